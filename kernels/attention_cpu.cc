// onnxfuse.Attention on the CPU: multi-head scaled dot-product attention over split heads
// (fuse-attention's fused op; the contract is in passes/attention.py).
//
//   inputs   qkv_packed = 0: q [B, Sq, H*dh], k [B, Sk, H*dh], v [B, Sk, H*dv] (, mask); with
//                            heads_first bit 0 (q), 1 (k), 2 (v) set, that operand is [B, H, S, d]
//            heads_merged bit 0, 1, 2 (absent = 0): that operand is [B*H, S, d] (3-D attention over
//            batch*heads; the memory of [B, H, S, d])
//            qkv_packed = 1: qkv [B, S, 3*H*dh] (, mask) (, bias), q/k/v its column blocks 0, D, 2D
//            mask: float32, additive, broadcastable to [B, H, Sq, Sk] (rank <= 4)
//            bias: [3*H*dh] (has_bias, packed only), added to qkv's columns as they are read
//   attrs    num_heads, scale, has_mask, qkv_packed, has_bias (absent = 0), heads_first (absent = 0;
//            not with qkv_packed), causal (absent = 0;
//            then causal_max_queries, causal_max_keys: longer sequences are an error),
//            nan_to_zero (absent = 0; not with causal): a row of NaN probabilities weighs v by 0;
//            mask_merged_heads (absent = 0): the mask is rank <= 3, broadcastable to [B*H, Sq, Sk]
//            (3-D attention over batch*heads: its [B*H, Sq, Sk] is the [B, H, Sq, Sk] scores);
//            fill_mode (absent = 0; not with causal), fill_value: 1 (2) replaces a score by
//            fill_value where the condition input (the last; float32, broadcastable to
//            [B, H, Sq, Sk]) is nonzero (zero), after the mask: Where's masked fill
//   output   out [B, Sq, H*dv]: out[b, s, h*dv + j] = sum_t softmax_t(scale * q.k + mask) * v[t, j]
//            (with fill_mode, softmax_t(fill(s, t) ? fill_value : scale * q.k + mask))
//            (causal: mask[s, t] = -inf for t > s, 0 otherwise; no mask input)
//
// q, k, v are read as strided views of the inputs (a row of one head is contiguous, rows are
// `row stride` apart), so the packed projection output is never copied apart. Each (batch,
// head)'s keys are transposed into a [dh, Sk] panel: by the work item itself, into per-thread
// scratch, when a pair is one work item (a single thread-pool pass per call, what short
// sequences get), else by a first parallel pass shared by the pair's query blocks. Work items
// (batch, head, block of query rows) run on onnxruntime's thread pool, four query rows at a time:
// their scores against 16 keys at a time (an AVX2 register tile over the key panel), scale and
// mask, a max-subtracted softmax, and the weighted sum of v rows, 16 output columns at a time.
// Nothing of size [Sq, Sk] leaves the cache.
//
// The packed projection's bias (has_bias) is added where q, k, v are read: to a copy of the
// query rows of a register tile, to the keys as they are packed into the panel, and to the
// output as bias_v[j] (sum_t p[t] * (v[t, j] + bias_v[j]) = sum_t p[t] * v[t, j] + bias_v[j]
// with p normalized), so no [B, S, 3*H*dh] pass of its own.
//
// causal: query row i's scores, softmax and weighted sum cover keys t <= i alone (a register
// tile's scores stop at the 16-key tile holding its last row's key), while the (b, h)'s key
// panel and value rows are finite; a non-finite one makes the kernel add -inf to the future
// keys' scores instead, so that its NaN reaches the rows the original's NaN reaches.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernel_util.h"
#include "numeric.h"
#include "registry.h"

namespace onnxfuse {
namespace {

constexpr int64_t kRows = 4;      // query rows per register tile
constexpr int64_t kKeyTile = 16;  // keys per register tile (two AVX2 registers)
// Query rows per work item when (batch, head) pairs alone are too few to keep threads busy.
constexpr int64_t kQueryBlock = 16;
constexpr int64_t kMinItems = 8;

// A [B, S, H, d] view: element (b, s, h, i) at
// data[b * batch_stride + s * row_stride + h * head_stride + i]. A [B, S, H*d] tensor has
// row_stride H*d (or qkv's 3*H*d) and head_stride d; a [B, H, S, d] one row_stride d and
// head_stride S*d.
struct View {
  const float* data;
  int64_t batch_stride, row_stride, head_stride;
};

struct Job {
  View q, k, v;
  const float* mask;  // null without one
  const float* bias;  // [3 * H * dh] (packed qkv's q, k, v column blocks), null without one
  int64_t mask_stride[4];  // [B, H, Sq, Sk] strides, 0 on broadcast axes
  const float* cond;       // fill_mode's condition, null without one
  int64_t cond_stride[4];  // as mask_stride
  int fill_mode;           // 0 none, 1 fill where cond != 0, 2 where cond == 0
  float fill_value;
  float* out;              // [B, Sq, H * dv]
  float* keys;             // per (b, h): the [dh, ld] key panel, ld = Sk rounded up to kKeyTile
  int64_t ld;
  int64_t batch, heads, sq, sk, dh, dv;
  int64_t query_blocks, block_rows;
  float scale;
  bool causal;  // key t of query row i is masked out for t > i (top-left causal mask, no mask input)
  bool nan_to_zero;  // Where(IsNaN(p), 0, p) on the probabilities (zero_probability_row)
  bool avx2;
};

// One (b, h)'s additive mask and fill condition (each null when absent), and the row's fill.
struct Terms {
  const float* mask;
  const float* cond;
};

struct Fill {
  const float* cond;  // the query row's conditions, null without a fill
  int64_t step;       // 0 (broadcast along the keys) or 1
  int mode;
  float value;
  // Whether key t's score is replaced (a NaN condition is nonzero, as Cast to bool reads it).
  bool at(int64_t t) const {
    const float c = cond[t * step];
    return mode == 1 ? c != 0.0f : c == 0.0f;
  }
};

Fill row_fill(const Job& job, const Terms& bh, int64_t row) {
  return Fill{bh.cond == nullptr ? nullptr : bh.cond + row * job.cond_stride[2], job.cond_stride[3], job.fill_mode,
              job.fill_value};
}

// Per-thread scratch: kRows score rows of ld floats.
std::vector<float>& score_scratch() {
  thread_local std::vector<float> s;
  return s;
}

// Per-thread scratch: kRows query rows of dh floats with the bias added.
std::vector<float>& query_scratch() {
  thread_local std::vector<float> s;
  return s;
}

// dst[r * dh + i] = q[r * q_stride + i] + bias[i] for `rows` rows.
void biased_rows(const float* q, int64_t q_stride, const float* bias, int64_t rows, int64_t dh, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < dh; ++i) dst[r * dh + i] = q[r * q_stride + i] + bias[i];
}

// out[r * out_stride + j] += bias[j]: v's bias, through normalized probabilities.
void add_value_bias(float* out, int64_t out_stride, int64_t rows, const float* bias, int64_t dv) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < dv; ++j) out[r * out_stride + j] += bias[j];
}

