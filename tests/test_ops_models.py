"""Each fused op's module (onnxfuse/ops) against what its pass replaces: the numpy model of the
op, given the inputs of every fused node the pass writes, gives what onnxruntime computes for
the replaced subgraph (the node's fallback function, run without our library), and every
attribute the pass writes is one the op's contract declares."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxfuse import ops, runtime
from onnxfuse.fused import DOMAIN
from onnxfuse.pipeline import Context, PassOptions, run_passes, select_passes
from attention_models import attention_model, rotary_attention_model
from small_models import float_model
from test_pass_channel_shuffle import shuffle_unit
from test_pass_matmul_batch import ensemble_model
from test_pass_squeeze_excite import Block

RNG = np.random.default_rng(27)


def _feeds(model: onnx.ModelProto, sizes: dict) -> dict:
    out = {}
    for vi in model.graph.input:
        shape = [sizes.get(d.dim_param, 2) if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        out[vi.name] = RNG.standard_normal(shape).astype(np.float32)
    return out


def _constants(model: onnx.ModelProto) -> dict:
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return values


def check_models_of_fused_nodes(model, passes, target="cpu", sizes=None, **options) -> set[str]:
    """Optimize `model` with `passes`; for each fused node, its op's numpy model on the node's
    inputs against onnxruntime's run of the node's fallback function. Returns the op types seen."""
    ctx = Context(target=target, options=PassOptions.from_mapping(options))
    work = onnx.ModelProto()
    work.CopyFrom(model)
    optimized, _ = run_passes(work, select_passes(passes, target), ctx)
    fused = [n for n in optimized.graph.node if n.domain == DOMAIN]
    assert fused, f"{passes} wrote no fused node"
    constants = _constants(optimized)
    probe = onnx.ModelProto()
    probe.CopyFrom(optimized)
    graph_outputs = {o.name for o in probe.graph.output}
    wanted = {t for n in fused for t in [*n.input, *n.output] if t and t not in constants}
    probe.graph.output.extend(onnx.ValueInfoProto(name=t) for t in sorted(wanted - graph_outputs))
    feeds = _feeds(model, sizes or {})
    names = [o.name for o in probe.graph.output]
    values = {**constants, **dict(zip(names, runtime.make_session(probe, with_library=False, threads=1).run(None, feeds)))}
    for node in fused:
        op = ops.BY_NAME[node.op_type]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert op.unknown_attributes(attrs) == [], f"{node.op_type} attributes outside its contract"
        got = op.reference([values[t] if t else None for t in node.input], attrs, len(node.output))
        assert len(got) == len(node.output)
        for name, g in zip(node.output, got):
            want = values[name]
            assert g.shape == want.shape, (node.op_type, g.shape, want.shape)
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))
    return {n.op_type for n in fused}


def test_pointwise_model_is_the_region_onnxruntime_runs():
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["m"]),
             helper.make_node("Add", ["m", "y"], ["a"]), helper.make_node("Tanh", ["a"], ["out"])]
    m = float_model("pw", nodes, {"x": [2, 3, 4], "y": [3, 4]}, {"out": [2, 3, 4]})
    assert check_models_of_fused_nodes(m, ["pointwise"]) == {"Pointwise"}


@pytest.mark.parametrize("hidden,gate,silu", [("Relu", "Sigmoid", False), ("HardSwish", "HardSigmoid", True)])
def test_squeeze_excite_model_is_the_block(hidden, gate, silu):
    m = Block().model(hidden=hidden, gate=gate, input_silu=silu)
    assert check_models_of_fused_nodes(m, ["squeeze-excite"]) == {"SqueezeExcite"}


@pytest.mark.parametrize("concat,cut", [(2, "split"), (1, "none")])
def test_channel_shuffle_model_is_the_shuffle(concat, cut):
    m = shuffle_unit(c=12, concat=concat, cut=cut)
    assert check_models_of_fused_nodes(m, ["channel-shuffle"], sizes={"batch": 2}) == {"ChannelShuffle"}


def test_stacked_mlp_model_is_the_stacked_ensemble():
    m = ensemble_model(k=3, d=8, hidden=20, out=3, batch=1)
    assert check_models_of_fused_nodes(m, ["batch-ensemble"]) == {"StackedMLP"}


@pytest.mark.parametrize("packed", [True, False])
def test_attention_model_is_the_attention_subgraph(packed):
    m = attention_model(packed=packed)
    assert check_models_of_fused_nodes(m, ["fuse-attention"], sizes={"B": 2, "S": 5, "Sq": 5, "Sk": 5}) == {"Attention"}


@pytest.mark.parametrize("layout", ["per_head", "split"])
def test_attention_model_reads_heads_first_operands(layout):
    # A partial rotary between the head split and the scores: q and k (and GPT-NeoX's v) are read
    # [B, H, S, d], with heads_first, an attribute of the op's contract.
    m = rotary_attention_model(layout=layout)
    assert check_models_of_fused_nodes(m, ["fuse-attention"], sizes={"B": 2, "S": 5}) == {"Attention"}


def test_conv_bias_act_model_is_the_convolution_and_its_epilogue():
    w = numpy_helper.from_array(RNG.standard_normal((6, 2, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(RNG.standard_normal(6).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 0, 1, 2], strides=[2, 1], group=2),
             helper.make_node("HardSigmoid", ["c"], ["h"], alpha=0.2, beta=0.5),
             helper.make_node("Mul", ["c", "h"], ["out"])]
    m = float_model("conv", nodes, {"x": [1, 4, 7, 6]}, {"out": None}, [w, b])
    assert check_models_of_fused_nodes(m, ["conv-bias-act"], target="cuda", conv_policy="always") == {"ConvBiasAct"}
