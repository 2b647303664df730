"""Profiling: kernels per inference as onnxruntime's profiler records them, bytes moved,
latency, and two models side by side."""
from __future__ import annotations

import json
import os
import re
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import cuda_device_count, pointwise_chain_model, stderr_lines
from onnxfuse.profile import count_kernels, kernel_profile, measure_latency
from onnxfuse.inputs import random_inputs


def conv_model():
    """Conv -> Relu -> MatMul -> Add: onnxruntime fuses Conv+Relu (and MatMul+Add) at level all."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
            helper.make_node("Relu", ["c"], ["r"], name="relu"),
            helper.make_node("Reshape", ["r", "shape"], ["flat"], name="reshape"),
            helper.make_node("MatMul", ["flat", "m"], ["mm"], name="matmul"),
            helper.make_node("Add", ["mm", "bias"], ["y"], name="add"),
        ],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        [
            numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"),
            numpy_helper.from_array(np.array([1, 256], dtype=np.int64), "shape"),
            numpy_helper.from_array(rng.standard_normal((256, 5)).astype(np.float32), "m"),
            numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "bias"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def hand_count(model, level, tmp_path):
    """Kernels of one inference, counted straight from onnxruntime's profiler JSON."""
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "hand")
    so.graph_optimization_level = level
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess.run(None, random_inputs(model))
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    kernels = [e for e in events if e["cat"] == "Node" and e["name"].endswith("_kernel_time")]
    return len(kernels), Counter(e["args"]["op_name"] for e in kernels)


