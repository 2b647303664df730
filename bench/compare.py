"""onnxfuse side by side with onnxruntime's own optimizer and the ONNX simplifiers.

Every zoo model is run five ways, each under onnxruntime at ORT_ENABLE_ALL:

    ort            the original model (onnxruntime's optimizer alone)
    onnxsim        onnxsim.simplify(model), then onnxruntime
    onnxslim       onnxslim.slim(model), then onnxruntime
    onnxoptimizer  onnxoptimizer.optimize(model) (its default passes), then onnxruntime
    onnxfuse       onnxfuse.api.optimize(model) (default CPU pipeline, verified), then
                   onnxruntime with the onnxfuse custom-op library

For each: kernels per inference (onnxruntime's profiler, CPU provider, 1 thread), latency
(min / median / max) on the CPU provider at 1 and 2 intra-op threads (and on the CUDA
provider where onnxruntime can use a GPU), optimize time, and ratios to the original.
Every variant's outputs are compared with the original's on the same seeded inputs; a tool
that fails, times out or changes the outputs is reported as failed for that model, with the
reason, and the benchmark goes on.

Optimizers run one at a time in a fresh Python process (a crash or a hang of a peer tool
costs only that model), timed around the tool's API call alone (imports and file I/O
excluded). Latency: all variants' sessions are warmed up, then timed in rounds, one sample
per variant per round, the starting variant rotating from round to round (A B C, B C A, ...),
so that a drifting shared machine does not favour any of them. A sample is the mean of k
back-to-back inferences, k chosen per variant so that a sample lasts about --sample-ms.

Also times `optimize` itself on the largest zoo model (most nodes) and on a generated
GPT-2-small-sized model (bench/gpt2_small.py), and when a time goal is missed reports where
the time goes (stages, passes, the hottest functions).

    pip install -e '.[bench]'
    python -m bench.compare                      # writes bench/RESULTS.md, bench/results/compare.{json,png}
    python -m bench.compare --models char_rnn,gpt_stack --runs 50 --no-optimize-time
    python -m bench.compare --render-only        # rewrite RESULTS.md and the chart from compare.json
    python -m bench.readme_section               # README's benchmark section from compare.json
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import click

from bench import harness
from bench.compare_report import (GOAL_GPT2_SMALL_S, GOAL_LARGEST_ZOO_S, GPT2_DIMS, VARIANTS, optimize_time_section,
                                  summary_tables, write_outputs)

REPO = harness.ROOT
DEFAULT_OUT = REPO / "bench" / "RESULTS.md"
DEFAULT_JSON = harness.RESULTS / "compare.json"
DEFAULT_CHART = harness.RESULTS / "compare.png"
FORMAT = 1

RESULT_MARK = "@@onnxfuse-bench-result "
INSTALL_HINT = "pip install -e '.[bench]'"


# =========================================================================== optimizer workers
# Run in a child process: `python -m bench.compare --worker JSON` optimizes one model with one tool.


def _optimize_with(tool: str, model, dims: dict, target: str):
    """(optimized ModelProto, details) for one tool."""
    if tool == "onnxsim":
        import onnxsim

        out, ok = onnxsim.simplify(model)
        if not ok:
            raise RuntimeError("onnxsim's own check of the simplified model failed")
        return out, {}
    if tool == "onnxslim":
        import onnxslim

        return onnxslim.slim(model), {}
    if tool == "onnxoptimizer":
        import onnxoptimizer

        return onnxoptimizer.optimize(model), {}
    if tool == "onnxfuse":
        from onnxfuse import api

        result = api.optimize(model, target=target, dims=dims or None, label=model.graph.name or "model")
        return result.model, {
            "stages": result.summary["seconds"],
            "passes": [{"pass": p.name, "matches": p.matches, "seconds": round(p.seconds, 4)} for p in result.passes],
            "kernels_before": result.summary.get("kernels_before"),
            "kernels_after": result.summary.get("kernels_after"),
        }
    raise ValueError(f"unknown tool '{tool}'")


def _import_tool(tool: str) -> None:
    """Import outside the timed call, so that import time is not optimize time."""
    import importlib

    try:
        importlib.import_module({"onnxfuse": "onnxfuse.api"}.get(tool, tool))
    except ImportError as e:
        raise ImportError(f"{tool} is not installed ({INSTALL_HINT}): {e}") from None


def _hot_functions(profiler, top: int) -> dict[str, list[dict]]:
    """From a cProfile run: the functions with the most own time (often protobuf or onnx
    internals), and onnxfuse's own functions (onnxfuse/, passes/) by cumulative time, which say
    which pass or helper those calls come from."""
    import pstats

    stats = pstats.Stats(profiler).stats
    rows = []
    for (filename, line, func), (_cc, calls, tottime, cumtime, _callers) in stats.items():
        short = _short_path(filename)
        rows.append({"function": f"{short}:{line}({func})", "calls": calls, "own_s": round(tottime, 3),
                     "cumulative_s": round(cumtime, 3), "ours": short.startswith(("onnxfuse/", "passes/"))})
    by_own = sorted(rows, key=lambda r: -r["own_s"])[:top]
    ours = sorted((r for r in rows if r["ours"]), key=lambda r: -r["cumulative_s"])[:top]
    return {"by_own_time": by_own, "ours_by_cumulative_time": ours}


def _short_path(filename: str) -> str:
    for root in (str(REPO) + os.sep, *[p + os.sep for p in sys.path if p and "site-packages" in p]):
        if filename.startswith(root):
            return filename[len(root):]
    return filename


def worker(job: dict) -> dict:
    import onnx

    from onnxfuse.modelsave import save_model

    tool = job["tool"]
    _import_tool(tool)
    model = onnx.load(job["model"])
    profiler = None
    if job.get("profile_top"):
        import cProfile

        profiler = cProfile.Profile()
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    optimized, details = _optimize_with(tool, model, job.get("dims") or {}, job.get("target", "cpu"))
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - t0
    if job.get("out"):
        save_model(optimized, job["out"])  # IR version onnxruntime loads; external data past 2 GB
    result = {"seconds": seconds, "nodes": len(optimized.graph.node), **details}
    if profiler:
        result["hot_functions"] = _hot_functions(profiler, job["profile_top"])
    return result


def _worker_main(job_json: str) -> int:
    job = json.loads(job_json)
    try:
        result = worker(job)
    except Exception as e:  # any failure of a tool is a result to report, not a crash
        result = {"error": _one_line(e)}
    sys.stdout.flush()
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(e).__name__}: {text}"


@dataclass
class ToolRun:
    seconds: float | None = None
    error: str | None = None
    details: dict = field(default_factory=dict)


def run_tool(tool: str, model_path, out_path, dims: dict | None = None, target: str = "cpu",
             timeout: float = 900.0, profile_top: int = 0) -> ToolRun:
    """Optimize model_path with `tool` in a fresh process; failures come back as ToolRun.error."""
    job = {"tool": tool, "model": str(model_path), "out": str(out_path) if out_path else None,
           "dims": dict(dims or {}), "target": target, "profile_top": profile_top}
    cmd = [sys.executable, "-m", "bench.compare", "--worker", json.dumps(job)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    except subprocess.TimeoutExpired:
        return ToolRun(error=f"no result after {timeout:g} s (timed out)")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK):])
            if "error" in result:
                return ToolRun(error=result["error"])
            seconds = result.pop("seconds")
            return ToolRun(seconds=seconds, details=result)
    if proc.returncode < 0:
        import signal

        how = f"killed by {signal.Signals(-proc.returncode).name}"
    else:
        how = f"exited with status {proc.returncode}"
    last = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "")
    return ToolRun(error=f"the optimizer process {how}" + (f": {last.strip()[:300]}" if last else ""))


# =========================================================================== measuring


@dataclass(frozen=True)
class Setting:
    provider: str
    threads: int | None

    @property
    def key(self) -> str:
        return f"{self.provider}-{self.threads}t" if self.threads else self.provider

    @property
    def label(self) -> str:
        if self.provider == "cpu":
            return f"CPU, {self.threads} thread{'s' if self.threads != 1 else ''}"
        return "CUDA"


def interleaved_latency(sessions: dict, feeds: dict, rounds: int, min_rounds: int, budget_s: float,
                        warmup: int, sample_ms: float, baseline: str | None = None) -> dict[str, dict]:
    """Latency per session: warm-up, then rotating rounds (harness.interleave): at least
    `min_rounds`, then until `rounds` or the time budget, whichever comes first. With a baseline
    session, each entry's "ratio" is the median over rounds of (its sample / the baseline's
    sample of the same round): a paired figure that load changes between rounds do not move."""
    samples = harness.interleave({name: harness.session_run(sess, feeds) for name, sess in sessions.items()},
                                 order="rotate", min_rounds=min_rounds, max_rounds=max(1, rounds), budget_s=budget_s,
                                 warmup=warmup, sample_ms=sample_ms, same_runs=False)
    result = {}
    for name in sessions:
        result[name] = {"min_ms": samples.min_ms(name), "median_ms": samples.median_ms(name),
                        "max_ms": samples.max_ms(name), "runs": samples.rounds,
                        "inferences_per_sample": samples.runs[name]}
        if baseline in sessions:
            result[name]["ratio"] = samples.ratio(baseline, name)
    return result


def _check_outputs(original, expected, actual) -> str | None:
    from onnxfuse.compare import compare_output

    if len(actual) != len(expected):
        return f"{len(actual)} outputs instead of {len(expected)}"
    for out, e, a in zip(original.graph.output, expected, actual):
        check = compare_output(out.name, out.type.tensor_type.elem_type, e, a)
        if not check.ok:
            return f"outputs differ from the original's: '{out.name}': {check.problem}"
    return None


def bench_model(name: str, path: Path, dims: dict, settings: list[Setting], tools: list[str], args,
                workdir: Path, log) -> dict:
    """Every variant of one model: optimize, check, count kernels, time."""
    import onnx

    from onnxfuse.environment import ort_error_text
    from onnxfuse.profile import open_session, profiled_run
    from onnxfuse.inputs import random_inputs

    original = onnx.load(str(path), load_external_data=False)
    entry = {"model": name, "nodes": len(original.graph.node), "dims": dict(dims), "variants": {}}
    variants = entry["variants"]
    targets = sorted({"cuda" if s.provider == "cuda" else "cpu" for s in settings})
    paths: dict[str, dict[str, Path]] = {}  # variant -> target -> model file
    for variant in ["ort", *tools]:
        variants[variant] = {"status": "ok", "error": None, "optimize_s": None, "nodes": None,
                             "kernels": {}, "latency": {}}
        if variant == "ort":
            variants[variant]["nodes"] = len(original.graph.node)
            paths[variant] = {t: path for t in targets}
            continue
        paths[variant] = {}
        for target in targets if variant == "onnxfuse" else ["cpu"]:
            out = workdir / f"{name}.{variant}.{target}.onnx"
            run = run_tool(variant, path, out, dims, target, timeout=args.tool_timeout)
            if run.error:
                variants[variant].update(status="failed", error=run.error)
                break
            if target == "cpu":
                variants[variant].update(optimize_s=round(run.seconds, 4), nodes=run.details.get("nodes"))
                if variant == "onnxfuse":
                    variants[variant]["stages"] = run.details.get("stages")
            paths[variant][target] = out
        if variant != "onnxfuse" and variants[variant]["status"] == "ok":
            paths[variant] = {t: paths[variant]["cpu"] for t in targets}
        log(f"  {name}: {variant}: " + (f"optimized in {variants[variant]['optimize_s']:.2f} s"
                                        if variants[variant]["status"] == "ok" else variants[variant]["error"]))

    feeds = random_inputs(original, dims, args.seed)
    for provider in targets:
        # Kernels per inference and outputs: one profiled inference per variant (1 CPU thread).
        threads = 1 if provider == "cpu" else None
        expected = None
        for variant in variants:
            info = variants[variant]
            if info["status"] != "ok":
                continue
            try:
                outputs, prof = profiled_run(str(paths[variant][provider]), feeds, provider, threads=threads)
            except Exception as e:  # onnxruntime's exception types
                if variant == "ort":
                    raise RuntimeError(f"{name}: onnxruntime cannot run the original: {ort_error_text(e)}") from None
                info.update(status="failed", error=f"onnxruntime cannot run the {variant} model: {ort_error_text(e)}")
                continue
            if variant == "ort":
                expected = outputs
            else:
                problem = _check_outputs(original, expected, outputs)
                if problem:
                    info.update(status="failed", error=problem)
                    continue
            info["kernels"][provider] = prof.kernels_per_inference

        for setting in (s for s in settings if s.provider == provider):
            ok = [v for v in variants if variants[v]["status"] == "ok"]
            sessions = {v: open_session(str(paths[v][provider]), provider, setting.threads)[0] for v in ok}
            latency = interleaved_latency(sessions, feeds, args.runs, args.min_runs, args.budget, args.warmup,
                                          args.sample_ms, baseline="ort")
            del sessions
            for v, lat in latency.items():
                variants[v]["latency"][setting.key] = {k: (round(x, 4) if isinstance(x, float) else x)
                                                      for k, x in lat.items()}
            log(f"  {name}: {setting.label}: " + ", ".join(
                f"{v} {lat['median_ms']:.3f} ms ({lat['ratio']:.2f}x, {lat['runs']} runs)" for v, lat in latency.items()))
    return entry


def time_optimize(label: str, path: Path, dims: dict, goal_s: float, reps: int, args, workdir: Path, log,
                  nodes: int, parameters: int | None = None) -> dict:
    """`optimize` (onnxfuse.api.optimize, CLI defaults) in fresh processes; where the time goes
    when the goal is missed."""
    runs = []
    for i in range(reps):
        run = run_tool("onnxfuse", path, None, dims, "cpu", timeout=args.tool_timeout)
        if run.error:
            log(f"  optimize {label}: {run.error}")
            return {"model": label, "nodes": nodes, "parameters": parameters, "goal_s": goal_s, "error": run.error}
        runs.append(run)
        log(f"  optimize {label}: run {i + 1}/{reps}: {run.seconds:.2f} s")
    best = min(runs, key=lambda r: r.seconds)
    entry = {
        "model": label, "nodes": nodes, "parameters": parameters, "dims": dims, "goal_s": goal_s,
        "seconds": [round(r.seconds, 3) for r in runs],
        "min_s": round(best.seconds, 3), "median_s": round(statistics.median(r.seconds for r in runs), 3),
        "met": best.seconds <= goal_s,
        "stages": best.details.get("stages"),
        "passes": sorted(best.details.get("passes", []), key=lambda p: -p["seconds"]),
    }
    if not entry["met"] and args.profile_top:
        run = run_tool("onnxfuse", path, None, dims, "cpu", timeout=args.tool_timeout, profile_top=args.profile_top)
        if not run.error:
            entry["profiled_s"] = round(run.seconds, 3)
            entry["hot_functions"] = run.details.get("hot_functions", [])
    return entry


# =========================================================================== environment


def environment(argv: list[str]) -> dict:
    modified = [ln for ln in harness.git("status", "--porcelain", "--untracked-files=no").splitlines() if ln.strip()]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": harness.command_line("compare", argv),
        "machine": harness.machine_and_system(),
        "python": platform.python_version(),
        "versions": [harness.dist_version(m) for m in ("onnxruntime", "onnx", "onnxsim", "onnxslim", "onnxoptimizer")],
        "commit": harness.git("rev-parse", "--short", "HEAD") or "unknown",
        "modified_tracked_files": len(modified),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }


# =========================================================================== command line


@harness.script(__doc__)
@click.option("--worker", hidden=True, help="optimize one model with one tool (JSON job) and print the result")
@click.option("--models", callback=harness.csv(), help="comma-separated zoo names (default: every zoo model)")
@click.option("--tools", callback=harness.csv(), default=",".join(VARIANTS[1:]), show_default=True,
              help="optimizers beside onnxruntime alone")
@click.option("--threads", callback=harness.csv(int), default="1,2", show_default=True, help="CPU intra-op thread counts")
@click.option("--runs", type=int, default=200, show_default=True, help="most timed rounds per model and setting")
@click.option("--min-runs", type=int, default=10, show_default=True, help="fewest timed rounds, whatever the budget")
@click.option("--budget", type=float, default=20.0, show_default=True,
              help="seconds of timed rounds per model and setting, after --min-runs")
@click.option("--warmup", type=int, default=3, show_default=True, help="warm-up inferences per variant")
@click.option("--sample-ms", type=float, default=1.0, show_default=True, help="about how long one latency sample lasts")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tool-timeout", type=float, default=900.0, show_default=True, help="seconds one optimizer run may take")
@click.option("--no-optimize-time", is_flag=True,
              help="skip timing `optimize` on the largest zoo model and a GPT-2-small-sized model")
@click.option("--optimize-reps", type=int, default=3, show_default=True, help="runs of each `optimize` timing")
@click.option("--profile-top", type=int, default=15, show_default=True,
              help="functions listed when an optimize-time goal is missed (0: no profiled run)")
@click.option("--out", type=click.Path(path_type=Path), default=DEFAULT_OUT, help="markdown report",
              show_default=str(DEFAULT_OUT.relative_to(REPO)))
@click.option("--json", type=click.Path(path_type=Path), default=DEFAULT_JSON, help="results data",
              show_default=str(DEFAULT_JSON.relative_to(REPO)))
@click.option("--chart", type=click.Path(path_type=Path), default=DEFAULT_CHART, help="PNG chart",
              show_default=str(DEFAULT_CHART.relative_to(REPO)))
@click.option("--no-chart", is_flag=True)
@click.option("--optimize-only", is_flag=True,
              help="only time `optimize` (largest zoo model, GPT-2 small) and update --json, --out and --chart")
@click.option("--render-only", is_flag=True, help="rewrite --out and --chart from --json without measuring")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int:
    if args.worker is not None:
        return _worker_main(args.worker)
    return run(_checked(vars(args)))


def _checked(params: dict) -> SimpleNamespace:
    """The options as attributes, after the checks click's types do not make."""
    args = SimpleNamespace(**params)
    unknown = [t for t in args.tools if t not in VARIANTS[1:]]
    if unknown:
        raise click.BadParameter(f"unknown {', '.join(unknown)} (known: {', '.join(VARIANTS[1:])})", param_hint="--tools")
    if not args.threads or any(t < 1 for t in args.threads):
        raise click.BadParameter("positive thread counts, comma-separated", param_hint="--threads")
    if args.runs < 1 or args.min_runs < 1:
        raise click.UsageError("--runs and --min-runs must be at least 1")
    return args


