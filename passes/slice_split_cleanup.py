"""Slice/Split/Concat cleanups: copies that give back what they were given.

remove-noop-slice
    match:     Slice(x) -> y | Split(x) -> y (one output) | Concat(x) -> y (one input)
    condition: Slice: on every sliced axis the indices are 0..dim-1 in order, checked against
               the static dim (or, for a dim only known at run time, start 0, step 1 and an end
               no tensor reaches); Split and Concat: always
    rewrite:   readers of y read x

merge-slices
    match:     Slice(Slice(x, a), b) -> y, the inner result read only by the outer Slice
    condition: constant starts/ends/axes/steps; axes disjoint, or on a shared axis the dim is
               static, or starts/ends are non-negative and steps positive (then the composed
               slice is exact for every size)
    rewrite:   Slice(x, a∘b) -> y

remove-split-concat
    match:     Concat(..., s_1, ..., s_k, ...) -> y where s_1..s_k = Split(x) are all the outputs
               of the Split, in order
    condition: Split and Concat on the same axis
    rewrite:   Concat(..., x, ...) (Concat(x) alone becomes x)

remove-concat-split
    match:     Split(Concat(x_1, ..., x_k)) -> s_1..s_k
    condition: same axis, k outputs, piece i has the size of x_i on that axis (static sizes, or
               equal symbolic sizes under an equal split); no s_i is a graph output
    rewrite:   readers of s_i read x_i
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import facts
from onnxfuse.graph import rules
from onnxfuse.graph.rules import ANY, Match, Rest, Rule, Var, fail, op
from onnxfuse.graph.slices import UNREACHABLE_END, normalize_axis, read_slice, slice_indices
from onnxfuse.pipeline import Context, Pass

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


# Slice parameters ---------------------------------------------------------------------------


def _range_params(r: range) -> tuple[int, int, int]:
    """Slice parameters that take exactly the indices `r` (an end below 0 becomes INT64_MIN:
    ONNX reads -1 as the last element)."""
    if len(r) == 0:
        return 0, 0, 1
    return r.start, (r.stop if r.stop >= 0 else INT64_MIN), r.step


def _keeps_axis(params: tuple[int, int, int], dim: int | str | None) -> bool:
    start, end, step = params
    if isinstance(dim, int):
        return slice_indices(dim, start, end, step) == range(dim)
    return step == 1 and (start == 0 or start <= -UNREACHABLE_END) and end >= UNREACHABLE_END


def _compose(outer_of_inner: tuple[int, int, int], inner: tuple[int, int, int], dim) -> tuple[int, int, int] | None:
    """Parameters of slicing with `inner` then with `outer_of_inner` along one axis."""
    if isinstance(dim, int):
        first = slice_indices(dim, *inner)
        s2 = slice_indices(len(first), *outer_of_inner)
        if len(s2) == 0:
            return 0, 0, 1
        start = first[s2.start]
        step = first.step * s2.step
        return _range_params(range(start, start + step * len(s2), step))
    (a, b, k1), (c, d, k2) = inner, outer_of_inner
    if min(a, b, c, d) < 0 or k1 <= 0 or k2 <= 0:
        return None
    # Taking a, a+k1, ... below b, then the c-th, (c+k2)-th, ... below d of those.
    return min(a + k1 * c, INT64_MAX), min(b, a + k1 * d, INT64_MAX), k1 * k2


def _write_slice(graph: gs.Graph, node: gs.Node, data: gs.Tensor, params: dict[int, tuple[int, int, int]], opset: int) -> bool:
    axes = sorted(params)
    starts = [params[a][0] for a in axes]
    ends = [params[a][1] for a in axes]
    steps = [params[a][2] for a in axes]
    if opset < 10:
        if any(s != 1 for s in steps):
            return False
        node.attrs.update(starts=starts, ends=ends, axes=axes)
        node.inputs[0] = data
        return True
    import numpy as np

    base = node.name or "slice"
    consts = [gu.make_constant(graph, f"{base}_{what}", np.array(v, dtype=np.int64))
              for what, v in (("starts", starts), ("ends", ends), ("axes", axes), ("steps", steps))]
    node.inputs.clear()
    node.inputs.extend([data] + consts)
    return True


# Passes -------------------------------------------------------------------------------------

x = Var("x")


def _bypass(graph: gs.Graph, m: Match):
    return gu.bypass(graph, m.root) or fail("its output cannot be renamed away")


def _keeps_everything(m: Match, graph: gs.Graph, shapes: facts.ShapeTable):
    node = m.root
    d = shapes.dims(node.inputs[0])
    params = read_slice(node, graph.opset or 1, None if d is None else len(d))
    if params is None or d is None:
        return fail("its parameters are not constants, or its input's shape is unknown")
    kept = [axis for axis, p in params.items() if not _keeps_axis(p, d[axis])]
    return not kept or fail(f"it takes part of axis {kept[0]} (dim {d[kept[0]]})")


def remove_noop_slice(graph: gs.Graph, ctx: Context) -> int:
    shapes = facts.lazy_shapes(graph)
    return rules.apply(graph, [
        Rule("one-output Split", op.Split(x, Rest("sizes"), _outputs=1), rewrite=_bypass),
        Rule("one-input Concat", op.Concat(x), rewrite=_bypass),
        Rule("Slice of everything", op.Slice(x, Rest("params")), rewrite=_bypass,
             condition=lambda m, g: _keeps_everything(m, g, shapes)),
    ], ctx.explainer)


# A Slice of a Slice whose result only the outer one reads (opset < 10: one input, attributes).
SLICE_OF_SLICE = op.Slice(op.Slice(x, ANY, ANY, ANY, ANY, _name="inner"), ANY, ANY, ANY, ANY)


def _merge(graph: gs.Graph, m: Match, shapes: facts.ShapeTable, opset: int):
    inner, outer = m["inner"], m.root
    d = shapes.dims(inner.inputs[0])
    rank = None if d is None else len(d)
    a = read_slice(inner, opset, rank)
    b = read_slice(outer, opset, rank)
    if a is None or b is None:
        return fail("a Slice's parameters are not constants")
    params = dict(a)
    for axis, pb in b.items():
        if axis not in a:
            params[axis] = pb
            continue
        composed = _compose(pb, a[axis], d[axis] if d is not None else None)
        if composed is None:
            return fail(f"on axis {axis}, of unknown size, a start or end is negative or a step is not positive")
        params[axis] = composed
    return _write_slice(graph, outer, inner.inputs[0], params, opset) or fail("opset < 10 has no Slice steps")


def merge_slices(graph: gs.Graph, ctx: Context) -> int:
    shapes, opset = facts.lazy_shapes(graph), graph.opset or 1
    rule = Rule("merge-slices", SLICE_OF_SLICE, rewrite=lambda g, m: _merge(g, m, shapes, opset))
    return rules.apply(graph, [rule], ctx.explainer)


def _split_axis(node: gs.Node, rank: int | None) -> int | None:
    return normalize_axis(int(gu.attr(node, "axis", 0)), rank)


def _split_sizes(node: gs.Node, opset: int) -> list[int] | None | bool:
    """Explicit piece sizes, None for an equal split, False when they cannot be read."""
    if opset < 13:
        sizes = gu.attr(node, "split")
        return None if sizes is None else [int(s) for s in sizes]
    if len(node.inputs) > 1 and gu.is_present(node.inputs[1]):
        sizes = gu.constant_ints(node.inputs[1])
        return False if sizes is None else sizes
    return None


# A Split read through its first output (the start of a run of Concat inputs).
SPLIT = Rule("split", op.Split(x, Rest("sizes"), _outputs=None), private=False)


def _rejoin_splits(graph: gs.Graph, m: Match, shapes: facts.ShapeTable):
    """Each run of Concat inputs that is every output of one Split, in order and on the Concat's
    axis, becomes the Split's input. Returns how many runs went."""
    concat = m.root
    rewrites = 0
    i = 0
    while i < len(concat.inputs):
        found = rules.match_at([SPLIT], graph, concat.inputs[i], set())
        if found is not None:
            split = found[1].root
            k = len(split.outputs)
            run = list(concat.inputs[i : i + k])
            rank = shapes.rank(split.inputs[0])
            axis = _split_axis(split, rank)
            if (
                len(run) == k
                and all(t is s for t, s in zip(run, split.outputs))
                and axis is not None
                and axis == normalize_axis(int(gu.attr(concat, "axis", 0)), rank)
            ):
                for _ in range(k):
                    concat.inputs.pop(i)
                concat.inputs.insert(i, split.inputs[0])
                rewrites += 1
        i += 1
    if rewrites and len(concat.inputs) == 1:
        gu.bypass(graph, concat)
    return rewrites or fail("no run of its inputs is every output of one Split, in order, on its axis")


