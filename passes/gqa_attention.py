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
               NaN-to-zero form gets Where(IsNaN(out), 0, out) after the op: a row whose
               probabilities were NaN gave 0 in the original.
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
from onnxfuse.graph.shape_values import ShapeEvaluator
from onnxfuse.graph.transformer_forms import GQA_FORMS, gqa_attention, heads, rotary
from onnxfuse.pipeline import Context, Pass

CONTRIB_DOMAIN = "com.microsoft"
PATTERNS = tuple(((exporter, form), gqa_attention(exporter, form)) for exporter, form in GQA_FORMS)
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
    freqs: gs.Tensor  # f [1, S', d/2]: cos and sin are Cos/Sin(Concat(f, f))
    out: gs.Tensor
    nan_to_zero: bool
    seq: tuple | None  # q's sequence dim (a monomial)
    batch: tuple | None
    expand_mask: bool  # the mask's dims are not proved [B|1, 1, S, S]: see _Shared.mask_for
    rows_proved: bool = False  # f's S' is proved to be S (else the caches are expanded to S rows)


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
    for i in (0, 1):
        if not (_is(target[i], xd[i]) or (target[i] == _const(0))):
            return None
    total = xd[2][0]
    if width <= 0 or target[3] != _const(width) or total % width:
        return None
    h = total // width
    if target[2] not in (_const(h), _const(-1)):
        return None
    return h


def _repeat(ev: ShapeEvaluator, m: rules.Match, name: str, kv_heads: int, heads_: int) -> bool:
    """repeat_kv of x [B, Hkv, S, d] (x's dims as its own symbols: the exporter reads them
    with Shape(x)) to [B, H, S, d]: Unsqueeze on axis 2, Expand to [x0, x1, H/Hkv, x2, x3],
    Reshape to [x0, x1 * H/Hkv, x2, x3]. That x1 is Hkv, the caller proves from x's producer."""
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
    for g, w, h in zip(got, want, have):
        if not (_is(g, w) or (g == _const(1) and _is(h, w))):
            return False
    target = _monos(ev, rep.inputs[1])
    grouped = (xd[1][0] * n, xd[1][1])
    want = [xd[0], grouped, xd[2], xd[3]]
    if target is None or len(target) != 4:
        return False
    zero_ok = int(gu.attr(rep, "allowzero", 0)) == 0
    copy = want[:1] + [xd[1], _const(n), xd[2]]  # what a 0 copies: the Expand output's dims
    for i, (g, w) in enumerate(zip(target, want)):
        if _is(g, w) or (zero_ok and g == _const(0) and _is(copy[i], w)):
            continue
        return False
    return True


def _keys_transposed(ev: ShapeEvaluator, m: rules.Match, exporter: str, heads_: int, b, s, d) -> bool:
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
    if flat[0] not in lead or not _is(flat[1], s) or flat[2] != d:
        return False
    return _is(unflat[0], b) and unflat[1] in (_const(heads_),) and unflat[2] == d and _is(unflat[3], s)


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


def _freqs(t: gs.Tensor, fn: str, width: int, shapes: facts.ShapeTable) -> gs.Tensor | None:
    """t = Unsqueeze([Cast to float](Mul(fn(Concat(f, f, -1)), 1.0) | fn(Concat(f, f, -1))), [1]):
    f float32 [1, S', d/2]."""
    node = gu.producer(t)
    if not gu.is_op(node, "Unsqueeze"):
        return None
    axes = gu.constant_ints(node.inputs[1]) if len(node.inputs) > 1 else gu.attr(node, "axes")
    if axes is None or list(axes) != [1]:
        return None
    node = gu.producer(node.inputs[0])
    if gu.is_op(node, "Cast") and int(gu.attr(node, "to", 0)) == 1:
        node = gu.producer(node.inputs[0])
    if gu.is_op(node, "Mul") and len(node.inputs) == 2:
        ones = [i for i in (0, 1) if gu.scalar(node.inputs[i]) == 1.0]
        if not ones:
            return None
        node = gu.producer(node.inputs[1 - ones[0]])
    if not gu.is_op(node, fn):
        return None
    cat = gu.producer(node.inputs[0])
    if not gu.is_op(cat, "Concat") or len(cat.inputs) != 2 or cat.inputs[0] is not cat.inputs[1]:
        return None
    f = cat.inputs[0]
    fd = shapes.dims(f)
    if int(gu.attr(cat, "axis", 0)) not in (-1, 2) or fd is None or len(fd) != 3:
        return None
    if fd[0] != 1 or fd[2] != width // 2 or f.dtype != np.float32:
        return None
    return f


