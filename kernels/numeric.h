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

// exp(x) for float, within a few ulp for normal results. Cephes-style: x = n ln2 + r with
// |r| <= ln2/2, exp(r) by a degree-6 polynomial, then 2^n added into the exponent field.
// Subnormal results included; +inf gives inf, -inf gives 0, NaN propagates through the
// arithmetic.
// The largest float whose exp is finite (88.72283172607421875; the next float, 88.72284, gives
// more than FLT_MAX). A shorter literal such as 88.7228f sends 88.72281..88.72283 to inf.
constexpr float kExpMaxFinite = 88.72283172607421875f;

ONNXFUSE_INLINE float exp_f32(float x) {
  float xc = x < -104.0f ? -104.0f : x;  // NaN passes both clamps
  xc = xc > kExpMaxFinite ? kExpMaxFinite : xc;
  // n = round(x / ln2) by the 1.5 * 2^23 trick: t holds n in its low mantissa bits.
  const float magic = 12582912.0f;
  float t = xc * 1.44269504088896341f + magic;
  float n = t - magic;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r2 + r + 1.0f;
  // 2^n applied as 2^n1 * 2^n2 so that n in [-150, 128] keeps both exponent fields in range and
  // subnormal results are rounded once, like libm's.
  int32_t ni = static_cast<int32_t>(bits(t) - bits(magic));
  int32_t n1 = ni >> 1;
  int32_t n2 = ni - n1;
  float res = y * from_bits(static_cast<uint32_t>(n1 + 127) << 23) * from_bits(static_cast<uint32_t>(n2 + 127) << 23);
  return x > kExpMaxFinite ? INFINITY : res;
}

// Past this |x|, float32 tanh(x) rounds to +-1 (atanh(1 - 2^-25) = 9.01091...).
constexpr float kTanhSaturation = 9.0109f;

// tanh(x) for float: x P(x^2) / Q(x^2) on [-9, 9], a rational fit with absolute error below 4e-7
// (within 6 ulps) and the right limit near 0; exactly +-1 past kTanhSaturation, where the
// rational alone would stop 5 ulps short of 1. NaN propagates. No branch: the calling loop
// vectorizes.
ONNXFUSE_INLINE float tanh_f32(float x) {
  float xc = x < -9.0f ? -9.0f : x;
  xc = xc > 9.0f ? 9.0f : xc;
  float z = xc * xc;
  float p = -8.489262523702124e-14f;
  p = p * z + 5.2782458524004754e-11f;
  p = p * z + -2.0226027843409983e-08f;
  p = p * z + 1.1154547001772391e-05f;
  p = p * z + 0.003103981597199744f;
  p = p * z + 0.1308403360950085f;
  p = p * z + 0.9999999934116282f;
  float q = 0.0002546180636283338f;
  q = q * z + 0.02449528195179353f;
  q = q * z + 0.46417360730632895f;
  q = q * z + 1.0f;
  float r = xc * p / q;
  r = r > 1.0f ? 1.0f : r;
  r = r < -1.0f ? -1.0f : r;
  return std::fabs(x) > kTanhSaturation ? std::copysign(1.0f, x) : r;
}

ONNXFUSE_INLINE float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

ONNXFUSE_INLINE float vexp(float x) { return exp_f32(x); }
ONNXFUSE_INLINE double vexp(double x) { return std::exp(x); }
ONNXFUSE_INLINE float vtanh(float x) { return tanh_f32(x); }
ONNXFUSE_INLINE double vtanh(double x) { return std::tanh(x); }
ONNXFUSE_INLINE float vsigmoid(float x) { return sigmoid_f32(x); }
ONNXFUSE_INLINE double vsigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace num
}  // namespace onnxfuse
