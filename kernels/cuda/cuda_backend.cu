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

// ---------------------------------------------------------------- attention
struct AttnShape {
  int64_t B, T, S, Hq, Hkv, D, Dv;
  float scale;
  int64_t window;
};

__device__ inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 ? (pos - window + 1 > 0 ? pos - window + 1 : 0) : 0;
}

// One warp per (b, t, h): online softmax over the visible keys.
__global__ void attention_fwd_kernel(const float* q, const float* k, const float* v, float* o, float* lse,
                                     AttnShape s) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / kWarp;
  int lane = threadIdx.x % kWarp;
  if (warp >= s.B * s.T * s.Hq) return;
  int64_t h = warp % s.Hq, t = (warp / s.Hq) % s.T, b = warp / (s.Hq * s.T);
  int64_t hk = h / (s.Hq / s.Hkv);
  int64_t pos = t + (s.S - s.T);
  const float* qr = q + ((b * s.T + t) * s.Hq + h) * s.D;
  float qv[kPerLane], acc[kPerLane];
  for (int i = 0; i < kPerLane; ++i) {
    int64_t d = lane + i * kWarp;
    qv[i] = d < s.D ? qr[d] : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int64_t j = first_key(pos, s.window); j <= pos; ++j) {
    const float* kr = k + ((b * s.S + j) * s.Hkv + hk) * s.D;
    const float* vr = v + ((b * s.S + j) * s.Hkv + hk) * s.Dv;
    float part = 0.f;
    for (int i = 0; i < kPerLane; ++i) {
      int64_t d = lane + i * kWarp;
      if (d < s.D) part += qv[i] * kr[d];
    }
    float sc = warp_sum(part) * s.scale;
    float m_new = fmaxf(m, sc);
    float corr = expf(m - m_new), p = expf(sc - m_new);
    l = l * corr + p;
    for (int i = 0; i < kPerLane; ++i) {
      int64_t d = lane + i * kWarp;
      acc[i] = acc[i] * corr + (d < s.Dv ? p * vr[d] : 0.f);
    }
    m = m_new;
  }
  float* orow = o + ((b * s.T + t) * s.Hq + h) * s.Dv;
  for (int i = 0; i < kPerLane; ++i) {
    int64_t d = lane + i * kWarp;
    if (d < s.Dv) orow[d] = acc[i] / l;
  }
  if (lane == 0) lse[(b * s.Hq + h) * s.T + t] = m + logf(l);
}

// delta[b,h,t] = dO·O of the row.
__global__ void attention_delta_kernel(const float* o, const float* dout, float* delta, AttnShape s) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / kWarp;
  int lane = threadIdx.x % kWarp;
  if (warp >= s.B * s.T * s.Hq) return;
  int64_t h = warp % s.Hq, t = (warp / s.Hq) % s.T, b = warp / (s.Hq * s.T);
  const float* orow = o + ((b * s.T + t) * s.Hq + h) * s.Dv;
  const float* drow = dout + ((b * s.T + t) * s.Hq + h) * s.Dv;
  float part = 0.f;
  for (int64_t d = lane; d < s.Dv; d += kWarp) part += orow[d] * drow[d];
  part = warp_sum(part);
  if (lane == 0) delta[(b * s.Hq + h) * s.T + t] = part;
}

__device__ inline float row_dot(const float* a, const float* b, int64_t n, int lane) {
  float part = 0.f;
  for (int64_t d = lane; d < n; d += kWarp) part += a[d] * b[d];
  return warp_sum(part);
}

