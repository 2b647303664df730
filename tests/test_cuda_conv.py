"""The ConvBiasAct CUDA kernels: the numpy model of their tiling against onnxruntime's Conv on every
zoo conv layer shape class, the generated source compiled for sm_90 (ptxas report), the tile
heuristic, and -- on a machine with a GPU and pycuda -- the kernels themselves."""
from __future__ import annotations

import functools
import os
import shutil

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxfuse.cuda import conv_model
from onnxfuse.cuda.conv_codegen import generate, generate_depthwise, generate_gemm
from onnxfuse.cuda.conv_plan import (
    DEPTHWISE_TILES,
    GEMM_TILES,
    H100_SMS,
    TENSOR_TILES,
    INDEX,
    ConvShape,
    DepthwiseTile,
    Epilogue,
    GemmTile,
    TensorTile,
    heuristic_tile,
)
from onnxfuse.cuda.conv_tune import ptxas_check
from onnxfuse.runtime import make_session

RNG = np.random.default_rng(7)
ZOO_CNNS = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
            "vgg19", "zfnet512", "mobilenetv3"]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not on PATH")


@functools.lru_cache(maxsize=None)
def zoo_layers() -> tuple:
    """(model, node, ConvShape, Epilogue or None) of every Conv of the zoo CNNs, after BN folding."""
    from onnxfuse.normalize import normalize
    from onnxfuse.zoo import resolve_input
    from onnxfuse.passes.conv_bias_act import conv_layers

    out = []
    for name in ZOO_CNNS:
        model = normalize(resolve_input(f"zoo:{name}")).model
        out += [(name, node, shape, epi) for node, shape, epi in conv_layers(model)]
    return tuple(out)


# One real layer of each class of conv the zoo CNNs hold (kernel, stride, which pads are non-zero,
# dilation, dense / grouped / depthwise); test_zoo_classes_are_all_listed (slow) keeps it honest.
ZOO_CLASS_LAYERS = [
    ConvShape(3, 224, 224, 96, 11, 11, (4, 4), (0, 0, 0, 0), (1, 1), 1),  # bvlc_alexnet
    ConvShape(96, 26, 26, 256, 5, 5, (1, 1), (2, 2, 2, 2), (1, 1), 2),  # bvlc_alexnet
    ConvShape(256, 12, 12, 384, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1),  # bvlc_alexnet
    ConvShape(384, 12, 12, 384, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 2),  # bvlc_alexnet
    ConvShape(3, 224, 224, 64, 7, 7, (2, 2), (3, 3, 3, 3), (1, 1), 1),  # densenet121
    ConvShape(64, 56, 56, 128, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),  # densenet121
    ConvShape(16, 27, 27, 32, 5, 5, (1, 1), (2, 2, 2, 2), (1, 1), 1),  # inception_v1
    ConvShape(128, 28, 28, 160, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 1),  # inception_v2
    ConvShape(256, 56, 56, 512, 1, 1, (2, 2), (0, 0, 0, 0), (1, 1), 1),  # resnet50
    ConvShape(24, 56, 56, 112, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 4),  # shufflenet
    ConvShape(112, 56, 56, 112, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 112),  # shufflenet
    ConvShape(136, 28, 28, 136, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 136),  # shufflenet
    ConvShape(3, 224, 224, 64, 3, 3, (2, 2), (0, 0, 0, 0), (1, 1), 1),  # squeezenet
    ConvShape(3, 224, 224, 96, 7, 7, (2, 2), (0, 0, 0, 0), (1, 1), 1),  # zfnet512
    ConvShape(96, 54, 54, 256, 5, 5, (2, 2), (0, 0, 0, 0), (1, 1), 1),  # zfnet512
    ConvShape(96, 8, 8, 96, 5, 5, (2, 2), (2, 2, 2, 2), (1, 1), 96),  # mobilenetv3
    ConvShape(240, 4, 4, 240, 5, 5, (1, 1), (2, 2, 2, 2), (1, 1), 240),  # mobilenetv3
]


def shape_class(s: ConvShape) -> tuple:
    kind = "depthwise" if s.depthwise else ("grouped" if s.group > 1 else "dense")
    return (s.r, s.s, s.stride, tuple(int(p > 0) for p in s.pads), s.dilation, kind)


