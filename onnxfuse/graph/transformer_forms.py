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

import numpy as np

from . import core as gu
from . import rules
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
    p = op.Softmax(logits, axis=_last_axis, _name="softmax", _value="probs")
    if form == "cast":
        return op.Cast(op.Cast(p, to=1), to=1)
    if form == "nan_to_zero":
        return op.Where(op.IsNaN(Var("probs"), _name="isnan"), Const(0.0), p, _name="nan_to_zero")
    return p


def gqa_attention(keys: str, scale: str, probs_form: str, view: bool = False, repeat: bool = True) -> OpPattern:
    """The attention of a decoder layer from its q (Var qr: rotated, or the head split alone)
    and k (Var kr), and head-split v (Var vh) to the merged heads [B, S, H*dv]: binds mask, the
    merge Reshape as `merge` and its target as `merge_target`. `keys` is the key transpose's
    form and `scale` the scale's (as keys_transposed and scores write them, by the exporter
    that writes them: GPT-2's TorchScript export splits the scale over q and kT as torch.export
    does). With `repeat`, k and v go through repeat_kv (grouped-query attention). With `view`, a
    Reshape of the weighted sum (`pv_view`, target `pv_view_target`; a decode step's view of
    [B, H, 1, d], which the pass proves a no-op) comes before the merge. kr and vh may be
    Concat(past, new) (a decode step's keys and values: the pass tells)."""
    k, v = (repeat_kv("kr"), repeat_kv("vh")) if repeat else (Var("kr"), Var("vh"))
    logits = scores(Var("qr"), keys_transposed(k, keys), scale) + Var("mask")
    pv = op.MatMul(probabilities(logits, probs_form), v)
    if view:
        pv = op.Reshape(pv, Var("pv_view_target"), _name="pv_view")
    return op.Reshape(op.Transpose(pv, perm=HEADS_PERM), Var("merge_target"), _name="merge")


# (key transpose, scale, probabilities form, view, repeat_kv) the corpus's decoder exports take:
# LLaMA's (both exporters; a decode step's torch.export view) and GPT-2's decode step (both).
GQA_FORMS = (("ts", "ts", "cast", False, True), ("ts", "ts", "plain", False, True),
             ("dynamo", "dynamo", "nan_to_zero", False, True), ("dynamo", "dynamo", "plain", False, True),
             ("dynamo", "dynamo", "nan_to_zero", True, True), ("dynamo", "dynamo", "plain", True, True),
             ("ts", "dynamo", "nan_to_zero", True, False), ("ts", "dynamo", "plain", True, False),
             ("dynamo", "dynamo", "nan_to_zero", True, False), ("dynamo", "dynamo", "plain", True, False),
             ("dynamo", "dynamo", "nan_to_zero", False, False), ("dynamo", "dynamo", "plain", False, False))


# torch's nn.MultiheadAttention (torchvision's ViT), as both exporters write it: sequence-first.
# The module transposes its batch-first input to [S, B, E], projects q, k, v with one packed
# weight, and unpacks them as proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2)
# followed by a Gather per piece; each piece goes [S, B, E] -> [S, B*H, dh] -> [B*H, S, dh] ->
# [B, H, S, dh]; the heads come back as [S, B, H, dh] -> [S, B, E] for the out-projection, which
# is transposed back to [B, S, E].
SEQ_FIRST_PERM = [1, 0, 2]  # [B, S, E] <-> [S, B, E]
PIECES_PERM = [3, 1, 2, 0, 4]  # [1, S, B, 3, E] -> [3, S, B, 1, E]
SEQ_FIRST_MERGE_PERM = [2, 0, 1, 3]  # [B, H, S, dh] -> [S, B, H, dh]


def seq_first_pieces(bias: bool) -> OpPattern:
    """Squeeze(Transpose(Unsqueeze(Reshape(Transpose(x, [1, 0, 2]) @ W (+ b), target), axes),
    [3, 1, 2, 0, 4]), axes): the packed projection of x [B, S, E] as [3, S, B, E] (the pass proves
    the targets and axes); binds x, in_weight, in_bias (with `bias`; a zero bias the export left
    out has no Add), unpack_target, unsqueeze_axes, squeeze_axes, and the MatMul as `in_proj`."""
    proj = op.MatMul(op.Transpose(Var("x"), perm=SEQ_FIRST_PERM), Var("in_weight"), _name="in_proj")
    if bias:
        proj = proj + Var("in_bias")
    unpacked = op.Reshape(proj, Var("unpack_target"), _name="unpack")
    return op.Squeeze(op.Transpose(op.Unsqueeze(unpacked, Var("unsqueeze_axes")), perm=PIECES_PERM),
                      Var("squeeze_axes"), _name="pieces")


