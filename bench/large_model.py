"""Time and peak memory of `onnxfuse optimize` against model size (issue 18).

Generates LLaMA-style models with models/llama_large.py (8 layers each, so every size has the
same node count and only the bytes differ; weights in an external data file) and runs
`onnxfuse optimize IN OUT --json` on each with --no-verify, with --verify-mode auto (the
default) and with --verify-mode regions, each in its own process. Peak memory
is that process's maximum resident set size (wait4's ru_maxrss: anonymous memory and the
pages of mapped weight files it touched).

    python bench/large_model.py --dir /tmp/llama                    # 0.5gb, 2.5gb, 6gb presets
    python bench/large_model.py --dir /tmp/llama --presets 0.5gb --write ''   # print only

Generated models are reused when present in --dir (they are seeded: the same bytes).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "models"))

import llama_large  # noqa: E402  (models/ is not a package on the path by default)

RESULTS = HERE / "results" / "large_model.md"
NOTES_HEADING = "## Reading the figures"


def _git(*argv: str) -> str:
    try:
        return subprocess.run(["git", *argv], capture_output=True, text=True, cwd=str(REPO), timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(dist: str) -> str:
    from importlib import metadata

    for name in ([dist, dist + "-gpu"] if dist == "onnxruntime" else [dist]):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return f"{dist} not installed"


def _machine() -> str:
    cpu = platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = next((int(line.split()[1]) / 2**20 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), 0.0)
    return f"{platform.machine()}, {cpu}, {os.cpu_count()} cores, {mem:.1f} GiB; {platform.platform()}"


def ensure_model(directory: Path, preset: str) -> Path:
    path = directory / f"llama_{preset}.onnx"
    if not (path.exists() and path.with_name(path.name + ".data").exists()):
        llama_large.main(["--preset", preset, str(path)])
    return path


def _measured(cmd: list[str], cwd: Path) -> dict:
    """Run `cmd` in `cwd`, returning its exit status, wall time, peak RSS (bytes) and output."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(cwd))
    out_chunks, err_chunks = [], []

    def drain(stream, into):
        for chunk in iter(lambda: stream.read(65536), b""):
            into.append(chunk)

    threads = [threading.Thread(target=drain, args=(proc.stdout, out_chunks)),
               threading.Thread(target=drain, args=(proc.stderr, err_chunks))]
    for t in threads:
        t.start()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    for t in threads:
        t.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": proc.returncode, "seconds": seconds, "peak_rss": usage.ru_maxrss * 1024,
            "stdout": b"".join(out_chunks).decode(errors="replace"),
            "stderr": b"".join(err_chunks).decode(errors="replace")}


def bench(model: Path, out_dir: Path, verify: bool, verify_mode: str) -> dict:
    """One optimize of `model`: with verification in `verify_mode`, or with --no-verify."""
    out = out_dir / f"{model.stem}.opt.onnx"
    extra = ["--verify-mode", verify_mode] if verify else ["--no-verify"]
    cmd = [sys.executable, "-c", "from onnxfuse.cli import main; main()", "optimize", str(model), str(out), "--json",
           *extra]
    # Not run from the source tree: `python -c` would import its onnxfuse/ before the installed package.
    run = _measured(cmd, out_dir)
    entry = {"model": model.name, "verify": verify, "verify_mode": verify_mode if verify else None, "rc": run["rc"], "seconds": round(run["seconds"], 2),
             "peak_rss_gb": round(run["peak_rss"] / 1e9, 2)}
    if run["rc"] == 0:
        summary = json.loads(run["stdout"])
        v = summary.get("verification")
        entry.update(nodes_before=summary["nodes_before"], nodes_after=summary["nodes_after"],
                     stages=summary["seconds"], mode=v["mode"] if v else None,
                     mode_reason=v.get("mode_reason") if v else None,
                     regions=len(v.get("regions", [])) if v else None,
                     max_abs=v["max_abs"] if v else None,
                     out_gb=round(sum(os.path.getsize(p) for p in summary["files_written"]) / 1e9, 2))
        for p in summary["files_written"]:
            os.remove(p)
    else:
        entry["error"] = (run["stderr"].strip().splitlines() or ["?"])[-1]
    return entry