def reduced(s: ConvShape) -> ConvShape:
    """The same class (kernel, stride, padding, dilation, grouping) with few channels and a small
    image, so the numpy model stays fast; channel counts keep tiles partly filled."""
    g = 1 if s.group == 1 else (s.group if s.depthwise else 2)
    if s.depthwise:
        c = k = 6
        g = 6
    else:
        c, k = 3 * g + (g if s.cg > 1 else 0), 5 * g
    size = max(s.dilation[0] * (s.r - 1) + 1, 2 * s.stride[0] + 5)
    return ConvShape(c, size, size + 1, k, s.r, s.s, s.stride, s.pads, s.dilation, g)


def _epilogue_nodes(epi: Epilogue, v: str) -> tuple[list, str, list]:
    """The epilogue as the ONNX ops it replaces, reading tensor `v` (and "z", the residual):
    (nodes, their output, the initializers they read)."""
    nodes = []
    act = epi.activation
    if act != "none":
        if act == "silu":
            nodes += [helper.make_node("Sigmoid", [v], ["sg"]), helper.make_node("Mul", [v, "sg"], ["a"])]
        elif act == "clip":
            nodes += [helper.make_node("Clip", [v, "lo", "hi"], ["a"])]
        else:
            op = {"relu": "Relu", "leakyrelu": "LeakyRelu", "sigmoid": "Sigmoid", "hardsigmoid": "HardSigmoid",
                  "tanh": "Tanh", "hardswish": "HardSwish"}[act]
            attrs = {"leakyrelu": {"alpha": epi.alpha}, "hardsigmoid": {"alpha": epi.alpha, "beta": epi.beta}}.get(act, {})
            nodes += [helper.make_node(op, [v], ["a"], **attrs)]
        v = "a"
    if epi.residual:
        nodes += [helper.make_node("Add", [v, "z"], ["r"])]
        v = "r"
    if epi.post_relu:
        nodes += [helper.make_node("Relu", [v], ["pr"])]
        v = "pr"
    inits = [helper.make_tensor("lo", TensorProto.FLOAT, [], [epi.alpha]),
             helper.make_tensor("hi", TensorProto.FLOAT, [], [epi.beta])] if act == "clip" else []
    return nodes, v, inits


def _run_ort(nodes, out: str, inits, feeds: dict):
    nodes = [*nodes, helper.make_node("Identity", [out], ["y"])]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in feeds],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return make_session(m, with_library=False, level="disable").run(None, feeds)[0]


def ort_reference(shape: ConvShape, epi: Epilogue, x, w, b, z=None):
    """onnxruntime (CPU, no graph optimizations) running Conv and the epilogue as ONNX ops."""
    conv = helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=list(shape.stride), pads=list(shape.pads),
                            dilations=list(shape.dilation), group=shape.group)
    nodes, out, inits = _epilogue_nodes(epi, "c")
    feeds = {"x": x, "w": w, "b": b, **({"z": z} if epi.residual else {})}
    return _run_ort([conv, *nodes], out, inits, feeds)


def random_problem(shape: ConvShape, epi: Epilogue, batch: int = 2):
    x = RNG.standard_normal((batch, shape.c, shape.h, shape.w)).astype(np.float32)
    w = (RNG.standard_normal((shape.k, shape.cg, shape.r, shape.s)) / np.sqrt(shape.kred)).astype(np.float32)
    b = RNG.standard_normal(shape.k).astype(np.float32)
    z = RNG.standard_normal((batch, shape.k, shape.p, shape.q)).astype(np.float32) if epi.residual else None
    return x, w, b, z


EPILOGUES = [
    Epilogue("relu"),
    Epilogue("none", residual=True, post_relu=True),
    Epilogue("leakyrelu", 0.1),
    Epilogue("clip", 0.0, 6.0),
    Epilogue("sigmoid"),
    Epilogue("hardsigmoid", 0.2, 0.5),
    Epilogue("hardswish", 1 / 6, 0.5, residual=True),
    Epilogue("tanh"),
    Epilogue("silu", residual=True),
]

