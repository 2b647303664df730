"""Symbolic shape values (onnxfuse/graph/shape_values.py) through the TorchScript exporter's
idioms around Expand and Reshape targets."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import facts
from onnxfuse.graph.shape_values import ShapeEvaluator


def test_shape_values_follow_torchscripts_expand_target_idiom():
    # expand(x, sizes) in the TorchScript export: t = Reshape(Concat(dims), [-1]);
    # Where(Equal(t, -1 * ConstantOfShape(Shape(t), 1)), 1, t) is t itself for dims (>= 0).
    x = gs.Variable("x", np.float32, ["batch", "seq", 8])
    c = lambda name, v: gs.Constant(name, np.array(v, np.int64))  # noqa: E731
    t = {k: gs.Variable(k, np.int64) for k in ("shape", "dims", "flat", "len", "ones", "neg", "eq", "target")}
    eq = gs.Variable("eq", np.bool_)
    nodes = [
        gs.Node("Shape", inputs=[x], outputs=[t["shape"]]),
        gs.Node("Concat", inputs=[t["shape"], c("two", [2])], outputs=[t["dims"]], attrs={"axis": 0}),
        gs.Node("Reshape", inputs=[t["dims"], c("minus_one", [-1])], outputs=[t["flat"]]),
        gs.Node("Shape", inputs=[t["flat"]], outputs=[t["len"]]),
        gs.Node("ConstantOfShape", inputs=[t["len"]], outputs=[t["ones"]],
                attrs={"value": gs.Constant("one", np.array([1], np.int64))}),
        gs.Node("Mul", inputs=[t["ones"], c("m1", -1)], outputs=[t["neg"]]),
        gs.Node("Equal", inputs=[t["flat"], t["neg"]], outputs=[eq]),
        gs.Node("Where", inputs=[eq, t["ones"], t["flat"]], outputs=[t["target"]]),
    ]
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[t["target"]], opset=17)
    ev = ShapeEvaluator(graph, facts.ShapeTable(graph))
    assert ev.value(t["target"]).elems == ((1, ("batch",)), (1, ("seq",)), (8, ()), (2, ()))
    # a condition that depends on a dim's value stays unknown
    unknown = gs.Variable("unknown", np.int64)
    graph.nodes.append(gs.Node("Equal", inputs=[t["flat"], c("two_again", 2)], outputs=[unknown]))
    assert ShapeEvaluator(graph, facts.ShapeTable(graph)).value(unknown).elems[0] is None
