"""A decode step's attention mask: the causal half that one new token makes all-true, and the
padding half read from the mask by a flat index grid.

decode-mask
    causal:    And(c, y) -> y, where c is a comparison proved true for every element and y's shape
               contains c's (so the And's broadcast is y's own shape). c is LessOrEqual(a, b) (or
               GreaterOrEqual(b, a)) of integer tensors whose element bounds are affine in opaque
               one-element tensors: Range(s, l, 1) lies in [lo(s), hi(l) - 1], Add/Sub add
               bounds, Unsqueeze/Reshape/Squeeze/Expand/Identity/integer Casts keep them, a
               constant is its min and max, any other one-element integer tensor X is [X, X].
               Proved when hi(a) - lo(b) is a constant <= 0: the symbols cancel. transformers'
               causal mask for a step of S new tokens compares kv = Range(0, P + S) with the
               positions P + arange(S): true everywhere exactly when S = 1, which the export
               has made static. Also Cast to bool of such a c, and And(True, c) (a constant
               true of size-1 dims). y contains c's shape when c is a compare whose one operand
               has size-1 static dims only and y's dims (shape inference) agree with the other's,
               or y is Reshape(., Shape(z)) (or a Cast of it) with z a broadcasting op reading it.
    padding:   Reshape(Reshape(Gather(Flatten(D) | Reshape(D, [-1, 1]), i, axis 0), [-1]),
               Shape(i)) -> Unsqueeze(Slice(D, 0, n_k, axis 1)), D [R, T] of rank 2, the index
               i = a_b * T + a_k (Add of either order, Mul of either order) with a_b an arange
               Range(0, n_b, 1) over an axis p and a_k an arange Range(0, n_k, 1) over an axis
               q > p of i (size-1 axes inserted by Unsqueeze), T a one-element value that is
               D's dim 1 and n_b one that is D's dim 0 (by value over the model's dims, on the
               facts of shape_values.refined_dims: Gather(Shape(D), 1), or a dim of another
               tensor proved the same size, e.g. the ids' batch and length against
               Reshape(mask, [B, -1])). Then element
               e of the Gather is D's flat element e[p] * T + e[q], which is D[e[p], e[q]] when
               e[q] < T; where n_k > T the last row's index passes R * T and the original
               fails (Gather's bounds check), so wherever it runs the Slice reads the same
               elements (the TorchScript export of transformers' padding mask,
               mask.flatten()[batch * T + kv]).
Rules (onnxfuse/graph/rules.py): And(c, y) (decode-mask/causal), the four forms of the padding
grid (decode-mask/padding/{flatten,reshape}/{shape,concat}: Flatten or Reshape to a column, the
target Shape(i) or a one-input Concat of it), Expand(x, t) (decode-mask/expand); the proofs are
their conditions, which say why they fail (`optimize --explain decode-mask`).
Why: the mask helpers of a decode step ran as about 30 kernels of index arithmetic per step in
onnxruntime (bench/results/corpus_decode.md); of them, the causal comparison and its And and the
flat index grid (Range, Unsqueezes, Mul, Shape, Gather, Add, Flatten, Gather, two Reshapes)
compute nothing the step needs beyond a Slice of the mask.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import facts
from onnxfuse.graph.rules import (ANY, Const, Failure, Match, Rule, Var, apply, fail, match, match_value, op,
                                  read_instead, through)
from onnxfuse.graph.shape_values import ShapeEvaluator, refined_dims
from onnxfuse.graph.writer import NodeWriter
from onnxfuse.pipeline import Context, Pass

_KEEP = ("Unsqueeze", "Reshape", "Squeeze", "Expand", "Identity", "Flatten")
_INT = (np.dtype(np.int64), np.dtype(np.int32))
_BROADCAST = ("Add", "Sub", "Mul", "Div", "And", "Or", "Xor", "Equal", "Less", "LessOrEqual", "Greater",
              "GreaterOrEqual", "Where", "Max", "Min")
_DEPTH = 12


def _affine_add(a: dict, b: dict, sign: int = 1) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + sign * v
    return {k: v for k, v in out.items() if v or k == ""}


def _one_element(shapes: facts.ShapeTable, t: gs.Tensor) -> bool:
    d = shapes.dims(t)
    return d is not None and all(x == 1 for x in d)


def _bounds(shapes: facts.ShapeTable, t: gs.Tensor, depth: int = 0):
    """(lo, hi): affine forms {tensor name: coef, "": constant} bounding every element of the
    integer tensor t, or None."""
    if depth > _DEPTH:
        return None
    value = gu.constant_value(t)
    if value is not None:
        if value.dtype.kind not in "iu" or value.size == 0:
            return None
        return {"": int(value.min())}, {"": int(value.max())}
    node = gu.producer(t)
    if gu.is_op(node, *_KEEP) or (gu.is_op(node, "Cast") and np.dtype(
            _np_type(gu.attr(node, "to", 0))) in _INT):
        inner = _bounds(shapes, node.inputs[0], depth + 1)
        if inner is not None:
            return inner
    elif gu.is_op(node, "Range") and gu.scalar(node.inputs[2]) == 1:
        s, lim = _bounds(shapes, node.inputs[0], depth + 1), _bounds(shapes, node.inputs[1], depth + 1)
        if s is not None and lim is not None:
            return s[0], _affine_add(lim[1], {"": -1})
    elif gu.is_op(node, "Add", "Sub") and len(node.inputs) == 2:
        a, b = (_bounds(shapes, x, depth + 1) for x in node.inputs)
        if a is not None and b is not None:
            if node.op == "Add":
                return _affine_add(a[0], b[0]), _affine_add(a[1], b[1])
            return _affine_add(a[0], b[1], -1), _affine_add(a[1], b[0], -1)
    dim = _dim_token(shapes, t)
    if dim is not None:  # a dim read at run time: its size, or its symbolic name
        return dim, dim
    if t.dtype is not None and np.dtype(t.dtype) in _INT and _one_element(shapes, t):
        return {t.name: 1, "": 0}, {t.name: 1, "": 0}
    return None


def _np_type(onnx_type: int):
    import onnx

    try:
        return onnx.helper.tensor_dtype_to_np_dtype(int(onnx_type))
    except Exception:  # noqa: BLE001 - an unknown type is not an integer one
        return np.float32


def _always_le(shapes: facts.ShapeTable, a: gs.Tensor, b: gs.Tensor) -> bool:
    """Every element of a is <= every element of b."""
    ba, bb = _bounds(shapes, a), _bounds(shapes, b)
    if ba is None or bb is None:
        return False
    diff = _affine_add(ba[1], bb[0], -1)
    return set(diff) == {""} and diff[""] <= 0


def _size_one(shapes: facts.ShapeTable, t: gs.Tensor, rank: int) -> bool:
    d = shapes.dims(t)
    return d is not None and len(d) <= rank and all(x == 1 for x in d)


def _all_true(shapes: facts.ShapeTable, t: gs.Tensor, depth: int = 0) -> gs.Tensor | Failure:
    """A tensor of t's own shape when t is proved true everywhere (the witness of its shape), else
    why not."""
    if depth > _DEPTH:
        return fail(f"'{t.name}' is {_DEPTH} nodes deep in Casts and Ands")
    node = gu.producer(t)
    if gu.is_op(node, "Cast", "Identity") and (node.op == "Identity" or int(gu.attr(node, "to", 0)) == 9):
        if node.op == "Identity" or node.inputs[0].dtype == np.bool_:
            return _all_true(shapes, node.inputs[0], depth + 1)
        return fail(f"'{t.name}' is a Cast to bool of a non-bool tensor")
    if gu.is_op(node, "And") and len(node.inputs) == 2:
        why = fail(f"And '{node.name}' has no constant true input of size-1 dims")
        for i in (0, 1):
            c = gu.constant_value(node.inputs[i])
            w = _all_true(shapes, node.inputs[1 - i], depth + 1)
            if c is not None and c.dtype == np.bool_ and bool(c.all()):
                if not isinstance(w, gs.Tensor):
                    why = w
                    continue
                rank = shapes.rank(w)
                if rank is not None and c.ndim <= rank and all(x == 1 for x in c.shape):
                    return w
        return why
    if gu.is_op(node, "LessOrEqual", "GreaterOrEqual") and len(node.inputs) == 2:
        lo, hi = node.inputs if node.op == "LessOrEqual" else node.inputs[::-1]
        if not _always_le(shapes, lo, hi):
            return fail(f"{node.op} '{node.name}': no affine bounds prove every '{lo.name}' <= every "
                        f"'{hi.name}' (more than one new token, or a key past the position)")
        for i in (0, 1):  # the output's shape is the other operand's when this one is all 1s
            other = node.inputs[1 - i]
            rank = shapes.rank(other)
            if rank is not None and _size_one(shapes, node.inputs[i], rank):
                return other
        return fail(f"{node.op} '{node.name}': neither operand has size-1 dims only (its shape is unknown)")
    what = "a graph input or constant" if node is None else f"{node.op} '{node.name}'"
    return fail(f"'{t.name}' is computed by {what}, not a LessOrEqual or GreaterOrEqual (or a Cast or And of one)")


def _contains(shapes: facts.ShapeTable, y: gs.Tensor, w: gs.Tensor, depth: int = 0) -> bool:
    """y's shape contains w's: broadcasting w to y's shape gives y's shape."""
    if y is w:
        return True
    if depth > _DEPTH:
        return False
    yd, wd = shapes.dims(y), shapes.dims(w)
    if yd is not None and wd is not None and len(wd) <= len(yd) and all(
            x is not None and (x == 1 or x == yd[len(yd) - len(wd) + i]) for i, x in enumerate(wd)):
        return True
    node = gu.producer(y)
    if gu.is_op(node, "Cast", "Identity"):
        return _contains(shapes, node.inputs[0], w, depth + 1)
    if gu.is_op(node, "Reshape") and len(node.inputs) == 2:
        target = gu.producer(node.inputs[1])
        if gu.is_op(target, "Concat") and len(target.inputs) == 1:
            target = gu.producer(target.inputs[0])
        if gu.is_op(target, "Shape") and "start" not in target.attrs and "end" not in target.attrs:
            return _contains(shapes, target.inputs[0], w, depth + 1)
        return False
    if gu.is_op(node, *_BROADCAST):
        return any(_contains(shapes, x, w, depth + 1) for x in node.inputs)
    return False


def _causal_proved(m: Match, graph: gs.Graph, shapes: facts.ShapeTable):
    """c is proved true everywhere and y's shape contains its witness's (And(c, y) is y)."""
    if gu.is_graph_output(graph, m.output):
        return fail("its output is a graph output")
    c, y = m["c"], m["y"]
    w = _all_true(shapes, c)
    if not isinstance(w, gs.Tensor):
        other = _all_true(shapes, y)
        return w if isinstance(other, gs.Tensor) else fail(f"neither input is proved true everywhere: {w.reason}; "
                                                           f"{other.reason}")
    if y.dtype != np.bool_:
        return fail(f"'{y.name}' is not bool")
    if not _contains(shapes, y, w):
        return fail(f"'{y.name}''s shape is not provably a broadcast of '{w.name}''s (the And could widen it)")
    return True


# An arange over one axis: Range(0, n, 1) with size-1 axes inserted by Unsqueeze.
ARANGE = through(["Unsqueeze"], op.Range(Const(0.0), ANY, Const(1.0), _name="range"), _DEPTH, name="unsqueezes")


def _arange(t: gs.Tensor):
    """(axis, rank, Range node) when t is Range(0, n, 1) with size-1 axes inserted by Unsqueeze
    (constant axes): every element is its coordinate on that axis."""
    m = match_value(ARANGE, t)
    if m is None:
        return None
    axis, rank = 0, 1
    for unsqueeze in reversed(m["unsqueezes"]):
        axes = gu.constant_ints(unsqueeze.inputs[1]) if len(unsqueeze.inputs) > 1 else gu.attr(unsqueeze, "axes")
        if axes is None:
            return None
        out_rank = rank + len(axes)
        inserted = sorted({int(a) % out_rank for a in axes if -out_rank <= int(a) < out_rank})
        if len(inserted) != len(axes):
            return None
        kept = [i for i in range(out_rank) if i not in inserted]
        axis, rank = kept[axis], out_rank
    return axis, rank, m["range"]


# A dim read at run time: Gather(Shape(z), k), axis 0, the whole shape.
DIM_OF = op.Gather(op.Shape(Var("z"), start=lambda v: not v, end=lambda v: v is None), Var("k"),
                   axis=lambda v: v is None or int(v) == 0)


def _dim_of(t: gs.Tensor):
    """(z, k) when t = Gather(Shape(z), k) (a scalar or a 1-element index), else None."""
    m = match_value(DIM_OF, t)
    idx = gu.constant_value(m["k"]) if m is not None else None
    if idx is None or idx.size != 1:
        return None
    return m["z"], int(idx.reshape(-1)[0])


def _dim_token(shapes: facts.ShapeTable, t: gs.Tensor) -> dict | None:
    """The affine form of a dim read at run time (Gather(Shape(z), k), Slice(Shape(z), k, k + 1),
    Shape(z, start=k, end=k + 1)): {"": n} for a static dim, {"dim:name": 1} for a named one."""
    found = _dim_of(t)
    node = gu.producer(t)
    if found is None and gu.is_op(node, "Slice") and len(node.inputs) in (3, 4):
        st, en = gu.constant_ints(node.inputs[1]), gu.constant_ints(node.inputs[2])
        ax = gu.constant_ints(node.inputs[3]) if len(node.inputs) == 4 else [0]
        shape = gu.producer(node.inputs[0])
        if st and en and ax == [0] and len(st) == 1 and en == [st[0] + 1] and st[0] >= 0 and gu.is_op(shape, "Shape") \
                and not shape.attrs.get("start") and "end" not in shape.attrs:
            found = shape.inputs[0], st[0]
    if found is None and gu.is_op(node, "Shape") and "end" in node.attrs:
        start, end = int(node.attrs.get("start", 0)), int(node.attrs["end"])
        if start >= 0 and end == start + 1:
            found = node.inputs[0], start
    if found is None:
        return None
    zd = shapes.dims(found[0])
    if zd is None or not -len(zd) <= found[1] < len(zd):
        return None
    return _token(zd[found[1]])


def _token(d) -> dict | None:
    if isinstance(d, (int, np.integer)):
        return {"": int(d)}
    if isinstance(d, str) and d:
        return {f"dim:{d}": 1, "": 0}
    return None


def _exact(shapes: facts.ShapeTable, t: gs.Tensor) -> dict | None:
    """The value of a one-element integer tensor as an affine form, when its bounds meet."""
    d = shapes.dims(t)
    if d is None or any(x != 1 for x in d):
        return None
    b = _bounds(shapes, t)
    return b[0] if b is not None and b[0] == b[1] else None


def _nonnegative(form: dict) -> bool:
    return form.get("", 0) >= 0 and all(k == "" or (k.startswith("dim:") and v > 0) for k, v in form.items())


def _shape_tokens(shapes: facts.ShapeTable, t: gs.Tensor, depth: int = 0) -> list | None:
    """The elements of a 1-D integer shape tensor as affine forms, or None."""
    if depth > _DEPTH:
        return None
    value = gu.constant_value(t)
    if value is not None:
        return [{"": int(v)} for v in value.reshape(-1)] if value.ndim == 1 and value.dtype.kind == "i" else None
    node = gu.producer(t)
    if gu.is_op(node, "Concat") and int(gu.attr(node, "axis", 0)) in (0, -1):
        out = []
        for part in node.inputs:
            got = _shape_tokens(shapes, part, depth + 1)
            if got is None:
                return None
            out += got
        return out
    if gu.is_op(node, "Cast") and np.dtype(_np_type(gu.attr(node, "to", 0))) in _INT:
        return _shape_tokens(shapes, node.inputs[0], depth + 1)
    if gu.is_op(node, "Shape") and not node.attrs.get("start") and "end" not in node.attrs:
        return _tensor_dims(shapes, node.inputs[0], {}, depth + 1)
    if gu.is_op(node, "Where") and len(node.inputs) == 3:
        eq = gu.producer(node.inputs[0])
        c = node.inputs[2]
        if gu.is_op(eq, "Equal") and eq.inputs[0] is c:
            probe, repl = gu.constant_value(eq.inputs[1]), gu.constant_value(node.inputs[1])
            got = _shape_tokens(shapes, c, depth + 1)
            if got is None or probe is None or repl is None or probe.size not in (1, len(got)) \
                    or repl.size not in (1, len(got)):
                return None
            out = []
            for i, tok in enumerate(got):
                v, r = int(probe.reshape(-1)[i % probe.size]), int(repl.reshape(-1)[i % repl.size])
                if set(tok) == {""}:
                    out.append({"": r} if tok[""] == v else tok)
                elif v < 0 and _nonnegative(tok):
                    out.append(tok)
                else:
                    return None
            return out
        return None
    one = _exact(shapes, t)
    return [one] if one is not None else None


def _tensor_dims(shapes: facts.ShapeTable, x: gs.Tensor, known: dict, depth: int = 0) -> list | None:
    """x's dims as affine forms: from the rewrites of this pass (`known`), through Unsqueeze,
    Casts, broadcasting ops and Expand, else as inference gives them."""
    if x.name in known:
        return known[x.name]
    if depth > _DEPTH:
        return None
    value = gu.constant_value(x)
    if value is not None:
        return [{"": int(n)} for n in value.shape]
    node = gu.producer(x)
    if gu.is_op(node, "Cast", "Identity"):
        return _tensor_dims(shapes, node.inputs[0], known, depth + 1)
    if gu.is_op(node, "Unsqueeze") and len(node.inputs) == 2:
        inner, axes = _tensor_dims(shapes, node.inputs[0], known, depth + 1), gu.constant_ints(node.inputs[1])
        if inner is not None and axes is not None:
            rank = len(inner) + len(axes)
            inserted = {a % rank for a in axes}
            it = iter(inner)
            return [{"": 1} if i in inserted else next(it) for i in range(rank)]
    if gu.is_op(node, "Expand") and len(node.inputs) == 2:
        return _broadcast([_tensor_dims(shapes, node.inputs[0], known, depth + 1),
                           _shape_tokens(shapes, node.inputs[1], depth + 1)])
    if gu.is_op(node, *_BROADCAST):
        return _broadcast([_tensor_dims(shapes, t, known, depth + 1) for t in node.inputs])
    dims = shapes.dims(x)
    if dims is None:
        return None
    out = [_token(d) for d in dims]
    return None if any(t is None for t in out) else out


def _broadcast(all_dims: list) -> list | None:
    """The broadcast of dims given as affine forms, where each axis is provably one size."""
    if any(d is None for d in all_dims):
        return None
    rank = max(len(d) for d in all_dims)
    out = []
    for i in range(rank):
        axis = [d[len(d) - rank + i] for d in all_dims if len(d) - rank + i >= 0]
        big = [t for t in axis if t != {"": 1}]
        if any(t != big[0] for t in big):
            return None
        out.append(big[0] if big else {"": 1})
    return out


def _expands_nothing(m: Match, graph: gs.Graph, shapes: facts.ShapeTable, known: dict):
    """Expand(x, t) is x: t broadcast to x's dims is x's dims (both as affine forms)."""
    if gu.is_graph_output(graph, m.output):
        return fail("its output is a graph output")
    x = m["x"]
    dx, dt = _tensor_dims(shapes, x, known), _shape_tokens(shapes, m["shape"])
    if dx is None:
        return fail(f"the dims of '{x.name}' are not known as affine forms")
    if dt is None:
        return fail(f"the elements of its target '{m['shape'].name}' are not known as affine forms")
    if len(dt) > len(dx) or _broadcast([dx, dt]) != dx:
        return fail(f"its target is not provably one that leaves '{x.name}''s dims as they are")
    return True


class _LazyDims:
    """Values of shape tensors over the dims refined with shape_values.refined_dims, worked out
    when a candidate first asks (they cost shape inference rounds a model without one skips)."""

    def __init__(self, graph: gs.Graph, shapes: facts.ShapeTable) -> None:
        self._graph, self._shapes, self._ev = graph, shapes, None

    def get(self) -> ShapeEvaluator:
        if self._ev is None:
            self._ev = refined_dims(self._graph, self._shapes)[1]
        return self._ev


def _is_dim(lazy: _LazyDims, t: gs.Tensor, data: gs.Tensor, axis: int) -> bool:
    """t's one element is dim `axis` of data: the same monomial over the model's dims
    (shape_values), wherever t reads it from (Gather(Shape(data), axis), a dim of another tensor
    the facts prove the same size, a constant equal to a static dim)."""
    ev = lazy.get()
    value, dims = ev.value(t), ev.dim_symbols(data)
    return (value is not None and len(value.elems) == 1 and value.elems[0] is not None and dims is not None
            and -len(dims) <= axis < len(dims) and value.elems[0] == dims[axis])


def _rows_of(shapes: facts.ShapeTable, ev: _LazyDims, range_node: gs.Node, data: gs.Tensor) -> bool:
    """The Range's length is D's dim 0: by inference (one symbolic name or static size), or its
    limit's value is that dim."""
    n, rows = shapes.dims(range_node.outputs[0]), shapes.dims(data)[0]
    return (n is not None and _same_dim(n[0], rows)) or _is_dim(ev, range_node.inputs[1], data, 0)


