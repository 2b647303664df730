"""Compiling generated kernels: cubin for one architecture plus PTX as the portable fallback.

PyCUDA's compiler is used when pycuda imports (it needs the NVIDIA driver, so it is imported
here lazily and only tried once); otherwise nvcc is called directly. Both run nvcc with the
same flags. Results are cached in memory and on disk (by a hash of the source, the flags, the
architecture and the compiler's version), so identical programs are compiled once.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import CompileError

DEFAULT_ARCH = "sm_90"
# No fast math: the kernels must match the reference bit for bit where IEEE arithmetic allows,
# so no flush-to-zero, IEEE division and square root, and no contraction of a*b+c into an FMA.
NVCC_FLAGS = ("-O3", "--std=c++17", "--fmad=false", "-diag-suppress=177")
CACHE_FORMAT = "1"


@dataclass(frozen=True)
class CompiledKernel:
    entry: str
    arch: str  # the cubin's architecture, e.g. "sm_90"
    ptx_arch: str  # the PTX's virtual architecture, e.g. "compute_90"
    cubin: bytes
    ptx: str
    compiler: str  # "pycuda" or "nvcc"


def parse_arch(arch: str | None) -> tuple[str, str]:
    """("sm_90", "compute_90") from "sm_90", "90", "9.0" or "compute_90"; "sm_90a" keeps its suffix
    for the cubin, while the PTX is for the portable "compute_90"."""
    text = (arch or DEFAULT_ARCH).strip().lower()
    m = re.fullmatch(r"(?:sm_|compute_)?(\d)\.?(\d+)([af]?)", text)
    if not m:
        raise ValueError(f"unknown CUDA architecture {arch!r} (expected e.g. sm_90 or 8.6)")
    num = m.group(1) + m.group(2)
    return f"sm_{num}{m.group(3)}", f"compute_{num}"


def cache_dir() -> Path:
    """Where compiled kernels are kept: $ONNXFUSE_CACHE_DIR, else $XDG_CACHE_HOME/onnxfuse, else ~/.cache/onnxfuse."""
    root = os.environ.get("ONNXFUSE_CACHE_DIR")
    if root:
        return Path(root) / "cuda"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onnxfuse" / "cuda"


def find_nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        cand = Path(cuda_home) / "bin" / "nvcc"
        if cand.is_file():
            nvcc = str(cand)
    if nvcc is None:
        raise CompileError("nvcc not found (PATH, $CUDA_HOME/bin): --target cuda needs the CUDA toolkit")
    return nvcc


@functools.lru_cache(maxsize=None)
def compiler_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    if out.returncode != 0:
        raise CompileError(f"{nvcc} --version failed: {out.stderr.strip()}")
    return out.stdout.strip().splitlines()[-1]


_pycuda_state: dict = {}
_pycuda_lock = threading.Lock()


def pycuda_compiler():
    """pycuda.compiler.compile when pycuda imports with a working driver, else None (tried once)."""
    with _pycuda_lock:
        if "fn" not in _pycuda_state:
            try:
                import pycuda.compiler  # noqa: F401  (imports pycuda.driver, which needs libcuda)
                import pycuda.driver  # noqa: F401

                _pycuda_state["fn"] = pycuda.compiler.compile
            except Exception:  # ImportError, OSError (no libcuda), pycuda's own errors
                _pycuda_state["fn"] = None
        return _pycuda_state["fn"]


def choose_backend(backend: str | None = None) -> str:
    """'pycuda' when it imports, else 'nvcc'; ONNXFUSE_CUDA_COMPILER or `backend` forces one."""
    want = backend or os.environ.get("ONNXFUSE_CUDA_COMPILER") or "auto"
    if want not in ("auto", "pycuda", "nvcc"):
        raise ValueError(f"unknown CUDA compiler {want!r} (auto, pycuda or nvcc)")
    if want == "nvcc":
        return "nvcc"
    if pycuda_compiler() is not None:
        return "pycuda"
    if want == "pycuda":
        raise CompileError("pycuda was asked for but does not import (is the NVIDIA driver present?)")
    return "nvcc"


_memory: dict[str, CompiledKernel] = {}
_memory_lock = threading.Lock()


def _cache_key(source: str, sm: str, ptx_arch: str, version: str) -> str:
    h = hashlib.sha256()
    for part in (CACHE_FORMAT, source, sm, ptx_arch, " ".join(NVCC_FLAGS), version):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _read_disk(key: str) -> tuple[bytes, str] | None:
    d = cache_dir()
    try:
        return (d / f"{key}.cubin").read_bytes(), (d / f"{key}.ptx").read_text()
    except OSError:
        return None


def _write_disk(key: str, cubin: bytes, ptx: str) -> None:
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        for suffix, data in ((".ptx", ptx.encode()), (".cubin", cubin)):  # cubin last: it marks completeness
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, d / f"{key}{suffix}")
            except BaseException:  # a failed write, SIGTERM or SIGINT (they unwind): no .tmp- file stays
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError:
        pass  # the disk cache only saves time; an unwritable one is not an error


def _run_nvcc(nvcc: str, source: str, sm: str, ptx_arch: str) -> tuple[bytes, str]:
    """One nvcc call: PTX for the virtual architecture and SASS for `sm`, both kept."""
    with tempfile.TemporaryDirectory(prefix="onnxfuse-nvcc-") as tmp:
        src = Path(tmp) / "kernel.cu"
        src.write_text(source)
        gencode = f"arch={ptx_arch},code=[{sm},{ptx_arch}]"
        cmd = [nvcc, "--fatbin", "-gencode", gencode, *NVCC_FLAGS, "--keep", "--keep-dir", tmp,
               "-o", str(Path(tmp) / "kernel.fatbin"), str(src)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if out.returncode != 0:
            raise CompileError(f"nvcc failed ({' '.join(cmd)}):\n{out.stderr.strip()}")
        cubins = sorted(Path(tmp).glob(f"kernel*.{sm}.cubin"))
        ptxs = sorted(Path(tmp).glob("kernel*.ptx"))
        if len(cubins) != 1 or len(ptxs) != 1:
            raise CompileError(f"nvcc left no single cubin/PTX in {tmp}: {sorted(os.listdir(tmp))}")
        return cubins[0].read_bytes(), ptxs[0].read_text()


def _run_pycuda(compile_fn, source: str, sm: str, ptx_arch: str) -> tuple[bytes, str]:
    try:
        cubin = compile_fn(source, options=list(NVCC_FLAGS), no_extern_c=True, arch=sm, target="cubin", cache_dir=False)
        ptx = compile_fn(source, options=list(NVCC_FLAGS), no_extern_c=True, arch=ptx_arch, target="ptx", cache_dir=False)
    except Exception as e:  # pycuda.driver.CompileError carries nvcc's message
        raise CompileError(f"pycuda compile failed: {e}") from None
    return bytes(cubin), ptx.decode() if isinstance(ptx, bytes) else str(ptx)


def compile_source(source: str, entry: str, arch: str | None = None, backend: str | None = None,
                   use_disk_cache: bool = True) -> CompiledKernel:
    """cubin for `arch` (default sm_90) and PTX for its virtual architecture."""
    sm, ptx_arch = parse_arch(arch)
    which = choose_backend(backend)
    nvcc = find_nvcc()
    key = _cache_key(source, sm, ptx_arch, compiler_version(nvcc))
    with _memory_lock:
        hit = _memory.get(key)
    if hit is not None:
        return CompiledKernel(entry, sm, ptx_arch, hit.cubin, hit.ptx, hit.compiler)
    cached = _read_disk(key) if use_disk_cache else None
    if cached is not None:
        cubin, ptx = cached
        result = CompiledKernel(entry, sm, ptx_arch, cubin, ptx, "cache")
    else:
        if which == "pycuda":
            cubin, ptx = _run_pycuda(pycuda_compiler(), source, sm, ptx_arch)
        else:
            cubin, ptx = _run_nvcc(nvcc, source, sm, ptx_arch)
        if f".entry {entry}(" not in ptx:
            raise CompileError(f"compiled PTX has no entry {entry!r}")
        result = CompiledKernel(entry, sm, ptx_arch, cubin, ptx, which)
        if use_disk_cache:
            _write_disk(key, cubin, ptx)
    with _memory_lock:
        _memory[key] = result
    return result


def compile_many(items: Sequence[tuple[str, str]], arch: str | None = None, jobs: int | None = None,
                 backend: str | None = None) -> list[CompiledKernel]:
    """Compile (source, entry) pairs, identical sources once, nvcc calls in parallel."""
    unique: dict[str, str] = {}
    for source, entry in items:
        unique.setdefault(source, entry)
    jobs = jobs or min(len(unique), os.cpu_count() or 1) or 1
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip(unique, pool.map(lambda se: compile_source(se[0], se[1], arch, backend), unique.items())))
    return [done[source] for source, _ in items]


@dataclass(frozen=True)
class PtxasInfo:
    """ptxas's resource report for one kernel entry."""

    entry: str
    registers: int
    spill_stores: int
    spill_loads: int
    smem_bytes: int


