"""ONNX Slice semantics: a Slice node's constant parameters and the indices it takes."""
from __future__ import annotations

import onnx_graphsurgeon as gs

from . import core as gu

# An end at least this large reaches past the end of any tensor that fits in memory.
UNREACHABLE_END = 2**62


def normalize_axis(axis: int, rank: int | None) -> int | None:
    if axis >= 0:
        return axis if rank is None or axis < rank else None
    if rank is None or axis < -rank:
        return None
    return axis + rank


def read_slice(node: gs.Node, opset: int, rank: int | None) -> dict[int, tuple[int, int, int]] | None:
    """{axis: (start, end, step)} of a Slice with constant parameters, axes made non-negative;
    None when a parameter is computed or invalid."""
    if opset < 10:
        starts, ends = gu.attr(node, "starts"), gu.attr(node, "ends")
        axes = gu.attr(node, "axes")
        steps = None
    else:
        ins = list(node.inputs) + [None] * (5 - len(node.inputs))
        starts, ends = gu.constant_ints(ins[1]), gu.constant_ints(ins[2])
        axes = gu.constant_ints(ins[3]) if gu.is_present(ins[3]) else None
        steps = gu.constant_ints(ins[4]) if gu.is_present(ins[4]) else None
        if (gu.is_present(ins[3]) and axes is None) or (gu.is_present(ins[4]) and steps is None):
            return None
    if starts is None or ends is None or len(starts) != len(ends):
        return None
    axes = list(range(len(starts))) if axes is None else list(axes)
    steps = [1] * len(starts) if steps is None else list(steps)
    if len(axes) != len(starts) or len(steps) != len(starts) or 0 in steps:
        return None
    out: dict[int, tuple[int, int, int]] = {}
    for a, s, e, k in zip(axes, starts, ends, steps):
        axis = normalize_axis(int(a), rank)
        if axis is None or axis in out:
            return None
        out[axis] = (int(s), int(e), int(k))
    return out


def slice_indices(dim: int, start: int, end: int, step: int) -> range:
    """The indices an ONNX Slice takes along an axis of static size `dim`."""
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
    else:
        start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return range(start, end, step)
