"""--target cuda on the corpus: every fused node the pipeline emits carries a CUDA kernel whose
stored PTX ptxas assembles for sm_90 (registers, spills and shared memory within bounds), and no op
is left that onnxruntime's CUDA provider would have to run on the CPU. Without nvcc and ptxas
(CI) the compile checks skip; the audit's own checks run everywhere."""
from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import api, zoo
from onnxfuse.cuda import audit

needs_ptxas = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("ptxas") is None,
                                 reason="nvcc and ptxas (CUDA toolkit) are not on PATH")

# One model per kind of fused op and form, each compiling in seconds: an unrolled LSTM (Pointwise
# regions reading Slice/Split views), BERT (GELU, NaN guards, bool mask regions), ResNet-18
# (ConvBiasAct GEMM kernels with residual and Relu epilogues). The rest of the corpus compiles
# one kernel per convolution shape and takes minutes without the kernel cache: marked slow.
FAST = ("lstm_ts", "bert_dynamo", "resnet18_ts")
# With attention_cuda also BERT's TorchScript export: the generated Attention kernel with the
# NaN-to-zero guard (bert_dynamo's attention is onnxruntime's Attention there).
FAST_ATTENTION = ("bert_ts", "gpt2_decode_ts")

# What each corpus transformer's attention is on cuda with attention_cuda: onnxfuse.Attention (the
# generated kernel), or onnxruntime's Attention / MultiHeadAttention from the onnxscript-fusions
# stage's attention groups (CUDA kernels of onnxruntime's own). None: the attention stays its
# chain, Softmax included. llama_ts: the CPU target writes GroupQueryAttention, whose CUDA kernel
# takes float16 and bfloat16 only; on cuda the generated kernel reads the rotary's q and k (and
# the repeated v) heads first.
ATTENTION_ON_CUDA = {
    "bert_ts": "onnxfuse.Attention", "bert_dynamo": "com.microsoft.Attention",
    "gpt2_ts": "onnxfuse.Attention", "gpt2_dynamo": "com.microsoft.MultiHeadAttention",
    "llama_ts": "onnxfuse.Attention", "llama_dynamo": "com.microsoft.MultiHeadAttention",
    "t5_encoder_ts": "onnxfuse.Attention", "t5_encoder_dynamo": "onnxfuse.Attention",
    "whisper_encoder_ts": "onnxfuse.Attention", "whisper_encoder_dynamo": "com.microsoft.MultiHeadAttention",
    "vit_ts": "onnxfuse.Attention", "vit_dynamo": "onnxfuse.Attention",
    # decode steps: GroupQueryAttention (the CPU's) has no float32 CUDA kernel; onnxscript's
    # MultiHeadAttention takes the past on the dynamo exports; on the TorchScript exports the
    # generated kernel reads the present k, v heads first, with the computed padding term (key
    # length past + 1) as its mask
    "gpt2_decode_ts": "onnxfuse.Attention", "gpt2_decode_dynamo": "com.microsoft.MultiHeadAttention",
    "llama_decode_ts": "onnxfuse.Attention", "llama_decode_dynamo": "com.microsoft.MultiHeadAttention",
}
ATTENTION_OPS = {"onnxfuse.Attention", "com.microsoft.Attention", "com.microsoft.MultiHeadAttention",
                 "com.microsoft.GroupQueryAttention"}

MAX_REGISTERS = 255  # per thread on sm_90
MAX_STATIC_SHARED = 48 * 1024  # bytes of static shared memory per block


def _corpus_params():
    """(model, pass options): every corpus model with the default pipeline, and the transformers
    again with the opt-in CUDA attention fusion, so that an attention form fuse-attention learns
    either gets a CUDA kernel or is not emitted for cuda."""
    params = []
    for m in zoo.list_models():
        if m.source != "corpus":
            continue
        marks = () if m.name in FAST else (pytest.mark.slow,)
        params.append(pytest.param(m.name, {}, marks=marks, id=m.name))
        if m.family == "transformer":
            fast = m.name in FAST or m.name in FAST_ATTENTION
            params.append(pytest.param(m.name, {"attention_cuda": True}, marks=() if fast else (pytest.mark.slow,),
                                       id=f"{m.name}-attention_cuda"))
    return params


def _cuda(name: str, **options) -> onnx.ModelProto:
    return api.optimize(f"zoo:{name}", target="cuda", verify_outputs=False, count_kernels=False,
                        options=options).model


def _check_resources(records: list[audit.NodeKernel]) -> None:
    for r in records:
        info = r.ptxas
        assert info is not None, (r.node, r.problem)
        assert info.spill_stores == 0 and info.spill_loads == 0, (r.node, r.form, info)
        assert info.registers <= MAX_REGISTERS, (r.node, info)
        assert info.smem_bytes <= MAX_STATIC_SHARED, (r.node, info)


