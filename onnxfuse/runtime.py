"""onnxruntime for the rest of onnxfuse: finding and registering the native custom-op library,
sessions, and runs under onnxruntime's profiler (what one inference executed).

This is the bottom layer with the io modules (modelio, modelsave, ...): verify, profile and zoo build on it, never the reverse.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx

from . import ops
from .fused import DOMAIN
from .modelio import InputError
from .records import attributes

_PKG = Path(__file__).resolve().parent
LIBRARY_STEM = "_onnxfuse_ops"
REBUILD_HINT = "rebuild it with `pip install -e .` (or `pip install .`) from the onnxfuse source tree"


class LibraryError(RuntimeError):
    """The custom-op library is missing or cannot be loaded."""


def library_path() -> str:
    """Path of the built custom-op library; ONNXFUSE_LIBRARY overrides where it is looked for.
    A file that is not a complete shared library for this machine is a LibraryError
    (check_library_file): loading it could crash the process."""
    env = os.environ.get("ONNXFUSE_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise LibraryError(f"ONNXFUSE_LIBRARY={env}: no such file")
        check_library_file(env)
        return env
    found = sorted(glob.glob(str(_PKG / f"{LIBRARY_STEM}*.so")))
    if not found:
        raise LibraryError(f"the onnxfuse custom-op library is not built (no {LIBRARY_STEM}*.so in {_PKG}); {REBUILD_HINT}")
    check_library_file(found[0])
    return found[0]


# ELF machine numbers of the architectures the library is built for (platform.machine() names).
_ELF_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21, "s390x": 22}
_checked_files: dict[tuple[str, int, int], None] = {}


def check_library_file(path: str) -> None:
    """LibraryError unless `path` is a whole 64-bit little-endian ELF shared object for this
    machine: every segment the loader maps and the section table lie inside the file. The
    dynamic loader maps a library by its headers; a truncated file maps pages past its end,
    and the first touch of one kills the process with SIGBUS, before any error can be
    reported. Checked once per file version (path, size, mtime)."""
    import platform
    import struct

    try:
        info = os.stat(path)
        key = (os.path.realpath(path), info.st_size, info.st_mtime_ns)
        if key in _checked_files:
            return
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size

            def damaged(why: str) -> LibraryError:
                return LibraryError(f"cannot load {path}: the custom-op library is damaged or truncated ({why});"
                                    f" {REBUILD_HINT}")

            if len(head) < 64 or head[:4] != b"\x7fELF":
                raise damaged("no ELF header")
            if head[4] != 2 or head[5] != 1:
                raise damaged("not a 64-bit little-endian ELF file")
            e_type, e_machine = struct.unpack_from("<HH", head, 16)
            e_phoff, e_shoff = struct.unpack_from("<QQ", head, 32)
            e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", head, 54)
            if e_type != 3:
                raise damaged("not a shared object")
            expected = _ELF_MACHINES.get(platform.machine().lower())
            if expected is not None and e_machine != expected:
                raise damaged(f"built for ELF machine {e_machine}, not {platform.machine()}")
            if e_phnum == 0 or e_phentsize < 56 or e_phoff + e_phnum * e_phentsize > size:
                raise damaged(f"its program headers lie past the end of its {size} bytes")
            if e_shnum and (e_shentsize < 64 or e_shoff + e_shnum * e_shentsize > size):
                raise damaged(f"its section headers lie past the end of its {size} bytes")
            f.seek(e_phoff)
            table = f.read(e_phnum * e_phentsize)
            for i in range(e_phnum):
                p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * e_phentsize)
                if p_type == 1 and p_offset + p_filesz > size:  # PT_LOAD
                    raise damaged(f"a segment ends at byte {p_offset + p_filesz}, the file has {size}")
    except OSError as e:
        raise LibraryError(f"cannot read {path}: {e.strerror or e}; {REBUILD_HINT}") from None
    _checked_files[key] = None


def get_library_path() -> str:
    """Path of onnxfuse's custom-op library, for onnxruntime's
    `SessionOptions.register_custom_ops_library` (the onnxruntime-extensions convention);
    `onnxfuse.get_library_path()` is this function.

        so = onnxruntime.SessionOptions()
        so.register_custom_ops_library(onnxfuse.get_library_path())

    Raises LibraryError when the library is not built.
    """
    return library_path()


# Fused op types the library registers for the CUDA provider (onnxfuse.ops' table). Their CUDA
# kernel launches the kernel compiled and stored with the node (--target cuda); a node without one
# must run its fallback function instead. On the CPU provider, op types the library does not
# implement fall back to their functions by themselves.
CUDA_KERNELS = ops.CUDA_KERNELS


def needs_library(model: onnx.ModelProto, provider: str = "cpu") -> bool:
    """True when the model holds fused ops and registering our library lets them run our
    kernels; False when it would bind a CUDA kernel to a node that has no compiled kernel
    (a model optimized for --target cpu, run on the CUDA provider): the fallback functions
    then run, which is always correct."""
    fused = [n for n in model.graph.node if n.domain == DOMAIN]
    if not fused:
        return False
    if provider == "cuda":
        return all(
            any(a.name == "cuda_entry" for a in n.attribute) for n in fused if n.op_type in CUDA_KERNELS
        )
    return True


PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
}


# Session config entry telling the library which providers' kernels to register (registry.h).
PROVIDERS_CONFIG_KEY = "onnxfuse.providers"


def session_options(
    with_library: bool = True,
    threads: int | None = None,
    level: str = "all",
    profile: bool = False,
    provider: str = "cpu",
    prepack: bool = True,
):
    """onnxruntime SessionOptions, with our custom-op library registered when asked.

    level: "disable", "basic", "extended" or "all" (onnxruntime's graph optimization level).
    provider: "cpu" registers our CPU kernels only; "cuda" also registers the CUDA kernels.
    A kernel registered for one provider stops onnxruntime from running the node's fallback
    function on the others, so a session gets the kernels of its own providers alone.
    prepack=False: onnxruntime's kernels keep their weights as they are instead of copying
    them into their own layouts when the session is made (session.disable_prepacking), for
    sessions that run a few times (verification): the same kernels, and a fraction of the
    time and memory to make the session of a large model (bench/results/verify_prepacking.md).
    """
    _check_onnxruntime_once()
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    if profile:
        so.enable_profiling = True
        # onnxruntime writes its trace into the working directory unless told otherwise.
        so.profile_file_prefix = os.path.join(tempfile.gettempdir(), f"onnxfuse_profile_{os.getpid()}")
    if with_library:
        so.add_session_config_entry(PROVIDERS_CONFIG_KEY, provider)
        path = library_path()
        try:
            so.register_custom_ops_library(path)
        except Exception as e:  # onnxruntime raises its own exception types
            raise LibraryError(f"cannot load {path}: {e}; {REBUILD_HINT}") from None
    return so


_onnxruntime_checked = False


def _check_onnxruntime_once() -> None:
    """Refuse a missing onnxruntime, or onnxruntime and onnxruntime-gpu over each other
    (environment.check_onnxruntime), before the first session; raises LibraryError."""
    global _onnxruntime_checked
    if _onnxruntime_checked:
        return
    from .environment import RuntimeInstallError, check_onnxruntime

    try:
        check_onnxruntime()
    except RuntimeInstallError as e:
        raise LibraryError(str(e)) from None
    _onnxruntime_checked = True


def executed_graph(model: onnx.ModelProto, with_library: bool = True) -> onnx.ModelProto:
    """The graph onnxruntime executes for `model`: CPU provider, ORT_ENABLE_ALL, one thread, as
    saved after all of onnxruntime's own optimizations (SessionOptions.optimized_model_filepath)."""
    import onnxruntime as ort

    # Weights are not packed for the kernels: a session that never runs, and packing does not
    # change the graph.
    so = session_options(with_library=with_library, threads=1, level="all", prepack=False)
    so.log_severity_level = 4  # saving at level "all" warns that the NCHWc layout is machine-specific
    with tempfile.TemporaryDirectory(prefix="onnxfuse-executed-") as tmp:
        path = os.path.join(tmp, "executed.onnx")
        so.optimized_model_filepath = path
        # Large initializers of the saved graph go to a data file that is never read back (a
        # link to /dev/null: what is asked is the graph, and writing the weights out would cost
        # more than the session).
        from .weights import has_references

        # A model holding weights by reference (a large single-file model, weights a pass
        # spilled) gets the sink too: onnxruntime would save the tensors it leaves as they are
        # still pointing at the session's links to their files.
        if _weight_bytes(model) >= EXECUTED_LARGE_MODEL_BYTES or has_references(model):
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                        "executed.data")
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                        str(EXECUTED_INLINE_MAX_BYTES))
            with contextlib.suppress(OSError):
                os.symlink(os.devnull, os.path.join(tmp, "executed.data"))
        # A model holding weights by reference is loaded from a file beside links to its data.
        with _session_source(model) as (data, _):
            ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        executed = onnx.load(path, load_external_data=False)
    from .weights import external_entries, graph_tensors

    for t in graph_tensors(executed.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL and external_entries(t).get("location") != "executed.data":
            # a value left in the model's own data file, whose link is gone with the session
            raise RuntimeError(f"executed graph: tensor '{t.name}' refers to a data file of the session")
    return executed


# For models of at least EXECUTED_LARGE_MODEL_BYTES of weights, initializers of
# executed_graph's result up to EXECUTED_INLINE_MAX_BYTES keep their values; larger ones are
# references to a file that no longer exists (their type and shape are kept). Passes that take
# values from the executed graph (fold-constants) see every value of a smaller model.
EXECUTED_INLINE_MAX_BYTES = 1 << 16
EXECUTED_LARGE_MODEL_BYTES = 64 << 20


def _weight_bytes(model: onnx.ModelProto) -> int:
    from .weights import referenced_bytes

    return model.ByteSize() + referenced_bytes(model)


_NCHWC_DOMAIN = "com.microsoft.nchwc"
_nchwc_block: int | None = None


def nchwc_block() -> int:
    """The channel block of onnxruntime's NCHWc layout on this machine, as measured: MLAS picks
    it by CPU (8 floats with AVX2, 16 with AVX-512; 0 here means no NCHWc layout, e.g. not x86).
    Kernel counts of models with convolutions or pools depend on it. Probed once per process
    with 1x1 convolutions of 4, 8, 16, ... input channels: onnxruntime reads an input of fewer
    channels than the block in place (NCHW) and reorders one of a multiple of the block
    (ReorderInput), so the block is the fewest channels it reorders. Output channels tell
    nothing: it pads them up to the block (a probe on those saw 8 on an AVX-512 CPU)."""
    global _nchwc_block
    if _nchwc_block is None:
        from onnx import TensorProto, helper, numpy_helper

        def executed_ops(channels: int) -> set[str]:
            w = numpy_helper.from_array(np.ones((16, channels, 1, 1), np.float32), "w")
            graph = helper.make_graph(
                [helper.make_node("Conv", ["x", "w"], ["y"])], "nchwc_probe",
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 4, 4])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 4, 4])], [w])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
            return {n.op_type for n in executed_graph(model, with_library=False).graph.node
                    if n.domain == _NCHWC_DOMAIN}

        _nchwc_block = 0
        for channels in (4, 8, 16, 32, 64):
            ops = executed_ops(channels)
            if not ops:
                break  # no NCHWc layout on this machine
            if "ReorderInput" in ops:
                _nchwc_block = channels
                break
    return _nchwc_block


