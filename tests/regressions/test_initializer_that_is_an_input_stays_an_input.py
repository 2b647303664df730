"""An initializer with the name of a graph input is, from IR 4 on, that input's default value:
the caller may feed another. onnx-graphsurgeon made it a constant and dropped the input, so the
optimized model (exit 0, verified on the default alone) folded the default into its fused node
and refused a feed of that input. Only IR 3 models list initializers as inputs to be dropped."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.runtime import make_session


def _model(ir_version: int) -> onnx.ModelProto:
    b = numpy_helper.from_array(np.full((4,), 2.0, np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "b"], ["t"]), helper.make_node("Relu", ["t"], ["u"]),
         helper.make_node("Mul", ["u", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=ir_version)


def _run(model, feeds):
    return make_session(model, threads=1).run(None, feeds)[0]


def test_an_overridable_default_stays_an_input_and_a_default(tmp_path, cli):
    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    original = _model(8)
    onnx.save(original, str(src))
    assert cli("optimize", src, out).exit_code == 0
    optimized = onnx.load(str(out))
    assert any(n.domain == "onnxfuse" for n in optimized.graph.node)  # the chain is still fused
    assert [i.name for i in optimized.graph.input] == ["x", "b"]
    assert [t.name for t in optimized.graph.initializer] == ["b"]
    x = np.linspace(-3, 3, 8, dtype=np.float32).reshape(2, 4)
    other = np.array([1.0, -1.0, 0.5, 4.0], np.float32)
    for feeds in ({"x": x}, {"x": x, "b": other}):
        np.testing.assert_array_equal(_run(optimized, feeds), _run(original, feeds))


def test_an_ir3_initializer_listed_as_input_is_still_a_constant(tmp_path, cli):
    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(_model(3), str(src))
    assert cli("optimize", src, out).exit_code == 0
    optimized = onnx.load(str(out))
    assert [i.name for i in optimized.graph.input] == ["x"]
