// Small helpers every kernel file uses: error context on onnxruntime statuses, node names,
// reading an input, the CPU's instruction set.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "fused_ops.h"
#include "ort_api.h"
#include "registry.h"

namespace onnxfuse {

// A failed status from onnxruntime, returned with our context prepended to its message.
inline OrtStatus* with_context(const OrtApiRef& api, OrtStatus* st, const std::string& context) {
  std::string msg = context + api.GetErrorMessage(st);
  OrtErrorCode code = api.GetErrorCode(st);
  api.ReleaseStatus(st);
  return api.CreateStatus(code, msg.c_str());
}

}  // namespace onnxfuse

// Returns from the calling function (which has an OrtApiRef named `api`) when `call` fails.
#define ONNXFUSE_RETURN_IF_ERROR(call, context)                                  \
  do {                                                                           \
    if (OrtStatus* st_ = (call)) return ::onnxfuse::with_context(api, st_, context); \
  } while (0)

namespace onnxfuse {

// Runs a kernel's create or compute body, turning a C++ exception into a failed status: "out of
// memory", or the exception's message, after `where` (which names the op and node). Nothing may
// unwind into onnxruntime.
template <typename Body>
OrtStatus* guarded(const OrtApiRef& api, const std::string& where, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return api.CreateStatus(ORT_FAIL, (where + "out of memory").c_str());
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_FAIL, (where + e.what()).c_str());
  }
}

// The node's name, as the kernel info reports it.
inline OrtStatus* read_node_name(const OrtApiRef& api, const OrtKernelInfo* info, std::string* name) {
  size_t size = 0;
  if (OrtStatus* st = api.KernelInfo_GetNodeName(info, nullptr, &size)) return st;
  name->assign(size, '\0');
  if (OrtStatus* st = api.KernelInfo_GetNodeName(info, name->data(), &size)) return st;
  name->resize(std::strlen(name->c_str()));
  return nullptr;
}

// The body of a kernel's create entry point for op `op` (`note` is " (CUDA)" for a CUDA kernel,
// "" otherwise): reads the node's name and runs make(api, name, where) guarded, where
// "onnxfuse OP node 'NAME' (CUDA): " is the prefix of every message about the node.
template <typename Make>
OrtStatus* create_guarded(const OrtApi* raw, const OrtKernelInfo* info, const char* op, const char* note,
                          Make&& make) noexcept {
  OrtApiRef api(raw);
  const std::string context = std::string("onnxfuse ") + op + note + ": ";
  return guarded(api, context, [&]() -> OrtStatus* {
    std::string name;
    ONNXFUSE_RETURN_IF_ERROR(read_node_name(api, info, &name), context);
    return make(api, name, std::string("onnxfuse ") + op + " node '" + name + "'" + note + ": ");
  });
}

}  // namespace onnxfuse