def parse_args(argv) -> SimpleNamespace:
    """The options of a command line, as `main` reads them (for tests and callers)."""
    params = dict(cli.make_context("compare", list(argv)).params)
    params.pop("worker", None)
    return _checked(params)


main = harness.main_of(cli)


def run(args: SimpleNamespace) -> int:
    """The benchmark (or, with --render-only or --optimize-only, part of it) for checked options."""
    argv = harness.invoked_argv()
    chart = None if args.no_chart else args.chart
    log = harness.log

    if args.render_only or args.optimize_only:
        if not args.json.is_file():
            log(f"error: {args.json} does not exist; run the benchmark first")
            return 2
        results = json.loads(args.json.read_text())
        if args.optimize_only:
            with tempfile.TemporaryDirectory(prefix="onnxfuse-bench-") as tmp:
                results["optimize_meta"], results["optimize_time"] = optimize_times(args, argv, Path(tmp), log)
        write_outputs(results, args.out, args.json if args.optimize_only else None, chart)
        print(optimize_time_section(results) if args.optimize_only else summary_tables(results))
        return 0

    import onnxruntime

    from onnxfuse import zoo
    from onnxfuse.profile import cuda_usable

    # Failures reach us as exceptions (and are reported); onnxruntime's own log of them, and of
    # its CUDA provider failing to load on a machine without a GPU, would be noise.
    onnxruntime.set_default_logger_severity(4)

    try:
        members = zoo.list_models()
        if args.models:
            members = [zoo.get(n) for n in args.models]
    except zoo.ZooError as e:
        log(f"error: {e}")
        return 2
    missing = [t for t in args.tools if t != "onnxfuse" and not _installed(t)]
    for t in missing:
        log(f"note: {t} is not installed ({INSTALL_HINT}); it is reported as failed")

    settings = [Setting("cpu", t) for t in args.threads]
    if cuda_usable():
        settings.append(Setting("cuda", None))
        cuda_note = "measured (onnxfuse variant optimized with --target cuda)"
    else:
        cuda_note = "skipped: onnxruntime cannot use a GPU on this machine"
        log(f"CUDA provider {cuda_note}")
    meta = environment(argv)
    meta.update(runs=args.runs, min_runs=args.min_runs, budget_s=args.budget, warmup=args.warmup,
                sample_ms=args.sample_ms, seed=args.seed, cuda=cuda_note)
    results = {"format": FORMAT, "meta": meta,
               "settings": [{"provider": s.provider, "threads": s.threads, "key": s.key, "label": s.label}
                            for s in settings],
               "models": [], "optimize_time": []}

    with tempfile.TemporaryDirectory(prefix="onnxfuse-bench-") as tmp:
        workdir = Path(tmp)
        for m in members:
            log(f"{m.name} ...")
            clear_dir(workdir)
            results["models"].append(bench_model(m.name, m.path, m.dims, settings, args.tools, args, workdir, log))
        meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        if not args.no_optimize_time:
            clear_dir(workdir)
            results["optimize_meta"], results["optimize_time"] = optimize_times(args, argv, workdir, log)
    write_outputs(results, args.out, args.json, chart)
    print(summary_tables(results))
    print()
    print(optimize_time_section(results))
    log(f"wrote {args.out}" + (f", {args.json}" if args.json else "") + (f", {chart}" if chart else ""))
    return 0


