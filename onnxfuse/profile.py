"""Kernels per inference, bytes moved and latency of a model in onnxruntime.

Kernel counts come from onnxruntime's own profiler: it writes one event of category "Node"
whose name ends in "_kernel_time" for every kernel it executes, after its graph optimizations,
so the count is what actually ran. Latency is measured in separate runs without the profiler
(it adds per-kernel overhead), after warm-up; two models are timed interleaved (A B A B ...) so
that drift of a shared machine does not favour one of them.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import onnx

from .modelio import InputError
from .runtime import PROVIDERS, needs_library, session_options
from .verify import UnfeedableInputError, random_inputs

KERNEL_SUFFIX = "_kernel_time"


@dataclass
class KernelProfile:
    """What one inference executed, from the profiler."""

    kernels_per_inference: int
    by_op_type: dict[str, int]  # kernels per inference by op type, most frequent first
    by_provider: dict[str, int]
    activation_bytes_read: int | None  # non-constant kernel inputs, summed over kernels
    parameter_bytes_read: int | None  # constant (initializer) kernel inputs
    bytes_written: int | None  # kernel outputs
    library_loaded: bool
    provider: str
    level: str
    # Profiler time of the kernels per inference (microseconds), by op type, most first; the
    # first run is left out when there are more (it pays one-off costs such as weight packing).
    # The profiler adds overhead to every kernel, so small kernels read long: for shares only.
    # Timings differ from run to run, so they take no part in comparing two profiles.
    time_us_by_op_type: dict[str, float] = field(default_factory=dict, compare=False)
    timed_runs: int = field(default=0, compare=False)

    @property
    def kernel_time_us(self) -> float:
        return sum(self.time_us_by_op_type.values())

    def as_dict(self) -> dict:
        return {
            "kernels_per_inference": self.kernels_per_inference,
            "by_op_type": self.by_op_type,
            "time_us_by_op_type": self.time_us_by_op_type,
            "kernel_time_us": self.kernel_time_us,
            "timed_runs": self.timed_runs,
            "by_provider": self.by_provider,
            "activation_bytes_read": self.activation_bytes_read,
            "parameter_bytes_read": self.parameter_bytes_read,
            "bytes_written": self.bytes_written,
            "library_loaded": self.library_loaded,
            "provider": self.provider,
            "ort_level": self.level,
        }


@dataclass
class Latency:
    median_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float
    runs: int
    samples_ms: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        return {
            "median_ms": self.median_ms,
            "p10_ms": self.p10_ms,
            "p90_ms": self.p90_ms,
            "mean_ms": self.mean_ms,
            "runs": self.runs,
        }


@dataclass
class ModelReport:
    label: str
    kernels: KernelProfile
    latency: Latency | None = None

    def as_dict(self) -> dict:
        return {"model": self.label, **self.kernels.as_dict(), "latency": self.latency.as_dict() if self.latency else None}


# --------------------------------------------------------------------------- sessions


def _model_bytes(model: onnx.ModelProto | bytes | str, provider: str = "cpu") -> tuple[bytes | str, bool]:
    """(what InferenceSession takes, whether our library runs its fused ops on this provider)."""
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString(), needs_library(model, provider)
    if isinstance(model, bytes):
        return model, needs_library(onnx.load_from_string(model), provider)
    return str(model), needs_library(onnx.load(str(model), load_external_data=False), provider)


def open_session(
    model: onnx.ModelProto | bytes | str,
    provider: str = "cpu",
    threads: int | None = None,
    level: str = "all",
    with_library: bool | None = None,
    profile_prefix: str | None = None,
):
    """(InferenceSession, library_loaded). The library is registered when the model holds
    fused ops (with_library=None) or as asked. Asking for CUDA where onnxruntime cannot use
    it is an InputError, not a silent fallback to the CPU."""
    import onnxruntime as ort

    data, fused = _model_bytes(model, provider)
    if with_library is None:
        with_library = fused
    so = session_options(
        with_library=with_library, threads=threads, level=level, profile=profile_prefix is not None, provider=provider
    )
    if profile_prefix is not None:
        so.profile_file_prefix = profile_prefix
    # Failures reach the caller as exceptions; onnxruntime's own error log (for example a
    # failed session's "Could not write a profile") would be a second, redundant message.
    so.log_severity_level = 4
    if provider not in PROVIDERS:
        raise InputError(f"unknown provider '{provider}' (known: {', '.join(PROVIDERS)})")
    if provider == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise InputError("--provider cuda: this onnxruntime has no CUDA execution provider")
    sess = ort.InferenceSession(data, sess_options=so, providers=PROVIDERS[provider])
    if provider == "cuda" and "CUDAExecutionProvider" not in sess.get_providers():
        raise InputError("--provider cuda: onnxruntime could not start its CUDA provider (no usable GPU or driver)")
    return sess, with_library


def cuda_usable() -> bool:
    """Whether onnxruntime can run a session on its CUDA provider here (a GPU and a driver)."""
    global _cuda_usable
    if _cuda_usable is None:
        import onnxruntime as ort

        from .modelio import _probe_model, ort_max_ir_version

        _cuda_usable = False
        if "CUDAExecutionProvider" in ort.get_available_providers():
            so = ort.SessionOptions()
            so.log_severity_level = 4
            try:
                sess = ort.InferenceSession(_probe_model(ort_max_ir_version(), 13), sess_options=so,
                                            providers=PROVIDERS["cuda"])
                _cuda_usable = "CUDAExecutionProvider" in sess.get_providers()
            except Exception:  # onnxruntime's exception types: no usable CUDA
                _cuda_usable = False
    return _cuda_usable


_cuda_usable: bool | None = None


# --------------------------------------------------------------------------- profiler events


def _tensor_bytes(type_shapes) -> int | None:
    """Bytes of tensors described as [{"float": [1, 3]}, ...] (profiler's *_type_shape args)."""
    total = 0
    for entry in type_shapes or []:
        for type_name, shape in entry.items():
            try:
                itemsize = np.dtype(_PROFILER_TYPES.get(type_name, type_name)).itemsize
            except TypeError:
                return None
            total += itemsize * int(np.prod(shape, dtype=np.int64))
    return total


_PROFILER_TYPES = {"float": "float32", "double": "float64", "float16": "float16", "bfloat16": "uint16", "bool": "bool"}


def kernel_events(events: Sequence[dict]) -> list[dict]:
    """The profiler events that are one executed kernel each."""
    return [e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith(KERNEL_SUFFIX)]


def summarize_events(events: Sequence[dict], runs: int, library_loaded: bool, provider: str, level: str) -> KernelProfile:
    """Per-inference counts and bytes from a profiler trace covering `runs` inferences."""
    run_events = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e.get("ts", 0)
    )
    runs = len(run_events) or runs
    kernels = kernel_events(events)
    by_op = Counter(e.get("args", {}).get("op_name", "?") for e in kernels)
    # Kernel time: runs after the first (warm-up) when the trace holds more than one.
    timed_runs, after_ts = runs, None
    if len(run_events) > 1:
        first = run_events[0]
        timed_runs, after_ts = len(run_events) - 1, first.get("ts", 0) + first.get("dur", 0)
    time_by_op: Counter = Counter()
    for e in kernels:
        if after_ts is None or e.get("ts", 0) >= after_ts:
            time_by_op[e.get("args", {}).get("op_name", "?")] += float(e.get("dur", 0))
    by_provider = Counter(e.get("args", {}).get("provider", "?") for e in kernels)
    act = par = out = 0
    known = True
    for e in kernels:
        args = e.get("args", {})
        if "activation_size" in args and "output_size" in args:
            act += int(args["activation_size"])
            par += int(args.get("parameter_size", 0))
            out += int(args["output_size"])
            continue
        read = _tensor_bytes(args.get("input_type_shape"))
        written = _tensor_bytes(args.get("output_type_shape"))
        if read is None or written is None or "input_type_shape" not in args:
            known = False
            continue
        act += read
        out += written

    def per_run(n: int) -> int:
        return int(round(n / runs))

    return KernelProfile(
        kernels_per_inference=per_run(len(kernels)),
        by_op_type={k: per_run(v) for k, v in by_op.most_common()},
        by_provider={k: per_run(v) for k, v in by_provider.most_common()},
        activation_bytes_read=per_run(act) if known else None,
        parameter_bytes_read=per_run(par) if known else None,
        bytes_written=per_run(out) if known else None,
        library_loaded=library_loaded,
        provider=provider,
        level=level,
        time_us_by_op_type={k: v / timed_runs for k, v in time_by_op.most_common()},
        timed_runs=timed_runs,
    )


