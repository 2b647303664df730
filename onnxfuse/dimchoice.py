"""Values for the symbolic input dimensions a verification runs at, when the caller set none.

A dimension at 1 makes attention, masks and rotary trivial, and a size baked into the optimized
model (batch * heads as a constant) passes by accident when every dim is 1, or when two dims
share a value. So each unset dimension gets a value from DIM_VALUES, distinct per dimension where
possible: dims that appear only as the first axis of the inputs (batch-like) the smallest,
the others (sequence-like) the largest that keeps the estimated activations within a budget
(and at most LARGE_MODEL_LARGEST_DIM for a model too large for a cheap run).

Dims are often related (a decode step's mask covers the past and the new token: total = past
+ 1). Relations are found, not guessed by name:

- a dim_param that is an expression of other dims, as torch's dynamo exporter writes them
  ("s0 + 1", "2*s1"), is computed from them;
- otherwise the original model is run in onnxruntime on candidate assignments (the distinct
  one, then one dim tied to another, dim = other + k, then pairs of such ties, then all dims
  equal) until one runs; if none does, every unset dim falls back to 1, with a note.

Values the caller sets (--dim, a zoo model's defaults) always win. `choose_dims` also picks a
second setting (other distinct values) when a run is cheap (SECOND_SETTING_MAX_WEIGHT_BYTES).
"""
from __future__ import annotations

import ast
import itertools
import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import onnx

from .inputs import DEFAULT_DIM, UnfeedableInputError, random_inputs, symbolic_dims

# Values an unset dimension takes, largest first: 17 is odd and above a 16-wide vector, 8 a
# power of two, 3 and 2 small and distinct. More dims than values take EXTRA_VALUES.
DIM_VALUES = (17, 8, 3, 2)
EXTRA_VALUES = (5, 7, 11, 13, 4, 6, 9, 10, 12, 14, 15, 16)
# The estimated activations (every tensor of known shape at the chosen dims, summed: an upper
# bound, onnxruntime reuses buffers) of one run may take at most this many bytes, and at most
# ACTIVATION_SHARE of the memory available.
ACTIVATION_BUDGET_BYTES = 256 << 20
ACTIVATION_SHARE = 0.1
# "Cheap" for a second verification setting: it opens each session again, which costs about the
# weights' size in reading and packing, so a model of at most this many bytes of weights.
SECOND_SETTING_MAX_WEIGHT_BYTES = 64 << 20
# A model above SECOND_SETTING_MAX_WEIGHT_BYTES takes no value above this: each of the five
# runs of a verification costs about the weights times the tokens (BERT-base, 2 cores: 0.5 s a
# run at batch 1 x seq 1, 1.0 s at 2 x 8, 1.5 s at 2 x 17).
LARGE_MODEL_LARGEST_DIM = 8
# Values of the free dims in the second setting (see _second).
SECOND_VALUES = (3, 2, 5, 7, 4, 6, 9, 11)
# Offsets tried between two dims (other = dim + k) when the distinct assignment does not run.
RELATION_OFFSETS = (1, 0, -1)
# At most this many candidate assignments are run on the original, and none is started after
# PROBE_SECONDS of them.
MAX_PROBES = 48
PROBE_SECONDS = 30.0


class ProbeUnavailable(Exception):
    """The original cannot be run at all (its inputs cannot be fed, onnxruntime refuses it):
    no candidate can be tried, and verification reports why."""

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}
_CALLS = {"Max": max, "Min": min, "max": max, "min": min, "floor": int, "ceiling": int, "FloorDiv": operator.floordiv}


