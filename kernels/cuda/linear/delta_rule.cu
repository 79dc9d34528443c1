// The chunkwise gated delta rule (gdn; deltanet with g = nullptr) forward, backward and decode.
// See linear_attention.hpp for the contract and kernels/cpu/linear/core.hpp for the math.
//
// Per chunk of n ≤ 64 tokens with start state S0 [dv×dk], G the in-chunk cumulative log-gate,
// M[t,j] = exp(G_t − G_j) (t ≥ j; every exponent ≤ 0), e = β k, z = β v:
//   Aw = (K Kᵀ ∘ M) strictly lower;  A = diag(β) Aw
//   X  = V − diag(e^G) K S0ᵀ;         (I + A) U = diag(β) X     (forward substitution, fp32)
//   P  = (Q Kᵀ ∘ M) lower;            O = scale (diag(e^G) Q S0ᵀ + P U)
//   S_end = e^{G_last} S0 + (diag(e^{G_last − G}) U)ᵀ K
// Padded rows of a partial last chunk load as zeros with g = β = 0, which makes every one of
// their contributions vanish (so no masks beyond the row guards on stores).
//
// Every product is a 64×64 (×64) GEMM: 8 warps, warp (wm, wn) owns rows 16·wm.., columns
// 32·wn.. of the output; operands are bf16 tiles in shared memory (row stride 72 elements,
// conflict-free ldmatrix), transposed operands through ldmatrix.trans.
#include <cuda_bf16.h>

#include <string>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/linear/linear_attention.hpp"

namespace lar::kernels::cuda::linear {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = 64, D = 64, NT = 256, LD = 72, LDF = 72;
constexpr unsigned FULL = 0xffffffffu;
constexpr int TILE = C * LD;    // bf16 elements of one tile
constexpr int TILEF = C * LDF;  // floats of one fp32 tile

struct Params {
  const bf16 *q, *k, *v, *dout;
  const float *g, *beta, *S0, *dST;
  bf16 *o, *bound, *dq, *dk, *dv;
  const bf16* bound_in;
  float *S_out, *dg, *dbeta, *dS0;
  int B, T, H, nc;
  float scale;
};

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
  __device__ int row(int e) const { return 16 * wm + g + 8 * (e >> 1); }
  __device__ int col(int nt, int e) const { return 32 * wn + 8 * nt + 2 * tig + (e & 1); }
};
using Acc = float[4][4];
__device__ __forceinline__ void zero(Acc& c) {
#pragma unroll
  for (int i = 0; i < 4; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
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

// Warp 0: sG = in-chunk inclusive cumsum of g (0 past n or without gates); warp 1: sB = β.
__device__ __forceinline__ void load_gates(const Params& p, int b, int h, int t0, int n, float* sG, float* sB) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const size_t base = (static_cast<size_t>(b) * p.T + t0) * p.H + h;
  if (w == 0) {
    float a = 0.f, c = 0.f;
    if (p.g) {
      if (2 * lane < n) a = p.g[base + static_cast<size_t>(2 * lane) * p.H];
      if (2 * lane + 1 < n) c = p.g[base + static_cast<size_t>(2 * lane + 1) * p.H];
    }
    float s = a + c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(FULL, s, o);
      if (lane >= o) s += y;
    }
    sG[2 * lane] = s - c;
    sG[2 * lane + 1] = s;
  } else if (w == 1) {
    for (int t = lane; t < C; t += 32) sB[t] = t < n ? p.beta[base + static_cast<size_t>(t) * p.H] : 0.f;
  }
}

