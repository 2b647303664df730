"""Checking an optimized model against its original in onnxruntime on seeded random inputs.

Both models run on the same inputs, drawn from a seeded generator with the declared shapes
(symbolic dimensions from `dims`, default 1); every output is compared with a tolerance that
depends on its element type. The optimized model runs with our custom-op library when it holds
fused ops, and once more without it, so the fallback functions are checked too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import onnx

from .modelio import InputError, ort_error_text

DEFAULT_DIM = 1

# (atol, rtol) by output element type. A fused kernel computes a chain in one pass (in f32 for
# f16/bf16 chains, where onnxruntime rounds after every op) and may use other approximations of
# exp/tanh than onnxruntime's, so floats get a few units in the last place per op of slack.
TOLERANCES: dict[int, tuple[float, float]] = {
    onnx.TensorProto.DOUBLE: (1e-9, 1e-6),
    onnx.TensorProto.FLOAT: (1e-4, 1e-3),
    onnx.TensorProto.FLOAT16: (1e-2, 1e-2),
    onnx.TensorProto.BFLOAT16: (5e-2, 5e-2),
}
EXACT = (0.0, 0.0)

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


class VerificationError(Exception):
    """The optimized model does not match the original (or does not run)."""

    def __init__(self, message: str, result: "Verification | None" = None):
        super().__init__(message)
        self.result = result


# --------------------------------------------------------------------------- inputs


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


# --------------------------------------------------------------------------- comparing


@dataclass
class OutputCheck:
    name: str
    dtype: str
    shape: tuple
    max_abs: float = 0.0
    max_rel: float = 0.0  # max |a - b| / (|b| + atol)
    # max |a - b| / max |b|: the error relative to the output's scale (infinity norm), which,
    # unlike max_rel, does not grow without bound where an element crosses zero.
    norm_rel: float = 0.0
    atol: float = 0.0
    rtol: float = 0.0
    mismatched: int = 0  # elements outside the tolerance
    problem: str | None = None  # shape/type/NaN mismatch, or the tolerance exceeded

    @property
    def ok(self) -> bool:
        return self.problem is None

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "norm_rel": self.norm_rel,
            "atol": self.atol,
            "rtol": self.rtol,
            "mismatched": self.mismatched,
            "ok": self.ok,
            "problem": self.problem,
        }


def compare_output(name: str, elem_type: int, expected: np.ndarray, actual: np.ndarray) -> OutputCheck:
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    atol, rtol = TOLERANCES.get(elem_type, EXACT)
    check = OutputCheck(name, str(expected.dtype), tuple(expected.shape), atol=atol, rtol=rtol)
    if expected.shape != actual.shape:
        check.problem = f"shape {tuple(actual.shape)} instead of {tuple(expected.shape)}"
        return check
    if expected.dtype != actual.dtype:
        check.problem = f"element type {actual.dtype} instead of {expected.dtype}"
        return check
    if expected.size == 0:
        return check
    if expected.dtype.kind not in "fc":
        bad = expected != actual
        check.mismatched = int(np.count_nonzero(bad))
        if expected.dtype.kind in "iub":
            diff = np.abs(expected.astype(np.float64) - actual.astype(np.float64))
            check.max_abs = float(diff.max())
            check.max_rel = float((diff / (np.abs(expected.astype(np.float64)) + 1)).max())
        if check.mismatched:
            check.problem = f"{check.mismatched} of {expected.size} values differ (exact match required)"
        return check
    e = expected.astype(np.complex128 if expected.dtype.kind == "c" else np.float64)
    a = actual.astype(e.dtype)
    nan_e, nan_a = np.isnan(e), np.isnan(a)
    if np.any(nan_e != nan_a):
        count = int(np.count_nonzero(nan_e != nan_a))
        check.mismatched = count
        check.problem = f"NaN at {count} positions where the other model has a number"
        return check
    finite = ~nan_e
    inf_e, inf_a = np.isinf(e) & finite, np.isinf(a) & finite
    if np.any(inf_e != inf_a) or np.any(e[inf_e] != a[inf_e]):
        count = int(np.count_nonzero((inf_e != inf_a) | (inf_e & (e != a))))
        check.mismatched = count
        check.problem = f"infinity at {count} positions that differ between the models"
        return check
    both = finite & ~inf_e
    diff = np.abs(a[both] - e[both])
    if diff.size:
        check.max_abs = float(diff.max())
        check.max_rel = float((diff / (np.abs(e[both]) + max(atol, np.finfo(np.float64).tiny))).max())
        scale = float(np.abs(e[both]).max())
        check.norm_rel = check.max_abs / scale if scale > 0 else (0.0 if check.max_abs == 0 else float("inf"))
        bad = diff > atol + rtol * np.abs(e[both])
        check.mismatched = int(np.count_nonzero(bad))
    if check.mismatched:
        check.problem = (
            f"{check.mismatched} of {expected.size} values outside atol={atol:g} rtol={rtol:g}"
            f" (max abs error {check.max_abs:.3g}, max rel error {check.max_rel:.3g})"
        )
    return check


# --------------------------------------------------------------------------- verifying


@dataclass
class RunCheck:
    """The optimized model in one configuration (with our library, or on fallback functions)."""

    label: str
    outputs: list[OutputCheck] = field(default_factory=list)
    error: str | None = None  # onnxruntime could not load or run it

    @property
    def ok(self) -> bool:
        return self.error is None and all(o.ok for o in self.outputs)

    def as_dict(self) -> dict:
        return {"run": self.label, "ok": self.ok, "error": self.error, "outputs": [o.as_dict() for o in self.outputs]}


@dataclass
class InputDependence:
    """Outputs whose values do not depend on the inputs, and what was compared instead.

    Some models compute the same outputs whatever the input (the light ONNX zoo CNNs: equal
    weights make every logit equal, so the final Softmax is uniform); comparing those outputs
    checks nothing the optimizer could get wrong upstream. The nearest tensors before them that
    do depend on the inputs, and that both models compute, are compared in their place.
    """

    constant_outputs: list[str]
    runs: list[RunCheck] = field(default_factory=list)  # the stand-in tensors, per configuration
    note: str | None = None  # why nothing could stand in

    @property
    def compared(self) -> list[str]:
        return [o.name for o in self.runs[0].outputs] if self.runs else []

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs)

    def as_dict(self) -> dict:
        return {"constant_outputs": self.constant_outputs, "compared": self.compared, "ok": self.ok,
                "note": self.note, "runs": [r.as_dict() for r in self.runs]}


@dataclass
class Verification:
    seed: int
    dims: dict[str, int]
    provider: str
    runs: list[RunCheck] = field(default_factory=list)
    original_profile: object | None = None  # profile.KernelProfile of the original
    optimized_profile: object | None = None  # ... and of the optimized model (with library)
    # "whole": both models run and compared; "regions": each fused node against its fallback
    # body (region_verify.py), for models whose whole run would not fit in memory.
    mode: str = "whole"
    mode_reason: str | None = None  # why this mode ran (auto choice, or the option that forced it)
    regions: list = field(default_factory=list)  # region_verify.RegionCheck, in "regions" mode
    input_dependence: InputDependence | None = None  # set when some outputs are constant
    # The same comparison on the inputs with special values at a few positions (special_inputs):
    # NaN and infinity positions must match; None when no input is a float tensor.
    special: RunCheck | None = None
    special_positions: int = 0

    def _all_runs(self) -> list[RunCheck]:
        return self.runs + (self.input_dependence.runs if self.input_dependence else [])

    @property
    def ok(self) -> bool:
        return (all(r.ok for r in self._all_runs()) and all(r.ok for r in self.regions)
                and (self.special is None or self.special.ok))

    @property
    def outputs(self) -> list[OutputCheck]:
        return [o for r in self._all_runs() for o in r.outputs] + [o for r in self.regions for o in r.outputs]

    @property
    def max_abs(self) -> float:
        return max((o.max_abs for o in self.outputs), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((o.max_rel for o in self.outputs), default=0.0)

    @property
    def norm_rel(self) -> float:
        return max((o.norm_rel for o in self.outputs), default=0.0)

    def first_problem(self) -> str | None:
        stand_ins = self.input_dependence.runs if self.input_dependence else []
        for r in self._all_runs() + ([self.special] if self.special is not None else []):
            what = "tensor" if r in stand_ins else "output"
            if r.error:
                return f"{r.label}: {r.error}"
            for o in r.outputs:
                if not o.ok:
                    return f"{what} '{o.name}' ({r.label}): {o.problem}"
        for g in self.regions:
            what, against = (("fused node", "its fallback body") if g.kind == "fused"
                             else ("rewrite at", "the original subgraph"))
            if g.error:
                return f"{what} '{g.node}' ({g.op_type}): {g.error}"
            for o in g.outputs:
                if not o.ok:
                    return f"{what} '{g.node}' ({g.op_type}), output '{o.name}' against {against}: {o.problem}"
        return None

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "seed": self.seed,
            "dims": self.dims,
            "provider": self.provider,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "norm_rel": self.norm_rel,
            "mode": self.mode,
            "mode_reason": self.mode_reason,
            "runs": [r.as_dict() for r in self.runs],
            **({"regions": [r.as_dict() for r in self.regions]} if self.mode == "regions" else {}),
            "input_dependence": self.input_dependence.as_dict() if self.input_dependence else None,
            "special_values": None if self.special is None else {
                "positions": self.special_positions, **self.special.as_dict()},
        }


def _output_types(model: onnx.ModelProto) -> list[int]:
    return [o.type.tensor_type.elem_type if o.type.HasField("tensor_type") else 0 for o in model.graph.output]


# Models with at least this many bytes of initializer data reach onnxruntime as model files
# with their weights in one external data file (written once for both models: the weights
# the optimized model did not change are stored once). Handing onnxruntime a ModelProto
# serializes it (weights included) for every session, which for GPT-2 small's 500 MB was
# most of the verification time; from a file, onnxruntime maps the aligned weights in.
EXTERNAL_DATA_MIN_BYTES = 64 << 20
_DATA_FILE = "weights.bin"
_ALIGN = 4096


def _initializer_bytes(t: onnx.TensorProto) -> int:
    """The bytes of an initializer's data by its type and dims, without reading the data."""
    if not t.HasField("raw_data"):
        return 0
    count = 1
    for d in t.dims:
        count *= d
    try:
        return count * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except Exception:  # packed or exotic types stay inline
        return 0


