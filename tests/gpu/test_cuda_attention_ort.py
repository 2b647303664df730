"""onnxfuse.Attention on onnxruntime's CUDA provider (kernels/cuda_attention.cc running the kernel
of onnxfuse/cuda/attention_codegen.py): against the node's fallback function on plain onnxruntime
CUDA, against the CPU provider with our library, with -inf masks, empty batches and key sets,
new batch and sequence sizes on one session, under CUDA-graph capture, and in the optimized
GPT-style zoo model end to end."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from attention_cases import CASES, NAN_TO_ZERO_CASES, Case, case_id, fused_model, padding_masked, plain_model
from gpu_helpers import arch, cuda_ort, cuda_session, device_arch, runner  # noqa: F401  (fixtures)
from test_cuda_ort import _graph_run, assert_close, feeds_for, profiled_node_providers

from onnxfuse.pipeline import Context, run_passes, select_passes

pytestmark = pytest.mark.gpu


def compiled(model: onnx.ModelProto) -> onnx.ModelProto:
    """The hand-built Attention model with its kernel stored for this GPU (cuda-compile only)."""
    return run_passes(model, select_passes(["cuda-compile"], "cuda"), Context(target="cuda", arch=device_arch()))[0]


def assert_attention_close(got, want, what):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: {got.shape} vs {want.shape}"
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=what)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_generated_kernel_alone_matches_its_numpy_model_and_direct_attention(runner, arch, case):
    """The kernel launched without onnxruntime (PyCUDA or CuPy + the driver), the ABI packed here."""
    import struct

    from onnxfuse.cuda import attention_codegen as ac
    from onnxfuse.cuda import attention_model as am
    from onnxfuse.cuda.compile import compile_source

    spec = ac.AttentionSpec(case.heads, case.dh, case.dv, case.scale, case.packed, case.has_mask, case.bias)
    kernel = ac.generate(spec)
    fn = runner.load(compile_source(kernel.source, kernel.entry, arch).cubin, kernel.entry)
    feeds = case.feeds(seed=21)
    names = ["qkv"] if case.packed else ["q", "k", "v"]
    dev = {n: runner.to_device(feeds[n]) for n in names}
    ptrs = [dev["qkv"][1]] * 3 if case.packed else [dev[n][1] for n in names]
    strides = [0, 0, 0, 0]
    mask_ptr = 0
    if case.has_mask:
        dev["mask"] = runner.to_device(np.atleast_1d(feeds["mask"]))
        mask_ptr = dev["mask"][1]
        strides = am.mask_strides(feeds["mask"].shape, (case.batch, case.heads, case.sq, case.sk))
    bias_ptr = 0
    if case.bias:
        dev["bias"] = runner.to_device(feeds["bias"])
        bias_ptr = dev["bias"][1]
    out, out_ptr = runner.empty((case.batch, case.sq, case.heads * case.dv), np.float32)
    args = struct.pack("<18q", *ptrs, mask_ptr, bias_ptr, out_ptr, case.batch, case.sq, case.sk, *strides,
                       0, 0, 0, 0, 0)  # ABI 3: no fill condition
    runner.launch(fn, kernel.grid(case.batch, case.sq), kernel.threads, args)
    got = runner.to_host(out)
    if case.packed:
        model = am.run(spec, feeds["qkv"], mask=feeds.get("mask"), bias=feeds.get("bias"))
    else:
        model = am.run(spec, feeds["q"], feeds["k"], feeds["v"], feeds.get("mask"))
    assert_attention_close(got, model, "vs the numpy model of the kernel")
    assert_attention_close(got, case.reference(feeds), "vs float64 numpy")


@pytest.mark.parametrize("case", NAN_TO_ZERO_CASES, ids=case_id)
def test_nan_to_zero_node_on_cuda_gives_fully_masked_rows_zero_like_its_fallback(cuda_ort, case):
    from onnxfuse.runtime import make_session

    model = compiled(fused_model(case))
    feeds = padding_masked(case, case.feeds(seed=15), seed=15)
    got = cuda_session(cuda_ort, model, with_library=True).run(None, feeds)[0]
    fallback = make_session(plain_model(case), with_library=False).run(None, feeds)[0]
    assert np.all(fallback[0] == 0) and not np.isnan(got).any()
    zero = fallback == 0
    np.testing.assert_array_equal(got[zero], 0.0)
    assert not np.signbit(got[zero]).any()  # +0, as the original's MatMul sums 0 * v from +0
    assert_attention_close(got, fallback, "vs the standard ops on the CPU provider")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_attention_node_on_cuda_matches_its_fallback_and_the_cpu_provider(cuda_ort, case, tmp_path):
    from onnxfuse.runtime import make_session

    model = compiled(fused_model(case))
    feeds = case.feeds(seed=11)
    got = cuda_session(cuda_ort, model, with_library=True).run(None, feeds)[0]
    fallback = cuda_session(cuda_ort, plain_model(case), with_library=False).run(None, feeds)[0]
    cpu = make_session(model, with_library=True).run(None, feeds)[0]
    assert_attention_close(got, fallback, "vs the standard ops on CUDA")
    assert_attention_close(got, cpu, "vs the CPU provider with the library")
    assert_attention_close(got, case.reference(feeds), "vs float64 numpy")
    providers = profiled_node_providers(cuda_ort, model, feeds, tmp_path)
    assert ("Attention", "CUDAExecutionProvider") in providers, providers


def test_one_session_serves_new_batch_and_sequence_sizes(cuda_ort):
    case = Case(2, 64, 64, 1, 8, 8, packed=True, mask_shape=(1, 1, 8, 8))
    sess = cuda_session(cuda_ort, compiled(fused_model(case)), with_library=True)
    for batch, seq in [(1, 8), (3, 33), (2, 1), (1, 100), (5, 31)]:
        c = Case(2, 64, 64, batch, seq, seq, packed=True, mask_shape=(1, 1, seq, seq))
        feeds = c.feeds(seed=batch * 1000 + seq)
        assert_attention_close(sess.run(None, feeds)[0], c.reference(feeds), f"batch {batch}, seq {seq}")


def test_minus_inf_masks_blocking_whole_key_tiles_match(cuda_ort):
    case = Case(2, 32, 32, 1, 9, 70, mask_shape=(9, 70))
    feeds = case.feeds(seed=12)
    mask = np.zeros((9, 70), np.float32)
    mask[0, :40] = -np.inf  # the first tile of 32 keys blocked
    mask[1, :69] = -np.inf  # two tiles blocked, one key left
    for r in range(2, 9):
        mask[r, r * 7 + 1:] = -np.inf
    feeds["mask"] = mask
    got = cuda_session(cuda_ort, compiled(fused_model(case)), with_library=True).run(None, feeds)[0]
    want = cuda_session(cuda_ort, plain_model(case), with_library=False).run(None, feeds)[0]
    assert not np.isnan(got).any()
    assert_attention_close(got, want, "-inf mask")
    np.testing.assert_allclose(got[0, 1], feeds["v"][0, 69], rtol=0, atol=0)


def test_empty_batch_query_or_key_set_gives_an_empty_or_zero_output(cuda_ort):
    case = Case(2, 32, 48, 2, 5, 7, mask_shape=(1, 1, 5, 7))
    sess = cuda_session(cuda_ort, compiled(fused_model(case)), with_library=True)
    for batch, sq, sk in [(0, 5, 7), (2, 0, 7), (2, 5, 0)]:
        c = Case(2, 32, 48, batch, sq, sk, mask_shape=(1, 1, sq, sk))
        got = sess.run(None, c.feeds())[0]
        assert got.shape == (batch, sq, 96)
        np.testing.assert_array_equal(got, 0)  # no keys: an empty weighted sum
    # The session still computes afterwards.
    feeds = case.feeds(seed=13)
    assert_attention_close(sess.run(None, feeds)[0], case.reference(feeds), "after empty runs")


def test_shape_mismatch_is_a_one_line_error_naming_the_node(cuda_ort):
    case = Case(2, 32, 32, 1, 4, 4, mask_shape=(4, 4))
    sess = cuda_session(cuda_ort, compiled(fused_model(case)), with_library=True)
    feeds = case.feeds()
    feeds["mask"] = np.zeros((3, 4), np.float32)  # broadcasts to neither [.., 4, 4]
    with pytest.raises(Exception) as info:
        sess.run(None, feeds)
    assert "Attention node 'attention' (CUDA)" in str(info.value) and "mask" in str(info.value)


def test_cuda_graph_captures_and_replays_the_attention_kernel_with_new_inputs(cuda_ort):
    case = Case(4, 32, 32, 2, 32, 32, packed=True, mask_shape=(1, 1, 32, 32))
    model = compiled(fused_model(case))
    first, second = case.feeds(seed=14), case.feeds(seed=15)
    sess, io, ins, outs = _graph_run(cuda_ort, model, first, {"out": (2, 32, 128)})
    for _ in range(3):  # warm-up, capture, replay
        sess.run_with_iobinding(io)
    assert_attention_close(outs["out"].numpy(), case.reference(first), "captured")
    for name, value in second.items():  # same device addresses, new values: the replay must see them
        ins[name].update_inplace(value)
    sess.run_with_iobinding(io)
    assert_attention_close(outs["out"].numpy(), case.reference(second), "replayed")


def optimize_like_the_cli(model: onnx.ModelProto, dims: dict) -> onnx.ModelProto:
    """What api.optimize(target="cuda", options={"attention_cuda": True}) and `python -m bench.gpu --attention` produce."""
    from onnxfuse import api

    return api.optimize(model, target="cuda", arch=device_arch(), verify_outputs=False, count_kernels=False,
                        dims=dims, options={"attention_cuda": True}).model


def test_optimized_gpt_stack_runs_attention_on_our_cuda_kernel_and_matches_onnxruntime(cuda_ort, tmp_path):
    from onnxfuse import zoo

    zm = zoo.get("gpt_stack")
    original = onnx.load(str(zm.path))
    for dims in ({"batch": 1, "seq": 32}, {"batch": 8, "seq": 32}, {"batch": 2, "seq": 64}, {"batch": 3, "seq": 5}):
        optimized = optimize_like_the_cli(original, dims)
        attention = [n for n in optimized.graph.node if n.op_type == "Attention" and n.domain == "onnxfuse"]
        assert len(attention) == 4, "fuse-attention should fuse each of the 4 blocks' attention"
        for n in attention:
            assert any(a.name == "cuda_cubin" for a in n.attribute), n.name
        feeds = feeds_for(original, dims, seed=3)
        want = cuda_session(cuda_ort, original, with_library=False).run(None, feeds)
        got = cuda_session(cuda_ort, optimized, with_library=True).run(None, feeds)
        assert_close(got, want, f"gpt_stack {dims}")
    providers = profiled_node_providers(cuda_ort, optimized, feeds, tmp_path)
    assert [p for op, p in providers if op == "Attention"] == ["CUDAExecutionProvider"] * 4, providers


@pytest.mark.parametrize("variant", [dict(), dict(term=False), dict(fill_branch="fill_second", not_cond=False)],
                         ids=["term_fill", "fill", "keep_second"])
def test_deberta_form_on_cuda_matches_the_original_on_the_cpu_provider(cuda_ort, variant, tmp_path):
    # 3-D attention over batch*heads with DeBERTa's [B*H, Sq, Sk] term and Where(Not(keep),
    # -FLT_MAX, s), fully masked rows included (uniform probabilities): the generated kernel's
    # heads_merged, mask_merged_heads and fill_mode forms.
    from test_pass_attention_merged import feeds as merged_feeds
    from test_pass_attention_merged import merged_model

    from onnxfuse.runtime import make_session

    original = merged_model(**variant)
    optimized = optimize_like_the_cli(original, {})
    assert "Softmax" not in [n.op_type for n in optimized.graph.node]
    sess = cuda_session(cuda_ort, optimized, with_library=True)
    for b, s in ((2, 6), (1, 1), (3, 2)):
        feeds = merged_feeds(b, s, seed=b)
        want = make_session(original, with_library=False).run(None, feeds)[0]
        assert_attention_close(sess.run(None, feeds)[0], want, f"batch {b}, seq {s}")
    providers = profiled_node_providers(cuda_ort, optimized, merged_feeds(2, 6), tmp_path)
    assert ("Attention", "CUDAExecutionProvider") in providers, providers
