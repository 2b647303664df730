"""A model of onnxruntime's own graph fusions, which the pointwise pass must not block.

onnxruntime (ORT_ENABLE_ALL, applied after our passes) fuses some elementwise ops into its own
kernels. A Pointwise region that swallowed them would leave onnxruntime's kernel unfused, one
more kernel per pattern and a slower one: those ops are reserved for onnxruntime (POLICY). Some
of its fusions are slower than a region, and a region takes them first (PREEMPT). Each rule
below was checked on onnxruntime 1.31 (CPU provider): the pattern alone runs as the named single
kernel (tests/test_ort_fusions.py::test_cpu_policy_patterns_are_fused_by_onnxruntime).

Where a rule's fusion depends on details the rule does not repeat, the graph onnxruntime would
execute is consulted through a function handed in (the ort layer's executed_graph): this module
opens no session itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import onnx
import onnx_graphsurgeon as gs

from onnxfuse.fused import DOMAIN, DOMAIN_VERSION

from . import core as gu
from .activations import ORT_FUSED_CONV, ORT_FUSED_GEMM, ORT_NCHWC, ops_fused_in
from .index import GraphIndex
from . import rules
from .patterns import GELU_FORMS, VIEW_OPS

# What onnxruntime executes for a model: its graph after all of its own optimizations.
ExecutedGraph = Callable[[onnx.ModelProto], onnx.ModelProto]

@dataclass(frozen=True)
class Rule:
    """Ops left to one of onnxruntime's fusions: `match` yields the nodes to leave alone."""

    name: str
    fused_into: str
    match: Callable[[GraphIndex], Iterable[gs.Node]]


def matched_nodes(rules: Iterable[Rule], a: GraphIndex) -> dict[int, str]:
    """id(node) -> the name of the first of `rules` whose match yields it."""
    matched: dict[int, str] = {}
    for rule in rules:
        for n in rule.match(a):
            matched.setdefault(id(n), rule.name)
    return matched


def reserved_for_runtime(a: GraphIndex, target: str, executed_graph: ExecutedGraph | None) -> dict[int, str]:
    """Nodes left to onnxruntime's own fusions on `target`: id(node) -> the rule's name.

    A rule describes a pattern; whether onnxruntime fuses a given instance depends on details a
    rule does not repeat (onnxruntime 1.31 fuses no FastGelu whose result is a graph output, and
    none with the cube written x * x * x). Where the rule's fusion removes the nodes it takes
    (CONFIRMED), the graph onnxruntime would execute is consulted: a node it still runs as it is
    was not fused, and is not left to it. `executed_graph` answers what onnxruntime executes for
    a model (onnxfuse.runtime.executed_graph, handed in by the pipeline's context); without it
    the rules stand alone."""
    reserved = matched_nodes(POLICY.get(target, ()), a)
    confirmed = CONFIRMED.get(target, frozenset())
    if executed_graph is not None and any(name in confirmed for name in reserved.values()):
        unfused = runtime_unfused(a.graph, executed_graph)
        if unfused is not None:
            reserved = {k: name for k, name in reserved.items() if name not in confirmed or k not in unfused}
    return reserved


PROBE_NAME = "onnxfuse_probe_"
PROBE_ELEMENTS = 1 << 16


def runtime_unfused(graph: gs.Graph, executed_graph: ExecutedGraph) -> set[int] | None:
    """id() of the top-level nodes that onnxruntime (CPU provider, ORT_ENABLE_ALL, our library
    registered) runs as they are: the same name, domain and op type in the graph it executes,
    every node named for the probe by its position. Weights of more than PROBE_ELEMENTS
    elements go in as graph inputs of their shape, so that asking costs a session over the
    graph's structure (GPT-2 small's 650 MB are not copied); the CONFIRMED fusions look at
    scalar constants and per-channel parameters only. None when onnxruntime cannot be asked
    (the graph does not export or load): the rules then stand alone."""
    nodes = list(graph.nodes)
    try:
        model, _ = gu.export_model(graph, keep_elements=PROBE_ELEMENTS)
        if len(model.graph.node) != len(nodes):
            return None
        model.ir_version = 10
        for i, node in enumerate(model.graph.node):
            node.name = f"{PROBE_NAME}{i}"
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
        executed = executed_graph(model)
    except Exception:  # noqa: BLE001 - onnxruntime raises its own types; the rules stand alone
        return None
    kept = {(n.name, n.domain or "", n.op_type) for n in executed.graph.node}
    return {id(n) for i, n in enumerate(nodes)
            if (f"{PROBE_NAME}{i}", model.graph.node[i].domain or "", model.graph.node[i].op_type) in kept}


