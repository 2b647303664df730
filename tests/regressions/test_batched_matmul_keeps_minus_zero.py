"""Fuzz seed 9064573: three sibling MatMuls on one input, one of them with a bias, were batched
into one MatMul + Add whose bias was +0 for the members without one; a member's exact -0 (a
product of subnormals) became +0 there, and Div(1.4e-45, it) gave +inf where onnxruntime gives
-inf. The filler bias is -0 now (x + -0 is x for every x); the ensemble batching likewise."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.fuzz import _run, optimize_model, run_case


def _model():
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(0.05, 0.45, (4, 8)).astype(np.float32), f"w{i}")
             for i in range(3)]
    inits.append(numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b0"))
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["m0"]), helper.make_node("Add", ["m0", "b0"], ["y0"]),
             helper.make_node("MatMul", ["x", "w1"], ["y1"]), helper.make_node("MatMul", ["x", "w2"], ["y2"]),
             helper.make_node("Div", ["y2", "y1"], ["q"])]
    f = TensorProto.FLOAT
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [2, 4])],
                          [helper.make_tensor_value_info(n, f, None) for n in ("y0", "y1", "q")], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def test_a_member_without_bias_keeps_its_minus_zero():
    model = _model()
    opt = optimize_model(model)
    assert sum(n.op_type == "MatMul" for n in opt.graph.node) == 1  # batched
    x = np.array([[-1.4e-45] * 4, [1.0, -2.0, 0.5, 3.0]], np.float32)
    ref = _run(model, {"x": x}, with_library=False, level="disable")
    assert np.signbit(ref["y1"][0]).all() and (ref["y1"][0] == 0).all()  # products of subnormals: -0
    for library in (False, True):
        got = _run(opt, {"x": x}, with_library=library, level="all")
        for k in ref:
            assert np.array_equal(np.signbit(got[k]), np.signbit(ref[k])), (library, k, got[k], ref[k])
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-6)


def test_seed_9064573_matches():
    outcome = run_case(9064573)
    assert outcome.status in ("ok", "tie"), outcome.message
