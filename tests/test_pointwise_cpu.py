"""The CPU Pointwise kernel (kernels/) against the numpy reference Program.evaluate, through real
onnxruntime sessions with the custom-op library registered."""
from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from onnxfuse import runtime
from onnxfuse.program import OPS, Program, _to_bf16
from small_models import pointwise_model

# ------------------------------------------------------------------------------ helpers


@functools.lru_cache(maxsize=None)
def _session(text: str, threads: int):
    return runtime.make_session(pointwise_model(text), threads=threads, with_library=True)


def feed_value(arr: np.ndarray, dtype: str) -> np.ndarray:
    """The array a graph input of program dtype `dtype` receives."""
    if dtype == "bf16":
        return _to_bf16(arr.astype(np.float32))  # exactly representable: the Cast is exact
    if dtype == "bool":
        return np.asarray(arr).astype(bool)
    return np.asarray(arr).astype({"f16": np.float16, "f32": np.float32, "f64": np.float64}[dtype])


def run_kernel(text: str, arrays, threads: int = 2):
    prog = Program.parse(text)
    feeds = {f"in{i}": feed_value(a, s.dtype) for i, (a, s) in enumerate(zip(arrays, prog.inputs))}
    return _session(text, threads).run(None, feeds), [feeds[f"in{i}"] for i in range(len(arrays))]


def tolerance(dtype: str, compute: str):
    if dtype == "f16":
        return dict(rtol=2e-3, atol=1e-3)
    if dtype == "bf16":
        return dict(rtol=1.6e-2, atol=1e-2)
    if compute == "f64" and dtype == "f64":
        return dict(rtol=1e-12, atol=1e-14)
    return dict(rtol=1e-5, atol=1e-6)


def check(text: str, arrays, threads: int = 2, tol: dict | None = None):
    """Run `text` in onnxruntime and compare every output with the reference, NaN for NaN and
    inf for inf."""
    got, feeds = run_kernel(text, arrays, threads)
    prog = Program.parse(text)
    want = prog.evaluate(*feeds)
    assert len(got) == len(want)
    for spec, g, w in zip(prog.outputs, got, want):
        assert g.shape == w.shape, (spec, g.shape, w.shape)
        if spec.dtype == "bool":
            np.testing.assert_array_equal(g, w)
        else:
            g = g.astype(np.float64)
            w = np.asarray(w).astype(np.float64)
            np.testing.assert_allclose(g, w, equal_nan=True, **(tol or tolerance(spec.dtype, prog.compute_dtype)))
    return got


SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.5, 1e-30, 88.0, -88.0, 100.0])


def sample(shape, rng, scale=3.0, specials=True):
    x = rng.standard_normal(shape) * scale
    if specials and x.size:
        flat = x.reshape(-1)
        idx = rng.choice(flat.size, size=min(flat.size, 3 * len(SPECIALS)), replace=False)
        flat[idx] = np.resize(SPECIALS, len(idx))
    return x


# Parameters for each op that takes some, chosen inside each op's documented range.
PARAMS = {
    "leakyrelu": "[0.01]",
    "elu": "[1.5]",
    "selu": "[1.67326,1.0507]",
    "celu": "[0.8]",
    "hardsigmoid": "[0.2,0.5]",
    "thresholdedrelu": "[1.0]",
    "clip": "[-1.5,2]",
}
PREDICATES = {name for name, op in OPS.items() if op.result == "bool"}

# ------------------------------------------------------------------------------ opcodes


def op_program(name: str, dtype: str, cast_to: str = "f16", literal: bool = False) -> str:
    op = OPS[name]
    params = f"[{cast_to}]" if name == "cast" else PARAMS.get(name, "")
    lines = [f"in x{i} {dtype}" for i in range(op.arity)]
    args = [f"x{i}" for i in range(op.arity)]
    if literal and op.arity >= 2:
        lines.pop()
        args[-1] = "0.75"
    lines.append(f"t0 = {name}{params} {' '.join(args)}")
    lines.append(f"out t0 {dtype}")
    if name in PREDICATES:
        lines.append("out t0 bool")
    return "\n".join(lines) + "\n"