// (I + diag(β) Aw) U = diag(β) X, Aw strictly lower [t][j]. Thread (column c = tid/4, part
// p = tid%4) owns rows 4i+p; right-looking: once u_j is final (its owner broadcasts it in the
// quad), every later row accumulates Aw[t][j]·u_j.
__device__ __forceinline__ void subst_fwd(const float* sAw, const float* sX, const float* sB, float (&x)[16]) {
  const int c = threadIdx.x >> 2, p = threadIdx.x & 3, lane = threadIdx.x & 31;
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = sX[(4 * i + p) * LDF + c], acc[i] = 0.f;
#pragma unroll
  for (int j = 0; j < C; ++j) {
    const int o = j & 3, ij = j >> 2;
    float xj = 0.f;
    if (p == o) {
      x[ij] = sB[j] * (x[ij] - acc[ij]);
      xj = x[ij];
    }
    xj = __shfl_sync(FULL, xj, (lane & ~3) | o);
#pragma unroll
    for (int i = ij; i < 16; ++i) acc[i] += sAw[(4 * i + p) * LDF + j] * xj;
  }
}
// (I + diag(β) Aw)ᵀ Y = dU, in place on x (= dU on entry, rows 4i+p of column c).
__device__ __forceinline__ void subst_bwd(const float* sAw, const float* sB, float (&x)[16]) {
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

__device__ __forceinline__ size_t row_off(const Params& p, int b, int t, int h) {
  return ((static_cast<size_t>(b) * p.T + t) * p.H + h) * D;
}

// ---------------------------------------------------------------- forward
// Shared memory: 2×(Q,K,V) + S, P, U, Û (bf16), Aw, X (fp32), G, β.
constexpr size_t kFwdSmem = (10 * TILE) * sizeof(bf16) + (2 * TILEF + 2 * C) * sizeof(float);

__global__ void __launch_bounds__(NT, 1) fwd_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // [2] each
  bf16* sK = sQ + 2 * TILE;
  bf16* sV = sK + 2 * TILE;
  bf16* sS = sV + 2 * TILE;
  bf16* sP = sS + TILE;
  bf16* sU = sP + TILE;
  bf16* sUh = sU + TILE;
  float* sAw = reinterpret_cast<float*>(sUh + TILE);
  float* sX = sAw + TILEF;
  float* sG = sX + TILEF;
  float* sB = sG + C;
  const Lane L;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;

  Acc st;  // the state, rows v, columns c (fp32)
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      st[nt][e] = p.S0 ? p.S0[bh * D * D + L.row(e) * D + L.col(nt, e)] : 0.f;
  store_bf(sS, st, L, [](float x, int, int) { return x; });

  auto prefetch = [&](int ci) {
    const int t0 = ci * C, n = min(C, p.T - t0), buf = ci & 1;
    load_tile(sQ + buf * TILE, p.q + row_off(p, b, t0, h), stride, n);
    load_tile(sK + buf * TILE, p.k + row_off(p, b, t0, h), stride, n);
    load_tile(sV + buf * TILE, p.v + row_off(p, b, t0, h), stride, n);
  };
  prefetch(0);
  cp_async_commit();

  for (int ci = 0; ci < p.nc; ++ci) {
    const int t0 = ci * C, n = min(C, p.T - t0), buf = ci & 1;
    if (ci + 1 < p.nc) prefetch(ci + 1);
    cp_async_commit();
    load_gates(p, b, h, t0, n, sG, sB);
    cp_async_wait<1>();
    __syncthreads();  // (A) tiles, gates and the bf16 state are in place
    const bf16 *Q = sQ + buf * TILE, *K = sK + buf * TILE, *V = sV + buf * TILE;
    if (p.bound) {  // the chunk's start state for the backward
      bf16* dst = p.bound + (bh * p.nc + ci) * D * D;
      for (int i = tid; i < D * 8; i += NT) {
        const int r = i >> 3, c = i & 7;
        *reinterpret_cast<uint4*>(dst + r * D + c * 8) = *reinterpret_cast<const uint4*>(sS + r * LD + c * 8);
      }
    }
    const float Gl = sG[C - 1];
    {
      Acc a;
      zero(a);
      gemm<false, false>(a, K, K, L);  // K Kᵀ
      store_f(sAw, a, L, [&](float x, int t, int j) { return t > j ? x * __expf(sG[t] - sG[j]) : 0.f; });
      zero(a);
      gemm<false, false>(a, Q, K, L);  // Q Kᵀ
      store_bf(sP, a, L, [&](float x, int t, int j) { return t >= j ? x * __expf(sG[t] - sG[j]) : 0.f; });
      zero(a);
      gemm<false, false>(a, K, sS, L);  // K S0ᵀ
      store_f(sX, a, L, [&](float x, int t, int c) { return bf(V, t, c) - __expf(sG[t]) * x; });
    }
    Acc o;
    zero(o);
    gemm<false, false>(o, Q, sS, L);  // Q S0ᵀ
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nt][e] *= __expf(sG[L.row(e)]);
    __syncthreads();  // (B)
    {
      float x[16];
      subst_fwd(sAw, sX, sB, x);
      const int c = tid >> 2, pp = tid & 3;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int t = 4 * i + pp;
        sU[t * LD + c] = __float2bfloat16(x[i]);
        sUh[t * LD + c] = __float2bfloat16(x[i] * __expf(Gl - sG[t]));
      }
    }
    __syncthreads();  // (C)
    gemm<false, true>(o, sP, sU, L);  // + P U
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = L.row(2 * hh);
        if (t < n)
          *reinterpret_cast<uint32_t*>(p.o + row_off(p, b, t0 + t, h) + L.col(nt, 0)) =
              pack(o[nt][2 * hh] * p.scale, o[nt][2 * hh + 1] * p.scale);
      }
    const float el = __expf(Gl);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] *= el;
    gemm<true, true>(st, sUh, K, L);  // + Ûᵀ K
    __syncthreads();  // (D) every read of sS and of this buffer is done
    store_bf(sS, st, L, [](float x, int, int) { return x; });
  }
  cp_async_wait<0>();
  if (p.S_out)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) p.S_out[bh * D * D + L.row(e) * D + L.col(nt, e)] = st[nt][e];
}

