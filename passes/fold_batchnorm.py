"""Fold inference BatchNormalization, and per-channel Mul / Add constants, into the Conv before them.

    Conv(X, W, b) -> BatchNormalization(scale, B, mean, var, eps)
        =>  Conv(X, W * s[k], (b - mean) * s + B)        s = scale / sqrt(var + eps)
    Conv(X, W, b) -> Mul(c[k])   =>  Conv(X, W * c[k], b * c[k])
    Conv(X, W, b) -> Add(c[k])   =>  Conv(X, W, b + c[k])

The result is plain ONNX on every target: onnxruntime's own Conv fusions (and our ConvBiasAct on
cuda, which runs after this pass) then see one Conv with a bias followed by its activation.

Condition: the Conv output has that one reader and is not a graph output; W, the bias and the
folded parameters are constants. "Constant" includes what a loader would fold anyway: outputs of
Constant and ConstantOfShape nodes and Identity / Unsqueeze / Squeeze / Reshape of constants (the
onnx "light" zoo models store every weight as a ConstantOfShape fill). A folded tensor that is
still one repeated value is written back as a ConstantOfShape of the new value, so the model does
not grow by the size of the weights it folded.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.graph import core as gu
from onnxfuse.graph import rules
from onnxfuse.graph.linear import write_output_of
from onnxfuse.graph.rules import Match, Rest, Rule, Var, fail, op
from onnxfuse.pipeline import Context, Pass

# Shape-only ops whose constant inputs are folded when resolving a weight's value.
_MAX_RESOLVE_ELEMENTS = 1 << 26
# A folded fill this large or larger is written back as ConstantOfShape instead of an initializer.
_COMPACT_FILL_ELEMENTS = 64


def resolve_constant(tensor: gs.Tensor | None) -> np.ndarray | None:
    """The value of `tensor` if it is an initializer, a Constant / ConstantOfShape output, or a
    shape-only op (Identity, Unsqueeze, Squeeze, Reshape) of those; else None."""
    if not gu.is_present(tensor):
        return None
    v = gu.constant_value(tensor)
    if v is not None:
        return v
    node = gu.producer(tensor)
    if node is None or not gu.is_default_domain(node):
        return None
    if node.op == "ConstantOfShape":
        shape = gu.constant_ints(node.inputs[0])
        if shape is None or int(np.prod(shape, dtype=np.int64)) > _MAX_RESOLVE_ELEMENTS:
            return None
        value = node.attrs.get("value")
        fill = np.asarray(value.values).reshape(-1) if isinstance(value, gs.Constant) else np.zeros(1, np.float32)
        return np.full(shape, fill[0], dtype=fill.dtype)
    if node.op == "Identity":
        return resolve_constant(node.inputs[0])
    if node.op in ("Unsqueeze", "Squeeze", "Reshape"):
        data = resolve_constant(node.inputs[0])
        if data is None:
            return None
        if node.op == "Reshape":
            shape = gu.constant_ints(node.inputs[1]) if len(node.inputs) > 1 else None
            if shape is None:
                return None
            # ONNX Reshape: 0 copies the input dim (unless allowzero), -1 is inferred.
            if not node.attrs.get("allowzero", 0):
                shape = [data.shape[i] if d == 0 else d for i, d in enumerate(shape)]
            try:
                return data.reshape(shape)
            except ValueError:
                return None
        axes = node.attrs.get("axes")
        if axes is None and len(node.inputs) > 1:
            axes = gu.constant_ints(node.inputs[1])
        if node.op == "Squeeze":
            if axes is None:
                return np.squeeze(data)
            return np.squeeze(data, axis=tuple(int(a) % data.ndim for a in axes))
        if axes is None:
            return None
        rank = data.ndim + len(axes)
        out = data
        for a in sorted(int(a) % rank for a in axes):
            out = np.expand_dims(out, a)
        return out
    return None


def write_constant(graph: gs.Graph, base: str, value: np.ndarray, taken: set[str] | None = None) -> gs.Tensor:
    """A tensor holding `value`: an initializer, or a ConstantOfShape node when it is one repeated
    value (so a fill stays a fill). `taken`: the names in use (see graph.core.unique_name)."""
    value = np.ascontiguousarray(value)
    if value.size >= _COMPACT_FILL_ELEMENTS and np.all(value == value.flat[0]):
        shape = gu.make_constant(graph, f"{base}_shape", np.array(value.shape, dtype=np.int64), taken)
        out = gs.Variable(gu.unique_name(graph, base, taken), dtype=value.dtype, shape=list(value.shape))
        fill = gs.Constant(f"{out.name}_value", np.array([value.flat[0]], dtype=value.dtype))
        graph.nodes.append(
            gs.Node("ConstantOfShape", name=gu.unique_name(graph, f"{out.name}_fill", taken), attrs={"value": fill},
                    inputs=[shape], outputs=[out])
        )
        return out
    return gu.make_constant(graph, base, value, taken)


def _conv_params(conv: gs.Node) -> tuple[np.ndarray, np.ndarray] | None:
    """(W, bias) of a Conv whose weights and bias are constants; a missing bias is zeros."""
    if len(conv.inputs) < 2:
        return None
    w = resolve_constant(conv.inputs[1])
    if w is None or w.ndim < 3 or w.dtype.kind != "f":
        return None
    if len(conv.inputs) > 2 and gu.is_present(conv.inputs[2]):
        b = resolve_constant(conv.inputs[2])
        if b is None or b.shape != (w.shape[0],):
            return None
    else:
        b = np.zeros(w.shape[0], dtype=w.dtype)
    return w, b


def per_channel(value: np.ndarray | None, channels: int, rank: int) -> np.ndarray | None:
    """`value` as a [channels] vector if, broadcast against a Conv output of rank `rank`
    (N, K, spatial...), it varies at most along the channel axis and changes no output dim."""
    if value is None or value.ndim > rank:
        return None
    lead = rank - value.ndim  # value's dims align with the output's last value.ndim dims
    for axis, size in enumerate(value.shape, start=lead):
        if axis == 1:
            if size not in (1, channels):
                return None
        elif size != 1:
            return None
    return np.broadcast_to(value.reshape(-1) if value.size > 1 else value.reshape(1), (channels,))


CONV = op.Conv(Var("x"), Var("w"), Rest("bias"), _name="conv")
# The Conv's output is read by the folded op alone and is no graph output (the engine's
# private intermediates).
FOLDED = (op.BatchNormalization(CONV, Var("scale"), Var("shift"), Var("mean"), Var("var"), _outputs=None),
          op.Mul(CONV, Var("c")),
          op.Add(CONV, Var("c")))


def _folded_params(m: Match, graph: gs.Graph):
    """Binds new_w (None: unchanged), new_b and w, the Conv's weight."""
    conv, reader = m["conv"], m.root
    params = _conv_params(conv)
    if params is None:
        return fail("the Conv's weight (float, rank 3 or more) or bias is not a constant")
    w, b = params
    k = w.shape[0]
    rank = w.ndim
    # In the weights' own type, in onnxruntime's order (its Conv+BatchNormalization, Conv+Mul and
    # Conv+Add fusions): the folded Conv is then bit for bit the one onnxruntime runs for the
    # original, where folding in double differed by an ulp that a Sin of a large product
    # downstream turned into 1.6 (fuzz seed 9243255).
    hi = w.dtype.type
    if reader.op == "BatchNormalization":
        if reader.attrs.get("training_mode", 0):
            return fail("training_mode is set")
        if any(gu.is_present(t) and (t.outputs or gu.is_graph_output(graph, t)) for t in reader.outputs[1:]):
            return fail("its running mean or variance output is read")
        vals = [resolve_constant(t) for t in reader.inputs[1:5]]
        if any(v is None or v.shape != (k,) for v in vals):
            return fail(f"its parameters are not constants of [{k}]")
        scale, shift, mean, var = (v.astype(hi) for v in vals)
        s = scale / np.sqrt(var + hi(reader.attrs.get("epsilon", 1e-5)))
        new_w = w.astype(hi) * s.reshape((k,) + (1,) * (rank - 1))
        new_b = (b.astype(hi) - mean) * s + shift
    else:
        c = per_channel(resolve_constant(m["c"]), k, rank) if m["c"] is not m["conv"].outputs[0] else None
        if c is None:
            return fail(f"its other operand is not a constant that varies along the {k} channels only")
        c = c.astype(hi)
        if reader.op == "Mul":
            new_w = w.astype(hi) * c.reshape((k,) + (1,) * (rank - 1))
            new_b = b.astype(hi) * c
        else:
            new_w = None
            new_b = b.astype(hi) + c
    m.bindings.update(new_w=new_w, new_b=new_b, w_value=w)
    return True


