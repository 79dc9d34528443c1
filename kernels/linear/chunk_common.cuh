#pragma once
// Shared device helpers of the chunkwise linear-attention kernels (kernels/delta_rule, kernels/channel_rule, kernels/carve, kernels/ccq):
// mma.sync m16n8k16 bf16 GEMMs on 64×64 shared-memory tiles by 8 warps, fragment stores,
// cp.async tile loads and the register-resident UT/WY substitutions. Internal: included
// only by the .cu files of this folder (everything has internal linkage).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.hpp"

namespace lar::kernels::cuda::linear {
namespace {

// SMs of the current device, for the path cost models (132, the H200's, if the query fails).
inline int sm_count() {
  static const int sms = [] {
    int dev = 0, n = 132;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      n = 132;
    return n;
  }();
  return sms;
}

using bf16 = __nv_bfloat16;
constexpr int C = 64, D = 64, NT = 256, LD = 72, LDF = 72;
constexpr unsigned FULL = 0xffffffffu;
constexpr int TILE = C * LD;    // bf16 elements of one tile
constexpr int TILEF = C * LDF;  // floats of one fp32 tile

// ---------------------------------------------------------------- PTX helpers
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Named barrier id (0 is __syncthreads) among n threads (whole warps): wait, or arrive only.
__device__ __forceinline__ void bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ float bf(const bf16* s, int r, int c) { return __bfloat162float(s[r * LD + c]); }

// ---------------------------------------------------------------- warp GEMM on 64×64 tiles
// The warp tile: rows 16·wm + g (+8), columns 32·wn + 8·nt + 2·tig (+1).
struct Lane {
  int lane, wm, wn, g, tig;
  __device__ Lane() {
    lane = threadIdx.x & 31;
    const int w = threadIdx.x >> 5;
    wm = w & 3, wn = w >> 2, g = lane >> 2, tig = lane & 3;
  }
  // Warp w (0..7) of an 8-warp group inside a larger CTA (warp-specialised kernels).
  __device__ explicit Lane(int w) {
    lane = threadIdx.x & 31;
    wm = w & 3, wn = w >> 2, g = lane >> 2, tig = lane & 3;
  }
  __device__ int row(int e) const { return 16 * wm + g + 8 * (e >> 1); }
  __device__ int col(int nt, int e) const { return 32 * wn + 8 * nt + 2 * tig + (e & 1); }
};
using Acc = float[4][4];
// Sums over the lanes of a fragment: quad_sum over the 4 lanes (tig) that hold one row,
// col8_sum over the 8 lanes (g) that hold one column.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(FULL, x, 1);
  return x + __shfl_xor_sync(FULL, x, 2);
}
__device__ __forceinline__ float col8_sum(float x) {
  x += __shfl_xor_sync(FULL, x, 4);
  x += __shfl_xor_sync(FULL, x, 8);
  return x + __shfl_xor_sync(FULL, x, 16);
}
// Per-column partials of a warp's fragment (col[nt][e] for column L.col(nt, e)) summed over the
// warp's 16 rows into s[wm·C + column]: one slot per row block, summed over the 4 by the reader.
__device__ __forceinline__ void store_col_sums(const float (&col)[4][2], float* s, const Lane& L) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float x = col8_sum(col[nt][e]);
      if (L.g == 0) s[L.wm * C + L.col(nt, e)] = x;
    }
}
__device__ __forceinline__ void zero(Acc& c) {
#pragma unroll
  for (int i = 0; i < 4; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
}
// An fp32 64×64 row-major tile ↔ a warp's accumulator fragments (store scaled by f).
__device__ __forceinline__ void frag_load_f(Acc& c, const float* src, const Lane& L) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float2 x = *reinterpret_cast<const float2*>(src + L.row(2 * hh) * D + L.col(nt, 0));
      c[nt][2 * hh] = x.x, c[nt][2 * hh + 1] = x.y;
    }
}
__device__ __forceinline__ void frag_store_f(float* dst, const Acc& c, const Lane& L, float f = 1.f) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      *reinterpret_cast<float2*>(dst + L.row(2 * hh) * D + L.col(nt, 0)) =
          make_float2(f * c[nt][2 * hh], f * c[nt][2 * hh + 1]);
}
// c += A·B over k = 0..63. A_KM: A stored [k][m] (else [m][k]); B_KN: B stored [k][n] (else [n][k]).
template <bool A_KM, bool B_KN>
__device__ __forceinline__ void gemm(Acc& c, const bf16* A, const bf16* B, const Lane& L) {
  const int lane = L.lane;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[4];
    if (!A_KM)
      ldsm_x4(a, A + (16 * L.wm + (lane & 15)) * LD + 16 * kk + (lane >> 4) * 8);
    else
      ldsm_x4_t(a, A + (16 * kk + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * L.wm + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int nn = 0; nn < 2; ++nn) {
      const int n0 = 32 * L.wn + 16 * nn;
      uint32_t b[4];
      if (!B_KN)
        ldsm_x4(b, B + (n0 + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * kk + ((lane >> 3) & 1) * 8);
      else
        ldsm_x4_t(b, B + (16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3)) * LD + n0 + (lane >> 4) * 8);
      mma(c[2 * nn], a, b[0], b[1]);
      mma(c[2 * nn + 1], a, b[2], b[3]);
    }
  }
}
// Two independent GEMMs with their k loops interleaved: 8 independent MMA chains per warp
// instead of 4, so one GEMM's MMAs fill the other's latency.
template <bool A1_KM, bool B1_KN, bool A2_KM, bool B2_KN>
__device__ __forceinline__ void gemm2(Acc& c1, const bf16* A1, const bf16* B1, Acc& c2, const bf16* A2,
                                      const bf16* B2, const Lane& L) {
  const int lane = L.lane;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a1[4], a2[4];
    if (!A1_KM)
      ldsm_x4(a1, A1 + (16 * L.wm + (lane & 15)) * LD + 16 * kk + (lane >> 4) * 8);
    else
      ldsm_x4_t(a1, A1 + (16 * kk + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * L.wm + ((lane >> 3) & 1) * 8);
    if (!A2_KM)
      ldsm_x4(a2, A2 + (16 * L.wm + (lane & 15)) * LD + 16 * kk + (lane >> 4) * 8);
    else
      ldsm_x4_t(a2, A2 + (16 * kk + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * L.wm + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int nn = 0; nn < 2; ++nn) {
      const int n0 = 32 * L.wn + 16 * nn;
      uint32_t b1[4], b2[4];
      if (!B1_KN)
        ldsm_x4(b1, B1 + (n0 + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * kk + ((lane >> 3) & 1) * 8);
      else
        ldsm_x4_t(b1, B1 + (16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3)) * LD + n0 + (lane >> 4) * 8);
      if (!B2_KN)
        ldsm_x4(b2, B2 + (n0 + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * kk + ((lane >> 3) & 1) * 8);
      else
        ldsm_x4_t(b2, B2 + (16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3)) * LD + n0 + (lane >> 4) * 8);
      mma(c1[2 * nn], a1, b1[0], b1[1]);
      mma(c2[2 * nn], a2, b2[0], b2[1]);
      mma(c1[2 * nn + 1], a1, b1[2], b1[3]);
      mma(c2[2 * nn + 1], a2, b2[2], b2[3]);
    }
  }
}
// c += A·B over k = 16·kk .. 16·kk+15 only (one k-step of gemm above).
template <bool A_KM, bool B_KN>
__device__ __forceinline__ void gemm_k(Acc& c, const bf16* A, const bf16* B, const Lane& L, int kk) {
  const int lane = L.lane;
  uint32_t a[4];
  if (!A_KM)
    ldsm_x4(a, A + (16 * L.wm + (lane & 15)) * LD + 16 * kk + (lane >> 4) * 8);
  else
    ldsm_x4_t(a, A + (16 * kk + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * L.wm + ((lane >> 3) & 1) * 8);
#pragma unroll
  for (int nn = 0; nn < 2; ++nn) {
    const int n0 = 32 * L.wn + 16 * nn;
    uint32_t b[4];
    if (!B_KN)
      ldsm_x4(b, B + (n0 + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * kk + ((lane >> 3) & 1) * 8);
    else
      ldsm_x4_t(b, B + (16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3)) * LD + n0 + (lane >> 4) * 8);
    mma(c[2 * nn], a, b[0], b[1]);
    mma(c[2 * nn + 1], a, b[2], b[3]);
  }
}
// Fragment → bf16 tile (f(value, row, col) gives the stored value).
template <class F>
__device__ __forceinline__ void store_bf(bf16* s, const Acc& c, const Lane& L, F f) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = L.row(2 * h), cc = L.col(nt, 0);
      *reinterpret_cast<uint32_t*>(s + r * LD + cc) = pack(f(c[nt][2 * h], r, cc), f(c[nt][2 * h + 1], r, cc + 1));
    }
}
template <class F>
__device__ __forceinline__ void store_f(float* s, const Acc& c, const Lane& L, F f) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = L.row(2 * h), cc = L.col(nt, 0);
      *reinterpret_cast<float2*>(s + r * LDF + cc) = make_float2(f(c[nt][2 * h], r, cc), f(c[nt][2 * h + 1], r, cc + 1));
    }
}

