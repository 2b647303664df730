"""Batching structurally identical ensemble branches layer by layer.

batch-ensemble
    match:     K >= 2 branches that start with linear readers of one tensor x (MatMul(x, W) or
               Gemm(x, W, C) with transA=0, constant 2-D weights of one shape, optional constant
               row bias; see onnxfuse.graph.linear.match_linear) and continue in lockstep with the same
               ops: further linear layers on constant weights of one shape per layer, and unary
               activations with equal attributes. Every intermediate tensor is read only by its
               branch. x must be 2-D ([B, D]).
    condition: at least two linear layers, and the rule for the target holds (below)
    rewrite:   MatMul(x, W1[K, D, H1]) -> [K, B, H1] (x broadcast over the branches)
               + Add(b1[K, 1, H1]) -> activation -> MatMul(., W2[K, H1, H2]) -> ...
               The branch outputs f_1..f_K ([B, O] each) are read from the stacked [K, B, O]:
               when they are exactly the inputs, in order, of a Concat on the last axis, that
               Concat becomes Transpose(perm=[1, 0, 2]) + Reshape([0, K*O]); otherwise a Split
               of that tensor gives back f_1..f_K.

    Rule. cuda: always (one batched GEMM launch per layer replaces K launches).
    cpu: the K separate (prepacked) Gemms are faster per FLOP than onnxruntime's stacked
    MatMul, so the stacked form pays only while kernel dispatch dominates: applied when the
    batch dim of x is static and 1, or at most CPU_MAX_BATCH with every layer's branch weight
    of at most CPU_MAX_BRANCH_WEIGHT elements (measured: bench/results/matmul_batch.md). Otherwise
    batch-sibling-matmul still merges the first layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph.activations import STACKED_MLP
from onnxfuse.graph.activations import TABLE as ACTIVATION_TABLE
from onnxfuse.graph.facts import refresh_shapes
from onnxfuse.graph.linear import LINEAR, Linear, match_linear
from onnxfuse.graph import rules
from onnxfuse.graph.patterns import ACTIVATION_RULES
from onnxfuse.graph.rules import Rest, Rule, op
from onnxfuse.graph.writer import NodeWriter
from onnxfuse.ops.stacked_mlp import MAX_BATCH as STACKED_MLP_MAX_BATCH
from onnxfuse.ops.stacked_mlp import OP as STACKED_MLP_OP
from onnxfuse.ops.stacked_mlp import PANEL, pack_panels
from onnxfuse.pipeline import Context, Pass
from onnxfuse.program import op_text

# On the CPU provider (1 thread) the stacked form pays at batch 1, at batch 4 only with small
# branch layers, and not at large batches (bench/results/matmul_batch.md). A dynamic batch may
# be large, so it is not applied then.
CPU_MAX_BRANCH_WEIGHT = 32 * 32
CPU_MAX_BATCH = 4


@dataclass
class Layer:
    kind: str  # "linear" or "activation"
    members: list  # Linear per branch, or the activation node per branch


def _same_act(a: gs.Node, b: gs.Node) -> bool:
    return a.op == b.op and gu.is_default_domain(b) and a.attrs == b.attrs and len(a.inputs) == 1


def _next_layer(graph: gs.Graph, tensors: list[gs.Tensor]) -> Layer | None:
    """The branches' next layer: on each branch a rule matched at the one reader of its tensor
    (match_reader: not a graph output, read by that node alone), the same activation on every
    branch or a linear layer whose weights have one shape and type on every branch."""
    readers = [gu.single_consumer(t) for t in tensors]
    if any(r is None for r in readers) or any(readers[0] is r for r in readers[1:]):
        return None
    acts = [rules.match_reader(ACTIVATION_RULES, graph, t, "y") for t in tensors]
    if acts[0] is not None:
        if all(a is not None and _same_act(readers[0], a[1].root) for a in acts):
            return Layer("activation", readers)
        return None
    members = [rules.match_reader(LINEAR, graph, t, "x") for t in tensors]
    if any(m is None for m in members):
        return None
    members = [m[1]["linear"] for m in members]
    shape = members[0].weight.shape
    if any(m.weight.shape != shape or m.weight.dtype != members[0].weight.dtype for m in members):
        return None
    return Layer("linear", members)


def _output(layer: Layer, k: int) -> gs.Tensor:
    m = layer.members[k]
    return m.output if isinstance(m, Linear) else m.outputs[0]


def _branches(graph: gs.Graph, x: gs.Tensor, first: list[Linear]) -> list[Layer]:
    layers = [Layer("linear", first)]
    while True:
        nxt = _next_layer(graph, [_output(layers[-1], k) for k in range(len(first))])
        if nxt is None:
            return layers
        layers.append(nxt)


def _pays(ctx: Context, x: gs.Tensor, layers: list[Layer]) -> bool:
    linear = [l for l in layers if l.kind == "linear"]
    if len(linear) < 2:
        return False
    if ctx.target.launch_bound:
        return True
    batch = gu.dims(x)[0]
    if not isinstance(batch, int) or batch > CPU_MAX_BATCH:
        return False
    if batch == 1:
        return True
    return all(l.members[0].weight.size <= CPU_MAX_BRANCH_WEIGHT for l in linear)


def _stacked_mlp_pays(x: gs.Tensor, ctx: Context) -> bool:
    """onnxfuse.StackedMLP's CPU kernel against onnxruntime's K prepacked Gemms per layer:
    measured faster up to STACKED_MLP_MAX_BATCH rows at one thread, and at every batch measured
    with two (bench/results/stacked_mlp.md). A symbolic batch is read as declared (optimize
    --dim, a zoo model's defaults) and as 1 otherwise, the value verification uses."""
    batch = gu.dims(x)[0]
    if not isinstance(batch, int):
        batch = ctx.options.dims.get(batch, 1) if isinstance(batch, str) else 1
    return batch <= STACKED_MLP_MAX_BATCH


# The branches' outputs joined along the features, in branch order.
FINAL_CONCAT = Rule("final-concat", op.Concat(Rest("parts"), axis=lambda a: a is not None and int(a) in (1, -1)))


def _final_concat(graph: gs.Graph, outs: list[gs.Tensor]) -> gs.Node | None:
    if any(gu.is_graph_output(graph, t) for t in outs):
        return None  # a member's output is also needed on its own: the Split path produces it
    readers = [gu.single_consumer(t) for t in outs]
    c = readers[0]
    if c is None or any(r is not c for r in readers):
        return None
    found = rules.first_match([FINAL_CONCAT], graph, c)
    if found is None or len(found[1]["parts"]) != len(outs) or any(a is not b for a, b in zip(found[1]["parts"], outs)):
        return None
    return c


STACKED_MLP_ACTIVATIONS = {a.op: a for a in ACTIVATION_TABLE if STACKED_MLP in a.fused_in}


def _stacked_mlp_activations(layers: list[Layer]) -> list[str] | None:
    """One activation per linear layer when the branches fit onnxfuse.StackedMLP (float32, each
    linear layer followed by at most one activation the kernel takes), written as the program
    instruction the kernel runs (`relu`, `leakyrelu[0.01]`, or `none`); else None."""
    acts: list[str] = []
    for layer in layers:
        if layer.kind == "linear":
            if layer.members[0].weight.dtype != np.float32:
                return None
            acts.append("none")
        else:
            a = layer.members[0]
            act = STACKED_MLP_ACTIVATIONS.get(a.op)
            if act is None or set(a.attrs) - {name for name, _ in act.params} or not acts or acts[-1] != "none":
                return None
            acts[-1] = op_text(act.name, act.values(a))
    return acts


def _unpack(w: NodeWriter, packed: gs.Tensor, shape: tuple, base: str) -> gs.Tensor:
    """Standard ops turning the packed weight back into [K, D_in, D_out] (for the fallback body)."""
    k, d_in, d_out = shape
    panels = -(-d_out // PANEL)
    t = w.op("Transpose", packed, name=f"{base}/UnpackTranspose", out=f"{base}_w_t", attrs={"perm": [0, 2, 1, 3]})
    target = w.constant(f"{base}_w_shape", np.array([k, d_in, panels * PANEL], np.int64))
    r = w.op("Reshape", t, target, name=f"{base}/UnpackReshape", out=f"{base}_w_r")
    if panels * PANEL == d_out:
        return r
    starts, ends, axes = (w.constant(f"{base}_w_{what}", np.array([v], np.int64))
                          for what, v in (("starts", 0), ("ends", d_out), ("axes", 2)))
    return w.op("Slice", r, starts, ends, axes, name=f"{base}/UnpackSlice", out=f"{base}_w")


def _rewrite(graph: gs.Graph, x: gs.Tensor, layers: list[Layer], ctx: Context, fused_acts: list[str] | None) -> None:
    """The stacked form (standard ops); with `fused_acts`, all of it but a final Split becomes
    one onnxfuse.StackedMLP node whose fallback function is that stacked form."""
    k_count = len(layers[0].members)
    dtype = layers[0].members[0].weight.dtype
    w = NodeWriter(graph)
    base = w.base(f"{x.name}_ensemble")
    fused_inputs: list[gs.Tensor] = [x]
    cur: gs.Tensor = x
    for i, layer in enumerate(layers):
        if layer.kind == "linear":
            weights = np.stack([m.weight for m in layer.members])  # [K, D_in, D_out]
            if fused_acts is None:
                w_t = w_in = w.constant(f"{base}_l{i}_weight", weights)
            else:  # the kernel's packed layout; the fallback body unpacks it (constant-folded)
                w_t = w.constant(f"{base}_l{i}_weight_panels", pack_panels(weights))
                w_in = _unpack(w, w_t, weights.shape, f"{base}/l{i}")
            cur = w.op("MatMul", cur, w_in, name=f"{base}/l{i}/MatMul", out=f"{base}_l{i}_matmul", dtype=dtype)
            if fused_acts is not None or any(m.bias is not None for m in layer.members):
                n = weights.shape[2]
                # -0 for a member without a bias: x + -0 is x, -0 included (matmul_batch.py)
                b = np.stack([m.bias if m.bias is not None else np.full(n, -0.0, dtype)
                              for m in layer.members])[:, None, :]
                b_t = w.constant(f"{base}_l{i}_bias", b.astype(dtype))
                cur = w.op("Add", cur, b_t, name=f"{base}/l{i}/Add", out=f"{base}_l{i}_add", dtype=dtype)
                fused_inputs += [w_t, b_t]
        else:
            a = layer.members[0]
            cur = w.op(a.op, cur, name=f"{base}/l{i}/{a.op}", out=f"{base}_l{i}_{a.op.lower()}", dtype=dtype,
                       attrs=a.attrs)
    outs = [_output(layers[-1], k) for k in range(k_count)]
    out_width = next(l for l in reversed(layers) if l.kind == "linear").members[0].weight.shape[1]
    concat = _final_concat(graph, outs)
    for layer in layers:
        for m in layer.members:
            for n in (m.nodes if isinstance(m, Linear) else [m]):
                gu.disconnect(n)
    t = w.op("Transpose", cur, name=f"{base}/Transpose", out=f"{base}_bko", dtype=dtype, attrs={"perm": [1, 0, 2]})
    shape = w.constant(f"{base}_shape", np.array([0, k_count * out_width], np.int64))
    split = None
    if concat is not None:
        flat = concat.outputs[0]
        gu.disconnect(concat)
    else:
        # Shape known here: the fused op's output has no shape inference of its own in this
        # pipeline, and the pointwise pass reads the Split pieces in place only with known ranks.
        flat = w.value(f"{base}_flat", dtype, [gu.dims(x)[0], k_count * out_width])
        split = gu.split_node(graph, flat, [out_width] * k_count, outs, name=w.node_name(f"{base}/Split"))
    w.op("Reshape", t, shape, name=f"{base}/Reshape", out=flat)
    if fused_acts is not None:
        if flat.dtype is None:
            flat.dtype = dtype
        ctx.fuse(graph, STACKED_MLP_OP.name, w.nodes, fused_inputs, [flat], {"activations": ",".join(fused_acts)})
    else:
        graph.nodes.extend(w.nodes)
    if split is not None:
        graph.nodes.append(split)


def batch_ensemble(graph: gs.Graph, ctx: Context) -> int:
    if not rules.any_root(graph, LINEAR):
        return 0  # nothing to batch: no shape inference paid
    refresh_shapes(graph)
    rewrites = 0
    for x in list(graph.tensors().values()):
        if isinstance(x, gs.Constant) or len(x.outputs) < 2 or gu.rank(x) != 2:
            continue
        first = [m for m in (match_linear(graph, n, x) for n in list(x.outputs)) if m is not None]
        groups: dict[tuple, list[Linear]] = {}
        for m in first:
            groups.setdefault((m.weight.shape, m.weight.dtype.str), []).append(m)
        for members in groups.values():
            if len(members) < 2 or len({id(m.nodes[0]) for m in members}) != len(members):
                continue
            layers = _branches(graph, x, members)
            explain = ctx.explainer
            if len([l for l in layers if l.kind == "linear"]) < 2:
                if explain is not None:
                    explain(members[0].nodes[0], f"the {len(members)} branches on '{x.name}' do not continue in lockstep"
                                                 " (same ops, weights of one shape, read by their branch alone)"
                                                 " to a second linear layer")
                continue
            fused_acts = _stacked_mlp_activations(layers) if ctx.target.has_kernel(STACKED_MLP_OP.name) else None
            if fused_acts is not None and (ctx.options.stacked_mlp == "always" or _stacked_mlp_pays(x, ctx)):
                _rewrite(graph, x, layers, ctx, fused_acts)
                rewrites += 1
            elif _pays(ctx, x, layers):
                _rewrite(graph, x, layers, ctx, None)
                rewrites += 1
            elif explain is not None:
                explain(members[0].nodes[0], f"the stacked form does not pay on {ctx.target.name} at batch"
                                             f" {gu.dims(x)[0]} (see CPU_MAX_BATCH, CPU_MAX_BRANCH_WEIGHT)")
    return rewrites


PASS = Pass(
    "batch-ensemble",
    405,
    "identical branches on one input as stacked [K, B, D] layers with one batched MatMul each",
    batch_ensemble,
)