_FUSED_CONV_ACTIVATIONS = ops_fused_in(ORT_FUSED_CONV)
_FUSED_GEMM_ACTIVATIONS = ops_fused_in(ORT_FUSED_GEMM)


def match_conv_activation(a: GraphIndex) -> Iterable[gs.Node]:
    """Conv -> Relu|Clip|Sigmoid|Tanh|LeakyRelu|HardSigmoid becomes FusedConv (the activation
    runs inside the convolution's output loop), and Conv -> Add|Sum (a residual) -> activation
    becomes one NCHWc convolution with a sum input when onnxruntime's NCHWc layout takes the
    convolution (group 1, output channels a multiple of 8): resnet50 runs 59 kernels per
    inference with them left to onnxruntime, 111 with them in Pointwise regions, which also
    need NCHWc reorders around them. Grouped convolutions (shufflenet) stay in NCHW: there
    the residual Sum + Relu is a region, faster than onnxruntime's kernels for it (the whole
    model: bench/results/zoo_latency.md)."""
    for n in a.nodes:
        if not gu.is_op(n, "Conv"):
            continue
        r = a.reader(n.outputs[0])
        w = gu.dims(n.inputs[1]) if len(n.inputs) > 1 else None
        nchwc = int(n.attrs.get("group", 1)) == 1 and w is not None and isinstance(w[0], int) and w[0] % 8 == 0
        if nchwc and gu.is_op(r, "Add", "Sum") and len(r.inputs) == 2:
            yield r
            r = a.reader(r.outputs[0])
        if gu.is_op(r, *_FUSED_CONV_ACTIVATIONS):
            yield r


# onnxruntime's NCHWc layout (CPU, x86): convolutions run on channel-blocked tensors, and these
# elementwise ops run on the blocked tensors in place, with no ReorderOutput / ReorderInput around
# them, when every activation they read is blocked (binary ones: two blocked tensors of one
# shape; Add and Sum even fold into the convolution as its sum input). Checked on onnxruntime
# 1.31: LeakyRelu, Clip, Elu, Exp, Neg, Abs, Softplus, Sub, Div, Max and ops with a broadcast
# constant are not among them (they get reorders). Pools of a blocked tensor stay blocked.
_NCHWC_UNARY = ops_fused_in(ORT_NCHWC)
_NCHWC_BINARY = ("Add", "Sum", "Mul")
_NCHWC_POOLS = ("MaxPool", "AveragePool", "GlobalMaxPool", "GlobalAveragePool")
# MLAS's NCHWc block is 8 floats with AVX2 and 16 with AVX-512: 8 also holds for 16-wide
# blocks only where channels are multiples of 16, so a 24-channel layer on an AVX-512 machine
# is (wrongly) taken as blocked; that only leaves an op to onnxruntime that could have fused.
_NCHWC_BLOCK = 8


def nchwc_conv(n: gs.Node) -> bool:
    """Whether onnxruntime's NCHWc layout takes this Conv: 2-D with constant weights, output
    channels a multiple of the block, and either group 1 (input channels a multiple of the
    block, or fewer than one block: the first layer reads NCHW) or depthwise."""
    if not gu.is_op(n, "Conv") or len(n.inputs) < 2 or not isinstance(n.inputs[1], gs.Constant):
        return False
    w = gu.dims(n.inputs[1])
    if w is None or len(w) != 4 or not all(isinstance(d, int) for d in w):
        return False
    cout, cin_per_group = w[0], w[1]
    group = int(n.attrs.get("group", 1))
    if cout % _NCHWC_BLOCK:
        return False
    if group == 1:
        return cin_per_group % _NCHWC_BLOCK == 0 or cin_per_group < _NCHWC_BLOCK
    return cin_per_group == 1 and group == cout