# Classes the zoo lacks but the kernels must handle: dilation, asymmetric padding, channel multiplier.
EXTRA_SHAPES = [
    ConvShape(6, 13, 12, 10, 3, 3, (1, 1), (2, 2, 2, 2), (2, 2), 2),
    ConvShape(5, 12, 11, 7, 3, 2, (2, 1), (0, 1, 1, 0), (1, 3), 1),
    ConvShape(4, 9, 9, 8, 3, 3, (1, 2), (1, 1, 1, 1), (1, 1), 4),  # depthwise, 2 outputs per input channel
    ConvShape(6, 7, 7, 6, 5, 5, (1, 1), (2, 2, 2, 2), (2, 2), 6),
]


@pytest.mark.slow
def test_zoo_classes_are_all_listed():
    """Every Conv of the zoo CNNs is matched, and ZOO_CLASS_LAYERS has exactly the zoo's classes."""
    layers = zoo_layers()
    assert len(layers) == 438
    assert {shape_class(s) for _, _, s, _ in layers} == {shape_class(s) for s in ZOO_CLASS_LAYERS}
    assert {shape_class(s) for s in ZOO_CLASS_LAYERS} and len(ZOO_CLASS_LAYERS) == len(
        {shape_class(s) for s in ZOO_CLASS_LAYERS})


def test_tiling_model_matches_onnxruntime_on_every_zoo_layer_class():
    """For each class of zoo conv layer, the numpy model of the generated kernel (heuristic tile
    and a second candidate) with a rotating epilogue equals onnxruntime's Conv + epilogue."""
    shapes = [reduced(s) for s in ZOO_CLASS_LAYERS] + EXTRA_SHAPES
    for i, shape in enumerate(shapes):
        epi = EPILOGUES[i % len(EPILOGUES)]
        x, w, b, z = random_problem(shape, epi)
        expected = ort_reference(shape, epi, x, w, b, z)
        tiles = {heuristic_tile(shape)}
        tiles.add(DEPTHWISE_TILES[-1] if shape.depthwise else GEMM_TILES[(i % (len(GEMM_TILES) - 1)) + 1])
        for tile in tiles:
            got = conv_model.run(shape, epi, tile, x, w, b, z)
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"{shape} {epi} {tile}")


@pytest.mark.parametrize("tile", GEMM_TILES, ids=lambda t: "x".join(map(str, t.as_list())))
def test_every_gemm_tile_handles_partial_tiles(tile):
    """Output channels, pixels and the reduction all end mid-tile."""
    shape = ConvShape(7, 9, 10, 19, 3, 3, (1, 1), (1, 1, 1, 1))
    epi = Epilogue("silu", residual=True, post_relu=True)
    x, w, b, z = random_problem(shape, epi, batch=3)
    np.testing.assert_allclose(conv_model.run(shape, epi, tile, x, w, b, z), ort_reference(shape, epi, x, w, b, z),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tile", [t.split(s) for t in GEMM_TILES[3:] for s in (2, 4, 8)],
                         ids=lambda t: "x".join(map(str, t.as_list())))
def test_split_k_tiles_sum_every_slice_once(tile):
    """Split-K over a cluster: reductions that end mid-slice, splits left without slices (8
    splits of 5 slices), groups, and every output stored by exactly one block of the cluster
    (the model raises otherwise)."""
    for shape, batch in ((ConvShape(9, 9, 10, 19, 3, 3, (1, 1), (1, 1, 1, 1)), 3),
                         (ConvShape(40, 6, 6, 24, 3, 3, (2, 2), (1, 1, 1, 1), group=2), 2)):
        epi = Epilogue("silu", residual=True, post_relu=True)
        x, w, b, z = random_problem(shape, epi, batch=batch)
        np.testing.assert_allclose(conv_model.run(shape, epi, tile, x, w, b, z), ort_reference(shape, epi, x, w, b, z),
                                   rtol=1e-4, atol=1e-4, err_msg=str(shape))


