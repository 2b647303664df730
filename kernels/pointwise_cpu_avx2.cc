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
// It also evaluates each FusedStep (pointwise_cpu.h) in one pass (fused_step below): those
// functions with the add/sub/mul instructions before and after them, per vector in registers, so
// a chain pays one load and store per run rather than per instruction. Long chains of these
// functions are then bound by the FMA/multiply ports (about 30 such operations per eight elements
// for the eight-op tanh/sigmoid/exp chain of bench/pointwise_cpu.py), not by the interpreter.
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

// y * 2^n for y in [0.7, 1.5] and n in [-150, 128], given N = n << 23, rounded once: y gets
// 2^n1 added into its exponent field (n1 = n clamped to [-125, 127], exact and normal), then one
// multiplication by 2^(n - n1) rounds subnormal results once and overflows to inf past FLT_MAX.
// Upper = false: n <= 0 is known, no upper clamp needed.
template <bool Upper>
ONNXFUSE_INLINE V scale_pow2(V y, __m256i N) {
  __m256i n1 = _mm256_max_epi32(N, _mm256_set1_epi32(-125 << 23));
  if (Upper) n1 = _mm256_min_epi32(n1, _mm256_set1_epi32(127 << 23));
  V y1 = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), n1));
  V s2 = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_sub_epi32(N, n1), _mm256_set1_epi32(0x3f800000)));
  // A NaN y stays NaN: the integer add above would carry a payload such as 0xffffffff (what
  // MLAS's GEMM writes) into the exponent and sign, making it a finite number.
  return _mm256_blendv_ps(_mm256_mul_ps(y1, s2), y, is_nan(y));
}

// The shared part: y = exp(r) in [sqrt(1/2), sqrt(2)] and *N = n << 23 (the low bits of t shifted
// into the exponent field; the magic's bits shift out), with exp(x) = y * 2^n.
ONNXFUSE_INLINE V exp_mantissa(V x, __m256i* N) {
  const V magic = splat(12582912.0f);  // 1.5 * 2^23: t holds round(x / ln2) in its low bits
  V t = _mm256_fmadd_ps(x, splat(1.44269504088896341f), magic);
  V n = _mm256_sub_ps(t, magic);
  V r = _mm256_fnmadd_ps(n, splat(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, splat(-2.12194440e-4f), r);
  V p = splat(num::kExpP[0]);
  p = _mm256_fmadd_ps(p, r, splat(num::kExpP[1]));
  p = _mm256_fmadd_ps(p, r, splat(num::kExpP[2]));
  p = _mm256_fmadd_ps(p, r, splat(num::kExpP[3]));
  p = _mm256_fmadd_ps(p, r, splat(num::kExpP[4]));
  *N = _mm256_slli_epi32(_mm256_castps_si256(t), 23);
  return _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), splat(1.0f));
}

// exp(x) for x in [-104, 89] (NaN passes through): the scheme of num::exp_f32. x = n ln2 + r
// (Cody-Waite, two FMAs), exp(r) = 1 + r + r^2 P(r) with P of degree 4 (relative error 3e-9),
// then scale_pow2. exp(x) past num::kExpMaxFinite overflows to inf in the final multiplication.
template <bool Upper>
ONNXFUSE_INLINE V exp_reduced(V x) {
  __m256i N;
  V y = exp_mantissa(x, &N);
  return scale_pow2<Upper>(y, N);
}

// exp_reduced for |x| <= 86 in every lane: n = round(x / ln2) is within [-125, 125], so y * 2^n
// is the normal float made by adding n to y's exponent field, what scale_pow2 computes there
// (bit for bit) without its clamps, scaling and NaN check.
ONNXFUSE_INLINE V exp_in_range(V x) {
  __m256i N;
  V y = exp_mantissa(x, &N);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), N));
}

// True when every lane of x is within [-86, 86] (no NaN): exp_in_range applies.
ONNXFUSE_INLINE bool exp_in_range_all(V x) {
  V out = _mm256_cmp_ps(_mm256_andnot_ps(splat(-0.0f), x), splat(86.0f), _CMP_NLE_UQ);
  return _mm256_testz_ps(out, out);
}

// The clamps send -inf to 0 and +inf to inf; exp(x) for x in (kExpMaxFinite, 89] overflows to inf.
ONNXFUSE_INLINE V exp8(V x) {
  if (exp_in_range_all(x)) return exp_in_range(x);
  return exp_reduced<true>(max_keep_nan(-104.0f, min_keep_nan(89.0f, x)));
}

// sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0, e = exp(-|x|) in (0, 1]:
// nothing overflows, the tail keeps its relative accuracy (subnormal results included), and one
// division (cheaper than a refined reciprocal here, and exact) gives both cases.
ONNXFUSE_INLINE V sigmoid8(V x) {
  const V neg = _mm256_or_ps(x, splat(-0.0f));  // -|x|; NaN stays
  V e = exp_in_range_all(neg) ? exp_in_range(neg) : exp_reduced<false>(max_keep_nan(-104.0f, neg));
  V num = _mm256_blendv_ps(splat(1.0f), e, x);  // by the sign bit of x
  return _mm256_div_ps(num, _mm256_add_ps(splat(1.0f), e));
}

