// The CUDA backend's SwiGLU ops: h = SiLU(gate) ⊙ up over the fused [gate | up] rows, its
// backward, and the backward fused with the forward's recomputation (f32 or bf16, 8 bf16 at a
// time where rows allow).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/backend_device.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_backend_internal.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda {

namespace {

// ---------------------------------------------------------------- SwiGLU
__device__ inline float sigmoidf_(float z) { return 1.f / (1.f + expf(-z)); }

// Typed SwiGLU (any mix of f32/bf16 storage): rows over blocks, columns over threads
// (no 64-bit division per element).
template <class TG, class TH>
__global__ void swiglu_fwd_typed(const TG* gu, TH* h, int64_t n, int64_t f) {
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x)
    for (int64_t c = threadIdx.x; c < f; c += blockDim.x) {
      const float g = ldf(gu + row * 2 * f + c), u = ldf(gu + row * 2 * f + f + c);
      stf(h + row * f + c, g * sigmoidf_(g) * u);
    }
}

template <class TG, class TD>
__global__ void swiglu_bwd_typed(const TG* gu, const TD* dh, TG* dgu, int64_t n, int64_t f) {
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x)
    for (int64_t c = threadIdx.x; c < f; c += blockDim.x) {
      const float g = ldf(gu + row * 2 * f + c), u = ldf(gu + row * 2 * f + f + c);
      const float sg = sigmoidf_(g), dd = ldf(dh + row * f + c);
      stf(dgu + row * 2 * f + c, dd * u * sg * (1.f + g * (1.f - sg)));
      stf(dgu + row * 2 * f + f + c, dd * g * sg);
    }
}

// All-bf16 SwiGLU, 8 columns per thread (f % 8 == 0): 16-byte loads and stores.
__global__ void swiglu_fwd_bf16x8(const bf16* gu, bf16* h, int64_t n, int64_t f) {
  const int64_t f8 = f / 8;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x)
    for (int64_t c8 = threadIdx.x; c8 < f8; c8 += blockDim.x) {
      float g[8], u[8], o[8];
      load8(gu + row * 2 * f + c8 * 8, g);
      load8(gu + row * 2 * f + f + c8 * 8, u);
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = g[k] * sigmoidf_(g[k]) * u[k];
      store8(h + row * f + c8 * 8, o);
    }
}

__global__ void swiglu_bwd_bf16x8(const bf16* gu, const bf16* dh, bf16* dgu, int64_t n, int64_t f) {
  const int64_t f8 = f / 8;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x)
    for (int64_t c8 = threadIdx.x; c8 < f8; c8 += blockDim.x) {
      float g[8], u[8], dd[8], dg[8], du[8];
      load8(gu + row * 2 * f + c8 * 8, g);
      load8(gu + row * 2 * f + f + c8 * 8, u);
      load8(dh + row * f + c8 * 8, dd);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float sg = sigmoidf_(g[k]);
        dg[k] = dd[k] * u[k] * sg * (1.f + g[k] * (1.f - sg));
        du[k] = dd[k] * g[k] * sg;
      }
      store8(dgu + row * 2 * f + c8 * 8, dg);
      store8(dgu + row * 2 * f + f + c8 * 8, du);
    }
}

// swiglu_bwd_bf16x8 that also writes h = silu(g)·u (the forward's output, recomputed in
// the backward instead of stored): one read of gu serves both.
__global__ void swiglu_bwd_fwd_bf16x8(const bf16* gu, const bf16* dh, bf16* dgu, bf16* h, int64_t n, int64_t f) {
  const int64_t f8 = f / 8;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x)
    for (int64_t c8 = threadIdx.x; c8 < f8; c8 += blockDim.x) {
      float g[8], u[8], dd[8], dg[8], du[8], o[8];
      load8(gu + row * 2 * f + c8 * 8, g);
      load8(gu + row * 2 * f + f + c8 * 8, u);
      load8(dh + row * f + c8 * 8, dd);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float sg = sigmoidf_(g[k]);
        o[k] = g[k] * sg * u[k];
        dg[k] = dd[k] * u[k] * sg * (1.f + g[k] * (1.f - sg));
        du[k] = dd[k] * g[k] * sg;
      }
      store8(dgu + row * 2 * f + c8 * 8, dg);
      store8(dgu + row * 2 * f + f + c8 * 8, du);
      store8(h + row * f + c8 * 8, o);
    }
}

}  // namespace

