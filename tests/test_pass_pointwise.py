"""The pointwise-fusion pass: region formation, views, conditions and the target policy.

Every rewritten model is checked three ways against the original model in onnxruntime:
the fallback functions (optimized model run without our library), each Pointwise program
evaluated by the numpy reference (Program.evaluate) on the node's actual inputs, and, where
the built library has the Pointwise kernel, the optimized model run with it.
"""
from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxfuse.pipeline import Context, run_passes, select_passes
from onnxfuse.program import ONNX_ELEM, Program

F = T.FLOAT


def model(nodes, inputs, outputs, inits=None, opset=17, elem=F):
    """inputs/outputs: [(name, shape)] (or (name, shape, elem_type)); inits: {name: array}."""

    def vi(spec):
        name, shape, *et = spec
        return helper.make_tensor_value_info(name, et[0] if et else elem, shape)

    graph = helper.make_graph(
        nodes, "g", [vi(s) for s in inputs], [vi(s) for s in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


def node(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, name=f"{op}_{outs[0]}", **attrs)


def fuse(m, target="cpu"):
    out, stats = run_passes(m, select_passes(["pointwise"], target), Context(target=target))
    onnx.checker.check_model(out)
    return out


def pointwise_nodes(m):
    return [n for n in m.graph.node if n.op_type == "Pointwise"]


def program_of(n) -> Program:
    return Program.parse(helper.get_attribute_value(next(a for a in n.attribute if a.name == "program")).decode())


def ops(m):
    return sorted(n.op_type for n in m.graph.node)


def session(m, with_library=False, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.log_severity_level = 3
    if with_library:
        from onnxfuse.runtime import library_path

        so.register_custom_ops_library(library_path())
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@functools.lru_cache(maxsize=None)
def library_has_pointwise() -> bool:
    graph = helper.make_graph(
        [helper.make_node("Pointwise", ["x"], ["y"], domain="onnxfuse", program="in x0 f32\nt0 = neg x0\nout t0 f32\n")],
        "probe", [helper.make_tensor_value_info("x", F, [2])], [helper.make_tensor_value_info("y", F, [2])],
    )
    one = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onnxfuse", 1)])
    one.ir_version = 10
    try:
        session(one, with_library=True).run(None, {"x": np.ones(2, np.float32)})
        return True
    except Exception:
        return False


def feeds_for(m, seed=0, dims=None):
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in m.graph.input:
        tt = i.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (dims or {}).get(d.dim_param, 3) for d in tt.shape.dim]
        dt = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if dt == np.bool_:
            feeds[i.name] = rng.random(shape) > 0.5
        elif dt.kind in "iu":
            feeds[i.name] = rng.integers(-3, 4, shape).astype(dt)
        else:
            feeds[i.name] = (rng.standard_normal(shape) * 2).astype(dt)
    return feeds


def assert_same(expected, got, rtol=1e-5, atol=1e-6):
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert e.shape == g.shape and e.dtype == g.dtype
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)


def check_equivalent(original, fused, dims=None, seeds=(0, 1)):
    """The fused model computes what the original computes: fallback bodies, every program
    by the reference evaluator, and the native kernel when the library has it."""
    for seed in seeds:
        feeds = feeds_for(original, seed, dims)
        want = session(original).run(None, feeds)
        assert_same(want, session(fused).run(None, feeds))
        check_programs(fused, feeds)
        if library_has_pointwise():
            assert_same(want, session(fused, with_library=True).run(None, feeds), rtol=2e-5, atol=1e-5)


def check_programs(fused, feeds):
    """Evaluate each Pointwise program on the node's inputs (from the fallback run) and
    compare with the node's outputs."""
    probe = onnx.ModelProto()
    probe.CopyFrom(fused)
    have = {o.name for o in probe.graph.output} | {i.name for i in probe.graph.input}
    inits = {t.name: numpy_helper.to_array(t) for t in probe.graph.initializer}
    for n in pointwise_nodes(fused):
        prog = program_of(n)
        dtypes = [i.dtype for i in prog.inputs] + [o.dtype for o in prog.outputs]
        for name, dt in zip(list(n.input) + list(n.output), dtypes):
            if name not in have and name not in inits:
                probe.graph.output.append(helper.make_tensor_value_info(name, ONNX_ELEM[dt], None))
                have.add(name)
    names = [o.name for o in probe.graph.output]
    values = dict(zip(names, session(probe).run(None, feeds)))
    values.update(feeds)
    values.update(inits)
    for n in pointwise_nodes(fused):
        prog = program_of(n)
        got = prog.evaluate(*[values[i] for i in n.input])
        assert_same([values[o] for o in n.output], got, rtol=2e-5, atol=1e-5)


# ----------------------------------------------------------------------------- regions


def test_connected_elementwise_ops_become_one_region():
    nodes = [
        node("Add", ["x", "y"], ["a"]),
        node("Relu", ["a"], ["r"]),
        node("Sigmoid", ["a"], ["s"]),
        node("Mul", ["r", "s"], ["m"]),
        node("Tanh", ["m"], ["z"]),
    ]
    m = model(nodes, [("x", ["N", 8]), ("y", [8])], [("z", ["N", 8])])
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    prog = program_of(out.graph.node[0])
    assert [i.op for i in prog.instrs] == ["add", "relu", "sigmoid", "mul", "tanh"]
    check_equivalent(m, out)


def test_value_read_outside_becomes_a_second_output():
    nodes = [
        node("Add", ["x", "b"], ["a"]),
        node("Tanh", ["a"], ["t"]),
        node("MatMul", ["t", "w"], ["mm"]),  # reads the intermediate: not elementwise
        node("Sigmoid", ["t"], ["s"]),
        node("Mul", ["s", "x"], ["z"]),
    ]
    m = model(nodes, [("x", [4, 8])], [("z", [4, 8]), ("mm", [4, 8])],
              {"b": np.linspace(-1, 1, 8, dtype=np.float32), "w": np.eye(8, dtype=np.float32)})
    out = fuse(m)
    (pw,) = pointwise_nodes(out)
    assert sorted(pw.output) == ["t", "z"]
    check_equivalent(m, out)


def test_graph_output_that_is_also_an_intermediate():
    nodes = [node("Relu", ["x"], ["r"]), node("Exp", ["r"], ["e"]), node("Neg", ["e"], ["z"])]
    m = model(nodes, [("x", [2, 3])], [("r", [2, 3]), ("z", [2, 3])])
    out = fuse(m)
    (pw,) = pointwise_nodes(out)
    assert sorted(pw.output) == ["r", "z"]
    assert [o.name for o in out.graph.output] == ["r", "z"]
    check_equivalent(m, out)


def test_merging_across_an_outside_node_would_make_a_cycle():
    # Exp -> Relu -> MatMul -> Add -> Tanh with Relu also read by Add: one region holding
    # Exp, Relu, Add and Tanh would both feed and read the MatMul.
    nodes = [
        node("Exp", ["x"], ["e"]),
        node("Relu", ["e"], ["r"]),
        node("MatMul", ["r", "w"], ["mm"]),
        node("Add", ["r", "mm"], ["a"]),
        node("Tanh", ["a"], ["z"]),
    ]
    # (rank 3: a 2-D MatMul + Add would be left to onnxruntime's Gemm)
    m = model(nodes, [("x", [2, 4, 4])], [("z", [2, 4, 4])], {"w": np.eye(4, dtype=np.float32) * 0.5})
    out = fuse(m)
    regions = pointwise_nodes(out)
    assert len(regions) == 2
    groups = sorted(sorted(i.op for i in program_of(n).instrs) for n in regions)
    assert groups == [["add", "tanh"], ["exp", "relu"]]
    check_equivalent(m, out)


def test_siblings_read_by_one_consumer_region_join_it():
    nodes = [
        node("Sigmoid", ["x"], ["a"]),
        node("Tanh", ["y"], ["b"]),
        node("Mul", ["a", "b"], ["z"]),
    ]
    m = model(nodes, [("x", [3, 5]), ("y", [3, 5])], [("z", [3, 5])])
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    check_equivalent(m, out)


def test_value_smaller_than_the_iteration_shape_is_not_an_output():
    # r = Relu(x) has shape [8] and is a graph output; the region around Add has shape [3, 8].
    nodes = [node("Relu", ["x"], ["r"]), node("Add", ["r", "y"], ["a"]), node("Tanh", ["a"], ["z"])]
    m = model(nodes, [("x", [8]), ("y", [3, 8])], [("z", [3, 8]), ("r", [8])])
    out = fuse(m)
    assert ops(out) == ["Pointwise", "Relu"]
    (pw,) = pointwise_nodes(out)
    assert list(pw.output) == ["z"]
    check_equivalent(m, out)


def test_smaller_value_used_only_inside_is_broadcast():
    # the [B, S, 1] statistic chain (Add eps, Sqrt) is read only by the [B, S, D] Div
    nodes = [
        node("Add", ["v", "eps"], ["ve"]),
        node("Sqrt", ["ve"], ["sd"]),
        node("Div", ["x", "sd"], ["n"]),
        node("Neg", ["n"], ["z"]),
    ]
    m = model(nodes, [("x", ["B", 4, 8]), ("v", ["B", 4, 1])], [("z", ["B", 4, 8])], {"eps": np.array(1e-5, np.float32)})
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    check_equivalent(m, out, dims={"B": 2})


def test_integer_values_stay_outside():
    nodes = [
        node("Cast", ["x"], ["xi"], to=T.INT64),
        node("Add", ["xi", "one"], ["ai"]),
        node("Cast", ["ai"], ["af"], to=F),
        node("Relu", ["af"], ["r"]),
        node("Mul", ["r", "x"], ["z"]),
    ]
    m = model(nodes, [("x", [3, 4])], [("z", [3, 4])], {"one": np.array(1, np.int64)})
    out = fuse(m)
    assert ops(out) == ["Add", "Cast", "Cast", "Pointwise"]
    check_equivalent(m, out)


def test_comparison_and_where_with_bool_values():
    nodes = [
        node("Greater", ["x", "y"], ["g"]),
        node("Not", ["g"], ["ng"]),
        node("Where", ["ng", "x", "y"], ["w"]),
        node("Cast", ["g"], ["gf"], to=F),
        node("Add", ["w", "gf"], ["z"]),
    ]
    m = model(nodes, [("x", [3, 4]), ("y", [4])], [("z", [3, 4]), ("ng", [3, 4], T.BOOL)])
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    check_equivalent(m, out)


def test_symbolic_dims_must_match_by_name():
    same = model([node("Add", ["x", "y"], ["a"]), node("Relu", ["a"], ["z"])], [("x", ["N", 4]), ("y", ["N", 4])], [("z", ["N", 4])])
    assert ops(fuse(same)) == ["Pointwise"]
    # Two different names: the output shape cannot be proved equal to the broadcast.
    other = model([node("Add", ["x", "y"], ["a"]), node("Relu", ["a"], ["z"])], [("x", ["N", 4]), ("y", ["M", 4])], [("z", [None, 4])])
    assert "Pointwise" not in ops(fuse(other))


def test_single_op_does_not_pay():
    m = model([node("Relu", ["x"], ["z"])], [("x", [3, 4])], [("z", [3, 4])])
    assert ops(fuse(m)) == ["Relu"]


def test_identity_and_dropout_count_as_no_work():
    m = model([node("Identity", ["x"], ["i"]), node("Relu", ["i"], ["z"])], [("x", [3, 4])], [("z", [3, 4])])
    assert "Pointwise" not in ops(fuse(m))
    m2 = model([node("Dropout", ["x"], ["d"]), node("Relu", ["d"], ["r"]), node("Exp", ["r"], ["z"])], [("x", [3, 4])], [("z", [3, 4])])
    out = fuse(m2)
    assert ops(out) == ["Pointwise"]
    check_equivalent(m2, out)


def test_equal_valued_constants_become_literals_and_others_inputs():
    inits = {
        "half": np.full((1, 4), 0.5, np.float32),  # all equal: literal
        "ramp": np.arange(4, dtype=np.float32),  # varying: a node input
        "big": np.full((2, 3, 4), 2.0, np.float32),  # all equal but grows the shape: an input
    }
    nodes = [node("Mul", ["x", "half"], ["a"]), node("Add", ["a", "ramp"], ["b"]), node("Mul", ["b", "big"], ["z"])]
    m = model(nodes, [("x", [3, 4])], [("z", [2, 3, 4])], inits)
    out = fuse(m)
    (pw,) = pointwise_nodes(out)
    assert list(pw.input) == ["x", "ramp", "big"]
    assert program_of(pw).instrs[0].args == ("x0", 0.5)
    check_equivalent(m, out)


def test_constant_node_operands_are_written_into_the_fallback():
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32))),
        node("Add", ["x", "c"], ["a"]),
        node("Exp", ["a"], ["z"]),
    ]
    m = model(nodes, [("x", [2, 3])], [("z", [2, 3])])
    out = fuse(m)
    assert "Pointwise" in ops(out)
    check_equivalent(m, out)