def _same_dim(a, b) -> bool:
    return a is not None and a == b and (isinstance(a, (int, np.integer)) or isinstance(a, str))


# The flat index of the padding grid, i = a_b * T + a_k; the engine tries both orders of the Add
# and of the Mul, in that order.
FLAT_INDEX = op.Add(op.Mul(Var("ab"), Var("stride")), Var("ak"))


def _flat_index(shapes: facts.ShapeTable, ev: _LazyDims, i: gs.Tensor, data: gs.Tensor):
    """(p, q, rank, n_k) when i = a_b * T + a_k as described in the module docstring, else why not."""
    dd = shapes.dims(data)
    if dd is None or len(dd) != 2:
        return fail(f"the mask '{data.name}' is not of rank 2")
    add = gu.producer(i)
    if add is None or add.outputs[0] is not i:
        return fail(f"the index '{i.name}' is computed by no node")
    # the reason of the way that got furthest: (stage, reason)
    why: list = [(0, None)]
    found = {}

    def note(stage: int, reason: str) -> bool:
        if stage >= why[0][0]:
            why[0] = (stage, reason)
        return False

    def grid(m: Match) -> bool:
        ab, stride, ak = m["ab"], m["stride"], m["ak"]
        fb, fk = _arange(ab), _arange(ak)
        if fb is None or fk is None:
            return note(1, f"'{ab.name}' and '{ak.name}' are not both Range(0, n, 1) with size-1 axes inserted")
        if not _is_dim(ev, stride, data, 1):
            return note(2, f"the row stride '{stride.name}' is not provably dim 1 of the mask '{data.name}'")
        (p, rb, range_b), (q, rk, range_k) = fb, fk
        rank = max(rb, rk)
        p, q = p + rank - rb, q + rank - rk
        if p >= q:
            return note(3, f"the batch arange '{ab.name}' is not on an axis before the key arange's")
        if not _rows_of(shapes, ev, range_b, data):
            return note(4, f"the length of Range '{range_b.name}' is not provably dim 0 of the mask '{data.name}'")
        found["grid"] = (p, q, rank, range_k.inputs[1])
        return True

    unmatched: list = []
    if match(FLAT_INDEX, add, frozenset(), private=False, condition=grid, why=unmatched) is not None:
        return found["grid"]
    return fail(why[0][1] or f"the index '{i.name}': {unmatched[0]}")


