"""Batching linear layers: sibling MatMul/Gemm nodes on one input become one GEMM.

batch-sibling-matmul
    match:     n >= 2 "linear" readers of one tensor x: MatMul(x, W) or Gemm(x, W, C) (transA=0)
               with a constant 2-D W, each optionally followed by Add(constant row bias) and,
               when every member has one, the same unary activation (Relu, Tanh, ... with equal
               attributes); members are grouped by K (rows of the effective weight) and dtype
    condition: it saves kernels (the rule below); a Gemm bias C must be a row bias (shape [],
               [1], [N] or [1, N]); members whose weight, bias and activation are the same are
               computed once (shared weights are not duplicated)
    rewrite:   MatMul(x, concat_N(W_i')) [+ Add(concat_N(b_i'))] [+ activation] -> Split on the
               last axis writing the members' original output tensors, where W' = alpha * W
               (transposed for transB=1) and b' = beta * C (+ the Add bias). Only standard ONNX
               ops; onnxruntime turns MatMul+Add(+activation) into one (Fused)Gemm on 2-D x.

    Rule (kernels per inference; the activation is fused into the GEMM by onnxruntime on 2-D
    inputs and counted as one kernel otherwise): before = sum over members of 1 GEMM (+1 bias
    Add when x is not known to be 2-D, +1 activation); after = 1 GEMM (+1 bias Add, +1
    activation) + 1 Split, where the Split counts 0 when every reader of every piece is an
    elementwise op (the pointwise-fusion pass reads the pieces in place as views) other than an
    Add with another GEMM's output (onnxruntime folds that Add into the GEMM as its C input,
    which needs a real tensor). Applied when after < before and, if the Split is a real copy,
    the GEMM has a static number of rows <= SPLIT_COPY_MAX_ROWS (the copy grows with the batch,
    the saved dispatches do not: with a dynamic batch only in-place pieces qualify). Members
    that compute the same thing are always merged (a whole GEMM saved). Weights and FLOPs are unchanged; the one GEMM streams x once.

hoist-matmul-over-gather
    match:     n >= 2 MatMul(Gather(T, i_k, axis=a), W) [+ Add(bias)] with one T, one axis a that
               is not T's last axis, constant indices i_k, one constant 2-D W and one bias (the
               per-step input projections of an unrolled RNN: x_t = emb[:, t])
    condition: T's dim a is static and the i_k cover at least half of it (the hoisted GEMM
               computes no more than twice what the members did); saves n - 1 GEMMs
    rewrite:   Y = MatMul(T, W) [+ Add(bias)], member k's output = Gather(Y, i_k, axis=a).
               When T = Gather(E, ids, axis=0) of a constant 2-D table E (an embedding) with at
               most FOLD_TABLE_MAX elements in E @ W, Y becomes Gather(E @ W + bias, ids): the
               GEMM is computed once, here.

merge-xh-matmul
    match:     a tree of Add nodes (each read only inside the tree) whose leaves include >= 2
               MatMul(a_i, W_i) with distinct variable inputs a_i (each MatMul read only by the
               tree), constant 2-D W_i of equal N, inputs of rank 2 with equal leading dims,
               plus any number of constant row biases and other tensors
    condition: no pointwise-fusion pass is in the pipeline (ctx.options.pipeline, the
               selected pass names, lists none). Rule: before = n GEMMs + the Adds of the tree (separate kernels without
               pointwise fusion; onnxruntime folds one Add into a Gemm's C); after = 1 Concat +
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
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.linear import Linear, match_linear
from onnxfuse.graph.patterns import ACTIVATIONS, ELEMENTWISE
from onnxfuse.pipeline import Context, Pass

# A Split that stays a real copy pays only up to this many GEMM rows (static): its copy grows
# with the rows while the dispatches it saves do not (bench/results/matmul_batch.md).
SPLIT_COPY_MAX_ROWS = 16


def _same_activation(a: gs.Node, b: gs.Node) -> bool:
    return a.op == b.op and a.attrs == b.attrs and len(a.inputs) == len(b.inputs) == 1


def _attach_activations(graph: gs.Graph, members: list[Linear]) -> None:
    """Absorb the activation of every member when all have the same one."""
    acts = []
    for m in members:
        r = gu.single_consumer(m.output)
        if not gl.rewirable(m.output, graph) or not gu.is_op(r, *ACTIVATIONS) or len(r.inputs) != 1:
            return
        acts.append(r)
    if all(_same_activation(acts[0], a) for a in acts[1:]):
        for m, a in zip(members, acts):
            m.activation = a
            m.nodes.append(a)
            m.output = a.outputs[0]


def pointwise_fusion_runs(ctx: Context) -> bool:
    """Whether a pointwise-fusion pass follows in this pipeline. ctx.options.pipeline lists
    the selected pass names when the caller records them; without it the default pipeline,
    which fuses pointwise regions, is assumed."""
    names = ctx.options.pipeline
    if names is None:
        return True
    return any("pointwise" in n for n in names)


def _folds_into_gemm(reader: gs.Node, piece: gs.Tensor) -> bool:
    """An Add of the piece and the single-use output of another MatMul/Gemm: onnxruntime makes
    it that GEMM's C input, which must be a real tensor (the Split piece is materialized)."""
    if not gu.is_op(reader, "Add") or len(reader.inputs) != 2:
        return False
    other = reader.inputs[1] if reader.inputs[0] is piece else reader.inputs[0]
    return gu.is_op(gu.producer(other), "MatMul", "Gemm") and len(other.outputs) == 1


