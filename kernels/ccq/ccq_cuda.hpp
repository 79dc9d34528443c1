#pragma once
// CCQ on Hopper (docs/spec.md §4): the read correction in front of any backbone, at key heads
// of 64 (ccq.cu: chunk-parallel and warp-specialised passes on wgmma, ccq_wgmma.cu) and of 128
// or 256 (ccq_wide.cu). Conventions and layouts: kernels/linear/shape.hpp. CPU reference:
// kernels/ccq/ccq.hpp. Tests: kernels/ccq/test_ccq_cuda.cpp; timings: `lar-bench ccq-kernels`,
// docs/perf.md.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/linear/shape.hpp"

namespace lar::kernels::cuda::linear {

// ---- CCQ read correction (kernels/ccq/ccq.hpp): q_c = (I − λ_t Σ_t) q on L2-normalised
// q, k, Σ_t = K_t/t − μ_t μ_tᵀ (centered) or K_t/t, with the running key statistics
// K_t = Σ_{j≤t} k_j k_jᵀ, m_t = Σ_{j≤t} k_j over this call's keys and those before it.
// It runs in front of any backbone: ccq_fwd makes q_c, the backbone runs on it (delta_fwd /
// channel_fwd / carve_fwd with q = q_c); the backbone's backward gives dq_c, and ccq_bwd turns
// it into dq and adds its key gradient into the backbone's dk.
struct CcqInputs {
  const __nv_bfloat16 *q = nullptr, *k = nullptr;  // [B,T,H,64]
  const float* lambda = nullptr;                   // [B,T,H] strength ∈ (0,1)
  bool centered = true;
  const float *K0 = nullptr, *m0 = nullptr;        // statistics before the call [B,H,64,64], [B,H,64]; nullable = none
  long long t0 = 0;                                // keys before the call (0 with K0 = m0 = nullptr)
};
struct CcqStats {  // the statistics after the call
  float* K = nullptr;  // [B,H,64,64]
  float* m = nullptr;  // [B,H,64]
};
// q_c [B,T,H,64] bf16; out.K, out.m nullable (then no backward from this forward).
void ccq_fwd(const DeltaShape& s, const CcqInputs& in, __nv_bfloat16* qc, const CcqStats& out, cudaStream_t stream);
// fin: the statistics ccq_fwd wrote (read only: the warp-specialised backward peels the chunks'
// K_prev, m_prev from them; the chunk-parallel one rebuilds them from K0, m0 and the keys). dq is
// overwritten, dk (the backbone's key gradient) gets CCQ's key gradient added, dlambda [B,T,H]
// fp32 is overwritten. Each pass picks, per call, between a warp-specialised kernel (one 16-warp
// CTA per (b, h), two warp teams on consecutive chunks) when B·H fills the GPU and a
// chunk-parallel one (stats, scan over groups of chunks, main; workspace from a private
// stream-ordered pool) otherwise; s.kernels.ccq_fwd / ccq_bwd (cuda.ccq_fwd, cuda.ccq_bwd) force one. Both are
// deterministic (fixed summation order, no atomics).
void ccq_bwd(const DeltaShape& s, const CcqInputs& in, const CcqStats& fin, const __nv_bfloat16* dqc,
             __nv_bfloat16* dq, __nv_bfloat16* dk, float* dlambda, cudaStream_t stream);
// Check of the wgmma helper CCQ's products run on (kernels/linear/wgmma.cuh; test only):
// C = C0 + A·B for 64×64 row-major bf16 blocks stored as A [m][k] (a_km: [k][m]) and B [n][k]
// (b_kn: [k][n]), C0 and C fp32 [64][64]; *used_wgmma = 1 if the device ran wgmma, 0 if the
// ldmatrix + mma.sync fallback (a plain sm_90 build).
void wgmma_tile_check(const __nv_bfloat16* A, const __nv_bfloat16* B, bool a_km, bool b_kn, const float* C0, float* C,
                      int* used_wgmma, cudaStream_t stream);

// CCQ's read correction (ccq_fwd / ccq_bwd above, same arguments) at dk ∈ {128,
// 256}: the key statistics K as a recurrent state of dk rows (tiles of 64) with u = k, no decay.
// The backward walks back from the statistics after the call (fin: K_{t−1} = K_t − k_t k_tᵀ,
// exact but for fp32 rounding, as nothing decays), so it needs no checkpoints; dq overwritten,
// CCQ's key gradient added into dk, dlambda overwritten; fixed-order sums, no atomics.
void wide_ccq_fwd(const DeltaShape& s, const CcqInputs& in, __nv_bfloat16* qc, const CcqStats& out,
                  cudaStream_t stream);
void wide_ccq_bwd(const DeltaShape& s, const CcqInputs& in, const CcqStats& fin, const __nv_bfloat16* dqc,
                  __nv_bfloat16* dq, __nv_bfloat16* dk, float* dlambda, cudaStream_t stream);

}  // namespace lar::kernels::cuda::linear