def dim_expression(text: str) -> ast.expr | None:
    """The parsed expression of a dim_param that is arithmetic of names and integers
    ("s0 + 1", "2*s1", "Max(1, s2)"); None for a plain name or anything else."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if isinstance(tree, ast.Name):
        return None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Name, ast.Load, ast.USub, ast.Call)) or \
            type(node) in _BINOPS or (isinstance(node, ast.Constant) and isinstance(node.value, int))
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _CALLS):
            ok = False
        if not ok:
            return None
    return tree


def expression_names(tree: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in _CALLS}


def evaluate_expression(tree: ast.expr, values: Mapping[str, int]) -> int | None:
    """The expression's value at `values`; None where a name has none or it does not compute."""
    def ev(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return values[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Call):
            return _CALLS[node.func.id](*[ev(a) for a in node.args])
        raise ValueError(node)

    try:
        return int(ev(tree))
    except (KeyError, ValueError, ZeroDivisionError, TypeError):
        return None


@dataclass
class DimChoice:
    """The settings of the symbolic dims to verify at, and how each value was chosen."""

    settings: list[dict[str, int]]  # the first is the main one (kernel counts are taken there)
    how: dict[str, str] = field(default_factory=dict)  # dim -> "given", "chosen", "= past + 1", ...
    note: str | None = None  # why the old default (1) was kept, or a second setting was not run
    probes: int = 0  # candidate assignments run on the original

    @property
    def dims(self) -> dict[str, int]:
        return self.settings[0]

    def as_dict(self) -> dict:
        return {"settings": self.settings, "how": self.how, "note": self.note, "probes": self.probes}


def _batch_like(model: onnx.ModelProto, names: list[str]) -> set[str]:
    """Dims that appear only as the first axis of the inputs they shape."""
    other_axes: set[str] = set()
    for value in model.graph.input:
        for axis, d in enumerate(value.type.tensor_type.shape.dim):
            if d.HasField("dim_param") and axis > 0:
                other_axes.add(d.dim_param)
    return {n for n in names if n not in other_axes}


def activation_bytes(model: onnx.ModelProto, dims: Mapping[str, int]) -> int:
    """Bytes of every tensor whose shape shape inference knows, at `dims` (dims not in `dims`
    and data-dependent ones count 1): an upper bound on one run's activations."""
    parsed: dict[str, ast.expr | None] = {}
    total = 0
    seen: set[str] = set()
    values = list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output)
    for v in values:
        if v.name in seen or not v.type.HasField("tensor_type") or not v.type.tensor_type.HasField("shape"):
            continue
        seen.add(v.name)
        try:
            itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)).itemsize
        except Exception:  # types without a numpy equivalent: count 4 bytes an element
            itemsize = 4
        n = 1
        for d in v.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                n *= max(d.dim_value, 0)
            elif d.HasField("dim_param"):
                p = d.dim_param
                if p in dims:
                    n *= dims[p]
                else:
                    if p not in parsed:
                        parsed[p] = dim_expression(p)
                    value = evaluate_expression(parsed[p], dims) if parsed[p] is not None else None
                    n *= max(value or 1, 1)
        total += n * itemsize
    return total


def _pool(count: int, largest: int | None = None) -> list[int]:
    fits = [v for v in (*DIM_VALUES, *EXTRA_VALUES) if largest is None or v <= largest]
    values = [v for v in DIM_VALUES if v in fits]
    for v in fits:
        if len(values) >= count:
            break
        if v not in values:
            values.append(v)
    return values


def _assign(free: list[str], batch_like: set[str], taken: set[int], largest: int | None = None) -> dict[str, int]:
    """Distinct values: sequence-like dims the largest, batch-like ones the smallest."""
    pool = [v for v in _pool(len(free) + len(taken), largest) if v not in taken]
    if len(pool) < len(free):
        pool += [v for v in _pool(len(free) + len(taken)) if v not in pool][: len(free) - len(pool)]
    order = sorted(pool, reverse=True)
    out: dict[str, int] = {}
    for name in [n for n in free if n not in batch_like]:
        out[name] = order.pop(0) if order else 2
    for name in [n for n in free if n in batch_like]:
        out[name] = order.pop(-1) if order else 2
    return out


def _lower(value: int, used: set[int]) -> int | None:
    """The next smaller value of the set that no other dim has (2 at least); None if none."""
    smaller = [v for v in (*DIM_VALUES, *EXTRA_VALUES) if 2 <= v < value and v not in used]
    return max(smaller) if smaller else None


