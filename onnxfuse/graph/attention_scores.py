"""What an attention block's scores go through between MatMul(q, kT) and MatMul(P, v), matched
where the proof needs shapes: additive terms (one, or T5's two summed), a masked fill (Where with
a constant), and the 3-D layout over batch*heads some models compute in.

3-D attention over batch*heads (DeBERTa-v2, both torch.onnx exporters): q, k, v are [B*H, S, d]
(views of [B, H, S, d]), the scores MatMul(q, kT) [B*H, Sq, Sk] plus additive terms of that
layout (DeBERTa's content-to-position and position-to-content terms) are viewed as
[B, H, Sq, Sk] for a masked fill and the Softmax, the probabilities are viewed back as
[B*H, Sq, Sk] for MatMul(P, v), whose [B*H, Sq, dv] is viewed as [B, H, Sq, dv] before the usual
Transpose(0, 2, 1, 3) and merge. A view is a Reshape proved to only split or merge the two
leading axes: [a, H, x, y] -> [-1 or a*H, x, y], or [n, x, y] -> [-1 or n/H, H, x, y], its target's
other entries symbolically equal to the input's dims (shape_values.ShapeEvaluator). What
computes q, k, v [B*H, S, d] stays in the graph (DeBERTa reads q and k for its position terms
too); the fused node reads them as they are (heads_merged) and the additive term as
[B*H, Sq, Sk] (mask_merged_heads). Shape nodes reading the chain's tensors are allowed when all
they feed is the chain's own view targets (the TorchScript export computes those from the
scores' and probabilities' shapes): the fused node's body computes each target from its view's
input instead, and the plumbing goes with the chain.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from . import core as gu
from .attention_heads import broadcast_dims, scaled, transpose_perm
from .attention_rule import VIEWED_SCORES, match_scores
from .shape_values import ShapeEvaluator, element_count, exact_quotient

MAX_PLUMBING = 64  # nodes a chain tensor's Shape readers may feed before the view targets


def summed_mask(graph: gs.Graph, m, sums: dict) -> None:
    """(scores + a) + b becomes scores + (a + b): one Add of the two terms in the main graph
    (shared by every attention that reads the same pair: T5's layers share the position bias and
    the padding mask), which the node reads as its mask, and one Add in its body. In float32
    this is the original's sum where b is 0 and where b is a large negative fill (both sums
    round to the fill), the padding mask's two values; elsewhere it may differ in the last bit.
    `m` is fuse-attention's match (mask_terms, nodes, mask)."""
    a, b = m.mask_terms
    outer = next(n for n in m.nodes if gu.is_op(n, "Add") and any(t is b for t in n.inputs))
    inner = gu.producer(next(t for t in outer.inputs if t is not b))
    key = (id(a), id(b))
    if key not in sums:
        dims = broadcast_dims(gu.dims(a), gu.dims(b))
        total = gs.Variable(gu.unique_name(graph, f"{inner.name or 'attention'}_mask_sum"), dtype=np.float32, shape=dims)
        graph.nodes.append(gs.Node("Add", name=gu.unique_name(graph, f"{inner.name or 'attention'}_mask_sum_add"),
                                   inputs=[a, b], outputs=[total]))
        sums[key] = total
    scores = next(t for t in inner.inputs if t is not a)
    out = outer.outputs[0]
    gu.disconnect(outer)
    gu.disconnect(inner)
    add = gs.Node("Add", name=outer.name, inputs=[scores, sums[key]], outputs=[out])
    at = next(i for i, n in enumerate(m.nodes) if n is inner)
    m.nodes[at:at + 2] = [add]
    m.mask = sums[key]


@dataclass
class Fill:
    """Where(cond, c, x) (mode 1: x replaced where cond) or Where(cond, x, c) (mode 2: where not
    cond), c a float32 constant of one element: a masked fill of the scores x."""

    node: gs.Node
    cond: gs.Tensor
    scores: gs.Tensor
    value: float
    mode: int


def score_fill(t: gs.Tensor) -> Fill | None:
    node = gu.producer(t)
    if not gu.is_op(node, "Where") or len(node.inputs) != 3 or node.inputs[0].dtype not in (bool, np.bool_):
        return None
    for mode, (c, x) in ((1, node.inputs[1:]), (2, node.inputs[2:0:-1])):
        value = gu.constant_value(c) if gu.is_constant(c) else None
        if value is not None and value.size == 1 and value.dtype == np.float32 and value.ndim <= 4 and not gu.is_constant(x):
            return Fill(node, node.inputs[0], x, float(value.reshape(())), mode)
    return None


