"""The one way a pass writes a fused op: a node in domain `onnxfuse` plus its fallback function.

Every fused node gets a unique ``overload`` and a model-local FunctionProto (same domain,
op_type and overload) whose body is exactly the subgraph the node replaced. onnxruntime runs
the body when our custom-op library is not registered and our kernel when it is, so an
optimized model runs anywhere.

onnx-graphsurgeon knows neither overloads nor per-node function bodies, so the helper records
them in the pass context and `attach_functions` writes them into the exported ModelProto.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper

DOMAIN = "onnxfuse"
# The op set of the domain: what the fused ops and their attributes mean. A change of meaning
# takes a new op set, here and in kernels/registry.h (kOpset). The written model records it in
# its opset_import, in its metadata with the onnxfuse version that wrote it (METADATA_*), and on
# every fused node (OPSET_ATTRIBUTE): onnxruntime binds any op set of a custom domain to the one
# schema a library registers, so the node attribute is what lets the library refuse a node of a
# newer op set than its own (registry.cc) rather than run it as the older op.
DOMAIN_VERSION = 1
OPSET_ATTRIBUTE = "onnxfuse_opset"
METADATA_VERSION = "onnxfuse.version"
METADATA_OPSET = "onnxfuse.opset"
MIN_IR_WITH_OVERLOADS = 10


@dataclass
class FusedRecord:
    op_type: str
    overload: str
    function: onnx.FunctionProto


class FusedRegistry:
    """Overloads and fallback bodies of the fused nodes created (or found) in one model."""

    def __init__(self) -> None:
        self.by_node: dict[str, FusedRecord] = {}
        self._taken: set[str] = set()
        self._names: set[str] = set()

    def reserve(self, overloads: Sequence[str], node_names: Sequence[str] = ()) -> None:
        self._taken.update(overloads)
        self._names.update(node_names)

    def new_overload(self, op_type: str) -> str:
        i = len(self._taken)
        while f"{op_type}_{i}" in self._taken:
            i += 1
        name = f"{op_type}_{i}"
        self._taken.add(name)
        return name

    def unique_node_name(self, base: str) -> str:
        name, i = base, 0
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name


def _export_node(node: gs.Node) -> onnx.NodeProto:
    from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

    return OnnxExporter.export_node(node)


def _constant_node(t: gs.Constant) -> onnx.NodeProto:
    from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

    value = OnnxExporter.export_tensor_proto(t)
    if value.data_location == onnx.TensorProto.EXTERNAL and not value.external_data:
        # Values read from a weight held by reference (mapped): graphsurgeon keeps the imported
        # data_location, but the bytes are inline now, and onnx rejects an external tensor
        # without a location.
        value.ClearField("data_location")
    return helper.make_node("Constant", [], [t.name], name=f"{t.name}__const", value=value)


def make_fused_node(
    graph: gs.Graph,
    registry: FusedRegistry,
    op_type: str,
    nodes: Sequence[gs.Node],
    inputs: Sequence[gs.Tensor],
    outputs: Sequence[gs.Variable],
    attrs: dict | None = None,
    opset: int | None = None,
) -> gs.Node:
    """Replace `nodes` by one fused node reading `inputs` and producing `outputs`.

    `nodes` must be in topological order. `inputs` are the tensors the fused node reads
    (variables or constants); any other constant a body node reads is written into the
    body as a Constant node. `outputs` are tensors produced by `nodes` that are used outside
    the region (or are graph outputs). The original nodes are disconnected and left for
    graph.cleanup() to remove.
    """
    input_names = [t.name for t in inputs]
    body: list[onnx.NodeProto] = []
    formal_inputs = _distinct_names(input_names)
    defined = set(input_names)
    for n in nodes:
        for t in n.inputs:
            if not t.name or t.name in defined:
                continue
            if isinstance(t, gs.Constant):
                body.append(_constant_node(t))
            elif _constant_producer(t) is not None:
                body.append(_export_node(_constant_producer(t)))
            else:
                # A function sees only its formal inputs: a body reading any other outer value
                # would be a fallback that does not run (or, inlined, reads a wrong value).
                raise ValueError(f"fused {op_type} node: body node {n.name!r} reads {t.name!r}, "
                                 "which is neither an input of the fused node nor computed in its body")
            defined.add(t.name)
        body.append(_export_node(n))
        defined.update(t.name for t in n.outputs if t.name)
    body = _relu_apart_from_clip(body, nodes, defined)
    if opset is None:
        opset = graph.opset
    overload = registry.new_overload(op_type)
    name = registry.unique_node_name(f"{op_type}_{nodes[0].name or overload}")
    opsets = [helper.make_opsetid("", opset)]
    # Bodies may hold nodes of other domains (for example com.microsoft ops): import them too.
    for d in sorted({n.domain for n in nodes if n.domain and n.domain != ""}):
        version = graph.import_domains and next(
            (o.version for o in graph.import_domains if o.domain == d), 1
        )
        opsets.append(helper.make_opsetid(d, version or 1))
    fn = helper.make_function(
        DOMAIN,
        op_type,
        inputs=formal_inputs,
        outputs=[t.name for t in outputs],
        nodes=body,
        opset_imports=opsets,
    )
    fn.overload = overload
    outs = list(outputs)
    for n in nodes:
        n.outputs.clear()
        n.inputs.clear()
    node = gs.Node(op=op_type, name=name, domain=DOMAIN, attrs=dict(attrs or {}), inputs=list(inputs), outputs=outs)
    graph.nodes.append(node)
    registry.by_node[name] = FusedRecord(op_type, overload, fn)
    return node


# Clip min types onnxruntime's Relu+Clip fusion (relu_clip_fusion.cc) can read; on any other it
# throws while the session loads (seed 3202 in the original; 9081087 in a fallback body).
_RELU_CLIP_MIN_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def _relu_apart_from_clip(body: list[onnx.NodeProto], nodes: Sequence[gs.Node],
                          defined: set[str]) -> list[onnx.NodeProto]:
    """A fallback body must load wherever its original did. onnxruntime, inlining the body,
    fuses a Relu into a Clip it feeds, and throws when that Clip's min is neither float nor
    float16. A region can bring such a pair together (a no-op Slice between them removed), so
    such a Relu is written as Clip(x, 0, max of its type), which is Relu bit for bit (NaN, -0
    and +inf kept) and which the fusion does not match. That Clip is such a Clip in turn: a Relu
    feeding it is written so too (Relu(Relu(x)) before a double Clip: fuzz seed 9427244)."""
    while True:
        rewritten = _relus_before_clips_once(body, nodes, defined)
        if len(rewritten) == len(body):
            return rewritten
        body = rewritten


def _relus_before_clips_once(body: list[onnx.NodeProto], nodes: Sequence[gs.Node],
                             defined: set[str]) -> list[onnx.NodeProto]:
    dtypes = {t.name: t.dtype for n in nodes for t in list(n.inputs) + list(n.outputs) if t.name}
    # Relu output -> the element type of the Clip it feeds (Clip's min has its input's type).
    hazards = {n.input[0]: dtypes.get(n.input[1]) if dtypes.get(n.input[1]) is not None else dtypes.get(n.input[0])
               for n in body
               if n.op_type == "Clip" and n.domain in ("", "ai.onnx") and len(n.input) > 1 and n.input[1]
               and _onnx_type(dtypes.get(n.input[1])) not in _RELU_CLIP_MIN_TYPES}
    out: list[onnx.NodeProto] = []
    for n in body:
        np_type = hazards.get(n.output[0]) if n.output else None
        if (n.op_type != "Relu" or n.domain not in ("", "ai.onnx") or n.output[0] not in hazards
                or _onnx_type(np_type) in (None, *_RELU_CLIP_MIN_TYPES)):
            out.append(n)
            continue
        dtype = np.dtype(np_type)
        top = np.inf if dtype.kind == "f" else np.iinfo(dtype).max
        bounds = []
        for what, value in (("zero", 0), ("top", top)):
            name = f"{n.output[0]}__relu_{what}"
            while name in defined:
                name += "_"
            defined.add(name)
            out.append(helper.make_node("Constant", [], [name], name=f"{name}__const",
                                        value=numpy_helper.from_array(np.array(value, dtype=dtype), name)))
            bounds.append(name)
        out.append(helper.make_node("Clip", [n.input[0], *bounds], list(n.output), name=n.name))
    return out


def _onnx_type(dtype) -> int | None:
    if dtype is None:
        return None
    try:
        return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (TypeError, KeyError, ValueError):
        return None


def _constant_producer(t: gs.Tensor) -> gs.Node | None:
    """The Constant node (outside the fused nodes) that writes `t`, if one does: its copy goes
    into the body, as a constant initializer's value does."""
    p = t.inputs[0] if len(t.inputs) else None
    if p is not None and p.op == "Constant" and p.domain in (None, "", "ai.onnx") and not p.inputs:
        return p
    return None


