"""Copying a model's protobuf fields one by one: light copies that leave the weights out, and
what a rebuilt model takes over from its original."""
from __future__ import annotations

from typing import Collection

import onnx


def copy_fields(src, dst, skip: Collection[str] = ()) -> None:
    """Copy every set field of protobuf message `src` but those named in `skip` into `dst`,
    replacing what `dst` held in them."""
    for desc, value in src.ListFields():
        if desc.name in skip:
            continue
        dst.ClearField(desc.name)
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
    copy_fields(original, out, skip=_MODEL_FIELDS_REBUILT)
    copy_fields(original.graph, out.graph, skip=_GRAPH_FIELDS_REBUILT)
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
