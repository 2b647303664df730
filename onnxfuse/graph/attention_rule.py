"""fuse-attention's forms as rule-engine patterns, and the pieces of its proof that need only the
graph: the scores chain from MatMul(q, kT) to the Softmax, a causal mask's Slice of a constant,
the packed QKV Split and its folded bias.

The scores chain (SCORED_SOFTMAX), one way per form, tried in this order:

    Softmax(Add(s, mask))             (s: MatMul(q_in, k_in), possibly scaled: Mul / Div by a
    Softmax(Add(mask, s))              constant; the mask either operand of the Add)
    Softmax(Add(Add(s, a), b))        (T5: the relative-position bias, then the padding mask;
                                       every Add's operands in either order)
    Softmax(s)

and after it MERGED_HEADS: Reshape(Transpose(MatMul(P, v), [0, 2, 1, 3]), target), or
MERGED_AFTER_VIEW with a no-op Reshape of MatMul(P, v) before the Transpose. The 3-D form
over batch*heads (attention_scores.match_merged) reads its scores through VIEWED_SCORES, the
first form or the last viewed as [B, H, Sq, Sk].

The first way whose scores operand is private to its Add (and is a scale `scaled` accepts) is
the match: what fails after it (a scale read outside the chain, any check of the pass's
condition) rejects the Softmax, it does not try another way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from . import core as gu
from . import facts
from . import rules
from .attention_heads import HEADS_PERM, scaled
from .rules import Const, Var, alt, op
from .shape_values import ShapeEvaluator

# A causal mask constant's entries above the diagonal must be at most this (or -inf) for the
# kernel to skip those keys instead of adding them: see causal_slice.
CAUSAL_MASKED_MAX = -1e4

QK = op.MatMul(Var("q_in"), Var("k_in"), _name="qk")
SCORES = alt(op.Mul(QK, Const(), _name="scale"), op.Div(QK, Const(), _name="scale"), QK)
LOGITS = alt(op.Add(SCORES, Var("mask"), _name="add"),
             op.Add(op.Add(SCORES, Var("term_a"), _name="inner_add"), Var("term_b"), _name="add"),
             SCORES)
SCORED_SOFTMAX = op.Softmax(LOGITS, _name="softmax")
# 3-D attention over batch*heads: [B*H, Sq, Sk] scores (plus one term) viewed as [B, H, Sq, Sk]
VIEWED_SCORES = op.Reshape(alt(op.Add(SCORES, Var("mask"), _name="add"), SCORES), Var("view_target"), _name="view")


def _merged_back(heads) -> rules.OpPattern:
    """`heads` [B, H, Sq, dv] merged back: Reshape(Transpose(heads, [0, 2, 1, 3]), target)."""
    return op.Reshape(op.Transpose(heads, _name="back", perm=lambda v: v is not None and [int(a) for a in v] == HEADS_PERM),
                      Var("target"), _name="merge")


# After the Softmax: MatMul(P, v), its heads merged back, every intermediate read inside;
# matched from P (rules.match_after, Var p bound to the probabilities).
MERGED_HEADS = rules.Rule("merged-heads", _merged_back(op.MatMul(Var("p"), Var("v_in"), _name="pv")))
# The same after a view of MatMul(P, v) (Var pv_out) that the pass proves a no-op (GPT-2's decode
# step: attention_scores.identity_view); matched from MatMul(P, v)'s output.
MERGED_AFTER_VIEW = rules.Rule("merged-heads-after-view", _merged_back(op.Reshape(Var("pv_out"), rules.ANY, _name="view")))


@dataclass
class Scores:
    """The matched scores chain: MatMul(q_in, k_in), its constant scale, the additive mask (or
    the two terms T5 adds, `mask` then None), the nodes from the MatMul to the Softmax."""

    qk: gs.Node
    scale: float
    mask: gs.Tensor | None
    mask_terms: tuple[gs.Tensor, gs.Tensor] | None
    nodes: list


def reads_scores(inner_add: gs.Node, term: gs.Tensor) -> bool:
    """Whether `term` is the inner Add's own output (Add(t, t) has no second mask term)."""
    return any(term is t for t in inner_add.outputs)


