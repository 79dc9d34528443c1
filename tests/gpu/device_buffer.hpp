// Shared by the GPU kernel tests: a device buffer that frees itself and converts to and
// from double on the host, and the relative RMS error every test checks against.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

namespace lar::gpu_test {

using bf16 = __nv_bfloat16;

template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    if (cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void poison() { cudaMemset(p, 0xff, n * sizeof(T)); }  // all-ones bits: NaN in bf16 and fp32
  void put(const std::vector<double>& x) {
    std::vector<T> h(n);
    for (size_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<T, bf16>)
        h[i] = __float2bfloat16(static_cast<float>(x[i]));
      else
        h[i] = static_cast<T>(x[i]);
    }
    cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<double> get() const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    std::vector<double> out(n);
    for (size_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<T, bf16>)
        out[i] = __bfloat162float(h[i]);
      else
        out[i] = h[i];
    }
    return out;
  }
};

// ‖got − ref‖ / ‖ref‖; infinite as soon as got holds a non-finite value (a poisoned
// output the kernel never wrote).
inline double rel_rms(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// x rounded to bf16 and back: what a kernel reading bf16 inputs actually sees.
inline double to_bf(double x) { return __bfloat162float(__float2bfloat16(static_cast<float>(x))); }

}  // namespace lar::gpu_test
