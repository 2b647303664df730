"""onnxscript's rewriter at the cost of the candidates, not of rules x nodes.

onnxscript applies a rule set by asking every rule at every node of the graph. Each ask goes
through five Python calls and allocates a match result before the first check, the node's op
type, fails: a real-size model (GPT-2 small, 2,700 nodes) asks 400,000 times in the stage, most
of its pass time. `linear_matching()` answers those asks where the answer is known from the op
type alone, and gives multi-output patterns the readers of one value instead of the whole
graph; the matches found, and their order, are onnxscript's own.
"""
from __future__ import annotations

from contextlib import contextmanager


class _Readers:
    """What onnxscript's multi-output matcher iterates instead of the whole graph: the nodes
    that read one value, in graph order; `graph` is the graph itself."""

    def __init__(self, graph, nodes):
        self.graph = graph
        self._nodes = nodes

    def __iter__(self):
        return iter(self._nodes)


def _ir():
    import onnx_ir as ir

    return ir


def shared_input_matcher(base):
    """A subclass of onnxscript's SimplePatternMatcher for patterns whose output nodes all read
    one pattern input first (SlicesSplit: Slice(x, ..), Slice(x, ..)). onnxscript matches such a
    pattern at each candidate node by listing every node of the graph, and pairing the candidate
    with each node of the other output's op type: nodes x candidates, quadratic in the graph.
    A match has every output node reading the candidate's first input, so the nodes listed are
    that value's readers, in graph order: the same matches, found in the same order."""

    class SharedInputMatcher(base):
        # Positions of the graph's nodes, kept while they hold for the nodes asked about:
        # inserting or removing nodes leaves the order of the others as it was.
        _order: tuple = (None, {})

        def match(self, model, graph_or_function, node, **kwargs):
            x = node.inputs[0] if node.inputs else None
            if x is None:
                return super().match(model, graph_or_function, node, **kwargs)
            graph = graph_or_function if isinstance(graph_or_function, _ir().Graph) else graph_or_function.graph
            readers = list(dict.fromkeys(use.node for use in x.uses() if use.node.graph is graph))
            if len(readers) > 2:  # which of them comes first decides the match: graph order
                owner, rank = self._order
                if owner is not graph_or_function or any(n not in rank for n in readers):
                    rank = {n: i for i, n in enumerate(graph_or_function)}
                    self._order = (graph_or_function, rank)
                readers.sort(key=rank.__getitem__)
            return super().match(model, _Readers(graph, readers), node, **kwargs)

    return SharedInputMatcher


# The attribute a rule's root (op_type, domain or None) is cached in.
_ROOT = "_onnxfuse_root"


def rule_root(rule) -> tuple[str, str | None] | None:
    """(op type, domain) a node must have for `rule` to match at it: the first output node of
    its pattern, which onnxscript's SimplePatternMatcher checks first (NodePattern.matches: op
    type, then domain) for single- and multi-output patterns alike. The domain is None where the
    pattern takes a prefix; None where the op type is not one constant or the matcher is
    another (GenericPatternMatcher)."""
    cached = rule.__dict__.get(_ROOT, False)
    if cached is not False:
        return cached
    root = None
    try:
        from onnxscript.rewriter import _matcher, _pattern_ir

        pattern, matcher = rule._target_pattern, rule._matcher
        if isinstance(matcher, _matcher.SimplePatternMatcher) and pattern.output_nodes:
            first = pattern.output_nodes[0]
            if isinstance(first.op, _pattern_ir.StringConstantPattern):
                domain = first.domain.value() if isinstance(first.domain, _pattern_ir.StringConstantPattern) else None
                root = (first.op.value(), domain)
    except (ImportError, AttributeError):  # another onnxscript: no shortcut
        root = None
    rule.__dict__[_ROOT] = root
    return root


def _quick_try_rewrite(original):
    def try_rewrite(self, model, graph_or_function, node, *, verbose=None, tracer=None):
        if tracer is None and not verbose:
            root = rule_root(self)
            if root is not None and (node.op_type != root[0] or (root[1] is not None and node.domain != root[1])):
                return None  # what the matcher answers at its first check
        return original(self, model, graph_or_function, node, verbose=verbose, tracer=tracer)

    try_rewrite.__wrapped__ = original
    return try_rewrite


@contextmanager
def linear_matching():
    """While the stage runs: onnxscript's rewrite rules skip nodes their root cannot match
    (rule_root), and the multi-output rules of its optimizer's defaults that read one input
    first match against that input's readers (shared_input_matcher). Restored after."""
    swapped = []
    patched = None
    try:
        from onnxscript import rewriter
        from onnxscript.rewriter import _matcher, _rewrite_rule

        for rule in getattr(rewriter, "_DEFAULT_REWRITE_RULES", ()):
            pattern, matcher = getattr(rule, "_target_pattern", None), getattr(rule, "_matcher", None)
            if pattern is None or type(matcher) is not _matcher.SimplePatternMatcher or pattern.has_single_output_node:
                continue
            firsts = [n.inputs[0] if n.inputs else None for n in pattern.output_nodes]
            if firsts[0] is None or any(f is not firsts[0] for f in firsts):
                continue
            swapped.append((rule, matcher))
            rule._matcher = shared_input_matcher(_matcher.SimplePatternMatcher)(pattern)
        cls = _rewrite_rule.RewriteRule
        if "try_rewrite" in cls.__dict__ and not hasattr(cls.try_rewrite, "__wrapped__"):
            patched = (cls, cls.__dict__["try_rewrite"])
            cls.try_rewrite = _quick_try_rewrite(patched[1])
    except (ImportError, AttributeError):  # another onnxscript: its own matching
        pass
    try:
        yield
    finally:
        if patched is not None:
            patched[0].try_rewrite = patched[1]
        for rule, matcher in swapped:
            rule._matcher = matcher
            rule.__dict__.pop(_ROOT, None)
