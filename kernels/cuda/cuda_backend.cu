// The CUDA backend's kernels (fp32 math, double where the CPU reference reduces in
// double; storage fp32 or, for activations in mixed precision, bf16). Written to be
// obviously right first: one warp per attention row, one block per normalisation row, no
// atomics so every result is bit-reproducible. The tensor-core bf16 paths that make it
// fast build on this and are checked against it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cub/device/device_radix_sort.cuh>
#include <cuda.h>

#include "core/env.hpp"
#include "kernels/cuda/attention/cudnn_attention.hpp"
#include "kernels/cuda/attention/flash_attention.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_backend_internal.hpp"
#include "kernels/cuda/backend_device.cuh"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/linear/linear_attention.hpp"
#include "kernels/cuda/optim/optim_kernels.hpp"

namespace lar::kernels::cuda {

namespace {
// ---------------------------------------------------------------- elementwise
__global__ void fill_kernel(float* x, int64_t n, float v) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = v;
}

__global__ void axpy_kernel(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] += alpha * x[i];
}

// Element i of an fp32 or bf16 tensor as float; 16 bytes of them (4 fp32 or 8 bf16) at once.
__device__ inline float elem_f(const float* x, int64_t i) { return x[i]; }
__device__ inline float elem_f(const __nv_bfloat16* x, int64_t i) { return __bfloat162float(x[i]); }
__device__ inline void vec16_f(const float* p, float (&v)[4]) {
  const float4 u = *reinterpret_cast<const float4*>(p);
  v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w;
}
__device__ inline void vec16_f(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x, v[2 * k + 1] = f.y;
  }
}

// Per-block partial sums of x² (double), then one block adds the partials in order. T is
// float or bf16: n counts elements of T (a bf16 tensor read as fp32 would run past its end).
template <class T>
__global__ void sum_squares_partial(const T* x, int64_t n, double* partial) {
  constexpr int kV = 16 / sizeof(T);  // elements per 16-byte load (the grad norm reads 1.4 GB)
  double acc = 0;
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const int64_t nv = n / kV;
#pragma unroll 4
    for (int64_t i = tid; i < nv; i += stride) {
      float v[kV];
      vec16_f(x + i * kV, v);
#pragma unroll
      for (int e = 0; e < kV; ++e) acc += static_cast<double>(v[e]) * v[e];
    }
    done = nv * kV;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    const double v = elem_f(x, i);
    acc += v * v;
  }
  double s = block_sum_d(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// Per-block counts of non-finite elements (T float or bf16).
template <class T>
__global__ void nonfinite_partial(const T* x, int64_t n, double* partial) {
  double acc = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    acc += isfinite(elem_f(x, i)) ? 0.0 : 1.0;
  double s = block_sum_d(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// The partials added by one block in a fixed tree (warp shuffles, then the warps in order):
// deterministic for a fixed n. (One thread adding them in sequence waited on each load.)
__global__ void sum_partials(const double* partial, int n, double* out) {
  double v = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) v += partial[i];
  v = block_sum_d(v);
  if (threadIdx.x == 0) *out = v;
}

// One CUDA block per norm block (Backend::block_sum_squares): block b lies in the last range
// whose first block is ≤ b; tab holds (offset, n, out, first block) per range. Threads add
// strided elements in double, then block_sum_d's fixed tree: deterministic.
__global__ void block_sum_squares_kernel(const float* x, const int64_t* tab, int nr, int64_t block, double* out) {
  const int64_t b = blockIdx.x;
  int lo = 0, hi = nr - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tab[4 * mid + 3] <= b) lo = mid;
    else hi = mid - 1;
  }
  const int64_t k = b - tab[4 * lo + 3];
  const int64_t start = tab[4 * lo] + k * block, len = min(block, tab[4 * lo + 1] - k * block);
  double acc = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const double v = x[start + i];
    acc += v * v;
  }
  const double s = block_sum_d(acc);
  if (threadIdx.x == 0) out[tab[4 * lo + 2] + k] = s;
}