def _scores_operand(m: rules.Match) -> gs.Tensor:
    """What the innermost Add reads as the scores: the scale's output, else the MatMul's."""
    return (m.get("scale") or m["qk"]).outputs[0]


def _way(graph: gs.Graph):
    def way(m: rules.Match):
        """Whether the form's Add reads its scores operand alone (T5: the inner Add's output read by
        the outer one alone, b not that output), through a scale `scaled` accepts."""
        s = _scores_operand(m)
        scale = m.get("scale")
        if scale is not None and scaled(graph, s)[2] is not scale:
            return rules.fail(f"the scores' {scale.op} is not by a finite float32 constant of rank <= 4"
                              + (" other than 0" if scale.op == "Div" else ""))
        inner = m.get("inner_add")
        if inner is not None:
            if not gu.is_private(graph, inner.outputs[0]) or reads_scores(inner, m["term_b"]):
                return rules.fail("(scores + a) + b: the inner sum is read outside the attention chain")
        if m.get("add") is not None and not gu.is_private(graph, s):
            return rules.fail("the (scaled) scores are read outside the attention chain")
        return True
    way.__name__ = "scores_form"
    return way


def match_scores(graph: gs.Graph, softmax: gs.Node, outs: set[str], pattern: rules.OpPattern = SCORED_SOFTMAX) -> Scores | str:
    """The scores chain feeding `softmax` (SCORED_SOFTMAX; or VIEWED_SCORES at the view, whose
    input's readers the caller checks), or why there is none."""
    why: list[str] = []
    m = rules.match(pattern, softmax, outs, private=False, condition=_way(graph), why=why)
    if m is None:  # the engine's words say where the form stops; a declined way's are a sentence
        structural = not why[0].startswith("the ")
        return f"the Softmax input is not (scaled) MatMul(q, kT) plus terms: {why[0]}" if structural else why[0]
    qk, scale_node = m["qk"], m.get("scale")
    scale = scaled(graph, scale_node.outputs[0])[1] if scale_node is not None else 1.0
    if scale_node is not None and not gu.is_private(graph, qk.outputs[0]):
        return "the scores before the scale are read outside the attention chain"
    if not gu.is_private(graph, qk.outputs[0]) or (pattern is SCORED_SOFTMAX and not gu.is_private(graph, softmax.inputs[0])):
        return "the scores are read outside the attention chain"
    terms = (m["term_a"], m["term_b"]) if m.get("inner_add") is not None else None
    return Scores(qk, scale, m.get("mask"), terms, m.nodes[:-1])


def is_causal_constant(value: np.ndarray) -> bool:
    """value [1, ..., 1, R, C] (R, C >= 2) with value[..., i, j] == 0 for j <= i and
    <= CAUSAL_MASKED_MAX (or -inf) for j > i."""
    if value.dtype != np.float32 or not 2 <= value.ndim <= 4 or any(d != 1 for d in value.shape[:-2]):
        return False
    rows, cols = value.shape[-2:]
    if rows < 2 or cols < 2:
        return False
    v = value.reshape(rows, cols)
    future = np.triu(np.ones((rows, cols), bool), 1)
    return bool(np.all(v[~future] == 0.0)) and bool(np.all(v[future] <= CAUSAL_MASKED_MAX))


