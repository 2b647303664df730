"""onnxfuse.Pointwise: a region of elementwise ops as one expression program.

contract   attribute `program` (onnxfuse/program.py's text form); variadic inputs and outputs of
           the program's dtypes (f16, bf16, f32, f64, bool), an input possibly read through a
           view (a Slice/Split folded into the region)
model      Program.evaluate: the reference every backend is tested against
kernels    kernels/pointwise_cpu.cc (+ pointwise_cpu_avx2.cc, pointwise_plan.cc) on the CPU;
           kernels/cuda_pointwise.cc launching onnxfuse/cuda/codegen.py's kernel on CUDA
pass       pointwise (passes/pointwise.py, regions in onnxfuse/regions.py)
pays       at least MIN_WORK ops that compute, or one and a Slice/Split that disappears, or one
           that a slower fusion of onnxruntime would otherwise take (passes/pointwise.py: pays);
           EXTRA_WORK more for each op whose kernel is slower than onnxruntime's
"""
from __future__ import annotations

import numpy as np

from .contract import CPU, CUDA, Attribute, FusedOp, Port, text

# Ops that compute (not Identity, Cast to the same type...) a region needs to replace on its own.
MIN_WORK = 2

# Ops whose kernel here costs more than onnxruntime's own, by provider: how many further computing
# ops a region must replace to pay for each. The CPU erf is evaluated in double to be correctly
# rounded (kernels/numeric.h), about 2.2 ns a value where onnxruntime's float32 Erf takes 1.3
# (1M values, 1 thread, interleaved: Erf + Mul fused 2.48 ms against onnxruntime's two kernels'
# 2.24; Erf + PRelu + Mul 3.25 ms against 8.94).
EXTRA_WORK = {CPU: {"Erf": 1}}


def reference(inputs: list[np.ndarray], attrs: dict, n_outputs: int) -> list[np.ndarray]:
    from ..program import Program

    return Program.parse(text(attrs["program"])).evaluate(*inputs)


def form(a: dict, n_inputs: int, n_outputs: int) -> str:
    """Instructions, inputs (how many read a view), outputs, dtypes and compute type."""
    from ..program import Program

    if "program" not in a:
        return f"{n_inputs} in, {n_outputs} out"
    prog = Program.parse(text(a["program"]))
    views = sum(1 for i in prog.inputs if i.view)
    dtypes = sorted({t.dtype for t in [*prog.inputs, *prog.outputs]})
    out = f"{len(prog.instrs)} instr, {len(prog.inputs)} in"
    if views:
        out += f" ({views} view{'s' if views > 1 else ''})"
    out += f", {len(prog.outputs)} out, {'/'.join(dtypes)}"
    if prog.compute_dtype != "f32":
        out += f", compute {prog.compute_dtype}"
    return out


OP = FusedOp(
    "Pointwise", "a region of elementwise ops as one expression program",
    kernels={CPU: "kernels/pointwise_cpu.cc", CUDA: "kernels/cuda_pointwise.cc"},
    inputs=(Port("x", "the program's inputs x0, x1, ... in order", variadic=True, dtype="any"),),
    outputs=(Port("y", "the program's outputs in order", variadic=True, dtype="any"),),
    attributes=(Attribute("program", "string", "the expression program (onnxfuse/program.py)"),),
    pass_name="pointwise",
    cuda_generator="onnxfuse.cuda.codegen",
    reference=reference,
    form=form,
)