// ---------------------------------------------------------------- embedding
__global__ void embedding_fwd_kernel(const int* ids, const float* table, float* out, int64_t n, int64_t d) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * d; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t row = i / d, col = i % d;
    out[i] = table[static_cast<int64_t>(ids[row]) * d + col];
  }
}

// The same with a warp per token row and 16-byte accesses (d % 4 == 0, 16-byte aligned rows):
// the scalar kernel's 64-bit division per element made it slower than its bytes.
__global__ void embedding_fwd_rows(const int* __restrict__ ids, const float4* __restrict__ table,
                                   float4* __restrict__ out, int64_t n, int64_t d4) {
  const int64_t row = blockIdx.x * (int64_t)(blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (row >= n) return;
  const float4* src = table + static_cast<int64_t>(ids[row]) * d4;
  float4* dst = out + row * d4;
#pragma unroll 4
  for (int64_t c = threadIdx.x % kWarp; c < d4; c += kWarp) dst[c] = src[c];
}

__global__ void iota_kernel(int* x, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = static_cast<int>(i);
}

// The backward over token positions sorted by id (a stable radix sort: positions of one id
// stay in token order). Block i handles the run of equal ids that starts at sorted position
// i (other blocks exit at once); its warps take 4-column groups (lane c: columns 4c…4c+3
// of a 128-column chunk) and add the run's dout rows four at a time (four loads in flight)
// but in token order, starting from the table row's old value: no atomics, the same bits
// as a sequential loop. Ids outside [0, V) are skipped. d % 4 == 0, 16-byte aligned rows.
constexpr int kEmbWarps = 8;
__global__ void __launch_bounds__(32 * kEmbWarps) embedding_bwd_sorted_kernel(const int* keys, const int* pos,
                                                                              const float* dout, float* dtable,
                                                                              int64_t n, int64_t d, int64_t V) {
  const int64_t i = blockIdx.x;
  const int id = keys[i];
  if ((i > 0 && keys[i - 1] == id) || id < 0 || id >= V) return;
  const int lane = threadIdx.x % kWarp, wid = threadIdx.x / kWarp;
  int64_t e = i;  // the run's end: keys are sorted, so equal ids are contiguous
  for (;;) {
    const int64_t j = e + lane;
    const unsigned same = __ballot_sync(0xffffffffu, j < n && keys[j] == id);
    if (same == 0xffffffffu) {
      e += kWarp;
      continue;
    }
    e += __ffs(~same) - 1;
    break;
  }
  for (int64_t c = (wid * (int64_t)kWarp + lane) * 4; c < d; c += kEmbWarps * kWarp * 4) {
    float* row = dtable + static_cast<int64_t>(id) * d + c;
    float4 acc = *reinterpret_cast<const float4*>(row);
    int64_t j = i;
    for (; j + 4 <= e; j += 4) {
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = *reinterpret_cast<const float4*>(dout + static_cast<int64_t>(pos[j + u]) * d + c);
#pragma unroll
      for (int u = 0; u < 4; ++u) acc.x += v[u].x, acc.y += v[u].y, acc.z += v[u].z, acc.w += v[u].w;
    }
    for (; j < e; ++j) {
      const float4 v = *reinterpret_cast<const float4*>(dout + static_cast<int64_t>(pos[j]) * d + c);
      acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
    }
    *reinterpret_cast<float4*>(row) = acc;
  }
}

// The same for any d (one column per thread).
__global__ void embedding_bwd_sorted_scalar(const int* keys, const int* pos, const float* dout, float* dtable,
                                            int64_t n, int64_t d, int64_t V) {
  const int64_t i = blockIdx.x;
  const int id = keys[i];
  if ((i > 0 && keys[i - 1] == id) || id < 0 || id >= V) return;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float* row = dtable + static_cast<int64_t>(id) * d + c;
    float acc = *row;
    for (int64_t j = i; j < n && keys[j] == id; ++j) acc += dout[static_cast<int64_t>(pos[j]) * d + c];
    *row = acc;
  }
}

