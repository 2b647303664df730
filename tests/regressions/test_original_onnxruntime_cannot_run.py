"""Fuzz seeds 17011, 17428, 24462: valid models (onnx full_check passes) that onnxruntime itself
cannot run (a Cast pair's result read inside an If/Loop body is reported missing). They say nothing
about onnxfuse: the fuzzer counts them apart as "unrunnable", never as passed and never hidden."""
import pytest

from onnxfuse.fuzz import run_case


@pytest.mark.parametrize("seed", [17011, 17428, 24462])
def test_valid_original_that_onnxruntime_cannot_run_is_counted_apart(seed):
    outcome = run_case(seed)
    assert outcome.status == "unrunnable", outcome.message
    assert "onnxruntime cannot run the original" in outcome.message
