"""CUDA C for onnxfuse.ConvBiasAct: an implicit-GEMM convolution and a direct depthwise one.

One kernel is generated per layer shape (channels, spatial size, kernel, strides, pads,
dilations, groups) and epilogue; the batch N is a run-time argument, so one kernel serves every
batch size. Layout NCHW, float32.

Implicit GEMM (every conv that is not depthwise), per group g:

    Y[g*KG + m, col] = sum_kr  W[g*KG + m, kr] * im2col(X)[g, kr, col]
    m   in [0, KG)          output channel within the group       (GEMM rows, tiled by BM)
    col in [0, N*P*Q)       output pixel (n, p, q)                (GEMM columns, tiled by BN)
    kr  in [0, CG*R*S)      input channel within the group, r, s  (reduction, tiled by BK)

grid = (ceil(N*P*Q / BN), ceil(KG / BM), G); each block holds a BM x BN accumulator tile, one
TM x TN micro-tile per thread. The reduction walks BK-slices: the block stages the weight slice
As[BK][BM] and the im2col slice Bs[BK][BN] in shared memory (im2col is never materialized: every
element is decoded from (kr, col) and is zero outside the padded input), then every thread
accumulates kk = 0..BK-1 in order. Epilogue, once per output element, in registers:
bias, activation, residual add, Relu; the output is written once.

Split-K (GemmTile / TensorTile splitk > 1, sm_90+): grid.z = G * SPLITK and the kernel declares
__cluster_dims__(1, 1, SPLITK), so one cluster is the SPLITK blocks of one output tile; block ks
sums a contiguous range of BK-slices, the partial tiles meet in distributed shared memory, and
each block reduces (ranks in order, so the result is deterministic) and stores 1/SPLITK of the
tile. No workspace, no atomics, one launch: CUDA-graph capturable like the others.

Tensor cores (TensorTile, sm_80+): the same staged slices, multiplied by warps with m16n16k8 TF32
WMMA fragments as 3xTF32 (big*small + small*big + big*big), so float32 accuracy is kept; the
accumulators pass through shared memory to the same epilogue.

Depthwise (group == C, one input channel per group): one thread per output element, the R*S
taps of its channel read from shared memory, the same epilogue.

The index arithmetic is written once, in INDEX below, as expressions that are valid C and are
also evaluated by the numpy model of the kernel (onnxfuse/cuda/conv_model.py), which executes the
same tile loops, load mappings and guards; the tests check that model against onnxruntime's Conv.

Kernel ABI (shared with the launcher of stored CUDA kernels): every argument is one 8-byte word

    struct ENTRY_args { const float* x; const float* w; const float* bias;
                        const float* z;   // residual, nullptr when the node has none
                        float* y; long long batch; };
    extern "C" __global__ void ENTRY(const ENTRY_args a)
    block = (threads, 1, 1)
    grid  = (ceil(batch * grid_cols / cols_per_block), grid_y, grid_z)   -- Kernel.grid(), Kernel.attrs()
            (grid_z = G * SPLITK; a split-K kernel's cluster shape is compiled in, so a plain
             cuLaunchKernel launches it)
    requires batch * grid_cols + cols_per_block < 2^31 (pixel indices are 32-bit)
"""
from __future__ import annotations

import hashlib
import math
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from onnxfuse.graph.activations import CONV, names_fused_in

ABI_VERSION = 1
H100_SMS = 132  # streaming multiprocessors the heuristic fills (sm_90 parts have 114..132)

# The epilogue's activations: the shared vocabulary's (onnxfuse/graph/activations.py) and SiLU,
# which conv-bias-act matches as x * Sigmoid(x).
ACTIVATIONS = ("none", *names_fused_in(CONV), "silu")


@dataclass(frozen=True)
class ConvShape:
    """One 2-D convolution layer, batch excluded. pads = (top, left, bottom, right)."""

    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    stride: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilation: tuple[int, int] = (1, 1)
    group: int = 1

    def __post_init__(self) -> None:
        if self.group < 1 or self.c % self.group or self.k % self.group:
            raise ValueError(f"channels {self.c}->{self.k} are not divisible by group {self.group}")
        if self.p < 1 or self.q < 1:
            raise ValueError(f"empty output for {self}")

    @property
    def p(self) -> int:
        return (self.h + self.pads[0] + self.pads[2] - self.dilation[0] * (self.r - 1) - 1) // self.stride[0] + 1

    @property
    def q(self) -> int:
        return (self.w + self.pads[1] + self.pads[3] - self.dilation[1] * (self.s - 1) - 1) // self.stride[1] + 1

    @property
    def cg(self) -> int:
        return self.c // self.group

    @property
    def kg(self) -> int:
        return self.k // self.group

    @property
    def kred(self) -> int:
        return self.cg * self.r * self.s

    @property
    def depthwise(self) -> bool:
        return self.group == self.c and self.cg == 1 and self.group > 1

    def constants(self) -> dict[str, int]:
        """The compile-time constants the generated kernel and the numpy model share."""
        return {
            "C": self.c, "H": self.h, "W": self.w, "K": self.k, "R": self.r, "S": self.s,
            "SH": self.stride[0], "SW": self.stride[1], "PT": self.pads[0], "PL": self.pads[1],
            "DH": self.dilation[0], "DW": self.dilation[1], "G": self.group,
            "P": self.p, "Q": self.q, "PQ": self.p * self.q, "RS": self.r * self.s,
            "CG": self.cg, "KG": self.kg, "KRED": self.kred,
        }

    def macs(self, batch: int = 1) -> int:
        return batch * self.k * self.p * self.q * self.kred


