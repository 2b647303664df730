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
from dataclasses import dataclass, field

from .codegen import HELPERS, body_lines
from .conv_plan import INDEX, ConvShape, DepthwiseTile, Epilogue, GemmTile, TensorTile, heuristic_tile


ABI_VERSION = 1


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
    """`v = epilogue(v)`: the epilogue's program (Epilogue.program) printed by the Pointwise
    printer, in a block of its own so that every store site can hold one."""
    prog = epi.program()
    if not prog.instrs:
        return []
    residual = ["a.z[dst]"] if epi.residual else []
    body, (result,) = body_lines(prog, [v, *residual], "f32", indent + "  ", prefix="ep_")
    return [f"{indent}{{", *body, f"{indent}  {v} = {result};", f"{indent}}}"]


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


def _own_elements(split: bool) -> list[str]:
    """Opens the loops over the thread's TM x TN micro-tile (two braces to close); with split-K,
    over the elements this block of the cluster stores (those with e % SPLITK == ks)."""
    lines = ["#pragma unroll", "  for (int i = 0; i < TM; ++i) {", "#pragma unroll", "    for (int j = 0; j < TN; ++j) {"]
    return lines + (["      if ((i * TN + j) % SPLITK != ks) continue;"] if split else [])


def _gemm_kernel(kind: str, entry: str, lines: list[str], shape: ConvShape, epi: Epilogue, tile) -> Kernel:
    """A GEMM kernel's launch record: one block per BN output pixels and BM output channels of a
    group, SPLITK blocks (a cluster) per tile with split-K."""
    return Kernel(entry=entry, source="\n".join([*lines, "#undef CT"]) + "\n", kind=kind, threads=tile.threads,
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
            *_own_elements(split),
            "      float sum = 0.0f;",
            "#pragma unroll",
            "      for (int rank = 0; rank < SPLITK; ++rank)",
            "        sum += cluster.map_shared_rank(&part[i * TN + j][0], rank)[tid];",
            "      acc[i][j] = sum;",
            "    }",
            "  }",
        ]
    L += _own_elements(split)
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
    return Kernel(entry=entry, source="\n".join([*L, "#undef CT"]) + "\n", kind="depthwise", threads=tile.threads,
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