// Four elements per thread step (16-byte loads, 8-byte stores) where both pointers allow it:
// the scalar loop moved ≈ 2 TB/s. Grids of blocks_for((n + 3) / 4, …) threads suffice then.
__global__ void f32_to_bf16_kernel(const float* __restrict__ x, __nv_bfloat16* __restrict__ y, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(x) & 15) | (reinterpret_cast<uintptr_t>(y) & 7)) == 0) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      const float4 v = reinterpret_cast<const float4*>(x)[i];
      reinterpret_cast<Bf16x4*>(y)[i] = Bf16x4{__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void bf16_to_f32_kernel(const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = __bfloat162float(x[i]);
}

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

void launch_f32_to_bf16(const float* x, __nv_bfloat16* y, int64_t n, int blocks, cudaStream_t st) {
  f32_to_bf16_kernel<<<blocks, 256, 0, st>>>(x, y, n);
  LAR_CUDA_LAUNCHED();
}
void launch_bf16_to_f32(const __nv_bfloat16* x, float* y, int64_t n, int blocks, cudaStream_t st) {
  bf16_to_f32_kernel<<<blocks, 256, 0, st>>>(x, y, n);
  LAR_CUDA_LAUNCHED();
}

// ================================================================== CudaBackend

std::vector<std::pair<std::string, double>> CudaBackend::profile_report() {
  synchronize();
  auto out = prof_.report();
  // GEMM rows: calls and achieved TFLOP/s appended; their sum as one more row.
  double gemm_total = 0, gemm_flops = 0;
  int64_t gemm_calls = 0;
  for (auto& [name, secs] : out) {
    auto it = gemm_stats_.find(name);
    if (it == gemm_stats_.end()) continue;
    gemm_total += secs;
    gemm_flops += it->second.flops;
    gemm_calls += it->second.calls;
    char buf[64];
    std::snprintf(buf, sizeof buf, " ×%lld %.0f TF/s", static_cast<long long>(it->second.calls),
                  secs > 0 ? it->second.flops / secs * 1e-12 : 0.0);
    name += buf;
  }
  if (gemm_calls > 0) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "gemm (all shapes) ×%lld %.0f TF/s", static_cast<long long>(gemm_calls),
                  gemm_total > 0 ? gemm_flops / gemm_total * 1e-12 : 0.0);
    out.emplace_back(buf, gemm_total);
    std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  }
  gemm_stats_.clear();
  return out;
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

CudaBackend::CudaBackend(int device) {
  LAR_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop{};
  LAR_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  gpu_name_ = prop.name;
  gpu_sms_ = prop.multiProcessorCount;
  smem_optin_ = prop.sharedMemPerBlockOptin;
  gpu_major_ = prop.major;
  device_ = device;
  total_mem_ = prop.totalGlobalMem;
  name_ = "cuda-f32 (" + gpu_name_ + ")";
  LAR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  LAR_CUBLAS_CHECK(cublasCreate(&cublas_));
  LAR_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  // Plain fp32 (no TF32) so that this path is the GPU's fp32 reference.
  LAR_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_PEDANTIC_MATH));
  LAR_CUBLAS_CHECK(cublasLtCreate(&lt_));
  profile_ = profiling_enabled();
}