def _read_within(graph: gs.Graph, t: gs.Tensor, nodes) -> bool:
    """t is no graph output and each of its readers is one of `nodes` or a Shape (the
    exporter's run-time shape arithmetic for the match's own Reshapes, which goes with them)."""
    return not gu.is_graph_output(graph, t) and all(any(r is n for n in nodes) or gu.is_op(r, "Shape")
                                                    for r in t.outputs)


def _rotated(graph: gs.Graph, ev: ShapeEvaluator, t: gs.Tensor, name: str, width: int, outs, attention: rules.Match):
    """The rotary match of `t` on head-split x, t read by the attention (or a Shape) only."""
    found = rules.match_at([ROTARY[name]], graph, t, outs) if _read_within(graph, t, attention.nodes) else None
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


def match(graph: gs.Graph, root: gs.Node, shapes: facts.ShapeTable, ev: ShapeEvaluator, outs) -> Layer | None:
    if not gu.is_op(root, "Reshape"):
        return None
    for (exporter, form), pattern in PATTERNS:
        m = rules.match(pattern, root, outs, private=False)
        if m is None:
            continue
        layer = _check(graph, m, exporter, form, shapes, ev, outs)
        if layer is not None:
            return layer
    return None


def _check(graph, m: rules.Match, exporter, form, shapes, ev, outs) -> Layer | None:
    extra = []
    if form == "nan_to_zero":
        isnan = gu.producer(m["isnan"])
        sm = m["softmax"].outputs[0]
        if not gu.is_op(isnan, "IsNaN") or isnan.inputs[0] is not sm or not gu.is_private(graph, m["isnan"]):
            return None
        extra.append(isnan)
    # Intermediates are read inside the match only, or by a Shape.
    held = list(m.nodes) + extra
    if not all(_read_within(graph, t, held) for n in held if n is not m.root for t in n.outputs):
        return None
    qr, kr, vh = m["qr"], m["kr"], m["vh"]
    # Head widths: from v's split (the rotary is checked against it).
    vs = _split(graph, vh, "v", outs, [m["vh_unsqueeze"]])
    if vs is None:
        return None
    vd = ev.dim_symbols(vs["v"])
    vt = _monos(ev, vs["v_target"])
    if vd is None or vt is None or len(vt) != 4 or vt[3][1]:
        return None
    width = vt[3][0]
    if width <= 0:
        return None
    kv_heads = _split_heads(ev, vs, "v", width)
    if kv_heads is None or width % 2:
        return None
    qm = _rotated(graph, ev, qr, "qh", width, outs, m)
    km = _rotated(graph, ev, kr, "kh", width, outs, m)
    if qm is None or km is None or qm["cos"] is not km["cos"] or qm["sin"] is not km["sin"]:
        return None
    qs = _split(graph, qm["qh"], "q", outs, qm.nodes)
    ks = _split(graph, km["kh"], "k", outs, km.nodes)
    if qs is None or ks is None:
        return None
    heads_ = _split_heads(ev, qs, "q", width)
    k_heads = _split_heads(ev, ks, "k", width)
    if heads_ is None or k_heads != kv_heads:
        return None
    qd, kd = ev.dim_symbols(qs["q"]), ev.dim_symbols(ks["k"])
    b, s = qd[0], qd[1]
    if not (_is(kd[0], b) and _is(vd[0], b) and _is(kd[1], s) and _is(vd[1], s)):
        return None
    d = _const(width)
    if not _repeat(ev, m, "kr", kv_heads, heads_) or not _repeat(ev, m, "vh", kv_heads, heads_):
        return None
    if not _keys_transposed(ev, m, exporter, heads_, b, s, d):
        return None
    merge = _monos(ev, m["merge_target"])
    if merge is None or len(merge) != 3 or int(gu.attr(m["merge"], "allowzero", 0)) == 1 and _const(0) in merge:
        return None
    if not ((_is(merge[0], b) or merge[0] == _const(0)) and (_is(merge[1], s) or merge[1] == _const(0))
            and merge[2] in (_const(heads_ * width), _const(-1))):
        return None
    mask = m["mask"]
    md = shapes.dims(mask)
    if mask.dtype != np.float32 or md is None or len(md) > 4:
        return None
    expand_mask = not _mask_fits(ev, mask, b, s)
    f = _freqs(qm["cos"], "Cos", width, shapes)
    if f is None or _freqs(qm["sin"], "Sin", width, shapes) is not f:
        return None
    scale = m["scale"] if exporter == "ts" else m["q_scale"] * m["k_scale"]
    if not np.isfinite(scale) or scale == 0.0:
        return None
    return Layer(qs["q"], ks["k"], vs["v"], heads_, kv_heads, width, float(np.float32(scale)), mask, f,
                 m.root.outputs[0], form == "nan_to_zero", s, b, expand_mask, _is((ev.dim_symbols(f) or [None, None])[1], s))


