// What one core of this machine can do at most, for bench/stacked_mlp.py: the AVX2 FMA rate
// (and the clock it implies) and the time to stream a weight set of a given size from where it
// lives between two inferences of the side-by-side benchmark (L3: the other session's run has
// pushed it out of L2). Built by the benchmark (g++), never part of the package.
//
//   machine_bounds BYTES   ->  one line per figure, "name value unit (...)"
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// 10 independent chains: enough to keep both FMA pipes busy whatever the latency.
__attribute__((target("avx2,fma"), noinline)) float fma_throughput(long iters) {
  __m256 a[10];
  for (int i = 0; i < 10; ++i) a[i] = _mm256_set1_ps(1.0f + i * 1e-7f);
  const __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-8f);
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 10
    for (int j = 0; j < 10; ++j) a[j] = _mm256_fmadd_ps(a[j], m, c);
  }
  for (int i = 1; i < 10; ++i) a[0] = _mm256_add_ps(a[0], a[i]);
  float o[8];
  _mm256_storeu_ps(o, a[0]);
  return o[0];
}

// One dependent chain: one FMA per latency (4 cycles on Zen 3 and on Intel since Skylake).
__attribute__((target("avx2,fma"), noinline)) float fma_chain(long iters) {
  __m256 a = _mm256_set1_ps(1.0f);
  const __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-8f);
  for (long i = 0; i < iters; ++i) a = _mm256_fmadd_ps(a, m, c);
  float o[8];
  _mm256_storeu_ps(o, a);
  return o[0];
}

// Reads n floats (a multiple of 64) in order, 8 independent sums.
__attribute__((target("avx2"), noinline)) float stream(const float* p, long n) {
  __m256 s[8];
  for (int i = 0; i < 8; ++i) s[i] = _mm256_setzero_ps();
  for (long i = 0; i < n; i += 64) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) s[j] = _mm256_add_ps(s[j], _mm256_load_ps(p + i + 8 * j));
  }
  for (int i = 1; i < 8; ++i) s[0] = _mm256_add_ps(s[0], s[i]);
  float o[8];
  _mm256_storeu_ps(o, s[0]);
  return o[0];
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}

}  // namespace

int main(int argc, char** argv) {
  const long bytes = argc > 1 ? std::atol(argv[1]) : 851968;
  volatile float sink = 0;
  // Best of many short runs: on a shared host, being descheduled only ever makes a run slower.
  const long iters = 2000000;
  std::vector<double> ghz, fma_per_cycle;
  for (int rep = 0; rep < 51; ++rep) {
    double t = now();
    sink = sink + fma_chain(iters);
    const double chain = now() - t;
    t = now();
    sink = sink + fma_throughput(iters);
    const double wide = now() - t;
    ghz.push_back(iters * 4.0 / chain / 1e9);
    fma_per_cycle.push_back(iters * 10.0 / wide / 1e9);
  }
  const double clock = *std::max_element(ghz.begin(), ghz.end());
  const double fma_rate = *std::max_element(fma_per_cycle.begin(), fma_per_cycle.end());
  std::printf("clock_ghz %.2f GHz (one dependent FMA chain, 4-cycle latency)\n", clock);
  std::printf("fma_rate %.2f G vFMA/s (8 floats each; %.2f per cycle)\n", fma_rate, fma_rate / clock);

  const long n = bytes / 4 / 64 * 64, other_n = 2L << 20 >> 2;  // the weights; 2 MB of other data
  float* w = static_cast<float*>(std::aligned_alloc(64, n * 4));
  float* other = static_cast<float*>(std::aligned_alloc(64, other_n * 4));
  for (long i = 0; i < n; ++i) w[i] = 1e-9f * i;
  for (long i = 0; i < other_n; ++i) other[i] = 1.0f;
  std::vector<double> l3, l2;
  for (int r = 0; r < 3000; ++r) {
    sink = sink + stream(other, other_n);  // what the other session's run does to L2
    double t = now();
    sink = sink + stream(w, n);
    l3.push_back(now() - t);
  }
  const long half = n / 2 / 64 * 64;  // fits L2: read twice, time the second
  for (int r = 0; r < 3000; ++r) {
    sink = sink + stream(w, half);
    double t = now();
    sink = sink + stream(w, half);
    l2.push_back(now() - t);
  }
  // median, and the 10th percentile: what the hardware gives when the host's other load lets it
  const double t3 = quantile(l3, 0.5), t3_10 = quantile(l3, 0.1), t2 = quantile(l2, 0.5), t2_10 = quantile(l2, 0.1);
  std::printf("stream_l3_us %.2f us (%ld bytes after 2 MB of other data, %.1f GB/s; 10th percentile %.2f us, %.1f GB/s)\n",
              t3 * 1e6, n * 4, n * 4.0 / t3 / 1e9, t3_10 * 1e6, n * 4.0 / t3_10 / 1e9);
  std::printf("stream_l2_us %.2f us (%ld bytes read again at once, %.1f GB/s; 10th percentile %.2f us, %.1f GB/s)\n",
              t2 * 1e6, half * 4, half * 4.0 / t2 / 1e9, t2_10 * 1e6, half * 4.0 / t2_10 / 1e9);
  std::free(w);
  std::free(other);
  return 0;
}
