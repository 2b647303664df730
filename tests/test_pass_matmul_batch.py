"""batch-sibling-matmul, merge-xh-matmul and batch-ensemble: what they match, what they leave
alone, and that the rewritten models compute the same values in onnxruntime."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.pipeline import Context, PassOptions, run_passes, select_passes

MODELS = Path(__file__).resolve().parent.parent / "models"
F = TensorProto.FLOAT


def model(nodes, inits, inputs, outputs, opset=17):
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(i[0], i[2] if len(i) > 2 else F, i[1]) for i in inputs],
        [helper.make_tensor_value_info(n, F, s) for n, s in outputs],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m


def optimize(m, names, target="cpu", **options):
    """Run the named passes; unless `pipeline` says otherwise, they decide as they would inside
    the default pipeline (where the pointwise pass follows them)."""
    options = {"pipeline": [p.name for p in select_passes(None, target)], **options}
    ctx = Context(target=target, options=PassOptions.from_mapping(options))
    out, stats = run_passes(m, select_passes(names, target), ctx)
    onnx.checker.check_model(out)
    return out, sum(s.matches for s in stats)


def run(m, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def assert_same(original, optimized, feeds_list):
    for feeds in feeds_list:
        for ref, got in zip(run(original, feeds), run(optimized, feeds)):
            assert got.shape == ref.shape
            scale = max(float(np.max(np.abs(ref))), 1e-30)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale)


def ops(m):
    return [n.op_type for n in m.graph.node]


def rng_arrays(seed, *shapes):
    r = np.random.default_rng(seed)
    return [r.standard_normal(s).astype(np.float32) for s in shapes]


def x_feeds(d, batches=(1, 3, 8), name="x"):
    return [{name: np.random.default_rng(b).standard_normal((b, d)).astype(np.float32)} for b in batches]


SIBLINGS = ["batch-sibling-matmul"]


# batch-sibling-matmul ---------------------------------------------------------------------------


def test_gemm_and_matmul_siblings_with_all_gemm_attributes_become_one_matmul():
    w0, w1, w2, c1, b2, w3 = rng_arrays(0, (16, 8), (5, 16), (16, 7), (5,), (7,), (16, 3))
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["y0"]),
        helper.make_node("Gemm", ["x", "w1", "c1"], ["y1"], transB=1, alpha=0.5, beta=2.0),
        helper.make_node("MatMul", ["x", "w2"], ["m2"]),
        helper.make_node("Add", ["b2", "m2"], ["y2"]),  # bias on the left
        helper.make_node("Gemm", ["x", "w3"], ["y3"], alpha=-1.5),
    ]
    outs = [("y0", [4, 8]), ("y1", [4, 5]), ("y2", [4, 7]), ("y3", [4, 3])]
    m = model(nodes, dict(w0=w0, w1=w1, w2=w2, c1=c1, b2=b2, w3=w3), [("x", [4, 16])], outs)
    opt, n = optimize(m, SIBLINGS)
    assert n == 1
    assert ops(opt).count("MatMul") == 1 and "Gemm" not in ops(opt)
    assert ops(opt).count("Split") == 1
    assert [o.name for o in opt.graph.output] == ["y0", "y1", "y2", "y3"]
    assert_same(m, opt, x_feeds(16, batches=(4,)))


def test_split_copy_with_a_dynamic_or_large_batch_is_not_applied():
    # Graph outputs need real tensors: the Split copy grows with the batch (slower at 64 rows).
    w = rng_arrays(20, (16, 8), (16, 8), (16, 8))
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(3)]
    inits = {f"w{i}": w[i] for i in range(3)}
    for batch in ("B", 64):
        m = model(nodes, inits, [("x", [batch, 16])], [(f"y{i}", [batch, 8]) for i in range(3)])
        _, n = optimize(m, SIBLINGS)
        assert n == 0


def test_common_activation_is_applied_once_on_the_batched_output():
    w = rng_arrays(1, (8, 4), (8, 4), (8, 4))
    b = rng_arrays(2, (4,), (4,), (4,))
    nodes = []
    for i in range(3):
        nodes += [
            helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"r{i}"]),
            helper.make_node("MatMul", [f"r{i}", "v"], [f"y{i}"]),
        ]
    inits = {f"w{i}": w[i] for i in range(3)} | {f"b{i}": b[i] for i in range(3)} | {"v": rng_arrays(3, (4, 2))[0]}
    m = model(nodes, inits, [("x", [2, 8])], [(f"y{i}", [2, 2]) for i in range(3)])
    opt, _ = optimize(m, SIBLINGS)
    assert ops(opt).count("Relu") == 1 and ops(opt).count("Add") == 1
    assert_same(m, opt, x_feeds(8, batches=(2,)))


def test_rank3_input_keeps_the_bias_add_and_matches():
    w0, w1, b0 = rng_arrays(4, (6, 4), (6, 5), (1, 4))
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["m0"]),
        helper.make_node("Add", ["m0", "b0"], ["y0"]),
        helper.make_node("MatMul", ["x", "w1"], ["y1"]),
    ]
    m = model(nodes, dict(w0=w0, w1=w1, b0=b0), [("x", [2, 3, 6])], [("y0", [2, 3, 4]), ("y1", [2, 3, 5])])
    opt, n = optimize(m, SIBLINGS)
    # 2 MatMul + 1 Add before; MatMul + Add + Split after (the Split is not read in place by
    # an elementwise op here, so it counts): 3 -> 3 does not pay.
    assert n == 0
    nodes.append(helper.make_node("MatMul", ["x", "w1"], ["y2"]))
    m2 = model(nodes, dict(w0=w0, w1=w1, b0=b0), [("x", [2, 3, 6])],
               [("y0", [2, 3, 4]), ("y1", [2, 3, 5]), ("y2", [2, 3, 5])])
    opt2, n2 = optimize(m2, SIBLINGS)
    assert n2 == 1
    feeds = [{"x": np.random.default_rng(b).standard_normal((2, 3, 6)).astype(np.float32)} for b in (1, 2)]
    assert_same(m2, opt2, feeds)


def test_shared_weight_is_computed_once():
    w, v = rng_arrays(5, (8, 6), (8, 3))
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y0"]),
        helper.make_node("MatMul", ["x", "w"], ["y1"]),
        helper.make_node("MatMul", ["x", "v"], ["y2"]),
    ]
    m = model(nodes, dict(w=w, v=v), [("x", ["B", 8])], [("y0", ["B", 6]), ("y1", ["B", 6]), ("y2", ["B", 3])])
    opt, n = optimize(m, SIBLINGS)
    assert n == 1
    mm = next(x for x in opt.graph.node if x.op_type == "MatMul")
    weight = next(t for t in opt.graph.initializer if t.name == mm.input[1])
    assert list(weight.dims) == [8, 9]  # w once, then v
    assert_same(m, opt, x_feeds(8))


@pytest.mark.parametrize(
    "case",
    ["non_constant_weight", "transposed_a", "full_matrix_bias"],
)
def test_siblings_that_cannot_be_batched_are_left_alone(case):
    w0, w1, w2, c = rng_arrays(6, (8, 4), (8, 4), (8, 4), (3, 4))
    inputs = [("x", [3, 8])]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["y0"])]
    inits = dict(w0=w0, w1=w1)
    if case == "non_constant_weight":
        inputs.append(("wv", [8, 4]))
        nodes += [helper.make_node("MatMul", ["x", "wv"], ["y1"])]
    elif case == "transposed_a":
        inits["w1"] = rng_arrays(7, (3, 4))[0]
        nodes += [helper.make_node("Gemm", ["x", "w1"], ["y1"], transA=1)]  # [8, 3] @ [3, 4]
    elif case == "full_matrix_bias":
        inits["c"] = c
        nodes += [helper.make_node("Gemm", ["x", "w1", "c"], ["y1"])]
    nodes.append(helper.make_node("MatMul", ["x", "w2"], ["y2"]))
    inits["w2"] = w2
    outs = [("y0", [3, 4]), ("y1", [8, 4] if case == "transposed_a" else [3, 4]), ("y2", [3, 4])]
    m = model(nodes, inits, inputs, outs)
    opt, _ = optimize(m, SIBLINGS)
    # At most the two plain MatMuls (y0, y2) may be merged; the odd one out stays as it was.
    odd = {"non_constant_weight": "MatMul", "transposed_a": "Gemm", "full_matrix_bias": "Gemm"}[case]
    assert any(n.op_type == odd and list(n.output) == ["y1"] for n in opt.graph.node)
    feeds = {"x": rng_arrays(9, (3, 8))[0]}
    if case == "non_constant_weight":
        feeds["wv"] = rng_arrays(10, (8, 4))[0]
    assert_same(m, opt, [feeds])


def test_two_siblings_batch_only_when_their_pieces_are_read_in_place():
    w0, w1, b = rng_arrays(11, (8, 16), (8, 16), (16,))
    # Pieces read by an elementwise Add (fused by the pointwise pass): 2 GEMMs -> 1 GEMM.
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["m0"]),
        helper.make_node("MatMul", ["x", "w1"], ["m1"]),
        helper.make_node("Add", ["m0", "h"], ["s0"]),
        helper.make_node("Mul", ["m1", "s0"], ["y"]),
    ]
    m = model(nodes, dict(w0=w0, w1=w1), [("x", ["B", 8]), ("h", ["B", 16])], [("y", ["B", 16])])
    opt, n = optimize(m, SIBLINGS)
    assert n == 1
    assert opt.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "B"  # batch stays dynamic
    feeds = [{"x": rng_arrays(b, (b, 8))[0], "h": rng_arrays(b + 1, (b, 16))[0]} for b in (1, 5)]
    assert_same(m, opt, feeds)
    # Without pointwise fusion in the pipeline the Split is a real copy: 2 -> 2, not applied.
    _, n = optimize(m, SIBLINGS, pipeline=SIBLINGS)
    assert n == 0
    # Pieces read by a MatMul: the Split stays, 2 -> 2, not applied.
    nodes2 = nodes[:2] + [helper.make_node("MatMul", ["m0", "b2"], ["y0"]), helper.make_node("MatMul", ["m1", "b2"], ["y1"])]
    m2 = model(nodes2, dict(w0=w0, w1=w1, b2=rng_arrays(12, (16, 2))[0]), [("x", [2, 8])], [("y0", [2, 2]), ("y1", [2, 2])])
    _, n = optimize(m2, SIBLINGS)
    assert n == 0


# merge-xh-matmul --------------------------------------------------------------------------------


def lstm_gates_model():
    wx, wh, bx, bh = rng_arrays(13, (6, 20), (5, 20), (20,), (20,))
    nodes = [
        helper.make_node("MatMul", ["x", "wx"], ["gx"]),
        helper.make_node("Add", ["gx", "bx"], ["gxb"]),
        helper.make_node("MatMul", ["h", "wh"], ["gh"]),
        helper.make_node("Add", ["gxb", "gh"], ["g"]),
        helper.make_node("Add", ["g", "bh"], ["gates"]),
        helper.make_node("Sigmoid", ["gates"], ["y"]),
    ]
    return model(nodes, dict(wx=wx, wh=wh, bx=bx, bh=bh), [("x", ["B", 6]), ("h", ["B", 5])], [("y", ["B", 20])])


def test_xh_merge_applies_only_without_pointwise_fusion():
    m = lstm_gates_model()
    opt, n = optimize(m, ["merge-xh-matmul"], pipeline=["merge-xh-matmul"])
    assert n == 1
    assert ops(opt) == ["Concat", "MatMul", "Add", "Sigmoid"]
    feeds = [{"x": rng_arrays(b, (b, 6))[0], "h": rng_arrays(b + 7, (b, 5))[0]} for b in (1, 4)]
    assert_same(m, opt, feeds)
    # The default pipeline fuses the Adds into the pointwise region: no kernel to save.
    _, n = optimize(m, ["merge-xh-matmul"])
    assert n == 0


def test_xh_merge_needs_equal_leading_dims():
    wx, wh = rng_arrays(14, (6, 4), (5, 4))
    nodes = [
        helper.make_node("MatMul", ["x", "wx"], ["gx"]),
        helper.make_node("MatMul", ["h", "wh"], ["gh"]),
        helper.make_node("Add", ["gx", "gh"], ["y"]),
    ]
    m = model(nodes, dict(wx=wx, wh=wh), [("x", ["B", 6]), ("h", [1, 5])], [("y", ["B", 4])])
    _, n = optimize(m, ["merge-xh-matmul"], pipeline=["merge-xh-matmul"])
    assert n == 0


# batch-ensemble ---------------------------------------------------------------------------------


def ensemble_model(k=4, d=8, hidden=12, out=3, batch="B", act="Relu", odd_branch=False):
    r = np.random.default_rng(15)
    nodes, inits, outs = [], {}, []
    dims = [d, hidden, hidden, out]
    for b in range(k):
        cur = "x"
        for layer in range(3):
            w = (r.standard_normal((dims[layer], dims[layer + 1])) / np.sqrt(dims[layer])).astype(np.float32)
            bias = r.standard_normal(dims[layer + 1]).astype(np.float32)
            if b % 2:  # nn.Linear as Gemm(transB=1)
                inits[f"w{b}_{layer}"], inits[f"b{b}_{layer}"] = w.T, bias
                nodes.append(helper.make_node("Gemm", [cur, f"w{b}_{layer}", f"b{b}_{layer}"], [f"l{b}_{layer}"], transB=1))
            else:
                inits[f"w{b}_{layer}"], inits[f"b{b}_{layer}"] = w, bias
                nodes += [helper.make_node("MatMul", [cur, f"w{b}_{layer}"], [f"m{b}_{layer}"]),
                          helper.make_node("Add", [f"m{b}_{layer}", f"b{b}_{layer}"], [f"l{b}_{layer}"])]
            cur = f"l{b}_{layer}"
            if layer < 2:
                op = "Tanh" if odd_branch and b == k - 1 else act
                nodes.append(helper.make_node(op, [cur], [f"a{b}_{layer}"]))
                cur = f"a{b}_{layer}"
        outs.append(cur)
    nodes.append(helper.make_node("Concat", outs, ["y"], axis=1))
    return model(nodes, inits, [("x", [batch, d])], [("y", [batch, k * out])])


def test_ensemble_becomes_stacked_layers_on_cuda_target():
    m = ensemble_model()
    opt, n = optimize(m, ["batch-ensemble"], target="cuda")
    assert n == 1
    assert ops(opt) == ["MatMul", "Add", "Relu", "MatMul", "Add", "Relu", "MatMul", "Add", "Transpose", "Reshape"]
    assert opt.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "B"
    assert_same(m, opt, x_feeds(8, batches=(1, 4, 7)))


def test_ensemble_on_cpu_in_standard_ops_only_with_small_static_batch():
    # Softsign has no StackedMLP kernel: the stacked standard-op form, whose batched MatMul is
    # slower than onnxruntime's separate Gemms beyond a small static batch.
    _, n = optimize(ensemble_model(batch="B", act="Softsign"), ["batch-ensemble"])
    assert n == 0
    m = ensemble_model(batch=2, act="Softsign")
    opt, n = optimize(m, ["batch-ensemble"])
    assert n == 1 and "StackedMLP" not in ops(opt)
    assert_same(m, opt, x_feeds(8, batches=(2,)))


def test_ensemble_needs_two_identical_linear_layers():
    m = ensemble_model(odd_branch=True)
    opt, n = optimize(m, ["batch-ensemble"], target="cuda")
    # Lockstep stops at the first differing op (Relu vs Tanh after layer 1); one common linear
    # layer is no ensemble (batch-sibling-matmul merges it), so nothing changes.
    assert n == 0
    assert_same(m, opt, x_feeds(8, batches=(1, 3)))


def drop_final_concat(m) -> list[str]:
    """Remove ensemble_model's final Concat and its graph output; the members' output names."""
    g = m.graph
    concat = next(n for n in g.node if n.op_type == "Concat")
    g.node.remove(concat)
    del g.output[:]
    return list(concat.input)


def test_ensemble_outputs_not_concatenated_are_split_back():
    m = ensemble_model(k=3)
    m.graph.output.extend([helper.make_tensor_value_info(n, F, ["B", 3]) for n in drop_final_concat(m)])
    opt, n = optimize(m, ["batch-ensemble"], target="cuda")
    assert n == 1 and ops(opt)[-1] == "Split"
    assert_same(m, opt, x_feeds(8, batches=(1, 5)))


# zoo models -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,target", [("mlp_ensemble", "cuda"), ("char_rnn", "cpu")])
def test_zoo_models_compute_the_same(name, target):
    path = MODELS / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} not generated")
    m = onnx.load(str(path))
    names = ["hoist-matmul-over-gather", "batch-ensemble", "batch-sibling-matmul", "merge-xh-matmul"]
    r = np.random.default_rng(0)
    feeds = {}
    for i in m.graph.input:
        shape = [d.dim_value or 4 for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == TensorProto.INT64:
            feeds[i.name] = r.integers(0, 60, shape).astype(np.int64)
        else:
            feeds[i.name] = r.standard_normal(shape).astype(np.float32)
    # With and without pointwise fusion in the pipeline (merge-xh-matmul applies without it).
    for pipeline in (None, names):
        opt, n = optimize(m, names, target=target, pipeline=pipeline) if pipeline else optimize(m, names, target=target)
        assert n > 0
        assert_same(m, opt, [feeds])


def test_matmuls_with_different_k_on_different_inputs_are_not_siblings():
    w0, w1 = rng_arrays(16, (8, 4), (6, 4))
    nodes = [helper.make_node("MatMul", ["x0", "w0"], ["y0"]), helper.make_node("MatMul", ["x1", "w1"], ["y1"])]
    m = model(nodes, dict(w0=w0, w1=w1), [("x0", ["B", 8]), ("x1", ["B", 6])], [("y0", ["B", 4]), ("y1", ["B", 4])])
    _, n = optimize(m, SIBLINGS)
    assert n == 0


# hoist-matmul-over-gather -----------------------------------------------------------------------


def unrolled_projection_model(steps=6, used=None, table=True):
    emb, w, b = rng_arrays(17, (11, 8), (8, 12), (12,))
    inits = dict(w=w, b=b) | ({"emb": emb} if table else {})
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"])] if table else []
    src = "e" if table else "seq"
    outs = []
    for t in used if used is not None else range(steps):
        inits[f"i{t}"] = np.array(t)
        nodes += [
            helper.make_node("Gather", [src, f"i{t}"], [f"x{t}"], axis=1),
            helper.make_node("MatMul", [f"x{t}", "w"], [f"m{t}"]),
            helper.make_node("Add", [f"m{t}", "b"], [f"y{t}"]),
        ]
        outs.append((f"y{t}", [2, 12]))
    inp = [("seq", [2, steps, 8])] if not table else [("ids", [2, steps], TensorProto.INT64)]
    m = model(nodes, inits, inp, outs)
    for t in m.graph.initializer:  # model() writes float32 initializers; the step indices are int64
        if t.name.startswith("i"):
            t.CopyFrom(numpy_helper.from_array(np.array(int(t.name[1:]), np.int64), t.name))
    return m


def test_rnn_input_projections_over_an_embedding_fold_into_one_table():
    m = unrolled_projection_model()
    opt, n = optimize(m, ["hoist-matmul-over-gather"])
    assert n == 1
    assert "MatMul" not in ops(opt) and "Add" not in ops(opt)  # emb @ W + b computed here
    feeds = [{"ids": np.random.default_rng(s).integers(0, 11, (2, 6)).astype(np.int64)} for s in (0, 1)]
    assert_same(m, opt, feeds)


def test_input_projections_over_a_sequence_become_one_matmul():
    m = unrolled_projection_model(table=False)
    opt, n = optimize(m, ["hoist-matmul-over-gather"])
    assert n == 1 and ops(opt).count("MatMul") == 1
    assert_same(m, opt, [{"seq": rng_arrays(18, (2, 6, 8))[0]}])
    # Two of six steps used: the hoisted GEMM would compute three times the work.
    _, n = optimize(unrolled_projection_model(table=False, used=[0, 3]), ["hoist-matmul-over-gather"])
    assert n == 0


def test_explain_says_why_branches_are_not_batched():
    from onnxfuse.api import optimize as optimize_model
    from onnxfuse.optimize_options import OptimizeOptions

    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["y1"], name="b1"), helper.make_node("MatMul", ["x", "w2"], ["y2"], name="b2")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3]) for n in ("y1", "y2")],
        [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), n) for n in ("w1", "w2")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    result = optimize_model(model, settings=OptimizeOptions(passes=("batch-ensemble",), explain=("batch-ensemble",),
                                                            verify=False, count_kernels=False))
    assert result.summary["unmatched"]["batch-ensemble"] == {"b1": [
        "the 2 branches on 'x' do not continue in lockstep (same ops, weights of one shape, read by their branch alone)"
        " to a second linear layer"]}