def causal_slice(graph: gs.Graph, mask: gs.Tensor, q, k, shapes: facts.ShapeTable) -> tuple[int, int] | None:
    """(R, C) when `mask` is provably the top-left [Sq, Sk] corner of a causal constant
    [1, ..., 1, R, C]: mask = Slice(c, starts 0, ends [Sq, Sk], axes the last two, steps 1), the
    ends proved equal to q's and k's sequence dims (symbolically, as shape-plumbing evaluates
    shape tensors). Then mask[..., i, j] is 0 for j <= i and very negative for j > i whenever
    Sq <= R and Sk <= C; a longer sequence makes the original's Add fail (the slice stops at R
    rows or C columns, neither 1 nor the scores' length), which the kernel reproduces as an error.

    Why skipping the future keys gives the original's probabilities: a masked score is x + c with
    c <= -1e4; it rounds to c itself for |x| small against c, and exp(x + c - m) (m the row's
    maximum, which an unmasked key attains) is exactly 0 in float32 when x - m < |c| - 104. So the
    rows are identical unless a masked scaled score exceeds the row's unmasked maximum by
    |c| - 104 or more (about 1e9 for torch's -1e9 fill; 9.9e3 at the -1e4 bound). A NaN or
    infinite masked score, which would make the original's row NaN, is kept by the kernel: it
    then adds -inf to the future keys instead of skipping them (see kernels/attention_cpu.cc)."""
    node = gu.producer(mask)
    if not gu.is_op(node, "Slice") or graph.opset < 10 or len(node.inputs) < 3:
        return None
    data = node.inputs[0]
    if not gu.is_constant(data):
        return None
    value = gu.constant_value(data)
    if value is None or not is_causal_constant(value):
        return None
    rank = value.ndim
    ins = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts = gu.constant_ints(ins[1])
    axes = gu.constant_ints(ins[3]) if gu.is_present(ins[3]) else None
    steps = gu.constant_ints(ins[4]) if gu.is_present(ins[4]) else None
    if starts is None or (gu.is_present(ins[3]) and axes is None) or (gu.is_present(ins[4]) and steps is None):
        return None
    axes = list(range(len(starts))) if axes is None else [a + rank if a < 0 else a for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    if sorted(axes) != [rank - 2, rank - 1] or len(starts) != 2 or starts != [0, 0] or steps != [1, 1]:
        return None
    ev = ShapeEvaluator(graph, shapes)
    ends = ev.value(ins[2])
    sq, sk = ev.dim_symbols(q.source), ev.dim_symbols(k.source)
    if ends is None or ends.rank != 1 or len(ends.elems) != 2 or sq is None or sk is None:
        return None
    want = {rank - 2: sq[2 if q.heads_first else 1], rank - 1: sk[2 if k.heads_first else 1]}
    if any(e is None or e != want[a] for a, e in zip(axes, ends.elems)):
        return None
    return int(value.shape[-2]), int(value.shape[-1])


def packed_split(graph: gs.Graph, m, shapes: facts.ShapeTable) -> gs.Node | None:
    """The Split whose outputs 0, 1, 2 are exactly m's q, k, v, in equal pieces on the last axis."""
    if m.q.heads_first or m.k.heads_first or m.v.heads_first:
        return None
    split = gu.producer(m.q.source)
    if not gu.is_op(split, "Split") or len(split.outputs) != 3:
        return None
    if [t is s for t, s in zip(split.outputs, (m.q.source, m.k.source, m.v.source))] != [True] * 3:
        return None
    if not all(gu.is_private(graph, t) for t in split.outputs):
        return None
    src = split.inputs[0]
    sd = shapes.dims(src)
    if sd is None or len(sd) != 3 or int(gu.attr(split, "axis", 0)) not in (2, -1):
        return None
    if not isinstance(sd[2], int) or src.dtype != np.float32:
        return None
    width = m.q.heads * m.q.width
    if sd[2] != 3 * width or m.v.width != m.q.width:
        return None
    sizes = gu.constant_ints(split.inputs[1]) if len(split.inputs) > 1 and gu.is_present(split.inputs[1]) else gu.attr(split, "split")
    if sizes is not None and [int(s) for s in sizes] != [width] * 3:
        return None
    return split


def qkv_bias(graph: gs.Graph, split: gs.Node, shapes: facts.ShapeTable) -> tuple[gs.Node, np.ndarray] | None:
    """The packed Split's input as Add(t, c) / Add(c, t), read by the Split alone, with c a
    float32 constant varying only along the last axis of t [B, S, 3D]: (the Add, c as [3D])."""
    src = split.inputs[0]
    add = gu.producer(src)
    if not gu.is_op(add, "Add") or len(add.inputs) != 2 or not gu.is_private(graph, src):
        return None
    width = shapes.dims(src)[2]
    for i in (0, 1):
        t, c = add.inputs[i], add.inputs[1 - i]
        if not gu.is_constant(c) or gu.is_constant(t):
            continue
        td = shapes.dims(t)
        if t.dtype != np.float32 or td is None or len(td) != 3 or td[2] != width:
            continue
        value = gu.constant_value(c)
        if value is None or value.dtype != np.float32 or not 1 <= value.ndim <= 3:
            continue
        if value.shape[-1] != width or any(d != 1 for d in value.shape[:-1]):
            continue
        return add, value.reshape(width)
    return None
