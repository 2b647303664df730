"""Weights that stay on disk: external tensors held by reference, mapped only when read.

A model loaded with external data keeps each such tensor as a reference (an EXTERNAL
TensorProto whose location is the data file's absolute path, with offset and length) instead
of reading the bytes into memory. Absolute locations exist only inside this process: every
writer (modelsave.save_model, the files ortfiles.py makes for onnxruntime) turns them back into relative ones.

- A pass that reads a weight's values gets a read-only numpy memmap of its file region
  (`ExternalValues`, graphsurgeon's lazy values for such tensors); `release_graph` drops the
  mapping again after each pass, so pages read once do not stay resident.
- New large weights a pass makes (concatenated GEMM weights, packed panels) are written to a
  scratch file (`spill`) and held by reference from then on.
- `tensor_source` tells an exporter where a constant's bytes already are, so exporting copies
  no weight.
"""
from __future__ import annotations

import atexit
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from . import outfiles

# Data file regions start at multiples of this, so that each tensor can be mapped on its own.
ALIGN = 4096
# New weights of at least this many bytes go to the scratch file when the model keeps its
# weights on disk (smaller ones stay in memory, as onnx keeps small tensors inline).
SPILL_MIN_BYTES = 1 << 16
# Bytes copied per read/write when weights are streamed from one file to another.
COPY_CHUNK = 64 << 20


@dataclass(frozen=True)
class FileRegion:
    """Where an external tensor's bytes are: an absolute path, an offset and a length."""

    path: str
    offset: int
    length: int


# --------------------------------------------------------------------------- references


def external_entries(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def element_size(data_type: int) -> int | None:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(data_type)).itemsize
    except Exception:  # packed (int4, float4) and exotic types
        return None


def element_count(dims) -> int:
    count = 1
    for d in dims:
        count *= int(d)
    return count


def expected_bytes(t: onnx.TensorProto) -> int | None:
    """The bytes of `t`'s data by its type and dims (None for types without a fixed size)."""
    size = element_size(t.data_type)
    if size is None or t.data_type == onnx.TensorProto.STRING:
        return None
    return element_count(t.dims) * size


def region_of(t: onnx.TensorProto) -> FileRegion | None:
    """The file region of a tensor held by reference (absolute location), else None."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = external_entries(t)
    location = info.get("location", "")
    if not os.path.isabs(location):
        return None
    length = int(info["length"]) if info.get("length") else expected_bytes(t)
    return FileRegion(location, int(info.get("offset", 0) or 0), int(length or 0))


def set_reference(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make `t` an external tensor at (location, offset, length), dropping inline data."""
    for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        t.ClearField(name)
    del t.external_data[:]
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value


def make_absolute(t: onnx.TensorProto, base_dir: Path) -> None:
    """Point an external tensor's location at its file's absolute path (a reference)."""
    info = external_entries(t)
    path = os.path.abspath(os.path.join(base_dir, info["location"]))
    length = int(info["length"]) if info.get("length") else expected_bytes(t)
    set_reference(t, path, int(info.get("offset", 0) or 0), int(length or 0))


def reference_tensor(name: str, data_type: int, dims, region: FileRegion) -> onnx.TensorProto:
    t = onnx.TensorProto()
    t.name = name
    t.data_type = data_type
    t.dims.extend(int(d) for d in dims)
    set_reference(t, region.path, region.offset, region.length)
    return t


def _node_tensors(nodes) -> Iterator[onnx.TensorProto]:
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from graph_tensors(attr.g)
            for g in attr.graphs:
                yield from graph_tensors(g)


def graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of a graph: initializers, Constant values and attribute tensors, in
    subgraphs too."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    yield from _node_tensors(graph.node)


def all_tensors(model: onnx.ModelProto, functions: bool = True) -> Iterator[onnx.TensorProto]:
    """graph_tensors of the model's graph, and of its function bodies when `functions`."""
    yield from graph_tensors(model.graph)
    if functions:
        for f in model.functions:
            yield from _node_tensors(f.node)


def inline_function_tensors(model: onnx.ModelProto) -> None:
    """Read the tensors of function bodies (fallback bodies' Constant nodes) back inline: a
    model file keeps those in the body, as onnx writes them."""
    for f in model.functions:
        for t in _node_tensors(f.node):
            inline_tensor(t)


def referenced_bytes(model: onnx.ModelProto, inline_origin: bool = True) -> int:
    """Bytes of the tensors `model` holds by reference (without those that were inline in
    their model file unless `inline_origin`)."""
    return sum(r.length for r in (region_of(t) for t in all_tensors(model))
               if r is not None and (inline_origin or not is_inline_origin(r)))


