"""CUDA C for onnxfuse.ChannelShuffle: every output channel plane copied from its input plane.

Contract of the op (float32, kernels/channel_shuffle_cpu.cc):

    X_1 .. X_k [N, C_i, H, W]  ->  Y_1 .. Y_m [N, C / m, H, W]
    S = Concat(X_1 .. X_k) shuffled in g groups: channel s of S is channel
        (s % g) * (C / g) + s / g of the Concat; Y_o is channels o * C/m .. (o + 1) * C/m - 1 of S.

One kernel per (C_1 .. C_k, g, m): the channel arithmetic divides by compile-time constants. N
and the plane size H * W are run-time arguments, so one kernel serves every batch and resolution.

Launch (plan_launch, mirrored by kernels/cuda_channel_shuffle.cc):

* grid = (N * C, chunks): blockIdx.x is the output plane p = image * C + s (at most 2^31 - 1
  planes, checked by the host), blockIdx.y the chunk of that plane this block copies. Every
  channel index is 32-bit and uniform per block; element offsets are 64-bit (plane base times
  H * W), built by one widening multiply each, no 64-bit division anywhere.
* The plane is copied in vectors of VEC floats: 4 when H * W % 4 == 0 and every buffer is 16-byte
  aligned (planes then start 16-byte aligned too), else 2 (8 bytes), else 1. `vec` is an
  argument; the kernel holds the three loops and takes the one it names.
* threads = min(MAX_THREADS, H * W / VEC rounded up to a warp); a block copies `span` vectors of
  its plane (a multiple of threads, SPAN_ITERS per thread, grown so that chunks <= 65535).

INDEX below is the per-block channel arithmetic, valid C and evaluated by the numpy model
(`model_copy`), which the tests run against the CPU kernel; the host simulation
(onnxfuse/cuda/hostsim.py, GridSim) runs the generated C itself block by block, thread by thread.

Kernel ABI (shared with kernels/cuda_channel_shuffle.cc): every argument is one 8-byte word

    struct ENTRY_args { const float* x[k]; float* y[m];
                        long long hw, vec, span; };
    extern "C" __global__ void ENTRY(const ENTRY_args a)
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from .emit import CSource

ABI_VERSION = 1
MAX_THREADS = 256
SPAN_ITERS = 4  # vectors per thread per block before the plane is cut into another chunk
MAX_GRID_Y = 65535
MAX_GRID_X = 2**31 - 1


@dataclass(frozen=True)
class ShuffleSpec:
    channels: tuple[int, ...]  # C_i of each input
    groups: int
    outputs: int

    def __post_init__(self) -> None:
        if not self.channels or any(c < 1 for c in self.channels) or self.groups < 1 or self.outputs < 1:
            raise ValueError(f"invalid channel shuffle {self}")
        c = sum(self.channels)
        if c % self.groups or c % self.outputs:
            raise ValueError(f"{c} channels do not divide into {self.groups} groups and {self.outputs} outputs")

    @property
    def total(self) -> int:
        return sum(self.channels)

    def constants(self) -> dict[str, int]:
        c = self.total
        return {"C": c, "G": self.groups, "PER_GROUP": c // self.groups, "PIECE": c // self.outputs}


# Channel arithmetic of one block, each (name, C expression). `plane` is blockIdx.x.
INDEX = [
    ("image", "plane / C"),
    ("s", "plane - image * C"),  # channel of the shuffled Concat
    ("out", "s / PIECE"),  # the output it belongs to
    ("ch", "s - out * PIECE"),  # its channel in that output
    ("from", "(s % G) * PER_GROUP + s / G"),  # channel of the Concat it copies
]


@dataclass(frozen=True)
class Kernel:
    spec: ShuffleSpec
    entry: str
    source: str

    def attrs(self) -> dict:
        """Launch description stored on the node (read by kernels/cuda_channel_shuffle.cc)."""
        return {"cuda_abi": ABI_VERSION, "cuda_block": MAX_THREADS,
                "cuda_channels": ",".join(str(c) for c in self.spec.channels)}


def entry_name(spec: ShuffleSpec) -> str:
    key = f"abi{ABI_VERSION} {spec.channels} {spec.groups} {spec.outputs}"
    return "onnxfuse_shuffle_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _select(names: list[str], bounds: list[int], index: str) -> str:
    """A conditional chain picking names[i] for the first bound index < bounds[i] (the last is
    taken without a test)."""
    expr = names[-1]
    for name, bound in reversed(list(zip(names[:-1], bounds[:-1]))):
        expr = f"{index} < {bound} ? {name} : {expr}"
    return expr


def generate(spec: ShuffleSpec) -> Kernel:
    entry = entry_name(spec)
    consts = spec.constants()
    k, m = len(spec.channels), spec.outputs
    starts, ends = [], []
    acc = 0
    for c in spec.channels:
        starts.append(acc)
        acc += c
        ends.append(acc)
    src = CSource()
    src.line(f"// onnxfuse.ChannelShuffle: inputs of {', '.join(map(str, spec.channels))} channels, "
             f"{spec.groups} groups, {m} outputs (onnxfuse/cuda/shuffle_codegen.py).", "#include <cuda_runtime.h>")
    with src.block(f"struct {entry}_args", end="};"):
        src.line(f"const float* x[{k}];", f"float* y[{m}];", "long long hw;    // elements per plane (H * W)",
                 "long long vec;   // floats per access: 4, 2 or 1",
                 "long long span;  // vectors of the plane one block copies")
    src.line("", "// Vectors begin .. end of the plane (VEC floats each; the divisions by VEC are shifts).",
             "template <typename V, int VEC>",
             f"__device__ __forceinline__ void {entry}_copy(const float* __restrict__ src, float* __restrict__ dst,")
    with src.block("                                               long long hw, long long span)"):
        src.line("const long long vecs = hw / VEC;", "const long long begin = (long long)blockIdx.y * span;",
                 "const long long end = begin + span < vecs ? begin + span : vecs;",
                 "const V* s = reinterpret_cast<const V*>(src);", "V* d = reinterpret_cast<V*>(dst);",
                 "for (long long j = begin + threadIdx.x; j < end; j += blockDim.x) d[j] = s[j];")
    src.line("")
    with src.block(f'extern "C" __global__ void __launch_bounds__({MAX_THREADS}) {entry}(const {entry}_args a)'):
        src.constants(consts)
        src.line("const int plane = (int)blockIdx.x;")
        src.decls(INDEX, ctype="const int")
        # The input holding Concat channel `from`, its channel count and its channel there.
        src_ptr = _select([f"a.x[{i}]" for i in range(k)], ends, "from")
        src_c = _select([str(c) for c in spec.channels], ends, "from")
        src_start = _select([str(s) for s in starts], ends, "from")
        dst_ptr = _select([f"a.y[{o}]" for o in range(m)], [(o + 1) for o in range(m)], "out")
        src.line(f"const float* src = {src_ptr};", f"const int src_c = {src_c};",
                 f"const int ci = from - ({src_start});", f"float* dst = {dst_ptr};",
                 "const long long src_off = ((long long)image * src_c + ci) * a.hw;",
                 "const long long dst_off = ((long long)image * PIECE + ch) * a.hw;",
                 f"if (a.vec == 4) {entry}_copy<float4, 4>(src + src_off, dst + dst_off, a.hw, a.span);",
                 f"else if (a.vec == 2) {entry}_copy<float2, 2>(src + src_off, dst + dst_off, a.hw, a.span);",
                 f"else {entry}_copy<float, 1>(src + src_off, dst + dst_off, a.hw, a.span);")
    return Kernel(spec, entry, src.text())


@dataclass(frozen=True)
class LaunchPlan:
    vec: int
    threads: int
    span: int  # vectors per block
    grid: tuple[int, int]  # (N * C, chunks)


def plan_launch(spec: ShuffleSpec, n: int, hw: int, addresses: list[int]) -> LaunchPlan | None:
    """How the kernel is launched for batch n, plane size hw and these buffer addresses (inputs
    and outputs); None when there is nothing to copy. Raises ValueError past the grid's limits."""
    planes = n * spec.total
    if planes == 0 or hw == 0:
        return None
    if planes > MAX_GRID_X:
        raise ValueError(f"{planes} planes exceed the grid")
    vec = 1
    for v in (4, 2):
        if hw % v == 0 and all(addr % (4 * v) == 0 for addr in addresses):
            vec = v
            break
    vecs = hw // vec
    threads = min(MAX_THREADS, -(-vecs // 32) * 32)
    span = threads * SPAN_ITERS
    if -(-vecs // span) > MAX_GRID_Y:
        span = -(-(-(-vecs // MAX_GRID_Y)) // threads) * threads
    return LaunchPlan(vec, threads, span, (planes, -(-vecs // span)))


def pack_args(spec: ShuffleSpec, plan: LaunchPlan, in_ptrs: list[int], out_ptrs: list[int], hw: int) -> bytes:
    """The argument struct as bytes: every member is one 8-byte word."""
    words = [*in_ptrs, *out_ptrs, hw, plan.vec, plan.span]
    return struct.pack(f"<{len(words)}q", *[w if w < 2**63 else w - 2**64 for w in words])


def model_copy(spec: ShuffleSpec, xs: list, n: int, hw: int) -> list:
    """numpy model of the kernel: for each block's plane, the INDEX expressions evaluated as the
    kernel evaluates them, then the plane copy. xs are [N, C_i, H*W] arrays; returns the outputs
    [N, C/m, H*W] (NaN where no block wrote)."""
    import numpy as np

    consts = spec.constants()
    ends = list(np.cumsum(spec.channels))
    ys = [np.full((n, consts["PIECE"], hw), np.nan, np.float32) for _ in range(spec.outputs)]
    for plane in range(n * consts["C"]):
        env = dict(consts, plane=plane)
        for name, expr in INDEX:
            env[name] = eval(expr.replace("/", "//"), {}, env)  # int division, as in C for these non-negatives
        i = next(j for j, e in enumerate(ends) if env["from"] < e)
        ci = env["from"] - (ends[i] - spec.channels[i])
        ys[env["out"]][env["image"], env["ch"]] = xs[i][env["image"], ci]
    return ys
