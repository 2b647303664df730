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


# Fused op types the library registers for the CUDA provider. Their CUDA kernel launches the
# kernel compiled and stored with the node (--target cuda); a node without one must run its
# fallback function instead. On the CPU provider, op types the library does not implement fall
# back to their functions by themselves.
CUDA_KERNELS = frozenset({"Pointwise", "ConvBiasAct", "Attention"})


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
):
    """onnxruntime SessionOptions, with our custom-op library registered when asked.

    level: "disable", "basic", "extended" or "all" (onnxruntime's graph optimization level).
    provider: "cpu" registers our CPU kernels only; "cuda" also registers the CUDA kernels.
    A kernel registered for one provider stops onnxruntime from running the node's fallback
    function on the others, so a session gets the kernels of its own providers alone.
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
        # onnxruntime writes its trace into the working directory unless told otherwise.
        import tempfile

        so.profile_file_prefix = os.path.join(tempfile.gettempdir(), f"onnxfuse_profile_{os.getpid()}")
    if with_library:
        so.add_session_config_entry(PROVIDERS_CONFIG_KEY, provider)
        path = library_path()
        try:
            so.register_custom_ops_library(path)
        except Exception as e:  # onnxruntime raises its own exception types
            raise LibraryError(f"cannot load {path}: {e}; {REBUILD_HINT}") from None
    return so


def executed_graph(model: onnx.ModelProto, with_library: bool = True) -> onnx.ModelProto:
    """The graph onnxruntime executes for `model`: CPU provider, ORT_ENABLE_ALL, one thread, as
    saved after all of onnxruntime's own optimizations (SessionOptions.optimized_model_filepath)."""
    import tempfile

    import onnxruntime as ort

    so = session_options(with_library=with_library, threads=1, level="all")
    so.log_severity_level = 4  # saving at level "all" warns that the NCHWc layout is machine-specific
    fd, path = tempfile.mkstemp(suffix=".onnx")
    os.close(fd)
    try:
        so.optimized_model_filepath = path
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return onnx.load(path)
    finally:
        os.remove(path)


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
            with_library = needs_library(model, provider)
        data = model.SerializeToString()
    elif isinstance(model, bytes):
        if with_library is None:
            with_library = needs_library(onnx.load_from_string(model), provider)
        data = model
    else:
        if with_library is None:
            with_library = needs_library(onnx.load(model, load_external_data=False), provider)
        data = model
    so = session_options(with_library=with_library, threads=threads, level=level, profile=profile, provider=provider)
    return ort.InferenceSession(data, sess_options=so, providers=list(providers or PROVIDERS[provider]))
