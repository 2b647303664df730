"""GroupQueryAttention's query, key and value projections as one GEMM on the packed form it reads.

pack-gqa-qkv
    match:     com.microsoft GroupQueryAttention(q, k, v, ...) with q, k, v each MatMul(x, W)
               [+ b] of one x: three MatMuls, each optionally followed by an Add of its bias
               (either operand order); every intermediate read inside the match only (each
               projection feeds the op alone) and none a graph output.
    condition: the three weights float constants of rank 2 with the same rows K and dtype, of
               H d, Hkv d and Hkv d columns (H = num_heads, Hkv = kv_num_heads, d the head
               width: q's columns / H); either all three have a bias or none does, each a
               constant of that dtype along the last axis only (linear.row_bias: [N], [1, N],
               [1, 1, N] or one element), not raising the rank of the product.
    rewrite:   MatMul(x, concat(Wq, Wk, Wv) on the columns) [+ concat(bq, bk, bv)] as the op's
               query, key and value inputs empty: onnxruntime's packed-QKV form (query
               [B, S, (H + 2 Hkv) d], key and value absent; the op splits the last axis into
               H d, Hkv d, Hkv d). Every other input, the attributes and the outputs stay.
               Each column of the packed product is the same dot product of a row of x with
               the same weight column, each bias element added once, as before.
Why: a projection with a bias is two kernels under onnxruntime (it makes Gemm of MatMul + Add on
2-D inputs only; a decoder's are [B, S, D]), so Qwen2's attention input was six kernels per
layer: three MatMuls, three Adds. Packed, it is one MatMul and one Add, and the weights are
streamed by one GEMM (a decode step's projections are bound by reading them). fuse-gqa packs the
projections without bias it matches itself; this rule also takes a GroupQueryAttention the model
already has or that another pass wrote.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.linear import FLOAT_KINDS, row_bias
from onnxfuse.graph.rules import Failure, Match, Rule, Rest, Var, apply, fail, op, ops
from onnxfuse.graph.writer import NodeWriter
from onnxfuse.pipeline import Context, Pass

CONTRIB = "com.microsoft"
PARTS = ("q", "k", "v")
x = Var("x")


def _projection(part: str, biased: bool):
    product = op.MatMul(x, Var(f"w{part}"), _name=f"mm{part}")
    return op.Add(product, Var(f"b{part}"), _name=f"add{part}") if biased else product


def _pattern(biased: bool):
    return ops(CONTRIB).GroupQueryAttention(*(_projection(p, biased) for p in PARTS), Rest("rest"),
                                            _name="gqa", _outputs=None)


PATTERNS = {"biased": _pattern(True), "plain": _pattern(False)}


def _weights(m: Match):
    """The three weights as arrays, or why not."""
    values = []
    for p in PARTS:
        w = m[f"w{p}"]
        value = gu.constant_value(w) if gu.is_constant(w) else None
        if value is None or value.ndim != 2 or value.dtype.kind not in FLOAT_KINDS or value.size == 0:
            return fail(f"the {p} projection's weight is not a 2-D float constant")
        values.append(value)
    if len({v.dtype for v in values}) != 1 or len({v.shape[0] for v in values}) != 1:
        return fail("the q, k, v weights differ in rows or dtype")
    return values


def _biases(m: Match, weights: list[np.ndarray]):
    """The three biases as [N] vectors (None when the match has none), or why not."""
    if "bq" not in m.bindings:
        return None
    vectors = []
    for p, w in zip(PARTS, weights):
        b = m[f"b{p}"]
        value = gu.constant_value(b) if gu.is_constant(b) else None
        rank = gu.rank(m[f"mm{p}"].outputs[0])
        if value is None or value.dtype != w.dtype:
            return fail(f"the {p} projection's bias is not a constant of its weight's dtype")
        vector = row_bias(value, w.shape[1], rank)
        if vector is None:
            return fail(f"the {p} projection's bias does not run along the last axis alone")
        vectors.append(vector)
    return vectors


def _pack(graph: gs.Graph, m: Match):
    gqa = m["gqa"]
    heads, kv_heads = int(gu.attr(gqa, "num_heads", 0)), int(gu.attr(gqa, "kv_num_heads", 0))
    weights = _weights(m)
    if isinstance(weights, Failure):
        return weights
    nq, nk, nv = (w.shape[1] for w in weights)
    if heads <= 0 or kv_heads <= 0 or nq % heads or nk != nv or nk * heads != nq * kv_heads:
        return fail(f"the projections' widths {nq}, {nk}, {nv} are not H d, Hkv d, Hkv d "
                    f"for num_heads {heads}, kv_num_heads {kv_heads}")
    biases = _biases(m, weights)
    if isinstance(biases, Failure):
        return biases
    first = m["mmq"]
    base = first.name or "qkv"
    writer = NodeWriter(graph)
    dtype = weights[0].dtype
    w = writer.constant(f"{m['wq'].name}_qkv_packed", np.concatenate(weights, axis=1))
    if biases is None:
        packed = writer.op("MatMul", m["x"], w, name=f"{base}_qkv_packed", dtype=dtype)
    else:
        b = writer.constant(f"{m['bq'].name}_qkv_packed", np.concatenate(biases))
        product = writer.op("MatMul", m["x"], w, name=f"{base}_qkv_packed", out=f"{base}_qkv_product", dtype=dtype)
        packed = writer.op("Add", product, b, name=f"{base}_qkv_bias", out=f"{base}_qkv_packed", dtype=dtype)
    for n in m.nodes[:-1]:  # the three projections (and their Adds) go
        gu.disconnect(n)
    gqa.inputs[0] = packed
    gqa.inputs[1] = gs.Variable.empty()
    gqa.inputs[2] = gs.Variable.empty()
    graph.nodes.extend(writer.nodes)
    return True


RULES = [Rule(f"pack-gqa-qkv/{name}", pattern, _pack) for name, pattern in PATTERNS.items()]


def run(graph: gs.Graph, ctx: Context) -> int:
    if not any(n.op == "GroupQueryAttention" and n.domain == CONTRIB for n in graph.nodes):
        return 0
    refresh_shapes(graph)  # a bias's broadcast is read against the product's rank
    explain = ctx.explainer
    if explain is not None:  # an op that already reads packed QKV is no candidate left
        def explain_unpacked(node, why, said=explain):
            if len(node.inputs) > 1 and gu.is_present(node.inputs[1]):
                said(node, why)
        explain = explain_unpacked
    count = apply(graph, RULES, explain)
    if count:
        gu.cleanup(graph)
        gu.toposort(graph)
    return count


PASS = Pass(
    name="pack-gqa-qkv",
    order=146,
    summary="GroupQueryAttention's q, k, v projections (MatMul + bias) of one input as one MatMul "
            "(+ one bias Add) on the packed QKV the op reads",
    run=run,
    targets=("cpu",),
)
