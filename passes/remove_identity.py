"""Identity and inference-mode Dropout removal.

remove-identity
    match:     Identity(x) -> y
    condition: y can be renamed away; when y is a graph output, x's producer can be made to
               write y instead (x is no graph input, initializer or other graph output)
    rewrite:   readers of y read x (or x's producer writes y)

remove-dropout
    match:     Dropout(x, [ratio], [training_mode]) -> y, [mask]
    condition: inference mode (training_mode absent or constant false; is_test=1 before opset 7),
               the mask output unused
    rewrite:   as Identity

cast-round-trip-outer-scope
    match:     Cast(Cast(x, to=U), to=T) -> y, x of type T with no producer (a graph input or
               an initializer), U a type that holds every value of T (T -> U -> T is exact)
    condition: y is read by a subgraph (If, Loop, Scan) from the outer scope, and is no graph output
    rewrite:   readers of y read x
    why:       onnxruntime (1.32, every optimization level) removes such a pair itself and, when x
               has no producer, rewires y's readers without renaming y inside their subgraphs: the
               subgraph then fails with "Missing Input: y". A pass that drops a no-op node before
               the first Cast (a full-range Slice, an Identity) would otherwise write this form;
               it runs before pointwise fusion, whose inlined fallback would hold the pair.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import rules
from onnxfuse.graph.rules import ANY, Match, Rule, Var, fail, op
from onnxfuse.pipeline import Context, Pass

x = Var("x")


def _bypass(graph: gs.Graph, m: Match):
    return gu.bypass(graph, m.root) or fail("its output is read (the mask, or a graph output whose input"
                                            " cannot take its name)")


def _dropout_in_inference(m: Match, graph: gs.Graph):
    node = m.root
    if (graph.opset or 1) < 7:
        # Dropout-1 and -6 run the training behaviour unless is_test is set.
        return bool(gu.attr(node, "is_test", 0)) or fail("is_test is not set (training mode before opset 7)")
    if len(node.inputs) < 3 or not gu.is_present(node.inputs[2]):
        return True
    mode = gu.constant_value(node.inputs[2])
    return (mode is not None and mode.size == 1 and not bool(mode.reshape(-1)[0])) or fail(
        "training_mode is not a constant false")


IDENTITY = Rule("remove-identity", op.Identity(x), rewrite=_bypass)
# ratio and training_mode are inputs from opset 12; the mask is a second output (bypass keeps
# the node when it is read).
DROPOUT = Rule("remove-dropout", op.Dropout(x, ANY, ANY, _outputs=None), rewrite=_bypass,
               condition=_dropout_in_inference)


# Element types by (kind, bits): a Cast from T to U and back is exact when U holds every value of T.
_KIND = {"b": "bool", "i": "int", "u": "uint", "f": "float"}


def _holds_all(src: np.dtype, dst: np.dtype) -> bool:
    """Whether every value of element type `src` is a value of `dst` (so src -> dst -> src is
    the identity): bool into anything numeric, integers into wider integers of a range that
    covers them or floats whose significand holds them, floats into wider floats."""
    a, b = _KIND.get(src.kind), _KIND.get(dst.kind)
    bits_a, bits_b = src.itemsize * 8, dst.itemsize * 8
    if a is None or b is None or src == dst:
        return False
    if a == "bool":
        return True
    if b == "float":
        significand = {16: 11, 32: 24, 64: 53}.get(bits_b, 0)
        return (a == "float" and bits_b > bits_a) or (a in ("int", "uint") and bits_a + (a == "uint") <= significand)
    if a == "float" or b == "bool":
        return False
    return bits_b > bits_a if (a == b or a == "uint") else False


def _np_type(t) -> np.dtype | None:
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t) if isinstance(t, int) else t)
    except (TypeError, ValueError, KeyError):
        return None


def _outer_scope_round_trip(local: set[int]):
    """The condition of cast-round-trip-outer-scope; `local`: ids of the top-level nodes (a
    reader outside them is a node of a subgraph)."""

    def condition(m: Match, graph: gs.Graph):
        first, second = m.nodes
        x, mid, y = m["x"], second.inputs[0], m.output
        if gu.producer(x) is not None:
            return fail(f"'{x.name}' is computed by a node (onnxruntime rewires such a pair correctly)")
        t, u, back = _np_type(x.dtype), _np_type(gu.attr(first, "to")), _np_type(gu.attr(second, "to"))
        if any(v is None for v in (t, u, back)) or back != t or not _holds_all(t, u):
            return fail(f"the round trip {t} -> {u} -> {back} is not exact")
        for v in (y, mid):
            if gu.is_graph_output(graph, v):
                return fail(f"'{v.name}' is a graph output")
        return any(id(r) not in local for r in y.outputs) or fail("no subgraph reads the result")

    return condition


def collapse_outer_scope_cast_round_trips(graph: gs.Graph, ctx: Context) -> int:
    rule = Rule("cast-round-trip-outer-scope", op.Cast(op.Cast(x)), rewrite=rules.read_instead("x"),
                condition=_outer_scope_round_trip({id(n) for n in graph.nodes}), private=False)
    return rules.apply(graph, [rule], ctx.explainer)


def remove_identity(graph: gs.Graph, ctx: Context) -> int:
    return rules.apply(graph, [IDENTITY], ctx.explainer)


def remove_dropout(graph: gs.Graph, ctx: Context) -> int:
    return rules.apply(graph, [DROPOUT], ctx.explainer)


PASSES = [
    Pass("remove-identity", 100, "drop Identity nodes (graph output names kept)", remove_identity),
    Pass("remove-dropout", 105, "drop inference-mode Dropout whose mask is unused", remove_dropout),
    Pass("cast-round-trip-outer-scope", 490,
         "an exact Cast round trip of a graph input read by a subgraph reads the input (runs in onnxruntime)",
         collapse_outer_scope_cast_round_trips),
]
