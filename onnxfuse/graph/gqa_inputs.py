"""The inputs onnxruntime's GroupQueryAttention reads besides q, k and v, built from the graph's
own tensors: seqlens_k and total_sequence_length from shapes (a decode step's from its past
keys' length), the half-width rotary caches from the exporter's frequencies f (rows padded to
the past length in a decode step, where the op rotates query row s by cache row P + s), and the
mask broadcast to the bias the op takes. Used by fuse-gqa (passes/gqa_attention.py).
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.fused import DOMAIN as FUSED_DOMAIN

from . import core as gu
from . import facts
from .facts import _vague, refresh_shapes


class GQAInputs:
    """Tensors every fused layer of one graph reads: seqlens_k, total_sequence_length, the
    caches and the attention bias, built once per (q's batch and sequence dims, past length,
    f, mask). `layer` is the pass's description of one attention (passes/gqa_attention.py:
    Layer): q's batch and seq dims, the past tensors and length of a decode step, f, the mask,
    the head width)."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self.lengths: dict = {}
        self.caches: dict = {}
        self.masks: dict = {}

    def _var(self, base: str, dtype):
        return gs.Variable(gu.unique_name(self.graph, base), dtype=dtype)

    def _const(self, base: str, value):
        return gu.make_constant(self.graph, base, np.asarray(value))

    def lengths_for(self, layer, query: gs.Tensor):
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

    def mask_for(self, layer, seq: gs.Tensor):
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

    def decode_lengths_for(self, layer, query: gs.Tensor):
        """A decode step's (seqlens_k = P + S - 1 per batch row, total_sequence_length = P + S,
        P as a 1-D tensor) from the Shapes of past_k [B, Hkv, P, d] and `query` [B, S, ..]."""
        named = all(layer_dim is not None and not any(x.startswith("\0") for x in layer_dim[1])
                    for layer_dim in (layer.batch, layer.seq, layer.past_len))
        key = ("decode", layer.batch, layer.seq, layer.past_len)
        if key not in self.lengths or not named:
            g = self.graph
            shape = self._var("gqa_past_shape", np.int64)
            batch, plen = self._var("gqa_batch", np.int64), self._var("gqa_past_length", np.int64)
            total64, total = self._var("gqa_total_length", np.int64), self._var("gqa_total_sequence_length", np.int32)
            last, seqlens = self._var("gqa_last_position", np.int32), self._var("gqa_seqlens_k", np.int32)
            total_1d = self._var("gqa_total_1d", np.int32)
            if layer.seq is not None and not layer.seq[1]:
                seq = self._const("gqa_seq", np.array(layer.seq[0], np.int64))
            else:
                qshape, seq = self._var("gqa_q_shape", np.int64), self._var("gqa_seq", np.int64)
                g.nodes += [gs.Node("Shape", name=qshape.name, inputs=[query], outputs=[qshape]),
                            gs.Node("Gather", name=seq.name, inputs=[qshape, self._const("gqa_one_scalar", np.array(1, np.int64))],
                                    outputs=[seq], attrs={"axis": 0})]
            g.nodes += [
                gs.Node("Shape", name=shape.name, inputs=[layer.past[0]], outputs=[shape]),
                gs.Node("Slice", name=batch.name, inputs=[shape, self._const("gqa_zero", np.array([0], np.int64)),
                                                          self._const("gqa_one", np.array([1], np.int64))], outputs=[batch]),
                gs.Node("Slice", name=plen.name, inputs=[shape, self._const("gqa_two", np.array([2], np.int64)),
                                                         self._const("gqa_three", np.array([3], np.int64))], outputs=[plen]),
                gs.Node("Add", name=total64.name, inputs=[plen, seq], outputs=[total64]),
                gs.Node("Cast", name=total_1d.name, inputs=[total64], outputs=[total_1d], attrs={"to": 6}),
                gs.Node("Squeeze", name=total.name, inputs=[total_1d, self._const("gqa_axis0", np.array([0], np.int64))],
                        outputs=[total]),
                gs.Node("Sub", name=last.name, inputs=[total_1d, self._const("gqa_one_int32", np.array([1], np.int32))],
                        outputs=[last]),
                gs.Node("Expand", name=seqlens.name, inputs=[last, batch], outputs=[seqlens]),
            ]
            self.lengths[key] = (seqlens, total, seq, plen, total64)
        return self.lengths[key]

    def decode_mask_for(self, layer, seq: gs.Tensor, total: gs.Tensor):
        """Expand(mask, [1, 1, S, P + S]): the bias the op takes, whatever broadcast of it the
        original's Add to scores [B, H, S, P + S] made."""
        key = ("decode", id(layer.mask), layer.seq, layer.past_len)
        if key not in self.masks:
            g = self.graph
            target, out = self._var("gqa_mask_shape", np.int64), self._var("gqa_attention_bias", np.float32)
            seq1 = seq
            nodes = []
            if not seq.shape or len(seq.shape) == 0:
                seq1 = self._var("gqa_mask_seq", np.int64)
                nodes.append(gs.Node("Unsqueeze", name=seq1.name, inputs=[seq, self._const("gqa_axis0", np.array([0], np.int64))],
                                     outputs=[seq1]))
            g.nodes += nodes + [
                gs.Node("Concat", name=target.name, inputs=[self._const("gqa_ones", np.array([1, 1], np.int64)), seq1, total],
                        outputs=[target], attrs={"axis": 0}),
                gs.Node("Expand", name=out.name, inputs=[layer.mask, target], outputs=[out]),
            ]
            self.masks[key] = out
        return self.masks[key]

    def nan_guard(self, layer, attention_out: gs.Tensor, values: gs.Tensor, out: gs.Tensor) -> list[gs.Node]:
        """out = Where(IsNaN(attention_out), Z, attention_out), Z what the original's attention
        gives for a row whose probabilities were NaN (its Where(IsNaN(p), 0, p) makes them 0):
        0 . V, which is 0 where every value of the head's column j (all T positions) is finite
        and NaN where one is not (0 * inf, 0 * NaN), as [B, 1, H*d] from the op's present values
        [B, Hkv, T, d]: ReduceSum over T of V - V (+0 for a finite value, NaN else; no overflow,
        unlike a sum of V) to [B, Hkv, 1, d], each kv head repeated H/Hkv times as repeat_kv
        does, the heads merged as the output's [B, 1, H*d] (h * d + j), which broadcasts over
        the query rows. Returns the nodes (added to the graph), in order: the body of
        onnxfuse.AttentionNanGuard where the pass writes it."""
        g = self.graph
        n = layer.heads // layer.kv_heads
        finite, heads = self._var("gqa_values_nonfinite", np.float32), self._var("gqa_values_nonfinite_heads", np.float32)
        nodes = [
            gs.Node("Sub", name=finite.name, inputs=[values, values], outputs=[finite]),
            gs.Node("ReduceSum", name=heads.name, inputs=[finite, self._const("gqa_axis2", np.array([2], np.int64))],
                    outputs=[heads], attrs={"keepdims": 1}),
        ]
        if n > 1:  # [B, Hkv, 1, d] -> [B, Hkv, n, d]
            grouped = self._var("gqa_values_nonfinite_grouped", np.float32)
            nodes.append(gs.Node("Expand", name=grouped.name, inputs=[heads, self._const(f"gqa_repeat_{n}", np.array([1, 1, n, 1], np.int64))],
                                 outputs=[grouped]))
            heads = grouped
        zero = self._var("gqa_zero_probs_output", np.float32)
        isnan = self._var(f"{out.name}_isnan", np.bool_)
        nodes += [
            gs.Node("Reshape", name=zero.name, inputs=[heads, self._const("gqa_merge_heads", np.array([0, 1, -1], np.int64))],
                    outputs=[zero]),
            gs.Node("IsNaN", name=isnan.name, inputs=[attention_out], outputs=[isnan]),
            gs.Node("Where", name=gu.unique_name(g, f"{out.name}_nan_to_zero"), inputs=[isnan, zero, attention_out],
                    outputs=[out]),
        ]
        g.nodes += nodes
        return nodes

    def caches_for(self, layer, seq: gs.Tensor, past_len: gs.Tensor | None = None):
        key = (id(layer.freqs), layer.seq, layer.rows_proved, id(past_len))
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
            pads = None
            if past_len is not None:
                # a decode step: the op rotates query row s by cache row P + s, the original by f's row s
                pads = self._var("gqa_cache_pads", np.int64)
                g.nodes.append(gs.Node("Concat", name=pads.name, inputs=[past_len, self._const("gqa_pad_rest", np.zeros(3, np.int64))],
                                       outputs=[pads], attrs={"axis": 0}))
            for fn in ("Cos", "Sin"):
                c = self._var(f"gqa_{fn.lower()}_cache", np.float32)
                g.nodes.append(gs.Node(fn, name=c.name, inputs=[per_row], outputs=[c]))
                if pads is not None:
                    padded = self._var(f"gqa_{fn.lower()}_cache_padded", np.float32)
                    g.nodes.append(gs.Node("Pad", name=padded.name, inputs=[c, pads], outputs=[padded]))
                    c = padded
                caches.append(c)
            self.caches[key] = tuple(caches)
        return self.caches[key]


