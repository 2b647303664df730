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

from conftest import SENTINEL, pointwise_chain_model, stderr_lines, temporaries, wait_for_the_write

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


# --------------------------------------------------------------------------- text from the model on a terminal

# A symbolic dimension and an input name that try to set the terminal's title, clear the screen,
# reverse the text and print a line of their own.
FORGED = "b\x1b]0;owned\x07\x1b[2J\u202e\nonnxfuse: error: forged"


def _forging_model() -> onnx.ModelProto:
    model = pointwise_chain_model()
    model.graph.input[0].name = "x" + FORGED
    model.graph.node[0].input[0] = "x" + FORGED
    model.graph.node[1].name = "relu" + FORGED
    for v in (model.graph.input[0], model.graph.output[0]):
        v.type.tensor_type.shape.dim[0].dim_param = FORGED
    return model


def _assert_inert(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, repr(text)
    assert not any(line.startswith("onnxfuse: error: forged") for line in text.splitlines()), text


def test_terminal_text_shows_controls_escapes_and_line_breaks_escaped():
    from onnxfuse.display import terminal_text

    assert terminal_text(FORGED) == "b\\x1b]0;owned\\x07\\x1b[2J\\u202e\\nonnxfuse: error: forged"
    assert terminal_text("plain name: x.1/ü") == "plain name: x.1/ü"
    assert terminal_text("a\rb\tc\u2028d\x9be") == "a\\rb\\tc\\u2028d\\x9be"


def test_names_from_the_model_cannot_drive_the_terminal_in_the_summary(cli, tmp_path):
    src = tmp_path / "forged.onnx"
    onnx.save(_forging_model(), str(src))
    result = cli("optimize", src, tmp_path / "out.onnx", "--explain", "pointwise")
    assert result.exit_code == 0, result.output
    assert "\\x1b]0;owned" in result.stdout  # the dimension's name is shown, escaped
    _assert_inert(result.stdout + result.stderr)
    profile = cli("profile", src, "--runs", 1)
    assert profile.exit_code == 0, profile.output
    assert "\\x1b]0;owned" in profile.stdout
    _assert_inert(profile.stdout + profile.stderr)


def test_names_from_the_model_cannot_forge_an_error_line(cli, tmp_path, sentinel_out):
    model = pointwise_chain_model()
    model.graph.node[2].input[0] = "ghost" + FORGED  # read, but produced by nothing
    src = tmp_path / "forged.onnx"
    onnx.save(model, str(src))
    result = cli("optimize", src, sentinel_out)
    assert result.exit_code == 2
    (line,) = stderr_lines(result)
    assert line.startswith("onnxfuse: error: ") and "reads 'ghost" in line and "\\nonnxfuse: error: forged" in line
    _assert_inert(result.stderr)
    # JSON keeps the names as they are (its own escaping makes them safe).
    ok = tmp_path / "ok.onnx"
    onnx.save(_forging_model(), str(ok))
    result = cli("optimize", ok, tmp_path / "out.onnx", "--json")
    import json

    assert FORGED in json.loads(result.stdout)["verification"]["dims"]


def test_op_table_cells_are_not_markup(capsys):
    from onnxfuse.display import print_op_table

    print_op_table({"op_types_before": {"[/bold]x\x1b[2J": 1}, "op_types_after": {}, "bytes_before": 1,
                    "bytes_after": 1})
    out = capsys.readouterr().out
    assert "[/bold]x\\x1b[2J" in out
    _assert_inert(out)


# --------------------------------------------------------------------------- the custom-op library


@pytest.mark.parametrize("keep", [0.3, 0.9, 40])
def test_a_truncated_library_is_one_line_and_exit_3_not_a_crash(chain_path, tmp_path, keep):
    from onnxfuse import runtime

    library = runtime.library_path()
    data = open(library, "rb").read()
    damaged = tmp_path / "_onnxfuse_ops.so"
    damaged.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
    env = dict(os.environ, ONNXFUSE_LIBRARY=str(damaged))
    result = _run("optimize", chain_path, tmp_path / "out.onnx", env=env)
    assert result.returncode == 3, (result.returncode, result.stderr)
    (line,) = _lines(result.stderr)
    assert line.startswith(f"onnxfuse: error: cannot load {damaged}: the custom-op library is damaged or truncated")
    assert "pip install -e" in line and not (tmp_path / "out.onnx").exists()
    info = _run("info", env=env)
    assert info.returncode == 0 and "damaged or truncated" in info.stdout


# --------------------------------------------------------------------------- external data and links


def _external_model(directory, location, offset="0", length="32", name="m.onnx"):
    model = pointwise_chain_model()
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    del w.float_data[:]
    w.data_location = T.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        if value is not None:
            w.external_data.add(key=key, value=value)
    path = directory / name
    path.write_bytes(model.SerializeToString())
    return path


def test_a_link_out_of_the_model_directory_reveals_nothing_about_its_target(cli, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 1221)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "weights.bin").symlink_to(secret)
    (model_dir / "missing.bin").symlink_to(tmp_path / "no-such-file")
    said = []
    for link in ("weights.bin", "missing.bin"):
        result = cli("optimize", _external_model(model_dir, link), tmp_path / "out.onnx")
        assert result.exit_code == 2
        (line,) = stderr_lines(result)
        assert "outside the model's directory" in line and "1221" not in line and "bytes" not in line
        said.append(line.replace(link, "LINK"))
    assert said[0] == said[1]  # the same words whether the target exists or not


