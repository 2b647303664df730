"""Reshape chains: a Reshape of a Reshape reads the first one's input; a Reshape to its input's
own shape goes.

merge-reshapes
    match:     Reshape(Reshape(x, s1), s2), s2 a constant with no 0 entry (or allowzero = 1,
               whose 0 is a real 0): a Reshape keeps the elements in order and reads only their
               count from its input, so the outer Reshape gives the same tensor from x. The inner
               Reshape goes when nothing else reads it.
remove-identity-reshape
    match:     Reshape(x, s) with s a constant of x's rank whose every entry is 0 (allowzero =
               0: copy that dim), x's static dim at that position, or one -1 with every other
               entry so: the output has x's shape.
    rewrite:   readers of the output read x (a graph output keeps its name).
Why: the exporters split heads into [B, S, H, d] and merge them again around attention; once
the attention is one op (the onnxscript-fusions stage's MultiHeadAttention), its output goes
through a Reshape to [B, S, H, d] and one back, which onnxruntime runs as two kernels.
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import rules
from onnxfuse.graph.facts import ShapeTable, lazy_shapes
from onnxfuse.graph.rules import ANY, Match, Rule, Var, fail, op
from onnxfuse.pipeline import Context, Pass

x = Var("x")
# The inner Reshape may have other readers: it goes only when nothing else reads it.
RESHAPE_OF_RESHAPE = op.Reshape(op.Reshape(x, ANY, _name="inner"), Var("shape"))


def _outer_keeps_no_zero(m: Match, graph: gs.Graph):
    s2 = gu.constant_ints(m["shape"])
    if s2 is None:
        return fail("its target shape is not a constant")
    if 0 in s2 and int(gu.attr(m.root, "allowzero", 0)) == 0:
        return fail("its target shape copies a dim (0) of the inner Reshape's output")
    return True


def _read_first_input(graph: gs.Graph, m: Match) -> bool:
    m.root.inputs[0] = m["x"]
    return True


MERGE = Rule("merge-reshapes", RESHAPE_OF_RESHAPE, condition=_outer_keeps_no_zero, rewrite=_read_first_input,
             private=False)


def merge_reshapes(graph: gs.Graph, ctx: Context) -> int:
    return rules.apply(graph, [MERGE], ctx.explainer)


def _is_identity(node: gs.Node, shapes: ShapeTable):
    s = gu.constant_ints(node.inputs[1])
    if s is None:
        return fail("its target shape is not a constant")
    xd = shapes.dims(node.inputs[0])
    if xd is None or len(xd) != len(s):
        return fail(f"its input's rank is {'unknown' if xd is None else len(xd)}, not {len(s)}")
    allowzero = int(gu.attr(node, "allowzero", 0)) != 0
    open_dims = 0
    for want, have in zip(s, xd):
        if want == 0 and not allowzero:
            continue
        if want == -1:
            open_dims += 1
            continue
        if not (isinstance(have, int) and have == want):
            return fail(f"target {s} is not its input's shape {xd}")
    return open_dims <= 1 or fail(f"target {s} has more than one -1")


def _bypass(graph: gs.Graph, m: Match):
    return gu.bypass(graph, m.root) or fail("its output cannot be renamed away")


def remove_identity_reshape(graph: gs.Graph, ctx: Context) -> int:
    shapes = lazy_shapes(graph)
    rule = Rule("remove-identity-reshape", op.Reshape(x, Var("shape")),
                condition=lambda m, g: _is_identity(m.root, shapes), rewrite=_bypass)
    return rules.apply(graph, [rule], ctx.explainer)


PASSES = [
    Pass("merge-reshapes", 210, "a Reshape of a Reshape reads the first one's input", merge_reshapes),
    Pass("remove-identity-reshape", 211, "a Reshape to its input's own shape goes", remove_identity_reshape),
]
