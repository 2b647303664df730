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
      on the target (PREEMPT below: SkipLayerNormalization on the CPU);
    - the target policy (POLICY below): ops that onnxruntime fuses into its own kernels
      (FusedConv, Gemm, LayerNormalization, Gelu...), or runs in place in its NCHWc layout, are
      left to it; the LayerNormalization and GELU rules only where the graph onnxruntime would
      execute shows the fusion (CONFIRMED, runtime_unfused).
rewrite
    one onnxfuse.Pointwise node per region, attribute ``program`` (onnxfuse.program), via
    ctx.fuse: its fallback function is the exact original subgraph, folded Slice/Split included.
    Constants whose elements are all equal become literals; other constants are node inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxfuse import graphutil as gu
from onnxfuse.lowering import (
    NO_OPS,
    SUPPORTED_OPS,
    LoweringError,
    literal_value,
    lower_node,
    lowerable,
    program_dtype,
)
from onnxfuse.pipeline import Context, Pass
from onnxfuse.program import Program, SliceSpec, resolve_slice

# An end at least this large reaches past the end of any tensor that fits in memory.
_UNREACHABLE_END = 2**62
VIEW_OPS = ("Slice", "Split")


# ----------------------------------------------------------------------------- graph facts


def elem_type(t: gs.Tensor) -> int | None:
    """ONNX element type of a tensor (graphsurgeon keeps numpy dtypes, or the ONNX code for
    types numpy lacks, such as bfloat16)."""
    dt = t.dtype
    if dt is None:
        return None
    if isinstance(dt, (int, np.integer)):
        return int(dt)
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt))
    except Exception:  # exotic dtypes (ml_dtypes) onnx cannot map back
        return None


def refresh_shapes(graph: gs.Graph) -> None:
    """Run onnx shape inference on the current graph and record dtypes/shapes that the graph
    does not know yet (tensors made by earlier passes have none)."""
    from onnxfuse.modelio import infer_light_model

    if all(t.dtype is not None and t.shape is not None
           for t in gu.tensor_map(graph).values() if not isinstance(t, gs.Constant)):
        return  # nothing to fill in
    try:
        # Large weights are described by type and shape: inferring on them costs their copies.
        model, left_out = gu.inference_model(graph)
    except Exception:
        return
    model = infer_light_model(model, left_out) or model
    infos = {}
    for vi in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input):
        if vi.type.HasField("tensor_type"):
            infos[vi.name] = vi.type.tensor_type
    for name, t in gu.tensor_map(graph).items():
        if isinstance(t, gs.Constant) or name not in infos:
            continue
        tt = infos[name]
        if t.dtype is None and tt.elem_type:
            try:
                t.dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
            except Exception:
                t.dtype = tt.elem_type
        if t.shape is None and tt.HasField("shape"):
            t.shape = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param if d.dim_param else None)
                for d in tt.shape.dim
            ]


def _same_dim(a, b) -> bool:
    return a is not None and a == b


def broadcast_dims(shapes: Iterable[list]) -> list | None:
    """Static multidirectional broadcast of dims (ints, symbolic names, None for unknown).
    A result dim is None when it cannot be known before run time."""
    out: list = []
    for s in shapes:
        if len(s) > len(out):
            out = [1] * (len(s) - len(out)) + out
        s = [1] * (len(out) - len(s)) + list(s)
        merged = []
        for a, b in zip(out, s):
            if a == 1:
                merged.append(b)
            elif b == 1:
                merged.append(a)
            elif a is None or b is None:
                merged.append(None)
            elif a == b:
                merged.append(a)
            elif isinstance(a, int) and isinstance(b, int):
                return None  # not broadcastable: the graph is not valid
            elif isinstance(a, int):
                merged.append(a)  # the name must be that size (or 1)
            elif isinstance(b, int):
                merged.append(b)
            else:
                merged.append(None)
        out = merged
    return out


def fits(shape: Iterable, target: list) -> bool:
    """True when broadcasting `shape` against `target` leaves `target` unchanged."""
    shape = list(shape)
    if len(shape) > len(target):
        return False
    for a, b in zip(reversed(shape), reversed(target)):
        if a != 1 and not _same_dim(a, b):
            return False
    return True


def view_dims(d: list, view: tuple[SliceSpec, ...]) -> list:
    d = list(d)
    for s in view:
        dim = d[s.axis]
        if isinstance(dim, int):
            d[s.axis] = resolve_slice(dim, s)[2]
        elif not (s.start == 0 and s.step == 1 and s.end >= _UNREACHABLE_END):
            d[s.axis] = None
    return d


# ----------------------------------------------------------------------------- views


def slice_specs(node: gs.Node, opset: int) -> tuple[SliceSpec, ...] | None:
    """The view a Slice node takes of its input (axes made non-negative), None if not constant."""
    rank = len(node.inputs[0].shape) if node.inputs[0].shape is not None else None
    if rank is None:
        return None
    if opset < 10:
        starts, ends = node.attrs.get("starts"), node.attrs.get("ends")
        axes, steps = node.attrs.get("axes"), None
        if starts is None or ends is None:
            return None
        starts, ends = list(starts), list(ends)
        axes = list(axes) if axes is not None else None
    else:
        ins = node.inputs
        starts, ends = gu.constant_ints(ins[1]), gu.constant_ints(ins[2])
        axes = gu.constant_ints(ins[3]) if len(ins) > 3 and gu.is_present(ins[3]) else None
        steps = gu.constant_ints(ins[4]) if len(ins) > 4 and gu.is_present(ins[4]) else None
        if starts is None or ends is None:
            return None
        if len(ins) > 3 and gu.is_present(ins[3]) and axes is None:
            return None
        if len(ins) > 4 and gu.is_present(ins[4]) and steps is None:
            return None
    if axes is None:
        axes = list(range(len(starts)))
    if steps is None:
        steps = [1] * len(starts)
    if not (len(starts) == len(ends) == len(axes) == len(steps)):
        return None
    specs = []
    for a, s, e, st in zip(axes, starts, ends, steps):
        a = a + rank if a < 0 else a
        if not 0 <= a < rank or st == 0:
            return None
        specs.append(SliceSpec(a, int(s), int(e), int(st)))
    if len({s.axis for s in specs}) != len(specs):
        return None
    return tuple(sorted(specs, key=lambda s: s.axis))


