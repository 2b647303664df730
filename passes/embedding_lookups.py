"""Embedding lookups that need no Gather: rows of a table picked by ids the graph already knows.

position-ids-as-slice
    match:     Gather(T, Slice(P, starts, ends, axes, [steps]), axis=0) -> y
    condition: T and P constants; P integer, of one axis k of length N (T's row count) and all
               other dims 1 ahead of it, its values 0..N-1 (the `position_ids` buffer Hugging
               Face's models register, sliced `[:, :seq]`); the Slice on axis k alone; y no graph
               output, read only by broadcasting elementwise ops whose other operand has y's
               rank (P's leading 1s then change nothing)
    rewrite:   y = Slice(T, starts, ends, [0], [steps]): on equal lengths the Slice takes the
               same indices, so it takes the rows the Gather took; one kernel instead of the
               Slice of the ids and the Gather

uniform-index-lookup
    match:     Gather(T, ids, axis=0) -> y
    condition: T constant; every element of ids provably one index v (a constant, or an Expand,
               Gather, GatherElements, Slice, Reshape ... of one: the token type ids a BERT-style
               model reads from its all-zero buffer when it is given none); y no graph output,
               read only by broadcasting elementwise ops whose other operand has ids' dims in
               the same places (or ids' dim is 1 there), so y's leading dims change nothing
    rewrite:   the readers read the constant row T[v]; the lookup and whatever computed the ids
               for it alone go (BERT, dynamo export: its GatherElements, Expand, Concat and
               Gather, 4 kernels)
"""
from __future__ import annotations

from functools import partial

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import rules
from onnxfuse.graph import facts
from onnxfuse.graph.shape_values import refined_dims
from onnxfuse.graph.patterns import BROADCASTING_BINARY, POSITION_LOOKUP, TABLE_LOOKUP
from onnxfuse.graph.rules import Failure, Match, Rule, fail
from onnxfuse.graph.slices import normalize_axis
from onnxfuse.pipeline import Context, Pass

# A position buffer longer than this is not read (its values are compared with an arange).
_MAX_POSITIONS = 1 << 16
_NOT_BROADCAST = fail("the lookup's output is a graph output, or read by other than broadcasting elementwise ops"
                      " whose other operand keeps its leading dims")


def _same_dim(a, b) -> bool:
    return a is not None and a == b


def _readers_broadcast_over(graph: gs.Graph, shapes: facts.ShapeTable, y: gs.Tensor, dropped: int) -> bool:
    """Whether replacing y by its trailing dims (its first `dropped` dims left out) leaves every
    reader's result the same: each reader broadcasts y against another operand that has y's
    rank at least and, in each left-out place, y's dim (or y's dim there is 1)."""
    y_dims = shapes.dims(y)
    if y_dims is None or gu.is_graph_output(graph, y) or not y.outputs:
        return False
    for reader in y.outputs:
        if not gu.is_op(reader, *BROADCASTING_BINARY):
            return False
        other = gu.other_input(reader, y)
        other_dims = None if other is None else shapes.dims(other)
        if other_dims is None or len(other_dims) < len(y_dims):
            return False
        offset = len(other_dims) - len(y_dims)
        for i in range(dropped):
            if y_dims[i] != 1 and not _same_dim(y_dims[i], other_dims[offset + i]):
                return False
    return True


def _table(t: gs.Tensor) -> bool:
    return isinstance(t, gs.Constant) and t.shape is not None and len(t.shape) >= 1


# position-ids-as-slice --------------------------------------------------------------------


def _positions_axis(m: Match) -> int | Failure:
    """The axis of P the Slice takes ids along, when P is an arange over T's rows on that axis
    (other dims 1, ahead of it) and the Slice cuts that axis alone; else why not."""
    table, positions, cut = m["table"], m["positions"], m["ids_slice"]
    if not _table(table) or not isinstance(positions, gs.Constant) or positions.shape is None:
        return fail("the table or the sliced ids are not initializers of known shape")
    shape = [int(d) for d in positions.shape]
    rows = int(table.shape[0])
    if not shape or shape[-1] != rows or any(d != 1 for d in shape[:-1]) or rows > _MAX_POSITIONS:
        return fail(f"the ids {shape} are not [1, ..., 1, {rows}] (one per table row, at most {_MAX_POSITIONS})")
    if len(cut.inputs) < 3:
        return fail("the Slice's bounds are attributes (Slice-1)")
    axis = len(shape) - 1
    if len(cut.inputs) > 3 and gu.is_present(cut.inputs[3]):
        axes = gu.constant_ints(cut.inputs[3])
        if axes is None or len(axes) != 1 or normalize_axis(int(axes[0]), len(shape)) != axis:
            return fail("the Slice does not cut the ids' last axis alone")
    elif axis != 0:
        return fail("the Slice does not cut the ids' last axis alone")
    values = gu.constant_value(positions)
    if values is None or values.dtype.kind not in "iu":
        return fail("the ids are not integers")
    if not np.array_equal(values.reshape(-1), np.arange(rows)):
        return fail(f"the ids are not 0..{rows - 1}")
    return axis