def _mono_mul(a, b):
    return None if a is None or b is None else (a[0] * b[0], tuple(sorted(a[1] + b[1])))


def merge_view(ev: ShapeEvaluator, node: gs.Node | None) -> bool:
    """node = Reshape([a, H, x, y] -> [-1 or a*H, x, y]), provably."""
    if not gu.is_op(node, "Reshape") or len(node.inputs) != 2:
        return False
    d, tv = ev.dim_symbols(node.inputs[0]), ev.value(node.inputs[1])
    if d is None or len(d) != 4 or tv is None or len(tv.elems) != 3 or any(e is None or e == (0, ()) for e in tv.elems):
        return False
    e0, e1, e2 = tv.elems
    return e1 == d[2] and e2 == d[3] and (e0 == (-1, ()) or e0 == _mono_mul(d[0], d[1]))


def unmerge_view(ev: ShapeEvaluator, node: gs.Node | None) -> int | None:
    """H when node = Reshape([n, x, y] -> [-1 or n/H, H, x, y]), provably (H a constant > 0)."""
    if not gu.is_op(node, "Reshape") or len(node.inputs) != 2:
        return None
    d, tv = ev.dim_symbols(node.inputs[0]), ev.value(node.inputs[1])
    if d is None or len(d) != 3 or tv is None or len(tv.elems) != 4 or any(e is None or e == (0, ()) for e in tv.elems):
        return None
    e0, e1, e2, e3 = tv.elems
    if e1[1] or e1[0] <= 0 or e2 != d[1] or e3 != d[2]:
        return None
    return e1[0] if e0 == (-1, ()) or e0 == exact_quotient(d[0], (e1[0], ())) else None


def _reps(ev: ShapeEvaluator, t: gs.Tensor, axis: int) -> set:
    """What one axis of t [N, S, d] is provably equal to: its own dim; when t is a Reshape, the
    target's entry there (not 0 or -1), and for an inferred N (-1) the token of the element
    count it divides (that of the tensor the Reshapes and Transposes before it start from) by
    the other entries; when t is a merge view of [a, H, x, y], a*H (axis 0) or x (axis 1)."""
    d = ev.dim_symbols(t)
    out = {d[axis]} if d is not None and len(d) == 3 else set()
    node = gu.producer(t)
    if merge_view(ev, node):
        src = ev.dim_symbols(node.inputs[0])
        out.add(_mono_mul(src[0], src[1]) if axis == 0 else src[axis + 1])
    target = _target(ev, node, 3)
    if target is not None and target[axis] not in ((0, ()), (-1, ())):
        out.add(target[axis])
    elif target is not None and axis == 0 and target[0] == (-1, ()) and (0, ()) not in target:
        src = node.inputs[0]
        while gu.is_op(gu.producer(src), "Transpose", "Reshape"):
            src = gu.producer(src).inputs[0]
        d = ev.dim_symbols(src)
        if element_count(d) is not None:
            out.add(("count", element_count(d), target[1], target[2]))
        if d is not None and d and not d[-1][1]:  # src = x @ W (+ c): x's rows times src's width
            out.add(("rows", _projected(src).name, d[-1], target[1], target[2]))
    return out


def _projected(t: gs.Tensor) -> gs.Tensor:
    """x where t = x @ W (+ c), W a 2-D constant, c a constant of rank <= 1 (t has x's leading
    dims), through any number of such steps; else t."""
    while True:
        node = gu.producer(t)
        if gu.is_op(node, "Add") and len(node.inputs) == 2:
            c = next((x for x in node.inputs if gu.is_constant(x)), None)
            if c is None or len(gu.dims(c) or [0, 0]) > 1 or all(gu.is_constant(x) for x in node.inputs):
                return t
            t = next(x for x in node.inputs if x is not c)
        elif gu.is_op(node, "MatMul") and gu.is_constant(node.inputs[1]) and len(gu.dims(node.inputs[1]) or []) == 2:
            t = node.inputs[0]
        else:
            return t


