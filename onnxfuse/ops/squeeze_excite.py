"""onnxfuse.SqueezeExcite: a squeeze-and-excitation block as one node.

contract   inputs X [N, C, H, W], W1 [R, C, 1, 1], B1 [R], W2 [C, R, 1, 1], B2 [C] (float32);
           output Y = x * gate(W2 hidden(W1 mean_hw(x) + B1) + B2), x = X or SiLU(X)
           (input_activation); activations by their program names with (alpha, beta)
model      reference below
kernels    kernels/squeeze_excite_cpu.cc; kernels/cuda_squeeze_excite.cc launching
           onnxfuse/cuda/squeeze_excite_codegen.py's kernel
pass       squeeze-excite (passes/squeeze_excite.py)
pays       on the CPU where H * W is known and at most MAX_MAP, and, for a block
           with no input activation, C * R under MAX_WEIGHTS_WITHOUT_INPUT_ACTIVATION; on CUDA opt-in
           until timed on a GPU
           (option squeeze_excite_cuda)
"""
from __future__ import annotations

import numpy as np

from .contract import CPU, CUDA, Attribute, FusedOp, Port, activation, activation_attributes, text

# The largest H * W the node replaces the block at (the 64x64 corpus CNNs' largest, 32x32): in
# whole models at 224x224 (bench/results/cnn224.md) the blocks on 56x56 and 112x112 maps are
# slower as the node than as onnxruntime's kernels, those on 28x28 and smaller faster.
# A symbolic H or W may be any size, so the block stays as it is there.
MAX_MAP = 32 * 32
# The most weights (C * R, each of the two convolutions) the node replaces a block without an input
# activation at. Such a block saves no pass over x, and in whole models its node ran slower than
# onnxruntime's kernels where its weights are large (thread CPU time, 1 thread, interleaved, ratio
# to onnxruntime alone; every block fused / those of C * R >= 20,000 left): mobilenet_v3_small_ts,
# with blocks C=288 R=72 and C=576 R=144 on 2x2 maps, 1.080 / 0.964; its dynamo export 1.060 /
# 0.944; at 224x224 (the same blocks on 7x7 maps) 1.018 / 0.994. The bundled mobilenetv3, whose
# blocks are C=240 R=64 at most, reads 0.88 with every block fused. A block that takes the SiLU
# before it saves that pass (efficientnet_b0_ts 0.935 with every block fused).
MAX_WEIGHTS_WITHOUT_INPUT_ACTIVATION = 20_000

ACTIVATIONS = ("input", "hidden", "gate")


def reference(inputs: list[np.ndarray], attrs: dict, n_outputs: int) -> list[np.ndarray]:
    x, w1, b1, w2, b2 = (np.asarray(v, np.float32) for v in inputs)

    def act(which: str, v):
        name = text(attrs.get(f"{which}_activation", "none"))
        return activation(v, name, float(attrs.get(f"{which}_alpha", 0.0)), float(attrs.get(f"{which}_beta", 0.0)))

    x = act("input", x)
    mean = x.astype(np.float64).mean(axis=(2, 3))  # [N, C]
    hidden = act("hidden", (mean @ w1[:, :, 0, 0].astype(np.float64).T + b1).astype(np.float32))
    gate = act("gate", (hidden.astype(np.float64) @ w2[:, :, 0, 0].astype(np.float64).T + b2).astype(np.float32))
    return [(x * gate[:, :, None, None]).astype(np.float32)]


def form(a: dict, n_inputs: int, n_outputs: int) -> str:
    """Channels C and R (when cuda-compile stored them) and the activations, with their
    parameters where they have any."""
    parts = [f"C={int(a['cuda_c'])} R={int(a['cuda_r'])}"] if "cuda_c" in a and "cuda_r" in a else []
    if text(a.get("input_activation", "none")) != "none":
        parts.append(f"input {text(a['input_activation'])}")
    for which in ("hidden", "gate"):
        act = text(a.get(f"{which}_activation", "none"))
        params = [float(a.get(f"{which}_{p}", 0.0)) for p in ("alpha", "beta")]
        parts.append(f"{which} {act}" + (f"({params[0]:.4g}, {params[1]:.4g})" if any(params) else ""))
    return " ".join(parts)


OP = FusedOp(
    "SqueezeExcite", "global pool, two 1x1 convs with activations, gate, scale",
    kernels={CPU: "kernels/squeeze_excite_cpu.cc", CUDA: "kernels/cuda_squeeze_excite.cc"},
    # X [N, C, H, W], W1 [R, C, 1, 1], B1 [R], W2 [C, R, 1, 1], B2 [C]: registered as five or more
    # float32 inputs (the kernels check the count and shapes when a session creates them).
    inputs=(Port("inputs", "X, W1, B1, W2, B2", variadic=True, min_arity=5),),
    outputs=(Port("Y", "[N, C, H, W]"),),
    attributes=(
        Attribute("input_activation", "string", "none or silu: applied to X before the block"),
        *activation_attributes("hidden_activation", "hidden", "after the first 1x1 convolution"),
        *activation_attributes("gate_activation", "gate", "sigmoid or hardsigmoid, after the second"),
    ),
    pass_name="squeeze-excite",
    cuda_generator="onnxfuse.cuda.squeeze_excite_codegen",
    reference=reference,
    form=form,
)
