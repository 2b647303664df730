"""A Gemm between a Reshape that flattens its input and one that restores the leading dims
becomes one MatMul on the unflattened tensor.

gemm-as-matmul
    match:     Reshape(Gemm(Reshape(x, [-1, K]), W (, C)), target) -> y: what both torch.onnx
               exporters write for a projection of a [..., K] activation (Hugging Face's
               Conv1D, `addmm` of a 2-D view: GPT-2), every intermediate read inside the match
               only.
    condition: x of rank >= 3 with its last dim K (static K, or symbolic: the original then
               fails unless it is K, as the MatMul does), or with static trailing dims that
               multiply to K, at least two leading dims and x a Transpose's output (torch's
               MultiheadAttention flattens its permuted [S, B, H, dh] attention output); the flattening target [-1, K] or
               [-1, x's last dim] (a constant, or a shape tensor evaluated symbolically); W a
               constant [K, N] (transB = 0) or [N, K] (transB = 1); transA = 0, alpha = 1; C
               absent, or a constant of N elements (rank <= 2, every dim but the last 1) with
               beta = 1; the restoring target proved (symbolically, as shape-plumbing evaluates
               shape tensors, on dims refined with shape_values.refined_dims) equal to x's
               leading dims followed by N, one entry -1 allowed (Reshape infers it to be that dim),
               and an entry 0 where the Gemm's output dim it copies is that dim (the rows M at
               position 0 when the other leading dims are 1: a decode step's [0, 1, N]).
               On --target cuda only without C (cuBLAS adds Gemm's bias in its epilogue).
    rewrite:   y = MatMul(x, W) (W transposed once, as a new constant, for transB = 1), plus
               Add(., C as [N]) when C is present; x merged trailing dims go through
               Reshape(x, [0, .., 0, K]) first (one kernel instead of two Reshapes).
Why: onnxruntime runs the two Reshapes as kernels of their own (GPT-2: 8 projections, 16
Reshape kernels; bench/results/gemm_as_matmul.md), and a 3-D MatMul by a 2-D weight is one
GEMM over the flattened rows in onnxruntime as well. A bias Add then left over is taken by what reads it: a Pointwise region
with the residual Add, onnxruntime's FastGelu/BiasGelu, or a contrib op's bias input.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import facts, rules
from onnxfuse.graph.rules import ANY, Match, Rule, Var, op
from onnxfuse.graph.shape_values import ShapeEvaluator, element_count, refined_dims
from onnxfuse.pipeline import Context, Pass

x, w, c = Var("x"), Var("w"), Var("c")
_PLAIN = {"transA": lambda v: v in (None, 0), "alpha": lambda v: v is None or float(v) == 1.0}
FLAT_GEMM = op.Reshape(op.Gemm(op.Reshape(x, ANY, _name="flatten"), w, _name="gemm", **_PLAIN), ANY)
FLAT_GEMM_BIAS = op.Reshape(op.Gemm(op.Reshape(x, ANY, _name="flatten"), w, c, _name="gemm", **_PLAIN,
                                    beta=lambda v: v is None or float(v) == 1.0), ANY)


def _weight(m: Match) -> np.ndarray | None:
    """W as [K, N] (transposed for transB = 1), or None when W is no 2-D float constant."""
    if not gu.is_constant(m["w"]):
        return None
    value = gu.constant_value(m["w"])
    if value is None or value.ndim != 2 or value.dtype != np.float32:
        return None
    return value.T if int(gu.attr(m["gemm"], "transB", 0)) else value


def _bias(m: Match, width: int) -> np.ndarray | None:
    """C as [N]; None when it is not a constant of N elements varying along the last axis."""
    if not gu.is_constant(m["c"]):
        return None
    value = gu.constant_value(m["c"])
    if value is None or value.dtype != np.float32 or not 1 <= value.ndim <= 2:
        return None
    if value.shape[-1] != width or any(d != 1 for d in value.shape[:-1]):
        return None
    return value.reshape(width)


def _merged_dims(xd: list, k: int) -> int | None:
    """How many trailing dims of x the flattening merges into K: 1 when the last dim is K (or
    symbolic: the original then fails unless it is K), more when static trailing dims multiply
    to K (torch's MultiheadAttention flattens [S, B, H, dh] to [S*B, H*dh]); at least two
    leading dims must stay. None otherwise."""
    if not isinstance(xd[-1], int) or xd[-1] == k:
        return 1 if len(xd) >= 3 else None
    product = 1
    for j in range(1, len(xd) - 1):
        if not isinstance(xd[-j], int):
            return None
        product *= xd[-j]
        if product == k:
            return j if len(xd) - j >= 2 else None
        if product > k:
            return None
    return None


def _unflattens(graph: gs.Graph, m: Match, k: int, n: int, shapes: facts.ShapeTable) -> int | None:
    """How many trailing dims of x the Reshapes merge into K (see _merged_dims) when they only
    flatten x's leading dims and restore them: the first target [-1, K] or [-1, x's last dim],
    the second proved equal to x's leading dims and N; None otherwise."""
    flatten, restore = m["flatten"], m.root
    xd = shapes.dims(m["x"])
    j = _merged_dims(xd, k) if xd else None
    if j is None or (j > 1 and not gu.is_op(gu.producer(m["x"]), "Transpose")):
        # Other producers may yet give the merged shape itself (a head merge that
        # merge-reshapes folds, as in GPT-2's dynamo export); a Transpose's output never does.
        return None
    ev = ShapeEvaluator(graph, shapes)
    first, target, leading = ev.value(flatten.inputs[1]), ev.value(restore.inputs[1]), ev.dim_symbols(m["x"])
    if first is None or target is None or leading is None or first.rank != 1 or target.rank != 1:
        return None
    # [-1, K], or [-1, x's last dim] (the TorchScript exporter's x.view(-1, x.size(-1)))
    if len(first.elems) != 2 or first.elems[0] != (-1, ()):
        return None
    if first.elems[1] != (k, ()) and not (j == 1 and first.elems[1] == leading[-1]):
        return None
    # Each entry x's dim (N last), or one -1, which Reshape then infers to be that dim, or a 0
    # that copies the Gemm's output dim [M, N] at its position (allowzero 0) where that is the
    # dim: M, the product of x's leading dims, at position 0 (the others 1).
    want = list(leading[:-j]) + [(n, ())]
    if len(target.elems) != len(want) or any(e is None for e in target.elems):
        return None
    if sum(e == (-1, ()) for e in target.elems) > 1:
        return None
    copied = [element_count(list(leading[:-j])), (n, ())] if not int(gu.attr(restore, "allowzero", 0)) else []
    if not all(e == v or e == (-1, ()) or (e == (0, ()) and i < len(copied) and copied[i] == v)
               for i, (e, v) in enumerate(zip(target.elems, want))):
        return None
    return j


