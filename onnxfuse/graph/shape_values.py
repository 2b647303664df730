"""Symbolic values of integer shape tensors (Shape -> Gather -> Unsqueeze -> Concat chains).

Every element is a monomial coef * d1 * d2 ... over the model's dims, where a dim is a number
when static and a symbol otherwise (a symbolic dim name, or one anonymous symbol per unnamed
position). Dims of tensors come from shape inference, so two tensors whose dims carry the same
symbolic name have the same size there.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from . import core as gu
from . import facts
from .slices import read_slice, slice_indices

# A monomial coef * product(symbols); symbols sorted. None: an element we cannot describe.
Mono = tuple[int, tuple[str, ...]]


MAX_ELEMENTS = 64  # shape tensors are short; longer integer tensors are data, not shapes


_INT_TYPES = {np.dtype(np.int64), np.dtype(np.int32)}


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


def _mul(a: Mono | None, b: Mono | None) -> Mono | None:
    if a is None or b is None:
        return None
    coef = a[0] * b[0]
    return (0, ()) if coef == 0 else (coef, tuple(sorted(a[1] + b[1])))


def _div(a: Mono | None, b: Mono | None) -> Mono | None:
    """Integer division, only where it is exact for every value of the symbols (or floor of
    non-negative constants, where ONNX's truncation and floor agree)."""
    if a is None or b is None or b[0] <= 0:
        return None
    num, den = Counter(a[1]), Counter(b[1])
    if any(num[s] < n for s, n in den.items()):
        return None
    if a[0] % b[0] != 0:
        if a[1] or b[1] or a[0] < 0:
            return None
        return _const(a[0] // b[0])
    rest = tuple(sorted((num - den).elements()))
    return (a[0] // b[0], rest) if a[0] else (0, ())


def _add(a: Mono | None, b: Mono | None, sign: int) -> Mono | None:
    if a is None or b is None or a[1] != b[1]:
        return None
    coef = a[0] + sign * b[0]
    return (0, ()) if coef == 0 else (coef, a[1])


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
            if v.dtype not in _INT_TYPES or v.ndim > 1 or v.size > MAX_ELEMENTS:
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
        if op in _ARITH:
            a, b = ins[0], ins[1]
            if a is None or b is None:
                return None
            la, lb = len(a.elems), len(b.elems)
            n = max(la, lb)
            if (la != n and la != 1) or (lb != n and lb != 1):
                return None
            fn = _ARITH[op]
            elems = tuple(fn(a.elems[i % la], b.elems[i % lb]) for i in range(n))
            return ShapeValue(max(a.rank, b.rank), elems, a.dtype)
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
        numpy_dtype(tensor.dtype) in _INT_TYPES
        and shape is not None
        and len(shape) <= 1
        and (not shape or int(shape[0]) <= MAX_ELEMENTS)
    )
