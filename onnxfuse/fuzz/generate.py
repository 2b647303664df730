"""The case generator's building blocks: the op tables, the Builder that grows a random graph
step by step (_step), and control-flow nodes whose bodies read top-level values."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F16, BF16, F32, F64 = TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE
BOOL, I32, I64, I8 = TensorProto.BOOL, TensorProto.INT32, TensorProto.INT64, TensorProto.INT8
NP = {F16: np.float16, F32: np.float32, F64: np.float64, BOOL: np.bool_, I32: np.int32, I64: np.int64, I8: np.int8}

# Ops onnxruntime's CPU provider implements per float type (checked on onnxruntime 1.31).
UNARY = ["Relu", "Tanh", "Sigmoid", "Abs", "Neg", "Exp", "Sqrt", "Log", "Erf", "Softplus", "Floor",
         "Reciprocal", "Softsign", "Ceil", "Round", "Sign", "Sin", "Cos", "Atan", "Sinh", "Asinh"]
UNARY_BY_TYPE = {
    F32: UNARY,
    F64: ["Relu", "Tanh", "Sigmoid", "Abs", "Neg", "Exp", "Sqrt", "Log", "Floor", "Reciprocal", "Ceil",
          "Round", "Sign"],
    # f16 chains avoid ops that blow values past the f16 range.
    F16: ["Relu", "Tanh", "Sigmoid", "Abs", "Neg", "Erf", "Softplus", "Floor", "Ceil", "Round", "Sign"],
}
PARAM_UNARY = ["LeakyRelu", "Elu", "HardSigmoid", "HardSwish", "Selu", "Clip", "Celu", "ThresholdedRelu"]
PARAM_BY_TYPE = {
    F32: PARAM_UNARY,
    F64: ["Clip"],
    F16: ["LeakyRelu", "Elu", "HardSigmoid", "HardSwish", "Selu", "Clip"],
}
BINARY = ["Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "PRelu", "Sum", "Mean"]
BINARY_BY_TYPE = {F32: BINARY, F64: ["Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "Sum"],
                  F16: ["Add", "Sub", "Mul", "Max", "Min", "PRelu"]}
COMPARE = ["Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual"]
# Discontinuous ops: near their jump two correct implementations may disagree (see the module doc).
_STEP_UNARY = {"Floor", "Ceil", "Round", "Sign"}


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: int = F32
    # |value| <= bound for every element and no NaN/inf; None when unknown (Exp, Div, Log...).
    bound: float | None = None


@dataclass
class Builder:
    rng: np.random.Generator
    dt: int = F32  # the case's float type
    opset: int = 17
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    values: list[Value] = field(default_factory=list)
    counter: int = 0
    control_flow: bool = False
    later_motifs: bool = False  # step Gathers, shared weights, ensembles: seeds >= LATER_MOTIFS_SEED

    def fresh(self, prefix: str = "v") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def const(self, arr) -> str:
        name = self.fresh("c")
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def fconst(self, arr) -> str:
        """A constant of the case's float type."""
        return self.const(np.asarray(arr, NP[self.dt]))

    def add(self, op: str, inputs: list[str], shape, dtype=None, bound=None, **attrs) -> Value:
        out = Value(self.fresh(), tuple(int(d) for d in shape), self.dt if dtype is None else dtype, bound)
        self.nodes.append(helper.make_node(op, inputs, [out.name], name=self.fresh("n"), **attrs))
        self.values.append(out)
        return out

    def pick(self, pred=lambda v: True) -> Value | None:
        cands = [v for v in self.values if pred(v)]
        if not cands:
            return None
        # Prefer recent values so chains grow long.
        w = np.arange(1, len(cands) + 1, dtype=float) ** 2
        return cands[self.rng.choice(len(cands), p=w / w.sum())]

    def isf(self, v: Value) -> bool:
        return v.dtype == self.dt