def profiled_run(
    model: onnx.ModelProto | bytes | str,
    feeds: Mapping[str, np.ndarray],
    provider: str = "cpu",
    threads: int | None = None,
    level: str = "all",
    with_library: bool | None = None,
    runs: int = 1,
) -> tuple[list[np.ndarray], KernelProfile]:
    """Run the model `runs` times with onnxruntime's profiler on: (outputs of the last run, profile)."""
    with tempfile.TemporaryDirectory(prefix="onnxfuse-profile-") as tmp:
        sess, loaded = open_session(model, provider, threads, level, with_library, profile_prefix=os.path.join(tmp, "p"))
        outputs = None
        for _ in range(max(1, runs)):
            outputs = sess.run(None, dict(feeds))
        trace = sess.end_profiling()
        with open(trace) as f:
            events = json.load(f)
    return outputs, summarize_events(events, max(1, runs), loaded, provider, level)


def kernel_profile(
    model: onnx.ModelProto | bytes | str,
    provider: str = "cpu",
    threads: int | None = None,
    level: str = "all",
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    with_library: bool | None = None,
) -> KernelProfile:
    proto = model if isinstance(model, onnx.ModelProto) else _load_for_inputs(model)
    feeds = random_inputs(proto, dims, seed)
    return profiled_run(model, feeds, provider, threads, level, with_library)[1]