def _scratch_directory(size: int) -> str | None:
    """Where the model files for onnxruntime go: a memory file system (/dev/shm) when it has
    room for twice `size` bytes, else the temporary directory. Writing to disk cost 2.8 s for
    GPT-2 small's weights here, to /dev/shm 0.45 s."""
    import os

    shm = "/dev/shm"
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    if not os.access(shm, os.W_OK | os.X_OK) or st.f_bavail * st.f_frsize < 2 * size:
        return None
    return shm


def _large_weights(model: onnx.ModelProto) -> int:
    return sum(_initializer_bytes(t) for t in model.graph.initializer)


class _SharedWeights:
    """One external data file for several models: identical initializers are stored once."""

    def __init__(self, directory: str) -> None:
        import os

        self.directory = directory
        self.file = open(os.path.join(directory, _DATA_FILE), "wb")
        self.offset = 0
        self.stored: dict[tuple, list[tuple[bytes, int]]] = {}

    def place(self, t: onnx.TensorProto) -> tuple[int, int]:
        """(offset, length) of `t`'s data in the file (written there unless an identical
        tensor's data was)."""
        data = t.raw_data
        key = (t.data_type, tuple(t.dims), len(data))
        for other, offset in self.stored.get(key, ()):
            if other == data:
                return offset, len(data)
        pad = (-self.offset) % _ALIGN
        self.file.write(b"\0" * pad)
        offset = self.offset + pad
        self.file.write(data)
        self.offset = offset + len(data)
        self.stored.setdefault(key, []).append((data, offset))
        return offset, len(data)

    def write_model(self, model: onnx.ModelProto, name: str) -> str:
        """Save `model` under `name` with its large initializers in the shared data file."""
        import os

        from .modelio import EXTERNAL_TENSOR_MIN_BYTES, _copy_fields

        light = onnx.ModelProto()
        _copy_fields(model, light, skip="graph")
        _copy_fields(model.graph, light.graph, skip="initializer")
        for t in model.graph.initializer:
            if _initializer_bytes(t) < EXTERNAL_TENSOR_MIN_BYTES:
                light.graph.initializer.append(t)
                continue
            offset, size = self.place(t)
            moved = light.graph.initializer.add()
            # Field by field: ListFields/CopyFrom would copy the data too.
            moved.name = t.name
            moved.data_type = t.data_type
            moved.dims.extend(t.dims)
            if t.HasField("doc_string"):
                moved.doc_string = t.doc_string
            if t.HasField("segment"):
                moved.segment.CopyFrom(t.segment)
            moved.metadata_props.extend(t.metadata_props)
            moved.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", _DATA_FILE), ("offset", str(offset)), ("length", str(size))):
                entry = moved.external_data.add()
                entry.key, entry.value = key, value
        path = os.path.join(self.directory, name)
        with open(path, "wb") as f:
            f.write(light.SerializeToString())
        return path

    def close(self) -> None:
        self.file.close()
        self.stored.clear()