def _varint_size(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def inline_size(model: onnx.ModelProto) -> int:
    """Bytes of `model` serialized with every tensor it holds by reference inline (raw_data):
    its size as files, weights included (ByteSize() alone counts a reference as its location,
    offset and length entries)."""
    total = model.ByteSize()
    for t in all_tensors(model):
        region = region_of(t)
        if region is None:
            continue
        bare = onnx.TensorProto()
        bare.CopyFrom(t)
        del bare.external_data[:]
        bare.ClearField("data_location")
        inline = bare.ByteSize() + 1 + _varint_size(region.length) + region.length
        held = t.ByteSize()
        total += (inline + _varint_size(inline)) - (held + _varint_size(held))
    return total


def has_references(model: onnx.ModelProto) -> bool:
    return any(region_of(t) is not None for t in all_tensors(model))


# --------------------------------------------------------------------------- reading


# Memmaps handed out for references, by id: (weak reference, region, ONNX type, dims), so that
# an exporter can tell an unchanged weight from a computed one without comparing bytes.
_mapped: dict[int, tuple[weakref.ref, FileRegion, int, tuple[int, ...]]] = {}


def _forget(key: int) -> None:
    _mapped.pop(key, None)


def map_region(region: FileRegion, data_type: int, dims) -> np.ndarray:
    """A read-only memmap of `region` as a tensor of `data_type` and `dims`."""
    shape = tuple(int(d) for d in dims)
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(data_type))
    if element_count(shape) == 0:
        return np.zeros(shape, dtype)
    array = np.memmap(region.path, dtype=dtype, mode="r", offset=region.offset, shape=shape)
    key = id(array)
    _mapped[key] = (weakref.ref(array, lambda _, key=key: _forget(key)), region, data_type, shape)
    return array


def mapped_source(array) -> tuple[FileRegion, int, tuple[int, ...]] | None:
    """(region, ONNX type, dims) when `array` is a memmap map_region made (not a view of one)."""
    entry = _mapped.get(id(array))
    if entry is None or entry[0]() is not array:
        return None
    return entry[1], entry[2], entry[3]


def read_tensor(t: onnx.TensorProto) -> np.ndarray:
    """A tensor's values: mapped from its file when held by reference, else as onnx reads them."""
    region = region_of(t)
    if region is not None:
        return map_region(region, t.data_type, t.dims)
    return onnx.numpy_helper.to_array(t)


def read_region(region: FileRegion) -> bytes:
    with open(region.path, "rb") as f:
        f.seek(region.offset)
        data = f.read(region.length)
    if len(data) != region.length:
        raise OSError(f"{region.path}: {region.length} bytes expected at offset {region.offset}, {len(data)} read")
    return data


def copy_region(region: FileRegion, out) -> None:
    """Stream a region's bytes into the open binary file `out` (at its position), in the
    kernel where it can (copy_file_range), else COPY_CHUNK at a time through memory."""
    with open(region.path, "rb") as f:
        left = region.length
        if hasattr(os, "copy_file_range"):
            out.flush()
            src, dst = f.fileno(), out.fileno()
            offset, dst_offset = region.offset, out.tell()
            try:
                while left:
                    n = os.copy_file_range(src, dst, min(left, 1 << 30), offset, dst_offset)
                    if n == 0:
                        raise OSError(f"{region.path}: ends {left} bytes short of the tensor at offset {region.offset}")
                    offset, dst_offset, left = offset + n, dst_offset + n, left - n
                out.seek(dst_offset)
                return
            except OSError as e:
                if left != region.length or getattr(e, "errno", None) is None:
                    raise
                # copy_file_range unsupported between these files: copy through memory
        for chunk in region_chunks(region, COPY_CHUNK, f):
            out.write(chunk)


def region_chunks(region: FileRegion, size: int = COPY_CHUNK, f=None):
    """A region's bytes, `size` at a time, read from `f` (its file, open) or from a file opened
    here; a file that ends before the region does is an OSError."""
    if f is None:
        with open(region.path, "rb") as opened:
            yield from region_chunks(region, size, opened)
        return
    f.seek(region.offset)
    left = region.length
    while left:
        chunk = f.read(min(left, size))
        if not chunk:
            raise OSError(f"{region.path}: ends {left} bytes short of the tensor at offset {region.offset}")
        yield chunk
        left -= len(chunk)


def inline_tensor(t: onnx.TensorProto) -> None:
    """Replace a reference by the bytes it points at (raw_data)."""
    region = region_of(t)
    if region is None:
        return
    data = read_region(region)
    del t.external_data[:]
    t.ClearField("data_location")  # unset, as a tensor that was inline all along (same bytes)
    t.raw_data = data


