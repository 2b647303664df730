"""shape-plumbing: run-time Reshape/Expand targets become constants, dynamic dims keep working.

Each rewritten model is compared with the original in onnxruntime (graph optimizations off) for
batch 1 and 3 and seq 1 and 7.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxfuse.pipeline import Context, run_passes, select_passes
from onnxfuse.profile import count_kernels
from onnxfuse.runtime import make_session
from small_models import SIZES, GraphBuilder, assert_same_outputs, symbolic_feeds

GPT_STACK = Path(__file__).resolve().parents[1] / "models" / "gpt_stack.onnx"


def i64(*v):
    return np.array(v, dtype=np.int64)


class Builder(GraphBuilder):
    """Exporter-style graphs: every x.size(i) is its own Shape -> Gather."""

    def op(self, op, ins, **kw):
        return self.node(op, ins, **kw)

    def size(self, t, i):
        return self.op("Gather", [self.op("Shape", [t]), self.const(np.array(i, np.int64))], axis=0)

    def unsq(self, scalar):
        return self.op("Unsqueeze", [scalar, self.const(i64(0))])

    def target(self, *parts):
        """Concat of scalars (unsqueezed) and ints (constants)."""
        ins = [self.const(i64(p)) if isinstance(p, int) else self.unsq(p) for p in parts]
        return self.op("Concat", ins, axis=0)

    def model(self, inputs, output, opset=17):
        graph = helper.make_graph(
            self.nodes, "g",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
            self.initializers(),
        )
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = 10
        inferred = onnx.shape_inference.infer_shapes(m)
        m.graph.output[0].type.CopyFrom(inferred.graph.output[0].type)
        onnx.checker.check_model(m)
        return m


def plumb(model):
    out, stats = run_passes(model, select_passes(["shape-plumbing"], "cpu"), Context())
    onnx.checker.check_model(out)
    return out, stats[0].matches


def ops(model):
    return [n.op_type for n in model.graph.node]


def reshape_targets(model):
    inits = {i.name: onnx.numpy_helper.to_array(i).tolist() for i in model.graph.initializer}
    return [inits.get(n.input[1]) for n in model.graph.node if n.op_type == "Reshape"]


def test_split_heads_target_from_the_reshaped_tensor_becomes_zeros_and_constants():
    b = Builder()
    x = b.op("Relu", ["x"])
    heads = b.op("Div", [b.size(x, 2), b.const(np.array(4, np.int64))])
    y = b.op("Reshape", [x, b.target(b.size(x, 0), b.size(x, 1), 4, heads)])
    m = b.model([("x", ["batch", "seq", 16])], y)
    out, n = plumb(m)
    assert n >= 1 and reshape_targets(out) == [[0, 0, 4, 4]]
    assert not {"Shape", "Gather", "Concat", "Unsqueeze", "Div"} & set(ops(out))
    assert_same_outputs(m, out)


def test_target_from_another_tensor_with_the_same_symbolic_dims():
    # The common GPT case: B, T, C = x.size() of the block input, view() of the projection.
    b = Builder()
    qkv = b.op("MatMul", ["x", b.const(np.ones((16, 48), np.float32))])
    q = b.op("Slice", [qkv, b.const(i64(0)), b.const(i64(16)), b.const(i64(2))])
    y = b.op("Reshape", [q, b.target(b.size("x", 0), b.size("x", 1), 2, 8)])
    y = b.op("Transpose", [y], perm=[0, 2, 1, 3])
    m = b.model([("x", ["batch", "seq", 16])], y)
    out, n = plumb(m)
    assert n >= 1 and reshape_targets(out) == [[0, 0, 2, 8]]
    assert "Shape" not in ops(out)
    assert_same_outputs(m, out)


def test_flatten_of_leading_dims_uses_minus_one():
    b = Builder()
    x = b.op("Relu", ["x"])
    y = b.op("Reshape", [x, b.target(b.op("Mul", [b.size(x, 0), b.size(x, 1)]), b.size(x, 2))])
    m = b.model([("x", ["batch", "seq", 6])], y)
    out, n = plumb(m)
    assert n >= 1 and reshape_targets(out) == [[-1, 6]]
    assert_same_outputs(m, out)


def test_target_that_reorders_dynamic_dims_is_kept():
    # [B, S, C] -> [S, B, C] is a valid reshape that neither 0 nor -1 can write.
    b = Builder()
    x = b.op("Relu", ["x"])
    y = b.op("Reshape", [x, b.target(b.size(x, 1), b.size(x, 0), b.size(x, 2))])
    m = b.model([("x", ["batch", "seq", 6])], y)
    out, n = plumb(m)
    assert reshape_targets(out) == [None] and "Shape" in ops(out)
    assert_same_outputs(m, out)


def test_restoring_dims_from_another_tensor_after_a_flatten_is_kept():
    # HF GPT-2's Conv1D: [B*S, C] back to [B, S, C]; two dims unknown to the flat tensor.
    b = Builder()
    x = b.op("Relu", ["x"])
    flat = b.op("Reshape", [x, b.const(i64(-1, 6))])
    y = b.op("Reshape", [flat, b.target(b.size(x, 0), b.size(x, 1), 6)])
    m = b.model([("x", ["batch", "seq", 6])], y)
    out, n = plumb(m)
    assert reshape_targets(out) == [[-1, 6], None]
    assert_same_outputs(m, out)


def test_minus_one_beside_a_dynamic_dim_is_not_written():
    # [B, S, 2, 3] -> [B, S*6]: [0, -1] would fail in onnxruntime for an empty batch (it cannot
    # divide by a zero product), where the original works.
    b = Builder()
    x = b.op("Relu", ["x"])
    rest = b.op("Mul", [b.size(x, 1), b.const(np.array(6, np.int64))])
    y = b.op("Reshape", [x, b.target(b.size(x, 0), rest)])
    m = b.model([("x", ["batch", "seq", 2, 3])], y)
    out, n = plumb(m)
    assert reshape_targets(out) == [None]
    assert_same_outputs(m, out, sizes=SIZES + ((0, 4),))


def test_allowzero_reshape_without_a_literal_zero_copies_dims_with_allowzero_off():
    # Every element is the dim itself or a nonzero constant: read with allowzero 0, copying the
    # dims gives the same target, zero-sized dims included.
    b = Builder()
    x = b.op("Relu", ["x"])
    y = b.op("Reshape", [x, b.target(b.size(x, 0), b.size(x, 1), 2, 2)], allowzero=1)
    m = b.model([("x", ["batch", "seq", 4])], y)
    out, n = plumb(m)
    assert reshape_targets(out) == [[0, 0, 2, 2]]
    [node] = [x for x in out.graph.node if x.op_type == "Reshape"]
    assert {a.name: a.i for a in node.attribute}.get("allowzero", 0) == 0
    assert_same_outputs(m, out, sizes=SIZES + ((0, 3),))


def test_allowzero_reshape_with_a_literal_zero_uses_no_zero_copies():
    b = Builder()
    x = b.op("Relu", ["x"])
    y = b.op("Reshape", [x, b.target(b.size(x, 0), b.size(x, 1), 0, 4)], allowzero=1)
    m = b.model([("x", ["batch", "seq", 0, 4])], y)
    out, n = plumb(m)
    assert reshape_targets(out) == [None]
    assert_same_outputs(m, out)


def test_heads_beside_copied_dims_are_computed_instead_of_minus_one():
    # [B, S, 64] -> [B, S, -1, 16]: -1 beside copies would be ambiguous at a zero dim; the
    # element count over the rest is 4 wherever the original reshape succeeds.
    b = Builder()
    x = b.op("Relu", ["x"])
    y = b.op("Reshape", [x, b.target(b.size(x, 0), b.size(x, 1), -1, 16)])
    m = b.model([("x", ["batch", "seq", 64])], y)
    out, n = plumb(m)
    assert reshape_targets(out) == [[0, 0, 4, 16]]
    assert_same_outputs(m, out)


def test_allowzero_reshape_with_one_dynamic_dim_copies_it():
    b = Builder()
    x = b.op("Relu", ["x"])
    y = b.op("Reshape", [x, b.target(b.size(x, 0), 2, 2)], allowzero=1)
    m = b.model([("x", ["batch", 4])], y)
    out, n = plumb(m)
    assert reshape_targets(out) == [[0, 2, 2]]
    assert_same_outputs(m, out, sizes=SIZES + ((0, 1),))


def test_shape_arithmetic_on_static_dims_is_folded():
    b = Builder()
    x = b.op("Relu", ["x"])
    n_cols = b.op("Mul", [b.size(x, 1), b.const(np.array(2, np.int64))])
    cols = b.op("Cast", [b.op("Range", [b.const(np.array(0, np.int64)), n_cols, b.const(np.array(1, np.int64))])], to=TensorProto.FLOAT)
    y = b.op("Add", [b.op("Concat", [x, x], axis=1), cols])
    m = b.model([("x", ["batch", 3])], y)
    out, n = plumb(m)
    assert n >= 1 and "Shape" not in ops(out) and "Range" in ops(out)
    assert_same_outputs(m, out)


def test_expand_target_of_matching_dims_becomes_ones():
    b = Builder()
    x = b.op("ReduceMean", ["x"], axes=[1], keepdims=1)  # [batch, 1, 4]
    y = b.op("Expand", [x, b.target(b.size(x, 0), 5, b.size(x, 2))])
    m = b.model([("x", ["batch", "seq", 4])], y)
    out, n = plumb(m)
    expand = next(nd for nd in out.graph.node if nd.op_type == "Expand")
    target = next(onnx.numpy_helper.to_array(i).tolist() for i in out.graph.initializer if i.name == expand.input[1])
    assert target == [1, 5, 4] and "Shape" not in ops(out)
    assert_same_outputs(m, out)


def test_expand_to_a_dim_of_another_tensor_is_kept():
    b = Builder()
    x = b.op("ReduceMean", ["x"], axes=[1], keepdims=1)  # [batch, 1, 4]
    y = b.op("Expand", [x, b.target(b.size("x", 0), b.size("x", 1), 4)])
    m = b.model([("x", ["batch", "seq", 4])], y)
    out, n = plumb(m)
    assert "Shape" in ops(out)
    assert_same_outputs(m, out)


def test_equal_shape_values_of_different_tensors_are_computed_once():
    # Two blocks each read seq from their own input; the values are the same symbolic dim.
    b = Builder()
    h1 = b.op("Relu", ["x"])
    h2 = b.op("Sigmoid", [h1])
    outs = []
    for h in (h1, h2):
        n = b.op("Cast", [b.op("Range", [b.const(np.array(0, np.int64)), b.size(h, 1), b.const(np.array(1, np.int64))])], to=TensorProto.FLOAT)
        outs.append(b.op("Add", [h, b.op("Unsqueeze", [n, b.const(i64(0))])]))
    y = b.op("Add", outs)
    m = b.model([("x", ["batch", "seq"])], y)
    out, n = plumb(m)
    assert ops(m).count("Shape") == 2 and ops(out).count("Shape") == 1
    assert_same_outputs(m, out)


def test_equal_shape_values_are_read_from_the_one_of_fewest_steps_whatever_the_node_order():
    """Before: from the first in node order, which under graphsurgeon's order (by depth) was the
    shallowest; with the exporter's order kept, the zoo's decode steps read their batch from the
    model's Shape -> Gather -> Unsqueeze instead of a Slice of the Shape (4 nodes more)."""
    b = Builder()
    seq = b.op("Unsqueeze", [b.size("x", 1), b.const(i64(0))])  # three steps, first in the graph
    seq_slice = b.op("Slice", [b.op("Shape", ["x"]), b.const(i64(1)), b.const(i64(2))])  # two
    ones = [b.op("ConstantOfShape", [s], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))
            for s in (seq, seq_slice)]
    y = b.op("Add", [b.op("Add", ["x", ones[0]]), ones[1]])
    m = b.model([("x", ["batch", "seq"])], y)
    out, _ = plumb(m)
    produced = {o: n.op_type for n in out.graph.node for o in n.output}
    read = {produced[n.input[0]] for n in out.graph.node if n.op_type == "ConstantOfShape"}
    assert read == {"Slice"}
    assert "Gather" not in ops(out)
    assert_same_outputs(m, out)


