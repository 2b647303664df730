"""Op vocabularies the passes match on."""
from __future__ import annotations

from typing import Callable

from .activations import TABLE
from .rules import ANY, Const, OpPattern, Rest, Rule, Var, op

# Unary elementwise ops an activation may be (equal attributes across members required).
ACTIVATIONS = {a.op for a in TABLE} | {"Gelu", "Mish", "Erf", "Abs", "Neg", "Exp", "Log", "Sqrt"}


# Ops the pointwise-fusion pass fuses: a Split piece read only by these is read in place.
# An activation node of one input (no optional bounds) reading "y": the first that matches.
ACTIVATION_RULES = tuple(Rule(f"activation/{a}", getattr(op, a)(Var("y"), Rest("more")),
                              condition=lambda m, graph: not m["more"]) for a in sorted(ACTIVATIONS))
ELEMENTWISE = ACTIVATIONS | {
    "Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "PRelu", "Where", "Clip", "Reciprocal",
    "Floor", "Ceil", "Round", "Sign", "Cast", "Not", "And", "Or", "Equal", "Less", "Greater",
    "Sin", "Cos",
}
# Ops whose outputs are views of their input: a region reads them in place.
VIEW_OPS = ("Slice", "Split")


# GELU as exporters write it: 0.5 x (1 + erf(x / sqrt 2)) (Gelu), the tanh approximation
# 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (FastGelu) and x * sigmoid(a x) (QuickGelu;
# SiLU is a = 1). Constants are any scalars (`c()`): which values onnxruntime accepts is its own
# business (ort_fusions asks the graph it executes). A new core is one line of GELU_CORES and
# comes in every grouping; any other new form is one line of GELU_FORMS.
x = Var("x")
c = Const
GELU_CORES: tuple[tuple[str, OpPattern], ...] = (
    ("erf", op.Erf(x / c())),  # erf(x / sqrt 2)
    ("erf", op.Erf(x * c())),  # erf(x * (1 / sqrt 2))
    ("tanh", op.Tanh((x + c() * op.Pow(x, c())) * c())),  # tanh(sqrt(2/pi) (x + 0.044715 x^3))
    ("tanh", op.Tanh((x + c() * (x * (x * x))) * c())),  # the cube as products
)
# The groupings of 0.5 * x * (1 + core) exporters write.
GELU_GROUPINGS: tuple[Callable[[OpPattern], OpPattern], ...] = (
    lambda core: (x * c()) * (core + c()),
    lambda core: (x * (core + c())) * c(),
    lambda core: x * ((core + c()) * c()),
)
GELU_FORMS: tuple[tuple[str, OpPattern], ...] = (
    *((kind, grouping(core)) for kind, core in GELU_CORES for grouping in GELU_GROUPINGS),
    ("sigmoid", x * op.Sigmoid(x * c())),  # QuickGelu
    ("sigmoid", x * op.Sigmoid(x)),  # SiLU
)


# Embedding lookups: a Gather of rows of a table on axis 0.
def _rows(axis) -> bool:
    return axis is None or axis == 0


table, ids = Var("table"), Var("ids")
# The position embedding as Hugging Face's models write it: the table's rows at ids taken from a
# registered `position_ids` buffer (an arange over the table's rows) by `[:, :seq]`.
POSITION_LOOKUP = op.Gather(table, op.Slice(Var("positions"), ANY, ANY, ANY, ANY, _name="ids_slice"),
                            axis=_rows, _name="lookup")
# Any lookup; the rule's condition proves what the ids are (token type ids from an all-zero buffer).
TABLE_LOOKUP = op.Gather(table, ids, axis=_rows, _name="lookup")
# Elementwise ops that broadcast their two operands: a reader for which a lookup's result may
# be replaced by a value of lower rank that broadcasts to the same result.
BROADCASTING_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min"})


# A GatherND whose index tuples are the output's own coordinates: component k an arange over
# axis p_k of the output, broadcast by Expand and stacked on a new last axis (the dynamo
# exporter's form of transformers' padding mask, `mask[batch_arange, None, None, kv_arange]`,
# gathered for a 2-D mask). The rule's condition proves the aranges and the axes.
def _last_axis(axis) -> bool:
    return axis == -1


def _grid_component(k: int) -> OpPattern:
    return op.Unsqueeze(op.Expand(Var(f"arange{k}"), ANY, _name=f"grid{k}"), ANY, _name=f"stack{k}")


INDEX_GRID_GATHER = op.GatherND(Var("data"), op.Concat(_grid_component(0), _grid_component(1), axis=_last_axis),
                                batch_dims=lambda b: b in (None, 0), _name="gather")