// ---------------------------------------------------------------- backward
// Shared memory: Q K V dO S0 dS P U dR dQK dKK Q̃ K̃ (bf16), Aw, X/dU/dR (fp32), G, β, partial sums.
constexpr int kBwdTiles = 13;
constexpr size_t kBwdSmem = kBwdTiles * TILE * sizeof(bf16) + (2 * TILEF + 2 * C + 2 * C + 2 * C + 4 * C + 8) * sizeof(float);

__global__ void __launch_bounds__(NT, 1) bwd_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + TILE;
  bf16* sV = sK + TILE;
  bf16* sdO = sV + TILE;
  bf16* sS0 = sdO + TILE;
  bf16* sdS = sS0 + TILE;
  bf16* sP = sdS + TILE;
  bf16* sU = sP + TILE;
  bf16* sdR = sU + TILE;
  bf16* sdQK = sdR + TILE;
  bf16* sdKK = sdQK + TILE;
  bf16* sQt = sdKK + TILE;
  bf16* sKt = sQt + TILE;
  float* sAw = reinterpret_cast<float*>(sKt + TILE);
  float* sX = sAw + TILEF;
  float* sG = sX + TILEF;
  float* sB = sG + C;
  float* sRowG = sB + C;     // [2][C] per wn
  float* sRowB = sRowG + 2 * C;  // [2][C]
  float* sColG = sRowB + 2 * C;  // [4][C] per wm
  float* sGl = sColG + 4 * C;    // [8] per warp
  const Lane L;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, warp = tid >> 5;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  const float scale = p.scale;

  Acc dS;  // gradient on the state at the end of the current chunk, rows v, columns c
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dS[nt][e] = p.dST ? p.dST[bh * D * D + L.row(e) * D + L.col(nt, e)] : 0.f;
  store_bf(sdS, dS, L, [](float x, int, int) { return x; });

  for (int ci = p.nc - 1; ci >= 0; --ci) {
    const int t0 = ci * C, n = min(C, p.T - t0);
    load_tile(sQ, p.q + row_off(p, b, t0, h), stride, n);
    load_tile(sK, p.k + row_off(p, b, t0, h), stride, n);
    load_tile(sV, p.v + row_off(p, b, t0, h), stride, n);
    load_tile(sdO, p.dout + row_off(p, b, t0, h), stride, n);
    load_tile(sS0, p.bound_in + (bh * p.nc + ci) * D * D, D, C);
    cp_async_commit();
    load_gates(p, b, h, t0, n, sG, sB);
    cp_async_wait<0>();
    __syncthreads();  // P0
    const float Gl = sG[C - 1], el = __expf(Gl);
    float rowG[2] = {0.f, 0.f}, rowB[2] = {0.f, 0.f}, colG[4][2] = {}, gl = 0.f;
    Acc pf;  // P in fp32 (for dG)
    {
      Acc a;
      zero(a);
      gemm<false, false>(a, sK, sK, L);
      store_f(sAw, a, L, [&](float x, int t, int j) { return t > j ? x * __expf(sG[t] - sG[j]) : 0.f; });
      zero(pf);
      gemm<false, false>(pf, sQ, sK, L);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = L.row(e), j = L.col(nt, e);
          pf[nt][e] = t >= j ? pf[nt][e] * __expf(sG[t] - sG[j]) : 0.f;
        }
      store_bf(sP, pf, L, [](float x, int, int) { return x; });
      zero(a);
      gemm<false, false>(a, sK, sS0, L);
      store_f(sX, a, L, [&](float x, int t, int c) { return bf(sV, t, c) - __expf(sG[t]) * x; });
      // Q̃ = e^G q, K̃ = β e^G k (operands of the dS update)
      for (int i = tid; i < C * D / 2; i += NT) {
        const int t = i >> 5, c = (i & 31) * 2;
        const float eg = __expf(sG[t]), ek = sB[t] * eg;
        *reinterpret_cast<uint32_t*>(sQt + t * LD + c) = pack(bf(sQ, t, c) * eg, bf(sQ, t, c + 1) * eg);
        *reinterpret_cast<uint32_t*>(sKt + t * LD + c) = pack(bf(sK, t, c) * ek, bf(sK, t, c + 1) * ek);
      }
    }
    __syncthreads();  // P1
    {
      float x[16];
      subst_fwd(sAw, sX, sB, x);
      const int c = tid >> 2, pp = tid & 3;
#pragma unroll
      for (int i = 0; i < 16; ++i) sU[(4 * i + pp) * LD + c] = __float2bfloat16(x[i]);
    }
    __syncthreads();  // P2
    {
      Acc a, c2;
      zero(a);
      zero(c2);
      gemm<false, false>(a, sK, sdS, L);   // K dSᵀ
      gemm<true, true>(c2, sP, sdO, L);    // Pᵀ dO
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[nt][e] = a[nt][e] * __expf(Gl - sG[L.row(e)]) + scale * c2[nt][e];
      store_f(sX, a, L, [](float x, int, int) { return x; });  // dU
    }
    __syncthreads();  // P3
    {
      float x[16];
      const int c = tid >> 2, pp = tid & 3;
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = sX[(4 * i + pp) * LDF + c];
      subst_bwd(sAw, sB, x);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        sX[(4 * i + pp) * LDF + c] = x[i];
        sdR[(4 * i + pp) * LD + c] = __float2bfloat16(x[i]);
      }
    }
    __syncthreads();  // P4
    {
      Acc da, dp;
      zero(da);
      zero(dp);
      gemm<false, false>(da, sdR, sU, L);  // dR Uᵀ
      gemm<false, false>(dp, sdO, sU, L);  // dO Uᵀ
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = L.row(e), j = L.col(nt, e);
          const float m = t >= j ? __expf(sG[t] - sG[j]) : 0.f, bt = sB[t];
          const float dA = t > j ? -da[nt][e] : 0.f;
          const float x = dA * sAw[t * LDF + j];
          const float dP = t >= j ? scale * dp[nt][e] : 0.f;
          const float y = bt * x + dP * pf[nt][e];
          rowB[e >> 1] += x;
          rowG[e >> 1] += y;
          colG[nt][e & 1] -= y;
          da[nt][e] = dA * bt * m;  // dKK
          dp[nt][e] = dP * m;       // dQK
        }
      store_bf(sdKK, da, L, [](float x, int, int) { return x; });
      store_bf(sdQK, dp, L, [](float x, int, int) { return x; });
    }
    __syncthreads();  // P5
    {
      Acc a, c2;  // dq
      zero(a);
      zero(c2);
      gemm<false, true>(a, sdQK, sK, L);  // dQK K
      gemm<false, true>(c2, sdO, sS0, L);  // dO S0
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = L.row(e), c = L.col(nt, e);
          const float y = scale * __expf(sG[t]) * c2[nt][e];
          rowG[e >> 1] += y * bf(sQ, t, c);
          a[nt][e] += y;
        }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = L.row(2 * hh);
          if (t < n)
            *reinterpret_cast<uint32_t*>(p.dq + row_off(p, b, t0 + t, h) + L.col(nt, 0)) =
                pack(a[nt][2 * hh], a[nt][2 * hh + 1]);
        }
    }
    {
      Acc a, c2, c3;  // dk
      zero(a);
      zero(c2);
      zero(c3);
      gemm<true, true>(a, sdQK, sQ, L);   // dQKᵀ Q
      gemm<false, true>(a, sdKK, sK, L);  // dKK K
      gemm<true, true>(a, sdKK, sK, L);   // dKKᵀ K
      gemm<false, true>(c2, sU, sdS, L);  // U dS  (dK̂)
      gemm<false, true>(c3, sdR, sS0, L); // dR S0
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = L.row(e), c = L.col(nt, e);
          const float dl = __expf(Gl - sG[t]), eg = __expf(sG[t]), kk = bf(sK, t, c), bt = sB[t];
          const float x = dl * c2[nt][e] * kk;
          const float y = -eg * c3[nt][e];
          gl += x;
          rowG[e >> 1] += bt * y * kk - x;
          rowB[e >> 1] += y * kk;
          a[nt][e] += dl * c2[nt][e] + bt * y;
        }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = L.row(2 * hh);
          if (t < n)
            *reinterpret_cast<uint32_t*>(p.dk + row_off(p, b, t0 + t, h) + L.col(nt, 0)) =
                pack(a[nt][2 * hh], a[nt][2 * hh + 1]);
        }
    }
    // dv = β dR, dβ += Σ dR·v
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = L.row(2 * hh), c = L.col(nt, 0);
        const float2 r = *reinterpret_cast<const float2*>(sX + t * LDF + c);
        rowB[hh] += r.x * bf(sV, t, c) + r.y * bf(sV, t, c + 1);
        if (t < n)
          *reinterpret_cast<uint32_t*>(p.dv + row_off(p, b, t0 + t, h) + c) = pack(sB[t] * r.x, sB[t] * r.y);
      }
    {
      Acc a, c2;  // dS at the chunk start
      zero(a);
      zero(c2);
      gemm<true, true>(a, sdO, sQt, L);  // dOᵀ Q̃
      gemm<true, true>(c2, sdR, sKt, L); // dRᵀ K̃
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int v = L.row(e), c = L.col(nt, e);
          gl += dS[nt][e] * bf(sS0, v, c) * el;
          dS[nt][e] = dS[nt][e] * el + scale * a[nt][e] - c2[nt][e];
        }
    }
    // partial sums → shared
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float rg = rowG[hh], rb = rowB[hh];
      rg += __shfl_xor_sync(FULL, rg, 1);
      rg += __shfl_xor_sync(FULL, rg, 2);
      rb += __shfl_xor_sync(FULL, rb, 1);
      rb += __shfl_xor_sync(FULL, rb, 2);
      if (L.tig == 0) {
        sRowG[L.wn * C + L.row(2 * hh)] = rg;
        sRowB[L.wn * C + L.row(2 * hh)] = rb;
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float cg = colG[nt][e];
        cg += __shfl_xor_sync(FULL, cg, 4);
        cg += __shfl_xor_sync(FULL, cg, 8);
        cg += __shfl_xor_sync(FULL, cg, 16);
        if (L.g == 0) sColG[L.wm * C + L.col(nt, e)] = cg;
      }
