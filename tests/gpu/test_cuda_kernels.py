"""Generated Pointwise kernels on the GPU, standalone (no onnxruntime): every output element of
fresh random inputs against Program.evaluate, in every loop mode the host can pick."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from gpu_helpers import arch, runner  # noqa: F401  (fixtures)

from onnxfuse.cuda import codegen
from onnxfuse.cuda.args import MODE_STRIDED, pack_args, plan_call
from onnxfuse.cuda.compile import compile_many, compile_source
from onnxfuse.program import OPS, Program, _to_bf16

pytestmark = pytest.mark.gpu

STORAGE = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32, "f64": np.float64, "bool": np.bool_}


def _random(rng, shape, dtype):
    if dtype == "bool":
        return rng.random(shape) > 0.5
    x = rng.normal(0, 2, shape)
    # Sprinkle the values whose handling differs between ops.
    flat = x.reshape(-1)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 20.5, -20.5])
    flat[: min(flat.size, specials.size)] = specials[: flat.size]
    if dtype == "bf16":
        return _to_bf16(x.astype(np.float32))
    return x.astype(STORAGE[dtype])


def _to_storage(x, dtype):
    if dtype == "bf16":
        return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return x


def _from_storage(x, dtype):
    if dtype == "bf16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x


def run_on_device(runner, prog: Program, arrays, rank: int, arch: str, mode: int | None = None):
    kernel = codegen.generate(prog, rank)
    compiled = compile_source(kernel.source, kernel.entry, arch)
    fn = runner.load(compiled.cubin, kernel.entry)
    dev_in = [runner.to_device(_to_storage(a, s.dtype)) for a, s in zip(arrays, prog.inputs)]
    plan0 = plan_call(prog, kernel.rank, kernel.vec, arrays)
    dev_out = [runner.empty(plan0.shape, STORAGE[o.dtype]) for o in prog.outputs]
    plan = plan_call(prog, kernel.rank, kernel.vec, arrays, addresses=[p for _, p in dev_in],
                     out_addresses=[p for _, p in dev_out])
    if mode is not None:
        plan.mode = mode
    args = pack_args(plan, [p for _, p in dev_in], [p for _, p in dev_out])
    work = plan.n // kernel.vec if plan.mode == 2 else plan.n
    grid = max(1, min((work + kernel.block - 1) // kernel.block, 1024))
    runner.launch(fn, grid, kernel.block, args)
    return [_from_storage(runner.to_host(h), o.dtype) for (h, _), o in zip(dev_out, prog.outputs)], plan.mode


def _assert_matches(got, want, transcendental: bool, ct: str):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaN positions differ"
    rtol = (4e-6 if ct == "f32" else 1e-14) if transcendental else 0
    # exp(x) - 1 (elu, selu, celu) cancels: an ulp of exp near 1 is an absolute error there.
    atol = (2e-6 if ct == "f32" else 1e-14) if transcendental else 0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)


EXACT = {"neg", "abs", "sqrt", "recip", "relu", "floor", "ceil", "round", "sign", "not", "isnan", "leakyrelu",
         "thresholdedrelu", "clip", "cast", "add", "sub", "mul", "div", "min", "max", "prelu", "eq", "lt", "le",
         "gt", "ge", "and", "or", "xor", "where", "hardsigmoid", "hardswish", "softsign"}


def op_program(name: str, ct: str) -> Program:
    op = OPS[name]
    prog = Program()
    xs = [prog.add_input(ct) for _ in range(op.arity)]
    params = ("f16",) if name == "cast" else ((-1.0, 2.0) if name == "clip" else tuple([0.2, 1.5][: op.nparams]))
    prog.add_output(prog.emit(name, *xs, params=params), ct)
    return prog


@pytest.fixture(scope="module", autouse=True)
def precompiled(arch):
    """Every kernel of this module compiled up front, in parallel (the tests then hit the cache)."""
    kernels = [codegen.generate(op_program(n, ct), 2) for n in OPS for ct in ("f32", "f64")]
    kernels += [codegen.generate(Program.parse(text), 4) for text, _ in CASES]
    compile_many([(k.source, k.entry) for k in kernels], arch=arch)


@pytest.mark.parametrize("ct", ["f32", "f64"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_every_opcode_on_the_gpu_matches_the_reference(runner, arch, name, ct):
    prog = op_program(name, ct)
    xs = prog.inputs
    rng = np.random.default_rng(zlib.crc32(f"{name}-{ct}".encode()))
    arrays = [_random(rng, (3, 1000), ct) for _ in xs]
    (got,), _ = run_on_device(runner, prog, arrays, 2, arch)
    (want,) = prog.evaluate(*arrays)
    _assert_matches(got, want, name not in EXACT, ct)


CASES = [
    ("in x0 f32 view=1:0:128:1\nin x1 f16\nt0 = add x0 x1\nt1 = sigmoid t0\nt2 = mul t1 0.5\n"
     "t3 = leakyrelu[0.01] t2\nout t3 f32\nout t1 f16\n", [((64, 200), "f32"), ((128,), "f16")]),
    ("in x0 f32 view=1:-1:-100:-2,0:1:4:1\nin x1 f32\nt0 = mul x0 x1\nt1 = tanh t0\nout t1 f32\n",
     [((5, 120, 7), "f32"), ((50, 1), "f32")]),
    ("in x0 bf16\nin x1 bool\nt0 = relu x0\nt1 = where x1 t0 x0\nt2 = cast[bool] t1\nout t1 bf16\nout t2 bool\n",
     [((33, 129), "bf16"), ((33, 129), "bool")]),
    ("in x0 f64\nin x1 f32\nt0 = sub x0 x1\nt1 = cast[f16] t0\nout t1 f64\nout t0 f16\n",
     [((2, 3, 40, 5), "f64"), ((40, 1), "f32")]),
    ("in x0 f16\nin x1 f16\nt0 = mul x0 x1\nt1 = erf t0\nt2 = add t1 1\nt3 = mul t2 x0\nout t3 f16\n",
     [((4096, 77), "f16"), ((1,), "f16")]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_views_broadcast_mixed_types_in_every_valid_mode(runner, arch, case):
    text, specs = CASES[case]
    prog = Program.parse(text)
    rng = np.random.default_rng(100 + case)
    arrays = [_random(rng, shape, dt) for shape, dt in specs]
    want = prog.evaluate(*arrays)
    got, best = run_on_device(runner, prog, arrays, 4, arch)
    modes = {best}
    strided, _ = run_on_device(runner, prog, arrays, 4, arch, mode=MODE_STRIDED)
    modes.add(MODE_STRIDED)
    for outs in (got, strided):
        for g, w, o in zip(outs, want, prog.outputs):
            w = _from_storage(_to_storage(w, o.dtype), o.dtype) if o.dtype == "bf16" else w
            np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=2e-3 if o.dtype in ("f16", "bf16") else 2e-6,
                                       atol=1e-6, equal_nan=True, err_msg=f"modes {sorted(modes)}")


def test_large_contiguous_input_takes_the_vector_path_and_matches(runner, arch):
    prog = Program.parse("in x0 f32\nin x1 f32\nt0 = mul x0 x1\nt1 = add t0 1\nt2 = relu t1\nout t2 f32\n")
    rng = np.random.default_rng(7)
    arrays = [rng.normal(size=(1 << 20) + 3).astype(np.float32), np.float32(0.5)]
    (got,), mode = run_on_device(runner, prog, arrays, 1, arch)
    assert mode == 2
    np.testing.assert_array_equal(got, prog.evaluate(*arrays)[0])