class DimResolver:
    """The symbolic input dims of a model: given, derived (expressions of others), free."""

    def __init__(self, model: onnx.ModelProto, given: Mapping[str, int]):
        self.model = model
        self.names = symbolic_dims(model)
        self.given = {k: int(v) for k, v in given.items() if k in self.names}
        self.derived: dict[str, ast.expr] = {}
        for name in self.names:
            if name in self.given:
                continue
            tree = dim_expression(name)
            if tree is not None and expression_names(tree) <= set(self.names) - {name}:
                self.derived[name] = tree
        self.free = [n for n in self.names if n not in self.given and n not in self.derived]
        self.batch_like = _batch_like(model, self.free)

    def complete(self, free_values: Mapping[str, int]) -> dict[str, int] | None:
        """Every dim's value (given, free, derived computed), in the inputs' order; None when a
        derived dim does not compute to a positive size."""
        values = {**free_values, **self.given}
        for _ in range(len(self.derived) + 1):  # derived dims may use one another
            for name, tree in self.derived.items():
                if name not in values:
                    v = evaluate_expression(tree, values)
                    if v is not None:
                        values[name] = v
        if any(n not in values or values[n] < 1 for n in self.names):
            return None
        return {n: values[n] for n in self.names}


def _relations(free: list[str], base: dict[str, int], batch_like: set[str]) -> list[tuple[dict[str, int], str]]:
    """Assignments with one dim tied to another (y = x + k), then two such ties; ties between
    two dims of one kind (both batch-like or both not) first: each candidate that fails costs
    a run of the model."""
    singles = []
    for same_kind in (True, False):
        for k in RELATION_OFFSETS:
            for x, y in itertools.permutations(free, 2):
                if ((x in batch_like) == (y in batch_like)) == same_kind and base[x] + k >= 2:
                    singles.append(((x, y, k), {**base, y: base[x] + k}))
    out = [(values, _relation_text(y, x, k)) for (x, y, k), values in singles]
    for ((x1, y1, k1), _), ((x2, y2, k2), _) in itertools.combinations(singles, 2):
        if len({y1, y2}) < 2 or y1 == x2 or y2 == x1:
            continue
        values = {**base, y1: base[x1] + k1}
        values[y2] = values[x2] + k2
        if min(values.values()) >= 2:
            out.append((values, f"{_relation_text(y1, x1, k1)}, {_relation_text(y2, x2, k2)}"))
    return out


def _relation_text(y: str, x: str, k: int) -> str:
    return f"{y} = {x}" + (f" + {k}" if k > 0 else f" - {-k}" if k < 0 else "")


def _second(resolver: DimResolver, first: dict[str, int], relation: Callable[[dict], dict] | None) -> dict | None:
    """Other values for the free dims (small ones, each unlike its first value), the same ties
    kept, distinct across all dims where possible."""
    fallback = None
    for combo in itertools.islice(itertools.permutations(SECOND_VALUES, len(resolver.free)), 720):
        alt = dict(zip(resolver.free, combo))
        if any(alt[n] == first[n] for n in alt):
            continue
        if relation is not None:
            alt = relation(alt)
        complete = resolver.complete(alt)
        if complete is None or complete == first or any(
                complete[n] < 2 for n in complete if n not in resolver.given):
            continue
        if len(set(complete.values())) == len(complete):
            return complete
        fallback = fallback or complete
    return fallback


