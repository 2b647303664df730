"""K identical pointwise chains on one input ran as K fused kernels, where onnxruntime's own
common-subexpression elimination runs the chain once: more kernels than onnxruntime alone
(16 -> 24, 52 -> 96) and slower, written with exit 0. And two copies of one value could be
computed apart, one in a fused kernel and one by onnxruntime, an ulp apart: Tanh(x) > Tanh(x)
came out true (fuzz seed 9040166). The common-subexpressions pass now computes identical nodes
on identical inputs once, before any region is formed."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import fuzz
from onnxfuse.api import optimize
from onnxfuse.runtime import make_session


def _chains(k: int, graph_outputs: bool) -> onnx.ModelProto:
    """k copies of Mul(x, c) -> Tanh -> Add(., c), each read by a MatMul of its own weight (or
    each a graph output)."""
    rng = np.random.RandomState(0)
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "c")]
    nodes, ends = [], []
    for i in range(k):
        nodes += [helper.make_node("Mul", ["x", "c"], [f"m{i}"]), helper.make_node("Tanh", [f"m{i}"], [f"t{i}"]),
                  helper.make_node("Add", [f"t{i}", "c"], [f"a{i}"])]
        if graph_outputs:
            ends.append(f"a{i}")
            continue
        inits.append(numpy_helper.from_array(rng.randn(16, 16).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [f"a{i}", f"w{i}"], [f"y{i}"]))
        ends.append(f"y{i}")
    if graph_outputs:
        outputs = [helper.make_tensor_value_info(e, TensorProto.FLOAT, [4, 16]) for e in ends]
    else:
        nodes.append(helper.make_node("Concat", ends, ["y"], axis=1))
        outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16 * k])]
    graph = helper.make_graph(nodes, "chains", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("k", [4, 8])
@pytest.mark.parametrize("graph_outputs", [False, True])
def test_identical_chains_never_run_more_kernels_than_onnxruntime_alone(k, graph_outputs):
    for passes in (None, ["common-subexpressions", "pointwise"]):  # the default pipeline, and regions alone
        result = optimize(_chains(k, graph_outputs), passes=passes, threads=1)
        before, after = result.summary["kernels_before"], result.summary["kernels_after"]
        assert after <= before, f"{passes}: {after} kernels, onnxruntime alone {before}"
        assert sum(n.op_type == "Tanh" or n.domain == "onnxfuse" for n in result.model.graph.node) == 1


def test_a_value_compared_with_itself_stays_exact():
    """Greater(Tanh(x), Tanh(x)) with one Tanh also read by a MatMul (seed 9040166's shape)."""
    w = numpy_helper.from_array(np.linspace(-1, 1, 8, dtype=np.float32).reshape(8, 1), "w")
    nodes = [helper.make_node("Tanh", ["x"], ["t1"]), helper.make_node("Tanh", ["x"], ["t2"]),
             helper.make_node("MatMul", ["t1", "w"], ["p"]), helper.make_node("Greater", ["t1", "t2"], ["g"]),
             helper.make_node("Where", ["g", "t2", "p"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("g", TensorProto.BOOL, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    optimized = fuzz.optimize_model(model)
    assert sum(n.op_type == "Tanh" for n in optimized.graph.node) <= 1
    x = np.random.RandomState(1).uniform(-4, 4, (64, 8)).astype(np.float32)
    for with_library in (True, False):
        out = dict(zip(["y", "g"], make_session(optimized, threads=1, with_library=with_library).run(["y", "g"], {"x": x})))
        assert not out["g"].any()
        np.testing.assert_array_equal(out["y"], make_session(model, threads=1).run(["y"], {"x": x})[0])


def test_fuzz_seed_of_tanh_compared_with_itself_matches():
    assert fuzz.run_case(9040166).status == "ok"


def test_nodes_that_differ_or_are_not_deterministic_stay_apart():
    from onnxfuse.fuzz import optimize_model

    nodes = [helper.make_node("LeakyRelu", ["x"], ["a"], alpha=0.1), helper.make_node("LeakyRelu", ["x"], ["b"], alpha=0.2),
             helper.make_node("RandomUniformLike", ["x"], ["r1"]), helper.make_node("RandomUniformLike", ["x"], ["r2"]),
             helper.make_node("Sub", ["r1", "r2"], ["d"]), helper.make_node("Sub", ["a", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4]),
                               helper.make_tensor_value_info("d", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    optimized = optimize_model(model, passes=["common-subexpressions"])
    assert sum(n.op_type == "RandomUniformLike" for n in optimized.graph.node) == 2
    assert sum(n.op_type == "LeakyRelu" for n in optimized.graph.node) == 2
