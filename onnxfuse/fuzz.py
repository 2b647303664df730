"""Differential fuzzing: random valid graphs, optimized and compared with the original in onnxruntime.

Each case is a seeded random DAG of the ops our passes touch (elementwise chains with broadcasting
and mixed ranks, Slice/Split/Concat with odd steps and negative indices, Conv + BatchNormalization +
activations + residuals, sibling MatMuls), random shapes including size-1 and zero-size dims,
symbolic dims, several outputs, intermediates that are also graph outputs. The optimized model runs
with and without our custom-op library; both must match the original.

    python -m onnxfuse.fuzz --cases 50000 --seed 0      # the long run
    python -m onnxfuse.fuzz --cases 20 --seed 7 --save failures/   # keep failing models

A failing case is reproduced exactly by its seed: `python -m onnxfuse.fuzz --one SEED`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
F32 = TensorProto.FLOAT

UNARY = ["Relu", "Tanh", "Sigmoid", "Abs", "Neg", "Exp", "Sqrt", "Log", "Erf", "Softplus", "Floor", "Reciprocal"]
PARAM_UNARY = ["LeakyRelu", "Elu", "HardSigmoid", "HardSwish", "Selu", "Clip", "Celu"]
BINARY = ["Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "PRelu"]


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: int = F32


@dataclass
class Builder:
    rng: np.random.Generator
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    values: list[Value] = field(default_factory=list)
    counter: int = 0

    def fresh(self, prefix: str = "v") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def const(self, arr: np.ndarray) -> str:
        name = self.fresh("c")
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def add(self, op: str, inputs: list[str], shape, dtype=F32, **attrs) -> Value:
        out = Value(self.fresh(), tuple(int(d) for d in shape), dtype)
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


def _broadcastable_shape(rng, shape):
    """A shape that broadcasts to `shape`: some dims set to 1, maybe fewer leading dims."""
    s = [d if rng.random() < 0.6 else 1 for d in shape]
    drop = rng.integers(0, len(s) + 1) if rng.random() < 0.3 else 0
    return tuple(s[drop:])


def _step(b: Builder) -> None:
    rng = b.rng
    f32 = lambda v: v.dtype == F32  # noqa: E731
    kind = rng.choice(
        ["unary", "param", "binary", "binary_const", "where", "cast", "slice", "split", "concat", "matmul2", "conv"],
        p=[0.16, 0.12, 0.18, 0.12, 0.05, 0.05, 0.09, 0.07, 0.05, 0.06, 0.05],
    )
    a = b.pick(f32)
    if a is None:
        return
    if kind == "unary":
        b.add(str(rng.choice(UNARY)), [a.name], a.shape)
    elif kind == "param":
        op = str(rng.choice(PARAM_UNARY))
        if op == "Clip":
            lo, hi = sorted(rng.uniform(-2, 2, 2).astype(np.float32))
            ins = [a.name, b.const(np.float32(lo)), b.const(np.float32(hi))]
            if rng.random() < 0.3:
                ins = [a.name, "", b.const(np.float32(hi))]
            b.add(op, ins, a.shape)
        elif op == "HardSwish":
            b.add(op, [a.name], a.shape)
        elif op == "HardSigmoid":
            b.add(op, [a.name], a.shape, alpha=float(rng.uniform(0.1, 0.5)), beta=float(rng.uniform(0.2, 0.7)))
        elif op == "Selu":
            b.add(op, [a.name], a.shape)
        else:
            b.add(op, [a.name], a.shape, alpha=float(rng.uniform(0.01, 1.5)))
    elif kind in ("binary", "binary_const"):
        op = str(rng.choice(BINARY))
        if kind == "binary":
            other = b.pick(lambda v: f32(v) and _broadcasts(v.shape, a.shape))
        else:
            other = None
        if other is None:
            cshape = _broadcastable_shape(rng, a.shape) if rng.random() < 0.5 else ()
            val = rng.uniform(0.5, 2.0, cshape).astype(np.float32)
            if rng.random() < 0.5 and op != "Pow":
                val = -val
            other_name, other_shape = b.const(val), cshape
        else:
            other_name, other_shape = other.name, other.shape
        if op == "PRelu":
            # PRelu broadcasts its slope to X only (unidirectional).
            if tuple(np.broadcast_shapes(a.shape, other_shape)) != a.shape:
                return
        ins = [a.name, other_name] if rng.random() < 0.7 or op == "PRelu" else [other_name, a.name]
        b.add(op, ins, np.broadcast_shapes(a.shape, other_shape))
    elif kind == "where":
        c = b.pick(lambda v: f32(v) and _broadcasts(v.shape, a.shape)) or a
        cond = b.add(str(rng.choice(["Greater", "Less", "Equal", "GreaterOrEqual"])), [a.name, c.name],
                     np.broadcast_shapes(a.shape, c.shape), dtype=TensorProto.BOOL)
        d = b.pick(lambda v: f32(v) and _broadcasts(v.shape, cond.shape)) or a
        b.add("Where", [cond.name, c.name, d.name], np.broadcast_shapes(cond.shape, c.shape, d.shape))
    elif kind == "cast":
        mid = int(rng.choice([TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BOOL]))
        t = b.add("Cast", [a.name], a.shape, dtype=mid, to=mid)
        b.add("Cast", [t.name], a.shape, to=F32)
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
        from .program import SliceSpec, resolve_slice

        _, _, length = resolve_slice(dim, SliceSpec(axis, start, end, step))
        shape = list(a.shape)
        shape[axis] = length
        ins = [a.name, b.const(np.array([start], np.int64)), b.const(np.array([end], np.int64)),
               b.const(np.array([axis - len(a.shape) if rng.random() < 0.3 else axis], np.int64)),
               b.const(np.array([step], np.int64))]
        b.add("Slice", ins, shape)
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
            outs.append(Value(b.fresh(), tuple(shape)))
        b.nodes.append(helper.make_node("Split", [a.name, b.const(sizes)], [o.name for o in outs], name=b.fresh("n"), axis=axis))
        b.values.extend(outs)
    elif kind == "concat":
        if not a.shape:
            return
        axis = int(rng.integers(0, len(a.shape)))
        other = b.pick(lambda v: f32(v) and len(v.shape) == len(a.shape)
                       and all(x == y for i, (x, y) in enumerate(zip(v.shape, a.shape)) if i != axis))
        if other is None:
            return
        shape = list(a.shape)
        shape[axis] += other.shape[axis]
        b.add("Concat", [a.name, other.name], shape, axis=axis)
    elif kind == "matmul2":
        # onnxruntime's own MatMul+Add->Gemm rewrite fails on zero-size inputs (its reshape
        # rejects them), so zero-size tensors never reach a MatMul here.
        if not a.shape or 0 in a.shape:
            return
        k = a.shape[-1]
        for _ in range(int(rng.integers(2, 4))):
            n = int(rng.choice([1, 3, 8]))
            w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
            mm = b.add("MatMul", [a.name, b.const(w)], (*a.shape[:-1], n))
            if rng.random() < 0.5:
                b.add("Add", [mm.name, b.const(rng.standard_normal(n).astype(np.float32))], mm.shape)
    elif kind == "conv":
        if len(a.shape) != 4 or 0 in a.shape or min(a.shape[2:]) < 3:
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
        act = rng.choice(["Relu", "Sigmoid", "HardSwish", "none"])
        if act != "none":
            y = b.add(str(act), [y.name], y.shape)
        if y.shape == a.shape and rng.random() < 0.5:
            b.add("Add", [y.name, a.name], y.shape)


def _broadcasts(s: tuple, t: tuple) -> bool:
    try:
        return tuple(np.broadcast_shapes(s, t)) == tuple(t) or tuple(np.broadcast_shapes(s, t)) == tuple(s)
    except ValueError:
        return False


def random_case(seed: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One random model and its inputs, fully determined by the seed."""
    rng = np.random.default_rng(seed)
    b = Builder(rng)
    rank = int(rng.choice([1, 2, 3, 4, 4]))
    dims = [int(rng.choice([1, 2, 3, 5, 8, 16, 7])) for _ in range(rank)]
    if rng.random() < 0.04:
        dims[int(rng.integers(0, rank))] = 0
    base = tuple(dims)
    symbolic = rng.random() < 0.3 and rank >= 2
    graph_inputs, feeds = [], {}
    for i in range(int(rng.integers(1, 4))):
        shape = base if i == 0 else _broadcastable_shape(rng, base)
        name = f"in{i}"
        decl = list(shape)
        if symbolic and len(shape) == rank:
            decl[0] = "batch"
        graph_inputs.append(helper.make_tensor_value_info(name, F32, decl))
        feeds[name] = np.asarray(rng.standard_normal(shape) * float(rng.choice([0.5, 1, 3])), np.float32)
        b.values.append(Value(name, tuple(shape)))
    for _ in range(int(rng.integers(2, 14))):
        _step(b)
    produced = [v for v in b.values if not v.name.startswith("in")]
    if not produced:
        b.add("Relu", [b.values[0].name], b.values[0].shape)
        produced = b.values[-1:]
    consumed = {i for n in b.nodes for i in n.input}
    leaves = [v for v in produced if v.name not in consumed]
    extra = [v for v in produced if v.name in consumed and rng.random() < 0.15]
    outs = (leaves[-3:] or produced[-1:]) + extra[:2]
    seen, out_vals = set(), []
    for v in outs:
        if v.name not in seen:
            seen.add(v.name)
            out_vals.append(v)
    # Keep only nodes that reach an output.
    needed = {v.name for v in out_vals}
    kept = []
    for n in reversed(b.nodes):
        if any(o in needed for o in n.output):
            kept.append(n)
            needed.update(i for i in n.input if i)
    kept.reverse()
    used_inputs = [gi for gi in graph_inputs if gi.name in needed] or graph_inputs[:1]
    feeds = {gi.name: feeds[gi.name] for gi in used_inputs}
    # Output ranks are declared, dims left unknown: with a symbolic batch a fixed dim would be wrong.
    outputs = [helper.make_tensor_value_info(v.name, v.dtype, [None] * len(v.shape)) for v in out_vals]
    inits = [t for t in b.inits if t.name in needed]
    graph = helper.make_graph(kept, f"fuzz_{seed}", used_inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 10
    return model, feeds


def _run(model: onnx.ModelProto, feeds, with_library: bool, level: str = "all"):
    from .runtime import make_session

    sess = make_session(model, with_library=with_library, threads=1, level=level)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def check_case(seed: int, passes=None) -> str | None:
    """None when the optimized model matches the original, else a description of the failure."""
    from .pipeline import Context, run_passes, select_passes

    model, feeds = random_case(seed)
    try:
        # The reference is the original without onnxruntime's graph rewrites: the plainest semantics.
        ref = _run(model, feeds, with_library=False, level="disable")
    except Exception as e:  # an invalid generated graph is a generator bug, reported as such
        return f"seed {seed}: original model does not run: {str(e).splitlines()[0][:200]}"
    try:
        opt, _ = run_passes(model, select_passes(passes, "cpu"), Context())
        onnx.checker.check_model(opt, full_check=True)
    except Exception as e:
        return f"seed {seed}: optimize failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    for with_library in (False, True):
        try:
            got = _run(opt, feeds, with_library=with_library)
        except Exception as e:
            return f"seed {seed}: optimized model (library={with_library}) does not run: {str(e).splitlines()[0][:300]}"
        for name, want in ref.items():
            have = got.get(name)
            if have is None or have.shape != want.shape or have.dtype != want.dtype:
                return f"seed {seed}: output {name}: shape/dtype {None if have is None else (have.shape, have.dtype)} != {(want.shape, want.dtype)}"
            if not np.allclose(have, want, rtol=1e-4, atol=1e-5, equal_nan=True):
                with np.errstate(all="ignore"):
                    err = np.nanmax(np.abs(have.astype(np.float64) - want))
                return f"seed {seed}: output {name} (library={with_library}) differs, max abs error {err:.3g}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onnxfuse.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0, help="first seed; case i uses seed+i")
    ap.add_argument("--one", type=int, help="run the case of this seed alone, with a traceback on error")
    ap.add_argument("--save", type=Path, help="write each failing original model here")
    ap.add_argument("--json", type=Path, help="write a summary (count, failures, seconds) here")
    args = ap.parse_args(argv)
    if args.one is not None:
        model, _ = random_case(args.one)
        print(onnx.helper.printable_graph(model.graph))
        try:
            print(check_case(args.one) or "ok")
        except Exception:
            traceback.print_exc()
            return 1
        return 0
    t0 = time.time()
    failures = []
    for i in range(args.cases):
        seed = args.seed + i
        msg = check_case(seed)
        if msg:
            failures.append(msg)
            print(msg, flush=True)
            if args.save:
                args.save.mkdir(parents=True, exist_ok=True)
                onnx.save(random_case(seed)[0], str(args.save / f"fuzz_{seed}.onnx"))
        if (i + 1) % 1000 == 0:
            print(f"{i + 1} cases, {len(failures)} failures, {time.time() - t0:.0f} s", flush=True)
    summary = {"cases": args.cases, "first_seed": args.seed, "failures": failures, "seconds": round(time.time() - t0, 1)}
    print(f"{args.cases} cases from seed {args.seed}: {len(failures)} failures in {summary['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
