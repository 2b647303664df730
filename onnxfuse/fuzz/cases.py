"""Cases: a seeded random model and its inputs (onnxfuse.fuzz.generate builds the graph)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from .generate import (BF16, F16, F32, F64, NP, Builder, Value, _broadcastable_shape, _control_flow, _step,
                       _subgraph_reads)

@dataclass
class Case:
    seed: int
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    dtype: int
    control_flow: bool
    scales: dict[str, float]
    salted: dict[str, list[int]]  # per input, the flat positions holding special values


# Seeds from here on also draw the motifs added after the first generator (step Gathers, one
# weight on several values, MLP ensembles); lower seeds give the first generator's cases, which
# the regression tests name (`--seed 100000` fuzzes with every motif).
LATER_MOTIFS_SEED = 100_000


def _feed(rng, shape, dtype, scale):
    return np.asarray(rng.standard_normal(shape) * scale, NP[dtype])


# Share of cases whose inputs get special values at a few positions (the others keep ordinary
# random inputs, so that the numbers themselves are compared too where a NaN would cover them).
SALTED_SHARE = 0.5


def special_values(dtype: int) -> np.ndarray:
    """+-0, +-inf, NaN, +-smallest normal, +-smallest subnormal, and (but for float16) +-largest.
    float16 regions compute in float32 and round once where onnxruntime rounds after every op,
    so a float16 intermediate past 65504 is inf in one and finite in the other: by design, not a
    special-value rule, and left out here."""
    t = NP[dtype]
    fi = np.finfo(t)
    values = [0.0, -0.0, np.inf, -np.inf, np.nan, fi.tiny, -fi.tiny, fi.smallest_subnormal, -fi.smallest_subnormal]
    if dtype != F16:
        values += [fi.max, -fi.max]
    return np.array(values, t)


def salt(seed: int, feeds: dict[str, np.ndarray], dtype: int) -> dict[str, list[int]]:
    """Put special values at 1-3 positions of each float input of about half the cases, in place;
    returns the positions. Drawn from a generator of their own: the graph a seed gives does not
    depend on it."""
    rng = np.random.default_rng([seed, 0x5A17])
    if rng.random() >= SALTED_SHARE:
        return {}
    values = special_values(dtype)
    where: dict[str, list[int]] = {}
    for name, arr in feeds.items():
        if arr.dtype.kind != "f" or arr.size == 0:
            continue
        flat = arr.reshape(-1)
        idx = rng.choice(flat.size, size=min(flat.size, int(rng.integers(1, 4))), replace=False)
        flat[idx] = rng.choice(values, size=len(idx))
        where[name] = sorted(int(i) for i in idx)
    return where


def build_case(seed: int) -> Case:
    """One random model and its inputs, fully determined by the seed."""
    rng = np.random.default_rng(seed)
    dt = int(rng.choice([F32, F32, F32, F32, F32, F32, F32, F16, F64, F64]))
    opset = int(rng.choice([17, 17, 17, 13, 18, 20]))
    b = Builder(rng, dt=dt, opset=opset, later_motifs=seed >= LATER_MOTIFS_SEED)
    rank = int(rng.choice([1, 2, 3, 4, 4]))
    dims = [int(rng.choice([1, 2, 3, 5, 8, 16, 7])) for _ in range(rank)]
    if rng.random() < 0.05:
        dims[int(rng.integers(0, rank))] = 0
    base = tuple(dims)
    # Declared dims: static, a symbolic batch, symbolic batch and width, or unknown (no name).
    mode = str(rng.choice(["static", "static", "batch", "batch_width", "unknown"])) if rank >= 2 else "static"
    graph_inputs, feeds, scales = [], {}, {}
    for i in range(int(rng.integers(1, 4))):
        shape = base if i == 0 else _broadcastable_shape(rng, base)
        name = f"in{i}"
        decl: list = list(shape)
        if len(shape) == rank:
            if mode in ("batch", "batch_width") and shape[0] == base[0]:
                decl[0] = "batch"
            if mode == "batch_width" and shape[-1] == base[-1] and base[-1] != 1:
                decl[-1] = "width"
            if mode == "unknown" and shape[0] == base[0] and base[0] != 1:
                decl[0] = None
        graph_inputs.append(helper.make_tensor_value_info(name, dt, decl))
        scale = float(rng.choice([0.5, 1, 3])) if dt != F16 else 1.0
        feeds[name] = _feed(rng, shape, dt, scale)
        scales[name] = scale
        b.values.append(Value(name, tuple(shape), dt, 6 * scale))
    steps = int(rng.integers(2, 14))
    cf_at = int(rng.integers(0, steps)) if rng.random() < 0.15 else -1
    for k in range(steps):
        if k == cf_at:
            _control_flow(b)
        _step(b)
    produced = [v for v in b.values if not v.name.startswith("in")]
    if not produced:
        b.add("Relu", [b.values[0].name], b.values[0].shape)
        produced = b.values[-1:]
    consumed = set().union(*[_subgraph_reads(n) for n in b.nodes]) if b.nodes else set()
    leaves = [v for v in produced if v.name not in consumed]
    extra = [v for v in produced if v.name in consumed and rng.random() < 0.15]
    # onnxruntime cannot hand bfloat16 outputs to numpy: bf16 values stay inside.
    leaves = [v for v in leaves if v.dtype != BF16]
    extra = [v for v in extra if v.dtype != BF16]
    outs = (leaves[-3:] or [v for v in produced if v.dtype != BF16][-1:]) + extra[:2]
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
            needed.update(_subgraph_reads(n))
    kept.reverse()
    used_inputs = [gi for gi in graph_inputs if gi.name in needed] or graph_inputs[:1]
    feeds = {gi.name: feeds[gi.name] for gi in used_inputs}
    # Output ranks are declared, dims left unknown: with a symbolic batch a fixed dim would be wrong.
    outputs = [helper.make_tensor_value_info(v.name, v.dtype, [None] * len(v.shape)) for v in out_vals]
    inits = [t for t in b.inits if t.name in needed]
    graph = helper.make_graph(kept, f"fuzz_{seed}", used_inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    cf = any(n.op_type in ("If", "Loop", "Scan") for n in kept)
    feeds = {k: np.array(v) for k, v in feeds.items()}
    salted = salt(seed, feeds, dt)
    return Case(seed, model, feeds, dt, cf, {k: scales[k] for k in feeds}, salted)


def random_case(seed: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One random model and its inputs, fully determined by the seed."""
    case = build_case(seed)
    return case.model, case.feeds
