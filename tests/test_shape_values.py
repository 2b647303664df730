"""Symbolic shape values (onnxfuse/graph/shape_values.py) through the TorchScript exporter's
idioms around Expand and Reshape targets."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import facts
from onnxfuse.graph.shape_values import ShapeEvaluator, refined_dims


def ids_viewed_by_seq(ids: gs.Variable, t: dict) -> list[gs.Node]:
    """ids.view(-1, seq) as the TorchScript exporter writes it: t["flat"] = Reshape(ids,
    Concat([-1], Shape(ids)[1:2])), and t["flat_shape"] = Shape(t["flat"])."""
    c = lambda name, v: gs.Constant(name, np.array(v, np.int64))  # noqa: E731
    return [
        gs.Node("Shape", inputs=[ids], outputs=[t["ids_shape"]]),
        gs.Node("Slice", inputs=[t["ids_shape"], c("s0", [1]), c("s1", [2])], outputs=[t["seq_dim"]]),
        gs.Node("Concat", inputs=[c("minus_one", [-1]), t["seq_dim"]], outputs=[t["flat_target"]], attrs={"axis": 0}),
        gs.Node("Reshape", inputs=[ids, t["flat_target"]], outputs=[t["flat"]]),
        gs.Node("Shape", inputs=[t["flat"]], outputs=[t["flat_shape"]]),
    ]


def expand_target_idiom(target: gs.Variable, out: gs.Variable, name: str) -> list[gs.Node]:
    """The TorchScript exporter's expand(x, sizes) target: out = Where(Equal(target,
    -1 * ConstantOfShape(Shape(target), 1)), 1, target), target itself for dims (>= 0)."""
    length, ones, minus_ones = (gs.Variable(f"{name}_{k}", np.int64) for k in ("len", "ones", "minus_ones"))
    is_minus_one = gs.Variable(f"{name}_is_minus_one", np.bool_)
    return [
        gs.Node("Shape", inputs=[target], outputs=[length]),
        gs.Node("ConstantOfShape", inputs=[length], outputs=[ones],
                attrs={"value": gs.Constant(f"{name}_one", np.array([1], np.int64))}),
        gs.Node("Mul", inputs=[ones, gs.Constant(f"{name}_m1", np.array(-1, np.int64))], outputs=[minus_ones]),
        gs.Node("Equal", inputs=[target, minus_ones], outputs=[is_minus_one]),
        gs.Node("Where", inputs=[is_minus_one, ones, target], outputs=[out]),
    ]


def test_shape_values_follow_torchscripts_expand_target_idiom():
    # expand(x, sizes) in the TorchScript export: t = Reshape(Concat(dims), [-1]);
    # Where(Equal(t, -1 * ConstantOfShape(Shape(t), 1)), 1, t) is t itself for dims (>= 0).
    x = gs.Variable("x", np.float32, ["batch", "seq", 8])
    c = lambda name, v: gs.Constant(name, np.array(v, np.int64))  # noqa: E731
    t = {k: gs.Variable(k, np.int64) for k in ("shape", "dims", "flat", "target")}
    nodes = [
        gs.Node("Shape", inputs=[x], outputs=[t["shape"]]),
        gs.Node("Concat", inputs=[t["shape"], c("two", [2])], outputs=[t["dims"]], attrs={"axis": 0}),
        gs.Node("Reshape", inputs=[t["dims"], c("minus_one", [-1])], outputs=[t["flat"]]),
        *expand_target_idiom(t["flat"], t["target"], "idiom"),
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
        *ids_viewed_by_seq(ids, t),
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
        *ids_viewed_by_seq(ids, t),
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


def _decode_mask_graph(offset: int = 1):
    """A decode step's padding term as the TorchScript exporter writes it: the key length
    L = Shape(past)[2] + offset, keep = Range(0, L) <= P (P = the past length), expanded to
    [batch, 1, 1, L] through the expand-target idiom (a -1 entry means keep that dim) and made
    additive, Where(keep, 0, -FLT_MAX)."""
    x = gs.Variable("x", np.float32, ["batch", 1, 64])
    past = gs.Variable("past_key", np.float32, ["batch", 4, "past", 16])
    c = lambda name, v, t=np.int64: gs.Constant(name, np.array(v, t))  # noqa: E731
    names = ("past_shape", "p", "length", "keys", "keys4", "p4", "x_shape", "b", "b1", "length1", "target", "target_ok")
    t = {k: gs.Variable(k, np.int64) for k in names}
    keep, wide, term = gs.Variable("keep", np.bool_), gs.Variable("wide", np.bool_), gs.Variable("term", np.float32)
    nodes = [
        gs.Node("Shape", inputs=[past], outputs=[t["past_shape"]]),
        gs.Node("Gather", inputs=[t["past_shape"], c("two", 2)], outputs=[t["p"]], attrs={"axis": 0}),
        gs.Node("Add", inputs=[t["p"], c("offset", offset)], outputs=[t["length"]]),
        gs.Node("Range", inputs=[c("start", 0), t["length"], c("step", 1)], outputs=[t["keys"]]),
        gs.Node("Unsqueeze", inputs=[t["keys"], c("axes", [0, 1, 2])], outputs=[t["keys4"]]),
        gs.Node("Unsqueeze", inputs=[t["p"], c("axes4", [0, 1, 2, 3])], outputs=[t["p4"]]),
        gs.Node("LessOrEqual", inputs=[t["keys4"], t["p4"]], outputs=[keep]),
        gs.Node("Shape", inputs=[x], outputs=[t["x_shape"]]),
        gs.Node("Gather", inputs=[t["x_shape"], c("zero", 0)], outputs=[t["b"]], attrs={"axis": 0}),
        gs.Node("Unsqueeze", inputs=[t["b"], c("axis0", [0])], outputs=[t["b1"]]),
        gs.Node("Unsqueeze", inputs=[t["length"], c("axis0_again", [0])], outputs=[t["length1"]]),
        gs.Node("Concat", inputs=[t["b1"], c("minus_one", [-1]), c("one", [1]), t["length1"]], outputs=[t["target"]],
                attrs={"axis": 0}),
        *expand_target_idiom(t["target"], t["target_ok"], "idiom"),
        gs.Node("Expand", inputs=[keep, t["target_ok"]], outputs=[wide]),
        gs.Node("Where", inputs=[wide, c("zero_f", 0.0, np.float32), c("lowest", np.finfo(np.float32).min, np.float32)],
                outputs=[term]),
    ]
    graph = gs.Graph(nodes=nodes, inputs=[x, past], outputs=[term], opset=17)
    return graph, t, term


def test_a_key_length_past_plus_one_is_a_value_and_names_the_dims_computed_from_it():
    # Before sums, past + 1 had no value: the expand target's -1 test could not be decided, the
    # Range's length and the term's dims stayed unknown (no attention fusion on a decode step).
    graph, t, term = _decode_mask_graph()
    facts.refresh_shapes(graph)
    shapes, ev = refined_dims(graph, facts.ShapeTable(graph))
    length = ev.value(t["length"]).elems[0]
    assert length is not None
    assert ev.value(t["target_ok"]).elems[:3] == ((1, ("batch",)), (1, ()), (1, ()))
    assert ev.value(t["target_ok"]).elems[3] == length
    name = shapes.dims(t["keys"])[0]
    assert name == length[1][0] and "past + 1" in name
    assert shapes.dims(term) == ["batch", 1, 1, name]


def test_a_length_that_may_be_negative_names_no_dim():
    # past - 1 is -1 at past 0: a Range of it is empty, not of that length; an Expand target's -1
    # test cannot be decided either.
    graph, t, term = _decode_mask_graph(offset=-1)
    facts.refresh_shapes(graph)
    shapes, ev = refined_dims(graph, facts.ShapeTable(graph))
    assert ev.value(t["length"]).elems[0] is not None  # a value, but no length
    assert "onnxfuse.sum" not in str(shapes.dims(t["keys"])[0])
    assert ev.value(t["target_ok"]) is None
    assert "onnxfuse.sum" not in str(shapes.dims(term)[3])


def test_sums_are_canonical_and_divide_exactly_or_not_at_all():
    from onnxfuse.graph import shape_sums as ss

    p, b, one = (1, ("past",)), (1, ("batch",)), (1, ())
    p1 = ss.add(p, one)
    assert p1 == ss.add(one, p) and p1[0] == 1 and ss.is_sum(p1[1][0])
    assert ss.add(p1, one, -1) == p  # (past + 1) - 1 is past again, a monomial
    two_p1 = ss.add(ss.mul((2, ()), p), (2, ()))
    assert two_p1 == (2, p1[1]) == ss.mul(p1, (2, ()))  # 2*past + 2 = 2 * (past + 1)
    bp1 = ss.mul(b, p1)  # batch*past + batch
    assert ss.divide(bp1, p1) == b and ss.divide(bp1, b) == p1
    assert ss.divide(p1, p) is None and ss.divide(ss.add(bp1, one), p1) is None
    sq = ss.mul(p1, p1)  # past^2 + 2 past + 1
    assert ss.divide(sq, p1) == p1
    assert ss.never_equal(p1, (-1, ())) and ss.never_equal(p1, p) and not ss.never_equal(p1, b)
    assert ss.nonnegative(p1) and not ss.nonnegative(ss.add(p, one, -1))


def test_a_scalar_reshaped_to_one_element_keeps_its_value_and_a_given_name_stays_over_a_sum():
    # torch.export writes the key length of repeat_kv's expand target as Reshape(past + 1, [-1]);
    # its Range over the keys is recorded as [total] (the attention mask's dim), which must stay:
    # the mask is proved with it (index-grid GatherND of the padding mask).
    past = gs.Variable("past_key", np.float32, ["batch", 2, "past", 16])
    c = lambda name, v: gs.Constant(name, np.array(v, np.int64))  # noqa: E731
    t = {k: gs.Variable(k, np.int64) for k in ("p1", "p", "length", "length1", "keys")}
    t["keys"].shape = ["total"]
    nodes = [
        gs.Node("Shape", inputs=[past], outputs=[t["p1"]], attrs={"start": 2, "end": 3}),
        gs.Node("Squeeze", inputs=[t["p1"], c("axes", [0])], outputs=[t["p"]]),
        gs.Node("Add", inputs=[t["p"], c("one", 1)], outputs=[t["length"]]),
        gs.Node("Reshape", inputs=[t["length"], c("flat", [-1])], outputs=[t["length1"]]),
        gs.Node("Range", inputs=[c("start", 0), t["length"], c("step", 1)], outputs=[t["keys"]]),
    ]
    graph = gs.Graph(nodes=nodes, inputs=[past], outputs=[t["length1"], t["keys"]], opset=17)
    shapes, ev = refined_dims(graph, facts.ShapeTable(graph))
    v = ev.value(t["length1"])
    assert v is not None and v.rank == 1 and v.elems == ev.value(t["length"]).elems
    assert "past + 1" in v.elems[0][1][0]
    assert shapes.dims(t["keys"]) == ["total"]
