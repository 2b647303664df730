// The floor of onnxruntime's custom-op path, for bench/pointwise_overhead.py: op
// onnxfuse.bench::OutputOnly gets its one output (shape [rows, cols] from its int attributes)
// and returns without reading its input or writing anything. A Pointwise call costs this much
// before it does any work of its own. Built by the benchmark (g++), never part of the package.
#include <new>

#include "kernel_util.h"

namespace {

using onnxfuse::OrtApiRef;

struct OutputOnlyKernel {
  OrtApiRef api;
  int64_t dims[2];
};

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* raw, const OrtKernelInfo* info, void** out) noexcept {
  OrtApiRef api(raw);
  auto* k = new (std::nothrow) OutputOnlyKernel{api, {1, 1}};
  if (k == nullptr) return api.CreateStatus(ORT_FAIL, "OutputOnly: out of memory");
  const char* names[2] = {"rows", "cols"};
  for (int d = 0; d < 2; ++d) {
    if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, names[d], &k->dims[d])) {
      delete k;
      return st;
    }
  }
  *out = k;
  return nullptr;
}

OrtStatus* compute(void* kernel, OrtKernelContext* ctx) noexcept {
  auto* k = static_cast<OutputOnlyKernel*>(kernel);
  OrtValue* out = nullptr;
  return k->api.KernelContext_GetOutput(ctx, 0, k->dims, 2, &out);
}

// The schema the library's fused ops use (variadic float32 inputs, one float32 output), so that
// the floor takes the path their calls take.
constexpr onnxfuse::FusedOpSignature kOutputOnlyOp{"OutputOnly", 1, 1, 1, 1, 1, 0, true, true, false};
const OrtCustomOp kOutputOnly =
    onnxfuse::fused_op<kOutputOnlyOp, onnxfuse::kCpuProvider, OutputOnlyKernel>(create_kernel, compute);

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                            const OrtApiBase* base) {
  OrtApiRef api(base->GetApi(onnxfuse::kOrtApiVersion));
  // onnxruntime keeps the domain for as long as any session uses it: one per process.
  static OrtCustomOpDomain* domain = nullptr;
  if (domain == nullptr) {
    OrtCustomOpDomain* created = nullptr;
    if (OrtStatus* st = api.CreateCustomOpDomain("onnxfuse.bench", &created)) return st;
    if (OrtStatus* st = api.CustomOpDomain_Add(created, &kOutputOnly)) return st;
    domain = created;
  }
  return api.AddCustomOpDomain(options, domain);
}
