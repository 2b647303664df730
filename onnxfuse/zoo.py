"""The model zoo: named models to optimize, profile and regression-test (`zoo:NAME`).

Two kinds of members, listed in models/manifest.json:
- "onnx-wheel": the nine light ONNX Model Zoo networks shipped in the onnx wheel
  (onnx/backend/test/data/light/), each with the reference output onnx's backend test checks;
  found at run time next to the installed onnx, never copied.
- "generated": small launch-bound models committed in models/ with the script that writes
  them (python models/NAME.py regenerates NAME.onnx byte for byte).

models/ is found in a source checkout or editable install (next to the onnxfuse package),
installed as package data (onnxfuse/models/), or where ONNXFUSE_ZOO_DIR points.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .modelio import InputError, LoadedModel, load_model

ZOO_PREFIX = "zoo:"
SOURCES = ("onnx-wheel", "generated")
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
    path: Path
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

    @property
    def uri(self) -> str:
        return ZOO_PREFIX + self.name

    def load(self) -> onnx.ModelProto:
        if not self.path.is_file():
            raise ZooError(f"{self.uri}: model file {self.path} is missing")
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
        path=base / raw["file"],
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
    if not model.path.is_file():
        hint = " (the installed onnx does not ship it)" if model.source == "onnx-wheel" else ""
        raise ZooError(f"{model.uri}: model file {model.path} is missing{hint}")
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


# --------------------------------------------------------------------------- regression baseline


def baseline_path() -> Path:
    return models_dir() / BASELINE


def load_baseline() -> dict:
    path = baseline_path()
    if not path.is_file():
        return {"models": {}}
    return json.loads(path.read_text())
