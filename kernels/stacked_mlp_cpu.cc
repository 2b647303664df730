// onnxfuse.StackedMLP on the CPU: an ensemble of K structurally identical MLPs on one input,
// every layer of every member in one kernel (batch-ensemble's fused op, passes/ensemble_batch.py).
//
//   inputs   X [B, D0] float32, then per layer l = 1..L: W_l packed as [K, ceil(D_l / 16),
//            D_{l-1}, 16] (16-column panels, each contiguous over the reduction, zero-padded
//            past D_l: the kernel streams a weight exactly in memory order), and b_l [K, D_l]
//            (or [K, 1, D_l], the stacked Add's bias)
//   attrs    activations: STRING, one name per layer, comma-separated: none, relu, tanh, sigmoid
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
#include "registry.h"

namespace onnxfuse {
namespace {

constexpr const char* kStackedMlpName = "StackedMLP";
enum Activation : int64_t { kNone = 0, kRelu = 1, kTanh = 2, kSigmoid = 3 };

constexpr int64_t kPanel = 16;  // columns per packed weight panel (two AVX2 registers)

struct Layer {
  const float* w;  // [K, panels, din, kPanel]
  const float* b;  // [K, dout]
  int64_t din, dout;
  int64_t act;
};

struct Job {
  const float* x;  // [B, D0]
  float* y;        // [B, K * D_L]
  int64_t batch, members;
  std::vector<Layer> layers;
  int64_t widest;  // max layer width, for the scratch rows
  bool avx2;
  OrtStatus* error = nullptr;
};

void activate(float* row, int64_t n, int64_t act) {
  switch (act) {
    case kRelu:
      for (int64_t j = 0; j < n; ++j) row[j] = row[j] > 0.0f ? row[j] : (row[j] == row[j] ? 0.0f : row[j]);
      break;
    case kTanh:
      for (int64_t j = 0; j < n; ++j) row[j] = num::vtanh(row[j]);
      break;
    case kSigmoid:
      for (int64_t j = 0; j < n; ++j) row[j] = num::vsigmoid(row[j]);
      break;
    default:
      break;
  }
}

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

// R rows x one 16-column panel of the product, accumulated in 2R registers; the panel is read
// in memory order. `cols` < 16 stores only the first `cols` columns (the padded last panel).
template <int R>
inline void panel_rows(const float* in, int64_t ldin, const float* panel, const float* bias, int64_t din,
                       float* out, int64_t ldout, int64_t cols) {
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* wp = panel;
  for (int64_t k = 0; k < din; ++k, wp += kPanel) {
    const __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(in + r * ldin + k);
      acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
    }
  }
  if (cols == kPanel) {
    const __m256 b0 = _mm256_loadu_ps(bias), b1 = _mm256_loadu_ps(bias + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * ldout, _mm256_add_ps(acc[r][0], b0));
      _mm256_storeu_ps(out + r * ldout + 8, _mm256_add_ps(acc[r][1], b1));
    }
  } else {
    alignas(32) float tmp[kPanel];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(tmp, acc[r][0]);
      _mm256_store_ps(tmp + 8, acc[r][1]);
      for (int64_t j = 0; j < cols; ++j) out[r * ldout + j] = tmp[j] + bias[j];
    }
  }
}