// nan_to_zero: the output row of a query whose probabilities are NaN, as Where(IsNaN(p), 0, p)
// then MatMul give it. Softmax's row is NaN as a whole or not at all (any NaN exp makes the sum,
// and so every quotient, NaN; otherwise the sum is at least 1), and the kernel's 1 / sum is NaN
// exactly then. out[j] = sum_t 0 * (v[t, j] + bias_v[j]): +0, or NaN where column j holds an
// infinite or NaN value (0 * inf), summed from +0 as the MatMul's accumulators are. Such rows
// (all keys masked by -inf) are rare, so this runs as plain loops after the row's normal path.
void zero_probability_row(const Job& job, const float* v, const float* v_bias, float* o) {
  for (int64_t j = 0; j < job.dv; ++j) {
    const float b = v_bias == nullptr ? 0.0f : v_bias[j];
    float acc = 0.0f;
    for (int64_t t = 0; t < job.sk; ++t) acc += 0.0f * (v[t * job.v.row_stride + j] + b);
    o[j] = acc;
  }
}

int64_t padded_keys(int64_t sk) { return (sk + kKeyTile - 1) / kKeyTile * kKeyTile; }

// keys[i * ld + t] = k[t, i] (+ bias[i] when bias is not null) for t < sk, zero for sk <= t < ld.
// Key rows are read in memory order; the writes go to dh panel rows at once, each advancing one
// float per key.
void pack_keys(const float* k, int64_t row_stride, int64_t sk, int64_t dh, int64_t ld, const float* bias,
               float* keys) {
  for (int64_t t = 0; t < sk; ++t) {
    const float* row = k + t * row_stride;
    if (bias != nullptr) {
      for (int64_t i = 0; i < dh; ++i) keys[i * ld + t] = row[i] + bias[i];
    } else {
      for (int64_t i = 0; i < dh; ++i) keys[i * ld + t] = row[i];
    }
  }
  for (int64_t i = 0; i < dh; ++i) std::fill(keys + i * ld + sk, keys + (i + 1) * ld, 0.0f);
}

// scores[t] = scale * scores[t] + mask_row[t * mask_step] for t < sk (no mask: mask_row null), plus
// -inf for t >= causal_end (a causal row's future keys; sk when not causal). Returns the maximum,
// NaN ignored (a NaN score makes the sum NaN, so the row is NaN anyway).
float scale_and_mask_base(float* scores, int64_t sk, float scale, const float* mask_row, int64_t mask_step,
                          int64_t causal_end, const Fill& fill) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < sk; ++t) {
    float s = scores[t] * scale;
    if (mask_row != nullptr) s += mask_row[t * mask_step];
    if (fill.cond != nullptr && fill.at(t)) s = fill.value;
    if (t >= causal_end) s += -std::numeric_limits<float>::infinity();
    scores[t] = s;
    mx = s > mx ? s : mx;
  }
  return mx;
}

// p[t] = exp(s[t] - mx); returns 1 / sum. An all -inf row has mx = -inf: -inf - -inf is NaN and
// the row comes out NaN, as onnxruntime's Softmax gives.
float softmax_base(float* scores, int64_t sk, float mx) {
  for (int64_t t = 0; t < sk; ++t) scores[t] = num::exp_f32(scores[t] - mx);
  float sum = 0.0f;
  for (int64_t t = 0; t < sk; ++t) sum += scores[t];
  return 1.0f / sum;
}