def test_broadcast_facts_hold_for_every_size():
    from onnxfuse.graph.shape_values import _min_name, broadcast_dim

    assert broadcast_dim("seq", _min_name("seq", 64)) == "seq"
    assert broadcast_dim(_min_name("seq", 64), "seq") == "seq"
    assert broadcast_dim("batch", 1) == "batch"
    # Different names may broadcast either way (one of them may be 1): nothing is claimed.
    assert broadcast_dim("seq", _min_name("other", 64)) is None
    assert broadcast_dim("seq", "batch") is None
    assert broadcast_dim("seq", None) is None
    # The claim itself, by brute force: broadcast(s, min(s, D)) == s wherever it is defined.
    for d in (1, 3, 64):
        for s_ in range(0, 70):
            m = min(s_, d)
            if s_ == m or s_ == 1 or m == 1:
                assert np.broadcast_shapes((s_,), (m,)) == (s_,)


@pytest.mark.skipif(not GPT_STACK.exists(), reason="models/gpt_stack.onnx is not generated")
def test_gpt_stack_keeps_outputs_and_runs_fewer_kernels():
    m = onnx.load(str(GPT_STACK))
    out, n = plumb(m)
    assert n > 0
    # Every view becomes constant: split heads [0, 0, 4, 32]; merge heads [0, 0, 128], which
    # needs the sliced causal mask's broadcast and Range(0, seq) to keep the seq dim's name.
    targets = reshape_targets(out)
    assert targets.count([0, 0, 4, 32]) == 12 and targets.count([0, 0, 128]) == 4
    a = make_session(m, level="disable")
    b = make_session(out, level="disable")
    for batch, seq in SIZES:
        f = symbolic_feeds(m, batch, seq)
        np.testing.assert_array_equal(a.run(None, f)[0], b.run(None, f)[0])
    assert kernels_per_run(out) < kernels_per_run(m)


