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
from onnxfuse.graph import rules
from onnxfuse.graph.facts import ShapeTable, lazy_shapes
from onnxfuse.graph.rules import Match, Rest, Rule, Var, fail, op, ops
from onnxfuse.pipeline import Context, Pass

CONTRIB_DOMAIN = "com.microsoft"
ms = ops(CONTRIB_DOMAIN)
# The bias input's position in each op's inputs (onnxruntime's contrib op schemas).
SKIP_NORM_BIAS = {"SkipLayerNormalization": 4, "SkipSimplifiedLayerNormalization": 3}
MHA_BIAS = 3
BIAS_ADD = op.Add(Var("x"), Var("b"))


def _bias_add(graph: gs.Graph, t: gs.Tensor, shapes: ShapeTable, width: int | None = None):
    """t = Add(x, b) with b a float32 1-D constant of t's last dim (or of `width`, the op's
    hidden size, when t's shape is unknown), t read once and not a graph output: (the Add, x, b).
    A 1-D b broadcasts along the last axis only, so t has x's shape."""
    if not isinstance(t, gs.Variable) or len(t.outputs) != 1 or gu.is_graph_output(graph, t):
        return None
    td = shapes.dims(t)
    last = td[-1] if td and isinstance(td[-1], int) else width

    def is_bias(m: Match) -> bool:
        if gu.is_constant(m["x"]) or not gu.is_constant(m["b"]):
            return False
        value = gu.constant_value(m["b"])
        return value is not None and value.dtype == np.float32 and value.ndim == 1 and last is not None \
            and value.shape[0] == last

    found = rules.match_at([Rule("bias", BIAS_ADD, condition=lambda m, g: is_bias(m))], graph, t)
    return None if found is None else (found[1].root, found[1]["x"], gu.constant_value(found[1]["b"]))


def _present(node: gs.Node, i: int) -> bool:
    return len(node.inputs) > i and gu.is_present(node.inputs[i])


def _skip_norm_bias(m: Match, graph: gs.Graph, shapes: ShapeTable):
    node = m.root
    if _present(node, SKIP_NORM_BIAS[node.op]):
        return fail("it has a bias input already")
    gamma = gu.constant_value(m["gamma"]) if gu.is_constant(m["gamma"]) else None
    width = int(gamma.shape[-1]) if gamma is not None and gamma.ndim >= 1 else None
    for i in (1, 0):
        found = _bias_add(graph, node.inputs[i], shapes, width)
        if found is not None:
            m.bindings.update(at=i, found=found)
            return True
    return fail("neither its input nor its skip is a bias Add read by it alone")


def _fold_skip_norm(graph: gs.Graph, m: Match) -> bool:
    node, i, (add, x, value) = m.root, m["at"], m["found"]
    at = SKIP_NORM_BIAS[node.op]
    node.inputs[i] = x
    while len(node.inputs) < at:
        node.inputs.append(gs.Variable.empty())
    node.inputs.append(gu.make_constant(graph, f"{add.name or node.name}_bias", value))
    add.outputs.clear()
    return True


def _mha_bias(m: Match, graph: gs.Graph, shapes: ShapeTable):
    node = m.root
    if _present(node, MHA_BIAS):
        return fail("it has a bias input already")
    dims = [shapes.dims(t) for t in node.inputs[:3]]
    if any(d is None or len(d) != 3 or not isinstance(d[2], int) for d in dims):
        return fail("query, key and value are not all 3-D [B, S, D] with a static D")
    found = [_bias_add(graph, t, shapes) for t in node.inputs[:3]]
    if all(f is None for f in found):
        return fail("none of query, key and value is a bias Add read by it alone")
    if len({id(f[0]) for f in found if f is not None}) != sum(f is not None for f in found):
        return fail("one bias Add feeds two of query, key and value")
    m.bindings.update(dims=dims, found=found)
    return True


def _fold_mha(graph: gs.Graph, m: Match) -> bool:
    node, dims, found = m.root, m["dims"], m["found"]
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


def _rules(shapes: ShapeTable) -> list[Rule]:
    # SkipLayerNormalization's bias slot comes after beta: without beta it would need an empty input.
    skip_norms = [Rule(f"fold-contrib-bias/{name}",
                       getattr(ms, name)(Var("input"), Var("skip"), Var("gamma"), Rest("more", min=at - 3)),
                       condition=lambda m, g: _skip_norm_bias(m, g, shapes), rewrite=_fold_skip_norm, private=False)
                  for name, at in SKIP_NORM_BIAS.items()]
    mha = Rule("fold-contrib-bias/MultiHeadAttention", ms.MultiHeadAttention(Var("q"), Var("k"), Var("v"), Rest("more")),
               condition=lambda m, g: _mha_bias(m, g, shapes), rewrite=_fold_mha, private=False)
    return [*skip_norms, mha]


def fold_contrib_bias(graph: gs.Graph, ctx: Context) -> int:
    return rules.apply(graph, _rules(lazy_shapes(graph)), ctx.explainer)


PASS = Pass(
    "fold-contrib-bias",
    160,
    "a projection's bias Add read by SkipLayerNormalization, SkipSimplifiedLayerNormalization or MultiHeadAttention goes into its bias input",
    fold_contrib_bias,
    targets=("cpu",),
)
