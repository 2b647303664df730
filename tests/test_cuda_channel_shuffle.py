"""The onnxfuse.ChannelShuffle CUDA kernel without a GPU: the numpy model of its channel arithmetic
against a direct shuffle, the generated C itself run over whole grids on the host (every vector
width, misaligned buffers, planes cut into chunks) against the CPU kernel bit for bit, nvcc +
ptxas for sm_90 without spills, the cuda-compile pass and the cuda pipeline on shuffle units; and
on a GPU, the model through onnxruntime's CUDA provider."""
from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_pass_channel_shuffle import shuffle_unit

from onnxfuse.cuda import shuffle_codegen as sc
from onnxfuse.cuda.shuffle_codegen import ShuffleSpec

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("ptxas") is None,
                                reason="nvcc and ptxas (CUDA toolkit) are not on PATH")
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no host C++ compiler")

RNG = np.random.default_rng(90)
SPECS = [ShuffleSpec((4, 4), 2, 2), ShuffleSpec((6,), 3, 1), ShuffleSpec((3, 5, 4), 4, 2), ShuffleSpec((12,), 2, 4),
         ShuffleSpec((116, 116), 2, 2), ShuffleSpec((24, 24, 24), 3, 3)]


def spec_id(s: ShuffleSpec) -> str:
    return f"c{'+'.join(map(str, s.channels))}-g{s.groups}-m{s.outputs}"


