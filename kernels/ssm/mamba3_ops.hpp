#pragma once
// The parts of the Mamba-3 layer (trainer/mixers/mamba3_mixer.cpp, its CUDA path
// cuda_layers/mamba3_layer_cuda.cpp) around the gla channel kernel (grouped_heads.hpp):
// the per-token scalars (Δ, A, λ, the trapezoidal write weight c and the next token's share
// β'), the rotary angles' cumulative sum, the RMSNorm + bias + rotation of B and C into the
// kernels' keys and queries, the written value c·(x ⊙ m_x), the log decay on the first of a
// token's R rows, the diagonal correction and the MIMO output maps — and their backwards.
//
// The mapping (kernels/ssm/mamba3.hpp): token t of a sequence is R consecutive rows
// t·R + r of the channel kernel's sequence of T·R rows; the rows of one (token, head) are
// q_r = R(φ_t) q̂_r, k_r = R(φ_t) k̂_r, v_r = c_t·(x ⊙ m_x,r) and the log-gate A_tΔ_t on every
// key channel of row r = 0 and 0 on the others (exp(0) = 1: the state is carried unchanged
// between a token's rows, so the decay is applied once per token, as the recurrence has it).
// The diagonal then adds, per query row r', Σ_r (c_t·[r > r'] − β'_{t+1})(q_r'·k_r)(x ⊙ m_x,r).
//
// Layouts: N = B·T token rows. P (act, row stride ldp): z [0, Di), x [Di, 2Di), B [2Di,
// 2Di+RGN), C [2Di+RGN, 2Di+2RGN) with RGN = R·G·S and B's column (r·G + g)·S + i; Pg (fp32,
// row stride ldg): dt [0, H), a [H, 2H), trap [2H, 3H), angle [3H, 3H+na). The kernels' rows
// are ((n·R + r)·H + h): q, k, g [.., S], v, o, dO [.., Pd]. Per-(token, head) scalars
// [N, H]; φ [N, H, na]. Conventions as mamba2_ops.hpp: every launch on `stream`, lar::
// RuntimeError on a bad shape, no atomics, fixed-order reductions. Tests:
// tests/gpu/test_mamba3_cuda.cpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace lar::kernels::cuda::linear {

struct Mamba3Args {
  int64_t B = 0, T = 0;
  int H = 0, Pd = 0, S = 0, G = 1, R = 1, na = 1;  // heads, head dim, state size, groups, rank, pairs
  const void* P = nullptr;
  bool act_bf16 = false;  // P, ypre, dyv, dP
  int64_t ldp = 0;
  const float* Pg = nullptr;
  int64_t ldg = 0;
  const float *dt_bias = nullptr, *nB = nullptr, *nC = nullptr;  // [H], [S], [S]
  const float *bB = nullptr, *bC = nullptr;                      // [H, R, S]
  const float* D = nullptr;                                      // [H]
  const float *mx = nullptr, *mz = nullptr, *mo = nullptr;       // [H, R, Pd]; null in the SISO form
  float eps = 1e-5f;
  // the per-token values mamba3_prepare writes (fp32; [N, H] each, phi [N, H, na])
  float *dt = nullptr, *A = nullptr, *lam = nullptr, *cw = nullptr, *bnext = nullptr, *phi = nullptr;
};

// Δ, A, λ, c, β' and φ into the args' arrays, then the kernel inputs q, k (bf16 [N·R·H, S]), v
// (bf16 [N·R·H, Pd]) and g (fp32 [N·R·H, S]).
void mamba3_prepare(const Mamba3Args& a, __nv_bfloat16* q, __nv_bfloat16* k, __nv_bfloat16* v, float* g,
                    cudaStream_t stream);

// From the kernel's output o (bf16 [N·R·H, Pd]): ypre [N, H·Pd] (act) = Σ_r m_o ⊙ (o_r + diag_r
// + D v_r) ⊙ SiLU(z ⊙ m_z) (the queries and keys of the diagonal recomputed in fp32).
void mamba3_out_forward(const Mamba3Args& a, const __nv_bfloat16* o, void* ypre, cudaStream_t stream);

