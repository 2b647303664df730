"""Other ways onnxruntime computes an original (used by check.unexplained): node by node, each value
materialized in its declared type, and a float16 original computed in float32 throughout."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper


def _run_step(model: onnx.ModelProto, feeds: dict) -> dict:
    from ..runtime import make_session

    sess = make_session(model, with_library=False, threads=1, level="disable")
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def outer_names(graph: onnx.GraphProto) -> set[str]:
    """The names a subgraph reads from the scopes around it (outer-scope references)."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.name for t in graph.sparse_initializer}
    read: set[str] = set()
    for node in graph.node:
        read.update(i for i in node.input if i)
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                read |= outer_names(g)
        defined.update(o for o in node.output if o)
    return read - defined


def casts_double_to_half(model: onnx.ModelProto) -> bool:
    """Whether the original has a top-level Cast to float16 (of a double, perhaps)."""
    return any(n.op_type == "Cast" and any(a.name == "to" and a.i == TensorProto.FLOAT16 for a in n.attribute)
               for n in model.graph.node)


def node_by_node(model: onnx.ModelProto, feeds: dict, half_casts_rounded_once: bool = False) -> dict:
    """The original's outputs as onnxruntime computes them one top-level node at a time, each
    node's outputs materialized in their declared types before the next node reads them. A node
    with subgraphs (If, Loop, Scan) is one step whose inputs include the top-level values its
    bodies read (seeds 9021200, 9033095). half_casts_rounded_once: a Cast of a double to float16
    rounds once, to the nearest float16, as Cast is defined (onnxruntime rounds through float,
    twice, which moves a value within 2^-24 of a float16 midpoint by an ulp: seeds 1591, 9059180;
    ours rounds once, tests/test_dtypes.py)."""
    graph = model.graph
    values = dict(feeds)
    values.update({t.name: numpy_helper.to_array(t) for t in graph.initializer})
    for node in graph.node:
        if half_casts_rounded_once and node.op_type == "Cast" and node.input[0] in values and \
                values[node.input[0]].dtype == np.float64 and \
                any(a.name == "to" and a.i == TensorProto.FLOAT16 for a in node.attribute):
            values[node.output[0]] = np.asarray(values[node.input[0]].astype(np.float16))
            continue
        names = list(i for i in node.input if i)
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                names += sorted(n for n in outer_names(g) if n in values)
        names = list(dict.fromkeys(names))
        inputs = [onnx.helper.make_tensor_value_info(i, onnx.helper.np_dtype_to_tensor_dtype(values[i].dtype),
                                                     values[i].shape) for i in names]
        outputs = [onnx.ValueInfoProto(name=o) for o in node.output if o]
        step = onnx.helper.make_model(onnx.helper.make_graph([node], "step", inputs, outputs),
                                      opset_imports=model.opset_import, ir_version=model.ir_version)
        values.update(_run_step(step, {i: values[i] for i in names}))
    return {o.name: values[o.name] for o in graph.output}


def _retype_tensor(t: TensorProto, src: int, dst: int) -> TensorProto:
    if t.data_type != src:
        return t
    np_dst = onnx.helper.tensor_dtype_to_np_dtype(dst)
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np_dst), t.name)


def retyped(model: onnx.ModelProto, src: int, dst: int) -> onnx.ModelProto:
    """The same model with every `src` tensor, value and Cast target `dst` instead (its graph
    inputs and outputs too)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)

    def graph(g: onnx.GraphProto) -> None:
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.tensor_type.elem_type == src:
                vi.type.tensor_type.elem_type = dst
        for i, t in enumerate(g.initializer):
            g.initializer[i].CopyFrom(_retype_tensor(t, src, dst))
        for node in g.node:
            for a in node.attribute:
                if node.op_type == "Cast" and a.name == "to" and a.i == src:
                    a.i = dst
                elif a.type == onnx.AttributeProto.TENSOR:
                    a.t.CopyFrom(_retype_tensor(a.t, src, dst))
                elif a.type == onnx.AttributeProto.GRAPH:
                    graph(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sub in a.graphs:
                        graph(sub)

    graph(m.graph)
    return m


def float16_in_float32(model: onnx.ModelProto, feeds: dict) -> dict | None:
    """A float16 original computed in float32 from its inputs to its outputs, each output rounded
    to float16 at the end: onnxruntime's float16 emulation (float32 kernels with Cast pairs it
    drops between them) where it drops every rounding. Which ones it drops depends on the graph's
    form: the optimized model's fallback functions, inlined, give it other forms (seed 9007059).
    None for a model without float16 values."""
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    if not any(v.dtype == np.float16 for v in feeds.values()) and \
            not any(t.data_type == f16 for t in model.graph.initializer):
        return None
    wide = retyped(model, f16, f32)
    fed = {k: (v.astype(np.float32) if v.dtype == np.float16 else v) for k, v in feeds.items()}
    got = _run_step(wide, fed)
    kinds = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    return {k: (v.astype(np.float16) if kinds.get(k) == f16 and v.dtype == np.float32 else v) for k, v in got.items()}
