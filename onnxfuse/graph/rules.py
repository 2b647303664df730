"""A small rule engine over onnx-graphsurgeon graphs: patterns as expressions, rules as data.

A pattern is written the way the subgraph computes its value:

    x = Var("x")
    HARD_SWISH = x * op.Clip(x + 3.0, 0.0, 6.0) / 6.0

`op.Name(...)` matches a node of that ONNX op (default domain) whose inputs match the operand
patterns (`ops("com.microsoft").Name(...)`: an op of another domain); Python operators stand for
Add, Sub, Mul and Div; a float is a scalar constant; a `Var` matches any tensor, the same tensor
wherever the name recurs; `Rest("xs")`, the last operand, matches the inputs that remain, any
number of them (Concat's, Sum's, a contrib op's optional ones), bound as a tuple; `alt(p, q)`
matches what p or q matches (tried in that order; `alt(op.Cast(x, to=1), x)`: an optional
node); `through(["Unsqueeze"], p, 12)` matches p behind at most 12 Unsqueezes (a bounded path).
The vocabulary lives in rule_patterns.py. The engine takes care of:

- commuted operands of commutative ops (Add, Mul, Max, Min, Sum, And, Or, Xor, Equal): both
  orders are tried, so `x * 0.5` also matches Mul(0.5, x);
- constants: a scalar matches an initializer or a Constant node's output of one element;
- inputs that older opsets carried as attributes (Clip's min and max before opset 11);
- private intermediates: a matched node other than the root has every output read inside the
  match only, and none is a graph output (so the rewrite can drop them).

A Rule bundles a pattern, a condition on the match and a rewrite; `apply` is the pass loop
(every node in topological order tried as the root of every rule whose root op it has). Every
candidate that does not match gets a reason in words, for `optimize --explain PASS`: the
engine names the furthest point its pattern reached ("input 1 of Mul 'm' is computed by Add,
not Clip"), a condition or a rewrite that declines returns `fail("why")` (falsy), and `apply`
hands each reason to its `explain` callback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import onnx_graphsurgeon as gs

from . import core as gu
from .reasons import Declined, Explain, Failure, Unmatched, explain_failures, fail  # noqa: F401 (the engine's API)
from .reasons import declined as _declined
from .rule_patterns import (ANY, Alt, AnyInput, Const, OpPattern, Pattern, Rest, Through, Var,  # noqa: F401 (the engine's API)
                            alt, op, ops, through)

COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "Sum", "And", "Or", "Xor", "Equal"})
# Inputs that an op took as attributes in older opsets: (attribute per input position).
ATTRIBUTE_INPUTS = {"Clip": (None, "min", "max")}


def _named(node: gs.Node) -> str:
    kind = node.op if gu.is_default_domain(node) else f"{node.domain}.{node.op}"
    return f"{kind} '{node.name}'" if node.name else kind


def _tensor_text(t) -> str:
    if isinstance(t, float):
        return f"{t:g}"
    return "absent" if not isinstance(t, gs.Tensor) or not gu.is_present(t) else f"'{t.name}'"


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

    def get(self, name: str, default=None):
        """What `name` is bound to, or `default` where the match went through an alternative
        (Alt) that does not bind it."""
        return self.bindings.get(name, default)

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
    def __init__(self, graph_outputs: Iterable[str]):
        # A set the caller holds is read as it is: copying it per match costs the graph's outputs
        # per candidate (quadratic in a graph whose outputs grow with it).
        self.graph_outputs = graph_outputs if isinstance(graph_outputs, (set, frozenset)) else set(graph_outputs)
        # Why the furthest attempt failed: (operands matched when it failed, the reason).
        self.held = 0
        self.failure: tuple[int, str] | None = None

    def fail(self, reason) -> None:
        """Note a failure (reason: a string, or a callable that makes one, so that matching
        without an explanation asked for builds no text) at the current depth."""
        if self.failure is None or self.held > self.failure[0]:
            self.failure = (self.held, reason)

    @property
    def reason(self) -> str | None:
        if self.failure is None:
            return None
        why = self.failure[1]
        return why() if callable(why) else why

    def tensor(self, p: Pattern, t, bound: dict, nodes: list, where: str) -> Iterator[None]:
        """Yield once per way `t` (a tensor, a float for an attribute-carried input, or None)
        matches `p`, with `bound` and `nodes` extended for that way (and restored after)."""
        self.held += 1
        try:
            yield from self._tensor(p, t, bound, nodes, where)
        finally:
            self.held -= 1

    def _bound_as(self, name: str, t, bound: dict, where: str, then=None) -> Iterator[None]:
        """The ways `then()` matches (once when None) with `name` standing for `t`: where the name
        is bound already (a Var that recurs, an op pattern's value), only if it is `t`."""
        if name in bound:
            if bound[name] is t:
                yield from then() if then is not None else (None,)
            else:
                other = bound[name]
                self.fail(lambda: f"{where} is {_tensor_text(t)}, not '{name}' ({_tensor_text(other)})")
            return
        bound[name] = t
        yield from then() if then is not None else (None,)
        del bound[name]

    def _tensor(self, p: Pattern, t, bound: dict, nodes: list, where: str) -> Iterator[None]:
        if isinstance(p, Var):
            if p.name not in bound and (not isinstance(t, gs.Tensor) or not gu.is_present(t)):
                self.fail(lambda: f"{where} is absent")
                return
            yield from self._bound_as(p.name, t, bound, where)
        elif isinstance(p, AnyInput):
            yield
        elif isinstance(p, Alt):
            node = t.inputs[0] if isinstance(t, gs.Tensor) and t.inputs else None
            roots = _op_options(p)
            if node is not None and roots and not any(o.op == node.op and _in_domain(node, o.domain) for o in roots):
                labels = list(dict.fromkeys(o.label for o in roots))
                either = " or ".join([", ".join(labels[:-1]), labels[-1]] if len(labels) > 1 else labels)
                self.fail(lambda: f"{where} is computed by {_named(node)}, not by {either}")
                return
            for option in p.options:
                yield from self._tensor(option, t, bound, nodes, where)
        elif isinstance(p, Through):
            yield from self._through(p, t, bound, nodes, where, ())
        elif isinstance(p, Const):
            v = t if isinstance(t, float) else gu.scalar(t) if isinstance(t, gs.Tensor) else None
            if v is None or (p.value is not None and not _close(v, p.value, p.rtol)):
                want = "a constant of one element" if p.value is None else f"the constant {p.value:g}"
                self.fail(lambda: f"{where} is {_tensor_text(t) if v is None else f'{v:g}'}, not {want}")
                return
            if p.name is None:
                yield
                return
            bound[p.name] = v
            yield
            del bound[p.name]
        else:
            node = t.inputs[0] if isinstance(t, gs.Tensor) and t.inputs else None
            if node is None:
                self.fail(lambda: f"{where} is {_tensor_text(t)}, computed by no node, not by {p.label}")
                return
            if node.outputs[0] is not t:
                self.fail(lambda: f"{where} is an output of {_named(node)} other than its first")
                return
            if p.value is None:
                yield from self.node(p, node, bound, nodes)
            else:
                yield from self._bound_as(p.value, t, bound, where, lambda: self.node(p, node, bound, nodes))

    def _through(self, p: Through, t, bound: dict, nodes: list, where: str, passed: tuple) -> Iterator[None]:
        if p.name is not None:
            bound[p.name] = passed
        yield from self._tensor(p.inner, t, bound, nodes, where)
        if p.name is not None:
            del bound[p.name]
        node = t.inputs[0] if isinstance(t, gs.Tensor) and t.inputs else None
        if node is None or node.op not in p.ops or not gu.is_default_domain(node):
            return  # the inner pattern's failure says why
        if len(passed) == p.most:
            # at the depth of the inner pattern's "Unsqueeze is not Range", and saying more
            if self.failure is None or self.failure[0] <= self.held:
                self.failure = (self.held, lambda: f"{where} is reached through more than {p.most} of {', '.join(p.ops)}")
            return
        if node.outputs[0] is not t or len(node.inputs) <= min(p.operands) or any(node is n for n in nodes):
            self.fail(lambda: f"{where} is not a path through {_named(node)}")
            return
        for i in p.operands:
            if i >= len(node.inputs) or not gu.is_present(node.inputs[i]):
                continue
            for _ in self._through(p, node.inputs[i], bound, nodes, f"input {i} of {_named(node)}", passed + (node,)):
                nodes.append(node)  # operands before readers, as op patterns record them
                yield
                nodes.pop()

    def node(self, p: OpPattern, node: gs.Node, bound: dict, nodes: list) -> Iterator[None]:
        if node.op != p.op or not _in_domain(node, p.domain):
            self.fail(lambda: f"{_named(node)} is not {p.label}")
            return
        if any(node is n for n in nodes):
            self.fail(lambda: f"{_named(node)} is matched twice")
            return
        if p.outputs is not None and len(node.outputs) != p.outputs:
            self.fail(lambda: f"{_named(node)} has {len(node.outputs)} outputs, not {p.outputs}")
            return
        for key, want in p.attrs:
            have = node.attrs.get(key)
            if not (want(have) if callable(want) else have == want):
                self.fail(lambda: f"{_named(node)} has {key}={have!r}"
                                  + ("" if callable(want) else f", not {want!r}"))
                return
        fixed = p.fixed
        operands = _operands(node, len(fixed))
        if len(fixed) < len(p.inputs):  # Rest: the remaining inputs
            rest = p.inputs[-1]
            extra = tuple(node.inputs[len(fixed):])
            if len(extra) < rest.min:
                self.fail(lambda: f"{_named(node)} has {len(node.inputs)} inputs, not at least {len(fixed) + rest.min}")
                return
        elif len(node.inputs) > len(fixed) and any(gu.is_present(t) for t in node.inputs[len(fixed):]):
            self.fail(lambda: f"{_named(node)} has {len(node.inputs)} inputs, not {len(fixed)}")
            return
        else:
            rest = extra = None
        orders = [fixed]
        if p.op in COMMUTATIVE and len(fixed) == 2 and rest is None:
            orders.append(fixed[::-1])
        for order in orders:
            for _ in self._all(order, operands, 0, bound, nodes, node):
                nodes.append(node)
                if p.name is not None:
                    bound[p.name] = node
                if rest is not None:
                    bound[rest.name] = extra
                yield
                if rest is not None:
                    del bound[rest.name]
                if p.name is not None:
                    del bound[p.name]
                nodes.pop()

    def _all(self, pats, operands, i, bound, nodes, node) -> Iterator[None]:
        if i == len(pats):
            yield
            return
        for _ in self.tensor(pats[i], operands[i], bound, nodes, f"input {i} of {_named(node)}"):
            yield from self._all(pats, operands, i + 1, bound, nodes, node)


def _op_options(p: Alt) -> list[OpPattern] | None:
    """The op patterns an Alt's options (nested ones flattened) are, or None when one is not."""
    out: list[OpPattern] = []
    for o in p.options:
        inner = _op_options(o) if isinstance(o, Alt) else [o] if isinstance(o, OpPattern) else None
        if inner is None:
            return None
        out += inner
    return out


def _in_domain(node: gs.Node, domain: str) -> bool:
    return gu.is_default_domain(node) if not domain else node.domain == domain


def _close(a: float, b: float, rtol: float) -> bool:
    return a == b or (rtol > 0 and abs(a - b) <= rtol * abs(b))


def _not_private(m: Match, graph_outputs: set[str]) -> str | None:
    """Why an intermediate of `m` is not private, or None when all are."""
    for n in m.nodes[:-1]:
        for t in n.outputs:
            if t.name in graph_outputs:
                return f"{_named(n)}'s output '{t.name}' is a graph output"
            outside = [r for r in t.outputs if not m.holds(r)]
            if outside:
                return f"{_named(n)}'s output '{t.name}' is read outside the match, by {_named(outside[0])}"
    return None


def match(pattern: OpPattern, root: gs.Node, graph_outputs: set[str] | frozenset = frozenset(),
          bind: dict[str, object] | None = None, private: bool = True,
          condition: Callable[[Match], object] | None = None, why: list[str] | None = None,
          commit: bool = False) -> Match | None:
    """The first way `root` matches `pattern` whose intermediates are private (when asked) and
    that satisfies `condition`; `bind` fixes some names beforehand (a Var to a given tensor).
    commit: the condition judges the first way with private intermediates only (a decline is
    final). Without a match, the reason is appended to `why` when given (see Failure)."""
    bound = dict(bind or {})
    nodes: list[gs.Node] = []
    matcher = _Matcher(graph_outputs)
    declined = None
    for _ in matcher.node(pattern, root, bound, nodes):
        m = Match(list(nodes), dict(bound), root.outputs[0])
        if private:
            shared = _not_private(m, matcher.graph_outputs)
            if shared is not None:
                declined = declined or Declined(shared)
                continue
        ok = True if condition is None else condition(m)
        if ok:
            return m
        declined = declined or Declined(_declined(ok, condition))
        if commit:
            break
    if why is not None:
        reason = matcher.reason
        why.append(declined or (Unmatched(reason, matcher.failure[0]) if reason else f"{_named(root)} does not match"))
    return None


def match_value(pattern: Pattern, tensor: gs.Tensor, graph_outputs: set[str] | frozenset = frozenset(),
                private: bool = False) -> Match | None:
    """The first way the value `tensor` matches `pattern` (a pattern of an operand: Through, Alt,
    an op pattern), with its intermediates private when asked; None when it does not."""
    bound: dict = {}
    nodes: list[gs.Node] = []
    matcher = _Matcher(graph_outputs)
    for _ in matcher.tensor(pattern, tensor, bound, nodes, f"'{tensor.name}'"):
        m = Match(list(nodes), dict(bound), tensor)
        if not private or _not_private(m, matcher.graph_outputs) is None:
            return m
    return None


@dataclass(frozen=True)
class Rule:
    """name: what reports call it; pattern: the subgraph, rooted at the op that computes its
    value; condition(match, graph) -> whether to rewrite; rewrite(graph, match) -> whether it
    rewrote (or how many rewrites it made); private: intermediates must be read inside the match
    only; commit: see `match`. A condition or rewrite that declines may say why: fail("reason")."""

    name: str
    pattern: OpPattern
    rewrite: Callable[[gs.Graph, Match], object] | None = None
    condition: Callable[[Match, gs.Graph], object] | None = None
    private: bool = True
    commit: bool = False  # the condition judges the first way only (see `match`)

    def match(self, graph: gs.Graph | None, root: gs.Node, graph_outputs: set[str] | None = None,
              bind: dict[str, object] | None = None, why: list[str] | None = None) -> Match | None:
        """The match at `root` (see `match`). graph may be None for a rule without condition when
        graph_outputs is given (a node's form read inside another rule's condition)."""
        outs = graph_outputs if graph_outputs is not None else {t.name for t in graph.outputs}
        cond = None
        if self.condition is not None:
            def cond(m):
                return self.condition(m, graph)
            cond.__name__ = getattr(self.condition, "__name__", "condition")
        return match(self.pattern, root, outs, bind, self.private, cond, why, self.commit)


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


def read_instead(name: str) -> Callable[[gs.Graph, Match], bool]:
    """A rewrite that drops the matched root: its readers read the tensor bound to `name`."""

    def rewrite(graph: gs.Graph, m: Match) -> bool:
        gu.replace_uses(m.output, m[name])
        gu.disconnect(m.root)
        return True

    return rewrite


def match_reader(rules: Sequence[Rule], graph: gs.Graph, tensor: gs.Tensor, var: str) -> tuple[Rule, Match] | None:
    """The first of `rules` rooted at the one node reading `tensor`, with Var `var` bound to it:
    an optional tail after a match (an activation, a residual Add), taken only where `tensor` is
    private (that node its only reader, no graph output), so that the tail can be fused with it."""
    reader = gu.single_consumer(tensor)
    if reader is None or not gu.is_private(graph, tensor):
        return None
    return first_match(rules, graph, reader, bind={var: tensor})


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


def any_root(graph: gs.Graph, rules: Sequence[Rule]) -> bool:
    """Whether some node has the root op of one of `rules` (a pass skips its set-up, shape
    inference, when none does)."""
    table = by_root_op(rules)
    return any(n.op in table and any(_in_domain(n, r.pattern.domain) for r in table[n.op]) for n in graph.nodes)


def find_all(graph: gs.Graph, rules: Sequence[Rule], explain: Explain | None = None) -> list[tuple[Rule, Match]]:
    """Every node, in the graph's order, matched against each rule with its op: the first
    matching rule's match per node, for passes that rewrite matches together (siblings that
    share an input); explain(node, reason) for each candidate root none matched. The rewrites
    come after, so the matches see the graph as it was."""
    table = by_root_op(rules)
    outs = {t.name for t in graph.outputs}
    found = []
    for node in graph.nodes:
        tried: list[tuple[str, str]] = []
        for rule in table.get(node.op, ()):
            why: list[str] | None = [] if explain is not None else None
            m = rule.match(graph, node, outs, why=why)
            if m is not None:
                found.append((rule, m))
                tried = []
                break
            if why:
                tried.append((rule.name, why[0]))
        explain_failures(explain, node, tried)
    return found


def apply(graph: gs.Graph, rules: Sequence[Rule], explain: Explain | None = None) -> int:
    """The pass loop: every node, in the graph's order, as the root of each rule with its op;
    the first rule that matches and rewrites wins. Returns the number of rewrites.
    explain(node, reason): called for each candidate root that no rule rewrote."""
    table = by_root_op(rules)
    outs = {t.name for t in graph.outputs}
    count = 0
    for node in list(graph.nodes):
        tried: list[tuple[str, str]] = []
        for rule in table.get(node.op, ()):
            if not node.outputs:  # removed by an earlier rewrite
                tried = []
                break
            why: list[str] | None = [] if explain is not None else None
            m = rule.match(graph, node, outs, why=why)
            if m is None:
                if why:
                    tried.append((rule.name, why[0]))
                continue
            if rule.rewrite is None:
                continue
            done = rule.rewrite(graph, m)
            if done:
                count += int(done)  # True, or how many rewrites it made
                tried = []
                break
            if explain is not None:
                tried.append((rule.name, Declined(_declined(done, rule.rewrite))))
        explain_failures(explain, node, tried)
    return count
