"""llama_large: a LLaMA-style decoder of any size, weights in an external data file.

Not part of the zoo (the files are gigabytes): a generator for the large-model benchmark
(bench/large_model.py) and for trying onnxfuse on models over protobuf's 2 GiB limit.

The graph is the decomposed form exporters write for LLaMA at opset 17, batch 1 and a static
sequence length:

- token embedding Gather;
- per layer: RMSNorm written out (Mul x*x, ReduceMean, Add eps, Sqrt, Div, Mul by the gain),
  Q/K/V projection MatMuls, per-head Reshape + Transpose, rotary embedding (q*cos +
  rotate_half(q)*sin, rotate_half = Concat(-x2, x1) of a Split), causal attention (MatMul,
  Mul by 1/sqrt(head_dim), Add of the additive mask, Softmax, MatMul), output projection,
  residual Add; RMSNorm, the SwiGLU MLP (gate and up MatMuls, gate*Sigmoid(gate)*up, down
  MatMul), residual Add;
- final RMSNorm and an untied LM head MatMul.

Weights are seeded standard normal * 0.02 (float32), written to `<OUT>.data` one tensor at a
time (each 4 KiB-aligned), so generating a 6 GB model needs little memory. Presets:

    python models/llama_large.py --preset 0.5gb /tmp/llama/llama_0.5gb.onnx
    python models/llama_large.py --preset 2.5gb /tmp/llama/llama_2.5gb.onnx
    python models/llama_large.py --preset 6gb /tmp/llama/llama_6gb.onnx

All presets have 8 layers (the same node count), so they differ only in bytes. The 6gb preset's
embedding and LM head are 2 GiB each (vocabulary 262144 x 2048 float32), so single tensors are at
protobuf's limit as well.
"""
from __future__ import annotations

import os
from pathlib import Path

import click
import numpy as np
import onnx
from onnx import TensorProto, helper

PRESETS = {
    "tiny": dict(hidden=64, ffn=176, vocab=512, layers=2, heads=4),
    "0.5gb": dict(hidden=1024, ffn=2816, vocab=16000, layers=8, heads=16),
    "2.5gb": dict(hidden=2048, ffn=5632, vocab=56000, layers=8, heads=16),
    "6gb": dict(hidden=2048, ffn=5632, vocab=262144, layers=8, heads=16),
}
SEQ = 16
SEED = 20251125
ALIGN = 4096
CHUNK_ELEMENTS = 1 << 24  # 64 MB of float32 per generated chunk
EPS = 1e-5
OPSET = 17


def weight_bytes(hidden: int, ffn: int, vocab: int, layers: int, heads: int) -> int:
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
    return 4 * (2 * vocab * hidden + layers * per_layer + hidden)