def _broadcastable_shape(rng, shape):
    """A shape that broadcasts to `shape`: some dims set to 1, maybe fewer leading dims."""
    s = [d if rng.random() < 0.6 else 1 for d in shape]
    drop = rng.integers(0, len(s) + 1) if rng.random() < 0.3 else 0
    return tuple(s[drop:])


def _fits(small: tuple, big: tuple) -> bool:
    """True when broadcasting `small` against `big` gives `big`."""
    try:
        return tuple(np.broadcast_shapes(small, big)) == tuple(big)
    except ValueError:
        return False


def _broadcasts(s: tuple, t: tuple) -> bool:
    return _fits(s, t) or _fits(t, s)


def _bmax(*bounds):
    return None if any(b is None for b in bounds) else max(bounds)


_BOUNDED_UNARY = {"Tanh": 1.0, "Sigmoid": 1.0, "Erf": 1.0, "Softsign": 1.0, "Sin": 1.0, "Cos": 1.0, "Atan": 1.6}
_SAME_BOUND = {"Relu", "Abs", "Neg", "Floor", "Ceil", "Round", "LeakyRelu", "HardSwish", "ThresholdedRelu"}


def _unary_bound(op: str, b: float | None) -> float | None:
    if b is None:
        return None
    if op in _BOUNDED_UNARY:
        return _BOUNDED_UNARY[op]
    if op == "Sign":
        return 1.0
    if op in _SAME_BOUND:
        return b + 1.0
    return None


