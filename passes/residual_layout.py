"""Keep a residual stream in its branches' channels-last layout: the Transposes move next to the
Convs, where onnxruntime's NCHWc layout absorbs them.

residual-channels-last
    match:     Add(r, Transpose(z, perm=[0, 3, 1, 2])): a branch computed channels-last (NHWC)
               and transposed back to NCHW to be added to the stream (ConvNeXt's blocks:
               depthwise Conv, permute, LayerNorm, Linear, GELU, Linear, permute, + x), the
               Transpose read by the Add only.
    rewrite:   Transpose(Add(r', z), perm=[0, 3, 1, 2]) writing the Add's output, where r' is
               r in NHWC: the input of r's Transpose when r is one with the same perm (the
               block before, once rewritten), else a new Transpose(r, perm=[0, 2, 3, 1]);
               repeated until no Add matches, so a whole stage's stream runs NHWC. A
               Transpose of a Transpose whose perms undo each other then reads their input
               (cancel-transposes).
    condition: the rewrite pays as a whole: onnxruntime (CPU, ORT_ENABLE_ALL) executes fewer
               nodes for the rewritten graph than for the original (asked with the weights
               of more than 65536 elements left out, as the pointwise pass asks) (the NHWC -> NCHW
               Transpose before each depthwise Conv becomes a channels-last ReorderInput,
               the NCHW -> NHWC one after a stage's downsampling Conv a channels-last
               ReorderOutput); otherwise the graph is left as it was.
Why: onnxruntime's transpose optimizer pushes such a Transpose through the Add only when the
stream is itself a Transpose's output, which holds in ConvNeXt's first stage (after the stem's
LayerNorm) and not after a downsampling Conv: 19 Transpose kernels in ConvNeXt-T, 3 once the
stream stays NHWC. With the stream NHWC the branch's bias Add and the residual Add are also
adjacent, so the pointwise pass runs them as one kernel.
"""
from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

from onnxfuse.fused import DOMAIN, DOMAIN_VERSION
from onnxfuse.graph import core as gu
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.ort_fusions import PROBE_ELEMENTS
from onnxfuse.graph.rules import Match, Rule, Var, apply, fail, op
from onnxfuse.graph.writer import NodeWriter
from onnxfuse.pipeline import Context, Pass

TO_NCHW = [0, 3, 1, 2]
TO_NHWC = [0, 2, 3, 1]

r, z, inner = Var("r"), Var("z"), Var("inner")
BRANCH_ADD = op.Add(r, op.Transpose(z, perm=lambda p: p is not None and list(p) == TO_NCHW, _name="branch"))
TRANSPOSE_PAIR = op.Transpose(op.Transpose(inner, _name="first"), _name="second", _outputs=1)


def _perm(node: gs.Node) -> list[int] | None:
    p = gu.attr(node, "perm")
    return None if p is None else [int(v) for v in p]


def _nhwc_of(graph: gs.Graph, stream: gs.Tensor) -> gs.Tensor:
    """`stream` (NCHW) as NHWC: the input of the Transpose that made it, or a new Transpose."""
    node = gu.producer(stream)
    if gu.is_op(node, "Transpose") and _perm(node) == TO_NCHW:
        return node.inputs[0]
    shape = gu.dims(stream)
    w = NodeWriter(graph)
    out = w.op("Transpose", stream, name=f"{stream.name}_to_nhwc", out=f"{stream.name}_nhwc",
               shape=None if shape is None else [shape[i] for i in TO_NHWC], attrs={"perm": TO_NHWC})
    graph.nodes.extend(w.nodes)
    return out


