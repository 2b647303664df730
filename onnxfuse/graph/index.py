"""An index of a graph's top-level nodes by identity: order, producers, consumers.

graphsurgeon nodes are unhashable and compare by value, so matchers key them by id().
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from . import core as gu


class GraphIndex:
    """The top-level nodes of `graph` in their current order, with who reads what."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self.opset = graph.opset
        self.nodes = list(graph.nodes)
        self.index = {id(n): i for i, n in enumerate(self.nodes)}
        self.graph_outputs = {t.name for t in graph.outputs}
        # A node inside an If/Loop/Scan body that reads a top-level value (outer-scope reference)
        # makes the If/Loop/Scan node itself a consumer of that value.
        owner: dict[int, gs.Node] = {}
        for n in self.nodes:
            for sub in subgraphs(n):
                for inner in all_nodes(sub):
                    owner[id(inner)] = n
        self.consumers: dict[int, list[gs.Node]] = {}
        for n in self.nodes:
            seen: dict[int, gs.Node] = {}
            for t in n.outputs:
                for c in t.outputs:
                    c = owner.get(id(c), c)
                    if id(c) in self.index:
                        seen[id(c)] = c
            self.consumers[id(n)] = list(seen.values())

    def is_used(self, t: gs.Tensor) -> bool:
        return bool(t.outputs) or t.name in self.graph_outputs

    def producer(self, t: gs.Tensor) -> gs.Node | None:
        """The top-level node that writes `t`, None for graph inputs and constants."""
        p = gu.producer(t)
        return p if p is not None and id(p) in self.index else None

    def reader(self, t: gs.Tensor) -> gs.Node | None:
        """The only node reading `t` (None when several, none, or when `t` is a graph output)."""
        if t.name in self.graph_outputs or len(t.outputs) != 1:
            return None
        return t.outputs[0]


def subgraphs(n: gs.Node) -> list[gs.Graph]:
    subs = []
    for v in n.attrs.values():
        subs += [v] if isinstance(v, gs.Graph) else [g for g in v if isinstance(g, gs.Graph)] if isinstance(v, list) else []
    return subs


def all_nodes(g: gs.Graph) -> list[gs.Node]:
    out = []
    for n in g.nodes:
        out.append(n)
        for sub in subgraphs(n):
            out += all_nodes(sub)
    return out
