"""Lowering of ONNX elementwise operators to expression-program instructions.

`lowerable(...)` says whether one ONNX node can become part of a Pointwise program (and why
not); `lower_node(...)` appends its instructions to a Program. Both work on plain values (op
type, attributes, opset, element types, constant operands) so that they are independent of how
a graph is represented.

An operand is a program value name (``"x0"``, ``"t3"``) or a Python float (a literal).
Attribute defaults follow the ONNX operator specification of the model's opset.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from onnx import TensorProto

from .graph.activations import TABLE as ACTIVATION_TABLE
from .program import DTYPE_OF_ONNX, Program

FLOAT_TYPES = {TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE}
BOOL = TensorProto.BOOL
PROGRAM_TYPES = FLOAT_TYPES | {BOOL}
# float32 lowest/max: the defaults of Clip's min/max attributes before opset 11.
FLT_LOWEST = float(np.finfo(np.float32).min)
FLT_MAX = float(np.finfo(np.float32).max)
# Widening conversions that change no value: Cast along them emits no instruction.
_EXACT = {
    ("f16", "f32"), ("f16", "f64"), ("bf16", "f32"), ("bf16", "f64"), ("f32", "f64"),
    ("bool", "f16"), ("bool", "bf16"), ("bool", "f32"), ("bool", "f64"),
}

UNARY = {
    "Neg": "neg", "Abs": "abs", "Sqrt": "sqrt", "Reciprocal": "recip", "Exp": "exp", "Log": "log",
    "Erf": "erf", "Floor": "floor", "Ceil": "ceil", "Round": "round", "Sign": "sign",
    "Sin": "sin", "Cos": "cos", "Tan": "tan", "Asin": "asin", "Acos": "acos", "Atan": "atan",
    "Sinh": "sinh", "Cosh": "cosh", "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh",
    "Not": "not", "IsNaN": "isnan",
    **{a.op: a.name for a in ACTIVATION_TABLE if not a.params},
}
BINARY = {
    "Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "PRelu": "prelu",
    "Equal": "eq", "Less": "lt", "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge",
    "And": "and", "Or": "or", "Xor": "xor",
}
VARIADIC = {"Sum": "add", "Max": "max", "Min": "min", "Mean": "add"}
# op -> ((attribute, default), ...): the program op's parameters, in order.
PARAM_UNARY = {a.op: (a.name, a.params) for a in ACTIVATION_TABLE if a.params}
SPECIAL = {"Clip", "Where", "Cast", "Identity", "Dropout", "IsInf", "Shrink", "Mish", "Gelu"}
# The first opset in which each operator has the semantics lowered here (broadcasting included).
MIN_OPSET = {
    "PRelu": 7, "Add": 7, "Sub": 7, "Mul": 7, "Div": 7, "Pow": 7, "Equal": 7, "Less": 7, "Greater": 7,
    "And": 7, "Or": 7, "Xor": 7, "Dropout": 7, "Sum": 8, "Max": 8, "Min": 8, "Mean": 8,
    "Where": 9, "Round": 11, "HardSwish": 14, "LessOrEqual": 12, "GreaterOrEqual": 12, "IsInf": 10,
    "Shrink": 9, "Mish": 18, "Gelu": 20, "Celu": 12, "Erf": 9, "Sign": 9, "IsNaN": 9,
    "Sinh": 9, "Cosh": 9, "Asinh": 9, "Acosh": 9, "Atanh": 9,
}

SUPPORTED_OPS = frozenset(UNARY) | frozenset(BINARY) | frozenset(VARIADIC) | frozenset(PARAM_UNARY) | SPECIAL
# Operators that compute nothing (onnxruntime removes them too): they do not count as work.
NO_OPS = frozenset({"Identity", "Dropout"})


class LoweringError(ValueError):
    """A node (or region) that cannot be expressed as a program."""


def program_dtype(elem_type: int | None) -> str | None:
    return DTYPE_OF_ONNX.get(elem_type) if elem_type is not None else None


def lowerable(
    op: str,
    attrs: dict,
    opset: int,
    in_types: Sequence[int | None],
    out_types: Sequence[int | None],
    constants: Sequence[np.ndarray | None],
    used_outputs: Sequence[bool],
) -> str | None:
    """None when the node can be lowered, else the reason it cannot (one short phrase).

    in_types/out_types: ONNX element types (None for an absent optional input/output);
    constants: the value of each input that is a constant, else None;
    used_outputs: whether each output is read by anything (or is a graph output).
    """
    if op not in SUPPORTED_OPS:
        return f"{op} is not elementwise"
    if opset < MIN_OPSET.get(op, 6):
        return f"{op} before opset {MIN_OPSET.get(op, 6)}"
    if op == "Dropout":
        if len(used_outputs) > 1 and any(used_outputs[1:]):
            return "Dropout mask is used"
        if len(constants) > 2 and in_types[2] is not None:
            mode = constants[2]
            if mode is None or bool(np.asarray(mode).reshape(-1)[0]):
                return "Dropout in training mode"
        in_types = in_types[:1]
    elif op == "Clip":
        for i in (1, 2):
            if i < len(in_types) and in_types[i] is not None and in_types[i] not in FLOAT_TYPES:
                return "Clip bound is not a float"
        in_types = in_types[:1]
    elif op == "Pow":
        # A constant integer exponent becomes a float operand; a computed one stays outside.
        if in_types[1] not in PROGRAM_TYPES and constants[1] is not None and np.asarray(constants[1]).dtype.kind in "iu":
            in_types = in_types[:1]
        if in_types[0] == BOOL:
            return "Pow of bool"
    elif op == "Cast":
        to = attrs.get("to")
        if to not in PROGRAM_TYPES:
            return "Cast to a type outside the program (integers, strings, float8)"
    elif op == "Gelu":
        if _attr_str(attrs, "approximate", "none") not in ("none", "tanh"):
            return "unknown Gelu approximation"
    elif op == "Identity":
        pass
    for t in list(in_types) + [t for t, u in zip(out_types, used_outputs) if u]:
        if t is not None and t not in PROGRAM_TYPES:
            return "integer or non-numeric value"
    if any(t is None for t in in_types[:1]):
        return "unknown element type"
    if op in BINARY and op not in ("Equal", "And", "Or", "Xor", "Pow"):
        if in_types[0] == BOOL:
            return f"{op} of bool"
    return None


def _attr_str(attrs: dict, name: str, default: str) -> str:
    v = attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else str(v)


def _attr_float(attrs: dict, name: str, default: float) -> float:
    v = attrs.get(name, default)
    return float(v)


_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
_NP_FLOAT = {TensorProto.FLOAT16: np.float16, TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}
# Operators with a jump: an operand a rounding away from it may land on its other side.
JUMP_OPS = frozenset({"Floor", "Ceil", "Round", "Sign", "Equal", "Less", "LessOrEqual", "Greater",
                      "GreaterOrEqual"})


def _rounded(prog: Program, value, elem_type: int | None):
    """`value` rounded to its half-precision type where it was computed in the program (program
    inputs and literals are exact already)."""
    if elem_type in _HALF and isinstance(value, str) and not value.startswith("x"):
        return prog.emit("cast", value, params=[program_dtype(elem_type)])
    return value


def lower_node(
    prog: Program,
    op: str,
    attrs: dict,
    opset: int,
    args: Sequence,
    in_types: Sequence[int | None],
    out_types: Sequence[int | None],
    constants: Sequence[np.ndarray | None] = (),
) -> list:
    """Append the instructions of one node; returns one operand per node output
    (None for outputs that have no value in the program, such as Dropout's mask)."""
    emit = prog.emit
    a = args[0] if args else None
    half = in_types[0] == TensorProto.FLOAT16 if in_types else False
    if (half or in_types[0] == TensorProto.DOUBLE) and op in ("PRelu", "LeakyRelu") and 16 <= opset <= 18:
        # onnxruntime's float16 and double kernels of these opsets give +0 where a negative x
        # times the slope is -0 (slope 0): the same here; a -0 x itself stays -0 there too.
        t = emit("prelu", a, args[1]) if op == "PRelu" else \
            emit("leakyrelu", a, params=[_attr_float(attrs, "alpha", 0.01)])
        return [emit("where", emit("lt", a, 0.0), emit("add", t, 0.0), t)]
    if op in JUMP_OPS and in_types[0] in _HALF:
        # A computed half-precision value is held unrounded in float32; rounding moves it across
        # the jump of these operators (a product of 1.1e-8 is 0 in float16, and Sign(0) is 0,
        # seed 35220 of the fuzzer): round their float operands to their own type first.
        args = [_rounded(prog, x, t) for x, t in zip(args, in_types)]
        a = args[0]
    if op == "Sign" and in_types[0] in _HALF:
        # onnxruntime's half-precision Sign gives 0 for NaN (its float and double Sign give NaN).
        return [emit("where", emit("isnan", a), 0.0, emit("sign", a))]
    if op == "Selu" and opset == 18 and in_types[0] in (TensorProto.FLOAT16, TensorProto.DOUBLE):
        # onnxruntime has no float16 or double Selu kernel: in an opset-18 model it runs the
        # operator's function body, Where(X < 0, gamma * (alpha * e^X - alpha), gamma * X), so
        # -0 gives -0 (its float kernel, and float16 ones of other opsets: +0).
        # Its steps as the body has them (alpha * e^x - alpha is +0 where e^x rounds to 1), with
        # alpha and gamma in X's type (CastLike); in float16 they run in float32 and round once
        # (onnxruntime drops the Cast pairs between its float32 stand-ins), as here.
        alpha, gamma = (float(np.asarray(_attr_float(attrs, k, d), _NP_FLOAT[in_types[0]]))
                        for k, d in PARAM_UNARY["Selu"][1])
        neg = emit("mul", emit("sub", emit("mul", emit("exp", a), alpha), alpha), gamma)
        return [emit("where", emit("lt", a, 0.0), neg, emit("mul", a, gamma))]
    if op == "Softplus" and opset == 18 and in_types[0] in (TensorProto.FLOAT16, TensorProto.DOUBLE):
        # As Selu: the function body, log(e^x + 1), which is inf where e^x overflows (x > 709.8
        # in double; float16's body runs in float32, x > 88.7) and +0 where e^x + 1 rounds to 1.
        return [emit("log", emit("add", emit("exp", a), 1.0))]
    if op in UNARY:
        return [emit(UNARY[op], a)]
    if op in PARAM_UNARY:
        name, params = PARAM_UNARY[op]
        return [emit(name, a, params=[_attr_float(attrs, k, d) for k, d in params])]
    if op == "Pow" and in_types[0] in (TensorProto.FLOAT, TensorProto.DOUBLE) \
            and isinstance(args[1], (int, float)) and float(args[1]) in (2.0, 3.0):
        # onnxruntime computes x^2 and x^3 as x * x and (x * x) * x (bit for bit); a general
        # pow per element would be both slower and a rounding away from it.
        square = emit("mul", a, a)
        return [square if float(args[1]) == 2.0 else emit("mul", square, a)]
    if op in BINARY:
        return [emit(BINARY[op], a, args[1])]
    if op in VARIADIC:
        operands = [x for x in args if x is not None]
        acc = operands[0]
        for x in operands[1:]:
            acc = emit(VARIADIC[op], acc, x)
        if op == "Mean" and len(operands) > 1:
            # onnxruntime multiplies the sum by the reciprocal of the count, rounded to the type
            # (1/3 in float32): dividing differs in the last bit for a third of the sums, which a
            # comparison with the mean turns into a jump (fuzz seed 43483).
            count = len(operands)
            inverse = 1.0 / count if in_types[0] == TensorProto.DOUBLE else float(np.float32(1) / np.float32(count))
            acc = emit("mul", acc, inverse)
        return [acc]
    if op in ("Identity", "Dropout"):
        return [a] + [None] * (len(out_types) - 1)
    if op == "Where":
        cond, x, y = args[:3]
        if in_types[1] != BOOL:
            # onnxruntime's Where gives +0 where it selects a -0 from X (from Y it keeps -0):
            # x + 0 is x for every other value, NaN and infinities included.
            x = (x + 0.0) if isinstance(x, float) else emit("add", x, 0.0)
        return [emit("where", cond, x, y)]
    if op == "Cast":
        to = attrs["to"]
        src, dst = program_dtype(in_types[0]), program_dtype(to)
        if src == dst:
            return [a]
        if (src, dst) in _EXACT:
            # A computed f16/bf16/f32 value is held in the wider compute type: round it to its
            # own type first, as onnxruntime stored it, so the widened value is the same.
            # Program inputs (x0, x1, ...) and bool values are exact already.
            if src != "bool" and isinstance(a, str) and not a.startswith("x"):
                return [emit("cast", a, params=[src])]
            return [a]
        if dst == "bool":
            a = _rounded(prog, a, in_types[0])  # nonzero is a jump too (see JUMP_OPS)
        return [emit("cast", a, params=[dst])]
    if op == "Clip":
        if opset < 11:
            lo, hi = _attr_float(attrs, "min", FLT_LOWEST), _attr_float(attrs, "max", FLT_MAX)
            return [emit("clip", a, params=[lo, hi])]
        # An absent bound is the type's lowest / largest finite value (onnxruntime's defaults):
        # Clip sends +-inf to them.
        lowest, largest = _finite_range(in_types[0])
        lo = args[1] if len(args) > 1 and args[1] is not None else lowest
        hi = args[2] if len(args) > 2 and args[2] is not None else largest
        if isinstance(lo, float) and isinstance(hi, float):
            return [emit("clip", a, params=[lo, hi])]
        # Tensor bounds: x < lo ? lo : x, then > hi ? hi, as onnxruntime evaluates Clip (a NaN
        # bound does nothing and -0 stays at a bound of 0, which max and min would not give).
        v = a
        if not (isinstance(lo, float) and lo == -math.inf):
            v = emit("where", emit("lt", v, lo), lo, v)
        if not (isinstance(hi, float) and hi == math.inf):
            v = emit("where", emit("gt", v, hi), hi, v)
        return [v]
    if op == "IsInf":
        pos, neg = int(attrs.get("detect_positive", 1)), int(attrs.get("detect_negative", 1))
        if pos and neg:
            return [emit("eq", emit("abs", a), math.inf)]
        if pos:
            return [emit("eq", a, math.inf)]
        if neg:
            return [emit("eq", a, -math.inf)]
        return [emit("gt", a, math.inf)]  # detects nothing: always false
    if op == "Shrink":
        lambd, bias = _attr_float(attrs, "lambd", 0.5), _attr_float(attrs, "bias", 0.0)
        if in_types[0] == TensorProto.DOUBLE:
            # onnxruntime's double Shrink computes in float (1e300 gives inf): the same here,
            # each step of it rounded to float.
            x32 = emit("cast", a, params=["f32"])
            below = emit("lt", x32, -lambd)
            above = emit("gt", x32, lambd)
            inner = emit("where", above, emit("cast", emit("sub", x32, bias), params=["f32"]), 0.0)
            return [emit("where", below, emit("cast", emit("add", x32, bias), params=["f32"]), inner)]
        below = emit("lt", a, -lambd)
        above = emit("gt", a, lambd)
        inner = emit("where", above, emit("sub", a, bias), 0.0)
        return [emit("where", below, emit("add", a, bias), inner)]
    if op == "Mish":
        return [emit("mul", a, emit("tanh", emit("softplus", a)))]
    if op == "Gelu":
        if _attr_str(attrs, "approximate", "none") == "tanh":
            cube = emit("mul", emit("mul", a, a), a)
            inner = emit("mul", emit("add", a, emit("mul", cube, 0.044715)), math.sqrt(2.0 / math.pi))
            return [emit("mul", emit("mul", a, 0.5), emit("add", emit("tanh", inner), 1.0))]
        e = emit("erf", emit("mul", a, 1.0 / math.sqrt(2.0)))
        return [emit("mul", emit("mul", a, 0.5), emit("add", e, 1.0))]
    raise LoweringError(f"no lowering for {op}")


def _finite_range(elem_type: int | None) -> tuple[float, float]:
    """(lowest, largest) finite value of a float element type (float32's when unknown)."""
    if elem_type == TensorProto.FLOAT16:
        return -65504.0, 65504.0
    if elem_type == TensorProto.BFLOAT16:
        big = float.fromhex("0x1.fep127")
        return -big, big
    if elem_type == TensorProto.DOUBLE:
        return -float(np.finfo(np.float64).max), float(np.finfo(np.float64).max)
    return FLT_LOWEST, FLT_MAX


def literal_value(value: np.ndarray | None) -> float | None:
    """The single value of a non-empty constant whose elements are all equal, else None."""
    if value is None:
        return None
    arr = np.asarray(value)
    if arr.size == 0 or arr.dtype.kind not in "fiub":
        return None
    flat = arr.reshape(-1)
    first = flat[0]
    if arr.dtype.kind == "f":
        if np.isnan(first):
            return float("nan") if np.isnan(flat).all() else None
        if not (flat == first).all():
            return None
    elif not (flat == first).all():
        return None
    return float(first)

