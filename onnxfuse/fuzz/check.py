"""Checking a case: optimize it, run both models in onnxruntime and compare; a difference is
excused only where it is explained position by position (see `unexplained`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .cases import build_case
from .generate import F16, F64
from .variants import (FLOAT_TYPES, _every_value_an_output, _float64_outputs, _relu_on_flat_tensors,  # noqa: F401
                       _to_float64, casts_double_to_half, float16_in_float32, near_equal_variant, node_by_node,
                       rounding_noise_variants, scaling_node, value_types, wrapped_in_a_function,
                       zero_tie_variants)



def _run(model: onnx.ModelProto, feeds, with_library: bool, level: str = "all"):
    from ..runtime import make_session

    sess = make_session(model, with_library=with_library, threads=1, level=level)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) of an output comparison. float16 regions compute in float32 and round once
    on store, where onnxruntime rounds after every op: a few half-precision ulps apart."""
    if np.dtype(dtype) == np.float16:
        return 2e-2, 2e-2
    return 1e-4, 1e-5


# Relative perturbations of the float inputs an excuse may use: a few ulps, and the rounding noise
# two correct implementations may put between intermediate values. Relative only: zeros, infinities
# and NaNs stay what they are, so a difference they cause is never excused.
PERTURBATIONS = {F16: (1e-3, 4e-3), F64: (4e-16, 1e-12)}
PERTURBATIONS_F32 = (3e-7, 4e-6)
PERTURBED_DRAWS = 3
# An output position whose original moves by more than this many tolerances when its inputs move
# by rounding noise is ill-conditioned (see `unexplained`).
ILL_CONDITIONED = 100


def perturbed_feeds(feeds: dict, dtype: int):
    """Copies of `feeds` with every float element moved by a random relative amount."""
    rng = np.random.default_rng(7)
    for scale in PERTURBATIONS.get(dtype, PERTURBATIONS_F32):
        for _ in range(PERTURBED_DRAWS):
            moved = {}
            for k, v in feeds.items():
                if v.dtype.kind == "f":
                    factor = 1 + scale * rng.uniform(-1.0, 1.0, v.shape)
                    with np.errstate(all="ignore"):
                        # np.asarray: arithmetic on a 0-d array gives a numpy scalar, which onnxruntime refuses
                        v = np.asarray((v.astype(np.float64) * factor).astype(v.dtype))
                moved[k] = v
            yield moved