def test_split_k_source_declares_its_cluster_and_grid():
    s = ConvShape(512, 7, 7, 512, 3, 3, (1, 1), (1, 1, 1, 1))
    t = heuristic_tile(s, clusters=True)
    assert t.splitk > 1 and heuristic_tile(s, clusters=False).splitk == 1
    k = generate(s, Epilogue("relu"), clusters=True)
    assert f"__cluster_dims__(1, 1, {t.splitk})" in k.source and k.grid(1)[2] == t.splitk
    for name, expr in INDEX["split"]:
        assert f"{name} = {expr};" in k.source
    assert "__cluster_dims__" not in generate(s, Epilogue("relu")).source


@pytest.mark.parametrize("tile", list(TENSOR_TILES) + [t.split(s) for t in TENSOR_TILES[1:] for s in (2, 8)],
                         ids=lambda t: "x".join(map(str, t.as_list())))
def test_tensor_core_tiles_keep_float32_accuracy(tile):
    """3xTF32 on tensor cores (the model emulates TF32 rounding and the three MMAs): partial
    tiles in every dimension, strides, groups, split-K, every output stored once, and the result
    within float32 accuracy of onnxruntime's Conv (the issue's bound is 1e-4 relative)."""
    for shape, batch in ((ConvShape(9, 9, 10, 19, 3, 3, (1, 1), (1, 1, 1, 1)), 3),
                         (ConvShape(40, 6, 6, 24, 3, 3, (2, 2), (1, 1, 1, 1), group=2), 2),
                         (ConvShape(96, 7, 7, 40, 1, 1), 1)):
        epi = Epilogue("silu", residual=True, post_relu=True)
        x, w, b, z = random_problem(shape, epi, batch=batch)
        got = conv_model.run(shape, epi, tile, x, w, b, z)
        want = ort_reference(shape, epi, x, w, b, z)
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max(), (shape, tile)


def test_tf32_rounding_is_to_nearest_with_ties_away_from_zero():
    one_ulp = np.float32(2.0 ** -10)  # TF32 keeps 10 explicit mantissa bits
    v = np.array([1.0, 1 + one_ulp / 2, 1 + one_ulp / 4, -(1 + one_ulp / 2), 1 + 3 * one_ulp / 4], np.float32)
    np.testing.assert_array_equal(conv_model.tf32(v), np.array([1.0, 1 + one_ulp, 1.0, -(1 + one_ulp), 1 + one_ulp],
                                                               np.float32))
    x = RNG.standard_normal(1000).astype(np.float32)
    big = conv_model.tf32(x)
    assert np.all(np.abs(x - big) <= np.abs(x) * 2.0 ** -11) and np.all(big.view(np.uint32) & 0x1FFF == 0)


