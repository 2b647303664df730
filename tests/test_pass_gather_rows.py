"""gather-rows-as-slices: constant-index Gathers of one tensor become Slices of one Reshape that
the pointwise pass reads in place; other Gathers are left alone."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from test_pass_matmul_batch import assert_same, model, ops, optimize, rng_arrays

PASS = ["gather-rows-as-slices"]


def step_inputs_model(shape=(2, 5, 6), axis=1, steps=(0, 1, 2, 4), reader="Add", index_dtype=np.int64):
    """y = Y * 2 (so Y is computed); out_k = reader(Gather(y, k, axis), bias) for k in steps."""
    (bias,) = rng_arrays(0, [d for i, d in enumerate(shape) if i != axis])
    nodes = [helper.make_node("Mul", ["Y", "two"], ["y"])]
    inits = {"two": np.float32(2.0), "bias": bias}
    outs = []
    out_shape = [d for i, d in enumerate(shape) if i != axis]
    for k in steps:
        nodes.append(helper.make_node("Constant", [], [f"i{k}"], value=numpy_helper.from_array(np.asarray(k, index_dtype))))
        nodes.append(helper.make_node("Gather", ["y", f"i{k}"], [f"g{k}"], axis=axis))
        if reader == "Add":
            nodes.append(helper.make_node("Add", [f"g{k}", "bias"], [f"o{k}"]))
        else:
            nodes.append(helper.make_node("ReduceSum", [f"g{k}"], [f"o{k}"], keepdims=1))
        outs.append((f"o{k}", out_shape if reader == "Add" else [1] * len(out_shape)))
    m = model(nodes, inits, [("Y", list(shape))], outs)
    feeds = {"Y": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    return m, feeds


@pytest.mark.parametrize("shape,axis", [((2, 5, 6), 1), ((5, 2, 6), 0), ((1, 16, 8), 1), ((3, 4, 2, 5), 2)])
def test_step_gathers_become_slices_of_one_reshape_and_compute_the_same(shape, axis):
    steps = sorted({0, 1, shape[axis] - 1})
    m, feeds = step_inputs_model(shape, axis, steps=tuple(steps))
    out, matches = optimize(m, PASS)
    assert matches == len(steps)
    kinds = ops(out)
    assert "Gather" not in kinds and kinds.count("Reshape") == 1 and kinds.count("Slice") == len(steps)
    assert_same(m, out, [feeds])


def test_negative_and_int32_indices_are_accepted():
    m, feeds = step_inputs_model((2, 5, 6), 1, steps=(0, -1), index_dtype=np.int32)
    assert optimize(m, PASS)[1] == 2
    assert_same(m, optimize(m, PASS)[0], [feeds])


def test_gathers_read_by_a_non_elementwise_op_are_left_alone():
    m, _ = step_inputs_model(reader="ReduceSum")
    out, matches = optimize(m, PASS)
    assert matches == 0 and ops(out).count("Gather") == ops(m).count("Gather") and "Slice" not in ops(out)


def test_a_single_gather_or_one_on_the_last_axis_is_left_alone():
    m, _ = step_inputs_model(steps=(2,))
    assert optimize(m, PASS)[1] == 0
    m, _ = step_inputs_model(shape=(2, 6), axis=1, steps=(0, 1, 2))
    assert optimize(m, PASS)[1] == 0


def test_rnn_step_inputs_are_read_in_place_in_the_default_pipeline():
    # With pointwise fusion after it, no Slice remains: the regions read the rows in place.
    m, feeds = step_inputs_model((1, 16, 8), 1, steps=tuple(range(16)))
    out, _ = optimize(m, None)
    kinds = ops(out)
    assert "Slice" not in kinds and "Gather" not in kinds, kinds


def test_the_same_index_twice_gives_distinct_node_names():
    # fuzz seed 760: two Gathers of one row made two Slices of one name, an invalid fallback body
    m, feeds = step_inputs_model((2, 5, 6), 1, steps=(1, 3))
    g = m.graph
    g.node.extend([helper.make_node("Gather", ["y", "i1"], ["g1b"], axis=1),
                   helper.make_node("Add", ["g1b", "bias"], ["o1b"])])
    g.output.extend([helper.make_tensor_value_info("o1b", 1, [2, 6])])
    out, matches = optimize(m, PASS)
    assert matches == 3
    names = [n.name for n in out.graph.node if n.name]
    assert len(names) == len(set(names))
    assert_same(m, out, [feeds])


def half_rows_model(source):
    """Two row Gathers of a float16 [2, 5, 6] y, each read by an Add: y a graph input ("input"),
    a Cast of a float input to float16 ("cast") or a float16 product ("mul")."""
    H, F = TensorProto.FLOAT16, TensorProto.FLOAT
    y = {"input": [], "cast": [helper.make_node("Cast", ["Y"], ["y"], to=H)],
         "mul": [helper.make_node("Mul", ["Y", "Y"], ["y"])]}[source]
    nodes = y + [helper.make_node("Gather", ["Y" if source == "input" else "y", f"i{k}"], [f"g{k}"], axis=1)
                 for k in (1, 3)]
    nodes += [helper.make_node("Add", [f"g{k}", f"g{k}"], [f"o{k}"]) for k in (1, 3)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("Y", F if source == "cast" else H, [2, 5, 6])],
                          [helper.make_tensor_value_info(f"o{k}", H, [2, 6]) for k in (1, 3)],
                          [numpy_helper.from_array(np.asarray(k, np.int64), f"i{k}") for k in (1, 3)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def test_rows_of_a_computed_float16_value_stay_gathers():
    # onnxruntime computes the float16 product in float32 and the Gather reads it unrounded;
    # a Reshape and Slice would read it rounded to float16 (fuzz seed 9325856)
    out, matches = optimize(half_rows_model("mul"), PASS)
    assert matches == 0 and ops(out).count("Gather") == 2


@pytest.mark.parametrize("source", ["input", "cast"])
def test_rows_of_a_rounded_float16_value_become_slices(source):
    m = half_rows_model(source)
    out, matches = optimize(m, PASS)
    assert matches == 2 and "Gather" not in ops(out)
    x = np.random.default_rng(2).standard_normal((2, 5, 6)).astype(np.float16 if source == "input" else np.float32)
    assert_same(m, out, [{"Y": x}])
