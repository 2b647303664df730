"""The CUDA Attention kernel on the forms the CPU kernel fuses beyond head splits, without a GPU:
3-D attention over batch*heads (heads_merged, DeBERTa-v2) with an additive term broadcast to
[B*H, Sq, Sk] (mask_merged_heads) and Where's masked fill (fill_mode), and the decode step (one
query row against Concat(past, new) keys and values, read heads first). The numpy model of the
generated kernel against the direct attention, the op's reference and the CPU kernel's result on
the node fuse-attention writes (special values included); --target cuda on these forms leaves no
Softmax and stores kernels ptxas accepts for sm_90 (skipped without nvcc)."""
from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from test_cuda_attention import assert_compile_for_sm90_without_spills
from test_pass_attention import attrs, fused
from test_pass_attention_merged import FILL, H, merged_model
from test_pass_attention_merged import feeds as merged_feeds
from test_pass_matmul_batch import optimize

from onnxfuse import api, runtime
from onnxfuse.cuda import attention_codegen as ac
from onnxfuse.cuda import attention_model as am
from onnxfuse.cuda.attention_codegen import AttentionSpec
from onnxfuse.ops import attention as attention_op

needs_ptxas = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("ptxas") is None,
                                 reason="nvcc and ptxas (CUDA toolkit) are not on PATH")


def op_attrs(spec: AttentionSpec) -> dict:
    a = {"num_heads": spec.heads, "scale": spec.scale, "has_mask": int(spec.has_mask), "heads_first": spec.heads_first,
         "heads_merged": spec.heads_merged, "mask_merged_heads": int(spec.mask_merged), "nan_to_zero": int(spec.nan_to_zero)}
    if spec.fill_mode:
        a.update(fill_mode=spec.fill_mode, fill_value=spec.fill_value)
    return a


def operands(spec: AttentionSpec, batch, sq, sk, rng):
    def one(bit, s, d):
        if spec.heads_merged >> bit & 1:
            shape = (batch * spec.heads, s, d)
        elif spec.heads_first >> bit & 1:
            shape = (batch, spec.heads, s, d)
        else:
            shape = (batch, s, spec.heads * d)
        return rng.normal(size=shape).astype(np.float32)
    return one(0, sq, spec.dh), one(1, sk, spec.dh), one(2, sk, spec.dv)


def check_against_references(spec, q, k, v, mask, cond, what):
    """The kernel's model against the direct attention (float64) and the op's reference (the
    contract the CPU kernel implements): NaN where they are NaN, close elsewhere."""
    got = am.run(spec, q, k, v, mask, cond=cond)
    inputs = [q, k, v] + ([mask] if spec.has_mask else []) + ([cond] if spec.fill_mode else [])
    for want in (am.reference(spec, q, k, v, mask, cond=cond), attention_op.reference(inputs, op_attrs(spec), 1)[0]):
        assert got.shape == want.shape, what
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=what)
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=2e-6, atol=2e-6, err_msg=what)
    return got


# ---------------------------------------------------------------- the numpy model of the kernel ----

# (heads, dh, dv, batch, sq, sk, mask shape [B*H-broadcast], condition shape, fill mode, fill value)
MERGED_CASES = [
    (4, 16, 16, 2, 7, 7, "full", (2, 1, 7, 7), 2, FILL),  # DeBERTa: [B*H, S, S] term, Where(Not(keep), -FLT_MAX, s)
    (4, 16, 16, 2, 7, 7, (1, 7, 7), (2, 4, 7, 7), 1, FILL),
    (2, 32, 24, 3, 5, 70, (70,), (3, 1, 1, 70), 2, -np.inf),  # three key tiles, padding fill -inf
    (3, 8, 8, 1, 9, 33, (), (9, 33), 1, 0.0),
    (2, 64, 64, 2, 1, 40, (4, 1, 40), (2, 1, 1, 40), 2, FILL),  # one query row
    (2, 16, 16, 2, 6, 6, None, (2, 1, 6, 6), 2, FILL),  # fill without an additive term
    (2, 16, 16, 2, 6, 6, "full", None, 0, 0.0),  # additive term without a fill
]


