"""The corpus benchmark of record: onnxfuse against the peers on torch.onnx exports.

Every corpus model of the zoo (models/corpus: transformers, RNN cells and CNNs, each from both
torch.onnx exporters) is run five ways, each under onnxruntime at ORT_ENABLE_ALL on the CPU:

    ort          the original model (onnxruntime's own optimizations alone)
    ort-transformers  onnxruntime.transformers.optimizer.optimize_model(model, model_type,
                 num_heads, hidden_size) with the model type that fits the architecture
                 (MODEL_TYPES below; opt_level 0: its fusions, then onnxruntime as for the others)
    onnxscript   onnxscript.optimizer.optimize, then onnxscript.rewriter.ort_fusions.optimize_for_ort
    onnxslim     onnxslim.slim(model)
    onnxfuse     onnxfuse.api.optimize(model): the default CPU pipeline, verified, run with the
                 onnxfuse library

For each: kernels per inference (onnxruntime's profiler, 1 thread) and the latency ratio to
onnxruntime alone at 1 and 2 intra-op threads, all five sessions timed interleaved in rounds
(bench.harness.interleave, rotating order; thread CPU time at 1 thread, wall time at 2), at the
model's default dims. Every variant's outputs are compared with the original's on the same seeded
inputs; a tool that raises or changes the outputs is reported as failed for that model and counts
as the original (ratio 1) in the geometric means: its user keeps the original model.

    pip install -e '.[bench]'
    python -m bench.corpus                          # writes bench/results/corpus.md and corpus.json
    python -m bench.corpus --models bert_ts,lstm_dynamo --budget 1
    python -m bench.corpus --render-only            # the report again from corpus.json
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import time
import warnings
from pathlib import Path

import click
import numpy as np
import onnx

from bench import harness

TOOLS = ("ort", "ort-transformers", "onnxscript", "onnxslim", "onnxfuse")
PEERS = ("ort-transformers", "onnxscript", "onnxslim")
FAMILIES = {"transformer": "transformers+RNNs", "rnn": "transformers+RNNs", "cnn": "CNNs"}
# onnxruntime.transformers.optimizer model types by architecture (the part before _ts/_dynamo):
# the closest type its fusions are written for; "bert" is its generic transformer type.
MODEL_TYPES = {"bert": "bert", "gpt2": "gpt2", "llama": "gpt2", "gpt2_decode": "gpt2", "llama_decode": "gpt2",
               "t5_encoder": "t5", "whisper_encoder": "bart",
               "vit": "vit"}
# the attention heads and hidden size of the corpus transformers (models/corpus/build.py)
HEADS, HIDDEN = 4, 64
RTOL, ATOL = 1e-3, 1e-4
DEFAULT_OUT = harness.RESULTS / "corpus.md"


def architecture(name: str) -> str:
    return name.rsplit("_", 1)[0]


@contextlib.contextmanager
def _quiet():
    """Peers print progress and warnings; the report is what this script prints."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            root.setLevel(level)


def optimize_with(tool: str, model: onnx.ModelProto, zm) -> onnx.ModelProto:
    """The model as `tool` rewrites it (a copy; `model` is left as it is)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    if tool == "ort":
        return copy
    if tool == "ort-transformers":
        from onnxruntime.transformers.optimizer import optimize_model

        model_type = MODEL_TYPES.get(architecture(zm.name), "bert")
        with _quiet():
            return optimize_model(copy, model_type=model_type, num_heads=HEADS, hidden_size=HIDDEN,
                                  opt_level=0).model
    if tool == "onnxscript":
        import onnxscript.optimizer
        from onnxscript import ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        with _quiet():
            irm = ir.from_proto(copy)
            onnxscript.optimizer.optimize(irm)
            irm, _ = optimize_for_ort(irm)
            return ir.to_proto(irm)
    if tool == "onnxslim":
        import onnxslim

        with _quiet():
            return onnxslim.slim(copy)
    if tool == "onnxfuse":
        from onnxfuse import api

        # verified as `onnxfuse optimize` does: a model it refuses (exit 1) is a failure here too
        return api.optimize(copy, dims=zm.dims or None, threads=1, count_kernels=False, label=zm.uri).model
    raise ValueError(f"unknown tool {tool!r}")


def _mismatch(expected: list, actual: list) -> str | None:
    if len(expected) != len(actual):
        return f"{len(actual)} outputs, the original has {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e.shape != a.shape:
            return f"output {i} has shape {a.shape}, the original {e.shape}"
        if not np.allclose(a, e, rtol=RTOL, atol=ATOL, equal_nan=True):
            return f"output {i} differs by up to {float(np.nanmax(np.abs(a - e))):.3g}"
    return None


def bench_model(zm, threads_list: list[int], budget_s: float) -> dict:
    """Kernels and interleaved latency of every tool's output for one corpus model."""
    from onnxfuse.profile import count_kernels
    from onnxfuse.runtime import open_session
    from onnxfuse.inputs import random_inputs

    original = zm.load()
    feeds = random_inputs(original, zm.dims, seed=0)
    row = {"name": zm.name, "family": zm.family, "exporter": zm.exporter, "dims": dict(zm.dims), "tools": {}}
    models, one_thread = {}, {}
    reference = None
    for tool in TOOLS:
        entry = row["tools"][tool] = {}
        t0 = time.perf_counter()
        try:
            optimized = optimize_with(tool, original, zm)
            entry["optimize_s"] = round(time.perf_counter() - t0, 3)
            session, _ = open_session(optimized, "cpu", 1, "all")
            outputs = session.run(None, feeds)
            one_thread[tool] = session
            if reference is None:
                reference = outputs
            problem = _mismatch(reference, outputs)
            if problem:
                raise RuntimeError(f"wrong outputs: {problem}")
            entry["kernels"] = count_kernels(optimized, threads=1, dims=zm.dims or None)[0]
        except Exception as e:  # a peer failing on one model is a result, not the end of the run
            if tool == "ort":
                raise
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            harness.log(f"{zm.name}: {tool} failed: {entry['error']}")
            continue
        models[tool] = optimized
    for threads in threads_list:
        sessions = {tool: one_thread[tool] if threads == 1 else open_session(m, "cpu", threads, "all")[0]
                    for tool, m in models.items()}
        samples = harness.interleave({t: harness.session_run(s, feeds) for t, s in sessions.items()},
                                     order="rotate", min_rounds=10, max_rounds=2000, budget_s=budget_s,
                                     warmup=5, sample_ms=3.0, cpu_clock=threads == 1)
        clock = "cpu" if threads == 1 else "wall"
        for tool in models:
            entry = row["tools"][tool]
            entry[f"ms_{threads}t"] = round(samples.median_ms(tool, clock), 4)
            if tool != "ort":
                c = samples.interval("ort", tool, clock)
                entry[f"ratio_{threads}t"] = [round(c["ratio"], 4), round(c["low"], 4), round(c["high"], 4)]
        harness.log(f"{zm.name} {threads} thread(s): " + ", ".join(
            f"{t} {row['tools'][t].get(f'ratio_{threads}t', [1.0])[0]:.3f}" for t in models))
    return row