def _pieces_read_in_place(graph: gs.Graph, outputs: list[gs.Tensor]) -> bool:
    for t in outputs:
        if gu.is_graph_output(graph, t) or not t.outputs:
            return False
        if not all(gu.is_op(r, *ELEMENTWISE) and not _folds_into_gemm(r, t) for r in t.outputs):
            return False
    return True


def _kernels(members: list[Linear], unique: int, x_rank: int | None, split_free: bool) -> tuple[int, int]:
    has_bias = any(m.bias is not None for m in members)
    has_act = members[0].activation is not None
    bias_kernel = 0 if x_rank == 2 else 1
    before = sum(1 + (bias_kernel if m.bias is not None else 0) + (1 if m.activation is not None else 0) for m in members)
    after = 1 + (bias_kernel if has_bias else 0) + (1 if has_act else 0)
    if unique > 1 and not split_free:
        after += 1
    return before, after


def _static_rows(x: gs.Tensor) -> int | None:
    """Rows of the GEMM on x (all dims but the last) when static, else None."""
    d = gu.dims(x)
    if d is None or not all(isinstance(v, int) for v in d[:-1]):
        return None
    return int(np.prod(d[:-1], dtype=np.int64))


def _batch_group(graph: gs.Graph, x: gs.Tensor, members: list[Linear], ctx: Context) -> bool:
    _attach_activations(graph, members)
    blocks: list[Linear] = []
    duplicates: list[tuple[Linear, Linear]] = []
    for m in members:
        act_key = None if m.activation is None else (m.activation.op, repr(sorted(m.activation.attrs.items())))
        m.key = m.key + (act_key,)
        first = next((b for b in blocks if b.key == m.key), None)
        if first is None:
            blocks.append(m)
        else:
            duplicates.append((m, first))
    outputs = [b.output for b in blocks]
    split_free = pointwise_fusion_runs(ctx) and _pieces_read_in_place(graph, outputs)
    before, after = _kernels(members, len(blocks), gu.rank(x), split_free)
    # A materialized Split copies rows x sum(N) values; that cost grows with the batch while the
    # saved dispatches do not (bench/results/matmul_batch.md).
    rows = _static_rows(x)
    copy_pays = split_free or len(blocks) == 1 or (rows is not None and rows <= SPLIT_COPY_MAX_ROWS)
    if not duplicates and (after >= before or not copy_pays):
        return False
    dtype = members[0].weight.dtype
    base = gu.unique_name(graph, f"{x.name}_batched")
    w = np.concatenate([b.weight for b in blocks], axis=1)
    sizes = [b.weight.shape[1] for b in blocks]
    new_nodes: list[gs.Node] = []
    cur: gs.Tensor = x
    w_t = gu.make_constant(graph, f"{base}_weight", w)
    y = gs.Variable(f"{base}_matmul", dtype=dtype)
    new_nodes.append(gs.Node("MatMul", name=f"{base}/MatMul", inputs=[cur, w_t], outputs=[y]))
    cur = y
    if any(b.bias is not None for b in blocks):
        bias = np.concatenate([b.bias if b.bias is not None else np.zeros(b.weight.shape[1], dtype) for b in blocks])
        b_t = gu.make_constant(graph, f"{base}_bias", bias.astype(dtype))
        y = gs.Variable(f"{base}_add", dtype=dtype)
        new_nodes.append(gs.Node("Add", name=f"{base}/Add", inputs=[cur, b_t], outputs=[y]))
        cur = y
    act = blocks[0].activation
    # Disconnect the members first: their output tensors are reused by the new nodes.
    for m in members:
        for n in m.nodes:
            gu.disconnect(n)
    if act is not None:
        y = gs.Variable(f"{base}_{act.op.lower()}", dtype=dtype)
        new_nodes.append(gs.Node(act.op, name=f"{base}/{act.op}", attrs=dict(act.attrs), inputs=[cur], outputs=[y]))
        cur = y
    if len(blocks) == 1:
        # Only duplicates: the single block writes its own output.
        new_nodes[-1].outputs[0] = outputs[0]
    else:
        new_nodes.append(gu.split_node(graph, cur, sizes, outputs))
        new_nodes[-1].name = f"{base}/Split"
    for dup, first in duplicates:
        if gu.is_graph_output(graph, dup.output):
            new_nodes.append(gs.Node("Identity", name=f"{base}/Identity", inputs=[first.output], outputs=[dup.output]))
        else:
            gu.replace_uses(dup.output, first.output)
    graph.nodes.extend(new_nodes)
    return True


