"""torch's sequence-first nn.MultiheadAttention rewritten batch-first, the form fuse-attention takes.

attention-batch-first
    match:     (patterns: onnxfuse/graph/transformer_forms.py, seq_first_*) what both torch.onnx
               exporters write for nn.MultiheadAttention with packed q, k, v weights (torchvision's
               ViT), after shape-plumbing made its targets constants:
                 in:  P = Transpose(x, [1, 0, 2]) @ W + b                      x [B, S, E] -> [S, B, 3E]
                      Squeeze(Transpose(Unsqueeze(Reshape(P, [S, B, 3, E]), [0]), [3, 1, 2, 0, 4]), [3])
                                                                               -> [3, S, B, E]
                      three Gathers (axis 0, indices 0, 1, 2) of it, each piece
                      Reshape [S, B*H, dh] -> Transpose(1, 0, 2) -> Reshape [B, H, S, dh]
                 out: Transpose(Reshape(Transpose(heads, [2, 0, 1, 3]), [S, B, E]) @ Wo + bo, [1, 0, 2])
               The two sides are separate rewrites, each value for value the same as what it replaces.
    condition: every intermediate read inside the match only and no graph output; W, Wo constant
               2-D ([E, 3E], [E', N]); b, bo constants varying along the last axis only (rank <= 3,
               every other dim 1), so that the bias commutes with the transposes; the Reshape
               targets constant and proved (shape_values.reshaped_dims, symbolically over the
               dims of x and of heads) to give exactly the dims above: [S, B, 3, E];
               [S, B*H, dh] with H*dh = E and then [B, H, S, dh]; [S', B', H'*dh'] from heads
               [B', H', S', dh']; the Unsqueeze axes [0], the Squeeze axes [3] or [-2]; the Gathers
               scalar constant indices, one per piece.
    rewrite:   in:  P' = x @ W + b [B, S, 3E] (one MatMul on x, no Transpose), Split into three
                    equal last-axis pieces, each Reshape [0, 0, H, dh] -> Transpose(0, 2, 1, 3):
                    the heads tensors the attention reads, the same values. That is the packed
                    form fuse-attention fuses with the Split and the bias (qkv_packed, has_bias).
               out: Reshape(Transpose(heads, [0, 2, 1, 3]), [0, 0, E']) @ Wo + bo, written to the
                    tensor the final Transpose wrote: fuse-attention's head merge, and a projection
                    without Transposes.
Why: onnxruntime alone runs the sequence-first form as 19 kernels on the input side (Transpose,
MatMul, Add, Reshape, Unsqueeze, Transpose, Squeeze, 3 Gathers, 3 x Reshape, Transpose, Reshape)
and 5 on the output side, and fuse-attention matches neither; batch-first, the attention with its
Split and bias becomes one onnxfuse.Attention and the projections plain MatMuls. Written
standard ops only, so the rewrite applies on every target (no new Attention attribute: the CUDA
generator takes the packed form as it is).
"""
from __future__ import annotations

from functools import partial

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import facts, rules
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.rules import ANY, Rule, Var, op
from onnxfuse.graph.shape_values import ShapeEvaluator, element_count, reshaped_dims
from onnxfuse.graph.transformer_forms import (seq_first_heads, seq_first_keys_transposed, seq_first_out_gemm,
                                              seq_first_out_projection, seq_first_pieces)
from onnxfuse.graph.writer import NodeWriter
from onnxfuse.pipeline import Context, Pass

PIECES = ("q", "k", "v")
# Per piece: [B, H, S, dh] or the keys as [B, H, dh, S], in this order of preference; and the
# Transpose that writes each once batch-first.
_HEADS = {p: (Rule(f"{p}-heads", seq_first_heads(p)), Rule(f"{p}-keys-transposed", seq_first_keys_transposed(p)))
          for p in PIECES}
_BATCH_FIRST_PERMS = ([0, 2, 1, 3], [0, 2, 3, 1])
# The longest chain from a piece to its heads (Reshape, Transpose, Transpose, Reshape).
_HEADS_DEPTH = 4


def _last_axis_bias(t: gs.Tensor, width: int) -> bool:
    """A float32 constant of rank <= 3 whose dims are 1 but the last, which is `width` or 1: added
    to a rank-3 tensor it varies along the last axis only, so it commutes with [1, 0, 2]."""
    if not gu.is_constant(t):
        return False
    v = gu.constant_value(t)
    return (v is not None and v.dtype == np.float32 and 1 <= v.ndim <= 3 and v.shape[-1] in (width, 1)
            and all(d == 1 for d in v.shape[:-1]))