// Rows [r0, r0 + rows) of one (b, h): portable version. q_bias / v_bias: this head's slices of
// the bias, or null.
void rows_base(const Job& job, const float* q, const float* keys, int64_t ld, const float* v, const Terms& bh,
               const float* q_bias, const float* v_bias, float* out, int64_t r0, int64_t rows, float* scores,
               float* q_rows) {
  const int64_t sk = job.sk, dh = job.dh, dv = job.dv;
  const int64_t out_stride = job.heads * dv;
  std::vector<int64_t> nan_rows;  // nan_to_zero: rows whose probabilities are NaN
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = q + (r0 + r) * job.q.row_stride;
    if (q_bias != nullptr) {
      biased_rows(qr, job.q.row_stride, q_bias, 1, dh, q_rows);
      qr = q_rows;
    }
    float* s = scores;
    for (int64_t t = 0; t < sk; ++t) s[t] = 0.0f;
    for (int64_t i = 0; i < dh; ++i) {
      const float a = qr[i];
      const float* kr = keys + i * ld;
      for (int64_t t = 0; t < sk; ++t) s[t] += a * kr[t];
    }
    const float* mrow = bh.mask == nullptr ? nullptr : bh.mask + (r0 + r) * job.mask_stride[2];
    const int64_t causal_end = job.causal ? r0 + r + 1 : sk;
    const float mx = scale_and_mask_base(s, sk, job.scale, mrow, job.mask_stride[3], causal_end, row_fill(job, bh, r0 + r));
    const float inv = softmax_base(s, sk, mx);
    if (job.nan_to_zero && std::isnan(inv)) nan_rows.push_back(r0 + r);
    float* o = out + (r0 + r) * out_stride;
    for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;
    for (int64_t t = 0; t < sk; ++t) {
      const float p = s[t];
      const float* vr = v + t * job.v.row_stride;
      for (int64_t j = 0; j < dv; ++j) o[j] += p * vr[j];
    }
    for (int64_t j = 0; j < dv; ++j) o[j] *= inv;
  }
  if (v_bias != nullptr) add_value_bias(out + r0 * out_stride, out_stride, rows, v_bias, dv);
  for (int64_t i : nan_rows) zero_probability_row(job, v, v_bias, out + i * out_stride);
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// scores[r * ld + t] = q_r . k_t for R rows and every t < cols (cols <= ld, both multiples of
// kKeyTile; padded keys are zero), 16 keys x R rows of accumulators per pass over the key panel.
template <int R>
inline void scores_tile(const float* q, int64_t q_stride, const float* keys, int64_t ld, int64_t cols, int64_t dh,
                        float* scores) {
  for (int64_t t0 = 0; t0 < cols; t0 += kKeyTile) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* kp = keys + t0;
    for (int64_t i = 0; i < dh; ++i, kp += ld) {
      const __m256 k0 = _mm256_loadu_ps(kp), k1 = _mm256_loadu_ps(kp + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(q + r * q_stride + i);
        acc[r][0] = _mm256_fmadd_ps(a, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(scores + r * ld + t0, acc[r][0]);
      _mm256_storeu_ps(scores + r * ld + t0 + 8, acc[r][1]);
    }
  }
}

// scale_and_mask_base's result: keys t >= causal_end (sk when not causal) get -inf added.
float scale_and_mask_avx2(float* s, int64_t sk, float scale, const float* mask_row, int64_t mask_step,
                          int64_t causal_end, const Fill& fill) {
  const __m256 fill_value = _mm256_set1_ps(fill.value), zero = _mm256_setzero_ps();
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  const int64_t vec_end = std::min(sk, causal_end);
  for (; t + 8 <= vec_end; t += 8) {
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + t), vs);
    if (mask_row != nullptr)
      x = _mm256_add_ps(x, mask_step == 1 ? _mm256_loadu_ps(mask_row + t) : _mm256_set1_ps(mask_row[0]));
    if (fill.cond != nullptr) {
      const __m256 c = fill.step == 1 ? _mm256_loadu_ps(fill.cond + t) : _mm256_set1_ps(fill.cond[0]);
      // Fill.at lane by lane: nonzero (NaN included) for mode 1, zero for mode 2.
      const __m256 sel = fill.mode == 1 ? _mm256_cmp_ps(c, zero, _CMP_NEQ_UQ) : _mm256_cmp_ps(c, zero, _CMP_EQ_OQ);
      x = _mm256_blendv_ps(x, fill_value, sel);
    }
    _mm256_storeu_ps(s + t, x);
    vmax = _mm256_max_ps(x, vmax);  // NaN in x: keeps vmax
  }
  float mx = hmax(vmax);
  for (; t < sk; ++t) {
    float x = s[t] * scale;
    if (mask_row != nullptr) x += mask_row[t * mask_step];
    if (fill.cond != nullptr && fill.at(t)) x = fill.value;
    if (t >= causal_end) x += -std::numeric_limits<float>::infinity();
    s[t] = x;
    mx = x > mx ? x : mx;
  }
  return mx;
}

// Whether exp(x - mx) is exactly 0 for all 8 lanes: num::exp_f32 clamps its argument to -104,
// where it rounds to 0. NaN lanes (and the NaN of -inf - -inf) are not dead.
inline bool dead8(const float* s, __m256 vmx) {
  const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(s), vmx);
  return _mm256_movemask_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_NLT_UQ)) == 0;
}

// pack_keys with 8 x 8 blocks transposed in registers (the bias added to the rows before); the
// edges as pack_keys does them.
void pack_keys_avx2(const float* k, int64_t row_stride, int64_t sk, int64_t dh, int64_t ld, const float* bias,
                    float* keys) {
  const int64_t sk8 = sk / 8 * 8, dh8 = dh / 8 * 8;
  auto at = [&](int64_t t, int64_t i) { return bias != nullptr ? k[t * row_stride + i] + bias[i] : k[t * row_stride + i]; };
  for (int64_t t0 = 0; t0 < sk8; t0 += 8) {
    for (int64_t i0 = 0; i0 < dh8; i0 += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(k + (t0 + j) * row_stride + i0);
      if (bias != nullptr) {
        const __m256 b = _mm256_loadu_ps(bias + i0);
        for (int j = 0; j < 8; ++j) r[j] = _mm256_add_ps(r[j], b);
      }
      const __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
      const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
      const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
      const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
      const __m256 c[8] = {_mm256_permute2f128_ps(b0, b4, 0x20), _mm256_permute2f128_ps(b1, b5, 0x20),
                           _mm256_permute2f128_ps(b2, b6, 0x20), _mm256_permute2f128_ps(b3, b7, 0x20),
                           _mm256_permute2f128_ps(b0, b4, 0x31), _mm256_permute2f128_ps(b1, b5, 0x31),
                           _mm256_permute2f128_ps(b2, b6, 0x31), _mm256_permute2f128_ps(b3, b7, 0x31)};
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(keys + (i0 + j) * ld + t0, c[j]);
    }
    for (int64_t t = t0; t < t0 + 8; ++t)
      for (int64_t i = dh8; i < dh; ++i) keys[i * ld + t] = at(t, i);
  }
  for (int64_t t = sk8; t < sk; ++t)
    for (int64_t i = 0; i < dh; ++i) keys[i * ld + t] = at(t, i);
  for (int64_t i = 0; i < dh; ++i) std::fill(keys + i * ld + sk, keys + (i + 1) * ld, 0.0f);
}

// exp(x - mx) for 8 consecutive floats: a fixed-length loop over the branch-free num::exp_f32,
// which g++ turns into one 8-lane evaluation in this build.
inline void exp8(float* p, float mx) {
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) p[j] = num::exp_f32(p[j] - mx);
}

// The row's probabilities up to normalization, in place; returns 1 / their sum. The row holds
// `sk` scores in a buffer of at least round_up(sk, 8) floats; the lanes past sk are set to -inf
// first, so whole 8-key blocks are evaluated and those lanes come out 0. [*live_begin,
// *live_end) gets the keys outside of which every probability is exactly 0.
float softmax_avx2(float* s, int64_t sk, float mx, int64_t* live_begin, int64_t* live_end) {
  const int64_t padded = (sk + 7) / 8 * 8;
  for (int64_t t = sk; t < padded; ++t) s[t] = -std::numeric_limits<float>::infinity();
  // Whole 8-key blocks whose exps are exactly 0 at either end of the row (a causal mask's
  // future keys) are written as 0 without evaluating exp: the same values, fewer exps.
  const __m256 vmx = _mm256_set1_ps(mx);
  int64_t begin = 0, end = padded;
  while (begin < end && dead8(s + begin, vmx)) begin += 8;
  while (end > begin && dead8(s + end - 8, vmx)) end -= 8;
  __m256 vsum = _mm256_setzero_ps();
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t t = 0; t < begin; t += 8) _mm256_storeu_ps(s + t, zero);
  for (int64_t t = begin; t < end; t += 8) {
    exp8(s + t, mx);
    vsum = _mm256_add_ps(vsum, _mm256_loadu_ps(s + t));
  }
  for (int64_t t = end; t < padded; t += 8) _mm256_storeu_ps(s + t, zero);
  *live_begin = begin;
  *live_end = std::min(end, sk);
  return 1.0f / hsum(vsum);
}

