"""Building small models for the pointwise pass and checking what it writes against the original.

Every rewritten model is checked three ways against the original model in onnxruntime: the
fallback functions (optimized model run without our library), each Pointwise program evaluated
by the numpy reference (Program.evaluate) on the node's actual inputs, and, where the built
library has the Pointwise kernel, the optimized model run with it.
"""
from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxfuse.pipeline import Context, run_passes, select_passes
from onnxfuse.program import ONNX_ELEM, Program

F = T.FLOAT


def model(nodes, inputs, outputs, inits=None, opset=17, elem=F):
    """inputs/outputs: [(name, shape)] (or (name, shape, elem_type)); inits: {name: array}."""

    def vi(spec):
        name, shape, *et = spec
        return helper.make_tensor_value_info(name, et[0] if et else elem, shape)

    graph = helper.make_graph(
        nodes, "g", [vi(s) for s in inputs], [vi(s) for s in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


def node(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, name=f"{op}_{outs[0]}", **attrs)


def fuse(m, target="cpu"):
    out, stats = run_passes(m, select_passes(["pointwise"], target), Context(target=target))
    onnx.checker.check_model(out)
    return out


def pointwise_nodes(m):
    return [n for n in m.graph.node if n.op_type == "Pointwise"]


def program_of(n) -> Program:
    return Program.parse(helper.get_attribute_value(next(a for a in n.attribute if a.name == "program")).decode())


def ops(m):
    return sorted(n.op_type for n in m.graph.node)


def session(m, with_library=False, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.log_severity_level = 3
    if with_library:
        from onnxfuse.runtime import library_path

        so.register_custom_ops_library(library_path())
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@functools.lru_cache(maxsize=None)
def library_has_pointwise() -> bool:
    graph = helper.make_graph(
        [helper.make_node("Pointwise", ["x"], ["y"], domain="onnxfuse", program="in x0 f32\nt0 = neg x0\nout t0 f32\n")],
        "probe", [helper.make_tensor_value_info("x", F, [2])], [helper.make_tensor_value_info("y", F, [2])],
    )
    one = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onnxfuse", 1)])
    one.ir_version = 10
    try:
        session(one, with_library=True).run(None, {"x": np.ones(2, np.float32)})
        return True
    except Exception:
        return False


def feeds_for(m, seed=0, dims=None):
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in m.graph.input:
        tt = i.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (dims or {}).get(d.dim_param, 3) for d in tt.shape.dim]
        dt = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if dt == np.bool_:
            feeds[i.name] = rng.random(shape) > 0.5
        elif dt.kind in "iu":
            feeds[i.name] = rng.integers(-3, 4, shape).astype(dt)
        else:
            feeds[i.name] = (rng.standard_normal(shape) * 2).astype(dt)
    return feeds


def assert_same(expected, got, rtol=1e-5, atol=1e-6):
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert e.shape == g.shape and e.dtype == g.dtype
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)


def check_equivalent(original, fused, dims=None, seeds=(0, 1)):
    """The fused model computes what the original computes: fallback bodies, every program
    by the reference evaluator, and the native kernel when the library has it."""
    for seed in seeds:
        feeds = feeds_for(original, seed, dims)
        want = session(original).run(None, feeds)
        assert_same(want, session(fused).run(None, feeds))
        check_programs(fused, feeds)
        if library_has_pointwise():
            assert_same(want, session(fused, with_library=True).run(None, feeds), rtol=2e-5, atol=1e-5)


def check_programs(fused, feeds):
    """Evaluate each Pointwise program on the node's inputs (from the fallback run) and
    compare with the node's outputs."""
    probe = onnx.ModelProto()
    probe.CopyFrom(fused)
    have = {o.name for o in probe.graph.output} | {i.name for i in probe.graph.input}
    inits = {t.name: numpy_helper.to_array(t) for t in probe.graph.initializer}
    for n in pointwise_nodes(fused):
        prog = program_of(n)
        dtypes = [i.dtype for i in prog.inputs] + [o.dtype for o in prog.outputs]
        for name, dt in zip(list(n.input) + list(n.output), dtypes):
            if name not in have and name not in inits:
                probe.graph.output.append(helper.make_tensor_value_info(name, ONNX_ELEM[dt], None))
                have.add(name)
    names = [o.name for o in probe.graph.output]
    values = dict(zip(names, session(probe).run(None, feeds)))
    values.update(feeds)
    values.update(inits)
    for n in pointwise_nodes(fused):
        prog = program_of(n)
        got = prog.evaluate(*[values[i] for i in n.input])
        assert_same([values[o] for o in n.output], got, rtol=2e-5, atol=1e-5)


RNG = np.random.default_rng(3)
GAMMA = np.linspace(0.5, 1.5, 16).astype(np.float32)
BETA = np.linspace(-0.2, 0.2, 16).astype(np.float32)
SCAL = lambda v: np.array(v, np.float32)  # noqa: E731


def ort_kernels(m, with_library=False) -> list[str]:
    """Op types of the kernels onnxruntime (ORT_ENABLE_ALL, CPU, 1 thread) runs per inference."""
    import json
    import os
    import tempfile

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.enable_profiling = True
    so.log_severity_level = 3
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "p")
    if with_library:
        from onnxfuse.runtime import library_path

        so.register_custom_ops_library(library_path())
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    s.run(None, feeds_for(m))
    events = json.load(open(s.end_profiling()))
    return [e["args"]["op_name"] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


ZOO = __import__("pathlib").Path(__file__).resolve().parent.parent / "models"
