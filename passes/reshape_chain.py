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
from onnxfuse.graph.facts import ShapeTable
from onnxfuse.pipeline import Context, Pass


def _target(node: gs.Node) -> list[int] | None:
    if not gu.is_op(node, "Reshape") or len(node.inputs) != 2:
        return None
    return gu.constant_ints(node.inputs[1])


def merge_reshapes(graph: gs.Graph, ctx: Context) -> int:
    done = 0
    for node in list(graph.nodes):
        s2 = _target(node)
        if s2 is None:
            continue
        inner = gu.producer(node.inputs[0])
        if not gu.is_op(inner, "Reshape"):
            continue
        if 0 in s2 and int(gu.attr(node, "allowzero", 0)) == 0:
            continue
        node.inputs[0] = inner.inputs[0]
        done += 1
    return done


def _is_identity(node: gs.Node, shapes: ShapeTable) -> bool:
    s = _target(node)
    if s is None:
        return False
    xd = shapes.dims(node.inputs[0])
    if xd is None or len(xd) != len(s):
        return False
    allowzero = int(gu.attr(node, "allowzero", 0)) != 0
    open_dims = 0
    for want, have in zip(s, xd):
        if want == 0 and not allowzero:
            continue
        if want == -1:
            open_dims += 1
            continue
        if not (isinstance(have, int) and have == want):
            return False
    return open_dims <= 1


def remove_identity_reshape(graph: gs.Graph, ctx: Context) -> int:
    if not any(_target(n) is not None for n in graph.nodes):
        return 0
    shapes = ShapeTable(graph)
    done = 0
    for node in list(graph.nodes):
        if _is_identity(node, shapes) and gu.bypass(graph, node):
            done += 1
    return done


PASSES = [
    Pass("merge-reshapes", 210, "a Reshape of a Reshape reads the first one's input", merge_reshapes),
    Pass("remove-identity-reshape", 211, "a Reshape to its input's own shape goes", remove_identity_reshape),
]
