"""What `optimize` is asked to do, as one object: the CLI fills it from its options, Python
callers pass it to onnxfuse.optimize (or the same fields as keywords), and both get the same
checks, each error naming the option as the command line spells it.

Imports nothing of the package at module level: the command line builds and checks it before
onnx is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .errors import InputError

VERIFY_MODES = ("auto", "whole", "regions")


class OptionError(InputError):
    """An option value or combination that cannot run; `option` is its command-line name."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class OptimizeOptions:
    """passes: pass names to run (None: the target's default pipeline).
    target, arch: what fused ops get kernels for (arch: the CUDA architecture, sm_NN, cuda only).
    tune: --target cuda: time each Conv layer's tile candidates on this machine's GPU.
    verify: compare original and optimized in onnxruntime (seeded inputs; symbolic dims from
        `dims`, default 1); fallback_check: also the optimized model without our library;
        verify_mode: "whole", "regions" (each fused node against its fallback body) or "auto".
    count_kernels: kernels per inference before/after (CPU provider, ORT_ENABLE_ALL).
    pass_options: further pass options by name (pipeline.PassOptions), for benchmarks and tests.
    explain: passes whose every candidate left unrewritten gets its reason in the summary's
        "unmatched" (--explain; fuse-attention's are there always).
    """

    passes: tuple[str, ...] | None = None
    target: str = "cpu"
    arch: str | None = None
    tune: bool = False
    verify: bool = True
    fallback_check: bool = True
    verify_mode: str = "auto"
    dims: Mapping[str, int] = field(default_factory=dict)
    seed: int = 0
    threads: int | None = None
    count_kernels: bool = True
    pass_options: Mapping[str, object] = field(default_factory=dict)
    explain: tuple[str, ...] = ()

    def check(self) -> OptimizeOptions:
        """Raises OptionError for a value or combination that cannot run; returns self."""
        from .target import NAMES

        if self.target not in NAMES:
            raise OptionError("--target", f"unknown target '{self.target}' (known: {', '.join(NAMES)})")
        if self.arch is not None and self.target != "cuda":
            raise OptionError("--arch", "--arch applies to --target cuda only")
        if self.tune and self.target != "cuda":
            raise OptionError("--tune", "--tune applies to --target cuda only")
        if self.arch is not None and not (self.arch.startswith("sm_") and self.arch[3:].isdigit()):
            raise OptionError("--arch", f"'{self.arch}': expected sm_NN, e.g. sm_90")
        if self.verify_mode not in VERIFY_MODES:
            raise OptionError("--verify-mode", f"unknown verify mode '{self.verify_mode}' "
                                               f"(known: {', '.join(VERIFY_MODES)})")
        return self

    @property
    def compiles_cuda(self) -> bool:
        """Whether the run compiles kernels with nvcc (cuda-compile runs)."""
        return self.target == "cuda" and (self.passes is None or "cuda-compile" in self.passes)
