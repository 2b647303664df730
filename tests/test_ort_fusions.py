"""The model of onnxruntime's own fusions (onnxfuse/graph/ort_fusions.py) as the pointwise pass
applies it: what onnxruntime fuses is left to it, on the CPU and on CUDA, and what it does not
fuse (asked of the graph it executes) becomes a region.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from pointwise_checks import (
    BETA,
    F,
    GAMMA,
    RNG,
    SCAL,
    ZOO,
    check_equivalent,
    fuse,
    model,
    node,
    ops,
    ort_kernels,
    pointwise_nodes,
)


def case(pattern, inputs, out, inits, kept, prefix=(), suffix=(), full_inputs=None):
    """A pattern onnxruntime fuses (inputs -> out), and a model that surrounds it with
    elementwise ops a region would like to merge with (prefix/suffix)."""
    return dict(pattern=pattern, inputs=inputs, out=out, inits=inits, kept=kept,
                prefix=list(prefix), suffix=list(suffix), full_inputs=full_inputs or inputs)


X3 = [("x", [2, 4, 16])]
EXP_AFTER = [node("Exp", ["y"], ["z"])]
POLICY_CASES = {
    "conv-relu": case(
        [node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]), node("Relu", ["c"], ["y"])],
        [("x", [1, 3, 8, 8])], ("y", [1, 4, 8, 8]), {"W": RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)},
        "Relu", suffix=EXP_AFTER,
    ),
    "matmul-add-2d": case(
        [node("MatMul", ["x", "W"], ["m"]), node("Add", ["m", "b"], ["y"])],
        [("x", [4, 16])], ("y", [4, 16]), {"W": RNG.standard_normal((16, 16)).astype(np.float32), "b": GAMMA},
        "Add", suffix=EXP_AFTER,
    ),
    "matmul-add-relu-2d": case(
        [node("MatMul", ["x", "W"], ["m"]), node("Add", ["m", "b"], ["a"]), node("Relu", ["a"], ["y"])],
        [("x", [4, 16])], ("y", [4, 16]), {"W": RNG.standard_normal((16, 16)).astype(np.float32), "b": GAMMA},
        "Relu", suffix=EXP_AFTER,
    ),
    "matmul-scale": case(
        [node("MatMul", ["x", "W"], ["m"]), node("Mul", ["m", "s"], ["y"])],
        X3, ("y", [2, 4, 16]), {"W": RNG.standard_normal((16, 16)).astype(np.float32), "s": SCAL(0.125)},
        "Mul", suffix=EXP_AFTER,
    ),
    "skip-layernorm": case(
        [node("Add", ["x", "r"], ["s"]), node("LayerNormalization", ["s", "g", "be"], ["y"], axis=-1)],
        [("x", [2, 4, 16]), ("r", [2, 4, 16])], ("y", [2, 4, 16]), {"g": GAMMA, "be": BETA},
        "Add", prefix=[node("Exp", ["x0"], ["x"])], full_inputs=[("x0", [2, 4, 16]), ("r", [2, 4, 16])],
    ),
    "layernorm": case(
        [
            node("ReduceMean", ["x"], ["mu"], axes=[-1]), node("Sub", ["x", "mu"], ["d"]), node("Pow", ["d", "two"], ["p"]),
            node("ReduceMean", ["p"], ["v"], axes=[-1]), node("Add", ["v", "eps"], ["ve"]), node("Sqrt", ["ve"], ["sd"]),
            node("Div", ["d", "sd"], ["n"]), node("Mul", ["n", "g"], ["ng"]), node("Add", ["ng", "be"], ["y"]),
        ],
        X3, ("y", [2, 4, 16]), {"two": SCAL(2.0), "eps": SCAL(1e-5), "g": GAMMA, "be": BETA},
        "Div", suffix=EXP_AFTER,
    ),
    "rms-norm": case(
        [
            node("Pow", ["x", "two"], ["p"]), node("ReduceMean", ["p"], ["v"], axes=[-1]), node("Add", ["v", "eps"], ["ve"]),
            node("Sqrt", ["ve"], ["sd"]), node("Div", ["x", "sd"], ["n"]), node("Mul", ["n", "g"], ["y"]),
        ],
        X3, ("y", [2, 4, 16]), {"two": SCAL(2.0), "eps": SCAL(1e-5), "g": GAMMA},
        "Div", suffix=EXP_AFTER,
    ),
    # Hugging Face's LlamaRMSNorm as the TorchScript exporter writes it: float32 to float32
    # Casts around the computation, the reciprocal as Div(1, .), the weight Mul last.
    "rms-norm-casts": case(
        [
            node("Cast", ["x"], ["xc"], to=F), node("Pow", ["xc", "two"], ["p"]), node("ReduceMean", ["p"], ["v"], axes=[-1]),
            node("Add", ["v", "eps"], ["ve"]), node("Sqrt", ["ve"], ["sd"]), node("Div", ["one", "sd"], ["r"]),
            node("Mul", ["xc", "r"], ["n"]), node("Cast", ["n"], ["nc"], to=F), node("Mul", ["g", "nc"], ["y"]),
        ],
        X3, ("y", [2, 4, 16]), {"two": SCAL(2.0), "eps": SCAL(1e-6), "one": SCAL(1.0), "g": GAMMA},
        "Div", suffix=EXP_AFTER,
    ),
    "bias-gelu-erf": case(
        [
            node("Add", ["x", "b"], ["xb"]), node("Div", ["xb", "sq2"], ["d"]), node("Erf", ["d"], ["e"]),
            node("Add", ["e", "one"], ["a"]), node("Mul", ["xb", "a"], ["m"]), node("Mul", ["m", "half"], ["y"]),
        ],
        X3, ("y", [2, 4, 16]), {"b": GAMMA, "sq2": SCAL(1.4142135), "one": SCAL(1.0), "half": SCAL(0.5)},
        "Erf", suffix=EXP_AFTER,
    ),
    "bias-gelu-tanh": case(
        [
            node("Add", ["x0", "b"], ["x"]), node("Pow", ["x", "three"], ["c3"]), node("Mul", ["c3", "k"], ["kc"]), node("Add", ["x", "kc"], ["in"]),
            node("Mul", ["in", "s2pi"], ["ins"]), node("Tanh", ["ins"], ["t"]), node("Add", ["t", "one"], ["a"]),
            node("Mul", ["x", "half"], ["xh"]), node("Mul", ["xh", "a"], ["y"]),
        ],
        [("x0", [2, 4, 16])], ("y", [2, 4, 16]),
        {"b": GAMMA, "three": SCAL(3.0), "k": SCAL(0.044715), "s2pi": SCAL(0.7978845608), "one": SCAL(1.0), "half": SCAL(0.5)},
        "Tanh", suffix=EXP_AFTER,
    ),
    "silu": case(
        [node("Sigmoid", ["x"], ["s"]), node("Mul", ["x", "s"], ["y"])],
        X3, ("y", [2, 4, 16]), {}, "Sigmoid", suffix=EXP_AFTER,
    ),
}


def full_model(c):
    out = ("z", c["out"][1]) if c["suffix"] else c["out"]
    return model(c["prefix"] + c["pattern"] + c["suffix"], c["full_inputs"], [out], c["inits"])


# onnxruntime 1.31 fuses the tanh GELU of gpt_stack (FastGelu) but not this standalone copy of
# it, whose result is the graph output (test_gelus_onnxruntime_does_not_fuse_become_regions); the
# rule is checked with an op after it and on the zoo model (test_gpt_stack_keeps_onnxruntime_fastgelu).
@pytest.mark.parametrize("name", sorted(set(POLICY_CASES) - {"bias-gelu-tanh"}))
def test_cpu_policy_patterns_are_fused_by_onnxruntime(name):
    """The measurement behind each CPU rule: onnxruntime runs the pattern as one kernel (a
    convolution also reorders its NCHWc output), the reserved op is no kernel of its own."""
    c = POLICY_CASES[name]
    kernels = ort_kernels(model(c["pattern"], c["inputs"], [c["out"]], c["inits"]))
    assert c["kept"] not in kernels
    assert len([k for k in kernels if k != "ReorderOutput"]) == 1, kernels


@pytest.mark.parametrize("name", sorted(set(POLICY_CASES) - {"skip-layernorm"}))
def test_cpu_policy_leaves_onnxruntime_fusions_alone(name):
    c = POLICY_CASES[name]
    m = full_model(c)
    out = fuse(m, "cpu")
    assert c["kept"] in ops(out)
    assert "Pointwise" not in ops(out)  # the op around it alone does not pay
    check_equivalent(m, out)


def _tanh_gelu_with_cube(cube_nodes):
    return [*cube_nodes, node("Mul", ["c3", "k"], ["kc"]), node("Add", ["x", "kc"], ["in"]),
            node("Mul", ["in", "s2pi"], ["ins"]), node("Tanh", ["ins"], ["t"]), node("Add", ["t", "one"], ["a"]),
            node("Mul", ["x", "half"], ["xh"]), node("Mul", ["xh", "a"], ["y"])]


GELU_CONSTS = {"three": SCAL(3.0), "k": SCAL(0.044715), "s2pi": SCAL(0.7978845608), "one": SCAL(1.0), "half": SCAL(0.5)}
# Tanh GELUs the gelu rule matches but onnxruntime 1.31 does not fuse: the result is the graph
# output, or the cube is written x * x * x. The pass asks onnxruntime (reserved_for_runtime)
# and makes them regions instead of leaving nine kernels.
UNFUSED_GELUS = {
    "result-is-graph-output": model(POLICY_CASES["bias-gelu-tanh"]["pattern"], [("x0", [2, 4, 16])], [("y", [2, 4, 16])],
                                    POLICY_CASES["bias-gelu-tanh"]["inits"]),
    "cube-as-products": model(_tanh_gelu_with_cube([node("Mul", ["x", "x"], ["x2"]), node("Mul", ["x2", "x"], ["c3"])])
                              + EXP_AFTER, [("x", [2, 4, 16])], [("z", [2, 4, 16])], GELU_CONSTS),
}


@pytest.mark.parametrize("name", sorted(UNFUSED_GELUS))
def test_gelus_onnxruntime_does_not_fuse_become_regions(name):
    m = UNFUSED_GELUS[name]
    assert "Tanh" in ort_kernels(m)  # the premise: onnxruntime leaves it in pieces
    out = fuse(m, "cpu")
    assert ops(out) == ["Pointwise"]
    check_equivalent(m, out)


def test_rules_stand_alone_when_onnxruntime_cannot_be_asked(monkeypatch):
    from onnxfuse import runtime

    def unavailable(model, with_library=True):
        raise RuntimeError("no session")

    monkeypatch.setattr(runtime, "executed_graph", unavailable)
    m = UNFUSED_GELUS["cube-as-products"]
    out = fuse(m, "cpu")
    assert "Pointwise" not in ops(out) and "Tanh" in ops(out)  # left to onnxruntime, as the rule says
    check_equivalent(m, out)


def test_gelu_onnxruntime_fuses_stays_with_it_beside_one_it_does_not():
    """One graph, two GELUs: the one onnxruntime fuses (FastGelu) is left to it, the other (cube
    written x * x * x) becomes a region: the probe decides node by node."""
    fused_one = [node("Pow", ["x", "three"], ["c3"])]
    other = [node("Mul", ["x", "x"], ["x2"]), node("Mul", ["x2", "x"], ["c3"])]
    rename = lambda nodes, sfx: [node(n.op_type, [i if i in GELU_CONSTS else i + sfx for i in n.input],  # noqa: E731
                                      [o + sfx for o in n.output]) for n in nodes]
    # Two graph inputs: GELUs of one value would share x * 0.5, which onnxruntime 1.31 merges and
    # then removes with the FastGelu it fuses, leaving the other GELU reading nothing.
    nodes = (rename(_tanh_gelu_with_cube(fused_one), "_a") + rename(_tanh_gelu_with_cube(other), "_b")
             + [node("Add", ["y_a", "y_b"], ["z"])])
    m = model(nodes, [("x_a", [2, 4, 16]), ("x_b", [2, 4, 16])], [("z", [2, 4, 16])], GELU_CONSTS)
    out = fuse(m, "cpu")
    kernels = ort_kernels(out, with_library=True)
    assert kernels.count("FastGelu") == 1 and "Tanh" not in kernels, kernels
    check_equivalent(m, out)


def test_cuda_policy_fuses_gelu_which_cpu_leaves_to_onnxruntime():
    m = full_model(POLICY_CASES["bias-gelu-tanh"])
    assert "Pointwise" not in ops(fuse(m, "cpu"))
    out = fuse(m, "cuda")
    assert ops(out) == ["Pointwise"]  # the Exp after it joins too
    check_equivalent(m, out)


@pytest.mark.skipif(not (ZOO / "gpt_stack.onnx").exists(), reason="zoo model models/gpt_stack.onnx not generated")
def test_gpt_stack_keeps_onnxruntime_fastgelu():
    m = onnx.load(str(ZOO / "gpt_stack.onnx"))
    out = fuse(m)
    before, after = ort_kernels(m), ort_kernels(out)
    assert before.count("FastGelu") == after.count("FastGelu") == 4
    # bias and residual Adds of the attention and MLP outputs: one region each (the last one
    # before ln_f too, which onnxruntime's slower SkipLayerNormalization would otherwise take)
    assert len(pointwise_nodes(out)) == 8
    assert "SkipLayerNormalization" not in ort_kernels(out, with_library=True)
    check_equivalent(m, out, dims={"batch": 2, "seq": 5}, seeds=(0,))


def conv_elementwise_conv(op: str, binary: bool, group: int = 1, channels: int = 16):
    """Conv -> op (unary on the Conv, or binary on two Convs of one shape) -> Mul by the first
    Conv (so that the op cannot fold into the Conv) -> Conv."""
    W = lambda cin: RNG.standard_normal((channels, cin, 3, 3)).astype(np.float32)  # noqa: E731
    nodes = [node("Conv", ["x", "W1"], ["c1"], pads=[1, 1, 1, 1], group=group)]
    inits = {"W1": W(channels // group), "W2": W(channels)}
    if binary:
        nodes.append(node("Conv", ["x", "W3"], ["c3"], pads=[1, 1, 1, 1]))
        inits["W3"] = W(channels)
    nodes.append(node(op, ["c1", "c3"] if binary else ["c1"], ["a"]))
    nodes += [node("Mul", ["a", "c1"], ["m"]), node("Conv", ["m", "W2"], ["y"], pads=[1, 1, 1, 1])]
    return model(nodes, [("x", [1, channels, 10, 10])], [("y", [1, channels, 10, 10])], inits)


NCHWC_CASES = [("HardSigmoid", False), ("Sigmoid", False), ("Tanh", False), ("Relu", False),
               ("Add", True), ("Mul", True), ("Sum", True)]


@pytest.mark.parametrize("op, binary", NCHWC_CASES)
def test_nchwc_elementwise_ops_run_in_place_in_onnxruntime(op, binary):
    """The measurement behind the nchwc-elementwise rule: between NCHWc convolutions,
    onnxruntime runs these ops on the blocked tensors with no reorder around them (one
    ReorderInput for the graph input, one ReorderOutput for the graph output)."""
    kernels = ort_kernels(conv_elementwise_conv(op, binary))
    assert kernels.count("ReorderInput") + kernels.count("ReorderOutput") == 2, kernels


@pytest.mark.parametrize("op, binary", NCHWC_CASES)
def test_cpu_policy_leaves_nchwc_elementwise_ops_to_onnxruntime(op, binary):
    m = conv_elementwise_conv(op, binary)
    out = fuse(m, "cpu")
    assert "Pointwise" not in ops(out)
    assert len(ort_kernels(out)) == len(ort_kernels(m))
    check_equivalent(m, out)


@pytest.mark.parametrize("op, binary", [("LeakyRelu", False), ("Sub", True)])
def test_ops_onnxruntime_reorders_around_are_still_fused_between_convolutions(op, binary):
    """LeakyRelu and Sub leave the NCHWc layout in onnxruntime (reorders around them), so the
    region with the Mul after them is fused, and saves kernels."""
    m = conv_elementwise_conv(op, binary)
    assert ort_kernels(m).count("ReorderOutput") > 1
    out = fuse(m, "cpu")
    assert ops(out).count("Pointwise") == 1
    assert len(ort_kernels(out, with_library=True)) < len(ort_kernels(m))
    check_equivalent(m, out)


def test_grouped_convolution_is_not_taken_as_nchwc():
    """A grouped (not depthwise) convolution stays NCHW in onnxruntime: its activation and the
    Mul after it are one region."""
    m = conv_elementwise_conv("HardSigmoid", False, group=2)
    out = fuse(m, "cpu")
    assert ops(out).count("Pointwise") == 1
    check_equivalent(m, out)


def residual_layernorm(written_out: bool):
    """Add(x, r) -> LayerNormalization over the last axis, as one op or written out."""
    if not written_out:
        nodes = [node("Add", ["x", "r"], ["s"]), node("LayerNormalization", ["s", "g", "be"], ["y"], axis=-1)]
        inits = {"g": GAMMA, "be": BETA}
    else:
        nodes = [
            node("Add", ["x", "r"], ["s"]), node("ReduceMean", ["s"], ["mu"], axes=[-1]), node("Sub", ["s", "mu"], ["d"]),
            node("Pow", ["d", "two"], ["p"]), node("ReduceMean", ["p"], ["v"], axes=[-1]), node("Add", ["v", "eps"], ["ve"]),
            node("Sqrt", ["ve"], ["sd"]), node("Div", ["d", "sd"], ["n"]), node("Mul", ["n", "g"], ["ng"]),
            node("Add", ["ng", "be"], ["y"]),
        ]
        inits = {"two": SCAL(2.0), "eps": SCAL(1e-5), "g": GAMMA, "be": BETA}
    return model(nodes, [("x", [2, 4, 16]), ("r", [2, 4, 16])], [("y", [2, 4, 16])], inits, opset=17)


def with_side_chain(m: onnx.ModelProto) -> onnx.ModelProto:
    """`m` plus an unrelated three-op chain q = tanh(-|x|), a region saving 2 kernels."""
    g = m.graph
    g.node.extend([node("Abs", ["x"], ["q0"]), node("Neg", ["q0"], ["q1"]), node("Tanh", ["q1"], ["q"])])
    g.output.append(helper.make_tensor_value_info("q", F, [2, 4, 16]))
    return onnx.shape_inference.infer_shapes(m)


@pytest.mark.parametrize("written_out", [False, True])
def test_cpu_takes_a_lone_residual_add_from_onnxruntimes_skip_layernorm(written_out):
    """onnxruntime's CPU SkipLayerNormalization is slower than a Pointwise region plus its
    LayerNormalization (bench/results/skip_layernorm.md), so on the CPU even the residual Add
    alone becomes a region, which keeps onnxruntime from making that fusion, where another
    region saves the kernel that costs."""
    m = with_side_chain(residual_layernorm(written_out))
    assert "SkipLayerNormalization" in ort_kernels(m)
    out = fuse(m, "cpu")
    assert ops(out).count("Pointwise") == 2
    kernels = ort_kernels(out, with_library=True)
    assert sorted(kernels) == ["LayerNormalization", "Pointwise", "Pointwise"], kernels
    check_equivalent(m, out)


@pytest.mark.parametrize("written_out", [False, True])
def test_cpu_leaves_a_lone_residual_add_when_nothing_pays_its_kernel(written_out):
    """Alone, the residual Add's region plus LayerNormalization are two kernels where
    onnxruntime runs one SkipLayerNormalization: a model never gets more kernels than
    onnxruntime alone (a GPT-2 block exported by TorchScript went from 64 to 65)."""
    m = residual_layernorm(written_out)
    out = fuse(m, "cpu")
    assert "Pointwise" not in ops(out)
    assert len(ort_kernels(out, with_library=True)) <= len(ort_kernels(m))


def test_cuda_leaves_the_residual_add_to_skip_layernorm():
    out = fuse(residual_layernorm(False), "cuda")
    assert "Pointwise" not in ops(out)


@pytest.mark.parametrize("packed", [True, False])
def test_gated_silu_is_one_region_not_quickgelu(packed):
    """SwiGLU, silu(gate) * up: onnxruntime runs QuickGelu and the Mul (and the Split of a packed
    gate/up projection) as separate kernels; the gated SiLU is left to the pointwise pass, which
    writes all of it as one region. A lone SiLU stays onnxruntime's QuickGelu."""
    if packed:
        nodes, inputs = [node("Split", ["x"], ["g", "u"], axis=-1, num_outputs=2)], [("x", [2, 1, 32])]
    else:
        nodes, inputs = [], [("g", [2, 1, 16]), ("u", [2, 1, 16])]
    nodes += [node("Sigmoid", ["g"], ["s"]), node("Mul", ["g", "s"], ["a"]), node("Mul", ["a", "u"], ["y"])]
    m = model(nodes, inputs, [("y", [2, 1, 16])], opset=18)
    before = ort_kernels(m)
    assert "QuickGelu" in before  # the premise: onnxruntime fuses the SiLU alone
    out = fuse(m, "cpu")
    assert ops(out) == ["Pointwise"]
    assert len(ort_kernels(out, with_library=True)) == 1 < len(before)
    check_equivalent(m, out)
    if not packed:
        lone = model(nodes[:-1], inputs[:1], [("a", [2, 1, 16])], opset=18)
        assert "QuickGelu" in ort_kernels(fuse(lone, "cpu"), with_library=True)
