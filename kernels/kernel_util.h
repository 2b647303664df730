// Small helpers every kernel file uses: error context on onnxruntime statuses, node names.
#pragma once

#include <cstring>
#include <string>

#include "ort_api.h"

namespace onnxfuse {

// A failed status from onnxruntime, returned with our context prepended to its message.
inline OrtStatus* with_context(const OrtApiRef& api, OrtStatus* st, const std::string& context) {
  std::string msg = context + api.GetErrorMessage(st);
  OrtErrorCode code = api.GetErrorCode(st);
  api.ReleaseStatus(st);
  return api.CreateStatus(code, msg.c_str());
}

}  // namespace onnxfuse

// Returns from the calling function (which has an OrtApiRef named `api`) when `call` fails.
#define ONNXFUSE_RETURN_IF_ERROR(call, context)                                  \
  do {                                                                           \
    if (OrtStatus* st_ = (call)) return ::onnxfuse::with_context(api, st_, context); \
  } while (0)

namespace onnxfuse {

// The node's name, as the kernel info reports it.
inline OrtStatus* read_node_name(const OrtApiRef& api, const OrtKernelInfo* info, std::string* name) {
  size_t size = 0;
  if (OrtStatus* st = api.KernelInfo_GetNodeName(info, nullptr, &size)) return st;
  name->assign(size, '\0');
  if (OrtStatus* st = api.KernelInfo_GetNodeName(info, name->data(), &size)) return st;
  name->resize(std::strlen(name->c_str()));
  return nullptr;
}

}  // namespace onnxfuse
