// onnxfuse.SqueezeExcite on the CPU: a squeeze-and-excitation block in one kernel
// (passes/squeeze_excite.py writes it).
//
//   inputs   X [N, C, H, W] float32, W1 [R, C, 1, 1], B1 [R], W2 [C, R, 1, 1], B2 [C]
//   attrs    input_activation: STRING, none or silu: applied to X first (the activation of the
//            convolution before the block, when only the block reads it)
//            hidden_activation, gate_activation: STRING, one of none, relu, sigmoid, tanh,
//            hardsigmoid, hardswish, silu, leakyrelu, clip; their parameters in
//            hidden_alpha / hidden_beta and gate_alpha / gate_beta (HardSigmoid's alpha and
//            beta, LeakyRelu's alpha, Clip's bounds)
//   output   Y = A * gate(W2 hidden(W1 mean_hw(A) + B1) + B2), A = input_activation(X), the
//            gate broadcast over H and W
//
// Why a kernel of our own: onnxruntime runs the block as GlobalAveragePool (or ReduceMean), two
// 1x1 convolutions on a 1x1 image, their activations and a broadcast Mul, and since its NCHWc
// layout has no broadcast Mul, the gate and X are each reordered out of the blocked layout for
// the Mul and the product reordered back in: 7-9 kernels per block, most of them a few
// microseconds of fixed cost on tensors of a few hundred values. Here the block is one pass that
// averages each channel (applying the input activation and storing it on the way), two small
// matrix-vector products and one pass that scales each channel in place.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernel_util.h"
#include "numeric.h"
#include "pointwise_cpu.h"
#include "registry.h"

