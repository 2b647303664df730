"""kernels/fused_ops.h from the ops table: the names and signatures the kernels register.

    python -m onnxfuse.ops.header            write kernels/fused_ops.h
    python -m onnxfuse.ops.header --check    exit 1 when the file differs from the table

Each kernel registers its op through the header's constants (name, input and output counts,
variadic minimum arity), so a signature changed in an op's module reaches every registration
of it on the next build; tests/test_ops_table.py fails while the header is stale.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import FUSED_OPS
from .contract import CPU, CUDA, FusedOp

HEADER = Path(__file__).resolve().parent.parent.parent / "kernels" / "fused_ops.h"


def _module(op: FusedOp) -> str:
    return op.reference.__module__.rsplit(".", 1)[-1] if op.reference is not None else "?"


def _row(op: FusedOp) -> str:
    cpp = {True: "true", False: "false"}
    n_in, req_in, var_in, homogeneous = op.signature("inputs")
    n_out, req_out, var_out, _ = op.signature("outputs")
    return (f'inline constexpr FusedOpSignature {op.name}{{"{op.name}", {n_in}, {req_in}, {var_in}, {n_out}, {req_out}, '
            f"{var_out}, {cpp[bool(homogeneous)]}, {cpp[CPU in op.providers]}, {cpp[CUDA in op.providers]}}};"
            f"  // ops/{_module(op)}.py")


def render() -> str:
    lines = [
        "// Generated from onnxfuse/ops (python -m onnxfuse.ops.header): do not edit.",
        "//",
        "// The fused ops of the onnxfuse domain: the name and the signature every registration of",
        "// each declares (kernel_util.h: fused_op). tests/test_ops_table.py checks this file against",
        "// the table, and the built library's registrations against both.",
        "#pragma once",
        "",
        "namespace onnxfuse {",
        "",
        "// Inputs, then outputs: ports, required ports, variadic minimum arity (0: not variadic)",
        "// (onnxfuse/ops/contract.py: FusedOp.signature). Homogeneous: float32 tensors, otherwise",
        "// any element type. cpu, cuda: the providers a kernel of ours is registered on.",
        "struct FusedOpSignature {",
        "  const char* name;",
        "  int inputs, required_inputs, variadic_inputs;",
        "  int outputs, required_outputs, variadic_outputs;",
        "  bool homogeneous, cpu, cuda;",
        "};",
        "",
        "namespace fused_ops {",
        "",
    ]
    lines += [_row(op) for op in FUSED_OPS]
    lines += ["", "}  // namespace fused_ops", "}  // namespace onnxfuse", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onnxfuse.ops.header")
    parser.add_argument("--check", action="store_true", help="exit 1 when kernels/fused_ops.h is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = HEADER.read_text() if HEADER.exists() else ""
        if current != text:
            print(f"{HEADER} is stale: run python -m onnxfuse.ops.header", file=sys.stderr)
            return 1
        return 0
    HEADER.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
