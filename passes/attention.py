"""Scaled dot-product attention over split heads as one onnxfuse.Attention node.

fuse-attention
    rule:      every Softmax is a candidate (`rule`); the engine matches the scores chain before
               it (attention_rule.SCORED_SOFTMAX), the merge after it (MERGED_HEADS), the head
               splits and scales of q, k, v (attention_heads.SPLITS, SCALED) and the NaN guard
               (transformer_forms.NAN_GUARD); each Softmax left gets its reason in words
               (`optimize --explain fuse-attention`).
    match:     the multi-head attention chain written by torch.onnx.export for
                 q, k, v [B, S, H*dh] -> Reshape [B, S, H, dh] -> Transpose
                 scores = MatMul(q [B, H, Sq, dh], kT [B, H, dh, Sk])
                 (Div by a constant | Mul by a constant | nothing) (+ mask | + a + b) -> Softmax(last axis)
                 (-> Where(IsNaN(P), 0, P))
                 MatMul(P, v [B, H, Sk, dv]) -> Transpose(0, 2, 1, 3) -> Reshape [B, Sq, H*dv]
               with q read as Transpose(0, 2, 1, 3) of its Reshape, optionally times a constant;
               k as Transpose(0, 2, 3, 1) of its Reshape, or Transpose(0, 1, 3, 2) of
               Transpose(0, 2, 1, 3), optionally times a constant (the TorchScript exporter
               splits the scale as (q*c) @ (kT*c)); v as Transpose(0, 2, 1, 3) of its Reshape.
               An operand that is not such a split (or not read by the chain alone) is read
               heads first: q, v any float32 [B, H, S, d] tensor, k one through
               Transpose(0, 1, 3, 2) (then optionally times a constant): whatever computes it
               (partial or full rotary after the split, q/k norms, a last-axis Slice of GPT-NeoX's
               per-head packed projection) stays in the graph, a region of its own.
               Two additive terms, (scores + a) + b (T5: the relative-position bias, then the
               padding mask), are one mask a + b (an Add in the main graph, one per pair of
               terms, shared by the blocks that read the same pair). When q, k, v
               are, in this order, the three equal last-axis pieces of one Split read by nothing
               else, the Split is part of the match (qkv_packed); when that Split reads
               Add(t, c) (either order) read by nothing else, with c a constant bias along the
               last axis only, the Add is part of the match too (has_bias). The NaN-to-zero
               guard transformers' eager attention writes after Softmax (BERT's and GPT-2's
               TorchScript exports: a row whose keys a -inf mask hides entirely gets
               probabilities 0, not NaN) is part of the match when P is read by its IsNaN and
               Where alone and the fill is a +0 constant of one element
               (transformer_forms.nan_to_zero_guard): the node gets nan_to_zero = 1 (both
               kernels implement it; its mask is never read as causal).
    condition: float32 throughout; every scale a finite constant scalar (Div by c, c != 0, is a
               scale of 1/c); the head Reshapes' targets constant, [0 or B, 0 or S, H, dh] with
               H*dh (H*dv) the static last dim of q, k (v) (heads first: H and d static dims 1
               and 3, and the batch dims of q, k, v provably equal), one H for all three, and the
               merge Reshape's target [0 or B, 0 or Sq, H*dv] as a constant or the Shape of a
               tensor whose dims are provably [B, Sq, H*dv]; Softmax on the last axis (opset >=
               13); the mask of rank <= 4, each dim provably 1 or equal to its axis of
               [B, H, Sq, Sk] (a slice to that axis's length, min(S, C), counts as equal: the
               original's Add fails where it differs, and so does the kernel's broadcast
               check), or, when the merge target pins [B, Sq], any dims (a mask that
               broadcast the scores up would make that Reshape fail in the original as well;
               two terms: their broadcast, each pair of dims equal or one of them 1, and dims
               read from a table refined with the facts inference misses: Range lengths,
               ConstantOfShape of a shape value, shape_values.refined_dims);
               every intermediate tensor read only by the chain and not a graph output; a
               folded bias float32 of 3*H*dh elements, of rank <= 3 with every dim but the last
               1 (so the Add's output is t's [B, S, 3*H*dh]).
               cpu: the key length, static or declared (--dim; else read as 1), at most
               CPU_MAX_KEYS (measured faster up to 256 keys, slower at 512), or in causal mode
               (below) CPU_MAX_CAUSAL_KEYS (measured faster at 512: half the work), and keys x
               head size at most CPU_MAX_KEY_PANEL (twice that causal: one head's key panel in
               L1; ViT-B/16's 197 x 64 is slower). cuda: always.
               causal (cpu only): the mask is Slice(c, starts [0, 0], ends, axes the last two,
               steps [1, 1]) of a float32 constant c [1, ..., 1, R, C], R, C >= 2, that is 0 on and
               below the diagonal and <= CAUSAL_MASKED_MAX (-1e4) or -inf above it, with ends
               proved (symbolically, as shape-plumbing evaluates shape tensors) equal to [Sq, Sk]:
               torch's `mask[:, :, :T, :T]` of a registered triu(-1e9) buffer. The mask is then
               exactly the top-left causal mask while Sq <= R and Sk <= C (beyond, the original's
               Add fails); see attention_rule.causal_slice for why skipping masked keys gives its probabilities.
    rewrite:   onnxfuse.Attention, whose fallback function is the matched subgraph (a merge
               target computed from a Shape is written there as the equal [0, 0, H*dv]; a bias of
               shape [1, 1, 3*H*dh] or [1, 3*H*dh] is given to the node, and read by the body's Add,
               as the same values reshaped to [3*H*dh], which broadcasts alike). causal: the node
               gets causal = 1 and no mask input; the body slices c itself, to the ends
               Shape(scores)[2:4], equal to the matched ends, so the graph's Shape -> Gather ->
               Unsqueeze -> Concat -> Slice of the mask lose their reader and go.

Contract of onnxfuse.Attention (the CPU kernel kernels/attention_cpu.cc and the CUDA kernel
implement exactly this):

    inputs   qkv_packed = 0: q [B, Sq, H*dh], k [B, Sk, H*dh], v [B, Sk, H*dv] (, mask)
             qkv_packed = 1: qkv [B, S, 3*H*dh] (, mask) (, bias): q, k, v are its columns
                             [0, D), [D, 2D), [2D, 3D) with D = H*dh (Sq = Sk = S, dv = dh); read
                             in place; with has_bias, q = qkv[..., 0:D] + bias[0:D],
                             k = qkv[..., D:2D] + bias[D:2D], v = qkv[..., 2D:3D] + bias[2D:3D]
             mask: float32, additive, broadcastable (ONNX multidirectional, rank <= 4) to
                   [B, H, Sq, Sk]
             heads_first (qkv_packed = 0): bit 0 set, q is [B, H, Sq, dh]; bit 1, k is
                   [B, H, Sk, dh]; bit 2, v is [B, H, Sk, dv] (q[b, s, h, i] = q[b, h, s, i])
    attrs    num_heads INT H; scale FLOAT; has_mask INT 0/1 (whether the last input is a mask);
             qkv_packed INT 0/1; heads_first INT 0-7, absent = 0 (see inputs); has_bias INT 0/1, absent = 0 (whether the last input is a
             bias [3*H*dh] float32 added to qkv's columns; only with qkv_packed = 1);
             nan_to_zero INT 0/1, absent = 0 (not with causal): a query row whose probabilities
             are NaN (Softmax's row is NaN as a whole: all scores -inf, or a NaN or +inf score)
             weighs v by 0 instead: out[b, s, h*dv + j] = sum_t 0 * v[b, t, h, j] (v with its
             bias), +0, or NaN where that column of v holds an infinite or NaN value
             causal INT 0/1, absent = 0 (only with has_mask = 0): the mask is the top-left causal
             one, -inf for t > s, 0 otherwise (see "out" for how the kernel may skip those keys);
             with causal, causal_max_queries INT R and causal_max_keys INT C: Sq > R or Sk > C
             is an error (the constant the original sliced has R rows and C columns)
             input order: qkv (or q, k, v), then the mask if has_mask, then the bias if has_bias
    output   out [B, Sq, H*dv], float32:
             out[b, s, h*dv + j] = sum_t softmax_t(scale * (q[b, s, h, :] . k[b, t, h, :])
                                                    + mask[b, h, s, t]) * v[b, t, h, j]
             (q[b, s, h, i] = q[b, s, h*dh + i]; mask indexed after broadcasting). A row whose
             scores are all -inf gives NaN, like onnxruntime's Softmax. causal: keys t > s get
             probability 0 and are left out while the (b, h)'s keys and values are finite (else
             -inf is added to their scores and 0 * v summed, so a NaN or infinite one gives the
             NaN rows the original gives).

The op is registered (kernels/registry.h) with variadic float32 inputs (minimum arity 1,
homogeneous) and one float32 output; every provider's registration must declare the same.

Why: onnxruntime's CPU provider runs each block's attention as 10 kernels (3 Reshapes, 4
Transposes, 2 MatMuls, the scale and mask Add, Softmax), copying the [B, H, S, S] scores
through memory between them. The fused kernel computes a query row's scores, softmax and
weighted sum of v in cache, reading q, k, v where the projection wrote them. onnxruntime does
not fuse a 3-D MatMul with its bias Add, so the projection's bias would be one more kernel and
one more pass over [B, S, 3*H*dh]: the Attention kernel adds it as it reads q, k and v.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import facts
from onnxfuse.graph.attention_heads import (Heads, keys_split, mask_fits, merge_pins_rows, operand_split, same_dim,
                                          scaled)
from onnxfuse.graph import rules
from onnxfuse.graph.attention_rule import MERGED_AFTER_VIEW, MERGED_HEADS, causal_slice, match_scores, packed_split, qkv_bias
from onnxfuse.graph.attention_scores import (Fill, feeds_only, identity_view, match_merged, pins_rows_by_value,
                                             rewrite_merged, summed_mask)
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.rules import Var, op
from onnxfuse.graph.shape_values import refined_dims
from onnxfuse.graph.transformer_forms import nan_to_zero_guard
from onnxfuse.pipeline import Context, Pass

# Longest key sequence (static or declared) for which the CPU kernel is applied, and the most
# keys x head size of one head's key panel: see _keys_unpaid_on_cpu.
CPU_MAX_KEYS = 256
CPU_MAX_CAUSAL_KEYS = 512  # in causal mode, which skips the masked half of the scores
CPU_MAX_KEY_PANEL = 8192  # 32 KiB of float32
CPU_MAX_CAUSAL_KEY_PANEL = 16384


@dataclass
class Match:
    q: Heads
    k: Heads
    v: Heads
    scale: float
    mask: gs.Tensor | None
    nodes: list  # the chain from the score MatMul to the merge Reshape (not the head splits)
    merge: gs.Node
    split: gs.Node | None = None
    bias_add: gs.Node | None = None  # Add(t, bias) read by the packed Split (folded)
    bias: np.ndarray | None = None  # its constant, as [3*H*dh]
    causal: tuple[int, int] | None = None  # the mask is a causal Slice of a [R, C] constant: (R, C)
    # (scores + a) + b: the two additive terms (T5's position bias and padding mask), which the
    # node reads as one mask a + b; `mask` is then None until the rewrite computes that sum.
    mask_terms: tuple[gs.Tensor, gs.Tensor] | None = None
    nan_to_zero: bool = False  # Where(IsNaN(p), 0, p) after the Softmax (transformer_forms.nan_to_zero_guard)
    fill: Fill | None = None  # 3-D over batch*heads (q.merged): a masked fill of the scores; the views
    views: list | None = None
    out_dims: list | None = None
    # MatMul(P, v) read by a Reshape to its own dims (GPT-2's decode step), dropped by the rewrite
    identity_view: gs.Node | None = None


def _keys_unpaid_on_cpu(k: Heads, shapes: facts.ShapeTable, ctx: Context | None, causal: bool) -> str | None:
    """Why the CPU kernel would not pay at this key length, or None (also for a target whose
    kernel is measured faster always, or without a context). Against onnxruntime's chain
    (bench/results/attention_cpu.md): faster up to CPU_MAX_KEYS keys of 32, slower at 512 (its
    key panel and v rows leave L1 for every 4 query rows); in causal mode faster at 512 keys of 32
    too (untimed beyond: CPU_MAX_CAUSAL_KEYS). With heads of 64: at 128 keys (BERT-base) 0.982
    against 0.990 for the whole model in one run, level with the chain within the 2.5% noise of
    bench/results/realsize_pass_ab.md (198 against 342 kernels); at 197 keys (ViT-B/16) slower,
    1.013 against 0.997: one head's key panel, keys x head size, at most CPU_MAX_KEY_PANEL floats
    (32 KiB, L1), twice that in causal mode. A symbolic key length is read as declared (optimize
    --dim, a zoo model's defaults), else as 1, the value verification uses."""
    if ctx is None or ctx.target.attention_measured_faster_always:
        return None
    sk = k.rows(shapes)[1]
    if isinstance(sk, str):
        sk = ctx.options.dims.get(sk, 1)
    if not isinstance(sk, int):
        return None
    keys, panel = (CPU_MAX_CAUSAL_KEYS, CPU_MAX_CAUSAL_KEY_PANEL) if causal else (CPU_MAX_KEYS, CPU_MAX_KEY_PANEL)
    if sk > keys:
        return f"the key length is above what the CPU kernel is measured faster at ({keys} keys)"
    if isinstance(k.width, int) and sk * k.width > panel:
        return (f"one head's keys ({sk} x {k.width}) are above what the CPU kernel is measured faster at"
                f" ({panel} elements)")
    return None


def _condition(shapes: facts.ShapeTable, ctx: Context | None):
    """The rule's condition: the rest of the chain around a Softmax, proved; the found match
    goes into the engine's bindings as "attention"."""

    def attention(m: rules.Match, graph: gs.Graph):
        found = match(graph, m["softmax"], shapes, ctx)
        if not found:
            return found
        if ctx is not None and ctx.target.compiles_kernels:
            from onnxfuse.cuda.attention_codegen import supported

            if not supported(found.q.width, found.v.width):
                return rules.fail(f"the CUDA kernel has no variant for head sizes q/k {found.q.width}, v {found.v.width}")
        m.bindings["attention"] = found
        return True
    return attention


def rule(shapes: facts.ShapeTable, ctx: Context | None) -> rules.Rule:
    """fuse-attention as a rule: every Softmax is a candidate; its scores chain is matched by
    the engine (attention_rule.SCORED_SOFTMAX, or the 3-D form over batch*heads), what reads
    its probabilities and what q, k and v are, by the condition."""
    return rules.Rule("fuse-attention", op.Softmax(Var("logits"), _name="softmax"), condition=_condition(shapes, ctx),
                      private=False)


def match(graph: gs.Graph, softmax: gs.Node, shapes: facts.ShapeTable, ctx: Context | None = None) -> Match | rules.Failure:
    if graph.opset < 13:
        return rules.fail(f"opset {graph.opset}: Softmax before opset 13 normalizes over flattened axes")
    axis = int(gu.attr(softmax, "axis", -1))
    if axis not in (-1, 3):
        return rules.fail(f"Softmax over axis {axis}, not the last axis of [B, H, Sq, Sk]")
    probs = softmax.outputs[0]
    # Where(IsNaN(p), 0, p) between Softmax and the MatMul: transformers' guard for all-masked rows.
    guard = nan_to_zero_guard(graph, probs)
    weights = guard[1].outputs[0] if guard is not None else probs
    if any(gu.is_op(n, "Reshape") for n in weights.outputs):  # 3-D attention over batch*heads
        return _merged(graph, softmax, weights, guard, shapes, ctx)
    if not gu.is_private(graph, weights):
        readers = ", ".join(sorted(n.op for n in weights.outputs)) or "nothing"
        output = " and are a graph output" if any(weights is t for t in graph.outputs) else ""
        return rules.fail(f"the probabilities are read by {readers}{output}, not by MatMul(P, V) alone")
    pv = weights.outputs[0]
    if not gu.is_op(pv, "MatMul") or pv.inputs[0] is not weights:
        merged = " (a reshape of P, such as 3-D attention over batch*heads, is not matched)" if gu.is_op(pv, "Reshape") else ""
        return rules.fail(f"the probabilities are read by {pv.op}, not as the left operand of MatMul(P, V){merged}")
    scores = match_scores(graph, softmax, {t.name for t in graph.outputs})
    if isinstance(scores, str):
        return rules.fail(scores)
    qk, scale, mask, mask_terms = scores.qk, scores.scale, scores.mask, scores.mask_terms
    q_in, q_scale, q_scale_node = scaled(graph, qk.inputs[0])
    if q_scale_node is not None and not gu.is_private(graph, qk.inputs[0]):
        return rules.fail("the scaled q is read outside the attention chain")
    # The TorchScript exporter writes a scale split as sqrt(s) on q and on kT: (q*c) @ (kT*c).
    k_in, k_scale, k_scale_node = scaled(graph, qk.inputs[1])
    if k_scale_node is not None and not gu.is_private(graph, qk.inputs[1]):
        return rules.fail("the scaled k is read outside the attention chain")
    # Each of q, k, v: its head split, read in place, or (after a prologue: rotary, norms) the
    # [B, H, S, d] tensor itself, which the node reads heads first.
    q = operand_split(graph, q_in, shapes)
    k = keys_split(graph, k_in, shapes)
    v = operand_split(graph, pv.inputs[1], shapes)
    for name, heads in (("q", q), ("k", k), ("v", v)):
        if heads is None:
            return rules.fail(f"{name} is neither a head split this pass proves (a Reshape [B, S, H, dh] with a"
                                     f" constant target, then Transpose to [B, H, S, dh]"
                                     f"{' (k: [B, H, dh, S])' if name == 'k' else ''}, read by the chain alone) nor"
                                     f" a float32 [B, H, S, d] tensor with H and d known"
                                     f"{' (k: transposed by Transpose(0, 1, 3, 2) read by the chain alone)' if name == 'k' else ''}")
    if qk.inputs[0] is qk.inputs[1]:
        return rules.fail("q and k are the same tensor")
    if not (q.heads == k.heads == v.heads and q.width == k.width):
        return rules.fail(f"head counts q {q.heads}, k {k.heads}, v {v.heads} differ (repeat_kv is"
                                 f" fuse-gqa's form) or q and k widths differ ({q.width}, {k.width})")
    if q_scale_node is not None:
        q.nodes.append(q_scale_node)
        scale *= q_scale
    if k_scale_node is not None:
        k.nodes.append(k_scale_node)
        scale *= k_scale
    merged = rules.match_after([MERGED_HEADS], graph, weights, "p", depth=3)
    view, plumbing = None, []
    if merged is None:
        # MatMul(P, v) read first by a Reshape to its own dims (GPT-2's decode step)
        ctx_heads = pv.outputs[0]
        found_view = (identity_view(graph, ctx_heads, q.source, q.heads_first, shapes)
                      if any(gu.is_op(n, "Reshape") for n in ctx_heads.outputs) else None)
        if found_view is not None:
            view, plumbing = found_view
            merged = rules.match_after([MERGED_AFTER_VIEW], graph, ctx_heads, "pv_out", depth=3)
            if merged is not None and merged[1]["view"] is not view:
                merged = None
        if merged is None:
            return rules.fail("the output is not merged back by Transpose(0, 2, 1, 3) read by one Reshape")
    back, merge = merged[1]["back"], merged[1]["merge"]
    out_width = v.heads * v.width
    pinned = merge_pins_rows(merge, q, out_width, shapes)
    if pinned is None:  # a target computed from shapes (a decode step's): proved by value
        pinned = pins_rows_by_value(graph, merge, q.source, q.heads_first, out_width, shapes)
    if pinned is not None and plumbing and not feeds_only(graph, plumbing, [view, merge]):
        return rules.fail("a Shape of MatMul(P, V) feeds more than the chain's own Reshape targets")
    if pinned is None:
        return rules.fail(f"the merge Reshape's target is not provably [B, Sq, {out_width}]")
    qd, kd, vd = (h.rows(shapes) for h in (q, k, v))
    if any(d is None for d in (qd, kd, vd)):
        return rules.fail("the dims of q, k or v are unknown")
    # A batch broadcast between q, k and v would grow the output (a pinned merge fails on it in the
    # original too); a [B, H, S, d] operand's MatMul broadcasts its batch, which the kernel does not.
    either_first = q.heads_first or k.heads_first or v.heads_first
    if (not pinned or either_first) and not (same_dim(qd[0], kd[0]) and same_dim(kd[0], vd[0])):
        return rules.fail(f"batch dims of q, k, v not provably equal ({qd[0]}, {kd[0]}, {vd[0]})")
    causal = None
    target = [qd[0], q.heads, qd[1], kd[1]]
    if mask is not None:
        # The CUDA kernel has no causal mode: there the mask stays an input. A guarded chain keeps
        # its mask as an input too (the kernel's causal mode has no guard).
        if (ctx is None or ctx.target.attention_causal_mode) and guard is None:
            causal = causal_slice(graph, mask, q, k, shapes)
        if causal is None and not mask_fits(mask, target, shapes, pinned, same_dim(kd[1], vd[1])):
            return rules.fail(f"the additive term's dims are not provably 1 or those of the scores {target}")
    if mask_terms is not None and not mask_fits(mask_terms, target, shapes, pinned):
        return rules.fail(f"the two additive terms' dims are not provably 1 or those of the scores {target}")
    unpaid = _keys_unpaid_on_cpu(k, shapes, ctx, causal is not None)
    if unpaid is not None:
        return rules.fail(unpaid)
    chain = scores.nodes + [softmax] + (list(guard) if guard is not None else []) + [pv, back, merge]
    m = Match(q, k, v, float(np.float32(scale)), mask, chain, merge, causal=causal, mask_terms=mask_terms,
              nan_to_zero=guard is not None, identity_view=view)
    m.split = packed_split(graph, m, shapes)
    if m.split is not None:
        folded = qkv_bias(graph, m.split, shapes)
        if folded is not None:
            m.bias_add, m.bias = folded
    return m


def _merged(graph, softmax, weights, guard, shapes, ctx) -> Match | rules.Failure:
    found = match_merged(graph, softmax, weights, guard, shapes)
    if isinstance(found, str):
        return rules.fail(found)
    q, k, v = (Heads(t, None, found.heads, shapes.dims(t)[2], n, merged=True)
               for t, n in ((found.q, found.q_nodes), (found.k, found.k_nodes), (found.v, [])))
    unpaid = _keys_unpaid_on_cpu(k, shapes, ctx, False)
    if unpaid is not None:
        return rules.fail(unpaid)
    return Match(q, k, v, found.scale, found.mask, found.nodes, found.nodes[-1], fill=found.fill, views=found.views,
                 out_dims=found.out_dims)


def rewrite(graph: gs.Graph, m: Match, ctx: Context, sums: dict | None = None) -> None:
    if m.mask_terms is not None:
        summed_mask(graph, m, {} if sums is None else sums)
    merge = m.merge
    out = merge.outputs[0]
    out_width = m.v.heads * m.v.width
    if m.identity_view is not None:  # the body's Transpose reads MatMul(P, v) itself: the same values
        m.nodes[-2].inputs[0] = m.identity_view.inputs[0]
        gu.disconnect(m.identity_view)
    if gu.constant_ints(merge.inputs[1]) is None:
        # The target was a Shape proved equal to [B, Sq, H*dv]: the fallback body says so with a
        # constant, so the fused node reads no shape tensor.
        gu.disconnect(merge)
        target = gu.make_constant(graph, gu.unique_name(graph, f"{out.name}_heads_merged"),
                                  np.array([0, 0, out_width], np.int64))
        merge = gs.Node("Reshape", name=merge.name, inputs=[m.nodes[-2].outputs[0], target], outputs=[out])
        m.nodes[-1] = merge
    if out.dtype is None:
        out.dtype = np.float32
    nodes = [n for h in (m.q, m.k, m.v) for n in h.nodes] + m.nodes
    bias = None
    if m.split is not None:
        nodes.insert(0, m.split)
        inputs = [m.split.inputs[0]]
        if m.bias_add is not None:
            add = m.bias_add
            i = 0 if gu.is_constant(add.inputs[1]) else 1  # the operand that is not the bias
            bias = add.inputs[1 - i]
            if tuple(gu.constant_value(bias).shape) != m.bias.shape:
                # The body's Add reads the [3D] bias the node is given: the same values, broadcast alike.
                bias = gu.make_constant(graph, f"{bias.name}_flat", m.bias)
                add.inputs[1 - i] = bias
            nodes.insert(0, add)
            inputs = [add.inputs[i]]
    else:
        inputs = [m.q.source, m.k.source, m.v.source]
    if m.causal is not None:
        _causal_body(graph, m, nodes)
    elif m.mask is not None:
        inputs.append(m.mask)
    if bias is not None:
        inputs.append(bias)
    attrs = {
        "num_heads": int(m.q.heads),
        "scale": float(m.scale),
        "has_mask": int(m.mask is not None and m.causal is None),
        "qkv_packed": int(m.split is not None),
    }
    if bias is not None:
        attrs["has_bias"] = 1
    if m.nan_to_zero:
        attrs["nan_to_zero"] = 1
    first = sum(1 << i for i, h in enumerate((m.q, m.k, m.v)) if h.heads_first)
    if first:
        attrs["heads_first"] = first
    if m.causal is not None:
        attrs["causal"] = 1
        attrs["causal_max_queries"], attrs["causal_max_keys"] = (int(x) for x in m.causal)
    if m.q.merged:
        rewrite_merged(graph, m, nodes, inputs, attrs, {} if sums is None else sums)
    ctx.fuse(graph, "Attention", nodes, inputs, [out], attrs)


def _causal_body(graph: gs.Graph, m: Match, nodes: list) -> None:
    """The fallback body slices the causal constant itself, to ends read from the scores' own
    shape [B, H, Sq, Sk] (which the matched ends were proved equal to), so that the fused node
    reads no mask and the graph's mask plumbing (Shape, Gather, Unsqueeze, Concat, Slice) loses
    its reader. A constant that is one value c above the diagonal (torch's triu(-1e9) buffer) is
    built there, bit for bit, as Trilu(ConstantOfShape(its shape, c), k = 1) (opset >= 14):
    every fused node's body holds a copy of what it reads, and a [1024, 1024] table would be
    4 MiB per attention block; any other constant goes into the body as a Constant node."""
    add = next(n for n in m.nodes if gu.is_op(n, "Add") and m.mask in n.inputs)
    j = 0 if add.inputs[0] is m.mask else 1
    scores = add.inputs[1 - j]
    old = gu.producer(m.mask)
    table = old.inputs[0]
    value = gu.constant_value(table)
    rank = value.ndim

    def const(base, values, dtype=np.int64):
        return gu.make_constant(graph, f"{m.mask.name}_{base}", np.array(values, dtype))

    def var(base, dtype):
        return gs.Variable(gu.unique_name(graph, f"{m.mask.name}_{base}"), dtype=dtype)

    made = []
    future = value.reshape(value.shape[-2:])[np.triu(np.ones(value.shape[-2:], bool), 1)]
    if graph.opset >= 14 and future.size and np.all(future == future[0]):
        filled, table = var("filled", np.float32), var("table", np.float32)
        made += [
            gs.Node("ConstantOfShape", name=f"{old.name}_filled", inputs=[const("table_shape", list(value.shape))],
                    outputs=[filled], attrs={"value": const("fill", [future[0]], np.float32)}),
            gs.Node("Trilu", name=f"{old.name}_table", inputs=[filled, const("diagonal", 1)], outputs=[table],
                    attrs={"upper": 1}),
        ]
    elif not isinstance(table, gs.Constant):  # a Constant node's output: the body gets the value itself
        table = gu.make_constant(graph, table.name, value)
    shape, ends, mask = var("scores_shape", np.int64), var("ends", np.int64), var("causal", np.float32)
    made += [
        gs.Node("Shape", name=f"{old.name}_scores_shape", inputs=[scores], outputs=[shape]),
        gs.Node("Slice", name=f"{old.name}_ends", inputs=[shape, const("from", [2]), const("to", [4]), const("axis", [0])],
                outputs=[ends]),
        gs.Node("Slice", name=old.name, inputs=[table, const("starts", [0, 0]), ends,
                                                const("axes", [rank - 2, rank - 1]), const("steps", [1, 1])],
                outputs=[mask]),
    ]
    add.inputs[j] = mask
    at = nodes.index(add)
    nodes[at:at] = made


def fuse_attention(graph: gs.Graph, ctx: Context) -> int:
    if not any(gu.is_op(n, "Softmax") for n in graph.nodes):
        return 0
    # On --target cuda the generated kernel (onnxfuse/cuda/attention_codegen.py) has been checked
    # with nvcc/ptxas and a numpy model of its indexing, but not yet timed or run on a GPU: until
    # it is, the CUDA rewrite is opt-in (pass option attention_cuda; python -m bench.gpu --attention).
    if not ctx.target.measured and not ctx.options.attention_cuda:
        for n in graph.nodes:
            if gu.is_op(n, "Softmax"):
                ctx.reject(n, f"the {ctx.target.name} kernel is not yet measured: opt-in (pass option attention_cuda)")
        return 0
    refresh_shapes(graph)
    # Dims inference alone leaves unnamed: a mask or position bias built from Ranges over the
    # sequence (T5) must be proved [.., Sq, Sk] to be the node's mask input.
    shapes, _ = refined_dims(graph, facts.ShapeTable(graph))
    # Every Softmax left gets its reason, asked for or not (the summary counts them).
    matches = [m["attention"] for _, m in rules.find_all(graph, [rule(shapes, ctx)], explain=ctx.reject)]
    sums: dict = {}  # summed mask terms, one Add per pair (_summed_mask)
    for m in matches:
        rewrite(graph, m, ctx, sums)
    if matches:
        gu.toposort(graph)
    return len(matches)

PASS = Pass(
    "fuse-attention",
    470,
    "multi-head scaled dot-product attention (head split, scores, mask, Softmax, merge) as one onnxfuse.Attention",
    fuse_attention,
)