// out_r[j] = inv_r * sum_t p_r[t] * v[t, j] for R rows and t0 <= t < t1, 16 columns at a time
// (8, then scalar, at the end).
template <int R>
inline void weighted_sum_tile(const float* p, int64_t ld, const float* inv, const float* v, int64_t v_stride,
                              int64_t t0, int64_t t1, int64_t dv, float* out, int64_t out_stride) {
  int64_t j = 0;
  for (; j + 16 <= dv; j += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* vp = v + t0 * v_stride + j;
    for (int64_t t = t0; t < t1; ++t, vp += v_stride) {
      const __m256 v0 = _mm256_loadu_ps(vp), v1 = _mm256_loadu_ps(vp + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(p + r * ld + t);
        acc[r][0] = _mm256_fmadd_ps(a, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_set1_ps(inv[r]);
      _mm256_storeu_ps(out + r * out_stride + j, _mm256_mul_ps(acc[r][0], w));
      _mm256_storeu_ps(out + r * out_stride + j + 8, _mm256_mul_ps(acc[r][1], w));
    }
  }
  for (; j + 8 <= dv; j += 8) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const float* vp = v + t0 * v_stride + j;
    for (int64_t t = t0; t < t1; ++t, vp += v_stride) {
      const __m256 v0 = _mm256_loadu_ps(vp);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * ld + t), v0, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * out_stride + j, _mm256_mul_ps(acc[r], _mm256_set1_ps(inv[r])));
  }
  for (; j < dv; ++j) {
    for (int r = 0; r < R; ++r) {
      float acc = 0.0f;
      for (int64_t t = t0; t < t1; ++t) acc = std::fma(p[r * ld + t], v[t * v_stride + j], acc);
      out[r * out_stride + j] = acc * inv[r];
    }
  }
}

// Whether every element of rows x cols (rows `stride` apart) is finite: x * 0 is 0 for finite x,
// NaN for an infinity or NaN. Four running sums, so that their adds overlap.
bool all_finite(const float* x, int64_t stride, int64_t rows, int64_t cols) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 acc[4] = {zero, zero, zero, zero};
  float tail = 0.0f;
  for (int64_t t = 0; t < rows; ++t) {
    const float* row = x + t * stride;
    int64_t j = 0;
    for (; j + 32 <= cols; j += 32)
      for (int u = 0; u < 4; ++u) acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(_mm256_loadu_ps(row + j + 8 * u), zero));
    for (; j + 8 <= cols; j += 8) acc[0] = _mm256_add_ps(acc[0], _mm256_mul_ps(_mm256_loadu_ps(row + j), zero));
    for (; j < cols; ++j) tail += row[j] * 0.0f;
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) + tail == 0.0f;
}

// out[r * out_stride + j] += bias[j] for `rows` rows.
inline void add_value_bias_avx2(float* out, int64_t out_stride, int64_t rows, const float* bias, int64_t dv) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * out_stride;
    int64_t j = 0;
    for (; j + 8 <= dv; j += 8) _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), _mm256_loadu_ps(bias + j)));
    for (; j < dv; ++j) o[j] += bias[j];
  }
}

// v_finite: whether this (b, h)'s value rows are all finite. Then keys whose probabilities are
// exactly 0 in all R rows (a causal mask's future) are left out of the weighted sum: each would
// add 0 * v[t, j] = 0. An infinite or NaN v row must still make 0 * v NaN, as onnxruntime's
// MatMul does, so then every key is summed.
//
// A causal row (job.causal) adds -inf to its future keys' scores here, so a NaN or infinite future
// key makes the row NaN, as it does in the original (whose mask adds a finite, very negative
// value); causal_tile_avx2 skips them instead when the (b, h)'s keys and values are finite.
template <int R>
void tile_avx2(const Job& job, const float* q, const float* keys, int64_t ld, const float* v, bool v_finite,
               const Terms& bh, const float* q_bias, const float* v_bias, float* out, int64_t r0, float* scores,
               float* q_rows) {
  if (q_bias != nullptr) {
    biased_rows(q + r0 * job.q.row_stride, job.q.row_stride, q_bias, R, job.dh, q_rows);
    scores_tile<R>(q_rows, job.dh, keys, ld, ld, job.dh, scores);
  } else {
    scores_tile<R>(q + r0 * job.q.row_stride, job.q.row_stride, keys, ld, ld, job.dh, scores);
  }
  float inv[R];
  int64_t t0 = job.sk, t1 = 0;
  for (int r = 0; r < R; ++r) {
    float* s = scores + r * ld;
    const float* mrow = bh.mask == nullptr ? nullptr : bh.mask + (r0 + r) * job.mask_stride[2];
    const int64_t causal_end = job.causal ? r0 + r + 1 : job.sk;
    const float mx =
        scale_and_mask_avx2(s, job.sk, job.scale, mrow, job.mask_stride[3], causal_end, row_fill(job, bh, r0 + r));
    int64_t begin = 0, end = 0;
    inv[r] = softmax_avx2(s, job.sk, mx, &begin, &end);
    t0 = std::min(t0, begin);
    t1 = std::max(t1, end);
  }
  if (!v_finite || t0 >= t1) t0 = 0, t1 = job.sk;
  const int64_t out_stride = job.heads * job.dv;
  weighted_sum_tile<R>(scores, ld, inv, v, job.v.row_stride, t0, t1, job.dv, out + r0 * out_stride, out_stride);
  if (v_bias != nullptr) add_value_bias_avx2(out + r0 * out_stride, out_stride, R, v_bias, job.dv);
  if (job.nan_to_zero)
    for (int r = 0; r < R; ++r)
      if (std::isnan(inv[r])) zero_probability_row(job, v, v_bias, out + (r0 + r) * out_stride);
}

