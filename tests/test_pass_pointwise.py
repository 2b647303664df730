"""The pointwise-fusion pass: region formation, views and conditions.

Each rewritten model is checked against the original (pointwise_checks.check_equivalent). The
rules that leave ops to onnxruntime's own fusions are tested in test_ort_fusions.py.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from pointwise_checks import (
    F,
    GAMMA,
    RNG,
    ZOO,
    assert_same,
    check_equivalent,
    feeds_for,
    fuse,
    library_has_pointwise,
    model,
    node,
    ops,
    ort_kernels,
    pointwise_nodes,
    program_of,
    session,
)


# ----------------------------------------------------------------------------- regions


def test_connected_elementwise_ops_become_one_region():
    nodes = [
        node("Add", ["x", "y"], ["a"]),
        node("Relu", ["a"], ["r"]),
        node("Sigmoid", ["a"], ["s"]),
        node("Mul", ["r", "s"], ["m"]),
        node("Tanh", ["m"], ["z"]),
    ]
    m = model(nodes, [("x", ["N", 8]), ("y", [8])], [("z", ["N", 8])])
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    prog = program_of(out.graph.node[0])
    assert [i.op for i in prog.instrs] == ["add", "relu", "sigmoid", "mul", "tanh"]
    check_equivalent(m, out)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_casts_to_the_type_a_value_has_make_no_copy_region(target):
    # LLaMA's softmax(scores, dtype=float32).to(q.dtype) in a float32 model: two Casts from float
    # to float, which onnxruntime removes at load time; a region of them would be a copy kernel.
    nodes = [node("Softmax", ["x"], ["p"], axis=-1), node("Cast", ["p"], ["c"], to=F),
             node("Cast", ["c"], ["d"], to=F), node("MatMul", ["d", "w"], ["z"])]
    m = model(nodes, [("x", [2, 4])], [("z", [2, 4])], {"w": np.eye(4, dtype=np.float32)})
    assert pointwise_nodes(fuse(m, target)) == []
    # A Cast that changes the type still stores in another dtype: that region is work.
    nodes[2] = node("Cast", ["c"], ["d"], to=T.FLOAT16)
    nodes[3] = node("Cast", ["d"], ["z"], to=F)
    m = model(nodes, [("x", [2, 4])], [("z", [2, 4])])
    assert len(pointwise_nodes(fuse(m, target))) == 1


def test_value_read_outside_becomes_a_second_output():
    nodes = [
        node("Add", ["x", "b"], ["a"]),
        node("Tanh", ["a"], ["t"]),
        node("MatMul", ["t", "w"], ["mm"]),  # reads the intermediate: not elementwise
        node("Sigmoid", ["t"], ["s"]),
        node("Mul", ["s", "x"], ["z"]),
    ]
    m = model(nodes, [("x", [4, 8])], [("z", [4, 8]), ("mm", [4, 8])],
              {"b": np.linspace(-1, 1, 8, dtype=np.float32), "w": np.eye(8, dtype=np.float32)})
    out = fuse(m)
    (pw,) = pointwise_nodes(out)
    assert sorted(pw.output) == ["t", "z"]
    check_equivalent(m, out)


def test_graph_output_that_is_also_an_intermediate():
    nodes = [node("Relu", ["x"], ["r"]), node("Exp", ["r"], ["e"]), node("Neg", ["e"], ["z"])]
    m = model(nodes, [("x", [2, 3])], [("r", [2, 3]), ("z", [2, 3])])
    out = fuse(m)
    (pw,) = pointwise_nodes(out)
    assert sorted(pw.output) == ["r", "z"]
    assert [o.name for o in out.graph.output] == ["r", "z"]
    check_equivalent(m, out)


def test_merging_across_an_outside_node_would_make_a_cycle():
    # Exp -> Relu -> MatMul -> Add -> Tanh with Relu also read by Add: one region holding
    # Exp, Relu, Add and Tanh would both feed and read the MatMul.
    nodes = [
        node("Exp", ["x"], ["e"]),
        node("Relu", ["e"], ["r"]),
        node("MatMul", ["r", "w"], ["mm"]),
        node("Add", ["r", "mm"], ["a"]),
        node("Tanh", ["a"], ["z"]),
    ]
    # (rank 3: a 2-D MatMul + Add would be left to onnxruntime's Gemm)
    m = model(nodes, [("x", [2, 4, 4])], [("z", [2, 4, 4])], {"w": np.eye(4, dtype=np.float32) * 0.5})
    out = fuse(m)
    regions = pointwise_nodes(out)
    assert len(regions) == 2
    groups = sorted(sorted(i.op for i in program_of(n).instrs) for n in regions)
    assert groups == [["add", "tanh"], ["exp", "relu"]]
    check_equivalent(m, out)


def test_siblings_read_by_one_consumer_region_join_it():
    nodes = [
        node("Sigmoid", ["x"], ["a"]),
        node("Tanh", ["y"], ["b"]),
        node("Mul", ["a", "b"], ["z"]),
    ]
    m = model(nodes, [("x", [3, 5]), ("y", [3, 5])], [("z", [3, 5])])
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    check_equivalent(m, out)


def test_value_smaller_than_the_iteration_shape_is_not_an_output():
    # r = Relu(x) has shape [8] and is a graph output; the region around Add has shape [3, 8].
    nodes = [node("Relu", ["x"], ["r"]), node("Add", ["r", "y"], ["a"]), node("Tanh", ["a"], ["z"])]
    m = model(nodes, [("x", [8]), ("y", [3, 8])], [("z", [3, 8]), ("r", [8])])
    out = fuse(m)
    assert ops(out) == ["Pointwise", "Relu"]
    (pw,) = pointwise_nodes(out)
    assert list(pw.output) == ["z"]
    check_equivalent(m, out)


def test_smaller_value_used_only_inside_is_broadcast():
    # the [B, S, 1] statistic chain (Add eps, Sqrt) is read only by the [B, S, D] Div
    nodes = [
        node("Add", ["v", "eps"], ["ve"]),
        node("Sqrt", ["ve"], ["sd"]),
        node("Div", ["x", "sd"], ["n"]),
        node("Neg", ["n"], ["z"]),
    ]
    m = model(nodes, [("x", ["B", 4, 8]), ("v", ["B", 4, 1])], [("z", ["B", 4, 8])], {"eps": np.array(1e-5, np.float32)})
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    check_equivalent(m, out, dims={"B": 2})


def test_integer_values_stay_outside():
    nodes = [
        node("Cast", ["x"], ["xi"], to=T.INT64),
        node("Add", ["xi", "one"], ["ai"]),
        node("Cast", ["ai"], ["af"], to=F),
        node("Relu", ["af"], ["r"]),
        node("Mul", ["r", "x"], ["z"]),
    ]
    m = model(nodes, [("x", [3, 4])], [("z", [3, 4])], {"one": np.array(1, np.int64)})
    out = fuse(m)
    assert ops(out) == ["Add", "Cast", "Cast", "Pointwise"]
    check_equivalent(m, out)


def test_comparison_and_where_with_bool_values():
    nodes = [
        node("Greater", ["x", "y"], ["g"]),
        node("Not", ["g"], ["ng"]),
        node("Where", ["ng", "x", "y"], ["w"]),
        node("Cast", ["g"], ["gf"], to=F),
        node("Add", ["w", "gf"], ["z"]),
    ]
    m = model(nodes, [("x", [3, 4]), ("y", [4])], [("z", [3, 4]), ("ng", [3, 4], T.BOOL)])
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    check_equivalent(m, out)


def test_symbolic_dims_must_match_by_name():
    same = model([node("Add", ["x", "y"], ["a"]), node("Relu", ["a"], ["z"])], [("x", ["N", 4]), ("y", ["N", 4])], [("z", ["N", 4])])
    assert ops(fuse(same)) == ["Pointwise"]
    # Two different names: the output shape cannot be proved equal to the broadcast.
    other = model([node("Add", ["x", "y"], ["a"]), node("Relu", ["a"], ["z"])], [("x", ["N", 4]), ("y", ["M", 4])], [("z", [None, 4])])
    assert "Pointwise" not in ops(fuse(other))


def test_single_op_does_not_pay():
    m = model([node("Relu", ["x"], ["z"])], [("x", [3, 4])], [("z", [3, 4])])
    assert ops(fuse(m)) == ["Relu"]


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_an_erf_needs_one_more_op_to_pay_on_the_cpu(target):
    # The CPU erf is correctly rounded, in double: slower than onnxruntime's float32 Erf, so Erf and
    # one more op stay onnxruntime's there (its two kernels are faster); with two more they fuse.
    pair = model([node("Erf", ["x"], ["e"]), node("Mul", ["e", "x"], ["z"])], [("x", [3, 4])], [("z", [3, 4])])
    assert ops(fuse(pair, target)) == (["Erf", "Mul"] if target == "cpu" else ["Pointwise"])
    three = model([node("Erf", ["x"], ["e"]), node("Mul", ["e", "x"], ["m"]), node("Tanh", ["m"], ["z"])],
                  [("x", [3, 4])], [("z", [3, 4])])
    out = fuse(three, target)
    assert ops(out) == ["Pointwise"]
    if target == "cpu":
        check_equivalent(three, out)


def test_identity_and_dropout_count_as_no_work():
    m = model([node("Identity", ["x"], ["i"]), node("Relu", ["i"], ["z"])], [("x", [3, 4])], [("z", [3, 4])])
    assert "Pointwise" not in ops(fuse(m))
    m2 = model([node("Dropout", ["x"], ["d"]), node("Relu", ["d"], ["r"]), node("Exp", ["r"], ["z"])], [("x", [3, 4])], [("z", [3, 4])])
    out = fuse(m2)
    assert ops(out) == ["Pointwise"]
    check_equivalent(m2, out)


def test_equal_valued_constants_become_literals_and_others_inputs():
    inits = {
        "half": np.full((1, 4), 0.5, np.float32),  # all equal: literal
        "ramp": np.arange(4, dtype=np.float32),  # varying: a node input
        "big": np.full((2, 3, 4), 2.0, np.float32),  # all equal but grows the shape: an input
    }
    nodes = [node("Mul", ["x", "half"], ["a"]), node("Add", ["a", "ramp"], ["b"]), node("Mul", ["b", "big"], ["z"])]
    m = model(nodes, [("x", [3, 4])], [("z", [2, 3, 4])], inits)
    out = fuse(m)
    (pw,) = pointwise_nodes(out)
    assert list(pw.input) == ["x", "ramp", "big"]
    assert program_of(pw).instrs[0].args == ("x0", 0.5)
    check_equivalent(m, out)


def test_constant_node_operands_are_written_into_the_fallback():
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32))),
        node("Add", ["x", "c"], ["a"]),
        node("Exp", ["a"], ["z"]),
    ]
    m = model(nodes, [("x", [2, 3])], [("z", [2, 3])])
    out = fuse(m)
    assert "Pointwise" in ops(out)
    check_equivalent(m, out)


def test_float16_region():
    nodes = [node("Add", ["x", "y"], ["a"]), node("Sigmoid", ["a"], ["z"])]
    m = model(nodes, [("x", [3, 4]), ("y", [3, 4])], [("z", [3, 4])], elem=T.FLOAT16)
    out = fuse(m)
    (pw,) = pointwise_nodes(out)
    assert program_of(pw).inputs[0].dtype == "f16"
    feeds = feeds_for(m)
    assert_same(session(m).run(None, feeds), session(out).run(None, feeds), rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------- views


def test_slice_with_negative_and_odd_steps_is_read_as_a_view():
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    nodes = [
        node("Slice", ["x", "st", "en", "ax", "sp"], ["s"]),
        node("Relu", ["s"], ["z"]),
    ]
    inits = {"st": i64(-1, 1), "en": i64(-100, 9), "ax": i64(1, 0), "sp": i64(-3, 2)}
    m = model(nodes, [("x", [10, 11])], [("z", [4, 4])], inits)
    out = fuse(m)
    assert ops(out) == ["Pointwise"]  # one op and a Slice that disappears: pays
    (pw,) = pointwise_nodes(out)
    assert list(pw.input) == ["x"]
    view = program_of(pw).inputs[0].view
    assert [(v.axis, v.start, v.end, v.step) for v in view] == [(0, 1, 9, 2), (1, -1, -100, -3)]
    check_equivalent(m, out)


def test_split_outputs_are_views_and_the_split_disappears():
    nodes = [
        node("Split", ["x", "sizes"], ["a", "b", "c"], axis=1),
        node("Sigmoid", ["a"], ["sa"]),
        node("Tanh", ["b"], ["tb"]),
        node("Mul", ["sa", "tb"], ["m"]),
        node("Add", ["m", "c"], ["z"]),
    ]
    m = model(nodes, [("x", ["N", 12])], [("z", ["N", 4])], {"sizes": np.array([4, 4, 4], np.int64)})
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    (pw,) = pointwise_nodes(out)
    assert list(pw.input) == ["x", "x", "x"]
    assert [(i.view[0].start, i.view[0].end) for i in program_of(pw).inputs] == [(0, 4), (4, 8), (8, 12)]
    check_equivalent(m, out, dims={"N": 2})


def test_equal_split_of_a_static_dim_and_split_attribute_before_opset_13():
    nodes = [node("Split", ["x"], ["a", "b"], axis=-1), node("Mul", ["a", "b"], ["m"]), node("Exp", ["m"], ["z"])]
    m = model(nodes, [("x", [3, 8])], [("z", [3, 4])])
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    check_equivalent(m, out)
    nodes11 = [node("Split", ["x"], ["a", "b"], axis=1, split=[3, 5]), node("Relu", ["a"], ["r"]), node("Exp", ["r"], ["z"])]
    m11 = model(nodes11, [("x", [2, 8])], [("z", [2, 3]), ("b", [2, 5])], opset=11)
    out11 = fuse(m11)
    assert sorted(ops(out11)) == ["Pointwise", "Split"]  # b is a graph output: the Split stays
    check_equivalent(m11, out11)


def test_partially_fused_split_stays_for_its_other_readers():
    nodes = [
        node("Split", ["x", "sizes"], ["a", "b", "c"], axis=1),
        node("Sigmoid", ["a"], ["sa"]),
        node("Mul", ["sa", "b"], ["z"]),
        node("MatMul", ["c", "w"], ["mm"]),
    ]
    m = model(nodes, [("x", [3, 12])], [("z", [3, 4]), ("mm", [3, 4])],
              {"sizes": np.array([4, 4, 4], np.int64), "w": np.eye(4, dtype=np.float32)})
    out = fuse(m)
    assert ops(out) == ["MatMul", "Pointwise", "Split"]
    (pw,) = pointwise_nodes(out)
    assert list(pw.input) == ["x", "x"]
    check_equivalent(m, out)


def test_view_is_pushed_through_the_elementwise_producer_of_the_split():
    # LSTM gates: Add(gates, bias) -> Split -> activations: the Add runs on each piece.
    nodes = [
        node("Add", ["g", "bias"], ["gb"]),
        node("Split", ["gb", "sizes"], ["i", "f"], axis=1),
        node("Sigmoid", ["i"], ["si"]),
        node("Tanh", ["f"], ["tf"]),
        node("Mul", ["si", "tf"], ["z"]),
    ]
    m = model(nodes, [("g", [2, 8])], [("z", [2, 4])],
              {"bias": np.arange(8, dtype=np.float32) / 8, "sizes": np.array([4, 4], np.int64)})
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    (pw,) = pointwise_nodes(out)
    assert list(pw.input) == ["g", "bias", "g", "bias"]
    views = [(i.view[0].axis, i.view[0].start) for i in program_of(pw).inputs]
    assert views == [(1, 0), (0, 0), (1, 4), (0, 4)]
    check_equivalent(m, out)


def lstm_model(steps=3, hidden=8, batch=2):
    """An unrolled LSTM: per step MatMul, MatMul, Add x3, Split, the cell's elementwise ops."""
    rng = np.random.default_rng(7)
    inits = {"sizes": np.array([hidden] * 4, np.int64)}
    nodes = []
    h, c = "h0", "c0"
    inits["W"] = rng.standard_normal((hidden, 4 * hidden)).astype(np.float32) * 0.3
    inits["R"] = rng.standard_normal((hidden, 4 * hidden)).astype(np.float32) * 0.3
    inits["b"] = rng.standard_normal(4 * hidden).astype(np.float32) * 0.1
    for t in range(steps):
        s = f"_{t}"
        nodes += [
            node("MatMul", [f"x{t}", "W"], ["xw" + s]),
            node("MatMul", [h, "R"], ["hr" + s]),
            node("Add", ["xw" + s, "hr" + s], ["g0" + s]),
            node("Add", ["g0" + s, "b"], ["g" + s]),
            node("Split", ["g" + s, "sizes"], ["i" + s, "f" + s, "gg" + s, "o" + s], axis=1),
            node("Sigmoid", ["i" + s], ["si" + s]),
            node("Sigmoid", ["f" + s], ["sf" + s]),
            node("Tanh", ["gg" + s], ["tg" + s]),
            node("Sigmoid", ["o" + s], ["so" + s]),
            node("Mul", ["sf" + s, c], ["fc" + s]),
            node("Mul", ["si" + s, "tg" + s], ["ig" + s]),
            node("Add", ["fc" + s, "ig" + s], ["c" + s]),
            node("Tanh", ["c" + s], ["tc" + s]),
            node("Mul", ["so" + s, "tc" + s], ["h" + s]),
        ]
        h, c = "h" + s, "c" + s
    inputs = [(f"x{t}", [batch, hidden]) for t in range(steps)] + [("h0", [batch, hidden]), ("c0", [batch, hidden])]
    return model(nodes, inputs, [(h, [batch, hidden]), (c, [batch, hidden])], inits)