def _sink(graph: gs.Graph, m: Match) -> bool:
    add, branch = m.root, m["branch"]
    stream = m["r"]
    if gu.rank(stream) != 4 or gu.rank(m["z"]) != 4 or gu.is_constant(stream):
        return fail("the stream or the branch is not of known rank 4, or the stream is a constant")
    out = add.outputs[0]
    if gu.dims(stream) != gu.dims(out):  # the stream is not broadcast by the Add
        return fail("the Add broadcasts the stream (its dims are not the sum's)")
    nhwc = _nhwc_of(graph, stream)
    shape = gu.dims(out)
    w = NodeWriter(graph)
    summed = w.value(f"{out.name}_nhwc", out.dtype, None if shape is None else [shape[i] for i in TO_NHWC])
    add.inputs[0], add.inputs[1] = nhwc, m["z"]
    add.outputs[0] = summed
    # The branch's Transpose now turns the NHWC sum back into the stream's NCHW tensor.
    gu.disconnect(branch)
    w.op("Transpose", summed, name=f"{out.name}_to_nchw", out=out, attrs={"perm": TO_NCHW})
    graph.nodes.extend(w.nodes)
    return True


def _cancel(graph: gs.Graph, m: Match) -> bool:
    first, second = m["first"], m.root
    p, q = _perm(first), _perm(second)
    if p is None or q is None or len(p) != len(q) or [p[i] for i in q] != list(range(len(p))):
        return fail(f"the permutations {p} and {q} do not cancel")
    out = second.outputs[0]
    if gu.is_graph_output(graph, out):
        return fail("the second Transpose's output is a graph output")
    gu.replace_uses(out, m["inner"])
    gu.disconnect(second)
    return True


SINK = Rule("residual-channels-last/sink", BRANCH_ADD, _sink)
# The first Transpose may have other readers (the depthwise Conv of the next block).
CANCEL = Rule("residual-channels-last/cancel-transposes", TRANSPOSE_PAIR, _cancel, private=False)


def _executed_nodes(graph: gs.Graph, ctx: Context) -> int | None:
    """Nodes onnxruntime executes for `graph` (the context's executed_graph), weights of more
    than PROBE_ELEMENTS elements given as graph inputs so that asking costs a session over the
    structure, not a copy of the weights; None when onnxruntime cannot be asked."""

    try:
        model, _ = gu.export_model(graph, keep_elements=PROBE_ELEMENTS)
        model.ir_version = min(model.ir_version, 10)
        if any(n.domain == DOMAIN for n in model.graph.node) and not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
        return len(ctx.executed_graph(model).graph.node)
    except Exception:  # noqa: BLE001 - onnxruntime raises its own types; then nothing is rewritten
        return None


def _rewrite(graph: gs.Graph, explain=None) -> int:
    """Sink every branch Transpose past its residual Add, cancelling the pairs that meet;
    explain(node, reason) for each Add the first round leaves."""
    count = 0
    while True:
        done = apply(graph, [SINK], explain if not count else None)
        if not done:
            return count
        count += done
        apply(graph, [CANCEL])
        graph.cleanup()
        gu.toposort(graph)


def run(graph: gs.Graph, ctx: Context) -> int:
    if ctx.executed_graph is None or not any(gu.is_op(n, "Transpose") for n in graph.nodes):
        return 0
    refresh_shapes(graph)  # the condition reads ranks and dims
    if not any(gu.is_op(n, "Add") and SINK.match(graph, n) for n in graph.nodes):
        return 0
    # The rewrite is tried on a copy: onnxruntime's count for it decides whether the graph gets it.
    trial = graph.copy()
    if not _rewrite(trial, ctx.explainer):
        return 0
    before = _executed_nodes(graph, ctx)
    after = _executed_nodes(trial, ctx)
    if before is None or after is None or after >= before:
        if ctx.explainer is not None:
            why = "onnxruntime cannot be asked" if before is None or after is None else \
                f"onnxruntime would execute {after} nodes with it, not fewer than {before}"
            for n in graph.nodes:
                if gu.is_op(n, "Add") and SINK.match(graph, n):
                    ctx.reject(n, why)
        return 0
    return _rewrite(graph)


PASS = Pass(
    name="residual-channels-last",
    order=340,
    summary="a residual stream whose branches run NHWC kept NHWC, its Transposes next to the Convs (onnxruntime's NCHWc layout absorbs them)",
    run=run,
    targets=("cpu",),
)
