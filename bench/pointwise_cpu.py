"""The CPU Pointwise kernel vs the same op chain as separate onnxruntime nodes.

Each chain is a run of elementwise ops that onnxruntime's own graph optimizer (ORT_ENABLE_ALL)
does not fuse: arithmetic with a second input and constants, mixed with Tanh, Sigmoid and Exp
(--cycle transcendental, the default), or cheap arithmetic alone (--cycle arithmetic: Mul, Add,
Max, Sub, Div, Abs), where separate nodes are bound by their passes over memory.
For every chain length, size and thread count both models run in onnxruntime's CPU provider,
interleaved (A B B A per round, so drift on a shared host hits both alike), inputs and outputs
bound once (IOBinding) so both sides pay the same fixed costs; the table shows medians and
ratio = median(separate nodes) / median(Pointwise), above 1 when the fused kernel is faster.
Each sample is back-to-back runs of one model lasting about --sample-ms, timed as one: with two
intra-op threads, a session's pool thread spins for a while after its run, and on a 2-CPU
machine that spinning took a CPU from the next model's first run (one run per sample showed
2-thread Pointwise no faster than 1-thread while a third session sped up 2x in the same rounds).
Outputs of the two models are compared before timing.

Where a chain has elementary functions, a third model times them alone: one Pointwise node with
only the chain's Tanh, Sigmoid and Exp, in order, then one Add of y when the chain reads y. That
is a floor for any fused kernel with these functions (one pass over the same memory plus their
arithmetic), so separate / that floor is the most fusion can gain on the chain without cheaper
functions: the table's "ceiling".

    python -m bench.pointwise_cpu --out bench/results/pointwise_cpu.md
    python -m bench.pointwise_cpu --sizes 1e5,1e6 --chains 4 --threads 1 --seconds 0.5
    python -m bench.pointwise_cpu --cycle arithmetic --out bench/results/pointwise_cpu_arithmetic.md
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import click
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from bench import harness
from onnxfuse import runtime
from onnxfuse.program import Program

# One step of a chain: (ONNX op, second operand: "y" the second input, a float constant, or None;
# program opcode). The cycles keep values bounded for any length and never form a pattern
# onnxruntime fuses (x * sigmoid(a * x), Add + LayerNorm, Gelu forms...).
CYCLES = {
    # A third of the ops transcendental: bounded by their arithmetic once fused.
    "transcendental": [
        ("Mul", 0.9, "mul"),
        ("Add", "y", "add"),
        ("Tanh", None, "tanh"),
        ("Mul", "y", "mul"),
        ("Sigmoid", None, "sigmoid"),
        ("Sub", 0.25, "sub"),
        ("Exp", None, "exp"),
        ("Add", "y", "add"),
    ],
    # Cheap arithmetic only (bias, scale, clamp, residual): separate nodes are bound by their
    # passes over memory, which fusion removes.
    "arithmetic": [
        ("Mul", 0.9, "mul"),
        ("Add", "y", "add"),
        ("Max", 0.1, "max"),
        ("Sub", 0.25, "sub"),
        ("Mul", "y", "mul"),
        ("Div", 1.5, "div"),
        ("Abs", None, "abs"),
        ("Add", "y", "add"),
    ],
}
CYCLE = CYCLES["transcendental"]


def chain_models(length: int, cycle: list = CYCLE) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(separate nodes, one Pointwise node) computing the same chain over x and y: float[n]."""
    nodes, inits = [], []
    prog = Program()
    x, y = prog.add_input("f32"), prog.add_input("f32")
    cur_name, cur_val = "x", x
    for k in range(length):
        op, operand, opcode = cycle[k % len(cycle)]
        out = "out" if k == length - 1 else f"t{k}"
        if operand is None:
            nodes.append(helper.make_node(op, [cur_name], [out]))
            cur_val = prog.emit(opcode, cur_val)
        elif operand == "y":
            nodes.append(helper.make_node(op, [cur_name, "y"], [out]))
            cur_val = prog.emit(opcode, cur_val, y)
        else:
            c = f"c{k}"
            inits.append(numpy_helper.from_array(np.array(operand, np.float32), c))
            nodes.append(helper.make_node(op, [cur_name, c], [out]))
            cur_val = prog.emit(opcode, cur_val, float(np.float32(operand)))
        cur_name = out
    prog.add_output(cur_val, "f32")
    io = (
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]), helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n"])],
    )
    opsets = [helper.make_opsetid("", 17)]
    separate = helper.make_model(helper.make_graph(nodes, "chain", *io, inits), opset_imports=opsets)
    fused_node = helper.make_node("Pointwise", ["x", "y"], ["out"], domain="onnxfuse", program=prog.to_text())
    fused = helper.make_model(
        helper.make_graph([fused_node], "chain_fused", *io), opset_imports=opsets + [helper.make_opsetid("onnxfuse", 1)]
    )
    separate.ir_version = fused.ir_version = 10
    return separate, fused


