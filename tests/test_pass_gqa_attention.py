"""fuse-gqa: the LLaMA-style decoder's grouped-query attention (rotary, repeat_kv, causal and
padding mask) as onnxruntime's GroupQueryAttention, on the corpus's exports by both torch.onnx
exporters, and the forms it must leave alone. Every rewritten model is run against the
original in onnxruntime, at two shape sets and with masks that leave whole rows masked."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxfuse import zoo
from test_pass_matmul_batch import assert_same, optimize, run

EXPORTS = ["llama_ts", "llama_dynamo"]
# The passes that run before fuse-gqa in the default pipeline and shape what it sees (the
# TorchScript export's one-input Concats go with remove-noop-slice).
PASSES = ["fold-constants", "remove-identity", "remove-noop-slice", "fuse-gqa"]


def llama(name: str) -> onnx.ModelProto:
    return zoo.get(name).load()


def feeds(seed: int, batch: int, seq: int) -> dict:
    rng = np.random.default_rng(seed)
    mask = (rng.random((batch, seq)) < 0.7).astype(np.int64)
    mask[0, :] = 1
    mask[-1, 0] = 0  # left padding: the first query row of that sequence has every key masked
    return {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64), "attention_mask": mask}


FEEDS = [feeds(0, 2, 16), feeds(1, 1, 7), feeds(2, 3, 5)]


def gqa_nodes(m: onnx.ModelProto) -> list:
    return [n for n in m.graph.node if n.domain == "com.microsoft" and n.op_type == "GroupQueryAttention"]


def fused_layers(m: onnx.ModelProto, feeds=None) -> int:
    """The GroupQueryAttention nodes fuse-gqa makes of m, its outputs checked on `feeds`
    (FEEDS[:2] when not given)."""
    out, _ = optimize(m, PASSES)
    assert_same(m, out, FEEDS[:2] if feeds is None else feeds)
    return len(gqa_nodes(out))


def attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("name", EXPORTS)
def test_llama_attention_becomes_group_query_attention_with_rotary_and_mask(name):
    m = llama(name)
    out, matches = optimize(m, PASSES)
    nodes = gqa_nodes(out)
    assert len(nodes) == 2 and matches >= 2
    for node in nodes:
        a = attrs(node)
        assert (a["num_heads"], a["kv_num_heads"], a["do_rotary"], a["causal"]) == (4, 2, 1, 0)
        assert a["scale"] == pytest.approx(0.25)
        # q, k, v projections packed into one MatMul the op reads; the mask is its attention_bias
        assert node.input[1] == node.input[2] == ""
        assert node.input[10] != ""
    ops = {n.op_type for n in out.graph.node}
    assert not ops & {"Softmax", "Neg", "Transpose"}
    assert_same(m, out, FEEDS)


def _replace_input(m: onnx.ModelProto, node, index: int, op_type: str, *others) -> None:
    """node.input[index] = op_type(node.input[index], *others), a new node before it."""
    name = f"{node.input[index]}_changed"
    at = list(m.graph.node).index(node)
    m.graph.node.insert(at, helper.make_node(op_type, [node.input[index], *others], [name], name=name))
    node.input[index] = name


def _llama_with_unequal_rotary_halves(name: str) -> onnx.ModelProto:
    """The LLaMA export with its rotary angles Concat(f, f) changed to Concat(f, 2 f)."""
    m = llama(name)
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two"))
    cat = next(n for n in m.graph.node if n.op_type == "Concat" and len(n.input) == 2 and n.input[0] == n.input[1])
    _replace_input(m, cat, 1, "Mul", "two")
    return m


@pytest.mark.parametrize("name", EXPORTS)
def test_rotary_caches_with_unequal_halves_stay_unfused(name):
    # cos = Cos(Concat(f, 2 f)): each half its own rows, which GroupQueryAttention's half-width
    # caches cannot hold.
    m = _llama_with_unequal_rotary_halves(name)
    assert fused_layers(m) == 0


@pytest.mark.parametrize("name", EXPORTS)
def test_explain_says_why_each_layer_stayed_unfused(name):
    from onnxfuse.api import optimize as optimize_model
    from onnxfuse.optimize_options import OptimizeOptions

    m = _llama_with_unequal_rotary_halves(name)
    result = optimize_model(m, settings=OptimizeOptions(passes=tuple(PASSES), explain=("fuse-gqa",), verify=False,
                                                        count_kernels=False))
    reasons = [r for rs in result.summary["unmatched"]["fuse-gqa"].values() for r in rs]
    said = [r for r in reasons if "cos and sin are not Cos and Sin of Concat(f, f)" in r]
    assert len(said) == 2  # one per layer: the reasons of the forms whose patterns matched


def test_rotate_half_not_at_the_middle_stays_unfused():
    # rotate_half split at d/4: Concat(-x[..., 4:], x[..., :4]) is not the rotary GroupQueryAttention applies
    m = llama("llama_dynamo")
    slices = [n for n in m.graph.node if n.op_type == "Slice" and n.input[0].startswith("transpose")]
    half = {n.input[2] for n in slices} & {n.input[1] for n in slices}
    assert len(half) == 1
    for init in m.graph.initializer:
        if init.name in half:
            init.CopyFrom(onnx.numpy_helper.from_array(np.array([4], np.int64), init.name))
    assert fused_layers(m) == 0


@pytest.mark.parametrize("name", EXPORTS)
def test_attention_probabilities_read_elsewhere_keep_their_layer_unfused(name):
    m = llama(name)
    softmax = next(n for n in m.graph.node if n.op_type == "Softmax")
    m.graph.output.append(helper.make_tensor_value_info(softmax.output[0], onnx.TensorProto.FLOAT, None))
    assert fused_layers(m) == 1


# Decode steps: one new token after a past of P cached positions (past keys and values inputs,
# present outputs), as models/corpus/build.py exports them: LLaMA's grouped-query attention with
# rotary and GPT-2's multi-head attention without (its dynamo export merges the heads as
# [B*S, H*d] for its out-projection), both exporters.
DECODE_EXPORTS = ["llama_decode_ts", "llama_decode_dynamo"]
# name: (kv heads, rotary)
DECODE = {"llama_decode_ts": (2, 1), "llama_decode_dynamo": (2, 1), "gpt2_decode_ts": (4, 0), "gpt2_decode_dynamo": (4, 0)}


def decode_feeds(seed: int, batch: int, past: int, kv_heads: int = 2) -> dict:
    rng = np.random.default_rng(seed)
    mask = (rng.random((batch, past + 1)) < 0.7).astype(np.int64)
    mask[:, -1] = 1
    mask[0, :] = 1
    feeds = {"input_ids": rng.integers(0, 1000, (batch, 1)).astype(np.int64), "attention_mask": mask}
    for i in range(2):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{i}"] = rng.standard_normal((batch, kv_heads, past, 16)).astype(np.float32)
    return feeds


def decode_feeds_for(kv_heads: int) -> list:
    return [decode_feeds(0, 2, 8, kv_heads), decode_feeds(1, 1, 17, kv_heads), decode_feeds(2, 3, 1, kv_heads),
            decode_feeds(3, 2, 40, kv_heads), decode_feeds(4, 2, 0, kv_heads)]


DECODE_FEEDS = decode_feeds_for(2)


@pytest.mark.parametrize("name", sorted(DECODE))
def test_decode_step_attention_becomes_group_query_attention_with_past_and_present(name):
    kv_heads, rotary = DECODE[name]
    m = llama(name)
    out, _ = optimize(m, PASSES)
    nodes = gqa_nodes(out)
    assert len(nodes) == 2
    outputs = {o.name for o in out.graph.output}
    for i, node in enumerate(sorted(nodes, key=lambda n: n.input[3])):
        a = attrs(node)
        assert (a["num_heads"], a["kv_num_heads"], a["do_rotary"], a["causal"]) == (4, kv_heads, rotary, 0)
        # q, k, v packed: GPT-2's one projection split in three, LLaMA's three packed in one
        assert node.input[1] == node.input[2] == ""
        # the past goes in, the present (Concat(past, new)) comes out as the model's outputs
        assert list(node.input[3:5]) == [f"past_key_{i}", f"past_value_{i}"]
        assert list(node.output[1:3]) == [f"present_key_{i}", f"present_value_{i}"]
        assert set(node.output[1:3]) <= outputs
        if name.endswith("_dynamo"):
            # the export's mask [batch, 1, 1, total] is the op's bias as it is: no Expand first
            assert not node.input[10].startswith("gqa_")
    ops = {n.op_type for n in out.graph.node}
    assert not ops & {"Softmax", "Neg"}
    # past lengths 8, 17, 1, 40 and 0 (the first token): the rotary caches are padded to the
    # past, the op rotates the new token by row P of them
    assert_same(m, out, decode_feeds_for(kv_heads))


@pytest.mark.parametrize("name", DECODE_EXPORTS)
def test_decode_keys_appended_before_the_past_stay_unfused(name):
    # present = Concat(new, past): not the cache GroupQueryAttention appends to
    m = llama(name)
    cat = next(n for n in m.graph.node if n.op_type == "Concat" and n.output[0] == "present_key_0")
    assert len(cat.input) == 2
    cat.input[0], cat.input[1] = cat.input[1], cat.input[0]
    assert fused_layers(m, DECODE_FEEDS[:2]) == 1


def test_decode_key_length_written_as_past_plus_one_is_proved():
    # torch.export's 1-layer decode step writes repeat_kv's expand target with the key length
    # computed, Reshape(Shape(past)[2] + 1, [-1]), where the 2-layer export reads the mask's
    # Shape: a sum of dims, which the shape facts carry (before: MultiHeadAttention, 66 kernels).
    m = llama("llama_decode_dynamo")
    target = next(n for n in m.graph.node if n.op_type == "Expand" and n.output[0] == "expand_1").input[1]
    concat = next(n for n in m.graph.node if n.output[0] == target)
    one = helper.make_tensor("one_key", onnx.TensorProto.INT64, [], [1])
    flat = helper.make_tensor("flat_key", onnx.TensorProto.INT64, [1], [-1])
    sq = helper.make_tensor("sq_axis", onnx.TensorProto.INT64, [1], [0])
    m.graph.initializer.extend([one, flat, sq])
    i = list(m.graph.node).index(concat)
    m.graph.node.insert(i, helper.make_node("Reshape", ["key_len", "flat_key"], ["key_len_1"]))
    m.graph.node.insert(i, helper.make_node("Add", ["past_len", "one_key"], ["key_len"]))
    m.graph.node.insert(i, helper.make_node("Squeeze", ["past_len_1", "sq_axis"], ["past_len"]))
    m.graph.node.insert(i, helper.make_node("Shape", ["past_key_0"], ["past_len_1"], start=2, end=3))
    concat.input[3] = "key_len_1"
    assert fused_layers(m, DECODE_FEEDS) == 2


def test_multi_head_attention_without_a_past_is_left_to_fuse_attention():
    # GPT-2's full-sequence attention has the decode step's form less the Concat(past, new):
    # onnxfuse.Attention (causal mode, no past) takes it, not GroupQueryAttention
    m = llama("gpt2_ts")
    out, _ = optimize(m, PASSES)
    assert not gqa_nodes(out)
    assert sum(n.op_type == "Softmax" for n in out.graph.node) == 2


@pytest.mark.parametrize("name", ["gpt2_decode_ts", "llama_decode_dynamo"])
def test_decode_nan_guard_after_the_op_is_one_fused_node(name):
    # the exports guard their probabilities with Where(IsNaN(p), 0, p); the exact guard after the
    # op (Sub, ReduceSum over the value cache, Expand for grouped heads, Reshape, IsNaN, Where)
    # is one onnxfuse.AttentionNanGuard per layer, reading the op's output and present values
    # (the default pipeline, verified)
    from onnxfuse.api import optimize as optimize_model

    m = llama(name)
    out = optimize_model(m, dims=zoo.get(name).dims, threads=1, count_kernels=False).model
    nodes = gqa_nodes(out)
    assert len(nodes) == 2
    guards = [n for n in out.graph.node if n.op_type == "AttentionNanGuard" and n.domain == "onnxfuse"]
    assert sorted((g.input[0], g.input[1]) for g in guards) == sorted((n.output[0], n.output[2]) for n in nodes)
    producers = {o: n for n in out.graph.node for o in n.output}
    for g in guards:
        assert (attrs(g)["num_heads"], attrs(g)["kv_num_heads"]) == (4, DECODE[name][0])
        # gqa-residual: the output projection of the unguarded output and the residual Add
        # after it go into the guard (projected = MatMul(out, W), W, residual)
        assert len(g.input) == 5
        proj = producers[g.input[2]]
        assert proj.op_type == "MatMul" and list(proj.input) == [g.input[0], g.input[3]]
    assert not [n for n in out.graph.node if n.op_type in ("IsNaN", "ReduceSum")]
    # the kernel gives what the fallback function (the exact guard) gives, special values too
    assert_same(m, out, decode_feeds_for(DECODE[name][0])[:2])
    for feeds in decode_special_feeds(DECODE[name][0]):
        for want, got in zip(run(out, feeds), run_with_library(out, feeds)):
            # special values where the fallback has them (the other fused nodes round apart)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
            ok = np.isfinite(want)
            np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-5)


def run_with_library(m, feeds):
    import onnxruntime as ort

    from onnxfuse.runtime import library_path

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    so.register_custom_ops_library(library_path())
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def decode_special_feeds(kv_heads: int) -> list:
    # one sequence attends to its new token only (mask 0, 0, 0, 3: any nonzero value attends),
    # and a masked past value of one head is infinite or NaN: the original's probability 0 of
    # that position times it is NaN in that column (the NaN guard is before P.V); a head whose
    # keys give NaN scores has its probabilities guarded to 0 and gives 0 . V
    out = []
    for bad in (-np.inf, np.inf, np.nan):
        f = decode_feeds(5, 2, 3, kv_heads)
        f["attention_mask"] = np.array([[2, 1, 1, 0], [0, 0, 0, 3]], np.int64)
        f["past_value_0"][1, 1, 0, 5] = bad
        f["past_key_1"][1, 0, 1, 7] = np.nan
        f["past_value_1"][1, 1, 2, 3] = bad
        out.append(f)
    return out


@pytest.mark.parametrize("name", ["gpt2_decode_ts", "llama_decode_dynamo"])
def test_decode_nan_guard_keeps_nan_from_masked_non_finite_values(name):
    # the default pipeline (verified with special values at these dims: it failed there before)
    from onnxfuse.api import optimize as optimize_model

    m = llama(name)
    out = optimize_model(m, dims={"batch": 2, "past": 3, "total": 4}, threads=1, count_kernels=False).model
    assert len(gqa_nodes(out)) == 2
    feeds_list = decode_special_feeds(DECODE[name][0])
    ref = run(m, feeds_list[0])
    assert np.isnan(ref[0][1]).all() and not np.isnan(ref[0][0]).any()
    for feeds in feeds_list:
        for want, got in [*zip(run(m, feeds), run(out, feeds)), *zip(run(m, feeds), run_with_library(out, feeds))]:
            assert got.shape == want.shape
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
            ok = np.isfinite(want)
            np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-5 * max(float(np.abs(want[ok]).max()), 1e-30))


def test_decode_op_output_dims_let_gpt2_projections_become_matmuls():
    # onnxfuse's shape inference gives the contrib op's output made-up dims; fuse-gqa names them
    # [past's batch, S, H*d] (its NaN guard's too), so that gemm-as-matmul proves GPT-2's Conv1D
    # projections after the first attention (Reshape -> Gemm -> Reshape) as MatMuls
    from onnxfuse.api import optimize as optimize_model

    m = llama("gpt2_decode_ts")
    out = optimize_model(m, dims={"batch": 1, "past": 8, "total": 9}, threads=1, count_kernels=False).model
    assert len(gqa_nodes(out)) == 2
    assert not [n for n in out.graph.node if n.op_type == "Gemm"]
    assert_same(m, out, decode_feeds_for(4))


@pytest.mark.parametrize("projected", [False, True])
def test_nan_guard_kernel_matches_its_model_with_special_values(projected):
    # onnxfuse.AttentionNanGuard alone: a row of out all NaN (every key masked), a row with one
    # head NaN, a value column holding inf (Z NaN there) and one holding NaN; with the projection
    # and residual, the guarded rows are recomputed and the others are residual + projected
    from onnxfuse.ops.attention_nan_guard import OP

    rng = np.random.default_rng(0)
    out = rng.standard_normal((2, 3, 8)).astype(np.float32)
    out[0, 1, :] = np.nan
    out[1, 2, 4:6] = np.nan  # head 2: kv head 1, finite values: Z = 0, the row recomputed finite
    values = rng.standard_normal((2, 2, 5, 2)).astype(np.float32)
    values[0, 0, 3, 1] = np.inf
    values[1, 0, 1, 0] = np.nan
    w = rng.standard_normal((8, 6)).astype(np.float32)
    residual = rng.standard_normal((2, 3, 6)).astype(np.float32)
    f = onnx.TensorProto.FLOAT
    nodes, inputs = [], [helper.make_tensor_value_info("out", f, [2, 3, 8]),
                         helper.make_tensor_value_info("values", f, [2, 2, 5, 2])]
    guard_inputs, feeds = ["out", "values"], {"out": out, "values": values}
    inits = []
    if projected:
        inits.append(onnx.numpy_helper.from_array(w, "w"))
        inputs.append(helper.make_tensor_value_info("residual", f, [2, 3, 6]))
        nodes.append(helper.make_node("MatMul", ["out", "w"], ["projected"]))
        guard_inputs += ["projected", "w", "residual"]
        feeds["residual"] = residual
    nodes.append(helper.make_node("AttentionNanGuard", guard_inputs, ["y"], domain="onnxfuse", num_heads=4,
                                  kv_num_heads=2))
    graph = helper.make_graph(nodes, "guard", inputs, [helper.make_tensor_value_info("y", f, None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onnxfuse", 1)])
    got = run_with_library(m, feeds)[0]
    args = [out, values] + ([out @ w, w, residual] if projected else [])
    want = OP.reference(args, {"num_heads": 4, "kv_num_heads": 2}, 1)[0]
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got).any() and np.isfinite(got[1, 2]).all()
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-5)