def match_nchwc_elementwise(a: GraphIndex) -> Iterable[gs.Node]:
    """Elementwise ops that onnxruntime runs in its NCHWc layout between convolutions. In a
    Pointwise region they would need a ReorderOutput before and a ReorderInput after: MobileNetV3's
    x * HardSigmoid(x) ran as 3 kernels per block that way, against onnxruntime's 2 in place."""
    blocked: set[int] = set()
    for n in a.nodes:  # topological order
        acts = [t for t in n.inputs if gu.is_present(t) and not isinstance(t, gs.Constant)]
        if nchwc_conv(n):
            blocked.update(id(t) for t in n.outputs)
            continue
        if gu.is_op(n, *_NCHWC_UNARY) or gu.is_op(n, *_NCHWC_POOLS):
            keep = len(acts) == 1 and id(acts[0]) in blocked
        elif gu.is_op(n, *_NCHWC_BINARY):
            keep = (len(n.inputs) == 2 == len(acts) and all(id(t) in blocked for t in acts)
                    and gu.dims(acts[0]) is not None and gu.dims(acts[0]) == gu.dims(acts[1]))
        else:
            continue
        if keep:
            blocked.update(id(t) for t in n.outputs)
            if not gu.is_op(n, *_NCHWC_POOLS):
                yield n


def match_matmul_gemm(a: GraphIndex) -> Iterable[gs.Node]:
    """MatMul of two 2-D operands -> Add becomes Gemm (the addend is Gemm's C, added for free),
    and Gemm -> Relu|Sigmoid|Tanh|LeakyRelu|HardSigmoid becomes FusedGemm. Rank-3 MatMuls are
    not turned into a Gemm when a dim is symbolic, and only with two extra Reshape kernels when
    all are static: those Adds are better in a region."""
    for n in a.nodes:
        gemm_out = None
        if gu.is_op(n, "MatMul") and gu.rank(n.inputs[0]) == 2 and gu.rank(n.inputs[1]) == 2:
            add = a.reader(n.outputs[0])
            if gu.is_op(add, "Add"):
                other = gu.other_input(add, n.outputs[0])
                # An addend cut from a larger tensor (Slice/Split) is read in place by a region;
                # as Gemm's C it would have to be copied out first: leave that Add to the region.
                if (other is not None and gu.rank(other) is not None and gu.rank(other) <= 2
                        and not gu.is_op(gu.producer(other), *VIEW_OPS)):
                    yield add
                    gemm_out = add.outputs[0]
        elif gu.is_op(n, "Gemm"):
            gemm_out = n.outputs[0]
        if gemm_out is not None:
            act = a.reader(gemm_out)
            if gu.is_op(act, *_FUSED_GEMM_ACTIVATIONS):
                yield act


def match_matmul_scale(a: GraphIndex) -> Iterable[gs.Node]:
    """Mul or Div by a scalar constant on a MatMul's input or output becomes FusedMatMul's alpha."""
    for n in a.nodes:
        if not gu.is_op(n, "Mul", "Div"):
            continue
        for i, t in enumerate(n.inputs):
            other = n.inputs[1 - i] if len(n.inputs) == 2 else None
            if other is None or gu.scalar(other) is None or (n.op == "Div" and i == 1):
                continue
            if gu.is_op(a.producer(t), "MatMul") and a.reader(t) is n:
                yield n
            elif gu.is_op(a.reader(n.outputs[0]), "MatMul"):
                yield n


