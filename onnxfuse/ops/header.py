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


def _ident(name: str) -> str:
    return "".join(c for c in name if c.isalnum())


def _op_block(op: FusedOp) -> list[str]:
    n_in, req_in, var_in, homogeneous = op.signature("inputs")
    n_out, req_out, var_out, _ = op.signature("outputs")
    return [
        f"// {op.name}: {op.summary} (onnxfuse/ops/{_module(op)}.py)",
        f"struct {_ident(op.name)} {{",
        f'  static constexpr char kName[] = "{op.name}";',
        f"  static constexpr int kInputs = {n_in};  // declared input ports",
        f"  static constexpr int kRequiredInputs = {req_in};",
        f"  static constexpr int kVariadicMinInputs = {var_in};  // 0: not variadic",
        f"  static constexpr int kOutputs = {n_out};",
        f"  static constexpr int kRequiredOutputs = {req_out};",
        f"  static constexpr int kVariadicMinOutputs = {var_out};",
        f"  static constexpr int kHomogeneous = {homogeneous};  // 1: float32 tensors; 0: any element type",
        f"  static constexpr bool kCpu = {'true' if CPU in op.providers else 'false'};",
        f"  static constexpr bool kCuda = {'true' if CUDA in op.providers else 'false'};",
        "};",
    ]


def _module(op: FusedOp) -> str:
    return op.reference.__module__.rsplit(".", 1)[-1] if op.reference is not None else "?"


def render() -> str:
    lines = [
        "// Generated from onnxfuse/ops (python -m onnxfuse.ops.header): do not edit.",
        "//",
        "// The fused ops of the onnxfuse domain, one struct each: the name and the signature every",
        "// registration of the op declares. tests/test_ops_table.py checks this file against the",
        "// table and the built library's registrations against both.",
        "#pragma once",
        "",
        "namespace onnxfuse {",
        "namespace fused_ops {",
        "",
    ]
    for op in FUSED_OPS:
        lines += _op_block(op) + [""]
    lines += ["}  // namespace fused_ops", "}  // namespace onnxfuse", ""]
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
