"""torch.onnx's TorchScript exporter writes Split sizes, Slice starts/ends and scalars as
Constant nodes, where torch.export writes initializers.

An unrolled LSTM (chunk(4) as a Split with its sizes from a Constant node) and an unrolled GRU
cell (gate Slices with their bounds from Constant nodes) were refused: the pointwise pass put
the Split/Slice into a region's fallback function, whose body then read the Constant's output,
a value of the main graph a function cannot see ("Node input '/Constant_2_output_0' is not a
graph input, initializer, or output of a previous node"; inlined, onnxruntime's shape inference
met the undefined bounds as "Incompatible dimensions" in a Mul). The GRU also needed a second
optimize to find its big regions. The pipeline now reads every Constant node as an initializer
(graphutil.constants_as_initializers), as onnxruntime does when it loads a model, and a fused
node's body carries a copy of any constant it reads.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.api import optimize
from onnxfuse.fuzz import optimize_model

H = 16


class _Builder:
    """Nodes and constants of one model; constants as Constant nodes or as initializers."""

    def __init__(self, constant_nodes: bool):
        self.constant_nodes = constant_nodes
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value) -> str:
        value = np.asarray(value)
        if self.constant_nodes:
            self.nodes.append(helper.make_node("Constant", [], [name], name=f"/{name}",
                                               value=numpy_helper.from_array(value, name)))
        else:
            self.inits.append(numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, ins: list[str], outs: list[str], **attrs) -> None:
        self.nodes.append(helper.make_node(op, ins, outs, name=f"/{op}_{outs[0]}", **attrs))

    def model(self, outputs: list[str]) -> onnx.ModelProto:
        vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, H])  # noqa: E731
        inputs = [vi("x"), vi("h0")] + ([vi("c0")] if any("c0" in n.input for n in self.nodes) else [])
        graph = helper.make_graph(self.nodes, "rnn", inputs, [vi(o) for o in outputs], self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m


def _weights(b: _Builder, gates: int) -> None:
    rng = np.random.default_rng(0)
    b.inits.append(numpy_helper.from_array((rng.standard_normal((H, gates * H)) * 0.3).astype(np.float32), "W"))
    b.inits.append(numpy_helper.from_array((rng.standard_normal((H, gates * H)) * 0.3).astype(np.float32), "R"))


def _projections(b: _Builder, h: str, s: str) -> None:
    """Step `s`'s input and recurrent projections gx = x W, gh = h R."""
    b.node("MatMul", ["x", "W"], ["gx" + s])
    b.node("MatMul", [h, "R"], ["gh" + s])


def _gates(b: _Builder, h: str, s: str) -> str:
    """Step `s`'s gate pre-activations x W + h R; returns their name."""
    _projections(b, h, s)
    b.node("Add", ["gx" + s, "gh" + s], ["g" + s])
    return "g" + s


def _lstm_cell(b: _Builder, c: str, s: str) -> tuple[str, str]:
    """The LSTM cell update of step `s` from its gates i, f, gg, o: (h, c) of the step."""
    for gate, act in (("i", "Sigmoid"), ("f", "Sigmoid"), ("gg", "Tanh"), ("o", "Sigmoid")):
        b.node(act, [gate + s], ["a" + gate + s])
    b.node("Mul", ["af" + s, c], ["fc" + s])
    b.node("Mul", ["ai" + s, "agg" + s], ["ig" + s])
    b.node("Add", ["fc" + s, "ig" + s], ["c" + s])
    b.node("Tanh", ["c" + s], ["tc" + s])
    b.node("Mul", ["ao" + s, "tc" + s], ["h" + s])
    return "h" + s, "c" + s


def lstm_model(constant_nodes: bool, steps: int = 3) -> onnx.ModelProto:
    """Unrolled LSTM steps: gates = x W + h R; i, f, g, o = Split(gates, sizes); c, h updates."""
    b = _Builder(constant_nodes)
    _weights(b, 4)
    sizes = b.const("sizes", np.array([H] * 4, np.int64))
    h, c = "h0", "c0"
    for t in range(steps):
        s = f"_{t}"
        b.node("Split", [_gates(b, h, s), sizes], ["i" + s, "f" + s, "gg" + s, "o" + s], axis=1)
        h, c = _lstm_cell(b, c, s)
    return b.model([h])


def gru_model(constant_nodes: bool, steps: int = 3) -> onnx.ModelProto:
    """Unrolled GRU cell steps with the gates cut by Slices (x[:, :H], x[:, H:2H], x[:, 2H:])
    whose starts, ends and axes are Constant nodes, and 1 - z as a Sub from a constant."""
    b = _Builder(constant_nodes)
    _weights(b, 3)
    axes = b.const("axes", np.array([1], np.int64))
    bounds = [b.const(f"b{k}", np.array([k * H], np.int64)) for k in range(3)]
    end = b.const("end", np.array([2**63 - 1], np.int64))
    one = b.const("one", np.array(1.0, np.float32))
    h = "h0"
    for t in range(steps):
        s = f"_{t}"
        _projections(b, h, s)
        for src in ("gx", "gh"):
            for k, (lo, hi) in enumerate(((bounds[0], bounds[1]), (bounds[1], bounds[2]), (bounds[2], end))):
                b.node("Slice", [src + s, lo, hi, axes], [f"{src}{k}{s}"])
        b.node("Add", ["gx0" + s, "gh0" + s], ["rs" + s])
        b.node("Sigmoid", ["rs" + s], ["r" + s])
        b.node("Add", ["gx1" + s, "gh1" + s], ["zs" + s])
        b.node("Sigmoid", ["zs" + s], ["z" + s])
        b.node("Mul", ["r" + s, "gh2" + s], ["rn" + s])
        b.node("Add", ["gx2" + s, "rn" + s], ["ns" + s])
        b.node("Tanh", ["ns" + s], ["n" + s])
        b.node("Sub", [one, "z" + s], ["omz" + s])
        b.node("Mul", ["omz" + s, "n" + s], ["a" + s])
        b.node("Mul", ["z" + s, h], ["bz" + s])
        b.node("Add", ["a" + s, "bz" + s], ["h" + s])
        h = "h" + s
    return b.model([h])


