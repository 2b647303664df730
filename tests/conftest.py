"""Shared fixtures: small models written to disk, a sentinel OUT file, the CLI runner, and the
`gpu` marker's skip on machines without a CUDA device."""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

SENTINEL = b"sentinel: must survive a failed run\n"


@functools.lru_cache(maxsize=None)
def cuda_device_count() -> int:
    """CUDA devices the driver reports (0 without a driver: no libcuda, no device)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def pytest_collection_modifyitems(config, items):
    if cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (no libcuda or no device on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pointwise_chain_model(opset: int = 17, ir_version: int = 10) -> onnx.ModelProto:
    """y = sigmoid(relu(x + w)), x: float[batch, 8], w a constant."""
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "w"], ["t"], name="add"),
            helper.make_node("Relu", ["t"], ["u"], name="relu"),
            helper.make_node("Sigmoid", ["u"], ["y"], name="sigmoid"),
        ],
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(np.linspace(-1, 1, 8, dtype=np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


@pytest.fixture
def chain_path(tmp_path):
    path = tmp_path / "chain.onnx"
    onnx.save(pointwise_chain_model(), str(path))
    return path


@pytest.fixture
def sentinel_out(tmp_path):
    """An existing OUT file whose content a failed run must leave as it was."""
    path = tmp_path / "out.onnx"
    path.write_bytes(SENTINEL)
    return path


@pytest.fixture
def cli():
    """Invoke the CLI in-process: cli(args...) -> click Result (exit_code, stdout, stderr)."""
    from click.testing import CliRunner

    from onnxfuse.cli import main

    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke


def stderr_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def use_only_passes(monkeypatch, *passes):
    """Make the pipeline see exactly these (test-only) passes."""
    from onnxfuse import pipeline

    monkeypatch.setattr(pipeline, "all_passes", lambda: list(passes))


def shift_first_constant(graph, ctx, amount=1.0):
    """A deliberately wrong rewrite: adds `amount` to the first constant tensor."""
    import onnx_graphsurgeon as gs

    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant) and tensor.values.dtype.kind == "f":
            tensor.values = (tensor.values + np.float32(amount)).astype(tensor.values.dtype)
            return 1
    return 0


def temporaries(directory) -> list[str]:
    """The temporary files a run left in `directory`."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def wait_for_the_write(proc, ready, directory) -> None:
    """Wait (at most 120 s) until a run stopped in its write has said so in file `ready`, and check
    that it holds a temporary file there then."""
    import time

    deadline = time.time() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run never reached the write"
        time.sleep(0.05)
    assert temporaries(directory), "the write had no temporary file to remove"