def remove_split_concat(graph: gs.Graph, ctx: Context) -> int:
    shapes = facts.lazy_shapes(graph)
    rule = Rule("remove-split-concat", op.Concat(Rest("parts")), rewrite=lambda g, m: _rejoin_splits(g, m, shapes))
    return rules.apply(graph, [rule], ctx.explainer)


def _pieces_come_back(m: Match, graph: gs.Graph, shapes: facts.ShapeTable):
    split, concat = m.root, m["concat"]
    if len(concat.inputs) != len(split.outputs):
        return fail(f"{len(split.outputs)} pieces out of a Concat of {len(concat.inputs)}")
    rank = shapes.rank(split.inputs[0])
    axis = _split_axis(split, rank)
    if axis is None or axis != normalize_axis(int(gu.attr(concat, "axis", 0)), rank):
        return fail("the Split and the Concat are on different axes (or the rank is unknown)")
    if any(gu.is_graph_output(graph, s) for s in split.outputs):
        return fail("a piece is a graph output")
    pieces = [shapes.dims(t) for t in concat.inputs]
    if any(p is None or len(p) != rank for p in pieces):
        return fail("a piece's shape is unknown")
    piece_dims = [p[axis] for p in pieces]
    sizes = _split_sizes(split, graph.opset or 1)
    if sizes is False:
        return fail("the split sizes are not constants")
    if sizes is None:
        # Equal split: pieces of one size d give k*d, split back into pieces of size d.
        fits = piece_dims[0] is not None and all(p == piece_dims[0] for p in piece_dims)
    else:
        fits = len(sizes) == len(piece_dims) and all(isinstance(p, int) and p == s for p, s in zip(piece_dims, sizes))
    return fits or fail(f"the split sizes are not the pieces' sizes {piece_dims}")


def _read_pieces(graph: gs.Graph, m: Match) -> bool:
    split = m.root
    for piece, out in zip(m["concat"].inputs, split.outputs):
        gu.replace_uses(out, piece)
    split.inputs.clear()
    split.outputs.clear()
    return True


def remove_concat_split(graph: gs.Graph, ctx: Context) -> int:
    shapes = facts.lazy_shapes(graph)
    rule = Rule("remove-concat-split", op.Split(op.Concat(Rest("pieces"), _name="concat"), Rest("sizes"), _outputs=None),
                condition=lambda m, g: _pieces_come_back(m, g, shapes), rewrite=_read_pieces, private=False)
    return rules.apply(graph, [rule], ctx.explainer)


PASSES = [
    Pass("remove-noop-slice", 110, "drop Slices that keep everything, one-output Splits, one-input Concats", remove_noop_slice),
    Pass("merge-slices", 120, "merge a Slice of a Slice into one Slice", merge_slices),
    Pass("remove-split-concat", 130, "Concat of all outputs of a Split in order reads the Split's input", remove_split_concat),
    Pass("remove-concat-split", 140, "Split that takes back the pieces of a Concat reads the pieces", remove_concat_split),
]
