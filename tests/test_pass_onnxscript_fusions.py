"""The onnxscript-fusions stage (onnxscript's optimizer and ort_fusions as a pipeline stage) and
the passes that tidy its output (fold-contrib-bias, merge-reshapes, remove-identity-reshape), on
transformer blocks written the way the exporters write them. Every optimized model is checked
against the original in onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxfuse
from onnxfuse.passes import onnxscript_fusions
from test_pass_matmul_batch import assert_same, optimize
from transformer_models import contrib_block, encoder_block, reshape_chain, rotary_block



def contrib_ops(model):
    return sorted(n.op_type for n in model.graph.node if n.domain == "com.microsoft")


def block_feeds(model, seed=0, masked_rows=False):
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((2, 8, 16)).astype(np.float32)}
    if any(i.name == "attention_mask" for i in model.graph.input):
        mask = rng.random((2, 1, 1, 8)) < 0.7
        mask[..., 0] = True
        if masked_rows:
            mask[1] = False  # a whole row masked: the original's NaN-to-zero Where gives 0 there
        feeds["attention_mask"] = mask
    return feeds


@pytest.mark.parametrize("torchscript", [False, True], ids=["dynamo_form", "torchscript_form"])
@pytest.mark.parametrize("mask", [False, True], ids=["no_mask", "padding_mask"])
def test_exported_attention_block_runs_as_contrib_attention_with_fewer_kernels(mask, torchscript):
    m = encoder_block(mask=mask, torchscript=torchscript)
    result = onnxfuse.optimize(m)
    out = result.model
    ops = contrib_ops(out)
    assert "MultiHeadAttention" in ops or "Attention" in ops
    # The residual Add and LayerNormalization stay a Pointwise region and onnxruntime's
    # LayerNormalization: its SkipLayerNormalization kernel is slower on the CPU.
    assert "SkipLayerNormalization" not in ops
    assert any(n.op_type == "LayerNormalization" for n in out.graph.node)
    assert not any(n.op_type in ("Softmax", "Transpose") for n in out.graph.node)
    assert result.summary["kernels_after"] < result.summary["kernels_before"]
    assert_same(m, out, [block_feeds(m, s) for s in range(3)])


@pytest.mark.parametrize("torchscript", [False, True], ids=["dynamo_form", "torchscript_form"])
def test_fully_masked_batch_row_gives_the_originals_zeros(torchscript):
    m = encoder_block(mask=True, torchscript=torchscript)
    out = onnxfuse.optimize(m).model
    assert_same(m, out, [block_feeds(m, 0, masked_rows=True)])


def test_optimizing_the_output_again_changes_nothing():
    first = onnxfuse.optimize(encoder_block(mask=True))
    second = onnxfuse.optimize(first.model)
    assert [n.op_type for n in second.model.graph.node] == [n.op_type for n in first.model.graph.node]
    assert second.summary["kernels_after"] == first.summary["kernels_after"]


def test_stage_leaves_a_graph_it_cannot_improve_alone():
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    out, n = optimize(m, ["onnxscript-fusions"])
    assert n == 0
    assert [(x.name, x.op_type) for x in out.graph.node] == [("relu", "Relu")]


def test_a_group_whose_result_onnxruntime_refuses_is_undone(monkeypatch):
    """A rule that writes a model onnxruntime cannot load (onnxscript 0.7's mha2 on the dynamo
    GPT-2 export writes a Gemm of a 3-D input) leaves the graph as it was before that group."""
    import onnx_ir as ir

    def broken(m):
        node = next(iter(m.graph))
        bad = ir.node("NoSuchOp", inputs=list(node.inputs), domain="com.microsoft")
        m.graph.insert_before(node, bad)
        return 1

    monkeypatch.setattr(onnxscript_fusions, "_groups", lambda target="cpu": [("broken", [broken])])
    m = encoder_block(mask=False)
    out, n = optimize(m, ["onnxscript-fusions"])
    assert n == 0
    assert not contrib_ops(out)


def test_only_the_passes_after_the_stage_without_onnxscript(monkeypatch):
    monkeypatch.setattr(onnxscript_fusions, "_groups", lambda target="cpu": None)
    m = encoder_block(mask=True)
    out, n = optimize(m, ["onnxscript-fusions"])
    assert n == 0 and not contrib_ops(out)


def test_projection_biases_go_into_the_contrib_ops_bias_inputs():
    m = contrib_block()
    out, n = optimize(m, ["fold-contrib-bias"])
    assert n == 2
    assert not any(x.op_type == "Add" for x in out.graph.node)
    mha = next(x for x in out.graph.node if x.op_type == "MultiHeadAttention")
    skip = next(x for x in out.graph.node if x.op_type == "SkipLayerNormalization")
    assert len(mha.input) == 4 and mha.input[3]
    assert len(skip.input) == 5 and skip.input[4]
    rng = np.random.default_rng(1)
    assert_same(m, out, [{"x": rng.standard_normal((2, 8, 16)).astype(np.float32)} for _ in range(2)])


def test_projection_without_a_bias_gets_zeros_in_the_attention_bias():
    m = contrib_block(key_bias=False)
    out, n = optimize(m, ["fold-contrib-bias"])
    assert n == 2
    mha = next(x for x in out.graph.node if x.op_type == "MultiHeadAttention")
    bias = onnx.numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == mha.input[3]))
    assert bias.shape == (48,) and not bias[16:32].any()
    rng = np.random.default_rng(2)
    assert_same(m, out, [{"x": rng.standard_normal((2, 8, 16)).astype(np.float32)}])


def test_graph_without_transformer_forms_skips_the_stage_without_a_session():
    """A Conv network (no attention, normalization, GELU or rotary) costs no onnxscript run and
    no onnxruntime session."""
    from onnxfuse.pipeline import Context, run_passes, select_passes
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    asked = []
    ctx = Context(target="cpu", executed_graph=lambda model: asked.append(model) or model)
    _, stats = run_passes(m, select_passes(["onnxscript-fusions"], "cpu"), ctx)
    assert stats[0].matches == 0 and not asked


def test_bias_read_by_another_node_stays():
    m = contrib_block()
    extra = onnx.helper.make_tensor_value_info("o_lin", onnx.TensorProto.FLOAT, [2, 8, 16])
    m.graph.output.append(extra)
    out, n = optimize(m, ["fold-contrib-bias"])
    assert n == 1  # the attention's q, k, v biases; the output projection's is a graph output
    assert any(x.op_type == "Add" and x.output[0] == "o_lin" for x in out.graph.node)


def test_reshape_back_to_the_input_shape_goes():
    m = reshape_chain()
    out, n = optimize(m, ["merge-reshapes", "remove-identity-reshape"])
    assert n >= 2
    assert [x.op_type for x in out.graph.node] == ["Relu", "Relu"]
    rng = np.random.default_rng(0)
    assert_same(m, out, [{"x": rng.standard_normal((2, 4, 16)).astype(np.float32)}])


def test_reshape_with_a_copied_zero_dim_is_not_merged_through():
    """Reshape(Reshape(x, s1), [0, -1]): the 0 copies the inner Reshape's first dim, not x's."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["r1"]),
        helper.make_node("Reshape", ["r1", "s2"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array([4, 6], np.int64), "s1"),
             numpy_helper.from_array(np.array([0, -1], np.int64), "s2")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 12])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    out, _ = optimize(m, ["merge-reshapes"])
    assert [list(x.input) for x in out.graph.node] == [["x", "s1"], ["r1", "s2"]]
    # The outer Reshape gives r1's own shape: remove-identity-reshape drops it, not the inner one.
    out, n = optimize(m, ["merge-reshapes", "remove-identity-reshape"])
    assert n == 1 and [list(x.input) for x in out.graph.node] == [["x", "s1"]]
    assert_same(m, out, [{"x": np.arange(24, dtype=np.float32).reshape(2, 12)}])


