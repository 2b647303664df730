// The CUDA driver API, opened with dlopen("libcuda.so.1") the first time a CUDA kernel runs.
//
// The library has no link-time CUDA dependency: it loads, and its CPU kernels run, on machines
// without the NVIDIA driver. Only the entry points below are used; each is looked up by its
// plain (non per-thread-stream) name with the signature documented in cuda.h (read, not
// copied). Handles are opaque pointers; CUdeviceptr is a 64-bit integer.
#pragma once

#include <cstdint>
#include <string>

namespace onnxfuse {
namespace cuda {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
using CUdeviceptr = unsigned long long;

constexpr CUresult kSuccess = 0;
// CUdevice_attribute values.
constexpr int kAttrMultiprocessorCount = 16;
constexpr int kAttrComputeCapabilityMajor = 75;
constexpr int kAttrComputeCapabilityMinor = 76;
// CUjit_option values.
constexpr int kJitErrorLogBuffer = 5;
constexpr int kJitErrorLogBufferSizeBytes = 6;
// CUfunction_attribute: dynamic shared memory above the 48 KiB default.
constexpr int kFuncAttrMaxDynamicSharedSizeBytes = 8;
// CUpointer_attribute: the context a device pointer belongs to.
constexpr int kPointerAttrContext = 1;

struct DriverApi {
  CUresult (*cuInit)(unsigned int flags);
  CUresult (*cuDriverGetVersion)(int* version);
  CUresult (*cuGetErrorName)(CUresult error, const char** str);
  CUresult (*cuGetErrorString)(CUresult error, const char** str);
  CUresult (*cuCtxGetCurrent)(CUcontext* ctx);
  CUresult (*cuCtxSetCurrent)(CUcontext ctx);
  CUresult (*cuCtxGetDevice)(CUdevice* device);
  CUresult (*cuStreamGetCtx)(CUstream stream, CUcontext* ctx);
  CUresult (*cuPointerGetAttribute)(void* data, int attribute, CUdeviceptr ptr);
  CUresult (*cuDeviceGetAttribute)(int* value, int attribute, CUdevice device);
  CUresult (*cuModuleLoadDataEx)(CUmodule* module, const void* image, unsigned int num_options, int* options,
                                 void** option_values);
  CUresult (*cuModuleGetFunction)(CUfunction* fn, CUmodule module, const char* name);
  CUresult (*cuFuncSetAttribute)(CUfunction fn, int attribute, int value);
  CUresult (*cuLaunchKernel)(CUfunction fn, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                             unsigned int block_x, unsigned int block_y, unsigned int block_z,
                             unsigned int shared_bytes, CUstream stream, void** params, void** extra);
};

// The driver, loaded and initialized once per process. Returns nullptr and sets *error (one line:
// what failed and why) when libcuda.so.1 cannot be opened, lacks an entry point, or cuInit fails.
const DriverApi* driver(std::string* error);

// "cuFoo failed: CUDA_ERROR_NAME (description)".
std::string error_text(const DriverApi& api, const char* call, CUresult result);

}  // namespace cuda
}  // namespace onnxfuse