def op_inputs(name: str, rng, big: bool):
    """Arrays of mixed ranks that broadcast; big enough to need several blocks and tasks."""
    n = 8200 if big else 300
    shapes = {1: [(5, 1, n)], 2: [(5, 1, n), (n,)], 3: [(5, 1, n), (1, n), (5, 1, 1)]}[OPS[name].arity]
    arrays = [sample(s, rng) for s in shapes]
    if name in ("and", "or", "xor", "where"):
        arrays[0] = np.where(rng.random(arrays[0].shape) < 0.5, 0.0, arrays[0])
    if name in ("eq", "le", "ge"):
        arrays[1][::3] = arrays[0][0, 0, ::3]  # equal pairs
    return arrays


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_every_opcode_matches_reference_with_nan_inf_and_broadcasting(name, dtype):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    # f32 runs big enough for several parallel tasks; f64 shares the code paths above the opcode.
    arrays = op_inputs(name, rng, big=dtype == "f32")
    check(op_program(name, dtype), arrays, threads=2)


@pytest.mark.parametrize("name", sorted(n for n, op in OPS.items() if op.arity >= 2))
def test_binary_and_ternary_opcodes_take_a_literal_operand(name):
    rng = np.random.default_rng(7)
    arrays = op_inputs(name, rng, big=False)[:-1]
    check(op_program(name, "f32", literal=True), arrays)


@pytest.mark.parametrize("to", ["f16", "bf16", "f32", "f64", "bool"])
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_cast_rounds_exactly_like_onnx_cast(to, dtype):
    rng = np.random.default_rng(3)
    x = np.concatenate([sample(4000, rng, scale=1e3), [65519.0, 65520.0, 1e-7, 6e-8, 3e-8, 3.3e38, 1e39]])
    got = check(op_program("cast", dtype, cast_to=to), [x], tol=dict(rtol=0, atol=0))
    assert got[0].dtype == (np.float64 if dtype == "f64" else np.float32)


# ------------------------------------------------------------------------------ dtypes


def test_half_precision_inputs_and_outputs_round_to_nearest_even():
    # Every finite float16 value as input; outputs rounded from float32 results.
    halves = np.arange(0, 2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    text = "in x0 f16\nin x1 f32\nt0 = mul x0 x1\nout t0 f16\nout x0 f32\nout t0 f32\n"
    got, feeds = run_kernel(text, [halves, np.array([1.0009765625], np.float32)])
    want = Program.parse(text).evaluate(*feeds)
    np.testing.assert_array_equal(got[0].view(np.uint16)[~np.isnan(want[0])], want[0].view(np.uint16)[~np.isnan(want[0])])
    np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(want[0]))
    np.testing.assert_array_equal(got[1], want[1])  # widening is exact
    np.testing.assert_array_equal(got[2], want[2])


def test_bfloat16_inputs_and_outputs():
    rng = np.random.default_rng(11)
    text = "in x0 bf16\nin x1 f32\nt0 = add x0 x1\nt1 = sigmoid t0\nout t1 bf16\nout t0 bf16\nout x0 f32\n"
    got = check(text, [sample((3, 700), rng), sample((700,), rng)], tol=dict(rtol=0, atol=1e-6))
    assert all(g.dtype == np.float32 for g in got)


def test_double_compute_with_half_and_bool_outputs():
    rng = np.random.default_rng(5)
    text = "in x0 f64\nin x1 f16\nt0 = mul x0 x1\nt1 = gt t0 0\nout t0 f16\nout t1 bool\nout t0 f64\nout x1 f64\n"
    got = check(text, [sample((2000,), rng), sample((2000,), rng)], tol=dict(rtol=0, atol=0))
    assert [g.dtype for g in got] == [np.float16, np.bool_, np.float64, np.float64]


def test_bool_inputs_are_zero_or_one():
    rng = np.random.default_rng(2)
    a, b = rng.random(3000) < 0.5, rng.random(3000) < 0.3
    text = "in x0 bool\nin x1 bool\nin x2 f32\nt0 = xor x0 x1\nt1 = where x0 x2 -1\nt2 = add x0 x1\nout t0 bool\nout t1 f32\nout t2 f32\n"
    check(text, [a, b, sample(3000, rng)])


