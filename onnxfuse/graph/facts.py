"""Facts about a graph's tensors: element types, and shapes from onnx shape inference.

Inference runs on the graph as exported with its large weights described by type and shape
only (core.export_model), so asking never copies weights.
"""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxfuse.normalize import infer_light_model

from . import core as gu


# Shape inference --------------------------------------------------------------------------

# Initializers at most this large keep their values during inference (shape constants need
# theirs); larger ones are described by type and shape only, so inference stays cheap and
# far from protobuf's 2 GiB limit.
_INFER_KEEP_ELEMENTS = 4096


def _merge_dim(a, b):
    """A number over a name, a name over one onnx's inference made up (unk__N): a recorded
    made-up name must not hide what inference, given facts it could not derive, now knows."""
    for good in (lambda d: isinstance(d, int), lambda d: isinstance(d, str) and not d.startswith("unk__"),
                 lambda d: isinstance(d, str)):
        for d in (a, b):
            if good(d):
                return d
    return None


class ShapeTable:
    """Dims of every tensor of a graph: what the graph records merged with what onnx shape
    inference (with data propagation) derives. Symbolic dims are names; a name means the same
    size wherever it appears; names inference invents (unk__N) never clash with existing ones.
    A table describes the graph as it was when built: rebuild it after rewrites that change
    shapes."""

    def __init__(self, graph: gs.Graph, infer: bool = True, _annotate: dict | None = None,
                 _forget: set[str] | None = None) -> None:
        self._types: dict[str, int] = {}
        self._inferred: dict[str, list] = _infer_dims(graph, self._types, _annotate, _forget) if infer else {}
        # Tensors whose dims were given as facts (refined) or inferred again from them: there a
        # made-up name of this table's inference, which may equal a name elsewhere (a Range's
        # length is the batch dim it was given), goes over the made-up name the graph records.
        self._refreshed: set[str] = set()

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
        # What the graph records for tensors downstream of the hints is what inference knew
        # before them: left out, so that inference propagates the hints' dims.
        table = ShapeTable(graph, _annotate=annotate, _forget=downstream)
        table._refreshed = self._refreshed | downstream | set(hints)
        return table

    def dims(self, tensor: gs.Tensor) -> list[int | str | None] | None:
        own = gu.dims(tensor)
        inferred = self._inferred.get(tensor.name)
        if own is None or (inferred is not None and len(inferred) != len(own)):
            return list(inferred) if inferred is not None else None
        if inferred is None:
            return own
        if tensor.name in self._refreshed:
            return [_merge_dim(b, a) for a, b in zip(own, inferred)]
        return [_merge_dim(a, b) for a, b in zip(own, inferred)]

    def rank(self, tensor: gs.Tensor) -> int | None:
        d = self.dims(tensor)
        return None if d is None else len(d)

    def static_shape(self, tensor: gs.Tensor) -> tuple[int, ...] | None:
        d = self.dims(tensor)
        if d is None or any(not isinstance(x, int) for x in d):
            return None
        return tuple(d)


def inference_model(graph: gs.Graph, keep_elements: int = _INFER_KEEP_ELEMENTS):
    """(model, bytes left out): `graph` as shape inference is given it (see export_model)."""
    return gu.export_model(graph, keep_elements)


# Inferred tables kept per graph (keyed by the exact model handed to inference), so that
# passes that find nothing to rewrite do not pay for inference on the same graph again.
_CACHE_ATTRIBUTE = "_onnxfuse_inferred_dims"


_CACHE_SIZE = 8