@dataclass
class Merged:
    """A 3-D attention over batch*heads from the score MatMul to the merge Reshape."""

    q: gs.Tensor  # [B*H, Sq, dh]
    k: gs.Tensor  # [B*H, Sk, dh]
    v: gs.Tensor  # [B*H, Sk, dv]
    heads: int
    scale: float
    mask: gs.Tensor | None  # the additive term, [B*H, Sq, Sk] broadcast
    fill: Fill | None
    q_nodes: list  # q's scale, if any
    k_nodes: list  # the keys' Transpose(0, 2, 1), then its scale, if any
    nodes: list  # the score MatMul to the merge Reshape, in order
    views: list = field(default_factory=list)  # (Reshape, True for a merge view, False to unmerge)
    out_dims: list | None = None  # [B, Sq, H*dv] by name where q is a merge view of [B, H, Sq, dh]


def _sole_reader(graph: gs.Graph, t: gs.Tensor, plumbing: list) -> gs.Node | None:
    """The one reader of t that is not a Shape (those go to `plumbing`); None when t is a graph
    output or has another reader."""
    if not isinstance(t, gs.Variable) or gu.is_graph_output(graph, t):
        return None
    others = [n for n in t.outputs if not gu.is_op(n, "Shape")]
    if len(others) != 1:
        return None
    plumbing.extend(n for n in t.outputs if gu.is_op(n, "Shape"))
    return others[0]


def _feeds_only(graph: gs.Graph, shapes: list, views: list) -> bool:
    """Whether everything the Shape nodes compute is read only as the target of one of `views`
    (through any plumbing nodes, which then lose their readers)."""
    todo, seen = list(shapes), set()
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > MAX_PLUMBING:
            return False
        for t in node.outputs:
            if gu.is_graph_output(graph, t):
                return False
            for reader in t.outputs:
                view = next((v for v, _ in views if v is reader), None)
                if view is None:
                    todo.append(reader)
                elif view.inputs[1] is not t or view.inputs[0] is t:
                    return False
    return True


