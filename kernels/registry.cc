// RegisterCustomOps: the library's one exported entry point, called by onnxruntime from
// SessionOptions.register_custom_ops_library.
#include "registry.h"

#include <mutex>
#include <new>
#include <string>
#include <vector>

namespace onnxfuse {
namespace {

std::vector<const OrtCustomOp*>& op_list() {
  static std::vector<const OrtCustomOp*> ops;  // function-local: safe during static initialization
  return ops;
}

}  // namespace

void register_op(const OrtCustomOp* op) { op_list().push_back(op); }

const OrtCustomOp* const* registered_ops(size_t* count) {
  *count = op_list().size();
  return op_list().data();
}

}  // namespace onnxfuse

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                            const OrtApiBase* api_base) {
  using namespace onnxfuse;
  const OrtApi* raw = api_base->GetApi(kOrtApiVersion);
  if (raw == nullptr) {
    // CreateStatus is slot 0 of every API version, so an older runtime still gets a clear message.
    OrtApiRef oldest(api_base->GetApi(1));
    std::string msg = std::string("onnxfuse custom ops need onnxruntime >= 1.17 (C API version ") +
                      std::to_string(kOrtApiVersion) + "); this onnxruntime is " + api_base->GetVersionString();
    return oldest ? oldest.CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  OrtApiRef api(raw);
  // onnxruntime keeps a pointer to the domain for the lifetime of every session that uses these
  // options and never frees it; one domain shared by all registrations bounds what we keep.
  static std::mutex mu;
  static OrtCustomOpDomain* domain = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  try {
    if (domain == nullptr) {
      OrtCustomOpDomain* created = nullptr;
      if (OrtStatus* st = api.CreateCustomOpDomain(kDomain, &created)) return st;
      size_t count = 0;
      const OrtCustomOp* const* ops = registered_ops(&count);
      for (size_t i = 0; i < count; ++i) {
        if (OrtStatus* st = api.CustomOpDomain_Add(created, ops[i])) return st;
      }
      domain = created;
    }
    return api.AddCustomOpDomain(options, domain);
  } catch (const std::bad_alloc&) {
    return api.CreateStatus(ORT_FAIL, "onnxfuse: out of memory while registering custom ops");
  }
}