def parse_ptxas(text: str) -> dict[str, PtxasInfo]:
    """ptxas -v output -> PtxasInfo per kernel entry."""
    out: dict[str, PtxasInfo] = {}
    current = None
    spills = (0, 0)
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line) or re.search(r"Function properties for (\w+)", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            spills = (int(m.group(1)), int(m.group(2)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            smem = re.search(r"(\d+) bytes smem", line)
            out[current] = PtxasInfo(current, int(m.group(1)), spills[0], spills[1], int(smem.group(1)) if smem else 0)
            spills = (0, 0)
    return out


def check_ptx(ptx: str, arch: str | None = None) -> dict[str, PtxasInfo]:
    """Assemble PTX with ptxas for `arch` and return its resource report per entry (ptxas -v):
    raises CompileError with ptxas's message when it fails."""
    sm, _ = parse_arch(arch)
    ptxas = shutil.which("ptxas") or str(Path(find_nvcc()).parent / "ptxas")
    with tempfile.TemporaryDirectory(prefix="onnxfuse-ptxas-") as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        out = subprocess.run([ptxas, "-v", f"-arch={sm}", str(path), "-o", str(Path(tmp) / "kernel.cubin")],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise CompileError(f"ptxas rejected the PTX for {sm}:\n{out.stderr.strip()}")
    return parse_ptxas(out.stdout + out.stderr)
