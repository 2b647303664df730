"""OptimizeOptions: what optimize is asked to do, one object the command line fills and the
Python API takes, with one set of checks for both."""
from __future__ import annotations

import pytest
from onnx import helper

import onnxfuse
from onnxfuse.optimize_options import OptimizeOptions, OptionError
from small_models import float_model


def _model():
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    return float_model("silu", nodes, {"x": [2, 3]}, {"y": [2, 3]})


@pytest.mark.parametrize("fields,option,words", [
    ({"target": "tpu"}, "--target", "unknown target"),
    ({"arch": "sm_90"}, "--arch", "--target cuda only"),
    ({"tune": True}, "--tune", "--target cuda only"),
    ({"target": "cuda", "arch": "ninety"}, "--arch", "sm_NN"),
    ({"verify_mode": "half"}, "--verify-mode", "unknown verify mode"),
])
def test_each_bad_combination_names_its_option(fields, option, words):
    with pytest.raises(OptionError) as e:
        OptimizeOptions(**fields).check()
    assert e.value.option == option and words in str(e.value)


def test_the_api_checks_what_the_command_line_checks():
    # The Python API used to run a CPU optimization with tune=True, which only the CLI refused.
    with pytest.raises(onnxfuse.InputError, match="--tune applies to --target cuda only"):
        onnxfuse.optimize(_model(), tune=True)


def test_settings_object_and_keywords_give_the_same_result():
    by_keywords = onnxfuse.optimize(_model(), passes=["pointwise"], count_kernels=False, seed=3)
    settings = OptimizeOptions(passes=("pointwise",), count_kernels=False, seed=3)
    by_settings = onnxfuse.optimize(_model(), settings=settings)
    assert by_settings.model.SerializeToString() == by_keywords.model.SerializeToString()
    assert by_settings.summary["passes_run"] == ["pointwise"] and by_settings.verification.ok


def test_cuda_compiler_is_needed_only_when_cuda_compile_runs():
    assert OptimizeOptions(target="cuda").compiles_cuda
    assert not OptimizeOptions(target="cuda", passes=("pointwise",)).compiles_cuda
    assert not OptimizeOptions().compiles_cuda
