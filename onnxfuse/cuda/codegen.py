"""CUDA C for a fused pointwise program: one kernel per distinct program.

The kernel implements exactly `Program.evaluate` (onnxfuse/program.py): values are widened to
the program's compute type on load (f32, or f64 when the program asks for it), every
instruction is one C expression with the reference's NaN/Inf behaviour, and each output is
rounded to its dtype on store. One thread computes one output element, in a grid-stride loop.

Kernel ABI (version 1), shared with the launcher in kernels/cuda_pointwise.cc:

    extern "C" __global__ void ENTRY(const ENTRY_args a)

    struct ENTRY_args {             // every member is 8 bytes wide: the host packs int64 words
      long long n;                  // elements of the iteration shape
      long long mode;               // 0 strided, 1 linear, 2 linear with vector loads
      long long scalar_mask;        // linear modes: bit k set when input k is a single element
      long long dims[RANK];         // iteration shape, outermost first, padded with leading 1s
      long long strides[NIN][RANK]; // element strides of input k over the iteration shape (0: broadcast)
      long long offsets[NIN];       // element offset of input k's first viewed element
      const void* in[NIN];
      void* out[NOUT];              // outputs are dense, in iteration order; null: not stored
    };

The rank is fixed when the kernel is generated; the dims are not. `mode` lets the host pick
the cheapest loop that is valid for the call: linear when every input is either contiguous in
iteration order or one element; vector when, in addition, every contiguous input and every
output is aligned to VEC elements (VEC is fixed per kernel and stored with the node).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from ..program import OPS, Program

ABI_VERSION = 1
BLOCK = 256  # threads per block; the kernel declares it in __launch_bounds__

# Storage type of each program dtype and its element size in bytes.
C_TYPE = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float", "f64": "double", "bool": "unsigned char"}
ELEM_SIZE = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8, "bool": 1}


@dataclass(frozen=True)
class Kernel:
    """A generated kernel: its entry name, its CUDA C source and its launch constants."""

    entry: str
    source: str
    rank: int
    vec: int
    block: int = BLOCK


def vector_width(prog: Program) -> int:
    """Elements per vector access: 16-byte loads for the narrowest float type, at most 8."""
    sizes = [ELEM_SIZE[t.dtype] for t in [*prog.inputs, *prog.outputs] if t.dtype != "bool"]
    if not sizes:
        return 4
    return max(2, min(8, 16 // min(sizes)))


def literal(value: float, ct: str) -> str:
    """A C literal for `value` rounded to the compute type, exactly (hex floats), as numpy's ct(value)."""
    with np.errstate(over="ignore"):
        v = float(np.float32(value)) if ct == "f32" else float(value)
    if math.isnan(v):
        return "(CT)NAN"
    if math.isinf(v):
        return "(CT)INFINITY" if v > 0 else "(-(CT)INFINITY)"
    text = v.hex() + ("f" if ct == "f32" else "")
    return f"({text})" if text.startswith("-") else text


def _math(name: str, ct: str) -> str:
    return name + ("f" if ct == "f32" else "")


