"""The model zoo: named models to optimize, profile and regression-test (`zoo:NAME`).

Two kinds of members, listed in models/manifest.json:
- "onnx-wheel": the nine light ONNX Model Zoo networks shipped in the onnx wheel
  (onnx/backend/test/data/light/), each with the reference output onnx's backend test checks;
  found at run time next to the installed onnx, never copied.
- "generated": small launch-bound models committed in models/ with the script that writes
  them (python models/NAME.py regenerates NAME.onnx byte for byte).
- "corpus": public architectures (transformers, torchvision, torch-written RNN cells) as
  torch.onnx exports them, written by models/corpus/build.py. They are committed as graphs
  without their weight values: each large float initializer is a record (dtype, dims, seed,
  mean and std, or the fill value of a constant tensor) that materialize_weights turns back
  into the same tensor on every machine. `path` is the materialized model, written once into
  the cache directory (ONNXFUSE_CACHE_DIR, default ~/.cache/onnxfuse).

models/ is found in a source checkout or editable install (next to the onnxfuse package),
installed as package data (onnxfuse/models/), or where ONNXFUSE_ZOO_DIR points.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .modelio import InputError, LoadedModel, load_model

ZOO_PREFIX = "zoo:"
SOURCES = ("onnx-wheel", "generated", "corpus")
MANIFEST = "manifest.json"
BASELINE = "baseline.json"
_PKG = Path(__file__).resolve().parent


class ZooError(LookupError):
    """An unknown zoo name or a zoo file that is missing; the message is one line."""


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: str  # numpy dtype name: "float32", "int64"
    shape: tuple  # ints and symbolic dim names
    description: str = ""


@dataclass(frozen=True)
class ZooModel:
    name: str
    file: Path  # the file as stored (a corpus model's holds weight records, not values)
    description: str
    dims: dict  # symbolic dim -> default size
    source: str  # "onnx-wheel" | "generated"
    reference: Path | None  # reference output (.pb) for the reference inputs, or None
    inputs: tuple[InputSpec, ...]
    slow: bool = False  # seconds per regression check: run only in the full (slow) suite
    generator: Path | None = None  # the script that writes a generated model
    reference_rtol: float = 1e-3
    reference_atol: float = 1e-7
    notes: tuple[str, ...] = field(default=())
    # further settings of the symbolic dims the regression suite verifies at, beyond `dims`
    alt_dims: tuple[dict, ...] = field(default=())
    exporter: str | None = None  # corpus: "torchscript" (dynamo=False) or "dynamo"
    family: str | None = None  # corpus: "transformer", "rnn" or "cnn"

    @property
    def uri(self) -> str:
        return ZOO_PREFIX + self.name

    @property
    def path(self) -> Path:
        """A runnable model file: the stored file, or for a corpus model its materialized copy
        in the cache directory (written on first use)."""
        if self.source != "corpus" or not self.file.is_file():
            return self.file
        return _materialized_path(self.file)

    @property
    def shape_sets(self) -> tuple[dict, ...]:
        """The settings of the symbolic dims to verify at: the defaults, then alt_dims."""
        return (dict(self.dims), *(dict(d) for d in self.alt_dims))

    def load(self) -> onnx.ModelProto:
        if not self.file.is_file():
            raise ZooError(f"{self.uri}: model file {self.file} is missing")
        if self.source == "corpus":
            return materialize_weights(onnx.load(str(self.file), load_external_data=False))
        return onnx.load(str(self.path))

    def input_shapes(self, dims: dict | None = None) -> dict[str, tuple[int, ...]]:
        """Concrete input shapes: symbolic dims from `dims`, then the model's defaults."""
        merged = {**self.dims, **(dims or {})}
        return {i.name: tuple(d if isinstance(d, int) else merged[d] for d in i.shape) for i in self.inputs}

    def reference_inputs(self) -> dict[str, np.ndarray]:
        """The inputs the reference output belongs to. onnx's backend test feeds the light
        models arange(n).reshape(shape) / n (float32) and compares with *_output_0.pb."""
        feeds = {}
        for spec in self.inputs:
            shape = self.input_shapes()[spec.name]
            n = int(np.prod(shape))
            feeds[spec.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
        return feeds

    def reference_outputs(self) -> list[np.ndarray]:
        if self.reference is None:
            raise ZooError(f"{self.uri} has no reference output")
        if not self.reference.is_file():
            raise ZooError(f"{self.uri}: reference output {self.reference} is missing")
        return [onnx.numpy_helper.to_array(onnx.load_tensor(str(self.reference)))]


def wheel_models_dir() -> Path:
    """Where the installed onnx keeps its light zoo models."""
    return Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "light"


def models_dir() -> Path:
    """The directory holding manifest.json and the generated models."""
    env = os.environ.get("ONNXFUSE_ZOO_DIR")
    candidates = [Path(env)] if env else []
    # installed package data first, then the source tree (checkout or editable install)
    candidates += [_PKG / "models", _PKG.parent / "models"]
    for candidate in candidates:
        if (candidate / MANIFEST).is_file():
            return candidate
    where = ", ".join(str(c) for c in candidates)
    raise ZooError(f"the model zoo manifest ({MANIFEST}) is not found (looked in {where}); set ONNXFUSE_ZOO_DIR")


def _entry(raw: dict, root: Path) -> ZooModel:
    source = raw["source"]
    if source not in SOURCES:
        raise ZooError(f"{MANIFEST}: model '{raw.get('name')}' has unknown source '{source}'")
    base = wheel_models_dir() if source == "onnx-wheel" else root
    ref = raw.get("reference")
    return ZooModel(
        name=raw["name"],
        file=base / raw["file"],
        description=raw["description"],
        dims=dict(raw.get("dims", {})),
        source=source,
        reference=base / ref["file"] if ref else None,
        reference_rtol=float(ref.get("rtol", 1e-3)) if ref else 1e-3,
        reference_atol=float(ref.get("atol", 1e-7)) if ref else 1e-7,
        inputs=tuple(
            InputSpec(i["name"], i["dtype"], tuple(i["shape"]), i.get("description", "")) for i in raw["inputs"]
        ),
        slow=bool(raw.get("slow", False)),
        generator=root / raw["generator"] if raw.get("generator") else None,
        notes=tuple(raw.get("notes", ())),
        alt_dims=tuple(dict(d) for d in raw.get("alt_dims", ())),
        exporter=raw.get("exporter"),
        family=raw.get("family"),
    )


def list_models() -> list[ZooModel]:
    """Every zoo model, in manifest order."""
    root = models_dir()
    try:
        raw = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ZooError(f"cannot read {root / MANIFEST}: {e}") from None
    return [_entry(m, root) for m in raw["models"]]


def names() -> list[str]:
    return [m.name for m in list_models()]


def get(name: str) -> ZooModel:
    """The zoo model called NAME (or zoo:NAME); ZooError listing the known names otherwise."""
    key = name[len(ZOO_PREFIX):] if name.startswith(ZOO_PREFIX) else name
    models = list_models()
    for m in models:
        if m.name == key:
            return m
    raise ZooError(f"unknown zoo model '{key}'; known: {', '.join(m.name for m in models)}")


def resolve(name_or_uri: str) -> str:
    """Path of the model file for NAME or zoo:NAME; ZooError when unknown or missing."""
    model = get(name_or_uri)
    if not model.file.is_file():
        hint = " (the installed onnx does not ship it)" if model.source == "onnx-wheel" else ""
        raise ZooError(f"{model.uri}: model file {model.file} is missing{hint}")
    return str(model.path)


def resolve_input(spec: str, weights_on_disk: bool = False) -> LoadedModel:
    """A path, or zoo:NAME for a bundled model (its symbolic dims come with it); weights_on_disk
    as for modelio.load_model."""
    if not spec.startswith(ZOO_PREFIX):
        return load_model(spec, weights_on_disk=weights_on_disk)
    name = spec[len(ZOO_PREFIX):]
    try:
        path = resolve(name)
    except ZooError as e:
        raise InputError(f"{spec}: {e}") from None
    loaded = load_model(path, label=spec, weights_on_disk=weights_on_disk)
    entry = next((m for m in list_models() if m.name == name), None)
    if entry is not None:
        loaded.dims = dict(entry.dims or {})
    return loaded


# --------------------------------------------------------------------------- seeded weights
#
# A corpus model keeps its graph and its small or integer tensors verbatim; every float
# initializer of more than SEEDED_MIN_ELEMENTS elements is stored as a record instead of its
# values, in the TensorProto itself: data_location EXTERNAL with the location SEEDED_LOCATION
# and the keys seed, mean, std (values drawn from a seeded normal distribution with the
# original tensor's mean and standard deviation), or the key fill (every element equal, as
# LayerNorm's ones). A reader that does not know the records fails on the missing external
# file instead of running wrong values.

SEEDED_LOCATION = "onnxfuse-seeded-weights"
SEEDED_MIN_ELEMENTS = 64
# A float tensor with at most this many distinct values (masks, one-hot tables) is kept as it is.
SEEDED_MIN_DISTINCT = 16
_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)


