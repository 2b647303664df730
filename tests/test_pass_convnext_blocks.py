"""ConvNeXt blocks: the layer scale folds into the second Linear (fold-linear-scale), and the
residual stream stays NHWC so its Transposes sit next to the Convs, where onnxruntime's NCHWc
layout absorbs them (residual-channels-last).

The model is a ConvNeXt stage as torch.onnx writes it: downsampling Conv, then blocks of
depthwise 7x7 Conv, Transpose to NHWC, LayerNormalization, MatMul + bias, Relu, MatMul + bias,
Transpose back to NCHW, Mul by the layer scale gamma [C, 1, 1], residual Add.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxfuse.pipeline import Context, run_passes, select_passes
from onnxfuse.profile import count_kernels

C, HIDDEN, SIDE = 16, 32, 8  # channels a multiple of 8: onnxruntime's NCHWc layout takes the Convs
RNG = np.random.default_rng(0)


def _block_nodes(i: int, stream: str, inits: dict, gamma_shape=(C, 1, 1), gamma_input=None) -> tuple[list, str]:
    p = f"b{i}_"
    inits[p + "dw"] = RNG.standard_normal((C, 1, 7, 7)).astype(np.float32) * 0.1
    inits[p + "dwb"] = RNG.standard_normal(C).astype(np.float32)
    inits[p + "ln_s"] = (1 + 0.1 * RNG.standard_normal(C)).astype(np.float32)
    inits[p + "ln_b"] = (0.1 * RNG.standard_normal(C)).astype(np.float32)
    inits[p + "w1"] = RNG.standard_normal((C, HIDDEN)).astype(np.float32) * 0.2
    inits[p + "b1"] = RNG.standard_normal(HIDDEN).astype(np.float32)
    inits[p + "w2"] = RNG.standard_normal((HIDDEN, C)).astype(np.float32) * 0.2
    inits[p + "b2"] = RNG.standard_normal(C).astype(np.float32)
    if gamma_input is None:
        inits[p + "gamma"] = (0.5 + RNG.random(gamma_shape)).astype(np.float32)
    gamma = gamma_input or p + "gamma"
    nodes = [
        helper.make_node("Conv", [stream, p + "dw", p + "dwb"], [p + "dwo"], group=C, kernel_shape=[7, 7], pads=[3, 3, 3, 3]),
        helper.make_node("Transpose", [p + "dwo"], [p + "nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("LayerNormalization", [p + "nhwc", p + "ln_s", p + "ln_b"], [p + "ln"], axis=-1),
        helper.make_node("MatMul", [p + "ln", p + "w1"], [p + "mm1"]),
        helper.make_node("Add", [p + "b1", p + "mm1"], [p + "h"]),
        helper.make_node("Relu", [p + "h"], [p + "act"]),
        helper.make_node("MatMul", [p + "act", p + "w2"], [p + "mm2"]),
        helper.make_node("Add", [p + "b2", p + "mm2"], [p + "lin2"]),
        helper.make_node("Transpose", [p + "lin2"], [p + "nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Mul", [gamma, p + "nchw"], [p + "scaled"]),
        helper.make_node("Add", [p + "scaled", stream], [p + "out"]),
    ]
    return nodes, p + "out"


def convnext_stage(blocks: int = 3, gamma_shape=(C, 1, 1), gamma_input: bool = False) -> onnx.ModelProto:
    inits = {"down_w": RNG.standard_normal((C, 8, 2, 2)).astype(np.float32) * 0.3,
             "down_b": RNG.standard_normal(C).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "down_w", "down_b"], ["stream0"], kernel_shape=[2, 2], strides=[2, 2])]
    stream = "stream0"
    for i in range(blocks):
        block, stream = _block_nodes(i, stream, inits, gamma_shape, "gamma" if gamma_input else None)
        nodes += block
    nodes.append(helper.make_node("GlobalAveragePool", [stream], ["y"]))
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8, 2 * SIDE, 2 * SIDE])]
    if gamma_input:
        inputs.append(helper.make_tensor_value_info("gamma", onnx.TensorProto.FLOAT, list(gamma_shape)))
    graph = helper.make_graph(nodes, "convnext_stage", inputs,
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, C, 1, 1])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


def _optimize(model: onnx.ModelProto, passes: list[str]):
    out, stats = run_passes(model, select_passes(passes, "cpu"), Context())
    onnx.checker.check_model(out)
    return out, {s.name: s.matches for s in stats}


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _feeds(model: onnx.ModelProto) -> dict:
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((1, 8, 2 * SIDE, 2 * SIDE)).astype(np.float32)}
    if any(i.name == "gamma" for i in model.graph.input):
        feeds["gamma"] = (0.5 + rng.random((C, 1, 1))).astype(np.float32)
    return feeds


def _assert_close(original: onnx.ModelProto, rewritten: onnx.ModelProto) -> None:
    """The same values: a scaled weight rounds once where the original rounds the product and
    the scale separately."""
    from onnxfuse.runtime import make_session

    feeds = _feeds(original)
    a = make_session(original, level="disable").run(None, feeds)
    b = make_session(rewritten, level="disable").run(None, feeds)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


def test_layer_scale_folds_into_the_second_linear():
    model = convnext_stage()
    out, matches = _optimize(model, ["fold-linear-scale"])
    assert matches["fold-linear-scale"] == 3
    assert "Mul" not in _ops(out)
    _assert_close(model, out)
    w2 = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    gamma = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "b0_gamma")).reshape(-1)
    original_w2 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "b0_w2"))
    scaled = next(v for k, v in w2.items() if v.shape == (HIDDEN, C) and np.allclose(v, original_w2 * gamma, rtol=1e-6))
    assert scaled is not None


def test_layer_scale_without_permute_or_bias_folds_too():
    """Mul(MatMul(x, W), s[N]): the scale of a plain projection."""
    from small_models import float_model

    w = RNG.standard_normal((4, 6)).astype(np.float32)
    s = RNG.random(6).astype(np.float32)
    model = float_model("scaled", [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Mul", ["mm", "s"], ["y"])],
                        {"x": [3, 4]}, {"y": [3, 6]}, [numpy_helper.from_array(w, "w"), numpy_helper.from_array(s, "s")])
    out, matches = _optimize(model, ["fold-linear-scale"])
    assert matches["fold-linear-scale"] == 1 and _ops(out) == ["MatMul"]
    from onnxfuse.runtime import make_session

    x = RNG.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(make_session(out, level="disable").run(None, {"x": x})[0],
                               make_session(model, level="disable").run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [0.0, np.inf, np.nan, 3e38], ids=["zero", "inf", "nan", "overflowing"])
def test_a_zero_infinite_or_overflowing_scale_is_not_folded(bad):
    """(x W) * 0 keeps each product's sign (and NaN where x W is infinite) where x (W * 0) is +0;
    an infinite scale or one whose product with W overflows does not commute with the sum."""
    from small_models import float_model

    w = np.full((4, 6), 2.0, np.float32)
    s = np.ones(6, np.float32)
    s[2] = bad
    model = float_model("scaled", [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Mul", ["mm", "s"], ["y"])],
                        {"x": [3, 4]}, {"y": [3, 6]}, [numpy_helper.from_array(w, "w"), numpy_helper.from_array(s, "s")])
    out, matches = _optimize(model, ["fold-linear-scale"])
    assert matches["fold-linear-scale"] == 0 and "Mul" in _ops(out)


@pytest.mark.parametrize("gamma_shape", [(1, SIDE, 1), (C, SIDE, 1)], ids=["along-height", "channel-and-height"])
def test_scale_along_another_axis_is_not_folded(gamma_shape):
    """A scale that varies along an axis other than the projection's output channels is no
    column scaling of W: the Mul stays."""
    model = convnext_stage(blocks=1, gamma_shape=gamma_shape)
    out, matches = _optimize(model, ["fold-linear-scale"])
    assert matches["fold-linear-scale"] == 0 and "Mul" in _ops(out)


def test_computed_scale_is_not_folded():
    model = convnext_stage(blocks=1, gamma_input=True)
    out, matches = _optimize(model, ["fold-linear-scale"])
    assert matches["fold-linear-scale"] == 0 and "Mul" in _ops(out)


def test_residual_stream_stays_channels_last_and_runs_fewer_kernels():
    model = convnext_stage()
    folded, _ = _optimize(model, ["fold-linear-scale"])  # the layer scale sits between Transpose and Add
    out, matches = _optimize(folded, ["residual-channels-last"])
    assert matches["residual-channels-last"] == 3
    _assert_close(model, out)
    before, by_op_before = count_kernels(folded, threads=1)
    after, by_op_after = count_kernels(out, threads=1)
    assert after < before
    assert by_op_after.get("Transpose", 0) < by_op_before.get("Transpose", 0)


def test_residual_rewrite_is_left_out_when_onnxruntime_would_not_run_fewer_kernels():
    """Without onnxruntime to ask, the pass cannot know that the Transposes are absorbed: it
    rewrites nothing."""
    model, _ = _optimize(convnext_stage(), ["fold-linear-scale"])
    out, stats = run_passes(model, select_passes(["residual-channels-last"], "cpu"), Context(executed_graph=None))
    assert sum(s.matches for s in stats) == 0
    assert _ops(out) == _ops(model)


def test_convnext_stage_runs_fewer_kernels_than_onnxruntime_alone_and_verifies():
    import onnxfuse

    model = convnext_stage()
    result = onnxfuse.optimize(model, threads=1)
    before, after = result.summary["kernels_before"], result.summary["kernels_after"]
    # Per block: the layer-scale Mul goes, the Transpose before the residual Add goes, and the
    # bias Add and the residual Add run as one Pointwise kernel.
    assert after <= before - 3 * 3, (before, after)


def test_residual_rewrite_is_left_out_where_onnxruntime_would_run_more_kernels():
    """A stream that is a graph input: its Transpose to NHWC would be a kernel of its own, and
    the one back after the Add another, where the original runs one Transpose."""
    from small_models import float_model

    w = RNG.standard_normal((C, C)).astype(np.float32)
    model = float_model("input_stream", [
        helper.make_node("MatMul", ["h", "w"], ["mm"]),
        helper.make_node("Transpose", ["mm"], ["mm_nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Add", ["x", "mm_nchw"], ["y"]),
    ], {"x": [1, C, SIDE, SIDE], "h": [1, SIDE, SIDE, C]}, {"y": [1, C, SIDE, SIDE]}, [numpy_helper.from_array(w, "w")])
    out, matches = _optimize(model, ["residual-channels-last"])
    assert matches["residual-channels-last"] == 0
    assert _ops(out) == _ops(model)
