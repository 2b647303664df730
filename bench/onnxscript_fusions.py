"""Exported transformers: kernels per inference (CPU, one thread, ORT_ENABLE_ALL) under
onnxruntime alone, onnxscript's optimizer + ort_fusions alone (the peer), onnxfuse without its
onnxscript-fusions stage, and onnxfuse's default pipeline; with --budget, the 1-thread latency of
the peer's and onnxfuse's models against onnxruntime alone (thread CPU time, interleaved A B B A
rounds, bench/harness.py's interleave; ratio = model / onnxruntime alone, median).

The models come from bench/transformer_exports.py (needs torch and transformers):

    python -m bench.transformer_exports exports
    python -m bench.onnxscript_fusions exports/*.onnx [--budget 4] [--out bench/results/onnxscript_fusions.md]
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import click
import onnx

from bench import harness


def onnxscript_peer(path: str) -> onnx.ModelProto:
    import onnx_ir as ir
    from onnxscript import optimizer
    from onnxscript.rewriter import ort_fusions

    m = ir.load(path)
    optimizer.optimize(m)
    m, _ = ort_fusions.optimize_for_ort(m)
    return ir.to_proto(m)


def kernels(model: onnx.ModelProto) -> int | str:
    from onnxfuse.profile import count_kernels

    try:
        return count_kernels(model, threads=1)[0]
    except Exception as e:  # noqa: BLE001 - a peer's model that onnxruntime refuses is a result
        return "fails: " + str(e).splitlines()[0][-90:]


def latency_ratio(original: onnx.ModelProto, model: onnx.ModelProto, budget: float) -> float | None:
    from onnxfuse import runtime
    from onnxfuse.inputs import random_inputs

    feeds = random_inputs(original, {}, 0)
    a = runtime.make_session(original, threads=1)
    b = runtime.make_session(model, threads=1)
    samples = harness.interleave({"ort": harness.session_run(a, feeds), "model": harness.session_run(b, feeds)},
                                 min_rounds=10, budget_s=budget, sample_ms=2.0, cpu_clock=True)
    return samples.ratio("ort", "model", "cpu")


def geomean(xs):
    xs = [x for x in xs if isinstance(x, (int, float)) and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


@harness.script(__doc__)
@click.argument("models", nargs=-1, required=True)
@click.option("--budget", type=float, default=0.0, show_default=True,
              help="seconds of timed rounds per model and variant (0: no timing)")
@click.option("--out", type=click.Path(path_type=Path), default=None)
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int:
    import onnxfuse
    from onnxfuse.pipeline import select_passes

    without_stage = [p.name for p in select_passes(None, "cpu") if p.name != "onnxscript-fusions"]
    rows = []
    for path in args.models:
        name = Path(path).stem
        original = onnx.load(path)
        row = {"model": name, "ort": kernels(original)}
        try:
            peer = onnxscript_peer(path)
            row["onnxscript"] = kernels(peer)
        except Exception as e:  # noqa: BLE001
            peer, row["onnxscript"] = None, "fails: " + str(e).splitlines()[0][-90:]
        for label, passes in (("onnxfuse, no stage", without_stage), ("onnxfuse", None)):
            try:
                r = onnxfuse.optimize(path, passes=passes)
                row[label] = r.summary["kernels_after"]
                row[label + " model"] = r.model
                row[label + " contrib"] = sorted({n.op_type for n in r.model.graph.node if n.domain == "com.microsoft"})
            except Exception as e:  # noqa: BLE001
                row[label] = "fails: " + str(e).splitlines()[0][-90:]
        if args.budget > 0:
            if peer is not None and isinstance(row["onnxscript"], int):
                row["lat onnxscript"] = latency_ratio(original, peer, args.budget)
            if "onnxfuse model" in row:
                row["lat onnxfuse"] = latency_ratio(original, row["onnxfuse model"], args.budget)
        harness.log(f"{name} {({k: v for k, v in row.items() if not k.endswith('model')})}")
        rows.append(row)

    cols = ["ort", "onnxscript", "onnxfuse, no stage", "onnxfuse"]
    lines = stamp.header("Exported transformers: onnxscript's fusions as a stage of onnxfuse", "onnxscript", "torch")
    lines += [
        "Kernels per inference (onnxruntime CPU provider, one thread, ORT_ENABLE_ALL; in brackets the ratio to",
        "onnxruntime alone). onnxscript = its optimizer + `ort_fusions.optimize_for_ort` alone; onnxfuse, no",
        "stage = the default pipeline without `onnxscript-fusions`. Models: bench/transformer_exports.py",
        "(`_ts`: TorchScript exporter, opset 17; `_dynamo`: torch.export-based exporter, opset 18).",
        "",
        "| model | " + " | ".join(cols) + " | contrib ops in onnxfuse's output |" + (" latency onnxscript | latency onnxfuse |" if args.budget else ""),
        "|---|" + "---:|" * len(cols) + "---|" + ("---:|---:|" if args.budget else ""),
    ]
    for row in rows:
        cells = []
        for c in cols:
            v = row.get(c)
            if isinstance(v, int) and isinstance(row["ort"], int) and c != "ort":
                cells.append(f"{v} ({v / row['ort']:.2f})")
            else:
                cells.append(str(v))
        line = f"| {row['model']} | " + " | ".join(cells) + " | " + ", ".join(row.get("onnxfuse contrib", [])) + " |"
        if args.budget:
            line += "".join(f" {row[k]:.3f} |" if isinstance(row.get(k), float) else " - |" for k in ("lat onnxscript", "lat onnxfuse"))
        lines.append(line)
    gm = ["geometric mean of ratios", "1.00"]
    for c in cols[1:]:
        gm.append(f"{geomean([row[c] / row['ort'] for row in rows if isinstance(row.get(c), int)]):.2f}")
    lines.append("| " + " | ".join(gm) + " | |" + (" %.3f | %.3f |" % (geomean([r.get("lat onnxscript") for r in rows]), geomean([r.get("lat onnxfuse") for r in rows])) if args.budget else ""))
    lines.append("")
    harness.write_report(args.out, "\n".join(lines))
    return 0


main = harness.main_of(cli)

if __name__ == "__main__":
    raise SystemExit(main())
