"""fuse-attention on the forms encoder exports write beside the ones test_pass_attention covers:
a scale split over q and kT (Whisper, TorchScript exporter: (q*c) @ (kT*c)) and two additive
terms before Softmax (T5: the relative-position bias, then the padding mask), which the node
reads summed as one mask. Results are checked with the library and without it (the fallback
function) against the original model."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from attention_models import attention_model
from test_pass_attention import PASS, attrs, check_runs_like_original, feeds_for, fused
from test_pass_matmul_batch import optimize


def _insert_after(m: onnx.ModelProto, producer: str, node: onnx.NodeProto) -> None:
    """Put `node` right after the node named `producer` (the model stays topologically sorted)."""
    at = next(i for i, n in enumerate(m.graph.node) if n.name == producer)
    m.graph.node.insert(at + 1, node)


def _reroute(m: onnx.ModelProto, old: str, new: str, skip: str) -> None:
    """Every node but `skip` that reads `old` reads `new` instead."""
    for n in m.graph.node:
        if n.name != skip:
            n.input[:] = [new if i == old else i for i in n.input]


def scale_on_q_and_kt(c=0.5, kt_scale="const"):
    """attention_model with the scale written as the TorchScript exporter splits it:
    MatMul(qh * c, kt * c). kt_scale "input": kt's factor is a graph input (not a constant)."""
    m = attention_model(scale="mul_q", scale_value=c)
    if kt_scale == "const":
        m.graph.initializer.append(numpy_helper.from_array(np.array(c, np.float32), "k_scale"))
    else:
        m.graph.input.append(helper.make_tensor_value_info("k_scale", TensorProto.FLOAT, []))
    _insert_after(m, "k_transpose", helper.make_node("Mul", ["kt", "k_scale"], ["kts"], name="k_scale"))
    _reroute(m, "kt", "kts", skip="k_scale")
    onnx.checker.check_model(m)
    return m


def two_mask_terms(bias_shape=(1, 2, "S", "S"), mask_shape=("B", 1, 1, "S"), blocks=1, merge="shape",
                   extra_output=None):
    """attention_model whose scores get two additive terms before Softmax, as T5 writes them:
    ((scores + mask) + bias); the bias a graph input of `bias_shape`. blocks = 2: a second
    attention block reads the block's output and the same two terms (T5's layers share them)."""
    m = attention_model(scale="none", mask=mask_shape, merge=merge, extra_output=extra_output)
    m.graph.input.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, list(bias_shape)))
    _insert_after(m, "mask_add", helper.make_node("Add", ["masked", "bias"], ["biased"], name="bias_add"))
    _reroute(m, "masked", "biased", skip="bias_add")
    if blocks == 2:
        second = attention_model(scale="none", mask=mask_shape, merge=merge, seed=1)
        names = {}
        for init in second.graph.initializer:
            names[init.name] = f"b2_{init.name}"
            init.name = names[init.name]
            m.graph.initializer.append(init)
        for n in second.graph.node:
            n.name = f"b2_{n.name}"
            n.input[:] = [names.get(i, {"x": "y", "mask": "mask"}.get(i, f"b2_{i}")) for i in n.input]
            n.output[:] = [f"b2_{o}" for o in n.output]
            m.graph.node.append(n)
        add = next(n for n in m.graph.node if n.name == "b2_mask_add")
        m.graph.node.append(helper.make_node("Add", [add.output[0], "bias"], ["b2_biased"], name="b2_bias_add"))
        _reroute(m, add.output[0], "b2_biased", skip="b2_bias_add")
        # keep the graph sorted: the second block's bias Add before its Softmax
        nodes = list(m.graph.node)
        bias_add = nodes.pop()
        at = next(i for i, n in enumerate(nodes) if n.name == "b2_softmax")
        nodes.insert(at, bias_add)
        m.graph.ClearField("node")
        m.graph.node.extend(nodes)
        m.graph.output[0].name = "b2_y"
    onnx.checker.check_model(m)
    return m


def feeds_with_bias(m, b, s, seed=0):
    feeds = feeds_for(m, b, s, seed=seed)
    rng = np.random.default_rng(seed + 1)
    shape = [{"B": b, "S": s}.get(d.dim_param, d.dim_value) for d in
             next(i for i in m.graph.input if i.name == "bias").type.tensor_type.shape.dim]
    feeds["bias"] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def test_scale_split_over_q_and_kt_fuses_with_the_product_of_both_factors():
    m = scale_on_q_and_kt(0.5)
    opt, n = optimize(m, PASS)
    assert n == 1
    [node] = fused(opt)
    assert attrs(node) == {"num_heads": 2, "scale": pytest.approx(0.25), "has_mask": 1, "qkv_packed": 1}
    assert [x.op_type for x in opt.graph.node] == ["MatMul", "Attention"]
    check_runs_like_original(m, opt, [feeds_for(m, b, s) for b, s in ((1, 1), (2, 6), (3, 13))])


def test_kt_scaled_by_a_graph_input_is_left_alone():
    opt, n = optimize(scale_on_q_and_kt(kt_scale="input"), PASS)
    assert n == 0 and not fused(opt)


def test_position_bias_and_padding_mask_become_one_summed_mask_input():
    m = two_mask_terms()
    opt, n = optimize(m, PASS)
    assert n == 1
    [node] = fused(opt)
    assert attrs(node) == {"num_heads": 2, "scale": pytest.approx(1.0), "has_mask": 1, "qkv_packed": 1}
    [mask_sum] = [x for x in opt.graph.node if x.op_type == "Add"]
    assert sorted(mask_sum.input) == ["bias", "mask"] and node.input[1] == mask_sum.output[0]
    check_runs_like_original(m, opt, [feeds_with_bias(m, b, s) for b, s in ((1, 1), (2, 6), (3, 13))])


def test_blocks_reading_the_same_two_terms_share_one_summed_mask():
    m = two_mask_terms(blocks=2)
    opt, n = optimize(m, PASS)
    assert n == 2 and len(fused(opt)) == 2
    [mask_sum] = [x for x in opt.graph.node if x.op_type == "Add"]
    assert all(node.input[1] == mask_sum.output[0] for node in fused(opt))
    check_runs_like_original(m, opt, [feeds_with_bias(m, b, s) for b, s in ((1, 3), (2, 9))])


@pytest.mark.parametrize(
    "options",
    [
        dict(bias_shape=("M0", "M1", "M2", "M3"), merge="const"),  # the sum may broadcast the scores up
        dict(extra_output="masked"),  # scores + mask read outside the chain
    ],
    ids=["terms-may-broadcast-up", "first-sum-used-elsewhere"],
)
def test_two_mask_terms_that_do_not_fit_or_are_read_elsewhere_are_left_alone(options):
    m = two_mask_terms(**options)
    opt, n = optimize(m, PASS)
    assert n == 0 and not fused(opt)
