#pragma once
// The linear mixers (docs/spec.md §2, kernels/cpu/linear/core.hpp) at key head dims dk ∈ {128, 256}:
// the recurrent (token-by-token) form, exact for any log-decay ≤ 0 (the decays are applied
// step by step; nothing is factored inside a chunk, so no exp(−G) can overflow).
//   S_t = S_{t−1} D(a_t) + u_t k_tᵀ,  u_t = z_t − S_{t−1}(a_t ⊙ e_t),  o_t = scale S_t q_t
// grouped_heads.hpp routes every dk ∈ {128, 256} call here (but gla's training passes once
// its key-block split is open: grouped_heads.hpp, which alone takes gla at dk 192, 320..512),
// with its layouts (q, k [B,T,Hk,dk] bf16; v, o, gdn2's w [B,T,H,dv] bf16; gdn's g, β [B,T,H]
// fp32; channel gates [B,T,H,dk] fp32, gdn2's b [B,T,H,dk] bf16; the state [B,H,dv,dk] fp32)
// and any dv = 64·m.
//
// Structure: one CTA of 16 warps per (b, h, 64 value rows); a warp holds 4 rows of the state
// in registers (a lane 4 of them × dk/32 key columns), so the forward needs no block barrier
// (value rows are independent given the keys). The forward writes the state at every 256th
// token (the boundary buffer, fp32, wide_boundary_bytes: B·H·⌈T/256⌉·dv·dk floats); the
// backward recomputes each 256-token segment from it (sub-checkpoints every 8 tokens, then the
// 8 decayed states S_{t−1} D(a_t) of a sub-segment, in a per-CTA global scratch: every token is
// recomputed twice) and runs the reverse recurrence with dS in registers. The key-side
// gradients (dq, dk, the channel gate, gdn2's b) and the scalar ones (β, gdn's g) are summed over
// the CTA's rows in a fixed order (shared memory), written per value tile, and summed over the
// value tiles and the key head's group of value heads by a second pass in a fixed order:
// deterministic, no atomics. The backward runs in waves of whole sequences of about one CTA per
// SM, so its scratch (2.5 MiB a CTA at dk 256) and partials (fp32, 4 rows of dk per token, value
// head and value tile) are bounded by the wave, not the batch. Tests: tests/gpu/test_linear_keydim.cpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/linear/grouped_heads.hpp"
#include "kernels/cuda/linear/linear_methods.hpp"

namespace lar::kernels::cuda::linear {

// True when the wide-key kernels take this key dim (128, 256).
bool wide_key_dim(int64_t dk);

std::size_t wide_boundary_bytes(const GroupedShape& s);

void wide_delta_fwd(const GroupedShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                    const float* g, const float* beta, const float* S0, __nv_bfloat16* o, float* S_out,
                    void* boundary, cudaStream_t stream);
void wide_delta_bwd(const GroupedShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                    const float* g, const float* beta, const void* boundary, const __nv_bfloat16* dout,
                    const float* dST, __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, float* dg,
                    float* dbeta, float* dS0, cudaStream_t stream);
void wide_delta_decode(const GroupedShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k,
                       const __nv_bfloat16* v, const float* g, const float* beta, float* S, __nv_bfloat16* o,
                       cudaStream_t stream);

void wide_channel_fwd(ChannelMixer m, const GroupedShape& s, const ChannelInputs& in, __nv_bfloat16* o,
                      float* S_out, void* boundary, cudaStream_t stream);
void wide_channel_bwd(ChannelMixer m, const GroupedShape& s, const ChannelInputs& in, const void* boundary,
                      const __nv_bfloat16* dout, const float* dST, const ChannelGrads& gr, cudaStream_t stream);
void wide_channel_decode(ChannelMixer m, const GroupedShape& s, const ChannelInputs& in, float* S,
                         __nv_bfloat16* o, cudaStream_t stream);

// CCQ's read correction (linear_methods.hpp's ccq_fwd / ccq_bwd, same arguments) at dk ∈ {128,
// 256}: the key statistics K as a recurrent state of dk rows (tiles of 64) with u = k, no decay.
// The backward walks back from the statistics after the call (fin: K_{t−1} = K_t − k_t k_tᵀ,
// exact but for fp32 rounding, as nothing decays), so it needs no checkpoints; dq overwritten,
// CCQ's key gradient added into dk, dlambda overwritten; fixed-order sums, no atomics.
void wide_ccq_fwd(const DeltaShape& s, const CcqInputs& in, __nv_bfloat16* qc, const CcqStats& out,
                  cudaStream_t stream);
void wide_ccq_bwd(const DeltaShape& s, const CcqInputs& in, const CcqStats& fin, const __nv_bfloat16* dqc,
                  __nv_bfloat16* dq, __nv_bfloat16* dk, float* dlambda, cudaStream_t stream);

// CARVE (linear_methods.hpp's carve_fwd / carve_bwd, same inputs with dk = s.dk, dv = s.dv; q, k
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

// The layer's L2 norm of q and k over key heads of any width (the fused qkv pass normalises
// heads of 64 only): x ← x / sqrt(Σx² + 1e-6) per row of `width` channels (bf16, in place),
// rn[row] = 1 / sqrt(Σx² + 1e-6) kept for the backward.
void l2_rows_forward(int64_t rows, int width, __nv_bfloat16* x, float* rn, cudaStream_t stream);
// dx ← rn (dx − x̂ (x̂·dx)) in place, from the normalised x̂ and rn of the forward.
void l2_rows_backward(int64_t rows, int width, const __nv_bfloat16* xhat, const float* rn, __nv_bfloat16* dx,
                      cudaStream_t stream);

}  // namespace lar::kernels::cuda::linear
