"""decode-mask: a decode step's causal mask that one new token makes all-true, the padding mask
gathered by a flat index grid, and the Expands that then change nothing, on small graphs of the
TorchScript export's form and on the corpus's decode steps; the outputs are compared with the
original's in onnxruntime, with padded and fully masked rows, at several past lengths."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import zoo
from test_pass_matmul_batch import assert_same, optimize, run


def _c(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def mask_step(new_tokens: int = 1, stride_from_mask: bool = True, extra_offset: int = 0) -> onnx.ModelProto:
    """bias[b, 0, s, k] = 0 where kv k <= position P + s (k < P + new_tokens + extra_offset) and
    mask[b, k] != 0, else float32's lowest: transformers' decode-step mask as the TorchScript exporter writes
    it (positions from the past's length, the padding read by a flat index b * T + k)."""
    n = helper.make_node
    nodes = [
        n("Shape", ["past"], ["past_shape"]), n("Gather", ["past_shape", "two"], ["P"], axis=0),
        n("Add", ["P", "new_plus"], ["L"]), n("Range", ["zero", "L", "one"], ["kv"]),
        n("Unsqueeze", ["kv", "axes012"], ["kv4"]),
        n("Add", ["P", "steps"], ["pos"]), n("Unsqueeze", ["pos", "axes013"], ["pos4"]),
        n("LessOrEqual", ["kv4", "pos4"], ["causal"]),
        n("Cast", ["mask"], ["D"], to=TensorProto.BOOL), n("Flatten", ["D"], ["F"], axis=2),
        n("Shape", ["mask"], ["mask_shape"]), n("Gather", ["mask_shape", "zero"], ["B"], axis=0),
        n("Shape", ["D"], ["d_shape"]), n("Gather", ["d_shape", "one_1d"], ["T"], axis=0),
        n("Range", ["zero", "B", "one"], ["bi"]), n("Unsqueeze", ["bi", "axes123"], ["bi4"]),
        n("Mul", ["bi4", "T" if stride_from_mask else "five"], ["row_start"]),
        n("Add", ["kv4", "row_start"], ["idx"]),
        n("Gather", ["F", "idx"], ["g"], axis=0), n("Reshape", ["g", "minus_one"], ["g1"]),
        n("Shape", ["idx"], ["idx_shape"]), n("Reshape", ["g1", "idx_shape"], ["pad"]),
        n("And", ["true", "causal"], ["causal_t"]), n("And", ["causal_t", "pad"], ["keep"]),
        n("Shape", ["keep"], ["keep_shape"]), n("Expand", ["keep", "keep_shape"], ["keep_e"]),
        n("Where", ["keep_e", "zero_f", "minus_inf"], ["bias"]),
    ]
    inits = [_c("two", np.int64(2)), _c("zero", np.int64(0)), _c("one", np.int64(1)),
             _c("new_plus", np.int64(new_tokens + extra_offset)), _c("steps", np.arange(new_tokens, dtype=np.int64)),
             _c("axes012", np.array([0, 1, 2], np.int64)), _c("axes013", np.array([0, 1, 3], np.int64)),
             _c("axes123", np.array([1, 2, 3], np.int64)), _c("one_1d", np.array([1], np.int64)),
             _c("five", np.int64(5)), _c("minus_one", np.array([-1], np.int64)), _c("true", np.array(True)),
             _c("zero_f", np.float32(0)), _c("minus_inf", np.finfo(np.float32).min)]
    graph = helper.make_graph(
        nodes, "mask_step",
        [helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "total"]),
         helper.make_tensor_value_info("past", TensorProto.FLOAT, ["batch", 2, "past", 4])],
        [helper.make_tensor_value_info("bias", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def step_feeds(seed: int, batch: int, past: int, extra: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    mask = (rng.random((batch, past + 1 + extra)) < 0.7).astype(np.int64)
    mask[-1, :] = 0  # a row with every key masked
    return {"mask": mask, "past": rng.standard_normal((batch, 2, past, 4)).astype(np.float32)}


# past 0, 1, 8, 17, 40; a mask longer than P + 1 (the original reads its first P + 1 columns)
STEP_FEEDS = [step_feeds(0, 2, 0), step_feeds(1, 3, 1), step_feeds(2, 2, 8), step_feeds(3, 1, 17),
              step_feeds(4, 2, 40), step_feeds(5, 2, 5, extra=3)]


def ops(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]


def test_one_new_token_mask_is_a_slice_of_the_padding_mask():
    m = mask_step()
    out, matches = optimize(m, ["decode-mask"])
    assert matches == 3  # the causal And, the flat gather, the Expand to its own shape
    assert not {"LessOrEqual", "And", "Flatten", "Range", "Mul", "Expand"} & set(ops(out)), ops(out)
    assert ops(out).count("Gather") == 1 and "Slice" in ops(out)  # the past length's read stays
    assert_same(m, out, STEP_FEEDS)


def test_two_new_tokens_keep_their_causal_mask():
    # kv up to P + 1 against positions P, P + 1: not all true, the comparison stays
    m = mask_step(new_tokens=2)
    out, _ = optimize(m, ["decode-mask"])
    assert "LessOrEqual" in ops(out) and "And" in ops(out)
    assert_same(m, out, [step_feeds(0, 2, 0, extra=1), step_feeds(1, 3, 8, extra=1), step_feeds(2, 1, 17, extra=3)])


def test_keys_past_the_position_keep_their_causal_mask():
    # kv up to P + 1 against position P (one key ahead of the query): the mask has a false column
    m = mask_step(extra_offset=1)
    out, _ = optimize(m, ["decode-mask"])
    assert "LessOrEqual" in ops(out)
    assert_same(m, out, [step_feeds(0, 2, 8, extra=1), step_feeds(1, 1, 3, extra=2)])


def test_a_flat_index_with_another_stride_stays_a_gather():
    # b * 5 + k reads across rows unless T = 5: not the 2-D indexing the Slice is
    m = mask_step(stride_from_mask=False)
    out, _ = optimize(m, ["decode-mask"])
    assert "Gather" in ops(out) and "Slice" not in ops(out)
    feeds = [step_feeds(0, 2, 4), step_feeds(1, 3, 2, extra=2)]
    assert_same(m, out, feeds)


def test_the_original_fails_when_the_mask_is_shorter_than_the_keys():
    # T < P + 1: the original's flat index passes the mask's end on its last row (Gather's
    # bounds check): the premise on which the Slice, which reads what there is, is exact
    m = mask_step()
    feeds = step_feeds(0, 2, 6)
    feeds["mask"] = feeds["mask"][:, :4]
    with pytest.raises(Exception):
        run(m, feeds)


def mask_read_through_ids() -> onnx.ModelProto:
    """mask_step's padding half as the TorchScript export of GPT-2 (inputs input_ids and
    attention_mask) leaves it once shape-plumbing has read each dim where it is first known: the
    mask is Reshape(attention_mask, [B, -1]) with B read from the ids, and the batch's Range and
    the row stride are dims of the ids, not Gathers of the mask's own Shape. Only the dim facts
    (B and -1 of the Reshape, over the symbols) say they are the mask's rows and columns."""
    n = helper.make_node
    nodes = [
        n("Shape", ["ids"], ["ids_shape"]), n("Gather", ["ids_shape", "zero"], ["B"], axis=0),
        n("Gather", ["ids_shape", "one"], ["S"], axis=0),
        n("Unsqueeze", ["B", "axes0"], ["B1"]), n("Concat", ["B1", "minus_one"], ["target"], axis=0),
        n("Reshape", ["mask", "target"], ["M"]), n("Cast", ["M"], ["D"], to=TensorProto.BOOL),
        n("Reshape", ["D", "minus_one_one"], ["F"]),
        n("Range", ["zero", "S", "one"], ["kv"]), n("Unsqueeze", ["kv", "axes012"], ["kv4"]),
        n("Range", ["zero", "B", "one"], ["bi"]), n("Unsqueeze", ["bi", "axes123"], ["bi4"]),
        n("Unsqueeze", ["S", "axes0"], ["T"]),  # the stride: the ids' length, as a 1-element vector
        n("Mul", ["bi4", "T"], ["row_start"]), n("Add", ["kv4", "row_start"], ["idx"]),
        n("Gather", ["F", "idx"], ["g"], axis=0), n("Reshape", ["g", "minus_one"], ["g1"]),
        n("Shape", ["idx"], ["idx_shape"]), n("Reshape", ["g1", "idx_shape"], ["pad"]),
        n("Where", ["pad", "zero_f", "minus_inf"], ["bias"]),
    ]
    inits = [_c("zero", np.int64(0)), _c("one", np.int64(1)), _c("axes0", np.array([0], np.int64)),
             _c("axes012", np.array([0, 1, 2], np.int64)), _c("axes123", np.array([1, 2, 3], np.int64)),
             _c("minus_one", np.array([-1], np.int64)), _c("minus_one_one", np.array([-1, 1], np.int64)),
             _c("zero_f", np.float32(0)), _c("minus_inf", np.finfo(np.float32).min)]
    graph = helper.make_graph(
        nodes, "mask_read_through_ids",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("bias", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_mask_rows_and_stride_read_from_another_tensor_of_the_same_dims_are_a_slice():
    # The zoo's gpt2_ts went from 47 to 51 kernels when the dim facts proved the mask's Reshape
    # [batch, seq]: shape-plumbing then read the stride and the batch from the ids, and the pass,
    # which compared where a dim was read rather than what it is, left the flat gather.
    m = mask_read_through_ids()
    out, matches = optimize(m, ["decode-mask"])
    assert matches == 1
    assert not {"Range", "Mul"} & set(ops(out)) and "Slice" in ops(out), ops(out)
    assert ops(out).count("Gather") == 2, ops(out)  # the batch and length reads stay
    rng = np.random.default_rng(7)
    feeds = []
    for b, s in ((1, 1), (2, 5), (3, 9)):
        mask = (rng.random((b, s)) < 0.7).astype(np.int64)
        mask[-1] = 0
        feeds.append({"ids": rng.integers(0, 100, (b, s)).astype(np.int64), "mask": mask})
    assert_same(m, out, feeds)


def test_gpt2_ts_padding_mask_is_a_slice_in_the_default_pipeline():
    from onnxfuse.api import optimize as optimize_model

    out = optimize_model(zoo.get("gpt2_ts").load(), verify_outputs=False, count_kernels=False).model
    assert ops(out).count("Range") == 1, ops(out)  # the positions' Range; the batch's is gone
    assert "Flatten" not in ops(out) and "Slice" in ops(out), ops(out)


DECODE_TS = ["llama_decode_ts", "gpt2_decode_ts"]


def decode_feeds(seed: int, batch: int, past: int, kv_heads: int) -> dict:
    rng = np.random.default_rng(seed)
    mask = (rng.random((batch, past + 1)) < 0.7).astype(np.int64)
    mask[0, :] = 1
    mask[-1, :3] = 0  # left padding
    feeds = {"input_ids": rng.integers(0, 1000, (batch, 1)).astype(np.int64), "attention_mask": mask}
    for i in range(2):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{i}"] = rng.standard_normal((batch, kv_heads, past, 16)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("name", DECODE_TS)
def test_decode_step_mask_helpers_fold_in_the_default_pipeline(name):
    from onnxfuse.api import optimize as optimize_model
    from onnxfuse.pipeline import select_passes
    from onnxfuse.profile import count_kernels

    m = zoo.get(name).load()
    dims = {"batch": 2, "past": 8, "total": 9}
    out = optimize_model(m, dims=dims, threads=1, count_kernels=False).model
    others = [p.name for p in select_passes(None, "cpu") if p.name != "decode-mask"]
    without = optimize_model(m, passes=others, dims=dims, threads=1, count_kernels=False).model
    assert not {"LessOrEqual", "Flatten"} & set(ops(out))
    # fewer kernels than the same pipeline without the pass, far fewer than onnxruntime alone
    k_out, k_without, k_ort = (count_kernels(x, threads=1, dims=dims)[0] for x in (out, without, m))
    assert k_out <= k_without - 10 and k_out < k_ort / 4, (k_out, k_without, k_ort)
    kv_heads = 4 if name.startswith("gpt2") else 2
    assert_same(m, out, [decode_feeds(s, b, p, kv_heads) for s, (b, p) in
                         enumerate([(2, 8), (1, 17), (3, 1), (2, 40), (2, 0)])])


def _named(m: onnx.ModelProto) -> onnx.ModelProto:
    for node in m.graph.node:
        node.name = f"{node.output[0]}_node"
    return m


def _explained(m: onnx.ModelProto) -> dict:
    from onnxfuse.api import optimize as optimize_model
    from onnxfuse.optimize_options import OptimizeOptions

    settings = OptimizeOptions(passes=("decode-mask",), dims={"batch": 2, "past": 3, "total": 5},
                               count_kernels=False, explain=("decode-mask",))
    result = optimize_model(m, settings=settings)
    return {node: why[0] for node, why in result.summary["unmatched"].get("decode-mask", {}).items()}


def test_explain_says_why_a_causal_mask_of_two_new_tokens_is_kept():
    why = _explained(_named(mask_step(new_tokens=2)))
    assert "no affine bounds prove every 'kv4' <= every 'pos4'" in why["causal_t_node"], why
    assert "neither input is proved true everywhere" in why["keep_node"], why


def test_explain_says_why_a_flat_index_of_another_stride_stays_a_gather():
    why = _explained(_named(mask_step(stride_from_mask=False)))
    assert "the row stride 'five' is not provably dim 1 of the mask 'D'" in why["pad_node"], why
    # only the padding form's Reshapes are its candidates
    assert not {"g1_node", "idx_shape_node"} & set(why), why


def test_explain_says_which_operand_of_the_flat_index_is_no_mul():
    m = _named(mask_step())
    for node in m.graph.node:
        if node.op_type == "Mul" and node.output[0] == "row_start":
            node.op_type = "Sub"
    why = _explained(m)
    assert "Sub 'row_start_node'" in why["pad_node"] and "Mul" in why["pad_node"], why
