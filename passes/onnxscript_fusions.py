"""onnxscript's optimizer and onnxruntime transformer fusions as one stage of the pipeline.

onnxscript-fusions
    what:      the graph as it stands goes through onnxscript's optimizer (constant and shape
               folding, common subexpressions, dead code) and `onnxscript.rewriter.ort_fusions`
               (`optimize_for_ort`), whose rules write onnxruntime's contrib ops (domain
               com.microsoft) for the transformer forms both torch.onnx exporters write:
               MultiHeadAttention / Attention (scaled dot-product attention with its masks,
               q*sqrt(s) @ kT*sqrt(s), the dynamo exporter's 3-D key transpose, the NaN-to-zero
               Where after Softmax), RotaryEmbedding, SimplifiedLayerNormalization, Gelu,
               FastGelu, BiasGelu, FusedMatMul. Its residual + normalization rules
               (SkipLayerNormalization, SkipSimplifiedLayerNormalization) are left out: that
               CPU kernel is slower than the pointwise pass's region + LayerNormalization.
    condition: the result runs as fewer kernels: the graph onnxruntime executes for it (CPU
               provider, ORT_ENABLE_ALL, our library registered) has fewer nodes than the one it
               executes for the graph before the stage. Otherwise the graph is left as it was,
               so the stage never costs a fusion onnxruntime would have made, and optimizing an
               optimized model changes nothing (the second time there is nothing left to gain).
               Nodes onnxfuse fused on an earlier run, and graphs the stage cannot read (no
               onnxscript, a rule that fails), are left alone.
    rewrite:   the graph is replaced by the stage's result. Contrib ops carry no fallback
               function: onnxruntime ships their kernels, so the output needs onnxruntime
               wherever the stage wrote one (docs/internals.md says which ops). The passes after it
               fuse what remains (pointwise regions, views) and read contrib ops as opaque nodes.
    cuda:      with the pass option attention_cuda only, and only the attention groups (after
               prepare): MultiHeadAttention and Attention, which onnxruntime's CUDA provider runs
               in float32 (onnxfuse/cuda/audit.py, CUDA_CONTRIB_FLOAT32). The grouped-query rules
               are left out there: GroupQueryAttention's CUDA kernel takes float16 and bfloat16
               only, so a float32 LLaMA-style decoder keeps its attention chain on cuda. The
               normalization, rotary, GELU and MatMul groups stay cpu-only (their kernels were
               chosen against the CPU provider's). Which groups pay is still decided by the CPU
               provider's executed graph: no session on a GPU is opened while optimizing.

Why: onnxscript's rules already know the forms real exports take (docs/internals.md "How it works";
figures per model in bench/results/onnxscript_fusions.md); onnxruntime's contrib kernels for
attention, rotary embeddings and residual + normalization run each as one kernel on the CPU.
The stage is a dependency rather than a copy of those rules, and onnxfuse's own passes run
after it on what it leaves.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import rules
from onnxfuse.graph.rules import ANY, op
from onnxfuse.graph.onnxscript_matching import linear_matching
from onnxfuse.pipeline import Context, Pass
from onnxfuse.target import CPU, Target

CONTRIB_DOMAIN = "com.microsoft"


def _executed_nodes(model: onnx.ModelProto, executed_graph) -> int | None:
    """Nodes of the graph onnxruntime executes for `model` (CPU, ORT_ENABLE_ALL, one thread:
    the context's executed_graph); None when onnxruntime cannot load it."""
    try:
        return len(executed_graph(model).graph.node)
    except Exception:  # noqa: BLE001 - onnxruntime raises its own types
        return None


def _as_model(graph: gs.Graph) -> onnx.ModelProto:
    from onnxfuse.fused import DOMAIN, DOMAIN_VERSION

    model, _ = gu.export_model(graph)
    model.ir_version = min(model.ir_version, 10)
    domains = {o.domain for o in model.opset_import}
    if DOMAIN not in domains and any(n.domain == DOMAIN for n in model.graph.node):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model


ATTENTION_OPS = ("MultiHeadAttention", "Attention", "GroupQueryAttention")


def _nan_guards(m) -> int:
    """Softmax -> IsNaN -> Where(isnan, 0, p) chains: torch's scaled_dot_product_attention
    decomposition gives a row whose keys are all masked probabilities 0 (output 0) instead of
    Softmax's NaN."""
    count = 0
    for node in m.graph:
        if node.op_type == "IsNaN" and node.domain == "" and node.inputs[0] is not None:
            src = node.inputs[0].producer()
            if src is not None and src.op_type == "Softmax":
                count += 1
    return count


def _attention_output_shape(node):
    """[B, S, v_hidden] of an attention op whose query is [B, S, D] and whose value (or packed
    weights, for Attention) fixes v_hidden; None when not known. The pointwise pass needs the
    guard's shape to make it one region."""
    import onnx_ir as ir

    q = node.inputs[0]
    if q is None or q.shape is None or len(q.shape) != 3:
        return None
    if node.op_type == "MultiHeadAttention" and len(node.inputs) > 2 and node.inputs[2] is not None:
        v = node.inputs[2]
        if v.shape is not None and len(v.shape) == 3 and isinstance(v.shape[2], int):
            return ir.Shape([q.shape[0], q.shape[1], v.shape[2]])
        return None
    if node.op_type == "Attention" and len(node.inputs) > 1 and node.inputs[1] is not None:
        w = node.inputs[1]  # packed projection weights [D_in, q + k + v hidden]
        sizes = node.attributes.get("qkv_hidden_sizes")
        if sizes is not None:
            return ir.Shape([q.shape[0], q.shape[1], int(list(sizes.as_ints())[-1])])
        if w.shape is not None and len(w.shape) == 2 and isinstance(w.shape[1], int) and w.shape[1] % 3 == 0:
            return ir.Shape([q.shape[0], q.shape[1], w.shape[1] // 3])
    return None


def _nan_rows_kept(run):
    """The attention rules drop the NaN-to-zero Where: onnxruntime's attention kernels give a
    fully masked row NaN, where the exported graph gives 0 (an all-padding sequence). When the
    rules removed such Wheres, each new attention op's output gets Where(IsNaN(o), 0, o) (one
    Pointwise kernel after the pointwise pass), so those rows are 0 again. A NaN or infinite
    value of v, which the original spreads through its MatMul, then reads 0 as well."""
    def guarded(m):
        import onnx_ir as ir

        had = _nan_guards(m)
        before = {id(n) for n in m.graph}
        done = run(m)
        if not done or _nan_guards(m) >= had:
            return done
        zero = None
        for node in list(m.graph):
            if id(node) in before or node.domain != "com.microsoft" or node.op_type not in ATTENTION_OPS:
                continue
            out = node.outputs[0]
            if zero is None:
                zero = ir.Value(name=f"{out.name}_nan_zero", const_value=ir.tensor(np.array(0.0, np.float32)))
                m.graph.register_initializer(zero)
            if out.shape is None:
                out.shape = _attention_output_shape(node)
            if out.dtype is None:
                out.dtype = node.inputs[0].dtype
            users = list(out.uses())
            isnan = ir.node("IsNaN", [out], name=f"{node.name}_nan")
            isnan.outputs[0].name = f"{out.name}_nan"
            isnan.outputs[0].shape, isnan.outputs[0].dtype = out.shape, ir.DataType.BOOL
            where = ir.node("Where", [isnan.outputs[0], zero, out], name=f"{node.name}_nan_to_zero")
            where.outputs[0].name = f"{out.name}_nan_to_zero"
            where.outputs[0].shape, where.outputs[0].dtype = out.shape, out.dtype
            m.graph.insert_after(node, [isnan, where])
            for use in users:
                use.node.replace_input_with(use.idx, where.outputs[0])
            if out.is_graph_output():
                raise ValueError("attention output is a graph output")  # keeps the group undone
        return done
    return guarded


def _torchscript_forms(m) -> int:
    """What the TorchScript exporter writes differently from the forms onnxscript's attention
    rules know: one-element constants where they expect scalars, and an identity Reshape between
    the attention's MatMul and its head merge. Rewritten only in the group that then runs the
    attention rules: when those do not match, the group does not pay and is undone."""
    return _scalar_constants(m) + _identity_reshapes(m)


def _scalar_constants(m) -> int:
    """The TorchScript exporter writes the NaN-to-zero Where's 0 and the q/k scales as
    one-element 1-D constants, where onnxscript's attention rules expect scalars: a [1] constant
    read by Where(IsNaN(..), c, ..) or by Mul with a 4-D operand becomes the scalar of its value
    (the other operand has rank >= 1, so broadcasting gives the same shape)."""
    import onnx_ir as ir

    count = 0
    for node in list(m.graph):
        if node.domain != "" or node.op_type not in ("Where", "Mul"):
            continue
        if node.op_type == "Where":
            cond = node.inputs[0].producer() if node.inputs[0] is not None else None
            slots = [1] if cond is not None and cond.op_type == "IsNaN" else []
        else:
            slots = [i for i in (0, 1) if node.inputs[1 - i] is not None and node.inputs[1 - i].shape is not None
                     and len(node.inputs[1 - i].shape) == 4]
        for i in slots:
            v = node.inputs[i]
            value = v.const_value if v is not None else None
            if value is None or tuple(value.shape) != (1,):
                continue
            scalar = ir.Value(name=f"{v.name}_scalar", const_value=ir.tensor(value.numpy().reshape(())))
            if scalar.name not in m.graph.initializers:
                m.graph.register_initializer(scalar)
            else:
                scalar = m.graph.initializers[scalar.name]
            node.replace_input_with(i, scalar)
            count += 1
    return count


def _identity_reshapes(m) -> int:
    """A Reshape whose input and output have one static shape (the TorchScript exporter's
    `view` of the attention output to [B, H, S, dv] it already has) is dropped: onnxscript's
    MultiHeadAttention rules expect the Transpose right after the MatMul."""
    count = 0
    for node in list(m.graph):
        if node.op_type != "Reshape" or node.domain != "" or node.inputs[0] is None:
            continue
        x, y = node.inputs[0], node.outputs[0]
        if x.shape is None or y.shape is None or not x.shape.is_static() or not y.shape.is_static():
            continue
        if list(x.shape) != list(y.shape) or y.is_graph_output():
            continue
        y.replace_all_uses_with(x)
        m.graph.remove(node, safe=True)
        count += 1
    return count


def _constant_rotary_caches(m) -> int:
    """onnxscript's rotary rule matches x * cos + rotate_half(x) * sin and leaves an
    intermediate RotaryEmbedding(x, cos, sin) for its cos/sin-cache rule, which wants cos and
    sin computed from position ids. In a static-shape export the optimizer has already folded
    them into constants [1, .., 1, S, d] (positions 0 .. S-1). When each is its first half
    repeated (the rotate-half layout), the op becomes onnxruntime's RotaryEmbedding on x
    [B, H, S, d] with position_ids [0] (positions 0 .. S-1) and caches cos[:, :d/2],
    sin[:, :d/2]: the same products and sums."""
    import onnx_ir as ir

    count = 0
    for node in list(m.graph):
        if node.domain != "ai.onnxruntime._fusion" or node.op_type != "RotaryEmbedding" or len(node.inputs) != 3:
            continue
        x, cos, sin = node.inputs
        shape = x.shape
        if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[2:]):
            continue
        seq, width = shape[2], shape[3]
        caches = []
        for v in (cos, sin):
            value = v.const_value if v is not None else None
            if value is None:
                break
            a = value.numpy()
            if a.dtype != np.float32 or a.ndim < 2 or a.shape[-2:] != (seq, width) or a.size != seq * width:
                break
            a = a.reshape(seq, width)
            half = width // 2
            if width % 2 or not np.array_equal(a[:, :half], a[:, half:]):
                break
            caches.append(np.ascontiguousarray(a[:, :half]))
        if len(caches) != 2:
            continue
        values = []
        for name, arr in (("position", np.zeros(1, np.int64)), ("cos_cache", caches[0]), ("sin_cache", caches[1])):
            value = ir.Value(name=f"{node.name}_{name}", const_value=ir.tensor(arr))
            m.graph.register_initializer(value)
            values.append(value)
        rotary = ir.node("RotaryEmbedding", [x, *values], domain="com.microsoft", name=f"{node.name}_ort",
                         attributes={"interleaved": 0, "num_heads": int(shape[1])})
        rotary.outputs[0].name = f"{node.outputs[0].name}_ort"
        rotary.outputs[0].shape = x.shape  # the attention rules check shapes
        rotary.outputs[0].dtype = x.dtype
        m.graph.insert_before(node, rotary)
        node.outputs[0].replace_all_uses_with(rotary.outputs[0])
        m.graph.remove(node, safe=True)
        count += 1
    return count


# The groups the stage runs on --target cuda (with attention_cuda): prepare and the attention rules.
CUDA_GROUPS = ("prepare", "attention", "attention, TorchScript forms")


def _groups(target: Target = CPU):
    """onnxscript's transformer fusions (the steps of ort_fusions.optimize_for_ort, in its
    order) as groups that each leave a model onnxruntime can load: a group's intermediate ops
    (the SDPA function the attention rules build on) are inlined again by the optimizer that
    closes it. Each group lists variants, tried in order: onnxscript 0.7's MultiHeadAttention
    rules (mha1/mha2) write a Gemm reading a 3-D tensor on the dynamo export of GPT-2, which
    onnxruntime refuses; without them the attention is still written as MultiHeadAttention by
    sdpa_via_mha. On cuda, the groups of CUDA_GROUPS alone, without the grouped-query rules.
    Returns None when onnxscript is not installed."""
    try:
        import onnx_ir.passes.common as common_passes
        from onnxscript import optimizer
        from onnxscript.rewriter import pattern, rewrite
        from onnxscript.rewriter.ort_fusions import (
            ORT_PATTERN_REWRITE_RULES,
            attention,
            bias_gelu,
            cos_sin_cache,
            erfgelu,
            gelu,
            gqa,
            gqa_packed_qkv,
            mha,
            mha_bias,
            mha_scale,
            rms_normalization,
            rotary_embedding,
            sdpa,
            sdpa_via_mha,
            shape_optimization,
            skip_normalization,
        )
        from onnxscript.rewriter.rules.common import _gemm_to_matmul_add
    except ImportError:
        return None

    def prepare(m):
        rewrite(m, [_gemm_to_matmul_add.gemm_to_matmul_add_rule])
        common_passes.ShapeInferencePass()(m)
        optimizer.optimize(m)
        shape_optimization.rules.apply_to_model(m)
        optimizer.optimize(m)
        return 1

    def steps(*fns):
        def run(m):
            done = 0
            for fn in fns:
                done += int(fn(m) or 0)
            if done:
                optimizer.optimize(m)
            return done
        return run

    def cse(m):
        common_passes.CommonSubexpressionEliminationPass()(m)
        return 0

    sdpa_step = lambda m: sdpa.fuse_sdpa(m, apply_shape_inference=True)  # noqa: E731

    def ort_rules(m):
        return pattern.RewriteRuleSet(ORT_PATTERN_REWRITE_RULES).apply_to_model(m)

    # GroupQueryAttention's CUDA kernel takes float16 / bfloat16 only: no such rule on cuda.
    gqa_rules = (gqa.fuse_gqa, gqa_packed_qkv.fuse_qkv_gqa) if target.float32_group_query_attention else ()
    groups = [
        ("prepare", [prepare]),
        # No residual + normalization rules: onnxruntime's SkipLayerNormalization CPU kernel takes
        # 2-4x the time of the pointwise pass's region plus LayerNormalization
        # (bench/results/skip_layernorm.md), which the pipeline writes instead.
        ("normalization", [steps(erfgelu.fuse_erfgelu, rms_normalization.fuse_rms_normalization)]),
        ("rotary", [steps(rotary_embedding.fuse_rotary_embedding, cos_sin_cache.fuse_cos_sin_cache,
                          _constant_rotary_caches, cse, rotary_embedding.fuse_partial_rotary_embedding)]),
        ("attention", [
            _nan_rows_kept(steps(sdpa_step, *gqa_rules, mha.fuse_mha1,
                                 mha.fuse_mha2, mha_scale.fuse_mha_scale, mha_bias.fuse_mha_bias,
                                 attention.fuse_attention, sdpa_via_mha.replace_sdpa_by_mha)),
            _nan_rows_kept(steps(sdpa_step, *gqa_rules, sdpa_via_mha.replace_sdpa_by_mha)),
            _nan_rows_kept(steps(sdpa_step, sdpa_via_mha.replace_sdpa_by_mha)),
        ]),
        # The TorchScript exporter's constants and views in the form the rules know, then the rules again.
        ("attention, TorchScript forms", [
            _nan_rows_kept(steps(_torchscript_forms, sdpa_step, *gqa_rules,
                                 mha.fuse_mha1, mha.fuse_mha2, mha_scale.fuse_mha_scale, mha_bias.fuse_mha_bias,
                                 attention.fuse_attention, sdpa_via_mha.replace_sdpa_by_mha)),
            _nan_rows_kept(steps(_torchscript_forms, sdpa_step, *gqa_rules, sdpa_via_mha.replace_sdpa_by_mha)),
        ]),
        ("gelu", [steps(gelu.fuse_gelu, bias_gelu.fuse_bias_gelu)]),
        ("matmul", [ort_rules]),
    ]
    return groups if target.measured else [g for g in groups if g[0] in CUDA_GROUPS]


class _PreparedRejected(Exception):
    """The prepared graph runs more kernels than the stage's input: the groups start over from
    the input."""


_NO_MATCH = object()


def _attempt(variant, start: onnx.ModelProto):
    """A group variant on a fresh copy of `start`: (its model, rewrites), _NO_MATCH when it
    rewrote nothing, None when it failed or lost a weight held by reference."""
    import onnx_ir as ir

    from onnxfuse.weights import all_tensors, region_of

    try:
        # A fresh copy: onnx_ir wraps the proto's tensors, and its passes can edit them.
        m = ir.from_proto(onnx.ModelProto.FromString(start.SerializeToString()))
        done = variant(m)
        if not done:
            return _NO_MATCH
        out = ir.to_proto(m)
        if any(t.data_location == onnx.TensorProto.EXTERNAL and region_of(t) is None for t in all_tensors(out)):
            return None  # a weight held by reference that lost its file: not taken
    except Exception:  # noqa: BLE001 - a rule failing on an unusual graph leaves it as it was
        return None
    out.ir_version = min(out.ir_version, start.ir_version)
    return out, done


def _run_groups(start: onnx.ModelProto, groups, nodes_of, settle=None):
    """(best model, rewrites, names of the groups kept) of `groups` run in turn from `start`,
    or None when onnxruntime cannot load `start`. A variant that fails is followed by the
    next; a group is kept when onnxruntime executes fewer nodes for its result than for the
    model before it. settle() is called before the first result is counted."""
    best, total, kept = start, 0, []
    for name, variants in groups:
        for variant in variants:
            result = _attempt(variant, best)
            if result is None:
                continue
            if result is _NO_MATCH:
                break
            if settle is not None:
                settle()
                settle = None
            best_nodes = nodes_of(best)
            if best_nodes is None:
                return None
            out, done = result
            nodes = nodes_of(out)
            if nodes is None:
                continue
            if nodes < best_nodes:
                kept.append(name)
                best, total = out, total + done
            break
    return best, total, kept


def _ort_fused(model: onnx.ModelProto, executed_graph,
               target: Target = CPU) -> tuple[onnx.ModelProto, int, list[str]] | None:
    """(the model through onnxscript's groups of fusions, rewrites kept, names of the groups
    kept), or None when onnxscript is missing or onnxruntime cannot load the model. The groups
    run on the prepared graph (the prepare group); a group is kept when onnxruntime loads its
    result and executes fewer nodes for it than for the model before it; a group that fails or
    does not pay is undone, and the next starts from the model before it. onnxruntime is asked
    only once some group rewrites: about the stage's input, the prepared graph and each result.
    The prepared graph stands when it executes no more nodes than the input; otherwise the
    groups start over from the input. (When no group rewrites the prepared graph, the stage
    leaves the graph as it was without asking onnxruntime.)"""
    groups = _groups(target)
    if groups is None:
        return None
    counts: dict[int, tuple[onnx.ModelProto, int | None]] = {}

    def nodes_of(m: onnx.ModelProto) -> int | None:
        if id(m) not in counts:
            counts[id(m)] = (m, _executed_nodes(m, executed_graph))
        return counts[id(m)][1]

    prepare = [variants for name, variants in groups if name == "prepare"]
    rest = [g for g in groups if g[0] != "prepare"]
    prepared = None
    for variant in prepare[0] if prepare else ():
        result = _attempt(variant, model)
        if result is None:
            continue
        if result is not _NO_MATCH:
            prepared, prepared_done = result
        break
    if prepared is None:
        return _run_groups(model, rest, nodes_of)

    def settle():
        base = nodes_of(model)
        nodes = nodes_of(prepared) if base is not None else None
        if nodes is None or nodes > base:
            raise _PreparedRejected

    try:
        fused = _run_groups(prepared, rest, nodes_of, settle)
    except _PreparedRejected:
        return _run_groups(model, rest, nodes_of)
    if fused is None:
        return None
    best, total, kept = fused  # kept: settle() found the input and the prepared graph loaded
    return (best, total + prepared_done, kept) if kept else (model, 0, [])


def _replace(graph: gs.Graph, model: onnx.ModelProto) -> None:
    from onnxfuse.weights import attach_graph

    new = gs.import_onnx(model)
    attach_graph(new)  # weights held by reference stay so
    graph.nodes = new.nodes
    graph.inputs = new.inputs
    graph.outputs = new.outputs
    graph.import_domains = new.import_domains
    # Shapes inferred for the graph before the stage no longer describe it.
    graph.__dict__.pop("_onnxfuse_inferred_dims", None)


# A Softmax of scores: its input reaches a MatMul through at most three Add, Mul, Div or Where
# nodes (scale, mask), at any of their operands.
ATTENTION_SOFTMAX = rules.Rule("attention-softmax", op.Softmax(
    rules.through(["Add", "Mul", "Div", "Where"], op.MatMul(ANY, ANY), 3, operand=(0, 1, 2))), private=False)


def _may_match(graph: gs.Graph, target: Target = CPU) -> bool:
    """Whether the graph holds a form the stage's rules rewrite: attention (a Softmax of
    MatMul scores), a normalization (LayerNormalization, or ReduceMean with Sqrt), a GELU (Erf,
    or Tanh with Pow), a rotary embedding (Neg, Concat and Slice). A graph without (a CNN, an
    unrolled LSTM) skips the stage without paying for onnxscript or a session."""
    nodes = [n for n in graph.nodes if gu.is_default_domain(n)]
    ops = {n.op for n in nodes}
    if not ops & {"MatMul", "Gemm"}:
        return False
    attention = any(n.op == "Softmax" and ATTENTION_SOFTMAX.match(None, n, frozenset()) is not None for n in nodes)
    if not target.measured:
        return attention  # the attention groups alone run there
    return (attention or "LayerNormalization" in ops or {"ReduceMean", "Sqrt"} <= ops or "Erf" in ops
            or {"Tanh", "Pow"} <= ops or {"Neg", "Concat", "Slice"} <= ops)


def onnxscript_fusions(graph: gs.Graph, ctx: Context) -> int:
    if not ctx.options.onnxscript_fusions or ctx.executed_graph is None:
        return 0
    if not ctx.target.measured and not ctx.options.attention_cuda:
        return 0  # the attention groups are the stage's only part on cuda: opt-in as fuse-attention is
    if ctx.target.compiles_kernels and any("cuda_cubin" in n.attrs for n in graph.nodes):
        # A later round (or an optimized model): the stage ran before cuda-compile stored these
        # kernels, and onnx_ir would read their bytes as text.
        return 0
    if not _may_match(graph, ctx.target):
        return 0
    before = _as_model(graph)
    from onnxfuse.weights import all_tensors, is_inline_origin, region_of

    if any(r is not None and not is_inline_origin(r) for r in map(region_of, all_tensors(before))):
        # External data files: onnx_ir writes some of their tensors back without a location
        # (tests/test_large_models.py); left to the passes after, as before.
        return 0
    with linear_matching():
        fused = _ort_fused(before, ctx.executed_graph, ctx.target)
    if fused is None:
        return 0
    after, rewrites, kept = fused
    if not kept:
        return 0
    _replace(graph, after)
    return max(1, rewrites)


PASS = Pass(
    "onnxscript-fusions",
    150,
    "onnxscript's optimizer + ort_fusions (contrib ops: attention, rotary, skip/RMS norm, GELU) where onnxruntime then runs fewer kernels",
    onnxscript_fusions,
    targets=("cpu", "cuda"),
)
