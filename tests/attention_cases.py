"""Hand-built models with one onnxfuse.Attention node (and its fallback function, the standard-op
subgraph it stands for), or the plain subgraph alone, for the CPU and GPU tests of the Attention
kernels. Batch and sequence dims are symbolic, so the kernels read them at run time."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


@dataclass(frozen=True)
class Case:
    heads: int
    dh: int
    dv: int
    batch: int
    sq: int
    sk: int
    packed: bool = False
    mask_shape: tuple[int, ...] | None = None  # None: no mask
    scale: float = 0.125
    bias: bool = False  # packed only: the projection's bias [3*H*dh] (has_bias)
    causal: int = 0  # N > 0: no mask input; the top-left [Sq, Sk] of triu(-1e9, 1) [N, N] (causal = 1)
    nan_to_zero: bool = False  # Where(IsNaN(p), 0, p) after the Softmax (the node's nan_to_zero = 1)
    heads_first: int = 0  # bit 0 q, 1 k, 2 v: that input is [B, H, S, d] (a prologue's output)

    def shape_of(self, name: str, batch, s, h, d) -> list:
        """An unpacked operand's shape: [B, S, H*d], or [B, H, S, d] when its heads_first bit is set."""
        if self.heads_first >> "qkv".index(name) & 1:
            return [batch, h, s, d]
        return [batch, s, h * d]

    @property
    def has_mask(self) -> bool:
        return self.mask_shape is not None

    def feeds(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Random inputs: q, k, v (or qkv) ~ N(0, 1), an additive mask ~ N(0, 4), a bias ~ N(0, 1)."""
        rng = np.random.default_rng(seed)
        h = self.heads
        if self.packed:
            out = {"qkv": rng.normal(size=(self.batch, self.sq, 3 * h * self.dh)).astype(np.float32)}
        else:
            out = {n: rng.normal(size=self.shape_of(n, self.batch, s, h, d)).astype(np.float32)
                   for n, s, d in (("q", self.sq, self.dh), ("k", self.sk, self.dh), ("v", self.sk, self.dv))}
        if self.has_mask:
            out["mask"] = np.asarray(rng.normal(size=self.mask_shape) * 2, np.float32)
        if self.bias:
            out["bias"] = rng.normal(size=3 * h * self.dh).astype(np.float32)
        return out

    def reference(self, feeds: dict) -> np.ndarray:
        from onnxfuse.cuda.attention_codegen import AttentionSpec
        from onnxfuse.cuda.attention_model import reference

        mask = feeds.get("mask")
        if self.causal:
            mask = np.triu(np.full((self.sq, self.sk), -np.inf), 1)
        spec = AttentionSpec(self.heads, self.dh, self.dv, self.scale, self.packed, mask is not None, self.bias,
                             self.nan_to_zero, self.heads_first)
        if self.packed:
            return reference(spec, feeds["qkv"], mask=mask, bias=feeds.get("bias"))
        return reference(spec, feeds["q"], feeds["k"], feeds["v"], mask)


def _ints(name: str, values) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64), name))


def reference_nodes(c: Case) -> tuple[list[onnx.NodeProto], list[str]]:
    """The standard-op subgraph (torch.onnx.export's multi-head attention) and its input names."""
    h, d = c.heads, c.heads * c.dh
    nodes = []
    if c.packed:
        inputs = ["qkv"]
        split_input = "qkv"
        if c.bias:
            nodes.append(helper.make_node("Add", ["qkv", "bias"], ["qkv_biased"]))
            split_input = "qkv_biased"
        nodes += [_ints("split_sizes", [d, d, d]),
                  helper.make_node("Split", [split_input, "split_sizes"], ["q", "k", "v"], axis=2)]
    else:
        inputs = ["q", "k", "v"]
    if c.has_mask:
        inputs.append("mask")
    if c.bias:
        inputs.append("bias")
    nodes += [
        _ints("qk_heads", [0, 0, h, c.dh]), _ints("v_heads", [0, 0, h, c.dv]), _ints("merged", [0, 0, h * c.dv]),
        helper.make_node("Constant", [], ["scale"], value=numpy_helper.from_array(np.array(c.scale, np.float32), "scale")),
    ]
    for name, heads, perm, out in (("q", "qk_heads", [0, 2, 1, 3], "qh"), ("k", "qk_heads", [0, 2, 3, 1], "khT"),
                                   ("v", "v_heads", [0, 2, 1, 3], "vh")):
        if c.heads_first >> "qkv".index(name) & 1:  # already [B, H, S, d]
            nodes.append(helper.make_node("Transpose", [name], [out], perm=[0, 1, 3, 2]) if name == "k"
                         else helper.make_node("Identity", [name], [out]))
        else:
            nodes += [helper.make_node("Reshape", [name, heads], [f"{name}4"]),
                      helper.make_node("Transpose", [f"{name}4"], [out], perm=perm)]
    nodes += [
        helper.make_node("MatMul", ["qh", "khT"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
    ]
    logits = "scaled"
    if c.causal:  # what fuse-attention writes for a causal mask slice
        table = np.triu(np.full((c.causal, c.causal), -1e9, np.float32), 1)[None, None]
        nodes += [
            helper.make_node("Constant", [], ["causal_table"], value=numpy_helper.from_array(table, "causal_table")),
            _ints("zeros", [0, 0]), _ints("last_two", [2, 3]), _ints("ones", [1, 1]),
            _ints("from", [2]), _ints("to", [4]), _ints("axis0", [0]),
            helper.make_node("Shape", ["scaled"], ["scores_shape"]),
            helper.make_node("Slice", ["scores_shape", "from", "to", "axis0"], ["causal_ends"]),
            helper.make_node("Slice", ["causal_table", "zeros", "causal_ends", "last_two", "ones"], ["causal_mask"]),
            helper.make_node("Add", ["scaled", "causal_mask"], ["masked"]),
        ]
        logits = "masked"
    if c.has_mask:
        nodes.append(helper.make_node("Add", ["scaled", "mask"], ["masked"]))
        logits = "masked"
    nodes.append(helper.make_node("Softmax", [logits], ["probs"], axis=-1))
    weights = "probs"
    if c.nan_to_zero:  # transformers' eager attention (BERT's and GPT-2's TorchScript exports)
        nodes += [
            helper.make_node("Constant", [], ["nan_fill"],
                             value=numpy_helper.from_array(np.array([0.0], np.float32), "nan_fill")),
            helper.make_node("IsNaN", ["probs"], ["probs_nan"]),
            helper.make_node("Where", ["probs_nan", "nan_fill", "probs"], ["weights"]),
        ]
        weights = "weights"
    nodes += [
        helper.make_node("MatMul", [weights, "vh"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "merged"], ["out"]),
    ]
    return nodes, inputs


def _value_infos(c: Case) -> tuple[list, list]:
    f = TensorProto.FLOAT
    h = c.heads
    sk = "sq" if c.packed else "sk"
    if c.packed:
        ins = [helper.make_tensor_value_info("qkv", f, ["batch", "sq", 3 * h * c.dh])]
    else:
        ins = [helper.make_tensor_value_info(n, f, c.shape_of(n, "batch", s, h, d))
               for n, s, d in (("q", "sq", c.dh), ("k", sk, c.dh), ("v", sk, c.dv))]
    if c.has_mask:
        # Symbolic dims: one model serves other sizes, and a wrong mask reaches the kernel's check.
        ins.append(helper.make_tensor_value_info("mask", f, [f"mask_d{i}" for i in range(len(c.mask_shape))]))
    if c.bias:
        ins.append(helper.make_tensor_value_info("bias", f, [3 * h * c.dh]))
    outs = [helper.make_tensor_value_info("out", f, ["batch", "sq", h * c.dv])]
    return ins, outs


def plain_model(c: Case) -> onnx.ModelProto:
    """The attention as standard ops only (what onnxruntime runs without onnxfuse)."""
    nodes, _ = reference_nodes(c)
    ins, outs = _value_infos(c)
    graph = helper.make_graph(nodes, "attention", ins, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)


def fused_model(c: Case) -> onnx.ModelProto:
    """One onnxfuse.Attention node whose fallback function is the plain subgraph."""
    body, inputs = reference_nodes(c)
    fn = helper.make_function("onnxfuse", "Attention", inputs=inputs, outputs=["out"], nodes=body,
                              opset_imports=[helper.make_opsetid("", OPSET)])
    fn.overload = "Attention_0"
    node = helper.make_node("Attention", inputs, ["out"], name="attention", domain="onnxfuse",
                            num_heads=c.heads, scale=float(c.scale), has_mask=int(c.has_mask),
                            qkv_packed=int(c.packed), **({"has_bias": 1} if c.bias else {}),
                            **({"nan_to_zero": 1} if c.nan_to_zero else {}),
                            **({"heads_first": c.heads_first} if c.heads_first else {}),
                            **({"causal": 1, "causal_max_queries": c.causal, "causal_max_keys": c.causal}
                               if c.causal else {}))
    node.overload = "Attention_0"
    ins, outs = _value_infos(c)
    graph = helper.make_graph([node], "attention", ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("onnxfuse", 1)],
                              ir_version=10, functions=[fn])
    return model


# Shapes the tests run: packed and unpacked, masks of every rank and broadcast pattern, Sq != Sk,
# dh in {32, 64, 80}, dv != dh, several key tiles, batch > 1, the packed projection's bias.
CASES = [
    Case(4, 32, 32, 1, 32, 32, packed=True, mask_shape=(1, 1, 32, 32)),  # gpt_stack's block
    Case(4, 32, 32, 3, 45, 45, packed=True, mask_shape=(45, 45)),
    Case(2, 64, 64, 2, 7, 70, mask_shape=(2, 1, 7, 70)),
    Case(2, 80, 80, 2, 9, 33, mask_shape=(2, 2, 1, 33)),
    Case(3, 80, 48, 1, 5, 100),
    Case(1, 64, 96, 2, 17, 3, mask_shape=(3,)),
    Case(2, 32, 32, 2, 6, 6, packed=True),
    Case(4, 64, 64, 1, 1, 65, mask_shape=()),
    Case(2, 32, 64, 3, 13, 40, mask_shape=(3, 2, 13, 40)),
    Case(2, 80, 80, 1, 64, 64, packed=True, mask_shape=(1, 64, 64)),
    Case(4, 32, 32, 2, 32, 32, packed=True, mask_shape=(1, 1, 32, 32), bias=True),  # gpt_stack's, bias folded
    Case(3, 24, 24, 2, 37, 37, packed=True, bias=True),
]

# The causal mode (CPU kernel only): gpt_stack's block, separate q, k, v with Sq != Sk, odd sizes.
CAUSAL_CASES = [
    Case(4, 32, 32, 2, 32, 32, packed=True, bias=True, causal=64),  # gpt_stack's, as optimized
    Case(4, 32, 32, 1, 64, 64, packed=True, bias=True, causal=64),
    Case(2, 64, 48, 2, 9, 33, causal=40),
    Case(3, 20, 20, 2, 37, 11, causal=40),
    Case(1, 8, 8, 3, 1, 1, packed=True, causal=2),
]


# nan_to_zero (both kernels): BERT's TorchScript block (packed qkv, bias, padding mask [B, 1, 1, S]),
# GPT-2's (causal + padding mask [B, 1, S, S] as a mask input), separate q, k, v with Sk over
# several key tiles, odd head sizes.
NAN_TO_ZERO_CASES = [
    Case(2, 32, 32, 3, 11, 11, packed=True, mask_shape=(3, 1, 1, 11), bias=True, nan_to_zero=True),
    Case(4, 32, 32, 2, 32, 32, packed=True, mask_shape=(2, 1, 32, 32), bias=True, nan_to_zero=True),
    Case(2, 64, 48, 3, 9, 70, mask_shape=(3, 1, 9, 70), nan_to_zero=True),
    Case(3, 20, 7, 2, 5, 33, mask_shape=(2, 3, 5, 33), nan_to_zero=True),
]


# heads_first (both kernels): q and k rotated by a prologue after the head split with v a head split
# (Phi-3: 3), all three [B, H, S, d] (GPT-NeoX's per-head projection: 7), a decode step (one query,
# keys and values Concat(past, new): 6 or 7), q alone (1), odd head sizes, several key tiles.
HEADS_FIRST_CASES = [
    Case(2, 32, 32, 2, 9, 9, mask_shape=(2, 1, 1, 9), nan_to_zero=True, heads_first=3),
    Case(4, 16, 16, 3, 17, 17, mask_shape=(3, 1, 1, 17), nan_to_zero=True, heads_first=7),
    Case(2, 64, 64, 2, 1, 70, mask_shape=(2, 1, 1, 70), heads_first=7),
    Case(3, 24, 40, 1, 1, 33, mask_shape=(1, 1, 1, 33), heads_first=6),
    Case(2, 20, 12, 2, 11, 5, heads_first=1),
    Case(2, 96, 96, 1, 5, 40, mask_shape=(5, 40), heads_first=4),
]


def padding_masked(c: Case, feeds: dict, seed: int = 0) -> dict:
    """feeds with a 0 / -inf mask: about 30 % of the keys masked at random, every key of batch 0
    masked (its rows' probabilities are NaN: the guard makes them 0), and in the other batches
    query row 1's every key masked too (a fully masked row next to rows that are not)."""
    rng = np.random.default_rng(seed)
    mask = np.where(rng.random(c.mask_shape) < 0.3, -np.inf, 0.0).astype(np.float32)
    mask[..., 0] = 0.0
    mask[0] = -np.inf
    if c.mask_shape[-2] > 1:
        mask[..., 1, :] = -np.inf
    return {**feeds, "mask": mask}


def case_id(c: Case) -> str:
    mask = "nomask" if c.mask_shape is None else "mask" + "x".join(map(str, c.mask_shape)) if c.mask_shape else "mask0d"
    if c.causal:
        mask = f"causal{c.causal}"
    guard = ("-nan_to_zero" if c.nan_to_zero else "") + (f"-first{c.heads_first}" if c.heads_first else "")
    return f"{'packed' if c.packed else 'qkv'}{'-bias' if c.bias else ''}{guard}-h{c.heads}-dh{c.dh}-dv{c.dv}-b{c.batch}-sq{c.sq}-sk{c.sk}-{mask}"
