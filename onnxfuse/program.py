"""The expression program: one description of a fused pointwise region, read by every backend.

A fused `onnxfuse.Pointwise` node carries its program as the string attribute ``program``.
The text is line-oriented and meant to be read by people::

    in x0 f32 view=1:0:128:1
    in x1 f32
    t0 = add x0 x1
    t1 = sigmoid t0
    t2 = mul t1 0.5
    t3 = leakyrelu[0.01] t2
    out t3 f32
    out t1 f16

Statements
    ``in NAME DTYPE [view=AXIS:START:END:STEP[,AXIS:START:END:STEP...]]``
        One line per node input, in node-input order; names are ``x0, x1, ...``.
        A view reads a slice of the tensor given to the node, with ONNX Slice semantics
        (negative indices count from the end, bounds are clamped) resolved against the
        tensor's shape at run time, so a Slice or Split output is read in place.
    ``tK = OP[PARAMS] ARG ...``
        SSA instruction. ARG is an earlier name or a numeric literal (``1.5``, ``-inf``,
        ``nan``). PARAMS are comma-separated literals fixed per op (see OPS).
    ``out NAME DTYPE``
        One line per node output, in node-output order. NAME may be an input or any
        instruction result; DTYPE is the node output's element type.

Semantics
    The iteration shape is the multidirectional (numpy) broadcast of every input's shape
    (after its view). Every output has the iteration shape: a value that does not depend on
    all inputs is broadcast when it is stored. Arithmetic runs in the program's compute type:
    f64 if any input or output is f64, otherwise f32 (f16 and bf16 values are widened on load
    and rounded on store; ``cast[f16]`` rounds to half precision in the middle of a chain).
    bool values are 0 or 1 in the compute type.

The numpy evaluator in this module is the reference every backend is tested against.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .graph.slices import slice_indices

DTYPES = {
    "f16": np.float16,
    "bf16": None,  # numpy has no bfloat16; see _to_bf16
    "f32": np.float32,
    "f64": np.float64,
    "bool": np.bool_,
}
# ONNX TensorProto element types of each program dtype.
ONNX_ELEM = {"f16": 10, "bf16": 16, "f32": 1, "f64": 11, "bool": 9}
DTYPE_OF_ONNX = {v: k for k, v in ONNX_ELEM.items()}


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 precision (round to nearest even), kept as float32."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(x, np.float32))
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    out = b.view(np.float32)
    return np.where(nan, np.float32("nan"), out)


def _erf(x):
    from math import erf

    return np.vectorize(erf, otypes=[x.dtype])(x) if x.size else x.copy()


# onnxruntime's float32 Tanh below 2^-12: (x * P(0)) / Q(0) of its rational, each step rounded
# (kernels/numeric.h, kTanhTiny).
_TANH_TINY, _ORT_TANH_P0, _ORT_TANH_Q0 = np.float32(2.0 ** -12), np.float32(0.0048935246), np.float32(0.004893525)


def _tanh(x):
    y = np.tanh(x)
    if x.dtype == np.float32:
        y = np.where(np.abs(x) < _TANH_TINY, (x * _ORT_TANH_P0) / _ORT_TANH_Q0, y)
    return y


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return 1 / (1 + np.exp(-x))


def _clamp(x, lo, hi):
    """x < lo ? lo : x, then > hi ? hi: onnxruntime's Clip. A NaN x passes, a NaN bound does
    nothing, and a zero bound leaves -0 as it is (np.clip and np.maximum would not)."""
    r = np.where(x < lo, lo, x)
    return np.where(r > hi, hi, r).astype(np.asarray(x).dtype)


def _softplus(x):
    with np.errstate(over="ignore"):
        return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(x.dtype)


@dataclass(frozen=True)
class OpDef:
    """An instruction: its operand count, its parameter count and its numpy meaning."""

    name: str
    arity: int
    nparams: int
    fn: Callable
    result: str = "same"  # "same": compute type; "bool": a predicate


def _u(name, fn, nparams=0, result="same"):
    return OpDef(name, 1, nparams, fn, result)


def _b(name, fn, result="same"):
    return OpDef(name, 2, 0, fn, result)


_OPS: list[OpDef] = [
    # unary
    _u("neg", lambda a: -a),
    _u("abs", np.abs),
    _u("sqrt", np.sqrt),
    _u("recip", lambda a: 1 / a),
    _u("exp", np.exp),
    _u("log", np.log),
    _u("erf", _erf),
    _u("tanh", _tanh),
    _u("sigmoid", _sigmoid),
    _u("relu", lambda a: np.where(a < 0, np.zeros_like(a), a)),  # as ORT: -0 and NaN stay, -inf -> +0
    _u("softplus", _softplus),
    _u("softsign", lambda a: a * (1 / (1 + np.abs(a)))),  # as ORT: times the reciprocal
    _u("floor", np.floor),
    _u("ceil", np.ceil),
    _u("round", np.round),  # half to even, as ONNX Round
    _u("sign", lambda a: np.where(a > 0, 1, np.where(a < 0, -1, np.where(np.isnan(a), a, 0))).astype(a.dtype)),  # +-0 -> +0
    _u("sin", np.sin),
    _u("cos", np.cos),
    _u("tan", np.tan),
    _u("asin", np.arcsin),
    _u("acos", np.arccos),
    _u("atan", np.arctan),
    _u("sinh", np.sinh),
    _u("cosh", np.cosh),
    _u("asinh", np.arcsinh),
    _u("acosh", np.arccosh),
    _u("atanh", np.arctanh),
    _u("hardswish", lambda a: a * _clamp(a * (a.dtype.type(1) / a.dtype.type(6)) + a.dtype.type(0.5), 0, 1)),
    _u("not", lambda a: (a == 0), result="bool"),
    _u("isnan", np.isnan, result="bool"),
    # unary with parameters
    _u("leakyrelu", lambda a, alpha: np.where(a < 0, alpha * a, a), 1),
    _u("elu", lambda a, alpha: np.where(a < 0, alpha * (np.exp(a) - 1), a), 1),
    _u("selu", lambda a, alpha, gamma: np.where(a <= 0, gamma * (alpha * (np.exp(a) - 1)), gamma * a), 2),
    _u("celu", lambda a, alpha: np.maximum(0, a) + np.minimum(0, alpha * (np.exp(a / alpha) - 1)), 1),
    _u("hardsigmoid", lambda a, alpha, beta: _clamp(alpha * a + beta, 0, 1), 2),
    _u("thresholdedrelu", lambda a, alpha: np.where(a > alpha, a, np.zeros_like(a)), 1),  # as ORT: NaN, -inf -> 0
    _u("clip", lambda a, lo, hi: _clamp(a, lo, hi), 2),  # as ORT: NaN passes, -0 stays at a bound of 0
    # cast[DTYPE]: exact ONNX Cast between the program dtypes (f16/bf16 round, bool is x != 0)
    OpDef("cast", 1, 1, None),
    # binary
    _b("add", lambda a, b: a + b),
    _b("sub", lambda a, b: a - b),
    _b("mul", lambda a, b: a * b),
    _b("div", lambda a, b: a / b),
    _b("pow", np.power),
    _b("min", np.minimum),  # NaN-propagating
    _b("max", np.maximum),  # NaN-propagating
    _b("prelu", lambda a, s: np.where(a < 0, a * s, a)),
    _b("eq", np.equal, "bool"),
    _b("lt", np.less, "bool"),
    _b("le", np.less_equal, "bool"),
    _b("gt", np.greater, "bool"),
    _b("ge", np.greater_equal, "bool"),
    _b("and", lambda a, b: (a != 0) & (b != 0), "bool"),
    _b("or", lambda a, b: (a != 0) | (b != 0), "bool"),
    _b("xor", lambda a, b: (a != 0) ^ (b != 0), "bool"),
    # ternary: where COND A B
    OpDef("where", 3, 0, lambda c, a, b: np.where(c != 0, a, b)),
]
OPS: dict[str, OpDef] = {op.name: op for op in _OPS}


@dataclass(frozen=True)
class SliceSpec:
    """One axis of a view: ONNX Slice semantics, resolved against the runtime shape."""

    axis: int
    start: int
    end: int
    step: int = 1


@dataclass
class Input:
    name: str
    dtype: str
    view: tuple[SliceSpec, ...] = ()


@dataclass
class Instr:
    dst: str
    op: str
    args: tuple  # each a name (str) or a float literal
    params: tuple = ()  # floats, or a dtype string for cast


@dataclass
class Output:
    name: str  # the value stored
    dtype: str


@dataclass
class Program:
    inputs: list[Input] = field(default_factory=list)
    instrs: list[Instr] = field(default_factory=list)
    outputs: list[Output] = field(default_factory=list)

    # ---- construction helpers -------------------------------------------------------
    def add_input(self, dtype: str, view: Sequence[SliceSpec] = ()) -> str:
        name = f"x{len(self.inputs)}"
        self.inputs.append(Input(name, dtype, tuple(view)))
        return name

    def emit(self, op: str, *args, params: Sequence = ()) -> str:
        name = f"t{len(self.instrs)}"
        self.instrs.append(Instr(name, op, tuple(args), tuple(params)))
        return name

    def add_output(self, value: str, dtype: str) -> None:
        self.outputs.append(Output(value, dtype))

    @property
    def compute_dtype(self) -> str:
        types = {i.dtype for i in self.inputs} | {o.dtype for o in self.outputs}
        types |= {ins.params[0] for ins in self.instrs if ins.op == "cast"}
        return "f64" if "f64" in types else "f32"

    # ---- text form ------------------------------------------------------------------
    def to_text(self) -> str:
        lines = []
        for i in self.inputs:
            line = f"in {i.name} {i.dtype}"
            if i.view:
                line += " view=" + ",".join(f"{s.axis}:{s.start}:{s.end}:{s.step}" for s in i.view)
            lines.append(line)
        for ins in self.instrs:
            lines.append(f"{ins.dst} = {op_text(ins.op, ins.params)} " + " ".join(_fmt(a) for a in ins.args))
        for o in self.outputs:
            lines.append(f"out {o.name} {o.dtype}")
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str) -> "Program":
        prog = cls()
        defined: set[str] = set()
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                tok = line.split()
                if tok[0] == "in":
                    name, dtype = tok[1], tok[2]
                    _check_dtype(dtype)
                    view: tuple[SliceSpec, ...] = ()
                    if len(tok) > 3:
                        if not tok[3].startswith("view="):
                            raise ValueError(f"unknown input option {tok[3]!r}")
                        view = tuple(
                            SliceSpec(*(int(v) for v in s.split(":"))) for s in tok[3][5:].split(",")
                        )
                    if name != f"x{len(prog.inputs)}":
                        raise ValueError(f"input {name!r} out of order")
                    prog.inputs.append(Input(name, dtype, view))
                    defined.add(name)
                elif tok[0] == "out":
                    if tok[1] not in defined:
                        raise ValueError(f"output of undefined value {tok[1]!r}")
                    _check_dtype(tok[2])
                    prog.outputs.append(Output(tok[1], tok[2]))
                else:
                    if tok[1] != "=":
                        raise ValueError("expected 'NAME = OP ARGS'")
                    dst, opspec, args = tok[0], tok[2], tok[3:]
                    m = re.fullmatch(r"([a-z_]+)(?:\[([^\]]*)\])?", opspec)
                    if not m or m.group(1) not in OPS:
                        raise ValueError(f"unknown op {opspec!r}")
                    op = OPS[m.group(1)]
                    params: tuple = ()
                    if m.group(2):
                        parts = m.group(2).split(",")
                        params = (parts[0],) if op.name == "cast" else tuple(float(p) for p in parts)
                    if op.name == "cast":
                        _check_dtype(params[0] if params else "?")
                    if len(params) != op.nparams or len(args) != op.arity:
                        raise ValueError(f"{op.name} takes {op.arity} args and {op.nparams} params")
                    parsed = []
                    for a in args:
                        if re.fullmatch(r"[xt]\d+", a):
                            if a not in defined:
                                raise ValueError(f"use of undefined value {a!r}")
                            parsed.append(a)
                        else:
                            parsed.append(float(a))
                    if dst != f"t{len(prog.instrs)}":
                        raise ValueError(f"instruction {dst!r} out of order")
                    prog.instrs.append(Instr(dst, op.name, tuple(parsed), params))
                    defined.add(dst)
            except (IndexError, ValueError, TypeError) as e:  # TypeError: a view with too few fields
                raise ValueError(f"program line {lineno}: {raw.strip()!r}: {e}") from None
        return prog

    # ---- reference semantics ----------------------------------------------------------
    def evaluate(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """Run the program with numpy: the reference for every backend."""
        if len(arrays) != len(self.inputs):
            raise ValueError(f"program takes {len(self.inputs)} inputs, got {len(arrays)}")
        ct = np.float64 if self.compute_dtype == "f64" else np.float32
        env: dict[str, np.ndarray] = {}
        for spec, arr in zip(self.inputs, arrays):
            arr = apply_view(np.asarray(arr), spec.view)
            env[spec.name] = arr.astype(ct)
        shape = np.broadcast_shapes(*(env[i.name].shape for i in self.inputs)) if self.inputs else ()

        def val(a):
            return env[a] if isinstance(a, str) else ct(a)

        with np.errstate(all="ignore"):
            for ins in self.instrs:
                op = OPS[ins.op]
                args = [val(a) for a in ins.args]
                if op.name == "cast":
                    res = cast_values(args[0], ins.params[0]).astype(ct)
                else:
                    res = op.fn(*args, *[ct(p) for p in ins.params])
                env[ins.dst] = np.asarray(res).astype(ct)
        outs = []
        for o in self.outputs:
            v = np.broadcast_to(env[o.name], shape)
            outs.append(store_values(v, o.dtype))
        return outs


def op_text(op: str, params: Sequence = ()) -> str:
    """An instruction's op as the text format writes it: `relu`, `leakyrelu[0.01]`."""
    return op + ("[" + ",".join(_fmt(p) for p in params) + "]" if params else "")