// Panels outer, row blocks inner: a panel (D_in x 16 floats) stays in L1 while every row block
// of the batch passes over it, so a weight is read from L2 or memory once per inference.
void linear_avx2(const float* in, int64_t ldin, int64_t rows, const float* w, const float* bias, int64_t din,
                 int64_t dout, float* out, int64_t ldout) {
  for (int64_t n0 = 0; n0 < dout; n0 += kPanel) {
    const float* panel = w + (n0 / kPanel) * din * kPanel;
    const int64_t cols = std::min<int64_t>(kPanel, dout - n0);
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6) panel_rows<6>(in + r * ldin, ldin, panel, bias + n0, din, out + r * ldout + n0, ldout, cols);
    switch (rows - r) {
      case 5: panel_rows<5>(in + r * ldin, ldin, panel, bias + n0, din, out + r * ldout + n0, ldout, cols); break;
      case 4: panel_rows<4>(in + r * ldin, ldin, panel, bias + n0, din, out + r * ldout + n0, ldout, cols); break;
      case 3: panel_rows<3>(in + r * ldin, ldin, panel, bias + n0, din, out + r * ldout + n0, ldout, cols); break;
      case 2: panel_rows<2>(in + r * ldin, ldin, panel, bias + n0, din, out + r * ldout + n0, ldout, cols); break;
      case 1: panel_rows<1>(in + r * ldin, ldin, panel, bias + n0, din, out + r * ldout + n0, ldout, cols); break;
      default: break;
    }
  }
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
  int64_t ldin = job->layers.front().din;
  const size_t L = job->layers.size();
  for (size_t l = 0; l < L; ++l) {
    const Layer& layer = job->layers[l];
    const bool last = l + 1 == L;
    float* out = last ? job->y + k * layer.dout : bufs[l % 2];
    const int64_t ldout = last ? job->members * layer.dout : layer.dout;
    const float* w = layer.w + k * ((layer.dout + kPanel - 1) / kPanel) * layer.din * kPanel;
    const float* b = layer.b + k * layer.dout;
#if defined(__x86_64__)
    if (job->avx2)
      linear_avx2(in, ldin, B, w, b, layer.din, layer.dout, out, ldout);
    else
#endif
      linear_base(in, ldin, B, w, b, layer.din, layer.dout, out, ldout);
    if (layer.act != kNone)
      for (int64_t r = 0; r < B; ++r) activate(out + r * ldout, layer.dout, layer.act);
    in = out;
    ldin = ldout;
  }
}

struct StackedMlpKernel {
  OrtApiRef api;
  std::string node_name;
  std::vector<int64_t> activations;
  bool avx2;
};

std::string where(const StackedMlpKernel* k) { return "onnxfuse StackedMLP node '" + k->node_name + "': "; }

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  OrtApiRef api(raw);
  try {
    auto kernel = std::make_unique<StackedMlpKernel>();
    kernel->api = api;
    if (OrtStatus* st = read_node_name(api, info, &kernel->node_name)) return st;
    size_t size = 0;
    std::string text;
    OrtStatus* st = api.KernelInfoGetAttribute_string(info, "activations", nullptr, &size);
    if (st == nullptr) {
      text.assign(size, '\0');
      st = api.KernelInfoGetAttribute_string(info, "activations", text.data(), &size);
      text.resize(std::strlen(text.c_str()));
    }
    if (st) return with_context(api, st, where(kernel.get()) + "attribute 'activations': ");
    for (size_t start = 0; start <= text.size();) {
      size_t end = text.find(',', start);
      if (end == std::string::npos) end = text.size();
      const std::string name = text.substr(start, end - start);
      const int64_t code = name == "none" ? kNone : name == "relu" ? kRelu : name == "tanh" ? kTanh
                         : name == "sigmoid" ? kSigmoid : -1;
      if (code < 0)
        return api.CreateStatus(ORT_INVALID_ARGUMENT, (where(kernel.get()) + "unknown activation '" + name + "'").c_str());
      kernel->activations.push_back(code);
      start = end + 1;
    }
    size_t n_in = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetInputCount(info, &n_in), where(kernel.get()));
    if (n_in < 3 || (n_in - 1) % 2 != 0 || kernel->activations.size() != (n_in - 1) / 2)
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (where(kernel.get()) + "expects X, then a weight and a bias per layer, and one "
                                                     "activation per layer")
                                  .c_str());
    kernel->avx2 = use_avx2_fma();
    *out = kernel.release();
    return nullptr;
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_FAIL, (std::string("onnxfuse StackedMLP: ") + e.what()).c_str());
  }
}

// Dims and data of input i, which must be present and float32.
OrtStatus* input_f32(const OrtApiRef& api, OrtKernelContext* ctx, size_t i, const std::string& w,
                     const float** data, std::vector<int64_t>* dims) {
  ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  const void* p = nullptr;
  bool present = false;
  ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, i, dims, &et, &p, &present), w);
  if (!present) return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "input " + std::to_string(i) + " is missing").c_str());
  if (et != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "input " + std::to_string(i) + " is not float32").c_str());
  *data = static_cast<const float*>(p);
  return nullptr;
}

