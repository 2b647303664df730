"""fold-constants: values computed only from constants and static shapes become initializers.

match
    Nodes of the standard domain whose every input is a constant (an initializer that is not
    a graph input, or the output of another such node), and Shape nodes of a tensor whose
    shape is static.
condition
    - the op is deterministic and holds no subgraph (no Random*, Multinomial, If, Loop, Scan);
      no sequence or optional values; not DequantizeLinear (onnxruntime keeps it for its
      quantized-op fusions);
    - each result has at most FOLD_ELEMENTS elements, or no more than the node's constant
      inputs: a broadcast of a small constant to a large tensor stays a node (onnxruntime folds
      it when it loads the model, and no region takes it: onnxfuse.regions.constant_only);
    - no output is a graph output or read from inside an If/Loop/Scan body.
rewrite
    The nodes run once in onnxruntime (Context.evaluate, the ort layer) with its optimizations
    off: the CPU kernels onnxruntime's own constant folding runs, so each value is bit for bit
    what onnxruntime alone would have made of it. Readers read initializers of the same names
    (equal values share one); the nodes go.

Why before fusing: onnxruntime folds such values itself at load time, but only while they are
standard nodes. Inside a Pointwise region (T5's relative-position buckets: a Log of a
constant range) they were computed again on every run, 8 kernels more than onnxruntime
alone.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import SparseValues

from onnxfuse.graph import core as gu
from onnxfuse.pipeline import Context, Pass

FOLD_ELEMENTS = 1 << 16
_NOT_FOLDED = frozenset({
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
    "If", "Loop", "Scan", "Constant", "DequantizeLinear",
})


def _elements(shape) -> int:
    return int(np.prod([int(d) for d in shape], dtype=np.int64))


def budget(n: gs.Node) -> int:
    """The most elements an output of `n` may have to be folded."""
    return max(FOLD_ELEMENTS, sum(_elements(t.shape) for t in n.inputs if isinstance(t, gs.Constant) and gu.is_present(t)))


def foldable_nodes(graph: gs.Graph) -> tuple[list[gs.Node], dict[str, np.ndarray]]:
    """(nodes to evaluate, in graph order; values known without evaluating: Shapes of static
    tensors). The graph must be topologically sorted."""
    top = {id(n) for n in graph.nodes}
    graph_io = {t.name for t in graph.inputs} | {t.name for t in graph.outputs}
    known: set[str] = set()
    shapes: dict[str, np.ndarray] = {}
    nodes: list[gs.Node] = []

    def is_known(t: gs.Tensor) -> bool:
        if not gu.is_present(t):
            return True
        if isinstance(t, gs.Constant):
            return t.name not in graph_io and not isinstance(t._values, SparseValues)
        return t.name in known

    for n in graph.nodes:
        if not gu.is_default_domain(n) or n.op in _NOT_FOLDED or n.op.startswith(("Sequence", "Optional")):
            continue
        if any(isinstance(v, gs.Graph) for v in n.attrs.values()) or not n.outputs:
            continue
        outs = [t for t in n.outputs if gu.is_present(t)]
        if any(t.name in graph_io or any(id(r) not in top for r in t.outputs) for t in outs):
            continue
        if n.op == "Shape" and len(n.inputs) == 1 and gu.static_shape(n.inputs[0]) is not None:
            dims = np.array(gu.static_shape(n.inputs[0]), np.int64)
            start, end = int(n.attrs.get("start", 0)), n.attrs.get("end")
            shapes[outs[0].name] = dims[start:None if end is None else int(end)].copy()
            known.add(outs[0].name)
            continue
        if not n.inputs or not all(is_known(t) for t in n.inputs):
            continue
        # Shapes the graph does not record (an Expand to a computed shape, before shape
        # inference sees the constant) are checked once the values are known (run).
        if any(s is not None and _elements(s) > budget(n) for s in (gu.static_shape(t) for t in outs)):
            continue
        nodes.append(n)
        known.update(t.name for t in outs)
    return nodes, shapes


def evaluate(graph: gs.Graph, ctx: Context, nodes: list[gs.Node], given: dict[str, np.ndarray],
             wanted: list[gs.Tensor]) -> dict[str, np.ndarray] | None:
    """The values of `wanted`, computed by running `nodes` in onnxruntime (ctx.evaluate: CPU,
    optimizations off); None when onnxruntime cannot run them."""
    from onnx import helper
    from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, dtype_to_onnx

    if not wanted:
        return {}
    produced = {t.name for n in nodes for t in n.outputs}
    inits, seen = [], set()
    for n in nodes:
        for t in n.inputs:
            if not gu.is_present(t) or t.name in produced or t.name in seen:
                continue
            seen.add(t.name)
            if t.name in given:
                inits.append(onnx.numpy_helper.from_array(given[t.name], t.name))
            else:
                inits.append(OnnxExporter.export_tensor_proto(t))
    outputs = [helper.make_empty_tensor_value_info(t.name) if t.dtype is None
               else helper.make_tensor_value_info(t.name, dtype_to_onnx(t.dtype), None) for t in wanted]
    g = helper.make_graph([OnnxExporter.export_node(n) for n in nodes], "fold", [], outputs, inits)
    opsets = [helper.make_opsetid("", graph.opset)]
    model = helper.make_model(g, opset_imports=opsets)
    model.ir_version = 8
    try:
        values = ctx.evaluate(model)
    except Exception:  # noqa: BLE001 - onnxruntime raises its own types; nothing is folded then
        return None
    return {t.name: np.asarray(v) for t, v in zip(wanted, values)}


def run(graph: gs.Graph, ctx: Context) -> int:
    if ctx.evaluate is None:
        return 0
    gu.toposort(graph)
    nodes, shapes = foldable_nodes(graph)
    if not nodes and not shapes:
        return 0
    folded = {t.name for n in nodes for t in n.outputs} | set(shapes)
    folding = {id(n) for n in nodes}
    # What the rest of the graph reads: outputs of folded nodes with a reader that stays.
    wanted: dict[str, gs.Tensor] = {}
    shape_readers = []
    for n in graph.nodes:
        if id(n) in folding:
            continue
        for t in n.inputs:
            if gu.is_present(t) and t.name in folded and not isinstance(t, gs.Constant):
                if t.name in shapes:
                    shape_readers.append(t)
                else:
                    wanted[t.name] = t
    values = evaluate(graph, ctx, nodes, shapes, list(wanted.values()))
    if values is None:
        return 0
    values.update({t.name: shapes[t.name] for t in shape_readers})
    count = 0
    # Equal values share one initializer: onnxruntime merges nodes with the same inputs (common
    # subexpression elimination), and equal ConstantOfShape nodes had made such inputs the same
    # value (two Convs of inception_v1 read weights built that way).
    shared: dict[tuple, gs.Constant] = {}
    for name, value in values.items():
        t = wanted.get(name) or next(x for x in shape_readers if x.name == name)
        producer = gu.producer(t)
        if value.dtype.kind not in "biuf" or (name in wanted and value.size > budget(producer)):
            continue
        key = (value.dtype.str, value.shape, value.tobytes())
        const = shared.setdefault(key, gs.Constant(name, value))
        count += gu.replace_uses(t, const) > 0
        if producer is not None and not any(o.outputs for o in producer.outputs):
            gu.disconnect(producer)
    return count


PASS = Pass(
    name="fold-constants",
    order=90,
    summary="evaluate what depends only on constants and static shapes once, as onnxruntime would at load",
    run=run,
)
