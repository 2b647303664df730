"""CUDA C for onnxfuse.Attention: softmax(scale * q.k^T + mask) . v, one warp per query row.

Contract of the op (float32):

    q [B, Sq, H*dh], k [B, Sk, H*dh], v [B, Sk, H*dv]  ->  out [B, Sq, H*dv]
    out[b, s, h*dv + j] = sum_t softmax_t(scale * q[b,s,h,:].k[b,t,h,:] + mask[.., s, t]) * v[b, t, h, j]

with `heads_first` (a bit per operand: 1 q, 2 k, 4 v; not with packing) that operand is [B, H, S, d]
instead (q[b, s, h, i] = q[b, h, s, i]: the output of a prologue after the head split, such as a
partial rotary, read where it was written); the output is [B, Sq, H*dv] in every case.

with `qkv_packed` the one input qkv [B, S, 3*H*dh] holds q, k and v at last-axis column offsets
0, H*dh and 2*H*dh (dv = dh), read in place; the optional additive mask broadcasts (ONNX
multidirectional, rank <= 4) to [B, H, Sq, Sk]. With `has_bias` (packed only) a bias [3*H*dh] is
added to qkv's columns as q, k, v are read: q = qkv[.., 0:D] + bias[0:D], and so on.

One kernel per (heads, dh, dv, scale, packed, has_mask, has_bias, nan_to_zero, heads_first); B,
Sq and Sk are run-time arguments. A [B, S, H*d] operand's row s of head h starts at
(b*S + s)*ROW + OFF + h*d (ROW its row width, 3*H*dh for packed qkv, OFF its column block); a
heads-first one's at ((b*H + h)*S + s)*d, as the CPU kernel's views read them (head stride S*d).

with `heads_merged` (a bit per operand, 3-D attention over batch*heads: DeBERTa-v2) that operand
is [B*H, S, d]: the memory of [B, H, S, d], read by the heads-first arithmetic (the host takes
B = dim 0 / H). With `mask_merged` the additive term is rank <= 3, broadcastable to
[B*H, Sq, Sk]; the host turns its strides into strides over [B, H, Sq, Sk] (h's stride that of
the merged axis, b's H times it), so the kernel reads it like any mask. With `fill_mode` 1 (2) a
score is replaced by FILL_VALUE where the condition (float32, broadcastable to [B, H, Sq, Sk],
read through its own strides, INDEX["fill"]) is nonzero (zero), after the mask: Where's masked
fill, as the CPU kernel applies it (a NaN condition is nonzero, as Cast to bool reads it). A row
filled entirely with a finite value (DeBERTa's -FLT_MAX) then has uniform probabilities, as
Softmax gives; a -inf fill takes the skip of fully masked tiles below.

A decode step (one query row against Concat(past, new) keys and values, [B, H, Sk, d] present
tensors) is the heads-first form with Sq = 1: one block serves one (b, h), one warp its row.

Design (simple on purpose; every B, Sq, Sk works):

* grid.x = B * H * ceil(Sq / ROWS) blocks of ROWS warps; block `bid` serves head h of batch b
  and the ROWS consecutive query rows s = rb*ROWS + warp (INDEX["block"]). Warps whose row is
  past Sq load zeros, take part in every __syncthreads and store nothing.
* Each warp keeps its query row in shared memory, qs[warp][0..dh) (unscaled: the scale
  multiplies each dot product, as the contract writes it; the bias added when HAS_BIAS).
* Keys and values are streamed through shared memory in tiles of TILE rows: the whole block
  loads ks[TILE][KS] (KS = dh, or dh + 1 when dh is even, so that lane j reading row j is free of
  bank conflicts) and vs[TILE][dv], the bias added when HAS_BIAS, zero-filled past Sk (a zero
  value times a zero probability stays zero; garbage could be NaN).
* Within a tile, lane j scores key t0 + j: sequential fmaf dot product over d, times scale,
  plus the mask element (read through the broadcast strides, INDEX["mask"]); lanes past the
  tile's last key score -inf.
* Online softmax, per warp (all warp-uniform): m_new = max(m, max over lanes); if m_new is still
  -inf (everything so far masked with -inf) the tile changes nothing; else corr = exp(m - m_new),
  p = exp(score - m_new), l = l*corr + sum(p), acc *= corr, acc += sum_j p_j * vs[j][col]
  (p_j broadcast with __shfl_sync), m = m_new. Lane c of the warp owns output columns
  c, c+32, ... (DVL = ceil(dv/32) accumulators).
  A tile holding a NaN score is not skipped even when its maximum is -inf (fmaxf drops NaN):
  its corr and p are NaN, so l and acc become NaN and stay NaN, as Softmax's row is NaN then.
* out = acc / l. With Sk = 0 the output is 0 (what MatMul with an empty reduction gives); a row
  whose every score is -inf gives 0/0 = NaN, as Softmax of such a row does.
* nan_to_zero (NAN_TO_ZERO, the node attribute: Where(IsNaN(p), 0, p) before the MatMul with v):
  a row whose probabilities are NaN, which is exactly a row with l not > 0 (l = 0: every score
  -inf; l NaN: a NaN or +inf score; otherwise l >= 1), is written as the original computes it
  with probabilities 0: out[col] = sum_t 0 * v[t, col] (v with its bias), summed from +0, so +0,
  or NaN where that column of v holds an infinite or NaN value. Such rows (all keys masked by
  -inf: padding) are rare, so the warp reads v from global memory for them (INDEX["zero_row"]).

The index arithmetic is written once, in INDEX below, as expressions that are valid C and are
also evaluated by the numpy model of the kernel (onnxfuse/cuda/attention_model.py), which runs the
same blocks, warps, tiles, guards and online-softmax steps; the tests check it against a direct
numpy attention.

Kernel ABI (shared with kernels/cuda_attention.cc): every argument is one 8-byte word

    struct ENTRY_args { const float* q; const float* k; const float* v;   // packed: all three = qkv
                        const float* mask;                                // nullptr without one
                        const float* bias;                                // [3*H*dh]; nullptr without one
                        float* out;
                        long long batch, sq, sk;
                        long long mask_strides[4];      // element strides over [B, H, Sq, Sk], 0 = broadcast
                        const float* cond;               // fill_mode's condition (declared with fill_mode only:
                        long long cond_strides[4]; };    //   the host always passes them), strides as mask_strides
    extern "C" __global__ void ENTRY(const ENTRY_args a)
    block = (ROWS * 32, 1, 1), grid = (batch * H * ceil(sq / ROWS), 1, 1)   (Kernel.attrs())
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from .emit import CSource

ABI_VERSION = 3  # 2: the bias pointer after the mask's; 3: the fill condition and its strides last
ROWS = 4  # query rows (warps) per block
MAX_HEAD_DIM = 256  # dh and dv the kernel supports (shared memory and accumulators)
SHARED_LIMIT = 48 * 1024  # static shared memory per block


@dataclass(frozen=True)
class AttentionSpec:
    heads: int
    dh: int
    dv: int
    scale: float
    packed: bool = False
    has_mask: bool = False
    has_bias: bool = False
    nan_to_zero: bool = False  # the node's nan_to_zero: a row of NaN probabilities weighs v by 0
    heads_first: int = 0  # bit 0 q, 1 k, 2 v: that operand is [B, H, S, d] (the node's heads_first)
    heads_merged: int = 0  # bit 0 q, 1 k, 2 v: that operand is [B*H, S, d] (the node's heads_merged)
    mask_merged: bool = False  # the mask is rank <= 3, broadcast to [B*H, Sq, Sk] (mask_merged_heads)
    fill_mode: int = 0  # 1 (2): a score is fill_value where the condition is nonzero (zero)
    fill_value: float = 0.0

    def __post_init__(self) -> None:
        if self.heads < 1 or self.dh < 1 or self.dv < 1:
            raise ValueError(f"invalid attention dimensions {self}")
        if self.packed and self.dv != self.dh:
            raise ValueError("packed qkv needs dv == dh")
        if self.has_bias and not self.packed:
            raise ValueError("has_bias needs packed qkv")
        if not 0 <= self.heads_first <= 7 or (self.heads_first and self.packed):
            raise ValueError("heads_first is a mask of bits 0-2 (q, k, v), and 0 with packed qkv")
        if not 0 <= self.heads_merged <= 7 or (self.heads_merged and self.packed) or self.heads_merged & self.heads_first:
            raise ValueError("heads_merged is a mask of bits 0-2 (q, k, v) apart from heads_first's, and 0 with packed qkv")
        if self.mask_merged and not self.has_mask:
            raise ValueError("mask_merged needs a mask")
        if self.fill_mode not in (0, 1, 2):
            raise ValueError("fill_mode is 0, 1 or 2")

    @property
    def layout_first(self) -> int:
        """The operands read by the heads-first arithmetic: [B, H, S, d] or [B*H, S, d] (same memory)."""
        return self.heads_first | self.heads_merged

    @property
    def tile(self) -> int:
        """Keys per shared-memory tile: 32 (one per lane) when it fits, else 16 or 8."""
        for t in (32, 16, 8):
            if shared_bytes(self.dh, self.dv, t) <= SHARED_LIMIT:
                return t
        raise ValueError(f"dh {self.dh} / dv {self.dv} do not fit in shared memory")

    def constants(self) -> dict[str, int]:
        """The compile-time constants the generated kernel and the numpy model share."""
        d = self.heads * self.dh
        qrow = 3 * d if self.packed else d
        return {
            "H": self.heads, "DH": self.dh, "DV": self.dv, "ROWS": ROWS, "THREADS": ROWS * 32,
            "TILE": self.tile, "KS": ks_stride(self.dh), "DVL": -(-self.dv // 32),
            "QROW": qrow, "KROW": qrow, "VROW": 3 * d if self.packed else self.heads * self.dv,
            "QOFF": 0, "KOFF": d if self.packed else 0, "VOFF": 2 * d if self.packed else 0,
            "HAS_MASK": int(self.has_mask), "HAS_BIAS": int(self.has_bias),
            "NAN_TO_ZERO": int(self.nan_to_zero),
            "QF": self.layout_first & 1, "KF": (self.layout_first >> 1) & 1, "VF": (self.layout_first >> 2) & 1,
            "FILL_MODE": self.fill_mode,
        }


def ks_stride(dh: int) -> int:
    """Row stride of the key tile: odd, so 32 lanes reading 32 rows at one column hit 32 banks."""
    return dh if dh % 2 else dh + 1


def shared_bytes(dh: int, dv: int, tile: int) -> int:
    return 4 * (ROWS * dh + tile * ks_stride(dh) + tile * dv)


# The onnxfuse.Attention attributes whose meaning the generated kernel implements (causal is
# among them only to be refused: the kernel has no causal mode). A node with any other attribute
# (a form added to the op's contract later) gets no kernel until the generator learns it, so that
# a CUDA session never runs a kernel that ignores part of the node's semantics.
NODE_ATTRIBUTES = frozenset({"num_heads", "scale", "has_mask", "qkv_packed", "has_bias", "nan_to_zero", "causal",
                             "causal_max_queries", "causal_max_keys", "heads_first", "heads_merged",
                             "mask_merged_heads", "fill_mode", "fill_value"})


def supported(dh: int, dv: int) -> bool:
    """Whether the kernel handles these head sizes (a pass should not emit Attention for CUDA otherwise)."""
    return 1 <= dh <= MAX_HEAD_DIM and 1 <= dv <= MAX_HEAD_DIM


def float_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


# Index expressions, each (name, C expression); valid C (with DIV/MOD/SEL below) and evaluated by
# the numpy model. Every quantity that can exceed 2^31 is long long in the kernel (bid, sq, sk, t0
# and the mask strides are). SEL(QF, heads first, split heads) picks an operand's layout by a
# compile-time constant, so a kernel without heads_first holds the split-heads arithmetic alone.
INDEX = {
    # block -> (b, h, first query row); warp -> its query row s
    "block": [
        ("nrb", "DIV(sq + ROWS - 1, ROWS)"), ("rb", "MOD(bid, nrb)"), ("bh", "DIV(bid, nrb)"),
        ("h", "MOD(bh, H)"), ("b", "DIV(bh, H)"), ("s", "rb * ROWS + warp"), ("row_ok", "s < sq"),
    ],
    # element d of the warp's query row
    "q_load": [
        ("q_src", "SEL(QF, (bh * sq + s) * DH + d, (b * sq + s) * QROW + QOFF + h * DH + d)"),
        ("qb_src", "QOFF + h * DH + d"),
    ],
    # slot e of the key tile at t0
    "k_load": [
        ("kt", "DIV(e, DH)"), ("kd", "MOD(e, DH)"), ("k_ok", "t0 + kt < sk"),
        ("k_src", "SEL(KF, (bh * sk + t0 + kt) * DH + kd, (b * sk + t0 + kt) * KROW + KOFF + h * DH + kd)"),
        ("k_dst", "kt * KS + kd"), ("kb_src", "KOFF + h * DH + kd"),
    ],
    # slot e of the value tile at t0
    "v_load": [
        ("vt", "DIV(e, DV)"), ("vd", "MOD(e, DV)"), ("v_ok", "t0 + vt < sk"),
        ("v_src", "SEL(VF, (bh * sk + t0 + vt) * DV + vd, (b * sk + t0 + vt) * VROW + VOFF + h * DV + vd)"),
        ("v_dst", "vt * DV + vd"), ("vb_src", "VOFF + h * DV + vd"),
    ],
    # the mask element lane `lane` adds to its score
    "mask": [("m_src", "b * ms0 + h * ms1 + s * ms2 + (t0 + lane) * ms3")],
    # the fill condition element lane `lane` reads (fill_mode)
    "fill": [("c_src", "b * cs0 + h * cs1 + s * cs2 + (t0 + lane) * cs3")],
    # output column col of the warp's row
    "store": [("o_dst", "(b * sq + s) * (H * DV) + h * DV + col")],
    # nan_to_zero: column col of value row t, read from global memory for a row of NaN probabilities
    "zero_row": [("z_src", "SEL(VF, (bh * sk + t) * DV + col, (b * sk + t) * VROW + VOFF + h * DV + col)"),
                 ("zb_src", "VOFF + h * DV + col")],
}

_INDEX_MACROS = """#define DIV(a, b) ((a) / (b))
#define MOD(a, b) ((a) % (b))
#define SEL(c, a, b) ((c) ? (a) : (b))"""


