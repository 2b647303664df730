"""Special values through the Pointwise kernels, op by op, bit for bit against onnxruntime.

Every ONNX operator the pointwise lowering knows runs on +-0, +-inf, NaN, subnormals and each
type's extremes (and, for binary operators, every pair of them), once in plain onnxruntime and
twice through the library: as a one-op Pointwise region and as a chained region (the op, then
two negations, which are exact and keep every sign). Both builds of the CPU kernel run (AVX2 and
the baseline, ONNXFUSE_NO_AVX2=1).

What is compared: every output bit, except that a NaN only has to be a NaN (its payload and
sign bit are not compared: onnxruntime itself gives different NaN payloads for one input in
different kernels). Where onnxruntime disagrees with itself about one input (the same value at
another position in the tensor, or the same operation on another tensor length, runs another
code path), any of its answers is accepted; `ORT_SELF_INCONSISTENT` lists where that was seen.
For the elementary functions the kernel evaluates with its own approximations (exp, tanh, erf,
...) the inputs compared are those whose result the IEEE special cases determine (+-0, +-inf,
NaN, the largest values, where the function saturates) and the subnormals (where it is x, 0,
1 or 1/2, or, where onnxruntime's value is not the correctly rounded one, the correctly rounded
value: see CORRECTLY_ROUNDED); their accuracy elsewhere is held to ulp bounds by
test_pointwise_cpu.py.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxfuse import runtime
from onnxfuse.lowering import lower_node, program_dtype
from onnxfuse.program import Program

ELEM = {np.float16: TensorProto.FLOAT16, np.float32: TensorProto.FLOAT, np.float64: TensorProto.DOUBLE}
DTYPES = [np.float32, np.float64, np.float16]

# Seen with onnxruntime 1.31: Max/Min of +0 and -0 return either operand depending on the tensor
# lengths and positions (its vectorized and scalar loops order the comparison differently).
ORT_SELF_INCONSISTENT = {"Max", "Min"}
# onnxruntime's float16 kernels of opset 18 that compute in float16 or round otherwise: Softplus
# overflows to inf at 65504 (its opset-20 kernel gives 65504), HardSwish rounds subnormal results
# differently. Not matched: the Pointwise program computes in float32 whatever the opset.
KNOWN_OPSET_DIFFERENCES = {("float16", 18): ("HardSwish",)}
# ... and its float16 Relu of opset 18 gives +0 or -0 for -0 depending on the tensor's length
# (+0 for 16 elements, -0 for 19 or 95): either is accepted there.
ORT_ZERO_SIGN_BY_LENGTH = {("Relu", "float16", 18)}


# The elementary functions whose float64 numpy value, rounded, is the correctly rounded result at
# subnormal inputs. Not Tanh: onnxruntime's float32 Tanh gives tanh(1.4e-45) = 0 and
# tanh(3.918315e-39) = 3.918232e-39, and ours gives the same (a zero that Log or Pow turns into
# -inf or 1 where x itself gives NaN: fuzz seeds 40289, 46091), so only its answer is accepted.
CORRECTLY_ROUNDED = {
    "Exp": np.exp, "Sin": np.sin, "Atan": np.arctan, "Asin": np.arcsin, "Sinh": np.sinh,
    "Asinh": np.arcsinh, "Atanh": np.arctanh, "Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
}


def special_values(dt) -> np.ndarray:
    """+-0, +-inf, NaN, +-largest, +-smallest normal, +-smallest subnormal, a subnormal in the
    middle, and a few ordinary values that signed zeros come out of (x * 0, x - x, 1 / x)."""
    fi = np.finfo(dt)
    mid_sub = fi.tiny / 3
    v = [0.0, -0.0, np.inf, -np.inf, np.nan, fi.max, -fi.max, fi.tiny, -fi.tiny, fi.smallest_subnormal,
         -fi.smallest_subnormal, mid_sub, -mid_sub, 1.0, -1.0, 0.5, -0.5, 2.5, -2.5]
    with np.errstate(all="ignore"):
        return np.array(v, dtype=dt)


# Whether a value is a special input of an approximated function: its result is an IEEE special
# case or a saturated value, the same for every correct implementation.
def _saturating_inputs(x: np.ndarray) -> np.ndarray:
    a = np.abs(x.astype(np.float64))
    return (a == 0) | np.isnan(a) | np.isinf(a) | (a >= np.finfo(x.dtype).max)


# op -> (attributes, arity, dtypes onnxruntime's CPU provider implements, approximated?)
UNARY_EXACT = ["Neg", "Abs", "Sqrt", "Reciprocal", "Relu", "Floor", "Ceil", "Round", "Sign", "IsNaN", "IsInf",
               "Softsign", "HardSigmoid", "HardSwish"]
UNARY_APPROX = ["Exp", "Log", "Erf", "Tanh", "Sigmoid", "Softplus", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan",
                "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Elu", "Selu", "Celu", "Mish", "Gelu"]
PARAM_EXACT = {
    "LeakyRelu": {"alpha": 0.1}, "ThresholdedRelu": {"alpha": 1.0}, "Shrink": {"lambd": 0.5, "bias": 0.25},
    "Clip": {},
}
BINARY_EXACT = ["Add", "Sub", "Mul", "Div", "Max", "Min", "PRelu", "Sum", "Mean", "Equal", "Less", "Greater",
                "LessOrEqual", "GreaterOrEqual"]
BINARY_APPROX = ["Pow"]
# Where(cond, X, Y) with X and Y the cross product of the values, each under both conditions.
TERNARY_EXACT = ["Where"]
PREDICATES = {"IsNaN", "IsInf", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"}
CASES = (
    [(op, {}, 1, False) for op in UNARY_EXACT] + [(op, {}, 1, True) for op in UNARY_APPROX]
    + [(op, attrs, 1, False) for op, attrs in PARAM_EXACT.items()]
    + [("LeakyRelu", {"alpha": 0.0}, 1, False), ("Clip", {"bounds": (0.0, 6.0)}, 1, False)]
    + [("Clip", {"tensor_bounds": b}, 1, False) for b in ((0.0, 6.0), (-0.0, -0.0), (np.nan, 1.0), (-1.0, np.nan))]
    + [(op, {}, 2, False) for op in BINARY_EXACT] + [(op, {}, 2, True) for op in BINARY_APPROX]
    + [(op, {}, 3, False) for op in TERNARY_EXACT]
)


def _case_id(case) -> str:
    op, attrs, _, _ = case
    return op + "".join(f"-{k}={v}" for k, v in attrs.items())


def _inputs(dt, arity: int) -> list[np.ndarray]:
    s = special_values(dt)
    if arity == 1:
        return [s]
    a, b = np.meshgrid(s, s, indexing="ij")
    if arity == 3:
        a, b = np.tile(a.reshape(-1), 2), np.tile(b.reshape(-1), 2)
        cond = np.repeat(np.array([True, False]), s.size * s.size)
        return [cond, a, b]
    return [a.reshape(-1).copy(), b.reshape(-1).copy()]


def _graph_inputs(op, attrs, dt, n_inputs):
    """(node input names, initializers): Clip's bounds are constants of the input's type, or
    (tensor_bounds) graph inputs lo and hi, fed by `bound_feeds`."""
    names = [f"in{i}" for i in range(n_inputs)]
    inits = []
    if op == "Clip" and "bounds" in attrs:
        for name, v in zip(("lo", "hi"), attrs["bounds"]):
            inits.append(onnx.numpy_helper.from_array(np.array(v, dt), name))
        names += ["lo", "hi"]
    if op == "Clip" and "tensor_bounds" in attrs:
        names += ["lo", "hi"]
    return names, inits


def bound_feeds(attrs, dt) -> dict:
    if "tensor_bounds" not in attrs:
        return {}
    lo, hi = attrs["tensor_bounds"]
    return {"lo": np.array(lo, dt), "hi": np.array(hi, dt)}


def _onnx_attrs(attrs):
    return {k: v for k, v in attrs.items() if k not in ("bounds", "tensor_bounds")}


def _in_elem(op, i, dt):
    return TensorProto.BOOL if op == "Where" and i == 0 else ELEM[dt]


def _out_elem(op, dt):
    return TensorProto.BOOL if op in PREDICATES else ELEM[dt]


def plain_model(op, attrs, dt, arity, opset: int = 20) -> onnx.ModelProto:
    names, inits = _graph_inputs(op, attrs, dt, arity)
    inputs = [helper.make_tensor_value_info(f"in{i}", _in_elem(op, i, dt), None) for i in range(arity)]
    inputs += [helper.make_tensor_value_info(k, ELEM[dt], []) for k in bound_feeds(attrs, dt)]
    node = helper.make_node(op, names, ["out0"], **_onnx_attrs(attrs))
    graph = helper.make_graph([node], "plain", inputs, [helper.make_tensor_value_info("out0", _out_elem(op, dt), None)],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def program_text(op, attrs, dt, arity, chained: bool, opset: int = 20) -> str:
    prog = Program()
    in_types = [_in_elem(op, i, dt) for i in range(arity)]
    args = [prog.add_input(program_dtype(t)) for t in in_types]
    if op == "Clip" and "bounds" in attrs:
        args += [float(v) for v in attrs["bounds"]]
        in_types += [ELEM[dt], ELEM[dt]]
    if op == "Clip" and "tensor_bounds" in attrs:
        args += [prog.add_input(program_dtype(ELEM[dt])) for _ in range(2)]
        in_types += [ELEM[dt], ELEM[dt]]
    out_elem = _out_elem(op, dt)
    (value,) = lower_node(prog, op, _onnx_attrs(attrs), opset, args, in_types, [out_elem])
    if chained and out_elem != TensorProto.BOOL:
        value = prog.emit("neg", prog.emit("neg", value))
    prog.add_output(value, program_dtype(out_elem))
    return prog.to_text()


def pointwise_model(text: str, dt, arity: int, op: str, extra: tuple = ()) -> onnx.ModelProto:
    names = [f"in{i}" for i in range(arity)] + list(extra)
    inputs = [helper.make_tensor_value_info(n, _in_elem(op, i, dt), None) for i, n in enumerate(names)]
    node = helper.make_node("Pointwise", names, ["out0"], domain="onnxfuse", program=text)
    graph = helper.make_graph([node], "fused", inputs, [helper.make_tensor_value_info("out0", _out_elem(op, dt), None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("onnxfuse", 1)])
    model.ir_version = 10
    return model


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def _run(model, feeds, with_library):
    sess = runtime.make_session(model, threads=1, with_library=with_library, level="disable")
    return sess.run(None, feeds)[0]


# Copies of the values per run: enough for the vectorized loops and their tails to see each value.
REPEAT = 5


def ort_answers(op, attrs, dt, arrays, opset: int = 20) -> list[np.ndarray]:
    """onnxruntime's outputs for the values, each at several positions and tensor lengths."""
    model = plain_model(op, attrs, dt, len(arrays), opset)
    n = arrays[0].size
    answers = []
    for copies, shift in ((1, 0), (REPEAT, 0), (REPEAT, 3)):
        tiled = [np.roll(np.tile(a, copies), shift) for a in arrays]
        feeds = {f"in{i}": t for i, t in enumerate(tiled)} | bound_feeds(attrs, dt)
        out = np.roll(_run(model, feeds, False), -shift)
        answers.extend(out[k * n:(k + 1) * n] for k in range(copies))
    return answers


