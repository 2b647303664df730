"""fold-batchnorm and conv-bias-act: what they match, what they leave alone, and that the result
computes what the original computed (onnxruntime, CPU provider, the fused node's fallback body)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.cuda import conv_model
from onnxfuse.cuda.conv_plan import ConvShape, DepthwiseTile, Epilogue, GemmTile
from onnxfuse.pipeline import Context, PassOptions, run_passes, select_passes
from onnxfuse.runtime import make_session

F = TensorProto.FLOAT
RNG = np.random.default_rng(1234)


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


class Net:
    """A tiny model builder: X [N, C, H, W] -> Conv -> ... ."""

    def __init__(self, c=4, h=9, w=9, batch: int | str = 2, opset=17):
        self.nodes, self.inits, self.opset = [], [], opset
        self.inputs = [helper.make_tensor_value_info("X", F, [batch, c, h, w])]
        self.c, self.count = c, 0

    def name(self, base):
        self.count += 1
        return f"{base}{self.count}"

    def const(self, arr, base="c"):
        n = self.name(base)
        self.inits.append(_init(n, np.asarray(arr, dtype=np.float32) if np.asarray(arr).dtype.kind == "f" else arr))
        return n

    def node(self, op, inputs, n_out=1, **attrs):
        outs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.name(op), **attrs))
        return outs[0] if n_out == 1 else outs

    def conv(self, x, cin, k, r=3, bias=True, group=1, **attrs):
        w = self.const(RNG.standard_normal((k, cin // group, r, r)).astype(np.float32) * 0.3, "W")
        ins = [x, w] + ([self.const(RNG.standard_normal(k).astype(np.float32), "B")] if bias else [])
        attrs.setdefault("pads", [r // 2] * 4)
        return self.node("Conv", ins, group=group, **attrs)

    def bn(self, x, k, **attrs):
        scale = self.const(RNG.uniform(0.5, 1.5, k))
        shift = self.const(RNG.standard_normal(k))
        mean = self.const(RNG.standard_normal(k))
        var = self.const(RNG.uniform(0.2, 2.0, k))
        return self.node("BatchNormalization", [x, scale, shift, mean, var], epsilon=1e-3, **attrs)

    def model(self, *outputs):
        g = helper.make_graph(self.nodes, "net", self.inputs,
                              [helper.make_tensor_value_info(o, F, None) for o in outputs], self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        m.ir_version = 10
        return m


def optimize(model, passes, target, arch=None, **options):
    ctx = Context(target=target, arch=arch, options=PassOptions.from_mapping(options))
    work = onnx.ModelProto()
    work.CopyFrom(model)
    out, stats = run_passes(work, select_passes(passes, target), ctx)
    return out, {s.name: s.matches for s in stats}


def run(model, feeds, level="disable"):
    return make_session(model, with_library=False, level=level).run(None, feeds)


def feeds_for(model, batch=2, extra=None):
    shape = [d.dim_value or batch for d in model.graph.input[0].type.tensor_type.shape.dim]
    out = {"X": RNG.standard_normal(shape).astype(np.float32)}
    out.update(extra or {})
    return out


def assert_same(a_model, b_model, feeds, rtol=1e-4):
    # ORT_DISABLE_ALL on both: the check is on our rewrite, not on onnxruntime's own fusions.
    for a, b in zip(run(a_model, feeds), run(b_model, feeds)):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * max(1.0, float(np.abs(a).max())))


def ops(model):
    return [n.op_type for n in model.graph.node]


# ------------------------------------------------------------------------------ fold-batchnorm


def test_batchnorm_folds_into_conv_without_bias():
    net = Net()
    y = net.node("Relu", [net.bn(net.conv("X", 4, 6, bias=False), 6)])
    m = net.model(y)
    out, stats = optimize(m, ["fold-batchnorm"], "cpu")
    assert stats["fold-batchnorm"] == 1
    assert ops(out) == ["Conv", "Relu"]
    assert_same(m, out, feeds_for(m))


def test_per_channel_mul_and_add_fold_after_batchnorm():
    net = Net()
    y = net.bn(net.conv("X", 4, 5), 5)
    y = net.node("Mul", [y, net.const(RNG.uniform(0.5, 2, (1, 5, 1, 1)))])
    y = net.node("Add", [net.const(RNG.standard_normal((5, 1, 1))), y])
    m = net.model(net.node("Relu", [y]))
    out, stats = optimize(m, ["fold-batchnorm"], "cpu")
    assert stats["fold-batchnorm"] == 3
    assert ops(out) == ["Conv", "Relu"]
    assert_same(m, out, feeds_for(m))


@pytest.mark.parametrize("case", ["two_readers", "graph_output", "width_vector", "training_mode", "runtime_scale"])
def test_fold_leaves_alone(case):
    net = Net(opset=15)
    x = net.conv("X", 4, 4)
    outs = []
    if case == "two_readers":
        y = net.bn(x, 4)
        outs = [y, net.node("Sigmoid", [x])]
    elif case == "graph_output":
        outs = [x, net.bn(x, 4)]
    elif case == "width_vector":  # shape [W] broadcasts along width, not channels
        outs = [net.node("Add", [x, net.const(RNG.standard_normal(9))])]
    elif case == "training_mode":
        outs = [net.bn(x, 4, training_mode=1)]
    elif case == "runtime_scale":
        net.inputs.append(helper.make_tensor_value_info("S", F, [4]))
        k = [net.const(RNG.standard_normal(4)) for _ in range(3)]
        outs = [net.node("BatchNormalization", [x, "S", k[0], k[1], net.const(RNG.uniform(1, 2, 4))])]
    m = net.model(*outs)
    out, stats = optimize(m, ["fold-batchnorm"], "cpu")
    assert stats["fold-batchnorm"] == 0
    assert ops(out) == ops(m)


def test_fill_weights_stay_compact_after_folding():
    """Weights stored as ConstantOfShape fills (the onnx light zoo) fold into fills, not into
    initializers the size of the weights."""
    net = Net(c=8, h=6, w=6)
    shape = net.const(np.array([16, 8, 3, 3], np.int64), "shape")
    fill = helper.make_tensor("v", F, [1], [0.02])
    net.nodes.append(helper.make_node("ConstantOfShape", [shape], ["Wfill"], value=fill))
    y = net.node("Conv", ["X", "Wfill"], pads=[1, 1, 1, 1])
    k = [net.const(np.full(16, v, np.float32)) for v in (1.5, 0.1, 0.2, 0.7)]
    y = net.node("BatchNormalization", [y, *k])
    m = net.model(net.node("Relu", [y]))
    out, stats = optimize(m, ["fold-batchnorm"], "cpu")
    assert stats["fold-batchnorm"] == 1
    assert max(numpy_helper.to_array(t).size for t in out.graph.initializer) < 16 * 8 * 3 * 3
    assert ops(out).count("ConstantOfShape") >= 1 and "BatchNormalization" not in ops(out)
    assert_same(m, out, feeds_for(m))


# ------------------------------------------------------------------------------ conv-bias-act


def _activation_chain(net, y, form):
    """Append an activation written as `form`; returns (output, expected activation attr)."""
    if form in ("Relu", "Sigmoid", "Tanh", "HardSwish"):
        return net.node(form, [y]), form.lower()
    if form == "LeakyRelu":
        return net.node("LeakyRelu", [y], alpha=0.07), "leakyrelu"
    if form == "HardSigmoid":
        return net.node("HardSigmoid", [y], alpha=0.3, beta=0.4), "hardsigmoid"
    if form == "Clip6":
        return net.node("Clip", [y, net.const(np.float32(0)), net.const(np.float32(6))]), "clip"
    if form == "silu":
        return net.node("Mul", [y, net.node("Sigmoid", [y])]), "silu"
    if form == "x*hardsigmoid":
        return net.node("Mul", [net.node("HardSigmoid", [y], alpha=1 / 6, beta=0.5), y]), "hardswish"
    if form == "x*relu6(x+3)/6":
        g = net.node("Clip", [net.node("Add", [y, net.const(np.float32(3))]), net.const(np.float32(0)),
                              net.const(np.float32(6))])
        return net.node("Div", [net.node("Mul", [y, g]), net.const(np.float32(6))]), "hardswish"
    if form == "x*(relu6(x+3)/6)":
        g = net.node("Clip", [net.node("Add", [y, net.const(np.float32(3))]), net.const(np.float32(0)),
                              net.const(np.float32(6))])
        return net.node("Mul", [y, net.node("Div", [g, net.const(np.float32(6))])]), "hardswish"
    raise AssertionError(form)


def _fused_nodes(model):
    return [n for n in model.graph.node if n.domain == "onnxfuse" and n.op_type == "ConvBiasAct"]


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _kernel_model_output(model, node, feeds):
    """Run the node's generated kernel design in the numpy model, on the node's own inputs."""
    a = _attrs(node)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    x = feeds[node.input[0]]
    w, b = inits[node.input[1]], inits[node.input[2]]
    z = feeds.get(node.input[3]) if len(node.input) > 3 else None
    k, cg, r, s = w.shape
    shape = ConvShape(x.shape[1], x.shape[2], x.shape[3], k, r, s, tuple(a["strides"]), tuple(a["pads"]),
                      tuple(a["dilations"]), a["group"])
    act = a["activation"].decode()
    epi = Epilogue(act, a["activation_alpha"], a["activation_beta"], z is not None, bool(a["post_relu"]))
    tile = DepthwiseTile(*a["cuda_tile"]) if a["cuda_kind"] == b"depthwise" else GemmTile(*a["cuda_tile"])
    return conv_model.run(shape, epi, tile, x, w, b, z)


FORMS = ["Relu", "LeakyRelu", "Clip6", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "silu", "x*hardsigmoid",
         "x*relu6(x+3)/6", "x*(relu6(x+3)/6)"]


@pytest.mark.parametrize("form", FORMS)
def test_activation_forms_fuse_into_one_node(form):
    net = Net(c=5, h=8, w=7)
    y, act = _activation_chain(net, net.bn(net.conv("X", 5, 6, bias=False), 6), form)
    m = net.model(y)
    out, stats = optimize(m, ["fold-batchnorm", "conv-bias-act"], "cuda")
    assert stats["conv-bias-act"] == 1
    (node,) = _fused_nodes(out)
    assert ops(out) == ["ConvBiasAct"]
    assert _attrs(node)["activation"].decode() == act
    feeds = feeds_for(m)
    assert_same(m, out, feeds)  # the fallback body
    expected = run(m, feeds)[0]
    np.testing.assert_allclose(_kernel_model_output(out, node, feeds), expected, rtol=1e-4, atol=1e-4)


def test_residual_add_and_relu_fuse_with_a_strided_depthwise_conv():
    net = Net(c=6, h=10, w=10)
    net.inputs.append(helper.make_tensor_value_info("Z", F, [2, 6, 5, 5]))
    y = net.conv("X", 6, 6, group=6, strides=[2, 2])
    y = net.node("Relu", [net.node("Add", ["Z", net.node("HardSwish", [y])])])
    m = net.model(y)
    out, _ = optimize(m, ["fold-batchnorm", "conv-bias-act"], "cuda")
    (node,) = _fused_nodes(out)
    a = _attrs(node)
    assert list(node.input)[3] == "Z" and a["post_relu"] == 1 and a["cuda_kind"] == b"depthwise"
    feeds = feeds_for(m, extra={"Z": RNG.standard_normal((2, 6, 5, 5)).astype(np.float32)})
    assert_same(m, out, feeds)
    np.testing.assert_allclose(_kernel_model_output(out, node, feeds), run(m, feeds)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("conv_attrs,out_hw,pads", [
    ({"group": 2, "strides": [2, 2], "auto_pad": "SAME_UPPER"}, 5, [0, 0, 1, 1]),  # extra pad at the end
    ({"group": 2, "strides": [2, 2], "auto_pad": "SAME_LOWER"}, 5, [1, 1, 0, 0]),
    ({"group": 4, "dilations": [2, 3], "pads": [2, 3, 2, 3]}, 10, [2, 3, 2, 3]),
])
def test_grouped_strided_dilated_conv_with_resnet_style_sum(conv_attrs, out_hw, pads):
    net = Net(c=8, h=10, w=10, opset=9)
    net.inputs.append(helper.make_tensor_value_info("Z", F, [2, 12, out_hw, out_hw]))
    w = net.const(RNG.standard_normal((12, 8 // conv_attrs["group"], 3, 3)) * 0.3, "W")
    y = net.node("Conv", ["X", w, net.const(RNG.standard_normal(12), "B")], **conv_attrs)
    y = net.node("Relu", [net.node("Sum", [y, "Z"])])
    m = net.model(y)
    out, _ = optimize(m, ["fold-batchnorm", "conv-bias-act"], "cuda")
    (node,) = _fused_nodes(out)
    a = _attrs(node)
    assert a["pads"] == pads and a["group"] == conv_attrs["group"] and a["activation"] == b"none"
    feeds = feeds_for(m, extra={"Z": RNG.standard_normal((2, 12, out_hw, out_hw)).astype(np.float32)})
    assert_same(m, out, feeds)
    np.testing.assert_allclose(_kernel_model_output(out, node, feeds), run(m, feeds)[0], rtol=1e-4, atol=1e-4)


def test_dynamic_batch_keeps_one_kernel_for_every_batch():
    net = Net(c=3, h=8, w=8, batch="N")
    m = net.model(net.node("Relu", [net.conv("X", 3, 8)]))
    out, _ = optimize(m, ["conv-bias-act"], "cuda")
    (node,) = _fused_nodes(out)
    for batch in (1, 3):
        feeds = feeds_for(m, batch=batch)
        np.testing.assert_allclose(_kernel_model_output(out, node, feeds), run(m, feeds)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["bare_conv", "intermediate_is_output", "broadcast_add", "cpu_target"])
def test_conv_bias_act_leaves_alone(case):
    net = Net()
    y = net.conv("X", 4, 4)
    target = "cuda"
    if case == "bare_conv":
        outs = [net.node("MaxPool", [y], kernel_shape=[2, 2])]
    elif case == "intermediate_is_output":
        outs = [y, net.node("Relu", [y])]
    elif case == "broadcast_add":  # not a residual: a [1, 4, 1, 1] tensor is a bias, not a branch
        net.inputs.append(helper.make_tensor_value_info("Z", F, [1, 4, 1, 1]))
        outs = [net.node("Add", [y, "Z"])]
    else:
        outs = [net.node("Relu", [y])]
        target = "cpu"
    m = net.model(*outs)
    out, stats = optimize(m, ["conv-bias-act"] if target == "cuda" else ["fold-batchnorm"], target)
    assert not _fused_nodes(out)
    if target == "cpu":
        assert "conv-bias-act" not in [p.name for p in select_passes(None, "cpu")]


def test_node_carries_a_launchable_kernel_description():
    net = Net(c=16, h=14, w=14)
    m = net.model(net.node("Relu", [net.conv("X", 16, 32)]))
    out, _ = optimize(m, ["conv-bias-act"], "cuda")
    (node,) = _fused_nodes(out)
    a = _attrs(node)
    entry = a["cuda_entry"].decode()
    assert f'extern "C" __global__ void __launch_bounds__({a["cuda_block"]}, 1) {entry}(' in a["cuda_source"].decode()
    assert a["cuda_grid_cols"] == 14 * 14 and a["cuda_cols_per_block"] == a["cuda_tile"][1]
    assert a["cuda_grid_z"] == 1 and a["cuda_grid_y"] == -(-32 // a["cuda_tile"][0])
    assert [a[f"cuda_{d}"] for d in "chwkpq"] == [16, 14, 14, 32, 14, 14] and a["cuda_residual"] == 0
    # the fallback function is the replaced subgraph: Conv + Relu
    (fn,) = [f for f in out.functions if f.overload == node.overload]
    assert [n.op_type for n in fn.node] == ["Conv", "Relu"]


def _small_layer_without_and_with(option: str, arch: str):
    """(opted in, the fused node's attributes) for a 16 -> 32 channel 14x14 Conv + Relu on cuda,
    without and with the pass option."""
    net = Net(c=16, h=14, w=14)
    m = net.model(net.node("Relu", [net.conv("X", 16, 32)]))
    for opt_in in (False, True):
        out, _ = optimize(m, ["conv-bias-act"], "cuda", arch=arch, **{option: opt_in})
        (node,) = _fused_nodes(out)
        yield opt_in, _attrs(node)


@pytest.mark.parametrize("arch,split", [("sm_90", True), ("sm_86", False)])
def test_split_k_is_opt_in_and_needs_clusters(arch, split):
    """With conv_split_k, a layer of few output tiles gets split-K over a cluster where the
    architecture has clusters (sm_90+); without the option, or on sm_86, the plain kernel."""
    for opt_in, a in _small_layer_without_and_with("conv_split_k", arch):
        splitk = a["cuda_tile"][5] if len(a["cuda_tile"]) > 5 else 1
        want = opt_in and split
        assert (splitk > 1) == want and a["cuda_grid_z"] == splitk
        assert ("__cluster_dims__(1, 1, " in a["cuda_source"].decode()) == want


@pytest.mark.parametrize("arch,tensor_cores", [("sm_90", True), ("sm_80", True), ("sm_75", False)])
def test_tensor_cores_are_opt_in_and_need_sm80(arch, tensor_cores):
    """With conv_tensor_cores the layer gets the 3xTF32 WMMA kernel where TF32 WMMA exists
    (sm_80+); without the option, or on sm_75, the CUDA-core kernel."""
    for opt_in, a in _small_layer_without_and_with("conv_tensor_cores", arch):
        want = opt_in and tensor_cores
        assert (a["cuda_kind"] == b"gemm_tf32x3") == want
        assert ("wmma::mma_sync" in a["cuda_source"].decode()) == want


@pytest.mark.parametrize("name,policy,expected", [("resnet50", "always", 49), ("mobilenetv3", "always", 33),
                                                  ("resnet50", "pays", 4), ("mobilenetv3", "pays", 29)])
def test_zoo_cnn_fuses_and_fallback_matches(name, policy, expected):
    from onnxfuse.normalize import normalize
    from onnxfuse.zoo import resolve_input
    from onnxfuse.inputs import random_inputs

    m = normalize(resolve_input(f"zoo:{name}")).model
    out, stats = optimize(m, ["fold-batchnorm", "conv-bias-act"], "cuda", conv_policy=policy)
    assert stats["conv-bias-act"] == expected == len(_fused_nodes(out))
    feeds = random_inputs(m, {}, 0)
    for a, b in zip(run(m, feeds, "all"), run(out, feeds, "all")):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-5)


def test_cuda_policy_fuses_only_layers_where_the_kernel_beat_cudnn():
    # The measured rule (bench/results/conv_cuda_layers.md): depthwise layers and layers whose
    # per-thread serial work is small are fused; resnet50's deep 3x3s and wide 1x1s are not.
    from onnxfuse.ops.conv_bias_act import MAX_SERIAL_FMAS, pays_on_cuda, serial_fmas

    dw = ConvShape(240, 4, 4, 240, 5, 5, (1, 1), (2, 2, 2, 2), group=240)
    deep = ConvShape(512, 7, 7, 512, 3, 3, (1, 1), (1, 1, 1, 1))
    small = ConvShape(64, 56, 56, 64, 1, 1)
    assert pays_on_cuda(dw) and pays_on_cuda(small) and not pays_on_cuda(deep)
    assert serial_fmas(small) <= MAX_SERIAL_FMAS < serial_fmas(deep)
    for shape, fused in ((small, True), (deep, False), (dw, True)):
        net = Net(c=shape.c, h=shape.h, w=shape.w, batch=1)
        y = net.node("Relu", [net.conv("X", shape.c, shape.k, r=shape.r, group=shape.group)])
        out, stats = optimize(net.model(y), ["conv-bias-act"], "cuda")
        assert stats["conv-bias-act"] == int(fused), shape
        assert len(_fused_nodes(out)) == int(fused)
