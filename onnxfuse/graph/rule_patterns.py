"""The pattern vocabulary of the rule engine (onnxfuse/graph/rules.py, which re-exports it):
Var, Const, Rest, ANY, alt, through and op patterns built by `op.Name(...)` or Python arithmetic."""
from __future__ import annotations

from dataclasses import dataclass


def _binary(op_type: str, reflected: bool = False):
    """The operator method that builds op_type(self, other), or op_type(other, self)."""

    def method(self, other):
        operands = (_lift(other), self) if reflected else (self, _lift(other))
        return OpPattern(op_type, operands)

    return method


class Pattern:
    """Base of pattern expressions; Python arithmetic builds op patterns."""

    __add__, __radd__ = _binary("Add"), _binary("Add", reflected=True)
    __sub__, __rsub__ = _binary("Sub"), _binary("Sub", reflected=True)
    __mul__, __rmul__ = _binary("Mul"), _binary("Mul", reflected=True)
    __truediv__, __rtruediv__ = _binary("Div"), _binary("Div", reflected=True)


@dataclass(frozen=True, eq=False)
class Var(Pattern):
    """Any tensor; bound under `name`, the same tensor wherever the name recurs."""

    name: str


@dataclass(frozen=True, eq=False)
class Const(Pattern):
    """A constant of one element (initializer or Constant node): equal to `value` within `rtol`
    when a value is given; its value is bound under `name` when one is given."""

    value: float | None = None
    name: str | None = None
    rtol: float = 0.0


@dataclass(frozen=True, eq=False)
class Rest(Pattern):
    """The last operand of an op pattern: every input that remains (at least `min`, present or
    omitted), bound under `name` as a tuple."""

    name: str
    min: int = 0


@dataclass(frozen=True, eq=False)
class AnyInput(Pattern):
    """Any operand, an omitted optional input included (the rule's condition looks at it)."""


ANY = AnyInput()


@dataclass(frozen=True, eq=False)
class Alt(Pattern):
    """One of several patterns for the same operand, tried in order (alternatives as data):
    `alt(x * Const(name="c"), x / Const(name="c"), x)` is x scaled by a constant or not. A name
    bound in one alternative only is absent from a match through another (Match.get)."""

    options: tuple[Pattern, ...]


@dataclass(frozen=True, eq=False)
class Through(Pattern):
    """`inner`, reached through at most `most` nodes of the default-domain ops `ops` (a bounded
    path: each passed node's first output is the tensor, and the path goes on at each of its
    `operands` in turn); at each node the inner pattern is
    tried before the path goes deeper. The nodes passed, reader first, are bound
    under `name` as a tuple when one is given. `through(["Unsqueeze"], op.Range(...), 12)` is a
    Range with axes inserted."""

    ops: tuple[str, ...]
    inner: Pattern
    most: int
    operands: tuple[int, ...] = (0,)
    name: str | None = None


def through(ops, inner, most: int, operand: int | tuple[int, ...] = 0, name: str | None = None) -> Through:
    """Through `ops` at operand `operand` (an index, or a tuple of them tried in turn)."""
    operands = (operand,) if isinstance(operand, int) else tuple(operand)
    return Through(tuple(ops), _lift(inner), most, operands, name)


def alt(*options) -> Alt:
    return Alt(tuple(_lift(o) for o in options))


@dataclass(frozen=True, eq=False)
class OpPattern(Pattern):
    """A node of op `op` in `domain` ("": the default ONNX domain) whose inputs match `inputs`
    (a node with more inputs than patterns has them omitted, unless the last pattern is Rest).

    attrs: attribute values the node must have (a callable is a predicate on the value, which is
    None when the attribute is absent); name: the node is bound under it; outputs: how many
    outputs the node may have (None: any); value: its output is bound under this name as a Var
    is, the same tensor wherever the name recurs (a value read twice, once before the pattern
    that computes it: Where(IsNaN(Var("p")), 0, op.Softmax(x, _value="p")))."""

    op: str
    inputs: tuple[Pattern, ...]
    attrs: tuple[tuple[str, object], ...] = ()
    name: str | None = None
    outputs: int | None = 1
    domain: str = ""
    value: str | None = None

    def __post_init__(self) -> None:
        if any(isinstance(p, Rest) for p in self.inputs[:-1]):
            raise ValueError(f"{self.op}: Rest must be the last operand")

    @property
    def fixed(self) -> tuple[Pattern, ...]:
        """The operand patterns before a Rest."""
        return self.inputs[:-1] if self.inputs and isinstance(self.inputs[-1], Rest) else self.inputs

    @property
    def label(self) -> str:
        return self.op if not self.domain else f"{self.domain}.{self.op}"


def _lift(value) -> Pattern:
    if isinstance(value, Pattern):
        return value
    if isinstance(value, (int, float)):
        return Const(float(value))
    raise TypeError(f"cannot use {value!r} in a pattern")


class _OpBuilder:
    """`op.Relu(x)`, `op.HardSigmoid(x, alpha=0.2, _name="gate")`: op patterns by name, in the
    builder's domain (`_name`, `_outputs`, `_value`: OpPattern's name, outputs and value)."""

    def __init__(self, domain: str = "") -> None:
        self._domain = domain

    def __getattr__(self, op: str):
        if op.startswith("_"):
            raise AttributeError(op)

        def build(*inputs, _name: str | None = None, _outputs: int | None = 1, _value: str | None = None,
                  **attrs) -> OpPattern:
            return OpPattern(op, tuple(_lift(i) for i in inputs), tuple(sorted(attrs.items())), _name, _outputs,
                             self._domain, _value)

        return build


op = _OpBuilder()


def ops(domain: str) -> _OpBuilder:
    """Op patterns of `domain`: `ops("com.microsoft").MultiHeadAttention(q, k, v, Rest("more"))`."""
    return _OpBuilder("" if domain == "ai.onnx" else domain)
