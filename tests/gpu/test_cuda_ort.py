"""onnxruntime's CUDA provider with our library: zoo models optimized for --target cuda against
the original models on plain onnxruntime CUDA, every Pointwise node on our CUDA kernel, CUDA
graph capture and replay, PTX-only kernels, and the architecture-mismatch error."""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import onnx
import pytest
from conftest import pointwise_chain_model
from gpu_helpers import arch, cuda_ort, cuda_session, device_arch  # noqa: F401  (fixtures)

from onnxfuse.pipeline import Context, PassOptions, run_passes, select_passes

pytestmark = pytest.mark.gpu

# Zoo models checked end to end: the launch-bound generated ones and two light zoo CNNs.
E2E_ZOO = ["char_rnn", "gpt_stack", "mlp_ensemble", "mobilenetv3", "squeezenet", "resnet50"]


def optimize_cuda(model: onnx.ModelProto) -> onnx.ModelProto:
    return run_passes(model, select_passes(None, "cuda"), Context(target="cuda", arch=device_arch()))[0]


def feeds_for(model: onnx.ModelProto, dims: dict, seed: int = 0) -> dict:
    from onnxfuse.inputs import random_inputs

    return random_inputs(model, dims, seed)


def profiled_node_providers(ort, model, feeds, tmp_path) -> list[tuple[str, str]]:
    """(op type, provider) of every kernel one run executes, from onnxruntime's profiler."""
    sess = cuda_session(ort, model, with_library=True, profile_prefix=str(tmp_path / "prof"))
    sess.run(None, feeds)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    return [(e["args"].get("op_name", ""), e["args"].get("provider", ""))
            for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]


def assert_close(got, want, what):
    for g, w in zip(got, want):
        g = np.asarray(g, np.float64)
        w = np.asarray(w, np.float64)
        assert g.shape == w.shape, what
        if w.size == 0:
            continue
        scale = max(1.0, float(np.nanmax(np.abs(w))))
        err = float(np.nanmax(np.abs(g - w)))
        # float32 on both sides (TF32 off), reductions in another order: ~1e-6 of the output scale.
        assert err <= 1e-4 * scale, f"{what}: max abs error {err:.3g} (output scale {scale:.3g})"


@pytest.mark.parametrize("name", E2E_ZOO)
def test_zoo_model_optimized_for_cuda_matches_plain_onnxruntime_cuda(cuda_ort, name, tmp_path):
    from onnxfuse import zoo

    zm = zoo.get(name)
    original = onnx.load(str(zm.path))
    optimized = optimize_cuda(original)
    fused_kinds = {n.op_type for n in optimized.graph.node if n.domain == "onnxfuse"}
    assert fused_kinds, "nothing was fused"  # Pointwise chains, or ConvBiasAct in the CNNs
    feeds = feeds_for(original, zm.dims)
    want = cuda_session(cuda_ort, original, with_library=False).run(None, feeds)
    got = cuda_session(cuda_ort, optimized, with_library=True).run(None, feeds)
    assert_close(got, want, name)
    providers = profiled_node_providers(cuda_ort, optimized, feeds, tmp_path)
    ours = [p for op, p in providers if op in fused_kinds]
    assert ours and set(ours) == {"CUDAExecutionProvider"}, providers


def _graph_run(ort, model, feeds, out_shapes):
    """A CUDA-graph session with inputs and outputs bound on the device at fixed addresses."""
    sess = cuda_session(ort, model, with_library=any(n.domain == "onnxfuse" for n in model.graph.node), graph=True)
    io = sess.io_binding()
    ins = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in feeds.items()}
    outs = {o.name: ort.OrtValue.ortvalue_from_shape_and_type(out_shapes[o.name], np.float32, "cuda", 0)
            for o in sess.get_outputs()}
    for k, v in ins.items():
        io.bind_ortvalue_input(k, v)
    for k, v in outs.items():
        io.bind_ortvalue_output(k, v)
    return sess, io, ins, outs


def test_cuda_graph_captures_and_replays_our_kernel_with_new_inputs(cuda_ort):
    original = pointwise_chain_model()
    optimized = optimize_cuda(original)
    rng = np.random.default_rng(5)
    x1 = rng.normal(size=(64, 8)).astype(np.float32)
    x2 = rng.normal(size=(64, 8)).astype(np.float32)
    reference = cuda_session(cuda_ort, original, with_library=False)
    sess, io, ins, outs = _graph_run(cuda_ort, optimized, {"x": x1}, {"y": (64, 8)})
    for _ in range(3):  # warm-up, capture, replay
        sess.run_with_iobinding(io)
    np.testing.assert_allclose(outs["y"].numpy(), reference.run(None, {"x": x1})[0], rtol=1e-6, atol=1e-6)
    ins["x"].update_inplace(x2)  # same device address, new values: the replay must see them
    sess.run_with_iobinding(io)
    np.testing.assert_allclose(outs["y"].numpy(), reference.run(None, {"x": x2})[0], rtol=1e-6, atol=1e-6)


