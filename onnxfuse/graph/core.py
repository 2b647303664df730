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


def scalar(tensor: gs.Tensor | None) -> float | None:
    """The value of a numeric constant of one element (initializer or Constant node), else None.
    A larger initializer is ruled out by its shape, without reading its values."""
    if not is_present(tensor):
        return None
    if isinstance(tensor, gs.Constant) and tensor.shape is not None and int(np.prod(tensor.shape)) != 1:
        return None
    v = constant_value(tensor)
    if v is None or v.size != 1 or v.dtype.kind not in "fiub":
        return None
    return float(v.reshape(-1)[0])


# Ops whose output holds only elements of their first input: when every element of that input
# is one value, so is every element of the output (indices assumed valid, as the model's own run
# checks them).
_ELEMENTS_OF_FIRST_INPUT = frozenset({
    "Expand", "Gather", "GatherElements", "GatherND", "Reshape", "Squeeze", "Unsqueeze", "Slice",
    "Tile", "Transpose", "Identity", "Flatten",
})
# Constants larger than this are not read to look for one repeated value.
_UNIFORM_MAX_ELEMENTS = 1 << 16


def uniform_value(tensor: gs.Tensor | None, depth: int = 8) -> float | int | None:
    """The one value every element of `tensor` provably has: a non-empty constant whose elements
    are all equal, or a view, broadcast or gather of one (Expand, Gather, Slice, Reshape, ...);
    None when not proved. Token type ids that a model without them reads from a registered
    all-zero buffer are such a tensor."""
    if not is_present(tensor):
        return None
    if is_constant(tensor):
        if isinstance(tensor, gs.Constant) and tensor.shape is not None \
                and int(np.prod(tensor.shape)) > _UNIFORM_MAX_ELEMENTS:
            return None
        v = constant_value(tensor)
        if v is None or v.size == 0 or v.size > _UNIFORM_MAX_ELEMENTS or v.dtype.kind not in "fiub":
            return None
        flat = v.reshape(-1)
        return flat[0].item() if bool(np.all(flat == flat[0])) else None
    node = producer(tensor)
    if depth == 0 or node is None or not is_default_domain(node) or node.op not in _ELEMENTS_OF_FIRST_INPUT:
        return None
    return uniform_value(node.inputs[0], depth - 1)


def clip_bounds(node: gs.Node) -> tuple[float, float] | None:
    """(min, max) of a Clip node, -inf/inf where absent; None when a bound is computed. Bounds
    are attributes before opset 11, inputs from then on."""
    if "min" in node.attrs or "max" in node.attrs:
        return float(node.attrs.get("min", -np.inf)), float(node.attrs.get("max", np.inf))
    bounds = []
    for i, absent in ((1, -np.inf), (2, np.inf)):
        t = node.inputs[i] if len(node.inputs) > i else None
        value = scalar(t)
        if is_present(t) and value is None:
            return None
        bounds.append(absent if value is None else value)
    return bounds[0], bounds[1]


