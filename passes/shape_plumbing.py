"""Shape plumbing: constant Reshape/Expand targets instead of run-time Shape arithmetic.

Exporters build Reshape targets at run time (Shape -> Gather -> Unsqueeze -> Concat, with
Mul/Div on the way) so that the batch and sequence dims stay dynamic. Each of those is a kernel
per inference. Most targets can be written as constants with Reshape's 0 (copy the input's dim
at the same position) and -1 (infer the one remaining dim), which keep the dims dynamic.

The pass evaluates shape tensors symbolically: every element is a monomial coef * d1 * d2 ...
over the model's dims, where a dim is a number when static and a symbol otherwise (a symbolic
dim name, or one anonymous symbol per unnamed position). Dims of tensors come from shape
inference, so the Reshape's input and the tensor whose Shape was taken need not be the same
tensor: dims with the same symbolic name are the same size.

shape-plumbing
    match:     Reshape(x, t) with t computed;
    condition: every element of t is a constant, equal to x's dim at the same position (-> 0,
               not with allowzero=1), or it is the only element left (-> -1) and all the others
               are positive constants (so a zero-sized dynamic dim cannot make -1 ambiguous)
    rewrite:   Reshape(x, constant)
    match:     Expand(x, t) with t computed
    condition: every element of t is a constant or equal to x's dim it aligns with (-> 1)
    rewrite:   Expand(x, constant)
    match:     any shape tensor whose elements are all constants (static shapes)
    rewrite:   the constant
The Shape/Gather/... nodes left without readers are removed by the graph cleanup.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph.facts import ShapeTable
from onnxfuse.graph.shape_values import Mono, ShapeEvaluator, numpy_dtype
from onnxfuse.graph.slices import slice_indices
from onnxfuse.pipeline import Context, Pass

MAX_ROUNDS = 4  # re-infer shapes after rewrites: a constant target makes the output's dims known


# Facts about dims onnx shape inference does not derive ---------------------------------------

# The dim of x[..., 0:e] along an axis of static size D is min(e, D): a name of its own.
_MIN = "onnxfuse.min"
_BROADCAST_OPS = {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Equal", "Less", "Greater",
                  "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Mod", "PRelu", "BitShift"}


def _min_name(sym: str, bound: int) -> str:
    return f"{_MIN}({sym},{bound})"


def _broadcast_dim(a, b):
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


def _dim_facts(graph: gs.Graph, shapes: ShapeTable, ev: "ShapeEvaluator") -> dict[str, list]:
    """Dims of Slice outputs with run-time bounds and of broadcasts of them: what a causal mask
    sliced to the sequence length, added to the attention scores, needs to keep the
    sequence dim's name."""
    facts: dict[str, list] = {}

    def dims(t):
        return facts.get(t.name) or shapes.dims(t)

    for node in graph.nodes:
        if not node.outputs or not gu.is_present(node.outputs[0]) or not gu.is_default_domain(node):
            continue
        out = node.outputs[0]
        new = None
        if node.op == "Slice" and (graph.opset or 1) >= 10 and len(node.inputs) >= 3:
            new = _slice_dims(node, dims(node.inputs[0]), ev)
        elif node.op == "Range" and len(node.inputs) == 3:
            new = _range_dims(*(ev.value(t) for t in node.inputs))
        elif node.op in _BROADCAST_OPS and len(node.outputs) == 1:
            ins = [dims(t) for t in node.inputs]
            if all(d is not None for d in ins) and ins:
                rank = max(len(d) for d in ins)
                padded = [[1] * (rank - len(d)) + list(d) for d in ins]
                new = []
                for column in zip(*padded):
                    r = column[0]
                    for c in column[1:]:
                        r = _broadcast_dim(r, c) if r is not None else None
                    new.append(r)
        if new is None:
            continue
        old = shapes.dims(out)
        if old is not None and len(old) == len(new):
            new = [n if n is not None else o for n, o in zip(new, old)]
        if _better(new, old):
            facts[out.name] = new
    return facts


def _range_dims(start, limit, delta) -> list | None:
    """Range(0, e, 1) has e elements: e's name, where e is one named dim."""
    if start is None or limit is None or delta is None or start.constant != [0] or delta.constant != [1]:
        return None
    e = limit.elems[0]
    if e is None or e[0] != 1 or len(e[1]) != 1 or e[1][0].startswith("\0"):
        return None
    return [e[1][0]]


def _slice_dims(node: gs.Node, in_dims: list | None, ev: "ShapeEvaluator") -> list | None:
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
        elif (e is not None and s0 == 0 and k == 1 and isinstance(dim, int) and dim >= 1 and e[0] == 1
              and len(e[1]) == 1 and not e[1][0].startswith("\0")):
            out[a] = _min_name(e[1][0], dim)
        else:
            out[a] = None
    return out


def _same_dim(elem: Mono | None, dim: Mono) -> bool:
    return elem is not None and elem == dim


