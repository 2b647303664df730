// onnxfuse.Attention on the CUDA execution provider: launches the kernel generated for the node
// (onnxfuse/cuda/attention_codegen.py: one warp per query row, keys and values streamed through
// shared memory, online softmax) and stored with it by passes/cuda_compile.py, through the
// shared stored-kernel layer (cuda_launch.h).
//
// Inputs (float32): qkv_packed = 0: q [B, Sq, H*dh], k [B, Sk, H*dh], v [B, Sk, H*dv] (, mask);
// with heads_first bit 0 (q), 1 (k), 2 (v) set, that operand is [B, H, S, d] (read with head
// stride S*d: the generated kernel was specialised for the bits); with heads_merged bit 0, 1, 2
// set, that operand is [B*H, S, d] (3-D attention over batch*heads: the memory of [B, H, S, d]);
// qkv_packed = 1: qkv [B, S, 3*H*dh] (, mask), q, k, v read in place at its column offsets
// 0, H*dh, 2*H*dh. mask: additive, broadcastable (rank <= 4) to [B, H, Sq, Sk]. bias (has_bias,
// packed only): [3*H*dh], added to qkv's columns as the kernel reads them; with
// mask_merged_heads the mask is rank <= 3, broadcastable to [B*H, Sq, Sk]. condition (fill_mode
// 1 or 2, the last input): float32, broadcastable (rank <= 4) to [B, H, Sq, Sk]; a score is the
// kernel's fill value where it is nonzero (1) or zero (2). Output
// out [B, Sq, H*dv]. The kernel is specialised for H, dh, dv, the scale, packing and the mask's
// and bias's presence; B, Sq, Sk and the mask's broadcast strides are arguments, so one kernel
// serves every batch and sequence length.
//
// Per call, on the host: shape checks, the argument words, one launch on onnxruntime's stream (no
// synchronization, copies or allocation on the device, so CUDA graphs can capture it). Nothing is
// launched when the output is empty.
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

constexpr int64_t kAbiVersion = 3;  // attention_codegen.ABI_VERSION

struct CudaAttentionKernel {
  OrtApiRef api;
  std::string where;  // "onnxfuse Attention node '<name>' (CUDA): ", built once
  cuda::StoredKernel kernel;
  int64_t heads, dh, dv, rows, threads;
  bool packed, has_mask, has_bias;
  int64_t heads_first;  // bit 0 q, 1 k, 2 v: that operand is [B, H, S, d]
  int64_t heads_merged;  // bit 0 q, 1 k, 2 v: that operand is [B*H, S, d]
  bool mask_merged;      // the mask is rank <= 3, broadcast to [B*H, Sq, Sk]
  int64_t fill_mode;     // 0 none; 1 (2): the last input is the fill condition
};