def gemm_as_matmul(graph: gs.Graph, ctx: Context) -> int:
    if not any(gu.is_op(n, "Gemm") for n in graph.nodes):
        return 0
    facts.refresh_shapes(graph)
    # Refined with the facts inference misses (a Range's length, a folded expand target): the
    # batch of an attention output whose scores got a mask built from them stays the batch.
    shapes, _ = refined_dims(graph, facts.ShapeTable(graph))
    flat = [Rule("gemm-as-matmul", FLAT_GEMM, condition=lambda m, g: _unflattened(g, m, shapes, False),
                 rewrite=_write_matmul)]
    if not ctx.target.gemm_bias_in_epilogue:
        flat.append(Rule("gemm-as-matmul/bias", FLAT_GEMM_BIAS, condition=lambda m, g: _unflattened(g, m, shapes, True),
                         rewrite=_write_matmul))
    done = rules.apply(graph, flat, ctx.explainer)
    if done:
        gu.cleanup(graph)
    return done


def _unflattened(graph: gs.Graph, m: Match, shapes: facts.ShapeTable, with_bias: bool):
    """Binds weight, bias, merged (dims of x merged into K) and rank when the Reshapes only
    flatten x's leading dims and restore them around a Gemm by a constant weight."""
    weight = _weight(m)
    if weight is None:
        return rules.fail("the Gemm's weight is not a 2-D float32 constant")
    k, n = weight.shape
    bias = _bias(m, n) if with_bias else None
    if with_bias and bias is None:
        return rules.fail(f"the Gemm's C is not a constant of {n} elements along the last axis")
    merged = _unflattens(graph, m, k, n, shapes)
    if merged is None:
        return rules.fail("the Reshapes do not just flatten x's leading dims and restore them")
    m.bindings.update(weight=weight, bias=bias, merged=merged, rank=len(shapes.dims(m["x"])))
    return True


def _write_matmul(graph: gs.Graph, m: Match) -> bool:
    _rewrite(graph, m, m["weight"], m["bias"], m["merged"], m["rank"])
    return True


def _rewrite(graph: gs.Graph, m: Match, weight: np.ndarray, bias: np.ndarray | None, merged: int,
             rank: int) -> None:
    gemm, restore = m["gemm"], m.root
    y = restore.outputs[0]
    w_in = m["w"]
    if int(gu.attr(gemm, "transB", 0)):
        w_in = gu.make_constant(graph, f"{w_in.name}_t", np.ascontiguousarray(weight))
    at = next(i for i, n in enumerate(graph.nodes) if n is restore)  # the new nodes keep its place
    gu.disconnect(restore)
    new, x = [], m["x"]
    if merged > 1:
        # [..., a, b] -> [..., K]: 0 keeps each leading dim
        target = gu.make_constant(graph, f"{x.name}_merged_shape", np.array([0] * (rank - merged) + [weight.shape[0]], np.int64))
        x3 = gs.Variable(gu.unique_name(graph, f"{x.name}_merged"), dtype=np.float32)
        new.append(gs.Node("Reshape", name=f"{gemm.name}_merge", inputs=[x, target], outputs=[x3]))
        x = x3
    if bias is None:
        new.append(gs.Node("MatMul", name=gemm.name, inputs=[x, w_in], outputs=[y]))
    else:
        product = gs.Variable(gu.unique_name(graph, f"{y.name}_matmul"), dtype=np.float32)
        b = gu.make_constant(graph, f"{m['c'].name}_row", bias)
        new += [gs.Node("MatMul", name=gemm.name, inputs=[x, w_in], outputs=[product]),
                gs.Node("Add", name=f"{gemm.name}_bias", inputs=[product, b], outputs=[y])]
    graph.nodes[at:at] = new


PASS = Pass(
    "gemm-as-matmul",
    205,
    "Reshape -> Gemm -> Reshape back (a projection of a flattened activation) as one MatMul on the unflattened tensor",
    gemm_as_matmul,
)
