// onnxfuse.StackedMLP on the CPU: an ensemble of K structurally identical MLPs on one input,
// every layer of every member in one kernel (batch-ensemble's fused op, passes/ensemble_batch.py).
//
//   inputs   X [B, D0] float32, then per layer l = 1..L: W_l packed as [K, ceil(D_l / 16),
//            D_{l-1}, 16] (16-column panels, each contiguous over the reduction, zero-padded
//            past D_l: the kernel streams a weight exactly in memory order), and b_l [K, D_l]
//            (or [K, 1, D_l], the stacked Add's bias)
//   attrs    activations: STRING, one per layer, comma-separated: none, or a unary instruction
//            of the expression program in its syntax (relu, tanh, leakyrelu[0.01]), run as the
//            Pointwise executor runs it (pointwise_exec.inc)
//   output   Y [B, K * D_L]: member k's output in columns [k * D_L, (k + 1) * D_L), which is
//            the Concat of the members' outputs on the last axis (the fallback body's layout)
//
// Why a kernel of our own: onnxruntime runs the members' K separate prepacked Gemms (3K
// kernels) or, for the stacked form, a batched MatMul that is slower per FLOP at small batch.
// Here the member is the unit of parallel work (ParallelFor over K), each member's layers run
// back to back on a per-thread scratch row block, and a weight is read exactly once per
// inference: at small batch the work is a stream over the weights, B rows at a time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
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

constexpr uint32_t kShapeReferenceApi = 24;  // GetTensorElementTypeAndShapeDataReference

constexpr int64_t kPanel = 16;  // columns per packed weight panel (two AVX2 registers)

struct Layer {
  const float* w;  // [K, panels, din, kPanel]
  const float* b;  // [K, dout]
  int64_t din, dout;
  const Instr* act;  // the layer's activation, nullptr for none
};

struct Job {
  const float* x;  // [B, D0]
  float* y;        // [B, K * D_L]
  int64_t batch, members;
  const Layer* layers;
  size_t n_layers;
  int64_t widest;  // max layer width, for the scratch rows
  bool avx2;
  ApplyUnaryFn apply;
  OrtStatus* error = nullptr;
};

// out[r, n] = bias[n] + sum_k in[r, k] * W[k, n] for r < rows, W packed in panels: portable version.
void linear_base(const float* in, int64_t ldin, int64_t rows, const float* w, const float* bias, int64_t din,
                 int64_t dout, float* out, int64_t ldout) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * ldout;
    const float* a = in + r * ldin;
    for (int64_t n0 = 0; n0 < dout; n0 += kPanel) {
      const float* panel = w + (n0 / kPanel) * din * kPanel;
      float acc[kPanel] = {};
      for (int64_t k = 0; k < din; ++k)
        for (int64_t j = 0; j < kPanel; ++j) acc[j] += a[k] * panel[k * kPanel + j];
      for (int64_t j = 0; j < kPanel && n0 + j < dout; ++j) o[n0 + j] = acc[j] + bias[n0 + j];
    }
  }
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")

// R rows x P adjacent 16-column panels of the product (16P columns), accumulated in 2RP
// registers; each panel is read in memory order. An FMA's result is needed again 4 cycles later
// and the core retires 2 FMAs a cycle, so a block needs >= 8 independent accumulators to keep
// both FMA pipes busy: few rows take several panels at once (1 row x 4 panels, 2 x 2), and
// R <= 6, 2RP <= 12 leaves registers for the weights and the broadcast row value.
// `cols` < 16P stores only the first `cols` columns (the padded last panel). Relu is applied on
// the store (max(0, v) keeps a NaN and -0, as the program's relu does); other activations run
// after the layer.
template <int R, int P, bool kRelu>
inline void block(const float* in, int64_t ldin, const float* panel, int64_t pstride, const float* bias, int64_t din,
                  float* out, int64_t ldout, int64_t cols) {
  __m256 acc[R][2 * P];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < 2 * P; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* wp = panel;
#pragma GCC unroll 2
  for (int64_t k = 0; k < din; ++k, wp += kPanel) {
    __m256 w[2 * P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      w[2 * p] = _mm256_loadu_ps(wp + p * pstride);
      w[2 * p + 1] = _mm256_loadu_ps(wp + p * pstride + 8);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(in + r * ldin + k);
#pragma GCC unroll 8
      for (int c = 0; c < 2 * P; ++c) acc[r][c] = _mm256_fmadd_ps(a, w[c], acc[r][c]);
    }
  }
  const __m256 zero = _mm256_setzero_ps();
  if (cols == P * kPanel) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < 2 * P; ++c) {
        __m256 v = _mm256_add_ps(acc[r][c], _mm256_loadu_ps(bias + 8 * c));
        if (kRelu) v = _mm256_max_ps(zero, v);  // zero > v ? zero : v: a NaN passes through
        _mm256_storeu_ps(out + r * ldout + 8 * c, v);
      }
  } else {
    alignas(32) float tmp[P * kPanel];
    // every loop over acc's indices is unrolled: an array indexed at run time would live in memory
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < 2 * P; ++c) _mm256_store_ps(tmp + 8 * c, acc[r][c]);
      for (int64_t j = 0; j < cols; ++j) {
        const float v = tmp[j] + bias[j];
        out[r * ldout + j] = kRelu && v < 0.0f ? 0.0f : v;
      }
    }
  }
}

