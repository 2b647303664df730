// Launching a CUDA kernel stored with a node: the layer every CUDA-EP op of this library uses.
//
// Contract for an op that uses it (Pointwise does; ConvBiasAct can):
//  * The node carries its compiled kernel as attributes:
//      cuda_entry  string  the extern "C" __global__ function's name (required)
//      cuda_arch   string  the cubin's architecture, e.g. "sm_90" (required with cuda_cubin)
//      cuda_cubin  string  the cubin's bytes (optional)
//      cuda_ptx    string  PTX text for a virtual architecture, e.g. compute_90 (optional)
//    At least one of cuda_cubin and cuda_ptx. onnxfuse/cuda/compile.py produces both;
//    passes/cuda_compile.py attaches them.
//  * At kernel creation: read_stored_kernel(api, info, &image, &error), then keep a
//    StoredKernel built from the image (one per node; it is thread-safe).
//  * In KernelCompute: get the stream with KernelContext_GetGPUComputeStream, fill the kernel's
//    argument values on the host, and call StoredKernel::launch. launch loads the module the
//    first time a context is seen (cubin when its architecture runs on the device, PTX
//    otherwise), then only calls cuLaunchKernel on that stream: no synchronization, no host
//    copies, no allocation, so onnxruntime can capture it in a CUDA graph after the first run.
//  * Errors are one line naming the node, the entry and, for architecture mismatches, both
//    the model's and the device's architecture.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "cuda_driver.h"
#include "ort_api.h"

namespace onnxfuse {
namespace cuda {

struct KernelImage {
  std::string entry;
  std::string arch;   // architecture of `cubin`, "sm_90"; empty without a cubin
  std::string cubin;  // may be empty
  std::string ptx;    // may be empty
};

// Reads cuda_entry, cuda_arch, cuda_cubin and cuda_ptx from the node. Returns false with a
// one-line *error when the node has no usable kernel.
bool read_stored_kernel(const OrtApiRef& api, const OrtKernelInfo* info, KernelImage* image, std::string* error);

// The stored kernel (read_stored_kernel) and its launch constants: the positive int attributes
// names[0..count) into values. Returns false with a one-line *error when one is missing.
bool read_launch(const OrtApiRef& api, const OrtKernelInfo* info, const char* const* names, size_t count,
                 KernelImage* image, int64_t* values, std::string* error);

// read_launch for a node whose last launch constant (names[count - 1]) is cuda_abi: nullptr, or an
// invalid-argument status prefixed by `where` when an attribute is missing, the stored kernel's
// ABI is not `abi`, this library's (the model then has to be optimized again), or a cuda_block
// among the names is not a whole number of warps up to 1024 threads.
OrtStatus* read_checked_launch(const OrtApiRef& api, const OrtKernelInfo* info, const char* const* names,
                               size_t count, int64_t abi, KernelImage* image, int64_t* values,
                               const std::string& where);

// A string attribute, binary-safe (cubins hold NUL bytes). false when the node lacks it.
bool string_attr(const OrtApiRef& api, const OrtKernelInfo* info, const char* name, std::string* out);
// An int attribute. false when the node lacks it.
bool int_attr(const OrtApiRef& api, const OrtKernelInfo* info, const char* name, int64_t* out);

struct DeviceInfo {
  int major = 0, minor = 0;
  int sm_count = 0;
};

struct Dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

// A grid of x * y * z blocks (each extent fits in 32 bits: the callers check their sizes).
inline Dim3 grid_of(int64_t x, int64_t y = 1, int64_t z = 1) {
  Dim3 d;
  d.x = static_cast<unsigned int>(x);
  d.y = static_cast<unsigned int>(y);
  d.z = static_cast<unsigned int>(z);
  return d;
}

class StoredKernel {
 public:
  explicit StoredKernel(KernelImage image);

  // The device the kernel will run on for this stream (loads the module on first use).
  bool prepare(CUstream stream, DeviceInfo* device, std::string* error);

  // Launches on `stream`. `params` as for cuLaunchKernel: one pointer per kernel parameter.
  bool launch(CUstream stream, Dim3 grid, Dim3 block, unsigned int shared_bytes, void** params,
              std::string* error);

  const KernelImage& image() const { return image_; }

 private:
  bool resolve(CUstream stream, CUfunction* fn, DeviceInfo* device, std::string* error);

  KernelImage image_;
  uint64_t image_hash_;
  std::mutex mu_;
  CUstream last_stream_ = nullptr;
  bool have_last_ = false;
  CUfunction last_fn_ = nullptr;
  DeviceInfo last_device_;
  unsigned int shared_set_ = 48 * 1024;  // dynamic shared memory the function allows
};

// Launches `kernel` on onnxruntime's compute stream of `ctx` over `grid`, `threads` threads a
// block, no dynamic shared memory, its one parameter the argument struct at `args`: nullptr, or
// the failed status prefixed by `where`.
OrtStatus* launch_on_ort_stream(const OrtApiRef& api, OrtKernelContext* ctx, StoredKernel& kernel, Dim3 grid,
                                int64_t threads, void* args, const std::string& where);

}  // namespace cuda
}  // namespace onnxfuse