#pragma unroll
    for (int o = 16; o; o >>= 1) gl += __shfl_xor_sync(FULL, gl, o);
    if (L.lane == 0) sGl[warp] = gl;
    __syncthreads();  // P6: every read of sdS, sS0 and the tiles is done
    store_bf(sdS, dS, L, [](float x, int, int) { return x; });
    if (warp == 0) {
      // dG_t, then dg = reverse cumsum within the chunk (g_t enters every G_s, s ≥ t)
      float d[2], bsum[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int t = 2 * L.lane + q;
        d[q] = sRowG[t] + sRowG[C + t] + sColG[t] + sColG[C + t] + sColG[2 * C + t] + sColG[3 * C + t];
        bsum[q] = sRowB[t] + sRowB[C + t];
      }
      if (L.lane == 31) {
        float s = 0.f;
        for (int w = 0; w < 8; ++w) s += sGl[w];
        d[1] += s;  // G_last: row 63 (rows ≥ n carry g = 0, so the reverse cumsum is the same)
      }
      float s = d[0] + d[1];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_down_sync(FULL, s, o);
        if (L.lane + o < 32) s += y;
      }
      // s = Σ_{lanes ≥ lane} (d0 + d1): dg[2l] = s, dg[2l+1] = s − d0
      const size_t base = (static_cast<size_t>(b) * p.T + t0) * p.H + h;
      const float dg2[2] = {s, s - d[0]};
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int t = 2 * L.lane + q;
        if (t < n) {
          if (p.dg && p.g) p.dg[base + static_cast<size_t>(t) * p.H] = dg2[q];
          p.dbeta[base + static_cast<size_t>(t) * p.H] = bsum[q];
        }
      }
    }
    __syncthreads();  // the next chunk overwrites the tiles, G and β
  }
  if (p.dS0)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) p.dS0[bh * D * D + L.row(e) * D + L.col(nt, e)] = dS[nt][e];
}

