"""onnxfuse.Attention's CPU kernel against numpy (float64) and against its fallback function, in
the AVX2 and the baseline build, at one and two threads: packed (with and without the projection's
bias) and separate q/k/v, Sq != Sk, dh != dv, masks of every broadcast shape, rows masked out
entirely, empty tensors."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from attention_cases import CASES, CAUSAL_CASES, case_id, fused_model
from attention_models import attention_model, packed_inputs, reference, rotary_attention_model
from onnxfuse import runtime
from test_pass_attention import PASS, feeds_for, fused
from test_pass_matmul_batch import optimize


def optimized(**options):
    m = attention_model(**options)
    opt, n = optimize(m, PASS)
    assert n == 1 and len(fused(opt)) == 1
    return opt


def run_three_ways(opt, feeds):
    """(kernel at 1 thread, kernel at 2 threads, fallback function)."""
    return [
        runtime.make_session(opt, threads=1, with_library=True).run(None, feeds)[0],
        runtime.make_session(opt, threads=2, with_library=True).run(None, feeds)[0],
        runtime.make_session(opt, threads=1, with_library=False).run(None, feeds)[0],
    ]


def assert_close(got, want):
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(want).max())))


def assert_kernel_and_fallback_close(model, feeds, want):
    """The library's kernel and the fallback function (library not loaded), at one and two
    threads, against want."""
    for with_library in (True, False):
        for threads in (1, 2):
            assert_close(runtime.make_session(model, threads=threads, with_library=with_library).run(None, feeds)[0], want)


@pytest.fixture(params=["avx2", "baseline"])
def build(request, monkeypatch):
    if request.param == "baseline":
        monkeypatch.setenv("ONNXFUSE_NO_AVX2", "1")
    return request.param


@pytest.mark.parametrize("heads,dh", [(1, 1), (2, 8), (4, 32), (3, 21), (2, 64)])
@pytest.mark.parametrize("b,s", [(1, 1), (2, 5), (1, 33), (3, 70)])
def test_packed_kernel_matches_numpy_and_the_fallback(heads, dh, b, s, build):
    opt = optimized(heads=heads, dh=dh, scale_value=float(np.sqrt(dh)))
    feeds = feeds_for(opt, b, s, seed=heads * 1000 + s)
    q, k, v = packed_inputs(opt, feeds["x"])
    want = reference(q, k, v, feeds["mask"], heads, 1 / np.sqrt(dh))
    for got in run_three_ways(opt, feeds):
        assert_close(got, want)


@pytest.mark.parametrize("heads,dh", [(1, 1), (4, 32), (3, 21), (2, 64)])
@pytest.mark.parametrize("b,s", [(1, 1), (2, 5), (1, 33), (3, 70)])
def test_packed_kernel_with_the_projection_bias_matches_numpy_and_the_fallback(heads, dh, b, s, build):
    """The folded bias added to q rows, the key panel (8 x 8 blocks and the edges) and v."""
    opt = optimized(heads=heads, dh=dh, scale_value=float(np.sqrt(dh)), qkv_bias="last")
    assert len(fused(opt)[0].input) == 3  # qkv, mask, bias
    feeds = feeds_for(opt, b, s, seed=heads * 1000 + s + 1)
    q, k, v = packed_inputs(opt, feeds["x"])
    want = reference(q, k, v, feeds["mask"], heads, 1 / np.sqrt(dh))
    for got in run_three_ways(opt, feeds):
        assert_close(got, want)


def test_bias_of_the_wrong_size_is_an_error_naming_it():
    opt = optimized(heads=2, dh=8, qkv_bias="last")
    bias = next(t for t in opt.graph.initializer if t.name == fused(opt)[0].input[2])
    bias.dims[:] = [47]
    del bias.float_data[:]
    bias.raw_data = np.zeros(47, np.float32).tobytes()
    with pytest.raises(Exception, match="bias of shape"):
        runtime.make_session(opt, threads=1, with_library=True).run(None, feeds_for(opt, 1, 3))


@pytest.mark.parametrize("mask", [None, (1, 1, "Sq", "Sk"), ("B", 1, 1, "Sk"), ("B", 3, "Sq", "Sk"), (1, 3, 1, 1),
                                  ("Sq", 1), ("Sk",), ("B", 1, "Sq", 1)])
@pytest.mark.parametrize("sq,sk", [(1, 9), (9, 1), (6, 19), (40, 17)])
def test_separate_qkv_with_other_lengths_widths_and_mask_shapes(mask, sq, sk, build):
    opt = optimized(packed=False, heads=3, dh=6, dv=11, merge="const", mask=mask, scale="mul", scale_value=0.3)
    feeds = feeds_for(opt, 2, sq, sk, seed=sq * 100 + sk)
    want = reference(feeds["q"], feeds["k"], feeds["v"], feeds.get("mask"), 3, 0.3)
    for got in run_three_ways(opt, feeds):
        assert_close(got, want)


def test_value_width_over_16_uses_every_column_path(build):
    opt = optimized(packed=False, heads=2, dh=4, dv=27, merge="const", mask=None)  # 16 + 8 + 3 columns
    feeds = feeds_for(opt, 2, 7, 12)
    want = reference(feeds["q"], feeds["k"], feeds["v"], None, 2, 0.25)
    for got in run_three_ways(opt, feeds):
        assert_close(got, want)


def test_rows_masked_out_entirely_are_nan_like_onnxruntime(build):
    opt = optimized(packed=False, heads=2, dh=4, merge="const", mask=("B", 1, "Sq", "Sk"))
    feeds = feeds_for(opt, 2, 5, 6)
    feeds["mask"][1, 0, 3, :] = -np.inf  # batch 1, query 3: every key masked
    feeds["mask"][0, 0, 1, 2:] = -np.inf  # partly masked: finite
    kernel, kernel2, fallback = run_three_ways(opt, feeds)
    nan_rows = np.isnan(fallback).any(axis=-1)
    assert nan_rows[1, 3] and nan_rows.sum() == 1 and np.isnan(fallback[1, 3]).all()
    for got in (kernel, kernel2):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(fallback))
        assert_close(np.nan_to_num(got), np.nan_to_num(fallback))


@pytest.mark.parametrize("b,sq,sk", [(0, 4, 4), (2, 0, 4), (2, 3, 0)])
def test_empty_tensors_give_what_the_fallback_gives(b, sq, sk):
    opt = optimized(packed=False, heads=2, dh=4, merge="const", mask=(1, 1, "Sq", "Sk"))
    feeds = feeds_for(opt, b, sq, sk)
    kernel, kernel2, fallback = run_three_ways(opt, feeds)
    assert kernel.shape == fallback.shape == (b, sq, 8)
    np.testing.assert_array_equal(kernel, fallback)
    np.testing.assert_array_equal(kernel2, fallback)


def test_mask_that_does_not_broadcast_is_an_error_like_in_the_original():
    opt = optimized(packed=False, heads=2, dh=4, merge="const", mask=(1, 1, "Sq", "Sk"))
    feeds = feeds_for(opt, 2, 3, 4)
    feeds["mask"] = np.zeros((1, 1, 3, 5), np.float32)
    with pytest.raises(Exception, match="broadcast"):
        runtime.make_session(opt, threads=1, with_library=True).run(None, feeds)
    with pytest.raises(Exception):
        runtime.make_session(opt, threads=1, with_library=False).run(None, feeds)


@pytest.mark.parametrize("masked", [-1e9, -np.inf])
def test_causal_mask_rows_skip_no_weight_and_keep_nan(masked, build):
    """Blocks of keys whose exps are exactly 0 (a causal mask's future) are written as 0 without
    evaluating exp; the result equals the full computation, and a NaN among them still makes
    its row NaN."""
    s = 45
    causal = np.triu(np.full((s, s), masked, np.float32), 1)[None, None]
    opt = optimized(heads=2, dh=16, scale_value=4.0, mask=None, mask_const=causal)
    x = np.random.default_rng(3).standard_normal((2, s, 32)).astype(np.float32)
    q, k, v = packed_inputs(opt, x)
    kernel, kernel2, fallback = run_three_ways(opt, {"x": x})
    want = reference(q, k, v, causal.astype(np.float64), 2, 0.25)
    for got in (kernel, kernel2, fallback):
        assert_close(got, want)
    nan_mask = causal.copy()
    nan_mask[0, 0, 2, 30] = np.nan  # query 2: key 30 lies in a block that is otherwise all masked
    opt_nan = optimized(heads=2, dh=16, scale_value=4.0, mask=None, mask_const=nan_mask)
    kernel, kernel2, fallback = run_three_ways(opt_nan, {"x": x})
    rows = np.isnan(fallback).any(axis=-1)
    assert rows[:, 2].all() and rows.sum() == 2
    np.testing.assert_array_equal(np.isnan(kernel), np.isnan(fallback))
    np.testing.assert_array_equal(np.isnan(kernel2), np.isnan(fallback))


def test_infinite_value_under_a_causal_mask_makes_the_earlier_rows_nan_like_matmul(build):
    """The kernel leaves keys whose probabilities are exactly 0 out of the weighted sum only while
    every v row is finite: a masked-out infinite v still gives 0 * inf = NaN in the rows before
    it, as the original MatMul does, and a finite v gives the full computation's result."""
    s = 40
    opt = optimized(packed=False, heads=2, dh=8, merge="const", mask=("B", 1, "Sq", "Sk"))
    feeds = feeds_for(opt, 2, s, s, seed=5)
    feeds["mask"][...] = np.triu(np.full((s, s), -1e9, np.float32), 1)
    want = reference(feeds["q"], feeds["k"], feeds["v"], feeds["mask"].astype(np.float64), 2, 0.25)
    for got in run_three_ways(opt, feeds):
        assert_close(got, want)
    feeds["v"][0, 35, 3] = np.inf  # batch 0, key 35, head 0's column 3
    kernel, kernel2, fallback = run_three_ways(opt, feeds)
    nan = np.isnan(fallback)
    assert nan[0, :35, 3].all() and nan.sum() == 35
    for got in (kernel, kernel2):
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(np.isinf(got), np.isinf(fallback))
        finite = np.isfinite(fallback)
        assert_close(np.where(finite, got, 0), np.where(finite, fallback, 0))


@pytest.mark.parametrize("case", [c for c in CASES if c.bias], ids=case_id)
def test_node_with_a_bias_input_agrees_with_its_fallback_and_numpy(case, build):
    """A hand-built node whose bias is a graph input (not a constant): the library's kernel and the
    fallback function (library not loaded) against float64 numpy."""
    model = fused_model(case)
    feeds = case.feeds(seed=9)
    assert_kernel_and_fallback_close(model, feeds, case.reference(feeds))


def test_infinite_key_bias_makes_its_head_nan_like_the_fallback(build):
    """q . (k_t + bias_k) shifts a row's scores by q . bias_k, which softmax cancels; an infinite
    key bias element shows that the panel carries the bias of its own head: that head's rows are
    NaN in the fallback and must be in the kernel."""
    case = next(c for c in CASES if c.bias and c.has_mask)
    feeds = case.feeds(seed=10)
    feeds["bias"][case.heads * case.dh + 2 * case.dh + 5] = np.inf  # head 2's keys, column 5
    model = fused_model(case)
    fallback = runtime.make_session(model, threads=1, with_library=False).run(None, feeds)[0]
    head = np.isnan(fallback[..., 2 * case.dh:3 * case.dh])
    assert head.all() and np.isnan(fallback).sum() == head.size
    for threads in (1, 2):
        got = runtime.make_session(model, threads=threads, with_library=True).run(None, feeds)[0]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(fallback))
        assert_close(np.nan_to_num(got), np.nan_to_num(fallback))


