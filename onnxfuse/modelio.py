"""Loading, checking, normalizing and atomically saving ONNX models.

Everything that can be wrong with a model file is reported as an InputError whose message is
one line naming the file and the problem; the CLI prints it and exits with status 2.
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import onnx
from onnx import helper

from . import outfiles
from .fused import DOMAIN

# Protobuf cannot serialize one message of 2 GiB or more; bigger models keep their large
# tensors in a data file next to the model.
PROTOBUF_LIMIT = 2**31 - 1
# Tensors at least this big go to the data file when a model has to use one (small ones
# stay inline, as onnx itself does).
EXTERNAL_TENSOR_MIN_BYTES = 1024
# IR version from which function overloads (one fallback body per fused node) exist.
IR_WITH_OVERLOADS = 10
# IR version from which initializers need not be listed as graph inputs.
IR_INITIALIZERS_NOT_INPUTS = 4
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


# --------------------------------------------------------------------------- onnxruntime limits


def _probe_model(ir_version: int, opset: int) -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model.SerializeToString()


def _ort_accepts(ir_version: int, opset: int) -> bool:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(_probe_model(ir_version, opset), sess_options=so, providers=["CPUExecutionProvider"])
    except Exception:  # onnxruntime raises its own exception types
        return False
    return True


def _highest_accepted(low: int, high: int, accepts) -> int:
    """The largest v in [low, high] with accepts(v), assuming acceptance is monotone."""
    if not accepts(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        if accepts(mid):
            low = mid
        else:
            high = mid - 1
    return low


@functools.lru_cache(maxsize=None)
def ort_max_ir_version() -> int:
    """The newest ONNX IR version the installed onnxruntime loads (probed once: tables by
    version go stale, a probe does not)."""
    return _highest_accepted(7, max(onnx.IR_VERSION, 7) + 4, lambda ir: _ort_accepts(ir, 9))


@functools.lru_cache(maxsize=None)
def ort_max_opset() -> int:
    """The newest ai.onnx opset the installed onnxruntime runs (probed once)."""
    ir = ort_max_ir_version()
    return _highest_accepted(7, onnx.defs.onnx_opset_version() + 4, lambda v: _ort_accepts(ir, v))


def ort_error_text(exc: BaseException) -> str:
    """onnxruntime's message without its status prefix and C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"^/\S+:\d+ \S+?\(.*?\) ", "", text)
    text = re.sub(r"^/\S+:\d+ ", "", text)
    return text


# --------------------------------------------------------------------------- loading


def _all_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for g in attr.graphs:
                yield from _all_tensors(g)


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

    external = [t for t in _all_tensors(model.graph) if uses_external_data(t)]
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
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{label}: cannot read: {e.strerror or e}") from None
    model = parse_model(data, label)
    _load_external_data(model, label, path.resolve().parent, weights_on_disk)
    check_model(model, label)
    return LoadedModel(model=model, label=label, path=str(path))


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


# --------------------------------------------------------------------------- normalizing


def normalize(loaded: LoadedModel) -> LoadedModel:
    """Prepare a loaded model for the passes: initializers are constants, shapes are inferred.

    IR < 4 models must list every initializer as a graph input; onnxruntime treats those as
    constants anyway, and the passes need to see them as constants, so such inputs are
    dropped (and the IR version raised to 4, where that is legal). In IR >= 4 an initializer
    that is also an input is an overridable default, part of the model's interface: kept.
    """
    model = loaded.model
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
    _copy_fields(model, light, skip="graph")
    _copy_fields(model.graph, light.graph, skip="initializer")
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


def _copy_fields(src, dst, skip: str) -> None:
    """Copy every set field of protobuf message `src` but `skip` into the empty `dst`."""
    for desc, value in src.ListFields():
        if desc.name == skip:
            continue
        if desc.is_repeated:
            getattr(dst, desc.name).extend(value)
        elif desc.type == desc.TYPE_MESSAGE:
            getattr(dst, desc.name).CopyFrom(value)
        else:
            setattr(dst, desc.name, value)