// dst[r * dh + i] = scale * (q[r * q_stride + i] + bias[i]) (no bias: scale * q) for R rows: the
// scores against these rows come out scaled.
template <int R>
inline void scaled_rows(const float* q, int64_t q_stride, const float* bias, float scale, int64_t dh, float* dst) {
  const __m256 vs = _mm256_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    const float* row = q + r * q_stride;
    float* d = dst + r * dh;
    int64_t i = 0;
    for (; i + 8 <= dh; i += 8) {
      __m256 x = _mm256_loadu_ps(row + i);
      if (bias != nullptr) x = _mm256_add_ps(x, _mm256_loadu_ps(bias + i));
      _mm256_storeu_ps(d + i, _mm256_mul_ps(x, vs));
    }
    for (; i < dh; ++i) d[i] = (bias != nullptr ? row[i] + bias[i] : row[i]) * scale;
  }
}

// Causal rows whose (b, h) has finite keys and values: row i = r0 + r weighs keys t < n_r =
// min(sk, i + 1) alone, so the scores stop at the 16-key tile holding the last row's key (q
// scaled first), keys t >= n_r are set to -inf (exp gives exactly 0), and the weighted sum covers
// the tile's keys t < r0 + R. The R rows' maxima, exps and sums go block by block across the rows,
// so that their dependency chains overlap instead of running one row after the other.
template <int R>
void causal_tile_avx2(const Job& job, const float* q, const float* keys, int64_t ld, const float* v,
                      const float* q_bias, const float* v_bias, float* out, int64_t r0, float* scores,
                      float* q_rows) {
  const int64_t kv = std::min(job.sk, r0 + R);
  const int64_t width = (kv + 7) / 8 * 8;  // <= padded_keys(kv) <= ld
  scaled_rows<R>(q + r0 * job.q.row_stride, job.q.row_stride, q_bias, job.scale, job.dh, q_rows);
  scores_tile<R>(q_rows, job.dh, keys, ld, padded_keys(kv), job.dh, scores);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i last[R];  // n_r - 1: lanes past it are the row's future
  __m256 vmax[R];
  for (int r = 0; r < R; ++r) {
    last[r] = _mm256_set1_epi32(static_cast<int>(std::min(job.sk, r0 + r + 1) - 1));
    vmax[r] = neg_inf;
  }
  for (int64_t t = 0; t < width; t += 8) {
    const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(t)));
    for (int r = 0; r < R; ++r) {
      float* s = scores + r * ld + t;
      const __m256 future = _mm256_castsi256_ps(_mm256_cmpgt_epi32(key, last[r]));
      const __m256 x = _mm256_blendv_ps(_mm256_loadu_ps(s), neg_inf, future);
      _mm256_storeu_ps(s, x);
      vmax[r] = _mm256_max_ps(x, vmax[r]);  // NaN in x: keeps vmax (the row's sum turns NaN)
    }
  }
  float mx[R], inv[R];
  __m256 vsum[R];
  for (int r = 0; r < R; ++r) {
    mx[r] = hmax(vmax[r]);
    vsum[r] = _mm256_setzero_ps();
  }
  for (int64_t t = 0; t < width; t += 8) {
    for (int r = 0; r < R; ++r) {
      float* s = scores + r * ld + t;
      exp8(s, mx[r]);
      vsum[r] = _mm256_add_ps(vsum[r], _mm256_loadu_ps(s));
    }
  }
  for (int r = 0; r < R; ++r) inv[r] = 1.0f / hsum(vsum[r]);
  const int64_t out_stride = job.heads * job.dv;
  weighted_sum_tile<R>(scores, ld, inv, v, job.v.row_stride, 0, kv, job.dv, out + r0 * out_stride, out_stride);
  if (v_bias != nullptr) add_value_bias_avx2(out + r0 * out_stride, out_stride, R, v_bias, job.dv);
}

void rows_avx2(const Job& job, const float* q, const float* keys, int64_t ld, const float* v, const Terms& bh,
               const float* q_bias, const float* v_bias, float* out, int64_t r0, int64_t rows, float* scores,
               float* q_rows) {
  int64_t r = r0;
  const int64_t end = r0 + rows;
  // v's bias is added to the output, not to v: the rows read are v's own.
  const bool vf = all_finite(v, job.v.row_stride, job.sk, job.dv);
  // The key panel holds the biased keys, zero-padded: it is finite when the keys are.
  if (job.causal && vf && all_finite(keys, ld, job.dh, ld)) {
    for (; r + kRows <= end; r += kRows)
      causal_tile_avx2<kRows>(job, q, keys, ld, v, q_bias, v_bias, out, r, scores, q_rows);
    switch (end - r) {
      case 3: causal_tile_avx2<3>(job, q, keys, ld, v, q_bias, v_bias, out, r, scores, q_rows); break;
      case 2: causal_tile_avx2<2>(job, q, keys, ld, v, q_bias, v_bias, out, r, scores, q_rows); break;
      case 1: causal_tile_avx2<1>(job, q, keys, ld, v, q_bias, v_bias, out, r, scores, q_rows); break;
      default: break;
    }
    return;
  }
  for (; r + kRows <= end; r += kRows)
    tile_avx2<kRows>(job, q, keys, ld, v, vf, bh, q_bias, v_bias, out, r, scores, q_rows);
  switch (end - r) {
    case 3: tile_avx2<3>(job, q, keys, ld, v, vf, bh, q_bias, v_bias, out, r, scores, q_rows); break;
    case 2: tile_avx2<2>(job, q, keys, ld, v, vf, bh, q_bias, v_bias, out, r, scores, q_rows); break;
    case 1: tile_avx2<1>(job, q, keys, ld, v, vf, bh, q_bias, v_bias, out, r, scores, q_rows); break;
    default: break;
  }
}

#pragma GCC pop_options
#endif

// Per-thread scratch: one (b, h)'s key panel, when each work item packs its own.
std::vector<float>& panel_scratch() {
  thread_local std::vector<float> s;
  return s;
}

// The key panel [dh, ld] of pair bh into `keys`.
void pack_pair(const Job& job, int64_t bh, float* keys) {
  const int64_t b = bh / job.heads, h = bh % job.heads;
  const float* k = job.k.data + b * job.k.batch_stride + h * job.k.head_stride;
  // The bias's key block starts at column D = H * dh, as k's columns do in qkv.
  const float* k_bias = job.bias == nullptr ? nullptr : job.bias + job.heads * job.dh + h * job.dh;
#if defined(__x86_64__)
  if (job.avx2) {
    pack_keys_avx2(k, job.k.row_stride, job.sk, job.dh, job.ld, k_bias, keys);
    return;
  }
#endif
  pack_keys(k, job.k.row_stride, job.sk, job.dh, job.ld, k_bias, keys);
}