CudaBackend::~CudaBackend() {
  cudnn_attn_.reset();  // its cuDNN handle is bound to stream_
  if (scratch_) cudaFree(scratch_);
  if (big_scratch_) cudaFree(big_scratch_);
  if (idx_scratch_) cudaFree(idx_scratch_);
  if (rope_table_) cudaFree(rope_table_);
  if (gemm_scratch_) cudaFree(gemm_scratch_);
  if (mirror_) cudaFree(mirror_);
  gemm_plans_.clear();
  if (lt_workspace_) cudaFree(lt_workspace_);
  if (lt_) cublasLtDestroy(lt_);
  while (!growables_.empty()) free_bytes(reinterpret_cast<void*>(growables_.back()->base));
  if (cublas_) cublasDestroy(cublas_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaBackend::synchronize() { LAR_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void CudaBackend::set_options(const Options& o) {
  if (o.precision != "auto" && o.precision != "fp32" && o.precision != "tf32" && o.precision != "mixed")
    throw UserError("precision: '" + o.precision + "' is not one of auto, fp32, tf32, mixed");
  Backend::set_options(o);
  mixed_ = o.precision != "fp32";
  bf16_gemm_ = o.precision == "mixed" || o.precision == "auto";
  // fp32 keeps pedantic fp32 GEMMs, so that path stays the GPU's fp32 reference.
  LAR_CUBLAS_CHECK(cublasSetMathMode(cublas_, mixed_ ? CUBLAS_DEFAULT_MATH : CUBLAS_PEDANTIC_MATH));
  // GEMM algorithm choice (cuda.gemm): deterministic runs never time candidates (the choice
  // would depend on the timings, the bits with it).
  const std::string& gm = o.cuda.gemm;
  if (!gm.empty() && gm != "tune" && gm != "heuristic" && gm != "cublas")
    throw UserError("cuda.gemm: '" + gm + "' is not one of heuristic, tune, cublas");
  if (gm == "tune" && o.deterministic)
    throw UserError("cuda.gemm: 'tune' picks GEMM algorithms by their timings, so the bits vary between processes; "
                    "a deterministic run takes heuristic or cublas");
  // the other kernel keys, checked here so that a bad value fails before the run starts
  (void)attention::attention_mode(o.cuda.attention);
  (void)linear::kernel_choice(o.cuda.linear_path, o.cuda.ccq_fwd, o.cuda.ccq_bwd, o.cuda.ccq_group);
  const std::string& keep = o.cuda.linear_keep;
  if (!keep.empty() && keep != "all" && keep != "p" && keep != "og")
    throw UserError("cuda.linear_keep: '" + keep + "' is not one of all, p, og");
  h200_ = gpu_sms_ == 132 && gpu_major_ == 9;  // where kH200Gemms was measured
  gemm_mode_ = gm == "cublas" ? GemmMode::cublas : gm == "tune" ? GemmMode::tune : GemmMode::heuristic;
  gemm_plans_.clear();
  name_ = std::string(!mixed_ ? "cuda-f32" : bf16_gemm_ ? "cuda-mixed-bf16" : "cuda-mixed-tf32") +
          (o.deterministic ? " deterministic" : "") + (bf16_gemm_ ? std::string(", gemm ") + gemm_mode() : "") +
          " (" + gpu_name_ + ")";
}

void CudaBackend::fill(const Tensor& t, double value) {
  require_f32(t, "fill");
  touch(t);
  fill_kernel<<<blocks_for(t.numel(), 256), 256, 0, stream_>>>(t.ptr<float>(), t.numel(), static_cast<float>(value));
  LAR_CUDA_LAUNCHED();
}

const void* CudaBackend::gemm_operand(const Tensor& t, std::size_t off) {
  if (t.dtype == DType::bf16) return t.data;
  require_f32(t, "gemm operand");
  const char* p = static_cast<const char*>(t.data);
  if (mirror_ && p >= weights_ && p + t.bytes() <= weights_ + weights_bytes_) {
    if (!mirror_fresh_) {  // one pass over all weights after each optimiser step / upload
      OpTimer timer(*this, "weights → bf16 mirror");
      const int64_t n = static_cast<int64_t>(weights_bytes_ / 4);
      f32_to_bf16_kernel<<<blocks_for((n + 3) / 4, 256), 256, 0, stream_>>>(reinterpret_cast<const float*>(weights_),
                                                                            static_cast<bf16*>(mirror_), n);
      LAR_CUDA_LAUNCHED();
      mirror_fresh_ = true;
    }
    return static_cast<const bf16*>(mirror_) + (p - weights_) / 4;
  }
  auto* dst = reinterpret_cast<bf16*>(static_cast<char*>(gemm_scratch_) + off);
  f32_to_bf16_kernel<<<blocks_for(t.numel(), 256), 256, 0, stream_>>>(t.ptr<float>(), dst, t.numel());
  LAR_CUDA_LAUNCHED();
  return dst;
}

void CudaBackend::axpy(double alpha, const Tensor& x, const Tensor& y) {
  OpTimer timer(*this, "axpy");
  require_f32(x, "axpy x");
  require_f32(y, "axpy y");
  touch(y);
  axpy_kernel<<<blocks_for(x.numel(), 256), 256, 0, stream_>>>(static_cast<float>(alpha), x.ptr<float>(),
                                                              y.ptr<float>(), x.numel());
  LAR_CUDA_LAUNCHED();
}

// Runs a per-block partial kernel (Σ x², or the count of non-finite elements) over an fp32
// or bf16 tensor and adds the partials in a fixed order on the device (deterministic for a
// fixed grid).
const double* CudaBackend::reduce_on_device(bool squares, const Tensor& x) {
  if (x.dtype != DType::f32 && x.dtype != DType::bf16)
    throw RuntimeError(std::string("cuda ") + (squares ? "sum_squares" : "all_finite") + ": needs an f32 or bf16 tensor");
  double* partial = scratch_doubles(kReduceBlocks + 1);
  const int64_t n = x.numel();
  if (x.dtype == DType::bf16) {
    if (squares) sum_squares_partial<<<kReduceBlocks, 256, 0, stream_>>>(x.ptr<bf16>(), n, partial);
    else nonfinite_partial<<<kReduceBlocks, 256, 0, stream_>>>(x.ptr<bf16>(), n, partial);
  } else {
    if (squares) sum_squares_partial<<<kReduceBlocks, 256, 0, stream_>>>(x.ptr<float>(), n, partial);
    else nonfinite_partial<<<kReduceBlocks, 256, 0, stream_>>>(x.ptr<float>(), n, partial);
  }
  LAR_CUDA_LAUNCHED();
  sum_partials<<<1, 1024, 0, stream_>>>(partial, kReduceBlocks, partial + kReduceBlocks);
  LAR_CUDA_LAUNCHED();
  return partial + kReduceBlocks;
}

double CudaBackend::reduce_to_host(bool squares, const Tensor& x) {
  OpTimer timer(*this, "reduce (norms)");
  const double* total = reduce_on_device(squares, x);
  double out = 0;
  LAR_CUDA_CHECK(cudaMemcpyAsync(&out, total, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return out;
}

double CudaBackend::sum_squares(const Tensor& x) { return reduce_to_host(true, x); }

bool CudaBackend::all_finite(const Tensor& x) { return reduce_to_host(false, x) == 0; }

void CudaBackend::block_sum_squares(const Tensor& x, const std::vector<SumRange>& ranges, int64_t block,
                                    const Tensor& out) {
  OpTimer timer(*this, "reduce (norms)");
  if (x.dtype != DType::f32 || out.dtype != DType::f64 || block < 1)
    throw RuntimeError("cuda block_sum_squares: needs an f32 buffer, f64 sums and block ≥ 1");
  std::vector<int64_t> tab;
  int64_t blocks = 0;
  for (const SumRange& r : ranges) {
    const int64_t nb = (r.n + block - 1) / block;
    if (r.offset < 0 || r.n < 0 || r.offset + r.n > x.numel() || r.out < 0 || r.out + nb > out.numel())
      throw RuntimeError("cuda block_sum_squares: range outside its buffers");
    tab.insert(tab.end(), {r.offset, r.n, r.out, blocks});
    blocks += nb;
  }
  if (blocks == 0) return;
  if (blocks > std::numeric_limits<int>::max()) throw RuntimeError("cuda block_sum_squares: too many blocks");
  // The table rides in the scratch doubles (int64 and double are both 8 bytes).
  int64_t* dtab = reinterpret_cast<int64_t*>(scratch_doubles(tab.size()));
  LAR_CUDA_CHECK(cudaMemcpyAsync(dtab, tab.data(), tab.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream_));
  block_sum_squares_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream_>>>(
      x.ptr<float>(), dtab, static_cast<int>(ranges.size()), block, out.ptr<double>());
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::embedding_fwd(const Tensor& ids, const Tensor& table, const Tensor& out) {
  OpTimer timer(*this, "embedding");
  int64_t n = ids.numel(), d = table.last();
  if (n == 0) return;
  if (d % 4 == 0 && aligned16(table) && aligned16(out)) {
    embedding_fwd_rows<<<static_cast<unsigned>((n + 7) / 8), 256, 0, stream_>>>(
        ids.ptr<int>(), reinterpret_cast<const float4*>(table.data), reinterpret_cast<float4*>(out.data), n, d / 4);
  } else {
    embedding_fwd_kernel<<<blocks_for(n * d, 256), 256, 0, stream_>>>(ids.ptr<int>(), table.ptr<float>(),
                                                                      out.ptr<float>(), n, d);
  }
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::embedding_bwd(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  OpTimer timer(*this, "embedding");
  const int64_t n = ids.numel(), d = dtable.last(), V = dtable.rows();
  touch(dtable);
  if (n == 0) return;
  if (n >= (int64_t(1) << 31)) throw RuntimeError("cuda embedding_bwd: too many tokens");
  // Token positions sorted by id on the device (cub's stable radix sort over the bits that
  // V needs), so no host round trip stalls the stream.
  int end_bit = 1;
  while (end_bit < 31 && (int64_t(1) << end_bit) < V) ++end_bit;
  std::size_t temp = 0;
  LAR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp, ids.ptr<int>(), static_cast<int*>(nullptr),
                                                 static_cast<int*>(nullptr), static_cast<int*>(nullptr),
                                                 static_cast<int>(n), 0, end_bit, stream_));
  const std::size_t ints = 3 * static_cast<std::size_t>(n) + (temp + 3) / 4 + 64;
  if (ints > idx_scratch_n_) {
    if (idx_scratch_) {
      synchronize();
      track_free(idx_scratch_);
      LAR_CUDA_CHECK(cudaFree(idx_scratch_));
    }
    LAR_CUDA_CHECK(cudaMalloc(&idx_scratch_, ints * sizeof(int32_t)));
    track_alloc(idx_scratch_, ints * sizeof(int32_t));
    idx_scratch_n_ = ints;
  }
  int32_t* keys = idx_scratch_;
  int32_t* pos_in = keys + n;
  int32_t* pos = pos_in + n;
  void* tmp = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(pos + n) + 255) / 256 * 256);
  iota_kernel<<<blocks_for(n, 256), 256, 0, stream_>>>(pos_in, n);
  LAR_CUDA_LAUNCHED();
  LAR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(tmp, temp, ids.ptr<int>(), keys, pos_in, pos, static_cast<int>(n), 0,
                                                 end_bit, stream_));
  const unsigned blocks = static_cast<unsigned>(n);
  if (d % 4 == 0 && aligned16(dout) && aligned16(dtable))
    embedding_bwd_sorted_kernel<<<blocks, 32 * kEmbWarps, 0, stream_>>>(keys, pos, dout.ptr<float>(),
                                                                        dtable.ptr<float>(), n, d, V);
  else
    embedding_bwd_sorted_scalar<<<blocks, 128, 0, stream_>>>(keys, pos, dout.ptr<float>(), dtable.ptr<float>(), n, d, V);
  LAR_CUDA_LAUNCHED();
}

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

void CudaBackend::convert(const Tensor& src, const Tensor& dst) {
  OpTimer timer(*this, "convert");
  if (src.numel() != dst.numel()) throw RuntimeError("cuda convert: " + src.shape_str() + " → " + dst.shape_str());
  touch(dst);
  const int64_t n = src.numel();
  if (src.dtype == dst.dtype) {
    LAR_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, stream_));
  } else if (src.dtype == DType::f32 && dst.dtype == DType::bf16) {
    f32_to_bf16_kernel<<<blocks_for((n + 3) / 4, 256), 256, 0, stream_>>>(src.ptr<float>(), dst.ptr<bf16>(), n);
    LAR_CUDA_LAUNCHED();
  } else if (src.dtype == DType::bf16 && dst.dtype == DType::f32) {
    bf16_to_f32_kernel<<<blocks_for(n, 256), 256, 0, stream_>>>(src.ptr<bf16>(), dst.ptr<float>(), n);
    LAR_CUDA_LAUNCHED();
  } else {
    throw RuntimeError("cuda convert: " + to_string(src.dtype) + " → " + to_string(dst.dtype) + " is not supported");
  }
}

