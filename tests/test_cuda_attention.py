"""The onnxfuse.Attention CUDA kernel without a GPU: the numpy model of the generated kernel (same
index expressions, tiles, guards and online softmax) against a direct attention, the source's
structure, nvcc + ptxas for sm_90 without spills, and the cuda-compile pass on Attention nodes."""
from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from attention_cases import (CASES, HEADS_FIRST_CASES, NAN_TO_ZERO_CASES, Case, case_id, fused_model, padding_masked,
                             plain_model)

from onnxfuse.cuda import attention_codegen as ac
from onnxfuse.cuda import attention_model as am
from onnxfuse.cuda.attention_codegen import AttentionSpec

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not on PATH")


def spec_of(c: Case) -> AttentionSpec:
    return AttentionSpec(c.heads, c.dh, c.dv, c.scale, c.packed, c.has_mask, c.bias, c.nan_to_zero, c.heads_first)


def run_model(c: Case, feeds: dict) -> np.ndarray:
    if c.packed:
        return am.run(spec_of(c), feeds["qkv"], mask=feeds.get("mask"), bias=feeds.get("bias"))
    return am.run(spec_of(c), feeds["q"], feeds["k"], feeds["v"], feeds.get("mask"))


def assert_matches(got, want, what, tol=2e-6):
    assert got.shape == want.shape, what
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)


# ---------------------------------------------------------------- the numpy model of the kernel ----


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_model_matches_direct_attention(case):
    feeds = case.feeds(seed=1)
    got = run_model(case, feeds)
    assert not np.isnan(got).any(), "an output element was not written"
    assert_matches(got, case.reference(feeds), case_id(case))


@pytest.mark.parametrize("dh,dv,sk", [(7, 5, 3), (33, 31, 32), (1, 1, 1), (256, 256, 20), (160, 200, 17)])
def test_kernel_model_handles_odd_and_extreme_head_sizes(dh, dv, sk):
    c = Case(2, dh, dv, 2, 6, sk, mask_shape=(1, 6, sk))
    feeds = c.feeds(seed=2)
    assert_matches(run_model(c, feeds), c.reference(feeds), case_id(c))


def test_kernel_model_with_minus_inf_masks_skips_blocked_tiles_and_matches():
    # Sk = 70 is three tiles of 32; row 0 sees only keys 40..69 (its first tile is all -inf),
    # row 1 only key 69 (two blocked tiles, then one key), the others a causal-style pattern.
    c = Case(2, 32, 32, 1, 9, 70, mask_shape=(9, 70))
    feeds = c.feeds(seed=3)
    mask = np.zeros((9, 70), np.float32)
    mask[0, :40] = -np.inf
    mask[1, :69] = -np.inf
    for r in range(2, 9):
        mask[r, r * 7 + 1:] = -np.inf
    feeds["mask"] = mask
    got = run_model(c, feeds)
    want = c.reference(feeds)
    assert not np.isnan(got).any()
    assert_matches(got, want, "blocked tiles")
    # Row 1 attends to key 69 alone: its output is exactly that key's value row.
    np.testing.assert_array_equal(got[0, 1], feeds["v"][0, 69])


def test_kernel_model_gives_nan_for_a_fully_blocked_row_like_softmax():
    c = Case(1, 32, 32, 1, 3, 40, mask_shape=(3, 40))
    feeds = c.feeds(seed=4)
    feeds["mask"] = np.zeros((3, 40), np.float32)
    feeds["mask"][1] = -np.inf
    got = run_model(c, feeds)
    assert np.isnan(got[0, 1]).all()
    assert not np.isnan(got[0, [0, 2]]).any()
    assert_matches(got[0, [0, 2]], c.reference(feeds)[0, [0, 2]], "other rows")


def onnxruntime_outputs(model: onnx.ModelProto, feeds: dict, with_library: bool = False) -> np.ndarray:
    """The model's output in onnxruntime (CPU provider); without the library an onnxfuse node runs
    its fallback function, the standard-op subgraph it stands for."""
    from onnxfuse.runtime import make_session

    return make_session(model, threads=1, with_library=with_library).run(None, feeds)[0]


