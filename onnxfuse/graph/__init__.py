"""The shared graph layer every pass builds on (onnx-graphsurgeon graphs).

core          producers, consumers, constants, dims, names, cleanup, toposort, export
index         a graph's top-level nodes by identity, with producers and consumers
facts         element types and shapes filled in by inference
slices        ONNX Slice semantics
shape_values  symbolic values of integer shape tensors
shape_sums    sums of monomials over dims (past + 1) as shape_values carries them
linear        linear layers (MatMul/Gemm with a constant weight, + row bias)
rules         the rule engine: patterns as expressions, rules as data (match, condition, rewrite)
activations   the activation vocabulary: every elementwise activation the passes know, one table
patterns      op vocabularies the passes match on
transformer_forms  rotary, repeat_kv and attention as the torch.onnx exporters write them
attention_heads    an attention block's operands matched by hand where the proof needs shapes
gqa_inputs    what GroupQueryAttention reads besides q, k, v (lengths, rotary caches, bias), from the graph
ort_fusions   a model of onnxruntime's own fusions, which passes must not block

No pass imports another pass: what two passes share lives here.
"""
