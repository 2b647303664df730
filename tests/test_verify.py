"""Verification: seeded inputs of the declared shapes, per-dtype comparison, and the CLI refusing
to write a model that does not match its original."""
from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import SENTINEL, shift_first_constant, stderr_lines, use_only_passes
from onnxfuse import pipeline
from onnxfuse.runtime import make_session
from onnxfuse.compare import TOLERANCES, compare_output
from onnxfuse.inputs import random_inputs
from onnxfuse.verify import verify


def gather_model():
    """Embedding lookup: table float[10, 4], ids int64[batch, 5], plus a bool mask input."""
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0),
            helper.make_node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["maskf", "axes"], ["mask3"]),
            helper.make_node("Mul", ["emb", "mask3"], ["y"]),
        ],
        "gather",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 5]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["batch", 5]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5, 4])],
        [
            numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table"),
            numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_random_inputs_are_seeded_and_take_declared_and_given_shapes():
    model = gather_model()
    a = random_inputs(model, {"batch": 3}, seed=5)
    b = random_inputs(model, {"batch": 3}, seed=5)
    c = random_inputs(model, {"batch": 3}, seed=6)
    assert a["ids"].shape == (3, 5) and a["ids"].dtype == np.int64
    assert a["mask"].shape == (3, 5) and a["mask"].dtype == np.bool_
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["ids"], c["ids"]) or not np.array_equal(a["mask"], c["mask"])
    assert random_inputs(model)["ids"].shape == (1, 5)  # symbolic dims default to 1


def test_integer_inputs_used_as_gather_indices_stay_within_the_table():
    model = gather_model()
    for seed in range(20):
        ids = random_inputs(model, {"batch": 8}, seed)["ids"]
        assert ids.min() >= 0 and ids.max() < 10
    seen = np.concatenate([random_inputs(model, {"batch": 8}, s)["ids"].ravel() for s in range(20)])
    assert seen.max() >= 5  # the whole table is used, not only the small default range
    feeds = random_inputs(model, {"batch": 2}, 0)
    make_session(model).run(None, feeds)


def test_float_outputs_compare_within_dtype_tolerance_and_fail_beyond():
    atol, rtol = TOLERANCES[TensorProto.FLOAT]
    ref = np.linspace(-3, 3, 100, dtype=np.float32)
    assert compare_output("y", TensorProto.FLOAT, ref, ref + np.float32(atol / 2)).ok
    bad = ref.copy()
    bad[7] += 0.5
    check = compare_output("y", TensorProto.FLOAT, ref, bad)
    assert not check.ok and check.mismatched == 1 and check.max_abs == pytest.approx(0.5, rel=1e-5)
    assert "1 of 100 values" in check.problem


def test_error_relative_to_the_outputs_scale_stays_small_at_a_zero_crossing():
    """An element near zero makes the elementwise relative error large; relative to the
    output's largest value the same error is small."""
    ref = np.array([-4.0, 1e-6, 2.0, 8.0], dtype=np.float32)
    out = ref + np.array([0, 4e-6, 0, 0], dtype=np.float32)
    check = compare_output("y", TensorProto.FLOAT, ref, out)
    assert check.ok
    assert check.max_rel > 0.03
    assert check.norm_rel == pytest.approx(check.max_abs / 8.0)
    assert check.norm_rel < 1e-6
    assert compare_output("y", TensorProto.FLOAT, np.zeros(3, np.float32), np.zeros(3, np.float32)).norm_rel == 0


def test_half_precision_gets_a_wider_tolerance_than_single():
    ref = np.linspace(1, 2, 50).astype(np.float16)
    off = (ref.astype(np.float32) * 1.004).astype(np.float16)
    assert compare_output("h", TensorProto.FLOAT16, ref, off).ok
    assert not compare_output("f", TensorProto.FLOAT, ref.astype(np.float32), off.astype(np.float32)).ok


def test_nan_shape_and_integer_differences_are_mismatches():
    ref = np.array([1.0, np.nan, 3.0], dtype=np.float32)
    assert compare_output("y", TensorProto.FLOAT, ref, ref.copy()).ok  # NaN where NaN is expected
    assert "NaN" in compare_output("y", TensorProto.FLOAT, ref, np.array([1, 2, 3], np.float32)).problem
    assert "shape" in compare_output("y", TensorProto.FLOAT, ref, ref[:2]).problem
    ints = np.array([1, 2, 3], dtype=np.int64)
    assert compare_output("i", TensorProto.INT64, ints, ints.copy()).ok
    assert not compare_output("i", TensorProto.INT64, ints, ints + np.array([0, 0, 1])).ok


def test_verify_reports_the_mismatching_output():
    from conftest import pointwise_chain_model

    original = pointwise_chain_model()
    broken = pointwise_chain_model()
    w = numpy_helper.to_array(broken.graph.initializer[0]) + np.float32(1)
    broken.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "w"))
    result = verify(original, original, {"batch": 2})
    assert result.ok and result.max_abs == 0
    result = verify(original, broken, {"batch": 2})
    assert not result.ok
    assert result.first_problem().startswith("output 'y'")
    assert result.original_profile.kernels_per_inference == 3