// dq: one warp per query row, over its visible keys.
__global__ void attention_dq_kernel(const float* q, const float* k, const float* v, const float* lse,
                                    const float* delta, const float* dout, float* dq, AttnShape s) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / kWarp;
  int lane = threadIdx.x % kWarp;
  if (warp >= s.B * s.T * s.Hq) return;
  int64_t h = warp % s.Hq, t = (warp / s.Hq) % s.T, b = warp / (s.Hq * s.T);
  int64_t hk = h / (s.Hq / s.Hkv);
  int64_t pos = t + (s.S - s.T);
  const float* qr = q + ((b * s.T + t) * s.Hq + h) * s.D;
  const float* dor = dout + ((b * s.T + t) * s.Hq + h) * s.Dv;
  float L = lse[(b * s.Hq + h) * s.T + t], dl = delta[(b * s.Hq + h) * s.T + t];
  float acc[kPerLane];
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
  for (int64_t j = first_key(pos, s.window); j <= pos; ++j) {
    const float* kr = k + ((b * s.S + j) * s.Hkv + hk) * s.D;
    const float* vr = v + ((b * s.S + j) * s.Hkv + hk) * s.Dv;
    float p = expf(row_dot(qr, kr, s.D, lane) * s.scale - L);
    float ds = p * (row_dot(dor, vr, s.Dv, lane) - dl);
    for (int i = 0; i < kPerLane; ++i) {
      int64_t d = lane + i * kWarp;
      if (d < s.D) acc[i] += ds * kr[d];
    }
  }
  float* dqr = dq + ((b * s.T + t) * s.Hq + h) * s.D;
  for (int i = 0; i < kPerLane; ++i) {
    int64_t d = lane + i * kWarp;
    if (d < s.D) dqr[d] = acc[i] * s.scale;
  }
}

// dk, dv: one warp per key row (b, j, kv head), over every query head of its group and
// every query that sees it — the sum runs in a fixed order, so no atomics are needed.
__global__ void attention_dkv_kernel(const float* q, const float* k, const float* v, const float* lse,
                                     const float* delta, const float* dout, float* dk, float* dv, AttnShape s) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / kWarp;
  int lane = threadIdx.x % kWarp;
  if (warp >= s.B * s.S * s.Hkv) return;
  int64_t hk = warp % s.Hkv, j = (warp / s.Hkv) % s.S, b = warp / (s.Hkv * s.S);
  int64_t group = s.Hq / s.Hkv;
  const float* kr = k + ((b * s.S + j) * s.Hkv + hk) * s.D;
  const float* vr = v + ((b * s.S + j) * s.Hkv + hk) * s.Dv;
  float ak[kPerLane], av[kPerLane];
  for (int i = 0; i < kPerLane; ++i) ak[i] = av[i] = 0.f;
  int64_t offset = s.S - s.T;
  // Queries that see key j: pos = t + offset ≥ j and pos − j < window.
  int64_t t_lo = j - offset > 0 ? j - offset : 0;
  int64_t t_hi = s.T - 1;
  if (s.window > 0 && j + s.window - 1 - offset < t_hi) t_hi = j + s.window - 1 - offset;
  for (int64_t g = 0; g < group; ++g) {
    int64_t h = hk * group + g;
    for (int64_t t = t_lo; t <= t_hi; ++t) {
      const float* qr = q + ((b * s.T + t) * s.Hq + h) * s.D;
      const float* dor = dout + ((b * s.T + t) * s.Hq + h) * s.Dv;
      float p = expf(row_dot(qr, kr, s.D, lane) * s.scale - lse[(b * s.Hq + h) * s.T + t]);
      float ds = p * (row_dot(dor, vr, s.Dv, lane) - delta[(b * s.Hq + h) * s.T + t]);
      for (int i = 0; i < kPerLane; ++i) {
        int64_t d = lane + i * kWarp;
        if (d < s.D) ak[i] += ds * qr[d];
        if (d < s.Dv) av[i] += p * dor[d];
      }
    }
  }
  float* dkr = dk + ((b * s.S + j) * s.Hkv + hk) * s.D;
  float* dvr = dv + ((b * s.S + j) * s.Hkv + hk) * s.Dv;
  for (int i = 0; i < kPerLane; ++i) {
    int64_t d = lane + i * kWarp;
    if (d < s.D) dkr[d] = ak[i] * s.scale;
    if (d < s.Dv) dvr[d] = av[i];
  }
}

// ---------------------------------------------------------------- cross-entropy
template <class TL>
__global__ void ce_fwd_kernel(const TL* logits, const int* targets, const float* mask, float* losses,
                              int* argmax, int64_t V) {
  int64_t row = blockIdx.x;
  const TL* lr = logits + row * V;
  float m = -INFINITY;
  int64_t best = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
    if (ldf(lr + i) > m) m = ldf(lr + i), best = i;
  float gmax = block_max(m);
  __shared__ long long best_idx;
  if (threadIdx.x == 0) best_idx = V;
  __syncthreads();
  // The first index holding the maximum, as the CPU reference picks it.
  if (m == gmax) atomicMin(&best_idx, static_cast<long long>(best));
  __syncthreads();
  double se = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) se += exp(static_cast<double>(ldf(lr + i) - gmax));
  se = block_sum_d(se);
  if (threadIdx.x == 0) {
    double lse = gmax + log(se);
    losses[row] = static_cast<float>(mask[row] * (lse - ldf(lr + targets[row])));
    if (argmax) argmax[row] = static_cast<int>(best_idx);
  }
}

