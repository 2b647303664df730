"""A numpy execution of the ConvBiasAct CUDA kernels, tile by tile.

It runs what the generated source runs, with the same index arithmetic (the INDEX expressions of
conv_codegen, evaluated on integer arrays), the same load-slot mapping and guards, the same
shared-memory tile layout, the same reduction order (k0 slices, then kk = 0..BK-1 within a slice)
and the same per-thread micro-tile and epilogue, for every block and thread at once. Tests compare
it with onnxruntime's Conv, so a tiling or indexing mistake in the kernel design fails here without
a GPU. (Float32 throughout; the GPU's fused multiply-add rounds once where numpy rounds twice.)
"""
from __future__ import annotations

import numpy as np

from .conv_codegen import INDEX, ConvShape, DepthwiseTile, Epilogue, GemmTile


def _eval(table: str, env: dict) -> dict:
    """Evaluate one INDEX table in order; `env` gets every name it defines."""
    scope = {"DIV": np.floor_divide, "MOD": np.mod, "MIN": np.minimum, "WIDE": lambda a: np.asarray(a, dtype=np.int64),
             "__builtins__": {}}
    for name, expr in INDEX[table]:
        env[name] = eval(expr.replace("&&", "&"), scope, env)  # noqa: S307 (our own expressions)
    return env


def activation(act: str, v: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    f = np.float32
    a, b = f(alpha), f(beta)
    with np.errstate(over="ignore"):
        if act == "none":
            return v
        if act == "relu":
            return np.maximum(v, f(0))
        if act == "leakyrelu":
            return np.where(v >= 0, v, a * v)
        if act == "clip":
            return np.minimum(np.maximum(v, a), b)
        if act == "sigmoid":
            return f(1) / (f(1) + np.exp(-v))
        if act == "hardsigmoid":
            return np.maximum(f(0), np.minimum(f(1), a * v + b))
        if act == "hardswish":
            return v * np.maximum(f(0), np.minimum(f(1), a * v + b))
        if act == "tanh":
            return np.tanh(v)
        if act == "silu":
            return v / (f(1) + np.exp(-v))
    raise ValueError(f"unknown activation {act!r}")


def _epilogue(v: np.ndarray, epi: Epilogue, z: np.ndarray | None, dst: np.ndarray) -> np.ndarray:
    v = activation(epi.activation, v, epi.alpha, epi.beta)
    if epi.residual:
        v = v + z[dst]
    if epi.post_relu:
        v = np.maximum(v, np.float32(0))
    return v


def run_gemm(shape: ConvShape, epi: Epilogue, tile: GemmTile, x, w, bias, z=None) -> np.ndarray:
    """The implicit-GEMM kernel over grid (ceil(N*P*Q/BN), ceil(KG/BM), G*SPLITK)."""
    batch = x.shape[0]
    t = tile
    split = t.splitk > 1
    consts = {**shape.constants(), "BM": t.bm, "BN": t.bn, "BK": t.bk, "TM": t.tm, "TN": t.tn,
              "THREADS": t.threads, "NPQ": batch * shape.p * shape.q,
              "SPLITK": t.splitk, "SPS": t.slices_per_split(shape.kred)}
    xf, wf = x.astype(np.float32).reshape(-1), w.astype(np.float32).reshape(-1)
    zf = None if z is None else z.astype(np.float32).reshape(-1)
    yf = np.zeros(batch * shape.k * shape.p * shape.q, np.float32)
    gx, gy, gz = -(-consts["NPQ"] // t.bn), -(-shape.kg // t.bm), shape.group * t.splitk
    # Every block at once: axis 0 enumerates (blockIdx.z, blockIdx.y, blockIdx.x), axis 1 threads.
    bz, by, bx = np.meshgrid(np.arange(gz), np.arange(gy), np.arange(gx), indexing="ij")
    blocks = bx.size
    base = {**consts, "m0": by.reshape(-1, 1) * t.bm, "n0": bx.reshape(-1, 1) * t.bn,
            "tid": np.arange(t.threads).reshape(1, -1)}
    if split:
        base = _eval("split", {**base, "bz": bz.reshape(-1, 1)})
    else:
        base.update(g=bz.reshape(-1, 1), ks=np.zeros((blocks, 1), int), kbeg=np.zeros((blocks, 1), int),
                    kend=np.full((blocks, 1), shape.kred))
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
        As = np.full((blocks, t.bk, t.bm), np.nan, np.float32)  # unwritten shared memory is poison
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
        for kk in range(t.bk):
            av = As[:, kk, :][:, (ty.reshape(-1, 1) + np.arange(t.tm) * (t.bm // t.tm))]  # [blocks, THREADS, TM]
            bv = Bs[:, kk, :][:, (tx.reshape(-1, 1) + np.arange(t.tn) * (t.bn // t.tn))]  # [blocks, THREADS, TN]
            acc[active] += av[active][:, :, :, None] * bv[active][:, :, None, :]
    if split:
        # The cluster of block (g, ks, y, x) is the SPLITK blocks (g, 0..SPLITK-1, y, x); the
        # partial tiles are summed over ranks in order, starting from 0.
        parts = acc.reshape(shape.group, t.splitk, gy * gx, t.threads, t.tm, t.tn)
        total = np.zeros_like(parts[:, 0])
        for rank in range(t.splitk):
            total = total + parts[:, rank]
        acc = np.broadcast_to(total[:, None], parts.shape).reshape(acc.shape)
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
    return run_gemm(shape, epi, tile, x, w, bias, z)
