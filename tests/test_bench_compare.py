"""bench/compare.py (onnxfuse beside onnxruntime alone and the ONNX simplifiers), its README
section generator and the GPT-2-small-sized model generator, on small models and few runs."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
from onnx import TensorProto, helper

from bench import compare, compare_report, gpt2_small, readme_section
from onnxfuse import zoo

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _peer_ok_or_not_installed(info: dict, tool: str) -> None:
    if importlib.util.find_spec(tool) is None:
        assert info["status"] == "failed" and "not installed" in info["error"]
    else:
        assert info["status"] == "ok", info["error"]


def test_benchmark_runs_every_variant_of_a_zoo_model_and_writes_report_data_and_chart(tmp_path, capsys):
    out, data, chart = tmp_path / "RESULTS.md", tmp_path / "compare.json", tmp_path / "compare.png"
    argv = ["--models", "mlp_ensemble", "--threads", "1", "--runs", "3", "--min-runs", "3", "--warmup", "1",
            "--no-optimize-time", "--out", str(out), "--json", str(data), "--chart", str(chart)]
    if not HAS_MATPLOTLIB:
        argv.append("--no-chart")
    assert compare.main(argv) == 0
    printed = capsys.readouterr().out

    results = json.loads(data.read_text())
    (model,) = results["models"]
    assert model["model"] == "mlp_ensemble"
    assert list(model["variants"]) == list(compare_report.VARIANTS)
    baseline = zoo.load_baseline()["models"]["mlp_ensemble"]
    ort, fuse = model["variants"]["ort"], model["variants"]["onnxfuse"]
    # kernels counted as the zoo's regression baseline counts them
    assert ort["kernels"]["cpu"] == baseline["ort"]
    assert fuse["status"] == "ok" and fuse["kernels"]["cpu"] == baseline["onnxfuse"]
    assert fuse["optimize_s"] > 0 and set(fuse["stages"]) >= {"load", "passes", "verify"}
    for tool in compare_report.PEERS:
        _peer_ok_or_not_installed(model["variants"][tool], tool)
    for name, info in model["variants"].items():
        if info["status"] != "ok":
            continue
        lat = info["latency"]["cpu-1t"]
        assert lat["runs"] == 3
        assert 0 < lat["min_ms"] <= lat["median_ms"] <= lat["max_ms"]
        assert lat["ratio"] > 0
    assert model["variants"]["ort"]["latency"]["cpu-1t"]["ratio"] == 1.0

    report = out.read_text()
    assert f"| mlp_ensemble | {baseline['ort']} |" in report
    assert "CUDA provider:" in report and "python -m bench.compare --models mlp_ensemble" in report
    assert compare_report.summary_tables(results) in printed  # what it prints is what it wrote
    assert compare_report.summary_tables(results) in report
    if HAS_MATPLOTLIB:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "](compare.png)" in report

    # --render-only rewrites the report from the data alone, identically
    out.unlink()
    render = ["--render-only", "--json", str(data), "--out", str(out), "--chart", str(chart)]
    assert compare.main(render + ([] if HAS_MATPLOTLIB else ["--no-chart"])) == 0
    assert out.read_text() == report


def test_a_failing_optimizer_is_a_reported_failure_with_its_reason(tmp_path):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07not a model at all")
    run = compare.run_tool("onnxoptimizer", garbage, tmp_path / "out.onnx", timeout=120)
    assert run.seconds is None and run.error
    assert "\n" not in run.error and len(run.error) < 400


def test_a_failed_tool_leaves_the_other_variants_measured(tmp_path, monkeypatch):
    real = compare.run_tool

    def failing_onnxsim(tool, *a, **kw):
        if tool == "onnxsim":
            return compare.ToolRun(error="the optimizer process killed by SIGSEGV")
        return real(tool, *a, **kw)

    monkeypatch.setattr(compare, "run_tool", failing_onnxsim)
    args = compare.parse_args(["--runs", "2", "--min-runs", "2", "--warmup", "1"])
    m = zoo.get("mlp_ensemble")
    entry = compare.bench_model(m.name, m.path, m.dims, [compare.Setting("cpu", 1)], ["onnxsim", "onnxfuse"],
                                args, tmp_path, lambda msg: None)
    assert entry["variants"]["onnxsim"] == {**entry["variants"]["onnxsim"], "status": "failed",
                                            "error": "the optimizer process killed by SIGSEGV"}
    assert entry["variants"]["onnxsim"]["latency"] == {}
    assert entry["variants"]["onnxfuse"]["status"] == "ok"
    assert entry["variants"]["onnxfuse"]["latency"]["cpu-1t"]["runs"] == 2
    table = compare_report.model_table(entry, [{"key": "cpu-1t", "label": "CPU, 1 thread", "provider": "cpu"}])
    assert "| onnxsim | failed: the optimizer process killed by SIGSEGV |" in table


def _add_model(scale: float) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    k = helper.make_tensor("k", TensorProto.FLOAT, [4], [scale] * 4)
    graph = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["y"])], "g", [x], [y], [k])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_changed_outputs_are_named_as_the_failure():
    original = _add_model(1.0)
    expected = [np.ones(4, np.float32)]
    assert compare._check_outputs(original, expected, [np.ones(4, np.float32)]) is None
    problem = compare._check_outputs(original, expected, [np.full(4, 2.0, np.float32)])
    assert problem.startswith("outputs differ from the original's: 'y':")
    assert compare._check_outputs(original, expected, []) == "0 outputs instead of 1"


class _RecordingSession:
    def __init__(self, name: str, log: list, seconds: float = 0.0):
        self.name, self.log, self.seconds = name, log, seconds

    def run(self, _outputs, _feeds):
        self.log.append(self.name)


def test_latency_rounds_rotate_the_starting_variant_and_pair_ratios():
    log: list[str] = []
    sessions = {n: _RecordingSession(n, log) for n in "abc"}
    # sample_ms 0: one inference per sample, so the log is the measuring order
    result = compare.interleaved_latency(sessions, {}, rounds=3, min_rounds=3, budget_s=0.0, warmup=1,
                                         sample_ms=0.0, baseline="a")
    assert log[:3] == ["a", "b", "c"]  # warm-up
    assert log[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(r["runs"] == 3 and r["inferences_per_sample"] == 1 for r in result.values())
    assert result["a"]["ratio"] == 1.0


def test_latency_rounds_stop_at_the_budget_after_the_minimum():
    log: list[str] = []
    sessions = {n: _RecordingSession(n, log) for n in "ab"}
    result = compare.interleaved_latency(sessions, {}, rounds=1000, min_rounds=4, budget_s=0.0, warmup=1,
                                         sample_ms=0.0)
    assert result["a"]["runs"] == result["b"]["runs"] == 4
    assert "ratio" not in result["a"]


def test_optimize_time_that_misses_its_goal_says_where_the_time_goes(tmp_path):
    args = compare.parse_args(["--profile-top", "5", "--tool-timeout", "300"])
    m = zoo.get("gpt_stack")
    entry = compare.time_optimize("gpt_stack", m.path, m.dims, 0.0, 1, args, tmp_path, lambda msg: None, nodes=228)
    assert entry["met"] is False and len(entry["seconds"]) == 1
    assert {p["pass"] for p in entry["passes"]} >= {"pointwise", "shape-plumbing"}
    assert entry["passes"] == sorted(entry["passes"], key=lambda p: -p["seconds"])
    hot = entry["hot_functions"]
    assert len(hot["by_own_time"]) == 5
    assert hot["ours_by_cumulative_time"][0]["function"].startswith("onnxfuse/api.py")
    text = compare_report.optimize_time_section({"optimize_time": [entry]})
    assert "### Where the time goes: gpt_stack" in text and "| **no** |" in text


def test_gpt2_small_generator_builds_gpt_stack_graph_with_per_block_weights():
    module = gpt2_small._gpt_stack_module()
    before = (module.BLOCKS, module.D_MODEL, module.VOCAB)
    model = gpt2_small.build(blocks=2, d_model=64, heads=4, vocab=100, max_seq=16)
    assert (module.BLOCKS, module.D_MODEL, module.VOCAB) == before  # the zoo generator is left as it was
    onnx.checker.check_model(model)
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    assert inits["transformer.h.0.attn.c_attn.weight"] == (64, 192)
    assert inits["transformer.h.1.mlp.c_proj.weight"] == (256, 64)
    assert not any(name in inits for name in gpt2_small.SHARED_BLOCK_WEIGHTS)
    readers: dict[str, set] = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.name.startswith("/transformer/h.") and node.input[1] in inits:
            readers.setdefault(node.input[1], set()).add(node.name.split("/")[2])
    assert len(readers) == 8 and all(len(blocks) == 1 for blocks in readers.values())

    from onnxfuse.runtime import make_session

    ids = np.arange(16, dtype=np.int64).reshape(2, 8) % 100
    (logits,) = make_session(model).run(None, {"input_ids": ids})
    assert logits.shape == (2, 8, 100) and np.isfinite(logits).all()


README = """# Project

