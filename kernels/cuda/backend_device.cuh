#pragma once
// Device helpers of the CUDA backend's op files (cuda_backend_internal.hpp lists them): warp
// and block reductions (fixed order: deterministic), the grid size of elementwise launches, and
// loads / stores of f32 or bf16 activations with f32 math. In an anonymous namespace, as they
// were in one file: each op file keeps its own copy, so moving an op between files changes no
// kernel.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace lar::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kMaxHeadDim = 256;                 // per-lane register arrays below
constexpr int kPerLane = kMaxHeadDim / kWarp;
constexpr int kReduceBlocks = 1024;

__device__ inline float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline double warp_sum_d(double v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum in double; every thread gets the result. blockDim.x multiple of 32.
__device__ double block_sum_d(double v) {
  __shared__ double part[32];
  v = warp_sum_d(v);
  int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  __syncthreads();
  if (lane == 0) part[w] = v;
  __syncthreads();
  int nw = blockDim.x / kWarp;
  double r = 0;
  for (int i = 0; i < nw; ++i) r += part[i];  // fixed order: deterministic
  return r;
}

__device__ float block_max(float v) {
  __shared__ float part[32];
  v = warp_max(v);
  int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  __syncthreads();
  if (lane == 0) part[w] = v;
  __syncthreads();
  int nw = blockDim.x / kWarp;
  float r = -INFINITY;
  for (int i = 0; i < nw; ++i) r = fmaxf(r, part[i]);
  return r;
}

int blocks_for(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 65535 * 16 ? b : 65535 * 16);
}

// ---------------------------------------------------------------- typed storage
// Activations are f32 or bf16 (Backend::act_dtype()); math is always f32.
using bf16 = __nv_bfloat16;
__device__ inline float ldf(const float* p) { return *p; }
__device__ inline float ldf(const bf16* p) { return __bfloat162float(*p); }
__device__ inline void stf(float* p, float v) { *p = v; }
__device__ inline void stf(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

// 8 bf16 ↔ 8 floats through one 16-byte access (p 16-byte aligned).
__device__ inline void load8(const bf16* p, float (&x)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    x[2 * k] = f.x;
    x[2 * k + 1] = f.y;
  }
}
__device__ inline void store8(bf16* p, const float (&x)[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(x[2 * k], x[2 * k + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// 4 elements through one 16-byte (f32) or 8-byte (bf16) access.
struct alignas(8) Bf16x4 {
  __nv_bfloat162 lo, hi;
};
__device__ inline void ld4(const float* p, float (&v)[4]) {
  const float4 f = *reinterpret_cast<const float4*>(p);
  v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
}
__device__ inline void ld4(const bf16* p, float (&v)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}
__device__ inline void st4(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ inline void st4(bf16* p, const float (&v)[4]) {
  Bf16x4 o{__floats2bfloat162_rn(v[0], v[1]), __floats2bfloat162_rn(v[2], v[3])};
  *reinterpret_cast<Bf16x4*>(p) = o;
}

}  // namespace

// The conversion kernels of cuda_backend.cu over n elements, blocks × 256 threads on st (for
// the other op files: norm.cu, attention/attention_ops.cu).
void launch_f32_to_bf16(const float* x, __nv_bfloat16* y, int64_t n, int blocks, cudaStream_t st);
void launch_bf16_to_f32(const __nv_bfloat16* x, float* y, int64_t n, int blocks, cudaStream_t st);

}  // namespace lar::kernels::cuda
