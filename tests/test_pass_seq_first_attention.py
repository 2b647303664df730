"""attention-batch-first: torch's sequence-first nn.MultiheadAttention, built here the way both
torch.onnx exporters write it, becomes the batch-first form, and then one onnxfuse.Attention
node with its Split and bias; near-misses are left alone. Results are checked against the
original at several batch sizes, with the library and with the fallback functions."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.graph.shape_values import reshaped_dims
from test_pass_attention import attrs, check_runs_like_original, fused
from test_pass_matmul_batch import optimize

S, E, H = 5, 16, 4
DH = E // H
BOTH = ["attention-batch-first", "fuse-attention"]


def seq_first_mha(form="ts", in_bias=True, out_bias=True, gather_indices=(0, 1, 2), unpack_target=(S, -1, 3, E),
                  q_flat_target=(S, -1, DH), in_bias_shape=(3 * E,), piece_output=False, out_gemm=False,
                  unflat_target=(S, -1, E)):
    """x [B, S, E] -> nn.MultiheadAttention(E, H) (packed in-projection, no mask) -> y [B, S, E],
    as the TorchScript exporter ("ts": Squeeze axis 3, keys transposed 4-D) or torch.export
    ("dynamo": Squeeze axis -2, allowzero = 1, the keys' 3-D transpose with its head split merged
    into the Reshape after it) writes it once shape-plumbing has made the targets constants.
    out_gemm: the output projection as torch.export writes it for nn.MultiheadAttention, a 2-D
    Gemm (transB = 1) of the rows flattened to [S*B, E], unflattened to `unflat_target` after."""
    rng = np.random.default_rng(1)
    az = {"allowzero": 1} if form == "dynamo" else {}
    scale = np.float32(np.sqrt(1.0 / np.sqrt(DH)))
    inits = {
        "w_in": rng.standard_normal((E, 3 * E)).astype(np.float32) / 4,
        "b_in": rng.standard_normal(in_bias_shape).astype(np.float32),
        "w_out": rng.standard_normal((E, E)).astype(np.float32) / 4,
        "b_out": rng.standard_normal(E).astype(np.float32),
        "unpack": np.array(unpack_target, np.int64),
        "axes0": np.array([0], np.int64),
        "pieces_axes": np.array([3] if form == "ts" else [-2], np.int64),
        "q_flat_target": np.array(q_flat_target, np.int64),
        "flat_target": np.array([S, -1, DH], np.int64),
        "heads": np.array([-1, H, S, DH], np.int64),
        "keys_t": np.array([-1, H, DH, S], np.int64),
        "merge": np.array([-1, E] if out_gemm else [0, 0, E], np.int64),
        "w_out_t": None,
        "unflat": np.array(unflat_target, np.int64),
        "scale": np.array([scale], np.float32),
        **{f"i{i}": np.array(i, np.int64) for i in range(3)},
    }
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
        helper.make_node("MatMul", ["xt", "w_in"], ["proj"]),
    ]
    packed = "proj"
    if in_bias:
        nodes.append(helper.make_node("Add", ["b_in", "proj"] if form == "ts" else ["proj", "b_in"], ["proj_b"]))
        packed = "proj_b"
    nodes += [
        helper.make_node("Reshape", [packed, "unpack"], ["unpacked"], **az),
        helper.make_node("Unsqueeze", ["unpacked", "axes0"], ["u"]),
        helper.make_node("Transpose", ["u"], ["t"], perm=[3, 1, 2, 0, 4]),
        helper.make_node("Squeeze", ["t", "pieces_axes"], ["pieces"]),
    ]
    for name, i in zip("qkv", gather_indices):
        nodes.append(helper.make_node("Gather", ["pieces", f"i{i}"], [f"{name}_piece"], axis=0))
    for name in "qv":
        nodes += [
            helper.make_node("Reshape", [f"{name}_piece", "q_flat_target" if name == "q" else "flat_target"], [f"{name}_flat"], **az),
            helper.make_node("Transpose", [f"{name}_flat"], [f"{name}_bh"], perm=[1, 0, 2]),
            helper.make_node("Reshape", [f"{name}_bh", "heads"], [f"{name}_heads"], **az),
        ]
    nodes += [
        helper.make_node("Reshape", ["k_piece", "flat_target"], ["k_flat"], **az),
        helper.make_node("Transpose", ["k_flat"], ["k_bh"], perm=[1, 0, 2]),
    ]
    if form == "ts":
        nodes += [
            helper.make_node("Reshape", ["k_bh", "heads"], ["k_heads"], **az),
            helper.make_node("Transpose", ["k_heads"], ["kt"], perm=[0, 1, 3, 2]),
        ]
    else:
        nodes += [
            helper.make_node("Transpose", ["k_bh"], ["k_bh_t"], perm=[0, 2, 1]),
            helper.make_node("Reshape", ["k_bh_t", "keys_t"], ["kt"], **az),
        ]
    nodes += [
        helper.make_node("Mul", ["q_heads", "scale"], ["qs"]),
        helper.make_node("Mul", ["kt", "scale"], ["kts"]),
        helper.make_node("MatMul", ["qs", "kts"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v_heads"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctx_sbh"], perm=[2, 0, 1, 3]),
        helper.make_node("Reshape", ["ctx_sbh", "merge"], ["merged"]),
    ]
    if out_gemm:
        inits["w_out_t"] = np.ascontiguousarray(inits["w_out"].T)
        nodes += [
            helper.make_node("Gemm", ["merged", "w_out_t"] + (["b_out"] if out_bias else []), ["rows"], transB=1),
            helper.make_node("Reshape", ["rows", "unflat"], ["out"], **az),
        ]
    else:
        nodes.append(helper.make_node("MatMul", ["merged", "w_out"], ["out"]))
        if out_bias:
            nodes.append(helper.make_node("Add", ["out", "b_out"], ["out_b"]))
    out = "out_b" if out_bias and not out_gemm else "out"
    nodes.append(helper.make_node("Transpose", [out], ["y"], perm=[1, 0, 2]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", S, E])]
    if piece_output:
        outputs.append(helper.make_tensor_value_info("q_piece", TensorProto.FLOAT, [S, "B", E]))
    graph = helper.make_graph(nodes, "mha", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", S, E])],
                              outputs, [numpy_helper.from_array(v, k) for k, v in inits.items() if v is not None])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18 if form == "dynamo" else 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


def feeds(batches=(1, 2, 3)):
    rng = np.random.default_rng(7)
    return [{"x": rng.standard_normal((b, S, E)).astype(np.float32)} for b in batches]


def ops(model):
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("in_bias, out_bias", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("form", ["ts", "dynamo"])
def test_both_exporters_forms_become_one_packed_attention_with_its_bias(form, in_bias, out_bias):
    m = seq_first_mha(form, in_bias=in_bias, out_bias=out_bias)
    opt, n = optimize(m, BOTH)
    (node,) = fused(opt)
    a = attrs(node)
    assert a["qkv_packed"] == 1 and a["num_heads"] == H and a.get("has_bias", 0) == int(in_bias)
    assert a["scale"] == pytest.approx(1.0 / np.sqrt(DH), rel=1e-6)
    # No sequence-first plumbing is left: the projections read x and write y directly.
    assert not {"Transpose", "Gather", "Squeeze", "Unsqueeze", "Reshape", "Split"} & set(ops(opt))
    assert ops(opt).count("MatMul") == 2
    check_runs_like_original(m, opt, feeds())


@pytest.mark.parametrize("out_bias", [True, False])
def test_torch_export_gemm_output_projection_becomes_one_packed_attention(out_bias):
    # torchvision's ViT with a static batch, exported by torch.export: the output projection is a
    # Gemm of rows flattened to [S*B, E], unflattened to [S, B, E] (fuse-attention said: "the
    # output is not merged back by Transpose(0, 2, 1, 3) read by one Reshape").
    m = seq_first_mha("dynamo", out_bias=out_bias, out_gemm=True)
    opt, n = optimize(m, BOTH)
    (node,) = fused(opt)
    assert attrs(node)["qkv_packed"] == 1
    assert not {"Transpose", "Gather", "Squeeze", "Unsqueeze", "Reshape", "Split", "Gemm"} & set(ops(opt))
    check_runs_like_original(m, opt, feeds())


def test_gemm_output_projection_unflattened_to_other_rows_is_left_alone():
    # [B, S, E] rows of a [S*B, N] product are not its [S, B, N] rows: the output side stays.
    m = seq_first_mha("dynamo", out_gemm=True, unflat_target=(-1, S, E))
    opt, _ = optimize(m, BOTH)
    assert "Gemm" in ops(opt)
    check_runs_like_original(m, opt, feeds())


@pytest.mark.parametrize("form", ["ts", "dynamo"])
def test_batch_first_rewrite_alone_keeps_the_values(form):
    m = seq_first_mha(form)
    opt, n = optimize(m, ["attention-batch-first"])
    assert n == 2  # the input side and the output side
    assert not {"Gather", "Squeeze", "Unsqueeze"} & set(ops(opt))
    # 3 head splits, 1 merge (and the TorchScript form's key transpose, which fuse-attention takes)
    assert ops(opt).count("Split") == 1 and ops(opt).count("Transpose") == (5 if form == "ts" else 4)
    check_runs_like_original(m, opt, feeds())


@pytest.mark.parametrize("tweak", [
    {"gather_indices": (0, 1, 1)},  # k read twice, no v: not the three pieces
    {"unpack_target": (-1, S, 3, E)},  # [B, S, 3, E] of a [S, B, 3E] tensor: other rows
    {"q_flat_target": (-1, S, DH)},  # splits the rows, not the features, into heads
    {"in_bias_shape": (S, 1, 3 * E)},  # a bias that varies along the sequence
    {"piece_output": True},  # q's piece is a graph output too
])
@pytest.mark.parametrize("form", ["ts", "dynamo"])
def test_near_misses_keep_the_sequence_first_input_side(form, tweak):
    m = seq_first_mha(form, **tweak)
    opt, _ = optimize(m, BOTH)
    assert "Squeeze" in ops(opt) and "Split" not in ops(opt) and not fused(opt)
    names = [o.name for o in m.graph.output]
    assert names == [o.name for o in opt.graph.output]
    check_runs_like_original(m, opt, feeds())


def test_reshaped_dims_proves_what_a_reshape_gives_over_symbolic_dims():
    b, s = (1, ("B",)), (5, ())
    e = (16, ())
    assert reshaped_dims([s, b, (48, ())], [5, -1, 3, 16]) == [s, b, (3, ()), e]
    assert reshaped_dims([s, b, e], [0, -1, 4], allowzero=0) == [s, (4, ("B",)), (4, ())]
    assert reshaped_dims([s, b, e], [0, -1, 4], allowzero=1) is None  # a literal 0: no element count fits
    assert reshaped_dims([s, b, e], [-1, 5, 16]) == [b, s, e]
    assert reshaped_dims([s, b, e], [5, -1, 3]) is None  # 16 B / 3 is not exact
    assert reshaped_dims([s, b, e], [5, 2, 8]) is None  # B is not 1 for every value
    assert reshaped_dims([s, b, e], [-1, -1, 16]) is None


@pytest.mark.parametrize("form", ["ts", "dynamo"])
def test_cuda_target_gets_the_packed_node_its_generator_implements(form):
    from onnxfuse.cuda.attention_codegen import NODE_ATTRIBUTES

    m = seq_first_mha(form)
    opt, _ = optimize(m, BOTH, target="cuda", attention_cuda=True)
    (node,) = fused(opt)
    assert set(attrs(node)) <= NODE_ATTRIBUTES and attrs(node)["qkv_packed"] == 1
    assert "causal" not in attrs(node)
    check_runs_like_original(m, opt, feeds((1, 3)))
