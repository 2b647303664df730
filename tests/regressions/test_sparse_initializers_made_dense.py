"""Sparse initializers were lost: graphsurgeon reads dense initializers only, so verification
failed (exit 1), and with --no-verify the written model computed with a missing weight. They are
now made dense on load (normalize.densify_sparse), sparse Constant values too."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import stderr_lines
from onnxfuse.runtime import make_session


def _sparse(indices, dims=(3, 4), name="w") -> onnx.SparseTensorProto:
    values = numpy_helper.from_array(np.array([1.5, -2.0, 3.0], np.float32), name)
    return helper.make_sparse_tensor(values, numpy_helper.from_array(np.array(indices, np.int64), f"{name}_i"), list(dims))


def _model(constant: bool, indices=(1, 5, 10)) -> onnx.ModelProto:
    nodes = [helper.make_node("Add", ["x", "w"], ["t"]), helper.make_node("Relu", ["t"], ["u"]),
             helper.make_node("Mul", ["u", "x"], ["y"])]
    if constant:
        nodes.insert(0, helper.make_node("Constant", [], ["w"], sparse_value=_sparse(indices)))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])])
    if not constant:
        graph.sparse_initializer.append(_sparse(indices))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("constant", [False, True], ids=["initializer", "constant"])
@pytest.mark.parametrize("verify", [True, False], ids=["verified", "no-verify"])
def test_sparse_weights_are_kept_as_dense_ones(tmp_path, cli, constant, verify):
    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    original = _model(constant)
    onnx.checker.check_model(original)
    onnx.save(original, str(src))
    result = cli("optimize", src, out, *([] if verify else ["--no-verify"]))
    assert result.exit_code == 0, result.stderr
    optimized = onnx.load(str(out))
    assert any(n.domain == "onnxfuse" for n in optimized.graph.node)
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    want = make_session(original, threads=1).run(None, {"x": x})[0]
    np.testing.assert_array_equal(make_session(optimized, threads=1).run(None, {"x": x})[0], want)
    np.testing.assert_array_equal(want[2, 2], (x[2, 2] + np.float32(3)) * x[2, 2])  # the sparse value is read


def test_sparse_coordinates_and_bad_indices(tmp_path, cli):
    from onnxfuse.normalize import dense_tensor

    dense = numpy_helper.to_array(dense_tensor(_sparse([[0, 1], [1, 1], [2, 2]])))
    assert dense[0, 1] == 1.5 and dense[1, 1] == -2.0 and dense[2, 2] == 3.0 and np.count_nonzero(dense) == 3
    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(_model(False, indices=(1, 5, 12)), str(src))  # 12 is past the 12 elements
    result = cli("optimize", src, out)
    assert result.exit_code == 2
    (line,) = stderr_lines(result)
    assert "sparse tensor 'w'" in line and not out.exists()