// From dyv = ∂L/∂ypre (act [N, H·Pd]): du (fp32) and dO (bf16) [N·R·H, Pd] = ∂L/∂(o_r + diag_r),
// dP's z columns (overwritten), dterm [N, H] (∂L/∂D's per-token terms), and in the MIMO form
// tmo, tmz [N, H·R·Pd] (∂L/∂m_o's, ∂L/∂m_z's per-token terms; null in the SISO form); ypre
// (nullable): the forward's output again.
void mamba3_out_backward(const Mamba3Args& a, const __nv_bfloat16* o, const void* dyv, float* du, __nv_bfloat16* dO,
                         void* dP, float* dterm, float* tmo, float* tmz, void* ypre, cudaStream_t stream);

// From du and the kernel's gradients (dq, dk, dv bf16; dg fp32, per key channel): the diagonal's
// and the written value's backward, the rotation's: dQh, dKh [N, H·R·S] = ∂L/∂(q̂, k̂) (also
// ∂L/∂C_bias's, ∂L/∂B_bias's per-token terms), dphi [N, H, na] = ∂L/∂φ, dc, dbn, dadt [N, H] =
// ∂L/∂c, ∂L/∂β'_{t+1}, ∂L/∂(AΔ); dP's x columns (overwritten) and, MIMO, tmx [N, H·R·Pd].
struct Mamba3CoreGrads {
  const __nv_bfloat16 *dq = nullptr, *dk = nullptr, *dv = nullptr;
  const float* dg = nullptr;
  float *dQh = nullptr, *dKh = nullptr, *dphi = nullptr, *dc = nullptr, *dbn = nullptr, *dadt = nullptr;
  float* tmx = nullptr;
};
void mamba3_core_backward(const Mamba3Args& a, const float* du, const Mamba3CoreGrads& g, void* dP,
                          cudaStream_t stream);

// The RMSNorms of B and C backward from dQh, dKh (summed over each group's heads in order):
// dP's B and C columns (overwritten) and tnB, tnC [N·R·G, S] (∂L/∂B_norm's, ∂L/∂C_norm's terms).
void mamba3_norm_backward(const Mamba3Args& a, const float* dQh, const float* dKh, void* dP, float* tnB, float* tnC,
                          cudaStream_t stream);

// The scalars' backward: dphi is turned into its reverse cumulative sum in place; dPg [N, ldg]
// (fp32, overwritten) = ∂L/∂(dt, a, trap, angle) pre-activations (its dt columns also ∂L/∂dt_bias's
// per-token terms).
void mamba3_scalars_backward(const Mamba3Args& a, float* dphi, const float* dc, const float* dbn, const float* dadt,
                             float* dPg, cudaStream_t stream);

// ---- decode: one token of B sequences, Mamba-3's own recurrence (kernels/ssm/mamba3.hpp's
// mamba3_step) on the device state, fp32 throughout:
//   φ ← φ + θΔ;  q_r, k_r = R(φ)(RMSNorm·w + bias) of C_r, B_r;  α = exp(AΔ), β = (1−λ)Δα, γ = λΔ;
//   S ← α S + β Σ_r v_prev,r k_prev,rᵀ + γ Σ_r v_r k_rᵀ,  o_r = S q_r;  k_prev, v_prev ← k, v;
//   ypre [B, H·Pd] (act) = Σ_r m_o ⊙ (o_r + D v_r) ⊙ SiLU(z ⊙ m_z).
// a: the shape and parameters with P, Pg the token's projection rows ([B, ldp], [B, ldg]; T is
// taken as 1; the work arrays are not used). The state, zeros at a sequence's start: φ [B, H, na],
// S [B, H, Pd, S], k_prev [B, H, R, S], v_prev [B, H, R, Pd], all fp32, updated in place.
struct Mamba3DecodeState {
  float *phi = nullptr, *S = nullptr, *k_prev = nullptr, *v_prev = nullptr;
};
void mamba3_decode_step(const Mamba3Args& a, const Mamba3DecodeState& s, void* ypre, cudaStream_t stream);

}  // namespace lar::kernels::cuda::linear
