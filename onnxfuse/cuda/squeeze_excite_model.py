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


def _warp_rows(table: str, row: str, rows: int, width: int, weight_src: str, env: dict, lane, w, vec, bias, act):
    """act(W vec + bias), a warp per row as the kernel's phases 2 and 3 compute it: lane + 32 * step
    walks the `width` columns, each lane sums its products in step order, then the butterfly."""
    k = (np.arange(_steps(width))[:, None] * LANES + lane)[None]
    ix = _eval(table, {**env, row: np.arange(rows)[:, None, None], "k": k})
    ok = np.broadcast_to(k < width, (rows, *k.shape[1:]))
    with np.errstate(all="ignore"):
        prods = (guarded_load(w, ix[weight_src], ok) * guarded_load(vec, k, ok)).astype(F)
        return act.evaluate((_lane_sums(np.where(ok, prods, F(0))) + bias).astype(F))[0]


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
        # 2. hidden: rows r over R, k = lane + 32 * step over C; 3. gates: rows c over C, k over R
        hidden = _warp_rows("hidden", "r", R, C, "w1_src", env, lane, w1f, means, b1f, act_h)
        gates = _warp_rows("gate", "c", C, R, "w2_src", env, lane, w2f, hidden, b2f, act_g)
        # 4. excite over the image's flat elements
        e = np.arange(C * hw, dtype=np.int64)
        ex = _eval("store", _eval("excite", {**env, "e": e}))
        with np.errstate(all="ignore"):
            y[ex["e_dst"]] = (act_in.evaluate(guarded_load(xf, ex["e_dst"], True))[0] * gates[ex["ec"]]).astype(F)
    return y.reshape(x.shape)
