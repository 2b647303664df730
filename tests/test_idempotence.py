"""Idempotence: optimizing an optimized model changes nothing and still verifies, and every
optimized model passes onnx.checker with full_check."""
from __future__ import annotations

import onnx
import pytest

from conftest import pointwise_chain_model
from onnxfuse import fuzz
from onnxfuse.fuzz import optimize_model


def _ops(model):
    return [(n.domain, n.op_type, n.overload) for n in model.graph.node]


def _assert_fixed_point(model):
    once = optimize_model(model)
    onnx.checker.check_model(once, full_check=True)
    twice = optimize_model(once)
    onnx.checker.check_model(twice, full_check=True)
    assert _ops(twice) == _ops(once)
    assert [f.overload for f in twice.functions] == [f.overload for f in once.functions]
    return once


def test_chain_model_is_a_fixed_point():
    once = _assert_fixed_point(pointwise_chain_model())
    assert any(n.domain == "onnxfuse" for n in once.graph.node)


def test_fuzz_models_with_fused_nodes_are_fixed_points():
    seeds = [s for s in range(2000, 2100) if fuzz.run_case(s, idempotence=False).fused][:15]
    assert len(seeds) >= 10
    for seed in seeds:
        _assert_fixed_point(fuzz.build_case(seed).model)


@pytest.mark.parametrize("name", ["mlp_ensemble", "mobilenetv3", "char_rnn"])
def test_second_cli_run_on_zoo_model_changes_nothing_and_verifies(name, tmp_path, cli):
    once, twice = tmp_path / "once.onnx", tmp_path / "twice.onnx"
    first = cli("optimize", f"zoo:{name}", once)
    assert first.exit_code == 0, first.stderr
    second = cli("optimize", once, twice)
    assert second.exit_code == 0, second.stderr
    assert "verified" in second.stdout
    a, b = onnx.load(str(once)), onnx.load(str(twice))
    onnx.checker.check_model(b, full_check=True)
    assert _ops(b) == _ops(a)
