"""Fuzz seed 9325856 (float16): v1 = Mul(in2, in2) is 3.6e-15, 0 in float16, and two Gathers of
v1's one row feed a Relu and, as its slope, a PRelu of Neg(Min(in1, v1)). onnxruntime runs the
float16 Mul, Min, Neg and PRelu in float32 and the Gather between them too (the Cast pair around
it dropped), so the slope is 3.6e-15 and a product of -1e-29 is -0 in float16. gather-rows-as-
slices made the Gathers one Reshape and two Slices, which onnxruntime keeps in float16: without
the library the slope was 0, the product -0, and onnxruntime's own Where (the PRelu's body)
turns a -0 it selects into +0, at 10 positions. Gathers of a computed float16 value stay now."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.fuzz import _run, optimize_model, run_case

H = TensorProto.FLOAT16


def _model():
    idx = [numpy_helper.from_array(np.asarray(0, np.int64), f"c{k}") for k in range(2)]
    nodes = [helper.make_node("Mul", ["in2", "in2"], ["v1"]),
             helper.make_node("Min", ["in1", "v1"], ["v3"]),
             helper.make_node("Gather", ["v1", "c0"], ["v6"], axis=2),
             helper.make_node("Relu", ["v6"], ["v8"]),
             helper.make_node("Gather", ["v1", "c1"], ["v11"], axis=2),
             helper.make_node("Neg", ["v3"], ["v13"]),
             helper.make_node("PRelu", ["v13", "v11"], ["v15"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("in1", H, [2, 1, 3, 1]),
                                       helper.make_tensor_value_info("in2", H, [1, 1, 1, 1])],
                          [helper.make_tensor_value_info("v8", H, [1, 1, 1]),
                           helper.make_tensor_value_info("v15", H, [2, 1, 3, 1])], idx)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.checker.check_model(m, full_check=True)
    return m


def test_fallback_keeps_the_slope_onnxruntime_computes_in_float32():
    model = _model()
    feeds = {"in1": np.array([-0.9, 0.26, 0.5, 1.5, -0.25, 6.1e-5], np.float16).reshape(2, 1, 3, 1),
             "in2": np.full((1, 1, 1, 1), 6e-8, np.float16)}
    ref = _run(model, feeds, with_library=False, level="disable")
    assert (ref["v15"].ravel()[[1, 2, 3, 5]] == 0).all() and np.signbit(ref["v15"].ravel()[[1, 2, 3, 5]]).all()
    opt = optimize_model(model)
    for library in (False, True):
        got = _run(opt, feeds, with_library=library, level="all")
        for k in ref:
            assert np.array_equal(got[k], ref[k]), (library, k, got[k], ref[k])
            assert np.array_equal(np.signbit(got[k]), np.signbit(ref[k])), (library, k, got[k], ref[k])


def test_fuzz_seed_matches_exactly():
    outcome = run_case(9325856)
    assert outcome.status == "ok", outcome.message
