// onnxfuse.ChannelShuffle on the CPU: Concat, channel shuffle and Split of a ShuffleNet block in
// one copy (passes/channel_shuffle.py writes it).
//
//   inputs   X_1 .. X_k float32 [N, C_i, H, W] (k >= 1), same N, H and W: read as their
//            Concat along the channels, C = sum C_i
//   attrs    groups: INT, g >= 1, with C % g == 0
//   outputs  Y_1 .. Y_m float32 [N, C / m, H, W] (m >= 1, C % m == 0): the equal pieces along
//            the channels of S, the shuffled Concat, where channel j * g + i of S is channel
//            i * (C / g) + j of the Concat (Reshape to [N, g, C / g, H, W], Transpose 0 2 1 3 4,
//            Reshape back)
//
// Why a kernel of our own: onnxruntime runs Concat, Reshape, Transpose, Reshape and Split as five
// kernels and three copies of the block's activations. The shuffle only permutes whole H x W
// planes, so each output plane is one contiguous copy from one input plane: one kernel, one copy.
// A channel count the groups or pieces do not divide is refused with a message, as the original
// Reshape and Split refuse it.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernel_util.h"
#include "registry.h"

namespace onnxfuse {
namespace {

struct ChannelShuffleKernel {
  OrtApiRef api;
  std::string where;  // "onnxfuse ChannelShuffle node '<name>': "
  int64_t groups = 1;
};

// One copy job: every output plane, planes of all images and outputs numbered in one range.
struct Job {
  const float* const* src;  // per concatenated channel c: input plane 0 of that channel
  const int64_t* src_image_stride;  // per concatenated channel: elements between images
  float* const* dst;          // per output
  int64_t n, c, piece, hw, groups, outputs;
};

// Plane p = ((image * outputs) + output) * piece + channel in the piece.
void copy_planes(void* data, size_t block) {
  const Job* j = static_cast<const Job*>(data);
  const int64_t planes = j->n * j->c;
  constexpr int64_t kPlanesPerBlock = 16;
  const int64_t begin = static_cast<int64_t>(block) * kPlanesPerBlock;
  const int64_t end = begin + kPlanesPerBlock < planes ? begin + kPlanesPerBlock : planes;
  const int64_t per_group = j->c / j->groups;
  for (int64_t p = begin; p < end; ++p) {
    const int64_t image = p / j->c;
    const int64_t s = p % j->c;  // channel of the shuffled Concat
    const int64_t out = s / j->piece, ch = s % j->piece;
    const int64_t from = (s % j->groups) * per_group + s / j->groups;  // channel of the Concat
    std::memcpy(j->dst[out] + (image * j->piece + ch) * j->hw,
                j->src[from] + image * j->src_image_stride[from],
                static_cast<size_t>(j->hw) * sizeof(float));
  }
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  return create_guarded(
      raw, info, fused_ops::ChannelShuffle.name, "",
      [&](const OrtApiRef& api, const std::string&, const std::string& where) -> OrtStatus* {
    auto kernel = std::make_unique<ChannelShuffleKernel>();
    kernel->api = api;
    kernel->where = where;
    if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, "groups", &kernel->groups))
      return with_context(api, st, where + "attribute 'groups': ");
    if (kernel->groups < 1)
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (where + "groups must be at least 1, got " + std::to_string(kernel->groups)).c_str());
    *out = kernel.release();
    return nullptr;
      });
}

OrtStatus* invalid(const ChannelShuffleKernel* k, const std::string& what) {
  return k->api.CreateStatus(ORT_INVALID_ARGUMENT, (k->where + what).c_str());
}

OrtStatus* run(ChannelShuffleKernel* k, OrtKernelContext* ctx) {
  const OrtApiRef& api = k->api;
  size_t n_in = 0, n_out = 0;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetInputCount(ctx, &n_in), k->where);
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutputCount(ctx, &n_out), k->where);
  if (n_in == 0 || n_out == 0) return invalid(k, "needs at least one input and one output");
  thread_local std::vector<const float*> src;
  thread_local std::vector<int64_t> src_stride;
  thread_local std::vector<float*> dst;
  src.clear();
  src_stride.clear();
  std::vector<int64_t> first, dims;
  for (size_t i = 0; i < n_in; ++i) {
    ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    const void* data = nullptr;
    bool present = false;
    ONNXFUSE_RETURN_IF_ERROR(read_input(api, ctx, i, &dims, &et, &data, &present), k->where);
    if (!present || et != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
      return invalid(k, "input " + std::to_string(i) + " must be a float32 tensor");
    if (dims.size() != 4) return invalid(k, "input " + std::to_string(i) + " must be 4-D [N, C, H, W], got " + dims_text(dims));
    if (i == 0) first = dims;
    if (dims[0] != first[0] || dims[2] != first[2] || dims[3] != first[3])
      return invalid(k, "input " + std::to_string(i) + " " + dims_text(dims) + " does not concatenate with input 0 " +
                            dims_text(first) + " along the channels");
    const float* base = static_cast<const float*>(data);
    const int64_t hw = dims[2] * dims[3];
    for (int64_t c = 0; c < dims[1]; ++c) {
      src.push_back(base + c * hw);
      src_stride.push_back(dims[1] * hw);
    }
  }
  const int64_t channels = static_cast<int64_t>(src.size());
  const int64_t m = static_cast<int64_t>(n_out);
  if (channels % k->groups != 0)
    return invalid(k, std::to_string(channels) + " channels do not divide into " + std::to_string(k->groups) + " groups");
  if (channels % m != 0)
    return invalid(k, std::to_string(channels) + " channels do not divide into " + std::to_string(m) + " equal outputs");
  Job job{};
  job.n = first[0];
  job.c = channels;
  job.piece = channels / m;
  job.hw = first[2] * first[3];
  job.groups = k->groups;
  job.outputs = m;
  dst.assign(n_out, nullptr);
  const int64_t out_dims[4] = {first[0], job.piece, first[2], first[3]};
  for (size_t o = 0; o < n_out; ++o) {
    OrtValue* y = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetOutput(ctx, o, out_dims, 4, &y), k->where);
    void* yp = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(y, &yp), k->where);
    dst[o] = static_cast<float*>(yp);
  }
  job.src = src.data();
  job.src_image_stride = src_stride.data();
  job.dst = dst.data();
  const int64_t planes = job.n * job.c;
  if (planes == 0 || job.hw == 0) return nullptr;
  const int64_t blocks = (planes + 15) / 16;
  if (blocks == 1) {
    copy_planes(&job, 0);
    return nullptr;
  }
  ONNXFUSE_RETURN_IF_ERROR(
      api.KernelContext_ParallelFor(ctx, copy_planes, static_cast<size_t>(blocks), 0, &job), k->where);
  return nullptr;
}

// Inputs X_1.. and outputs Y_1..: variadic float32 tensors, at least one of each.
ONNXFUSE_REGISTER_FUSED_OP(ChannelShuffle, kCpuProvider, ChannelShuffleKernel, create_kernel,
                           compute_entry<ChannelShuffleKernel, run>);

}  // namespace
}  // namespace onnxfuse