def _ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    return sorted((n.domain, n.op_type) for n in model.graph.node)


@pytest.mark.parametrize("build", [lstm_model, gru_model], ids=["lstm_split", "gru_slices"])
def test_constant_node_bounds_optimize_and_fallbacks_run(build):
    result = optimize(build(constant_nodes=True), threads=1)
    assert result.verification.ok  # with the library and through the fallback functions
    assert result.summary["fused_ops"].get("Pointwise") == 3  # one region per step
    onnx.checker.check_model(result.model, full_check=True)


@pytest.mark.parametrize("build", [lstm_model, gru_model], ids=["lstm_split", "gru_slices"])
def test_constant_nodes_optimize_as_initializers_do(build):
    from_nodes = optimize_model(build(constant_nodes=True))
    from_initializers = optimize_model(build(constant_nodes=False))
    assert _ops(from_nodes) == _ops(from_initializers)


@pytest.mark.parametrize("build", [lstm_model, gru_model], ids=["lstm_split", "gru_slices"])
def test_one_optimize_reaches_the_fixed_point(build):
    once = optimize_model(build(constant_nodes=True))
    twice = optimize_model(once)
    assert [(n.domain, n.op_type) for n in twice.graph.node] == [(n.domain, n.op_type) for n in once.graph.node]


def test_fused_node_whose_body_reads_an_undeclared_outer_value_is_refused():
    """The engine's own check: a fallback body may read only the fused node's inputs, constants
    (written into the body) and values computed in the body."""
    import onnx_graphsurgeon as gs

    from onnxfuse.fused import FusedRegistry, make_fused_node

    x = gs.Variable("x", np.float32, [4])
    hidden, other, y = (gs.Variable(n, np.float32, [4]) for n in ("hidden", "other", "y"))
    neg = gs.Node("Neg", "neg", inputs=[x], outputs=[other])
    relu = gs.Node("Relu", "relu", inputs=[x], outputs=[hidden])
    add = gs.Node("Add", "add", inputs=[hidden, other], outputs=[y])
    graph = gs.Graph(nodes=[neg, relu, add], inputs=[x], outputs=[y], opset=17)
    with pytest.raises(ValueError, match="'other'"):
        make_fused_node(graph, FusedRegistry(), "Pointwise", [relu, add], [x], [y])
    scale = gs.Constant("scale", np.full([4], 2.0, np.float32))
    mul = gs.Node("Mul", "mul", inputs=[x, scale], outputs=[gs.Variable("z", np.float32, [4])])
    graph.nodes.append(mul)
    fused = make_fused_node(graph, FusedRegistry(), "Pointwise", [mul], [x], list(mul.outputs))
    assert fused.op == "Pointwise"


def dynamic_batch_lstm_model(steps: int = 2) -> onnx.ModelProto:
    """The TorchScript export of an LSTM with a dynamic batch: chunk(4) as four Slices whose
    bounds are computed from the gate tensor's shape (Shape -> Gather -> Div -> Mul ->
    Unsqueeze), so onnx's shape inference gives the gates made-up dims (unk__N)."""
    b = _Builder(constant_nodes=True)
    _weights(b, 4)
    idx, four, axes = b.const("idx", np.array(1, np.int64)), b.const("four", np.array(4, np.int64)), b.const("axes", np.array([0], np.int64))
    ks = [b.const(f"k{k}", np.array(k, np.int64)) for k in range(5)]
    slice_axes = b.const("slice_axes", np.array([1], np.int64))
    h, c = "h0", "c0"
    for t in range(steps):
        s = f"_{t}"
        b.node("Shape", [_gates(b, h, s)], ["shape" + s])
        b.node("Gather", ["shape" + s, idx], ["width" + s], axis=0)
        b.node("Div", ["width" + s, four], ["size" + s])
        for k in range(5):
            b.node("Mul", ["size" + s, ks[k]], [f"bound{k}{s}"])
            b.node("Unsqueeze", [f"bound{k}{s}", axes], [f"b{k}{s}"])
        for k, gate in enumerate(("i", "f", "gg", "o")):
            b.node("Slice", ["g" + s, f"b{k}{s}", f"b{k + 1}{s}", slice_axes], [gate + s])
        h, c = _lstm_cell(b, c, s)
    m = b.model([h])
    for v in list(m.graph.input) + list(m.graph.output):
        v.type.tensor_type.shape.dim[0].dim_param = "batch"
    return m


def test_bounds_made_constant_give_regions_in_one_optimize():
    """Once shape-plumbing made the Slice bounds constants, the gates' widths were still the
    made-up dims of the first shape inference, and the pointwise pass formed no region: the
    corpus's LSTM (TorchScript, dynamic batch) ran 122 kernels after one optimize, 42 after a
    second. The pointwise pass refreshes such dims."""
    model = dynamic_batch_lstm_model()
    once = optimize_model(model)
    assert sum(n.op_type == "Pointwise" for n in once.graph.node) == 2  # one region per step
    twice = optimize_model(once)
    assert [(n.domain, n.op_type) for n in twice.graph.node] == [(n.domain, n.op_type) for n in once.graph.node]
    result = optimize(model, threads=1, dims={"batch": 3})
    assert result.verification.ok