def _padding_grid(m: Match, graph: gs.Graph, shapes: facts.ShapeTable, ev: _LazyDims):
    """Binds "grid": (p, q, rank, n_k) for the Slice, where the gathered elements are D[b, k]."""
    data, g, r1 = m["data"], m["gather"].outputs[0], m["r1"].outputs[0]
    if shapes.rank(data) != 2:
        return fail(f"the mask '{data.name}' is not of rank 2")
    if "flat_shape" in m.bindings and gu.constant_ints(m["flat_shape"]) not in ([-1, 1], [-1]):
        return fail(f"Reshape '{m['flat'].name}' does not flatten to [-1, 1] or [-1]")
    if gu.constant_ints(m["minus_one"]) != [-1]:
        return fail(f"Reshape '{m['r1'].name}' does not flatten to [-1]")
    for t in (g, r1):
        if len(t.outputs) != 1 or gu.is_graph_output(graph, t):
            return fail(f"'{t.name}' is read elsewhere")
    found = _flat_index(shapes, ev, m["i"], data)
    if isinstance(found, Failure):
        return found
    if found[3].dtype is None or np.dtype(found[3].dtype) != np.int64:
        return fail(f"the key length '{found[3].name}' is not int64")
    m.bindings["grid"] = found
    return True


def _slice_rows(graph: gs.Graph, m: Match, shapes: facts.ShapeTable, known: dict) -> bool:
    """Reshape(Reshape(Gather(flat D, i), [-1]), Shape(i)) -> Unsqueeze(Slice(D, 0, n_k, axis 1))."""
    data, r2 = m["data"], m.root
    p, q, rank, n_k = m["grid"]
    out = r2.outputs[0]
    rows, cols_form = _token(shapes.dims(data)[0]), _exact(shapes, n_k)
    if rows is not None and cols_form is not None:  # the Slice has n_k columns wherever the original runs
        known[out.name] = [rows if k == p else cols_form if k == q else {"": 1} for k in range(rank)]
    w = NodeWriter(graph)
    end = w.value(f"{out.name}_columns", np.int64, [1])
    cols = w.value(f"{out.name}_rows", data.dtype)
    axes = w.constant(f"{out.name}_axes", np.array([k for k in range(rank) if k not in (p, q)], np.int64))
    zero = w.constant("decode_mask_zero", np.array([0], np.int64))
    one = w.constant("decode_mask_one", np.array([1], np.int64))
    r2.outputs.clear()
    w.op("Reshape", n_k, one, name=end.name, out=end)
    w.op("Slice", data, zero, end, one, name=cols.name, out=cols)
    w.op("Unsqueeze", cols, axes, name=f"{out.name}_grid", out=out)
    graph.nodes += w.nodes
    return True


