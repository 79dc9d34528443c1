#pragma once
// CUDA kernels of the papers' methods on top of the linear mixers (docs/spec.md §4), and the
// recurrent decode of the channel-gated mixers. Same conventions as linear_attention.hpp:
// bf16 [B,T,H,64] activations, fp32 gates and state [B,H,64 (dv),64 (dk)], chunk 64, any T,
// plain functions on device pointers + a stream, bad shapes throw lar::RuntimeError.
//   carve_fwd / carve_bwd      CARVE (content-aware erase on the gdn2 recurrence)
//   ccq_fwd / ccq_bwd          CCQ read correction in front of any backbone
//   channel_decode, carve_decode   one token of gla / kda / gdn2 / carve, state in place
// Tests: tests/gpu/test_linear_methods.cpp; timings: `lar-bench linear-cuda`, dev/perf-history.md.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/linear/linear_attention.hpp"

namespace lar::kernels::cuda::linear {

// ---- CARVE (kernels/cpu/linear/carve.hpp): gdn2 with
//   e_t = b_t ⊙ k_t, b_t = σ(bx_t + U2 tanh(U1 m_c)),  z_t = w_t v_t (scalar w per token, head)
//   m_c = mean of the outputs o over chunk c−1 (content chunk = kernel chunk = 64), m_0 = 0.
// The chunks already run in order inside one CTA per (b, h), so the content signal of the
// next chunk is reduced from the output fragments still in registers and U_b(m) costs two
// tiny mat-vecs between barriers that exist anyway (dev/perf-history.md).
struct CarveInputs {
  const __nv_bfloat16 *q = nullptr, *k = nullptr, *v = nullptr;
  const float* g = nullptr;              // [B,T,H,64] per-channel log-decay ≤ 0
  const __nv_bfloat16* bx = nullptr;     // [B,T,H,64] erase logits W_b x
  const float* w = nullptr;              // [B,T,H] write gate ∈ (0,1) (already σ-activated)
  const float *U1 = nullptr, *U2 = nullptr;  // [H, rank, 64], [H, 64, rank] (per head)
  int rank = 0;                          // 1..32
  const float* S0 = nullptr;             // nullable; the content signal always starts at m_0 = 0
  bool content_grad = true;              // false: m_c is a constant input of chunk c
};
struct CarveGrads {
  __nv_bfloat16 *dq = nullptr, *dk = nullptr, *dv = nullptr, *dbx = nullptr;
  float* dg = nullptr;
  float* dw = nullptr;                   // [B,T,H]
  float *dU1 = nullptr, *dU2 = nullptr;  // [H, rank, 64], [H, 64, rank]: summed over the batch
  float* dS0 = nullptr;                  // nullable
};
// Bytes of the content-signal workspace (m_c of every chunk, [B,H,nc,64] fp32) the forward
// writes and the backward reads, beside the boundary states (delta_boundary_bytes).
std::size_t carve_content_bytes(const DeltaShape& s);
void carve_fwd(const DeltaShape& s, const CarveInputs& in, __nv_bfloat16* o, float* S_out,
               __nv_bfloat16* boundary, float* content, cudaStream_t stream);
// All of gr but dS0 required; every gradient is overwritten (dU1, dU2 too).
void carve_bwd(const DeltaShape& s, const CarveInputs& in, const __nv_bfloat16* boundary,
               const float* content, const __nv_bfloat16* dout, const float* dST, const CarveGrads& gr,
               cudaStream_t stream);

// ---- CCQ read correction (kernels/cpu/linear/ccq.hpp): q_c = (I − λ_t Σ_t) q on L2-normalised
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
// Check of the wgmma helper CCQ's products run on (kernels/cuda/linear/wgmma.cuh; test only):
// C = C0 + A·B for 64×64 row-major bf16 blocks stored as A [m][k] (a_km: [k][m]) and B [n][k]
// (b_kn: [k][n]), C0 and C fp32 [64][64]; *used_wgmma = 1 if the device ran wgmma, 0 if the
// ldmatrix + mma.sync fallback (a plain sm_90 build).
void wgmma_tile_check(const __nv_bfloat16* A, const __nv_bfloat16* B, bool a_km, bool b_kn, const float* C0, float* C,
                      int* used_wgmma, cudaStream_t stream);

// ---- Recurrent single-token decode (state in registers, one pass over it).
// Per-token layouts: q, k, v [B,H,64] bf16, g [B,H,64] fp32; kda: beta [B,H]; gdn2: b, w
// [B,H,64] bf16 (ChannelInputs; S0 is ignored). S [B,H,64,64] fp32 updated in place, o [B,H,64].
void channel_decode(ChannelMixer m, const DeltaShape& s, const ChannelInputs& in, float* S, __nv_bfloat16* o,
                    cudaStream_t stream);
// CARVE: CarveInputs in the per-token layout (bx [B,H,64] bf16, w [B,H] fp32; S0 ignored).
// content [B,H,128] fp32 = the current content chunk's m (64) and its running output sum
// (64), updated in place (zeros at the sequence start); pos = tokens of the current content
// chunk seen before this one (0..63; the caller counts: pos = t mod 64). Matches carve_fwd's
// chunk forward token by token.
void carve_decode(const DeltaShape& s, const CarveInputs& in, int pos, float* S, float* content, __nv_bfloat16* o,
                  cudaStream_t stream);

}  // namespace lar::kernels::cuda::linear