def mismatches(got: np.ndarray, answers: list[np.ndarray], compared: np.ndarray) -> np.ndarray:
    """Indices where `got` is none of onnxruntime's answers (NaN: any NaN)."""
    ok = np.zeros(got.shape, bool)
    for want in answers:
        if got.dtype == np.bool_:
            ok |= got == want
            continue
        ok |= (_bits(got) == _bits(want)) | (np.isnan(got) & np.isnan(want))
    return np.nonzero(compared & ~ok)[0]


# onnxruntime registers some float16 kernels per opset range, with other special-value rules.
OPSETS = {np.float16: (17, 18, 20)}


@pytest.mark.parametrize("dt,opset", [(d, o) for d in DTYPES for o in OPSETS.get(d, (20,))],
                         ids=lambda v: np.dtype(v).name if isinstance(v, type) else f"opset{v}")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_pointwise_matches_onnxruntime_bit_for_bit_on_special_values(case, dt, opset, monkeypatch):
    _check_bit_for_bit(case, dt, opset, monkeypatch)


# onnxruntime has no double Selu or Softplus kernel: an opset-18 model runs their function bodies
# (Selu's -0 is -0, its alpha * e^x - alpha is +0 where e^x rounds to 1; Softplus, log(e^x + 1),
# overflows), and its double PRelu and LeakyRelu of opsets 16-18 give +0 for x * 0 with x < 0.
# (Attributes are float32: LeakyRelu's alpha is one float32 holds exactly, so that the test's
# double program and onnxruntime's attribute hold the same slope.)
DOUBLE_OPSET_18 = [c for c in CASES if c[0] in ("Selu", "Softplus", "PRelu")] + [
    ("LeakyRelu", {"alpha": 0.125}, 1, False), ("LeakyRelu", {"alpha": 0.0}, 1, False)]