def seq_first_heads(piece: str) -> OpPattern:
    """Reshape(Transpose(Reshape(piece, flat_target), [1, 0, 2]), target): one of q, k, v
    [S, B, E] split into heads [B, H, S, dh]; binds the piece as `piece`, the targets as
    `piece`_flat_target and `piece`_target, the Reshapes as `piece`_flat and `piece`_heads."""
    flat = op.Reshape(Var(piece), Var(f"{piece}_flat_target"), _name=f"{piece}_flat")
    return op.Reshape(op.Transpose(flat, perm=SEQ_FIRST_PERM), Var(f"{piece}_target"), _name=f"{piece}_heads")


def seq_first_keys_transposed(piece: str) -> OpPattern:
    """Reshape(Transpose(Transpose(Reshape(piece, flat_target), [1, 0, 2]), [0, 2, 1]), target):
    the keys [S, B, E] as [B, H, dh, S] (torch.export's 3-D key transpose, its head-split Reshape
    merged into the one after it); binds as seq_first_heads does."""
    flat = op.Reshape(Var(piece), Var(f"{piece}_flat_target"), _name=f"{piece}_flat")
    keys_t = op.Transpose(op.Transpose(flat, perm=SEQ_FIRST_PERM), perm=[0, 2, 1])
    return op.Reshape(keys_t, Var(f"{piece}_target"), _name=f"{piece}_heads")


def seq_first_out_projection(bias: bool) -> OpPattern:
    """Transpose(Reshape(Transpose(heads, [2, 0, 1, 3]), target) @ W (+ b), [1, 0, 2]): the heads
    [B, H, S, dh] merged sequence-first, projected and made batch-first [B, S, N]; binds heads,
    merge_target, out_weight, out_bias (with `bias`), and the Reshape as `merge`."""
    merged = op.Reshape(op.Transpose(Var("heads"), perm=SEQ_FIRST_MERGE_PERM), Var("merge_target"), _name="merge")
    proj = op.MatMul(merged, Var("out_weight"))
    return op.Transpose(proj + Var("out_bias") if bias else proj, perm=SEQ_FIRST_PERM)


def seq_first_out_gemm() -> OpPattern:
    """Transpose(Reshape(Gemm(Reshape(Transpose(heads, [2, 0, 1, 3]), [S*B, E]), W, C), [S, B, N]),
    [1, 0, 2]): nn.MultiheadAttention's output as torch.export writes it, the projection a 2-D Gemm
    of the flattened rows (alpha and beta 1, A not transposed, B either way, C absent or a bias);
    binds heads, merge_target, out_weight, out_bias (None when absent), unflat_target, and the
    Reshapes as `merge` and `unflat`, the Gemm as `out_gemm`."""
    merged = op.Reshape(op.Transpose(Var("heads"), perm=SEQ_FIRST_MERGE_PERM), Var("merge_target"), _name="merge")
    unit = lambda v: v is None or float(v) == 1.0  # noqa: E731
    proj = op.Gemm(merged, Var("out_weight"), ANY, _name="out_gemm", alpha=unit, beta=unit,
                   transA=lambda v: v is None or int(v) == 0)
    return op.Transpose(op.Reshape(proj, Var("unflat_target"), _name="unflat"), perm=SEQ_FIRST_PERM)


# Where(IsNaN(p), zero, p), matched from p
NAN_GUARD = rules.Rule("nan-to-zero", op.Where(op.IsNaN(Var("p"), _name="isnan"), Var("zero"), Var("p"), _name="where"))


def nan_to_zero_guard(graph, probs):
    """The NaN-to-zero guard the exporters write after an attention's Softmax (transformers'
    eager attention with a -inf padding or causal mask: a query row whose keys are all masked
    gets probabilities 0 instead of Softmax's NaN): Where(IsNaN(p), 0, p) with p = `probs` read
    by that IsNaN and that Where alone, the IsNaN's output by the Where alone, and 0 a float32
    constant of one element, +0. Returns (IsNaN node, Where node), else None.

    Shape-preserving: the Where's output has p's shape (its other operands are a same-shape mask
    and a one-element constant), so the guarded probabilities replace p element for element."""
    if not gu.is_private(graph, probs, readers=2):
        return None
    found = rules.match_after([NAN_GUARD], graph, probs, "p", depth=1)
    if found is None:
        return None
    isnan, where = found[1]["isnan"], found[1]["where"]
    zero = gu.constant_value(where.inputs[1]) if gu.is_constant(where.inputs[1]) else None
    if zero is None or zero.size != 1 or zero.dtype != np.float32 or zero.ndim > 4:
        return None
    z = zero.reshape(())
    if z != 0.0 or np.signbit(z):
        return None
    return isnan, where