@dataclass(frozen=True)
class Epilogue:
    """What follows the convolution sum: + bias, activation, + residual, Relu.

    Activation parameters: leakyrelu alpha; clip min=alpha max=beta; hardsigmoid and hardswish
    alpha, beta (y = v * max(0, min(1, alpha*v + beta)) for hardswish); silu is v * sigmoid(v).
    """

    activation: str = "none"
    alpha: float = 0.0
    beta: float = 0.0
    residual: bool = False
    post_relu: bool = False

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; known: {', '.join(ACTIVATIONS)}")


@dataclass(frozen=True)
class GemmTile:
    """Block tile BM x BN (output channels x output pixels), reduction slice BK, per-thread TM x TN.

    splitk > 1: the reduction is split over a thread-block cluster of `splitk` blocks (sm_90 and
    later), each summing a contiguous range of BK-slices; the partial tiles meet in distributed
    shared memory and each block reduces, in rank order, and stores 1/splitk of the tile."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int
    splitk: int = 1

    def __post_init__(self) -> None:
        if self.bm % self.tm or self.bn % self.tn:
            raise ValueError(f"thread tile {self.tm}x{self.tn} does not divide block tile {self.bm}x{self.bn}")
        if not 32 <= self.threads <= 1024:
            raise ValueError(f"{self} gives {self.threads} threads per block")
        if self.splitk not in SPLITS:
            raise ValueError(f"split-K {self.splitk}: one of {SPLITS} (a portable cluster holds at most 8 blocks)")
        if self.splitk > 1 and self.smem_bytes > 48 * 1024:
            raise ValueError(f"{self} needs {self.smem_bytes} bytes of static shared memory")

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    @property
    def smem_bytes(self) -> int:
        return 4 * self.bk * (self.bm + self.bn) + (4 * self.bm * self.bn if self.splitk > 1 else 0)

    def as_list(self) -> list[int]:
        return [self.bm, self.bn, self.bk, self.tm, self.tn] + ([self.splitk] if self.splitk > 1 else [])

    def split(self, splitk: int) -> "GemmTile":
        return GemmTile(self.bm, self.bn, self.bk, self.tm, self.tn, splitk)

    def slices_per_split(self, kred: int) -> int:
        """BK-slices of the reduction each block of a cluster sums (the last may get fewer)."""
        return -(-(-(-kred // self.bk)) // self.splitk)


SPLITS = (1, 2, 4, 8)


@dataclass(frozen=True)
class DepthwiseTile:
    threads: int


@dataclass(frozen=True)
class TensorTile:
    """Implicit GEMM on tensor cores, 3xTF32: block tile BM x BN, reduction slice BK, one warp
    per WM x WN piece of the block tile (16x16 WMMA fragments, k-steps of 8); splitk as GemmTile.

    Every operand x is split into big = tf32(x) and small = tf32(x - big), and each product is
    big*small + small*big + big*big (three m16n16k8 TF32 MMAs, float32 accumulation): plain TF32
    would give ~1e-3 relative error, this keeps float32 accuracy (the dropped small*small term is
    ~2^-22 of the product)."""

    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    splitk: int = 1

    def __post_init__(self) -> None:
        if self.bm % self.wm or self.bn % self.wn or self.wm % 16 or self.wn % 16 or self.bk % 8:
            raise ValueError(f"{self}: warp tiles must be multiples of 16 dividing the block tile, BK of 8")
        if not 32 <= self.threads <= 1024:
            raise ValueError(f"{self} gives {self.threads} threads per block")
        if self.splitk not in SPLITS:
            raise ValueError(f"split-K {self.splitk}: one of {SPLITS}")
        if self.smem_bytes > 48 * 1024:
            raise ValueError(f"{self} needs {self.smem_bytes} bytes of static shared memory")

    @property
    def warps(self) -> int:
        return (self.bm // self.wm) * (self.bn // self.wn)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        # As, Bs and the accumulator tile Cs (the epilogue's input, and split-K's partial tile)
        return 4 * (self.bk * (self.bm + self.bn) + self.bm * self.bn)

    def as_list(self) -> list[int]:
        return [self.bm, self.bn, self.bk, self.wm, self.wn, self.splitk]

    def split(self, splitk: int) -> "TensorTile":
        return TensorTile(self.bm, self.bn, self.bk, self.wm, self.wn, splitk)

    def slices_per_split(self, kred: int) -> int:
        return -(-(-(-kred // self.bk)) // self.splitk)


# Candidates, largest first; the heuristic and --tune choose among these.
GEMM_TILES = (
    GemmTile(128, 128, 8, 8, 8),
    GemmTile(128, 64, 8, 8, 4),
    GemmTile(64, 128, 8, 4, 8),
    GemmTile(64, 64, 8, 4, 4),
    GemmTile(32, 64, 16, 4, 4),
    GemmTile(64, 32, 16, 4, 4),
    GemmTile(32, 32, 16, 2, 4),
    GemmTile(16, 64, 16, 2, 4),
)
DEPTHWISE_TILES = (DepthwiseTile(256), DepthwiseTile(128), DepthwiseTile(64))
TENSOR_TILES = (
    TensorTile(128, 64, 16, 32, 32),
    TensorTile(64, 64, 16, 32, 32),
    TensorTile(64, 32, 16, 32, 16),
    TensorTile(32, 64, 16, 16, 32),
    TensorTile(32, 32, 16, 16, 16),
    TensorTile(64, 16, 16, 16, 16),
)

# Index arithmetic shared by the CUDA source and the numpy model, in evaluation order. DIV and
# MOD are the quotient and remainder of non-negative integers (C `/` `%`, numpy // %).
# Names in capitals are ConvShape.constants() or tile constants; `e` is a load slot.
INDEX = {
    # split-K: blockIdx.z = g * SPLITK + ks; the cluster (1, 1, SPLITK) is one group's SPLITK
    # blocks, block ks (its rank in the cluster) sums BK-slices [ks*SPS, (ks+1)*SPS)
    "split": [
        ("g", "DIV(bz, SPLITK)"), ("ks", "MOD(bz, SPLITK)"),
        ("kbeg", "ks * SPS * BK"), ("kend", "MIN(KRED, kbeg + SPS * BK)"),
    ],
    # weight slice (A): slot e of the BM x BK slice at (m0, k0); kr fastest (W rows are contiguous)
    "a_load": [
        ("am", "DIV(e, BK)"), ("ak", "MOD(e, BK)"),
        ("m", "m0 + am"), ("kr", "k0 + ak"),
        ("ok", "(e < BM * BK) && (m < KG) && (kr < KRED)"),
        ("src", "(g * KG + m) * KRED + kr"),
    ],
    # im2col slice (B): slot e of the BK x BN slice at (k0, n0); col fastest (q is contiguous in X)
    "b_load": [
        ("bkk", "DIV(e, BN)"), ("bj", "MOD(e, BN)"),
        ("kr", "k0 + bkk"), ("col", "n0 + bj"),
        ("c", "DIV(kr, RS)"), ("rs", "MOD(kr, RS)"), ("r", "DIV(rs, S)"), ("s", "MOD(rs, S)"),
        ("n", "DIV(col, PQ)"), ("pq", "MOD(col, PQ)"), ("p", "DIV(pq, Q)"), ("q", "MOD(pq, Q)"),
        ("ih", "p * SH - PT + r * DH"), ("iw", "q * SW - PL + s * DW"),
        ("ok", "(e < BK * BN) && (kr < KRED) && (col < NPQ) && (ih >= 0) && (ih < H) && (iw >= 0) && (iw < W)"),
        ("src", "((WIDE(n) * C + g * CG + c) * H + ih) * W + iw"),
    ],
    # thread -> micro-tile: rows ty + i*(BM/TM), columns tx + j*(BN/TN) (strided, so a warp's
    # stores are contiguous in q)
    "thread": [("ty", "DIV(tid, DIV(BN, TN))"), ("tx", "MOD(tid, DIV(BN, TN))")],
    "store": [
        ("m", "m0 + ty + i * DIV(BM, TM)"), ("col", "n0 + tx + j * DIV(BN, TN)"),
        ("ok", "(m < KG) && (col < NPQ)"),
        ("n", "DIV(col, PQ)"), ("pq", "MOD(col, PQ)"),
        ("ko", "g * KG + m"),
        ("dst", "(WIDE(n) * K + ko) * PQ + pq"),
    ],
    # tensor-core epilogue: slot e of the BM x BN accumulator tile Cs[BM][BN], col fastest
    "tc_store": [
        ("em", "DIV(e, BN)"), ("ej", "MOD(e, BN)"),
        ("m", "m0 + em"), ("col", "n0 + ej"),
        ("ok", "(m < KG) && (col < NPQ)"),
        ("n", "DIV(col, PQ)"), ("pq", "MOD(col, PQ)"),
        ("ko", "g * KG + m"),
        ("dst", "(WIDE(n) * K + ko) * PQ + pq"),
    ],
    # depthwise: one thread per output element; block (x: pixels of all images, y: channel k)
    "dw_out": [
        ("col", "n0 + tid"), ("n", "DIV(col, PQ)"), ("pq", "MOD(col, PQ)"),
        ("p", "DIV(pq, Q)"), ("q", "MOD(pq, Q)"),
        ("ci", "DIV(ko, DM)"),  # input channel of output channel ko (DM = K / C outputs per input)
        ("ok", "col < NPQ"),
        ("dst", "(WIDE(n) * K + ko) * PQ + pq"),
    ],
    "dw_tap": [
        ("ih", "p * SH - PT + r * DH"), ("iw", "q * SW - PL + s * DW"),
        ("tok", "(ih >= 0) && (ih < H) && (iw >= 0) && (iw < W)"),
        ("src", "((WIDE(n) * C + ci) * H + ih) * W + iw"),
    ],
}
# Element offsets are 64-bit (WIDE widens before the multiplications); pixel indices stay 32-bit
# so that DIV/MOD by P*Q and Q are single 32-bit operations (a 64-bit division is a called
# routine with a stack frame, which spilled). The launcher keeps batch * P * Q below 2^31.
_WIDE = {"src", "dst"}


def _c_lines(table: str, indent: str, skip: tuple[str, ...] = ()) -> list[str]:
    lines = []
    for name, expr in INDEX[table]:
        if name in skip:
            continue
        ctype = "bool" if name in ("ok", "tok") else ("long long" if name in _WIDE else "int")
        lines.append(f"{indent}const {ctype} {name} = {expr};")
    return lines


def activation_c(act: str, v: str, alpha: float, beta: float) -> str:
    a, b = _flit(alpha), _flit(beta)
    return {
        "none": v,
        "relu": f"fmaxf({v}, 0.0f)",
        "leakyrelu": f"({v} >= 0.0f ? {v} : {a} * {v})",
        "clip": f"fminf(fmaxf({v}, {a}), {b})",
        "sigmoid": f"(1.0f / (1.0f + expf(-{v})))",
        "hardsigmoid": f"fmaxf(0.0f, fminf(1.0f, {a} * {v} + {b}))",
        "hardswish": f"({v} * fmaxf(0.0f, fminf(1.0f, {a} * {v} + {b})))",
        "tanh": f"tanhf({v})",
        "silu": f"({v} / (1.0f + expf(-{v})))",
    }[act]


def _flit(x: float) -> str:
    """An exact float32 C literal."""
    import numpy as np

    v = float(np.float32(x))
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    text = v.hex() + "f"
    return f"({text})" if text.startswith("-") else text


@dataclass(frozen=True)
class Kernel:
    """A generated ConvBiasAct kernel and its launch rule."""

    entry: str
    source: str
    kind: str  # "gemm" or "depthwise"
    threads: int
    cols_per_block: int  # output pixels (over all images) one block covers along grid.x
    grid_cols: int  # output pixels per image (P*Q)
    grid_y: int
    grid_z: int
    smem_bytes: int
    tile: list[int] = field(default_factory=list)
    input_chw: tuple[int, int, int] = (0, 0, 0)
    output_kpq: tuple[int, int, int] = (0, 0, 0)
    residual: bool = False

    def grid(self, batch: int) -> tuple[int, int, int]:
        return (-(-batch * self.grid_cols // self.cols_per_block), self.grid_y, self.grid_z)

    def attrs(self) -> dict:
        """Launch description stored on the ConvBiasAct node (read by kernels/cuda_conv.cc).
        grid = (ceil(batch * cuda_grid_cols / cuda_cols_per_block), cuda_grid_y, cuda_grid_z),
        block = (cuda_block, 1, 1); X must be [N, cuda_c, cuda_h, cuda_w], Y is
        [N, cuda_k, cuda_p, cuda_q]."""
        c, h, w = self.input_chw
        k, p, q = self.output_kpq
        return {
            "cuda_abi": ABI_VERSION,
            "cuda_entry": self.entry,
            "cuda_source": self.source,
            "cuda_kind": self.kind,
            "cuda_block": self.threads,
            "cuda_grid_cols": self.grid_cols,
            "cuda_cols_per_block": self.cols_per_block,
            "cuda_grid_y": self.grid_y,
            "cuda_grid_z": self.grid_z,
            "cuda_tile": list(self.tile),
            "cuda_c": c, "cuda_h": h, "cuda_w": w, "cuda_k": k, "cuda_p": p, "cuda_q": q,
            "cuda_residual": int(self.residual),
        }


def entry_name(shape: ConvShape, epi: Epilogue, tile) -> str:
    key = f"abi{ABI_VERSION} {shape} {epi} {tile}"
    return "onnxfuse_conv_" + hashlib.sha256(key.encode()).hexdigest()[:16]


# INDEX expressions appear verbatim in the source; these give DIV and MOD their C meaning.
_INDEX_MACROS = """#ifndef ONNXFUSE_CONV_INDEX
#define ONNXFUSE_CONV_INDEX
#define DIV(a, b) ((a) / (b))
#define MOD(a, b) ((a) % (b))
#define WIDE(a) ((long long)(a))
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#endif"""


