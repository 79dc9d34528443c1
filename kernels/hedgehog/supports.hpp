#pragma once
// Which heads the Hedgehog feature-map kernels take (hedgehog_ops.hpp), before anything runs:
// CUDA-free. The recurrence behind the map is the channel rule's (gla at key dim 2·dk padded to
// 64, 128 or 256: kernels/channel_rule/supports.hpp, and the key-block split beyond).
#include <cstdint>

namespace lar::kernels::cuda::linear {

// The widest map head (dk) the kernels take.
constexpr int kHedgehogMaxDim = 256;

constexpr bool hedgehog_map_supports(int64_t dk) { return dk >= 1 && dk <= kHedgehogMaxDim; }

}  // namespace lar::kernels::cuda::linear
