"""Run generated Pointwise kernels on the CPU: the exact CUDA C, compiled as host C++.

The generated code is written so that everything but the `__global__` wrapper is
`__host__ __device__`; with the CUDA launch variables defined as a one-thread grid, the entry
itself is an ordinary C function. Compiling it with the host compiler and calling it through
ctypes checks the code generator, the argument ABI and the host-side planning on machines
without a GPU. Device-only differences (the CUDA math library's last-ulp behaviour) are what
is left for the GPU tests.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from ..program import Program
from .args import pack_args, plan_call
from .codegen import Kernel

_SHIM = r"""// Host stand-ins for the CUDA launch environment: a grid of one thread.
#include <cuda_runtime.h>
#define __launch_bounds__(...)
struct onnxfuse_host_idx { unsigned int x, y, z; };
static const onnxfuse_host_idx blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0};
static const onnxfuse_host_idx blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
"""


def cuda_include_dir() -> str:
    nvcc = shutil.which("nvcc")
    cands = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    if nvcc:
        cands.insert(0, str(Path(os.path.realpath(nvcc)).parent.parent))
    for c in cands:
        if c and (Path(c) / "include" / "cuda_fp16.h").is_file():
            return str(Path(c) / "include")
    raise FileNotFoundError("CUDA headers (cuda_fp16.h) not found: set CUDA_HOME")


def _host_library(src: str, stem: str, opt: str, workdir: str | None) -> ctypes.CDLL:
    """`src` compiled as a host shared library and loaded: in `workdir` (kept), or in a temporary
    directory removed once the library is loaded or the compile failed (a loaded library stays
    mapped without its file)."""
    build = workdir or tempfile.mkdtemp(prefix="onnxfuse-hostsim-")
    try:
        cc = Path(build) / f"{stem}.cc"
        so = Path(build) / f"{stem}.so"
        cc.write_text(src)
        cxx = os.environ.get("CXX", "g++")
        cmd = [cxx, "-std=c++17", opt, "-shared", "-fPIC", "-w", f"-I{cuda_include_dir()}", str(cc), "-o", str(so)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"host compile failed: {' '.join(cmd)}\n{out.stderr[-4000:]}")
        return ctypes.CDLL(str(so))
    finally:
        if workdir is None:
            shutil.rmtree(build, ignore_errors=True)


class HostKernels:
    """A shared library of generated kernels compiled for the host CPU."""

    def __init__(self, kernels: Sequence[Kernel], workdir: str | None = None):
        """Compile in `workdir` (kept), or in a temporary directory removed once the library is
        loaded or the compile failed: a loaded library stays mapped without its file."""
        self.kernels = {k.entry: k for k in kernels}
        src = _SHIM + "".join(k.source for k in self.kernels.values())
        digest = hashlib.sha256(src.encode()).hexdigest()[:16]
        self.lib = _host_library(src, f"kernels_{digest}", "-O0", workdir)

    def run(self, prog: Program, kernel: Kernel, arrays: Sequence[np.ndarray], out_dtypes: Sequence[np.dtype],
            mode: int | None = None) -> list[np.ndarray]:
        """Call the kernel on host arrays; `mode` forces a loop (it must be valid for the call)."""
        arrays = [np.asarray(a) for a in arrays]
        plan = plan_call(prog, kernel.rank, kernel.vec, arrays)
        outs = [_aligned_empty(plan.shape, dt) for dt in out_dtypes]
        if mode is not None:
            plan.mode = mode
        else:
            plan = plan_call(prog, kernel.rank, kernel.vec, arrays,
                             out_addresses=[o.__array_interface__["data"][0] for o in outs])
        words = pack_args(plan, [a.__array_interface__["data"][0] for a in arrays],
                          [o.__array_interface__["data"][0] for o in outs])

        class Args(ctypes.Structure):
            _fields_ = [("words", ctypes.c_int64 * (len(words) // 8))]

        args = Args.from_buffer_copy(words)
        fn = getattr(self.lib, kernel.entry)
        fn.argtypes = [Args]
        fn.restype = None
        fn(args)
        self.last_mode = plan.mode
        return outs


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    raw = np.empty(n * dtype.itemsize + align, np.uint8)
    start = (-raw.__array_interface__["data"][0]) % align
    return raw[start:start + n * dtype.itemsize].view(dtype).reshape(shape)


_GRID_SHIM = r"""// Host stand-ins for the CUDA launch environment: a grid run block by block, thread by thread.
#include <cuda_runtime.h>
#define __launch_bounds__(...)
struct onnxfuse_host_idx { unsigned int x, y, z; };
static onnxfuse_host_idx blockIdx, threadIdx, blockDim, gridDim;
"""


class GridSim:
    """Generated kernels without shared memory or barriers, compiled for the host and run over a
    whole grid: every (block, thread) calls the entry once, in order. Each thread of such a kernel
    works alone, so the sequential run computes what the device computes, with the kernel's own
    index arithmetic, guards and vector accesses. `kernels` have `entry` and `source`, and the
    source declares the argument struct `ENTRY_args`."""

    def __init__(self, kernels: Sequence, workdir: str | None = None):
        unique = {k.entry: k for k in kernels}
        launchers = "".join(
            f'\nextern "C" void {e}_grid(const {e}_args* a, unsigned gx, unsigned gy, unsigned bx) {{\n'
            "  gridDim = {gx, gy, 1}; blockDim = {bx, 1, 1};\n"
            "  for (unsigned y = 0; y < gy; ++y)\n"
            "    for (unsigned x = 0; x < gx; ++x)\n"
            "      for (unsigned t = 0; t < bx; ++t) {\n"
            f"        blockIdx = {{x, y, 0}}; threadIdx = {{t, 0, 0}}; {e}(*a);\n"
            "      }\n"
            "}\n" for e in unique)
        src = _GRID_SHIM + "".join(k.source for k in unique.values()) + launchers
        digest = hashlib.sha256(src.encode()).hexdigest()[:16]
        self.lib = _host_library(src, f"grid_{digest}", "-O1", workdir)

    def launch(self, entry: str, args: bytes, grid: tuple[int, int], threads: int) -> None:
        """Run the grid (grid.x, grid.y) of `threads`-thread blocks with the packed argument struct."""
        buf = ctypes.create_string_buffer(args, len(args))
        fn = getattr(self.lib, f"{entry}_grid")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint]
        fn.restype = None
        fn(ctypes.cast(buf, ctypes.c_void_p), grid[0], grid[1], threads)


def aligned_empty(shape, dtype, align: int = 64, offset: int = 0) -> np.ndarray:
    """An uninitialised array whose data starts `offset` bytes past an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    raw = np.empty(n * dtype.itemsize + align + offset, np.uint8)
    start = (-raw.__array_interface__["data"][0]) % align + offset
    return raw[start:start + n * dtype.itemsize].view(dtype).reshape(shape)
