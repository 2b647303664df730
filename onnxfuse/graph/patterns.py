"""Op vocabularies the passes match on."""
from __future__ import annotations

from .activations import TABLE
from .rules import Const, OpPattern, Var, op

# Unary elementwise ops an activation may be (equal attributes across members required).
ACTIVATIONS = {a.op for a in TABLE} | {"Gelu", "Mish", "Erf", "Abs", "Neg", "Exp", "Log", "Sqrt"}


# Ops the pointwise-fusion pass fuses: a Split piece read only by these is read in place.
ELEMENTWISE = ACTIVATIONS | {
    "Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "PRelu", "Where", "Clip", "Reciprocal",
    "Floor", "Ceil", "Round", "Sign", "Cast", "Not", "And", "Or", "Equal", "Less", "Greater",
    "Sin", "Cos",
}
# Ops whose outputs are views of their input: a region reads them in place.
VIEW_OPS = ("Slice", "Split")


# GELU as exporters write it, one line per form: 0.5 x (1 + erf(x / sqrt 2)) (Gelu), the tanh
# approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (FastGelu) and x * sigmoid(a x)
# (QuickGelu; SiLU is a = 1). Constants are any scalars (`c()`): which values onnxruntime
# accepts is its own business (ort_fusions asks the graph it executes). The outer product
# 0.5 * x * (1 + core) comes in three groupings, the scale of x in erf as a Div or a Mul, the
# cube as Pow(x, 3) or x * (x * x).
x = Var("x")
c = Const
ERF_CORE_DIV = op.Erf(x / c())
ERF_CORE_MUL = op.Erf(x * c())
TANH_CORE_POW = op.Tanh((x + c() * op.Pow(x, c())) * c())
TANH_CORE_MUL = op.Tanh((x + c() * (x * (x * x))) * c())
GELU_FORMS: tuple[tuple[str, OpPattern], ...] = (
    ("erf", (x * c()) * (ERF_CORE_DIV + c())),
    ("erf", (x * (ERF_CORE_DIV + c())) * c()),
    ("erf", x * ((ERF_CORE_DIV + c()) * c())),
    ("erf", (x * c()) * (ERF_CORE_MUL + c())),
    ("erf", (x * (ERF_CORE_MUL + c())) * c()),
    ("erf", x * ((ERF_CORE_MUL + c()) * c())),
    ("tanh", (x * c()) * (TANH_CORE_POW + c())),
    ("tanh", (x * (TANH_CORE_POW + c())) * c()),
    ("tanh", x * ((TANH_CORE_POW + c()) * c())),
    ("tanh", (x * c()) * (TANH_CORE_MUL + c())),
    ("tanh", (x * (TANH_CORE_MUL + c())) * c()),
    ("tanh", x * ((TANH_CORE_MUL + c()) * c())),
    ("sigmoid", x * op.Sigmoid(x * c())),
    ("sigmoid", x * op.Sigmoid(x)),
)