def _step(b: Builder) -> None:
    rng = b.rng
    if b.later_motifs:
        kind = rng.choice(
            ["unary", "param", "binary", "binary_const", "where", "cast", "intchain", "slice", "split", "concat",
             "matmul2", "conv", "gather_steps", "shared_weight", "ensemble"],
            p=[0.14, 0.10, 0.16, 0.10, 0.05, 0.06, 0.03, 0.08, 0.07, 0.05, 0.06, 0.04, 0.02, 0.02, 0.02],
        )
    else:  # the first generator's draws, unchanged, so that the seeds tests name keep their cases
        kind = rng.choice(
            ["unary", "param", "binary", "binary_const", "where", "cast", "intchain", "slice", "split", "concat",
             "matmul2", "conv"],
            p=[0.15, 0.11, 0.17, 0.11, 0.05, 0.06, 0.03, 0.09, 0.07, 0.05, 0.06, 0.05],
        )
    a = b.pick(b.isf)
    if a is None:
        return
    if kind == "unary":
        op = str(rng.choice(UNARY_BY_TYPE[b.dt]))
        b.add(op, [a.name], a.shape, bound=_unary_bound(op, a.bound))
    elif kind == "param":
        op = str(rng.choice(PARAM_BY_TYPE[b.dt]))
        if op in ("HardSwish",) and b.opset < 14 or op == "Celu" and b.opset < 12:
            op = "LeakyRelu"
        if op == "Clip":
            lo, hi = sorted(rng.uniform(-2, 2, 2))
            ins = [a.name, b.fconst(lo), b.fconst(hi)]
            bound = None if a.bound is None else 2.0
            if rng.random() < 0.3:
                ins, bound = [a.name, "", b.fconst(hi)], None
            b.add(op, ins, a.shape, bound=bound)
        elif op in ("HardSwish", "Selu"):
            b.add(op, [a.name], a.shape, bound=None if a.bound is None else a.bound * 1.1 + 2)
        elif op == "HardSigmoid":
            b.add(op, [a.name], a.shape, bound=None if a.bound is None else 1.0,
                  alpha=float(rng.uniform(0.1, 0.5)), beta=float(rng.uniform(0.2, 0.7)))
        elif op == "ThresholdedRelu":
            b.add(op, [a.name], a.shape, bound=_unary_bound(op, a.bound), alpha=float(rng.uniform(-0.5, 1.0)))
        else:
            alpha = float(rng.uniform(0.1, 1.5))
            b.add(op, [a.name], a.shape, bound=None if a.bound is None else a.bound * 1.5 + 2, alpha=alpha)
    elif kind in ("binary", "binary_const"):
        op = str(rng.choice(BINARY_BY_TYPE[b.dt]))
        other = b.pick(lambda v: b.isf(v) and _broadcasts(v.shape, a.shape)) if kind == "binary" else None
        if other is None:
            cshape = _broadcastable_shape(rng, a.shape) if rng.random() < 0.5 else ()
            val = rng.uniform(0.5, 2.0, cshape)
            if rng.random() < 0.5 and op != "Pow":
                val = -val
            if op == "Pow" and rng.random() < 0.5:
                val = np.round(val * 2)  # integer exponents: defined for negative bases
            other = Value(b.fconst(val), cshape, b.dt, 4.0)
        if op == "PRelu" and not _fits(other.shape, a.shape):
            return  # PRelu broadcasts its slope to X only (unidirectional)
        ins = [a.name, other.name] if rng.random() < 0.7 or op == "PRelu" else [other.name, a.name]
        if op in ("Sum", "Mean") and rng.random() < 0.5:
            third = b.pick(lambda v: b.isf(v) and _broadcasts(v.shape, np.broadcast_shapes(a.shape, other.shape)))
            if third is not None:
                ins.append(third.name)
                other = Value(other.name, np.broadcast_shapes(other.shape, third.shape), b.dt,
                              None if other.bound is None or third.bound is None else other.bound + third.bound)
        bound = None
        if a.bound is not None and other.bound is not None:
            bound = {"Add": a.bound + other.bound, "Sub": a.bound + other.bound, "Mul": a.bound * other.bound,
                     "Max": max(a.bound, other.bound), "Min": max(a.bound, other.bound),
                     "Sum": a.bound + other.bound, "Mean": a.bound + other.bound,
                     "PRelu": a.bound * max(1.0, other.bound)}.get(op)
        b.add(op, ins, np.broadcast_shapes(a.shape, other.shape), bound=bound)
    elif kind == "where":
        c = b.pick(lambda v: b.isf(v) and _broadcasts(v.shape, a.shape)) or a
        cmp = str(rng.choice(COMPARE if b.opset >= 12 else COMPARE[:3]))
        cond = b.add(cmp, [a.name, c.name], np.broadcast_shapes(a.shape, c.shape), dtype=BOOL)
        if rng.random() < 0.25:
            # Logic on the condition: Not, or And/Or/Xor with a second comparison.
            if rng.random() < 0.5:
                cond = b.add("Not", [cond.name], cond.shape, dtype=BOOL)
            else:
                e = b.pick(lambda v: b.isf(v) and _broadcasts(v.shape, cond.shape)) or a
                c2 = b.add("Less", [e.name, b.fconst(rng.uniform(-1, 1))], e.shape, dtype=BOOL)
                if not _broadcasts(c2.shape, cond.shape):
                    return
                cond = b.add(str(rng.choice(["And", "Or", "Xor"])), [cond.name, c2.name],
                             np.broadcast_shapes(cond.shape, c2.shape), dtype=BOOL)
        d = b.pick(lambda v: b.isf(v) and _broadcasts(v.shape, cond.shape)) or a
        shape = np.broadcast_shapes(cond.shape, c.shape, d.shape)
        b.add("Where", [cond.name, c.name, d.name], shape, bound=_bmax(c.bound, d.bound))
    elif kind == "cast":
        mids = {F32: [F16, F64, BOOL, BF16, I32, I64, I8], F64: [F32, F16, BOOL, I32, I64],
                F16: [F32, F64, BOOL, I32]}[b.dt]
        mid = int(rng.choice(mids))
        if mid in (I32, I64, I8) and (a.bound is None or a.bound > 100):
            mid = BOOL  # float -> int is undefined for NaN, inf and out-of-range values
        t = b.add("Cast", [a.name], a.shape, dtype=mid, to=mid)
        if mid == BOOL and rng.random() < 0.3:
            t = b.add("Not", [t.name], t.shape, dtype=BOOL)
        back = b.dt
        b.add("Cast", [t.name], a.shape, bound=a.bound if mid != BOOL else 1.0, to=back)
    elif kind == "intchain":
        # float -> integer -> integer ops -> float: integer values stay outside fused regions.
        if a.bound is None or a.bound > 100:
            return
        it = int(rng.choice([I32, I64]))
        x = b.add("Cast", [a.name], a.shape, dtype=it, to=it)
        for _ in range(int(rng.integers(1, 4))):
            op = str(rng.choice(["Add", "Sub", "Mul", "Div", "Max", "Min", "Abs", "Neg"]))
            if op in ("Abs", "Neg"):
                x = b.add(op, [x.name], x.shape, dtype=it)
            else:
                # Positive divisors only: integer division by zero is undefined.
                k = int(rng.integers(1, 4)) if op in ("Div", "Mul") else int(rng.integers(-3, 4))
                x = b.add(op, [x.name, b.const(np.asarray(k, NP[it]))], x.shape, dtype=it)
        b.add("Cast", [x.name], a.shape, bound=a.bound * 30 + 10, to=b.dt)
    elif kind == "slice":
        if not a.shape:
            return
        axis = int(rng.integers(0, len(a.shape)))
        dim = a.shape[axis]
        step = int(rng.choice([1, 1, 1, 2, 3, -1, -2]))
        start = int(rng.integers(-dim - 2, dim + 3)) if dim else 0
        end = int(rng.integers(-dim - 2, dim + 3)) if dim else 1
        if rng.random() < 0.15:
            end = 2**62 if step > 0 else -(2**62)
        from ..program import SliceSpec, resolve_slice

        _, _, length = resolve_slice(dim, SliceSpec(axis, start, end, step))
        shape = list(a.shape)
        shape[axis] = length
        ins = [a.name, b.const(np.array([start], np.int64)), b.const(np.array([end], np.int64)),
               b.const(np.array([axis - len(a.shape) if rng.random() < 0.3 else axis], np.int64))]
        if step != 1 or rng.random() < 0.5:
            ins.append(b.const(np.array([step], np.int64)))
        b.add("Slice", ins, shape, bound=a.bound)
    elif kind == "split":
        if not a.shape:
            return
        axis = int(rng.integers(0, len(a.shape)))
        dim = a.shape[axis]
        if dim < 2:
            return
        cut = sorted(rng.choice(np.arange(1, dim), size=min(int(rng.integers(1, 3)), dim - 1), replace=False))
        sizes = np.diff([0, *cut, dim]).astype(np.int64)
        outs = []
        for s in sizes:
            shape = list(a.shape)
            shape[axis] = int(s)
            outs.append(Value(b.fresh(), tuple(shape), b.dt, a.bound))
        attrs = {"axis": axis - len(a.shape) if rng.random() < 0.2 else axis}
        if b.opset >= 18 and len(set(sizes.tolist())) == 1 and rng.random() < 0.5:
            ins, attrs["num_outputs"] = [a.name], len(sizes)
        elif b.opset < 18 and len(set(sizes.tolist())) == 1 and rng.random() < 0.5:
            ins = [a.name]  # equal split of the axis
        else:
            ins = [a.name, b.const(sizes)]
        b.nodes.append(helper.make_node("Split", ins, [o.name for o in outs], name=b.fresh("n"), **attrs))
        b.values.extend(outs)
    elif kind == "concat":
        if not a.shape:
            return
        axis = int(rng.integers(0, len(a.shape)))
        other = b.pick(lambda v: b.isf(v) and len(v.shape) == len(a.shape)
                       and all(x == y for i, (x, y) in enumerate(zip(v.shape, a.shape)) if i != axis))
        if other is None:
            return
        shape = list(a.shape)
        shape[axis] += other.shape[axis]
        b.add("Concat", [a.name, other.name], shape, bound=_bmax(a.bound, other.bound),
              axis=axis - len(shape) if rng.random() < 0.2 else axis)
    elif kind == "matmul2":
        # onnxruntime's own MatMul+Add->Gemm rewrite fails on zero-size inputs (its reshape
        # rejects them), so zero-size tensors never reach a MatMul here.
        if not a.shape or 0 in a.shape or b.dt == F16:
            return
        k = a.shape[-1]
        for _ in range(int(rng.integers(2, 4))):
            n = int(rng.choice([1, 3, 8]))
            w = rng.standard_normal((k, n)) / np.sqrt(k)
            mm = b.add("MatMul", [a.name, b.fconst(w)], (*a.shape[:-1], n))
            if rng.random() < 0.5:
                b.add("Add", [mm.name, b.fconst(rng.standard_normal(n))], mm.shape)
    elif kind == "gather_steps":
        # An unrolled RNN's step inputs: constant-index Gathers along one axis (gather-rows-as-slices).
        if len(a.shape) < 2 or 0 in a.shape:
            return
        axis = int(rng.integers(0, len(a.shape) - 1 if rng.random() < 0.9 else len(a.shape)))
        out_shape = a.shape[:axis] + a.shape[axis + 1:]
        count = int(rng.integers(2, a.shape[axis] + 2))
        for _ in range(count):
            i = int(rng.integers(-a.shape[axis], a.shape[axis]))
            g = b.add("Gather", [a.name, b.const(np.asarray(i, rng.choice([np.int64, np.int32])))], out_shape, bound=a.bound,
                      axis=axis)
            if rng.random() < 0.7:
                b.add("Tanh" if b.dt != F16 else "Relu", [g.name], out_shape, bound=1.0)
    elif kind == "shared_weight":
        # One weight on several independent 2-D values (batch-shared-weight-matmul).
        if len(a.shape) != 2 or 0 in a.shape or b.dt == F16:
            return
        k = a.shape[-1]
        n = int(rng.choice([1, 4, 9]))
        w = b.fconst(rng.standard_normal((k, n)) / np.sqrt(k))
        bias = b.fconst(rng.standard_normal(n)) if rng.random() < 0.5 else None
        srcs = [a] + [b.add(str(rng.choice(["Relu", "Tanh", "Neg"])), [a.name], a.shape) for _ in range(int(rng.integers(2, 5)))]
        for v in srcs:
            mm = b.add("MatMul", [v.name, w], (a.shape[0], n))
            if bias is not None:
                b.add("Add", [mm.name, bias], mm.shape)
    elif kind == "ensemble":
        # K identical MLP members on one 2-D value, concatenated (batch-ensemble, StackedMLP).
        if len(a.shape) != 2 or 0 in a.shape or b.dt == F16:
            return
        k_members = int(rng.integers(2, 4))
        widths = [a.shape[1]] + [int(rng.choice([3, 8, 17])) for _ in range(int(rng.integers(2, 4)))]
        act = str(rng.choice(["Relu", "Tanh", "Sigmoid", "LeakyRelu"]))
        outs = []
        for _ in range(k_members):
            cur = a
            for layer in range(len(widths) - 1):
                w = rng.standard_normal((widths[layer], widths[layer + 1])) / np.sqrt(widths[layer])
                cur = b.add("MatMul", [cur.name, b.fconst(w)], (a.shape[0], widths[layer + 1]))
                cur = b.add("Add", [cur.name, b.fconst(rng.standard_normal(widths[layer + 1]))], cur.shape)
                if layer < len(widths) - 2:
                    cur = b.add(act, [cur.name], cur.shape)
            outs.append(cur)
        if rng.random() < 0.8:
            b.add("Concat", [o.name for o in outs], (a.shape[0], widths[-1] * k_members), axis=1)
    elif kind == "conv":
        if len(a.shape) != 4 or 0 in a.shape or min(a.shape[2:]) < 3 or b.dt != F32:
            return
        n, c, h, w_ = a.shape
        group = c if rng.random() < 0.3 else 1
        m = c if group == c else int(rng.choice([2, 4, 8]))
        kh = int(rng.choice([1, 3]))
        stride = int(rng.choice([1, 2]))
        pad = kh // 2 if rng.random() < 0.7 else 0
        wt = (rng.standard_normal((m, c // group, kh, kh)) / np.sqrt(c * kh * kh / group)).astype(np.float32)
        ins = [a.name, b.const(wt)]
        if rng.random() < 0.5:
            ins.append(b.const(rng.standard_normal(m).astype(np.float32)))
        oh = (h + 2 * pad - kh) // stride + 1
        ow = (w_ + 2 * pad - kh) // stride + 1
        y = b.add("Conv", ins, (n, m, oh, ow), group=group, kernel_shape=[kh, kh], strides=[stride, stride], pads=[pad] * 4)
        if rng.random() < 0.6:
            scale, bias = rng.uniform(0.5, 1.5, m), rng.standard_normal(m)
            mean, var = rng.standard_normal(m), rng.uniform(0.5, 2, m)
            y = b.add("BatchNormalization", [y.name] + [b.const(v.astype(np.float32)) for v in (scale, bias, mean, var)], y.shape)
        act = rng.choice(["Relu", "Sigmoid", "HardSwish", "Clip", "LeakyRelu", "none"])
        if act == "HardSwish" and b.opset < 14:
            act = "Relu"
        if act == "Clip":
            y = b.add("Clip", [y.name, b.fconst(0.0), b.fconst(6.0)], y.shape)
        elif act == "LeakyRelu":
            y = b.add("LeakyRelu", [y.name], y.shape, alpha=0.1)
        elif act != "none":
            y = b.add(str(act), [y.name], y.shape)
        if y.shape == a.shape and rng.random() < 0.5:
            y = b.add("Add", [y.name, a.name], y.shape)
            if rng.random() < 0.5:
                b.add("Relu", [y.name], y.shape)


# ----------------------------------------------------------------------------- control flow


def _body_chain(b: Builder, x: str, shape, outer: Value | None, nodes: list) -> str:
    """An elementwise chain on `x` inside a subgraph body, reading `outer` (a top-level value)."""
    rng = b.rng
    for _ in range(int(rng.integers(1, 4))):
        op = str(rng.choice(["Relu", "Tanh", "Sigmoid", "Abs", "Neg"]))
        y = b.fresh()
        nodes.append(helper.make_node(op, [x], [y], name=b.fresh("n")))
        x = y
        if outer is not None and rng.random() < 0.6:
            y = b.fresh()
            nodes.append(helper.make_node(str(rng.choice(["Add", "Mul", "Sub"])), [x, outer.name], [y], name=b.fresh("n")))
            x = y
    return x


def _vi(name: str, dtype: int, rank: int | None):
    return helper.make_tensor_value_info(name, dtype, None if rank is None else [None] * rank)


def _control_flow(b: Builder) -> None:
    """One If, Loop or Scan whose bodies read top-level values (the values stay, the bodies run)."""
    rng = b.rng
    a = b.pick(lambda v: b.isf(v) and len(v.shape) >= 1)
    if a is None:
        return
    outer = b.pick(lambda v: b.isf(v) and _fits(v.shape, a.shape))
    kind = str(rng.choice(["If", "Loop", "Scan"]))
    if kind == "Scan" and a.shape[0] == 0:
        kind = "Loop"  # onnxruntime's Scan rejects a zero-length scan axis
    if kind == "If":
        if 0 not in a.shape and rng.random() < 0.7:
            r = b.add("ReduceMax", [a.name], (), keepdims=0)
            cond = b.add("Greater", [r.name, b.fconst(rng.uniform(-0.5, 0.5))], (), dtype=BOOL)
            cond_name = cond.name
        else:
            cond_name = b.const(np.array(bool(rng.random() < 0.5)))
        branches = []
        for _ in range(2):
            nodes: list = []
            src = b.pick(lambda v: b.isf(v) and v.shape == a.shape) or a
            out = _body_chain(b, src.name, a.shape, outer, nodes)
            if out == src.name:  # a branch output must be made inside the branch
                nodes.append(helper.make_node("Identity", [src.name], [b.fresh()], name=b.fresh("n")))
                out = nodes[-1].output[0]
            branches.append(helper.make_graph(nodes, b.fresh("branch"), [], [_vi(out, b.dt, len(a.shape))]))
        y = Value(b.fresh(), a.shape, b.dt)
        b.nodes.append(helper.make_node("If", [cond_name], [y.name], name=b.fresh("n"),
                                        then_branch=branches[0], else_branch=branches[1]))
        b.values.append(y)
    elif kind == "Loop":
        trips = int(rng.choice([0, 1, 2, 3]))
        it, cin, s_in = b.fresh("iter"), b.fresh("cond"), b.fresh("state")
        nodes: list = []
        s_out = _body_chain(b, s_in, a.shape, outer, nodes)
        cout = b.fresh("cond")
        nodes.append(helper.make_node("Identity", [cin], [cout], name=b.fresh("n")))
        if s_out == s_in:
            nodes.append(helper.make_node("Identity", [s_in], [b.fresh()], name=b.fresh("n")))
            s_out = nodes[-1].output[0]
        scan_out = b.fresh()
        nodes.append(helper.make_node("Tanh", [s_out], [scan_out], name=b.fresh("n")))
        body = helper.make_graph(
            nodes, b.fresh("loop_body"),
            [helper.make_tensor_value_info(it, I64, []), helper.make_tensor_value_info(cin, BOOL, []),
             _vi(s_in, b.dt, len(a.shape))],
            [helper.make_tensor_value_info(cout, BOOL, []), _vi(s_out, b.dt, len(a.shape)),
             _vi(scan_out, b.dt, len(a.shape))],
        )
        final, stacked = Value(b.fresh(), a.shape, b.dt), Value(b.fresh(), (trips, *a.shape), b.dt)
        cond0 = b.const(np.array(True)) if rng.random() < 0.5 else ""
        b.nodes.append(helper.make_node("Loop", [b.const(np.array(trips, np.int64)), cond0, a.name],
                                        [final.name, stacked.name], name=b.fresh("n"), body=body))
        # With no iteration onnxruntime cannot know the stacked output's per-step shape: unused then.
        b.values.extend([final, stacked] if trips else [final])
    else:
        # Scan over axis 0 of `a`: state of shape a.shape[1:].
        inner = a.shape[1:]
        o = b.pick(lambda v: b.isf(v) and _fits(v.shape, inner))
        s_in, x_t = b.fresh("state"), b.fresh("x")
        nodes: list = []
        s_mid = b.fresh()
        nodes.append(helper.make_node("Add", [s_in, x_t], [s_mid], name=b.fresh("n")))
        s_out = _body_chain(b, s_mid, inner, o, nodes)
        y_t = b.fresh()
        nodes.append(helper.make_node("Relu", [s_out], [y_t], name=b.fresh("n")))
        body = helper.make_graph(
            nodes, b.fresh("scan_body"), [_vi(s_in, b.dt, len(inner)), _vi(x_t, b.dt, len(inner))],
            [_vi(s_out, b.dt, len(inner)), _vi(y_t, b.dt, len(inner))],
        )
        s0 = b.fconst(rng.uniform(-1, 1, inner))
        final, ys = Value(b.fresh(), inner, b.dt), Value(b.fresh(), a.shape, b.dt)
        b.nodes.append(helper.make_node("Scan", [s0, a.name], [final.name, ys.name], name=b.fresh("n"),
                                        body=body, num_scan_inputs=1))
        b.values.extend([final, ys])
    b.control_flow = True


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Names a node reads, its subgraphs' outer-scope references included."""
    reads = {i for i in node.input if i}
    for attr in node.attribute:
        for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            defined = {i.name for i in g.input} | {t.name for t in g.initializer}
            for n in g.node:
                reads |= {r for r in _subgraph_reads(n) if r not in defined}
                defined |= set(n.output)
            reads |= {o.name for o in g.output if o.name not in defined}
    return reads
