"""onnxfuse.Attention: multi-head scaled dot-product attention over split heads.

contract   qkv_packed = 0: inputs q [B, Sq, H*dh], k [B, Sk, H*dh], v [B, Sk, H*dv] (, mask), each
           [B, H, S, d] instead where its heads_first bit (1 q, 2 k, 4 v) is set;
           qkv_packed = 1: qkv [B, S, 3*H*dh] (, mask) (, bias [3*H*dh]); mask additive,
           broadcastable to [B, H, Sq, Sk]; output [B, Sq, H*dv] =
           softmax(scale * q k^T + mask) v per head (kernels/attention_cpu.cc's header);
           mask_merged_heads = 1: the mask is rank <= 3, broadcastable to [B*H, Sq, Sk] (3-D
           attention over batch*heads), read as [B, H, Sq, Sk]; fill_mode 1 (2): a score is
           replaced by fill_value where the last input, the condition (float32, broadcastable
           to [B, H, Sq, Sk]), is nonzero (zero), after the mask: Where's masked fill
model      reference below
kernels    kernels/attention_cpu.cc; kernels/cuda_attention.cc launching
           onnxfuse/cuda/attention_codegen.py's kernel
pass       fuse-attention (passes/attention.py) and its variants, which hold the op's cost policy
           (the key-length bounds measured on the CPU)
"""
from __future__ import annotations

import numpy as np

from .contract import CPU, CUDA, Attribute, FusedOp, Port


def reference(inputs: list[np.ndarray], attrs: dict, n_outputs: int) -> list[np.ndarray]:
    heads = int(attrs["num_heads"])
    packed, has_mask, has_bias = (bool(int(attrs.get(a, 0))) for a in ("qkv_packed", "has_mask", "has_bias"))
    it = iter(np.asarray(v, np.float64) for v in inputs)
    if packed:
        qkv = next(it)
        mask = next(it) if has_mask else None
        if has_bias:
            qkv = qkv + next(it)
        q, k, v = np.split(qkv, 3, axis=-1)
    else:
        q, k, v = next(it), next(it), next(it)
        mask = next(it) if has_mask else None
    fill_mode = int(attrs.get("fill_mode", 0))
    cond = next(it) if fill_mode else None

    first, merged = int(attrs.get("heads_first", 0)), int(attrs.get("heads_merged", 0))

    def split(t, bit):  # [B, S, H*d] (heads_first: [B, H, S, d]; heads_merged: [B*H, S, d]) -> [B, H, S, d]
        if (first >> bit) & 1:
            return t
        if (merged >> bit) & 1:
            return t.reshape(t.shape[0] // heads, heads, *t.shape[1:])
        b, s, hd = t.shape
        return t.reshape(b, s, heads, hd // heads).transpose(0, 2, 1, 3)

    with np.errstate(all="ignore"):
        scores = float(attrs.get("scale", 1.0)) * (split(q, 0) @ split(k, 1).transpose(0, 1, 3, 2))
        if mask is not None:
            if int(attrs.get("mask_merged_heads", 0)):
                b, h, sq, sk = scores.shape
                mask = np.broadcast_to(mask, (b * h, sq, sk)).reshape(b, h, sq, sk)
            scores = scores + mask
        if fill_mode:
            hit = cond != 0 if fill_mode == 1 else cond == 0
            scores = np.where(hit, np.float64(np.float32(attrs.get("fill_value", 0.0))), scores)
        if int(attrs.get("causal", 0)):
            sq, sk = scores.shape[-2:]
            scores = np.where(np.arange(sk)[None, :] > np.arange(sq)[:, None], -np.inf, scores)
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
        if int(attrs.get("nan_to_zero", 0)):
            p = np.where(np.isnan(p), 0.0, p)
        out = p @ split(v, 2)
    b, h, s, dv = out.shape
    return [out.transpose(0, 2, 1, 3).reshape(b, s, h * dv).astype(np.float32)]


def form(a: dict, n_inputs: int, n_outputs: int) -> str:
    parts = [f"H={int(a.get('num_heads', 0))}"]
    if "cuda_dh" in a:
        parts.append(f"dh={int(a['cuda_dh'])}")
    parts.append("packed qkv" if int(a.get("qkv_packed", 0)) else "q,k,v")
    if int(a.get("has_bias", 0)):
        parts.append("+bias")
    if int(a.get("has_mask", 0)):
        parts.append("+mask [B*H]" if int(a.get("mask_merged_heads", 0)) else "+mask")
    if int(a.get("fill_mode", 0)):
        parts.append(f"fill {float(a.get('fill_value', 0.0)):.4g} where {'nonzero' if int(a['fill_mode']) == 1 else 'zero'}")
    if int(a.get("causal", 0)):
        parts.append("causal")
    if int(a.get("nan_to_zero", 0)):
        parts.append("nan_to_zero")
    first, merged = int(a.get("heads_first", 0)), int(a.get("heads_merged", 0))
    if first:
        parts.append("heads first " + ",".join(n for i, n in enumerate("qkv") if first >> i & 1))
    if merged:
        parts.append("[B*H, S, d] " + ",".join(n for i, n in enumerate("qkv") if merged >> i & 1))
    parts.append(f"scale={float(a.get('scale', 1.0)):.4g}")
    return " ".join(parts)


OP = FusedOp(
    "Attention", "softmax(Q K^T * scale + bias) V, with masks, scale forms and head layouts",
    kernels={CPU: "kernels/attention_cpu.cc", CUDA: "kernels/cuda_attention.cc"},
    inputs=(Port("inputs", "qkv or q, k, v; then the mask (has_mask), the bias (has_bias), the fill condition (fill_mode)",
                 variadic=True),),
    outputs=(Port("out", "[B, Sq, H*dv]"),),
    attributes=(
        Attribute("num_heads", "int", "H"),
        Attribute("scale", "float", "multiplies q.k", 1.0),
        Attribute("has_mask", "int", "an additive mask input follows q, k, v", 0),
        Attribute("qkv_packed", "int", "one input qkv [B, S, 3*H*dh]", 0),
        Attribute("has_bias", "int", "the packed projection's bias [3*H*dh] is the last input", 0),
        Attribute("causal", "int", "keys after the query's position are hidden (CPU kernel only)", 0),
        Attribute("causal_max_queries", "int", "the longest query sequence the causal form takes", 0),
        Attribute("causal_max_keys", "int", "the longest key sequence the causal form takes", 0),
        Attribute("nan_to_zero", "int", "a row of NaN probabilities weighs v by 0", 0),
        Attribute("heads_first", "int", "bit 0 q, 1 k, 2 v: that input is [B, H, S, d] (not with qkv_packed)", 0),
        Attribute("heads_merged", "int", "bits 0-2: q, k, v is [B*H, S, d] (3-D attention over batch*heads)", 0),
        Attribute("mask_merged_heads", "int", "the mask is [B*H, Sq, Sk] (3-D attention over batch*heads)", 0),
        Attribute("fill_mode", "int", "1 (2): a score is fill_value where the condition input is nonzero (zero)", 0),
        Attribute("fill_value", "float", "the masked fill's value", 0.0),
    ),
    pass_name="fuse-attention",
    cuda_generator="onnxfuse.cuda.attention_codegen",
    reference=reference,
    form=form,
)
