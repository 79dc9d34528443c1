#pragma once
// Which head shapes the channel rule's CUDA kernels take (gla, kda, gdn2; training passes and
// decode alike), before anything runs: CUDA-free, read by the trainer's checks. gla also runs at
// key heads of 192 and 320..512 on the key-block split of grouped_heads.hpp, behind its gate
// (kernels/linear/key_split_gate.hpp); the layers that use it check that gate themselves.
#include "kernels/linear/shape.hpp"

namespace lar::kernels::cuda::linear {

constexpr bool channel_rule_supports(HeadDims h) {
  return linear_key_dim_supported(h.dk) && linear_value_dim_supported(h.dv);
}

}  // namespace lar::kernels::cuda::linear
