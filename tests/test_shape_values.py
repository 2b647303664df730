"""Symbolic shape values (onnxfuse/graph/shape_values.py) through the TorchScript exporter's
idioms around Expand and Reshape targets."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import facts
from onnxfuse.graph.shape_values import ShapeEvaluator, refined_dims


def test_shape_values_follow_torchscripts_expand_target_idiom():
    # expand(x, sizes) in the TorchScript export: t = Reshape(Concat(dims), [-1]);
    # Where(Equal(t, -1 * ConstantOfShape(Shape(t), 1)), 1, t) is t itself for dims (>= 0).
    x = gs.Variable("x", np.float32, ["batch", "seq", 8])
    c = lambda name, v: gs.Constant(name, np.array(v, np.int64))  # noqa: E731
    t = {k: gs.Variable(k, np.int64) for k in ("shape", "dims", "flat", "len", "ones", "neg", "eq", "target")}
    eq = gs.Variable("eq", np.bool_)
    nodes = [
        gs.Node("Shape", inputs=[x], outputs=[t["shape"]]),
        gs.Node("Concat", inputs=[t["shape"], c("two", [2])], outputs=[t["dims"]], attrs={"axis": 0}),
        gs.Node("Reshape", inputs=[t["dims"], c("minus_one", [-1])], outputs=[t["flat"]]),
        gs.Node("Shape", inputs=[t["flat"]], outputs=[t["len"]]),
        gs.Node("ConstantOfShape", inputs=[t["len"]], outputs=[t["ones"]],
                attrs={"value": gs.Constant("one", np.array([1], np.int64))}),
        gs.Node("Mul", inputs=[t["ones"], c("m1", -1)], outputs=[t["neg"]]),
        gs.Node("Equal", inputs=[t["flat"], t["neg"]], outputs=[eq]),
        gs.Node("Where", inputs=[eq, t["ones"], t["flat"]], outputs=[t["target"]]),
    ]
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[t["target"]], opset=17)
    ev = ShapeEvaluator(graph, facts.ShapeTable(graph))
    assert ev.value(t["target"]).elems == ((1, ("batch",)), (1, ("seq",)), (8, ()), (2, ()))
    # a condition that depends on a dim's value stays unknown
    unknown = gs.Variable("unknown", np.int64)
    graph.nodes.append(gs.Node("Equal", inputs=[t["flat"], c("two_again", 2)], outputs=[unknown]))
    assert ShapeEvaluator(graph, facts.ShapeTable(graph)).value(unknown).elems[0] is None


def test_where_on_a_folded_condition_selects_the_expand_target():
    # fold-constants computes the idiom's Equal when the target's -1 entries are known: the
    # condition is then a bool constant, which selects as the Equal would.
    x = gs.Variable("x", np.float32, ["batch", "seq"])
    shape, b, s, target = (gs.Variable(n, np.int64) for n in ("shape", "b", "s", "target"))
    dims = gs.Variable("dims", np.int64)
    c = lambda name, v, t=np.int64: gs.Constant(name, np.array(v, t))  # noqa: E731
    nodes = [
        gs.Node("Shape", inputs=[x], outputs=[shape]),
        gs.Node("Slice", inputs=[shape, c("b0", [0]), c("b1", [1])], outputs=[b]),
        gs.Node("Slice", inputs=[shape, c("s0", [1]), c("s1", [2])], outputs=[s]),
        gs.Node("Concat", inputs=[b, c("minus_one", [-1]), s, s], outputs=[dims], attrs={"axis": 0}),
        gs.Node("Where", inputs=[c("is_minus_one", [False, True, False, False], np.bool_), c("ones", [1, 1, 1, 1]), dims],
                outputs=[target]),
    ]
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[target], opset=17)
    ev = ShapeEvaluator(graph, facts.ShapeTable(graph))
    assert ev.value(target).elems == ((1, ("batch",)), (1, ()), (1, ("seq",)), (1, ("seq",)))


def test_a_range_over_an_inferred_batch_keeps_that_batch_over_its_recorded_name():
    # GPT-2's TorchScript mask: arange(batch) where batch is Shape(Reshape(ids, [-1, S]))[0], a
    # dim inference names itself (unk__N). Inference gives the Range's length a name of its own;
    # refined_dims proves it is that batch, and what reads the Range keeps it.
    ids = gs.Variable("ids", np.int64, ["batch", "seq"])
    c = lambda name, v: gs.Constant(name, np.array(v, np.int64))  # noqa: E731
    t = {k: gs.Variable(k, np.int64) for k in ("ids_shape", "seq_dim", "flat_target", "flat", "flat_shape", "b", "rows",
                                               "rows4", "doubled")}
    nodes = [
        gs.Node("Shape", inputs=[ids], outputs=[t["ids_shape"]]),
        gs.Node("Slice", inputs=[t["ids_shape"], c("s0", [1]), c("s1", [2])], outputs=[t["seq_dim"]]),
        gs.Node("Concat", inputs=[c("minus_one", [-1]), t["seq_dim"]], outputs=[t["flat_target"]], attrs={"axis": 0}),
        gs.Node("Reshape", inputs=[ids, t["flat_target"]], outputs=[t["flat"]]),
        gs.Node("Shape", inputs=[t["flat"]], outputs=[t["flat_shape"]]),
        gs.Node("Gather", inputs=[t["flat_shape"], c("zero", 0)], outputs=[t["b"]], attrs={"axis": 0}),
        gs.Node("Range", inputs=[c("start", 0), t["b"], c("step", 1)], outputs=[t["rows"]]),
        gs.Node("Unsqueeze", inputs=[t["rows"], c("axes", [1, 2, 3])], outputs=[t["rows4"]]),
        gs.Node("Add", inputs=[t["rows4"], t["rows4"]], outputs=[t["doubled"]]),
    ]
    graph = gs.Graph(nodes=nodes, inputs=[ids], outputs=[t["flat"], t["doubled"]], opset=17)
    facts.refresh_shapes(graph)  # the graph records inference's names, the Range's length among them
    batch = facts.ShapeTable(graph).dims(t["flat"])[0]
    assert isinstance(batch, str) and facts.ShapeTable(graph).dims(t["rows"]) != [batch]
    shapes, _ = refined_dims(graph, facts.ShapeTable(graph))
    # (the flattened batch is now proved the input's own, by the Reshape's element count)
    batch = shapes.dims(t["flat"])[0]
    assert batch == "batch"
    assert shapes.dims(t["rows"]) == [batch] and shapes.dims(t["rows4"]) == [batch, 1, 1, 1]


def test_a_reshape_with_minus_one_keeps_the_dims_its_element_count_proves():
    # Reshape(ids [batch, seq], [-1, seq]) is [batch, seq]; Reshape(am [batch, seq], [that, -1])
    # is [batch, seq] again: inference names each -1 of its own (unk__N).
    ids = gs.Variable("ids", np.int64, ["batch", "seq"])
    am = gs.Variable("am", np.int64, ["batch", "seq"])
    c = lambda name, v: gs.Constant(name, np.array(v, np.int64))  # noqa: E731
    t = {k: gs.Variable(k, np.int64) for k in ("ids_shape", "seq_dim", "flat_target", "flat", "flat_shape", "b",
                                               "am_target", "rows", "rows_by_two", "half_target")}
    nodes = [
        gs.Node("Shape", inputs=[ids], outputs=[t["ids_shape"]]),
        gs.Node("Slice", inputs=[t["ids_shape"], c("s0", [1]), c("s1", [2])], outputs=[t["seq_dim"]]),
        gs.Node("Concat", inputs=[c("minus_one", [-1]), t["seq_dim"]], outputs=[t["flat_target"]], attrs={"axis": 0}),
        gs.Node("Reshape", inputs=[ids, t["flat_target"]], outputs=[t["flat"]]),
        gs.Node("Shape", inputs=[t["flat"]], outputs=[t["flat_shape"]]),
        gs.Node("Slice", inputs=[t["flat_shape"], c("b0", [0]), c("b1", [1])], outputs=[t["b"]]),
        gs.Node("Concat", inputs=[t["b"], c("minus_one_again", [-1])], outputs=[t["am_target"]], attrs={"axis": 0}),
        gs.Node("Reshape", inputs=[am, t["am_target"]], outputs=[t["rows"]]),
        # [batch, 2, -1]: seq / 2 is not a whole dim for every seq, so nothing is claimed
        gs.Node("Concat", inputs=[t["b"], c("two", [2]), c("minus_one_too", [-1])], outputs=[t["half_target"]],
                attrs={"axis": 0}),
        gs.Node("Reshape", inputs=[am, t["half_target"]], outputs=[t["rows_by_two"]]),
    ]
    graph = gs.Graph(nodes=nodes, inputs=[ids, am], outputs=[t["rows"], t["rows_by_two"]], opset=17)
    facts.refresh_shapes(graph)
    before = facts.ShapeTable(graph)
    assert before.dims(t["flat"])[0] != "batch" and before.dims(t["rows"]) != ["batch", "seq"]
    shapes, _ = refined_dims(graph, facts.ShapeTable(graph))
    assert shapes.dims(t["flat"]) == ["batch", "seq"] and shapes.dims(t["rows"]) == ["batch", "seq"]
    assert shapes.dims(t["rows_by_two"])[0] == "batch" and shapes.dims(t["rows_by_two"])[2] != "seq"
