"""Lowering of ONNX elementwise ops to the expression program, checked numerically.

Each case runs one ONNX node in onnxruntime (graph optimizations off) and the lowered program
with Program.evaluate (the reference every backend implements) on the same inputs. Constant
operands are initializers in the model and literals in the program, as the pass writes them.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxfuse.lowering import (
    SUPPORTED_OPS,
    literal_value,
    lower_node,
    lowerable,
    program_dtype,
)
from onnxfuse.program import Program

F, H, D, B = T.FLOAT, T.FLOAT16, T.DOUBLE, T.BOOL
NP = {F: np.float32, H: np.float16, D: np.float64, B: np.bool_}
RNG = np.random.default_rng(1234)


def data(shape, dtype=F, kind="any"):
    if dtype == B:
        return RNG.random(shape) > 0.5
    x = {
        "any": lambda: RNG.standard_normal(shape) * 2,
        "pos": lambda: RNG.random(shape) * 4 + 0.05,
        "unit": lambda: RNG.uniform(-0.95, 0.95, shape),
        "ge1": lambda: RNG.random(shape) * 3 + 1.0,
        "halfway": lambda: np.round(RNG.standard_normal(shape) * 4) / 2,  # .5 cases for Round
    }[kind]()
    return np.asarray(x).astype(NP[dtype])


def run_case(op, inputs, attrs=None, opset=17, out_types=None, n_out=1, rtol=1e-5, atol=1e-6):
    """inputs: list of ("var" | "const", array, elem_type) or None (absent optional input)."""
    attrs = attrs or {}
    names, vis, inits, feeds = [], [], [], {}
    for i, spec in enumerate(inputs):
        if spec is None:
            names.append("")
            continue
        kind, arr, et = spec
        name = f"in{i}"
        names.append(name)
        if kind == "var":
            vis.append(helper.make_tensor_value_info(name, et, list(arr.shape)))
            feeds[name] = arr
        else:
            inits.append(numpy_helper.from_array(np.asarray(arr), name))
    out_names = [f"out{k}" for k in range(n_out)]
    node = helper.make_node(op, names, out_names, **attrs)
    graph = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info(o, T.UNDEFINED, None) for o in out_names], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    types = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    expected = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)

    in_types = [None if s is None else s[2] for s in inputs]
    outs_t = [types[o] for o in out_names]
    consts = [None if s is None or s[0] == "var" else np.asarray(s[1]) for s in inputs]
    reason = lowerable(op, node_attrs(node), opset, in_types, outs_t, consts, [True] + [False] * (n_out - 1))
    assert reason is None, reason
    prog = Program()
    args, arrays = [], []
    for s in inputs:
        if s is None:
            args.append(None)
        elif s[0] == "const" and literal_value(s[1]) is not None:
            args.append(literal_value(s[1]))
        else:
            args.append(prog.add_input(program_dtype(s[2]) or "f32"))
            arrays.append(np.asarray(s[1]))
    results = lower_node(prog, op, node_attrs(node), opset, args, in_types, outs_t, consts)
    prog.add_output(results[0] if not isinstance(results[0], float) else prog.emit("add", results[0], 0.0), program_dtype(outs_t[0]))
    # The text form is what the node carries: evaluate the parsed program.
    prog = Program.parse(prog.to_text())
    got = prog.evaluate(*arrays)[0]
    want = expected[0]
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if want.dtype == np.bool_:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)
    return prog


def node_attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def var(shape=(3, 4), dtype=F, kind="any"):
    return ("var", data(shape, dtype, kind), dtype)


def const(value, dtype=F):
    return ("const", np.asarray(value, dtype=NP.get(dtype, dtype)), dtype)


UNARY_KIND = {
    "Sqrt": "pos", "Log": "pos", "Reciprocal": "pos", "Asin": "unit", "Acos": "unit", "Atanh": "unit",
    "Acosh": "ge1", "Round": "halfway", "Tan": "unit",
}
UNARY = [
    "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Tanh", "Sigmoid", "Relu", "Softplus",
    "Softsign", "Floor", "Ceil", "Round", "Sign", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh",
    "Cosh", "Asinh", "Acosh", "Atanh", "HardSwish", "Identity", "IsNaN",
]


@pytest.mark.parametrize("op", UNARY)
def test_unary_op_matches_onnxruntime(op):
    x = var((2, 3, 5), kind=UNARY_KIND.get(op, "any"))
    if op == "IsNaN":
        x[1][0, 0, 0] = np.nan
    run_case(op, [x], opset=18, rtol=2e-5)


@pytest.mark.parametrize(
    "op,attrs",
    [
        ("LeakyRelu", {}), ("LeakyRelu", {"alpha": 0.3}),
        ("Elu", {}), ("Elu", {"alpha": 0.7}),
        ("Selu", {}), ("Selu", {"alpha": 1.5, "gamma": 2.0}),
        ("Celu", {}), ("Celu", {"alpha": 2.5}),
        ("HardSigmoid", {}), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
        ("ThresholdedRelu", {}), ("ThresholdedRelu", {"alpha": 0.5}),
        ("Shrink", {}), ("Shrink", {"lambd": 1.0, "bias": 0.25}),
        ("IsInf", {}), ("IsInf", {"detect_negative": 0}), ("IsInf", {"detect_positive": 0}),
        ("Mish", {}),
        ("Gelu", {}), ("Gelu", {"approximate": "tanh"}),
    ],
)
def test_op_with_attribute_defaults_matches_onnxruntime(op, attrs):
    x = var((4, 6))
    if op == "IsInf":
        x[1][0, :3] = [np.inf, -np.inf, np.nan]
    run_case(op, [x], attrs, opset=20, rtol=2e-5)


BINARY = ["Add", "Sub", "Mul", "Div", "Pow", "PRelu", "Max", "Min", "Sum", "Mean"]


SHAPES = [((3, 4), (3, 4)), ((2, 1, 4), (3, 1)), ((4,), (2, 3, 4)), ((3, 4), ())]


@pytest.mark.parametrize(
    "op,shapes",
    # PRelu's slope broadcasts to X (unidirectionally)
    [(op, s) for op in BINARY for s in SHAPES if op != "PRelu" or np.broadcast_shapes(*s) == s[0]],
)
def test_binary_op_broadcasts_like_onnxruntime(op, shapes):
    a, b = shapes
    x = var(a, kind="pos" if op == "Pow" else "any")
    y = var(b, kind="any")
    if op == "Pow":
        y = ("var", np.asarray(np.round(y[1]), np.float32), F)
    run_case(op, [x, y], rtol=3e-5)


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic_op_with_three_inputs(op):
    run_case(op, [var((2, 3)), var((3,)), var((1, 3))])


@pytest.mark.parametrize("op", ["Sum", "Max"])
def test_variadic_op_with_one_input_is_a_copy(op):
    run_case(op, [var((2, 3))])


@pytest.mark.parametrize("op", ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"])
def test_comparison_gives_bool(op):
    a = var((3, 4), kind="halfway")
    b = var((4,), kind="halfway")
    run_case(op, [a, b])


@pytest.mark.parametrize("op", ["And", "Or", "Xor", "Equal"])
def test_logic_on_bool(op):
    run_case(op, [var((3, 4), B), var((1, 4), B)])


def test_not_on_bool():
    run_case("Not", [var((3, 4), B)])


def test_where_broadcasts_condition_and_branches():
    run_case("Where", [var((3, 1), B), var((4,)), var((3, 4))])


@pytest.mark.parametrize("opset", [6, 13])
def test_clip_without_bounds(opset):
    run_case("Clip", [var((3, 4))], opset=opset)


def test_clip_attribute_bounds_before_opset_11():
    run_case("Clip", [var((3, 4))], {"min": -0.5, "max": 0.75}, opset=6)


def test_clip_constant_bounds_become_parameters():
    prog = run_case("Clip", [var((3, 4)), const(-0.5), const(1.0)], opset=13)
    assert [i.op for i in prog.instrs] == ["clip"] and prog.instrs[0].params == (-0.5, 1.0)


def test_clip_with_only_a_maximum_keeps_the_lowest_float_as_its_minimum():
    # onnxruntime's absent bound is the type's lowest value, so Clip sends -inf there.
    prog = run_case("Clip", [var((3, 4)), None, const(0.25)], opset=13)
    assert prog.instrs[0].params == (float(np.finfo(np.float32).min), 0.25)


def test_clip_tensor_bounds_become_compares_and_selects():
    # x < lo ? lo : x, then > hi ? hi: as onnxruntime, a NaN bound does nothing and -0 stays -0
    # at a bound of 0 (max and min would give NaN and +0).
    prog = run_case("Clip", [var((3, 4)), ("var", np.array(-0.5, np.float32), F), ("var", np.array(0.5, np.float32), F)], opset=13)
    assert [i.op for i in prog.instrs] == ["lt", "where", "gt", "where"]


@pytest.mark.parametrize(
    "src,dst",
    [(F, H), (F, D), (F, B), (H, F), (D, F), (B, F), (D, H)],
)
def test_cast_between_program_types(src, dst):
    run_case("Cast", [var((3, 5), src)], {"to": dst})


def test_cast_to_bfloat16_rounds():
    prog = Program()
    x = prog.add_input("f32")
    lowered = lower_node(prog, "Cast", {"to": T.BFLOAT16}, 17, [x], [F], [T.BFLOAT16])
    prog.add_output(lowered[0], "f32")
    v = np.array([1.0 + 2**-9, 3.14159], np.float32)
    got = prog.evaluate(v)[0]
    assert got[0] == 1.0 and abs(got[1] - 3.140625) < 1e-7


def test_exact_widening_cast_emits_nothing():
    prog = Program()
    x = prog.add_input("f16")
    assert lower_node(prog, "Cast", {"to": F}, 17, [x], [H], [F]) == [x]
    assert prog.instrs == []


def test_dropout_in_inference_is_the_identity():
    run_case("Dropout", [var((3, 4)), const(0.3)], opset=13)


def test_float16_chain_member():
    run_case("Add", [var((3, 4), H), var((4,), H)], rtol=1e-3, atol=1e-3)


def test_float64_op():
    run_case("Tanh", [var((3, 4), D)], rtol=1e-12, atol=1e-12)


def test_constant_integer_exponent_is_a_literal():
    prog = run_case("Pow", [var((3, 4), kind="pos"), ("const", np.array(5, np.int64), T.INT64)], opset=13)
    assert prog.instrs[0].args[1] == 5.0


@pytest.mark.parametrize("exponent", [2.0, 3.0])
def test_square_and_cube_are_multiplies_that_match_onnxruntime_bit_for_bit(exponent):
    # onnxruntime's CPU Pow computes x^2 and x^3 as x * x and (x * x) * x, not with pow().
    x = np.random.default_rng(3).standard_normal(4096).astype(np.float32) * 10
    prog = run_case("Pow", [("var", x, T.FLOAT), ("const", np.array(exponent, np.float32), T.FLOAT)])
    assert [i.op for i in prog.instrs] == ["mul"] * int(exponent - 1)
    g = helper.make_graph([helper.make_node("Pow", ["x", "e"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [x.size])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [x.size])],
                          [numpy_helper.from_array(np.array(exponent, np.float32), "e")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.array_equal(prog.evaluate(x)[0], want)


def test_every_supported_op_is_tested():
    import sys

    mod = sys.modules[__name__]
    source = open(mod.__file__).read()
    missing = [op for op in SUPPORTED_OPS if f'"{op}"' not in source]
    assert not missing, missing


@pytest.mark.parametrize(
    "op,in_types,out_types,consts,used,reason",
    [
        ("MatMul", [F, F], [F], [None, None], [True], "not elementwise"),
        ("Add", [T.INT64, T.INT64], [T.INT64], [None, None], [True], "integer"),
        ("Cast", [F], [T.INT32], [None], [True], "Cast to a type outside"),
        ("Cast", [T.INT64], [F], [None], [True], "integer"),
        ("Dropout", [F], [F, B], [None], [True, True], "mask is used"),
        ("Dropout", [F, F, B], [F], [None, None, None], [True], "training"),
        ("Pow", [F, T.INT64], [F], [None, None], [True], "integer"),
        ("Add", [B, B], [B], [None, None], [True], "of bool"),
        ("HardSwish", [F], [F], [None], [True], "before opset"),
    ],
)
def test_lowerable_refuses_with_a_reason(op, in_types, out_types, consts, used, reason):
    opset = 13
    got = lowerable(op, {"to": out_types[0]} if op == "Cast" else {}, opset, in_types, out_types, consts, used)
    assert got is not None and reason in got


def test_literal_value_needs_all_elements_equal():
    assert literal_value(np.full((2, 3), 0.5, np.float32)) == 0.5
    assert literal_value(np.array([1.0, 2.0], np.float32)) is None
    assert literal_value(np.zeros((0,), np.float32)) is None
    assert math.isnan(literal_value(np.array([np.nan, np.nan], np.float32)))
    assert literal_value(np.array([True])) == 1.0