OrtStatus* compute(void* kernel_ptr, OrtKernelContext* ctx) noexcept {
  auto* k = static_cast<StackedMlpKernel*>(kernel_ptr);
  const OrtApiRef& api = k->api;
  const std::string w = where(k);
  try {
    Job job;
    std::vector<int64_t> dims;
    ONNXFUSE_RETURN_IF_ERROR(input_f32(api, ctx, 0, w, &job.x, &dims), "");
    if (dims.size() != 2) return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "X must be 2-D [batch, features]").c_str());
    job.batch = dims[0];
    int64_t width = dims[1];
    job.members = -1;
    job.widest = 1;
    job.avx2 = k->avx2;
    for (size_t l = 0; l < k->activations.size(); ++l) {
      Layer layer{};
      layer.act = k->activations[l];
      ONNXFUSE_RETURN_IF_ERROR(input_f32(api, ctx, 1 + 2 * l, w, &layer.w, &dims), "");
      if (dims.size() != 4 || dims[2] != width || dims[3] != kPanel || (job.members >= 0 && dims[0] != job.members))
        return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "weight of layer " + std::to_string(l + 1) +
                                                       " must be packed as [members, panels, " + std::to_string(width) +
                                                       ", 16]").c_str());
      job.members = dims[0];
      const int64_t panels = dims[1];
      layer.din = dims[2];
      ONNXFUSE_RETURN_IF_ERROR(input_f32(api, ctx, 2 + 2 * l, w, &layer.b, &dims), "");
      int64_t count = 1;
      for (int64_t d : dims) count *= d;
      if (dims.empty() || dims[0] != job.members || job.members == 0 || count % job.members != 0)
        return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "bias of layer " + std::to_string(l + 1) +
                                                       " must hold [members, out] values").c_str());
      layer.dout = count / job.members;
      if ((layer.dout + kPanel - 1) / kPanel != panels)
        return api.CreateStatus(ORT_INVALID_ARGUMENT, (w + "weight of layer " + std::to_string(l + 1) + " has " +
                                                       std::to_string(panels) + " panels for " +
                                                       std::to_string(layer.dout) + " outputs").c_str());
      width = layer.dout;
      job.widest = std::max(job.widest, width);
      job.layers.push_back(layer);
    }
    const int64_t out_dims[2] = {job.batch, job.members * width};
    OrtValue* y = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutput(ctx, 0, out_dims, 2, &y), w);
    void* yp = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(y, &yp), w);
    job.y = static_cast<float*>(yp);
    if (job.batch == 0 || job.members == 0) return nullptr;
    ONNXFUSE_RETURN_IF_ERROR(
        api.KernelContext_ParallelFor(ctx, run_member, static_cast<size_t>(job.members), 0, &job), w);
    return nullptr;
  } catch (const std::bad_alloc&) {
    return api.CreateStatus(ORT_FAIL, (w + "out of memory").c_str());
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_FAIL, (w + e.what()).c_str());
  }
}

void destroy_kernel(void* kernel) { delete static_cast<StackedMlpKernel*>(kernel); }

const char* op_name(const OrtCustomOp*) { return kStackedMlpName; }
const char* cpu_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
ONNXTensorElementDataType float_type(const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
size_t one(const OrtCustomOp*) { return 1; }
OrtCustomOpInputOutputCharacteristic variadic(const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; }
OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; }
OrtMemType default_memory(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int three(const OrtCustomOp*) { return 3; }
int homogeneous(const OrtCustomOp*) { return 1; }

OrtCustomOp make_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = kOrtApiVersion;
  op.GetName = op_name;
  op.GetExecutionProviderType = cpu_provider;
  op.GetInputType = float_type;
  op.GetInputTypeCount = one;
  op.GetOutputType = float_type;
  op.GetOutputTypeCount = one;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = variadic;
  op.GetOutputCharacteristic = required;
  op.GetInputMemoryType = default_memory;
  op.GetVariadicInputMinArity = three;
  op.GetVariadicInputHomogeneity = homogeneous;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  return op;
}

const OrtCustomOp kStackedMlpOp = make_op();
ONNXFUSE_REGISTER_OP(kStackedMlpOp);

}  // namespace
}  // namespace onnxfuse
