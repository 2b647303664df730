"""`optimize --explain PASS`: why a pass left each candidate still in the model."""
from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from onnxfuse.api import optimize
from onnxfuse.cli import main

from attention_models import attention_model


def test_a_softmax_over_another_axis_is_left_with_its_reason():
    result = optimize(attention_model(softmax_axis=1), dims={"B": 1, "S": 4})
    assert result.summary["softmax_left"] == 1
    reasons = result.summary["unmatched"]["fuse-attention"]
    assert list(reasons.values()) == [["Softmax over axis 1, not the last axis of [B, H, Sq, Sk]"]]


def test_keys_beyond_the_cpu_bound_are_left_with_the_measured_bound_as_reason():
    # fuse-attention alone: onnxruntime's MultiHeadAttention (the onnxscript stage) takes it otherwise
    result = optimize(attention_model(), passes=["fuse-attention"], dims={"B": 1, "S": 1024})
    assert result.summary["softmax_left"] == 1
    ((why,),) = result.summary["unmatched"]["fuse-attention"].values()
    assert "key length" in why and "256 keys" in why


def test_probabilities_read_outside_the_chain_name_their_readers():
    result = optimize(attention_model(extra_output="probs"), passes=["fuse-attention"], dims={"B": 1, "S": 4})
    ((why,),) = result.summary["unmatched"]["fuse-attention"].values()
    assert why == "the probabilities are read by MatMul and are a graph output, not by MatMul(P, V) alone"


@pytest.mark.parametrize("kwargs, reason", [
    # the scores chain, matched by the rule engine: its words name where the form stops
    ({"scale": "input"}, "the Softmax input is not (scaled) MatMul(q, kT) plus terms: input 1 of Div 'scale' is 'c', not a constant of one element"),
    ({"extra_output": "scaled"}, "the (scaled) scores are read outside the attention chain"),
    ({"extra_output": "scores"}, "the scores before the scale are read outside the attention chain"),
    ({"extra_output": "masked"}, "the scores are read outside the attention chain"),
    ({"extra_output": "ctx"}, "the output is not merged back by Transpose(0, 2, 1, 3) read by one Reshape"),
    ({"softmax_axis": 2}, "Softmax over axis 2, not the last axis of [B, H, Sq, Sk]"),
    ({"opset": 12}, "opset 12: Softmax before opset 13 normalizes over flattened axes"),
])
def test_every_attention_rejection_is_explained_in_words(kwargs, reason):
    result = optimize(attention_model(**kwargs), passes=["fuse-attention"], dims={"B": 1, "S": 4}, verify_outputs=False,
                      count_kernels=False)
    assert result.summary["unmatched"]["fuse-attention"] == {"softmax": [reason]}


def test_a_fused_attention_leaves_no_softmax_and_no_reason():
    result = optimize(attention_model(), dims={"B": 1, "S": 8})
    assert result.summary["softmax_left"] == 0
    assert "fuse-attention" not in result.summary["unmatched"]


def test_cli_explain_prints_each_left_candidate_and_json_carries_them(tmp_path):
    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(attention_model(softmax_axis=1), src)
    runner = CliRunner()
    done = runner.invoke(main, ["optimize", str(src), str(out), "--dim", "B=1", "--dim", "S=4",
                                "--explain", "fuse-attention"])
    assert done.exit_code == 0, done.output
    assert "1 Softmax left unfused" in done.output
    assert "fuse-attention: 1 candidate(s) left:" in done.output
    assert "Softmax over axis 1" in done.output
    done = runner.invoke(main, ["optimize", str(src), str(out), "--dim", "B=1", "--dim", "S=4", "--json"])
    summary = json.loads(done.output)
    assert summary["softmax_left"] == 1 and "fuse-attention" in summary["unmatched"]


def test_cli_explain_refuses_an_unknown_pass(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(attention_model(), src)
    done = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "o.onnx"), "--explain", "no-such-pass"])
    assert done.exit_code == 2 and "unknown pass 'no-such-pass'" in done.output


def _dropout_in_training_model():
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np

    g = helper.make_graph(
        [helper.make_node("Dropout", ["x", "ratio", "train"], ["d"], name="drop"),
         helper.make_node("Relu", ["d"], ["y"], name="relu")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.array(0.0, np.float32), "ratio"), numpy_helper.from_array(np.array(True), "train")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_rule_pass_explains_each_candidate_it_left_when_asked():
    from onnxfuse.optimize_options import OptimizeOptions

    model = _dropout_in_training_model()
    asked = optimize(model, settings=OptimizeOptions(explain=("remove-dropout",), verify=False, count_kernels=False))
    assert asked.summary["unmatched"]["remove-dropout"] == {"drop": ["training_mode is not a constant false"]}
    # Not asked: rule passes record nothing.
    plain = optimize(model, settings=OptimizeOptions(verify=False, count_kernels=False))
    assert "remove-dropout" not in plain.summary["unmatched"]


def test_cli_explain_prints_a_rule_pass_reason(tmp_path):
    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(_dropout_in_training_model(), src)
    done = CliRunner().invoke(main, ["optimize", str(src), str(out), "--explain", "remove-dropout"])
    assert done.exit_code == 0, done.output
    assert "remove-dropout: 1 candidate(s) left:" in done.output
    assert "drop: training_mode is not a constant false" in done.output


def test_converted_passes_give_their_reasons_through_the_engine():
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np

    from onnxfuse.optimize_options import OptimizeOptions

    g = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s1"], ["r1"], name="inner"),
         helper.make_node("Reshape", ["r1", "s2"], ["r2"], name="outer"),
         helper.make_node("Concat", ["r2", "r2"], ["y"], name="cat", axis=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 12])],
        [numpy_helper.from_array(np.array([6, 4], np.int64), "s1"), numpy_helper.from_array(np.array([0, -1], np.int64), "s2")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    names = ("merge-reshapes", "remove-split-concat")
    result = optimize(model, settings=OptimizeOptions(passes=names, explain=names, verify=False, count_kernels=False))
    why = result.summary["unmatched"]
    assert why["merge-reshapes"] == {
        "inner": ["input 0 of Reshape 'inner' is 'x', computed by no node, not by Reshape"],
        "outer": ["its target shape copies a dim (0) of the inner Reshape's output"]}
    assert why["remove-split-concat"] == {"cat": ["no run of its inputs is every output of one Split, in order, on its axis"]}