void CudaBackend::register_weights(const Tensor& flat) {
  require_f32(flat, "weights");
  if (mirror_) {
    synchronize();
    track_free(mirror_);
    LAR_CUDA_CHECK(cudaFree(mirror_));
    mirror_ = nullptr;
  }
  weights_ = static_cast<const char*>(flat.data);
  weights_bytes_ = flat.bytes();
  mirror_fresh_ = false;
  // The mirror is only used by bf16 GEMMs; allocated here so its size counts from the start.
  if (bf16_gemm_ && weights_bytes_) {
    LAR_CUDA_CHECK(cudaMalloc(&mirror_, weights_bytes_ / 2));
    track_alloc(mirror_, weights_bytes_ / 2);
  }
}

// ---- optimiser updates (kernels/cuda/optim) ----

void CudaBackend::adamw_step(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                             const AdamWStep& s) {
  OpTimer timer(*this, "optimiser");
  const int64_t n = w.numel();
  if (g.numel() != n || m.numel() != n || v.numel() != n) throw RuntimeError("cuda adamw_step: sizes differ");
  // Inside the registered weights the update also writes the bf16 mirror's copy of w, so
  // the mirror stays as fresh as it was (no refresh pass after the optimiser step).
  uint16_t* mirror = nullptr;
  const char* p = static_cast<const char*>(w.data);
  if (mirror_ && p >= weights_ && p + w.bytes() <= weights_ + weights_bytes_ && (p - weights_) % 4 == 0)
    mirror = static_cast<uint16_t*>(mirror_) + (p - weights_) / 4;
  else
    touch(w);
  optim::adamw_step(w.ptr<float>(), g.ptr<float>(), m.ptr<float>(), v.ptr<float>(), n, s, mirror, stream_);
}

