// The CUDA backend's kernels (fp32 storage, fp32 math, double where the CPU reference
// reduces in double). Written to be obviously right first: one warp per attention row,
// one block per normalisation row, no atomics so every result is bit-reproducible.
// The tensor-core bf16 paths that make it fast build on this and are checked against it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda/attention/flash_attention.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/optim/optim_kernels.hpp"

namespace lar::kernels::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kMaxHeadDim = 256;                 // per-lane register arrays below
constexpr int kPerLane = kMaxHeadDim / kWarp;
constexpr int kReduceBlocks = 256;

__device__ inline float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline double warp_sum_d(double v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum in double; every thread gets the result. blockDim.x multiple of 32.
__device__ double block_sum_d(double v) {
  __shared__ double part[32];
  v = warp_sum_d(v);
  int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  __syncthreads();
  if (lane == 0) part[w] = v;
  __syncthreads();
  int nw = blockDim.x / kWarp;
  double r = 0;
  for (int i = 0; i < nw; ++i) r += part[i];  // fixed order: deterministic
  return r;
}

__device__ float block_max(float v) {
  __shared__ float part[32];
  v = warp_max(v);
  int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  __syncthreads();
  if (lane == 0) part[w] = v;
  __syncthreads();
  int nw = blockDim.x / kWarp;
  float r = -INFINITY;
  for (int i = 0; i < nw; ++i) r = fmaxf(r, part[i]);
  return r;
}

int blocks_for(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 65535 * 16 ? b : 65535 * 16);
}

// ---------------------------------------------------------------- elementwise
__global__ void fill_kernel(float* x, int64_t n, float v) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = v;
}

__global__ void axpy_kernel(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] += alpha * x[i];
}

// Per-block partial sums of x² (double), then one block adds the partials in order.
__global__ void sum_squares_partial(const float* x, int64_t n, double* partial) {
  double acc = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    acc += static_cast<double>(x[i]) * x[i];
  double s = block_sum_d(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void nonfinite_partial(const float* x, int64_t n, double* partial) {
  double acc = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    acc += isfinite(x[i]) ? 0.0 : 1.0;
  double s = block_sum_d(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_partials(const double* partial, int n, double* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double s = 0;
    for (int i = 0; i < n; ++i) s += partial[i];
    *out = s;
  }
}

// ---------------------------------------------------------------- embedding
__global__ void embedding_fwd_kernel(const int* ids, const float* table, float* out, int64_t n, int64_t d) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * d; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t row = i / d, col = i % d;
    out[i] = table[static_cast<int64_t>(ids[row]) * d + col];
  }
}

// One block row per distinct id (blockIdx.y), threads over columns; each walks the
// positions holding that id in token order (a stable counting sort on the host), so the
// sum has a fixed order without atomics and distinct rows run in parallel.
__global__ void embedding_bwd_kernel(const int* uniq, const int* starts, const int* order, const float* dout,
                                     float* dtable, int64_t d) {
  const int u = blockIdx.y;
  const int64_t col = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (col >= d) return;
  float* row = dtable + static_cast<int64_t>(uniq[u]) * d + col;
  float acc = *row;
  for (int i = starts[u]; i < starts[u + 1]; ++i) acc += dout[static_cast<int64_t>(order[i]) * d + col];
  *row = acc;
}

// ---------------------------------------------------------------- RMSNorm
__global__ void rmsnorm_fwd_kernel(const float* x, const float* w, float* y, float* rstd, int64_t d, float eps) {
  int64_t row = blockIdx.x;
  const float* xr = x + row * d;
  double ss = 0;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) ss += static_cast<double>(xr[i]) * xr[i];
  ss = block_sum_d(ss);
  float r = static_cast<float>(1.0 / sqrt(ss / d + eps));
  if (threadIdx.x == 0) rstd[row] = r;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) y[row * d + i] = xr[i] * r * w[i];
}