def evaluate(model: onnx.ModelProto) -> list:
    """The outputs of `model`, a graph without inputs, as onnxruntime's CPU kernels compute them
    with its graph optimizations off (one thread): what its load-time constant folding makes
    of the same nodes."""
    import onnxruntime as ort

    so = session_options(with_library=False, threads=1, level="disable")
    so.log_severity_level = 4
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {})


def make_session(
    model: onnx.ModelProto | str | bytes,
    provider: str = "cpu",
    with_library: bool | None = None,
    threads: int | None = None,
    level: str = "all",
    profile: bool = False,
    providers: Sequence[str] | None = None,
    prepack: bool = True,
):
    """An onnxruntime InferenceSession; the library is registered when the model needs it
    (with_library=None) or as asked. prepack: as in session_options."""
    import onnxruntime as ort

    with _session_source(model, provider) as (data, fused):
        if with_library is None:
            with_library = fused
        so = session_options(with_library=with_library, threads=threads, level=level, profile=profile,
                             provider=provider, prepack=prepack)
        return ort.InferenceSession(data, sess_options=so, providers=list(providers or PROVIDERS[provider]))


# --------------------------------------------------------------------------- profiled runs

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
    # Each op type's share of the kernel time in the timed run where it was lowest and highest
    # (fractions; only when two or more runs were timed): how much the shares move between runs.
    share_range_by_op_type: dict[str, tuple[float, float]] = field(default_factory=dict, compare=False)

    @property
    def kernel_time_us(self) -> float:
        return sum(self.time_us_by_op_type.values())

    def as_dict(self) -> dict:
        return attributes(self, "kernels_per_inference by_op_type time_us_by_op_type kernel_time_us timed_runs"
                                " share_range_by_op_type"
                                " by_provider activation_bytes_read parameter_bytes_read bytes_written"
                                " library_loaded provider", ort_level=self.level)


