"""Checking an optimized model against its original in onnxruntime on seeded random inputs.

Both models run on the same inputs (inputs.py: drawn from a seeded generator with the declared
shapes, symbolic dimensions from `dims`: the caller's, with dimchoice.py's values for the ones
the caller left unset); every output is compared with a tolerance
that depends on its element type (compare.py). The optimized model runs with our custom-op
library when it holds fused ops, and once more without it, so the fallback functions are
checked too. A model too large to run whole is checked region by region instead
(region_verify.py; `choose_mode` decides).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import onnx

from .compare import OutputCheck, compare_output
from .environment import ort_error_text
from .inputs import UnfeedableInputError, random_inputs, special_inputs
from .modelio import InputError
from .records import attributes


class VerificationError(Exception):
    """The optimized model does not match the original (or does not run)."""

    def __init__(self, message: str, result: "Verification | None" = None):
        super().__init__(message)
        self.result = result


# --------------------------------------------------------------------------- verifying


@dataclass
class RunCheck:
    """The optimized model in one configuration (with our library, or on fallback functions)."""

    label: str
    outputs: list[OutputCheck] = field(default_factory=list)
    error: str | None = None  # onnxruntime could not load or run it

    @property
    def ok(self) -> bool:
        return self.error is None and all(o.ok for o in self.outputs)

    def as_dict(self) -> dict:
        return {"run": self.label, "ok": self.ok, "error": self.error, "outputs": [o.as_dict() for o in self.outputs]}


@dataclass
class InputDependence:
    """Outputs whose values do not depend on the inputs, and what was compared instead.

    Some models compute the same outputs whatever the input (the light ONNX zoo CNNs: equal
    weights make every logit equal, so the final Softmax is uniform); comparing those outputs
    checks nothing the optimizer could get wrong upstream. The nearest tensors before them that
    do depend on the inputs, and that both models compute, are compared in their place.
    """

    constant_outputs: list[str]
    runs: list[RunCheck] = field(default_factory=list)  # the stand-in tensors, per configuration
    note: str | None = None  # why nothing could stand in

    @property
    def compared(self) -> list[str]:
        return [o.name for o in self.runs[0].outputs] if self.runs else []

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs)

    def as_dict(self) -> dict:
        return {"constant_outputs": self.constant_outputs, "compared": self.compared, "ok": self.ok,
                "note": self.note, "runs": [r.as_dict() for r in self.runs]}


@dataclass
class Verification:
    seed: int
    dims: dict[str, int]
    provider: str
    runs: list[RunCheck] = field(default_factory=list)
    original_profile: object | None = None  # profile.KernelProfile of the original
    optimized_profile: object | None = None  # ... and of the optimized model (with library)
    # "whole": both models run and compared; "regions": each fused node against its fallback
    # body (region_verify.py), for models whose whole run would not fit in memory.
    mode: str = "whole"
    mode_reason: str | None = None  # why this mode ran (auto choice, or the option that forced it)
    regions: list = field(default_factory=list)  # region_verify.RegionCheck, in "regions" mode
    input_dependence: InputDependence | None = None  # set when some outputs are constant
    # The same comparison on the inputs with special values at a few positions (special_inputs):
    # NaN and infinity positions must match; None when no input is a float tensor.
    special: RunCheck | None = None
    special_positions: int = 0
    # The same verification at further settings of the symbolic dims (dimchoice.py: a second
    # setting where a run is cheap); kernels are counted at `dims` alone.
    more: list["Verification"] = field(default_factory=list)

    def _all_runs(self) -> list[RunCheck]:
        return self.runs + (self.input_dependence.runs if self.input_dependence else [])

    @property
    def ok(self) -> bool:
        return (all(r.ok for r in self._all_runs()) and all(r.ok for r in self.regions)
                and (self.special is None or self.special.ok) and all(m.ok for m in self.more))

    @property
    def outputs(self) -> list[OutputCheck]:
        return ([o for r in self._all_runs() for o in r.outputs] + [o for r in self.regions for o in r.outputs]
                + [o for m in self.more for o in m.outputs])

    @property
    def max_abs(self) -> float:
        return max((o.max_abs for o in self.outputs), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((o.max_rel for o in self.outputs), default=0.0)

    @property
    def norm_rel(self) -> float:
        return max((o.norm_rel for o in self.outputs), default=0.0)

    def first_problem(self) -> str | None:
        for head, error, outputs, output_text in self._checked():
            if error:
                return f"{head}: {error}"
            bad = next((o for o in outputs if not o.ok), None)
            if bad is not None:
                return f"{output_text(bad)}: {bad.problem}"
        for m in self.more:
            problem = m.first_problem()
            if problem:
                return f"at dims {', '.join(f'{k}={v}' for k, v in m.dims.items())}: {problem}"
        return None

    def _checked(self):
        """Each run and region compared: (what it is, its error, its outputs, how one of them is
        named in a problem)."""
        stand_ins = self.input_dependence.runs if self.input_dependence else []
        for r in self._all_runs() + ([self.special] if self.special is not None else []):
            what = "tensor" if r in stand_ins else "output"
            yield r.label, r.error, r.outputs, lambda o, what=what, label=r.label: f"{what} '{o.name}' ({label})"
        for g in self.regions:
            what, against = (("fused node", "its fallback body") if g.kind == "fused"
                             else ("rewrite at", "the original subgraph"))
            head = f"{what} '{g.node}' ({g.op_type})"
            yield head, g.error, g.outputs, lambda o, head=head, against=against: f"{head}, output '{o.name}' against {against}"

    def as_dict(self) -> dict:
        return {
            **attributes(self, "ok seed dims provider max_abs max_rel norm_rel mode mode_reason"),
            "runs": [r.as_dict() for r in self.runs],
            **({"regions": [r.as_dict() for r in self.regions]} if self.mode == "regions" else {}),
            "input_dependence": self.input_dependence.as_dict() if self.input_dependence else None,
            "special_values": None if self.special is None else {
                "positions": self.special_positions, **self.special.as_dict()},
            **({"more_settings": [m.as_dict() for m in self.more]} if self.more else {}),
        }


def _output_types(model: onnx.ModelProto) -> list[int]:
    return [o.type.tensor_type.elem_type if o.type.HasField("tensor_type") else 0 for o in model.graph.output]


def verify(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    provider: str = "cpu",
    threads: int | None = None,
    fallback: bool = True,
    original_label: str = "original model",
    mode: str = "whole",
) -> Verification:
    """Run both models on the same seeded inputs and compare every output; with mode "regions",
    check each fused node and rewrite against what it replaced instead (region_verify.py).

    Raises InputError when the original itself cannot be fed or run (that is the input's
    problem, not the optimizer's). Mismatches and failures of the optimized model are recorded
    in the result; check .ok. The profiled runs also give both models' kernel counts.
    """
    dims = dict(dims or {})
    if mode == "regions":
        from .region_verify import check_regions

        return Verification(seed=seed, dims=dims, provider=provider, mode="regions",
                            regions=check_regions(original, optimized, dims, seed, provider, threads))
    if mode != "whole":
        raise ValueError(f"verification mode {mode!r}: expected 'whole' or 'regions'")
    try:
        feeds = random_inputs(original, dims, seed)
    except UnfeedableInputError as e:
        raise UnfeedableInputError(f"{original_label}: {e}; verification needs random inputs (--no-verify skips it)") from None
    from .ortfiles import runtime_sources

    with runtime_sources([original, optimized]) as (original_source, optimized_source):
        return _verify(original, optimized, original_source, optimized_source, feeds, dims, seed, provider, threads,
                       fallback, original_label)


# --------------------------------------------------------------------------- choosing a mode

VERIFY_MODES = ("auto", "whole", "regions")
# Peak memory of a whole-model run per byte of weights: onnxruntime maps the weights, and
# verification's sessions pack no second copy of them (PREPACK). A session and one run, per
# byte of the weights, without packing and with it: one 1 GiB MatMul weight 1.06 / 2.06,
# TinyLlama-1.1B's decode step (4.1 GiB) 0.96 / 1.02, GPT-2 small and BERT-base as single
# files, parsed whole, 1.34-1.36 / 1.53-1.59 (bench/results/verify_prepacking.md).
WHOLE_RUN_BYTES_PER_WEIGHT_BYTE = 1.5
# Memory a whole-model run may plan on: this share of what the machine has available.
USABLE_MEMORY_SHARE = 0.8
# Verification sessions run a model once or twice: their kernels read the weights as the model
# holds them instead of packing a copy first (runtime.session_options). The same nodes and
# kernels run (kernel counts are unchanged); MatMul results differ from a packing session's in
# rounding only (at most 3.3e-6 on BERT-base and GPT-2 small), and both models of a comparison
# run the same way. Making the session of TinyLlama-1.1B's decode step takes 9.6-14.0 s with
# packing, 0.24-0.25 s without, its run about as long (bench/results/verify_prepacking.md).
PREPACK = False


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's initializers, inline or held by reference."""
    from .weights import expected_bytes

    total = 0
    for t in model.graph.initializer:
        total += expected_bytes(t) or 0
    return total


def available_memory() -> int | None:
    """Bytes of memory this process can still get: the machine's MemAvailable, less where a
    cgroup limit is lower; None where that cannot be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max" and available is not None:
            available = min(available, int(limit) - current)
    except (OSError, ValueError):
        pass
    return available


def whole_run_bytes(original: onnx.ModelProto, optimized: onnx.ModelProto) -> int:
    """Estimated peak memory of a whole-model verification (the models run one at a time)."""
    return int(max(weight_bytes(original), weight_bytes(optimized)) * WHOLE_RUN_BYTES_PER_WEIGHT_BYTE)


def choose_mode(original: onnx.ModelProto, optimized: onnx.ModelProto, requested: str = "auto",
                available: int | None = None) -> tuple[str, str]:
    """(mode, why): "whole" unless its estimated memory exceeds what is available ("auto"),
    or as requested."""
    if requested not in VERIFY_MODES:
        raise InputError(f"--verify-mode {requested}: expected one of {', '.join(VERIFY_MODES)}")
    if requested != "auto":
        return requested, f"--verify-mode {requested}"
    need = whole_run_bytes(original, optimized)
    available = available_memory() if available is None else available
    if available is None or need <= available * USABLE_MEMORY_SHARE:
        return "whole", "fits in memory" if available is not None else "available memory unknown"
    return "regions", (f"a whole-model run needs about {need / 1e9:.1f} GB, {available / 1e9:.1f} GB"
                       " available")


def _verify(original, optimized, original_source, optimized_source, feeds, dims, seed, provider, threads, fallback,
            original_label) -> Verification:
    """verify() with the models as onnxruntime is to load them (ModelProtos or file paths)."""
    from .runtime import needs_library, profiled_run

    result = Verification(seed=seed, dims=dims, provider=provider)
    # The special-value runs (_verify_special_values) go through the sessions the profiled runs
    # open: the original's where it runs without the library anyway, the first optimized one's.
    salted, count = special_inputs(feeds, seed)
    salted_outputs: dict[str, object] = {}

    def salted_run(key: str):
        def run(session) -> None:
            try:
                salted_outputs[key] = session.run(None, dict(salted))
            except Exception as e:  # onnxruntime's own types: a model may refuse a NaN (e.g. as an index)
                salted_outputs[key] = e
        return run if count else None

    try:
        expected, result.original_profile = profiled_run(
            original_source, feeds, provider=provider, threads=threads, prepack=PREPACK,
            then=None if needs_library(original, provider) else salted_run("original"))
    except InputError:
        raise
    except Exception as e:  # onnxruntime raises its own exception types
        from .runtime import LibraryError

        if isinstance(e, LibraryError):
            raise
        raise InputError(f"{original_label}: onnxruntime cannot run it: {ort_error_text(e)}") from None
    names = [o.name for o in original.graph.output]
    types = _output_types(original)

    uses_library = needs_library(optimized, provider)
    configs = [("with the onnxfuse library", None)] if uses_library else [("optimized", False)]
    if fallback and uses_library:
        configs.append(("fallback functions, no library", False))
    for k, (label, with_library) in enumerate(configs):
        run = RunCheck(label)
        result.runs.append(run)
        try:
            actual, prof = profiled_run(
                optimized_source, feeds, provider=provider, threads=threads, with_library=with_library, prepack=PREPACK,
                then=salted_run("optimized") if k == 0 else None,
            )
        except InputError:
            raise
        except Exception as e:  # onnxruntime raises its own exception types
            from .runtime import LibraryError

            if isinstance(e, LibraryError):
                raise
            run.error = f"onnxruntime cannot run the optimized model: {ort_error_text(e)}"
            continue
        if result.optimized_profile is None:
            result.optimized_profile = prof
        opt_names = [o.name for o in optimized.graph.output]
        if opt_names != names:
            run.error = f"outputs are {opt_names}, the original's are {names}"
            continue
        for name, elem, e, a in zip(names, types, expected, actual):
            run.outputs.append(compare_output(name, elem, e, a))
    if result.runs and all(r.error is None for r in result.runs) and any(_uniform(x) for x in expected):
        result.input_dependence = _input_dependence(
            original, optimized, feeds, expected, dims, seed, provider, threads, configs)
    if result.ok:
        _verify_special_values(result, original_source, optimized_source, salted, count, salted_outputs, provider,
                               threads, configs[0], names, types)
    return result


def _uniform(value) -> bool:
    """All elements equal: what an output that ignores its inputs usually looks like (checked
    further with other inputs before anything is concluded)."""
    a = np.asarray(value)
    if a.size == 0 or a.dtype.kind not in "fciub":
        return False
    flat = a.reshape(-1)
    return bool(np.all(flat == flat[0])) or bool(np.all(np.isnan(flat)))


# How far back from a constant output to look for tensors that depend on the inputs.
MAX_STAND_IN_CANDIDATES = 24


def _input_dependence(original, optimized, feeds, expected, dims, seed, provider, threads, configs):
    """Which outputs are the same for other inputs, and the comparison of the nearest tensors
    upstream of them that are not (see InputDependence)."""
    from .runtime import make_session

    other_feeds = random_inputs(original, dims, seed + 1)
    if not feeds or all(np.array_equal(feeds[k], other_feeds[k]) for k in feeds):
        return None
    names = [o.name for o in original.graph.output]
    uniform = [n for n, value in zip(names, expected) if _uniform(value)]

    # Tensors before the uniform outputs, nearest first, that the optimized model computes too.
    producer = {out: node for node in original.graph.node for out in node.output if out}
    in_optimized = {out for node in optimized.graph.node for out in node.output}
    graph_inputs = {i.name for i in original.graph.input}
    candidates: list[str] = []
    queue, seen = list(uniform), set(uniform)
    while queue and len(candidates) < MAX_STAND_IN_CANDIDATES:
        node = producer.get(queue.pop(0))
        if node is None:
            continue
        for inp in node.input:
            if not inp or inp in seen or inp in graph_inputs or inp not in producer:
                continue
            seen.add(inp)
            queue.append(inp)
            if inp in in_optimized and inp not in names:
                candidates.append(inp)

    # One session of the original answers both questions: do the uniform outputs stay the same
    # for other inputs, and which candidates change with them.
    sess = make_session(_with_outputs(original, candidates), provider=provider, threads=threads, prepack=PREPACK)
    fetched = uniform + candidates
    first = sess.run(fetched, feeds)
    second = sess.run(fetched, other_feeds)
    same = {n: np.asarray(a).shape == np.asarray(b).shape and np.array_equal(a, b, equal_nan=True)
            for n, a, b in zip(fetched, first, second)}
    constant = [n for n in uniform if same[n]]
    if not constant:
        return None
    found = InputDependence(constant)
    varying = [n for n in candidates if not same[n]]
    if not varying:
        found.note = "no tensor before them that depends on the inputs is computed by both models"
        return found
    stand_in = varying[0]  # the nearest one, in breadth-first order from the outputs
    reference = first[fetched.index(stand_in)]
    elem = _elem_type(reference)
    optimized_probe = _with_outputs(optimized, [stand_in])
    for label, with_library in configs:
        run = RunCheck(label)
        found.runs.append(run)
        try:
            (actual,) = make_session(optimized_probe, provider=provider, threads=threads,
                                     with_library=with_library, prepack=PREPACK).run([stand_in], feeds)
        except Exception as e:  # onnxruntime's exception types
            run.error = f"onnxruntime cannot run the optimized model with '{stand_in}' as an output: {ort_error_text(e)}"
            continue
        run.outputs.append(compare_output(stand_in, elem, reference, actual))
    return found


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for name in names:
        copy.graph.output.append(onnx.ValueInfoProto(name=name))
    return copy


def _elem_type(value) -> int:
    try:
        return int(onnx.helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype))
    except Exception:  # a dtype onnx has no enum for: compared exactly
        return 0


def _verify_special_values(result, original_source, optimized_source, salted, count, salted_outputs, provider,
                           threads, config, names, types) -> None:
    """Both models again on the inputs with special values salted in (special_inputs): the
    outputs the profiled runs' sessions gave (`salted_outputs`, "original" and "optimized",
    each a list of outputs or the exception), else a session of their own."""
    from .runtime import LibraryError, make_session

    if not count:
        return
    label, with_library = config
    result.special_positions = count
    result.special = run = RunCheck(f"special values at {count} input positions, {label}")

    def outputs(key: str, source, library):
        if key in salted_outputs:
            found = salted_outputs[key]
            if isinstance(found, Exception):
                raise found
            return found
        return make_session(source, provider, with_library=library, threads=threads,
                            prepack=PREPACK).run(None, salted)

    try:
        expected = outputs("original", original_source, False)
    except Exception as e:  # onnxruntime's own types: a model may refuse a NaN (e.g. as an index)
        if isinstance(e, LibraryError):
            raise
        result.special = None  # the original cannot run them: nothing to compare
        return
    try:
        actual = outputs("optimized", optimized_source, with_library)
    except Exception as e:
        if isinstance(e, LibraryError):
            raise
        run.error = f"onnxruntime cannot run the optimized model: {ort_error_text(e)}"
        return
    for name, elem, e, a in zip(names, types, expected, actual):
        run.outputs.append(compare_output(name, elem, e, a))
