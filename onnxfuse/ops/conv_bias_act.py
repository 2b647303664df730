"""onnxfuse.ConvBiasAct: a 2-D convolution with its bias, activation, residual and Relu.

contract   inputs X [N, C, H, W], W [K, C/group, R, S], B [K], optional residual Z [N, K, P, Q]
           (float32); output Y = post_relu(activation(conv(X, W) + B) + Z); the Conv's
           attributes (kernel_shape, strides, pads, dilations, group) and the epilogue's
           (activation, activation_alpha, activation_beta, post_relu)
model      reference below (the epilogue as onnxfuse/cuda/conv_plan.py's Epilogue.program)
kernels    CUDA only: kernels/cuda_conv.cc launching onnxfuse/cuda/conv_codegen.py's kernel,
           generated when the pass writes the node. On the CPU onnxruntime fuses the same
           chain on MLAS kernels (FusedConv, NCHWc), which nothing of ours beats
           (bench/results/conv_cpu.md)
pass       conv-bias-act (passes/conv_bias_act.py)
pays       depthwise layers always; others while one thread's serial multiply-adds with the
           heuristic tile stay at most MAX_SERIAL_FMAS (pays_on_cuda)
"""
from __future__ import annotations

import numpy as np

from .contract import CUDA, Attribute, FusedOp, Port, activation_attributes, text

# Where our kernel pays, as the per-layer table against onnxruntime's cuDNN Conv measured it
# (bench/results/conv_cuda_layers.md: H100, batch 1, the default tiles). With those tiles (no
# split-K, CUDA cores: both alternatives are opt-in, see the pass's options, and have no
# per-layer table yet) its time grows with the serial work of one thread, KRED x TM x TN
# multiply-adds with the heuristic tile: the table shows it beating cuDNN on nearly every layer
# below this bound and losing on nearly every layer above it, and depthwise layers (the direct
# kernel) beating it throughout.
MAX_SERIAL_FMAS = 1536


def serial_fmas(shape, batch: int = 1) -> int:
    """Multiply-adds one thread of the GEMM kernel performs in sequence (heuristic tile) for a
    conv_plan.ConvShape."""
    from ..cuda.conv_plan import heuristic_tile

    tile = heuristic_tile(shape, batch)
    return shape.r * shape.s if shape.depthwise else shape.kred * tile.tm * tile.tn


def pays_on_cuda(shape, batch: int = 1) -> bool:
    """True when our kernel is expected to beat onnxruntime's cuDNN Conv on this layer."""
    return shape.depthwise or serial_fmas(shape, batch) <= MAX_SERIAL_FMAS


def conv2d(x: np.ndarray, w: np.ndarray, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group: int = 1):
    """ONNX Conv (NCHW, pads top, left, bottom, right), summed in float64."""
    n, c, h, wd = x.shape
    k, cg, r, s = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    p = (xp.shape[2] - dilations[0] * (r - 1) - 1) // strides[0] + 1
    q = (xp.shape[3] - dilations[1] * (s - 1) - 1) // strides[1] + 1
    kg = k // group
    out = np.zeros((n, k, p, q))
    for g in range(group):
        xs = xp[:, g * cg:(g + 1) * cg]
        ws = w[g * kg:(g + 1) * kg].astype(np.float64)
        for i in range(r):
            for j in range(s):
                win = xs[:, :, i * dilations[0]:i * dilations[0] + strides[0] * (p - 1) + 1:strides[0],
                         j * dilations[1]:j * dilations[1] + strides[1] * (q - 1) + 1:strides[1]]
                out[:, g * kg:(g + 1) * kg] += np.einsum("ncpq,kc->nkpq", win, ws[:, :, i, j])
    return out


def reference(inputs: list[np.ndarray], attrs: dict, n_outputs: int) -> list[np.ndarray]:
    from ..cuda.conv_plan import Epilogue

    x, w, b = (np.asarray(v, np.float32) for v in inputs[:3])
    z = np.asarray(inputs[3], np.float32) if len(inputs) > 3 and inputs[3] is not None else None
    v = conv2d(x, w, attrs.get("strides", (1, 1)), attrs.get("pads", (0, 0, 0, 0)), attrs.get("dilations", (1, 1)),
               int(attrs.get("group", 1)))
    v = (v + b[None, :, None, None]).astype(np.float32)
    epi = Epilogue(text(attrs.get("activation", "none")), float(attrs.get("activation_alpha", 0.0)),
                   float(attrs.get("activation_beta", 0.0)), z is not None, bool(int(attrs.get("post_relu", 0))))
    prog = epi.program()
    if not prog.instrs:
        return [v]
    return [prog.evaluate(v, *([z] if z is not None else []))[0]]


def form(a: dict, n_inputs: int, n_outputs: int) -> str:
    """Kernel kind, window, stride, groups, activation, residual."""
    kh, kw = a.get("kernel_shape", [0, 0])
    stride = a.get("strides", [1, 1])
    group = int(a.get("group", 1))
    parts = [text(a.get("cuda_kind", "?")), f"{kh}x{kw}"]
    if list(stride) != [1, 1]:
        parts.append(f"s{stride[0]}")
    if group > 1:
        parts.append(f"g{group}")
    act = text(a.get("activation", "none"))
    parts.append(act if act else "none")
    if "cuda_residual" in a and int(a["cuda_residual"]):
        parts.append("+residual")
    if int(a.get("post_relu", 0)):
        parts.append("+relu")
    return " ".join(parts)


OP = FusedOp(
    "ConvBiasAct", "Conv + bias + activation (+ residual) on CUDA; onnxruntime fuses it on the CPU",
    kernels={CUDA: "kernels/cuda_conv.cc"},
    inputs=(Port("X", "[N, C, H, W]"), Port("W", "[K, C / group, R, S]"), Port("B", "[K]"),
            Port("Z", "[N, K, P, Q]: the residual", optional=True)),
    outputs=(Port("Y", "[N, K, P, Q]"),),
    attributes=(
        Attribute("kernel_shape", "ints", "[R, S]"),
        Attribute("strides", "ints", "as Conv's"),
        Attribute("pads", "ints", "as Conv's: top, left, bottom, right"),
        Attribute("dilations", "ints", "as Conv's"),
        Attribute("group", "int", "as Conv's"),
        *activation_attributes("activation", "activation", "the epilogue's (conv_plan.ACTIVATIONS)"),
        Attribute("post_relu", "int", "a Relu after the residual", 0),
    ),
    pass_name="conv-bias-act",
    cuda_generator="onnxfuse.cuda.conv_codegen",
    reference=reference,
    form=form,
)
