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
#include "kernels/cuda/linear/chunk_common.cuh"
#include "kernels/cuda/linear/linear_attention.hpp"

namespace lar::kernels::cuda::linear {
namespace {


struct Params {
  const bf16 *q, *k, *v, *dout;
  const float *g, *beta, *S0, *dST;
  bf16 *o, *bound, *dq, *dk, *dv;
  const bf16* bound_in;
  float *S_out, *dg, *dbeta, *dS0;
  int B, T, H, nc;
  float scale;
};

// Gates of one chunk, fetched into registers one chunk ahead (their global latency is then
// off the critical path) and published to shared memory when the chunk starts: warp 0 holds
// g of tokens 2·lane, 2·lane+1; warp 1 holds β of tokens lane, lane+32.
struct GateRegs {
  float a = 0.f, c = 0.f;
};
__device__ __forceinline__ GateRegs fetch_gates(const Params& p, int b, int h, int t0, int n) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const size_t base = (static_cast<size_t>(b) * p.T + t0) * p.H + h;
  GateRegs r;
  if (w == 0 && p.g) {
    if (2 * lane < n) r.a = p.g[base + static_cast<size_t>(2 * lane) * p.H];
    if (2 * lane + 1 < n) r.c = p.g[base + static_cast<size_t>(2 * lane + 1) * p.H];
  } else if (w == 1) {
    if (lane < n) r.a = p.beta[base + static_cast<size_t>(lane) * p.H];
    if (lane + 32 < n) r.c = p.beta[base + static_cast<size_t>(lane + 32) * p.H];
  }
  return r;
}
// sG = in-chunk inclusive cumsum of g (0 past n or without gates); sB = β (0 past n).
__device__ __forceinline__ void publish_gates(const GateRegs& r, float* sG, float* sB) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (w == 0) {
    float s = r.a + r.c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(FULL, s, o);
      if (lane >= o) s += y;
    }
    sG[2 * lane] = s - r.c;
    sG[2 * lane + 1] = s;
  } else if (w == 1) {
    sB[lane] = r.a;
    sB[lane + 32] = r.c;
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
  GateRegs gr = fetch_gates(p, b, h, 0, min(C, p.T));

  for (int ci = 0; ci < p.nc; ++ci) {
    const int t0 = ci * C, n = min(C, p.T - t0), buf = ci & 1;
    if (ci + 1 < p.nc) prefetch(ci + 1);
    cp_async_commit();
    publish_gates(gr, sG, sB);
    if (ci + 1 < p.nc) gr = fetch_gates(p, b, h, t0 + C, min(C, p.T - t0 - C));
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
      Acc a, a2;
      zero(a);
      zero(a2);
      gemm2<false, false, false, false>(a, K, K, a2, Q, K, L);  // K Kᵀ, Q Kᵀ
      store_f(sAw, a, L, [&](float x, int t, int j) { return t > j ? x * __expf(sG[t] - sG[j]) : 0.f; });
      store_bf(sP, a2, L, [&](float x, int t, int j) { return t >= j ? x * __expf(sG[t] - sG[j]) : 0.f; });
    }
    Acc o;
    {
      Acc a;
      zero(a);
      zero(o);
      gemm2<false, false, false, false>(a, K, sS, o, Q, sS, L);  // K S0ᵀ, Q S0ᵀ
      store_f(sX, a, L, [&](float x, int t, int c) { return bf(V, t, c) - __expf(sG[t]) * x; });
    }
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
// Shared memory: 2×(Q K V dO S0) (the next chunk loads while this one computes), dS P U dR
// dQK dKK Q̃ K̃ (bf16), Aw, X/dU/dR, Awᵀ (fp32), G, β, partial sums.
constexpr int kBwdTiles = 18;
constexpr size_t kBwdSmem = kBwdTiles * TILE * sizeof(bf16) + (3 * TILEF + 2 * C + 2 * C + 2 * C + 4 * C + 8) * sizeof(float);

__global__ void __launch_bounds__(NT, 1) bwd_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sIn = reinterpret_cast<bf16*>(smem);  // [2][5] tiles: Q K V dO S0 of chunks with parity 0, 1
  bf16* sdS = sIn + 10 * TILE;
  bf16* sP = sdS + TILE;
  bf16* sU = sP + TILE;
  bf16* sdR = sU + TILE;
  bf16* sdQK = sdR + TILE;
  bf16* sdKK = sdQK + TILE;
  bf16* sQt = sdKK + TILE;
  bf16* sKt = sQt + TILE;
  float* sAw = reinterpret_cast<float*>(sKt + TILE);
  float* sX = sAw + TILEF;
  float* sAwT = sX + TILEF;
  float* sG = sAwT + TILEF;
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

  auto prefetch = [&](int ci) {
    const int t0 = ci * C, n = min(C, p.T - t0);
    bf16* dst = sIn + (ci & 1) * 5 * TILE;
    load_tile(dst, p.q + row_off(p, b, t0, h), stride, n);
    load_tile(dst + TILE, p.k + row_off(p, b, t0, h), stride, n);
    load_tile(dst + 2 * TILE, p.v + row_off(p, b, t0, h), stride, n);
    load_tile(dst + 3 * TILE, p.dout + row_off(p, b, t0, h), stride, n);
    load_tile(dst + 4 * TILE, p.bound_in + (bh * p.nc + ci) * D * D, D, C);
  };
  prefetch(p.nc - 1);
  cp_async_commit();
  GateRegs gr = fetch_gates(p, b, h, (p.nc - 1) * C, p.T - (p.nc - 1) * C);

  for (int ci = p.nc - 1; ci >= 0; --ci) {
    const int t0 = ci * C, n = min(C, p.T - t0);
    if (ci > 0) prefetch(ci - 1);
    cp_async_commit();
    publish_gates(gr, sG, sB);
    if (ci > 0) gr = fetch_gates(p, b, h, t0 - C, C);
    cp_async_wait<1>();
    __syncthreads();  // P0
    const bf16* sQ = sIn + (ci & 1) * 5 * TILE;
    const bf16 *sK = sQ + TILE, *sV = sQ + 2 * TILE, *sdO = sQ + 3 * TILE, *sS0 = sQ + 4 * TILE;
    const float Gl = sG[C - 1], el = __expf(Gl);
    float rowG[2] = {0.f, 0.f}, rowB[2] = {0.f, 0.f}, colG[4][2] = {}, gl = 0.f;
    Acc pf;  // P in fp32 (for dG)
    {
      Acc a;
      zero(a);
      zero(pf);
      gemm2<false, false, false, false>(a, sK, sK, pf, sQ, sK, L);  // K Kᵀ, Q Kᵀ
      store_f(sAw, a, L, [&](float x, int t, int j) {
        const float y = t > j ? x * __expf(sG[t] - sG[j]) : 0.f;
        sAwT[j * LDF + t] = y;
        return y;
      });
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
      gemm2<false, false, true, true>(a, sK, sdS, c2, sP, sdO, L);  // K dSᵀ, Pᵀ dO
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
      subst_bwd(sAwT, sB, x);
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
      gemm2<false, false, false, false>(da, sdR, sU, dp, sdO, sU, L);  // dR Uᵀ, dO Uᵀ
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
      gemm2<false, true, false, true>(a, sdQK, sK, c2, sdO, sS0, L);  // dQK K, dO S0
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
      gemm2<true, true, false, true>(a, sdQK, sQ, c2, sU, sdS, L);   // dQKᵀ Q, U dS (dK̂)
      gemm2<false, true, false, true>(a, sdKK, sK, c3, sdR, sS0, L); // dKK K, dR S0
      gemm<true, true>(a, sdKK, sK, L);                               // dKKᵀ K
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
      gemm2<true, true, true, true>(a, sdO, sQt, c2, sdR, sKt, L);  // dOᵀ Q̃, dRᵀ K̃
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
