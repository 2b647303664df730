"""Fuzz seeds 464, 572 and 874 (onnxfuse.fuzz at e26fd3d): an If whose branches read a value of a
top-level elementwise chain (outer-scope reference) while the If's output flows back into the
same chain.

The pointwise pass did not see the If as a reader of that value (graphsurgeon lists the branch
nodes, not the If, as its consumers), so its cycle check let one region hold both the producer
of the value and the op reading the If's output: region -> If -> region, a cycle, and
`onnxfuse optimize` failed with "Cycle detected in graph".
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from small_models import float_model
from onnxfuse.fuzz import compare, optimize_model, _run


def if_in_the_middle_model() -> onnx.ModelProto:
    def branch(name, op):
        return helper.make_graph([helper.make_node(op, ["m"], [f"{name}_out"], name=f"{name}_op")], name, [],
                                 [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [None, 5])])

    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"], name="sigmoid"),
        helper.make_node("Mul", ["s", "two"], ["m"], name="mul"),
        helper.make_node("ReduceMax", ["x"], ["r"], name="reduce", keepdims=0),
        helper.make_node("Greater", ["r", "zero"], ["cond"], name="greater"),
        helper.make_node("If", ["cond"], ["b"], name="if", then_branch=branch("then", "Neg"),
                         else_branch=branch("else", "Abs")),
        helper.make_node("Max", ["m", "b"], ["t"], name="max"),
        helper.make_node("Tanh", ["t"], ["y"], name="tanh"),
    ]
    inits = [numpy_helper.from_array(np.array(2, np.float32), "two"),
             numpy_helper.from_array(np.array(0, np.float32), "zero")]
    return float_model("if_in_the_middle", nodes, {"x": ["n", 5]}, {"y": None}, inits)


def test_region_is_not_fused_across_an_if_that_reads_it():
    model = if_in_the_middle_model()
    opt = optimize_model(model)
    onnx.checker.check_model(opt, full_check=True)
    assert [n.op_type for n in opt.graph.node].count("If") == 1
    for sign in (1, -1):  # both branches taken
        feeds = {"x": (sign * np.abs(np.random.default_rng(1).standard_normal((3, 5)))).astype(np.float32)}
        ref = _run(model, feeds, with_library=False, level="disable")
        for with_library in (False, True):
            assert compare(ref, _run(opt, feeds, with_library=with_library)) is None
