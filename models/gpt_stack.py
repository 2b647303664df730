"""gpt_stack: a GPT-style decoder, 4 blocks, d_model 128, 4 heads, dynamic batch and sequence.

The graph is what torch.onnx.export (opset 17, dynamic axes `batch` and `seq`) writes for a
nanoGPT-style model:

- token embedding Gather + position embedding Gather of Range(0, seq), seq read at run time
  (Shape -> Gather);
- per block: LayerNormalization (the single op torch writes at opset 17, not the decomposed
  ReduceMean/Sub/Pow/Sqrt/Div form), QKV projection MatMul + Add split three ways (Split),
  per-head `view(B, T, nh, hs).transpose(1, 2)` whose Reshape target is built at run time
  from Shape -> Gather -> Unsqueeze -> Concat chains, causal attention (MatMul, Div by
  sqrt(hs), Add of the sliced additive mask `mask[:, :, :T, :T]`, Softmax, MatMul), output
  projection, the written-out tanh GELU 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))) in the
  MLP (hidden 4 * d_model), residual Adds;
- final LayerNormalization and the LM head tied to the token embedding.

To keep the file under 2 MB the four blocks share their weight matrices (cross-layer sharing
as in ALBERT: each block's MatMuls read the same initializers); biases and LayerNorm
parameters are per block, so the blocks still compute different functions.

Regenerate: python models/gpt_stack.py   (deterministic: seeded numpy)
"""
from __future__ import annotations

import math

import numpy as np

from onnxfuse.models._build import FLOAT, INT64, GraphBuilder, run_main, tensor

NAME = "gpt_stack"
VOCAB = 256  # byte-level
D_MODEL = 128
HEADS = 4
HEAD_DIM = D_MODEL // HEADS
BLOCKS = 4
MLP = 4 * D_MODEL
MAX_SEQ = 64
SEED = 20240602