// First pass (several query blocks per pair): the key panel of one (b, h), shared by every
// query block of that pair.
void pack_item(void* data, size_t index) {
  const Job& job = *static_cast<const Job*>(data);
  const int64_t bh = static_cast<int64_t>(index);
  pack_pair(job, bh, job.keys + bh * job.dh * job.ld);
}

// One work item: (b, h, block of query rows).
void run_item(void* data, size_t index) {
  const Job& job = *static_cast<const Job*>(data);
  const int64_t item = static_cast<int64_t>(index);
  const int64_t block = item % job.query_blocks;
  const int64_t bh = item / job.query_blocks;
  const int64_t b = bh / job.heads, h = bh % job.heads;
  const int64_t r0 = block * job.block_rows;
  const int64_t rows = std::min(job.block_rows, job.sq - r0);
  if (rows <= 0) return;
  const float* q = job.q.data + b * job.q.batch_stride + h * job.q.head_stride;
  const float* v = job.v.data + b * job.v.batch_stride + h * job.v.head_stride;
  // One query block per pair (job.keys null): the item packs the pair's keys itself, into
  // per-thread scratch, so the call is a single thread-pool pass with no shared panel buffer.
  const float* keys = nullptr;
  if (job.keys == nullptr) {
    std::vector<float>& panel = panel_scratch();
    panel.resize(static_cast<size_t>(job.dh * job.ld));
    pack_pair(job, bh, panel.data());
    keys = panel.data();
  } else {
    keys = job.keys + bh * job.dh * job.ld;
  }
  const Terms terms{job.mask == nullptr ? nullptr : job.mask + b * job.mask_stride[0] + h * job.mask_stride[1],
                 job.cond == nullptr ? nullptr : job.cond + b * job.cond_stride[0] + h * job.cond_stride[1]};
  float* out = job.out + b * job.sq * job.heads * job.dv + h * job.dv;
  const float* q_bias = job.bias == nullptr ? nullptr : job.bias + h * job.dh;
  const float* v_bias = job.bias == nullptr ? nullptr : job.bias + 2 * job.heads * job.dh + h * job.dv;
  std::vector<float>& scores = score_scratch();
  scores.resize(static_cast<size_t>(kRows * job.ld));
  std::vector<float>& q_rows = query_scratch();
  if (q_bias != nullptr || job.causal) q_rows.resize(static_cast<size_t>(kRows * job.dh));
#if defined(__x86_64__)
  if (job.avx2) {
    rows_avx2(job, q, keys, job.ld, v, terms, q_bias, v_bias, out, r0, rows, scores.data(), q_rows.data());
    return;
  }
#endif
  rows_base(job, q, keys, job.ld, v, terms, q_bias, v_bias, out, r0, rows, scores.data(), q_rows.data());
}

struct AttentionKernel {
  OrtApiRef api;
  std::string node_name;
  std::string where;  // "onnxfuse Attention node 'NAME': ", the prefix of every error
  int64_t heads = 0;
  float scale = 1.0f;
  bool has_mask = false, packed = false, has_bias = false, avx2 = false;
  bool causal = false, nan_to_zero = false;
  int64_t heads_first = 0;  // bit 0 q, 1 k, 2 v: that operand is [B, H, S, d]
  int64_t heads_merged = 0;  // bit 0 q, 1 k, 2 v: that operand is [B*H, S, d] (read as [B, H, S, d])
  int64_t causal_max_queries = 0, causal_max_keys = 0;  // the causal mask constant's [R, C]
  bool mask_merged = false;  // the mask is [B*H, Sq, Sk] (rank <= 3, broadcast)
  int64_t fill_mode = 0;     // 0 none, 1 fill where the condition is nonzero, 2 where it is zero
  float fill_value = 0.0f;
};

