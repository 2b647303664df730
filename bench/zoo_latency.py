"""Is any zoo model slower after onnxfuse? Every zoo model, optimized with the default CPU
pipeline (outputs verified, as `onnxfuse optimize` does), against the original, both run by
onnxruntime with ORT_ENABLE_ALL on the CPU provider.

Two answers, the first exact, the second measured:

1. The graph onnxruntime runs. Each session saves the graph it executes after all of its own
   optimizations (SessionOptions.optimized_model_filepath). Where the two are the same graph
   (the same nodes, attributes, edges and weight shapes, compared as DAGs, so the node order
   may differ), the kernels run are the same and the ratio is 1 by construction; nothing is
   timed (unless --time-same, which times them as a check of the timing itself). This is how a
   model onnxfuse leaves for onnxruntime to fuse (CNN Conv+BN+Relu on the CPU) is shown to cost
   nothing. Whether the weights are bit-identical is reported too (they
   differ where onnxfuse folded a BatchNormalization that onnxruntime would have folded itself).

2. The rest are timed, interleaved: rounds of A B B A, one sample being enough back-to-back
   inferences to last --sample-ms, the ratio (optimized / original) taken per round. With one
   intra-op thread the clock is the calling thread's CPU time (onnxruntime runs every kernel of a
   one-thread session on the calling thread), which other processes on a shared machine do not
   inflate by preempting it; wall time is shown beside it. With more threads only wall time is
   meaningful (pool threads spin while waiting). Reported: the median of the per-round ratios
   and a 95% bootstrap interval of that median. A model counts as "at most 1.02" when the upper
   end of the interval is at most 1.02.

    python -m bench.zoo_latency [--models a,b] [--threads 1,2] [--budget 20] [--out FILE.md]
"""
from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
import onnx

from bench import harness

DEFAULT_OUT = harness.RESULTS / "zoo_latency.md"
LIMIT = 1.02


def graph_signature(model: onnx.ModelProto) -> tuple[list[str], list[str], list[str]]:
    """(sorted node hashes, output hashes, sorted weight-content hashes). A node's hash covers
    its domain, op type, attributes and the hashes of what feeds it (graph inputs by name,
    weights by shape and type), so equal signatures mean the same DAG, in any node order."""
    g = model.graph
    weights = {t.name: t for t in g.initializer}
    value = {i.name: "input:" + i.name for i in g.input if i.name not in weights}
    value.update({t.name: f"weight:{tuple(t.dims)}:{t.data_type}" for t in g.initializer})
    nodes = []
    for n in g.node:
        attrs = sorted((a.name, a.SerializeToString().hex()) for a in n.attribute)
        key = repr((n.domain, n.op_type, [value.get(x, "unknown:" + x) if x else "" for x in n.input], attrs))
        digest = hashlib.sha1(key.encode()).hexdigest()
        nodes.append(digest)
        for j, out in enumerate(n.output):
            value[out] = f"{digest}:{j}"
    outputs = [value.get(o.name, "unknown:" + o.name) for o in g.output]
    contents = sorted(
        hashlib.sha1(onnx.numpy_helper.to_array(t).tobytes()).hexdigest() for t in g.initializer
    )
    return sorted(nodes), outputs, contents


def timed_rounds(sess_a, sess_b, feeds, threads: int, budget_s: float, sample_ms: float,
                 min_rounds: int, max_rounds: int) -> dict:
    """Interleaved A B B A rounds (harness.interleave); per-round ratios b / a on CPU time (one
    thread) and wall time, each with its median and 95% bootstrap interval."""
    samples = harness.interleave({"a": harness.session_run(sess_a, feeds), "b": harness.session_run(sess_b, feeds)},
                                 order="mirror", min_rounds=min_rounds, max_rounds=max_rounds, budget_s=budget_s,
                                 warmup=5, sample_ms=sample_ms, cpu_clock=threads == 1)
    result = {"rounds": samples.rounds, "burst": samples.runs["a"]}
    for clock in ("wall", "cpu") if threads == 1 else ("wall",):
        result[clock] = samples.interval("a", "b", clock)
    return result


def bench_model(zm, threads_list: list[int], args, log) -> dict:
    from onnxfuse import api, runtime
    from onnxfuse.profile import needs_library, open_session
    from onnxfuse.inputs import random_inputs

    original = zm.load()
    t0 = time.perf_counter()
    result = api.optimize(str(zm.path), dims=zm.dims or None, seed=args.seed)
    optimized = result.model
    lib = needs_library(optimized, "cpu")
    entry = {
        "model": zm.name,
        "fused": api.fused_ops(optimized),
        "kernels": [result.summary.get("kernels_before"), result.summary.get("kernels_after")],
        "optimize_s": time.perf_counter() - t0,
    }
    sig_a = graph_signature(runtime.executed_graph(original, False))
    sig_b = graph_signature(runtime.executed_graph(optimized, lib))
    entry["same_graph"] = sig_a[:2] == sig_b[:2]
    entry["same_weights"] = entry["same_graph"] and sig_a[2] == sig_b[2]
    entry["timing"] = {}
    if entry["same_graph"] and not args.time_same:
        log(f"{zm.name}: onnxruntime runs the same graph for both; not timed")
        return entry
    feeds = random_inputs(optimized, zm.dims, args.seed)
    for threads in threads_list:
        sess_a, _ = open_session(original, "cpu", threads, "all", with_library=False)
        sess_b, _ = open_session(optimized, "cpu", threads, "all", with_library=lib)
        t = timed_rounds(sess_a, sess_b, feeds, threads, args.budget, args.sample_ms, args.min_rounds, args.max_rounds)
        entry["timing"][threads] = t
        main = t.get("cpu", t["wall"])
        log(f"{zm.name} threads {threads}: {main['ratio']:.3f} [{main['low']:.3f}, {main['high']:.3f}] "
            f"({'cpu' if 'cpu' in t else 'wall'}), wall {t['wall']['ratio']:.3f}, {t['rounds']} rounds")
        del sess_a, sess_b
    return entry


