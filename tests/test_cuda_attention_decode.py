"""--target cuda on a decode step's attention: MatMul(P, v) reshaped to its own dims computed from
Shapes (GPT-2's [Shape(it)[0], -1, Sq, dv]) and a merge target computed from the input's Shape
(LLaMA's [Shape(x)[0], Shape(x)[1], -1])."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as oh
from onnx import numpy_helper as nh

from onnxfuse import api, runtime

H, D = 4, 8

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="--target cuda needs nvcc (CUDA toolkit)")


def _i64(name, vals):
    return nh.from_array(np.array(vals, dtype=np.int64), name)


def decode_model(identity_view: bool = True, shape_merge: bool = True, mask_dims: list | None = None) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    init = [nh.from_array(rng.standard_normal((H * D, H * D)).astype(np.float32) * 0.2, "wq"),
            _i64("qshape", [0, 0, H, D]), _i64("i0", [0]), _i64("i1", [1]), _i64("i2", [2]),
            _i64("neg1", [-1]), _i64("dv", [D]), _i64("width", [H * D]),
            nh.from_array(np.array(1.0 / np.sqrt(D), dtype=np.float32), "scale")]
    n = [oh.make_node("MatMul", ["x", "wq"], ["qp"]),
         oh.make_node("Reshape", ["qp", "qshape"], ["q4"]),
         oh.make_node("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]),
         oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
         oh.make_node("MatMul", ["q", "kt"], ["s0"]),
         oh.make_node("Mul", ["s0", "scale"], ["s1" if mask_dims else "s"]),
         *([oh.make_node("Add", ["s1", "m"], ["s"])] if mask_dims else []),
         oh.make_node("Softmax", ["s"], ["p"], axis=-1),
         oh.make_node("MatMul", ["p", "v"], ["pv"])]
    ctx = "pv"
    if identity_view:
        n += [oh.make_node("Shape", ["pv"], ["pvs"]), oh.make_node("Gather", ["pvs", "i0"], ["b0"], axis=0),
              oh.make_node("Shape", ["x"], ["xs0"]), oh.make_node("Gather", ["xs0", "i1"], ["sq0"], axis=0),
              oh.make_node("Concat", ["b0", "neg1", "sq0", "dv"], ["vt"], axis=0),
              oh.make_node("Reshape", ["pv", "vt"], ["pvr"])]
        ctx = "pvr"
    n.append(oh.make_node("Transpose", [ctx], ["back"], perm=[0, 2, 1, 3]))
    if shape_merge:
        n += [oh.make_node("Shape", ["x"], ["xs"]), oh.make_node("Gather", ["xs", "i0"], ["xb"], axis=0),
              oh.make_node("Gather", ["xs", "i1"], ["xq"], axis=0),
              oh.make_node("Concat", ["xb", "xq", "neg1"], ["mt"], axis=0)]
    else:
        init.append(_i64("mt", [0, 0, H * D]))
    n.append(oh.make_node("Reshape", ["back", "mt"], ["y"]))
    g = oh.make_graph(n, "decode", [oh.make_tensor_value_info("x", T.FLOAT, ["batch", 1, H * D]),
                                    oh.make_tensor_value_info("k", T.FLOAT, ["batch", H, "total", D]),
                                    oh.make_tensor_value_info("v", T.FLOAT, ["batch", H, "total", D])]
                      + ([oh.make_tensor_value_info("m", T.FLOAT, mask_dims)] if mask_dims else []),
                      [oh.make_tensor_value_info("y", T.FLOAT, None)], init)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])


def feeds(b=2, t=5, seed=1):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((b, 1, H * D)).astype(np.float32),
            "k": rng.standard_normal((b, H, t, D)).astype(np.float32),
            "v": rng.standard_normal((b, H, t, D)).astype(np.float32)}


@pytest.mark.parametrize("variant", [dict(), dict(identity_view=False), dict(shape_merge=False)],
                         ids=["gpt2_view_shape_merge", "shape_merge", "gpt2_view"])
def test_decode_step_forms_fuse_on_the_cuda_pipeline(variant, tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    model = decode_model(**variant)
    r = api.optimize(model, target="cuda", arch="sm_90", verify_outputs=False, count_kernels=False,
                     passes=["fuse-attention"], options={"attention_cuda": True})
    ops = [x.op_type for x in r.model.graph.node]
    assert "Softmax" not in ops and "Attention" in ops, ops
    f = feeds()
    want = runtime.make_session(model, threads=1).run(None, f)[0]
    got = runtime.make_session(r.model, threads=1, with_library=True).run(None, f)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
def test_decode_step_kernel_is_accepted_by_ptxas_sm90(tmp_path, monkeypatch):
    from onnxfuse.cuda import audit

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    model = api.optimize(decode_model(), target="cuda", arch="sm_90", verify_outputs=False, count_kernels=False,
                         options={"attention_cuda": True}).model
    records = [r for r in audit.audit(model, "sm_90") if r.op == "Attention"]
    assert len(records) == 1 and records[0].ok, [(r.node, r.problem) for r in records]
    info = records[0].ptxas
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.registers <= 255


def test_a_term_of_unknown_key_length_fuses_and_one_of_unknown_batch_does_not(tmp_path, monkeypatch):
    # v's key length is k's: a term widening the key axis would fail MatMul(P, v) in the original.
    # An unknown batch could grow the output, which the merge's -1 would absorb: no proof, no fusion.
    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    keys = decode_model(mask_dims=["batch", 1, 1, "mk"])
    r = api.optimize(keys, target="cuda", arch="sm_90", verify_outputs=False, count_kernels=False,
                     passes=["fuse-attention"], options={"attention_cuda": True})
    assert "Softmax" not in [x.op_type for x in r.model.graph.node]
    f = feeds()
    f["m"] = np.where(np.arange(5) < 3, 0, -3.0e38).astype(np.float32).reshape(1, 1, 1, 5).repeat(2, 0)
    want = runtime.make_session(keys, threads=1).run(None, f)[0]
    got = runtime.make_session(r.model, threads=1, with_library=True).run(None, f)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    batch = decode_model(mask_dims=["mb", 1, 1, "total"])
    r = api.optimize(batch, target="cuda", arch="sm_90", verify_outputs=False, count_kernels=False,
                     passes=["fuse-attention"], options={"attention_cuda": True})
    assert "Softmax" in [x.op_type for x in r.model.graph.node]


def decode_with_cache() -> onnx.ModelProto:
    """A decode step with a KV cache as the TorchScript exporter writes GPT-2's: k, v are
    Concat(past, new) [B, H, past + 1, D]; the additive term is computed, Where(Expand(keep,
    [B, -1, 1, L]), 0, -FLT_MAX) with the key length L = Shape(past)[2] + 1 (the expand-target
    idiom turns the -1 into 1); the merge target is [Shape(x)[0], Shape(x)[1], -1], which pins no
    row: the term's batch, head and query dims must be proved."""
    rng = np.random.default_rng(0)
    w = lambda name: nh.from_array(rng.standard_normal((H * D, H * D)).astype(np.float32) * 0.2, name)  # noqa: E731
    init = [w("wq"), w("wk"), w("wv"), _i64("qshape", [0, 0, H, D]), _i64("i0", [0]), _i64("i1", [1]),
            _i64("two", 2), _i64("one", 1), _i64("zero", 0), _i64("neg1", [-1]), _i64("unit", [1]),
            _i64("ax012", [0, 1, 2]), _i64("ax123", [1, 2, 3]), _i64("ax0", [0]),
            nh.from_array(np.array(1.0 / np.sqrt(D), dtype=np.float32), "scale"),
            nh.from_array(np.array(0.0, dtype=np.float32), "fzero"),
            nh.from_array(np.array(np.finfo(np.float32).min, dtype=np.float32), "lowest")]
    n = []
    for name in ("q", "knew", "vnew"):
        proj = {"q": "wq", "knew": "wk", "vnew": "wv"}[name]
        n += [oh.make_node("MatMul", ["x", proj], [f"{name}_p"]),
              oh.make_node("Reshape", [f"{name}_p", "qshape"], [f"{name}_4"]),
              oh.make_node("Transpose", [f"{name}_4"], [name], perm=[0, 2, 1, 3])]
    n += [oh.make_node("Concat", ["past_key", "knew"], ["k"], axis=2),
          oh.make_node("Concat", ["past_value", "vnew"], ["v"], axis=2),
          # the term: keys t >= first[b] are kept, L = past + 1 keys
          oh.make_node("Shape", ["past_key"], ["pks"]), oh.make_node("Gather", ["pks", "two"], ["p"], axis=0),
          oh.make_node("Add", ["p", "one"], ["L"]), oh.make_node("Range", ["zero", "L", "one"], ["keys"]),
          oh.make_node("Unsqueeze", ["keys", "ax012"], ["keys4"]),
          oh.make_node("Unsqueeze", ["first", "ax123"], ["first4"]),
          oh.make_node("GreaterOrEqual", ["keys4", "first4"], ["keep"]),
          oh.make_node("Shape", ["x"], ["xs"]), oh.make_node("Gather", ["xs", "i0"], ["xb"], axis=0),
          oh.make_node("Gather", ["xs", "i1"], ["xq"], axis=0),
          oh.make_node("Unsqueeze", ["L", "ax0"], ["L1"]),
          oh.make_node("Concat", ["xb", "neg1", "unit", "L1"], ["et"], axis=0),
          oh.make_node("Shape", ["et"], ["etn"]),
          oh.make_node("ConstantOfShape", ["etn"], ["ones"], value=nh.from_array(np.array([1], np.int64))),
          oh.make_node("Mul", ["ones", "neg1"], ["negs"]), oh.make_node("Equal", ["et", "negs"], ["is_neg"]),
          oh.make_node("Where", ["is_neg", "ones", "et"], ["et_ok"]),
          oh.make_node("Expand", ["keep", "et_ok"], ["wide"]),
          oh.make_node("Where", ["wide", "fzero", "lowest"], ["m"]),
          oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
          oh.make_node("MatMul", ["q", "kt"], ["s0"]), oh.make_node("Mul", ["s0", "scale"], ["s1"]),
          oh.make_node("Add", ["s1", "m"], ["s"]), oh.make_node("Softmax", ["s"], ["pr"], axis=-1),
          oh.make_node("MatMul", ["pr", "v"], ["pv"]),
          oh.make_node("Transpose", ["pv"], ["back"], perm=[0, 2, 1, 3]),
          oh.make_node("Concat", ["xb", "xq", "neg1"], ["mt"], axis=0),
          oh.make_node("Reshape", ["back", "mt"], ["y"])]
    g = oh.make_graph(n, "decode_cache", [oh.make_tensor_value_info("x", T.FLOAT, ["batch", 1, H * D]),
                                          oh.make_tensor_value_info("past_key", T.FLOAT, ["batch", H, "past", D]),
                                          oh.make_tensor_value_info("past_value", T.FLOAT, ["batch", H, "past", D]),
                                          oh.make_tensor_value_info("first", T.INT64, ["batch"])],
                      [oh.make_tensor_value_info("y", T.FLOAT, None), oh.make_tensor_value_info("k", T.FLOAT, None),
                       oh.make_tensor_value_info("v", T.FLOAT, None)], init)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])


