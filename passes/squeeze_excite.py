"""squeeze-excite: a squeeze-and-excitation block -> one onnxfuse.SqueezeExcite node.

match
    x * gate(Conv2(hidden(Conv1(mean(x)))))

    mean      GlobalAveragePool(x), or ReduceMean(x) over axes 2 and 3 keeping them (torch.export)
    Conv1/2   1x1 convolutions (group 1, stride 1, no padding) with constant weights [R, C, 1, 1]
              and [C, R, 1, 1] and constant biases: the block's two fully connected layers
    hidden    Relu, Sigmoid, Tanh, HardSigmoid, HardSwish, LeakyRelu, Clip or SiLU (h * Sigmoid(h))
    gate      Sigmoid or HardSigmoid
    x         float32 [N, C, H, W]; when x is SiLU(y) read by the block alone (EfficientNet: the
              depthwise convolution's activation), the SiLU goes in too and the node reads y
              (--target cpu only: on cuda conv-bias-act takes it into the convolution's epilogue).

    Each form is a rule on the shared pattern layer (onnxfuse/graph/rules.py): the block from
    its gate convolution up, rooted at the Mul, and Conv1 with its mean, matched at the producer
    of the hidden activation's input.
condition
    the intermediates are read inside the block only (the rule engine's private matches);
    on --target cpu, x's H * W known and at most MAX_MAP (32x32: larger maps run faster as
    onnxruntime's kernels, bench/results/cnn224.md), and C * R under 20,000 for a block with no
    input activation (MAX_WEIGHTS_WITHOUT_INPUT_ACTIVATION: such a node with larger weights ran
    slower in whole models);
    --target cpu (kernels/squeeze_excite_cpu.cc) or cuda (the kernel cuda-compile generates,
    onnxfuse/cuda/squeeze_excite_codegen.py, launched by kernels/cuda_squeeze_excite.cc).
rewrite
    one onnxfuse.SqueezeExcite node through ctx.fuse, its fallback function the exact block.
order
    310: after fold-batchnorm and fold-linear-scale (the Convs' weights are final), before
    conv-bias-act (320), which on cuda would otherwise take the block's 1x1 Convs and their
    activations (and the SiLU before it) into ConvBiasAct nodes of their own.

Why it pays (measured, bench/results/squeeze_excite.md): onnxruntime runs the block as the pool,
two convolutions on a 1x1 image, their activations and a broadcast Mul, which its NCHWc layout
cannot run blocked, so the gate and x are reordered out of the blocked layout and the product
reordered back in: 7-9 kernels per block (EfficientNet-B0 16 blocks, MobileNetV3-small 9). The
fused node runs as one kernel between the two reorders onnxruntime already makes for the Mul.
On cuda there are no NCHWc reorders, but onnxruntime's CUDA provider still runs the block as 5-6
kernels (pool, two Convs, their activations, Mul); the fused node is one launch.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import facts
from onnxfuse.graph.activations import BY_OP
from onnxfuse.graph import rules
from onnxfuse.graph.rules import ANY, Match, OpPattern, Rule, Var, fail, op
from onnxfuse.ops.conv_bias_act import OP as CONV_BIAS_ACT
from onnxfuse.ops.squeeze_excite import MAX_MAP, MAX_WEIGHTS_WITHOUT_INPUT_ACTIVATION, OP
from onnxfuse.pipeline import Context, fused_op_pass

FLOAT = np.dtype(np.float32)

x, h, y = Var("x"), Var("h"), Var("y")
w1, w2 = Var("w1"), Var("w2")

# Activation parameters (alpha, beta) as the kernel reads them, from the activation's node.
Params = Callable[[Match], tuple[float, float] | None]


def _none(m: Match) -> tuple[float, float]:
    return 0.0, 0.0


def _attrs_of(op_type: str, name: str) -> Params:
    act = BY_OP[op_type]
    return lambda m: (*act.values(m[name]), 0.0, 0.0)[:2]


def _clip(name: str) -> Params:
    return lambda m: gu.clip_bounds(m[name])


# hidden(h): (kernel name, pattern over Var h, parameters).
HIDDEN: tuple[tuple[str, OpPattern, Params], ...] = (
    ("relu", op.Relu(h), _none),
    ("sigmoid", op.Sigmoid(h), _none),
    ("tanh", op.Tanh(h), _none),
    ("hardsigmoid", op.HardSigmoid(h, _name="hidden"), _attrs_of("HardSigmoid", "hidden")),
    ("hardswish", op.HardSwish(h), _none),
    ("leakyrelu", op.LeakyRelu(h, _name="hidden"), _attrs_of("LeakyRelu", "hidden")),
    ("clip", op.Clip(h, ANY, ANY, _name="hidden"), _clip("hidden")),
    ("silu", h * op.Sigmoid(h), _none),
)
# gate(v): (kernel name, pattern builder, parameters).
GATES: tuple[tuple[str, Callable[[OpPattern], OpPattern], Params], ...] = (
    ("sigmoid", lambda v: op.Sigmoid(v), _none),
    ("hardsigmoid", lambda v: op.HardSigmoid(v, _name="gate"), _attrs_of("HardSigmoid", "gate")),
)


def _block_rule(hidden: tuple[str, OpPattern, Params], gate: tuple[str, Callable, Params]) -> Rule:
    pattern = x * gate[1](op.Conv(hidden[1], w2, ANY, _name="conv2"))
    return Rule(f"squeeze-excite/{hidden[0]}/{gate[0]}", pattern)


BLOCK_RULES: tuple[tuple[Rule, tuple, tuple], ...] = tuple(
    (_block_rule(hd, gt), hd, gt) for gt in GATES for hd in HIDDEN)
# Conv1 and the mean of x, matched at the producer of h with x bound.
SQUEEZE_RULES: tuple[Rule, ...] = (
    Rule("squeeze/global-average-pool", op.Conv(op.GlobalAveragePool(x), w1, ANY, _name="conv1")),
    Rule("squeeze/reduce-mean", op.Conv(op.ReduceMean(x, ANY, _name="mean"), w1, ANY, _name="conv1")),
)
# SiLU of x's producer's input: taken into the node when the block alone reads x.
def _silu_reads_y_alone(m: Match, graph: gs.Graph):
    if gu.is_graph_output(graph, m["y"]) or not all(m.holds(r) for r in m["y"].outputs):
        return fail("the SiLU's input is read outside it or is a graph output")
    return True


INPUT_SILU = Rule("squeeze-excite/input-silu", y * op.Sigmoid(y), condition=_silu_reads_y_alone)


def _bias(conv: gs.Node) -> gs.Tensor | None:
    return conv.inputs[2] if len(conv.inputs) > 2 and gu.is_present(conv.inputs[2]) else None


def _pointwise_conv(conv: gs.Node, cout: int | None, cin: int | None) -> tuple[int, int] | None:
    """(out, in) channels of a group-1, stride-1, unpadded 1x1 Conv with a constant weight and a
    constant bias, or none."""
    wv = gu.constant_value(conv.inputs[1])
    b = _bias(conv)
    bv = None if b is None else gu.constant_value(b)
    if wv is None or wv.dtype != FLOAT or wv.ndim != 4 or wv.shape[2:] != (1, 1):
        return None
    if b is not None and (bv is None or bv.dtype != FLOAT or bv.shape != (wv.shape[0],)):
        return None
    if int(conv.attrs.get("group", 1)) != 1:
        return None
    auto_pad = conv.attrs.get("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad not in ("NOTSET", "", "VALID"):
        return None
    for name, one in (("strides", 1), ("dilations", 1), ("pads", 0)):
        if any(int(v) != one for v in conv.attrs.get(name, [])):
            return None
    if (cout is not None and wv.shape[0] != cout) or (cin is not None and wv.shape[1] != cin):
        return None
    return int(wv.shape[0]), int(wv.shape[1])


def _mean_over_hw(m: Match) -> bool:
    mean = m.bindings.get("mean")
    if mean is None:
        return True
    axes = gu.constant_ints(mean.inputs[1]) if len(mean.inputs) > 1 and gu.is_present(mean.inputs[1]) \
        else mean.attrs.get("axes")
    return (axes is not None and sorted(int(a) % 4 for a in axes) == [2, 3]
            and int(mean.attrs.get("keepdims", 1)) == 1)


def _block(graph: gs.Graph, m: Match, hidden: tuple, gate: tuple, outs: set[str], shapes: facts.ShapeTable,
           take_input_silu: bool, max_map: int | None):
    """The rest of the block a rule matched at the Mul (Conv1 and its mean, the convolutions'
    forms, the activations' parameters, the SiLU before it): (nodes, spec), or why not."""
    xt = m["x"]
    xd = shapes.dims(xt)
    if xd is None or len(xd) != 4 or not isinstance(xd[1], int) or (xt.dtype is not None and np.dtype(xt.dtype) != FLOAT):
        return fail("x is not float32 [N, C, H, W] with C known")
    if max_map is not None and not (isinstance(xd[2], int) and isinstance(xd[3], int) and xd[2] * xd[3] <= max_map):
        return fail(f"x's H * W is unknown or above {max_map} (larger maps run faster as onnxruntime's kernels)")
    conv1_node = gu.producer(m["h"])
    if conv1_node is None or m["h"].name in outs:
        return fail("the hidden activation's input is a graph input or a graph output")
    squeeze = None
    for srule in SQUEEZE_RULES:
        squeeze = srule.match(graph, conv1_node, outs, bind={"x": xt})
        if squeeze is not None and _mean_over_hw(squeeze):
            break
        squeeze = None
    if squeeze is None:
        return fail("the hidden activation's input is not Conv1(GlobalAveragePool(x)) or Conv1(ReduceMean(x) over"
                    " axes 2 and 3, keeping them), read by the block alone")
    # h is read by the hidden activation alone, the mean by Conv1 alone.
    if not all(m.holds(r) for r in m["h"].outputs):
        return fail("Conv1's output is read outside the block")
    rc = _pointwise_conv(squeeze["conv1"], None, xd[1])
    if rc is None or _pointwise_conv(m["conv2"], xd[1], rc[0]) is None:
        return fail("Conv1 and Conv2 are not 1x1 convolutions (group 1, stride 1, unpadded) with constant float32"
                    " weights [R, C, 1, 1] and [C, R, 1, 1] and constant biases")
    hp, gp = hidden[2](m), gate[2](m)
    if hp is None or gp is None:
        return fail("an activation's parameters are not constants")
    nodes = squeeze.nodes + m.nodes
    attrs = {"input_activation": "none",
             "hidden_activation": hidden[0], "hidden_alpha": float(hp[0]), "hidden_beta": float(hp[1]),
             "gate_activation": gate[0], "gate_alpha": float(gp[0]), "gate_beta": float(gp[1])}
    source = xt
    silu = _input_silu(graph, xt, nodes, outs) if take_input_silu else None
    if silu is not None:
        nodes = silu.nodes + nodes
        source = silu["y"]
        attrs["input_activation"] = "silu"
    elif max_map is not None and xd[1] * rc[0] >= MAX_WEIGHTS_WITHOUT_INPUT_ACTIVATION:
        return fail(f"C * R is {xd[1] * rc[0]}, at least {MAX_WEIGHTS_WITHOUT_INPUT_ACTIVATION}, and the block has no"
                    " input activation to take (onnxruntime's kernels run such blocks faster in a model)")
    return nodes, {"source": source, "convs": (squeeze["conv1"], m["conv2"]), "attrs": attrs}


def match_block(graph: gs.Graph, mul: gs.Node, outs: set[str], shapes: facts.ShapeTable,
                take_input_silu: bool = True, max_map: int | None = None,
                explain: rules.Explain | None = None) -> tuple[list[gs.Node], dict] | None:
    """The squeeze-and-excitation block rooted at `mul`: (nodes, node inputs and attributes),
    with the SiLU before it when `take_input_silu` and only the block reads x; when `max_map` is
    given, only where x's H and W are known and H * W is at most that (and, for a block with no
    input activation, C * R under MAX_WEIGHTS_WITHOUT_INPUT_ACTIVATION). Each form's rule judges
    the first way its pattern matches; explain(mul, reason) when none is a block."""
    tried = []
    for rule, hidden, gate in BLOCK_RULES:
        found = {}

        def block(m: Match):
            done = _block(graph, m, hidden, gate, outs, shapes, take_input_silu, max_map)
            found["block"] = done
            return bool(done) or done

        why: list[str] | None = [] if explain is not None else None
        if rules.match(rule.pattern, mul, outs, private=rule.private, condition=block, why=why, commit=True) is not None:
            return found["block"]
        if why:
            tried.append((rule.name, why[0]))
    rules.explain_failures(explain, mul, tried)
    return None


def _input_silu(graph: gs.Graph, xt: gs.Tensor, block: list[gs.Node], outs: set[str]) -> Match | None:
    """x = y * Sigmoid(y) when the block alone reads x."""
    if xt.name in outs or not all(any(r is n for n in block) for r in xt.outputs):
        return None
    found = rules.match_at([INPUT_SILU], graph, xt, outs)
    return found[1] if found else None


def run(graph: gs.Graph, ctx: Context) -> int:
    # The CUDA kernel (onnxfuse/cuda/squeeze_excite_codegen.py: one block per image) has passed
    # ptxas and a numpy model of its arithmetic, not yet a GPU: at batch 1 a large first layer
    # could run slower than onnxruntime's kernels. Until it is timed, the rewrite is opt-in there.
    if not ctx.target.measured and not ctx.options.squeeze_excite_cuda:
        return 0
    outs = {t.name for t in graph.outputs}
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    count = 0
    for mul, shapes in facts.roots_with_shapes(graph, "Mul"):
        # On cuda the SiLU stays the epilogue of the convolution before it (conv-bias-act's
        # depthwise kernel), so the block's kernel reads x once per pass instead of computing it twice.
        # MAX_MAP is a CPU measurement: the CUDA kernel is not timed yet (opt-in above).
        found = match_block(graph, mul, outs, shapes, take_input_silu=not ctx.target.has_kernel(CONV_BIAS_ACT.name),
                            max_map=MAX_MAP if ctx.target.measured else None, explain=ctx.explainer)
        if found is None:
            continue
        nodes, spec = found
        nodes = sorted(nodes, key=lambda n: order.get(id(n), 0))
        inputs = [spec["source"]]
        for conv in spec["convs"]:
            if _bias(conv) is None:  # the node always reads a bias, so the Conv reads zeros
                zero = gu.make_constant(graph, f"{conv.name or 'conv'}_zero_bias",
                                        np.zeros(gu.constant_value(conv.inputs[1]).shape[0], np.float32))
                if len(conv.inputs) < 3:
                    conv.inputs.append(zero)
                else:
                    conv.inputs[2] = zero
            inputs += [conv.inputs[1], conv.inputs[2]]
        ctx.fuse(graph, OP.name, nodes, inputs, [mul.outputs[0]], spec["attrs"])
        count += 1
    return count


PASS = fused_op_pass(OP, 310, run=run,
                     summary="squeeze-and-excitation blocks (pool, two 1x1 Convs, activations, Mul) -> onnxfuse.SqueezeExcite")
