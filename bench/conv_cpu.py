"""CPU policy check of the Conv passes: every zoo CNN, original vs optimized, under ORT_ENABLE_ALL.

For each model: optimize with the Conv passes for --target cpu (fold-batchnorm, conv-bias-act),
verify the outputs (seeded random inputs), then time both models side by side in onnxruntime's
CPU provider, interleaved (A B A B ...), and report the median latency ratio and the kernels per
inference (ORT profiler) of each. Writes a markdown table.

    python bench/conv_cpu.py --out bench/results/conv_cpu.md
    python bench/conv_cpu.py --models resnet50 mobilenetv3 --threads 2 --seconds 10
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import onnx
import onnxruntime as ort

from onnxfuse import api
from onnxfuse.modelio import normalize
from onnxfuse.zoo import resolve_input
from onnxfuse.profile import compare, open_session
from onnxfuse.verify import random_inputs

CNNS = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
        "vgg19", "zfnet512", "mobilenetv3"]
PASSES = ["fold-batchnorm", "conv-bias-act"]


def timed_pairs(original: onnx.ModelProto, optimized: onnx.ModelProto, threads: int, seconds: float,
                min_runs: int) -> tuple[list[float], list[float]]:
    """Latencies (ms) of both models, in A B B A order per round so that drift on a shared host
    hits both alike; entries 2i and 2i+1 of each list belong to round i."""
    feeds = random_inputs(original, {}, 0)
    sa, _ = open_session(original, "cpu", threads, "all")
    sb, _ = open_session(optimized, "cpu", threads, "all")
    for _ in range(3):
        sa.run(None, feeds)
        sb.run(None, feeds)
    clock = time.perf_counter_ns
    ta: list[float] = []
    tb: list[float] = []

    def one(sess, out):
        t0 = clock()
        sess.run(None, feeds)
        out.append((clock() - t0) / 1e6)

    start = time.perf_counter()
    while len(ta) < min_runs or time.perf_counter() - start < seconds:
        one(sa, ta)
        one(sb, tb)
        one(sb, tb)
        one(sa, ta)
    return ta, tb


def bench_one(name: str, threads: int, seconds: float, min_runs: int) -> dict:
    original = normalize(resolve_input(f"zoo:{name}")).model
    result = api.optimize(original, passes=PASSES, target="cpu", verify_outputs=True, threads=threads, label=name)
    optimized = result.model
    kernels = compare(original, optimized, threads=threads, runs=0)  # profiler: kernels per inference
    a, b = kernels["a"].kernels, kernels["b"].kernels
    ta, tb = timed_pairs(original, optimized, threads, seconds, min_runs)
    ver = result.summary["verification"] or {}
    return {
        "model": name,
        "nodes": f"{len(original.graph.node)} -> {len(optimized.graph.node)}",
        "folds": next((p.matches for p in result.passes if p.name == "fold-batchnorm"), 0),
        "verified": ver.get("ok"),
        "kernels": (a.kernels_per_inference, b.kernels_per_inference),
        "same_kernels": a.by_op_type == b.by_op_type,
        "ms": (statistics.median(ta), statistics.median(tb)),
        "ratio": statistics.median(tb) / statistics.median(ta),
        # per round (A B B A): the two B runs over the two A runs, then the median over rounds
        "paired": statistics.median((tb[i] + tb[i + 1]) / (ta[i] + ta[i + 1]) for i in range(0, len(ta), 2)),
        "runs": len(ta),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=CNNS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=8.0, help="timing budget per model (both variants)")
    ap.add_argument("--min-runs", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for name in args.models:
        t0 = time.time()
        row = bench_one(name, args.threads, args.seconds, args.min_runs)
        rows.append(row)
        print(f"{name}: ratio {row['ratio']:.3f} paired {row['paired']:.3f} kernels {row['kernels']} verified {row['verified']} "
              f"({time.time() - t0:.0f}s)", flush=True)
    lines = [
        "# Conv passes on --target cpu: optimized vs original under ORT_ENABLE_ALL",
        "",
        f"Command: `python bench/conv_cpu.py {' '.join(argv if argv is not None else sys.argv[1:])}`".rstrip(),
        f"Date: {datetime.date.today().isoformat()}. Machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
        f"shared 2-core host; onnxruntime {ort.__version__}, onnx {onnx.__version__}, Python {platform.python_version()}.",
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
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
