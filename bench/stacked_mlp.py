"""onnxfuse.StackedMLP (batch-ensemble's CPU fused op) against onnxruntime running the original
ensemble, side by side, per batch and thread count.

The zoo's eight-member MLP ensemble (64 -> 128 -> 128 -> 10 each), as is and optimized with the
fused op forced at every batch (so the rule's limit, passes/ensemble_batch.py
STACKED_MLP_MAX_BATCH, can be read off the table); CPU provider, ORT_ENABLE_ALL, runs
interleaved (onnxfuse.profile.compare), median latency; ratio = ours / onnxruntime.

    python bench/stacked_mlp.py [--runs 3000] [--out bench/results/stacked_mlp.md]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys

import onnx


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import onnxruntime

    from onnxfuse import api, zoo
    from onnxfuse.profile import compare

    original = onnx.load(str(zoo.get("mlp_ensemble").path))
    optimized = api.optimize(original, verify_outputs=True, count_kernels=False, options={"stacked_mlp": "always"}).model
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = ["# StackedMLP on the CPU: the MLP ensemble, one fused op vs onnxruntime", "",
             f"Command: `python bench/stacked_mlp.py --runs {args.runs}`", "",
             f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Commit: {commit}. Machine: "
             f"{platform.machine()}, 2-core shared VM (AMD EPYC); onnxruntime {onnxruntime.__version__}, onnx {onnx.__version__}, "
             f"Python {platform.python_version()}.", "",
             "Zoo `mlp_ensemble` (8 members, 64 -> 128 -> 128 -> 10, Relu) as is vs optimized (1 StackedMLP "
             "node; fused here at every batch to show where it stops paying). ratio = ours / onnxruntime (< 1: faster).", "",
             "| threads | batch | kernels ORT | kernels ours | ORT ms | ours ms | ratio |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for threads in [int(t) for t in args.threads.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            r = compare(original, optimized, threads=threads, dims={"batch": batch}, runs=args.runs, warmup=50)
            a, b = r["a"], r["b"]
            lines.append(f"| {threads} | {batch} | {a.kernels.kernels_per_inference} | {b.kernels.kernels_per_inference} | "
                         f"{a.latency.median_ms:.4f} | {b.latency.median_ms:.4f} | {b.latency.median_ms / a.latency.median_ms:.2f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
