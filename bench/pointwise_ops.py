"""Per-element cost of single Pointwise ops against the same onnxruntime op, CPU, 1 thread.

Long compute-bound chains fuse into one kernel but cannot beat onnxruntime's separate kernels by
more than our per-op arithmetic allows: this measures that arithmetic, one op at a time.

    python bench/pointwise_ops.py [--elements 100000] [--rounds 200] [--out bench/results/pointwise_ops.md]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent
OPS = ["Sigmoid", "Tanh", "Exp", "Log", "Erf", "Relu", "Abs"]


def _model(op: str, fused: bool) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])
    if fused:
        node = helper.make_node("Pointwise", ["x"], ["y"], domain="onnxfuse",
                                program=f"in x0 f32\nt0 = {op.lower()} x0\nout t0 f32\n")
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("onnxfuse", 1)]
    else:
        node = helper.make_node(op, ["x"], ["y"])
        opsets = [helper.make_opsetid("", 17)]
    m = helper.make_model(helper.make_graph([node], "g", [x], [y]), opset_imports=opsets)
    m.ir_version = 10
    return m.SerializeToString()


def main(argv=None) -> int:
    from onnxfuse.runtime import make_session

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/pointwise_ops.md")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.uniform(0.05, 5, args.elements).astype(np.float32)  # positive: Log is defined
    x[::2] *= -1
    feeds_for = {op: {"x": np.abs(x) if op == "Log" else x} for op in OPS}
    sessions = {(op, fused): make_session(_model(op, fused), threads=1, with_library=fused)
                for op in OPS for fused in (False, True)}
    samples = {key: [] for key in sessions}
    for _ in range(args.rounds):  # interleaved, so drift favours neither
        for (op, fused), sess in sessions.items():
            t0 = time.perf_counter()
            sess.run(None, feeds_for[op])
            samples[(op, fused)].append(time.perf_counter() - t0)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    import onnxruntime

    lines = [
        "# Per-element cost of single ops: onnxfuse Pointwise vs onnxruntime",
        "",
        f"Command: `python bench/pointwise_ops.py --elements {args.elements} --rounds {args.rounds}`",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Commit: {commit}. "
        f"Machine: {platform.machine()}, 2-core shared VM; onnxruntime {onnxruntime.__version__}, "
        f"onnx {onnx.__version__}, Python {platform.python_version()}.",
        "",
        f"One op on float32[{args.elements}] (values in +-[0.05, 5]), CPU provider, 1 thread, ORT_ENABLE_ALL, "
        "runs interleaved; median time per run divided by the element count (includes the ~1-3 us of "
        "per-run overhead). ratio = ours / onnxruntime (> 1: ours slower).",
        "",
        "| op | onnxruntime ns/element | onnxfuse ns/element | ratio |",
        "|---|---:|---:|---:|",
    ]
    for op in OPS:
        theirs = np.median(samples[(op, False)]) / args.elements * 1e9
        ours = np.median(samples[(op, True)]) / args.elements * 1e9
        lines.append(f"| {op} | {theirs:.3f} | {ours:.3f} | {ours / theirs:.2f} |")
        print(lines[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
