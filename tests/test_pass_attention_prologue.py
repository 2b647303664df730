"""fuse-attention with a prologue between the head split and the scores (partial or full rotary,
q/k norms, GPT-NeoX's per-head packed projection): the node reads the prologue's [B, H, S, d]
output heads first, the prologue stays in the graph, and the model runs like the original
(with the library and without it), fully masked rows included."""
from __future__ import annotations

import numpy as np
import pytest

from attention_models import attention_model, rotary_attention_model
from onnxfuse import runtime
from test_pass_attention import PASS, attrs, check_runs_like_original, feeds_for, fused
from test_pass_matmul_batch import optimize


@pytest.mark.parametrize("layout,rotary_dim,qk_norm,first", [
    ("per_head", 4, False, 7),  # GPT-NeoX: q, k rotated, v a Slice of the per-head projection
    ("split", 4, False, 3),  # Phi-3: v a plain head split, read in place
    ("split", 8, False, 3),  # full rotary
    ("split", 4, True, 3),  # q/k norms before the rotary
])
def test_rotary_prologue_fuses_reading_q_and_k_heads_first(layout, rotary_dim, qk_norm, first):
    m = rotary_attention_model(layout=layout, rotary_dim=rotary_dim, qk_norm=qk_norm)
    opt, n = optimize(m, PASS)
    assert n == 1
    [node] = fused(opt)
    assert attrs(node) == {"num_heads": 2, "scale": pytest.approx(1 / np.sqrt(8), rel=1e-6), "has_mask": 1,
                           "qkv_packed": 0, "nan_to_zero": 1, "heads_first": first}
    assert not any(n.op_type in ("Softmax", "IsNaN") for n in opt.graph.node)
    assert sum(n.op_type == "Transpose" for n in opt.graph.node) == (1 if layout == "per_head" else 2)
    check_runs_like_original(m, opt, [feeds_for(m, b, s, seed=s) for b, s in ((1, 1), (2, 5), (3, 17))])


def test_rows_masked_out_entirely_give_the_guards_zeros():
    m = rotary_attention_model()
    opt, n = optimize(m, PASS)
    assert n == 1
    feeds = feeds_for(m, 2, 6)
    feeds["mask"][1] = -np.inf  # every key of batch 1 hidden: Softmax NaN, the guard's 0
    want = runtime.make_session(m, threads=1).run(None, feeds)[0]
    assert np.all(want[1] == 0)
    for with_library in (True, False):
        got = runtime.make_session(opt, threads=1, with_library=with_library).run(None, feeds)[0]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_v_read_outside_the_chain_is_read_heads_first():
    m = rotary_attention_model(layout="split", v_first=True)
    opt, n = optimize(m, PASS)
    assert n == 1
    [node] = fused(opt)
    assert attrs(node)["heads_first"] == 7
    check_runs_like_original(m, opt, [feeds_for(m, 2, 5)])


def test_q_heads_read_outside_the_chain_are_read_heads_first():
    m = attention_model(extra_output="qh")
    opt, n = optimize(m, PASS)
    assert n == 1
    [node] = fused(opt)
    assert attrs(node)["heads_first"] == 1 and node.input[0] == "qh"
    check_runs_like_original(m, opt, [feeds_for(m, b, s) for b, s in ((1, 1), (2, 5))])


@pytest.mark.parametrize("layout,rotary_dim,qk_norm,first", [("per_head", 4, False, 7), ("split", 4, True, 3)])
def test_cuda_target_fuses_heads_first_operands_and_gives_them_a_kernel(layout, rotary_dim, qk_norm, first,
                                                                         tmp_path, monkeypatch):
    # The generated CUDA kernel reads [B, H, S, d] operands (attention_codegen, heads_first): the
    # cuda target fuses the prologue's attention as the CPU target does, and cuda-compile stores a
    # kernel ptxas accepts for sm_90 (where the CUDA toolkit is installed).
    import shutil

    m = rotary_attention_model(layout=layout, rotary_dim=rotary_dim, qk_norm=qk_norm)
    opt, n = optimize(m, PASS, target="cuda", attention_cuda=True)
    assert n == 1
    [node] = fused(opt)
    assert attrs(node)["heads_first"] == first
    check_runs_like_original(m, opt, [feeds_for(m, b, s, seed=s) for b, s in ((1, 1), (2, 5))])
    if shutil.which("nvcc") is None or shutil.which("ptxas") is None:
        return
    from onnxfuse.cuda import audit
    from onnxfuse.pipeline import Context, run_passes, select_passes

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    compiled, _ = run_passes(opt, select_passes(["cuda-compile"], "cuda"), Context(target="cuda", arch="sm_90"))
    [rec] = [r for r in audit.audit(compiled, "sm_90") if r.op == "Attention"]
    assert rec.ok and f"heads first {'q,k,v' if first == 7 else 'q,k'}" in rec.form, (rec.problem, rec.form)
    assert rec.ptxas.spill_stores == 0 and rec.ptxas.spill_loads == 0