template <class TL, class TD>
__global__ void ce_bwd_kernel(const TL* logits, const int* targets, const float* mask, float grad_scale,
                              TD* dlogits, int64_t V) {
  int64_t row = blockIdx.x;
  const TL* lr = logits + row * V;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, ldf(lr + i));
  float gmax = block_max(m);
  double se = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) se += exp(static_cast<double>(ldf(lr + i) - gmax));
  se = block_sum_d(se);
  __syncthreads();  // every read of the row is done before dlogits (which may alias) is written
  float w = grad_scale * mask[row];
  int tgt = targets[row];
  float inv = static_cast<float>(1.0 / se);
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    float p = expf(ldf(lr + i) - gmax) * inv;
    stf(dlogits + row * V + i, w * (p - (i == tgt ? 1.f : 0.f)));
  }
}

// cross-entropy forward and backward of one row per block, the row staged once in shared
// memory (V floats): one read of the logits, one write of dlogits, instead of five passes.
// Same arithmetic as ce_fwd_kernel + ce_bwd_kernel (reduction splits differ: not bitwise).
constexpr int kCeFusedThreads = 1024;
template <class TL, class TD>
__global__ void __launch_bounds__(kCeFusedThreads) ce_fused_kernel(const TL* logits, const int* targets,
                                                                   const float* mask, float* losses, float grad_scale,
                                                                   TD* dlogits, int64_t V) {
  extern __shared__ float srow[];
  const int64_t row = blockIdx.x;
  const TL* lr = logits + row * V;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float x = ldf(lr + i);
    srow[i] = x;
    m = fmaxf(m, x);
  }
  const float gmax = block_max(m);  // its barriers also publish srow
  double se = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) se += exp(static_cast<double>(srow[i] - gmax));
  se = block_sum_d(se);
  const int tgt = targets[row];
  if (threadIdx.x == 0) losses[row] = static_cast<float>(mask[row] * (gmax + log(se) - srow[tgt]));
  const float w = grad_scale * mask[row];
  const float inv = static_cast<float>(1.0 / se);
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float p = expf(srow[i] - gmax) * inv;
    stf(dlogits + row * V + i, w * (p - (i == tgt ? 1.f : 0.f)));
  }
}

// The training cross-entropy on bf16 logits (the head GEMM's bf16 output), one row per
// block of kCeRegThreads threads with the row held in registers (VPT 16-byte groups of 8
// logits per thread): one read of the logits and one write of bf16 dlogits, in place
// allowed (every read of the row precedes the block barrier before the writes). Max by
// a block reduction; Σ exp in float per thread (exp2 of a pre-scaled argument), then in
// double across the block in a fixed order: deterministic. V % 8 == 0, rows 16-byte aligned.
constexpr int kCeRegThreads = 512;
template <int VPT>
__global__ void __launch_bounds__(kCeRegThreads, VPT <= 8 ? 2 : 1) ce_fused_bf16_rows(const bf16* logits, const int* targets,
                                                                    const float* mask, float* losses, float grad_scale,
                                                                    bf16* dlogits, int64_t V) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int64_t row = blockIdx.x;
  const uint4* lr = reinterpret_cast<const uint4*>(logits + row * V);
  const int v8 = static_cast<int>(V / 8);
  uint4 buf[VPT];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = threadIdx.x + k * kCeRegThreads;
    if (i < v8) {
      buf[k] = lr[i];
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&buf[k]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(h[e]);
        m = fmaxf(m, fmaxf(f.x, f.y));
      }
    }
  }
  const float gmax = block_max(m);
  const float mscaled = gmax * kLog2e;
  // exp(x − max) once per logit: summed in float, and kept (rounded to bf16, in place of the
  // logit) for the output pass — the output is bf16 anyway, and one exp per logit instead
  // of two halves the MUFU work, which bounds this kernel next to its memory traffic.
  float se = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = threadIdx.x + k * kCeRegThreads;
    if (i < v8) {
      __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&buf[k]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(h[e]);
        const float a = exp2f(fmaf(f.x, kLog2e, -mscaled)), b = exp2f(fmaf(f.y, kLog2e, -mscaled));
        se += a + b;
        h[e] = __floats2bfloat162_rn(a, b);
      }
    }
  }
  const double sed = block_sum_d(se);  // its barriers also end every read of the row
  const int tgt = targets[row];
  if (threadIdx.x == 0) {
    const float xt = __bfloat162float(logits[row * V + tgt]);
    losses[row] = static_cast<float>(mask[row] * (gmax + log(sed) - xt));
  }
  __syncthreads();  // the target logit is read before any thread overwrites the row
  const float w = grad_scale * mask[row];
  const float inv = static_cast<float>(1.0 / sed);
  uint4* dl = reinterpret_cast<uint4*>(dlogits + row * V);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = threadIdx.x + k * kCeRegThreads;
    if (i < v8) {
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&buf[k]);
      float o[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(h[e]);  // exp(x − max)
        o[2 * e] = w * (f.x * inv - (8 * i + 2 * e == tgt ? 1.f : 0.f));
        o[2 * e + 1] = w * (f.y * inv - (8 * i + 2 * e + 1 == tgt ? 1.f : 0.f));
      }
      store8(reinterpret_cast<bf16*>(dl + i), o);
    }
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

