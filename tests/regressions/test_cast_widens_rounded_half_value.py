"""Fuzz seed 1975 (onnxfuse.fuzz at 868a319): Cast(float16 -> float32) of a computed float16 value.

The program computes float16 arithmetic in float32; the lowering treated Cast f16 -> f32 as
exact and emitted nothing, so the fused kernel returned the unrounded float32 difference where
onnxruntime returns the float16 result widened (off by up to half a float16 ulp, 4.9e-4 here).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.fuzz import _run, optimize_model


def _model(dtype, np_dtype, wide):
    x = helper.make_tensor_value_info("x", dtype, [64])
    nodes = [helper.make_node("Sub", ["x", "c"], ["d"]), helper.make_node("Cast", ["d"], ["y"], to=wide),
             helper.make_node("Neg", ["y"], ["z"])]
    c = numpy_helper.from_array(np.linspace(-3, 3, 64).astype(np_dtype), "c")
    graph = helper.make_graph(nodes, "cast_widen", [x], [helper.make_tensor_value_info("z", wide, [64])], [c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_cast_of_computed_half_to_float_is_bit_exact():
    """Against ONNX semantics (numpy's float16 Sub rounds); onnxruntime itself drops the rounding
    when its float16 Sub runs as a float32 Sub between Casts and it folds the Cast pair, so the
    fallback function (library not loaded) is not held to this."""
    model = _model(TensorProto.FLOAT16, np.float16, TensorProto.FLOAT)
    x = np.random.default_rng(3).standard_normal(64).astype(np.float16)
    c = np.linspace(-3, 3, 64).astype(np.float16)
    want = -(x - c).astype(np.float32)
    opt = optimize_model(model)
    assert any(n.domain == "onnxfuse" for n in opt.graph.node)
    got = _run(opt, {"x": x}, with_library=True, level="disable")["z"]
    assert np.array_equal(got, want)


def test_cast_of_computed_float_to_double_is_bit_exact():
    """The same for float32 -> float64: a program with a double output computes in double."""
    model = _model(TensorProto.FLOAT, np.float32, TensorProto.DOUBLE)
    feeds = {"x": (np.random.default_rng(4).standard_normal(64) / 3).astype(np.float32)}
    opt = optimize_model(model)
    assert any(n.domain == "onnxfuse" for n in opt.graph.node)
    ref = _run(model, feeds, with_library=False, level="disable")["z"]
    got = _run(opt, feeds, with_library=True)["z"]
    assert np.array_equal(got, ref)