def choose_dims(model: onnx.ModelProto, given: Mapping[str, int] | None = None,
                runs: Callable[[dict[str, int]], bool] | None = None,
                budget: int | None = None, second: bool = False, largest: int | None = None) -> DimChoice:
    """The settings to verify `model` at (see the module's docstring).

    runs(dims) says whether the original model runs at those dims (None: assume it does);
    budget: activation bytes one run may take (default: ACTIVATION_BUDGET_BYTES);
    second: also choose a second setting (the caller decides whether it is cheap);
    largest: no unset dim above this value (where enough values below it remain)."""
    resolver = DimResolver(model, dict(given or {}))
    how = {n: "given" for n in resolver.given}
    if not resolver.free and not resolver.derived:
        return DimChoice([dict(resolver.given)], how)
    budget = ACTIVATION_BUDGET_BYTES if budget is None else budget
    base = _assign(resolver.free, resolver.batch_like, set(resolver.given.values()), largest)
    # Within the budget: lower the largest free value that can go lower (to a value no other
    # dim has, 2 at least) until the estimate fits.
    while True:
        complete = resolver.complete(base)
        if complete is None or activation_bytes(model, complete) <= budget:
            break
        lowered = False
        for name in sorted(base, key=lambda n: -base[n]):
            value = _lower(base[name], set(base.values()) - {base[name]})
            if value is not None:
                base[name], lowered = value, True
                break
        if not lowered:
            break

    candidates: list[tuple[dict[str, int], str | None]] = [(base, None)]
    if runs is not None and resolver.free:
        candidates += _relations(resolver.free, base, resolver.batch_like)
        for v in sorted({*base.values(), 2}, reverse=True):
            candidates.append(({n: v for n in resolver.free}, "all unset dims equal" if len(resolver.free) > 1 else None))
    probes = 0
    tried: list[dict] = []
    start = time.perf_counter()
    for values, relation in candidates:
        complete = resolver.complete(values)
        if complete is None or complete in tried:
            continue
        tried.append(complete)
        if runs is not None:
            if probes >= MAX_PROBES or time.perf_counter() - start > PROBE_SECONDS:
                break
            probes += 1
            try:
                if not runs(complete):
                    continue
            except ProbeUnavailable:
                return _fallback(resolver, how, probes, None, "1 (the original cannot be run to try others)")
        for name in resolver.free:
            how[name] = "chosen"
        for name in resolver.derived:
            how[name] = "computed from its expression"
        if relation:
            for part in relation.split(", "):
                if " = " in part:
                    how[part.split(" = ")[0]] = "= " + part.split(" = ", 1)[1] + ", found by running the original"
                else:
                    how = {**how, **{n: "all equal, found by running the original" for n in resolver.free}}
        settings = [complete]
        note = None
        if second:
            tie = _tie(relation) if relation else None
            alt = _second(resolver, values, tie)
            if alt is not None and alt != complete and (runs is None or _runs(runs, alt)):
                settings.append(alt)
            elif alt is not None and alt != complete:
                note = f"second setting {_text(alt)} does not run on the original: not verified there"
            if runs is not None and alt is not None and alt != complete:
                probes += 1
        return DimChoice(settings, how, note, probes)
    unset = ", ".join(resolver.free + list(resolver.derived))
    return _fallback(resolver, how, probes, f"the original runs at none of {probes} settings of {unset} above 1:"
                     " verified at 1 (--dim sets them)", "1 (no other values run)")


def _fallback(resolver: DimResolver, how: dict, probes: int, note: str | None, why: str) -> DimChoice:
    """The old default: every unset dim at 1."""
    fallback = resolver.complete({n: DEFAULT_DIM for n in resolver.free}) or {
        n: resolver.given.get(n, DEFAULT_DIM) for n in resolver.names}
    for name in resolver.names:
        if name not in resolver.given:
            how[name] = why
    return DimChoice([fallback], how, note=note, probes=probes)


def _runs(runs: Callable[[dict[str, int]], bool], dims: dict[str, int]) -> bool:
    try:
        return runs(dims)
    except ProbeUnavailable:
        return False


def _tie(relation: str) -> Callable[[dict], dict]:
    """A function re-applying the ties of `relation` ("y = x + 1, ...") to other free values."""
    parts = []
    for part in relation.split(", "):
        if " = " not in part:
            return lambda alt: {n: max(alt.values()) for n in alt}
        y, rhs = part.split(" = ")
        tokens = rhs.split(" ")
        k = 0 if len(tokens) == 1 else (int(tokens[2]) if tokens[1] == "+" else -int(tokens[2]))
        parts.append((y, tokens[0], k))

    def apply(alt: dict) -> dict:
        out = dict(alt)
        for y, x, k in parts:
            out[y] = out[x] + k
        return out

    return apply