# The C expression of each program op, built once: unary math functions by their C name (an `f`
# suffix in f32), the others as templates over the operands a, b, c, the literal parameters p0,
# p1, one and zero in the compute type and the math functions exp, log1p, fabs, pow (cast apart).
UNARY_MATH = {
    "sqrt": "sqrt", "exp": "exp", "log": "log", "erf": "erf", "tanh": "tanh", "floor": "floor",
    "ceil": "ceil", "round": "rint", "sin": "sin", "cos": "cos", "tan": "tan", "asin": "asin",
    "acos": "acos", "atan": "atan", "sinh": "sinh", "cosh": "cosh", "asinh": "asinh",
    "acosh": "acosh", "atanh": "atanh", "abs": "fabs",
}
EXPRESSIONS = {
    "neg": "-{a}",
    "recip": "{one} / {a}",
    "sigmoid": "{one} / ({one} + {exp}(-{a}))",
    # Below 0 (-inf included) gives +0; -0 and NaN pass as they are, as onnxruntime's Relu.
    "relu": "({a} < {zero}) ? {zero} : {a}",
    "softplus": "({a} > (CT)20) ? {a} : {log1p}({exp}(of_min({a}, (CT)20)))",
    # x times the reciprocal, as onnxruntime (x / (1 + |x|) differs in the last bit for 1 in 10).
    "softsign": "{a} * ({one} / ({one} + {fabs}({a})))",
    # +-0 give +0 (as onnxruntime), NaN stays NaN.
    "sign": "({a} > {zero}) ? {one} : (({a} < {zero}) ? -{one} : (({a} != {a}) ? {a} : {zero}))",
    # x * clip(x * (1/6) + 1/2, 0, 1) with the product rounded on its own (no FMA), as onnxruntime.
    "hardswish": "{a} * of_clamp(of_mul_rn({a}, {one} / (CT)6) + (CT)0.5, {zero}, {one})",
    "not": "({a} == {zero}) ? {one} : {zero}",
    "isnan": "({a} != {a}) ? {one} : {zero}",
    "leakyrelu": "({a} < {zero}) ? {p0} * {a} : {a}",
    "elu": "({a} < {zero}) ? {p0} * ({exp}({a}) - {one}) : {a}",
    "selu": "({a} <= {zero}) ? {p1} * ({p0} * ({exp}({a}) - {one})) : {p1} * {a}",
    "celu": "of_max({zero}, {a}) + of_min({zero}, {p0} * ({exp}({a} / {p0}) - {one}))",
    "hardsigmoid": "of_clamp(of_mul_rn({p0}, {a}) + {p1}, {zero}, {one})",
    "thresholdedrelu": "({a} > {p0}) ? {a} : {zero}",  # NaN and -inf give 0
    # x < lo ? lo : x > hi ? hi : x, as onnxruntime: -0 stays at a bound of 0, NaN passes.
    "clip": "of_clamp({a}, {p0}, {p1})",
    "add": "{a} + {b}",
    "sub": "{a} - {b}",
    "mul": "{a} * {b}",
    "div": "{a} / {b}",
    "pow": "{pow}({a}, {b})",
    "min": "of_min({a}, {b})",
    "max": "of_max({a}, {b})",
    "prelu": "({a} < {zero}) ? {a} * {b} : {a}",
    "eq": "({a} == {b}) ? {one} : {zero}",
    "lt": "({a} < {b}) ? {one} : {zero}",
    "le": "({a} <= {b}) ? {one} : {zero}",
    "gt": "({a} > {b}) ? {one} : {zero}",
    "ge": "({a} >= {b}) ? {one} : {zero}",
    "and": "(({a} != {zero}) && ({b} != {zero})) ? {one} : {zero}",
    "or": "(({a} != {zero}) || ({b} != {zero})) ? {one} : {zero}",
    "xor": "(({a} != {zero}) != ({b} != {zero})) ? {one} : {zero}",
    "where": "({a} != {zero}) ? {b} : {c}",
}
_MATH_FIELDS = ("exp", "log1p", "fabs", "pow")


def instr_expr(op: str, args: list[str], params: tuple, ct: str) -> str:
    """The C expression of one instruction over already-computed operands (compute type CT)."""
    if op in UNARY_MATH:
        return f"{_math(UNARY_MATH[op], ct)}({args[0]})"
    if op == "cast":
        return _cast_expr(args[0], params[0], ct)
    if op not in EXPRESSIONS:
        raise ValueError(f"no CUDA code for op {op!r}")
    p = [literal(x, ct) for x in params]
    fields = {"one": "(CT)1", "zero": "(CT)0", **{f: _math(f, ct) for f in _MATH_FIELDS},
              **{k: v for k, v in zip("abc", args)}, **{f"p{i}": v for i, v in enumerate(p)}}
    return EXPRESSIONS[op].format_map(fields)