def test_rotary_embedding_with_folded_cos_sin_becomes_one_rotary_op():
    m = rotary_block()
    out, n = optimize(m, ["onnxscript-fusions"])
    assert n > 0
    assert contrib_ops(out) == ["RotaryEmbedding"]
    assert not any(x.op_type in ("Neg", "Concat", "Slice") for x in out.graph.node)
    rng = np.random.default_rng(0)
    assert_same(m, out, [{"x": rng.standard_normal((2, 8, 16)).astype(np.float32)} for _ in range(2)])


def test_rotary_caches_that_are_not_rotate_half_stay_written_out():
    """cos whose halves differ is no rotate-half cache: onnxruntime's op would compute another
    thing, so the written-out form stays."""
    m = rotary_block()
    cos = next(i for i in m.graph.initializer if i.name == "cos")
    value = onnx.numpy_helper.to_array(cos).copy()
    value[..., 0] += 0.5
    cos.CopyFrom(onnx.numpy_helper.from_array(value, "cos"))
    out, _ = optimize(m, ["onnxscript-fusions"])
    assert "RotaryEmbedding" not in contrib_ops(out)
    rng = np.random.default_rng(0)
    assert_same(m, out, [{"x": rng.standard_normal((2, 8, 16)).astype(np.float32)}])


# ---------------------------------------------------------------- --target cuda ------------------


@pytest.mark.parametrize("torchscript", [False, True], ids=["dynamo_form", "torchscript_form"])
def test_on_cuda_the_stage_writes_contrib_attention_only_with_attention_cuda(torchscript):
    m = encoder_block(mask=True, torchscript=torchscript)
    out, n = optimize(m, ["onnxscript-fusions"], target="cuda")
    assert n == 0 and not contrib_ops(out)  # opt-in, as fuse-attention is on cuda
    out, n = optimize(m, ["onnxscript-fusions"], target="cuda", attention_cuda=True)
    ops = contrib_ops(out)
    assert n > 0 and ("MultiHeadAttention" in ops or "Attention" in ops)
    # The attention groups alone: every contrib op written has a float32 CUDA kernel.
    from onnxfuse.cuda.audit import foreign_ops_without_cuda_kernel

    assert set(ops) <= {"MultiHeadAttention", "Attention"} and foreign_ops_without_cuda_kernel(out) == []
    assert not any(x.op_type == "Softmax" for x in out.graph.node)
    assert_same(m, out, [block_feeds(m, 0, masked_rows=True), block_feeds(m, 1)])


