"""CPU policy check of the Conv passes: every zoo CNN, original vs optimized, under ORT_ENABLE_ALL.

For each model: optimize with the Conv passes for --target cpu (fold-batchnorm, conv-bias-act),
verify the outputs (seeded random inputs), then time both models side by side in onnxruntime's
CPU provider, interleaved (A B A B ...), and report the median latency ratio and the kernels per
inference (ORT profiler) of each. Writes a markdown table.

    python -m bench.conv_cpu --out bench/results/conv_cpu.md
    python -m bench.conv_cpu --models resnet50,mobilenetv3 --threads 2 --seconds 10
"""
from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import click
import onnx

from bench import harness
from onnxfuse import api
from onnxfuse.normalize import normalize
from onnxfuse.zoo import resolve_input
from onnxfuse.profile import compare, open_session
from onnxfuse.inputs import random_inputs

CNNS = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
        "vgg19", "zfnet512", "mobilenetv3"]
PASSES = ["fold-batchnorm", "conv-bias-act"]


def timed_pairs(original: onnx.ModelProto, optimized: onnx.ModelProto, threads: int, seconds: float,
                min_runs: int) -> harness.Samples:
    """Both models timed in A B B A rounds (one run per sample), so that drift on a shared host
    hits both alike, for `seconds` and at least `min_runs` runs of each."""
    feeds = random_inputs(original, {}, 0)
    sa, _ = open_session(original, "cpu", threads, "all")
    sb, _ = open_session(optimized, "cpu", threads, "all")
    return harness.interleave({"a": harness.session_run(sa, feeds), "b": harness.session_run(sb, feeds)},
                              order="mirror", min_rounds=(min_runs + 1) // 2, budget_s=seconds, warmup=3, runs=1)


def bench_one(name: str, threads: int, seconds: float, min_runs: int) -> dict:
    original = normalize(resolve_input(f"zoo:{name}")).model
    result = api.optimize(original, passes=PASSES, target="cpu", verify_outputs=True, threads=threads, label=name)
    optimized = result.model
    kernels = compare(original, optimized, threads=threads, runs=0)  # profiler: kernels per inference
    a, b = kernels["a"].kernels, kernels["b"].kernels
    samples = timed_pairs(original, optimized, threads, seconds, min_runs)
    ver = result.summary["verification"] or {}
    return {
        "model": name,
        "nodes": f"{len(original.graph.node)} -> {len(optimized.graph.node)}",
        "folds": next((p.matches for p in result.passes if p.name == "fold-batchnorm"), 0),
        "verified": ver.get("ok"),
        "kernels": (a.kernels_per_inference, b.kernels_per_inference),
        "same_kernels": a.by_op_type == b.by_op_type,
        "ms": (samples.median_ms("a"), samples.median_ms("b")),
        "ratio": samples.median_ms("b") / samples.median_ms("a"),
        # per round (A B B A): the two B runs over the two A runs, then the median over rounds
        "paired": samples.ratio("a", "b"),
        "runs": samples.total_runs("a"),
    }


@harness.script(__doc__)
@click.option("--models", callback=harness.csv(), default=",".join(CNNS), show_default=True,
              help="comma-separated zoo CNNs")
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--seconds", type=float, default=8.0, show_default=True, help="timing budget per model (both variants)")
@click.option("--min-runs", type=int, default=20, show_default=True)
@click.option("--out", default=None, help="write the report here (default: print it only)")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int | None:
    rows = []
    for name in args.models:
        t0 = time.time()
        row = bench_one(name, args.threads, args.seconds, args.min_runs)
        rows.append(row)
        harness.log(f"{name}: ratio {row['ratio']:.3f} paired {row['paired']:.3f} kernels {row['kernels']} "
                    f"verified {row['verified']} ({time.time() - t0:.0f}s)")
    lines = [
        *stamp.header("Conv passes on --target cpu: optimized vs original under ORT_ENABLE_ALL")[:-1],
        f"onnxruntime CPU provider, ORT_ENABLE_ALL, intra-op threads {args.threads}, batch 1, seeded random inputs; "
        "both models timed interleaved (A B B A per round), median of the runs shown; "
        "ratio = median(optimized) / median(original); paired = median over rounds of "
        "(B1 + B2) / (A1 + A2), robust to load changes between rounds.",
        "Passes: " + ", ".join(PASSES) + " (the Conv passes alone, not the whole default pipeline).",
        "",
        "| model | nodes before -> after | Conv folds | verified | kernels/inference orig | opt | same kernels by op | "
        "median ms orig | opt | ratio opt/orig | paired ratio | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['folds']} | {'yes' if r['verified'] else 'NO'} | {r['kernels'][0]} | {r['kernels'][1]} | "
            f"{'yes' if r['same_kernels'] else 'no'} | {r['ms'][0]:.2f} | {r['ms'][1]:.2f} | {r['ratio']:.3f} | {r['paired']:.3f} | {r['runs']} |"
        )
    worst = max(rows, key=lambda r: r["paired"]) if rows else None
    if worst:
        lines += ["", f"Worst paired ratio: {worst['paired']:.3f} ({worst['model']})."]
    harness.write_report(args.out, "\n".join(lines) + "\n")


main = harness.main_of(cli)


if __name__ == "__main__":
    sys.exit(main())
