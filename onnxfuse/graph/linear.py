"""Linear layers: x @ W (+ b) as MatMul or Gemm with a constant weight, an Add of a constant
row bias after it included."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from . import core as gu
from .rules import ANY, Match, Rule, Var, fail, first_match, match_reader, op

FLOAT_KINDS = "f"


@dataclass
class Linear:
    """One member: x @ weight (+ bias) (+ activation) -> output."""

    nodes: list[gs.Node]
    weight: np.ndarray  # effective [K, N]: transB and alpha applied
    bias: np.ndarray | None  # effective [N]: beta and any Add bias applied
    output: gs.Variable
    key: tuple  # identifies members that compute the same thing
    activation: gs.Node | None = None


def row_bias(value: np.ndarray, n: int, out_rank: int | None) -> np.ndarray | None:
    """value as an [n] vector when adding it to an [..., n] tensor broadcasts along the last
    axis only (and does not raise the rank); else None."""
    if value.ndim == 0 or value.size == 1:
        if out_rank is not None and value.ndim > out_rank:
            return None
        return np.full((n,), value.reshape(()), dtype=value.dtype)
    if value.shape[-1] != n or any(d != 1 for d in value.shape[:-1]):
        return None
    if value.ndim > max(out_rank or 2, 2) or (out_rank is None and value.ndim > 1):
        return None
    return value.reshape(n)


def rewirable(t: gs.Tensor, graph: gs.Graph) -> bool:
    """An intermediate tensor that can be rewired: not a graph output."""
    return not gu.is_graph_output(graph, t)


X, W = Var("x"), Var("w")
# MatMul/Gemm + Add(constant row bias): the Add that reads the product, matched from it.
BIAS = Rule("row-bias", op.Add(Var("y"), Var("b")))


def as_linear(m: Match, graph: gs.Graph):
    """Binds "linear": the node as x @ W' + b' (a following Add of a constant row bias folded)."""
    node, x = m.root, m["x"]
    if m["w"] is x:
        return fail("it multiplies its input by itself")
    w = gu.constant_value(m["w"])
    if w is None or w.ndim != 2 or w.dtype.kind not in FLOAT_KINDS or w.size == 0:
        return fail("its weight is not a constant non-empty 2-D float matrix")
    x_rank = gu.rank(x)
    bias = None
    key: tuple
    if node.op == "MatMul":
        if x_rank is not None and x_rank < 2:
            return fail(f"its input has rank {x_rank}")
        key = ("W", m["w"].name, 0, 1.0)
    else:
        if gu.attr(node, "transA", 0):
            return fail("transA is set")
        if x_rank is not None and x_rank != 2:
            return fail(f"its input has rank {x_rank}")
        alpha = float(gu.attr(node, "alpha", 1.0))
        beta = float(gu.attr(node, "beta", 1.0))
        trans_b = int(gu.attr(node, "transB", 0))
        key = ("W", m["w"].name, trans_b, alpha)
        if trans_b:
            w = w.T
        if alpha != 1.0:
            w = (w * np.asarray(alpha, w.dtype)).astype(w.dtype)
        if len(node.inputs) > 2 and gu.is_present(node.inputs[2]):
            c = gu.constant_value(node.inputs[2])
            if c is None or c.dtype != w.dtype:
                return fail("its C input is not a constant of the weight's type")
            c = row_bias(c, w.shape[1], 2)
            if c is None:
                return fail("its C input is not a row bias")
            bias = (c * np.asarray(beta, c.dtype)).astype(c.dtype) if beta != 1.0 else c
    w = np.ascontiguousarray(w)
    out = node.outputs[0]
    nodes = [node]
    added = match_reader([BIAS], graph, out, "y")
    if added is not None:
        reader, other = added[1].root, added[1]["b"]
        b = gu.constant_value(other) if other is not out else None
        out_rank = 2 if node.op == "Gemm" else x_rank
        if b is not None and b.dtype == w.dtype:
            b = row_bias(b, w.shape[1], out_rank)
            if b is not None:
                bias = b if bias is None else (bias + b).astype(w.dtype)
                nodes.append(reader)
                out = reader.outputs[0]
    bias_key = None if bias is None else (bias.shape, bias.tobytes())
    m.bindings["linear"] = Linear(nodes, w, bias, out, key + (bias_key,))
    return True


LINEAR = (Rule("linear/MatMul", op.MatMul(X, W), condition=as_linear, private=False),
          Rule("linear/Gemm", op.Gemm(X, W, ANY), condition=as_linear, private=False))


def match_linear(graph: gs.Graph, node: gs.Node, x: gs.Tensor) -> Linear | None:
    """node as x @ W' + b' when it reads x as its left operand with a constant weight."""
    found = first_match(LINEAR, graph, node, bind={"x": x})
    return None if found is None else found[1]["linear"]


def write_output_of(writer: gs.Node, folded: gs.Node) -> gs.Tensor:
    """`folded` (the Mul or Add whose constant went into `writer`'s weights) leaves the graph and
    `writer` writes its output, so its readers and a graph output keep the name; the output keeps
    the type and shape `writer`'s own had where it had none. Returns `writer`'s former output."""
    result = folded.outputs[0]
    dropped = writer.outputs[0]
    gu.disconnect(folded)
    writer.outputs[0] = result
    if result.dtype is None:
        result.dtype = dropped.dtype
    if result.shape is None:
        result.shape = dropped.shape
    return dropped