def assert_same_special_values(got, want, what):
    """NaN where want is NaN, and the elements equal to 0 in want bit for bit (+0, not -0)."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=what)
    zero = want == 0
    np.testing.assert_array_equal(got[zero], want[zero], err_msg=what)
    np.testing.assert_array_equal(np.signbit(got[zero]), np.signbit(want[zero]), err_msg=what)


@pytest.mark.parametrize("case", NAN_TO_ZERO_CASES, ids=case_id)
def test_kernel_model_with_nan_to_zero_gives_fully_masked_rows_zero_like_the_fallback_function(case):
    feeds = padding_masked(case, case.feeds(seed=11), seed=11)
    got = run_model(case, feeds)
    fallback = onnxruntime_outputs(fused_model(case), feeds)  # Where(IsNaN(p), 0, p) in standard ops
    assert np.array_equal(fallback, onnxruntime_outputs(plain_model(case), feeds), equal_nan=True)
    assert np.all(fallback[0] == 0) and not np.isnan(fallback).any()
    assert_same_special_values(got, fallback, "fully masked rows")
    np.testing.assert_allclose(got, fallback, rtol=1e-5, atol=1e-5)
    assert_matches(got, case.reference(feeds), "against the direct attention")
    # Without the guard the same rows are NaN, as Softmax makes them.
    unguarded = Case(**{**case.__dict__, "nan_to_zero": False})
    nan_rows = np.isnan(run_model(unguarded, feeds))
    np.testing.assert_array_equal(nan_rows, np.isnan(onnxruntime_outputs(plain_model(unguarded), feeds)))
    assert nan_rows[0].all()
    np.testing.assert_array_equal(nan_rows.any(axis=-1), (fallback == 0).all(axis=-1))


@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
def test_kernel_model_with_nan_to_zero_spreads_a_non_finite_value_of_v_like_the_fallback_function(special):
    # 0 * inf is NaN in the original's MatMul: a fully masked row is NaN in the columns where v
    # holds an infinite or NaN value, +0 elsewhere. With the bias folded, v's bias is in it too.
    case = NAN_TO_ZERO_CASES[0]
    feeds = padding_masked(case, case.feeds(seed=12), seed=12)
    d = case.heads * case.dh
    feeds["qkv"][0, 4, 2 * d + 5] = special  # batch 0 (every key masked), value column 5 (head 0)
    feeds["bias"][2 * d + d - 1] = special if special != -np.inf else np.inf  # the last head's last value column
    want = onnxruntime_outputs(fused_model(case), feeds)
    got = run_model(case, feeds)
    assert np.isnan(want[0, :, 5]).all() and np.isnan(want[..., d - 1]).all()
    assert_same_special_values(got, want, "non-finite values under a fully masked row")
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


def test_kernel_model_gives_nan_for_a_nan_score_in_a_tile_whose_other_scores_are_minus_inf():
    # fmaxf drops NaN: the tile's maximum is -inf, yet the NaN score must make the row NaN (Softmax's
    # row is NaN), also when later tiles hold finite scores; with nan_to_zero the row is then 0.
    for guard in (False, True):
        c = Case(1, 32, 32, 1, 3, 70, mask_shape=(3, 70), nan_to_zero=guard)
        feeds = c.feeds(seed=13)
        mask = np.zeros((3, 70), np.float32)
        mask[1, :32] = -np.inf
        mask[1, 7] = np.nan
        feeds["mask"] = mask
        got = run_model(c, feeds)
        want = onnxruntime_outputs(fused_model(c), feeds)
        assert np.isnan(want[0, 1]).all() != guard
        assert_same_special_values(got, want, f"nan_to_zero={guard}")
        np.testing.assert_allclose(got[0, [0, 2]], want[0, [0, 2]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", NAN_TO_ZERO_CASES, ids=case_id)
def test_cpu_kernel_and_kernel_model_agree_on_nan_to_zero_rows(case):
    # The CPU kernel (kernels/attention_cpu.cc) implements nan_to_zero too: both kernels give the
    # fully masked rows +0 and the others the same probabilities.
    feeds = padding_masked(case, case.feeds(seed=14), seed=14)
    cpu = onnxruntime_outputs(fused_model(case), feeds, with_library=True)
    got = run_model(case, feeds)
    assert_same_special_values(got, cpu, "CPU kernel")
    np.testing.assert_allclose(got, cpu, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", HEADS_FIRST_CASES, ids=case_id)
def test_kernel_model_reads_heads_first_operands_like_the_cpu_kernel_and_the_fallback(case):
    # [B, H, S, d] operands (a rotary prologue's outputs, a decode step's Concat(past, new)): the
    # model of the kernel against the direct attention, the CPU kernel and the fallback function.
    feeds = case.feeds(seed=15)
    if case.nan_to_zero:
        feeds = padding_masked(case, feeds, seed=15)
    got = run_model(case, feeds)
    assert got.shape == (case.batch, case.sq, case.heads * case.dv)
    want = case.reference(feeds)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=2e-6, atol=2e-6)
    for with_library in (False, True):  # the fallback function, then kernels/attention_cpu.cc
        ort = onnxruntime_outputs(fused_model(case), feeds, with_library=with_library)
        assert_same_special_values(got, ort, f"with_library={with_library}")
        np.testing.assert_allclose(got, ort, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("table,right,wrong", [
    ("q_load", "(bh * sq + s) * DH + d", "((b * sq + s) * H + h) * DH + d"),  # q read as [B, S, H, d]
    ("k_load", "(bh * sk + t0 + kt) * DH + kd", "((b * sk + t0 + kt) * H + h) * DH + kd"),  # k too
    ("v_load", "(bh * sk + t0 + vt) * DV + vd", "((b + h) * sk + t0 + vt) * DV + vd"),  # batches a head apart
])
def test_a_heads_first_stride_mistake_is_caught_by_the_model(monkeypatch, table, right, wrong):
    c = HEADS_FIRST_CASES[1]  # heads_first 7, batch 3
    feeds = c.feeds(seed=16)
    assert any(right in e for _, e in ac.INDEX[table])
    broken = {**ac.INDEX, table: [(n, e.replace(right, wrong)) for n, e in ac.INDEX[table]]}
    monkeypatch.setattr(am, "INDEX", broken)
    with pytest.raises((AssertionError, IndexError)):  # wrong values, or a read past the operand
        assert_matches(run_model(c, feeds), c.reference(feeds), f"{right} read as {wrong}")


def test_heads_first_with_packed_qkv_is_refused():
    with pytest.raises(ValueError):
        AttentionSpec(2, 32, 32, 0.125, True, heads_first=1)
    with pytest.raises(ValueError):
        AttentionSpec(2, 32, 32, 0.125, heads_first=8)


def test_kernel_model_with_no_keys_writes_zeros_like_an_empty_matmul():
    c = Case(2, 32, 48, 2, 5, 0, mask_shape=(1, 1, 5, 0))
    got = run_model(c, c.feeds())
    assert got.shape == (2, 5, 96)
    np.testing.assert_array_equal(got, 0)


def test_a_packing_offset_mistake_is_caught_by_the_model(monkeypatch):
    c = CASES[0]  # packed
    feeds = c.feeds(seed=5)
    broken = {**ac.INDEX, "k_load": [(n, e.replace(" + KOFF", "")) for n, e in ac.INDEX["k_load"]]}
    monkeypatch.setattr(am, "INDEX", broken)
    with pytest.raises(AssertionError):
        assert_matches(run_model(c, feeds), c.reference(feeds), "keys read from the query columns")


def infinite_key_bias(c: Case, feeds: dict, head: int) -> dict:
    """The key bias shifts all of a query row's scores by q . bias_k, which softmax cancels: only an
    infinite element shows whether it reaches the scores, making that head's rows NaN."""
    feeds["bias"][c.heads * c.dh + head * c.dh + 3] = np.inf
    return feeds


