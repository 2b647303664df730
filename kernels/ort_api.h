// The parts of the ONNX Runtime C API this library uses, declared here once.
//
// onnxruntime ships no C headers in its Python wheels, and the library must build with g++
// alone, so we declare what we call ourselves. The facts below come from the public header
// include/onnxruntime/core/session/onnxruntime_c_api.h (read, not copied):
//
//  * OrtGetApiBase()->GetApi(version) returns an OrtApi: an append-only table of function
//    pointers. A slot's index never changes once released, so we treat the table as an array of
//    untyped slots and name only the indices we call, each with its exact C signature.
//  * OrtCustomOp is a struct led by a uint32 version followed by function pointers in a fixed
//    order; onnxruntime reads only the fields that exist at the op's declared version.
//
// Every slot in OrtApiSlot that the CPU kernel calls is exercised through a real onnxruntime
// session by tests/test_runtime.py and tests/test_pointwise_cpu.py, so a wrong index cannot pass
// unnoticed. Slots only a CUDA kernel calls are marked so; their tests live with that kernel.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

extern "C" {

// Opaque handles (never dereferenced here).
struct OrtApi;
struct OrtStatus;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtShapeInferContext;

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version) noexcept;
  const char* (*GetVersionString)() noexcept;
};

enum OrtErrorCode {
  ORT_OK = 0,
  ORT_FAIL = 1,
  ORT_INVALID_ARGUMENT = 2,
  ORT_NO_SUCHFILE = 3,
  ORT_NO_MODEL = 4,
  ORT_ENGINE_ERROR = 5,
  ORT_RUNTIME_EXCEPTION = 6,
  ORT_INVALID_PROTOBUF = 7,
  ORT_MODEL_LOADED = 8,
  ORT_NOT_IMPLEMENTED = 9,
  ORT_INVALID_GRAPH = 10,
  ORT_EP_FAIL = 11,
};

// TensorProto::DataType values (only the ones the library handles are named).
enum ONNXTensorElementDataType {
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED = 0,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL = 9,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 = 10,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE = 11,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 = 16,
};

enum OrtCustomOpInputOutputCharacteristic {
  INPUT_OUTPUT_REQUIRED = 0,
  INPUT_OUTPUT_OPTIONAL = 1,
  INPUT_OUTPUT_VARIADIC = 2,
};

enum OrtMemType {
  OrtMemTypeCPUInput = -2,
  OrtMemTypeCPUOutput = -1,
  OrtMemTypeDefault = 0,
};

