"""Loading ONNX models: the file, its external data, and the checks that reject graphs no runtime
can run.

Everything that can be wrong with a model file is reported as an InputError whose message is
one line naming the file and the problem; the CLI prints it and exits with status 2.
Preparing a loaded model for the passes is normalize.py; saving one, modelsave.py.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from .environment import ort_max_opset

# Protobuf cannot serialize one message of 2 GiB or more; bigger models keep their large
# tensors in a data file next to the model.
PROTOBUF_LIMIT = 2**31 - 1
DEFAULT_DOMAINS = ("", "ai.onnx")


class InputError(Exception):
    """Bad input (a model file, an option value): the message is one line for the user."""


@dataclass
class LoadedModel:
    """A model read from disk (or the zoo) with what normalizing it did."""

    model: onnx.ModelProto
    label: str  # what messages call it: the path as given, or zoo:NAME
    path: str | None = None
    dims: dict[str, int] = field(default_factory=dict)  # default symbolic dims (zoo models)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- loading


def _external_location(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def external_data_path(base_dir: Path, location: str, label: str, tensor: str) -> Path:
    """The file an external-data location names, or InputError. A location is a relative path
    below the model's directory (as the ONNX format specifies; onnx's own loader refuses others
    too); one that is absolute or climbs out with '..' is refused before anything is looked up,
    so that no message says anything about files elsewhere (a model must not be a way to probe
    the file system). Symbolic links inside the directory are the model owner's choice and are
    followed."""
    candidate = Path(location)
    if candidate.is_absolute() or candidate.drive or ".." in candidate.parts or "\\" in location:
        raise InputError(f"{label}: tensor '{tensor}': external data location '{location}' is outside the"
                         " model's directory")
    data_path = base_dir / candidate
    if not data_path.is_file():
        raise InputError(f"{label}: external data file '{location}' for tensor '{tensor}' not found next to the"
                         " model")
    return data_path


def _load_external_data(model: onnx.ModelProto, label: str, base_dir: Path, on_disk: bool = False) -> None:
    from onnx.external_data_helper import uses_external_data

    from .weights import graph_tensors

    external = [t for t in graph_tensors(model.graph) if uses_external_data(t)]
    if not external:
        return
    for t in external:
        info = _external_location(t)
        location = info.get("location")
        if not location:
            raise InputError(f"{label}: tensor '{t.name}' uses external data but names no file")
        data_path = external_data_path(base_dir, location, label, t.name)
        size = data_path.stat().st_size
        offset = int(info.get("offset", 0) or 0)
        length = int(info["length"]) if info.get("length") else None
        if offset > size or (length is not None and offset + length > size):
            raise InputError(
                f"{label}: external data file '{location}' is shorter ({size} bytes) than tensor '{t.name}' needs"
                " (truncated?)"
            )
    if on_disk:
        _reference_external_data(model, label, base_dir, external)
        return
    from onnx.external_data_helper import load_external_data_for_model

    try:
        load_external_data_for_model(model, str(base_dir))
    except Exception as e:  # onnx raises several types (ValueError, OSError, ...) here
        raise InputError(f"{label}: cannot load external data: {e}") from None


def _reference_external_data(model: onnx.ModelProto, label: str, base_dir: Path, external) -> None:
    """Keep external tensors on disk: each becomes a reference to its file region (see
    weights.py), read only when a pass needs its values. A region must lie inside the model's
    directory and hold exactly the bytes the tensor's type and shape need."""
    from .weights import expected_bytes, make_absolute

    root = os.path.realpath(base_dir)
    for t in external:
        info = _external_location(t)
        location = info["location"]
        resolved = os.path.realpath(os.path.join(root, location))
        if os.path.isabs(location) or os.path.commonpath([root, resolved]) != root:
            raise InputError(f"{label}: external data location '{location}' of tensor '{t.name}' is outside the"
                             " model's directory")
        need = expected_bytes(t)
        length = int(info["length"]) if info.get("length") else None
        if need is not None and length is not None and length != need:
            raise InputError(f"{label}: tensor '{t.name}' has {length} bytes of external data but its shape"
                             f" {list(t.dims)} needs {need}")
        if need is not None and length is None:
            offset = int(info.get("offset", 0) or 0)
            if offset + need > os.path.getsize(resolved):
                raise InputError(f"{label}: external data file '{location}' is shorter than tensor '{t.name}' needs"
                                 " (truncated?)")
        if need is None:  # types without a fixed element size: read into memory, as onnx does
            from onnx.external_data_helper import load_external_data_for_tensor

            try:
                load_external_data_for_tensor(t, str(base_dir))
            except Exception as e:  # onnx raises several types (ValueError, OSError, ...) here
                raise InputError(f"{label}: cannot load external data: {e}") from None
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
            continue
        make_absolute(t, Path(root))