void CudaBackend::adamw_step_multi(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                                   const std::vector<AdamWSegment>& segments) {
  OpTimer timer(*this, "optimiser");
  for (const Tensor* t : {&w, &g, &m, &v}) require_f32(*t, "adamw_step_multi buffer");
  if (g.numel() != w.numel()) throw RuntimeError("cuda adamw_step_multi: w and g differ in size");
  for (const AdamWSegment& s : segments)
    if (s.n < 0 || s.offset < 0 || s.m_offset < 0 || s.v_offset < 0 || s.offset + s.n > w.numel() ||
        s.m_offset + s.n > m.numel() || s.v_offset + s.n > v.numel())
      throw RuntimeError("cuda adamw_step_multi: a segment lies outside its buffers");
  // Inside the registered weights the update also writes the bf16 mirror (see adamw_step).
  uint16_t* mirror = nullptr;
  const char* p = static_cast<const char*>(w.data);
  if (mirror_ && p >= weights_ && p + w.bytes() <= weights_ + weights_bytes_ && (p - weights_) % 4 == 0)
    mirror = static_cast<uint16_t*>(mirror_) + (p - weights_) / 4;
  else
    touch(w);
  optim::adamw_step_multi(w.ptr<float>(), g.ptr<float>(), m.ptr<float>(), v.ptr<float>(), segments, mirror, stream_);
}

