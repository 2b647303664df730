"""Hoisting a weight over Gathers: the per-step input projections of an unrolled RNN as one GEMM.

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
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import linear as gl
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.pipeline import Context, Pass

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
    if not any(gu.is_op(n, "Gather") for n in graph.nodes):
        return 0  # no MatMul over a Gather: no shape inference paid
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


PASS = Pass(
    "hoist-matmul-over-gather",
    400,
    "one MatMul over a tensor for MatMuls with one weight on Gathers of it (RNN input projections)",
    hoist_matmul_over_gather,
)
