"""fuse-gqa: the LLaMA-style decoder's grouped-query attention (rotary, repeat_kv, causal and
padding mask) as onnxruntime's GroupQueryAttention, on the corpus's exports by both torch.onnx
exporters, and the forms it must leave alone. Every rewritten model is run against the
original in onnxruntime, at two shape sets and with masks that leave whole rows masked."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxfuse import zoo
from test_pass_matmul_batch import assert_same, optimize

EXPORTS = ["llama_ts", "llama_dynamo"]
# The passes that run before fuse-gqa in the default pipeline and shape what it sees (the
# TorchScript export's one-input Concats go with remove-noop-slice).
PASSES = ["fold-constants", "remove-identity", "remove-noop-slice", "fuse-gqa"]


def llama(name: str) -> onnx.ModelProto:
    return zoo.get(name).load()


def feeds(seed: int, batch: int, seq: int) -> dict:
    rng = np.random.default_rng(seed)
    mask = (rng.random((batch, seq)) < 0.7).astype(np.int64)
    mask[0, :] = 1
    mask[-1, 0] = 0  # left padding: the first query row of that sequence has every key masked
    return {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64), "attention_mask": mask}


FEEDS = [feeds(0, 2, 16), feeds(1, 1, 7), feeds(2, 3, 5)]


def gqa_nodes(m: onnx.ModelProto) -> list:
    return [n for n in m.graph.node if n.domain == "com.microsoft" and n.op_type == "GroupQueryAttention"]


def attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("name", EXPORTS)
def test_llama_attention_becomes_group_query_attention_with_rotary_and_mask(name):
    m = llama(name)
    out, matches = optimize(m, PASSES)
    nodes = gqa_nodes(out)
    assert len(nodes) == 2 and matches >= 2
    for node in nodes:
        a = attrs(node)
        assert (a["num_heads"], a["kv_num_heads"], a["do_rotary"], a["causal"]) == (4, 2, 1, 0)
        assert a["scale"] == pytest.approx(0.25)
        # q, k, v projections packed into one MatMul the op reads; the mask is its attention_bias
        assert node.input[1] == node.input[2] == ""
        assert node.input[10] != ""
    ops = {n.op_type for n in out.graph.node}
    assert not ops & {"Softmax", "Neg", "Transpose"}
    assert_same(m, out, FEEDS)


def _replace_input(m: onnx.ModelProto, node, index: int, op_type: str, *others) -> None:
    """node.input[index] = op_type(node.input[index], *others), a new node before it."""
    name = f"{node.input[index]}_changed"
    at = list(m.graph.node).index(node)
    m.graph.node.insert(at, helper.make_node(op_type, [node.input[index], *others], [name], name=name))
    node.input[index] = name


@pytest.mark.parametrize("name", EXPORTS)
def test_rotary_caches_with_unequal_halves_stay_unfused(name):
    # cos = Cos(Concat(f, 2 f)): each half its own rows, which GroupQueryAttention's half-width
    # caches cannot hold.
    m = llama(name)
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two"))
    cat = next(n for n in m.graph.node if n.op_type == "Concat" and len(n.input) == 2 and n.input[0] == n.input[1])
    _replace_input(m, cat, 1, "Mul", "two")
    out, _ = optimize(m, PASSES)
    assert not gqa_nodes(out)
    assert_same(m, out, FEEDS[:2])


def test_rotate_half_not_at_the_middle_stays_unfused():
    # rotate_half split at d/4: Concat(-x[..., 4:], x[..., :4]) is not the rotary GroupQueryAttention applies
    m = llama("llama_dynamo")
    slices = [n for n in m.graph.node if n.op_type == "Slice" and n.input[0].startswith("transpose")]
    half = {n.input[2] for n in slices} & {n.input[1] for n in slices}
    assert len(half) == 1
    for init in m.graph.initializer:
        if init.name in half:
            init.CopyFrom(onnx.numpy_helper.from_array(np.array([4], np.int64), init.name))
    out, _ = optimize(m, PASSES)
    assert not gqa_nodes(out)
    assert_same(m, out, FEEDS[:2])


@pytest.mark.parametrize("name", EXPORTS)
def test_attention_probabilities_read_elsewhere_keep_their_layer_unfused(name):
    m = llama(name)
    softmax = next(n for n in m.graph.node if n.op_type == "Softmax")
    m.graph.output.append(helper.make_tensor_value_info(softmax.output[0], onnx.TensorProto.FLOAT, None))
    out, _ = optimize(m, PASSES)
    assert len(gqa_nodes(out)) == 1
    assert_same(m, out, FEEDS[:2])
