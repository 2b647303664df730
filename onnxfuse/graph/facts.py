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


def _vague(shape) -> bool:
    """Whether a recorded shape has dims that inference may now know: unknown ones, or the
    names onnx's inference makes up for a dim it could not compute (unk__N)."""
    return shape is not None and any(d is None or (isinstance(d, str) and d.startswith("unk__")) for d in shape)


def refresh_shapes(graph: gs.Graph) -> None:
    """Run onnx shape inference on the current graph and record dtypes/shapes that the graph
    does not know yet (tensors made by earlier passes have none), and dims it knew only
    vaguely: a Slice whose bounds an earlier pass made constant (torch's chunk of a dynamic
    batch, bounds once computed from Shape) now has its static width, which the pointwise pass
    needs; without it only a second optimize found the regions."""
    tensors = gu.tensor_map(graph)
    outer = {t.name for t in graph.inputs} | {t.name for t in graph.outputs}
    vague = {name: t.shape for name, t in tensors.items()
             if isinstance(t, gs.Variable) and name not in outer and _vague(t.shape)}
    if not vague and all(t.dtype is not None and t.shape is not None
                         for t in tensors.values() if not isinstance(t, gs.Constant)):
        return  # nothing to fill in
    for name in vague:
        tensors[name].shape = None
    try:
        # Large weights are described by type and shape: inferring on them costs their copies.
        model, left_out = gu.inference_model(graph)
    except Exception:
        for name, shape in vague.items():
            tensors[name].shape = shape
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
    # A dim inference still cannot compute keeps its old made-up name: other tensors may share
    # it (onnxruntime reads such equalities from the value_info), where a new one would not.
    for name, shape in vague.items():
        new = tensors[name].shape
        if new is None or len(new) != len(shape):
            tensors[name].shape = shape
        else:
            tensors[name].shape = [o if _vague([d]) or not _vague([o]) else d for o, d in zip(shape, new)]
