#include "cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

namespace onnxfuse {
namespace cuda {
namespace {

struct Loaded {
  DriverApi api{};
  std::string error;  // empty when api is usable
};

template <typename Fn>
bool bind(void* lib, const char* name, Fn* slot, std::string* error) {
  void* sym = dlsym(lib, name);
  if (sym == nullptr) {
    *error = std::string("libcuda.so.1 has no ") + name + " (driver too old?)";
    return false;
  }
  *slot = reinterpret_cast<Fn>(sym);
  return true;
}

Loaded load() {
  Loaded out;
  // RTLD_LOCAL: the driver's symbols stay out of the global namespace of the host process.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    out.error = std::string("cannot load the CUDA driver (libcuda.so.1): ") + (why ? why : "unknown error");
    return out;
  }
  DriverApi& a = out.api;
  std::string& e = out.error;
  bool ok = bind(lib, "cuInit", &a.cuInit, &e) && bind(lib, "cuDriverGetVersion", &a.cuDriverGetVersion, &e) &&
            bind(lib, "cuGetErrorName", &a.cuGetErrorName, &e) &&
            bind(lib, "cuGetErrorString", &a.cuGetErrorString, &e) &&
            bind(lib, "cuCtxGetCurrent", &a.cuCtxGetCurrent, &e) &&
            bind(lib, "cuCtxSetCurrent", &a.cuCtxSetCurrent, &e) &&
            bind(lib, "cuCtxGetDevice", &a.cuCtxGetDevice, &e) && bind(lib, "cuStreamGetCtx", &a.cuStreamGetCtx, &e) &&
            bind(lib, "cuPointerGetAttribute", &a.cuPointerGetAttribute, &e) &&
            bind(lib, "cuDeviceGetAttribute", &a.cuDeviceGetAttribute, &e) &&
            bind(lib, "cuModuleLoadDataEx", &a.cuModuleLoadDataEx, &e) &&
            bind(lib, "cuModuleGetFunction", &a.cuModuleGetFunction, &e) &&
            bind(lib, "cuFuncSetAttribute", &a.cuFuncSetAttribute, &e) &&
            bind(lib, "cuLaunchKernel", &a.cuLaunchKernel, &e);
  if (!ok) return out;  // the handle stays open: harmless, and dlclose of a driver is not
  CUresult r = a.cuInit(0);
  if (r != kSuccess) out.error = error_text(a, "cuInit", r);
  return out;
}

}  // namespace

const DriverApi* driver(std::string* error) {
  static std::once_flag once;
  static Loaded* loaded = nullptr;  // never freed: kernels may run until the process exits
  std::call_once(once, [] { loaded = new Loaded(load()); });
  if (!loaded->error.empty()) {
    *error = loaded->error;
    return nullptr;
  }
  return &loaded->api;
}

std::string error_text(const DriverApi& api, const char* call, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api.cuGetErrorName(result, &name) != kSuccess) name = nullptr;
  if (api.cuGetErrorString(result, &text) != kSuccess) text = nullptr;
  std::string out = std::string(call) + " failed: " + (name ? name : ("CUresult " + std::to_string(result)).c_str());
  if (text) out += std::string(" (") + text + ")";
  return out;
}

}  // namespace cuda
}  // namespace onnxfuse

// A cheap probe for tools and tests: loads the driver (once) and reports what it found, without
// onnxruntime. Returns 1 when a CUDA driver is usable, 0 otherwise; `message` gets one line.
extern "C" __attribute__((visibility("default"))) int OnnxfuseCudaProbe(char* message, size_t size) {
  using namespace onnxfuse::cuda;
  std::string error;
  const DriverApi* api = driver(&error);
  std::string text;
  int ok = 0;
  if (api == nullptr) {
    text = error;
  } else {
    int version = 0;
    api->cuDriverGetVersion(&version);
    text = "CUDA driver API " + std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
    ok = 1;
  }
  if (message != nullptr && size > 0) {
    size_t n = text.size() < size - 1 ? text.size() : size - 1;
    text.copy(message, n);
    message[n] = '\0';
  }
  return ok;
}