void CudaBackend::momentum_step(const Tensor& g, const Tensor& buf, const Tensor& u, double mu, bool nesterov) {
  OpTimer timer(*this, "optimiser");
  if (buf.numel() != g.numel() || u.numel() != g.numel()) throw RuntimeError("cuda momentum_step: sizes differ");
  touch(buf);
  touch(u);
  optim::momentum_step(g.ptr<float>(), buf.ptr<float>(), u.ptr<float>(), g.numel(), static_cast<float>(mu), nesterov,
                       stream_);
}

void CudaBackend::scale(const Tensor& x, double alpha) {
  OpTimer timer(*this, "optimiser");
  touch(x);
  optim::scale(x.ptr<float>(), x.numel(), static_cast<float>(alpha), stream_);
}

void CudaBackend::transpose(const Tensor& src, const Tensor& dst, double alpha) {
  OpTimer timer(*this, "optimiser");
  if (src.numel() != dst.numel()) throw RuntimeError("cuda transpose: " + src.shape_str() + " → " + dst.shape_str());
  touch(dst);
  optim::transpose(src.ptr<float>(), dst.ptr<float>(), src.rows(), src.last(), static_cast<float>(alpha), stream_);
}

void CudaBackend::normuon_normalize(const Tensor& o, const Tensor& V, double beta2, double eps) {
  OpTimer timer(*this, "optimiser");
  const int64_t rows = o.rows(), cols = o.last();
  if (V.numel() != std::max(rows, cols)) throw RuntimeError("cuda normuon_normalize: V has " + V.shape_str());
  touch(o);
  double* scratch = scratch_doubles(static_cast<std::size_t>(optim::normuon_scratch_doubles(rows, cols)));
  optim::normuon_normalize(o.ptr<float>(), V.ptr<float>(), rows, cols, beta2, eps, scratch, stream_);
}