# ------------------------------------------------------------------------------------- report


def kernel_ratio(row: dict, tool: str) -> float:
    """Kernels of the tool's output over the original's; 1 where the tool failed."""
    k = row["tools"][tool].get("kernels")
    return k / row["tools"]["ort"]["kernels"] if k else 1.0


def latency_ratio(row: dict, tool: str, threads: int) -> float:
    if tool == "ort":
        return 1.0
    r = row["tools"][tool].get(f"ratio_{threads}t")
    return r[0] if r else 1.0


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def best(row: dict, key, digits: int = 3) -> list[str]:
    """The tools with the lowest figure (rounded to `digits`; several when tied), ["ort"] when
    none improves on onnxruntime alone."""
    scores = {t: round(key(row, t), digits) for t in TOOLS if "error" not in row["tools"][t]}
    low = min(scores.values())
    winners = [t for t in TOOLS if scores.get(t) == low]
    return ["ort"] if "ort" in winners else winners


def summary_rows(rows: list[dict], threads_list: list[int]) -> list[list[str]]:
    out = []
    for group in ("transformers+RNNs", "CNNs"):
        members = [r for r in rows if FAMILIES[r["family"]] == group]
        if not members:
            continue
        for tool in TOOLS[1:]:
            failed = sum("error" in r["tools"][tool] for r in members)
            cells = [group, tool, f"{geomean([kernel_ratio(r, tool) for r in members]):.3f}"]
            cells += [f"{geomean([latency_ratio(r, tool, th) for r in members]):.3f}" for th in threads_list]
            cells += [str(sum(tool in best(r, kernel_ratio) for r in members)),
                      str(sum(tool in best(r, lambda r_, t: latency_ratio(r_, t, threads_list[0]), 2)
                              for r in members)),
                      f"{failed}/{len(members)}"]
            out.append(cells)
    return out


def _ratio_cell(entry: dict, threads: int) -> str:
    r = entry.get(f"ratio_{threads}t")
    return f"{r[0]:.3f}" if r else "-"


def model_rows(rows: list[dict], threads_list: list[int]) -> list[list[str]]:
    out = []
    for r in rows:
        ort = r["tools"]["ort"]
        cells = [r["name"], str(ort["kernels"]), f"{ort['ms_1t']:.3f}"]
        for tool in TOOLS[1:]:
            e = r["tools"][tool]
            if "error" in e:
                cells.append("failed")
                continue
            cells.append(f"{e['kernels']} / " + " / ".join(_ratio_cell(e, th) for th in threads_list))
        cells += [" = ".join(best(r, kernel_ratio)),
                  " = ".join(best(r, lambda r_, t: latency_ratio(r_, t, threads_list[0]), 2))]
        out.append(cells)
    return out


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [*harness.table_head([(h, "l") for h in head]), *("| " + " | ".join(r) + " |" for r in rows)]


