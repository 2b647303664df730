"""An exact Cast round trip of a graph input, read by a subgraph from the outer scope: onnxruntime
removes the pair without renaming the value inside the subgraph ("Missing Input"). A pass that
drops a no-op node before the first Cast (fuzz seed 9334658: a full-range Slice) must not leave
that form behind."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h

from onnxfuse.api import optimize
from passes.remove_identity import _holds_all


def _model(first: int, elem: int = T.FLOAT16, noop_slice: bool = True) -> onnx.ModelProto:
    nodes, inits, src = [], [h.make_tensor("n", T.INT64, [], [2])], "x"
    if noop_slice:
        inits += [h.make_tensor("s0", T.INT64, [1], [0]), h.make_tensor("s1", T.INT64, [1], [9]),
                  h.make_tensor("s2", T.INT64, [1], [0])]
        nodes.append(h.make_node("Slice", ["x", "s0", "s1", "s2"], ["p"]))
        src = "p"
    nodes += [h.make_node("Cast", [src], ["w"], to=first), h.make_node("Cast", ["w"], ["v"], to=elem)]
    body = h.make_graph(
        [h.make_node("Add", ["s", "v"], ["s_next"]), h.make_node("Identity", ["c"], ["c_next"])], "body",
        [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("c", T.BOOL, []),
         h.make_tensor_value_info("s", elem, [2])],
        [h.make_tensor_value_info("c_next", T.BOOL, []), h.make_tensor_value_info("s_next", elem, [2])])
    nodes.append(h.make_node("Loop", ["n", "", "v"], ["y"], body=body))
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", elem, [2])],
                         [h.make_tensor_value_info("y", elem, [2])], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=9)


def _run(model: onnx.ModelProto, elem=np.float16):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": np.array([1.5, -2.25], dtype=elem)})[0]


def test_onnxruntime_fails_on_the_pair_of_a_graph_input():
    # The form itself (no Slice before the pair): if onnxruntime ever runs it, the pass may go.
    try:
        _run(_model(T.DOUBLE, noop_slice=False))
    except Exception as e:  # noqa: BLE001 - onnxruntime's own error class
        assert "Missing Input" in str(e)
    else:
        raise AssertionError("onnxruntime now runs an outer-scope Cast round trip of a graph input")


def test_dropping_a_noop_slice_leaves_a_model_that_runs():
    for first, elem, np_elem in [(T.DOUBLE, T.FLOAT16, np.float16), (T.FLOAT, T.FLOAT16, np.float16),
                                 (T.DOUBLE, T.FLOAT, np.float32), (T.INT64, T.INT32, np.int32)]:
        model = _model(first, elem)
        expected = _run(model, np_elem)
        result = optimize(model)  # verification on: raised "cannot run the optimized model" before
        assert not [n for n in result.model.graph.node if n.op_type == "Slice"]
        np.testing.assert_array_equal(_run(result.model, np_elem), expected)


def test_a_lossy_round_trip_is_left():
    # float32 -> float16 -> float32 rounds: onnxruntime keeps it, and so does the pass.
    only = dict(passes=["cast-round-trip-outer-scope"], verify_outputs=False, count_kernels=False)
    lossy = optimize(_model(T.FLOAT16, T.FLOAT, noop_slice=False), **only)
    assert [n.op_type for n in lossy.model.graph.node].count("Cast") == 2
    exact = optimize(_model(T.DOUBLE, T.FLOAT16, noop_slice=False), **only)
    assert [n.op_type for n in exact.model.graph.node] == ["Loop"]


def test_exact_round_trips():
    d = np.dtype
    assert _holds_all(d("float16"), d("float64")) and _holds_all(d("int32"), d("int64"))
    assert _holds_all(d("bool"), d("int8")) and _holds_all(d("uint8"), d("int16"))
    assert _holds_all(d("int8"), d("float16")) and _holds_all(d("int32"), d("float64"))
    assert not _holds_all(d("float32"), d("float16")) and not _holds_all(d("int32"), d("float32"))
    assert not _holds_all(d("int8"), d("uint16")) and not _holds_all(d("float16"), d("int64"))
    assert not _holds_all(d("uint16"), d("float16")) and not _holds_all(d("int16"), d("int16"))