def verdict(entry: dict) -> str:
    t1 = entry["timing"].get(1)
    if entry["same_graph"]:
        return "same graph: 1 by construction" + (" (timed as a check)" if t1 else "")
    if not t1:
        return "not timed at 1 thread"
    c = t1["cpu"]
    if c["high"] <= 1.0:
        return "faster"
    if c["high"] <= LIMIT:
        return f"at most {LIMIT}"
    if c["low"] > LIMIT:
        return f"SLOWER than {LIMIT}"
    return "inconclusive"


def _cell(t: dict | None, clock: str) -> str:
    if not t or clock not in t:
        return ""
    c = t[clock]
    return f"{c['ratio']:.3f} [{c['low']:.3f}, {c['high']:.3f}]"


def render(entries: list[dict], threads_list: list[int], stamp: harness.RunStamp) -> str:
    lines = [
        *stamp.header("No zoo model slower: the graph onnxruntime runs, and interleaved CPU time"),
        "Each model is optimized with the default CPU pipeline (outputs verified), then both run by onnxruntime "
        "(CPU provider, ORT_ENABLE_ALL, the zoo's default dims, seeded random inputs). "
        "Column *graph*: whether the graphs onnxruntime executes after its own optimizations are the same DAG "
        "(then the ratio is 1 by construction and nothing is timed; *weights* says whether the weights are "
        "bit-identical too). Otherwise: ratio optimized / original, median of interleaved A B B A rounds with a "
        "95% bootstrap interval; *cpu* is the calling thread's CPU time (one intra-op thread), *wall* wall time.",
        "",
    ]
    head = "| model | fused ops | kernels | graph | weights |"
    rule = "|---|---|---|---|---|"
    for th in threads_list:
        if th == 1:
            head += " 1 thread, cpu | 1 thread, wall |"
            rule += "---|---|"
        else:
            head += f" {th} threads, wall |"
            rule += "---|"
    head += " rounds | verdict (1 thread, cpu) |"
    rule += "---|---|"
    lines += [head, rule]
    for e in entries:
        fused = ", ".join(f"{k} x{v}" for k, v in e["fused"].items()) or "none"
        k = e["kernels"]
        row = f"| {e['model']} | {fused} | {k[0]} -> {k[1]} | {'same' if e['same_graph'] else 'differs'} | " \
              f"{'same' if e['same_weights'] else ('differ' if e['same_graph'] else '')} |"
        for th in threads_list:
            t = e["timing"].get(th)
            row += f" {_cell(t, 'cpu')} | {_cell(t, 'wall')} |" if th == 1 else f" {_cell(t, 'wall')} |"
        rounds = "/".join(str(e["timing"][th]["rounds"]) for th in threads_list if th in e["timing"])
        row += f" {rounds} | {verdict(e)} |"
        lines.append(row)
    worst = [e for e in entries if 1 in e["timing"]]
    if worst:
        w = max(worst, key=lambda e: e["timing"][1]["cpu"]["high"])
        c = w["timing"][1]["cpu"]
        lines += ["", f"Highest upper bound at 1 thread (cpu): {w['model']}, {c['ratio']:.3f} [{c['low']:.3f}, {c['high']:.3f}]."]
    lines += [
        "",
        "Per-model median latencies (ms, original / optimized):",
        "",
    ]
    for e in entries:
        for th, t in e["timing"].items():
            for clock in ("cpu", "wall"):
                if clock in t:
                    lines.append(f"- {e['model']}, {th} thread{'s' if th > 1 else ''}, {clock}: "
                                 f"{t[clock]['ms_a']:.4f} / {t[clock]['ms_b']:.4f} ({t['rounds']} rounds of {t['burst']} runs)")
    return "\n".join(lines) + "\n"


@harness.script(__doc__)
@click.option("--models", callback=harness.csv(), help="comma-separated zoo names (default: every zoo model)")
@click.option("--threads", default="1,2", callback=harness.csv(int), show_default=True,
              help="intra-op thread counts")
@click.option("--budget", type=float, default=20.0, show_default=True,
              help="seconds of timed rounds per model and thread count")
@click.option("--sample-ms", type=float, default=2.0, show_default=True, help="about how long one sample lasts")
@click.option("--min-rounds", type=int, default=15, show_default=True)
@click.option("--max-rounds", type=int, default=400, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--time-same", is_flag=True,
              help="time models whose executed graphs are the same too (a check of the timing: expect 1)")
@click.option("--out", type=click.Path(path_type=Path), default=DEFAULT_OUT, show_default=True)
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int | None:
    from onnxfuse import zoo

    threads_list = args.threads
    entries = [bench_model(zoo.get(n), threads_list, args, harness.log) for n in args.models or zoo.names()]
    harness.write_report(args.out, render(entries, threads_list, stamp))


main = harness.main_of(cli)

if __name__ == "__main__":
    sys.exit(main())
