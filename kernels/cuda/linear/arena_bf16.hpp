#pragma once
// A bf16 buffer carved from a kernels::Arena, which allocates f32, f64 and i32 tensors only:
// n bf16 elements take ⌈n/2⌉ f32 slots. The CUDA layers (trainer/mixers/*_cuda.cpp) hold
// their bf16 activations this way, so the arena's mark/release frees them with the rest.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/backend.hpp"

namespace lar::kernels::cuda::linear {

struct Bf {
  Tensor t;
  __nv_bfloat16* p = nullptr;
};

inline Bf bf_alloc(Arena& ar, int64_t n) {
  Bf b;
  b.t = ar.alloc(DType::f32, {(n + 1) / 2});
  b.p = static_cast<__nv_bfloat16*>(b.t.data);
  return b;
}

}  // namespace lar::kernels::cuda::linear
