// onnxfuse.ConvBiasAct on the CUDA execution provider: launches the kernel generated for the
// layer (onnxfuse/cuda/conv_codegen.py, implicit GEMM or direct depthwise) and stored with the
// node by passes/cuda_compile.py, through the shared stored-kernel layer (cuda_launch.h).
//
// Inputs X [N, C, H, W], W, B [K], optional residual Z [N, K, P, Q]; output Y [N, K, P, Q];
// float32. The kernel is specialised for C, H, W (and the conv's parameters); N is an argument,
// so the grid's x dimension is computed per call: ceil(N * cuda_grid[0] / cuda_grid[1]).
//
// For the CUDA provider only, and (see the end of the file) not registered by default.
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "cuda_launch.h"
#include "kernel_util.h"
#include "registry.h"

namespace onnxfuse {
namespace {


struct CudaConvKernel {
  OrtApiRef api;
  std::string where;  // "onnxfuse ConvBiasAct node '<name>' (CUDA): ", built once
  cuda::StoredKernel kernel;
  int64_t threads;
  int64_t grid_cols, cols_per_block, grid_y, grid_z;
  int64_t c, h, w, k, p, q;
  bool residual;
};

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  return create_guarded(
      raw, info, fused_ops::ConvBiasAct.name, " (CUDA)",
      [&](const OrtApiRef& api, const std::string& name, const std::string& where) -> OrtStatus* {
    // Launch constants (conv_codegen.Kernel.attrs).
    const char* names[] = {"cuda_block", "cuda_grid_cols", "cuda_cols_per_block", "cuda_grid_y", "cuda_grid_z",
                           "cuda_c",     "cuda_h",         "cuda_w",              "cuda_k",      "cuda_p",
                           "cuda_q"};
    int64_t v[11];
    cuda::KernelImage image;
    std::string error;
    if (!cuda::read_launch(api, info, names, 11, &image, v, &error))
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + error).c_str());
    if (v[0] > 1024)
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (where + "missing or invalid attribute cuda_block (optimize the model again)").c_str());
    int64_t residual = 0;
    if (!cuda::int_attr(api, info, "cuda_residual", &residual))
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "missing attribute cuda_residual").c_str());
    size_t n_in = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetInputCount(info, &n_in), where);
    if ((residual != 0) != (n_in == 4))
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (where + "the kernel's residual epilogue and the node's inputs disagree").c_str());
    *out = new CudaConvKernel{api,  where, cuda::StoredKernel(std::move(image)),
                              v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], residual != 0};
    return nullptr;
  });
}

OrtStatus* run(CudaConvKernel* k, OrtKernelContext* ctx) {
  const OrtApiRef& api = k->api;
  const std::string& where = k->where;
  std::vector<int64_t> xs, ws, bs, zs;
  ONNXTensorElementDataType xt = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, wt = xt, bt = xt, zt = xt;
  const void *x = nullptr, *w = nullptr, *b = nullptr, *z = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 0, &xs, &xt, &x), where);
  ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 1, &ws, &wt, &w), where);
  ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 2, &bs, &bt, &b), where);
  if (k->residual) ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 3, &zs, &zt, &z), where);
  const auto f32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  if (xt != f32 || wt != f32 || bt != f32 || (k->residual && zt != f32))
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "the kernel reads float32 tensors only").c_str());
  if (xs.size() != 4 || xs[1] != k->c || xs[2] != k->h || xs[3] != k->w)
    return api.CreateStatus(ORT_INVALID_ARGUMENT,
                            (where + "input X is " + dims_text(xs) + ", the kernel was generated for [N, " +
                             std::to_string(k->c) + ", " + std::to_string(k->h) + ", " + std::to_string(k->w) +
                             "] (optimize the model again for this input size)")
                                .c_str());
  if (bs.size() != 1 || bs[0] != k->k || ws.empty() || ws[0] != k->k)
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "W or B does not match the kernel's channels").c_str());
  const int64_t n = xs[0];
  const std::vector<int64_t> ys = {n, k->k, k->p, k->q};
  if (k->residual && (z == nullptr || zs != ys))
    return api.CreateStatus(ORT_INVALID_ARGUMENT,
                            (where + "residual Z is " + dims_text(zs) + ", expected " + dims_text(ys)).c_str());
  OrtValue* yv = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutput(ctx, 0, ys.data(), ys.size(), &yv), where);
  void* y = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(yv, &y), where);
  if (n == 0) return nullptr;
  // Pixel indices in the kernel are 32-bit.
  if (n * k->grid_cols + k->cols_per_block >= (int64_t{1} << 31))
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "batch " + std::to_string(n) + " is too large").c_str());

  // The argument struct of conv_codegen ABI 1: x, w, bias, z, y, batch, as 8-byte words.
  int64_t words[6] = {
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(x)), static_cast<int64_t>(reinterpret_cast<uintptr_t>(w)),
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(b)), static_cast<int64_t>(reinterpret_cast<uintptr_t>(z)),
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(y)), n};
  const cuda::Dim3 grid = cuda::grid_of((n * k->grid_cols + k->cols_per_block - 1) / k->cols_per_block, k->grid_y,
                                        k->grid_z);
  return cuda::launch_on_ort_stream(api, ctx, k->kernel, grid, k->threads, words, where);
}

// X, W, B and the optional residual Z, float32; one float32 output. Registered for CUDA sessions
// only (registry.cc): a CPU session does not get this op, so its ConvBiasAct nodes run their
// fallback functions there.
ONNXFUSE_REGISTER_FUSED_OP(ConvBiasAct, kCudaProvider, CudaConvKernel, create_kernel,
                           compute_entry<CudaConvKernel, run>);

}  // namespace
}  // namespace onnxfuse
