// RegisterCustomOps: the library's one exported entry point, called by onnxruntime from
// SessionOptions.register_custom_ops_library.
#include "registry.h"

#include <cstring>
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
  record_runtime_api_version(api_base);
  // Which kernels a session gets. An op registered for any provider stops onnxruntime from
  // running that node's fallback function on every other provider ("could not find an
  // implementation"), so a session gets only the kernels of the providers it asks for:
  // onnxfuse.runtime sets the config entry `onnxfuse.providers` to "cuda" for CUDA sessions;
  // without it, a session gets the CPU kernels alone.
  bool with_cuda = false;
  int has_entry = 0;
  if (OrtStatus* st = api.HasSessionConfigEntry(options, kProvidersConfigKey, &has_entry)) return st;
  if (has_entry) {
    char value[64] = {0};
    size_t size = sizeof(value);
    if (OrtStatus* st = api.GetSessionConfigEntry(options, kProvidersConfigKey, value, &size)) return st;
    with_cuda = std::strstr(value, "cuda") != nullptr;
  }
  // onnxruntime keeps a pointer to the domain for the lifetime of every session that uses these
  // options and never frees it; one domain per provider set, shared by all registrations,
  // bounds what we keep.
  static std::mutex mu;
  static OrtCustomOpDomain* domains[2] = {nullptr, nullptr};
  std::lock_guard<std::mutex> lock(mu);
  OrtCustomOpDomain*& domain = domains[with_cuda ? 1 : 0];
  try {
    if (domain == nullptr) {
      OrtCustomOpDomain* created = nullptr;
      if (OrtStatus* st = api.CreateCustomOpDomain(kDomain, &created)) return st;
      size_t count = 0;
      const OrtCustomOp* const* ops = registered_ops(&count);
      for (size_t i = 0; i < count; ++i) {
        const char* provider = ops[i]->GetExecutionProviderType(ops[i]);
        const bool is_cpu = provider == nullptr || std::strcmp(provider, "CPUExecutionProvider") == 0;
        if (!is_cpu && !with_cuda) continue;
        if (OrtStatus* st = api.CustomOpDomain_Add(created, ops[i])) return st;
      }
      domain = created;
    }
    return api.AddCustomOpDomain(options, domain);
  } catch (const std::bad_alloc&) {
    return api.CreateStatus(ORT_FAIL, "onnxfuse: out of memory while registering custom ops");
  }
}
