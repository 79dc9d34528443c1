#pragma once
// Device helpers shared by the layers' elementwise and reduction ops (layer_ops.cu,
// mamba2_ops.cu): fp32/bf16 conversion by type, a warp's sum, and the grid for n elements.
// The gate nonlinearities stay in each file (layer_ops uses the fast __expf; mamba2_ops uses
// expf, to match the CPU's ssm helpers).
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

namespace lar::kernels::cuda::linear::op_common {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_f(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16(x);
  else return x;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

inline unsigned blocks_for(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

}  // namespace lar::kernels::cuda::linear::op_common