def optimize_times(args, argv: list[str], workdir: Path, log) -> tuple[dict, list[dict]]:
    """(when and how measured, entries): `optimize` on the largest zoo model and on GPT-2 small."""
    import onnx

    from onnxfuse import zoo

    from bench import gpt2_small

    env = environment(argv)
    meta = {k: env[k] for k in ("date", "command", "commit", "modified_tracked_files", "load_average_start")}
    entries = []
    members = [m for m in zoo.list_models() if m.path.is_file()]
    sizes = {m.name: len(onnx.load(str(m.path), load_external_data=False).graph.node) for m in members}
    largest = max(members, key=lambda m: sizes[m.name])
    log(f"optimize time: {largest.name} (largest zoo model, {sizes[largest.name]} nodes)")
    entries.append(time_optimize(f"{largest.name} (largest zoo model)", largest.path, largest.dims,
                                 GOAL_LARGEST_ZOO_S, args.optimize_reps, args, workdir, log, sizes[largest.name]))
    clear_dir(workdir)
    log("optimize time: generating a GPT-2-small-sized model")
    model = gpt2_small.build()
    nodes, params = len(model.graph.node), gpt2_small.parameters(model)
    path = workdir / "gpt2_small.onnx"
    onnx.save(model, str(path))
    del model
    entries.append(time_optimize("gpt2_small (12 blocks, d_model 768, generated)", path, GPT2_DIMS,
                                 GOAL_GPT2_SMALL_S, args.optimize_reps, args, workdir, log, nodes, params))
    meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    return meta, entries


def clear_dir(workdir: Path) -> None:
    """Remove the previous model's optimized files (some are hundreds of MB)."""
    for f in workdir.iterdir():
        if f.is_file():
            f.unlink()


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    sys.exit(main())
