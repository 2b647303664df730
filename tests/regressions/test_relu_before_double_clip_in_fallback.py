"""Fuzz seed 9081087: Relu -> Slice -> Clip in double, the Slice a no-op (steps 2 over a
dimension of 1). The pipeline dropped the Slice, and the pointwise region's fallback function
held Relu directly before a Clip whose bounds are double. Without our library onnxruntime
inlines that body and runs its Relu+Clip fusion, which throws on a min that is neither float
nor float16 ("Unexpected data type for Clip 'min' input of 11", relu_clip_fusion.cc): the
optimized model did not load, where the original (its Slice keeping the two apart) did.

A fallback body now writes such a Relu as Clip(x, 0, max of its type), Relu bit for bit, which
that fusion does not match; a float Relu is left for onnxruntime to fuse.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.fused import DOMAIN
from onnxfuse.fuzz import optimize_model

SPECIAL = [np.nan, -np.nan, -0.0, 0.0, np.inf, -np.inf, 5e-324, -5e-324, 1.5, -1.5]


def _model(dtype: int, lo: float, hi: float | None) -> onnx.ModelProto:
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((5, 1)).astype(np_type), "w"),
             numpy_helper.from_array(np.array([-0.01], np_type), "b"),
             numpy_helper.from_array(np.array([-2], np.int64), "starts"),
             numpy_helper.from_array(np.array([1], np.int64), "ends"),
             numpy_helper.from_array(np.array([1], np.int64), "axes"),
             numpy_helper.from_array(np.array([2], np.int64), "steps"),
             numpy_helper.from_array(np.array(lo, np_type), "lo")]
    clip_in = ["s", "lo"]
    if hi is not None:
        inits.append(numpy_helper.from_array(np.array(hi, np_type), "hi"))
        clip_in.append("hi")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Relu", ["x2"], ["r"], name="relu"),
             helper.make_node("Slice", ["r", "starts", "ends", "axes", "steps"], ["s"], name="slice"),
             helper.make_node("Clip", clip_in, ["y"], name="clip"),
             helper.make_node("Neg", ["y"], ["z"], name="neg")]
    # The Relu reads the MatMul's result plus the input's first column, so that special values
    # reach it unchanged through x2 = a + x[:, :1] * 1.
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "c0"))
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "c1"))
    nodes[2:2] = [helper.make_node("Slice", ["x", "c0", "c1", "c1"], ["xc"], name="col"),
                  helper.make_node("Add", ["a", "xc"], ["x2"], name="add2")]
    graph = helper.make_graph(nodes, "relu_clip", [helper.make_tensor_value_info("x", dtype, [10, 5])],
                              [helper.make_tensor_value_info("y", dtype, None),
                               helper.make_tensor_value_info("z", dtype, None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    m.ir_version = 10
    return m


def _run(model: onnx.ModelProto, x: np.ndarray, level) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


@pytest.mark.parametrize("lo,hi", [(-1.5843368841904857, -1.4038692319989878), (-1.0, 1.0), (0.25, None),
                                   (0.0, 0.0)])
def test_double_fallback_body_loads_and_matches_bit_for_bit(lo, hi):
    model = _model(TensorProto.DOUBLE, lo, hi)
    opt = optimize_model(model)
    assert any(n.domain == DOMAIN for n in opt.graph.node), "the case no longer forms a region"
    x = np.zeros((10, 5), np.float64)
    x[:, 0] = SPECIAL
    x[:, 1:] = np.random.default_rng(0).standard_normal((10, 4))
    want = _run(model, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    # Without our library, at onnxruntime's default level: the body is inlined and optimized.
    got = _run(opt, x, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and np.array_equal(w.view(np.int64), g.view(np.int64))


def test_float_relu_is_left_for_onnxruntime_to_fuse():
    opt = optimize_model(_model(TensorProto.FLOAT, -1.0, 1.0))
    ops = [n.op_type for f in opt.functions for n in f.node]
    assert "Relu" in ops


def test_relu_of_a_relu_before_a_double_clip_loads_without_the_library():
    """Fuzz seed 9427244: Clip(Relu(Relu(x)), lo, hi) in double. The Relu before the Clip became
    Clip(r, 0, inf), and the first Relu then fed that Clip: the same fusion threw on it."""
    from onnxfuse import fuzz

    outcome = fuzz.run_case(9427244)
    assert outcome.status == "ok", outcome.message
