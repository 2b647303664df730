"""squeeze-excite: the blocks it fuses into onnxfuse.SqueezeExcite, the ones it leaves alone, and
that the CPU kernel computes what onnxruntime computes for the original (special values bit for
bit: signed zeros, infinities, NaN)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.pipeline import Context, PassOptions, run_passes, select_passes
from onnxfuse.runtime import make_session
from small_models import GraphBuilder

F = TensorProto.FLOAT
RNG = np.random.default_rng(2024)


class Block(GraphBuilder):
    """X [N, C, H, W] -> [SiLU] -> squeeze-and-excitation -> Y, written as the exporters write it."""

    def __init__(self, c=16, r=4, hw=5, opset=17):
        super().__init__()
        self.c, self.r, self.hw, self.opset = c, r, hw, opset

    def act(self, kind, v):
        if kind == "silu":
            return self.node("Mul", [v, self.node("Sigmoid", [v])])
        if kind == "hardsigmoid":
            return self.node("HardSigmoid", [v], alpha=1 / 6, beta=0.5)
        if kind == "clip":
            return self.node("Clip", [v, self.const(np.float32(0)), self.const(np.float32(6))])
        return self.node(kind, [v])

    def conv1x1(self, v, cout, cin, bias=True, **attrs):
        w = self.const((RNG.standard_normal((cout, cin, 1, 1)) * 0.3).astype(np.float32))
        b = [self.const(RNG.standard_normal(cout).astype(np.float32) * 0.1)] if bias else []
        return self.node("Conv", [v, w] + b, kernel_shape=[1, 1], **attrs)

    def model(self, hidden="Relu", gate="Sigmoid", pool="gap", input_silu=False, bias=True, extra_reader=None,
              conv_attrs=None):
        x = "X"
        if input_silu:
            x = self.act("silu", x)
        if pool == "gap":
            m = self.node("GlobalAveragePool", [x])
        elif self.opset >= 18:
            m = self.node("ReduceMean", [x, self.const(np.array([2, 3], np.int64))], keepdims=1)
        else:
            m = self.node("ReduceMean", [x], axes=[2, 3], keepdims=1)
        h = self.conv1x1(m, self.r, self.c, bias, **(conv_attrs or {}))
        a = self.act(hidden, h)
        g = self.act(gate, self.conv1x1(a, self.c, self.r, bias))
        y = self.node("Mul", [x, g])
        outs = [y] + ([{"h": h, "g": g}[extra_reader]] if extra_reader else [])
        graph = helper.make_graph(
            self.nodes, "se", [helper.make_tensor_value_info("X", F, ["batch", self.c, self.hw, self.hw])],
            [helper.make_tensor_value_info(o, F, None) for o in outs], self.initializers())
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8
        return model


def optimize(model, target="cpu", **options):
    # On cuda the rewrite is opt-in (squeeze_excite_cuda) until its kernel is timed on a GPU.
    if target == "cuda":
        options.setdefault("squeeze_excite_cuda", True)
    ctx = Context(target=target, options=PassOptions.from_mapping(options))
    work = onnx.ModelProto()
    work.CopyFrom(model)
    out, stats = run_passes(work, select_passes(["squeeze-excite"], target), ctx)
    return out, {s.name: s.matches for s in stats}["squeeze-excite"]


def ops(model):
    return [n.op_type for n in model.graph.node]


def outputs(model, x, with_library):
    return make_session(model, with_library=with_library, threads=1).run(None, {"X": x})


def assert_matches_onnxruntime(original, fused, x):
    """Finite values within float32 rounding of the sums; +-0, +-inf and NaN bit for bit (a NaN
    only has to be a NaN). The fallback body (no library) computes the original exactly."""
    (want,) = outputs(original, x, with_library=False)
    (got,) = outputs(fused, x, with_library=True)
    (fallback,) = outputs(fused, x, with_library=False)
    np.testing.assert_array_equal(fallback, want)
    assert got.shape == want.shape
    assert np.array_equal(np.isnan(got), np.isnan(want))
    exact = np.isinf(want) | (want == 0)
    assert np.array_equal(got[exact].view(np.uint32), want[exact].view(np.uint32))
    close = ~exact & ~np.isnan(want)
    np.testing.assert_allclose(got[close], want[close], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("hidden", ["Relu", "silu", "Sigmoid", "Tanh", "hardsigmoid", "HardSwish", "LeakyRelu", "clip"])
@pytest.mark.parametrize("gate", ["Sigmoid", "hardsigmoid"])
def test_block_becomes_one_node_for_each_hidden_and_gate_activation(hidden, gate):
    m = Block().model(hidden=hidden, gate=gate)
    out, count = optimize(m)
    assert count == 1 and ops(out) == ["SqueezeExcite"]
    assert_matches_onnxruntime(m, out, RNG.standard_normal((2, 16, 5, 5)).astype(np.float32))


@pytest.mark.parametrize("opset", [17, 18])
def test_reduce_mean_over_height_and_width_is_the_pool(opset):
    m = Block(opset=opset).model(pool="reduce_mean", hidden="silu", bias=False)
    out, count = optimize(m)
    assert count == 1 and ops(out) == ["SqueezeExcite"]
    assert_matches_onnxruntime(m, out, RNG.standard_normal((1, 16, 5, 5)).astype(np.float32))


def test_silu_read_by_the_block_alone_goes_into_the_node():
    m = Block().model(hidden="silu", input_silu=True)
    out, count = optimize(m)
    assert count == 1 and ops(out) == ["SqueezeExcite"]
    node = out.graph.node[0]
    assert node.input[0] == "X"
    assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "input_activation")) == b"silu"
    assert_matches_onnxruntime(m, out, RNG.standard_normal((2, 16, 5, 5)).astype(np.float32) * 3)


@pytest.mark.parametrize("case", ["hidden_read_outside", "gate_read_outside", "strided_conv"])
def test_blocks_it_cannot_take_are_left_alone(case):
    b = Block()
    if case == "hidden_read_outside":
        m = b.model(extra_reader="h")
    elif case == "gate_read_outside":
        m = b.model(extra_reader="g")
    else:
        m = b.model(conv_attrs={"strides": [2, 2]})
    out, count = optimize(m)
    assert count == 0 and "SqueezeExcite" not in ops(out)


def test_block_fuses_on_the_cuda_target_before_conv_bias_act_takes_its_convolutions():
    # On cuda conv-bias-act (order 320) would make the 1x1 Convs and their activations
    # ConvBiasAct nodes; squeeze-excite runs first and takes the whole block.
    m = Block().model(hidden="silu", gate="hardsigmoid")
    passes = select_passes(None, "cuda")
    names = [p.name for p in passes]
    assert names.index("squeeze-excite") < names.index("conv-bias-act")
    ctx = Context(target="cuda", options=PassOptions.from_mapping({"squeeze_excite_cuda": True}))
    work = onnx.ModelProto()
    work.CopyFrom(m)
    out, _ = run_passes(work, [p for p in passes if p.name in ("squeeze-excite", "conv-bias-act")], ctx)
    assert ops(out) == ["SqueezeExcite"]


def test_block_is_left_alone_on_the_cuda_target_without_the_opt_in():
    # The CUDA kernel is not yet timed on a GPU: without squeeze_excite_cuda the block stays.
    out, count = optimize(Block().model(hidden="relu", gate="hardsigmoid"), target="cuda", squeeze_excite_cuda=False)
    assert count == 0 and "SqueezeExcite" not in ops(out)


def test_silu_before_the_block_stays_outside_on_the_cuda_target():
    # There it is the epilogue of the convolution before it (conv-bias-act's depthwise kernel).
    out, count = optimize(Block().model(hidden="silu", input_silu=True), target="cuda")
    assert count == 1 and sorted(ops(out)) == ["Mul", "Sigmoid", "SqueezeExcite"]
    node = next(n for n in out.graph.node if n.op_type == "SqueezeExcite")
    assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "input_activation")) == b"none"


def test_reduce_mean_over_other_axes_is_not_the_pool():
    b = Block(opset=18)
    m = b.model(pool="reduce_mean")
    for init in m.graph.initializer:
        if init.data_type == TensorProto.INT64:
            init.CopyFrom(numpy_helper.from_array(np.array([1, 2], np.int64), init.name))
    out, count = optimize(m)
    assert count == 0


def test_explain_says_why_a_block_is_left():
    b = Block()
    ctx = Context(target="cpu", explain=frozenset({"squeeze-excite"}))
    run_passes(b.model(conv_attrs={"strides": [2, 2]}), select_passes(["squeeze-excite"], "cpu"), ctx)
    (reasons,) = ctx.rejections["squeeze-excite"].values()
    assert reasons == ["Conv1 and Conv2 are not 1x1 convolutions (group 1, stride 1, unpadded) with constant float32"
                       " weights [R, C, 1, 1] and [C, R, 1, 1] and constant biases"]


@pytest.mark.parametrize("build", ["avx2", "baseline"])
def test_special_values_match_onnxruntime_bit_for_bit(build, monkeypatch):
    if build == "baseline":
        monkeypatch.setenv("ONNXFUSE_NO_AVX2", "1")
    # Signed zeros and subnormals keep a finite mean: their products with the gates keep their
    # signs; an infinity or NaN in a channel makes every gate NaN (0 * inf in the convolution),
    # in the original as in the kernel. A HardSigmoid gate saturates to exactly 0 and 1.
    specials = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.0, -3.0, 0.0], np.float32)
    x = np.tile(specials, 2 * 16 * 25 // len(specials) + 1)[: 2 * 16 * 25].reshape(2, 16, 5, 5)
    for gate in ("Sigmoid", "hardsigmoid"):
        for input_silu in (False, True):
            m = Block().model(hidden="Relu", gate=gate, input_silu=input_silu)
            out, count = optimize(m)
            assert count == 1
            assert_matches_onnxruntime(m, out, x)
            for bad in (np.inf, -np.inf, np.nan):
                y = x.copy()
                y[1, 3, 2, 2] = bad
                assert_matches_onnxruntime(m, out, y)


@pytest.mark.parametrize("c, r, input_silu, fused", [(240, 64, False, True), (288, 72, False, False),
                                                      (576, 144, True, True)])
def test_cpu_rewrite_of_a_block_without_input_activation_only_under_20000_weights(c, r, input_silu, fused):
    # Such a block saves no pass over x, and with larger weights (MobileNetV3's C=288 R=72 and
    # C=576 R=144) its node ran slower in whole models; a block that takes the SiLU before it pays.
    m = Block(c=c, r=r, hw=4).model(hidden="Relu", gate="HardSigmoid", input_silu=input_silu)
    out, count = optimize(m)
    assert (count == 1) == fused
    assert ("SqueezeExcite" in ops(out)) == fused


@pytest.mark.parametrize("hw, spatial, fused", [(32, None, True), (56, None, False), (5, "side", False)])
def test_cpu_rewrite_only_on_maps_where_it_pays(hw, spatial, fused):
    # At 224x224 images the blocks on 56x56 and 112x112 maps ran slower as the node than as
    # onnxruntime's kernels (bench/results/cnn224.md); a symbolic H or W may be that large.
    m = Block(hw=hw).model(hidden="silu", input_silu=True)
    if spatial is not None:
        dims = m.graph.input[0].type.tensor_type.shape.dim
        dims[2].dim_param = dims[3].dim_param = spatial
    out, count = optimize(m)
    assert (count == 1) == fused
    assert ("SqueezeExcite" in ops(out)) == fused
    _, on_cuda = optimize(m, target="cuda")
    assert on_cuda == 1