def split_specs(node: gs.Node, opset: int) -> list[tuple[SliceSpec, ...]] | None:
    """One view per Split output, None when the piece sizes are not known statically."""
    data = node.inputs[0]
    if data.shape is None:
        return None
    rank = len(data.shape)
    axis = int(node.attrs.get("axis", 0))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        return None
    n = len(node.outputs)
    sizes = None
    if opset >= 13:
        if len(node.inputs) > 1 and gu.is_present(node.inputs[1]):
            sizes = gu.constant_ints(node.inputs[1])
            if sizes is None:
                return None
    elif node.attrs.get("split") is not None:
        sizes = [int(v) for v in node.attrs["split"]]
    if sizes is None:
        dim = gu.dims(data)[axis]
        if not isinstance(dim, int):
            return None
        if opset >= 18 and "num_outputs" in node.attrs:
            chunk = -(-dim // n)
            sizes = [min(chunk, max(0, dim - chunk * i)) for i in range(n)]
        else:
            if dim % n:
                return None
            sizes = [dim // n] * n
    if len(sizes) != n:
        return None
    views, start = [], 0
    for s in sizes:
        views.append((SliceSpec(axis, start, start + s, 1),))
        start += s
    return views


def compose(outer: tuple[SliceSpec, ...], inner: tuple[SliceSpec, ...]) -> tuple[SliceSpec, ...] | None:
    """The view `outer` of (the view `inner` of x), as one view of x; None when both slice one axis."""
    if {s.axis for s in outer} & {s.axis for s in inner}:
        return None
    return tuple(sorted(outer + inner, key=lambda s: s.axis))


# ----------------------------------------------------------------------------- regions


@dataclass
class Lowered:
    program: Program
    inputs: list[gs.Tensor]
    outputs: list[gs.Variable]
    views_read: list[gs.Node]  # Slice/Split nodes outside the region read through views
    constant_nodes: list[gs.Node]  # Constant nodes whose outputs the body reads


@dataclass
class Region:
    members: dict[int, gs.Node] = field(default_factory=dict)
    lowered: Lowered | None = None


class Analysis:
    """Everything the region builder needs about the graph, indexed by node identity."""

    def __init__(self, graph: gs.Graph, ctx: Context):
        self.graph = graph
        self.ctx = ctx
        self.opset = graph.opset
        self.nodes = list(graph.nodes)
        self.index = {id(n): i for i, n in enumerate(self.nodes)}
        self.graph_outputs = {t.name for t in graph.outputs}
        # A node inside an If/Loop/Scan body that reads a top-level value (outer-scope reference)
        # makes the If/Loop/Scan node itself a consumer of that value.
        owner: dict[int, gs.Node] = {}
        for n in self.nodes:
            for sub in _subgraphs(n):
                for inner in _all_nodes(sub):
                    owner[id(inner)] = n
        self.consumers: dict[int, list[gs.Node]] = {}
        for n in self.nodes:
            seen: dict[int, gs.Node] = {}
            for t in n.outputs:
                for c in t.outputs:
                    c = owner.get(id(c), c)
                    if id(c) in self.index:
                        seen[id(c)] = c
            self.consumers[id(n)] = list(seen.values())
        self.reserved = reserved_for_runtime(graph, ctx.target, self)
        self.preempted = preempted_from_runtime(ctx.target, self)
        self.views: dict[int, list[tuple[SliceSpec, ...]]] = {}
        self.pointwise: set[int] = set()
        for n in self.nodes:
            if not gu.is_default_domain(n):
                continue
            if n.op in VIEW_OPS:
                v = self._view_of(n)
                if v is not None:
                    self.views[id(n)] = v
            elif n.op in SUPPORTED_OPS and id(n) not in self.reserved and self._lowerable(n):
                self.pointwise.add(id(n))

    def _view_of(self, n: gs.Node):
        if elem_type(n.inputs[0]) not in (1, 10, 11, 16, 9):
            return None
        if n.op == "Slice":
            s = slice_specs(n, self.opset)
            return None if s is None else [s]
        return split_specs(n, self.opset)

    def is_used(self, t: gs.Tensor) -> bool:
        return bool(t.outputs) or t.name in self.graph_outputs

    def _lowerable(self, n: gs.Node) -> bool:
        ins = [t if gu.is_present(t) else None for t in n.inputs]
        in_types = [elem_type(t) if t is not None else None for t in ins]
        consts = [gu.constant_value(t) if t is not None else None for t in ins]
        out_types = [elem_type(t) if gu.is_present(t) else None for t in n.outputs]
        used = [gu.is_present(t) and self.is_used(t) for t in n.outputs]
        if any(t is not None and t.shape is None for t in ins):
            return False
        if any(u and t.shape is None for t, u in zip(n.outputs, used)):
            return False
        return lowerable(n.op, dict(n.attrs), self.opset, in_types, out_types, consts, used) is None

    def producer(self, t: gs.Tensor) -> gs.Node | None:
        p = gu.producer(t)
        return p if p is not None and id(p) in self.index else None


def _subgraphs(n: gs.Node) -> list[gs.Graph]:
    subs = []
    for v in n.attrs.values():
        subs += [v] if isinstance(v, gs.Graph) else [g for g in v if isinstance(g, gs.Graph)] if isinstance(v, list) else []
    return subs


def _all_nodes(g: gs.Graph) -> list[gs.Node]:
    out = []
    for n in g.nodes:
        out.append(n)
        for sub in _subgraphs(n):
            out += _all_nodes(sub)
    return out


def lower_region(a: Analysis, members: dict[int, gs.Node]) -> Lowered:
    """The program of a region; LoweringError when the region is not valid.

    A constant whose elements are all equal is a literal unless its shape would grow the
    iteration shape (the broadcast of the other inputs): then it is an input after all.
    A Slice/Split outside the region is read through views unless the region also reads one
    of its outputs as a stored tensor (the two views could not be composed): the fallback body
    would then both compute that output and receive it as an input."""
    forced: set[tuple] = set()
    no_view: set[int] = set()
    while True:
        lowered, grows, stored = _lower_region_once(a, members, forced, no_view)
        if not grows and not stored:
            return lowered
        forced |= grows
        no_view |= stored


def _lower_region_once(
    a: Analysis, members: dict[int, gs.Node], forced: set[tuple], no_view: set[int]
) -> tuple[Lowered | None, set[tuple], set[int]]:
    outputs: list[gs.Variable] = []
    for n in sorted(members.values(), key=lambda n: a.index[id(n)]):
        for t in n.outputs:
            if not gu.is_present(t):
                continue
            outside = any(id(c) not in members for c in t.outputs) or t.name in a.graph_outputs
            if outside:
                outputs.append(t)
    if not outputs:
        raise LoweringError("region has no output")
    out_dims = [gu.dims(t) for t in outputs]
    if any(d is None for d in out_dims):
        raise LoweringError("output of unknown rank")
    target = out_dims[0]

    prog = Program()
    inputs: list[gs.Tensor] = []
    input_index: dict[tuple, str] = {}
    input_dims: list[list] = []
    memo: dict[tuple, object] = {}
    views_read: dict[int, gs.Node] = {}
    constant_nodes: dict[int, gs.Node] = {}
    literals: list[tuple[tuple, tuple]] = []  # (key, shape) of constants made literals

    def new_input(t: gs.Tensor, view: tuple) -> str:
        key = (t.name, view)
        if key in input_index:
            return input_index[key]
        d = gu.dims(t)
        dt = program_dtype(elem_type(t))
        if d is None or dt is None:
            raise LoweringError(f"input {t.name} has no program dtype or no known rank")
        name = prog.add_input(dt, view)
        input_index[key] = name
        inputs.append(t)
        input_dims.append(view_dims(d, view))
        return name

    def map_view(view: tuple, out: gs.Tensor, inp: gs.Tensor) -> tuple:
        """The view of `inp` that an elementwise op reads to produce the view `view` of `out`."""
        if not view:
            return ()
        od, idims = gu.dims(out), gu.dims(inp)
        if od is None or idims is None:
            raise LoweringError("view through a value of unknown rank")
        specs = []
        for s in view:
            ia = s.axis - (len(od) - len(idims))
            if ia < 0:
                continue
            if idims[ia] == 1 and od[s.axis] != 1:
                continue  # broadcast along the sliced axis: every piece reads the same values
            if not _same_dim(idims[ia], od[s.axis]):
                raise LoweringError("view through a broadcast of unknown size")
            specs.append(SliceSpec(ia, s.start, s.end, s.step))
        return tuple(specs)

    def operand(t: gs.Tensor, view: tuple):
        key = (t.name, view)
        if key in memo:
            return memo[key]
        const = gu.constant_value(t)
        if const is not None:
            p = a.producer(t)
            if p is not None:
                constant_nodes[id(p)] = p
            arr = np.asarray(const)
            if view:
                from onnxfuse.program import apply_view

                arr = apply_view(arr, view)
            lit = literal_value(arr)
            if lit is not None and key not in forced and fits(arr.shape, target):
                literals.append((key, arr.shape))
                memo[key] = lit
                return lit
            memo[key] = new_input(t, view)
            return memo[key]
        p = a.producer(t)
        if p is not None and id(p) in members:
            if p.op in VIEW_OPS:
                k = next(i for i, o in enumerate(p.outputs) if o is t)
                combined = compose(view, a.views[id(p)][k if p.op == "Split" else 0])
                if combined is None:
                    raise LoweringError("two slices of one axis")
                res = operand(p.inputs[0], combined)
            else:
                args = []
                for inp in p.inputs:
                    args.append(operand(inp, map_view(view, t, inp)) if gu.is_present(inp) else None)
                ins = [x if gu.is_present(x) else None for x in p.inputs]
                outs = lower_node(
                    prog, p.op, dict(p.attrs), a.opset, args,
                    [elem_type(x) if x is not None else None for x in ins],
                    [elem_type(x) if gu.is_present(x) else None for x in p.outputs],
                )
                for o, v in zip(p.outputs, outs):
                    if gu.is_present(o):
                        memo[(o.name, view)] = v
                res = memo.get(key)
                if res is None:
                    raise LoweringError("value without a program result")
            memo[key] = res
            return res
        if p is not None and id(p) in a.views and id(p) not in no_view:
            src = p.inputs[0]
            src_p = a.producer(src)
            if src_p is None or id(src_p) not in members:
                k = next(i for i, o in enumerate(p.outputs) if o is t)
                combined = compose(view, a.views[id(p)][k if p.op == "Split" else 0])
                if combined is not None and gu.constant_value(src) is None:
                    views_read[id(p)] = p
                    memo[key] = new_input(src, combined)
                    return memo[key]
        memo[key] = new_input(t, view)
        return memo[key]

    values = [operand(t, ()) for t in outputs]
    if not inputs:
        raise LoweringError("region reads no tensor")
    shape = broadcast_dims(input_dims)
    if shape is None:
        raise LoweringError("inputs do not broadcast")
    grows = {key for key, lit_shape in literals if not fits(lit_shape, shape)}
    given = {t.name for t in inputs}
    stored = {id(v) for v in views_read.values() if any(o.name in given for o in v.outputs)}
    if grows or stored:
        return None, grows, stored
    for t, d in zip(outputs, out_dims):
        if len(d) != len(shape) or not all(_same_dim(x, y) for x, y in zip(d, shape)):
            raise LoweringError(f"output {t.name} does not have the iteration shape")
    for t, v in zip(outputs, values):
        dt = program_dtype(elem_type(t))
        if dt is None:
            raise LoweringError("output outside the program dtypes")
        if isinstance(v, float):
            v = prog.emit("add", v, 0.0)  # a constant output still needs a stored value
        prog.add_output(v, dt)
    # The fallback body must be closed: everything its nodes read is an input, a constant or
    # made inside it.
    made = {o.name for n in members.values() for o in n.outputs}
    made |= {o.name for n in views_read.values() for o in n.outputs}
    for n in list(members.values()) + list(views_read.values()):
        for t in n.inputs:
            if gu.is_present(t) and t.name not in made and t.name not in given and gu.constant_value(t) is None:
                raise LoweringError(f"the region reads {t.name} outside its program")
    # A Constant node whose value is a node input is read through that input instead.
    body_constants = [n for n in constant_nodes.values() if n.outputs[0].name not in given]
    return Lowered(prog, inputs, outputs, list(views_read.values()), body_constants), set(), set()


def _creates_cycle(a: Analysis, members: dict[int, gs.Node], region_of: dict[int, Region]) -> bool:
    """True when a path leaves `members` and comes back (regions count as single nodes)."""
    stack: list[gs.Node] = []
    for n in members.values():
        stack.extend(c for c in a.consumers[id(n)] if id(c) not in members)
    seen: set[int] = set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        r = region_of.get(id(n))
        group = list(r.members.values()) if r is not None else [n]
        for g in group:
            seen.add(id(g))
            for c in a.consumers[id(g)]:
                if id(c) in members:
                    return True
                if id(c) not in seen:
                    stack.append(c)
    return False


def build_regions(a: Analysis) -> list[Region]:
    """Grow regions from consumers to producers (reverse topological order)."""
    region_of: dict[int, Region] = {}
    regions: list[Region] = []

    def attempt(n: gs.Node, joined: list[Region]) -> Region | None:
        members = {id(n): n}
        for r in joined:
            members.update(r.members)
        if len(joined) > 0 and _creates_cycle(a, members, {k: v for k, v in region_of.items() if k not in members}):
            return None
        try:
            lowered = lower_region(a, members)
        except LoweringError:
            return None
        return Region(members, lowered)

    for n in reversed(a.nodes):
        nid = id(n)
        is_view = nid in a.views
        if nid not in a.pointwise and not is_view:
            continue
        cons = a.consumers[nid]
        by_region: dict[int, Region] = {}
        for c in cons:
            r = region_of.get(id(c))
            if r is not None:
                by_region[id(r)] = r
        outside = [c for c in cons if id(c) not in region_of]
        candidates: list[list[Region]] = []
        if is_view:
            # A Slice/Split joins a region only when that region reads all of it.
            if len(by_region) == 1 and not outside and not any(
                o.name in a.graph_outputs for o in n.outputs
            ):
                candidates.append(list(by_region.values()))
        else:
            regs = list(by_region.values())
            if len(regs) > 1:
                candidates.append(regs)
            for r in sorted(regs, key=lambda r: -sum(id(c) in r.members for c in cons)):
                candidates.append([r])
            candidates.append([])
        for joined in candidates:
            new = attempt(n, joined)
            if new is None:
                continue
            regions[:] = [r for r in regions if not any(r is j for j in joined)]
            regions.append(new)
            for k in new.members:
                region_of[k] = new
            break
    return regions


def _work(r: Region) -> int:
    return sum(1 for n in r.members.values() if n.op not in NO_OPS and n.op not in VIEW_OPS)


def pays(a: Analysis, r: Region, fused: set[int]) -> bool:
    """At least two ops that compute, or one and a Slice/Split that disappears, or one that a
    slower fusion of onnxruntime would otherwise take (PREEMPT)."""
    work = _work(r)
    if work >= 2:
        return True
    if work == 0:
        return False
    if any(id(n) in a.preempted for n in r.members.values()):
        return True
    views = [n for n in r.members.values() if n.op in VIEW_OPS] + r.lowered.views_read
    for v in views:
        readers = [c for o in v.outputs for c in o.outputs]
        if all(id(c) in fused for c in readers) and not any(o.name in a.graph_outputs for o in v.outputs):
            return True
    return False


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
    a = Analysis(graph, ctx)
    regions = build_regions(a)
    # Decide which regions pay; a region whose only work is one op pays when a Slice/Split
    # it reads disappears, which needs every reader of that Slice/Split fused.
    chosen = [r for r in regions if _work(r) >= 1]
    while True:
        fused = {k for r in chosen for k in r.members}
        keep = [r for r in chosen if pays(a, r, fused)]
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
        node = ctx.fuse(graph, "Pointwise", nodes, low.inputs, low.outputs, {"program": low.program.to_text()})
        count += 1
    return count


# ----------------------------------------------------------------------------- policy
#
# onnxruntime (ORT_ENABLE_ALL, applied after our passes) fuses some elementwise ops into its
# own kernels. A Pointwise region that swallowed them would leave ORT's kernel unfused, one
# more kernel per pattern and a slower one: those ops are reserved for onnxruntime. Each rule
# below was checked on onnxruntime 1.31 (CPU provider): the pattern alone runs as the named
# single kernel (tests/test_pass_pointwise.py::test_cpu_policy_patterns_are_fused_by_onnxruntime).


@dataclass(frozen=True)
class Rule:
    """Ops left to one of onnxruntime's fusions: `match` yields the nodes to leave alone."""

    name: str
    fused_into: str
    match: Callable[["Analysis"], Iterable[gs.Node]]


def matched_nodes(rules: Iterable[Rule], a: "Analysis") -> dict[int, str]:
    """id(node) -> the name of the first of `rules` whose match yields it."""
    matched: dict[int, str] = {}
    for rule in rules:
        for n in rule.match(a):
            matched.setdefault(id(n), rule.name)
    return matched


def reserved_for_runtime(graph: gs.Graph, target: str, a: "Analysis") -> dict[int, str]:
    """Nodes left to onnxruntime's own fusions on `target`: id(node) -> the rule's name.

    A rule describes a pattern; whether onnxruntime fuses a given instance depends on details a
    rule does not repeat (onnxruntime 1.31 fuses no FastGelu whose result is a graph output, and
    none with the cube written x * x * x). Where the rule's fusion removes the nodes it takes
    (CONFIRMED), the graph onnxruntime would execute is consulted: a node it still runs as it is
    was not fused, and is not left to it."""
    reserved = matched_nodes(POLICY.get(target, ()), a)
    confirmed = CONFIRMED.get(target, frozenset())
    if any(name in confirmed for name in reserved.values()):
        unfused = runtime_unfused(graph)
        if unfused is not None:
            reserved = {k: name for k, name in reserved.items() if name not in confirmed or k not in unfused}
    return reserved


PROBE_NAME = "onnxfuse_probe_"
PROBE_ELEMENTS = 1 << 16


def runtime_unfused(graph: gs.Graph) -> set[int] | None:
    """id() of the top-level nodes that onnxruntime (CPU provider, ORT_ENABLE_ALL, our library
    registered) runs as they are: the same name, domain and op type in the graph it executes,
    every node named for the probe by its position. Weights of more than PROBE_ELEMENTS
    elements go in as graph inputs of their shape, so that asking costs a session over the
    graph's structure (GPT-2 small's 650 MB are not copied); the CONFIRMED fusions look at
    scalar constants and per-channel parameters only. None when onnxruntime cannot be asked
    (the graph does not export or load): the rules then stand alone."""
    from onnxfuse import runtime
    from onnxfuse.fused import DOMAIN, DOMAIN_VERSION

    nodes = list(graph.nodes)
    try:
        model, _ = gu.export_model(graph, keep_elements=PROBE_ELEMENTS)
        if len(model.graph.node) != len(nodes):
            return None
        model.ir_version = 10
        for i, node in enumerate(model.graph.node):
            node.name = f"{PROBE_NAME}{i}"
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
        executed = runtime.executed_graph(model)
    except Exception:  # noqa: BLE001 - onnxruntime raises its own types; the rules stand alone
        return None
    kept = {(n.name, n.domain or "", n.op_type) for n in executed.graph.node}
    return {id(n) for i, n in enumerate(nodes)
            if (f"{PROBE_NAME}{i}", model.graph.node[i].domain or "", model.graph.node[i].op_type) in kept}


def _reader(a: "Analysis", t: gs.Tensor) -> gs.Node | None:
    """The only node reading `t` (None when several, none, or when `t` is a graph output)."""
    if t.name in a.graph_outputs or len(t.outputs) != 1:
        return None
    return t.outputs[0]


def _std(n: gs.Node | None, *ops: str) -> bool:
    return n is not None and gu.is_op(n, *ops)


def _scalar_const(t: gs.Tensor) -> float | None:
    v = gu.constant_value(t) if gu.is_present(t) else None
    if v is None or np.asarray(v).size != 1:
        return None
    return float(np.asarray(v).reshape(-1)[0])


def _other(n: gs.Node, t: gs.Tensor) -> gs.Tensor | None:
    """The other operand of a binary node that reads `t`."""
    if len(n.inputs) != 2:
        return None
    if n.inputs[0] is t:
        return n.inputs[1]
    if n.inputs[1] is t:
        return n.inputs[0]
    return None


def _rank(t: gs.Tensor) -> int | None:
    d = gu.dims(t)
    return None if d is None else len(d)


_FUSED_CONV_ACTIVATIONS = ("Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "HardSigmoid")
_FUSED_GEMM_ACTIVATIONS = ("Relu", "Sigmoid", "Tanh", "LeakyRelu", "HardSigmoid")


def match_conv_activation(a: "Analysis") -> Iterable[gs.Node]:
    """Conv -> Relu|Clip|Sigmoid|Tanh|LeakyRelu|HardSigmoid becomes FusedConv (the activation
    runs inside the convolution's output loop), and Conv -> Add|Sum (a residual) -> activation
    becomes one NCHWc convolution with a sum input when onnxruntime's NCHWc layout takes the
    convolution (group 1, output channels a multiple of 8): resnet50 runs 59 kernels per
    inference with them left to onnxruntime, 111 with them in Pointwise regions, which also
    need NCHWc reorders around them. Grouped convolutions (shufflenet) stay in NCHW: there
    the residual Sum + Relu is a region (0.74x latency)."""
    for n in a.nodes:
        if not _std(n, "Conv"):
            continue
        r = _reader(a, n.outputs[0])
        w = gu.dims(n.inputs[1]) if len(n.inputs) > 1 else None
        nchwc = int(n.attrs.get("group", 1)) == 1 and w is not None and isinstance(w[0], int) and w[0] % 8 == 0
        if nchwc and _std(r, "Add", "Sum") and len(r.inputs) == 2:
            yield r
            r = _reader(a, r.outputs[0])
        if _std(r, *_FUSED_CONV_ACTIVATIONS):
            yield r


# onnxruntime's NCHWc layout (CPU, x86): convolutions run on channel-blocked tensors, and these
# elementwise ops run on the blocked tensors in place, with no ReorderOutput / ReorderInput around
# them, when every activation they read is blocked (binary ones: two blocked tensors of one
# shape; Add and Sum even fold into the convolution as its sum input). Checked on onnxruntime
# 1.31: LeakyRelu, Clip, Elu, Exp, Neg, Abs, Softplus, Sub, Div, Max and ops with a broadcast
# constant are not among them (they get reorders). Pools of a blocked tensor stay blocked.
_NCHWC_UNARY = ("Relu", "Sigmoid", "Tanh", "HardSigmoid")
_NCHWC_BINARY = ("Add", "Sum", "Mul")
_NCHWC_POOLS = ("MaxPool", "AveragePool", "GlobalMaxPool", "GlobalAveragePool")
# MLAS's NCHWc block is 8 floats with AVX2 and 16 with AVX-512: 8 also holds for 16-wide
# blocks only where channels are multiples of 16, so a 24-channel layer on an AVX-512 machine
# is (wrongly) taken as blocked; that only leaves an op to onnxruntime that could have fused.
_NCHWC_BLOCK = 8


def nchwc_conv(n: gs.Node) -> bool:
    """Whether onnxruntime's NCHWc layout takes this Conv: 2-D with constant weights, output
    channels a multiple of the block, and either group 1 (input channels a multiple of the
    block, or fewer than one block: the first layer reads NCHW) or depthwise."""
    if not _std(n, "Conv") or len(n.inputs) < 2 or not isinstance(n.inputs[1], gs.Constant):
        return False
    w = gu.dims(n.inputs[1])
    if w is None or len(w) != 4 or not all(isinstance(d, int) for d in w):
        return False
    cout, cin_per_group = w[0], w[1]
    group = int(n.attrs.get("group", 1))
    if cout % _NCHWC_BLOCK:
        return False
    if group == 1:
        return cin_per_group % _NCHWC_BLOCK == 0 or cin_per_group < _NCHWC_BLOCK
    return cin_per_group == 1 and group == cout


def match_nchwc_elementwise(a: "Analysis") -> Iterable[gs.Node]:
    """Elementwise ops that onnxruntime runs in its NCHWc layout between convolutions. In a
    Pointwise region they would need a ReorderOutput before and a ReorderInput after: MobileNetV3's
    x * HardSigmoid(x) ran as 3 kernels per block that way, against onnxruntime's 2 in place."""
    blocked: set[int] = set()
    for n in a.nodes:  # topological order
        acts = [t for t in n.inputs if gu.is_present(t) and not isinstance(t, gs.Constant)]
        if nchwc_conv(n):
            blocked.update(id(t) for t in n.outputs)
            continue
        if _std(n, *_NCHWC_UNARY) or _std(n, *_NCHWC_POOLS):
            keep = len(acts) == 1 and id(acts[0]) in blocked
        elif _std(n, *_NCHWC_BINARY):
            keep = (len(n.inputs) == 2 == len(acts) and all(id(t) in blocked for t in acts)
                    and gu.dims(acts[0]) is not None and gu.dims(acts[0]) == gu.dims(acts[1]))
        else:
            continue
        if keep:
            blocked.update(id(t) for t in n.outputs)
            if not _std(n, *_NCHWC_POOLS):
                yield n


def match_matmul_gemm(a: "Analysis") -> Iterable[gs.Node]:
    """MatMul of two 2-D operands -> Add becomes Gemm (the addend is Gemm's C, added for free),
    and Gemm -> Relu|Sigmoid|Tanh|LeakyRelu|HardSigmoid becomes FusedGemm. Rank-3 MatMuls are
    not turned into a Gemm when a dim is symbolic, and only with two extra Reshape kernels when
    all are static: those Adds are better in a region."""
    for n in a.nodes:
        gemm_out = None
        if _std(n, "MatMul") and _rank(n.inputs[0]) == 2 and _rank(n.inputs[1]) == 2:
            add = _reader(a, n.outputs[0])
            if _std(add, "Add"):
                other = _other(add, n.outputs[0])
                # An addend cut from a larger tensor (Slice/Split) is read in place by a region;
                # as Gemm's C it would have to be copied out first: leave that Add to the region.
                if (other is not None and _rank(other) is not None and _rank(other) <= 2
                        and not _std(gu.producer(other), *VIEW_OPS)):
                    yield add
                    gemm_out = add.outputs[0]
        elif _std(n, "Gemm"):
            gemm_out = n.outputs[0]
        if gemm_out is not None:
            act = _reader(a, gemm_out)
            if _std(act, *_FUSED_GEMM_ACTIVATIONS):
                yield act


def match_matmul_scale(a: "Analysis") -> Iterable[gs.Node]:
    """Mul or Div by a scalar constant on a MatMul's input or output becomes FusedMatMul's alpha."""
    for n in a.nodes:
        if not _std(n, "Mul", "Div"):
            continue
        for i, t in enumerate(n.inputs):
            other = n.inputs[1 - i] if len(n.inputs) == 2 else None
            if other is None or _scalar_const(other) is None or (n.op == "Div" and i == 1):
                continue
            if _std(a.producer(t), "MatMul") and _reader(a, t) is n:
                yield n
            elif _std(_reader(a, n.outputs[0]), "MatMul"):
                yield n


def match_skip_layernorm(a: "Analysis") -> Iterable[gs.Node]:
    """Add -> LayerNormalization (the sum read by nothing else; or by the written-out
    LayerNormalization that onnxruntime first fuses, its mean and its Sub) becomes
    SkipLayerNormalization, a bias Add before it included."""
    written_out = {id(n) for n in match_layernorm(a)}
    for n in a.nodes:
        if not _std(n, "Add"):
            continue
        readers = [] if n.outputs[0].name in a.graph_outputs else list(n.outputs[0].outputs)
        one_ln = len(readers) == 1 and _std(readers[0], "LayerNormalization")
        subs = [r for r in readers if _std(r, "Sub") and id(r) in written_out and r.inputs[0] is n.outputs[0]]
        means = [r for r in readers if _std(r, "ReduceMean")]
        written = (len(readers) == 2 and len(subs) == 1 and len(means) == 1
                   and a.producer(subs[0].inputs[1]) is means[0])
        if not (one_ln or written):
            continue
        yield n
        for t in n.inputs:
            p = a.producer(t)
            if _std(p, "Add") and _reader(a, t) is n and any(gu.constant_value(x) is not None for x in p.inputs):
                yield p


def _forward_chain(a: "Analysis", t: gs.Tensor, ops: tuple[str, ...], limit: int) -> list[gs.Node]:
    """Nodes of `ops` following `t` one reader at a time (at most `limit`)."""
    out = []
    while len(out) < limit:
        r = _reader(a, t)
        if not _std(r, *ops):
            break
        out.append(r)
        t = r.outputs[0]
    return out


def match_layernorm(a: "Analysis") -> Iterable[gs.Node]:
    """The written-out LayerNormalization (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul,
    Add) and RMS norm (Pow, ReduceMean, Add, Sqrt, Div|Reciprocal+Mul, Mul) become
    LayerNormalization / SimplifiedLayerNormalization."""
    for var in a.nodes:
        if not _std(var, "ReduceMean"):
            continue
        sq = a.producer(var.inputs[0])
        if not _std(sq, "Pow", "Mul") or _reader(a, var.inputs[0]) is not var:
            continue
        if sq.op == "Pow" and _scalar_const(sq.inputs[1]) != 2.0:
            continue
        if sq.op == "Mul" and sq.inputs[0] is not sq.inputs[1]:
            continue
        centred = sq.inputs[0]
        sub = a.producer(centred)
        # statistic chain (Add eps, Sqrt, Reciprocal) up to the op that also reads the input
        chain, norm, t = [], None, var.outputs[0]
        for _ in range(4):
            r = _reader(a, t)
            if not _std(r, "Add", "Sqrt", "Reciprocal", "Div", "Mul"):
                break
            if any(x is centred for x in r.inputs):
                norm = r
                break
            chain.append(r)
            t = r.outputs[0]
        if norm is None:
            continue
        yield sq
        yield from chain
        yield norm
        if _std(sub, "Sub") and _std(a.producer(sub.inputs[1]), "ReduceMean"):
            yield sub
        yield from _forward_chain(a, norm.outputs[0], ("Mul", "Add"), 2)


def _bias_add(a: "Analysis", x: gs.Tensor, pattern_readers: int) -> gs.Node | None:
    """The Add of a constant bias that computes `x`, when only the pattern reads `x`."""
    p = a.producer(x)
    if not _std(p, "Add") or x.name in a.graph_outputs or len(x.outputs) != pattern_readers:
        return None
    if any(gu.constant_value(t) is not None and _rank(t) == 1 for t in p.inputs):
        return p
    return None


def _cube_source(a: "Analysis", n: gs.Node) -> gs.Tensor | None:
    """x when `n` computes x^3 as Pow(x, 3) or x * (x * x)."""
    if _std(n, "Pow") and _scalar_const(n.inputs[1]) == 3.0:
        return n.inputs[0]
    if _std(n, "Mul"):
        for i in (0, 1):
            sq = a.producer(n.inputs[i])
            x = n.inputs[1 - i]
            if _std(sq, "Mul") and sq.inputs[0] is x and sq.inputs[1] is x:
                return x
    return None


def match_gelu(a: "Analysis") -> Iterable[gs.Node]:
    """GELU written out with Erf (Gelu, BiasGelu with a bias Add before it), with Tanh and x^3
    (FastGelu, bias included), and x * Sigmoid(alpha * x) (QuickGelu; SiLU is alpha 1)."""
    for n in a.nodes:
        if _std(n, "Erf"):
            scale = a.producer(n.inputs[0])
            if not _std(scale, "Div", "Mul") or _scalar_const(scale.inputs[1]) is None:
                continue
            x = scale.inputs[0]
            tail = _forward_chain(a, n.outputs[0], ("Add", "Mul"), 3)
            side = [c for c in x.outputs if _std(c, "Mul") and c is not scale and c not in tail]
            group = [scale, n] + tail + [c for c in side if _scalar_const(_other(c, x) or x) is not None]
            yield from group
            bias = _bias_add(a, x, sum(1 for c in x.outputs if any(c is g for g in group)))
            if bias is not None:
                yield bias
        elif _cube_source(a, n) is not None:
            # x^3 -> * 0.044715 -> + x -> * sqrt(2/pi) -> Tanh -> + 1 -> * x -> * 0.5
            x = _cube_source(a, n)
            chain = _forward_chain(a, n.outputs[0], ("Mul", "Add", "Div"), 3)
            t = chain[-1].outputs[0] if chain else n.outputs[0]
            tanh = _reader(a, t)
            if not _std(tanh, "Tanh"):
                continue
            yield from [p for p in (a.producer(i) for i in n.inputs) if _std(p, "Mul") and p.inputs[0] is x and p.inputs[1] is x]
            yield n
            yield from chain
            yield tanh
            tail = _forward_chain(a, tanh.outputs[0], ("Add", "Mul"), 3)
            yield from tail
            side = [c for c in x.outputs if _std(c, "Mul") and _scalar_const(_other(c, x) or x) is not None]
            yield from side
            readers = sum(1 for c in x.outputs if any(c is g for g in [n, *chain, *tail, *side]) or (_std(c, "Mul") and c.inputs[0] is x and c.inputs[1] is x))
            bias = _bias_add(a, x, readers)
            if bias is not None:
                yield bias
        elif _std(n, "Sigmoid"):
            scale = a.producer(n.inputs[0])
            x = n.inputs[0]
            group = [n]
            if _std(scale, "Mul") and any(_scalar_const(t) is not None for t in scale.inputs):
                x = next(t for t in scale.inputs if _scalar_const(t) is None)
                group.append(scale)
            gate = _reader(a, n.outputs[0])
            if _std(gate, "Mul") and _other(gate, n.outputs[0]) is x:
                yield from group
                yield gate


POLICY: dict[str, tuple[Rule, ...]] = {
    "cpu": (
        Rule("conv-activation", "FusedConv", match_conv_activation),
        Rule("nchwc-elementwise", "NCHWc layout (in place between convolutions)", match_nchwc_elementwise),
        Rule("matmul-gemm", "Gemm / FusedGemm", match_matmul_gemm),
        Rule("matmul-scale", "FusedMatMul", match_matmul_scale),
        Rule("layernorm", "LayerNormalization / SimplifiedLayerNormalization", match_layernorm),
        Rule("gelu", "Gelu / BiasGelu / FastGelu / QuickGelu", match_gelu),
    ),
    # onnxruntime's CUDA provider fuses less: convolution activations through cuDNN (Relu
    # only is kept here), normalizations (reductions, which a Pointwise cannot hold) and the
    # bias of a 2-D MatMul (cuBLAS epilogue). GELU and the MatMul scale are left to our
    # generated kernel, which also takes the ops around them.
    "cuda": (
        Rule("conv-activation", "FusedConv (cuDNN)", lambda a: (n for n in match_conv_activation(a) if n.op == "Relu")),
        Rule("matmul-gemm", "Gemm", lambda a: (n for n in match_matmul_gemm(a) if n.op == "Add")),
        Rule("skip-layernorm", "SkipLayerNormalization", match_skip_layernorm),
        Rule("layernorm", "LayerNormalization / SimplifiedLayerNormalization", match_layernorm),
    ),
}

# The rules checked against the graph onnxruntime executes (reserved_for_runtime): fusions that
# remove the nodes they take and decide on scalar constants and per-channel parameters alone, so
# that the probe's weights-as-inputs graph (runtime_unfused) gets the same answer. Not the
# convolution and MatMul rules: onnxruntime's NCHWc layout and Gemm fusions look at the weights.
CONFIRMED: dict[str, frozenset[str]] = {
    "cpu": frozenset({"layernorm", "gelu"}),
}

# Fusions of onnxruntime that run slower on the target than a Pointwise region plus the rest
# left unfused: a region holding one of these ops pays even when that op is its only work, so
# that onnxruntime does not make the fusion. On the CPU (onnxruntime 1.31), a Pointwise region
# with the residual (and bias) Add plus LayerNormalization took 0.24-0.52x the time of
# SkipLayerNormalization with one thread and 0.21-0.75x with two, at 64x128 to 2048x1024
# (bench/skip_layernorm.py, bench/results/skip_layernorm.md).
PREEMPT: dict[str, tuple[Rule, ...]] = {
    "cpu": (Rule("skip-layernorm", "SkipLayerNormalization", match_skip_layernorm),),
}


def preempted_from_runtime(target: str, a: "Analysis") -> dict[int, str]:
    """Nodes that a region takes from one of onnxruntime's slower fusions: id(node) -> rule name."""
    return matched_nodes(PREEMPT.get(target, ()), a)


PASS = Pass(
    name="pointwise",
    order=500,
    summary="fuse maximal regions of elementwise ops (Slice/Split read as views) into onnxfuse.Pointwise",
    run=run,
)
