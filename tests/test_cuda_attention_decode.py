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
