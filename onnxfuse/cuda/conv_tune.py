"""ConvBiasAct kernels checked and timed: ptxas's resource report per kernel, and --tune's
choice of tile by timing every candidate on the GPU (onnxfuse/cuda/conv_codegen.py writes them).
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from .compile import PtxasInfo, parse_ptxas
from .conv_codegen import Kernel, generate
from .conv_plan import ConvShape, Epilogue, candidates


def ptxas_check(kernels: list[Kernel], arch: str = "sm_90", timeout: float = 900) -> dict[str, PtxasInfo]:
    """Compile `kernels` in one translation unit to a cubin for `arch` with the flags of
    onnxfuse.cuda.compile and return ptxas's per-kernel resource report (registers, spills,
    shared memory). Raises CompileError with nvcc's message when compilation fails."""
    from .compile import NVCC_FLAGS, CompileError, find_nvcc, parse_arch

    nvcc = find_nvcc()
    sm, _ = parse_arch(arch)
    unique = {k.entry: k for k in kernels}
    with tempfile.TemporaryDirectory(prefix="onnxfuse-conv-") as tmp:
        src = Path(tmp) / "conv_kernels.cu"
        src.write_text("\n".join(k.source for k in unique.values()))
        cmd = [nvcc, f"-arch={sm}", "-cubin", *NVCC_FLAGS, "-Xptxas", "-v", "-o", str(Path(tmp) / "k.cubin"), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise CompileError(f"nvcc failed ({proc.returncode}): {proc.stderr.strip()[-4000:]}")
    report = parse_ptxas(proc.stderr)
    missing = sorted(set(unique) - set(report))
    if missing:
        raise CompileError(f"ptxas reported nothing for {missing[:3]}")
    return report


def tune(shape: ConvShape, epi: Epilogue, batch: int = 1, repeats: int = 20) -> tuple[object, list[tuple[object, float]]]:
    """Time every candidate tile on the current GPU with CUDA events (PyCUDA) and return the
    fastest and the (tile, milliseconds) table. Needs pycuda and a CUDA device."""
    import numpy as np

    try:
        import pycuda.autoinit  # noqa: F401  (creates the context)
        import pycuda.driver as drv
        from pycuda.compiler import SourceModule
    except Exception as e:  # ImportError, or pycuda's own error when no device/driver is present
        raise RuntimeError(f"tuning needs pycuda and a CUDA device: {e}") from None
    major = drv.Context.get_device().compute_capability()[0]
    clusters, tensor_cores = major >= 9, major >= 8
    rng = np.random.default_rng(0)
    x = drv.to_device(rng.standard_normal((batch, shape.c, shape.h, shape.w), dtype=np.float32))
    wt = drv.to_device(rng.standard_normal((shape.k, shape.kred), dtype=np.float32))
    b = drv.to_device(rng.standard_normal(shape.k, dtype=np.float32))
    z = drv.to_device(np.zeros((batch, shape.k, shape.p, shape.q), np.float32)) if epi.residual else None
    y = drv.mem_alloc(4 * batch * shape.k * shape.p * shape.q)
    tiles = candidates(shape, batch, clusters=clusters, tensor_cores=tensor_cores)
    kernels = [generate(shape, epi, t) for t in tiles]
    # One module (one compiler call) for every candidate.
    module = SourceModule("\n".join(k.source for k in kernels), no_extern_c=True, options=["-O3"])
    table = []
    for tile, k in zip(tiles, kernels):
        fn = module.get_function(k.entry)
        words = np.array([int(x), int(wt), int(b), int(z) if z is not None else 0, int(y), batch], dtype=np.uint64)
        # The kernel takes its argument struct by value: pass the 48 bytes as one opaque scalar.
        args = np.frombuffer(words.tobytes(), dtype=np.dtype((np.void, words.nbytes)))[0]
        launch = dict(block=(k.threads, 1, 1), grid=k.grid(batch))
        fn(args, **launch)  # warm-up
        start, end = drv.Event(), drv.Event()
        times = []
        for _ in range(repeats):
            start.record()
            fn(args, **launch)
            end.record()
            end.synchronize()
            times.append(start.time_till(end))
        table.append((tile, float(np.median(times))))
    best = min(table, key=lambda t: t[1])[0]
    return best, table
