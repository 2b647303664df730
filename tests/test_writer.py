"""NodeWriter (onnxfuse/graph/writer.py): the nodes a rewrite writes, named apart from the graph's."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph.writer import NodeWriter


def small_graph() -> tuple[gs.Graph, gs.Variable, gs.Variable]:
    x = gs.Variable("x", np.float32, [2, 3])
    y = gs.Variable("proj", np.float32, [2, 3])
    node = gs.Node("Relu", name="proj", inputs=[x], outputs=[y])
    return gs.Graph(nodes=[node], inputs=[x], outputs=[y], opset=17), x, y


def test_each_call_returns_the_value_its_node_computes_named_apart_from_the_graph():
    graph, x, y = small_graph()
    w = NodeWriter(graph)
    a = w.op("Neg", x, name="proj")  # both names taken in the graph
    b = w.op("Neg", a, name="proj")  # and now taken by the writer too
    assert (a.name, b.name) == ("proj_1", "proj_2")
    assert [n.name for n in w.nodes] == ["proj_1", "proj_2"]
    assert a.dtype == np.float32 and w.nodes[1].inputs[0] is a  # the first input's type
    assert a.inputs[0] is w.nodes[0]


def test_a_node_and_its_output_may_share_a_name_and_an_existing_value_keeps_its_readers():
    graph, x, y = small_graph()
    w = NodeWriter(graph)
    t = w.op("Exp", x, name="exp")
    assert t.name == "exp" and w.nodes[0].name == "exp"
    graph.nodes[0].outputs.clear()  # the replaced node
    out = w.op("Relu", t, name="relu", out=y)
    assert out is y and y.inputs[0] is w.nodes[1] and y in graph.outputs


def test_a_base_is_free_among_nodes_and_values_and_constants_are_named_after_it():
    graph, x, y = small_graph()
    w = NodeWriter(graph)
    base = w.base("proj")
    assert base == "proj_1"
    c = w.constant(f"{base}_weight", np.ones((3, 3), np.float32))
    assert isinstance(c, gs.Constant) and c.name == "proj_1_weight"
    assert w.value(f"{base}_weight").name == "proj_1_weight_1"
