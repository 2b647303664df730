// The block executor built for AVX2 + FMA + F16C (x86-64-v3); chosen at run time by
// select_run_task when the CPU has them, so one build serves every x86-64 machine.
//
// On top of the shared executor, this build evaluates the hot float32 transcendental opcodes
// (exp, log, erf, tanh, sigmoid) eight lanes at a time with intrinsics (vector_unary below).
// They follow program.py's semantics: NaN in gives NaN out, exp(+-inf) = inf / 0, log(0) = -inf,
// log(x < 0) = NaN, log(inf) = inf, erf/tanh(+-inf) = +-1, sigmoid(+-inf) = 1 / 0; subnormal
// inputs and results are handled. Accuracy (a dense float32 sweep against float64): exp 1 ulp,
// sigmoid 2.3, tanh 5 (6 in the baseline build), erf 5.5 (tanh and erf within 3.3e-7 absolute);
// tests compare with numpy at rtol 1e-5 and check these bounds.
//
// It also evaluates each chain of instructions (FusedStep, pointwise_cpu.h) without storing its
// intermediate results (fused_step below), in segments: each elementary function with the
// add/sub/mul instructions right around it, two or four vectors at a time, and each run of the
// other single operations (add, sub, mul, div, max, min, abs, neg, relu, ...) eight vectors at a
// time, kept in registers from the first instruction of the segment to the last. A chain of cheap operations then
// costs about one pass over memory plus its arithmetic; a chain with elementary functions is
// bound by their arithmetic (bench/results/cpu_kernel_design.md).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "numeric.h"
#include "pointwise_cpu.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace onnxfuse {
namespace isa_avx2 {
namespace {

using V = __m256;

ONNXFUSE_INLINE V splat(float v) { return _mm256_set1_ps(v); }
// min/max that return `x` when it is NaN (MINPS/MAXPS return their second operand on NaN).
ONNXFUSE_INLINE V min_keep_nan(float bound, V x) { return _mm256_min_ps(splat(bound), x); }
ONNXFUSE_INLINE V max_keep_nan(float bound, V x) { return _mm256_max_ps(splat(bound), x); }
ONNXFUSE_INLINE V is_nan(V x) { return _mm256_cmp_ps(x, x, _CMP_UNORD_Q); }

// The elementary functions below take N vectors at once (x[0..N-1], replaced by the results)
// and perform each step for all N before the next step: the N dependency chains (polynomials,
// then a division) are independent, so their instructions interleave and the floating-point
// ports stay busy where one vector at a time waits on the latency of each step. Every lane gets
// the same operations as with N = 1.
#define ONNXFUSE_EACH for (int i = 0; i < N; ++i)

// y * 2^n for y in [0.7, 1.5] and n in [-150, 128], given e = n << 23, rounded once: y gets
// 2^n1 added into its exponent field (n1 = n clamped to [-125, 127], exact and normal), then one
// multiplication by 2^(n - n1) rounds subnormal results once and overflows to inf past FLT_MAX.
// Upper = false: n <= 0 is known, no upper clamp needed.
template <bool Upper, int N>
ONNXFUSE_INLINE void scale_pow2(V* y, const __m256i* e) {
  __m256i n1[N];
  ONNXFUSE_EACH n1[i] = _mm256_max_epi32(e[i], _mm256_set1_epi32(-125 << 23));
  if (Upper) ONNXFUSE_EACH n1[i] = _mm256_min_epi32(n1[i], _mm256_set1_epi32(127 << 23));
  V y1[N], s2[N];
  ONNXFUSE_EACH y1[i] = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y[i]), n1[i]));
  ONNXFUSE_EACH s2[i] = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_sub_epi32(e[i], n1[i]), _mm256_set1_epi32(0x3f800000)));
  // A NaN y stays NaN: the integer add above would carry a payload such as 0xffffffff (what
  // MLAS's GEMM writes) into the exponent and sign, making it a finite number.
  ONNXFUSE_EACH y[i] = _mm256_blendv_ps(_mm256_mul_ps(y1[i], s2[i]), y[i], is_nan(y[i]));
}

// The shared part: y = exp(r) in [sqrt(1/2), sqrt(2)] and e = n << 23 (the low bits of t shifted
// into the exponent field; the magic's bits shift out), with exp(x) = y * 2^n.
template <int N>
ONNXFUSE_INLINE void exp_mantissa(const V* x, V* y, __m256i* e) {
  const V magic = splat(12582912.0f);  // 1.5 * 2^23: t holds round(x / ln2) in its low bits
  V t[N], n[N], r[N], p[N];
  ONNXFUSE_EACH t[i] = _mm256_fmadd_ps(x[i], splat(1.44269504088896341f), magic);
  ONNXFUSE_EACH n[i] = _mm256_sub_ps(t[i], magic);
  ONNXFUSE_EACH r[i] = _mm256_fnmadd_ps(n[i], splat(0.693359375f), x[i]);
  ONNXFUSE_EACH r[i] = _mm256_fnmadd_ps(n[i], splat(-2.12194440e-4f), r[i]);
  ONNXFUSE_EACH p[i] = _mm256_fmadd_ps(splat(num::kExpP[0]), r[i], splat(num::kExpP[1]));
  for (int k = 2; k < 5; ++k) ONNXFUSE_EACH p[i] = _mm256_fmadd_ps(p[i], r[i], splat(num::kExpP[k]));
  ONNXFUSE_EACH e[i] = _mm256_slli_epi32(_mm256_castps_si256(t[i]), 23);
  ONNXFUSE_EACH y[i] = _mm256_add_ps(_mm256_fmadd_ps(p[i], _mm256_mul_ps(r[i], r[i]), r[i]), splat(1.0f));
}

