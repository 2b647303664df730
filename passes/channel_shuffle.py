"""channel-shuffle: ShuffleNet's Concat -> channel shuffle -> Split as one onnxfuse.ChannelShuffle
node (CPU and CUDA).

match
    pieces(Reshape(Transpose(Reshape(cat, [N, g, C/g, H, W]), perm 0 2 1 3 4), [N, C, H, W]))

    cat       Concat(x_1, ..., x_k) along the channels (axis 1), taken in when the shuffle alone
              reads it; otherwise the shuffle's input itself
    pieces    a Split along the channels into equal pieces (split sizes, num_outputs or none), or
              Slices along the channels with constant bounds that take equal contiguous pieces
              covering the channels in order (the TorchScript export of chunk(2)); taken in when
              they are all the shuffle's readers, otherwise the node writes the shuffled tensor

    The shuffle is a rule on the shared pattern layer (onnxfuse/graph/rules.py), rooted at the
    last Reshape; the Concat and the pieces are the rule's neighbours, looked at after it.
condition
    float32 [N, C, H, W] with C static and g dividing it; both Reshape targets constant and
    meaning exactly those shapes (0 copies of N, H and W, one -1 beside positive dims, or the
    static values); the intermediates read inside the block only. --target cpu runs the node on
    kernels/channel_shuffle_cpu.cc; --target cuda on the plane-copy kernel cuda-compile generates
    for it (onnxfuse/cuda/shuffle_codegen.py, launched by kernels/cuda_channel_shuffle.cc).
rewrite
    one onnxfuse.ChannelShuffle node through ctx.fuse, its fallback function the exact block.

Why it pays (measured, bench/results/shufflenet.md): onnxruntime runs the block as Concat,
Reshape, Transpose, Reshape and Split, five kernels and three copies of the activations per
ShuffleNetV2 unit (its NCHWc layout takes none of them). The fused node is one kernel and one
copy. Where the Concat read two NCHWc convolutions (a downsampling unit), onnxruntime concatenated
in the blocked layout and reordered once; the fused node needs each input reordered, one kernel
more, still three fewer. onnxruntime's CUDA provider runs the same five ops as five nodes
(Concat, Transpose and Split each copying the activations); the fused node is one kernel.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import facts
from onnxfuse.graph import rules
from onnxfuse.graph.rules import ANY, Match, Rest, Rule, Var, op
from onnxfuse.graph.slices import normalize_axis, read_slice, slice_indices
from onnxfuse.ops.channel_shuffle import MAX_CONCAT_INPUTS, OP
from onnxfuse.pipeline import Context, fused_op_pass

FLOAT = np.dtype(np.float32)
SHUFFLE_PERM = [0, 2, 1, 3, 4]

x = Var("x")
SHUFFLE = Rule(
    "channel-shuffle",
    op.Reshape(op.Transpose(op.Reshape(x, ANY, _name="unflatten"), _name="transpose",
                            perm=lambda p: p is not None and list(p) == SHUFFLE_PERM),
               ANY, _name="flatten"))


def _is_float(t: gs.Tensor) -> bool:
    return t.dtype is None or np.dtype(t.dtype) == FLOAT


def _reshape_means(node: gs.Node, in_dims: list, want: list) -> bool:
    """Whether Reshape `node`, reading a tensor of dims `in_dims`, gives exactly dims `want`
    (ints and symbolic names; every entry of `want` known) for every size of its symbolic dims."""
    target = gu.constant_ints(node.inputs[1]) if len(node.inputs) > 1 else None
    if target is None or len(target) != len(want):
        return False
    allowzero = int(gu.attr(node, "allowzero", 0)) == 1
    inferred = None
    for i, (t, w) in enumerate(zip(target, want)):
        if t == -1:
            if inferred is not None:
                return False
            inferred = i
        elif t == 0 and not allowzero:
            if i >= len(in_dims) or in_dims[i] is None or in_dims[i] != w:
                return False
        elif t <= 0 or t != w:
            return False
    if inferred is None:
        return True
    # One -1: it takes what the others leave, exactly want[i] when the others are positive
    # constants or copies of positive dims; a copied symbolic dim could be 0, then -1 is
    # ambiguous, so only constants may stand beside it.
    return all(isinstance(t, int) and t > 0 for i, t in enumerate(target) if i != inferred)


def _shuffle_groups(m: Match, shapes: facts.ShapeTable) -> int | None:
    """g of the matched shuffle when it is exactly a channel shuffle of a float32 [N, C, H, W]
    tensor with static C, else None."""
    xt = m["x"]
    xd = shapes.dims(xt)
    if xd is None or len(xd) != 4 or not isinstance(xd[1], int) or any(d is None for d in xd) or not _is_float(xt):
        return None
    target = gu.constant_ints(m["unflatten"].inputs[1])
    if target is None or len(target) != 5 or target[1] <= 0:
        return None
    g, c = target[1], xd[1]
    if c % g != 0:
        return None
    if not _reshape_means(m["unflatten"], xd, [xd[0], g, c // g, xd[2], xd[3]]):
        return None
    mid = [xd[0], c // g, g, xd[2], xd[3]]
    if not _reshape_means(m["flatten"], mid, list(xd)):
        return None
    return g


# The nodes around a shuffle: the Concat that computes its input, the Split or Slices that cut its output.
CONCAT = Rule("concat", op.Concat(Rest("parts")))
SPLIT = Rule("split", op.Split(ANY, Rest("sizes"), _outputs=None))
SLICE = Rule("slice", op.Slice(ANY, Rest("params")))


def _concat_inputs(xt: gs.Tensor, reader: gs.Node, outs: set[str], shapes: facts.ShapeTable) -> tuple[gs.Node, list] | None:
    """The Concat along the channels that computes x, with its inputs, when `reader` alone reads x."""
    found = rules.match_at([CONCAT], None, xt, set())
    if found is None or xt.name in outs:
        return None
    p = found[1].root
    if len(xt.outputs) != 1 or xt.outputs[0] is not reader:
        return None
    if normalize_axis(int(gu.attr(p, "axis", 0)), 4) != 1:
        return None
    ins = list(p.inputs)
    if not ins or len(ins) > MAX_CONCAT_INPUTS or any(not gu.is_present(t) or not _is_float(t) for t in ins):
        return None
    for t in ins:
        d = shapes.dims(t)
        if d is None or len(d) != 4 or not isinstance(d[1], int):
            return None
    return p, ins


def _split_pieces(split: gs.Node, c: int, opset: int) -> bool:
    """Whether Split node `split` cuts a [N, C, H, W] tensor into equal pieces along the channels."""
    if not gu.is_default_domain(split) or normalize_axis(int(gu.attr(split, "axis", 0)), 4) != 1:
        return False
    m = len(split.outputs)
    if m == 0 or c % m != 0:
        return False
    sizes = None
    if len(split.inputs) > 1 and gu.is_present(split.inputs[1]):
        sizes = gu.constant_ints(split.inputs[1])
        if sizes is None:
            return False
    elif gu.attr(split, "split") is not None:
        sizes = [int(v) for v in gu.attr(split, "split")]
    return sizes is None or sizes == [c // m] * m


def _slice_pieces(readers: list[gs.Node], c: int, opset: int) -> list[gs.Node] | None:
    """Slices that take equal contiguous pieces covering the channels in order, ordered by piece;
    None when the readers are not exactly that."""
    m = len(readers)
    if m < 2 or c % m != 0:
        return None
    piece = c // m
    by_start: dict[int, gs.Node] = {}
    for r in readers:
        if rules.first_match([SLICE], None, r, set()) is None:
            return None
        params = read_slice(r, opset, 4)
        if params is None or set(params) != {1}:
            return None
        taken = slice_indices(c, *params[1])
        if taken.step != 1 or len(taken) != piece or taken.start % piece != 0 or taken.start in by_start:
            return None
        by_start[taken.start] = r
    return [by_start[k * piece] for k in range(m)]


def _pieces(y: gs.Tensor, c: int, outs: set[str], opset: int) -> tuple[list[gs.Node], list[gs.Tensor]] | None:
    """The nodes that cut the shuffled tensor y into equal pieces along the channels, and the
    pieces, when they are all of y's readers; None otherwise."""
    readers = list(y.outputs)
    if y.name in outs or not readers:
        return None
    if len(readers) == 1 and rules.first_match([SPLIT], None, readers[0], set()) and _split_pieces(readers[0], c, opset):
        return [readers[0]], list(readers[0].outputs)
    slices = _slice_pieces(readers, c, opset)
    if slices is None:
        return None
    return slices, [s.outputs[0] for s in slices]


