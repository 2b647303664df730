"""Symbolic values of integer shape tensors (Shape -> Gather -> Unsqueeze -> Concat chains).

Every element is a monomial coef * d1 * d2 ... over the model's dims, where a dim is a number
when static and a symbol otherwise (a symbolic dim name, or one anonymous symbol per unnamed
position). Dims of tensors come from shape inference, so two tensors whose dims carry the same
symbolic name have the same size there. A sum of monomials (a decode step's key length past + 1)
is one monomial too, over a symbol that names the sum (shape_sums.py): such a symbol can name a
dim in the facts below, as `onnxfuse.sum(past + 1)`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from . import core as gu
from . import facts
from . import shape_sums
from .slices import read_slice, slice_indices

# A monomial coef * product(symbols); symbols sorted. None: an element we cannot describe.
Mono = tuple[int, tuple[str, ...]]


MAX_ELEMENTS = 64  # shape tensors are short; longer integer tensors are data, not shapes


_INT_TYPES = {np.dtype(np.int64), np.dtype(np.int32)}
# A folded Equal of a shape value against constants (the TorchScript exporter's `-1` test in an
# expand target, Where(Equal(s, -1), 1, s), once fold-constants has computed the Equal) is a
# 1-D bool constant: read as 0/1, it is the condition Where selects with.
_CONDITION_TYPES = _INT_TYPES | {np.dtype(np.bool_)}


@dataclass(frozen=True)
class ShapeValue:
    """The value of a 0-d or 1-d integer tensor, element by element."""

    rank: int
    elems: tuple[Mono | None, ...]
    dtype: np.dtype

    @property
    def constant(self) -> list[int] | None:
        if any(e is None or e[1] for e in self.elems):
            return None
        return [e[0] for e in self.elems]


def _const(c: int) -> Mono:
    return (int(c), ())


def _broadcast_binary(a: "ShapeValue | None", b: "ShapeValue | None", fn, dtype) -> "ShapeValue | None":
    """fn elementwise over two shape values, one of them possibly a single element (numpy
    broadcasting of 1-D values); the result has dtype, or a's when dtype is None."""
    if a is None or b is None:
        return None
    la, lb = len(a.elems), len(b.elems)
    n = max(la, lb)
    if (la != n and la != 1) or (lb != n and lb != 1):
        return None
    elems = tuple(fn(a.elems[i % la], b.elems[i % lb]) for i in range(n))
    return ShapeValue(max(a.rank, b.rank), elems, a.dtype if dtype is None else dtype)


def _equal(a: Mono | None, b: Mono | None) -> Mono | None:
    """a == b as 1 or 0 where it holds for every value of the symbols: equal monomials, two
    different constants, or values whose difference has one sign for every value of the dims
    (never negative): a monomial of dims against a negative constant, past + 1 against -1."""
    if a is None or b is None:
        return None
    if a == b:
        return _const(1)
    if not a[1] and not b[1] or shape_sums.never_equal(a, b):
        return _const(0)
    return None


def _mul(a: Mono | None, b: Mono | None) -> Mono | None:
    if a is None or b is None:
        return None
    if shape_sums.has_sum(a) or shape_sums.has_sum(b):
        return shape_sums.mul(a, b)  # a sum times anything: the terms multiplied out
    coef = a[0] * b[0]
    return (0, ()) if coef == 0 else (coef, tuple(sorted(a[1] + b[1])))


