"""onnxruntime's CPU SkipLayerNormalization against what onnxfuse writes instead: the residual
(and bias) Add as one Pointwise region, then onnxruntime's LayerNormalization.

The model is [bias Add ->] residual Add -> LayerNormalization over the last axis on
float32[2, rows / 2, d]; onnxruntime (ORT_ENABLE_ALL) fuses it into one SkipLayerNormalization.
The onnxfuse side is the same model optimized by the default CPU pipeline (onnxfuse library
loaded), which the pointwise pass's PREEMPT rule turns into Pointwise + LayerNormalization.
Timed interleaved (A B B A rounds, bench/harness.py's interleave): at one thread the
calling thread's CPU time, at two wall time; ratio = onnxfuse / onnxruntime, median of the
per-round ratios with a 95% bootstrap interval.

    python -m bench.skip_layernorm [--out bench/results/skip_layernorm.md]
"""
from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import helper, numpy_helper

from bench import harness

SHAPES = [(64, 128), (512, 768), (2048, 1024)]


def residual_layernorm(rows: int, d: int, bias: bool, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(d)).astype(np.float32), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(d)).astype(np.float32), "beta")]
    nodes, x = [], "x"
    if bias:
        inits.append(numpy_helper.from_array((0.1 * rng.standard_normal(d)).astype(np.float32), "bias"))
        nodes.append(helper.make_node("Add", ["x", "bias"], ["xb"]))
        x = "xb"
    nodes.append(helper.make_node("Add", [x, "residual"], ["sum"]))
    nodes.append(helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5))
    shape = [2, rows // 2, d]
    return harness.float_model("residual_layernorm", nodes, {"x": shape, "residual": shape}, {"y": shape}, inits)


cases = harness.row_cases(SHAPES, {"yes": True, "no": False}, residual_layernorm, ["x", "residual"])
main = harness.optimized_ab_command(
    "skip_layernorm", __doc__,
    "onnxruntime's SkipLayerNormalization (CPU) against Pointwise + LayerNormalization",
    "[bias Add ->] residual Add -> LayerNormalization on float32[2, rows/2, d], ORT_ENABLE_ALL on both sides; "
    "onnxruntime alone fuses it into SkipLayerNormalization, onnxfuse's CPU pipeline writes the Adds as one "
    "Pointwise region (even the lone residual Add: the pointwise pass's PREEMPT rule).",
    ["rows x d", "bias Add"], cases)


if __name__ == "__main__":
    sys.exit(main())
