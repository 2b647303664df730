"""common-subexpressions: identical nodes on identical inputs computed once.

match
    Two top-level elementwise nodes (the ops a Pointwise region computes) or Slice/Split
    nodes of the standard ONNX domain with the same op type, the same attributes
    and the same inputs: the same values, or constants of equal type, shape and elements (up to
    MAX_CONSTANT_ELEMENTS; larger ones only when they are the same tensor).
condition
    - deterministic ops only (no Random*, Multinomial, Bernoulli, Dropout) and no subgraph
      attributes;
    - at least one input is a value computed at run time: nodes of constants alone are left to
      fold-constants (two weights made one tensor would keep fold-batchnorm from folding
      either: inception_v2, whose weights are equal ConstantOfShape fills, ran 117 kernels
      instead of 91);
    - at most one of the two writes a graph output (an output name is part of the model's
      interface), and that one is kept; every output the other's readers use is one the kept
      node writes.
rewrite
    readers of the second node's outputs read the first's (or the first's readers read the
    graph output), and the second node goes.

onnxruntime runs its own common-subexpression elimination at load time: K identical chains on
one input run as one chain there. Fusing each copy into a region of its own ran more kernels
than onnxruntime alone (16 -> 24). It also keeps one value one value: where one copy of
Tanh(x) ran in a fused kernel and the other in onnxruntime, the two differed by an ulp and
Tanh(x) > Tanh(x) came out true. Runs before every other rewrite, so that the patterns see one
node where the model wrote two.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph.index import subgraphs
from onnxfuse.graph.patterns import VIEW_OPS
from onnxfuse.lowering import SUPPORTED_OPS
from onnxfuse.pipeline import Context, Pass

# Ops whose result is not a function of their inputs and attributes.
NONDETERMINISTIC = frozenset({
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
    "Bernoulli", "Dropout",
})
ELIGIBLE = (frozenset(SUPPORTED_OPS) | frozenset(VIEW_OPS)) - NONDETERMINISTIC
# Constants of at most this many elements are compared by value.
MAX_CONSTANT_ELEMENTS = 4096


def _value_key(v) -> object:
    if isinstance(v, gs.Constant):
        v = v.values
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, (list, tuple)):
        return ("list", tuple(_value_key(x) for x in v))
    if isinstance(v, float) and v != v:
        return ("nan",)
    return (type(v).__name__, v)


def _input_key(t: gs.Tensor) -> object:
    if not gu.is_present(t):
        return ("absent",)
    if isinstance(t, gs.Constant):
        shape = tuple(t.shape) if t.shape is not None else None
        if shape is not None and int(np.prod(shape, dtype=np.int64)) <= MAX_CONSTANT_ELEMENTS:
            return ("constant", _value_key(np.asarray(t.values)))
    return ("value", id(t))


def _node_key(n: gs.Node) -> tuple | None:
    if not gu.is_default_domain(n) or n.op not in ELIGIBLE or subgraphs(n):
        return None
    if not any(gu.is_present(t) and not isinstance(t, gs.Constant) for t in n.inputs):
        return None
    try:
        attrs = tuple(sorted((k, _value_key(v)) for k, v in n.attrs.items()))
        hash(attrs)
    except TypeError:  # an attribute value this key cannot hold: left alone
        return None
    return (n.op, len(n.outputs), tuple(_input_key(t) for t in n.inputs), attrs)


def _used(t: gs.Tensor, outputs: set[str]) -> bool:
    return gu.is_present(t) and (bool(t.outputs) or t.name in outputs)


def _merge(keep: gs.Node, drop: gs.Node, outputs: set[str]) -> bool:
    """Make `drop`'s readers read `keep`'s outputs; False (nothing changed) when that cannot be."""
    for k, d in zip(keep.outputs, drop.outputs):
        if d.name in outputs or (_used(d, outputs) and not gu.is_present(k)):
            return False
        if _used(d, outputs) and k.dtype is not None and d.dtype is not None and k.dtype != d.dtype:
            return False
    for k, d in zip(keep.outputs, drop.outputs):
        if gu.is_present(d):
            gu.replace_uses(d, k)
    gu.disconnect(drop)
    return True


def eliminate_common_subexpressions(graph: gs.Graph, ctx: Context) -> int:
    outputs = {t.name for t in graph.outputs}
    seen: dict[tuple, gs.Node] = {}
    merged = 0
    for n in list(graph.nodes):  # topological order: a node's inputs are merged before it is keyed
        key = _node_key(n)
        if key is None:
            continue
        first = seen.get(key)
        if first is None:
            seen[key] = n
            continue
        if any(o.name in outputs for o in n.outputs) and not any(o.name in outputs for o in first.outputs):
            keep, drop = n, first  # the graph output's writer stays
        else:
            keep, drop = first, n
        if _merge(keep, drop, outputs):
            seen[key] = keep
            merged += 1
    return merged


PASS = Pass(
    name="common-subexpressions",
    order=95,
    summary="identical nodes on identical inputs (equal attributes, equal small constants) computed once",
    run=eliminate_common_subexpressions,
)