ELEMENTARY = {"tanh", "sigmoid", "exp"}


def functions_only_model(length: int, cycle: list = CYCLE) -> onnx.ModelProto | None:
    """One Pointwise node applying only the chain's elementary functions to x, in order, then adding
    y if the chain reads it (the same memory traffic); None when the chain has none."""
    steps = [cycle[k % len(cycle)] for k in range(length)]
    opcodes = [opcode for _, operand, opcode in steps if operand is None and opcode in ELEMENTARY]
    if not opcodes:
        return None
    prog = Program()
    cur, y = prog.add_input("f32"), prog.add_input("f32")
    for opcode in opcodes:
        cur = prog.emit(opcode, cur)
    if any(operand == "y" for _, operand, _ in steps):
        cur = prog.emit("add", cur, y)
    prog.add_output(cur, "f32")
    io = (
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]), helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n"])],
    )
    node = helper.make_node("Pointwise", ["x", "y"], ["out"], domain="onnxfuse", program=prog.to_text())
    model = helper.make_model(helper.make_graph([node], "functions_only", *io),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onnxfuse", 1)])
    model.ir_version = 10
    return model


class Runner:
    """A session with its inputs and output bound once."""

    def __init__(self, model: onnx.ModelProto, threads: int, x: np.ndarray, y: np.ndarray):
        self.session = runtime.make_session(model, threads=threads, level="all")
        self.out = np.empty_like(x)
        self.binding = self.session.io_binding()
        for name, arr in (("x", x), ("y", y), ("out", self.out)):
            value = ort.OrtValue.ortvalue_from_numpy(arr)
            if name == "out":
                self.binding.bind_ortvalue_output(name, value)
                self._out_value = value
            else:
                self.binding.bind_ortvalue_input(name, value)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)

    def result(self) -> np.ndarray:
        self.session.run_with_iobinding(self.binding)
        return self._out_value.numpy().copy()


def bench_case(length: int, size: int, threads: int, seconds: float, min_rounds: int, max_rounds: int,
               cycle: list = CYCLE, sample_ms: float = 2.0) -> dict:
    rng = np.random.default_rng(size + length)
    x = rng.standard_normal(size).astype(np.float32)
    y = rng.standard_normal(size).astype(np.float32)
    separate, fused = chain_models(length, cycle)
    floor_model = functions_only_model(length, cycle)
    runners = [Runner(separate, threads, x, y), Runner(fused, threads, x, y)]
    if floor_model is not None:
        runners.append(Runner(floor_model, threads, x, y))
    np.testing.assert_allclose(runners[1].result(), runners[0].result(), rtol=1e-5, atol=1e-5)
    # A B C C B A rounds; runs per sample: enough to last sample_ms for the slowest model.
    samples = harness.interleave({i: r.run for i, r in enumerate(runners)}, order="mirror", min_rounds=min_rounds,
                                 max_rounds=max_rounds, budget_s=seconds, warmup=3, sample_ms=sample_ms)
    med = [samples.median_ms(i) for i in range(len(runners))]
    return {"length": length, "size": size, "threads": threads, "ms": tuple(med), "ratio": med[0] / med[1],
            "ceiling": med[0] / med[2] if len(med) > 2 else None, "runs": samples.total_runs(0)}


@harness.script(__doc__)
@click.option("--chains", callback=harness.csv(int), default="2,4,8,16", show_default=True, help="chain lengths")
@click.option("--sizes", callback=harness.csv(float), default="1e3,1e4,1e5,1e6,1e7", show_default=True,
              help="elements per input")
@click.option("--threads", callback=harness.csv(int), default="1,2", show_default=True)
@click.option("--seconds", type=float, default=1.0, show_default=True, help="time per case (each model), at least")
@click.option("--sample-ms", type=float, default=2.0, show_default=True,
              help="back-to-back runs per sample, about this long")