# ------------------------------------------------------------------------------ shapes and views


@pytest.mark.parametrize(
    "view, shape",
    [
        ("1:0:128:1", (4, 256)),  # first half of a Split
        ("1:128:256:1", (4, 256)),  # second half
        ("-1:-1:-1000:-1", (6, 33)),  # reversed, negative indices, clamped end
        ("0:1:100:3", (10, 7, 5)),  # odd step, clamped end
        ("1:5:-2:2,2:-1:0:-2", (3, 9, 11)),  # two axes, negative step
        ("0:2:2:1", (4, 5)),  # empty
        ("2:1:1000:1", (2, 3, 2000)),  # long rows: blocks inside a row
    ],
)
def test_views_read_slices_in_place(view, shape):
    rng = np.random.default_rng(len(view))
    text = f"in x0 f32 view={view}\nin x1 f32\nt0 = mul x0 x1\nt1 = tanh t0\nout t1 f32\nout x0 f32\n"
    x = sample(shape, rng)
    from onnxfuse.program import SliceSpec, apply_view

    viewed = apply_view(x, Program.parse(text).inputs[0].view)
    y = sample(viewed.shape[-1:], rng)
    check(text, [x, y])


def test_view_of_a_half_input_and_broadcast_against_a_view():
    rng = np.random.default_rng(9)
    text = "in x0 f16 view=0:1:4:2\nin x1 f32 view=1:0:1:1\nt0 = sub x0 x1\nout t0 f32\n"
    check(text, [sample((5, 64), rng), sample((2, 3, 64), rng)])


@pytest.mark.parametrize(
    "shapes",
    [
        [(0,), (0,)],
        [(3, 0, 4), (4,)],
        [(0, 5), (1, 5)],
        [(2, 1, 0), (2, 7, 1)],
    ],
)
def test_zero_size_tensors_give_empty_outputs(shapes):
    text = "in x0 f32\nin x1 f16\nt0 = add x0 x1\nout t0 f32\nout t0 f16\n"
    got = check(text, [np.zeros(s) for s in shapes])
    assert got[0].shape == np.broadcast_shapes(*shapes)


def test_scalar_and_rank_zero_inputs():
    text = "in x0 f32\nin x1 f32\nt0 = mul x0 x1\nt1 = exp t0\nout t1 f32\n"
    check(text, [np.array(2.0), np.array(-0.5)])
    check(text, [np.array(2.0), np.arange(6.0).reshape(2, 3)])


@pytest.mark.parametrize("n", [1, 1023, 1024, 1025, 2047, 32767, 32768, 32769, 100_003])
def test_sizes_around_block_and_task_boundaries(n):
    rng = np.random.default_rng(n)
    text = "in x0 f32\nin x1 f32\nt0 = mul x0 1.5\nt1 = add t0 x1\nt2 = sigmoid t1\nout t2 f32\nout t1 f16\n"
    check(text, [sample(n, rng), sample(n, rng)])


# Programs whose every result goes to the next instruction of a chain or straight to an output
# run in blocks as long as a task (kStreamBlock, 32768 elements) where the AVX2 build runs the
# chains: the same sizes around those boundaries, rows cut into several long chunks, and one and
# two threads.
STREAMING_RUN = "t0 = mul x0 1.5\nt1 = add t0 x1\nt2 = tanh t1\nt3 = mul t2 x2\n"


@pytest.mark.parametrize("shapes", [[(n,), (n,), (1,)] for n in (32767, 32768, 32769, 65537, 100_003, 131_072)]
                         + [[(3, 70_001), (70_001,), (3, 1)], [(2, 5, 9000), (5, 9000), (2, 1, 1)]])