# --------------------------------------------------------------------------- scratch file


class _Scratch:
    """One file per process for new weights; removed at exit."""

    def __init__(self) -> None:
        self.directory: str | None = None
        self.file = None
        self.path = ""
        self.offset = 0

    def open(self) -> None:
        if self.file is not None:
            if os.path.isdir(self.directory):
                return
            # removed under us by the signal cleanup (outfiles): a later run in this process
            # starts a new file rather than write to the unlinked one
            self.file.close()
            self.file, self.offset = None, 0
        self.directory = outfiles.temporary_directory("onnxfuse-weights-")
        self.path = os.path.join(self.directory, "weights.bin")
        self.file = open(self.path, "wb")
        atexit.register(self.remove)

    def write(self, data) -> FileRegion:
        self.open()
        pad = (-self.offset) % ALIGN
        if pad:
            self.file.write(b"\0" * pad)
        offset = self.offset + pad
        view = memoryview(data).cast("B")
        self.file.write(view)
        self.file.flush()
        self.offset = offset + view.nbytes
        return FileRegion(self.path, offset, view.nbytes)

    def copy(self, region: FileRegion) -> FileRegion:
        """Copy a region of another file here (in the kernel where it can): where it now is."""
        self.open()
        pad = (-self.offset) % ALIGN
        if pad:
            self.file.write(b"\0" * pad)
        self.file.flush()
        offset = self.offset + pad
        self.file.seek(offset)
        copy_region(region, self.file)
        self.file.flush()
        self.offset = offset + region.length
        return FileRegion(self.path, offset, region.length)

    def remove(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.directory:
            outfiles.remove_directory(self.directory)
        self.file, self.directory = None, None


_scratch = _Scratch()
# The weights of single-file models, copied out of the model file at load (modelio): held by
# reference like external data, but the model is still written as one file (modelsave).
_inline_scratch = _Scratch()


def keep_inline_weight(region: FileRegion) -> FileRegion:
    """Copy an inline weight's bytes (a region of a single-file model) to the scratch file of
    inline weights, aligned so that onnxruntime maps it: where it now is."""
    return _inline_scratch.copy(region)


def is_inline_origin(region: FileRegion) -> bool:
    """Whether a reference is to a weight that was inline in its model file."""
    return _inline_scratch.path != "" and region.path == _inline_scratch.path


def hold_inline_weights_by_reference(model: onnx.ModelProto, min_total: int) -> int:
    """Move the large inline initializers (raw data of SPILL_MIN_BYTES or more) of an in-memory
    model to the scratch file of inline weights and hold them by reference, as a large
    single-file model's are at load (modelio): the optimizer's copies of the model (the
    onnxscript stage copies it once per group it tries) then copy no weight. Nothing moves when
    they total less than `min_total` bytes. How many moved."""
    large = [t for t in model.graph.initializer
             if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) >= SPILL_MIN_BYTES]
    if sum(len(t.raw_data) for t in large) < min_total:
        return 0
    for t in large:
        region = _inline_scratch.write(t.raw_data)
        set_reference(t, region.path, region.offset, region.length)
    return len(large)


def inline_scratch_references(model: onnx.ModelProto) -> None:
    """Give every tensor held by reference to a scratch file (an inline weight moved there, a
    weight a pass made) its bytes back: a model that owns its weights, for a caller that gave
    one."""
    for t in all_tensors(model):
        region = region_of(t)
        if region is not None and region.path in (_inline_scratch.path, _scratch.path) and region.path:
            inline_tensor(t)


def spill(array: np.ndarray) -> FileRegion:
    """Write a new weight's bytes to the scratch file (in the temporary directory, TMPDIR):
    where they now are."""
    return _scratch.write(np.ascontiguousarray(array))


def scratch_directory() -> str | None:
    """The directory of the scratch file, once a weight was spilled there (else None)."""
    return _scratch.directory


# --------------------------------------------------------------------------- graphsurgeon


class ExternalValues(LazyValues):
    """graphsurgeon lazy values of a tensor held by reference: loading maps the file region
    (graphsurgeon's own LazyValues would read the bytes through onnx, which refuses absolute
    locations). graphsurgeon exports lazy values as their TensorProto: the reference."""

    def load(self):
        return map_region(region_of(self.tensor), self.tensor.data_type, self.tensor.dims)