def _fmt(v) -> str:
    if isinstance(v, str):
        return v
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def _check_dtype(d: str) -> None:
    if d not in DTYPES:
        raise ValueError(f"unknown dtype {d!r}")


def cast_values(x: np.ndarray, dtype: str) -> np.ndarray:
    """ONNX Cast to a program dtype, result kept in the value's own float type."""
    if dtype == "bool":
        return (x != 0).astype(x.dtype)
    if dtype == "f16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(x.dtype)
    if dtype == "bf16":
        return _to_bf16(x).astype(x.dtype)
    if dtype == "f32":
        return x.astype(np.float32).astype(x.dtype)
    return x


def _contiguous(x) -> np.ndarray:
    """A C-contiguous copy that keeps rank 0 (np.ascontiguousarray makes 0-d arrays 1-d)."""
    return np.array(x, order="C", copy=True)


def store_values(x: np.ndarray, dtype: str) -> np.ndarray:
    """The stored form of a value for an output of the given dtype."""
    if dtype == "bool":
        return _contiguous(x != 0)
    if dtype == "bf16":
        return _contiguous(_to_bf16(x))  # bf16 values as float32 (numpy has no bfloat16)
    with np.errstate(over="ignore"):
        return _contiguous(x.astype(DTYPES[dtype]))


def resolve_slice(dim: int, spec: SliceSpec) -> tuple[int, int, int]:
    """(start, step, length) of an ONNX Slice along a dimension of size `dim`."""
    if spec.step == 0:
        raise ValueError("slice step 0")
    taken = slice_indices(dim, spec.start, spec.end, spec.step)
    return taken.start, spec.step, len(taken)


def apply_view(arr: np.ndarray, view: Sequence[SliceSpec]) -> np.ndarray:
    for s in view:
        axis = s.axis + arr.ndim if s.axis < 0 else s.axis
        start, step, length = resolve_slice(arr.shape[axis], s)
        idx = [slice(None)] * arr.ndim
        idx[axis] = slice(start, start + step * length, step) if length else slice(0, 0)
        if step < 0 and length:
            stop = start + step * length
            idx[axis] = slice(start, stop if stop >= 0 else None, step)
        arr = arr[tuple(idx)]
    return arr
