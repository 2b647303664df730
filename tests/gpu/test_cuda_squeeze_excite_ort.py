"""onnxfuse.SqueezeExcite on a CUDA device: the generated kernel launched alone against its numpy
model, and the node on onnxruntime's CUDA provider (kernels/cuda_squeeze_excite.cc) against the
CPU kernel and the fallback function, special values included, with the node running on the
CUDA provider."""
from __future__ import annotations

import struct

import numpy as np
import onnx
import pytest
from gpu_helpers import arch, cuda_ort, cuda_session, device_arch, runner  # noqa: F401  (fixtures)
from test_cuda_ort import profiled_node_providers
from test_cuda_squeeze_excite import assert_same_where_exact, model_run, weights
from test_pass_squeeze_excite import Block, optimize, outputs

from onnxfuse.cuda import squeeze_excite_codegen as sc
from onnxfuse.cuda import squeeze_excite_model as sm
from onnxfuse.cuda.squeeze_excite_codegen import Act, SqueezeExciteSpec
from onnxfuse.pipeline import Context, run_passes, select_passes

pytestmark = pytest.mark.gpu
RNG = np.random.default_rng(11)


def compiled(model: onnx.ModelProto) -> onnx.ModelProto:
    """The block fused for cuda with its kernel stored for this GPU."""
    fused, count = optimize(model, target="cuda")
    assert count == 1
    return run_passes(fused, select_passes(["cuda-compile"], "cuda"), Context(target="cuda", arch=device_arch()))[0]


@pytest.mark.parametrize("c,r,h,w", [(16, 8, 56, 56), (96, 24, 7, 7), (33, 40, 3, 11), (1152, 48, 7, 7)])
def test_generated_kernel_alone_matches_its_numpy_model(runner, arch, c, r, h, w):
    from onnxfuse.cuda.compile import compile_source

    spec = SqueezeExciteSpec(c, r, Act("silu"), Act("silu"), Act("hardsigmoid", 1 / 6, 0.5))
    kernel = sc.generate(spec)
    fn = runner.load(compile_source(kernel.source, kernel.entry, arch).cubin, kernel.entry)
    x = RNG.standard_normal((3, c, h, w)).astype(np.float32)
    ws = weights(c, r)
    dev = [runner.to_device(a) for a in (x, *ws)]
    out, out_ptr = runner.empty(x.shape, np.float32)
    args = struct.pack("<8q", *(d[1] for d in dev), out_ptr, x.shape[0], h * w)
    runner.launch(fn, x.shape[0], kernel.threads, args)
    got = runner.to_host(out)
    # Same sums in the same order; only expf may round differently from numpy's exp.
    np.testing.assert_allclose(got, sm.run(spec, x, *ws), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hidden,gate,input_silu", [("Relu", "hardsigmoid", False), ("silu", "Sigmoid", True),
                                                    ("HardSwish", "hardsigmoid", False)])
def test_node_on_the_cuda_provider_matches_the_cpu_kernel_and_the_fallback(cuda_ort, hidden, gate, input_silu, tmp_path):
    m = Block().model(hidden=hidden, gate=gate, input_silu=input_silu)
    model = compiled(m)
    x = RNG.standard_normal((4, 16, 5, 5)).astype(np.float32) * 2
    x[0, 1, 0, 0], x[1, 2, 3, 3] = -0.0, 1e-45
    got = cuda_session(cuda_ort, model, with_library=True).run(None, {"X": x})[0]
    (cpu,) = outputs(model, x, with_library=True)
    assert_same_where_exact(got, cpu, "vs the CPU kernel")
    assert_same_where_exact(got, model_run(model, x), "vs the numpy model")
    plain = cuda_session(cuda_ort, m, with_library=False).run(None, {"X": x})[0]
    assert_same_where_exact(got, plain, "vs the original on onnxruntime CUDA")
    providers = profiled_node_providers(cuda_ort, model, {"X": x}, tmp_path)
    assert ("SqueezeExcite", "CUDAExecutionProvider") in providers, providers


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_node_on_the_cuda_provider_spreads_a_non_finite_input_like_the_cpu_kernel(cuda_ort, bad):
    model = compiled(Block().model(hidden="Relu", gate="Sigmoid"))
    x = RNG.standard_normal((2, 16, 5, 5)).astype(np.float32)
    x[1, 3, 2, 2] = bad
    got = cuda_session(cuda_ort, model, with_library=True).run(None, {"X": x})[0]
    (cpu,) = outputs(model, x, with_library=True)
    assert_same_where_exact(got, cpu, f"input {bad}")


def test_empty_batch_launches_nothing_and_gives_an_empty_output(cuda_ort):
    model = compiled(Block().model())
    x = np.zeros((0, 16, 5, 5), np.float32)
    got = cuda_session(cuda_ort, model, with_library=True).run(None, {"X": x})[0]
    assert got.shape == (0, 16, 5, 5)
