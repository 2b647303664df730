"""Fuzz seeds 878, 160 and 377 (onnxfuse.fuzz, before the generator gained dtypes/control flow):
a Split whose pieces a region reads both through views and as a stored tensor (the piece is
split again along the same axis, so the two views cannot be composed).

The pointwise pass put the outer Split into the fallback body (it produces the piece read
through a view) and also made the stored piece a formal input of the function: the same name
defined twice, which onnx.checker rejects ("Function must be in single static assignment
form") and `onnxfuse optimize` reported as an internal error. Fixed in the pointwise pass
(2c6de67): such a Split is not read through views.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from small_models import float_model
from onnxfuse.fuzz import compare, optimize_model, _run


def split_twice_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Split", ["x", "sizes"], ["a", "b", "c"], name="split_outer", axis=3),
        helper.make_node("Split", ["a", "halves"], ["a0", "a1"], name="split_inner", axis=3),
        helper.make_node("GreaterOrEqual", ["b", "a1"], ["ge"], name="ge"),
        helper.make_node("Where", ["ge", "a1", "a0"], ["w"], name="where"),
        helper.make_node("Sub", ["w", "k"], ["y"], name="sub"),
    ]
    inits = [
        numpy_helper.from_array(np.array([2, 13, 1], np.int64), "sizes"),
        numpy_helper.from_array(np.array([1, 1], np.int64), "halves"),
        numpy_helper.from_array(np.array(1.75, np.float32), "k"),
    ]
    return float_model("split_twice", nodes, {"x": ["batch", 1, 3, 16]}, {"y": None, "c": None}, inits)


def test_split_read_through_view_and_as_tensor_gives_valid_function():
    model = split_twice_model()
    opt = optimize_model(model)
    onnx.checker.check_model(opt, full_check=True)
    feeds = {"x": np.random.default_rng(0).standard_normal((5, 1, 3, 16)).astype(np.float32)}
    ref = _run(model, feeds, with_library=False, level="disable")
    for with_library in (False, True):
        assert compare(ref, _run(opt, feeds, with_library=with_library)) is None
