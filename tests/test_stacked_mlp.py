"""onnxfuse.StackedMLP: batch-ensemble's CPU fused op. The native kernel against numpy and
against its own fallback function, in both builds; when the pass emits it and when not."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxfuse import runtime
from onnxfuse.ops.stacked_mlp import MAX_BATCH as STACKED_MLP_MAX_BATCH
from onnxfuse.ops.stacked_mlp import pack_panels
from test_pass_matmul_batch import F, assert_same, drop_final_concat, ensemble_model, ops, optimize, x_feeds


def stacked(model):
    return [n for n in model.graph.node if n.domain == "onnxfuse" and n.op_type == "StackedMLP"]


def reference(k, d, hidden, out, act, x):
    """numpy evaluation of ensemble_model's members, concatenated (same seed and weights); `act`
    is the model's activation op, or a function applied in its place."""
    m = ensemble_model(k=k, d=d, hidden=hidden, out=out, act=act if isinstance(act, str) else "Relu")
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    f = act if callable(act) else {"Relu": lambda v: np.maximum(v, 0), "Tanh": np.tanh,
                                   "Sigmoid": lambda v: 1 / (1 + np.exp(-v))}[act]
    cols = []
    for b in range(k):
        cur = x.astype(np.float64)
        for layer in range(3):
            w = inits[f"w{b}_{layer}"].astype(np.float64)
            w = w.T if b % 2 else w
            cur = cur @ w + inits[f"b{b}_{layer}"]
            if layer < 2:
                cur = f(cur)
        cols.append(cur)
    return np.concatenate(cols, axis=1)