class _Shared:
    """Tensors every fused layer of one graph reads: seqlens_k, total_sequence_length and the
    caches, built once per (q's batch and sequence dims, f)."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self.lengths: dict = {}
        self.caches: dict = {}
        self.masks: dict = {}

    def _var(self, base: str, dtype):
        return gs.Variable(gu.unique_name(self.graph, base), dtype=dtype)

    def _const(self, base: str, value):
        return gu.make_constant(self.graph, base, np.asarray(value))

    def lengths_for(self, layer: Layer, query: gs.Tensor):
        """(seqlens_k, total_sequence_length, S) from the Shape of `query` [B, S, ..]."""
        key = (layer.batch, layer.seq)
        if key not in self.lengths or layer.batch is None or layer.seq is None:
            g, q = self.graph, query
            shape = self._var("gqa_q_shape", np.int64)
            batch, seq = self._var("gqa_batch", np.int64), self._var("gqa_seq", np.int64)
            total, last = self._var("gqa_total_sequence_length", np.int32), self._var("gqa_last_position", np.int32)
            seqlens = self._var("gqa_seqlens_k", np.int32)
            g.nodes += [
                gs.Node("Shape", name=shape.name, inputs=[q], outputs=[shape]),
                gs.Node("Slice", name=batch.name, inputs=[shape, self._const("gqa_zero", np.array([0], np.int64)),
                                                          self._const("gqa_one", np.array([1], np.int64))], outputs=[batch]),
                gs.Node("Gather", name=seq.name, inputs=[shape, self._const("gqa_one_scalar", np.array(1, np.int64))],
                        outputs=[seq], attrs={"axis": 0}),
                gs.Node("Cast", name=total.name, inputs=[seq], outputs=[total], attrs={"to": 6}),
                gs.Node("Sub", name=last.name, inputs=[total, self._const("gqa_one_int32", np.array(1, np.int32))],
                        outputs=[last]),
                gs.Node("Expand", name=seqlens.name, inputs=[last, batch], outputs=[seqlens]),
            ]
            self.lengths[key] = (seqlens, total, seq)
        return self.lengths[key]

    def mask_for(self, layer: Layer, seq: gs.Tensor):
        """Expand(mask, [1, 1, S, S]): where inference does not give the mask's dims. The
        original adds the mask to scores [B, H, S, S]; broadcast to [.., .., S, S] first, it is
        a bias GroupQueryAttention takes whenever that Add works ([B|1, H|1, S, S]; the op
        refuses any other shape), and a mask of [B, 1, 1, S] (padding only) gets its rows."""
        key = (id(layer.mask), layer.seq)
        if key not in self.masks or layer.seq is None:
            g = self.graph
            seq1, target, out = (self._var(n, t) for n, t in (("gqa_mask_seq", np.int64), ("gqa_mask_shape", np.int64),
                                                               ("gqa_attention_bias", np.float32)))
            g.nodes += [
                gs.Node("Unsqueeze", name=seq1.name, inputs=[seq, self._const("gqa_axis0", np.array([0], np.int64))],
                        outputs=[seq1]),
                gs.Node("Concat", name=target.name, inputs=[self._const("gqa_ones", np.array([1, 1], np.int64)), seq1, seq1],
                        outputs=[target], attrs={"axis": 0}),
                gs.Node("Expand", name=out.name, inputs=[layer.mask, target], outputs=[out]),
            ]
            self.masks[key] = out
        return self.masks[key]

    def caches_for(self, layer: Layer, seq: gs.Tensor):
        key = (id(layer.freqs), layer.seq, layer.rows_proved)
        if key not in self.caches:
            g, half = self.graph, layer.width // 2
            flat = self._var("gqa_positions_freqs", np.float32)
            rows = self._var("gqa_cache_shape", np.int64)
            g.nodes.append(gs.Node("Reshape", name=flat.name,
                                   inputs=[layer.freqs, self._const("gqa_freqs_rows", np.array([-1, half], np.int64))],
                                   outputs=[flat]))
            per_row = flat
            if not layer.rows_proved:
                # f has S' rows: S' = S, or 1 (one row for every position), which Expand repeats
                # to S rows as the original's broadcast does; any other S' fails there as in the
                # original.
                seq1 = self._var("gqa_seq_1d", np.int64)
                per_row = self._var("gqa_freqs_per_position", np.float32)
                g.nodes += [
                    gs.Node("Unsqueeze", name=seq1.name, inputs=[seq, self._const("gqa_axis0", np.array([0], np.int64))],
                            outputs=[seq1]),
                    gs.Node("Concat", name=rows.name, inputs=[seq1, self._const("gqa_half", np.array([half], np.int64))],
                            outputs=[rows], attrs={"axis": 0}),
                    gs.Node("Expand", name=per_row.name, inputs=[flat, rows], outputs=[per_row]),
                ]
            caches = []
            for fn in ("Cos", "Sin"):
                c = self._var(f"gqa_{fn.lower()}_cache", np.float32)
                g.nodes.append(gs.Node(fn, name=c.name, inputs=[per_row], outputs=[c]))
                caches.append(c)
            self.caches[key] = tuple(caches)
        return self.caches[key]


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


def rewrite(graph: gs.Graph, layer: Layer, shared: _Shared) -> None:
    packed = _packed_projection(graph, layer)
    qkv = [packed, gs.Variable.empty(), gs.Variable.empty()] if packed is not None else [layer.q, layer.k, layer.v]
    seqlens, total, seq = shared.lengths_for(layer, qkv[0])
    cos, sin = shared.caches_for(layer, seq)
    mask = shared.mask_for(layer, seq) if layer.expand_mask else layer.mask
    out = layer.out
    producer = gu.producer(out)
    producer.outputs.clear()
    attention_out = out
    if layer.nan_to_zero:
        attention_out = gs.Variable(gu.unique_name(graph, f"{out.name}_gqa"), dtype=np.float32)
    node = gs.Node("GroupQueryAttention", domain=CONTRIB_DOMAIN, name=gu.unique_name(graph, f"{out.name}_GroupQueryAttention"),
                   inputs=[*qkv, gs.Variable.empty(), gs.Variable.empty(), seqlens, total, cos, sin,
                           gs.Variable.empty(), mask],
                   outputs=[attention_out],
                   attrs={"num_heads": layer.heads, "kv_num_heads": layer.kv_heads, "scale": layer.scale,
                          "do_rotary": 1, "causal": 0})
    graph.nodes.append(node)
    if layer.nan_to_zero:
        isnan = gs.Variable(gu.unique_name(graph, f"{out.name}_isnan"), dtype=np.bool_)
        zero = gu.make_constant(graph, "gqa_nan_zero", np.array(0.0, np.float32))
        graph.nodes += [
            gs.Node("IsNaN", name=isnan.name, inputs=[attention_out], outputs=[isnan]),
            gs.Node("Where", name=gu.unique_name(graph, f"{out.name}_nan_to_zero"), inputs=[isnan, zero, attention_out],
                    outputs=[out]),
        ]
    # [B, S, H*d], q's shape (H*d = v's heads times width): the pointwise pass makes the
    # NaN-to-zero guard one region when it knows the shape.
    for t in {id(out): out, id(attention_out): attention_out}.values():
        t.dtype = np.float32
        if t.shape is None and layer.q.shape is not None:
            t.shape = list(layer.q.shape)


def fuse_gqa(graph: gs.Graph, ctx: Context) -> int:
    if not ctx.target.float32_group_query_attention or not any(gu.is_op(n, "Expand") for n in graph.nodes):
        return 0
    if not any(gu.is_op(n, "Softmax") for n in graph.nodes):
        return 0
    refresh_shapes(graph)
    shapes = facts.ShapeTable(graph)
    ev = ShapeEvaluator(graph, shapes)
    outs = {t.name for t in graph.outputs}
    layers = [layer for layer in (match(graph, n, shapes, ev, outs) for n in list(graph.nodes)) if layer is not None]
    if not layers:
        return 0
    shared = _Shared(graph)
    for layer in layers:
        rewrite(graph, layer, shared)
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
