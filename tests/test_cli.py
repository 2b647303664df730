"""The `onnxfuse` command line: optimize (summary, JSON, report, dims, IR versions, zoo input),
passes, zoo, help, and the installed console script in a real subprocess."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import SENTINEL, pointwise_chain_model, stderr_lines, use_only_passes
from onnxfuse import pipeline
from onnxfuse.environment import ort_max_ir_version
from onnxfuse.modelio import load_model
from onnxfuse.modelsave import data_file_name, save_model
from onnxfuse.inputs import random_inputs


def run_plain(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def fuse_relu_sigmoid(graph, ctx):
    """Test-only fusion: Relu -> Sigmoid becomes one onnxfuse node (an op type our library does
    not implement, so it always runs on its fallback function)."""
    relu = next((n for n in graph.nodes if n.op == "Relu"), None)
    if relu is None:  # nothing (left) to match
        return 0
    sigmoid = relu.outputs[0].outputs[0]
    ctx.fuse(graph, "TestOnlyReluSigmoid", [relu, sigmoid], [relu.inputs[0]], [sigmoid.outputs[0]])
    return 1


TEST_FUSION = pipeline.Pass("test-fuse-relu-sigmoid", 1, "Relu+Sigmoid -> one fused node", fuse_relu_sigmoid)


def test_optimize_writes_a_model_that_computes_what_the_original_does(chain_path, tmp_path, cli):
    out = tmp_path / "chain.opt.onnx"
    result = cli("optimize", chain_path, out, "--dim", "batch=4")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    for field in ("nodes", "fused ops", "kernels", "verified", "time"):
        assert f"  {field} " in result.stdout
    assert "dims batch=4" in result.stdout
    optimized = onnx.load(str(out))
    feeds = random_inputs(optimized, {"batch": 4}, seed=3)
    np.testing.assert_allclose(run_plain(optimized, feeds)[0], run_plain(onnx.load(str(chain_path)), feeds)[0],
                               rtol=1e-5, atol=1e-6)


def test_json_summary_and_report_file(chain_path, tmp_path, cli):
    out, report = tmp_path / "o.onnx", tmp_path / "report.json"
    result = cli("optimize", chain_path, out, "--json", "--report", report, "--seed", 11)
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["nodes_before"] == 3 and summary["kernels_before"] == 3
    assert summary["output"] == str(out) and summary["verification"]["ok"] is True
    # batch is unset: verified at a value above 1 (dimchoice.py), and at a second one (a cheap model)
    assert summary["verification"]["seed"] == 11 and summary["dims"] == {"batch": 2}
    assert summary["dims_chosen"]["how"] == {"batch": "chosen"}
    assert summary["dims_chosen"]["settings"] == [{"batch": 2}, {"batch": 3}]
    assert [m["dims"] for m in summary["verification"]["more_settings"]] == [{"batch": 3}]
    saved = json.loads(report.read_text())
    assert saved["summary"] == summary
    expected_passes = [p.name for p in pipeline.select_passes(None, "cpu")]
    assert [p["pass"] for p in saved["passes"]] == expected_passes
    for p in saved["passes"]:
        assert set(p) == {"pass", "matches", "nodes_removed", "seconds", "rounds"}
        assert p["nodes_removed"] == sum(r["nodes_before"] - r["nodes_after"] for r in p["rounds"])
        assert p["matches"] == sum(r["matches"] for r in p["rounds"])


def test_fused_nodes_carry_overload_functions_and_the_saved_ir_allows_them(chain_path, tmp_path, cli, monkeypatch):
    use_only_passes(monkeypatch, TEST_FUSION)
    out = tmp_path / "fused.onnx"
    source = pointwise_chain_model(ir_version=8)
    onnx.save(source, str(chain_path))
    result = cli("optimize", chain_path, out, "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["fused_ops"] == {"TestOnlyReluSigmoid": 1}
    assert summary["nodes_after"] == 2
    runs = summary["verification"]["runs"]
    assert [r["run"] for r in runs] == ["with the onnxfuse library", "fallback functions, no library"]
    model = onnx.load(str(out))
    assert model.ir_version == 10  # overloads need IR >= 10, the input had 8
    fused = [n for n in model.graph.node if n.domain == "onnxfuse"]
    assert len(fused) == 1 and fused[0].overload
    assert [(f.domain, f.name, f.overload) for f in model.functions] == [
        ("onnxfuse", "TestOnlyReluSigmoid", fused[0].overload)]
    feeds = random_inputs(model, {}, seed=1)
    np.testing.assert_allclose(run_plain(model, feeds)[0], run_plain(source, feeds)[0], rtol=1e-6)


def test_ir3_model_listing_initializers_as_inputs_gets_constants(tmp_path, cli):
    model = pointwise_chain_model(opset=9, ir_version=3)
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [8]))
    src, out = tmp_path / "ir3.onnx", tmp_path / "ir3.opt.onnx"
    onnx.save(model, str(src))
    result = cli("optimize", src, out)
    assert result.exit_code == 0, result.stderr
    assert "1 initializers listed as graph inputs (IR 3) made constants" in result.stdout
    saved = onnx.load(str(out))
    assert [i.name for i in saved.graph.input] == ["x"]
    assert saved.ir_version >= 4
    onnx.checker.check_model(saved)


def test_output_ir_version_is_one_onnxruntime_loads(tmp_path, cli):
    model = pointwise_chain_model()
    model.ir_version = onnx.IR_VERSION  # what onnx writes by default, newer than onnxruntime reads
    src, out = tmp_path / "new_ir.onnx", tmp_path / "o.onnx"
    onnx.save(model, str(src))
    result = cli("optimize", src, out)
    assert result.exit_code == 0, result.stderr
    saved = onnx.load(str(out))
    assert saved.ir_version == min(onnx.IR_VERSION, ort_max_ir_version())
    run_plain(saved, random_inputs(saved))


def test_save_is_atomic_and_leaves_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    target = tmp_path / "model.onnx"
    target.write_bytes(SENTINEL)

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    from onnxfuse.outfiles import OutputError

    with pytest.raises(OutputError, match=f"{target}: cannot write output: no space left on device"):
        save_model(pointwise_chain_model(), target)
    assert target.read_bytes() == SENTINEL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # no temporary left behind


def test_big_models_are_saved_with_external_data_next_to_them(tmp_path):
    model = pointwise_chain_model()
    big = numpy_helper.from_array(np.arange(4096, dtype=np.float32), "big")
    model.graph.initializer.append(big)
    model.graph.node.append(helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info("total", TensorProto.FLOAT, []))
    target = tmp_path / "big.onnx"
    written = save_model(model, target, external_threshold=1024)  # as if the model were over 2 GiB
    data = data_file_name("big.onnx", hashlib.sha256((tmp_path / written[1]).read_bytes()).hexdigest())
    assert written == [str(target), str(tmp_path / data)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", data]
    assert target.stat().st_size < 4096 * 4  # the large tensor is not inline
    loaded = load_model(target).model
    out = run_plain(loaded, random_inputs(loaded))
    assert out[1] == pytest.approx(np.arange(4096).sum())


def _table_rows(text: str) -> tuple[list[str], list[list[str]]]:
    """A wrapped rich table (SIMPLE_HEAD) read back: its header cells and, per row, each column's
    text with the wrapped lines joined. A row starts where the first column has text."""
    lines = text.splitlines()
    header, rule, body = lines[0], lines[1], lines[2:]
    assert set(rule) == {"─"}, rule
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[max(0, i - 2):i] == "  ")]
    rows: list[list[str]] = []
    for line in body:
        cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [len(line) + 1])]
        if cells[0]:
            rows.append(cells)
        else:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells)]
    return [header[a:b].strip() for a, b in zip(starts, starts[1:] + [len(header) + 1])], rows


def test_passes_command_lists_every_pass_with_its_targets_within_the_terminal(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "90")
    result = cli("passes")
    assert result.exit_code == 0
    assert max(len(line) for line in result.stdout.splitlines()) <= 90
    header, rows = _table_rows(result.stdout)
    assert header == ["pass", "targets", "runs", "what it does"]
    passes = pipeline.all_passes()
    assert [r[0] for r in rows] == [p.name for p in passes]
    for (name, targets, runs, summary), p in zip(rows, passes):
        assert targets == ",".join(p.targets) and runs == ("default" if p.default else "opt-in")
        assert summary == " ".join(p.summary.split()), (summary, p.summary)
    listed = json.loads(cli("passes", "--json").stdout)
    assert [p["name"] for p in listed] == [p.name for p in passes]


def test_passes_option_runs_only_the_named_passes(chain_path, tmp_path, cli):
    names = [p.name for p in pipeline.all_passes()][:1]
    if not names:
        pytest.skip("no passes installed")
    result = cli("optimize", chain_path, tmp_path / "o.onnx", "--passes", ",".join(names), "--json")
    assert json.loads(result.stdout)["passes_run"] == names


def test_zoo_command_lists_the_bundled_models_with_their_inputs(cli, monkeypatch):
    from onnxfuse import zoo

    result = cli("zoo", "--json")
    assert result.exit_code == 0, result.stderr
    listed = json.loads(result.stdout)
    assert [m["name"] for m in listed] == [m.name for m in zoo.list_models()]
    assert all(m["inputs"] and m["description"] for m in listed)
    assert "char_rnn" in [m["name"] for m in listed]
    monkeypatch.setenv("COLUMNS", "100")
    text = cli("zoo").stdout
    assert max(len(line) for line in text.splitlines()) <= 100
    header, rows = _table_rows(text)
    assert header == ["model (zoo:NAME)", "description", "inputs"]
    assert [r[0] for r in rows] == [m["name"] for m in listed]
    # input shapes in brackets are shown as they are (not read as markup)
    assert rows[0][2].replace(" ", "") == "".join(listed[0]["inputs"]).replace(" ", "")


def test_zoo_model_as_input(tmp_path, cli):
    out = tmp_path / "char_rnn.opt.onnx"
    result = cli("optimize", "zoo:char_rnn", out, "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["input"] == "zoo:char_rnn" and summary["verification"]["ok"]
    assert summary["kernels_after"] <= summary["kernels_before"]
    onnx.checker.check_model(onnx.load(str(out)))


def test_help_documents_the_exit_codes(cli):
    for args in ([], ["optimize"]):
        text = cli(*args, "--help").stdout
        assert "Exit status" in text
        for code in ("0  success", "1  verification failed", "2  bad input", "3  internal error"):
            assert code in text


def console_script() -> str:
    found = Path(sys.executable).parent / "onnxfuse"
    if found.exists():
        return str(found)
    found = shutil.which("onnxfuse")
    assert found, "the onnxfuse console script is not installed (pip install -e .)"
    return found


def test_console_script_in_a_subprocess(chain_path, tmp_path, sentinel_out):
    out = tmp_path / "o.onnx"
    done = subprocess.run([console_script(), "optimize", str(chain_path), str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "verified" in done.stdout and done.stderr == ""
    assert onnx.load(str(out)).graph.node

    # Bad input, seen from outside: exactly one line on the real stderr (onnxruntime's own
    # C++ logging included), exit 2, OUT untouched.
    random_file = tmp_path / "random.onnx"
    random_file.write_bytes(os.urandom(2048))
    unknown_op = pointwise_chain_model()
    unknown_op.graph.node[1].op_type = "NoSuchOp"
    onnx.save(unknown_op, str(tmp_path / "unknown_op.onnx"))
    for bad in (random_file, tmp_path / "unknown_op.onnx"):
        done = subprocess.run([console_script(), "optimize", str(bad), str(sentinel_out)], capture_output=True,
                              text=True, timeout=120)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and lines[0].startswith(f"onnxfuse: error: {bad}: "), done.stderr
        assert sentinel_out.read_bytes() == SENTINEL


def test_python_api_optimizes_a_model_proto_and_refuses_a_mismatch(monkeypatch):
    import onnxfuse
    from conftest import shift_first_constant

    result = onnxfuse.optimize(pointwise_chain_model(), dims={"batch": 2})
    assert isinstance(result.model, onnx.ModelProto)
    assert result.summary["kernels_before"] == 3 and result.verification.ok
    assert [s.name for s in result.passes] == [p.name for p in pipeline.select_passes(None, "cpu")]

    use_only_passes(monkeypatch, pipeline.Pass("test-shift", 1, "wrong on purpose", shift_first_constant))
    with pytest.raises(onnxfuse.VerificationError, match="output 'y'"):
        onnxfuse.optimize(pointwise_chain_model())
    with pytest.raises(onnxfuse.InputError, match="unknown pass"):
        onnxfuse.optimize(pointwise_chain_model(), passes=["nope"])


def test_shape_inference_failure_does_not_fail_the_run(chain_path, tmp_path, cli, monkeypatch):
    from onnx import shape_inference

    def broken_inference(*args, **kwargs):
        raise onnx.shape_inference.InferenceError("inference gave up on purpose")

    monkeypatch.setattr(shape_inference, "infer_shapes", broken_inference)
    result = cli("optimize", chain_path, tmp_path / "o.onnx")
    assert result.exit_code == 0, result.stderr
    assert "shape inference failed (inference gave up on purpose)" in result.stdout


def test_model_with_external_data_is_optimized(tmp_path, cli):
    src = tmp_path / "ext.onnx"
    onnx.save(pointwise_chain_model(), str(src), save_as_external_data=True, location="ext.onnx.data",
              size_threshold=0)
    out = tmp_path / "o.onnx"
    result = cli("optimize", src, out, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["verification"]["ok"]
    saved = onnx.load(str(out))  # small: written self-contained
    assert not any(t.external_data for t in saved.graph.initializer)


def test_model_size_counts_external_data_before_and_after(tmp_path, cli):
    """A model whose weights are in a .data file (torch's dynamo exporter writes such): the size
    line and bytes_before/bytes_after are the files' sizes, weights included, not the few bytes
    the .onnx file holds for each reference."""
    from onnx.external_data_helper import convert_model_to_external_data

    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])
    weights = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w{i}") for i in range(4)]
    nodes, last = [], "x"
    for i in range(4):
        nodes += [helper.make_node("MatMul", [last, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        last = f"r{i}"
    nodes.append(helper.make_node("Sigmoid", [last], ["y"]))
    model = helper.make_model(helper.make_graph(nodes, "mlp", [x], [y], weights),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location="mlp.onnx.data", size_threshold=0)
    source = tmp_path / "mlp.onnx"
    onnx.save(model, str(source))
    files_before = source.stat().st_size + (tmp_path / "mlp.onnx.data").stat().st_size
    assert files_before > 4 * 64 * 64 * 4 > 10 * source.stat().st_size  # the weights are in the .data file

    out = tmp_path / "out" / "mlp.opt.onnx"
    out.parent.mkdir()
    summary = json.loads(cli("optimize", source, out, "--json").stdout)
    files_after = sum(Path(p).stat().st_size for p in summary["files_written"])
    # the message's own bytes for each reference (location, offset, length) differ from raw_data's
    assert abs(summary["bytes_before"] - files_before) <= 48 * len(weights), (summary["bytes_before"], files_before)
    assert abs(summary["bytes_after"] - files_after) <= 48 * len(weights), (summary["bytes_after"], files_after)
    text = cli("optimize", source, out).stdout
    size_line = next(line for line in text.splitlines() if line.startswith("model size"))
    assert size_line.split()[2:] == [f"{files_before / 1024:.1f}", "KiB", f"{files_after / 1024:.1f}", "KiB"], size_line


def test_a_cuda_compile_error_is_told_by_its_type_not_its_name(chain_path, tmp_path, cli, monkeypatch):
    from onnxfuse import api
    from onnxfuse.errors import CompileError

    class NvccRejected(CompileError):
        pass

    def failing(*args, **kwargs):
        raise NvccRejected("ptxas: too many registers\nmore")

    monkeypatch.setattr(api, "optimize", failing)
    done = cli("optimize", chain_path, tmp_path / "o.onnx")
    assert done.exit_code == 3
    assert "CUDA compilation failed: ptxas: too many registers" in done.stderr and "internal error" not in done.stderr
