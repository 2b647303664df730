"""Pass time against node count: a model of 25,000 nodes should optimize in at most 10x the time
of one of 2,500.

The model (parallel_chains): k chains of 10 pointwise nodes (Add, Mul, Tanh, Sub, Relu) on one
input, each chain an output of the graph; k = 250 is 2,500 nodes, k = 2,500 is 25,000. Each
run is a fresh Python process: a warm-up on 250 nodes (imports, first sessions), then the
2,500-node model five times and the 25,000-node one twice, alternating, each timed in CPU
seconds (process_time: other jobs on the machine count less than in wall time) around
`optimize(model, verify_outputs=False, count_kernels=False)`, the default CPU pipeline; a run's
figure for each size is its least time.

    python -m bench.node_scaling                 # 5 runs, a table on stdout
    python -m bench.node_scaling --runs 8 --json out.json

A run also prints the load average when it ended: on a shared machine the ratio follows the
load (bench/results/node_scaling.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import onnx
from onnx import helper, numpy_helper


def parallel_chains(k: int, length: int = 10) -> onnx.ModelProto:
    """k pointwise chains of `length` nodes on one input, each an output of the graph."""
    nodes, inits, outs = [], [], []
    ops = ["Add", "Mul", "Tanh", "Sub", "Relu"]
    for c in range(k):
        prev = "x"
        for i in range(length):
            op, out = ops[i % len(ops)], f"c{c}_{i}"
            if op in ("Add", "Mul", "Sub"):
                inits.append(numpy_helper.from_array(np.array([0.5 + c * 1e-3 + i * 1e-4], np.float32), f"k{c}_{i}"))
                nodes.append(helper.make_node(op, [prev, f"k{c}_{i}"], [out]))
            else:
                nodes.append(helper.make_node(op, [prev], [out]))
            prev = out
        outs.append(helper.make_tensor_value_info(prev, 1, [1, 64]))
    g = helper.make_graph(nodes, "chains", [helper.make_tensor_value_info("x", 1, [1, 64])], outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def cpu_seconds(k: int) -> float:
    """CPU seconds of optimizing parallel_chains(k), model building excluded."""
    from onnxfuse.api import optimize

    model = parallel_chains(k)
    t = time.process_time()
    optimize(model, verify_outputs=False, count_kernels=False)
    return time.process_time() - t


def one_run(small_reps: int = 5, large_reps: int = 2) -> dict:
    """The measurement of one fresh process: the least CPU time of `small_reps` optimizations of
    the small model and of `large_reps` of the large one, alternating (another job on the
    machine only ever adds time, and on a shared machine it added up to 40% to one sample)."""
    cpu_seconds(25)
    small, large = [], []
    for i in range(max(small_reps, large_reps)):
        if i < small_reps:
            small.append(cpu_seconds(250))
        if i < large_reps:
            large.append(cpu_seconds(2500))
    small, large = min(small), min(large)
    return {"small_s": round(small, 3), "large_s": round(large, 3), "ratio": round(large / small, 3),
            "load": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", help="write the runs and their median ratio here")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a run's own process
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one_run()))
        return 0
    runs = []
    print("| run | 2,500 nodes CPU s | 25,000 nodes CPU s | ratio | load |\n|---|---:|---:|---:|---:|")
    for i in range(args.runs):
        out = subprocess.run([sys.executable, "-m", "bench.node_scaling", "--one"], check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        runs.append(r)
        print(f"| {i + 1} | {r['small_s']:.2f} | {r['large_s']:.2f} | {r['ratio']:.2f} | {r['load']:.1f} |", flush=True)
    median = statistics.median(r["ratio"] for r in runs)
    print(f"\nmedian ratio {median:.2f} ({min(r['ratio'] for r in runs):.2f}-{max(r['ratio'] for r in runs):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "median_ratio": round(median, 3), "command": " ".join(["python -m bench.node_scaling"] + (argv or sys.argv[1:]))}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