// exp(x) for x in [-104, 89] (NaN passes through): the scheme of num::exp_f32. x = n ln2 + r
// (Cody-Waite, two FMAs), exp(r) = 1 + r + r^2 P(r) with P of degree 4 (relative error 3e-9),
// then scale_pow2. exp(x) past num::kExpMaxFinite overflows to inf in the final multiplication.
template <bool Upper, int N>
ONNXFUSE_INLINE void exp_reduced(V* x) {
  __m256i e[N];
  exp_mantissa<N>(x, x, e);
  scale_pow2<Upper, N>(x, e);
}

// exp_reduced for |x| <= 86 in every lane: n = round(x / ln2) is within [-125, 125], so y * 2^n
// is the normal float made by adding n to y's exponent field, what scale_pow2 computes there
// (bit for bit) without its clamps, scaling and NaN check.
template <int N>
ONNXFUSE_INLINE void exp_in_range(V* x) {
  __m256i e[N];
  exp_mantissa<N>(x, x, e);
  ONNXFUSE_EACH x[i] = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(x[i]), e[i]));
}

// True when every lane of the N vectors is within [-86, 86] (no NaN): exp_in_range applies.
template <int N>
ONNXFUSE_INLINE bool exp_in_range_all(const V* x) {
  V out = _mm256_setzero_ps();
  ONNXFUSE_EACH out = _mm256_or_ps(out, _mm256_cmp_ps(_mm256_andnot_ps(splat(-0.0f), x[i]), splat(86.0f), _CMP_NLE_UQ));
  return _mm256_testz_ps(out, out);
}

// The clamps send -inf to 0 and +inf to inf; exp(x) for x in (kExpMaxFinite, 89] overflows to inf.
template <int N>
ONNXFUSE_INLINE void exp_n(V* x) {
  if (exp_in_range_all<N>(x)) return exp_in_range<N>(x);
  ONNXFUSE_EACH x[i] = max_keep_nan(-104.0f, min_keep_nan(89.0f, x[i]));
  exp_reduced<true, N>(x);
}

// sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0, e = exp(-|x|) in (0, 1]:
// nothing overflows, the tail keeps its relative accuracy (subnormal results included), and one
// division (cheaper than a refined reciprocal here, and exact) gives both cases.
template <int N>
ONNXFUSE_INLINE void sigmoid_n(V* x) {
  V e[N];
  ONNXFUSE_EACH e[i] = _mm256_or_ps(x[i], splat(-0.0f));  // -|x|; NaN stays
  if (exp_in_range_all<N>(e)) {
    exp_in_range<N>(e);
  } else {
    ONNXFUSE_EACH e[i] = max_keep_nan(-104.0f, e[i]);
    exp_reduced<false, N>(e);
  }
  V num[N];
  ONNXFUSE_EACH num[i] = _mm256_blendv_ps(splat(1.0f), e[i], x[i]);  // by the sign bit of x
  ONNXFUSE_EACH x[i] = _mm256_div_ps(num[i], _mm256_add_ps(splat(1.0f), e[i]));
}

// tanh: the rational of num::tanh_f32, x P(x^2) / Q(x^2) on [-9, 9]. Evaluated with FMAs and a
// division, it reaches 1 (after the clamp to [-1, 1]) at |x| = 9, so every |x| >= 9 gives exactly
// +-1, as float32 tanh does past 9.0109 (onnxruntime's too); the last 0.01 below is within 0.52 ulp.
// Being odd (P and Q have positive coefficients), it is evaluated at |x| and given x's sign back:
// the same bits as clamping x itself to [-9, 9] and the result to [-1, 1], with half the clamps.
template <int N>
ONNXFUSE_INLINE void tanh_n(V* x) {
  const V sign = splat(-0.0f);
  V xc[N], z[N], p[N], q[N];
  ONNXFUSE_EACH xc[i] = min_keep_nan(9.0f, _mm256_andnot_ps(sign, x[i]));  // NaN stays NaN
  ONNXFUSE_EACH z[i] = _mm256_mul_ps(xc[i], xc[i]);
  ONNXFUSE_EACH p[i] = _mm256_fmadd_ps(splat(num::kTanhP[0]), z[i], splat(num::kTanhP[1]));
  ONNXFUSE_EACH q[i] = _mm256_fmadd_ps(splat(num::kTanhQ[0]), z[i], splat(num::kTanhQ[1]));
  for (int k = 2; k < 5; ++k) {
    ONNXFUSE_EACH p[i] = _mm256_fmadd_ps(p[i], z[i], splat(num::kTanhP[k]));
    ONNXFUSE_EACH q[i] = _mm256_fmadd_ps(q[i], z[i], splat(num::kTanhQ[k]));
  }
  ONNXFUSE_EACH p[i] = min_keep_nan(1.0f, _mm256_div_ps(_mm256_mul_ps(xc[i], p[i]), q[i]));
  // Below num::kTanhTiny, onnxruntime's value (see num::tanh_f32): rare, so only when a lane is.
  // Rounding is odd, so computing it at |x| and giving the sign back is the same.
  ONNXFUSE_EACH {
    const V tiny = _mm256_cmp_ps(xc[i], splat(num::kTanhTiny), _CMP_LT_OQ);
    if (_mm256_movemask_ps(tiny)) {
      const V small = _mm256_div_ps(_mm256_mul_ps(xc[i], splat(num::kOrtTanhP0)), splat(num::kOrtTanhQ0));
      p[i] = _mm256_blendv_ps(p[i], small, tiny);
    }
  }
  ONNXFUSE_EACH x[i] = _mm256_or_ps(p[i], _mm256_and_ps(x[i], sign));
}