def kernels_per_run(model, batch=2, seq=16):
    """Kernels onnxruntime runs for one inference: ORT_ENABLE_ALL, CPU, 1 thread."""
    return count_kernels(model, "cpu", 1, "all", {"batch": batch, "seq": seq})[0]


if __name__ == "__main__":
    # The measurement quoted in the report: python tests/test_pass_shape_plumbing.py
    model = onnx.load(str(GPT_STACK))
    rewritten, matches = plumb(model)
    before, after = kernels_per_run(model), kernels_per_run(rewritten)
    print(f"gpt_stack: {before} -> {after} kernels per inference ({before - after} removed; "
          f"{len(model.graph.node)} -> {len(rewritten.graph.node)} nodes)")


def test_refined_dims_follow_a_torchscript_expand_with_minus_one_handling():
    # x.expand(B, 1, S, S) as the TorchScript exporter writes it: the target goes through
    # Where(Equal(t, -1 * ConstantOfShape(Shape(t))), ones, t); dims are never -1, so the
    # Where gives t, and the expanded Range over the sequence is [B, 1, S, S] (T5's mask).
    import onnx_graphsurgeon as gs

    from onnxfuse.graph.facts import ShapeTable
    from onnxfuse.graph.shape_values import refined_dims

    b = Builder()
    x = b.op("Relu", ["x"])
    seq = b.size(x, 1)
    rng = b.op("Range", [b.const(np.array(0, np.int64)), seq, b.const(np.array(1, np.int64))])
    row = b.op("Unsqueeze", [rng, b.const(i64(0, 1, 2))])  # [1, 1, 1, S]
    t = b.op("Reshape", [b.target(b.size(x, 0), 1, seq, seq), b.const(i64(-1))])
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    ones = b.op("ConstantOfShape", [b.op("Shape", [t])], value=one)
    minus = b.op("Mul", [ones, b.const(np.array(-1, np.int64))])
    target = b.op("Where", [b.op("Equal", [t, minus]), ones, t])
    expanded = b.op("Expand", [row, target])
    y = b.op("Cast", [expanded], to=TensorProto.FLOAT)
    m = b.model([("x", ["batch", "seq", 3])], y)
    g = gs.import_onnx(m)
    assert ShapeTable(g).dims(g.tensors()[expanded])[0] != "batch"  # inference alone
    shapes, _ = refined_dims(g, ShapeTable(g))
    assert shapes.dims(g.tensors()[expanded]) == ["batch", 1, "seq", "seq"]
    out, n = plumb(m)
    assert_same_outputs(m, out)
