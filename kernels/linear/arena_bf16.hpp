#pragma once
// Arena-backed helpers of the CUDA layers (trainer/mixers/*_cuda.cpp). A bf16 buffer carved
// from a kernels::Arena, which allocates f32, f64 and i32 tensors only: n bf16 elements take
// ⌈n/2⌉ f32 slots, so the arena's mark/release frees the layers' bf16 activations with the
// rest. A tensor in a given dtype, and a parameter's column sums, with scratch from the arena.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/backend.hpp"
#include "kernels/linear/layer_ops.hpp"

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

// t in dtype at: t itself, or a converted copy in the arena.
inline Tensor as_dtype(Backend& be, Arena& ar, const Tensor& t, DType at) {
  if (t.dtype == at) return t;
  Tensor c = ar.alloc(at, t.shape());
  be.convert(t, c);
  return c;
}

// grad[j] += Σ_n Σ_{c in group j} M[n, c] for the fp32 [N, C] M (deterministic), timed as label.
inline void colsum_into(Arena& ar, cudaStream_t st, const Tensor& M, int group, float* grad, const char* label) {
  Tensor scratch = ar.alloc(DType::f32, {(int64_t)colsum_scratch_floats(M.size(0), (int)M.size(1))});
  LayerTimer tm(label, st);
  colsum_accumulate(M.ptr<float>(), M.size(0), (int)M.size(1), M.size(1), group, grad, scratch.ptr<float>(), st);
}

}  // namespace lar::kernels::cuda::linear
