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
from onnxfuse.graph import rules
from onnxfuse.graph.facts import ShapeTable
from onnxfuse.graph.rules import Match, Rule, Var, fail, op
from onnxfuse.graph.shape_values import Mono, ShapeEvaluator, element_count, exact_quotient, numpy_dtype, refined_dims
from onnxfuse.graph.slices import slice_indices
from onnxfuse.pipeline import Context, Pass

MAX_ROUNDS = 4  # re-infer shapes after rewrites: a constant target makes the output's dims known


def _same_dim(elem: Mono | None, dim: Mono) -> bool:
    return elem is not None and elem == dim


def reshape_target(ev: ShapeEvaluator, node: gs.Node) -> list[int] | None:
    """A constant target equivalent to the Reshape's computed one, or None."""
    target = ev.value(node.inputs[1])
    if target is None or target.rank != 1:
        return None
    # With allowzero = 1 (the dynamo exporter's) a 0 is a zero, not a copy; a target without
    # a literal zero means the same read either way, and the rewrite sets allowzero to 0
    # (_rewrite_round) where the constant copies a dim with 0.
    allowzero = int(gu.attr(node, "allowzero", 0)) == 1 and any(e == (0, ()) for e in target.elems)
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
    if any(v is None or v < 0 for v in rest):
        return None
    if any(v == 0 for v in rest) and not allowzero:
        # -1 beside copied dims would be ambiguous where one of them is zero; the element
        # itself is known when the input's element count over the other elements' product is
        # a constant ([B, S, 64] to [B, S, -1, 16]: 4 heads). Where the original reshape
        # succeeds the two agree.
        if not in_dims or any(v == 0 and i >= len(in_dims) for i, v in enumerate(out)):
            return None
        count = element_count(in_dims)
        others = element_count([in_dims[i] if v == 0 else (v, ()) for i, v in enumerate(out) if i != unknown[0]])
        quotient = exact_quotient(count, others)
        if quotient is None or quotient[1] or quotient[0] <= 0 or element_count([quotient, others]) != count:
            return None
        out[unknown[0]] = quotient[0]
        return out  # type: ignore[return-value]
    # -1 divides the element count by the product of the rest: it must never be zero.
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


# A Reshape (opset >= 5) or Expand whose target is computed at run time.
TARGETED = {name: getattr(op, name)(Var("x"), Var("target")) for name in ("Reshape", "Expand")}


def _constant_target(m: Match, graph: gs.Graph, ev: ShapeEvaluator):
    """Binds "constant": the target as constants (0: keep the dim, -1: infer it)."""
    node = m.root
    if not _is_computed(m["target"]):
        return fail("its target is a constant already")
    if node.op == "Reshape" and (graph.opset or 1) < 5:
        return fail("opset < 5")
    target = reshape_target(ev, node) if node.op == "Reshape" else expand_target(ev, node)
    if target is None:
        return fail("an element of its target is neither a constant nor its input's dim there")
    m.bindings["constant"] = target
    return True


def _write_target(graph: gs.Graph, m: Match, taken: set[str]) -> bool:
    node, target = m.root, m["constant"]
    base = f"{node.name or node.op.lower()}_shape"
    node.inputs[1] = gu.make_constant(graph, base, np.array(target, dtype=np.int64), taken)
    if node.op == "Reshape" and 0 in target and int(gu.attr(node, "allowzero", 0)) == 1:
        node.attrs["allowzero"] = 0  # its zeros copy dims now (reshape_target: no literal zero)
    return True


def _rewrite_round(graph: gs.Graph, explain=None) -> int:
    gu.toposort(graph)
    if not _reads_dims(graph):
        shapes = ShapeTable(graph, infer=False)  # never consulted (see _reads_dims)
        ev = ShapeEvaluator(graph, shapes)
    else:
        shapes, ev = refined_dims(graph, ShapeTable(graph), MAX_ROUNDS)
    taken = gu.taken_names(graph)
    rewrites = rules.apply(graph, [Rule("shape-plumbing/Reshape", TARGETED["Reshape"],
                                        condition=lambda m, g: _constant_target(m, g, ev),
                                        rewrite=lambda g, m: _write_target(g, m, taken)),
                                   Rule("shape-plumbing/Expand", TARGETED["Expand"],
                                        condition=lambda m, g: _constant_target(m, g, ev),
                                        rewrite=lambda g, m: _write_target(g, m, taken))], explain)
    # Shape arithmetic on static dims that something else reads (Range, ConstantOfShape, Slice
    # bounds, ...): the value is known now. Shape values equal element by element are all read
    # from one of them: the one computed in the fewest steps from the graph's inputs (the
    # earliest in the graph among those), so that the longer chains computing the same dims
    # (every block of a transformer reads them from its own tensor) lose their readers. It
    # depends on none of the others' readers (they are deeper than it), so no cycle can form.
    gu.toposort(graph)
    depth: dict[int, int] = {}
    equal: dict[tuple, list[tuple[int, int, gs.Tensor]]] = {}
    # gu.is_graph_output by name, the outputs listed once (per node: quadratic in the graph)
    graph_outputs = {t.name for t in graph.outputs}
    for position, node in enumerate(list(graph.nodes)):
        steps = 1 + max((depth.get(id(p), 0) for t in node.inputs for p in t.inputs), default=0)
        depth[id(node)] = steps
        if not gu.is_default_domain(node) or node.op == "Constant":
            continue
        for out in node.outputs:
            if not gu.is_present(out) or not out.outputs or out.name in graph_outputs:
                continue
            v = ev.value(out)
            if v is None:
                continue
            if v.constant is None:
                if all(e is not None for e in v.elems):
                    equal.setdefault((v.rank, v.elems, v.dtype.str), []).append((steps, position, out))
                continue
            arr = np.array(v.constant, dtype=v.dtype).reshape(() if v.rank == 0 else (-1,))
            if out.dtype is not None and numpy_dtype(out.dtype) != arr.dtype:
                continue
            rewrites += bool(gu.replace_uses(out, gu.make_constant(graph, f"{out.name}_value", arr, taken)))
    for values in equal.values():
        first = min(values, key=lambda v: v[:2])[2]
        for _, _, out in values:
            if out is not first:
                rewrites += bool(gu.replace_uses(out, first))
    return rewrites


def shape_plumbing(graph: gs.Graph, ctx: Context) -> int:
    total = 0
    for _ in range(MAX_ROUNDS):
        n = _rewrite_round(graph, ctx.explainer)
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