static AttnShape attn_shape(const Tensor& q, const Tensor& k, const Tensor& v, double scale, int64_t window) {
  AttnShape s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3),
              static_cast<float>(scale), window};
  if (s.D > kMaxHeadDim || s.Dv > kMaxHeadDim)
    throw RuntimeError("cuda attention: head dim > " + std::to_string(kMaxHeadDim));
  if (s.Hq % s.Hkv != 0) throw RuntimeError("cuda attention: Hq % Hkv != 0");
  return s;
}

// ---- bf16 flash attention over fp32 tensors (mixed precision) ----
// q, k, v (and dout) are rounded to bf16 in a scratch buffer, the flash kernels run, and
// their bf16 outputs widen back into the fp32 tensors. The forward's o is a widened bf16,
// so the backward's re-rounding of o gives the forward's bf16 o exactly.

namespace {
void to_bf16(const Tensor& x, __nv_bfloat16* y, cudaStream_t st) {
  f32_to_bf16_kernel<<<blocks_for(x.numel(), 256), 256, 0, st>>>(x.ptr<float>(), y, x.numel());
  LAR_CUDA_LAUNCHED();
}
void to_f32(const __nv_bfloat16* x, const Tensor& y, cudaStream_t st) {
  bf16_to_f32_kernel<<<blocks_for(y.numel(), 256), 256, 0, st>>>(x, y.ptr<float>(), y.numel());
  LAR_CUDA_LAUNCHED();
}
attention::FlashShape flash_shape(const Tensor& q, const Tensor& k, double scale, int64_t window) {
  attention::FlashShape f;
  f.B = q.size(0), f.T = q.size(1), f.S = k.size(1), f.Hq = q.size(2), f.Hkv = k.size(2), f.D = q.size(3);
  f.scale = scale;
  f.window = window;
  return f;
}
std::size_t align256(std::size_t b) { return (b + 255) / 256 * 256; }
}  // namespace

bool CudaBackend::flash_ok(const Tensor& q, const Tensor& v) const {
  return mixed_ && (q.size(3) == 64 || q.size(3) == 128) && v.size(3) == q.size(3);
}

void CudaBackend::flash_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                            double scale, int64_t window) {
  using bf = __nv_bfloat16;
  const std::size_t nq = align256(q.numel() * 2), nk = align256(k.numel() * 2);
  char* base = static_cast<char*>(scratch_bytes(2 * nq + 2 * nk));
  bf* qb = reinterpret_cast<bf*>(base);
  bf* kb = reinterpret_cast<bf*>(base + nq);
  bf* vb = reinterpret_cast<bf*>(base + nq + nk);
  bf* ob = reinterpret_cast<bf*>(base + nq + 2 * nk);
  to_bf16(q, qb, stream_);
  to_bf16(k, kb, stream_);
  to_bf16(v, vb, stream_);
  attention::flash_attention_fwd(flash_shape(q, k, scale, window), qb, kb, vb, ob, lse.ptr<float>(), stream_);
  to_f32(ob, o, stream_);
}