def _close(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """Elementwise: equal within tolerance, NaN for NaN, an infinity for the same infinity."""
    with np.errstate(all="ignore"):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        finite = np.isfinite(a64) & np.isfinite(b64)  # inf - -inf is within rtol * inf: infinities must be equal
        near = (finite & (np.abs(a64 - b64) <= atol + rtol * np.abs(b64))) | (a64 == b64)
        zeros = (a64 == 0) & (b64 == 0)
        near &= ~zeros | (np.signbit(a64) == np.signbit(b64))
        return near | (np.isnan(a64) & np.isnan(b64))


def differing(want: np.ndarray, have: np.ndarray, loose: bool) -> np.ndarray:
    """Mask of the elements where `have` does not match `want` (as `compare` judges them): all of
    them where the shapes differ (an explanation's run whose output has another shape explains
    nothing, and broadcast it would index past `have`: seed 9468840)."""
    if want.shape != have.shape:
        return np.ones(have.shape, bool)
    if want.dtype.kind not in "fc":
        return np.asarray(have != want)
    rtol, atol = tolerance(np.float16 if loose else want.dtype)
    return ~_close(have, want, rtol, atol)


def unexplained(model: onnx.ModelProto, feeds: dict, ref: dict, got: dict, dtype: int,
                without_library: bool = False) -> str | None:
    """None when every element where `got` (the optimized model) differs from `ref` (the original
    in onnxruntime) is explained at that same position, else why not.

    A position is explained when the original itself moves there: run in onnxruntime with its
    graph rewrites, with every value a graph output, with each Relu on its input flattened, as
    one model-local function (with its graph rewrites), or node by node with each value in its declared type
    (also with each Cast of a double to float16 rounded once, as Cast is defined) (onnxruntime's other answers for the same
    computation), or on inputs
    moved by a few ulps or by rounding noise, or with the operands of its jump operators (Ceil,
    comparisons, Cast...) moved by rounding noise (relative moves: exact zeros, infinities and
    NaNs stay; jump_variants; a comparison's two operands move apart; last, each operator's alone),
    it gives our value there; or when
    its runs on moved inputs give finite values on both sides of our finite nonzero value, or,
    where they spread over ILL_CONDITIONED tolerances, within that spread of them (an
    ill-conditioned position); or when our value is at least as close to the exact result
    (the original evaluated in float64) there as onnxruntime's, both being finite; or when ours
    is the NaN or infinity the exact result is and onnxruntime's value is finite, or ours is the
    finite exact result where onnxruntime gives NaN or an infinity; or, for a zero of the other
    sign only, when the original has a Max/Min of -0 and +0 (an opset-18 float16 Relu of -0 is
    one) or a MatMul/Gemm/Conv giving an exact zero (onnxruntime's own kernels choose that sign
    differently). An infinity of the other sign is only explained by the first. without_library:
    `got` is the optimized model without our library (the original's nodes in functions), for
    which a float16 original computed in float32 throughout is one more of onnxruntime's answers."""
    loose = dtype == F16
    masks = {}
    for name, want in ref.items():
        have = got.get(name)
        if have is None or have.shape != want.shape or have.dtype != want.dtype:
            return f"output {name} has another shape or type"
        masks[name] = differing(want, have, loose)
    open_ = {k: m for k, m in masks.items() if m.any()}
    # onnxruntime's own graph rewrites change some special values (Where(Not(c), x, y) becomes
    # Where(c, y, x), and its Where gives +0 for a -0 taken from X only): at level "all" the
    # original gives onnxruntime's other answer. So does the original with every value a graph
    # output: its float16 Sign of NaN was NaN there and 0 alone (seed 5966).
    # Its float16 Relu (in an opset-18 model it runs the function body, Max(X, 0)) gives -0 or +0
    # for -0 by the tensor's shape: on the same values flattened it gives its other answer (seed 1241).
    runs = [(model, feeds, "all"), (_every_value_an_output(model), feeds, "disable"),
            (_relu_on_flat_tensors(model), feeds, "disable")]
    runs += [(model, moved, "disable") for moved in perturbed_feeds(feeds, dtype)]
    noisy = list(rounding_noise_variants(model, PERTURBATIONS.get(dtype, PERTURBATIONS_F32)[0]))
    runs += [(variant, feeds, "disable") for variant in noisy]
    runs += [(variant, feeds, "disable") for variant in jump_variants(model, dtype)]
    runs += [(variant, feeds, "disable") for variant in zero_tie_variants(model)]
    # Equal taken as near-equal, alone and with the jump operands moved (a tie that then decides
    # a later comparison: seed 9218161)
    scale = PERTURBATIONS.get(dtype, PERTURBATIONS_F32)[-1]
    near = [near_equal_variant(v, 4 * scale) for v in [model, *jump_variants(model, dtype)]]
    runs += [(variant, feeds, "disable") for variant in near if variant is not None]
    # The original as one model-local function, as a fused node's fallback holds its nodes:
    # onnxruntime inlines it and rounds a float16 op's constants (Elu's alpha, CastLike in its
    # opset-18 body) where in the main graph it did not, so its float16 emulation, which
    # compares unrounded float values, moves to other positions (seed 9005431).
    wrapped = wrapped_in_a_function(model)
    if wrapped is not None:
        runs.append((wrapped, feeds, "all"))
    # Its float16 emulation computes float16 ops in float32 and drops the Cast pairs between
    # them, so a float16 value may reach its consumer unrounded: run node by node, each value
    # rounded to its type as the graph says, it gives the graph's answer (seed 6581).
    runs.append((None, feeds, "disable"))
    if casts_double_to_half(model):
        runs.append(("half casts rounded once", feeds, "disable"))
    if without_library:
        # Without our library the optimized model is the original's nodes in model-local
        # functions, and onnxruntime's float16 emulation, inlining them, drops Cast pairs the main
        # graph keeps (a float32 Split between a PRelu and a Cast to bool: seed 9007059): the
        # original computed in float32 throughout is its answer where it drops them all.
        runs.append(("float32", feeds, "disable"))
    spans: dict[str, list] = {}  # name -> the original's finite values under moved inputs
    for variant, moved, level in runs:
        if not open_:
            break
        try:
            if variant is None:
                again = node_by_node(model, moved)
            elif variant == "half casts rounded once":
                again = node_by_node(model, moved, half_casts_rounded_once=True)
            elif variant == "float32":
                again = float16_in_float32(model, moved)
                if again is None:
                    continue
            else:
                again = _run(variant, moved, with_library=False, level=level)
        except Exception:  # onnxruntime's exception types: that draw explains nothing
            continue
        spanning = (variant is model and moved is not feeds) or any(variant is v for v in noisy)
        for name in list(open_):
            want = again[name]
            if spanning and want.shape == got[name].shape:
                spans.setdefault(name, []).append(want)
            explained = ~differing(want, got[name], loose)
            open_[name] = open_[name] & ~explained
            if not open_[name].any():
                del open_[name]
    if open_ and _zero_sign_is_onnxruntimes_choice(model, feeds):
        # onnxruntime's Max and Min of -0 and +0 return either zero by the tensors' lengths and
        # positions (tests/test_special_values.py), and the sign of an exact zero that a sum of
        # products gives (MatMul, Gemm, Conv) depends on how its kernel starts the sum (+0 + -0 is
        # +0), which differs between its kernels for one product and for several: a zero of the
        # other sign downstream of one is one of its answers.
        for name in list(open_):
            want, have = ref[name], got[name]
            if want.dtype.kind == "f":
                open_[name] = open_[name] & ~((want == 0) & (have == 0))
                if not open_[name].any():
                    del open_[name]
    for name in list(open_):
        # Ill-conditioned positions: where the original itself, on inputs moved by rounding
        # noise, gives finite values on both sides of ours, ours is onnxruntime's answer for
        # inputs between those (a Conv summing reciprocals of values near 0, after a
        # BatchNormalization folded into its weights: seed 9013880). Finite nonzero values only.
        want, have = ref[name], got[name]
        if want.dtype.kind != "f" or name not in spans:
            continue
        with np.errstate(all="ignore"):
            seen = np.stack([want] + spans[name]).astype(np.float64)
            ours = have.astype(np.float64)
            rtol, atol = tolerance(np.float16 if loose else want.dtype)
            slack = atol + rtol * np.abs(ours)
            low, high = seen.min(axis=0), seen.max(axis=0)
            # Where rounding noise moves the original's answer by over ILL_CONDITIONED tolerances,
            # the position carries no digit to compare: within S of its answers, S their spread
            # (a Sin of a Pow of 2.7e5 whose exponent an exp one ulp off moves by four ulps:
            # seed 9703068; six draws need not land on both sides of ours).
            spread = np.where(high - low > ILL_CONDITIONED * (atol + rtol * np.abs(want.astype(np.float64))),
                              high - low, 0.0)
            inside = (np.all(np.isfinite(seen), axis=0) & np.isfinite(ours) & (ours != 0)
                      & (low - slack - spread <= ours) & (ours <= high + slack + spread))
        open_[name] = open_[name] & ~inside
        if not open_[name].any():
            del open_[name]
    if open_:
        exact = _float64_outputs(model, feeds)
        for name in list(open_):
            want, have = ref[name], got[name]
            if exact is not None and name in exact and np.shape(exact[name]) != have.shape:
                continue  # the reference evaluator's answer has another shape: it explains nothing
            if exact is not None and name in exact and want.dtype == bool:
                # a comparison's answer of exact arithmetic where onnxruntime's is not: its
                # float32 Sigmoid is 0 for -18.12 (1.35e-8), and Greater(Mean(s*s, s*s, s), s*s)
                # false there (seed 9229080)
                truth = np.asarray(exact[name]).astype(bool)
                open_[name] = open_[name] & ~((have == truth) & (want != truth))
                if not open_[name].any():
                    del open_[name]
                continue
            if exact is None or name not in exact or want.dtype.kind != "f":
                continue
            truth = np.asarray(exact[name])  # float64, or longdouble for a double model
            truth = truth if truth.dtype == np.longdouble else truth.astype(np.float64)
            with np.errstate(all="ignore"):
                ours, theirs = have.astype(np.float64), want.astype(np.float64)
                finite = np.isfinite(ours) & np.isfinite(theirs) & np.isfinite(truth)
                as_close = finite & (np.abs(ours - truth) <= 2 * np.abs(theirs - truth) + 1e-6)
                # Where onnxruntime's value is finite and the exact result a NaN or an infinity
                # (its double Sigmoid flushing 1e-32 to 0 before a Pow, seed 25019), ours may be
                # that NaN or infinity. Never an infinity of the other sign, never a zero of the
                # other sign: there the reference evaluator's own rules (its Relu gives +0 for -0)
                # would speak, not accuracy.
                right_special = np.isfinite(theirs) & ((np.isnan(ours) & np.isnan(truth)) |
                                                       (np.isinf(ours) & (ours == truth)))
                # ... and the reverse: onnxruntime's NaN or infinity where the exact result is
                # finite and ours is it (its float32 Tanh flushes subnormal inputs to 0, so
                # Ceil(tanh(x)) / tanh(x) is 0 / 0 there: seed 3062).
                rtol, atol = tolerance(np.float16 if loose else want.dtype)
                right_finite = (~np.isfinite(theirs) & np.isfinite(truth) & np.isfinite(ours)
                                & (np.abs(ours - truth) <= atol + rtol * np.abs(truth)))
                right_special |= right_finite
                # ... or the exact result of inputs moved by rounding noise (a bfloat16 Cast of a
                # Sin of -756 lands on either side of a midpoint: seed 9456693); where onnxruntime's
                # is NaN, within S of those, S their spread (the Cos of 1.66e38, whose argument the
                # float64 evaluation computes without the overflow to inf: seed 9372421).
                open_here = np.isfinite(truth) & np.isfinite(ours) & ~right_finite & ~as_close
                if open_here.any():
                    low, high = _exact_span(model, feeds, dtype, name, truth)
                    spread = np.where(np.isfinite(theirs), 0.0, high - low)
                    right_special |= (open_here & (np.isfinite(theirs) | (spread > atol + rtol * np.abs(truth)))
                                      & (low - spread <= ours) & (ours <= high + spread))
                sign_of_zero = (ours == 0) & (theirs == 0)
            open_[name] = open_[name] & ~((as_close & ~sign_of_zero) | right_special)
            if not open_[name].any():
                del open_[name]
    # Last, each jump operator's operands moved alone: moving all at once also moves a Pow's
    # exponent after the Cast of a value on a float16 midpoint, and a Sin of 7e34 downstream
    # follows every such move (seed 9094634: onnxruntime's float32 Sigmoid lands on the midpoint).
    jumps = sum(n.op_type in JUMP_OPS for n in model.graph.node)
    for variant in (jump_variants(model, dtype, alone=k) for k in range(jumps) if jumps > 1 and open_):
        for v in variant:
            try:
                again = _run(v, feeds, with_library=False, level="disable")
            except Exception:  # onnxruntime's exception types: that variant explains nothing
                continue
            open_ = {k2: m & differing(again[k2], got[k2], loose) for k2, m in open_.items()}
            open_ = {k2: m for k2, m in open_.items() if m.any()}
    if not open_:
        return None
    name, mask = next(iter(open_.items()))
    i = int(np.flatnonzero(mask.reshape(-1))[0])
    return (f"a deterministic difference at {int(mask.sum())} position(s) of output {name}, e.g. element {i}:"
            f" {got[name].reshape(-1)[i]!r} where onnxruntime gives {ref[name].reshape(-1)[i]!r}, unchanged when"
            " the inputs move by a few ulps, and not closer to the float64 result")


def _exact_span(model: onnx.ModelProto, feeds: dict, dtype, name: str, truth: np.ndarray):
    """The lowest and highest finite float64 value of output `name` over the original's exact
    results on its feeds and on the feeds moved by rounding noise (a move may overflow an input)."""
    seen = [np.asarray(truth, np.float64)]
    for moved in perturbed_feeds(feeds, dtype):
        exact = _float64_outputs(model, moved)
        if exact is not None and name in exact and np.shape(exact[name]) == np.shape(truth):
            seen.append(np.asarray(exact[name]).astype(np.float64))
    stacked = np.stack(seen)
    finite = np.isfinite(stacked)
    with np.errstate(all="ignore"):
        return (np.where(finite, stacked, np.inf).min(axis=0), np.where(finite, stacked, -np.inf).max(axis=0))


# Operators with a jump (a discontinuity): a value within rounding noise of it may land on either
# side in two correct implementations, and everything computed from it follows.
JUMP_OPS = {"Floor", "Ceil", "Round", "Sign", "Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual",
            "Cast", "Pow"}
COMPARISONS = {"Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual"}


def jump_variants(model: onnx.ModelProto, dtype: int, alone: int | None = None):
    """The original with the operands of its jump operators scaled by 1 +- noise (relative: a
    zero, an infinity or a NaN stays), one variant per direction; `alone`: only those of the
    alone-th jump operator. The two operands of a
    comparison move apart, one up and one down (scaling both alike keeps their order, so a
    comparison of values within noise of each other, Less(tanh(x), x) for x = 2.5e-4 where one
    implementation's tanh rounds to x and the other's is an ulp below, could not move: seed
    9016634); both move alike where they are one value, so a value compared with itself stays
    exact."""
    jumps = [n for n in model.graph.node if n.op_type in JUMP_OPS]
    if not jumps:
        return
    types = value_types(model)
    if types is None:
        return
    consts = {t.name for t in model.graph.initializer}
    for scale in PERTURBATIONS.get(dtype, PERTURBATIONS_F32)[1:]:
        for sign in (1.0, -1.0):
            variant = onnx.ModelProto()
            variant.CopyFrom(model)
            graph = variant.graph
            new_nodes = []
            seen = -1
            for n in graph.node:
                seen += n.op_type in JUMP_OPS
                if n.op_type in JUMP_OPS and alone in (None, seen):
                    apart = n.op_type in COMPARISONS and n.input[0] != n.input[1]
                    for k, name in enumerate(n.input):
                        np_type = FLOAT_TYPES.get(types.get(name))
                        if not name or name in consts or np_type is None:
                            continue
                        factor = f"{name}__jump_factor_{k}_{len(new_nodes)}"
                        moved = f"{name}__jump_moved_{k}_{len(new_nodes)}"
                        step = -sign * scale if apart and k == 1 else sign * scale
                        if np_type(1 + step) == 1:
                            # No move in this type (float16 at float32's noise), and a Mul of a
                            # float16 value is one more node onnxruntime computes in float32, its
                            # Cast pair dropped: Cast(Cast(x, float16), float) lost its rounding
                            # (seed 9067949). Left as it is.
                            continue
                        new_nodes.append(scaling_node(graph, name, 1 + step, np_type, factor, moved))
                        n.input[k] = moved
                new_nodes.append(n)
            del graph.node[:]
            graph.node.extend(new_nodes)
            yield variant


SUMS_OF_PRODUCTS = {"MatMul", "Gemm", "Conv", "ConvTranspose"}


def _zero_sign_is_onnxruntimes_choice(model: onnx.ModelProto, feeds: dict) -> bool:
    """Whether some Max or Min of the original (top level) takes -0 and +0 at one position (an
    opset-18 float16 Relu of -0 included), or some MatMul, Gemm or Conv gives an exact zero."""
    pairs = [n.input[:2] for n in model.graph.node if n.op_type in ("Max", "Min") and len(n.input) == 2]
    sums = [n.output[0] for n in model.graph.node if n.op_type in SUMS_OF_PRODUCTS and n.output]
    # onnxruntime runs the float16 Relu of an opset-18 model as its body, Max(X, 0): a Max of -0
    # and +0 wherever X is -0, whose zero flattening does not always move (a 0-d or
    # one-element X gives +0 flat too: seeds 9008093, 9018599).
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    relus = [n.input[0] for n in model.graph.node if n.op_type == "Relu" and opset == 18 and n.input]
    if not pairs and not sums and not relus:
        return False
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output} | set(feeds) | {t.name for t in model.graph.initializer}
    for name in ({x for pair in pairs for x in pair} | set(sums) | set(relus)) - have:
        probe.graph.output.append(onnx.ValueInfoProto(name=name))
    try:
        values = _run(probe, feeds, with_library=False, level="disable")
    except Exception:  # onnxruntime's exception types
        return False
    values.update(feeds)
    values.update({t.name: numpy_helper.to_array(t) for t in model.graph.initializer})
    for name in sums:
        v = values.get(name)
        if v is not None and v.dtype.kind == "f" and np.any(v == 0):
            return True
    for name in relus:
        v = values.get(name)
        if v is not None and v.dtype == np.float16 and np.any((v == 0) & np.signbit(v)):
            return True
    for a, b in pairs:
        x, y = values.get(a), values.get(b)
        if x is None or y is None or x.dtype.kind != "f" or y.dtype.kind != "f":
            continue
        try:
            x, y = np.broadcast_arrays(x, y)
        except ValueError:
            continue
        if np.any((x == 0) & (y == 0) & (np.signbit(x) != np.signbit(y))):
            return True
    return False


