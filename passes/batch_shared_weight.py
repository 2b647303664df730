"""Linear layers that apply one weight to independent inputs become one GEMM over stacked rows.

batch-shared-weight-matmul
    match:     n >= 2 linear nodes (MatMul(x_i, W) or Gemm(x_i, W, C) with transA=0, each
               optionally followed by Add(constant row bias); see onnxfuse.graph.linear.match_linear)
               that compute the same thing (one constant W, the same transB/alpha, the same
               bias) on distinct 2-D inputs x_i of one static shape [B, K]: an unrolled RNN's
               per-step input projection of a second layer (x_t = h1_t), a model applying one
               layer at several places
    condition: no x_i depends on a member's output (a recurrent projection h_t @ W_hh does:
               h_t needs h_{t-1} @ W_hh), so one GEMM can run after all inputs exist; the rows
               n * B are static and at most MAX_ROWS (the Concat and Split copies grow with the
               rows, the saved dispatches do not)
    rewrite:   Concat([x_1 .. x_n], axis=0) -> MatMul(W') [+ Add(b')] -> Split(axis=0) writing
               the members' output tensors. n GEMMs become 3 kernels (Concat, GEMM, Split), and
               the weight is read once instead of n times. Members are taken in graph order;
               the Split pieces are ordinary tensors, so onnxruntime still folds a following
               Add of another GEMM's output into that GEMM as its C input.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph import rules
from onnxfuse.graph.linear import LINEAR, Linear, as_linear
from onnxfuse.graph.rules import Match, fail
from onnxfuse.graph.writer import NodeWriter
from onnxfuse.pipeline import Context, Pass

MAX_ROWS = 256
MIN_MEMBERS = 3  # Concat + GEMM + Split: fewer than 3 members saves no kernel


def _descendants(start: gs.Tensor) -> set[int]:
    """ids of the nodes that read `start`, directly or through other nodes."""
    seen: set[int] = set()
    stack = list(start.outputs)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for t in node.outputs:
            stack.extend(t.outputs)
    return seen


def _stackable(m: Match, graph: gs.Graph):
    """A linear layer (binds "linear") on an input of static 2-D shape (binds "shape")."""
    shape = gu.static_shape(m["x"])
    if shape is None or len(shape) != 2:
        return fail("its input has no static 2-D shape")
    m.bindings["shape"] = shape
    return as_linear(m, graph)


MEMBERS = [replace(rule, condition=_stackable) for rule in LINEAR]


def _members(graph: gs.Graph, explain) -> dict[tuple, list[tuple[gs.Tensor, Linear]]]:
    groups: dict[tuple, list[tuple[gs.Tensor, Linear]]] = defaultdict(list)
    for _, m in rules.find_all(graph, MEMBERS, explain):
        lin = m["linear"]
        groups[lin.key + (m["shape"], str(lin.weight.dtype))].append((m["x"], lin))
    return groups


def _independent(members: list[tuple[gs.Tensor, Linear]]) -> list[tuple[gs.Tensor, Linear]]:
    """The longest prefix-greedy subset in which no member's input depends on another's output."""
    chosen: list[tuple[gs.Tensor, Linear]] = []
    below: set[int] = set()  # nodes downstream of a chosen member's first node
    for x, lin in members:
        first = lin.nodes[0]
        if id(gu.producer(x)) in below:
            continue
        mine = _descendants(first.outputs[0])
        # x_i must not depend on this member either (a later chosen input reading our output)
        if any(id(gu.producer(cx)) in mine for cx, _ in chosen):
            continue
        chosen.append((x, lin))
        below |= mine
    return chosen


def run(graph: gs.Graph, ctx: Context) -> int:
    if not rules.any_root(graph, MEMBERS):
        return 0  # nothing to batch: no shape inference paid
    refresh_shapes(graph)
    made = 0
    for key, members in _members(graph, ctx.explainer).items():
        members = list({id(lin.nodes[0]): (x, lin) for x, lin in members}.values())
        # Distinct inputs only: the same x twice is one computation (batch-sibling-matmul's case).
        seen_x: set[int] = set()
        members = [(x, lin) for x, lin in members if not (id(x) in seen_x or seen_x.add(id(x)))]
        members = _independent(members)
        if len(members) < MIN_MEMBERS:
            if ctx.explainer is not None:
                for _, lin in members:
                    ctx.explainer(lin.nodes[0], f"{len(members)} independent layer(s) apply its weight to distinct"
                                                f" inputs of its shape, not {MIN_MEMBERS} or more")
            continue
        rows, k = gu.static_shape(members[0][0])
        if rows * len(members) > MAX_ROWS:
            members = members[: MAX_ROWS // rows]
            if len(members) < MIN_MEMBERS:
                continue
        lin0 = members[0][1]
        stem = f"{lin0.nodes[0].name or 'matmul'}/shared_weight"
        node_names = {nd.name for nd in graph.nodes}
        base, i = stem, 0
        while f"{base}/Concat" in node_names:
            i += 1
            base = f"{stem}_{i}"
        dtype, n = lin0.weight.dtype, lin0.weight.shape[1]
        w = NodeWriter(graph)
        stacked = w.op("Concat", *[x for x, _ in members], name=f"{base}/Concat", out=f"{base}/rows", dtype=dtype,
                       shape=[rows * len(members), k], attrs={"axis": 0})
        weight = w.constant(f"{base}_weight", lin0.weight)
        y = w.op("MatMul", stacked, weight, name=f"{base}/MatMul", out=f"{base}/product", dtype=dtype,
                 shape=[rows * len(members), n])
        if lin0.bias is not None:
            y = w.op("Add", y, w.constant(f"{base}_bias", lin0.bias), name=f"{base}/Add", out=f"{base}/biased",
                     dtype=dtype, shape=[rows * len(members), n])
        outputs = [gu.take_output(lin.nodes, lin.output, [rows, n]) for _, lin in members]
        w.add(gu.split_node(graph, y, [rows] * len(members), outputs, axis=0, name=w.node_name(f"{base}/Split")))
        graph.nodes.extend(w.nodes)
        made += len(members)
    return made  # the pipeline sorts the graph after a pass that rewrote


PASS = Pass(
    name="batch-shared-weight-matmul",
    order=420,
    summary="one GEMM over Concat-stacked rows for MatMuls applying one weight to independent inputs (RNN layer-2 input projections)",
    run=run,
)
