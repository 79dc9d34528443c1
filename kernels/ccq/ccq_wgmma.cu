// wgmma_tile_check (ccq_cuda.hpp): one 64×64×64 product through wgmma.cuh's helper, for
// the GPU test of the helper on its own (kernels/ccq/test_ccq_cuda.cpp, WgmmaTileProduct).
#include <cuda_bf16.h>

#include <string>

#include "kernels/ccq/ccq_cuda.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/linear/wgmma.cuh"

namespace lar::kernels::cuda::linear {
namespace {

// 8 warps (two warpgroups): the two operand tiles loaded with cp.async into swizzled tiles,
// C0 into the accumulator fragments, c += A·B, the fragments back to C. used[0] = 1 where the
// pass that ran was compiled with wgmma.
template <bool A_KM, bool B_KN>
__global__ void __launch_bounds__(256) wgmma_check_kernel(const __nv_bfloat16* A, const __nv_bfloat16* B,
                                                          const float* C0, float* C, int* used) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto* sA = reinterpret_cast<__nv_bfloat16*>(wg::align1k(smem_raw));
  __nv_bfloat16* sB = sA + 64 * 64;
  const int t = threadIdx.x, w = t >> 5, lane = t & 31, wm = w & 3, wn = w >> 2, g = lane >> 2, tig = lane & 3;
  wg::load_tile_async(sA, A, 64, 64, t, 256);
  wg::load_tile_async(sB, B, 64, 64, t, 256);
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  wg::fence_async_smem();
  __syncthreads();
  float c[4][4];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[nt][e] = C0[(16 * wm + g + 8 * (e >> 1)) * 64 + 32 * wn + 8 * nt + 2 * tig + (e & 1)];
  wg::mma_64x64<A_KM, B_KN>(c, sA, sB, wn);
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) C[(16 * wm + g + 8 * (e >> 1)) * 64 + 32 * wn + 8 * nt + 2 * tig + (e & 1)] = c[nt][e];
  if (t == 0) *used = wg::kWgmma ? 1 : 0;
}

template <bool A_KM, bool B_KN>
void launch(const __nv_bfloat16* A, const __nv_bfloat16* B, const float* C0, float* C, int* used, cudaStream_t st) {
  const int smem = 2 * wg::kTileBytes + 1024;
  LAR_CUDA_CHECK(cudaFuncSetAttribute(wgmma_check_kernel<A_KM, B_KN>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  wgmma_check_kernel<A_KM, B_KN><<<1, 256, smem, st>>>(A, B, C0, C, used);
  LAR_CUDA_LAUNCHED();
}

}  // namespace

void wgmma_tile_check(const __nv_bfloat16* A, const __nv_bfloat16* B, bool a_km, bool b_kn, const float* C0, float* C,
                      int* used_wgmma, cudaStream_t stream) {
  if (!A || !B || !C0 || !C || !used_wgmma) throw RuntimeError("wgmma_tile_check: every pointer is required");
  if (!a_km && !b_kn) launch<false, false>(A, B, C0, C, used_wgmma, stream);
  if (!a_km && b_kn) launch<false, true>(A, B, C0, C, used_wgmma, stream);
  if (a_km && !b_kn) launch<true, false>(A, B, C0, C, used_wgmma, stream);
  if (a_km && b_kn) launch<true, true>(A, B, C0, C, used_wgmma, stream);
}

}  // namespace lar::kernels::cuda::linear
