"""GPU benchmark: onnxfuse --target cuda against onnxruntime's CUDA provider, side by side.

For each model, four configurations run interleaved (A B C D A B C D ...), inputs and outputs
bound on the device at fixed addresses (IOBinding), so what is timed is one inference:
    ort        original model, CUDA provider, ORT_ENABLE_ALL
    ort+graph  the same with enable_cuda_graph (captured once, replayed)
    ours       optimized for --target cuda, our library registered
    ours+graph the same with enable_cuda_graph
Kernels per inference come from onnxruntime's profiler (Node events, one run). Our outputs are
checked against onnxruntime's before timing.

    python -m bench.gpu [--runs 200] [--budget SECONDS] [--md FILE] [--json FILE] [--env FILE]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import click
import numpy as np
import onnx

from bench import harness

# (label, zoo model, symbolic dims); in priority order: the budget may cut the tail.
CASES = [
    ("char-rnn b1", "char_rnn", {}),
    ("gpt-stack b1", "gpt_stack", {"batch": 1, "seq": 32}),
    ("gpt-stack b8", "gpt_stack", {"batch": 8, "seq": 32}),
    ("mlp-ensemble", "mlp_ensemble", {}),
    ("mobilenetv3 b1", "mobilenetv3", {"batch": 1}),
    ("resnet50 (light zoo)", "resnet50", {}),
]
CONFIGS = ("ort", "ort+graph", "ours", "ours+graph")


@dataclass
class Row:
    label: str
    model: str
    dims: dict
    kernels: dict = field(default_factory=dict)  # config -> kernels per inference
    median_ms: dict = field(default_factory=dict)  # config -> median latency
    p90_ms: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    max_abs_diff: float | None = None


def report_options(f):
    """--md, --json and --env, the options of every GPU bench script's report."""
    f = click.option("--env", default=None, help="a markdown file describing the machine, put above the table")(f)
    f = click.option("--json", default=None, help="write the rows as JSON here")(f)
    return click.option("--md", default=None, help="write the markdown report here")(f)


class NoGpu(click.ClickException):
    """onnxruntime cannot run a session on a GPU here: the script stops with exit status 2."""

    exit_code = 2


def cuda_onnxruntime():
    """(onnxruntime, the GPU's sm_XY architecture); NoGpu when onnxruntime cannot use a GPU here."""
    import onnxruntime as ort

    from onnxfuse.profile import cuda_usable

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise NoGpu("this onnxruntime has no CUDA provider (install onnxruntime-gpu)")
    if not cuda_usable():
        raise NoGpu("onnxruntime cannot use a GPU on this machine")
    return ort, device_arch()


def device_arch() -> str:
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    cuda.cuDeviceGet(ctypes.byref(dev), 0)
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    return f"sm_{major.value}{minor.value}"


def make_session(ort, model: onnx.ModelProto, library: bool, graph: bool, profile_prefix: str | None = None):
    from onnxfuse.runtime import session_options

    so = session_options(with_library=library, level="all", profile=profile_prefix is not None, provider="cuda")
    if profile_prefix:
        so.profile_file_prefix = profile_prefix
    cuda = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"}) if graph else "CUDAExecutionProvider"
    sess = ort.InferenceSession(model.SerializeToString(), sess_options=so,
                                providers=[cuda] if graph else [cuda, "CPUExecutionProvider"])
    if sess.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(f"the CUDA provider did not start: {sess.get_providers()}")
    return sess


def kernels_per_inference(ort, model, library: bool, feeds) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        sess = make_session(ort, model, library, graph=False, profile_prefix=os.path.join(tmp, "p"))
        sess.run(None, feeds)
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    return sum(1 for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"))


class Bound:
    """A session run through IOBinding with device-resident inputs and outputs."""

    def __init__(self, ort, sess, feeds, outputs):
        self.sess = sess
        self.io = sess.io_binding()
        self.keep = []
        for k, v in feeds.items():
            ov = ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0)
            self.keep.append(ov)
            self.io.bind_ortvalue_input(k, ov)
        self.outs = []
        for meta, ref in zip(sess.get_outputs(), outputs):
            ov = ort.OrtValue.ortvalue_from_shape_and_type(ref.shape, ref.dtype, "cuda", 0)
            self.outs.append(ov)
            self.io.bind_ortvalue_output(meta.name, ov)

    def run(self) -> None:
        self.sess.run_with_iobinding(self.io)

    def results(self):
        return [o.numpy() for o in self.outs]


