"""CUDA C for onnxfuse.SqueezeExcite: a squeeze-and-excitation block in one kernel.

Contract of the op (float32, passes/squeeze_excite.py, kernels/squeeze_excite_cpu.cc):

    X [N, C, H, W], W1 [R, C, 1, 1], B1 [R], W2 [C, R, 1, 1], B2 [C]  ->  Y [N, C, H, W]
    A = input(X);  mean[c] = sum_hw A[n, c] / HW
    hidden[r] = act_h(sum_c W1[r, c] * mean[c] + B1[r]);  gate[c] = act_g(sum_r W2[c, r] * hidden[r] + B2[c])
    Y[n, c] = A[n, c] * gate[c]

Each activation is an expression program (activation_program): none, silu as x * sigmoid(x), or
one program op of the same name with the node's alpha / beta as its parameters, exactly as the
CPU kernel parses it. The kernel prints the programs with the Pointwise printer (codegen.body_lines)
and the numpy model evaluates them with Program.evaluate, so every activation has one meaning.

One kernel per (C, R, activations); N and HW are run-time arguments.

Design: one block of THREADS threads per image (grid.x = N), four phases separated by
__syncthreads, the per-image vectors in static shared memory:

1. squeeze: warp w sums channels c = w, w + WARPS, ...: lane l adds A at j = l, l + 32, ... (from
   +0, in order), then a butterfly over the warp (__shfl_xor_sync, offsets 16..1); lane 0 stores
   sum / (float)HW in means[c]. A's input activation is computed here and again in phase 4 (same
   expression, same bits) rather than stored: one pass over Y fewer.
2. hidden: warp w computes rows r = w, w + WARPS, ...: lane l adds W1[r, c] * means[c] at
   c = l, l + 32, ..., butterfly, lane 0 adds B1[r] and applies act_h into hidden[r].
3. gate: the same for W2 and hidden, into gates[c] (means is dead: gates reuses it).
4. excite: Y = A * gates[c] over the image in iteration order, the flat index split into
   (c, j) by one division: 32-bit while C * HW fits (the common case), 64-bit otherwise.

The products are not contracted into FMAs (nvcc --fmad=false; compile.NVCC_FLAGS), so the numpy
model (squeeze_excite_model.py), which runs the same lanes, orders and butterflies in float32,
computes the same bits except where expf / tanhf round differently from numpy.

Offsets are 64-bit: the image's base n * C * HW and each channel's c * HW are long long
(INDEX), so no product overflows whatever N and HW are.

Kernel ABI (shared with kernels/cuda_squeeze_excite.cc): every argument is one 8-byte word

    struct ENTRY_args { const float* x; const float* w1; const float* b1;
                        const float* w2; const float* b2; float* y;
                        long long batch; long long hw; };
    extern "C" __global__ void ENTRY(const ENTRY_args a)
    block = (THREADS, 1, 1), grid = (batch, 1, 1)
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from ..program import OPS, Program
from .codegen import HELPERS, body_lines
from .emit import CSource

ABI_VERSION = 1
THREADS = 512  # one block per image: enough warps to keep one SM's loads in flight
WARPS = THREADS // 32
# The block's shared vectors (means / gates [C], hidden [R]) are static shared memory.
SHARED_LIMIT = 48 * 1024

INPUT_ACTIVATIONS = ("none", "silu")
# Activations the node may name (kernels/squeeze_excite_cpu.cc: none, silu, or a unary program op).
ACTIVATIONS = ("none", "silu", "relu", "sigmoid", "tanh", "hardsigmoid", "hardswish", "leakyrelu", "clip")


@dataclass(frozen=True)
class Act:
    name: str = "none"
    alpha: float = 0.0
    beta: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.name!r}; known: {', '.join(ACTIVATIONS)}")


def activation_program(act: Act) -> Program:
    """The activation as a one-input f32 program, as the CPU kernel runs it: silu as a Sigmoid and
    a Mul, any other name as the program op of that name with (alpha, beta) as its parameters."""
    p = Program()
    v = p.add_input("f32")
    if act.name == "silu":
        v = p.emit("mul", v, p.emit("sigmoid", v))
    elif act.name != "none":
        v = p.emit(act.name, v, params=(act.alpha, act.beta)[:OPS[act.name].nparams])
    p.add_output(v, "f32")
    return p


@dataclass(frozen=True)
class SqueezeExciteSpec:
    c: int
    r: int
    input_act: Act = Act()
    hidden: Act = Act("relu")
    gate: Act = Act("sigmoid")

    def __post_init__(self) -> None:
        if self.c < 1 or self.r < 1:
            raise ValueError(f"invalid squeeze-excite channels C={self.c}, R={self.r}")
        if self.input_act.name not in INPUT_ACTIVATIONS:
            raise ValueError(f"input activation {self.input_act.name!r} is not none or silu")
        if shared_bytes(self.c, self.r) > SHARED_LIMIT:
            raise ValueError(f"C={self.c}, R={self.r} do not fit in static shared memory")

    def constants(self) -> dict[str, int]:
        return {"C": self.c, "R": self.r, "THREADS": THREADS, "WARPS": WARPS}


def shared_bytes(c: int, r: int) -> int:
    return 4 * (c + r)


def supported(c: int, r: int) -> bool:
    return c >= 1 and r >= 1 and shared_bytes(c, r) <= SHARED_LIMIT


# Index expressions, (name, C expression): valid C (WIDE and DIV below) and evaluated by the numpy model.
# n, c, r, j and hw are long long where they are offsets; e is the flat index within an image.
INDEX = {
    "image": [("img", "WIDE(n) * C * hw")],  # first element of image n
    "squeeze": [("x_src", "img + WIDE(c) * hw + j")],  # element j of channel c
    "hidden": [("w1_src", "WIDE(r) * C + k")],  # W1[r, k]
    "gate": [("w2_src", "WIDE(c) * R + k")],  # W2[c, k]
    "excite": [("ec", "DIV(e, hw)")],  # the channel of flat element e of the image (e, hw of type I)
    "store": [("e_dst", "img + WIDE(e)")],  # flat element e of image n
}

_INDEX_MACROS = """#ifndef ONNXFUSE_SE_INDEX
#define ONNXFUSE_SE_INDEX
#define WIDE(a) ((long long)(a))
#define DIV(a, b) ((a) / (b))
#endif
"""


def _decls(src: CSource, table: str, ctype: str = "long long") -> None:
    src.decls(INDEX[table], ctype=f"const {ctype}")


def _act(src: CSource, act: Act, v: str, prefix: str) -> None:
    """`v = act(v)`, printed by the Pointwise printer in a block of its own."""
    prog = activation_program(act)
    if not prog.instrs:
        return
    with src.block(""):
        body, (result,) = body_lines(prog, [v], "f32", src.indent, prefix=prefix)
        src.extend(body).line(f"{v} = {result};")


@dataclass(frozen=True)
class Kernel:
    entry: str
    source: str
    spec: SqueezeExciteSpec
    threads: int = THREADS

    def attrs(self) -> dict:
        """Launch description stored on the node (read by kernels/cuda_squeeze_excite.cc):
        block = (cuda_block, 1, 1), grid = (N, 1, 1); the kernel was generated for C = cuda_c and
        R = cuda_r."""
        return {"cuda_abi": ABI_VERSION, "cuda_block": self.threads, "cuda_c": self.spec.c, "cuda_r": self.spec.r}


def float_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def entry_name(spec: SqueezeExciteSpec) -> str:
    acts = " ".join(f"{a.name}:{float_bits(a.alpha):08x}:{float_bits(a.beta):08x}"
                    for a in (spec.input_act, spec.hidden, spec.gate))
    key = f"abi{ABI_VERSION} threads{THREADS} {spec.c} {spec.r} {acts}"
    return "onnxfuse_se_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _warp_sum(src: CSource, v: str) -> None:
    src.pragma("unroll").line(f"for (int o = 16; o > 0; o >>= 1) {v} += __shfl_xor_sync(FULL, {v}, o);")


def _warp_rows(src: CSource, comment: str, row: str, rows: str, width: str, table: str, layer: int, vec: str,
               act: Act, prefix: str, dst: str) -> None:
    """A 1x1 convolution on the block's vector, a warp per output row: the lanes' strided dot of
    W{layer} with `vec` over `width` columns, the butterfly, then lane 0 adds the bias, applies
    `act` and writes dst[row]."""
    src.comment(comment)
    with src.block(f"for (int {row} = warp; {row} < {rows}; {row} += WARPS)"):
        src.line("float dot = 0.0f;")
        with src.block(f"for (int k = lane; k < {width}; k += 32)"):
            _decls(src, table)
            src.line(f"dot += a.w{layer}[w{layer}_src] * {vec}[k];")
        _warp_sum(src, "dot")
        with src.block("if (lane == 0)"):
            src.line(f"float v = dot + a.b{layer}[{row}];")
            _act(src, act, "v", prefix)
            src.line(f"{dst}[{row}] = v;")
    src.line("__syncthreads();")


def generate(spec: SqueezeExciteSpec) -> Kernel:
    entry = entry_name(spec)
    src = CSource()
    src.line(f"// onnxfuse SqueezeExcite kernel (ABI {ABI_VERSION}): {spec}", "#include <math.h>")
    src.raw(_INDEX_MACROS + HELPERS).line("#define CT float  // the activation programs' compute type")
    with src.block(f"struct {entry}_args", end="};"):
        src.line("const float* x; const float* w1; const float* b1; const float* w2; const float* b2;", "float* y;",
                 "long long batch; long long hw;")
    src.comment("Y over image n from `img`: element e of the image is channel e / hw (I: the index type).")
    src.line(f"template <typename I> static __device__ __forceinline__ void {entry}_excite(")
    with src.block(f"    const {entry}_args& a, const float* gates, const long long img, const I total, const I hw)"):
        with src.block(f"for (I e = threadIdx.x; e < total; e += {THREADS})"):
            _decls(src, "excite", "I")
            _decls(src, "store")
            src.line("float v = a.x[e_dst];")
            _act(src, spec.input_act, "v", "in_")
            src.line("a.y[e_dst] = v * gates[ec];")
    with src.block(f'extern "C" __global__ void __launch_bounds__({THREADS}, 1) {entry}(const {entry}_args a)'):
        src.constants(spec.constants())
        src.line("const unsigned FULL = 0xffffffffu;", "__shared__ float means[C];  // then the gates",
                 "__shared__ float hidden[R];", "const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;",
                 "const long long hw = a.hw;", "const long long n = blockIdx.x;")
        _decls(src, "image")
        src.comment("1. squeeze: the mean of each channel of A = input(X)")
        with src.block("for (int c = warp; c < C; c += WARPS)"):
            src.line("float sum = 0.0f;")
            with src.block("for (long long j = lane; j < hw; j += 32)"):
                _decls(src, "squeeze")
                src.line("float v = a.x[x_src];")
                _act(src, spec.input_act, "v", "in_")
                src.line("sum += v;")
            _warp_sum(src, "sum")
            src.line("if (lane == 0) means[c] = sum / (float)hw;")
        src.line("__syncthreads();")
        _warp_rows(src, "2. hidden = act_h(W1 means + B1)", "r", "R", "C", "hidden", 1, "means", spec.hidden, "h_",
                   "hidden")
        _warp_rows(src, "3. gates = act_g(W2 hidden + B2), over the means (read by phase 2 only)", "c", "C", "R",
                   "gate", 2, "hidden", spec.gate, "g_", "means")
        src.comment("4. excite: Y = A * gate of its channel")
        src.line("const long long total = C * hw;", "if (total <= 0xffffffffLL)",
                 f"  {entry}_excite<unsigned int>(a, means, img, (unsigned int)total, (unsigned int)hw);", "else",
                 f"  {entry}_excite<long long>(a, means, img, total, hw);")
    src.line("#undef CT")
    return Kernel(entry, src.text(), spec)


def spec_of_node(node, shapes=None) -> SqueezeExciteSpec | None:
    """The kernel an onnxfuse.SqueezeExcite node (onnx_graphsurgeon) needs, or None when its
    weights' shapes are unknown (from W1's recorded shape, or `shapes`, a facts.ShapeTable, when
    given) or its channels do not fit the kernel."""
    if len(node.inputs) != 5:
        return None
    shape = shapes.dims(node.inputs[1]) if shapes is not None else node.inputs[1].shape
    if not shape or len(shape) < 2 or not all(isinstance(d, int) for d in shape[:2]):
        return None
    r, c = int(shape[0]), int(shape[1])
    if not supported(c, r):
        return None

    def text(name: str) -> str:
        v = node.attrs.get(name, "none")
        return v.decode() if isinstance(v, bytes) else str(v)

    def act(prefix: str) -> Act:
        return Act(text(f"{prefix}_activation"), float(node.attrs.get(f"{prefix}_alpha", 0.0)),
                   float(node.attrs.get(f"{prefix}_beta", 0.0)))

    try:
        return SqueezeExciteSpec(c, r, Act(text("input_activation")), act("hidden"), act("gate"))
    except ValueError:
        return None
