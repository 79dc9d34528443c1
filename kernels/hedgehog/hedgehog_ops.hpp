#pragma once
// The Hedgehog feature map of the GLA-Hedgehog layer (trainer/mixers/hedgehog_mixer.cpp; the
// CPU map is kernels/hedgehog/hedgehog_map.hpp) on the GPU, one row per (token, head):
//   x = a + u + b,  u = a Δᵀ (a GEMM: the map's offset from the identity, run by the caller),
//   φ(a) = [softmax(x), softmax(−x)] ∈ R^{2dk}
// written in bf16 as the gla channel kernels' q or k, in rows of ld ≥ 2dk elements whose
// columns [2dk, ld) are zeroed (padding to the kernels' key dim: those channels have q = k = 0
// and add nothing to the state's product). The backward recomputes x and φ in fp32 and gives
// ∂L/∂x; the caller turns it into ∂L/∂a = ∂L/∂x (I + Δ), ∂L/∂Δ = Σ ∂L/∂xᵀ a and
// ∂L/∂b = Σ ∂L/∂x (a GEMM with β = 1 and layer_ops' column sums).
//
// One warp per row, dk ≤ 256 (4 channels a lane up to 128, 8 past it: CCQ's paper heads of
// 256, feature dim 512); every reduction in a fixed order (warp shuffles), no atomics:
// bit-reproducible. Row-major, launches on `stream`, lar::RuntimeError on a bad shape. Tests:
// tests/gpu/test_hedgehog_cuda.cpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/hedgehog/supports.hpp"

namespace lar::kernels::cuda::linear {

// rows × dk inputs: u = a Δᵀ and a (fp32, contiguous [rows, dk]), bias [dk] (shared by every
// row: one map for all heads); phi [rows, ld] bf16.
void hedgehog_map_forward(int64_t rows, int dk, const float* u, const float* a, const float* bias, __nv_bfloat16* phi,
                          int64_t ld, cudaStream_t stream);
// From dphi [rows, ld] (bf16, the kernels' dq or dk; columns past 2dk not read): dx [rows, dk]
// fp32 = ∂L/∂(a + u + b), also copied into dx2 when not null (the caller's ∂L/∂a before its
// β = 1 GEMM adds ∂L/∂x Δ).
void hedgehog_map_backward(int64_t rows, int dk, const float* u, const float* a, const float* bias,
                           const __nv_bfloat16* dphi, int64_t ld, float* dx, float* dx2, cudaStream_t stream);

}  // namespace lar::kernels::cuda::linear
