"""Fuzz seed 13516: Pow(v, Ceil(Pow(x, erf(x)))) with x near -3.8: our erf(-3.765) was -1.0 where
the correctly rounded value (and onnxruntime's) is -0.9999999, so Pow(x, erf x) of a negative x
was finite instead of NaN (an integer exponent); erf(-3.934) was the reverse. Past |x| = 3 erf is
now 1 - erfc, rounded once: exactly +-1 only where erf rounds to +-1 in float32."""
import math
import os

import numpy as np
import pytest

from onnxfuse.runtime import make_session
from small_models import pointwise_model


@pytest.mark.parametrize("no_avx2", ["", "1"])
def test_erf_near_one_is_correctly_rounded(no_avx2, monkeypatch):
    if no_avx2:
        monkeypatch.setenv("ONNXFUSE_NO_AVX2", "1")
    m = pointwise_model("in x0 f32\nt0 = erf x0\nout t0 f32\n")
    x = np.concatenate([np.array([-3.7652209, -3.934122, -3.7850935, -3.884551], np.float32),
                        np.linspace(3.0, 4.5, 3001, dtype=np.float32)])
    x = np.concatenate([x, -x, np.array([np.inf, -np.inf, np.nan], np.float32)])
    y = make_session(m).run(None, {"in0": x})[0]
    want = np.array([math.erf(v) if np.isfinite(v) else (np.sign(v) if not np.isnan(v) else np.nan)
                     for v in x.astype(np.float64)]).astype(np.float32)
    finite = np.isfinite(x)
    # correctly rounded but within 1e-11 of a rounding midpoint: at most one ulp, and never at +-1
    assert np.max(np.abs(y[finite] - want[finite]) / np.spacing(np.float32(1))) <= 1
    assert np.array_equal(np.abs(y[finite]) == 1, np.abs(want[finite]) == 1)
    assert np.array_equal(y[~finite][:2], np.array([1, -1], np.float32)) and np.isnan(y[-1])
    assert os.environ.get("ONNXFUSE_NO_AVX2", "") == no_avx2