// dx += r·g − x·r³·(g·x)/d with g = dy·w.
__global__ void rmsnorm_bwd_dx_kernel(const float* x, const float* w, const float* rstd, const float* dy,
                                      float* dx, int64_t d) {
  int64_t row = blockIdx.x;
  const float* xr = x + row * d;
  const float* dyr = dy + row * d;
  double gx = 0;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) gx += static_cast<double>(dyr[i]) * w[i] * xr[i];
  gx = block_sum_d(gx);
  float r = rstd[row];
  float c = static_cast<float>(gx / d) * r * r * r;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) dx[row * d + i] += r * dyr[i] * w[i] - xr[i] * c;
}

// dw[i] += Σ_rows dy·x·r in two deterministic stages: per chunk of rows (one thread per
// column, rows in order) into partial[chunk][col], then the chunks in order.
__global__ void rmsnorm_bwd_dw_partial(const float* x, const float* rstd, const float* dy, double* partial,
                                       int64_t n, int64_t d, int64_t rows_per_chunk) {
  int64_t col = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (col >= d) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk, r1 = r0 + rows_per_chunk < n ? r0 + rows_per_chunk : n;
  double acc = 0;
  for (int64_t r = r0; r < r1; ++r) acc += static_cast<double>(dy[r * d + col]) * x[r * d + col] * rstd[r];
  partial[blockIdx.y * d + col] = acc;
}

__global__ void rmsnorm_bwd_dw_final(const double* partial, float* dw, int64_t d, int chunks) {
  int64_t col = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (col >= d) return;
  double acc = 0;
  for (int c = 0; c < chunks; ++c) acc += partial[c * d + col];
  dw[col] += static_cast<float>(acc);
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ x, __nv_bfloat16* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void bf16_to_f32_kernel(const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = __bfloat162float(x[i]);
}

// ---------------------------------------------------------------- SwiGLU
__device__ inline float sigmoidf_(float z) { return 1.f / (1.f + expf(-z)); }

__global__ void swiglu_fwd_kernel(const float* gu, float* h, int64_t n, int64_t f) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * f; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t row = i / f, col = i % f;
    float g = gu[row * 2 * f + col], u = gu[row * 2 * f + f + col];
    h[i] = g * sigmoidf_(g) * u;
  }
}

__global__ void swiglu_bwd_kernel(const float* gu, const float* dh, float* dgu, int64_t n, int64_t f) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * f; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t row = i / f, col = i % f;
    float g = gu[row * 2 * f + col], u = gu[row * 2 * f + f + col];
    float s = sigmoidf_(g);
    float d = dh[i];
    dgu[row * 2 * f + col] = d * u * s * (1.f + g * (1.f - s));
    dgu[row * 2 * f + f + col] = d * g * s;
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
__global__ void ce_fwd_kernel(const float* logits, const int* targets, const float* mask, float* losses,
                              int* argmax, int64_t V) {
  int64_t row = blockIdx.x;
  const float* lr = logits + row * V;
  float m = -INFINITY;
  int64_t best = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
    if (lr[i] > m) m = lr[i], best = i;
  float gmax = block_max(m);
  __shared__ long long best_idx;
  if (threadIdx.x == 0) best_idx = V;
  __syncthreads();
  // The first index holding the maximum, as the CPU reference picks it.
  if (m == gmax) atomicMin(&best_idx, static_cast<long long>(best));
  __syncthreads();
  double se = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) se += exp(static_cast<double>(lr[i] - gmax));
  se = block_sum_d(se);
  if (threadIdx.x == 0) {
    double lse = gmax + log(se);
    losses[row] = static_cast<float>(mask[row] * (lse - lr[targets[row]]));
    if (argmax) argmax[row] = static_cast<int>(best_idx);
  }
}

__global__ void ce_bwd_kernel(const float* logits, const int* targets, const float* mask, float grad_scale,
                              float* dlogits, int64_t V) {
  int64_t row = blockIdx.x;
  const float* lr = logits + row * V;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, lr[i]);
  float gmax = block_max(m);
  double se = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) se += exp(static_cast<double>(lr[i] - gmax));
  se = block_sum_d(se);
  __syncthreads();  // every read of the row is done before dlogits (which may alias) is written
  float w = grad_scale * mask[row];
  int tgt = targets[row];
  float inv = static_cast<float>(1.0 / se);
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    float p = expf(lr[i] - gmax) * inv;
    dlogits[row * V + i] = w * (p - (i == tgt ? 1.f : 0.f));
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