def causal_reference(q, k, v, heads, scale):
    sq, sk = q.shape[1], k.shape[1]
    mask = np.triu(np.full((sq, sk), -np.inf), 1)  # top-left: key t is masked for query i < t
    return reference(q, k, v, mask, heads, scale)


@pytest.mark.parametrize("heads,dh", [(1, 1), (4, 32), (3, 21), (2, 64)])
@pytest.mark.parametrize("b,s", [(1, 1), (2, 5), (1, 33), (3, 70)])
@pytest.mark.parametrize("bias", [None, "last"], ids=["no-bias", "bias"])
def test_causal_kernel_matches_numpy_and_the_fallback(heads, dh, b, s, bias, build):
    """causal = 1: the kernel masks key t > query i itself (no mask input), skipping those keys."""
    opt = optimized(heads=heads, dh=dh, scale_value=float(np.sqrt(dh)), mask=None, causal=dict(size=70), qkv_bias=bias)
    assert fused(opt)[0].attribute and len(fused(opt)[0].input) == (2 if bias else 1)
    feeds = feeds_for(opt, b, s, seed=heads * 1000 + s + 2)
    q, k, v = packed_inputs(opt, feeds["x"])
    want = causal_reference(q, k, v, heads, 1 / np.sqrt(dh))
    for got in run_three_ways(opt, feeds):
        assert_close(got, want)


