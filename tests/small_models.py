"""Small hand-built test models: float32 models in one call (opset 17, IR 10), seeded inputs for
their symbolic dims, and the check that a rewrite computes the same bits."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.program import ONNX_ELEM, Program


class GraphBuilder:
    """Nodes and constants with fresh names, for test graphs written as the exporters write them."""

    def __init__(self):
        self.nodes, self.constants, self.count = [], {}, 0

    def name(self, base: str) -> str:
        self.count += 1
        return f"{base}{self.count}"

    def const(self, value) -> str:
        name = self.name("c")
        self.constants[name] = np.asarray(value)
        return name

    def node(self, op: str, inputs, **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.name(op), **attrs))
        return out

    def initializers(self) -> list:
        return [numpy_helper.from_array(v, k) for k, v in self.constants.items()]


def float_model(name: str, nodes, inputs: dict, outputs: dict, inits=(), opset: int = 17) -> onnx.ModelProto:
    """inputs and outputs: name -> shape (None for an output whose shape is left to inference)."""

    def declared(values: dict) -> list:
        return [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in values.items()]

    graph = helper.make_graph(list(nodes), name, declared(inputs), declared(outputs), list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


SIZES = ((1, 1), (1, 7), (3, 1), (3, 7))


def symbolic_feeds(model: onnx.ModelProto, batch: int, seq: int) -> dict:
    """Seeded inputs with the symbolic dims `batch` and `seq` set: token ids (0-255) for int64
    inputs, standard normal values for the others."""
    rng = np.random.default_rng(batch * 100 + seq)
    out = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else {"batch": batch, "seq": seq}[d.dim_param] for d in tt.shape.dim]
        if tt.elem_type == TensorProto.INT64:
            out[vi.name] = rng.integers(0, 256, dims).astype(np.int64)
        else:
            out[vi.name] = rng.standard_normal(dims).astype(np.float32)
    return out


def assert_same_outputs(original: onnx.ModelProto, rewritten: onnx.ModelProto, sizes=SIZES) -> None:
    """The rewritten model keeps the inputs and outputs and computes the same bits at every size,
    both run by onnxruntime with its own optimizations off."""
    from onnxfuse.runtime import make_session

    assert [o.name for o in original.graph.output] == [o.name for o in rewritten.graph.output]
    assert [i.name for i in original.graph.input] == [i.name for i in rewritten.graph.input]
    a = make_session(original, level="disable")
    b = make_session(rewritten, level="disable")
    for batch, seq in sizes:
        f = symbolic_feeds(original, batch, seq)
        for x, y in zip(a.run(None, f), b.run(None, f)):
            assert x.shape == y.shape
            np.testing.assert_array_equal(x, y)


def pointwise_model(text: str, opset: int = 17) -> onnx.ModelProto:
    """A model with one Pointwise node running `text`. Graph inputs are named in0.. and outputs
    out0..; bf16 values cross the graph boundary as float32 through Cast nodes, since numpy and
    onnxruntime's Python API have no bfloat16."""
    prog = Program.parse(text)
    nodes, inputs, outputs, value_info = [], [], [], []
    node_in, node_out = [], []
    for i, spec in enumerate(prog.inputs):
        if spec.dtype == "bf16":
            inputs.append(helper.make_tensor_value_info(f"in{i}", TensorProto.FLOAT, None))
            nodes.append(helper.make_node("Cast", [f"in{i}"], [f"x{i}"], to=TensorProto.BFLOAT16))
            node_in.append(f"x{i}")
        else:
            inputs.append(helper.make_tensor_value_info(f"in{i}", ONNX_ELEM[spec.dtype], None))
            node_in.append(f"in{i}")
    for o, spec in enumerate(prog.outputs):
        if spec.dtype == "bf16":
            node_out.append(f"y{o}")
            value_info.append(helper.make_tensor_value_info(f"y{o}", TensorProto.BFLOAT16, None))
            nodes.append(helper.make_node("Cast", [f"y{o}"], [f"out{o}"], to=TensorProto.FLOAT))
            outputs.append(helper.make_tensor_value_info(f"out{o}", TensorProto.FLOAT, None))
        else:
            node_out.append(f"out{o}")
            outputs.append(helper.make_tensor_value_info(f"out{o}", ONNX_ELEM[spec.dtype], None))
    nodes.insert(0, helper.make_node("Pointwise", node_in, node_out, name="pw", domain="onnxfuse", program=text))
    graph = helper.make_graph(nodes, "pointwise", inputs, outputs, value_info=value_info)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("onnxfuse", 1)]
    )
    model.ir_version = 10
    return model


def with_fused_op_set(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """A copy of an optimized model whose fused nodes say they need the onnxfuse op set `version`."""
    from onnxfuse.fused import OPSET_ATTRIBUTE

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        for a in node.attribute:
            if a.name == OPSET_ATTRIBUTE:
                a.i = version
    return copy
