"""Small transformer blocks written the way the torch.onnx exporters write them, built with
onnx.helper (no torch): the forms the onnxscript-fusions stage and the passes after it meet."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Builder:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, shape, scale: float) -> str:
        return self.const(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def node(self, op: str, inputs, output: str, domain: str = "", **attrs) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=f"{output}_node", domain=domain, **attrs))
        return output

    def model(self, inputs, outputs, opsets=(("", 18),)) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "block", inputs, outputs, self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=9)
        onnx.checker.check_model(m)
        return m


def encoder_block(mask: bool = True, batch: int = 2, seq: int = 8, hidden: int = 16, heads: int = 2,
                  seed: int = 0, torchscript: bool = False) -> onnx.ModelProto:
    """One BERT encoder layer's attention half as both exporters write it: q, k, v projections
    (MatMul + bias Add), heads split by Reshape + Transpose, k transposed on its last two axes,
    q and kT each scaled by sqrt(1/sqrt(dh)), an additive mask Where(attention_mask, 0, -inf),
    Softmax, the NaN-to-zero Where of a fully masked row, the weighted sum of v, heads merged, the
    output projection, the residual Add and LayerNormalization.

    torchscript: the TorchScript exporter's spelling: k transposed once by perm [0, 2, 3, 1],
    the scale and the NaN-to-zero Where's 0 as one-element 1-D constants, and a Reshape of the
    attention's MatMul output to the [B, H, S, dv] it already has."""
    b = _Builder(seed)
    dh = hidden // heads
    heads_shape = b.const("heads_shape", np.array([batch, seq, heads, dh], np.int64))
    merged_shape = b.const("merged_shape", np.array([batch, seq, hidden], np.int64))
    scalar_shape = (1,) if torchscript else ()
    scale = b.const("sqrt_scale", np.full(scalar_shape, float(dh) ** -0.25, np.float32))
    proj = {}
    for p in "qkv":
        mm = b.node("MatMul", ["x", b.weight(f"w{p}", (hidden, hidden), 0.3)], f"{p}_mm")
        lin = b.node("Add", [mm, b.weight(f"b{p}", (hidden,), 0.1)], f"{p}_lin")
        split = b.node("Reshape", [lin, heads_shape], f"{p}_split")
        if p == "k" and torchscript:
            proj[p] = split
            continue
        proj[p] = b.node("Transpose", [split], f"{p}_heads", perm=[0, 2, 1, 3])
    if torchscript:
        kt = b.node("Transpose", [proj["k"]], "k_t", perm=[0, 2, 3, 1])
    else:
        kt = b.node("Transpose", [proj["k"]], "k_t", perm=[0, 1, 3, 2])
    scores = b.node("MatMul", [b.node("Mul", [proj["q"], scale], "q_scaled"), b.node("Mul", [kt, scale], "k_scaled")],
                    "scores")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, hidden])]
    if mask:
        inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.BOOL, [batch, 1, 1, seq]))
        bias = b.node("Where", ["attention_mask", b.const("zero", np.zeros(scalar_shape, np.float32)),
                                b.const("minus_inf", np.array(-np.inf, np.float32))], "mask_bias")
        scores = b.node("Add", [scores, bias], "masked_scores")
    probs = b.node("Softmax", [scores], "probs", axis=-1)
    if mask:
        probs = b.node("Where", [b.node("IsNaN", [probs], "probs_nan"), "zero", probs], "probs_finite")
    ctx = b.node("MatMul", [probs, proj["v"]], "context")
    if torchscript:
        ctx = b.node("Reshape", [ctx, b.const("context_shape", np.array([batch, heads, seq, dh], np.int64))],
                     "context_view")
    merged = b.node("Reshape", [b.node("Transpose", [ctx], "context_t", perm=[0, 2, 1, 3]), merged_shape], "merged")
    out = b.node("Add", [b.node("MatMul", [merged, b.weight("wo", (hidden, hidden), 0.3)], "o_mm"),
                         b.weight("bo", (hidden,), 0.1)], "o_lin")
    residual = b.node("Add", ["x", out], "residual")
    gamma = b.const("gamma", (1 + 0.1 * b.rng.standard_normal(hidden)).astype(np.float32))
    beta = b.weight("beta", (hidden,), 0.1)
    b.node("LayerNormalization", [residual, gamma, beta], "y", axis=-1, epsilon=1e-5)
    return b.model(inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, hidden])])