def body_lines(prog: Program, inputs: list[str], ct: str, indent: str, prefix: str = "") -> tuple[list[str], list[str]]:
    """The program's instructions as C statements `const CT PREFIXtK = ...;` over the C
    expressions `inputs` (one per program input, in the compute type), and the C names of its
    outputs. Every kernel that applies a program (a Pointwise node, a ConvBiasAct epilogue)
    prints it here, so each op has one CUDA expression."""
    names = {i.name: inputs[k] for k, i in enumerate(prog.inputs)}
    lines = []
    for ins in prog.instrs:
        args = [names[a] if isinstance(a, str) else literal(a, ct) for a in ins.args]
        names[ins.dst] = prefix + ins.dst
        lines.append(f"{indent}const CT {prefix}{ins.dst} = {instr_expr(ins.op, args, ins.params, ct)};")
    return lines, [names[o.name] for o in prog.outputs]


def _cast_expr(a: str, dtype: str, ct: str) -> str:
    """ONNX Cast to `dtype` and back to the compute type, as program.cast_values does."""
    if dtype == "bool":
        return f"({a} != (CT)0) ? (CT)1 : (CT)0"
    if dtype == "f16":
        to_half = "__double2half" if ct == "f64" else "__float2half_rn"
        return f"(CT)__half2float({to_half}({a}))"
    if dtype == "bf16":
        # The reference rounds through float32 first, also from f64.
        return f"(CT)__bfloat162float(__float2bfloat16_rn((float){a}))"
    if dtype == "f32":
        return f"(CT)(float){a}"
    return a  # f64: a no-op in either compute type


def load_expr(ptr_elem: str, dtype: str) -> str:
    """Widen one stored element (a C lvalue of the storage type) to the compute type."""
    return {
        "f16": f"(CT)__half2float({ptr_elem})",
        "bf16": f"(CT)__bfloat162float({ptr_elem})",
        "f32": f"(CT){ptr_elem}",
        "f64": f"(CT){ptr_elem}",
        "bool": f"(({ptr_elem}) != 0 ? (CT)1 : (CT)0)",
    }[dtype]


def store_expr(value: str, dtype: str, ct: str) -> str:
    """Round a compute-type value to the storage type, as program.store_values does."""
    if dtype == "f16":
        return f"__double2half({value})" if ct == "f64" else f"__float2half_rn({value})"
    if dtype == "bf16":
        return f"__float2bfloat16_rn((float){value})"
    if dtype == "f32":
        return f"(float){value}"
    if dtype == "f64":
        return f"(double){value}"
    return f"(unsigned char)({value} != (CT)0)"


HELPERS = r"""#ifndef ONNXFUSE_PW_HELPERS
#define ONNXFUSE_PW_HELPERS
// min/max that propagate NaN like numpy.minimum/maximum (fminf/fmaxf would drop it).
template <typename T> __host__ __device__ __forceinline__ T of_min(T a, T b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }
template <typename T> __host__ __device__ __forceinline__ T of_max(T a, T b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
template <typename T> __host__ __device__ __forceinline__ T of_clamp(T v, T lo, T hi) { T r = v < lo ? lo : v; return r > hi ? hi : r; }
// A product rounded on its own: nvcc would contract it with the addition after it into an FMA.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ float of_mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double of_mul_rn(double a, double b) { return __dmul_rn(a, b); }
#else
template <typename T> __host__ __forceinline__ T of_mul_rn(T a, T b) { volatile T p = a * b; return p; }
#endif
template <typename T, int N> struct alignas(sizeof(T) * N) onnxfuse_vec { T v[N]; };
#endif
"""