def seeded_record(tensor: onnx.TensorProto, seed: int) -> onnx.TensorProto | None:
    """The record that stands for `tensor`, or None when the tensor is kept verbatim (small,
    not a float, few distinct values, or holding inf/NaN)."""
    if tensor.data_type not in _FLOAT_TYPES or tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None
    values = onnx.numpy_helper.to_array(tensor)
    if values.size <= SEEDED_MIN_ELEMENTS or not np.all(np.isfinite(values)):
        return None
    wide = values.astype(np.float64).ravel()
    if np.all(wide == wide[0]):
        stats = {"fill": repr(float(wide[0]))}
    elif len(np.unique(wide)) <= SEEDED_MIN_DISTINCT:
        return None
    else:
        stats = {"seed": str(seed), "mean": repr(float(wide.mean())), "std": repr(float(wide.std()))}
    record = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=list(tensor.dims))
    record.data_location = onnx.TensorProto.EXTERNAL
    for key, value in {"location": SEEDED_LOCATION, **stats}.items():
        record.external_data.add(key=key, value=value)
    return record


def strip_weights(model: onnx.ModelProto, seed: int) -> int:
    """Replace the model's large float initializers by seeded records, in place (tensor i gets
    seed + i). Returns how many were replaced."""
    replaced = 0
    for i, tensor in enumerate(model.graph.initializer):
        record = seeded_record(tensor, seed + i)
        if record is not None:
            tensor.CopyFrom(record)
            replaced += 1
    return replaced