// strides[i] of a tensor of dims `d` read as broadcast to `target` [B, H, Sq, Sk] (0 on broadcast
// axes); false when a dim is neither 1 nor the target's. merged: d (rank <= 3) is broadcast to
// [B*H, Sq, Sk], whose first axis holds (b, h) as b * H + h: h's stride is that axis's, b's H
// times it (as kernels/attention_cpu.cc reads it).
bool broadcast_strides(const std::vector<int64_t>& d, const int64_t target[4], bool merged, int64_t strides[4]) {
  const size_t rank = merged ? 3 : 4;
  if (d.size() > rank) return false;
  int64_t dims[4] = {1, 1, 1, 1};
  for (size_t i = 0; i < d.size(); ++i) dims[4 - d.size() + i] = d[i];
  int64_t running = 1;
  for (int i = 3; i >= (merged ? 1 : 0); --i) {
    const int64_t want = merged && i == 1 ? target[0] * target[1] : target[i];
    if (dims[i] != 1 && dims[i] != want) return false;
    strides[i] = dims[i] == 1 ? 0 : running;
    running *= dims[i];
  }
  if (merged) strides[0] = strides[1] * target[1];
  return true;
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  return create_guarded(
      raw, info, fused_ops::Attention.name, " (CUDA)",
      [&](const OrtApiRef& api, const std::string& name, const std::string& where) -> OrtStatus* {
    const char* names[] = {"num_heads", "cuda_dh", "cuda_dv", "cuda_rows", "cuda_block", "cuda_abi"};
    int64_t v[6];
    cuda::KernelImage image;
    if (OrtStatus* status = cuda::read_checked_launch(api, info, names, 6, kAbiVersion, &image, v, where))
      return status;
    if (v[4] != 32 * v[3] || v[4] > 1024)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "cuda_block is not 32 * cuda_rows").c_str());
    int64_t packed = 0, has_mask = 0, has_bias = 0, causal = 0, heads_first = 0, heads_merged = 0, mask_merged = 0,
            fill_mode = 0;
    cuda::int_attr(api, info, "qkv_packed", &packed);
    cuda::int_attr(api, info, "has_mask", &has_mask);
    cuda::int_attr(api, info, "has_bias", &has_bias);  // absent = 0
    cuda::int_attr(api, info, "causal", &causal);      // absent = 0
    cuda::int_attr(api, info, "heads_first", &heads_first);  // absent = 0
    cuda::int_attr(api, info, "heads_merged", &heads_merged);  // absent = 0
    cuda::int_attr(api, info, "mask_merged_heads", &mask_merged);  // absent = 0
    cuda::int_attr(api, info, "fill_mode", &fill_mode);  // absent = 0 (the fill value is the kernel's)
    // fuse-attention writes causal = 1 for the CPU target alone; this kernel has no causal mode.
    if (causal != 0)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "causal = 1 is not implemented by the CUDA kernel "
                                                     "(optimize the model with --target cuda)").c_str());
    size_t n_in = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetInputCount(info, &n_in), where);
    if (fill_mode < 0 || fill_mode > 2)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "fill_mode must be 0, 1 or 2").c_str());
    const size_t expected = (packed ? 1 : 3) + (has_mask ? 1 : 0) + (has_bias ? 1 : 0) + (fill_mode ? 1 : 0);
    if (n_in != expected)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "the node has " + std::to_string(n_in) +
                                                     " inputs, qkv_packed, has_mask, has_bias and fill_mode say " +
                                                     std::to_string(expected)).c_str());
    if (packed && v[1] != v[2])
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "packed qkv needs cuda_dh == cuda_dv").c_str());
    if (has_bias && !packed)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "has_bias needs qkv_packed = 1").c_str());
    if (heads_first < 0 || heads_first > 7 || (heads_first != 0 && packed))
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (where + "heads_first must be a mask of bits 0-2 (q, k, v), and 0 with qkv_packed").c_str());
    if (heads_merged < 0 || heads_merged > 7 || (heads_merged & heads_first) != 0 || (heads_merged != 0 && packed))
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (where + "heads_merged must be a mask of bits 0-2 (q, k, v), apart from heads_first's, "
                                       "and 0 with qkv_packed").c_str());
    if (mask_merged != 0 && has_mask == 0)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "mask_merged_heads needs has_mask = 1").c_str());
    *out = new CudaAttentionKernel{api,     where, cuda::StoredKernel(std::move(image)), v[0], v[1], v[2], v[3], v[4],
                                   packed != 0, has_mask != 0, has_bias != 0, heads_first, heads_merged,
                                   mask_merged != 0, fill_mode};
    return nullptr;
  });
}

