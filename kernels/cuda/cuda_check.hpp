#pragma once
// Every CUDA / cuBLAS call is checked; a failure is a RuntimeError naming the call.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "core/error.hpp"

namespace lar::kernels::cuda {

inline void check_cuda(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess)
    throw RuntimeError(std::string("CUDA: ") + what + " failed at " + file + ":" + std::to_string(line) +
                       ": " + cudaGetErrorString(e));
}
inline void check_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw RuntimeError(std::string("cuBLAS: ") + what + " failed at " + file + ":" + std::to_string(line) +
                       ": status " + std::to_string(static_cast<int>(s)));
}

}  // namespace lar::kernels::cuda

#define LAR_CUDA_CHECK(x) ::lar::kernels::cuda::check_cuda((x), #x, __FILE__, __LINE__)
#define LAR_CUBLAS_CHECK(x) ::lar::kernels::cuda::check_cublas((x), #x, __FILE__, __LINE__)
// After a kernel launch: launch-configuration errors surface here.
#define LAR_CUDA_LAUNCHED() LAR_CUDA_CHECK(cudaGetLastError())