@pytest.mark.parametrize("case", DOUBLE_OPSET_18, ids=_case_id)
def test_double_function_bodies_of_opset_18_match_bit_for_bit_on_special_values(case, monkeypatch):
    dt, opset = np.float64, 18
    _check_bit_for_bit(case, dt, opset, monkeypatch)


def _check_bit_for_bit(case, dt, opset, monkeypatch):
    op, attrs, arity, approximated = case
    if op in KNOWN_OPSET_DIFFERENCES.get((np.dtype(dt).name, opset), ()):
        pytest.skip(f"onnxruntime's {np.dtype(dt).name} {op} of opset {opset}: see KNOWN_OPSET_DIFFERENCES")
    arrays = _inputs(dt, arity)
    try:
        answers = ort_answers(op, attrs, dt, arrays, opset)
    except Exception as e:  # onnxruntime's NOT_IMPLEMENTED: no kernel of this type
        if "NOT_IMPLEMENTED" in str(e) or "Type Error" in str(e) or "No Op registered" in str(e):
            pytest.skip(f"onnxruntime has no {np.dtype(dt).name} {op}")
        raise
    compared = np.ones(arrays[0].shape, bool)
    if approximated:
        for a in arrays:
            compared &= _saturating_inputs(a) | (np.abs(a.astype(np.float64)) < np.finfo(dt).tiny)
    if approximated and op in CORRECTLY_ROUNDED:
        # Subnormal inputs: onnxruntime's own result or the correctly rounded one.
        with np.errstate(all="ignore"):
            exact = CORRECTLY_ROUNDED[op](*[a.astype(np.float64) for a in arrays]).astype(dt)
        subnormal = np.zeros(arrays[0].shape, bool)
        for a in arrays:
            subnormal |= (a != 0) & (np.abs(a.astype(np.float64)) < np.finfo(dt).tiny)
        answers = answers + [np.where(subnormal, exact, answers[0])]
    if (op, np.dtype(dt).name, opset) in ORT_ZERO_SIGN_BY_LENGTH:
        answers = answers + [np.where(arrays[0] == 0, -answers[0], answers[0]).astype(dt)]
    if op in ORT_SELF_INCONSISTENT:
        # Accept the other zero where both operands are zeros (see ORT_SELF_INCONSISTENT).
        zeros = (arrays[0] == 0) & (arrays[1] == 0)
        answers = answers + [np.where(zeros, arrays[1], arrays[0]).astype(dt), np.where(zeros, arrays[0], arrays[1]).astype(dt)]
    tiled = [np.tile(a, REPEAT) for a in arrays]
    feeds = {f"in{i}": t for i, t in enumerate(tiled)} | bound_feeds(attrs, dt)
    n = arrays[0].size
    problems = []
    for chained in (False, True):
        text = program_text(op, attrs, dt, arity, chained, opset)
        for no_avx2 in (False, True):
            if no_avx2:
                monkeypatch.setenv("ONNXFUSE_NO_AVX2", "1")
            else:
                monkeypatch.delenv("ONNXFUSE_NO_AVX2", raising=False)
            out = _run(pointwise_model(text, dt, arity, op, tuple(bound_feeds(attrs, dt))), feeds, True)
            for k in range(REPEAT):
                got = out[k * n:(k + 1) * n]
                for i in mismatches(got, answers, compared)[:4]:
                    problems.append(
                        f"{'chained' if chained else 'one-op'} {'baseline' if no_avx2 else 'avx2'} copy {k}:"
                        f" {op}({', '.join(repr(float(a[i])) for a in arrays)}) = {float(got[i])!r},"
                        f" onnxruntime {float(answers[0][i])!r}")
    assert not problems, "\n".join(sorted(set(problems))[:30])


