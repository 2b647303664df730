"""pack-gqa-qkv: a decode step's q, k, v projections (MatMul + bias, Qwen2's; or MatMul alone)
feeding onnxruntime's GroupQueryAttention become one MatMul (+ one Add) on the packed QKV the op
reads. Each model is generated here, run against the rewritten one in onnxruntime at two past
lengths, and its kernels counted against onnxruntime alone on the same machine."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.api import optimize as optimize_model
from onnxfuse.profile import count_kernels
from test_pass_matmul_batch import assert_same, optimize

D, HEADS, KV_HEADS, WIDTH, CACHE = 64, 4, 2, 16, 64
PASSES = ["pack-gqa-qkv"]


def decode_step(biases=(True, True, True), rotary: bool = True, seed: int = 0,
                k_read_elsewhere: bool = False) -> onnx.ModelProto:
    """x [batch, 1, D] -> q, k, v = x W (+ b) -> GroupQueryAttention with the past keys and values
    [batch, Hkv, past, d]; the lengths computed from the past's shape as a decode step does."""
    rng = np.random.default_rng(seed)
    widths = {"q": HEADS * WIDTH, "k": KV_HEADS * WIDTH, "v": KV_HEADS * WIDTH}
    inits, nodes = [], []
    for (p, n), biased in zip(widths.items(), biases):
        inits.append(numpy_helper.from_array((rng.standard_normal((D, n)) / 8).astype(np.float32), f"W{p}"))
        nodes.append(helper.make_node("MatMul", ["x", f"W{p}"], [f"{p}_mm"], name=f"{p}_proj"))
        if biased:
            inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"b{p}"))
            # Qwen2's TorchScript export writes the bias first
            nodes.append(helper.make_node("Add", [f"b{p}", f"{p}_mm"], [p], name=f"{p}_bias"))
        else:
            nodes[-1].output[0] = p
    angles = np.arange(CACHE)[:, None] * (10000.0 ** (-np.arange(WIDTH // 2) / (WIDTH // 2)))[None, :]
    inits += [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
              numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin"),
              numpy_helper.from_array(np.array([2], np.int64), "two"),
              numpy_helper.from_array(np.array([3], np.int64), "three"),
              numpy_helper.from_array(np.array([1], np.int64), "one"),
              numpy_helper.from_array(np.array([0], np.int64), "zero"),
              numpy_helper.from_array(np.zeros((1, 1, 1, 1), np.float32), "bias0")]
    nodes += [
        helper.make_node("Shape", ["past_key"], ["pk_shape"]),
        helper.make_node("Slice", ["pk_shape", "two", "three"], ["past_len"]),
        helper.make_node("Add", ["past_len", "one"], ["total64"]),
        helper.make_node("Sub", ["total64", "one"], ["seqlen64"]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Slice", ["x_shape", "zero", "one"], ["batch"]),
        helper.make_node("Expand", ["seqlen64", "batch"], ["seqlens64"]),
        helper.make_node("Cast", ["seqlens64"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Squeeze", ["total64"], ["total_sq"]),
        helper.make_node("Cast", ["total_sq"], ["total_len"], to=TensorProto.INT32),
        helper.make_node("GroupQueryAttention",
                         ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total_len",
                          "cos" if rotary else "", "sin" if rotary else ""],
                         ["out", "present_key", "present_value"], domain="com.microsoft", name="gqa",
                         num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=int(rotary), scale=WIDTH ** -0.5),
    ]
    cache = ["batch", KV_HEADS, "past", WIDTH]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 1, HEADS * WIDTH]),
               helper.make_tensor_value_info("present_key", TensorProto.FLOAT, ["batch", KV_HEADS, "total", WIDTH]),
               helper.make_tensor_value_info("present_value", TensorProto.FLOAT, ["batch", KV_HEADS, "total", WIDTH])]
    if k_read_elsewhere:
        outputs.append(helper.make_tensor_value_info("k", TensorProto.FLOAT, ["batch", 1, KV_HEADS * WIDTH]))
    graph = helper.make_graph(
        nodes, "decode_step",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, D]),
         helper.make_tensor_value_info("past_key", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("past_value", TensorProto.FLOAT, cache)],
        outputs, inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    return m


def feeds(seed: int, batch: int, past: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 1, D)).astype(np.float32),
            "past_key": rng.standard_normal((batch, KV_HEADS, past, WIDTH)).astype(np.float32),
            "past_value": rng.standard_normal((batch, KV_HEADS, past, WIDTH)).astype(np.float32)}


FEEDS = [feeds(0, 1, 8), feeds(1, 3, 17)]
DIMS = {"batch": 1, "past": 16}


def gqa(m: onnx.ModelProto):
    return next(n for n in m.graph.node if n.op_type == "GroupQueryAttention")


def op_counts(m: onnx.ModelProto) -> dict:
    counts: dict = {}
    for n in m.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


@pytest.mark.parametrize("biased", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("rotary", [True, False], ids=["rotary", "no-rotary"])
def test_projections_become_one_matmul_on_the_packed_input(biased, rotary):
    m = decode_step((biased,) * 3, rotary)
    out, matches = optimize(m, PASSES)
    assert matches == 1
    node = gqa(out)
    assert node.input[1] == node.input[2] == ""
    counts = op_counts(out)
    assert counts["MatMul"] == 1 and counts.get("Add", 0) - op_counts(m)["Add"] == (-2 if biased else 0)
    assert_same(m, out, FEEDS)


def test_packed_bias_is_the_three_biases_in_order():
    m = decode_step()
    out, _ = optimize(m, PASSES)
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    add = next(n for n in out.graph.node if n.op_type == "Add" and n.output[0] == gqa(out).input[0])
    packed = next(inits[i] for i in add.input if i in inits)
    want = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    np.testing.assert_array_equal(packed, np.concatenate([want["bq"], want["bk"], want["bv"]]))


def test_default_pipeline_saves_the_kernels_against_onnxruntime_alone():
    m = decode_step()
    result = optimize_model(m, dims=DIMS, threads=1, count_kernels=False)
    before = count_kernels(m, threads=1, dims=DIMS)[0]
    after = count_kernels(result.model, threads=1, dims=DIMS)[0]
    # three MatMuls and three bias Adds became one MatMul and one Add
    assert after <= before - 4
    assert_same(m, result.model, FEEDS)


@pytest.mark.parametrize("biases", [(True, False, True), (False, True, True)])
def test_projections_with_and_without_bias_stay(biases):
    m = decode_step(biases)
    out, matches = optimize(m, PASSES)
    assert matches == 0 and gqa(out).input[1] == "k"


def test_projection_read_elsewhere_stays():
    m = decode_step(k_read_elsewhere=True)
    out, matches = optimize(m, PASSES)
    assert matches == 0 and op_counts(out)["MatMul"] == 3


def test_explain_names_the_unpacked_op_alone():
    from onnxfuse.optimize_options import OptimizeOptions

    run_optimize = optimize_model
    mixed = run_optimize(decode_step((True, False, True)), settings=OptimizeOptions(
        explain=("pack-gqa-qkv",), verify=False, count_kernels=False))
    packed = run_optimize(decode_step(), settings=OptimizeOptions(
        explain=("pack-gqa-qkv",), verify=False, count_kernels=False))
    # the op whose projections differ is named with its reason; the one packed is no candidate
    assert "gqa" in mixed.summary["unmatched"]["pack-gqa-qkv"]
    assert "gqa" not in packed.summary["unmatched"].get("pack-gqa-qkv", {})
