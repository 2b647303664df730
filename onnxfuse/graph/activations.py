"""The activation vocabulary: every elementwise activation the passes know, in one table.

One line per activation: its ONNX op, its name in expression programs (onnxfuse/program.py) and
kernel epilogues, its ONNX attributes in program-parameter order with their defaults, and the
fused epilogues that apply it in registers. Everything else derives from this table: the
pointwise lowering (onnxfuse/lowering.py), the ops a batched linear layer may end in
(patterns.ACTIVATIONS), ConvBiasAct's epilogue activations (cuda/conv_plan.py), StackedMLP's
(passes/ensemble_batch.py) and the activations onnxruntime fuses into its Conv and Gemm kernels
(ort_fusions.py).

Adding an activation the expression program already computes is one line here, and so is
adding it to an epilogue: every fused epilogue applies its activation as a program instruction
(ConvBiasAct's CUDA kernels print it with the Pointwise printer, cuda/conv_plan.Epilogue.program;
StackedMLP's kernel runs it with the Pointwise interpreter). A new program op needs its numpy
reference (program.py), its C++ interpreter case (kernels/pointwise_plan.h, pointwise_exec.inc)
and its CUDA expression (cuda/codegen.py), and then serves every backend and epilogue.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

# Fused epilogues (and onnxruntime fusions) an activation may belong to.
CONV = "conv"  # onnxfuse.ConvBiasAct's epilogue (--target cuda)
STACKED_MLP = "stacked_mlp"  # onnxfuse.StackedMLP's per-layer activation (CPU)
ORT_FUSED_CONV = "ort_fused_conv"  # onnxruntime's FusedConv (CPU)
ORT_FUSED_GEMM = "ort_fused_gemm"  # onnxruntime's FusedGemm (CPU)
ORT_NCHWC = "ort_nchwc"  # onnxruntime runs it in place on an NCHWc-blocked tensor (CPU)


@dataclass(frozen=True)
class Activation:
    op: str  # ONNX op type
    name: str  # op in expression programs and in kernel epilogues
    params: tuple[tuple[str, float], ...] = ()  # ONNX attributes (name, default), program order
    fused_in: frozenset[str] = frozenset()  # epilogues and onnxruntime fusions that take it

    def values(self, node: gs.Node) -> tuple[float, ...]:
        """The node's parameters (its attributes, defaults where absent), in program order."""
        return tuple(float(node.attrs.get(attr, default)) for attr, default in self.params)


def _in(*where: str) -> frozenset[str]:
    return frozenset(where)


TABLE: tuple[Activation, ...] = (
    Activation("Relu", "relu", (), _in(CONV, STACKED_MLP, ORT_FUSED_CONV, ORT_FUSED_GEMM, ORT_NCHWC)),
    Activation("Sigmoid", "sigmoid", (), _in(CONV, STACKED_MLP, ORT_FUSED_CONV, ORT_FUSED_GEMM, ORT_NCHWC)),
    Activation("Tanh", "tanh", (), _in(CONV, STACKED_MLP, ORT_FUSED_CONV, ORT_FUSED_GEMM, ORT_NCHWC)),
    Activation("LeakyRelu", "leakyrelu", (("alpha", 0.01),), _in(CONV, ORT_FUSED_CONV, ORT_FUSED_GEMM)),
    Activation("HardSigmoid", "hardsigmoid", (("alpha", 0.2), ("beta", 0.5)),
               _in(CONV, ORT_FUSED_CONV, ORT_FUSED_GEMM, ORT_NCHWC)),
    Activation("HardSwish", "hardswish", (), _in(CONV)),
    Activation("Elu", "elu", (("alpha", 1.0),)),
    Activation("Selu", "selu", (("alpha", 1.67326319217681884765625), ("gamma", 1.05070102214813232421875))),
    Activation("Celu", "celu", (("alpha", 1.0),)),
    Activation("ThresholdedRelu", "thresholdedrelu", (("alpha", 1.0),)),
    Activation("Softplus", "softplus"),
    Activation("Softsign", "softsign"),
)
# Clip is an activation too (ReLU6), but its bounds are inputs from opset 11, attributes before:
# see clip_bounds below. onnxruntime's FusedConv takes it, its FusedGemm does not.
CLIP = "Clip"
CLIP_FUSED_IN = _in(CONV, ORT_FUSED_CONV)

BY_OP: dict[str, Activation] = {a.op: a for a in TABLE}


def ops_fused_in(where: str) -> tuple[str, ...]:
    """The ONNX ops of the activations a fused epilogue (or onnxruntime fusion) takes."""
    ops = tuple(a.op for a in TABLE if where in a.fused_in)
    return ops + ((CLIP,) if where in CLIP_FUSED_IN else ())


def names_fused_in(where: str) -> tuple[str, ...]:
    """The program names of the activations a fused epilogue applies."""
    return tuple(a.name for a in TABLE if where in a.fused_in) + (("clip",) if where in CLIP_FUSED_IN else ())
