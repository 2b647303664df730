"""What one fused op is: its contract as data, the same shape for every op.

A fused op's module (onnxfuse/ops/<op>.py) builds one FusedOp: the node's name in the onnxfuse
domain and the op set it was defined in, its attributes, its inputs and outputs as the native
library registers them, the providers with a kernel of ours, where those kernels and the CUDA
generator live, the pass that writes it, a numpy model of what it computes, and the figures that
decide when it pays (the module's constants, read by its pass).

This module imports numpy and nothing of the package above the fused-node helpers: onnxfuse.ops
is read by runtime and target at start-up. A numpy model that needs the expression programs
imports onnxfuse.program when it runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..fused import DOMAIN, DOMAIN_VERSION

# onnxruntime's names for the providers a custom op registers on.
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
# --target's names for them (onnxfuse/target.py).
PROVIDER_OF_TARGET = {"cpu": CPU, "cuda": CUDA}

# Attributes every fused node may carry besides its contract's: the op set it was written for
# (fused.OPSET_ATTRIBUTE) and, on --target cuda, the compiled kernel and its launch description
# (names starting with CUDA_PREFIX, written by the op's generator and by cuda-compile).
OPSET_ATTRIBUTE = "onnxfuse_opset"
CUDA_PREFIX = "cuda_"


@dataclass(frozen=True)
class Port:
    """An input or output. A variadic port repeats, at least `min_arity` times, and must be the
    only port of its side (onnxruntime's custom ops have one variadic port, the last); an
    optional port may be left out, as may every port after it."""

    name: str
    doc: str
    optional: bool = False
    variadic: bool = False
    min_arity: int = 1
    dtype: str = "float32"  # the element type the kernels take; "any": a program's dtypes


@dataclass(frozen=True)
class Attribute:
    name: str
    kind: str  # "int", "float", "string", "ints"
    doc: str
    default: object = None  # None: the pass always writes it


@dataclass(frozen=True)
class FusedOp:
    name: str
    summary: str
    # The kernel source registering the op on each provider that has one (kernels/*.cc). Where
    # none is registered the node runs its model-local fallback function (always correct, never
    # faster than the original).
    kernels: dict[str, str] = field(compare=False)
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attributes: tuple[Attribute, ...] = ()
    pass_name: str = ""  # the pass that writes the op (passes/)
    cuda_generator: str | None = None  # the module generating its CUDA kernel (onnxfuse/cuda/)
    # numpy model: reference(inputs, attributes, number of outputs) -> the outputs, what a node
    # computes (its kernels may round differently where the fallback would too).
    reference: Callable[[list, dict, int], list[np.ndarray]] | None = field(default=None, compare=False)
    # A short description of one node's form (what a kernel specialises on), from its attributes
    # and its input and output counts: `onnxfuse cuda-audit` prints it.
    form: Callable[[dict, int, int], str] | None = field(default=None, compare=False)
    domain: str = DOMAIN
    since_version: int = DOMAIN_VERSION

    def __post_init__(self) -> None:
        for side in (self.inputs, self.outputs):
            if any(p.variadic for p in side) and len(side) != 1:
                raise ValueError(f"{self.name}: a variadic port must be its side's only port")
            optional = [p.optional for p in side]
            if any(a and not b for a, b in zip(optional, optional[1:])):
                raise ValueError(f"{self.name}: a required port follows an optional one")
        unknown = set(self.kernels) - {CPU, CUDA}
        if unknown:
            raise ValueError(f"{self.name}: unknown providers {sorted(unknown)}")

    @property
    def providers(self) -> frozenset[str]:
        """The providers the native library registers a kernel of the op on."""
        return frozenset(self.kernels)

    @property
    def targets(self) -> tuple[str, ...]:
        """The --target values with a kernel of the op: where the pass writing it applies."""
        return tuple(t for t, p in PROVIDER_OF_TARGET.items() if p in self.kernels)

    @property
    def cuda_kernel(self) -> bool:
        # A CUDA kernel of ours launches the kernel compiled and stored with the node
        # (--target cuda); a node without one must run its fallback function instead.
        return CUDA in self.providers

    @property
    def attribute_names(self) -> frozenset[str]:
        return frozenset(a.name for a in self.attributes)

    def unknown_attributes(self, names) -> list[str]:
        """The names among `names` that this contract does not allow on a node of the op."""
        return sorted(n for n in names if n not in self.attribute_names and n != OPSET_ATTRIBUTE
                      and not n.startswith(CUDA_PREFIX))

    def signature(self, side: str) -> tuple[int, int, int, int]:
        """(ports, required ports, variadic minimum arity or 0, homogeneous) of `side` ("inputs"
        or "outputs"), as the native library declares them (kernels/fused_ops.h) and reports
        them (OnnxfuseLibraryInfo's "signatures")."""
        ports = getattr(self, side)
        variadic = ports[0].min_arity if len(ports) == 1 and ports[0].variadic else 0
        homogeneous = int(not variadic or ports[0].dtype != "any")
        return len(ports), sum(1 for p in ports if not p.optional), variadic, homogeneous


def activation_attributes(name: str, params: str, doc: str) -> tuple[Attribute, ...]:
    """An activation the kernel applies: its program name (attribute `name`) and its two
    parameters (`params`_alpha, `params`_beta), 0 where the activation takes fewer."""
    return (Attribute(name, "string", f"{doc} (a program name, or none)"),
            Attribute(f"{params}_alpha", "float", "its first parameter", 0.0),
            Attribute(f"{params}_beta", "float", "its second parameter", 0.0))


def text(v) -> str:
    """An attribute value as text (onnx gives strings as bytes)."""
    return v.decode() if isinstance(v, bytes) else str(v)


def activation(v: np.ndarray, name: str, alpha: float = 0.0, beta: float = 0.0) -> np.ndarray:
    """An activation by its program name (onnxfuse/program.py: relu, sigmoid, hardsigmoid,
    leakyrelu, clip, ...; silu as v * sigmoid(v); none), as every fused op's kernels run it."""
    from ..program import OPS, Program

    if name == "none":
        return v
    p = Program()
    x = p.add_input("f32")
    if name == "silu":
        y = p.emit("mul", x, p.emit("sigmoid", x))
    else:
        y = p.emit(name, x, params=(alpha, beta)[:OPS[name].nparams])
    p.add_output(y, "f32")
    with np.errstate(all="ignore"):
        return p.evaluate(np.asarray(v, np.float32))[0]
