"""onnxfuse.StackedMLP: K small MLPs on one input (an ensemble) as one batched kernel.

contract   inputs X [B, D_0] float32, then per layer l: W_l packed in PANEL-column panels
           [K, ceil(D_l / PANEL), D_{l-1}, PANEL] (zero-padded, pack_panels) and b_l [K, D_l]
           or [K, 1, D_l]; attribute `activations`, one program instruction per layer (none,
           relu, leakyrelu[0.01]...); output Y [B, K * D_L], member k in columns k * D_L...
model      reference below
kernels    kernels/stacked_mlp_cpu.cc (CPU only: on CUDA the stacked standard ops are batched
           GEMMs already)
pass       batch-ensemble (passes/ensemble_batch.py), which writes the stacked form and, where
           this op has a kernel and it pays, this node around it
pays       up to MAX_BATCH rows at one thread (bench/results/stacked_mlp.md); a symbolic batch is
           read as declared (optimize --dim) and as 1 otherwise
"""
from __future__ import annotations

import numpy as np

from .contract import CPU, Attribute, FusedOp, Port, text

PANEL = 16  # kernels/stacked_mlp_cpu.cc: kPanel
MAX_BATCH = 64


def pack_panels(w: np.ndarray) -> np.ndarray:
    """[K, D_in, D_out] -> [K, ceil(D_out / 16), D_in, 16]: 16-column panels, zero-padded."""
    k, d_in, d_out = w.shape
    panels = -(-d_out // PANEL)
    padded = np.zeros((k, d_in, panels * PANEL), w.dtype)
    padded[:, :, :d_out] = w
    return np.ascontiguousarray(padded.reshape(k, d_in, panels, PANEL).transpose(0, 2, 1, 3))


def unpack_panels(packed: np.ndarray, d_out: int) -> np.ndarray:
    """pack_panels' inverse: [K, panels, D_in, 16] -> [K, D_in, D_out]."""
    k, panels, d_in, _ = packed.shape
    return packed.transpose(0, 2, 1, 3).reshape(k, d_in, panels * PANEL)[:, :, :d_out]


def _instruction(v: np.ndarray, instr: str) -> np.ndarray:
    from ..program import Program

    if instr == "none":
        return v
    return Program.parse(f"in x0 f32\nt0 = {instr} x0\nout t0 f32\n").evaluate(v)[0]


def reference(inputs: list[np.ndarray], attrs: dict, n_outputs: int) -> list[np.ndarray]:
    x = np.asarray(inputs[0], np.float32)
    acts = text(attrs["activations"]).split(",")
    k = inputs[1].shape[0]
    cur = np.broadcast_to(x, (k, *x.shape))
    for layer, act in enumerate(acts):
        b = np.asarray(inputs[2 + 2 * layer], np.float32).reshape(k, -1)
        w = unpack_panels(np.asarray(inputs[1 + 2 * layer], np.float32), b.shape[1])
        cur = _instruction((cur.astype(np.float64) @ w + b[:, None, :]).astype(np.float32), act)
    return [np.concatenate(list(cur), axis=1)]


def form(a: dict, n_inputs: int, n_outputs: int) -> str:
    return f"activations {text(a.get('activations', ''))}"


OP = FusedOp(
    "StackedMLP", "K small MLPs on one input as one batched kernel",
    kernels={CPU: "kernels/stacked_mlp_cpu.cc"},
    inputs=(Port("inputs", "X, then W_l (packed) and b_l per layer", variadic=True, min_arity=3),),
    outputs=(Port("Y", "[B, K * D_L]: the members' outputs side by side"),),
    attributes=(Attribute("activations", "string", "one program instruction per layer, comma-separated"),),
    pass_name="batch-ensemble",
    reference=reference,
    form=form,
)