def render(entries: list[dict], env: dict) -> str:
    lines = [
        "# Large models: optimize time and peak memory against model size (issue 18)",
        "",
        "LLaMA-style decoders from models/llama_large.py (8 layers each: the same nodes at every size,",
        "float32 weights in an external data file), optimized by `onnxfuse optimize IN OUT --json`",
        "in a fresh process per run. Peak RSS is the process's maximum resident set size (wait4's",
        "ru_maxrss), which counts the pages of memory-mapped weight files it touched as well as its own",
        "memory.",
        "",
        f"- Machine: {env['machine']}",
        f"- Versions: Python {env['python']}, {', '.join(env['versions'])}",
        f"- Date: {env['date']}, commit {env['commit']}",
        f"- Command: `{env['command']}`",
        f"- Load average (1 min) at start and end: {env['load_start']:.1f}, {env['load_end']:.1f} (the machine is shared)",
        "",
        "| model | size GB | nodes | verification | time s | load | passes | verify | save | peak RSS GB | result |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for e in entries:
        st = e.get("stages", {})
        if e["rc"] == 0:
            if e["verify"]:
                what = f"--verify-mode {e['verify_mode']}: {e['mode']} ({e['mode_reason']})"
                if e["mode"] == "regions":
                    what += f", {e['regions']} fused nodes"
                result = f"ok, max abs error {e['max_abs']:.2g}"
            else:
                what, result = "--no-verify", "ok"
            nodes = f"{e['nodes_before']} -> {e['nodes_after']}"
        else:
            what = f"--verify-mode {e['verify_mode']}" if e["verify"] else "--no-verify"
            nodes, result = "", f"exit {e['rc']}: {e['error']}"
        lines.append(
            f"| {e['model']} | {e['size_gb']:.2f} | {nodes} | {what} | {e['seconds']:.1f} |"
            f" {st.get('load', 0):.1f} | {st.get('passes', 0):.1f} | {st.get('verify', 0):.1f} |"
            f" {st.get('save', 0):.1f} | {e['peak_rss_gb']:.2f} | {result} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/onnxfuse-large"), help="where models are generated")
    ap.add_argument("--presets", default="0.5gb,2.5gb,6gb")
    ap.add_argument("--modes", default="no-verify,auto,regions",
                    help="comma-separated runs per model: no-verify, or a --verify-mode (auto, whole, regions)")
    ap.add_argument("--write", default=str(RESULTS), help="results file ('' to print only)")
    args = ap.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    env = {
        "machine": _machine(),
        "python": platform.python_version(),
        "versions": [_version(d) for d in ("onnxruntime", "onnx", "onnx-graphsurgeon", "numpy")],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        "load_start": os.getloadavg()[0],
        "command": "python bench/large_model.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
    }
    entries = []
    for preset in args.presets.split(","):
        model = ensure_model(args.dir, preset)
        size = sum(os.path.getsize(p) for p in (model, model.with_name(model.name + ".data")))
        for mode in args.modes.split(","):
            entry = bench(model, args.dir, mode != "no-verify", mode)
            entry["size_gb"] = size / 1e9
            entries.append(entry)
            print(json.dumps(entry), flush=True)
    env["load_end"] = os.getloadavg()[0]
    text = render(entries, env)
    print(text)
    if args.write:
        path = Path(args.write)
        # The hand-written reading of the figures below the table survives a rerun.
        old = path.read_text() if path.exists() else ""
        if NOTES_HEADING in old:
            text += "\n" + old[old.index(NOTES_HEADING):]
        path.write_text(text)


if __name__ == "__main__":
    main()