class Writer:
    """Graph nodes, small inline constants, and large weights streamed to the data file."""

    def __init__(self, data_path: Path, seed: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.data = open(data_path, "wb")
        self.location = data_path.name
        self.offset = 0
        self.seed = seed
        self.count = 0

    def node(self, op: str, inputs: list[str], attrs: dict | None = None, outputs: int = 1) -> list[str] | str:
        self.count += 1
        outs = [f"{op.lower()}_{self.count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=f"{op}_{self.count}", **(attrs or {})))
        return outs if outputs > 1 else outs[0]

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(onnx.numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, shape: tuple[int, ...], scale: float = 0.02, fill: float | None = None) -> str:
        """A float32 weight written to the data file in chunks (seeded per tensor)."""
        count = int(np.prod(shape))
        pad = (-self.offset) % ALIGN
        self.data.write(b"\0" * pad)
        self.offset += pad
        rng = np.random.default_rng([self.seed, len(self.initializers)])
        left = count
        while left:
            n = min(left, CHUNK_ELEMENTS)
            if fill is None:
                chunk = rng.standard_normal(n, dtype=np.float32)
                chunk *= np.float32(scale)
            else:
                chunk = np.full(n, fill, np.float32)
            self.data.write(chunk.tobytes())
            left -= n
        t = TensorProto()
        t.name = name
        t.data_type = TensorProto.FLOAT
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(self.offset)), ("length", str(count * 4))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        self.offset += count * 4
        self.initializers.append(t)
        return name


def rms_norm(w: Writer, x: str, hidden: int, name: str) -> str:
    squared = w.node("Mul", [x, x])
    mean = w.node("ReduceMean", [squared], {"axes": [-1], "keepdims": 1})
    shifted = w.node("Add", [mean, w.const(f"{name}.eps", np.array(EPS, np.float32))])
    root = w.node("Sqrt", [shifted])
    normed = w.node("Div", [x, root])
    return w.node("Mul", [normed, w.weight(f"{name}.weight", (hidden,), fill=1.0)])


def rotary(w: Writer, x: str, cos: str, sin: str, half: str) -> str:
    first, second = w.node("Split", [x, half], {"axis": -1}, outputs=2)
    rotated = w.node("Concat", [w.node("Neg", [second]), first], {"axis": -1})
    return w.node("Add", [w.node("Mul", [x, cos]), w.node("Mul", [rotated, sin])])


def build(out: Path, hidden: int, ffn: int, vocab: int, layers: int, heads: int, seq: int = SEQ,
          seed: int = SEED) -> list[Path]:
    """Write the model to `out` and its weights to `out`.data; returns both paths."""
    head_dim = hidden // heads
    data_path = out.with_name(out.name + ".data")
    w = Writer(data_path, seed)
    try:
        x = w.node("Gather", [w.weight("embed_tokens.weight", (vocab, hidden)), "input_ids"], {"axis": 0})
        inv = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        angles = np.outer(np.arange(seq, dtype=np.float64), inv)
        angles = np.concatenate([angles, angles], axis=-1)
        cos = w.const("rope.cos", np.cos(angles).astype(np.float32))
        sin = w.const("rope.sin", np.sin(angles).astype(np.float32))
        half = w.const("rope.split", np.array([head_dim // 2, head_dim // 2], np.int64))
        mask = np.triu(np.full((seq, seq), -1e9, np.float32), k=1).reshape(1, 1, seq, seq)
        mask_name = w.const("causal_mask", mask)
        heads_shape = w.const("heads_shape", np.array([1, seq, heads, head_dim], np.int64))
        hidden_shape = w.const("hidden_shape", np.array([1, seq, hidden], np.int64))
        scale = w.const("attn_scale", np.array(1.0 / np.sqrt(head_dim), np.float32))
        for i in range(layers):
            p = f"layers.{i}"
            h = rms_norm(w, x, hidden, f"{p}.input_layernorm")
            projected = []
            for proj in ("q", "k", "v"):
                y = w.node("MatMul", [h, w.weight(f"{p}.self_attn.{proj}_proj.weight", (hidden, hidden))])
                y = w.node("Reshape", [y, heads_shape])
                projected.append(w.node("Transpose", [y], {"perm": [0, 2, 1, 3]}))
            q, k, v = projected
            q, k = rotary(w, q, cos, sin, half), rotary(w, k, cos, sin, half)
            scores = w.node("MatMul", [q, w.node("Transpose", [k], {"perm": [0, 1, 3, 2]})])
            scores = w.node("Add", [w.node("Mul", [scores, scale]), mask_name])
            attn = w.node("MatMul", [w.node("Softmax", [scores], {"axis": -1}), v])
            attn = w.node("Reshape", [w.node("Transpose", [attn], {"perm": [0, 2, 1, 3]}), hidden_shape])
            attn = w.node("MatMul", [attn, w.weight(f"{p}.self_attn.o_proj.weight", (hidden, hidden))])
            x = w.node("Add", [x, attn])
            h = rms_norm(w, x, hidden, f"{p}.post_attention_layernorm")
            gate = w.node("MatMul", [h, w.weight(f"{p}.mlp.gate_proj.weight", (hidden, ffn))])
            up = w.node("MatMul", [h, w.weight(f"{p}.mlp.up_proj.weight", (hidden, ffn))])
            act = w.node("Mul", [w.node("Mul", [gate, w.node("Sigmoid", [gate])]), up])
            down = w.node("MatMul", [act, w.weight(f"{p}.mlp.down_proj.weight", (ffn, hidden))])
            x = w.node("Add", [x, down])
        x = rms_norm(w, x, hidden, "norm")
        w.nodes.append(helper.make_node("MatMul", [x, w.weight("lm_head.weight", (hidden, vocab))], ["logits"],
                                        name="lm_head"))
    finally:
        w.data.close()
    graph = helper.make_graph(
        w.nodes, "llama_large",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, seq, vocab])],
        w.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="llama_large")
    model.ir_version = 8
    with open(out, "wb") as f:
        f.write(model.SerializeToString())
    return [out, data_path]


def _size_options(f):
    for key in ("heads", "layers", "vocab", "ffn", "hidden"):
        f = click.option(f"--{key}", type=int, default=None, help=f"override the preset's {key}")(f)
    return f


@click.command(help=__doc__.splitlines()[0] + "\n\nOUT: the model file to write (its weights go to OUT.data).")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="0.5gb", show_default=True)
@_size_options
@click.option("--seq", type=int, default=SEQ, show_default=True)
@click.option("--seed", type=int, default=SEED, show_default=True)
def main(out: Path, preset: str, seq: int, seed: int, **overrides) -> None:
    sizes = dict(PRESETS[preset])
    sizes.update({key: value for key, value in overrides.items() if value is not None})
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = build(out, seq=seq, seed=seed, **sizes)
    total = sum(os.path.getsize(p) for p in paths)
    click.echo(f"{out}: {total / 1e9:.2f} GB ({', '.join(f'{k} {v}' for k, v in sizes.items())}, seq {seq})")


if __name__ == "__main__":
    main()