@pytest.mark.parametrize("table,name,wrong", [("q_load", "qb_src", "d"),  # every head with head 0's bias
                                              ("k_load", "kb_src", "h * DH + kd"),  # keys with q's bias
                                              ("v_load", "vb_src", "h * DV + vd")])  # values with q's bias
def test_a_bias_offset_mistake_is_caught_by_the_model(monkeypatch, table, name, wrong):
    c = next(c for c in CASES if c.bias and c.has_mask)
    feeds = c.feeds(seed=5)
    if table == "k_load":
        feeds = infinite_key_bias(c, feeds, head=1)
        got, want = run_model(c, feeds), c.reference(feeds)
        assert np.isnan(want[..., c.dh:2 * c.dh]).all() and np.isnan(want).sum() == want[..., c.dh:2 * c.dh].size
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        monkeypatch.setattr(am, "INDEX", {**ac.INDEX, table: [(n, wrong if n == name else e) for n, e in ac.INDEX[table]]})
        assert not np.array_equal(np.isnan(run_model(c, feeds)), np.isnan(want))
        return
    broken = {**ac.INDEX, table: [(n, wrong if n == name else e) for n, e in ac.INDEX[table]]}
    monkeypatch.setattr(am, "INDEX", broken)
    with pytest.raises(AssertionError):
        assert_matches(run_model(c, feeds), c.reference(feeds), f"{name} read as {wrong}")


