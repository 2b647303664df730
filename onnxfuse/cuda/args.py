"""The per-call host side of a Pointwise kernel, in Python: iteration shape, strides, mode, packed arguments.

kernels/cuda_pointwise.cc does the same in C++ for onnxruntime; this module serves the
standalone kernel tests (PyCUDA, the host-compiled harness) and documents the rules:

- every input, after its view, is described by an element offset into its buffer and one
  element stride per iteration dimension (0 where it is broadcast);
- adjacent dimensions that every input walks contiguously are merged, size-1 dimensions are
  dropped, and the result is padded with leading 1s to the kernel's rank;
- mode 1 (linear) when every input is contiguous in iteration order or a single element,
  mode 2 (vector) when in addition every buffer the loop touches is aligned to `vec` elements,
  mode 0 (strided) otherwise.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..program import Program, apply_view

MODE_STRIDED, MODE_LINEAR, MODE_VECTOR = 0, 1, 2


@dataclass
class CallPlan:
    shape: tuple[int, ...]  # iteration shape (broadcast of the viewed inputs)
    n: int
    dims: list[int]  # padded to the kernel's rank
    strides: list[list[int]]  # per input, per dim (elements)
    offsets: list[int]  # per input (elements)
    scalar_mask: int
    mode: int


def coalesce(shape: Sequence[int], strides: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge adjacent dims that every input walks as one."""
    dims: list[int] = []
    st: list[list[int]] = [[] for _ in strides]
    for d, size in enumerate(shape):
        if size == 1:
            continue
        if dims and all(s[-1] == sk[d] * size for s, sk in zip(st, strides)):
            dims[-1] *= size
            for s, sk in zip(st, strides):
                s[-1] = sk[d]
            continue
        dims.append(size)
        for s, sk in zip(st, strides):
            s.append(sk[d])
    return dims, st


def plan_call(prog: Program, rank: int, vec: int, arrays: Sequence[np.ndarray],
              addresses: Sequence[int] | None = None, out_addresses: Sequence[int] = ()) -> CallPlan:
    """How the kernel is called for these inputs (host numpy arrays standing for device buffers).

    `addresses` are the device addresses of the inputs' buffers (default: the arrays' own),
    used only for the vector-mode alignment test, as are `out_addresses`.
    """
    arrays = [np.asarray(a) for a in arrays]  # once: np.asarray of a numpy scalar is a new array each time
    views = [apply_view(a, spec.view) for a, spec in zip(arrays, prog.inputs)]
    shape = tuple(np.broadcast_shapes(*(v.shape for v in views))) if views else ()
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    offsets, full = [], []
    for a, v in zip(arrays, views):
        b = np.broadcast_to(v, shape)
        item = a.itemsize
        full.append([s // item for s in b.strides])
        offsets.append((b.__array_interface__["data"][0] - a.__array_interface__["data"][0]) // item if v.size else 0)
    dims, strides = coalesce(shape, full)
    if len(dims) > rank:
        raise ValueError(f"iteration shape {shape} needs rank {len(dims)} > kernel rank {rank}")
    pad = rank - len(dims)
    dims = [1] * pad + dims
    strides = [[0] * pad + s for s in strides]
    contiguous = [1] * rank
    for d in range(rank - 2, -1, -1):
        contiguous[d] = contiguous[d + 1] * dims[d + 1]
    scalar_mask, linear = 0, True
    for k, s in enumerate(strides):
        live = [d for d in range(rank) if dims[d] > 1]
        if all(s[d] == 0 for d in live):
            scalar_mask |= 1 << k
        elif any(s[d] != contiguous[d] for d in live):
            linear = False
    mode = MODE_LINEAR if linear else MODE_STRIDED
    if linear:
        addrs = list(addresses) if addresses is not None else [a.__array_interface__["data"][0] for a in arrays]
        aligned = all(
            (addrs[k] + offsets[k] * arrays[k].itemsize) % (vec * arrays[k].itemsize) == 0
            for k in range(len(arrays)) if not (scalar_mask >> k) & 1
        )
        aligned = aligned and all(addr % (vec * _out_itemsize(prog, j)) == 0 for j, addr in enumerate(out_addresses))
        if aligned:
            mode = MODE_VECTOR
    return CallPlan(shape, n, dims, strides, offsets, scalar_mask, mode)


def _out_itemsize(prog: Program, j: int) -> int:
    return {"f16": 2, "bf16": 2, "f32": 4, "f64": 8, "bool": 1}[prog.outputs[j].dtype]


def pack_args(plan: CallPlan, in_ptrs: Sequence[int], out_ptrs: Sequence[int]) -> bytes:
    """The kernel's argument struct (codegen ABI 1) as bytes: all members are 8-byte words."""
    words = [plan.n, plan.mode, plan.scalar_mask, *plan.dims]
    for s in plan.strides:
        words.extend(s)
    words.extend(plan.offsets)
    words.extend(int(p) for p in in_ptrs)
    words.extend(int(p) for p in out_ptrs)
    return struct.pack(f"<{len(words)}q", *[w if w < 2**63 else w - 2**64 for w in words])
