"""The differential fuzzer: seeded random graphs optimized and compared with the original in
onnxruntime, with and without our library (onnxfuse.fuzz). CI runs 1,000 seeded cases (marked
slow, in chunks of 100); `python -m onnxfuse.fuzz --cases 50000` is the long run
(bench/results/fuzz.md records it)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import shift_first_constant, use_only_passes
from onnxfuse import fuzz
from onnxfuse.pipeline import Pass

CI_CASES = 1000
CHUNK = 100


@pytest.mark.slow
@pytest.mark.parametrize("first", range(0, CI_CASES, CHUNK))
def test_seeded_fuzz_cases_match_the_original(first):
    failures = [m for m in (fuzz.check_case(s) for s in range(first, first + CHUNK)) if m]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("first", range(fuzz.LATER_MOTIFS_SEED, fuzz.LATER_MOTIFS_SEED + 300, CHUNK))
def test_seeded_fuzz_cases_with_the_later_motifs_match_the_original(first):
    failures = [m for m in (fuzz.check_case(s) for s in range(first, first + CHUNK)) if m]
    assert not failures, "\n".join(failures)


def test_later_motifs_appear_only_from_their_first_seed():
    def ops(seeds):
        return {n.op_type for s in seeds for n in fuzz.build_case(s).model.graph.node}

    assert "Gather" not in ops(range(0, 200))
    assert "Gather" in ops(range(fuzz.LATER_MOTIFS_SEED, fuzz.LATER_MOTIFS_SEED + 200))


def test_fuzz_smoke_cases_match_the_original():
    # Seeds far from the CI range: a quick sample in every run.
    failures = [m for m in (fuzz.check_case(s) for s in range(10**6, 10**6 + 25)) if m]
    assert not failures, "\n".join(failures)


def test_cases_are_determined_by_the_seed():
    a, b = fuzz.build_case(123), fuzz.build_case(123)
    assert a.model.SerializeToString() == b.model.SerializeToString()
    assert all(np.array_equal(a.feeds[k], b.feeds[k]) for k in a.feeds)
    assert fuzz.build_case(124).model.SerializeToString() != a.model.SerializeToString()


def test_generator_covers_the_issue_space():
    """Over 300 seeds the generator makes every kind of case the fuzzer is meant to try."""
    seen_ops, dtypes, flags = set(), set(), set()
    for seed in range(300):
        case = fuzz.build_case(seed)
        g = case.model.graph
        seen_ops |= {n.op_type for n in g.node}
        dtypes.add(case.dtype)
        shapes = [[d for d in i.type.tensor_type.shape.dim] for i in g.input]
        if any(d.dim_param for s in shapes for d in s):
            flags.add("symbolic")
        if any(not d.dim_param and not d.HasField("dim_value") for s in shapes for d in s):
            flags.add("unknown dim")
        if any(0 in v.shape for v in case.feeds.values()):
            flags.add("zero-size")
        if len(g.output) > 1:
            flags.add("several outputs")
        produced_and_read = {i for n in g.node for i in n.input} & {o.name for o in g.output}
        if produced_and_read:
            flags.add("intermediate output")
        for n in g.node:
            if n.op_type == "Slice" and len(n.input) == 5:
                flags.add("sliced with step")
            if n.op_type == "Cast":
                flags.add(f"cast to {onnx.TensorProto.DataType.Name(n.attribute[0].i)}")
    for op in ("Slice", "Split", "Concat", "Conv", "BatchNormalization", "MatMul", "Where", "If", "Loop",
               "Scan", "Cast", "Pow", "PRelu", "Equal", "Not"):
        assert op in seen_ops, op
    assert {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE} <= dtypes
    for flag in ("symbolic", "unknown dim", "zero-size", "several outputs", "intermediate output",
                 "sliced with step", "cast to FLOAT16", "cast to BFLOAT16", "cast to BOOL", "cast to INT32"):
        assert flag in flags, flag


def test_a_wrong_rewrite_is_reported_as_a_failure(monkeypatch):
    """The fuzzer can fail: a pass that shifts a constant makes the cases that have one fail."""
    use_only_passes(monkeypatch, Pass("shift-constant", 1, "deliberately wrong", shift_first_constant))
    results = [fuzz.run_case(s, idempotence=False) for s in range(40)]
    failed = [r for r in results if r.status == "fail"]
    assert len(failed) >= 10
    assert all("differs" in r.message or "does not run" in r.message for r in failed)


def _tanh_tie_model():
    """Equal(|x|, tanh(x)): for tiny x the two sides are one ulp apart (or equal)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Tanh", ["x"], ["t"]),
             helper.make_node("Equal", ["a", "t"], ["y"])]
    graph = helper.make_graph(nodes, "tie", [x], [helper.make_tensor_value_info("y", TensorProto.BOOL, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_near_tie_is_detected_only_near_the_jump():
    model = _tanh_tie_model()
    assert fuzz.near_tie(model, {"x": np.array([1.7e-4, 2.6e-4, 0.5, -1], np.float32)}, TensorProto.FLOAT)
    assert not fuzz.near_tie(model, {"x": np.array([0.3, 0.5, -0.7, 2], np.float32)}, TensorProto.FLOAT)


def test_casts_near_a_rounding_boundary_are_near_ties():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    for to, tie, clear in ((TensorProto.INT32, 3.0000001, 3.5), (TensorProto.FLOAT16, 1 + 2**-11, 1 + 2**-10),
                           (TensorProto.BOOL, 1e-9, 0.5)):
        graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=to)], "cast", [x],
                                  [helper.make_tensor_value_info("y", to, [2])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 10
        assert fuzz.near_tie(model, {"x": np.array([tie, clear], np.float32)}, TensorProto.FLOAT), to
        assert not fuzz.near_tie(model, {"x": np.array([clear, clear], np.float32)}, TensorProto.FLOAT), to


def test_compare_is_exact_for_bool_and_integer_outputs():
    ref = {"b": np.array([True, False]), "i": np.array([1, 2], np.int32)}
    assert fuzz.compare(ref, dict(ref)) is None
    assert "differs" in fuzz.compare(ref, {"b": np.array([True, True]), "i": ref["i"]})
    assert "shape/dtype" in fuzz.compare(ref, {"b": ref["b"], "i": ref["i"].astype(np.int64)})
    f = {"y": np.array([1.0, np.nan], np.float32)}
    assert fuzz.compare(f, {"y": np.array([1.00001, np.nan], np.float32)}) is None
    assert fuzz.compare(f, {"y": np.array([1.01, np.nan], np.float32)}) is not None


def test_an_ill_conditioned_mismatch_is_excused_only_when_as_accurate_as_onnxruntime():
    """Selu(x)/x near 0 magnifies last-ulp differences of exp: a result as close to the float64
    truth as onnxruntime's own is excused; a result farther from it is not."""
    from onnx import TensorProto, helper

    from onnxfuse.fuzz import _run, as_accurate_as_onnxruntime

    g = helper.make_graph(
        [helper.make_node("Selu", ["x"], ["s"]), helper.make_node("Div", ["s", "x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    feeds = {"x": -np.geomspace(1e-6, 1e-3, 64).astype(np.float32)}
    ref = _run(model, feeds, with_library=False, level="disable")
    exact = 1.0507009873554805 * 1.6732632423543772 * np.expm1(feeds["x"].astype(np.float64)) / feeds["x"]
    assert as_accurate_as_onnxruntime(model, feeds, ref, {"y": exact.astype(np.float32)})
    off = exact.astype(np.float32) * np.float32(1.2)  # onnxruntime itself is ~1% off here
    assert not as_accurate_as_onnxruntime(model, feeds, ref, {"y": off})


def test_nan_is_judged_against_the_float64_result():
    """Ours may be NaN where the exact result is NaN even if onnxruntime's is not (seed 25019:
    onnxruntime's double Sigmoid flushes 1e-32 to 0, so its Pow gives 1 where the truth is NaN),
    but never NaN where onnxruntime's output is right and finite."""
    from onnx import TensorProto, helper

    from onnxfuse.fuzz import as_accurate_as_onnxruntime

    g = helper.make_graph([helper.make_node("Sqrt", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.array([-1.0, 4.0], np.float32)}
    onnxruntime_wrong = {"y": np.array([1.0, 2.0], np.float32)}
    assert as_accurate_as_onnxruntime(model, feeds, onnxruntime_wrong, {"y": np.array([np.nan, 2.0], np.float32)})
    onnxruntime_right = {"y": np.array([np.nan, 2.0], np.float32)}
    assert not as_accurate_as_onnxruntime(model, feeds, onnxruntime_right, {"y": np.array([np.nan, np.nan], np.float32)})
