"""Model files onnxruntime loads instead of in-memory models.

onnxruntime takes a model as bytes or as a file path. Bytes hold every weight (serialized again
for each session), and cannot hold weights by reference at all (weights.py); from a file,
onnxruntime maps the weights of an aligned external data file instead. So:

- `RuntimeFiles` writes models holding weights by reference beside hard links to their data
  files;
- `SharedWeights` writes in-memory models with large weights around one shared data file (the
  weights two models have in common stored once);
- `runtime_sources` picks between them and the models themselves, for a set of models that
  run together (an original and its optimized model).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator, Sequence

import onnx

from . import outfiles
from .modelfields import copy_fields
from .modelsave import EXTERNAL_TENSOR_MIN_BYTES
from .weights import (ALIGN, FileRegion, all_tensors, copy_region, expected_bytes, has_references,
                      inline_function_tensors, region_of, scratch_directory, set_reference)


class RuntimeFiles:
    """Model files onnxruntime can load for models holding weights by reference.

    onnxruntime accepts external data only at relative locations inside the model file's
    directory (no absolute paths, no symbolic links leading out of it), and from a file path
    it maps the data instead of copying it. So each data file a model references gets a hard
    link in `directory` (a copy of the regions used where linking is impossible, e.g. across
    file systems), and the model is written there with relative locations. Data files are
    shared by all models written to the same directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.linked: dict[str, str] = {}  # source path -> file name in directory
        self.copied: dict[FileRegion, tuple[str, int]] = {}
        self.copy_file = None

    def _name_for(self, region: FileRegion) -> tuple[str, int]:
        """(file name in directory, offset there) of a region's bytes."""
        name = self.linked.get(region.path)
        if name is None and region.path not in self.linked:
            candidate = f"data{len(self.linked)}.bin"
            try:
                os.link(region.path, os.path.join(self.directory, candidate))
                name = candidate
            except OSError:
                name = None
            self.linked[region.path] = name
        if name is not None:
            return name, region.offset
        if region not in self.copied:
            if self.copy_file is None:
                self.copy_file = open(os.path.join(self.directory, "copied.bin"), "wb")
            pad = (-self.copy_file.tell()) % ALIGN
            self.copy_file.write(b"\0" * pad)
            offset = self.copy_file.tell()
            copy_region(region, self.copy_file)
            self.copy_file.flush()
            self.copied[region] = ("copied.bin", offset)
        return self.copied[region]

    def write(self, model: onnx.ModelProto, name: str) -> str:
        """Write `model` as `name` in the directory; returns its path."""
        out = onnx.ModelProto()
        out.CopyFrom(model)
        inline_function_tensors(out)
        for t in all_tensors(out, functions=False):
            region = region_of(t)
            if region is not None:
                location, offset = self._name_for(region)
                set_reference(t, location, offset, region.length)
        path = os.path.join(self.directory, name)
        with open(path, "wb") as f:
            f.write(out.SerializeToString())
        return path

    def close(self) -> None:
        if self.copy_file is not None:
            self.copy_file.close()
            self.copy_file = None


def runtime_directory() -> str:
    """A new temporary directory for RuntimeFiles, on the scratch file's file system when
    there is one (so that its new weights can be linked, not copied)."""
    scratch = scratch_directory()
    base = os.path.dirname(scratch) if scratch else None
    return outfiles.temporary_directory("onnxfuse-ort-", base)


def remove_runtime_directory(directory: str) -> None:
    """Remove a directory of runtime_directory with its files."""
    outfiles.remove_directory(directory)


# In-memory models with at least this many bytes of initializer data reach onnxruntime as
# model files with their weights in one external data file (written once for all models: the
# weights the optimized model did not change are stored once). Handing onnxruntime a
# ModelProto serializes it (weights included) for every session, which for GPT-2 small's
# 500 MB was most of the verification time; from a file, onnxruntime maps the aligned
# weights in.
EXTERNAL_DATA_MIN_BYTES = 64 << 20
_DATA_FILE = "weights.bin"


def _inline_bytes(t: onnx.TensorProto) -> int:
    """The bytes of an initializer's inline raw data by its type and dims, without reading it
    (0 for typed fields and for types without a fixed element size: those stay inline)."""
    return (expected_bytes(t) or 0) if t.HasField("raw_data") else 0


def inline_weight_bytes(model: onnx.ModelProto) -> int:
    return sum(_inline_bytes(t) for t in model.graph.initializer)


def memory_directory(size: int) -> str | None:
    """Where model files for onnxruntime go: a memory file system (/dev/shm) when it has room
    for twice `size` bytes, else None (the temporary directory). Writing to disk cost 2.8 s for
    GPT-2 small's weights here, to /dev/shm 0.45 s."""
    shm = "/dev/shm"
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    if not os.access(shm, os.W_OK | os.X_OK) or st.f_bavail * st.f_frsize < 2 * size:
        return None
    return shm


class SharedWeights:
    """One external data file for several in-memory models: identical initializers are stored
    once."""

    def __init__(self, directory: str) -> None:
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
        pad = (-self.offset) % ALIGN
        self.file.write(b"\0" * pad)
        offset = self.offset + pad
        self.file.write(data)
        self.offset = offset + len(data)
        self.stored.setdefault(key, []).append((data, offset))
        return offset, len(data)

    def write(self, model: onnx.ModelProto, name: str) -> str:
        """Save `model` under `name` with its large initializers in the shared data file."""
        light = onnx.ModelProto()
        copy_fields(model, light, skip=("graph",))
        copy_fields(model.graph, light.graph, skip=("initializer",))
        for t in model.graph.initializer:
            if _inline_bytes(t) < EXTERNAL_TENSOR_MIN_BYTES:
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
            set_reference(moved, _DATA_FILE, offset, size)
        path = os.path.join(self.directory, name)
        with open(path, "wb") as f:
            f.write(light.SerializeToString())
        return path

    def close(self) -> None:
        self.file.close()
        self.stored.clear()


# --------------------------------------------------------------------------- choosing


@contextlib.contextmanager
def runtime_sources(models: Sequence[onnx.ModelProto], share_weights: bool = True) -> Iterator[list]:
    """What onnxruntime is to load for each of `models` (run together): model files beside
    links to their data files when any holds weights by reference; with `share_weights`, files
    around one shared data file when any has EXTERNAL_DATA_MIN_BYTES of inline weights; else
    the ModelProtos themselves. The files are removed when the context ends."""
    if any(has_references(m) for m in models):
        directory = runtime_directory()
        files = RuntimeFiles(directory)
        try:
            paths = [files.write(m, f"model{i}.onnx") for i, m in enumerate(models)]
            files.close()
            yield paths
        finally:
            files.close()
            remove_runtime_directory(directory)
        return
    sizes = [inline_weight_bytes(m) for m in models]
    if not share_weights or max(sizes, default=0) < EXTERNAL_DATA_MIN_BYTES:
        yield list(models)
        return
    with tempfile.TemporaryDirectory(prefix="onnxfuse-ort-", dir=memory_directory(sum(sizes))) as tmp:
        shared = SharedWeights(tmp)
        try:
            paths = [shared.write(m, f"model{i}.onnx") for i, m in enumerate(models)]
        finally:
            shared.close()
        yield paths
