"""fuse-attention on the NaN-to-zero guard transformers' eager attention writes after Softmax
(both torch.onnx exporters, BERT and GPT-2 with a -inf padding or causal mask):
Where(IsNaN(p), 0, p) before the MatMul with v. A query row whose keys are all masked gets
probabilities 0 (output 0) instead of Softmax's NaN; the fused node does the same with its
attribute nan_to_zero. Results are checked with the library and without it (the fallback
function) against the original model, all-masked rows included, bit for bit where they are 0."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from attention_models import attention_model
from onnxfuse import runtime
from test_pass_attention import PASS, attrs, check_runs_like_original, feeds_for, fused
from test_pass_attention_encdec import _insert_after, _reroute
from test_pass_matmul_batch import optimize


def guarded(zero=0.0, branches="guard", extra_reader=None, split_scale=True, **options):
    """attention_model as BERT's TorchScript export writes it: the scale split over q and kT,
    (q * c) @ (kT * c), a padding mask [B, 1, 1, S] added to the scores, then
    Where(IsNaN(p), zero, p) between Softmax and the MatMul with v.
    branches "swapped": Where(IsNaN(p), p, zero) (not the guard). extra_reader "isnan" / "probs":
    that tensor is also a graph output (read outside the chain)."""
    options.setdefault("mask", ("B", 1, 1, "S"))
    m = attention_model(scale="mul_q" if split_scale else "div", scale_value=0.5 if split_scale else 4.0, **options)
    if split_scale:
        m.graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "k_scale"))
        kt_producer = next(n.name for n in m.graph.node if "kt" in n.output)
        _insert_after(m, kt_producer, helper.make_node("Mul", ["kt", "k_scale"], ["kts"], name="k_scale"))
        _reroute(m, "kt", "kts", skip="k_scale")
    m.graph.initializer.append(numpy_helper.from_array(np.array([zero], np.float32), "nan_fill"))
    where_inputs = ["is_nan", "nan_fill", "probs"] if branches == "guard" else ["is_nan", "probs", "nan_fill"]
    _insert_after(m, "softmax", helper.make_node("Where", where_inputs, ["weights"], name="nan_to_zero"))
    _insert_after(m, "softmax", helper.make_node("IsNaN", ["probs"], ["is_nan"], name="is_nan"))
    _reroute(m, "probs", "weights", skip="nan_to_zero")
    for n in m.graph.node:  # the IsNaN reads p itself
        if n.name == "is_nan":
            n.input[:] = ["probs"]
    if extra_reader is not None:
        name = {"isnan": "is_nan", "probs": "probs"}[extra_reader]
        elem = onnx.TensorProto.BOOL if extra_reader == "isnan" else onnx.TensorProto.FLOAT
        m.graph.output.append(helper.make_tensor_value_info(name, elem, [None] * 4))
    onnx.checker.check_model(m)
    return m


def padded_feeds(m, b, s, seed=0, masked_batch=0, v_special=None):
    """Random inputs with a 0 / -inf padding mask; every key of batch `masked_batch` is masked
    (its rows' probabilities are NaN before the guard). v_special: a value put into x's first
    row of that batch (an infinite or NaN value reaches its v and so, times 0, its output)."""
    feeds = feeds_for(m, b, s, seed=seed)
    rng = np.random.default_rng(seed + 7)
    shape = feeds["mask"].shape
    mask = np.where(rng.random(shape) < 0.3, -np.inf, 0.0).astype(np.float32)
    mask[..., 0] = 0.0  # the other batches keep a key
    mask[masked_batch] = -np.inf
    feeds["mask"] = mask
    if v_special is not None:
        feeds["x"][masked_batch, 0, :] = v_special
    return feeds


def outputs(model, feeds, with_library=True):
    return runtime.make_session(model, threads=1, with_library=with_library).run(None, feeds)[0]


@pytest.mark.parametrize("qkv_bias", [None, "last"], ids=["no-bias", "projection-bias"])
def test_nan_to_zero_guard_fuses_and_all_masked_rows_come_out_zero_like_the_original(qkv_bias):
    m = guarded(qkv_bias=qkv_bias)
    opt, n = optimize(m, PASS)
    assert n == 1
    [node] = fused(opt)
    want = {"num_heads": 2, "scale": pytest.approx(0.25), "has_mask": 1, "qkv_packed": 1, "nan_to_zero": 1}
    if qkv_bias is not None:
        want["has_bias"] = 1
    assert attrs(node) == want
    assert not any(x.op_type in ("IsNaN", "Where", "Softmax") for x in opt.graph.node)
    feed_list = [padded_feeds(m, b, s, seed=b) for b, s in ((1, 1), (2, 6), (3, 13))]
    check_runs_like_original(m, opt, feed_list)
    for with_library in (True, False):
        got = outputs(opt, feed_list[1], with_library)
        # all keys of batch 0 masked: 0 * v summed, +0 as in the original (not -0, not the v bias)
        assert np.all(got[0] == 0.0) and not np.any(np.signbit(got[0]))
        assert np.array_equal(np.signbit(got), np.signbit(outputs(m, feed_list[1])))


@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
def test_all_masked_row_over_a_non_finite_value_is_nan_like_the_original(special):
    m = guarded()
    opt, n = optimize(m, PASS)
    assert n == 1
    feeds = padded_feeds(m, 2, 6, v_special=special)
    want = outputs(m, feeds)
    assert np.isnan(want[0]).any()  # 0 * inf in the original's MatMul
    for with_library in (True, False):
        got = outputs(opt, feeds, with_library)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.signbit(got[0]), np.signbit(want[0]))


def test_guard_after_a_plain_scale_fuses_too():
    m = guarded(split_scale=False)
    opt, n = optimize(m, PASS)
    assert n == 1 and attrs(fused(opt)[0])["nan_to_zero"] == 1
    check_runs_like_original(m, opt, [padded_feeds(m, b, s) for b, s in ((1, 3), (2, 9))])


@pytest.mark.parametrize(
    "options",
    [
        dict(zero=0.5),  # not a zero fill
        dict(zero=-0.0),  # only the +0 fill the exporters write is matched
        dict(branches="swapped"),  # keeps the NaN, zeroes the rest
        dict(extra_reader="isnan"),  # the IsNaN read outside the chain
        dict(extra_reader="probs"),  # the probabilities read outside the chain
    ],
    ids=["nonzero-fill", "negative-zero-fill", "swapped-branches", "isnan-read-elsewhere", "probs-read-elsewhere"],
)
def test_guards_that_are_not_nan_to_zero_or_are_read_elsewhere_are_left_alone(options):
    opt, n = optimize(guarded(**options), PASS)
    assert n == 0 and not fused(opt)


def test_cuda_target_fuses_a_guarded_chain_with_the_guard():
    # The generated CUDA kernel implements nan_to_zero (tests/test_cuda_attention.py): the chain
    # fuses on cuda as on the CPU; without attention_cuda nothing does there.
    m = guarded()
    opt, n = optimize(m, PASS, target="cuda")
    assert n == 0 and not fused(opt)
    opt, n = optimize(m, PASS, target="cuda", attention_cuda=True)
    assert n == 1 and attrs(fused(opt)[0])["nan_to_zero"] == 1
    check_runs_like_original(m, opt, [padded_feeds(m, 2, 6)])


def expanded_padding_mask(batch_from="x"):
    """guarded() with the mask built as transformers' helpers have the TorchScript exporter write
    it (GPT-2, BERT): Where(Expand(pad, target), 0, -inf) from a bool padding input pad
    [B, 1, 1, S], the expand target Where(is_minus_one, 1, [batch, -1, S, S]) with its Equal
    folded to a constant, batch read from `batch_from`'s first dim ("x": the batch; "other":
    another input's, which need not be it). The merge target is the constant [0, 0, D], so the
    mask's dims must be proved."""
    m = guarded(mask=("B", 1, "S", "S"), merge="const")
    g = m.graph
    inputs = [i for i in g.input if i.name != "mask"]  # computed below instead
    g.ClearField("input")
    g.input.extend(inputs)
    g.input.append(helper.make_tensor_value_info("pad", onnx.TensorProto.BOOL, ["B", 1, 1, "S"]))
    if batch_from == "other":
        g.input.append(helper.make_tensor_value_info("other", onnx.TensorProto.FLOAT, ["M", 1]))
    inits = {
        "i0": np.array([0], np.int64), "i1": np.array([1], np.int64), "i2": np.array([2], np.int64),
        "minus_one": np.array([-1], np.int64), "ones4": np.array([1, 1, 1, 1], np.int64),
        "is_minus_one": np.array([False, True, False, False]), "mask_zero": np.array([0.0], np.float32),
        "mask_fill": np.array([-np.inf], np.float32),
    }
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in inits.items())
    nodes = [
        helper.make_node("Shape", [batch_from], ["batch_shape"], name="batch_shape"),
        helper.make_node("Slice", ["batch_shape", "i0", "i1"], ["batch_dim"], name="batch_dim"),
        helper.make_node("Shape", ["x"], ["x_shape"], name="x_shape"),
        helper.make_node("Slice", ["x_shape", "i1", "i2"], ["seq_dim"], name="seq_dim"),
        helper.make_node("Concat", ["batch_dim", "minus_one", "seq_dim", "seq_dim"], ["expand_dims"], axis=0,
                         name="expand_dims"),
        helper.make_node("Where", ["is_minus_one", "ones4", "expand_dims"], ["expand_target"], name="expand_target"),
        helper.make_node("Expand", ["pad", "expand_target"], ["keep"], name="expand_mask"),
        helper.make_node("Where", ["keep", "mask_zero", "mask_fill"], ["mask"], name="additive_mask"),
    ]
    for n in reversed(nodes):
        g.node.insert(0, n)
    onnx.checker.check_model(m)
    return m


