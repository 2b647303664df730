"""Small hand-built test models: float32 models in one call (opset 17, IR 10), seeded inputs for
their symbolic dims, and the check that a rewrite computes the same bits."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper


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