def merged_spec(c) -> AttentionSpec:
    h, dh, dv, _, _, _, mask, cond, mode, value = c
    return AttentionSpec(h, dh, dv, 0.25, has_mask=mask is not None, heads_merged=7, mask_merged=mask is not None,
                         fill_mode=mode, fill_value=float(value))


def merged_inputs(c, seed=0):
    h, dh, dv, b, sq, sk, mask_shape, cond_shape, mode, _ = c
    rng = np.random.default_rng(seed)
    spec = merged_spec(c)
    q, k, v = operands(spec, b, sq, sk, rng)
    mask = None
    if mask_shape is not None:
        mask = (rng.normal(size=(b * h, sq, sk) if mask_shape == "full" else mask_shape) * 2).astype(np.float32)
    cond = None
    if cond_shape is not None:
        cond = (rng.random(cond_shape) < 0.4).astype(np.float32)
        if len(cond_shape) >= 2 and cond_shape[-2] > 1:  # one row filled entirely: uniform (finite fill) or NaN (-inf)
            cond[(0,) * (len(cond_shape) - 2) + (1, slice(None))] = 1.0 if mode == 1 else 0.0
        cond.flat[0] = np.nan  # a NaN condition is nonzero: filled in mode 1, kept in mode 2
    return spec, q, k, v, mask, cond


@pytest.mark.parametrize("case", MERGED_CASES, ids=lambda c: f"H{c[0]}-dh{c[1]}-dv{c[2]}-sq{c[4]}-sk{c[5]}-fill{c[8]}")
def test_kernel_model_reads_merged_heads_terms_and_fills_like_the_references(case):
    spec, q, k, v, mask, cond = merged_inputs(case, seed=1)
    got = check_against_references(spec, q, k, v, mask, cond, str(case))
    if spec.fill_mode and np.isfinite(spec.fill_value):
        assert not np.isnan(got).any(), "a row filled with a finite value has uniform probabilities, not NaN"


def test_a_fully_filled_row_averages_the_values_and_a_minus_inf_fill_gives_nan_like_softmax():
    for value, want_nan in ((FILL, False), (-np.inf, True)):
        spec = AttentionSpec(2, 16, 16, 0.5, heads_merged=7, fill_mode=1, fill_value=float(value))
        rng = np.random.default_rng(2)
        q, k, v = operands(spec, 1, 3, 40, rng)
        cond = np.zeros((1, 1, 3, 40), np.float32)
        cond[0, 0, 1] = 1.0  # row 1 filled at every key
        got = am.run(spec, q, k, v, cond=cond)
        assert np.isnan(got[0, 1]).all() == want_nan and not np.isnan(got[0, [0, 2]]).any()
        if not want_nan:  # uniform probabilities: the mean of v's rows per head
            mean = v.reshape(1, 2, 40, 16).astype(np.float64).mean(axis=2).reshape(32)
            np.testing.assert_allclose(got[0, 1], mean, rtol=1e-5, atol=1e-6)


def test_a_nan_score_under_a_fill_is_replaced_and_elsewhere_spreads():
    # Where replaces the score whatever it was: a NaN term under the fill leaves the row finite;
    # a NaN term where the condition keeps the score makes the row NaN, as Softmax does.
    spec = AttentionSpec(2, 8, 8, 1.0, has_mask=True, heads_merged=7, mask_merged=True, fill_mode=2, fill_value=FILL)
    rng = np.random.default_rng(3)
    q, k, v = operands(spec, 1, 2, 5, rng)
    mask = np.zeros((2, 2, 5), np.float32)
    mask[0, 0, 3] = np.nan  # (b 0, h 0) row 0, key 3
    mask[1, 1, 2] = np.nan  # (b 0, h 1) row 1, key 2
    cond = np.ones((1, 1, 2, 5), np.float32)
    cond[0, 0, 0, 3] = 0.0  # filled: the NaN is gone
    got = check_against_references(spec, q, k, v, mask, cond, "NaN terms")
    assert not np.isnan(got[0, 0]).any()
    assert np.isnan(got[0, 1, 8:]).all() and not np.isnan(got[0, 1, :8]).any()