def batch_sibling_matmul(graph: gs.Graph, ctx: Context) -> int:
    refresh_shapes(graph)
    rewrites = 0
    changed = True
    while changed:
        changed = False
        for x in list(graph.tensors().values()):
            if isinstance(x, gs.Constant) or len(x.outputs) < 2:
                continue
            groups: dict[tuple, list[Linear]] = {}
            for node in list(x.outputs):
                m = match_linear(graph, node, x)
                if m is None:
                    continue
                if any(m.nodes[0] is g.nodes[0] for gl in groups.values() for g in gl):
                    continue
                groups.setdefault((m.weight.shape[0], m.weight.dtype.str), []).append(m)
            for members in groups.values():
                if len(members) >= 2 and _batch_group(graph, x, members, ctx):
                    rewrites += 1
                    changed = True
            if changed:
                break
    return rewrites


# hoist-matmul-over-gather -----------------------------------------------------------------------

FOLD_TABLE_MAX = 1 << 22  # elements of a folded embedding @ weight table (16 MiB of float32)


def _gather_member(graph: gs.Graph, mm: gs.Node):
    """(T, axis, indices, weight tensor, bias array|None, nodes, output) of MatMul(Gather(T, i, a), W) [+ bias]."""
    if not gu.is_op(mm, "MatMul"):
        return None
    g_out = mm.inputs[0]
    g = gu.producer(g_out)
    if not gu.is_op(g, "Gather") or isinstance(g.inputs[0], gs.Constant):
        return None
    idx = gu.constant_value(g.inputs[1])
    w = gu.constant_value(mm.inputs[1])
    src = g.inputs[0]
    rank = gu.rank(src)
    if idx is None or w is None or w.ndim != 2 or w.dtype.kind not in gl.FLOAT_KINDS or rank is None:
        return None
    axis = int(gu.attr(g, "axis", 0))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank - 1:
        return None
    nodes, out, bias = [mm], mm.outputs[0], None
    reader = gu.single_consumer(out)
    if gl.rewirable(out, graph) and gu.is_op(reader, "Add") and len(reader.inputs) == 2:
        other = reader.inputs[1] if reader.inputs[0] is out else reader.inputs[0]
        b = gu.constant_value(other) if other is not out else None
        b = gl.row_bias(b, w.shape[1], None) if b is not None and b.dtype == w.dtype else None
        if b is not None:
            nodes.append(reader)
            out, bias = reader.outputs[0], b
    return src, axis, idx, mm.inputs[1], bias, nodes, out


def hoist_matmul_over_gather(graph: gs.Graph, ctx: Context) -> int:
    refresh_shapes(graph)
    groups: dict[tuple, list] = {}
    for node in list(graph.nodes):
        m = _gather_member(graph, node)
        if m is None:
            continue
        src, axis, idx, w_t, bias, _, _ = m
        bias_key = None if bias is None else bias.tobytes()
        groups.setdefault((src.name, axis, w_t.name, bias_key), []).append(m)
    rewrites = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        src, axis, _, w_t, bias, _, _ = members[0]
        size = gu.dims(src)[axis]
        covered = {int(i) % size for m in members for i in np.asarray(m[2]).reshape(-1)} if isinstance(size, int) else set()
        if not isinstance(size, int) or 2 * len(covered) < size:
            continue
        w = gu.constant_value(w_t)
        dtype = w.dtype
        base = gu.unique_name(graph, f"{src.name}_hoisted")
        nodes: list[gs.Node] = []
        table_src = gu.producer(src)
        table = gu.constant_value(table_src.inputs[0]) if gu.is_op(table_src, "Gather") else None
        if (
            table is not None and table.ndim == 2 and table.dtype == dtype
            and int(gu.attr(table_src, "axis", 0)) in (0, -2)
            and table.shape[0] * w.shape[1] <= FOLD_TABLE_MAX
        ):
            folded = (table.astype(np.float64) @ w.astype(np.float64))
            if bias is not None:
                folded = folded + bias
            y = gs.Variable(f"{base}_folded", dtype=dtype)
            nodes.append(gs.Node("Gather", name=f"{base}/Gather", attrs={"axis": 0},
                                 inputs=[gu.make_constant(graph, f"{base}_table", folded.astype(dtype)), table_src.inputs[1]], outputs=[y]))
        else:
            y = gs.Variable(f"{base}_matmul", dtype=dtype)
            nodes.append(gs.Node("MatMul", name=f"{base}/MatMul", inputs=[src, w_t], outputs=[y]))
            if bias is not None:
                yb = gs.Variable(f"{base}_add", dtype=dtype)
                nodes.append(gs.Node("Add", name=f"{base}/Add", inputs=[y, gu.make_constant(graph, f"{base}_bias", bias)], outputs=[yb]))
                y = yb
        for k, (_, _, _, _, _, old, out) in enumerate(members):
            gather = gu.producer(old[0].inputs[0])
            for n in old:
                gu.disconnect(n)
            nodes.append(gs.Node("Gather", name=f"{base}/Gather_{k}", attrs={"axis": axis}, inputs=[y, gather.inputs[1]], outputs=[out]))
        graph.nodes.extend(nodes)
        rewrites += 1
    return rewrites