// log(x): x = 2^e m with m in [sqrt(1/2), sqrt(2)), log(m) = f - f^2/2 + f^3 P(f) for f = m - 1
// (P fitted to log1p on that interval), e ln2 added in two parts. Subnormals are scaled by 2^23
// first.
template <int N>
ONNXFUSE_INLINE void log_n(V* x) {
  static constexpr float kLogP[9] = {0.07148932665586472f, -0.1157151386141777f, 0.1166200265288353f,
                                     -0.12411021441221237f, 0.14249871671199799f, -0.1666848063468933f,
                                     0.2000070959329605f,  -0.24999989569187164f, 0.3333333134651184f};
  V e[N], f[N], p[N];
  ONNXFUSE_EACH {
    V sub = _mm256_and_ps(_mm256_cmp_ps(x[i], splat(1.17549435e-38f), _CMP_LT_OQ),
                          _mm256_cmp_ps(x[i], _mm256_setzero_ps(), _CMP_GT_OQ));
    V xs = _mm256_blendv_ps(x[i], _mm256_mul_ps(x[i], splat(8388608.0f)), sub);
    __m256i bits = _mm256_castps_si256(xs);
    e[i] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
    e[i] = _mm256_sub_ps(e[i], _mm256_and_ps(sub, splat(23.0f)));
    V m = _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
    V upper = _mm256_cmp_ps(m, splat(1.41421356f), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, splat(0.5f)), upper);
    e[i] = _mm256_add_ps(e[i], _mm256_and_ps(upper, splat(1.0f)));
    f[i] = _mm256_sub_ps(m, splat(1.0f));
  }
  ONNXFUSE_EACH p[i] = _mm256_fmadd_ps(splat(kLogP[0]), f[i], splat(kLogP[1]));
  for (int k = 2; k < 9; ++k) ONNXFUSE_EACH p[i] = _mm256_fmadd_ps(p[i], f[i], splat(kLogP[k]));
  ONNXFUSE_EACH {
    V f2 = _mm256_mul_ps(f[i], f[i]);
    V y = _mm256_mul_ps(_mm256_mul_ps(f2, f[i]), p[i]);
    y = _mm256_fmadd_ps(e[i], splat(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(splat(0.5f), f2, y);
    V r = _mm256_add_ps(f[i], y);
    r = _mm256_fmadd_ps(e[i], splat(0.693359375f), r);
    // Special values: log(0) = -inf, log(x < 0) = NaN, log(inf) = inf, NaN stays NaN.
    r = _mm256_blendv_ps(r, splat(-INFINITY), _mm256_cmp_ps(x[i], _mm256_setzero_ps(), _CMP_EQ_OQ));
    r = _mm256_blendv_ps(r, splat(NAN), _mm256_cmp_ps(x[i], _mm256_setzero_ps(), _CMP_LT_OQ));
    x[i] = _mm256_blendv_ps(r, x[i], _mm256_or_ps(is_nan(x[i]), _mm256_cmp_ps(x[i], splat(INFINITY), _CMP_EQ_OQ)));
  }
}

// erf(x) = x H(x^2 / 4.5 - 1) for |x| < 3 (num::kErfH), each half of the lanes in double and
// rounded once to float32: erf correctly rounded. From |x| = 3 on it is 1 - exp(-x^2) G(|x|)
// instead (num::kErfcG), rounded once: exactly 1 where erf rounds to 1 (past 3.92). |x| is clamped
// to 4 first.
template <int N>
ONNXFUSE_INLINE void erf_n(V* x) {
  const V sign = splat(-0.0f);
  V a[N], z[N], p[N], q[N];
  ONNXFUSE_EACH a[i] = min_keep_nan(4.0f, _mm256_andnot_ps(sign, x[i]));
  ONNXFUSE_EACH z[i] = _mm256_mul_ps(a[i], a[i]);
  // Both halves of every vector at once: the 2N Horner chains are independent, so their FMAs
  // overlap instead of each waiting on the one before.
  auto half = [&a](int j) {
    return _mm256_cvtps_pd(j % 2 ? _mm256_extractf128_ps(a[j / 2], 1) : _mm256_castps256_ps128(a[j / 2]));
  };
  __m256d u[2 * N], h[2 * N];
  for (int j = 0; j < 2 * N; ++j) {
    const __m256d d = half(j);
    u[j] = _mm256_fmadd_pd(_mm256_mul_pd(d, d), _mm256_set1_pd(1.0 / 4.5), _mm256_set1_pd(-1.0));
    h[j] = _mm256_set1_pd(num::kErfH[num::kErfHDegree]);
  }
  for (int k = num::kErfHDegree - 1; k >= 0; --k)
    for (int j = 0; j < 2 * N; ++j) h[j] = _mm256_fmadd_pd(h[j], u[j], _mm256_set1_pd(num::kErfH[k]));
  ONNXFUSE_EACH p[i] = min_keep_nan(1.0f, _mm256_set_m128(_mm256_cvtpd_ps(_mm256_mul_pd(half(2 * i + 1), h[2 * i + 1])),
                                                         _mm256_cvtpd_ps(_mm256_mul_pd(half(2 * i), h[2 * i]))));
  V far[N], any = _mm256_setzero_ps();
  ONNXFUSE_EACH far[i] = _mm256_cmp_ps(a[i], splat(num::kErfTailFrom), _CMP_GE_OQ);  // NaN: no
  ONNXFUSE_EACH any = _mm256_or_ps(any, far[i]);
  if (!_mm256_testz_ps(any, any)) {
    V e[N], g[N];
    ONNXFUSE_EACH e[i] = _mm256_sub_ps(_mm256_setzero_ps(), z[i]);  // in [-16, 0]; NaN lanes are not used
    exp_in_range<N>(e);
    ONNXFUSE_EACH q[i] = _mm256_sub_ps(a[i], splat(3.5f));
    ONNXFUSE_EACH g[i] = _mm256_fmadd_ps(splat(num::kErfcG[0]), q[i], splat(num::kErfcG[1]));
    for (int k = 2; k < 6; ++k) ONNXFUSE_EACH g[i] = _mm256_fmadd_ps(g[i], q[i], splat(num::kErfcG[k]));
    ONNXFUSE_EACH p[i] = _mm256_blendv_ps(p[i], _mm256_fnmadd_ps(e[i], g[i], splat(1.0f)), far[i]);
  }
  ONNXFUSE_EACH x[i] = _mm256_or_ps(p[i], _mm256_and_ps(x[i], sign));  // erf is odd; NaN stays NaN
}

template <bool Tail>
ONNXFUSE_INLINE V load8(const float* p, __m256i mask) {
  if constexpr (Tail) return _mm256_maskload_ps(p, mask);
  else return _mm256_loadu_ps(p);
}

template <bool Tail>
ONNXFUSE_INLINE void store8(float* p, __m256i mask, V x) {
  if constexpr (Tail) _mm256_maskstore_ps(p, mask, x);
  else _mm256_storeu_ps(p, x);
}

// The result is hidden from the optimizer (an empty asm that "changes" it): g++ contracts a
// multiplication feeding an addition into one FMA, rounding once where the separate instructions
// round twice.
ONNXFUSE_INLINE V opaque(V x) {
  __asm__("" : "+x"(x));
  return x;
}

// max_nan and min_nan of pointwise_exec.inc: MAXPS/MINPS compute a > b ? a : b (a < b ? a : b),
// then a NaN b, and before it a NaN a, is returned as it is.
ONNXFUSE_INLINE V max_nan8(V a, V b) {
  V m = _mm256_blendv_ps(_mm256_max_ps(a, b), b, is_nan(b));
  return _mm256_blendv_ps(m, a, is_nan(a));
}
ONNXFUSE_INLINE V min_nan8(V a, V b) {
  V m = _mm256_blendv_ps(_mm256_min_ps(a, b), b, is_nan(b));
  return _mm256_blendv_ps(m, a, is_nan(a));
}

// One stage of a chain as its loop reads it: for the vector at element j of the block, the other
// operand is at o + (j & mask), mask being ~0 for a contiguous operand and 0 for a constant (read
// from eight copies of it).
struct StageLoop {
  const float* o;
  int64_t mask;
  ChainStage::Kind kind;
  float p0, p1;  // LeakyRelu's alpha, Clip's bounds
};

// One stage over the vectors x[0..N-1] at element j: the single IEEE operation, or the function
// of vector_unary, of the instruction it evaluates. The result is made opaque (no contraction
// with the next stage).
template <ChainStage::Kind Kind, int N, bool Tail>
ONNXFUSE_INLINE void apply_stage(const StageLoop& c, V* x, int64_t j, __m256i mask) {
  using K = ChainStage;
  V y[N];
  if constexpr (Kind <= K::MinC) ONNXFUSE_EACH y[i] = load8<Tail>(c.o + ((j + 8 * i) & c.mask), mask);
  if constexpr (Kind == K::Add) ONNXFUSE_EACH x[i] = _mm256_add_ps(x[i], y[i]);
  if constexpr (Kind == K::Sub) ONNXFUSE_EACH x[i] = _mm256_sub_ps(x[i], y[i]);
  if constexpr (Kind == K::RSub) ONNXFUSE_EACH x[i] = _mm256_sub_ps(y[i], x[i]);
  if constexpr (Kind == K::Mul) ONNXFUSE_EACH x[i] = _mm256_mul_ps(x[i], y[i]);
  if constexpr (Kind == K::Div) ONNXFUSE_EACH x[i] = _mm256_div_ps(x[i], y[i]);
  if constexpr (Kind == K::RDiv) ONNXFUSE_EACH x[i] = _mm256_div_ps(y[i], x[i]);
  if constexpr (Kind == K::Max) ONNXFUSE_EACH x[i] = max_nan8(x[i], y[i]);
  if constexpr (Kind == K::RMax) ONNXFUSE_EACH x[i] = max_nan8(y[i], x[i]);
  if constexpr (Kind == K::Min) ONNXFUSE_EACH x[i] = min_nan8(x[i], y[i]);
  if constexpr (Kind == K::RMin) ONNXFUSE_EACH x[i] = min_nan8(y[i], x[i]);
  if constexpr (Kind == K::MaxC) ONNXFUSE_EACH x[i] = _mm256_max_ps(y[i], x[i]);
  if constexpr (Kind == K::MinC) ONNXFUSE_EACH x[i] = _mm256_min_ps(y[i], x[i]);
  if constexpr (Kind == K::Neg) ONNXFUSE_EACH x[i] = _mm256_xor_ps(x[i], splat(-0.0f));
  if constexpr (Kind == K::Abs) ONNXFUSE_EACH x[i] = _mm256_andnot_ps(splat(-0.0f), x[i]);
  // x < 0: +0; otherwise x (-0 and NaN included), as onnxruntime.
  if constexpr (Kind == K::Relu)
    ONNXFUSE_EACH x[i] = _mm256_andnot_ps(_mm256_cmp_ps(x[i], _mm256_setzero_ps(), _CMP_LT_OQ), x[i]);
  if constexpr (Kind == K::Sqrt) ONNXFUSE_EACH x[i] = _mm256_sqrt_ps(x[i]);
  if constexpr (Kind == K::Recip) ONNXFUSE_EACH x[i] = _mm256_div_ps(splat(1.0f), x[i]);
  if constexpr (Kind == K::Floor) ONNXFUSE_EACH x[i] = _mm256_round_ps(x[i], _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  if constexpr (Kind == K::Ceil) ONNXFUSE_EACH x[i] = _mm256_round_ps(x[i], _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
  if constexpr (Kind == K::Round)
    ONNXFUSE_EACH x[i] = _mm256_round_ps(x[i], _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
  if constexpr (Kind == K::LeakyRelu)
    ONNXFUSE_EACH x[i] = _mm256_blendv_ps(x[i], _mm256_mul_ps(splat(c.p0), x[i]),
                                          _mm256_cmp_ps(x[i], _mm256_setzero_ps(), _CMP_LT_OQ));
  // x < lo ? lo : x, then > hi ? hi: MAXPS(x, lo) is x > lo ? x : lo, which gives lo for x = -0 and
  // lo = +0; onnxruntime keeps x. A NaN x passes both compares.
  if constexpr (Kind == K::Clip)
    ONNXFUSE_EACH {
      V lo = _mm256_blendv_ps(x[i], splat(c.p0), _mm256_cmp_ps(x[i], splat(c.p0), _CMP_LT_OQ));
      x[i] = _mm256_blendv_ps(lo, splat(c.p1), _mm256_cmp_ps(lo, splat(c.p1), _CMP_GT_OQ));
    }
  if constexpr (Kind == K::Exp) exp_n<N>(x);
  if constexpr (Kind == K::Log) log_n<N>(x);
  if constexpr (Kind == K::Erf) erf_n<N>(x);
  if constexpr (Kind == K::Tanh) tanh_n<N>(x);
  if constexpr (Kind == K::Sigmoid) sigmoid_n<N>(x);
  ONNXFUSE_EACH x[i] = opaque(x[i]);
}

// Vectors an elementary function takes at once (the N of the functions above): more independent
// chains per step keep the ports busier until their temporaries no longer fit in the sixteen
// vector registers (tanh, between add/mul stages, fits two; the others four: erf's eight double
// chains ran faster than four or twelve). The functions are bound by the throughput of the
// floating-point ports, not by latency or the divider, so more vectors at a time, Estrin's scheme
// for the polynomials or a reciprocal estimate in place of the division all ran slower
// (bench/results/cpu_kernel_design.md).
template <ChainStage::Kind Kind>
constexpr int unary_group() { return Kind == ChainStage::Tanh ? 2 : 4; }

// out[0..m) = the elementary function Kind of in[0..m): unary_group vectors at a time, then
// single vectors, then the rest through masked loads and stores (lanes past the end read nothing:
// masked loads give 0). out may be in.
template <ChainStage::Kind Kind>
void unary_pass(const float* in, float* out, int64_t m) {
  constexpr int G = unary_group<Kind>();
  const StageLoop c{nullptr, 0, Kind, 0.0f, 0.0f};
  const __m256i none = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 8 * G <= m; j += 8 * G) {
    V x[G];
    for (int i = 0; i < G; ++i) x[i] = _mm256_loadu_ps(in + j + 8 * i);
    apply_stage<Kind, G, false>(c, x, j, none);
    for (int i = 0; i < G; ++i) _mm256_storeu_ps(out + j + 8 * i, x[i]);
  }
  for (; j + 8 <= m; j += 8) {
    V x = _mm256_loadu_ps(in + j);
    apply_stage<Kind, 1, false>(c, &x, j, none);
    _mm256_storeu_ps(out + j, x);
  }
  if (j < m) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m - j)), lane);
    V x = _mm256_maskload_ps(in + j, mask);
    apply_stage<Kind, 1, true>(c, &x, j, mask);
    _mm256_maskstore_ps(out + j, mask, x);
  }
}