OrtStatus* run(CudaAttentionKernel* k, OrtKernelContext* ctx) {
  const OrtApiRef& api = k->api;
  const std::string& where = k->where;
  const auto f32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  auto invalid = [&](const std::string& msg) { return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + msg).c_str()); };
  std::vector<int64_t> qs, ks, vs, ms;
  ONNXTensorElementDataType qt = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, kt = qt, vt = qt, mt = qt;
  const void *q = nullptr, *kp = nullptr, *vp = nullptr, *mask = nullptr, *bias = nullptr;
  const int64_t H = k->heads;
  ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 0, &qs, &qt, &q), where);
  if (qt != f32) return invalid("the kernel reads float32 tensors only");
  int64_t batch = 0, sq = 0, sk = 0;
  if (k->packed) {
    if (qs.size() != 3 || qs[2] != 3 * H * k->dh)
      return invalid("qkv is " + dims_text(qs) + ", the kernel was generated for [B, S, " +
                     std::to_string(3 * H * k->dh) + "]");
    batch = qs[0];
    sq = sk = qs[1];
    kp = vp = q;
  } else {
    ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 1, &ks, &kt, &kp), where);
    ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, 2, &vs, &vt, &vp), where);
    if (kt != f32 || vt != f32) return invalid("the kernel reads float32 tensors only");
    // Each operand's (B, S): [B, S, H*d], [B, H, S, d] where its heads_first bit is set, or
    // [B*H, S, d] where its heads_merged bit is.
    const std::vector<int64_t>* dims[3] = {&qs, &ks, &vs};
    const int64_t widths[3] = {k->dh, k->dh, k->dv};
    int64_t bs[3][2] = {};
    bool fits = true;
    for (int o = 0; o < 3; ++o) {
      const std::vector<int64_t>& d = *dims[o];
      if ((k->heads_merged >> o) & 1) {
        fits = fits && d.size() == 3 && d[0] % H == 0 && d[2] == widths[o];
        if (d.size() == 3) bs[o][0] = d[0] / H, bs[o][1] = d[1];
      } else if ((k->heads_first >> o) & 1) {
        fits = fits && d.size() == 4 && d[1] == H && d[3] == widths[o];
        if (d.size() == 4) bs[o][0] = d[0], bs[o][1] = d[2];
      } else {
        fits = fits && d.size() == 3 && d[2] == H * widths[o];
        if (d.size() == 3) bs[o][0] = d[0], bs[o][1] = d[1];
      }
    }
    if (!fits || bs[1][0] != bs[0][0] || bs[2][0] != bs[0][0] || bs[2][1] != bs[1][1]) {
      auto form = [&](int o, const char* s) {
        const std::string d = std::to_string(widths[o]);
        if ((k->heads_merged >> o) & 1) return "[B*" + std::to_string(H) + ", " + s + ", " + d + "]";
        return ((k->heads_first >> o) & 1) ? "[B, " + std::to_string(H) + ", " + s + ", " + d + "]"
                                           : "[B, " + std::string(s) + ", " + std::to_string(H * widths[o]) + "]";
      };
      return invalid("q " + dims_text(qs) + ", k " + dims_text(ks) + ", v " + dims_text(vs) +
                     " do not fit the kernel's " + form(0, "Sq") + ", " + form(1, "Sk") + ", " + form(2, "Sk"));
    }
    batch = bs[0][0];
    sq = bs[0][1];
    sk = bs[1][1];
  }
  // The mask's element strides over [B, H, Sq, Sk]; 0 where it broadcasts.
  int64_t mask_strides[4] = {0, 0, 0, 0};
  if (k->has_mask) {
    bool present = false;
    ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, k->packed ? 1 : 3, &ms, &mt, &mask, &present), where);
    if (!present) return invalid("has_mask is 1 but the mask input is missing");
    if (mt != f32) return invalid("the mask must be float32");
    const int64_t target[4] = {batch, H, sq, sk};
    if (!broadcast_strides(ms, target, k->mask_merged, mask_strides))
      return invalid("the mask " + dims_text(ms) + " does not broadcast to " +
                     (k->mask_merged ? "[B*H, Sq, Sk] = " + dims_text({batch * H, sq, sk})
                                     : "[B, H, Sq, Sk] = " + dims_text({batch, H, sq, sk})));
  }
  if (k->has_bias) {
    std::vector<int64_t> bs;
    ONNXTensorElementDataType bt = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    bool present = false;
    ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, k->has_mask ? 2 : 1, &bs, &bt, &bias, &present), where);
    if (!present) return invalid("has_bias is 1 but the bias input is missing");
    if (bt != f32) return invalid("the bias must be float32");
    if (bs.size() != 1 || bs[0] != 3 * H * k->dh)
      return invalid("the bias is " + dims_text(bs) + ", the kernel was generated for [" +
                     std::to_string(3 * H * k->dh) + "]");
  }
  // The fill condition's element strides over [B, H, Sq, Sk] (fill_mode: the last input).
  const void* cond = nullptr;
  int64_t cond_strides[4] = {0, 0, 0, 0};
  if (k->fill_mode != 0) {
    std::vector<int64_t> cs;
    ONNXTensorElementDataType ct = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    bool present = false;
    const size_t at = (k->packed ? 1 : 3) + (k->has_mask ? 1 : 0) + (k->has_bias ? 1 : 0);
    ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, at, &cs, &ct, &cond, &present), where);
    if (!present) return invalid("fill_mode is set but the condition input is missing");
    if (ct != f32) return invalid("the fill condition must be float32");
    const int64_t target[4] = {batch, H, sq, sk};
    if (!broadcast_strides(cs, target, false, cond_strides))
      return invalid("the fill condition " + dims_text(cs) + " does not broadcast to [B, H, Sq, Sk] = " +
                     dims_text({batch, H, sq, sk}));
  }
  const int64_t out_dims[3] = {batch, sq, H * k->dv};
  OrtValue* ov = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutput(ctx, 0, out_dims, 3, &ov), where);
  void* out = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(ov, &out), where);
  if (batch == 0 || sq == 0) return nullptr;  // empty output: nothing to compute

  const int64_t row_blocks = (sq + k->rows - 1) / k->rows;
  const int64_t max_grid = (int64_t{1} << 31) - 1;
  if (batch > max_grid / H || batch * H > max_grid / row_blocks)
    return invalid("batch " + std::to_string(batch) + " x sequence " + std::to_string(sq) + " is too large");

  // The argument struct of attention_codegen ABI 3, as 8-byte words (a kernel without a fill
  // declares the first 13 only; the driver copies the size the kernel declares).
  int64_t words[18] = {static_cast<int64_t>(reinterpret_cast<uintptr_t>(q)),
                       static_cast<int64_t>(reinterpret_cast<uintptr_t>(kp)),
                       static_cast<int64_t>(reinterpret_cast<uintptr_t>(vp)),
                       static_cast<int64_t>(reinterpret_cast<uintptr_t>(mask)),
                       static_cast<int64_t>(reinterpret_cast<uintptr_t>(bias)),
                       static_cast<int64_t>(reinterpret_cast<uintptr_t>(out)),
                       batch,
                       sq,
                       sk,
                       mask_strides[0],
                       mask_strides[1],
                       mask_strides[2],
                       mask_strides[3],
                       static_cast<int64_t>(reinterpret_cast<uintptr_t>(cond)),
                       cond_strides[0],
                       cond_strides[1],
                       cond_strides[2],
                       cond_strides[3]};
  return cuda::launch_on_ort_stream(api, ctx, k->kernel, cuda::grid_of(batch * H * row_blocks), k->threads, words,
                                    where);
}

// The schema every registration of onnxfuse.Attention shares (the CPU kernel's in
// attention_cpu.cc): float32 inputs, variadic and homogeneous (qkv or q, k, v, then the mask when
// has_mask, then the bias when has_bias), one output. Registered for CUDA sessions only
// (registry.cc).
ONNXFUSE_REGISTER_FUSED_OP(Attention, kCudaProvider, CudaAttentionKernel, create_kernel,
                           compute_entry<CudaAttentionKernel, run>);

}  // namespace
}  // namespace onnxfuse