void CudaBackend::decayed_update(const Tensor& w, const Tensor& o, double decay, double step) {
  OpTimer timer(*this, "optimiser");
  if (w.numel() != o.numel()) throw RuntimeError("cuda decayed_update: sizes differ");
  touch(w);
  optim::decayed_update(w.ptr<float>(), o.ptr<float>(), w.numel(), static_cast<float>(decay),
                        static_cast<float>(step), stream_);
}

void CudaBackend::frobenius_normalize(const Tensor& src, const Tensor& dst, bool transposed, double eps) {
  OpTimer timer(*this, "optimiser");
  require_f32(src, "frobenius_normalize");
  if (src.numel() != dst.numel()) throw RuntimeError("cuda frobenius_normalize: " + src.shape_str() + " → " + dst.shape_str());
  touch(dst);
  // sum_squares's reduction (the same partials and tree, so the same sum), left on the device.
  const double* sum_sq = reduce_on_device(true, src);
  optim::scale_by_inv_norm(src.ptr<float>(), dst.ptr<float>(), src.rows(), src.last(), transposed, sum_sq, eps,
                           stream_);
}

// Registered as "cuda"; usable only when a device is present, so `backend: auto` falls
// back to the CPU on a machine without a GPU.
static BackendRegistration reg{"cuda", [](int, DType dtype) -> std::unique_ptr<Backend> {
                                 if (dtype != DType::f32)
                                   throw RuntimeError("the cuda backend runs in f32 storage; asked for " +
                                                      to_string(dtype));
                                 if (cuda_device_count() == 0)
                                   throw RuntimeError("the cuda backend found no CUDA device");
                                 return std::make_unique<CudaBackend>(0);
                               },
                               [] { return cuda_device_count() > 0; }};

}  // namespace lar::kernels::cuda