def test_one_tf32_product_misses_the_bound_that_3xtf32_meets():
    """Why three MMAs: on a resnet50-sized reduction (K = 4608) plain TF32 is ~1e-3 off."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 4608)).astype(np.float32)
    b = (rng.standard_normal((4608, 49)) / 68).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(exact).max()
    t = conv_model.tf32
    plain = t(a).astype(np.float64) @ t(b).astype(np.float64)
    a_s, b_s = t(a - t(a)), t(b - t(b))
    three = plain + t(a).astype(np.float64) @ b_s.astype(np.float64) + a_s.astype(np.float64) @ t(b).astype(np.float64)
    assert np.abs(plain - exact).max() > 1e-4 * scale
    assert np.abs(three - exact).max() < 1e-6 * scale


def test_a_tiling_mistake_is_caught_by_the_model():
    """The model reads shared memory only where the kernel's load mapping wrote it: a slice that
    leaves a hole is poison (NaN) in the result, not a silent zero."""
    import onnxfuse.cuda.conv_plan as cg

    shape = ConvShape(4, 6, 6, 8, 3, 3, (1, 1), (1, 1, 1, 1))
    x, w, b, _ = random_problem(shape, Epilogue())
    good = dict(cg.INDEX)
    try:
        cg.INDEX["b_load"] = [(n, "DIV(e, BN) + 1" if n == "bkk" else e) for n, e in good["b_load"]]
        got = conv_model.run(shape, Epilogue(), GemmTile(32, 32, 16, 2, 4), x, w, b)
    except IndexError:
        got = None  # writing past the slice is caught too
    finally:
        cg.INDEX.update(good)
    assert got is None or not np.allclose(got, ort_reference(shape, Epilogue(), x, w, b), rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------ the epilogue's special values

# Epilogues of ops onnxruntime computes exactly (no elementary function): the kernels must give
# its bits, signed zeros, NaN and infinities included.
EXACT_EPILOGUES = [
    Epilogue("relu"),
    Epilogue("leakyrelu", 0.1),
    Epilogue("clip", 0.0, 6.0),
    Epilogue("hardsigmoid", 0.2, 0.5),
    Epilogue("hardswish", 1 / 6, 0.5, residual=True, post_relu=True),
    Epilogue("leakyrelu", 1e-30, residual=True, post_relu=True),
    Epilogue("none", residual=True, post_relu=True),
]
SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.2e-38, -1.2e-38, -10.0, 10.0, -3.0, 3.0,
                     -0.5, 0.5, 3e38, -3e38], np.float32)


def _bits(a) -> np.ndarray:
    """The float32 bits, every NaN as one (its sign and payload are not compared)."""
    a = np.asarray(a, np.float32)
    return np.where(np.isnan(a), np.uint32(0x7FC00000), a.view(np.uint32))


def _special_pairs() -> tuple[np.ndarray, np.ndarray]:
    """Every (value, residual) pair of special values."""
    return np.repeat(SPECIALS, len(SPECIALS)), np.tile(SPECIALS, len(SPECIALS))


def _ort_epilogue(epi: Epilogue, v, z):
    nodes, out, inits = _epilogue_nodes(epi, "v")
    return _run_ort(nodes, out, inits, {"v": v, **({"z": z} if epi.residual else {})})


def test_every_store_site_prints_the_epilogue_program():
    """The kernels apply the epilogue through the Pointwise printer, so the CUDA code and the
    numpy model share one meaning of each op: no hand-written activation (fmaxf turned -0 into
    +0 and dropped NaN where onnxruntime keeps them)."""
    from onnxfuse.cuda.codegen import body_lines

    gemm = ConvShape(8, 6, 6, 16, 3, 3, (1, 1), (1, 1, 1, 1))
    dw = ConvShape(8, 6, 6, 8, 3, 3, (1, 1), (1, 1, 1, 1), group=8)
    for epi in EPILOGUES + EXACT_EPILOGUES:
        body, _ = body_lines(epi.program(), ["v", *(["a.z[dst]"] if epi.residual else [])], "f32", "", prefix="ep_")
        for k in (generate_gemm(gemm, epi, GEMM_TILES[0]), generate(gemm, epi, TENSOR_TILES[0]),
                  generate(gemm, epi, GEMM_TILES[3].split(2)), generate_depthwise(dw, epi, DEPTHWISE_TILES[0])):
            lines = [line.strip() for line in k.source.splitlines()]
            assert all(line in lines for line in body), (epi, k.kind)
            assert "fmaxf(" not in k.source and "fminf(" not in k.source


@pytest.mark.parametrize("epi", EXACT_EPILOGUES, ids=str)
def test_epilogue_program_matches_onnxruntime_bit_for_bit_on_special_values(epi):
    v, z = _special_pairs()
    got = epi.program().evaluate(v, *([z] if epi.residual else []))[0]
    np.testing.assert_array_equal(_bits(got), _bits(_ort_epilogue(epi, v, z)))


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_printed_epilogue_matches_onnxruntime_bit_for_bit_on_special_values(tmp_path):
    """The CUDA C the kernels hold, compiled for the host (onnxfuse/cuda/hostsim.py)."""
    from onnxfuse.cuda import codegen
    from onnxfuse.cuda.hostsim import HostKernels

    kernels = [codegen.generate(epi.program(), 1) for epi in EXACT_EPILOGUES]
    host = HostKernels(kernels, str(tmp_path))
    v, z = _special_pairs()
    for epi, k in zip(EXACT_EPILOGUES, kernels):
        (got,) = host.run(epi.program(), k, [v, *([z] if epi.residual else [])], [np.float32])
        np.testing.assert_array_equal(_bits(got), _bits(_ort_epilogue(epi, v, z)), err_msg=str(epi))


# A Relu after a residual Add of -0 to a hard-swish's -0 (onnxruntime's Relu keeps it), and a Clip
# of NaN (onnxruntime's Clip lets it through).
SIGNED_ZERO_EPILOGUES = [Epilogue("hardswish", 1 / 6, 0.5, residual=True, post_relu=True), Epilogue("clip", 0.0, 6.0)]


def _signed_zero_problem(epi: Epilogue, depthwise: bool = False):
    """A convolution whose outputs all lie below -3 (hard-swish gives -0 there), a residual of
    -0 and one NaN in the input: (shape, x, w, b, z)."""
    rng = np.random.default_rng(3)
    shape = ConvShape(4, 6, 6, 4 if depthwise else 8, 3, 3, (1, 1), (1, 1, 1, 1), group=4 if depthwise else 1)
    x = rng.uniform(0, 1, (2, shape.c, shape.h, shape.w)).astype(np.float32)
    x[1, 1, 2, 3] = np.nan
    w = rng.uniform(0, 0.1, (shape.k, shape.cg, shape.r, shape.s)).astype(np.float32)
    b = np.full(shape.k, -10.0, np.float32)
    z = np.full((2, shape.k, shape.p, shape.q), -0.0, np.float32) if epi.residual else None
    return shape, x, w, b, z


@pytest.mark.parametrize("epi", SIGNED_ZERO_EPILOGUES, ids=str)
def test_kernel_model_keeps_negative_zero_and_nan_as_onnxruntime(epi):
    shape, x, w, b, z = _signed_zero_problem(epi)
    want = ort_reference(shape, epi, x, w, b, z)
    assert np.isnan(want).any() and (np.signbit(want) & ~np.isnan(want)).any() == epi.residual
    for tile in (GEMM_TILES[0], TENSOR_TILES[0], heuristic_tile(shape)):
        np.testing.assert_array_equal(_bits(conv_model.run(shape, epi, tile, x, w, b, z)), _bits(want), err_msg=str(tile))
    shape, x, w, b, z = _signed_zero_problem(epi, depthwise=True)
    got = conv_model.run(shape, epi, DEPTHWISE_TILES[0], x, w, b, z)
    np.testing.assert_array_equal(_bits(got), _bits(ort_reference(shape, epi, x, w, b, z)))


def test_index_expressions_appear_verbatim_in_the_source():
    s = ConvShape(16, 12, 12, 32, 3, 3, (2, 2), (1, 1, 1, 1))
    gemm = generate_gemm(s, Epilogue("relu"), GEMM_TILES[3]).source
    for table in ("a_load", "b_load", "thread", "store"):
        for name, expr in INDEX[table]:
            assert f"{name} = {expr};" in gemm
    dw = generate_depthwise(ConvShape(8, 12, 12, 8, 3, 3, group=8), Epilogue("relu"), DEPTHWISE_TILES[0]).source
    for table in ("dw_out", "dw_tap"):
        for name, expr in INDEX[table]:
            assert f"{name} = {expr};" in dw


def test_heuristic_fills_the_gpu_when_the_layer_allows():
    big = ConvShape(64, 112, 112, 256, 3, 3, (1, 1), (1, 1, 1, 1))
    t = heuristic_tile(big)
    assert t == GEMM_TILES[0]  # 128x128 tiles: 2 x 98 blocks already fill every SM
    assert heuristic_tile(ConvShape(64, 56, 56, 256, 3, 3, (1, 1), (1, 1, 1, 1))) != GEMM_TILES[0]  # 50 blocks
    small = ConvShape(512, 7, 7, 512, 3, 3, (1, 1), (1, 1, 1, 1))
    t = heuristic_tile(small)
    blocks = -(-512 // t.bm) * -(-49 // t.bn)
    assert blocks >= max(-(-512 // g.bm) * -(-49 // g.bn) for g in GEMM_TILES if g.bn >= 64) or blocks >= H100_SMS
    assert isinstance(heuristic_tile(ConvShape(96, 16, 16, 96, 5, 5, (1, 1), (2, 2, 2, 2), group=96)), DepthwiseTile)
    kernel = generate(big, Epilogue("relu"))
    assert kernel.grid(4) == (-(-4 * 112 * 112 // 128), 2, 1)


def _representative_kernels():
    kernels = [generate(s, EPILOGUES[i % len(EPILOGUES)]) for i, s in enumerate(ZOO_CLASS_LAYERS + EXTRA_SHAPES)]
    # every tile candidate and every epilogue at least once
    s = ConvShape(64, 28, 28, 128, 3, 3, (1, 1), (1, 1, 1, 1))
    kernels += [generate_gemm(s, EPILOGUES[i % len(EPILOGUES)], t) for i, t in enumerate(GEMM_TILES)]
    deep = ConvShape(512, 7, 7, 512, 3, 3, (1, 1), (1, 1, 1, 1))  # split-K over clusters
    kernels += [generate_gemm(deep, EPILOGUES[i % len(EPILOGUES)], t.split(s))
                for i, t in enumerate(GEMM_TILES[3:]) for s in (2, 8)]
    kernels += [generate(deep, EPILOGUES[i % len(EPILOGUES)], t) for i, t in enumerate(TENSOR_TILES)]
    kernels += [generate(deep, EPILOGUES[i % len(EPILOGUES)], t.split(8)) for i, t in enumerate(TENSOR_TILES[1:])]
    dw = ConvShape(96, 28, 28, 96, 3, 3, (2, 2), (1, 1, 1, 1), group=96)
    kernels += [generate_depthwise(dw, e, t) for e, t in zip(EPILOGUES, DEPTHWISE_TILES * 3)]
    return kernels


@needs_nvcc
def test_generated_kernels_compile_for_sm90_without_spills():
    kernels = _representative_kernels()
    report = ptxas_check(kernels, "sm_90")
    assert set(report) == {k.entry for k in kernels}
    for k in kernels:
        info = report[k.entry]
        assert info.spill_stores == 0 and info.spill_loads == 0, info
        assert info.registers * k.threads <= 65536, info  # one block fits the register file
        assert info.smem_bytes == k.smem_bytes, info


@needs_nvcc
def test_tensor_core_kernels_without_split_compile_for_sm80():
    """TF32 WMMA needs sm_80; clusters (split-K) need sm_90, so sm_80 gets unsplit tiles."""
    s = ConvShape(256, 14, 14, 256, 3, 3, (1, 1), (1, 1, 1, 1))
    t = heuristic_tile(s, clusters=False, tensor_cores=True)
    assert isinstance(t, TensorTile) and t.splitk == 1
    kernels = [generate(s, Epilogue("relu"), t) for t in TENSOR_TILES]
    report = ptxas_check(kernels, "sm_80")
    assert all(report[k.entry].spill_stores == 0 for k in kernels)


@pytest.mark.slow
@needs_nvcc
def test_every_zoo_conv_layer_compiles_for_sm90():
    kernels = [generate(s, e or Epilogue()) for _, _, s, e in zoo_layers()]
    report = ptxas_check(kernels, "sm_90")
    assert all(report[k.entry].spill_stores == 0 for k in kernels)


# ------------------------------------------------------------------------------ on a GPU


def _gpu():
    try:
        import pycuda.autoinit  # noqa: F401
        import pycuda.driver as drv
    except Exception as e:  # ImportError, or no driver / device
        pytest.skip(f"needs pycuda and a CUDA device: {type(e).__name__}: {e}")
    return drv


@pytest.mark.gpu
@pytest.mark.parametrize("shape", EXTRA_SHAPES + [ConvShape(64, 56, 56, 64, 3, 3, (1, 1), (1, 1, 1, 1)),
                                                   ConvShape(96, 28, 28, 96, 5, 5, (2, 2), (2, 2, 2, 2), group=96),
                                                   ConvShape(256, 7, 7, 128, 3, 3, (1, 1), (1, 1, 1, 1)),
                                                   ConvShape(256, 5, 5, 64, 3, 3, (1, 1), (1, 1, 1, 1), group=2)])
def test_kernel_on_gpu_matches_onnxruntime(shape):
    """Every candidate tile, split-K over thread-block clusters and 3xTF32 tensor cores included."""
    drv = _gpu()
    from onnxfuse.cuda.conv_plan import candidates

    epi = Epilogue("hardswish", 1 / 6, 0.5, residual=True, post_relu=True)
    x, w, b, z = random_problem(shape, epi, batch=2)
    expected = ort_reference(shape, epi, x, w, b, z)
    tiles = candidates(shape, 2, clusters=True, tensor_cores=True)
    kernels = [generate(shape, epi, tile) for tile in tiles]
    for tile, y in zip(tiles, _run_on_gpu(drv, kernels, x, w, b, z)):
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4, err_msg=str(tile))


def _run_on_gpu(drv, kernels, x, w, b, z) -> list[np.ndarray]:
    """Each kernel's output for the same inputs (z None: no residual), compiled in one module."""
    from pycuda.compiler import SourceModule

    module = SourceModule("\n".join({k.entry: k.source for k in kernels}.values()), no_extern_c=True, options=["-O3"])
    outs = []
    batch = x.shape[0]
    for k in kernels:
        fn = module.get_function(k.entry)
        kk, p, q = k.output_kpq
        y = np.zeros((batch, kk, p, q), np.float32)
        bufs = [drv.to_device(a) for a in (x, w, b)]
        zd = drv.to_device(z) if z is not None else None
        yd = drv.mem_alloc(y.nbytes)
        words = np.array([int(p) for p in bufs] + [int(zd) if zd is not None else 0, int(yd), batch], dtype=np.uint64)
        fn(np.frombuffer(words.tobytes(), dtype=np.dtype((np.void, words.nbytes)))[0],
           block=(k.threads, 1, 1), grid=k.grid(batch))
        drv.memcpy_dtoh(y, yd)
        outs.append(y)
    return outs


