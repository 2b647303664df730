"""Bad input: one line on stderr naming the file and the problem, exit status 2, no traceback,
and an existing OUT left exactly as it was."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import SENTINEL, pointwise_chain_model, stderr_lines
from onnxfuse.modelio import InputError, load_model


def _save(model, path):
    onnx.save(model, str(path))
    return path


def missing_file(tmp):
    return tmp / "nothere.onnx", "no such file"


def directory(tmp):
    d = tmp / "adir.onnx"
    d.mkdir()
    return d, "is a directory"


def random_bytes(tmp):
    p = tmp / "random.onnx"
    p.write_bytes(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    return p, "not an ONNX model"


def truncated(tmp):
    data = pointwise_chain_model().SerializeToString()
    p = tmp / "truncated.onnx"
    p.write_bytes(data[: len(data) // 2])
    return p, "not an ONNX model"


def json_file(tmp):
    p = tmp / "model.json"
    p.write_text('{"graph": {"node": []}, "ir_version": 10}\n')
    return p, "a JSON file"


def empty_file(tmp):
    p = tmp / "empty.onnx"
    p.write_bytes(b"")
    return p, "empty file"


def missing_external_data(tmp):
    p = tmp / "ext.onnx"
    onnx.save(pointwise_chain_model(), str(p), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    os.remove(tmp / "ext.onnx.data")
    return p, "external data file 'ext.onnx.data'"


def truncated_external_data(tmp):
    p = tmp / "ext.onnx"
    onnx.save(pointwise_chain_model(), str(p), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    data = (tmp / "ext.onnx.data").read_bytes()
    (tmp / "ext.onnx.data").write_bytes(data[:5])
    return p, "is shorter"


def opset_too_new(tmp):
    return _save(pointwise_chain_model(opset=99), tmp / "opset99.onnx"), "opset 99 is newer than onnxruntime"


def unknown_operator(tmp):
    model = pointwise_chain_model()
    model.graph.node[1].op_type = "NoSuchOp"
    return _save(model, tmp / "unknown_op.onnx"), "onnxruntime cannot run it"


def cycle(tmp):
    model = pointwise_chain_model()
    model.graph.node[0].input[0] = "y"  # add reads sigmoid's output: add -> relu -> sigmoid -> add
    return _save(model, tmp / "cycle.onnx"), "cycle"


def dangling_input(tmp):
    model = pointwise_chain_model()
    model.graph.node[2].input[0] = "ghost"
    return _save(model, tmp / "dangling.onnx"), "reads 'ghost', which nothing produces"


def output_nobody_produces(tmp):
    model = pointwise_chain_model()
    model.graph.output[0].name = "nowhere"
    return _save(model, tmp / "nooutput.onnx"), "graph output 'nowhere'"


BAD_MODELS = [
    missing_file, directory, random_bytes, truncated, json_file, empty_file, missing_external_data,
    truncated_external_data, opset_too_new, unknown_operator, cycle, dangling_input, output_nobody_produces,
]


def assert_one_line_error(result, *fragments):
    lines = stderr_lines(result)
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.stdout)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("onnxfuse: error: "), lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.mark.parametrize("case", BAD_MODELS, ids=lambda c: c.__name__)
def test_optimize_rejects_bad_model_with_one_line_and_exit_2(case, tmp_path, cli, sentinel_out):
    path, problem = case(tmp_path)
    result = cli("optimize", path, sentinel_out)
    assert_one_line_error(result, path.name, problem)
    assert sentinel_out.read_bytes() == SENTINEL


@pytest.mark.parametrize("case", [missing_file, random_bytes, cycle, opset_too_new], ids=lambda c: c.__name__)
def test_profile_rejects_bad_model_with_one_line_and_exit_2(case, tmp_path, cli):
    path, problem = case(tmp_path)
    assert_one_line_error(cli("profile", path, "--runs", 1), path.name, problem)


def test_every_truncation_of_a_model_is_rejected(tmp_path):
    data = pointwise_chain_model().SerializeToString()
    for cut in range(len(data)):
        with pytest.raises(InputError, match="truncated.onnx: "):
            p = tmp_path / "truncated.onnx"
            p.write_bytes(data[:cut])
            load_model(p)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--passes", "no-such-pass"], "unknown pass(es): no-such-pass"),
        (["--passes", "a,,b"], "comma-separated"),
        (["--dim", "batch"], "expected NAME=VALUE"),
        (["--dim", "batch=two"], "is not an integer"),
        (["--dim", "batch=0"], "at least 1"),
        (["--dim", "btach=2"], "no input has a symbolic dimension 'btach'"),
        (["--target", "tpu"], "--target"),
        (["--arch", "sm_90"], "--target cuda only"),
        (["--target", "cuda", "--arch", "ninety"], "sm_NN"),
        (["--no-such-option"], "No such option"),
    ],
)
def test_bad_option_is_one_line_and_exit_2(args, fragment, chain_path, cli, sentinel_out):
    result = cli("optimize", chain_path, sentinel_out, *args)
    assert_one_line_error(result, fragment)
    assert sentinel_out.read_bytes() == SENTINEL


def test_unwritable_out_is_reported_before_any_work(chain_path, tmp_path, cli):
    result = cli("optimize", chain_path, tmp_path / "no" / "such" / "dir" / "out.onnx")
    assert_one_line_error(result, "does not exist")
    result = cli("optimize", chain_path, tmp_path)
    assert_one_line_error(result, "is a directory")


def test_missing_argument_is_one_line(cli):
    assert_one_line_error(cli("optimize", "only-in.onnx"), "Missing argument 'OUT'")


def test_unknown_zoo_model_is_bad_input(cli, sentinel_out):
    result = cli("optimize", "zoo:no_such_model", sentinel_out)
    assert_one_line_error(result, "zoo:no_such_model")
    assert sentinel_out.read_bytes() == SENTINEL


def test_internal_error_is_one_line_exit_3_and_traceback_only_with_debug(chain_path, tmp_path, cli, monkeypatch):
    from onnxfuse import pipeline

    def explode(graph, ctx):
        raise RuntimeError("pass exploded on purpose")

    boom = pipeline.Pass("test-explode", 1, "raises", explode)
    monkeypatch.setattr(pipeline, "all_passes", lambda: [boom])
    out = tmp_path / "o.onnx"

    result = cli("optimize", chain_path, out)
    lines = stderr_lines(result)
    assert result.exit_code == 3
    assert lines == ["onnxfuse: internal error: RuntimeError: pass exploded on purpose (rerun with --debug for the traceback)"]
    assert not out.exists()

    result = cli("--debug", "optimize", chain_path, out)
    assert result.exit_code == 3
    assert "Traceback" in result.stderr and "pass exploded on purpose" in result.stderr

    monkeypatch.setenv("ONNXFUSE_DEBUG", "1")
    result = cli("optimize", chain_path, out)
    assert result.exit_code == 3 and "Traceback" in result.stderr


def test_inputs_that_cannot_be_fed_random_data_are_bad_input_only_for_verification(tmp_path, cli, sentinel_out):
    graph = helper.make_graph(
        [helper.make_node("SequenceLength", ["s"], ["n"])],
        "seq",
        [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("n", TensorProto.INT64, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = _save(model, tmp_path / "seq.onnx")
    assert_one_line_error(cli("optimize", path, sentinel_out), "seq.onnx", "input 's' is a sequence", "--no-verify")
    assert sentinel_out.read_bytes() == SENTINEL
    result = cli("optimize", path, sentinel_out, "--no-verify")
    assert result.exit_code == 0, result.stderr
    assert "kernels not counted" in result.stdout
    onnx.checker.check_model(onnx.load(str(sentinel_out)))