def match_skip_layernorm(a: GraphIndex) -> Iterable[gs.Node]:
    """Add -> LayerNormalization (the sum read by nothing else; or by the written-out
    LayerNormalization that onnxruntime first fuses, its mean and its Sub) becomes
    SkipLayerNormalization, a bias Add before it included."""
    written_out = {id(n) for n in match_layernorm(a)}
    for n in a.nodes:
        if not gu.is_op(n, "Add"):
            continue
        readers = [] if n.outputs[0].name in a.graph_outputs else list(n.outputs[0].outputs)
        one_ln = len(readers) == 1 and gu.is_op(readers[0], "LayerNormalization")
        subs = [r for r in readers if gu.is_op(r, "Sub") and id(r) in written_out and r.inputs[0] is n.outputs[0]]
        means = [r for r in readers if gu.is_op(r, "ReduceMean")]
        written = (len(readers) == 2 and len(subs) == 1 and len(means) == 1
                   and a.producer(subs[0].inputs[1]) is means[0])
        if not (one_ln or written):
            continue
        yield n
        for t in n.inputs:
            p = a.producer(t)
            if gu.is_op(p, "Add") and a.reader(t) is n and any(gu.constant_value(x) is not None for x in p.inputs):
                yield p


def _forward_chain(a: GraphIndex, t: gs.Tensor, ops: tuple[str, ...], limit: int) -> list[gs.Node]:
    """Nodes of `ops` following `t` one reader at a time (at most `limit`)."""
    out = []
    while len(out) < limit:
        r = a.reader(t)
        if not gu.is_op(r, *ops):
            break
        out.append(r)
        t = r.outputs[0]
    return out


def match_layernorm(a: GraphIndex) -> Iterable[gs.Node]:
    """The written-out LayerNormalization (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul,
    Add) and RMS norm (Pow, ReduceMean, Add, Sqrt, Div|Reciprocal+Mul, Mul) become
    LayerNormalization / SimplifiedLayerNormalization."""
    for var in a.nodes:
        if not gu.is_op(var, "ReduceMean"):
            continue
        sq = a.producer(var.inputs[0])
        if not gu.is_op(sq, "Pow", "Mul") or a.reader(var.inputs[0]) is not var:
            continue
        if sq.op == "Pow" and gu.scalar(sq.inputs[1]) != 2.0:
            continue
        if sq.op == "Mul" and sq.inputs[0] is not sq.inputs[1]:
            continue
        centred = sq.inputs[0]
        sub = a.producer(centred)
        # statistic chain (Add eps, Sqrt, Reciprocal) up to the op that also reads the input
        chain, norm, t = [], None, var.outputs[0]
        for _ in range(4):
            r = a.reader(t)
            if not gu.is_op(r, "Add", "Sqrt", "Reciprocal", "Div", "Mul"):
                break
            if any(x is centred for x in r.inputs):
                norm = r
                break
            chain.append(r)
            t = r.outputs[0]
        if norm is None:
            continue
        yield sq
        yield from chain
        yield norm
        if gu.is_op(sub, "Sub") and gu.is_op(a.producer(sub.inputs[1]), "ReduceMean"):
            yield sub
        # Hugging Face's RMSNorm computes in float32 and casts back before the weight Mul
        # (x.to(float32) ... (x * rsqrt).to(dtype) * weight); the TorchScript exporter keeps
        # those Casts, even float32 to float32, and onnxruntime's fusion takes them in.
        if gu.is_op(sub, "Cast") and centred.name not in a.graph_outputs and all(
                c is sq or c is norm for c in centred.outputs):
            yield sub
        yield from _forward_chain(a, norm.outputs[0], ("Mul", "Add", "Cast"), 3)


def _bias_add(a: GraphIndex, x: gs.Tensor, pattern_readers: int) -> gs.Node | None:
    """The Add of a constant bias that computes `x`, when only the pattern reads `x`."""
    p = a.producer(x)
    if not gu.is_op(p, "Add") or x.name in a.graph_outputs or len(x.outputs) != pattern_readers:
        return None
    if any(gu.constant_value(t) is not None and gu.rank(t) == 1 for t in p.inputs):
        return p
    return None


def _gates(a: GraphIndex, n: gs.Node) -> bool:
    """The activation `n` writes is read by one Mul alone, by a computed tensor (a gated linear
    unit: SwiGLU's silu(gate) * up). onnxruntime runs QuickGelu and that Mul as two kernels (three
    with the Split of a packed gate/up projection); a Pointwise region holds all of them as one."""
    out = n.outputs[0]
    readers = a.consumers.get(id(n), [])
    if out.name in a.graph_outputs or len(readers) != 1 or not gu.is_op(readers[0], "Mul"):
        return False
    other = [t for t in readers[0].inputs if t is not out]
    return len(other) == 1 and gu.constant_value(other[0]) is None


