"""Real-size models: onnxfuse beside onnxruntime alone, onnxruntime's transformers optimizer and onnxscript.

The published architectures at their published sizes (random weights), exported from torch at
run time by bench/realsize_models.py with a Python that has torch, torchvision and transformers
(--torch-python); nothing is committed and nothing runs in CI. For each model and each variant:

    ort               the exported model (onnxruntime's own optimizer alone, ORT_ENABLE_ALL)
    onnxfuse          `onnxfuse optimize IN OUT` (defaults: default CPU pipeline, verification)
    ort_transformers  onnxruntime.transformers.optimizer.optimize_model (model type, heads and
                      hidden size given; CPU)
    onnxscript        onnxscript's optimizer, then onnxscript.rewriter.ort_fusions.optimize_for_ort
    onnxfuse-without-PASS[+PASS]   onnxfuse's default CPU pipeline without those passes (not
                      run by default): what a pass earns, side by side with the whole pipeline

each optimizer in its own process, whose wall time and peak resident memory (wait4) are the
figures (onnxfuse's include loading, verification and saving; the peers' their API call and
saving); kernels per inference (onnxruntime's profiler, CPU, 1 thread) and outputs checked against
the original's at the model's real dims; latency ratios against onnxruntime alone at 1 and 2
intra-op threads, interleaved rounds (bench/harness.py; median of per-round ratios); and the
share of the original's profiled kernel time in MatMul/Gemm kernels (how close it is to its
matmul floor).

    python -m bench.realsize --torch-python /path/to/python-with-torch [--models bert_ts,gpt2_ts]
    python -m bench.realsize --models vit_ts --tools onnxfuse,onnxfuse-without-fuse-attention --workdir DIR
        (a pass's A/B; reuses DIR/vit_ts.onnx when it is there; --out/--json-out elsewhere)
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from bench import harness

OUT_MD = harness.RESULTS / "realsize.md"
OUT_JSON = harness.RESULTS / "realsize.json"
RESULT_MARK = "@@realsize-result "
TOOLS = ("onnxfuse", "ort_transformers", "onnxscript")

# name -> (what it is, dims it runs at, onnxruntime.transformers model type, heads, hidden)
MODELS = {
    "bert_ts": ("BERT-base, seq 128 (TorchScript)", {"batch": 1, "sequence": 128}, "bert", 12, 768),
    "bert_dynamo": ("BERT-base, seq 128 (dynamo)", {"batch": 1, "sequence": 128}, "bert", 12, 768),
    "gpt2_ts": ("GPT-2 small, seq 128", {"batch": 1, "sequence": 128}, "gpt2", 12, 768),
    "gpt2_decode_ts": ("GPT-2 small, decode step, past 128", {"batch": 1, "past_sequence": 128,
                                                               "total_sequence": 129}, "gpt2", 12, 768),
    "vit_ts": ("ViT-B/16, 224", {"batch": 1}, "vit", 12, 768),
    "resnet50_ts": ("ResNet-50, 224", {"batch": 1}, "bert", 0, 0),
    "whisper_enc_ts": ("Whisper-base encoder", {"batch": 1}, "bert", 8, 512),
    "qwen2_decode_ts": ("Qwen2-0.5B, decode step, past 128 (external data)",
                        {"batch": 1, "past_sequence": 128, "total_sequence": 129}, "gpt2", 14, 896),
    "tinyllama_decode_ts": ("TinyLlama-1.1B, decode step, past 128 (external data)",
                            {"batch": 1, "past_sequence": 128, "total_sequence": 129}, "gpt2", 32, 2048),
}
MATMUL_OPS = ("MatMul", "Gemm", "FusedMatMul", "FusedGemm", "MatMulInteger", "Attention", "MultiHeadAttention")


# ----------------------------------------------------------------------------- optimizer workers


def _worker(tool: str, src: str, out: str, name: str) -> dict:
    if tool == "onnxscript":
        import onnx_ir as ir
        from onnxscript import optimizer
        from onnxscript.rewriter import ort_fusions

        t0 = time.perf_counter()
        m = ir.load(src)
        optimizer.optimize(m)
        m, _ = ort_fusions.optimize_for_ort(m)
        if os.path.exists(src + ".data"):
            ir.save(m, out, external_data=os.path.basename(out) + ".data")
        else:
            ir.save(m, out)
        return {"seconds": time.perf_counter() - t0}
    raise ValueError(f"unknown tool {tool}")


# onnxruntime.transformers' optimizer imports torch: it runs in the Python that has it.
ORT_TRANSFORMERS = """
import json, os, sys, time
from onnxruntime.transformers.optimizer import optimize_model
src, out, model_type, heads, hidden = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
t0 = time.perf_counter()
m = optimize_model(src, model_type=model_type, num_heads=heads, hidden_size=hidden, use_gpu=False)
m.save_model_to_file(out, use_external_data_format=os.path.exists(src + ".data"))
print(sys.argv[6] + json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
"""


TIME = "/usr/bin/time"


def _child(cmd: list[str], timeout: float, memory_gib: float | None = None) -> tuple[int, str, float, float, float]:
    """(exit status, stdout, wall seconds, peak resident GiB, CPU seconds) of a child process,
    its address space limited to `memory_gib` where given (a tool that needs more fails with
    its own out-of-memory error instead of the kernel killing whatever it picks).
    The peak comes from /usr/bin/time where there is one: a child started from this process
    reports this process's own peak as its own (exec records the memory it leaves, which
    vfork shares with this process), while /usr/bin/time's child starts from a small process."""
    t0 = time.perf_counter()
    stats = None
    if os.access(TIME, os.X_OK):
        stats = tempfile.NamedTemporaryFile("r", suffix=".time", delete=False)
        cmd = [TIME, "-o", stats.name, "-f", "%M %U %S", *cmd]
    with tempfile.TemporaryFile("w+") as out:
        limit = None if memory_gib is None else int(memory_gib * (1 << 30))
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=str(harness.ROOT),
                                preexec_fn=None if limit is None else
                                (lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))))
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    peak, cpu = usage.ru_maxrss / (1 << 20), usage.ru_utime + usage.ru_stime
    if stats is not None:
        fields = (stats.read().split() or [""])[-3:]
        stats.close()
        os.unlink(stats.name)
        if len(fields) == 3:
            peak, cpu = int(fields[0]) / (1 << 20), float(fields[1]) + float(fields[2])
        if proc.returncode > 128 and proc.returncode - 128 in signal.Signals._value2member_map_:
            # /usr/bin/time exits with 128 + N when its command is ended by signal N
            proc.returncode = -(proc.returncode - 128)
    return proc.returncode, text, time.perf_counter() - t0, peak, cpu


