"""The CPU Pointwise kernel's elementary functions (exp, log, erf, tanh, sigmoid) in the AVX2 and
the portable baseline build: against the reference, at the overflow boundary, within their
documented ulp bounds, and with every NaN payload."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from onnxfuse import runtime
from onnxfuse.program import Program
from small_models import pointwise_model


def _unary_in_both_builds(name: str, x: np.ndarray, monkeypatch, skip_baseline: bool = False):
    """(no_avx2, output) of one `name` Pointwise node over x from the AVX2 build, then from the
    portable baseline build (ONNXFUSE_NO_AVX2) unless skip_baseline."""
    model = pointwise_model(f"in x0 f32\nt0 = {name} x0\nout t0 f32\n")
    for no_avx2 in (False,) if skip_baseline else (False, True):
        if no_avx2:
            monkeypatch.setenv("ONNXFUSE_NO_AVX2", "1")
        yield no_avx2, runtime.make_session(model, threads=1, with_library=True).run(None, {"in0": x})[0]


@pytest.mark.parametrize("name", ["exp", "log", "erf", "tanh", "sigmoid"])
def test_vectorized_and_baseline_transcendentals_agree_with_the_reference(name, monkeypatch):
    # The AVX2 build evaluates these with intrinsics; the baseline build (ONNXFUSE_NO_AVX2) with the
    # portable code. Both against the reference, over a wide range with subnormals and specials.
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    x = np.concatenate([
        rng.uniform(-110, 110, 20000), rng.standard_normal(20000) * 3, np.exp(rng.uniform(-103, 88, 20000)),
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1.4e-45, 3.4e38, -3.4e38, 88.72, 88.73, -103.9, 1.0, 4.0],
    ]).astype(np.float32)
    want = Program.parse(f"in x0 f32\nt0 = {name} x0\nout t0 f32\n").evaluate(x)[0]
    for no_avx2, got in _unary_in_both_builds(name, x, monkeypatch):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=f"no_avx2={no_avx2}")
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("name", ["exp", "sigmoid"])
def test_exp_overflow_boundary_is_exact_in_both_builds(name, monkeypatch):
    # Every float32 from 88.70 to 88.75 (where exp crosses FLT_MAX) and from -104 to -103 (where it
    # leaves the subnormals): the last finite result must stay finite, the first overflow must be inf.
    def floats(lo, hi):
        return np.arange(np.float32(lo).view(np.int32), np.float32(hi).view(np.int32), dtype=np.int32).view(np.float32)
    x = np.concatenate([floats(88.70, 88.75), -floats(88.70, 88.75), floats(-104.0, -103.0)])
    want = Program.parse(f"in x0 f32\nt0 = {name} x0\nout t0 f32\n").evaluate(x)[0]
    for no_avx2, got in _unary_in_both_builds(name, x, monkeypatch):
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"no_avx2={no_avx2}")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"no_avx2={no_avx2}")


# Documented worst-case errors of the float32 transcendentals (kernels/numeric.h and
# pointwise_cpu_avx2.cc), in units in the last place of the correctly rounded result.
ULP_BOUNDS = {"exp": 1.5, "sigmoid": 3.0, "tanh": 6.0, "erf": 0.5001}


@pytest.mark.parametrize("name", sorted(ULP_BOUNDS))
def test_transcendentals_stay_within_their_ulp_bound_in_both_builds(name, monkeypatch):
    # A dense sweep (every 2^12th float32 of each sign over the range where the function is not
    # constant, ~500,000 values, plus a fine grid near 0 and the saturation points) against float64.
    import math

    lo, hi = {"exp": (1e-30, 104.0), "sigmoid": (1e-30, 110.0), "tanh": (1e-30, 12.0), "erf": (1e-30, 6.0)}[name]
    bits = np.arange(np.float32(lo).view(np.int32), np.float32(hi).view(np.int32), 4096, dtype=np.int32)
    pos = bits.view(np.float32)
    x = np.concatenate([pos, -pos, np.linspace(-9.5, 9.5, 100001, dtype=np.float32)])
    if name == "exp":
        x = x[x <= 89.0]
    x64 = x.astype(np.float64)
    want = {"exp": np.exp, "tanh": np.tanh, "sigmoid": lambda v: 1 / (1 + np.exp(-v)),
            "erf": np.vectorize(math.erf)}[name](x64)
    want32 = want.astype(np.float32)
    # The baseline build evaluates erf with std::erf.
    for no_avx2, got in _unary_in_both_builds(name, x, monkeypatch, skip_baseline=name == "erf"):
        finite = np.isfinite(want32)
        np.testing.assert_array_equal(got[~finite], want32[~finite], err_msg=f"no_avx2={no_avx2}")
        err = np.abs(got[finite].astype(np.float64) - want[finite]) / np.spacing(np.abs(want32[finite]))
        worst = int(np.argmax(err))
        assert err[worst] <= ULP_BOUNDS[name], (no_avx2, x[finite][worst], got[finite][worst], want[finite][worst], err[worst])


@pytest.mark.parametrize("name", ["exp", "log", "erf", "tanh", "sigmoid"])
def test_every_nan_payload_stays_nan_in_both_builds(name, monkeypatch):
    # fuzz seed 116237: onnxruntime's GEMM writes NaN as 0xffffffff; exp's exponent arithmetic
    # carried that payload into a finite -3.4e38.
    payloads = np.array([0xFFFFFFFF, 0x7FFFFFFF, 0xFFC00000, 0x7FC00000, 0x7F800001, 0xFF800001, 0x7FC00001,
                         0xFFBFFFFF] * 4, np.uint32).view(np.float32)
    for no_avx2, got in _unary_in_both_builds(name, payloads, monkeypatch):
        assert np.isnan(got).all(), (no_avx2, got)


@pytest.mark.parametrize("name", ["elu[1]", "celu[0.8861332]", "selu[1.6732632,1.050701]"])
def test_exponential_units_have_no_cancellation_near_zero_in_both_builds(name, monkeypatch):
    # alpha (e^x - 1) computed as exp(x) - 1 was 1e-5 off at x = -0.0039 (fuzz seed 9456693):
    # within 3 ulps of alpha expm1(x / alpha) now (the scale and the division round too), and
    # onnxruntime's own +0 where x is -0 or a subnormal.
    import math

    x = -np.exp(np.random.default_rng(7).uniform(np.log(2.0 ** -23), np.log(0.6), 20000)).astype(np.float32)
    op, params = name.rstrip("]").split("[")
    p = [float(v) for v in params.split(",")]
    alpha, scale = (p[0] if op != "selu" else p[0]), (p[1] if op == "selu" else 1.0)
    inner = (lambda v: v / alpha) if op == "celu" else (lambda v: v)
    want = np.array([scale * alpha * math.expm1(inner(float(v))) for v in x])
    for no_avx2, got in _unary_in_both_builds(name, x, monkeypatch):
        err = np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want.astype(np.float32)))
        assert err.max() <= 3.0, (no_avx2, x[int(np.argmax(err))], err.max())
    tiny = np.array([-0.0, -1e-40, -1.4e-45], np.float32)
    for no_avx2, got in _unary_in_both_builds(name, tiny, monkeypatch):
        assert np.all(got == 0) and not np.signbit(got[1:]).any(), (no_avx2, got)