// An optional int attribute (absent = 0).
int64_t optional_int(const OrtApiRef& api, const OrtKernelInfo* info, const char* name) {
  int64_t v = 0;
  if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, name, &v)) {
    api.ReleaseStatus(st);
    v = 0;
  }
  return v;
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  return create_guarded(
      raw, info, fused_ops::Attention.name, "",
      [&](const OrtApiRef& api, const std::string& name, const std::string& where) -> OrtStatus* {
    auto kernel = new_kernel<AttentionKernel>(api, name, where);
    const std::string& w = kernel->where;
    int64_t has_mask = 0, packed = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfoGetAttribute_int64(info, "num_heads", &kernel->heads), w + "attribute 'num_heads': ");
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfoGetAttribute_float(info, "scale", &kernel->scale), w + "attribute 'scale': ");
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfoGetAttribute_int64(info, "has_mask", &has_mask), w + "attribute 'has_mask': ");
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfoGetAttribute_int64(info, "qkv_packed", &packed), w + "attribute 'qkv_packed': ");
    int64_t has_bias = 0;  // optional: absent = 0
    if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, "has_bias", &has_bias)) {
      api.ReleaseStatus(st);
      has_bias = 0;
    }
    int64_t causal = 0;  // optional: absent = 0
    if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, "causal", &causal)) {
      api.ReleaseStatus(st);
      causal = 0;
    }
    int64_t nan_to_zero = 0;  // optional: absent = 0
    if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, "nan_to_zero", &nan_to_zero)) {
      api.ReleaseStatus(st);
      nan_to_zero = 0;
    }
    if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, "heads_first", &kernel->heads_first)) {
      api.ReleaseStatus(st);  // optional: absent = 0
      kernel->heads_first = 0;
    }
    kernel->nan_to_zero = nan_to_zero != 0;
    kernel->mask_merged = optional_int(api, info, "mask_merged_heads") != 0;
    kernel->heads_merged = optional_int(api, info, "heads_merged");
    if (kernel->heads_merged < 0 || kernel->heads_merged > 7 || (kernel->heads_merged & kernel->heads_first) != 0 ||
        (kernel->heads_merged != 0 && kernel->packed))
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (w + "heads_merged must be a mask of bits 0-2 (q, k, v), apart from heads_first's,"
                                   " and 0 with qkv_packed").c_str());
    kernel->fill_mode = optional_int(api, info, "fill_mode");
    if (kernel->fill_mode < 0 || kernel->fill_mode > 2)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "fill_mode must be 0, 1 or 2").c_str());
    if (kernel->fill_mode != 0)
      ONNXFUSE_RETURN_IF_ERROR(api.KernelInfoGetAttribute_float(info, "fill_value", &kernel->fill_value),
                               w + "attribute 'fill_value': ");
    kernel->has_mask = has_mask != 0;
    kernel->packed = packed != 0;
    kernel->has_bias = has_bias != 0;
    kernel->causal = causal != 0;
    if (kernel->causal) {
      ONNXFUSE_RETURN_IF_ERROR(api.KernelInfoGetAttribute_int64(info, "causal_max_queries", &kernel->causal_max_queries),
                               w + "attribute 'causal_max_queries': ");
      ONNXFUSE_RETURN_IF_ERROR(api.KernelInfoGetAttribute_int64(info, "causal_max_keys", &kernel->causal_max_keys),
                               w + "attribute 'causal_max_keys': ");
      if (kernel->has_mask)
        return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "causal and has_mask are exclusive").c_str());
      if (kernel->nan_to_zero)
        return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "causal and nan_to_zero are exclusive").c_str());
      if (kernel->fill_mode != 0)
        return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "causal and fill_mode are exclusive").c_str());
    }
    if (kernel->heads <= 0)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "num_heads must be positive").c_str());
    if (kernel->has_bias && !kernel->packed)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "has_bias needs qkv_packed = 1").c_str());
    if (kernel->heads_first < 0 || kernel->heads_first > 7 || (kernel->heads_first != 0 && kernel->packed))
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (w + "heads_first must be a mask of bits 0-2 (q, k, v), and 0 with qkv_packed").c_str());
    size_t n_in = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetInputCount(info, &n_in), w);
    const size_t want =
        (kernel->packed ? 1 : 3) + (kernel->has_mask ? 1 : 0) + (kernel->has_bias ? 1 : 0) + (kernel->fill_mode ? 1 : 0);
    if (n_in != want)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "expects " + std::to_string(want) + " inputs (" +
                                                     (kernel->packed ? "qkv" : "q, k, v") +
                                                     (kernel->has_mask ? ", mask" : "") +
                                                     (kernel->has_bias ? ", bias" : "") +
                                                     (kernel->fill_mode ? ", condition" : "") + "), got " +
                                                     std::to_string(n_in)).c_str());
    kernel->avx2 = use_avx2_fma();
    *out = kernel.release();
    return nullptr;
  });
}

OrtStatus* input_f32(const OrtApiRef& api, OrtKernelContext* ctx, size_t i, const std::string& w, const char* what,
                     const float** data, std::vector<int64_t>* dims) {
  ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  const void* p = nullptr;
  bool present = false;
  ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, i, dims, &et, &p, &present), w);
  if (!present) return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + what + " is missing").c_str());
  if (et != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + what + " is not float32").c_str());
  *data = static_cast<const float*>(p);
  return nullptr;
}

// strides[i] of a tensor of dims `d` (rank <= 4) read as broadcast to `target` [B, H, Sq, Sk]: 0 on
// broadcast axes; false when a dim is neither 1 nor the target's. merged: d (rank <= 3) is read
// as broadcast to [B*H, Sq, Sk], whose first axis holds (b, h) as b * H + h.
bool broadcast_strides(const std::vector<int64_t>& d, const int64_t target[4], bool merged, int64_t strides[4]) {
  const size_t rank = merged ? 3 : 4;
  if (d.size() > rank) return false;
  int64_t dims[4] = {1, 1, 1, 1};
  const int64_t want[4] = {merged ? target[0] * target[1] : target[0], target[1], target[2], target[3]};
  const size_t first = merged ? 1 : 0;  // dims[first..3] hold d, right-aligned
  for (size_t i = 0; i < d.size(); ++i) dims[4 - d.size() + i] = d[i];
  int64_t stride = 1;
  for (int i = 3; i >= static_cast<int>(first); --i) {
    const int64_t w = merged && i == 1 ? want[0] : want[i];
    if (dims[i] != 1 && dims[i] != w) return false;
    strides[i] = dims[i] == 1 ? 0 : stride;
    stride *= dims[i];
  }
  if (merged) {  // axis 1 of dims is the merged (b, h): b's stride is H of it
    strides[0] = strides[1] * target[1];
  }
  return true;
}

OrtStatus* invalid(const OrtApiRef& api, const std::string& msg) {
  return api.CreateStatus(ORT_INVALID_ARGUMENT, msg.c_str());
}

