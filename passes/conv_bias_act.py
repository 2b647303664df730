"""Conv + bias + activation (+ residual Add, + Relu) -> one onnxfuse.ConvBiasAct node (--target cuda).

Matches a 2-D float32 Conv (any stride, padding, dilation and groups, depthwise included) whose
output feeds, each step optional but at least one present:

    activation   Relu, LeakyRelu, Clip (ReLU6), Sigmoid, HardSigmoid, HardSwish, Tanh,
                 SiLU written as x * Sigmoid(x), hard-swish written as x * HardSigmoid(x)
                 or as x * Clip(x + 3, 0, 6) / 6
    residual     Add (or a two-input Sum) with a tensor of the Conv output's shape
    Relu         after the residual

BatchNormalization and per-channel Mul/Add constants were already folded into the Conv's
weights and bias by fold-batchnorm (order 300), so the fused node's fallback body -- exactly the
replaced subgraph -- is the folded Conv and its activation chain. A Conv without a bias gets a
zero bias first, so the node always reads (X, W, B[, Z]).

The node carries the layer's generated CUDA kernel (onnxfuse/cuda/conv_codegen.py): the source,
its entry and the launch rule; the cuda-compile pass (order 900) adds cubin and PTX for --arch,
and kernels/cuda_conv.cc launches it on the CUDA execution provider. Tiles come from the documented
heuristic, or from timing the candidates on the GPU when ctx.options.tune is set and one is
present.

Target policy on cuda (never slower): a layer is fused only where our kernel beat cuDNN in the
per-layer measurements (pays_on_cuda below); the others stay plain Convs, which onnxruntime fuses
with their activation itself.

Target policy (measured, bench/results/conv_cpu.md): on --target cpu this pass does nothing.
onnxruntime's CPU provider already fuses the folded Conv with Relu/Clip/LeakyRelu/Sigmoid/Tanh/
HardSigmoid (FusedConv, and NCHWc Conv with the residual Add and Relu) on MLAS kernels; we have no
CPU convolution that beats MLAS, and a ConvBiasAct node without a CPU kernel would only run its
fallback body, which onnxruntime then fuses into exactly what it would have produced from the
original. So on cpu the Conv work is fold-batchnorm's, and the fused op exists only for cuda.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph.activations import BY_OP, CONV, ops_fused_in
from onnxfuse.graph import rules
from onnxfuse.graph.rules import ANY, Match, OpPattern, Rest, Rule, Var, match_after, op
from onnxfuse.graph import facts
from onnxfuse.cuda.conv_codegen import Kernel, generate
from onnxfuse.cuda.conv_plan import ConvShape, Epilogue, clusters_supported, heuristic_tile, tensor_cores_supported
from onnxfuse.cuda.conv_tune import tune
from onnxfuse.ops.conv_bias_act import OP, pays_on_cuda
from onnxfuse.pipeline import Context, fused_op_pass

FLOAT = np.dtype(np.float32)


@dataclass
class ConvMatch:
    conv: gs.Node
    shape: ConvShape
    nodes: list[gs.Node] = field(default_factory=list)  # the replaced subgraph, in order
    epilogue: Epilogue = field(default_factory=Epilogue)
    residual: gs.Tensor | None = None
    output: gs.Tensor | None = None


def conv_shape(conv: gs.Node, shapes: facts.ShapeTable) -> ConvShape | None:
    """The ConvShape of a 2-D Conv with static C, H, W and a 4-D weight; None otherwise."""
    if len(conv.inputs) < 2:
        return None
    x, w = conv.inputs[0], conv.inputs[1]
    xd, wd = shapes.dims(x), shapes.static_shape(w)
    if xd is None or wd is None or len(xd) != 4 or len(wd) != 4:
        return None
    if not all(isinstance(d, int) for d in xd[1:]):
        return None
    if x.dtype is not None and np.dtype(x.dtype) != FLOAT:
        return None
    c, h, wi = xd[1:]
    k, cg, r, s = wd
    group = int(conv.attrs.get("group", 1))
    if group < 1 or cg * group != c:
        return None
    ks = conv.attrs.get("kernel_shape")
    if ks is not None and list(ks) != [r, s]:
        return None
    strides = tuple(int(v) for v in conv.attrs.get("strides", [1, 1]))
    dil = tuple(int(v) for v in conv.attrs.get("dilations", [1, 1]))
    auto_pad = conv.attrs.get("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad in ("NOTSET", ""):
        pads = tuple(int(v) for v in conv.attrs.get("pads", [0, 0, 0, 0]))
        if len(pads) != 4:
            return None
        pads = (pads[0], pads[1], pads[2], pads[3])  # ONNX order: begins (h, w), ends (h, w)
    elif auto_pad == "VALID":
        pads = (0, 0, 0, 0)
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, st, d, kk in ((h, strides[0], dil[0], r), (wi, strides[1], dil[1], s)):
            out = -(-size // st)
            total = max(0, (out - 1) * st + (kk - 1) * d + 1 - size)
            small, big = total // 2, total - total // 2
            begin.append(big if auto_pad == "SAME_LOWER" else small)
            end.append(small if auto_pad == "SAME_LOWER" else big)
        pads = (begin[0], begin[1], end[0], end[1])
    else:
        return None
    if len(strides) != 2 or len(dil) != 2 or min(strides + dil) < 1 or min(pads) < 0:
        return None
    try:
        return ConvShape(c, h, wi, k, r, s, strides, pads, dil, group)
    except ValueError:
        return None


# The activation forms the epilogue applies, as rules on the Conv's output x. Each names the
# epilogue's activation and how its parameters (alpha, beta) come from the match. The one-op
# forms are the shared vocabulary's epilogue activations (onnxfuse/graph/activations.py).
x = Var("x")
HARDSWISH = (1.0 / 6.0, 0.5)  # hardswish(v) = v * max(0, min(1, v / 6 + 0.5))
_HARD_SIGMOID = BY_OP["HardSigmoid"]


def _op_params(m: Match) -> tuple[float, float] | None:
    act = BY_OP.get(m.root.op)
    if act is not None:
        return HARDSWISH if act.name == "hardswish" else (*act.values(m.root), 0.0, 0.0)[:2]
    return gu.clip_bounds(m.root)  # Clip: its bounds, None when one is computed


def _reads_all_of_x(m: Match, graph: gs.Graph) -> bool:
    return all(m.holds(r) for r in m["x"].outputs)


def _form(name: str, pattern: OpPattern) -> Rule:
    return Rule(name, pattern, condition=_reads_all_of_x)


def _one_op(op_type: str) -> Rule:
    name = BY_OP[op_type].name if op_type in BY_OP else op_type.lower()
    return _form(name, OpPattern(op_type, (x, ANY, ANY) if op_type == "Clip" else (x,)))


EPILOGUE_FORMS: tuple[tuple[Rule, Callable[[Match], tuple[float, float] | None]], ...] = (
    *((_one_op(op_type), _op_params) for op_type in ops_fused_in(CONV)),
    (_form("silu", x * op.Sigmoid(x)), lambda m: (0.0, 0.0)),
    (_form("hardswish", x * op.HardSigmoid(x, _name="gate")), lambda m: _HARD_SIGMOID.values(m["gate"])),
    (_form("hardswish", x * op.Clip(x + 3.0, 0.0, 6.0) / 6.0), lambda m: HARDSWISH),
    (_form("hardswish", x * (op.Clip(x + 3.0, 0.0, 6.0) / 6.0)), lambda m: HARDSWISH),
)


def _activation(graph: gs.Graph, y: gs.Tensor) -> tuple[list[gs.Node], str, float, float, gs.Tensor] | None:
    """The activation reading Conv output `y`: (nodes, name, alpha, beta, output) or None. Only
    the activation may read y."""
    if gu.is_graph_output(graph, y):
        return None
    found = match_after([rule for rule, _ in EPILOGUE_FORMS], graph, y, "x")
    if found is None:
        return None
    rule, m = found
    params = dict((id(r), p) for r, p in EPILOGUE_FORMS)[id(rule)](m)
    if params is None:
        return None
    return m.nodes, rule.name, params[0], params[1], m.output


CONV = op.Conv(Var("x"), Var("w"), Rest("bias"))
# What may follow the Conv (and its activation): a residual Add of a tensor of its shape, then Relu.
RESIDUAL = tuple(Rule(f"residual/{p.op}", p, condition=lambda m, g: m["z"] is not m["y"])
                 for p in (op.Add(Var("y"), Var("z")), op.Sum(Var("y"), Var("z"))))
POST_RELU = (Rule("post-relu", op.Relu(Var("y"))),)


def match(graph: gs.Graph, conv: gs.Node, shapes: facts.ShapeTable) -> ConvMatch | None:
    if rules.match(CONV, conv) is None:
        return None
    shape = conv_shape(conv, shapes)
    if shape is None:
        return None
    m = ConvMatch(conv, shape, [conv])
    y = conv.outputs[0]
    act, alpha, beta = "none", 0.0, 0.0
    found = _activation(graph, y)
    if found is not None:
        nodes, act, alpha, beta, y = found
        m.nodes += nodes
    residual, post_relu = None, False
    added = rules.match_reader(RESIDUAL, graph, y, "y")
    if added is not None:
        n, z = added[1].root, added[1]["z"]
        yd, zd = shapes.dims(y), shapes.dims(z) if z is not None else None
        same = (z is not None and yd is not None and zd is not None and len(yd) == len(zd) == 4
                and yd[1:] == zd[1:] and all(isinstance(d, int) for d in yd[1:])
                and (yd[0] == zd[0] and yd[0] is not None))
        if same and not isinstance(z, gs.Constant):
            residual = z
            m.nodes.append(n)
            y = n.outputs[0]
            relu = rules.match_reader(POST_RELU, graph, y, "y")
            if relu is not None:
                post_relu = True
                m.nodes.append(relu[1].root)
                y = relu[1].output
    if act == "none" and residual is None:
        return None  # a bare Conv: nothing for an epilogue to save
    m.epilogue = Epilogue(act, alpha, beta, residual is not None, post_relu)
    m.residual = residual
    m.output = y
    return m


def _attach_kernel(graph: gs.Graph, m: ConvMatch, ctx: Context) -> Kernel:
    tile = None
    if ctx.options.tune and ctx.tune_unavailable is None:
        try:
            tile, _ = tune(m.shape, m.epilogue, batch=ctx.options.tune_batch)
        except RuntimeError as e:  # no GPU here: the heuristic below, for every layer
            ctx.tune_unavailable = str(e)
    # Split-K over clusters (option conv_split_k) and the 3xTF32 tensor-core GEMM (option
    # conv_tensor_cores) are opt-in until the per-layer GPU table shows where they beat cuDNN;
    # --tune (which times the candidates on the GPU) may pick them anyway.
    clusters = ctx.options.conv_split_k and clusters_supported(ctx.target.arch)
    tensor_cores = ctx.options.conv_tensor_cores and tensor_cores_supported(ctx.target.arch)
    tile = tile or heuristic_tile(m.shape, clusters=clusters, tensor_cores=tensor_cores)
    return generate(m.shape, m.epilogue, tile)


def rewrite(graph: gs.Graph, m: ConvMatch, ctx: Context, kernel: Kernel) -> gs.Node:
    conv = m.conv
    if len(conv.inputs) < 3 or not gu.is_present(conv.inputs[2]):
        zero = gu.make_constant(graph, f"{conv.name or 'conv'}_zero_bias", np.zeros(m.shape.k, np.float32))
        if len(conv.inputs) < 3:
            conv.inputs.append(zero)
        else:
            conv.inputs[2] = zero
    s = m.shape
    inputs = list(conv.inputs[:3]) + ([m.residual] if m.residual is not None else [])
    attrs = {
        "kernel_shape": [s.r, s.s],
        "strides": list(s.stride),
        "pads": list(s.pads),
        "dilations": list(s.dilation),
        "group": s.group,
        "activation": m.epilogue.activation,
        "activation_alpha": float(m.epilogue.alpha),
        "activation_beta": float(m.epilogue.beta),
        "post_relu": int(m.epilogue.post_relu),
        **kernel.attrs(),
    }
    return ctx.fuse(graph, OP.name, m.nodes, inputs, [m.output], attrs)


def run(graph: gs.Graph, ctx: Context) -> int:
    if not ctx.target.has_kernel(OP.name):
        return 0
    shapes = facts.ShapeTable(graph)
    # "pays" (default): only layers where our kernel is expected to win; "always": every match
    # (benchmarks and tests of the kernel itself).
    policy = ctx.options.conv_policy

    def fusable(found: Match, graph: gs.Graph):
        m = match(graph, found.root, shapes)
        if m is None:
            return rules.fail("no activation or residual Add follows it privately, or its shape is not a 2-D"
                              " float32 convolution the kernel takes")
        if policy != "always" and not pays_on_cuda(m.shape):
            return rules.fail("cuDNN was measured faster for its shape")
        found.bindings["conv_match"] = m
        return True

    def fuse(graph: gs.Graph, found: Match) -> bool:
        m = found["conv_match"]
        rewrite(graph, m, ctx, _attach_kernel(graph, m, ctx))
        return True

    return rules.apply(graph, [Rule("conv-bias-act", CONV, condition=fusable, rewrite=fuse)], ctx.explainer)


def conv_layers(model) -> list[tuple[str, ConvShape, Epilogue | None]]:
    """Every 2-D Conv of an ONNX model after BN folding: (node name, shape, epilogue), the
    epilogue None where this pass would leave the Conv alone (a bare Conv)."""
    from onnxfuse.pipeline import import_graph, select_passes

    ctx = Context(target="cuda")
    graph, _, _ = import_graph(model, ctx)
    for fold in select_passes(["fold-batchnorm"], "cuda"):
        fold.run(graph, ctx)
    gu.toposort(gu.cleanup(graph))
    shapes = facts.ShapeTable(graph)
    out = []
    for conv in graph.nodes:
        if rules.match(CONV, conv) is None:
            continue
        shape = conv_shape(conv, shapes)
        if shape is None:
            continue
        m = match(graph, conv, shapes)
        out.append((conv.name, shape, m.epilogue if m else None))
    return out


PASS = fused_op_pass(OP, 320, run=run,
                     summary="Conv + bias + activation (+ residual Add, + Relu) -> onnxfuse.ConvBiasAct with a generated CUDA kernel (cuda)")
