"""An attention block's operands as both torch.onnx exporters write them, matched by hand where
the proof needs shapes: head splits (Reshape then Transposes), constant scales on q, k or the
scores, the merge Reshape after the output, and additive masks that broadcast to the scores.

fuse-attention (passes/attention.py) builds its match from these; the rule-engine patterns of
the same pieces, for passes that need no shape proof, are in transformer_forms.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from . import core as gu
from . import facts
from . import rules
from .rules import Var, op
from .shape_values import broadcast_dim
from .transformer_forms import HEADS_PERM  # [B, S, H, d] <-> [B, H, S, d]

KEYS_PERM = [0, 2, 3, 1]  # [B, S, H, dh] -> [B, H, dh, S]
LAST_TWO_PERM = [0, 1, 3, 2]


@dataclass
class Heads:
    """x [B, S, H*d] -> Reshape [B, S, H, d] (-> Transpose ...): one operand's head split; or,
    heads_first, x itself [B, H, S, d], whatever computes it (a rotary or norm prologue after the
    split: the fused node reads its output, the prologue stays a region of its own)."""

    source: gs.Tensor  # x
    reshape: gs.Node | None
    heads: int
    width: int  # d
    nodes: list = field(default_factory=list)  # Reshape first, then its Transposes
    heads_first: bool = False
    merged: bool = False  # x [B*H, S, d] itself (3-D attention over batch*heads: attention_scores.py)

    def rows(self, shapes: facts.ShapeTable) -> list | None:
        """[B, S]: the source's batch and sequence dims ([B*H, S] when merged)."""
        d = shapes.dims(self.source)
        if d is None:
            return None
        return [d[0], d[2]] if self.heads_first else [d[0], d[1]]


def transpose_perm(node: gs.Node | None) -> list[int] | None:
    if not gu.is_op(node, "Transpose"):
        return None
    p = gu.attr(node, "perm")
    return None if p is None else [int(x) for x in p]


def scale_constant(t: gs.Tensor) -> float | None:
    """The value of a constant float tensor of one element and rank <= 4 (so multiplying by it
    changes neither the values' layout nor the rank of a rank-4 operand)."""
    if not gu.is_constant(t):
        return None
    v = gu.constant_value(t)
    if v is None or v.size != 1 or v.ndim > 4 or v.dtype != np.float32:
        return None
    x = float(v.reshape(()))
    return x if np.isfinite(x) else None


# x times or over a constant c (Mul's operands in either order), by the op that computes t
SCALED = {kind: getattr(op, kind)(Var("x"), Var("c"), _name="scale") for kind in ("Mul", "Div")}


def _scale_of(m: rules.Match):
    """The factor of a SCALED match: a constant scale_constant accepts (Div's nonzero), on a
    computed x."""
    c = scale_constant(m["c"])
    div = m["scale"].op == "Div"
    if c is None or (div and c == 0.0) or not isinstance(m["x"], gs.Variable):
        return rules.fail("not a scale by a finite float32 constant of rank <= 4")
    m.bindings["factor"] = float(np.float64(1.0) / np.float64(c)) if div else c
    return True


def scaled(graph: gs.Graph, t: gs.Tensor) -> tuple[gs.Tensor, float, gs.Node | None]:
    """t = Mul(x, c) / Mul(c, x) / Div(x, c) with x private to it: (x, factor, node); else (t, 1, None)."""
    node = gu.producer(t)
    if node is None or node.op not in SCALED:
        return t, 1.0, None
    m = rules.match(SCALED[node.op], node, private=False, condition=_scale_of)
    return (t, 1.0, None) if m is None else (m["x"], m["factor"], node)


def same_dim(a, b) -> bool:
    return a is not None and a == b


def _transposed(p: rules.Pattern, perm: list[int]) -> rules.OpPattern:
    return op.Transpose(p, perm=lambda v: v is not None and [int(a) for a in v] == perm)


def _split_pattern(perms: list[list[int]]) -> rules.OpPattern:
    """Transpose(perms[-1])(...Transpose(perms[0])(Reshape(x, target)))."""
    p = op.Reshape(Var("x"), Var("target"), _name="reshape")
    for perm in perms:
        p = _transposed(p, perm)
    return p


# The head splits an attention reads q, v (HEADS_PERM) and k^T (KEYS_PERM, or HEADS_PERM then
# LAST_TWO_PERM) through.
SPLITS = {tuple(map(tuple, perms)): _split_pattern(perms) for perms in ([HEADS_PERM], [KEYS_PERM], [HEADS_PERM, LAST_TWO_PERM])}


def head_split(graph: gs.Graph, t: gs.Tensor, perms: list[list[int]], shapes: facts.ShapeTable) -> Heads | None:
    """t = Transpose(perms[-1])(...Transpose(perms[0])(Reshape(x, [0|B, 0|S, H, d]))) (SPLITS),
    every intermediate private; x float32 [B, S, H*d] with H*d static."""
    node = gu.producer(t)
    m = None if node is None else rules.match(SPLITS[tuple(map(tuple, perms))], node, {o.name for o in graph.outputs})
    if m is None:
        return None
    reshape = m["reshape"]
    if int(gu.attr(reshape, "allowzero", 0)) != 0:
        return None
    x = reshape.inputs[0]
    target = gu.constant_ints(reshape.inputs[1])
    xd = shapes.dims(x)
    if target is None or len(target) != 4 or xd is None or len(xd) != 3 or not isinstance(xd[2], int):
        return None
    if x.dtype != np.float32:
        return None
    for i in (0, 1):
        if target[i] != 0 and not (isinstance(xd[i], int) and target[i] == xd[i]):
            return None
    heads, width = target[2], target[3]
    if heads == -1 and width > 0 and xd[2] % width == 0:
        heads = xd[2] // width
    elif width == -1 and heads > 0 and xd[2] % heads == 0:
        width = xd[2] // heads
    if heads <= 0 or width <= 0 or heads * width != xd[2]:
        return None
    return Heads(x, reshape, heads, width, list(m.nodes))


