// The CUDA backend's RMSNorm ops: the plain one-block-per-row kernels, the warp-per-row fast
// paths (forward with the residual sum fused, backward with the weight gradient's partial sums
// and the bf16 conversion fused), and their dispatch.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/backend_device.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_backend_internal.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda {

namespace {

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
template <class TD>
__global__ void rmsnorm_bwd_dx_kernel(const float* x, const float* w, const float* rstd, const TD* dy,
                                      float* dx, int64_t d) {
  int64_t row = blockIdx.x;
  const float* xr = x + row * d;
  const TD* dyr = dy + row * d;
  double gx = 0;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) gx += static_cast<double>(ldf(dyr + i)) * w[i] * xr[i];
  gx = block_sum_d(gx);
  float r = rstd[row];
  float c = static_cast<float>(gx / d) * r * r * r;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) dx[row * d + i] += r * ldf(dyr + i) * w[i] - xr[i] * c;
}

// dw[i] += Σ_rows dy·x·r in two deterministic stages: per chunk of rows (one thread per
// column, rows in order) into partial[chunk][col], then the chunks in order.
template <class TD>
__global__ void rmsnorm_bwd_dw_partial(const float* x, const float* rstd, const TD* dy, double* partial,
                                       int64_t n, int64_t d, int64_t rows_per_chunk) {
  int64_t col = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (col >= d) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk, r1 = r0 + rows_per_chunk < n ? r0 + rows_per_chunk : n;
  double acc = 0;
  for (int64_t r = r0; r < r1; ++r) acc += static_cast<double>(ldf(dy + r * d + col)) * x[r * d + col] * rstd[r];
  partial[blockIdx.y * d + col] = acc;
}

__global__ void rmsnorm_bwd_dw_final(const double* partial, float* dw, int64_t d, int chunks) {
  int64_t col = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (col >= d) return;
  double acc = 0;
  for (int c = 0; c < chunks; ++c) acc += partial[c * d + col];
  dw[col] += static_cast<float>(acc);
}

// RMSNorm forward with the output in TY (f32 or bf16); the same arithmetic as
// rmsnorm_fwd_kernel. With r given, h = x + r is formed and written first (the residual
// add fused with the next norm; h may alias x).
template <class TR, class TY>
__global__ void add_rmsnorm_fwd_kernel(const float* x, const TR* r, float* h, const float* w, TY* y,
                                       float* rstd, int64_t d, float eps) {
  const int64_t row = blockIdx.x;
  const float* xr = x + row * d;
  float* hr = h + row * d;
  double ss = 0;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    float v = xr[i];
    if (r) {
      v += ldf(r + row * d + i);
      hr[i] = v;
    }
    ss += static_cast<double>(v) * v;
  }
  ss = block_sum_d(ss);  // its barriers also order the h writes before the reads below
  const float rs = static_cast<float>(1.0 / sqrt(ss / d + eps));
  if (threadIdx.x == 0) rstd[row] = rs;
  const float* src = r ? hr : xr;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) stf(y + row * d + i, src[i] * rs * w[i]);
}


// ---- warp-per-row RMSNorm (d % 4 == 0, 16-byte aligned rows): the fast path ----
// One warp per row, lane c handles the 4-element groups c, c+32, …; the row stays in
// registers between the sum of squares and the output (one read of x, one write of y).
// KMAX bounds the groups per lane (d ≤ 128·KMAX). Sums in float per lane, then a
// fixed-order warp sum: deterministic.
constexpr int kNormWarps = 8;  // rows per block of the warp-per-row norms

// y = RMSNorm(x + r) (r optional: TR = float with r = nullptr for the plain norm); h = x + r
// written when r is given (h may alias x: each element is read before it is written by the
// same lane).
template <int KMAX, class TR, class TY>
__global__ void __launch_bounds__(32 * kNormWarps) rmsnorm_fwd_rows(const float* x, const TR* r, float* h,
                                                                    const float* __restrict__ w, TY* __restrict__ y,
                                                                    float* __restrict__ rstd, int64_t n, int d,
                                                                    float eps) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = blockIdx.x * (int64_t)kNormWarps + threadIdx.x / kWarp;
  if (row >= n) return;
  const int d4 = d / 4;
  const int64_t base = row * d;
  float v[KMAX][4];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = lane + kWarp * k;
    if (c < d4) {
      ld4(x + base + 4 * c, v[k]);
      if (r) {
        float b[4];
        ld4(r + base + 4 * c, b);
#pragma unroll
        for (int e = 0; e < 4; ++e) v[k][e] += b[e];
        st4(h + base + 4 * c, v[k]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) ss += v[k][e] * v[k][e];
    }
  }
  ss = warp_sum(ss);
  const float rs = static_cast<float>(1.0 / sqrt(static_cast<double>(ss) / d + eps));
  if (lane == 0) rstd[row] = rs;
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = lane + kWarp * k;
    if (c < d4) {
      float wv[4], o[4];
      ld4(w + 4 * c, wv);
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = v[k][e] * rs * wv[e];
      st4(y + base + 4 * c, o);
    }
  }
}

