// Host cost of the CUDA Pointwise kernel's plan step per call, on the CPU (no GPU needed): resolving
// the iteration plan every call (before) vs the plan kept from the previous call with the same
// input shapes as kernels/cuda_pointwise.cc does (after: lock, compare shapes, shared_ptr copy),
// timed interleaved. A char-rnn/gpt-style Pointwise: a 384-wide view, a broadcast bias, tanh.
//   g++ -O2 -std=c++17 -Ikernels bench/cuda_host_plan.cc kernels/pointwise_plan.cc -o /tmp/cuda_host_plan && /tmp/cuda_host_plan
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include "pointwise_plan.h"
using namespace onnxfuse;
template <class F> double per_call(F f, int n) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
}
int main() {
  const char* text = "in x0 f32 view=2:0:128:1\nin x1 f32\nin x2 f32\nt0 = add x0 x1\nt1 = mul t0 x2\nt2 = tanh t1\nout t2 f32\n";
  Program p; std::string err;
  Program::parse(text, &p, &err);
  std::vector<std::vector<int64_t>> shapes = {{1, 32, 384}, {128}, {1, 32, 128}};
  volatile int64_t sink = 0;
  std::mutex mu;
  std::vector<std::vector<int64_t>> cached_shapes;
  std::shared_ptr<const IterPlan> cached;
  for (int rep = 0; rep < 5; ++rep) {
    double before = per_call([&] { IterPlan plan; resolve_plan(p, shapes, &plan, &err); sink = sink + plan.numel; }, 100000);
    double after = per_call([&] {
      std::shared_ptr<const IterPlan> ref;
      { std::lock_guard<std::mutex> l(mu); if (cached && cached_shapes == shapes) ref = cached; }
      if (!ref) { auto f = std::make_shared<IterPlan>(); resolve_plan(p, shapes, f.get(), &err); ref = f;
                  std::lock_guard<std::mutex> l(mu); cached_shapes = shapes; cached = ref; }
      sink = sink + ref->numel; }, 100000);
    printf("before %.3f us/call, after %.3f us/call, ratio %.3f\n", before, after, after / before);
  }
}
