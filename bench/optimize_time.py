"""How long `onnxfuse optimize` takes, stage by stage and pass by pass, and proof that making it
faster changed no optimized model.

Times `onnxfuse.api.optimize(model)` (CLI defaults: default CPU pipeline, outputs verified,
kernels counted) on the largest zoo model (densenet121) and on a GPT-2-small-sized model
(bench/gpt2_small.py), each run in a fresh Python process, timed around the API call alone
(imports and reading the file excluded), as `python -m bench.compare --optimize-only` does.

    python -m bench.optimize_time                          # both models, 3 runs each
    python -m bench.optimize_time --models densenet121 --reps 1 --profile 25
    python -m bench.optimize_time --gpt2 /tmp/gpt2_small.onnx   # reuse a generated model
    python -m bench.optimize_time --fingerprints before.json    # every zoo model + GPT-2 small:
    python -m bench.optimize_time --fingerprints after.json --compare before.json

--fingerprints optimizes every zoo model and the GPT-2-small-sized model (without verification:
it does not change the model) and records a SHA-256 of each optimized model's serialization;
--compare names the models whose optimized form differs from an earlier record.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import click

from bench import harness

REPO = harness.ROOT
GPT2_DIMS = {"batch": 2, "seq": 32}
GOALS_S = {"densenet121": 2.0, "gpt2_small": 10.0}
MARK = "@@optimize-time "


def _child(job: dict) -> dict:
    """One optimize in this (fresh) process."""
    import onnx

    from onnxfuse import api

    model = onnx.load(job["path"])
    profiler = None
    if job.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    result = api.optimize(model, dims=job["dims"] or None, verify_outputs=job["verify"],
                          count_kernels=job["verify"], label=job["name"])
    seconds = time.perf_counter() - t0
    if profiler:
        profiler.disable()
    out = {
        "seconds": seconds,
        "stages": result.summary["seconds"],
        "passes": {p.name: round(p.seconds, 3) for p in result.passes},
        "nodes_after": len(result.model.graph.node),
        "sha256": hashlib.sha256(result.model.SerializeToString()).hexdigest(),
    }
    if profiler:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(job["profile"])
        out["profile"] = text.getvalue()
    return out


def run_child(name: str, path: str, dims: dict, verify: bool = True, profile: int = 0) -> dict:
    job = {"name": name, "path": path, "dims": dims, "verify": verify, "profile": profile}
    proc = subprocess.run([sys.executable, "-m", "bench.optimize_time", "--child", json.dumps(job)],
                          capture_output=True, text=True, cwd=str(REPO))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{name}: optimize failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}")


def gpt2_path(given: str | None, tmp: Path) -> str:
    if given and Path(given).is_file():
        return given
    from bench import gpt2_small

    path = Path(given) if given else tmp / "gpt2_small.onnx"
    print(f"generating {path}", file=sys.stderr)
    gpt2_small.write(path)
    return str(path)


def models(names: list[str], gpt2: str | None, tmp: Path) -> list[tuple[str, str, dict]]:
    from onnxfuse import zoo

    out = []
    for m in zoo.list_models():
        if m.name in names or "all-zoo" in names:
            out.append((m.name, str(m.path), dict(m.dims or {})))
    if "gpt2_small" in names:
        out.append(("gpt2_small", gpt2_path(gpt2, tmp), GPT2_DIMS))
    return out


@harness.script(__doc__)
@click.option("--child", hidden=True)
@click.option("--models", default="densenet121,gpt2_small", show_default=True,
              help="zoo model names and/or gpt2_small, comma-separated")
@click.option("--gpt2", help="the GPT-2-small-sized model file (generated there when missing)")
@click.option("--reps", type=int, default=3, show_default=True, help="fresh-process runs per model (the best counts)")
@click.option("--profile", type=int, default=0, help="one more run under cProfile, printing the top N functions")
@click.option("--fingerprints", help="write SHA-256 of every zoo model's and GPT-2 small's optimized form here")
@click.option("--compare", help="an earlier --fingerprints file to compare with")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int:
    if args.child:
        result = _child(json.loads(args.child))
        print(MARK + json.dumps(result), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="onnxfuse-optimize-time-") as tmp:
        if args.fingerprints:
            record = {"commit": harness.git("rev-parse", "--short", "HEAD"), "models": {}}
            for name, path, dims in models(["all-zoo", "gpt2_small"], args.gpt2, Path(tmp)):
                r = run_child(name, path, dims, verify=False)
                record["models"][name] = r["sha256"]
                print(f"{name:14s} {r['seconds']:7.2f} s  {r['nodes_after']:5d} nodes  {r['sha256'][:16]}")
            Path(args.fingerprints).write_text(json.dumps(record, indent=1) + "\n")
            if args.compare:
                before = json.loads(Path(args.compare).read_text())["models"]
                differ = [n for n, h in record["models"].items() if before.get(n) != h]
                print("identical optimized models" if not differ else f"DIFFERENT: {', '.join(differ)}")
                return 1 if differ else 0
            return 0
        print(f"commit {harness.git('rev-parse', '--short', 'HEAD')}, load average {os.getloadavg()[0]:.2f}")
        for name, path, dims in models(args.models.split(","), args.gpt2, Path(tmp)):
            runs = [run_child(name, path, dims) for _ in range(args.reps)]
            best = min(runs, key=lambda r: r["seconds"])
            goal = GOALS_S.get(name)
            times = ", ".join(f"{r['seconds']:.2f}" for r in runs)
            print(f"{name}: runs {times} s; best {best['seconds']:.2f} s"
                  + (f" (goal {goal:g} s: {'met' if best['seconds'] <= goal else 'missed'})" if goal else ""))
            print("  stages: " + ", ".join(f"{k} {v:.2f}" for k, v in best["stages"].items()))
            print("  passes: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(best["passes"].items(), key=lambda kv: -kv[1])))
            if args.profile:
                print(run_child(name, path, dims, profile=args.profile)["profile"])
    return 0


main = harness.main_of(cli)

if __name__ == "__main__":
    sys.exit(main())
