"""Loading ONNX models: the file, its external data, and the checks that reject graphs no runtime
can run.

Everything that can be wrong with a model file is reported as an InputError whose message is
one line naming the file and the problem; the CLI prints it and exits with status 2.
Preparing a loaded model for the passes is normalize.py; saving one, modelsave.py.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from .environment import ort_max_opset
from .errors import InputError

# Protobuf cannot serialize one message of 2 GiB or more; bigger models keep their large
# tensors in a data file next to the model.
PROTOBUF_LIMIT = 2**31 - 1
DEFAULT_DOMAINS = ("", "ai.onnx")


# InputError lives in errors.py (imported by the command line before anything heavy) and is
# re-exported here, where the rest of the package takes it from.


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
    the file system). A symbolic link is judged by where it leads, before the file is looked
    at: one that leads out of the directory is refused with the same words, so that neither
    the existence nor the size of its target is revealed."""
    candidate = Path(location)
    outside = InputError(f"{label}: tensor '{tensor}': external data location '{location}' is outside the"
                         " model's directory")
    if candidate.is_absolute() or candidate.drive or ".." in candidate.parts or "\\" in location:
        raise outside
    data_path = base_dir / candidate
    root = os.path.realpath(base_dir)
    if os.path.commonpath([root, os.path.realpath(data_path)]) != root:
        raise outside
    if not data_path.is_file():
        raise InputError(f"{label}: external data file '{location}' for tensor '{tensor}' not found next to the"
                         " model")
    return data_path


def external_number(info: dict[str, str], key: str, label: str, tensor: str) -> int | None:
    """An external-data offset or length: a whole number of bytes (None when absent), else
    InputError."""
    value = info.get(key)
    if value is None or value == "":
        return None
    if not re.fullmatch(r"-?[0-9]+", value):
        raise InputError(f"{label}: tensor '{tensor}': external data {key} '{value}' is not a number of bytes")
    number = int(value)
    if number < 0:
        raise InputError(f"{label}: tensor '{tensor}': external data {key} {number} is negative")
    return number


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
        offset = external_number(info, "offset", label, t.name) or 0
        length = external_number(info, "length", label, t.name)
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
        length = external_number(info, "length", label, t.name)
        if need is not None and length is not None and length != need:
            raise InputError(f"{label}: tensor '{t.name}' has {length} bytes of external data but its shape"
                             f" {list(t.dims)} needs {need}")
        if need is not None and length is None:
            offset = external_number(info, "offset", label, t.name) or 0
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
    where = None if _all_text(model) else _undecodable_text(model)
    if where:
        raise InputError(f"{label}: {where} is not UTF-8 text (ONNX strings are UTF-8)")
    return model


def _joined(*groups) -> bool:
    """Whether every item of the groups of strings is text: protobuf hands a string field that
    is not valid UTF-8 over as bytes, which str.join refuses (at C speed)."""
    try:
        for group in groups:
            "".join(group)
    except TypeError:
        return False
    return True


def _values_text(values) -> bool:
    tensors = [v.type.tensor_type for v in values if v.type.HasField("tensor_type")]
    if len(tensors) < len(values) and any(_undecodable_text(v.type) is not None for v in values
                                          if not v.type.HasField("tensor_type")):
        return False
    dims = [d for t in tensors for d in t.shape.dim]
    return _joined([x for v in values for x in (v.name, v.doc_string, v.type.denotation)],
                   [d.dim_param for d in dims], [d.denotation for d in dims])


def _nodes_text(nodes) -> bool:
    if not _joined([x for n in nodes for x in (n.name, n.op_type, n.domain, n.doc_string, n.overload)],
                   [x for n in nodes for x in n.input], [x for n in nodes for x in n.output]):
        return False
    return not any(_undecodable_text(a) is not None for n in nodes if n.attribute for a in n.attribute)


def _all_text(model: onnx.ModelProto) -> bool:
    """Whether every string field of the model is valid UTF-8: a fast pass over the parts that
    grow with the model (nodes, value infos, function bodies), the generic walk for the rest;
    _undecodable_text then says where the first bad one is."""
    g = model.graph
    if not (_nodes_text(g.node) and _values_text(g.input) and _values_text(g.output) and _values_text(g.value_info)):
        return False
    for f in model.functions:
        if not (_nodes_text(f.node) and _values_text(f.value_info)
                and _joined((f.name, f.domain, f.doc_string, f.overload), f.input, f.output, f.attribute)):
            return False
        if any(_undecodable_text(m) is not None for m in (*f.attribute_proto, *f.opset_import, *f.metadata_props)):
            return False
    if _undecodable_text(model, skip=("graph", "functions")) is not None:
        return False
    if _undecodable_text(g, skip=("node", "input", "output", "value_info")) is not None:
        return False
    return True