namespace onnxfuse {
namespace {


// An activation of the block as expression-program instructions (pointwise_plan.h), so that it
// has the one meaning the Pointwise kernel gives it: none; one unary instruction of the same
// name (relu, sigmoid, tanh, hardsigmoid, hardswish, leakyrelu, clip); or silu, x * sigmoid(x),
// which the program (like onnxruntime) computes as a Sigmoid and a Mul.
struct Activation {
  enum class Kind { None, Unary, Silu } kind = Kind::None;
  Instr ins{};  // the unary instruction; sigmoid for silu
};

// The activation `name` with its parameters alpha and beta (HardSigmoid's alpha and beta,
// LeakyRelu's alpha, Clip's bounds; an op reads as many as it takes): false with *error for a
// name that is no unary program op.
bool parse_activation(const std::string& name, float alpha, float beta, Activation* out, std::string* error) {
  if (name == "none") {
    out->kind = Activation::Kind::None;
    return true;
  }
  const bool silu = name == "silu";
  const std::string op = silu ? "sigmoid" : name;
  int nparams = -1;
  for (int i = 0; i < op_count(); ++i)
    if (op == op_info(static_cast<Op>(i)).name) nparams = op_info(static_cast<Op>(i)).nparams;
  // Parsed with placeholder parameters, which the attributes' values then replace exactly.
  static const char* const kPlaceholders[] = {"", "[0]", "[0,0]"};
  if (nparams < 0 || nparams > 2) {
    *error = "no such activation";
    return false;
  }
  if (!parse_unary_f32(op + kPlaceholders[nparams], &out->ins, error)) return false;
  out->ins.params[0] = alpha;
  out->ins.params[1] = beta;
  out->kind = silu ? Activation::Kind::Silu : Activation::Kind::Unary;
  return true;
}

// y = x * sigmoid(x) for n values (y and x apart), as a Sigmoid and a Mul.
void silu(const Instr& sigmoid, ApplyUnaryFn apply, const float* x, float* y, int64_t n) {
  std::memcpy(y, x, static_cast<size_t>(n) * sizeof(float));
  apply(sigmoid, y, n);
  for (int64_t j = 0; j < n; ++j) y[j] *= x[j];
}

// v = act(v) for n values in place; scratch holds n floats (silu's input).
void activate(const Activation& act, ApplyUnaryFn apply, float* v, float* scratch, int64_t n) {
  switch (act.kind) {
    case Activation::Kind::None: return;
    case Activation::Kind::Unary: apply(act.ins, v, n); return;
    case Activation::Kind::Silu:
      std::memcpy(scratch, v, static_cast<size_t>(n) * sizeof(float));
      silu(act.ins, apply, scratch, v, n);
      return;
  }
}

struct SqueezeExciteKernel {
  OrtApiRef api;
  std::string node_name;
  std::string where;  // "onnxfuse SqueezeExcite node '<name>': ", built once
  bool avx2 = false;
  Activation input_act, hidden_act, gate_act;
  ApplyUnaryFn apply = nullptr;
};

const std::string& where(const SqueezeExciteKernel* k) { return k->where; }

struct Job {
  const SqueezeExciteKernel* k;
  const float* x;
  float* y;
  const float *w1, *b1, *w2, *b2;
  int64_t n, c, r, hw;
  float* means;  // [N, C]
  float* gates;  // [N, C]
};

// The kernel's loops, inlined into a baseline and an AVX2 + FMA build of each (below): a task's
// channels of all N * C with their input activation stored in Y (or X read as it is) and their
// means; one image's
// two 1x1 convolutions; channel i scaled by its gate. Sums run in kLanes independent lanes, which
// the compiler keeps in vector registers.
constexpr int kLanes = 16;

// Channel i's mean, of Y when the input activation was stored there, else of X.
ONNXFUSE_INLINE void squeeze_channel(Job* job, int64_t i) {
  const int64_t hw = job->hw;
  const float* x = (job->k->input_act.kind == Activation::Kind::Silu ? job->y : job->x) + i * hw;
  if (hw < kLanes) {  // a late layer's few values: one sum, no lanes to fold
    float sum = 0.0f;
    for (int64_t j = 0; j < hw; ++j) sum += x[j];
    job->means[i] = sum / static_cast<float>(hw);
    return;
  }
  float acc[kLanes] = {};
  const int64_t whole = hw - hw % kLanes;
  for (int64_t j0 = 0; j0 < whole; j0 += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[j0 + l];
  for (int64_t j = whole; j < hw; ++j) acc[j - whole] += x[j];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  job->means[i] = acc[0] / static_cast<float>(hw);
}

// out[i] = sum_j w[i * ld + j] * v[j] for i < rows: four rows at a time, kLanes lanes each, so
// that 8 vector accumulators are in flight (one row alone would wait on its adds' latency).
void matvec(const float* w, int64_t ld, const float* v, int64_t n, int64_t rows, float* out) {
  constexpr int kRows = 4;
  const int64_t whole = n - n % kLanes;
  int64_t i = 0;
  for (; i + kRows <= rows; i += kRows) {
    float acc[kRows][kLanes] = {};
    for (int64_t j0 = 0; j0 < whole; j0 += kLanes)
      for (int q = 0; q < kRows; ++q)
        for (int l = 0; l < kLanes; ++l) acc[q][l] += w[(i + q) * ld + j0 + l] * v[j0 + l];
    for (int q = 0; q < kRows; ++q) {
      for (int64_t j = whole; j < n; ++j) acc[q][j - whole] += w[(i + q) * ld + j] * v[j];
      for (int h = kLanes / 2; h > 0; h /= 2)
        for (int l = 0; l < h; ++l) acc[q][l] += acc[q][l + h];
      out[i + q] = acc[q][0];
    }
  }
  for (; i < rows; ++i) {
    float acc[kLanes] = {};
    for (int64_t j0 = 0; j0 < whole; j0 += kLanes)
      for (int l = 0; l < kLanes; ++l) acc[l] += w[i * ld + j0 + l] * v[j0 + l];
    for (int64_t j = whole; j < n; ++j) acc[j - whole] += w[i * ld + j] * v[j];
    for (int h = kLanes / 2; h > 0; h /= 2)
      for (int l = 0; l < h; ++l) acc[l] += acc[l + h];
    out[i] = acc[0];
  }
}

// hidden: R floats, then max(R, C) of scratch for the activations.
template <void (*Matvec)(const float*, int64_t, const float*, int64_t, int64_t, float*)>
ONNXFUSE_INLINE void excite_image_body(Job* job, int64_t n, float* hidden) {
  const SqueezeExciteKernel* k = job->k;
  const int64_t C = job->c, R = job->r;
  float* scratch = hidden + R;
  Matvec(job->w1, C, job->means + n * C, C, R, hidden);
  for (int64_t r = 0; r < R; ++r) hidden[r] += job->b1[r];
  activate(k->hidden_act, k->apply, hidden, scratch, R);
  float* g = job->gates + n * C;
  Matvec(job->w2, R, hidden, R, C, g);
  for (int64_t c = 0; c < C; ++c) g[c] += job->b2[c];
  activate(k->gate_act, k->apply, g, scratch, C);
}

ONNXFUSE_INLINE void excite_channel(Job* job, int64_t i) {
  const int64_t hw = job->hw;
  const float g = job->gates[i];
  const float* src = (job->k->input_act.kind == Activation::Kind::None ? job->x : job->y) + static_cast<int64_t>(i) * hw;
  float* y = job->y + static_cast<int64_t>(i) * hw;
  for (int64_t j = 0; j < hw; ++j) y[j] = src[j] * g;
}

// Tasks of kChunk channels: a late layer's channels hold a few values each, too little work for
// one call each.
constexpr int64_t kChunk = 32;

int64_t chunks(int64_t channels) { return (channels + kChunk - 1) / kChunk; }

ONNXFUSE_INLINE void squeeze_body(void* data, size_t t) {
  auto* job = static_cast<Job*>(data);
  const int64_t begin = static_cast<int64_t>(t) * kChunk;
  const int64_t end = std::min<int64_t>(job->n * job->c, begin + kChunk);
  // The task's channels are contiguous: their input activation in one call, stored in Y (the
  // values the block scales). One call per channel cost more than the work on late layers' 7x7
  // and smaller maps.
  if (job->k->input_act.kind == Activation::Kind::Silu)
    silu(job->k->input_act.ins, job->k->apply, job->x + begin * job->hw, job->y + begin * job->hw,
         (end - begin) * job->hw);
  for (int64_t i = begin; i < end; ++i) squeeze_channel(job, i);
}

ONNXFUSE_INLINE void excite_body(void* data, size_t t) {
  auto* job = static_cast<Job*>(data);
  const int64_t end = std::min<int64_t>(job->n * job->c, (static_cast<int64_t>(t) + 1) * kChunk);
  for (int64_t i = static_cast<int64_t>(t) * kChunk; i < end; ++i) excite_channel(job, i);
}

struct Loops {
  void (*squeeze)(void*, size_t);
  void (*excite_image)(Job*, int64_t, float*);
  void (*excite)(void*, size_t);
};

void squeeze_base(void* d, size_t i) { squeeze_body(d, i); }
void excite_image_base(Job* j, int64_t n, float* h) { excite_image_body<matvec>(j, n, h); }
void excite_base(void* d, size_t i) { excite_body(d, i); }
const Loops kBaseLoops = {squeeze_base, excite_image_base, excite_base};

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
void squeeze_avx2(void* d, size_t i) { squeeze_body(d, i); }
// matvec with AVX2 FMAs: four rows at a time, two 8-float accumulators per row.
void matvec_avx2(const float* w, int64_t ld, const float* v, int64_t n, int64_t rows, float* out) {
  const int64_t whole = n - n % 16;
  auto hsum = [](__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  };
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) {
    __m256 acc[4][2];
    for (int q = 0; q < 4; ++q) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < whole; j += 16) {
      const __m256 v0 = _mm256_loadu_ps(v + j), v1 = _mm256_loadu_ps(v + j + 8);
      for (int q = 0; q < 4; ++q) {
        const float* wr = w + (i + q) * ld + j;
        acc[q][0] = _mm256_fmadd_ps(_mm256_loadu_ps(wr), v0, acc[q][0]);
        acc[q][1] = _mm256_fmadd_ps(_mm256_loadu_ps(wr + 8), v1, acc[q][1]);
      }
    }
    for (int q = 0; q < 4; ++q) {
      float sum = hsum(_mm256_add_ps(acc[q][0], acc[q][1]));
      for (int64_t j = whole; j < n; ++j) sum += w[(i + q) * ld + j] * v[j];
      out[i + q] = sum;
    }
  }
  for (; i < rows; ++i) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t j = 0; j < whole; j += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i * ld + j), _mm256_loadu_ps(v + j), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i * ld + j + 8), _mm256_loadu_ps(v + j + 8), a1);
    }
    float sum = hsum(_mm256_add_ps(a0, a1));
    for (int64_t j = whole; j < n; ++j) sum += w[i * ld + j] * v[j];
    out[i] = sum;
  }
}
void excite_image_avx2(Job* j, int64_t n, float* h) { excite_image_body<matvec_avx2>(j, n, h); }
void excite_avx2(void* d, size_t i) { excite_body(d, i); }
#pragma GCC pop_options
const Loops kAvx2Loops = {squeeze_avx2, excite_image_avx2, excite_avx2};
#endif

