"""float16, bfloat16, double and integer chains: fused correctly or left alone, never computed
wrongly; Cast chains keep ONNX's exact semantics (rounding to half, truncation to integers,
bool as x != 0), compared bit for bit with numpy's ONNX-conforming results."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper, numpy_helper

from onnxfuse.fuzz import _run, compare, optimize_model
from onnxfuse.program import _to_bf16

vi = helper.make_tensor_value_info


def _model(nodes, x_type, out_type, shape=(64,), inits=()):
    graph = helper.make_graph(nodes, "dtypes", [vi("x", x_type, list(shape))], [vi("y", out_type, list(shape))], list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def _fused(model) -> list[str]:
    return [n.attribute[0].s.decode() for n in model.graph.node if n.domain == "onnxfuse"]


def _chain(elem, np_dtype):
    nodes = [helper.make_node("Mul", ["x", "k"], ["a"]), helper.make_node("Tanh", ["a"], ["b"]),
             helper.make_node("Add", ["b", "x"], ["c"]), helper.make_node("Relu", ["c"], ["y"])]
    return _model(nodes, elem, elem, inits=[numpy_helper.from_array(np.array(1.5, np_dtype), "k")])


@pytest.mark.parametrize("elem, np_dtype, rtol", [(T.FLOAT16, np.float16, 2e-3), (T.DOUBLE, np.float64, 1e-12),
                                                  (T.FLOAT, np.float32, 1e-6)])
def test_float_chain_of_each_type_fuses_and_matches(elem, np_dtype, rtol):
    model = _chain(elem, np_dtype)
    x = np.random.default_rng(0).standard_normal(64).astype(np_dtype)
    opt = optimize_model(model)
    assert len(_fused(opt)) == 1
    ref = _run(model, {"x": x}, with_library=False, level="disable")["y"]
    for with_library in (False, True):
        got = _run(opt, {"x": x}, with_library=with_library)["y"]
        assert got.dtype == np_dtype
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("elem, np_dtype", [(T.INT32, np.int32), (T.INT64, np.int64)])
def test_integer_chain_is_left_alone(elem, np_dtype):
    """Integer values stay outside fused regions; Div keeps truncation toward zero."""
    nodes = [helper.make_node("Mul", ["x", "k"], ["a"]), helper.make_node("Div", ["a", "d"], ["b"]),
             helper.make_node("Abs", ["b"], ["c"]), helper.make_node("Neg", ["c"], ["y"])]
    model = _model(nodes, elem, elem, inits=[numpy_helper.from_array(np.array(3, np_dtype), "k"),
                                             numpy_helper.from_array(np.array(2, np_dtype), "d")])
    x = np.arange(-32, 32).astype(np_dtype)
    opt = optimize_model(model)
    assert not _fused(opt)
    got = _run(opt, {"x": x}, with_library=True)["y"]
    assert np.array_equal(got, -np.abs(np.trunc(x * 3 / 2).astype(np_dtype)))


def _cast_chain(mid, post="Neg"):
    """x (float32) -> Abs -> Cast(mid) -> Cast(float32) -> post: the Casts sit inside a region."""
    nodes = [helper.make_node("Mul", ["x", "one"], ["a"]), helper.make_node("Cast", ["a"], ["m"], to=mid),
             helper.make_node("Cast", ["m"], ["b"], to=T.FLOAT), helper.make_node(post, ["b"], ["y"])]
    return _model(nodes, T.FLOAT, T.FLOAT, shape=(16,), inits=[numpy_helper.from_array(np.array(1, np.float32), "one")])


def _edge_values():
    f16_mid = float(np.float16(1)) + 2.0**-11  # halfway between two halves: ties to even (1.0)
    return np.array([f16_mid, 1 + 3 * 2.0**-11, 65504.0, 65520.0, 1e5, -1e5, 2.0**-25, 2.0**-24 * 1.5, -0.0, 0.0,
                     1e-45, -2.7, 2.7, -0.5, np.nan, np.inf], np.float32)


def test_cast_through_half_rounds_to_nearest_even():
    x = _edge_values()
    opt = optimize_model(_cast_chain(T.FLOAT16))
    assert any("cast[f16]" in p for p in _fused(opt))
    got = _run(opt, {"x": x}, with_library=True)["y"]
    want = -(x.astype(np.float16).astype(np.float32))
    assert np.array_equal(got, want, equal_nan=True)


def test_cast_through_bfloat16_rounds_to_nearest_even():
    x = np.concatenate([_edge_values()[:-2], np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8], np.float32)])
    opt = optimize_model(_cast_chain(T.BFLOAT16))
    assert any("cast[bf16]" in p for p in _fused(opt))
    got = _run(opt, {"x": x}, with_library=True)["y"]
    assert np.array_equal(got, -_to_bf16(x), equal_nan=True)
    ref = _run(_cast_chain(T.BFLOAT16), {"x": x}, with_library=False, level="disable")["y"]
    assert np.array_equal(got, ref, equal_nan=True)


def test_cast_through_bool_is_nonzero():
    x = np.array([0.0, -0.0, 1e-45, -1e-45, np.nan, np.inf, -3.0, 0.5] * 2, np.float32)
    model = _cast_chain(T.BOOL)
    opt = optimize_model(model)
    assert any("cast[bool]" in p for p in _fused(opt))
    got = _run(opt, {"x": x}, with_library=True)["y"]
    assert np.array_equal(got, -(x != 0).astype(np.float32))
    assert compare(_run(model, {"x": x}, with_library=False, level="disable"), {"y": got}) is None


def test_cast_through_int32_truncates_and_is_not_fused_through():
    x = np.array([-2.7, -2.5, -0.5, 0.5, 2.5, 2.7, 1e6 + 0.5, -1e6 - 0.5] * 2, np.float32)
    model = _cast_chain(T.INT32)
    opt = optimize_model(model)
    assert not any("int" in p for p in _fused(opt))  # integer values are not program values
    got = _run(opt, {"x": x}, with_library=True)["y"]
    assert np.array_equal(got, -np.trunc(x))


def test_double_to_half_rounds_once():
    """Cast double -> float16 rounds the exact double (onnxruntime's own Cast rounds through
    float32, twice; the fuzzer treats such values as near-ties)."""
    x = np.array([1.38720706, 1.0 + 2.0**-11 + 2.0**-40, 3.0, -7.25], np.float64)
    nodes = [helper.make_node("Mul", ["x", "one"], ["a"]), helper.make_node("Cast", ["a"], ["h"], to=T.FLOAT16),
             helper.make_node("Cast", ["h"], ["b"], to=T.DOUBLE), helper.make_node("Neg", ["b"], ["y"])]
    model = _model(nodes, T.DOUBLE, T.DOUBLE, shape=(4,), inits=[numpy_helper.from_array(np.array(1, np.float64), "one")])
    opt = optimize_model(model)
    assert _fused(opt)
    got = _run(opt, {"x": x}, with_library=True)["y"]
    assert np.array_equal(got, -(x.astype(np.float16).astype(np.float64)))