__global__ void rope_apply_kernel(float* x, const float2* cs, int64_t B, int64_t T, int64_t H, int64_t D) {
  const int64_t half = D / 2, n = B * T * H * half;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t p = i % half, row = i / half, t = (row / H) % T;
    const float2 r = cs[t * half + p];
    float* xr = x + row * D;
    const float a = xr[p], b = xr[p + half];
    xr[p] = a * r.x - b * r.y;
    xr[p + half] = b * r.x + a * r.y;
  }
}

void require_f32(const Tensor& t, const char* what) {
  if (t.dtype != DType::f32) throw RuntimeError(std::string("cuda backend: ") + what + " must be f32");
}

}  // namespace

// ================================================================== CudaBackend

// LAR_CUDA_PROFILE=1: every op records a pair of CUDA events around its launches;
// profile_report() sums them per op (lar bench gpu-train prints the table). Off by
// default: then an OpTimer costs one branch.
struct CudaBackend::OpTimer {
  CudaBackend& be;
  const char* name;
  cudaEvent_t a = nullptr;
  OpTimer(CudaBackend& b, const char* n) : be(b), name(n) {
    if (!be.profile_) return;
    LAR_CUDA_CHECK(cudaEventCreate(&a));
    LAR_CUDA_CHECK(cudaEventRecord(a, be.stream_));
  }
  ~OpTimer() {
    if (!a) return;
    cudaEvent_t b = nullptr;
    if (cudaEventCreate(&b) == cudaSuccess && cudaEventRecord(b, be.stream_) == cudaSuccess)
      be.prof_.push_back({name, a, b});
  }
};

std::vector<std::pair<std::string, double>> CudaBackend::profile_report() {
  synchronize();
  std::vector<std::pair<std::string, double>> out;
  for (const auto& e : prof_) {
    float ms = 0;
    LAR_CUDA_CHECK(cudaEventElapsedTime(&ms, e.a, e.b));
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == e.name; });
    if (it == out.end()) out.emplace_back(e.name, ms * 1e-3);
    else it->second += ms * 1e-3;
    cudaEventDestroy(e.a);
    cudaEventDestroy(e.b);
  }
  prof_.clear();
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
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
  name_ = "cuda-f32 (" + gpu_name_ + ")";
  LAR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  LAR_CUBLAS_CHECK(cublasCreate(&cublas_));
  LAR_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  // Plain fp32 (no TF32) so that this path is the GPU's fp32 reference.
  LAR_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_PEDANTIC_MATH));
  const char* prof = std::getenv("LAR_CUDA_PROFILE");
  profile_ = prof && std::string(prof) == "1";
}

CudaBackend::~CudaBackend() {
  if (scratch_) cudaFree(scratch_);
  if (big_scratch_) cudaFree(big_scratch_);
  if (idx_scratch_) cudaFree(idx_scratch_);
  if (rope_table_) cudaFree(rope_table_);
  if (gemm_scratch_) cudaFree(gemm_scratch_);
  for (const auto& e : prof_) cudaEventDestroy(e.a), cudaEventDestroy(e.b);
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
  name_ = std::string(!mixed_ ? "cuda-f32" : bf16_gemm_ ? "cuda-mixed-bf16" : "cuda-mixed-tf32") +
          (o.deterministic ? " deterministic" : "") + " (" + gpu_name_ + ")";
}

void CudaBackend::track_alloc(void* p, std::size_t bytes) {
  allocs_.emplace_back(p, bytes);
  live_bytes_ += bytes;
  peak_bytes_ = std::max(peak_bytes_, live_bytes_);
}

