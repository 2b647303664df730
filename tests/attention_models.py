"""Multi-head attention graphs as torch.onnx.export writes them, with the variants and near-misses
the fuse-attention tests need, and a numpy reference of onnxfuse.Attention's contract."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HEADS_PERM = [0, 2, 1, 3]


def attention_model(
    packed=True,
    heads=2,
    dh=8,
    dv=None,
    scale="div",
    scale_value=4.0,
    mask=(1, 1, "S", "S"),
    mask_const=None,
    causal=None,
    k_form="single",
    merge="shape",
    softmax_axis=-1,
    q_perm=HEADS_PERM,
    extra_output=None,
    qkv_bias=None,
    opset=17,
    seed=0,
):
    """y = attention over `heads` heads.

    packed:   x [B, S, H*dh] -> MatMul(x, W [H*dh, 3*H*dh]) -> Split(axis 2) -> q, k, v
              (the GPT block); else q [B, Sq, H*dh], k [B, Sk, H*dh], v [B, Sk, H*dv] inputs
    scale:    "div" (scores / c), "mul" (c * scores), "mul_q" (q heads * c), "none",
              "input" (scores / a graph input: not a constant)
    mask:     shape of the additive mask input (None: no mask); mask_const: its value as a
              constant instead
    causal:   the mask as torch exports `self.mask[:, :, :T, :T]`: Slice(table, starts [0, 0],
              ends read at run time (Shape -> Gather -> Unsqueeze -> Concat), axes [2, 3], steps
              [1, 1]); a dict with "size" N (table triu(-1e9, 1) of [1, 1, N, N]) or "table" (the
              constant), and overrides "starts", "axes", "steps", "ends_from" (the (tensor, axis)
              pairs the ends are read from: by default x's axis 1 twice when packed, q's and k's
              axis 1 otherwise)
    k_form:   "single" Transpose(0, 2, 3, 1) or "double" Transpose(0, 2, 1, 3) + (0, 1, 3, 2)
    merge:    "shape" (target Shape(x), packed only, or Shape(q) when dh == dv), "const"
              ([0, 0, H*dv])
    extra_output: name of an intermediate also made a graph output
    qkv_bias: packed only, the projection's bias Add before the Split: "last" Add(x W, b [3D]),
              "first" Add(b, x W), "rank3" b [1, 1, 3D], "scalar" b [1], "input" b a graph
              input [3D] (not a constant); the Add's output is "qkv", the MatMul's "qkv_mm"
    """
    dv = dh if dv is None else dv
    rng = np.random.default_rng(seed)
    D, Dv = heads * dh, heads * dv
    nodes, inits, inputs = [], [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    if packed:
        assert dv == dh
        inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", D]))
        const("w_qkv", (rng.standard_normal((D, 3 * D)) / np.sqrt(D)).astype(np.float32))
        if qkv_bias is None:
            nodes.append(helper.make_node("MatMul", ["x", "w_qkv"], ["qkv"], name="qkv_proj"))
        else:
            nodes.append(helper.make_node("MatMul", ["x", "w_qkv"], ["qkv_mm"], name="qkv_proj"))
            b = rng.standard_normal(3 * D).astype(np.float32)
            if qkv_bias == "input":
                inputs.append(helper.make_tensor_value_info("qkv_bias", TensorProto.FLOAT, [3 * D]))
            else:
                shape = {"last": (3 * D,), "first": (3 * D,), "rank3": (1, 1, 3 * D), "scalar": (1,)}[qkv_bias]
                const("qkv_bias", b[: int(np.prod(shape))].reshape(shape))
            operands = ["qkv_bias", "qkv_mm"] if qkv_bias == "first" else ["qkv_mm", "qkv_bias"]
            nodes.append(helper.make_node("Add", operands, ["qkv"], name="qkv_bias_add"))
        if opset >= 13:
            nodes.append(helper.make_node("Split", ["qkv", const("split", np.array([D, D, D], np.int64))],
                                          ["q", "k", "v"], axis=2, name="split"))
        else:  # sizes are an attribute before opset 13
            nodes.append(helper.make_node("Split", ["qkv"], ["q", "k", "v"], axis=2, split=[D, D, D], name="split"))
        shape_source = "x"
    else:
        inputs += [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, ["B", "Sq", D]),
            helper.make_tensor_value_info("k", TensorProto.FLOAT, ["B", "Sk", D]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, ["B", "Sk", Dv]),
        ]
        shape_source = "q"
    const("heads_qk", np.array([0, 0, heads, dh], np.int64))
    const("heads_v", np.array([0, 0, heads, dv], np.int64))
    nodes += [
        helper.make_node("Reshape", ["q", "heads_qk"], ["q4"], name="q_reshape"),
        helper.make_node("Reshape", ["k", "heads_qk"], ["k4"], name="k_reshape"),
        helper.make_node("Reshape", ["v", "heads_v"], ["v4"], name="v_reshape"),
        helper.make_node("Transpose", ["q4"], ["qh"], perm=list(q_perm), name="q_transpose"),
        helper.make_node("Transpose", ["v4"], ["vh"], perm=HEADS_PERM, name="v_transpose"),
    ]
    if k_form == "single":
        nodes.append(helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1], name="k_transpose"))
    else:
        nodes.append(helper.make_node("Transpose", ["k4"], ["kh"], perm=HEADS_PERM, name="k_transpose"))
        nodes.append(helper.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2], name="k_transpose_last"))
    q_in = "qh"
    c = np.array(scale_value, np.float32)
    if scale == "mul_q":
        nodes.append(helper.make_node("Mul", ["qh", const("q_scale", c)], ["qs"], name="q_scale"))
        q_in = "qs"
    nodes.append(helper.make_node("MatMul", [q_in, "kt"], ["scores"], name="qk"))
    logits = "scores"
    if scale == "div":
        nodes.append(helper.make_node("Div", ["scores", const("scale", c)], ["scaled"], name="scale"))
        logits = "scaled"
    elif scale == "mul":
        nodes.append(helper.make_node("Mul", [const("scale", c), "scores"], ["scaled"], name="scale"))
        logits = "scaled"
    elif scale == "input":
        inputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, []))
        nodes.append(helper.make_node("Div", ["scores", "c"], ["scaled"], name="scale"))
        logits = "scaled"
    if causal is not None:
        table = causal.get("table")
        if table is None:
            table = np.triu(np.full((causal["size"],) * 2, -1e9, np.float32), 1)[None, None]
        ends_from = causal.get("ends_from", [("x", 1)] * 2 if packed else [("q", 1), ("k", 1)])
        ends = []
        for n, (source, axis) in enumerate(ends_from):
            nodes += [helper.make_node("Shape", [source], [f"ends_shape{n}"], name=f"ends_shape{n}"),
                      helper.make_node("Gather", [f"ends_shape{n}", const(f"ends_axis{n}", np.array(axis, np.int64))],
                                       [f"ends_dim{n}"], axis=0, name=f"ends_gather{n}"),
                      helper.make_node("Unsqueeze", [f"ends_dim{n}", const(f"ends_unsq{n}", np.array([0], np.int64))],
                                       [f"ends_{n}"], name=f"ends_unsqueeze{n}")]
            ends.append(f"ends_{n}")
        nodes.append(helper.make_node("Concat", ends, ["causal_ends"], axis=0, name="causal_ends"))
        params = [const(f"causal_{key}", np.array(causal.get(key, default), np.int64))
                  for key, default in (("starts", [0, 0]), ("axes", [2, 3]), ("steps", [1, 1]))]
        nodes.append(helper.make_node("Slice", [const("causal_table", np.asarray(table, np.float32)), params[0],
                                                "causal_ends", params[1], params[2]], ["causal_mask"], name="causal_slice"))
        nodes.append(helper.make_node("Add", [logits, "causal_mask"], ["masked"], name="mask_add"))
        logits = "masked"
    elif mask_const is not None:
        nodes.append(helper.make_node("Add", [logits, const("mask", np.asarray(mask_const, np.float32))], ["masked"], name="mask_add"))
        logits = "masked"
    elif mask is not None:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, list(mask)))
        nodes.append(helper.make_node("Add", [logits, "mask"], ["masked"], name="mask_add"))
        logits = "masked"
    nodes += [
        helper.make_node("Softmax", [logits], ["probs"], axis=softmax_axis, name="softmax"),
        helper.make_node("MatMul", ["probs", "vh"], ["ctx"], name="pv"),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=HEADS_PERM, name="merge_transpose"),
    ]
    if merge == "shape":
        nodes.append(helper.make_node("Shape", [shape_source], ["merged_shape"], name="merge_shape"))
        target = "merged_shape"
    else:
        target = const("merged", np.array([0, 0, Dv], np.int64))
    nodes.append(helper.make_node("Reshape", ["ctx_t", target], ["y"], name="merge"))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S" if packed else "Sq", Dv])]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, [None] * 4))
    graph = helper.make_graph(nodes, "attention", inputs, outputs, inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    onnx.checker.check_model(m)
    return m


def reference(q, k, v, mask, heads, scale):
    """onnxfuse.Attention's contract in float64: out[b, s, h*dv + j]."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    b, sq, _ = q.shape
    sk = k.shape[1]
    qh = q.reshape(b, sq, heads, -1).transpose(0, 2, 1, 3)
    kh = k.reshape(b, sk, heads, -1).transpose(0, 2, 1, 3)
    vh = v.reshape(b, sk, heads, -1).transpose(0, 2, 1, 3)
    s = scale * qh @ kh.transpose(0, 1, 3, 2)
    if mask is not None:
        s = s + mask
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    return (p @ vh).transpose(0, 2, 1, 3).reshape(b, sq, -1)


