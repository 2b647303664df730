"""Grouped-query attention with rotary embeddings and its mask as onnxruntime's GroupQueryAttention.

fuse-gqa
    match:     a LLaMA-style decoder layer's attention as both torch.onnx exporters write it
               (onnxfuse/graph/transformer_forms.py): q, k, v projections [B, S, H*d],
               [B, S, Hkv*d], [B, S, Hkv*d] split into heads (Reshape, Transpose(0, 2, 1, 3));
               rotary x * cos + rotate_half(x) * sin on q and k with one cos and sin; k and v
               repeated to H heads (repeat_kv: Unsqueeze, Expand, Reshape); scores q @ kT
               scaled by constants, plus an additive mask; Softmax on the last axis (then
               Cast(Cast) float to float, or Where(IsNaN(p), 0, p)); times v; heads merged
               (Transpose(0, 2, 1, 3), Reshape [B, S, H*d]).
    condition: float32; every shape proved symbolically (shape_values.ShapeEvaluator, as
               shape-plumbing does) from the graph's own shape tensors: the head splits give
               [B, S, H|Hkv, d]; repeat_kv unsqueezes axis 2, expands to [B, Hkv, n, S, d] and
               reshapes to [B, Hkv*n, S, d] with H = Hkv*n; the key transpose is of the last two
               axes; the merge target is [B|0, S|0, H*d|-1]; the Slices cut the last axis at d/2
               (x[..., d/2:] negated first, then x[..., :d/2]); cos and sin are each
               [Cast](Mul(Cos|Sin(Concat(f, f, -1)), 1)) unsqueezed on axis 1, with f float32 [1, S', d/2]
               (positions along S', one row per position, both halves equal, as GroupQueryAttention's
               caches are); the mask float32 of rank 4 [B|1, 1, S, S] (checked by inference,
               or proved by the broadcast of the original's Add: see _mask_fits).
    rewrite:   com.microsoft GroupQueryAttention(q, k, v, seqlens_k = S-1 per batch row,
               total_sequence_length = S, cos_cache, sin_cache = Cos|Sin(f) as [S, d/2],
               attention_bias = mask), num_heads H, kv_num_heads Hkv, scale, do_rotary 1,
               causal 0 (the mask carries causality and padding: the op adds it to every
               score, as the original does). Positions: with no past and no position_ids the
               op rotates token s by cache row s, which is the original's position s when
               S' = S; an S' of 1 (one row for all positions) is expanded to S rows. The
               NaN-to-zero form gets Where(IsNaN(out), Z, out) after the op: a row whose
               probabilities were NaN gave 0 . V in the original, Z (gqa_inputs: 0 where the
               head's value column is finite at every position, NaN where not); a NaN the op
               gives with finite probabilities (0 * inf at a masked position) is NaN there too.
               Where onnxfuse's library has a kernel, the guard is one onnxfuse.AttentionNanGuard
               node (onnxfuse/ops/attention_nan_guard.py), its fallback function those nodes.
    decode:    a decode step's k and v are Concat(past, new) on the sequence axis ([B, Hkv, P, d]
               pasts; the Concats are the model's present outputs), the rotary and head splits
               on the new token. The op takes past_key/past_value and writes the Concats as its
               present_key/present_value; seqlens_k = P + S - 1 and total_sequence_length
               P + S come from the past's shape; the caches get P leading rows (the op rotates
               query row s by cache row P + s, the original by f's row s); the mask is expanded
               to [1, 1, S, P + S] unless inference gives it [B|1, 1, S, T] with T a named dim
               (torch.export's, from the attention mask input). Without a past the rotary and repeat_kv are required;
               with one they may both be absent (GPT-2: do_rotary 0, Hkv = H), and q, k, v the
               three pieces of one Split of a packed projection (the op reads it packed);
               heads merged as [B*S, H*d] (torch.export's GPT-2) get a Reshape of the op's output.
               torch.export's head-split and merge targets with -1 for a static sequence and
               its no-op view of the weighted sum [B, H, S, d] are proved as such. The key
               length's elements of the repeat_kv and key-transpose targets may be any
               run-time length (torch.export reads it from the mask's shape): the original
               fails unless it is P + S, except for one key broadcast along a longer mask (a
               past of 0 with a mask of more than one column), which the op refuses.
Known limit: where inference gives no dims for the mask (the TorchScript export), a mask whose
batch dim exceeds q's batch of 1 would have made the original broadcast its output wider; the
op refuses that mask with an error instead.
Why: onnxruntime alone runs each layer's attention as ~40 kernels (head splits, rotary pieces,
repeat_kv copies, the 3-D key transpose, scores, mask, Softmax, merge); its GroupQueryAttention
CPU kernel does the rotary, the grouped heads and the mask in one (figures in
bench/results/corpus_llama.md). The op is onnxruntime's: the output needs onnxruntime (any
build; the CPU kernel is in the default package), and the node carries no fallback function.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import facts
from onnxfuse.graph import rules
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.rules import ANY, Const, Var, alt, op
from onnxfuse.graph.gqa_inputs import GQAInputs, name_output_dims
from onnxfuse.graph.shape_values import ShapeEvaluator
from onnxfuse.graph.transformer_forms import GQA_FORMS, gqa_attention, heads, rotary
from onnxfuse.ops.attention_nan_guard import OP as NAN_GUARD
from onnxfuse.pipeline import Context, Pass

CONTRIB_DOMAIN = "com.microsoft"
PATTERNS = tuple((form, gqa_attention(*form)) for form in GQA_FORMS)
ROTARY = {name: rules.Rule(f"rotary/{name}", rotary(name)) for name in ("qh", "kh")}
HEADS = {name: rules.Rule(f"heads/{name}", heads(name)) for name in ("q", "k", "v")}


@dataclass
class Layer:
    q: gs.Tensor  # projections [B, S, H*d], [B, S, Hkv*d], [B, S, Hkv*d]
    k: gs.Tensor
    v: gs.Tensor
    heads: int
    kv_heads: int
    width: int
    scale: float
    mask: gs.Tensor
    freqs: gs.Tensor | None  # f [1, S', d/2]: cos and sin are Cos/Sin(Concat(f, f)); None: no rotary
    out: gs.Tensor
    nan_to_zero: bool
    seq: tuple | None  # q's sequence dim (a monomial)
    batch: tuple | None
    expand_mask: bool  # the mask's dims are not proved [B|1, 1, S, S]: see _Shared.mask_for
    rows_proved: bool = False  # f's S' is proved to be S (else the caches are expanded to S rows)
    past: tuple | None = None  # a decode step: (past_k, past_v) [B, Hkv, P, d] the keys and values extend
    present: tuple = (None, None)  # their Concat(past, new): kept as the op's present outputs
    past_len: tuple | None = None  # P (a monomial)
    flat: bool = False  # the heads merged as [B*S, H*d] (a Reshape of the op's [B, S, H*d] output)


def _monos(ev: ShapeEvaluator, t: gs.Tensor):
    v = ev.value(t)
    return None if v is None or v.rank != 1 else list(v.elems)


def _is(e, want) -> bool:
    return e is not None and want is not None and e == want


def _const(n: int):
    return (int(n), ())


def _split_heads(ev: ShapeEvaluator, m: rules.Match, name: str, width: int) -> int | None:
    """Heads of `name`'s split Reshape: its target proved [B|0, S|0, H|-1, d] for x [B, S, H*d]
    (d = width)."""
    x = m[name]
    xd = ev.dim_symbols(x)
    target = _monos(ev, m[f"{name}_target"])
    if xd is None or target is None or len(xd) != 3 or len(target) != 4 or xd[2][1] or x.dtype != np.float32:
        return None
    if int(gu.attr(m[f"{name}_split"], "allowzero", 0)) == 1 and (target[0] == _const(0) or target[1] == _const(0)):
        return None
    kept = [_is(target[i], xd[i]) or target[i] == _const(0) for i in (0, 1)]
    total = xd[2][0]
    if width <= 0 or target[3] != _const(width) or total % width:
        return None
    h = total // width
    # one -1 (B or S inferred: torch.export's target for a static S) when every other element is proved
    if not (all(kept) and target[2] in (_const(h), _const(-1))
            or target[2] == _const(h) and sorted(kept) == [False, True] and target[kept.index(False)] == _const(-1)):
        return None
    return h


def _repeat(ev: ShapeEvaluator, m: rules.Match, name: str, kv_heads: int, heads_: int, key_len=None) -> bool:
    """repeat_kv of x [B, Hkv, S, d] (x's dims as its own symbols: the exporter reads them
    with Shape(x)) to [B, H, S, d]: Unsqueeze on axis 2, Expand to [x0, x1, H/Hkv, x2, x3],
    Reshape to [x0, x1 * H/Hkv, x2, x3]. That x1 is Hkv, the caller proves from x's producer.
    `key_len`, when given, decides the sequence elements (x2) of both targets (a decode step's)."""
    unsq, expand, rep = m[f"{name}_unsqueeze"], m[f"{name}_expand"], m[f"{name}_repeat"]
    axes = gu.constant_ints(unsq.inputs[1]) if len(unsq.inputs) > 1 else gu.attr(unsq, "axes")
    xd = ev.dim_symbols(m[name])
    if axes is None or list(axes) != [2] or heads_ % kv_heads or xd is None or len(xd) != 4:
        return False
    n = heads_ // kv_heads
    got = _monos(ev, expand.inputs[1])
    if got is None or len(got) != 5:
        return False
    # Expand broadcasts: a target element of 1 keeps the input's dim.
    want = [xd[0], xd[1], _const(n), xd[2], xd[3]]
    have = [xd[0], xd[1], _const(1), xd[2], xd[3]]
    for i, (g, w, h) in enumerate(zip(got, want, have)):
        if not (_is(g, w) or (g == _const(1) and _is(h, w)) or (i == 3 and key_len is not None and key_len(g))):
            return False
    target = _monos(ev, rep.inputs[1])
    grouped = (xd[1][0] * n, xd[1][1])
    want = [xd[0], grouped, xd[2], xd[3]]
    if target is None or len(target) != 4:
        return False
    zero_ok = int(gu.attr(rep, "allowzero", 0)) == 0
    copy = want[:1] + [xd[1], _const(n), xd[2]]  # what a 0 copies: the Expand output's dims
    for i, (g, w) in enumerate(zip(target, want)):
        if _is(g, w) or (zero_ok and g == _const(0) and _is(copy[i], w)) or (i == 2 and key_len is not None and key_len(g)):
            continue
        return False
    return True


def _keys_transposed(ev: ShapeEvaluator, m: rules.Match, exporter: str, heads_: int, b, key_len, d) -> bool:
    if exporter == "ts":
        return True
    flat = _monos(ev, m["kt_flat"].inputs[1])
    unflat = _monos(ev, m["kt_unflat"].inputs[1])
    if flat is None or unflat is None or len(flat) != 3 or len(unflat) != 4:
        return False
    if int(gu.attr(m["kt_flat"], "allowzero", 0)) == 1 and _const(0) in flat:
        return False
    if int(gu.attr(m["kt_unflat"], "allowzero", 0)) == 1 and _const(0) in unflat:
        return False
    lead = [_const(-1)]
    if b is not None and not b[1]:
        lead.append(_const(b[0] * heads_))
    elif b is not None:
        lead.append((b[0] * heads_, b[1]))
    if flat[0] not in lead or not key_len(flat[1]) or flat[2] != d:
        return False
    return _is(unflat[0], b) and unflat[1] in (_const(heads_),) and unflat[2] == d and key_len(unflat[3])


def _slice_half(ev: ShapeEvaluator, node: gs.Node, width: int, upper: bool) -> bool:
    """node = Slice(x, start, end, axes, steps) of x [B, H, S, d] taking [d/2, end) (upper) or [0, d/2)."""
    starts, ends, axes = (ev.value(t) for t in node.inputs[1:4])
    steps = gu.constant_ints(node.inputs[4]) if len(node.inputs) > 4 and gu.is_present(node.inputs[4]) else [1]
    if starts is None or ends is None or axes is None or steps != [1]:
        return False
    if axes.constant not in ([3], [-1]) or len(starts.elems) != 1 or len(ends.elems) != 1:
        return False
    half = width // 2
    st, en = starts.constant, ends.constant
    if upper:
        return st == [half] and en is not None and en[0] >= width
    return st == [0] and en == [half]


def _freqs_rule(fn: str) -> rules.Rule:
    """Unsqueeze([Cast to float](Mul(fn(Concat(f, f)), 1.0) | fn(Concat(f, f))), axes)."""
    f = Var("f")
    wave = getattr(op, fn)(op.Concat(f, f, _name="cat"))
    scaled = alt(op.Mul(wave, Const(1.0)), wave)
    return rules.Rule(f"freqs/{fn}", op.Unsqueeze(alt(op.Cast(scaled, to=1), scaled), ANY, _name="unsqueeze"),
                      private=False)


FREQS = {fn: _freqs_rule(fn) for fn in ("Cos", "Sin")}
PAST = rules.Rule("past", op.Concat(Var("past"), Var("new"), _name="concat",
                                    axis=lambda a: int(a if a is not None else 0) in (2, -2)), private=False)


def _freqs(graph: gs.Graph, t: gs.Tensor, fn: str, width: int, shapes: facts.ShapeTable, outs) -> gs.Tensor | None:
    """t = FREQS[fn] unsqueezed on axis 1, its Concat on the last axis: f float32 [1, S', d/2]."""
    found = rules.match_at([FREQS[fn]], graph, t, outs)
    if found is None:
        return None
    m = found[1]
    node = m["unsqueeze"]
    axes = gu.constant_ints(node.inputs[1]) if len(node.inputs) > 1 else gu.attr(node, "axes")
    if axes is None or list(axes) != [1]:
        return None
    f = m["f"]
    fd = shapes.dims(f)
    if int(gu.attr(m["cat"], "axis", 0)) not in (-1, 2) or fd is None or len(fd) != 3:
        return None
    if fd[0] != 1 or fd[2] != width // 2 or f.dtype != np.float32:
        return None
    return f


def _read_within(graph: gs.Graph, t: gs.Tensor, nodes) -> bool:
    """t is no graph output and each of its readers is one of `nodes` or a Shape (the
    exporter's run-time shape arithmetic for the match's own Reshapes, which goes with them)."""
    return not gu.is_graph_output(graph, t) and all(any(r is n for n in nodes) or gu.is_op(r, "Shape")
                                                    for r in t.outputs)


def _rotated(graph: gs.Graph, ev: ShapeEvaluator, t: gs.Tensor, name: str, width: int, outs, readers):
    """The rotary match of `t` on head-split x, t read by `readers` (or a Shape) only."""
    found = rules.match_at([ROTARY[name]], graph, t, outs) if _read_within(graph, t, readers) else None
    if found is None:
        return None
    m = found[1]
    if not _slice_half(ev, m[f"{name}_hi"], width, True) or not _slice_half(ev, m[f"{name}_lo"], width, False):
        return None
    return m


def _split(graph: gs.Graph, t: gs.Tensor, name: str, outs, allowed) -> rules.Match | None:
    """t = heads(name); every reader of t is in `allowed` or a Shape (shape arithmetic only)."""
    found = rules.match_at([HEADS[name]], graph, t, outs) if _read_within(graph, t, allowed) else None
    return None if found is None else found[1]


def _mask_fits(ev: ShapeEvaluator, mask: gs.Tensor, b, s) -> bool:
    """mask float32 [B|1, 1, S, S] as shape inference gives its dims."""
    md = ev.dim_symbols(mask)
    if mask.dtype != np.float32 or md is None or len(md) != 4:
        return False
    return ((md[0] == _const(1) or _is(md[0], b)) and md[1] == _const(1) and _is(md[2], s) and _is(md[3], s))


def _condition(form, shapes: facts.ShapeTable, ev: ShapeEvaluator, outs):
    def layer(m: rules.Match, graph: gs.Graph):
        found = _check(graph, m, form, shapes, ev, outs)
        if found:
            m.bindings["layer"] = found
        return found
    return layer


def layer_rules(shapes: facts.ShapeTable, ev: ShapeEvaluator, outs) -> list[rules.Rule]:
    """One rule per form (GQA_FORMS, in that order), rooted at the merge Reshape: the first
    way a form matches is the one its condition (_check) judges."""
    return [rules.Rule("gqa/" + "-".join(str(x) for x in form), pattern, condition=_condition(form, shapes, ev, outs),
                       private=False, commit=True) for form, pattern in PATTERNS]


def _past(graph: gs.Graph, ev: ShapeEvaluator, t: gs.Tensor, outs):
    """t = PAST: Concat(past, new) on axis 2 of [B, Hkv, L, d] (a decode step's keys or values):
    (past, new, the Concat), else None. The dims are checked by the caller."""
    found = rules.match_at([PAST], graph, t, outs)
    if found is None:
        return None
    m = found[1]
    dims = ev.dim_symbols(t)
    if dims is None or len(dims) != 4 or m["past"].dtype != np.float32:
        return None
    return m["past"], m["new"], m["concat"]


def _decode_length(total):
    """Which elements of a decode step's shape targets may stand for the key length L = P + S:
    L's own symbol, or a run-time length of one symbol (torch.export reads it from the
    attention mask's shape). A target element that is not L at run time makes the original's
    repeat_kv Reshape (or key transpose) fail, except for one key broadcast along a longer
    mask (past 0, a mask of more than one column): an input the model's contract excludes."""
    return lambda e: e is not None and (_is(e, total) or (e[0] == 1 and len(e[1]) == 1))


def _noop_view(ev: ShapeEvaluator, m: rules.Match, known: list) -> bool:
    """The pv_view Reshape's target is its input's dims (each the same symbol as inference
    gives it or as proved by the match, `known` = [B, H, S, d]: the weighted sum has q's rows,
    H heads and v's width; or 0 copying it), one of them possibly -1 (then inferred as that
    dim): a no-op."""
    node = m["pv_view"]
    t, dims = _monos(ev, m["pv_view_target"]), ev.dim_symbols(node.inputs[0])
    if t is None or dims is None or len(t) != len(dims):
        return False
    zero = int(gu.attr(node, "allowzero", 0)) == 0
    kept = [_is(e, x) or _is(e, k) or (zero and e == _const(0)) for e, x, k in zip(t, dims, known)]
    return all(kept) or (kept.count(False) == 1 and t[kept.index(False)] == _const(-1))


def _check(graph, m: rules.Match, form, shapes, ev, outs) -> Layer | rules.Failure:
    exporter, scale_form, probs, view, repeat = form
    # Intermediates are read inside the match only, or by a Shape.
    if not all(_read_within(graph, t, m.nodes) for n in m.nodes if n is not m.root for t in n.outputs):
        return rules.fail("an intermediate of the attention is read outside it (other than by a Shape) or is a graph output")
    qr, kr, vh = m["qr"], m["kr"], m["vh"]
    # A decode step: k and v each Concat(past, new) on the sequence axis, the rotary and the
    # head split on the new ones.
    kpast, vpast = _past(graph, ev, kr, outs), _past(graph, ev, vh, outs)
    if (kpast is None) != (vpast is None):
        return rules.fail("one of k and v is Concat(past, new) and the other is not")
    if kpast is None and not repeat:  # multi-head attention without a past: fuse-attention's
        return rules.fail("no repeat_kv and no past: multi-head attention, fuse-attention's form")
    if kpast is not None:
        kr, vh = kpast[1], vpast[1]
    # Head widths: from v's split (the rotary is checked against it).
    vs = _split(graph, vh, "v", outs, [vpast[2]] if vpast else m.nodes)
    if vs is None:
        return rules.fail("v is not a head split Reshape(v, [B, S, Hkv, d]) -> Transpose(0, 2, 1, 3) read by the attention alone")
    vd = ev.dim_symbols(vs["v"])
    vt = _monos(ev, vs["v_target"])
    if vd is None or vt is None or len(vt) != 4 or vt[3][1]:
        return rules.fail("v's head-split target or dims are unknown, or its head width is not a constant")
    width = vt[3][0]
    if width <= 0:
        return rules.fail(f"v's head width {width} is not positive")
    kv_heads = _split_heads(ev, vs, "v", width)
    if kv_heads is None:
        return rules.fail("v's head-split target is not provably [B, S, Hkv, d] of v [B, S, Hkv*d]")
    k_readers = [kpast[2]] if kpast else m.nodes
    qm = km = None
    qs, ks = _split(graph, qr, "q", outs, m.nodes), _split(graph, kr, "k", outs, k_readers)
    if qs is None or ks is None:  # rotary on both (a head split on either alone: no match)
        if qs is not None or ks is not None or width % 2:
            return rules.fail("q and k are not both head splits, nor both rotated head splits of an even width")
        qm = _rotated(graph, ev, qr, "qh", width, outs, m.nodes)
        km = _rotated(graph, ev, kr, "kh", width, outs, k_readers)
        if qm is None or km is None or qm["cos"] is not km["cos"] or qm["sin"] is not km["sin"]:
            return rules.fail("q and k are not both rotated (x * cos + rotate_half(x) * sin) with one cos and sin")
        qs = _split(graph, qm["qh"], "q", outs, qm.nodes)
        ks = _split(graph, km["kh"], "k", outs, km.nodes)
        if qs is None or ks is None:
            return rules.fail("the rotated q or k is not a head split Reshape -> Transpose(0, 2, 1, 3) read by the rotary alone")
    heads_ = _split_heads(ev, qs, "q", width)
    k_heads = _split_heads(ev, ks, "k", width)
    if heads_ is None or k_heads != kv_heads or (not repeat and heads_ != kv_heads):
        return rules.fail("q's and k's head splits are not provably [B, S, H, d] and [B, S, Hkv, d] with v's Hkv and d"
                          " (and H = Hkv without repeat_kv)")
    qd, kd = ev.dim_symbols(qs["q"]), ev.dim_symbols(ks["k"])
    b, s = qd[0], qd[1]
    if not (_is(kd[0], b) and _is(vd[0], b) and _is(kd[1], s) and _is(vd[1], s)):
        return rules.fail("the batch and sequence dims of q, k and v are not provably equal")
    d = _const(width)
    key_len, past = (lambda e: _is(e, s)), None
    if kpast is not None:
        # past [B, Hkv, P, d] for k and v: the Concats make the original fail unless the past's
        # B, Hkv, d are the new k's and v's (proved above); their length is L = P + S
        pk, pv = ev.dim_symbols(kpast[0]), ev.dim_symbols(vpast[0])
        if pk is None or pv is None or len(pk) != 4 or len(pv) != 4 or vpast[0].dtype != np.float32:
            return rules.fail("the past keys and values are not float32 [B, Hkv, P, d] with known dims")
        key_len, past = _decode_length(ev.dim_symbols(m["kr"])[2]), (kpast[0], vpast[0])
    if repeat and not _repeat(ev, m, "kr", kv_heads, heads_, key_len if past else None):
        return rules.fail("repeat_kv of k is not provably Unsqueeze(2), Expand to [B, Hkv, H/Hkv, S, d], Reshape to [B, H, S, d]")
    if repeat and not _repeat(ev, m, "vh", kv_heads, heads_, key_len if past else None):
        return rules.fail("repeat_kv of v is not provably Unsqueeze(2), Expand to [B, Hkv, H/Hkv, S, d], Reshape to [B, H, S, d]")
    if not _keys_transposed(ev, m, exporter, heads_, b, key_len, d):
        return rules.fail("the key transpose's reshape targets are not provably those of k [B*H, L, d] and [B, H, d, L]")
    if view and not _noop_view(ev, m, [b, _const(heads_), s, d]):
        return rules.fail("the view of the weighted sum is not provably a no-op")
    merge = _monos(ev, m["merge_target"])
    flat = merge is not None and merge == [_const(-1), _const(heads_ * width)]  # [B*S, H*d] (torch.export's GPT-2)
    if flat and past is not None:
        merge = [_const(0), _const(0), _const(-1)]
    if merge is None or len(merge) != 3 or int(gu.attr(m["merge"], "allowzero", 0)) == 1 and _const(0) in merge:
        return rules.fail("the merge Reshape's target is unknown or not of rank 3 (or copies a 0 with allowzero)")
    # [B, S] as proved, or as inference gives the merged tensor's own dims
    own = ev.dim_symbols(m["merge"].inputs[0]) or [None, None]
    lead = _is(merge[0], b) or _is(merge[0], own[0]) or merge[0] == _const(0)
    mid = _is(merge[1], s) or _is(merge[1], own[1]) or merge[1] == _const(0)
    if not (lead and mid and merge[2] in (_const(heads_ * width), _const(-1))
            or merge[0] == _const(-1) and mid and merge[2] == _const(heads_ * width)):
        return rules.fail("the merge Reshape's target is not provably [B, S, H*d]")
    mask = m["mask"]
    md = shapes.dims(mask)
    if mask.dtype != np.float32 or md is None or len(md) > 4:
        return rules.fail("the mask is not float32 of known rank <= 4")
    if past is None:
        expand_mask = not _mask_fits(ev, mask, b, s)
    else:  # [B|1, 1, S, T], T a named dim (an input's: the original's Add fails unless T = P + S or 1)
        md = ev.dim_symbols(mask)
        expand_mask = not (md is not None and len(md) == 4 and mask.dtype == np.float32
                           and (md[0] == _const(1) or _is(md[0], b)) and md[1] == _const(1) and _is(md[2], s)
                           and key_len(md[3]) and not md[3][1][0].startswith("\0"))
    f = None
    if qm is not None:
        f = _freqs(graph, qm["cos"], "Cos", width, shapes, outs)
        if f is None or _freqs(graph, qm["sin"], "Sin", width, shapes, outs) is not f:
            return rules.fail("cos and sin are not Cos and Sin of Concat(f, f) unsqueezed on axis 1, f float32 [1, S', d/2], one f")
    scale = m["scale"] if scale_form == "ts" else m["q_scale"] * m["k_scale"]
    if not np.isfinite(scale) or scale == 0.0:
        return rules.fail(f"the scale {scale} is not finite and nonzero")
    return Layer(qs["q"], ks["k"], vs["v"], heads_, kv_heads, width, float(np.float32(scale)), mask, f,
                 m.root.outputs[0], probs == "nan_to_zero", s, b, expand_mask,
                 f is not None and _is((ev.dim_symbols(f) or [None, None])[1], s),
                 past, (m["kr"], m["vh"]) if past else (None, None), pk[2] if past else None, flat)


def _packed_split(graph: gs.Graph, layer: Layer) -> gs.Tensor | None:
    """q, k, v the three outputs, in order, of one Split of x [B, S, (H + 2 Hkv) d] on the last
    axis into H d, Hkv d, Hkv d (GPT-2's Conv1D projection): x is the packed input the op reads."""
    split = gu.producer(layer.q)
    if not gu.is_op(split, "Split") or [t for t in split.outputs] != [layer.q, layer.k, layer.v]:
        return None
    x, width = split.inputs[0], layer.width
    dims = facts.ShapeTable(graph).dims(x) if x.shape is None else x.shape
    if dims is None or len(dims) != 3 or int(gu.attr(split, "axis", 0)) not in (2, -1):
        return None
    sizes = gu.constant_ints(split.inputs[1]) if len(split.inputs) > 1 and gu.is_present(split.inputs[1]) \
        else gu.attr(split, "split")
    want = [layer.heads * width, layer.kv_heads * width, layer.kv_heads * width]
    if sizes is None and int(gu.attr(split, "num_outputs", 0)) == 3 and len(set(want)) == 1:
        sizes = want
    if sizes is None or list(sizes) != want or dims[2] != sum(want):
        return None
    if any(gu.is_graph_output(graph, t) for t in split.outputs):
        return None
    return x


def _packed_projection(graph: gs.Graph, layer: Layer) -> gs.Tensor | None:
    """q, k, v = MatMul(x, Wq), MatMul(x, Wk), MatMul(x, Wv) with one x and constant 2-D float32
    weights, each read by its head split alone: MatMul(x, Concat(Wq, Wk, Wv) on the columns),
    the packed [B, S, (H + 2 Hkv) d] GroupQueryAttention reads (one GEMM instead of three)."""
    mms = [gu.producer(t) for t in (layer.q, layer.k, layer.v)]
    if not all(gu.is_op(n, "MatMul") and len(t.outputs) == 1 and not gu.is_graph_output(graph, t)
               for n, t in zip(mms, (layer.q, layer.k, layer.v))):
        return None
    x = mms[0].inputs[0]
    if any(n.inputs[0] is not x for n in mms) or not all(gu.is_constant(n.inputs[1]) for n in mms):
        return None
    weights = [gu.constant_value(n.inputs[1]) for n in mms]
    if any(w is None or w.ndim != 2 or w.dtype != np.float32 or w.shape[0] != weights[0].shape[0] for w in weights):
        return None
    packed = gu.make_constant(graph, f"{mms[0].inputs[1].name}_qkv_packed", np.concatenate(weights, axis=1))
    out = gs.Variable(gu.unique_name(graph, f"{layer.q.name}_qkv_packed"), dtype=np.float32)
    graph.nodes.append(gs.Node("MatMul", name=gu.unique_name(graph, f"{mms[0].name}_qkv_packed"), inputs=[x, packed],
                               outputs=[out]))
    return out


def rewrite(graph: gs.Graph, layer: Layer, shared: GQAInputs, ctx: Context | None = None) -> None:
    packed = _packed_split(graph, layer) or _packed_projection(graph, layer)
    qkv = [packed, gs.Variable.empty(), gs.Variable.empty()] if packed is not None else [layer.q, layer.k, layer.v]
    past = [gs.Variable.empty(), gs.Variable.empty()]
    if layer.past is not None:
        seqlens, total, seq, plen, total64 = shared.decode_lengths_for(layer, qkv[0])
        cos, sin = shared.caches_for(layer, seq, plen) if layer.freqs is not None else (gs.Variable.empty(),) * 2
        mask = shared.decode_mask_for(layer, seq, total64) if layer.expand_mask else layer.mask
        past = list(layer.past)
    else:
        seqlens, total, seq = shared.lengths_for(layer, qkv[0])
        cos, sin = shared.caches_for(layer, seq) if layer.freqs is not None else (gs.Variable.empty(),) * 2
        mask = shared.mask_for(layer, seq) if layer.expand_mask else layer.mask
    out = flat_out = layer.out
    producer = gu.producer(out)
    producer.outputs.clear()
    if layer.flat:
        out = gs.Variable(gu.unique_name(graph, f"{flat_out.name}_heads"), dtype=np.float32)
        target = gu.make_constant(graph, "gqa_flat_heads", np.array([-1, layer.heads * layer.width], np.int64))
        graph.nodes.append(gs.Node("Reshape", name=gu.unique_name(graph, f"{flat_out.name}_flat"), inputs=[out, target],
                                   outputs=[flat_out]))
    presents = []
    for t in layer.present:
        if t is not None:  # the op writes Concat(past, new) itself
            gu.producer(t).outputs.clear()
            presents.append(t)
    attention_out = out
    if layer.nan_to_zero:
        attention_out = gs.Variable(gu.unique_name(graph, f"{out.name}_gqa"), dtype=np.float32)
        if not presents:  # the guard reads the values the op holds: its present outputs
            presents = [gs.Variable(gu.unique_name(graph, f"{out.name}_present_{kind}"), dtype=np.float32)
                        for kind in ("key", "value")]
    node = gs.Node("GroupQueryAttention", domain=CONTRIB_DOMAIN, name=gu.unique_name(graph, f"{out.name}_GroupQueryAttention"),
                   inputs=[*qkv, *past, seqlens, total, cos, sin, gs.Variable.empty(), mask],
                   outputs=[attention_out, *presents],
                   attrs={"num_heads": layer.heads, "kv_num_heads": layer.kv_heads, "scale": layer.scale,
                          "do_rotary": int(layer.freqs is not None), "causal": 0})
    graph.nodes.append(node)
    if layer.nan_to_zero:
        nodes = shared.nan_guard(layer, attention_out, presents[1], out)
        zero = nodes[-1].inputs[1]
        if ctx is not None and ctx.target.has_kernel(NAN_GUARD.name):
            # one kernel of ours for the guard's four or five, its fallback the exact nodes
            ctx.fuse(graph, NAN_GUARD.name, nodes, [attention_out, presents[1]], [out],
                     {"num_heads": layer.heads, "kv_num_heads": layer.kv_heads})
    # [B, S, H*d], q's shape (H*d = v's heads times width): where the guard stays standard
    # ops, the pointwise pass makes its IsNaN and Where one region when it knows the shape.
    # Both get q's shape when q is [B, S, H*d] (a packed q's last dim is larger): one shape for
    # the guard's two operands, where inference may have named the merged dims apart.
    q_shape = list(layer.q.shape) if layer.q.shape is not None else None
    merged = q_shape is not None and len(q_shape) == 3 and q_shape[2] == layer.heads * layer.width
    for t in {id(out): out, id(attention_out): attention_out}.values():
        t.dtype = np.float32
        if merged and (t.shape is None or layer.nan_to_zero):
            t.shape = list(q_shape)
        if merged and layer.nan_to_zero:  # the guard's Z: [B, 1, H*d]
            zero.shape = [q_shape[0], 1, q_shape[2]]


def fuse_gqa(graph: gs.Graph, ctx: Context) -> int:
    if ctx.target.float32_group_query_attention:
        name_output_dims(graph)
    if not ctx.target.float32_group_query_attention or not any(gu.is_op(n, "Expand") or gu.is_op(n, "Concat")
                                                                for n in graph.nodes):
        return 0
    if not any(gu.is_op(n, "Softmax") for n in graph.nodes):
        return 0
    refresh_shapes(graph)
    shapes = facts.ShapeTable(graph)
    ev = ShapeEvaluator(graph, shapes)
    outs = {t.name for t in graph.outputs}
    layers = [m["layer"] for _, m in rules.find_all(graph, layer_rules(shapes, ev, outs), explain=ctx.explainer)]
    if not layers:
        return 0
    shared = GQAInputs(graph)
    for layer in layers:
        rewrite(graph, layer, shared, ctx)
    gu.cleanup(graph)
    gu.toposort(graph)
    return len(layers)


PASS = Pass(
    "fuse-gqa",
    145,
    "grouped-query attention with rotary embeddings and mask (LLaMA-style) as onnxruntime's GroupQueryAttention",
    fuse_gqa,
    targets=("cpu",),
)
