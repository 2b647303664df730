"""A GPT-2-small-sized decoder for timing `optimize` on a model of realistic size.

The graph is the zoo's gpt_stack (models/gpt_stack.py: what torch.onnx.export writes for a
nanoGPT-style model at opset 17) at GPT-2 small's sizes: 12 blocks, d_model 768, 12 heads,
MLP 3072, vocabulary 50257, 1024 positions. gpt_stack shares one set of block matrices between
its blocks to keep the committed file small; here every block gets its own matrices, so the
model holds GPT-2 small's ~124M parameters (~500 MB) and the optimizer copies and rewrites
a model of that size. The file is generated on demand (into a temporary directory by
`python -m bench.compare`), never committed.

    python -m bench.gpt2_small --out /tmp/gpt2_small.onnx
"""
from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager
from pathlib import Path

import click
import numpy as np
import onnx
from onnx import numpy_helper

from bench import harness

GPT2_SMALL = dict(blocks=12, d_model=768, heads=12, vocab=50257, max_seq=1024)
SEED = 20240603
# The block matrices gpt_stack shares between its blocks (initializer names in gpt_stack.py).
SHARED_BLOCK_WEIGHTS = (
    "transformer.h.attn.c_attn.weight",
    "transformer.h.attn.c_proj.weight",
    "transformer.h.mlp.c_fc.weight",
    "transformer.h.mlp.c_proj.weight",
)


def _gpt_stack_module():
    return importlib.import_module("onnxfuse.models.gpt_stack")


@contextmanager
def _sizes(module, blocks: int, d_model: int, heads: int, vocab: int, max_seq: int):
    """gpt_stack.build() reads its sizes from module constants: set them for one build."""
    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
    wanted = dict(BLOCKS=blocks, D_MODEL=d_model, HEADS=heads, HEAD_DIM=d_model // heads, MLP=4 * d_model,
                  VOCAB=vocab, MAX_SEQ=max_seq)
    missing = [k for k in wanted if not hasattr(module, k)]
    if missing:
        raise RuntimeError(f"models/gpt_stack.py no longer defines {', '.join(missing)}; update bench/gpt2_small.py")
    saved = {k: getattr(module, k) for k in wanted}
    for k, v in wanted.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def _unshare_block_weights(model: onnx.ModelProto, blocks: int, seed: int) -> None:
    """Give each block its own copy of the shared matrices: same shape and scale, new values."""
    rng = np.random.default_rng(seed)
    inits = {t.name: t for t in model.graph.initializer}
    shared = {name: numpy_helper.to_array(inits[name]) for name in SHARED_BLOCK_WEIGHTS if name in inits}
    if len(shared) != len(SHARED_BLOCK_WEIGHTS):
        raise RuntimeError("models/gpt_stack.py no longer names its shared block matrices as bench/gpt2_small.py expects")
    std = {name: float(a.std()) for name, a in shared.items()}
    for node in model.graph.node:
        block = node.name.split("/")[2] if node.name.startswith("/transformer/h.") else None
        for k, name in enumerate(node.input):
            if name in shared and block is not None:
                own = name.replace("transformer.h.", f"transformer.{block}.")
                if own not in inits:
                    values = (rng.standard_normal(shared[name].shape) * std[name]).astype(np.float32)
                    inits[own] = numpy_helper.from_array(values, own)
                    model.graph.initializer.append(inits[own])
                node.input[k] = own
    used = {i for n in model.graph.node for i in n.input}
    keep = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


def build(blocks: int = 12, d_model: int = 768, heads: int = 12, vocab: int = 50257, max_seq: int = 1024,
          seed: int = SEED) -> onnx.ModelProto:
    """gpt_stack's graph at the given sizes, with per-block weights."""
    module = _gpt_stack_module()
    with _sizes(module, blocks, d_model, heads, vocab, max_seq):
        model = module.build()
    _unshare_block_weights(model, blocks, seed)
    model.graph.name = "gpt2_small" if (blocks, d_model, heads, vocab, max_seq) == tuple(GPT2_SMALL.values()) else \
        f"gpt_{blocks}x{d_model}"
    return model


def write(path: str | Path, **sizes) -> Path:
    path = Path(path)
    onnx.save(build(**sizes), str(path))
    return path


def parameters(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer)


@click.command(help="Write a GPT-2-small-sized decoder (gpt_stack's graph, per-block weights).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="output model path")
@click.option("--blocks", type=int, default=GPT2_SMALL["blocks"], show_default=True)
@click.option("--d-model", type=int, default=GPT2_SMALL["d_model"], show_default=True)
@click.option("--heads", type=int, default=GPT2_SMALL["heads"], show_default=True)
def cli(out: Path, blocks: int, d_model: int, heads: int) -> int:
    model = build(blocks=blocks, d_model=d_model, heads=heads)
    onnx.save(model, str(out))
    harness.log(f"wrote {out}: {len(model.graph.node)} nodes, {parameters(model) / 1e6:.1f}M parameters")
    return 0


main = harness.main_of(cli)


if __name__ == "__main__":
    sys.exit(main())