// dst[j] = op(src[j]) for the opcodes evaluated with intrinsics; false for the others. dst may
// be src (each vector is read before it is written).
bool vector_unary(Op op, const float* src, float* dst, int64_t n) {
  using K = ChainStage;
  switch (op) {
    case Op::Exp: unary_pass<K::Exp>(src, dst, n); return true;
    case Op::Log: unary_pass<K::Log>(src, dst, n); return true;
    case Op::Erf: unary_pass<K::Erf>(src, dst, n); return true;
    case Op::Tanh: unary_pass<K::Tanh>(src, dst, n); return true;
    case Op::Sigmoid: unary_pass<K::Sigmoid>(src, dst, n); return true;
    default: return false;
  }
}

// The stages other than the elementary functions, U vectors at a time.
template <int U, bool Tail>
ONNXFUSE_INLINE void apply_simple(const StageLoop& c, V* x, int64_t j, __m256i mask) {
  using K = ChainStage;
  switch (c.kind) {
#define ONNXFUSE_KIND(k) \
  case K::k: apply_stage<K::k, U, Tail>(c, x, j, mask); break;
    ONNXFUSE_KIND(Add) ONNXFUSE_KIND(Sub) ONNXFUSE_KIND(RSub) ONNXFUSE_KIND(Mul) ONNXFUSE_KIND(Div)
    ONNXFUSE_KIND(RDiv) ONNXFUSE_KIND(Max) ONNXFUSE_KIND(RMax) ONNXFUSE_KIND(Min) ONNXFUSE_KIND(RMin)
    ONNXFUSE_KIND(MaxC) ONNXFUSE_KIND(MinC) ONNXFUSE_KIND(Neg) ONNXFUSE_KIND(Abs) ONNXFUSE_KIND(Relu)
    ONNXFUSE_KIND(Sqrt) ONNXFUSE_KIND(Recip) ONNXFUSE_KIND(Floor) ONNXFUSE_KIND(Ceil) ONNXFUSE_KIND(Round)
    ONNXFUSE_KIND(LeakyRelu) ONNXFUSE_KIND(Clip)
#undef ONNXFUSE_KIND
    default: break;  // elementary functions: their own segments
  }
}