def cache_feeds(b, past, seed=2):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((b, 1, H * D)).astype(np.float32),
            "past_key": rng.standard_normal((b, H, past, D)).astype(np.float32),
            "past_value": rng.standard_normal((b, H, past, D)).astype(np.float32),
            "first": np.arange(b, dtype=np.int64) % (past + 1)}


def test_decode_step_with_a_computed_term_over_past_plus_one_keys_fuses(tmp_path, monkeypatch):
    # The term's dims are [B, 1, 1, past + 1]: before the shape facts carried sums, its key length
    # (and, through the expand target's -1 test, every dim) was unknown and the Softmax stayed.
    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    model = decode_with_cache()
    r = api.optimize(model, target="cuda", arch="sm_90", verify_outputs=False, count_kernels=False,
                     passes=["fuse-attention"], options={"attention_cuda": True})
    ops = [x.op_type for x in r.model.graph.node]
    assert "Softmax" not in ops and ops.count("Attention") == 1, r.summary.get("unmatched")
    for b, past in ((2, 5), (3, 1), (1, 0)):
        f = cache_feeds(b, past)
        want = runtime.make_session(model, threads=1).run(None, f)
        got = runtime.make_session(r.model, threads=1, with_library=True).run(None, f)
        for g_, w_ in zip(got, want):
            np.testing.assert_allclose(g_, w_, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
@pytest.mark.parametrize("name", ["gpt2_decode_ts", "llama_decode_ts"])
def test_corpus_decode_steps_fuse_on_cuda_into_kernels_ptxas_accepts(name, tmp_path, monkeypatch):
    # The corpus's TorchScript decode steps (present k, v heads first; GPT-2's NaN guard; LLaMA's
    # rotary q, k and repeated v): every attention one Attention node with a kernel for sm_90.
    from onnxfuse.cuda import audit

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    model = api.optimize(f"zoo:{name}", target="cuda", arch="sm_90", options={"attention_cuda": True},
                         count_kernels=False).model  # verified on the CPU provider (the CPU kernel)
    assert "Softmax" not in [x.op_type for x in model.graph.node]
    records = [r for r in audit.audit(model, "sm_90") if r.op == "Attention"]
    assert len(records) == 2 and all(r.ok for r in records), [(r.node, r.problem) for r in records]
    for r in records:
        assert "+mask" in r.form and "heads first" in r.form
        assert r.ptxas.spill_stores == 0 and r.ptxas.spill_loads == 0 and r.ptxas.registers <= 255
