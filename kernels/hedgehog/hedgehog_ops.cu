// The Hedgehog feature map's forward and backward: see hedgehog_ops.hpp. A warp holds one
// row (lane l has channels l, l + 32, …: PER of them, 4 for heads up to 128, 8 up to 256), the
// max, min and sums are warp shuffles in a fixed order.
#include <cuda_bf16.h>

#include <cmath>
#include <string>

#include "core/error.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/hedgehog/hedgehog_ops.hpp"
#include "kernels/linear/op_common.cuh"

namespace lar::kernels::cuda::linear {
namespace {

using op_common::blocks_for;
using op_common::warp_sum;
using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;
// Channels a lane: the narrow instance (heads up to 128) and the wide one (up to kHedgehogMaxDim).
constexpr int kPerNarrow = 4;
constexpr int kPerWide = kHedgehogMaxDim / 32;

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_min(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The row's pre-activation x and its two softmaxes: p = softmax(x), n = softmax(−x), per lane
// (channels past dk: p = n = 0). softmax(−x) is exp(min x − x) / Σ.
template <int kPer>
struct Row {
  float p[kPer], n[kPer];
};
template <int kPer>
__device__ __forceinline__ Row<kPer> softmaxes(int64_t row, int dk, int lane, const float* u, const float* a,
                                               const float* bias) {
  float x[kPer];
  float mx = -INFINITY, mn = INFINITY;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = lane + 32 * j;
    x[j] = 0.f;
    if (c < dk) {
      x[j] = u[row * dk + c] + a[row * dk + c] + bias[c];
      mx = fmaxf(mx, x[j]);
      mn = fminf(mn, x[j]);
    }
  }
  mx = warp_max(mx);
  mn = warp_min(mn);
  Row<kPer> r;
  float sp = 0.f, sn = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const bool in = lane + 32 * j < dk;
    r.p[j] = in ? expf(x[j] - mx) : 0.f;
    r.n[j] = in ? expf(mn - x[j]) : 0.f;
    sp += r.p[j];
    sn += r.n[j];
  }
  sp = warp_sum(sp);
  sn = warp_sum(sn);
  const float inv_p = 1.f / sp, inv_n = 1.f / sn;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    r.p[j] *= inv_p;
    r.n[j] *= inv_n;
  }
  return r;
}

template <int kPer>
__global__ void map_fwd_kernel(int64_t rows, int dk, const float* u, const float* a, const float* bias, bf16* phi,
                               int64_t ld) {
  const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;  // the whole warp: row is per warp
  const Row<kPer> r = softmaxes<kPer>(row, dk, lane, u, a, bias);
  bf16* out = phi + row * ld;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = lane + 32 * j;
    if (c < dk) {
      out[c] = __float2bfloat16(r.p[j]);
      out[dk + c] = __float2bfloat16(r.n[j]);
    }
  }
  for (int64_t c = 2 * dk + lane; c < ld; c += 32) out[c] = __float2bfloat16(0.f);
}

// dx = p ⊙ (dp − p·dp) − n ⊙ (dn − n·dn)   (the two softmaxes' Jacobians; −x for the second)
template <int kPer>
__global__ void map_bwd_kernel(int64_t rows, int dk, const float* u, const float* a, const float* bias,
                               const bf16* dphi, int64_t ld, float* dx, float* dx2) {
  const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const Row<kPer> r = softmaxes<kPer>(row, dk, lane, u, a, bias);
  const bf16* d = dphi + row * ld;
  float dp[kPer], dn[kPer];
  float sp = 0.f, sn = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = lane + 32 * j;
    dp[j] = c < dk ? __bfloat162float(d[c]) : 0.f;
    dn[j] = c < dk ? __bfloat162float(d[dk + c]) : 0.f;
    sp += r.p[j] * dp[j];
    sn += r.n[j] * dn[j];
  }
  sp = warp_sum(sp);
  sn = warp_sum(sn);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = lane + 32 * j;
    if (c >= dk) continue;
    const float g = r.p[j] * (dp[j] - sp) - r.n[j] * (dn[j] - sn);
    dx[row * dk + c] = g;
    if (dx2) dx2[row * dk + c] = g;
  }
}

void check(int64_t rows, int dk, const void* u, const void* a, const void* bias, const void* phi, int64_t ld,
           const char* what) {
  if (!hedgehog_map_supports(dk))
    throw RuntimeError(std::string("hedgehog ") + what + ": head dim " + std::to_string(dk) + " outside 1.." +
                       std::to_string(kHedgehogMaxDim));
  if (ld < 2 * dk)
    throw RuntimeError(std::string("hedgehog ") + what + ": row stride " + std::to_string(ld) + " below 2·" +
                       std::to_string(dk));
  if (rows < 0 || (rows > 0 && !(u && a && bias && phi)))
    throw RuntimeError(std::string("hedgehog ") + what + ": null argument or negative row count");
}

}  // namespace

void hedgehog_map_forward(int64_t rows, int dk, const float* u, const float* a, const float* bias, bf16* phi,
                          int64_t ld, cudaStream_t stream) {
  check(rows, dk, u, a, bias, phi, ld, "map forward");
  if (rows == 0) return;
  if (dk <= 32 * kPerNarrow)
    map_fwd_kernel<kPerNarrow><<<blocks_for(rows, kRowsPerBlock), kThreads, 0, stream>>>(rows, dk, u, a, bias, phi, ld);
  else
    map_fwd_kernel<kPerWide><<<blocks_for(rows, kRowsPerBlock), kThreads, 0, stream>>>(rows, dk, u, a, bias, phi, ld);
  LAR_CUDA_LAUNCHED();
}

void hedgehog_map_backward(int64_t rows, int dk, const float* u, const float* a, const float* bias, const bf16* dphi,
                           int64_t ld, float* dx, float* dx2, cudaStream_t stream) {
  check(rows, dk, u, a, bias, dphi, ld, "map backward");
  if (rows > 0 && !dx) throw RuntimeError("hedgehog map backward: null dx");
  if (rows == 0) return;
  if (dk <= 32 * kPerNarrow)
    map_bwd_kernel<kPerNarrow>
        <<<blocks_for(rows, kRowsPerBlock), kThreads, 0, stream>>>(rows, dk, u, a, bias, dphi, ld, dx, dx2);
  else
    map_bwd_kernel<kPerWide>
        <<<blocks_for(rows, kRowsPerBlock), kThreads, 0, stream>>>(rows, dk, u, a, bias, dphi, ld, dx, dx2);
  LAR_CUDA_LAUNCHED();
}

}  // namespace lar::kernels::cuda::linear
