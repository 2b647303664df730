"""Which kernels a session gets from the library: those of the providers it asks for.

A custom op registered for one execution provider stops onnxruntime from running the node's
fallback function on any other provider. The library therefore registers its CUDA kernels only
in sessions whose `onnxfuse.providers` config entry says "cuda" (onnxfuse.runtime sets it).
"""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.pipeline import Context, run_passes, select_passes
from onnxfuse.runtime import make_session, needs_library


def _conv_relu_model():
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["c"], ["y"]),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def test_a_cuda_only_fused_op_runs_its_fallback_in_a_cpu_session_with_the_library_loaded():
    model = _conv_relu_model()
    # The CUDA pipeline without its compile step: a ConvBiasAct node with its fallback function.
    passes = [p for p in select_passes(None, "cuda") if p.name != "cuda-compile"]
    fused, _ = run_passes(model, passes, Context(target="cuda"))
    assert [n.op_type for n in fused.graph.node] == ["ConvBiasAct"]
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    want = make_session(model, with_library=False).run(None, {"x": x})[0]
    got = make_session(fused, provider="cpu", with_library=True).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_cpu_target_model_on_the_cuda_provider_uses_its_fallback_functions():
    p = helper.make_node("Pointwise", ["x"], ["y"], domain="onnxfuse", program="in x0 f32\nt0 = neg x0\nout t0 f32\n")
    g = helper.make_graph([p], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onnxfuse", 1)])
    assert needs_library(m, "cpu")
    assert not needs_library(m, "cuda")  # no compiled CUDA kernel stored with the node
    p.attribute.append(helper.make_attribute("cuda_entry", "k"))
    m.graph.node[0].CopyFrom(p)
    assert needs_library(m, "cuda")
