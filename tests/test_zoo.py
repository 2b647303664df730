"""Zoo-wide regression suite: every zoo model through the default CPU pipeline.

For each model: the optimized model matches the original in onnxruntime on seeded random inputs
(our library registered; fallback functions checked too), and runs exactly the number of
kernels per inference recorded in models/baseline.json (ORT_ENABLE_ALL, CPU, 1 thread): more is
a regression, fewer means the baseline is stale (rewrite it with `python models/update_baseline.py`).
The light onnx-wheel models also match the reference output onnx's backend test uses, and their
pre-Softmax logits match the original's: their weights are all equal constants, so the Softmax
output alone is uniform whatever the arithmetic before it and would hide errors.

Models marked slow in models/manifest.json run only with the slow tests (`pytest -m slow`);
the whole zoo takes well under a minute on 2 cores.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxfuse import zoo
from onnxfuse.api import optimize_for_baseline
from onnxfuse.runtime import make_session

MODELS = zoo.list_models()
BASELINE = zoo.load_baseline().get("models", {})
UPDATE_HINT = "python models/update_baseline.py"
# optimize_for_baseline results by model name, reused by the reference-output test
_OPTIMIZED: dict = {}


def _params(models):
    return [pytest.param(m, id=m.name, marks=[pytest.mark.slow] if m.slow else []) for m in models]


@pytest.mark.parametrize("model", _params(MODELS))
def test_optimized_zoo_model_matches_original_and_kernel_baseline(model):
    # optimize_for_baseline raises VerificationError when any output differs from the original's
    result = _OPTIMIZED[model.name] = optimize_for_baseline(model)
    assert result.verification is not None and result.verification.ok
    before = result.summary["kernels_before"]
    after = result.summary["kernels_after"]
    assert model.name in BASELINE, f"{model.uri} has no entry in models/baseline.json; run {UPDATE_HINT} {model.name}"
    expected = BASELINE[model.name]["onnxfuse"]
    assert after <= expected, (
        f"{model.uri} runs {after} kernels per inference, more than the baseline's {expected} "
        f"(onnxruntime alone: {before}): a regression"
    )
    assert after >= expected, (
        f"{model.uri} now runs {after} kernels per inference, fewer than the baseline's {expected}: "
        f"update the baseline with `{UPDATE_HINT} {model.name}`"
    )
    assert after <= before, f"{model.uri}: the optimized model runs {after} kernels, the original {before}"


def _softmax_logits(model: onnx.ModelProto) -> str | None:
    """Name of the tensor a final Softmax reads (the graph's first output), if there is one."""
    out = model.graph.output[0].name
    producer = next((n for n in model.graph.node if out in n.output), None)
    return producer.input[0] if producer is not None and producer.op_type == "Softmax" else None


LIGHT = [m for m in MODELS if m.reference is not None]


@pytest.mark.parametrize("model", _params(LIGHT))
def test_light_zoo_model_matches_reference_output_and_original_logits(model):
    from onnxfuse.api import optimize

    original = model.load()
    logits = _softmax_logits(original)
    if logits is not None:
        # Expose the logits as a second output: verification (seeded random inputs) compares them too.
        original.graph.output.append(onnx.ValueInfoProto(name=logits))
        result = optimize(original, threads=1, count_kernels=False, label=model.uri)
        assert logits in [o.name for o in result.verification.runs[0].outputs]
    else:
        result = _OPTIMIZED.get(model.name) or optimize_for_baseline(model)
    assert result.verification.ok

    outputs = make_session(result.model, threads=1).run(None, model.reference_inputs())
    (reference,) = model.reference_outputs()
    np.testing.assert_allclose(
        outputs[0], reference, rtol=model.reference_rtol, atol=model.reference_atol,
        err_msg=f"{model.uri}: optimized output differs from the reference {model.reference.name}",
    )


def test_baseline_covers_every_zoo_model_and_records_no_slowdown():
    assert sorted(BASELINE) == sorted(m.name for m in MODELS), f"rewrite it with {UPDATE_HINT}"
    for name, counts in BASELINE.items():
        assert set(counts) == {"ort", "onnxfuse"}, name
        assert 0 < counts["onnxfuse"] <= counts["ort"], name
