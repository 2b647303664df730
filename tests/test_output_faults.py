"""Environment faults of `onnxfuse optimize`: where OUT and --report go, write errors, signals,
what messages reveal, and the model-level fields the output keeps."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import onnx
import pytest
from onnx import helper

from conftest import SENTINEL, pointwise_chain_model, stderr_lines, temporaries, wait_for_the_write



@pytest.mark.parametrize("where,message", [
    ("/proc/onnxfuse-out.onnx", "/proc is a kernel pseudo filesystem"),
    ("/sys/kernel/onnxfuse-out.onnx", "/sys is a kernel pseudo filesystem"),
    ("{tmp}/no/such/dir/out.onnx", "does not exist"),
    ("{tmp}/" + "n" * 300 + ".onnx", "the file name is 305 bytes long"),
    ("{tmp}", "is a directory"),
])
def test_unwritable_out_exits_2_with_one_line_before_any_work(cli, chain_path, tmp_path, monkeypatch, where, message):
    from onnxfuse import api

    def no_work(*a, **k):
        raise AssertionError("optimize ran before OUT was checked")

    monkeypatch.setattr(api, "optimize", no_work)
    dest = where.format(tmp=tmp_path)
    result = cli("optimize", chain_path, dest)
    assert result.exit_code == 2, result.output
    lines = stderr_lines(result)
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("onnxfuse: error:"), lines


def test_out_in_a_read_only_directory_exits_2_before_any_work(cli, chain_path, tmp_path, monkeypatch):
    # Permission bits do not stop root: the check creates a probe file, which a read-only mount
    # refuses. The refusal is simulated where the probe is made.
    from onnxfuse import api, outfiles

    monkeypatch.setattr(api, "optimize", lambda *a, **k: pytest.fail("optimize ran"))

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(outfiles.tempfile, "mkstemp", read_only)
    result = cli("optimize", chain_path, tmp_path / "out.onnx")
    assert result.exit_code == 2
    assert stderr_lines(result) == [f"onnxfuse: error: {tmp_path / 'out.onnx'}: cannot write output: read-only file system"]


def test_unwritable_report_path_exits_2_before_any_work(cli, chain_path, tmp_path, monkeypatch):
    from onnxfuse import api

    monkeypatch.setattr(api, "optimize", lambda *a, **k: pytest.fail("optimize ran"))
    result = cli("optimize", chain_path, tmp_path / "out.onnx", "--report", tmp_path / "missing" / "r.json")
    assert result.exit_code == 2
    assert "cannot write report" in stderr_lines(result)[0]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failed_write_exits_2_naming_the_path_and_leaves_out_untouched(cli, chain_path, tmp_path, sentinel_out,
                                                                         monkeypatch, code):
    from onnxfuse import modelsave

    def failing_fsync(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(modelsave.os, "fsync", failing_fsync)
    result = cli("optimize", chain_path, sentinel_out)
    assert result.exit_code == 2, result.output
    (line,) = stderr_lines(result)
    assert line.startswith(f"onnxfuse: error: {sentinel_out}: cannot write output: ")
    assert ("no space left on device" if code == errno.ENOSPC else "input/output error") in line
    assert sentinel_out.read_bytes() == SENTINEL
    assert temporaries(tmp_path) == []


def test_report_is_written_before_out_so_its_failure_leaves_out_untouched(cli, chain_path, tmp_path, sentinel_out,
                                                                          monkeypatch):
    from onnxfuse import modelsave

    report = tmp_path / "report.json"
    real_replace = os.replace

    def replace(src, dst):
        if str(dst) == str(report):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst)

    monkeypatch.setattr(modelsave.os, "replace", replace)
    result = cli("optimize", chain_path, sentinel_out, "--report", report)
    assert result.exit_code == 2
    assert stderr_lines(result) == [f"onnxfuse: error: {report}: cannot write report: no space left on device"]
    assert sentinel_out.read_bytes() == SENTINEL
    assert not report.exists()
    assert temporaries(tmp_path) == []


def test_report_and_out_are_both_written_on_success(cli, chain_path, tmp_path):
    import json

    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    result = cli("optimize", chain_path, out, "--report", report)
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["summary"]["files_written"] == [str(out)]
    onnx.checker.check_model(onnx.load(str(out)))


# A run that stops inside the write of OUT (its bytes are being synced) until a signal comes.
_SLOW_WRITE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from onnxfuse import modelsave
    from onnxfuse.cli import main
    ready = Path(sys.argv[1])
    def slow_fsync(fd):
        ready.write_text("writing")
        time.sleep(60)
    modelsave.os.fsync = slow_fsync
    sys.argv = ["onnxfuse"] + sys.argv[2:]
    main()
""")