void CudaBackend::track_free(void* p) {
  for (std::size_t i = 0; i < allocs_.size(); ++i)
    if (allocs_[i].first == p) {
      live_bytes_ -= allocs_[i].second;
      allocs_[i] = allocs_.back();
      allocs_.pop_back();
      return;
    }
}

void* CudaBackend::scratch_bytes(std::size_t bytes) {
  if (bytes > big_scratch_n_) {
    if (big_scratch_) {
      synchronize();
      track_free(big_scratch_);
      LAR_CUDA_CHECK(cudaFree(big_scratch_));
      big_scratch_ = nullptr;
    }
    LAR_CUDA_CHECK(cudaMalloc(&big_scratch_, bytes));
    track_alloc(big_scratch_, bytes);
    big_scratch_n_ = bytes;
  }
  return big_scratch_;
}

double* CudaBackend::scratch_doubles(std::size_t n) {
  if (n > scratch_n_) {
    if (scratch_) LAR_CUDA_CHECK(cudaFree(scratch_));
    LAR_CUDA_CHECK(cudaMalloc(&scratch_, n * sizeof(double)));
    scratch_n_ = n;
  }
  return scratch_;
}

void* CudaBackend::alloc_bytes(std::size_t bytes) {
  void* p = nullptr;
  LAR_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 64));
  track_alloc(p, bytes ? bytes : 64);
  return p;
}

void CudaBackend::free_bytes(void* p) {
  if (p) {
    synchronize();
    track_free(p);
    LAR_CUDA_CHECK(cudaFree(p));
  }
}

void CudaBackend::upload(const void* host, const Tensor& dst) {
  LAR_CUDA_CHECK(cudaMemcpyAsync(dst.data, host, dst.bytes(), cudaMemcpyHostToDevice, stream_));
  synchronize();
}

void CudaBackend::download(const Tensor& src, void* host) {
  LAR_CUDA_CHECK(cudaMemcpyAsync(host, src.data, src.bytes(), cudaMemcpyDeviceToHost, stream_));
  synchronize();
}

void CudaBackend::zero(const Tensor& t) {
  OpTimer timer(*this, "zero");
  LAR_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.bytes(), stream_));
}

void CudaBackend::fill(const Tensor& t, double value) {
  require_f32(t, "fill");
  fill_kernel<<<blocks_for(t.numel(), 256), 256, 0, stream_>>>(t.ptr<float>(), t.numel(), static_cast<float>(value));
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::copy(const Tensor& src, const Tensor& dst) {
  OpTimer timer(*this, "copy");
  if (src.numel() != dst.numel() || src.dtype != dst.dtype)
    throw RuntimeError("cuda copy: " + src.shape_str() + " → " + dst.shape_str());
  LAR_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, stream_));
}

// Row-major C[M,N] = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands.
void CudaBackend::gemm(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C, double alpha,
                       double beta) {
  gemm_batched(A, ta, B, tb, C, 1, alpha, beta);
}

