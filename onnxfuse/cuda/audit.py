"""Every fused node of a `--target cuda` model against the CUDA kernel it carries.

A fused node that reaches a CUDA session without a kernel of its own runs its fallback
function there, op by op, so a cuda-target model may hold only fused ops that cuda-compile
gave a kernel (cuda_entry, cuda_arch, a cubin and its PTX), and ops of other domains only where
onnxruntime's CUDA provider has a kernel for them. `audit` lists, for each fused node, the form
it takes (what its generator specialises on), its kernel, and ptxas's resource report for the
stored PTX assembled for an architecture: registers per thread, spill bytes and static shared
memory, the figures that decide whether a kernel runs as generated.

This module reads models only; it compiles nothing but runs ptxas (CompileError without one).
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from .. import ops
from ..fused import DOMAIN
from .compile import CompileError, PtxasInfo, check_ptx, parse_arch

# com.microsoft ops with a CUDA-provider kernel for float32 (onnxruntime's docs/OperatorKernels.md,
# CUDAExecutionProvider, com.microsoft domain). GroupQueryAttention is not among them: its CUDA
# kernel takes float16 and bfloat16 only, so a float32 one runs on the CPU provider.
CUDA_CONTRIB_FLOAT32 = frozenset({
    "Attention", "BiasAdd", "BiasGelu", "BiasSoftmax", "BiasSplitGelu", "FastGelu", "FusedConv", "FusedMatMul",
    "Gelu", "GroupNorm", "MultiHeadAttention", "QuickGelu", "RelativePositionBias", "RotaryEmbedding",
    "SkipGroupNorm", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "TransposeMatMul",
    "GatedRelativePositionBias", "NhwcConv",
})
# Ops outside the default domain that the CUDA provider runs in the ai.onnx tables although
# onnxruntime declares them in its own schema set.
CUDA_ONNX_DOMAIN_EXTRAS = frozenset({"SimplifiedLayerNormalization", "LayerNormalization"})

# Spill bytes above which a kernel is reported as spilling (ptxas counts stores and loads).
SPILL_NOTE_BYTES = 0


@dataclass
class NodeKernel:
    """One fused node and its kernel as the model stores it."""

    node: str
    op: str
    form: str
    entry: str | None = None
    arch: str | None = None
    ptxas: PtxasInfo | None = None
    problem: str | None = None  # why the node has no usable kernel, None when it has one

    @property
    def ok(self) -> bool:
        return self.problem is None


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def node_form(node: onnx.NodeProto) -> str:
    """What the node's kernel specialises on, as its op's module describes it (onnxfuse/ops)."""
    op = ops.BY_NAME.get(node.op_type)
    if op is None or op.form is None:
        return f"{len(node.input)} in, {len(node.output)} out"
    return op.form(_attrs(node), len(node.input), len(node.output))


def foreign_ops_without_cuda_kernel(model: onnx.ModelProto) -> list[str]:
    """domain.op of the main graph's nodes outside the default and onnxfuse domains that
    onnxruntime's CUDA provider has no float32 kernel for."""
    missing = []
    for n in model.graph.node:
        if n.domain in ("", "ai.onnx", DOMAIN):
            continue
        if n.domain == "com.microsoft" and n.op_type in CUDA_CONTRIB_FLOAT32:
            continue
        if n.op_type in CUDA_ONNX_DOMAIN_EXTRAS:
            continue
        missing.append(f"{n.domain}.{n.op_type}")
    return missing


def audit(model: onnx.ModelProto, arch: str | None = None) -> list[NodeKernel]:
    """Each onnxfuse node of `model` with its form, its kernel, and ptxas's report on the stored
    PTX assembled for `arch` (default: the architecture the cubin was built for). A node without
    a kernel, with a cubin for another architecture, or whose PTX ptxas rejects gets a `problem`.
    Raises CompileError when ptxas is not installed."""
    found: list[NodeKernel] = []
    reports: dict[str, tuple[dict[str, PtxasInfo] | None, str | None]] = {}
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        a = _attrs(node)
        rec = NodeKernel(node.name, node.op_type, node_form(node))
        found.append(rec)
        missing = [k for k in ("cuda_entry", "cuda_arch", "cuda_cubin", "cuda_ptx") if k not in a]
        if missing:
            rec.problem = "no CUDA kernel (" + ", ".join(missing) + " missing)"
            continue
        rec.entry, rec.arch = _text(a["cuda_entry"]), _text(a["cuda_arch"])
        want = parse_arch(arch or rec.arch)[0]
        if arch is not None and rec.arch != want:
            rec.problem = f"cubin is for {rec.arch}, not {want}"
            continue
        if bytes(a["cuda_cubin"])[:4] != b"\x7fELF":
            rec.problem = "cuda_cubin is not an ELF cubin"
            continue
        ptx = _text(a["cuda_ptx"])
        key = f"{want}\0{ptx}"
        if key not in reports:
            try:
                reports[key] = (check_ptx(ptx, want), None)
            except CompileError as e:
                if "not found" in str(e):
                    raise
                reports[key] = (None, str(e).splitlines()[-1])
        report, error = reports[key]
        if error is not None:
            rec.problem = f"ptxas: {error}"
        elif rec.entry not in report:
            rec.problem = f"ptxas reported no entry {rec.entry}"
        else:
            rec.ptxas = report[rec.entry]
    return found
