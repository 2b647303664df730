"""Fuzz seed 2706: Pow(tanh(x), 1.4e5) magnified our tanh(11.87) = 1 - 1.8e-7 into an error of
0.025. tanh rounds to exactly +-1 in float32 past |x| = 9.01, as onnxruntime's Tanh does."""
import os

import numpy as np
import pytest

from onnxfuse.runtime import make_session
from small_models import pointwise_model


@pytest.mark.parametrize("no_avx2", ["", "1"])
def test_tanh_is_exactly_one_where_float32_tanh_rounds_to_one(no_avx2, monkeypatch):
    if no_avx2:
        monkeypatch.setenv("ONNXFUSE_NO_AVX2", "1")
    m = pointwise_model("in x0 f32\nt0 = tanh x0\nout t0 f32\n")
    x = np.array([9.02, 11.87, 20.0, 88.0, 1e30, -9.02, -11.87, -1e30] * 4, np.float32)
    y = make_session(m).run(None, {"in0": x})[0]
    assert np.array_equal(y, np.sign(x)), y
    # Below saturation, within the rational fit's 6 ulps of the correctly rounded value.
    x = np.linspace(-9, 9, 4001, dtype=np.float32)
    y = make_session(m).run(None, {"in0": x})[0]
    want = np.tanh(x.astype(np.float64)).astype(np.float32)
    assert np.max(np.abs(y - want) / np.spacing(np.abs(want) + np.float32(1e-30))) <= 6
    assert os.environ.get("ONNXFUSE_NO_AVX2", "") == no_avx2