def _text(dims: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in dims.items())


def probe_runner(source, model: onnx.ModelProto, seed: int = 0, threads: int | None = None
                 ) -> Callable[[dict[str, int]], bool]:
    """runs(dims) for choose_dims: one onnxruntime session of the original (no graph
    optimization, no weight packing: a quick start), run on seeded random inputs at each
    candidate; a candidate runs when onnxruntime runs it and the outputs have their declared
    sizes (outputs_match_declared)."""
    import onnxruntime as ort

    from .runtime import _session_source, session_options

    from .runtime import LibraryError

    session = None
    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # a candidate that does not run is expected, not an error to print

    def runs(dims: dict[str, int]) -> bool:
        nonlocal session
        try:
            feeds = random_inputs(model, dims, seed)
        except UnfeedableInputError as e:
            raise ProbeUnavailable(str(e)) from None
        if session is None:
            # Packing the MatMul weights is most of a session's start (4 s of 4.5 for
            # BERT-base); a probe runs a few small batches and does without it.
            so = session_options(with_library=False, threads=threads, level="disable", prepack=False)
            so.log_severity_level = 4
            try:
                with _session_source(source, "cpu") as (data, _):
                    session = ort.InferenceSession(data, sess_options=so, providers=["CPUExecutionProvider"])
            except LibraryError:
                raise
            except Exception as e:  # onnxruntime's exception types: verification reports it
                raise ProbeUnavailable(str(e)) from None
        try:
            outputs = session.run(None, feeds, quiet)
        except Exception:  # onnxruntime's exception types: a shape that does not fit, an index out of range
            return False
        return outputs_match_declared(model, dims, outputs)

    return runs


def outputs_match_declared(model: onnx.ModelProto, dims: Mapping[str, int], outputs) -> bool:
    """Whether each output's shape has the sizes its declared symbolic dims take at `dims` (a
    present key declared [batch, heads, total, d] is not of length total when the mask's length
    and the cache's do not fit together, even where the model runs)."""
    for value, out in zip(model.graph.output, outputs):
        shape = np.shape(out)
        declared = value.type.tensor_type.shape.dim if value.type.HasField("tensor_type") else []
        if len(declared) and len(declared) != len(shape):
            return False
        for d, actual in zip(declared, shape):
            if d.HasField("dim_value") and d.dim_value and d.dim_value != actual:
                return False
            if d.HasField("dim_param"):
                want = dims.get(d.dim_param)
                if want is None:
                    tree = dim_expression(d.dim_param)
                    want = evaluate_expression(tree, dims) if tree is not None else None
                if want is not None and want != actual:
                    return False
    return True


def choose_verify_dims(model: onnx.ModelProto, given: Mapping[str, int], seed: int = 0,
                       threads: int | None = None) -> DimChoice:
    """choose_dims for a verification of `model`: candidates run on the model itself, the
    activation budget within the memory available, a second setting when the model's weights
    make a second set of sessions cheap (at most SECOND_SETTING_MAX_WEIGHT_BYTES)."""
    from .verify import available_memory, weight_bytes

    resolver_names = symbolic_dims(model)
    if all(n in given for n in resolver_names):
        return DimChoice([{n: int(given[n]) for n in resolver_names}], {n: "given" for n in resolver_names})
    available = available_memory()
    budget = ACTIVATION_BUDGET_BYTES if available is None else min(ACTIVATION_BUDGET_BYTES,
                                                                  int(available * ACTIVATION_SHARE))
    cheap = weight_bytes(model) <= SECOND_SETTING_MAX_WEIGHT_BYTES
    return choose_dims(model, given, runs=probe_runner(model, model, seed, threads), budget=budget, second=cheap,
                       largest=None if cheap else LARGE_MODEL_LARGEST_DIM)
