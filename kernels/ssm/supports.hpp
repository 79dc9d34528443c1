#pragma once
// Which shapes the Mamba-2 and Mamba-3 CUDA layers' kernels take, before anything runs:
// CUDA-free, read by the trainer's checks. Their recurrence runs on the channel rule's recurrent
// wide-key kernels (kernels/linear/wide_key.hpp: exact at any chunk size), so the state size is
// its key dim (128 or 256) and the head dim its value dim (64·m up to 512); Mamba-3's per-token
// kernels (mamba3_ops.cu) hold the R rows of its MIMO q and k in registers, up to kMamba3MaxRank.
#include <cstdint>

#include "kernels/linear/shape.hpp"

namespace lar::kernels::cuda::linear {

constexpr int kMamba3MaxRank = 4;

constexpr bool ssm_state_supported(int64_t state_size) { return state_size == 128 || state_size == 256; }
constexpr bool ssm_head_supported(int64_t head_dim) { return linear_value_dim_supported(head_dim); }
constexpr bool mamba3_rank_supported(int rank) { return rank >= 1 && rank <= kMamba3MaxRank; }

}  // namespace lar::kernels::cuda::linear