// RMSNorm backward, one pass: per row (one warp) dx += r·g − x·r³·(g·x)/d with g = dy·w,
// optionally dx_out = the new dx in TO (bf16: the next GEMMs' operand, instead of a separate
// conversion pass), and dw's contribution Σ_rows dy·x·r accumulated per warp in shared
// memory (each lane owns the same columns in every row: no conflicts, no barriers), then
// summed over the block's warps in a fixed order into partial[block][col]: no second read
// of x and dy for dw, no atomics. x, dy and the old dx of a row are loaded together before
// the row's reduction (three streams in flight per warp). Rows go to warps round-robin
// over a fixed grid, so the result does not depend on scheduling. With r given (TR bf16 or
// f32), the norm's input is x + r, formed exactly as rmsnorm_fwd_rows forms h (the same
// float add): the forward's sum need not be stored.
template <int KMAX, class TD, class TO, class TR>
__global__ void __launch_bounds__(32 * kNormWarps, 2)
    rmsnorm_bwd_rows(const float* __restrict__ x, const TR* __restrict__ res, const float* __restrict__ w,
                     const float* __restrict__ rstd, const TD* __restrict__ dy, float* __restrict__ dx,
                     TO* __restrict__ dx_out, float* __restrict__ partial, int64_t n, int d) {
  extern __shared__ float warp_dw[];  // [kNormWarps][d]
  const int lane = threadIdx.x % kWarp, wid = threadIdx.x / kWarp;
  const int d4 = d / 4;
  float* my_dw = warp_dw + wid * d;
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = lane + kWarp * k;
    if (c < d4) {
      const float z[4] = {0.f, 0.f, 0.f, 0.f};
      st4(my_dw + 4 * c, z);
    }
  }
  const int64_t warps = (int64_t)gridDim.x * kNormWarps;
  for (int64_t row = blockIdx.x * (int64_t)kNormWarps + wid; row < n; row += warps) {
    const int64_t base = row * d;
    const float r = rstd[row];
    float xv[KMAX][4], gv[KMAX][4], ov[KMAX][4];
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = lane + kWarp * k;
      if (c < d4) {
        ld4(x + base + 4 * c, xv[k]);
        if (res) {
          float b[4];
          ld4(res + base + 4 * c, b);
#pragma unroll
          for (int e = 0; e < 4; ++e) xv[k][e] += b[e];
        }
        ld4(dy + base + 4 * c, gv[k]);
        ld4(dx + base + 4 * c, ov[k]);
      }
    }
    float gx = 0.f;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = lane + kWarp * k;
      if (c < d4) {
        float wv[4], acc[4];
        ld4(w + 4 * c, wv);
        ld4(my_dw + 4 * c, acc);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc[e] += gv[k][e] * xv[k][e] * r;
          gv[k][e] *= wv[e];  // g = dy·w from here on
          gx += gv[k][e] * xv[k][e];
        }
        st4(my_dw + 4 * c, acc);
      }
    }
    gx = warp_sum(gx);
    const float cc = (gx / d) * r * r * r;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = lane + kWarp * k;
      if (c < d4) {
#pragma unroll
        for (int e = 0; e < 4; ++e) ov[k][e] += r * gv[k][e] - xv[k][e] * cc;
        st4(dx + base + 4 * c, ov[k]);
        if (dx_out) st4(dx_out + base + 4 * c, ov[k]);
      }
    }
  }
  __syncthreads();
  for (int col = threadIdx.x; col < d; col += blockDim.x) {
    float s = 0.f;
    for (int i = 0; i < kNormWarps; ++i) s += warp_dw[i * d + col];
    partial[blockIdx.x * (int64_t)d + col] = s;
  }
}

// dw[col] += Σ_blocks partial[block][col] in double, in a fixed order: 8 rows of threads
// each sum every 8th block's partial in block order, then those 8 sums in row order. (One
// thread per column summing all 264 partials in sequence was a latency-bound tail of a few
// µs per norm on only d/128 blocks.)
constexpr int kDwRows = 8;
__global__ void __launch_bounds__(32 * kDwRows) rmsnorm_dw_sum(const float* partial, float* dw, int d, int blocks) {
  __shared__ double part[kDwRows][kWarp];
  const int col = blockIdx.x * kWarp + threadIdx.x;
  double s = 0;
  if (col < d)
    for (int b = threadIdx.y; b < blocks; b += kDwRows) s += partial[b * (int64_t)d + col];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= d) return;
  double t = 0;
  for (int i = 0; i < kDwRows; ++i) t += part[i][threadIdx.x];
  dw[col] += static_cast<float>(t);
}