// ---------------------------------------------------------------- decode
// One CTA per (b, h); thread (v = tid/4, part) holds S[v, 16·part .. 16·part+15].
__global__ void __launch_bounds__(NT) decode_kernel(const Params p) {
  __shared__ float sq[D], sk[D];
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, v = tid >> 2, part = tid & 3;
  const size_t bh = static_cast<size_t>(b) * p.H + h;
  if (tid < D) {
    sq[tid] = __bfloat162float(p.q[bh * D + tid]);
    sk[tid] = __bfloat162float(p.k[bh * D + tid]);
  }
  __syncthreads();
  const float a = p.g ? __expf(p.g[bh]) : 1.f, beta = p.beta[bh];
  float* S = p.S_out + bh * D * D + v * D + part * 16;
  float s[16];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 x = reinterpret_cast<const float4*>(S)[i];
    s[4 * i] = x.x * a, s[4 * i + 1] = x.y * a, s[4 * i + 2] = x.z * a, s[4 * i + 3] = x.w * a;
  }
  float sk_dot = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) sk_dot += s[i] * sk[part * 16 + i];
  sk_dot += __shfl_xor_sync(FULL, sk_dot, 1);
  sk_dot += __shfl_xor_sync(FULL, sk_dot, 2);
  const float u = beta * (__bfloat162float(p.v[bh * D + v]) - sk_dot);
  float od = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    s[i] += u * sk[part * 16 + i];
    od += s[i] * sq[part * 16 + i];
  }
  od += __shfl_xor_sync(FULL, od, 1);
  od += __shfl_xor_sync(FULL, od, 2);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    reinterpret_cast<float4*>(S)[i] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
  if (part == 0) p.o[bh * D + v] = __float2bfloat16(od * p.scale);
}