def test_bias_without_packed_qkv_is_refused():
    with pytest.raises(ValueError):
        AttentionSpec(2, 32, 32, 0.125, False, False, True)


def test_a_mask_stride_mistake_is_caught_by_the_model(monkeypatch):
    c = CASES[2]  # mask [B, 1, Sq, Sk]
    feeds = c.feeds(seed=6)
    broken = {**ac.INDEX, "mask": [("m_src", "b * ms0 + s * ms2 + (t0 + lane) * ms3 + h")]}
    monkeypatch.setattr(am, "INDEX", broken)
    with pytest.raises((AssertionError, IndexError)):  # wrong values, or a read past the mask
        assert_matches(run_model(c, feeds), c.reference(feeds), "mask read at the wrong offset")


def test_mask_strides_broadcast_like_onnx():
    assert am.mask_strides((1, 1, 5, 7), (2, 3, 5, 7)) == [0, 0, 7, 1]
    assert am.mask_strides((7,), (2, 3, 5, 7)) == [0, 0, 0, 1]
    assert am.mask_strides((), (2, 3, 5, 7)) == [0, 0, 0, 0]
    assert am.mask_strides((2, 1, 5, 1), (2, 3, 5, 7)) == [5, 0, 1, 0]
    with pytest.raises(ValueError):
        am.mask_strides((4, 7), (2, 3, 5, 7))


# ---------------------------------------------------------------- the generated source -------------


def test_index_expressions_appear_verbatim_in_the_source():
    k = ac.generate(spec_of(CASES[0]))
    fill = ac.generate(AttentionSpec(2, 16, 16, 0.25, heads_merged=7, fill_mode=2, fill_value=-1e30))
    for table_name, table in ac.INDEX.items():
        for name, expr in table:
            assert f"const auto {name} = {expr};" in (fill if table_name == "fill" else k).source
    assert "c_src" not in k.source  # the fill's reads only where the node has a fill


def test_entry_is_deterministic_and_names_the_specialisation():
    s = AttentionSpec(4, 32, 32, 0.125, True, True)
    k1, k2 = ac.generate(s), ac.generate(AttentionSpec(4, 32, 32, 0.125, True, True))
    assert k1.entry == k2.entry and k1.source == k2.source
    assert k1.source.count('extern "C" __global__') == 1
    others = [AttentionSpec(4, 32, 32, 0.25, True, True), AttentionSpec(4, 32, 32, 0.125, False, True),
              AttentionSpec(4, 32, 32, 0.125, True, False), AttentionSpec(2, 32, 32, 0.125, True, True),
              AttentionSpec(4, 64, 64, 0.125, True, True), AttentionSpec(4, 32, 32, 0.125, True, True, True),
              AttentionSpec(4, 32, 32, 0.125, True, True, nan_to_zero=True)]
    others += [AttentionSpec(4, 32, 32, 0.125, False, True, heads_first=b) for b in (1, 3, 6, 7)]
    assert len({k1.entry, *(ac.generate(o).entry for o in others)}) == 12
    assert "__int_as_float(0x3e000000)" in k1.source  # the scale, bit-exact


def test_every_supported_head_size_fits_static_shared_memory():
    for dh in (1, 2, 31, 32, 64, 80, 127, 128, 200, 255, 256):
        for dv in (1, 32, 80, 128, 256):
            s = AttentionSpec(1, dh, dv, 1.0)
            assert ac.shared_bytes(dh, dv, s.tile) <= ac.SHARED_LIMIT
            assert s.tile in (32, 16, 8)
    assert not ac.supported(257, 64) and not ac.supported(64, 257) and ac.supported(256, 256)
    with pytest.raises(ValueError):
        ac.generate(AttentionSpec(1, 300, 64, 1.0))