@pytest.mark.parametrize("threads", [1, 2])
def test_streaming_chains_around_long_block_and_task_boundaries(shapes, threads):
    rng = np.random.default_rng(sum(map(sum, shapes)) + threads)
    arrays = [sample(s, rng).astype(np.float32) for s in shapes]
    streaming, stepwise = _with_intermediates_out(STREAMING_RUN, 3)
    got = check(streaming, arrays, threads=threads)[0]
    want = run_kernel(stepwise, arrays, threads=threads)[0][0]
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("inner", [1, 3, 1000, 1024, 1500])
def test_short_and_long_rows_with_row_and_column_broadcasts(inner):
    rng = np.random.default_rng(inner)
    rows = 70_000 // inner + 1
    text = "in x0 f32\nin x1 f32\nin x2 f64\nt0 = mul x0 x1\nt1 = add t0 x2\nout t1 f32\n"
    check(text, [sample((rows, inner), rng), sample((rows, 1), rng), sample((inner,), rng)])


def test_one_and_two_threads_give_identical_results():
    rng = np.random.default_rng(0)
    text = "in x0 f32\nin x1 f32\nt0 = mul x0 x1\nt1 = tanh t0\nt2 = exp t1\nt3 = div t2 x1\nout t3 f32\nout t1 bf16\n"
    arrays = [sample((300, 1000), rng), sample((1000,), rng)]
    one, _ = run_kernel(text, arrays, threads=1)
    two, _ = run_kernel(text, arrays, threads=2)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)
    check(text, arrays, threads=1)


# Runs of affine instructions around one transcendental, each result read once by the next: the
# AVX2 build evaluates such a run in one pass (kernels/pointwise_cpu.h, FusedStep). Writing every
# intermediate as an output too stops that (each is read twice), so the two programs must agree
# bit for bit: the fused pass performs the same IEEE operations.
FUSED_RUNS = [
    "t0 = mul x0 0.9\nt1 = add t0 x1\nt2 = tanh t1\nt3 = mul t2 x1\n",
    "t0 = sub 1.5 x0\nt1 = sub t0 x1\nt2 = sigmoid t1\nt3 = sub x1 t2\nt4 = sub t3 0.25\n",
    "t0 = mul x1 x0\nt1 = exp t0\nt2 = add 1.0 t1\nt3 = mul x2 t2\n",
    "t0 = add x0 x2\nt1 = log t0\nt2 = mul t1 t1\n",
    "t0 = erf x0\nt1 = mul t0 0.5\nt2 = add t1 0.5\nt3 = mul t2 x0\nt4 = exp t3\n",
    "t0 = sub x0 x1\nt1 = mul t0 -0.0\nt2 = add t1 -0.0\nt3 = sigmoid t2\nt4 = tanh t3\n",
    "t0 = mul x0 x0\nt1 = add t0 x0\nt2 = sub t1 x2\nt3 = exp t2\nt4 = mul t3 3.0\nt5 = sub 2.0 t4\n",
    "t0 = sub 2.0 x0\nt1 = sub t0 x1\n",
    "t0 = add x0 x1\nt1 = sub 0.5 t0\n",
    "t0 = mul x2 x0\nt1 = mul x1 t0\n",
    # Chains of the other single-operation stages, with each operand order and constant operands
    # that are zeros, NaN, or numbers (max and min by a constant that is no zero or NaN take a
    # shorter form: it must give the same bits).
    "t0 = mul x0 0.9\nt1 = add t0 x1\nt2 = max t1 0.1\nt3 = sub t2 0.25\nt4 = mul t3 x1\nt5 = div t4 1.5\n"
    "t6 = abs t5\nt7 = add t6 x1\n",
    "t0 = max x0 0.0\nt1 = max -0.0 t0\nt2 = min t1 -0.0\nt3 = min 0.0 t2\nt4 = max t3 nan\nt5 = min nan t4\n",
    "t0 = max x0 x1\nt1 = min x2 t0\nt2 = max 2.5 t1\nt3 = min t2 -0.5\nt4 = max t3 -1.0\nt5 = min 1.0 t4\n",
    "t0 = div x0 x1\nt1 = div 2.0 t0\nt2 = recip t1\nt3 = neg t2\nt4 = relu t3\nt5 = sqrt t4\n",
    "t0 = sub x0 x1\nt1 = floor t0\nt2 = mul t1 0.3\nt3 = ceil t2\nt4 = mul t3 0.7\nt5 = round t4\n",
    "t0 = leakyrelu[0.01] x0\nt1 = clip[-1.5,2] t0\nt2 = clip[0,6] t1\nt3 = sub t2 x1\nt4 = clip[-0.0,0.0] t3\n",
    "t0 = abs x0\nt1 = log t0\nt2 = max t1 -3.0\nt3 = tanh t2\nt4 = div t3 x1\nt5 = sigmoid t4\nt6 = neg t5\n"
    "t7 = exp t6\nt8 = min t7 x2\nt9 = erf t8\n",
]