OrtStatus* read_string(const OrtApiRef& api, const OrtKernelInfo* info, const char* name, std::string* out) {
  size_t size = 0;
  if (OrtStatus* st = api.KernelInfoGetAttribute_string(info, name, nullptr, &size)) return st;
  out->assign(size, '\0');
  if (OrtStatus* st = api.KernelInfoGetAttribute_string(info, name, out->data(), &size)) return st;
  out->resize(std::strlen(out->c_str()));
  return nullptr;
}

// A float attribute, `fallback` when absent.
float read_float(const OrtApiRef& api, const OrtKernelInfo* info, const char* name, float fallback) {
  float v = fallback;
  if (OrtStatus* st = api.KernelInfoGetAttribute_float(info, name, &v)) {
    api.ReleaseStatus(st);
    return fallback;
  }
  return v;
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  return create_guarded(
      raw, info, fused_ops::SqueezeExcite.name, "",
      [&](const OrtApiRef& api, const std::string& name, const std::string& where) -> OrtStatus* {
    auto kernel = new_kernel<SqueezeExciteKernel>(api, name, where);
    const struct {
      const char* attr;
      const char* alpha;  // the attributes of its parameters (none for the input activation)
      const char* beta;
      Activation* act;
    } acts[] = {{"input_activation", nullptr, nullptr, &kernel->input_act},
                {"hidden_activation", "hidden_alpha", "hidden_beta", &kernel->hidden_act},
                {"gate_activation", "gate_alpha", "gate_beta", &kernel->gate_act}};
    for (const auto& a : acts) {
      std::string act_name, error;
      if (OrtStatus* st = read_string(api, info, a.attr, &act_name))
        return with_context(api, st, where + "attribute '" + a.attr + "': ");
      const float alpha = a.alpha ? read_float(api, info, a.alpha, 0.0f) : 0.0f;
      const float beta = a.beta ? read_float(api, info, a.beta, 0.0f) : 0.0f;
      if (!parse_activation(act_name, alpha, beta, a.act, &error) ||
          (a.act == &kernel->input_act && act_name != "none" && act_name != "silu"))
        return api.CreateStatus(ORT_INVALID_ARGUMENT,
                                (where + "unknown " + a.attr + " '" + act_name + "'").c_str());
    }
    kernel->apply = select_apply_unary_f32();
    kernel->avx2 = use_avx2_fma();
    size_t n_in = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetInputCount(info, &n_in), where);
    if (n_in != 5)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "expects X, W1, B1, W2, B2").c_str());
    *out = kernel.release();
    return nullptr;
      });
}

