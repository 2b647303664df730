// onnxfuse.Pointwise on the CUDA execution provider: runs the kernel generated from the node's
// program (onnxfuse/cuda/codegen.py) and stored with the node by passes/cuda_compile.py.
//
// Per call, on the host: the iteration plan (shared with the CPU kernel, pointwise_plan.h; kept
// from the previous call while the input shapes stay the same, since resolving it was the largest
// host cost per call), the loop mode (linear / vector / strided, see codegen.py), the argument
// words, one launch on onnxruntime's stream. Same schema as the CPU registration (registry.h
// requires it).
#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "cuda_launch.h"
#include "pointwise_plan.h"
#include "kernel_util.h"
#include "registry.h"

namespace onnxfuse {
namespace {

struct CudaPointwiseKernel {
  OrtApiRef api;
  Program program;
  std::string where;  // "onnxfuse Pointwise node '<name>' (CUDA): ", built once
  cuda::StoredKernel kernel;
  int rank;   // the kernel's iteration rank (cuda_rank)
  int vec;    // elements per vector access (cuda_vec)
  int block;  // threads per block (cuda_block)
  // The plan of the last call's input shapes (resolve_plan depends on nothing else). Shared
  // read-only between concurrent calls; replaced when the shapes change.
  std::mutex plan_mu;
  std::vector<std::vector<int64_t>> plan_shapes;
  std::shared_ptr<const IterPlan> plan;
};

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  return create_guarded(
      raw, info, fused_ops::Pointwise.name, " (CUDA)",
      [&](const OrtApiRef& api, const std::string& name, const std::string& where) -> OrtStatus* {
    std::string text;
    if (!cuda::string_attr(api, info, kProgramAttr, &text))
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "missing string attribute 'program'").c_str());
    Program program;
    std::string error;
    if (!Program::parse(text, &program, &error)) return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + error).c_str());
    size_t n_in = 0, n_out = 0;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetInputCount(info, &n_in), where);
    ONNXFUSE_RETURN_IF_ERROR(api.KernelInfo_GetOutputCount(info, &n_out), where);
    if (n_in != program.inputs.size() || n_out != program.outputs.size())
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "input/output count differs from the program").c_str());

    cuda::KernelImage image;
    if (!cuda::read_stored_kernel(api, info, &image, &error))
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + error).c_str());
    int64_t rank = 0, vec = 0, block = 0;
    if (!cuda::int_attr(api, info, "cuda_rank", &rank) || !cuda::int_attr(api, info, "cuda_vec", &vec) ||
        !cuda::int_attr(api, info, "cuda_block", &block) || rank < 1 || vec < 1 || block < 1 || block > 1024)
      return api.CreateStatus(ORT_INVALID_ARGUMENT,
                              (where + "missing or invalid cuda_rank / cuda_vec / cuda_block attributes").c_str());
    *out = new CudaPointwiseKernel{api,
                                   std::move(program),
                                   where,
                                   cuda::StoredKernel(std::move(image)),
                                   static_cast<int>(rank),
                                   static_cast<int>(vec),
                                   static_cast<int>(block),
                                   {},
                                   {},
                                   nullptr};
    return nullptr;
  });
}

// Loop modes of the generated kernel (codegen.py).
constexpr int64_t kModeStrided = 0, kModeLinear = 1, kModeVector = 2;