def test_a_fill_condition_stride_mistake_is_caught_by_the_model(monkeypatch):
    spec, q, k, v, mask, cond = merged_inputs(MERGED_CASES[1], seed=4)
    want = am.reference(spec, q, k, v, mask, cond=cond)
    broken = {**ac.INDEX, "fill": [("c_src", "b * cs0 + s * cs2 + (t0 + lane) * cs3")]}  # every head reads head 0's
    monkeypatch.setattr(am, "INDEX", broken)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(am.run(spec, q, k, v, mask, cond=cond), want, rtol=1e-5, atol=1e-5)


def test_merged_mask_strides_split_the_merged_axis_into_batch_and_head():
    assert am.mask_strides((8, 5, 7), (2, 4, 5, 7), merged=True) == [140, 35, 7, 1]
    assert am.mask_strides((1, 5, 7), (2, 4, 5, 7), merged=True) == [0, 0, 7, 1]
    assert am.mask_strides((8, 1, 7), (2, 4, 5, 7), merged=True) == [28, 7, 0, 1]
    assert am.mask_strides((7,), (2, 4, 5, 7), merged=True) == [0, 0, 0, 1]
    with pytest.raises(ValueError):
        am.mask_strides((4, 5, 7), (2, 4, 5, 7), merged=True)
    with pytest.raises(ValueError):
        am.mask_strides((2, 4, 5, 7), (2, 4, 5, 7), merged=True)


def test_decode_step_one_query_row_against_present_keys_and_values():
    # A decode step: q [B, 1, H*dh] (or its heads-first rotary output), k and v the present
    # Concat(past, new) [B, H, past + 1, d]; a padding term [B, 1, 1, Sk] with -inf entries.
    for first in (6, 7):
        spec = AttentionSpec(4, 16, 16, 0.25, has_mask=True, nan_to_zero=True, heads_first=first)
        rng = np.random.default_rng(5)
        q, k, v = operands(spec, 2, 1, 129, rng)
        mask = np.zeros((2, 1, 1, 129), np.float32)
        mask[0, 0, 0, :5] = -np.inf
        mask[1] = -np.inf  # a fully padded batch row: nan_to_zero gives +0
        got = check_against_references(spec, q, k, v, mask, None, f"heads_first {first}")
        assert np.all(got[1] == 0) and not np.signbit(got[1]).any()


# ------------------------------------------- the node fuse-attention writes, against the CPU kernel --


