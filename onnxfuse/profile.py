"""Kernels per inference, bytes moved and latency of a model in onnxruntime.

Kernel counts come from onnxruntime's own profiler: it writes one event of category "Node"
whose name ends in "_kernel_time" for every kernel it executes, after its graph optimizations,
so the count is what actually ran. Latency is measured in separate runs without the profiler
(it adds per-kernel overhead), after warm-up; two models are timed interleaved (A B A B ...) so
that drift of a shared machine does not favour one of them.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import onnx

from .inputs import UnfeedableInputError, random_inputs
from .records import attributes

# Sessions and profiled runs live in the ort layer (runtime), which verify uses too; they are
# part of this module's documented interface as well.
from .runtime import (  # noqa: F401
    KERNEL_SUFFIX,
    KernelProfile,
    cuda_usable,
    kernel_events,
    needs_library,
    open_session,
    profiled_run,
    summarize_events,
)


@dataclass
class Latency:
    median_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float
    runs: int
    samples_ms: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        return attributes(self, "median_ms p10_ms p90_ms mean_ms runs")


@dataclass
class ModelReport:
    label: str
    kernels: KernelProfile
    latency: Latency | None = None
    # op types of the model's onnxfuse nodes: the profiler names kernels by op type alone, the
    # display names these as the model and the optimize summary do (onnxfuse.Pointwise)
    fused_op_types: frozenset = frozenset()

    def as_dict(self) -> dict:
        return {"model": self.label, **self.kernels.as_dict(), "latency": self.latency.as_dict() if self.latency else None}


def kernel_profile(
    model: onnx.ModelProto | bytes | str,
    provider: str = "cpu",
    threads: int | None = None,
    level: str = "all",
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    with_library: bool | None = None,
) -> KernelProfile:
    """The kernels one inference executes. Counted in a session that leaves the weights unpacked
    (runtime.session_options(prepack=False)): the same kernels run, and making the session
    costs a fraction (bench/results/verify_prepacking.md); its kernel times include packing
    weights per run, so latency and time shares come from profile_models, which packs."""
    return profiled_run(model, _feeds(model, dims, seed), provider, threads, level, with_library, prepack=False)[1]


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


def _feeds(model: onnx.ModelProto | bytes | str, dims: Mapping[str, int] | None, seed: int, label: str | None = None):
    """random_inputs for a model as a ModelProto, bytes or a path (read without its weights);
    `label` names the model in the error when its inputs cannot be fed."""
    if isinstance(model, bytes):
        model = onnx.load_from_string(model)
    elif not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    try:
        return random_inputs(model, dims, seed)
    except UnfeedableInputError as e:
        if label is None:
            raise
        raise UnfeedableInputError(f"{label}: {e}") from None


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
    feeds = _feeds(model, dims, seed)
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
        feeds = _feeds(model, dims, seed, label)
        _, prof = profiled_run(model, feeds, provider, threads, level, runs=profile_runs)
        fused = frozenset(n.op_type for n in model.graph.node if n.domain == "onnxfuse") \
            if isinstance(model, onnx.ModelProto) else frozenset()
        reports.append(ModelReport(label, prof, fused_op_types=fused))
        sess, _ = open_session(model, provider, threads, level)
        timed.append((sess, feeds))
    if runs > 0:
        for report, samples in zip(reports, _timed_runs(timed, runs, warmup)):
            report.latency = _latency(samples)
    return reports


def compare(model_a: onnx.ModelProto, model_b: onnx.ModelProto, *options, **named_options) -> dict:
    """Two models side by side: their reports and the ratios B/A (options as for profile_models)."""
    a, b = profile_models([("a", model_a), ("b", model_b)], *options, **named_options)
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
