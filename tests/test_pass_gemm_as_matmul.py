"""gemm-as-matmul: Reshape -> Gemm -> Reshape back becomes one MatMul on the unflattened tensor.

Every rewritten model is run in onnxruntime (its optimizations off) against the original at
several batch and sequence lengths.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxfuse.pipeline import Context, run_passes, select_passes
from small_models import assert_same_outputs

K, N = 8, 6
RNG = np.random.default_rng(0)
W = RNG.standard_normal((K, N)).astype(np.float32)
C = RNG.standard_normal(N).astype(np.float32)


def _model(gemm_inputs=("flat", "w"), restore=("batch_dim", "seq_dim", "n"), flat_target="flat_shape",
           extra_nodes=(), extra_outputs=(), **gemm_attrs):
    """x [batch, seq, K] -> Reshape(flat_target) -> Gemm -> Reshape(Concat of `restore`) -> y,
    the restoring target built from Shape(x) as the TorchScript exporter writes it."""
    inits = {
        "w": W, "wt": np.ascontiguousarray(W.T), "c": C, "c2": C.reshape(1, N),
        "flat_shape": np.array([-1, K], np.int64), "flat_wrong": np.array([-1, 2 * K], np.int64),
        "i0": np.array(0, np.int64), "i1": np.array(1, np.int64), "axes0": np.array([0], np.int64),
        "n": np.array([N], np.int64),
    }
    nodes = [
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Gather", ["xs", "i0"], ["b0"], axis=0),
        helper.make_node("Gather", ["xs", "i1"], ["s0"], axis=0),
        helper.make_node("Unsqueeze", ["b0", "axes0"], ["batch_dim"]),
        helper.make_node("Unsqueeze", ["s0", "axes0"], ["seq_dim"]),
        helper.make_node("Concat", list(restore), ["target"], axis=0),
        helper.make_node("Reshape", ["x", flat_target], ["flat"]),
        helper.make_node("Gemm", list(gemm_inputs), ["mm"], **gemm_attrs),
        helper.make_node("Reshape", ["mm", "target"], ["y"]),
        *extra_nodes,
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["d0", "d1", N]),
         *(helper.make_tensor_value_info(o, TensorProto.FLOAT, ["rows", K]) for o in extra_outputs)],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


def _optimize(model):
    out, stats = run_passes(model, select_passes(["gemm-as-matmul"], "cpu"), Context())
    onnx.checker.check_model(out)
    return out, sum(s.matches for s in stats)


def _ops(model):
    return sorted(n.op_type for n in model.graph.node)


def _assert_close(original, rewritten):
    """The same values (a 3-D MatMul may sum in another order than the 2-D Gemm)."""
    from onnxfuse.runtime import make_session

    a, b = make_session(original, level="disable"), make_session(rewritten, level="disable")
    for batch, seq in ((1, 1), (2, 5), (3, 7)):
        x = RNG.standard_normal((batch, seq, K)).astype(np.float32)
        for u, v in zip(a.run(None, {"x": x}), b.run(None, {"x": x})):
            assert u.shape == v.shape
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


def test_flattened_projection_becomes_one_matmul():
    m = _model()
    out, n = _optimize(m)
    assert n == 1 and _ops(out) == ["MatMul"]  # the Shape arithmetic loses its reader too
    _assert_close(m, out)


def test_flattened_projection_with_bias_becomes_matmul_and_bias_add():
    m = _model(gemm_inputs=("flat", "w", "c2"))
    out, n = _optimize(m)
    assert n == 1 and _ops(out) == ["Add", "MatMul"]
    add = next(nd for nd in out.graph.node if nd.op_type == "Add")
    bias = next(i for i in out.graph.initializer if i.name in add.input)
    assert list(bias.dims) == [N]
    _assert_close(m, out)


def test_transposed_weight_is_transposed_once():
    m = _model(gemm_inputs=("flat", "wt"), transB=1)
    out, n = _optimize(m)
    assert n == 1 and _ops(out) == ["MatMul"]
    _assert_close(m, out)


def test_target_that_does_not_restore_the_leading_dims_is_left_alone():
    # [seq, batch, N]: the rows come back in another order than x's
    m = _model(restore=("seq_dim", "batch_dim", "n"))
    out, n = _optimize(m)
    assert n == 0 and "Gemm" in _ops(out)
    assert_same_outputs(m, out, sizes=((1, 1), (2, 2)))


def test_flattened_view_read_elsewhere_is_left_alone():
    m = _model(extra_nodes=[helper.make_node("Relu", ["flat"], ["z"])], extra_outputs=["z"])
    out, n = _optimize(m)
    assert n == 0 and "Gemm" in _ops(out)


def test_scaled_gemm_is_left_alone():
    m = _model(alpha=0.5)
    out, n = _optimize(m)
    assert n == 0 and "Gemm" in _ops(out)


def _heads_model(restore):
    """torch's MultiheadAttention output: Transpose(x) [5, batch, 2, K/2] -> Reshape [-1, K] ->
    Gemm(transB) -> Reshape(restore), a constant target."""
    inits = {"wt": np.ascontiguousarray(W.T), "flat": np.array([-1, K], np.int64), "target": np.array(restore, np.int64)}
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[2, 0, 1, 3]),
        helper.make_node("Reshape", ["xt", "flat"], ["f"]),
        helper.make_node("Gemm", ["f", "wt"], ["mm"], transB=1),
        helper.make_node("Reshape", ["mm", "target"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 5, K // 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["d0", "d1", "d2"])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _assert_close_heads(original, rewritten):
    from onnxfuse.runtime import make_session

    a, b = make_session(original, level="disable"), make_session(rewritten, level="disable")
    for batch in (1, 3):
        x = RNG.standard_normal((batch, 2, 5, K // 2)).astype(np.float32)
        for u, v in zip(a.run(None, {"x": x}), b.run(None, {"x": x})):
            assert u.shape == v.shape
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


def test_merged_head_dims_become_one_reshape_and_a_matmul():
    m = _heads_model([5, -1, N])
    out, n = _optimize(m)
    assert n == 1 and _ops(out) == ["MatMul", "Reshape", "Transpose"]
    _assert_close_heads(m, out)


def test_target_with_rows_in_another_grouping_is_left_alone():
    # [-1, 5, N] regroups the rows: batch-major instead of x's sequence-major order
    m = _heads_model([-1, 5, N])
    out, n = _optimize(m)
    assert n == 0 and "Gemm" in _ops(out)


def _step_model(seq, restore):
    """x [batch, seq, K] -> Reshape [-1, K] -> Gemm -> Reshape(`restore`, a constant): a decode
    step's projection once shape-plumbing made its restoring target [0, 1, N]."""
    inits = {"w": W, "flat_shape": np.array([-1, K], np.int64), "target": np.array(restore, np.int64)}
    nodes = [
        helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
        helper.make_node("Gemm", ["flat", "w"], ["mm"]),
        helper.make_node("Reshape", ["mm", "target"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["d0", "d1", N])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


def test_restoring_target_copying_the_rows_of_one_token_becomes_a_matmul():
    # [0, 1, N]: the 0 copies the Gemm's rows, batch * 1, which is the batch
    m = _step_model(1, [0, 1, N])
    out, n = _optimize(m)
    assert n == 1 and _ops(out) == ["MatMul"]
    from onnxfuse.runtime import make_session

    a, b = make_session(m, level="disable"), make_session(out, level="disable")
    for batch in (1, 3):
        x = RNG.standard_normal((batch, 1, K)).astype(np.float32)
        np.testing.assert_allclose(a.run(None, {"x": x})[0], b.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_restoring_target_copying_rows_that_are_not_the_batch_is_left_alone():
    # [0, 2, N] over [batch, 2, K]: the 0 copies batch * 2 rows, so the original fails there
    # (its element count doubles); a MatMul would run
    _, n = _optimize(_step_model(2, [0, 2, N]))
    assert n == 0
