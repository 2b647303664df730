"""gather-by-index-grid: a GatherND whose index tuples are its own coordinates (the dynamo
exporter's padding mask) becomes an Unsqueeze of the data; grids that permute, shift or
broadcast the data keep their GatherND."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from test_pass_matmul_batch import ops, optimize, run

PASS = ["gather-by-index-grid"]


def mask_model(start=0, first_axis=0, second_axis=3):
    """out = mask[arange(batch) on axis first_axis, arange(seq) on axis second_axis] of a rank-4
    grid, as torch.export writes transformers' padding mask (Range, Unsqueezes, Max, Shape,
    Expand, Unsqueeze(-1), Concat, GatherND), then a bool And so the result is used as a mask."""
    def unsqueezes(src, axis, name):
        nodes, cur = [], src
        for i, a in enumerate(sorted(set(range(4)) - {axis})):
            nodes.append(helper.make_node("Unsqueeze", [cur, f"ax{a}"], [f"{name}{i}"]))
            cur = f"{name}{i}"
        return nodes, cur

    inits = [numpy_helper.from_array(np.asarray(v, np.int64), n) for n, v in
             (("start", start), ("step", 1), ("last", [-1]), ("b0", [0]), ("b1", [1]), ("b2", [2]))]
    inits += [numpy_helper.from_array(np.asarray([a], np.int64), f"ax{a}") for a in range(4)]
    nodes = [
        helper.make_node("Shape", ["mask"], ["n0"], start=0, end=1),
        helper.make_node("Shape", ["mask"], ["n1"], start=1, end=2),
        helper.make_node("Squeeze", ["n0"], ["n0s"]),
        helper.make_node("Squeeze", ["n1"], ["n1s"]),
        helper.make_node("Cast", ["mask"], ["mask_b"], to=TensorProto.BOOL),
        helper.make_node("Range", ["start", "n0s", "step"], ["r0"]),
        helper.make_node("Range", ["start", "n1s", "step"], ["r1"]),
    ]
    n0, a0 = unsqueezes("r0", first_axis, "u0_")
    n1, a1 = unsqueezes("r1", second_axis, "u1_")
    nodes += n0 + n1 + [
        helper.make_node("Max", [a0, a1], ["grid_max"]),
        helper.make_node("Shape", ["grid_max"], ["grid_shape"]),
        helper.make_node("Expand", [a0, "grid_shape"], ["g0"]),
        helper.make_node("Expand", [a1, "grid_shape"], ["g1"]),
        helper.make_node("Unsqueeze", ["g0", "last"], ["s0"]),
        helper.make_node("Unsqueeze", ["g1", "last"], ["s1"]),
        helper.make_node("Concat", ["s0", "s1"], ["grid"], axis=-1),
        helper.make_node("GatherND", ["mask_b", "grid"], ["gathered"]),
        helper.make_node("Not", ["gathered"], ["out"]),
    ]
    g = helper.make_graph(nodes, "mask", [helper.make_tensor_value_info("mask", TensorProto.INT64, ["b", "s"])],
                          [helper.make_tensor_value_info("out", TensorProto.BOOL, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


def feeds(batch, seq):
    return {"mask": (np.random.default_rng(seq).random((batch, seq)) > 0.4).astype(np.int64)}


def assert_same(a, b, shapes):
    for batch, seq in shapes:
        for x, y in zip(run(a, feeds(batch, seq)), run(b, feeds(batch, seq))):
            assert x.shape == y.shape
            np.testing.assert_array_equal(x, y)


def test_the_padding_mask_grid_becomes_one_unsqueeze_and_computes_the_same():
    m = mask_model()
    out, matches = optimize(m, PASS)
    assert matches == 1
    kinds = ops(out)
    assert not {"GatherND", "Range", "Expand", "Max", "Concat"} & set(kinds), kinds
    assert kinds.count("Unsqueeze") == 1
    assert_same(m, out, [(2, 5), (1, 1), (3, 9)])


def test_other_axes_of_the_grid_compute_the_same():
    m = mask_model(first_axis=1, second_axis=2)
    out, matches = optimize(m, PASS)
    assert matches == 1
    assert_same(m, out, [(2, 5), (4, 3)])


def test_a_grid_that_transposes_or_shifts_the_data_keeps_its_gathernd():
    for m in (mask_model(first_axis=3, second_axis=0), mask_model(start=1)):
        out, matches = optimize(m, PASS)
        assert matches == 0 and "GatherND" in ops(out)
