"""onnxfuse.ChannelShuffle: ShuffleNet's Concat -> channel shuffle -> Split as one plane copy.

contract   attribute `groups`; inputs X_1.. (float32 [N, C_i, H, W], concatenated along the
           channels), outputs Y_1.. (equal pieces of the shuffled channels)
model      reference below: concat, [N, g, C/g, H, W] -> transpose(0 2 1 3 4), equal split
kernels    kernels/channel_shuffle_cpu.cc; kernels/cuda_channel_shuffle.cc launching
           onnxfuse/cuda/shuffle_codegen.py's kernel
pass       channel-shuffle (passes/channel_shuffle.py)
pays       always where it matches: five kernels and three copies become one copy; a Concat of
           more than MAX_CONCAT_INPUTS inputs stays outside (bench/results/shufflenet.md)
"""
from __future__ import annotations

import numpy as np

from .contract import CPU, CUDA, Attribute, FusedOp, Port

# A Concat that onnxruntime runs in its blocked NCHWc layout (of convolution outputs) is reordered
# out of it once; the fused node reads plain NCHW, so each input gets its own reorder. Up to three
# inputs that still saves kernels (the Concat, two Reshapes and the Transpose go); beyond, the
# Concat stays and the node reads its output.
MAX_CONCAT_INPUTS = 3


def reference(inputs: list[np.ndarray], attrs: dict, n_outputs: int) -> list[np.ndarray]:
    groups = int(attrs["groups"])
    x = np.concatenate(inputs, axis=1)
    n, c, h, w = x.shape
    shuffled = x.reshape(n, groups, c // groups, h, w).transpose(0, 2, 1, 3, 4).reshape(n, c, h, w)
    return list(np.split(shuffled, n_outputs, axis=1))


def form(a: dict, n_inputs: int, n_outputs: int) -> str:
    from .contract import text

    channels = text(a.get("cuda_channels", "")) or "?"
    return f"g={int(a.get('groups', 0))}, channels {channels.replace(',', '+')}, {n_outputs} out"


OP = FusedOp(
    "ChannelShuffle", "Concat -> Reshape -> Transpose -> Reshape -> Split as one plane copy",
    kernels={CPU: "kernels/channel_shuffle_cpu.cc", CUDA: "kernels/cuda_channel_shuffle.cc"},
    inputs=(Port("x", "X_1, X_2, ...: float32 [N, C_i, H, W], concatenated along the channels", variadic=True),),
    outputs=(Port("y", "Y_1, Y_2, ...: equal channel pieces of the shuffled tensor", variadic=True),),
    attributes=(Attribute("groups", "int", "g: the channels are read as [g, C/g] and written as [C/g, g]"),),
    pass_name="channel-shuffle",
    cuda_generator="onnxfuse.cuda.shuffle_codegen",
    reference=reference,
    form=form,
)
