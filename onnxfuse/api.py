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
from typing import Mapping, Sequence

import onnx

from .fused import DOMAIN
from .modelio import InputError, LoadedModel, normalize, parse_model, check_model, resolve_input, save_model
from .pipeline import TARGETS, Context, PassStats, run_passes, select_passes
from .verify import Verification, VerificationError, check_dims, effective_dims, verify


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


def _as_loaded(model, label: str | None) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        label = label or (model.graph.name or "model")
        check_model(copy, label)
        return LoadedModel(copy, label)
    if isinstance(model, (bytes, bytearray)):
        label = label or "model"
        proto = parse_model(bytes(model), label)
        check_model(proto, label)
        return LoadedModel(proto, label)
    return resolve_input(str(model))


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
) -> OptimizeResult:
    """Optimize a model (ModelProto, serialized bytes, a path or "zoo:NAME").

    passes: pass names to run (default: the default pipeline for the target).
    verify_outputs: run original and optimized in onnxruntime on seeded random inputs
        (symbolic dims from `dims`, default 1) and raise VerificationError on a mismatch.
    count_kernels: put kernels per inference before/after (onnxruntime profiler, CPU,
        ORT_ENABLE_ALL) into the summary.
    Raises InputError for bad input (bad model, unknown pass, bad dims).
    """
    t_start = time.perf_counter()
    if target not in TARGETS:
        raise InputError(f"unknown target '{target}' (known: {', '.join(TARGETS)})")
    if arch is not None and target != "cuda":
        raise InputError("--arch applies to --target cuda only")
    try:
        chosen = select_passes(list(passes) if passes is not None else None, target)
    except ValueError as e:
        raise InputError(f"--passes: {e}") from None
    loaded = normalize(_as_loaded(model, label))
    check_dims(dict(dims or {}), [loaded.model])
    merged_dims = effective_dims([loaded.model], {**loaded.dims, **dict(dims or {})})
    original = loaded.model
    t_loaded = time.perf_counter()

    ctx = Context(target=target, arch=arch)
    work = onnx.ModelProto()
    work.CopyFrom(original)
    optimized, stats = run_passes(work, chosen, ctx)
    t_passes = time.perf_counter()

    verification = None
    kernels_before = kernels_after = None
    kernel_note = None
    # Verification and kernel counts both run on the CPU provider: that is where ORT_ENABLE_ALL
    # counts are defined, and it is there on every machine.
    if verify_outputs:
        verification = verify(
            original, optimized, merged_dims, seed, provider="cpu", threads=threads,
            fallback=fallback_check, original_label=loaded.label,
        )
        if verification.original_profile is not None:
            kernels_before = verification.original_profile
        if verification.optimized_profile is not None:
            kernels_after = verification.optimized_profile
    elif count_kernels:
        from .profile import kernel_profile

        try:
            kernels_before = kernel_profile(original, dims=merged_dims, seed=seed, threads=threads)
        except InputError:
            raise
        except Exception as e:  # onnxruntime's exception types
            from .modelio import ort_error_text
            from .runtime import LibraryError

            if isinstance(e, LibraryError):
                raise
            raise InputError(f"{loaded.label}: onnxruntime cannot run it: {ort_error_text(e)}") from None
        try:
            kernels_after = kernel_profile(optimized, dims=merged_dims, seed=seed, threads=threads)
        except InputError:
            raise
        except Exception as e:  # not verified: an optimized model that does not run is reported
            from .modelio import ort_error_text
            from .runtime import LibraryError

            if isinstance(e, LibraryError):
                raise
            kernel_note = f"onnxruntime cannot run the optimized model: {ort_error_text(e)}"
    t_verified = time.perf_counter()

    summary = {
        "input": loaded.label,
        "target": target,
        "arch": arch,
        "passes_run": [p.name for p in chosen],
        "nodes_before": len(original.graph.node),
        "nodes_after": len(optimized.graph.node),
        "fused_ops": fused_ops(optimized),
        "kernels_before": kernels_before.kernels_per_inference if kernels_before else None,
        "kernels_after": kernels_after.kernels_per_inference if kernels_after else None,
        "kernels_by_op_before": kernels_before.by_op_type if kernels_before else None,
        "kernels_by_op_after": kernels_after.by_op_type if kernels_after else None,
        "library_loaded": kernels_after.library_loaded if kernels_after else None,
        "kernel_note": kernel_note,
        "dims": merged_dims,
        "verification": verification.as_dict() if verification else None,
        "notes": list(loaded.notes),
        "seconds": {
            "load": round(t_loaded - t_start, 4),
            "passes": round(t_passes - t_loaded, 4),
            "verify": round(t_verified - t_passes, 4) if (verify_outputs or count_kernels) else 0.0,
            "total": round(t_verified - t_start, 4),
        },
    }
    result = OptimizeResult(optimized, stats, summary, verification, list(loaded.notes))
    if verification is not None and not verification.ok:
        raise VerificationError(f"verification failed: {verification.first_problem()}", result=verification)
    return result


def save(model: onnx.ModelProto, path: str) -> list[str]:
    """Write a model atomically with an IR version onnxruntime accepts (see modelio.save_model)."""
    return save_model(model, path)


def load(path: str) -> onnx.ModelProto:
    """Load a model file (or zoo:NAME) with its external data, checked and normalized."""
    return normalize(resolve_input(path)).model
