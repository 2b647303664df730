"""The Python entry point: `onnxfuse.optimize(model, ...)`.

    import onnxfuse
    result = onnxfuse.optimize("model.onnx", dims={"batch": 4})
    onnxfuse.save(result.model, "model.opt.onnx")
    print(result.summary["kernels_after"], result.passes)

The CLI's `onnxfuse optimize` is this function plus argument parsing and printing.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import onnx

from .fused import DOMAIN
from .dimchoice import DimChoice, choose_verify_dims
from .inputs import check_dims, effective_dims
from .modelio import SPLIT_MIN_FILE_BYTES, InputError, LoadedModel, check_model, parse_model
from .modelsave import save_model
from .normalize import normalize
from .optimize_options import OptimizeOptions
from .pipeline import Context, PassOptions, PassStats, run_passes, select_passes
from .verify import Verification, VerificationError, choose_mode, verify
from .weights import hold_inline_weights_by_reference, inline_scratch_references
from .zoo import ZooModel, resolve_input


@dataclass
class OptimizeResult:
    model: onnx.ModelProto
    passes: list[PassStats]
    summary: dict
    verification: Verification | None = None
    notes: list[str] = field(default_factory=list)

    def report(self) -> dict:
        """What `--report FILE.json` holds: per-pass statistics and the summary."""
        return {"summary": self.summary, "passes": [p.as_dict() for p in self.passes]}


def fused_ops(model: onnx.ModelProto) -> dict[str, int]:
    return dict(Counter(n.op_type for n in model.graph.node if n.domain == DOMAIN).most_common())


def unmatched(ctx: Context, model: onnx.ModelProto) -> dict[str, dict[str, list[str]]]:
    """Why each pass left the candidates it rejected, pass -> node -> its reasons (the first
    round's first), for the nodes still in the optimized model (a candidate another pass took is
    no longer of interest)."""
    left = {n.name for n in model.graph.node}
    out = {}
    for pass_name, reasons in ctx.rejections.items():
        kept = {node: list(why) for node, why in reasons.items() if node in left}
        if kept:
            out[pass_name] = kept
    return out


def op_types(model: onnx.ModelProto) -> dict[str, int]:
    """Nodes of the main graph by op type, most frequent first; ops of a domain other than the
    default one are named domain.op_type."""
    return dict(Counter(f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                        for n in model.graph.node).most_common())


def _as_loaded(model, label: str | None) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        label = label or (model.graph.name or "model")
        check_model(copy, label)
        hold_inline_weights_by_reference(copy, SPLIT_MIN_FILE_BYTES)
        return LoadedModel(copy, label)
    if isinstance(model, (bytes, bytearray)):
        label = label or "model"
        proto = parse_model(bytes(model), label)
        check_model(proto, label)
        hold_inline_weights_by_reference(proto, SPLIT_MIN_FILE_BYTES)
        return LoadedModel(proto, label)
    # The optimizer holds external weights by reference: its memory does not grow with them.
    return resolve_input(str(model), weights_on_disk=True)


def optimize(
    model: onnx.ModelProto | bytes | str | LoadedModel,
    passes: Sequence[str] | None = None,
    target: str = "cpu",
    arch: str | None = None,
    verify_outputs: bool = True,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    count_kernels: bool = True,
    threads: int | None = None,
    fallback_check: bool = True,
    label: str | None = None,
    tune: bool = False,
    options: Mapping[str, object] | None = None,
    verify_mode: str = "auto",
    progress: Callable[[str], None] | None = None,
    settings: OptimizeOptions | None = None,
) -> OptimizeResult:
    """Optimize a model (ModelProto, serialized bytes, a path or "zoo:NAME").

    settings: what to do, as one OptimizeOptions (what the command line fills); when given, the
        keyword arguments from `passes` to `verify_mode` are not read. Otherwise they are its
        fields (verify_outputs is `verify`, options is `pass_options`).
    passes: pass names to run (default: the default pipeline for the target).
    verify_outputs: run original and optimized in onnxruntime on seeded random inputs
        (symbolic dims from `dims`; unset ones at values chosen to exercise the model, see
        dimchoice.py, named in summary["dims_chosen"]) and raise VerificationError on a mismatch.
    count_kernels: put kernels per inference before/after (onnxruntime profiler, CPU,
        ORT_ENABLE_ALL) into the summary.
    tune: --target cuda: choose each Conv layer's tile by timing the candidates on this
        machine's GPU (needs pycuda and a CUDA device; the documented heuristic otherwise).
    options: further pass options by name (pipeline.PassOptions), for benchmarks and tests.
    verify_mode: "whole" compares the two models' outputs; "regions" each fused node against
        its fallback body (region_verify.py), for models too large to run whole; "auto" (default)
        picks "whole" unless its estimated memory exceeds what is available.
    progress: called with a short description as each stage (and each pass) starts, for a
        progress display.
    Raises InputError for bad input (bad model, unknown pass, bad dims).
    """
    t_start = time.perf_counter()
    stage = progress or (lambda text: None)
    if settings is None:
        settings = OptimizeOptions(
            passes=tuple(passes) if passes is not None else None, target=target, arch=arch, tune=tune,
            verify=verify_outputs, fallback_check=fallback_check, verify_mode=verify_mode, dims=dict(dims or {}),
            seed=seed, threads=threads, count_kernels=count_kernels, pass_options=dict(options or {}))
    settings.check()
    o = settings
    passes, target, arch, tune, verify_outputs, fallback_check, verify_mode = (
        o.passes, o.target, o.arch, o.tune, o.verify, o.fallback_check, o.verify_mode)
    dims, seed, threads, count_kernels, options = o.dims, o.seed, o.threads, o.count_kernels, o.pass_options
    try:
        chosen = select_passes(list(passes) if passes is not None else None, target)
    except ValueError as e:
        raise InputError(f"--passes: {e}") from None
    stage(f"loading {label or (model if isinstance(model, str) else 'the model')}")
    loaded = normalize(_as_loaded(model, label))
    check_dims(dict(dims or {}), [loaded.model])
    given_dims = {**loaded.dims, **dict(dims or {})}
    merged_dims = effective_dims([loaded.model], given_dims)
    original = loaded.model
    t_loaded = time.perf_counter()

    # Passes whose rule depends on a size read symbolic dims as the caller declared them
    # (--dim; a zoo model's defaults), 1 otherwise: a size verification picks to exercise the
    # model (dimchoice.py) says nothing about the size it will run at.
    try:
        pass_options = PassOptions.from_mapping({"dims": dict(merged_dims), **dict(options or {}),
                                                 **({"tune": True} if tune else {})})
    except (TypeError, ValueError) as e:
        raise InputError(f"options: {e}") from None
    ctx = Context(target=target, arch=arch, options=pass_options, explain=frozenset(o.explain))
    # run_passes works on its own copy (pipeline.import_graph) and leaves `original` as it is.
    stage("running passes")
    optimized, stats = run_passes(original, chosen, ctx,
                                  on_pass=lambda name, round_: stage(f"pass {name} (round {round_ + 1})"))
    t_passes = time.perf_counter()

    verification = None
    kernels_before = kernels_after = None
    kernel_note = None
    # Kernel counts are defined on the CPU provider with ORT_ENABLE_ALL (there on every machine).
    # Verification runs there too, except for --target cuda on a machine with a usable GPU,
    # where the CUDA kernels the fused ops get are what must be checked.
    verify_provider = "cpu"
    if target == "cuda" and verify_outputs:
        from .profile import cuda_usable

        if cuda_usable():
            verify_provider = "cuda"
        else:
            kernel_note = "no usable GPU here: kernels counted and outputs checked on the CPU provider"
    choice = None
    too_large = _too_large_to_count(original, optimized) if count_kernels and not verify_outputs else None
    if verify_outputs:
        mode, why = choose_mode(original, optimized, verify_mode)
    if (verify_outputs and mode == "whole") or (count_kernels and not verify_outputs and not too_large):
        stage("choosing the symbolic dims to run at")
        choice = choose_verify_dims(original, given_dims, seed, threads)
    elif verify_outputs:  # regions: each region's shapes at the dims as declared, 1 where unset
        choice = DimChoice([merged_dims], {n: "given" if n in given_dims else "1 (region-level verification)"
                                           for n in merged_dims})
    run_dims = choice.dims if choice else merged_dims
    if verify_outputs:
        stage("verifying against the original in onnxruntime" if mode == "whole"
              else "verifying each fused node against its fallback body")
        verification = verify(
            original, optimized, run_dims, seed, provider=verify_provider, threads=threads,
            fallback=fallback_check, original_label=loaded.label, mode=mode,
        )
        for other in choice.settings[1:] if verification.ok else []:
            stage(f"verifying at {', '.join(f'{k}={v}' for k, v in other.items())}")
            verification.more.append(verify(
                original, optimized, other, seed, provider=verify_provider, threads=threads,
                fallback=fallback_check, original_label=loaded.label, mode=mode))
        if mode == "regions":
            kernel_note = kernel_note or "kernels not counted (region-level verification: the whole model was not run)"
        verification.mode_reason = why
        if verify_provider == "cpu":
            kernels_before = verification.original_profile
            kernels_after = verification.optimized_profile
    if too_large:
        kernel_note = too_large
    elif count_kernels and kernels_before is None and (verification is None or verification.mode == "whole") and (
            verification is None or verification.ok):
        stage("counting kernels")
        kernels_before, kernels_after, note = _count_before_after(
            original, optimized, loaded.label, run_dims, seed, threads)
        kernel_note = note or kernel_note
    t_verified = time.perf_counter()

    notes = list(loaded.notes)
    if choice and choice.note:
        notes.append(choice.note)
    if ctx.tune_unavailable:
        notes.append(f"--tune: heuristic tiles used ({ctx.tune_unavailable})")
    summary = {
        "input": loaded.label,
        "target": target,
        "arch": arch,
        "passes_run": [p.name for p in chosen],
        "nodes_before": len(original.graph.node),
        "nodes_after": len(optimized.graph.node),
        "op_types_before": op_types(original),
        "op_types_after": op_types(optimized),
        "bytes_before": model_bytes(original),
        "bytes_after": model_bytes(optimized),
        "fused_ops": fused_ops(optimized),
        "softmax_left": sum(1 for n in optimized.graph.node if n.op_type == "Softmax" and n.domain in ("", "ai.onnx")),
        "unmatched": unmatched(ctx, optimized),
        "kernels_before": kernels_before.kernels_per_inference if kernels_before else None,
        "kernels_after": kernels_after.kernels_per_inference if kernels_after else None,
        "kernels_by_op_before": kernels_before.by_op_type if kernels_before else None,
        "kernels_by_op_after": kernels_after.by_op_type if kernels_after else None,
        "library_loaded": kernels_after.library_loaded if kernels_after else None,
        "kernel_note": kernel_note,
        "dims": run_dims,
        "dims_chosen": choice.as_dict() if choice else None,
        "verification": verification.as_dict() if verification else None,
        "notes": notes,
        "seconds": {
            "load": round(t_loaded - t_start, 4),
            "passes": round(t_passes - t_loaded, 4),
            "verify": round(t_verified - t_passes, 4) if (verify_outputs or count_kernels) else 0.0,
            "total": round(t_verified - t_start, 4),
        },
    }
    if isinstance(model, (onnx.ModelProto, bytes, bytearray)):
        # An in-memory model's large weights were held on disk while the passes ran (_as_loaded);
        # the caller gets a model that owns its weights, as it gave one.
        inline_scratch_references(optimized)
    result = OptimizeResult(optimized, stats, summary, verification, notes)
    if verification is not None and not verification.ok:
        raise VerificationError(f"verification failed: {verification.first_problem()}", result=verification)
    return result


def model_bytes(model: onnx.ModelProto) -> int:
    """The model's size as files: its serialized message with the tensors it holds by
    reference (external data, read from a `.data` file or spilled to scratch) counted inline."""
    from .weights import inline_size

    return inline_size(model)


# Without verification, kernels are counted only for models of at most this many bytes of
# weights: counting runs the whole model, and a --no-verify run of a large model is to stay
# within bounded memory.
KERNEL_COUNT_MAX_WEIGHT_BYTES = 256 << 20


def _too_large_to_count(original, optimized) -> str | None:
    from .verify import weight_bytes

    size = max(weight_bytes(original), weight_bytes(optimized))
    if size <= KERNEL_COUNT_MAX_WEIGHT_BYTES:
        return None
    return (f"kernels not counted without verification for {size / 1e9:.1f} GB of weights"
            " (`onnxfuse profile` counts them)")


def _count_before_after(original, optimized, label, dims, seed, threads):
    from .ortfiles import runtime_sources

    # weights held by reference go through model files; inline ones are serialized as they are
    with runtime_sources([original, optimized], share_weights=False) as (original_source, optimized_source):
        return _count_models(original, optimized, label, dims, seed, threads, original_source, optimized_source)


def _count_models(original, optimized, label, dims, seed, threads, original_source, optimized_source):
    """Kernel profiles of both models on the CPU provider (ORT_ENABLE_ALL). The original not
    running is bad input; the optimized one not running (unverified) is reported in the note."""
    from .environment import ort_error_text
    from .profile import kernel_profile
    from .runtime import LibraryError
    from .inputs import UnfeedableInputError, random_inputs

    try:
        random_inputs(original, dims, seed)
    except UnfeedableInputError as e:  # e.g. sequence inputs: nothing to count with, but nothing wrong
        return None, None, f"kernels not counted: {e}"
    try:
        before = kernel_profile(original_source, dims=dims, seed=seed, threads=threads)
    except (InputError, LibraryError):
        raise
    except Exception as e:  # onnxruntime's exception types
        raise InputError(f"{label}: onnxruntime cannot run it: {ort_error_text(e)}") from None
    try:
        return before, kernel_profile(optimized_source, dims=dims, seed=seed, threads=threads), None
    except (InputError, LibraryError):
        raise
    except Exception as e:  # onnxruntime's exception types
        return before, None, f"onnxruntime cannot run the optimized model: {ort_error_text(e)}"


def optimize_for_baseline(model: ZooModel) -> OptimizeResult:
    """Optimize a zoo model with the default CPU pipeline the way the regression suite does:
    verified against the original on seeded inputs (dims = the model's defaults), kernels per
    inference counted before and after (onnxruntime ORT_ENABLE_ALL, CPU provider, 1 thread).
    Raises VerificationError on a mismatch."""
    return optimize(model.load(), dims=model.dims or None, threads=1, label=model.uri)


def save(model: onnx.ModelProto, path: str) -> list[str]:
    """Write a model atomically with an IR version onnxruntime accepts (see modelsave.save_model)."""
    return save_model(model, path)


def load(path: str) -> onnx.ModelProto:
    """Load a model file (or zoo:NAME) with its external data, checked and normalized."""
    return normalize(resolve_input(path)).model
