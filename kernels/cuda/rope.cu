// The CUDA backend's rotary position embedding: the table of rotations (double, like the CPU
// reference), the rotation of q / k in place, and the split of the fused qkv projection into
// rotated q, k and v (and its backward merge).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/backend_device.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_backend_internal.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda {

namespace {

// The table of RoPE rotations for positions pos0 … pos0+T−1: cs[t·half + p] = (cos, sin)
// of sign·(pos0+t)·base^(−2p/D), in double like the CPU reference, rounded to float.
__global__ void rope_table_kernel(float2* cs, int64_t T, int64_t D, double base, int64_t pos0, double sign) {
  const int64_t half = D / 2;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < T * half; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / half, p = i % half;
    const double ang = sign * (pos0 + t) * pow(base, -2.0 * p / D);
    cs[i] = make_float2(static_cast<float>(cos(ang)), static_cast<float>(sin(ang)));
  }
}

// x (f32 or bf16) rotated in place by sign·θ; I is the index type (32-bit when the
// element count allows: cheaper division).
template <class T, class I>
__global__ void rope_apply_kernel(T* x, const float2* cs, I B, I Tn, I H, I D, float sign) {
  const I half = D / 2, n = B * Tn * H * half;
  for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
    const I p = i % half, row = i / half, t = (row / H) % Tn;
    const float2 r = cs[t * half + p];
    const float c = r.x, sn = sign * r.y;
    T* xr = x + row * D;
    const float a = ldf(xr + p), b = ldf(xr + p + half);
    stf(xr + p, a * c - b * sn);
    stf(xr + p + half, b * c + a * sn);
  }
}

// Token tok's row of head hh of the fused qkv layout [q heads | k heads | v heads] in the
// separate q [N, Hq, D], k and v [N, Hkv, D] tensors.
template <class T, class I>
__device__ inline T* qkv_part(T* q, T* k, T* v, I tok, I hh, I Hq, I Hkv, I D) {
  if (hh < Hq) return q + (tok * Hq + hh) * D;
  if (hh < Hq + Hkv) return k + (tok * Hkv + hh - Hq) * D;
  return v + (tok * Hkv + hh - Hq - Hkv) * D;
}

// q/k/v split of one GEMM's qkv [N, Hq+2·Hkv, D] with RoPE on q and k (dir = +1), and
// its transpose (dir = −1: merge dq, dk, dv into dqkv, rotating back). One thread per
// (token, head, pair); I the index type.
template <class T, class I, int DIR>
__global__ void rope_qkv_kernel(T* qkv, T* q, T* k, T* v, const float2* cs, I N, I Tn, I Hq, I Hkv, I D) {
  const I half = D / 2, H3 = Hq + 2 * Hkv, n = N * H3 * half;
  for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
    const I p = i % half, hh = (i / half) % H3, tok = i / (half * H3), t = tok % Tn;
    T* fused = qkv + (tok * H3 + hh) * D;
    const bool rotate = hh < Hq + Hkv;  // q and k; v is copied as is
    T* part = qkv_part(q, k, v, tok, hh, Hq, Hkv, D);
    const T* src = DIR > 0 ? fused : part;
    T* dst = DIR > 0 ? part : fused;
    const float a = ldf(src + p), b = ldf(src + p + half);
    if (rotate) {
      const float2 r = cs[t * half + p];
      const float sn = DIR * r.y;
      stf(dst + p, a * r.x - b * sn);
      stf(dst + p + half, b * r.x + a * sn);
    } else {
      stf(dst + p, a);
      stf(dst + p + half, b);
    }
  }
}

// The RoPE kernels on 16-byte groups: W = 8 bf16 or 4 f32 consecutive pairs of one head
// per thread (half % W == 0, 16-byte aligned tensors), so every access is one 16-byte load
// or store and the index arithmetic is paid once per W pairs. Same arithmetic as above.
__device__ inline void ldv(const bf16* p, float (&x)[8]) { load8(p, x); }
__device__ inline void stv(bf16* p, const float (&x)[8]) { store8(p, x); }
__device__ inline void ldv(const float* p, float (&x)[4]) { ld4(p, x); }
__device__ inline void stv(float* p, const float (&x)[4]) { st4(p, x); }

template <int W>
__device__ inline void rotate_vec(float (&a)[W], float (&b)[W], const float2* cs, float sign) {
  const float4* c4 = reinterpret_cast<const float4*>(cs);
#pragma unroll
  for (int j = 0; j < W / 2; ++j) {
    const float4 r = c4[j];  // (cos, sin) of pairs 2j and 2j+1
    const float c0 = r.x, s0 = sign * r.y, c1 = r.z, s1 = sign * r.w;
    const float a0 = a[2 * j], b0 = b[2 * j], a1 = a[2 * j + 1], b1 = b[2 * j + 1];
    a[2 * j] = a0 * c0 - b0 * s0;
    b[2 * j] = b0 * c0 + a0 * s0;
    a[2 * j + 1] = a1 * c1 - b1 * s1;
    b[2 * j + 1] = b1 * c1 + a1 * s1;
  }
}