def contrib_block(batch: int = 2, seq: int = 8, hidden: int = 16, heads: int = 2, seed: int = 0,
                  key_bias: bool = True) -> onnx.ModelProto:
    """The stage's output form with the projections' bias Adds still separate:
    MultiHeadAttention(q + bq, k + bk, v + bv) and SkipLayerNormalization(x, o + bo, gamma, beta);
    key_bias=False: k without a bias."""
    b = _Builder(seed)
    lin = {}
    for p in "qkvo":
        src = "x" if p != "o" else "attended"
        if p == "o":
            b.node("MultiHeadAttention", [lin["q"], lin["k"], lin["v"]], "attended", domain="com.microsoft",
                   num_heads=heads)
        mm = b.node("MatMul", [src, b.weight(f"w{p}", (hidden, hidden), 0.3)], f"{p}_mm")
        if p == "k" and not key_bias:  # Whisper's k_proj has no bias
            lin[p] = mm
            continue
        lin[p] = b.node("Add", [b.weight(f"b{p}", (hidden,), 0.1), mm], f"{p}_lin")
    gamma = b.const("gamma", (1 + 0.1 * b.rng.standard_normal(hidden)).astype(np.float32))
    b.node("SkipLayerNormalization", ["x", lin["o"], gamma, b.weight("beta", (hidden,), 0.1)], "y",
           domain="com.microsoft", epsilon=1e-5)
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, hidden])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, hidden])],
                   opsets=(("", 18), ("com.microsoft", 1)))


def reshape_chain(batch: int = 2, seq: int = 4, hidden: int = 16, heads: int = 2) -> onnx.ModelProto:
    """x -> Relu -> Reshape [B, S, H, d] -> Reshape [B, S, H*d] -> Relu: the two Reshapes give
    back x's shape (what a merged attention's output goes through)."""
    b = _Builder(0)
    split = b.node("Reshape", [b.node("Relu", ["x"], "r"),
                               b.const("split_shape", np.array([0, 0, heads, hidden // heads], np.int64))], "split")
    merged = b.node("Reshape", [split, b.const("merged_shape", np.array([batch, seq, hidden], np.int64))], "merged")
    b.node("Relu", [merged], "y")
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, hidden])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, hidden])])


def rotary_block(batch: int = 2, seq: int = 8, hidden: int = 16, heads: int = 2, seed: int = 0) -> onnx.ModelProto:
    """LLaMA's rotary embedding on the query heads as a static-shape export leaves it once cos and
    sin are folded: q [B, H, S, d] * cos + rotate_half(q) * sin, rotate_half(q) =
    Concat(-q[..., d/2:], q[..., :d/2]), cos and sin constants [1, 1, S, d] (each its first half
    repeated), then the heads merged again."""
    b = _Builder(seed)
    dh = hidden // heads
    q = b.node("MatMul", ["x", b.weight("wq", (hidden, hidden), 0.3)], "q_mm")
    q = b.node("Transpose", [b.node("Reshape", [q, b.const("heads_shape", np.array([batch, seq, heads, dh], np.int64))],
                                    "q_split")], "q_heads", perm=[0, 2, 1, 3])
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
    angles = np.outer(np.arange(seq), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)[None, None]
    cos = b.const("cos", np.cos(angles).astype(np.float32))
    sin = b.const("sin", np.sin(angles).astype(np.float32))
    half = dh // 2
    first = b.node("Slice", [q, b.const("s0", np.array([0], np.int64)), b.const("s1", np.array([half], np.int64)),
                             b.const("axis", np.array([3], np.int64)), b.const("step", np.array([1], np.int64))], "q_first")
    second = b.node("Slice", [q, "s1", b.const("s2", np.array([np.iinfo(np.int64).max], np.int64)), "axis", "step"],
                    "q_second")
    rotated = b.node("Concat", [b.node("Neg", [second], "q_second_neg"), first], "q_rotated", axis=-1)
    roped = b.node("Add", [b.node("Mul", [q, cos], "q_cos"), b.node("Mul", [rotated, sin], "q_sin")], "q_rope")
    merged = b.node("Transpose", [roped], "q_merged_t", perm=[0, 2, 1, 3])
    b.node("Reshape", [merged, b.const("merged_shape", np.array([batch, seq, hidden], np.int64))], "y")
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, hidden])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, hidden])])
