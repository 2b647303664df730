"""Finding and registering the native custom-op library (libonnxfuse) with onnxruntime."""
from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Sequence

import onnx

from .fused import DOMAIN

_PKG = Path(__file__).resolve().parent
LIBRARY_STEM = "_onnxfuse_ops"
REBUILD_HINT = "rebuild it with `pip install -e .` (or `pip install .`) from the onnxfuse source tree"


class LibraryError(RuntimeError):
    """The custom-op library is missing or cannot be loaded."""


def library_path() -> str:
    """Path of the built custom-op library; ONNXFUSE_LIBRARY overrides where it is looked for."""
    env = os.environ.get("ONNXFUSE_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise LibraryError(f"ONNXFUSE_LIBRARY={env}: no such file")
        return env
    found = sorted(glob.glob(str(_PKG / f"{LIBRARY_STEM}*.so")))
    if not found:
        raise LibraryError(f"the onnxfuse custom-op library is not built (no {LIBRARY_STEM}*.so in {_PKG}); {REBUILD_HINT}")
    return found[0]


def needs_library(model: onnx.ModelProto) -> bool:
    """True when the model holds fused ops our library implements."""
    return any(n.domain == DOMAIN for n in model.graph.node)


PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
}


def session_options(with_library: bool = True, threads: int | None = None, level: str = "all", profile: bool = False):
    """onnxruntime SessionOptions, with our custom-op library registered when asked.

    level: "disable", "basic", "extended" or "all" (onnxruntime's graph optimization level).
    """
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
    if profile:
        so.enable_profiling = True
    if with_library:
        path = library_path()
        try:
            so.register_custom_ops_library(path)
        except Exception as e:  # onnxruntime raises its own exception types
            raise LibraryError(f"cannot load {path}: {e}; {REBUILD_HINT}") from None
    return so


def make_session(
    model: onnx.ModelProto | str | bytes,
    provider: str = "cpu",
    with_library: bool | None = None,
    threads: int | None = None,
    level: str = "all",
    profile: bool = False,
    providers: Sequence[str] | None = None,
):
    """An onnxruntime InferenceSession; the library is registered when the model needs it
    (with_library=None) or as asked."""
    import onnxruntime as ort

    if isinstance(model, onnx.ModelProto):
        if with_library is None:
            with_library = needs_library(model)
        data = model.SerializeToString()
    elif isinstance(model, bytes):
        if with_library is None:
            with_library = needs_library(onnx.load_from_string(model))
        data = model
    else:
        if with_library is None:
            with_library = needs_library(onnx.load(model, load_external_data=False))
        data = model
    so = session_options(with_library=with_library, threads=threads, level=level, profile=profile)
    return ort.InferenceSession(data, sess_options=so, providers=list(providers or PROVIDERS[provider]))