def _with_kernel_attrs(model: onnx.ModelProto, drop: tuple[str, ...] = (), arch_to: str | None = None):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for n in out.graph.node:
        if n.op_type != "Pointwise":
            continue
        keep = [a for a in n.attribute if a.name not in drop]
        del n.attribute[:]
        n.attribute.extend(keep)
        if arch_to:
            for a in n.attribute:
                if a.name == "cuda_arch":
                    a.s = arch_to.encode()
    return out


def test_ptx_only_kernel_is_jit_compiled_by_the_driver_and_matches(cuda_ort):
    original = pointwise_chain_model()
    ptx_only = _with_kernel_attrs(optimize_cuda(original), drop=("cuda_cubin",))
    x = np.random.default_rng(6).normal(size=(7, 8)).astype(np.float32)
    got = cuda_session(cuda_ort, ptx_only, with_library=True).run(None, {"x": x})[0]
    want = cuda_session(cuda_ort, original, with_library=False).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_kernel_for_another_architecture_without_ptx_fails_naming_both_architectures(cuda_ort, arch):
    other = "sm_80" if not arch.startswith("sm_8") else "sm_90"
    model = _with_kernel_attrs(optimize_cuda(pointwise_chain_model()), drop=("cuda_ptx",), arch_to=other)
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(Exception) as info:
        cuda_session(cuda_ort, model, with_library=True).run(None, {"x": x})
    text = str(info.value)
    assert other in text and arch in text, text


def test_library_finds_the_cuda_driver_here():
    import ctypes

    from onnxfuse.runtime import library_path

    lib = ctypes.CDLL(library_path())
    buf = ctypes.create_string_buffer(256)
    assert lib.OnnxfuseCudaProbe(buf, ctypes.c_size_t(256)) == 1, buf.value.decode()


def _deep_conv_model(c=256, hw=7, k=256):
    """A deep batch-1 Conv + residual Add + Relu: few output tiles, so the heuristic splits the
    reduction over a thread-block cluster (split-K)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(9)
    w = (rng.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "z"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    g = helper.make_graph(nodes, "deep", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw]),
                                          helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, k, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, k, hw, hw])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    m = onnx.helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores-3xtf32"])
def test_split_k_conv_runs_in_onnxruntime_and_replays_in_a_cuda_graph(cuda_ort, tensor_cores):
    original = _deep_conv_model()
    optimized = run_passes(original, select_passes(None, "cuda"),
                           Context(target="cuda", arch=device_arch(),
                                   options=PassOptions(conv_policy="always", conv_split_k=True,
                                                       conv_tensor_cores=tensor_cores)))[0]
    (node,) = [n for n in optimized.graph.node if n.op_type == "ConvBiasAct"]
    tile = [list(a.ints) for a in node.attribute if a.name == "cuda_tile"][0]
    kind = [a.s for a in node.attribute if a.name == "cuda_kind"][0]
    assert len(tile) == 6 and tile[5] > 1, tile  # split-K chosen
    assert (kind == b"gemm_tf32x3") == tensor_cores
    rng = np.random.default_rng(10)
    feeds = {"x": rng.standard_normal((1, 256, 7, 7)).astype(np.float32),
             "z": rng.standard_normal((1, 256, 7, 7)).astype(np.float32)}
    want = cuda_session(cuda_ort, original, with_library=False).run(None, feeds)
    assert_close(cuda_session(cuda_ort, optimized, with_library=True).run(None, feeds), want, "split-K")
    sess, io, ins, outs = _graph_run(cuda_ort, optimized, feeds, {"y": (1, 256, 7, 7)})
    for _ in range(3):  # warm-up, capture, replay
        sess.run_with_iobinding(io)
    assert_close([outs["y"].numpy()], want, "split-K in a CUDA graph")
    feeds2 = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in feeds.items()}
    for k, v in feeds2.items():
        ins[k].update_inplace(v)
    sess.run_with_iobinding(io)
    assert_close([outs["y"].numpy()], cuda_session(cuda_ort, original, with_library=False).run(None, feeds2),
                 "split-K replay with new inputs")
