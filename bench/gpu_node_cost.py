"""Where the time of one inference goes on the CUDA provider: per op type, the host-side time
onnxruntime spends in each node (its profiler's kernel_time events: argument checks, allocation,
the launch; the GPU runs asynchronously), for a model as is and optimized with --target cuda.

At batch 1 these models are bound by this host-side cost, not by the GPU, so the per-node figure
of our fused ops against onnxruntime's own ops says what a fused node must save to pay.

    python -m bench.gpu_node_cost [--models char_rnn,gpt_stack] [--runs 50] [--md FILE]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from types import SimpleNamespace

import click
import onnx

from bench import harness
from bench.gpu import cuda_onnxruntime, make_session


def profile(ort, model, library: bool, feeds, runs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sess = make_session(ort, model, library, graph=False, profile_prefix=os.path.join(tmp, "p"))
        for _ in range(5):
            sess.run(None, feeds)
        t0 = time.perf_counter()
        for _ in range(runs):
            sess.run(None, feeds)
        wall_ms = (time.perf_counter() - t0) * 1e3 / runs
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    per_run = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    by_op = defaultdict(list)
    for e in nodes[-len(nodes) * runs // (runs + 5):]:  # the timed runs only
        by_op[e["args"].get("op_name", "?")].append(e["dur"])
    run_us = statistics.median(e["dur"] for e in per_run[-runs:]) if per_run else float("nan")
    return {"wall_ms": wall_ms, "model_run_us": run_us,
            "ops": {op: {"nodes": len(d) / runs, "us_per_node": statistics.median(d), "us_per_run": sum(d) / runs}
                    for op, d in by_op.items()}}


@harness.script(__doc__)
@click.option("--models", default="char_rnn,gpt_stack", show_default=True, help="comma-separated zoo names")
@click.option("--runs", type=int, default=50, show_default=True)
@click.option("--md", default=None, help="write the markdown report here")
@click.option("--env", default=None, help="a markdown file describing the machine, put above the tables")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int | None:
    from onnxfuse import api, zoo
    from onnxfuse.inputs import random_inputs

    ort, arch = cuda_onnxruntime()
    lines = stamp.header("Host-side cost per node on the CUDA provider")
    if args.env:
        lines += [open(args.env).read().strip(), ""]
    lines += ["Profiled runs "
              "(onnxruntime profiler on, which adds its own cost to every node): median host time per node "
              "(kernel_time event) and its total per inference, by op type; `model_run` = the profiler's "
              "whole-run time.", ""]
    for name in args.models.split(","):
        zm = zoo.get(name)
        original = onnx.load(str(zm.path))
        optimized = api.optimize(original, target="cuda", arch=arch, verify_outputs=False, count_kernels=False,
                                 dims=dict(zm.dims)).model
        feeds = random_inputs(original, dict(zm.dims), 0)
        res = {"ort": profile(ort, original, False, feeds, args.runs), "ours": profile(ort, optimized, True, feeds, args.runs)}
        lines += [f"## {name}", "",
                  f"model_run: ort {res['ort']['model_run_us']:.0f} us, ours {res['ours']['model_run_us']:.0f} us; "
                  f"wall per run with the profiler: ort {res['ort']['wall_ms']:.3f} ms, ours {res['ours']['wall_ms']:.3f} ms", "",
                  "| op | ort nodes | ort us/node | ort us/run | ours nodes | ours us/node | ours us/run |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        ops = sorted(set(res["ort"]["ops"]) | set(res["ours"]["ops"]),
                     key=lambda o: -max(res[k]["ops"].get(o, {}).get("us_per_run", 0) for k in res))
        for op in ops:
            cells = [op]
            for k in ("ort", "ours"):
                d = res[k]["ops"].get(op)
                cells += [f"{d['nodes']:.0f}", f"{d['us_per_node']:.1f}", f"{d['us_per_run']:.0f}"] if d else ["-", "-", "-"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        print("\n".join(lines[-(len(ops) + 6):]), flush=True)
    harness.write_report(args.md, "\n".join(lines) + "\n", echo=False)


main = harness.main_of(cli)


if __name__ == "__main__":
    sys.exit(main())
