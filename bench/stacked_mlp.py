"""onnxfuse.StackedMLP (batch-ensemble's CPU fused op) against onnxruntime running the original
ensemble, side by side, per batch and thread count.

The zoo's eight-member MLP ensemble (64 -> 128 -> 128 -> 10 each), as is and optimized with the
fused op forced at every batch (so the rule's limit, passes/ensemble_batch.py
STACKED_MLP_MAX_BATCH, can be read off the table); CPU provider, ORT_ENABLE_ALL, median latency;
ratio = ours / onnxruntime. Timed interleaved (A B C A B C ...) with a third session, the per-run
floor: one custom op that only gets its output [batch, 80] from x [batch, 64]
(bench/overhead_floor.cc), what any one-node model costs per run here, before its kernel works.
--baseline LIB runs the optimized model once more with another build of the library in the same
rotation (a before/after under the same load). --bounds appends what one core can do at most
(bench/machine_bounds.cc: FMA rate, streaming the 852 KB of packed weights from L3 and from L2).

    python -m bench.stacked_mlp [--runs 3000] [--baseline /tmp/old/_onnxfuse_ops.so] [--bounds]
                                [--out bench/results/stacked_mlp.md]
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import click
import onnx
from onnx import helper

from bench import harness
from bench.pointwise_overhead import build_floor_library

ROOT = harness.ROOT


def floor_model(batch: int, width_in: int, width_out: int) -> onnx.ModelProto:
    node = helper.make_node("OutputOnly", ["x"], ["y"], domain="onnxfuse.bench", rows=batch, cols=width_out)
    return harness.float_model("floor", [node], {"x": [batch, width_in]}, {"y": [batch, width_out]},
                               domains=("onnxfuse.bench",))


def session_with(library: str, model: onnx.ModelProto, threads: int):
    import onnxruntime as ort

    from onnxfuse import runtime

    so = runtime.session_options(with_library=False, threads=threads)
    so.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])


def machine_bounds(weight_bytes: int) -> list[str]:
    exe = Path(tempfile.gettempdir()) / "onnxfuse_machine_bounds"
    subprocess.run(["g++", "-O2", "-std=c++17", str(ROOT / "bench" / "machine_bounds.cc"), "-o", str(exe)], check=True)
    return subprocess.run([str(exe), str(weight_bytes)], capture_output=True, text=True, check=True).stdout.splitlines()


def packed_weight_floats(optimized: onnx.ModelProto) -> int:
    """Floats in the StackedMLP node's packed weights ([K, panels, D_in, 16] per layer, zero-padded)."""
    node = next(n for n in optimized.graph.node if n.op_type == "StackedMLP")
    inits = {t.name: t for t in optimized.graph.initializer}
    total = 0
    for name in node.input[1::2]:
        n = 1
        for d in inits[name].dims:
            n *= d
        total += n
    return total


@harness.script(__doc__)
@click.option("--runs", type=int, default=3000, show_default=True, help="rounds (one run of each session per round)")
@click.option("--batches", callback=harness.csv(int), default="1,4,16,64,256", show_default=True)
@click.option("--threads", callback=harness.csv(int), default="1,2", show_default=True)
@click.option("--baseline", help="another build of the custom-op library, timed in the same rotation")
@click.option("--bounds", is_flag=True, help="append the machine's FMA and streaming bounds")
@click.option("--out", default=None, help="write the report here (default: print it only)")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int | None:
    from onnxfuse import api, zoo
    from onnxfuse.profile import open_session, profile_models, random_inputs

    original = onnx.load(str(zoo.get("mlp_ensemble").path))
    optimized = api.optimize(original, verify_outputs=True, count_kernels=False, options={"stacked_mlp": "always"}).model
    floor_lib = build_floor_library(Path(tempfile.gettempdir()))
    lines = [*stamp.header("StackedMLP on the CPU: the MLP ensemble, one fused op vs onnxruntime"),
             "Zoo `mlp_ensemble` (8 members, 64 -> 128 -> 128 -> 10, Relu) as is vs optimized (1 StackedMLP "
             "node; fused here at every batch to show where it stops paying). ratio = ours / onnxruntime (< 1: faster). "
             "floor: a one-node custom-op model with the same input and output shapes, timed in the same rotation "
             "(what a run costs before any kernel works).", ""]
    columns = ["threads", "batch", "kernels ORT", "kernels ours", "ORT ms", "ours ms", "ratio", "floor ms"]
    columns += ["baseline ms", "baseline ratio"] if args.baseline else []
    lines += harness.table_head([(c, "r") for c in columns])
    for threads in args.threads:
        for batch in args.batches:
            dims = {"batch": batch}
            a, b = profile_models([("a", original), ("b", optimized)], "cpu", threads, "all", dims, runs=0)
            feeds = random_inputs(original, dims, 0)
            ort_session = open_session(original, "cpu", threads, "all")[0]
            width_out = ort_session.run(None, feeds)[0].shape[1]
            timed = [ort_session, open_session(optimized, "cpu", threads, "all")[0],
                     session_with(floor_lib, floor_model(batch, feeds["x"].shape[1], width_out), threads)]
            if args.baseline:
                timed.append(session_with(args.baseline, optimized, threads))
            samples = harness.interleave({i: harness.session_run(s, feeds) for i, s in enumerate(timed)}, order="cycle",
                                         min_rounds=args.runs, max_rounds=args.runs, warmup=50, runs=1)
            med = [samples.median_ms(i) for i in range(len(timed))]
            row = (f"| {threads} | {batch} | {a.kernels.kernels_per_inference} | {b.kernels.kernels_per_inference} | "
                   f"{med[0]:.4f} | {med[1]:.4f} | {med[1] / med[0]:.2f} | {med[2]:.4f} |")
            if args.baseline:
                row += f" {med[3]:.4f} | {med[3] / med[0]:.2f} |"
            lines.append(row)
            print(row, flush=True)
    if args.bounds:
        per_row = packed_weight_floats(optimized) // 8  # 8-float FMAs per input row
        weight_bytes = per_row * 8 * 4
        figures = machine_bounds(weight_bytes)
        lines += ["", "## What one core can do at most", "", f"`bench/machine_bounds.cc` (built and run by `--bounds`) on the "
                  f"packed weights' size, {weight_bytes} bytes:", "", "```"] + figures + ["```", ""]
        rate = float(next(f for f in figures if f.startswith("fma_rate")).split()[1]) * 1e9
        stream = float(next(f for f in figures if f.startswith("stream_l3_us")).split()[1])
        lines += [f"{per_row} 8-float FMAs per row ({weight_bytes // 4} packed weights): at {rate / 1e9:.2f} G FMA/s the "
                  "arithmetic alone takes " + ", ".join(f"{b * per_row / rate * 1e6:.1f} us at batch {b}"
                                                        for b in args.batches) +
                  f" on one core (half that on two); streaming the weights from L3 takes {stream:.1f} us on one core."]
    harness.write_report(args.out, "\n".join(lines) + "\n")


main = harness.main_of(cli)


if __name__ == "__main__":
    sys.exit(main())
