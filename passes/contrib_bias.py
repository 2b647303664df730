"""A projection's bias Add read by an onnxruntime contrib op goes into that op's bias input.

fold-contrib-bias
    match:     a com.microsoft SkipLayerNormalization or SkipSimplifiedLayerNormalization whose
               input or skip is Add(t, b) / Add(b, t), with no bias input yet; a
               com.microsoft MultiHeadAttention whose query, key or value (one or more) is such
               an Add, with no bias input yet (the others get zeros in the bias). t is any tensor, b a
               float32 constant of one dimension (the hidden size), the Add's output read by
               the contrib op alone and not a graph output.
    condition: b's length equals the Add output's static last dim (for the norms, when that is
               unknown, gamma's length: the hidden size the op normalizes); for MultiHeadAttention, query, key and
               value are 3-D [B, S, D] (not packed) and their biases are concatenated in that
               order, as the op reads its bias: q + bias[0:D], k + bias[D:2D], v + bias[2D:].
    rewrite:   the contrib op reads t and gets b as its bias input; the Add goes.
Why: onnxruntime rewrites a 3-D MatMul followed by a bias Add as Reshape -> Gemm -> Reshape,
three kernels per projection, and a bias Add left alone is one more kernel; the contrib ops add
the bias as they read their input, so the projection stays one MatMul (BERT: 12 kernels fewer
per layer pair; figures in bench/results/onnxscript_fusions.md).
These ops come from the onnxscript-fusions stage only, so the output already needs onnxruntime;
no fallback function is involved.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph.facts import ShapeTable
from onnxfuse.pipeline import Context, Pass

CONTRIB_DOMAIN = "com.microsoft"
# The bias input's position in each op's inputs (onnxruntime's contrib op schemas).
SKIP_NORM_BIAS = {"SkipLayerNormalization": 4, "SkipSimplifiedLayerNormalization": 3}
MHA_BIAS = 3


def _is_contrib(node: gs.Node, *ops: str) -> bool:
    return node.domain == CONTRIB_DOMAIN and node.op in ops


def _bias_add(graph: gs.Graph, t: gs.Tensor, shapes: ShapeTable, width: int | None = None):
    """t = Add(x, b) with b a float32 1-D constant of t's last dim (or of `width`, the op's
    hidden size, when t's shape is unknown), t read once and not a graph output: (the Add, x, b).
    A 1-D b broadcasts along the last axis only, so t has x's shape."""
    if not isinstance(t, gs.Variable) or len(t.outputs) != 1 or gu.is_graph_output(graph, t):
        return None
    add = gu.producer(t)
    if not gu.is_op(add, "Add") or len(add.inputs) != 2:
        return None
    td = shapes.dims(t)
    last = td[-1] if td and isinstance(td[-1], int) else width
    for i in (0, 1):
        x, b = add.inputs[i], add.inputs[1 - i]
        if gu.is_constant(x) or not gu.is_constant(b):
            continue
        value = gu.constant_value(b)
        if value is None or value.dtype != np.float32 or value.ndim != 1 or last is None or value.shape[0] != last:
            continue
        return add, x, value
    return None


def _present(node: gs.Node, i: int) -> bool:
    return len(node.inputs) > i and gu.is_present(node.inputs[i])


def _fold_skip_norm(graph: gs.Graph, node: gs.Node, shapes: ShapeTable) -> bool:
    at = SKIP_NORM_BIAS[node.op]
    if _present(node, at) or len(node.inputs) < 3:
        return False
    if node.op == "SkipLayerNormalization" and len(node.inputs) < 4:
        return False  # the bias slot comes after beta; an absent beta would need an empty input
    gamma = gu.constant_value(node.inputs[2]) if gu.is_constant(node.inputs[2]) else None
    width = int(gamma.shape[-1]) if gamma is not None and gamma.ndim >= 1 else None
    for i in (1, 0):
        found = _bias_add(graph, node.inputs[i], shapes, width)
        if found is None:
            continue
        add, x, value = found
        node.inputs[i] = x
        while len(node.inputs) < at:
            node.inputs.append(gs.Variable.empty())
        node.inputs.append(gu.make_constant(graph, f"{add.name or node.name}_bias", value))
        add.outputs.clear()
        return True
    return False


def _fold_mha(graph: gs.Graph, node: gs.Node, shapes: ShapeTable) -> bool:
    if len(node.inputs) < 3 or _present(node, MHA_BIAS):
        return False
    dims = [shapes.dims(t) for t in node.inputs[:3]]
    if any(d is None or len(d) != 3 or not isinstance(d[2], int) for d in dims):
        return False
    found = [_bias_add(graph, t, shapes) for t in node.inputs[:3]]
    if all(f is None for f in found) or len({id(f[0]) for f in found if f is not None}) != sum(f is not None for f in found):
        return False
    # A projection without a bias (Whisper's k_proj) adds zeros.
    bias = np.concatenate([f[2] if f is not None else np.zeros(d[2], np.float32) for f, d in zip(found, dims)])
    for i, f in enumerate(found):
        if f is not None:
            node.inputs[i] = f[1]
    const = gu.make_constant(graph, f"{node.name}_qkv_bias", bias)
    if len(node.inputs) > MHA_BIAS:
        node.inputs[MHA_BIAS] = const
    else:
        node.inputs.append(const)
    for f in found:
        if f is not None:
            f[0].outputs.clear()
    return True


def fold_contrib_bias(graph: gs.Graph, ctx: Context) -> int:
    if not any(_is_contrib(n, "MultiHeadAttention", *SKIP_NORM_BIAS) for n in graph.nodes):
        return 0
    shapes = ShapeTable(graph)
    done = 0
    for node in list(graph.nodes):
        if _is_contrib(node, *SKIP_NORM_BIAS):
            done += _fold_skip_norm(graph, node, shapes)
        elif _is_contrib(node, "MultiHeadAttention"):
            done += _fold_mha(graph, node, shapes)
    return done


PASS = Pass(
    "fold-contrib-bias",
    160,
    "a projection's bias Add read by SkipLayerNormalization, SkipSimplifiedLayerNormalization or MultiHeadAttention goes into its bias input",
    fold_contrib_bias,
    targets=("cpu",),
)