// Field order and types of OrtCustomOp, through the fields of API version 20. onnxruntime reads a
// field only when `version` is at least the version that introduced it, and treats a null
// optional callback as "not provided".
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
  ONNXTensorElementDataType (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  ONNXTensorElementDataType (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* op_kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* op_kernel);
  OrtCustomOpInputOutputCharacteristic (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  OrtCustomOpInputOutputCharacteristic (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  OrtMemType (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  // version >= 16
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* op_kernel, OrtKernelContext* context);
  // version >= 17
  OrtStatus* (*InferOutputShapeFn)(const OrtCustomOp* op, OrtShapeInferContext* ctx);
  int (*GetStartVersion)(const OrtCustomOp* op);
  int (*GetEndVersion)(const OrtCustomOp* op);
  // version >= 18 / 20
  size_t (*GetMayInplace)(int** input_index, int** output_index);
  void (*ReleaseMayInplace)(int* input_index, int* output_index);
  size_t (*GetAliasMap)(int** input_index, int** output_index);
  void (*ReleaseAliasMap)(int* input_index, int* output_index);
};

}  // extern "C"

static_assert(sizeof(void*) == 8, "the slot layout below is for 64-bit platforms");
static_assert(offsetof(OrtCustomOp, CreateKernel) == 8, "OrtCustomOp: version is padded to one slot");
static_assert(offsetof(OrtCustomOp, CreateKernelV2) == 17 * 8, "OrtCustomOp field order");
static_assert(offsetof(OrtCustomOp, GetEndVersion) == 21 * 8, "OrtCustomOp field order");
static_assert(sizeof(OrtCustomOp) == 26 * 8, "OrtCustomOp size through version 20");

namespace onnxfuse {

// The API version we request and declare in OrtCustomOp::version. KernelContext_ParallelFor
// first appeared in version 17 (onnxruntime 1.17); every other slot we use is older.
constexpr uint32_t kOrtApiVersion = 17;

// Indices into the OrtApi function table.
enum class OrtApiSlot : size_t {
  CreateStatus = 0,
  GetErrorCode = 1,
  GetErrorMessage = 2,
  CreateCustomOpDomain = 26,
  CustomOpDomain_Add = 27,
  AddCustomOpDomain = 28,
  GetTensorMutableData = 51,
  GetTensorElementType = 60,
  GetDimensionsCount = 61,
  GetDimensions = 62,
  GetTensorTypeAndShape = 65,
  KernelInfoGetAttribute_float = 85,
  KernelInfoGetAttribute_int64 = 86,
  KernelInfoGetAttribute_string = 87,
  KernelContext_GetInputCount = 88,
  KernelContext_GetOutputCount = 89,
  KernelContext_GetInput = 90,
  KernelContext_GetOutput = 91,
  ReleaseStatus = 93,
  ReleaseTensorTypeAndShapeInfo = 99,
  KernelContext_GetGPUComputeStream = 193,  // CUDA kernels only
  KernelInfo_GetInputCount = 230,
  KernelInfo_GetOutputCount = 231,
  HasSessionConfigEntry = 237,
  GetSessionConfigEntry = 238,
  KernelInfo_GetNodeName = 244,
  KernelContext_ParallelFor = 274,
  // API version 24 (onnxruntime 1.24): call only when runtime_serves_api(24).
  GetTensorElementTypeAndShapeDataReference = 414,
};

// Typed access to the slots we call. Holds the table onnxruntime handed us.
class OrtApiRef {
 public:
  OrtApiRef() = default;
  explicit OrtApiRef(const OrtApi* api) : api_(api) {}
  const OrtApi* raw() const { return api_; }
  explicit operator bool() const { return api_ != nullptr; }

  OrtStatus* CreateStatus(OrtErrorCode code, const char* msg) const {
    return slot<OrtStatus* (*)(OrtErrorCode, const char*)>(OrtApiSlot::CreateStatus)(code, msg);
  }
  OrtErrorCode GetErrorCode(const OrtStatus* status) const {
    return slot<OrtErrorCode (*)(const OrtStatus*)>(OrtApiSlot::GetErrorCode)(status);
  }
  const char* GetErrorMessage(const OrtStatus* status) const {
    return slot<const char* (*)(const OrtStatus*)>(OrtApiSlot::GetErrorMessage)(status);
  }
  void ReleaseStatus(OrtStatus* status) const {
    slot<void (*)(OrtStatus*)>(OrtApiSlot::ReleaseStatus)(status);
  }
  OrtStatus* CreateCustomOpDomain(const char* domain, OrtCustomOpDomain** out) const {
    return slot<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(OrtApiSlot::CreateCustomOpDomain)(domain, out);
  }
  OrtStatus* CustomOpDomain_Add(OrtCustomOpDomain* domain, const OrtCustomOp* op) const {
    return slot<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(OrtApiSlot::CustomOpDomain_Add)(domain, op);
  }
  OrtStatus* AddCustomOpDomain(OrtSessionOptions* options, OrtCustomOpDomain* domain) const {
    return slot<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(OrtApiSlot::AddCustomOpDomain)(options, domain);
  }
  OrtStatus* GetTensorMutableData(OrtValue* value, void** out) const {
    return slot<OrtStatus* (*)(OrtValue*, void**)>(OrtApiSlot::GetTensorMutableData)(value, out);
  }
  OrtStatus* GetTensorElementType(const OrtTensorTypeAndShapeInfo* info, ONNXTensorElementDataType* out) const {
    return slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, ONNXTensorElementDataType*)>(
        OrtApiSlot::GetTensorElementType)(info, out);
  }
  OrtStatus* GetDimensionsCount(const OrtTensorTypeAndShapeInfo* info, size_t* out) const {
    return slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(OrtApiSlot::GetDimensionsCount)(info, out);
  }
  OrtStatus* GetDimensions(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t count) const {
    return slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(OrtApiSlot::GetDimensions)(
        info, dims, count);
  }
  OrtStatus* GetTensorTypeAndShape(const OrtValue* value, OrtTensorTypeAndShapeInfo** out) const {
    return slot<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(OrtApiSlot::GetTensorTypeAndShape)(
        value, out);
  }
  void ReleaseTensorTypeAndShapeInfo(OrtTensorTypeAndShapeInfo* info) const {
    slot<void (*)(OrtTensorTypeAndShapeInfo*)>(OrtApiSlot::ReleaseTensorTypeAndShapeInfo)(info);
  }
  OrtStatus* KernelInfoGetAttribute_string(const OrtKernelInfo* info, const char* name, char* out, size_t* size) const {
    return slot<OrtStatus* (*)(const OrtKernelInfo*, const char*, char*, size_t*)>(
        OrtApiSlot::KernelInfoGetAttribute_string)(info, name, out, size);
  }
  OrtStatus* HasSessionConfigEntry(const OrtSessionOptions* options, const char* key, int* out) const {
    return slot<OrtStatus* (*)(const OrtSessionOptions*, const char*, int*)>(OrtApiSlot::HasSessionConfigEntry)(
        options, key, out);
  }
  OrtStatus* GetSessionConfigEntry(const OrtSessionOptions* options, const char* key, char* value, size_t* size) const {
    return slot<OrtStatus* (*)(const OrtSessionOptions*, const char*, char*, size_t*)>(
        OrtApiSlot::GetSessionConfigEntry)(options, key, value, size);
  }
  OrtStatus* KernelInfoGetAttribute_float(const OrtKernelInfo* info, const char* name, float* out) const {
    return slot<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(
        OrtApiSlot::KernelInfoGetAttribute_float)(info, name, out);
  }
  OrtStatus* KernelInfoGetAttribute_int64(const OrtKernelInfo* info, const char* name, int64_t* out) const {
    return slot<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(
        OrtApiSlot::KernelInfoGetAttribute_int64)(info, name, out);
  }
  OrtStatus* KernelInfo_GetInputCount(const OrtKernelInfo* info, size_t* out) const {
    return slot<OrtStatus* (*)(const OrtKernelInfo*, size_t*)>(OrtApiSlot::KernelInfo_GetInputCount)(info, out);
  }
  OrtStatus* KernelInfo_GetOutputCount(const OrtKernelInfo* info, size_t* out) const {
    return slot<OrtStatus* (*)(const OrtKernelInfo*, size_t*)>(OrtApiSlot::KernelInfo_GetOutputCount)(info, out);
  }
  // out nullptr: *size is set to the name's size including the terminating NUL.
  OrtStatus* KernelInfo_GetNodeName(const OrtKernelInfo* info, char* out, size_t* size) const {
    return slot<OrtStatus* (*)(const OrtKernelInfo*, char*, size_t*)>(OrtApiSlot::KernelInfo_GetNodeName)(info, out,
                                                                                                       size);
  }
  OrtStatus* KernelContext_GetInputCount(const OrtKernelContext* ctx, size_t* out) const {
    return slot<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(OrtApiSlot::KernelContext_GetInputCount)(ctx, out);
  }
  OrtStatus* KernelContext_GetOutputCount(const OrtKernelContext* ctx, size_t* out) const {
    return slot<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(OrtApiSlot::KernelContext_GetOutputCount)(ctx, out);
  }
  OrtStatus* KernelContext_GetInput(const OrtKernelContext* ctx, size_t index, const OrtValue** out) const {
    return slot<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(
        OrtApiSlot::KernelContext_GetInput)(ctx, index, out);
  }
  OrtStatus* KernelContext_GetOutput(OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t count,
                                     OrtValue** out) const {
    return slot<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
        OrtApiSlot::KernelContext_GetOutput)(ctx, index, dims, count, out);
  }
  // CUDA kernels only: the cudaStream_t the kernel must run on.
  OrtStatus* KernelContext_GetGPUComputeStream(const OrtKernelContext* ctx, void** out) const {
    return slot<OrtStatus* (*)(const OrtKernelContext*, void**)>(OrtApiSlot::KernelContext_GetGPUComputeStream)(
        ctx, out);
  }
  // Runs fn(usr_data, i) for i in [0, total) on the session's intra-op thread pool (inline when
  // the session has one thread). num_batch 0: onnxruntime picks the partition.
  OrtStatus* KernelContext_ParallelFor(const OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t total,
                                       size_t num_batch, void* usr_data) const {
    return slot<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
        OrtApiSlot::KernelContext_ParallelFor)(ctx, fn, total, num_batch, usr_data);
  }
  // A tensor's element type and a pointer to its own dimensions (valid as long as the value),
  // without allocating: GetTensorTypeAndShape allocates an info object per call. API version 24.
  OrtStatus* GetTensorElementTypeAndShapeDataReference(const OrtValue* value, ONNXTensorElementDataType* type,
                                                       const int64_t** dims, size_t* count) const {
    return slot<OrtStatus* (*)(const OrtValue*, ONNXTensorElementDataType*, const int64_t**, size_t*)>(
        OrtApiSlot::GetTensorElementTypeAndShapeDataReference)(value, type, dims, count);
  }

 private:
  template <typename Fn>
  Fn slot(OrtApiSlot index) const {
    return reinterpret_cast<Fn>(reinterpret_cast<void* const*>(api_)[static_cast<size_t>(index)]);
  }
  const OrtApi* api_ = nullptr;
};

// The C API version of the onnxruntime this library registered with, recorded by
// RegisterCustomOps; slots newer than kOrtApiVersion are called only when it is high enough. The
// function table does not record its own length, and onnxruntime logs an error when asked for a
// version it lacks, so the version is read from GetVersionString ("1.N.P" serves API N) and
// confirmed with GetApi(N). Anything unexpected leaves it at kOrtApiVersion.
inline std::atomic<uint32_t> runtime_api_version{kOrtApiVersion};

inline void record_runtime_api_version(const OrtApiBase* base) {
  uint32_t version = kOrtApiVersion;
  const char* text = base->GetVersionString();
  if (text != nullptr && text[0] == '1' && text[1] == '.') {
    char* end = nullptr;
    const unsigned long minor = std::strtoul(text + 2, &end, 10);
    if (end != text + 2 && minor > kOrtApiVersion && minor < 1000 && base->GetApi(static_cast<uint32_t>(minor)))
      version = static_cast<uint32_t>(minor);
  }
  runtime_api_version.store(version, std::memory_order_relaxed);
}

inline bool runtime_serves_api(uint32_t version) {
  return runtime_api_version.load(std::memory_order_relaxed) >= version;
}

}  // namespace onnxfuse
