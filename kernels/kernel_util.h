// Small helpers every kernel file uses: error context on onnxruntime statuses, node names,
// reading an input, the CPU's instruction set.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "fused_ops.h"
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

// Execution providers, as arrays: a template argument of custom_op. Op names come from
// fused_ops.h (generated from onnxfuse/ops).
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

// What every op of this library declares alike: its name and execution provider, inputs in
// default memory, and its kernel type K (created by `create`, run by `compute`, deleted by
// KernelDestroy). The caller adds the signature (types, counts, characteristics).
template <const char* Name, const char* Provider, typename K>
OrtCustomOp custom_op(CreateKernelFn create, ComputeKernelFn compute) {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = kOrtApiVersion;
  op.GetName = [](const OrtCustomOp*) { return static_cast<const char*>(Name); };
  op.GetExecutionProviderType = [](const OrtCustomOp*) { return static_cast<const char*>(Provider); };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op.KernelDestroy = [](void* kernel) { delete static_cast<K*>(kernel); };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  return op;
}

// An op whose inputs are variadic: at least MinInputs, all of element type T when Homogeneous
// (T UNDEFINED: any type). Its outputs are one of type T (MinOutputs 0), or variadic like the
// inputs, at least MinOutputs. onnxruntime requires every provider's registration of one op name
// to declare the same schema, so the CPU and CUDA kernels of an op build it from here.
template <const char* Name, const char* Provider, typename K, ONNXTensorElementDataType T, int MinInputs,
          int Homogeneous, int MinOutputs>
OrtCustomOp variadic_op(CreateKernelFn create, ComputeKernelFn compute) {
  OrtCustomOp op = custom_op<Name, Provider, K>(create, compute);
  op.GetInputType = [](const OrtCustomOp*, size_t) { return T; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return T; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) {
    return MinOutputs > 0 ? INPUT_OUTPUT_VARIADIC : INPUT_OUTPUT_REQUIRED;
  };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return MinInputs; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return Homogeneous; };
  if (MinOutputs > 0) {
    op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return MinOutputs; };
    op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return Homogeneous; };
  }
  return op;
}

// The OrtCustomOp of fused op Op (a struct of fused_ops.h, generated from onnxfuse/ops) for one
// provider: its name and its signature as the op's module declares it. Every registration goes
// through here, so the registrations of one name share one schema and agree with the table.
// Homogeneous ops take float32 tensors; the others (Pointwise) any element type.
template <typename Op, const char* Provider, typename K>
OrtCustomOp fused_op(CreateKernelFn create, ComputeKernelFn compute) {
  constexpr ONNXTensorElementDataType T =
      Op::kHomogeneous ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  static_assert(Op::kCpu || Provider != kCpuProvider, "the ops table registers no CPU kernel of this op");
  static_assert(Op::kCuda || Provider != kCudaProvider, "the ops table registers no CUDA kernel of this op");
  if constexpr (Op::kVariadicMinInputs > 0) {
    static_assert(Op::kInputs == 1 && (Op::kVariadicMinOutputs > 0 || Op::kOutputs == 1), "variadic signature");
    return variadic_op<Op::kName, Provider, K, T, Op::kVariadicMinInputs, Op::kHomogeneous, Op::kVariadicMinOutputs>(
        create, compute);
  } else {
    static_assert(Op::kVariadicMinOutputs == 0, "variadic outputs need variadic inputs");
    OrtCustomOp op = custom_op<Op::kName, Provider, K>(create, compute);
    op.GetInputType = [](const OrtCustomOp*, size_t) { return T; };
    op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return Op::kInputs; };
    op.GetOutputType = [](const OrtCustomOp*, size_t) { return T; };
    op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return Op::kOutputs; };
    op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i < static_cast<size_t>(Op::kRequiredInputs) ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
    op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i < static_cast<size_t>(Op::kRequiredOutputs) ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
    return op;
  }
}

}  // namespace onnxfuse
