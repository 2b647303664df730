"""Cleanup passes: Identity/Dropout removal and the Slice/Split/Concat cleanups.

Every rewritten model is run in onnxruntime (graph optimizations off, so what is compared is
our rewrite, not onnxruntime's) against the original for several sizes of its dynamic dims.
"""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxfuse.pipeline import Context, run_passes, select_passes
from small_models import assert_same_outputs

BIG = 2**63 - 1


def i64(*v):
    return np.array(v, dtype=np.int64)


def make_model(nodes, inputs, outputs, inits=None, opset=17):
    """inputs/outputs: [(name, shape)] float tensors; inits: {name: array}."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 9 else 3
    if any(s is None for _, s in outputs):
        # Outputs given without a shape take the one shape inference derives.
        inferred = onnx.shape_inference.infer_shapes(model)
        types = {vi.name: vi.type for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
        for out in model.graph.output:
            if out.name in types:
                out.type.CopyFrom(types[out.name])
    onnx.checker.check_model(model)
    return model


def optimize(model, *names):
    out, stats = run_passes(model, select_passes(list(names), "cpu"), Context())
    onnx.checker.check_model(out)
    return out, sum(s.matches for s in stats)


def ops(model):
    return [n.op_type for n in model.graph.node]


def node(op, ins, outs, **kw):
    return helper.make_node(op, ins, outs, **kw)


# Identity -----------------------------------------------------------------------------------


def test_identity_between_nodes_is_removed():
    m = make_model(
        [node("Relu", ["x"], ["a"]), node("Identity", ["a"], ["b"]), node("Neg", ["b"], ["y"])],
        [("x", ["batch", "seq"])], [("y", ["batch", "seq"])],
    )
    out, n = optimize(m, "remove-identity")
    assert n == 1 and ops(out) == ["Relu", "Neg"]
    assert_same_outputs(m, out)


def test_identity_feeding_graph_output_keeps_the_output_name():
    # a is also read by Neg: after the rewrite Relu writes y and Neg reads y.
    m = make_model(
        [node("Relu", ["x"], ["a"]), node("Identity", ["a"], ["y"]), node("Neg", ["a"], ["z"])],
        [("x", ["batch", "seq"])], [("y", ["batch", "seq"]), ("z", ["batch", "seq"])],
    )
    out, n = optimize(m, "remove-identity")
    assert n == 1 and "Identity" not in ops(out)
    relu = next(nd for nd in out.graph.node if nd.op_type == "Relu")
    assert list(relu.output) == ["y"]
    assert_same_outputs(m, out)


def test_identity_from_graph_input_to_graph_output_is_kept():
    m = make_model([node("Identity", ["x"], ["y"])], [("x", ["batch"])], [("y", ["batch"])])
    out, n = optimize(m, "remove-identity")
    assert n == 0 and ops(out) == ["Identity"]
    assert_same_outputs(m, out)


def test_identity_copying_one_graph_output_to_another_is_kept():
    m = make_model(
        [node("Relu", ["x"], ["a"]), node("Identity", ["a"], ["y"])],
        [("x", ["batch"])], [("a", ["batch"]), ("y", ["batch"])],
    )
    out, n = optimize(m, "remove-identity")
    assert n == 0 and ops(out) == ["Relu", "Identity"]
    assert_same_outputs(m, out)


def test_identity_of_initializer_feeding_graph_output_is_kept():
    m = make_model(
        [node("Identity", ["w"], ["y"]), node("Relu", ["x"], ["z"])],
        [("x", ["batch"])], [("y", [3]), ("z", ["batch"])], {"w": np.ones(3, np.float32)},
    )
    out, n = optimize(m, "remove-identity")
    assert n == 0 and "Identity" in ops(out)
    assert_same_outputs(m, out)


# Dropout ------------------------------------------------------------------------------------


def _dropout_model(extra_inputs=(), outputs=("d",), mask_used=False, inits=None, opset=13):
    nodes = [node("Relu", ["x"], ["a"]), node("Dropout", ["a", *extra_inputs], list(outputs))]
    outs = [("y", ["batch", "seq"])]
    nodes.append(node("Neg", ["d"], ["y"]))
    if mask_used:
        nodes.append(node("Cast", ["mask"], ["m"], to=TensorProto.FLOAT))
        outs.append(("m", ["batch", "seq"]))
    return make_model(nodes, [("x", ["batch", "seq"])], outs, inits, opset=opset)


def test_inference_dropout_is_removed():
    m = _dropout_model()
    out, n = optimize(m, "remove-dropout")
    assert n == 1 and ops(out) == ["Relu", "Neg"]
    assert_same_outputs(m, out)


def test_dropout_with_constant_false_training_mode_is_removed():
    m = _dropout_model(["ratio", "train"], inits={"ratio": np.array(0.5, np.float32), "train": np.array(False)})
    out, n = optimize(m, "remove-dropout")
    assert n == 1 and "Dropout" not in ops(out)
    assert_same_outputs(m, out)


def test_dropout_in_training_mode_is_kept():
    m = _dropout_model(["ratio", "train"], inits={"ratio": np.array(0.0, np.float32), "train": np.array(True)})
    out, n = optimize(m, "remove-dropout")
    assert n == 0 and "Dropout" in ops(out)


def test_dropout_whose_mask_is_used_is_kept():
    m = _dropout_model(outputs=("d", "mask"), mask_used=True)
    out, n = optimize(m, "remove-dropout")
    assert n == 0 and "Dropout" in ops(out)
    assert_same_outputs(m, out)


def test_dropout_with_unused_mask_output_is_removed():
    m = _dropout_model(outputs=("d", "mask"))
    out, n = optimize(m, "remove-dropout")
    assert n == 1 and "Dropout" not in ops(out)
    assert_same_outputs(m, out)


# No-op Slice / Split / Concat ---------------------------------------------------------------


def _slice_model(starts, ends, axes, steps=None, shape=("batch", "seq", 4)):
    inits = {"s": i64(*starts), "e": i64(*ends), "a": i64(*axes)}
    ins = ["x", "s", "e", "a"]
    if steps is not None:
        inits["k"] = i64(*steps)
        ins.append("k")
    return make_model(
        [node("Relu", ["x"], ["r"]), node("Slice", ["r", *ins[1:]], ["sl"]), node("Neg", ["sl"], ["y"])],
        [("x", list(shape))], [("y", None)], inits,
    )


@pytest.mark.parametrize(
    "starts, ends, axes, steps",
    [
        ([0], [4], [2], None),  # exactly the static dim
        ([0], [BIG], [1], None),  # to the end of a dynamic dim
        ([-4], [100], [-1], [1]),  # negative start on a static dim
        ([0, 0], [BIG, 4], [0, 2], [1, 1]),
    ],
)
def test_slice_keeping_everything_is_removed(starts, ends, axes, steps):
    m = _slice_model(starts, ends, axes, steps)
    out, n = optimize(m, "remove-noop-slice")
    assert n == 1 and "Slice" not in ops(out)
    assert_same_outputs(m, out)


@pytest.mark.parametrize(
    "starts, ends, axes, steps",
    [
        ([0], [3], [0], None),  # keeps everything only while batch <= 3
        ([0], [3], [2], None),  # drops the last element of a static dim
        ([0], [BIG], [2], [2]),  # every other element
        ([-1], [-BIG], [2], [-1]),  # reversal
        ([1], [BIG], [1], None),
    ],
)
def test_slice_that_drops_or_reorders_is_kept(starts, ends, axes, steps):
    m = _slice_model(starts, ends, axes, steps)
    out, n = optimize(m, "remove-noop-slice")
    assert n == 0 and "Slice" in ops(out)
    assert_same_outputs(m, out, sizes=((1, 1), (3, 7), (5, 2)))


def test_split_into_one_output_and_one_input_concat_are_removed():
    m = make_model(
        [node("Relu", ["x"], ["r"]), node("Split", ["r"], ["s"], axis=1, num_outputs=1),
         node("Concat", ["s"], ["c"], axis=0), node("Neg", ["c"], ["y"])],
        [("x", ["batch", "seq"])], [("y", ["batch", "seq"])], opset=18,
    )
    out, n = optimize(m, "remove-noop-slice")
    assert n == 2 and ops(out) == ["Relu", "Neg"]
    assert_same_outputs(m, out)


# Slice of Slice -----------------------------------------------------------------------------


def _two_slices(first, second, shape=("batch", "seq", 12), inner_used_twice=False):
    inits, nodes = {}, [node("Relu", ["x"], ["r"])]
    src = "r"
    for tag, (starts, ends, axes, steps) in (("p", first), ("q", second)):
        inits.update({f"{tag}s": i64(*starts), f"{tag}e": i64(*ends), f"{tag}a": i64(*axes), f"{tag}k": i64(*steps)})
        nodes.append(node("Slice", [src, f"{tag}s", f"{tag}e", f"{tag}a", f"{tag}k"], [f"{tag}out"]))
        src = f"{tag}out"
    nodes.append(node("Neg", [src], ["y"]))
    outs = [("y", None)]
    if inner_used_twice:
        nodes.append(node("Sigmoid", ["pout"], ["z"]))
        outs.append(("z", None))
    return make_model(nodes, [("x", list(shape))], outs, inits)


@pytest.mark.parametrize(
    "first, second",
    [
        (([1], [BIG], [1], [1]), ([0], [5], [2], [1])),  # different axes
        (([1], [11], [2], [2]), ([1], [4], [2], [1])),  # same static axis with steps
        (([-1], [-BIG], [2], [-1]), ([2], [9], [2], [3])),  # reversed then strided, static
        (([1], [BIG], [1], [1]), ([2], [5], [1], [2])),  # same dynamic axis, non-negative
        (([0, 2], [2, 10], [0, 2], [1, 1]), ([1], [BIG], [0], [1])),
    ],
)
def test_slice_of_slice_becomes_one_slice(first, second):
    m = _two_slices(first, second)
    out, n = optimize(m, "merge-slices")
    assert n == 1 and ops(out).count("Slice") == 1
    assert_same_outputs(m, out)


@pytest.mark.parametrize(
    "first, second",
    [
        (([-3], [BIG], [1], [1]), ([1], [BIG], [1], [1])),  # counts from the end of a dynamic dim
        (([0], [BIG], [1], [2]), ([0], [-1], [1], [1])),
    ],
)
def test_slice_of_slice_on_dynamic_axis_counting_from_the_end_is_kept(first, second):
    m = _two_slices(first, second)
    out, n = optimize(m, "merge-slices")
    assert n == 0 and ops(out).count("Slice") == 2
    assert_same_outputs(m, out)


def test_slice_whose_result_is_read_twice_is_not_merged():
    m = _two_slices(([1], [BIG], [1], [1]), ([0], [5], [2], [1]), inner_used_twice=True)
    out, n = optimize(m, "merge-slices")
    assert n == 0 and ops(out).count("Slice") == 2


def test_slice_of_slice_with_attribute_form_before_opset_10():
    inits = {}
    m = make_model(
        [node("Relu", ["x"], ["r"]), node("Slice", ["r"], ["a"], starts=[1], ends=[11], axes=[1]),
         node("Slice", ["a"], ["b"], starts=[0, 2], ends=[1, 8], axes=[0, 1]), node("Neg", ["b"], ["y"])],
        [("x", [2, 12])], [("y", None)], inits, opset=9,
    )
    out, n = optimize(m, "merge-slices")
    assert n == 1 and ops(out).count("Slice") == 1
    assert_same_outputs(m, out, sizes=((1, 1),))


# Split + Concat ------------------------------------------------------------------------------


def _split_concat(split_axis, concat_axis, order=(0, 1, 2), extra=False, sizes=(1, 2, 3)):
    cat_in = [f"s{i}" for i in order]
    inputs = [("x", ["batch", "seq", 6])]
    if extra:
        cat_in = ["w"] + cat_in
        inputs.append(("w", ["batch", "seq", 6]))
    return make_model(
        [node("Relu", ["x"], ["r"]), node("Split", ["r", "sizes"], ["s0", "s1", "s2"], axis=split_axis),
         node("Concat", cat_in, ["c"], axis=concat_axis), node("Neg", ["c"], ["y"])],
        inputs, [("y", None)], {"sizes": i64(*sizes)},
    )


def test_concat_of_all_split_outputs_in_order_is_removed():
    m = _split_concat(2, -1)
    out, n = optimize(m, "remove-split-concat")
    assert n == 1 and ops(out) == ["Relu", "Neg"]
    assert_same_outputs(m, out)


def test_split_pieces_inside_a_longer_concat_are_replaced_by_the_split_input():
    m = _split_concat(2, 2, extra=True)
    out, n = optimize(m, "remove-split-concat")
    assert n == 1 and ops(out) == ["Relu", "Concat", "Neg"]
    assert_same_outputs(m, out)


@pytest.mark.parametrize("split_axis, concat_axis, order", [(2, 1, (0, 1, 2)), (2, 2, (1, 0, 2))])
def test_split_concat_on_other_axis_or_order_is_kept(split_axis, concat_axis, order):
    m = _split_concat(split_axis, concat_axis, order, sizes=(2, 2, 2))
    out, n = optimize(m, "remove-split-concat")
    assert n == 0 and "Split" in ops(out) and "Concat" in ops(out)
    assert_same_outputs(m, out)


# Concat + Split ------------------------------------------------------------------------------


def _concat_split(sizes, split_axis=1, shapes=((2,), (3,)), equal=False):
    inputs = [(f"x{i}", ["batch", *s, "seq"]) for i, s in enumerate(shapes)]
    ins = ["cat"] if equal else ["cat", "sizes"]
    inits = {} if equal else {"sizes": i64(*sizes)}
    kw = {"num_outputs": len(shapes)} if equal else {}
    nodes = [node("Concat", [n for n, _ in inputs], ["cat"], axis=1),
             node("Split", ins, [f"s{i}" for i in range(len(shapes))], axis=split_axis, **kw)]
    nodes += [node("Neg", [f"s{i}"], [f"y{i}"]) for i in range(len(shapes))]
    nodes.append(node("Sigmoid", ["cat"], ["z"]))
    return make_model(nodes, inputs, [(f"y{i}", None) for i in range(len(shapes))] + [("z", None)], inits, opset=18)


def test_split_taking_back_the_concat_pieces_reads_the_pieces():
    m = _concat_split([2, 3])
    out, n = optimize(m, "remove-concat-split")
    assert n == 1 and "Split" not in ops(out)
    assert_same_outputs(m, out)


def test_equal_split_of_equal_symbolic_pieces_reads_the_pieces():
    m = _concat_split(None, shapes=(("seq",), ("seq",)), equal=True)
    out, n = optimize(m, "remove-concat-split")
    assert n == 1 and "Split" not in ops(out)
    assert_same_outputs(m, out)


@pytest.mark.parametrize("sizes", [[3, 2], [1, 4]])
def test_concat_split_with_other_sizes_is_kept(sizes):
    m = _concat_split(sizes)
    out, n = optimize(m, "remove-concat-split")
    assert n == 0 and "Split" in ops(out)
    assert_same_outputs(m, out)


def test_concat_split_on_another_axis_is_kept():
    # Split along seq with sizes 2, 3: a valid model for seq == 5 only, so it is not run.
    m = _concat_split([2, 3], split_axis=-1)
    out, n = optimize(m, "remove-concat-split")
    assert n == 0 and "Split" in ops(out)


def test_equal_split_of_pieces_with_different_symbolic_sizes_is_kept():
    m = _concat_split(None, shapes=(("seq",), (2,)), equal=True)
    out, n = optimize(m, "remove-concat-split")
    assert n == 0 and "Split" in ops(out)


# All cleanups together -----------------------------------------------------------------------


def test_all_cleanups_in_default_order_on_a_mixed_model():
    m = make_model(
        [node("Identity", ["x"], ["i"]), node("Dropout", ["i"], ["d"]),
         node("Slice", ["d", "z", "big", "one"], ["s"]),
         node("Split", ["s", "sizes"], ["p0", "p1"], axis=2), node("Concat", ["p0", "p1"], ["c"], axis=2),
         node("Identity", ["c"], ["y"])],
        [("x", ["batch", "seq", 6])], [("y", ["batch", "seq", 6])],
        {"z": i64(0), "big": i64(BIG), "one": i64(1), "sizes": i64(2, 4)},
    )
    names = ["remove-identity", "remove-dropout", "remove-noop-slice", "merge-slices",
             "remove-split-concat", "remove-concat-split"]
    out, n = optimize(m, *names)
    # Everything is a copy; the graph output must still be produced by a node.
    assert len(out.graph.node) == 1 and out.graph.node[0].output[0] == "y"
    assert_same_outputs(m, out)


def test_every_cleanup_keeps_outputs_on_all_dynamic_sizes():
    # A broad cross-check: the whole cleanup family on one model, sizes beyond the usual grid.
    m = _two_slices(([0], [BIG], [1], [1]), ([1], [BIG], [2], [1]))
    out, _ = optimize(m, "remove-noop-slice", "merge-slices")
    assert_same_outputs(m, out, sizes=list(itertools.product((1, 2, 5), (1, 3, 7))))