OrtStatus* invalid(const SqueezeExciteKernel* k, const std::string& what) {
  return k->api.CreateStatus(ORT_INVALID_ARGUMENT, (where(k) + what).c_str());
}

int64_t count(const std::vector<int64_t>& d) {
  int64_t n = 1;
  for (int64_t v : d) n *= v;
  return n;
}

OrtStatus* run(SqueezeExciteKernel* k, OrtKernelContext* ctx) {
  const OrtApiRef& api = k->api;
  {
    thread_local std::vector<int64_t> dims[5];
    const void* data[5] = {};
    for (size_t i = 0; i < 5; ++i) {
      ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      bool present = false;
      ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, i, &dims[i], &et, &data[i], &present), where(k));
      if (!present || et != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
        return invalid(k, "input " + std::to_string(i) + " must be a float32 tensor");
    }
    const std::vector<int64_t>& xd = dims[0];
    if (xd.size() != 4) return invalid(k, "X must be 4-D [N, C, H, W], got " + dims_text(xd));
    Job job{};
    job.k = k;
    job.n = xd[0];
    job.c = xd[1];
    job.hw = xd[2] * xd[3];
    job.r = count(dims[2]);
    if (count(dims[1]) != job.r * job.c || count(dims[3]) != job.c * job.r || count(dims[4]) != job.c)
      return invalid(k, "weights " + dims_text(dims[1]) + ", " + dims_text(dims[3]) + " and biases " +
                            dims_text(dims[2]) + ", " + dims_text(dims[4]) + " do not fit X " + dims_text(xd));
    job.x = static_cast<const float*>(data[0]);
    job.w1 = static_cast<const float*>(data[1]);
    job.b1 = static_cast<const float*>(data[2]);
    job.w2 = static_cast<const float*>(data[3]);
    job.b2 = static_cast<const float*>(data[4]);
    OrtValue* y = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutput(ctx, 0, xd.data(), xd.size(), &y), where(k));
    void* yp = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(y, &yp), where(k));
    job.y = static_cast<float*>(yp);
    const int64_t channels = job.n * job.c;
    if (channels == 0 || job.hw == 0) return nullptr;
    thread_local std::vector<float> scratch, hidden;
    scratch.resize(static_cast<size_t>(2 * channels));
    job.means = scratch.data();
    job.gates = scratch.data() + channels;
    hidden.resize(static_cast<size_t>(job.r + std::max(job.r, job.c)));
#if defined(__x86_64__)
    const Loops& loops = k->avx2 ? kAvx2Loops : kBaseLoops;
#else
    const Loops& loops = kBaseLoops;
#endif
    ONNXFUSE_RETURN_IF_ERROR(
        api.KernelContext_ParallelFor(ctx, loops.squeeze, static_cast<size_t>(chunks(channels)), 0, &job), where(k));
    for (int64_t n = 0; n < job.n; ++n) loops.excite_image(&job, n, hidden.data());
    ONNXFUSE_RETURN_IF_ERROR(
        api.KernelContext_ParallelFor(ctx, loops.excite, static_cast<size_t>(chunks(channels)), 0, &job), where(k));
    return nullptr;
  }
}

// Inputs: X, W1, B1, W2, B2: five float32 tensors.
ONNXFUSE_REGISTER_FUSED_OP(SqueezeExcite, kCpuProvider, SqueezeExciteKernel, create_kernel,
                           compute_entry<SqueezeExciteKernel, run>);

}  // namespace
}  // namespace onnxfuse
