// The block executor built for AVX2 + FMA + F16C (x86-64-v3); chosen at run time by
// select_run_task when the CPU has them, so one build serves every x86-64 machine.
//
// On top of the shared executor, this build evaluates the hot float32 transcendental opcodes
// (exp, log, erf, tanh, sigmoid) eight lanes at a time with intrinsics (vector_unary below).
// They follow program.py's semantics: NaN in gives NaN out, exp(+-inf) = inf / 0, log(0) = -inf,
// log(x < 0) = NaN, log(inf) = inf, erf/tanh(+-inf) = +-1, sigmoid(+-inf) = 1 / 0; subnormal
// inputs and results are handled. Accuracy: a few ulp (tests compare with numpy at rtol 1e-5).
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

// 1 / d for d in [1, 2^24] or so: the 12-bit reciprocal estimate refined by one Newton step
// (relative error about 2^-22), cheaper than a division on the critical path.
ONNXFUSE_INLINE V reciprocal(V d) {
  V r = _mm256_rcp_ps(d);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, splat(2.0f)));
}

// exp for x <= num::kExpMaxFinite (no overflow handling): the scheme of num::exp_f32 (x = n ln2 + r,
// degree-6 polynomial, 2^n applied in two halves so subnormal results round once).
ONNXFUSE_INLINE V exp_no_overflow(V x) {
  const V magic = splat(12582912.0f);
  V xc = max_keep_nan(-104.0f, min_keep_nan(num::kExpMaxFinite, x));
  V t = _mm256_fmadd_ps(xc, splat(1.44269504088896341f), magic);
  V n = _mm256_sub_ps(t, magic);
  V r = _mm256_fnmadd_ps(n, splat(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, splat(-2.12194440e-4f), r);
  V p = splat(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, splat(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, splat(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, splat(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, splat(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, splat(5.0000001201e-1f));
  V y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), splat(1.0f));
  __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
  __m256i n1 = _mm256_srai_epi32(ni, 1);
  __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  V s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  V s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
}

ONNXFUSE_INLINE V exp8(V x) {
  V big = _mm256_cmp_ps(x, splat(num::kExpMaxFinite), _CMP_GT_OQ);
  return _mm256_blendv_ps(exp_no_overflow(x), splat(INFINITY), big);
}

// sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0, e = exp(-|x|) in (0, 1]:
// nothing overflows and the denominator stays in [1, 2], where the refined reciprocal is exact
// enough.
ONNXFUSE_INLINE V sigmoid8(V x) {
  V e = exp_no_overflow(_mm256_or_ps(x, splat(-0.0f)));  // -|x|, NaN stays NaN
  V r = reciprocal(_mm256_add_ps(splat(1.0f), e));
  return _mm256_blendv_ps(r, _mm256_mul_ps(e, r), x);  // by the sign bit of x
}

// tanh: the rational of num::tanh_f32 (within 6 ulps up to |x| = 9), and exactly +-1 past
// |x| = 9.0109, where float32 tanh rounds to +-1 (as onnxruntime's does): the rational alone
// stops 5 ulps short of 1 there, which an ill-conditioned consumer (a power with a huge
// exponent) magnifies.
ONNXFUSE_INLINE V tanh8(V x) {
  V xc = max_keep_nan(-9.0f, min_keep_nan(9.0f, x));
  V z = _mm256_mul_ps(xc, xc);
  V p = splat(-8.489262523702124e-14f);
  p = _mm256_fmadd_ps(p, z, splat(5.2782458524004754e-11f));
  p = _mm256_fmadd_ps(p, z, splat(-2.0226027843409983e-08f));
  p = _mm256_fmadd_ps(p, z, splat(1.1154547001772391e-05f));
  p = _mm256_fmadd_ps(p, z, splat(0.003103981597199744f));
  p = _mm256_fmadd_ps(p, z, splat(0.1308403360950085f));
  p = _mm256_fmadd_ps(p, z, splat(0.9999999934116282f));
  V q = splat(0.0002546180636283338f);
  q = _mm256_fmadd_ps(q, z, splat(0.02449528195179353f));
  q = _mm256_fmadd_ps(q, z, splat(0.46417360730632895f));
  q = _mm256_fmadd_ps(q, z, splat(1.0f));
  V r = max_keep_nan(-1.0f, min_keep_nan(1.0f, _mm256_mul_ps(_mm256_mul_ps(xc, p), reciprocal(q))));
  const V sign_bit = splat(-0.0f);
  V saturated = _mm256_cmp_ps(_mm256_andnot_ps(sign_bit, x), splat(num::kTanhSaturation), _CMP_GT_OQ);
  return _mm256_blendv_ps(r, _mm256_or_ps(splat(1.0f), _mm256_and_ps(x, sign_bit)), saturated);
}

// log(x): x = 2^e m with m in [sqrt(1/2), sqrt(2)), log(m) = f - f^2/2 + f^3 P(f) for f = m - 1
// (P fitted to log1p on that interval), e ln2 added in two parts. Subnormals are scaled by 2^23
// first.
ONNXFUSE_INLINE V log8(V x) {
  V sub = _mm256_and_ps(_mm256_cmp_ps(x, splat(1.17549435e-38f), _CMP_LT_OQ),
                        _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
  V xs = _mm256_blendv_ps(x, _mm256_mul_ps(x, splat(8388608.0f)), sub);
  __m256i bits = _mm256_castps_si256(xs);
  V e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  e = _mm256_sub_ps(e, _mm256_and_ps(sub, splat(23.0f)));
  V m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
  V upper = _mm256_cmp_ps(m, splat(1.41421356f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, splat(0.5f)), upper);
  e = _mm256_add_ps(e, _mm256_and_ps(upper, splat(1.0f)));
  V f = _mm256_sub_ps(m, splat(1.0f));
  V p = splat(0.07148932665586472f);
  p = _mm256_fmadd_ps(p, f, splat(-0.1157151386141777f));
  p = _mm256_fmadd_ps(p, f, splat(0.1166200265288353f));
  p = _mm256_fmadd_ps(p, f, splat(-0.12411021441221237f));
  p = _mm256_fmadd_ps(p, f, splat(0.14249871671199799f));
  p = _mm256_fmadd_ps(p, f, splat(-0.1666848063468933f));
  p = _mm256_fmadd_ps(p, f, splat(0.2000070959329605f));
  p = _mm256_fmadd_ps(p, f, splat(-0.24999989569187164f));
  p = _mm256_fmadd_ps(p, f, splat(0.3333333134651184f));
  V f2 = _mm256_mul_ps(f, f);
  V y = _mm256_mul_ps(_mm256_mul_ps(f2, f), p);
  y = _mm256_fmadd_ps(e, splat(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(splat(0.5f), f2, y);
  V r = _mm256_add_ps(f, y);
  r = _mm256_fmadd_ps(e, splat(0.693359375f), r);
  // Special values: log(0) = -inf, log(x < 0) = NaN, log(inf) = inf, NaN stays NaN.
  r = _mm256_blendv_ps(r, splat(-INFINITY), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_EQ_OQ));
  r = _mm256_blendv_ps(r, splat(NAN), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
  r = _mm256_blendv_ps(r, x, _mm256_or_ps(is_nan(x), _mm256_cmp_ps(x, splat(INFINITY), _CMP_EQ_OQ)));
  return r;
}

// erf(x): x P(x^2) for |x| < 1; 1 - exp(Q(|x|)) for |x| in [1, 4], Q fitted to log(erfc);
// beyond 4, erf rounds to +-1 in float32 (|x| is clamped to 4). Polynomials fitted for this file.
ONNXFUSE_INLINE V erf8(V x) {
  const V sign = splat(-0.0f);
  V a = min_keep_nan(4.0f, _mm256_andnot_ps(sign, x));
  V z = _mm256_mul_ps(a, a);
  V p = splat(7.933493907330558e-05f);
  p = _mm256_fmadd_ps(p, z, splat(-0.0008034846396185458f));
  p = _mm256_fmadd_ps(p, z, splat(0.005191218573600054f));
  p = _mm256_fmadd_ps(p, z, splat(-0.02685539983212948f));
  p = _mm256_fmadd_ps(p, z, splat(0.11283625662326813f));
  p = _mm256_fmadd_ps(p, z, splat(-0.3761262893676758f));
  p = _mm256_fmadd_ps(p, z, splat(1.128379225730896f));
  V small = _mm256_mul_ps(a, p);
  V q = splat(1.6140616025950294e-06f);
  q = _mm256_fmadd_ps(q, a, splat(-4.559062290354632e-05f));
  q = _mm256_fmadd_ps(q, a, splat(0.0005927695310674608f));
  q = _mm256_fmadd_ps(q, a, splat(-0.004740222357213497f));
  q = _mm256_fmadd_ps(q, a, splat(0.02636471763253212f));
  q = _mm256_fmadd_ps(q, a, splat(-0.10997824370861053f));
  q = _mm256_fmadd_ps(q, a, splat(-0.6319370865821838f));
  q = _mm256_fmadd_ps(q, a, splat(-1.1301666498184204f));
  q = _mm256_fmadd_ps(q, a, splat(0.0003032129898201674f));
  V large = _mm256_sub_ps(splat(1.0f), exp_no_overflow(q));
  V r = _mm256_blendv_ps(large, small, _mm256_cmp_ps(a, splat(1.0f), _CMP_LT_OQ));
  return _mm256_or_ps(r, _mm256_and_ps(x, sign));  // erf is odd; NaN stays NaN
}

template <V (*F)(V)>
ONNXFUSE_INLINE void apply8(const float* src, float* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, F(_mm256_loadu_ps(src + j)));
  if (j < n) {  // the tail through a full vector
    alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tail, src + j, static_cast<size_t>(n - j) * sizeof(float));
    _mm256_store_ps(tail, F(_mm256_load_ps(tail)));
    std::memcpy(dst + j, tail, static_cast<size_t>(n - j) * sizeof(float));
  }
}

// dst[j] = op(src[j]) for the opcodes evaluated with intrinsics; false for the others. dst may
// be src (each vector is read before it is written).
bool vector_unary(Op op, const float* src, float* dst, int64_t n) {
  switch (op) {
    case Op::Exp: apply8<exp8>(src, dst, n); return true;
    case Op::Log: apply8<log8>(src, dst, n); return true;
    case Op::Erf: apply8<erf8>(src, dst, n); return true;
    case Op::Tanh: apply8<tanh8>(src, dst, n); return true;
    case Op::Sigmoid: apply8<sigmoid8>(src, dst, n); return true;
    default: return false;
  }
}

}  // namespace

#define ONNXFUSE_VECTOR_UNARY_F32 vector_unary
#include "pointwise_exec.inc"
}  // namespace isa_avx2
}  // namespace onnxfuse
#pragma GCC pop_options
#else
namespace onnxfuse {
namespace isa_avx2 {
void run_task(const ExecJob& job, int64_t task) { isa_base::run_task(job, task); }
}  // namespace isa_avx2
}  // namespace onnxfuse
#endif