void CudaBackend::flash_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                            const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv, double scale,
                            int64_t window) {
  using bf = __nv_bfloat16;
  const attention::FlashShape fs = flash_shape(q, k, scale, window);
  const std::size_t nq = align256(q.numel() * 2), nk = align256(k.numel() * 2);
  const std::size_t ws = align256(attention::flash_attention_bwd_workspace_bytes(fs));
  char* base = static_cast<char*>(scratch_bytes(4 * nq + 4 * nk + ws));
  bf* qb = reinterpret_cast<bf*>(base);
  bf* ob = reinterpret_cast<bf*>(base + nq);
  bf* dob = reinterpret_cast<bf*>(base + 2 * nq);
  bf* dqb = reinterpret_cast<bf*>(base + 3 * nq);
  bf* kb = reinterpret_cast<bf*>(base + 4 * nq);
  bf* vb = reinterpret_cast<bf*>(base + 4 * nq + nk);
  bf* dkb = reinterpret_cast<bf*>(base + 4 * nq + 2 * nk);
  bf* dvb = reinterpret_cast<bf*>(base + 4 * nq + 3 * nk);
  void* work = base + 4 * nq + 4 * nk;
  to_bf16(q, qb, stream_);
  to_bf16(k, kb, stream_);
  to_bf16(v, vb, stream_);
  to_bf16(o, ob, stream_);
  to_bf16(dout, dob, stream_);
  attention::flash_attention_bwd(fs, qb, kb, vb, ob, lse.ptr<float>(), dob, dqb, dkb, dvb, work, stream_);
  to_f32(dqb, dq, stream_);
  to_f32(dkb, dk, stream_);
  to_f32(dvb, dv, stream_);
}

namespace {
// bf16 attention tensors: all of them bf16 (lse stays f32).
bool all_bf16(std::initializer_list<const Tensor*> ts) {
  int n = 0;
  for (const Tensor* t : ts) n += is_bf16(*t);
  if (n != 0 && n != static_cast<int>(ts.size()))
    throw RuntimeError("cuda attention: q, k, v, o (and dout, dq, dk, dv) must all be f32 or all bf16");
  return n != 0;
}
Tensor as_f32(const Tensor& t, char*& cursor) {
  Tensor f(cursor, DType::f32, t.shape());
  cursor += align256(f.bytes());
  return f;
}
}  // namespace

// cuDNN's fused attention for the bf16 shapes it covers (attention/cudnn_attention.hpp),
// unless deterministic (its backward accumulates dQ with atomics) or cuda.attention: flash.
// The forward and backward plans of a shape are built together, so both directions of a
// shape take the same path; were they ever to differ, the saved lse means the same in both
// (natural-log LSE of scale·q·kᵀ, [B, Hq, T]).
bool CudaBackend::attn_cudnn(const attention::FlashShape& fs) {
  const attention::AttentionMode mode = attention::attention_mode(options().cuda.attention);
  if (mode == attention::AttentionMode::flash || options().deterministic || !attention::cudnn_covers(fs)) return false;
  const bool forced = mode == attention::AttentionMode::cudnn;
  if (!cudnn_attn_) {
    if (!attention::cudnn_available()) {
      if (forced) throw RuntimeError("cuda.attention: cudnn: " + attention::cudnn_unavailable_reason());
      return false;
    }
    cudnn_attn_ = std::make_unique<attention::CudnnAttention>();
  }
  std::string why;
  if (cudnn_attn_->prepare(fs, &why)) return true;
  if (forced) throw RuntimeError("cuda.attention: cudnn: " + why);
  static bool warned = false;  // once per process: the flash kernels take over
  if (!warned) std::fprintf(stderr, "lar: cuDNN attention unavailable (%s); using the flash kernels\n", why.c_str());
  warned = true;
  return false;
}

