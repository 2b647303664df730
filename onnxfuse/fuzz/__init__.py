"""Differential fuzzing: random valid graphs, optimized and compared with the original in onnxruntime.

Each case is a seeded random DAG of the ops our passes touch (elementwise chains with broadcasting
and mixed ranks, Slice/Split/Concat with odd steps and negative indices, Conv + BatchNormalization +
activations + residuals, sibling MatMuls), random shapes including size-1 and zero-size dims,
symbolic and unknown dims, several outputs, intermediates that are also graph outputs, float16 /
float64 cases, Cast chains through f16, bf16, f64, bool and integers, integer chains, and If / Loop /
Scan nodes whose bodies read top-level values (outer-scope references). Half the cases have
special values (+-0, +-inf, NaN, subnormals, the type's extremes) at a few input positions.

For each case the optimized model must pass onnx.checker (full_check), run with and without our
custom-op library and match the original (run with onnxruntime's graph rewrites disabled, the
plainest semantics): floats within a tolerance, NaN for NaN, an infinity for the same infinity,
a zero for a zero of the same sign; optimizing the optimized model must change nothing.

    onnxfuse fuzz --cases 50000 --seed 0 --jobs 2     # the long run (python -m onnxfuse.fuzz too)
    onnxfuse fuzz --cases 20 --seed 7 --save failures/   # keep failing models

A failing case is reproduced exactly by its seed: `onnxfuse fuzz --one SEED`.

Excuses. Two correct implementations may disagree where the original is ill-conditioned or near a
jump (Equal(|x|, tanh(x)) for x = 1e-4, where onnxruntime's tanh and ours differ by one ulp; x / x
near 0; Pow with a large exponent). A difference is excused only position by position
(check.unexplained): at every element where the outputs differ, the original run in onnxruntime
on inputs moved by a few ulps or by rounding noise, or in another way that computes the same
(its graph rewrites on; every value a graph output; each Relu on its input flattened, as its
float16 Relu picks the sign of a zero by shape; node by node, each value rounded to its declared
type, as its float16 emulation skips such roundings; without our library, a float16 original
computed in float32 throughout), gives our value, or the operands of a comparison within rounding
noise of each other move apart, or its runs on moved inputs give finite values on both sides of
ours, or our value is at least as close to the float64 result as onnxruntime's. The moves are relative, so zeros, infinities and NaNs
stay what they are: a difference that a special value causes deterministically is a failure.
Excused cases are counted and listed ("tie-sensitive"); anything else is a failure.

The package: generate (op tables and the graph builder), cases (a seed's model and inputs), check
(running and comparing one case), run (the command line).
"""
from .cases import LATER_MOTIFS_SEED, SALTED_SHARE, Case, build_case, random_case, salt, special_values
from .check import (Outcome, _run, _to_float64, check_case, compare, differing, optimize_model, run_case,
                    tolerance, unexplained)
from .run import failure_kind, run_fuzz

__all__ = [
    "LATER_MOTIFS_SEED", "SALTED_SHARE", "Case", "Outcome", "build_case", "check_case", "compare", "differing",
    "failure_kind", "run_fuzz", "optimize_model", "random_case", "run_case", "salt", "special_values", "tolerance",
    "unexplained", "_run", "_to_float64",
]
