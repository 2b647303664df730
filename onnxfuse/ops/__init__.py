"""The fused ops onnxfuse writes: one module each, and the one table built from them.

A fused op's module (pointwise.py, attention.py, ...) holds its contract (onnxfuse/ops/contract.py:
name, domain and op set, attributes, inputs and outputs), its numpy model, where its CPU and CUDA
kernels and its CUDA generator live, and the figures that decide when it pays, which its pass
reads. The table at the bottom is data built from the modules; every other list derives from
it: runtime (which ops bind a CUDA kernel that needs a compiled kernel on the node), target
(which ops have a kernel where), the CUDA audit (each op's form), cuda-compile (the generators)
and the C++ header kernels/fused_ops.h (names and signatures the kernels register, written by
`python -m onnxfuse.ops.header`). tests/test_ops_table.py holds the table against the header,
the kernels' sources and what the built library registers (OnnxfuseLibraryInfo's "ops").

Adding a fused op: a new module here with its OP, a line in the table, and its kernel source.
"""
from __future__ import annotations

from . import attention, attention_nan_guard, channel_shuffle, conv_bias_act, pointwise, squeeze_excite, stacked_mlp
from .contract import CPU, CUDA, Attribute, FusedOp, Port

__all__ = ["CPU", "CUDA", "Attribute", "FusedOp", "Port", "FUSED_OPS", "BY_NAME", "CUDA_KERNELS"]

FUSED_OPS: tuple[FusedOp, ...] = (
    pointwise.OP,
    conv_bias_act.OP,
    attention.OP,
    channel_shuffle.OP,
    squeeze_excite.OP,
    stacked_mlp.OP,
    attention_nan_guard.OP,
)

BY_NAME = {op.name: op for op in FUSED_OPS}
CUDA_KERNELS = frozenset(op.name for op in FUSED_OPS if op.cuda_kernel)
