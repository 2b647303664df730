"""Comparing one output of the optimized model with the original's, within the tolerance of
its element type: NaN and infinity positions must match exactly, integers and booleans too."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from .records import attributes

# (atol, rtol) by output element type. A fused kernel computes a chain in one pass (in f32 for
# f16/bf16 chains, where onnxruntime rounds after every op) and may use other approximations of
# exp/tanh than onnxruntime's, so floats get a few units in the last place per op of slack.
TOLERANCES: dict[int, tuple[float, float]] = {
    onnx.TensorProto.DOUBLE: (1e-9, 1e-6),
    onnx.TensorProto.FLOAT: (1e-4, 1e-3),
    onnx.TensorProto.FLOAT16: (1e-2, 1e-2),
    onnx.TensorProto.BFLOAT16: (5e-2, 5e-2),
}
EXACT = (0.0, 0.0)


@dataclass
class OutputCheck:
    name: str
    dtype: str
    shape: tuple
    max_abs: float = 0.0
    max_rel: float = 0.0  # max |a - b| / (|b| + atol)
    # max |a - b| / max |b|: the error relative to the output's scale (infinity norm), which,
    # unlike max_rel, does not grow without bound where an element crosses zero.
    norm_rel: float = 0.0
    atol: float = 0.0
    rtol: float = 0.0
    mismatched: int = 0  # elements outside the tolerance
    problem: str | None = None  # shape/type/NaN mismatch, or the tolerance exceeded

    @property
    def ok(self) -> bool:
        return self.problem is None

    def as_dict(self) -> dict:
        return {**attributes(self, "name dtype", shape=list(self.shape)),
                **attributes(self, "max_abs max_rel norm_rel atol rtol mismatched ok problem")}


def compare_output(name: str, elem_type: int, expected: np.ndarray, actual: np.ndarray) -> OutputCheck:
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    atol, rtol = TOLERANCES.get(elem_type, EXACT)
    check = OutputCheck(name, str(expected.dtype), tuple(expected.shape), atol=atol, rtol=rtol)
    if expected.shape != actual.shape:
        check.problem = f"shape {tuple(actual.shape)} instead of {tuple(expected.shape)}"
        return check
    if expected.dtype != actual.dtype:
        check.problem = f"element type {actual.dtype} instead of {expected.dtype}"
        return check
    if expected.size == 0:
        return check
    if expected.dtype.kind not in "fc":
        bad = expected != actual
        check.mismatched = int(np.count_nonzero(bad))
        if expected.dtype.kind in "iub":
            diff = np.abs(expected.astype(np.float64) - actual.astype(np.float64))
            check.max_abs = float(diff.max())
            check.max_rel = float((diff / (np.abs(expected.astype(np.float64)) + 1)).max())
        if check.mismatched:
            check.problem = f"{check.mismatched} of {expected.size} values differ (exact match required)"
        return check
    e = expected.astype(np.complex128 if expected.dtype.kind == "c" else np.float64)
    a = actual.astype(e.dtype)
    nan_e, nan_a = np.isnan(e), np.isnan(a)
    if np.any(nan_e != nan_a):
        count = int(np.count_nonzero(nan_e != nan_a))
        check.mismatched = count
        check.problem = f"NaN at {count} positions where the other model has a number"
        return check
    finite = ~nan_e
    inf_e, inf_a = np.isinf(e) & finite, np.isinf(a) & finite
    if np.any(inf_e != inf_a) or np.any(e[inf_e] != a[inf_e]):
        count = int(np.count_nonzero((inf_e != inf_a) | (inf_e & (e != a))))
        check.mismatched = count
        check.problem = f"infinity at {count} positions that differ between the models"
        return check
    both = finite & ~inf_e
    diff = np.abs(a[both] - e[both])
    if diff.size:
        check.max_abs = float(diff.max())
        check.max_rel = float((diff / (np.abs(e[both]) + max(atol, np.finfo(np.float64).tiny))).max())
        scale = float(np.abs(e[both]).max())
        check.norm_rel = check.max_abs / scale if scale > 0 else (0.0 if check.max_abs == 0 else float("inf"))
        bad = diff > atol + rtol * np.abs(e[both])
        check.mismatched = int(np.count_nonzero(bad))
    if check.mismatched:
        check.problem = (
            f"{check.mismatched} of {expected.size} values outside atol={atol:g} rtol={rtol:g}"
            f" (max abs error {check.max_abs:.3g}, max rel error {check.max_rel:.3g})"
        )
    return check