@click.option("--min-rounds", type=int, default=5, show_default=True, help="A B B A rounds per case, at least")
@click.option("--max-rounds", type=int, default=2000, show_default=True, help="rounds per case, at most")
@click.option("--cycle", type=click.Choice(sorted(CYCLES)), default="transcendental", show_default=True,
              help="the ops the chains cycle through")
@click.option("--out", help="write the markdown report here")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int | None:

    rows = []
    for threads in args.threads:
        for size in (int(s) for s in args.sizes):
            for length in args.chains:
                # A run of the 1e7 cases is long enough that a few rounds give a stable median.
                rounds = (args.min_rounds, 10) if size >= 10**7 else (args.min_rounds, args.max_rounds)
                r = bench_case(length, size, threads, args.seconds, *rounds, cycle=CYCLES[args.cycle],
                               sample_ms=args.sample_ms)
                rows.append(r)
                floor = f", functions only {r['ms'][2]:9.3f} ms, ceiling x{r['ceiling']:.2f}" if r["ceiling"] else ""
                harness.log(f"threads {threads} n {size:>9} chain {length:>2}: separate {r['ms'][0]:9.3f} ms, "
                            f"Pointwise {r['ms'][1]:9.3f} ms, x{r['ratio']:.2f}{floor} ({r['runs']} runs each)")

    lines = [
        *stamp.header(f"Pointwise CPU kernel vs separate onnxruntime nodes ({args.cycle} chains)"),
        "Chains over x, y: float32[n] of ops onnxruntime does not fuse, cycling "
        + ", ".join(f"{op}({'x' if o is None else 'x, ' + str(o)})" for op, o, _ in CYCLES[args.cycle])
        + "; ORT_ENABLE_ALL for both models, intra-op threads as listed; inputs and output bound once"
        f" (IOBinding). Models timed interleaved (A B B A per round), each sample back-to-back runs lasting"
        f" about {args.sample_ms:g} ms; median time per run shown; ratio = separate / Pointwise (> 1: Pointwise"
        " faster).",
    ]
    floors = any(r["ceiling"] for r in rows)
    if floors:
        lines += [
            "Functions only: one Pointwise node with just the chain's elementary functions and one Add of y"
            " (the same memory traffic), timed in the same rounds (A B C C B A); ceiling = separate /"
            " functions only, the most a fused kernel with these functions can gain on the chain.",
        ]
    lines += ["", "| threads | elements | chain | separate nodes ms | Pointwise ms | ratio |"
              + (" functions only ms | ceiling |" if floors else "") + " runs each |",
              "|---|---|---|---|---|---|" + ("---|---|" if floors else "") + "---|"]
    for r in rows:
        floor = ""
        if floors:
            floor = f" {r['ms'][2]:.4f} | {r['ceiling']:.2f} |" if r["ceiling"] else " - | - |"
        lines.append(f"| {r['threads']} | {r['size']:.0e} | {r['length']} | {r['ms'][0]:.4f} | {r['ms'][1]:.4f} | "
                     f"{r['ratio']:.2f} |{floor} {r['runs']} |")
    worst2 = min((r for r in rows if r["length"] == 2), key=lambda r: r["ratio"], default=None)
    long_big = [r for r in rows if r["length"] >= 4 and r["size"] >= 10**5]
    lines.append("")
    if worst2:
        lines.append(f"Worst 2-op ratio: {worst2['ratio']:.2f} (n {worst2['size']:.0e}, {worst2['threads']} threads).")
    if long_big:
        w = min(long_big, key=lambda r: r["ratio"])
        lines.append(f"Worst ratio for chains >= 4 ops on >= 1e5 elements: {w['ratio']:.2f} "
                     f"(chain {w['length']}, n {w['size']:.0e}, {w['threads']} threads).")
        under = [r for r in long_big if r["ratio"] < 2]
        if under:
            lines.append("Under 2x among them (ratio / ceiling): " + "; ".join(
                f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}, n {r['size']:.0e}, chain {r['length']}: "
                f"{r['ratio']:.2f} / " + (f"{r['ceiling']:.2f}" if r["ceiling"] else "-") for r in under) + ".")
    cpus = os.cpu_count() or 1
    if any(r["threads"] >= cpus for r in rows):
        lines.append(f"Rows with {cpus} or more threads use every CPU of this machine: their wall times also carry"
                     " whatever else the host runs there, and scatter far more between runs than 1-thread rows.")
    harness.write_report(args.out, "\n".join(lines) + "\n")


main = harness.main_of(cli)


if __name__ == "__main__":
    sys.exit(main())
