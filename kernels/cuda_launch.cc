#include "cuda_launch.h"

#include "kernel_util.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>

namespace onnxfuse {
namespace cuda {
namespace {

uint64_t fnv1a(uint64_t h, const std::string& s) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h ^ 0xff;  // separates consecutive strings
}

struct ModuleKey {
  CUcontext ctx;
  std::string entry;
  uint64_t hash;
  bool operator<(const ModuleKey& o) const {
    return std::tie(ctx, hash, entry) < std::tie(o.ctx, o.hash, o.entry);
  }
};

struct LoadedFunction {
  CUfunction fn = nullptr;
  DeviceInfo device;
};

// Modules loaded per context, shared by every node with the same kernel. Modules are never
// unloaded: a context outlives the sessions that use it, and the set of distinct kernels is
// bounded by the models loaded.
std::mutex& cache_mutex() {
  static std::mutex mu;
  return mu;
}
std::map<ModuleKey, LoadedFunction>& module_cache() {
  static auto* cache = new std::map<ModuleKey, LoadedFunction>();
  return *cache;
}

// "sm_90" -> (9, 0, false); "sm_90a" -> (9, 0, true); "sm_120" -> (12, 0, false).
bool parse_arch(const std::string& arch, int* major, int* minor, bool* specific) {
  if (arch.rfind("sm_", 0) != 0) return false;
  std::string digits;
  size_t i = 3;
  while (i < arch.size() && arch[i] >= '0' && arch[i] <= '9') digits += arch[i++];
  if (digits.size() < 2) return false;
  *specific = i < arch.size();
  *major = std::stoi(digits.substr(0, digits.size() - 1));
  *minor = digits.back() - '0';
  return true;
}

// A cubin runs on devices of its major version with at least its minor version; an
// architecture-specific one ("sm_90a") only on exactly its own.
bool cubin_runs_on(const std::string& arch, const DeviceInfo& dev) {
  int major = 0, minor = 0;
  bool specific = false;
  if (!parse_arch(arch, &major, &minor, &specific)) return false;
  if (specific) return major == dev.major && minor == dev.minor;
  return major == dev.major && minor <= dev.minor;
}

std::string device_arch(const DeviceInfo& dev) {
  return "sm_" + std::to_string(dev.major) + std::to_string(dev.minor);
}

std::string ptx_target(const std::string& ptx) {
  size_t at = ptx.find(".target ");
  if (at == std::string::npos) return "unknown target";
  size_t end = ptx.find_first_of(" ,\n\r", at + 8);
  return ptx.substr(at + 8, end == std::string::npos ? std::string::npos : end - at - 8);
}

bool load_function(const DriverApi& api, const KernelImage& image, const DeviceInfo& dev, CUfunction* fn,
                   std::string* error) {
  std::string cubin_error, ptx_error;
  const bool cubin_fits = !image.cubin.empty() && cubin_runs_on(image.arch, dev);
  auto get = [&](CUmodule module, std::string* err) {
    CUresult r = api.cuModuleGetFunction(fn, module, image.entry.c_str());
    if (r != kSuccess) *err = error_text(api, "cuModuleGetFunction", r);
    return r == kSuccess;
  };
  if (cubin_fits) {
    CUmodule module = nullptr;
    CUresult r = api.cuModuleLoadDataEx(&module, image.cubin.data(), 0, nullptr, nullptr);
    if (r == kSuccess && get(module, &cubin_error)) return true;
    if (r != kSuccess) cubin_error = "cubin " + image.arch + ": " + error_text(api, "cuModuleLoadDataEx", r);
  }
  if (!image.ptx.empty()) {
    char log[4096] = {0};
    int options[2] = {kJitErrorLogBuffer, kJitErrorLogBufferSizeBytes};
    void* values[2] = {log, reinterpret_cast<void*>(static_cast<uintptr_t>(sizeof(log)))};
    CUmodule module = nullptr;
    CUresult r = api.cuModuleLoadDataEx(&module, image.ptx.c_str(), 2, options, values);
    if (r == kSuccess && get(module, &ptx_error)) return true;
    if (r != kSuccess) {
      ptx_error = "PTX " + ptx_target(image.ptx) + ": " + error_text(api, "cuModuleLoadDataEx", r);
      std::string jit(log);
      while (!jit.empty() && (jit.back() == '\n' || jit.back() == '\r')) jit.pop_back();
      for (char& c : jit)
        if (c == '\n') c = ' ';
      if (!jit.empty()) ptx_error += " [" + jit + "]";
    }
  }
  const std::string here = device_arch(dev);
  if (!cubin_fits && image.ptx.empty()) {
    *error = "kernel " + image.entry + " was compiled for " + (image.arch.empty() ? "no architecture" : image.arch) +
             " only (no PTX stored) and cannot run on this " + here +
             " GPU; optimize the model again for this GPU (--arch " + here + ")";
    return false;
  }
  *error = "cannot load kernel " + image.entry + " on this " + here + " GPU (model built for " +
           (image.arch.empty() ? std::string("PTX only") : image.arch) + "): ";
  if (!cubin_error.empty()) *error += cubin_error;
  if (!cubin_error.empty() && !ptx_error.empty()) *error += "; ";
  *error += ptx_error;
  return false;
}

}  // namespace

bool string_attr(const OrtApiRef& api, const OrtKernelInfo* info, const char* name, std::string* out) {
  size_t size = 0;
  if (OrtStatus* st = api.KernelInfoGetAttribute_string(info, name, nullptr, &size)) {
    api.ReleaseStatus(st);
    return false;
  }
  std::string value(size, '\0');
  if (OrtStatus* st = api.KernelInfoGetAttribute_string(info, name, value.data(), &size)) {
    api.ReleaseStatus(st);
    return false;
  }
  // `size` counts the terminating NUL onnxruntime appends; the bytes before it are the value.
  value.resize(size > 0 ? size - 1 : 0);
  *out = std::move(value);
  return true;
}

bool int_attr(const OrtApiRef& api, const OrtKernelInfo* info, const char* name, int64_t* out) {
  if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, name, out)) {
    api.ReleaseStatus(st);
    return false;
  }
  return true;
}

