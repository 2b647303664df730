"""Small helpers over onnx-graphsurgeon graphs shared by the passes.

graphsurgeon tensors and nodes compare by value and are unhashable, so the helpers work with
identities (`is`) and names. A tensor's producer is `tensor.inputs`, its consumers
`tensor.outputs`; rewiring goes through the node's input/output lists, which keep both sides
in sync.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import onnx_graphsurgeon as gs


def producer(tensor: gs.Tensor) -> gs.Node | None:
    """The node that writes `tensor`, or None for graph inputs and initializers."""
    return tensor.inputs[0] if len(tensor.inputs) else None


def consumers(tensor: gs.Tensor) -> list[gs.Node]:
    """Nodes that read `tensor` (nodes of subgraphs that read it from the outer scope included)."""
    return list(tensor.outputs)


def single_consumer(tensor: gs.Tensor) -> gs.Node | None:
    """The only reader of `tensor`, or None when it has none or several."""
    return tensor.outputs[0] if len(tensor.outputs) == 1 else None


def _contains(tensors: Iterable[gs.Tensor], tensor: gs.Tensor) -> bool:
    return any(t is tensor or t.name == tensor.name for t in tensors)


def is_graph_output(graph: gs.Graph, tensor: gs.Tensor) -> bool:
    return _contains(graph.outputs, tensor)


def is_graph_input(graph: gs.Graph, tensor: gs.Tensor) -> bool:
    return _contains(graph.inputs, tensor)


def is_present(tensor: gs.Tensor | None) -> bool:
    """False for an omitted optional input or output (an empty name)."""
    return tensor is not None and bool(tensor.name)


def is_default_domain(node: gs.Node) -> bool:
    """True for operators of the standard ONNX domain (graphsurgeon leaves that domain as None)."""
    return node.domain in (None, "", "ai.onnx")


def is_op(node: gs.Node | None, *ops: str) -> bool:
    """True when `node` is one of the standard ONNX operators `ops`."""
    return node is not None and node.op in ops and is_default_domain(node)


def attr(node: gs.Node, name: str, default=None):
    return node.attrs.get(name, default)


def constant_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of an initializer or of the output of a Constant node; None for anything computed."""
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    node = producer(tensor)
    if node is None or node.op != "Constant" or not is_default_domain(node):
        return None
    a = node.attrs
    if isinstance(a.get("value"), gs.Constant):
        return np.asarray(a["value"].values)
    for key, dtype in (("value_int", np.int64), ("value_float", np.float32)):
        if key in a:
            return np.array(a[key], dtype=dtype)
    for key, dtype in (("value_ints", np.int64), ("value_floats", np.float32)):
        if key in a:
            return np.array(list(a[key]), dtype=dtype)
    return None


def constant_ints(tensor: gs.Tensor) -> list[int] | None:
    """A constant integer tensor as a flat list of Python ints (None if not constant or not integer)."""
    if not is_present(tensor):
        return None
    v = constant_value(tensor)
    if v is None or v.dtype.kind not in "iu":
        return None
    return [int(x) for x in v.reshape(-1)]


def dims(tensor: gs.Tensor) -> list[int | str | None] | None:
    """The shape as recorded in the graph: ints for static dims, names for symbolic ones, None for
    unknown ones; None when not even the rank is known."""
    if isinstance(tensor, gs.Constant):
        return list(tensor.shape)
    if tensor.shape is None:
        return None
    out: list[int | str | None] = []
    for d in tensor.shape:
        if isinstance(d, (int, np.integer)) and d >= 0:
            out.append(int(d))
        elif isinstance(d, str) and d:
            out.append(d)
        else:
            out.append(None)
    return out


def static_shape(tensor: gs.Tensor) -> tuple[int, ...] | None:
    """The shape when every dim is a known integer, else None."""
    d = dims(tensor)
    if d is None or any(not isinstance(x, int) for x in d):
        return None
    return tuple(d)


def tensor_names(graph: gs.Graph) -> set[str]:
    return set(graph.tensors().keys())


def unique_name(graph: gs.Graph, base: str, taken: set[str] | None = None) -> str:
    """A tensor name not used in `graph` (nor in `taken`, which is updated)."""
    used = tensor_names(graph) if taken is None else taken
    if taken is None:
        used |= {n.name for n in graph.nodes}
    name, i = base, 0
    while name in used:
        i += 1
        name = f"{base}_{i}"
    if taken is not None:
        taken.add(name)
    return name


def make_constant(graph: gs.Graph, base: str, value: np.ndarray, taken: set[str] | None = None) -> gs.Constant:
    """A new initializer with a name unique in `graph`."""
    # np.array, not np.ascontiguousarray: that one turns a 0-d value into shape (1,).
    return gs.Constant(unique_name(graph, base, taken), np.array(value, order="C"))


def replace_uses(old: gs.Tensor, new: gs.Tensor, except_nodes: Sequence[gs.Node] = ()) -> int:
    """Make every consumer of `old` read `new` instead (graph outputs are left alone: an output
    name is part of the model's interface). Returns how many inputs were rewired."""
    count = 0
    for node in list(old.outputs):
        if any(node is e for e in except_nodes):
            continue
        for i, t in enumerate(node.inputs):
            if t is old:
                node.inputs[i] = new
                count += 1
    return count


def disconnect(node: gs.Node) -> None:
    """Detach a node from all its tensors; graph.cleanup() then drops it."""
    node.inputs.clear()
    node.outputs.clear()


