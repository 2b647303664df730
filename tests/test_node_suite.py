"""The ONNX backend node test cases, run through the CPU Pointwise kernel.

Independent of program.py's reference: for every ONNX op the program supports, each of its
backend test cases (onnx.backend.test.case.node) becomes a one-node model whose node is an
onnxfuse.Pointwise running the op as a program; its outputs must match the case's expected
outputs within the case's own tolerances. The ONNX -> program mapping here is deliberately local
and minimal (onnxfuse/lowering.py has the real lowering). Cases the program cannot express
(integer or string dtypes, non-constant Clip bounds...) are skipped with the reason.
"""
from __future__ import annotations

import functools
import importlib
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import runtime
from onnxfuse.program import Program

UNARY = {
    "Neg": "neg", "Abs": "abs", "Sqrt": "sqrt", "Reciprocal": "recip", "Exp": "exp", "Log": "log", "Erf": "erf",
    "Tanh": "tanh", "Sigmoid": "sigmoid", "Relu": "relu", "Softplus": "softplus", "Softsign": "softsign",
    "Floor": "floor", "Ceil": "ceil", "Round": "round", "Sign": "sign", "Sin": "sin", "Cos": "cos", "Tan": "tan",
    "Asin": "asin", "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh", "Asinh": "asinh",
    "Acosh": "acosh", "Atanh": "atanh", "HardSwish": "hardswish", "Not": "not", "IsNaN": "isnan",
}
# op -> (opcode, [(attribute, default)...]) for ops whose attributes become parameters.
WITH_PARAMS = {
    "LeakyRelu": ("leakyrelu", [("alpha", 0.01)]),
    "Elu": ("elu", [("alpha", 1.0)]),
    "Selu": ("selu", [("alpha", 1.67326319217681884765625), ("gamma", 1.05070102214813232421875)]),
    "Celu": ("celu", [("alpha", 1.0)]),
    "HardSigmoid": ("hardsigmoid", [("alpha", 0.2), ("beta", 0.5)]),
    "ThresholdedRelu": ("thresholdedrelu", [("alpha", 1.0)]),
}
BINARY = {
    "Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "PRelu": "prelu", "Equal": "eq",
    "Less": "lt", "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge", "And": "and", "Or": "or", "Xor": "xor",
}
VARIADIC = {"Min": "min", "Max": "max"}
OTHER = ("Clip", "Cast", "Where")
ALL_OPS = sorted([*UNARY, *WITH_PARAMS, *BINARY, *VARIADIC, *OTHER])
# The backend test module of each op (onnx/backend/test/case/node/<module>.py).
MODULES = {
    "And": "and_", "Not": "not_", "Or": "or_", "GreaterOrEqual": "greater_or_equal", "LessOrEqual": "less_or_equal",
    "IsNaN": "isnan",
}

PROGRAM_DTYPE = {TensorProto.FLOAT: "f32", TensorProto.DOUBLE: "f64", TensorProto.FLOAT16: "f16", TensorProto.BOOL: "bool"}


class Unsupported(Exception):
    """The case needs something the program cannot express."""


@functools.lru_cache(maxsize=None)
def node_cases() -> list:
    """Backend test cases of ALL_OPS. collect_testcases(op_type) imports the case modules only
    once per process, so we import just the modules of our ops and filter by op type."""
    from onnx.backend.test.case import node as case_node

    case_node._TargetOpType = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in ALL_OPS:
            importlib.import_module(f"{case_node.__name__}.{MODULES.get(op, op.lower())}")
    # One-node cases only: the *_expanded variants are the op's function body, other ops.
    return [c for c in case_node._NodeTestCases
            if len(c.model.graph.node) == 1 and c.model.graph.node[0].op_type in ALL_OPS]


def elem_type(vi: onnx.ValueInfoProto) -> int:
    return vi.type.tensor_type.elem_type


def dtype_of(elem: int) -> str:
    if elem not in PROGRAM_DTYPE:
        raise Unsupported(f"element type {TensorProto.DataType.Name(elem)} is not a program dtype")
    return PROGRAM_DTYPE[elem]