# A tool "onnxfuse-without-fuse-attention" (or "...-without-A+B") is onnxfuse's default CPU
# pipeline without those passes: what a pass earns on a real model, measured side by side with
# the whole pipeline (--tools onnxfuse,onnxfuse-without-fuse-attention).
WITHOUT = "onnxfuse-without-"


def default_passes_without(left_out: list[str]) -> list[str]:
    from onnxfuse.pipeline import select_passes

    names = [p.name for p in select_passes(None, "cpu")]
    unknown = [n for n in left_out if n not in names]
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: not in the default CPU pipeline ({', '.join(names)})")
    return [n for n in names if n not in left_out]


def optimize(tool: str, src: Path, out: Path, name: str, timeout: float, torch_python: str,
             memory_gib: float | None = None) -> dict:
    if tool == "ort_transformers":
        _, _, model_type, heads, hidden = MODELS[name]
        cmd = [torch_python, "-c", ORT_TRANSFORMERS, str(src), str(out), model_type, str(heads), str(hidden),
               RESULT_MARK]
    elif tool == "onnxfuse" or tool.startswith(WITHOUT):
        report = out.with_suffix(".report.json")
        cmd = [sys.executable, "-m", "onnxfuse", "optimize", str(src), str(out), "--report", str(report)]
        dims = MODELS[name][1]
        if "past_sequence" in dims:  # a decode step: its cache and mask lengths must agree (1 and 1 do not)
            cmd += [f"--dim={k}={v}" for k, v in dims.items()]
        if tool.startswith(WITHOUT):
            cmd += ["--passes", ",".join(default_passes_without(tool[len(WITHOUT):].split("+")))]
    else:
        cmd = [sys.executable, "-m", "bench.realsize", "--worker", json.dumps([tool, str(src), str(out), name])]
    status, text, wall, peak, cpu = _child(cmd, timeout, memory_gib)
    result = {"status": "ok" if status == 0 else "failed", "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
              "peak_gib": round(peak, 2)}
    if status != 0:
        result["error"] = " ".join(text.strip().splitlines()[-1:])[:300] or (
            f"ended by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}")
        return result
    if tool == "onnxfuse" or tool.startswith(WITHOUT):
        summary = json.loads(report.read_text())["summary"]
        result["stages"] = summary["seconds"]
        result["kernels_reported"] = [summary.get("kernels_before"), summary.get("kernels_after")]
        result["verified_dims"] = summary.get("dims")
        result["optimize_s"] = round(wall, 2)
    else:
        line = next((ln for ln in reversed(text.splitlines()) if ln.startswith(RESULT_MARK)), None)
        result["optimize_s"] = round(json.loads(line[len(RESULT_MARK):])["seconds"], 2) if line else None
    return result