def _node_io(model: onnx.ModelProto, node: onnx.NodeProto, feeds: dict) -> list[np.ndarray]:
    """The node's inputs and output in a run of `model` with the library (the CPU kernel)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = [*node.input, node.output[0]]
    known = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in known)
    sess = runtime.make_session(m, threads=1, with_library=True)
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    return [out[n] for n in names]


@pytest.mark.parametrize("variant", [dict(), dict(fill_branch="fill_second", not_cond=False),
                                     dict(fill_branch="fill_first", not_cond=False), dict(term=False)],
                         ids=["not_keep", "keep_second", "keep_first", "no_term"])
@pytest.mark.parametrize("special", [None, np.inf, np.nan], ids=["finite", "inf", "nan"])
def test_kernel_model_on_the_deberta_node_agrees_with_the_cpu_kernel(variant, special):
    from onnxfuse.passes.cuda_compile import attention_spec

    import onnx_graphsurgeon as gs

    model = merged_model(**variant)
    opt, n = optimize(model, ["fuse-attention"])
    assert n == 1
    [node] = fused(opt)
    a = attrs(node)
    assert a["heads_merged"] == 7 and a["fill_mode"] in (1, 2)
    graph = gs.import_onnx(opt)
    spec = attention_spec(next(x for x in graph.nodes if x.op == "Attention"))
    assert spec is not None and spec.heads_merged == 7 and spec.fill_mode == a["fill_mode"]
    assert spec.mask_merged == bool(a.get("mask_merged_heads", 0)) and np.float32(spec.fill_value) == np.float32(FILL)
    for b, s in ((2, 6), (1, 1), (3, 2)):
        f = merged_feeds(b, s, seed=b, special=special)  # row s-1 of batch 0 fully masked: uniform
        ins = _node_io(opt, node, f)
        cpu = ins.pop()
        q, k, v = ins[:3]
        mask = ins[3] if spec.has_mask else None
        cond = ins[-1]
        got = am.run(spec, q, k, v, mask, cond=cond)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(cpu))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(cpu))
        ok = np.isfinite(cpu)
        np.testing.assert_allclose(got[ok], cpu[ok], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- nvcc / ptxas, --target cuda ------

NEW_FORM_SPECS = [
    merged_spec(c) for c in MERGED_CASES] + [
    AttentionSpec(12, 64, 64, 0.125 / np.sqrt(3), has_mask=True, heads_merged=7, mask_merged=True, fill_mode=2,
                  fill_value=FILL),  # DeBERTa-v3-base's attention
    AttentionSpec(16, 128, 128, 0.0884, has_mask=True, heads_merged=7, mask_merged=True, fill_mode=1, fill_value=FILL),
    AttentionSpec(8, 256, 256, 0.0625, has_mask=True, heads_merged=7, mask_merged=True, fill_mode=2, fill_value=FILL),
    AttentionSpec(12, 64, 64, 0.125, has_mask=True, nan_to_zero=True, heads_first=6),  # GPT-2 decode (present k, v)
    AttentionSpec(32, 128, 128, 128 ** -0.5, has_mask=True, heads_first=7),  # LLaMA decode (rotary q, k; repeated v)
    # the corpus's TorchScript decode steps as --target cuda fuses them (H 4, d 16; the mask is the
    # computed padding term over past + 1 keys)
    AttentionSpec(4, 16, 16, 0.25, has_mask=True, nan_to_zero=True, heads_first=6),  # gpt2_decode_ts
    AttentionSpec(4, 16, 16, 0.25, has_mask=True, heads_first=7),  # llama_decode_ts
]


@needs_ptxas
def test_new_form_kernels_compile_for_sm90_without_spills():
    assert_compile_for_sm90_without_spills(NEW_FORM_SPECS)


def _cuda_model(model, tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    return api.optimize(model, target="cuda", arch="sm_90", verify_outputs=False, count_kernels=False,
                        options={"attention_cuda": True}).model


@needs_ptxas
@pytest.mark.parametrize("variant", [dict(), dict(term=False), dict(fill_branch="fill_second", not_cond=False)],
                         ids=["term_fill", "fill", "keep_second"])
def test_target_cuda_fuses_the_deberta_form_into_a_kernel_ptxas_accepts(variant, tmp_path, monkeypatch):
    from onnxfuse.cuda import audit

    model = _cuda_model(merged_model(**variant), tmp_path, monkeypatch)
    ops = [n.op_type for n in model.graph.node]
    assert "Softmax" not in ops and "Where" not in ops
    records = [r for r in audit.audit(model, "sm_90") if r.op == "Attention"]
    assert len(records) == 1 and records[0].ok, [(r.node, r.problem) for r in records]
    assert "[B*H]" in records[0].form or "fill" in records[0].form
    info = records[0].ptxas
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.registers <= 255
    # The optimized model still runs (CPU provider: the CPU kernel) like the original.
    f = merged_feeds(2, 6, seed=3)
    want = runtime.make_session(merged_model(**variant), threads=1).run(None, f)[0]
    got = runtime.make_session(model, threads=1, with_library=True).run(None, f)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_heads_merged_operand_gives_its_head_size_by_its_last_dim_and_an_unknown_attribute_no_kernel():
    from onnxfuse.passes.cuda_compile import attention_spec

    import onnx_graphsurgeon as gs

    opt, _ = optimize(merged_model(), ["fuse-attention"])
    graph = gs.import_onnx(opt)
    node = next(x for x in graph.nodes if x.op == "Attention")
    spec = attention_spec(node)
    assert (spec.heads, spec.dh, spec.dv) == (H, 8, 8)
    node.attrs["heads_first"] = 1  # overlaps heads_merged: no kernel
    assert attention_spec(node) is None