namespace onnxfuse {

// A new kernel of type K (members api, node_name, where) for node `name`, `where` the prefix of
// every message about it (create_guarded's).
template <typename K>
std::unique_ptr<K> new_kernel(const OrtApiRef& api, const std::string& name, const std::string& where) {
  auto kernel = std::make_unique<K>();
  kernel->api = api;
  kernel->node_name = name;
  kernel->where = where;
  return kernel;
}

// A shape as error messages print it: [2, 32, 384].
inline std::string dims_text(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Element type, dimensions and data of input i. A missing optional input gives an empty shape,
// null data and, when `present` is given, *present = false.
inline OrtStatus* read_input(const OrtApiRef& api, OrtKernelContext* ctx, size_t i, std::vector<int64_t>* shape,
                             ONNXTensorElementDataType* type, const void** data, bool* present = nullptr) {
  const OrtValue* value = nullptr;
  if (OrtStatus* st = api.KernelContext_GetInput(ctx, i, &value)) return st;
  shape->clear();
  *data = nullptr;
  if (present != nullptr) *present = value != nullptr;
  if (value == nullptr) return nullptr;
  OrtTensorTypeAndShapeInfo* ti = nullptr;
  if (OrtStatus* st = api.GetTensorTypeAndShape(value, &ti)) return st;
  size_t rank = 0;
  OrtStatus* st = api.GetTensorElementType(ti, type);
  if (!st) st = api.GetDimensionsCount(ti, &rank);
  if (!st) {
    shape->resize(rank);
    st = api.GetDimensions(ti, shape->data(), rank);
  }
  api.ReleaseTensorTypeAndShapeInfo(ti);
  if (st) return st;
  void* ptr = nullptr;
  if (OrtStatus* s = api.GetTensorMutableData(const_cast<OrtValue*>(value), &ptr)) return s;
  *data = ptr;
  return nullptr;
}

// Whether the AVX2 + FMA builds of the CPU kernels run here: the CPU has both and
// ONNXFUSE_NO_AVX2 is unset (it forces the baseline builds, for tests and comparisons).
inline bool use_avx2_fma() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && std::getenv("ONNXFUSE_NO_AVX2") == nullptr;
#else
  return false;
#endif
}

// Execution providers, as arrays: a template argument of fused_op. Op names and signatures come
// from fused_ops.h (generated from onnxfuse/ops).
inline constexpr char kCpuProvider[] = "CPUExecutionProvider";
inline constexpr char kCudaProvider[] = "CUDAExecutionProvider";

using CreateKernelFn = decltype(OrtCustomOp::CreateKernelV2);
using ComputeKernelFn = decltype(OrtCustomOp::KernelComputeV2);

// The compute entry point of a kernel type K (with members `api` and `where`): Run(kernel, ctx),
// guarded.
template <typename K, OrtStatus* (*Run)(K*, OrtKernelContext*)>
OrtStatus* compute_entry(void* kernel, OrtKernelContext* ctx) noexcept {
  K* k = static_cast<K*>(kernel);
  return guarded(k->api, k->where, [&]() { return Run(k, ctx); });
}

// The side of a signature a port is on: variadic, or required up to `required`, optional after.
inline OrtCustomOpInputOutputCharacteristic port_characteristic(size_t i, int required, int variadic) {
  if (variadic > 0) return INPUT_OUTPUT_VARIADIC;
  return i < static_cast<size_t>(required) ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

// The OrtCustomOp of fused op Op (fused_ops.h, generated from onnxfuse/ops) on one provider, its
// kernel type K created by `create`, run by `compute` and deleted by KernelDestroy, inputs in
// default memory. Its name and signature are the table's: every registration goes through here,
// so the registrations of one name share one schema (as onnxruntime requires) and agree with the
// ops' modules. Homogeneous ops take float32 tensors; the others (Pointwise) any element type.
template <const FusedOpSignature& Op, const char* Provider, typename K>
OrtCustomOp fused_op(CreateKernelFn create, ComputeKernelFn compute) {
  static_assert(Op.cpu || Provider != kCpuProvider, "the ops table registers no CPU kernel of this op");
  static_assert(Op.cuda || Provider != kCudaProvider, "the ops table registers no CUDA kernel of this op");
  static_assert(Op.variadic_inputs == 0 || Op.inputs == 1, "a variadic side has one port");
  static_assert(Op.variadic_outputs == 0 || Op.outputs == 1, "a variadic side has one port");
  constexpr ONNXTensorElementDataType T =
      Op.homogeneous ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = kOrtApiVersion;
  op.GetName = [](const OrtCustomOp*) { return Op.name; };
  op.GetExecutionProviderType = [](const OrtCustomOp*) { return static_cast<const char*>(Provider); };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op.KernelDestroy = [](void* kernel) { delete static_cast<K*>(kernel); };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  op.GetInputType = [](const OrtCustomOp*, size_t) { return T; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return Op.inputs; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return T; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return Op.outputs; };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
    return port_characteristic(i, Op.required_inputs, Op.variadic_inputs);
  };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t i) {
    return port_characteristic(i, Op.required_outputs, Op.variadic_outputs);
  };
  if (Op.variadic_inputs > 0) {
    op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return Op.variadic_inputs; };
    op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return Op.homogeneous ? 1 : 0; };
  }
  if (Op.variadic_outputs > 0) {
    op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return Op.variadic_outputs; };
    op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return Op.homogeneous ? 1 : 0; };
  }
  return op;
}

}  // namespace onnxfuse

// Defines the OrtCustomOp of fused op Op (fused_ops::NAME) on Provider with kernel type K and
// registers it when the library is loaded: the one registration statement of a kernel file.
// The compute entry point is the last argument (it may hold commas: compute_entry<K, run>).
#define ONNXFUSE_REGISTER_FUSED_OP(Op, Provider, K, create, ...)                                     \
  const OrtCustomOp ONNXFUSE_CONCAT(onnxfuse_fused_op_, __LINE__) =                                \
      ::onnxfuse::fused_op<::onnxfuse::fused_ops::Op, Provider, K>(create, __VA_ARGS__);          \
  ONNXFUSE_REGISTER_OP(ONNXFUSE_CONCAT(onnxfuse_fused_op_, __LINE__))