def test_launch_rule_covers_every_query_row():
    k = ac.generate(AttentionSpec(3, 32, 32, 1.0))
    assert k.threads == 32 * k.rows_per_block
    assert k.grid(2, 9) == 2 * 3 * 3 and k.grid(1, 8) == 3 * 2 and k.grid(0, 5) == 0
    assert k.attrs() == {"cuda_abi": ac.ABI_VERSION, "cuda_block": k.threads, "cuda_rows": k.rows_per_block,
                         "cuda_dh": 32, "cuda_dv": 32}


# ---------------------------------------------------------------- nvcc / ptxas ----------------------


SPECS = sorted({spec_of(c) for c in CASES + NAN_TO_ZERO_CASES + HEADS_FIRST_CASES} | {
                                              AttentionSpec(32, 96, 96, 96 ** -0.5, False, True, False, True, 3),
                                              AttentionSpec(32, 128, 128, 128 ** -0.5, False, True, heads_first=7),
                                              AttentionSpec(8, 256, 256, 0.0625, False, True, heads_first=6),AttentionSpec(2, 256, 256, 0.0625, False, True),
                                              AttentionSpec(3, 7, 5, 1.0, False, True),
                                              AttentionSpec(12, 64, 64, 0.125, True, True),
                                              AttentionSpec(12, 64, 64, 0.125, True, True, True)}, key=str)


def assert_compile_for_sm90_without_spills(specs) -> None:
    """ptxas for sm_90: no spills, shared memory within the kernel's limit, registers within a block's."""
    from onnxfuse.cuda.conv_tune import ptxas_check

    kernels = [ac.generate(s) for s in specs]
    report = ptxas_check(kernels, "sm_90")
    for k in kernels:
        info = report[k.entry]
        assert info.spill_stores == 0 and info.spill_loads == 0, (k.spec, info)
        assert info.smem_bytes <= ac.SHARED_LIMIT, (k.spec, info)
        assert info.registers * k.threads <= 65536, (k.spec, info)


@needs_nvcc
def test_generated_kernels_compile_for_sm90_without_spills():
    assert_compile_for_sm90_without_spills(SPECS)


def _optimize_cuda(model):
    from onnxfuse.pipeline import Context, run_passes, select_passes

    return run_passes(model, select_passes(["cuda-compile"], "cuda"), Context(target="cuda", arch="sm_90"))[0]


