"""pointwise: maximal regions of elementwise ops become one onnxfuse.Pointwise kernel each.

match
    Connected regions of elementwise nodes (onnxfuse.lowering.SUPPORTED_OPS: arithmetic,
    activations, comparisons and logic, Where, Cast, Identity, inference Dropout, ...), grown
    from consumers to producers, together with the Slice/Split nodes they read. A Slice (constant
    starts/ends/axes/steps) or Split (constant sizes, or an equal split of a static dim) whose
    outputs are read only by fused regions is folded into a view: the region reads the
    Slice/Split input in place (``in x0 f32 view=1:128:256:1``). When the Split's input is itself
    computed by the region (the LSTM gates: Add, Split, Sigmoid...), the view is pushed through
    the elementwise producers onto their inputs, so the gate tensor is never stored.
condition
    - values of program dtypes only (f16, bf16, f32, f64, bool; integer values stay outside);
      known ranks;
    - every region output (a value read outside the region, or a graph output) has the
      iteration shape, the broadcast of the region inputs, statically (equal dims or equal
      symbolic names); a node that would break this is left out of the region;
    - no cycle: a region never feeds an outside node that feeds back into it;
    - the region pays: at least 2 ops that compute something, or 1 op and a Slice/Split that
      disappears, or 1 op that would otherwise go into a fusion of onnxruntime that is slower
      on the target (PREEMPT in onnxfuse/graph/ort_fusions.py: SkipLayerNormalization on the
      CPU) while the other regions save the kernel that costs; one op more for each op whose
      kernel is slower than onnxruntime's on the target (EXTRA_WORK: the CPU's correctly rounded
      Erf);
    - the target policy (POLICY in onnxfuse/graph/ort_fusions.py): ops that onnxruntime fuses
      into its own kernels (FusedConv, Gemm, LayerNormalization, Gelu...), or runs in place in
      its NCHWc layout, are left to it; the LayerNormalization and GELU rules only where the
      graph onnxruntime would execute shows the fusion (CONFIRMED, runtime_unfused).
Regions are formed in onnxfuse/regions.py; this module decides which pay and writes them.
rewrite
    one onnxfuse.Pointwise node per region, attribute ``program`` (onnxfuse.program), via
    ctx.fuse: its fallback function is the exact original subgraph, folded Slice/Split included.
    Constants whose elements are all equal become literals; other constants are node inputs.
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.ort_fusions import preempted_from_runtime, reserved_for_runtime
from onnxfuse.graph.index import GraphIndex
from onnxfuse.graph.patterns import VIEW_OPS
from onnxfuse.ops.pointwise import EXTRA_WORK, MIN_WORK, OP
from onnxfuse.pipeline import Context, Pass
from onnxfuse.regions import Analysis, Region, build_regions, work


def pays(a: Analysis, r: Region, fused: set[int], extra: dict[str, int]) -> bool:
    """At least two ops that compute, or one and a Slice/Split that disappears, or one that a
    slower fusion of onnxruntime would otherwise take (PREEMPT); `extra` more ops for each op of
    the region whose kernel is slower than onnxruntime's (EXTRA_WORK of the target's provider)."""
    if _copies_its_input(r):
        return False
    work_ops = work(r)
    needed = sum(extra.get(n.op, 0) for n in r.members.values())
    if needed and work_ops < MIN_WORK + needed:
        return False
    if work_ops >= MIN_WORK:
        return True
    if work_ops == 0:
        return False
    if _preempts(a, r):
        return True
    views = [n for n in r.members.values() if n.op in VIEW_OPS] + r.lowered.views_read
    for v in views:
        readers = [c for o in v.outputs for c in o.outputs]
        if all(id(c) in fused for c in readers) and not any(o.name in a.graph_outputs for o in v.outputs):
            return True
    return False


def _copies_its_input(r: Region) -> bool:
    """Whether the region's program computes nothing: no instruction, one input read whole, and
    every output that input in its own dtype (a Cast to the type a value already has, twice in
    LLaMA's `softmax(..., dtype=float32).to(q.dtype)` of a float32 model). Its kernel would only
    copy, where onnxruntime removes such Casts at load time and runs no kernel."""
    prog = r.lowered.program
    if prog.instrs or len(prog.inputs) != 1 or prog.inputs[0].view:
        return False
    x = prog.inputs[0]
    return all(o.name == x.name and o.dtype == x.dtype for o in prog.outputs)


def _preempts(a: Analysis, r: Region) -> bool:
    return any(id(n) in a.preempted for n in r.members.values())


def _within_kernel_budget(regions: list[Region], a: Analysis) -> list[Region]:
    """`regions` less the lone preempting ones the others cannot pay for. A region whose one
    op is there only to keep a slower fusion of onnxruntime from forming (the residual Add
    before a LayerNormalization) runs one kernel more than onnxruntime's fusion; a model must
    never run more kernels than onnxruntime alone, so such regions are kept only while the
    other regions save at least as many kernels (each saves its ops but one), in graph order."""
    lone = [r for r in regions if work(r) == 1 and _preempts(a, r)]
    saved = sum(work(r) - 1 for r in regions if not (work(r) == 1 and _preempts(a, r)))
    if len(lone) <= saved:
        return regions
    dropped = {id(r) for r in lone[saved:]}
    return [r for r in regions if id(r) not in dropped]


def _detached_copy(n: gs.Node) -> gs.Node:
    """A copy of `n` that is not wired into the graph: the fallback body of a fused node may
    hold a Slice/Split or Constant that stays in the graph for other readers."""

    def twin(t):
        if not gu.is_present(t):
            return gs.Variable.empty()
        if isinstance(t, gs.Constant):
            return gs.Constant(t.name, t.values)
        return gs.Variable(t.name, t.dtype, t.shape)

    return gs.Node(n.op, n.name, dict(n.attrs), [twin(t) for t in n.inputs], [twin(t) for t in n.outputs], domain=n.domain)


def run(graph: gs.Graph, ctx: Context) -> int:
    refresh_shapes(graph)
    gu.toposort(graph)
    index = GraphIndex(graph)
    reserved = reserved_for_runtime(index, ctx.target.name, ctx.executed_graph)
    a = Analysis(graph, reserved, preempted_from_runtime(index, ctx.target.name))
    regions = build_regions(a)
    # Decide which regions pay; a region whose only work is one op pays when a Slice/Split
    # it reads disappears, which needs every reader of that Slice/Split fused.
    chosen = [r for r in regions if work(r) >= 1]
    extra = EXTRA_WORK.get(ctx.target.provider, {})
    while True:
        fused = {k for r in chosen for k in r.members}
        keep = _within_kernel_budget([r for r in chosen if pays(a, r, fused, extra)], a)
        if len(keep) == len(chosen):
            break
        chosen = keep
    count = 0
    for r in sorted(chosen, key=lambda r: a.index[id(next(iter(r.members.values())))]):
        low = r.lowered
        body = [n for n in r.members.values() if n.op not in VIEW_OPS]
        extra = list(low.views_read) + [n for n in r.members.values() if n.op in VIEW_OPS] + low.constant_nodes
        nodes = sorted(body + extra, key=lambda n: a.index[id(n)])
        nodes = [_detached_copy(n) if any(n is e for e in extra) else n for n in nodes]
        ctx.fuse(graph, OP.name, nodes, low.inputs, low.outputs, {"program": low.program.to_text()})
        count += 1
    return count


PASS = Pass(
    name="pointwise",
    order=500,
    summary="fuse maximal regions of elementwise ops (Slice/Split read as views) into onnxfuse.Pointwise",
    run=run,
)