def bypass(graph: gs.Graph, node: gs.Node, input_index: int = 0, output_index: int = 0) -> bool:
    """Remove a node whose output `output_index` equals its input `input_index` (Identity, a
    no-op Slice, ...). Other outputs of the node must be unused.

    When the output is a graph output its name must survive: the producer of the input is
    rewired to write the graph-output tensor directly and the input's other readers read that.
    That is impossible when the input is a graph input, an initializer or itself a graph output
    (two names for one value need a copy); then nothing changes and False is returned.
    """
    src = node.inputs[input_index]
    dst = node.outputs[output_index]
    for j, out in enumerate(node.outputs):
        if j != output_index and is_present(out) and (out.outputs or is_graph_output(graph, out)):
            return False
    if not is_graph_output(graph, dst):
        replace_uses(dst, src)
        disconnect(node)
        return True
    src_node = producer(src)
    if src_node is None or is_graph_output(graph, src) or is_graph_input(graph, src):
        return False
    if any(n is src_node for n in dst.outputs):
        return False
    disconnect(node)
    slot = next(i for i, t in enumerate(src_node.outputs) if t is src)
    replace_uses(src, dst)
    src_node.outputs[slot] = dst
    if dst.dtype is None and src.dtype is not None:
        dst.dtype = src.dtype
    if dst.shape is None and src.shape is not None:
        dst.shape = src.shape
    return True


# Shape inference --------------------------------------------------------------------------

# Initializers at most this large keep their values during inference (shape constants need
# theirs); larger ones are described by type and shape only, so inference stays cheap and
# far from protobuf's 2 GiB limit.
_INFER_KEEP_ELEMENTS = 4096


def _merge_dim(a, b):
    for pick in (int, str):
        for d in (a, b):
            if isinstance(d, pick):
                return d
    return None


class ShapeTable:
    """Dims of every tensor of a graph: what the graph records merged with what onnx shape
    inference (with data propagation) derives. Symbolic dims are names; a name means the same
    size wherever it appears; names inference invents (unk__N) never clash with existing ones.
    A table describes the graph as it was when built: rebuild it after rewrites that change
    shapes."""

    def __init__(self, graph: gs.Graph, infer: bool = True, _annotate: dict | None = None) -> None:
        self._types: dict[str, int] = {}
        self._inferred: dict[str, list] = _infer_dims(graph, self._types, _annotate) if infer else {}

    def refined(self, graph: gs.Graph, hints: dict[str, list]) -> "ShapeTable":
        """A new table where the tensors in `hints` have the given dims (facts a pass derived that
        onnx inference cannot, e.g. about broadcasting) and what depends on them is inferred
        again; everything else keeps this table's dims, symbol names included, so names stay
        comparable across the two tables."""
        tensors = graph.tensors()
        downstream: set[str] = set()
        stack = [tensors[n] for n in hints if n in tensors]
        while stack:
            for node in stack.pop().outputs:
                for out in node.outputs:
                    if out.name not in downstream:
                        downstream.add(out.name)
                        stack.append(out)
        annotate = {n: (self._types.get(n, 0), d) for n, d in self._inferred.items() if n not in downstream}
        for n, d in hints.items():
            annotate[n] = (self._types.get(n, 0), d)
        return ShapeTable(graph, _annotate=annotate)

    def dims(self, tensor: gs.Tensor) -> list[int | str | None] | None:
        own = dims(tensor)
        inferred = self._inferred.get(tensor.name)
        if own is None or (inferred is not None and len(inferred) != len(own)):
            return list(inferred) if inferred is not None else None
        if inferred is None:
            return own
        return [_merge_dim(a, b) for a, b in zip(own, inferred)]

    def rank(self, tensor: gs.Tensor) -> int | None:
        d = self.dims(tensor)
        return None if d is None else len(d)

    def static_shape(self, tensor: gs.Tensor) -> tuple[int, ...] | None:
        d = self.dims(tensor)
        if d is None or any(not isinstance(x, int) for x in d):
            return None
        return tuple(d)


def _infer_dims(graph: gs.Graph, types: dict[str, int], annotate: dict | None = None) -> dict[str, list]:
    import onnx
    from onnx import helper

    try:
        model = gs.export_onnx(graph, do_type_check=False)
    except Exception:  # a graph graphsurgeon cannot export has no inferable shapes either
        return {}
    g = model.graph
    kept, moved = [], []
    for init in g.initializer:
        n = 1
        for d in init.dims:
            n *= d
        (kept if n <= _INFER_KEEP_ELEMENTS else moved).append(init)
    if moved:
        del g.initializer[:]
        g.initializer.extend(kept)
        g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved)
    if annotate:
        interface = {v.name for v in list(g.input) + list(g.output)} | {t.name for t in g.initializer}
        others = [vi for vi in g.value_info if vi.name not in annotate]
        del g.value_info[:]
        g.value_info.extend(others)
        for name, (elem_type, d) in annotate.items():
            if name not in interface and elem_type:
                g.value_info.append(helper.make_tensor_value_info(name, elem_type, list(d)))
    if model.ir_version > 10:
        model.ir_version = 10
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # inference is an aid: without it passes see only the recorded shapes
        return {}
    table: dict[str, list] = {}
    for vi in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
            continue
        types[vi.name] = tt.elem_type
        table[vi.name] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        ]
    return table