def test_on_cuda_the_stage_leaves_rotary_and_normalization_forms_alone():
    m = rotary_block()
    out, n = optimize(m, ["onnxscript-fusions"], target="cuda", attention_cuda=True)
    assert n == 0 and not contrib_ops(out)


def test_on_cuda_grouped_query_attention_is_never_written():
    # GroupQueryAttention's CUDA kernel takes float16 and bfloat16 only (on the CPU fuse-gqa writes
    # it, a cpu-only pass): the float32 LLaMA-style decoder of the corpus gets MultiHeadAttention
    # over its repeated key/value heads on cuda instead.
    from onnxfuse import zoo
    from onnxfuse.cuda.audit import foreign_ops_without_cuda_kernel

    from onnxfuse.pipeline import Context, PassOptions, run_passes, select_passes

    def stage(target):
        ctx = Context(target=target, options=PassOptions(attention_cuda=True))
        out, stats = run_passes(zoo.get("llama_dynamo").load(), select_passes(["onnxscript-fusions"], target), ctx)
        return out, stats[0].matches

    out, n = stage("cuda")
    assert n > 0 and contrib_ops(out) == ["MultiHeadAttention"] * 2
    assert foreign_ops_without_cuda_kernel(out) == []


def test_on_cuda_an_optimized_model_with_stored_kernels_skips_the_stage():
    import onnx_graphsurgeon as gs

    from onnxfuse.pipeline import Context, PassOptions

    m = encoder_block(mask=True)
    graph = gs.import_onnx(m)
    graph.nodes[0].attrs["cuda_cubin"] = b"\x7fELF\xff"  # what cuda-compile stores, not text
    asked = []
    ctx = Context(target="cuda", options=PassOptions(attention_cuda=True),
                  executed_graph=lambda model: asked.append(model) or model)
    assert onnxscript_fusions.onnxscript_fusions(graph, ctx) == 0 and not asked
    del graph.nodes[0].attrs["cuda_cubin"]  # the same graph before cuda-compile: the stage runs
    assert onnxscript_fusions.onnxscript_fusions(graph, ctx) > 0 and asked


def _mlp_with_layernorm():
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    s = numpy_helper.from_array(np.ones(8, np.float32), "s")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("LayerNormalization", ["r", "s"], ["y"], axis=-1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [w, s])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_stage_asks_onnxruntime_nothing_when_no_group_rewrites():
    """Before: the input and the prepared graph were each loaded in an onnxruntime session
    (GPT-2 small: about a second each, every round) before any group had rewritten anything."""
    from onnxfuse.pipeline import Context, run_passes, select_passes

    asked = []
    ctx = Context(target="cpu", executed_graph=lambda model: asked.append(model) or model)
    _, stats = run_passes(_mlp_with_layernorm(), select_passes(["onnxscript-fusions"], "cpu"), ctx)
    assert stats[0].matches == 0 and not asked


def test_a_kept_group_is_counted_against_the_input_and_the_prepared_graph(torchscript=False):
    from onnxfuse.pipeline import Context, run_passes, select_passes
    from onnxfuse.runtime import executed_graph

    asked = []

    def counting(model):
        asked.append(len(model.graph.node))
        return executed_graph(model)

    ctx = Context(target="cpu", executed_graph=counting)
    out, stats = run_passes(encoder_block(mask=True), select_passes(["onnxscript-fusions"], "cpu"), ctx)
    assert contrib_ops(out) and stats[0].matches
    # round 1: the input, the prepared graph, each group that rewrote; round 2: nothing rewrote
    assert 3 <= len(asked) <= 2 + len(onnxscript_fusions._groups()), asked


def test_onnxscript_rules_are_asked_only_at_nodes_of_their_root_op():
    """Before: onnxscript asked every rule at every node (GPT-2 small: 400,000 asks in the stage,
    most of its time); the answer at a node of another op type is known without the matcher."""
    import onnx_ir as ir
    from onnxscript.rewriter import _matcher, pattern

    from onnxfuse.graph.onnxscript_matching import linear_matching

    def add_zero(op, x):
        return op.Add(x, op.Constant(value_float=0.0))

    rule = pattern.RewriteRule(add_zero, lambda op, x: op.Identity(x))
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(50)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("t50", TensorProto.FLOAT, [4])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    calls = []
    original = _matcher.SimplePatternMatcher.match

    def counted(self, *a, **k):
        calls.append(1)
        return original(self, *a, **k)

    _matcher.SimplePatternMatcher.match = counted
    try:
        assert pattern.RewriteRuleSet([rule]).apply_to_model(ir.from_proto(model)) == 0
        unfiltered = len(calls)
        calls.clear()
        with linear_matching():
            assert pattern.RewriteRuleSet([rule]).apply_to_model(ir.from_proto(model)) == 0
    finally:
        _matcher.SimplePatternMatcher.match = original
    assert unfiltered == 50 and not calls