bool read_launch(const OrtApiRef& api, const OrtKernelInfo* info, const char* const* names, size_t count,
                 KernelImage* image, int64_t* values, std::string* error) {
  if (!read_stored_kernel(api, info, image, error)) return false;
  for (size_t i = 0; i < count; ++i) {
    if (!int_attr(api, info, names[i], &values[i]) || values[i] < 1) {
      *error = std::string("missing or invalid attribute ") + names[i] + " (optimize the model again)";
      return false;
    }
  }
  return true;
}

OrtStatus* read_checked_launch(const OrtApiRef& api, const OrtKernelInfo* info, const char* const* names,
                               size_t count, int64_t abi, KernelImage* image, int64_t* values,
                               const std::string& where) {
  std::string error;
  if (!read_launch(api, info, names, count, image, values, &error))
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + error).c_str());
  if (values[count - 1] != abi)
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "the stored kernel's ABI " + std::to_string(values[count - 1]) +
                                                   " is not this library's " + std::to_string(abi) +
                                                   " (optimize the model again)").c_str());
  for (size_t i = 0; i < count; ++i)
    if (std::strcmp(names[i], "cuda_block") == 0 && (values[i] > 1024 || values[i] % 32 != 0))
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (where + "invalid attribute cuda_block").c_str());
  return nullptr;
}

OrtStatus* launch_on_ort_stream(const OrtApiRef& api, OrtKernelContext* ctx, StoredKernel& kernel, Dim3 grid,
                                int64_t threads, void* args, const std::string& where) {
  void* stream = nullptr;
  ONNXFUSE_RETURN_IF_ERROR(api.KernelContext_GetGPUComputeStream(ctx, &stream), where);
  const Dim3 block = grid_of(threads);
  void* params[] = {args};
  std::string error;
  if (!kernel.launch(static_cast<CUstream>(stream), grid, block, 0, params, &error))
    return api.CreateStatus(ORT_FAIL, (where + error).c_str());
  return nullptr;
}

bool read_stored_kernel(const OrtApiRef& api, const OrtKernelInfo* info, KernelImage* image, std::string* error) {
  if (!string_attr(api, info, "cuda_entry", &image->entry) || image->entry.empty()) {
    *error = "no compiled CUDA kernel is stored with the node (attribute cuda_entry); optimize the model with "
             "--target cuda, or run it without the onnxfuse library on the CUDA provider";
    return false;
  }
  string_attr(api, info, "cuda_arch", &image->arch);
  string_attr(api, info, "cuda_cubin", &image->cubin);
  string_attr(api, info, "cuda_ptx", &image->ptx);
  if (image->cubin.empty() && image->ptx.empty()) {
    *error = "kernel " + image->entry + " has neither cuda_cubin nor cuda_ptx";
    return false;
  }
  if (!image->cubin.empty() && image->cubin.compare(0, 4, "\x7f" "ELF") != 0) {
    image->cubin.clear();  // damaged (for example cut at a NUL byte): the PTX is the fallback
    if (image->ptx.empty()) {
      *error = "kernel " + image->entry + ": cuda_cubin is not a cubin and no PTX is stored";
      return false;
    }
  }
  return true;
}