def verify(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    provider: str = "cpu",
    threads: int | None = None,
    fallback: bool = True,
    original_label: str = "original model",
) -> Verification:
    """Run both models on the same seeded inputs and compare every output.

    Raises InputError when the original itself cannot be fed or run (that is the input's
    problem, not the optimizer's). Mismatches and failures of the optimized model are recorded
    in the result; check .ok. The profiled runs also give both models' kernel counts.
    """
    dims = dict(dims or {})
    try:
        feeds = random_inputs(original, dims, seed)
    except UnfeedableInputError as e:
        raise UnfeedableInputError(f"{original_label}: {e}; verification needs random inputs (--no-verify skips it)") from None
    from .weights import has_references

    if has_references(original) or has_references(optimized):
        return _verify_from_references(original, optimized, feeds, dims, seed, provider, threads, fallback,
                                       original_label)
    if max(_large_weights(original), _large_weights(optimized)) < EXTERNAL_DATA_MIN_BYTES:
        return _verify(original, optimized, original, optimized, feeds, dims, seed, provider, threads, fallback,
                       original_label)
    import tempfile

    size = _large_weights(original) + _large_weights(optimized)
    with tempfile.TemporaryDirectory(prefix="onnxfuse-verify-", dir=_scratch_directory(size)) as tmp:
        weights = _SharedWeights(tmp)
        try:
            original_file = weights.write_model(original, "original.onnx")
            optimized_file = weights.write_model(optimized, "optimized.onnx")
        finally:
            weights.close()
        return _verify(original, optimized, original_file, optimized_file, feeds, dims, seed, provider, threads,
                       fallback, original_label)