def match_merged(graph: gs.Graph, softmax: gs.Node, weights: gs.Tensor, guard: list, shapes) -> Merged | str:
    """The 3-D form around `softmax` (its probabilities, after the NaN guard if any, are
    `weights`), or why not."""
    ev = ShapeEvaluator(graph, shapes)
    plumbing: list = []
    views: list = []
    view_p = _sole_reader(graph, weights, plumbing)
    # A view proved by its input's dims (strict), or by a target pinned to q's and k's lengths
    # (checked below, once they are known).
    probs_pins = _target(ev, view_p, 3)
    strict = merge_view(ev, view_p)
    if not strict and (probs_pins is None or probs_pins[0] != (-1, ())):
        return "the probabilities are not read by one Reshape to [B*H, Sq, Sk] (and Shapes)"
    views.append((view_p, True))
    pv = _sole_reader(graph, view_p.outputs[0], plumbing)
    if not gu.is_op(pv, "MatMul") or pv.inputs[0] is not view_p.outputs[0]:
        return "the [B*H, Sq, Sk] probabilities are not the left operand of MatMul(P, V) alone"
    view_o = _sole_reader(graph, pv.outputs[0], plumbing)
    heads = unmerge_view(ev, view_o)
    out_pins = _target(ev, view_o, 4)
    if heads is None and out_pins is not None and out_pins[0] == (-1, ()) and not out_pins[1][1] and out_pins[1][0] > 0:
        heads, strict = out_pins[1][0], False
    if heads is None:
        return "MatMul(P, V) is not read by one Reshape to [B, H, Sq, dv]"
    views.append((view_o, False))
    back = _sole_reader(graph, view_o.outputs[0], plumbing)
    if transpose_perm(back) != [0, 2, 1, 3]:
        return "the [B, H, Sq, dv] output is not read by Transpose(0, 2, 1, 3) alone"
    merge = _sole_reader(graph, back.outputs[0], plumbing)
    # Scores side: Softmax(Where fill(view(scores + term))).
    logits = softmax.inputs[0]
    if _sole_reader(graph, logits, plumbing) is not softmax:
        return "the Softmax input is read outside the attention chain"
    before = []
    fill = score_fill(logits)
    if fill is not None:
        if _sole_reader(graph, fill.scores, plumbing) is not fill.node:
            return "the scores before the masked fill are read outside the attention chain"
        before.append(fill.node)
        logits = fill.scores
    view_s = gu.producer(logits)
    strict = strict and unmerge_view(ev, view_s) == heads
    pins = _target(ev, view_s, 4)
    if not strict and (pins is None or pins[1] != (heads, ())):
        return f"the Softmax input is not a view of [B*H, Sq, Sk] scores as [B, {heads}, Sq, Sk] (through a masked fill)"
    views.append((view_s, False))
    before.append(view_s)
    s3 = view_s.inputs[0]
    if _sole_reader(graph, s3, plumbing) is not view_s:
        return "the [B*H, Sq, Sk] scores are read outside the attention chain"
    found = match_scores(graph, view_s, {t.name for t in graph.outputs}, VIEWED_SCORES)
    if isinstance(found, str):
        return f"the [B*H, Sq, Sk] scores: {found}"
    qk, scale, mask = found.qk, found.scale, found.mask
    before += list(reversed(found.nodes[1:]))  # the Add, then the scale, as the chain reads back
    q, q_scale, q_node = scaled(graph, qk.inputs[0])
    kt, k_scale, k_node = scaled(graph, qk.inputs[1])
    if (q_node is not None and not gu.is_private(graph, qk.inputs[0])) or (k_node is not None and not gu.is_private(graph, qk.inputs[1])):
        return "the scaled q or k is read outside the attention chain"
    transpose = gu.producer(kt)
    if transpose_perm(transpose) != [0, 2, 1] or not gu.is_private(graph, kt):
        return "k^T is not Transpose(0, 2, 1) of k [B*H, Sk, dh] read by the chain alone"
    k, v = transpose.inputs[0], pv.inputs[1]
    dims = [shapes.dims(t) for t in (q, k, v)]
    if any(t.dtype != np.float32 or d is None or len(d) != 3 or not isinstance(d[2], int) for t, d in zip((q, k, v), dims)):
        return "q, k or v is not float32 [B*H, S, d] with d known"
    if dims[0][2] != dims[1][2]:
        return f"q and k widths differ ({dims[0][2]}, {dims[1][2]})"
    n = _reps(ev, q, 0) & _reps(ev, k, 0) & _reps(ev, v, 0)
    sq, sk = _reps(ev, q, 1), _reps(ev, k, 1)
    if not n or not sk & _reps(ev, v, 1):
        return "the batch*heads dims of q, k, v, or the key lengths of k and v, are not provably equal"
    batch = {b for b in (exact_quotient(x, (heads, ())) for x in n if isinstance(x[0], int)) if b is not None}
    one = {(1, ())}
    # Pinned: the views' targets are [-1, H, Sq, Sk] and [-1, Sq, Sk] with Sq, Sk q's and k's
    # lengths. An additive term that grew the [B*H, Sq, Sk] scores (a dim of 1 broadcast up)
    # would then make the probabilities [g*B*H, Sq, Sk], g >= 2, whose MatMul with v [B*H, Sk, dv]
    # fails in the original (H >= 2), as the kernel's broadcast check does.
    pinned = (heads >= 2 and pins is not None and pins[0] == (-1, ()) and pins[2] in sq and pins[3] in sk and probs_pins is not None
              and probs_pins[0] == (-1, ()) and probs_pins[1] in sq and probs_pins[2] in sk
              and (unmerge_view(ev, view_o) == heads or out_pins[2] in sq and out_pins[3] == (dims[2][2], ())))
    if not strict and not pinned:
        return f"the Softmax input is not a view of [B*H, Sq, Sk] scores as [B, {heads}, Sq, Sk] (through a masked fill)"
    if mask is not None and (len(gu.dims(mask) or []) > 3 or mask.dtype != np.float32):
        return "the additive term is not float32 of rank <= 3"
    if mask is not None and not pinned and not _fits(ev, mask, [n, sq, sk], one):
        return "the additive term's dims are not provably 1 or those of the [B*H, Sq, Sk] scores"
    if fill is not None and (len(gu.dims(fill.cond) or [0] * 5) > 4 or
                             not pinned and not _fits(ev, fill.cond, [batch, {(heads, ())}, sq, sk], one)):
        return "the masked fill's condition's dims are not provably 1 or those of the [B, H, Sq, Sk] scores"
    if not _merges_rows(ev, merge, heads * dims[2][2]):
        return f"the output is not merged back by one Reshape to [B, Sq, {heads * dims[2][2]}]"
    if not _feeds_only(graph, plumbing, views):
        return "a Shape of a tensor of the chain feeds more than the chain's own Reshape targets"
    nodes = [qk] + list(reversed(before)) + [softmax] + list(guard or []) + [view_p, pv, view_o, back, merge]
    q4 = gu.producer(q).inputs[0] if merge_view(ev, gu.producer(q)) else None
    d = shapes.dims(q4) if q4 is not None else None
    out_dims = [d[0], d[2], heads * dims[2][2]] if d is not None and None not in (d[0], d[2]) else None
    return Merged(q, k, v, heads, float(np.float32(q_scale * k_scale * scale)), mask, fill,
                  [q_node] if q_node is not None else [], [transpose] + ([k_node] if k_node is not None else []),
                  nodes, views, out_dims)


