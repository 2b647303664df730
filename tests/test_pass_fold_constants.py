"""fold-constants: what depends only on constants and static shapes is computed once, before
fusing, as onnxruntime computes it at load time.

T5's relative-position bias (TorchScript export) computes its buckets from the sequence length
alone: Shape -> Range -> Sub -> Abs -> Cast -> Div -> Log -> Mul -> Cast -> Min -> Gather. The
pointwise pass fused the Log and its neighbours into a region that onnxruntime cannot fold: T5
encoder went from 80 to 88 kernels and 1.02-1.035x the latency of onnxruntime alone.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.api import optimize
from onnxfuse.fuzz import optimize_model
from onnxfuse.runtime import executed_graph

S, D, BUCKETS = 8, 16, 6


def relative_position_model(seq: int | str = S) -> onnx.ModelProto:
    """scores = x x^T + bias[bucket(|j - i|)], with the bucket computed as T5 does for large
    distances (log of the distance), read from the sequence length of x."""
    rng = np.random.default_rng(0)
    c = lambda name, v: numpy_helper.from_array(np.asarray(v), name)  # noqa: E731
    inits = [
        c("one_idx", np.array(1, np.int64)), c("zero", np.array(0, np.int64)), c("step", np.array(1, np.int64)),
        c("ax0", np.array([0], np.int64)), c("ax1", np.array([1], np.int64)),
        c("exact", np.array(2.0, np.float32)), c("scale", np.array(1.7, np.float32)),
        c("top", np.array(BUCKETS - 1, np.int64)), c("tiny", np.array(1.0, np.float32)),
        c("table", rng.standard_normal((BUCKETS,)).astype(np.float32)),
    ]
    n = helper.make_node
    nodes = [
        n("Shape", ["x"], ["shape"], name="shape"),
        n("Gather", ["shape", "one_idx"], ["len"], name="len", axis=0),
        n("Range", ["zero", "len", "step"], ["pos"], name="range"),
        n("Unsqueeze", ["pos", "ax0"], ["pos_k"], name="pos_k"),
        n("Unsqueeze", ["pos", "ax1"], ["pos_q"], name="pos_q"),
        n("Sub", ["pos_k", "pos_q"], ["rel"], name="rel"),
        n("Abs", ["rel"], ["dist"], name="dist"),
        n("Cast", ["dist"], ["distf"], name="distf", to=TensorProto.FLOAT),
        n("Add", ["distf", "tiny"], ["distf1"], name="distf1"),
        n("Div", ["distf1", "exact"], ["ratio"], name="ratio"),
        n("Log", ["ratio"], ["logr"], name="log"),
        n("Mul", ["logr", "scale"], ["scaled"], name="scaled"),
        n("Cast", ["scaled"], ["bucket_raw"], name="bucket_raw", to=TensorProto.INT64),
        n("Max", ["bucket_raw", "zero"], ["bucket_lo"], name="bucket_lo"),
        n("Min", ["bucket_lo", "top"], ["bucket"], name="bucket"),
        n("Gather", ["table", "bucket"], ["bias"], name="bias", axis=0),
        n("Transpose", ["x"], ["xt"], name="xt", perm=[0, 2, 1]),
        n("MatMul", ["x", "xt"], ["qk"], name="qk"),
        n("Add", ["qk", "bias"], ["scores"], name="add_bias"),
        n("Softmax", ["scores"], ["y"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "relpos", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, seq])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _ops(model: onnx.ModelProto) -> list[str]:
    return sorted(n.op_type for n in model.graph.node)


def test_shape_only_values_are_folded_before_fusing():
    model = relative_position_model()
    result = optimize(model, threads=1)
    assert result.verification.ok
    # Everything up to the bias is one constant; what is left is what onnxruntime runs.
    assert _ops(result.model) == ["Add", "MatMul", "Softmax", "Transpose"]
    assert result.summary["kernels_after"] <= result.summary["kernels_before"]
    executed = executed_graph(result.model)
    assert "Log" not in {n.op_type for n in executed.graph.node}


def test_folded_values_are_what_onnxruntime_computes():
    """Bit for bit: fold-constants runs onnxruntime's own kernels."""
    model = relative_position_model()
    out = optimize_model(model, passes=["fold-constants"])
    bias = next(i for i in out.graph.initializer if i.name == "bias")
    ort_folded = next(i for i in executed_graph(model, with_library=False).graph.initializer if i.name == "bias")
    np.testing.assert_array_equal(numpy_helper.to_array(bias), numpy_helper.to_array(ort_folded))