def _looks_like_json(data: bytes) -> bool:
    head = data.lstrip()[:1]
    if head not in (b"{", b"["):
        return False
    try:
        json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def parse_model(data: bytes, label: str) -> onnx.ModelProto:
    """Bytes -> ModelProto, or InputError saying why these bytes are not a model."""
    if not data:
        raise InputError(f"{label}: not an ONNX model (empty file)")
    if _looks_like_json(data):
        raise InputError(f"{label}: not an ONNX model (a JSON file)")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception:  # google.protobuf.message.DecodeError, or RuntimeWarning-based errors
        raise InputError(f"{label}: not an ONNX model (protobuf parse failed)") from None
    # Arbitrary bytes sometimes parse as a message with stray fields: a model has an IR
    # version, an opset and a graph with outputs.
    if model.ir_version <= 0 or not model.opset_import or not model.HasField("graph") or not model.graph.output:
        raise InputError(f"{label}: not an ONNX model (protobuf parsed, but it has no graph, opset or IR version)")
    return model


def load_model(path: str | os.PathLike, label: str | None = None, weights_on_disk: bool = False) -> LoadedModel:
    """Read a model file with its external data; InputError for anything wrong with it.

    weights_on_disk: external tensors are not read but held by reference to their file
    regions (weights.py), for the optimizer, whose memory then does not grow with the model."""
    path = Path(path)
    label = label or str(path)
    if not path.exists():
        raise InputError(f"{label}: no such file")
    if path.is_dir():
        raise InputError(f"{label}: is a directory, not a model file")
    model = _load_split(path, label) if weights_on_disk else None
    if model is None:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise InputError(f"{label}: cannot read: {e.strerror or e}") from None
        model = parse_model(data, label)
        _load_external_data(model, label, path.resolve().parent, weights_on_disk)
    check_model(model, label)
    return LoadedModel(model=model, label=label, path=str(path))


# Files of at least this size have their inline weights held by reference when the weights are
# to stay on disk (smaller ones are read whole: a copy of them costs little).
SPLIT_MIN_FILE_BYTES = 64 << 20


def _load_split(path: Path, label: str) -> onnx.ModelProto | None:
    """A large single-file model read without its large initializers' bytes: each is copied
    (in the kernel) from the file to the scratch file of inline weights and held by reference
    there (weights.py), as external data is. None when the file is small, not a regular file,
    or not a protobuf message this reads (the caller then reads it whole and reports what is
    wrong with it)."""
    import mmap

    from .protowire import WireError, split_weights
    from .weights import SPILL_MIN_BYTES, FileRegion, expected_bytes, keep_inline_weight, set_reference

    try:
        if not path.is_file() or path.stat().st_size < SPLIT_MIN_FILE_BYTES:
            return None
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            light, inline = split_weights(mapped, SPILL_MIN_BYTES)
    except (OSError, ValueError, WireError):
        return None
    if not inline:
        return None
    try:
        model = parse_model(light, label)
    except InputError:
        return None
    tensors = model.graph.initializer
    if any(w.index >= len(tensors) or expected_bytes(tensors[w.index]) != w.length for w in inline):
        return None  # data that does not fit its shape: read whole, and check_model says so
    source = os.path.realpath(path)
    _load_external_data(model, label, path.resolve().parent, True)
    try:
        regions = [keep_inline_weight(FileRegion(source, w.offset, w.length)) for w in inline]
    except OSError:
        return None  # no room for the copy: read whole
    for w, region in zip(inline, regions):
        set_reference(tensors[w.index], region.path, region.offset, region.length)
    return model


# --------------------------------------------------------------------------- structural checks