// R rows (R < 6) over every panel of the layer, P panels at a time.
template <int R, int P, bool kRelu>
void rows_all_panels(const float* in, int64_t ldin, const float* w, const float* bias, int64_t din, int64_t dout,
                     float* out, int64_t ldout) {
  const int64_t panels = (dout + kPanel - 1) / kPanel, pstride = din * kPanel;
  int64_t p = 0;
  for (; p + P <= panels; p += P)
    block<R, P, kRelu>(in, ldin, w + p * pstride, pstride, bias + p * kPanel, din, out + p * kPanel, ldout,
                       std::min<int64_t>(P * kPanel, dout - p * kPanel));
  for (; p < panels; ++p)
    block<R, 1, kRelu>(in, ldin, w + p * pstride, pstride, bias + p * kPanel, din, out + p * kPanel, ldout,
                       std::min<int64_t>(kPanel, dout - p * kPanel));
}

// Blocks of 6 rows with panels outer (a panel stays in L1 while every block passes over it, so
// a weight comes from L2 or beyond once per inference), then the last rows % 6 in one block.
template <bool kRelu>
void linear_avx2_act(const float* in, int64_t ldin, int64_t rows, const float* w, const float* bias, int64_t din,
                     int64_t dout, float* out, int64_t ldout) {
  const int64_t full = rows / 6 * 6;
  if (full > 0) {
    const int64_t pstride = din * kPanel;
    for (int64_t n0 = 0; n0 < dout; n0 += kPanel) {
      const int64_t cols = std::min<int64_t>(kPanel, dout - n0);
      for (int64_t r = 0; r < full; r += 6)
        block<6, 1, kRelu>(in + r * ldin, ldin, w + (n0 / kPanel) * pstride, pstride, bias + n0, din,
                           out + r * ldout + n0, ldout, cols);
    }
  }
  in += full * ldin;
  out += full * ldout;
  switch (rows - full) {
    case 5: rows_all_panels<5, 1, kRelu>(in, ldin, w, bias, din, dout, out, ldout); break;
    case 4: rows_all_panels<4, 1, kRelu>(in, ldin, w, bias, din, dout, out, ldout); break;
    case 3: rows_all_panels<3, 2, kRelu>(in, ldin, w, bias, din, dout, out, ldout); break;
    case 2: rows_all_panels<2, 2, kRelu>(in, ldin, w, bias, din, dout, out, ldout); break;
    case 1: rows_all_panels<1, 4, kRelu>(in, ldin, w, bias, din, dout, out, ldout); break;
    default: break;
  }
}

void linear_avx2(const float* in, int64_t ldin, int64_t rows, const float* w, const float* bias, int64_t din,
                 int64_t dout, float* out, int64_t ldout, bool relu) {
  if (relu)
    linear_avx2_act<true>(in, ldin, rows, w, bias, din, dout, out, ldout);
  else
    linear_avx2_act<false>(in, ldin, rows, w, bias, din, dout, out, ldout);
}

#pragma GCC pop_options
#endif

