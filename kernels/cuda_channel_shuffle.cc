// onnxfuse.ChannelShuffle on the CUDA execution provider: launches the plane-copy kernel generated
// for the node (onnxfuse/cuda/shuffle_codegen.py) and stored with it by passes/cuda_compile.py,
// through the shared stored-kernel layer (cuda_launch.h).
//
// Inputs X_1 .. X_k float32 [N, C_i, H, W], outputs Y_1 .. Y_m float32 [N, C / m, H, W]: the
// contract of the CPU kernel (channel_shuffle_cpu.cc). The kernel is specialised for the C_i
// (attribute cuda_channels, "116,116"), the groups and m; N and H * W are arguments.
//
// Per call, on the host: shape checks, the launch plan (shuffle_codegen.plan_launch: vector width
// from H * W and the buffers' alignment, threads, span, grid = (N * C, chunks)), one launch on
// onnxruntime's stream (no synchronization, copies or allocation, so CUDA graphs can capture it).
// Nothing is launched when the outputs are empty.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_launch.h"
#include "kernel_util.h"
#include "registry.h"

namespace onnxfuse {
namespace {

constexpr int64_t kAbiVersion = 1;      // shuffle_codegen.ABI_VERSION
constexpr int64_t kSpanIters = 4;       // shuffle_codegen.SPAN_ITERS
constexpr int64_t kMaxGridY = 65535;    // shuffle_codegen.MAX_GRID_Y
constexpr int64_t kMaxGridX = (int64_t{1} << 31) - 1;

struct CudaChannelShuffleKernel {
  OrtApiRef api;
  std::string where;  // "onnxfuse ChannelShuffle node '<name>' (CUDA): ", built once
  cuda::StoredKernel kernel;
  int64_t groups, max_threads;
  std::vector<int64_t> channels;  // C_i the kernel was generated for
  size_t outputs;
};

// "116,116" -> {116, 116}; false unless every entry is a positive integer.
bool parse_channels(const std::string& text, std::vector<int64_t>* out) {
  out->clear();
  int64_t value = 0;
  bool digits = false;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == ',') {
      if (!digits || value < 1) return false;
      out->push_back(value);
      value = 0;
      digits = false;
    } else if (text[i] >= '0' && text[i] <= '9' && value < (int64_t{1} << 40)) {
      value = value * 10 + (text[i] - '0');
      digits = true;
    } else {
      return false;
    }
  }
  return !out->empty();
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  return create_guarded(
      raw, info, fused_ops::ChannelShuffle.name, " (CUDA)",
      [&](const OrtApiRef& api, const std::string&, const std::string& where) -> OrtStatus* {
    const char* names[] = {"groups", "cuda_block", "cuda_abi"};
    int64_t v[3];
    cuda::KernelImage image;
    if (OrtStatus* status = cuda::read_checked_launch(api, info, names, 3, kAbiVersion, &image, v, where))
      return status;
    std::string text;
    std::vector<int64_t> channels;
    if (!cuda::string_attr(api, info, "cuda_channels", &text) || !parse_channels(text, &channels))
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (where + "missing or invalid attribute cuda_channels (optimize the model again)").c_str());
    size_t n_in = 0, n_out = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetInputCount(info, &n_in), where);
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetOutputCount(info, &n_out), where);
    if (n_in != channels.size())
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "the node has " + std::to_string(n_in) +
                                                     " inputs, the kernel was generated for " +
                                                     std::to_string(channels.size())).c_str());
    int64_t total = 0;
    for (int64_t c : channels) total += c;
    if (n_out == 0 || total % v[0] != 0 || total % static_cast<int64_t>(n_out) != 0)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + std::to_string(total) + " channels do not divide into " +
                                                     std::to_string(v[0]) + " groups and " + std::to_string(n_out) +
                                                     " outputs").c_str());
    *out = new CudaChannelShuffleKernel{api, where, cuda::StoredKernel(std::move(image)), v[0], v[1],
                                        std::move(channels), n_out};
    return nullptr;
  });
}