Params make_params(const DeltaShape& s, const char* what) {
  if (s.dk != 64 || s.dv != 64)
    throw RuntimeError(std::string(what) + ": head dims dk=" + std::to_string(s.dk) + " dv=" + std::to_string(s.dv) +
                       " (supported: dk = dv = 64)");
  if (s.B < 1 || s.T < 1 || s.H < 1 || s.B > 65535 || s.H > 65535 || s.T > (int64_t{1} << 30))
    throw RuntimeError(std::string(what) + ": bad shape B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                       " H=" + std::to_string(s.H));
  Params p{};
  p.B = static_cast<int>(s.B), p.T = static_cast<int>(s.T), p.H = static_cast<int>(s.H);
  p.nc = static_cast<int>(delta_num_chunks(s));
  p.scale = static_cast<float>(s.scale);
  return p;
}

}  // namespace

std::size_t delta_boundary_bytes(const DeltaShape& s) {
  return static_cast<std::size_t>(s.B * s.H * delta_num_chunks(s)) * D * D * sizeof(bf16);
}

void delta_fwd(const DeltaShape& s, const bf16* q, const bf16* k, const bf16* v, const float* g, const float* beta,
               const float* S0, bf16* o, float* S_out, bf16* boundary, cudaStream_t stream) {
  Params p = make_params(s, "delta_fwd");
  if (!q || !k || !v || !beta || !o) throw RuntimeError("delta_fwd: q, k, v, beta and o are required");
  p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta, p.S0 = S0, p.o = o, p.S_out = S_out, p.bound = boundary;
  LAR_CUDA_CHECK(cudaFuncSetAttribute(fwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kFwdSmem)));
  fwd_kernel<<<dim3(p.H, p.B), NT, kFwdSmem, stream>>>(p);
  LAR_CUDA_LAUNCHED();
}

