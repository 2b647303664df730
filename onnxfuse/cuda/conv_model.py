"""A numpy execution of the ConvBiasAct CUDA kernels, tile by tile.

It runs what the generated source runs, with the same index arithmetic (the INDEX expressions of
conv_plan.py, evaluated on integer arrays), the same load-slot mapping and guards, the same
shared-memory tile layout, the same reduction order (k0 slices, then kk = 0..BK-1 within a slice)
and the same per-thread micro-tile and epilogue, for every block and thread at once. Tests compare
it with onnxruntime's Conv, so a tiling or indexing mistake in the kernel design fails here without
a GPU. (Float32 throughout; the GPU's fused multiply-add rounds once where numpy rounds twice.)
"""
from __future__ import annotations

import numpy as np

from .conv_plan import INDEX, ConvShape, DepthwiseTile, Epilogue, GemmTile, TensorTile


def _eval(table: str, env: dict) -> dict:
    """Evaluate one INDEX table in order; `env` gets every name it defines."""
    scope = {"DIV": np.floor_divide, "MOD": np.mod, "MIN": np.minimum, "WIDE": lambda a: np.asarray(a, dtype=np.int64),
             "__builtins__": {}}
    for name, expr in INDEX[table]:
        env[name] = eval(expr.replace("&&", "&"), scope, env)  # noqa: S307 (our own expressions)
    return env


def _epilogue(v: np.ndarray, epi: Epilogue, z: np.ndarray | None, dst: np.ndarray) -> np.ndarray:
    """The epilogue's program (Epilogue.program), evaluated by the program's numpy reference."""
    prog = epi.program()
    if not prog.instrs:
        return v
    return prog.evaluate(v, *([z[dst]] if epi.residual else []))[0]


def _stage_tiles(t, base: dict, k0, rows, blocks: int, a_iters: int, b_iters: int, wf, xf):
    """One k0 step's shared-memory tiles As [blocks, BK, BM] and Bs [blocks, BK, BN], staged by the
    INDEX a_load / b_load expressions as both GEMM kernels stage them; what no thread writes is
    NaN (unwritten shared memory is poison)."""
    As = np.full((blocks, t.bk, t.bm), np.nan, np.float32)
    Bs = np.full((blocks, t.bk, t.bn), np.nan, np.float32)
    for it in range(a_iters):
        env = _eval("a_load", {**base, "k0": k0, "e": base["tid"] + it * t.threads})
        live = np.broadcast_to(env["e"] < t.bm * t.bk, env["ok"].shape)
        ok = np.broadcast_to(env["ok"], live.shape)
        val = np.where(ok, wf[np.where(ok, env["src"], 0)], np.float32(0))
        r_, ak, am = np.broadcast_arrays(rows, env["ak"], env["am"])
        As[r_[live], ak[live], am[live]] = val[live]
    for it in range(b_iters):
        env = _eval("b_load", {**base, "k0": k0, "e": base["tid"] + it * t.threads})
        ok = env["ok"]
        live = np.broadcast_to(env["e"] < t.bk * t.bn, ok.shape)
        val = np.where(ok, xf[np.where(ok, env["src"], 0)], np.float32(0))
        r_, bkk, bj = np.broadcast_arrays(rows, env["bkk"], env["bj"])
        Bs[r_[live], bkk[live], bj[live]] = val[live]
    return As, Bs


