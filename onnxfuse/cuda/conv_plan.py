"""A ConvBiasAct layer's plan: its shape, its epilogue, the tiles its kernel may use and the
heuristic that picks one, and the index arithmetic the generated kernel (conv_codegen.py) and
its numpy model (conv_model.py) share (INDEX)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from onnxfuse.graph.activations import CONV, names_fused_in
from onnxfuse.program import OPS, Program

H100_SMS = 132  # streaming multiprocessors the heuristic fills (sm_90 parts have 114..132)


# Epilogue activations that are more than one program op, as the instructions they stand for:
# SiLU, which conv-bias-act matches as x * Sigmoid(x), and a hard-swish with any gate
# (x * HardSigmoid(x), whose defaults 1/6, 1/2 give HardSwish's bits).
COMPOSITE_ACTIVATIONS = {
    "silu": lambda p, v, alpha, beta: p.emit("mul", v, p.emit("sigmoid", v)),
    "hardswish": lambda p, v, alpha, beta: p.emit("mul", v, p.emit("hardsigmoid", v, params=(alpha, beta))),
}
# The epilogue's activations: the shared vocabulary's (onnxfuse/graph/activations.py), each one
# program op, and the composites above.
ACTIVATIONS = ("none", *names_fused_in(CONV), *(a for a in COMPOSITE_ACTIVATIONS if a not in names_fused_in(CONV)))


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

    Activation parameters, in the program op's parameter order: leakyrelu alpha; clip min=alpha
    max=beta; hardsigmoid and hardswish alpha, beta (hardswish is v * hardsigmoid[alpha, beta](v));
    silu is v * sigmoid(v). program() is its meaning.
    """

    activation: str = "none"
    alpha: float = 0.0
    beta: float = 0.0
    residual: bool = False
    post_relu: bool = False

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; known: {', '.join(ACTIVATIONS)}")

    def program(self) -> Program:
        """The epilogue as an expression program (onnxfuse/program.py) over x0, the convolution
        sum plus bias, and x1, the residual when there is one: the numpy model evaluates it and
        the CUDA kernels print it with the Pointwise printer, so every activation has one
        meaning, special values included (a Relu keeps -0, a Clip lets NaN through)."""
        p = Program()
        v = p.add_input("f32")
        z = p.add_input("f32") if self.residual else None
        if self.activation in COMPOSITE_ACTIVATIONS:
            v = COMPOSITE_ACTIVATIONS[self.activation](p, v, self.alpha, self.beta)
        elif self.activation != "none":
            v = p.emit(self.activation, v, params=(self.alpha, self.beta)[:OPS[self.activation].nparams])
        if z is not None:
            v = p.emit("add", v, z)
        if self.post_relu:
            v = p.emit("relu", v)
        p.add_output(v, "f32")
        return p


class _BlockTile:
    """What both GEMM tiles share: a BM x BN block tile whose reduction runs in BK-slices, split
    over a cluster of `splitk` blocks, and the limits a launch puts on it."""

    def _check_launch(self, needs_smem: bool) -> None:
        if not 32 <= self.threads <= 1024:
            raise ValueError(f"{self} gives {self.threads} threads per block")
        if self.splitk not in SPLITS:
            raise ValueError(f"split-K {self.splitk}: one of {SPLITS} (a portable cluster holds at most 8 blocks)")
        if needs_smem and self.smem_bytes > 48 * 1024:
            raise ValueError(f"{self} needs {self.smem_bytes} bytes of static shared memory")

    def split(self, splitk: int):
        """The same tile with its reduction split over a cluster of `splitk` blocks."""
        return replace(self, splitk=splitk)

    def slices_per_split(self, kred: int) -> int:
        """BK-slices of the reduction each block of a cluster sums (the last may get fewer)."""
        return -(-(-(-kred // self.bk)) // self.splitk)


@dataclass(frozen=True)
class GemmTile(_BlockTile):
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
        self._check_launch(needs_smem=self.splitk > 1)

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    @property
    def smem_bytes(self) -> int:
        return 4 * self.bk * (self.bm + self.bn) + (4 * self.bm * self.bn if self.splitk > 1 else 0)

    def as_list(self) -> list[int]:
        return [self.bm, self.bn, self.bk, self.tm, self.tn] + ([self.splitk] if self.splitk > 1 else [])


SPLITS = (1, 2, 4, 8)


@dataclass(frozen=True)
class DepthwiseTile:
    threads: int


@dataclass(frozen=True)
class TensorTile(_BlockTile):
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
        self._check_launch(needs_smem=True)

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
