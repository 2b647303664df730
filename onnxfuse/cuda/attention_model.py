"""A numpy execution of the Attention CUDA kernel, block by block and warp by warp.

It runs what the generated source runs: the same index arithmetic (the INDEX expressions of
attention_codegen, evaluated on integers and integer arrays), the same flat buffers and strided
reads (packed qkv read in place), the same zero-filled key/value tiles and guards, and the same
online-softmax steps per tile (lanes as a numpy axis of 32; warp reductions as whole-axis max and
sum). Tests compare it with a direct attention in float64, so an indexing, tiling or softmax
mistake in the kernel design fails without a GPU. (Float32 throughout; summation order of the
warp sums and expf's last bit differ from the GPU.)
"""
from __future__ import annotations

import numpy as np

from .attention_codegen import INDEX, AttentionSpec
from .kernel_model import guarded_load

F = np.float32


def _eval(table: str, env: dict) -> dict:
    scope = {"DIV": np.floor_divide, "MOD": np.mod, "SEL": lambda c, a, b: a if c else b, "__builtins__": {}}
    for name, expr in INDEX[table]:
        env[name] = eval(expr, scope, env)  # noqa: S307 (our own expressions)
    return env


def mask_strides(mask_shape: tuple[int, ...], target: tuple[int, int, int, int], merged: bool = False) -> list[int]:
    """Element strides of a contiguous mask over [B, H, Sq, Sk], 0 where it broadcasts (as
    kernels/cuda_attention.cc computes them). merged: the mask is rank <= 3, broadcast to
    [B*H, Sq, Sk], whose first axis holds (b, h) as b * H + h: h's stride is that axis's, b's H
    times it (0 and 0 where it broadcasts)."""
    if merged:
        if len(mask_shape) > 3:
            raise ValueError("merged mask rank > 3")
        b, h, sq, sk = target
        inner = mask_strides(mask_shape, (1, b * h, sq, sk))
        return [inner[1] * h, inner[1], inner[2], inner[3]]
    if len(mask_shape) > 4:
        raise ValueError("mask rank > 4")
    dims = [1] * (4 - len(mask_shape)) + list(mask_shape)
    strides = [0] * 4
    running = 1
    for i in range(3, -1, -1):
        if dims[i] != 1 and dims[i] != target[i]:
            raise ValueError(f"mask {mask_shape} does not broadcast to {target}")
        strides[i] = running if dims[i] != 1 else 0
        running *= dims[i]
    return strides


def _rows(spec: AttentionSpec, t: np.ndarray, bit: int) -> tuple[int, int]:
    """(B, S) of an operand: [B, S, H*d], [B, H, S, d] when its heads_first bit is set, or
    [B*H, S, d] when its heads_merged bit is."""
    if spec.heads_merged >> bit & 1:
        if t.ndim != 3 or t.shape[0] % spec.heads:
            raise ValueError(f"a merged operand {t.shape} is not [B*{spec.heads}, S, d]")
        return t.shape[0] // spec.heads, t.shape[1]
    if spec.heads_first >> bit & 1:
        return t.shape[0], t.shape[2]
    return t.shape[0], t.shape[1]