@pytest.mark.parametrize("sq,sk", [(5, 19), (19, 5), (40, 40), (1, 9)])
def test_causal_kernel_with_separate_qkv_is_top_left_aligned(sq, sk, build):
    opt = optimized(packed=False, heads=3, dh=6, dv=11, merge="const", mask=None, causal=dict(size=40), scale="mul",
                    scale_value=0.3)
    feeds = feeds_for(opt, 2, sq, sk, seed=sq * 100 + sk + 7)
    want = causal_reference(feeds["q"], feeds["k"], feeds["v"], 3, 0.3)
    for got in run_three_ways(opt, feeds):
        assert_close(got, want)


@pytest.mark.parametrize("tensor,value", [("k", np.nan), ("k", np.inf), ("k", -np.inf), ("q", np.inf), ("v", np.inf)])
def test_causal_kernel_gives_the_originals_nan_rows_for_non_finite_inputs(tensor, value, build):
    """The original adds -1e9 to a future key's score: a NaN or +inf score stays NaN or +inf and
    makes its row NaN, and 0 * an infinite v is NaN. The kernel skips future keys only while this
    (batch, head)'s keys and values are finite; otherwise it adds -inf to them, which gives the
    same NaN rows."""
    s = 40
    opt = optimized(packed=False, heads=2, dh=8, merge="const", mask=None, causal=dict(size=s))
    feeds = feeds_for(opt, 2, s, s, seed=11)
    row = {"q": 3, "k": 30, "v": 35}[tensor]
    feeds[tensor][0, row, 3] = value  # batch 0, head 0's column 3
    kernel, kernel2, fallback = run_three_ways(opt, feeds)
    nan = np.isnan(fallback)
    assert nan.any() and not nan[1].any()  # batch 1 is untouched
    if tensor == "k" and np.isnan(value):
        assert nan[0, :, :8].all()  # every query row of head 0: the past through its scores, the rest through the mask
    for got in (kernel, kernel2):
        np.testing.assert_array_equal(np.isnan(got), nan)
        finite = np.isfinite(fallback)
        assert_close(np.where(finite, got, 0), np.where(finite, fallback, 0))


