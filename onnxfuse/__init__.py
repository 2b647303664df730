"""onnxfuse: a graph optimizer for ONNX models that fuses launch-bound op chains."""

from .version import __version__

# The Python API, imported on first use so that `import onnxfuse` (and the native-library and
# program modules) stay light.
_API = {
    "optimize": "api",
    "OptimizeResult": "api",
    "OptimizeOptions": "optimize_options",
    "load": "api",
    "save": "api",
    "InputError": "modelio",
    "VerificationError": "verify",
    "count_kernels": "profile",
    "measure_latency": "profile",
    "get_library_path": "runtime",
}

__all__ = ["__version__", *_API]


def __getattr__(name):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(f"module 'onnxfuse' has no attribute {name!r}")