def _one_guarded_node_with_a_mask(m):
    """The model optimized by the pass, which made exactly one guarded node reading a mask."""
    opt, n = optimize(m, PASS)
    assert n == 1
    [node] = fused(opt)
    assert attrs(node)["nan_to_zero"] == 1 and attrs(node)["has_mask"] == 1
    return opt


def _feeds_with_batch_0_all_padded(m, mask_input, random_mask, seed):
    """Feeds at (batch, seq) (1, 1), (2, 6), (3, 13), the mask input drawn by random_mask(rng,
    b, s) with every key of batch 0 padded (zero)."""
    rng = np.random.default_rng(seed)
    feed_list = []
    for b, s in ((1, 1), (2, 6), (3, 13)):
        feeds = {k: v for k, v in feeds_for(m, b, s).items() if k != mask_input}
        mask = random_mask(rng, b, s)
        mask[0] = 0
        feeds[mask_input] = mask
        feed_list.append(feeds)
    return feed_list


def test_guarded_attention_reads_a_mask_expanded_to_a_folded_target():
    m = expanded_padding_mask()
    opt = _one_guarded_node_with_a_mask(m)
    feed_list = _feeds_with_batch_0_all_padded(m, "pad", lambda rng, b, s: rng.random((b, 1, 1, s)) < 0.7, seed=3)
    check_runs_like_original(m, opt, feed_list)


