#pragma once
// The parts of the Mamba-2 layer (trainer/mixers/mamba2_mixer.cpp, its CUDA path
// cuda_layers/mamba2_layer_cuda.cpp) that no op of layer_ops.hpp covers: the causal
// depthwise conv with a bias (x, B and C each have their own, and the widths differ: Di vs
// G·N), softplus(dt + dt_bias) with the written value Δ·x and the scalar log-gate broadcast
// over the key channels of the gla channel kernels, and the output y = o + D·x through the
// gated RMSNorm over groups of Di/G channels (norm after the gate, unlike out_gate_forward).
// The recurrence itself is the gla channel kernel (grouped_heads.hpp): q = C, k = B,
// value Δ·x, log-gate a = −exp(A_log)·Δ on every key channel, scale 1.
//
// Conventions as layer_ops.hpp: row-major, N = B·T token rows, every launch on `stream`,
// lar::RuntimeError on a bad shape; no atomics, every reduction in a fixed order
// (bit-reproducible). "act" tensors are fp32, or bf16 when the flag says so (the backend's
// act_dtype()). Tests: tests/gpu/test_mamba2_cuda.cpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace lar::kernels::cuda::linear {

// ---- causal depthwise conv (width W ≤ 8, bias) + SiLU over a column block ----
//   s[t, c] = bias[c] + Σ_i w[c, i]·p[t − W + 1 + i, c]   (zero before t = 0 of each sequence)
//   out = silu(s)
// p: the block's first column inside P (act, row stride ldp); w [C, W], bias [C] fp32.
struct SsmConvArgs {
  int64_t B = 0, T = 0;
  int C = 0, W = 0;
  const void* p = nullptr;
  bool p_bf16 = false;
  int64_t ldp = 0;
  const float* w = nullptr;
  const float* bias = nullptr;
};
// out [N, C] contiguous: fp32, or bf16 when out_bf16.
void ssm_conv_silu_forward(const SsmConvArgs& a, void* out, bool out_bf16, cudaStream_t stream);
// From da = ∂L/∂out ([N, C] contiguous, fp32 or bf16 when da_bf16): dp (P's dtype, row stride
// ldp, the block's columns overwritten) and ∂L/∂w, ∂L/∂bias accumulated into dw [C, W], dbias [C]
// (fixed-order sums over row splits; scratch: ssm_conv_silu_backward_scratch_floats(a) floats).
std::size_t ssm_conv_silu_backward_scratch_floats(const SsmConvArgs& a);
void ssm_conv_silu_backward(const SsmConvArgs& a, const void* da, bool da_bf16, void* dp, float* dw, float* dbias,
                            float* scratch, cudaStream_t stream);

// ---- Δ, the written value and the broadcast log-gate ----
//   Δ[n, h] = softplus(pdt[n, h] + dt_bias[h]),  a[n, h] = −exp(A_log[h])·Δ[n, h]
//   v[n, h·P + p] = Δ[n, h]·x[n, h·P + p]  (bf16, the kernels' value)
//   g[n, h·S + i] = a[n, h]  for i < S  (fp32 [N, H·S], the channel kernels' log-gate)
struct Mamba2GateArgs {
  int64_t N = 0;
  int H = 0, P = 0, S = 0;  // heads, head (value) dim, state size (key dim)
  const float* pdt = nullptr;      // [N, H]
  const float* dt_bias = nullptr;  // [H]
  const float* A_log = nullptr;    // [H]
  const float* x = nullptr;        // [N, H·P] fp32 (the conv's SiLU output)
};
void mamba2_gates_forward(const Mamba2GateArgs& a, __nv_bfloat16* v, float* g, cudaStream_t stream);
// From the kernels' dv (bf16 [N, H·P]) and dg (fp32 [N, H·S]): dx [N, H·P] += Δ·dv;
// ddt [N, H] = ∂L/∂pdt (overwritten; also the per-token terms of ∂L/∂dt_bias); aterm [N, H] =
// (Σ_i dg)·a (overwritten; the per-token terms of ∂L/∂A_log). One warp per (token, head).
void mamba2_gates_backward(const Mamba2GateArgs& a, const __nv_bfloat16* dv, const float* dg, float* dx, float* ddt,
                           float* aterm, cudaStream_t stream);

// ---- output: y = o + D·x, then RMSNorm over groups of Di/G channels of y ⊙ SiLU(z), × wn ----
struct Mamba2OutArgs {
  int64_t N = 0;
  int H = 0, P = 0, G = 1;          // Di = H·P channels in G norm groups
  const __nv_bfloat16* o = nullptr;  // [N, Di] (the kernel's output)
  const float* x = nullptr;          // [N, Di] fp32
  const float* D = nullptr;          // [H]
  const void* z = nullptr;           // act, row stride ldz (P's z columns)
  int64_t ldz = 0;
  const float* wn = nullptr;         // [Di]
  float eps = 1e-5f;
  bool act_bf16 = false;             // z, ypre, dypre, dz
};
// ypre [N, Di] (act), rstd [N·G] fp32.
void mamba2_out_forward(const Mamba2OutArgs& a, void* ypre, float* rstd, cudaStream_t stream);
// From dypre (act [N, Di]) and the forward's rstd: dO (bf16 [N, Di], the kernels' dout), dz
// (act, row stride ldz, overwritten), dx [N, Di] = D·dy (overwritten), and the per-token terms
// of the parameter gradients: wterm [N, Di] = ∂L/∂wn's, dterm [N, Di] = dy ⊙ x (sum each head's
// P columns for ∂L/∂D); ypre (nullable): the forward's output again, bit for bit.
void mamba2_out_backward(const Mamba2OutArgs& a, const float* rstd, const void* dypre, __nv_bfloat16* dO, void* dz,
                         float* dx, float* wterm, float* dterm, void* ypre, cudaStream_t stream);

}  // namespace lar::kernels::cuda::linear
