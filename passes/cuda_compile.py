"""cuda-compile: the compiled CUDA kernel of every fused node, stored with the node (--target cuda).

    match:     onnxfuse.Pointwise nodes; onnxfuse.Attention nodes whose head sizes are known
               (onnxfuse/cuda/attention_codegen.py); onnxfuse.ChannelShuffle nodes whose inputs'
               channel counts are known (onnxfuse/cuda/shuffle_codegen.py); onnxfuse.SqueezeExcite
               nodes whose weight shapes are known (onnxfuse/cuda/squeeze_excite_codegen.py); other
               onnxfuse nodes that carry a generated kernel (cuda_source + cuda_entry) but no cubin
    condition: --target cuda; runs after every fusion pass (order 900); an Attention node gets a
               kernel only when every attribute it carries is one the generator implements
               (attention_codegen.NODE_ATTRIBUTES) and it is not in the CPU-only causal mode;
               a heads_first operand [B, H, S, d] or heads_merged one [B*H, S, d] gives its head
               size by its last dim
    rewrite:   attributes read by the CUDA-EP kernels (kernels/cuda_launch.h):
                 cuda_entry  the kernel's extern "C" name
                 cuda_arch   the cubin's architecture (--arch, default sm_90)
                 cuda_cubin  the cubin's bytes
                 cuda_ptx    PTX for the matching virtual architecture (portable fallback)
               and, for Pointwise, the launch constants cuda_rank, cuda_vec, cuda_block; for
               Attention cuda_abi, cuda_block, cuda_rows, cuda_dh, cuda_dv; for ChannelShuffle
               cuda_abi, cuda_block, cuda_channels; for SqueezeExcite cuda_abi, cuda_block, cuda_c,
               cuda_r.
               The CPU kernel ignores them. Identical programs share one compile (cached in
               memory and under ~/.cache/onnxfuse/cuda).

The rewrite count is the number of nodes that received a kernel.
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxfuse.graph import facts
from onnxfuse.cuda import attention_codegen, codegen, shuffle_codegen, squeeze_excite_codegen
from onnxfuse.cuda.compile import DEFAULT_ARCH, compile_many
from onnxfuse import fused
from onnxfuse.fused import DOMAIN
from onnxfuse.ops import attention, channel_shuffle, pointwise, squeeze_excite
from onnxfuse.pipeline import Context, Pass
from onnxfuse.program import Program

# Iteration rank for kernels whose inputs' ranks are unknown (the host pads shorter shapes).
FALLBACK_RANK = 6


def iteration_rank(node: gs.Node) -> int:
    """The largest input rank: the iteration space (broadcast of the viewed inputs) has no more."""
    ranks = []
    for t in node.inputs:
        if t.shape is None:
            return FALLBACK_RANK
        ranks.append(len(t.shape))
    return max([1, *ranks])


def _static_last_dim(t: gs.Tensor, shapes: facts.ShapeTable | None) -> int | None:
    shape = shapes.dims(t) if shapes is not None else t.shape
    if not shape or not isinstance(shape[-1], int) or isinstance(shape[-1], bool) or shape[-1] < 1:
        return None
    return shape[-1]


def attention_spec(node: gs.Node, shapes: facts.ShapeTable | None = None) -> attention_codegen.AttentionSpec | None:
    """The kernel an onnxfuse.Attention node needs, or None when its head sizes are not known
    statically (from the tensors' recorded shapes, or `shapes` when given) or exceed what the
    kernel supports."""
    heads = int(node.attrs.get("num_heads", 0))
    packed = bool(int(node.attrs.get("qkv_packed", 0)))
    has_mask = bool(int(node.attrs.get("has_mask", 0)))
    has_bias = bool(int(node.attrs.get("has_bias", 0)))
    nan_to_zero = bool(int(node.attrs.get("nan_to_zero", 0)))
    first_bits = int(node.attrs.get("heads_first", 0))
    merged_bits = int(node.attrs.get("heads_merged", 0))
    mask_merged = bool(int(node.attrs.get("mask_merged_heads", 0)))
    fill_mode = int(node.attrs.get("fill_mode", 0))
    if heads < 1 or not node.inputs or not 0 <= first_bits <= 7 or (first_bits and packed):
        return None
    if not 0 <= merged_bits <= 7 or (merged_bits and packed) or merged_bits & first_bits or fill_mode not in (0, 1, 2):
        return None
    if mask_merged and not has_mask:
        return None
    layout_bits = first_bits | merged_bits  # operands whose last dim is d: [B, H, S, d] or [B*H, S, d]
    if int(node.attrs.get("causal", 0)):
        return None  # fuse-attention's CPU-only causal mode: the generated kernel has none
    if any(not a.startswith("cuda_") and a not in attention_codegen.NODE_ATTRIBUTES and a != fused.OPSET_ATTRIBUTE
           for a in node.attrs):
        return None  # an attribute the generator does not implement: no kernel rather than a wrong one
    first = _static_last_dim(node.inputs[0], shapes)
    if first is None:
        return None
    if packed:
        if first % (3 * heads):
            return None
        dh = dv = first // (3 * heads)
    else:
        if len(node.inputs) < 3:
            return None
        vdim = _static_last_dim(node.inputs[2], shapes)
        if vdim is None:
            return None
        # [B, S, H*d], or [B, H, S, d] (last dim d) where the operand's heads_first bit is set
        (dh, q_split), (dv, v_split) = ((d, False) if layout_bits >> bit & 1 else (d // heads, d % heads != 0)
                                        for d, bit in ((first, 0), (vdim, 2)))
        if q_split or v_split:
            return None
    if not attention_codegen.supported(dh, dv):
        return None
    if has_bias and not packed:
        return None
    return attention_codegen.AttentionSpec(heads, dh, dv, float(node.attrs.get("scale", 1.0)), packed, has_mask,
                                           has_bias, nan_to_zero, first_bits, merged_bits, mask_merged, fill_mode,
                                           float(node.attrs.get("fill_value", 0.0)) if fill_mode else 0.0)


def shuffle_spec(node: gs.Node, shapes: facts.ShapeTable) -> shuffle_codegen.ShuffleSpec | None:
    """The kernel an onnxfuse.ChannelShuffle node needs, or None when an input's channel count is
    not known statically or the counts do not divide into the node's groups and outputs."""
    channels = []
    for t in node.inputs:
        dims = shapes.dims(t)
        if dims is None or len(dims) != 4 or not isinstance(dims[1], int) or isinstance(dims[1], bool) or dims[1] < 1:
            return None
        channels.append(dims[1])
    groups = int(node.attrs.get("groups", 0))
    total = sum(channels)
    if not channels or groups < 1 or not node.outputs or total % groups or total % len(node.outputs):
        return None
    return shuffle_codegen.ShuffleSpec(tuple(channels), groups, len(node.outputs))


# Fused ops whose kernel is generated from a spec read off the node and the graph's shapes:
# (the spec, None when the node cannot get a kernel; the generator).
SPEC_KERNELS = {
    attention.OP.name: (attention_spec, attention_codegen.generate),
    channel_shuffle.OP.name: (shuffle_spec, shuffle_codegen.generate),
    squeeze_excite.OP.name: (squeeze_excite_codegen.spec_of_node, squeeze_excite_codegen.generate),
}


def run(graph: gs.Graph, ctx: Context) -> int:
    if not ctx.target.compiles_kernels:
        return 0
    arch = ctx.target.arch or DEFAULT_ARCH
    jobs: list[tuple[gs.Node, str, str, dict]] = []
    shapes = None  # built for the first node of SPEC_KERNELS: shape inference costs time
    for node in graph.nodes:
        if node.domain != DOMAIN:
            continue
        if node.op == pointwise.OP.name:
            kernel = codegen.generate(Program.parse(node.attrs["program"]), iteration_rank(node))
            launch = {"cuda_rank": kernel.rank, "cuda_vec": kernel.vec, "cuda_block": kernel.block}
            jobs.append((node, kernel.source, kernel.entry, launch))
        elif node.op in SPEC_KERNELS:
            if shapes is None:
                shapes = facts.ShapeTable(graph)
            spec_of, generate = SPEC_KERNELS[node.op]
            spec = spec_of(node, shapes)
            if spec is None:
                continue  # no kernel: the CUDA kernel reports it when a session runs the node
            kernel = generate(spec)
            jobs.append((node, kernel.source, kernel.entry, kernel.attrs()))
        elif "cuda_source" in node.attrs and "cuda_entry" in node.attrs and "cuda_cubin" not in node.attrs:
            jobs.append((node, str(node.attrs["cuda_source"]), str(node.attrs["cuda_entry"]), {}))
    if not jobs:
        return 0
    compiled = compile_many([(source, entry) for _, source, entry, _ in jobs], arch=arch)
    for (node, _, entry, launch), ck in zip(jobs, compiled):
        node.attrs["cuda_entry"] = entry
        node.attrs["cuda_arch"] = ck.arch
        node.attrs["cuda_cubin"] = ck.cubin
        node.attrs["cuda_ptx"] = ck.ptx
        node.attrs.update(launch)
    return len(jobs)


PASS = Pass(
    name="cuda-compile",
    order=900,
    summary="compile each fused node's CUDA kernel (cubin for --arch + PTX) and store it with the node",
    run=run,
    targets=("cuda",),
)
