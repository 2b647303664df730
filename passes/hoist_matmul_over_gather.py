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
from onnxfuse.graph import rules
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.rules import Match, Rule, Var, fail, op
from onnxfuse.graph.writer import NodeWriter
from onnxfuse.pipeline import Context, Pass

FOLD_TABLE_MAX = 1 << 22  # elements of a folded embedding @ weight table (16 MiB of float32)

# The Gather may have other readers: it stays for them.
PROJECTION = op.MatMul(op.Gather(Var("src"), Var("idx"), _name="gather"), Var("w"))
# T as an embedding lookup: Gather(E, ids, axis=0) of a constant 2-D table E.
LOOKUP = op.Gather(Var("table"), Var("ids"), axis=lambda a: a in (None, 0, -2))


def _member(m: Match, graph: gs.Graph):
    """Binds axis, weight, bias (array or None), nodes (the MatMul and a folded bias Add) and out."""
    mm, src = m.root, m["src"]
    if isinstance(src, gs.Constant):
        return fail("it gathers from a constant")
    idx = gu.constant_value(m["idx"])
    w = gu.constant_value(m["w"])
    rank = gu.rank(src)
    if idx is None or w is None or w.ndim != 2 or w.dtype.kind not in gl.FLOAT_KINDS or rank is None:
        return fail("its indices or its 2-D float weight are not constants, or the data's rank is unknown")
    axis = int(gu.attr(m["gather"], "axis", 0))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank - 1:
        return fail(f"it gathers along axis {axis}, the last (or none) of rank {rank}")
    nodes, out, bias = [mm], mm.outputs[0], None
    added = rules.match_reader([gl.BIAS], graph, out, "y")
    if added is not None:
        reader, other = added[1].root, added[1]["b"]
        b = gu.constant_value(other) if other is not out else None
        b = gl.row_bias(b, w.shape[1], None) if b is not None and b.dtype == w.dtype else None
        if b is not None:
            nodes.append(reader)
            out, bias = reader.outputs[0], b
    m.bindings.update(idx=idx, axis=axis, bias=bias, nodes=nodes, out=out)
    return True


MEMBER = Rule("hoist-matmul-over-gather", PROJECTION, condition=_member, private=False)
TABLE = Rule("embedding-table", LOOKUP)


def _table(graph: gs.Graph, src: gs.Tensor, dtype, cols: int):
    """(E, ids) when src = Gather(E, ids, axis=0) of a constant 2-D table E of `dtype` small
    enough to fold E @ W; else None."""
    found = rules.match_at([TABLE], graph, src)
    if found is None:
        return None
    table = gu.constant_value(found[1]["table"])
    if table is None or table.ndim != 2 or table.dtype != dtype or table.shape[0] * cols > FOLD_TABLE_MAX:
        return None
    return table, found[1]["ids"]


def hoist_matmul_over_gather(graph: gs.Graph, ctx: Context) -> int:
    if not any(gu.is_op(n, "Gather") for n in graph.nodes):
        return 0  # no MatMul over a Gather: no shape inference paid
    refresh_shapes(graph)
    groups: dict[tuple, list[Match]] = {}
    for _, m in rules.find_all(graph, [MEMBER], ctx.explainer):
        bias_key = None if m["bias"] is None else m["bias"].tobytes()
        groups.setdefault((m["src"].name, m["axis"], m["w"].name, bias_key), []).append(m)
    rewrites = 0
    for members in groups.values():
        first = members[0]
        src, axis, w_t, bias = first["src"], first["axis"], first["w"], first["bias"]
        size = gu.dims(src)[axis]
        covered = {int(i) % size for m in members for i in np.asarray(m["idx"]).reshape(-1)} if isinstance(size, int) else set()
        if len(members) < 2 or not isinstance(size, int) or 2 * len(covered) < size:
            if ctx.explainer is not None:
                for m in members:
                    ctx.explainer(m.root, f"{len(members)} projection(s) of '{src.name}' with this weight cover"
                                          f" {len(covered)} of {size} rows (two or more covering half are needed)")
            continue
        w = gu.constant_value(w_t)
        dtype = w.dtype
        writer = NodeWriter(graph)
        base = writer.base(f"{src.name}_hoisted")
        lookup = _table(graph, src, dtype, w.shape[1])
        if lookup is not None:
            folded = (lookup[0].astype(np.float64) @ w.astype(np.float64))
            if bias is not None:
                folded = folded + bias
            table = writer.constant(f"{base}_table", folded.astype(dtype))
            y = writer.op("Gather", table, lookup[1], name=f"{base}/Gather", out=f"{base}_folded", dtype=dtype,
                          attrs={"axis": 0})
        else:
            y = writer.op("MatMul", src, w_t, name=f"{base}/MatMul", out=f"{base}_matmul", dtype=dtype)
            if bias is not None:
                y = writer.op("Add", y, writer.constant(f"{base}_bias", bias), name=f"{base}/Add", out=f"{base}_add",
                              dtype=dtype)
        for k, m in enumerate(members):
            for n in m["nodes"]:
                gu.disconnect(n)
            writer.op("Gather", y, m["gather"].inputs[1], name=f"{base}/Gather_{k}", out=m["out"], attrs={"axis": axis})
        graph.nodes.extend(writer.nodes)
        rewrites += 1
    return rewrites


PASS = Pass(
    "hoist-matmul-over-gather",
    400,
    "one MatMul over a tensor for MatMuls with one weight on Gathers of it (RNN input projections)",
    hoist_matmul_over_gather,
)
