#pragma once
// The linear mixers (docs/spec.md §2, kernels/linear/core.hpp) at key head dims dk ∈ {128, 256}:
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
// head and value tile) are bounded by the wave, not the batch. Tests: kernels/linear/test_wide_key_cuda.cpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/channel_rule/channel_rule.hpp"
#include "kernels/linear/grouped_heads.hpp"

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

// The layer's L2 norm of q and k over key heads of any width (the fused qkv pass normalises
// heads of 64 only): x ← x / sqrt(Σx² + 1e-6) per row of `width` channels (bf16, in place),
// rn[row] = 1 / sqrt(Σx² + 1e-6) kept for the backward.
void l2_rows_forward(int64_t rows, int width, __nv_bfloat16* x, float* rn, cudaStream_t stream);
// dx ← rn (dx − x̂ (x̂·dx)) in place, from the normalised x̂ and rn of the forward.
void l2_rows_backward(int64_t rows, int width, const __nv_bfloat16* xhat, const float* rn, __nv_bfloat16* dx,
                      cudaStream_t stream);

}  // namespace lar::kernels::cuda::linear