@needs_ptxas
@pytest.mark.parametrize("name, options", _corpus_params())
def test_every_fused_node_of_corpus_model_has_a_kernel_ptxas_accepts_for_sm90(name, options):
    model = _cuda(name, **options)
    records = audit.audit(model, "sm_90")
    assert records, "the cuda pipeline fuses nothing in this model"
    assert [(r.node, r.problem) for r in records if not r.ok] == []
    _check_resources(records)
    assert audit.foreign_ops_without_cuda_kernel(model) == []
    if options.get("attention_cuda"):
        _check_attention_fused(name, model)


def _check_attention_fused(name: str, model: onnx.ModelProto) -> None:
    """Each attention of the model is one node of the op ATTENTION_ON_CUDA names (no Softmax is
    left), or, where it names None, every attention keeps its Softmax and none becomes an op
    without a float32 CUDA kernel."""
    ops = [f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in model.graph.node]
    fused = [op for op in ops if op in ATTENTION_OPS]
    want = ATTENTION_ON_CUDA[name]
    if want is None:
        assert fused == [] and "Softmax" in ops
        return
    assert "Softmax" not in ops
    assert fused and set(fused) == {want}


@needs_ptxas
def test_attention_nodes_of_the_opt_in_cuda_fusion_carry_kernels_ptxas_accepts():
    # The zoo's GPT stack: packed qkv, folded bias, and its causal mask sliced to the sequence,
    # which the CUDA kernel (no causal mode) reads as a mask input. The corpus transformers'
    # forms are checked with attention_cuda above.
    model = _cuda("gpt_stack", attention_cuda=True)
    records = audit.audit(model, "sm_90")
    attention = [r for r in records if r.op == "Attention"]
    assert attention and all(r.ok for r in attention), [(r.node, r.problem) for r in attention]
    assert all("packed qkv" in r.form and "+mask" in r.form for r in attention)
    _check_resources(records)


def _pointwise_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["t"]), helper.make_node("Relu", ["t"], ["u"]),
         helper.make_node("Sigmoid", ["u"], ["y"])],
        "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(np.linspace(-1, 1, 8, dtype=np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_audit_reports_a_fused_node_without_a_cuda_kernel():
    # The CPU target stores no CUDA kernel: each of its fused nodes is one that a CUDA session
    # would run through its fallback function.
    model = api.optimize(_pointwise_model(), target="cpu", verify_outputs=False, count_kernels=False).model
    records = audit.audit(model, "sm_90")
    assert [r.op for r in records] == ["Pointwise"]
    assert not records[0].ok and "no CUDA kernel" in records[0].problem
    assert records[0].form == "3 instr, 2 in, 1 out, f32"


def test_contrib_ops_without_a_float32_cuda_kernel_are_reported():
    nodes = [helper.make_node("GroupQueryAttention", ["q"], ["o"], domain="com.microsoft"),
             helper.make_node("SkipLayerNormalization", ["o"], ["p"], domain="com.microsoft"),
             helper.make_node("SimplifiedLayerNormalization", ["p"], ["r"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("r", TensorProto.FLOAT, [1])])
    assert audit.foreign_ops_without_cuda_kernel(helper.make_model(graph)) == ["com.microsoft.GroupQueryAttention"]


@needs_ptxas
def test_audit_reports_a_kernel_for_another_architecture_and_ptx_ptxas_rejects():
    model = _cuda("lstm_ts")
    records = audit.audit(model, "sm_80")
    assert records and all(not r.ok and "not sm_80" in r.problem for r in records)
    node = next(n for n in model.graph.node if n.op_type == "Pointwise")
    ptx = next(a for a in node.attribute if a.name == "cuda_ptx")
    ptx.s = ptx.s.replace(b".entry", b".entry_broken", 1)
    bad = [r for r in audit.audit(model, "sm_90") if r.node == node.name]
    assert bad and bad[0].problem.startswith("ptxas")


@needs_ptxas
def test_cuda_corpus_report_lists_each_model_with_its_fused_ops_and_kernel_resources(tmp_path):
    from bench.cuda_corpus import main

    out = tmp_path / "cuda_corpus.md"
    assert main(["--models", "lstm_ts", "--no-cpu-contrib", "--out", str(out)]) == 0
    text = out.read_text()
    assert "nodes without a kernel ptxas accepts: 0" in text
    row = next(line for line in text.splitlines() if line.startswith("| lstm_ts |"))
    assert "Pointwise 8" in row
    assert "| Pointwise | 13 instr, 9 in (8 views), 2 out, f32 | 8 | lstm_ts | yes |" in text
