#pragma once
// Which head shapes the delta rule's CUDA kernels take (gdn, deltanet; training passes and
// decode alike), before anything runs: CUDA-free, read by the trainer's checks.
#include "kernels/linear/shape.hpp"

namespace lar::kernels::cuda::linear {

constexpr bool delta_rule_supports(HeadDims h) {
  return linear_key_dim_supported(h.dk) && linear_value_dim_supported(h.dv);
}

}  // namespace lar::kernels::cuda::linear