def _infer_dims(graph: gs.Graph, types: dict[str, int], annotate: dict | None = None,
                forget: set[str] | None = None) -> dict[str, list]:
    import hashlib

    import onnx
    from onnx import helper

    try:
        model, _ = inference_model(graph)
    except Exception:  # a graph graphsurgeon cannot export has no inferable shapes either
        return {}
    g = model.graph
    if annotate:
        interface = {v.name for v in list(g.input) + list(g.output)} | {t.name for t in g.initializer}
        others = [vi for vi in g.value_info if vi.name not in annotate and vi.name not in (forget or ())]
        del g.value_info[:]
        g.value_info.extend(others)
        for name, (elem_type, d) in annotate.items():
            if name not in interface and elem_type:
                g.value_info.append(helper.make_tensor_value_info(name, elem_type, list(d)))
        # A graph output is annotated, or forgotten, in its own declaration (value_info never
        # holds it): a fact about it must reach what reads it, a stale name must not.
        for vi in g.output:
            tt = vi.type.tensor_type
            if vi.name in annotate and vi.type.HasField("tensor_type"):
                elem_type, d = annotate[vi.name]
                vi.CopyFrom(helper.make_tensor_value_info(vi.name, elem_type or tt.elem_type, list(d)))
            elif vi.name in (forget or ()) and vi.type.HasField("tensor_type"):
                tt.ClearField("shape")
    if model.ir_version > 10:
        model.ir_version = 10
    key = hashlib.sha256(model.SerializeToString()).digest()
    cache: dict = graph.__dict__.setdefault(_CACHE_ATTRIBUTE, {})
    if key in cache:
        cached_types, cached_table = cache[key]
        types.update(cached_types)
        return dict(cached_table)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # inference is an aid: without it passes see only the recorded shapes
        return {}
    table: dict[str, list] = {}
    found_types: dict[str, int] = {}
    for vi in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
            continue
        found_types[vi.name] = tt.elem_type
        table[vi.name] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        ]
    if len(cache) >= _CACHE_SIZE:
        del cache[next(iter(cache))]
    cache[key] = (found_types, table)
    types.update(found_types)
    return dict(table)


def elem_type(t: gs.Tensor) -> int | None:
    """ONNX element type of a tensor (graphsurgeon keeps numpy dtypes, or the ONNX code for
    types numpy lacks, such as bfloat16)."""
    dt = t.dtype
    if dt is None:
        return None
    if isinstance(dt, (int, np.integer)):
        return int(dt)
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt))
    except Exception:  # exotic dtypes (ml_dtypes) onnx cannot map back
        return None


def _vague(shape) -> bool:
    """Whether a recorded shape has dims that inference may now know: unknown ones, or the
    names onnx's inference makes up for a dim it could not compute (unk__N)."""
    return shape is not None and any(d is None or (isinstance(d, str) and d.startswith("unk__")) for d in shape)


