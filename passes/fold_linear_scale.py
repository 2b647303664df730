"""Fold a per-channel constant scale after a linear layer into the layer's weight and bias.

fold-linear-scale
    match:     Mul(s, [Transpose](MatMul(x, W) [+ b])): a constant scale of a MatMul's output,
               its bias Add and a Transpose in between optional (ConvNeXt's layer scale
               `gamma * permute(linear(x))`: both torch.onnx exporters write the permute
               first, then the Mul by gamma of shape [C, 1, 1]); every intermediate read
               inside the match only.
    condition: W a 2-D float constant [K, N]; b, when present, a constant of N elements along
               the last axis (linear.row_bias); s a constant of W's dtype that, carried back
               through the Transpose onto the MatMul's output axes, varies along the last
               axis only (N or 1 there, 1 elsewhere) and broadcasts to no wider a shape than
               the Mul's other operand (the output shape is unchanged); every scale finite
               and nonzero, and no scaled weight or bias overflowing the type.
    rewrite:   MatMul(x, W * s), b * s; the Mul goes and the node before it writes its output.
               Products are taken in float64 and rounded once to W's dtype.
Why: onnxruntime folds constants only where every input of a node is constant; a Mul of a
computed tensor by a constant stays a kernel of its own (18 in ConvNeXt-T, one per block).
The scaled weight is the layer a trained model would have had without the separate gamma.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.linear import FLOAT_KINDS, row_bias, write_output_of
from onnxfuse.graph.rules import Match, Rule, Var, apply, op
from onnxfuse.pipeline import Context, Pass

x, w, b, s = Var("x"), Var("w"), Var("b"), Var("s")
_LINEAR = op.MatMul(x, w, _name="matmul")
_BIASED = op.Add(_LINEAR, b, _name="bias")


def _scaled(inner) -> object:
    return op.Mul(inner, s, _name="scale")


def _permuted(inner) -> object:
    return op.Transpose(inner, _name="perm")


PATTERNS = {
    "scale/bias/permute": _scaled(_permuted(_BIASED)),
    "scale/permute": _scaled(_permuted(_LINEAR)),
    "scale/bias": _scaled(_BIASED),
    "scale": _scaled(_LINEAR),
}


def channel_scale(scale: np.ndarray, out_rank: int, perm: list[int] | None, width: int) -> np.ndarray | None:
    """`scale` as an [width] vector over the MatMul output's last axis when multiplying the
    (permuted) output by it scales along that axis only; None otherwise."""
    if scale.ndim > out_rank:
        return None
    aligned = scale.reshape((1,) * (out_rank - scale.ndim) + scale.shape)
    if perm is not None:
        if sorted(perm) != list(range(out_rank)):
            return None
        # Output axis i of the Transpose is its input axis perm[i]: carry the scale back.
        aligned = np.transpose(aligned, np.argsort(perm))
    if any(d != 1 for d in aligned.shape[:-1]) or aligned.shape[-1] not in (1, width):
        return None
    return np.broadcast_to(aligned.reshape(-1), (width,))


def _fold(graph: gs.Graph, m: Match) -> bool:
    weight = gu.constant_value(m["w"]) if gu.is_constant(m["w"]) else None
    if weight is None or weight.ndim != 2 or weight.dtype.kind not in FLOAT_KINDS or weight.size == 0:
        return False
    width = weight.shape[1]
    out_rank = gu.rank(m["matmul"].outputs[0])
    if out_rank is None or out_rank < 2:
        return False
    scale_node = m["scale"]
    other = scale_node.inputs[0] if scale_node.inputs[1] is m["s"] else scale_node.inputs[1]
    if other is m["s"] or not gu.is_constant(m["s"]):
        return False
    scale = gu.constant_value(m["s"])
    if scale is None or scale.dtype != weight.dtype:
        return False
    perm_node = m.bindings.get("perm")
    perm = None
    if perm_node is not None:
        perm = gu.attr(perm_node, "perm")
        perm = list(perm) if perm is not None else list(range(out_rank))[::-1]
    vector = channel_scale(scale, out_rank, perm, width)
    # A zero or non-finite scale does not commute with the sum: (x W) * 0 keeps the sign of each
    # x W (and NaN for an infinite one), x (W * 0) is +0; (x W) * inf is not x (W * inf).
    if vector is None or not (np.all(np.isfinite(vector)) and np.all(vector != 0)):
        return False
    bias = None
    if "b" in m.bindings:
        if not gu.is_constant(m["b"]):
            return False
        value = gu.constant_value(m["b"])
        if value is None or value.dtype != weight.dtype:
            return False
        bias = row_bias(value, width, out_rank)
        if bias is None:
            return False
    hi = vector.astype(np.float64)
    with np.errstate(over="ignore"):
        scaled_weight = (weight.astype(np.float64) * hi).astype(weight.dtype)
        scaled_bias = None if bias is None else (bias.astype(np.float64) * hi).astype(weight.dtype)
    # A product that overflows the type would turn finite outputs into infinities.
    if not np.all(np.isfinite(scaled_weight) | ~np.isfinite(weight)) or (
            scaled_bias is not None and not np.all(np.isfinite(scaled_bias) | ~np.isfinite(bias))):
        return False
    base = m["matmul"].name or "matmul"
    m["matmul"].inputs[1] = gu.make_constant(graph, f"{base}_W_scaled", scaled_weight)
    if bias is not None:
        add = m["bias"]
        index = 0 if add.inputs[0] is m["b"] else 1
        add.inputs[index] = gu.make_constant(graph, f"{base}_B_scaled", scaled_bias)
    # The node before the Mul writes the Mul's output: readers and graph outputs keep the name.
    write_output_of(m.nodes[-2], scale_node)
    return True


RULES = [Rule(f"fold-linear-scale/{name}", pattern, _fold) for name, pattern in PATTERNS.items()]


def run(graph: gs.Graph, ctx: Context) -> int:
    if not any(gu.is_op(n, "Mul") for n in graph.nodes):
        return 0
    refresh_shapes(graph)  # the condition reads the MatMul output's rank
    return apply(graph, RULES, ctx.explainer)


PASS = Pass(
    name="fold-linear-scale",
    order=305,
    summary="fold a per-channel constant Mul after MatMul (+ bias) (+ Transpose) into the weight and bias (ConvNeXt's layer scale)",
    run=run,
)
