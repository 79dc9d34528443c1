#pragma once
// The delta rule on Hopper: gdn (scalar decay per token and head) and deltanet (no decay), the
// chunkwise forward and backward and the recurrent single-token decode, at heads of 64 (wider
// heads: grouped_heads.hpp, wide_key.hpp). Conventions and layouts: kernels/linear/shape.hpp.
// CPU reference: kernels/linear/core.hpp with the gdn and deltanet maps of kernels/linear/mixers.hpp.
// Tests: kernels/delta_rule/test_delta_rule_cuda.cpp; timings and the comparison with fla:
// docs/perf.md, `lar-bench linear-cuda`.
//
// The recurrence (kernels/linear/core.hpp with e = β k, z = β v; per batch b, head h):
//   S_t = S_{t−1} exp(g_t) + u_t k_tᵀ,  u_t = β_t (v_t − S_{t−1} exp(g_t) k_t),  o_t = scale S_t q_t
// gdn: scalar log-gate g_t ≤ 0 per (token, head); deltanet: g = nullptr (no decay).
//
// Structure: one CTA of 8 warps per (b, h) walks the chunks in order with the state in
// registers (forward: S; backward: dS, chunks in reverse); inside a chunk every product is a
// 64×64×64 tensor-core GEMM on shared-memory tiles, and the UT/WY solve (I + A) U = R is a
// register-resident forward substitution (fp32) spread over 4 threads per column.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/linear/shape.hpp"

namespace lar::kernels::cuda::linear {

// Chunkwise forward. g nullable (deltanet); S0 nullable (zero state); S_out nullable;
// boundary nullable (then the backward cannot run from this forward).
void delta_fwd(const DeltaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k,
               const __nv_bfloat16* v, const float* g, const float* beta, const float* S0,
               __nv_bfloat16* o, float* S_out, __nv_bfloat16* boundary, cudaStream_t stream);

// Chunkwise backward from the forward's boundary states. dST nullable (no gradient on the
// final state); dg nullable (and ignored when g is nullptr); dS0 nullable. dq, dk, dv,
// dbeta, dg, dS0 are overwritten.
void delta_bwd(const DeltaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k,
               const __nv_bfloat16* v, const float* g, const float* beta,
               const __nv_bfloat16* boundary, const __nv_bfloat16* dout, const float* dST,
               __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, float* dg, float* dbeta,
               float* dS0, cudaStream_t stream);

// Recurrent single-token decode: q, k, v [B, H, 64] bf16, g, beta [B, H] fp32 (g nullable),
// state S [B, H, 64, 64] fp32 updated in place, o [B, H, 64] bf16. (s.T is ignored.)
void delta_decode(const DeltaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k,
                  const __nv_bfloat16* v, const float* g, const float* beta, float* S,
                  __nv_bfloat16* o, cudaStream_t stream);

}  // namespace lar::kernels::cuda::linear