def other_input(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor | None:
    """The other operand of a two-input node that reads `tensor` once (None when it reads it
    twice, or not at all)."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is tensor and b is not tensor:
        return b
    if b is tensor and a is not tensor:
        return a
    return None


def is_private(graph: gs.Graph, tensor: gs.Tensor, readers: int = 1) -> bool:
    """True when `tensor` is internal to a chain: a computed value with exactly `readers`
    readers, not a graph output (a rewrite may fold it away)."""
    return isinstance(tensor, gs.Variable) and len(tensor.outputs) == readers and not is_graph_output(graph, tensor)


def is_constant(tensor: gs.Tensor) -> bool:
    """constant_value(tensor) is not None, without reading (and so loading) the value: a weight
    read once is converted to and from numpy from then on."""
    if isinstance(tensor, gs.Constant):
        return True
    node = producer(tensor)
    if node is None or node.op != "Constant" or not is_default_domain(node):
        return False
    a = node.attrs
    return isinstance(a.get("value"), gs.Constant) or any(
        k in a for k in ("value_int", "value_float", "value_ints", "value_floats")
    )


def constants_as_initializers(graph: gs.Graph) -> int:
    """Every Constant node of the top-level graph becomes an initializer of the same name;
    returns how many.

    Exporters write constants both ways (torch.onnx's TorchScript exporter as Constant nodes,
    torch.export mostly as initializers), and onnxruntime turns Constant nodes into
    initializers when it loads a model. Passes then meet one form: a constant is a
    gs.Constant, which a fused node's fallback body carries with it, where a Constant node's
    output would be a value the function cannot see. Kept as nodes: a Constant whose output
    is a graph output (an initializer cannot be one), one read from inside an If/Loop/Scan
    body, and sparse or string values."""
    nodes = {id(n) for n in graph.nodes}
    outputs = {t.name for t in graph.outputs}
    count = 0
    for node in list(graph.nodes):
        if not is_op(node, "Constant") or len(node.outputs) != 1:
            continue
        out = node.outputs[0]
        if out.name in outputs or any(id(r) not in nodes for r in out.outputs):
            continue
        value = constant_value(out)
        if value is None or value.dtype.kind not in "biuf":
            continue
        replace_uses(out, gs.Constant(out.name, np.asarray(value)))
        node.outputs.clear()
        count += 1
    if count:
        graph.nodes = [n for n in graph.nodes if n.outputs or not is_op(n, "Constant")]
    return count


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


def tensor_map(graph: gs.Graph) -> dict[str, gs.Tensor]:
    """What graph.tensors() returns (graph inputs, then each node's inputs and outputs, then
    graph outputs; empty names left out; a later tensor of a name replaces an earlier one in
    that name's first position), without its per-call list concatenations and checks: many
    times faster, for passes that look up tensors often."""
    out: dict[str, gs.Tensor] = {}
    for t in graph.inputs:
        if t.name:
            out[t.name] = t
    for node in graph.nodes:
        for t in node.inputs:
            if t.name:
                out[t.name] = t
        for t in node.outputs:
            if t.name:
                out[t.name] = t
    for t in graph.outputs:
        if t.name:
            out[t.name] = t
    return out


def tensor_names(graph: gs.Graph) -> set[str]:
    names = {t.name for t in graph.inputs}
    names.update(t.name for t in graph.outputs)
    for node in graph.nodes:
        names.update(t.name for t in node.inputs)
        names.update(t.name for t in node.outputs)
    names.discard("")
    return names


class TakenNames(set):
    """Every tensor and node name of a graph: the `taken` set for a pass's unique_name calls,
    built once per pass instead of once per call. unique_name adds the names it hands out;
    release_names takes back those of tensors the pass detached, so the set stays what
    unique_name would collect from the graph itself."""

    def __init__(self, graph: gs.Graph) -> None:
        self.node_names = {n.name for n in graph.nodes}
        super().__init__(tensor_names(graph) | self.node_names)


def taken_names(graph: gs.Graph) -> TakenNames:
    return TakenNames(graph)


def release_names(graph: gs.Graph, taken: set[str], tensors: Iterable[gs.Tensor]) -> None:
    """Remove from `taken` the names of `tensors` that no node reads or writes any more and
    that are not graph inputs or outputs (a pass detached them; the graph no longer has
    them), unless a node of the graph has that name."""
    node_names = getattr(taken, "node_names", ())
    for t in tensors:
        if not is_present(t) or t.inputs or t.outputs or is_graph_input(graph, t) or is_graph_output(graph, t):
            continue
        if t.name not in node_names:
            taken.discard(t.name)


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
    from ..weights import new_constant

    return new_constant(graph, unique_name(graph, base, taken), value)


def _has_subgraph(node: gs.Node) -> bool:
    for v in node.attrs.values():
        if isinstance(v, gs.Graph) or (isinstance(v, (list, tuple)) and any(isinstance(x, gs.Graph) for x in v)):
            return True
    return False


def _local_names(graph: gs.Graph) -> set[str]:
    """The names graphsurgeon treats as defined in `graph` itself (Graph._local_tensors)."""
    local = {t.name for n in graph.nodes for t in n.outputs if t.name}
    local.update(t.name for t in graph.inputs)
    local.update(name for name, t in tensor_map(graph).items() if isinstance(t, gs.Constant))
    return local


def cleanup(graph: gs.Graph) -> gs.Graph:
    """graph.cleanup(remove_unused_graph_inputs=False), with the same result, several times
    faster: graphsurgeon formats a log message (the whole node) for every node it removes,
    logged or not. Nodes that contribute to no graph output are dropped and disconnected.
    Graphs with subgraphs or local functions, and graphs graphsurgeon would reject, go to
    graphsurgeon itself."""
    if graph.functions or any(_has_subgraph(n) for n in graph.nodes):
        return graph.cleanup(remove_unused_graph_inputs=False)
    for t in graph.inputs:  # what graphsurgeon does first: graph inputs have no producers
        t.inputs.clear()
    local = _local_names(graph)
    in_graph = {id(n) for n in graph.nodes}
    seen: set[str] = set()

    def wanted(t: gs.Tensor) -> bool:
        if not t.name:
            return True
        if t.name not in local or t.name in seen:
            return False
        seen.add(t.name)
        return True

    queue = [t for t in graph.outputs if wanted(t)]
    used: set[int] = set()
    i = 0
    while i < len(queue):
        t = queue[i]
        i += 1
        for node in t.inputs:
            if id(node) not in in_graph:
                return graph.cleanup(remove_unused_graph_inputs=False)  # graphsurgeon reports it
            used.add(id(node))
            queue.extend(x for x in list(node.inputs) if wanted(x))
    kept = []
    for node in graph.nodes:
        if id(node) in used:
            kept.append(node)
        else:
            node.inputs.clear()
            node.outputs.clear()
    graph.nodes = kept
    return graph


def _is_topological(nodes: Sequence[gs.Node]) -> bool:
    """Whether every value a node reads that some node writes is written earlier in `nodes`."""
    written: set[str] = set()
    for node in nodes:
        for t in node.inputs:
            if t.inputs and t.name not in written:
                return False
        written.update(t.name for t in node.outputs)
    return True


def toposort(graph: gs.Graph) -> gs.Graph:
    """Order the nodes so that every node comes after the producers of its inputs, moving as
    few as possible: an order that is already topological stays as it is, and a node out of
    place moves to just before its first reader.

    A depth-first walk from each node in list order, producers first in the order of the node's
    inputs, without recursion; nodes are placed in the order the walk finishes them. The
    exporter's order is kept because passes walk the graph in it: each branch of the graph is
    then visited in one piece, where graphsurgeon's order (stably by depth) interleaves parallel
    branches, so that a graph of many branches is walked with a cold cache at every step (17%
    of the pass time of 2,500 parallel chains, bench/results/node_scaling.md). Graphs with
    subgraphs or local functions, and graphs with a cycle or a producer outside the graph, go
    to graph.toposort() (graphsurgeon reports the cycle)."""
    nodes = graph.nodes
    if graph.functions or any(_has_subgraph(n) for n in nodes):
        return graph.toposort()
    if _is_topological(nodes):
        return graph  # most calls: a pass's first step, or after a pass that only rewired
    in_graph = {id(n) for n in nodes}
    local = _local_names(graph)

    def producers(node: gs.Node) -> list[gs.Node]:
        found: dict[int, gs.Node] = {}
        for t in node.inputs:
            if t.name in local:
                for p in t.inputs:
                    found.setdefault(id(p), p)
        return list(found.values())

    placed: set[int] = set()
    ordered: list[gs.Node] = []
    for root in nodes:
        if id(root) in placed:
            continue
        stack = [[root, producers(root), 0]]  # node, its producers, next one to visit
        walking = {id(root)}
        while stack:
            frame = stack[-1]
            node, prods, i = frame
            while i < len(prods) and id(prods[i]) in placed:
                i += 1
            if i < len(prods):
                p = prods[i]
                if id(p) in walking or id(p) not in in_graph:
                    return graph.toposort()
                frame[2] = i + 1
                walking.add(id(p))
                stack.append([p, producers(p), 0])
                continue
            stack.pop()
            walking.discard(id(node))
            placed.add(id(node))
            ordered.append(node)
    graph.nodes = ordered
    return graph


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


def take_output(nodes: Iterable[gs.Node], output: gs.Variable, shape: Sequence) -> gs.Variable:
    """Detach `nodes` (those that computed `output`) and return `output`, now of `shape`, for a
    replacement node to write: its readers keep reading the same tensor."""
    for node in nodes:
        disconnect(node)
    output.shape = list(shape)
    return output


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


def export_model(graph: gs.Graph, keep_elements: int | None = None):
    """(model, bytes left out): the model gs.export_onnx(graph, do_type_check=False) writes,
    field for field, with each initializer copied once (gs.export_onnx copies every weight
    twice, into its GraphProto and again into the ModelProto).

    keep_elements: initializers of more elements become graph inputs of their type and shape
    instead, built without converting or copying their values. Shape inference derives the
    same shapes from such a model (no shape depends on the values of a tensor that large), so
    it is what shape inference is given: exporting and inferring over GPT-2 small's 500 MB of
    weights for every inference was most of the optimizer's time."""
    import onnx
    from onnx import helper
    from onnx_graphsurgeon.exporters.onnx_exporter import (
        OnnxExporter,
        check_duplicate_node_names,
        dtype_to_onnx,
        update_import_domains,
    )
    from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

    from ..weights import export_reference

    exporter = OnnxExporter
    check_duplicate_node_names(graph.nodes)
    model = onnx.ModelProto()
    model.ir_version = onnx.IR_VERSION
    g = model.graph
    g.node.extend(exporter.export_node(n) for n in graph.nodes)
    g.name = graph.name
    g.input.extend(exporter.export_value_info_proto(t, False) for t in graph.inputs)
    g.output.extend(exporter.export_value_info_proto(t, False) for t in graph.outputs)
    tensors = tensor_map(graph)
    left_out = 0
    moved = []
    for t in tensors.values():
        if not isinstance(t, gs.Constant):
            continue
        values = t._values
        if isinstance(values, SparseValues):
            g.sparse_initializer.append(exporter.export_sparse_tensor_proto(t))
            continue
        if keep_elements is not None:
            count = 1
            for d in t.shape:
                count *= int(d)
            if count > keep_elements:
                if isinstance(values, LazyValues):
                    elem_type = values.tensor.data_type
                    left_out += values.nbytes
                else:
                    elem_type = dtype_to_onnx(t.export_dtype)
                    left_out += int(np.asarray(values).nbytes)
                moved.append(helper.make_tensor_value_info(t.name, elem_type, [int(d) for d in t.shape]))
                continue
        # A weight whose bytes are on disk is exported as a reference to them (weights.py).
        reference = export_reference(t)
        g.initializer.append(reference if reference is not None else exporter.export_tensor_proto(t))
    io_names = {t.name for t in graph.inputs} | {t.name for t in graph.outputs}
    g.value_info.extend(
        exporter.export_value_info_proto(t, False)
        for name, t in tensors.items()
        if name not in io_names and isinstance(t, gs.Variable) and (t.dtype is not None or t.shape is not None)
    )
    if graph.doc_string:
        g.doc_string = graph.doc_string
    g.input.extend(moved)
    model.opset_import.extend(update_import_domains(graph))
    model.functions.extend(exporter.export_function(f) for f in graph.functions)
    model.producer_name = graph.producer_name
    model.producer_version = graph.producer_version
    if graph.ir_version is not None:
        model.ir_version = graph.ir_version
    return model, left_out


def rank(t: gs.Tensor) -> int | None:
    d = dims(t)
    return None if d is None else len(d)


def split_node(graph: gs.Graph, src: gs.Tensor, sizes: list[int], outputs: list[gs.Variable], axis: int = -1,
               name: str | None = None) -> gs.Node:
    """Split of `src` into pieces of `sizes` along `axis`, in the form the graph's opset takes
    (sizes as an input from opset 13, as an attribute before)."""
    if graph.opset >= 13:
        sizes_t = make_constant(graph, f"{src.name}_split", np.asarray(sizes, np.int64))
        node = gs.Node("Split", inputs=[src, sizes_t], outputs=outputs, attrs={"axis": axis})
    else:
        node = gs.Node("Split", inputs=[src], outputs=outputs, attrs={"axis": axis, "split": list(sizes)})
    if name is not None:
        node.name = name
    return node