// The same backward through a cp.async pipeline: each warp owns STAGES row buffers in
// shared memory and, while it computes row i from one of them, the copies of its next
// STAGES − 1 rows (x, the old dx, dy and r: 12 KB a row at d = 1024) are in flight. The
// register-staged kernel above holds one row per warp in registers (16 rows per SM, none in
// flight while a warp reduces and stores); here loads never wait on a warp's own arithmetic
// (H200, 32768 × 1024, bf16 dy: 179 → 152 µs plain, 195 → 167 µs with r; dev/perf-history.md,
// "Training step: pipelined norm backward, clip folded into AdamW, bf16 reductions"). dw's row terms stay in registers (lane-owned columns), then the block's warps
// are summed in a fixed order into partial[block][col] as above. Rows go to warps
// round-robin over a fixed grid: deterministic, no atomics. d % 8 == 0, d ≤ 128·KMAX, every
// row 16-byte aligned.
__device__ inline void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ inline void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Bytes of one row buffer: x and the old dx (f32), dy (TD), r (TR) when given, then the
// row's rstd (16 bytes, so that every buffer stays 16-byte aligned).
template <class TD, class TR>
__host__ __device__ inline int norm_pipe_row_bytes(int d, bool has_r) {
  return d * (8 + static_cast<int>(sizeof(TD)) + (has_r ? static_cast<int>(sizeof(TR)) : 0)) + 16;
}
template <int KMAX, class TD, class TR, int WARPS, int STAGES>
__global__ void __launch_bounds__(32 * WARPS, 1)
    rmsnorm_bwd_pipe(const float* __restrict__ x, const TR* __restrict__ res, const float* __restrict__ w,
                     const float* __restrict__ rstd, const TD* __restrict__ dy, float* __restrict__ dx,
                     bf16* __restrict__ dx_out, float* __restrict__ partial, int64_t n, int d) {
  extern __shared__ __align__(16) unsigned char pipe_smem[];
  const int lane = threadIdx.x % kWarp, wid = threadIdx.x / kWarp;
  const int d4 = d / 4;
  const int row_bytes = norm_pipe_row_bytes<TD, TR>(d, res != nullptr);
  unsigned char* mine = pipe_smem + static_cast<std::size_t>(wid) * STAGES * row_bytes;
  const int64_t warps = (int64_t)gridDim.x * WARPS, first = blockIdx.x * (int64_t)WARPS + wid;
  constexpr int kEy = 16 / sizeof(TD), kEr = 16 / sizeof(TR);
  // One commit group per row, empty past the end, so the wait counts below hold throughout.
  auto issue = [&](int64_t row, int stage) {
    if (row < n) {
      unsigned char* s = mine + stage * row_bytes;
      const int64_t base = row * d;
      for (int c = lane; c < d4; c += kWarp) {
        cp_async16(s + 16 * c, x + base + 4 * c);
        cp_async16(s + 4 * d + 16 * c, dx + base + 4 * c);
      }
      for (int c = lane; c < d / kEy; c += kWarp) cp_async16(s + 8 * d + 16 * c, dy + base + kEy * c);
      if (res)
        for (int c = lane; c < d / kEr; c += kWarp)
          cp_async16(s + 8 * d + d * static_cast<int>(sizeof(TD)) + 16 * c, res + base + kEr * c);
      if (lane == 0) cp_async4(s + row_bytes - 16, rstd + row);  // no dependent load per row
    }
    cp_async_commit();
  };
  float wv[KMAX][4], dwa[KMAX][4];
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = lane + kWarp * k;
#pragma unroll
    for (int e = 0; e < 4; ++e) dwa[k][e] = 0.f, wv[k][e] = 0.f;
    if (c < d4) ld4(w + 4 * c, wv[k]);
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(first + s * warps, s);
  int it = 0;
  for (int64_t row = first; row < n; row += warps, ++it) {
    __syncwarp();  // every lane is done with the buffer that the next issue refills
    issue(row + (STAGES - 1) * warps, (it + STAGES - 1) % STAGES);
    cp_async_wait<STAGES - 1>();  // this row's copies (each lane's own) have landed
    __syncwarp();                 // … and every other lane's
    const unsigned char* s = mine + (it % STAGES) * row_bytes;
    const float* sx = reinterpret_cast<const float*>(s);
    const float* sdx = reinterpret_cast<const float*>(s + 4 * d);
    const TD* sdy = reinterpret_cast<const TD*>(s + 8 * d);
    const TR* sr = reinterpret_cast<const TR*>(s + 8 * d + d * static_cast<int>(sizeof(TD)));
    const float r = *reinterpret_cast<const float*>(s + row_bytes - 16);
    float xv[KMAX][4], gv[KMAX][4];
    float gx = 0.f;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = lane + kWarp * k;
      if (c < d4) {
        ld4(sx + 4 * c, xv[k]);
        if (res) {
          float b[4];
          ld4(sr + 4 * c, b);
#pragma unroll
          for (int e = 0; e < 4; ++e) xv[k][e] += b[e];
        }
        ld4(sdy + 4 * c, gv[k]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dwa[k][e] += gv[k][e] * xv[k][e] * r;
          gv[k][e] *= wv[k][e];  // g = dy·w from here on
          gx += gv[k][e] * xv[k][e];
        }
      }
    }
    gx = warp_sum(gx);
    const float cc = (gx / d) * r * r * r;
    const int64_t base = row * d;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = lane + kWarp * k;
      if (c < d4) {
        float ov[4];
        ld4(sdx + 4 * c, ov);
#pragma unroll
        for (int e = 0; e < 4; ++e) ov[e] += r * gv[k][e] - xv[k][e] * cc;
        st4(dx + base + 4 * c, ov);
        if (dx_out) st4(dx_out + base + 4 * c, ov);
      }
    }
  }
  cp_async_wait<0>();  // the empty groups past the end
  __syncthreads();
  float* warp_dw = reinterpret_cast<float*>(pipe_smem);  // [WARPS][d]: fits in the row buffers
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = lane + kWarp * k;
    if (c < d4) st4(warp_dw + wid * d + 4 * c, dwa[k]);
  }
  __syncthreads();
  for (int col = threadIdx.x; col < d; col += blockDim.x) {
    float t = 0.f;
    for (int i = 0; i < WARPS; ++i) t += warp_dw[i * d + col];
    partial[blockIdx.x * (int64_t)d + col] = t;
  }
}

}  // namespace

