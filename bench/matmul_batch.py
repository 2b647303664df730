"""Figures of the linear-layer batching passes on the CPU provider (1 thread, ORT_ENABLE_ALL).

mlp_ensemble: kernels per inference and latency of the original, of the default pipeline
without our passes, and of the default pipeline, at several batch sizes. char_rnn: the same
for the original, the default pipeline without our passes (pointwise fusion alone does the
work there) and the default pipeline. The stacked-ensemble sweep times synthetic 8-member
MLP ensembles of width H (input H, two hidden layers of H, 10 outputs) as they are, with
batch-sibling-matmul, and with batch-ensemble forced (--target cuda rewrites), to back the
CPU rule of batch-ensemble. Latency: interleaved rounds (A B C A B C ...), median and min of
per-round means, so that drift on a shared host hits every model alike.

    python -m bench.matmul_batch --out bench/results/matmul_batch.md
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import click
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench import harness
from onnxfuse import api
from onnxfuse.pipeline import select_passes
from onnxfuse.profile import count_kernels, open_session
from onnxfuse.inputs import random_inputs

RULES = """## Rules these figures back

- batch-sibling-matmul: a Split that stays a real copy (pieces read by GEMMs or graph outputs)
  pays at a few rows and costs 5-13% at 256 rows, so it is applied only with a static row count
  <= 16 (SPLIT_COPY_MAX_ROWS); with a dynamic batch only pieces read in place by pointwise
  regions qualify. This is why the default pipeline leaves mlp_ensemble (dynamic batch, pieces
  read by Gemms) as it is on the CPU.
- batch-ensemble on the CPU: the stacked [K, B, D] form wins at batch 1 for every width, at
  batch 4 only up to 32x32 branch weights, and loses at batch 64 and more: applied only for a
  static batch of 1, or <= 4 with branch weights <= 32x32. On --target cuda it is applied
  always (not measured here: no GPU on this host).
