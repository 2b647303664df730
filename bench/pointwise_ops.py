"""Per-element cost of single Pointwise ops against the same onnxruntime op, CPU, 1 thread.

Long compute-bound chains fuse into one kernel but cannot beat onnxruntime's separate kernels by
more than our per-op arithmetic allows: this measures that arithmetic, one op at a time.

    python -m bench.pointwise_ops [--elements 100000] [--rounds 200] [--out bench/results/pointwise_ops.md]
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np
from onnx import TensorProto, helper

from bench import harness

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


@harness.script(__doc__)
@click.option("--elements", type=int, default=100_000, show_default=True)
@click.option("--rounds", type=int, default=200, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=harness.RESULTS / "pointwise_ops.md", show_default=True)
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int:
    from onnxfuse.runtime import make_session

    rng = np.random.default_rng(0)
    x = rng.uniform(0.05, 5, args.elements).astype(np.float32)  # positive: Log is defined
    x[::2] *= -1
    feeds_for = {op: {"x": np.abs(x) if op == "Log" else x} for op in OPS}
    sessions = {(op, fused): make_session(_model(op, fused), threads=1, with_library=fused)
                for op in OPS for fused in (False, True)}
    # interleaved, so drift favours neither
    samples = harness.interleave({key: harness.session_run(sess, feeds_for[key[0]]) for key, sess in sessions.items()},
                                 order="cycle", min_rounds=args.rounds, max_rounds=args.rounds, warmup=1, runs=1)
    lines = [
        *stamp.header("Per-element cost of single ops: onnxfuse Pointwise vs onnxruntime"),
        f"One op on float32[{args.elements}] (values in +-[0.05, 5]), CPU provider, 1 thread, ORT_ENABLE_ALL, "
        "runs interleaved; median time per run divided by the element count (includes the ~1-3 us of "
        "per-run overhead). ratio = ours / onnxruntime (> 1: ours slower).",
        "",
        "| op | onnxruntime ns/element | onnxfuse ns/element | ratio |",
        "|---|---:|---:|---:|",
    ]
    for op in OPS:
        theirs = samples.median_ms((op, False)) / args.elements * 1e6
        ours = samples.median_ms((op, True)) / args.elements * 1e6
        lines.append(f"| {op} | {theirs:.3f} | {ours:.3f} | {ours / theirs:.2f} |")
        harness.log(lines[-1])
    harness.write_report(args.out, "\n".join(lines) + "\n", echo=False)
    harness.log(f"wrote {args.out}")
    return 0


main = harness.main_of(cli)


if __name__ == "__main__":
    sys.exit(main())