def name_output_dims(graph: gs.Graph) -> None:
    """Give each GroupQueryAttention output (and its NaN guard's) [B, S, H*d] where inference
    knows q's S and width: the inference onnxfuse runs gives the contrib op's output made-up dims
    (unk__N), and with them nothing downstream has a shape (gemm-as-matmul cannot prove GPT-2's
    Conv1D projections after it). B is the past's batch dim by name (the op, like the original's
    Concat(past, new), takes q's batch only when it is the past's), so that the dims, named, hold
    across inference refreshes; then the same for the Pointwise regions (no views) whose inputs all
    have one named shape, as the residual Adds after the op (else a second optimize finds more)."""
    ops = [n for n in graph.nodes if n.op == "GroupQueryAttention" and n.domain == "com.microsoft"]
    if not ops:
        return
    refresh_shapes(graph)
    shapes = facts.ShapeTable(graph)
    for node in ops:
        q, out = node.inputs[0], node.outputs[0]
        qd = shapes.dims(q)
        past = shapes.dims(node.inputs[3]) if len(node.inputs) > 3 and gu.is_present(node.inputs[3]) else None
        heads, kv_heads = int(gu.attr(node, "num_heads", 0)), int(gu.attr(node, "kv_num_heads", 0))
        if qd is None or len(qd) != 3 or not isinstance(qd[1], int) or not isinstance(qd[2], int) or heads <= 0:
            continue
        if past is None or len(past) != 4 or not isinstance(past[0], str) or past[0].startswith("unk__"):
            continue
        packed = not (len(node.inputs) > 1 and gu.is_present(node.inputs[1]))
        per = heads + 2 * kv_heads if packed else heads
        if qd[2] % per:
            continue
        dims = [past[0], qd[1], heads * (qd[2] // per)]
        out.shape = list(dims)
        # the NaN guard after the op (Where(IsNaN(out), Z, out), or onnxfuse.AttentionNanGuard): elementwise on out
        for reader in out.outputs:
            # a one-input Pointwise (the guard as the pointwise pass wrote it) is elementwise on out
            one_input = _whole_pointwise(reader) and len(reader.inputs) == 1
            fused = reader.op == "AttentionNanGuard" and reader.domain == FUSED_DOMAIN and reader.inputs[0] is out
            if gu.is_op(reader, "IsNaN") or (gu.is_op(reader, "Where") and reader.inputs[2] is out) or one_input or fused:
                reader.outputs[0].shape = list(dims)
                for r2 in reader.outputs[0].outputs:
                    if gu.is_op(r2, "Where") and r2.inputs[2] is out:
                        r2.outputs[0].shape = list(dims)
    # Pointwise regions (inference does not know them either) on equal-shaped inputs now named:
    # without views, a region's output has its inputs' shape
    for node in graph.nodes:
        ins = [shapes.dims(t) if t.shape is None else t.shape for t in node.inputs if not isinstance(t, gs.Constant)]
        if _whole_pointwise(node) and ins and all(d == ins[0] for d in ins) and not _vague(ins[0]) \
                and _vague(node.outputs[0].shape):
            node.outputs[0].shape = list(ins[0])


def _whole_pointwise(node: gs.Node) -> bool:
    """An onnxfuse Pointwise of one output that reads every input whole (no Slice/Split views):
    elementwise, its output has its inputs' broadcast shape."""
    program = node.attrs.get("program", "")
    program = program.decode() if isinstance(program, bytes) else str(program)
    return node.op == "Pointwise" and node.domain == FUSED_DOMAIN and len(node.outputs) == 1 and "view=" not in program