def _weight(t: gs.Tensor, rows: int) -> int | None:
    """The column count of a float32 constant 2-D weight with `rows` rows."""
    if not gu.is_constant(t):
        return None
    v = gu.constant_value(t)
    if v is None or v.dtype != np.float32 or v.ndim != 2 or v.shape[0] != rows:
        return None
    return int(v.shape[1])


def _ints(t: gs.Tensor) -> list[int] | None:
    return gu.constant_ints(t) if gu.is_constant(t) else None


def _reshape_gives(node: gs.Node, target: gs.Tensor, in_dims: list, want: list) -> bool:
    return reshaped_dims(in_dims, _ints(target), int(gu.attr(node, "allowzero", 0))) == want


# One of q, k, v taken from the packed projection by a Gather on axis 0.
PIECE = Rule("piece", op.Gather(ANY, Var("i"), axis=lambda a: a is None or int(a) == 0))


def _piece_index(node: gs.Node) -> int | None:
    found = rules.first_match([PIECE], None, node, set())
    if found is None:
        return None
    v = gu.constant_value(found[1]["i"]) if gu.is_constant(found[1]["i"]) else None
    if v is None or v.ndim != 0 or v.dtype.kind not in "iu":
        return None
    i = int(v)
    i = i + 3 if i < 0 else i
    return i if 0 <= i < 3 else None


def _input_side(ev: ShapeEvaluator, graph: gs.Graph, m: rules.Match) -> bool:
    in_bias = m.bindings.get("in_bias")
    x = m["x"]
    xd = ev.dim_symbols(x)
    if x.dtype != np.float32 or xd is None or len(xd) != 3 or xd[2][1]:
        return False
    batch, seq, (width, _) = xd
    if _weight(m["in_weight"], width) != 3 * width or (in_bias is not None and not _last_axis_bias(in_bias, 3 * width)):
        return False
    three_e = (3 * width, ())
    if not _reshape_gives(m["unpack"], m["unpack_target"], [seq, batch, three_e], [seq, batch, (3, ()), (width, ())]):
        return False
    if _ints(m["unsqueeze_axes"]) != [0] or _ints(m["squeeze_axes"]) not in ([3], [-2]):
        return False
    pieces = m.output
    gathers = list(pieces.outputs)
    if len(gathers) != 3 or gu.is_graph_output(graph, pieces):
        return False
    order = [_piece_index(g) for g in gathers]
    if sorted(i for i in order if i is not None) != [0, 1, 2]:
        return False
    heads = {}
    for g, i in zip(gathers, order):
        piece = g.outputs[0]
        name = PIECES[i]
        found = rules.match_after(_HEADS[name], graph, piece, name, depth=_HEADS_DEPTH)
        if found is None or not gu.is_private(graph, piece):
            return False
        rule, hm = found
        perm = _BATCH_FIRST_PERMS[_HEADS[name].index(rule)]
        flat = _ints(hm[f"{name}_flat_target"])
        if flat is None or len(flat) != 3 or flat[2] <= 0 or width % flat[2]:
            return False
        dh = flat[2]
        h = width // dh
        rows = element_count([batch, (h, ())])  # B*H
        if not _reshape_gives(hm[f"{name}_flat"], hm[f"{name}_flat_target"], [seq, batch, (width, ())],
                              [seq, rows, (dh, ())]):
            return False
        split = [rows, seq, (dh, ())] if perm == [0, 2, 1, 3] else [rows, (dh, ()), seq]
        if not _reshape_gives(hm[f"{name}_heads"], hm[f"{name}_target"], split, [batch, (h, ())] + split[1:]):
            return False
        heads[i] = (g, hm, h, dh, perm)
    # Rewrite: x @ W + b, split into q, k, v, each Reshape [0, 0, H, dh] -> Transpose(0, 2, 1, 3)
    # writing the heads tensor the attention reads.
    proj = m["in_proj"]
    base = proj.name or "attention_in_proj"
    w = NodeWriter(graph)
    f32 = np.float32
    packed = w.op("MatMul", x, m["in_weight"], name=f"{base}_batch_first", dtype=f32)
    if in_bias is not None:
        packed = w.op("Add", packed, in_bias, name=f"{base}_batch_first_bias", dtype=f32)
    parts = [w.value(f"{base}_{p}", f32) for p in PIECES]
    w.add(gu.split_node(graph, packed, [width] * 3, parts, axis=2, name=w.node_name(f"{base}_split")))
    old = list(m.nodes)
    for i in range(3):
        g, hm, h, dh, perm = heads[i]
        old += [g] + list(hm.nodes)
        split4 = w.value(f"{parts[i].name}_heads", f32)
        target = w.constant(f"{parts[i].name}_heads_target", np.array([0, 0, h, dh], np.int64))
        w.op("Reshape", parts[i], target, name=f"{parts[i].name}_split_heads", out=split4)
        w.op("Transpose", split4, name=f"{parts[i].name}_heads_first", out=hm.output, attrs={"perm": perm})
    for node in old:
        gu.disconnect(node)
    graph.nodes.extend(w.nodes)
    return True