def _fold(graph: gs.Graph, m: Match, taken: set[str]) -> bool:
    conv, reader, w = m["conv"], m.root, m["w_value"]
    out = conv.outputs[0]
    base = conv.name or "conv"
    if m["new_w"] is not None:
        old_w = conv.inputs[1]
        conv.inputs[1] = write_constant(graph, f"{base}_W_folded", m["new_w"].astype(w.dtype), taken)
        gu.release_names(graph, taken, [old_w])
    bias = write_constant(graph, f"{base}_B_folded", m["new_b"].astype(w.dtype), taken)
    dropped = [out, *reader.inputs, *reader.outputs[1:]]
    if len(conv.inputs) > 2:
        dropped.append(conv.inputs[2])
        conv.inputs[2] = bias
    else:
        conv.inputs.append(bias)
    # The Conv now writes what the folded op wrote (its name may be a graph output).
    write_output_of(conv, reader)
    gu.release_names(graph, taken, dropped)
    return True


def run(graph: gs.Graph, ctx: Context) -> int:
    if not rules.any_root(graph, [Rule("conv", CONV)]):
        return 0  # no Conv to fold into: the names in use are not collected
    folds = 0
    # Names in use are collected once and kept current (collecting them for every new tensor
    # was most of the pass's time on densenet121: 877 walks over the whole graph).
    taken = gu.taken_names(graph)
    folding = [Rule(f"fold-batchnorm/{p.op}", p, condition=_folded_params, rewrite=lambda g, m: _fold(g, m, taken))
               for p in FOLDED]
    while True:
        done = rules.apply(graph, folding, ctx.explainer)
        if not done:
            return folds
        folds += done


PASS = Pass(
    name="fold-batchnorm",
    order=300,
    summary="fold inference BatchNormalization and per-channel Mul/Add constants into the preceding Conv",
    run=run,
)