- hoist-matmul-over-gather: char_rnn's 16 per-step input projections of layer 0 become one
  Gather of a precomputed embedding @ W_ih + b table (16 Gemm kernels fewer)."""

OURS = {"hoist-matmul-over-gather", "batch-ensemble", "batch-sibling-matmul", "merge-xh-matmul"}


def without_ours(target: str = "cpu") -> list[str]:
    return [p.name for p in select_passes(None, target) if p.name not in OURS]


def optimized(model: onnx.ModelProto, passes, target="cpu") -> onnx.ModelProto:
    return api.optimize(model, passes=passes, target=target, count_kernels=False, verify_outputs=True).model


def forced_siblings(model: onnx.ModelProto) -> onnx.ModelProto:
    """batch-sibling-matmul with its Split-copy row limit lifted (to measure what the limit avoids)."""
    from onnxfuse.passes import matmul_batch

    saved = matmul_batch.SPLIT_COPY_MAX_ROWS
    matmul_batch.SPLIT_COPY_MAX_ROWS = 1 << 62
    try:
        static = onnx.ModelProto()
        static.CopyFrom(model)
        for i in static.graph.input:  # a static batch, so that the row limit is what decides
            for dim in i.type.tensor_type.shape.dim:
                if dim.dim_param:
                    dim.dim_value = 1
        out = optimized(static, ["batch-sibling-matmul"])
    finally:
        matmul_batch.SPLIT_COPY_MAX_ROWS = saved
    # Put the symbolic batch back: the rewrite does not depend on it.
    for a, b in zip(out.graph.input, model.graph.input):
        a.type.CopyFrom(b.type)
    for a, b in zip(out.graph.output, model.graph.output):
        a.type.CopyFrom(b.type)
    del out.graph.value_info[:]
    return out


def interleaved(models: dict[str, onnx.ModelProto], feeds, seconds: float) -> dict[str, tuple[float, float]]:
    """(median, min) ms per run of each model over A B C rounds, each sample about 2 ms of runs."""
    sessions = {k: open_session(m, "cpu", 1, "all")[0] for k, m in models.items()}
    samples = harness.interleave({k: harness.session_run(s, feeds) for k, s in sessions.items()}, order="cycle",
                                 min_rounds=20, budget_s=seconds, warmup=10, sample_ms=2.0)
    return {k: (samples.median_ms(k), samples.min_ms(k)) for k in sessions}


def table(rows: list[list[str]], head: list[str]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def ensemble(width: int, members: int = 8, classes: int = 10) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits, outs = [], [], []
    dims = [width, width, width, classes]
    for k in range(members):
        cur = "x"
        for layer in range(3):
            w = (rng.standard_normal((dims[layer], dims[layer + 1])) / np.sqrt(dims[layer])).astype(np.float32)
            b = (rng.standard_normal(dims[layer + 1]) * 0.1).astype(np.float32)
            inits += [numpy_helper.from_array(w, f"w{k}_{layer}"), numpy_helper.from_array(b, f"b{k}_{layer}")]
            nodes.append(helper.make_node("Gemm", [cur, f"w{k}_{layer}", f"b{k}_{layer}"], [f"l{k}_{layer}"]))
            cur = f"l{k}_{layer}"
            if layer < 2:
                nodes.append(helper.make_node("Relu", [cur], [f"r{k}_{layer}"]))
                cur = f"r{k}_{layer}"
        outs.append(cur)
    nodes.append(helper.make_node("Concat", outs, ["y"], axis=1))
    g = helper.make_graph(nodes, "ensemble", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", members * classes])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


@harness.script(__doc__)
@click.option("--out", help="write the markdown here (default: print it only)")
@click.option("--seconds", type=float, default=3.0, show_default=True, help="timing per configuration")
@click.option("--batches", callback=harness.csv(int), default="1,4,64,256", show_default=True)
@click.option("--widths", callback=harness.csv(int), default="16,32,64,128", show_default=True)
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int | None:
    parts = [f"Command: `{stamp.command}`\n{stamp.line()} CPU provider, 1 thread, ORT_ENABLE_ALL."]

    mlp = onnx.load(str(harness.ROOT / "models" / "mlp_ensemble.onnx"))
    variants = {"original": mlp, "default pipeline": optimized(mlp, None),
                "siblings, copy rule lifted": forced_siblings(mlp), "stacked (cuda rewrite)": optimized(mlp, ["batch-ensemble"], "cuda")}
    kern = {k: count_kernels(m, "cpu", 1, "all", {"batch": 4})[0] for k, m in variants.items()}
    rows = []
    for b in args.batches:
        t = interleaved(variants, random_inputs(mlp, {"batch": b}, 0), args.seconds)
        base = t["original"][1]
        rows.append([str(b)] + [f"{t[k][1]:.4f} ({t[k][1] / base:.2f}x), median {t[k][0]:.4f}" for k in variants])
    parts.append("## mlp_ensemble\n\nKernels per inference (batch 4): " + ", ".join(f"{k} {v}" for k, v in kern.items()))
    parts.append("Latency, ms: min of per-round means (ratio to the original's min), and the median "
                 "(on a loaded shared host the median is noisy; the min is the comparable figure):\n\n"
                 + table(rows, ["batch"] + list(variants)))

    rnn = onnx.load(str(harness.ROOT / "models" / "char_rnn.onnx"))
    variants = {"original": rnn, "default without ours": optimized(rnn, without_ours()), "default pipeline": optimized(rnn, None)}
    kern = {k: count_kernels(m, "cpu", 1, "all")[0] for k, m in variants.items()}
    t = interleaved(variants, random_inputs(rnn, {}, 0), args.seconds)
    parts.append("## char_rnn\n\n" + table(
        [[k, str(kern[k]), f"{t[k][1]:.4f} ({t[k][1] / t['original'][1]:.2f}x)", f"{t[k][0]:.4f}"] for k in variants],
        ["model", "kernels", "latency ms, min (ratio)", "median"]))

    rows = []
    for width in args.widths:
        m = ensemble(width)
        v = {"as is": m, "siblings, copy rule lifted": forced_siblings(m), "stacked": optimized(m, ["batch-ensemble"], target="cuda")}
        for b in args.batches:
            t = interleaved(v, random_inputs(m, {"batch": b}, 0), args.seconds / 2)
            base = t["as is"][1]
            rows.append([str(width), str(b)] + [f"{t[k][1]:.4f} ({t[k][1] / base:.2f}x)" for k in v])
        harness.log(f"width {width} done")
    parts.append("## Stacked ensemble on the CPU provider (rule of batch-ensemble)\n\n8 members, width H; "
                 "latency ms, min of per-round means (ratio to as is):\n\n" + table(rows, ["H", "batch", "as is", "siblings, copy rule lifted", "stacked"]))
    parts.append(RULES)
    harness.write_report(args.out, "# Linear-layer batching: measured figures\n\n" + "\n\n".join(parts) + "\n")


main = harness.main_of(cli)

if __name__ == "__main__":
    sys.exit(main())