def reshape_target(ev: ShapeEvaluator, node: gs.Node) -> list[int] | None:
    """A constant target equivalent to the Reshape's computed one, or None."""
    target = ev.value(node.inputs[1])
    if target is None or target.rank != 1:
        return None
    allowzero = int(gu.attr(node, "allowzero", 0)) == 1
    in_dims = ev.dim_symbols(node.inputs[0]) or []
    out: list[int | None] = []
    for i, e in enumerate(target.elems):
        if e is not None and not e[1]:
            out.append(e[0])  # constants, including an existing 0 or -1, mean what they meant
        elif not allowzero and i < len(in_dims) and _same_dim(e, in_dims[i]):
            out.append(0)
        else:
            out.append(None)
    unknown = [i for i, v in enumerate(out) if v is None or v == -1]
    if not unknown:
        return out  # type: ignore[return-value]
    if len(unknown) > 1:
        return None
    rest = [v for i, v in enumerate(out) if i != unknown[0]]
    # -1 divides the element count by the product of the rest: it must never be zero.
    if any(v is None or v <= 0 for v in rest):
        return None
    out[unknown[0]] = -1
    return out  # type: ignore[return-value]


def expand_target(ev: ShapeEvaluator, node: gs.Node) -> list[int] | None:
    target = ev.value(node.inputs[1])
    if target is None or target.rank != 1:
        return None
    in_dims = ev.dim_symbols(node.inputs[0])
    if in_dims is None:
        return None
    offset = len(target.elems) - len(in_dims)
    out = []
    for i, e in enumerate(target.elems):
        if e is not None and not e[1]:
            out.append(e[0])
        elif i - offset >= 0 and _same_dim(e, in_dims[i - offset]):
            out.append(1)  # broadcasting 1 against the input's dim gives that dim
        else:
            return None
    return out


def _is_computed(tensor: gs.Tensor) -> bool:
    return not gu.is_constant(tensor)


def _reads_dims(graph: gs.Graph) -> bool:
    """Whether this round can read a tensor's dims: a Shape or Size node, a Reshape or Expand
    with a computed target, or a Slice or Range (the only nodes whose dims facts refine). A
    graph without any needs no shape inference, which is most of what the pass costs there."""
    opset = graph.opset or 1
    for node in graph.nodes:
        if gu.is_op(node, "Shape", "Size", "Slice", "Range"):
            return True
        if (
            ((gu.is_op(node, "Reshape") and opset >= 5) or gu.is_op(node, "Expand"))
            and len(node.inputs) >= 2
            and gu.is_present(node.inputs[1])
            and _is_computed(node.inputs[1])
        ):
            return True
    return False


def _rewrite_round(graph: gs.Graph) -> int:
    gu.toposort(graph)
    if not _reads_dims(graph):
        shapes = ShapeTable(graph, infer=False)  # never consulted (see _reads_dims)
        ev = ShapeEvaluator(graph, shapes)
    else:
        shapes = ShapeTable(graph)
        ev = ShapeEvaluator(graph, shapes)
        for _ in range(MAX_ROUNDS):
            facts = _dim_facts(graph, shapes, ev)
            if not facts:
                break
            shapes = shapes.refined(graph, facts)
            ev = ShapeEvaluator(graph, shapes)
    taken = gu.tensor_names(graph) | {n.name for n in graph.nodes}
    rewrites = 0
    for node in list(graph.nodes):
        if len(node.inputs) < 2 or not gu.is_present(node.inputs[1]) or not _is_computed(node.inputs[1]):
            continue
        if gu.is_op(node, "Reshape") and (graph.opset or 1) >= 5:
            target = reshape_target(ev, node)
        elif gu.is_op(node, "Expand"):
            target = expand_target(ev, node)
        else:
            continue
        if target is None:
            continue
        base = f"{node.name or node.op.lower()}_shape"
        node.inputs[1] = gu.make_constant(graph, base, np.array(target, dtype=np.int64), taken)
        rewrites += 1
    # Shape arithmetic on static dims that something else reads (Range, ConstantOfShape, Slice
    # bounds, ...): the value is known now. Shape values equal element by element to one computed
    # earlier (the same dims read from another tensor of the same shape, as every block of a
    # transformer does) are read from the earlier one. Earlier in topological order, so no
    # cycle can form.
    gu.toposort(graph)
    seen: dict[tuple, gs.Tensor] = {}
    for node in list(graph.nodes):
        if not gu.is_default_domain(node) or node.op == "Constant":
            continue
        for out in node.outputs:
            if not gu.is_present(out) or not out.outputs or gu.is_graph_output(graph, out):
                continue
            v = ev.value(out)
            if v is None:
                continue
            if v.constant is None:
                if all(e is not None for e in v.elems) and not gu.is_graph_output(graph, out):
                    key = (v.rank, v.elems, v.dtype.str)
                    first = seen.setdefault(key, out)
                    if first is not out:
                        rewrites += bool(gu.replace_uses(out, first))
                continue
            arr = np.array(v.constant, dtype=v.dtype).reshape(() if v.rank == 0 else (-1,))
            if out.dtype is not None and numpy_dtype(out.dtype) != arr.dtype:
                continue
            rewrites += bool(gu.replace_uses(out, gu.make_constant(graph, f"{out.name}_value", arr, taken)))
    return rewrites


def shape_plumbing(graph: gs.Graph, ctx: Context) -> int:
    total = 0
    for _ in range(MAX_ROUNDS):
        n = _rewrite_round(graph)
        total += n
        if not n:
            break
        gu.cleanup(graph)
    return total


PASS = Pass(
    "shape-plumbing",
    200,
    "constant Reshape/Expand targets (0 = keep dim, -1 = infer) instead of run-time Shape arithmetic",
    shape_plumbing,
)
