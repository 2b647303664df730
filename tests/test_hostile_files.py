"""Hostile files through `onnxfuse optimize`: huge or negative dims, odd names, names defined
twice, initializers whose data does not fit their shape. Each is one clear line on stderr and
exit status 2 (or, for legal oddities such as odd names, a verified success): never a
traceback, an internal error or a hang."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper, numpy_helper

from conftest import SENTINEL, stderr_lines

vi = helper.make_tensor_value_info


def _model(nodes, inputs, inits=(), outputs=("y",)):
    graph = helper.make_graph(nodes, "hostile", inputs, [vi(o, T.FLOAT, None) for o in outputs], list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def _chain(x="x"):
    return [helper.make_node("Relu", [x], ["r"]), helper.make_node("Sigmoid", ["r"], ["y"])]


def _add_w(w: onnx.TensorProto):
    return _model([helper.make_node("Add", ["x", "w"], ["r"]), helper.make_node("Sigmoid", ["r"], ["y"])],
                  [vi("x", T.FLOAT, [2, 3])], [w])


def _raw(name, dims, data: bytes):
    t = onnx.TensorProto(name=name, data_type=T.FLOAT, dims=dims)
    t.raw_data = data
    return t


HOSTILE = {
    "huge input dims": (_model(_chain(), [vi("x", T.FLOAT, [2**40, 2**40])]), "too large to feed random data"),
    "negative input dim": (_model(_chain(), [vi("x", T.FLOAT, [-3, 4])]), "negative dimension"),
    "output defined twice": (
        _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Sigmoid", ["x"], ["r"]),
                helper.make_node("Tanh", ["r"], ["y"])], [vi("x", T.FLOAT, [2, 3])]),
        "'r' is defined twice"),
    "duplicate node names": (
        _model([helper.make_node("Relu", ["x"], ["r"], name="same"), helper.make_node("Sigmoid", ["r"], ["y"], name="same")],
               [vi("x", T.FLOAT, [2, 3])]),
        "same node name"),
    "duplicate initializers": (
        _model([helper.make_node("Add", ["x", "w"], ["r"]), helper.make_node("Sigmoid", ["r"], ["y"])],
               [vi("x", T.FLOAT, [2, 3])],
               [numpy_helper.from_array(np.ones(3, np.float32), "w"), numpy_helper.from_array(np.zeros(3, np.float32), "w")]),
        "'w' is defined twice"),
    "duplicate graph inputs": (
        _model([helper.make_node("Add", ["x", "x"], ["r"]), helper.make_node("Sigmoid", ["r"], ["y"])],
               [vi("x", T.FLOAT, [2, 3]), vi("x", T.FLOAT, [2, 3])]),
        "'x' is defined twice"),
    "initializer raw data shorter than its shape": (_add_w(_raw("w", [3], b"\0" * 5)), "holds 5 bytes"),
    "initializer with huge dims and little data": (_add_w(_raw("w", [2**31, 2**31], b"\0" * 8)), "holds 8 bytes"),
    "initializer float_data shorter than its shape": (
        _add_w(onnx.TensorProto(name="w", data_type=T.FLOAT, dims=[3], float_data=[1.0])), "holds 1 values"),
    "initializer with a negative dim": (_add_w(_raw("w", [-3], b"\0" * 12)), "negative dimension"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_is_one_line_and_exit_2(case, tmp_path, cli, sentinel_out):
    model, message = HOSTILE[case]
    path = tmp_path / "hostile.onnx"
    onnx.save(model, str(path))
    result = cli("optimize", path, sentinel_out)
    lines = stderr_lines(result)
    assert result.exit_code == 2, (result.exit_code, lines)
    assert len(lines) == 1 and lines[0].startswith("onnxfuse: error: ") and str(path) in lines[0], lines
    assert message in lines[0], lines
    assert sentinel_out.read_bytes() == SENTINEL


def test_odd_names_are_optimized_and_verified(tmp_path, cli):
    """Tensor and node names are arbitrary strings: spaces, slashes, colons, newlines, tabs,
    non-ASCII and emoji survive optimization."""
    x, r, y = "x y/ü:\n", "r\t%;\"'", "y😀"
    model = _model([helper.make_node("Relu", [x], [r], name="n 1"), helper.make_node("Sigmoid", [r], [y], name="n/2"),
                    helper.make_node("Tanh", [y], ["z"], name="n:3")], [vi(x, T.FLOAT, [2, 3])], outputs=(y, "z"))
    path, out = tmp_path / "odd.onnx", tmp_path / "odd.opt.onnx"
    onnx.save(model, str(path))
    result = cli("optimize", path, out)
    assert result.exit_code == 0, stderr_lines(result)
    opt = onnx.load(str(out))
    assert [o.name for o in opt.graph.output] == [y, "z"] and opt.graph.input[0].name == x
    assert any(n.domain == "onnxfuse" for n in opt.graph.node)


def test_huge_dims_fail_fast_in_a_fresh_process(tmp_path):
    """No allocation of the declared size is attempted: the console script exits 2 quickly."""
    model, _ = HOSTILE["huge input dims"]
    path = tmp_path / "huge.onnx"
    onnx.save(model, str(path))
    proc = subprocess.run([sys.executable, "-m", "onnxfuse.cli", "optimize", str(path), str(tmp_path / "o.onnx")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
