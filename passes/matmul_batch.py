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
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import linear as gl
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.linear import Linear, match_linear
from onnxfuse.graph import rules
from onnxfuse.graph.patterns import ACTIVATION_RULES, ELEMENTWISE
from onnxfuse.graph.rules import ANY, Rule, Var, op
from onnxfuse.graph.writer import NodeWriter
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
        found = rules.match_reader(ACTIVATION_RULES, graph, m.output, "y")
        if found is None:
            return
        acts.append(found[1].root)
    if all(_same_activation(acts[0], a) for a in acts[1:]):
        for m, a in zip(members, acts):
            m.activation = a
            m.nodes.append(a)
            m.output = a.outputs[0]


# An Add of a Split piece and the output of another MatMul/Gemm that it alone reads.
GEMM_C = tuple(Rule(f"gemm-c/{p.op}", op.Add(Var("piece"), p), private=False,
                    condition=lambda m, graph: len(m["gemm"].outputs[0].outputs) == 1)
               for p in (op.MatMul(ANY, ANY, _name="gemm"), op.Gemm(ANY, ANY, ANY, _name="gemm")))


def _folds_into_gemm(graph: gs.Graph, reader: gs.Node, piece: gs.Tensor) -> bool:
    """An Add of the piece and the single-use output of another MatMul/Gemm: onnxruntime makes
    it that GEMM's C input, which must be a real tensor (the Split piece is materialized)."""
    return rules.first_match(GEMM_C, graph, reader, bind={"piece": piece}) is not None


def _pieces_read_in_place(graph: gs.Graph, outputs: list[gs.Tensor]) -> bool:
    for t in outputs:
        if gu.is_graph_output(graph, t) or not t.outputs:
            return False
        if not all(gu.is_op(r, *ELEMENTWISE) and not _folds_into_gemm(graph, r, t) for r in t.outputs):
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
    split_free = ctx.options.pointwise_fusion_runs() and _pieces_read_in_place(graph, outputs)
    before, after = _kernels(members, len(blocks), gu.rank(x), split_free)
    # A materialized Split copies rows x sum(N) values; that cost grows with the batch while the
    # saved dispatches do not (bench/results/matmul_batch.md).
    rows = _static_rows(x)
    copy_pays = split_free or len(blocks) == 1 or (rows is not None and rows <= SPLIT_COPY_MAX_ROWS)
    if not duplicates and (after >= before or not copy_pays):
        return False
    dtype = members[0].weight.dtype
    w = NodeWriter(graph)
    base = w.base(f"{x.name}_batched")
    sizes = [b.weight.shape[1] for b in blocks]
    w_t = w.constant(f"{base}_weight", np.concatenate([b.weight for b in blocks], axis=1))
    cur = w.op("MatMul", x, w_t, name=f"{base}/MatMul", out=f"{base}_matmul", dtype=dtype)
    if any(b.bias is not None for b in blocks):
        # A member without a bias gets -0, not +0: x + -0 is x for every x, where -0 + +0 is +0
        # (a MatMul's exact -0 divided into a number gave +inf for -inf: fuzz seed 9064573).
        bias = np.concatenate([b.bias if b.bias is not None else np.full(b.weight.shape[1], -0.0, dtype)
                               for b in blocks])
        b_t = w.constant(f"{base}_bias", bias.astype(dtype))
        cur = w.op("Add", cur, b_t, name=f"{base}/Add", out=f"{base}_add", dtype=dtype)
    act = blocks[0].activation
    # Disconnect the members first: their output tensors are reused by the new nodes.
    for m in members:
        for n in m.nodes:
            gu.disconnect(n)
    if act is not None:
        cur = w.op(act.op, cur, name=f"{base}/{act.op}", out=f"{base}_{act.op.lower()}", dtype=dtype, attrs=act.attrs)
    if len(blocks) == 1:
        # Only duplicates: the single block writes its own output.
        w.nodes[-1].outputs[0] = outputs[0]
    else:
        w.add(gu.split_node(graph, cur, sizes, outputs, name=w.node_name(f"{base}/Split")))
    for i, (dup, first) in enumerate(duplicates):
        if gu.is_graph_output(graph, dup.output):
            # one Identity per duplicate that is a graph output: each needs a name of its own
            w.op("Identity", first.output, name=f"{base}/Identity", out=dup.output)
        else:
            gu.replace_uses(dup.output, first.output)
    graph.nodes.extend(w.nodes)
    return True


def batch_sibling_matmul(graph: gs.Graph, ctx: Context) -> int:
    if not rules.any_root(graph, gl.LINEAR):
        return 0  # nothing to batch: no shape inference paid
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


PASS = Pass(
    "batch-sibling-matmul",
    410,
    "one GEMM on concatenated weights for MatMul/Gemm siblings reading the same input",
    batch_sibling_matmul,
)