# Model fields the passes produce themselves; every other field of the original is kept.
_MODEL_FIELDS_REBUILT = ("graph", "ir_version", "opset_import", "functions")
_GRAPH_FIELDS_REBUILT = ("node", "initializer", "sparse_initializer", "input", "output", "value_info", "name")


def keep_model_fields(original: onnx.ModelProto, out: onnx.ModelProto) -> None:
    """Copy onto `out` (a rebuilt model) what the rebuilding does not carry: every model-level
    field of `original` (domain, doc string, model version, producer, metadata_props, training
    info, ...), the graph's doc string and metadata, and the doc strings and metadata of the graph
    inputs and outputs that `out` still has (matched by name)."""
    for desc, value in original.ListFields():
        if desc.name in _MODEL_FIELDS_REBUILT:
            continue
        out.ClearField(desc.name)
        if desc.is_repeated:
            getattr(out, desc.name).extend(value)
        elif desc.type == desc.TYPE_MESSAGE:
            getattr(out, desc.name).CopyFrom(value)
        else:
            setattr(out, desc.name, value)
    for desc, value in original.graph.ListFields():
        if desc.name in _GRAPH_FIELDS_REBUILT:
            continue
        out.graph.ClearField(desc.name)
        if desc.is_repeated:
            getattr(out.graph, desc.name).extend(value)
        elif desc.type == desc.TYPE_MESSAGE:
            getattr(out.graph, desc.name).CopyFrom(value)
        else:
            setattr(out.graph, desc.name, value)
    for mine, theirs in ((original.graph.input, out.graph.input), (original.graph.output, out.graph.output)):
        by_name = {v.name: v for v in mine}
        for v in theirs:
            source = by_name.get(v.name)
            if source is None:
                continue
            if source.doc_string:
                v.doc_string = source.doc_string
            if source.metadata_props and not v.metadata_props:
                v.metadata_props.extend(source.metadata_props)


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


# --------------------------------------------------------------------------- saving


def uses_functions(model: onnx.ModelProto) -> bool:
    return bool(model.functions) or any(n.overload for n in model.graph.node) or any(
        n.domain == DOMAIN for n in model.graph.node
    )


def output_ir_version(model: onnx.ModelProto) -> int:
    """min(max(model IR, 10 when fused ops / overloads are used), newest onnxruntime loads)."""
    wanted = model.ir_version
    if uses_functions(model):
        wanted = max(wanted, IR_WITH_OVERLOADS)
    return min(wanted, ort_max_ir_version())


def _mode_for_new_file() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


# A model holding more than this many bytes of weights by reference (loaded with external
# data) is written with a data file even under 2 GiB: inlining would read them all into memory.
INLINE_REFERENCED_MAX = 256 << 20


def _externalize(model: onnx.ModelProto, data_file, location: str, min_bytes: int) -> None:
    """Move large tensor payloads into data_file (already open), pointing the model at `location`.

    Tensors held by reference are streamed from their files, never read whole; tensors in
    function bodies (fallback bodies' Constant nodes) stay inline."""
    from onnx import numpy_helper

    from .weights import ALIGN, all_tensors, copy_region, inline_tensor, region_of, set_reference

    for f in model.functions:
        for node in f.node:
            for attr in node.attribute:
                for t in ([attr.t] if attr.HasField("t") else []) + list(attr.tensors):
                    inline_tensor(t)
    offset = 0
    for t in all_tensors(model, functions=False):
        if t.data_type == onnx.TensorProto.STRING:
            continue
        region = region_of(t)
        if region is None:
            if not t.HasField("raw_data"):
                # Typed fields (float_data, ...) become raw bytes so they can be moved out too.
                array = numpy_helper.to_array(t)
                if array.nbytes < min_bytes:
                    continue
                t.CopyFrom(numpy_helper.from_array(array, t.name))
            if len(t.raw_data) < min_bytes:
                continue
        # Align each tensor to 4 KiB so the data file can be memory-mapped tensor by tensor.
        pad = (-offset) % ALIGN
        data_file.write(b"\0" * pad)
        offset += pad
        if region is None:
            length = len(t.raw_data)
            data_file.write(t.raw_data)
        else:
            length = region.length
            copy_region(region, data_file)
        set_reference(t, location, offset, length)
        offset += length