template <class T, class I>
__global__ void rope_apply_vec_kernel(T* x, const float2* cs, I B, I Tn, I H, I D, float sign) {
  constexpr int W = 16 / sizeof(T);
  const I half = D / 2, hv = half / W, n = B * Tn * H * hv;
  for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
    const I p = (i % hv) * W, row = i / hv, t = (row / H) % Tn;
    T* xr = x + row * D;
    float a[W], b[W];
    ldv(xr + p, a);
    ldv(xr + p + half, b);
    rotate_vec<W>(a, b, cs + t * half + p, sign);
    stv(xr + p, a);
    stv(xr + p + half, b);
  }
}

template <class T, class I, int DIR>
__global__ void rope_qkv_vec_kernel(T* qkv, T* q, T* k, T* v, const float2* cs, I N, I Tn, I Hq, I Hkv, I D) {
  constexpr int W = 16 / sizeof(T);
  const I half = D / 2, hv = half / W, H3 = Hq + 2 * Hkv, n = N * H3 * hv;
  for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
    const I p = (i % hv) * W, hh = (i / hv) % H3, tok = i / (hv * H3), t = tok % Tn;
    T* fused = qkv + (tok * H3 + hh) * D;
    const bool rotate = hh < Hq + Hkv;  // q and k; v is copied as is
    T* part = qkv_part(q, k, v, tok, hh, Hq, Hkv, D);
    const T* src = DIR > 0 ? fused : part;
    T* dst = DIR > 0 ? part : fused;
    float a[W], b[W];
    ldv(src + p, a);
    ldv(src + p + half, b);
    if (rotate) rotate_vec<W>(a, b, cs + t * half + p, static_cast<float>(DIR));
    stv(dst + p, a);
    stv(dst + p + half, b);
  }
}

}  // namespace

const float2* CudaBackend::rope_table(int64_t T, int64_t D, double base, int64_t pos0) {
  const int64_t half = D / 2;
  // The (cos, sin) table of positions pos0 … pos0+T−1 is cached: training calls this four
  // times per layer with the same T, so it is computed once per run.
  if (T != rope_T_ || D != rope_D_ || base != rope_base_ || pos0 != rope_pos0_) {
    if (static_cast<std::size_t>(T * half) > rope_table_n_) {
      if (rope_table_) {
        synchronize();
        track_free(rope_table_);
        LAR_CUDA_CHECK(cudaFree(rope_table_));
      }
      LAR_CUDA_CHECK(cudaMalloc(&rope_table_, T * half * sizeof(float2)));
      track_alloc(rope_table_, T * half * sizeof(float2));
      rope_table_n_ = T * half;
    }
    rope_table_kernel<<<blocks_for(T * half, 256), 256, 0, stream_>>>(static_cast<float2*>(rope_table_), T, D, base,
                                                                       pos0, 1.0);
    LAR_CUDA_LAUNCHED();
    rope_T_ = T, rope_D_ = D, rope_base_ = base, rope_pos0_ = pos0;
  }
  return static_cast<const float2*>(rope_table_);
}

void CudaBackend::rope(const Tensor& x, double base, int64_t pos0, double sign) {
  require_act(x, "rope x");
  const int64_t T = x.size(1), D = x.size(3);
  const float2* cs = rope_table(T, D, base, pos0);
  const float sg = static_cast<float>(sign);
  const int64_t pairs = x.numel() / 2;
  const int64_t W = is_bf16(x) ? 8 : 4;
  if ((D / 2) % W == 0 && aligned16(x) && pairs < (int64_t(1) << 31)) {  // 16-byte groups of W pairs
    using I = uint32_t;
    const int blocks = blocks_for(pairs / W, 256);
    if (is_bf16(x))
      rope_apply_vec_kernel<bf16, I><<<blocks, 256, 0, stream_>>>(x.ptr<bf16>(), cs, I(x.size(0)), I(T), I(x.size(2)), I(D), sg);
    else
      rope_apply_vec_kernel<float, I><<<blocks, 256, 0, stream_>>>(x.ptr<float>(), cs, I(x.size(0)), I(T), I(x.size(2)), I(D), sg);
    LAR_CUDA_LAUNCHED();
    return;
  }
  const int blocks = blocks_for(pairs, 256);
  if (pairs < (int64_t(1) << 31)) {
    using I = uint32_t;
    if (is_bf16(x))
      rope_apply_kernel<bf16, I><<<blocks, 256, 0, stream_>>>(x.ptr<bf16>(), cs, I(x.size(0)), I(T), I(x.size(2)), I(D), sg);
    else
      rope_apply_kernel<float, I><<<blocks, 256, 0, stream_>>>(x.ptr<float>(), cs, I(x.size(0)), I(T), I(x.size(2)), I(D), sg);
  } else {
    if (is_bf16(x))
      rope_apply_kernel<bf16, int64_t><<<blocks, 256, 0, stream_>>>(x.ptr<bf16>(), cs, x.size(0), T, x.size(2), D, sg);
    else
      rope_apply_kernel<float, int64_t><<<blocks, 256, 0, stream_>>>(x.ptr<float>(), cs, x.size(0), T, x.size(2), D, sg);
  }
  LAR_CUDA_LAUNCHED();
}