def to_program(case) -> tuple[str, list[int]]:
    """The program for a case's node, and which node inputs become Pointwise inputs (the rest
    are constants of the data set written into the program)."""
    node = case.model.graph.node[0]
    op = node.op_type
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    graph_in = {vi.name: vi for vi in case.model.graph.input}
    inputs, _ = case.data_sets[0]
    prog = Program()
    present = [i for i, name in enumerate(node.input) if name]
    used: list[int] = []

    def add(i: int) -> str:
        used.append(i)
        return prog.add_input(dtype_of(elem_type(graph_in[node.input[i]])))

    out_vi = case.model.graph.output[0]
    out_dtype = dtype_of(elem_type(out_vi))
    if op in UNARY:
        value = prog.emit(UNARY[op], add(0))
    elif op in WITH_PARAMS:
        code, spec = WITH_PARAMS[op]
        value = prog.emit(code, add(0), params=[float(attrs.get(name, default)) for name, default in spec])
    elif op in BINARY:
        value = prog.emit(BINARY[op], add(0), add(1))
    elif op in VARIADIC:
        value = add(present[0])
        for i in present[1:]:
            value = prog.emit(VARIADIC[op], value, add(i))
    elif op == "Where":
        value = prog.emit("where", add(0), add(1), add(2))
    elif op == "Cast":
        if set(attrs) - {"to"}:
            raise Unsupported(f"Cast attributes {sorted(set(attrs) - {'to'})}")
        value = prog.emit("cast", add(0), params=[dtype_of(attrs["to"])])
    elif op == "Clip":
        bounds = []
        for k, default in ((1, -np.inf), (2, np.inf)):
            if k < len(node.input) and node.input[k]:
                arr = np.asarray(inputs[present.index(k)])
                if arr.size != 1:
                    raise Unsupported("Clip bound is not a scalar")
                bounds.append(float(arr.reshape(-1)[0]))
            else:
                bounds.append(float(attrs.get("min" if k == 1 else "max", default)))
        value = prog.emit("clip", add(0), params=bounds)
    else:
        raise Unsupported(op)
    if set(attrs) and op not in WITH_PARAMS and op not in ("Cast", "Clip"):
        raise Unsupported(f"attributes {sorted(attrs)}")
    prog.add_output(value, out_dtype)
    return prog.to_text(), used


def pointwise_case_model(case, text: str, used: list[int]) -> onnx.ModelProto:
    node = case.model.graph.node[0]
    graph_in = {vi.name: vi for vi in case.model.graph.input}
    ins = [graph_in[node.input[i]] for i in used]
    pw = helper.make_node("Pointwise", [vi.name for vi in ins], [case.model.graph.output[0].name], name="pw",
                          domain="onnxfuse", program=text)
    graph = helper.make_graph([pw], case.name, ins, [case.model.graph.output[0]])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onnxfuse", 1)])
    model.ir_version = 10
    return model


def _case_ids():
    return [c.name for c in node_cases()]


@pytest.mark.parametrize("case", node_cases(), ids=_case_ids())
def test_backend_node_case_through_pointwise(case):
    node = case.model.graph.node[0]
    if len(case.model.graph.output) != 1:
        pytest.skip("more than one output")
    try:
        text, used = to_program(case)
    except Unsupported as e:
        pytest.skip(f"{node.op_type}: {e}")
    present = [i for i, name in enumerate(node.input) if name]
    for inputs, outputs in case.data_sets:
        arrays = [numpy_helper.to_array(a) if isinstance(a, onnx.TensorProto) else np.asarray(a) for a in inputs]
        feeds = {node.input[i]: arrays[present.index(i)] for i in used}
        session = runtime.make_session(pointwise_case_model(case, text, used), with_library=True, threads=2)
        (got,) = session.run(None, feeds)
        want = numpy_helper.to_array(outputs[0]) if isinstance(outputs[0], onnx.TensorProto) else np.asarray(outputs[0])
        assert got.dtype == want.dtype and got.shape == want.shape
        if want.dtype == np.bool_:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol, equal_nan=True)


def test_every_supported_op_has_backend_cases_that_run():
    """Every op of the mapping has backend cases, and at least one of them runs (the skipped
    ones are integer or string dtypes)."""
    runnable: dict[str, int] = {op: 0 for op in ALL_OPS}
    for c in node_cases():
        try:
            to_program(c)
            runnable[c.model.graph.node[0].op_type] += 1
        except Unsupported:
            pass
    # The suite's Equal cases are all integer or string typed (eq is covered by
    # test_pointwise_cpu against the reference).
    assert [op for op, n in runnable.items() if n == 0] == ["Equal"], runnable
