#pragma once
// What the CUDA backend's source files share beyond cuda_backend.hpp: the nested structs its
// header only declares (a growable arena block, an op's profiling scope, a cuBLASLt GEMM plan)
// and the dtype checks of its ops. One file per op family: cuda_backend.cu (construction,
// options, profiling, elementwise ops and reductions, conversions, the optimiser updates),
// embedding.cu, norm.cu (RMSNorm), swiglu.cu, rope.cu, loss.cu (cross-entropy),
// attention/attention_ops.cu (causal attention and its dispatch), cuda_memory.cpp (the allocator
// and the copies), cuda_gemm.cpp (the GEMMs); backend_device.cuh holds the device helpers they
// share.
#include <cublasLt.h>
#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/event_profile.hpp"

namespace lar::kernels::cuda {

inline void require_f32(const Tensor& t, const char* what) {
  if (t.dtype != DType::f32) throw RuntimeError(std::string("cuda backend: ") + what + " must be f32");
}
inline void require_act(const Tensor& t, const char* what) {
  if (t.dtype != DType::f32 && t.dtype != DType::bf16)
    throw RuntimeError(std::string("cuda backend: ") + what + " must be f32 or bf16, got " + to_string(t.dtype));
}
inline bool is_bf16(const Tensor& t) { return t.dtype == DType::bf16; }
inline bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data) % 16 == 0; }

// An arena block in reserved address space, backed chunk by chunk (alloc_growable).
struct CudaBackend::Growable {
  CUdeviceptr base = 0;
  std::size_t reserved = 0, mapped = 0, gran = 0;
  std::vector<std::pair<CUmemGenericAllocationHandle, std::size_t>> chunks;  // in address order
  CUmemAllocationProp prop{};
};

// LAR_CUDA_PROFILE=1: every op records a pair of CUDA events around its launches;
// profile_report() sums them per op (lar-bench gpu-train prints the table). Off by
// default: then an OpTimer costs one branch.
struct CudaBackend::OpTimer : EventProfile::Scope {
  OpTimer(CudaBackend& b, const char* name) : Scope(b.prof_, b.profile_, name, b.stream_) {}
};

struct CudaBackend::GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool usable = false;  // false: cuBLASLt offered no algorithm; the legacy call runs instead
  std::size_t workspace = 0;
  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

}  // namespace lar::kernels::cuda
