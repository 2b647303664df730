"""CUDA code generation without a GPU: the kernel's structure, its semantics (the generated C
compiled for the host and compared with Program.evaluate), and nvcc/ptxas acceptance."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import onnx
import pytest

from onnxfuse.cuda import codegen
from onnxfuse.cuda.args import MODE_LINEAR, MODE_STRIDED, MODE_VECTOR, coalesce, pack_args, plan_call
from onnxfuse.program import OPS, Program, SliceSpec

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")

# A strided view, a half input and output, a constant operand, an attribute, a transcendental.
SAMPLE = """in x0 f32 view=1:0:128:1
in x1 f16
t0 = mul x1 0.5
t1 = add x0 t0
t2 = leakyrelu[0.01] t1
t3 = sigmoid t2
out t3 f32
out t0 f16
"""

SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.5, -2.5, 1e-30, -1e-30, 20.0, 21.0,
            -20.0, 88.0, -88.0, 1e30, -1e30, 6.0, -3.0, 3.0, 0.01]


def _values(dtype):
    rng = np.random.default_rng(0)
    return np.concatenate([np.array(SPECIALS), rng.normal(0, 3, 40)]).astype(dtype)


# ---------------------------------------------------------------- structure ----------------------


def test_kernel_is_one_extern_c_entry_with_launch_bounds_and_deterministic_name():
    prog = Program.parse(SAMPLE)
    k1, k2 = codegen.generate(prog, 3), codegen.generate(Program.parse(SAMPLE), 3)
    assert k1.entry == k2.entry and k1.source == k2.source
    assert re.fullmatch(r"onnxfuse_pw_[0-9a-f]{16}", k1.entry)
    assert k1.source.count('extern "C" __global__') == 1
    assert f"__launch_bounds__({codegen.BLOCK}) {k1.entry}(const {k1.entry}_args a)" in k1.source
    # Another rank is another kernel.
    assert codegen.generate(prog, 2).entry != k1.entry


def test_argument_struct_follows_abi_layout():
    k = codegen.generate(Program.parse(SAMPLE), 3)
    body = k.source.split(f"struct {k.entry}_args {{")[1].split("};")[0]
    members = [line.strip() for line in body.strip().splitlines()]
    assert members == [
        "long long n;", "long long mode;", "long long scalar_mask;", "long long dims[3];",
        "long long strides[2][3];", "long long offsets[2];", "const void* in[2];", "void* out[2];",
    ]


def test_compute_function_has_one_statement_per_instruction_in_compute_type():
    prog = Program.parse(SAMPLE)
    src = codegen.generate(prog, 3).source
    compute = src.split("_compute(")[1].split("\n}\n")[0]
    assert [ln.split("=")[0].strip() for ln in compute.splitlines() if ln.strip().startswith("const CT t")] == [
        f"const CT t{i}" for i in range(len(prog.instrs))
    ]
    assert "#define CT float" in src and "expf(" in src
    f64 = codegen.generate(Program.parse("in x0 f64\nt0 = exp x0\nout t0 f64\n"), 1).source
    assert "#define CT double" in f64 and "exp(" in f64 and "expf(" not in f64


def test_half_headers_only_when_a_half_type_is_used():
    f32 = codegen.generate(Program.parse("in x0 f32\nt0 = relu x0\nout t0 f32\n"), 1).source
    assert "cuda_fp16.h" not in f32 and "cuda_bf16.h" not in f32
    mixed = codegen.generate(Program.parse("in x0 f16\nt0 = cast[bf16] x0\nout t0 f32\n"), 1).source
    assert "cuda_fp16.h" in mixed and "cuda_bf16.h" in mixed


def test_literals_are_exact_in_the_compute_type():
    assert codegen.literal(0.1, "f32") == float(np.float32(0.1)).hex() + "f"
    assert codegen.literal(0.1, "f64") == (0.1).hex()
    assert codegen.literal(-2.0, "f32") == "(-0x1.0000000000000p+1f)"
    assert codegen.literal(float("inf"), "f32") == "(CT)INFINITY"
    assert codegen.literal(1e300, "f32") == "(CT)INFINITY"  # overflows float32 as numpy's ct(1e300)
    assert codegen.literal(float("nan"), "f64") == "(CT)NAN"


def test_every_opcode_has_cuda_code():
    for name, op in OPS.items():
        args = ["a", "b", "c"][: op.arity]
        params = ("f16",) if name == "cast" else tuple(0.5 for _ in range(op.nparams))
        assert codegen.instr_expr(name, args, params, "f32")


def test_vector_width_gives_16_byte_accesses_for_the_narrowest_float():
    assert codegen.vector_width(Program.parse("in x0 f32\nout x0 f32\n")) == 4
    assert codegen.vector_width(Program.parse("in x0 f16\nout x0 f16\n")) == 8
    assert codegen.vector_width(Program.parse("in x0 f64\nout x0 f64\n")) == 2
    assert codegen.vector_width(Program.parse("in x0 bool\nout x0 bool\n")) == 4


# ---------------------------------------------------------------- host planning ------------------


def test_coalesce_merges_dims_walked_contiguously_and_drops_ones():
    dims, st = coalesce((2, 1, 3, 4), [[12, 12, 4, 1], [0, 0, 0, 1]])
    assert dims == [6, 4] and st == [[4, 1], [0, 1]]
    dims, st = coalesce((2, 3, 4), [[12, 4, 1]])
    assert dims == [24] and st == [[1]]


def test_plan_picks_linear_vector_and_strided_modes():
    prog = Program.parse("in x0 f32\nin x1 f32\nt0 = add x0 x1\nout t0 f32\n")
    a = np.zeros((4, 8), np.float32)
    assert plan_call(prog, 2, 4, [a, np.float32(1)], addresses=[0, 0]).mode == MODE_VECTOR
    assert plan_call(prog, 2, 4, [a, np.float32(1)], addresses=[4, 0]).mode == MODE_LINEAR
    row = np.zeros((1, 8), np.float32)
    plan = plan_call(prog, 2, 4, [a, row], addresses=[0, 0])
    assert plan.mode == MODE_STRIDED and plan.strides[1] == [0, 1]
    viewed = Program.parse("in x0 f32 view=1:-1:-9:-2\nt0 = neg x0\nout t0 f32\n")
    plan = plan_call(viewed, 2, 4, [a])
    assert plan.dims == [4, 4] and plan.strides == [[8, -2]] and plan.offsets == [7]


def test_packed_arguments_are_8_byte_words_in_struct_order():
    prog = Program.parse("in x0 f32\nin x1 f32\nt0 = add x0 x1\nout t0 f32\n")
    plan = plan_call(prog, 2, 4, [np.zeros((3, 5), np.float32), np.zeros((5,), np.float32)], addresses=[0, 0])
    words = np.frombuffer(pack_args(plan, [0x1000, 0x2000], [0x3000]), np.int64)
    # n, mode, mask, dims[2], strides[2][2], offsets[2], in[2], out[1]
    assert len(words) == 3 + 2 + 4 + 2 + 2 + 1
    assert list(words[:5]) == [15, MODE_STRIDED, 0, 3, 5]
    assert list(words[5:9]) == [5, 1, 0, 1]
    assert list(words[-3:]) == [0x1000, 0x2000, 0x3000]


# ---------------------------------------------------------------- semantics (host-compiled) -----


def _op_program(name: str, ct: str) -> Program:
    op = OPS[name]
    prog = Program()
    xs = [prog.add_input(ct) for _ in range(op.arity)]
    params = ("f16",) if name == "cast" else tuple([0.2, 1.5][: op.nparams])
    if name == "clip":
        params = (-1.0, 2.0)
    prog.add_output(prog.emit(name, *xs, params=params), ct)
    return prog


EXACT_OPS = {"neg", "abs", "sqrt", "recip", "relu", "floor", "ceil", "round", "sign", "not", "isnan", "leakyrelu",
             "thresholdedrelu", "clip", "cast", "add", "sub", "mul", "div", "min", "max", "prelu", "eq", "lt", "le",
             "gt", "ge", "and", "or", "xor", "where", "hardsigmoid", "hardswish", "softsign"}


@pytest.fixture(scope="module")
def op_kernels(tmp_path_factory):
    from onnxfuse.cuda.hostsim import HostKernels

    progs = {(name, ct): _op_program(name, ct) for name in OPS for ct in ("f32", "f64")}
    kernels = {key: codegen.generate(p, 1) for key, p in progs.items()}
    return progs, kernels, HostKernels(list(kernels.values()), str(tmp_path_factory.mktemp("ops")))


@needs_cxx
@pytest.mark.parametrize("ct", ["f32", "f64"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_opcode_matches_reference_including_nan_and_inf(op_kernels, name, ct):
    progs, kernels, host = op_kernels
    prog, kernel = progs[(name, ct)], kernels[(name, ct)]
    dt = np.float32 if ct == "f32" else np.float64
    v = _values(dt)
    # Every pair (and triple for where) of interesting values.
    grids = np.meshgrid(*([v] * OPS[name].arity), indexing="ij")
    arrays = [np.ascontiguousarray(g.reshape(-1)) for g in grids]
    (got,) = host.run(prog, kernel, arrays, [dt])
    (want,) = prog.evaluate(*arrays)
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{name}: NaN positions differ"
    if name in EXACT_OPS:
        np.testing.assert_array_equal(got, want)
    else:
        rtol = 4e-6 if ct == "f32" else 1e-13
        atol = 1e-37 if ct == "f32" else 1e-300
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)


MIXED = [
    # views (negative step), broadcast, f16 in and out, two outputs
    (SAMPLE, lambda r: [r.normal(size=(4, 200)).astype(np.float32), r.normal(size=(128,)).astype(np.float16)]),
    ("in x0 f32 view=1:-1:-100:-2,0:1:4:1\nin x1 f32\nt0 = mul x0 x1\nt1 = tanh t0\nout t1 f32\n",
     lambda r: [r.normal(size=(5, 120, 7)).astype(np.float32), r.normal(size=(50, 1)).astype(np.float32)]),
    ("in x0 f16\nin x1 bool\nt0 = relu x0\nt1 = where x1 t0 x0\nt2 = cast[bool] t1\nout t1 f16\nout t2 bool\n",
     lambda r: [r.normal(size=(3, 33)).astype(np.float16), r.random((3, 33)) > 0.5]),
    ("in x0 f64\nin x1 f32\nt0 = sub x0 x1\nt1 = cast[f16] t0\nt2 = cast[f32] t0\nout t1 f64\nout t2 f32\nout t0 f16\n",
     lambda r: [r.normal(size=(2, 3, 4, 5)) * 1000, r.normal(size=(4, 1)).astype(np.float32)]),
    ("in x0 f32\nin x1 f32\nt0 = div x0 x1\nout t0 f32\n",
     lambda r: [r.normal(size=(1,)).astype(np.float32), r.normal(size=(6, 1, 5)).astype(np.float32)]),
]


def _np_dtype(d):
    return {"f16": np.float16, "bf16": np.uint16, "f32": np.float32, "f64": np.float64, "bool": np.bool_}[d]


@pytest.fixture(scope="module")
def mixed_kernels(tmp_path_factory):
    from onnxfuse.cuda.hostsim import HostKernels

    progs = [Program.parse(text) for text, _ in MIXED]
    kernels = [codegen.generate(p, 4) for p in progs]
    return progs, kernels, HostKernels(kernels, str(tmp_path_factory.mktemp("mixed")))


@needs_cxx
@pytest.mark.parametrize("case", range(len(MIXED)))
def test_views_broadcast_and_storage_types_match_reference_in_every_valid_mode(mixed_kernels, case):
    progs, kernels, host = mixed_kernels
    prog, kernel = progs[case], kernels[case]
    arrays = MIXED[case][1](np.random.default_rng(case))
    want = prog.evaluate(*arrays)
    best = plan_call(prog, kernel.rank, kernel.vec, arrays).mode
    for mode in sorted({MODE_STRIDED, best}):
        got = host.run(prog, kernel, arrays, [_np_dtype(o.dtype) for o in prog.outputs], mode=mode)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=2e-6, err_msg=f"mode {mode}")


@needs_cxx
def test_bf16_load_and_store_round_to_nearest_even_like_the_reference(tmp_path):
    from onnxfuse.cuda.hostsim import HostKernels
    from onnxfuse.program import _to_bf16

    prog = Program.parse("in x0 bf16\nt0 = mul x0 3\nout t0 bf16\n")
    kernel = codegen.generate(prog, 1)
    host = HostKernels([kernel], str(tmp_path))
    vals = _to_bf16(np.random.default_rng(1).normal(size=1000).astype(np.float32))
    bits = (vals.view(np.uint32) >> 16).astype(np.uint16)
    (got,) = host.run(prog, kernel, [bits], [np.uint16])
    (want,) = prog.evaluate(vals)
    np.testing.assert_array_equal((got.astype(np.uint32) << 16).view(np.float32), want)


@needs_cxx
def test_host_kernels_remove_their_temporary_directory_after_loading_and_after_a_failed_compile(tmp_path, monkeypatch):
    import tempfile

    from onnxfuse.cuda.hostsim import HostKernels

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes its directory
    prog = Program.parse("in x0 f32\nt0 = neg x0\nout t0 f32\n")
    kernel = codegen.generate(prog, 1)
    host = HostKernels([kernel])
    assert list(tmp_path.iterdir()) == []
    (got,) = host.run(prog, kernel, [np.arange(4, dtype=np.float32)], [np.float32])  # loaded, its file gone
    np.testing.assert_array_equal(got, -np.arange(4, dtype=np.float32))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(RuntimeError, match="host compile failed"):
        HostKernels([kernel])
    assert list(tmp_path.iterdir()) == []


@needs_cxx
def test_vector_mode_runs_with_a_tail_and_scalar_inputs(tmp_path):
    from onnxfuse.cuda.hostsim import HostKernels

    prog = Program.parse("in x0 f32\nin x1 f32\nt0 = max x0 x1\nout t0 f32\n")
    kernel = codegen.generate(prog, 2)
    host = HostKernels([kernel], str(tmp_path))
    a = np.random.default_rng(2).normal(size=(3, 11)).astype(np.float32)  # 33 elements: 8 groups + 1
    buf = np.zeros(64, np.float32)
    start = (-buf.__array_interface__["data"][0] // 4) % 4
    aligned = buf[start:start + 33].reshape(3, 11)
    aligned[...] = a
    (got,) = host.run(prog, kernel, [aligned, np.float32(0.25)], [np.float32])
    assert host.last_mode == MODE_VECTOR
    np.testing.assert_array_equal(got, np.maximum(a, np.float32(0.25)))


# ---------------------------------------------------------------- nvcc / ptxas ---------------------


@needs_nvcc
def test_nvcc_builds_cubin_for_sm90_and_ptx_that_ptxas_accepts(tmp_path, monkeypatch):
    from onnxfuse.cuda.compile import check_ptx, compile_source

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    k = codegen.generate(Program.parse(SAMPLE), 3)
    c = compile_source(k.source, k.entry, "sm_90", backend="nvcc")
    assert c.arch == "sm_90" and c.ptx_arch == "compute_90"
    assert c.cubin[:4] == b"\x7fELF"
    assert f".entry {k.entry}(" in c.ptx and ".target sm_90" in c.ptx
    check_ptx(c.ptx, "sm_90")
    assert list(tmp_path.glob("cuda/*.cubin")), "compiled kernel not cached on disk"
    again = compile_source(k.source, k.entry, "sm_90", backend="nvcc")
    assert again.cubin == c.cubin


@needs_nvcc
@pytest.mark.parametrize("ct", ["f32", "f64"])
def test_every_opcode_compiles_for_the_device_and_affine_products_stay_unfused(tmp_path, monkeypatch, ct):
    # The host build of the generated code (the tests above) takes the host branch of the
    # helpers; this compiles the device branch of every opcode with nvcc and checks with ptxas.
    # HardSigmoid and HardSwish round their product before the addition, as onnxruntime does:
    # their PTX holds a mul.rn that nvcc may not contract into an fma.
    from onnxfuse.cuda.compile import check_ptx, compile_source

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    kernels = [codegen.generate(_op_program(name, ct), 1) for name in sorted(OPS)]
    # One translation unit (the helpers are guarded against repetition): one nvcc run.
    c = compile_source("".join(k.source for k in kernels), kernels[0].entry, "sm_90", backend="nvcc")
    check_ptx(c.ptx, "sm_90")
    for name, k in zip(sorted(OPS), kernels):
        assert f".entry {k.entry}(" in c.ptx, name
    for name in ("hardsigmoid", "hardswish"):
        k = kernels[sorted(OPS).index(name)]
        body = c.ptx.split(f".entry {k.entry}(", 1)[1].split(".entry", 1)[0]
        assert re.search(rf"mul\.rn\.{ct}", body), name


@needs_nvcc
def test_ptxas_rejects_broken_ptx_with_its_message():
    from onnxfuse.cuda.compile import CompileError, check_ptx

    with pytest.raises(CompileError, match="ptxas"):
        check_ptx(".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry broken( {\n", "sm_90")


def test_arch_names_are_normalized():
    from onnxfuse.cuda.compile import parse_arch

    assert parse_arch("sm_90") == ("sm_90", "compute_90")
    assert parse_arch("8.6") == ("sm_86", "compute_86")
    assert parse_arch("sm_90a") == ("sm_90a", "compute_90")
    with pytest.raises(ValueError):
        parse_arch("volta")


# ---------------------------------------------------------------- the cuda-compile pass ------------


def _optimize_cuda(model, passes=None):
    from onnxfuse.pipeline import Context, run_passes, select_passes

    return run_passes(model, select_passes(passes, "cuda"), Context(target="cuda", arch="sm_90"))[0]


@needs_nvcc
def test_cuda_compile_pass_stores_cubin_ptx_and_launch_constants_on_pointwise_nodes(tmp_path, monkeypatch):
    from conftest import pointwise_chain_model

    from onnxfuse.cuda.compile import check_ptx

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    out = _optimize_cuda(pointwise_chain_model())
    nodes = [n for n in out.graph.node if n.op_type == "Pointwise"]
    assert len(nodes) == 1
    attrs = {a.name: a for a in nodes[0].attribute}
    entry = attrs["cuda_entry"].s.decode()
    assert attrs["cuda_arch"].s == b"sm_90"
    assert attrs["cuda_cubin"].s[:4] == b"\x7fELF"
    ptx = attrs["cuda_ptx"].s.decode()
    assert f".entry {entry}(" in ptx
    check_ptx(ptx, "sm_90")
    assert (attrs["cuda_rank"].i, attrs["cuda_vec"].i, attrs["cuda_block"].i) == (2, 4, codegen.BLOCK)


def test_cuda_compile_pass_is_not_in_the_cpu_pipeline():
    from onnxfuse.pipeline import select_passes

    assert "cuda-compile" not in [p.name for p in select_passes(None, "cpu")]
    cuda = [p.name for p in select_passes(None, "cuda")]
    assert cuda[-1] == "cuda-compile"


# ---------------------------------------------------------------- the native library without CUDA --


def _library():
    from onnxfuse.runtime import library_path

    return library_path()


def test_native_library_has_no_link_time_cuda_dependency():
    out = subprocess.run(["readelf", "-d", _library()], capture_output=True, text=True)
    needed = [ln for ln in out.stdout.splitlines() if "NEEDED" in ln]
    assert needed and not any("cuda" in ln.lower() for ln in needed), needed


def test_cuda_probe_reports_the_driver_state_in_one_line():
    lib = ctypes.CDLL(_library())
    buf = ctypes.create_string_buffer(512)
    ok = lib.OnnxfuseCudaProbe(buf, ctypes.c_size_t(len(buf)))
    text = buf.value.decode()
    assert "\n" not in text and text
    if ok:
        assert text.startswith("CUDA driver API")
    else:
        assert "libcuda.so.1" in text or "cuInit" in text


@needs_nvcc
def test_cuda_target_model_runs_on_cpu_provider_with_the_library_and_never_loads_libcuda(tmp_path, monkeypatch):
    from conftest import cuda_device_count, pointwise_chain_model

    from onnxfuse.runtime import make_session

    if cuda_device_count() > 0:
        pytest.skip("this machine has a CUDA driver: the no-libcuda path cannot be observed here")
    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    original = pointwise_chain_model()
    optimized = _optimize_cuda(original)
    x = np.random.default_rng(3).normal(size=(5, 8)).astype(np.float32)
    want = make_session(original).run(None, {"x": x})[0]
    got = make_session(optimized, with_library=True).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    with open("/proc/self/maps") as f:
        assert "libcuda" not in f.read()


# ---------------------------------------------------------------- every zoo model, nvcc + ptxas ------


# Models without convolutions compile a handful of Pointwise kernels in seconds; every
# convolution shape is its own ConvBiasAct kernel, which takes nvcc minutes per model.
FAST_ZOO = ("char_rnn", "gpt_stack", "mlp_ensemble")


def _zoo_params():
    from onnxfuse import zoo

    return [n if n in FAST_ZOO else pytest.param(n, marks=pytest.mark.slow) for n in zoo.names()]


@needs_nvcc
@pytest.mark.parametrize("name", _zoo_params())
def test_every_fused_kernel_of_zoo_model_compiles_for_sm90_and_its_ptx_assembles(name):
    from onnxfuse import zoo
    from onnxfuse.cuda.compile import check_ptx

    model = onnx.load(str(zoo.get(name).path))
    out = _optimize_cuda(model)
    kernels = {}
    for n in out.graph.node:
        attrs = {a.name: a for a in n.attribute}
        if n.op_type == "Pointwise":
            assert {"cuda_entry", "cuda_cubin", "cuda_ptx", "cuda_arch", "cuda_rank"} <= set(attrs), n.name
        if "cuda_ptx" in attrs:
            assert attrs["cuda_cubin"].s[:4] == b"\x7fELF", n.name
            kernels[attrs["cuda_entry"].s.decode()] = attrs["cuda_ptx"].s.decode()
    for ptx in kernels.values():
        check_ptx(ptx, "sm_90")


def test_plan_of_a_numpy_scalar_input_reads_its_only_element():
    prog = Program.parse("in x0 f32\nin x1 f32\nt0 = mul x0 x1\nout t0 f32\n")
    plan = plan_call(prog, 1, 4, [np.zeros(8, np.float32), np.float32(0.5)])
    assert plan.offsets == [0, 0] and plan.scalar_mask == 0b10


def test_an_interrupted_kernel_cache_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """SIGINT (KeyboardInterrupt) or SIGTERM (onnxfuse's Terminated) while a compiled kernel is
    being stored unwinds through the cache write: its temporary file goes with it."""
    from onnxfuse.cuda import compile as cuda_compile

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(cuda_compile.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cuda_compile._write_disk("k", b"cubin", "ptx")
    assert list((tmp_path / "cuda").iterdir()) == []