// Vectors a run of simple stages carries in registers at once: eight independent chains keep
// the ports busy through the latency of each stage, with registers left for the operands.
constexpr int kSimpleGroup = 8;

// out[0..m) = the simple stages st[0..count) applied to in[0..m) (elements [j0, j0 + m) of the
// block), each vector kept in a register from its load to its store: one pass over memory and one
// dispatch per stage per kSimpleGroup vectors. out may be in.
void simple_pass(const StageLoop* st, int count, const float* in, float* out, int64_t j0, int64_t m) {
  const __m256i none = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 8 * kSimpleGroup <= m; j += 8 * kSimpleGroup) {
    V x[kSimpleGroup];
    for (int i = 0; i < kSimpleGroup; ++i) x[i] = _mm256_loadu_ps(in + j + 8 * i);
    for (int s = 0; s < count; ++s) apply_simple<kSimpleGroup, false>(st[s], x, j0 + j, none);
    for (int i = 0; i < kSimpleGroup; ++i) _mm256_storeu_ps(out + j + 8 * i, x[i]);
  }
  for (; j + 8 <= m; j += 8) {
    V x = _mm256_loadu_ps(in + j);
    for (int s = 0; s < count; ++s) apply_simple<1, false>(st[s], &x, j0 + j, none);
    _mm256_storeu_ps(out + j, x);
  }
  if (j < m) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m - j)), lane);
    V x = _mm256_maskload_ps(in + j, mask);
    for (int s = 0; s < count; ++s) apply_simple<1, true>(st[s], &x, j0 + j, mask);
    _mm256_maskstore_ps(out + j, mask, x);
  }
}