def _args_struct(entry: str) -> list[str]:
    return [
        f"struct {entry}_args {{",
        "  const float* x; const float* w; const float* bias;",
        "  const float* z;  // residual input, nullptr without one",
        "  float* y;",
        "  long long batch;",
        "};",
    ]


def _constants_block(consts: dict[str, int], indent: str) -> list[str]:
    items = ", ".join(f"{k} = {v}" for k, v in consts.items())
    return [f"{indent}constexpr int {items};"]


def _epilogue_lines(epi: Epilogue, v: str, indent: str) -> list[str]:
    lines = [f"{indent}{v} = {activation_c(epi.activation, v, epi.alpha, epi.beta)};"] if epi.activation != "none" else []
    if epi.residual:
        lines.append(f"{indent}{v} += a.z[dst];")
    if epi.post_relu:
        lines.append(f"{indent}{v} = fmaxf({v}, 0.0f);")
    return lines


# Every kernel declares __launch_bounds__(THREADS, 1): with no minimum-blocks hint ptxas capped
# some 128-thread kernels at 64 registers and spilled; a minimum of one block lets the
# accumulator tile stay in registers (ptxas reports no spills for any zoo layer).


def _tile_load_lines(a_iters: int, b_iters: int) -> list[str]:
    """Inside the k0 loop of both GEMM kernels: the block's threads stage the weight tile As
    [BK][BM] and the im2col input tile Bs [BK][BN] in shared memory (0 outside the tensors),
    then synchronize."""
    L = [
        "#pragma unroll",
        f"    for (int it = 0; it < {a_iters}; ++it) {{",
        "      const int e = tid + it * THREADS;",
    ]
    L += _c_lines("a_load", "      ")
    L += [
        "      if (e < BM * BK) As[ak][am] = ok ? __ldg(a.w + src) : 0.0f;",
        "    }",
        "#pragma unroll",
        f"    for (int it = 0; it < {b_iters}; ++it) {{",
        "      const int e = tid + it * THREADS;",
    ]
    L += _c_lines("b_load", "      ")
    L += [
        "      if (e < BK * BN) Bs[bkk][bj] = ok ? __ldg(a.x + src) : 0.0f;",
        "    }",
        "    __syncthreads();",
    ]
    return L


