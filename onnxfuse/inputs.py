"""Seeded random inputs for a model: every graph input at its declared shape.

Symbolic dimensions take the values given (`dims`), else DEFAULT_DIM; integer inputs used as
indices (Gather & co.) stay within the axis they index. `special_inputs` salts special values
(+-0, +-inf, NaN, denormals) into a few positions of each float input.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import onnx

from .modelio import InputError

DEFAULT_DIM = 1

# Ops whose input at the given position holds indices into another input's axis: a random
# integer input feeding them is drawn within that axis' size.
_INDEX_INPUTS = {
    "Gather": (1, 0, "axis", 0),
    "GatherElements": (1, 0, "axis", 0),
    "GatherND": (1, 0, None, 0),
    "ScatterElements": (1, 0, "axis", 0),
    "ScatterND": (1, 0, None, 0),
    "OneHot": (0, None, None, None),
}
DEFAULT_INT_HIGH = 4  # integers of unknown use: small non-negative values (counts, ids, flags)


class UnfeedableInputError(InputError):
    """A graph input random data cannot be made for (not a tensor, no numpy type)."""


def symbolic_dims(model: onnx.ModelProto) -> list[str]:
    names: list[str] = []
    initializers = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        for d in value.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param not in names:
                names.append(d.dim_param)
    return names


def input_shape(value: onnx.ValueInfoProto, dims: Mapping[str, int]) -> tuple[int, ...]:
    shape = []
    for d in value.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            shape.append(d.dim_value)
        elif d.HasField("dim_param"):
            shape.append(int(dims.get(d.dim_param, DEFAULT_DIM)))
        else:
            shape.append(DEFAULT_DIM)
    return tuple(shape)


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    shapes: dict[str, list[int | None]] = {}
    for t in model.graph.initializer:
        shapes[t.name] = list(t.dims)
    for v in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            shapes.setdefault(
                v.name, [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
            )
    return shapes


def _int_bounds(model: onnx.ModelProto, name: str) -> tuple[int, int]:
    """[low, high) for a random integer input: within the indexed axis when the input is used
    as indices (Gather & co.), else small non-negative values."""
    shapes = None
    high = None
    for node in model.graph.node:
        spec = _INDEX_INPUTS.get(node.op_type)
        if spec is None:
            continue
        index_pos, data_pos, axis_attr, default_axis = spec
        if index_pos >= len(node.input) or node.input[index_pos] != name:
            continue
        if node.op_type == "OneHot":
            bound = None
            depth = next((t for t in model.graph.initializer if len(node.input) > 1 and t.name == node.input[1]), None)
            if depth is not None:
                bound = int(onnx.numpy_helper.to_array(depth).reshape(-1)[0])
        else:
            if shapes is None:
                shapes = _static_shapes(model)
            data_shape = shapes.get(node.input[data_pos])
            axis = default_axis
            for a in node.attribute:
                if axis_attr and a.name == axis_attr:
                    axis = a.i
            bound = None
            if data_shape:
                axis = axis + len(data_shape) if axis < 0 else axis
                if 0 <= axis < len(data_shape):
                    bound = data_shape[axis]
        if bound:
            high = bound if high is None else min(high, bound)
    if high is None:
        return 0, DEFAULT_INT_HIGH
    return 0, max(1, high)


# Random inputs beyond this many elements (4 GiB of float32) would exhaust memory or take minutes.
MAX_RANDOM_INPUT_ELEMENTS = 2**30


def random_inputs(model: onnx.ModelProto, dims: Mapping[str, int] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random feeds for every graph input (initializers excluded), of the declared shapes."""
    dims = dict(dims or {})
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        if not value.type.HasField("tensor_type"):
            kind = value.type.WhichOneof("value") or "untyped"
            raise UnfeedableInputError(f"input '{value.name}' is a {kind.replace('_type', '')} value; only tensor inputs can be"
                             " fed random data")
        elem = value.type.tensor_type.elem_type
        shape = input_shape(value, dims)
        if any(d < 0 for d in shape):
            raise UnfeedableInputError(f"input '{value.name}' has a negative dimension {list(shape)}")
        if int(np.prod(shape, dtype=object)) > MAX_RANDOM_INPUT_ELEMENTS:
            raise UnfeedableInputError(
                f"input '{value.name}' of shape {list(shape)} is too large to feed random data"
                f" (more than {MAX_RANDOM_INPUT_ELEMENTS} elements)")
        if elem == onnx.TensorProto.STRING:
            feeds[value.name] = rng.choice(np.array(["a", "b", "c"], dtype=object), size=shape)
            continue
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
        except Exception:  # onnx raises KeyError/ValueError for types without a numpy equivalent
            dtype = None
        if dtype is None or elem in (onnx.TensorProto.BFLOAT16,) or dtype.kind == "V":
            name = onnx.TensorProto.DataType.Name(elem)
            raise UnfeedableInputError(f"input '{value.name}' has element type {name}, which cannot be fed from numpy")
        if dtype.kind == "f":
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "c":
            feeds[value.name] = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
        elif dtype.kind == "b":
            feeds[value.name] = rng.random(shape) < 0.5
        elif dtype.kind in "iu":
            low, high = _int_bounds(model, value.name)
            feeds[value.name] = rng.integers(low, high, size=shape).astype(dtype)
        else:
            raise UnfeedableInputError(f"input '{value.name}' has element type {dtype}, which cannot be fed random data")
    return feeds


