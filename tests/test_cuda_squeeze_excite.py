"""The onnxfuse.SqueezeExcite CUDA kernel without a GPU: the numpy model of the generated kernel
(same index expressions, lanes, sum orders and activation programs) against the CPU kernel and a
float64 reference, special values included; the source's structure; nvcc + ptxas for sm_90
without spills; and the cuda-compile pass on SqueezeExcite nodes."""
from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import helper
from test_pass_squeeze_excite import Block, optimize, outputs

from onnxfuse.cuda import squeeze_excite_codegen as sc
from onnxfuse.cuda import squeeze_excite_model as sm
from onnxfuse.cuda.squeeze_excite_codegen import Act, SqueezeExciteSpec
from onnxfuse.pipeline import Context, run_passes, select_passes

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("ptxas") is None,
                                reason="nvcc and ptxas (CUDA toolkit) are not on PATH")
RNG = np.random.default_rng(7)


def fused_node(model: onnx.ModelProto) -> gs.Node:
    (node,) = [n for n in gs.import_onnx(model).nodes if n.op == "SqueezeExcite"]
    return node


def model_run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The kernel model on the fused node of `model` (its spec and weights as cuda-compile reads them)."""
    node = fused_node(model)
    spec = sc.spec_of_node(node)
    assert spec is not None
    return sm.run(spec, x, *(t.values for t in node.inputs[1:]))


def assert_same_where_exact(got, want, what=""):
    """NaN where the other is NaN; +-0 and +-inf bit for bit; the rest within float32 rounding of
    the sums (the CPU kernel adds in 16 lanes and with FMAs, the GPU in 32 lanes without)."""
    assert got.shape == want.shape, what
    assert np.array_equal(np.isnan(got), np.isnan(want)), what
    exact = np.isinf(want) | (want == 0)
    assert np.array_equal(got[exact].view(np.uint32), want[exact].view(np.uint32)), what
    close = ~exact & ~np.isnan(want)
    np.testing.assert_allclose(got[close], want[close], rtol=2e-5, atol=1e-6, err_msg=what)


def reference(spec: SqueezeExciteSpec, x, w1, b1, w2, b2) -> np.ndarray:
    """The block in float64, each activation by its program."""
    def act(a: Act, v):
        return sc.activation_program(a).evaluate(v.astype(np.float32))[0].astype(np.float64)
    a = act(spec.input_act, x)
    mean = a.mean(axis=(2, 3))
    h = act(spec.hidden, mean @ w1[:, :, 0, 0].T.astype(np.float64) + b1)
    g = act(spec.gate, h @ w2[:, :, 0, 0].T.astype(np.float64) + b2)
    return a * g[:, :, None, None]


def weights(c: int, r: int):
    return ((RNG.standard_normal((r, c, 1, 1)) * 0.3).astype(np.float32), RNG.standard_normal(r).astype(np.float32),
            (RNG.standard_normal((c, r, 1, 1)) * 0.3).astype(np.float32), RNG.standard_normal(c).astype(np.float32))


# ---------------------------------------------------------------- the numpy model of the kernel ----


@pytest.mark.parametrize("hidden", ["Relu", "silu", "Sigmoid", "Tanh", "hardsigmoid", "HardSwish", "LeakyRelu", "clip"])
@pytest.mark.parametrize("gate", ["Sigmoid", "hardsigmoid"])
def test_kernel_model_matches_the_cpu_kernel_for_each_hidden_and_gate_activation(hidden, gate):
    m = Block().model(hidden=hidden, gate=gate, input_silu=hidden == "silu")
    fused, count = optimize(m)
    assert count == 1
    x = RNG.standard_normal((2, 16, 5, 5)).astype(np.float32) * 2
    (cpu,) = outputs(fused, x, with_library=True)
    assert_same_where_exact(model_run(fused, x), cpu, hidden + "/" + gate)


def test_kernel_model_matches_the_cpu_kernel_on_signed_zeros_infinities_and_nan():
    specials = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.0, -3.0, 0.0], np.float32)
    x = np.tile(specials, 2 * 16 * 25 // len(specials) + 1)[: 2 * 16 * 25].reshape(2, 16, 5, 5)
    for gate in ("Sigmoid", "hardsigmoid"):
        for input_silu in (False, True):
            fused, count = optimize(Block().model(hidden="Relu", gate=gate, input_silu=input_silu))
            assert count == 1
            for bad in (None, np.inf, -np.inf, np.nan):
                y = x.copy()
                if bad is not None:
                    y[1, 3, 2, 2] = bad
                (cpu,) = outputs(fused, y, with_library=True)
                (fallback,) = outputs(fused, y, with_library=False)
                got = model_run(fused, y)
                assert_same_where_exact(got, cpu, f"{gate} silu={input_silu} {bad}")
                assert_same_where_exact(got, fallback, f"{gate} silu={input_silu} {bad} (fallback)")


@pytest.mark.parametrize("c,r,h,w", [(1, 1, 1, 1), (16, 4, 1, 1), (33, 40, 3, 11), (70, 8, 7, 7), (40, 10, 32, 33),
                                     (1152, 48, 2, 3)])
def test_kernel_model_handles_odd_sizes_against_float64(c, r, h, w):
    # Fewer and more channels than warps, R above one warp's lanes, images smaller than a warp
    # and not a multiple of it.
    spec = SqueezeExciteSpec(c, r, Act("silu"), Act("silu"), Act("sigmoid"))
    x = RNG.standard_normal((2, c, h, w)).astype(np.float32)
    ws = weights(c, r)
    got = sm.run(spec, x, *ws)
    assert not np.isnan(got).any(), "an output element was not written"
    np.testing.assert_allclose(got, reference(spec, x, *ws), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("table,name,wrong", [
    ("squeeze", "x_src", "img + WIDE(c) * hw + j - 1"),  # one element early
    ("hidden", "w1_src", "WIDE(k) * R + r"),  # W1 read transposed
    ("gate", "w2_src", "WIDE(c) * R"),  # every column of W2's row is its first
    ("excite", "ec", "DIV(e, hw + 1)"),  # the wrong channel's gate
])
def test_an_index_mistake_is_caught_by_the_model(monkeypatch, table, name, wrong):
    spec = SqueezeExciteSpec(24, 6, Act("none"), Act("relu"), Act("sigmoid"))
    x = RNG.standard_normal((2, 24, 4, 5)).astype(np.float32)
    ws = weights(24, 6)
    monkeypatch.setitem(sc.INDEX, table, [(n, wrong if n == name else e) for n, e in sc.INDEX[table]])
    try:
        got = sm.run(spec, x, *ws)
    except IndexError:
        return
    assert not np.allclose(got, reference(spec, x, *ws), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the generated source ----


def test_index_expressions_and_activation_programs_appear_in_the_source():
    spec = SqueezeExciteSpec(96, 24, Act("silu"), Act("hardswish"), Act("hardsigmoid", 1 / 6, 0.5))
    src = sc.generate(spec).source
    for table in sc.INDEX.values():
        for name, expr in table:
            assert f"{name} = {expr};" in src
    # Each activation is the Pointwise printer's expression of its program.
    assert "in_t1 = v * in_t0" in src and "1 / ((CT)1 + expf(-v))" in src
    assert "h_t0 = v * of_clamp(" in src
    assert "g_t0 = of_clamp(of_mul_rn(0x1.5555560000000p-3f, v)" in src


def test_entry_names_the_specialisation():
    a = SqueezeExciteSpec(96, 24, Act("none"), Act("relu"), Act("hardsigmoid", 1 / 6, 0.5))
    b = SqueezeExciteSpec(96, 24, Act("none"), Act("relu"), Act("hardsigmoid", 0.2, 0.5))
    assert sc.entry_name(a) == sc.entry_name(a) != sc.entry_name(b)
    assert sc.entry_name(a) != sc.entry_name(SqueezeExciteSpec(96, 25, Act("none"), Act("relu"), Act("sigmoid")))


def test_channels_beyond_static_shared_memory_are_refused():
    assert sc.supported(1152, 48) and not sc.supported(12 * 1024, 64)
    with pytest.raises(ValueError):
        SqueezeExciteSpec(12 * 1024, 64)
    with pytest.raises(ValueError):
        SqueezeExciteSpec(16, 4, input_act=Act("relu"))


@needs_nvcc
def test_generated_kernels_compile_for_sm90_without_spills():
    from onnxfuse.cuda.compile import check_ptx, compile_source

    for spec in (SqueezeExciteSpec(16, 8, Act("none"), Act("relu"), Act("hardsigmoid", 1 / 6, 0.5)),
                 SqueezeExciteSpec(1152, 48, Act("silu"), Act("silu"), Act("sigmoid")),
                 SqueezeExciteSpec(64, 16, Act("none"), Act("clip", 0.0, 6.0), Act("sigmoid"))):
        kernel = sc.generate(spec)
        info = check_ptx(compile_source(kernel.source, kernel.entry, "sm_90").ptx, "sm_90")[kernel.entry]
        assert info.spill_stores == 0 and info.spill_loads == 0, (spec, info)
        assert info.smem_bytes == sc.shared_bytes(spec.c, spec.r)


# ---------------------------------------------------------------- cuda-compile ----


def _optimize_cuda(model: onnx.ModelProto) -> onnx.ModelProto:
    fused, count = optimize(model, target="cuda")
    assert count == 1
    return run_passes(fused, select_passes(["cuda-compile"], "cuda"), Context(target="cuda", arch="sm_90"))[0]


@needs_nvcc
def test_cuda_compile_pass_stores_the_kernel_and_launch_constants():
    out = _optimize_cuda(Block(c=16, r=4).model(hidden="silu", gate="hardsigmoid"))
    (node,) = [n for n in out.graph.node if n.op_type == "SqueezeExcite"]
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    assert a["cuda_entry"].decode().startswith("onnxfuse_se_") and a["cuda_cubin"][:4] == b"\x7fELF"
    assert (a["cuda_c"], a["cuda_r"], a["cuda_abi"], a["cuda_block"]) == (16, 4, sc.ABI_VERSION, sc.THREADS)
    from onnxfuse.cuda import audit

    (rec,) = audit.audit(out, "sm_90")
    assert rec.ok and rec.form == "C=16 R=4 hidden silu gate hardsigmoid(0.1667, 0.5)"


@needs_nvcc
def test_cuda_target_model_runs_on_the_cpu_provider_with_the_library():
    # The CPU kernel ignores the cuda_* attributes: the same file serves both providers.
    m = Block().model(hidden="Relu", gate="hardsigmoid")
    out = _optimize_cuda(m)
    x = RNG.standard_normal((2, 16, 5, 5)).astype(np.float32)
    (want,) = outputs(m, x, with_library=False)
    (got,) = outputs(out, x, with_library=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
