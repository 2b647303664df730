"""Constant-index Gathers become Slices of one Reshape that fused regions read in place.

gather-rows-as-slices
    match:     n >= 2 Gather(Y, i_k, axis=a) on one tensor Y with scalar constant indices i_k and
               static dims [..., T, d, ...] (T at axis a, not the last axis): the per-step inputs
               an unrolled RNN takes from a [batch, steps, features] or [steps, batch, features]
               tensor
    condition: every reader of every Gather output is an elementwise op (one the pointwise pass
               fuses), so each row block can be read in place by the fused region; otherwise
               onnxruntime turns the Gathers into one Split plus a Squeeze per output, which is
               no more kernels than the rewrite would leave; and Y is not a float16 value computed
               by a node other than a Cast (see _unrounded_half)
    rewrite:   Y2 = Reshape(Y, [..., T * d, ...]) (axes a and a+1 merged, once: no copy), and
               member k's output = Slice(Y2, axis a, [i_k * d, (i_k + 1) * d)), which equals
               Gather(Y, i_k, axis=a) and which the pointwise pass folds into the region that
               reads it. For char-rnn the 16 step inputs stop costing a Split and 16 Squeezes.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import rules
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.patterns import ELEMENTWISE
from onnxfuse.graph.rules import Match, Rule, Var, fail, op
from onnxfuse.graph.writer import NodeWriter
from onnxfuse.pipeline import Context, Pass


def _row(m: Match, graph: gs.Graph):
    """The member's (axis, row) in m.bindings when Y is a static [..., T, d, ...] variable, the
    index a scalar integer constant in range and every reader elementwise."""
    node, y = m.root, m["y"]
    idx = gu.constant_value(m["i"])
    shape = gu.static_shape(y)
    if idx is None or idx.ndim != 0 or idx.dtype.kind not in "iu":
        return fail("its index is not a scalar integer constant")
    if shape is None or len(shape) < 2:
        return fail("its data has no static shape of rank 2 or more")
    axis = int(gu.attr(node, "axis", 0))
    axis = axis + len(shape) if axis < 0 else axis
    if not 0 <= axis < len(shape) - 1:
        return fail(f"it gathers along axis {axis}, the last (or none) of {shape}")
    if isinstance(y, gs.Constant):
        return fail("its data is a constant (constant folding's business, not a view)")
    if _unrounded_half(y):
        return fail("its data is a computed float16 value, which onnxruntime may hold in float32 for one"
                    " Gather but rounds for a Reshape and Slice")
    i = int(idx)
    i = i + shape[axis] if i < 0 else i
    if not 0 <= i < shape[axis]:
        return fail(f"index {int(idx)} is out of range for {shape[axis]} rows")
    out = node.outputs[0]
    if gu.is_graph_output(graph, out) or not out.outputs:
        return fail("its output is a graph output or unread")
    if not all(gu.is_op(r, *ELEMENTWISE) for r in out.outputs):
        return fail("a reader of its output is not elementwise (no fused region would read the slice in place)")
    m.bindings.update(axis=axis, row=i)
    return True


def _unrounded_half(y: gs.Variable) -> bool:
    """Whether onnxruntime may read float16 `y` unrounded through the Gather. Its CPU float16
    emulation runs a node without a float16 kernel (Mul, Min...) in float32 and drops the Cast
    pair it puts around a node that has one (Gather) between two such nodes: that Gather reads
    the float32 value. A Reshape then a Slice have kernels next to each other and keep their
    Cast to float16, so the rows of the rewrite are rounded where the Gather's were not (fuzz
    seed 9325856: a product of 3.6e-15, 0 in float16, is a PRelu slope). A graph input or a
    Cast's float16 output holds rounded values either way."""
    if y.dtype is None or np.dtype(y.dtype) != np.float16:
        return False
    made_by = gu.producer(y)
    return made_by is not None and not gu.is_op(made_by, "Cast")


ROW = Rule("gather-rows-as-slices", op.Gather(Var("y"), Var("i")), condition=_row)


def run(graph: gs.Graph, ctx: Context) -> int:
    if not rules.any_root(graph, [ROW]):
        return 0  # no Gather: no shape inference paid
    refresh_shapes(graph)
    groups: dict[tuple[int, int], list[Match]] = defaultdict(list)
    for _, m in rules.find_all(graph, [ROW], ctx.explainer):
        groups[(id(m["y"]), m["axis"])].append(m)
    made = 0
    for members in groups.values():
        if len(members) < 2:
            if ctx.explainer is not None:
                ctx.explainer(members[0].root, "the only such Gather of its tensor along that axis")
            continue
        y, axis = members[0]["y"], members[0]["axis"]
        shape = list(gu.static_shape(y))
        rows = shape[axis + 1]
        flat_shape = shape[:axis] + [shape[axis] * rows] + shape[axis + 2:]
        w = NodeWriter(graph)
        flat = w.value(f"{y.name}_rows", y.dtype, flat_shape)
        base = flat.name
        target = w.constant(f"{base}_shape", np.asarray(flat_shape, np.int64))
        w.op("Reshape", y, target, name=f"{base}/Reshape", out=flat)
        axes = w.constant(f"{base}_axes", np.asarray([axis], np.int64))
        for k, m in enumerate(members):
            node, i = m.root, m["row"]
            out = gu.take_output([node], node.outputs[0], shape[:axis] + shape[axis + 1:])
            starts = w.constant(f"{base}_start{i}", np.asarray([i * rows], np.int64))
            ends = w.constant(f"{base}_end{i}", np.asarray([(i + 1) * rows], np.int64))
            w.op("Slice", flat, starts, ends, axes, name=f"{base}/Slice_{k}", out=out)
        graph.nodes.extend(w.nodes)
        made += len(members)
    return made  # the pipeline sorts the graph after a pass that rewrote


PASS = Pass(
    name="gather-rows-as-slices",
    order=450,
    summary="constant-index Gathers -> Slices of one Reshape, read in place by fused regions (RNN step inputs)",
    run=run,
)