def count_kernels(
    model: onnx.ModelProto | bytes | str,
    provider: str = "cpu",
    threads: int | None = None,
    level: str = "all",
    dims: Mapping[str, int] | None = None,
) -> tuple[int, dict[str, int]]:
    """(kernels executed per inference, the same by op type) after onnxruntime's optimizations."""
    prof = kernel_profile(model, provider, threads, level, dims)
    return prof.kernels_per_inference, prof.by_op_type


def _load_for_inputs(model: bytes | str) -> onnx.ModelProto:
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return onnx.load(str(model), load_external_data=False)


# --------------------------------------------------------------------------- latency


def _latency(samples_ns: Sequence[int]) -> Latency:
    ms = sorted(s / 1e6 for s in samples_ns)
    q = statistics.quantiles(ms, n=10) if len(ms) >= 2 else [ms[0]] * 9
    return Latency(
        median_ms=statistics.median(ms),
        p10_ms=q[0],
        p90_ms=q[-1],
        mean_ms=statistics.fmean(ms),
        runs=len(ms),
        samples_ms=ms,
    )


def _timed_runs(sessions_and_feeds, runs: int, warmup: int) -> list[list[int]]:
    """Warm every session up, then time them in turns (A B A B ...)."""
    for sess, feeds in sessions_and_feeds:
        for _ in range(warmup):
            sess.run(None, feeds)
    samples: list[list[int]] = [[] for _ in sessions_and_feeds]
    clock = time.perf_counter_ns
    for _ in range(runs):
        for i, (sess, feeds) in enumerate(sessions_and_feeds):
            t0 = clock()
            sess.run(None, feeds)
            samples[i].append(clock() - t0)
    return samples


def measure_latency(
    model: onnx.ModelProto | bytes | str,
    provider: str = "cpu",
    threads: int | None = None,
    level: str = "all",
    dims: Mapping[str, int] | None = None,
    runs: int = 100,
    warmup: int = 10,
    seed: int = 0,
    with_library: bool | None = None,
) -> Latency:
    """Latency of one inference (no profiler), over `runs` runs after `warmup` runs."""
    proto = model if isinstance(model, onnx.ModelProto) else _load_for_inputs(model)
    feeds = random_inputs(proto, dims, seed)
    sess, _ = open_session(model, provider, threads, level, with_library)
    return _latency(_timed_runs([(sess, feeds)], max(1, runs), warmup)[0])


def profile_models(
    models: Sequence[tuple[str, onnx.ModelProto]],
    provider: str = "cpu",
    threads: int | None = None,
    level: str = "all",
    dims: Mapping[str, int] | None = None,
    runs: int = 100,
    warmup: int = 10,
    seed: int = 0,
    profile_runs: int = 6,
) -> list[ModelReport]:
    """Kernel profile and latency of each (label, model), timed interleaved. The profile covers
    `profile_runs` inferences: counts per inference, kernel time from all but the first."""
    reports: list[ModelReport] = []
    timed = []
    for label, model in models:
        try:
            feeds = random_inputs(model, dims, seed)
        except UnfeedableInputError as e:
            raise UnfeedableInputError(f"{label}: {e}") from None
        _, prof = profiled_run(model, feeds, provider, threads, level, runs=profile_runs)
        reports.append(ModelReport(label, prof))
        sess, _ = open_session(model, provider, threads, level)
        timed.append((sess, feeds))
    if runs > 0:
        for report, samples in zip(reports, _timed_runs(timed, runs, warmup)):
            report.latency = _latency(samples)
    return reports


def compare(
    model_a: onnx.ModelProto,
    model_b: onnx.ModelProto,
    provider: str = "cpu",
    threads: int | None = None,
    level: str = "all",
    dims: Mapping[str, int] | None = None,
    runs: int = 100,
    warmup: int = 10,
    seed: int = 0,
) -> dict:
    """Two models side by side: their reports and the ratios B/A."""
    a, b = profile_models([("a", model_a), ("b", model_b)], provider, threads, level, dims, runs, warmup, seed)
    return {"a": a, "b": b, "ratios": ratios(a, b)}


def ratios(a: ModelReport, b: ModelReport) -> dict[str, float | None]:
    def ratio(x, y):
        return None if x is None or y is None or x == 0 else y / x

    out = {
        "kernels_per_inference": ratio(a.kernels.kernels_per_inference, b.kernels.kernels_per_inference),
        "activation_bytes_read": ratio(a.kernels.activation_bytes_read, b.kernels.activation_bytes_read),
        "bytes_written": ratio(a.kernels.bytes_written, b.kernels.bytes_written),
        "kernel_time_us": ratio(a.kernels.kernel_time_us, b.kernels.kernel_time_us),
    }
    if a.latency and b.latency:
        out["median_ms"] = ratio(a.latency.median_ms, b.latency.median_ms)
    return out