OrtStatus* run(AttentionKernel* k, OrtKernelContext* ctx) {
  const OrtApiRef& api = k->api;
  const std::string& w = k->where;
  Job job{};
  job.heads = k->heads;
  job.scale = k->scale;
  job.avx2 = k->avx2;
  job.causal = k->causal;
  job.nan_to_zero = k->nan_to_zero;
  const int64_t H = k->heads;
  std::vector<int64_t> qd, kd, vd, md;
  size_t next = 0;
  if (k->packed) {
    const float* qkv = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(input_f32(api, ctx, next++, w, "qkv", &qkv, &qd), "");
    if (qd.size() != 3 || qd[2] % (3 * H) != 0)
      return invalid(api, w + "qkv of shape " + dims_text(qd) + " is not [B, S, 3 * " + std::to_string(H) + " * d]");
    const int64_t D = qd[2] / 3;
    const View base{qkv, qd[1] * qd[2], qd[2], D / H};
    job.q = base;
    job.k = View{qkv + D, base.batch_stride, base.row_stride, base.head_stride};
    job.v = View{qkv + 2 * D, base.batch_stride, base.row_stride, base.head_stride};
    job.batch = qd[0];
    job.sq = job.sk = qd[1];
    job.dh = job.dv = D / H;
  } else {
    const float *q = nullptr, *kk = nullptr, *v = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(input_f32(api, ctx, next++, w, "q", &q, &qd), "");
    ONNXFUSE_RETURN_IF_ERROR(input_f32(api, ctx, next++, w, "k", &kk, &kd), "");
    ONNXFUSE_RETURN_IF_ERROR(input_f32(api, ctx, next++, w, "v", &v, &vd), "");
    // Each operand as [B, S, H, d] (its view) from [B, S, H*d] or, heads first, [B, H, S, d].
    int64_t bsd[3][3] = {};  // per operand: B, S, d (-1 when the dims are neither form)
    const std::vector<int64_t>* dims[3] = {&qd, &kd, &vd};
    const float* data[3] = {q, kk, v};
    View* views[3] = {&job.q, &job.k, &job.v};
    for (int o = 0; o < 3; ++o) {
      const std::vector<int64_t>& d = *dims[o];
      int64_t* r = bsd[o];
      if ((k->heads_merged >> o) & 1) {  // [B*H, S, d]: the memory of [B, H, S, d]
        const bool ok = d.size() == 3 && d[0] % H == 0;
        r[0] = ok ? d[0] / H : -1, r[1] = ok ? d[1] : -1, r[2] = ok ? d[2] : -1;
        if (ok) *views[o] = View{data[o], H * d[1] * d[2], d[2], d[1] * d[2]};
      } else if ((k->heads_first >> o) & 1) {
        const bool ok = d.size() == 4 && d[1] == H;
        r[0] = ok ? d[0] : -1, r[1] = ok ? d[2] : -1, r[2] = ok ? d[3] : -1;
        if (ok) *views[o] = View{data[o], H * d[2] * d[3], d[3], d[2] * d[3]};
      } else {
        const bool ok = d.size() == 3 && d[2] % H == 0;
        r[0] = ok ? d[0] : -1, r[1] = ok ? d[1] : -1, r[2] = ok ? d[2] / H : -1;
        if (ok) *views[o] = View{data[o], d[1] * d[2], d[2], d[2] / H};
      }
    }
    if (bsd[0][0] < 0 || bsd[1][0] < 0 || bsd[2][0] < 0 || bsd[0][0] != bsd[1][0] || bsd[1][0] != bsd[2][0] ||
        bsd[1][1] != bsd[2][1] || bsd[0][2] != bsd[1][2])
      return invalid(api, w + "q " + dims_text(qd) + ", k " + dims_text(kd) + ", v " + dims_text(vd) +
                              " are not [B, Sq, H*dh], [B, Sk, H*dh], [B, Sk, H*dv] (heads_first " +
                              std::to_string(k->heads_first) + ": [B, H, S, d]) with H = " + std::to_string(H));
    job.batch = bsd[0][0];
    job.sq = bsd[0][1];
    job.sk = bsd[1][1];
    job.dh = bsd[0][2];
    job.dv = bsd[2][2];
  }
  if (k->has_mask) {
    ONNXFUSE_RETURN_IF_ERROR(input_f32(api, ctx, next++, w, "mask", &job.mask, &md), "");
    const int64_t target[4] = {job.batch, H, job.sq, job.sk};
    if (!broadcast_strides(md, target, k->mask_merged, job.mask_stride))
      return invalid(api, w + "mask of shape " + dims_text(md) + " does not broadcast to " +
                              (k->mask_merged ? "[B*H, Sq, Sk] = " + dims_text({job.batch * H, job.sq, job.sk})
                                              : "[B, H, Sq, Sk] = " + dims_text(std::vector<int64_t>(target, target + 4))));
  }
  if (k->causal && (job.sq > k->causal_max_queries || job.sk > k->causal_max_keys))
    return invalid(api, w + std::to_string(job.sq) + " queries and " + std::to_string(job.sk) +
                            " keys exceed the causal mask's " + std::to_string(k->causal_max_queries) + " x " +
                            std::to_string(k->causal_max_keys) +
                            " (the original model's slice of that mask does not broadcast to the scores)");
  if (k->has_bias) {
    std::vector<int64_t> bd;
    ONNXFUSE_RETURN_IF_ERROR(input_f32(api, ctx, next++, w, "bias", &job.bias, &bd), "");
    if (bd.size() != 1 || bd[0] != 3 * H * job.dh)
      return invalid(api, w + "bias of shape " + dims_text(bd) + " is not [" + std::to_string(3 * H * job.dh) + "]");
  }
  if (k->fill_mode != 0) {
    std::vector<int64_t> cd;
    ONNXFUSE_RETURN_IF_ERROR(input_f32(api, ctx, next++, w, "condition", &job.cond, &cd), "");
    const int64_t target[4] = {job.batch, H, job.sq, job.sk};
    if (!broadcast_strides(cd, target, false, job.cond_stride))
      return invalid(api, w + "condition of shape " + dims_text(cd) + " does not broadcast to [B, H, Sq, Sk] = " +
                              dims_text(std::vector<int64_t>(target, target + 4)));
    job.fill_mode = static_cast<int>(k->fill_mode);
    job.fill_value = k->fill_value;
  }
  const int64_t out_dims[3] = {job.batch, job.sq, H * job.dv};
  OrtValue* y = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutput(ctx, 0, out_dims, 3, &y), w);
  void* yp = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(y, &yp), w);
  job.out = static_cast<float*>(yp);
  const int64_t total = job.batch * job.sq * H * job.dv;
  if (total == 0) return nullptr;
  if (job.sk == 0) {  // an empty sum: what MatMul over a zero-length axis gives
    std::fill(job.out, job.out + total, 0.0f);
    return nullptr;
  }
  const int64_t pairs = job.batch * H;
  job.ld = padded_keys(job.sk);
  job.block_rows = pairs >= kMinItems ? job.sq : std::min<int64_t>(job.sq, kQueryBlock);
  job.query_blocks = (job.sq + job.block_rows - 1) / job.block_rows;
  // Several query blocks per pair share its key panel, packed by a first pass; with one block
  // per pair each work item packs its own (job.keys stays null).
  std::unique_ptr<float[]> keys;
  if (job.query_blocks > 1) {
    keys.reset(new float[static_cast<size_t>(pairs * job.dh * job.ld)]);  // pack_keys writes every element
    job.keys = keys.get();
    ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_ParallelFor(ctx, pack_item, static_cast<size_t>(pairs), 0, &job), w);
  }
  ONNXFUSE_RETURN_IF_ERROR(
      api.KernelContext_ParallelFor(ctx, run_item, static_cast<size_t>(pairs * job.query_blocks), 0, &job), w);
  return nullptr;
}

// Inputs are variadic (1 to 5 float32 tensors: qkv or q, k, v, then the mask when has_mask, then
// the bias when has_bias, then the condition when fill_mode).
ONNXFUSE_REGISTER_FUSED_OP(Attention, kCpuProvider, AttentionKernel, create_kernel,
                           compute_entry<AttentionKernel, run>);

}  // namespace
}  // namespace onnxfuse