def test_reciprocal_of_relu_of_negated_zero_is_minus_infinity():
    # The case that showed the signed-zero bug: y = 1 / Relu(-x) at x = 0 is 1 / -0 = -inf in
    # onnxruntime; a Relu that turned -0 into +0 gave +inf.
    for dt in DTYPES:
        text = f"in x0 {program_dtype(ELEM[dt])}\nt0 = neg x0\nt1 = relu t0\nt2 = recip t1\nout t2 {program_dtype(ELEM[dt])}\n"
        got = _run(pointwise_model(text, dt, 1, "Relu"), {"in0": np.zeros(19, dt)}, True)
        assert np.all(np.isneginf(got)), (np.dtype(dt).name, got)


@pytest.mark.parametrize("dt", [np.float16, np.float64], ids=["float16", "float64"])
def test_selu_of_opset_18_keeps_minus_zero_as_onnxruntime(dt):
    """seeds 33858 and 43999 of the fuzzer: onnxruntime runs the float16 and double Selu of an
    opset-18 model as Where(X < 0, ..., gamma * X), so Selu(-0) is -0 there (+0 at other opsets,
    where its float kernel runs)."""
    for opset, minus in ((18, True), (17, False)):
        if dt == np.float64 and opset != 18:
            continue  # no double Selu outside the opset-18 function body
        x = np.array([-0.0, 0.0, -1e-20, 2.5], dt)
        want = _run(plain_model("Selu", {}, dt, 1, opset), {"in0": x}, False)
        got = _run(pointwise_model(program_text("Selu", {}, dt, 1, True, opset), dt, 1, "Selu"), {"in0": x}, True)
        assert np.signbit(want[0]) == minus and not np.signbit(want[1])
        assert (_bits(got[:3]) == _bits(want[:3])).all(), (opset, got, want)