// An affine stage with the kind known at run time: a predicted branch per vector, which costs no
// floating-point port (those bound the elementary functions' loops); y: the other operand.
ONNXFUSE_INLINE V affine_stage(ChainStage::Kind kind, V x, V y) {
  switch (kind) {
    case ChainStage::Add: return opaque(_mm256_add_ps(x, y));
    case ChainStage::Sub: return opaque(_mm256_sub_ps(x, y));
    case ChainStage::RSub: return opaque(_mm256_sub_ps(y, x));
    default: break;
  }
  return opaque(_mm256_mul_ps(x, y));
}

// A stage's other operand walked one vector at a time: advanced by `step` floats per vector (8
// for a contiguous operand, 0 for a constant).
struct Cursor {
  const float* o;
  int64_t step;
  ChainStage::Kind kind;
};

// Cursors for stages st[0..n) from element j0 of the block.
ONNXFUSE_INLINE void start_cursors(const StageLoop* st, int n, int64_t j0, Cursor* c) {
  for (int s = 0; s < n; ++s) c[s] = {st[s].o + (j0 & st[s].mask), st[s].mask & 8, st[s].kind};
}

// N vectors through the affine stage of cursor c: vector i's other operand is at c.o + i c.step.
template <int N, bool Tail>
ONNXFUSE_INLINE void affine_n(const Cursor& c, V* x, __m256i mask) {
  V y[N];
  ONNXFUSE_EACH y[i] = load8<Tail>(c.o + i * c.step, mask);
  ONNXFUSE_EACH x[i] = affine_stage(c.kind, x[i], y[i]);
}