def _distinct_names(names: Sequence[str]) -> list[str]:
    """A tensor read twice by a fused node (say, through two views) is two node inputs, but a
    function's formal inputs must be distinct: repeats get names the body never reads."""
    taken = set(names)
    seen: set[str] = set()
    out = []
    for name in names:
        if name in seen:
            k = 1
            while f"{name}__dup{k}" in taken:
                k += 1
            name = f"{name}__dup{k}"
            taken.add(name)
        seen.add(name)
        out.append(name)
    return out


def attach_functions(model: onnx.ModelProto, registry: FusedRegistry, kept: Sequence[onnx.FunctionProto]) -> None:
    """Write overloads and fallback functions of fused nodes into an exported model.

    `kept` are the functions the input model already had (restored as they were).
    Functions of fused nodes that no longer exist in the graph are dropped.
    """
    used: set[tuple[str, str, str]] = set()
    for node in model.graph.node:
        rec = registry.by_node.get(node.name)
        if node.domain == DOMAIN and rec is not None:
            node.overload = rec.overload
        if node.domain == DOMAIN and not any(a.name == OPSET_ATTRIBUTE for a in node.attribute):
            node.attribute.append(helper.make_attribute(OPSET_ATTRIBUTE, DOMAIN_VERSION))
        if node.domain:
            used.add((node.domain, node.op_type, node.overload))
    del model.functions[:]
    seen = set()
    for fn in list(kept) + [r.function for r in registry.by_node.values()]:
        key = (fn.domain, fn.name, fn.overload)
        if key in seen:
            continue
        # Unused fallbacks of our own domain are dropped; foreign functions are kept.
        if fn.domain == DOMAIN and key not in used:
            continue
        seen.add(key)
        model.functions.append(fn)
    if any(n.domain == DOMAIN for n in model.graph.node):
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
        _record_writer(model)
        # Function overloads exist from IR 10 on; saving may lower a higher IR to what the
        # installed onnxruntime accepts, never below 10.
        model.ir_version = max(model.ir_version, MIN_IR_WITH_OVERLOADS)


def _record_writer(model: onnx.ModelProto) -> None:
    """Model metadata naming the onnxfuse version and op set the fused nodes need."""
    from .version import __version__

    opset = next(o.version for o in model.opset_import if o.domain == DOMAIN)
    values = {METADATA_VERSION: __version__, METADATA_OPSET: str(opset)}
    kept = [p for p in model.metadata_props if p.key not in values]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in values.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
