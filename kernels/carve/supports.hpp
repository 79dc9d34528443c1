#pragma once
// Which shapes CARVE's CUDA kernels take, before anything runs: CUDA-free, read by the trainer's
// checks. The chunk kernels take heads of 64 and the recurrent ones (carve_wide.cu) key or value
// heads of 128; the decode heads of 64 only. The content chunk is the kernels' chunk.
#include <cstdint>

#include "kernels/linear/shape.hpp"

namespace lar::kernels::cuda::linear {

constexpr int64_t kCarveContentChunk = kChunk;

constexpr bool carve_head_dim_supported(int64_t d) { return d == 64 || d == 128; }
constexpr bool carve_supports(HeadDims h) { return carve_head_dim_supported(h.dk) && carve_head_dim_supported(h.dv); }
constexpr bool carve_decode_supports(HeadDims h) { return h.dk == 64 && h.dv == 64; }

}  // namespace lar::kernels::cuda::linear