# ----------------------------------------------------------------------------- measuring


def measure(name: str, src: Path, workdir: Path, args) -> dict:
    import onnx

    from bench.compare import _check_outputs, interleaved_latency
    from onnxfuse.environment import ort_error_text
    from onnxfuse.inputs import random_inputs
    from onnxfuse.runtime import open_session, profiled_run

    label, dims, *_ = MODELS[name]
    original = onnx.load(str(src), load_external_data=False)
    size = src.stat().st_size + (Path(str(src) + ".data").stat().st_size if Path(str(src) + ".data").exists() else 0)
    entry = {"model": name, "label": label, "dims": dims, "nodes": len(original.graph.node),
             "file_mib": round(size / (1 << 20), 1), "variants": {"ort": {"status": "ok", "path": str(src)}}}
    for tool in args.tools:
        out = workdir / f"{name}.{tool}.onnx"
        harness.log(f"{name}: optimizing with {tool}")
        info = optimize(tool, src, out, name, args.tool_timeout, args.torch_python, args.tool_memory)
        info["path"] = str(out)
        entry["variants"][tool] = info
        harness.log(f"  {tool}: {info['status']} {info.get('optimize_s')} s, peak {info['peak_gib']} GiB "
                    f"{info.get('error', '')}")
    feeds = random_inputs(original, dims, 0)
    expected = None
    for variant, info in entry["variants"].items():
        if info["status"] != "ok":
            continue
        try:
            outputs, prof = profiled_run(info["path"], feeds, "cpu", threads=1, runs=3)
        except Exception as e:  # onnxruntime's exception types
            info.update(status="failed", error=f"onnxruntime cannot run it: {ort_error_text(e)}"[:300])
            continue
        if variant == "ort":
            expected = outputs
            total = prof.kernel_time_us or 1.0
            entry["matmul_share"] = round(sum(t for op, t in prof.time_us_by_op_type.items() if op in MATMUL_OPS)
                                          / total, 3)
        else:
            problem = _check_outputs(original, expected, outputs)
            if problem:
                info.update(status="failed", error=problem[:300])
                continue
        info["kernels"] = prof.kernels_per_inference
    del expected
    for threads in (1, 2):
        ok = [v for v, info in entry["variants"].items() if info["status"] == "ok"]
        sessions = {v: open_session(entry["variants"][v]["path"], "cpu", threads)[0] for v in ok}
        latency = interleaved_latency(sessions, feeds, args.rounds, args.min_rounds, args.budget, 3, 20.0,
                                      baseline="ort")
        del sessions
        for v, lat in latency.items():
            entry["variants"][v][f"ratio_{threads}t"] = round(lat["ratio"], 3)
            entry["variants"][v][f"median_ms_{threads}t"] = round(lat["median_ms"], 2)
            entry["variants"][v][f"rounds_{threads}t"] = lat["runs"]
        harness.log(f"  {threads} thread(s): " + ", ".join(f"{v} {lat['median_ms']:.1f} ms ({lat['ratio']:.3f})"
                                                            for v, lat in latency.items()))
    for info in entry["variants"].values():
        info.pop("path", None)
    return entry