void CudaBackend::attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                const Tensor& lse, double scale, int64_t window) {
  OpTimer timer(*this, "attention fwd");
  require_f32(lse, "attention lse");
  if (all_bf16({&q, &k, &v, &o})) {
    if (flash_ok(q, v)) {  // bf16 tensors straight into cuDNN or the flash kernel: no conversions
      const attention::FlashShape fs = flash_shape(q, k, scale, window);
      if (attn_cudnn(fs)) {
        void* work = scratch_bytes(cudnn_attn_->fwd_workspace_bytes(fs));
        cudnn_attn_->fwd(fs, q.ptr<bf16>(), k.ptr<bf16>(), v.ptr<bf16>(), o.ptr<bf16>(), lse.ptr<float>(), work,
                         stream_);
        attn_path_ = "cudnn";
        return;
      }
      attention::flash_attention_fwd(fs, q.ptr<bf16>(), k.ptr<bf16>(), v.ptr<bf16>(), o.ptr<bf16>(), lse.ptr<float>(),
                                     stream_);
      attn_path_ = "flash";
      return;
    }
    attn_path_ = "fp32";
    // Head dims the flash kernel lacks: widen, run the fp32 kernels, round o.
    char* cur = static_cast<char*>(
        scratch_bytes(align256(q.numel() * 4) + align256(o.numel() * 4) + align256(k.numel() * 4) + align256(v.numel() * 4)));
    Tensor qf = as_f32(q, cur), kf = as_f32(k, cur), vf = as_f32(v, cur), of = as_f32(o, cur);
    convert(q, qf), convert(k, kf), convert(v, vf);
    AttnShape s = attn_shape(qf, kf, vf, scale, window);
    attention_fwd_kernel<<<blocks_for(s.B * s.T * s.Hq * kWarp, 256), 256, 0, stream_>>>(
        qf.ptr<float>(), kf.ptr<float>(), vf.ptr<float>(), of.ptr<float>(), lse.ptr<float>(), s);
    LAR_CUDA_LAUNCHED();
    convert(of, o);
    return;
  }
  attn_path_ = flash_ok(q, v) ? "flash" : "fp32";
  if (flash_ok(q, v)) return flash_fwd(q, k, v, o, lse, scale, window);
  AttnShape s = attn_shape(q, k, v, scale, window);
  int64_t warps = s.B * s.T * s.Hq;
  attention_fwd_kernel<<<blocks_for(warps * kWarp, 256), 256, 0, stream_>>>(
      q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), o.ptr<float>(), lse.ptr<float>(), s);
  LAR_CUDA_LAUNCHED();
}

// The fp32 reference backward on f32 tensors.
static void attention_bwd_f32(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                              const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv, double scale,
                              int64_t window, cudaStream_t stream) {
  AttnShape s = attn_shape(q, k, v, scale, window);
  float* delta = nullptr;
  LAR_CUDA_CHECK(cudaMallocAsync(&delta, sizeof(float) * s.B * s.Hq * s.T, stream));
  int64_t qwarps = s.B * s.T * s.Hq, kwarps = s.B * s.S * s.Hkv;
  attention_delta_kernel<<<blocks_for(qwarps * kWarp, 256), 256, 0, stream>>>(o.ptr<float>(), dout.ptr<float>(),
                                                                              delta, s);
  LAR_CUDA_LAUNCHED();
  attention_dq_kernel<<<blocks_for(qwarps * kWarp, 256), 256, 0, stream>>>(
      q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), lse.ptr<float>(), delta, dout.ptr<float>(), dq.ptr<float>(), s);
  LAR_CUDA_LAUNCHED();
  attention_dkv_kernel<<<blocks_for(kwarps * kWarp, 256), 256, 0, stream>>>(
      q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), lse.ptr<float>(), delta, dout.ptr<float>(), dk.ptr<float>(),
      dv.ptr<float>(), s);
  LAR_CUDA_LAUNCHED();
  LAR_CUDA_CHECK(cudaFreeAsync(delta, stream));
}