// One member, all layers: X -> scratch -> scratch -> ... -> its columns of Y.
void run_member(void* data, size_t member) {
  auto* job = static_cast<Job*>(data);
  const int64_t k = static_cast<int64_t>(member);
  const int64_t B = job->batch;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(2 * B * job->widest));
  float* bufs[2] = {scratch.data(), scratch.data() + B * job->widest};
  const float* in = job->x;
  int64_t ldin = job->layers[0].din;
  const size_t L = job->n_layers;
  for (size_t l = 0; l < L; ++l) {
    const Layer& layer = job->layers[l];
    const bool last = l + 1 == L;
    float* out = last ? job->y + k * layer.dout : bufs[l % 2];
    const int64_t ldout = last ? job->members * layer.dout : layer.dout;
    const float* w = layer.w + k * ((layer.dout + kPanel - 1) / kPanel) * layer.din * kPanel;
    const float* b = layer.b + k * layer.dout;
#if defined(__x86_64__)
    bool activated = false;
    if (job->avx2) {
      const bool relu = layer.act != nullptr && layer.act->op == Op::Relu;
      linear_avx2(in, ldin, B, w, b, layer.din, layer.dout, out, ldout, relu);
      activated = relu;
    } else
#endif
      linear_base(in, ldin, B, w, b, layer.din, layer.dout, out, ldout);
    if (layer.act != nullptr && !activated)
      for (int64_t r = 0; r < B; ++r) job->apply(*layer.act, out + r * ldout, layer.dout);
    in = out;
    ldin = ldout;
  }
}

struct StackedMlpKernel {
  OrtApiRef api;
  std::string node_name;
  std::string where;  // "onnxfuse StackedMLP node '<name>': ", built once
  std::vector<Instr> activations;  // one per layer
  std::vector<bool> activated;      // whether layer l has one
  bool avx2;
  ApplyUnaryFn apply;
  bool shape_reference;  // the runtime serves GetTensorElementTypeAndShapeDataReference
};

const std::string& where(const StackedMlpKernel* k) { return k->where; }

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  return create_guarded(
      raw, info, fused_ops::StackedMLP.name, "",
      [&](const OrtApiRef& api, const std::string& name, const std::string& where) -> OrtStatus* {
    auto kernel = new_kernel<StackedMlpKernel>(api, name, where);
    size_t size = 0;
    std::string text;
    OrtStatus* st = api.KernelInfoGetAttribute_string(info, "activations", nullptr, &size);
    if (st == nullptr) {
      text.assign(size, '\0');
      st = api.KernelInfoGetAttribute_string(info, "activations", text.data(), &size);
      text.resize(std::strlen(text.c_str()));
    }
    if (st) return with_context(api, st, where + "attribute 'activations': ");
    for (size_t start = 0; start <= text.size();) {
      size_t end = text.find(',', start);
      if (end == std::string::npos) end = text.size();
      const std::string name = text.substr(start, end - start);
      Instr act{};
      std::string error;
      if (name != "none" && !parse_unary_f32(name, &act, &error))
        return api.CreateStatus(ORT_INVALID_ARGUMENT,
                                (where + "activation '" + name + "': " + error).c_str());
      kernel->activations.push_back(act);
      kernel->activated.push_back(name != "none");
      start = end + 1;
    }
    size_t n_in = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetInputCount(info, &n_in), where);
    if (n_in < 3 || (n_in - 1) % 2 != 0 || kernel->activations.size() != (n_in - 1) / 2)
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (where + "expects X, then a weight and a bias per layer, and one "
                                                     "activation per layer")
                                  .c_str());
    kernel->avx2 = use_avx2_fma();
    kernel->apply = select_apply_unary_f32();
    kernel->shape_reference =
        runtime_serves_api(kShapeReferenceApi) && std::getenv("ONNXFUSE_NO_SHAPE_REFERENCE") == nullptr;
    *out = kernel.release();
    return nullptr;
  });
}

