"""A GatherND that gathers every element in order: its index tuples are its own coordinates.

gather-by-index-grid
    match:     GatherND(D, Concat(Unsqueeze(Expand(a_0, s), -1), Unsqueeze(Expand(a_1, s), -1),
               axis=-1), batch_dims=0) -> y, D of rank 2: the dynamo exporter's form of
               transformers' padding mask `mask[batch_arange[:, None, None, None],
               kv_arange[None, None, None, :]]` (BERT: [batch, seq] to [batch, 1, 1, seq])
    condition: a_k is Range(0, n_k, 1) with size-1 axes inserted by Unsqueeze, so its values are
               the coordinate on one axis p_k of y; p_0 < p_1; y's dim there is a_k's and D's dim
               k (symbolic dims, Range lengths and Slices to run-time bounds resolved), every
               other dim of y is 1. Then y[e] = D[e[p_0], e[p_1]]: D with size-1 axes inserted
    rewrite:   y = Unsqueeze(D, the other axes): one kernel for the Ranges, Unsqueezes, Max,
               Shape, Expands, Concat and GatherND that build and apply the index grid
               (BERT dynamo export: 12 kernels)
"""
from __future__ import annotations

from functools import partial

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import facts
from onnxfuse.graph import rules
from onnxfuse.graph.patterns import INDEX_GRID_GATHER
from onnxfuse.graph.rules import Const, Match, Rest, Rule, Var, op
from onnxfuse.graph.shape_values import refined_dims
from onnxfuse.graph.slices import normalize_axis
from onnxfuse.pipeline import Context, Pass

_MAX_UNSQUEEZES = 8


def _unsqueeze_axes(node: gs.Node, in_rank: int) -> list[int] | None:
    """The axes an Unsqueeze inserts, non-negative, sorted; None when not constant or invalid."""
    if len(node.inputs) > 1 and gu.is_present(node.inputs[1]):
        axes = gu.constant_ints(node.inputs[1])
    else:
        axes = gu.attr(node, "axes")
    if axes is None:
        return None
    out_rank = in_rank + len(axes)
    norm = sorted({normalize_axis(int(a), out_rank) for a in axes})
    if None in norm or len(norm) != len(axes):
        return None
    return norm


UNSQUEEZE = Rule("unsqueeze", op.Unsqueeze(Var("x"), Rest("axes")))
ARANGE = Rule("arange", op.Range(Const(0.0), Var("n"), Const(1.0)))


def _arange_axis(t: gs.Tensor) -> tuple[int, int] | None:
    """(axis, rank) when t is Range(0, n, 1) with size-1 axes inserted by Unsqueeze: every element
    is its coordinate on that axis."""
    chain: list[gs.Node] = []
    found = rules.match_at([UNSQUEEZE], None, t, set())
    while found is not None and len(chain) < _MAX_UNSQUEEZES:
        chain.append(found[1].root)
        t = found[1]["x"]
        found = rules.match_at([UNSQUEEZE], None, t, set())
    if rules.match_at([ARANGE], None, t, set()) is None:
        return None
    axis, rank = 0, 1
    for unsqueeze in reversed(chain):
        inserted = _unsqueeze_axes(unsqueeze, rank)
        if inserted is None:
            return None
        kept = [i for i in range(rank + len(inserted)) if i not in inserted]
        axis, rank = kept[axis], rank + len(inserted)
    return axis, rank


def _stacks_on_last_axis(stack: gs.Node, rank: int) -> bool:
    axes = _unsqueeze_axes(stack, rank)
    return axes == [rank]


def _grid_axes(shapes: facts.ShapeTable, m: Match) -> tuple[list[int], int] | None:
    """(p_0, p_1) and y's rank when the condition holds."""
    data_dims, y_dims = shapes.dims(m["data"]), shapes.dims(m.output)
    if data_dims is None or len(data_dims) != 2 or y_dims is None or len(y_dims) <= 2:
        return None
    rank = len(y_dims)
    axes = []
    for k in range(2):
        found = _arange_axis(m[f"arange{k}"])
        grid = m[f"grid{k}"].outputs[0]
        grid_dims = shapes.dims(grid)
        if found is None or grid_dims != y_dims or not _stacks_on_last_axis(m[f"stack{k}"], rank):
            return None
        local, local_rank = found
        if local_rank > rank:
            return None
        p = local + rank - local_rank  # Expand aligns shapes on the right
        a_dims = shapes.dims(m[f"arange{k}"])
        if a_dims is None or len(a_dims) != local_rank or a_dims[local] is None:
            return None
        if not (a_dims[local] == y_dims[p] == data_dims[k]):
            return None
        axes.append(p)
    if axes[0] >= axes[1] or any(d != 1 for i, d in enumerate(y_dims) if i not in axes):
        return None
    return axes, rank


def _condition(shapes: facts.ShapeTable, m: Match, graph: gs.Graph) -> bool:
    return _grid_axes(shapes, m) is not None


def _unsqueeze_data(shapes: facts.ShapeTable, graph: gs.Graph, m: Match) -> bool:
    axes, rank = _grid_axes(shapes, m)
    y, gather = m.output, m["gather"]
    inserted = gu.make_constant(graph, f"{y.name}_axes",
                                np.asarray([i for i in range(rank) if i not in axes], np.int64))
    out = gu.take_output([gather], y, shapes.dims(y))
    graph.nodes.append(gs.Node("Unsqueeze", name=gu.unique_name(graph, f"{gather.name}_as_unsqueeze"),
                               inputs=[m["data"], inserted], outputs=[out]))
    return True


def run(graph: gs.Graph, ctx: Context) -> int:
    if (graph.opset or 1) < 13 or not rules.any_root(graph, [Rule("gather", INDEX_GRID_GATHER)]):
        return 0
    shapes, _ = refined_dims(graph, facts.ShapeTable(graph))
    rule = Rule("gather-by-index-grid", INDEX_GRID_GATHER, rewrite=partial(_unsqueeze_data, shapes),
                condition=partial(_condition, shapes))
    return rules.apply(graph, [rule], ctx.explainer)


PASS = Pass(
    name="gather-by-index-grid",
    order=216,
    summary="GatherND by a grid of aranges over its own coordinates (a padding mask's) as an Unsqueeze",
    run=run,
)