@pytest.mark.parametrize("case", CAUSAL_CASES, ids=case_id)
def test_causal_node_agrees_with_its_fallback_and_numpy(case, build):
    """A hand-built causal node (the bias, where there is one, a graph input): the library's kernel
    and the fallback function against float64 numpy."""
    model = fused_model(case)
    feeds = case.feeds(seed=12)
    assert_kernel_and_fallback_close(model, feeds, case.reference(feeds))


@pytest.mark.parametrize("heads,dh,rotary_dim", [(1, 4, 2), (3, 20, 8), (4, 32, 32)])
@pytest.mark.parametrize("b,s", [(1, 1), (2, 33), (1, 70)])
@pytest.mark.parametrize("layout", ["per_head", "split"])
def test_heads_first_operands_match_the_original_and_the_fallback(heads, dh, rotary_dim, b, s, layout, build):
    """q, k (and, per head packed, v) read as [B, H, S, d]: strided views with a head stride of
    S*d, one query block per pair and several (s = 70 at one pair)."""
    m = rotary_attention_model(layout=layout, heads=heads, dh=dh, rotary_dim=rotary_dim)
    opt, n = optimize(m, PASS)
    assert n == 1
    feeds = feeds_for(m, b, s, seed=heads * 100 + s)
    want = runtime.make_session(m, threads=1, with_library=False).run(None, feeds)[0]
    for got in run_three_ways(opt, feeds):
        assert_close(got, want)


def test_heads_first_operand_of_the_wrong_heads_is_an_error_naming_it():
    m = rotary_attention_model(layout="split")
    opt, _ = optimize(m, PASS)
    [node] = [n for n in opt.graph.node if n.op_type == "Attention"]
    node.attribute.extend([onnx.helper.make_attribute("num_heads", 4)])
    del node.attribute[[a.name for a in node.attribute].index("num_heads")]
    with pytest.raises(Exception, match="heads_first 3"):
        runtime.make_session(opt, threads=1, with_library=True).run(None, feeds_for(m, 2, 5))
