"""Verification at informative shapes: unset symbolic dims get values above 1, distinct per dim,
related dims found (by their dim_param expression, else by running the original), --dim wins."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxfuse
from onnxfuse import zoo
from onnxfuse.dimchoice import activation_bytes, choose_dims, choose_verify_dims, probe_runner
from onnxfuse.verify import verify


def _model(nodes, inputs, outputs, inits=(), name="m"):
    graph = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def decode_model(mask_dim: str = "s1 + 1", past: str = "s1", batch: str = "s0"):
    """A decode step as dynamo names it: the cache [s0, s1, 8] and one new token concatenated,
    weighted by a mask over past + new [s0, s1 + 1]."""
    return _model(
        [helper.make_node("Concat", ["past", "x"], ["kv"], axis=1),
         helper.make_node("Unsqueeze", ["mask", "axes"], ["m3"]),
         helper.make_node("Mul", ["kv", "m3"], ["w"]),
         helper.make_node("ReduceSum", ["w", "axes1"], ["y"], keepdims=0)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 1, 8]),
         helper.make_tensor_value_info("past", TensorProto.FLOAT, [batch, past, 8]),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, [batch, mask_dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])],
        [_i64("axes", [-1]), _i64("axes1", [1])])


def heads_model(baked_heads: bool = False, swapped: bool = False):
    """x [batch, seq, 16] split into 4 heads of 4 and merged into [batch * 4, seq, 4]. With
    baked_heads the merge's target is the constant [4, -1, 4] (batch * heads at batch 1); with
    swapped the target reads seq where batch belongs (right only where batch == seq)."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "i0"], ["b"], axis=0),
             helper.make_node("Gather", ["shape", "i1"], ["s"], axis=0),
             helper.make_node("Concat", ["b", "s", "four", "four"], ["split"], axis=0),
             helper.make_node("Reshape", ["x", "split"], ["x4"]),
             helper.make_node("Transpose", ["x4"], ["xt"], perm=[0, 2, 1, 3])]
    if baked_heads:
        nodes.append(helper.make_node("Reshape", ["xt", "baked"], ["y"]))
    else:
        first, second = ("s", "b") if swapped else ("b", "s")
        nodes += [helper.make_node("Mul", [first, "four"], ["bh"]),
                  helper.make_node("Concat", ["bh", second, "four"], ["merge"], axis=0),
                  helper.make_node("Reshape", ["xt", "merge"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 16])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                  [_i64("i0", [0]), _i64("i1", [1]), _i64("four", [4]), _i64("baked", [4, -1, 4])])


def test_a_dim_written_as_an_expression_of_others_is_computed_from_them():
    model = decode_model()
    choice = choose_verify_dims(model, {})
    dims = choice.dims
    assert dims["s1 + 1"] == dims["s1"] + 1 and dims["s1"] > 1 and dims["s0"] > 1
    assert choice.how["s1 + 1"] == "computed from its expression"
    assert choice.probes == 2  # one run for each setting: nothing to search
    assert len(choice.settings) == 2 and choice.settings[1]["s1 + 1"] == choice.settings[1]["s1"] + 1


def test_related_dims_named_apart_are_found_by_running_the_original():
    model = decode_model(mask_dim="total", past="past", batch="batch")
    choice = choose_verify_dims(model, {})
    dims = choice.dims
    assert dims["total"] == dims["past"] + 1 and dims["past"] > 1 and dims["batch"] > 1
    assert "found by running the original" in choice.how["total"]
    assert all(s["total"] == s["past"] + 1 for s in choice.settings)
    # without a run to try candidates on, the distinct values are all there is
    unprobed = choose_dims(model, {}).dims
    assert len(set(unprobed.values())) == 3


def test_user_dims_always_win_and_the_rest_is_chosen_around_them():
    model = decode_model(mask_dim="total", past="past", batch="batch")
    choice = choose_verify_dims(model, {"past": 1})
    assert choice.dims["past"] == 1 and choice.dims["total"] == 2 and choice.how["past"] == "given"
    assert choose_verify_dims(model, {"past": 4, "total": 5, "batch": 1}).settings == [
        {"batch": 1, "total": 5, "past": 4}]


def test_values_are_distinct_above_one_and_sequence_like_dims_get_the_largest():
    choice = choose_verify_dims(heads_model(), {})
    assert choice.dims["seq"] > choice.dims["batch"] > 1
    assert choice.settings[1]["seq"] > 1 and choice.settings[1]["batch"] > 1
    assert choice.settings[1] != choice.dims


def test_the_memory_budget_lowers_the_largest_dims():
    model = heads_model()
    small = choose_dims(model, {}, budget=activation_bytes(model, {"batch": 2, "seq": 8}))
    assert small.dims == {"batch": 2, "seq": 8}
    assert choose_dims(model, {}, budget=0).dims == {"batch": 2, "seq": 3}


def test_a_model_that_runs_only_at_one_falls_back_to_one_with_a_note():
    model = _model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])], [_i64("shape", [16])])
    choice = choose_verify_dims(model, {})
    assert choice.dims == {"n": 1} and "verified at 1" in choice.note
    result = onnxfuse.optimize(model)
    assert result.summary["dims"] == {"n": 1} and any("verified at 1" in n for n in result.notes)


