"""bench/zoo_latency.py: the executed-graph comparison that stands in for timing; bench/harness.py:
the interval of the timed ratio and the interleaved timer."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench import harness, zoo_latency
from onnxfuse import runtime


def two_branch_model(order=(0, 1), alpha=0.1, weight=1.0):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    branches = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
                helper.make_node("LeakyRelu", ["x"], ["b"], alpha=alpha, name="leaky")]
    nodes = [branches[i] for i in order] + [helper.make_node("Mul", ["a", "w"], ["aw"]),
                                             helper.make_node("Add", ["aw", "b"], ["y"])]
    w = numpy_helper.from_array(np.full((4,), weight, np.float32), "w")
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]), opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def test_graph_signature_ignores_node_order_and_names():
    a = zoo_latency.graph_signature(two_branch_model((0, 1)))
    b = zoo_latency.graph_signature(two_branch_model((1, 0)))
    assert a == b


def test_graph_signature_sees_attributes_and_weight_contents():
    base = zoo_latency.graph_signature(two_branch_model())
    other_alpha = zoo_latency.graph_signature(two_branch_model(alpha=0.2))
    assert base[:2] != other_alpha[:2]
    other_weight = zoo_latency.graph_signature(two_branch_model(weight=2.0))
    assert base[:2] == other_weight[:2]  # same structure ...
    assert base[2] != other_weight[2]  # ... other weights


def test_executed_graph_is_what_onnxruntime_runs():
    g = runtime.executed_graph(two_branch_model(), with_library=False)
    assert isinstance(g, onnx.ModelProto)
    assert {n.op_type for n in g.graph.node} >= {"Relu", "LeakyRelu"}


def test_bootstrap_interval_brackets_the_median():
    rng = np.random.default_rng(1)
    ratios = 1.0 + 0.01 * rng.standard_normal(200)
    lo, hi = harness.bootstrap_median_interval(ratios)
    assert lo < float(np.median(ratios)) < hi
    assert hi - lo < 0.01