@needs_nvcc
@pytest.mark.parametrize("case", [CASES[0], CASES[4], HEADS_FIRST_CASES[0], HEADS_FIRST_CASES[3]], ids=case_id)
def test_cuda_compile_pass_stores_the_attention_kernel_and_launch_constants(case, tmp_path, monkeypatch):
    from onnxfuse.cuda.compile import check_ptx

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    out = _optimize_cuda(fused_model(case))
    (node,) = [n for n in out.graph.node if n.op_type == "Attention"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    kernel = ac.generate(spec_of(case))
    assert attrs["cuda_entry"].decode() == kernel.entry
    assert attrs["cuda_arch"] == b"sm_90" and attrs["cuda_cubin"][:4] == b"\x7fELF"
    ptx = attrs["cuda_ptx"].decode()
    assert f".entry {kernel.entry}(" in ptx
    check_ptx(ptx, "sm_90")
    for key, value in kernel.attrs().items():
        assert attrs[key] == value, key


def test_cuda_compile_pass_leaves_an_attention_node_of_unknown_head_size_without_a_kernel():
    from onnxfuse.passes.cuda_compile import attention_spec

    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(fused_model(CASES[4]))
    (node,) = graph.nodes
    assert attention_spec(node) == spec_of(CASES[4])
    node.inputs[0].shape = ["batch", "sq", "width"]
    assert attention_spec(node) is None
    node.inputs[0].shape = ["batch", "sq", 3 * 512]  # dh 512: beyond the kernel
    node.inputs[2].shape = ["batch", "sk", 3 * 48]
    assert attention_spec(node) is None


def test_cuda_compile_pass_gives_no_kernel_to_an_attention_node_with_an_attribute_it_does_not_implement():
    from onnxfuse.passes.cuda_compile import attention_spec

    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(fused_model(CASES[4]))
    (node,) = graph.nodes
    node.attrs["cuda_entry"] = "a kernel's own attribute"
    assert attention_spec(node) == spec_of(CASES[4])
    node.attrs["kv_num_heads"] = 2  # grouped heads: a form the generator does not know
    assert attention_spec(node) is None


@pytest.mark.parametrize("case", HEADS_FIRST_CASES, ids=case_id)
def test_cuda_compile_pass_reads_head_sizes_of_heads_first_operands_from_their_last_dim(case):
    from onnxfuse.passes.cuda_compile import attention_spec

    import onnx_graphsurgeon as gs

    (node,) = gs.import_onnx(fused_model(case)).nodes
    spec = attention_spec(node)
    assert spec == spec_of(case) and spec.heads_first == case.heads_first
    node.attrs["qkv_packed"] = 1  # a contract the kernel does not have: no kernel
    assert attention_spec(node) is None


def test_cuda_compile_pass_gives_a_nan_to_zero_node_the_kernel_with_the_guard():
    from onnxfuse.passes.cuda_compile import attention_spec

    import onnx_graphsurgeon as gs

    case = NAN_TO_ZERO_CASES[0]
    (node,) = gs.import_onnx(fused_model(case)).nodes
    spec = attention_spec(node)
    assert spec == spec_of(case) and spec.nan_to_zero
    source = ac.generate(spec).source
    assert "NAN_TO_ZERO = 1" in source and "NAN_TO_ZERO = 0" in ac.generate(spec_of(CASES[10])).source


@needs_nvcc
def test_cuda_target_attention_model_runs_on_the_cpu_provider_with_the_library(tmp_path, monkeypatch):
    from conftest import cuda_device_count

    from onnxfuse.runtime import make_session

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    case = CASES[2]
    optimized = _optimize_cuda(fused_model(case))
    feeds = case.feeds(seed=7)
    got = make_session(optimized, with_library=True).run(None, feeds)[0]
    assert_matches(got, case.reference(feeds).astype(np.float32), "CPU provider", tol=1e-5)
    if cuda_device_count() == 0:
        with open("/proc/self/maps") as f:
            assert "libcuda" not in f.read()


@needs_nvcc
def test_cuda_compile_pass_reads_head_sizes_that_only_shape_inference_knows(tmp_path, monkeypatch):
    from onnx import TensorProto, helper, numpy_helper

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    case = CASES[0]  # packed qkv [B, S, 384]; here the product of x [B, S, 16] and a weight
    model = fused_model(case)
    graph = model.graph
    weight = numpy_helper.from_array(np.zeros((16, 384), np.float32), "w_qkv")
    graph.initializer.append(weight)
    graph.node.insert(0, helper.make_node("MatMul", ["x", "w_qkv"], ["qkv"]))
    old = [i for i in graph.input if i.name == "qkv"][0]
    graph.input.remove(old)
    graph.input.insert(0, helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sq", 16]))
    out = _optimize_cuda(model)
    (node,) = [n for n in out.graph.node if n.op_type == "Attention"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["cuda_entry"].decode() == ac.generate(spec_of(case)).entry


def test_cpu_and_cuda_attention_kernels_register_together_with_one_schema():
    # A CUDA session gets both registrations of onnxfuse.Attention (registry.cc); onnxruntime
    # builds one schema per op name and rejects registrations that disagree. Here the CPU
    # provider alone runs the model, so the CPU kernel computes it.
    import onnxruntime as ort

    from onnxfuse.runtime import session_options

    case = CASES[1]
    so = session_options(with_library=True, level="all", provider="cuda")
    sess = ort.InferenceSession(fused_model(case).SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = case.feeds(seed=8)
    assert_matches(sess.run(None, feeds)[0], case.reference(feeds).astype(np.float32), "CPU kernel", tol=1e-5)


def test_an_attention_node_without_a_compiled_kernel_makes_a_cuda_session_use_the_fallbacks():
    from onnxfuse.runtime import needs_library

    model = fused_model(CASES[0])  # as a --target cpu model has it: no cuda_entry
    assert needs_library(model, "cpu")
    assert not needs_library(model, "cuda")
    node = model.graph.node[0]
    node.attribute.append(onnx.helper.make_attribute("cuda_entry", "onnxfuse_attn_0"))
    assert needs_library(model, "cuda")