# Special values the verification's second run puts at a few positions of every float input.
# Not the type's largest values: summed in another order (a fused GEMM, a blocked reduction),
# products near the top of the range overflow in one model and not in the other, correctly.
SPECIAL_POSITIONS = 4


def special_values(dtype: np.dtype) -> np.ndarray:
    """+-0, +-inf, NaN, +-smallest normal and +-smallest subnormal of a float type."""
    fi = np.finfo(dtype)
    return np.array([0.0, -0.0, np.inf, -np.inf, np.nan, fi.tiny, -fi.tiny, fi.smallest_subnormal,
                     -fi.smallest_subnormal], dtype)


def special_inputs(feeds: Mapping[str, np.ndarray], seed: int = 0) -> tuple[dict[str, np.ndarray], int]:
    """(a copy of `feeds` with special values at up to SPECIAL_POSITIONS positions of each real
    float input, the number of positions salted); deterministic in the seed."""
    rng = np.random.default_rng([seed, 0x5A17])
    salted: dict[str, np.ndarray] = {}
    count = 0
    for name, arr in feeds.items():
        arr = np.asarray(arr)
        if arr.dtype.kind != "f" or arr.size == 0:
            salted[name] = arr
            continue
        arr = np.array(arr)
        flat = arr.reshape(-1)
        idx = rng.choice(flat.size, size=min(flat.size, SPECIAL_POSITIONS), replace=False)
        flat[idx] = rng.choice(special_values(arr.dtype), size=len(idx))
        salted[name] = arr
        count += len(idx)
    return salted, count


def effective_dims(models: Sequence[onnx.ModelProto], dims: Mapping[str, int] | None = None) -> dict[str, int]:
    """Every symbolic input dimension of the models with the value it gets (given, else 1)."""
    dims = dict(dims or {})
    out: dict[str, int] = {}
    for m in models:
        for name in symbolic_dims(m):
            out.setdefault(name, int(dims.get(name, DEFAULT_DIM)))
    return out


def check_dims(dims: Mapping[str, int], models: Sequence[onnx.ModelProto], label: str = "--dim") -> None:
    """A --dim naming no symbolic dimension of any model is a typo, not a no-op."""
    known: list[str] = []
    for m in models:
        known += [d for d in symbolic_dims(m) if d not in known]
    for name in dims:
        if name not in known:
            has = f"it has: {', '.join(known)}" if known else "it has none"
            raise InputError(f"{label} {name}={dims[name]}: no input has a symbolic dimension '{name}' ({has})")
