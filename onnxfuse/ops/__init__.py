"""The fused ops onnxfuse writes, as one data-only table.

Every other list of fused ops derives from this one: runtime (which ops bind a CUDA kernel that
needs a compiled kernel on the node), the CUDA audit, the docs. tests/test_ops_table.py holds it
against what the native library actually registers (OnnxfuseLibraryInfo's "ops"), so the Python
side and the kernels cannot disagree.

Each op's pass, numpy model and kernels live in their own modules today; this table is the one
place that says which ops exist and where each has a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

# onnxruntime's names for the providers a custom op registers on.
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


@dataclass(frozen=True)
class FusedOp:
    name: str
    summary: str
    # Providers the native library registers a kernel on. Where none is registered the node runs
    # its model-local fallback function (always correct, never faster than the original).
    providers: frozenset[str]

    @property
    def cuda_kernel(self) -> bool:
        # A CUDA kernel of ours launches the kernel compiled and stored with the node
        # (--target cuda); a node without one must run its fallback function instead.
        return CUDA in self.providers


FUSED_OPS: tuple[FusedOp, ...] = (
    FusedOp("Pointwise", "a region of elementwise ops as one expression program", frozenset({CPU, CUDA})),
    FusedOp("ConvBiasAct", "Conv + bias + activation (+ residual) on CUDA; onnxruntime fuses it on the CPU",
            frozenset({CUDA})),
    FusedOp("Attention", "softmax(Q K^T * scale + bias) V, with masks, scale forms and head layouts",
            frozenset({CPU, CUDA})),
    FusedOp("ChannelShuffle", "Concat -> Reshape -> Transpose -> Reshape -> Split as one plane copy",
            frozenset({CPU, CUDA})),
    FusedOp("SqueezeExcite", "global pool, two 1x1 convs with activations, gate, scale", frozenset({CPU, CUDA})),
    FusedOp("StackedMLP", "K small MLPs on one input as one batched kernel", frozenset({CPU})),
)

BY_NAME = {op.name: op for op in FUSED_OPS}
CUDA_KERNELS = frozenset(op.name for op in FUSED_OPS if op.cuda_kernel)
