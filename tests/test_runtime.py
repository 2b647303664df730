"""Loading the custom-op library, and fused models run three ways: the original graph, the
optimized graph without our library (fallback functions) and with it (our kernels)."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import runtime
from onnxfuse.pipeline import Context, Pass, run_passes
from onnxfuse.program import Program

# ------------------------------------------------------------------------------ library


def test_library_path_finds_the_built_library():
    path = runtime.library_path()
    assert os.path.isfile(path) and "_onnxfuse_ops" in os.path.basename(path)


def test_missing_library_is_a_library_error_that_says_how_to_rebuild(monkeypatch, tmp_path):
    monkeypatch.setenv("ONNXFUSE_LIBRARY", str(tmp_path / "nope.so"))
    with pytest.raises(runtime.LibraryError, match="no such file"):
        runtime.library_path()
    monkeypatch.delenv("ONNXFUSE_LIBRARY")
    monkeypatch.setattr(runtime, "_PKG", tmp_path)
    with pytest.raises(runtime.LibraryError, match="pip install -e"):
        runtime.library_path()


def test_unloadable_library_is_a_library_error_that_says_how_to_rebuild(monkeypatch, tmp_path):
    bogus = tmp_path / "_onnxfuse_ops.so"
    bogus.write_bytes(b"not an ELF file")
    monkeypatch.setenv("ONNXFUSE_LIBRARY", str(bogus))
    with pytest.raises(runtime.LibraryError, match="cannot load .*pip install -e"):
        runtime.session_options(with_library=True)


def test_library_has_no_cuda_or_onnxruntime_link_dependency():
    # The library must load on machines without CUDA (CUDA kernels dlopen the driver lazily);
    # onnxruntime hands us its API at run time, so we do not link it either.
    import shutil
    import subprocess

    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    out = subprocess.run(["readelf", "-d", runtime.library_path()], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    assert needed and not [lib for lib in needed if "cuda" in lib or "onnxruntime" in lib or "nvrtc" in lib], needed


def test_library_registers_with_a_session_for_a_model_without_fused_ops():
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 10
    # Registering twice in one process shares one domain; both sessions work.
    for _ in range(2):
        s = runtime.make_session(model, with_library=True)
        np.testing.assert_array_equal(s.run(None, {"x": np.array([-1, 0, 2], np.float32)})[0], [0, 0, 2])


# ------------------------------------------------------------------------------ fused models


def _chain_model() -> onnx.ModelProto:
    """Two pointwise regions around a MatMul, with a broadcast bias, a Slice, several dtypes:
    y = tanh(x * 0.5 + b) @ W ; z = sigmoid(Slice(y)) cast to f16, r = relu(y) - 1."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 12)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    starts = numpy_helper.from_array(np.array([2], np.int64), "starts")
    ends = numpy_helper.from_array(np.array([10], np.int64), "ends")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [
        helper.make_node("Mul", ["x", "half"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "b"], ["a"], name="add"),
        helper.make_node("Tanh", ["a"], ["t"], name="tanh"),
        helper.make_node("MatMul", ["t", "W"], ["y"], name="matmul"),
        helper.make_node("Slice", ["y", "starts", "ends", "axes"], ["s"], name="slice"),
        helper.make_node("Sigmoid", ["s"], ["g"], name="sigmoid"),
        helper.make_node("Cast", ["g"], ["z"], name="cast", to=TensorProto.FLOAT16),
        helper.make_node("Relu", ["y"], ["u"], name="relu"),
        helper.make_node("Sub", ["u", "one"], ["r"], name="sub"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [
            helper.make_tensor_value_info("z", TensorProto.FLOAT16, ["batch", 8]),
            helper.make_tensor_value_info("r", TensorProto.FLOAT, ["batch", 12]),
        ],
        [w, b, half, one, starts, ends, axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model)


def _fuse_by_hand(graph: gs.Graph, ctx: Context) -> int:
    """Fuse the three regions of _chain_model with hand-written programs through ctx.fuse, the
    one way passes write fused ops (fallback function included)."""
    by_name = {n.name: n for n in graph.nodes}
    if "mul" not in by_name:  # already fused: nothing left to match
        return 0
    tensors = graph.tensors()
    p1 = Program()
    x, b = p1.add_input("f32"), p1.add_input("f32")
    p1.add_output(p1.emit("tanh", p1.emit("add", p1.emit("mul", x, 0.5), b)), "f32")
    ctx.fuse(graph, "Pointwise", [by_name[n] for n in ("mul", "add", "tanh")],
             [tensors["x"], tensors["b"]], [tensors["t"]], {"program": p1.to_text()})
    from onnxfuse.program import SliceSpec

    p2 = Program()
    y = p2.add_input("f32")
    p2.add_output(p2.emit("sub", p2.emit("relu", y), 1.0), "f32")
    ctx.fuse(graph, "Pointwise", [by_name["relu"], by_name["sub"]], [tensors["y"]], [tensors["r"]],
             {"program": p2.to_text()})
    p3 = Program()  # the Slice is read in place through a view
    ys = p3.add_input("f32", view=[SliceSpec(1, 2, 10, 1)])
    p3.add_output(p3.emit("sigmoid", ys), "f16")
    ctx.fuse(graph, "Pointwise", [by_name[n] for n in ("slice", "sigmoid", "cast")], [tensors["y"]], [tensors["z"]],
             {"program": p3.to_text()})
    return 3


FUSE_BY_HAND = Pass("fuse-by-hand", 0, "test: three hand-written Pointwise regions", _fuse_by_hand)


@pytest.fixture(scope="module")
def fused_pair():
    original = _chain_model()
    fused, stats = run_passes(original, [FUSE_BY_HAND], Context())
    assert stats[0].matches == 3
    return original, fused


def _kernel_ops(model: onnx.ModelProto, with_library: bool, feeds, tmp_path) -> list[str]:
    """op_name of every kernel onnxruntime's profiler saw run."""
    session = runtime.make_session(model, with_library=with_library, profile=True, threads=2)
    session.run(None, feeds)
    path = session.end_profiling()
    try:
        with open(path) as f:
            events = json.load(f)
    finally:
        os.remove(path)
    return [e["args"].get("op_name") for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def test_fused_model_agrees_with_the_original_with_and_without_the_library(fused_pair, tmp_path):
    original, fused = fused_pair
    assert sum(n.op_type == "Pointwise" and n.domain == "onnxfuse" for n in fused.graph.node) == 3
    assert {f.overload for f in fused.functions} == {n.overload for n in fused.graph.node if n.domain == "onnxfuse"}
    rng = np.random.default_rng(1)
    for batch in (1, 7, 3000):  # 3000 x 16: several blocks and parallel tasks
        x = rng.standard_normal((batch, 16)).astype(np.float32)
        x[0, :3] = [np.nan, np.inf, -np.inf]
        want = runtime.make_session(original).run(None, {"x": x})
        fallback = runtime.make_session(fused, with_library=False).run(None, {"x": x})
        ours = runtime.make_session(fused, with_library=True, threads=2).run(None, {"x": x})
        for w, f, o in zip(want, fallback, ours):
            assert w.dtype == f.dtype == o.dtype and w.shape == f.shape == o.shape
            np.testing.assert_allclose(f.astype(np.float64), w.astype(np.float64), rtol=1e-6, atol=1e-6, equal_nan=True)
            tol = 1e-3 if w.dtype == np.float16 else 1e-5
            np.testing.assert_allclose(o.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol, equal_nan=True)


def test_our_kernel_runs_when_the_library_is_registered_and_the_fallback_otherwise(fused_pair, tmp_path):
    _, fused = fused_pair
    feeds = {"x": np.ones((4, 16), np.float32)}
    with_lib = _kernel_ops(fused, True, feeds, tmp_path)
    without = _kernel_ops(fused, False, feeds, tmp_path)
    assert with_lib.count("Pointwise") == 3
    assert "Pointwise" not in without and "Tanh" in without and "Sigmoid" in without


def test_cpu_kernel_ignores_attributes_reserved_for_other_providers(fused_pair):
    original, fused = fused_pair
    model = onnx.ModelProto()
    model.CopyFrom(fused)
    for node in model.graph.node:
        if node.domain == "onnxfuse":
            node.attribute.extend([helper.make_attribute("cuda_ptx", "// not for the CPU"),
                                   helper.make_attribute("cuda_entry", "pointwise_0")])
    x = np.random.default_rng(2).standard_normal((5, 16)).astype(np.float32)
    want = runtime.make_session(original).run(None, {"x": x})
    got = runtime.make_session(model, with_library=True).run(None, {"x": x})
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-3, atol=1e-3)