def test_float16_region():
    nodes = [node("Add", ["x", "y"], ["a"]), node("Sigmoid", ["a"], ["z"])]
    m = model(nodes, [("x", [3, 4]), ("y", [3, 4])], [("z", [3, 4])], elem=T.FLOAT16)
    out = fuse(m)
    (pw,) = pointwise_nodes(out)
    assert program_of(pw).inputs[0].dtype == "f16"
    feeds = feeds_for(m)
    assert_same(session(m).run(None, feeds), session(out).run(None, feeds), rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------- views


def test_slice_with_negative_and_odd_steps_is_read_as_a_view():
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    nodes = [
        node("Slice", ["x", "st", "en", "ax", "sp"], ["s"]),
        node("Relu", ["s"], ["z"]),
    ]
    inits = {"st": i64(-1, 1), "en": i64(-100, 9), "ax": i64(1, 0), "sp": i64(-3, 2)}
    m = model(nodes, [("x", [10, 11])], [("z", [4, 4])], inits)
    out = fuse(m)
    assert ops(out) == ["Pointwise"]  # one op and a Slice that disappears: pays
    (pw,) = pointwise_nodes(out)
    assert list(pw.input) == ["x"]
    view = program_of(pw).inputs[0].view
    assert [(v.axis, v.start, v.end, v.step) for v in view] == [(0, 1, 9, 2), (1, -1, -100, -3)]
    check_equivalent(m, out)


def test_split_outputs_are_views_and_the_split_disappears():
    nodes = [
        node("Split", ["x", "sizes"], ["a", "b", "c"], axis=1),
        node("Sigmoid", ["a"], ["sa"]),
        node("Tanh", ["b"], ["tb"]),
        node("Mul", ["sa", "tb"], ["m"]),
        node("Add", ["m", "c"], ["z"]),
    ]
    m = model(nodes, [("x", ["N", 12])], [("z", ["N", 4])], {"sizes": np.array([4, 4, 4], np.int64)})
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    (pw,) = pointwise_nodes(out)
    assert list(pw.input) == ["x", "x", "x"]
    assert [(i.view[0].start, i.view[0].end) for i in program_of(pw).inputs] == [(0, 4), (4, 8), (8, 12)]
    check_equivalent(m, out, dims={"N": 2})


def test_equal_split_of_a_static_dim_and_split_attribute_before_opset_13():
    nodes = [node("Split", ["x"], ["a", "b"], axis=-1), node("Mul", ["a", "b"], ["m"]), node("Exp", ["m"], ["z"])]
    m = model(nodes, [("x", [3, 8])], [("z", [3, 4])])
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    check_equivalent(m, out)
    nodes11 = [node("Split", ["x"], ["a", "b"], axis=1, split=[3, 5]), node("Relu", ["a"], ["r"]), node("Exp", ["r"], ["z"])]
    m11 = model(nodes11, [("x", [2, 8])], [("z", [2, 3]), ("b", [2, 5])], opset=11)
    out11 = fuse(m11)
    assert sorted(ops(out11)) == ["Pointwise", "Split"]  # b is a graph output: the Split stays
    check_equivalent(m11, out11)


def test_partially_fused_split_stays_for_its_other_readers():
    nodes = [
        node("Split", ["x", "sizes"], ["a", "b", "c"], axis=1),
        node("Sigmoid", ["a"], ["sa"]),
        node("Mul", ["sa", "b"], ["z"]),
        node("MatMul", ["c", "w"], ["mm"]),
    ]
    m = model(nodes, [("x", [3, 12])], [("z", [3, 4]), ("mm", [3, 4])],
              {"sizes": np.array([4, 4, 4], np.int64), "w": np.eye(4, dtype=np.float32)})
    out = fuse(m)
    assert ops(out) == ["MatMul", "Pointwise", "Split"]
    (pw,) = pointwise_nodes(out)
    assert list(pw.input) == ["x", "x"]
    check_equivalent(m, out)


def test_view_is_pushed_through_the_elementwise_producer_of_the_split():
    # LSTM gates: Add(gates, bias) -> Split -> activations: the Add runs on each piece.
    nodes = [
        node("Add", ["g", "bias"], ["gb"]),
        node("Split", ["gb", "sizes"], ["i", "f"], axis=1),
        node("Sigmoid", ["i"], ["si"]),
        node("Tanh", ["f"], ["tf"]),
        node("Mul", ["si", "tf"], ["z"]),
    ]
    m = model(nodes, [("g", [2, 8])], [("z", [2, 4])],
              {"bias": np.arange(8, dtype=np.float32) / 8, "sizes": np.array([4, 4], np.int64)})
    out = fuse(m)
    assert ops(out) == ["Pointwise"]
    (pw,) = pointwise_nodes(out)
    assert list(pw.input) == ["g", "bias", "g", "bias"]
    views = [(i.view[0].axis, i.view[0].start) for i in program_of(pw).inputs]
    assert views == [(1, 0), (0, 0), (1, 4), (0, 4)]
    check_equivalent(m, out)


def lstm_model(steps=3, hidden=8, batch=2):
    """An unrolled LSTM: per step MatMul, MatMul, Add x3, Split, the cell's elementwise ops."""
    rng = np.random.default_rng(7)
    inits = {"sizes": np.array([hidden] * 4, np.int64)}
    nodes = []
    h, c = "h0", "c0"
    inits["W"] = rng.standard_normal((hidden, 4 * hidden)).astype(np.float32) * 0.3
    inits["R"] = rng.standard_normal((hidden, 4 * hidden)).astype(np.float32) * 0.3
    inits["b"] = rng.standard_normal(4 * hidden).astype(np.float32) * 0.1
    for t in range(steps):
        s = f"_{t}"
        nodes += [
            node("MatMul", [f"x{t}", "W"], ["xw" + s]),
            node("MatMul", [h, "R"], ["hr" + s]),
            node("Add", ["xw" + s, "hr" + s], ["g0" + s]),
            node("Add", ["g0" + s, "b"], ["g" + s]),
            node("Split", ["g" + s, "sizes"], ["i" + s, "f" + s, "gg" + s, "o" + s], axis=1),
            node("Sigmoid", ["i" + s], ["si" + s]),
            node("Sigmoid", ["f" + s], ["sf" + s]),
            node("Tanh", ["gg" + s], ["tg" + s]),
            node("Sigmoid", ["o" + s], ["so" + s]),
            node("Mul", ["sf" + s, c], ["fc" + s]),
            node("Mul", ["si" + s, "tg" + s], ["ig" + s]),
            node("Add", ["fc" + s, "ig" + s], ["c" + s]),
            node("Tanh", ["c" + s], ["tc" + s]),
            node("Mul", ["so" + s, "tc" + s], ["h" + s]),
        ]
        h, c = "h" + s, "c" + s
    inputs = [(f"x{t}", [batch, hidden]) for t in range(steps)] + [("h0", [batch, hidden]), ("c0", [batch, hidden])]
    return model(nodes, inputs, [(h, [batch, hidden]), (c, [batch, hidden])], inits)


def test_unrolled_lstm_one_pointwise_per_step_no_split_left():
    m = lstm_model()
    out = fuse(m)
    counts = {op: ops(out).count(op) for op in set(ops(out))}
    # The first Add of each step reads a 2-D MatMul: left to onnxruntime's Gemm (CPU policy).
    assert counts == {"MatMul": 6, "Add": 3, "Pointwise": 3}
    for pw in pointwise_nodes(out):
        prog = program_of(pw)
        assert sum(1 for i in prog.inputs if i.view) == 8  # 4 gates x (gate sum, bias)
    check_equivalent(m, out)


def test_fallback_body_is_valid_when_a_tensor_is_read_through_several_views():
    out = fuse(lstm_model(steps=1))
    onnx.checker.check_model(out, full_check=True)
    for fn in out.functions:
        assert len(set(fn.input)) == len(fn.input)


# ----------------------------------------------------------------------------- policy


RNG = np.random.default_rng(3)
GAMMA = np.linspace(0.5, 1.5, 16).astype(np.float32)
BETA = np.linspace(-0.2, 0.2, 16).astype(np.float32)
SCAL = lambda v: np.array(v, np.float32)  # noqa: E731



def case(pattern, inputs, out, inits, kept, prefix=(), suffix=(), full_inputs=None):
    """A pattern onnxruntime fuses (inputs -> out), and a model that surrounds it with
    elementwise ops a region would like to merge with (prefix/suffix)."""
    return dict(pattern=pattern, inputs=inputs, out=out, inits=inits, kept=kept,
                prefix=list(prefix), suffix=list(suffix), full_inputs=full_inputs or inputs)


X3 = [("x", [2, 4, 16])]
EXP_AFTER = [node("Exp", ["y"], ["z"])]
POLICY_CASES = {
    "conv-relu": case(
        [node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]), node("Relu", ["c"], ["y"])],
        [("x", [1, 3, 8, 8])], ("y", [1, 4, 8, 8]), {"W": RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)},
        "Relu", suffix=EXP_AFTER,
    ),
    "matmul-add-2d": case(
        [node("MatMul", ["x", "W"], ["m"]), node("Add", ["m", "b"], ["y"])],
        [("x", [4, 16])], ("y", [4, 16]), {"W": RNG.standard_normal((16, 16)).astype(np.float32), "b": GAMMA},
        "Add", suffix=EXP_AFTER,
    ),
    "matmul-add-relu-2d": case(
        [node("MatMul", ["x", "W"], ["m"]), node("Add", ["m", "b"], ["a"]), node("Relu", ["a"], ["y"])],
        [("x", [4, 16])], ("y", [4, 16]), {"W": RNG.standard_normal((16, 16)).astype(np.float32), "b": GAMMA},
        "Relu", suffix=EXP_AFTER,
    ),
    "matmul-scale": case(
        [node("MatMul", ["x", "W"], ["m"]), node("Mul", ["m", "s"], ["y"])],
        X3, ("y", [2, 4, 16]), {"W": RNG.standard_normal((16, 16)).astype(np.float32), "s": SCAL(0.125)},
        "Mul", suffix=EXP_AFTER,
    ),
    "skip-layernorm": case(
        [node("Add", ["x", "r"], ["s"]), node("LayerNormalization", ["s", "g", "be"], ["y"], axis=-1)],
        [("x", [2, 4, 16]), ("r", [2, 4, 16])], ("y", [2, 4, 16]), {"g": GAMMA, "be": BETA},
        "Add", prefix=[node("Exp", ["x0"], ["x"])], full_inputs=[("x0", [2, 4, 16]), ("r", [2, 4, 16])],
    ),
    "layernorm": case(
        [
            node("ReduceMean", ["x"], ["mu"], axes=[-1]), node("Sub", ["x", "mu"], ["d"]), node("Pow", ["d", "two"], ["p"]),
            node("ReduceMean", ["p"], ["v"], axes=[-1]), node("Add", ["v", "eps"], ["ve"]), node("Sqrt", ["ve"], ["sd"]),
            node("Div", ["d", "sd"], ["n"]), node("Mul", ["n", "g"], ["ng"]), node("Add", ["ng", "be"], ["y"]),
        ],
        X3, ("y", [2, 4, 16]), {"two": SCAL(2.0), "eps": SCAL(1e-5), "g": GAMMA, "be": BETA},
        "Div", suffix=EXP_AFTER,
    ),
    "rms-norm": case(
        [
            node("Pow", ["x", "two"], ["p"]), node("ReduceMean", ["p"], ["v"], axes=[-1]), node("Add", ["v", "eps"], ["ve"]),
            node("Sqrt", ["ve"], ["sd"]), node("Div", ["x", "sd"], ["n"]), node("Mul", ["n", "g"], ["y"]),
        ],
        X3, ("y", [2, 4, 16]), {"two": SCAL(2.0), "eps": SCAL(1e-5), "g": GAMMA},
        "Div", suffix=EXP_AFTER,
    ),
    # Hugging Face's LlamaRMSNorm as the TorchScript exporter writes it: float32 to float32
    # Casts around the computation, the reciprocal as Div(1, .), the weight Mul last.
    "rms-norm-casts": case(
        [
            node("Cast", ["x"], ["xc"], to=F), node("Pow", ["xc", "two"], ["p"]), node("ReduceMean", ["p"], ["v"], axes=[-1]),
            node("Add", ["v", "eps"], ["ve"]), node("Sqrt", ["ve"], ["sd"]), node("Div", ["one", "sd"], ["r"]),
            node("Mul", ["xc", "r"], ["n"]), node("Cast", ["n"], ["nc"], to=F), node("Mul", ["g", "nc"], ["y"]),
        ],
        X3, ("y", [2, 4, 16]), {"two": SCAL(2.0), "eps": SCAL(1e-6), "one": SCAL(1.0), "g": GAMMA},
        "Div", suffix=EXP_AFTER,
    ),
    "bias-gelu-erf": case(
        [
            node("Add", ["x", "b"], ["xb"]), node("Div", ["xb", "sq2"], ["d"]), node("Erf", ["d"], ["e"]),
            node("Add", ["e", "one"], ["a"]), node("Mul", ["xb", "a"], ["m"]), node("Mul", ["m", "half"], ["y"]),
        ],
        X3, ("y", [2, 4, 16]), {"b": GAMMA, "sq2": SCAL(1.4142135), "one": SCAL(1.0), "half": SCAL(0.5)},
        "Erf", suffix=EXP_AFTER,
    ),
    "bias-gelu-tanh": case(
        [
            node("Add", ["x0", "b"], ["x"]), node("Pow", ["x", "three"], ["c3"]), node("Mul", ["c3", "k"], ["kc"]), node("Add", ["x", "kc"], ["in"]),
            node("Mul", ["in", "s2pi"], ["ins"]), node("Tanh", ["ins"], ["t"]), node("Add", ["t", "one"], ["a"]),
            node("Mul", ["x", "half"], ["xh"]), node("Mul", ["xh", "a"], ["y"]),
        ],
        [("x0", [2, 4, 16])], ("y", [2, 4, 16]),
        {"b": GAMMA, "three": SCAL(3.0), "k": SCAL(0.044715), "s2pi": SCAL(0.7978845608), "one": SCAL(1.0), "half": SCAL(0.5)},
        "Tanh", suffix=EXP_AFTER,
    ),
    "silu": case(
        [node("Sigmoid", ["x"], ["s"]), node("Mul", ["x", "s"], ["y"])],
        X3, ("y", [2, 4, 16]), {}, "Sigmoid", suffix=EXP_AFTER,
    ),
}