void CudaBackend::attention_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                const Tensor& dv, double scale, int64_t window) {
  OpTimer timer(*this, "attention bwd");
  require_f32(lse, "attention lse");
  if (all_bf16({&q, &k, &v, &o, &dout, &dq, &dk, &dv})) {
    if (flash_ok(q, v)) {
      const attention::FlashShape fs = flash_shape(q, k, scale, window);
      if (attn_cudnn(fs)) {
        void* work = scratch_bytes(cudnn_attn_->bwd_workspace_bytes(fs));
        cudnn_attn_->bwd(fs, q.ptr<bf16>(), k.ptr<bf16>(), v.ptr<bf16>(), o.ptr<bf16>(), lse.ptr<float>(),
                         dout.ptr<bf16>(), dq.ptr<bf16>(), dk.ptr<bf16>(), dv.ptr<bf16>(), work, stream_);
        attn_path_ = "cudnn";
        return;
      }
      void* work = scratch_bytes(align256(attention::flash_attention_bwd_workspace_bytes(fs)));
      attention::flash_attention_bwd(fs, q.ptr<bf16>(), k.ptr<bf16>(), v.ptr<bf16>(), o.ptr<bf16>(), lse.ptr<float>(),
                                     dout.ptr<bf16>(), dq.ptr<bf16>(), dk.ptr<bf16>(), dv.ptr<bf16>(), work, stream_);
      attn_path_ = "flash";
      return;
    }
    attn_path_ = "fp32";
    const std::size_t nq = align256(q.numel() * 4), no = align256(o.numel() * 4), nk = align256(k.numel() * 4),
                      nv = align256(v.numel() * 4);
    char* cur = static_cast<char*>(scratch_bytes(2 * nq + 2 * no + 2 * nk + 2 * nv));
    Tensor qf = as_f32(q, cur), kf = as_f32(k, cur), vf = as_f32(v, cur), of = as_f32(o, cur);
    Tensor df = as_f32(dout, cur), dqf = as_f32(dq, cur), dkf = as_f32(dk, cur), dvf = as_f32(dv, cur);
    convert(q, qf), convert(k, kf), convert(v, vf), convert(o, of), convert(dout, df);
    attention_bwd_f32(qf, kf, vf, of, lse, df, dqf, dkf, dvf, scale, window, stream_);
    convert(dqf, dq), convert(dkf, dk), convert(dvf, dv);
    return;
  }
  attn_path_ = flash_ok(q, v) ? "flash" : "fp32";
  if (flash_ok(q, v)) return flash_bwd(q, k, v, o, lse, dout, dq, dk, dv, scale, window);
  attention_bwd_f32(q, k, v, o, lse, dout, dq, dk, dv, scale, window, stream_);
}

namespace {
// The n per-row losses summed in a fixed order on the host (N floats is small next to N·V
// logits), so the loss is the same bits run to run.
double host_sum(Backend& be, const Tensor& losses, int64_t n) {
  std::vector<float> host(static_cast<std::size_t>(n));
  be.download(losses, host.data());
  double total = 0;
  for (float l : host) total += l;
  return total;
}
}  // namespace

double CudaBackend::cross_entropy_fwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                      const Tensor& losses, const Tensor& argmax) {
  OpTimer timer(*this, "cross-entropy");
  require_act(logits, "cross-entropy logits");
  int64_t n = logits.rows(), V = logits.last();
  int* am = argmax.empty() ? nullptr : argmax.ptr<int>();
  if (is_bf16(logits))
    ce_fwd_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(logits.ptr<bf16>(), targets.ptr<int>(),
                                                                 mask.ptr<float>(), losses.ptr<float>(), am, V);
  else
    ce_fwd_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(logits.ptr<float>(), targets.ptr<int>(),
                                                                 mask.ptr<float>(), losses.ptr<float>(), am, V);
  LAR_CUDA_LAUNCHED();
  return host_sum(*this, losses, n);
}