def _gemm_prologue(title: str, shape: ConvShape, epi: Epilogue, tile, consts: dict[str, int],
                   includes: tuple[str, ...] = (), preamble: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """(entry, the source up to the GEMM's own shared memory) of both GEMM kernels: the header,
    the arguments, the constants (with split-K's SPLITK and SPS), the block's tile origin and
    its K range (the cluster rank's slices with split-K, all of KRED without)."""
    entry = entry_name(shape, epi, tile)
    split = tile.splitk > 1
    if split:
        consts = {**consts, "SPLITK": tile.splitk, "SPS": tile.slices_per_split(shape.kred)}
    L = [f"// {title} (ABI {ABI_VERSION})", f"// {shape}", f"// {epi}", f"// {tile}", "#include <math.h>", *includes]
    if split:
        L.append("#include <cooperative_groups.h>")
    L.append(_INDEX_MACROS)
    L += _args_struct(entry)
    cluster = f"__cluster_dims__(1, 1, {tile.splitk}) " if split else ""
    L.append(f'extern "C" __global__ void {cluster}__launch_bounds__({tile.threads}, 1) {entry}(const {entry}_args a) {{')
    L += list(preamble)
    L += _constants_block(consts, "  ")
    L += [
        "  const int NPQ = (int)a.batch * PQ;",
        "  const int tid = threadIdx.x;",
        "  const int n0 = blockIdx.x * BN;",
        "  const int m0 = blockIdx.y * BM;",
    ]
    if split:
        L.append("  const int bz = blockIdx.z;")
        L += _c_lines("split", "  ")
    else:
        L += ["  const int g = blockIdx.z;", "  const int kbeg = 0, kend = KRED;"]
    return entry, L


def _gemm_kernel(kind: str, entry: str, lines: list[str], shape: ConvShape, epi: Epilogue, tile) -> Kernel:
    """A GEMM kernel's launch record: one block per BN output pixels and BM output channels of a
    group, SPLITK blocks (a cluster) per tile with split-K."""
    return Kernel(entry=entry, source="\n".join(lines) + "\n", kind=kind, threads=tile.threads,
                  cols_per_block=tile.bn, grid_cols=shape.p * shape.q, grid_y=-(-shape.kg // tile.bm),
                  grid_z=shape.group * tile.splitk, smem_bytes=tile.smem_bytes, tile=tile.as_list(),
                  **_io(shape, epi))


def generate_gemm(shape: ConvShape, epi: Epilogue, tile: GemmTile) -> Kernel:
    t = tile
    split = t.splitk > 1
    consts = {**shape.constants(), "BM": t.bm, "BN": t.bn, "BK": t.bk, "TM": t.tm, "TN": t.tn,
              "THREADS": t.threads}
    a_iters = -(-t.bm * t.bk // t.threads)
    b_iters = -(-t.bk * t.bn // t.threads)
    entry, L = _gemm_prologue("onnxfuse ConvBiasAct implicit-GEMM kernel", shape, epi, t, consts)
    L += [
        "  __shared__ float As[BK][BM];",
        "  __shared__ float Bs[BK][BN];",
    ]
    L += _c_lines("thread", "  ")
    L += [
        "  float acc[TM][TN];",
        "#pragma unroll",
        "  for (int i = 0; i < TM; ++i)",
        "#pragma unroll",
        "    for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;",
        "  for (int k0 = kbeg; k0 < kend; k0 += BK) {",
    ]
    L += _tile_load_lines(a_iters, b_iters)
    L += [
        "#pragma unroll",
        "    for (int kk = 0; kk < BK; ++kk) {",
        "      float av[TM], bv[TN];",
        "#pragma unroll",
        "      for (int i = 0; i < TM; ++i) av[i] = As[kk][ty + i * (BM / TM)];",
        "#pragma unroll",
        "      for (int j = 0; j < TN; ++j) bv[j] = Bs[kk][tx + j * (BN / TN)];",
        "#pragma unroll",
        "      for (int i = 0; i < TM; ++i)",
        "#pragma unroll",
        "        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);",
        "    }",
        "    __syncthreads();",
        "  }",
    ]
    if split:
        # Each block's partial tile goes to its shared memory, [micro-tile element][thread] (a
        # warp's accesses are consecutive words); after the cluster barrier, block ks reduces the
        # micro-tile elements e with e % SPLITK == ks over ranks 0..SPLITK-1, in order, and stores
        # them; the second barrier keeps every block's shared memory alive until all have read it.
        L += [
            "  __shared__ float part[TM * TN][THREADS];",
            "  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();",
            "#pragma unroll",
            "  for (int i = 0; i < TM; ++i)",
            "#pragma unroll",
            "    for (int j = 0; j < TN; ++j) part[i * TN + j][tid] = acc[i][j];",
            "  cluster.sync();",
            "#pragma unroll",
            "  for (int i = 0; i < TM; ++i) {",
            "#pragma unroll",
            "    for (int j = 0; j < TN; ++j) {",
            "      if ((i * TN + j) % SPLITK != ks) continue;",
            "      float sum = 0.0f;",
            "#pragma unroll",
            "      for (int rank = 0; rank < SPLITK; ++rank)",
            "        sum += cluster.map_shared_rank(&part[i * TN + j][0], rank)[tid];",
            "      acc[i][j] = sum;",
            "    }",
            "  }",
        ]
    L += [
        "#pragma unroll",
        "  for (int i = 0; i < TM; ++i) {",
        "#pragma unroll",
        "    for (int j = 0; j < TN; ++j) {",
    ]
    if split:
        L.append("      if ((i * TN + j) % SPLITK != ks) continue;")
    L += _c_lines("store", "      ")
    L += ["      if (!ok) continue;", "      float v = acc[i][j] + __ldg(a.bias + ko);"]
    L += _epilogue_lines(epi, "v", "      ")
    L += ["      a.y[dst] = v;", "    }", "  }"]
    if split:
        L.append("  cluster.sync();")
    L.append("}")
    return _gemm_kernel("gemm", entry, L, shape, epi, t)


def _tf32_split_lines(name: str, i: str, count: str, tile_at: str) -> list[str]:
    """Load the operand's `count` fragments from shared memory (`tile_at`: address, leading
    dimension) into {name}_big and split each value v into TF32 parts: big = tf32(v), small =
    tf32(v - big), for 3xTF32's big*small + small*big + big*big."""
    return [
        "#pragma unroll",
        f"      for (int {i} = 0; {i} < {count}; ++{i}) {{",
        f"        wmma::load_matrix_sync({name}_big[{i}], {tile_at});",
        "#pragma unroll",
        f"        for (int t = 0; t < {name}_big[{i}].num_elements; ++t) {{",
        f"          const float v = {name}_big[{i}].x[t];",
        "          const float hi = wmma::__float_to_tf32(v);",
        f"          {name}_big[{i}].x[t] = hi;",
        f"          {name}_small[{i}].x[t] = wmma::__float_to_tf32(v - hi);",
        "        }",
        "      }",
    ]


def generate_gemm_tc(shape: ConvShape, epi: Epilogue, tile: TensorTile) -> Kernel:
    """Implicit GEMM on tensor cores (3xTF32 WMMA, sm_80+; split-K needs sm_90 clusters).

    The slices As[BK][BM] and Bs[BK][BN] are staged exactly as in generate_gemm (INDEX a_load,
    b_load). Warp w owns rows wm0 .. wm0+WM and columns wn0 .. wn0+WN of the block tile; per
    8-deep k-step it loads A fragments (16x8, column-major in As: element (m, k) at As[k][m]) and
    B fragments (8x16, row-major in Bs), splits each into big and small TF32 parts, and
    accumulates small terms first. The accumulators go to Cs[BM][BN]; the epilogue then walks Cs
    with every thread of the block (INDEX tc_store, slot e = tid + it * THREADS), so a warp's
    stores are consecutive pixels."""
    t = tile
    split = t.splitk > 1
    fm, fn = t.wm // 16, t.wn // 16
    consts = {**shape.constants(), "BM": t.bm, "BN": t.bn, "BK": t.bk, "WM": t.wm, "WN": t.wn,
              "FM": fm, "FN": fn, "THREADS": t.threads}
    a_iters = -(-t.bm * t.bk // t.threads)
    b_iters = -(-t.bk * t.bn // t.threads)
    c_iters = -(-t.bm * t.bn // t.threads)
    entry, L = _gemm_prologue("onnxfuse ConvBiasAct implicit-GEMM kernel on tensor cores, 3xTF32", shape, epi, t,
                              consts, includes=("#include <mma.h>",), preamble=("  using namespace nvcuda;",))
    L += [
        "  __shared__ __align__(32) float As[BK][BM];",
        "  __shared__ __align__(32) float Bs[BK][BN];",
        "  __shared__ __align__(32) float Cs[BM][BN];",
        "  const int warp = tid / 32;",
        "  const int wm0 = (warp / (BN / WN)) * WM;",
        "  const int wn0 = (warp % (BN / WN)) * WN;",
        "  wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc[FM][FN];",
        "#pragma unroll",
        "  for (int i = 0; i < FM; ++i)",
        "#pragma unroll",
        "    for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);",
        "  for (int k0 = kbeg; k0 < kend; k0 += BK) {",
    ]
    L += _tile_load_lines(a_iters, b_iters)
    L += [
        "#pragma unroll",
        "    for (int kk = 0; kk < BK; kk += 8) {",
        "      wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major> a_big[FM], a_small[FM];",
        "      wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> b_big[FN], b_small[FN];",
    ]
    L += _tf32_split_lines("a", "i", "FM", "&As[kk][wm0 + i * 16], BM")
    L += _tf32_split_lines("b", "j", "FN", "&Bs[kk][wn0 + j * 16], BN")
    L += [
        "#pragma unroll",
        "      for (int i = 0; i < FM; ++i)",
        "#pragma unroll",
        "        for (int j = 0; j < FN; ++j) {",
        "          wmma::mma_sync(acc[i][j], a_big[i], b_small[j], acc[i][j]);",
        "          wmma::mma_sync(acc[i][j], a_small[i], b_big[j], acc[i][j]);",
        "          wmma::mma_sync(acc[i][j], a_big[i], b_big[j], acc[i][j]);",
        "        }",
        "    }",
        "    __syncthreads();",
        "  }",
        "#pragma unroll",
        "  for (int i = 0; i < FM; ++i)",
        "#pragma unroll",
        "    for (int j = 0; j < FN; ++j)",
        "      wmma::store_matrix_sync(&Cs[wm0 + i * 16][wn0 + j * 16], acc[i][j], BN, wmma::mem_row_major);",
    ]
    if split:
        # Slot iteration `it` of the epilogue belongs to block it % SPLITK of the cluster, which
        # sums that slot of every block's Cs in rank order.
        L += [
            "  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();",
            "  cluster.sync();",
        ]
    else:
        L.append("  __syncthreads();")
    L += [
        "#pragma unroll",
        f"  for (int it = 0; it < {c_iters}; ++it) {{",
    ]
    if split:
        L.append("    if (it % SPLITK != ks) continue;")
    L += ["    const int e = tid + it * THREADS;", "    if (e >= BM * BN) continue;"]
    L += _c_lines("tc_store", "    ")
    L.append("    if (!ok) continue;")
    if split:
        L += [
            "    float sum = 0.0f;",
            "#pragma unroll",
            "    for (int rank = 0; rank < SPLITK; ++rank) sum += cluster.map_shared_rank(&Cs[0][0], rank)[e];",
            "    float v = sum + __ldg(a.bias + ko);",
        ]
    else:
        L.append("    float v = Cs[em][ej] + __ldg(a.bias + ko);")
    L += _epilogue_lines(epi, "v", "    ")
    L += ["    a.y[dst] = v;", "  }"]
    if split:
        L.append("  cluster.sync();")
    L.append("}")
    return _gemm_kernel("gemm_tf32x3", entry, L, shape, epi, t)


def generate_depthwise(shape: ConvShape, epi: Epilogue, tile: DepthwiseTile) -> Kernel:
    if not shape.depthwise:
        raise ValueError(f"not a depthwise convolution: {shape}")
    entry = entry_name(shape, epi, tile)
    consts = {**shape.constants(), "DM": shape.k // shape.c, "THREADS": tile.threads}
    L = [f"// onnxfuse ConvBiasAct direct depthwise kernel (ABI {ABI_VERSION})",
         f"// {shape}", f"// {epi}", f"// {tile}", "#include <math.h>", _INDEX_MACROS]
    L += _args_struct(entry)
    L.append(f'extern "C" __global__ void __launch_bounds__({tile.threads}, 1) {entry}(const {entry}_args a) {{')
    L += _constants_block(consts, "  ")
    L += [
        "  const int NPQ = (int)a.batch * PQ;",
        "  const int tid = threadIdx.x;",
        "  const int n0 = blockIdx.x * THREADS;",
        "  const int ko = blockIdx.y;",
        "  __shared__ float wk[RS];",
        "  for (int t = tid; t < RS; t += THREADS) wk[t] = __ldg(a.w + ko * RS + t);",
        "  __syncthreads();",
    ]
    L += _c_lines("dw_out", "  ")
    L += [
        "  if (!ok) return;",
        "  float acc = 0.0f;",
        "#pragma unroll",
        "  for (int r = 0; r < R; ++r) {",
        "#pragma unroll",
        "    for (int s = 0; s < S; ++s) {",
    ]
    L += _c_lines("dw_tap", "      ")
    L += [
        "      if (tok) acc = fmaf(wk[r * S + s], __ldg(a.x + src), acc);",
        "    }",
        "  }",
        "  float v = acc + __ldg(a.bias + ko);",
    ]
    L += _epilogue_lines(epi, "v", "  ")
    L += ["  a.y[dst] = v;", "}"]
    return Kernel(entry=entry, source="\n".join(L) + "\n", kind="depthwise", threads=tile.threads,
                  cols_per_block=tile.threads, grid_cols=shape.p * shape.q, grid_y=shape.k, grid_z=1,
                  smem_bytes=4 * shape.r * shape.s, tile=[tile.threads], **_io(shape, epi))


def _io(shape: ConvShape, epi: Epilogue) -> dict:
    return {"input_chw": (shape.c, shape.h, shape.w), "output_kpq": (shape.k, shape.p, shape.q),
            "residual": epi.residual}


def clusters_supported(arch: str | None) -> bool:
    """Thread-block clusters (split-K) need sm_90 or later."""
    from .compile import parse_arch

    sm, _ = parse_arch(arch)
    return int(sm.split("_")[1].rstrip("a")) >= 90


def tensor_cores_supported(arch: str | None) -> bool:
    """TF32 WMMA needs sm_80 or later."""
    from .compile import parse_arch

    sm, _ = parse_arch(arch)
    return int(sm.split("_")[1].rstrip("a")) >= 80


# Split-K keeps at least this many BK-slices per block, and at most this many blocks per SM.
MIN_SLICES_PER_SPLIT = 4
MAX_SPLIT_BLOCKS_PER_SM = 2


def _gemm_stats(shape: ConvShape, t: GemmTile, batch: int) -> tuple[int, float]:
    """(blocks without split-K, padded / useful multiply-adds)."""
    npq = batch * shape.p * shape.q
    gm, gn = -(-shape.kg // t.bm), -(-npq // t.bn)
    return gm * gn * shape.group, (gm * t.bm * gn * t.bn) / (shape.kg * npq)


def _serial(shape: ConvShape, t) -> int:
    """Serial work of one thread (GemmTile: multiply-adds) or one warp (TensorTile: 16x16x8
    fragment products / 8), for comparing splits of one kind of tile."""
    per_k = t.tm * t.tn if isinstance(t, GemmTile) else (t.wm // 16) * (t.wn // 16)
    return t.slices_per_split(shape.kred) * t.bk * per_k


def _splits(shape: ConvShape, t, batch: int, sms: int):
    """Split-K variants of tile t the heuristic and --tune consider: only for tiles of at most
    64x64 that leave SMs idle, >= MIN_SLICES_PER_SPLIT slices per block, <= MAX_SPLIT_BLOCKS_PER_SM
    blocks per SM."""
    blocks, _ = _gemm_stats(shape, t, batch)
    if t.bm * t.bn > 64 * 64 or blocks >= sms:
        return
    nslices = -(-shape.kred // t.bk)
    for split in SPLITS[1:]:
        if blocks * split > MAX_SPLIT_BLOCKS_PER_SM * sms or nslices < MIN_SLICES_PER_SPLIT * split:
            break
        yield t.split(split)


def heuristic_tile(shape: ConvShape, batch: int = 1, sms: int = H100_SMS, clusters: bool = False,
                   tensor_cores: bool = False):
    """The tile used without --tune.

    Depthwise: the largest block that is not mostly idle (P*Q per image bounds it).
    GEMM: walk GEMM_TILES (TENSOR_TILES with tensor_cores) from the largest; take the first that
    wastes at most 25% of its multiply-adds on tile padding and still puts at least one block on
    every SM (a full wave) at batch `batch`. When none fills a wave, the candidate with the most
    blocks among those with the least padding (small layers: keep every SM busy rather than
    reuse more).
    With clusters (sm_90+), a layer that still leaves SMs idle gets split-K: among the tiles
    of at most 64x64 wasting at most 25% (or the tile above), and splits of 2, 4, 8 that keep
    >= MIN_SLICES_PER_SPLIT slices per block and <= MAX_SPLIT_BLOCKS_PER_SM blocks per SM, the
    one with the least serial work per thread or warp (_serial).
    """
    if shape.depthwise:
        pq = batch * shape.p * shape.q
        for t in DEPTHWISE_TILES:
            if pq * shape.k >= t.threads * sms or t is DEPTHWISE_TILES[-1]:
                return t
    tiles = TENSOR_TILES if tensor_cores else GEMM_TILES
    base = None
    for t in tiles:
        blocks, waste = _gemm_stats(shape, t, batch)
        if waste <= 1.25 and blocks >= sms:
            base = t
            break
    if base is None:
        scored = [(round(_gemm_stats(shape, t, batch)[1], 2), -_gemm_stats(shape, t, batch)[0], i)
                  for i, t in enumerate(tiles)]
        base = tiles[min(scored)[2]]
    if not clusters or _gemm_stats(shape, base, batch)[0] >= sms:
        return base
    best, best_key = base, (_serial(shape, base), 0)
    for t in tiles:
        if _gemm_stats(shape, t, batch)[1] > 1.25 and t != base:
            continue
        for cand in _splits(shape, t, batch, sms):
            key = (_serial(shape, cand), _gemm_stats(shape, t, batch)[0] * cand.splitk)
            if key < best_key:
                best, best_key = cand, key
    return best


def generate(shape: ConvShape, epi: Epilogue, tile=None, clusters: bool = False, tensor_cores: bool = False) -> Kernel:
    """The kernel for one layer: depthwise layers get the direct kernel, every other the GEMM
    (on tensor cores for a TensorTile)."""
    tile = tile or heuristic_tile(shape, clusters=clusters, tensor_cores=tensor_cores)
    if shape.depthwise:
        return generate_depthwise(shape, epi, tile)
    if isinstance(tile, TensorTile):
        return generate_gemm_tc(shape, epi, tile)
    return generate_gemm(shape, epi, tile)


def candidates(shape: ConvShape, batch: int = 1, sms: int = H100_SMS, clusters: bool = False,
               tensor_cores: bool = False) -> tuple:
    """Tiles --tune times: every GEMM tile (and with tensor_cores every TensorTile), and with
    clusters their split-K variants (the bounds of _splits)."""
    if shape.depthwise:
        return DEPTHWISE_TILES
    out = []
    for tiles in (GEMM_TILES,) + ((TENSOR_TILES,) if tensor_cores else ()):
        out += tiles
        if clusters:
            for t in tiles:
                out += list(_splits(shape, t, batch, sms))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Compile checks (nvcc / ptxas) and tuning on a GPU.


@dataclass
class PtxasInfo:
    entry: str
    registers: int
    spill_stores: int
    spill_loads: int
    smem_bytes: int


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
