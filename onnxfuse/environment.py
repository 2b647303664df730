"""Which onnxruntime this installation runs on, what it loads (the newest IR version and opset,
probed), and what the native library was built with.

onnxruntime comes from the extra a user installs: `onnxfuse[cpu]` (the `onnxruntime` wheel) or
`onnxfuse[gpu]` (`onnxruntime-gpu`, which also has the CPU provider). Both wheels install the
same `onnxruntime` module; installed into one site-packages, whichever came last overwrites
files of the other, and the mix can fail in ways that name neither. That case is refused here
with one message. (The same pair in different directories is fine: the first on sys.path is
imported whole, which is how a GPU host shadows a CPU build.)
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass

# onnx is imported where it is used: the command line calls check_onnxruntime() before
# every command, and an error found before any work is told without loading onnx.

ONNXRUNTIME_WHEELS = ("onnxruntime", "onnxruntime-gpu")
CHOOSE_HINT = "pip install 'onnxfuse[cpu]' (or 'onnxfuse[gpu]' for CUDA)"


class RuntimeInstallError(RuntimeError):
    """onnxruntime is missing, or installed twice over itself."""


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    location: str  # the site-packages directory it is installed in


def onnxruntime_wheels() -> list[Wheel]:
    """The onnxruntime distributions installed (name, version, site-packages directory)."""
    from importlib import metadata

    found: list[Wheel] = []
    seen: set[tuple[str, str]] = set()
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if name not in ONNXRUNTIME_WHEELS:
            continue
        location = os.path.realpath(str(dist.locate_file("")))
        if (name, location) in seen:
            continue
        seen.add((name, location))
        found.append(Wheel(name, dist.version, location))
    return found


def check_onnxruntime() -> None:
    """Raise RuntimeInstallError when no onnxruntime is installed, or when `onnxruntime` and
    `onnxruntime-gpu` share one site-packages directory."""
    wheels = onnxruntime_wheels()
    by_location: dict[str, set[str]] = {}
    for w in wheels:
        by_location.setdefault(w.location, set()).add(w.name)
    for location, names in by_location.items():
        if len(names) > 1:
            raise RuntimeInstallError(
                f"both onnxruntime and onnxruntime-gpu are installed in {location}: they install the same module"
                " and overwrite each other's files; keep one: pip uninstall -y onnxruntime onnxruntime-gpu, then"
                f" {CHOOSE_HINT}"
            )
    if not wheels:
        try:
            import onnxruntime  # noqa: F401  (a build from source has no wheel metadata)
        except ImportError:
            raise RuntimeInstallError(f"onnxruntime is not installed: {CHOOSE_HINT}") from None


def quiet_libraries(graphsurgeon_level: str = "ERROR") -> None:
    """Silence what onnxruntime, graphsurgeon and Python's warnings print to the terminal
    (graphsurgeon below `graphsurgeon_level`): a command's output is its own lines alone."""
    import warnings

    warnings.simplefilter("ignore")
    try:
        import onnxruntime as ort

        ort.set_default_logger_severity(4)
    except ImportError:
        pass
    try:
        from onnx_graphsurgeon.logger import G_LOGGER

        G_LOGGER.severity = getattr(G_LOGGER, graphsurgeon_level)
    except ImportError:
        pass


def library_info(path: str) -> dict:
    """What the native library at `path` says about itself (its OnnxfuseLibraryInfo entry)."""
    import ctypes

    lib = ctypes.CDLL(path)
    entry = lib.OnnxfuseLibraryInfo
    entry.restype = ctypes.c_char_p
    return json.loads(entry().decode("utf-8"))


# --------------------------------------------------------------------------- what it loads


def probe_model(ir_version: int, opset: int) -> bytes:
    """A one-Relu model of `ir_version` and ai.onnx `opset`, serialized: what the probes load."""
    import onnx
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model.SerializeToString()


def _ort_accepts(ir_version: int, opset: int) -> bool:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(probe_model(ir_version, opset), sess_options=so, providers=["CPUExecutionProvider"])
    except Exception:  # onnxruntime raises its own exception types
        return False
    return True


def _highest_accepted(low: int, high: int, accepts) -> int:
    """The largest v in [low, high] with accepts(v), assuming acceptance is monotone."""
    if not accepts(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        if accepts(mid):
            low = mid
        else:
            high = mid - 1
    return low


@functools.lru_cache(maxsize=None)
def ort_max_ir_version() -> int:
    """The newest ONNX IR version the installed onnxruntime loads (probed once: tables by
    version go stale, a probe does not)."""
    import onnx

    return _highest_accepted(7, max(onnx.IR_VERSION, 7) + 4, lambda ir: _ort_accepts(ir, 9))


@functools.lru_cache(maxsize=None)
def ort_max_opset() -> int:
    """The newest ai.onnx opset the installed onnxruntime runs (probed once)."""
    import onnx

    ir = ort_max_ir_version()
    return _highest_accepted(7, onnx.defs.onnx_opset_version() + 4, lambda v: _ort_accepts(ir, v))


def ort_error_text(exc: BaseException) -> str:
    """onnxruntime's message without its status prefix and C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"^/\S+:\d+ \S+?\(.*?\) ", "", text)
    text = re.sub(r"^/\S+:\d+ ", "", text)
    return text