@pytest.mark.parametrize("level, ort_level", [
    ("all", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
    ("disable", ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
])
def test_kernel_count_equals_a_hand_count_of_the_profiler_json(level, ort_level, tmp_path):
    model = conv_model()
    expected, expected_by_op = hand_count(model, ort_level, tmp_path)
    kernels, by_op = count_kernels(model, level=level)
    assert kernels == expected
    assert by_op == dict(expected_by_op)
    assert sum(by_op.values()) == kernels


def test_kernel_count_is_after_onnxruntime_optimizations():
    model = conv_model()
    unoptimized, by_op = count_kernels(model, level="disable")
    assert unoptimized == len(model.graph.node) and by_op["Relu"] == 1
    optimized, by_op = count_kernels(model, level="all")
    assert optimized < unoptimized and "Relu" not in by_op  # Conv+Relu run as one FusedConv


def test_kernel_count_is_per_inference_over_several_runs():
    from onnxfuse.profile import profiled_run

    model = conv_model()
    _, one = profiled_run(model, random_inputs(model), runs=1)
    _, five = profiled_run(model, random_inputs(model), runs=5)
    assert five.kernels_per_inference == one.kernels_per_inference
    assert five.bytes_written == one.bytes_written


def test_bytes_read_and_written_follow_the_tensor_shapes():
    model = pointwise_chain_model()  # Add(x, w) -> Relu -> Sigmoid on float[batch, 8]
    for batch in (1, 3):
        prof = kernel_profile(model, level="disable", dims={"batch": batch})
        activation = batch * 8 * 4
        assert prof.activation_bytes_read == 3 * activation  # x, t, u
        assert prof.parameter_bytes_read == 8 * 4  # w
        assert prof.bytes_written == 3 * activation
        assert not prof.library_loaded


def test_measure_latency_times_the_requested_runs():
    lat = measure_latency(pointwise_chain_model(), runs=20, warmup=2)
    assert lat.runs == 20 and len(lat.samples_ms) == 20
    assert 0 < lat.p10_ms <= lat.median_ms <= lat.p90_ms


def test_profile_cli_shows_two_models_side_by_side(tmp_path, cli):
    a = tmp_path / "conv.onnx"
    onnx.save(conv_model(), str(a))
    b = tmp_path / "conv_copy.onnx"
    onnx.save(conv_model(), str(b))
    result = cli("profile", a, b, "--runs", 5, "--warmup", 1, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert [m["model"] for m in report["models"]] == [str(a), str(b)]
    assert report["models"][0]["kernels_per_inference"] == count_kernels(conv_model())[0]
    assert report["ratios"]["kernels_per_inference"] == 1.0
    assert all(m["latency"]["runs"] == 5 for m in report["models"])

    result = cli("profile", a, b, "--runs", 5, "--ort-level", "disable")
    assert result.exit_code == 0
    assert str(a) in result.stdout and str(b) in result.stdout and "MODEL2/MODEL" in result.stdout
    assert "kernels / inference" in result.stdout and "median latency" in result.stdout


def test_profile_cli_ratio_is_model2_over_model(tmp_path, cli):
    a = tmp_path / "conv.onnx"
    onnx.save(conv_model(), str(a))
    result = cli("profile", a, "--runs", 0, "--ort-level", "disable", "--json")
    one = json.loads(result.stdout)["models"][0]
    assert one["kernels_per_inference"] == 5 and one["latency"] is None
    small = pointwise_chain_model()
    p1, p2 = tmp_path / "chain.onnx", tmp_path / "sigmoid.onnx"
    onnx.save(small, str(p1))
    del small.graph.node[:2]
    small.graph.node[0].input[0] = "x"
    del small.graph.initializer[:]
    onnx.save(small, str(p2))
    report = json.loads(cli("profile", p1, p2, "--runs", 2, "--ort-level", "disable", "--json").stdout)
    assert report["ratios"]["kernels_per_inference"] == pytest.approx(1 / 3)


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the refusal on machines without a GPU")
def test_profile_cuda_without_a_gpu_is_refused_not_silently_run_on_cpu(chain_path, cli):
    result = cli("profile", chain_path, "--provider", "cuda", "--runs", 1)
    assert result.exit_code == 2
    assert len(stderr_lines(result)) == 1 and "cuda" in result.stderr.lower()


def test_kernel_time_by_op_type_leaves_out_the_first_run(tmp_path):
    from onnxfuse.profile import summarize_events

    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "time")
    sess = ort.InferenceSession(conv_model().SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = random_inputs(conv_model())
    for _ in range(4):
        sess.run(None, feeds)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    runs = sorted((e for e in events if e["cat"] == "Session" and e["name"] == "model_run"), key=lambda e: e["ts"])
    assert len(runs) == 4
    warm_end = runs[0]["ts"] + runs[0]["dur"]
    expected: Counter = Counter()
    for e in events:
        if e["cat"] == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= warm_end:
            expected[e["args"]["op_name"]] += e["dur"] / 3

    prof = summarize_events(events, 4, False, "cpu", "all")
    assert prof.timed_runs == 3
    assert set(prof.time_us_by_op_type) == set(prof.by_op_type)
    assert prof.time_us_by_op_type == pytest.approx(dict(expected))
    assert prof.kernel_time_us == pytest.approx(sum(expected.values()))
    assert list(prof.time_us_by_op_type.values()) == sorted(prof.time_us_by_op_type.values(), reverse=True)


def test_profile_text_shows_each_op_types_share_of_kernel_time():
    from click.testing import CliRunner

    from onnxfuse.cli import main

    path = os.path.join(os.path.dirname(__file__), "..", "models", "mlp_ensemble.onnx")
    res = CliRunner().invoke(main, ["profile", path, "--runs", "3", "--profile-runs", "3", "--top", "3"])
    assert res.exit_code == 0, res.output
    assert "kernel time (profiler)" in res.output
    rows = [re.search(r"\((\d+)%(?:, (\d+)-(\d+)%)?\)$", line.rstrip()) for line in res.output.splitlines()
            if line.startswith("  ") and line.rstrip().endswith("%)")]
    shares = [int(m.group(1)) for m in rows]
    assert shares and 95 <= sum(shares) <= 105  # three op types plus "more", each rounded
    # with two timed runs or more, each op type shows the lowest and highest share of one run
    ranges = [(int(m.group(2)), int(m.group(3))) for m in rows if m.group(2)]
    assert ranges and len(ranges) >= len(rows) - 1  # every row but "(N more op types)"
    assert all(0 <= low <= high <= 100 for low, high in ranges)
    assert "lowest-highest of 2 runs" in res.output
    assert "activations read / written:" in res.output  # the figures are explained