def _target(ev: ShapeEvaluator, node: gs.Node, rank: int) -> tuple | None:
    """A Reshape's target value, `rank` elements all known (monomials), or None."""
    if not gu.is_op(node, "Reshape") or len(node.inputs) != 2:
        return None
    tv = ev.value(node.inputs[1])
    return None if tv is None or len(tv.elems) != rank or any(e is None for e in tv.elems) else tv.elems


def _fits(ev: ShapeEvaluator, t: gs.Tensor, target: list, one: set) -> bool:
    d = ev.dim_symbols(t)
    if d is None or len(d) > len(target):
        return False
    return all(x in one or x in reps for x, reps in zip(reversed(d), reversed(target)))


def _merges_rows(ev: ShapeEvaluator, merge: gs.Node | None, width: int) -> bool:
    """merge = Reshape([B, Sq, H, dv] -> [B, Sq, H*dv]) with a target of 0 (copy) or the dim itself
    for B and Sq, and H*dv or -1 last."""
    if not gu.is_op(merge, "Reshape") or len(merge.inputs) != 2:
        return False
    d, tv = ev.dim_symbols(merge.inputs[0]), ev.value(merge.inputs[1])
    if d is None or len(d) != 4 or tv is None or len(tv.elems) != 3:
        return False
    copy = set() if int(gu.attr(merge, "allowzero", 0)) else {(0, ())}
    return tv.elems[0] in copy | {d[0]} and tv.elems[1] in copy | {d[1]} and tv.elems[2] in {(width, ()), (-1, ())}


def rewrite_merged(graph: gs.Graph, m, nodes: list, inputs: list, attrs: dict, cache: dict) -> None:
    """fuse-attention's rewrite of a 3-D match `m` (q, k, v heads merged): each view in the body
    computes its target from its own input (Shape, Slice, Concat; the same values, proved when
    matched), so the node reads no shape tensor; the fill condition is the node's last input as
    float32 (one Cast in the main graph per condition, shared by the blocks reading it; Not(x)
    is read as x with the opposite mode), cast back to bool in the body."""
    heads = m.q.heads
    for view, merge in m.views:
        if gu.constant_ints(view.inputs[1]) is not None:
            continue
        name = view.outputs[0].name  # unique in the graph, unlike a node name (which may be empty)

        def var(base, _name=name):
            return gs.Variable(gu.unique_name(graph, f"{_name}_{base}"), dtype=np.int64)

        def const(base, values, _name=name):
            return gu.make_constant(graph, f"{_name}_{base}", np.array(values, np.int64))

        shape, dims, target = var("input_shape"), var("kept_dims"), var("target")
        lo, hi = (2, 4) if merge else (1, 3)
        made = [gs.Node("Shape", name=f"{name}_input_shape", inputs=[view.inputs[0]], outputs=[shape]),
                gs.Node("Slice", name=f"{name}_kept_dims", inputs=[shape, const("from", [lo]), const("to", [hi]),
                                                                   const("axis", [0])], outputs=[dims]),
                gs.Node("Concat", name=f"{name}_target", inputs=[const("lead", [-1] if merge else [-1, heads]), dims],
                        outputs=[target], attrs={"axis": 0})]
        view.inputs[1] = target
        at = next(i for i, n in enumerate(nodes) if n is view)
        nodes[at:at] = made
    attrs["heads_merged"] = 7
    # The output [B, Sq, H*dv] keeps B and Sq's names where q is a view of [B, H, Sq, dh] (a custom
    # op's output is not inferred), so that the next block's q, k and v are provably of one batch.
    if m.out_dims is not None:
        nodes[-1].outputs[0].shape = list(m.out_dims)
    if m.mask is not None:
        attrs["mask_merged_heads"] = 1
    fill = m.fill
    if fill is None:
        return
    cond, mode = fill.cond, fill.mode
    negated = gu.producer(cond)
    if gu.is_op(negated, "Not") and negated.inputs[0].dtype in (bool, np.bool_):
        cond, mode = negated.inputs[0], 3 - mode
    else:
        negated = None
    key = ("fill_condition", id(cond))
    if key not in cache:
        as_float = gs.Variable(gu.unique_name(graph, f"{cond.name}_as_float"), dtype=np.float32, shape=cond.shape)
        graph.nodes.append(gs.Node("Cast", name=gu.unique_name(graph, f"{cond.name}_as_float_cast"), inputs=[cond],
                                   outputs=[as_float], attrs={"to": 1}))
        cache[key] = as_float
    inputs.append(cache[key])
    base = fill.node.outputs[0].name
    flag = gs.Variable(gu.unique_name(graph, f"{base}_condition"), dtype=np.bool_)
    made = [gs.Node("Cast", name=f"{base}_condition", inputs=[cache[key]], outputs=[flag], attrs={"to": 9})]
    if negated is not None:
        flip = gs.Variable(gu.unique_name(graph, f"{base}_condition_not"), dtype=np.bool_)
        made.append(gs.Node("Not", name=f"{base}_condition_not", inputs=[flag], outputs=[flip]))
        flag = flip
    fill.node.inputs[0] = flag
    at = next(i for i, n in enumerate(nodes) if n is fill.node)
    nodes[at:at] = made
    attrs["fill_mode"] = mode
    attrs["fill_value"] = fill.value


