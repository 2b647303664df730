"""Attention on architectures outside the corpus: which Softmax onnxfuse leaves, and why.

    python -m bench.architectures                 # every architecture, both exporters
    python -m bench.architectures phi3 gpt_neox   # the named ones
    python -m bench.architectures phi3 --dim seq=256 --out bench/results/architectures_seq256.md

Each architecture is built from transformers at a small configuration (hidden 64, 2 layers,
4 heads, random weights), exported by both torch.onnx exporters the way models/corpus/build.py
exports the corpus, optimized with the default CPU pipeline (verified, dims batch=2 seq=16), and
reported with its kernels per inference before and after, its latency against onnxruntime alone
(1 thread, thread CPU time, the two sessions interleaved in mirrored rounds for about
LATENCY_BUDGET_S seconds: the median per-round ratio and its 95% bootstrap interval) and
`--explain fuse-attention`'s reason for every Softmax left. The exports need torch and transformers (never in CI), in this
Python or in the one `--torch-python` names; writes bench/results/architectures.md.
"""
from __future__ import annotations

import datetime
import subprocess
import sys
import tempfile
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "models" / "corpus"))

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
# name -> (config class, model class, config fields beyond COMMON): what each exercises.
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2Model", dict(num_key_value_heads=2)),  # GQA, q/k/v biases
    "mistral": ("MistralConfig", "MistralModel", dict(num_key_value_heads=2, sliding_window=8)),  # sliding window
    "gemma": ("GemmaConfig", "GemmaModel", dict(num_key_value_heads=1, head_dim=16)),  # multi-query
    "phi3": ("Phi3Config", "Phi3Model", dict(num_key_value_heads=4, partial_rotary_factor=0.5, pad_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXModel", dict(rotary_pct=0.25)),  # partial rotary, parallel residual
    "deberta_v2": ("DebertaV2Config", "DebertaV2Model", dict(relative_attention=True, pos_att_type=["p2c", "c2p"],
                                                             max_relative_positions=32, position_buckets=16)),
}
DIMS = {"batch": 2, "seq": 16}
LATENCY_BUDGET_S = 6.0


def _case(name: str):
    import build

    cfg_cls, model_cls, extra = ARCHITECTURES[name]

    def make():
        import transformers

        cfg = getattr(transformers, cfg_cls)(vocab_size=1000, max_position_embeddings=64, **COMMON, **extra)
        ids, mask = build._ids(1000)
        model = build._Encoder.wrap(getattr(transformers, model_cls)(cfg))
        return model, {"input_ids": ids, "attention_mask": mask}, build.TEXT_AXES

    return build.Case(name, "transformer", name, make, ["last_hidden_state"])


def export(name: str, exporter: str, path: str) -> None:
    import build
    import onnx

    model, axes = build.export(_case(name), exporter)
    build._rename_dims(model, axes)
    onnx.save(model, path)


def measure(name: str, exporter: str, workdir: Path, torch_python: str, dims: dict = DIMS) -> dict:
    from onnxfuse.api import optimize

    path = workdir / f"{name}_{exporter}.onnx"
    done = subprocess.run([torch_python, "-c", "import sys; sys.path.insert(0, sys.argv[1]);"
                           " from bench.architectures import export; export(*sys.argv[2:])",
                           str(ROOT), name, exporter, str(path)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "export failed")
    result = optimize(str(path), dims=dims, threads=1)
    s = result.summary
    latency = _latency(str(path), result.model, dims)
    return {"latency": latency, "model": f"{name}_{exporter}", "kernels_before": s["kernels_before"], "kernels_after": s["kernels_after"],
            "softmax_before": s["op_types_before"].get("Softmax", 0), "softmax_left": s["softmax_left"],
            "attention_ops": {k: v for k, v in s["op_types_after"].items() if "Attention" in k},
            "reasons": sorted({" / ".join(r) for r in s["unmatched"].get("fuse-attention", {}).values()})}


def _latency(path: str, optimized, dims: dict) -> list[float]:
    """[median, low, high] of the per-round ratio onnxfuse / onnxruntime alone, 1 thread."""
    import onnx

    from bench import harness
    from onnxfuse import runtime
    from onnxfuse.inputs import random_inputs

    original = onnx.load(path)
    feeds = random_inputs(original, dims, seed=0)
    sessions = {"ort": runtime.make_session(original, threads=1, with_library=False),
                "onnxfuse": runtime.make_session(optimized, threads=1, with_library=True)}
    samples = harness.interleave({t: harness.session_run(s, feeds) for t, s in sessions.items()},
                                 order="mirror", min_rounds=10, max_rounds=2000, budget_s=LATENCY_BUDGET_S,
                                 warmup=5, sample_ms=3.0, cpu_clock=True)
    c = samples.interval("ort", "onnxfuse", "cpu")
    return [round(c["ratio"], 3), round(c["low"], 3), round(c["high"], 3)]


@click.command(help=__doc__.splitlines()[0])
@click.argument("names", nargs=-1)
@click.option("--torch-python", default=sys.executable, show_default=True,
              help="The Python that has torch and transformers, for the exports.")
@click.option("--dim", "dim_values", multiple=True, metavar="NAME=VALUE",
              help=f"Override a dim of {DIMS} (repeatable).")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="The report's path [default: bench/results/architectures.md].")
def main(names, torch_python, dim_values, out):
    dims = dict(DIMS)
    for item in dim_values:
        key, _, value = item.partition("=")
        if key not in DIMS or not value.isdigit() or int(value) < 1:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE with NAME one of {sorted(DIMS)} and VALUE >= 1",
                                     param_hint="--dim")
        dims[key] = int(value)
    import onnxruntime

    from bench import harness

    versions = subprocess.run([torch_python, "-c", "import torch, transformers;"
                               " print(torch.__version__, transformers.__version__)"],
                              capture_output=True, text=True, check=True).stdout.split()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or ARCHITECTURES:
            for exporter in ("ts", "dynamo"):
                try:
                    rows.append(measure(name, exporter, Path(tmp), torch_python, dims))
                except Exception as e:  # an export that fails is a row too
                    rows.append({"model": f"{name}_{exporter}", "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(rows[-1], flush=True)
    lines = [
        "# Attention on architectures outside the corpus",
        "",
        f"`python -m bench.architectures --torch-python PY` on {datetime.date.today()} at commit"
        f" {harness.commit_text()}: {harness.machine()},"
        f" onnxruntime {onnxruntime.__version__}, torch {versions[0]}, transformers {versions[1]};"
        f" CPU provider, ORT_ENABLE_ALL, 1 thread, dims {dims}; a machine shared with other work."
        " Kernels per inference: onnxruntime alone -> onnxfuse. Latency: onnxfuse / onnxruntime alone, thread"
        f" CPU time, interleaved (mirrored rounds, about {LATENCY_BUDGET_S:g} s a model), median per-round"
        " ratio [95% interval]. Reasons: `optimize --explain fuse-attention` for the Softmax nodes left (each round's"
        " reason, the first round's first).",
        "",
        "| model | kernels | latency | Softmax left | attention ops | why a Softmax is left |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | export failed | | | | {r['error']} |")
            continue
        ops = ", ".join(f"{k} x{v}" for k, v in r["attention_ops"].items()) or "none"
        lat = r["latency"]
        lines.append(f"| {r['model']} | {r['kernels_before']} -> {r['kernels_after']} |"
                     f" {lat[0]:.3f} [{lat[1]:.3f}, {lat[2]:.3f}] | {r['softmax_left']} of {r['softmax_before']} | {ops} | {'; '.join(r['reasons'])} |")
    out = Path(out) if out else ROOT / "bench" / "results" / "architectures.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
