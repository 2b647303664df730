"""The channel-shuffle pass on the zoo's ShuffleNets: kernels and latency against onnxruntime alone
and against the same pipeline without the pass.

    python -m bench.channel_shuffle
    python -m bench.channel_shuffle --models shufflenet_v2_dynamo --threads 1 --budget 3

Each model runs as three sessions timed interleaved (A B C C B A rounds; thread CPU time at one
thread, wall time above): the exported model under onnxruntime alone, the default CPU pipeline
without channel-shuffle, and the default pipeline. Ratios are medians of per-round ratios over
onnxruntime alone's time, with their 95% bootstrap intervals. CPU provider, ORT_ENABLE_ALL.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import click

from bench.harness import RESULTS, RunStamp, csv, interleave, kernel_names, log, main_of, script, session_run, table_head, write_report
from onnxfuse import api, zoo
from onnxfuse.inputs import random_inputs
from onnxfuse.pipeline import select_passes
from onnxfuse.profile import count_kernels, open_session

MODELS = ["shufflenet_v2_dynamo", "shufflenet_v2_ts", "shufflenet"]
PASS = "channel-shuffle"


def variants(entry) -> dict:
    """label -> model: onnxruntime alone, the pipeline without the pass, the pipeline."""
    original = entry.load()
    dims = entry.dims or None
    without = [p.name for p in select_passes(None, "cpu") if p.name != PASS]
    return {
        "onnxruntime": original,
        "without channel-shuffle": api.optimize(original, passes=without, dims=dims, count_kernels=False).model,
        "onnxfuse": api.optimize(original, dims=dims, count_kernels=False).model,
    }


@script(__doc__)
@click.option("--models", default=",".join(MODELS), callback=csv(), show_default=True)
@click.option("--threads", default="1,2", callback=csv(int), show_default=True)
@click.option("--budget", type=float, default=6.0, show_default=True, help="seconds of timed rounds per model and thread count")
@click.option("--out", type=click.Path(path_type=Path), default=RESULTS / "channel_shuffle.md", show_default=True)
def cli(args: SimpleNamespace, stamp: RunStamp) -> int:
    columns = [("model", "l"), ("threads", "r"), ("kernels: ort / without / with", "l"),
               ("ort ms", "r"), ("without / ort [95%]", "l"), ("with / ort [95%]", "l"), ("with / without", "r")]
    rows, kernels_rows = [], []
    for name in args.models:
        entry = zoo.get(name)
        models = variants(entry)
        counts = {label: count_kernels(m, threads=1, dims=entry.dims or None) for label, m in models.items()}
        kernels = " / ".join(str(c[0]) for c in counts.values())
        gone = {op: n for op, n in counts["without channel-shuffle"][1].items()
                if counts["onnxfuse"][1].get(op, 0) < n}
        came = {op: n - counts["without channel-shuffle"][1].get(op, 0) for op, n in counts["onnxfuse"][1].items()
                if n > counts["without channel-shuffle"][1].get(op, 0)}
        kernels_rows.append(f"| {name} | {kernel_names({op: n - counts['onnxfuse'][1].get(op, 0) for op, n in gone.items()})}"
                            f" | {kernel_names(came)} |")
        feeds = random_inputs(models["onnxruntime"], dims=entry.dims or None, seed=0)
        for threads in args.threads:
            sessions = {label: open_session(m, "cpu", threads, "all", with_library=label == "onnxfuse")[0]
                        for label, m in models.items()}
            samples = interleave({label: session_run(s, feeds) for label, s in sessions.items()}, order="mirror",
                                 min_rounds=15, max_rounds=2000, budget_s=args.budget, warmup=5, sample_ms=5.0,
                                 cpu_clock=threads == 1)
            clock = "cpu" if threads == 1 else "wall"
            w = samples.interval("onnxruntime", "without channel-shuffle", clock)
            f = samples.interval("onnxruntime", "onnxfuse", clock)
            pair = samples.ratio("without channel-shuffle", "onnxfuse", clock)
            rows.append(f"| {name} | {threads} | {kernels} | {w['ms_a']:.3f} | {w['ratio']:.3f} [{w['low']:.3f}, {w['high']:.3f}]"
                        f" | {f['ratio']:.3f} [{f['low']:.3f}, {f['high']:.3f}] | {pair:.3f} |")
            log(rows[-1])
    text = "\n".join([
        *stamp.header("channel-shuffle on the zoo's ShuffleNets"),
        "Models: the corpus's ShuffleNetV2 x0.5 (torchvision, 64x64 images, batch 1; both torch.onnx exporters) and "
        "the light zoo's ShuffleNet v1 (groups 3). Three sessions per model timed interleaved (A B C C B A rounds, "
        "about the budget's seconds; thread CPU time at 1 thread, wall time at 2): onnxruntime alone, the default CPU "
        "pipeline without channel-shuffle, the default pipeline. Ratios: median of per-round ratios over onnxruntime "
        "alone's, with the 95% bootstrap interval; the last column is the median per-round ratio with / without the "
        "pass. Kernels per inference: onnxruntime's profiler, CPU provider, ORT_ENABLE_ALL, 1 thread.",
        "",
        *table_head(columns),
        *rows,
        "",
        "Kernels the pass removes and adds, per inference:",
        "",
        *table_head([("model", "l"), ("gone", "l"), ("new", "l")]),
        *kernels_rows,
        "",
    ])
    write_report(args.out, text)
    return 0


main = main_of(cli)

if __name__ == "__main__":
    raise SystemExit(main())
