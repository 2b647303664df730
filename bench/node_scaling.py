"""Pass time against node count: a model of 25,000 nodes should optimize in at most 10x the time
of one of 2,500.

The model (parallel_chains): k chains of 10 pointwise nodes (Add, Mul, Tanh, Sub, Relu) on one
input, each chain an output of the graph; k = 250 is 2,500 nodes, k = 2,500 is 25,000. Times
are CPU seconds (process_time: other jobs on the machine count less than in wall time) around
`optimize(model, verify_outputs=False, count_kernels=False)`, the default CPU pipeline, each
started on a collected heap (model building and the garbage earlier runs left excluded).

The estimator compares equal amounts of work side by side: the 25,000-node model between two
halves of a block of ten 2,500-node ones, its time over the mean of theirs; the median over
`pairs` such pairs in one fresh Python process (after a warm-up on 250 nodes), and over runs.
Both sizes then see the same drift of a shared machine. The least of five single 2,500-node
samples against the least of two 25,000-node ones (this benchmark's estimator until
2026-11-29) reads high there: a short sample can fall between two bursts of another job's
work, a long one cannot. `--control` times a block of ten 2,500-node optimizations where the
25,000-node model goes, work exactly ten times the small one's: it should read 10
(bench/results/node_scaling.md).

`--parts` says where the time goes, in one process: ten 2,500-node optimizations against one
of 25,000, each pass's seconds (its statistics), the load and what runs around the passes, and
the garbage collector's (gc.callbacks). `--command` times `onnxfuse optimize IN OUT` as a user
runs it (default verification, wall seconds of the whole process, the report's stages), the
25,000-node file between two halves of ten 2,500-node ones.

`--instructions` counts instead of timing: the instructions the CPU executes for ten
2,500-node optimizations and for one of 25,000 (valgrind's cachegrind, four processes, about
ten minutes), each less a process that builds the same models without optimizing them. The
count does not depend on the machine's caches or its other jobs: a ratio of 10 there is work
linear in nodes, and whatever CPU time adds above it is what the same work costs on a larger
heap. `--linear-control` times such work with nothing of onnxfuse in it: a graph of plain
Python objects (two tensors per node, as here) built and walked 40 times, the same
instructions per node at both sizes, timed as the estimator times the optimizer.

    python -m bench.node_scaling                 # 5 runs, a table on stdout
    python -m bench.node_scaling --runs 8 --json out.json
    python -m bench.node_scaling --control       # the estimator on work known to be 10x
    python -m bench.node_scaling --parts         # per pass and collector, 2 repetitions
    python -m bench.node_scaling --command       # the command, 3 pairs
    python -m bench.node_scaling --instructions  # executed instructions (needs valgrind)
    python -m bench.node_scaling --linear-control

A run also prints the load average when it ended.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

SMALL, LARGE, BLOCK = 250, 2500, 10  # chains; BLOCK small models are the work of one large one


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


def cpu_seconds(k: int, times: int = 1) -> float:
    """CPU seconds of optimizing parallel_chains(k) `times` times, each on a collected heap: the
    garbage of what ran before (model building, earlier runs) is not its cost, as it is not a
    command's that optimizes one model in a fresh process."""
    from onnxfuse.api import optimize

    total = 0.0
    for model in [parallel_chains(k) for _ in range(times)]:
        gc.collect()
        t = time.process_time()
        optimize(model, verify_outputs=False, count_kernels=False)
        total += time.process_time() - t
    return total