def _subgraph_outer_refs(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {s.values.name for s in graph.sparse_initializer}
    refs: set[str] = set()
    for node in graph.node:
        for name in _node_reads(node):
            if name not in defined:
                refs.add(name)
        defined.update(o for o in node.output if o)
    refs |= {o.name for o in graph.output if o.name not in defined}
    return refs


def _node_reads(node: onnx.NodeProto) -> list[str]:
    reads = [i for i in node.input if i]
    for attr in node.attribute:
        subgraphs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
        for g in subgraphs:
            reads.extend(sorted(_subgraph_outer_refs(g)))
    return reads


def _node_label(node: onnx.NodeProto, index: int) -> str:
    return f"'{node.name}' ({node.op_type})" if node.name else f"#{index} ({node.op_type})"


# Element types stored in int32_data (onnx.proto), and the bytes of each element type.
_IN_INT32_DATA = {onnx.TensorProto.INT32, onnx.TensorProto.INT16, onnx.TensorProto.INT8, onnx.TensorProto.UINT16,
                  onnx.TensorProto.UINT8, onnx.TensorProto.BOOL, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def _tensor_problem(t: onnx.TensorProto) -> str | None:
    """Why an initializer's data cannot be its shape (negative dims, too few or too many values)."""
    if any(d < 0 for d in t.dims):
        return f"has a negative dimension {list(t.dims)}"
    if t.data_location == onnx.TensorProto.EXTERNAL or t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    count = 1
    for d in t.dims:
        count *= d
    try:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except Exception:  # float8/int4 and other packed types: left to onnxruntime
        return None
    if t.HasField("raw_data"):
        have, need = len(t.raw_data), count * itemsize
        unit = "bytes"
    else:
        typed = {onnx.TensorProto.FLOAT: t.float_data, onnx.TensorProto.DOUBLE: t.double_data,
                 onnx.TensorProto.INT64: t.int64_data, onnx.TensorProto.UINT32: t.uint64_data,
                 onnx.TensorProto.UINT64: t.uint64_data, onnx.TensorProto.COMPLEX64: t.float_data,
                 onnx.TensorProto.COMPLEX128: t.double_data}
        field = typed.get(t.data_type, t.int32_data if t.data_type in _IN_INT32_DATA else None)
        if field is None:
            return None
        per = 2 if t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128) else 1
        have, need, unit = len(field), count * per, "values"
    if have != need:
        return f"holds {have} {unit} of data but its shape {list(t.dims)} needs {need}"
    return None


def _check_definitions_and_data(model: onnx.ModelProto, label: str) -> None:
    """Names defined twice, negative input dims, initializers whose data does not fit their shape:
    onnxruntime (or numpy, while verifying) would fail on them with an unclear message, or run
    the original and the optimized model differently."""
    graph = model.graph
    for v in graph.input:
        if v.type.HasField("tensor_type"):
            dims = [d.dim_value for d in v.type.tensor_type.shape.dim if d.HasField("dim_value")]
            if any(d < 0 for d in dims):
                raise InputError(f"{label}: input '{v.name}' has a negative dimension")
    for t in graph.initializer:
        problem = _tensor_problem(t)
        if problem:
            raise InputError(f"{label}: initializer '{t.name}' {problem}")
    seen: dict[str, str] = {}

    def define(name: str, what: str) -> None:
        if name in seen:
            raise InputError(f"{label}: '{name}' is defined twice ({seen[name]} and {what})")
        seen[name] = what

    initializers = {t.name for t in graph.initializer}
    for t in graph.initializer:
        define(t.name, "an initializer")
    for v in graph.input:
        # Before IR 4 every initializer is also listed as an input; since then an input may
        # share its initializer's name (an overridable default).
        if v.name not in initializers:
            define(v.name, "a graph input")
    for i, node in enumerate(graph.node):
        for o in node.output:
            if o:
                define(o, f"an output of node {_node_label(node, i)}")


def check_model(model: onnx.ModelProto, label: str) -> None:
    """Reject graphs no runtime can run: opsets onnxruntime lacks, reads of values nothing
    produces, cycles, outputs nothing produces."""
    for opset in model.opset_import:
        if opset.domain in DEFAULT_DOMAINS and opset.version > ort_max_opset():
            import onnxruntime as ort

            raise InputError(
                f"{label}: opset {opset.version} is newer than onnxruntime {ort.__version__} supports"
                f" (up to opset {ort_max_opset()})"
            )
    if model.ir_version > onnx.IR_VERSION:
        raise InputError(f"{label}: IR version {model.ir_version} is newer than this onnx ({onnx.IR_VERSION}) knows")
    _check_definitions_and_data(model, label)
    graph = model.graph
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    available |= {s.values.name for s in graph.sparse_initializer}
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for o in node.output:
            if o:
                producer[o] = i
    reads = [_node_reads(n) for n in graph.node]
    for i, node in enumerate(graph.node):
        for name in reads[i]:
            if name not in available and name not in producer:
                raise InputError(f"{label}: node {_node_label(node, i)} reads '{name}', which nothing produces")
    for out in graph.output:
        if out.name not in available and out.name not in producer:
            raise InputError(f"{label}: graph output '{out.name}' is produced by no node")
    # Kahn's algorithm: whatever cannot be ordered lies on (or behind) a cycle.
    waiting = [sum(1 for name in set(reads[i]) if name in producer) for i in range(len(graph.node))]
    consumers: dict[int, list[int]] = {}
    for i in range(len(graph.node)):
        for name in set(reads[i]):
            if name in producer:
                consumers.setdefault(producer[name], []).append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        for j in consumers.get(i, []):
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    if done < len(graph.node):
        stuck = [_node_label(graph.node[i], i) for i, w in enumerate(waiting) if w > 0]
        more = f" and {len(stuck) - 3} more" if len(stuck) > 3 else ""
        raise InputError(f"{label}: graph has a cycle through nodes {', '.join(stuck[:3])}{more}")