def _gemm_grid(shape: ConvShape, t, x, w, z, tile_consts: dict):
    """What both GEMM kernels start from, for every block at once (axis 0 enumerates (blockIdx.z,
    blockIdx.y, blockIdx.x), axis 1 the threads): (base, blocks, (grid y, grid x), x, w and z flattened in
    float32, the zeroed flat output). base holds the constants (tile_consts added), the tile origin
    m0, n0, tid, and the K range: the split table's g, ks, kbeg, kend with split-K, else the whole
    of KRED."""
    batch = x.shape[0]
    consts = {**shape.constants(), "BM": t.bm, "BN": t.bn, "BK": t.bk, **tile_consts, "THREADS": t.threads,
              "NPQ": batch * shape.p * shape.q, "SPLITK": t.splitk, "SPS": t.slices_per_split(shape.kred)}
    xf, wf = x.astype(np.float32).reshape(-1), w.astype(np.float32).reshape(-1)
    zf = None if z is None else z.astype(np.float32).reshape(-1)
    yf = np.zeros(batch * shape.k * shape.p * shape.q, np.float32)
    gx, gy, gz = -(-consts["NPQ"] // t.bn), -(-shape.kg // t.bm), shape.group * t.splitk
    bz, by, bx = np.meshgrid(np.arange(gz), np.arange(gy), np.arange(gx), indexing="ij")
    blocks = bx.size
    base = {**consts, "m0": by.reshape(-1, 1) * t.bm, "n0": bx.reshape(-1, 1) * t.bn,
            "tid": np.arange(t.threads).reshape(1, -1)}
    if t.splitk > 1:
        base = _eval("split", {**base, "bz": bz.reshape(-1, 1)})
    else:
        base.update(g=bz.reshape(-1, 1), ks=np.zeros((blocks, 1), int), kbeg=np.zeros((blocks, 1), int),
                    kend=np.full((blocks, 1), shape.kred))
    return base, blocks, (gy, gx), xf, wf, zf, yf


def _cluster_sum(tiles: np.ndarray, groups: int, splitk: int) -> np.ndarray:
    """Split-K's reduction of per-block partial tiles (axis 0 enumerates (blockIdx.z, y, x)): the
    cluster of block (g, ks, y, x) is the SPLITK blocks (g, 0..SPLITK-1, y, x), whose partial
    tiles are summed over ranks in order, starting from 0; every block of the cluster gets the sum."""
    parts = tiles.reshape(groups, splitk, -1, *tiles.shape[1:])
    total = np.zeros_like(parts[:, 0])
    for rank in range(splitk):
        total = total + parts[:, rank]
    return np.broadcast_to(total[:, None], parts.shape).reshape(tiles.shape)


def run_gemm(shape: ConvShape, epi: Epilogue, tile: GemmTile, x, w, bias, z=None) -> np.ndarray:
    """The implicit-GEMM kernel over grid (ceil(N*P*Q/BN), ceil(KG/BM), G*SPLITK)."""
    batch = x.shape[0]
    t = tile
    split = t.splitk > 1
    base, blocks, _, xf, wf, zf, yf = _gemm_grid(shape, t, x, w, z, {"TM": t.tm, "TN": t.tn})
    th = _eval("thread", dict(base))
    ty, tx = th["ty"], th["tx"]  # [1, THREADS]
    acc = np.zeros((blocks, t.threads, t.tm, t.tn), np.float32)
    a_iters = -(-t.bm * t.bk // t.threads)
    b_iters = -(-t.bk * t.bn // t.threads)
    rows = np.arange(blocks).reshape(-1, 1)
    # k0 runs from each block's kbeg to its kend in BK steps: slice `sl` of every block at once,
    # blocks whose range has ended (k0 >= kend) idle.
    for sl in range(-(-shape.kred // t.bk)):
        k0 = base["kbeg"] + sl * t.bk  # [blocks, 1]
        active = (k0 < base["kend"]).reshape(-1)
        if not active.any():
            break
        As, Bs = _stage_tiles(t, base, k0, rows, blocks, a_iters, b_iters, wf, xf)
        for kk in range(t.bk):
            av = As[:, kk, :][:, (ty.reshape(-1, 1) + np.arange(t.tm) * (t.bm // t.tm))]  # [blocks, THREADS, TM]
            bv = Bs[:, kk, :][:, (tx.reshape(-1, 1) + np.arange(t.tn) * (t.bn // t.tn))]  # [blocks, THREADS, TN]
            acc[active] += av[active][:, :, :, None] * bv[active][:, :, None, :]
    if split:
        acc = _cluster_sum(acc, shape.group, t.splitk)
    bias = bias.astype(np.float32)
    stored = np.zeros(yf.shape, int)
    ks = base["ks"].reshape(-1, 1)
    for i in range(t.tm):
        for j in range(t.tn):
            env = _eval("store", {**base, "ty": ty, "tx": tx, "i": i, "j": j})
            ok = np.broadcast_to(env["ok"], (blocks, t.threads)) & np.broadcast_to(ks == (i * t.tn + j) % t.splitk,
                                                                                   (blocks, t.threads))
            ko = np.broadcast_to(env["ko"], ok.shape)[ok]
            dst = np.broadcast_to(env["dst"], ok.shape)[ok]
            v = acc[:, :, i, j][ok] + bias[ko]
            yf[dst] = _epilogue(v, epi, zf, dst)
            np.add.at(stored, dst, 1)
    if not (stored == 1).all():
        raise AssertionError(f"{int((stored == 0).sum())} outputs unwritten, {int((stored > 1).sum())} written twice")
    return yf.reshape(batch, shape.k, shape.p, shape.q)


def tf32(v: np.ndarray) -> np.ndarray:
    """float32 -> the nearest TF32 value (10 explicit mantissa bits), ties away from zero: what
    cvt.rna.tf32.f32 (wmma::__float_to_tf32) gives for finite inputs."""
    bits = np.asarray(v, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _mma(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One m16n16k8 MMA step: products of TF32 values are exact; the sum is taken in float64 and
    rounded to float32 once (the tensor core's float32 accumulation, within an ulp or so)."""
    return (acc.astype(np.float64) + np.matmul(a.astype(np.float64), b.astype(np.float64))).astype(np.float32)


def run_gemm_tc(shape: ConvShape, epi: Epilogue, tile: TensorTile, x, w, bias, z=None) -> np.ndarray:
    """The tensor-core kernel (3xTF32 WMMA) over grid (ceil(N*P*Q/BN), ceil(KG/BM), G*SPLITK):
    the same staged slices as run_gemm, warp w's 16x16 fragments at (wm0 + 16i, wn0 + 16j),
    per 8-deep k-step big*small, small*big, big*big, then Cs and the tc_store epilogue."""
    batch = x.shape[0]
    t = tile
    split = t.splitk > 1
    base, blocks, _, xf, wf, zf, yf = _gemm_grid(shape, t, x, w, z, {})
    # warp -> (wm0, wn0), as in the source
    warps = [((wp // (t.bn // t.wn)) * t.wm, (wp % (t.bn // t.wn)) * t.wn) for wp in range(t.warps)]
    acc = {(wp, i, j): np.zeros((blocks, 16, 16), np.float32)
           for wp in range(t.warps) for i in range(t.wm // 16) for j in range(t.wn // 16)}
    rows = np.arange(blocks).reshape(-1, 1)
    a_iters = -(-t.bm * t.bk // t.threads)
    b_iters = -(-t.bk * t.bn // t.threads)
    for sl in range(-(-shape.kred // t.bk)):
        k0 = base["kbeg"] + sl * t.bk
        active = (k0 < base["kend"]).reshape(-1)
        if not active.any():
            break
        As, Bs = _stage_tiles(t, base, k0, rows, blocks, a_iters, b_iters, wf, xf)
        for kk in range(0, t.bk, 8):
            for (wp, i, j), c in acc.items():
                wm0, wn0 = warps[wp]
                a = As[active, kk:kk + 8, wm0 + 16 * i:wm0 + 16 * i + 16].transpose(0, 2, 1)  # [b, 16, 8]
                b = Bs[active, kk:kk + 8, wn0 + 16 * j:wn0 + 16 * j + 16]  # [b, 8, 16]
                a_big, b_big = tf32(a), tf32(b)
                a_small, b_small = tf32(a - a_big), tf32(b - b_big)
                v = c[active]
                v = _mma(v, a_big, b_small)
                v = _mma(v, a_small, b_big)
                c[active] = _mma(v, a_big, b_big)
    Cs = np.full((blocks, t.bm, t.bn), np.nan, np.float32)  # poison: every slot must be stored
    for (wp, i, j), c in acc.items():
        wm0, wn0 = warps[wp]
        Cs[:, wm0 + 16 * i:wm0 + 16 * i + 16, wn0 + 16 * j:wn0 + 16 * j + 16] = c
    Cs = Cs.reshape(blocks, -1)
    if split:
        Cs = _cluster_sum(Cs, shape.group, t.splitk)
    bias = bias.astype(np.float32)
    stored = np.zeros(yf.shape, int)
    ks = base["ks"].reshape(-1, 1)
    for it in range(-(-t.bm * t.bn // t.threads)):
        e = base["tid"] + it * t.threads
        env = _eval("tc_store", {**base, "e": e})
        ok = np.broadcast_to(env["ok"] & (e < t.bm * t.bn), (blocks, t.threads)) & np.broadcast_to(
            ks == it % t.splitk, (blocks, t.threads))
        ko = np.broadcast_to(env["ko"], ok.shape)[ok]
        dst = np.broadcast_to(env["dst"], ok.shape)[ok]
        slot = np.broadcast_to(np.minimum(e, t.bm * t.bn - 1), ok.shape)
        v = Cs[np.broadcast_to(rows, ok.shape)[ok], slot[ok]] + bias[ko]
        yf[dst] = _epilogue(v, epi, zf, dst)
        np.add.at(stored, dst, 1)
    if not (stored == 1).all():
        raise AssertionError(f"{int((stored == 0).sum())} outputs unwritten, {int((stored > 1).sum())} written twice")
    return yf.reshape(batch, shape.k, shape.p, shape.q)


def run_depthwise(shape: ConvShape, epi: Epilogue, tile: DepthwiseTile, x, w, bias, z=None) -> np.ndarray:
    """The direct depthwise kernel over grid (ceil(N*P*Q/THREADS), K, 1)."""
    batch = x.shape[0]
    consts = {**shape.constants(), "DM": shape.k // shape.c, "THREADS": tile.threads,
              "NPQ": batch * shape.p * shape.q}
    xf, wf = x.astype(np.float32).reshape(-1), w.astype(np.float32).reshape(shape.k, -1)
    zf = None if z is None else z.astype(np.float32).reshape(-1)
    yf = np.zeros(batch * shape.k * shape.p * shape.q, np.float32)
    gx = -(-consts["NPQ"] // tile.threads)
    ky, bx = np.meshgrid(np.arange(shape.k), np.arange(gx), indexing="ij")
    env = _eval("dw_out", {**consts, "ko": ky.reshape(-1, 1), "n0": bx.reshape(-1, 1) * tile.threads,
                           "tid": np.arange(tile.threads).reshape(1, -1)})
    ok = np.broadcast_to(env["ok"], (ky.size, tile.threads))
    wk = wf[ky.reshape(-1)]  # the block's taps, as staged in shared memory: [blocks, RS]
    acc = np.zeros(ok.shape, np.float32)
    for r in range(shape.r):
        for s in range(shape.s):
            tap = _eval("dw_tap", {**consts, **env, "r": r, "s": s})
            tok = np.broadcast_to(tap["tok"], ok.shape) & ok
            src = np.where(tok, np.broadcast_to(tap["src"], ok.shape), 0)
            acc += np.where(tok, wk[:, r * shape.s + s][:, None] * xf[src], np.float32(0))
    ko = np.broadcast_to(ky.reshape(-1, 1), ok.shape)[ok]
    dst = np.broadcast_to(env["dst"], ok.shape)[ok]
    v = acc[ok] + bias.astype(np.float32)[ko]
    yf[dst] = _epilogue(v, epi, zf, dst)
    return yf.reshape(batch, shape.k, shape.p, shape.q)


def run(shape: ConvShape, epi: Epilogue, tile, x, w, bias, z=None) -> np.ndarray:
    if isinstance(tile, DepthwiseTile):
        return run_depthwise(shape, epi, tile, x, w, bias, z)
    if isinstance(tile, TensorTile):
        return run_gemm_tc(shape, epi, tile, x, w, bias, z)
    return run_gemm(shape, epi, tile, x, w, bias, z)
