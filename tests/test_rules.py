"""The rule engine (onnxfuse/graph/rules.py) and the activation vocabulary it serves."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnxfuse.graph import core as gu
from onnxfuse.graph import rules
from onnxfuse.graph.activations import CONV, STACKED_MLP, TABLE, names_fused_in
from onnxfuse.graph.rules import ANY, Const, Rule, Var, op

x = Var("x")
HARD_SWISH = x * op.Clip(x + 3.0, 0.0, 6.0) / 6.0


def graph_of(nodes, inits=None, opset=17, inputs=("x",), outputs=("y",)):
    inits = inits or {}
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, T.FLOAT, [2, 3]) for n in inputs],
        [helper.make_tensor_value_info(n, T.FLOAT, [2, 3]) for n in outputs],
        [onnx.numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()],
    )
    return gs.import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))


def root(graph, name="y"):
    return next(n for n in graph.nodes if n.outputs[0].name == name)


def hard_swish_nodes(three="three", clip_bounds=("zero", "six")):
    return [
        helper.make_node("Add", ["x", three], ["a"]),
        helper.make_node("Clip", ["a", *clip_bounds], ["c"]),
        helper.make_node("Mul", ["x", "c"], ["m"]),
        helper.make_node("Div", ["m", "six"], ["y"]),
    ]


CONSTS = {"three": 3.0, "zero": 0.0, "six": 6.0}


def test_pattern_matches_and_lists_nodes_operands_first():
    g = graph_of(hard_swish_nodes(), CONSTS)
    m = rules.match(HARD_SWISH, root(g))
    assert m is not None and [n.op for n in m.nodes] == ["Add", "Clip", "Mul", "Div"]
    assert m["x"] is g.inputs[0] and m.output.name == "y"


def test_commuted_operands_of_commutative_ops_match():
    nodes = hard_swish_nodes()
    nodes[0] = helper.make_node("Add", ["three", "x"], ["a"])  # 3 + x
    nodes[2] = helper.make_node("Mul", ["c", "x"], ["m"])  # clip * x
    assert rules.match(HARD_SWISH, root(graph_of(nodes, CONSTS))) is not None


def test_operands_of_non_commutative_ops_keep_their_order():
    nodes = hard_swish_nodes()
    nodes[3] = helper.make_node("Div", ["six", "m"], ["y"])  # 6 / m is another function
    assert rules.match(HARD_SWISH, root(graph_of(nodes, CONSTS))) is None


def test_constant_node_matches_like_an_initializer():
    nodes = [helper.make_node("Constant", [], ["three"], value=helper.make_tensor("v", T.FLOAT, [], [3.0]))]
    nodes += hard_swish_nodes()
    assert rules.match(HARD_SWISH, root(graph_of(nodes, {"zero": 0.0, "six": 6.0}))) is not None


def test_constant_of_another_value_does_not_match():
    assert rules.match(HARD_SWISH, root(graph_of(hard_swish_nodes(), {**CONSTS, "three": 2.5}))) is None


def test_clip_bounds_as_attributes_match_as_inputs():
    """Clip before opset 11 carries min and max as attributes."""
    nodes = hard_swish_nodes(clip_bounds=())
    nodes[1] = helper.make_node("Clip", ["a"], ["c"], min=0.0, max=6.0)
    assert rules.match(HARD_SWISH, root(graph_of(nodes, CONSTS, opset=10))) is not None


def test_a_recurring_name_must_be_the_same_tensor():
    nodes = hard_swish_nodes()
    nodes[2] = helper.make_node("Mul", ["x2", "c"], ["m"])  # x2 is not x
    g = graph_of(nodes, CONSTS, inputs=("x", "x2"))
    assert rules.match(HARD_SWISH, root(g)) is None


def test_intermediate_read_outside_the_match_is_not_private():
    nodes = hard_swish_nodes() + [helper.make_node("Neg", ["c"], ["other"])]
    g = graph_of(nodes, CONSTS, outputs=("y", "other"))
    assert rules.match(HARD_SWISH, root(g), {"y", "other"}) is None
    assert rules.match(HARD_SWISH, root(g), {"y", "other"}, private=False) is not None


def test_condition_and_bound_names():
    pattern = op.LeakyRelu(x, _name="act") * Const(name="k")
    g = graph_of([helper.make_node("LeakyRelu", ["x"], ["l"], alpha=0.1), helper.make_node("Mul", ["l", "k"], ["y"])],
                 {"k": 2.0})
    m = rules.match(pattern, root(g), condition=lambda m: m["k"] == 2.0)
    assert m is not None and m["act"].op == "LeakyRelu" and m["k"] == 2.0
    assert rules.match(pattern, root(g), condition=lambda m: m["k"] == 3.0) is None


def test_match_after_starts_from_a_given_tensor():
    # x * Clip(x + 3, 0, 6) / 6 with x the Relu's output: the Var is bound to it beforehand
    rewired = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "three"], ["a"]),
               helper.make_node("Clip", ["a", "zero", "six"], ["c"]), helper.make_node("Mul", ["r", "c"], ["m"]),
               helper.make_node("Div", ["m", "six"], ["y"])]
    g = graph_of(rewired, CONSTS)
    r = next(n for n in g.nodes if n.op == "Relu").outputs[0]
    found = rules.match_after([Rule("hardswish", HARD_SWISH)], g, r, "x", depth=3)
    assert found is not None and found[1].root.op == "Div"


def test_match_at_reads_back_from_the_tensor_a_chain_computes():
    g = graph_of(hard_swish_nodes(), CONSTS)
    y = next(n for n in g.nodes if n.op == "Div").outputs[0]
    clipped = next(n for n in g.nodes if n.op == "Clip").outputs[0]
    rule = Rule("hardswish", HARD_SWISH)
    found = rules.match_at([rule], g, y)
    assert found is not None and found[0] is rule and found[1].output is y
    assert rules.match_at([rule], g, clipped) is None  # computed by a Clip: no Div root
    assert rules.match_at([rule], g, g.inputs[0]) is None  # a graph input: no producer


def test_apply_is_the_pass_loop():
    nodes = [helper.make_node("Identity", ["x"], ["i1"]), helper.make_node("Identity", ["i1"], ["i2"]),
             helper.make_node("Relu", ["i2"], ["y"])]
    g = graph_of(nodes)
    drop = Rule("drop", op.Identity(x), rewrite=lambda graph, m: gu.bypass(graph, m.root))
    assert rules.apply(g, [drop]) == 2
    g.cleanup()
    assert [n.op for n in g.nodes] == ["Relu"] and g.nodes[0].inputs[0] is g.inputs[0]


def test_any_input_matches_an_omitted_optional_input():
    g = graph_of([helper.make_node("Clip", ["x", "", "six"], ["y"])], {"six": 6.0})
    assert rules.match(op.Clip(x, ANY, ANY), root(g)) is not None
    assert gu.clip_bounds(root(g)) == (-np.inf, 6.0)


# --------------------------------------------------------------------------- the vocabulary


@pytest.mark.parametrize("act", TABLE, ids=lambda a: a.op)
def test_every_activation_lowers_to_a_program_op(act):
    from onnxfuse.lowering import PARAM_UNARY, UNARY
    from onnxfuse.program import OPS

    lowered = PARAM_UNARY[act.op][0] if act.params else UNARY[act.op]
    assert lowered == act.name and act.name in OPS


def test_every_conv_epilogue_activation_is_a_program_the_cuda_printer_renders():
    from onnxfuse.cuda.codegen import body_lines
    from onnxfuse.cuda.conv_plan import ACTIVATIONS, Epilogue
    from onnxfuse.program import Program

    assert set(names_fused_in(CONV)) <= set(ACTIVATIONS)
    for name in ACTIVATIONS:
        prog = Epilogue(name, 0.5, 1.0).program()
        assert Program.parse(prog.to_text()).to_text() == prog.to_text()
        body_lines(prog, ["v"], "f32", "")


def test_stacked_mlp_activations_are_unary_program_ops():
    # kernels/stacked_mlp_cpu.cc runs each as a one-instruction program (pointwise_exec.inc)
    from onnxfuse.program import OPS

    acts = [a for a in TABLE if STACKED_MLP in a.fused_in]
    assert acts and all(OPS[a.name].arity == 1 and OPS[a.name].nparams == len(a.params) for a in acts)


# --------------------------------------------------------------------------- GELU forms

GELU_CONSTS = {"s": 1.4142, "r": 0.7071, "one": 1.0, "half": 0.5, "three": 3.0, "k": 0.044715, "s2pi": 0.79788}
N = helper.make_node
GELU_CORES = {
    "erf, x / sqrt 2": [N("Div", ["x", "s"], ["d"]), N("Erf", ["d"], ["e"])],
    "erf, x * 1/sqrt 2": [N("Mul", ["r", "x"], ["d"]), N("Erf", ["d"], ["e"])],
    "tanh, Pow cube": [N("Pow", ["x", "three"], ["c3"]), N("Mul", ["k", "c3"], ["kc"]), N("Add", ["kc", "x"], ["in"]),
                       N("Mul", ["in", "s2pi"], ["u"]), N("Tanh", ["u"], ["e"])],
    "tanh, x*x*x cube": [N("Mul", ["x", "x"], ["x2"]), N("Mul", ["x2", "x"], ["c3"]), N("Mul", ["c3", "k"], ["kc"]),
                         N("Add", ["x", "kc"], ["in"]), N("Mul", ["s2pi", "in"], ["u"]), N("Tanh", ["u"], ["e"])],
}
GELU_OUTERS = {
    "(x * 0.5) * (1 + core)": [N("Add", ["one", "e"], ["a"]), N("Mul", ["half", "x"], ["xh"]), N("Mul", ["a", "xh"], ["y"])],
    "0.5 * (x * (core + 1))": [N("Add", ["e", "one"], ["a"]), N("Mul", ["x", "a"], ["xa"]), N("Mul", ["half", "xa"], ["y"])],
    "((core + 1) * 0.5) * x": [N("Add", ["e", "one"], ["a"]), N("Mul", ["a", "half"], ["ah"]), N("Mul", ["ah", "x"], ["y"])],
}


@pytest.mark.parametrize("outer", sorted(GELU_OUTERS))
@pytest.mark.parametrize("core", sorted(GELU_CORES))
def test_gelu_forms_cover_the_groupings_exporters_write(core, outer):
    from onnxfuse.graph.index import GraphIndex
    from onnxfuse.graph.ort_fusions import match_gelu

    nodes = [N("Identity", ["x0"], ["x"]), *GELU_CORES[core], *GELU_OUTERS[outer]]
    g = graph_of(nodes, GELU_CONSTS, inputs=("x0",))
    found = {id(n) for n in match_gelu(GraphIndex(g))}
    assert found == {id(n) for n in g.nodes if n.op != "Identity"}


# Domains, variadic inputs and reasons -------------------------------------------------------


def contrib_graph():
    nodes = [helper.make_node("Add", ["x", "b"], ["q"]),
             helper.make_node("MultiHeadAttention", ["q", "x", "x", "", "mask"], ["y"], domain="com.microsoft",
                              num_heads=2)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, T.FLOAT, [1, 2, 4]) for n in ("x", "mask")],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, 2, 4])],
                          [onnx.numpy_helper.from_array(np.ones(4, np.float32), "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return gs.import_onnx(model)


def test_an_op_pattern_of_another_domain_matches_that_domain_only():
    g = contrib_graph()
    mha = root(g)
    ms = rules.ops("com.microsoft")
    m = rules.match(ms.MultiHeadAttention(x + Var("b"), x, x, rules.Rest("more"), num_heads=2), mha)
    assert m is not None and m["b"].name == "b"
    why = []
    assert rules.match(op.MultiHeadAttention(ANY, ANY, ANY, rules.Rest("more")), mha, why=why) is None
    assert why == ["com.microsoft.MultiHeadAttention is not MultiHeadAttention"]
    assert rules.ops("ai.onnx").Relu(x).domain == ""


def test_rest_binds_the_remaining_inputs_as_a_tuple_and_counts_them():
    g = contrib_graph()
    ms = rules.ops("com.microsoft")
    m = rules.match(ms.MultiHeadAttention(Var("q"), rules.Rest("more")), root(g))
    assert [t.name for t in m["more"]] == ["x", "x", "", "mask"]
    assert rules.match(ms.MultiHeadAttention(Var("q"), rules.Rest("more", min=5)), root(g)) is None
    # Without Rest a present input beyond the patterns is a mismatch, with its reason.
    why = []
    assert rules.match(ms.MultiHeadAttention(Var("q"), x, x), root(g), why=why) is None
    assert "has 5 inputs, not 3" in why[0]
    with pytest.raises(ValueError):
        op.Concat(rules.Rest("xs"), x)
    concat = graph_of([helper.make_node("Concat", ["x", "x2", "x"], ["y"], axis=0)], inputs=("x", "x2"))
    m = rules.match(op.Concat(rules.Rest("parts", min=2)), root(concat))
    assert [t.name for t in m["parts"]] == ["x", "x2", "x"]


def test_the_reason_names_the_furthest_point_the_pattern_reached():
    nodes = hard_swish_nodes()
    nodes[1] = helper.make_node("Relu", ["a"], ["c"])  # Clip replaced
    why = []
    assert rules.match(HARD_SWISH, root(graph_of(nodes, CONSTS)), why=why) is None
    assert why == ["Relu is not Clip"]
    why = []
    assert rules.match(HARD_SWISH, root(graph_of(hard_swish_nodes(), {**CONSTS, "three": 2.5})), why=why) is None
    assert why == ["input 1 of Add is 2.5, not the constant 3"]
    nodes = hard_swish_nodes() + [helper.make_node("Neg", ["c"], ["other"])]
    why = []
    assert rules.match(HARD_SWISH, root(graph_of(nodes, CONSTS, outputs=("y", "other"))), why=why) is None
    assert why == ["Clip's output 'c' is read outside the match, by Neg"]


def test_a_condition_or_rewrite_declines_with_its_reason_and_apply_hands_it_on():
    g = graph_of([helper.make_node("Identity", ["x"], ["i1"]), helper.make_node("Relu", ["i1"], ["y"])])
    refuse = Rule("refuse", op.Identity(x), condition=lambda m, graph: rules.fail("not today"),
                  rewrite=lambda graph, m: True)
    decline = Rule("decline", op.Identity(x), rewrite=lambda graph, m: rules.fail("nothing to gain"))
    said = []
    assert rules.apply(g, [refuse, decline], explain=lambda node, why: said.append(why)) == 0
    assert said == ["refuse: not today; decline: nothing to gain"]
    quiet = Rule("quiet", op.Identity(x), condition=lambda m, graph: False)
    said.clear()
    assert rules.apply(g, [quiet], explain=lambda node, why: said.append(why)) == 0
    assert said == ["its condition does not hold"]
    assert not rules.fail("x") and repr(rules.fail("x")) == "fail('x')"


def test_alternatives_are_tried_in_order_and_bind_only_their_own_names():
    scaled = rules.alt(op.Mul(x, Const(name="c")), op.Div(x, Const(name="d")), x)
    relu = op.Relu(scaled)
    mul = graph_of([helper.make_node("Mul", ["half", "x"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
                   {"half": 0.5})
    m = rules.match(relu, root(mul))
    assert m["c"] == 0.5 and m.get("d") is None and m["x"].name == "x" and [n.op for n in m.nodes] == ["Mul", "Relu"]
    div = graph_of([helper.make_node("Div", ["x", "two"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
                   {"two": 2.0})
    m = rules.match(relu, root(div))
    assert m["d"] == 2.0 and m.get("c") is None
    # The last alternative, x itself: Relu(Sub(...)) binds x to the Sub's output.
    sub = graph_of([helper.make_node("Sub", ["x", "x"], ["s"]), helper.make_node("Relu", ["s"], ["y"])])
    m = rules.match(relu, root(sub))
    assert m["x"].name == "s" and m.get("c") is None and len(m.nodes) == 1
    # An optional node: Cast or nothing; without a match the reason is the furthest reached.
    optional = op.Relu(rules.alt(op.Cast(op.Neg(x), to=1), op.Neg(x)))
    why = []
    cast = graph_of([helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Cast", ["a"], ["s"], to=1),
                     helper.make_node("Relu", ["s"], ["y"])])
    assert rules.match(optional, root(cast), why=why) is None
    assert why == ["Abs is not Neg"]
    # A condition that declines one alternative's match lets the next one be tried.
    neg = graph_of([helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Relu", ["n"], ["y"])])
    either = op.Relu(rules.alt(op.Neg(Var("a")), Var("b")))
    m = rules.match(either, root(neg), condition=lambda m: "a" not in m.bindings)
    assert m is not None and m["b"].name == "n"
    # Alternatives that are all ops say so in one reason.
    why = []
    assert rules.match(op.Relu(rules.alt(op.Mul(x, 2.0), op.Div(x, 2.0), op.Neg(x))), root(sub), why=why) is None
    assert why == ["input 0 of Relu is computed by Sub, not by Mul, Div or Neg"]
    why = []  # nested alternatives alike
    assert rules.match(op.Relu(rules.alt(op.Mul(x, 2.0), rules.alt(op.Div(x, 2.0), op.Neg(x)))), root(sub), why=why) is None
    assert why == ["input 0 of Relu is computed by Sub, not by Mul, Div or Neg"]


def test_commit_judges_the_first_way_only_and_a_matched_rule_gives_the_reason():
    # Mul(x, x2): commuted, both orders match op.Mul(Var a, Var b).
    g = graph_of([helper.make_node("Mul", ["x", "x2"], ["y"])], inputs=("x", "x2"))
    pattern = op.Mul(Var("a"), Var("b"))
    first_only = []

    def not_x_first(m):
        first_only.append(m["a"].name)
        return rules.fail("a is x") if m["a"].name == "x" else True

    assert rules.match(pattern, root(g), condition=not_x_first)["a"].name == "x2"
    first_only.clear()
    why = []
    assert rules.match(pattern, root(g), condition=not_x_first, commit=True, why=why) is None
    assert first_only == ["x"] and why == ["a is x"]
    # Of several rules, those whose pattern matched say why; the others are left out.
    said = []
    rules.apply(g, [Rule("relu", op.Mul(op.Relu(x), Var("b"))), Rule("cond", pattern, condition=lambda m, gr: rules.fail("no")),
                    Rule("neg", op.Mul(op.Neg(x), Var("b")))], explain=lambda node, w: said.append(w))
    assert said == ["no"]


def test_of_rules_whose_patterns_did_not_match_the_furthest_say_why_once():
    g = graph_of([helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Relu", ["n"], ["y"])])
    said = []
    two = [Rule("a", op.Relu(op.Abs(x))), Rule("b", op.Relu(op.Abs(x)))]
    rules.apply(g, two, explain=lambda node, w: said.append(w))
    assert said == ["Neg is not Abs"]  # one line, not two named
    said.clear()
    deeper = [Rule("shallow", op.Relu(op.Abs(x))), Rule("deep", op.Relu(op.Neg(op.Exp(x))))]
    rules.apply(g, deeper, explain=lambda node, w: said.append(w))
    assert said == ["input 0 of Neg is 'x', computed by no node, not by Exp"]


def test_match_reader_takes_a_private_tail_with_the_tensor_bound():
    relu = (Rule("relu", op.Relu(Var("t"))),)
    g = graph_of([helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Relu", ["e"], ["y"])])
    e = root(g, "y").inputs[0]
    rule, m = rules.match_reader(relu, g, e, "t")
    assert m.root.op == "Relu" and m["t"] is e
    # read twice, or a graph output: the tail would not be private
    shared = graph_of([helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Relu", ["e"], ["y"]),
                       helper.make_node("Neg", ["e"], ["z"])], outputs=("y", "z"))
    assert rules.match_reader(relu, shared, root(shared, "y").inputs[0], "t") is None
    exposed = graph_of([helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Relu", ["e"], ["y"])],
                       outputs=("y", "e"))
    assert rules.match_reader(relu, exposed, root(exposed, "y").inputs[0], "t") is None


def test_through_follows_a_bounded_path_to_its_inner_pattern():
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Neg", ["e"], ["n1"]),
             helper.make_node("Neg", ["n1"], ["y"])]
    g = graph_of(nodes)
    y = root(g).outputs[0]
    exp_after_negs = rules.through(["Neg"], op.Exp(x, _name="exp"), 2, name="negs")
    m = rules.match_value(exp_after_negs, y)
    assert [n.op for n in m.nodes] == ["Exp", "Neg", "Neg"]  # operands before readers
    assert [n.outputs[0].name for n in m["negs"]] == ["y", "n1"]  # reader first
    assert m["exp"].op == "Exp" and m["x"].name == "x"
    # no node passed: the inner pattern itself
    assert rules.match_value(exp_after_negs, root(g, "e").outputs[0])["negs"] == ()
    # a path longer than allowed, and the reason the matcher gives for it
    assert rules.match_value(rules.through(["Neg"], op.Exp(x), 1), y) is None
    why: list = []
    assert rules.match(op.Abs(rules.through(["Neg"], op.Exp(x), 1)),
                       gs.Node("Abs", inputs=[y], outputs=[gs.Variable("z")]), why=why) is None
    assert "through more than 1 of Neg" in why[0], why


def test_a_value_read_before_the_pattern_that_computes_it_is_the_same_tensor():
    # Where(IsNaN(p), 0, p): IsNaN's operand comes first, the Softmax that computes p last
    guard = op.Where(op.IsNaN(Var("p"), _name="isnan"), Const(0.0), op.Softmax(x, _value="p", _name="softmax"))
    zero = {"zero": 0.0}
    nodes = [helper.make_node("Softmax", ["x"], ["s"]), helper.make_node("IsNaN", ["s"], ["n"]),
             helper.make_node("Where", ["n", "zero", "s"], ["y"])]
    m = rules.match(guard, root(graph_of(nodes, zero)))
    assert m is not None and m["p"] is m["softmax"].outputs[0]
    assert [n.op for n in m.nodes] == ["IsNaN", "Softmax", "Where"]
    # IsNaN of another tensor: the Softmax's output is not 'p'
    other = [helper.make_node("Softmax", ["x"], ["s"]), helper.make_node("IsNaN", ["x"], ["n"]),
             helper.make_node("Where", ["n", "zero", "s"], ["y"])]
    why: list = []
    assert rules.match(guard, root(graph_of(other, zero)), why=why) is None
    assert "not 'p'" in str(why[0]), why


def test_through_at_several_operands_follows_each_in_turn():
    # Where(c, s, fill): the path goes on at operand 1, not at the condition (operand 0)
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("IsNaN", ["x"], ["c"]),
             helper.make_node("Where", ["c", "e", "x"], ["y"])]
    g = graph_of(nodes)
    y = root(g).outputs[0]
    assert rules.match_value(rules.through(["Where"], op.Exp(x), 1), y) is None  # operand 0 only
    m = rules.match_value(rules.through(["Where"], op.Exp(x), 1, operand=(0, 1, 2)), y)
    assert m is not None and [n.op for n in m.nodes] == ["Exp", "Where"]
