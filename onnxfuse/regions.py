"""Pointwise regions: maximal connected groups of elementwise nodes, with the Slice/Split nodes
they read as views, lowered to one expression program each (onnxfuse.program).

The pointwise pass (passes/pointwise.py) decides which regions pay and writes them; this module
only forms them. Regions grow from consumers to producers; a node joins when the region stays
lowerable (program dtypes, the iteration shape on every output) and acyclic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph.facts import elem_type
from onnxfuse.graph.index import GraphIndex
from onnxfuse.graph.patterns import VIEW_OPS
from onnxfuse.graph.slices import UNREACHABLE_END, read_slice
from onnxfuse.lowering import NO_OPS, SUPPORTED_OPS, LoweringError, literal_value, lower_node, lowerable, program_dtype
from onnxfuse.program import OPS, Program, SliceSpec, apply_view, resolve_slice


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
        elif not (s.start == 0 and s.step == 1 and s.end >= UNREACHABLE_END):
            d[s.axis] = None
    return d


def slice_specs(node: gs.Node, opset: int) -> tuple[SliceSpec, ...] | None:
    """The view a Slice node takes of its input (axes made non-negative), None if not constant."""
    rank = gu.rank(node.inputs[0])
    params = None if rank is None else read_slice(node, opset, rank)
    if params is None:
        return None
    return tuple(SliceSpec(axis, start, end, step) for axis, (start, end, step) in sorted(params.items()))


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


_NOT_CONSTANT_OPS = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli")


def constant_only(nodes: list[gs.Node]) -> set[int]:
    """id() of the nodes (in topological order) that compute from constants alone: onnxruntime
    folds them when it loads the model (fold-constants leaves such a node only when its result
    is large), where a region would compute them on every run."""
    derived: set[str] = set()
    out: set[int] = set()
    for n in nodes:
        present = [t for t in n.inputs if gu.is_present(t)]
        if (present and not gu.is_op(n, *_NOT_CONSTANT_OPS)
                and not any(isinstance(v, gs.Graph) for v in n.attrs.values())
                and all(t.name in derived or gu.is_constant(t) for t in present)):
            out.add(id(n))
            derived.update(t.name for t in n.outputs if gu.is_present(t))
    return out


class Analysis(GraphIndex):
    """Everything the region builder needs about the graph, indexed by node identity.

    reserved: nodes left to onnxruntime's own fusions (never in a region);
    preempted: nodes a region takes from a slower fusion of onnxruntime (a region holding one
    pays even when it is its only work). Both are id(node) -> the name of the rule that says so
    (onnxfuse.graph.ort_fusions)."""

    def __init__(self, graph: gs.Graph, reserved: dict[int, str], preempted: dict[int, str]):
        super().__init__(graph)
        self.reserved = reserved
        self.preempted = preempted
        self.constant_only = constant_only(self.nodes)
        self.views: dict[int, list[tuple[SliceSpec, ...]]] = {}
        self.pointwise: set[int] = set()
        for n in self.nodes:
            if not gu.is_default_domain(n):
                continue
            if n.op in VIEW_OPS:
                v = self._view_of(n)
                if v is not None:
                    self.views[id(n)] = v
            elif (n.op in SUPPORTED_OPS and id(n) not in self.reserved and id(n) not in self.constant_only
                  and self._lowerable(n)):
                self.pointwise.add(id(n))

    def _view_of(self, n: gs.Node):
        if elem_type(n.inputs[0]) not in (1, 10, 11, 16, 9):
            return None
        if n.op == "Slice":
            s = slice_specs(n, self.opset)
            return None if s is None else [s]
        return split_specs(n, self.opset)

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


def lower_region(a: Analysis, members: dict[int, gs.Node]) -> Lowered:
    """The program of a region; LoweringError when the region is not valid.

    A constant whose elements are all equal is a literal unless its shape would grow the
    iteration shape (the broadcast of the other inputs): then it is an input after all.
    A Slice/Split outside the region is read through views unless the region also reads one
    of its outputs as a stored tensor (the two views could not be composed): the fallback body
    would then both compute that output and receive it as an input."""
    forced: set[tuple] = set()
    no_view: set[int] = set()
    round_narrow: frozenset[str] = frozenset()
    while True:
        lowered, grows, stored = _lower_region_once(a, members, forced, no_view, round_narrow)
        if not grows and not stored:
            narrower = NARROWER_THAN.get(lowered.program.compute_dtype, frozenset())
            if round_narrow or not lowered.program.instrs or not narrower & _value_types(lowered.program):
                return lowered
            # A region computing in float64 holds its float32 (float16) values in double, one
            # computing in float32 its float16 values in float: each node's result is rounded to
            # its own type, as the operator's definition (and onnxruntime, node by node) stores it,
            # or x + x would not overflow where onnxruntime's does (fuzz seeds 28404, 28493),
            # and Equal(erf(x) - y, z) would compare unrounded values (seed 12802).
            round_narrow = narrower
            continue
        forced |= grows
        no_view |= stored


def _lower_region_once(
    a: Analysis, members: dict[int, gs.Node], forced: set[tuple], no_view: set[int],
    round_narrow: frozenset[str] = frozenset(),
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
                out_types = [elem_type(x) if gu.is_present(x) else None for x in p.outputs]
                narrow = program_dtype(out_types[0]) if round_narrow and p.op != "Cast" and out_types[0] else None
                # float32 kernels (in a float64 region) round each step, their partial sums too;
                # float16 ones compute in float and round what they store (the node's outputs).
                stepwise = narrow in round_narrow and narrow == "f32"
                outs = lower_node(
                    _RoundingEmitter(prog, narrow) if stepwise else prog,
                    p.op, dict(p.attrs), a.opset, args,
                    [elem_type(x) if x is not None else None for x in ins], out_types,
                )
                if narrow in round_narrow and not stepwise:
                    outs = [prog.emit("cast", v, params=[narrow])
                            if isinstance(v, str) and t is not None and program_dtype(t) == narrow else v
                            for v, t in zip(outs, out_types)]
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

    try:
        values = [operand(t, ()) for t in outputs]
    finally:
        # operand reaches itself through its closure: a reference cycle that would keep this
        # attempt's program, memo and inputs alive until a garbage collection finds them (80
        # objects per node of a graph, most of what its collections walked).
        operand = None
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


# The float types a region's compute type holds without rounding (lower_region).
NARROWER_THAN = {"f64": frozenset({"f32", "f16", "bf16"}), "f32": frozenset({"f16", "bf16"})}


def _value_types(program: Program) -> set[str]:
    """The program dtypes of its inputs, outputs and casts."""
    return ({i.dtype for i in program.inputs} | {o.dtype for o in program.outputs}
            | {str(i.params[0]) for i in program.instrs if i.op == "cast"})


# Program ops whose result of rounded operands is representable in their type already.
_EXACT_ON_ROUNDED = frozenset({"neg", "abs", "max", "min", "where", "relu", "floor", "ceil", "round", "sign", "clip"})


class _RoundingEmitter:
    """Emits into `program` with every arithmetic result rounded to `dtype` (a node's own float
    type, narrower than the region's float64 compute type), as onnxruntime's kernel of that
    type rounds each step: a partial sum of Sum or Mean included."""

    def __init__(self, program: Program, dtype: str):
        self.program, self.dtype = program, dtype

    def emit(self, op: str, *args, params=()) -> str:
        value = self.program.emit(op, *args, params=params)
        if op == "cast" or op in _EXACT_ON_ROUNDED or OPS[op].result != "same":
            return value
        return self.program.emit("cast", value, params=[self.dtype])


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
    regions: dict[int, Region] = {}  # by id, in the order made (joined ones leave, the new one comes last)

    def attempt(n: gs.Node, joined: list[Region]) -> Region | None:
        members = {id(n): n}
        for r in joined:
            members.update(r.members)
        # _creates_cycle looks up nodes outside `members` only: region_of as it is (a copy
        # without the members per attempt made this quadratic in the graph)
        if len(joined) > 0 and _creates_cycle(a, members, region_of):
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
            for j in joined:
                regions.pop(id(j), None)
            regions[id(new)] = new
            for k in new.members:
                region_of[k] = new
            break
    return list(regions.values())


def work(r: Region) -> int:
    return sum(1 for n in r.members.values() if n.op not in NO_OPS and n.op not in VIEW_OPS)
