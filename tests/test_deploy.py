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
from onnxfuse.verify import random_inputs


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
    newer = onnx.ModelProto()
    newer.CopyFrom(optimized_char_rnn)
    for n in newer.graph.node:
        for a in n.attribute:
            if a.name == OPSET_ATTRIBUTE:
                a.i = DOMAIN_VERSION + 1
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