def packed_inputs(model, x):
    """q, k, v of a packed attention_model for input x (its projection, bias and Split)."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    qkv = x.astype(np.float64) @ inits["w_qkv"].astype(np.float64)
    bias = [v for name, v in inits.items() if name.startswith("qkv_bias")]  # "qkv_bias_flat" once folded
    if bias:
        qkv = qkv + bias[0].astype(np.float64).reshape(-1)
    return np.split(qkv, 3, axis=2)


def rotary_attention_model(layout="per_head", heads=2, dh=8, rotary_dim=4, qk_norm=False, nan_guard=True,
                           v_first=False, seed=0):
    """Attention whose q and k pass through a prologue after the head split, as GPT-NeoX's and
    Phi-3's TorchScript exports write it: partial rotary over the first `rotary_dim` columns of
    each head (x_rot * cos + rotate_half(x_rot) * sin, rotate_half(x) = Concat(-x[.., d/2:],
    x[.., :d/2]), then Concat with the columns left), the scale split as (q * c) @ (k^T * c), an
    additive padding mask [B, 1, 1, S] and (nan_guard) Where(IsNaN(p), 0, p) after the Softmax.

    layout:  "per_head" x W -> Reshape [0, 0, H, 3*dh] -> Transpose -> last-axis Slices q, k, v
             (GPT-NeoX: the projection's columns grouped per head); "split" x W -> Split -> a head
             split each (Phi-3's packed projection)
    qk_norm: LayerNormalization over each head's dh before the rotary (q/k norms)
    v_first: v's head split also made a graph output (read outside the chain)
    cos, sin are inputs [1, 1, S, rotary_dim]."""
    rng = np.random.default_rng(seed)
    D = heads * dh
    nodes, inits = [], []
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", D]),
              helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["B", 1, 1, "S"]),
              helper.make_tensor_value_info("cos", TensorProto.FLOAT, [1, 1, "S", rotary_dim]),
              helper.make_tensor_value_info("sin", TensorProto.FLOAT, [1, 1, "S", rotary_dim])]

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    def last_slice(t, start, end, name):
        return node("Slice", [t, const(f"{name}_s", np.array([start], np.int64)), const(f"{name}_e", np.array([end], np.int64)),
                              const(f"{name}_a", np.array([3], np.int64)), const(f"{name}_st", np.array([1], np.int64))], name)

    const("w_qkv", (rng.standard_normal((D, 3 * D)) / np.sqrt(D)).astype(np.float32))
    node("MatMul", ["x", "w_qkv"], "qkv")
    if layout == "per_head":
        node("Reshape", ["qkv", const("per_head", np.array([0, 0, heads, 3 * dh], np.int64))], "qkv4")
        node("Transpose", ["qkv4"], "qkvh", perm=HEADS_PERM)
        q, k, v = (last_slice("qkvh", i * dh, (i + 1) * dh, f"{n}h") for i, n in enumerate("qkv"))
    else:
        nodes.append(helper.make_node("Split", ["qkv", const("split", np.array([D] * 3, np.int64))], ["q", "k", "v"],
                                      axis=2, name="split"))
        split = const("heads", np.array([0, 0, heads, dh], np.int64))
        q, k, v = (node("Transpose", [node("Reshape", [n, split], f"{n}4")], f"{n}h", perm=HEADS_PERM) for n in "qkv")

    def prologue(t, n):
        if qk_norm:
            t = node("LayerNormalization", [t, const(f"{n}_ln_w", (1 + 0.1 * rng.standard_normal(dh)).astype(np.float32)),
                                            const(f"{n}_ln_b", (0.1 * rng.standard_normal(dh)).astype(np.float32))],
                     f"{n}_norm", axis=-1)
        rot = last_slice(t, 0, rotary_dim, f"{n}_rot") if rotary_dim < dh else t
        half = rotary_dim // 2
        lo, hi = last_slice(rot, 0, half, f"{n}_lo"), last_slice(rot, half, 2**62, f"{n}_hi")
        rh = node("Concat", [node("Neg", [hi], f"{n}_neg"), lo], f"{n}_rh", axis=-1)
        rr = node("Add", [node("Mul", [rot, "cos"], f"{n}_cos"), node("Mul", [rh, "sin"], f"{n}_sin")], f"{n}_rr")
        if rotary_dim == dh:
            return rr
        return node("Concat", [rr, last_slice(t, rotary_dim, 2**62, f"{n}_pass")], f"{n}_rope", axis=-1)

    c = const("c", np.array(1 / np.sqrt(np.sqrt(dh)), np.float32))
    qs = node("Mul", [prologue(q, "q"), c], "q_scaled")
    kt = node("Mul", [node("Transpose", [prologue(k, "k")], "kt", perm=[0, 1, 3, 2]), c], "kt_scaled")
    logits = node("Add", [node("MatMul", [qs, kt], "scores"), "mask"], "masked")
    probs = node("Softmax", [logits], "probs", axis=-1)
    if nan_guard:
        probs = node("Where", [node("IsNaN", [probs], "isnan"), const("zero", np.array(0.0, np.float32)), probs], "guarded")
    ctx = node("Transpose", [node("MatMul", [probs, v], "ctx")], "ctx_t", perm=HEADS_PERM)
    node("Reshape", [ctx, const("merged", np.array([0, 0, D], np.int64))], "y")
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", D])]
    if v_first:
        outputs.append(helper.make_tensor_value_info(v, TensorProto.FLOAT, ["B", heads, "S", dh]))
    graph = helper.make_graph(nodes, "rotary_attention", inputs, outputs, inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.checker.check_model(m)
    return m