// tanh: the rational of num::tanh_f32, x P(x^2) / Q(x^2) on [-9, 9]. Evaluated with FMAs and a
// division, it reaches 1 (after the clamp to [-1, 1]) at |x| = 9, so every |x| >= 9 gives exactly
// +-1, as float32 tanh does past 9.0109 (onnxruntime's too); the last 0.01 below is within 0.52 ulp.
// Being odd (P and Q have positive coefficients), it is evaluated at |x| and given x's sign back:
// the same bits as clamping x itself to [-9, 9] and the result to [-1, 1], with half the clamps.
ONNXFUSE_INLINE V tanh8(V x) {
  const V sign = splat(-0.0f);
  V xc = min_keep_nan(9.0f, _mm256_andnot_ps(sign, x));  // NaN stays NaN
  V z = _mm256_mul_ps(xc, xc);
  V p = splat(num::kTanhP[0]);
  p = _mm256_fmadd_ps(p, z, splat(num::kTanhP[1]));
  p = _mm256_fmadd_ps(p, z, splat(num::kTanhP[2]));
  p = _mm256_fmadd_ps(p, z, splat(num::kTanhP[3]));
  p = _mm256_fmadd_ps(p, z, splat(num::kTanhP[4]));
  V q = splat(num::kTanhQ[0]);
  q = _mm256_fmadd_ps(q, z, splat(num::kTanhQ[1]));
  q = _mm256_fmadd_ps(q, z, splat(num::kTanhQ[2]));
  q = _mm256_fmadd_ps(q, z, splat(num::kTanhQ[3]));
  q = _mm256_fmadd_ps(q, z, splat(num::kTanhQ[4]));
  V r = min_keep_nan(1.0f, _mm256_div_ps(_mm256_mul_ps(xc, p), q));
  return _mm256_or_ps(r, _mm256_and_ps(x, sign));
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

// erf(x) = x P(x^2) / Q(x^2) for |x| <= 4 (num::kErfP, kErfQ: one rational fitted for this
// file, relative error 6.5e-8 before rounding, within 6 ulps evaluated in float32); |x| is clamped
// to 4, where the rational reaches 1 (erf rounds to 1 in float32 past 3.92), and the result to 1.
ONNXFUSE_INLINE V erf8(V x) {
  const V sign = splat(-0.0f);
  V a = min_keep_nan(4.0f, _mm256_andnot_ps(sign, x));
  V z = _mm256_mul_ps(a, a);
  V p = splat(num::kErfP[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, z, splat(num::kErfP[i]));
  V q = splat(num::kErfQ[0]);
  for (int i = 1; i < 5; ++i) q = _mm256_fmadd_ps(q, z, splat(num::kErfQ[i]));
  V r = min_keep_nan(1.0f, _mm256_div_ps(_mm256_mul_ps(a, p), q));
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

// One affine stage of a FusedStep as its loop reads it: the other operand advanced by `step`
// floats per vector (8 for a contiguous operand, 0 for a constant, read from eight copies). Each
// stage is the same single IEEE operation as the instruction it replaces. The branch on the kind
// is loop-invariant and predicted; it costs no floating-point port, which bounds these loops.
struct StageLoop {
  const float* o;
  int64_t step;
  AffineStage::Kind kind;
};

// A stage's operand: the Val's floats, or its constant copied into `splat`.
template <class ValT>
StageLoop stage_loop(AffineStage::Kind kind, const ValT& o, float* splat) {
  if (!o.scalar) return {o.p, 8, kind};
  for (int l = 0; l < 8; ++l) splat[l] = o.s;
  return {splat, 0, kind};
}

template <bool Tail>
ONNXFUSE_INLINE V load8(const float* p, __m256i mask) {
  if constexpr (Tail) return _mm256_maskload_ps(p, mask);
  else return _mm256_loadu_ps(p);
}

// The result is hidden from the optimizer (an empty asm that "changes" it): g++ contracts a
// multiplication feeding an addition into one FMA, rounding once where the separate instructions
// round twice.
ONNXFUSE_INLINE V opaque(V x) {
  __asm__("" : "+x"(x));
  return x;
}

ONNXFUSE_INLINE V apply_stage(AffineStage::Kind kind, V x, V o) {
  switch (kind) {
    case AffineStage::Add: return opaque(_mm256_add_ps(x, o));
    case AffineStage::Sub: return opaque(_mm256_sub_ps(x, o));
    case AffineStage::RSub: return opaque(_mm256_sub_ps(o, x));
    case AffineStage::Mul: break;
  }
  return opaque(_mm256_mul_ps(x, o));
}

template <int NPre, V (*F)(V), int NPost, bool Tail>
ONNXFUSE_INLINE V step8(const StageLoop* st, const float* src, __m256i mask) {
  V x = load8<Tail>(src, mask);
  for (int s = 0; s < NPre + NPost; ++s) {
    if (s == NPre) x = opaque(F(x));
    x = apply_stage(st[s].kind, x, load8<Tail>(st[s].o, mask));
  }
  if (NPost == 0) x = F(x);
  return x;
}

template <int NPre, V (*F)(V), int NPost>
void run_step(const StageLoop* stages, const float* src, float* dst, int64_t n) {
  // A local copy: stores to dst could alias *stages as far as the compiler knows, which would
  // reload every field per vector.
  constexpr int kStages = NPre + NPost;
  StageLoop st[kStages > 0 ? kStages : 1];
  for (int s = 0; s < kStages; ++s) st[s] = stages[s];
  const __m256i none = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(dst + j, step8<NPre, F, NPost, false>(st, src + j, none));
    for (int s = 0; s < kStages; ++s) st[s].o += st[s].step;
  }
  if (const int64_t rest = n - j) {
    // Lanes past the end read nothing (masked loads give 0) and are not stored.
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rest)), lane);
    _mm256_maskstore_ps(dst + j, mask, step8<NPre, F, NPost, true>(st, src + j, mask));
  }
}