def test_unrolled_lstm_one_pointwise_per_step_no_split_left():
    m = lstm_model()
    out = fuse(m)
    counts = {op: ops(out).count(op) for op in set(ops(out))}
    # The first Add of each step reads a 2-D MatMul: left to onnxruntime's Gemm (CPU policy).
    assert counts == {"MatMul": 6, "Add": 3, "Pointwise": 3}
    for pw in pointwise_nodes(out):
        prog = program_of(pw)
        assert sum(1 for i in prog.inputs if i.view) == 8  # 4 gates x (gate sum, bias)
    check_equivalent(m, out)


def test_fallback_body_is_valid_when_a_tensor_is_read_through_several_views():
    out = fuse(lstm_model(steps=1))
    onnx.checker.check_model(out, full_check=True)
    for fn in out.functions:
        assert len(set(fn.input)) == len(fn.input)


def test_3d_matmul_bias_is_fused_on_cpu():
    """onnxruntime makes no Gemm of a MatMul with symbolic leading dims: the bias Add and the
    residual Add are one region."""
    nodes = [node("MatMul", ["x", "W"], ["m"]), node("Add", ["m", "b"], ["a"]), node("Add", ["a", "x"], ["z"])]
    m = model(nodes, [("x", ["B", "T", 16])], [("z", ["B", "T", 16])], {"W": RNG.standard_normal((16, 16)).astype(np.float32), "b": GAMMA})
    out = fuse(m)
    assert ops(out) == ["MatMul", "Pointwise"]
    check_equivalent(m, out, dims={"B": 2, "T": 5})