template <int NPre, ChainStage::Kind Kind, int NPost, int N, bool Tail>
ONNXFUSE_INLINE void elementary_n(const StageLoop& f, const Cursor* c, const float* in, float* out, __m256i mask) {
  V x[N];
  ONNXFUSE_EACH x[i] = load8<Tail>(in + 8 * i, mask);
  for (int s = 0; s < NPre; ++s) affine_n<N, Tail>(c[s], x, mask);
  apply_stage<Kind, N, Tail>(f, x, 0, mask);
  for (int s = NPre; s < NPre + NPost; ++s) affine_n<N, Tail>(c[s], x, mask);
  ONNXFUSE_EACH store8<Tail>(out + 8 * i, mask, x[i]);
}

// out[0..m) = a segment applied to in[0..m) (elements [j0, j0 + m) of the block): NPre affine
// stages, the elementary function Kind and NPost affine stages, unary_group<Kind> vectors at a
// time in registers.
template <int NPre, ChainStage::Kind Kind, int NPost>
void elementary_pass(const StageLoop* st, const float* in, float* out, int64_t j0, int64_t m) {
  // Locals: stores to out could alias *st as far as the compiler knows, which would reload every
  // field per vector.
  constexpr int kAffine = NPre + NPost;
  constexpr int G = unary_group<Kind>();
  Cursor c[kAffine > 0 ? kAffine : 1];
  start_cursors(st, NPre, j0, c);
  start_cursors(st + NPre + 1, NPost, j0, c + NPre);
  const StageLoop f = st[NPre];
  const __m256i none = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 8 * G <= m; j += 8 * G) {
    elementary_n<NPre, Kind, NPost, G, false>(f, c, in + j, out + j, none);
    for (int s = 0; s < kAffine; ++s) c[s].o += G * c[s].step;
  }
  for (; j + 8 <= m; j += 8) {
    elementary_n<NPre, Kind, NPost, 1, false>(f, c, in + j, out + j, none);
    for (int s = 0; s < kAffine; ++s) c[s].o += c[s].step;
  }
  if (j < m) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m - j)), lane);
    elementary_n<NPre, Kind, NPost, 1, true>(f, c, in + j, out + j, mask);
  }
}

using SegmentFn = void (*)(const StageLoop*, const float*, float*, int64_t, int64_t);

template <int NPre, int NPost>
SegmentFn elementary_fn(ChainStage::Kind kind) {
  using K = ChainStage;
  switch (kind) {
    case K::Exp: return elementary_pass<NPre, K::Exp, NPost>;
    case K::Log: return elementary_pass<NPre, K::Log, NPost>;
    case K::Erf: return elementary_pass<NPre, K::Erf, NPost>;
    case K::Tanh: return elementary_pass<NPre, K::Tanh, NPost>;
    case K::Sigmoid: return elementary_pass<NPre, K::Sigmoid, NPost>;
    default: return nullptr;
  }
}

static_assert(kMaxAffine == 2, "elementary_fn instantiates 0..2 affine stages on each side");

SegmentFn elementary_fn(int npre, ChainStage::Kind kind, int npost) {
  switch (npre * 3 + npost) {
    case 0: return elementary_fn<0, 0>(kind);
    case 1: return elementary_fn<0, 1>(kind);
    case 2: return elementary_fn<0, 2>(kind);
    case 3: return elementary_fn<1, 0>(kind);
    case 4: return elementary_fn<1, 1>(kind);
    case 5: return elementary_fn<1, 2>(kind);
    case 6: return elementary_fn<2, 0>(kind);
    case 7: return elementary_fn<2, 1>(kind);
    case 8: return elementary_fn<2, 2>(kind);
  }
  return nullptr;
}