namespace {
// Groups of 4 columns per lane of the warp-per-row norm kernels for rows of d (0: they do
// not apply — d % 4 != 0, or d > 1024).
int norm_groups(int64_t d) {
  if (d % 4 != 0 || d <= 0) return 0;
  const int64_t g = (d / 4 + kWarp - 1) / kWarp;
  return g <= 1 ? 1 : g <= 2 ? 2 : g <= 4 ? 4 : g <= 8 ? 8 : 0;
}
unsigned norm_fwd_blocks(int64_t n) { return static_cast<unsigned>((n + kNormWarps - 1) / kNormWarps); }

template <int K, class TR, class TY>
void norm_fwd_k(const Tensor& x, const TR* r, const Tensor& h, const Tensor& w, const Tensor& y, const Tensor& rstd,
                float eps, cudaStream_t st) {
  const int64_t n = x.rows();
  rmsnorm_fwd_rows<K, TR, TY><<<norm_fwd_blocks(n), 32 * kNormWarps, 0, st>>>(
      x.ptr<float>(), r, h.empty() ? nullptr : h.ptr<float>(), w.ptr<float>(), y.ptr<TY>(), rstd.ptr<float>(), n,
      static_cast<int>(x.last()), eps);
}
// y = RMSNorm(x [+ r]) through the warp-per-row kernel (r, h empty for the plain norm).
template <class TR, class TY>
void norm_fwd_rows(int groups, const Tensor& x, const Tensor& r, const Tensor& h, const Tensor& w, const Tensor& y,
                   const Tensor& rstd, float eps, cudaStream_t st) {
  const TR* rp = r.empty() ? nullptr : r.ptr<TR>();
  switch (groups) {
    case 1: norm_fwd_k<1, TR, TY>(x, rp, h, w, y, rstd, eps, st); break;
    case 2: norm_fwd_k<2, TR, TY>(x, rp, h, w, y, rstd, eps, st); break;
    case 4: norm_fwd_k<4, TR, TY>(x, rp, h, w, y, rstd, eps, st); break;
    default: norm_fwd_k<8, TR, TY>(x, rp, h, w, y, rstd, eps, st); break;
  }
}
template <class TR>
void norm_fwd_rows_y(int groups, const Tensor& x, const Tensor& r, const Tensor& h, const Tensor& w, const Tensor& y,
                     const Tensor& rstd, float eps, cudaStream_t st) {
  if (is_bf16(y)) norm_fwd_rows<TR, bf16>(groups, x, r, h, w, y, rstd, eps, st);
  else norm_fwd_rows<TR, float>(groups, x, r, h, w, y, rstd, eps, st);
}
bool norm_rows_ok(const Tensor& x, std::initializer_list<const Tensor*> others) {
  if (norm_groups(x.last()) == 0 || !aligned16(x)) return false;
  for (const Tensor* t : others)
    if (!t->empty() && !aligned16(*t)) return false;
  return true;
}
// Blocks of the one-pass norm backward: a fixed count for a given row count (so the
// dw partial sums, and the result, do not depend on the device).
constexpr int kNormBwdBlocks = 264;
int norm_bwd_blocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>(kNormBwdBlocks, (n + kNormWarps - 1) / kNormWarps));
}
template <int K, class TD, class TO, class TR>
void norm_bwd_k(const Tensor& x, const Tensor& r, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                const Tensor& dx, const Tensor& dx_out, float* partial, int blocks, cudaStream_t st) {
  const int d = static_cast<int>(x.last());
  rmsnorm_bwd_rows<K, TD, TO, TR><<<blocks, 32 * kNormWarps, kNormWarps * d * sizeof(float), st>>>(
      x.ptr<float>(), r.empty() ? nullptr : r.ptr<TR>(), w.ptr<float>(), rstd.ptr<float>(), dy.ptr<TD>(),
      dx.ptr<float>(), dx_out.empty() ? nullptr : dx_out.ptr<TO>(), partial, x.rows(), d);
}
// The pipelined backward (rmsnorm_bwd_pipe): a fixed grid of one block of WARPS warps per SM
// of the H200 (the same partial sums, and bits, on any device).
constexpr int kNormPipeBlocks = 132;
int norm_pipe_blocks(int64_t n, int warps) {
  return static_cast<int>(std::min<int64_t>(kNormPipeBlocks, (n + warps - 1) / warps));
}
// The pipeline's shape: 8 warps × 2 row buffers per SM (measured on the H200 at d = 1024,
// plain / with r: 151.9 / 167.5 µs, against 153.8 / 171.1 for 6 warps × 3 buffers, 155.6 /
// 172.8 for 4 × 4 and 153.6 / 171.2 for 9 × 2; dev/perf-history.md, "Training step: pipelined norm backward, clip folded into AdamW, bf16 reductions"), and
// its shared memory.
constexpr int kPipeWarps = 8, kPipeStages = 2;
std::size_t norm_pipe_smem(int64_t d, std::size_t dy_bytes, std::size_t r_bytes) {
  return static_cast<std::size_t>(kPipeWarps) * kPipeStages *
         (static_cast<std::size_t>(d) * (8 + dy_bytes + r_bytes) + 16);
}
// Whether the pipelined backward takes this shape: d % 8 == 0, d ≤ 1024, buffers that fit.
bool norm_pipe_fits(std::size_t smem_max, int64_t d, std::size_t dy_bytes, std::size_t r_bytes) {
  return d > 0 && d % 8 == 0 && d <= 1024 && norm_pipe_smem(d, dy_bytes, r_bytes) <= smem_max;
}
template <int K, class TD, class TR>
void norm_bwd_pipe_k(const Tensor& x, const Tensor& r, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                     const Tensor& dx, const Tensor& dx_out, float* partial, cudaStream_t st) {
  const int d = static_cast<int>(x.last());
  const std::size_t smem = norm_pipe_smem(d, sizeof(TD), r.empty() ? 0 : sizeof(TR));
  auto kernel = rmsnorm_bwd_pipe<K, TD, TR, kPipeWarps, kPipeStages>;
  LAR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<norm_pipe_blocks(x.rows(), kPipeWarps), 32 * kPipeWarps, smem, st>>>(
      x.ptr<float>(), r.empty() ? nullptr : r.ptr<TR>(), w.ptr<float>(), rstd.ptr<float>(), dy.ptr<TD>(),
      dx.ptr<float>(), dx_out.empty() ? nullptr : dx_out.ptr<bf16>(), partial, x.rows(), d);
}
// Launches the pipelined backward (norm_pipe_fits checked by the caller); returns its grid.
template <class TD, class TR>
int norm_bwd_pipe(const Tensor& x, const Tensor& r, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                  const Tensor& dx, const Tensor& dx_out, float* partial, cudaStream_t st) {
  switch (norm_groups(x.last())) {
    case 1: norm_bwd_pipe_k<1, TD, TR>(x, r, w, rstd, dy, dx, dx_out, partial, st); break;
    case 2: norm_bwd_pipe_k<2, TD, TR>(x, r, w, rstd, dy, dx, dx_out, partial, st); break;
    case 4: norm_bwd_pipe_k<4, TD, TR>(x, r, w, rstd, dy, dx, dx_out, partial, st); break;
    default: norm_bwd_pipe_k<8, TD, TR>(x, r, w, rstd, dy, dx, dx_out, partial, st); break;
  }
  return norm_pipe_blocks(x.rows(), kPipeWarps);
}
template <class TD, class TO, class TR>
void norm_bwd_rows(int groups, const Tensor& x, const Tensor& r, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                   const Tensor& dx, const Tensor& dx_out, float* partial, int blocks, cudaStream_t st) {
  switch (groups) {
    case 1: norm_bwd_k<1, TD, TO, TR>(x, r, w, rstd, dy, dx, dx_out, partial, blocks, st); break;
    case 2: norm_bwd_k<2, TD, TO, TR>(x, r, w, rstd, dy, dx, dx_out, partial, blocks, st); break;
    case 4: norm_bwd_k<4, TD, TO, TR>(x, r, w, rstd, dy, dx, dx_out, partial, blocks, st); break;
    default: norm_bwd_k<8, TD, TO, TR>(x, r, w, rstd, dy, dx, dx_out, partial, blocks, st); break;
  }
}
// The residual sum h = x + r of the fallback path (the float add of the forward kernels).
template <class TR>
__global__ void residual_sum_kernel(const float* x, const TR* r, float* h, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float v = x[i];
    v += ldf(r + i);
    h[i] = v;
  }
}
}  // namespace

