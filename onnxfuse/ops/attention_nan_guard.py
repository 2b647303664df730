"""onnxfuse.AttentionNanGuard: the NaN guard after onnxruntime's GroupQueryAttention, one kernel.

contract   inputs out [B, S, H*d] (the op's output) and values [B, Hkv, T, d] (its present
           values); attributes num_heads H, kv_num_heads Hkv (H a multiple of Hkv); output
           [B, S, H*d]: out where it is not NaN, else Z[b, h*d + j] = sum over t of
           V[b, h / (H/Hkv), t, j] - V[b, h / (H/Hkv), t, j] (+0 where that value column is
           finite at every position, NaN where not): what an attention whose NaN probabilities
           were set to 0 gives there, 0 . V. With the optional inputs projected [B, S, D]
           (= MatMul(out, W), as onnxruntime computed it), W [H*d, D] and residual [B, S, D]:
           y = residual + MatMul(guarded out, W), which is residual + projected on the rows of
           out without a NaN and, on the others, the guarded row times W (the output projection
           and the residual Add after the attention, folded by gqa-residual)
model      reference below; the fallback function is the exact subgraph, Sub, ReduceSum over T,
           the kv heads repeated (Expand), Reshape to [B, 1, H*d], Where(IsNaN(out), Z, out)
kernels    kernels/attention_nan_guard_cpu.cc (CPU only, as GroupQueryAttention's float32 kernel)
pass       fuse-gqa (passes/gqa_attention.py), for the NaN-to-zero probabilities form;
           gqa-residual (passes/gqa_residual.py) adds the projection's inputs and the residual
pays       always: four or five kernels (two of them over the whole value cache) become one that
           reads out and, only for a NaN of out, the value column it stands for
"""
from __future__ import annotations

import numpy as np

from .contract import CPU, Attribute, FusedOp, Port


def reference(inputs: list[np.ndarray], attrs: dict, n_outputs: int) -> list[np.ndarray]:
    out, values = (np.asarray(t, np.float32) for t in inputs[:2])
    heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    b, kv, t, d = values.shape
    with np.errstate(all="ignore"):
        z = (values - values).sum(axis=2, dtype=np.float32)  # [B, Hkv, d]
    z = np.repeat(z, heads // kv_heads, axis=1).reshape(b, 1, heads * d)
    y = np.where(np.isnan(out), z, out).astype(np.float32)
    if len(inputs) == 5:
        w, residual = np.asarray(inputs[3], np.float32), np.asarray(inputs[4], np.float32)
        with np.errstate(all="ignore"):
            y = (residual + (y.astype(np.float64) @ w).astype(np.float32)).astype(np.float32)
    return [y]


def form(a: dict, n_inputs: int, n_outputs: int) -> str:
    more = " +projection+residual" if n_inputs == 5 else ""
    return f"H={int(a.get('num_heads', 0))} Hkv={int(a.get('kv_num_heads', 0))}{more}"


OP = FusedOp(
    "AttentionNanGuard", "Where(IsNaN(out), 0 . V, out) after GroupQueryAttention as one kernel",
    kernels={CPU: "kernels/attention_nan_guard_cpu.cc"},
    inputs=(Port("out", "[B, S, H*d]: GroupQueryAttention's output"),
            Port("values", "[B, Hkv, T, d]: its present values"),
            Port("projected", "[B, S, D]: MatMul(out, W) (with W and residual, or none of them)", optional=True),
            Port("weight", "W [H*d, D]: the output projection", optional=True),
            Port("residual", "[B, S, D]: added to the projected output", optional=True)),
    outputs=(Port("y", "[B, S, H*d], or [B, S, D] with the projection and residual"),),
    attributes=(Attribute("num_heads", "int", "H"), Attribute("kv_num_heads", "int", "Hkv")),
    pass_name="fuse-gqa",
    reference=reference,
    form=form,
)
