"""Facts about a graph's tensors that passes ask for: shapes filled in by inference."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxfuse.modelio import infer_light_model

from . import core as gu


def infer_shapes(graph: gs.Graph) -> None:
    """Fill in the shapes of intermediate tensors that the model did not record (ONNX shape
    inference on an exported copy); the rules below need ranks and leading dims."""
    import onnx

    if all(t.shape is not None for t in graph.tensors().values() if isinstance(t, gs.Variable) and t.inputs):
        return
    try:
        model = gs.export_onnx(graph.copy(), do_type_check=False)
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # shape inference is best effort: unknown shapes only disable rewrites
        return
    known = {vi.name: vi for vi in list(model.graph.value_info) + list(model.graph.output)}
    for name, t in graph.tensors().items():
        vi = known.get(name)
        if not isinstance(t, gs.Variable) or vi is None or t.shape is not None:
            continue
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        t.shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        if t.dtype is None and tt.elem_type:
            t.dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)


def elem_type(t: gs.Tensor) -> int | None:
    """ONNX element type of a tensor (graphsurgeon keeps numpy dtypes, or the ONNX code for
    types numpy lacks, such as bfloat16)."""
    dt = t.dtype
    if dt is None:
        return None
    if isinstance(dt, (int, np.integer)):
        return int(dt)
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt))
    except Exception:  # exotic dtypes (ml_dtypes) onnx cannot map back
        return None


def refresh_shapes(graph: gs.Graph) -> None:
    """Run onnx shape inference on the current graph and record dtypes/shapes that the graph
    does not know yet (tensors made by earlier passes have none)."""
    if all(t.dtype is not None and t.shape is not None
           for t in gu.tensor_map(graph).values() if not isinstance(t, gs.Constant)):
        return  # nothing to fill in
    try:
        # Large weights are described by type and shape: inferring on them costs their copies.
        model, left_out = gu.inference_model(graph)
    except Exception:
        return
    model = infer_light_model(model, left_out) or model
    infos = {}
    for vi in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input):
        if vi.type.HasField("tensor_type"):
            infos[vi.name] = vi.type.tensor_type
    for name, t in gu.tensor_map(graph).items():
        if isinstance(t, gs.Constant) or name not in infos:
            continue
        tt = infos[name]
        if t.dtype is None and tt.elem_type:
            try:
                t.dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
            except Exception:
                t.dtype = tt.elem_type
        if t.shape is None and tt.HasField("shape"):
            t.shape = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param if d.dim_param else None)
                for d in tt.shape.dim
            ]
