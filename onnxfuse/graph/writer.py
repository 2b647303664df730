"""NodeWriter: the replacement a rewrite writes, one call per node, each returning the value the
node computes.

    w = NodeWriter(graph)
    y = w.op("MatMul", x, weight, name=f"{base}_proj")            # a new value, float32 as x
    y = w.op("Add", y, bias, name=f"{base}_proj_bias", out=m.output)  # or one the match had
    graph.nodes.extend(w.nodes)

Names are unique in the graph as it was when the writer was made and among the names the
writer has handed out: one set of the graph's names per rewrite instead of a walk of the graph
per name (gu.unique_name without a taken set). Node names and value names are apart, as ONNX
keeps them, so a node and its output may share one, as the rewrites written by hand named them.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_graphsurgeon as gs

from . import core as gu


class NodeWriter:
    def __init__(self, graph: gs.Graph) -> None:
        self.graph = graph
        taken = gu.taken_names(graph)
        self._value_names = set(taken)
        self._node_names = set(taken)
        self.nodes: list[gs.Node] = []

    @staticmethod
    def _unique(base: str, used: set[str]) -> str:
        name, i = base, 0
        while name in used:
            i += 1
            name = f"{base}_{i}"
        used.add(name)
        return name

    def value(self, base: str, dtype=None, shape: Sequence | None = None) -> gs.Variable:
        """A new value (not yet written by a node) named after `base`."""
        return gs.Variable(self._unique(base, self._value_names), dtype=dtype, shape=shape)

    def constant(self, base: str, value: np.ndarray) -> gs.Constant:
        """A new initializer named after `base` (held on disk in a graph whose weights are)."""
        from ..weights import new_constant

        return new_constant(self.graph, self._unique(base, self._value_names), value)

    def node_name(self, base: str) -> str:
        return self._unique(base, self._node_names)

    def base(self, base: str) -> str:
        """A prefix for a group of nodes and values (`{base}/MatMul`, `{base}_matmul`): a name
        that neither a node nor a value has."""
        name = self._unique(base, self._value_names | self._node_names)
        self._value_names.add(name)
        self._node_names.add(name)
        return name

    def op(self, op_type: str, *inputs: gs.Tensor, name: str, out: gs.Variable | str | None = None,
           dtype=None, shape: Sequence | None = None, attrs: dict | None = None,
           domain: str | None = None) -> gs.Variable:
        """A node `op_type`(inputs) named after `name`, and its one output: `out` when it is a
        value (one the replaced subgraph computed, which keeps its readers), else a new value
        named after `out` or `name`, of `dtype` (the first input's when not given) and `shape`."""
        if not isinstance(out, gs.Variable):
            out = self.value(out or name, dtype if dtype is not None else inputs[0].dtype, shape)
        self.add(gs.Node(op_type, name=self.node_name(name), inputs=list(inputs), outputs=[out],
                         attrs=dict(attrs or {}), domain=domain))
        return out

    def add(self, node: gs.Node) -> gs.Node:
        """A node made elsewhere (gu.split_node) written with the others."""
        self.nodes.append(node)
        return node
