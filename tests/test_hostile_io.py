"""Hostile files and faults at the edges of a run: a model and its data file published as a pair,
names that try to drive the terminal, a damaged custom-op library, links out of the model's
directory, malformed external-data fields and undecodable text, inputs that are not files, out
of memory, SIGHUP, and model functions in onnxfuse's own domain. Each is one clear line and a
documented exit status, never a crash, a hang, a traceback or a mixed-up OUT."""
from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper, numpy_helper

from conftest import SENTINEL, pointwise_chain_model, stderr_lines

vi = helper.make_tensor_value_info


def _run(*args, env=None, timeout=300):
    """`onnxfuse ARGS` in a fresh process (a crash or a signal there cannot take pytest down)."""
    return subprocess.run([sys.executable, "-m", "onnxfuse", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --------------------------------------------------------------------------- OUT and its data file


def _weights_model(value: float) -> onnx.ModelProto:
    """y = x + w with w (4096 floats, all `value`) large enough to go to the data file."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "weights", [vi("x", T.FLOAT, [4096])], [vi("y", T.FLOAT, [4096])],
        [numpy_helper.from_array(np.full(4096, value, np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _saved_weight(path) -> float:
    """The weight the model file at `path` loads with its data file (every element equal)."""
    from onnxfuse.modelio import load_model

    (w,) = load_model(path).model.graph.initializer
    values = numpy_helper.to_array(w)
    assert (values == values[0]).all()
    return float(values[0])


# Saves _weights_model(VALUE) to OUT with a data file; with a STEP, the process kills itself
# (SIGKILL: nothing of ours runs after) at that step of publishing the pair.
_SAVE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[4])
    from test_hostile_io import _weights_model
    from onnxfuse.modelsave import save_model
    out, value, step = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    real = os.replace
    def replace(src, dst):
        dst = os.fspath(dst)
        if step == "before-out" and dst == out:
            os.kill(os.getpid(), signal.SIGKILL)
        real(src, dst)
        if step == "after-data" and dst.endswith(".data"):
            os.kill(os.getpid(), signal.SIGKILL)
        if step == "after-out" and dst == out:
            os.kill(os.getpid(), signal.SIGKILL)
    os.replace = replace
    save_model(_weights_model(value), out, external_threshold=1024)
""")


def _save_in_a_process(out, value, step="none"):
    return subprocess.run([sys.executable, "-c", _SAVE, str(out), str(value), step, os.path.dirname(__file__)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("step,loads", [("after-data", 1.0), ("before-out", 1.0), ("after-out", 2.0)])
def test_a_kill_while_publishing_out_and_its_data_never_pairs_a_model_with_other_weights(tmp_path, step, loads):
    out = tmp_path / "out.onnx"
    assert _save_in_a_process(out, 1.0).returncode == 0
    assert _saved_weight(out) == 1.0
    killed = _save_in_a_process(out, 2.0, step)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # Whatever step the second write died at, OUT loads with the weights written with it.
    assert _saved_weight(out) == loads


def test_a_new_write_replaces_the_pair_and_removes_the_old_data_file(tmp_path):
    from onnxfuse.modelsave import save_model
    from onnxfuse.weights import external_entries

    out = tmp_path / "out.onnx"
    first = save_model(_weights_model(1.0), out, external_threshold=1024)
    second = save_model(_weights_model(2.0), out, external_threshold=1024)
    assert first[0] == second[0] == str(out) and first[1] != second[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(os.path.basename(p) for p in second)
    (w,) = onnx.load(str(out), load_external_data=False).graph.initializer
    assert os.path.join(tmp_path, external_entries(w)["location"]) == second[1]
    assert _saved_weight(out) == 2.0
    # The same weights again: the same data file, kept.
    assert save_model(_weights_model(2.0), out, external_threshold=1024) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(os.path.basename(p) for p in second)
    # A model saved inline over it: the data file of the old one goes.
    save_model(_weights_model(3.0), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx"]
    assert _saved_weight(out) == 3.0


def test_a_data_file_that_the_old_out_does_not_name_is_left_alone(tmp_path):
    from onnxfuse.modelsave import save_model

    out = tmp_path / "out.onnx"
    other = tmp_path / "out.onnx.0123456789abcdef.data"
    other.write_bytes(b"not ours to remove")
    save_model(_weights_model(1.0), out, external_threshold=1024)
    save_model(_weights_model(2.0), out, external_threshold=1024)
    assert other.read_bytes() == b"not ours to remove"