namespace {
unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, 65535 * 8)); }
template <class A, class Bt>
void swiglu_fwd_launch(const Tensor& gu, const Tensor& h, cudaStream_t st) {
  swiglu_fwd_typed<<<row_blocks(h.rows()), 256, 0, st>>>(gu.ptr<A>(), h.ptr<Bt>(), h.rows(), h.last());
}
template <class A, class D>
void swiglu_bwd_launch(const Tensor& gu, const Tensor& dh, const Tensor& dgu, cudaStream_t st) {
  swiglu_bwd_typed<<<row_blocks(dh.rows()), 256, 0, st>>>(gu.ptr<A>(), dh.ptr<D>(), dgu.ptr<A>(), dh.rows(),
                                                          dh.last());
}
}  // namespace

void CudaBackend::swiglu_fwd(const Tensor& gu, const Tensor& h) {
  OpTimer timer(*this, "swiglu");
  require_act(gu, "swiglu gu");
  require_act(h, "swiglu h");
  const int64_t n = h.rows(), f = h.last();
  if (gu.numel() != 2 * n * f) throw RuntimeError("cuda swiglu_fwd: gu " + gu.shape_str() + ", h " + h.shape_str());
  if (is_bf16(gu) && is_bf16(h) && f % 8 == 0 && aligned16(gu) && aligned16(h))
    swiglu_fwd_bf16x8<<<row_blocks(n), 128, 0, stream_>>>(gu.ptr<bf16>(), h.ptr<bf16>(), n, f);
  else if (is_bf16(gu))
    is_bf16(h) ? swiglu_fwd_launch<bf16, bf16>(gu, h, stream_) : swiglu_fwd_launch<bf16, float>(gu, h, stream_);
  else
    is_bf16(h) ? swiglu_fwd_launch<float, bf16>(gu, h, stream_) : swiglu_fwd_launch<float, float>(gu, h, stream_);
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::swiglu_bwd(const Tensor& gu, const Tensor& dh, const Tensor& dgu) {
  OpTimer timer(*this, "swiglu");
  require_act(gu, "swiglu gu");
  require_act(dh, "swiglu dh");
  if (dgu.dtype != gu.dtype) throw RuntimeError("cuda swiglu_bwd: dgu must have gu's dtype");
  const int64_t n = dh.rows(), f = dh.last();
  if (gu.numel() != 2 * n * f || dgu.numel() != gu.numel())
    throw RuntimeError("cuda swiglu_bwd: gu " + gu.shape_str() + ", dh " + dh.shape_str());
  if (is_bf16(gu) && is_bf16(dh) && f % 8 == 0 && aligned16(gu) && aligned16(dh) && aligned16(dgu))
    swiglu_bwd_bf16x8<<<row_blocks(n), 128, 0, stream_>>>(gu.ptr<bf16>(), dh.ptr<bf16>(), dgu.ptr<bf16>(), n, f);
  else if (is_bf16(gu))
    is_bf16(dh) ? swiglu_bwd_launch<bf16, bf16>(gu, dh, dgu, stream_)
                : swiglu_bwd_launch<bf16, float>(gu, dh, dgu, stream_);
  else
    is_bf16(dh) ? swiglu_bwd_launch<float, bf16>(gu, dh, dgu, stream_)
                : swiglu_bwd_launch<float, float>(gu, dh, dgu, stream_);
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::swiglu_bwd_fwd(const Tensor& gu, const Tensor& dh, const Tensor& dgu, const Tensor& h) {
  if (!(is_bf16(gu) && is_bf16(dh) && is_bf16(dgu) && is_bf16(h) && dh.last() % 8 == 0 && aligned16(gu) &&
        aligned16(dh) && aligned16(dgu) && aligned16(h)))
    return Backend::swiglu_bwd_fwd(gu, dh, dgu, h);
  OpTimer timer(*this, "swiglu");
  const int64_t n = dh.rows(), f = dh.last();
  if (gu.numel() != 2 * n * f || dgu.numel() != gu.numel() || h.numel() != dh.numel())
    throw RuntimeError("cuda swiglu_bwd_fwd: gu " + gu.shape_str() + ", dh " + dh.shape_str() + ", h " + h.shape_str());
  swiglu_bwd_fwd_bf16x8<<<row_blocks(n), 128, 0, stream_>>>(gu.ptr<bf16>(), dh.ptr<bf16>(), dgu.ptr<bf16>(),
                                                           h.ptr<bf16>(), n, f);
  LAR_CUDA_LAUNCHED();
}

}  // namespace lar::kernels::cuda