_D, _I = Var("data"), Var("i")
_FLAT = {
    "flatten": op.Flatten(_D, _name="flat", axis=lambda v: v is not None and int(v) == 2),  # [R * T, 1]
    "reshape": op.Reshape(_D, Var("flat_shape"), _name="flat"),
}
_SHAPE = op.Shape(_I, _name="shape", start=lambda v: not v, end=lambda v: v is None)
_TARGET = {"shape": _SHAPE, "concat": op.Concat(_SHAPE)}


def _padding(flat, target):
    """The gathered elements put back in i's shape: Reshape(Reshape(g, [-1]), Shape(i))."""
    gather = op.Gather(flat, _I, _name="gather", axis=lambda v: v is None or int(v) == 0)
    return op.Reshape(op.Reshape(gather, Var("minus_one"), _name="r1"), target)


CAUSAL = op.And(Var("c"), Var("y"))
PADDING = {f"{f}/{t}": _padding(_FLAT[f], _TARGET[t]) for f in _FLAT for t in _TARGET}
NOOP_EXPAND = op.Expand(Var("x"), Var("shape"))


# A Reshape of a Reshape of a Gather: the form --explain reports on (every other Reshape is no
# candidate of the padding rules).
PADDING_CANDIDATE = op.Reshape(op.Reshape(op.Gather(ANY, ANY), ANY), ANY)