@pytest.mark.parametrize("signum,code,word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_signal_during_the_write_removes_the_temporary_files(chain_path, tmp_path, sentinel_out, signum, code, word):
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITE, str(ready), "optimize", str(chain_path),
                             str(sentinel_out), "--no-verify"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for_the_write(proc, ready, tmp_path)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (out, err)
    assert [line for line in err.splitlines() if line.strip()] == [f"onnxfuse: {word}"]
    assert temporaries(tmp_path) == []
    assert sentinel_out.read_bytes() == SENTINEL


# A run that stops at a point of `optimize` (a new weight just spilled to the scratch file, or a
# model file just written for onnxruntime to verify) until a signal comes.
_PAUSE_AT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from onnxfuse import ortfiles, weights
    from onnxfuse.cli import main
    ready, point = Path(sys.argv[1]), sys.argv[2]
    cls, name = {"spill": (weights._Scratch, "write"), "verify": (ortfiles.RuntimeFiles, "write")}[point]
    original = getattr(cls, name)
    def paused(*args, **kwargs):
        result = original(*args, **kwargs)
        ready.write_text(point)
        time.sleep(60)
        return result
    setattr(cls, name, paused)
    sys.argv = ["onnxfuse"] + sys.argv[3:]
    main()
""")


def _left_in(directory) -> list[str]:
    # onnxruntime keeps a session id file, .ses, in TMPDIR across runs: not a temporary of the run
    return sorted(p.name for p in directory.iterdir() if p.name != ".ses")


@pytest.mark.parametrize("point", ["spill", "verify"])
@pytest.mark.parametrize("signum,code,word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_signal_during_optimize_removes_every_temporary_file(tmp_path, point, signum, code, word):
    """The new weights' scratch file and the model files made for onnxruntime (in TMPDIR) go too,
    not only OUT's temporary file."""
    from onnxfuse.models import llama_large

    model_dir, scratch = tmp_path / "model", tmp_path / "scratch"
    model_dir.mkdir()
    scratch.mkdir()
    model = model_dir / "llama.onnx"
    llama_large.build(model, **llama_large.PRESETS["tiny"])
    before = sorted(p.name for p in model_dir.iterdir())
    ready = tmp_path / "ready"
    env = dict(os.environ, TMPDIR=str(scratch))
    proc = subprocess.Popen([sys.executable, "-c", _PAUSE_AT, str(ready), point, "optimize", str(model),
                             str(model_dir / "out.onnx")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    deadline = time.time() + 300
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"the run never reached the {point}"
        time.sleep(0.05)
    assert _left_in(scratch), "the run had no temporary file to remove"
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (out, err)
    assert [line for line in err.splitlines() if line.strip()] == [f"onnxfuse: {word}"]
    assert _left_in(scratch) == []
    assert sorted(p.name for p in model_dir.iterdir()) == before


def test_external_data_outside_the_model_directory_is_refused_without_a_word_about_it(cli, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 1234)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    model = pointwise_chain_model()
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    del w.float_data[:]
    w.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "../secret.bin"), ("offset", "0"), ("length", "100000")):
        w.external_data.add(key=key, value=value)
    path = model_dir / "m.onnx"
    path.write_bytes(model.SerializeToString())
    result = cli("optimize", path, tmp_path / "out.onnx")
    assert result.exit_code == 2
    (line,) = stderr_lines(result)
    assert "outside the model's directory" in line
    assert "1234" not in line and "bytes" not in line


def test_model_level_fields_are_kept(cli, tmp_path):
    model = pointwise_chain_model()
    model.domain = "org.example.models"
    model.doc_string = "model doc"
    model.model_version = 7
    model.producer_name, model.producer_version = "exporter", "1.2"
    helper.set_model_props(model, {"license": "apache-2.0", "author": "someone"})
    model.graph.doc_string = "graph doc"
    model.graph.input[0].doc_string = "pixels"
    model.graph.output[0].doc_string = "scores"
    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, str(src))
    result = cli("optimize", src, out)
    assert result.exit_code == 0, result.output
    saved = onnx.load(str(out))
    assert any(n.domain == "onnxfuse" for n in saved.graph.node), "nothing was fused: the test checks nothing"
    assert saved.domain == "org.example.models"
    assert (saved.doc_string, saved.model_version) == ("model doc", 7)
    assert (saved.producer_name, saved.producer_version) == ("exporter", "1.2")
    props = {p.key: p.value for p in saved.metadata_props}
    assert {k: props.get(k) for k in ("license", "author")} == {"license": "apache-2.0", "author": "someone"}
    assert saved.graph.doc_string == "graph doc"
    assert saved.graph.input[0].doc_string == "pixels"
    assert saved.graph.output[0].doc_string == "scores"


def test_a_signal_while_a_temporary_is_registered_waits_and_then_removes_it(tmp_path):
    """A signal handled between creating a temporary and registering it would leave it behind:
    it waits until the registration is done, then removes it and unwinds."""
    from onnxfuse import outfiles

    with pytest.raises(outfiles.Terminated):
        with outfiles._signals_wait():
            made = outfiles.tempfile.mkdtemp(prefix="onnxfuse-test-", dir=tmp_path)
            outfiles._on_signal(signal.SIGTERM, None)  # arrives here: nothing to remove yet
            assert os.path.isdir(made)
            outfiles._live_directories.add(made)
    assert not os.path.exists(made) and made not in outfiles.live_temporaries()
    scratch = outfiles.temporary_directory("onnxfuse-test-", tmp_path)
    assert scratch in outfiles.live_temporaries()
    outfiles.remove_directory(scratch)
    assert not os.path.exists(scratch) and scratch not in outfiles.live_temporaries()