def heads_first(t: gs.Tensor, shapes: facts.ShapeTable) -> Heads | None:
    """t itself as the operand: float32 [B, H, S, d] with H and d static (the Attention node reads
    it with heads_first). What computes t is left to the graph: any prologue after a head split
    (full or partial rotary: last-axis Slices, Neg, Concat, Mul and Add with cos and sin; q/k
    norms; a Slice of a per-head packed projection), which the pointwise pass makes a region."""
    d = shapes.dims(t)
    if t.dtype != np.float32 or d is None or len(d) != 4:
        return None
    if not (isinstance(d[1], int) and isinstance(d[3], int)) or d[1] <= 0 or d[3] <= 0:
        return None
    return Heads(t, None, d[1], d[3], [], heads_first=True)


def operand_split(graph: gs.Graph, t: gs.Tensor, shapes: facts.ShapeTable) -> Heads | None:
    """q or v [B, H, S, d]: its head split (read in place from [B, S, H*d]) when t is private to
    the chain, else t heads first."""
    split = head_split(graph, t, [HEADS_PERM], shapes) if gu.is_private(graph, t) else None
    return split or heads_first(t, shapes)


def keys_split(graph: gs.Graph, t: gs.Tensor, shapes: facts.ShapeTable) -> Heads | None:
    """k^T [B, H, dh, S]: a head split transposed (KEYS_PERM, or HEADS_PERM then LAST_TWO_PERM),
    or Transpose(LAST_TWO_PERM) of k [B, H, S, dh] heads first (the Transpose in the chain)."""
    if not gu.is_private(graph, t):
        return None
    split = head_split(graph, t, [KEYS_PERM], shapes) or head_split(graph, t, [HEADS_PERM, LAST_TWO_PERM], shapes)
    if split is not None:
        return split
    node = gu.producer(t)
    if transpose_perm(node) != LAST_TWO_PERM:
        return None
    k = heads_first(node.inputs[0], shapes)
    if k is not None:
        k.nodes.append(node)
    return k


def merge_pins_rows(merge: gs.Node, q: Heads, out_width: int, shapes: facts.ShapeTable) -> bool | None:
    """Whether the merge Reshape's target is [B, Sq, H*dv]: None when it is not provably
    [0|B, 0|Sq, H*dv]; True when it also fixes B and Sq by value (not by copying them from the
    attention output, which a broadcast mask could have grown); False otherwise."""
    if not gu.is_op(merge, "Reshape") or len(merge.inputs) != 2 or int(gu.attr(merge, "allowzero", 0)) != 0:
        return None
    qd = q.rows(shapes)
    if qd is None:
        return None
    target = gu.constant_ints(merge.inputs[1])
    if target is not None:
        if len(target) != 3 or target[2] not in (out_width, -1):
            return None
        pinned = True
        for i in (0, 1):
            if target[i] == 0:
                pinned = False
            elif not (isinstance(qd[i], int) and target[i] == qd[i]):
                return None
        return pinned
    shape_node = gu.producer(merge.inputs[1])
    if not gu.is_op(shape_node, "Shape") or "start" in shape_node.attrs or "end" in shape_node.attrs:
        return None
    sd = shapes.dims(shape_node.inputs[0])
    if sd is None or len(sd) != 3 or sd[2] != out_width:
        return None
    return True if same_dim(sd[0], qd[0]) and same_dim(sd[1], qd[1]) else None


def broadcast_dims(a: list | None, b: list | None) -> list | None:
    """The dims of a + b (ONNX multidirectional broadcasting) where provable: each pair of
    aligned dims equal, or one of them 1; None otherwise."""
    if a is None or b is None:
        return None
    n = max(len(a), len(b))
    a, b = [1] * (n - len(a)) + list(a), [1] * (n - len(b)) + list(b)
    out = []
    for x, y in zip(a, b):
        if x == 1:
            out.append(y)
        elif y == 1 or same_dim(x, y):
            out.append(x)
        else:
            return None
    return out


def mask_fits(mask: gs.Tensor | tuple, target: list, shapes: facts.ShapeTable, pinned: bool,
              keys_checked: bool = False) -> bool:
    """Whether the additive mask (a tensor, or the pair of terms the node reads summed) is
    float32 of rank <= 4 and provably broadcasts to `target` [B, H, Sq, Sk] without growing it.
    keys_checked: v's key length is provably k's, so a term that grew the key axis (Sk = 1, the
    term's X > 1) makes MatMul(P [.., X], v [.., 1, dv]) fail in the original, as any other
    mismatch there makes its Add fail: the key axis needs no proof (the kernel's broadcast check
    fails in those runs too)."""
    terms = mask if isinstance(mask, tuple) else (mask,)
    if any(t.dtype != np.float32 for t in terms):
        return False
    md = shapes.dims(terms[0])
    for t in terms[1:]:
        md = broadcast_dims(md, shapes.dims(t))
    if md is None or len(md) > 4:
        return False
    if pinned:
        return True
    # A dim that broadcasts with its target axis to that axis in every run where the original's
    # Add succeeds never grows the scores: 1, the same dim, or the slice of a causal constant to
    # the sequence, min(S, C), against S (where S > C the original fails, and so does the
    # kernel's broadcast check).
    return all(m == 1 or (t is not None and broadcast_dim(m, t) == t) or (keys_checked and i == 0)
               for i, (m, t) in enumerate(zip(md[::-1], target[::-1])))