def _verify_from_references(original, optimized, feeds, dims, seed, provider, threads, fallback, original_label):
    """verify() for models holding weights by reference (loaded with external data): onnxruntime
    loads them from model files beside hard links to their data files, and maps the weights."""
    import shutil

    from .weights import RuntimeFiles, runtime_directory

    directory = runtime_directory()
    files = RuntimeFiles(directory)
    try:
        original_file = files.write(original, "original.onnx")
        optimized_file = files.write(optimized, "optimized.onnx")
        files.close()
        return _verify(original, optimized, original_file, optimized_file, feeds, dims, seed, provider, threads,
                       fallback, original_label)
    finally:
        files.close()
        shutil.rmtree(directory, ignore_errors=True)


# --------------------------------------------------------------------------- choosing a mode

VERIFY_MODES = ("auto", "whole", "regions")
# Peak memory of a whole-model run per byte of weights: onnxruntime maps the weights and
# prepacks the GEMM weights into a second copy (bench/results/large_model.md).
WHOLE_RUN_BYTES_PER_WEIGHT_BYTE = 2.0
# Memory a whole-model run may plan on: this share of what the machine has available.
USABLE_MEMORY_SHARE = 0.8


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's initializers, inline or held by reference."""
    from .weights import expected_bytes

    total = 0
    for t in model.graph.initializer:
        total += expected_bytes(t) or 0
    return total