def test_cli_refuses_to_write_a_broken_optimized_model(chain_path, sentinel_out, cli, monkeypatch):
    breaker = pipeline.Pass("test-shift-constant", 1, "adds 1 to a constant (wrong on purpose)", shift_first_constant)
    use_only_passes(monkeypatch, breaker)
    result = cli("optimize", chain_path, sentinel_out, "--dim", "batch=4")
    lines = stderr_lines(result)
    assert result.exit_code == 1, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("onnxfuse: verification failed: output 'y'")
    assert "max abs error" in lines[0] and f"{sentinel_out} not written" in lines[0]
    assert sentinel_out.read_bytes() == SENTINEL

    # The same rewrite is written when verification is switched off: verify is what stops it.
    result = cli("optimize", chain_path, sentinel_out, "--no-verify")
    assert result.exit_code == 0, result.stderr
    assert onnx.load(str(sentinel_out)).graph.node


def test_cli_accepts_a_rewrite_within_tolerance(chain_path, tmp_path, cli, monkeypatch):
    nudge = pipeline.Pass("test-nudge-constant", 1, "adds 1e-7 to a constant",
                          functools.partial(shift_first_constant, amount=1e-7))
    use_only_passes(monkeypatch, nudge)
    result = cli("optimize", chain_path, tmp_path / "o.onnx", "--dim", "batch=4")
    assert result.exit_code == 0, result.stderr
    assert "verified" in result.stdout


def test_cli_refuses_an_optimized_model_onnxruntime_cannot_run(chain_path, sentinel_out, cli, monkeypatch):
    def corrupt(graph, ctx):
        graph.nodes[1].op = "NoSuchOp"
        return 1

    use_only_passes(monkeypatch, pipeline.Pass("test-corrupt", 1, "unknown op (wrong on purpose)", corrupt))
    result = cli("optimize", chain_path, sentinel_out)
    assert result.exit_code == 1
    assert "onnxruntime cannot run the optimized model" in result.stderr
    assert sentinel_out.read_bytes() == SENTINEL


def _unary_model(nodes, out="y"):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, [64])],
                              [numpy_helper.from_array(np.array(1e30, np.float32), "big")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_special_inputs_are_seeded_and_hold_special_values_at_a_few_positions():
    from onnxfuse.inputs import SPECIAL_POSITIONS, special_inputs, special_values

    feeds = {"x": np.ones((4, 16), np.float32), "i": np.arange(3, dtype=np.int64)}
    a, count = special_inputs(feeds, seed=3)
    b, _ = special_inputs(feeds, seed=3)
    assert count == SPECIAL_POSITIONS
    np.testing.assert_array_equal(a["x"], b["x"])
    np.testing.assert_array_equal(a["i"], feeds["i"])
    changed = a["x"].reshape(-1) != 1
    assert changed.sum() == SPECIAL_POSITIONS
    specials = special_values(np.float32)
    assert all(np.isnan(v) or v in specials for v in a["x"].reshape(-1)[changed])
    assert (feeds["x"] == 1).all(), "the caller's inputs were changed"


def test_outputs_with_nan_and_infinity_from_special_inputs_still_verify():
    # log(x) and 1 / x: NaN and infinities at the special positions, in both models alike.
    model = _unary_model([helper.make_node("Log", ["x"], ["l"]), helper.make_node("Reciprocal", ["l"], ["y"])])
    result = verify(model, model)
    assert result.ok, result.first_problem()
    assert result.special is not None and result.special_positions > 0
    assert result.as_dict()["special_values"]["ok"]


def test_special_values_run_in_the_sessions_the_profiled_runs_opened(monkeypatch):
    """Before: the original and the optimized model each got a session of their own for the
    special-value runs (at 25,000 nodes 2.5 of verification's 15 s went to creating them)."""
    import onnxruntime as ort

    model = _unary_model([helper.make_node("Log", ["x"], ["l"]), helper.make_node("Reciprocal", ["l"], ["y"])])
    opened = []
    real = ort.InferenceSession.__init__
    monkeypatch.setattr(ort.InferenceSession, "__init__", lambda self, *a, **k: opened.append(1) or real(self, *a, **k))
    result = verify(model, model)
    assert result.ok and result.special is not None and result.special_positions > 0
    assert len(opened) == 2  # the original's profiled run and the optimized model's


def test_a_difference_only_special_values_show_fails_verification():
    # min(x, 1e30) and x agree on every ordinary input; at +inf one gives 1e30, the other inf.
    original = _unary_model([helper.make_node("Min", ["x", "big"], ["y"])])
    wrong = _unary_model([helper.make_node("Identity", ["x"], ["y"])])
    for seed in range(4):
        result = verify(original, wrong, seed=seed)
        assert all(r.ok for r in result.runs)  # the ordinary inputs cannot tell them apart
        if not result.ok:
            assert "special values" in result.first_problem() and "infinity" in result.first_problem()
            return
    pytest.fail("no seed salted a +inf into the input")


def test_verification_sessions_use_the_weights_without_packing_a_copy(monkeypatch):
    """Before: every verification session packed the MatMul weights into a second copy: 9.6-14 s
    of making each of the three sessions of TinyLlama-1.1B's decode step, and twice the weights
    in memory (bench/results/verify_prepacking.md). Kernel counts come from the same sessions,
    so they stay those of a packing session."""
    from onnxfuse import runtime

    asked = []
    made = runtime.session_options

    def packs(so) -> bool:
        try:
            return so.get_session_config_entry("session.disable_prepacking") != "1"
        except RuntimeError:  # an entry never set: onnxruntime's default, packing
            return True

    def recording(*args, **kwargs):
        so = made(*args, **kwargs)
        asked.append(not packs(so))
        return so

    monkeypatch.setattr(runtime, "session_options", recording)
    weight = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = verify(model, model)
    assert result.ok
    assert asked and all(asked), asked
    assert result.original_profile.by_op_type.get("MatMul") == 1
    # Other sessions keep onnxruntime's default: packing pays over many runs.
    assert packs(made(with_library=False))
