"""Kernels per decoder layer of a decode step, as the slope over layer counts.

The corpus's decode steps (models/corpus/build.py: GPT-2 and LLaMA-style, hidden 64, one new
token after a past) have 2 layers, where the step's shared work (the mask helpers, position and
length arithmetic, the embedding and the final norm) weighs as much as the layers. This script
exports the same architectures at 1, 2 and 4 layers with both exporters, optimizes each (default
CPU pipeline, verified at `--past`), counts kernels per inference (onnxruntime profiler, CPU,
ORT_ENABLE_ALL, 1 thread) and reports per layer the slope (K(4) - K(2)) / 2, and the shared part
K(2) - 2 * slope, for onnxruntime alone and onnxfuse.

    # export (needs torch and transformers), then count (the onnxfuse environment)
    PYTHONPATH=. /path/to/torch-env/bin/python -m bench.decode_layers export --dir /tmp/decode_layers
    python -m bench.decode_layers count --dir /tmp/decode_layers   # bench/results/decode_layers.md
"""
from __future__ import annotations

import sys
from pathlib import Path

LAYERS = (1, 2, 4)
ARCHS = ("gpt2_decode", "llama_decode", "qwen2_decode")
EXPORTERS = ("ts", "dynamo")


def _case(arch: str, layers: int):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models" / "corpus"))
    import build

    def make():
        if arch == "gpt2_decode":
            from transformers import GPT2Config, GPT2Model

            cfg = GPT2Config(vocab_size=1000, n_embd=64, n_layer=layers, n_head=4, n_positions=512, bos_token_id=0,
                             eos_token_id=0)
            feeds, axes = build._Decoder.inputs(1000, layers, 4, 16)
            return build._Decoder.wrap(GPT2Model(cfg), layers), feeds, axes
        if arch == "qwen2_decode":  # LLaMA's layer with biases on the q, k, v projections
            from transformers import Qwen2Config, Qwen2Model

            cfg = Qwen2Config(vocab_size=1000, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
            model = Qwen2Model(cfg)
            import torch

            with torch.no_grad():  # transformers initializes biases to 0: give the packing something to add
                for layer in model.layers:
                    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                        proj.bias.normal_(0.0, 0.5)
            feeds, axes = build._Decoder.inputs(1000, layers, 2, 16)
            return build._Decoder.wrap(model, layers), feeds, axes
        from transformers import LlamaConfig, LlamaModel

        cfg = LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
        feeds, axes = build._Decoder.inputs(1000, layers, 2, 16)
        return build._Decoder.wrap(LlamaModel(cfg), layers), feeds, axes

    return build, build.Case(arch, "transformer", f"{arch}, {layers} layers", make, build._Decoder.outputs(layers))


def export(out_dir: Path, archs=ARCHS) -> None:
    import onnx

    out_dir.mkdir(parents=True, exist_ok=True)
    for arch in archs:
        for layers in LAYERS:
            build, case = _case(arch, layers)
            for exporter in EXPORTERS:
                model, axes = build.export(case, exporter)
                build._rename_dims(model, axes)
                build._drop_debug_metadata(model)
                onnx.save(model, str(out_dir / f"{arch}_{exporter}_{layers}.onnx"))
                print(f"{arch}_{exporter}_{layers}", file=sys.stderr)


def count(out_dir: Path, past: int, out: Path | None, archs=ARCHS) -> None:
    import onnx

    from bench import harness
    from onnxfuse.api import optimize
    from onnxfuse.profile import count_kernels

    dims = {"batch": 1, "past": past, "total": past + 1}
    rows = []
    for arch in archs:
        for exporter in EXPORTERS:
            k = {}
            for layers in LAYERS:
                m = onnx.load(str(out_dir / f"{arch}_{exporter}_{layers}.onnx"))
                opt = optimize(m, dims=dims, threads=1, count_kernels=False).model
                k[layers] = (count_kernels(m, threads=1, dims=dims)[0], count_kernels(opt, threads=1, dims=dims)[0])
                harness.log(f"{arch}_{exporter} {layers} layers: ort {k[layers][0]}, onnxfuse {k[layers][1]}")
            slope = [(k[4][i] - k[2][i]) / 2 for i in (0, 1)]
            shared = [k[2][i] - 2 * slope[i] for i in (0, 1)]
            rows.append(f"| {arch}_{exporter} | " + " | ".join(f"{k[n][0]} / {k[n][1]}" for n in LAYERS)
                        + f" | {slope[0]:g} | {slope[1]:g} | {shared[0]:g} | {shared[1]:g} |")
    text = "\n".join([
        "# Kernels per decoder layer of a decode step: the slope over layer counts", "",
        f"Command: `python -m bench.decode_layers count` (models exported at 1, 2 and 4 layers by "
        f"`bench.decode_layers export`, the corpus's configs otherwise). {harness.versions()}", "",
        f"Kernels per inference at batch 1, past {past} (one new token): onnxruntime's profiler, CPU provider, "
        "ORT_ENABLE_ALL, 1 thread; onnxfuse = the default CPU pipeline, verified at those dims. Per layer = "
        "(K(4 layers) - K(2 layers)) / 2: what each further layer adds; shared = K(2) - 2 x per layer: the "
        "step's mask, position and length arithmetic, embedding and final norm, paid once per step.", "",
        "| model | 1 layer: ort / onnxfuse | 2 layers | 4 layers | ort per layer | onnxfuse per layer "
        "| ort shared | onnxfuse shared |",
        "|---|---|---|---|---:|---:|---:|---:|",
        *rows, ""])
    harness.write_report(out, text)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("export", "count"))
    p.add_argument("--dir", type=Path, default=Path("/tmp/decode_layers"))
    p.add_argument("--past", type=int, default=128)
    p.add_argument("--archs", default=",".join(ARCHS), help="comma-separated, of: " + ", ".join(ARCHS))
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "decode_layers.md")
    args = p.parse_args(argv)
    archs = tuple(a for a in args.archs.split(",") if a)
    if any(a not in ARCHS for a in archs):
        p.error(f"--archs: each of {', '.join(ARCHS)}")
    if args.mode == "export":
        export(args.dir, archs)
    else:
        count(args.dir, args.past, args.out, archs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
