"""Helpers and fixtures of the GPU tests (imported by name: a second conftest.py would clash
with tests/conftest.py as module `conftest`): the device's architecture, a way to run a stored kernel on the
device without onnxruntime (PyCUDA, or the driver API through ctypes with CuPy's memory when
PyCUDA is missing), and CUDA-provider sessions. Every test here carries the `gpu` marker; the
top-level conftest skips them all on machines without a CUDA device."""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import pytest


@functools.lru_cache(maxsize=None)
def device_arch() -> str:
    """"sm_XY" of device 0, read through the driver API."""
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    dev = ctypes.c_int(0)
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    assert cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) == 0
    assert cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) == 0
    return f"sm_{major.value}{minor.value}"


@pytest.fixture(scope="session")
def arch() -> str:
    return device_arch()


class PycudaRunner:
    """Stored kernels launched with PyCUDA on the primary context."""

    name = "pycuda"

    def __init__(self):
        import pycuda.autoprimaryctx  # noqa: F401
        import pycuda.driver as drv
        import pycuda.gpuarray as gpuarray

        self.drv, self.gpuarray = drv, gpuarray

    def load(self, cubin: bytes, entry: str):
        return self.drv.module_from_buffer(cubin).get_function(entry)

    def to_device(self, array: np.ndarray):
        g = self.gpuarray.to_gpu(np.ascontiguousarray(array))
        return g, int(g.gpudata)

    def empty(self, shape, dtype):
        g = self.gpuarray.empty(shape, dtype)
        return g, int(g.gpudata)

    def launch(self, fn, grid: int, block: int, args: bytes) -> None:
        fn(np.frombuffer(args, np.uint8).copy(), block=(block, 1, 1), grid=(grid, 1))
        self.drv.Context.synchronize()

    def to_host(self, handle) -> np.ndarray:
        return handle.get()


class CupyDriverRunner:
    """Without PyCUDA: CuPy's memory on the primary context, the kernel through libcuda (ctypes)."""

    name = "cupy+driver"

    def __init__(self):
        import cupy

        self.cp = cupy
        cupy.cuda.Device(0).use()
        cupy.zeros(1)  # makes the primary context current on this thread
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self._modules = []

    def _check(self, r, what):
        if r != 0:
            raise RuntimeError(f"{what} failed: CUresult {r}")

    def load(self, cubin: bytes, entry: str):
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        image = ctypes.create_string_buffer(cubin, len(cubin))
        self._check(self.cuda.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
        self._check(self.cuda.cuModuleGetFunction(ctypes.byref(fn), module, entry.encode()), "cuModuleGetFunction")
        self._modules.append(module)
        return fn

    def to_device(self, array: np.ndarray):
        g = self.cp.asarray(np.ascontiguousarray(array))
        return g, int(g.data.ptr)

    def empty(self, shape, dtype):
        g = self.cp.empty(shape, dtype)
        return g, int(g.data.ptr)

    def launch(self, fn, grid: int, block: int, args: bytes) -> None:
        buf = ctypes.create_string_buffer(args, len(args))
        params = (ctypes.c_void_p * 1)(ctypes.cast(buf, ctypes.c_void_p))
        u = ctypes.c_uint
        self._check(self.cuda.cuLaunchKernel(fn, u(grid), u(1), u(1), u(block), u(1), u(1), u(0), None, params, None),
                    "cuLaunchKernel")
        self._check(self.cuda.cuCtxSynchronize(), "cuCtxSynchronize")

    def to_host(self, handle) -> np.ndarray:
        return self.cp.asnumpy(handle)


@pytest.fixture(scope="session")
def runner():
    """PyCUDA when it imports (the intended path), else CuPy + the driver API."""
    errors = []
    for cls in (PycudaRunner, CupyDriverRunner):
        try:
            return cls()
        except Exception as e:  # ImportError, pycuda/cupy driver errors
            errors.append(f"{cls.name}: {type(e).__name__}: {e}")
    pytest.skip("no way to launch kernels standalone: " + "; ".join(errors))


@pytest.fixture(scope="session")
def cuda_ort():
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"onnxruntime {ort.__version__} here has no CUDA execution provider (install onnxruntime-gpu)")
    return ort


def cuda_session(ort, model, with_library: bool, graph: bool = False, profile_prefix: str | None = None):
    """A session on the CUDA provider (ORT_ENABLE_ALL); `graph` turns on CUDA graph capture.

    TF32 is off (use_tf32=0): onnxruntime's default lets cuDNN and cuBLAS round inputs to 10-bit
    mantissas, which moves a whole network's output by ~1e-3 and would hide our kernels' own error
    (they compute in float32)."""
    from onnxfuse.runtime import session_options

    so = session_options(with_library=with_library, level="all", profile=profile_prefix is not None, provider="cuda")
    if profile_prefix:
        so.profile_file_prefix = profile_prefix
    cuda = ("CUDAExecutionProvider", {"use_tf32": "0", **({"enable_cuda_graph": "1"} if graph else {})})
    providers = [cuda] if graph else [cuda, "CPUExecutionProvider"]
    data = model.SerializeToString() if hasattr(model, "SerializeToString") else model
    sess = ort.InferenceSession(data, sess_options=so, providers=providers)
    assert sess.get_providers()[0] == "CUDAExecutionProvider", sess.get_providers()
    return sess