@pytest.mark.parametrize("offset,length,message", [
    ("-4", "32", "external data offset -4 is negative"),
    ("abc", "32", "external data offset 'abc' is not a number of bytes"),
    ("0", "-32", "external data length -32 is negative"),
    ("0", "1e3", "external data length '1e3' is not a number of bytes"),
    ("0", " 32", "external data length ' 32' is not a number of bytes"),
])
def test_a_malformed_external_data_offset_or_length_is_bad_input(cli, tmp_path, sentinel_out, offset, length, message):
    (tmp_path / "w.bin").write_bytes(b"\0" * 64)
    result = cli("optimize", _external_model(tmp_path, "w.bin", offset, length), sentinel_out)
    assert result.exit_code == 2, result.output
    (line,) = stderr_lines(result)
    assert line.startswith("onnxfuse: error: ") and message in line
    assert sentinel_out.read_bytes() == SENTINEL


# --------------------------------------------------------------------------- text that is not UTF-8, huge constants


def _with_bytes(model: onnx.ModelProto, marker: str, raw: bytes) -> bytes:
    data = model.SerializeToString()
    assert len(marker.encode()) == len(raw) and data.count(marker.encode()) >= 1
    return data.replace(marker.encode(), raw)


def _non_utf8(where):
    model = pointwise_chain_model()
    if where == "node name":
        model.graph.node[1].name = "MARKER"
    elif where == "node doc string":
        model.graph.node[0].doc_string = "MARKER"
    elif where == "model doc string":
        model.doc_string = "MARKER"
    elif where == "dim name":
        for v in (model.graph.input[0], model.graph.output[0]):
            v.type.tensor_type.shape.dim[0].dim_param = "MARKER"
    return _with_bytes(model, "MARKER", b"MA\xff\xfeER")


@pytest.mark.parametrize("where,field", [("node name", "model.graph.node[1].name"),
                                         ("node doc string", "model.graph.node[0].doc_string"),
                                         ("model doc string", "model.doc_string"),
                                         ("dim name", "model.graph.input[0].type.tensor_type.shape.dim[0].dim_param")])
def test_text_that_is_not_utf8_is_bad_input(cli, tmp_path, sentinel_out, where, field):
    src = tmp_path / "bytes.onnx"
    src.write_bytes(_non_utf8(where))
    result = cli("optimize", src, sentinel_out)
    assert result.exit_code == 2, result.output
    assert stderr_lines(result) == [f"onnxfuse: error: {src}: {field} is not UTF-8 text (ONNX strings are UTF-8)"]
    assert sentinel_out.read_bytes() == SENTINEL


def test_a_constant_node_that_claims_a_huge_shape_is_bad_input(cli, tmp_path, sentinel_out):
    model = pointwise_chain_model()
    value = onnx.TensorProto(name="c", data_type=T.FLOAT, dims=[2**20, 2**20], raw_data=b"\0" * 8)
    model.graph.node.insert(0, helper.make_node("Constant", [], ["c"], name="huge", value=value))
    model.graph.node[1].input[1] = "c"
    del model.graph.initializer[:]
    src = tmp_path / "const.onnx"
    onnx.save(model, str(src))
    result = cli("optimize", src, sentinel_out)
    assert result.exit_code == 2, result.output
    (line,) = stderr_lines(result)
    assert "Constant node 'huge' (Constant): its value holds 8 bytes of data but its shape" in line


# --------------------------------------------------------------------------- inputs that are not files


def _limited_memory():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.RLIM_INFINITY))


def test_a_device_as_input_is_refused_before_it_is_read(tmp_path, sentinel_out):
    # In a process of its own with a memory limit: reading /dev/zero never ends.
    result = subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", "/dev/zero", str(sentinel_out)],
                            capture_output=True, text=True, timeout=120, preexec_fn=_limited_memory)
    assert result.returncode == 2
    assert _lines(result.stderr) == ["onnxfuse: error: /dev/zero: not a regular file (a device), not a model file"]


def test_a_fifo_as_input_is_refused_without_waiting_for_a_writer(tmp_path, sentinel_out):
    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo)
    result = _run("optimize", fifo, sentinel_out, timeout=60)  # a hang fails here, by the timeout
    assert result.returncode == 2
    assert _lines(result.stderr) == [f"onnxfuse: error: {fifo}: not a regular file (a FIFO), not a model file"]
    assert sentinel_out.read_bytes() == SENTINEL


# --------------------------------------------------------------------------- model functions in onnxfuse's domain


