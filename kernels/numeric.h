// Element conversions and elementary functions written so that g++ -O3 vectorizes the loops that
// call them: no branches (both sides of a select are computed), no calls, bit casts instead of
// type punning through memory.
//
// Everything here is `inline` and has no target attributes: the same definitions are inlined
// into the baseline and the AVX2 builds of the Pointwise executor (see pointwise_exec.inc).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define ONNXFUSE_INLINE inline __attribute__((always_inline))

namespace onnxfuse {
namespace num {

ONNXFUSE_INLINE uint32_t bits(float f) { return __builtin_bit_cast(uint32_t, f); }
ONNXFUSE_INLINE float from_bits(uint32_t u) { return __builtin_bit_cast(float, u); }
ONNXFUSE_INLINE uint64_t bits(double d) { return __builtin_bit_cast(uint64_t, d); }

// IEEE half -> float, exact (normals, subnormals, inf, NaN payloads).
ONNXFUSE_INLINE float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  // Shifting exponent and mantissa into float position and scaling by 2^112 rebias the exponent
  // and normalizes half subnormals in one multiplication.
  float scaled = from_bits(em << 13) * 0x1p112f;
  uint32_t special = (em << 13) | 0x7f800000u;  // inf / NaN keep their payload
  uint32_t r = em >= 0x7c00u ? special : bits(scaled);
  return from_bits(r | sign);
}

// float -> IEEE half, round to nearest even; overflow gives inf, NaN stays NaN (quiet).
ONNXFUSE_INLINE uint16_t float_to_half(float f) {
  uint32_t u = bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  // Normal halves: rebias and round the 13 dropped mantissa bits to nearest even.
  uint32_t normal = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;  // 0xc8000000 = (15-127) << 23
  // Half subnormals: adding 0.5 aligns the mantissa so that the FPU does the rounding.
  uint32_t sub = bits(from_bits(u) + 0.5f) - 0x3f000000u;
  uint32_t big = u > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN : inf (and overflow)
  uint32_t r = u >= 0x47800000u ? big : (u < 0x38800000u ? sub : normal);
  return static_cast<uint16_t>(r | sign);
}

// double -> IEEE half rounded once (not via a float rounding): round to float with "round to
// odd", which preserves the information the final rounding needs.
ONNXFUSE_INLINE uint16_t double_to_half(double d) {
  float f = static_cast<float>(d);
  double back = static_cast<double>(f);
  uint32_t u = bits(f);
  bool inexact = back != d && d == d;
  bool overshoot = std::fabs(back) > std::fabs(d);
  uint32_t mag = (u & 0x7fffffffu) - (inexact && overshoot ? 1u : 0u);
  mag |= inexact ? 1u : 0u;
  return float_to_half(from_bits(mag | (u & 0x80000000u)));
}

ONNXFUSE_INLINE float bf16_to_float(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

// float -> bfloat16, round to nearest even, NaN stays NaN.
ONNXFUSE_INLINE uint16_t float_to_bf16(float f) {
  uint32_t u = bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>(f != f ? nan : rounded);
}

// exp(x) for float, within 1 ulp (every float32 checked), subnormal results included: x = n ln2 + r
// with |r| <= ln2/2 (Cody-Waite in two steps), exp(r) = 1 + r + r^2 P(r) with P of degree 4 (a
// minimax fit, relative error 3e-9), then 2^n applied with one rounding (below). +inf gives inf,
// -inf gives 0, NaN propagates through the arithmetic. The AVX2 build evaluates the same formula.
constexpr float kExpP[5] = {1.3814612757e-03f, 8.3687100559e-03f, 4.1668388993e-02f, 1.6666521132e-01f,
                            4.9999994040e-01f};
// The largest float whose exp is finite (88.72283172607421875; the next float, 88.72284, gives
// more than FLT_MAX). A shorter literal such as 88.7228f sends 88.72281..88.72283 to inf.
constexpr float kExpMaxFinite = 88.72283172607421875f;

// y * 2^n for y in [0.7, 1.5], n in [-150, 128] given as N = n << 23: 2^n1 goes into y's exponent
// field (n1 = n clamped to [-125, 127]: exact, y stays normal and finite), then one multiplication
// by 2^(n - n1) rounds a subnormal result once, like libm, and overflows to inf past FLT_MAX.
ONNXFUSE_INLINE float scale_pow2(float y, int32_t n_shifted) {
  int32_t n1 = n_shifted < (-125 * (1 << 23)) ? (-125 * (1 << 23)) : n_shifted;
  n1 = n1 > (127 << 23) ? (127 << 23) : n1;
  float y1 = from_bits(bits(y) + static_cast<uint32_t>(n1));
  float r = y1 * from_bits(static_cast<uint32_t>(n_shifted - n1) + 0x3f800000u);
  return y != y ? y : r;  // a NaN payload must not carry into the exponent (see the AVX2 build)
}

// exp for x already clamped to [-104, 89] (or NaN).
ONNXFUSE_INLINE float exp_reduced(float xc) {
  // n = round(x / ln2) by the 1.5 * 2^23 trick: t holds n in its low mantissa bits.
  const float magic = 12582912.0f;
  float t = xc * 1.44269504088896341f + magic;
  float n = t - magic;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = kExpP[0];
  p = p * r + kExpP[1];
  p = p * r + kExpP[2];
  p = p * r + kExpP[3];
  p = p * r + kExpP[4];
  float y = p * (r * r) + r + 1.0f;
  // t's bits shifted left by 23 are n << 23: the magic's own bits shift out.
  return scale_pow2(y, static_cast<int32_t>(bits(t) << 23));
}

// The clamps send -inf to 0 (exp(-104) rounds to 0) and +inf to inf; past kExpMaxFinite the
// final multiplication overflows, exactly at the float32 boundary (tests check every float there).
ONNXFUSE_INLINE float exp_f32(float x) {
  float xc = x < -104.0f ? -104.0f : x;  // NaN passes both clamps
  xc = xc > 89.0f ? 89.0f : xc;
  return exp_reduced(xc);
}

// Past this |x|, float32 tanh(x) rounds to +-1 (atanh(1 - 2^-25) = 9.01091...).
constexpr float kTanhSaturation = 9.0109f;

// tanh(x) = x P(x^2) / Q(x^2) on [-9, 9], a rational fit (relative error 2e-8 before rounding,
// within 5 ulps evaluated with FMAs, 6 without) with the right limit near 0; exactly +-1 past
// kTanhSaturation (at |x| >= 9 the rational already evaluates to 1 with FMAs, which the AVX2
// build relies on; the check here keeps it so without FMA). NaN propagates. No branch: the
// calling loop vectorizes.
constexpr float kTanhP[5] = {1.3354688022e-08f, 2.0609102648e-05f, 3.4955893643e-03f, 1.3381026685e-01f, 1.0f};
constexpr float kTanhQ[5] = {7.7765696460e-07f, 3.2856367761e-04f, 2.5876987725e-02f, 4.6714341640e-01f, 1.0f};

// Below kTanhTiny onnxruntime's float32 Tanh gives (x * P(0)) / Q(0) of its own rational, P(0) !=
// Q(0), each step rounded: its higher terms vanish in rounding there (x^2 < 2^-24). x * P(0) loses
// bits in the subnormals (tanh(-1.4e-45) = -0, tanh(1e-40) = 9.99392e-41), and on normal inputs the
// ratio moves x by up to 2 ulps. Ours gives the same bits, measured equal on every subnormal and a
// sweep of the normals below 2^-12 (tests/test_special_values.py), so that what follows sees its
// values (Log(Tanh(x)), Pow(Tanh(x), y), PRelu(t, t): fuzz seeds 29838, 40289, 46091).
constexpr float kTanhTiny = 0x1p-12f;
constexpr float kOrtTanhP0 = 0x1.40b3b8p-8f;  // 4.8935246e-3
constexpr float kOrtTanhQ0 = 0x1.40b3bap-8f;  // 4.8935250e-3

ONNXFUSE_INLINE float tanh_f32(float x) {
  float xc = x < -9.0f ? -9.0f : x;
  xc = xc > 9.0f ? 9.0f : xc;
  float z = xc * xc;
  float p = kTanhP[0];
  p = p * z + kTanhP[1];
  p = p * z + kTanhP[2];
  p = p * z + kTanhP[3];
  p = p * z + kTanhP[4];
  float q = kTanhQ[0];
  q = q * z + kTanhQ[1];
  q = q * z + kTanhQ[2];
  q = q * z + kTanhQ[3];
  q = q * z + kTanhQ[4];
  float r = xc * p / q;
  r = r > 1.0f ? 1.0f : r;
  r = r < -1.0f ? -1.0f : r;
  r = std::fabs(x) < kTanhTiny ? (x * kOrtTanhP0) / kOrtTanhQ0 : r;
  return std::fabs(x) > kTanhSaturation ? std::copysign(1.0f, x) : r;
}

// sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0, e = exp(-|x|) in (0, 1]: nothing
// overflows and the negative tail keeps its relative accuracy (subnormal results included).
ONNXFUSE_INLINE float sigmoid_f32(float x) {
  float a = -std::fabs(x);
  a = a < -104.0f ? -104.0f : a;  // NaN passes
  float e = exp_reduced(a);
  float num = std::signbit(x) ? e : 1.0f;
  return num / (1.0f + e);
}

// erf(x) = x H(x^2 / 4.5 - 1) for |x| < 3, evaluated in double: H of degree 18 (power form of a
// Chebyshev fit of erf(x) / x on x^2 in [0, 9]), relative error 1.2e-13, so the float32 result is
// erf correctly rounded but within 2e-6 ulps of a midpoint. A float32 rational was within
// 6 ulps, which a Pow of a value near 0 raised to an erf amplifies 87-fold (fuzz seed 9366658).
constexpr int kErfHDegree = 18;
constexpr double kErfH[kErfHDegree + 1] = {
    0.47013182472159265,     -0.2287983322310371,     0.15749669387980966,    -0.11009416191186082,
    0.07253517337770865,     -0.043864160405738345,   0.0241456909540396,     -0.0120946989529372,
    0.005530244279120697,    -0.0023187688516154723,  0.0008958909081988671,  -0.0003204397840384968,
    0.00010664297054821486,  -3.326623502114925e-05,  9.693625560581116e-06,  -2.5552484703141132e-06,
    6.642310746433439e-07,   -2.1500982829918985e-07, 4.9517264400503856e-08};
// erf(x) for |x| >= 3, within 370 ulps of 1, where a few ulps decide whether it is exactly +-1
// (which a Pow with a negative base or a Ceil turns into a jump: fuzz seed 13516): 1 - erfc(|x|),
// erfc(a) = exp(-a^2) G(a - 3.5) with G of degree 5 fitted to erfc(a) exp(a^2) on [3, 4]
// (relative error 2.3e-7), so the result is erf correctly rounded but within 1e-11 of a midpoint.
constexpr float kErfTailFrom = 3.0f;
constexpr float kErfcG[6] = {-1.588467857800424e-04f, 6.651979638263583e-04f, -2.6726885698735714e-03f,
                             1.0660084895789623e-02f, -4.132358729839325e-02f, 1.5529367327690125e-01f};

// e^x - 1 without the cancellation of exp(x) - 1 near 0, which left Celu's alpha (e^(x/alpha) - 1)
// 1e-5 off at x = -0.0039 (onnxruntime's too), and a Sin of its reciprocal turned that into 2e-3
// (fuzz seed 9456693): x + x^2 P(x) on (-0.5, -2^-24), P the Taylor terms 1/2! .. 1/10! (truncation
// below 3e-10 relative). Elsewhere exp(x) - 1: below -0.5 nothing cancels, at and above -2^-24
// (-0, subnormals, positive x) it is onnxruntime's own answer, kept bit for bit.
ONNXFUSE_INLINE float expm1_f32(float x) {
  if (!(x < -0x1p-24f) || x <= -0.5f) return exp_f32(x) - 1.0f;
  float p = 1.0f / 3628800.0f;
  p = p * x + 1.0f / 362880.0f;
  p = p * x + 1.0f / 40320.0f;
  p = p * x + 1.0f / 5040.0f;
  p = p * x + 1.0f / 720.0f;
  p = p * x + 1.0f / 120.0f;
  p = p * x + 1.0f / 24.0f;
  p = p * x + 1.0f / 6.0f;
  p = p * x + 0.5f;
  return x + x * x * p;
}

ONNXFUSE_INLINE float vexp(float x) { return exp_f32(x); }
ONNXFUSE_INLINE double vexp(double x) { return std::exp(x); }
// e^x - 1 for Elu, Selu and Celu; in double the cancellation costs 1e-16 of e^x, nothing to mend.
ONNXFUSE_INLINE float vexpm1(float x) { return expm1_f32(x); }
ONNXFUSE_INLINE double vexpm1(double x) { return std::exp(x) - 1.0; }
ONNXFUSE_INLINE float vtanh(float x) { return tanh_f32(x); }
ONNXFUSE_INLINE double vtanh(double x) { return std::tanh(x); }
ONNXFUSE_INLINE float vsigmoid(float x) { return sigmoid_f32(x); }
ONNXFUSE_INLINE double vsigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace num
}  // namespace onnxfuse
