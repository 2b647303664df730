"""Models with If, Loop and Scan: the passes run on the top-level graph only and leave subgraph
bodies exactly as they were; a top-level value read inside a body (outer-scope reference) stays
a stored value, and regions never wrap around the If/Loop/Scan that reads them."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper, numpy_helper

from onnxfuse import fuzz
from onnxfuse.fuzz import _run, compare, optimize_model

vi = helper.make_tensor_value_info


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "cf", inputs, [vi(o, T.FLOAT, [None] * r) for o, r in outputs.items()], list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def _pre():
    """x -> Add(w) -> Relu -> m, then Sigmoid: a fusable top-level chain whose middle value m
    the bodies read."""
    return [helper.make_node("Add", ["x", "w"], ["a"], name="add"), helper.make_node("Relu", ["a"], ["m"], name="relu"),
            helper.make_node("Sigmoid", ["m"], ["s"], name="sigmoid"), helper.make_node("Mul", ["s", "x"], ["p"], name="mul")]


W = numpy_helper.from_array(np.linspace(-1, 1, 6).astype(np.float32), "w")


def if_model():
    then = helper.make_graph([helper.make_node("Tanh", ["m"], ["t1"]), helper.make_node("Mul", ["t1", "m"], ["t_out"])],
                             "then", [], [vi("t_out", T.FLOAT, [None, 6])])
    other = helper.make_graph([helper.make_node("Neg", ["m"], ["e_out"])], "else", [], [vi("e_out", T.FLOAT, [None, 6])])
    nodes = _pre() + [
        helper.make_node("ReduceSum", ["x"], ["r"], keepdims=0, name="sum"),
        helper.make_node("Greater", ["r", "zero"], ["cond"], name="gt"),
        helper.make_node("If", ["cond"], ["b"], then_branch=then, else_branch=other, name="if"),
        helper.make_node("Add", ["b", "p"], ["y"], name="join"),
    ]
    return _model(nodes, [vi("x", T.FLOAT, ["n", 6])], {"y": 2}, [W, numpy_helper.from_array(np.array(0, np.float32), "zero")])


def loop_model():
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Mul", ["s_in", "half"], ["h"]),
         helper.make_node("Add", ["h", "m"], ["s_out"]), helper.make_node("Tanh", ["s_out"], ["scan"])],
        "body", [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("s_in", T.FLOAT, [None, 6])],
        [vi("c_out", T.BOOL, []), vi("s_out", T.FLOAT, [None, 6]), vi("scan", T.FLOAT, [None, 6])],
        [numpy_helper.from_array(np.array(0.5, np.float32), "half")])
    nodes = _pre() + [
        helper.make_node("Loop", ["trips", "", "p"], ["final", "stacked"], body=body, name="loop"),
        helper.make_node("Sub", ["final", "m"], ["d"], name="sub"), helper.make_node("Abs", ["d"], ["y"], name="abs"),
    ]
    return _model(nodes, [vi("x", T.FLOAT, ["n", 6])], {"y": 2, "stacked": 3},
                  [W, numpy_helper.from_array(np.array(3, np.int64), "trips")])


def scan_model():
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_t"], ["u"]), helper.make_node("Mul", ["u", "mrow"], ["s_out"]),
         helper.make_node("Relu", ["s_out"], ["y_t"])],
        "body", [vi("s_in", T.FLOAT, [6]), vi("x_t", T.FLOAT, [6])], [vi("s_out", T.FLOAT, [6]), vi("y_t", T.FLOAT, [6])])
    nodes = _pre() + [
        helper.make_node("ReduceMean", ["m"], ["mrow"], axes=[0], keepdims=0, name="mean"),
        helper.make_node("Scan", ["s0", "p"], ["final", "ys"], body=body, num_scan_inputs=1, name="scan"),
        helper.make_node("Sigmoid", ["ys"], ["y"], name="post"),
    ]
    return _model(nodes, [vi("x", T.FLOAT, [4, 6])], {"y": 2, "final": 1},
                  [W, numpy_helper.from_array(np.zeros(6, np.float32), "s0")])


def nested_model():
    """An If inside a Loop body reads the top-level value m two scopes down."""
    inner_then = helper.make_graph([helper.make_node("Add", ["s_in", "m"], ["it"])], "it", [], [vi("it", T.FLOAT, [None, 6])])
    inner_else = helper.make_graph([helper.make_node("Sub", ["s_in", "m"], ["ie"])], "ie", [], [vi("ie", T.FLOAT, [None, 6])])
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Greater", ["i", "one"], ["odd"]),
         helper.make_node("If", ["odd"], ["s_out"], then_branch=inner_then, else_branch=inner_else)],
        "body", [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("s_in", T.FLOAT, [None, 6])],
        [vi("c_out", T.BOOL, []), vi("s_out", T.FLOAT, [None, 6])],
        [numpy_helper.from_array(np.array(1, np.int64), "one")])
    nodes = _pre() + [helper.make_node("Loop", ["trips", "", "p"], ["final"], body=body, name="loop"),
                      helper.make_node("Tanh", ["final"], ["t"], name="tanh"),
                      helper.make_node("Add", ["t", "s"], ["y"], name="join")]
    return _model(nodes, [vi("x", T.FLOAT, ["n", 6])], {"y": 2}, [W, numpy_helper.from_array(np.array(3, np.int64), "trips")])


MODELS = {"if": if_model, "loop": loop_model, "scan": scan_model, "nested": nested_model}


def _plain(g: onnx.GraphProto) -> bytes:
    """A body without the value types shape inference may add, nested bodies included."""
    g = onnx.GraphProto.FromString(g.SerializeToString())

    def strip(graph):
        del graph.value_info[:]
        for v in list(graph.input) + list(graph.output):
            v.ClearField("type")
        for n in graph.node:
            for a in n.attribute:
                if a.HasField("g"):
                    strip(a.g)

    strip(g)
    return g.SerializeToString()


def _bodies(model):
    return {(n.name, a.name): _plain(a.g) for n in model.graph.node for a in n.attribute if a.HasField("g")}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_control_flow_model_is_optimized_around_its_bodies(name):
    model = MODELS[name]()
    onnx.checker.check_model(model, full_check=True)
    opt = optimize_model(model)
    onnx.checker.check_model(opt, full_check=True)
    # The top level is optimized (the chain around m fuses) ...
    assert any(n.domain == "onnxfuse" for n in opt.graph.node)
    # ... the value the bodies read is still made at the top level ...
    assert any("m" in n.output for n in opt.graph.node)
    # ... and the bodies are exactly as they were.
    assert _bodies(opt) == _bodies(model)
    for sign in (1.0, -1.0):
        x = (sign * np.abs(np.random.default_rng(5).standard_normal((4, 6)))).astype(np.float32)
        ref = _run(model, {"x": x}, with_library=False, level="disable")
        for with_library in (False, True):
            assert compare(ref, _run(opt, {"x": x}, with_library=with_library)) is None


def test_control_flow_model_through_the_cli(tmp_path, cli):
    path, out = tmp_path / "loop.onnx", tmp_path / "loop.opt.onnx"
    onnx.save(loop_model(), str(path))
    result = cli("optimize", path, out)
    assert result.exit_code == 0, result.stderr
    assert "verified" in result.stdout
    assert [n.op_type for n in onnx.load(str(out)).graph.node].count("Loop") == 1


def test_fuzz_cases_with_control_flow_pass():
    seeds = [s for s in range(400) if fuzz.build_case(s).control_flow][:12]
    assert len(seeds) == 12
    failures = [m for m in (fuzz.check_case(s) for s in seeds) if m]
    assert not failures, "\n".join(failures)
