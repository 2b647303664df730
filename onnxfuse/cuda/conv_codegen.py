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

The index arithmetic is written once, in INDEX (conv_plan.py), as expressions that are valid C and are
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
from contextlib import contextmanager
from typing import Iterator
from dataclasses import dataclass, field

from .codegen import HELPERS, body_lines
from .emit import CSource
from .conv_plan import INDEX, ConvShape, DepthwiseTile, Epilogue, GemmTile, TensorTile, heuristic_tile


ABI_VERSION = 1


# Element offsets are 64-bit (WIDE widens before the multiplications); pixel indices stay 32-bit
# so that DIV/MOD by P*Q and Q are single 32-bit operations (a 64-bit division is a called
# routine with a stack frame, which spilled). The launcher keeps batch * P * Q below 2^31.
_WIDE = {"src", "dst"}


def _decls(src: CSource, table: str) -> None:
    for name, expr in INDEX[table]:
        ctype = "bool" if name in ("ok", "tok") else ("long long" if name in _WIDE else "int")
        src.line(f"const {ctype} {name} = {expr};")


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
#endif
""" + HELPERS + "#define CT float  // the epilogue program's compute type"


def _args_struct(src: CSource, entry: str) -> None:
    with src.block(f"struct {entry}_args", end="};"):
        src.line("const float* x; const float* w; const float* bias;", "const float* z;  // residual input, nullptr without one",
                 "float* y;", "long long batch;")


def _epilogue(src: CSource, epi: Epilogue, v: str) -> None:
    """`v = epilogue(v)`: the epilogue's program (Epilogue.program) printed by the Pointwise
    printer, in a block of its own so that every store site can hold one."""
    prog = epi.program()
    if not prog.instrs:
        return
    residual = ["a.z[dst]"] if epi.residual else []
    with src.block(""):
        body, (result,) = body_lines(prog, [v, *residual], "f32", src.indent, prefix="ep_")
        src.extend(body).line(f"{v} = {result};")


# Every kernel declares __launch_bounds__(THREADS, 1): with no minimum-blocks hint ptxas capped
# some 128-thread kernels at 64 registers and spilled; a minimum of one block lets the
# accumulator tile stay in registers (ptxas reports no spills for any zoo layer).


def _tile_loads(src: CSource, a_iters: int, b_iters: int) -> None:
    """Inside the k0 loop of both GEMM kernels: the block's threads stage the weight tile As
    [BK][BM] and the im2col input tile Bs [BK][BN] in shared memory (0 outside the tensors),
    then synchronize."""
    for iters, table, store in ((a_iters, "a_load", "if (e < BM * BK) As[ak][am] = ok ? __ldg(a.w + src) : 0.0f;"),
                                (b_iters, "b_load", "if (e < BK * BN) Bs[bkk][bj] = ok ? __ldg(a.x + src) : 0.0f;")):
        src.pragma("unroll")
        with src.block(f"for (int it = 0; it < {iters}; ++it)"):
            src.line("const int e = tid + it * THREADS;")
            _decls(src, table)
            src.line(store)
    src.line("__syncthreads();")


def _gemm_prologue(title: str, shape: ConvShape, epi: Epilogue, tile, consts: dict[str, int],
                   includes: tuple[str, ...] = (), preamble: tuple[str, ...] = ()) -> tuple[str, CSource]:
    """(entry, the source up to the GEMM's own shared memory, inside the kernel's body) of both
    GEMM kernels: the header, the arguments, the constants (with split-K's SPLITK and SPS), the
    block's tile origin and its K range (the cluster rank's slices with split-K, all of KRED
    without). The caller closes the body (_close_kernel)."""
    entry = entry_name(shape, epi, tile)
    split = tile.splitk > 1
    if split:
        consts = {**consts, "SPLITK": tile.splitk, "SPS": tile.slices_per_split(shape.kred)}
    src = CSource()
    src.line(f"// {title} (ABI {ABI_VERSION})", f"// {shape}", f"// {epi}", f"// {tile}", "#include <math.h>", *includes)
    if split:
        src.line("#include <cooperative_groups.h>")
    src.raw(_INDEX_MACROS)
    _args_struct(src, entry)
    cluster = f"__cluster_dims__(1, 1, {tile.splitk}) " if split else ""
    src.line(f'extern "C" __global__ void {cluster}__launch_bounds__({tile.threads}, 1) {entry}(const {entry}_args a) {{')
    src.depth += 1
    src.line(*preamble)
    src.constants(consts)
    src.line("const int NPQ = (int)a.batch * PQ;", "const int tid = threadIdx.x;", "const int n0 = blockIdx.x * BN;",
             "const int m0 = blockIdx.y * BM;")
    if split:
        src.line("const int bz = blockIdx.z;")
        _decls(src, "split")
    else:
        src.line("const int g = blockIdx.z;", "const int kbeg = 0, kend = KRED;")
    return entry, src


def _close_kernel(src: CSource) -> str:
    src.depth -= 1
    src.line("}", "#undef CT")
    return src.text()


@contextmanager
def _own_elements(src: CSource, split: bool) -> Iterator[None]:
    """The loops over the thread's TM x TN micro-tile; with split-K, over the elements this block
    of the cluster stores (those with e % SPLITK == ks)."""
    src.pragma("unroll")
    with src.block("for (int i = 0; i < TM; ++i)"):
        src.pragma("unroll")
        with src.block("for (int j = 0; j < TN; ++j)"):
            if split:
                src.line("if ((i * TN + j) % SPLITK != ks) continue;")
            yield


def _unrolled_pair(src: CSource, outer: str, inner: str) -> None:
    """`#pragma unroll` for-loop over an unbraced `#pragma unroll` for-loop statement."""
    src.pragma("unroll").line(outer)
    with src.indented():
        src.pragma("unroll").line(inner)


def _gemm_kernel(kind: str, entry: str, source: str, shape: ConvShape, epi: Epilogue, tile) -> Kernel:
    """A GEMM kernel's launch record: one block per BN output pixels and BM output channels of a
    group, SPLITK blocks (a cluster) per tile with split-K."""
    return Kernel(entry=entry, source=source, kind=kind, threads=tile.threads,
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
    entry, src = _gemm_prologue("onnxfuse ConvBiasAct implicit-GEMM kernel", shape, epi, t, consts)
    src.line("__shared__ float As[BK][BM];", "__shared__ float Bs[BK][BN];")
    _decls(src, "thread")
    src.line("float acc[TM][TN];")
    _unrolled_pair(src, "for (int i = 0; i < TM; ++i)", "for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;")
    with src.block("for (int k0 = kbeg; k0 < kend; k0 += BK)"):
        _tile_loads(src, a_iters, b_iters)
        src.pragma("unroll")
        with src.block("for (int kk = 0; kk < BK; ++kk)"):
            src.line("float av[TM], bv[TN];").pragma("unroll")
            src.line("for (int i = 0; i < TM; ++i) av[i] = As[kk][ty + i * (BM / TM)];").pragma("unroll")
            src.line("for (int j = 0; j < TN; ++j) bv[j] = Bs[kk][tx + j * (BN / TN)];")
            _unrolled_pair(src, "for (int i = 0; i < TM; ++i)",
                           "for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);")
        src.line("__syncthreads();")
    if split:
        # Each block's partial tile goes to its shared memory, [micro-tile element][thread] (a
        # warp's accesses are consecutive words); after the cluster barrier, block ks reduces the
        # micro-tile elements e with e % SPLITK == ks over ranks 0..SPLITK-1, in order, and stores
        # them; the second barrier keeps every block's shared memory alive until all have read it.
        src.line("__shared__ float part[TM * TN][THREADS];",
                 "cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();")
        _unrolled_pair(src, "for (int i = 0; i < TM; ++i)", "for (int j = 0; j < TN; ++j) part[i * TN + j][tid] = acc[i][j];")
        src.line("cluster.sync();")
        with _own_elements(src, split):
            src.line("float sum = 0.0f;").pragma("unroll")
            src.line("for (int rank = 0; rank < SPLITK; ++rank)")
            with src.indented():
                src.line("sum += cluster.map_shared_rank(&part[i * TN + j][0], rank)[tid];")
            src.line("acc[i][j] = sum;")
    with _own_elements(src, split):
        _decls(src, "store")
        src.line("if (!ok) continue;", "float v = acc[i][j] + __ldg(a.bias + ko);")
        _epilogue(src, epi, "v")
        src.line("a.y[dst] = v;")
    if split:
        src.line("cluster.sync();")
    return _gemm_kernel("gemm", entry, _close_kernel(src), shape, epi, t)


def _tf32_split(src: CSource, name: str, i: str, count: str, tile_at: str) -> None:
    """Load the operand's `count` fragments from shared memory (`tile_at`: address, leading
    dimension) into {name}_big and split each value v into TF32 parts: big = tf32(v), small =
    tf32(v - big), for 3xTF32's big*small + small*big + big*big."""
    src.pragma("unroll")
    with src.block(f"for (int {i} = 0; {i} < {count}; ++{i})"):
        src.line(f"wmma::load_matrix_sync({name}_big[{i}], {tile_at});").pragma("unroll")
        with src.block(f"for (int t = 0; t < {name}_big[{i}].num_elements; ++t)"):
            src.line(f"const float v = {name}_big[{i}].x[t];", "const float hi = wmma::__float_to_tf32(v);",
                     f"{name}_big[{i}].x[t] = hi;", f"{name}_small[{i}].x[t] = wmma::__float_to_tf32(v - hi);")


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
    entry, src = _gemm_prologue("onnxfuse ConvBiasAct implicit-GEMM kernel on tensor cores, 3xTF32", shape, epi, t,
                                consts, includes=("#include <mma.h>",), preamble=("using namespace nvcuda;",))
    src.line("__shared__ __align__(32) float As[BK][BM];", "__shared__ __align__(32) float Bs[BK][BN];",
             "__shared__ __align__(32) float Cs[BM][BN];", "const int warp = tid / 32;",
             "const int wm0 = (warp / (BN / WN)) * WM;", "const int wn0 = (warp % (BN / WN)) * WN;",
             "wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc[FM][FN];")
    _unrolled_pair(src, "for (int i = 0; i < FM; ++i)", "for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);")
    with src.block("for (int k0 = kbeg; k0 < kend; k0 += BK)"):
        _tile_loads(src, a_iters, b_iters)
        src.pragma("unroll")
        with src.block("for (int kk = 0; kk < BK; kk += 8)"):
            src.line("wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major> a_big[FM], a_small[FM];",
                     "wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> b_big[FN], b_small[FN];")
            _tf32_split(src, "a", "i", "FM", "&As[kk][wm0 + i * 16], BM")
            _tf32_split(src, "b", "j", "FN", "&Bs[kk][wn0 + j * 16], BN")
            src.pragma("unroll").line("for (int i = 0; i < FM; ++i)")
            with src.indented():
                src.pragma("unroll")
                with src.block("for (int j = 0; j < FN; ++j)"):
                    src.line("wmma::mma_sync(acc[i][j], a_big[i], b_small[j], acc[i][j]);",
                             "wmma::mma_sync(acc[i][j], a_small[i], b_big[j], acc[i][j]);",
                             "wmma::mma_sync(acc[i][j], a_big[i], b_big[j], acc[i][j]);")
        src.line("__syncthreads();")
    _unrolled_pair(src, "for (int i = 0; i < FM; ++i)", "for (int j = 0; j < FN; ++j)")
    with src.indented(), src.indented():
        src.line("wmma::store_matrix_sync(&Cs[wm0 + i * 16][wn0 + j * 16], acc[i][j], BN, wmma::mem_row_major);")
    if split:
        # Slot iteration `it` of the epilogue belongs to block it % SPLITK of the cluster, which
        # sums that slot of every block's Cs in rank order.
        src.line("cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();", "cluster.sync();")
    else:
        src.line("__syncthreads();")
    src.pragma("unroll")
    with src.block(f"for (int it = 0; it < {c_iters}; ++it)"):
        if split:
            src.line("if (it % SPLITK != ks) continue;")
        src.line("const int e = tid + it * THREADS;", "if (e >= BM * BN) continue;")
        _decls(src, "tc_store")
        src.line("if (!ok) continue;")
        if split:
            src.line("float sum = 0.0f;").pragma("unroll")
            src.line("for (int rank = 0; rank < SPLITK; ++rank) sum += cluster.map_shared_rank(&Cs[0][0], rank)[e];",
                     "float v = sum + __ldg(a.bias + ko);")
        else:
            src.line("float v = Cs[em][ej] + __ldg(a.bias + ko);")
        _epilogue(src, epi, "v")
        src.line("a.y[dst] = v;")
    if split:
        src.line("cluster.sync();")
    return _gemm_kernel("gemm_tf32x3", entry, _close_kernel(src), shape, epi, t)