def render(rows: list[dict], stamp: harness.RunStamp, threads_list: list[int], budget: float, seconds: float) -> str:
    th = "/".join(f"{t}t" for t in threads_list)
    lines = stamp.header("Corpus benchmark: onnxfuse and the peers on torch.onnx exports",
                         "onnxscript", "onnxslim", "torch")
    lines += [
        "Models: the zoo's corpus (models/corpus; `python models/corpus/build.py`), at their default dims. "
        "Kernels per inference: onnxruntime's profiler, CPU provider, ORT_ENABLE_ALL, 1 thread. Latency: "
        f"the five sessions timed interleaved (rotating order, about {budget:g} s of rounds per model and thread "
        "count; thread CPU time at 1 thread, wall time at 2); ratio = median per-round time over onnxruntime "
        "alone's. ort is the exported file as written (models/baseline.json counts it after onnx shape "
        "inference, as onnxfuse loads it, so a few of its ort figures are lower). Fewest kernels: ties listed; "
        "fastest: the lowest 1-thread ratio at two decimals, ties listed. A tool that fails or changes the "
        "outputs (rtol 1e-3, atol 1e-4) counts as ratio 1 in the means. "
        f"The run took {seconds / 60:.1f} minutes.",
        "",
        "Tools: ort-transformers = `onnxruntime.transformers.optimizer.optimize_model` (model type per "
        "architecture: " + ", ".join(f"{a} {t}" for a, t in MODEL_TYPES.items()) + ", the others bert; "
        "opt_level 0); onnxscript = `onnxscript.optimizer.optimize` + `onnxscript.rewriter.ort_fusions."
        "optimize_for_ort`; onnxslim = `onnxslim.slim`; onnxfuse = `onnxfuse.api.optimize` (default CPU "
        "pipeline, verified: a model it refuses counts as failed).",
        "",
        "## Geometric means against onnxruntime alone",
        "",
        *_table(
            ["models", "tool", "kernels", *[f"latency {t} thread{'s' if t > 1 else ''}" for t in threads_list],
             "fewest kernels on", f"fastest ({threads_list[0]}t) on", "failed"],
            summary_rows(rows, threads_list)),
        "",
        "## Per model",
        "",
        f"Each tool: kernels / latency ratio at {th}. ort ms: onnxruntime alone's median at 1 thread.",
        "",
        *_table(["model", "ort kernels", "ort ms", *TOOLS[1:], "fewest kernels", "fastest (1t)"],
                                model_rows(rows, threads_list)),
        "",
    ]
    failures = [(r["name"], t, r["tools"][t]["error"]) for r in rows for t in TOOLS if "error" in r["tools"][t]]
    if failures:
        lines += ["## Failures", "", *[f"- {n}, {t}: {e}" for n, t, e in failures], ""]
    return "\n".join(lines)


@harness.script(__doc__)
@click.option("--models", callback=harness.csv(), default=None, help="corpus models (default: all)")
@click.option("--family", type=click.Choice(["transformer", "rnn", "cnn"]), default=None, help="only this family")
@click.option("--budget", type=float, default=3.0, show_default=True,
              help="seconds of timed rounds per model and thread count")
@click.option("--threads", default="1,2", callback=harness.csv(int), show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=DEFAULT_OUT, show_default=True,
              help="the report (its figures in a .json beside it, written after each model)")
@click.option("--render-only", is_flag=True, help="rewrite the report from its .json, running nothing")
def cli(args, stamp: harness.RunStamp) -> int:
    from onnxfuse import zoo

    corpus = [m for m in zoo.list_models() if m.source == "corpus"]
    if args.models:
        known = {m.name for m in corpus}
        unknown = [n for n in args.models if n not in known]
        if unknown:
            raise click.BadParameter(f"not corpus models: {', '.join(unknown)}", param_hint="--models")
        corpus = [m for m in corpus if m.name in args.models]
    if args.family:
        corpus = [m for m in corpus if m.family == args.family]
    data_path = Path(args.out).with_suffix(".json") if args.out is not None else None
    if args.render_only:
        if data_path is None or not data_path.is_file():
            raise click.UsageError(f"--render-only: no {data_path} to render")
        data = json.loads(data_path.read_text())
        stamp = harness.RunStamp(data["command"], data["started"], tuple(data["load"]), data["commit"])
        harness.write_report(args.out, render(data["models"], stamp, data["threads"], data["budget"], data["seconds"]))
        return 0
    t0 = time.perf_counter()
    rows = []
    for zm in corpus:
        harness.log(f"{zm.name} ...")
        rows.append(bench_model(zm, args.threads, args.budget))
        if data_path is not None:  # after every model: a run cut short still leaves its figures
            data_path.parent.mkdir(parents=True, exist_ok=True)
            data_path.write_text(json.dumps(
                {"command": stamp.command, "started": stamp.started, "load": list(stamp.load), "commit": stamp.commit,
                 "machine": harness.machine(), "versions": harness.versions("onnxscript", "onnxslim"),
                 "threads": args.threads, "budget": args.budget, "seconds": round(time.perf_counter() - t0, 1),
                 "models": rows}, indent=1) + "\n")
    harness.write_report(args.out, render(rows, stamp, args.threads, args.budget, time.perf_counter() - t0))
    return 0


main = harness.main_of(cli)

if __name__ == "__main__":
    raise SystemExit(main())