def reference(spec: ShuffleSpec, xs: list[np.ndarray]) -> list[np.ndarray]:
    """Concat, Reshape [N, g, C/g, H, W], Transpose 0 2 1 3 4, Reshape, equal Split: the block."""
    cat = np.concatenate(xs, axis=1)
    n, c = cat.shape[:2]
    rest = cat.shape[2:]
    shuffled = cat.reshape(n, spec.groups, c // spec.groups, *rest).transpose(0, 2, 1, *range(3, 3 + len(rest)))
    return np.split(shuffled.reshape(cat.shape), spec.outputs, axis=1)


def special_inputs(spec: ShuffleSpec, n: int, h: int, w: int) -> list[np.ndarray]:
    """Random values with NaN payloads, signed zeros, infinities and denormals mixed in."""
    xs = []
    for c in spec.channels:
        x = RNG.standard_normal((n, c, h, w)).astype(np.float32)
        bits = x.view(np.uint32).reshape(-1)
        specials = np.array([0x7FC00123, 0xFFC00001, 0x80000000, 0x00000000, 0x7F800000, 0xFF800000, 0x00000001],
                            np.uint32)
        pick = RNG.random(bits.size) < 0.2
        bits[pick] = specials[RNG.integers(0, specials.size, int(pick.sum()))]
        xs.append(x)
    return xs


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


# ---------------------------------------------------------------- the numpy model of the kernel ----


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_kernel_model_matches_the_direct_shuffle(spec):
    n, h, w = 2, 3, 5
    xs = special_inputs(spec, n, h, w)
    got = sc.model_copy(spec, [x.reshape(n, x.shape[1], h * w) for x in xs], n, h * w)
    for g, want in zip(got, reference(spec, xs)):
        np.testing.assert_array_equal(bits(g.reshape(want.shape)), bits(want))


def test_a_channel_arithmetic_mistake_is_caught_by_the_model(monkeypatch):
    spec = ShuffleSpec((4, 4), 2, 2)
    xs = special_inputs(spec, 1, 2, 2)
    flat = [x.reshape(1, 4, 4) for x in xs]
    # The inverse permutation (g and C/g swapped): the shuffle's classic mistake.
    broken = [(name, "(s % PER_GROUP) * G + s / PER_GROUP" if name == "from" else e) for name, e in sc.INDEX]
    monkeypatch.setattr(sc, "INDEX", broken)
    got = sc.model_copy(spec, flat, 1, 4)
    assert any(not np.array_equal(bits(g.reshape(want.shape)), bits(want)) for g, want in zip(got, reference(spec, xs)))


def test_spec_refuses_channels_the_groups_or_outputs_do_not_divide():
    with pytest.raises(ValueError):
        ShuffleSpec((5,), 2, 1)
    with pytest.raises(ValueError):
        ShuffleSpec((6,), 2, 4)
    with pytest.raises(ValueError):
        ShuffleSpec((), 1, 1)


# ---------------------------------------------------------------- the generated source and its launch


def test_index_expressions_appear_verbatim_in_the_source():
    k = sc.generate(SPECS[2])
    for name, expr in sc.INDEX:
        assert f"const int {name} = {expr};" in k.source
    assert k.source.count('extern "C" __global__') == 1


def test_entry_is_deterministic_and_names_the_specialisation():
    a, b = sc.generate(ShuffleSpec((4, 4), 2, 2)), sc.generate(ShuffleSpec((4, 4), 2, 2))
    assert a.entry == b.entry and a.source == b.source
    others = [ShuffleSpec((8,), 2, 2), ShuffleSpec((4, 4), 4, 2), ShuffleSpec((4, 4), 2, 1), ShuffleSpec((2, 6), 2, 2)]
    assert len({a.entry, *(sc.generate(o).entry for o in others)}) == 5
    assert a.attrs() == {"cuda_abi": sc.ABI_VERSION, "cuda_block": sc.MAX_THREADS, "cuda_channels": "4,4"}


def test_launch_plan_picks_the_widest_vector_the_plane_and_buffers_allow():
    spec = ShuffleSpec((4, 4), 2, 2)
    assert sc.plan_launch(spec, 1, 28 * 28, [0, 256, 512, 1024]).vec == 4
    assert sc.plan_launch(spec, 1, 28 * 28, [0, 256, 520, 1024]).vec == 2  # one buffer 8-byte aligned
    assert sc.plan_launch(spec, 1, 7 * 7, [0, 256, 512, 1024]).vec == 1  # odd plane
    assert sc.plan_launch(spec, 1, 14 * 14, [4, 256, 512, 1024]).vec == 1
    plan = sc.plan_launch(spec, 3, 7 * 7, [0] * 4)
    assert plan.threads == 64 and plan.grid == (3 * 8, 1)
    assert sc.plan_launch(spec, 0, 49, [0] * 4) is None and sc.plan_launch(spec, 2, 0, [0] * 4) is None


def test_launch_plan_covers_huge_planes_within_the_grid():
    spec = ShuffleSpec((2,), 2, 1)
    hw = 3 * 2**31 + 4  # one plane of more than 2^32 floats: 64-bit offsets, chunks within grid.y
    plan = sc.plan_launch(spec, 1, hw, [0, 0])
    assert plan.vec == 4 and plan.grid[1] <= sc.MAX_GRID_Y
    assert plan.grid[1] * plan.span >= hw // 4 and plan.span % plan.threads == 0
    with pytest.raises(ValueError):
        sc.plan_launch(spec, 2**30, 4, [0, 0])


# ---------------------------------------------------------------- the generated C run on the host ---


@pytest.fixture(scope="module")
def host_grid(tmp_path_factory):
    from onnxfuse.cuda.hostsim import GridSim

    return GridSim([sc.generate(s) for s in SPECS], workdir=str(tmp_path_factory.mktemp("shuffle")))


def run_on_host(sim, spec: ShuffleSpec, xs: list[np.ndarray], misalign: int = 0, span: int | None = None):
    """The kernel's outputs for inputs xs [N, C_i, H, W], buffers placed `misalign` bytes past a
    64-byte boundary; `span` overrides the plan's vectors per block (more chunks per plane)."""
    from onnxfuse.cuda.hostsim import aligned_empty

    n, _, h, w = xs[0].shape
    ins = []
    for x in xs:
        buf = aligned_empty(x.shape, np.float32, offset=misalign)
        buf[...] = x
        ins.append(buf)
    piece = spec.total // spec.outputs
    outs = [aligned_empty((n, piece, h, w), np.float32, offset=misalign) for _ in range(spec.outputs)]
    for o in outs:
        bits(o)[...] = 0xFFFFFFFF  # a NaN pattern no input holds: an unwritten element shows
    addrs = [a.__array_interface__["data"][0] for a in ins + outs]
    plan = sc.plan_launch(spec, n, h * w, addrs)
    if span is not None:
        plan = sc.LaunchPlan(plan.vec, plan.threads, span, (plan.grid[0], -(-(h * w // plan.vec) // span)))
    kernel = sc.generate(spec)
    sim.launch(kernel.entry, sc.pack_args(spec, plan, addrs[:len(ins)], addrs[len(ins):], h * w), plan.grid, plan.threads)
    return outs, plan


def cpu_kernel(spec: ShuffleSpec, xs: list[np.ndarray]) -> list[np.ndarray]:
    """onnxfuse.ChannelShuffle on the CPU provider with the library: the kernel of record."""
    from onnxfuse.fused import DOMAIN
    from onnxfuse.runtime import make_session

    names = [f"x{i}" for i in range(len(xs))]
    outs = [f"y{o}" for o in range(spec.outputs)]
    node = helper.make_node("ChannelShuffle", names, outs, domain=DOMAIN, groups=spec.groups)
    graph = helper.make_graph([node], "shuffle",
                              [helper.make_tensor_value_info(nm, TensorProto.FLOAT, list(x.shape)) for nm, x in zip(names, xs)],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    return make_session(model, with_library=True).run(None, dict(zip(names, xs)))


@needs_cxx
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
@pytest.mark.parametrize("hw, misalign, vec", [((4, 6), 0, 4), ((3, 6), 0, 2), ((7, 7), 0, 1), ((4, 6), 8, 2),
                                               ((4, 6), 4, 1)], ids=["vec4", "vec2", "odd", "8-byte", "4-byte"])
def test_generated_kernel_on_the_host_matches_the_cpu_kernel_bit_for_bit(host_grid, spec, hw, misalign, vec):
    xs = special_inputs(spec, 2, *hw)
    got, plan = run_on_host(host_grid, spec, xs, misalign)
    assert plan.vec == vec
    for g, want in zip(got, cpu_kernel(spec, xs)):
        np.testing.assert_array_equal(bits(g), bits(want))


@needs_cxx
@pytest.mark.parametrize("span", [1, 3, 32])
def test_generated_kernel_on_the_host_copies_planes_cut_into_chunks(host_grid, span):
    spec = SPECS[2]
    xs = special_inputs(spec, 1, 10, 10)  # 100 floats: 25 float4 vectors over 25, 9 or 1 chunks
    got, plan = run_on_host(host_grid, spec, xs, span=span)
    assert plan.grid[1] == -(-25 // span)
    for g, want in zip(got, reference(spec, xs)):
        np.testing.assert_array_equal(bits(g), bits(want))


# ---------------------------------------------------------------- nvcc / ptxas ----------------------


@needs_nvcc
def test_generated_kernels_compile_for_sm90_without_spills():
    from onnxfuse.cuda.conv_tune import ptxas_check

    kernels = [sc.generate(s) for s in SPECS + [ShuffleSpec((232, 232, 464), 4, 8)]]
    report = ptxas_check(kernels, "sm_90")
    for k in kernels:
        info = report[k.entry]
        assert info.spill_stores == 0 and info.spill_loads == 0, (k.spec, info)
        assert info.smem_bytes == 0 and info.registers * sc.MAX_THREADS <= 65536, (k.spec, info)


def _cuda_pipeline(model, tmp_path, monkeypatch):
    from onnxfuse.pipeline import Context, PassOptions, run_passes, select_passes

    monkeypatch.setenv("ONNXFUSE_CACHE_DIR", str(tmp_path))
    work = onnx.ModelProto()
    work.CopyFrom(model)
    ctx = Context(target="cuda", arch="sm_90", options=PassOptions.from_mapping({}))
    return run_passes(work, select_passes(["channel-shuffle", "cuda-compile"], "cuda"), ctx)[0]


@needs_nvcc
@pytest.mark.parametrize("concat, cut", [(2, "split"), (1, "slices"), (3, "none")])
def test_cuda_target_fuses_the_shuffle_and_stores_a_kernel_ptxas_accepts(concat, cut, tmp_path, monkeypatch):
    from onnxfuse.cuda import audit
    from onnxfuse.cuda.compile import check_ptx

    out = _cuda_pipeline(shuffle_unit(c=12, hw=4, groups=2, concat=concat, cut=cut), tmp_path, monkeypatch)
    (node,) = [n for n in out.graph.node if n.op_type == "ChannelShuffle"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    per = [12 // concat] * (concat - 1) + [12 - (12 // concat) * (concat - 1)]
    kernel = sc.generate(ShuffleSpec(tuple(per), 2, 1 if cut == "none" else 2))
    assert attrs["cuda_entry"].decode() == kernel.entry
    assert attrs["cuda_channels"].decode() == ",".join(map(str, per))
    assert attrs["cuda_arch"] == b"sm_90" and attrs["cuda_cubin"][:4] == b"\x7fELF"
    info = check_ptx(attrs["cuda_ptx"].decode(), "sm_90")[kernel.entry]
    assert info.spill_stores == 0 and info.spill_loads == 0
    (record,) = audit.audit(out, "sm_90")
    assert record.ok and record.form.startswith("g=2, channels ")


@needs_nvcc
def test_cuda_target_shuffle_model_runs_on_the_cpu_provider_with_the_library(tmp_path, monkeypatch):
    from onnxfuse.runtime import make_session

    model = shuffle_unit(c=8, hw=3, groups=2)
    out = _cuda_pipeline(model, tmp_path, monkeypatch)
    x = {"X0": special_inputs(ShuffleSpec((4,), 1, 1), 2, 3, 3)[0],
         "X1": special_inputs(ShuffleSpec((4,), 1, 1), 2, 3, 3)[0]}
    want = make_session(model, with_library=False).run(None, x)
    for g, w in zip(make_session(out, with_library=True).run(None, x), want):
        np.testing.assert_array_equal(bits(g), bits(w))


@needs_nvcc
def test_cpu_and_cuda_shuffle_kernels_register_together_with_one_schema(tmp_path, monkeypatch):
    # A CUDA session gets both registrations of onnxfuse.ChannelShuffle (registry.cc), and
    # onnxruntime rejects registrations of one name that disagree. Here the CPU provider alone
    # runs the cuda-target model, so the CPU kernel computes it and the CUDA one is only loaded.
    import onnxruntime as ort

    from onnxfuse.runtime import session_options

    model = shuffle_unit(c=8, hw=3, groups=2)
    out = _cuda_pipeline(model, tmp_path, monkeypatch)
    so = session_options(with_library=True, level="all", provider="cuda")
    sess = ort.InferenceSession(out.SerializeToString(), so, providers=["CPUExecutionProvider"])
    xs = special_inputs(ShuffleSpec((4, 4), 2, 2), 2, 3, 3)
    for g, want in zip(sess.run(None, {"X0": xs[0], "X1": xs[1]}), reference(ShuffleSpec((4, 4), 2, 2), xs)):
        np.testing.assert_array_equal(bits(g), bits(want))


def test_cuda_compile_gives_no_kernel_to_a_shuffle_of_unknown_channels():
    import onnx_graphsurgeon as gs

    from onnxfuse.graph import facts
    from onnxfuse.passes.cuda_compile import shuffle_spec

    from onnxfuse.fused import DOMAIN

    node = helper.make_node("ChannelShuffle", ["a", "b"], ["y0", "y1"], domain=DOMAIN, groups=2)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 4, 3, 3]),
                                            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", "c", 3, 3])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y0", "y1")])
    g = gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert shuffle_spec(g.nodes[0], facts.ShapeTable(g)) is None
    g.inputs[1].shape = ["n", 4, 3, 3]
    assert shuffle_spec(g.nodes[0], facts.ShapeTable(g)) == ShuffleSpec((4, 4), 2, 2)


# ---------------------------------------------------------------- on a GPU --------------------------


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("hw", [4, 7, 28])
def test_cuda_target_shuffle_runs_on_the_cuda_provider_bit_for_bit(hw, tmp_path, monkeypatch):
    import onnxruntime as ort

    from onnxfuse.runtime import make_session

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA provider here")
    model = shuffle_unit(c=232, hw=hw, groups=2)
    out = _cuda_pipeline(model, tmp_path, monkeypatch)
    assert [n.op_type for n in out.graph.node] == ["ChannelShuffle"]
    spec = ShuffleSpec((116, 116), 2, 2)
    xs = special_inputs(spec, 3, hw, hw)
    feeds = {"X0": xs[0], "X1": xs[1]}
    sess = make_session(out, provider="cuda", with_library=True)
    assert sess.get_providers()[0] == "CUDAExecutionProvider"
    for g, want in zip(sess.run(None, feeds), reference(spec, xs)):
        np.testing.assert_array_equal(bits(g), bits(want))