@pytest.mark.parametrize("no_avx2", [False, True])
@pytest.mark.parametrize("act", ["Relu", "Tanh", "Sigmoid"])
@pytest.mark.parametrize("k,d,hidden,out", [(4, 8, 12, 3), (3, 37, 48, 17), (8, 64, 128, 10)])
def test_kernel_matches_numpy_and_the_fallback_at_every_batch(k, d, hidden, out, act, no_avx2, monkeypatch):
    if no_avx2:
        monkeypatch.setenv("ONNXFUSE_NO_AVX2", "1")
    m = ensemble_model(k=k, d=d, hidden=hidden, out=out, act=act)
    opt, n = optimize(m, ["batch-ensemble"])
    assert n == 1 and len(stacked(opt)) == 1 and ops(opt) == ["StackedMLP"]
    for batch in (1, 2, 4, 5, 9, 70):  # every row-block shape: 6-row blocks, then 1-5 rows
        x = np.random.default_rng(batch).standard_normal((batch, d)).astype(np.float32)
        want = reference(k, d, hidden, out, act, x)
        for threads in (1, 2):
            got = runtime.make_session(opt, threads=threads, with_library=True).run(None, {"x": x})[0]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        fallback = runtime.make_session(opt, threads=1, with_library=False).run(None, {"x": x})[0]
        np.testing.assert_allclose(fallback, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_shape_reading_without_the_reference_api_gives_the_same_results(monkeypatch):
    # onnxruntime before C API 24 has no GetTensorElementTypeAndShapeDataReference; the kernel then
    # copies shapes out through GetTensorTypeAndShape (forced here by the environment switch).
    opt, _ = optimize(ensemble_model(k=3, d=37, hidden=48, out=17), ["batch-ensemble"])
    x = np.random.default_rng(3).standard_normal((5, 37)).astype(np.float32)
    fast = runtime.make_session(opt, threads=1, with_library=True).run(None, {"x": x})[0]
    monkeypatch.setenv("ONNXFUSE_NO_SHAPE_REFERENCE", "1")
    legacy = runtime.make_session(opt, threads=1, with_library=True).run(None, {"x": x})[0]
    np.testing.assert_array_equal(fast, legacy)


def test_a_weight_not_packed_in_panels_is_a_clear_run_error():
    opt, _ = optimize(ensemble_model(), ["batch-ensemble"])
    node = stacked(opt)[0]
    weight = next(t for t in opt.graph.initializer if t.name == node.input[3])  # layer 2's packed weight
    w = onnx.numpy_helper.to_array(weight)
    weight.CopyFrom(onnx.numpy_helper.from_array(w.reshape(*w.shape[:3], 2, 8)[..., 0, :].copy(), weight.name))
    with pytest.raises(Exception, match="weight of layer 2 must be packed as"):
        runtime.make_session(opt, threads=1, with_library=True).run(None, x_feeds(8, batches=(1,))[0])


def test_weights_are_packed_in_16_column_panels_zero_padded():
    w = np.arange(2 * 3 * 20, dtype=np.float32).reshape(2, 3, 20)
    p = pack_panels(w)
    assert p.shape == (2, 2, 3, 16)
    np.testing.assert_array_equal(p[1, 0, 2], w[1, 2, :16])
    np.testing.assert_array_equal(p[1, 1, 2, :4], w[1, 2, 16:])
    assert not p[:, 1, :, 4:].any()


def test_batch_rule_reads_static_declared_and_default_batches():
    # static above the limit: not fused; symbolic: the declared value, or 1
    big = STACKED_MLP_MAX_BATCH + 1
    assert not stacked(optimize(ensemble_model(batch=big), ["batch-ensemble"])[0])
    assert stacked(optimize(ensemble_model(batch=STACKED_MLP_MAX_BATCH), ["batch-ensemble"])[0])
    assert stacked(optimize(ensemble_model(batch="B"), ["batch-ensemble"])[0])
    assert not stacked(optimize(ensemble_model(batch="B"), ["batch-ensemble"], dims={"B": big})[0])


def test_cuda_target_keeps_the_stacked_standard_ops():
    opt, n = optimize(ensemble_model(), ["batch-ensemble"], target="cuda")
    assert n == 1 and not stacked(opt)


def test_members_not_concatenated_get_a_split_after_the_fused_op():
    m = ensemble_model(k=3)
    m.graph.output.extend([helper.make_tensor_value_info(n, F, ["B", 3]) for n in drop_final_concat(m)])
    opt, n = optimize(m, ["batch-ensemble"])
    assert n == 1 and ops(opt) == ["StackedMLP", "Split"]
    assert_same(m, opt, x_feeds(8, batches=(1, 5)))
    got = runtime.make_session(opt, threads=1, with_library=True).run(None, x_feeds(8, batches=(5,))[0])
    want = runtime.make_session(m, threads=1, with_library=False).run(None, x_feeds(8, batches=(5,))[0])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_an_unknown_activation_is_a_clear_session_error():
    opt, _ = optimize(ensemble_model(), ["batch-ensemble"])
    node = stacked(opt)[0]
    next(a for a in node.attribute if a.name == "activations").s = b"relu,gelu,none"
    with pytest.raises(Exception, match="activation 'gelu': .*unknown op 'gelu'"):
        runtime.make_session(opt, threads=1, with_library=True).run(None, x_feeds(8, batches=(1,))[0])


def test_an_activation_with_parameters_runs_as_its_program_instruction():
    # The `activations` attribute takes any unary op of the expression program, in its syntax.
    opt, _ = optimize(ensemble_model(k=3, d=37, hidden=48, out=17), ["batch-ensemble"])
    next(a for a in stacked(opt)[0].attribute if a.name == "activations").s = b"leakyrelu[0.25],leakyrelu[0.25],none"
    x = np.random.default_rng(4).standard_normal((5, 37)).astype(np.float32)
    got = runtime.make_session(opt, threads=1, with_library=True).run(None, {"x": x})[0]
    want = reference(3, 37, 48, 17, lambda v: np.where(v < 0, 0.25 * v, v), x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_member_output_that_is_also_a_graph_output_stays_produced():
    # fuzz seed 2889: the final Concat was replaced, and the member output it read (also a graph
    # output) was left without a producer
    m = ensemble_model(k=3)
    concat = next(n for n in m.graph.node if n.op_type == "Concat")
    m.graph.output.extend([helper.make_tensor_value_info(concat.input[1], F, ["B", 3])])
    for target in ("cpu", "cuda"):
        opt, n = optimize(m, ["batch-ensemble"], target=target)
        assert n == 1
        assert_same(m, opt, x_feeds(8, batches=(1, 4)))


def test_split_pieces_are_read_in_place_in_the_first_run():
    # fuzz seed 121: the fused op's output had no shape, so the pointwise pass could read the
    # Split pieces in place only when the model was optimized a second time
    from onnxfuse.pipeline import Context, run_passes, select_passes

    m = ensemble_model(k=2)
    g = m.graph
    for i, name in enumerate(drop_final_concat(m)):  # different ops: not one more lockstep layer
        g.node.append(helper.make_node(["Tanh", "Sigmoid"][i], [name], [f"t{i}"]))
        g.output.append(helper.make_tensor_value_info(f"t{i}", F, ["B", 3]))
    once, _ = run_passes(m, select_passes(None, "cpu"), Context(target="cpu"))
    twice, _ = run_passes(once, select_passes(None, "cpu"), Context(target="cpu"))
    assert ops(once) == ops(twice) and "Split" not in ops(once), ops(once)