def generate_depthwise(shape: ConvShape, epi: Epilogue, tile: DepthwiseTile) -> Kernel:
    if not shape.depthwise:
        raise ValueError(f"not a depthwise convolution: {shape}")
    entry = entry_name(shape, epi, tile)
    consts = {**shape.constants(), "DM": shape.k // shape.c, "THREADS": tile.threads}
    src = CSource()
    src.line(f"// onnxfuse ConvBiasAct direct depthwise kernel (ABI {ABI_VERSION})", f"// {shape}", f"// {epi}",
             f"// {tile}", "#include <math.h>").raw(_INDEX_MACROS)
    _args_struct(src, entry)
    with src.block(f'extern "C" __global__ void __launch_bounds__({tile.threads}, 1) {entry}(const {entry}_args a)'):
        src.constants(consts)
        src.line("const int NPQ = (int)a.batch * PQ;", "const int tid = threadIdx.x;", "const int n0 = blockIdx.x * THREADS;",
                 "const int ko = blockIdx.y;", "__shared__ float wk[RS];",
                 "for (int t = tid; t < RS; t += THREADS) wk[t] = __ldg(a.w + ko * RS + t);", "__syncthreads();")
        _decls(src, "dw_out")
        src.line("if (!ok) return;", "float acc = 0.0f;").pragma("unroll")
        with src.block("for (int r = 0; r < R; ++r)"):
            src.pragma("unroll")
            with src.block("for (int s = 0; s < S; ++s)"):
                _decls(src, "dw_tap")
                src.line("if (tok) acc = fmaf(wk[r * S + s], __ldg(a.x + src), acc);")
        src.line("float v = acc + __ldg(a.bias + ko);")
        _epilogue(src, epi, "v")
        src.line("a.y[dst] = v;")
    src.line("#undef CT")
    return Kernel(entry=entry, source=src.text(), kind="depthwise", threads=tile.threads,
                  cols_per_block=tile.threads, grid_cols=shape.p * shape.q, grid_y=shape.k, grid_z=1,
                  smem_bytes=4 * shape.r * shape.s, tile=[tile.threads], **_io(shape, epi))


def _io(shape: ConvShape, epi: Epilogue) -> dict:
    return {"input_chw": (shape.c, shape.h, shape.w), "output_kpq": (shape.k, shape.p, shape.q),
            "residual": epi.residual}


def generate(shape: ConvShape, epi: Epilogue, tile=None, clusters: bool = False, tensor_cores: bool = False) -> Kernel:
    """The kernel for one layer: depthwise layers get the direct kernel, every other the GEMM
    (on tensor cores for a TensorTile)."""
    tile = tile or heuristic_tile(shape, clusters=clusters, tensor_cores=tensor_cores)
    if shape.depthwise:
        return generate_depthwise(shape, epi, tile)
    if isinstance(tile, TensorTile):
        return generate_gemm_tc(shape, epi, tile)
    return generate_gemm(shape, epi, tile)
