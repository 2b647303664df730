"""Region-level verification: each fused node against the subgraph it replaced, and the
choice between it and the whole-model comparison (region_verify.py, verify.choose_mode)."""
from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from onnxfuse import api, verify
from onnxfuse.fused import DOMAIN
from onnxfuse.modelio import InputError, load_model
from onnxfuse.models import llama_large
from onnxfuse.normalize import normalize



@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "llama.onnx"
    llama_large.build(path, **llama_large.PRESETS["tiny"])
    return path


def test_region_mode_checks_every_fused_node_against_its_fallback(llama):
    result = api.optimize(str(llama), verify_mode="regions")
    v = result.verification
    fused = [n for n in result.model.graph.node if n.domain == DOMAIN]
    assert v.mode == "regions" and v.ok and fused
    assert not any(r.skipped for r in v.regions) and all(r.outputs for r in v.regions)
    assert sorted(r.node for r in v.regions if r.kind == "fused") == sorted(n.name for n in fused)


def test_region_mode_checks_concatenated_gemm_weights_against_the_original_matmuls(llama):
    result = api.optimize(str(llama), verify_mode="regions")
    rewrites = [r for r in result.verification.regions if r.kind == "rewrite"]
    # Per layer, batch-sibling-matmul makes Q/K/V one MatMul + Split, and gate/up another MatMul
    # whose halves the gated activation's Pointwise reads: checked with it, against the original.
    assert len(rewrites) == 4 and all(r.ok for r in rewrites)
    assert sorted((r.op_type, len(r.outputs)) for r in rewrites) == [
        ("MatMul+Pointwise", 1), ("MatMul+Pointwise", 1), ("MatMul+Split", 3), ("MatMul+Split", 3)]


def test_region_mode_catches_a_rewrite_that_differs_from_the_original(llama):
    result = api.optimize(str(llama), verify_outputs=False, count_kernels=False)
    original = normalize(load_model(llama, weights_on_disk=True)).model
    optimized = onnx.ModelProto()
    optimized.CopyFrom(result.model)
    split = next(n for n in optimized.graph.node if n.op_type == "Split" and len(n.output) == 3)
    first, second = split.output[0], split.output[1]
    split.output[0], split.output[1] = second, first  # Q and K swapped: same shapes, other values
    v = verify.verify(original, optimized, mode="regions")
    bad = [r for r in v.regions if not r.ok]
    assert len(bad) == 1 and bad[0].kind == "rewrite" and bad[0].op_type == "MatMul+Split"
    assert not v.ok and "against the original subgraph" in v.first_problem()
    assert result.summary["kernels_before"] is None  # the whole model was not run


def _tamper_one_fallback(model: onnx.ModelProto) -> str:
    """Change one op of one fused node's fallback body (Sigmoid -> Tanh, or Mul -> Add): the
    fused kernel and its fallback then disagree. Returns the fused node's name."""
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        fn = next(f for f in model.functions if (f.name, f.overload) == (node.op_type, node.overload))
        for body_node in fn.node:
            swap = {"Sigmoid": "Tanh", "Mul": "Add", "Div": "Mul"}.get(body_node.op_type)
            if swap:
                body_node.op_type = swap
                return node.name
    raise AssertionError("no fused node with a body op to change")


def test_region_mode_catches_a_fused_node_that_differs_from_its_fallback(llama):
    result = api.optimize(str(llama), verify_outputs=False, count_kernels=False)
    original = normalize(load_model(llama, weights_on_disk=True)).model
    optimized = onnx.ModelProto()
    optimized.CopyFrom(result.model)
    name = _tamper_one_fallback(optimized)
    v = verify.verify(original, optimized, mode="regions")
    assert not v.ok
    bad = [r for r in v.regions if not r.ok]
    assert [r.node for r in bad] == [name]
    assert f"fused node '{name}'" in v.first_problem() and "fallback body" in v.first_problem()


def test_auto_mode_picks_regions_when_the_whole_run_would_not_fit(llama, monkeypatch):
    original = normalize(load_model(llama, weights_on_disk=True)).model
    size = verify.weight_bytes(original)
    assert verify.choose_mode(original, original, "auto", available=100 * size)[0] == "whole"
    mode, why = verify.choose_mode(original, original, "auto", available=size)
    assert mode == "regions" and "available" in why
    assert verify.choose_mode(original, original, "whole", available=1)[0] == "whole"
    with pytest.raises(InputError):
        verify.choose_mode(original, original, "partial")
    monkeypatch.setattr(verify, "available_memory", lambda: size)
    result = api.optimize(str(llama))
    assert result.summary["verification"]["mode"] == "regions"


def test_cli_summary_names_the_region_mode(llama, tmp_path, cli):
    out = tmp_path / "out.onnx"
    result = cli("optimize", llama, out, "--verify-mode", "regions")
    assert result.exit_code == 0, result.output
    assert "verified   region by region (--verify-mode regions)" in result.stdout and out.exists()
    result = cli("optimize", llama, out, "--verify-mode", "regions", "--json")
    summary = json.loads(result.stdout)
    assert summary["verification"]["mode"] == "regions" and summary["verification"]["regions"]


def test_region_model_of_a_node_with_unknown_input_shape_is_skipped_not_failed():
    from onnxfuse.region_verify import region_model

    fn = helper.make_function(DOMAIN, "Pointwise", ["x"], ["y"], [helper.make_node("Relu", ["x"], ["y"])],
                              [helper.make_opsetid("", 17)])
    fn.overload = "Pointwise_0"
    node = helper.make_node("Pointwise", ["x"], ["y"], domain=DOMAIN, name="p")
    node.overload = "Pointwise_0"
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", 17),
                                                                    helper.make_opsetid(DOMAIN, 1)])
    assert "no known type and shape" in region_model(model, model.graph.node[0], {}, {})