using StepFn = void (*)(const StageLoop*, const float*, float*, int64_t);

// Two affine stages and nothing else: too little arithmetic to hide the per-vector branches on
// the kinds (it ran slower than the two instructions' separate loops), so the kinds are compiled in.
template <AffineStage::Kind K0, AffineStage::Kind K1>
void run_affine2(const StageLoop* stages, const float* src, float* dst, int64_t n) {
  const float* o0 = stages[0].o;
  const float* o1 = stages[1].o;
  const int64_t s0 = stages[0].step, s1 = stages[1].step;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8, o0 += s0, o1 += s1) {
    V x = apply_stage(K0, _mm256_loadu_ps(src + j), _mm256_loadu_ps(o0));
    _mm256_storeu_ps(dst + j, apply_stage(K1, x, _mm256_loadu_ps(o1)));
  }
  if (const int64_t rest = n - j) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rest)), lane);
    V x = apply_stage(K0, _mm256_maskload_ps(src + j, mask), _mm256_maskload_ps(o0, mask));
    _mm256_maskstore_ps(dst + j, mask, apply_stage(K1, x, _mm256_maskload_ps(o1, mask)));
  }
}

template <AffineStage::Kind K0>
StepFn affine2_fn(AffineStage::Kind k1) {
  switch (k1) {
    case AffineStage::Add: return run_affine2<K0, AffineStage::Add>;
    case AffineStage::Sub: return run_affine2<K0, AffineStage::Sub>;
    case AffineStage::RSub: return run_affine2<K0, AffineStage::RSub>;
    case AffineStage::Mul: break;
  }
  return run_affine2<K0, AffineStage::Mul>;
}

StepFn affine2_fn(AffineStage::Kind k0, AffineStage::Kind k1) {
  switch (k0) {
    case AffineStage::Add: return affine2_fn<AffineStage::Add>(k1);
    case AffineStage::Sub: return affine2_fn<AffineStage::Sub>(k1);
    case AffineStage::RSub: return affine2_fn<AffineStage::RSub>(k1);
    case AffineStage::Mul: break;
  }
  return affine2_fn<AffineStage::Mul>(k1);
}

template <int NPre, int NPost>
StepFn step_fn(const FusedStep& st) {
  switch (st.unary) {
    case Op::Exp: return run_step<NPre, exp8, NPost>;
    case Op::Log: return run_step<NPre, log8, NPost>;
    case Op::Erf: return run_step<NPre, erf8, NPost>;
    case Op::Tanh: return run_step<NPre, tanh8, NPost>;
    case Op::Sigmoid: return run_step<NPre, sigmoid8, NPost>;
    default: return nullptr;
  }
}

static_assert(kMaxAffine == 2, "fused_step instantiates 0..2 stages on each side");

// Evaluates a FusedStep over n elements: src is the running value, others[s] the other operand
// of stage s (a Val: contiguous floats or a constant).
template <class ValT>
void fused_step(const FusedStep& st, const float* src, const ValT* others, float* dst, int64_t n) {
  StageLoop rt[2 * kMaxAffine];
  alignas(32) float splats[2 * kMaxAffine][8];
  for (int s = 0; s < st.num_pre + st.num_post; ++s) rt[s] = stage_loop(st.stages[s].kind, others[s], splats[s]);
  StepFn fn = nullptr;
  if (!st.has_unary) {  // then it is two affine stages (plan_fused_steps)
    affine2_fn(st.stages[0].kind, st.stages[1].kind)(rt, src, dst, n);
    return;
  }
  switch (st.num_pre * 3 + st.num_post) {
    case 0: fn = step_fn<0, 0>(st); break;
    case 1: fn = step_fn<0, 1>(st); break;
    case 2: fn = step_fn<0, 2>(st); break;
    case 3: fn = step_fn<1, 0>(st); break;
    case 4: fn = step_fn<1, 1>(st); break;
    case 5: fn = step_fn<1, 2>(st); break;
    case 6: fn = step_fn<2, 0>(st); break;
    case 7: fn = step_fn<2, 1>(st); break;
    case 8: fn = step_fn<2, 2>(st); break;
  }
  fn(rt, src, dst, n);
}

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
}  // namespace isa_avx2
}  // namespace onnxfuse
#endif
