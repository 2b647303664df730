"""Transformer pieces as the torch.onnx exporters write them, as rule-engine patterns.

Each pattern is written the way the exported subgraph computes its value (rules.py). Names a
pattern binds (Var, Const, _name) are what a pass's condition reads; the conditions that need
shapes (which axis a Slice cuts, what a run-time Reshape target holds) are left to the pass,
which proves them with shape_values.ShapeEvaluator.

    rotary:     x * cos + rotate_half(x) * sin, rotate_half(x) = Concat(-x[..., d/2:], x[..., :d/2])
                (transformers' apply_rotary_pos_emb, both exporters)
    repeat_kv:  Reshape(Expand(Unsqueeze(x, 2), [B, Hkv, n, S, d]), [B, Hkv * n, S, d])
                (transformers' repeat_kv: grouped-query attention's key and value heads)
    keys^T:     Transpose(k, [0, 1, 3, 2]) (TorchScript) or Reshape(Transpose(Reshape(k, [-1, S, d]),
                [0, 2, 1]), [B, H, d, S]) (torch.export's 3-D transpose)
    scores:     (q @ kT) * s (TorchScript: eager attention) or (q * s1) @ (kT * s2) (torch.export:
                scaled_dot_product_attention's decomposition, the scale split as sqrt on both)
    probs:      Softmax(scores + mask), then Cast(Cast(p)) float to float (TorchScript's
                softmax(dtype=float32).to(q.dtype)) or Where(IsNaN(p), 0, p) (the decomposition's
                NaN-to-zero for all-masked rows; its IsNaN is checked by the pass)
"""
from __future__ import annotations

from .rules import ANY, Const, OpPattern, Var, op

HEADS_PERM = [0, 2, 1, 3]


def _last_axis(axis) -> bool:
    return axis is None or int(axis) in (-1, 3)


def heads(name: str) -> OpPattern:
    """Transpose(Reshape(x, target), [0, 2, 1, 3]): x [B, S, H*d] split into [B, H, S, d];
    binds x as `name`, the target as `name`_target, the Reshape as `name`_split."""
    return op.Transpose(op.Reshape(Var(name), Var(f"{name}_target"), _name=f"{name}_split"), perm=HEADS_PERM)


def rotary(x: str) -> OpPattern:
    """x * cos + rotate_half(x) * sin on the head-split x; binds x, cos, sin and the two
    Slices as `x`_hi (x[..., d/2:], negated) and `x`_lo (x[..., :d/2])."""
    xv = Var(x)
    half = op.Concat(op.Neg(op.Slice(xv, ANY, ANY, ANY, ANY, _name=f"{x}_hi")),
                     op.Slice(xv, ANY, ANY, ANY, ANY, _name=f"{x}_lo"), axis=lambda a: a is not None and int(a) in (-1, 3))
    return xv * Var("cos") + half * Var("sin")


def repeat_kv(x: str) -> OpPattern:
    """Reshape(Expand(Unsqueeze(x, axes), shape), target); binds x, and the Unsqueeze, Expand and
    Reshape as `x`_unsqueeze, `x`_expand, `x`_repeat."""
    return op.Reshape(op.Expand(op.Unsqueeze(Var(x), ANY, _name=f"{x}_unsqueeze"), ANY, _name=f"{x}_expand"),
                      ANY, _name=f"{x}_repeat")


def keys_transposed(k: OpPattern, exporter: str) -> OpPattern:
    if exporter == "ts":
        return op.Transpose(k, perm=[0, 1, 3, 2])
    return op.Reshape(op.Transpose(op.Reshape(k, ANY, _name="kt_flat"), perm=[0, 2, 1]), ANY, _name="kt_unflat")


def scores(q: OpPattern, kt: OpPattern, exporter: str) -> OpPattern:
    if exporter == "ts":
        return op.MatMul(q, kt) * Const(name="scale")
    return op.MatMul(q * Const(name="q_scale"), kt * Const(name="k_scale"))


def probabilities(logits: OpPattern, form: str) -> OpPattern:
    p = op.Softmax(logits, axis=_last_axis, _name="softmax")
    if form == "cast":
        return op.Cast(op.Cast(p, to=1), to=1)
    if form == "nan_to_zero":
        return op.Where(Var("isnan"), Const(0.0), p, _name="nan_to_zero")
    return p


def gqa_attention(exporter: str, probs_form: str) -> OpPattern:
    """The attention of a grouped-query decoder layer from its rotated q and k (Vars qr, kr)
    and head-split v (Var vh) to the merged heads [B, S, H*dv]: binds mask, the merge Reshape
    as `merge` and its target as `merge_target`."""
    logits = scores(Var("qr"), keys_transposed(repeat_kv("kr"), exporter), exporter) + Var("mask")
    pv = op.MatMul(probabilities(logits, probs_form), repeat_kv("vh"))
    return op.Reshape(op.Transpose(pv, perm=HEADS_PERM), Var("merge_target"), _name="merge")


# (exporter, probabilities form) pairs the corpus's LLaMA exports take.
GQA_FORMS = (("ts", "cast"), ("ts", "plain"), ("dynamo", "nan_to_zero"), ("dynamo", "plain"))