// Rows row0.. of a [*, 64] bf16 matrix with row stride `stride` into a tile; rows ≥ n → 0.
__device__ __forceinline__ void load_tile(bf16* s, const bf16* gsrc, size_t stride, int n) {
#pragma unroll
  for (int i = threadIdx.x; i < C * 8; i += NT) {
    const int r = i >> 3, c = i & 7;
    const bool ok = r < n;
    cp_async16(s + r * LD + c * 8, ok ? gsrc + r * stride + c * 8 : gsrc, ok);
  }
}

// (I + diag(β) Aw) U = diag(β) X, Aw strictly lower [t][j]. Thread (column c = tid/4, part
// p = tid%4) owns rows 4i+p. Blocked right-looking substitution in blocks of 4 rows (one
// row per part): the block's 4 values are solved in turn (each broadcast in the quad), then
// every later row takes their 4 contributions with one float4 load of Aw.
// subst_fwd_regs takes the right-hand side X already in x (rows 4i+p of column tid/4).
__device__ __forceinline__ void subst_fwd_regs(const float* sAw, const float* sB, float (&x)[16]) {
  const int p = threadIdx.x & 3, lane = threadIdx.x & 31;
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i] = 0.f;
#pragma unroll
  for (int jb = 0; jb < 16; ++jb) {
    const float4 ad = *reinterpret_cast<const float4*>(sAw + (4 * jb + p) * LDF + 4 * jb);
    const float adj[4] = {ad.x, ad.y, ad.z, ad.w};
    float xs[4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      float xj = 0.f;
      if (p == jj) {
        x[jb] = sB[4 * jb + jj] * (x[jb] - acc[jb]);
        xj = x[jb];
      }
      xs[jj] = __shfl_sync(FULL, xj, (lane & ~3) | jj);
      if (p > jj) acc[jb] += adj[jj] * xs[jj];
    }
#pragma unroll
    for (int i = jb + 1; i < 16; ++i) {
      const float4 a = *reinterpret_cast<const float4*>(sAw + (4 * i + p) * LDF + 4 * jb);
      acc[i] += a.x * xs[0] + a.y * xs[1] + a.z * xs[2] + a.w * xs[3];
    }
  }
}
// subst_fwd loads X from the fp32 tile sX.
__device__ __forceinline__ void subst_fwd(const float* sAw, const float* sX, const float* sB, float (&x)[16]) {
  const int c = threadIdx.x >> 2, p = threadIdx.x & 3;
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = sX[(4 * i + p) * LDF + c];
  subst_fwd_regs(sAw, sB, x);
}
// (I + diag(β) Aw)ᵀ Y = dU, in place on x (= dU on entry, rows 4i+p of column c), blocked
// like subst_fwd from the last block up; sAwT = Awᵀ makes the trailing loads float4.
__device__ __forceinline__ void subst_bwd(const float* sAwT, const float* sB, float (&x)[16]) {
  const int p = threadIdx.x & 3, lane = threadIdx.x & 31;
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i] = 0.f;
#pragma unroll
  for (int jb = 15; jb >= 0; --jb) {
    // AwT[4jb+p][4jb+jj] = Aw[4jb+jj][4jb+p]
    const float4 ad = *reinterpret_cast<const float4*>(sAwT + (4 * jb + p) * LDF + 4 * jb);
    const float adj[4] = {ad.x, ad.y, ad.z, ad.w};
    float ys[4];
#pragma unroll
    for (int jj = 3; jj >= 0; --jj) {
      float yj = 0.f;
      if (p == jj) {
        x[jb] -= acc[jb];
        yj = sB[4 * jb + jj] * x[jb];
      }
      ys[jj] = __shfl_sync(FULL, yj, (lane & ~3) | jj);
      if (p < jj) acc[jb] += adj[jj] * ys[jj];
    }
#pragma unroll
    for (int i = 0; i < jb; ++i) {
      const float4 a = *reinterpret_cast<const float4*>(sAwT + (4 * i + p) * LDF + 4 * jb);
      acc[i] += a.x * ys[0] + a.y * ys[1] + a.z * ys[2] + a.w * ys[3];
    }
  }
}

// subst_bwd without the Awᵀ copy (scalar loads of Aw; for kernels short of shared memory).
__device__ __forceinline__ void subst_bwd_scalar(const float* sAw, const float* sB, float (&x)[16]) {
  const int p = threadIdx.x & 3, lane = threadIdx.x & 31;
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i] = 0.f;
#pragma unroll
  for (int t = C - 1; t >= 0; --t) {
    const int o = t & 3, it = t >> 2;
    float yt = 0.f;
    if (p == o) {
      x[it] -= acc[it];
      yt = sB[t] * x[it];
    }
    yt = __shfl_sync(FULL, yt, (lane & ~3) | o);
#pragma unroll
    for (int i = 0; i <= it; ++i) acc[i] += sAw[t * LDF + 4 * i + p] * yt;
  }
}

}  // namespace
}  // namespace lar::kernels::cuda::linear