@pytest.mark.parametrize("bad", [dict(baked_heads=True), dict(swapped=True)], ids=["baked", "swapped"])
def test_a_baked_or_swapped_batch_times_heads_is_caught(bad):
    original, wrong = heads_model(), heads_model(**bad)
    # at every dim 1 (the old default), or where batch == seq, the wrong model passes...
    assert verify(original, wrong, {"batch": 1, "seq": 1}).ok
    if "swapped" in bad:
        assert verify(original, wrong, {"batch": 3, "seq": 3}).ok
    # ...at the chosen dims it does not
    choice = choose_verify_dims(original, {})
    assert not all(verify(original, wrong, dims).ok for dims in choice.settings)
    assert not verify(original, wrong, choice.dims).ok


def _corpus_file(name):
    """The materialized corpus model as a plain file: no zoo defaults for its dims."""
    return str(zoo.get(name).path)


def test_dynamo_corpus_model_without_dim_verifies_at_a_sequence_above_one(tmp_path, cli):
    out = tmp_path / "o.onnx"
    result = cli("optimize", _corpus_file("llama_dynamo"), out, "--json")
    assert result.exit_code == 0, result.stderr
    s = json.loads(result.stdout)
    assert s["dims"]["seq"] > 1 and s["dims"]["batch"] > 1 and s["dims"]["seq"] != s["dims"]["batch"]
    assert s["dims_chosen"]["how"] == {"batch": "chosen", "seq": "chosen"}
    v = s["verification"]
    assert v["ok"] and v["dims"] == s["dims"]
    assert [m["dims"] for m in v["more_settings"]] == s["dims_chosen"]["settings"][1:]
    assert all(d["seq"] > 1 for d in s["dims_chosen"]["settings"])
    # the kernel counts come from the run at the same dims
    from onnxfuse.profile import kernel_profile

    assert s["kernels_before"] == kernel_profile(onnx.load(_corpus_file("llama_dynamo")), dims=s["dims"],
                                                 threads=None).kernels_per_inference


def test_decode_model_without_dim_finds_total_is_past_plus_one():
    from onnxfuse.display import dims_chosen_text

    summary = onnxfuse.optimize(_corpus_file("gpt2_decode_ts")).summary
    assert "total=" in dims_chosen_text(summary["dims_chosen"])
    assert "past + 1, found by running the original" in dims_chosen_text(summary["dims_chosen"])
    assert summary["verification"]["ok"] and len(summary["dims_chosen"]["settings"]) == 2
    for dims in summary["dims_chosen"]["settings"]:
        assert dims["total"] == dims["past"] + 1 and dims["past"] > 1 and dims["batch"] > 1


def test_no_verify_counts_kernels_at_the_chosen_dims():
    result = onnxfuse.optimize(heads_model(), verify_outputs=False)
    assert result.summary["dims"]["seq"] > 1 and result.summary["kernels_before"]


def test_probe_rejects_a_run_whose_outputs_do_not_have_their_declared_sizes():
    # runs at mask length 9 with a cache of 3 (broadcast-free) but declares y of length "total"
    model = _model([helper.make_node("Concat", ["past", "x"], ["y"], axis=1),
                    helper.make_node("Identity", ["mask"], ["m"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1]),
                    helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, "past"]),
                    helper.make_tensor_value_info("mask", TensorProto.FLOAT, [2, "total"])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "total"]),
                    helper.make_tensor_value_info("m", TensorProto.FLOAT, [2, "total"])])
    runs = probe_runner(model, model)
    assert not runs({"past": 3, "total": 9}) and runs({"past": 3, "total": 4})


TRANSFORMERS = [m.name for m in zoo.list_models() if m.source == "corpus" and m.family == "transformer"]


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_no_corpus_transformer_is_verified_at_one_without_dim(name):
    """Every unset dim of every corpus transformer (both exporters, the decode steps) gets a
    value above 1, distinct from the others where no relation ties them, at which it runs."""
    from onnxfuse.normalize import normalize

    model = normalize(zoo.resolve_input(_corpus_file(name))).model
    choice = choose_verify_dims(model, {})
    assert choice.note is None
    for dims in choice.settings:
        assert all(v > 1 for v in dims.values()), dims
        assert probe_runner(model, model)(dims)
    tied = {n for n, h in choice.how.items() if "found by running" in h}
    assert len({v for n, v in choice.dims.items() if n not in tied}) == len(choice.dims) - len(tied)


def test_a_model_that_cannot_be_fed_keeps_the_old_default_and_its_own_error():
    model = _model([helper.make_node("Identity", ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["n", 4])],
                   [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["n", 4])])
    choice = choose_verify_dims(model, {})
    assert choice.dims == {"n": 1} and choice.note is None and choice.probes == 1


def test_a_large_model_takes_smaller_values_still_distinct_and_above_one():
    model = decode_model(mask_dim="total", past="past", batch="batch")
    choice = choose_dims(model, {}, runs=probe_runner(model, model), largest=8)
    assert choice.dims == {"batch": 2, "past": 8, "total": 9}  # total = past + 1 over the cap, as found