void CudaBackend::gemm_batched(const Tensor& A, bool ta, const Tensor& B, bool tb, const Tensor& C,
                               int64_t batches, double alpha, double beta) {
  OpTimer timer(*this, "gemm");
  require_f32(A, "gemm A");
  require_f32(B, "gemm B");
  require_f32(C, "gemm C");
  int64_t M = C.rows() / batches, N = C.last();
  int64_t K = ta ? A.rows() / batches : A.last();
  int64_t a_rows = A.rows() / batches, b_rows = B.rows() / batches;
  if ((ta ? A.last() : a_rows) != M || (tb ? b_rows : B.last()) != N || (tb ? B.last() : b_rows) != K)
    throw RuntimeError("cuda gemm: shapes " + A.shape_str() + (ta ? "ᵀ" : "") + " · " + B.shape_str() +
                       (tb ? "ᵀ" : "") + " → " + C.shape_str() + " do not match");
  float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
  int lda = static_cast<int>(A.last()), ldb = static_cast<int>(B.last()), ldc = static_cast<int>(N);
  if (!mixed_) {
    LAR_CUBLAS_CHECK(cublasSgemmStridedBatched(
        cublas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
        static_cast<int>(M), static_cast<int>(K), &fa, B.ptr<float>(), ldb, b_rows * B.last(), A.ptr<float>(),
        lda, a_rows * A.last(), &fb, C.ptr<float>(), ldc, M * N, static_cast<int>(batches)));
    return;
  }
  if (bf16_gemm_) {
    // Operands rounded to bf16 (one pass each over A and B), bf16 tensor-core products,
    // fp32 accumulation and fp32 C. Measured faster than cuBLAS's FAST_16BF on the same
    // fp32 operands (docs/perf.md), which spent 175 ms of a 0.38 s step in GEMMs.
    const std::size_t na = A.numel(), nb = B.numel(), abytes = (na * 2 + 255) / 256 * 256;
    if (abytes + nb * 2 > gemm_scratch_n_) {
      if (gemm_scratch_) {
        synchronize();
        track_free(gemm_scratch_);
        LAR_CUDA_CHECK(cudaFree(gemm_scratch_));
      }
      gemm_scratch_n_ = abytes + nb * 2;
      LAR_CUDA_CHECK(cudaMalloc(&gemm_scratch_, gemm_scratch_n_));
      track_alloc(gemm_scratch_, gemm_scratch_n_);
    }
    auto* ab = static_cast<__nv_bfloat16*>(gemm_scratch_);
    auto* bb = reinterpret_cast<__nv_bfloat16*>(static_cast<char*>(gemm_scratch_) + abytes);
    f32_to_bf16_kernel<<<blocks_for(na, 256), 256, 0, stream_>>>(A.ptr<float>(), ab, na);
    LAR_CUDA_LAUNCHED();
    f32_to_bf16_kernel<<<blocks_for(nb, 256), 256, 0, stream_>>>(B.ptr<float>(), bb, nb);
    LAR_CUDA_LAUNCHED();
    LAR_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        cublas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
        static_cast<int>(M), static_cast<int>(K), &fa, bb, CUDA_R_16BF, ldb, b_rows * B.last(), ab, CUDA_R_16BF,
        lda, a_rows * A.last(), &fb, C.data, CUDA_R_32F, ldc, M * N, static_cast<int>(batches), CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT));
    return;
  }
  // fp32 tensors, TF32 tensor-core products, fp32 accumulation and output.
  LAR_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      cublas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
      static_cast<int>(M), static_cast<int>(K), &fa, B.data, CUDA_R_32F, ldb, b_rows * B.last(), A.data, CUDA_R_32F,
      lda, a_rows * A.last(), &fb, C.data, CUDA_R_32F, ldc, M * N, static_cast<int>(batches),
      CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
}

void CudaBackend::axpy(double alpha, const Tensor& x, const Tensor& y) {
  OpTimer timer(*this, "axpy");
  axpy_kernel<<<blocks_for(x.numel(), 256), 256, 0, stream_>>>(static_cast<float>(alpha), x.ptr<float>(),
                                                              y.ptr<float>(), x.numel());
  LAR_CUDA_LAUNCHED();
}