def test_mask_expanded_to_a_batch_read_elsewhere_is_left_alone():
    opt, n = optimize(expanded_padding_mask(batch_from="other"), PASS)
    assert n == 0 and not fused(opt)



def padding_mask_from_token_mask():
    """expanded_padding_mask() as GPT-2's TorchScript export with inputs input_ids and
    attention_mask builds it: the batch is the first dim of a flattened view of x,
    Reshape(x, [-1, S, D]); the int64 token mask am [B, S] is reshaped to [that batch, -1], made
    bool and unsqueezed to [B, 1, 1, S], and the expand target's key length is that tensor's last
    dim. Onnx's inference gives the flattened batch and each -1 a name of its own, so the mask is
    [B, 1, S, S] only by the Reshapes' element counts."""
    m = expanded_padding_mask()
    g = m.graph
    kept = [i for i in g.input if i.name != "pad"]
    g.ClearField("input")
    g.input.extend(kept)
    g.input.append(helper.make_tensor_value_info("am", onnx.TensorProto.INT64, ["B", "S"]))
    g.initializer.extend([numpy_helper.from_array(np.array([3], np.int64), "i3"),
                          numpy_helper.from_array(np.array([4], np.int64), "i4"),
                          numpy_helper.from_array(np.array([1, 2], np.int64), "axes12")])
    nodes = [
        helper.make_node("Shape", ["x"], ["x_dims"], name="x_dims"),
        helper.make_node("Slice", ["x_dims", "i1", "i3"], ["x_row"], name="x_row"),
        helper.make_node("Concat", ["minus_one", "x_row"], ["flat_target"], axis=0, name="flat_target"),
        helper.make_node("Reshape", ["x", "flat_target"], ["x_flat"], name="x_flat"),
        helper.make_node("Shape", ["x_flat"], ["flat_shape"], name="flat_shape"),
        helper.make_node("Slice", ["flat_shape", "i0", "i1"], ["flat_batch"], name="flat_batch"),
        helper.make_node("Concat", ["flat_batch", "minus_one"], ["am_target"], axis=0, name="am_target"),
        helper.make_node("Reshape", ["am", "am_target"], ["am_rows"], name="am_rows"),
        helper.make_node("Cast", ["am_rows"], ["am_bool"], to=onnx.TensorProto.BOOL, name="am_bool"),
        helper.make_node("Unsqueeze", ["am_bool", "axes12"], ["pad"], name="pad"),
        helper.make_node("Shape", ["pad"], ["pad_shape"], name="pad_shape"),
        helper.make_node("Slice", ["pad_shape", "i3", "i4"], ["key_dim"], name="key_dim"),
    ]
    for n in g.node:
        if n.name == "expand_dims":
            n.input[:] = ["flat_batch", "minus_one", "seq_dim", "key_dim"]
    for n in reversed(nodes):
        g.node.insert(0, n)
    onnx.checker.check_model(m)
    return m


def test_mask_from_a_token_mask_reshaped_to_a_flattened_batch_is_the_nodes_input():
    # The real-size GPT-2 TorchScript export (input_ids and attention_mask): every Softmax was
    # left because the mask's batch and key length were names of inference's own.
    m = padding_mask_from_token_mask()
    opt = _one_guarded_node_with_a_mask(m)
    feed_list = _feeds_with_batch_0_all_padded(m, "am", lambda rng, b, s: (rng.random((b, s)) < 0.7).astype(np.int64),
                                               seed=5)
    check_runs_like_original(m, opt, feed_list)
    feeds = feed_list[2]
    feeds["x"][0, 0, :] = np.inf  # reaches v of the all-masked batch: 0 * inf is NaN there
    want = outputs(m, feeds)
    for with_library in (True, False):
        got = outputs(opt, feeds, with_library)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.signbit(got[0]), np.signbit(want[0]))
        np.testing.assert_array_equal(got[0][~np.isnan(want[0])], want[0][~np.isnan(want[0])])
