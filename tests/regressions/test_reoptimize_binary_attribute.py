"""Optimizing a model optimized with --target cuda again failed with an internal error
(UnicodeDecodeError): its Pointwise nodes carry the compiled kernel as a binary string
attribute (cuda_cubin), and onnx-graphsurgeon decodes every string attribute as UTF-8 on import.
Any model with a non-UTF-8 string attribute fails the same way."""
from __future__ import annotations

import onnx

from conftest import pointwise_chain_model
from onnxfuse.fuzz import optimize_model


def test_model_with_binary_string_attribute_optimizes_again():
    once = optimize_model(pointwise_chain_model())
    fused = next(n for n in once.graph.node if n.domain == "onnxfuse")
    fused.attribute.append(onnx.helper.make_attribute("cuda_cubin", bytes(range(256))))
    twice = optimize_model(once)
    again = next(n for n in twice.graph.node if n.domain == "onnxfuse")
    assert next(a.s for a in again.attribute if a.name == "cuda_cubin") == bytes(range(256))