namespace {
template <class T, int DIR>
void rope_qkv_launch(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v, const float2* cs,
                     cudaStream_t st) {
  const int64_t N = q.size(0) * q.size(1), Tn = q.size(1), Hq = q.size(2), Hkv = k.size(2), D = q.size(3);
  const int64_t n = N * (Hq + 2 * Hkv) * (D / 2);
  constexpr int64_t W = 16 / sizeof(T);
  if ((D / 2) % W == 0 && aligned16(qkv) && aligned16(q) && aligned16(k) && aligned16(v) && n < (int64_t(1) << 31)) {
    using I = uint32_t;  // 16-byte groups of W pairs per thread
    rope_qkv_vec_kernel<T, I, DIR><<<blocks_for(n / W, 256), 256, 0, st>>>(qkv.ptr<T>(), q.ptr<T>(), k.ptr<T>(),
                                                                         v.ptr<T>(), cs, I(N), I(Tn), I(Hq), I(Hkv), I(D));
    LAR_CUDA_LAUNCHED();
    return;
  }
  const int blocks = blocks_for(n, 256);
  if (n < (int64_t(1) << 31)) {
    using I = uint32_t;
    rope_qkv_kernel<T, I, DIR><<<blocks, 256, 0, st>>>(qkv.ptr<T>(), q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), cs, I(N),
                                                       I(Tn), I(Hq), I(Hkv), I(D));
  } else {
    rope_qkv_kernel<T, int64_t, DIR><<<blocks, 256, 0, st>>>(qkv.ptr<T>(), q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), cs, N,
                                                             Tn, Hq, Hkv, D);
  }
  LAR_CUDA_LAUNCHED();
}
void check_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.ndim != 4 || k.ndim != 4 || v.ndim != 4 || k.shape() != v.shape() || q.size(3) != k.size(3) ||
      q.size(0) != k.size(0) || q.size(1) != k.size(1) || q.size(3) % 2 != 0 ||
      qkv.numel() != q.size(0) * q.size(1) * (q.size(2) + 2 * k.size(2)) * q.size(3))
    throw RuntimeError("cuda rope qkv: qkv " + qkv.shape_str() + " does not hold q " + q.shape_str() + ", k " +
                       k.shape_str() + ", v " + v.shape_str());
  if (q.dtype != qkv.dtype || k.dtype != qkv.dtype || v.dtype != qkv.dtype)
    throw RuntimeError("cuda rope qkv: q, k, v and qkv must have one dtype");
  require_act(qkv, "rope qkv");
}
}  // namespace

void CudaBackend::rope_split_qkv(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v, double base,
                                 int64_t pos0) {
  OpTimer timer(*this, "rope");
  check_qkv(qkv, q, k, v);
  const float2* cs = rope_table(q.size(1), q.size(3), base, pos0);
  if (is_bf16(qkv)) rope_qkv_launch<bf16, 1>(qkv, q, k, v, cs, stream_);
  else rope_qkv_launch<float, 1>(qkv, q, k, v, cs, stream_);
}

void CudaBackend::rope_merge_qkv(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dqkv,
                                 double base, int64_t pos0) {
  OpTimer timer(*this, "rope");
  check_qkv(dqkv, dq, dk, dv);
  touch(dqkv);
  const float2* cs = rope_table(dq.size(1), dq.size(3), base, pos0);
  if (is_bf16(dqkv)) rope_qkv_launch<bf16, -1>(dqkv, dq, dk, dv, cs, stream_);
  else rope_qkv_launch<float, -1>(dqkv, dq, dk, dv, cs, stream_);
}

void CudaBackend::rope_fwd(const Tensor& x, double base, int64_t pos0) {
  OpTimer timer(*this, "rope");
  rope(x, base, pos0, 1.0);
}

void CudaBackend::rope_bwd(const Tensor& dx, double base, int64_t pos0) {
  OpTimer timer(*this, "rope");
  rope(dx, base, pos0, -1.0);
}

}  // namespace lar::kernels::cuda