def bench_case(ort, label, name, dims, runs, warmup, arch, conv_policy=None, split_k=False,
               tensor_cores=False, attention=False) -> Row:
    from onnxfuse import api, zoo
    from onnxfuse.inputs import random_inputs

    zm = zoo.get(name)
    row = Row(label, name, dims or dict(zm.dims))
    dims = dims or dict(zm.dims)
    original = onnx.load(str(zm.path))
    t0 = time.perf_counter()
    options = {**({"conv_policy": conv_policy} if conv_policy else {}), "conv_split_k": split_k,
               "conv_tensor_cores": tensor_cores, "attention_cuda": attention}
    optimized = api.optimize(original, target="cuda", arch=arch, verify_outputs=False, count_kernels=False,
                             dims=dims, options=options).model
    row.notes.append(f"optimize {time.perf_counter() - t0:.1f} s")
    opted_in = [k for k, v in options.items() if v is True]
    if opted_in:
        row.notes.append("opt-in pass options: " + ", ".join(opted_in))
    feeds = random_inputs(original, dims, 0)
    reference = make_session(ort, original, False, False).run(None, feeds)
    ours_out = make_session(ort, optimized, True, False).run(None, feeds)
    row.max_abs_diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                           for a, b in zip(ours_out, reference) if np.asarray(b).size)
    row.kernels["ort"] = kernels_per_inference(ort, original, False, feeds)
    row.kernels["ours"] = kernels_per_inference(ort, optimized, True, feeds)

    bound = {}
    for cfg in CONFIGS:
        model, library, graph = (optimized, True, "graph" in cfg) if cfg.startswith("ours") else (original, False, "graph" in cfg)
        try:
            b = Bound(ort, make_session(ort, model, library, graph), feeds, reference)
            for _ in range(warmup):
                b.run()
            if graph:
                got = b.results()
                err = max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(r, np.float64))))
                          for g, r in zip(got, reference) if np.asarray(r).size)
                if not err <= 1e-2 * max(1.0, max(float(np.max(np.abs(r))) for r in reference if np.asarray(r).size)):
                    raise RuntimeError(f"graph replay outputs differ from onnxruntime's by {err:.3g}")
            bound[cfg] = b
        except Exception as e:  # onnxruntime refuses graph capture for some models (CPU nodes)
            row.notes.append(f"{cfg}: not run ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    if bound:
        samples = harness.interleave({cfg: b.run for cfg, b in bound.items()}, order="cycle", min_rounds=runs,
                                     max_rounds=runs, warmup=1, runs=1)
        for cfg in bound:
            row.median_ms[cfg] = samples.median_ms(cfg)
            row.p90_ms[cfg] = samples.quantile_ms(cfg, 0.9)
    return row


def fmt(v, unit=""):
    return "n/a" if v is None else (f"{v:.3f}{unit}" if isinstance(v, float) else str(v))


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "n/a"


def markdown(rows, env: str, runs: int, skipped, stamp: harness.RunStamp) -> str:
    lines = stamp.header("onnxfuse on the GPU: --target cuda vs onnxruntime's CUDA provider")
    if env:
        lines += [env.strip(), ""]
    lines += [f"Median latency of one inference over {runs} interleaved runs (IOBinding, data on the device), "
              "kernels per inference from onnxruntime's profiler. Speedup = onnxruntime / ours.", "",
              "| model | kernels ORT | kernels ours | ORT ms | ORT+graph ms | ours ms | ours+graph ms | "
              "ours vs ORT | ours+graph vs ORT+graph | max abs diff |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r.median_ms
        lines.append(
            f"| {r.label} | {fmt(r.kernels.get('ort'))} | {fmt(r.kernels.get('ours'))} | {fmt(m.get('ort'))} | "
            f"{fmt(m.get('ort+graph'))} | {fmt(m.get('ours'))} | {fmt(m.get('ours+graph'))} | "
            f"{ratio(m.get('ort'), m.get('ours'))} | {ratio(m.get('ort+graph'), m.get('ours+graph'))} | "
            f"{r.max_abs_diff:.2g} |")
    notes = [f"- {r.label}: {n}" for r in rows for n in r.notes]
    if skipped:
        notes.append(f"- not run (time budget): {', '.join(skipped)}")
    if notes:
        lines += ["", "Notes:", *notes]
    lines += ["", "Produced by `bash gpu/run.sh` on the GPU host."]
    return "\n".join(lines) + "\n"


@harness.script(__doc__)
@click.option("--runs", type=int, default=200, show_default=True)
@click.option("--warmup", type=int, default=20, show_default=True)
@click.option("--budget", type=float, default=1e9, help="seconds; cases that would not fit are skipped")
@click.option("--models", default=None, help="comma-separated labels or zoo names")
@click.option("--conv-policy", default=None, type=click.Choice(["pays", "always"]),
              help="conv-bias-act's rule on cuda: pays (default, layers our kernel wins) or always (every layer)")
@click.option("--split-k", is_flag=True, help="conv-bias-act's split-K over thread-block clusters")
@click.option("--tensor-cores", is_flag=True, help="conv-bias-act's 3xTF32 tensor-core GEMM")
@click.option("--attention", is_flag=True, help="fuse-attention on cuda (pass option attention_cuda)")
@report_options
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int:
    ort, arch = cuda_onnxruntime()
    env = open(args.env).read() if args.env else ""
    cases = CASES
    if args.models:
        want = {w.strip() for w in args.models.split(",")}
        cases = [c for c in CASES if c[0] in want or c[1] in want]
    start = time.monotonic()
    rows, skipped, durations = [], [], []
    for label, name, dims in cases:
        elapsed = time.monotonic() - start
        expected = max(durations) if durations else 0.0
        if elapsed + expected > args.budget:
            skipped.append(label)
            print(f"[bench] skip {label}: {elapsed:.0f} s of {args.budget:.0f} s used", flush=True)
            continue
        t = time.monotonic()
        print(f"[bench] {label} ...", flush=True)
        try:
            row = bench_case(ort, label, name, dims, args.runs, args.warmup, arch, args.conv_policy, args.split_k,
                             args.tensor_cores, args.attention)
        except Exception as e:
            row = Row(label, name, dims, notes=[f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"])
            row.max_abs_diff = float("nan")
        durations.append(time.monotonic() - t)
        rows.append(row)
        print(f"[bench] {label}: kernels {row.kernels} median ms {row.median_ms} ({durations[-1]:.0f} s)", flush=True)
    harness.write_report(args.md, markdown(rows, env, args.runs, skipped, stamp))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": arch, "runs": args.runs, "rows": [asdict(r) for r in rows], "skipped": skipped}, f, indent=1)
    return 0


main = harness.main_of(cli)

if __name__ == "__main__":
    sys.exit(main())
