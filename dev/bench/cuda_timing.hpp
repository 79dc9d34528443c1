#pragma once
// Shared by the CUDA benchmarks: a device buffer that frees itself (filled from host floats)
// and the median of CUDA-event timings.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/cuda/cuda_check.hpp"

namespace lar::bench {

using bf16 = __nv_bfloat16;

template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    LAR_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void put(const std::vector<float>& h) {
    std::vector<T> x(n);
    for (size_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<T, bf16>)
        x[i] = __float2bfloat16(h[i]);
      else
        x[i] = static_cast<T>(h[i]);
    }
    LAR_CUDA_CHECK(cudaMemcpy(p, x.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
};

// Median milliseconds of `reps` calls of f, each between two events, after `warmup` calls.
template <class F>
double median_event_ms(F&& f, int reps, int warmup) {
  for (int i = 0; i < warmup; ++i) f();
  cudaEvent_t a, b;
  LAR_CUDA_CHECK(cudaEventCreate(&a));
  LAR_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    LAR_CUDA_CHECK(cudaEventRecord(a));
    f();
    LAR_CUDA_CHECK(cudaEventRecord(b));
    LAR_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    LAR_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace lar::bench