// Two affine stages and nothing else: too little arithmetic to hide a dispatch on the kinds (it
// ran slower than the two instructions' separate loops), so the kinds are compiled in.
template <ChainStage::Kind K0, ChainStage::Kind K1>
void affine2_pass(const StageLoop* st, const float* in, float* out, int64_t j0, int64_t m) {
  Cursor c[2];
  start_cursors(st, 2, j0, c);
  int64_t j = 0;
  for (; j + 8 <= m; j += 8, c[0].o += c[0].step, c[1].o += c[1].step) {
    V x = affine_stage(K0, _mm256_loadu_ps(in + j), _mm256_loadu_ps(c[0].o));
    _mm256_storeu_ps(out + j, affine_stage(K1, x, _mm256_loadu_ps(c[1].o)));
  }
  if (j < m) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m - j)), lane);
    V x = affine_stage(K0, _mm256_maskload_ps(in + j, mask), _mm256_maskload_ps(c[0].o, mask));
    _mm256_maskstore_ps(out + j, mask, affine_stage(K1, x, _mm256_maskload_ps(c[1].o, mask)));
  }
}

template <ChainStage::Kind K0>
SegmentFn affine2_fn(ChainStage::Kind k1) {
  using K = ChainStage;
  switch (k1) {
    case K::Add: return affine2_pass<K0, K::Add>;
    case K::Sub: return affine2_pass<K0, K::Sub>;
    case K::RSub: return affine2_pass<K0, K::RSub>;
    default: break;
  }
  return affine2_pass<K0, K::Mul>;
}

SegmentFn affine2_fn(ChainStage::Kind k0, ChainStage::Kind k1) {
  using K = ChainStage;
  switch (k0) {
    case K::Add: return affine2_fn<K::Add>(k1);
    case K::Sub: return affine2_fn<K::Sub>(k1);
    case K::RSub: return affine2_fn<K::RSub>(k1);
    default: break;
  }
  return affine2_fn<K::Mul>(k1);
}

// Elements per tile of a chain of several segments: every segment runs over the tile before the
// next, through a tile buffer that stays in L1.
constexpr int64_t kChainTile = kBlock;

// Evaluates a FusedStep over n elements: src is the running value, others[s] the other operand
// of binary stage s (a Val: contiguous floats or a constant). Per tile, the first segment reads
// src, the last writes dst, the others go through the tile buffer; each element is read by every
// stage before the last writes it, so dst may be src or another stage's operand.
template <class ValT>
void fused_step(const FusedStep& step, const float* src, const ValT* others, float* dst, int64_t n) {
  using K = ChainStage;
  // Locals: stores to dst could alias the stages as far as the compiler knows.
  StageLoop st[kMaxChain];
  alignas(32) float splats[kMaxChain][8];
  const int count = step.count;
  for (int s = 0; s < count; ++s) {
    const ChainStage& cs = step.stages[s];
    st[s] = {nullptr, 0, cs.kind, cs.p0, cs.p1};
    if (cs.other < 0) continue;
    const ValT& o = others[s];
    if (!o.scalar) {
      st[s].o = o.p;
      st[s].mask = ~int64_t{0};
      continue;
    }
    for (int l = 0; l < 8; ++l) splats[s][l] = o.s;
    st[s].o = splats[s];
    // max_nan(o, x) for an o that is no NaN is MAXPS(o, x) (x when x is NaN; o > x ? o : x
    // otherwise), and so is max_nan(x, o) unless o is a zero (x > o ? x : o differs from it only
    // for equal operands, -0 and +0). Likewise for min.
    const bool number = o.s == o.s, nonzero = o.s != 0.0f;
    if ((cs.kind == K::RMax && number) || (cs.kind == K::Max && number && nonzero)) st[s].kind = K::MaxC;
    if ((cs.kind == K::RMin && number) || (cs.kind == K::Min && number && nonzero)) st[s].kind = K::MinC;
  }
  const int nseg = step.num_segments;
  auto run_segment = [&](int g, const float* in, float* out, int64_t j0, int64_t m) {
    const ChainSegment& sg = step.segments[g];
    const StageLoop* first = st + sg.begin;
    if (sg.pre >= 0)
      elementary_fn(sg.pre, first[sg.pre].kind, sg.count - sg.pre - 1)(first, in, out, j0, m);
    else if (sg.count == 2 && affine_kind(first[0].kind) && affine_kind(first[1].kind))
      affine2_fn(first[0].kind, first[1].kind)(first, in, out, j0, m);
    else
      simple_pass(first, sg.count, in, out, j0, m);
  };
  if (nseg == 1) {
    run_segment(0, src, dst, 0, n);
    return;
  }
  alignas(32) float tile[kChainTile];
  for (int64_t j0 = 0; j0 < n; j0 += kChainTile) {
    const int64_t m = std::min(kChainTile, n - j0);
    for (int g = 0; g < nseg; ++g) run_segment(g, g == 0 ? src + j0 : tile, g == nseg - 1 ? dst + j0 : tile, j0, m);
  }
}

#undef ONNXFUSE_EACH

}  // namespace

#define ONNXFUSE_VECTOR_UNARY_F32 vector_unary
#define ONNXFUSE_FUSED_STEP_F32 fused_step
#include "pointwise_exec.inc"
}  // namespace isa_avx2
}  // namespace onnxfuse
#pragma GCC pop_options
#else
namespace onnxfuse {
namespace isa_avx2 {
void run_task(const ExecJob& job, int64_t task) { isa_base::run_task(job, task); }
void apply_unary_f32(const Instr& ins, float* data, int64_t n) { isa_base::apply_unary_f32(ins, data, n); }
}  // namespace isa_avx2
}  // namespace onnxfuse
#endif
