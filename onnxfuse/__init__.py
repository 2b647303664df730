"""onnxfuse: a graph optimizer for ONNX models that fuses launch-bound op chains."""

from .version import __version__

# The Python API, imported on first use so that `import onnxfuse` (and the native-library and
# program modules) stay light.
_API = {
    "optimize": "api",
    "OptimizeResult": "api",
    "load": "api",
    "save": "api",
    "InputError": "modelio",
    "VerificationError": "verify",
    "count_kernels": "profile",
    "measure_latency": "profile",
}

__all__ = ["__version__", "get_library_path", *_API]


def get_library_path() -> str:
    """Path of onnxfuse's custom-op library, for onnxruntime's
    `SessionOptions.register_custom_ops_library` (the onnxruntime-extensions convention).

        so = onnxruntime.SessionOptions()
        so.register_custom_ops_library(onnxfuse.get_library_path())

    Raises onnxfuse.runtime.LibraryError when the library is not built.
    """
    from .runtime import library_path

    return library_path()


def __getattr__(name):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(f"module 'onnxfuse' has no attribute {name!r}")