// Dims and data of input i, which must be present and float32. With a runtime that serves
// GetTensorElementTypeAndShapeDataReference the dims are read in place (the per-call path then
// allocates nothing: it runs once per inference, and the kernel's own work at small batches is
// short enough for that to show: bench/results/cpu_kernel_design.md);
// otherwise they are copied into *store.
OrtStatus* input_f32(const StackedMlpKernel* k, OrtKernelContext* ctx, size_t i, const float** data,
                     const int64_t** dims, size_t* rank, std::vector<int64_t>* store) {
  const OrtApiRef& api = k->api;
  const OrtValue* value = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetInput(ctx, i, &value), where(k));
  if (value == nullptr)
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (where(k) + "input " + std::to_string(i) + " is missing").c_str());
  ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  if (k->shape_reference) {
    ONNXFUSE_RETURN_IF_ERROR(api.GetTensorElementTypeAndShapeDataReference(value, &et, dims, rank), where(k));
  } else {
    const void* unused = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, i, store, &et, &unused), where(k));
    *dims = store->data();
    *rank = store->size();
  }
  if (et != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (where(k) + "input " + std::to_string(i) + " is not float32").c_str());
  void* p = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(const_cast<OrtValue*>(value), &p), where(k));
  *data = static_cast<const float*>(p);
  return nullptr;
}

OrtStatus* invalid(const StackedMlpKernel* k, const std::string& what) {
  return k->api.CreateStatus(ORT_INVALID_ARGUMENT, (where(k) + what).c_str());
}

OrtStatus* run(StackedMlpKernel* k, OrtKernelContext* ctx) {
  const OrtApiRef& api = k->api;
  Job job;
  thread_local std::vector<Layer> layers;  // the calling thread's, kept between calls
  thread_local std::vector<int64_t> store;
  layers.clear();
  const int64_t* dims = nullptr;
  size_t rank = 0;
  if (OrtStatus* st = input_f32(k, ctx, 0, &job.x, &dims, &rank, &store)) return st;
  if (rank != 2) return invalid(k, "X must be 2-D [batch, features]");
  job.batch = dims[0];
  int64_t width = dims[1];
  job.members = -1;
  job.widest = 1;
  job.avx2 = k->avx2;
  job.apply = k->apply;
  for (size_t l = 0; l < k->activations.size(); ++l) {
    Layer layer{};
    layer.act = k->activated[l] ? &k->activations[l] : nullptr;
    if (OrtStatus* st = input_f32(k, ctx, 1 + 2 * l, &layer.w, &dims, &rank, &store)) return st;
    if (rank != 4 || dims[2] != width || dims[3] != kPanel || (job.members >= 0 && dims[0] != job.members))
      return invalid(k, "weight of layer " + std::to_string(l + 1) + " must be packed as [members, panels, " +
                            std::to_string(width) + ", 16]");
    job.members = dims[0];
    const int64_t panels = dims[1];
    layer.din = dims[2];
    if (OrtStatus* st = input_f32(k, ctx, 2 + 2 * l, &layer.b, &dims, &rank, &store)) return st;
    int64_t count = 1;
    for (size_t d = 0; d < rank; ++d) count *= dims[d];
    if (rank == 0 || dims[0] != job.members || job.members == 0 || count % job.members != 0)
      return invalid(k, "bias of layer " + std::to_string(l + 1) + " must hold [members, out] values");
    layer.dout = count / job.members;
    if ((layer.dout + kPanel - 1) / kPanel != panels)
      return invalid(k, "weight of layer " + std::to_string(l + 1) + " has " + std::to_string(panels) +
                            " panels for " + std::to_string(layer.dout) + " outputs");
    width = layer.dout;
    job.widest = std::max(job.widest, width);
    layers.push_back(layer);
  }
  job.layers = layers.data();
  job.n_layers = layers.size();
  const int64_t out_dims[2] = {job.batch, job.members * width};
  OrtValue* y = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutput(ctx, 0, out_dims, 2, &y), where(k));
  void* yp = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(y, &yp), where(k));
  job.y = static_cast<float*>(yp);
  if (job.batch == 0 || job.members == 0) return nullptr;
  ONNXFUSE_RETURN_IF_ERROR(
      api.KernelContext_ParallelFor(ctx, run_member, static_cast<size_t>(job.members), 0, &job), where(k));
  return nullptr;
}

// Inputs: X, then (W, b) per layer: at least three float32 tensors.
ONNXFUSE_REGISTER_FUSED_OP(StackedMLP, kCpuProvider, StackedMlpKernel, create_kernel,
                           compute_entry<StackedMlpKernel, run>);

}  // namespace
}  // namespace onnxfuse
