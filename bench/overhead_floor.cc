// The floor of onnxruntime's custom-op path, for bench/pointwise_overhead.py: op
// onnxfuse.bench::OutputOnly gets its one output (shape [rows, cols] from its int attributes)
// and returns without reading its input or writing anything. A Pointwise call costs this much
// before it does any work of its own. Built by the benchmark (g++), never part of the package.
#include <cstring>
#include <new>

#include "ort_api.h"

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

void destroy_kernel(void* kernel) { delete static_cast<OutputOnlyKernel*>(kernel); }
const char* op_name(const OrtCustomOp*) { return "OutputOnly"; }
const char* cpu_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
ONNXTensorElementDataType float_type(const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
size_t one(const OrtCustomOp*) { return 1; }
OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; }
OrtMemType default_memory(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int one_int(const OrtCustomOp*) { return 1; }
int zero_int(const OrtCustomOp*) { return 0; }

OrtCustomOp make_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = onnxfuse::kOrtApiVersion;
  op.GetName = op_name;
  op.GetExecutionProviderType = cpu_provider;
  op.GetInputType = float_type;
  op.GetInputTypeCount = one;
  op.GetOutputType = float_type;
  op.GetOutputTypeCount = one;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = required;
  op.GetOutputCharacteristic = required;
  op.GetInputMemoryType = default_memory;
  op.GetVariadicInputMinArity = one_int;
  op.GetVariadicInputHomogeneity = zero_int;
  op.GetVariadicOutputMinArity = one_int;
  op.GetVariadicOutputHomogeneity = zero_int;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  return op;
}

const OrtCustomOp kOutputOnly = make_op();

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
