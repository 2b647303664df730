"""Time and peak memory of `onnxfuse optimize` against model size (issue 18).

Generates LLaMA-style models with models/llama_large.py (8 layers each, so every size has the
same node count and only the bytes differ; weights in an external data file) and runs
`onnxfuse optimize IN OUT --json` on each with --no-verify, with --verify-mode auto (the
default) and with --verify-mode regions, each in its own process. Peak memory
is that process's maximum resident set size (wait4's ru_maxrss: anonymous memory and the
pages of mapped weight files it touched).

    python -m bench.large_model --dir /tmp/llama                    # 0.5gb, 2.5gb, 6gb presets
    python -m bench.large_model --dir /tmp/llama --presets 0.5gb --write ''   # print only

Generated models are reused when present in --dir (they are seeded: the same bytes).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import click

from bench import harness
from onnxfuse.models import llama_large

RESULTS = harness.RESULTS / "large_model.md"
NOTES_HEADING = "## Reading the figures"


def ensure_model(directory: Path, preset: str) -> Path:
    path = directory / f"llama_{preset}.onnx"
    if not (path.exists() and path.with_name(path.name + ".data").exists()):
        llama_large.build(path, **llama_large.PRESETS[preset])
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
                     regions={kind: sum(1 for r in v.get("regions", []) if r.get("kind") == kind and not r["skipped"])
                              for kind in ("fused", "rewrite")} if v else None,
                     not_checked=sum(1 for r in v.get("regions", []) if r["skipped"]) if v else None,
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
                    what += (f", {e['regions']['fused']} fused nodes and {e['regions']['rewrite']} other rewrites"
                             f" checked, {e['not_checked']} not")
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


@harness.script(__doc__)
@click.option("--dir", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/onnxfuse-large"),
              show_default=True, help="where models are generated")
@click.option("--presets", callback=harness.csv(), default="0.5gb,2.5gb,6gb", show_default=True)
@click.option("--modes", callback=harness.csv(), default="no-verify,auto,regions", show_default=True,
              help="comma-separated runs per model: no-verify, or a --verify-mode (auto, whole, regions)")
@click.option("--write", default=str(RESULTS), help="results file ('' to print only)")
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> None:
    args.dir.mkdir(parents=True, exist_ok=True)
    env = {
        "machine": harness.machine_and_system(),
        "python": platform.python_version(),
        "versions": [harness.dist_version(d) for d in ("onnxruntime", "onnx", "onnx-graphsurgeon", "numpy")],
        "date": stamp.started,
        "commit": stamp.commit,
        "load_start": stamp.load[0],
        "command": stamp.command,
    }
    entries = []
    for preset in args.presets:
        model = ensure_model(args.dir, preset)
        size = sum(os.path.getsize(p) for p in (model, model.with_name(model.name + ".data")))
        for mode in args.modes:
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


main = harness.main_of(cli)

if __name__ == "__main__":
    sys.exit(main())