StoredKernel::StoredKernel(KernelImage image) : image_(std::move(image)) {
  image_hash_ = fnv1a(fnv1a(fnv1a(1469598103934665603ull, image_.entry), image_.cubin), image_.ptx);
}

bool StoredKernel::resolve(CUstream stream, CUfunction* fn, DeviceInfo* device, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (have_last_ && stream == last_stream_) {
    *fn = last_fn_;
    *device = last_device_;
    return true;
  }
  const DriverApi* api = driver(error);
  if (api == nullptr) return false;
  CUcontext ctx = nullptr;
  CUresult r = api->cuStreamGetCtx(stream, &ctx);
  if (r != kSuccess || ctx == nullptr) {
    r = api->cuCtxGetCurrent(&ctx);
    if (r != kSuccess || ctx == nullptr) {
      *error = "no CUDA context for onnxruntime's stream and none is current";
      return false;
    }
  }
  CUcontext current = nullptr;
  if (api->cuCtxGetCurrent(&current) != kSuccess || current != ctx) {
    r = api->cuCtxSetCurrent(ctx);
    if (r != kSuccess) {
      *error = error_text(*api, "cuCtxSetCurrent", r);
      return false;
    }
  }
  ModuleKey key{ctx, image_.entry, image_hash_};
  {
    std::lock_guard<std::mutex> cache_lock(cache_mutex());
    auto it = module_cache().find(key);
    if (it == module_cache().end()) {
      LoadedFunction lf;
      CUdevice dev = 0;
      r = api->cuCtxGetDevice(&dev);
      if (r == kSuccess) r = api->cuDeviceGetAttribute(&lf.device.major, kAttrComputeCapabilityMajor, dev);
      if (r == kSuccess) r = api->cuDeviceGetAttribute(&lf.device.minor, kAttrComputeCapabilityMinor, dev);
      if (r == kSuccess) r = api->cuDeviceGetAttribute(&lf.device.sm_count, kAttrMultiprocessorCount, dev);
      if (r != kSuccess) {
        *error = error_text(*api, "cuDeviceGetAttribute", r);
        return false;
      }
      if (!load_function(*api, image_, lf.device, &lf.fn, error)) return false;
      it = module_cache().emplace(key, lf).first;
    }
    last_fn_ = it->second.fn;
    last_device_ = it->second.device;
  }
  last_stream_ = stream;
  have_last_ = true;
  *fn = last_fn_;
  *device = last_device_;
  return true;
}

bool StoredKernel::prepare(CUstream stream, DeviceInfo* device, std::string* error) {
  CUfunction fn = nullptr;
  return resolve(stream, &fn, device, error);
}

bool StoredKernel::launch(CUstream stream, Dim3 grid, Dim3 block, unsigned int shared_bytes, void** params,
                          std::string* error) {
  CUfunction fn = nullptr;
  DeviceInfo device;
  if (!resolve(stream, &fn, &device, error)) return false;
  const DriverApi* api = driver(error);
  if (shared_bytes > 48 * 1024) {
    std::lock_guard<std::mutex> lock(mu_);
    if (shared_bytes > shared_set_) {
      CUresult r = api->cuFuncSetAttribute(fn, kFuncAttrMaxDynamicSharedSizeBytes, static_cast<int>(shared_bytes));
      if (r != kSuccess) {
        *error = "kernel " + image_.entry + ": " + error_text(*api, "cuFuncSetAttribute", r);
        return false;
      }
      shared_set_ = shared_bytes;
    }
  }
  CUresult r = api->cuLaunchKernel(fn, grid.x, grid.y, grid.z, block.x, block.y, block.z, shared_bytes, stream,
                                   params, nullptr);
  if (r != kSuccess) {
    *error = "kernel " + image_.entry + ": " + error_text(*api, "cuLaunchKernel", r);
    return false;
  }
  return true;
}

}  // namespace cuda
}  // namespace onnxfuse