def _constants(graph: gs.Graph, attributes: bool = True) -> Iterator[gs.Constant]:
    """The graph's constants (of subgraphs too); with `attributes`, also Constant nodes' values."""
    seen: set[int] = set()
    stack = [graph]
    while stack:
        g = stack.pop()
        for t in list(g.inputs) + [x for n in g.nodes for x in list(n.inputs) + list(n.outputs)]:
            if isinstance(t, gs.Constant) and id(t) not in seen:
                seen.add(id(t))
                yield t
        for n in g.nodes:
            for v in n.attrs.values():
                if isinstance(v, gs.Graph):
                    stack.append(v)
                elif isinstance(v, (list, tuple)):
                    stack.extend(x for x in v if isinstance(x, gs.Graph))
                elif attributes and isinstance(v, gs.Constant) and id(v) not in seen:
                    seen.add(id(v))
                    yield v


# Set on a graphsurgeon graph whose weights stay on disk: new constants are spilled.
_ON_DISK = "_onnxfuse_weights_on_disk"


def attach_graph(graph: gs.Graph) -> int:
    """Give the constants graphsurgeon imported from references ExternalValues; returns how
    many there are. A graph with any keeps its new large constants on disk too (new_constant)."""
    count = 0
    for t in _constants(graph):
        values = t._values
        if type(values) is LazyValues and region_of(values.tensor) is not None:
            t._values = ExternalValues(values.tensor)
            count += 1
    if count:
        graph.__dict__[_ON_DISK] = True
    return count


def keeps_weights_on_disk(graph: gs.Graph) -> bool:
    return bool(graph.__dict__.get(_ON_DISK))


def new_constant(graph: gs.Graph, name: str, value: np.ndarray) -> gs.Constant:
    """A constant for a value a pass computed: in a graph whose weights stay on disk, a large
    one is written to the scratch file at once and held by reference, and the pages of the
    weights read to compute it are given back (a pass making one weight at a time then holds
    about one weight in memory, not all it has made)."""
    from onnx_graphsurgeon.exporters.onnx_exporter import dtype_to_onnx

    value = np.asarray(value)
    if not keeps_weights_on_disk(graph) or value.nbytes < SPILL_MIN_BYTES or value.dtype.kind not in "biuf":
        # A copy the pass cannot change afterwards; np.array, not np.ascontiguousarray: that
        # one turns a 0-d value into shape (1,).
        return gs.Constant(name, np.array(value, order="C"))
    data_type = dtype_to_onnx(value.dtype)
    region = spill(value)
    drop_resident_pages()
    return gs.Constant(name, ExternalValues(reference_tensor(name, data_type, value.shape, region)))


def drop_resident_pages() -> None:
    """Let the kernel take back the pages of every mapped weight (they are read again from
    the file system's cache when touched): keeps pages a pass read from counting as this
    process's memory."""
    import mmap

    for ref, _, _, _ in list(_mapped.values()):
        array = ref()
        handle = getattr(array, "_mmap", None) if array is not None else None
        if handle is not None:
            try:
                handle.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError, AttributeError):  # closed, or madvise unsupported here
                pass


def release_graph(graph: gs.Graph, spill_min_bytes: int = SPILL_MIN_BYTES) -> None:
    """After a pass: constants whose values are an unchanged mapping go back to lazy references
    (the mapping is dropped), and new arrays of spill_min_bytes or more go to the scratch file
    (Constant nodes' values excepted: they stay in the node, as onnx writes them)."""
    from onnx_graphsurgeon.exporters.onnx_exporter import dtype_to_onnx

    as_inputs = {id(t) for t in _constants(graph, attributes=False)}
    for t in _constants(graph):
        values = t._values
        if isinstance(values, LazyValues):
            continue
        source = mapped_source(values)
        if source is not None:
            region, data_type, dims = source
            t._values = ExternalValues(reference_tensor(t.name, data_type, dims, region))
            continue
        if (id(t) not in as_inputs or not isinstance(values, np.ndarray) or values.nbytes < spill_min_bytes
                or values.dtype.kind not in "biuf"):
            continue
        data_type = dtype_to_onnx(t.export_dtype)
        if element_size(data_type) != values.dtype.itemsize:
            continue  # an export_dtype that converts on export: left to graphsurgeon
        region = spill(values)
        t._values = ExternalValues(reference_tensor(t.name, data_type, values.shape, region))
    # Mappings still referenced (from the pass's leftovers, until collected) keep no pages.
    drop_resident_pages()


def export_reference(t: gs.Constant) -> onnx.TensorProto | None:
    """The TensorProto that exports constant `t` without copying its bytes, when they are on
    disk (a reference or an unchanged mapping of one); None otherwise."""
    values = t._values
    if isinstance(values, ExternalValues):
        values.tensor.name = t.name
        return values.tensor
    source = mapped_source(values)
    if source is not None:
        region, data_type, dims = source
        return reference_tensor(t.name, data_type, dims, region)
    return None