void CudaBackend::rmsnorm_fwd(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd, double eps) {
  OpTimer timer(*this, "rmsnorm");
  require_f32(x, "rmsnorm x");
  require_act(y, "rmsnorm y");
  int64_t n = x.rows(), d = x.last();
  if (norm_rows_ok(x, {&w, &y}))
    norm_fwd_rows_y<float>(norm_groups(d), x, Tensor(), Tensor(), w, y, rstd, static_cast<float>(eps), stream_);
  else if (is_bf16(y))
    add_rmsnorm_fwd_kernel<float, bf16><<<static_cast<unsigned>(n), 256, 0, stream_>>>(
        x.ptr<float>(), nullptr, nullptr, w.ptr<float>(), y.ptr<bf16>(), rstd.ptr<float>(), d, static_cast<float>(eps));
  else
    rmsnorm_fwd_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(x.ptr<float>(), w.ptr<float>(), y.ptr<float>(),
                                                                      rstd.ptr<float>(), d, static_cast<float>(eps));
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::add_rmsnorm_fwd(const Tensor& x, const Tensor& r, const Tensor& h, const Tensor& w, const Tensor& y,
                                  const Tensor& rstd, double eps) {
  OpTimer timer(*this, "residual add + rmsnorm");
  require_f32(x, "add_rmsnorm x");
  require_act(r, "add_rmsnorm r");
  require_f32(h, "add_rmsnorm h");
  require_act(y, "add_rmsnorm y");
  if (x.numel() != r.numel() || x.numel() != h.numel() || x.numel() != y.numel())
    throw RuntimeError("cuda add_rmsnorm_fwd: sizes differ");
  touch(h);
  const int64_t n = x.rows(), d = x.last();
  const float fe = static_cast<float>(eps);
  if (norm_rows_ok(x, {&r, &h, &w, &y})) {
    if (is_bf16(r)) norm_fwd_rows_y<bf16>(norm_groups(d), x, r, h, w, y, rstd, fe, stream_);
    else norm_fwd_rows_y<float>(norm_groups(d), x, r, h, w, y, rstd, fe, stream_);
  } else {
    const unsigned rows = static_cast<unsigned>(n);
    if (is_bf16(r) && is_bf16(y))
      add_rmsnorm_fwd_kernel<<<rows, 256, 0, stream_>>>(x.ptr<float>(), r.ptr<bf16>(), h.ptr<float>(), w.ptr<float>(),
                                                        y.ptr<bf16>(), rstd.ptr<float>(), d, fe);
    else if (is_bf16(r))
      add_rmsnorm_fwd_kernel<<<rows, 256, 0, stream_>>>(x.ptr<float>(), r.ptr<bf16>(), h.ptr<float>(), w.ptr<float>(),
                                                        y.ptr<float>(), rstd.ptr<float>(), d, fe);
    else if (is_bf16(y))
      add_rmsnorm_fwd_kernel<<<rows, 256, 0, stream_>>>(x.ptr<float>(), r.ptr<float>(), h.ptr<float>(),
                                                        w.ptr<float>(), y.ptr<bf16>(), rstd.ptr<float>(), d, fe);
    else
      add_rmsnorm_fwd_kernel<<<rows, 256, 0, stream_>>>(x.ptr<float>(), r.ptr<float>(), h.ptr<float>(),
                                                        w.ptr<float>(), y.ptr<float>(), rstd.ptr<float>(), d, fe);
  }
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                              const Tensor& dx, const Tensor& dw) {
  OpTimer timer(*this, "rmsnorm");
  norm_bwd(x, Tensor(), w, rstd, dy, dx, dw, Tensor());
}

void CudaBackend::rmsnorm_bwd_convert(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                                      const Tensor& dx, const Tensor& dw, const Tensor& dx_out) {
  OpTimer timer(*this, "rmsnorm");
  norm_bwd(x, Tensor(), w, rstd, dy, dx, dw, dx_out);
}

void CudaBackend::add_rmsnorm_bwd_convert(const Tensor& x0, const Tensor& r, const Tensor& w, const Tensor& rstd,
                                          const Tensor& dy, const Tensor& dx, const Tensor& dw, const Tensor& dx_act) {
  OpTimer timer(*this, "rmsnorm bwd (x0 + r)");
  require_act(r, "add_rmsnorm_bwd r");
  if (r.numel() != x0.numel()) throw RuntimeError("cuda add_rmsnorm_bwd_convert: sizes differ");
  norm_bwd(x0, r, w, rstd, dy, dx, dw, dx_act);
}

// The norm backward of x (+ r when given) shared by the three ops above.
void CudaBackend::norm_bwd(const Tensor& x, const Tensor& r, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                           const Tensor& dx, const Tensor& dw, const Tensor& dx_out) {
  require_f32(x, "rmsnorm_bwd x");
  require_act(dy, "rmsnorm_bwd dy");
  require_f32(dx, "rmsnorm_bwd dx");
  if (!dx_out.empty()) require_act(dx_out, "rmsnorm_bwd dx_out");
  if (dy.numel() != x.numel() || dx.numel() != x.numel() || (!dx_out.empty() && dx_out.numel() != x.numel()))
    throw RuntimeError("cuda rmsnorm_bwd: sizes differ");
  touch(dx);
  touch(dw);
  if (!dx_out.empty()) touch(dx_out);
  const int64_t n = x.rows(), d = x.last();
  if (n == 0) return;
  if (norm_rows_ok(x, {&r, &w, &dy, &dx, &dx_out}) && (dx_out.empty() || dx_out.dtype == DType::bf16)) {
    // One pass: dx, the bf16 copy and dw's per-block partials, then the partials in order.
    const std::size_t dyb = dtype_size(dy.dtype), rb = r.empty() ? 0 : dtype_size(r.dtype);
    if (norm_pipe_fits(smem_optin_, d, dyb, rb)) {  // pipelined through shared memory
      float* partial =
          reinterpret_cast<float*>(scratch_doubles((static_cast<std::size_t>(kNormPipeBlocks) * d + 1) / 2));
      int blocks = 0;
      if (r.empty() && is_bf16(dy)) blocks = norm_bwd_pipe<bf16, float>(x, r, w, rstd, dy, dx, dx_out, partial, stream_);
      else if (r.empty()) blocks = norm_bwd_pipe<float, float>(x, r, w, rstd, dy, dx, dx_out, partial, stream_);
      else if (is_bf16(r) && is_bf16(dy)) blocks = norm_bwd_pipe<bf16, bf16>(x, r, w, rstd, dy, dx, dx_out, partial, stream_);
      else if (is_bf16(r)) blocks = norm_bwd_pipe<float, bf16>(x, r, w, rstd, dy, dx, dx_out, partial, stream_);
      else if (is_bf16(dy)) blocks = norm_bwd_pipe<bf16, float>(x, r, w, rstd, dy, dx, dx_out, partial, stream_);
      else blocks = norm_bwd_pipe<float, float>(x, r, w, rstd, dy, dx, dx_out, partial, stream_);
      LAR_CUDA_LAUNCHED();
      rmsnorm_dw_sum<<<static_cast<unsigned>((d + kWarp - 1) / kWarp), dim3(kWarp, kDwRows), 0, stream_>>>(
          partial, dw.ptr<float>(), static_cast<int>(d), blocks);
      LAR_CUDA_LAUNCHED();
      return;
    }
    // x + r whose buffers do not fit while x alone would: the sum in scratch, then the
    // pipelined plain backward below (the same bits as the plain backward of the stored sum).
    const bool sum_first = rb > 0 && norm_pipe_fits(smem_optin_, d, dyb, 0);
    if (!sum_first) {
      const int blocks = norm_bwd_blocks(n), g = norm_groups(d);
      float* partial = reinterpret_cast<float*>(scratch_doubles((static_cast<std::size_t>(blocks) * d + 1) / 2));
      if (r.empty() && is_bf16(dy)) norm_bwd_rows<bf16, bf16, float>(g, x, r, w, rstd, dy, dx, dx_out, partial, blocks, stream_);
      else if (r.empty()) norm_bwd_rows<float, bf16, float>(g, x, r, w, rstd, dy, dx, dx_out, partial, blocks, stream_);
      else if (is_bf16(r) && is_bf16(dy)) norm_bwd_rows<bf16, bf16, bf16>(g, x, r, w, rstd, dy, dx, dx_out, partial, blocks, stream_);
      else if (is_bf16(r)) norm_bwd_rows<float, bf16, bf16>(g, x, r, w, rstd, dy, dx, dx_out, partial, blocks, stream_);
      else if (is_bf16(dy)) norm_bwd_rows<bf16, bf16, float>(g, x, r, w, rstd, dy, dx, dx_out, partial, blocks, stream_);
      else norm_bwd_rows<float, bf16, float>(g, x, r, w, rstd, dy, dx, dx_out, partial, blocks, stream_);
      LAR_CUDA_LAUNCHED();
      rmsnorm_dw_sum<<<static_cast<unsigned>((d + kWarp - 1) / kWarp), dim3(kWarp, kDwRows), 0, stream_>>>(
          partial, dw.ptr<float>(), static_cast<int>(d), blocks);
      LAR_CUDA_LAUNCHED();
      return;
    }
  }
  if (!r.empty()) {  // the sum x + r in scratch, then the plain backward of it
    const Tensor h(scratch_bytes(x.bytes()), DType::f32, x.shape());
    if (is_bf16(r))
      residual_sum_kernel<<<blocks_for(x.numel(), 256), 256, 0, stream_>>>(x.ptr<float>(), r.ptr<bf16>(),
                                                                           h.ptr<float>(), x.numel());
    else
      residual_sum_kernel<<<blocks_for(x.numel(), 256), 256, 0, stream_>>>(x.ptr<float>(), r.ptr<float>(),
                                                                           h.ptr<float>(), x.numel());
    LAR_CUDA_LAUNCHED();
    norm_bwd(h, Tensor(), w, rstd, dy, dx, dw, dx_out);
    return;
  }
  if (is_bf16(dy))
    rmsnorm_bwd_dx_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(
        x.ptr<float>(), w.ptr<float>(), rstd.ptr<float>(), dy.ptr<bf16>(), dx.ptr<float>(), d);
  else
    rmsnorm_bwd_dx_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(
        x.ptr<float>(), w.ptr<float>(), rstd.ptr<float>(), dy.ptr<float>(), dx.ptr<float>(), d);
  LAR_CUDA_LAUNCHED();
  const int chunks = static_cast<int>(std::min<int64_t>(128, std::max<int64_t>(1, n / 64)));
  const int64_t rows_per = (n + chunks - 1) / chunks;
  double* partial = scratch_doubles(static_cast<std::size_t>(chunks) * d);
  const dim3 grid(static_cast<unsigned>((d + 127) / 128), chunks);
  if (is_bf16(dy))
    rmsnorm_bwd_dw_partial<<<grid, 128, 0, stream_>>>(x.ptr<float>(), rstd.ptr<float>(), dy.ptr<bf16>(), partial, n,
                                                      d, rows_per);
  else
    rmsnorm_bwd_dw_partial<<<grid, 128, 0, stream_>>>(x.ptr<float>(), rstd.ptr<float>(), dy.ptr<float>(), partial,
                                                      n, d, rows_per);
  LAR_CUDA_LAUNCHED();
  rmsnorm_bwd_dw_final<<<blocks_for(d, 128), 128, 0, stream_>>>(partial, dw.ptr<float>(), d, chunks);
  LAR_CUDA_LAUNCHED();
  if (!dx_out.empty()) {
    if (dx_out.dtype == DType::f32) {
      LAR_CUDA_CHECK(cudaMemcpyAsync(dx_out.data, dx.data, dx.bytes(), cudaMemcpyDeviceToDevice, stream_));
    } else {
      launch_f32_to_bf16(dx.ptr<float>(), dx_out.ptr<bf16>(), dx.numel(), blocks_for((dx.numel() + 3) / 4, 256),
                         stream_);
    }
  }
}

}  // namespace lar::kernels::cuda
