"""Models whose weights stay on disk: loading by reference, new weights spilled, streaming saves.

The models here are small (a 2-layer LLaMA-style decoder of models/llama_large.py, under 1 MB);
the paths they take are the ones a model of any size takes: weights held by reference, new
weights spilled to the scratch file, data files written tensor by tensor. The figures for
models of 0.5 to 6 GB are in bench/results/large_model.md.
"""
from __future__ import annotations

import gc
import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from onnxfuse import api, modelsave, weights
from onnxfuse.modelio import InputError, load_model
from onnxfuse.modelsave import save_model
from onnxfuse.normalize import normalize
from onnxfuse.models import llama_large


FEEDS = {"input_ids": (np.arange(16, dtype=np.int64) % 7).reshape(1, 16)}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "llama.onnx"
    llama_large.build(path, **llama_large.PRESETS["tiny"])
    return path


def run_file(path, feeds=FEEDS):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def test_weights_on_disk_are_references_not_bytes(llama):
    loaded = load_model(llama, weights_on_disk=True).model
    big = [t for t in loaded.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert big and all(not t.raw_data for t in big)
    region = weights.region_of(big[0])
    assert region is not None and Path(region.path).is_absolute() and region.offset % weights.ALIGN == 0
    in_memory = {t.name: numpy_helper.to_array(t) for t in load_model(llama).model.graph.initializer}
    mapped = weights.read_tensor(big[0])
    assert isinstance(mapped, np.memmap) and np.array_equal(mapped, in_memory[big[0].name])


def test_external_location_outside_the_model_directory_is_rejected(tmp_path):
    (tmp_path / "inner").mkdir()
    path = tmp_path / "inner" / "m.onnx"
    llama_large.build(path, **llama_large.PRESETS["tiny"])
    (tmp_path / "inner" / "m.onnx.data").rename(tmp_path / "m.onnx.data")
    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../m.onnx.data"
    onnx.save(model, str(path))
    with pytest.raises(InputError, match="outside the model's directory"):
        load_model(path, weights_on_disk=True)


def test_optimize_keeps_weights_on_disk_and_spills_new_ones(llama, tmp_path):
    result = api.optimize(str(llama), verify_outputs=False, count_kernels=False)
    model = result.model
    regions = [weights.region_of(t) for t in model.graph.initializer]
    assert all(t.raw_data == b"" or len(t.raw_data) < weights.SPILL_MIN_BYTES for t in model.graph.initializer)
    sources = {r.path for r in regions if r is not None}
    # Unchanged weights point at the input's data file; concatenated sibling GEMM weights
    # (batch-sibling-matmul) at the scratch file.
    assert str(Path(str(llama) + ".data").resolve()) in sources
    assert len(sources) == 2
    gc.collect()  # graphsurgeon's graphs hold reference cycles: what they held goes with them
    assert all(ref() is None for ref, *_ in weights._mapped.values())  # no mapping outlives the run
    out = tmp_path / "out.onnx"
    written = save_model(model, out, external_threshold=1 << 40)  # never over 2 GiB: the data file is by bytes held
    assert written == [str(out)]  # under INLINE_REFERENCED_MAX: one self-contained file
    assert not any(t.external_data for t in onnx.load(str(out)).graph.initializer)
    np.testing.assert_allclose(run_file(out), run_file(llama), rtol=1e-5, atol=1e-5)


def _serialized_sizes(monkeypatch) -> list[int]:
    """The size of every message serialized from now on (a model holding its weights shows as one
    the size of the weights)."""
    serialized = []
    real = onnx.ModelProto.SerializeToString

    def spy(self, *args, **kwargs):
        data = real(self, *args, **kwargs)
        serialized.append(len(data))
        return data

    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", spy)
    return serialized


def test_save_streams_references_into_the_data_file(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(modelsave, "INLINE_REFERENCED_MAX", 1024)  # as if the weights were gigabytes
    model = api.optimize(str(llama), verify_outputs=False, count_kernels=False).model
    serialized = _serialized_sizes(monkeypatch)
    out = tmp_path / "out.onnx"
    written = save_model(model, out)
    assert len(written) == 2 and written[0] == str(out)
    data = os.path.basename(written[1])
    assert re.fullmatch(r"out\.onnx\.[0-9a-f]{16}\.data", data) and (tmp_path / data).is_file()
    saved = onnx.load(str(out), load_external_data=False)
    external = [t for t in saved.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    total = sum(weights.expected_bytes(t) for t in external)
    assert total > 600_000 and max(serialized) < 100_000  # no message held the weights
    for t in external:
        info = weights.external_entries(t)
        assert info["location"] == data and int(info["offset"]) % weights.ALIGN == 0
    np.testing.assert_allclose(run_file(out), run_file(llama), rtol=1e-5, atol=1e-5)


def test_shape_inference_is_not_skipped_for_weights_left_out(llama):
    loaded = normalize(load_model(llama, weights_on_disk=True))
    assert not any("skipped" in n for n in loaded.notes)
    assert len(loaded.model.graph.value_info) > 50


def test_whole_model_verification_runs_models_holding_references(llama):
    result = api.optimize(str(llama), verify_mode="whole")
    v = result.summary["verification"]
    assert v["mode"] == "whole" and v["ok"] and v["mode_reason"] == "--verify-mode whole"
    assert result.summary["kernels_after"] < result.summary["kernels_before"]


def test_verification_copies_the_weights_where_they_cannot_be_linked(llama, monkeypatch):
    def no_links(src, dst, *args, **kwargs):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(weights.os, "link", no_links)
    result = api.optimize(str(llama), verify_mode="whole")
    assert result.summary["verification"]["ok"] and result.summary["verification"]["mode"] == "whole"


def test_sessions_open_models_holding_references(llama):
    from onnxfuse.runtime import make_session, open_session

    model = api.optimize(str(llama), verify_outputs=False, count_kernels=False).model
    assert weights.has_references(model)
    expected = run_file(llama)
    np.testing.assert_allclose(make_session(model).run(None, FEEDS)[0], expected, rtol=1e-5, atol=1e-5)
    sess, _ = open_session(model, with_library=False)
    np.testing.assert_allclose(sess.run(None, FEEDS)[0], expected, rtol=1e-5, atol=1e-5)


def test_profile_holds_external_weights_by_reference(llama, monkeypatch):
    """`onnxfuse profile` of a model with external data opens its sessions from the weights'
    files, as optimize does: read into the model, a 2.4 GiB decode step (Qwen2-0.5B) could not
    be serialized for the session (protobuf's 2 GiB limit) and the command failed with exit 3."""
    from click.testing import CliRunner

    from onnxfuse.cli import main

    serialized = _serialized_sizes(monkeypatch)
    result = CliRunner().invoke(main, ["profile", str(llama), "--runs", "1", "--warmup", "0", "--profile-runs", "1"])
    assert result.exit_code == 0, result.output
    assert "kernels / inference" in result.output
    weights_bytes = sum(os.path.getsize(p) for p in llama.parent.glob("*.data"))
    assert weights_bytes > 600_000 and max(serialized, default=0) < 100_000  # no message held the weights


def test_data_file_of_streamed_references_is_named_after_the_sha256_of_its_bytes(llama, tmp_path, monkeypatch):
    """The digest is computed on a second thread from the bytes and regions written, while the
    regions are copied (bench/results/save_digest.md); it must be the file's own SHA-256."""
    import hashlib

    monkeypatch.setattr(modelsave, "INLINE_REFERENCED_MAX", 1024)
    model = api.optimize(str(llama), verify_outputs=False, count_kernels=False).model
    written = save_model(model, tmp_path / "out.onnx")
    data = Path(written[1])
    assert data.name == modelsave.data_file_name("out.onnx", hashlib.sha256(data.read_bytes()).hexdigest())


def test_a_region_that_cannot_be_read_for_the_digest_writes_nothing(llama, tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(modelsave, "INLINE_REFERENCED_MAX", 1024)
    model = api.optimize(str(llama), verify_outputs=False, count_kernels=False).model
    monkeypatch.setattr(modelsave._DigestOfWrites, "CHUNK", 4096)
    real_open = open

    def failing_open(path, mode="r", *args, **kwargs):  # the digest thread's reads fail
        if "r" in mode and threading.current_thread().name == "onnxfuse-data-digest":
            raise OSError(5, "Input/output error")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", failing_open)
    with pytest.raises(modelsave.outfiles.OutputError, match="out.onnx"):
        save_model(model, tmp_path / "out.onnx")
    assert list(tmp_path.iterdir()) == []
