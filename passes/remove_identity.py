"""Identity and inference-mode Dropout removal.

remove-identity
    match:     Identity(x) -> y
    condition: y can be renamed away; when y is a graph output, x's producer can be made to
               write y instead (x is no graph input, initializer or other graph output)
    rewrite:   readers of y read x (or x's producer writes y)

remove-dropout
    match:     Dropout(x, [ratio], [training_mode]) -> y, [mask]
    condition: inference mode (training_mode absent or constant false; is_test=1 before opset 7),
               the mask output unused
    rewrite:   as Identity
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import rules
from onnxfuse.graph.rules import ANY, Match, Rule, Var, fail, op
from onnxfuse.pipeline import Context, Pass

x = Var("x")


def _bypass(graph: gs.Graph, m: Match):
    return gu.bypass(graph, m.root) or fail("its output is read (the mask, or a graph output whose input"
                                            " cannot take its name)")


def _dropout_in_inference(m: Match, graph: gs.Graph):
    node = m.root
    if (graph.opset or 1) < 7:
        # Dropout-1 and -6 run the training behaviour unless is_test is set.
        return bool(gu.attr(node, "is_test", 0)) or fail("is_test is not set (training mode before opset 7)")
    if len(node.inputs) < 3 or not gu.is_present(node.inputs[2]):
        return True
    mode = gu.constant_value(node.inputs[2])
    return (mode is not None and mode.size == 1 and not bool(mode.reshape(-1)[0])) or fail(
        "training_mode is not a constant false")


IDENTITY = Rule("remove-identity", op.Identity(x), rewrite=_bypass)
# ratio and training_mode are inputs from opset 12; the mask is a second output (bypass keeps
# the node when it is read).
DROPOUT = Rule("remove-dropout", op.Dropout(x, ANY, ANY, _outputs=None), rewrite=_bypass,
               condition=_dropout_in_inference)


def remove_identity(graph: gs.Graph, ctx: Context) -> int:
    return rules.apply(graph, [IDENTITY], ctx.explainer)


def remove_dropout(graph: gs.Graph, ctx: Context) -> int:
    return rules.apply(graph, [DROPOUT], ctx.explainer)


PASSES = [
    Pass("remove-identity", 100, "drop Identity nodes (graph output names kept)", remove_identity),
    Pass("remove-dropout", 105, "drop inference-mode Dropout whose mask is unused", remove_dropout),
]