def run(spec: AttentionSpec, q, k=None, v=None, mask=None, bias=None, cond=None) -> np.ndarray:
    """The kernel's output for q, k, v (or packed qkv as `q`), an optional mask and (packed) bias
    and, with fill_mode, the fill condition; an operand whose heads_first bit is set is
    [B, H, S, d], whose heads_merged bit is set [B*H, S, d]."""
    c = spec.constants()
    q = np.ascontiguousarray(q, F)
    if spec.packed:
        k = v = q
    k = np.ascontiguousarray(k, F)
    v = np.ascontiguousarray(v, F)
    (batch, sq), (_, sk) = _rows(spec, q, 0), _rows(spec, k, 1)
    out = np.full(batch * sq * spec.heads * spec.dv, np.nan, F)  # every element must be written
    qf, kf, vf = q.ravel(), k.ravel(), v.ravel()
    if spec.has_mask:
        m_arr = np.ascontiguousarray(mask, F)
        ms = mask_strides(m_arr.shape, (batch, spec.heads, sq, sk), spec.mask_merged)
        mf = m_arr.ravel()
    else:
        ms, mf = [0, 0, 0, 0], None
    bf = np.ascontiguousarray(bias, F).ravel() if spec.has_bias else None
    if spec.fill_mode:
        c_arr = np.ascontiguousarray(cond, F)
        cs, cf = mask_strides(c_arr.shape, (batch, spec.heads, sq, sk)), c_arr.ravel()
    else:
        cs, cf = [0, 0, 0, 0], None

    def biased(values, index, ok):  # the kernel's load, plus bias[index] where HAS_BIAS
        if bf is None:
            return values
        return np.where(ok, (values + guarded_load(bf, index, ok)).astype(F), values)
    grid = batch * spec.heads * (-(-sq // c["ROWS"]))
    lanes = np.arange(32)
    env0 = {**c, "sq": sq, "sk": sk, "ms0": ms[0], "ms1": ms[1], "ms2": ms[2], "ms3": ms[3],
            "cs0": cs[0], "cs1": cs[1], "cs2": cs[2], "cs3": cs[3]}
    tile, dv = c["TILE"], c["DV"]
    cols = lanes[:, None] + 32 * np.arange(c["DVL"])[None, :]  # [lane, c]
    col_ok = cols < dv
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for bid in range(grid):
            warps = []
            for warp in range(c["ROWS"]):
                env = _eval("block", {**env0, "bid": bid, "warp": warp})
                env["d"] = np.arange(c["DH"])
                _eval("q_load", env)
                q_ok = np.full(c["DH"], env["row_ok"])
                qs = biased(guarded_load(qf, env["q_src"], q_ok), env["qb_src"], q_ok)
                warps.append((env, qs, F(-np.inf), F(0), np.zeros((32, c["DVL"]), F)))
            for t0 in range(0, sk, tile):
                e = np.arange(tile * c["DH"])
                ke = _eval("k_load", {**warps[0][0], "e": e, "t0": t0})
                ks = np.zeros(tile * c["KS"], F)
                ks[ke["k_dst"]] = biased(guarded_load(kf, ke["k_src"], ke["k_ok"]), ke["kb_src"], ke["k_ok"])
                e = np.arange(tile * dv)
                ve = _eval("v_load", {**warps[0][0], "e": e, "t0": t0})
                vs = np.zeros(tile * dv, F)
                vs[ve["v_dst"]] = biased(guarded_load(vf, ve["v_src"], ve["v_ok"]), ve["vb_src"], ve["v_ok"])
                n_valid = min(sk - t0, tile)
                for w, (env, qs, m, l, acc) in enumerate(warps):
                    if not env["row_ok"]:
                        continue
                    valid = lanes < n_valid
                    rows = np.where(valid, lanes, 0)
                    dot = np.zeros(32, F)
                    for d in range(c["DH"]):  # sequential fmaf over d
                        dot = (qs[d].astype(np.float64) * ks[rows * c["KS"] + d] + dot).astype(F)
                    score = np.where(valid, dot * F(spec.scale), F(-np.inf)).astype(F)
                    if spec.has_mask:
                        me = _eval("mask", {**env, "t0": t0, "lane": lanes})
                        score = np.where(valid, score + guarded_load(mf, me["m_src"], valid), score).astype(F)
                    if spec.fill_mode:  # NaN conditions are nonzero (c != 0 is true, c == 0 false)
                        ce = _eval("fill", {**env, "t0": t0, "lane": lanes})
                        cv = guarded_load(cf, ce["c_src"], valid)
                        hit = (cv != 0) if spec.fill_mode == 1 else (cv == 0)
                        score = np.where(valid & hit, F(spec.fill_value), score).astype(F)
                    finite = score[~np.isnan(score)]
                    tile_max = finite.max() if finite.size else F(np.nan)  # fmaxf ignores NaN
                    m_new = F(np.fmax(m, tile_max))
                    if m_new == -np.inf and not np.isnan(score).any():
                        continue  # a NaN score is not skipped: it makes l and acc NaN
                    corr = F(np.exp(m - m_new))
                    p = np.exp(score - m_new).astype(F)
                    l = F(l * corr + p.sum(dtype=F))
                    acc = (acc * corr).astype(F)
                    for j in range(n_valid):
                        vrow = vs[j * dv + np.where(col_ok, cols, 0)]
                        upd = (F(p[j]).astype(np.float64) * vrow + acc).astype(F)
                        acc = np.where(col_ok, upd, acc)
                    warps[w] = (env, qs, F(m_new), l, acc)
            for env, qs, m, l, acc in warps:
                if not env["row_ok"]:
                    continue
                st = _eval("store", {**env, "col": cols[col_ok]})
                row = (acc[col_ok] / l).astype(F) if sk > 0 else np.zeros(int(col_ok.sum()), F)
                if spec.nan_to_zero and sk > 0 and not l > 0:  # NaN probabilities: sum_t 0 * v[t]
                    row = np.zeros_like(row)
                    for t in range(sk):
                        ze = _eval("zero_row", {**env, "t": t, "col": cols[col_ok]})
                        ok = np.ones(row.shape, bool)
                        row = (row + F(0) * biased(guarded_load(vf, ze["z_src"], ok), ze["zb_src"], ok)).astype(F)
                out[st["o_dst"]] = row
    return out.reshape(batch, sq, spec.heads * spec.dv)


def reference(spec: AttentionSpec, q, k=None, v=None, mask=None, bias=None, cond=None) -> np.ndarray:
    """Direct attention in float64: softmax(scale * q.k^T + mask) . v per head (packed qkv: plus
    the bias on its columns first; nan_to_zero: NaN probabilities read as 0, as Where(IsNaN(p), 0, p)
    gives them; heads_first operands [B, H, S, d], heads_merged ones [B*H, S, d]; a merged mask
    broadcast to [B*H, Sq, Sk]; fill_mode: the masked scores replaced where the condition is
    nonzero (1) or zero (2))."""
    q = np.asarray(q, np.float64)
    d = spec.heads * spec.dh
    if spec.has_bias:
        q = q + np.asarray(bias, np.float64)
    if spec.packed:
        q, k, v = q[..., :d], q[..., d:2 * d], q[..., 2 * d:]
    h = spec.heads

    def heads(t, bit, d):  # -> [B, H, S, d]
        t = np.asarray(t, np.float64)
        if spec.heads_merged >> bit & 1:
            return t.reshape(t.shape[0] // h, h, *t.shape[1:])
        if spec.heads_first >> bit & 1:
            return t
        return t.reshape(t.shape[0], t.shape[1], h, d).transpose(0, 2, 1, 3)
    qh, kh, vh = heads(q, 0, spec.dh), heads(k, 1, spec.dh), heads(v, 2, spec.dv)
    batch, sq, sk = qh.shape[0], qh.shape[2], kh.shape[2]
    scores = spec.scale * (qh @ kh.transpose(0, 1, 3, 2))
    if spec.has_mask:
        m = np.asarray(mask, np.float64)
        if spec.mask_merged:
            m = np.broadcast_to(m, (batch * h, sq, sk)).reshape(batch, h, sq, sk)
        scores = scores + m
    if spec.fill_mode:
        c = np.asarray(cond, np.float32)
        with np.errstate(invalid="ignore"):
            hit = c != 0 if spec.fill_mode == 1 else c == 0
        scores = np.where(hit, np.float64(np.float32(spec.fill_value)), scores)
    if sk == 0:
        return np.zeros((batch, sq, h * spec.dv), np.float64)
    with np.errstate(invalid="ignore"):
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = e / e.sum(axis=-1, keepdims=True)
        if spec.nan_to_zero:
            probs = np.where(np.isnan(probs), 0.0, probs)
    return (probs @ vh).transpose(0, 2, 1, 3).reshape(batch, sq, h * spec.dv)