def available_memory() -> int | None:
    """Bytes of memory this process can still get: the machine's MemAvailable, less where a
    cgroup limit is lower; None where that cannot be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max" and available is not None:
            available = min(available, int(limit) - current)
    except (OSError, ValueError):
        pass
    return available


def whole_run_bytes(original: onnx.ModelProto, optimized: onnx.ModelProto) -> int:
    """Estimated peak memory of a whole-model verification (the models run one at a time)."""
    return int(max(weight_bytes(original), weight_bytes(optimized)) * WHOLE_RUN_BYTES_PER_WEIGHT_BYTE)


def choose_mode(original: onnx.ModelProto, optimized: onnx.ModelProto, requested: str = "auto",
                available: int | None = None) -> tuple[str, str]:
    """(mode, why): "whole" unless its estimated memory exceeds what is available ("auto"),
    or as requested."""
    if requested not in VERIFY_MODES:
        raise InputError(f"--verify-mode {requested}: expected one of {', '.join(VERIFY_MODES)}")
    if requested != "auto":
        return requested, f"--verify-mode {requested}"
    need = whole_run_bytes(original, optimized)
    available = available_memory() if available is None else available
    if available is None or need <= available * USABLE_MEMORY_SHARE:
        return "whole", "fits in memory" if available is not None else "available memory unknown"
    return "regions", (f"a whole-model run needs about {need / 1e9:.1f} GB, {available / 1e9:.1f} GB"
                       " available")


def _verify(original, optimized, original_source, optimized_source, feeds, dims, seed, provider, threads, fallback,
            original_label) -> Verification:
    """verify() with the models as onnxruntime is to load them (ModelProtos or file paths)."""
    from .runtime import needs_library, profiled_run

    result = Verification(seed=seed, dims=dims, provider=provider)
    try:
        expected, result.original_profile = profiled_run(original_source, feeds, provider=provider, threads=threads)
    except InputError:
        raise
    except Exception as e:  # onnxruntime raises its own exception types
        from .runtime import LibraryError

        if isinstance(e, LibraryError):
            raise
        raise InputError(f"{original_label}: onnxruntime cannot run it: {ort_error_text(e)}") from None
    names = [o.name for o in original.graph.output]
    types = _output_types(original)

    uses_library = needs_library(optimized, provider)
    configs = [("with the onnxfuse library", None)] if uses_library else [("optimized", False)]
    if fallback and uses_library:
        configs.append(("fallback functions, no library", False))
    for label, with_library in configs:
        run = RunCheck(label)
        result.runs.append(run)
        try:
            actual, prof = profiled_run(
                optimized_source, feeds, provider=provider, threads=threads, with_library=with_library
            )
        except InputError:
            raise
        except Exception as e:  # onnxruntime raises its own exception types
            from .runtime import LibraryError

            if isinstance(e, LibraryError):
                raise
            run.error = f"onnxruntime cannot run the optimized model: {ort_error_text(e)}"
            continue
        if result.optimized_profile is None:
            result.optimized_profile = prof
        opt_names = [o.name for o in optimized.graph.output]
        if opt_names != names:
            run.error = f"outputs are {opt_names}, the original's are {names}"
            continue
        for name, elem, e, a in zip(names, types, expected, actual):
            run.outputs.append(compare_output(name, elem, e, a))
    if result.runs and all(r.error is None for r in result.runs) and any(_uniform(x) for x in expected):
        result.input_dependence = _input_dependence(
            original, optimized, feeds, expected, dims, seed, provider, threads, configs)
    if result.ok:
        _verify_special_values(result, original_source, optimized_source, feeds, seed, provider, threads,
                               configs[0], names, types, original_label)
    return result


def _uniform(value) -> bool:
    """All elements equal: what an output that ignores its inputs usually looks like (checked
    further with other inputs before anything is concluded)."""
    a = np.asarray(value)
    if a.size == 0 or a.dtype.kind not in "fciub":
        return False
    flat = a.reshape(-1)
    return bool(np.all(flat == flat[0])) or bool(np.all(np.isnan(flat)))


# How far back from a constant output to look for tensors that depend on the inputs.
MAX_STAND_IN_CANDIDATES = 24


def _input_dependence(original, optimized, feeds, expected, dims, seed, provider, threads, configs):
    """Which outputs are the same for other inputs, and the comparison of the nearest tensors
    upstream of them that are not (see InputDependence)."""
    from .runtime import make_session

    other_feeds = random_inputs(original, dims, seed + 1)
    if not feeds or all(np.array_equal(feeds[k], other_feeds[k]) for k in feeds):
        return None
    names = [o.name for o in original.graph.output]
    uniform = [n for n, value in zip(names, expected) if _uniform(value)]

    # Tensors before the uniform outputs, nearest first, that the optimized model computes too.
    producer = {out: node for node in original.graph.node for out in node.output if out}
    in_optimized = {out for node in optimized.graph.node for out in node.output}
    graph_inputs = {i.name for i in original.graph.input}
    candidates: list[str] = []
    queue, seen = list(uniform), set(uniform)
    while queue and len(candidates) < MAX_STAND_IN_CANDIDATES:
        node = producer.get(queue.pop(0))
        if node is None:
            continue
        for inp in node.input:
            if not inp or inp in seen or inp in graph_inputs or inp not in producer:
                continue
            seen.add(inp)
            queue.append(inp)
            if inp in in_optimized and inp not in names:
                candidates.append(inp)

    # One session of the original answers both questions: do the uniform outputs stay the same
    # for other inputs, and which candidates change with them.
    sess = make_session(_with_outputs(original, candidates), provider=provider, threads=threads)
    fetched = uniform + candidates
    first = sess.run(fetched, feeds)
    second = sess.run(fetched, other_feeds)
    same = {n: np.asarray(a).shape == np.asarray(b).shape and np.array_equal(a, b, equal_nan=True)
            for n, a, b in zip(fetched, first, second)}
    constant = [n for n in uniform if same[n]]
    if not constant:
        return None
    found = InputDependence(constant)
    varying = [n for n in candidates if not same[n]]
    if not varying:
        found.note = "no tensor before them that depends on the inputs is computed by both models"
        return found
    stand_in = varying[0]  # the nearest one, in breadth-first order from the outputs
    reference = first[fetched.index(stand_in)]
    elem = _elem_type(reference)
    optimized_probe = _with_outputs(optimized, [stand_in])
    for label, with_library in configs:
        run = RunCheck(label)
        found.runs.append(run)
        try:
            (actual,) = make_session(optimized_probe, provider=provider, threads=threads,
                                     with_library=with_library).run([stand_in], feeds)
        except Exception as e:  # onnxruntime's exception types
            run.error = f"onnxruntime cannot run the optimized model with '{stand_in}' as an output: {ort_error_text(e)}"
            continue
        run.outputs.append(compare_output(stand_in, elem, reference, actual))
    return found


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for name in names:
        copy.graph.output.append(onnx.ValueInfoProto(name=name))
    return copy


def _elem_type(value) -> int:
    try:
        return int(onnx.helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype))
    except Exception:  # a dtype onnx has no enum for: compared exactly
        return 0


def _verify_special_values(result, original_source, optimized_source, feeds, seed, provider, threads, config,
                           names, types, original_label) -> None:
    """Both models again on the inputs with special values salted in (special_inputs)."""
    from .runtime import LibraryError, make_session

    salted, count = special_inputs(feeds, seed)
    if not count:
        return
    label, with_library = config
    result.special_positions = count
    result.special = run = RunCheck(f"special values at {count} input positions, {label}")
    try:
        expected = make_session(original_source, provider, with_library=False, threads=threads).run(None, salted)
    except Exception as e:  # onnxruntime's own types: a model may refuse a NaN (e.g. as an index)
        if isinstance(e, LibraryError):
            raise
        result.special = None  # the original cannot run them: nothing to compare
        return
    try:
        actual = make_session(optimized_source, provider, with_library=with_library, threads=threads).run(None, salted)
    except Exception as e:
        if isinstance(e, LibraryError):
            raise
        run.error = f"onnxruntime cannot run the optimized model: {ort_error_text(e)}"
        return
    for name, elem, e, a in zip(names, types, expected, actual):
        run.outputs.append(compare_output(name, elem, e, a))