## Benchmarks

<!-- bench:start -->
old figures
<!-- bench:end -->

## After
"""


def _tiny_results() -> dict:
    variant = lambda k, r: {"status": "ok", "error": None, "optimize_s": 0.1, "nodes": 3,  # noqa: E731
                            "kernels": {"cpu": k}, "latency": {"cpu-1t": {"min_ms": 1.0, "median_ms": 2.0,
                                                                          "max_ms": 3.0, "runs": 5, "ratio": r}}}
    return {
        "format": 1,
        "meta": {"date": "2026-01-01 00:00 UTC", "commit": "abc1234", "machine": "x86_64, cpu, 2 cores; linux",
                 "load_average_start": [3.0, 2.0, 1.0]},
        "settings": [{"provider": "cpu", "threads": 1, "key": "cpu-1t", "label": "CPU, 1 thread"}],
        "models": [{"model": "m", "nodes": 3, "dims": {},
                    "variants": {"ort": variant(10, 1.0), "onnxfuse": variant(5, 0.8)}}],
    }


def test_readme_section_is_rewritten_between_the_markers_from_the_data(tmp_path):
    readme, data = tmp_path / "README.md", tmp_path / "compare.json"
    readme.write_text(README)
    data.write_text(json.dumps(_tiny_results()))
    argv = ["--readme", str(readme), "--json", str(data), "--chart", str(tmp_path / "none.png"),
            "--results", str(tmp_path / "bench" / "RESULTS.md")]
    assert readme_section.main(argv + ["--check"]) == 1
    assert readme_section.main(argv) == 0
    text = readme.read_text()
    assert "old figures" not in text
    assert text.startswith("# Project\n\n## Benchmarks\n\n<!-- bench:start -->\n")
    assert text.endswith("<!-- bench:end -->\n\n## After\n")
    assert "| m | 10 | 5 (0.50) |" in text and "| m | 2.000 ms | 0.80 |" in text
    assert "[bench/RESULTS.md](bench/RESULTS.md)" in text
    assert readme_section.main(argv + ["--check"]) == 0  # up to date


def test_readme_without_markers_is_one_line_error_exit_2(tmp_path, capsys):
    readme, data = tmp_path / "README.md", tmp_path / "compare.json"
    readme.write_text("# Project\n")
    data.write_text(json.dumps(_tiny_results()))
    assert readme_section.main(["--readme", str(readme), "--json", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "<!-- bench:start -->" in err and "\n" not in err
    assert readme.read_text() == "# Project\n"