def render(entries: list[dict], stamp: harness.RunStamp, torch_versions: str) -> str:
    lines = stamp.header("Real-size models: onnxfuse, onnxruntime alone and its peers", "onnxruntime", "onnx",
                         "onnxscript", "onnx_ir")
    lines += [f"Exports: {torch_versions}; random weights at the published configurations (bench/realsize_models.py).",
              "Latency figures are interleaved ratios (per-round model / onnxruntime alone, median; below 1 is "
              "faster); optimize times are wall seconds of a child process, which grow with the machine's load "
              "(the load average at the start is in the header), and its CPU seconds (user + system).", ""]
    head = ["model", "file MiB", "nodes", "matmul share", "variant", "kernels", "ratio 1 thread", "ratio 2 threads",
            "optimize s", "optimize CPU s", "peak GiB"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        first = True
        for v, info in e["variants"].items():
            lead = [e["label"], f"{e['file_mib']:.0f}", str(e["nodes"]),
                    f"{e.get('matmul_share', 0) * 100:.0f}%"] if first else ["", "", "", ""]
            first = False
            if info["status"] != "ok":
                lines.append("| " + " | ".join(lead + [v, "failed: " + info.get("error", "")[:120], "", "", "", "", ""]) + " |")
                continue
            fmt = lambda x, f="{:.3f}": f.format(x) if isinstance(x, (int, float)) else "-"  # noqa: E731
            lines.append("| " + " | ".join(lead + [v, str(info.get("kernels", "-")), fmt(info.get("ratio_1t")),
                                                   fmt(info.get("ratio_2t")), fmt(info.get("optimize_s"), "{:.1f}"),
                                                   fmt(info.get("cpu_s"), "{:.1f}"),
                                                   fmt(info.get("peak_gib"), "{:.2f}")]) + " |")
    lines += ["", "onnxfuse's optimize time is `onnxfuse optimize` as a user runs it (load, passes, verification "
              "against onnxruntime at the dims it picks, save); kernels are per inference at the dims above."]
    return "\n".join(lines) + "\n"


@harness.script(__doc__)
@click.option("--torch-python", default=lambda: os.environ.get("ONNXFUSE_TORCH_PYTHON", "python3"),
              help="The Python that has torch, torchvision and transformers, for the exports.")
@click.option("--models", callback=harness.csv(), default=",".join(MODELS), show_default=True)
@click.option("--tools", callback=harness.csv(), default=",".join(TOOLS), show_default=True)
@click.option("--workdir", type=click.Path(path_type=Path), default=None,
              help="Where the exports and optimized models go (default: a temporary folder, removed after).")
@click.option("--budget", type=float, default=20.0, show_default=True, help="Seconds of latency rounds per setting.")
@click.option("--rounds", type=int, default=200, show_default=True)
@click.option("--min-rounds", type=int, default=8, show_default=True)
@click.option("--tool-timeout", type=float, default=1200.0, show_default=True)
@click.option("--tool-memory", type=float, default=None,
              help="GiB of address space each optimizer may use (default: no limit).")
@click.option("--out", type=click.Path(path_type=Path), default=OUT_MD, show_default=True)
@click.option("--json-out", type=click.Path(path_type=Path), default=OUT_JSON, show_default=True)
@click.option("--worker", default=None, hidden=True)
def cli(args, stamp) -> int:
    if args.worker:
        tool, src, out, name = json.loads(args.worker)
        print(RESULT_MARK + json.dumps(_worker(tool, src, out, name)), flush=True)
        return 0
    versions = subprocess.run([args.torch_python, "-c", "import torch, transformers;"
                               " print(f'torch {torch.__version__}, transformers {transformers.__version__}')"],
                              capture_output=True, text=True).stdout.strip()
    entries = []
    with tempfile.TemporaryDirectory(prefix="onnxfuse-realsize-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            if name not in MODELS:
                raise click.BadParameter(f"unknown model {name}; known: {', '.join(MODELS)}")
            src = workdir / f"{name}.onnx"
            if not src.exists():
                harness.log(f"{name}: exporting")
                subprocess.run([args.torch_python, str(harness.ROOT / "bench" / "realsize_models.py"), str(workdir),
                                name], check=True, cwd=str(harness.ROOT))
            entries.append(measure(name, src, workdir, args))
            report = {"command": stamp.command, "started": stamp.started, "machine": harness.machine(),
                      "versions": harness.versions("onnxruntime", "onnx", "onnxscript", "onnx_ir"),
                      "exports": versions, "models": entries}
            harness.write_report(args.json_out, json.dumps(report, indent=1) + "\n", echo=False)
            harness.write_report(args.out, render(entries, stamp, versions), echo=False)
            for tool in args.tools:  # the optimized models are not kept
                for p in workdir.glob(f"{name}.{tool}.onnx*"):
                    p.unlink()
    print(render(entries, stamp, versions))
    return 0


main = harness.main_of(cli)

if __name__ == "__main__":
    sys.exit(main())
