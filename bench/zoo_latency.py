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

    python bench/zoo_latency.py [--models a,b] [--threads 1,2] [--budget 20] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "zoo_latency.md"
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


def bootstrap_median_interval(ratios: np.ndarray, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(ratios), size=(reps, len(ratios)))
    medians = np.median(ratios[picks], axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def timed_rounds(sess_a, sess_b, feeds, threads: int, budget_s: float, sample_ms: float,
                 min_rounds: int, max_rounds: int) -> dict:
    """Interleaved A B B A rounds; per-round ratios b / a on CPU time (one thread) and wall time."""
    for s in (sess_a, sess_b):
        for _ in range(5):
            s.run(None, feeds)
    t0 = time.perf_counter()
    sess_a.run(None, feeds)
    per_run = max(time.perf_counter() - t0, 1e-6)
    burst = max(1, int(sample_ms / 1e3 / per_run))

    def sample(sess) -> tuple[int, int]:
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        for _ in range(burst):
            sess.run(None, feeds)
        return time.thread_time_ns() - c0, time.perf_counter_ns() - w0

    cpu_a, cpu_b, wall_a, wall_b = [], [], [], []
    start = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() - start < budget_s):
        a1, b1, b2, a2 = sample(sess_a), sample(sess_b), sample(sess_b), sample(sess_a)
        cpu_a.append(a1[0] + a2[0]); cpu_b.append(b1[0] + b2[0])
        wall_a.append(a1[1] + a2[1]); wall_b.append(b1[1] + b2[1])
        rounds += 1
    result = {"rounds": rounds, "burst": burst}
    clocks = {"wall": (np.array(wall_a, float), np.array(wall_b, float))}
    if threads == 1:
        clocks["cpu"] = (np.array(cpu_a, float), np.array(cpu_b, float))
    for clock, (a, b) in clocks.items():
        ratios = b / a
        lo, hi = bootstrap_median_interval(ratios)
        result[clock] = {
            "ms_a": float(np.median(a)) / 2 / burst / 1e6,
            "ms_b": float(np.median(b)) / 2 / burst / 1e6,
            "ratio": float(np.median(ratios)),
            "low": lo,
            "high": hi,
        }
    return result


def bench_model(zm, threads_list: list[int], args, log) -> dict:
    from onnxfuse import api, runtime
    from onnxfuse.profile import needs_library, open_session
    from onnxfuse.verify import random_inputs

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


def _git(*argv) -> str:
    try:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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


def commit_text() -> str:
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return _git("rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if dirty else "")


def run_stamp() -> tuple[str, tuple, str]:
    """(start time, load average, commit) for a report's header, taken when a run starts."""
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return started, os.getloadavg(), commit_text()


def write_report(path: Path, text: str) -> None:
    """Write a report (creating its folder) and print it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)


def report_header(title: str, script: str, argv: list[str], started: str, load: tuple, commit: str) -> list[str]:
    """The first lines of a report: title, command, date, commit, machine and versions."""
    import onnxruntime as ort

    return [
        f"# {title}",
        "",
        "Command: `" + " ".join([f"python bench/{script}", *argv]) + "`",
        f"Date: {started}. Commit: {commit}. Machine: {platform.machine()}, {_cpu()}, {os.cpu_count()} logical CPUs "
        f"(shared host; load average at the start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}). "
        f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, numpy {np.__version__}, Python {platform.python_version()}.",
        "",
    ]


def optimized_ab_table(cases, threads_list: list[int], budget_s: float) -> tuple[str, str, list[str]]:
    """Each case (label: its first table cells, model, feeds) run by onnxruntime alone and as the
    default CPU pipeline writes it (onnxfuse library loaded): the kernels each runs, then per
    thread count the interleaved time (timed_rounds: thread CPU time at one thread, wall time
    above) and ratio onnxfuse / onnxruntime. Returns the table's head and rule after the label
    columns, and its rows."""
    from onnxfuse import api
    from onnxfuse.profile import count_kernels, open_session

    names = lambda k: " + ".join(f"{op}" + (f" x{n}" if n > 1 else "") for op, n in k.items())  # noqa: E731
    rows = []
    for label, m, feeds in cases:
        fused = api.optimize(m, count_kernels=False).model
        cells = [*label, names(count_kernels(m, threads=1)[1]), names(count_kernels(fused, threads=1)[1])]
        for threads in threads_list:
            a, _ = open_session(m, "cpu", threads, "all", with_library=False)
            b, _ = open_session(fused, "cpu", threads, "all", with_library=True)
            c = timed_rounds(a, b, feeds, threads, budget_s, 2.0, 15, 400)["cpu" if threads == 1 else "wall"]
            cells.append(f"{c['ms_a'] * 1e3:.1f} / {c['ms_b'] * 1e3:.1f} | {c['ratio']:.3f} [{c['low']:.3f}, {c['high']:.3f}]")
            print(f"{' '.join(label)} threads={threads}: {cells[-1]}", file=sys.stderr, flush=True)
        rows.append("| " + " | ".join(cells) + " |")
    head = " onnxruntime runs | onnxfuse runs |"
    rule = "---|---|"
    for th in threads_list:
        clock = "thread CPU" if th == 1 else "wall"
        head += f" {th} thread{'s' if th > 1 else ''}: us, ort / ours ({clock}) | ratio [95%] |"
        rule += "---|---|"
    return head, rule, rows


def optimized_ab_main(argv, script: str, doc: str, title: str, description: str, labels: list[str], cases) -> int:
    """The command line of a bench script that times cases with optimized_ab_table (--budget,
    --threads, --out; default out bench/results/<script>.md): labels name the cases' first table
    columns, cases() yields them; the report is written and printed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=6.0, help="seconds of timed rounds per row")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / (Path(script).stem + ".md"))
    args = p.parse_args(argv)
    started, load, commit = run_stamp()
    head, rule, rows = optimized_ab_table(cases(), [int(t) for t in args.threads.split(",")], args.budget)
    text = "\n".join([
        *report_header(title, script, argv, started, load, commit),
        description,
        "",
        "| " + " | ".join(labels) + " |" + head, "|" + "---|" * len(labels) + rule, *rows, "",
    ])
    write_report(args.out, text)
    return 0


def render(entries: list[dict], threads_list: list[int], argv: list[str], started: str, load: tuple, commit: str) -> str:
    lines = [
        *report_header("No zoo model slower: the graph onnxruntime runs, and interleaved CPU time", "zoo_latency.py",
                       argv, started, load, commit),
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


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated zoo names (default: every zoo model)")
    p.add_argument("--threads", default="1,2", help="intra-op thread counts (default 1,2)")
    p.add_argument("--budget", type=float, default=20.0, help="seconds of timed rounds per model and thread count")
    p.add_argument("--sample-ms", type=float, default=2.0, help="about how long one sample lasts (default 2)")
    p.add_argument("--min-rounds", type=int, default=15)
    p.add_argument("--max-rounds", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-same", action="store_true",
                   help="time models whose executed graphs are the same too (a check of the timing: expect 1)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from onnxfuse import zoo

    names = args.models.split(",") if args.models else zoo.names()
    threads_list = [int(t) for t in args.threads.split(",")]
    started, load, commit = run_stamp()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    entries = [bench_model(zoo.get(n), threads_list, args, log) for n in names]
    text = render(entries, threads_list, argv, started, load, commit)
    write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