def refresh_shapes(graph: gs.Graph) -> None:
    """Run onnx shape inference on the current graph and record dtypes/shapes that the graph
    does not know yet (tensors made by earlier passes have none), and dims it knew only
    vaguely: a Slice whose bounds an earlier pass made constant (torch's chunk of a dynamic
    batch, bounds once computed from Shape) now has its static width, which the pointwise pass
    needs; without it only a second optimize found the regions."""
    tensors = gu.tensor_map(graph)
    # Graph outputs are refined too: an output declared [?, ?] that inference now knows as
    # [N, 1] (an earlier pass removed what hid it) is that shape, and the pointwise pass reads
    # it; left vague, only a second optimize fused what reads it (fuzz seed 9335061).
    interface = {t.name for t in graph.inputs}
    vague = {name: t.shape for name, t in tensors.items()
             if isinstance(t, gs.Variable) and name not in interface and _vague(t.shape)}
    if not vague and all(t.dtype is not None and t.shape is not None
                         for t in tensors.values() if not isinstance(t, gs.Constant)):
        return  # nothing to fill in
    # An output keeps its declared shape through inference (a constraint inference merges with
    # what it derives; cleared, the tensors computed from it would lose their shapes too).
    outputs = {t.name for t in graph.outputs}
    for name in vague:
        if name not in outputs:
            tensors[name].shape = None
    try:
        # Large weights are described by type and shape: inferring on them costs their copies.
        model, left_out = inference_model(graph)
    except Exception:
        for name, shape in vague.items():
            tensors[name].shape = shape
        return
    model = infer_light_model(model, left_out) or model
    infos = {}
    for vi in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input):
        if vi.type.HasField("tensor_type"):
            infos[vi.name] = vi.type.tensor_type
    filled: list[gs.Tensor] = []
    renamed: dict[str, str | int | None] = {}
    for name, t in gu.tensor_map(graph).items():
        if isinstance(t, gs.Constant) or name not in infos:
            continue
        tt = infos[name]
        recorded = vague.get(name, t.shape)
        if recorded is not None and tt.HasField("shape") and len(tt.shape.dim) == len(recorded):
            # what this run calls a dim the graph already records for the same tensor
            for o, d in zip(recorded, tt.shape.dim):
                if _made_up(d.dim_param) and not d.HasField("dim_value") and o is not None:
                    renamed.setdefault(d.dim_param, o)
        if t.dtype is None and tt.elem_type:
            try:
                t.dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
            except Exception:
                t.dtype = tt.elem_type
        if t.shape is None and tt.HasField("shape"):
            t.shape = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param if d.dim_param else None)
                for d in tt.shape.dim
            ]
            if name not in vague:
                filled.append(t)
    # A dim inference still cannot compute keeps its old made-up name: other tensors may share
    # it (onnxruntime reads such equalities from the value_info), where a new one would not.
    # This run's made-up names are another namespace than the recorded ones: its unk__1 may be
    # a dim the graph already calls unk__0 while the graph's unk__1 is another size, and
    # onnxruntime takes one name for one size (it planned a buffer of 2 rows for 4: fuzz seed
    # 9206914). So a new tensor's made-up name that the graph already uses becomes the recorded
    # name of the same dim where a re-inferred tensor shows it, else a name used nowhere.
    for name in outputs & vague.keys():
        tt = infos.get(name)
        if tt is not None and tt.HasField("shape"):
            tensors[name].shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                   for d in tt.shape.dim]
    # An unknown dim (None) that inference names (unk__N) takes the name: it says which dims are
    # equal (an output the same size as the values it is computed from), where None says nothing
    # and left the pointwise pass unable to fuse what a second optimize fused (fuzz seed 9381154).
    named: list[tuple[gs.Tensor, int]] = []
    for name, shape in vague.items():
        new = tensors[name].shape
        if new is None or len(new) != len(shape):
            tensors[name].shape = shape
            continue
        tensors[name].shape = [o if (_vague([d]) and o is not None) or not _vague([o]) else d for o, d in zip(shape, new)]
        named += [(tensors[name], i) for i, (o, d) in enumerate(zip(shape, new)) if o is None and _made_up(d)]
    if filled or named:
        new = {id(t) for t in filled}
        used = {d for t in gu.tensor_map(graph).values() if isinstance(t, gs.Variable) and t.shape
                and id(t) not in new for i, d in enumerate(t.shape) if isinstance(d, str) and (t, i) not in named}
        fresh = (f"unk__{i}" for i in itertools.count() if f"unk__{i}" not in used)
        for t in filled:
            for d in t.shape:
                if _made_up(d) and d in used and d not in renamed:
                    renamed[d] = next(fresh)
            t.shape = [renamed.get(d, d) if _made_up(d) and d in used else d for d in t.shape]
        for t, i in named:  # this run's name, in the namespace the filled tensors now use
            d = t.shape[i]
            if d in used and d not in renamed:
                renamed[d] = next(fresh)
            t.shape = [renamed.get(d, d) if k == i and d in used else v for k, v in enumerate(t.shape)]


def _made_up(d) -> bool:
    """Whether a dim is a name onnx's shape inference made up (unk__N)."""
    return isinstance(d, str) and d.startswith("unk__")


def roots_with_shapes(graph: gs.Graph, op_type: str):
    """Each node of `op_type` (default domain) that still writes something, in the graph's order
    when the iteration starts (a rewrite may take later ones, which are then skipped), with the
    graph's ShapeTable, built when a condition first asks it: shape inference only once a
    candidate's structure matches (25,000 nodes of pointwise chains without a block paid 2.5 s)."""
    shapes = _LazyShapeTable(graph)
    for node in list(graph.nodes):
        if node.op != op_type or not node.outputs or not gu.is_default_domain(node):
            continue
        yield node, shapes


def lazy_shapes(graph: gs.Graph) -> "ShapeTable":
    """The graph's ShapeTable, built when first asked (a rule's condition): a pass pays shape
    inference only once a candidate's structure matches."""
    return _LazyShapeTable(graph)  # type: ignore[return-value]


class _LazyShapeTable:
    """A ShapeTable of `graph` made at its first use."""

    def __init__(self, graph: gs.Graph):
        self._graph, self._table = graph, None

    def __getattr__(self, name):
        if self._table is None:
            self._table = ShapeTable(self._graph)
        return getattr(self._table, name)
