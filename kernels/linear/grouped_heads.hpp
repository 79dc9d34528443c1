#pragma once
// The chunk kernels of the delta and channel rules (kernels/delta_rule, kernels/channel_rule) at
// any value width dv = 64·m and with grouped heads: Hk key heads (q, k) serve H = G·Hk value
// heads (v, β, the decay gate, gdn2's b and w, the state), value head j reading key head
// j / G — fla's `repeat '... h d -> ... (h g) d'` on q and k.
//
// Every rule updates the state's value rows independently given the keys (S_t row i depends
// on v_ti and on k, q, the gates only), so value head j of dv channels runs as m virtual heads
// of 64 channels that share its q, k and gates: virtual head u = j·m + i holds the value
// channels 64i..64i+63 and reads key head u / (G·m). The value-side tensors ([B,T,H,dv] and
// the state [B,H,dv,64]) are already laid out as [B,T,H·m,64] and [B,H·m,64,64]; q, k and the
// per-value-head gates are copied out to the virtual heads, the 64-wide kernels run on those,
// and the virtual heads' gradients on q, k and the gates are summed back in a fixed order
// (deterministic, no atomics). G = m = 1 calls the kernels directly.
//
// Layouts (row-major): q, k [B,T,Hk,64] bf16; v, o, dv, dout, gdn2's w [B,T,H,dv] bf16;
// gdn's g and β [B,T,H] fp32; the channel gate g [B,T,H,64] fp32, gdn2's b [B,T,H,64] bf16;
// S0, S_out, dST, dS0 [B,H,dv,64] fp32; boundary grouped_boundary_bytes. The decodes take the
// same layouts without T. Key dim 64 here; dk ∈ {128, 256} (which couples the key channels
// inside the chunk products and the solve) goes to the recurrent kernels of wide_key.hpp,
// whose boundary workspace grouped_boundary_bytes then sizes. Tests:
// kernels/linear/test_grouped_heads_cuda.cpp, kernels/linear/test_wide_key_cuda.cpp.
//
// The key-block split. gla's recurrence (and linear's, gla with a zero log-gate) never mixes
// key channels: S_t = S_{t−1} diag(exp g_t) + v_t k_tᵀ, o_t = scale S_t q_t, so a key dim
// dk = 64·n is n independent problems of 64 key channels — block b reads q, k, g at channels
// 64b..64b+63 and the whole v; o = Σ_b o_b, dv = Σ_b dv_b; dq, dk, dg are per block; the
// state's columns 64b..64b+63 are block b's state. The split runs the n blocks as one call
// of the 64-wide path over n·B sequences (sequence b·B + i is block b of sequence i: the
// boundary layout then depends on the value heads only, as the other paths', so a readout
// over per-value-head keys reuses the main pass's boundary), with q, k, g, S0, dST split into
// column blocks, v and dout repeated per block, and o, dv summed over the blocks in fp32 in
// order of b (each block's part is bf16, the sum rounds once; deterministic, no atomics). It
// takes dk = 64·n for n = 2..8 (key_split_gate.hpp: key_split_dim), so gla runs at dk 192 and
// 320..512, which the recurrent kernels do not take, on the split alone. The decode (one token)
// keeps the recurrent decode at 128 and 256 (it reads the state once, in place); at the other
// split dims it runs the same way as n 64-wide decodes over n·B sequences: the state's n column
// blocks copied out and back, q, k, g split, v repeated, o summed over the blocks in fp32 in
// order of b and rounded once. The delta-rule mixers (k·S couples the key channels) stay on the
// recurrent kernels. Until the split has passed its GPU tests (kernels/linear/test_wide_key_cuda.cpp,
// KeySplit*) the product keeps the recurrent kernels and refuses the split-only dims by the
// gate's name; the tests and `lar-bench linear-cuda --key-split` open it with the hook of
// key_split_gate.hpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/channel_rule/channel_rule.hpp"
#include "kernels/linear/key_split_gate.hpp"