def match_block(graph: gs.Graph, root: gs.Node, outs: set[str], shapes: facts.ShapeTable, opset: int) -> tuple[list[gs.Node], list, list, int] | None:
    """The channel-shuffle block whose last Reshape is `root`: (nodes in order, inputs, outputs,
    groups), or None."""
    m = SHUFFLE.match(graph, root, outs)
    if m is None:
        return None
    g = _shuffle_groups(m, shapes)
    if g is None:
        return None
    xt = m["x"]
    c = shapes.dims(xt)[1]
    nodes = list(m.nodes)
    inputs = [xt]
    concat = _concat_inputs(xt, m["unflatten"], outs, shapes)
    if concat is not None:
        nodes = [concat[0]] + nodes
        inputs = concat[1]
    y = root.outputs[0]
    outputs = [y]
    cut = _pieces(y, c, outs, opset)
    if cut is not None:
        nodes = nodes + cut[0]
        outputs = cut[1]
    return nodes, inputs, outputs, g


def run(graph: gs.Graph, ctx: Context) -> int:
    if not ctx.target.has_kernel(OP.name):
        return 0
    outs = {t.name for t in graph.outputs}
    opset = graph.opset
    count = 0
    for node, shapes in facts.roots_with_shapes(graph, "Reshape"):
        found = match_block(graph, node, outs, shapes, opset)
        if found is None:
            continue
        nodes, inputs, outputs, g = found
        ctx.fuse(graph, OP.name, nodes, inputs, outputs, {"groups": int(g)})
        count += 1
    return count


PASS = fused_op_pass(OP, 340, run=run,
                     summary="Concat -> channel shuffle (Reshape, Transpose, Reshape) -> Split -> onnxfuse.ChannelShuffle")
