#pragma once
// What the linear families' CUDA kernels share (kernels/delta_rule, kernels/channel_rule,
// kernels/carve, kernels/ccq; the head-shape adapters grouped_heads.hpp and wide_key.hpp): the
// shape of a call, the run's choice among bit-identical kernel paths, and the chunk. CUDA-free,
// so a model can be checked before anything runs on a GPU.
//
// Conventions of every kernel behind these shapes: bf16 activations in and out, fp32 gates, state
// and accumulation, chunk 64, plain functions on device pointers + a stream (no Backend
// dependency). Layouts (row-major, contiguous), for heads of 64:
//   q, k, dq, dk     [B, T, H, 64] bf16          (q, k already L2-normalised by the layer)
//   v, o, dv, dout   [B, T, H, 64] bf16
//   g, beta, dg, dbeta [B, T, H]   fp32          (g: log-gate ≤ 0; beta ∈ (0, 1))
//   S0, S_out, dST, dS0 [B, H, 64 (dv), 64 (dk)] fp32  (state rows = value channels, as the CPU reference)
//   boundary         [B, H, nc, 64, 64] bf16     the state at every chunk start (nc = ⌈T/64⌉),
//                                                written by the forward for the backward
// Value heads of 64·m and grouped heads go through grouped_heads.hpp, key heads of 128 and 256
// through wide_key.hpp. Any T ≥ 1 (the last chunk may be partial). Any pointer documented as
// nullable may be nullptr. Every launch goes on `stream`; bad shapes throw lar::RuntimeError.
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

// A call's head widths: key heads (q, k; the state's columns) and value heads (v, o; its rows).
// What each family's CUDA kernels take is its supports.hpp (kernels/<family>/supports.hpp),
// CUDA-free like this file, so the trainer refuses a shape before it builds a layer.
struct HeadDims {
  int64_t dk = 64, dv = 64;
};

// The widths of the delta and channel rules' kernels, whatever the mixer: key heads of 64 (the
// chunk kernels), 128 or 256 (wide_key.hpp); value heads of 64·m up to 512 (grouped_heads.hpp
// runs them as heads of 64).
constexpr bool linear_key_dim_supported(int64_t dk) { return dk == 64 || dk == 128 || dk == 256; }
constexpr bool linear_value_dim_supported(int64_t dv) { return dv >= 64 && dv <= 512 && dv % 64 == 0; }

struct DeltaShape {
  int64_t B = 1, T = 0, H = 1, dk = 64, dv = 64;
  double scale = 0.125;  // output scale (1/sqrt(dk) in docs/spec.md §1)
  KernelChoice kernels;
};

constexpr int kChunk = 64;

inline int64_t delta_num_chunks(const DeltaShape& s) { return (s.T + kChunk - 1) / kChunk; }
// Bytes of the boundary-state workspace the forward writes and the backward reads.
std::size_t delta_boundary_bytes(const DeltaShape& s);

}  // namespace lar::kernels::cuda::linear