@pytest.mark.skipif(not (ZOO / "char_rnn.onnx").exists(), reason="zoo model models/char_rnn.onnx not generated")
def test_char_rnn_each_cell_is_one_pointwise_reading_its_gates_in_place():
    m = onnx.load(str(ZOO / "char_rnn.onnx"))
    out = fuse(m)
    assert ops(out).count("Pointwise") == 32
    assert "Split" not in ops(out) and "Sigmoid" not in ops(out) and "Tanh" not in ops(out)
    for pw in pointwise_nodes(out):
        assert sum(1 for i in program_of(pw).inputs if i.view) >= 4
    check_equivalent(m, out, seeds=(0,))
    if library_has_pointwise():
        # about 435 kernels before; per cell Gemm, Gemm, Pointwise after
        assert len(ort_kernels(out, with_library=True)) <= 130 < len(ort_kernels(m))


def test_split_piece_split_again_on_the_same_axis_is_read_stored():
    # b is read through a view of x, but the piece a is split again along the same axis: two
    # slices of one axis do not compose, so a is a stored input, and then the outer Split must
    # not be in the fallback body (it would define a twice).
    nodes = [
        node("Split", ["x", "sizes"], ["a", "b", "c"], axis=3),
        node("Split", ["a", "halves"], ["a0", "a1"], axis=3),
        node("GreaterOrEqual", ["b", "a1"], ["ge"]),
        node("Where", ["ge", "a1", "a0"], ["w"]),
        node("Sub", ["w", "k"], ["y"]),
    ]
    inits = {"sizes": np.array([2, 13, 1], np.int64), "halves": np.array([1, 1], np.int64), "k": np.array(1.75, np.float32)}
    m = model(nodes, [("x", ["batch", 1, 3, 16])], [("y", ["batch", 1, 3, 13]), ("c", ["batch", 1, 3, 1])], inits)
    out = fuse(m)
    onnx.checker.check_model(out, full_check=True)
    (pw,) = pointwise_nodes(out)
    assert "a" in pw.input and "x" not in pw.input
    check_equivalent(m, out, dims={"batch": 2})
