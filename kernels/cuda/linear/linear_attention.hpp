#pragma once
// Fused chunkwise CUDA kernels for the linear mixers of docs/spec.md §2 on Hopper: bf16 in and out,
// fp32 state and accumulation, tensor cores through mma.sync m16n8k16, chunk 64.
//   delta_fwd / delta_bwd / delta_decode     gdn (scalar decay per token and head), deltanet
//   channel_fwd / channel_bwd                gla, kda, gdn2 (decay per key channel)
// Plain functions on device pointers + a stream (no Backend dependency), so the trainer can
// wire them in later. Tests: tests/gpu/test_linear_{delta,channel}.cpp; timings and the
// comparison with fla: dev/perf-history.md, `lar-bench linear-cuda`.
//
// The recurrence (kernels/cpu/linear/core.hpp with e = β k, z = β v; per batch b, head h):
//   S_t = S_{t−1} exp(g_t) + u_t k_tᵀ,  u_t = β_t (v_t − S_{t−1} exp(g_t) k_t),  o_t = scale S_t q_t
// gdn: scalar log-gate g_t ≤ 0 per (token, head); deltanet: g = nullptr (no decay).
//
// Layouts (row-major, contiguous):
//   q, k, dq, dk     [B, T, H, 64] bf16          (q, k already L2-normalised by the layer)
//   v, o, dv, dout   [B, T, H, 64] bf16
//   g, beta, dg, dbeta [B, T, H]   fp32          (g: log-gate ≤ 0; beta ∈ (0, 1))
//   S0, S_out, dST, dS0 [B, H, 64 (dv), 64 (dk)] fp32  (state rows = value channels, as the CPU reference)
//   boundary         [B, H, nc, 64, 64] bf16     the state at every chunk start (nc = ⌈T/64⌉),
//                                                written by the forward for the backward
// Head dims: dk = dv = 64 here; value heads of 64·m and grouped heads go through
// grouped_heads.hpp, key heads of 128 and 256 through wide_key.hpp. Any T ≥ 1 (the last chunk
// may be partial). Any pointer documented as nullable may be nullptr. Every launch goes on
// `stream`; bad shapes throw lar::RuntimeError.
//
// Structure: one CTA of 8 warps per (b, h) walks the chunks in order with the state in
// registers (forward: S; backward: dS, chunks in reverse); inside a chunk every product is a
// 64×64×64 tensor-core GEMM on shared-memory tiles, and the UT/WY solve (I + A) U = R is a
// register-resident forward substitution (fp32) spread over 4 threads per column.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.hpp"

namespace lar::kernels::cuda::linear {

// Which kernels a pass runs: the run's cuda.linear_path and cuda.ccq_* keys, through the
// mixer (kernels/cuda/cuda_backend.hpp parses them); tests and benchmarks force each path.
// automatic: the cost model beside each choice (use_two_phase, use_carve_split, use_ws,
// group_chunks).
enum class PathChoice { automatic, fused, chunked };  // delta and channel rules, CARVE
enum class CcqPath { automatic, par, ws };            // CCQ: chunk-parallel or warp-specialised
struct KernelChoice {
  PathChoice path = PathChoice::automatic;
  CcqPath ccq_fwd = CcqPath::automatic, ccq_bwd = CcqPath::automatic;
  int ccq_group = 0;  // CCQ's chunks per group of the chunk-parallel passes, 1..64; 0: per shape
};

// The choice from the run's keys ("auto" or "" for each default); lar::UserError naming the key
// for a value it does not know.
inline KernelChoice kernel_choice(const std::string& linear_path, const std::string& ccq_fwd,
                                  const std::string& ccq_bwd, int ccq_group) {
  KernelChoice c;
  if (linear_path == "fused") c.path = PathChoice::fused;
  else if (linear_path == "chunked") c.path = PathChoice::chunked;
  else if (!linear_path.empty() && linear_path != "auto")
    throw UserError("cuda.linear_path: '" + linear_path + "' is not one of auto, fused, chunked");
  const auto ccq = [](const std::string& v, const char* key) {
    if (v == "par") return CcqPath::par;
    if (v == "ws") return CcqPath::ws;
    if (!v.empty() && v != "auto") throw UserError(std::string(key) + ": '" + v + "' is not one of auto, par, ws");
    return CcqPath::automatic;
  };
  c.ccq_fwd = ccq(ccq_fwd, "cuda.ccq_fwd");
  c.ccq_bwd = ccq(ccq_bwd, "cuda.ccq_bwd");
  if (ccq_group < 0 || ccq_group > 64)
    throw UserError("cuda.ccq_group: " + std::to_string(ccq_group) + " is not from 0 to 64");
  c.ccq_group = ccq_group;
  return c;
}

struct DeltaShape {
  int64_t B = 1, T = 0, H = 1, dk = 64, dv = 64;
  double scale = 0.125;  // output scale (1/sqrt(dk) in docs/spec.md §1)
  KernelChoice kernels;
};

constexpr int kChunk = 64;

inline int64_t delta_num_chunks(const DeltaShape& s) { return (s.T + kChunk - 1) / kChunk; }
// Bytes of the boundary-state workspace the forward writes and the backward reads.
std::size_t delta_boundary_bytes(const DeltaShape& s);

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

}  // namespace lar::kernels::cuda::linear