namespace {
template <class TL, class TD>
void ce_bwd_launch(const Tensor& logits, const Tensor& targets, const Tensor& mask, float grad_scale,
                   const Tensor& dlogits, cudaStream_t st) {
  ce_bwd_kernel<<<static_cast<unsigned>(logits.rows()), 256, 0, st>>>(
      logits.ptr<TL>(), targets.ptr<int>(), mask.ptr<float>(), grad_scale, dlogits.ptr<TD>(), logits.last());
}
template <class TL, class TD>
void ce_fused_launch(const Tensor& logits, const Tensor& targets, const Tensor& mask, const Tensor& losses,
                     float grad_scale, const Tensor& dlogits, std::size_t smem, cudaStream_t st) {
  LAR_CUDA_CHECK(cudaFuncSetAttribute(ce_fused_kernel<TL, TD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  ce_fused_kernel<<<static_cast<unsigned>(logits.rows()), kCeFusedThreads, smem, st>>>(
      logits.ptr<TL>(), targets.ptr<int>(), mask.ptr<float>(), losses.ptr<float>(), grad_scale, dlogits.ptr<TD>(),
      logits.last());
}
template <int VPT>
void ce_rows_launch(const Tensor& logits, const Tensor& targets, const Tensor& mask, const Tensor& losses,
                    float grad_scale, const Tensor& dlogits, cudaStream_t st) {
  ce_fused_bf16_rows<VPT><<<static_cast<unsigned>(logits.rows()), kCeRegThreads, 0, st>>>(
      logits.ptr<bf16>(), targets.ptr<int>(), mask.ptr<float>(), losses.ptr<float>(), grad_scale, dlogits.ptr<bf16>(),
      logits.last());
}
}  // namespace

void CudaBackend::cross_entropy_bwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                    double grad_scale, const Tensor& dlogits) {
  OpTimer timer(*this, "cross-entropy");
  require_act(logits, "cross-entropy logits");
  require_act(dlogits, "cross-entropy dlogits");
  if (dlogits.data == logits.data && dlogits.dtype != logits.dtype)
    throw RuntimeError("cuda cross_entropy_bwd: dlogits may alias the logits only in their dtype");
  touch(dlogits);
  const float gs = static_cast<float>(grad_scale);
  if (is_bf16(logits))
    is_bf16(dlogits) ? ce_bwd_launch<bf16, bf16>(logits, targets, mask, gs, dlogits, stream_)
                     : ce_bwd_launch<bf16, float>(logits, targets, mask, gs, dlogits, stream_);
  else
    is_bf16(dlogits) ? ce_bwd_launch<float, bf16>(logits, targets, mask, gs, dlogits, stream_)
                     : ce_bwd_launch<float, float>(logits, targets, mask, gs, dlogits, stream_);
  LAR_CUDA_LAUNCHED();
}

double CudaBackend::cross_entropy_fwd_bwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                          const Tensor& losses, double grad_scale, const Tensor& dlogits) {
  require_act(logits, "cross-entropy logits");
  require_act(dlogits, "cross-entropy dlogits");
  const int64_t n = logits.rows(), V = logits.last();
  const float gs = static_cast<float>(grad_scale);
  const bool alias = dlogits.data == logits.data;
  // bf16 logits, V % 8 == 0: the row in registers (≤ 16 groups of 8 per thread, V ≤ 65536).
  const int64_t groups = (V / 8 + kCeRegThreads - 1) / kCeRegThreads;
  if (is_bf16(logits) && is_bf16(dlogits) && V % 8 == 0 && groups <= 16 && aligned16(logits) && aligned16(dlogits) &&
      (alias || static_cast<const char*>(dlogits.data) >= static_cast<const char*>(logits.data) + logits.bytes() ||
       static_cast<const char*>(logits.data) >= static_cast<const char*>(dlogits.data) + dlogits.bytes())) {
    OpTimer timer(*this, "cross-entropy");
    touch(dlogits);
    if (groups <= 2) ce_rows_launch<2>(logits, targets, mask, losses, gs, dlogits, stream_);
    else if (groups <= 4) ce_rows_launch<4>(logits, targets, mask, losses, gs, dlogits, stream_);
    else if (groups <= 8) ce_rows_launch<8>(logits, targets, mask, losses, gs, dlogits, stream_);
    else ce_rows_launch<16>(logits, targets, mask, losses, gs, dlogits, stream_);
    LAR_CUDA_LAUNCHED();
    return host_sum(*this, losses, n);
  }
  const std::size_t smem = static_cast<std::size_t>(V) * sizeof(float);
  // The row must fit in shared memory (V ≤ 40960); in place only in one dtype (the row is
  // staged before any write, but a bf16 dlogits over f32 logits would overlap other rows).
  if (smem > 160 * 1024 || (alias && dlogits.dtype != logits.dtype))
    return Backend::cross_entropy_fwd_bwd(logits, targets, mask, losses, grad_scale, dlogits);
  {
    OpTimer timer(*this, "cross-entropy");
    touch(dlogits);
    if (is_bf16(logits))
      is_bf16(dlogits) ? ce_fused_launch<bf16, bf16>(logits, targets, mask, losses, gs, dlogits, smem, stream_)
                       : ce_fused_launch<bf16, float>(logits, targets, mask, losses, gs, dlogits, smem, stream_);
    else
      is_bf16(dlogits) ? ce_fused_launch<float, bf16>(logits, targets, mask, losses, gs, dlogits, smem, stream_)
                       : ce_fused_launch<float, float>(logits, targets, mask, losses, gs, dlogits, smem, stream_);
    LAR_CUDA_LAUNCHED();
  }
  return host_sum(*this, losses, n);
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