def _undecodable_text(message, path: str = "model", skip=()) -> str | None:
    """Where the first string field of `message` (or of a message in it) that is not valid
    UTF-8 is, as a field path; None when every one is. protobuf hands such a field over as
    bytes, which names, shapes and messages downstream are not made for."""
    from google.protobuf.descriptor import FieldDescriptor

    for field, value in message.ListFields():
        if field.name in skip:
            continue
        if field.type == FieldDescriptor.TYPE_STRING:
            values = value if field.is_repeated else [value]
            for i, v in enumerate(values):
                if isinstance(v, bytes):
                    suffix = f"[{i}]" if field.is_repeated else ""
                    return f"{path}.{field.name}{suffix}"
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                for i, item in enumerate(value):
                    found = _undecodable_text(item, f"{path}.{field.name}[{i}]")
                    if found:
                        return found
            else:
                found = _undecodable_text(value, f"{path}.{field.name}")
                if found:
                    return found
    return None


def read_model_file(path: Path, label: str) -> bytes:
    """The bytes of a model file, or InputError. Only a regular file is read: a device such as
    /dev/zero never ends and a FIFO blocks until someone writes to it, so both are refused before
    they are opened (and the file opened is checked again, in case it was swapped meanwhile)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"{label}: no such file") from None
    except OSError as e:
        raise InputError(f"{label}: cannot read: {e.strerror or e}") from None
    if stat.S_ISDIR(info.st_mode):
        raise InputError(f"{label}: is a directory, not a model file")
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{label}: not a regular file ({_file_kind(info.st_mode)}), not a model file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise InputError(f"{label}: cannot read: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{label}: not a regular file ({_file_kind(info.st_mode)}), not a model file")
        if info.st_size > PROTOBUF_LIMIT:
            raise InputError(f"{label}: not an ONNX model ({info.st_size} bytes; a model file holds at most 2 GiB,"
                             " larger weights go in external data)")
        try:
            return f.read()
        except OSError as e:
            raise InputError(f"{label}: cannot read: {e.strerror or e}") from None


def _file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"


def load_model(path: str | os.PathLike, label: str | None = None, weights_on_disk: bool = False) -> LoadedModel:
    """Read a model file with its external data; InputError for anything wrong with it.

    weights_on_disk: external tensors are not read but held by reference to their file
    regions (weights.py), for the optimizer, whose memory then does not grow with the model."""
    path = Path(path)
    label = label or str(path)
    model = _load_split(path, label) if weights_on_disk else None
    if model is None:
        model = parse_model(read_model_file(path, label), label)
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


def _all_node_lists(model: onnx.ModelProto):
    """(where, nodes) for the main graph, every subgraph (If/Loop/Scan bodies) and every
    function body; `where` is "" for the main graph, else " in ..." for messages."""
    pending = [("", model.graph.node)] + [(f" in function '{f.name}'", f.node) for f in model.functions]
    while pending:
        where, nodes = pending.pop(0)
        yield where, nodes
        for node in nodes:
            for attr in node.attribute:
                for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    pending.append((f" in a subgraph of '{node.name or node.op_type}'", g.node))


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
    for where, nodes in _all_node_lists(model):
        for i, node in enumerate(nodes):
            if node.op_type != "Constant" or node.domain not in DEFAULT_DOMAINS:
                continue
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    problem = _tensor_problem(attr.t)
                    if problem:
                        raise InputError(f"{label}: Constant node {_node_label(node, i)}{where}: its value {problem}")
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


def _check_own_domain_functions(model: onnx.ModelProto, label: str) -> None:
    """A model's own function in the domain of onnxfuse's fused ops is refused: with the
    onnxfuse library registered, onnxruntime would run the library's op of that name instead of
    the model's function (or fail on the node), so the model would not mean what it says. A
    fallback function onnxfuse wrote (an overload, called by nodes that carry the op set
    attribute) is onnxfuse's own and is kept."""
    if not model.functions:
        return
    from .fused import DOMAIN, OPSET_ATTRIBUTE

    callers: dict[tuple[str, str], list[onnx.NodeProto]] = {}
    for _, nodes in _all_node_lists(model):
        for node in nodes:
            if node.domain == DOMAIN:
                callers.setdefault((node.op_type, node.overload), []).append(node)
    for fn in model.functions:
        if fn.domain != DOMAIN:
            continue
        ours = bool(fn.overload) and all(any(a.name == OPSET_ATTRIBUTE for a in node.attribute)
                                         for node in callers.get((fn.name, fn.overload), []))
        if not ours:
            raise InputError(f"{label}: the model's function '{fn.name}' is in the domain '{DOMAIN}', which is reserved"
                             " for onnxfuse's fused ops (onnxruntime would run onnxfuse's op instead of the function);"
                             " give the function another domain")


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
    _check_own_domain_functions(model, label)
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
