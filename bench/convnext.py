"""ConvNeXt: what fold-linear-scale and residual-channels-last change, against the same pipeline
without them and against onnxruntime alone and onnxslim.

The corpus's two ConvNeXt-T exports (TorchScript and dynamo, 64x64 images), and its Whisper
encoder exports, whose query scale fold-linear-scale also folds, are run four ways, each under
onnxruntime at ORT_ENABLE_ALL on the CPU with one thread:

    ort              the original model
    onnxslim         onnxslim.slim(model) (the peer with the fewest kernels on convnext_ts before)
    onnxfuse-before  onnxfuse.api.optimize with the default CPU pipeline less the two passes
    onnxfuse         onnxfuse.api.optimize with the default CPU pipeline

For each: kernels per inference (onnxruntime's profiler) and the latency ratios, all four
sessions timed interleaved in rounds (bench.harness.interleave, rotating order, the calling
thread's CPU time), each ratio the median of the per-round ratios with its 95% bootstrap interval.

    python -m bench.convnext                     # writes bench/results/convnext.md
    python -m bench.convnext --budget 5 --out /tmp/convnext.md
"""
from __future__ import annotations

from pathlib import Path

import click

from bench import harness

MODELS = ("convnext_ts", "convnext_dynamo", "whisper_encoder_ts", "whisper_encoder_dynamo")
NEW_PASSES = ("fold-linear-scale", "residual-channels-last")
VARIANTS = ("ort", "onnxslim", "onnxfuse-before", "onnxfuse")
DEFAULT_OUT = harness.RESULTS / "convnext.md"


def variants(zm) -> dict:
    import onnxslim

    from onnxfuse import api
    from onnxfuse.pipeline import select_passes

    original = zm.load()
    before = [p.name for p in select_passes(None, "cpu") if p.name not in NEW_PASSES]
    return {
        "ort": original,
        "onnxslim": onnxslim.slim(original),
        "onnxfuse-before": api.optimize(original, passes=before, dims=zm.dims or None, threads=1, count_kernels=False).model,
        "onnxfuse": api.optimize(original, dims=zm.dims or None, threads=1, count_kernels=False).model,
    }


def bench_model(zm, budget: float) -> dict:
    from onnxfuse.inputs import random_inputs
    from onnxfuse.profile import count_kernels
    from onnxfuse.runtime import open_session

    models = variants(zm)
    feeds = random_inputs(models["ort"], zm.dims, seed=0)
    sessions = {name: open_session(m, "cpu", 1, "all")[0] for name, m in models.items()}
    samples = harness.interleave({n: harness.session_run(s, feeds) for n, s in sessions.items()},
                                 order="rotate", min_rounds=10, max_rounds=5000, budget_s=budget,
                                 warmup=5, sample_ms=3.0, cpu_clock=True)
    row = {"name": zm.name, "rounds": samples.rounds, "ort_ms": samples.median_ms("ort", "cpu"), "tools": {}}
    for name, m in models.items():
        row["tools"][name] = {"kernels": count_kernels(m, threads=1, dims=zm.dims or None)[0],
                              "vs_ort": None if name == "ort" else samples.interval("ort", name, "cpu")}
    row["after_vs_before"] = samples.interval("onnxfuse-before", "onnxfuse", "cpu")
    return row


def _ratio(c: dict | None) -> str:
    return "1" if c is None else f"{c['ratio']:.3f} [{c['low']:.3f}, {c['high']:.3f}]"


def render(rows: list[dict], stamp: harness.RunStamp, budget: float) -> str:
    lines = stamp.header("ConvNeXt: layer scale folded, residual stream kept NHWC", "onnxslim")
    lines += [
        "Models: the corpus's ConvNeXt-T exports (64x64 images) and Whisper encoder exports, at their default "
        "dims (`python models/corpus/build.py`). "
        "Kernels per inference: onnxruntime's profiler, CPU provider, ORT_ENABLE_ALL, 1 thread. "
        f"Latency: the four sessions timed interleaved (rotating order, about {budget:g} s of rounds per model), "
        "1 thread, thread CPU time; ratio = median per-round time ratio with its 95% bootstrap interval. "
        "onnxfuse-before is the default pipeline less fold-linear-scale and residual-channels-last.",
        "",
    ]
    lines += harness.table_head([("model", "l"), ("variant", "l"), ("kernels", "r"), ("latency vs ort (1t)", "r")])
    for row in rows:
        for name in VARIANTS:
            t = row["tools"][name]
            lines.append(f"| {row['name']} | {name} | {t['kernels']} | {_ratio(t['vs_ort'])} |")
    lines += ["", "onnxfuse against onnxfuse-before (same rounds):", ""]
    lines += harness.table_head([("model", "l"), ("kernels", "r"), ("latency ratio (1t)", "r"), ("ort ms", "r"),
                                 ("rounds", "r")])
    for row in rows:
        t = row["tools"]
        lines.append(f"| {row['name']} | {t['onnxfuse-before']['kernels']} -> {t['onnxfuse']['kernels']} | "
                     f"{_ratio(row['after_vs_before'])} | {row['ort_ms']:.3f} | {row['rounds']} |")
    return "\n".join(lines) + "\n"


@harness.script(__doc__)
@click.option("--models", callback=harness.csv(), default=",".join(MODELS), show_default=True)
@click.option("--budget", type=float, default=20.0, show_default=True, help="seconds of timed rounds per model")
@click.option("--out", type=click.Path(path_type=Path), default=DEFAULT_OUT, show_default=True)
def cli(args, stamp: harness.RunStamp) -> int:
    from onnxfuse import zoo

    rows = []
    for name in args.models:
        harness.log(f"{name} ...")
        rows.append(bench_model(zoo.get(name), args.budget))
    harness.write_report(args.out, render(rows, stamp, args.budget))
    return 0


main = harness.main_of(cli)

if __name__ == "__main__":
    raise SystemExit(main())