def test_sign_of_a_float16_product_that_underflows_is_zero():
    """seed 35220 of the fuzzer: in float16 the product 1.07e-4 * 1.07e-4 = 1.1e-8 is 0, and
    onnxruntime's Sign of it is 0; the program, computing in float32, rounds Sign's operand to
    float16 first."""
    prog = Program()
    x = prog.add_input("f16")
    (sq,) = lower_node(prog, "Mul", {}, 17, [x, x], [TensorProto.FLOAT16] * 2, [TensorProto.FLOAT16])
    (s,) = lower_node(prog, "Sign", {}, 17, [sq], [TensorProto.FLOAT16], [TensorProto.FLOAT16])
    prog.add_output(s, "f16")
    feeds = {"in0": np.array([-1.072e-4, 1e-3, -0.0, 3.0], np.float16)}
    got = _run(pointwise_model(prog.to_text(), np.float16, 1, "Sign"), feeds, True)
    plain = helper.make_graph([helper.make_node("Mul", ["in0", "in0"], ["m"]), helper.make_node("Sign", ["m"], ["out0"])],
                              "plain", [helper.make_tensor_value_info("in0", TensorProto.FLOAT16, None)],
                              [helper.make_tensor_value_info("out0", TensorProto.FLOAT16, None)])
    model = helper.make_model(plain, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    want = _run(model, feeds, False)
    assert want[0] == 0 and (_bits(got) == _bits(want)).all(), (got, want)


@pytest.mark.parametrize("no_avx2", [False, True], ids=["avx2", "baseline"])
def test_float_tanh_of_tiny_values_is_onnxruntimes_bit_for_bit(no_avx2, monkeypatch):
    # Every 61st subnormal and a sample of the normals below 2^-12, where onnxruntime's Tanh
    # computes (x * P(0)) / Q(0) and loses bits (kernels/numeric.h, kTanhTiny), with the first
    # normals above; each of both signs.
    if no_avx2:
        monkeypatch.setenv("ONNXFUSE_NO_AVX2", "1")
    rng = np.random.default_rng(40289)
    bits = np.concatenate([np.arange(0, 1 << 23, 61, dtype=np.uint32),
                           rng.integers(1 << 23, 0x39800000, 50000, dtype=np.uint32),
                           np.arange(0x397FFFF0, 0x39800010, dtype=np.uint32)])
    x = np.concatenate([bits, bits | 0x80000000]).view(np.float32)
    want = ort_answers("Tanh", {}, np.float32, [x])[0]
    got = _run(pointwise_model(program_text("Tanh", {}, np.float32, 1, False), np.float32, 1, "Tanh"), {"in0": x}, True)
    tiny = np.abs(x) < np.float32(2.0 ** -12)
    bad = np.nonzero(tiny & (_bits(got) != _bits(want)))[0]
    assert bad.size == 0, [(float(x[i]), float(got[i]), float(want[i])) for i in bad[:5]]
    # Above it, the rational's own accuracy (within 2 ulps of onnxruntime here).
    assert np.all(np.abs(got[~tiny] - want[~tiny]) <= 2 * np.spacing(np.abs(want[~tiny])))
    # Log(Tanh(-1.4e-45)) is -inf as in onnxruntime, not the NaN of a log of a negative number.
    text = "in x0 f32\nt0 = tanh x0\nt1 = log t0\nout t1 f32\n"
    got = _run(pointwise_model(text, np.float32, 1, "Log"), {"in0": np.full(19, -1.4e-45, np.float32)}, True)
    assert np.all(np.isneginf(got)), got


def test_mean_of_several_inputs_is_onnxruntimes_bit_for_bit():
    # (onnxruntime 1.31 has a float32 Mean only.) It multiplies the sum by 1/n rounded to the type; a division by 3 differs in the
    # last bit for a third of the values, which Greater(h, Mean(h, h, h)) made a jump (fuzz seed 43483).
    rng, dt = np.random.default_rng(43483), np.float32
    for count in (3, 5, 6):
        arrays = [rng.standard_normal(999).astype(dt) for _ in range(count)]
        arrays[0][:19] = special_values(dt)
        names = [f"in{i}" for i in range(count)]
        inputs = [helper.make_tensor_value_info(n, ELEM[dt], None) for n in names]
        out = helper.make_tensor_value_info("out0", ELEM[dt], None)
        graph = helper.make_graph([helper.make_node("Mean", names, ["out0"])], "mean", inputs, [out])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 10
        feeds = dict(zip(names, arrays))
        want = _run(model, feeds, False)
        prog = Program()
        args = [prog.add_input(program_dtype(ELEM[dt])) for _ in names]
        (value,) = lower_node(prog, "Mean", {}, 13, args, [ELEM[dt]] * count, [ELEM[dt]])
        prog.add_output(value, program_dtype(ELEM[dt]))
        fused = helper.make_node("Pointwise", names, ["out0"], domain="onnxfuse", program=prog.to_text())
        fused_model = helper.make_model(helper.make_graph([fused], "fused", inputs, [out]),
                                        opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("onnxfuse", 1)])
        fused_model.ir_version = 10
        got = _run(fused_model, feeds, True)
        same = (_bits(got) == _bits(want)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (count, np.nonzero(~same)[0][:5])


def test_float_steps_of_a_region_computing_in_double_overflow_as_float():
    # A region with a double output (Cast to float64) computes in double; its float32 steps are
    # rounded to float32 each, as onnxruntime stores them: Sum(x, x) of 3e38 is inf, and
    # Sum(x, x) - Cast(Cast(Sum(x, x), double), float) is NaN there, not 6e38 - inf (fuzz seed
    # 28493), and Mean(x, x, y) is inf, not 2.27e38 (fuzz seed 28404).
    from onnxfuse.fuzz import optimize_model

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [24])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [24])
    nodes = [helper.make_node("Sum", ["x", "x"], ["s"]), helper.make_node("Cast", ["s"], ["wide"], to=TensorProto.DOUBLE),
             helper.make_node("Cast", ["wide"], ["back"], to=TensorProto.FLOAT), helper.make_node("Sub", ["s", "back"], ["d"]),
             helper.make_node("Mean", ["x", "x", "y"], ["m"]), helper.make_node("Cast", ["m"], ["mw"], to=TensorProto.DOUBLE),
             helper.make_node("Neg", ["m"], ["mn"])]
    outs = [helper.make_tensor_value_info(n, t, [24]) for n, t in
            (("wide", TensorProto.DOUBLE), ("d", TensorProto.FLOAT), ("mw", TensorProto.DOUBLE), ("mn", TensorProto.FLOAT))]
    model = helper.make_model(helper.make_graph(nodes, "double_region", [x, y], outs),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    opt = optimize_model(model)
    assert any(n.domain == "onnxfuse" for n in opt.graph.node)
    big = np.finfo(np.float32).max
    feeds = {"x": np.array([3e38, -3e38, big, 2e38, 1.7e38, 1.0, -0.0, np.inf] * 3, np.float32),
             "y": np.array([1.0, -1.0, big, -big, 1e38, 2.0, 0.0, np.nan] * 3, np.float32)}
    sess = runtime.make_session(opt, threads=1, with_library=True, level="disable")
    names = [o.name for o in sess.get_outputs()]
    for name, got, ref in zip(names, sess.run(None, feeds), runtime.make_session(
            model, threads=1, with_library=False, level="disable").run(names, feeds)):
        same = (_bits(got) == _bits(ref)) | (np.isnan(got) & np.isnan(ref))
        assert same.all(), (name, got[~same][:4], ref[~same][:4])


def test_float16_steps_of_a_region_computing_in_float_are_rounded_each():
    """A float16 region computes in float32; each float16 step is rounded to float16, as the
    operators define it (and onnxruntime computes node by node): erf(0.676) - 0.2041 is 0.45654
    in float16, not the 0.45667 of float32 that rounds to 0.4568 only at the end, so
    Equal(erf(x) - a, b) with b = 0.4568 is False (fuzz seed 12802)."""
    from onnxfuse.fuzz import optimize_model

    h = TensorProto.FLOAT16
    nodes = [helper.make_node("Erf", ["x"], ["e"]), helper.make_node("Sub", ["e", "a"], ["d"]),
             helper.make_node("Equal", ["d", "b"], ["eq"]), helper.make_node("Where", ["eq", "b", "x"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "half_region", [helper.make_tensor_value_info(n, h, [16]) for n in ("x", "a", "b")],
        [helper.make_tensor_value_info("y", h, [16])]), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    opt = optimize_model(model)
    assert any(n.domain == "onnxfuse" for n in opt.graph.node)
    feeds = {"x": np.full(16, 14696, np.uint16).view(np.float16), "a": np.full(16, 0.2041, np.float16),
             "b": np.full(16, 14159, np.uint16).view(np.float16)}
    d = (np.float16(math.erf(float(feeds["x"][0]))) - feeds["a"][0]).astype(np.float16)
    assert d.view(np.uint16) == 14158  # one float16 ulp below b: the steps rounded, they differ
    got = runtime.make_session(opt, threads=1, with_library=True, level="disable").run(None, feeds)[0]
    assert (_bits(got) == _bits(feeds["x"])).all(), got


def test_float16_leaky_relu_rounds_its_output_not_its_inner_steps():
    """A float16 node computed in float rounds what it stores, once: LeakyRelu of the smallest
    negative subnormal gives -0 (the product rounds to -0), and a second LeakyRelu keeps it, as
    in onnxruntime. Rounding the inner product before the lowering's own "+ 0" step gave +0
    (fuzz seeds 12323, 15646)."""
    from onnxfuse.fuzz import optimize_model

    h = TensorProto.FLOAT16
    nodes = [helper.make_node("LeakyRelu", ["x"], ["t"], alpha=0.49384218),
             helper.make_node("LeakyRelu", ["t"], ["y"], alpha=0.1651976)]
    model = helper.make_model(helper.make_graph(nodes, "half_leaky", [helper.make_tensor_value_info("x", h, [16])],
                                                [helper.make_tensor_value_info("y", h, [16])]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    opt = optimize_model(model)
    assert any(n.domain == "onnxfuse" for n in opt.graph.node)
    x = np.array([-6e-8, 6e-8, -0.0, 0.0, -1.2e-7, 1e-4, np.inf, -np.inf] * 2, np.float16)
    want = _run(model, {"x": x}, False)
    got = runtime.make_session(opt, threads=1, with_library=True, level="disable").run(None, {"x": x})[0]
    assert np.signbit(want[0]) and (_bits(got) == _bits(want)).all(), (got, want)