def _record_values(tensor: onnx.TensorProto) -> np.ndarray:
    entries = {e.key: e.value for e in tensor.external_data}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    shape = tuple(tensor.dims)
    if "fill" in entries:
        return np.full(shape, float(entries["fill"]), dtype=dtype)
    rng = np.random.default_rng(int(entries["seed"]))
    values = rng.standard_normal(int(np.prod(shape, dtype=np.int64))) * float(entries["std"]) + float(entries["mean"])
    return values.reshape(shape).astype(dtype)


def is_seeded(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == SEEDED_LOCATION for e in tensor.external_data
    )


def materialize_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every seeded record replaced by its values (in place; returned)."""
    for tensor in model.graph.initializer:
        if is_seeded(tensor):
            tensor.CopyFrom(onnx.numpy_helper.from_array(_record_values(tensor), tensor.name))
    return model


def cache_dir() -> Path:
    env = os.environ.get("ONNXFUSE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "onnxfuse"


def _materialized_path(stored: Path) -> Path:
    """The materialized copy of a stored corpus model, named by the stored bytes' hash, written
    (atomically) when it is not there yet."""
    data = stored.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    target = cache_dir() / "zoo" / f"{stored.stem}-{digest}.onnx"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ZooError(f"cannot create the zoo cache directory {target.parent}: {e.strerror or e}; "
                       "set ONNXFUSE_CACHE_DIR") from None
    model = onnx.ModelProto()
    model.ParseFromString(data)
    payload = materialize_weights(model).SerializeToString()
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


# --------------------------------------------------------------------------- regression baseline


def baseline_path() -> Path:
    return models_dir() / BASELINE


def load_baseline() -> dict:
    path = baseline_path()
    if not path.is_file():
        return {"models": {}}
    return json.loads(path.read_text())


# onnxruntime's NCHWc layout (CPU, x86) starts at these ops; what it does depends on the CPU
# (MLAS's channel block: 8 floats with AVX2, 16 with AVX-512), so the kernel counts of a model
# that has one depend on the machine. A model without any runs the same kernels on every CPU.
LAYOUT_OPS = frozenset({"Conv", "MaxPool", "AveragePool", "GlobalMaxPool", "GlobalAveragePool"})


def _graph_ops(graph: onnx.GraphProto):
    for n in graph.node:
        yield n
        for a in n.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _graph_ops(g)


def layout_dependent(*models: onnx.ModelProto) -> bool:
    """Whether onnxruntime's kernel counts of any of `models` may change with the CPU's NCHWc
    block: some node (in any subgraph too) is one of LAYOUT_OPS."""
    return any(n.op_type in LAYOUT_OPS and n.domain in ("", "ai.onnx")
               for m in models for n in _graph_ops(m.graph))


def baseline_kernels(entry: dict, block: int, recorded_block: int, dependent: bool) -> dict | None:
    """The kernel counts ({"ort": N, "onnxfuse": N}) a baseline entry expects on a machine whose
    NCHWc block is `block`: the entry's own counts (recorded at `recorded_block`) where the
    block is the same or the model's counts do not depend on it, the counts recorded for that
    block ("at_block") if any, else None: the machine's kernels can then only be compared with
    onnxruntime alone on it (never more), beside the CPU-independent node count."""
    if block == recorded_block or not dependent:
        return {"ort": entry["ort"], "onnxfuse": entry["onnxfuse"]}
    return entry.get("at_block", {}).get(str(block))