@pytest.mark.gpu
def test_kernel_on_gpu_keeps_negative_zero_and_nan_as_onnxruntime():
    """Relu after a residual keeps -0 and Clip lets NaN through, as onnxruntime's ops do: every
    kind of kernel, bit for bit."""
    drv = _gpu()
    for epi in SIGNED_ZERO_EPILOGUES:
        shape, x, w, b, z = _signed_zero_problem(epi)
        tiles = [GEMM_TILES[0], TENSOR_TILES[0], heuristic_tile(shape)]
        dw_shape, dx, dwt, db, dz = _signed_zero_problem(epi, depthwise=True)
        got = _run_on_gpu(drv, [generate(shape, epi, t) for t in tiles], x, w, b, z)
        want = ort_reference(shape, epi, x, w, b, z)
        for tile, y in zip(tiles, got):
            np.testing.assert_array_equal(_bits(y), _bits(want), err_msg=f"{epi} {tile}")
        (y,) = _run_on_gpu(drv, [generate(dw_shape, epi, DEPTHWISE_TILES[0])], dx, dwt, db, dz)
        np.testing.assert_array_equal(_bits(y), _bits(ort_reference(dw_shape, epi, dx, dwt, db, dz)), err_msg=str(epi))


@pytest.mark.gpu
def test_tune_times_every_candidate():
    _gpu()
    from onnxfuse.cuda.conv_tune import tune

    from onnxfuse.cuda.conv_plan import candidates

    shape = ConvShape(64, 28, 28, 64, 3, 3, (1, 1), (1, 1, 1, 1))
    best, table = tune(shape, Epilogue("relu"), batch=1, repeats=3)
    tiles = candidates(shape, 1, clusters=True, tensor_cores=True)
    assert [t for t, _ in table] == list(tiles) and best in tiles and all(ms > 0 for _, ms in table)
    assert any(t.splitk > 1 for t in tiles) and any(isinstance(t, TensorTile) for t in tiles)


def test_tune_without_a_gpu_says_so():
    if os.environ.get("CUDA_VISIBLE_DEVICES", "") != "" and shutil.which("nvidia-smi"):
        pytest.skip("a GPU may be present")
    from onnxfuse.cuda.conv_tune import tune

    try:
        import pycuda.autoinit  # noqa: F401

        pytest.skip("pycuda has a device here")
    except Exception:
        pass
    with pytest.raises(RuntimeError, match="tuning needs pycuda and a CUDA device"):
        tune(ConvShape(8, 8, 8, 8, 3, 3), Epilogue("relu"))
