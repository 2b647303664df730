"""Preparing a loaded model for the passes: initializers as constants, an IR version onnxruntime
loads, and shapes inferred on a copy that leaves the large weights out."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .environment import ort_max_ir_version
from .modelfields import copy_fields
from .modelio import PROTOBUF_LIMIT, InputError, LoadedModel

# IR version from which initializers need not be listed as graph inputs.
IR_INITIALIZERS_NOT_INPUTS = 4


def normalize(loaded: LoadedModel) -> LoadedModel:
    """Prepare a loaded model for the passes: initializers are constants, shapes are inferred.

    IR < 4 models must list every initializer as a graph input; onnxruntime treats those as
    constants anyway, and the passes need to see them as constants, so such inputs are
    dropped (and the IR version raised to 4, where that is legal). In IR >= 4 an initializer
    that is also an input is an overridable default, part of the model's interface: kept.
    Sparse initializers and sparse Constant values become dense (densify_sparse).
    """
    model = loaded.model
    densified = densify_sparse(model.graph)
    if densified:
        loaded.notes.append(f"{densified} sparse initializers or constants made dense")
    if model.ir_version < IR_INITIALIZERS_NOT_INPUTS:
        initializers = {t.name for t in model.graph.initializer}
        kept = [i for i in model.graph.input if i.name not in initializers]
        dropped = len(model.graph.input) - len(kept)
        if dropped:
            del model.graph.input[:]
            model.graph.input.extend(kept)
            loaded.notes.append(f"{dropped} initializers listed as graph inputs (IR {model.ir_version}) made constants")
        model.ir_version = IR_INITIALIZERS_NOT_INPUTS
    # onnx writes IR versions newer than onnxruntime loads; a model that uses nothing of the
    # newer IR runs unchanged under the older number (and is saved with it).
    model.ir_version = min(model.ir_version, max(ort_max_ir_version(), IR_INITIALIZERS_NOT_INPUTS))
    loaded.model = infer_shapes(model, loaded.notes)
    return loaded


# The most bytes a sparse tensor may take once dense.
MAX_DENSE_BYTES = PROTOBUF_LIMIT


def dense_tensor(sparse: onnx.SparseTensorProto) -> onnx.TensorProto:
    """The dense tensor a SparseTensorProto stands for: zeros but at its indices (linear
    [NNZ] or coordinates [NNZ, rank]); InputError when it is malformed or too large."""
    from onnx import numpy_helper

    values, dims = sparse.values, [int(d) for d in sparse.dims]
    name = values.name or sparse.indices.name
    try:
        vals = numpy_helper.to_array(values).reshape(-1)
        idx = numpy_helper.to_array(sparse.indices).astype(np.int64)
    except Exception as e:  # onnx's own errors on a malformed tensor
        raise InputError(f"sparse tensor '{name}' cannot be read: {e}") from None
    if any(d < 0 for d in dims):
        raise InputError(f"sparse tensor '{name}' has a negative dimension {dims}")
    size = int(np.prod(dims, dtype=object)) if dims else 1
    if size * vals.dtype.itemsize > MAX_DENSE_BYTES:
        raise InputError(f"sparse tensor '{name}' of shape {dims} is too large to make dense"
                         f" ({size * vals.dtype.itemsize} bytes)")
    if idx.ndim == 2 and dims:
        if idx.shape != (vals.size, len(dims)) or (idx < 0).any() or (idx >= np.array(dims)).any():
            raise InputError(f"sparse tensor '{name}': indices do not fit its shape {dims}")
        idx = np.ravel_multi_index(tuple(idx.T), dims) if vals.size else idx.reshape(-1)
    idx = idx.reshape(-1)
    if idx.size != vals.size or (idx < 0).any() or (idx >= size).any():
        raise InputError(f"sparse tensor '{name}': {idx.size} indices for {vals.size} values, or outside its"
                         f" {size} elements")
    dense = np.zeros(size, vals.dtype)
    dense[idx] = vals
    return numpy_helper.from_array(dense.reshape(dims), name)


def densify_sparse(graph: onnx.GraphProto) -> int:
    """Make the sparse initializers of `graph` and of its subgraphs dense initializers, and
    Constant nodes with a sparse_value Constants with a value: the passes and graphsurgeon read
    dense tensors only (a sparse initializer was lost). Returns how many were changed."""
    count = 0
    if len(graph.sparse_initializer):
        graph.initializer.extend(dense_tensor(s) for s in graph.sparse_initializer)
        count += len(graph.sparse_initializer)
        del graph.sparse_initializer[:]
    for node in graph.node:
        for a in node.attribute:
            if node.op_type == "Constant" and a.name == "sparse_value" and node.domain in ("", "ai.onnx"):
                dense = dense_tensor(a.sparse_tensor)
                a.Clear()
                a.CopyFrom(helper.make_attribute("value", dense))
                count += 1
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                count += densify_sparse(g)
    return count


def infer_shapes(model: onnx.ModelProto, notes: list[str] | None = None) -> onnx.ModelProto:
    """onnx shape inference with data propagation, falling back to plain inference, then to
    none: inference failing on an exotic model must not fail the run.

    Inference runs on a copy without the large initializers (graph inputs of their type and
    shape instead: no shape depends on the values of a tensor that large) and its results are
    written into `model`, which is returned: what onnx's inference returns, without copying
    hundreds of MB of weights into and out of it."""
    light, left_out = without_large_initializers(model)
    inferred = infer_light_model(light, left_out, notes)
    if inferred is None:
        return model
    # Inference writes value_info (in subgraphs too: nodes are taken over with their
    # attributes) and may refine inputs and outputs; the left-out weights' input entries go.
    graph, result = model.graph, inferred.graph
    inputs = list(result.input)[: len(graph.input)]
    del graph.input[:]
    graph.input.extend(inputs)
    for desc, value in result.ListFields():
        if desc.name in ("initializer", "input") or not desc.is_repeated:
            continue
        field = getattr(graph, desc.name)
        del field[:]
        field.extend(value)
    return model


# Initializers larger than this (elements) are described by type and shape alone while
# inferring shapes (graph.core.ShapeTable keeps the same ones).
INFER_KEEP_ELEMENTS = 4096


def without_large_initializers(
    model: onnx.ModelProto, keep_elements: int = INFER_KEEP_ELEMENTS
) -> tuple[onnx.ModelProto, int]:
    """(a copy of `model` whose initializers of more than keep_elements elements are graph
    inputs of their type and shape, the bytes of data left out)."""
    light = onnx.ModelProto()
    copy_fields(model, light, skip=("graph",))
    copy_fields(model.graph, light.graph, skip=("initializer",))
    declared = {v.name for v in model.graph.input}
    left_out = 0
    for t in model.graph.initializer:
        count = 1
        for d in t.dims:
            count *= d
        # An initializer that is also an input stays: inference checks the two against each other.
        if count <= keep_elements or t.name in declared:
            light.graph.initializer.append(t)
            continue
        try:
            itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        except Exception:  # packed or exotic types: a byte per element is close enough for a size estimate
            itemsize = 1
        left_out += count * itemsize
        light.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return light, left_out


def infer_light_model(light: onnx.ModelProto, left_out: int = 0, notes: list[str] | None = None) -> onnx.ModelProto | None:
    """Shape inference on a model whose large initializers were left out (left_out: their
    bytes): with data propagation, else without; None (with a note) when both fail or `light`
    itself is over protobuf's 2 GiB limit (onnx's inference serializes it)."""
    # left_out bytes are not part of `light` (that is the point of leaving them out).
    if light.ByteSize() >= PROTOBUF_LIMIT:
        if notes is not None:
            notes.append("shape inference skipped (model over 2 GiB)")
        return None
    from onnx import shape_inference

    for data_prop in (True, False):
        try:
            return shape_inference.infer_shapes(light, check_type=False, strict_mode=False, data_prop=data_prop)
        except Exception as e:  # onnx raises InferenceError, ValidationError, RuntimeError...
            error = e
    if notes is not None:
        notes.append(f"shape inference failed ({str(error).splitlines()[0] if str(error) else type(error).__name__})")
    return None