def compare(ref: dict, got: dict, loose: bool = False) -> str | None:
    """None when `got` matches `ref`; loose: float16 tolerances for every float output (a float16
    case's values widened to float32 carry float16 rounding differences). Floats match within
    the tolerance, NaN for NaN, an infinity for the same infinity and a zero for a zero of the
    same sign."""
    for name, want in ref.items():
        have = got.get(name)
        if have is None or have.shape != want.shape or have.dtype != want.dtype:
            return (f"output {name}: shape/dtype {None if have is None else (have.shape, have.dtype)}"
                    f" != {(want.shape, want.dtype)}")
        bad = differing(want, have, loose)
        if not bad.any():
            continue
        if want.dtype.kind in "fc":
            with np.errstate(all="ignore"):
                err = np.nanmax(np.abs(have.astype(np.float64) - want)) if want.size else 0.0
            return f"output {name} differs in {int(bad.sum())} elements, max abs error {err:.3g}"
        return f"output {name} differs in {int(bad.sum())} elements"
    return None


@dataclass
class Outcome:
    seed: int
    status: str  # "ok", "tie" (a difference explained at every position, see `unexplained`), "unrunnable"
    # (a valid original onnxruntime itself cannot run) or "fail"
    message: str = ""
    control_flow: bool = False
    fused: int = 0
    salted: bool = False  # special values at some input positions