def _gemm_operands(graph: gs.Graph, m: rules.Match, width: int) -> tuple[gs.Tensor, gs.Tensor | None] | None:
    """The Gemm form's weight as a [width, N] constant (transposed when the Gemm reads it as B^T)
    and its bias C (None when absent): what the MatMul form binds as out_weight and out_bias."""
    gemm = m["out_gemm"]
    weight = m["out_weight"]
    if int(gu.attr(gemm, "transB", 0)):
        v = gu.constant_value(weight) if gu.is_constant(weight) else None
        if v is None or v.ndim != 2:
            return None
        weight = gu.make_constant(graph, f"{gemm.name or 'out_proj'}_weight_t", np.ascontiguousarray(v.T))
    bias = gemm.inputs[2] if len(gemm.inputs) > 2 and gu.is_present(gemm.inputs[2]) else None
    return weight, bias


def _output_side(ev: ShapeEvaluator, graph: gs.Graph, m: rules.Match) -> bool:
    out_bias = m.bindings.get("out_bias")
    heads = m["heads"]
    hd = ev.dim_symbols(heads)
    if heads.dtype != np.float32 or hd is None or len(hd) != 4 or hd[1][1] or hd[3][1]:
        return False
    batch, (h, _), seq, (dh, _) = hd
    width = h * dh
    gemm_form = "out_gemm" in m.bindings
    rows = [seq, batch]
    if gemm_form:
        # torch.export flattens the rows for a 2-D Gemm and unflattens them after: [S*B, E] -> [S, B, N]
        rows = [element_count(rows)]
        if not gu.is_private(graph, m["out_gemm"].outputs[0]):
            return False
        operands = _gemm_operands(graph, m, width)
        if operands is None:
            return False
        weight, out_bias = operands
        m.bindings["out_weight"] = weight
    n = _weight(m["out_weight"], width)
    if n is None or (out_bias is not None and not _last_axis_bias(out_bias, n)):
        return False
    if not _reshape_gives(m["merge"], m["merge_target"], [seq, batch, (h, ()), (dh, ())], rows + [(width, ())]):
        return False
    if gemm_form and not _reshape_gives(m["unflat"], m["unflat_target"], rows + [(n, ())], [seq, batch, (n, ())]):
        return False
    merge = m["merge"]
    base = merge.name or "attention_merge"
    w = NodeWriter(graph)
    f32 = np.float32
    moved = w.value(f"{base}_batch_first_heads", f32)
    merged = w.value(f"{base}_batch_first", f32)
    product = m.output if out_bias is None else w.value(f"{base}_batch_first_proj", f32)
    target = w.constant(f"{base}_batch_first_target", np.array([0, 0, width], np.int64))
    w.op("Transpose", heads, name=f"{base}_heads_back", out=moved, attrs={"perm": [0, 2, 1, 3]})
    w.op("Reshape", moved, target, name=f"{base}_batch_first", out=merged)
    w.op("MatMul", merged, m["out_weight"], name=f"{base}_out_proj", out=product)
    if out_bias is not None:
        w.op("Add", product, out_bias, name=f"{base}_out_proj_bias", out=m.output)
    for old in m.nodes:
        gu.disconnect(old)
    graph.nodes.extend(w.nodes)
    return True


def _rules(ev: ShapeEvaluator) -> list[Rule]:
    """The two sides, each with and without its bias (a zero bias the export left out has no Add;
    the patterns exclude each other), rewritten where the shape proof holds."""
    return [Rule(f"{side}{'/bias' if bias else ''}", pattern(bias), rewrite=partial(rewrite, ev))
            for side, pattern, rewrite in (("batch-first-input", seq_first_pieces, _input_side),
                                           ("batch-first-output", seq_first_out_projection, _output_side))
            for bias in (True, False)] + [Rule("batch-first-output/gemm", seq_first_out_gemm(),
                                               rewrite=partial(_output_side, ev))]


def attention_batch_first(graph: gs.Graph, ctx: Context) -> int:
    if not any(gu.is_op(n, "Squeeze") for n in graph.nodes) or graph.opset < 13:
        return 0
    refresh_shapes(graph)
    count = rules.apply(graph, _rules(ShapeEvaluator(graph, facts.ShapeTable(graph))), ctx.explainer)
    if count:
        gu.toposort(graph)
    return count


PASS = Pass(
    "attention-batch-first",
    460,
    "torch's sequence-first nn.MultiheadAttention (packed q, k, v unpacked by Gathers) as the batch-first form fuse-attention fuses",
    attention_batch_first,
)
