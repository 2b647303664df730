"""A numpy execution of the SqueezeExcite CUDA kernel, phase by phase and lane by lane.

It runs what the generated source runs (squeeze_excite_codegen.py): the same index arithmetic
(the INDEX expressions, evaluated on integer arrays), the same guarded strided reads of the flat
buffers, the same float32 sums per lane in the same order (lanes as a numpy axis of 32) and the
same butterfly over the warp, the same division for the means and the activation programs
evaluated by Program.evaluate. The kernel's products are not contracted into FMAs, so the model's
bits are the kernel's except where expf / tanhf round differently from numpy's exp / tanh.
"""
from __future__ import annotations

import numpy as np

from .squeeze_excite_codegen import INDEX, SqueezeExciteSpec, activation_program
from .kernel_model import guarded_load

F = np.float32
LANES = 32


def _eval(table: str, env: dict) -> dict:
    scope = {"WIDE": lambda a: np.asarray(a, np.int64), "DIV": np.floor_divide, "__builtins__": {}}
    for name, expr in INDEX[table]:
        env[name] = eval(expr, scope, env)  # noqa: S307 (our own expressions)
    return env


def _lane_sums(values: np.ndarray) -> np.ndarray:
    """values [rows, steps, 32] (zeros where a lane has nothing): each lane's sum from +0 in step
    order, then the butterfly (__shfl_xor_sync, offsets 16..1); lane 0's result per row. A +0
    added to a sum that started at +0 changes no bit, so the padding is harmless."""
    acc = np.zeros((values.shape[0], LANES), F)
    with np.errstate(all="ignore"):
        for step in range(values.shape[1]):
            acc = (acc + values[:, step, :]).astype(F)
        lanes = np.arange(LANES)
        for o in (16, 8, 4, 2, 1):
            acc = (acc + acc[:, lanes ^ o]).astype(F)
    return acc[:, 0]


def _steps(count: int) -> int:
    return max(1, -(-count // LANES))


def run(spec: SqueezeExciteSpec, x, w1, b1, w2, b2) -> np.ndarray:
    """The kernel's Y for X [N, C, H, W] and the block's weights."""
    C, R = spec.c, spec.r
    x = np.ascontiguousarray(x, F)
    if x.ndim != 4 or x.shape[1] != C:
        raise ValueError(f"X {x.shape} is not [N, {C}, H, W]")
    batch, hw = x.shape[0], x.shape[2] * x.shape[3]
    xf = x.ravel()
    w1f, b1f = np.ascontiguousarray(w1, F).ravel(), np.ascontiguousarray(b1, F).ravel()
    w2f, b2f = np.ascontiguousarray(w2, F).ravel(), np.ascontiguousarray(b2, F).ravel()
    act_in, act_h, act_g = (activation_program(a) for a in (spec.input_act, spec.hidden, spec.gate))
    y = np.full(xf.size, np.nan, F)  # every element must be written
    lane = np.arange(LANES)
    consts = spec.constants()
    for n in range(batch):
        env = _eval("image", {**consts, "n": n, "hw": hw})
        # 1. squeeze: channels as rows, j = lane + 32 * step
        j = (np.arange(_steps(hw))[:, None] * LANES + lane)[None]
        sq = _eval("squeeze", {**env, "c": np.arange(C)[:, None, None], "j": j})
        ok = np.broadcast_to(j < hw, (C, *j.shape[1:]))
        a = act_in.evaluate(guarded_load(xf, sq["x_src"], ok))[0]
        with np.errstate(all="ignore"):
            means = (_lane_sums(np.where(ok, a, F(0))) / F(hw)).astype(F)
        # 2. hidden: rows r, k = lane + 32 * step over C
        k = (np.arange(_steps(C))[:, None] * LANES + lane)[None]
        hd = _eval("hidden", {**env, "r": np.arange(R)[:, None, None], "k": k})
        okc = np.broadcast_to(k < C, (R, *k.shape[1:]))
        with np.errstate(all="ignore"):
            prods = (guarded_load(w1f, hd["w1_src"], okc) * guarded_load(means, k, okc)).astype(F)
            hidden = act_h.evaluate((_lane_sums(np.where(okc, prods, F(0))) + b1f).astype(F))[0]
        # 3. gates: rows c, k over R
        k = (np.arange(_steps(R))[:, None] * LANES + lane)[None]
        gt = _eval("gate", {**env, "c": np.arange(C)[:, None, None], "k": k})
        okr = np.broadcast_to(k < R, (C, *k.shape[1:]))
        with np.errstate(all="ignore"):
            prods = (guarded_load(w2f, gt["w2_src"], okr) * guarded_load(hidden, k, okr)).astype(F)
            gates = act_g.evaluate((_lane_sums(np.where(okr, prods, F(0))) + b2f).astype(F))[0]
        # 4. excite over the image's flat elements
        e = np.arange(C * hw, dtype=np.int64)
        ex = _eval("store", _eval("excite", {**env, "e": e}))
        with np.errstate(all="ignore"):
            y[ex["e_dst"]] = (act_in.evaluate(guarded_load(xf, ex["e_dst"], True))[0] * gates[ex["ec"]]).astype(F)
    return y.reshape(x.shape)