OrtStatus* run(CudaChannelShuffleKernel* k, OrtKernelContext* ctx) {
  const OrtApiRef& api = k->api;
  const std::string& where = k->where;
  auto invalid = [&](const std::string& msg) { return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + msg).c_str()); };
  const size_t n_in = k->channels.size();
  // The argument struct (shuffle_codegen ABI 1): x[k], y[m], hw, vec, span as 8-byte words.
  thread_local std::vector<int64_t> words;
  words.assign(n_in + k->outputs + 3, 0);
  std::vector<int64_t> dims, first;
  uintptr_t alignment_bits = 0;  // OR of every buffer address: its low bits decide the vector width
  int64_t total = 0;
  for (size_t i = 0; i < n_in; ++i) {
    ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    const void* data = nullptr;
    bool present = false;
    ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, i, &dims, &et, &data, &present), where);
    if (!present || et != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
      return invalid("input " + std::to_string(i) + " must be a float32 tensor");
    if (dims.size() != 4) return invalid("input " + std::to_string(i) + " must be 4-D [N, C, H, W], got " + dims_text(dims));
    if (i == 0) first = dims;
    if (dims[0] != first[0] || dims[2] != first[2] || dims[3] != first[3])
      return invalid("input " + std::to_string(i) + " " + dims_text(dims) + " does not concatenate with input 0 " +
                     dims_text(first) + " along the channels");
    if (dims[1] != k->channels[i])
      return invalid("input " + std::to_string(i) + " is " + dims_text(dims) + ", the kernel was generated for " +
                     std::to_string(k->channels[i]) + " channels");
    words[i] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(data));
    alignment_bits |= reinterpret_cast<uintptr_t>(data);
    total += dims[1];
  }
  const int64_t n = first[0], hw = first[2] * first[3];
  const int64_t piece = total / static_cast<int64_t>(k->outputs);
  const int64_t out_dims[4] = {n, piece, first[2], first[3]};
  for (size_t o = 0; o < k->outputs; ++o) {
    OrtValue* y = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutput(ctx, o, out_dims, 4, &y), where);
    void* yp = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(y, &yp), where);
    words[n_in + o] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(yp));
    alignment_bits |= reinterpret_cast<uintptr_t>(yp);
  }
  if (n == 0 || hw == 0) return nullptr;  // empty outputs: nothing to copy
  if (n > kMaxGridX / total) return invalid("batch " + std::to_string(n) + " x " + std::to_string(total) +
                                            " channels exceeds the grid");
  // shuffle_codegen.plan_launch.
  int64_t vec = 1;
  if (hw % 4 == 0 && alignment_bits % 16 == 0)
    vec = 4;
  else if (hw % 2 == 0 && alignment_bits % 8 == 0)
    vec = 2;
  const int64_t vecs = hw / vec;
  int64_t threads = (vecs + 31) / 32 * 32;
  if (threads > k->max_threads) threads = k->max_threads;
  int64_t span = threads * kSpanIters;
  if ((vecs + span - 1) / span > kMaxGridY) {
    const int64_t least = (vecs + kMaxGridY - 1) / kMaxGridY;
    span = (least + threads - 1) / threads * threads;
  }
  words[n_in + k->outputs] = hw;
  words[n_in + k->outputs + 1] = vec;
  words[n_in + k->outputs + 2] = span;
  return cuda::launch_on_ort_stream(api, ctx, k->kernel, cuda::grid_of(n * total, (vecs + span - 1) / span), threads,
                                    words.data(), where);
}

// The schema of the CPU registration (channel_shuffle_cpu.cc): variadic float32 inputs and
// outputs, at least one of each. Registered for CUDA sessions only (registry.cc).
ONNXFUSE_REGISTER_FUSED_OP(ChannelShuffle, kCudaProvider, CudaChannelShuffleKernel, create_kernel,
                           compute_entry<CudaChannelShuffleKernel, run>);

}  // namespace
}  // namespace onnxfuse