def test_symbolic_sequence_leaves_the_chain_to_run_time():
    out = optimize_model(relative_position_model("seq"), passes=["fold-constants"])
    assert "Log" in _ops(out) and "Range" in _ops(out)


def test_pointwise_leaves_a_large_constant_broadcast_to_onnxruntime():
    """An Expand of a small constant to a large tensor is not written into the file; onnxruntime
    folds it at load time, and no region takes the ops that only read it."""
    n = helper.make_node
    big = [1, 512, 512]
    nodes = [
        n("Expand", ["c", "shape"], ["e"], name="expand"),
        n("Neg", ["e"], ["ne"], name="neg"),
        n("Exp", ["ne"], ["m"], name="exp"),
        n("Add", ["x", "m"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, big)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, big)],
        [numpy_helper.from_array(np.array([0.5], np.float32), "c"), numpy_helper.from_array(np.array(big, np.int64), "shape")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    out = optimize_model(m)
    assert sum(i.ByteSize() for i in out.graph.initializer) < 4096
    assert "Pointwise" not in _ops(out)


def scaled_scores_model() -> onnx.ModelProto:
    """torch's scaled_dot_product_attention as the TorchScript exporter writes it (torchvision's
    ViT): q and kT each multiplied by sqrt(1 / sqrt(head size)), the head size read from q's
    shape, then Softmax(q' @ kT') @ v, with a residual Add and an Exp around it."""
    n = helper.make_node
    c = lambda name, v: numpy_helper.from_array(np.asarray(v), name)  # noqa: E731
    nodes = [
        n("Shape", ["q"], ["qs"], name="qs"),
        n("Gather", ["qs", "last"], ["hd"], name="hd", axis=0),
        n("Cast", ["hd"], ["hdf"], name="hdf", to=TensorProto.FLOAT),
        n("Sqrt", ["hdf"], ["sq"], name="sq"),
        n("Div", ["one", "sq"], ["scale"], name="scale"),
        n("Sqrt", ["scale"], ["root"], name="root"),
        n("Mul", ["q", "root"], ["qr"], name="qr"),
        n("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
        n("Mul", ["kt", "root"], ["ktr"], name="ktr"),
        n("MatMul", ["qr", "ktr"], ["s"], name="qk"),
        n("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        n("MatMul", ["p", "v"], ["o"], name="pv"),
        n("Add", ["o", "q"], ["r"], name="residual"),
        n("Exp", ["r"], ["y"], name="exp"),
    ]
    vi = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [4, S, D])  # noqa: E731
    graph = helper.make_graph(nodes, "sdpa", [vi("q"), vi("k"), vi("v")], [vi("y")],
                              [c("last", np.array(-1, np.int64)), c("one", np.array(1.0, np.float32))])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_scale_from_the_head_size_stays_onnxruntimes_fused_matmul():
    """The scale depended on q's shape, so no rule saw a constant: the Muls went into regions
    and onnxruntime lost its FusedMatMul (ViT, TorchScript: 104 to 114 kernels)."""
    model = scaled_scores_model()
    before = [n.op_type for n in executed_graph(model, with_library=False).graph.node]
    assert before.count("FusedMatMul") == 1
    result = optimize(model, threads=1)
    after = [n.op_type for n in executed_graph(result.model).graph.node]
    assert after.count("FusedMatMul") == 1
    assert result.summary["kernels_after"] <= result.summary["kernels_before"]
