"""The expression program's text form and its reference semantics."""
import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.program import Program, SliceSpec, apply_view, resolve_slice


def test_text_form_round_trips():
    p = Program()
    a = p.add_input("f32", [SliceSpec(1, 0, 4, 1), SliceSpec(0, -1, -100, -2)])
    b = p.add_input("f16")
    t = p.emit("add", a, b)
    u = p.emit("leakyrelu", t, params=[0.01])
    c = p.emit("cast", u, params=["f16"])
    w = p.emit("clip", p.emit("mul", c, 1.5), params=[float("-inf"), 6])
    p.add_output(w, "f32")
    p.add_output(t, "bool")
    text = p.to_text()
    assert Program.parse(text).to_text() == text


@pytest.mark.parametrize(
    "text, message",
    [
        ("in x0 f32\nt0 = frobnicate x0\nout t0 f32\n", "unknown op"),
        ("in x0 f32\nt0 = add x0\nout t0 f32\n", "takes 2 args"),
        ("in x0 f32\nt0 = add x0 t5\nout t0 f32\n", "undefined value"),
        ("in x0 i32\n", "unknown dtype"),
        ("in x1 f32\n", "out of order"),
    ],
)
def test_malformed_program_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match=message):
        Program.parse(text)


def _onnx_slice(dim, start, end, step):
    x = np.arange(dim, dtype=np.float32)
    inits = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in
             (("s", start), ("e", end), ("a", 0), ("p", step))]
    g = helper.make_graph([helper.make_node("Slice", ["x", "s", "e", "a", "p"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [dim])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    import onnxruntime as ort

    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_views_follow_onnx_slice_semantics_including_clamping_and_negative_steps():
    big = 2**62
    for dim, start, end, step in itertools.product(
        [0, 1, 5], [-10, -3, -1, 0, 2, 7, big, -big], [-10, -2, 0, 3, 9, big, -big], [1, 2, -1, -3]
    ):
        want = _onnx_slice(dim, start, end, step)
        got = apply_view(np.arange(dim, dtype=np.float32), [SliceSpec(0, start, end, step)])
        assert got.tolist() == want.tolist(), (dim, start, end, step)
        assert resolve_slice(dim, SliceSpec(0, start, end, step))[2] == len(want)


def test_outputs_take_the_iteration_shape():
    p = Program()
    a = p.add_input("f32")
    b = p.add_input("f32")
    p.add_output(p.emit("neg", a), "f32")
    p.add_output(p.emit("add", a, b), "f32")
    outs = p.evaluate(np.ones(3, np.float32), np.ones((2, 3), np.float32))
    assert [o.shape for o in outs] == [(2, 3), (2, 3)]