void delta_bwd(const DeltaShape& s, const bf16* q, const bf16* k, const bf16* v, const float* g, const float* beta,
               const bf16* boundary, const bf16* dout, const float* dST, bf16* dq, bf16* dk, bf16* dv, float* dg,
               float* dbeta, float* dS0, cudaStream_t stream) {
  Params p = make_params(s, "delta_bwd");
  if (!q || !k || !v || !beta || !boundary || !dout || !dq || !dk || !dv || !dbeta)
    throw RuntimeError("delta_bwd: q, k, v, beta, boundary, dout, dq, dk, dv and dbeta are required");
  p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta, p.bound_in = boundary, p.dout = dout, p.dST = dST;
  p.dq = dq, p.dk = dk, p.dv = dv, p.dg = dg, p.dbeta = dbeta, p.dS0 = dS0;
  LAR_CUDA_CHECK(cudaFuncSetAttribute(bwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kBwdSmem)));
  bwd_kernel<<<dim3(p.H, p.B), NT, kBwdSmem, stream>>>(p);
  LAR_CUDA_LAUNCHED();
}

void delta_decode(const DeltaShape& s0, const bf16* q, const bf16* k, const bf16* v, const float* g, const float* beta,
                  float* S, bf16* o, cudaStream_t stream) {
  DeltaShape s = s0;
  s.T = 1;
  Params p = make_params(s, "delta_decode");
  if (!q || !k || !v || !beta || !S || !o) throw RuntimeError("delta_decode: q, k, v, beta, S and o are required");
  p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta, p.S_out = S, p.o = o;
  decode_kernel<<<dim3(p.H, p.B), NT, 0, stream>>>(p);
  LAR_CUDA_LAUNCHED();
}

}  // namespace lar::kernels::cuda::linear