def _with_intermediates_out(run: str, n_inputs: int) -> tuple[str, str]:
    lines = [f"in x{i} f32" for i in range(n_inputs)] + run.strip().splitlines()
    last = lines[-1].split()[0]
    fused = "\n".join(lines + [f"out {last} f32"]) + "\n"
    temps = [line.split()[0] for line in run.strip().splitlines()]
    stepwise = "\n".join(lines + [f"out {last} f32"] + [f"out {t} f32" for t in temps[:-1]]) + "\n"
    return fused, stepwise


@pytest.mark.parametrize("run", FUSED_RUNS)
@pytest.mark.parametrize("shapes", [[(1,), (1,), (1,)], [(7,), (7,), (1,)], [(1031,), (1031,), (1031,)],
                                    [(3, 2053), (2053,), (3, 1)], [(40, 5), (1, 5), (40, 1)],
                                    [(9000,), (1,), (9000,)], [(1,), (4099,), (1,)]])
def test_fused_runs_give_the_bits_of_one_instruction_at_a_time(run, shapes):
    rng = np.random.default_rng(zlib.crc32((run + str(shapes)).encode()))
    arrays = [sample(s, rng).astype(np.float32) for s in shapes]
    # Values past exp's fast range (|x| > 86) and signed zeros, in every vector somewhere.
    arrays[0].reshape(-1)[::37] = np.resize(np.float32([90.0, -100.0, -0.0, 0.0, 87.5, -86.5]),
                                            arrays[0].reshape(-1)[::37].size)
    fused, stepwise = _with_intermediates_out(run, 3)
    got = check(fused, arrays)[0]
    want = run_kernel(stepwise, arrays)[0][0]
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_outputs_may_repeat_values_and_pass_inputs_through():
    rng = np.random.default_rng(4)
    text = "in x0 f32\nin x1 f32\nt0 = add x0 x1\nt1 = neg t0\nout t0 f32\nout t0 f32\nout x1 f32\nout t1 f64\nout x0 f16\n"
    check(text, [sample((40, 50), rng), sample((50,), rng)])


def test_many_live_values_reuse_registers_correctly():
    # A long chain where early values are read again at the end (registers cannot all be reused).
    lines = ["in x0 f32", "in x1 f32", "t0 = mul x0 x1"]
    for k in range(1, 24):
        lines.append(f"t{k} = {['add', 'mul', 'sub', 'max'][k % 4]} t{k - 1} t{k // 2}")
    lines += ["t24 = tanh t23", "out t24 f32", "out t3 f32", "out t12 f16"]
    rng = np.random.default_rng(1)
    check("\n".join(lines) + "\n", [sample(5000, rng, scale=0.5, specials=False), sample(5000, rng, scale=0.5)])


_SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_programs_match_reference(data):
    """Random small programs over random broadcastable shapes and dtypes."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    out_shape = data.draw(st.lists(st.integers(0, 40), min_size=0, max_size=3))
    n_in = data.draw(st.integers(1, 3))
    dtypes = [data.draw(st.sampled_from(["f32", "f32", "f16", "f64", "bool", "bf16"])) for _ in range(n_in)]
    prog = Program()
    arrays, names = [], []
    for d in dtypes:
        names.append(prog.add_input(d))
        shape = [s if data.draw(st.booleans()) else 1 for s in out_shape]
        shape = shape[data.draw(st.integers(0, len(shape))):]
        arrays.append(sample(tuple(shape), rng))
    unary = sorted(n for n, o in OPS.items() if o.arity == 1 and n != "cast")
    for _ in range(data.draw(st.integers(1, 6))):
        name = data.draw(st.sampled_from(sorted(OPS)))
        op = OPS[name]
        args = [data.draw(st.sampled_from(names)) for _ in range(op.arity)]
        if name == "cast":
            params = (data.draw(st.sampled_from(["f16", "bf16", "f32", "bool"])),)
        else:
            params = tuple(float(p) for p in PARAMS.get(name, "[]")[1:-1].split(",") if p)
        names.append(prog.emit(name, *args, params=params))
    del unary
    prog.add_output(names[-1], data.draw(st.sampled_from(["f32", "f16", "bool", "f64"])))
    prog.add_output(names[data.draw(st.integers(0, len(names) - 1))], "f32")
    text = prog.to_text()
    tol = dict(rtol=1e-3, atol=1e-4) if "f16" in text or "bf16" in text else dict(rtol=1e-4, atol=1e-5)
    got, feeds = run_kernel(text, arrays)
    want = prog.evaluate(*feeds)
    for spec, g, w in zip(prog.outputs, got, want):
        assert g.shape == w.shape
        if spec.dtype == "bool":
            np.testing.assert_array_equal(g, w, err_msg=text)
        else:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), equal_nan=True, err_msg=text, **tol)


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "text, message",
    [
        ("in x0 f32\nt0 = frobnicate x0\nout t0 f32\n", "unknown op 'frobnicate'"),
        ("in x0 f32\nt0 = add x0\nout t0 f32\n", "add takes 2 args"),
        ("in x0 f32\nt0 = relu x9\nout t0 f32\n", "undefined value 'x9'"),
        ("in x0 f99\nt0 = relu x0\nout t0 f32\n", "unknown dtype 'f99'"),
        ("in x0 f32 view=0:1\nt0 = relu x0\nout t0 f32\n", "bad view"),
        ("in x0 f32 view=0:1:2:0\nt0 = relu x0\nout t0 f32\n", "slice step 0"),
        ("in x0 f32\nt1 = relu x0\nout t1 f32\n", "out of order"),
        ("in x0 f32\nt0 = leakyrelu[a] x0\nout t0 f32\n", "bad parameter"),
        ("in x0 f32\nt0 = relu x0\n", "no outputs"),
    ],
)
def test_malformed_program_is_a_clean_session_error(text, message):
    model = pointwise_model("in x0 f32\nt0 = relu x0\nout t0 f32\n")
    for attr in model.graph.node[0].attribute:
        if attr.name == "program":
            attr.s = text.encode()
    with pytest.raises(Exception) as err:
        runtime.make_session(model, with_library=True)
    text_of_error = str(err.value)
    assert "Pointwise node 'pw'" in text_of_error and message in text_of_error
    # The Python side rejects the same text too (at parse time, or when evaluating a step-0
    # view); the kernel also refuses a program without outputs, which no node can have.
    if message != "no outputs":
        with pytest.raises(ValueError):
            Program.parse(text).evaluate(np.zeros(3, np.float32))


def test_program_attribute_of_wrong_type_is_a_clean_error():
    model = pointwise_model("in x0 f32\nt0 = relu x0\nout t0 f32\n")
    del model.graph.node[0].attribute[:]
    model.graph.node[0].attribute.append(helper.make_attribute("program", 3))
    with pytest.raises(Exception, match="Pointwise node 'pw'.*attribute 'program'"):
        runtime.make_session(model, with_library=True)


def test_program_input_count_must_match_the_node():
    model = pointwise_model("in x0 f32\nin x1 f32\nt0 = add x0 x1\nout t0 f32\n")
    model.graph.node[0].attribute[0].s = b"in x0 f32\nt0 = relu x0\nout t0 f32\n"
    with pytest.raises(Exception, match="program declares 1 inputs and 1 outputs, the node has 2 and 1"):
        runtime.make_session(model, with_library=True)


def test_shapes_that_do_not_broadcast_fail_the_run_cleanly():
    session = _session("in x0 f32\nin x1 f32\nt0 = add x0 x1\nout t0 f32\n", 2)
    with pytest.raises(Exception, match="do not broadcast"):
        session.run(None, {"in0": np.zeros((3, 4), np.float32), "in1": np.zeros((5,), np.float32)})


def test_view_axis_out_of_range_fails_the_run_cleanly():
    session = _session("in x0 f32 view=2:0:1:1\nt0 = relu x0\nout t0 f32\n", 2)
    with pytest.raises(Exception, match="view axis 2 out of range"):
        session.run(None, {"in0": np.zeros((3, 4), np.float32)})


def test_input_element_type_must_match_the_program():
    model = pointwise_model("in x0 f32\nt0 = relu x0\nout t0 f32\n")
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    session = runtime.make_session(model, with_library=True)
    with pytest.raises(Exception, match="input 0 is f64, the program reads f32"):
        session.run(None, {"in0": np.zeros(3, np.float64)})


# ------------------------------------------------------------------------------ per-call path


def test_plans_of_many_shape_combinations_on_one_kernel_stay_correct():
    # The kernel caches the plans of the first input-shape combinations it sees and resolves the
    # others per run; both, in any order, must give the reference result.
    rng = np.random.default_rng(11)
    text = "in x0 f32\nin x1 f32 view=0:1:-1:1\nt0 = mul x0 x1\nt1 = sigmoid t0\nout t1 f32\n"
    shapes = [((r, c), (c + 2,)) for r in (1, 2, 3, 5) for c in (1, 4, 9)]  # 12 combinations
    for s0, s1 in shapes + shapes[::-1]:
        check(text, [sample(s0, rng), sample(s1, rng)], threads=1)


def test_concurrent_runs_of_one_session_with_different_shapes():
    from concurrent.futures import ThreadPoolExecutor

    text = "in x0 f32\nin x1 f32\nt0 = add x0 x1\nt1 = tanh t0\nt2 = exp t1\nout t2 f32\n"
    session = _session(text, 1)
    prog = Program.parse(text)

    def work(seed):
        rng = np.random.default_rng(seed)
        for k in range(30):
            n = 1 + (seed * 7 + k) % 11
            a, b = sample((n, 33), rng).astype(np.float32), sample((33,), rng).astype(np.float32)
            got = session.run(None, {"in0": a, "in1": b})[0]
            np.testing.assert_allclose(got, prog.evaluate(a, b)[0], rtol=1e-5, atol=1e-6)
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(8)))


def test_shape_reading_without_the_reference_api_gives_the_same_results(monkeypatch):
    # onnxruntime before C API 24 has no GetTensorElementTypeAndShapeDataReference; the kernel then
    # reads shapes through GetTensorTypeAndShape (forced here by the environment switch).
    rng = np.random.default_rng(5)
    text = "in x0 f32 view=1:0:6:2\nin x1 f16\nin x2 f64\nt0 = add x0 x1\nt1 = mul t0 x2\nout t1 f32\nout t0 f16\n"
    arrays = [sample((4, 12), rng), sample((4, 3), rng), sample((3,), rng)]
    fast, _ = run_kernel(text, arrays, threads=1)
    monkeypatch.setenv("ONNXFUSE_NO_SHAPE_REFERENCE", "1")
    legacy, _ = runtime.make_session(pointwise_model(text), threads=1, with_library=True).run(
        None, {f"in{i}": feed_value(a, s.dtype) for i, (a, s) in enumerate(zip(arrays, Program.parse(text).inputs))}
    ), None
    for a, b in zip(fast, legacy):
        np.testing.assert_array_equal(a, b)


def test_output_only_floor_op_reads_int_attributes(tmp_path):
    # bench/overhead_floor.cc (the benchmark's floor of the custom-op path) is built against
    # kernels/ort_api.h and reads its output shape with KernelInfoGetAttribute_int64.
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    from bench import pointwise_overhead

    lib = pointwise_overhead.build_floor_library(tmp_path)
    model = pointwise_overhead.chain_model("floor", 3)
    for node in model.graph.node:
        for attr in node.attribute:
            attr.i = {"rows": 3, "cols": 7}[attr.name]
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 3
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 7
    del model.graph.value_info[:]
    import onnxruntime as ort

    so = runtime.session_options(with_library=False, threads=1)
    so.register_custom_ops_library(lib)
    session = ort.InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": np.zeros((1, 128), np.float32)})[0].shape == (3, 7)