// Runs a per-block partial kernel over x, adds the partials in a fixed order on the
// device and returns the total (deterministic for a fixed grid).
double CudaBackend::reduce_to_host(void (*partial_kernel)(const float*, int64_t, double*), const Tensor& x) {
  OpTimer timer(*this, "reduce (norms)");
  double* partial = scratch_doubles(kReduceBlocks + 1);
  partial_kernel<<<kReduceBlocks, 256, 0, stream_>>>(x.ptr<float>(), x.numel(), partial);
  LAR_CUDA_LAUNCHED();
  sum_partials<<<1, 32, 0, stream_>>>(partial, kReduceBlocks, partial + kReduceBlocks);
  LAR_CUDA_LAUNCHED();
  double out = 0;
  LAR_CUDA_CHECK(cudaMemcpyAsync(&out, partial + kReduceBlocks, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return out;
}

double CudaBackend::sum_squares(const Tensor& x) { return reduce_to_host(sum_squares_partial, x); }

bool CudaBackend::all_finite(const Tensor& x) { return reduce_to_host(nonfinite_partial, x) == 0; }

void CudaBackend::embedding_fwd(const Tensor& ids, const Tensor& table, const Tensor& out) {
  OpTimer timer(*this, "embedding");
  int64_t n = ids.numel(), d = table.last();
  embedding_fwd_kernel<<<blocks_for(n * d, 256), 256, 0, stream_>>>(ids.ptr<int>(), table.ptr<float>(),
                                                                    out.ptr<float>(), n, d);
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::embedding_bwd(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  OpTimer timer(*this, "embedding");
  const int64_t n = ids.numel(), d = dtable.last(), V = dtable.rows();
  // A stable counting sort of the token positions by id, on the host (N ints each way).
  host_ids_.resize(n);
  download(ids, host_ids_.data());
  std::vector<int32_t> count(static_cast<std::size_t>(V) + 1, 0);
  for (int32_t id : host_ids_) {
    if (id < 0 || id >= V) throw RuntimeError("embedding_bwd: id " + std::to_string(id) + " outside the table");
    ++count[id];
  }
  host_starts_.clear();
  std::vector<int32_t> uniq, pos(static_cast<std::size_t>(V));
  int32_t run = 0;
  for (int64_t v = 0; v < V; ++v)
    if (count[v]) {
      uniq.push_back(static_cast<int32_t>(v));
      host_starts_.push_back(run);
      pos[v] = run;
      run += count[v];
    }
  host_starts_.push_back(run);
  host_order_.resize(n);
  for (int64_t i = 0; i < n; ++i) host_order_[pos[host_ids_[i]]++] = static_cast<int32_t>(i);
  const std::size_t nu = uniq.size(), need = 2 * nu + 1 + n;
  if (nu == 0) return;
  if (need > idx_scratch_n_) {
    if (idx_scratch_) {
      synchronize();
      track_free(idx_scratch_);
      LAR_CUDA_CHECK(cudaFree(idx_scratch_));
    }
    LAR_CUDA_CHECK(cudaMalloc(&idx_scratch_, need * sizeof(int32_t)));
    track_alloc(idx_scratch_, need * sizeof(int32_t));
    idx_scratch_n_ = need;
  }
  int32_t* d_uniq = idx_scratch_;
  int32_t* d_starts = d_uniq + nu;
  int32_t* d_order = d_starts + nu + 1;
  LAR_CUDA_CHECK(cudaMemcpyAsync(d_uniq, uniq.data(), nu * 4, cudaMemcpyHostToDevice, stream_));
  LAR_CUDA_CHECK(cudaMemcpyAsync(d_starts, host_starts_.data(), (nu + 1) * 4, cudaMemcpyHostToDevice, stream_));
  LAR_CUDA_CHECK(cudaMemcpyAsync(d_order, host_order_.data(), n * 4, cudaMemcpyHostToDevice, stream_));
  dim3 grid(static_cast<unsigned>((d + 127) / 128), static_cast<unsigned>(nu));
  embedding_bwd_kernel<<<grid, 128, 0, stream_>>>(d_uniq, d_starts, d_order, dout.ptr<float>(), dtable.ptr<float>(), d);
  LAR_CUDA_LAUNCHED();
  synchronize();  // the host vectors are reused by the next call
}

void CudaBackend::rmsnorm_fwd(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd, double eps) {
  OpTimer timer(*this, "rmsnorm");
  int64_t n = x.rows(), d = x.last();
  rmsnorm_fwd_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(x.ptr<float>(), w.ptr<float>(), y.ptr<float>(),
                                                                    rstd.ptr<float>(), d, static_cast<float>(eps));
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                              const Tensor& dx, const Tensor& dw) {
  OpTimer timer(*this, "rmsnorm");
  int64_t n = x.rows(), d = x.last();
  rmsnorm_bwd_dx_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(x.ptr<float>(), w.ptr<float>(),
                                                                       rstd.ptr<float>(), dy.ptr<float>(),
                                                                       dx.ptr<float>(), d);
  LAR_CUDA_LAUNCHED();
  const int chunks = static_cast<int>(std::min<int64_t>(128, std::max<int64_t>(1, n / 64)));
  const int64_t rows_per = (n + chunks - 1) / chunks;
  double* partial = scratch_doubles(static_cast<std::size_t>(chunks) * d);
  rmsnorm_bwd_dw_partial<<<dim3(static_cast<unsigned>((d + 127) / 128), chunks), 128, 0, stream_>>>(
      x.ptr<float>(), rstd.ptr<float>(), dy.ptr<float>(), partial, n, d, rows_per);
  LAR_CUDA_LAUNCHED();
  rmsnorm_bwd_dw_final<<<blocks_for(d, 128), 128, 0, stream_>>>(partial, dw.ptr<float>(), d, chunks);
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::swiglu_fwd(const Tensor& gu, const Tensor& h) {
  OpTimer timer(*this, "swiglu");
  int64_t n = h.rows(), f = h.last();
  swiglu_fwd_kernel<<<blocks_for(n * f, 256), 256, 0, stream_>>>(gu.ptr<float>(), h.ptr<float>(), n, f);
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::swiglu_bwd(const Tensor& gu, const Tensor& dh, const Tensor& dgu) {
  OpTimer timer(*this, "swiglu");
  int64_t n = dh.rows(), f = dh.last();
  swiglu_bwd_kernel<<<blocks_for(n * f, 256), 256, 0, stream_>>>(gu.ptr<float>(), dh.ptr<float>(),
                                                                 dgu.ptr<float>(), n, f);
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::rope(const Tensor& x, double base, int64_t pos0, double sign) {
  const int64_t T = x.size(1), D = x.size(3), half = D / 2;
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
  float2* cs = static_cast<float2*>(rope_table_);
  rope_table_kernel<<<blocks_for(T * half, 256), 256, 0, stream_>>>(cs, T, D, base, pos0, sign);
  LAR_CUDA_LAUNCHED();
  rope_apply_kernel<<<blocks_for(x.numel() / 2, 256), 256, 0, stream_>>>(x.ptr<float>(), cs, x.size(0), T, x.size(2), D);
  LAR_CUDA_LAUNCHED();
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

void CudaBackend::attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                const Tensor& lse, double scale, int64_t window) {
  OpTimer timer(*this, "attention fwd");
  if (flash_ok(q, v)) return flash_fwd(q, k, v, o, lse, scale, window);
  AttnShape s = attn_shape(q, k, v, scale, window);
  int64_t warps = s.B * s.T * s.Hq;
  attention_fwd_kernel<<<blocks_for(warps * kWarp, 256), 256, 0, stream_>>>(
      q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), o.ptr<float>(), lse.ptr<float>(), s);
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::attention_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                const Tensor& dv, double scale, int64_t window) {
  OpTimer timer(*this, "attention bwd");
  if (flash_ok(q, v)) return flash_bwd(q, k, v, o, lse, dout, dq, dk, dv, scale, window);
  AttnShape s = attn_shape(q, k, v, scale, window);
  float* delta = nullptr;
  LAR_CUDA_CHECK(cudaMallocAsync(&delta, sizeof(float) * s.B * s.Hq * s.T, stream_));
  int64_t qwarps = s.B * s.T * s.Hq, kwarps = s.B * s.S * s.Hkv;
  attention_delta_kernel<<<blocks_for(qwarps * kWarp, 256), 256, 0, stream_>>>(o.ptr<float>(), dout.ptr<float>(),
                                                                               delta, s);
  LAR_CUDA_LAUNCHED();
  attention_dq_kernel<<<blocks_for(qwarps * kWarp, 256), 256, 0, stream_>>>(
      q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), lse.ptr<float>(), delta, dout.ptr<float>(), dq.ptr<float>(), s);
  LAR_CUDA_LAUNCHED();
  attention_dkv_kernel<<<blocks_for(kwarps * kWarp, 256), 256, 0, stream_>>>(
      q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), lse.ptr<float>(), delta, dout.ptr<float>(), dk.ptr<float>(),
      dv.ptr<float>(), s);
  LAR_CUDA_LAUNCHED();
  LAR_CUDA_CHECK(cudaFreeAsync(delta, stream_));
}

double CudaBackend::cross_entropy_fwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                      const Tensor& losses, const Tensor& argmax) {
  OpTimer timer(*this, "cross-entropy");
  int64_t n = logits.rows(), V = logits.last();
  ce_fwd_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(logits.ptr<float>(), targets.ptr<int>(),
                                                               mask.ptr<float>(), losses.ptr<float>(),
                                                               argmax.empty() ? nullptr : argmax.ptr<int>(), V);
  LAR_CUDA_LAUNCHED();
  // The sum in a fixed order on the host (N floats is small next to N·V logits).
  std::vector<float> host(static_cast<std::size_t>(n));
  download(losses, host.data());
  double total = 0;
  for (float l : host) total += l;
  return total;
}

void CudaBackend::cross_entropy_bwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                    double grad_scale, const Tensor& dlogits) {
  OpTimer timer(*this, "cross-entropy");
  int64_t n = logits.rows(), V = logits.last();
  ce_bwd_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(logits.ptr<float>(), targets.ptr<int>(),
                                                               mask.ptr<float>(), static_cast<float>(grad_scale),
                                                               dlogits.ptr<float>(), V);
  LAR_CUDA_LAUNCHED();
}

// ---- optimiser updates (kernels/cuda/optim) ----

void CudaBackend::adamw_step(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                             const AdamWStep& s) {
  OpTimer timer(*this, "optimiser");
  const int64_t n = w.numel();
  if (g.numel() != n || m.numel() != n || v.numel() != n) throw RuntimeError("cuda adamw_step: sizes differ");
  optim::adamw_step(w.ptr<float>(), g.ptr<float>(), m.ptr<float>(), v.ptr<float>(), n, s, stream_);
}

void CudaBackend::momentum_step(const Tensor& g, const Tensor& buf, const Tensor& u, double mu, bool nesterov) {
  OpTimer timer(*this, "optimiser");
  if (buf.numel() != g.numel() || u.numel() != g.numel()) throw RuntimeError("cuda momentum_step: sizes differ");
  optim::momentum_step(g.ptr<float>(), buf.ptr<float>(), u.ptr<float>(), g.numel(), static_cast<float>(mu), nesterov,
                       stream_);
}

void CudaBackend::scale(const Tensor& x, double alpha) {
  OpTimer timer(*this, "optimiser");
  optim::scale(x.ptr<float>(), x.numel(), static_cast<float>(alpha), stream_);
}

void CudaBackend::transpose(const Tensor& src, const Tensor& dst, double alpha) {
  OpTimer timer(*this, "optimiser");
  if (src.numel() != dst.numel()) throw RuntimeError("cuda transpose: " + src.shape_str() + " → " + dst.shape_str());
  optim::transpose(src.ptr<float>(), dst.ptr<float>(), src.rows(), src.last(), static_cast<float>(alpha), stream_);
}

void CudaBackend::normuon_normalize(const Tensor& o, const Tensor& V, double beta2, double eps) {
  OpTimer timer(*this, "optimiser");
  const int64_t rows = o.rows(), cols = o.last();
  if (V.numel() != std::max(rows, cols)) throw RuntimeError("cuda normuon_normalize: V has " + V.shape_str());
  double* scratch = scratch_doubles(static_cast<std::size_t>(optim::normuon_scratch_doubles(rows, cols)));
  optim::normuon_normalize(o.ptr<float>(), V.ptr<float>(), rows, cols, beta2, eps, scratch, stream_);
}

void CudaBackend::decayed_update(const Tensor& w, const Tensor& o, double decay, double step) {
  OpTimer timer(*this, "optimiser");
  if (w.numel() != o.numel()) throw RuntimeError("cuda decayed_update: sizes differ");
  optim::decayed_update(w.ptr<float>(), o.ptr<float>(), w.numel(), static_cast<float>(decay),
                        static_cast<float>(step), stream_);
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
