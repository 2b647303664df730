"""A small rule engine over onnx-graphsurgeon graphs: patterns as expressions, rules as data.

A pattern is written the way the subgraph computes its value:

    x = Var("x")
    HARD_SWISH = x * op.Clip(x + 3.0, 0.0, 6.0) / 6.0

`op.Name(...)` matches a node of that ONNX op (default domain) whose inputs match the operand
patterns; Python operators stand for Add, Sub, Mul and Div; a float is a scalar constant; a
`Var` matches any tensor, the same tensor wherever the name recurs. The engine takes care of:

- commuted operands of commutative ops (Add, Mul, Max, Min, Sum, And, Or, Xor, Equal): both
  orders are tried, so `x * 0.5` also matches Mul(0.5, x);
- constants: a scalar matches an initializer or a Constant node's output of one element;
- inputs that older opsets carried as attributes (Clip's min and max before opset 11);
- private intermediates: a matched node other than the root has every output read inside the
  match only, and none is a graph output (so the rewrite can drop them).

A Rule bundles a pattern, a condition on the match and a rewrite; `apply` is the pass loop
(every node in topological order tried as the root of every rule whose root op it has).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import onnx_graphsurgeon as gs

from . import core as gu

COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "Sum", "And", "Or", "Xor", "Equal"})
# Inputs that an op took as attributes in older opsets: (attribute per input position).
ATTRIBUTE_INPUTS = {"Clip": (None, "min", "max")}


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
class AnyInput(Pattern):
    """Any operand, an omitted optional input included (the rule's condition looks at it)."""


ANY = AnyInput()


@dataclass(frozen=True, eq=False)
class OpPattern(Pattern):
    """A node of ONNX op `op` (default domain) whose inputs match `inputs`.

    attrs: attribute values the node must have (a callable is a predicate on the value, which is
    None when the attribute is absent); name: the node is bound under it; outputs: how many
    outputs the node may have (None: any)."""

    op: str
    inputs: tuple[Pattern, ...]
    attrs: tuple[tuple[str, object], ...] = ()
    name: str | None = None
    outputs: int | None = 1


def _lift(value) -> Pattern:
    if isinstance(value, Pattern):
        return value
    if isinstance(value, (int, float)):
        return Const(float(value))
    raise TypeError(f"cannot use {value!r} in a pattern")


class _OpBuilder:
    """`op.Relu(x)`, `op.HardSigmoid(x, alpha=0.2, _name="gate")`: op patterns by name."""

    def __getattr__(self, op: str):
        def build(*inputs, _name: str | None = None, _outputs: int | None = 1, **attrs) -> OpPattern:
            return OpPattern(op, tuple(_lift(i) for i in inputs), tuple(sorted(attrs.items())), _name, _outputs)

        return build


op = _OpBuilder()


@dataclass
class Match:
    """A matched subgraph: its nodes (operands before readers, root last), what the pattern's
    names are bound to, and the root's output."""

    nodes: list[gs.Node]
    bindings: dict[str, object]
    output: gs.Tensor

    @property
    def root(self) -> gs.Node:
        return self.nodes[-1]

    def __getitem__(self, name: str):
        return self.bindings[name]

    def holds(self, node: gs.Node | None) -> bool:
        return node is not None and any(node is n for n in self.nodes)


def _operands(node: gs.Node, count: int) -> list[gs.Tensor | float | None] | None:
    """The node's first `count` operands, attribute-carried ones (ATTRIBUTE_INPUTS) as floats."""
    ins: list = list(node.inputs[:count])
    if len(ins) < count:
        ins += [None] * (count - len(ins))
    carried = ATTRIBUTE_INPUTS.get(node.op, ())
    for i, attr in enumerate(carried[:count]):
        if attr is not None and attr in node.attrs:
            ins[i] = float(node.attrs[attr])
    return ins


class _Matcher:
    def __init__(self, graph_outputs: set[str]):
        self.graph_outputs = graph_outputs

    def tensor(self, p: Pattern, t, bound: dict, nodes: list) -> Iterator[None]:
        """Yield once per way `t` (a tensor, a float for an attribute-carried input, or None)
        matches `p`, with `bound` and `nodes` extended for that way (and restored after)."""
        if isinstance(p, Var):
            if p.name in bound:
                if bound[p.name] is t:
                    yield
                return
            if not isinstance(t, gs.Tensor) or not gu.is_present(t):
                return
            bound[p.name] = t
            yield
            del bound[p.name]
        elif isinstance(p, AnyInput):
            yield
        elif isinstance(p, Const):
            v = t if isinstance(t, float) else gu.scalar(t) if isinstance(t, gs.Tensor) else None
            if v is None or (p.value is not None and not _close(v, p.value, p.rtol)):
                return
            if p.name is None:
                yield
                return
            bound[p.name] = v
            yield
            del bound[p.name]
        else:
            if not isinstance(t, gs.Tensor) or not t.inputs:
                return
            node = t.inputs[0]
            if node.outputs[0] is not t:
                return
            yield from self.node(p, node, bound, nodes)

    def node(self, p: OpPattern, node: gs.Node, bound: dict, nodes: list) -> Iterator[None]:
        if node.op != p.op or not gu.is_default_domain(node) or any(node is n for n in nodes):
            return
        if p.outputs is not None and len(node.outputs) != p.outputs:
            return
        for key, want in p.attrs:
            have = node.attrs.get(key)
            if not (want(have) if callable(want) else have == want):
                return
        operands = _operands(node, len(p.inputs))
        if len(node.inputs) > len(p.inputs) and any(gu.is_present(t) for t in node.inputs[len(p.inputs):]):
            return
        orders = [p.inputs]
        if p.op in COMMUTATIVE and len(p.inputs) == 2:
            orders.append(p.inputs[::-1])
        for order in orders:
            for _ in self._all(order, operands, 0, bound, nodes):
                nodes.append(node)
                if p.name is not None:
                    bound[p.name] = node
                yield
                if p.name is not None:
                    del bound[p.name]
                nodes.pop()

    def _all(self, pats, operands, i, bound, nodes) -> Iterator[None]:
        if i == len(pats):
            yield
            return
        for _ in self.tensor(pats[i], operands[i], bound, nodes):
            yield from self._all(pats, operands, i + 1, bound, nodes)


def _close(a: float, b: float, rtol: float) -> bool:
    return a == b or (rtol > 0 and abs(a - b) <= rtol * abs(b))


def _private(m: Match, graph_outputs: set[str]) -> bool:
    for n in m.nodes[:-1]:
        for t in n.outputs:
            if t.name in graph_outputs or not all(m.holds(r) for r in t.outputs):
                return False
    return True


def match(pattern: OpPattern, root: gs.Node, graph_outputs: set[str] | frozenset = frozenset(),
          bind: dict[str, object] | None = None, private: bool = True,
          condition: Callable[[Match], bool] | None = None) -> Match | None:
    """The first way `root` matches `pattern` whose intermediates are private (when asked) and
    that satisfies `condition`; `bind` fixes some names beforehand (a Var to a given tensor)."""
    bound = dict(bind or {})
    nodes: list[gs.Node] = []
    # A set the caller holds is read as it is: copying it per match costs the graph's outputs
    # per candidate (quadratic in a graph whose outputs grow with it).
    matcher = _Matcher(graph_outputs if isinstance(graph_outputs, (set, frozenset)) else set(graph_outputs))
    for _ in matcher.node(pattern, root, bound, nodes):
        m = Match(list(nodes), dict(bound), root.outputs[0])
        if private and not _private(m, matcher.graph_outputs):
            continue
        if condition is None or condition(m):
            return m
    return None


@dataclass(frozen=True)
class Rule:
    """name: what reports call it; pattern: the subgraph, rooted at the op that computes its
    value; condition(match, graph) -> whether to rewrite; rewrite(graph, match) -> whether it
    rewrote; private: intermediates must be read inside the match only."""

    name: str
    pattern: OpPattern
    rewrite: Callable[[gs.Graph, Match], bool] | None = None
    condition: Callable[[Match, gs.Graph], bool] | None = None
    private: bool = True

    def match(self, graph: gs.Graph, root: gs.Node, graph_outputs: set[str] | None = None,
              bind: dict[str, object] | None = None) -> Match | None:
        outs = graph_outputs if graph_outputs is not None else {t.name for t in graph.outputs}
        cond = None if self.condition is None else (lambda m: self.condition(m, graph))
        return match(self.pattern, root, outs, bind, self.private, cond)


def by_root_op(rules: Iterable[Rule]) -> dict[str, list[Rule]]:
    table: dict[str, list[Rule]] = {}
    for r in rules:
        table.setdefault(r.pattern.op, []).append(r)
    return table


def first_match(rules: Sequence[Rule], graph: gs.Graph, root: gs.Node, graph_outputs: set[str] | None = None,
                bind: dict[str, object] | None = None) -> tuple[Rule, Match] | None:
    """The first of `rules` that matches at `root`, with its match."""
    outs = graph_outputs if graph_outputs is not None else {t.name for t in graph.outputs}
    for rule in rules:
        if rule.pattern.op == root.op:
            m = rule.match(graph, root, outs, bind)
            if m is not None:
                return rule, m
    return None


def match_at(rules: Sequence[Rule], graph: gs.Graph, tensor: gs.Tensor,
             graph_outputs: set[str] | None = None) -> tuple[Rule, Match] | None:
    """The first of `rules` rooted at the node that computes `tensor` (its first output), with
    its match: a chain read back from a value the caller already holds."""
    node = gu.producer(tensor)
    if node is None or node.outputs[0] is not tensor:
        return None
    return first_match(rules, graph, node, graph_outputs)


def match_after(rules: Sequence[Rule], graph: gs.Graph, tensor: gs.Tensor, var: str,
                depth: int = 2) -> tuple[Rule, Match] | None:
    """The first of `rules` matching with Var `var` bound to `tensor`, rooted at a node at most
    `depth` readers downstream of it (a chain that starts where `tensor` is computed)."""
    outs = {t.name for t in graph.outputs}
    roots: list[gs.Node] = []
    frontier = [tensor]
    for _ in range(depth):
        nxt = []
        for t in frontier:
            for r in t.outputs:
                if not any(r is n for n in roots):
                    roots.append(r)
                    nxt.extend(r.outputs)
        frontier = nxt
    for rule in rules:
        for root in roots:
            if root.op == rule.pattern.op and root.outputs:
                m = rule.match(graph, root, outs, {var: tensor})
                if m is not None:
                    return rule, m
    return None


def apply(graph: gs.Graph, rules: Sequence[Rule]) -> int:
    """The pass loop: every node, in the graph's order, as the root of each rule with its op;
    the first rule that matches and rewrites wins. Returns the number of rewrites."""
    table = by_root_op(rules)
    outs = {t.name for t in graph.outputs}
    count = 0
    for node in list(graph.nodes):
        for rule in table.get(node.op, ()):
            if not node.outputs:  # removed by an earlier rewrite
                break
            m = rule.match(graph, node, outs)
            if m is not None and rule.rewrite is not None and rule.rewrite(graph, m):
                count += 1
                break
    return count