# --------------------------------------------------------------------------- sessions and profiled runs


@contextlib.contextmanager
def _session_source(model: onnx.ModelProto | bytes | str, provider: str = "cpu"):
    """_model_bytes as a context: a model holding weights by reference (weights.py) is written
    as a file beside links to its data files for the session to load (onnxruntime refuses the
    absolute locations in memory), removed again once the session is made (it keeps the
    weights it mapped)."""
    from .ortfiles import runtime_sources
    from .weights import has_references

    if not (isinstance(model, onnx.ModelProto) and has_references(model)):
        yield _model_bytes(model, provider)
        return
    with runtime_sources([model]) as (path,):
        yield path, needs_library(model, provider)


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
    prepack: bool = True,
):
    """(InferenceSession, library_loaded). The library is registered when the model holds
    fused ops (with_library=None) or as asked. Asking for CUDA where onnxruntime cannot use
    it is an InputError, not a silent fallback to the CPU. prepack: as in session_options."""
    import onnxruntime as ort

    with _session_source(model, provider) as (data, fused):
        return _open_session(ort, data, fused, provider, threads, level, with_library, profile_prefix, prepack)


def _open_session(ort, data, fused, provider, threads, level, with_library, profile_prefix, prepack=True):
    if with_library is None:
        with_library = fused
    so = session_options(
        with_library=with_library, threads=threads, level=level, profile=profile_prefix is not None, provider=provider,
        prepack=prepack,
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

        from .environment import ort_max_ir_version, probe_model

        _cuda_usable = False
        if "CUDAExecutionProvider" in ort.get_available_providers():
            so = ort.SessionOptions()
            so.log_severity_level = 4
            try:
                sess = ort.InferenceSession(probe_model(ort_max_ir_version(), 13), sess_options=so,
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
    share_range = _share_range(kernels, run_events[1:]) if len(run_events) > 2 else {}
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
        share_range_by_op_type=share_range,
    )


def _share_range(kernels: Sequence[dict], runs: Sequence[dict]) -> dict[str, tuple[float, float]]:
    """Lowest and highest share of each op type in the kernel time of one run, over `runs`."""
    import bisect

    starts = [r.get("ts", 0) for r in runs]
    per_run: list[Counter] = [Counter() for _ in runs]
    for e in kernels:
        i = bisect.bisect_right(starts, e.get("ts", 0)) - 1
        if i >= 0 and e.get("ts", 0) <= starts[i] + runs[i].get("dur", 0):
            per_run[i][e.get("args", {}).get("op_name", "?")] += float(e.get("dur", 0))
    ops = {k for c in per_run for k in c}
    shares = {k: [c.get(k, 0.0) / (sum(c.values()) or 1.0) for c in per_run] for k in ops}
    return {k: (min(v), max(v)) for k, v in shares.items()}


def profiled_run(
    model: onnx.ModelProto | bytes | str,
    feeds: Mapping[str, np.ndarray],
    provider: str = "cpu",
    threads: int | None = None,
    level: str = "all",
    with_library: bool | None = None,
    runs: int = 1,
    then: Callable[[object], None] | None = None,
    prepack: bool = True,
) -> tuple[list[np.ndarray], KernelProfile]:
    """Run the model `runs` times with onnxruntime's profiler on: (outputs of the last run, profile).
    prepack: as in session_options (its kernel times then include packing weights per run).
    `then(session)` is called after the profile is read, while the session is still open: more
    runs of the same model without a session of their own (creating one is most of the cost of
    a run at real sizes, and grows faster than the graph)."""
    with tempfile.TemporaryDirectory(prefix="onnxfuse-profile-") as tmp:
        sess, loaded = open_session(model, provider, threads, level, with_library, profile_prefix=os.path.join(tmp, "p"),
                                    prepack=prepack)
        outputs = None
        for _ in range(max(1, runs)):
            outputs = sess.run(None, dict(feeds))
        trace = sess.end_profiling()
        with open(trace) as f:
            events = json.load(f)
        if then is not None:
            then(sess)
    return outputs, summarize_events(events, max(1, runs), loaded, provider, level)
