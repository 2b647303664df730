"""The output projection and residual Add after a decode step's NaN guard, folded into the guard.

gqa-residual
    match:     onnxfuse.AttentionNanGuard(out, values) (fuse-gqa's exact guard after
               GroupQueryAttention) read only by MatMul(guarded, W), W a float32 [H*d, D]
               constant, whose output is read only by Add(residual, projected) (either order),
               residual float32 of the projected output's shape (no broadcast; both shapes
               known and equal).
    rewrite:   projected = MatMul(out, W) on the op's unguarded output, and
               AttentionNanGuard(out, values, projected, W, residual) = residual +
               MatMul(guarded, W): the guard changes only rows of out with a NaN, and a row of a
               MatMul depends on its own row alone, so the kernel adds residual + projected on
               the other rows and recomputes the few guarded ones (onnxfuse/ops/
               attention_nan_guard.py). Its fallback function is the guard, the MatMul and the
               Add as they were.
Why: with the exact guard a decode layer is GroupQueryAttention, the guard, the projection and
the residual Add; folded, the guard costs no kernel of its own (bench/results/decode_layers.md).
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from onnxfuse.fused import DOMAIN as FUSED_DOMAIN
from onnxfuse.fused import FusedRecord
from onnxfuse.graph import core as gu
from onnxfuse.graph import facts
from onnxfuse.graph import rules
from onnxfuse.graph.facts import _vague, refresh_shapes
from onnxfuse.graph.rules import Var, op, ops
from onnxfuse.graph.writer import NodeWriter
from onnxfuse.ops.attention_nan_guard import OP
from onnxfuse.pipeline import Context, Pass


def _dims(shapes: facts.ShapeTable, t: gs.Tensor):
    return shapes.dims(t) if t.shape is None or _vague(t.shape) else list(t.shape)


# residual + MatMul(AttentionNanGuard(out, values), W), the Add's operands in either order
PATTERN = op.Add(op.MatMul(ops(FUSED_DOMAIN).AttentionNanGuard(Var("out"), Var("values"), _name="guard"), Var("w"),
                           _name="mm"), Var("r"), _name="add")


def _condition(shapes: facts.ShapeTable):
    def fits(m: rules.Match, graph: gs.Graph):
        """The guarded output and the projection read by the match alone; W a float32 [H*d, D]
        initializer; the residual float32 of the projection's shape [B, S, D] (no broadcast)."""
        guard, mm, add, w, r = m["guard"], m["mm"], m["add"], m["w"], m["r"]
        y, p = guard.outputs[0], mm.outputs[0]
        if len(y.outputs) != 1 or len(p.outputs) != 1 or add.inputs[0] is add.inputs[1]:
            return rules.fail("the guarded output or its projection is read outside the match")
        if not isinstance(w, gs.Constant):
            return rules.fail("the projection's weight is not an initializer")
        wv = w.values
        yd = _dims(shapes, y)
        if wv.ndim != 2 or wv.dtype != np.float32 or yd is None or len(yd) != 3 or yd[2] != wv.shape[0]:
            return rules.fail("the projection is not of [B, S, H*d] by a float32 [H*d, D] weight")
        pd = _dims(shapes, p)
        rd = _dims(shapes, r)
        if r.dtype != np.float32 or pd is None or rd is None or _vague(pd) or list(pd) != list(rd):
            return rules.fail("the residual is not float32 of the projection's known shape")
        if len(pd) != 3 or list(pd[:2]) != list(yd[:2]) or pd[2] != wv.shape[1]:
            return rules.fail("the projection's output is not [B, S, D]")
        return True
    return fits


def _fold(graph: gs.Graph, ctx: Context, node: gs.Node, mm: gs.Node, add: gs.Node, w: gs.Tensor, r: gs.Tensor) -> bool:
    record = ctx.registry.by_node.get(node.name)
    if record is None:
        return False
    fn = record.function
    out, values = node.inputs
    p, y = mm.outputs[0], node.outputs[0]
    formals = list(fn.input) + [p.name, w.name, r.name]
    if len(set(formals)) != len(formals) or p.name in fn.output:
        return False
    writer = NodeWriter(graph)
    projected = writer.op("MatMul", out, w, name=f"{mm.name}_unguarded", out=f"{p.name}_unguarded", dtype=np.float32,
                          shape=p.shape)
    graph.nodes.extend(writer.nodes)
    result = add.outputs[0]
    body = list(fn.node) + [
        helper.make_node("MatMul", [y.name, w.name], [p.name], name=mm.name),
        helper.make_node("Add", [t.name for t in add.inputs], [result.name], name=add.name),
    ]
    # formal input names: the body reads the projection input under p's name, which the MatMul
    # above defines again; a formal of its own keeps the body single-assignment
    formal_p = f"{p.name}__projected"
    if formal_p in formals:
        return False
    formals[2] = formal_p
    new_fn = helper.make_function(FUSED_DOMAIN, OP.name, inputs=formals, outputs=[result.name], nodes=body,
                                  opset_imports=list(fn.opset_import))
    new_fn.overload = ctx.registry.new_overload(OP.name)
    name = ctx.registry.unique_node_name(f"{OP.name}_{add.name}")
    fused = gs.Node(OP.name, name=name, domain=FUSED_DOMAIN, attrs=dict(node.attrs),
                    inputs=[out, values, projected, w, r], outputs=[result])
    for n in (node, mm, add):
        n.inputs.clear()
        n.outputs.clear()
    graph.nodes.append(fused)
    del ctx.registry.by_node[node.name]
    ctx.registry.by_node[name] = FusedRecord(OP.name, new_fn.overload, new_fn)
    return True


def fold_gqa_residual(graph: gs.Graph, ctx: Context) -> int:
    if not ctx.target.has_kernel(OP.name) or not any(n.op == OP.name and n.domain == FUSED_DOMAIN for n in graph.nodes):
        return 0
    refresh_shapes(graph)
    shapes = facts.ShapeTable(graph)
    rule = rules.Rule("gqa-residual", PATTERN, condition=_condition(shapes))
    # the guards in the graph's order (the registry names the fused nodes in that order)
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    found = sorted((m for _, m in rules.find_all(graph, [rule], explain=ctx.explainer)), key=lambda m: order[id(m["guard"])])
    count = 0
    for m in found:
        if _fold(graph, ctx, m["guard"], m["mm"], m["add"], m["w"], m["r"]):
            count += 1
    if count:
        gu.cleanup(graph)
        gu.toposort(graph)
    return count


PASS = Pass(
    "gqa-residual",
    490,
    "the output projection and residual Add after fuse-gqa's NaN guard go into the guard's kernel",
    fold_gqa_residual,
    targets=("cpu",),
)