@pytest.mark.parametrize("name", ["Pointwise", "MyNeg"])
def test_a_model_function_in_onnxfuse_domain_is_refused_not_shadowed(cli, tmp_path, sentinel_out, name):
    fn = helper.make_function("onnxfuse", name, ["a"], ["b"], [helper.make_node("Neg", ["a"], ["b"])],
                              [helper.make_opsetid("", 17)])
    graph = helper.make_graph([helper.make_node(name, ["x"], ["t"], domain="onnxfuse"),
                               helper.make_node("Relu", ["t"], ["y"])], "g", [vi("x", T.FLOAT, [2, 8])],
                              [vi("y", T.FLOAT, [2, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onnxfuse", 1)],
                              functions=[fn])
    model.ir_version = 10
    src = tmp_path / "fn.onnx"
    onnx.save(model, str(src))
    result = cli("optimize", src, sentinel_out)
    assert result.exit_code == 2, result.output
    (line,) = stderr_lines(result)
    assert f"the model's function '{name}' is in the domain 'onnxfuse', which is reserved" in line
    # onnxfuse's own fallback functions are not refused: an optimized model optimizes again.
    once, twice = tmp_path / "once.onnx", tmp_path / "twice.onnx"
    onnx.save(pointwise_chain_model(), str(src))
    assert cli("optimize", src, once).exit_code == 0
    assert any(f.domain == "onnxfuse" for f in onnx.load(str(once)).functions)
    assert cli("optimize", once, twice).exit_code == 0


# --------------------------------------------------------------------------- out of memory, crashes, SIGHUP

# `onnxfuse optimize` as the command runs (supervised: the work in a child process), stopped
# inside the write of OUT (its bytes are being synced); there it waits for a signal (ACTION
# "wait") or dies by one of its own (ACTION a signal name), optionally under an address-space
# limit (LIMIT bytes, 0: none).
_STOP_IN_WRITE = textwrap.dedent("""
    import os, resource, signal, sys, time
    from pathlib import Path
    from onnxfuse import modelsave
    from onnxfuse.cli import main
    ready, action, limit = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    def stop(fd):
        ready.write_text(str(os.getpid()))
        if action == "wait":
            time.sleep(60)
        else:
            os.kill(os.getpid(), getattr(signal, action))
    modelsave.os.fsync = stop
    sys.argv = ["onnxfuse"] + sys.argv[4:]
    main()
""")


def _default_sighup() -> None:
    # The run as a terminal session starts it: a test runner started under nohup (or by a CI agent
    # that ignores SIGHUP) passes SIG_IGN on, and onnxfuse rightly keeps an ignored SIGHUP ignored.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _stopped_in_write(chain_path, out, ready, action, limit=0):
    return subprocess.Popen([sys.executable, "-c", _STOP_IN_WRITE, str(ready), action, str(limit), "optimize",
                             str(chain_path), str(out), "--no-verify"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sighup)



def test_sighup_removes_the_temporary_files_and_exits_129(chain_path, tmp_path, sentinel_out):
    ready = tmp_path / "ready"
    proc = _stopped_in_write(chain_path, sentinel_out, ready, "wait")
    wait_for_the_write(proc, ready, tmp_path)
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 129, (out, err)
    assert _lines(err) == ["onnxfuse: hung up"]
    assert temporaries(tmp_path) == [] and sentinel_out.read_bytes() == SENTINEL


@pytest.mark.parametrize("action,limit,code,words", [
    ("SIGSEGV", 64 << 30, 2, "onnxfuse: error: out of memory: the run crashed (segmentation fault) with an"
                             " address-space limit of 65536 MiB (ulimit -v)"),
    ("SIGSEGV", 0, 3, "onnxfuse: internal error: the run crashed (segmentation fault)"),
    ("SIGBUS", 0, 3, "onnxfuse: internal error: the run crashed (bus error)"),
    ("SIGKILL", 0, 137, "onnxfuse: error: killed (SIGKILL): the kernel's out-of-memory killer"),
])
def test_a_run_that_dies_of_a_signal_ends_in_one_line_and_leaves_no_temporary_file(chain_path, tmp_path,
                                                                                   sentinel_out, action, limit,
                                                                                   code, words):
    """protobuf dereferences a failed allocation when an address-space limit runs out (SIGSEGV),
    the out-of-memory killer sends SIGKILL: neither can be caught inside the process."""
    proc = _stopped_in_write(chain_path, sentinel_out, tmp_path / "ready", action, limit)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, (out, err)
    (line,) = _lines(err)
    assert line.startswith(words), line
    assert temporaries(tmp_path) == [] and sentinel_out.read_bytes() == SENTINEL


def test_running_out_of_memory_is_one_line_and_exit_2(cli, chain_path, sentinel_out, monkeypatch):
    from onnxfuse import api

    def exhausted(*args, **kwargs):
        raise MemoryError("Unable to allocate 192. MiB for an array with shape (4096, 12288) and data type float32")

    monkeypatch.setattr(api, "optimize", exhausted)
    result = cli("optimize", chain_path, sentinel_out)
    assert result.exit_code == 2
    (line,) = stderr_lines(result)
    assert line.startswith("onnxfuse: error: out of memory") and "internal error" not in line and "debug" not in line
    assert sentinel_out.read_bytes() == SENTINEL
