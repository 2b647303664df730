// The ops this library registers in the `onnxfuse` domain.
//
// Each kernel file defines its OrtCustomOp instances and adds them with ONNXFUSE_REGISTER_OP at
// static-initialization time; RegisterCustomOps (registry.cc) hands all of them to onnxruntime.
// This keeps kernel files independent: a CUDA-EP kernel lives in its own kernels/cuda_*.cc and
// registers itself the same way, without editing any other file.
//
// One op name may be registered once per execution provider (GetExecutionProviderType). All
// registrations of a name must agree on the schema: same input/output counts, characteristics,
// variadic min arity and homogeneity (onnxruntime builds one schema per name and rejects
// mismatches); only the execution provider and element types may differ.
#pragma once

#include "ort_api.h"

namespace onnxfuse {

// The custom-op domain of every op in this library (onnxfuse/fused.py: DOMAIN).
constexpr const char* kDomain = "onnxfuse";

// The op set of the `onnxfuse` domain this library implements (onnxfuse/fused.py:
// DOMAIN_VERSION). An op whose meaning changes gets a new op set. Every fused node records the
// op set it was written for in the attribute kOpsetAttribute (fused.py: OPSET_ATTRIBUTE), and
// this library refuses nodes of a newer one with one message (registry.cc) instead of running
// them as the older op.
constexpr int kOpset = 1;
constexpr const char* kOpsetAttribute = "onnxfuse_opset";

// Session config entry naming the providers whose kernels a session gets ("cpu" or "cuda";
// onnxfuse/runtime.py: PROVIDERS_CONFIG_KEY). Absent: CPU kernels only.
constexpr const char* kProvidersConfigKey = "onnxfuse.providers";

// Adds an op to the set registered with every session. `op` must live as long as the library.
void register_op(const OrtCustomOp* op);

// Ops added so far, in registration order.
const OrtCustomOp* const* registered_ops(size_t* count);

struct OpRegistrar {
  explicit OpRegistrar(const OrtCustomOp* op) { register_op(op); }
};

}  // namespace onnxfuse

#define ONNXFUSE_CONCAT_INNER(a, b) a##b
#define ONNXFUSE_CONCAT(a, b) ONNXFUSE_CONCAT_INNER(a, b)
// Registers an OrtCustomOp object (by reference) when the library is loaded.
#define ONNXFUSE_REGISTER_OP(op) \
  static ::onnxfuse::OpRegistrar ONNXFUSE_CONCAT(onnxfuse_registrar_, __LINE__)(&(op))
