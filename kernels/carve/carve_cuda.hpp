#pragma once
// CARVE on Hopper (docs/spec.md §4): content-aware erase on the gdn2 recurrence. The chunk
// forward and backward (the channel rule's chunk kernels in their CARVE mode, carve.cu), the
// recurrent form at key or value heads of 128 (carve_wide.cu) and the single-token decode
// (carve_decode.cu). Conventions and layouts: kernels/linear/shape.hpp. CPU reference:
// kernels/carve/carve.hpp. Tests: kernels/carve/test_carve_cuda.cpp; timings: `lar-bench
// linear-cuda`, docs/perf.md.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/linear/shape.hpp"

namespace lar::kernels::cuda::linear {

// ---- CARVE (kernels/carve/carve.hpp): gdn2 with
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

// CARVE: CarveInputs in the per-token layout (bx [B,H,64] bf16, w [B,H] fp32; S0 ignored).
// content [B,H,128] fp32 = the current content chunk's m (64) and its running output sum
// (64), updated in place (zeros at the sequence start); pos = tokens of the current content
// chunk seen before this one (0..63; the caller counts: pos = t mod 64). Matches carve_fwd's
// chunk forward token by token.
void carve_decode(const DeltaShape& s, const CarveInputs& in, int pos, float* S, float* content, __nv_bfloat16* o,
                  cudaStream_t stream);

// CARVE (carve_fwd / carve_bwd above, same inputs with dk = s.dk, dv = s.dv; q, k
// one key head per value head [B,T,H,dk]; U1 [H, rank, dv], U2 [H, dk, rank]) at key heads of 128
// or value heads of 128 (wide_carve_shape: dk, dv ∈ {64, 128}): the recurrent form, one CTA per
// (b, h) holding the whole head (the content signal m_c reads every value row), exact for any
// log-decay ≤ 0. boundary: wide_carve_boundary_bytes (the state every 256 tokens); content:
// wide_carve_content_bytes (per chunk of 64 tokens m_c, tanh(U1 m_c), u_c). The backward
// overwrites every gradient (dU1, dU2 summed over the batch in a fixed order; no atomics).
bool wide_carve_shape(int64_t dk, int64_t dv);
std::size_t wide_carve_boundary_bytes(const DeltaShape& s);  // B·H·⌈T/256⌉·dv·dk floats
std::size_t wide_carve_content_bytes(const DeltaShape& s);
void wide_carve_fwd(const DeltaShape& s, const CarveInputs& in, __nv_bfloat16* o, float* S_out, void* boundary,
                    float* content, cudaStream_t stream);
void wide_carve_bwd(const DeltaShape& s, const CarveInputs& in, const void* boundary, const float* content,
                    const __nv_bfloat16* dout, const float* dST, const CarveGrads& gr, cudaStream_t stream);

}  // namespace lar::kernels::cuda::linear