def _position_condition(shapes: facts.ShapeTable, m: Match, graph: gs.Graph) -> bool | Failure:
    axis = _positions_axis(m)
    if isinstance(axis, Failure):
        return axis
    return _readers_broadcast_over(graph, shapes, m.output, axis) or _NOT_BROADCAST


def _slice_rows(shapes: facts.ShapeTable, graph: gs.Graph, m: Match) -> bool:
    table, cut, lookup = m["table"], m["ids_slice"], m["lookup"]
    y = m.output
    y_dims = shapes.dims(y)
    kept = y_dims[len(y_dims) - len(table.shape):]
    axes = gu.make_constant(graph, f"{y.name}_rows_axis", np.asarray([0], np.int64))
    inputs = [table, cut.inputs[1], cut.inputs[2], axes]
    if len(cut.inputs) > 4 and gu.is_present(cut.inputs[4]):
        inputs.append(cut.inputs[4])
    out = gu.take_output([lookup], y, kept)
    graph.nodes.append(gs.Node("Slice", name=gu.unique_name(graph, f"{lookup.name}_rows"), inputs=inputs,
                               outputs=[out]))
    return True


# uniform-index-lookup ---------------------------------------------------------------------


def _uniform_index(m: Match) -> int | None:
    table = m["table"]
    if not _table(table):
        return None
    v = gu.uniform_value(m["ids"])  # an int when the ids come from an integer constant
    if not isinstance(v, int) or isinstance(v, bool):
        return None
    rows = int(table.shape[0])
    return int(v) if -rows <= int(v) < rows else None


def _uniform_condition(shapes: facts.ShapeTable, m: Match, graph: gs.Graph) -> bool | Failure:
    ids_dims = shapes.dims(m["ids"])
    if isinstance(m["ids"], gs.Constant) or ids_dims is None:
        return fail("the ids are an initializer (fold-constants' case) or of unknown dims")
    if _uniform_index(m) is None:
        return fail("the ids are not provably one index within the table's rows")
    return _readers_broadcast_over(graph, shapes, m.output, len(ids_dims)) or _NOT_BROADCAST


def _read_row(graph: gs.Graph, m: Match) -> bool:
    table, v = m["table"], _uniform_index(m)
    row = np.take(np.asarray(table.values), v, axis=0)
    const = gu.make_constant(graph, f"{table.name}_row{v % int(table.shape[0])}", np.ascontiguousarray(row))
    gu.replace_uses(m.output, const)
    gu.disconnect(m["lookup"])
    return True


def _rules(shapes: facts.ShapeTable) -> list[Rule]:
    """The two rules, reasoning on `shapes` (symbolic dims refined with Range lengths and
    Slices to run-time bounds: the exporters' shape arithmetic)."""
    return [
        Rule("position-ids-as-slice", POSITION_LOOKUP, rewrite=partial(_slice_rows, shapes),
             condition=partial(_position_condition, shapes), private=False),
        Rule("uniform-index-lookup", TABLE_LOOKUP, rewrite=_read_row,
             condition=partial(_uniform_condition, shapes), private=False),
    ]


def _candidate(node: gs.Node) -> bool:
    return gu.is_op(node, "Gather") and len(node.inputs) == 2 and _table(node.inputs[0]) \
        and not isinstance(node.inputs[1], gs.Constant)


def run(graph: gs.Graph, ctx: Context) -> int:
    if not any(_candidate(n) for n in graph.nodes):
        return 0  # no lookup of a constant table: no shape inference either
    shapes, _ = refined_dims(graph, facts.ShapeTable(graph))
    return rules.apply(graph, _rules(shapes), ctx.explainer)


PASS = Pass(
    name="embedding-lookups",
    order=215,
    summary="position-id and constant-id embedding Gathers as a Slice of the table or one constant row",
    run=run,
)
