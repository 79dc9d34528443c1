#pragma once
// Flash-style causal softmax attention for Hopper (sm_90), bf16 in / bf16 out, fp32
// accumulation, tensor cores through mma.sync m16n8k16. GQA, optional sliding window,
// any T (tested up to 32K), head dim 64 or 128.
//
// Layouts (row-major, contiguous; the same as Backend::attention_fwd/bwd):
//   q, o, dout, dq  [B, T, Hq,  D]  bf16
//   k, v, dk, dv    [B, S, Hkv, D]  bf16      (S ≥ T; S > T is a KV cache)
//   lse             [B, Hq, T]      fp32      (natural-log log-sum-exp of each row)
// Query t sits at absolute position t + (S − T) and sees keys j ≤ pos with
// pos − j < window (window ≤ 0: unlimited); query head h uses kv head h / (Hq / Hkv).
//
// Backward is deterministic without atomics: one key-block-parallel kernel computes dk
// and dv (looping over the query heads of its kv group in a fixed order), a separate
// query-block-parallel kernel computes dq. Both recompute P from q, k and lse.
//
// All launches go on `stream`; errors throw lar::RuntimeError (bad shapes included).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/attention/supports.hpp"

namespace lar::kernels::cuda::attention {

struct FlashShape {
  int64_t B = 1, T = 0, S = 0, Hq = 1, Hkv = 1, D = 64;
  double scale = 0.125;  // multiplies q·k (usually 1/sqrt(D))
  int64_t window = 0;    // ≤ 0: full causal
  int tiles = -1;        // 0 or 1: one tile configuration for both passes (benchmarks); -1: each pass its faster
};

// o and lse are overwritten.
void flash_attention_fwd(const FlashShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k,
                         const __nv_bfloat16* v, __nv_bfloat16* o, float* lse, cudaStream_t stream);

// Device scratch the backward needs (rowwise dout·o), in bytes.
std::size_t flash_attention_bwd_workspace_bytes(const FlashShape& s);

// dq, dk, dv are overwritten. `o` and `lse` are the forward's outputs; `workspace` holds
// at least flash_attention_bwd_workspace_bytes(s) bytes (256-byte aligned).
void flash_attention_bwd(const FlashShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k,
                         const __nv_bfloat16* v, const __nv_bfloat16* o, const float* lse,
                         const __nv_bfloat16* dout, __nv_bfloat16* dq, __nv_bfloat16* dk,
                         __nv_bfloat16* dv, void* workspace, cudaStream_t stream);

}  // namespace lar::kernels::cuda::attention