def identity_view(graph: gs.Graph, t: gs.Tensor, q: gs.Tensor, q_first: bool, shapes) -> tuple[gs.Node, list] | None:
    """(view, Shapes) when t = MatMul(P, v) [B, H, Sq, dv] is read by one Reshape whose target is
    provably t's own dims and otherwise by Shape nodes alone (t not a graph output): each entry
    equal to its dim, Sq read as q's (q [B, S, H*d], or [B, H, S, d] when q_first; the scores'
    rows are q's unless a term broadcast them up, which a pinned merge makes fail in the original),
    and at most one -1, which is then the remaining dim. GPT-2's decode step reshapes MatMul(P, v)
    to [Shape(it)[0], -1, Sq, dv] before its Transpose."""
    plumbing: list = []
    view = _sole_reader(graph, t, plumbing)
    if not gu.is_op(view, "Reshape") or len(view.inputs) != 2 or view.inputs[0] is not t:
        return None
    ev = ShapeEvaluator(graph, shapes)
    d, qd, target = ev.dim_symbols(t), ev.dim_symbols(q), _target(ev, view, 4)
    if d is None or qd is None or len(d) != 4 or len(qd) != (4 if q_first else 3) or target is None:
        return None
    d = [d[0], d[1], qd[2 if q_first else 1], d[3]]
    free = [i for i, e in enumerate(target) if e == (-1, ())]
    if len(free) > 1 or any(e != x for i, (e, x) in enumerate(zip(target, d)) if i not in free):
        return None
    return view, plumbing


def pins_rows_by_value(graph: gs.Graph, merge: gs.Node, q: gs.Tensor, q_first: bool, out_width: int,
                       shapes) -> bool | None:
    """Whether the merge Reshape's target, computed (not constant), is provably [B, Sq, H*dv]: its
    first two entries each q's batch or sequence dim (q [B, S, H*d], or [B, H, S, d] when
    q_first) or the merge input's own dim there (a copy, as 0 is), and H*dv or -1 last. True when
    B and Sq are q's and H*dv is last (fixed by value, not copied from the attention output that a
    term broadcast could have grown, nor taken up by -1); False when it copies or ends in -1; None
    when not provable."""
    ev = ShapeEvaluator(graph, shapes)
    target, d, own = _target(ev, merge, 3), ev.dim_symbols(q), ev.dim_symbols(merge.inputs[0])
    if target is None or d is None or len(d) != (4 if q_first else 3) or own is None or len(own) != 4:
        return None
    if int(gu.attr(merge, "allowzero", 0)) or target[2] not in ((out_width, ()), (-1, ())):
        return None
    rows = (d[0], d[2 if q_first else 1])
    if any(target[i] != rows[i] and target[i] != own[i] for i in (0, 1)):
        return None
    return target[0] == rows[0] and target[1] == rows[1] and target[2] == (out_width, ())


def feeds_only(graph: gs.Graph, shapes: list, views: list) -> bool:
    """Whether the Shape nodes feed nothing but the targets of `views` (Reshapes), through any plumbing."""
    return _feeds_only(graph, shapes, [(v, False) for v in views])
