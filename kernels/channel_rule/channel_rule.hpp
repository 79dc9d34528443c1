#pragma once
// The channel rule on Hopper: the mixers whose decay is per key channel (log-gate g
// [B, T, H, 64] fp32), the chunkwise forward and backward and the recurrent single-token decode,
// at heads of 64 (wider heads: grouped_heads.hpp, wide_key.hpp). CARVE (kernels/carve) runs on
// the same chunk kernels as a fourth mode. Conventions and layouts: kernels/linear/shape.hpp.
// CPU reference: kernels/linear/core.hpp with the gla, kda and gdn2 maps of
// kernels/linear/mixers.hpp. Tests: kernels/channel_rule/test_channel_rule_cuda.cpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/linear/shape.hpp"

namespace lar::kernels::cuda::linear {

// ---- channel-gated mixers (per-key-channel log-gate g [B, T, H, 64] fp32) ----
//   gla:  e = 0,      z = v        (no erase: a gated linear attention)
//   kda:  e = β k,    z = β v      (beta [B, T, H] fp32)
//   gdn2: e = b ⊙ k,  z = w ⊙ v    (b, w [B, T, H, 64] bf16, already activated)
// Same layouts, boundary workspace (delta_boundary_bytes) and structure as the delta rule
// above; the in-chunk decays are factored per 16-token block, with the pairs of a block whose
// decay is too steep for that summed directly: exact for any log-decay ≤ 0 (channel_rule.cu).
enum class ChannelMixer { gla, kda, gdn2 };
const char* channel_mixer_name(ChannelMixer m);

struct ChannelInputs {
  const __nv_bfloat16 *q = nullptr, *k = nullptr, *v = nullptr;
  const float* g = nullptr;
  const float* beta = nullptr;                        // kda
  const __nv_bfloat16 *b = nullptr, *w = nullptr;    // gdn2
  const float* S0 = nullptr;                          // nullable
};
// Overwritten; dbeta for kda, db and dw (bf16) for gdn2; dS0 nullable.
struct ChannelGrads {
  __nv_bfloat16 *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float* dg = nullptr;
  float* dbeta = nullptr;
  __nv_bfloat16 *db = nullptr, *dw = nullptr;
  float* dS0 = nullptr;
};

void channel_fwd(ChannelMixer m, const DeltaShape& s, const ChannelInputs& in, __nv_bfloat16* o, float* S_out,
                 __nv_bfloat16* boundary, cudaStream_t stream);
void channel_bwd(ChannelMixer m, const DeltaShape& s, const ChannelInputs& in, const __nv_bfloat16* boundary,
                 const __nv_bfloat16* dout, const float* dST, const ChannelGrads& gr, cudaStream_t stream);

// ---- Recurrent single-token decode (state in registers, one pass over it).
// Per-token layouts: q, k, v [B,H,64] bf16, g [B,H,64] fp32; kda: beta [B,H]; gdn2: b, w
// [B,H,64] bf16 (ChannelInputs; S0 is ignored). S [B,H,64,64] fp32 updated in place, o [B,H,64].
void channel_decode(ChannelMixer m, const DeltaShape& s, const ChannelInputs& in, float* S, __nv_bfloat16* o,
                    cudaStream_t stream);

}  // namespace lar::kernels::cuda::linear
