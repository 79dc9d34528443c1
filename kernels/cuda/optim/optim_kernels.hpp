#pragma once
// Device kernels of the optimiser updates (Backend's "optimiser updates" section; the
// CudaBackend methods are thin wrappers). fp32 in and out, written with explicit
// round-to-nearest intrinsics (no FMA contraction) so that each element gets exactly the
// bits the host Optimizer (trainer/optim/optimizer.cpp) computes for it.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/backend.hpp"

namespace lar::kernels::cuda::optim {

// mirror (optional, else nullptr): also writes the new w rounded to bf16 there (the
// backend's bf16 weight mirror, kept fresh by the update instead of a separate pass).
// Vectorised (16-byte accesses) where w, g, m, v are 16-byte aligned; the same bits either way.
void adamw_step(float* w, const float* g, float* m, float* v, int64_t n, const Backend::AdamWStep& s,
                uint16_t* mirror, cudaStream_t st);
// Backend::adamw_step_multi in one launch per 48 segments (blocks of 4096 elements, each
// finding its segment in a table passed by value); mirror as above (indexed like w).
void adamw_step_multi(float* w, const float* g, float* m, float* v, const std::vector<Backend::AdamWSegment>& segs,
                      uint16_t* mirror, cudaStream_t st);
void momentum_step(const float* g, float* buf, float* u, int64_t n, float mu, bool nesterov, cudaStream_t st);
void scale(float* x, int64_t n, float alpha, cudaStream_t st);
// dst [c,r] = alpha·srcᵀ, src [r,c].
void transpose(const float* src, float* dst, int64_t r, int64_t c, float alpha, cudaStream_t st);
// `scratch` holds at least normuon_scratch_doubles(rows, cols) doubles of device memory.
int64_t normuon_scratch_doubles(int64_t rows, int64_t cols);
void normuon_normalize(float* o, float* V, int64_t rows, int64_t cols, double beta2, double eps, double* scratch,
                       cudaStream_t st);
void decayed_update(float* w, const float* o, int64_t n, float decay, float step, cudaStream_t st);
// dst = a·src, or dst [c,r] = a·srcᵀ for src [r,c] when `transposed`, with
// a = float(1 / (sqrt(*sum_sq) + eps)) evaluated on the device in double (sum_sq: device memory).
void scale_by_inv_norm(const float* src, float* dst, int64_t r, int64_t c, bool transposed, const double* sum_sq,
                       double eps, cudaStream_t st);

}  // namespace lar::kernels::cuda::optim
