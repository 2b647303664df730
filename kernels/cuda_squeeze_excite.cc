// onnxfuse.SqueezeExcite on the CUDA execution provider: launches the kernel generated for the
// block (onnxfuse/cuda/squeeze_excite_codegen.py: one block per image, the channel means, the two
// small matrix-vector products with their activations and the gated multiply) and stored with
// the node by passes/cuda_compile.py, through the shared stored-kernel layer (cuda_launch.h).
//
// Inputs X [N, C, H, W], W1 [R, C, 1, 1], B1 [R], W2 [C, R, 1, 1], B2 [C]; output Y [N, C, H, W];
// float32. The kernel is specialised for C and R (and the activations); N and H * W are
// arguments. Per call, on the host: shape checks, the argument words, one launch on
// onnxruntime's stream (no synchronization, copies or allocation, so CUDA graphs can capture
// it). Nothing is launched when Y is empty.
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_launch.h"
#include "kernel_util.h"
#include "registry.h"

namespace onnxfuse {
namespace {

constexpr int64_t kAbiVersion = 1;  // squeeze_excite_codegen.ABI_VERSION

struct CudaSqueezeExciteKernel {
  OrtApiRef api;
  std::string where;  // "onnxfuse SqueezeExcite node '<name>' (CUDA): ", built once
  cuda::StoredKernel kernel;
  int64_t threads, c, r;
};

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  return create_guarded(
      raw, info, fused_ops::SqueezeExcite.name, " (CUDA)",
      [&](const OrtApiRef& api, const std::string& name, const std::string& where) -> OrtStatus* {
    // Launch constants (squeeze_excite_codegen.Kernel.attrs).
    const char* names[] = {"cuda_block", "cuda_c", "cuda_r", "cuda_abi"};
    int64_t v[4];
    cuda::KernelImage image;
    if (OrtStatus* status = cuda::read_checked_launch(api, info, names, 4, kAbiVersion, &image, v, where))
      return status;
    size_t n_in = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetInputCount(info, &n_in), where);
    if (n_in != 5)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "expects X, W1, B1, W2, B2").c_str());
    *out = new CudaSqueezeExciteKernel{api, where, cuda::StoredKernel(std::move(image)), v[0], v[1], v[2]};
    return nullptr;
  });
}

OrtStatus* run(CudaSqueezeExciteKernel* k, OrtKernelContext* ctx) {
  const OrtApiRef& api = k->api;
  const std::string& where = k->where;
  auto invalid = [&](const std::string& msg) { return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + msg).c_str()); };
  std::vector<int64_t> dims[5];
  const void* data[5] = {};
  for (size_t i = 0; i < 5; ++i) {
    ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    bool present = false;
    ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, i, &dims[i], &et, &data[i], &present), where);
    if (!present || et != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
      return invalid("input " + std::to_string(i) + " must be a float32 tensor");
  }
  const std::vector<int64_t>& xd = dims[0];
  if (xd.size() != 4 || xd[1] != k->c)
    return invalid("X is " + dims_text(xd) + ", the kernel was generated for [N, " + std::to_string(k->c) +
                   ", H, W]");
  const std::vector<int64_t> w1 = {k->r, k->c, 1, 1}, w2 = {k->c, k->r, 1, 1}, b1 = {k->r}, b2 = {k->c};
  if (dims[1] != w1 || dims[2] != b1 || dims[3] != w2 || dims[4] != b2)
    return invalid("weights " + dims_text(dims[1]) + ", " + dims_text(dims[3]) + " and biases " + dims_text(dims[2]) +
                   ", " + dims_text(dims[4]) + " are not the kernel's " + dims_text(w1) + ", " + dims_text(w2) +
                   ", " + dims_text(b1) + ", " + dims_text(b2));
  OrtValue* yv = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutput(ctx, 0, xd.data(), xd.size(), &yv), where);
  void* y = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(yv, &y), where);
  const int64_t batch = xd[0], hw = xd[2] * xd[3];
  if (batch == 0 || hw == 0) return nullptr;  // empty Y: nothing to compute
  if (batch > (int64_t{1} << 31) - 1) return invalid("batch " + std::to_string(batch) + " is too large");

  // The argument struct of squeeze_excite_codegen ABI 1, as 8-byte words.
  int64_t words[8];
  for (int i = 0; i < 5; ++i) words[i] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(data[i]));
  words[5] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(y));
  words[6] = batch;
  words[7] = hw;
  return cuda::launch_on_ort_stream(api, ctx, k->kernel, cuda::grid_of(batch), k->threads, words, where);
}

// The schema of the CPU kernel's registration (squeeze_excite_cpu.cc): five float32 inputs, one
// float32 output. Registered for CUDA sessions only (registry.cc).
ONNXFUSE_REGISTER_FUSED_OP(SqueezeExcite, kCudaProvider, CudaSqueezeExciteKernel, create_kernel,
                           compute_entry<CudaSqueezeExciteKernel, run>);

}  // namespace
}  // namespace onnxfuse