def _needs_data_file(model: onnx.ModelProto, threshold: int) -> bool:
    from .weights import referenced_bytes

    referenced = referenced_bytes(model)
    if referenced > INLINE_REFERENCED_MAX:
        return True
    try:
        size = model.ByteSize()
    except Exception:  # protobuf refuses to size a message over 2 GiB
        return True
    return size + referenced >= threshold


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    external_threshold: int = PROTOBUF_LIMIT,
    external_min_bytes: int = EXTERNAL_TENSOR_MIN_BYTES,
    before_commit: Callable[[list[str]], None] | None = None,
) -> list[str]:
    """Write `model` to `path` atomically, with the IR version onnxruntime accepts.

    Models of external_threshold bytes or more, and models holding over INLINE_REFERENCED_MAX
    bytes of weights by reference, keep tensors of external_min_bytes or more in `<name>.data`
    next to the model, streamed there tensor by tensor (no protobuf message ever holds them);
    both files are written to temporary names in the target directory and renamed into place
    (data file first), so a reader never sees a partial model and a failed run leaves an
    existing file untouched. `before_commit` runs when every byte is written and before the
    first rename, given the paths about to be written: when it raises, nothing is renamed and
    the temporary files are removed. A failed write (disk full, I/O error) is an OutputError
    naming the path. Returns the paths written.
    """
    from .weights import all_tensors, inline_tensor

    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.ir_version = output_ir_version(model)
    mode = _mode_for_new_file()
    temps: list[str] = []
    written: list[str] = []
    target = path
    try:
        data_tmp = None
        if _needs_data_file(out, external_threshold):
            location = path.name + ".data"
            target = directory / location
            fd, data_tmp = outfiles.temporary(directory, location)
            temps.append(data_tmp)
            with os.fdopen(fd, "wb") as f:
                _externalize(out, f, location, external_min_bytes)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(data_tmp, mode)
        else:
            for t in all_tensors(out):
                inline_tensor(t)
        target = path
        fd, model_tmp = outfiles.temporary(directory, path.name)
        temps.append(model_tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(out.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(model_tmp, mode)
        if before_commit is not None:
            finals = [str(path)] + ([str(directory / (path.name + ".data"))] if data_tmp is not None else [])
            before_commit(finals)
        if data_tmp is not None:
            target = directory / (path.name + ".data")
            os.replace(data_tmp, target)
            outfiles.release(data_tmp)
            written.append(str(target))
        target = path
        os.replace(model_tmp, path)
        outfiles.release(model_tmp)
        written.insert(0, str(path))
        temps.clear()
    except OSError as e:
        raise outfiles.write_error(target, e) from None
    finally:
        for t in temps:
            outfiles.remove(t)
    return written


def check_writable(path: str | os.PathLike, label: str = "output") -> None:
    """Fail early (before any work) when OUT cannot be written: see outfiles.check_output_path."""
    outfiles.check_output_path(path, label)


def write_text_atomic(path: str | os.PathLike, text: str, label: str = "output") -> None:
    """Write `text` to `path` through a temporary file renamed into place; a failed write is an
    OutputError naming the path and leaves nothing behind."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    tmp = None
    try:
        fd, tmp = outfiles.temporary(directory, path.name)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for_new_file())
        os.replace(tmp, path)
        outfiles.release(tmp)
        tmp = None
    except OSError as e:
        raise outfiles.write_error(path, e, label) from None
    finally:
        if tmp is not None:
            outfiles.remove(tmp)