def _includes(prog: Program) -> list[str]:
    """Headers the kernel needs: the half-precision ones only when a half type appears."""
    used = {t.dtype for t in [*prog.inputs, *prog.outputs]}
    used |= {ins.params[0] for ins in prog.instrs if ins.op == "cast"}
    inc = ["#include <math.h>"]
    if "f16" in used:
        inc.append("#include <cuda_fp16.h>")
    if "bf16" in used:
        inc.append("#include <cuda_bf16.h>")
    return inc


def entry_name(prog: Program, rank: int) -> str:
    key = f"abi{ABI_VERSION} rank{rank} vec{vector_width(prog)}\n{prog.to_text()}"
    return "onnxfuse_pw_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def generate(prog: Program, rank: int) -> Kernel:
    """One CUDA C kernel for `prog` over an iteration space of `rank` (>= 1) dimensions."""
    for ins in prog.instrs:
        if ins.op not in OPS:
            raise ValueError(f"unknown op {ins.op!r}")
    if not prog.outputs:
        raise ValueError("program has no outputs")
    rank = max(1, int(rank))
    ct = prog.compute_dtype
    ctype = "double" if ct == "f64" else "float"
    vec = vector_width(prog)
    entry = entry_name(prog, rank)
    nin, nout = len(prog.inputs), len(prog.outputs)
    ins_, outs = prog.inputs, prog.outputs

    L: list[str] = []
    w = L.append
    w(f"// onnxfuse Pointwise kernel (ABI {ABI_VERSION}, rank {rank}, {vec} elements per vector access).")
    w("// Generated from the program:")
    for line in prog.to_text().splitlines():
        w(f"//   {line}")
    L.extend(_includes(prog))
    w(HELPERS)
    w(f"#define CT {ctype}")
    w(f"struct {entry}_args {{")
    w("  long long n;")
    w("  long long mode;")
    w("  long long scalar_mask;")
    w(f"  long long dims[{rank}];")
    if nin:
        w(f"  long long strides[{nin}][{rank}];")
        w(f"  long long offsets[{nin}];")
        w(f"  const void* in[{nin}];")
    w(f"  void* out[{nout}];")
    w("};")
    w("")

    # The program itself: compute-type operands in, compute-type results out.
    params = [f"const CT {i.name}" for i in ins_] + [f"CT& y{k}" for k in range(nout)]
    w(f"static __host__ __device__ __forceinline__ void {entry}_compute({', '.join(params)}) {{")
    body, results = body_lines(prog, [i.name for i in ins_], ct, "  ")
    L.extend(body)
    for k, name in enumerate(results):
        w(f"  y{k} = {name};")
    w("}")
    w("")

    def call_compute(x_vals: list[str], indent: str) -> None:
        for k in range(nout):
            w(f"{indent}CT y{k};")
        w(f"{indent}{entry}_compute({', '.join([*x_vals, *[f'y{k}' for k in range(nout)]])});")

    def ptr(k: int) -> str:
        return f"static_cast<const {C_TYPE[ins_[k].dtype]}*>(a.in[{k}])"

    def optr(k: int) -> str:
        return f"static_cast<{C_TYPE[outs[k].dtype]}*>(a.out[{k}])"

    # Strided element: index math over the dims (I is 32-bit when n allows it).
    w(f"template <typename I> static __host__ __device__ __forceinline__ void {entry}_strided(const {entry}_args& a, const I i) {{")
    if nin:
        w("  I rem = i;")
        for k in range(nin):
            w(f"  long long o{k} = a.offsets[{k}];")
        for d in range(rank - 1, -1, -1):
            if d > 0:
                w(f"  {{ const I c = rem % (I)a.dims[{d}]; rem /= (I)a.dims[{d}];")
            else:
                w("  { const I c = rem;")
            for k in range(nin):
                w(f"    o{k} += (long long)c * a.strides[{k}][{d}];")
            w("  }")
    xs = [load_expr(f"{ptr(k)}[o{k}]", ins_[k].dtype) for k in range(nin)]
    call_compute(xs, "  ")
    for k, o in enumerate(outs):
        w(f"  if (a.out[{k}]) {optr(k)}[i] = {store_expr(f'y{k}', o.dtype, ct)};")
    w("}")
    w("")

    # Linear element: inputs contiguous in iteration order, or one element (scalar_mask).
    w(f"static __host__ __device__ __forceinline__ void {entry}_linear(const {entry}_args& a, const long long i) {{")
    xs = []
    for k in range(nin):
        w(f"  const long long o{k} = a.offsets[{k}] + (((a.scalar_mask >> {k}) & 1) ? 0 : i);")
        xs.append(load_expr(f"{ptr(k)}[o{k}]", ins_[k].dtype))
    call_compute(xs, "  ")
    for k, o in enumerate(outs):
        w(f"  if (a.out[{k}]) {optr(k)}[i] = {store_expr(f'y{k}', o.dtype, ct)};")
    w("}")
    w("")

    # Vector group: VEC consecutive elements, contiguous inputs read with aligned vector loads.
    w(f"static __host__ __device__ __forceinline__ void {entry}_vector(const {entry}_args& a, const long long g) {{")
    w(f"  const long long base = g * {vec};")
    for k in range(nin):
        t = C_TYPE[ins_[k].dtype]
        w(f"  const bool s{k} = (a.scalar_mask >> {k}) & 1;")
        w(f"  onnxfuse_vec<{t}, {vec}> v{k} = {{}};")
        w(f"  if (s{k}) v{k}.v[0] = {ptr(k)}[a.offsets[{k}]];")
        w(f"  else v{k} = *reinterpret_cast<const onnxfuse_vec<{t}, {vec}>*>({ptr(k)} + a.offsets[{k}] + base);")
    for k, o in enumerate(outs):
        w(f"  onnxfuse_vec<{C_TYPE[o.dtype]}, {vec}> w{k};")
    w("#pragma unroll")
    w(f"  for (int j = 0; j < {vec}; ++j) {{")
    xs = [load_expr(f"v{k}.v[s{k} ? 0 : j]", ins_[k].dtype) for k in range(nin)]
    call_compute(xs, "    ")
    for k, o in enumerate(outs):
        w(f"    w{k}.v[j] = {store_expr(f'y{k}', o.dtype, ct)};")
    w("  }")
    for k, o in enumerate(outs):
        w(f"  if (a.out[{k}]) *reinterpret_cast<onnxfuse_vec<{C_TYPE[o.dtype]}, {vec}>*>({optr(k)} + base) = w{k};")
    w("}")
    w("")

    w(f"extern \"C\" __global__ void __launch_bounds__({BLOCK}) {entry}(const {entry}_args a) {{")
    w("  const long long n = a.n;")
    w("  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;")
    w("  const long long step = (long long)gridDim.x * blockDim.x;")
    w("  if (a.mode == 2) {")
    w(f"    const long long groups = n / {vec};")
    w(f"    for (long long g = first; g < groups; g += step) {entry}_vector(a, g);")
    w(f"    for (long long i = groups * {vec} + first; i < n; i += step) {entry}_linear(a, i);")
    w("  } else if (a.mode == 1) {")
    w(f"    for (long long i = first; i < n; i += step) {entry}_linear(a, i);")
    w("  } else if (n <= 0xffffffffLL) {")
    w(f"    for (long long i = first; i < n; i += step) {entry}_strided<unsigned int>(a, (unsigned int)i);")
    w("  } else {")
    # Not unrolled: ptxas calls a subroutine for 64-bit division, and the unrolled loop keeps
    # more values live across those calls than the registers hold (16 bytes of spills in two of
    # the corpus's kernels). The loop runs only for more than 2**32 elements.
    w("#pragma unroll 1")
    w(f"    for (long long i = first; i < n; i += step) {entry}_strided<long long>(a, i);")
    w("  }")
    w("}")
    w("#undef CT")
    return Kernel(entry=entry, source="\n".join(L) + "\n", rank=rank, vec=vec)