def one_run(pairs: int = 3, control: bool = False) -> dict:
    """The measurement of one fresh process: `pairs` times the large model between two halves of
    a block of BLOCK small ones (with `control`, a second block of small ones in its place),
    each large time over the mean of the small ones around it; the median of those ratios.
    The halves on both sides cancel a drift of the machine's speed over the seconds a pair
    takes (identical blocks of ten differ by up to 12% one after the other on a shared host)."""
    cpu_seconds(25)
    ratios, smalls, larges = [], [], []
    for _ in range(pairs):
        before = [cpu_seconds(SMALL) for _ in range(BLOCK // 2)]
        large = cpu_seconds(SMALL, BLOCK) if control else cpu_seconds(LARGE)
        after = [cpu_seconds(SMALL) for _ in range(BLOCK - BLOCK // 2)]
        small = statistics.mean(before + after)
        ratios.append(large / small)
        smalls.append(small)
        larges.append(large)
    return {"small_s": round(statistics.median(smalls), 3), "large_s": round(statistics.median(larges), 3),
            "ratio": round(statistics.median(ratios), 3), "pair_ratios": [round(r, 3) for r in ratios],
            "load": round(os.getloadavg()[0], 2)}


def parts(k: int, times: int) -> Counter:
    """CPU seconds of optimizing parallel_chains(k) `times` times, and its parts: each pass (its
    statistics, wall seconds), "(load)", "(around the passes)" (import, export) and "(collector)"."""
    from onnxfuse.api import optimize

    seconds: Counter = Counter()
    started: list[float] = []

    def collector(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.process_time())
        elif started:
            seconds["(collector)"] += time.process_time() - started.pop()

    for model in [parallel_chains(k) for _ in range(times)]:
        gc.collect()
        gc.callbacks.append(collector)
        t = time.process_time()
        try:
            result = optimize(model, verify_outputs=False, count_kernels=False)
        finally:
            gc.callbacks.remove(collector)
        seconds["(total CPU)"] += time.process_time() - t
        for p in result.passes:
            seconds[p.name] += p.seconds
        seconds["(load)"] += result.summary["seconds"]["load"]
        seconds["(around the passes)"] += result.summary["seconds"]["passes"] - sum(p.seconds for p in result.passes)
    return seconds


def parts_table(repetitions: int = 2) -> str:
    cpu_seconds(25)
    rows = []
    for _ in range(repetitions):
        small, large = parts(SMALL, BLOCK), parts(LARGE, 1)
        rows.append((small, large))
    lines = ["| part | " + " | ".join(f"10 x 2,500 s | 25,000 s | ratio" for _ in rows) + " |",
             "|---|" + "---:|---:|---:|" * len(rows)]
    for name in sorted(rows[0][1], key=lambda n: -rows[0][1][n]):
        if rows[0][1][name] < 0.01:
            continue
        cells = [f"{s[name]:.3f} | {l_[name]:.3f} | {10 * l_[name] / s[name]:.2f}" if s[name] else "- | - | -"
                 for s, l_ in rows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def command_pairs(pairs: int = 3) -> str:
    """`onnxfuse optimize` on the 25,000-node file between two halves of ten on the 2,500-node one."""
    lines = ["| pair | 2,500 nodes s | 25,000 nodes s | ratio | load + passes + verify | passes | verify |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="onnxfuse-scaling-") as tmp:
        def run(k: int) -> list[float]:
            src, report = os.path.join(tmp, f"chains{k}.onnx"), os.path.join(tmp, "report.json")
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", src, os.path.join(tmp, "out.onnx"),
                            "--report", report], check=True, capture_output=True)
            wall = time.perf_counter() - t
            with open(report) as f:
                stages = json.load(f)["summary"]["seconds"]
            return [wall, stages["total"], stages["passes"], stages["verify"]]

        for k in (SMALL, LARGE):
            onnx.save(parallel_chains(k), os.path.join(tmp, f"chains{k}.onnx"))
        print("\n".join(lines), flush=True)
        run(SMALL)
        for i in range(pairs):
            around = [run(SMALL) for _ in range(BLOCK // 2)]
            large = run(LARGE)
            around += [run(SMALL) for _ in range(BLOCK - BLOCK // 2)]
            small = [statistics.mean(r[j] for r in around) for j in range(4)]
            ratio = [large[j] / small[j] for j in range(4)]
            lines.append(f"| {i + 1} | {small[0]:.2f} | {large[0]:.2f} | {ratio[0]:.2f} | {ratio[1]:.2f} | "
                         f"{ratio[2]:.2f} | {ratio[3]:.2f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def counted_work(k: int, times: int, optimize_them: bool) -> None:
    """What --instructions counts in one process: `times` models of k chains built, each optimized
    when `optimize_them`, each followed by a collection (so its garbage is its own cost)."""
    from onnxfuse.api import optimize

    optimize(parallel_chains(25), verify_outputs=False, count_kernels=False)  # imports, first-use caches
    for _ in range(times):
        model = parallel_chains(k)
        if optimize_them:
            optimize(model, verify_outputs=False, count_kernels=False)
        del model
        gc.collect()


def instructions() -> str:
    """Executed instructions of optimizing ten 2,500-node models and one 25,000-node model, each
    less those of building the models (cachegrind; two processes at a time)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind on PATH")
    jobs = {(k, times, opt): None for k, times in ((SMALL, BLOCK), (LARGE, 1)) for opt in (False, True)}
    with tempfile.TemporaryDirectory(prefix="onnxfuse-instructions-") as tmp:
        pending = list(jobs)
        while pending:
            started = []
            for key in pending[:2]:
                k, times, opt = key
                cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no",
                       f"--cachegrind-out-file={os.path.join(tmp, 'cg.%p')}", sys.executable, "-m",
                       "bench.node_scaling", "--counted-work", str(k), str(times), str(int(opt))]
                started.append((key, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                      text=True)))
            for key, proc in started:
                err = proc.communicate()[1]
                found = re.search(r"I\s+refs:\s+([\d,]+)", err)
                if proc.returncode != 0 or found is None:
                    raise SystemExit(f"valgrind run {key} failed:\n{err[-2000:]}")
                jobs[key] = int(found.group(1).replace(",", ""))
            pending = pending[2:]
    small = jobs[(SMALL, BLOCK, True)] - jobs[(SMALL, BLOCK, False)]
    large = jobs[(LARGE, 1, True)] - jobs[(LARGE, 1, False)]
    return ("| work | instructions | per node |\n|---|---:|---:|\n"
            f"| 10 x 2,500 nodes | {small:,} | {small / (BLOCK * SMALL * 10):,.0f} |\n"
            f"| 25,000 nodes | {large:,} | {large / (LARGE * 10):,.0f} |\n\n"
            f"instruction ratio {10 * large / small:.3f}")


class _Tensor:
    __slots__ = ("name", "inputs", "outputs", "shape")

    def __init__(self, name: str):
        self.name, self.inputs, self.outputs, self.shape = name, [], [], [1, 64]


class _Node:
    __slots__ = ("op", "name", "attrs", "inputs", "outputs")

    def __init__(self, name: str, inputs: list, outputs: list):
        self.op, self.name, self.attrs, self.inputs, self.outputs = "Add", name, {"axis": 1}, inputs, outputs


def linear_work(nodes: int, sweeps: int = 40) -> float:
    """CPU seconds of building a graph of `nodes` plain Python nodes (chains of 10) and walking it
    `sweeps` times: an index by identity, each node's readers, a few attribute reads; the same
    instructions per node at any size (the collector is off: its full collections walk
    the interpreter's own objects too, a share that differs with size)."""
    gc.collect()
    gc.disable()
    t = time.process_time()
    x, graph = _Tensor("x"), []
    for c in range(nodes // 10):
        prev = x
        for i in range(10):
            out, weight = _Tensor(f"c{c}_{i}"), _Tensor(f"k{c}_{i}")
            node = _Node(f"n{c}_{i}", [prev, weight], [out])
            prev.outputs.append(node)
            weight.outputs.append(node)
            out.inputs.append(node)
            graph.append(node)
            prev = out
    total = 0
    for _ in range(sweeps):
        index = {id(n): i for i, n in enumerate(graph)}
        readers = {id(n): [r for t in n.outputs for r in t.outputs if id(r) in index] for n in graph}
        total += len(readers) + sum(len(n.name) + len(n.attrs) + len(n.inputs[1].shape) for n in graph)
    for n in graph:  # unlink, so that the collector's cost stays out of it
        n.inputs.clear()
        n.outputs.clear()
    seconds = time.process_time() - t
    gc.enable()
    return seconds


def linear_control(pairs: int = 3) -> str:
    """linear_work at 25,000 nodes between two halves of ten at 2,500, as one_run pairs them."""
    linear_work(2500)
    lines = ["| pair | 2,500 nodes s | 25,000 nodes s | ratio |", "|---|---:|---:|---:|"]
    for i in range(pairs):
        around = [linear_work(SMALL * 10) for _ in range(BLOCK // 2)]
        large = linear_work(LARGE * 10)
        around += [linear_work(SMALL * 10) for _ in range(BLOCK - BLOCK // 2)]
        small = statistics.mean(around)
        lines.append(f"| {i + 1} | {small:.4f} | {large:.3f} | {large / small:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=3, help="blocks and large models timed per run")
    ap.add_argument("--control", action="store_true",
                    help="time a second block of 2,500-node models where the 25,000-node one goes")
    ap.add_argument("--parts", action="store_true", help="where the time goes, per pass and collector")
    ap.add_argument("--command", action="store_true", help="time `onnxfuse optimize` as a user runs it")
    ap.add_argument("--instructions", action="store_true",
                    help="count executed instructions instead of timing (valgrind, about ten minutes)")
    ap.add_argument("--linear-control", action="store_true",
                    help="time work exactly linear in nodes, with nothing of onnxfuse in it")
    ap.add_argument("--json", help="write the runs and their median ratio here")
    ap.add_argument("--counted-work", nargs=3, type=int, help=argparse.SUPPRESS)  # K TIMES OPTIMIZE
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a run's own process
    args = ap.parse_args(argv)
    if args.parts:
        print(parts_table())
        return 0
    if args.command:
        command_pairs(args.pairs)
        return 0
    if args.instructions:
        print(instructions())
        return 0
    if args.linear_control:
        print(linear_control(args.pairs))
        return 0
    if args.counted_work:
        counted_work(*args.counted_work[:2], bool(args.counted_work[2]))
        return 0
    if args.one:
        print(json.dumps(one_run(args.pairs, args.control)))
        return 0
    runs = []
    large_label = "10 x 2,500 nodes CPU s" if args.control else "25,000 nodes CPU s"
    print(f"| run | 2,500 nodes CPU s | {large_label} | ratio | load |\n|---|---:|---:|---:|---:|")
    for i in range(args.runs):
        cmd = [sys.executable, "-m", "bench.node_scaling", "--one", "--pairs", str(args.pairs)]
        out = subprocess.run(cmd + (["--control"] if args.control else []), check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        runs.append(r)
        print(f"| {i + 1} | {r['small_s']:.3f} | {r['large_s']:.2f} | {r['ratio']:.2f} | {r['load']:.1f} |", flush=True)
    ratios = [r["ratio"] for r in runs]
    median = statistics.median(ratios)
    print(f"\nmedian ratio {median:.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "median_ratio": round(median, 3),
                       "command": " ".join(["python -m bench.node_scaling"] + (argv or sys.argv[1:]))}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
