// onnxfuse.AttentionNanGuard on the CPU: the NaN guard fuse-gqa writes after onnxruntime's
// GroupQueryAttention for an attention whose NaN probabilities are set to 0 (passes/gqa_attention.py).
//
//   inputs   out    float32 [B, S, H*d]: the op's output
//            values float32 [B, Hkv, T, d]: its present values
//   attrs    num_heads H, kv_num_heads Hkv: INT, H a multiple of Hkv
//   output   y float32 [B, S, H*d] = out where out is not NaN; where it is, Z[b, h*d + j] =
//            sum over t of (v - v), v = values[b, h / (H / Hkv), t, j]: +0 where that value column
//            is finite at every position, NaN where one is not (0 . V, what the original gives
//            for a row whose probabilities it set to 0)
//
// Why a kernel of our own: the guard as standard ops is Sub and ReduceSum over the whole value
// cache, Expand (grouped heads), Reshape and Where(IsNaN): four or five kernels a layer, and the
// two over the cache grow with it. Z is needed only where out is NaN (a row every key is masked
// from, or non-finite scores), so this kernel copies out and sums a value column only for a NaN
// of out: one kernel, one pass over out. The sum is the fallback's (ReduceSum of v - v, in t
// order), so special values come out where the fallback gives them.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernel_util.h"
#include "registry.h"

namespace onnxfuse {
namespace {

struct AttentionNanGuardKernel {
  OrtApiRef api;
  std::string where;  // "onnxfuse AttentionNanGuard node '<name>': "
  int64_t heads = 0, kv_heads = 0;
};

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  return create_guarded(
      raw, info, fused_ops::AttentionNanGuard.name, "",
      [&](const OrtApiRef& api, const std::string&, const std::string& where) -> OrtStatus* {
    auto kernel = std::make_unique<AttentionNanGuardKernel>();
    kernel->api = api;
    kernel->where = where;
    if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, "num_heads", &kernel->heads))
      return with_context(api, st, where + "attribute 'num_heads': ");
    if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, "kv_num_heads", &kernel->kv_heads))
      return with_context(api, st, where + "attribute 'kv_num_heads': ");
    if (kernel->heads < 1 || kernel->kv_heads < 1 || kernel->heads % kernel->kv_heads != 0)
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (where + "num_heads (" + std::to_string(kernel->heads) +
                               ") must be a positive multiple of kv_num_heads (" +
                               std::to_string(kernel->kv_heads) + ")").c_str());
    *out = kernel.release();
    return nullptr;
      });
}

OrtStatus* invalid(const AttentionNanGuardKernel* k, const std::string& what) {
  return k->api.CreateStatus(ORT_INVALID_ARGUMENT, (k->where + what).c_str());
}

OrtStatus* run(AttentionNanGuardKernel* k, OrtKernelContext* ctx) {
  const OrtApiRef& api = k->api;
  std::vector<int64_t> od, vd;
  ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, vt = et;
  const void* op = nullptr;
  const void* vp = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 0, &od, &et, &op), k->where);
  ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 1, &vd, &vt, &vp), k->where);
  if (et != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || vt != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
    return invalid(k, "inputs must be float32 tensors");
  if (od.size() != 3 || vd.size() != 4)
    return invalid(k, "out must be [B, S, H*d] and values [B, Hkv, T, d], got " + dims_text(od) + " and " + dims_text(vd));
  const int64_t b = od[0], s = od[1], width = vd[3], t = vd[2];
  if (vd[0] != b || vd[1] != k->kv_heads || od[2] != k->heads * width)
    return invalid(k, "out " + dims_text(od) + " and values " + dims_text(vd) + " do not fit num_heads " +
                          std::to_string(k->heads) + ", kv_num_heads " + std::to_string(k->kv_heads));
  OrtValue* yv = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutput(ctx, 0, od.data(), od.size(), &yv), k->where);
  void* yp = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(yv, &yp), k->where);
  const float* x = static_cast<const float*>(op);
  const float* v = static_cast<const float*>(vp);
  float* y = static_cast<float*>(yp);
  const int64_t row = od[2], n = b * s * row;
  if (n == 0) return nullptr;
  if (y != x) std::memcpy(y, x, static_cast<size_t>(n) * sizeof(float));
  const int64_t group = k->heads / k->kv_heads;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isnan(y[i])) continue;
    const int64_t c = i % row, batch = i / (s * row);
    const int64_t kv = (c / width) / group, j = c % width;
    const float* col = v + ((batch * k->kv_heads + kv) * t) * width + j;
    float z = 0.0f;
    for (int64_t p = 0; p < t; ++p) z += col[p * width] - col[p * width];
    y[i] = z;
  }
  return nullptr;
}

ONNXFUSE_REGISTER_FUSED_OP(AttentionNanGuard, kCpuProvider, AttentionNanGuardKernel, create_kernel,
                           compute_entry<AttentionNanGuardKernel, run>);

}  // namespace
}  // namespace onnxfuse