# merge-xh-matmul -------------------------------------------------------------------------------


@dataclass
class _AddTree:
    adds: list[gs.Node] = field(default_factory=list)
    leaves: list[gs.Tensor] = field(default_factory=list)


def _collect_add_tree(graph: gs.Graph, root: gs.Node) -> _AddTree:
    tree = _AddTree()

    def visit(node: gs.Node) -> None:
        tree.adds.append(node)
        for t in node.inputs:
            p = gu.producer(t)
            if (
                gu.is_op(p, "Add")
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
    if pointwise_fusion_runs(ctx):
        return 0
    refresh_shapes(graph)
    rewrites = 0
    for root in list(graph.nodes):
        if not gu.is_op(root, "Add") or not root.outputs:
            continue
        out = root.outputs[0]
        # Only the top of a tree: a root read by another Add of the tree is handled there.
        reader = gu.single_consumer(out)
        if gu.is_op(reader, "Add") and gl.rewirable(out, graph):
            continue
        tree = _collect_add_tree(graph, root)
        terms, rest = [], []
        for leaf in tree.leaves:
            p = gu.producer(leaf)
            w = gu.constant_value(p.inputs[1]) if gu.is_op(p, "MatMul") else None
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
            continue
        n = terms[0][1].shape[1]
        a0 = terms[0][0].inputs[0]
        if any(w.shape[1] != n or w.dtype != terms[0][1].dtype for _, w in terms):
            continue
        if len({id(p.inputs[0]) for p, _ in terms}) != len(terms):
            continue
        if not all(_same_leading_dims(a0, p.inputs[0]) for p, _ in terms[1:]):
            continue
        dtype = terms[0][1].dtype
        biases, others = [], []
        for t in rest:
            v = gu.constant_value(t)
            b = gl.row_bias(v, n, 2) if v is not None and v.dtype == dtype else None
            if b is not None:
                biases.append(b)
            else:
                others.append(t)
        base = gu.unique_name(graph, f"{out.name}_xh")
        cat = gs.Variable(f"{base}_concat", dtype=dtype)
        nodes = [gs.Node("Concat", name=f"{base}/Concat", attrs={"axis": -1}, inputs=[p.inputs[0] for p, _ in terms], outputs=[cat])]
        w_t = gu.make_constant(graph, f"{base}_weight", np.concatenate([w for _, w in terms], axis=0))
        cur = gs.Variable(f"{base}_matmul", dtype=dtype)
        nodes.append(gs.Node("MatMul", name=f"{base}/MatMul", inputs=[cat, w_t], outputs=[cur]))
        extra = []
        if biases:
            extra.append(gu.make_constant(graph, f"{base}_bias", np.sum(biases, axis=0).astype(dtype)))
        extra += others
        for n_ in tree.adds:
            gu.disconnect(n_)
        for p, _ in terms:
            gu.disconnect(p)
        for i, t in enumerate(extra):
            last = i == len(extra) - 1
            y = out if last else gs.Variable(f"{base}_add{i}", dtype=dtype)
            nodes.append(gs.Node("Add", name=f"{base}/Add{i}", inputs=[cur, t], outputs=[y]))
            cur = y
        if not extra:
            nodes[-1].outputs[0] = out
        graph.nodes.extend(nodes)
        rewrites += 1
    return rewrites


PASSES = [
    Pass(
        "hoist-matmul-over-gather",
        400,
        "one MatMul over a tensor for MatMuls with one weight on Gathers of it (RNN input projections)",
        hoist_matmul_over_gather,
    ),
    Pass(
        "batch-sibling-matmul",
        410,
        "one GEMM on concatenated weights for MatMul/Gemm siblings reading the same input",
        batch_sibling_matmul,
    ),
    Pass(
        "merge-xh-matmul",
        430,
        "x@Wx + h@Wh as one GEMM on Concat([x, h]) when the Adds would be separate kernels",
        merge_xh_matmul,
    ),
]
