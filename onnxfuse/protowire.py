"""A model file's large initializers found in its protobuf bytes, without parsing them.

A single-file model holds its weights inline (TensorProto.raw_data). Parsing the file copies
every weight into memory, and every later copy of the model (an export, a session) copies them
again. `split_weights` reads the file's bytes (a memory map: only the pages of the message
headers are touched) and returns the model's bytes without the raw data of its large
initializers, and where in the file each one's bytes are, so that the loader can hold them by
reference (weights.py) as it does for a model with external data.

The wire format (protobuf encoding): each field is a varint key (field number << 3 | wire type)
followed by a varint (type 0), 8 bytes (1), a varint length and that many bytes (2) or 4 bytes
(5). ModelProto.graph is field 7, GraphProto.initializer field 5, and TensorProto has dims (1),
data_type (2), raw_data (9), external_data (13) and data_location (14).
"""
from __future__ import annotations

from dataclasses import dataclass


class WireError(ValueError):
    """The bytes are not the protobuf message they were read as."""


MODEL_GRAPH = 7
GRAPH_INITIALIZER = 5
TENSOR_DIMS, TENSOR_DATA_TYPE, TENSOR_RAW_DATA = 1, 2, 9
TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION = 13, 14


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def fields(buf, start: int, end: int):
    """(field number, wire type, start of the field's key, start of its payload, end of the
    field) for each field of the message in buf[start:end]; for wire type 2 the payload is
    the bytes after the length."""
    pos = start
    while pos < end:
        key_at = pos
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wire == 0:
            _, after = _varint(buf, pos, end)
            payload = pos
        elif wire == 1:
            payload, after = pos, pos + 8
        elif wire == 2:
            length, payload = _varint(buf, pos, end)
            after = payload + length
        elif wire == 5:
            payload, after = pos, pos + 4
        else:
            raise WireError(f"unsupported wire type {wire}")
        if after > end:
            raise WireError("field runs past the end of its message")
        yield number, wire, key_at, payload, after
        pos = after


def _length_delimited(number: int, payload: bytes) -> bytes:
    return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload


@dataclass(frozen=True)
class InlineWeight:
    """An initializer whose raw data was left out: its position in graph.initializer, and
    where its bytes are in the file."""

    index: int
    offset: int
    length: int


def _tensor_without_data(buf, start: int, end: int, min_bytes: int) -> tuple[bytes, int, int] | None:
    """(the TensorProto's bytes without raw_data, raw data offset, raw data length) when it
    holds at least min_bytes of raw data and nothing else of its data; else None."""
    raw = None
    kept = []
    for number, wire, key_at, payload, after in fields(buf, start, end):
        if number == TENSOR_RAW_DATA and wire == 2:
            raw = (payload, after - payload)
            continue
        if number in (TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION):
            return None  # external already
        kept.append((key_at, after))
    if raw is None or raw[1] < min_bytes:
        return None
    return b"".join(bytes(buf[a:b]) for a, b in kept), raw[0], raw[1]


def split_weights(buf, min_bytes: int) -> tuple[bytes, list[InlineWeight]]:
    """(the model's bytes with the raw data of initializers of min_bytes or more left out,
    those initializers). Raises WireError for bytes that are not a well-formed ModelProto."""
    end = len(buf)
    out = []
    weights: list[InlineWeight] = []
    graphs = 0
    for number, wire, key_at, payload, after in fields(buf, 0, end):
        if number != MODEL_GRAPH or wire != 2:
            out.append(bytes(buf[key_at:after]))
            continue
        graphs += 1
        if graphs > 1:
            raise WireError("more than one graph field")
        parts = []
        index = 0
        for g_number, g_wire, g_key, g_payload, g_after in fields(buf, payload, after):
            if g_number == GRAPH_INITIALIZER and g_wire == 2:
                light = _tensor_without_data(buf, g_payload, g_after, min_bytes)
                if light is not None:
                    parts.append(_length_delimited(GRAPH_INITIALIZER, light[0]))
                    weights.append(InlineWeight(index, light[1], light[2]))
                else:
                    parts.append(bytes(buf[g_key:g_after]))
                index += 1
                continue
            parts.append(bytes(buf[g_key:g_after]))
        out.append(_length_delimited(MODEL_GRAPH, b"".join(parts)))
    return b"".join(out), weights


def join_weights(buf, regions: dict, write, copy) -> None:
    """Write the ModelProto in `buf` with the initializers at the positions of `regions` (index
    in graph.initializer -> where its bytes are) given their bytes inline as raw data, in place
    of their external-data fields: write(bytes) writes model bytes, copy(region) the bytes of
    a region (streamed, never held whole). The inverse of split_weights."""
    end = len(buf)
    top, graph = [], None
    for number, wire, key_at, payload, after in fields(buf, 0, end):
        if number == MODEL_GRAPH and wire == 2 and graph is None:
            graph = (payload, after)
            top.append(None)
        else:
            top.append(bytes(buf[key_at:after]))
    if graph is None:
        raise WireError("no graph")
    pieces: list = []
    size = 0
    index = 0
    for number, wire, key_at, payload, after in fields(buf, *graph):
        if number == GRAPH_INITIALIZER and wire == 2:
            region = regions.get(index)
            index += 1
            if region is not None:
                # raw_data in field order, as protobuf writes it
                kept = [(n, bytes(buf[a:c])) for n, _, a, _, c in fields(buf, payload, after)
                        if n not in (TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION, TENSOR_RAW_DATA)]
                head = b"".join(b for n, b in kept if n < TENSOR_RAW_DATA)
                head += encode_varint(TENSOR_RAW_DATA << 3 | 2) + encode_varint(region.length)
                tail = b"".join(b for n, b in kept if n > TENSOR_RAW_DATA)
                tensor_size = len(head) + region.length + len(tail)
                head = encode_varint(GRAPH_INITIALIZER << 3 | 2) + encode_varint(tensor_size) + head
                pieces += [head, region, tail]
                size += len(head) + region.length + len(tail)
                continue
        piece = bytes(buf[key_at:after])
        pieces.append(piece)
        size += len(piece)
    for part in top:
        if part is not None:
            write(part)
            continue
        write(encode_varint(MODEL_GRAPH << 3 | 2) + encode_varint(size))
        for piece in pieces:
            if isinstance(piece, bytes):
                write(piece)
            else:
                copy(piece)
