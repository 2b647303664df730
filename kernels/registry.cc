// RegisterCustomOps: the library's one exported entry point, called by onnxruntime from
// SessionOptions.register_custom_ops_library.
#include "registry.h"

#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_driver.h"
#include "kernel_util.h"

#ifndef ONNXFUSE_VERSION
#define ONNXFUSE_VERSION "unknown"
#endif

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

namespace {

using CreateKernelFn = decltype(OrtCustomOp::CreateKernelV2);

// The kernel-creating function of each op as the kernel file registered it, by the address of the
// copy onnxruntime is handed (versioned_ops). Written once, under RegisterCustomOps' lock,
// before any session can create a kernel; read-only after.
std::unordered_map<const OrtCustomOp*, CreateKernelFn>& original_create() {
  static std::unordered_map<const OrtCustomOp*, CreateKernelFn> table;
  return table;
}

std::string node_name(const OrtApiRef& api, const OrtKernelInfo* info) {
  std::string name;
  size_t size = 0;
  if (api.KernelInfo_GetNodeName(info, nullptr, &size) == nullptr && size > 0) {
    name.resize(size);
    if (api.KernelInfo_GetNodeName(info, &name[0], &size) != nullptr) name.clear();
    while (!name.empty() && name.back() == '\0') name.pop_back();
  }
  return name;
}

// Every fused node carries the op set it was written for (attribute kOpsetAttribute; absent on
// models written before it existed, which are op set 1). onnxruntime cannot tell: it builds one
// schema per op name and binds any op set of the domain to it, so a model from a newer onnxfuse
// would run an older kernel that may read its attributes differently. It is refused here, with
// one message, before any kernel is built.
OrtStatus* create_checked(const OrtCustomOp* op, const OrtApi* raw, const OrtKernelInfo* info, void** kernel) {
  *kernel = nullptr;
  OrtApiRef api(raw);
  int64_t opset = 1;
  if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, kOpsetAttribute, &opset)) {
    api.ReleaseStatus(st);  // absent: op set 1
    opset = 1;
  }
  if (opset < 1 || opset > kOpset) {
    std::string msg = std::string("onnxfuse: node '") + node_name(api, info) + "' (" + op->GetName(op) +
                      ") was written for onnxfuse op set " + std::to_string(opset) +
                      ", but this library implements op set " + std::to_string(kOpset) + " (onnxfuse " +
                      ONNXFUSE_VERSION + "): upgrade onnxfuse, or run the model without registering the "
                      "library (its fallback functions then run)";
    return api.CreateStatus(ORT_INVALID_GRAPH, msg.c_str());
  }
  return original_create().at(op)(op, raw, info, kernel);
}

// The registered ops, each copied with its kernel creation going through create_checked.
// Built once: onnxruntime keeps the pointers for the life of the process.
const std::vector<const OrtCustomOp*>& versioned_ops() {
  static std::deque<OrtCustomOp> storage;
  static std::vector<const OrtCustomOp*> ops;
  if (!ops.empty()) return ops;
  size_t count = 0;
  const OrtCustomOp* const* base = registered_ops(&count);
  for (size_t i = 0; i < count; ++i) {
    storage.push_back(*base[i]);
    OrtCustomOp& checked = storage.back();
    original_create()[&checked] = base[i]->CreateKernelV2;
    checked.CreateKernelV2 = create_checked;
    ops.push_back(&checked);
  }
  return ops;
}

std::string json_text(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
    out += c;
  }
  return out + "\"";
}

// A JSON list with item(op) for each registered op.
template <typename Item>
std::string registered_json(Item item) {
  size_t count = 0;
  const OrtCustomOp* const* ops = registered_ops(&count);
  std::string out = "[";
  for (size_t i = 0; i < count; ++i) out += (i ? ", " : "") + item(ops[i]);
  return out + "]";
}

// [op type, execution provider]
std::string op_json(const OrtCustomOp* op) {
  return "[" + json_text(op->GetName(op)) + ", " + json_text(op->GetExecutionProviderType(op)) + "]";
}

// One side of a registered op's schema as onnxfuse/ops declares it (FusedOp.signature): [ports,
// required ports, variadic minimum arity or 0, homogeneous].
std::string side_json(const OrtCustomOp* op, bool inputs) {
  const size_t ports = inputs ? op->GetInputTypeCount(op) : op->GetOutputTypeCount(op);
  size_t required = 0;
  bool variadic = false;
  for (size_t i = 0; i < ports; ++i) {
    const OrtCustomOpInputOutputCharacteristic c =
        inputs ? op->GetInputCharacteristic(op, i) : op->GetOutputCharacteristic(op, i);
    if (c == INPUT_OUTPUT_REQUIRED) ++required;
    if (c == INPUT_OUTPUT_VARIADIC) variadic = true;
  }
  int min_arity = 0, homogeneous = 1;
  if (variadic) {
    ++required;
    min_arity = inputs ? op->GetVariadicInputMinArity(op) : op->GetVariadicOutputMinArity(op);
    homogeneous = inputs ? op->GetVariadicInputHomogeneity(op) : op->GetVariadicOutputHomogeneity(op);
  }
  return "[" + std::to_string(ports) + ", " + std::to_string(required) + ", " + std::to_string(min_arity) + ", " +
         std::to_string(homogeneous) + "]";
}

// [op type, execution provider, inputs, outputs]: what tests hold against onnxfuse.ops' table,
// so that the Python side and the kernels cannot disagree.
std::string signature_json(const OrtCustomOp* op) {
  return "[" + json_text(op->GetName(op)) + ", " + json_text(op->GetExecutionProviderType(op)) + ", " +
         side_json(op, true) + ", " + side_json(op, false) + "]";
}

}  // namespace

}  // namespace onnxfuse

// What this build of the library is and what it finds on this machine, as one JSON object, for
// `onnxfuse info` (read through ctypes; onnxruntime never calls it).
extern "C" __attribute__((visibility("default"))) const char* OnnxfuseLibraryInfo() {
  using namespace onnxfuse;
  static std::mutex mu;
  static std::string text;
  std::lock_guard<std::mutex> lock(mu);
  if (text.empty()) {
    std::string cuda_error;
    const bool driver_found = cuda::driver(&cuda_error) != nullptr;
#if defined(__x86_64__)
    const bool avx2_built = true;  // the AVX2 + FMA kernels are compiled in on x86-64 (target attributes)
#else
    const bool avx2_built = false;
#endif
    size_t count = 0;
    registered_ops(&count);
    text = std::string("{\"version\": ") + json_text(ONNXFUSE_VERSION) + ", \"opset\": " + std::to_string(kOpset) +
           ", \"ort_api_version\": " + std::to_string(kOrtApiVersion) + ", \"compiler\": " +
#if defined(__VERSION__)
           json_text(std::string("gcc-compatible ") + __VERSION__) +
#else
           json_text("unknown") +
#endif
           ", \"kernels\": " + std::to_string(count) + ", \"ops\": " + registered_json(op_json) +
           ", \"signatures\": " + registered_json(signature_json) +
           ", \"avx2_fma_kernels\": " + (avx2_built ? "true" : "false") +
           ", \"avx2_fma_used\": " + (use_avx2_fma() ? "true" : "false") +
           ", \"cuda_kernels\": true, \"cuda_driver_found\": " + (driver_found ? "true" : "false") +
           ", \"cuda_driver_error\": " + (driver_found ? std::string("null") : json_text(cuda_error)) + "}";
  }
  return text.c_str();
}

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
      const std::vector<const OrtCustomOp*>& ops = versioned_ops();
      for (size_t i = 0; i < ops.size(); ++i) {
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
