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
//   optional projected float32 [B, S, D] = MatMul(out, W) as onnxruntime computed it, W float32
//            [H*d, D], residual float32 [B, S, D] (all three or none): then y [B, S, D] =
//            residual + MatMul(guarded out, W): residual + projected on a row of out without a
//            NaN (the guard leaves it as it is, and a row of a MatMul depends on its own row
//            alone), residual + the guarded row times W (in double, rounded once) on the others
//
// Why a kernel of our own: the guard as standard ops is Sub and ReduceSum over the whole value
// cache, Expand (grouped heads), Reshape and Where(IsNaN): four or five kernels a layer, and the
// two over the cache grow with it. Z is needed only where out is NaN (a row every key is masked
// from, or non-finite scores), so this kernel copies out and sums a value column only for a NaN
// of out: one kernel, one pass over out. The sum is the fallback's (ReduceSum of v - v, in t
// order), so special values come out where the fallback gives them. With the projection, the
// residual Add after it is this kernel too: the layer's attention output costs the projection's
// MatMul and this one kernel.
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
  std::vector<int64_t> pd, wd, rd;
  ONNXTensorElementDataType pt = et, wt = et, rt = et;
  const void* pp = nullptr;
  const void* wp = nullptr;
  const void* rp = nullptr;
  bool has_p = false, has_w = false, has_r = false;
  size_t n_in = 0;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetInputCount(ctx, &n_in), k->where);
  if (n_in > 2) {
    ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 2, &pd, &pt, &pp, &has_p), k->where);
    if (n_in > 3) ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 3, &wd, &wt, &wp, &has_w), k->where);
    if (n_in > 4) ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 4, &rd, &rt, &rp, &has_r), k->where);
  }
  const bool projected = has_p || has_w || has_r;
  if (projected) {
    if (!(has_p && has_w && has_r)) return invalid(k, "projected, weight and residual go together");
    if (pt != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || wt != pt || rt != pt) return invalid(k, "inputs must be float32 tensors");
    if (wd.size() != 2 || wd[0] != od[2] || pd.size() != 3 || pd[0] != b || pd[1] != s || pd[2] != wd[1] || rd != pd)
      return invalid(k, "projected " + dims_text(pd) + ", weight " + dims_text(wd) + " and residual " + dims_text(rd) +
                            " do not fit out " + dims_text(od));
  }
  const std::vector<int64_t>& yd = projected ? pd : od;
  OrtValue* yv = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutput(ctx, 0, yd.data(), yd.size(), &yv), k->where);
  void* yp = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(yv, &yp), k->where);
  const float* x = static_cast<const float*>(op);
  const float* v = static_cast<const float*>(vp);
  float* y = static_cast<float*>(yp);
  const int64_t row = od[2], rows = b * s, group = k->heads / k->kv_heads;
  // Z for element c of a row of batch `batch`: the value column's sum of v - v.
  auto zero_probs = [&](int64_t batch, int64_t c) {
    const int64_t kv = (c / width) / group, j = c % width;
    const float* col = v + ((batch * k->kv_heads + kv) * t) * width + j;
    float z = 0.0f;
    for (int64_t p = 0; p < t; ++p) z += col[p * width] - col[p * width];
    return z;
  };
  if (!projected) {
    const int64_t n = rows * row;
    if (n == 0) return nullptr;
    if (y != x) std::memcpy(y, x, static_cast<size_t>(n) * sizeof(float));
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(y[i])) y[i] = zero_probs(i / (s * row), i % row);
    return nullptr;
  }
  const float* proj = static_cast<const float*>(pp);
  const float* w = static_cast<const float*>(wp);
  const float* res = static_cast<const float*>(rp);
  const int64_t d_out = pd[2];
  std::vector<float> guarded;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * row;
    float* yr = y + r * d_out;
    const float* resr = res + r * d_out;
    bool nan = false;
    for (int64_t c = 0; c < row && !nan; ++c) nan = std::isnan(xr[c]);
    if (!nan) {
      const float* pr = proj + r * d_out;
      for (int64_t o = 0; o < d_out; ++o) yr[o] = resr[o] + pr[o];
      continue;
    }
    guarded.assign(xr, xr + row);
    for (int64_t c = 0; c < row; ++c)
      if (std::isnan(guarded[c])) guarded[c] = zero_probs(r / s, c);
    for (int64_t o = 0; o < d_out; ++o) {
      double acc = 0.0;
      for (int64_t c = 0; c < row; ++c) acc += static_cast<double>(guarded[c]) * w[c * d_out + o];
      yr[o] = resr[o] + static_cast<float>(acc);
    }
  }
  return nullptr;
}

ONNXFUSE_REGISTER_FUSED_OP(AttentionNanGuard, kCpuProvider, AttentionNanGuardKernel, create_kernel,
                           compute_entry<AttentionNanGuardKernel, run>);

}  // namespace
}  // namespace onnxfuse