namespace lar::kernels::cuda::linear {

struct GroupedShape {
  int64_t B = 1, T = 0;
  int64_t H = 1;   // value heads
  int64_t Hk = 0;  // key heads (0: H); H must be a multiple
  int64_t dk = 64, dv = 64;
  double scale = 0.125;
  KernelChoice kernels;  // (shape.hpp)
  bool key_split = true;  // false: never gla's key-block split (the state-space layers: ssm_key_split_open)
};

// Bytes of the boundary workspace (the forward writes it, the backward reads it): for any
// mixer (while the key-block split is open, the larger of its need and the recurrent
// kernels'; at the split-only key dims, the split's); grouped_channel_boundary_bytes gives the
// exact need of channel mixer m. A key dim no path takes (or a split-only one while the gate is
// closed) is a RuntimeError naming the supported dims and, for the latter, the gate.
std::size_t grouped_boundary_bytes(const GroupedShape& s);
std::size_t grouped_channel_boundary_bytes(ChannelMixer m, const GroupedShape& s);

// The key-block split's gate (kWideKeySplitVerified, wide_key_split_unverified_allowed():
// key_split_gate.hpp). True when grouped_channel_fwd / grouped_channel_bwd run mixer m at shape
// s as key blocks: gla at key_split_dim(dk) with the gate open and s.key_split (at dk 128 and
// 256 for T ≥ 1).
bool grouped_channel_key_split(ChannelMixer m, const GroupedShape& s);
// True when grouped_channel_decode runs mixer m at shape s as key blocks: gla at the split's key
// dims but 128 and 256, with the gate open and s.key_split.
bool grouped_channel_decode_key_split(ChannelMixer m, const GroupedShape& s);

void grouped_delta_fwd(const GroupedShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k,
                       const __nv_bfloat16* v, const float* g, const float* beta, const float* S0,
                       __nv_bfloat16* o, float* S_out, __nv_bfloat16* boundary, cudaStream_t stream);
void grouped_delta_bwd(const GroupedShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k,
                       const __nv_bfloat16* v, const float* g, const float* beta,
                       const __nv_bfloat16* boundary, const __nv_bfloat16* dout, const float* dST,
                       __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, float* dg, float* dbeta,
                       float* dS0, cudaStream_t stream);
void grouped_delta_decode(const GroupedShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k,
                          const __nv_bfloat16* v, const float* g, const float* beta, float* S,
                          __nv_bfloat16* o, cudaStream_t stream);

void grouped_channel_fwd(ChannelMixer m, const GroupedShape& s, const ChannelInputs& in, __nv_bfloat16* o,
                         float* S_out, __nv_bfloat16* boundary, cudaStream_t stream);
void grouped_channel_bwd(ChannelMixer m, const GroupedShape& s, const ChannelInputs& in,
                         const __nv_bfloat16* boundary, const __nv_bfloat16* dout, const float* dST,
                         const ChannelGrads& gr, cudaStream_t stream);
void grouped_channel_decode(ChannelMixer m, const GroupedShape& s, const ChannelInputs& in, float* S,
                            __nv_bfloat16* o, cudaStream_t stream);

// The same mapping for callers whose query is per value head (the layer's CCQ correction with
// its λ per value head, CARVE, the cler/cler_h readout whose shifted query carries the value
// head's gates), which run the kernels over q, k repeated per group: dst [rows, Hk·G, w] =
// src [rows, Hk, w] with every head repeated G times; and the sum back of a gradient on the
// repeated heads, dst [rows, Hk, w] = Σ_{u<G} src [rows, Hk·G, w] at head j·G + u (in order of
// u, in fp32: deterministic; the bf16 one rounds once, as the grouped kernels' own sums do).
void repeat_heads(const __nv_bfloat16* src, __nv_bfloat16* dst, int64_t rows, int Hk, int G, int w,
                  cudaStream_t stream);
void sum_head_groups(const float* src, float* dst, int64_t rows, int Hk, int G, int w, cudaStream_t stream);
void sum_head_groups(const __nv_bfloat16* src, __nv_bfloat16* dst, int64_t rows, int Hk, int G, int w,
                     cudaStream_t stream);

}  // namespace lar::kernels::cuda::linear
