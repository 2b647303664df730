"""channel-shuffle: ShuffleNet's Concat -> channel shuffle -> Split (or Slices) as one
onnxfuse.ChannelShuffle node, the forms it leaves alone, and that the kernel moves every value
bit for bit (NaN payloads, signed zeros, infinities) where onnxruntime's original does."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import zoo
from onnxfuse.fused import DOMAIN
from onnxfuse.pipeline import Context, PassOptions, run_passes, select_passes
from onnxfuse.runtime import make_session

F = TensorProto.FLOAT
RNG = np.random.default_rng(16)


def shuffle_unit(c=8, hw=3, groups=2, concat=2, cut="split", split_sizes=None, opset=17, batch="batch",
                 targets=None, perm=(0, 2, 1, 3, 4), extra_reader=None):
    """Inputs X_i [batch, c_i, hw, hw] -> Concat -> Reshape [N, g, C/g, H, W] -> Transpose ->
    Reshape [N, C, H, W] -> cut, as torch.onnx writes ShuffleNetV2's units. `concat` inputs
    share the c channels (the last takes the remainder)."""
    nodes, inits = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    per = [c // concat] * (concat - 1) + [c - (c // concat) * (concat - 1)]
    inputs = [helper.make_tensor_value_info(f"X{i}", F, [batch, n, hw, hw]) for i, n in enumerate(per)]
    x = "X0"
    if concat > 1:
        nodes.append(helper.make_node("Concat", [f"X{i}" for i in range(concat)], ["cat"], name="concat", axis=1))
        x = "cat"
    t1, t2 = targets or ([-1, groups, c // groups, hw, hw], [-1, c, hw, hw])
    nodes.append(helper.make_node("Reshape", [x, const("t1", np.array(t1, np.int64))], ["r1"], name="unflatten"))
    nodes.append(helper.make_node("Transpose", ["r1"], ["tr"], name="transpose", perm=list(perm)))
    nodes.append(helper.make_node("Reshape", ["tr", const("t2", np.array(t2, np.int64))], ["y"], name="flatten"))
    outs = ["y"]
    if cut == "split":
        sizes = [const("sizes", np.array(split_sizes or [c // 2, c // 2], np.int64))]
        nodes.append(helper.make_node("Split", ["y"] + sizes, ["a", "b"], name="split", axis=1))
        outs = ["a", "b"]
    elif cut == "slices":
        half = c // 2
        for name, (s, e) in (("a", (0, half)), ("b", (half, c))):
            nodes.append(helper.make_node(
                "Slice", ["y", const(f"{name}_s", np.array([s], np.int64)), const(f"{name}_e", np.array([e], np.int64)),
                          const(f"{name}_ax", np.array([1], np.int64))], [name], name=f"slice_{name}"))
        outs = ["a", "b"]
    if extra_reader:
        outs.append(extra_reader)
    graph = helper.make_graph(nodes, "shuffle", inputs, [helper.make_tensor_value_info(o, F, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def optimize(model):
    ctx = Context(target="cpu", options=PassOptions.from_mapping({}))
    work = onnx.ModelProto()
    work.CopyFrom(model)
    out, stats = run_passes(work, select_passes(["channel-shuffle"], "cpu"), ctx)
    return out, {s.name: s.matches for s in stats}["channel-shuffle"]


def ops(model):
    return [n.op_type for n in model.graph.node]


def feeds(model, n=2, fill=None):
    out = {}
    for i in model.graph.input:
        shape = [n if d.dim_param else d.dim_value for d in i.type.tensor_type.shape.dim]
        out[i.name] = RNG.standard_normal(shape).astype(np.float32) if fill is None else fill(shape)
    return out


def run(model, x, with_library, threads=1):
    return make_session(model, with_library=with_library, threads=threads).run(None, x)


def assert_bitwise_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert np.array_equal(g.view(np.uint32), w.view(np.uint32))


@pytest.mark.parametrize("cut", ["split", "slices", "none"])
@pytest.mark.parametrize("concat", [1, 2, 3])
def test_concat_shuffle_and_cut_become_one_node_whose_kernel_and_fallback_are_exact(cut, concat):
    m = shuffle_unit(c=12, concat=concat, cut=cut)
    out, count = optimize(m)
    assert count == 1 and ops(out) == ["ChannelShuffle"]
    node = out.graph.node[0]
    assert node.domain == DOMAIN and len(node.input) == concat and len(node.output) == (1 if cut == "none" else 2)
    assert [a.i for a in node.attribute if a.name == "groups"] == [2]
    x = feeds(m)
    want = run(m, x, with_library=False)
    assert_bitwise_equal(run(out, x, with_library=True), want)
    assert_bitwise_equal(run(out, x, with_library=False), want)  # the fallback function, no library


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("groups", [3, 4])
def test_more_groups_and_batch_of_several_images_are_exact(groups, threads):
    # 3 images of 24 channels: 72 planes, copied in blocks spread over the intra-op threads
    m = shuffle_unit(c=24, hw=5, groups=groups, concat=2, cut="split")
    out, count = optimize(m)
    assert count == 1
    x = feeds(m, n=3)
    assert_bitwise_equal(run(out, x, with_library=True, threads=threads), run(m, x, with_library=False))


def test_special_values_and_nan_payloads_move_bit_for_bit():
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-40, 3.5, np.nan], np.float32)
    bits = specials.view(np.uint32).copy()
    bits[-1] = 0x7FC01234  # a NaN with a payload: a copy keeps it
    specials = bits.view(np.float32)

    def fill(shape):
        size = int(np.prod(shape))
        return np.resize(specials, size).reshape(shape)

    m = shuffle_unit(c=16, hw=4, concat=2, cut="split")
    out, count = optimize(m)
    assert count == 1
    x = feeds(m, fill=fill)
    assert_bitwise_equal(run(out, x, with_library=True), run(m, x, with_library=False))


def test_shuffle_read_elsewhere_keeps_the_cut_outside():
    m = shuffle_unit(c=8, cut="split", extra_reader="y")
    out, count = optimize(m)
    assert count == 1 and sorted(ops(out)) == ["ChannelShuffle", "Split"]
    x = feeds(m)
    assert_bitwise_equal(run(out, x, with_library=True), run(m, x, with_library=False))


def test_concat_read_elsewhere_stays_outside():
    m = shuffle_unit(c=8, cut="split", extra_reader="cat")
    out, count = optimize(m)
    assert count == 1 and sorted(ops(out)) == ["ChannelShuffle", "Concat"]
    node = next(n for n in out.graph.node if n.op_type == "ChannelShuffle")
    assert list(node.input) == ["cat"]


def test_unequal_split_stays_outside():
    m = shuffle_unit(c=8, cut="split", split_sizes=[2, 6])
    out, count = optimize(m)
    assert count == 1 and sorted(ops(out)) == ["ChannelShuffle", "Split"]
    x = feeds(m)
    assert_bitwise_equal(run(out, x, with_library=True), run(m, x, with_library=False))


@pytest.mark.parametrize("case", ["perm", "first_target", "second_target", "symbolic_channels"])
def test_what_is_not_a_channel_shuffle_is_left_alone(case):
    if case == "perm":
        m = shuffle_unit(c=8, perm=(0, 1, 2, 4, 3))
    elif case == "first_target":  # [N, 2, 12, 3, 1]: the transposed axis mixes channels and rows
        m = shuffle_unit(c=8, targets=([-1, 2, 12, 3, 1], [-1, 8, 3, 3]))
    elif case == "second_target":  # the shuffled tensor flattened into the width
        m = shuffle_unit(c=8, targets=([-1, 2, 4, 3, 3], [-1, 4, 3, 6]), cut="none")
    else:
        m = shuffle_unit(c=8, concat=1, cut="none")
        m.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "channels"
    out, count = optimize(m)
    assert count == 0 and "ChannelShuffle" not in ops(out)


def test_odd_channel_count_is_not_fused_and_the_kernel_refuses_it():
    # 2 groups of 7 channels cannot be made: the original Reshape fails, so nothing is fused.
    m = shuffle_unit(c=7, concat=1, cut="none", targets=([-1, 2, 3, 3, 3], [-1, 7, 3, 3]))
    out, count = optimize(m)
    assert count == 0
    # A ChannelShuffle node given 7 channels at run time refuses them with a message.
    ok = shuffle_unit(c=8, concat=1, cut="none")
    fused, count = optimize(ok)
    assert count == 1
    fused.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 7
    for vi in list(fused.graph.value_info):
        fused.graph.value_info.remove(vi)
    del fused.graph.output[0].type.tensor_type.shape.dim[:]
    with pytest.raises(Exception, match="7 channels do not divide into 2 groups"):
        run(fused, {"X0": np.zeros((1, 7, 3, 3), np.float32)}, with_library=True)


def test_dynamo_opset18_split_without_sizes_is_cut_in_halves():
    m = shuffle_unit(c=8, cut="split", opset=18)
    split = next(n for n in m.graph.node if n.op_type == "Split")
    del split.input[1:]
    split.attribute.append(helper.make_attribute("num_outputs", 2))
    out, count = optimize(m)
    assert count == 1 and ops(out) == ["ChannelShuffle"]
    x = feeds(m)
    assert_bitwise_equal(run(out, x, with_library=True), run(m, x, with_library=False))


@pytest.mark.parametrize("name", ["shufflenet_v2_ts", "shufflenet_v2_dynamo"])
def test_pass_fuses_every_shufflenet_v2_unit_of_both_exports(name):
    from onnxfuse.api import optimize as optimize_model

    model = zoo.get(name)
    result = optimize_model(model.load(), dims=model.dims or None, threads=1, count_kernels=False, verify_outputs=False,
                            label=model.uri)
    shuffles = [n for n in result.model.graph.node if n.op_type == "ChannelShuffle"]
    # 16 units (stages of 4, 8 and 4): each unit's shuffle, with the next unit's split where
    # one reads it (13 of them)
    assert len(shuffles) == 16
    assert sum(len(n.output) == 2 for n in shuffles) == 13
    assert not any(n.op_type == "Transpose" for n in result.model.graph.node)
