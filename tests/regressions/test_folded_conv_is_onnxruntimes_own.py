"""Fuzz seed 9243255: Conv -> BatchNormalization -> ... -> Sin of a large product. fold-batchnorm
folded the BatchNormalization into the Conv's weights in double; onnxruntime folds the same pair
itself (its Conv+BatchNormalization fusion) in float, and the two Convs differed by an ulp that
the Sin turned into 1.6. Folded in the weights' own type and in onnxruntime's order, the folded
Conv is the one onnxruntime runs for the original, bit for bit: Conv+BatchNormalization with and
without a bias, Conv+Mul and Conv+Add."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.fuzz import optimize_model

C = 16


def _model(reader: str, with_bias: bool, seed: int) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    f = np.float32
    inits = {"w": rng.standard_normal((C, 1, 3, 3)).astype(f)}
    conv_inputs = ["x", "w"]
    if with_bias:
        inits["cb"] = (3 * rng.standard_normal(C)).astype(f)
        conv_inputs.append("cb")
    nodes = [helper.make_node("Conv", conv_inputs, ["c"], group=C, kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    if reader == "BatchNormalization":
        inits.update(s=rng.standard_normal(C).astype(f), b=rng.standard_normal(C).astype(f),
                     m=(5 * rng.standard_normal(C)).astype(f), v=rng.uniform(0.1, 2, C).astype(f))
        nodes.append(helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["y"], epsilon=1e-3))
    else:
        inits["k"] = rng.standard_normal((1, C, 1, 1)).astype(f)
        nodes.append(helper.make_node(reader, ["c", "k"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, 8, 8])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("reader,with_bias", [("BatchNormalization", True), ("BatchNormalization", False),
                                              ("Mul", True), ("Add", True)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_folded_conv_is_bit_for_bit_the_one_onnxruntime_folds_itself(reader, with_bias, seed):
    model = _model(reader, with_bias, seed)
    optimized = optimize_model(model, passes=["fold-batchnorm"])
    assert [n.op_type for n in optimized.graph.node] == ["Conv"]
    x = (30 * np.random.default_rng(seed + 10).standard_normal((1, C, 8, 8))).astype(np.float32)
    np.testing.assert_array_equal(_run(optimized, x), _run(model, x))
