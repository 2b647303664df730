"""Fuzz seeds 780 and 944 (onnxfuse.fuzz at e26fd3d): optimizing an optimized model changed it.

A Slice read by an elementwise region and by a second Slice: merge-slices leaves the pair alone
(the first Slice has two readers), then the pointwise pass reads the first Slice through a view,
so it has one reader left; a second `onnxfuse optimize` merges the two Slices. The pipeline must
reach its result in one run.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from small_models import float_model
from onnxfuse.fuzz import compare, optimize_model, _run


def shared_slice_model() -> onnx.ModelProto:
    def ints(name, v):
        return numpy_helper.from_array(np.array(v, np.int64), name)

    nodes = [
        helper.make_node("Slice", ["x", "s1", "e1", "a1"], ["a"], name="slice_a"),
        helper.make_node("Slice", ["a", "s0", "e0", "a0"], ["b"], name="slice_b"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Tanh", ["r"], ["y"], name="tanh"),
    ]
    inits = [ints("s1", [1]), ints("e1", [11]), ints("a1", [1]), ints("s0", [0]), ints("e0", [1]), ints("a0", [0])]
    return float_model("shared_slice", nodes, {"x": [2, 12]}, {"y": None, "b": None}, inits)


def test_shared_slice_model_is_optimized_correctly():
    model = shared_slice_model()
    opt = optimize_model(model)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 12)).astype(np.float32)}
    ref = _run(model, feeds, with_library=False, level="disable")
    for with_library in (False, True):
        assert compare(ref, _run(opt, feeds, with_library=with_library)) is None


def test_optimizing_twice_changes_nothing():
    once = optimize_model(shared_slice_model())
    twice = optimize_model(once)
    assert [n.op_type for n in twice.graph.node] == [n.op_type for n in once.graph.node]
