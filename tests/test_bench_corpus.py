"""bench/corpus.py (the corpus benchmark of record): its figures, from rows as bench_model
writes them, and one real model through every tool that is installed."""
from __future__ import annotations

import importlib.util
import math

import pytest

from bench import corpus


def _row(name, family, kernels: dict, ratios: dict, errors=()):
    tools = {"ort": {"kernels": kernels["ort"], "ms_1t": 1.0}}
    for tool in corpus.TOOLS[1:]:
        if tool in errors:
            tools[tool] = {"error": "RuntimeError: boom"}
        else:
            tools[tool] = {"kernels": kernels[tool], "ratio_1t": [ratios[tool], 0.0, 2.0],
                           "ratio_2t": [ratios[tool], 0.0, 2.0]}
    return {"name": name, "family": family, "tools": tools}


K = {"ort": 100, "ort-transformers": 80, "onnxscript": 50, "onnxslim": 90, "onnxfuse": 50}
R = {"ort-transformers": 0.95, "onnxscript": 0.9, "onnxslim": 1.0, "onnxfuse": 0.8}


def test_geometric_means_count_a_failed_tool_as_the_original():
    rows = [_row("a_ts", "transformer", K, R), _row("b_ts", "rnn", K, R, errors=("onnxfuse",))]
    assert corpus.kernel_ratio(rows[1], "onnxfuse") == 1.0 and corpus.latency_ratio(rows[1], "onnxfuse", 1) == 1.0
    summary = {(c[0], c[1]): c for c in corpus.summary_rows(rows, [1, 2])}
    fuse = summary[("transformers+RNNs", "onnxfuse")]
    assert float(fuse[2]) == pytest.approx(math.sqrt(0.5 * 1.0), abs=1e-3)
    assert float(fuse[3]) == pytest.approx(math.sqrt(0.8 * 1.0), abs=1e-3)
    assert fuse[-1] == "1/2"
    assert ("CNNs", "onnxfuse") not in summary


def test_best_tool_lists_ties_and_names_onnxruntime_when_nothing_improves():
    row = _row("a_ts", "transformer", K, R)
    assert corpus.best(row, corpus.kernel_ratio) == ["onnxscript", "onnxfuse"]
    assert corpus.best(row, lambda r, t: corpus.latency_ratio(r, t, 1)) == ["onnxfuse"]
    flat = _row("c_ts", "cnn", dict.fromkeys(K, 100), dict.fromkeys(R, 1.0))
    assert corpus.best(flat, corpus.kernel_ratio) == ["ort"]


def test_corpus_model_runs_through_every_installed_tool(tmp_path):
    out = tmp_path / "corpus.md"
    status = corpus.main(["--models", "lstm_dynamo", "--threads", "1", "--budget", "0.05", "--out", str(out)])
    assert status == 0
    text = out.read_text()
    assert "| lstm_dynamo | 122 |" in text and "Geometric means" in text
    row = __import__("json").loads(out.with_suffix(".json").read_text())["models"][0]
    assert row["tools"]["onnxfuse"]["kernels"] < row["tools"]["ort"]["kernels"]
    for tool, module in (("onnxscript", "onnxscript"), ("onnxslim", "onnxslim")):
        if importlib.util.find_spec(module) is None:
            assert "error" in row["tools"][tool]
    out.write_text("")
    assert corpus.main(["--render-only", "--out", str(out)]) == 0
    assert out.read_text() == text