@dataclass(frozen=True)
class Kernel:
    """A generated Attention kernel and its launch rule."""

    entry: str
    source: str
    spec: AttentionSpec
    threads: int
    rows_per_block: int

    def grid(self, batch: int, sq: int) -> int:
        return batch * self.spec.heads * -(-sq // self.rows_per_block)

    def attrs(self) -> dict:
        """Launch description stored on the Attention node (read by kernels/cuda_attention.cc):
        block = (cuda_block, 1, 1), grid = (B * num_heads * ceil(Sq / cuda_rows), 1, 1); the
        kernel was generated for head sizes cuda_dh / cuda_dv."""
        return {
            "cuda_abi": ABI_VERSION,
            "cuda_block": self.threads,
            "cuda_rows": self.rows_per_block,
            "cuda_dh": self.spec.dh,
            "cuda_dv": self.spec.dv,
        }


def entry_name(spec: AttentionSpec) -> str:
    key = (f"abi{ABI_VERSION} rows{ROWS} {spec.heads} {spec.dh} {spec.dv} {float_bits(spec.scale):08x} {spec.packed}"
           f" {spec.has_mask} {spec.has_bias}" + (" nan_to_zero" if spec.nan_to_zero else "")
           + (f" heads_first{spec.heads_first}" if spec.heads_first else "")
           + (f" heads_merged{spec.heads_merged}" if spec.heads_merged else "")
           + (" mask_merged" if spec.mask_merged else "")
           + (f" fill{spec.fill_mode} {float_bits(spec.fill_value):08x}" if spec.fill_mode else ""))
    return "onnxfuse_attn_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def generate(spec: AttentionSpec) -> Kernel:
    if not supported(spec.dh, spec.dv):
        raise ValueError(f"head sizes dh {spec.dh}, dv {spec.dv} exceed {MAX_HEAD_DIM}")
    entry = entry_name(spec)
    c = spec.constants()
    src = CSource()
    src.line(f"// onnxfuse Attention kernel (ABI {ABI_VERSION}): {spec}", "#include <math.h>").raw(_INDEX_MACROS)
    with src.block(f"struct {entry}_args", end="};"):
        src.line("const float* q; const float* k; const float* v;", "const float* mask;  // nullptr without one",
                 "const float* bias;  // nullptr without one", "float* out;",
                 "long long batch; long long sq; long long sk;", "long long mask_strides[4];")
        if spec.fill_mode:  # the host passes these words always; a kernel without a fill does not declare them
            src.line("const float* cond;", "long long cond_strides[4];")
    with src.block(f'extern "C" __global__ void __launch_bounds__({c["THREADS"]}) {entry}(const {entry}_args a)'):
        _body(src, spec, c)
    return Kernel(entry, src.text(), spec, c["THREADS"], ROWS)


def _body(src: CSource, spec: AttentionSpec, c: dict) -> None:
    src.constants(c)
    src.line(f"const float scale = __int_as_float({float_bits(spec.scale):#010x});  // {spec.scale!r}",
             "const unsigned FULL = 0xffffffffu;",
             "__shared__ float qs[ROWS][DH];", "__shared__ float ks[TILE * KS];", "__shared__ float vs[TILE * DV];",
             "const int tid = threadIdx.x;", "const int warp = tid >> 5, lane = tid & 31;",
             "const long long sq = a.sq, sk = a.sk;", "const long long bid = blockIdx.x;",
             "const long long ms0 = a.mask_strides[0], ms1 = a.mask_strides[1], ms2 = a.mask_strides[2],"
             " ms3 = a.mask_strides[3];",
             "(void)ms0; (void)ms1; (void)ms2; (void)ms3;")
    if spec.fill_mode:
        src.line(f"const float fill_value = __int_as_float({float_bits(spec.fill_value):#010x});  // {spec.fill_value!r}",
                 "const long long cs0 = a.cond_strides[0], cs1 = a.cond_strides[1], cs2 = a.cond_strides[2],"
                 " cs3 = a.cond_strides[3];")
    src.decls(INDEX["block"])
    with src.block("for (int d = lane; d < DH; d += 32)"):
        src.decls(INDEX["q_load"])
        src.line("qs[warp][d] = row_ok ? (HAS_BIAS ? a.q[q_src] + a.bias[qb_src] : a.q[q_src]) : 0.0f;")
    src.line("float m = -INFINITY, l = 0.0f;", "float acc[DVL];").pragma("unroll")
    src.line("for (int c = 0; c < DVL; ++c) acc[c] = 0.0f;")
    with src.block("for (long long t0 = 0; t0 < sk; t0 += TILE)"):
        src.line("__syncthreads();  // the previous tile is consumed (the first time: no effect)")
        with src.block("for (int e = tid; e < TILE * DH; e += THREADS)"):
            src.decls(INDEX["k_load"])
            src.line("ks[k_dst] = k_ok ? (HAS_BIAS ? a.k[k_src] + a.bias[kb_src] : a.k[k_src]) : 0.0f;")
        with src.block("for (int e = tid; e < TILE * DV; e += THREADS)"):
            src.decls(INDEX["v_load"])
            src.line("vs[v_dst] = v_ok ? (HAS_BIAS ? a.v[v_src] + a.bias[vb_src] : a.v[v_src]) : 0.0f;")
        src.line("__syncthreads();", "const int n_valid = sk - t0 < TILE ? (int)(sk - t0) : TILE;")
        with src.block("if (row_ok)", comment="uniform in the warp: every lane takes part in the shuffles below"):
            _tile_softmax(src, spec)
    with src.block("if (row_ok)"):
        src.pragma("unroll")
        with src.block("for (int c = 0; c < DVL; ++c)"):
            src.line("const int col = lane + 32 * c;", "if (col >= DV) continue;")
            src.decls(INDEX["store"])
            src.line("float o = sk > 0 ? acc[c] / l : 0.0f;")
            with src.block("if (NAN_TO_ZERO && sk > 0 && !(l > 0.0f))", comment="the row's probabilities are NaN: 0 * v"):
                src.line("o = 0.0f;")
                with src.block("for (long long t = 0; t < sk; ++t)"):
                    src.decls(INDEX["zero_row"])
                    src.line("o += 0.0f * (HAS_BIAS ? a.v[z_src] + a.bias[zb_src] : a.v[z_src]);")
            src.line("a.out[o_dst] = o;")


def _tile_softmax(src: CSource, spec: AttentionSpec) -> None:
    """A warp's scores against the tile's keys (lane j: key t0 + j) and the online-softmax step."""
    src.line("float score = -INFINITY;")
    with src.block("if (lane < n_valid)"):
        src.line("float dot = 0.0f;").pragma("unroll 8")
        src.line("for (int d = 0; d < DH; ++d) dot = fmaf(qs[warp][d], ks[lane * KS + d], dot);",
                 "score = dot * scale;")
        with src.block("if (HAS_MASK)"):
            src.decls(INDEX["mask"])
            src.line("score += a.mask[m_src];")
        if spec.fill_mode:  # after the mask, as Where reads the masked scores; NaN is nonzero
            src.decls(INDEX["fill"])
            src.line("const float c = a.cond[c_src];",
                     f"if ({'c != 0.0f' if spec.fill_mode == 1 else 'c == 0.0f'}) score = fill_value;")
    src.line("float tile_max = score;").pragma("unroll")
    src.line("for (int o = 16; o > 0; o >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL, tile_max, o));",
             "const float m_new = fmaxf(m, tile_max);",
             "// Skipped only when every score so far is -inf: fmaxf drops NaN, and a NaN score must",
             "// make the row NaN (m_new uniform in the warp, so every lane takes part in the vote).")
    with src.block("if (m_new != -INFINITY || __any_sync(FULL, isnan(score)))"):
        src.line("const float corr = expf(m - m_new);", "const float p = expf(score - m_new);",
                 "float p_sum = p;").pragma("unroll")
        src.line("for (int o = 16; o > 0; o >>= 1) p_sum += __shfl_xor_sync(FULL, p_sum, o);",
                 "l = l * corr + p_sum;").pragma("unroll")
        src.line("for (int c = 0; c < DVL; ++c) acc[c] *= corr;")
        with src.block("for (int j = 0; j < n_valid; ++j)"):
            src.line("const float pj = __shfl_sync(FULL, p, j);").pragma("unroll")
            with src.block("for (int c = 0; c < DVL; ++c)"):
                src.line("const int col = lane + 32 * c;", "if (col < DV) acc[c] = fmaf(pj, vs[j * DV + col], acc[c]);")
        src.line("m = m_new;")
