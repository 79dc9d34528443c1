#pragma once
// Which key heads CCQ's CUDA kernels take, before anything runs: CUDA-free. 64 (ccq.cu), 128 and
// 256 (ccq_wide.cu); the value side is the backbone's (its own supports.hpp).
#include <cstdint>

#include "kernels/linear/shape.hpp"

namespace lar::kernels::cuda::linear {

constexpr bool ccq_supports(int64_t dk) { return linear_key_dim_supported(dk); }

}  // namespace lar::kernels::cuda::linear