def full_model(c):
    out = ("z", c["out"][1]) if c["suffix"] else c["out"]
    return model(c["prefix"] + c["pattern"] + c["suffix"], c["full_inputs"], [out], c["inits"])


def ort_kernels(m, with_library=False) -> list[str]:
    """Op types of the kernels onnxruntime (ORT_ENABLE_ALL, CPU, 1 thread) runs per inference."""
    import json
    import os
    import tempfile

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.enable_profiling = True
    so.log_severity_level = 3
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "p")
    if with_library:
        from onnxfuse.runtime import library_path

        so.register_custom_ops_library(library_path())
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    s.run(None, feeds_for(m))
    events = json.load(open(s.end_profiling()))
    return [e["args"]["op_name"] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


# onnxruntime 1.31 fuses the tanh GELU of gpt_stack (FastGelu) but not this standalone copy of
# it, whose result is the graph output (test_gelus_onnxruntime_does_not_fuse_become_regions); the
# rule is checked with an op after it and on the zoo model (test_gpt_stack_keeps_onnxruntime_fastgelu).
@pytest.mark.parametrize("name", sorted(set(POLICY_CASES) - {"bias-gelu-tanh"}))
def test_cpu_policy_patterns_are_fused_by_onnxruntime(name):
    """The measurement behind each CPU rule: onnxruntime runs the pattern as one kernel (a
    convolution also reorders its NCHWc output), the reserved op is no kernel of its own."""
    c = POLICY_CASES[name]
    kernels = ort_kernels(model(c["pattern"], c["inputs"], [c["out"]], c["inits"]))
    assert c["kept"] not in kernels
    assert len([k for k in kernels if k != "ReorderOutput"]) == 1, kernels


@pytest.mark.parametrize("name", sorted(set(POLICY_CASES) - {"skip-layernorm"}))
def test_cpu_policy_leaves_onnxruntime_fusions_alone(name):
    c = POLICY_CASES[name]
    m = full_model(c)
    out = fuse(m, "cpu")
    assert c["kept"] in ops(out)
    assert "Pointwise" not in ops(out)  # the op around it alone does not pay
    check_equivalent(m, out)


def _tanh_gelu_with_cube(cube_nodes):
    return [*cube_nodes, node("Mul", ["c3", "k"], ["kc"]), node("Add", ["x", "kc"], ["in"]),
            node("Mul", ["in", "s2pi"], ["ins"]), node("Tanh", ["ins"], ["t"]), node("Add", ["t", "one"], ["a"]),
            node("Mul", ["x", "half"], ["xh"]), node("Mul", ["xh", "a"], ["y"])]


GELU_CONSTS = {"three": SCAL(3.0), "k": SCAL(0.044715), "s2pi": SCAL(0.7978845608), "one": SCAL(1.0), "half": SCAL(0.5)}
# Tanh GELUs the gelu rule matches but onnxruntime 1.31 does not fuse: the result is the graph
# output, or the cube is written x * x * x. The pass asks onnxruntime (reserved_for_runtime)
# and makes them regions instead of leaving nine kernels.
UNFUSED_GELUS = {
    "result-is-graph-output": model(POLICY_CASES["bias-gelu-tanh"]["pattern"], [("x0", [2, 4, 16])], [("y", [2, 4, 16])],
                                    POLICY_CASES["bias-gelu-tanh"]["inits"]),
    "cube-as-products": model(_tanh_gelu_with_cube([node("Mul", ["x", "x"], ["x2"]), node("Mul", ["x2", "x"], ["c3"])])
                              + EXP_AFTER, [("x", [2, 4, 16])], [("z", [2, 4, 16])], GELU_CONSTS),
}


@pytest.mark.parametrize("name", sorted(UNFUSED_GELUS))
def test_gelus_onnxruntime_does_not_fuse_become_regions(name):
    m = UNFUSED_GELUS[name]
    assert "Tanh" in ort_kernels(m)  # the premise: onnxruntime leaves it in pieces
    out = fuse(m, "cpu")
    assert ops(out) == ["Pointwise"]
    check_equivalent(m, out)


def test_rules_stand_alone_when_onnxruntime_cannot_be_asked(monkeypatch):
    from onnxfuse import runtime

    def unavailable(model, with_library=True):
        raise RuntimeError("no session")

    monkeypatch.setattr(runtime, "executed_graph", unavailable)
    m = UNFUSED_GELUS["cube-as-products"]
    out = fuse(m, "cpu")
    assert "Pointwise" not in ops(out) and "Tanh" in ops(out)  # left to onnxruntime, as the rule says
    check_equivalent(m, out)


def test_gelu_onnxruntime_fuses_stays_with_it_beside_one_it_does_not():
    """One graph, two GELUs: the one onnxruntime fuses (FastGelu) is left to it, the other (cube
    written x * x * x) becomes a region: the probe decides node by node."""
    fused_one = [node("Pow", ["x", "three"], ["c3"])]
    other = [node("Mul", ["x", "x"], ["x2"]), node("Mul", ["x2", "x"], ["c3"])]
    rename = lambda nodes, sfx: [node(n.op_type, [i if i in GELU_CONSTS else i + sfx for i in n.input],  # noqa: E731
                                      [o + sfx for o in n.output]) for n in nodes]
    # Two graph inputs: GELUs of one value would share x * 0.5, which onnxruntime 1.31 merges and
    # then removes with the FastGelu it fuses, leaving the other GELU reading nothing.
    nodes = (rename(_tanh_gelu_with_cube(fused_one), "_a") + rename(_tanh_gelu_with_cube(other), "_b")
             + [node("Add", ["y_a", "y_b"], ["z"])])
    m = model(nodes, [("x_a", [2, 4, 16]), ("x_b", [2, 4, 16])], [("z", [2, 4, 16])], GELU_CONSTS)
    out = fuse(m, "cpu")
    kernels = ort_kernels(out, with_library=True)
    assert kernels.count("FastGelu") == 1 and "Tanh" not in kernels, kernels
    check_equivalent(m, out)


def test_cuda_policy_fuses_gelu_which_cpu_leaves_to_onnxruntime():
    m = full_model(POLICY_CASES["bias-gelu-tanh"])
    assert "Pointwise" not in ops(fuse(m, "cpu"))
    out = fuse(m, "cuda")
    assert ops(out) == ["Pointwise"]  # the Exp after it joins too
    check_equivalent(m, out)


def test_3d_matmul_bias_is_fused_on_cpu():
    """onnxruntime makes no Gemm of a MatMul with symbolic leading dims: the bias Add and the
    residual Add are one region."""
    nodes = [node("MatMul", ["x", "W"], ["m"]), node("Add", ["m", "b"], ["a"]), node("Add", ["a", "x"], ["z"])]
    m = model(nodes, [("x", ["B", "T", 16])], [("z", ["B", "T", 16])], {"W": RNG.standard_normal((16, 16)).astype(np.float32), "b": GAMMA})
    out = fuse(m)
    assert ops(out) == ["MatMul", "Pointwise"]
    check_equivalent(m, out, dims={"B": 2, "T": 5})


ZOO = __import__("pathlib").Path(__file__).resolve().parent.parent / "models"


@pytest.mark.skipif(not (ZOO / "gpt_stack.onnx").exists(), reason="zoo model models/gpt_stack.onnx not generated")
def test_gpt_stack_keeps_onnxruntime_fastgelu():
    m = onnx.load(str(ZOO / "gpt_stack.onnx"))
    out = fuse(m)
    before, after = ort_kernels(m), ort_kernels(out)
    assert before.count("FastGelu") == after.count("FastGelu") == 4
    # bias and residual Adds of the attention and MLP outputs: one region each (the last one
    # before ln_f too, which onnxruntime's slower SkipLayerNormalization would otherwise take)
    assert len(pointwise_nodes(out)) == 8
    assert "SkipLayerNormalization" not in ort_kernels(out, with_library=True)
    check_equivalent(m, out, dims={"batch": 2, "seq": 5}, seeds=(0,))


@pytest.mark.skipif(not (ZOO / "char_rnn.onnx").exists(), reason="zoo model models/char_rnn.onnx not generated")
def test_char_rnn_each_cell_is_one_pointwise_reading_its_gates_in_place():
    m = onnx.load(str(ZOO / "char_rnn.onnx"))
    out = fuse(m)
    assert ops(out).count("Pointwise") == 32
    assert "Split" not in ops(out) and "Sigmoid" not in ops(out) and "Tanh" not in ops(out)
    for pw in pointwise_nodes(out):
        assert sum(1 for i in program_of(pw).inputs if i.view) >= 4
    check_equivalent(m, out, seeds=(0,))
    if library_has_pointwise():
        # about 435 kernels before; per cell Gemm, Gemm, Pointwise after
        assert len(ort_kernels(out, with_library=True)) <= 130 < len(ort_kernels(m))


def test_split_piece_split_again_on_the_same_axis_is_read_stored():
    # b is read through a view of x, but the piece a is split again along the same axis: two
    # slices of one axis do not compose, so a is a stored input, and then the outer Split must
    # not be in the fallback body (it would define a twice).
    nodes = [
        node("Split", ["x", "sizes"], ["a", "b", "c"], axis=3),
        node("Split", ["a", "halves"], ["a0", "a1"], axis=3),
        node("GreaterOrEqual", ["b", "a1"], ["ge"]),
        node("Where", ["ge", "a1", "a0"], ["w"]),
        node("Sub", ["w", "k"], ["y"]),
    ]
    inits = {"sizes": np.array([2, 13, 1], np.int64), "halves": np.array([1, 1], np.int64), "k": np.array(1.75, np.float32)}
    m = model(nodes, [("x", ["batch", 1, 3, 16])], [("y", ["batch", 1, 3, 13]), ("c", ["batch", 1, 3, 1])], inits)
    out = fuse(m)
    onnx.checker.check_model(out, full_check=True)
    (pw,) = pointwise_nodes(out)
    assert "a" in pw.input and "x" not in pw.input
    check_equivalent(m, out, dims={"batch": 2})


def conv_elementwise_conv(op: str, binary: bool, group: int = 1, channels: int = 16):
    """Conv -> op (unary on the Conv, or binary on two Convs of one shape) -> Mul by the first
    Conv (so that the op cannot fold into the Conv) -> Conv."""
    W = lambda cin: RNG.standard_normal((channels, cin, 3, 3)).astype(np.float32)  # noqa: E731
    nodes = [node("Conv", ["x", "W1"], ["c1"], pads=[1, 1, 1, 1], group=group)]
    inits = {"W1": W(channels // group), "W2": W(channels)}
    if binary:
        nodes.append(node("Conv", ["x", "W3"], ["c3"], pads=[1, 1, 1, 1]))
        inits["W3"] = W(channels)
    nodes.append(node(op, ["c1", "c3"] if binary else ["c1"], ["a"]))
    nodes += [node("Mul", ["a", "c1"], ["m"]), node("Conv", ["m", "W2"], ["y"], pads=[1, 1, 1, 1])]
    return model(nodes, [("x", [1, channels, 10, 10])], [("y", [1, channels, 10, 10])], inits)


NCHWC_CASES = [("HardSigmoid", False), ("Sigmoid", False), ("Tanh", False), ("Relu", False),
               ("Add", True), ("Mul", True), ("Sum", True)]


@pytest.mark.parametrize("op, binary", NCHWC_CASES)
def test_nchwc_elementwise_ops_run_in_place_in_onnxruntime(op, binary):
    """The measurement behind the nchwc-elementwise rule: between NCHWc convolutions,
    onnxruntime runs these ops on the blocked tensors with no reorder around them (one
    ReorderInput for the graph input, one ReorderOutput for the graph output)."""
    kernels = ort_kernels(conv_elementwise_conv(op, binary))
    assert kernels.count("ReorderInput") + kernels.count("ReorderOutput") == 2, kernels


@pytest.mark.parametrize("op, binary", NCHWC_CASES)
def test_cpu_policy_leaves_nchwc_elementwise_ops_to_onnxruntime(op, binary):
    m = conv_elementwise_conv(op, binary)
    out = fuse(m, "cpu")
    assert "Pointwise" not in ops(out)
    assert len(ort_kernels(out)) == len(ort_kernels(m))
    check_equivalent(m, out)


@pytest.mark.parametrize("op, binary", [("LeakyRelu", False), ("Sub", True)])
def test_ops_onnxruntime_reorders_around_are_still_fused_between_convolutions(op, binary):
    """LeakyRelu and Sub leave the NCHWc layout in onnxruntime (reorders around them), so the
    region with the Mul after them is fused, and saves kernels."""
    m = conv_elementwise_conv(op, binary)
    assert ort_kernels(m).count("ReorderOutput") > 1
    out = fuse(m, "cpu")
    assert ops(out).count("Pointwise") == 1
    assert len(ort_kernels(out, with_library=True)) < len(ort_kernels(m))
    check_equivalent(m, out)


def test_grouped_convolution_is_not_taken_as_nchwc():
    """A grouped (not depthwise) convolution stays NCHW in onnxruntime: its activation and the
    Mul after it are one region."""
    m = conv_elementwise_conv("HardSigmoid", False, group=2)
    out = fuse(m, "cpu")
    assert ops(out).count("Pointwise") == 1
    check_equivalent(m, out)


def residual_layernorm(written_out: bool):
    """Add(x, r) -> LayerNormalization over the last axis, as one op or written out."""
    if not written_out:
        nodes = [node("Add", ["x", "r"], ["s"]), node("LayerNormalization", ["s", "g", "be"], ["y"], axis=-1)]
        inits = {"g": GAMMA, "be": BETA}
    else:
        nodes = [
            node("Add", ["x", "r"], ["s"]), node("ReduceMean", ["s"], ["mu"], axes=[-1]), node("Sub", ["s", "mu"], ["d"]),
            node("Pow", ["d", "two"], ["p"]), node("ReduceMean", ["p"], ["v"], axes=[-1]), node("Add", ["v", "eps"], ["ve"]),
            node("Sqrt", ["ve"], ["sd"]), node("Div", ["d", "sd"], ["n"]), node("Mul", ["n", "g"], ["ng"]),
            node("Add", ["ng", "be"], ["y"]),
        ]
        inits = {"two": SCAL(2.0), "eps": SCAL(1e-5), "g": GAMMA, "be": BETA}
    return model(nodes, [("x", [2, 4, 16]), ("r", [2, 4, 16])], [("y", [2, 4, 16])], inits, opset=17)


def with_side_chain(m: onnx.ModelProto) -> onnx.ModelProto:
    """`m` plus an unrelated three-op chain q = tanh(-|x|), a region saving 2 kernels."""
    g = m.graph
    g.node.extend([node("Abs", ["x"], ["q0"]), node("Neg", ["q0"], ["q1"]), node("Tanh", ["q1"], ["q"])])
    g.output.append(helper.make_tensor_value_info("q", F, [2, 4, 16]))
    return onnx.shape_inference.infer_shapes(m)


@pytest.mark.parametrize("written_out", [False, True])
def test_cpu_takes_a_lone_residual_add_from_onnxruntimes_skip_layernorm(written_out):
    """onnxruntime's CPU SkipLayerNormalization is slower than a Pointwise region plus its
    LayerNormalization (bench/results/skip_layernorm.md), so on the CPU even the residual Add
    alone becomes a region, which keeps onnxruntime from making that fusion, where another
    region saves the kernel that costs."""
    m = with_side_chain(residual_layernorm(written_out))
    assert "SkipLayerNormalization" in ort_kernels(m)
    out = fuse(m, "cpu")
    assert ops(out).count("Pointwise") == 2
    kernels = ort_kernels(out, with_library=True)
    assert sorted(kernels) == ["LayerNormalization", "Pointwise", "Pointwise"], kernels
    check_equivalent(m, out)


@pytest.mark.parametrize("written_out", [False, True])
def test_cpu_leaves_a_lone_residual_add_when_nothing_pays_its_kernel(written_out):
    """Alone, the residual Add's region plus LayerNormalization are two kernels where
    onnxruntime runs one SkipLayerNormalization: a model never gets more kernels than
    onnxruntime alone (a GPT-2 block exported by TorchScript went from 64 to 65)."""
    m = residual_layernorm(written_out)
    out = fuse(m, "cpu")
    assert "Pointwise" not in ops(out)
    assert len(ort_kernels(out, with_library=True)) <= len(ort_kernels(m))


def test_cuda_leaves_the_residual_add_to_skip_layernorm():
    out = fuse(residual_layernorm(False), "cuda")
    assert "Pointwise" not in ops(out)
