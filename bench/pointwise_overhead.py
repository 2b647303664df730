"""Per-call cost of the CPU Pointwise kernel against onnxruntime's own kernels and against the
floor of onnxruntime's custom-op path.

Chains of N nodes on float32[1, 128], each node reading the previous node's output, one intra-op
thread, ORT_ENABLE_ALL, input and output bound once (IOBinding):

  ort-sigmoid        N onnxruntime Sigmoid nodes
  floor              N custom ops that only get their output and return (bench/overhead_floor.cc,
                     built here with g++): what onnxruntime's custom-op path costs by itself
  pointwise-sigmoid  N Pointwise nodes running `t0 = sigmoid x0`
  ort-cell           N char-rnn LSTM cell steps as onnxruntime nodes: Add, Split, 3 Sigmoid,
                     2 Tanh, 3 Mul, Add (c), then Add(c, h) feeding the next step: 12 kernels
  pointwise-cell     the same steps as the Pointwise node the pointwise pass makes of a cell
                     (9 inputs through views, 13 instructions) plus the Add(c, h): 2 kernels

Every model also runs as a 1-node (1-step) chain; cost per node = (median(N) - median(1)) / (N-1),
which removes the fixed cost of a session run. All models are timed interleaved, the starting
model rotating from round to round, many rounds, so drift on a shared host hits all alike.
--baseline LIB adds the Pointwise models once more with another build of the library (both
loaded in one process, one per session): a before/after comparison under the same load.

    python -m bench.pointwise_overhead --out bench/results/pointwise_overhead.md
    python -m bench.pointwise_overhead --baseline /tmp/old/_onnxfuse_ops.so --seconds 20
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from bench import harness
from onnxfuse import runtime

ROOT = harness.ROOT
FLOOR_SOURCE = ROOT / "bench" / "overhead_floor.cc"
COLS = 128
CELL_PROGRAM = """\
in x0 f32 view=1:128:256:1
in x1 f32 view=0:128:256:1
in x2 f32
in x3 f32 view=1:0:128:1
in x4 f32 view=0:0:128:1
in x5 f32 view=1:256:384:1
in x6 f32 view=0:256:384:1
in x7 f32 view=1:384:512:1
in x8 f32 view=0:384:512:1
t0 = add x0 x1
t1 = sigmoid t0
t2 = mul t1 x2
t3 = add x3 x4
t4 = sigmoid t3
t5 = add x5 x6
t6 = tanh t5
t7 = mul t4 t6
t8 = add t2 t7
t9 = add x7 x8
t10 = sigmoid t9
t11 = tanh t8
t12 = mul t10 t11
out t8 f32
out t12 f32
"""


def build_floor_library(cache_dir: Path) -> str:
    """Compiles bench/overhead_floor.cc (cached by the hash of its sources)."""
    sources = [FLOOR_SOURCE, ROOT / "kernels" / "ort_api.h", ROOT / "kernels" / "kernel_util.h"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    out = cache_dir / f"overhead_floor_{digest}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", f"-I{ROOT / 'kernels'}",
                        str(FLOOR_SOURCE), "-o", str(tmp), "-ldl"], check=True)
        tmp.rename(out)
    return str(out)


def _model(nodes, inputs: dict, outputs: dict, inits=(), domains=()) -> onnx.ModelProto:
    # Custom ops' outputs get no type inference: their intermediate values are declared.
    value_info = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, COLS])
                  for node in nodes if node.domain for o in node.output if o not in {*inputs, *outputs}]
    return harness.float_model("chain", nodes, inputs, outputs, inits, tuple(domains), value_info)


def chain_model(kind: str, n: int) -> onnx.ModelProto:
    """A chain of n nodes of `kind` ("ort-sigmoid", "floor", "pointwise-sigmoid") on x: [1, 128]."""
    nodes = []
    prev = "x"
    for k in range(n):
        out = "y" if k == n - 1 else f"t{k}"
        if kind == "ort-sigmoid":
            nodes.append(helper.make_node("Sigmoid", [prev], [out]))
        elif kind == "floor":
            nodes.append(helper.make_node("OutputOnly", [prev], [out], domain="onnxfuse.bench", rows=1, cols=COLS))
        elif kind == "pointwise-sigmoid":
            nodes.append(helper.make_node("Pointwise", [prev], [out], domain="onnxfuse",
                                          program="in x0 f32\nt0 = sigmoid x0\nout t0 f32\n"))
        else:
            raise ValueError(kind)
        prev = out
    domains = {"floor": ["onnxfuse.bench"], "pointwise-sigmoid": ["onnxfuse"]}.get(kind, [])
    return _model(nodes, {"x": [1, COLS]}, {"y": [1, COLS]}, domains=domains)


def cell_model(kind: str, n: int) -> onnx.ModelProto:
    """n LSTM cell steps (the char-rnn cell) over gates: [1, 512] and bias [512], c chained."""
    rng = np.random.default_rng(0)
    bias = numpy_helper.from_array((rng.standard_normal(4 * COLS) * 0.1).astype(np.float32), "bias")
    nodes = []
    c = "c"
    for k in range(n):
        cn, h, nxt = f"c{k}", f"h{k}", ("y" if k == n - 1 else f"s{k}")
        if kind == "ort-cell":
            p = f"k{k}_"
            nodes += [
                helper.make_node("Add", ["gates", "bias"], [p + "a"]),
                helper.make_node("Split", [p + "a"], [p + "i", p + "o", p + "f", p + "g"], axis=1),
                helper.make_node("Sigmoid", [p + "o"], [p + "so"]),
                helper.make_node("Sigmoid", [p + "i"], [p + "si"]),
                helper.make_node("Tanh", [p + "f"], [p + "tf"]),
                helper.make_node("Sigmoid", [p + "g"], [p + "sg"]),
                helper.make_node("Mul", [p + "so", c], [p + "m1"]),
                helper.make_node("Mul", [p + "si", p + "tf"], [p + "m2"]),
                helper.make_node("Add", [p + "m1", p + "m2"], [cn]),
                helper.make_node("Tanh", [cn], [p + "tc"]),
                helper.make_node("Mul", [p + "sg", p + "tc"], [h]),
            ]
        else:
            nodes.append(helper.make_node(
                "Pointwise", ["gates", "bias", c, "gates", "bias", "gates", "bias", "gates", "bias"], [cn, h],
                domain="onnxfuse", program=CELL_PROGRAM))
        nodes.append(helper.make_node("Add", [cn, h], [nxt]))
        c = nxt
    domains = ["onnxfuse"] if kind == "pointwise-cell" else []
    return _model(nodes, {"gates": [1, 4 * COLS], "c": [1, COLS]}, {"y": [1, COLS]}, [bias], domains)


class Runner:
    """One session, inputs and output bound once."""

    def __init__(self, model: onnx.ModelProto, library: str | None, feeds: dict[str, np.ndarray]):
        so = runtime.session_options(with_library=False, threads=1, level="all")
        if library:
            so.register_custom_ops_library(library)
        self.session = ort.InferenceSession(model.SerializeToString(), sess_options=so,
                                            providers=["CPUExecutionProvider"])
        self.binding = self.session.io_binding()
        self._keep = []
        for name, arr in feeds.items():
            v = ort.OrtValue.ortvalue_from_numpy(arr)
            self._keep.append(v)
            self.binding.bind_ortvalue_input(name, v)
        self.out = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, COLS), np.float32))
        self.binding.bind_ortvalue_output("y", self.out)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)

    def result(self) -> np.ndarray:
        self.session.run_with_iobinding(self.binding)
        return self.out.numpy().copy()


@harness.script(__doc__)
@click.option("--nodes", type=int, default=100, show_default=True, help="chain length N")
@click.option("--seconds", type=float, default=30.0, show_default=True, help="total timing budget")
@click.option("--runs-per-turn", type=int, default=5, show_default=True,
              help="consecutive runs of one model per turn")
@click.option("--baseline", help="another build of the custom-op library to compare with (before/after)")
@click.option("--out", help="write the markdown report here")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int | None:

    rng = np.random.default_rng(1)
    x = {"x": rng.standard_normal((1, COLS)).astype(np.float32)}
    cell = {"gates": rng.standard_normal((1, 4 * COLS)).astype(np.float32),
            "c": rng.standard_normal((1, COLS)).astype(np.float32)}
    ours = runtime.library_path()
    floor_lib = build_floor_library(Path(tempfile.gettempdir()))
    cases = [  # (label, model builder, kind, library, feeds)
        ("ort-sigmoid", chain_model, "ort-sigmoid", None, x),
        ("floor", chain_model, "floor", floor_lib, x),
        ("pointwise-sigmoid", chain_model, "pointwise-sigmoid", ours, x),
        ("ort-cell", cell_model, "ort-cell", None, cell),
        ("pointwise-cell", cell_model, "pointwise-cell", ours, cell),
    ]
    if args.baseline:
        cases += [("pointwise-sigmoid (baseline)", chain_model, "pointwise-sigmoid", args.baseline, x),
                  ("pointwise-cell (baseline)", cell_model, "pointwise-cell", args.baseline, cell)]

    runners = {}
    for label, build, kind, lib, feeds in cases:
        for n in (1, args.nodes):
            runners[(label, n)] = Runner(build(kind, n), lib, feeds)
    # Same results where the computation is the same (floor computes nothing).
    for a, b in (("ort-sigmoid", "pointwise-sigmoid"), ("ort-cell", "pointwise-cell")):
        for n in (1, args.nodes):
            np.testing.assert_allclose(runners[(b, n)].result(), runners[(a, n)].result(), rtol=1e-5, atol=1e-6)
    samples = harness.interleave({k: r.run for k, r in runners.items()}, order="rotate", min_rounds=3,
                                 budget_s=args.seconds, warmup=20, runs=args.runs_per_turn)
    n = args.nodes
    med = {k: samples.median_ms(k) * 1e3 for k in runners}  # us
    per_node = {label: (med[(label, n)] - med[(label, 1)]) / (n - 1) for label, *_ in cases}
    lines = [
        *stamp.header("Pointwise CPU kernel: per-call cost"),
        f"Chains of N = {n} nodes on float32[1, {COLS}] (cell: N LSTM cell steps), 1 intra-op thread, ORT_ENABLE_ALL,"
        " IOBinding; all models interleaved in rotating order; cost per node (step) = (median(N) - median(1)) / (N - 1).",
        "",
        "| model | median run, N=1 (us) | median run, N (us) | per node / step (us) | runs each |",
        "|---|---|---|---|---|",
    ]
    for label, *_ in cases:
        lines.append(f"| {label} | {med[(label, 1)]:.1f} | {med[(label, n)]:.1f} | {per_node[label]:.2f} | "
                     f"{samples.total_runs((label, n))} |")
    pw, fl, os_ = per_node["pointwise-sigmoid"], per_node["floor"], per_node["ort-sigmoid"]
    lines += [
        "",
        f"Pointwise sigmoid per call: {pw:.2f} us = floor {fl:.2f} us + ours {pw - fl:.2f} us;"
        f" onnxruntime Sigmoid {os_:.2f} us (Pointwise / Sigmoid = {pw / os_:.2f}).",
        f"LSTM cell step: Pointwise {per_node['pointwise-cell']:.2f} us vs onnxruntime nodes"
        f" {per_node['ort-cell']:.2f} us (ratio {per_node['pointwise-cell'] / per_node['ort-cell']:.2f}).",
    ]
    if args.baseline:
        b1, b2 = per_node["pointwise-sigmoid (baseline)"], per_node["pointwise-cell (baseline)"]
        lines.append(f"Against the baseline library: sigmoid node {b1:.2f} -> {pw:.2f} us (ours above the floor"
                     f" {b1 - fl:.2f} -> {pw - fl:.2f} us); cell step {b2:.2f} -> {per_node['pointwise-cell']:.2f} us.")
    harness.write_report(args.out, "\n".join(lines) + "\n")


main = harness.main_of(cli)


if __name__ == "__main__":
    sys.exit(main())