def build():
    b = GraphBuilder(SEED)
    std = 1.0 / math.sqrt(D_MODEL)
    residual_std = std / math.sqrt(2 * BLOCKS)  # GPT-2's scaled init of the residual projections
    wte = b.normal((VOCAB, D_MODEL), 0.1)
    wte_name = b.weight("transformer.wte.weight", wte)
    wpe = b.weight("transformer.wpe.weight", b.normal((MAX_SEQ, D_MODEL), 0.05))
    shared = dict(
        qkv=b.weight("transformer.h.attn.c_attn.weight", b.normal((D_MODEL, 3 * D_MODEL), std)),
        proj=b.weight("transformer.h.attn.c_proj.weight", b.normal((D_MODEL, D_MODEL), residual_std)),
        fc=b.weight("transformer.h.mlp.c_fc.weight", b.normal((D_MODEL, MLP), std)),
        fc_proj=b.weight("transformer.h.mlp.c_proj.weight", b.normal((MLP, D_MODEL), 1.0 / math.sqrt(MLP) / math.sqrt(2 * BLOCKS))),
    )
    causal = np.triu(np.full((MAX_SEQ, MAX_SEQ), -1e9, dtype=np.float32), k=1)[None, None]
    mask = b.weight("transformer.mask", causal)

    def layer_norm(x, prefix, scope):
        gamma = b.weight(f"{prefix}.weight", (1.0 + b.normal((D_MODEL,), 0.05)).astype(np.float32))
        beta = b.weight(f"{prefix}.bias", b.normal((D_MODEL,), 0.02))
        return b.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=1e-5, name=f"{scope}/LayerNormalization")

    def linear(x, weight, bias_name, width, scope):
        bias = b.weight(bias_name, b.normal((width,), 0.02))
        y = b.op("MatMul", [x, weight], name=f"{scope}/MatMul")
        return b.op("Add", [y, bias], name=f"{scope}/Add")

    def unsqueeze(scalar, scope, k):
        return b.op("Unsqueeze", [scalar, b.const([0])], name=f"{scope}/Unsqueeze_{k}")

    # idx.size() -> Shape, Gather; pos = arange(0, t)
    t = b.op("Gather", [b.op("Shape", ["input_ids"], name="/Shape"), b.const(1)], axis=0, name="/Gather")
    pos = b.op("Range", [b.const(0), t, b.const(1)], name="/Range")
    tok_emb = b.op("Gather", [wte_name, "input_ids"], name="/transformer/wte/Gather")
    pos_emb = b.op("Gather", [wpe, pos], name="/transformer/wpe/Gather")
    x = b.op("Add", [tok_emb, pos_emb], name="/transformer/Add")

    for i in range(BLOCKS):
        blk = f"/transformer/h.{i}"
        p = f"transformer.h.{i}"
        # ---- attention: x = x + attn(ln_1(x))
        h = layer_norm(x, f"{p}.ln_1", f"{blk}/ln_1")
        a = f"{blk}/attn"
        shape = b.op("Shape", [h], name=f"{a}/Shape")  # B, T, C = x.size()
        batch = b.op("Gather", [shape, b.const(0)], axis=0, name=f"{a}/Gather")
        seq = b.op("Gather", [shape, b.const(1)], axis=0, name=f"{a}/Gather_1")
        width = b.op("Gather", [shape, b.const(2)], axis=0, name=f"{a}/Gather_2")
        qkv = linear(h, shared["qkv"], f"{p}.attn.c_attn.bias", 3 * D_MODEL, f"{a}/c_attn")
        q, k, v = b.op("Split", [qkv, b.const([D_MODEL] * 3)], n_out=3, axis=2, name=f"{a}/Split")
        heads = {}
        for n, (name, tensor_, perm) in enumerate((("k", k, [0, 2, 3, 1]), ("q", q, [0, 2, 1, 3]), ("v", v, [0, 2, 1, 3]))):
            # view(B, T, nh, hs): the target shape is assembled at run time from the scalars.
            target = b.op(
                "Concat",
                [unsqueeze(batch, a, 2 * n), unsqueeze(seq, a, 2 * n + 1), b.const([HEADS]), b.const([HEAD_DIM])],
                axis=0,
                name=f"{a}/Concat_{n}",
            )
            viewed = b.op("Reshape", [tensor_, target], name=f"{a}/Reshape_{n}")
            # k: transpose(1, 2) then transpose(-2, -1), which the exporter folds into one Transpose.
            heads[name] = b.op("Transpose", [viewed], perm=perm, name=f"{a}/Transpose_{n}")
        att = b.op("MatMul", [heads["q"], heads["k"]], name=f"{a}/MatMul")
        att = b.op("Div", [att, b.const(math.sqrt(HEAD_DIM), np.float32)], name=f"{a}/Div")
        # mask[:, :, :T, :T]
        ends = b.op("Concat", [unsqueeze(seq, a, 6), unsqueeze(seq, a, 7)], axis=0, name=f"{a}/Concat_3")
        sliced = b.op("Slice", [mask, b.const([0, 0]), ends, b.const([2, 3]), b.const([1, 1])], name=f"{a}/Slice")
        att = b.op("Add", [att, sliced], name=f"{a}/Add")
        att = b.op("Softmax", [att], axis=-1, name=f"{a}/Softmax")
        y = b.op("MatMul", [att, heads["v"]], name=f"{a}/MatMul_1")
        y = b.op("Transpose", [y], perm=[0, 2, 1, 3], name=f"{a}/Transpose_3")
        target = b.op(
            "Concat",
            [unsqueeze(batch, a, 8), unsqueeze(seq, a, 9), unsqueeze(width, a, 10)],
            axis=0,
            name=f"{a}/Concat_4",
        )
        y = b.op("Reshape", [y, target], name=f"{a}/Reshape_3")
        y = linear(y, shared["proj"], f"{p}.attn.c_proj.bias", D_MODEL, f"{a}/c_proj")
        x = b.op("Add", [x, y], name=f"{blk}/Add")
        # ---- MLP: x = x + mlp(ln_2(x))
        h = layer_norm(x, f"{p}.ln_2", f"{blk}/ln_2")
        m = f"{blk}/mlp"
        h = linear(h, shared["fc"], f"{p}.mlp.c_fc.bias", MLP, f"{m}/c_fc")
        half = b.op("Mul", [h, b.const(0.5, np.float32)], name=f"{m}/Mul")
        cube = b.op("Pow", [h, b.const(3.0, np.float32)], name=f"{m}/Pow")
        inner = b.op("Mul", [cube, b.const(0.044715, np.float32)], name=f"{m}/Mul_1")
        inner = b.op("Add", [h, inner], name=f"{m}/Add")
        inner = b.op("Mul", [inner, b.const(math.sqrt(2.0 / math.pi), np.float32)], name=f"{m}/Mul_2")
        inner = b.op("Tanh", [inner], name=f"{m}/Tanh")
        inner = b.op("Add", [inner, b.const(1.0, np.float32)], name=f"{m}/Add_1")
        h = b.op("Mul", [half, inner], name=f"{m}/Mul_3")
        h = linear(h, shared["fc_proj"], f"{p}.mlp.c_proj.bias", D_MODEL, f"{m}/c_proj")
        x = b.op("Add", [x, h], name=f"{blk}/Add_1")

    x = layer_norm(x, "transformer.ln_f", "/transformer/ln_f")
    head = b.weight("lm_head.weight_t", np.ascontiguousarray(wte.T))  # tied, transpose folded
    b.op("MatMul", [x, head], name="/lm_head/MatMul", outputs=["logits"])

    inputs = [tensor("input_ids", INT64, ["batch", "seq"])]
    outputs = [tensor("logits", FLOAT, ["batch", "seq", VOCAB])]
    return b.model(NAME, inputs, outputs, doc=__doc__.strip().splitlines()[0])


if __name__ == "__main__":
    run_main(build, NAME)
