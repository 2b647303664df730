// The block executor built for AVX2 + FMA + F16C (x86-64-v3); chosen at run time by
// select_run_task when the CPU has them, so one build serves every x86-64 machine.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "numeric.h"
#include "pointwise_cpu.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace onnxfuse {
namespace isa_avx2 {
#include "pointwise_exec.inc"
}  // namespace isa_avx2
}  // namespace onnxfuse
#pragma GCC pop_options
#else
namespace onnxfuse {
namespace isa_avx2 {
void run_task(const ExecJob& job, int64_t task) { isa_base::run_task(job, task); }
}  // namespace isa_avx2
}  // namespace onnxfuse
#endif