def _div(a: Mono | None, b: Mono | None) -> Mono | None:
    """Integer division, only where it is exact for every value of the symbols (or floor of
    non-negative constants, where ONNX's truncation and floor agree)."""
    if a is None or b is None or b[0] <= 0:
        return None
    num, den = Counter(a[1]), Counter(b[1])
    if any(num[s] < n for s, n in den.items()):
        # (B*P + B) / (P + 1): exact division of sums, term by term
        return shape_sums.divide(a, b) if shape_sums.has_sum(a) or shape_sums.has_sum(b) else None
    if a[0] % b[0] != 0:
        if a[1] or b[1] or a[0] < 0:
            return None
        return _const(a[0] // b[0])
    rest = tuple(sorted((num - den).elements()))
    return (a[0] // b[0], rest) if a[0] else (0, ())


def _add(a: Mono | None, b: Mono | None, sign: int) -> Mono | None:
    if a is None or b is None:
        return None
    if a[1] != b[1] or shape_sums.has_sum(a):
        return shape_sums.add(a, b, sign)  # a sum (past + 1), or a sum's terms combined
    coef = a[0] + sign * b[0]
    return (0, ()) if coef == 0 else (coef, a[1])


def element_count(dims: list[Mono] | None) -> Mono | None:
    """The product of dims given as monomials (a tensor's element count); None if one is unknown."""
    if dims is None:
        return None
    total: Mono | None = _const(1)
    for d in dims:
        total = _mul(total, d)
    return total


def exact_quotient(a: Mono | None, b: Mono | None) -> Mono | None:
    """a / b where the division is exact for every value of the symbols, else None."""
    return _div(a, b)


def reshaped_dims(in_dims: list[Mono | None] | None, target: list | None, allowzero: int = 0) -> list[Mono] | None:
    """The dims of Reshape(x, target) for x of dims `in_dims` (monomials), where provable: a 0
    copies x's dim at its position (allowzero = 0), one -1 is x's element count over the other
    entries where that division is exact for every value of the symbols; without a -1 the element
    counts must be equal. None otherwise (the Reshape could fail or give other dims). An entry of
    `target` is a number or a monomial (a run-time target's element: a dim it was read from,
    which is that dim of the output)."""
    if in_dims is None or target is None or any(d is None for d in in_dims):
        return None
    out: list[Mono | None] = []
    inferred = None
    for i, t in enumerate(target):
        if isinstance(t, tuple):
            if t[1]:
                if t[0] <= 0 or not shape_sums.nonnegative(t):  # a sum that may be -1 would infer
                    return None
                out.append(t)
                continue
            t = t[0]
        if t is None:
            return None
        if t == 0 and not allowzero:
            if i >= len(in_dims):
                return None
            out.append(in_dims[i])
        elif t == -1 and inferred is None:
            inferred = i
            out.append(None)
        elif t >= 0:
            out.append(_const(t))
        else:
            return None
    total = element_count(list(in_dims))
    if inferred is None:
        return out if element_count(out) == total else None
    rest = element_count([d for i, d in enumerate(out) if i != inferred])
    out[inferred] = exact_quotient(total, rest)
    return None if out[inferred] is None else out


_ARITH = {
    "Mul": _mul,
    "Div": _div,
    "Add": lambda a, b: _add(a, b, 1),
    "Sub": lambda a, b: _add(a, b, -1),
}


class ShapeEvaluator:
    """Symbolic values of the integer shape tensors of one graph."""

    def __init__(self, graph: gs.Graph, shapes: facts.ShapeTable) -> None:
        self.graph = graph
        self.shapes = shapes
        self.opset = graph.opset or 1
        self._memo: dict[str, ShapeValue | None] = {}

    def dim_symbols(self, tensor: gs.Tensor) -> list[Mono] | None:
        d = self.shapes.dims(tensor)
        if d is None:
            return None
        # An unnamed dynamic dim is a symbol of its own; "\0" keeps it apart from real names.
        return [_const(x) if isinstance(x, int) else (1, (x if x else f"\0{tensor.name}[{i}]",)) for i, x in enumerate(d)]

    def value(self, tensor: gs.Tensor, depth: int = 0) -> ShapeValue | None:
        if not gu.is_present(tensor):
            return None
        if tensor.name in self._memo:
            return self._memo[tensor.name]
        result = None
        if depth < 200:
            try:
                result = self._evaluate(tensor, depth)
            except (ValueError, TypeError, IndexError, KeyError):
                result = None
        if result is not None and len(result.elems) > MAX_ELEMENTS:
            result = None
        self._memo[tensor.name] = result
        return result

    def _evaluate(self, tensor: gs.Tensor, depth: int) -> ShapeValue | None:
        if isinstance(tensor, gs.Constant) and not _may_be_shape(tensor):
            return None  # a weight: its type and shape say so without reading its values
        v = gu.constant_value(tensor)
        if v is not None:
            if v.dtype not in _CONDITION_TYPES or v.ndim > 1 or v.size > MAX_ELEMENTS:
                return None
            return ShapeValue(v.ndim, tuple(_const(x) for x in v.reshape(-1)), v.dtype)
        node = gu.producer(tensor)
        if node is None or not gu.is_default_domain(node) or node.outputs[0] is not tensor:
            return None
        op = node.op
        if op == "Shape":
            syms = self.dim_symbols(node.inputs[0])
            if syms is None:
                return None
            # Shape's start and end take the dims as a Slice with step 1 would.
            taken = slice_indices(len(syms), int(gu.attr(node, "start", 0)), int(gu.attr(node, "end", len(syms))), 1)
            return ShapeValue(1, tuple(syms[i] for i in taken), np.dtype(np.int64))
        if op == "Size":
            syms = self.dim_symbols(node.inputs[0])
            if syms is None:
                return None
            total: Mono | None = _const(1)
            for s in syms:
                total = _mul(total, s)
            return ShapeValue(0, (total,), np.dtype(np.int64))
        ins = [self.value(t, depth + 1) for t in node.inputs]
        if op == "Identity":
            return ins[0]
        if op == "Cast":
            to = np.dtype({7: np.int64, 6: np.int32}.get(int(gu.attr(node, "to", 0)), np.float32))
            return None if ins[0] is None or to not in _INT_TYPES else ShapeValue(ins[0].rank, ins[0].elems, to)
        if op == "Gather":
            data, idx = ins[0], ins[1]
            if data is None or idx is None or data.rank != 1 or gu.attr(node, "axis", 0) not in (0, -1):
                return None
            picks = idx.constant
            if picks is None:
                return None
            n = len(data.elems)
            return ShapeValue(idx.rank, tuple(data.elems[p + n if p < 0 else p] for p in picks), data.dtype)
        if op in ("Unsqueeze", "Squeeze"):
            x = ins[0]
            if x is None:
                return None
            axes = gu.attr(node, "axes") if self.opset < 13 else (ins[1].constant if len(ins) > 1 and ins[1] else None)
            if op == "Unsqueeze":
                ok = x.rank == 0 and axes is not None and list(axes) in ([0], [-1])
                return ShapeValue(1, x.elems, x.dtype) if ok else None
            ok = x.rank == 1 and len(x.elems) == 1 and (axes is None or list(axes) in ([0], [-1]))
            return ShapeValue(0, x.elems, x.dtype) if ok else None
        if op == "Concat":
            if any(v is None or v.rank != 1 for v in ins) or gu.attr(node, "axis", 0) not in (0, -1):
                return None
            return ShapeValue(1, tuple(e for v in ins for e in v.elems), ins[0].dtype)
        if op == "Slice":
            return self._slice(node, ins)
        if op == "Reshape":
            # a 1-D value (or a scalar) reshaped to 1-D ([-1] or its length): the same elements;
            # one element reshaped to a scalar ([]): that element
            x, to = ins[0], ins[1]
            if x is None or to is None or x.rank > 1:
                return None
            if to.constant in ([-1], [len(x.elems)]):
                return ShapeValue(1, x.elems, x.dtype)
            return ShapeValue(0, x.elems, x.dtype) if to.constant == [] and len(x.elems) == 1 else None
        if op == "ConstantOfShape":
            shape = ins[0].constant if ins[0] is not None else None
            value = node.attrs.get("value")
            fill = np.asarray(value.values if isinstance(value, gs.Constant) else 0).reshape(-1)
            if shape is None or len(shape) != 1 or shape[0] > MAX_ELEMENTS or fill.size != 1:
                return None
            dtype = fill.dtype if isinstance(value, gs.Constant) else np.dtype(np.float32)
            if dtype not in _INT_TYPES:
                return None
            return ShapeValue(1, tuple(_const(int(fill[0])) for _ in range(shape[0])), dtype)
        if op == "Equal":
            return _broadcast_binary(ins[0], ins[1], _equal, np.dtype(bool))
        if op == "Where":
            cond, a, b = ins
            if cond is None or a is None or b is None or cond.constant is None:
                return None
            n = max(len(cond.elems), len(a.elems), len(b.elems))
            if any(len(v.elems) not in (1, n) for v in (cond, a, b)):
                return None
            pick = lambda v, i: v.elems[i % len(v.elems)]  # noqa: E731
            elems = tuple(pick(a, i) if pick(cond, i)[0] else pick(b, i) for i in range(n))
            return ShapeValue(max(cond.rank, a.rank, b.rank), elems, a.dtype)
        if op in _ARITH:
            return _broadcast_binary(ins[0], ins[1], _ARITH[op], None)
        return None

    def _slice(self, node: gs.Node, ins) -> ShapeValue | None:
        data = ins[0]
        if data is None or data.rank != 1:
            return None
        params = read_slice(node, self.opset, 1)
        if params is None or set(params) != {0}:
            return None
        idx = slice_indices(len(data.elems), *params[0])
        return ShapeValue(1, tuple(data.elems[i] for i in idx), data.dtype)


def numpy_dtype(dtype) -> np.dtype | None:
    try:
        return np.dtype(dtype)
    except TypeError:  # graphsurgeon keeps some ONNX types as TensorProto enums
        return None


def _may_be_shape(tensor: gs.Constant) -> bool:
    """False when an initializer's recorded type or shape already rules out a shape value."""
    shape = tensor.shape
    return (
        numpy_dtype(tensor.dtype) in _CONDITION_TYPES
        and shape is not None
        and len(shape) <= 1
        and (not shape or int(shape[0]) <= MAX_ELEMENTS)
    )


# Facts about dims onnx shape inference does not derive ---------------------------------------

# The dim of x[..., 0:e] along an axis of static size D is min(e, D): a name of its own.
_MIN = "onnxfuse.min"
_BROADCAST_OPS = {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Equal", "Less", "Greater",
                  "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Mod", "PRelu", "BitShift"}


def _min_name(sym: str, bound: int) -> str:
    return f"{_MIN}({sym},{bound})"


def broadcast_dim(a, b):
    """The broadcast of two dims when it is the same in every valid run, else None."""
    if a == b and a is not None:
        return a
    if a == 1:
        return b
    if b == 1:
        return a
    for x, y in ((a, b), (b, a)):
        # min(s, D) with D >= 1 broadcast with s is s: they are equal, or both are 1, or s = 0.
        if isinstance(x, str) and isinstance(y, str) and y.startswith(f"{_MIN}({x},"):
            return x
    return None


def _better(new: list, old: list | None) -> bool:
    if old is None:
        return True
    return len(new) == len(old) and any(n is not None and n != o for n, o in zip(new, old))


def _dim_facts(graph: gs.Graph, shapes: facts.ShapeTable, ev: ShapeEvaluator) -> dict[str, list]:
    """Dims of Slice outputs with run-time bounds, of Ranges to a dim, of ConstantOfShape of a
    shape value, and of broadcasts of them: what a causal mask sliced to the sequence length,
    added to the attention scores, needs to keep the sequence dim's name, and what T5's
    relative-position bias, built from Ranges over the sequence, needs to be [1, H, S, S]."""
    found: dict[str, list] = {}

    def dims(t):
        return found.get(t.name) or shapes.dims(t)

    for node in graph.nodes:
        if _no_view_pointwise(node):  # every output has the broadcast shape of the inputs
            new = _broadcast_of([dims(t) for t in node.inputs])
            for out in node.outputs:
                old = shapes.dims(out)
                if new is not None and gu.is_present(out) and (old is None or len(old) == len(new)):
                    merged = _merge_facts(new, old) if old is not None else new
                    if _better(merged, old):
                        found[out.name] = merged
            continue
        if not node.outputs or not gu.is_present(node.outputs[0]) or not gu.is_default_domain(node):
            continue
        out = node.outputs[0]
        new = None
        if node.op == "Slice" and (graph.opset or 1) >= 10 and len(node.inputs) >= 3:
            new = _slice_dims(node, dims(node.inputs[0]), ev)
        elif node.op == "Range" and len(node.inputs) == 3:
            new = _range_dims(*(ev.value(t) for t in node.inputs))
        elif node.op == "ConstantOfShape" and node.inputs:
            new = _dims_of_value(ev.value(node.inputs[0]))
        elif node.op == "Reshape" and len(node.inputs) == 2:
            target = ev.value(node.inputs[1])
            new = _dims_of_value(target)
            if new is not None and any(d in (0, -1) for d in new):
                # Copied and inferred dims, over the symbols: Reshape(ids [B, S], [-1, S]) is
                # [B, S], which inference leaves a name of its own (unk__N) for the -1. Only a
                # number or a given name is a fact here: one made-up name for another would only
                # make inference rename what reads it, round after round.
                new = _dims_of_monomials(reshaped_dims(ev.dim_symbols(node.inputs[0]), list(target.elems),
                                                       int(gu.attr(node, "allowzero", 0))))
                if new is not None:
                    new = [None if isinstance(d, str) and not _settled(d) else d for d in new]
        elif node.op == "Concat" and node.inputs:
            new = _concat_dims(node, [dims(t) for t in node.inputs], shapes.dims(out))
        elif node.op == "Expand" and len(node.inputs) == 2:
            to, x = _dims_of_value(ev.value(node.inputs[1])), dims(node.inputs[0])
            if to is not None and x is not None:
                rank = max(len(to), len(x))
                new = [broadcast_dim(a, b) if a is not None and b is not None else None
                       for a, b in zip([1] * (rank - len(x)) + list(x), [1] * (rank - len(to)) + list(to))]
        elif node.op in _BROADCAST_OPS and len(node.outputs) == 1:
            new = _broadcast_of([dims(t) for t in node.inputs])
        if new is None:
            continue
        old = shapes.dims(out)
        if old is not None and len(old) == len(new):
            new = _merge_facts(new, old)
        if _better(new, old):
            found[out.name] = new
    return found


def _concat_dims(node: gs.Node, ins: list, old: list | None) -> list | None:
    """Concat(past, new) along an axis whose output dim inference leaves unknown (or names itself):
    the sum of the inputs' dims there (past + 1), where each is a number or a given name and one
    is a name. A name the graph gives that axis (a declared output's `total`) is kept."""
    if old is None or any(d is None or len(d) != len(old) for d in ins):
        return None
    axis = int(gu.attr(node, "axis", 0))
    axis = axis + len(old) if axis < 0 else axis
    if not 0 <= axis < len(old) or _settled(old[axis]):
        return None
    total: Mono | None = _const(0)
    for d in ins:
        x = d[axis]
        if not _settled(x) or (isinstance(x, str) and x.startswith("\0")):
            return None
        total = _add(total, _const(x) if isinstance(x, int) else (1, (x,)), 1)
    # A number is left to inference (re-inferring what reads it renames dims it had named).
    name = _dim_name(total) if total is not None and total[1] else None
    return None if name is None else [name if i == axis else None for i in range(len(old))]


def _merge_facts(new: list, old: list) -> list:
    """New dims over old ones, except that a name the model gives (`total`, which other tensors
    share) stays over a sum symbol for the same dim (past + 1): the names say the same size, and
    the given one is what the rest of the graph is proved with."""
    return [o if n is None or (isinstance(n, str) and shape_sums.is_sum(n) and isinstance(o, str)
                               and _settled(o) and not shape_sums.is_sum(o)) else n
            for n, o in zip(new, old)]


def _broadcast_of(ins: list) -> list | None:
    if not ins or any(d is None for d in ins):
        return None
    rank = max(len(d) for d in ins)
    padded = [[1] * (rank - len(d)) + list(d) for d in ins]
    new = []
    for column in zip(*padded):
        r = column[0]
        for c in column[1:]:
            r = broadcast_dim(r, c) if r is not None else None
        new.append(r)
    return new


def _no_view_pointwise(node: gs.Node) -> bool:
    """An onnxfuse.Pointwise node none of whose inputs is read through a view: elementwise over
    the broadcast of its inputs (onnxfuse/program.py: every output has the iteration shape)."""
    if node.op != "Pointwise" or node.domain != "onnxfuse" or not node.inputs:
        return False
    program = node.attrs.get("program")
    program = program.decode() if isinstance(program, bytes) else program
    return isinstance(program, str) and " view=" not in program


def _dim_name(e: Mono | None) -> str | None:
    """The dim an element is, by name: one named dim, or a sum symbol of named dims that is never
    negative (past + 1; a sum that may be negative is no length: a Slice end or Reshape target
    reads it otherwise)."""
    if e is None or e[0] != 1 or len(e[1]) != 1 or e[1][0].startswith("\0"):
        return None
    name = e[1][0]
    if shape_sums.is_sum(name) and (not shape_sums.nonnegative(e)
                                    or any(s.startswith("\0") for s in shape_sums.symbols(e))):
        return None
    return name


def _dims_of_value(v: ShapeValue | None) -> list | None:
    """The dims a shape tensor's value spells: each element a number or one named dim."""
    if v is None or v.rank != 1:
        return None
    dims = []
    for e in v.elems:
        if e is not None and not e[1]:
            dims.append(e[0])
        else:
            dims.append(_dim_name(e))
    return dims


def _dims_of_monomials(monos: list[Mono] | None) -> list | None:
    """Dims from monomials: a number, one named dim, else None (unknown)."""
    if monos is None:
        return None
    return _dims_of_value(ShapeValue(1, tuple(monos), np.dtype(np.int64)))


def _range_dims(start, limit, delta) -> list | None:
    """Range(0, e, 1) has e elements: e's name, where e is one named dim."""
    if start is None or limit is None or delta is None or start.constant != [0] or delta.constant != [1]:
        return None
    name = _dim_name(limit.elems[0])
    return None if name is None else [name]


def _slice_dims(node: gs.Node, in_dims: list | None, ev: ShapeEvaluator) -> list | None:
    if in_dims is None:
        return None
    vals = [ev.value(t) if gu.is_present(t) else None for t in list(node.inputs[1:5]) + [None] * (5 - len(node.inputs))]
    starts, ends, axes, steps = vals[0], vals[1], vals[2], vals[3]
    if starts is None or ends is None or starts.constant is None or len(starts.elems) != len(ends.elems):
        return None
    n = len(starts.elems)
    axes_c = axes.constant if axes is not None else list(range(n))
    steps_c = steps.constant if steps is not None else [1] * n
    if axes_c is None or steps_c is None or (len(node.inputs) > 3 and gu.is_present(node.inputs[3]) and axes is None):
        return None
    out = list(in_dims)
    for a, s0, e, k in zip(axes_c, starts.constant, ends.elems, steps_c):
        a = a + len(in_dims) if a < 0 else a
        if not 0 <= a < len(in_dims):
            return None
        dim = in_dims[a]
        if e is not None and not e[1] and isinstance(dim, int) and k != 0:
            out[a] = len(slice_indices(dim, s0, e[0], k))
        elif e is not None and s0 == 0 and k == 1 and isinstance(dim, int) and dim >= 1 and _dim_name(e):
            out[a] = _min_name(_dim_name(e), dim)
        elif e is not None and s0 == 0 and k == 1 and isinstance(dim, str) and dim and e == (1, (dim,)):
            out[a] = dim  # x[0:S] of an axis of length S (DeBERTa's relative positions, TorchScript)
        else:
            out[a] = None
    return out


def refined_dims(graph: gs.Graph, shapes: facts.ShapeTable, rounds: int = 8) -> tuple[facts.ShapeTable, ShapeEvaluator]:
    """`shapes` refined with the dim facts onnx inference does not derive (_dim_facts: Range
    lengths, Slices to run-time bounds, broadcasts of them), inferring again after each round,
    and an evaluator over the refined table. A fact of numbers and given names alone holds in
    every later round too, and is given again with each round's new ones: inferring again what
    reads a new fact must not forget it (one made-up name is only valid in its own round)."""
    ev = ShapeEvaluator(graph, shapes)
    settled: dict[str, list] = {}
    for _ in range(rounds):
        found = _dim_facts(graph, shapes, ev)
        if not found:
            break
        hints = {**settled, **found}
        shapes = shapes.refined(graph, hints)
        ev = ShapeEvaluator(graph, shapes)
        settled.update({name: d for name, d in hints.items() if all(_settled(x) for x in d)})
    return shapes, ev


def _settled(d) -> bool:
    """A dim that means the same in every inference: a number or a name the model gives (a sum
    of them)."""
    if isinstance(d, str) and shape_sums.is_sum(d):
        return all(_settled(s) for s in shape_sums.symbols((1, (d,))))
    return isinstance(d, int) or (isinstance(d, str) and not d.startswith("unk__"))
