"""Using an optimized model outside onnxfuse: the library found the onnxruntime-extensions way
(get_library_path), what the library says about its build, the op set a written model records
and the library's refusal of a newer one, `python -m onnxfuse`, `onnxfuse info`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxfuse
from onnxfuse.environment import library_info
from onnxfuse.fused import DOMAIN, DOMAIN_VERSION, METADATA_OPSET, METADATA_VERSION, OPSET_ATTRIBUTE
from onnxfuse.inputs import random_inputs
from small_models import with_fused_op_set


@pytest.fixture(scope="module")
def optimized_char_rnn():
    return onnxfuse.optimize("zoo:char_rnn", count_kernels=False, threads=1).model


def _session(model, with_library=True):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if with_library:
        so.register_custom_ops_library(onnxfuse.get_library_path())
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_get_library_path_names_the_built_library_onnxruntime_registers(optimized_char_rnn):
    path = onnxfuse.get_library_path()
    assert os.path.isfile(path) and os.path.basename(path).startswith("_onnxfuse_ops")
    feeds = random_inputs(optimized_char_rnn, {}, 0)
    with_library = _session(optimized_char_rnn).run(None, feeds)
    fallback = _session(optimized_char_rnn, with_library=False).run(None, feeds)
    for a, b in zip(with_library, fallback):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_library_reports_its_version_op_set_and_build():
    info = library_info(onnxfuse.get_library_path())
    assert info["version"] == onnxfuse.__version__
    assert info["opset"] == DOMAIN_VERSION
    assert info["kernels"] >= 4
    assert isinstance(info["avx2_fma_kernels"], bool) and isinstance(info["cuda_driver_found"], bool)
    assert info["cuda_driver_found"] == (info["cuda_driver_error"] is None)


def test_library_is_stripped_and_exports_only_its_entry_points():
    out = subprocess.run(["nm", "-D", "--defined-only", onnxfuse.get_library_path()], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"nm not usable here: {out.stderr.strip()}")
    exported = {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}
    assert {"RegisterCustomOps", "OnnxfuseLibraryInfo"} <= exported
    symtab = subprocess.run(["nm", onnxfuse.get_library_path()], capture_output=True, text=True)
    assert "no symbols" in symtab.stderr or not symtab.stdout.strip(), "the library carries a symbol table"


def test_written_model_records_the_onnxfuse_version_and_op_set(optimized_char_rnn):
    meta = {p.key: p.value for p in optimized_char_rnn.metadata_props}
    assert meta[METADATA_VERSION] == onnxfuse.__version__
    assert meta[METADATA_OPSET] == str(DOMAIN_VERSION)
    assert [o.version for o in optimized_char_rnn.opset_import if o.domain == DOMAIN] == [DOMAIN_VERSION]
    fused = [n for n in optimized_char_rnn.graph.node if n.domain == DOMAIN]
    assert fused
    for n in fused:
        assert [a.i for a in n.attribute if a.name == OPSET_ATTRIBUTE] == [DOMAIN_VERSION], n.name


def test_library_refuses_a_node_of_a_newer_op_set_with_one_message(optimized_char_rnn):
    newer = with_fused_op_set(optimized_char_rnn, DOMAIN_VERSION + 1)
    ort.set_default_logger_severity(4)
    with pytest.raises(Exception) as refused:
        _session(newer)
    message = str(refused.value)
    assert f"was written for onnxfuse op set {DOMAIN_VERSION + 1}" in message
    assert f"this library implements op set {DOMAIN_VERSION} (onnxfuse {onnxfuse.__version__})" in message
    # Without the library the same model runs on its fallback functions.
    feeds = random_inputs(newer, {}, 0)
    _session(newer, with_library=False).run(None, feeds)


def test_python_dash_m_onnxfuse_is_the_cli():
    out = subprocess.run([sys.executable, "-m", "onnxfuse", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Usage: onnxfuse" in out.stdout and "optimize" in out.stdout


def test_info_command_names_versions_library_and_build(cli):
    result = cli("info", "--json")
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["onnxfuse"] == onnxfuse.__version__
    assert info["onnxruntime"]["version"] == ort.__version__
    assert info["library"]["path"] == onnxfuse.get_library_path()
    assert info["library"]["opset"] == DOMAIN_VERSION
    text = cli("info")
    assert text.exit_code == 0
    for needle in ("onnxfuse", "onnxruntime", onnxfuse.get_library_path(), "AVX2", "CUDA driver"):
        assert needle in text.stdout


def _softmax_of_equal_logits_model() -> onnx.ModelProto:
    """y = Softmax(x @ W) with every column of W equal: every logit of a row is the same, so y
    is uniform (1/4 everywhere) whatever x is, like the light zoo CNNs' outputs."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.tile(np.linspace(-1, 1, 8, dtype=np.float32)[:, None], (1, 4))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"], name="matmul"),
         helper.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=-1)],
        "uniform", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_constant_outputs_are_named_and_the_values_before_them_are_compared(tmp_path, cli):
    path = tmp_path / "uniform.onnx"
    onnx.save(_softmax_of_equal_logits_model(), str(path))
    result = cli("optimize", path, tmp_path / "out.onnx")
    assert result.exit_code == 0, result.stderr
    assert "output(s) 'y' are the same whatever the input" in result.stdout
    assert "compared instead the last values that depend on the inputs, 'logits'" in result.stdout
    summary = json.loads(cli("optimize", path, tmp_path / "out.onnx", "--json").stdout)
    dependence = summary["verification"]["input_dependence"]
    assert dependence["constant_outputs"] == ["y"] and dependence["compared"] == ["logits"] and dependence["ok"]


def test_a_wrong_rewrite_hidden_by_constant_outputs_is_caught(tmp_path, monkeypatch, cli):
    from conftest import SENTINEL, shift_first_constant, use_only_passes
    from onnxfuse import pipeline

    # W + 1 keeps W's columns equal: y stays uniform, only the logits show the rewrite is wrong.
    use_only_passes(monkeypatch, pipeline.Pass("test-shift-weights", 1, "wrong on purpose", shift_first_constant))
    path, out = tmp_path / "uniform.onnx", tmp_path / "out.onnx"
    onnx.save(_softmax_of_equal_logits_model(), str(path))
    out.write_bytes(SENTINEL)
    result = cli("optimize", path, out)
    assert result.exit_code == 1
    assert "tensor 'logits'" in result.stderr and f"{out} not written" in result.stderr
    assert out.read_bytes() == SENTINEL


def test_optimize_prints_op_types_before_and_after_and_the_model_size(chain_path, tmp_path, cli):
    result = cli("optimize", chain_path, tmp_path / "out.onnx")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == ["op", "type", "original", "optimized"])
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 2:] if line.strip()
            and not line.startswith("  ")}
    assert rows["Add"][0] == "1" and rows["Relu"][0] == "1" and rows["Sigmoid"][0] == "1"
    assert rows["model"][0] == "size"
    assert all(line == line.rstrip() for line in lines)


def test_progress_is_shown_on_a_terminal_only(chain_path, tmp_path):
    # Off a terminal (this pipe) stderr stays empty, with and without --json.
    for extra in ([], ["--json"]):
        done = subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(chain_path),
                               str(tmp_path / "out.onnx"), *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stderr == "", done.stderr