def match_gelu(a: GraphIndex) -> Iterable[gs.Node]:
    """GELU written out (patterns.GELU_FORMS): with Erf (Gelu, BiasGelu with a bias Add before
    it), with Tanh and x^3 (FastGelu, bias included), and x * Sigmoid(alpha * x) (QuickGelu;
    SiLU is alpha 1), except a sigmoid form that gates (_gates: the pointwise pass takes it
    with its Mul)."""
    for n in a.nodes:
        if n.op != "Mul":
            continue
        for kind, form in GELU_FORMS:
            m = rules.match(form, n, a.graph_outputs, private=False)
            if m is None:
                continue
            if kind == "sigmoid" and _gates(a, n):
                break
            yield from m.nodes
            x = m["x"]
            bias = _bias_add(a, x, sum(1 for r in x.outputs if m.holds(r)))
            if bias is not None:
                yield bias
            break


POLICY: dict[str, tuple[Rule, ...]] = {
    "cpu": (
        Rule("conv-activation", "FusedConv", match_conv_activation),
        Rule("nchwc-elementwise", "NCHWc layout (in place between convolutions)", match_nchwc_elementwise),
        Rule("matmul-gemm", "Gemm / FusedGemm", match_matmul_gemm),
        Rule("matmul-scale", "FusedMatMul", match_matmul_scale),
        Rule("layernorm", "LayerNormalization / SimplifiedLayerNormalization", match_layernorm),
        Rule("gelu", "Gelu / BiasGelu / FastGelu / QuickGelu", match_gelu),
    ),
    # onnxruntime's CUDA provider fuses less: convolution activations through cuDNN (Relu
    # only is kept here), normalizations (reductions, which a Pointwise cannot hold) and the
    # bias of a 2-D MatMul (cuBLAS epilogue). GELU and the MatMul scale are left to our
    # generated kernel, which also takes the ops around them.
    "cuda": (
        Rule("conv-activation", "FusedConv (cuDNN)", lambda a: (n for n in match_conv_activation(a) if n.op == "Relu")),
        Rule("matmul-gemm", "Gemm", lambda a: (n for n in match_matmul_gemm(a) if n.op == "Add")),
        Rule("skip-layernorm", "SkipLayerNormalization", match_skip_layernorm),
        Rule("layernorm", "LayerNormalization / SimplifiedLayerNormalization", match_layernorm),
    ),
}

# The rules checked against the graph onnxruntime executes (reserved_for_runtime): fusions that
# remove the nodes they take and decide on scalar constants and per-channel parameters alone, so
# that the probe's weights-as-inputs graph (runtime_unfused) gets the same answer. Not the
# convolution and MatMul rules: onnxruntime's NCHWc layout and Gemm fusions look at the weights.
CONFIRMED: dict[str, frozenset[str]] = {
    "cpu": frozenset({"layernorm", "gelu"}),
}

# Fusions of onnxruntime that run slower on the target than a Pointwise region plus the rest
# left unfused: a region holding one of these ops pays even when that op is its only work, so
# that onnxruntime does not make the fusion. On the CPU (onnxruntime 1.31), a Pointwise region
# with the residual (and bias) Add plus LayerNormalization takes less time than
# SkipLayerNormalization at every size and thread count measured (`python -m
# bench.skip_layernorm`, bench/results/skip_layernorm.md).
PREEMPT: dict[str, tuple[Rule, ...]] = {
    "cpu": (Rule("skip-layernorm", "SkipLayerNormalization", match_skip_layernorm),),
}


def preempted_from_runtime(a: GraphIndex, target: str) -> dict[int, str]:
    """Nodes that a region takes from one of onnxruntime's slower fusions: id(node) -> rule name."""
    return matched_nodes(PREEMPT.get(target, ()), a)
