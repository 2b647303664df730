"""char_rnn: a 2-layer character-level LSTM language model, unrolled over 16 steps.

The graph is what torch.onnx.export (opset 17) writes for a char-rnn whose LSTM cells are
written out in Python, nn.LSTMCell style:

    gates = x @ W_ih.T + b_ih + h @ W_hh.T + b_hh      # MatMul, Add, MatMul, Add, Add
    i, f, g, o = gates.chunk(4, 1)                      # Split with a constant `split` input
    c = sigmoid(f) * c + sigmoid(i) * tanh(g)           # Sigmoid, Tanh, Mul, Mul, Add
    h = sigmoid(o) * tanh(c)                            # Sigmoid, Tanh, Mul

The embedding is one Gather of the token ids, each step reads its column with a Gather
(`emb[:, t]`), the transposed weights are constant-folded initializers, and the logits of
the next character come from the last step's top hidden state (MatMul + Add). The hidden
and cell states of both layers are inputs and outputs, as when sampling text.
Hundreds of tiny kernels per inference: the launch-bound graph onnxfuse exists for.

Regenerate: python models/char_rnn.py   (deterministic: seeded numpy)
"""
from __future__ import annotations

import numpy as np

from onnxfuse.models._build import FLOAT, INT64, GraphBuilder, run_main, tensor

NAME = "char_rnn"
VOCAB = 65  # the tiny-shakespeare character set
EMBED = 64
HIDDEN = 128
LAYERS = 2
STEPS = 16
BATCH = 1
SEED = 20240601


def build():
    b = GraphBuilder(SEED)
    # nn.Embedding initialises N(0, 1); nn.LSTMCell and nn.Linear U(-1/sqrt(fan), 1/sqrt(fan)).
    embedding = b.weight("embed.weight", b.normal((VOCAB, EMBED), 1.0))
    bound = 1.0 / np.sqrt(HIDDEN)
    cells = []
    for layer in range(LAYERS):
        fan_in = EMBED if layer == 0 else HIDDEN
        w_ih = b.uniform((4 * HIDDEN, fan_in), bound)
        w_hh = b.uniform((4 * HIDDEN, HIDDEN), bound)
        cells.append(
            dict(
                w_ih_t=b.weight(f"cells.{layer}.weight_ih_t", w_ih.T),
                b_ih=b.weight(f"cells.{layer}.bias_ih", b.uniform((4 * HIDDEN,), bound)),
                w_hh_t=b.weight(f"cells.{layer}.weight_hh_t", w_hh.T),
                b_hh=b.weight(f"cells.{layer}.bias_hh", b.uniform((4 * HIDDEN,), bound)),
            )
        )
    head_w = b.weight("head.weight_t", b.uniform((VOCAB, HIDDEN), bound).T)
    head_b = b.weight("head.bias", b.uniform((VOCAB,), bound))
    split = b.const([HIDDEN] * 4)

    emb = b.op("Gather", [embedding, "tokens"], name="/embed/Gather")  # [1, STEPS, EMBED]
    h = [f"h0.{layer}" for layer in range(LAYERS)]
    c = [f"c0.{layer}" for layer in range(LAYERS)]
    for t in range(STEPS):
        x = b.op("Gather", [emb, b.const(t)], axis=1, name=f"/step{t}/Gather")  # [1, EMBED]
        for layer, p in enumerate(cells):
            scope = f"/step{t}/cell{layer}"
            gates = b.op("MatMul", [x, p["w_ih_t"]], name=f"{scope}/MatMul")
            gates = b.op("Add", [gates, p["b_ih"]], name=f"{scope}/Add")
            hh = b.op("MatMul", [h[layer], p["w_hh_t"]], name=f"{scope}/MatMul_1")
            gates = b.op("Add", [gates, hh], name=f"{scope}/Add_1")
            gates = b.op("Add", [gates, p["b_hh"]], name=f"{scope}/Add_2")
            i, f, g, o = b.op("Split", [gates, split], n_out=4, axis=1, name=f"{scope}/Split")
            i = b.op("Sigmoid", [i], name=f"{scope}/Sigmoid")
            f = b.op("Sigmoid", [f], name=f"{scope}/Sigmoid_1")
            g = b.op("Tanh", [g], name=f"{scope}/Tanh")
            o = b.op("Sigmoid", [o], name=f"{scope}/Sigmoid_2")
            fc = b.op("Mul", [f, c[layer]], name=f"{scope}/Mul")
            ig = b.op("Mul", [i, g], name=f"{scope}/Mul_1")
            last = t == STEPS - 1
            c[layer] = b.op("Add", [fc, ig], name=f"{scope}/Add_3", outputs=[f"cn.{layer}"] if last else None)
            tc = b.op("Tanh", [c[layer]], name=f"{scope}/Tanh_1")
            h[layer] = b.op("Mul", [o, tc], name=f"{scope}/Mul_2", outputs=[f"hn.{layer}"] if last else None)
            x = h[layer]
    logits = b.op("MatMul", [x, head_w], name="/head/MatMul")
    b.op("Add", [logits, head_b], name="/head/Add", outputs=["logits"])

    inputs = [tensor("tokens", INT64, [BATCH, STEPS])]
    for layer in range(LAYERS):
        inputs += [tensor(f"h0.{layer}", FLOAT, [BATCH, HIDDEN]), tensor(f"c0.{layer}", FLOAT, [BATCH, HIDDEN])]
    outputs = [tensor("logits", FLOAT, [BATCH, VOCAB])]
    for layer in range(LAYERS):
        outputs += [tensor(f"hn.{layer}", FLOAT, [BATCH, HIDDEN]), tensor(f"cn.{layer}", FLOAT, [BATCH, HIDDEN])]
    return b.model(NAME, inputs, outputs, doc=__doc__.strip().splitlines()[0])


if __name__ == "__main__":
    run_main(build, NAME)