def optimize_model(model: onnx.ModelProto, passes=None, target: str = "cpu") -> onnx.ModelProto:
    from ..modelio import LoadedModel
    from ..normalize import normalize
    from ..pipeline import Context, run_passes, select_passes

    work = onnx.ModelProto()
    work.CopyFrom(model)
    # As `onnxfuse optimize` does: shape inference first (the passes read inferred shapes).
    work = normalize(LoadedModel(work, "fuzz")).model
    opt, _ = run_passes(work, select_passes(passes, target), Context(target=target))
    return opt


def _fused_count(model: onnx.ModelProto) -> int:
    from ..fused import DOMAIN

    return sum(1 for n in model.graph.node if n.domain == DOMAIN)


def run_case(seed: int, passes=None, idempotence: bool = True) -> Outcome:
    """Build, optimize, check and compare one case."""
    case = build_case(seed)
    model = case.model
    out = Outcome(seed, "ok", control_flow=case.control_flow, salted=bool(case.salted))

    def fail(msg):
        out.status, out.message = "fail", f"seed {seed}: {msg}"
        return out

    try:
        # The reference is the original without onnxruntime's graph rewrites: the plainest semantics.
        ref = _run(model, case.feeds, with_library=False, level="disable")
    except Exception as e:
        # A model onnx's full checker rejects is a generator bug, reported as a failure; a valid
        # model onnxruntime cannot run (for example a Cast pair's result read from an If branch
        # is reported "missing") says nothing about onnxfuse: counted apart, never hidden.
        first = str(e).splitlines()[0][:200]
        try:
            onnx.checker.check_model(model, full_check=True)
        except Exception:
            return fail(f"original model does not run: {first}")
        out.status, out.message = "unrunnable", f"seed {seed}: onnxruntime cannot run the original: {first}"
        return out
    try:
        opt = optimize_model(model, passes)
        onnx.checker.check_model(opt, full_check=True)
    except Exception as e:
        return fail(f"optimize failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    out.fused = _fused_count(opt)
    if idempotence:
        try:
            again = optimize_model(opt, passes)
        except Exception as e:
            return fail(f"optimizing the optimized model failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        if len(again.graph.node) != len(opt.graph.node) or _fused_count(again) != out.fused or \
                [n.op_type for n in again.graph.node] != [n.op_type for n in opt.graph.node]:
            return fail(f"not idempotent: {len(opt.graph.node)} nodes after one run, {len(again.graph.node)} after two")
    level = "all"
    feeds = case.feeds
    for with_library in (False, True):
        try:
            got = _run(opt, feeds, with_library=with_library, level=level)
        except Exception as e:
            err = f"optimized model (library={with_library}) does not run: {str(e).splitlines()[0][:300]}"
            try:
                # onnxruntime's own graph rewrites fail on some valid models (e.g. its
                # Relu+Clip fusion on double Clip bounds): when they fail on the original
                # too, the optimized model is run without them.
                _run(model, feeds, with_library=False, level="all")
            except Exception:
                level = "disable"
                try:
                    got = _run(opt, feeds, with_library=with_library, level=level)
                except Exception as e2:
                    return fail(f"optimized model (library={with_library}) does not run:"
                                f" {str(e2).splitlines()[0][:300]}")
            else:
                return fail(err)
        msg = compare(ref, got, loose=case.dtype == F16)
        if not msg:
            continue
        try:
            why = unexplained(model, feeds, ref, got, case.dtype, without_library=not with_library)
        except Exception as e:  # onnxruntime's exception types
            return fail(f"{msg} (library={with_library}); explaining it failed: {str(e).splitlines()[0][:200]}")
        if why is not None:
            return fail(f"{msg} (library={with_library}): {why}")
        # Excused for this run; the other run (with or without the library) is still checked.
        out.status = "tie"
        out.message = (f"seed {seed}: {msg} (library={with_library}), explained at every position by the"
                       " original (onnxruntime's other answers for the same computation, or its inputs or jump operands"
                       " a few ulps away) or by the float64 result")
    return out


def check_case(seed: int, passes=None) -> str | None:
    """None when the optimized model matches the original, else a description of the failure."""
    o = run_case(seed, passes)
    return o.message if o.status == "fail" else None
