"""x @ Wx + h @ Wh as one GEMM on Concat([x, h]), when no pointwise fusion takes the Adds.

merge-xh-matmul
    match:     a tree of Add nodes (each read only inside the tree) whose leaves include >= 2
               MatMul(a_i, W_i) with distinct variable inputs a_i (each MatMul read only by the
               tree), constant 2-D W_i of equal N, inputs of rank 2 with equal leading dims,
               plus any number of constant row biases and other tensors
    condition: no pointwise-fusion pass is in the pipeline (ctx.options.pipeline, the
               selected pass names, lists none). Rule: before = n GEMMs + the Adds of the
               tree (separate kernels without pointwise fusion; onnxruntime folds one Add into a Gemm's C); after = 1 Concat +
               1 GEMM (+ the remaining non-MatMul variable terms). With pointwise fusion the
               Adds are fused into the next region anyway, so the merge would trade n-1 GEMMs
               for one Concat copy: no kernel saved, and not applied.
    rewrite:   Concat([a_1 .. a_n], axis=-1) -> MatMul(., stack_K(W_i)) + sum of constant
               biases (+ other terms), writing the tree's output tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import linear as gl
from onnxfuse.graph import rules
from onnxfuse.graph.rules import Match, Rule, Var, fail, op
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.writer import NodeWriter
from onnxfuse.pipeline import Context, Pass

@dataclass
class _AddTree:
    adds: list[gs.Node] = field(default_factory=list)
    leaves: list[gs.Tensor] = field(default_factory=list)


ADD = op.Add(Var("a"), Var("b"))
# A leaf of the tree: a product by a constant weight (read by the tree alone, checked below).
TERM = Rule("term", op.MatMul(Var("x"), Var("w")), private=False)


def _collect_add_tree(graph: gs.Graph, root: gs.Node) -> _AddTree:
    tree = _AddTree()
    inner = Rule("tree", ADD, private=False)

    def visit(node: gs.Node) -> None:
        tree.adds.append(node)
        for t in node.inputs:
            found = rules.match_at([inner], graph, t, set())
            p = found[1].root if found is not None else None
            if (
                p is not None
                and len(t.outputs) == 1
                and gl.rewirable(t, graph)
                and node.inputs.count(t) == 1
                and p.outputs[0].dtype == root.outputs[0].dtype
            ):
                visit(p)
            else:
                tree.leaves.append(t)

    visit(root)
    return tree


def _same_leading_dims(a: gs.Tensor, b: gs.Tensor) -> bool:
    da, db = gu.dims(a), gu.dims(b)
    if da is None or db is None or len(da) != 2 or len(db) != 2:
        return False
    return da[0] is not None and da[0] == db[0]


def merge_xh_matmul(graph: gs.Graph, ctx: Context) -> int:
    if ctx.options.pointwise_fusion_runs():
        return 0
    if not rules.any_root(graph, gl.LINEAR):
        return 0
    refresh_shapes(graph)
    return rules.apply(graph, [Rule("merge-xh-matmul", ADD, condition=_merges, rewrite=_merge, private=False)],
                       ctx.explainer)


def _merges(m: Match, graph: gs.Graph):
    """Binds tree, terms (MatMul, weight) and rest when the Add tree topped by m.root has two
    or more products by constant weights of one width on distinct rank-2 inputs."""
    root = m.root
    out = root.outputs[0]
    # Only the top of a tree: a root read by another Add of the tree is handled there.
    reader = gu.single_consumer(out)
    if reader is not None and rules.match(ADD, reader) is not None and gl.rewirable(out, graph):
        return fail("it is read by another Add of a tree (handled there)")
    tree = _collect_add_tree(graph, root)
    terms, rest = [], []
    for leaf in tree.leaves:
        found = rules.match_at([TERM], graph, leaf, set())
        p = found[1].root if found is not None else None
        w = gu.constant_value(p.inputs[1]) if p is not None else None
        if (
            w is not None and w.ndim == 2 and w.dtype.kind in gl.FLOAT_KINDS
            and len(leaf.outputs) == 1 and gl.rewirable(leaf, graph)
            and not isinstance(p.inputs[0], gs.Constant)
            and gu.rank(p.inputs[0]) == 2
        ):
            terms.append((p, w))
        else:
            rest.append(leaf)
    if len(terms) < 2:
        return fail(f"{len(terms)} product(s) of a rank-2 input by a constant weight among its terms, not 2 or more")
    n = terms[0][1].shape[1]
    a0 = terms[0][0].inputs[0]
    if any(w.shape[1] != n or w.dtype != terms[0][1].dtype for _, w in terms):
        return fail("the weights differ in width or type")
    if len({id(p.inputs[0]) for p, _ in terms}) != len(terms):
        return fail("two products read one input")
    if not all(_same_leading_dims(a0, p.inputs[0]) for p, _ in terms[1:]):
        return fail("the products' inputs differ in their leading dim")
    m.bindings.update(tree=tree, terms=terms, rest=rest)
    return True


def _merge(graph: gs.Graph, m: Match) -> bool:
    tree, terms, rest, out = m["tree"], m["terms"], m["rest"], m.root.outputs[0]
    n = terms[0][1].shape[1]
    dtype = terms[0][1].dtype
    biases, others = [], []
    for t in rest:
        v = gu.constant_value(t)
        b = gl.row_bias(v, n, 2) if v is not None and v.dtype == dtype else None
        if b is not None:
            biases.append(b)
        else:
            others.append(t)
    w = NodeWriter(graph)
    base = w.base(f"{out.name}_xh")
    cat = w.op("Concat", *[p.inputs[0] for p, _ in terms], name=f"{base}/Concat", out=f"{base}_concat", dtype=dtype,
               attrs={"axis": -1})
    w_t = w.constant(f"{base}_weight", np.concatenate([wt for _, wt in terms], axis=0))
    extra = []
    if biases:
        extra.append(w.constant(f"{base}_bias", np.sum(biases, axis=0).astype(dtype)))
    extra += others
    cur = w.op("MatMul", cat, w_t, name=f"{base}/MatMul", out=out if not extra else f"{base}_matmul", dtype=dtype)
    for i, t in enumerate(extra):
        last = i == len(extra) - 1
        cur = w.op("Add", cur, t, name=f"{base}/Add{i}", out=out if last else f"{base}_add{i}", dtype=dtype)
    for n_ in tree.adds:
        gu.disconnect(n_)
    for p, _ in terms:
        gu.disconnect(p)
    graph.nodes.extend(w.nodes)
    return True


PASS = Pass(
    "merge-xh-matmul",
    430,
    "x@Wx + h@Wh as one GEMM on Concat([x, h]) when the Adds would be separate kernels",
    merge_xh_matmul,
)
