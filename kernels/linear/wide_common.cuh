#pragma once
// What the recurrent wide-key kernels share (kernels/linear/wide_key.cu: delta and channel rules;
// kernels/ccq/ccq_wide.cu; kernels/carve/carve_wide.cu): the CTA of 16 warps holding 4 state rows
// each, the checkpoint spacing of the backward, the warp sums, the fixed-order sums of the
// per-tile partials, and the backward's waves of sequences.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda::linear {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kRW = 4;                // state rows per warp
constexpr int kNW = 16;               // warps per CTA
constexpr int kRT = kRW * kNW;        // value rows per CTA (one value tile)
constexpr int kThreads = 32 * kNW;
constexpr int kSeg = 256;             // tokens between the forward's checkpoints
constexpr int kSub = 8;               // tokens between the backward's sub-checkpoints
constexpr int kSlots = kSeg / kSub;   // sub-checkpoints of a segment

__device__ __forceinline__ float bf(bf16 x) { return __bfloat162float(x); }

template <int N>
__device__ __forceinline__ void warp_sum(float (&x)[N]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int r = 0; r < N; ++r) x[r] += __shfl_xor_sync(0xffffffffu, x[r], o);
}
__device__ __forceinline__ float warp_sum1(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float pick4(const float (&x)[kRW], int i) {
  return i == 0 ? x[0] : i == 1 ? x[1] : i == 2 ? x[2] : x[3];
}

template <int DK>
__device__ __forceinline__ void load_state(const float* src, int lane, float (&S)[kRW][DK / 32]) {
#pragma unroll
  for (int r = 0; r < kRW; ++r)
#pragma unroll
    for (int j = 0; j < DK / 32; ++j) S[r][j] = src ? src[r * DK + lane + 32 * j] : 0.f;
}
template <int DK>
__device__ __forceinline__ void store_state(float* dst, int lane, const float (&S)[kRW][DK / 32]) {
#pragma unroll
  for (int r = 0; r < kRW; ++r)
#pragma unroll
    for (int j = 0; j < DK / 32; ++j) dst[r * DK + lane + 32 * j] = S[r][j];
}

// out[r, c] = Σ_{tile < m} Σ_{g < G} part[tile][r·G + g][c] (fixed order), r < NH / G.
__global__ void sum_tiles(const float* __restrict__ part, int m, int64_t NH, int G, int W, float* outf,
                          bf16* outb) {
  const int64_t n = NH / G * W;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % W, r = i / W;
    float acc = 0.f;
    for (int tile = 0; tile < m; ++tile)
      for (int g = 0; g < G; ++g) acc += part[((tile * NH) + r * G + g) * W + c];
    if (outf) outf[i] = acc;
    else outb[i] = __float2bfloat16(acc);
  }
}
inline unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::clamp<int64_t>((n + 255) / 256, 1, 65535)); }
inline void sum_parts(const float* part, int m, int64_t NH, int G, int W, float* outf, bf16* outb, cudaStream_t st) {
  if (!outf && !outb) return;
  const int64_t n = NH / G * W;
  sum_tiles<<<grid_for(n), 256, 0, st>>>(part, m, NH, G, W, outf, outb);
  LAR_CUDA_LAUNCHED();
}

// Sequences per backward wave: about one CTA per SM (the kernels run one CTA an SM), so the
// per-CTA scratch and the per-tile partials stay bounded whatever the batch.
inline int64_t wave_batches(int64_t B, int64_t ctas_per_seq) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return std::clamp<int64_t>(std::max<int64_t>(sms, 1) / std::max<int64_t>(ctas_per_seq, 1), 1, B);
}

}  // namespace
}  // namespace lar::kernels::cuda::linear
