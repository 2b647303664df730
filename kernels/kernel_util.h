// Small helpers every kernel file uses: error context on onnxruntime statuses, node names,
// reading an input, the CPU's instruction set.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ort_api.h"

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

// The node's name, as the kernel info reports it.
inline OrtStatus* read_node_name(const OrtApiRef& api, const OrtKernelInfo* info, std::string* name) {
  size_t size = 0;
  if (OrtStatus* st = api.KernelInfo_GetNodeName(info, nullptr, &size)) return st;
  name->assign(size, '\0');
  if (OrtStatus* st = api.KernelInfo_GetNodeName(info, name->data(), &size)) return st;
  name->resize(std::strlen(name->c_str()));
  return nullptr;
}

}  // namespace onnxfuse

namespace onnxfuse {

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

// The schema of a fused op whose inputs are variadic, homogeneous float32 tensors (at least
// Schema::kMinInputs) and whose one output is float32 (Attention, StackedMLP). onnxruntime
// requires every provider's registration of one op name to declare the same schema, so the CPU
// and CUDA kernels of an op build it from here. Schema supplies kName, kProvider, kMinInputs and
// the kernel's create / compute / destroy.
template <typename Schema>
OrtCustomOp make_float_variadic_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = kOrtApiVersion;
  op.GetName = [](const OrtCustomOp*) { return Schema::kName; };
  op.GetExecutionProviderType = [](const OrtCustomOp*) { return Schema::kProvider; };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.KernelDestroy = Schema::destroy;
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return Schema::kMinInputs; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.CreateKernelV2 = Schema::create;
  op.KernelComputeV2 = Schema::compute;
  return op;
}

}  // namespace onnxfuse