def _padding_candidate(node: gs.Node) -> bool:
    return match(PADDING_CANDIDATE, node, private=False) is not None


def decode_mask(graph: gs.Graph, ctx: Context) -> int:
    if not any(gu.is_op(n, "And", "Gather", "Expand") for n in graph.nodes):
        return 0
    facts.refresh_shapes(graph)
    shapes = facts.ShapeTable(graph)
    ev = _LazyDims(graph, shapes)
    known: dict = {}
    explain = ctx.explainer
    padding_explain = None if explain is None else (
        lambda node, why: explain(node, why) if _padding_candidate(node) else None)
    done = apply(graph, [Rule("decode-mask/causal", CAUSAL, read_instead("y"),
                              lambda m, g: _causal_proved(m, g, shapes), private=False)], explain)
    done += apply(graph, [Rule(f"decode-mask/padding/{name}", pattern, lambda g, m: _slice_rows(g, m, shapes, known),
                               lambda m, g: _padding_grid(m, g, shapes, ev), private=False)
                          for name, pattern in PADDING.items()], padding_explain)
    done += apply(graph, [Rule("decode-mask/expand", NOOP_EXPAND, read_instead("x"),
                               lambda m, g: _expands_nothing(m, g, shapes, known), private=False)], explain)
    if done:
        gu.cleanup(graph)
        gu.toposort(graph)
    return done


PASS = Pass(
    "decode-mask",
    480,
    "a decode step's causal mask proved all-true dropped from its And; a padding mask gathered by a flat "
    "index grid read as a Slice",
    decode_mask,
)
