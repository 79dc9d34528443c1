#pragma once
// Which head dims the flash attention kernels take (flash_attention.hpp), before anything runs:
// CUDA-free.
#include <cstdint>

namespace lar::kernels::cuda::attention {

constexpr bool flash_attention_supports(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

}  // namespace lar::kernels::cuda::attention
