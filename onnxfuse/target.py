"""What the optimized model will run on, as one object the passes ask.

A pass never compares a target name: it asks what the target's kernels can do (which fused ops
have a kernel there, which of onnxruntime's kernels exist there for float32), so that adding a
target, or a kernel to one, changes this module and the ops table, not the passes.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ops
from .ops.contract import PROVIDER_OF_TARGET

_PROVIDERS = PROVIDER_OF_TARGET
NAMES = tuple(_PROVIDERS)


@dataclass(frozen=True)
class Target:
    name: str  # one of NAMES: what --target takes
    arch: str | None = None  # CUDA architecture (sm_NN) for kernels compiled for this target

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"unknown target '{self.name}' (known: {', '.join(NAMES)})")

    def __str__(self) -> str:
        return self.name if self.arch is None else f"{self.name} ({self.arch})"

    @property
    def provider(self) -> str:
        """The onnxruntime execution provider the model's kernels run on."""
        return _PROVIDERS[self.name]

    def has_kernel(self, fused_op: str) -> bool:
        """Whether onnxfuse's library runs `fused_op` with a kernel of its own on this target
        (elsewhere the node runs its fallback function, which gains nothing)."""
        op = ops.BY_NAME.get(fused_op)
        return op is not None and self.provider in op.providers

    @property
    def compiles_kernels(self) -> bool:
        """Fused nodes carry a kernel compiled for this target (cuda-compile), with `arch`."""
        return self.provider == ops.CUDA

    @property
    def attention_causal_mode(self) -> bool:
        """Our Attention kernel can skip the keys a causal mask hides (the CPU kernel has a causal
        mode; the CUDA kernel takes the mask as an input)."""
        return self.provider == ops.CPU

    @property
    def attention_measured_faster_always(self) -> bool:
        """Our Attention kernel beats onnxruntime's chain at any key length (CUDA); on the CPU it
        does up to the key bounds measured in passes/attention.py."""
        return self.provider == ops.CUDA

    @property
    def float32_group_query_attention(self) -> bool:
        """onnxruntime's GroupQueryAttention has a float32 kernel here (its CUDA kernel takes
        float16 and bfloat16 only)."""
        return self.provider == ops.CPU

    @property
    def gemm_bias_in_epilogue(self) -> bool:
        """The provider's Gemm adds its bias in the matrix product's epilogue (cuBLAS), so a Gemm
        with a bias is one kernel where MatMul + Add would be two."""
        return self.provider == ops.CUDA

    @property
    def measured(self) -> bool:
        """The rewrites' gains were measured on this target's hardware (the CPU). On CUDA, which
        the test machines lack, a rewrite not yet timed on a GPU is opt-in (its pass option) or
        left out."""
        return self.provider == ops.CPU

    @property
    def launch_bound(self) -> bool:
        """A kernel launch costs more than the arithmetic a merge adds (a GPU at these sizes): a
        rewrite that removes kernels pays whatever the batch."""
        return self.provider == ops.CUDA


CPU = Target("cpu")


def as_target(value: str | Target, arch: str | None = None) -> Target:
    return value if isinstance(value, Target) else Target(value, arch)