OrtStatus* run(CudaPointwiseKernel* k, OrtKernelContext* ctx) {
  const OrtApiRef& api = k->api;
  const Program& prog = k->program;
  const std::string& where = k->where;
  const size_t n_in = prog.inputs.size(), n_out = prog.outputs.size();
  std::vector<std::vector<int64_t>> shapes(n_in);
  std::vector<const unsigned char*> in_ptr(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    const OrtValue* value = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetInput(ctx, i, &value), where);
    if (value == nullptr)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "input " + std::to_string(i) + " is missing").c_str());
    OrtTensorTypeAndShapeInfo* ti = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.GetTensorTypeAndShape(value, &ti), where);
    ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    size_t r = 0;
    OrtStatus* st = api.GetTensorElementType(ti, &et);
    if (!st) st = api.GetDimensionsCount(ti, &r);
    if (!st) {
      shapes[i].resize(r);
      st = api.GetDimensions(ti, shapes[i].data(), r);
    }
    api.ReleaseTensorTypeAndShapeInfo(ti);
    if (st) return with_context(api, st, where);
    if (et != dtype_to_onnx(prog.inputs[i].dtype)) {
      std::string msg = where + "input " + std::to_string(i) + " has element type " + std::to_string(et) +
                        ", the program reads " + dtype_name(prog.inputs[i].dtype);
      return api.CreateStatus(ORT_INVALID_ARGUMENT, msg.c_str());
    }
    void* data = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(const_cast<OrtValue*>(value), &data), where);
    in_ptr[i] = static_cast<const unsigned char*>(data);
  }

  std::string error;
  std::shared_ptr<const IterPlan> plan_ref;
  {
    std::lock_guard<std::mutex> lock(k->plan_mu);
    if (k->plan != nullptr && k->plan_shapes == shapes) plan_ref = k->plan;
  }
  if (plan_ref == nullptr) {
    auto fresh = std::make_shared<IterPlan>();
    if (!resolve_plan(prog, shapes, fresh.get(), &error))
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + error).c_str());
    plan_ref = fresh;
    std::lock_guard<std::mutex> lock(k->plan_mu);
    k->plan_shapes = shapes;
    k->plan = plan_ref;
  }
  const IterPlan& plan = *plan_ref;

  std::vector<unsigned char*> out_ptr(n_out, nullptr);
  for (size_t o = 0; o < n_out; ++o) {
    OrtValue* value = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(
        api.KernelContext_GetOutput(ctx, o, plan.out_shape.data(), plan.out_shape.size(), &value), where);
    if (value == nullptr) continue;  // not materialized: the kernel skips its stores
    void* data = nullptr;
    ONNXFUSE_RETURN_IF_ERROR(api.GetTensorMutableData(value, &data), where);
    out_ptr[o] = static_cast<unsigned char*>(data);
  }
  if (plan.numel == 0) return nullptr;

  const int R = k->rank;
  const int rank = static_cast<int>(plan.shape.size());
  if (rank > R) {
    std::string msg = where + "the inputs need a " + std::to_string(rank) + "-dimensional iteration space, the " +
                      "kernel was generated for " + std::to_string(R) + " (optimize the model again)";
    return api.CreateStatus(ORT_INVALID_ARGUMENT, msg.c_str());
  }
  // Dims padded with leading 1s to the kernel's rank; strides padded with 0.
  std::vector<int64_t> dims(R, 1);
  std::copy(plan.shape.begin(), plan.shape.end(), dims.begin() + (R - rank));
  std::vector<int64_t> dense(R, 1);
  for (int d = R - 2; d >= 0; --d) dense[d] = dense[d + 1] * dims[d + 1];

  int64_t scalar_mask = 0;
  bool linear = true, aligned = true;
  const uintptr_t vec = static_cast<uintptr_t>(k->vec);
  for (size_t i = 0; i < n_in; ++i) {
    const auto& st = plan.inputs[i].strides;
    bool scalar = true, contiguous = true;
    for (int d = 0; d < rank; ++d) {
      const int64_t size = plan.shape[d];
      if (size == 1) continue;
      if (st[d] != 0) scalar = false;
      if (st[d] != dense[R - rank + d]) contiguous = false;
    }
    if (scalar) {
      if (i < 63) scalar_mask |= int64_t{1} << i;
      else linear = false;
      continue;
    }
    if (!contiguous) linear = false;
    const size_t esize = dtype_size(prog.inputs[i].dtype);
    const uintptr_t addr = reinterpret_cast<uintptr_t>(in_ptr[i]) + plan.inputs[i].offset * esize;
    if (addr % (vec * esize) != 0) aligned = false;
  }
  for (size_t o = 0; o < n_out; ++o) {
    const size_t esize = dtype_size(prog.outputs[o].dtype);
    if (reinterpret_cast<uintptr_t>(out_ptr[o]) % (vec * esize) != 0) aligned = false;
  }
  const int64_t mode = !linear ? kModeStrided : (aligned ? kModeVector : kModeLinear);

  // The argument struct of codegen ABI 1, as 8-byte words.
  std::vector<int64_t> words;
  words.reserve(3 + R + n_in * (R + 2) + n_out);
  words.push_back(plan.numel);
  words.push_back(mode);
  words.push_back(linear ? scalar_mask : 0);
  words.insert(words.end(), dims.begin(), dims.end());
  for (size_t i = 0; i < n_in; ++i) {
    for (int d = 0; d < R - rank; ++d) words.push_back(0);
    words.insert(words.end(), plan.inputs[i].strides.begin(), plan.inputs[i].strides.end());
  }
  for (size_t i = 0; i < n_in; ++i) words.push_back(plan.inputs[i].offset);
  for (size_t i = 0; i < n_in; ++i) words.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(in_ptr[i])));
  for (size_t o = 0; o < n_out; ++o) words.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(out_ptr[o])));

  void* stream = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetGPUComputeStream(ctx, &stream), where);
  auto cu_stream = static_cast<cuda::CUstream>(stream);
  cuda::DeviceInfo device;
  if (!k->kernel.prepare(cu_stream, &device, &error)) return api.CreateStatus(ORT_FAIL, (where + error).c_str());
  const int64_t work = mode == kModeVector ? std::max<int64_t>(1, plan.numel / k->vec) : plan.numel;
  // A grid-stride loop: enough blocks to fill the device a few times over, no more.
  const int64_t max_blocks = std::max(1, device.sm_count) * int64_t{16};
  const int64_t blocks = std::min<int64_t>((work + k->block - 1) / k->block, max_blocks);
  cuda::Dim3 grid, block;
  grid.x = static_cast<unsigned int>(std::max<int64_t>(1, blocks));
  block.x = static_cast<unsigned int>(k->block);
  void* params[] = {words.data()};
  if (!k->kernel.launch(cu_stream, grid, block, 0, params, &error))
    return api.CreateStatus(ORT_FAIL, (where + error).c_str());
  return nullptr;
}

ONNXFUSE_REGISTER_FUSED_OP(Pointwise, kCudaProvider, CudaPointwiseKernel, create_kernel,
                           compute_entry<CudaPointwiseKernel, run>);

}  // namespace
}  // namespace onnxfuse
