"""Tanh GELUs on the CPU: onnxruntime alone against the model onnxfuse writes, for the forms
onnxruntime fuses into FastGelu and the forms it leaves in pieces.

The model is bias Add -> tanh GELU 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) on
float32[2, rows / 2, d], in three forms:
- pow, then Exp: the cube as Pow(x, 3) and an op after the GELU, as torch.onnx.export writes
  it inside a model; onnxruntime makes one FastGelu and onnxfuse leaves it to it (the control);
- pow, result out: the same GELU whose result is the graph output; onnxruntime 1.31 makes no
  FastGelu of it;
- x*x*x, then Exp: the cube written as two products; onnxruntime 1.31 makes no FastGelu of it.
onnxfuse's pointwise pass asks onnxruntime's executed graph which GELUs it fuses and makes the
others one Pointwise region. Timed interleaved (A B B A rounds, bench/harness.py's
interleave): at one thread the calling thread's CPU time, at two wall time; ratio = onnxfuse /
onnxruntime, median of the per-round ratios with a 95% bootstrap interval.

    python -m bench.gelu_forms [--out bench/results/gelu_forms.md]
"""
from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import helper, numpy_helper

from bench import harness

SHAPES = [(64, 512), (512, 3072)]
FORMS = ["pow, then Exp", "pow, result out", "x*x*x, then Exp"]


def gelu_model(rows: int, d: int, form: str, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    consts = {"three": 3.0, "k": 0.044715, "s2pi": 0.7978845608, "one": 1.0, "half": 0.5}
    inits = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in consts.items()]
    inits.append(numpy_helper.from_array((0.1 * rng.standard_normal(d)).astype(np.float32), "bias"))
    node = helper.make_node
    cube = ([node("Pow", ["x", "three"], ["c3"])] if form.startswith("pow")
            else [node("Mul", ["x", "x"], ["x2"]), node("Mul", ["x2", "x"], ["c3"])])
    result_out = form.endswith("result out")
    nodes = [node("Add", ["x0", "bias"], ["x"]), *cube,
             node("Mul", ["c3", "k"], ["kc"]), node("Add", ["x", "kc"], ["inner"]),
             node("Mul", ["inner", "s2pi"], ["u"]), node("Tanh", ["u"], ["t"]), node("Add", ["t", "one"], ["a"]),
             node("Mul", ["x", "half"], ["xh"]), node("Mul", ["xh", "a"], ["y" if result_out else "g"])]
    if not result_out:
        nodes.append(node("Exp", ["g"], ["y"]))
    shape = [2, rows // 2, d]
    return harness.float_model("gelu", nodes, {"x0": shape}, {"y": shape}, inits)


cases = harness.row_cases(SHAPES, {form: form for form in FORMS}, gelu_model, ["x0"])
main = harness.optimized_ab_command(
    "gelu_forms", __doc__, "Tanh GELU forms on the CPU: onnxruntime alone against onnxfuse",
    "bias Add -> tanh GELU on float32[2, rows/2, d], ORT_ENABLE_ALL on both sides. *pow, then Exp*: Pow(x, 3) and an"
    " op after the GELU (onnxruntime fuses it: FastGelu); *pow, result out*: the GELU's result is the graph output;"
    " *x\\*x\\*x, then Exp*: the cube as two products (onnxruntime 1.31 fuses neither). onnxfuse leaves to"
    " onnxruntime the GELUs its executed graph shows fused and makes the others one Pointwise region.",
    ["rows x d", "form"], cases)


if __name__ == "__main__":
    sys.exit(main())
