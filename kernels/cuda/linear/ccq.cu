// CCQ read correction (SPEC §4, kernels/cpu/linear/ccq.hpp) forward and backward:
//   q_c = q − λ_t r_t,  r_t = (K_t q)/t − m_t (m_tᵀ q)/t²  (centered; uncentered: no m term)
// with the running key statistics K_t = Σ_{j≤t} k_j k_jᵀ, m_t = Σ_{j≤t} k_j (no forgetting).
// The backbone then runs on q_c; its gradient on q_c comes back here as dqc. See
// linear_methods.hpp for the contract.
//
// Chunk-parallel (docs/perf.md, "CCQ chunk-parallel"). The statistics have no decay, so the
// state before a chunk is a prefix sum of per-chunk terms, and the gradients on it (GK on
// K_prev, Gm on m_prev) are suffix sums. Chunks (64 tokens) are taken in groups of kGroup;
// every pass is three launches:
//   stats   one CTA per (group, h, b): the group's own sums (fwd: Σ KᵀK, Σ k; bwd also
//           GK = Σ dAᵀQ, W = Σ (λ/t²)(g qᵀ + q gᵀ) and Gm with m = 0 at the group start)
//   scan    per (b, h), 16 CTAs of 4 rows each: inclusive prefix of K, m over the groups (+
//           K0, m0; the last one is the final statistics), Gm += W m_start, then the
//           exclusive suffix sums of GK and Gm (all in fp32, fixed order: deterministic)
//   main    one CTA per (group, h, b) walks its kGroup chunks from its start state (forward:
//           K_prev, m_prev; backward in reverse: K, m after the group, GK, Gm after it), next
//           chunk's tiles prefetched with cp.async, two CTAs per SM.
// Per chunk (rows i, t_i = t_prev + i + 1), as mma.sync 64×64×64 GEMMs on bf16 shared tiles:
//   forward  R = Q K_prev + (Q Kᵀ ⊙ L) K,  M_i = m_prev + Σ_{j≤i} k_j,
//            r_i = R_i/t_i − M_i (M_iᵀ q_i)/t_i²,  K += KᵀK
//   backward (g = dqc, dA = −λ g/t, mq = Mᵀq, mg = Mᵀg, a = λ mq/t², b = λ mg/t²)
//            S1' = (QKᵀ − mq/t) ⊙ L,  S2' = (dA Kᵀ + b) ⊙ L   (the mean term folded in)
//            dq = g − (λ/t) G K_prev + S2' K + b m_prev,  dλ = −(qᵀK_prev g + Σ_j S1·GKᵀ)/t + mg mq/t²
//            dk += S2'ᵀ Q + S1'ᵀ dA + K (GK + GKᵀ) + Gm,  GK += dAᵀ Q,  Gm += Σ_i (a g + b q)
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/linear/chunk_common.cuh"
#include "kernels/cuda/linear/linear_methods.hpp"

namespace lar::kernels::cuda::linear {
namespace {

constexpr int kGroup = 8;  // chunks per group: workspace [B,H,nc/8] records, 8 CTAs per head at T=4096
// Workspace records per (b, h, group), fp32: forward {K, m}; backward {K, m, GK, W, Gm}.
constexpr int kOffK = 0, kOffM = D * D, kOffGK = D * D + D, kOffW = 2 * D * D + D, kOffGm = 3 * D * D + D;
constexpr int kRecF = D * D + D, kRecB = 3 * D * D + 2 * D;

struct QParams {
  const bf16 *q, *k, *dqc;
  const float *lam, *K0, *m0;
  bf16 *qc, *dq, *dk;
  float *Kout, *mout, *dlam;
  float* ws;  // workspace records [B, H, ng, rec]
  int B, T, H, nc, G, ng, rec, centered;  // G chunks per group, ng groups
  double t0;  // tokens seen before this call
};

__device__ __forceinline__ size_t qrow(const QParams& p, int b, int t, int h) {
  return ((static_cast<size_t>(b) * p.T + t) * p.H + h) * D;
}
__device__ __forceinline__ float* rec(const QParams& p, int b, int h, int g) {
  return p.ws + ((static_cast<size_t>(b) * p.H + h) * p.ng + g) * p.rec;
}
__device__ __forceinline__ void load_frag(Acc& a, const float* src, const Lane& L) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float2 v = *reinterpret_cast<const float2*>(src + L.row(2 * hh) * D + L.col(nt, 0));
      a[nt][2 * hh] = v.x, a[nt][2 * hh + 1] = v.y;
    }
}
__device__ __forceinline__ void store_frag(float* dst, const Acc& a, const Lane& L) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      *reinterpret_cast<float2*>(dst + L.row(2 * hh) * D + L.col(nt, 0)) = make_float2(a[nt][2 * hh], a[nt][2 * hh + 1]);
}
// λ_i and 1/t_i of the rows of the chunk starting at token t0 (rows ≥ n: λ = 0).
__device__ __forceinline__ void load_rows(const QParams& p, int b, int h, int t0, int n, float* sLam, float* sInv) {
  const int i = threadIdx.x;
  if (i < C) {
    sLam[i] = i < n ? p.lam[(static_cast<size_t>(b) * p.T + t0 + i) * p.H + h] : 0.f;
    sInv[i] = 1.f / static_cast<float>(p.t0 + t0 + i + 1);
  }
}
// Quad (4 lanes) sum.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(FULL, x, 1);
  return x + __shfl_xor_sync(FULL, x, 2);
}
// Column sum of a bf16 tile by thread (column tid/4, rows 16·(tid%4)..), returned to the quad.
__device__ __forceinline__ float col_sum(const bf16* s) {
  const int c = threadIdx.x >> 2, part = threadIdx.x & 3;
  float x = 0.f;
#pragma unroll
  for (int r = 0; r < 16; ++r) x += bf(s, 16 * part + r, c);
  return quad_sum(x);
}

// sM[i][c] = base_c + Σ_{j≤i} K[j][c] (bf16 tile K, fp32 out); returns the column total
// Σ_j K[j][c] to every thread of the quad of column c. Thread (column tid/4, part tid%4)
// scans rows 16·part...
__device__ __forceinline__ float cumsum_k(const bf16* sK, const float* base, float* sM) {
  const int c = threadIdx.x >> 2, p = threadIdx.x & 3;
  float v[16];
#pragma unroll
  for (int r = 0; r < 16; ++r) v[r] = __bfloat162float(sK[(16 * p + r) * LD + c]) + (r ? v[r - 1] : 0.f);
  float inc = v[15];
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    const float y = __shfl_up_sync(FULL, inc, o);
    if (p >= o) inc += y;
  }
  const float total = __shfl_sync(FULL, inc, (threadIdx.x & 31) | 3);
  const float ex = inc - v[15] + base[c];
#pragma unroll
  for (int r = 0; r < 16; ++r) sM[(16 * p + r) * LDF + c] = v[r] + ex;
  return total;
}

// ---------------------------------------------------------------- stats (forward)
// The group's Σ KᵀK (fp32 MMA accumulation, chunk after chunk) and Σ k.
constexpr size_t kStatsFwdSmem = 2 * TILE * sizeof(bf16) + 4 * C * sizeof(float);

__global__ void __launch_bounds__(NT, 2) ccq_stats_fwd_kernel(const QParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sKb = reinterpret_cast<bf16*>(smem);  // two buffers of TILE
  float* sCol = reinterpret_cast<float*>(sKb + 2 * TILE);  // [4][C]
  const Lane L;
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const size_t stride = static_cast<size_t>(p.H) * D;
  const int c0 = g * p.G, c1 = min(p.nc, c0 + p.G);
  Acc Ks;
  zero(Ks);
  float col = 0.f;  // column tid%64, rows 16·(tid/64)..
  load_tile(sKb, p.k + qrow(p, b, c0 * C, h), stride, min(C, p.T - c0 * C));
  cp_async_commit();
  for (int ci = c0; ci < c1; ++ci) {
    const bf16* sK = sKb + ((ci - c0) & 1) * TILE;
    if (ci + 1 < c1) load_tile(sKb + ((ci - c0 + 1) & 1) * TILE, p.k + qrow(p, b, (ci + 1) * C, h), stride, min(C, p.T - (ci + 1) * C));
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    gemm<true, true>(Ks, sK, sK, L);
#pragma unroll
    for (int r = 0; r < 16; ++r) col += bf(sK, 16 * (tid >> 6) + r, tid & 63);
    __syncthreads();  // before the next prefetch overwrites this buffer
  }
  float* R = rec(p, b, h, g);
  store_frag(R + kOffK, Ks, L);
  sCol[tid] = col;
  __syncthreads();
  if (tid < C) R[kOffM + tid] = (sCol[tid] + sCol[C + tid]) + (sCol[2 * C + tid] + sCol[3 * C + tid]);
}

// ---------------------------------------------------------------- stats (backward)
// Besides the group's Σ KᵀK and Σ k: GK = Σ dAᵀQ (dA = −λ g/t), W = Y + Yᵀ with
// Y = Σ (λ g/t²)ᵀ Q, and Gm0 = Σ_i (a_i g_i + b_i q_i) with M counted from the group start
// (the scan adds W m_start: the m gradient is linear in the m before the group).
// Q K G ×2 (prefetch), dA, E (bf16; reused as the fp32 Y tile at the end), λ, 1/t, local m
// ping-pong, row sums of the masked QKᵀ and GKᵀ per warp half, m·q, m·g.
constexpr size_t kStatsBwdSmem = 8 * TILE * sizeof(bf16) + (2 * C + 2 * C + 4 * C + 2 * C) * sizeof(float);

__global__ void __launch_bounds__(NT, 2) ccq_stats_bwd_kernel(const QParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* base = reinterpret_cast<bf16*>(smem);
  bf16* sQb = base;  // two buffers each (prefetch)
  bf16* sKb = base + 2 * TILE;
  bf16* sGb = base + 4 * TILE;
  bf16* sdA = base + 6 * TILE;
  bf16* sE = base + 7 * TILE;
  float* sY = reinterpret_cast<float*>(sdA);  // [64][LDF] fp32 over dA and E at the end
  float* sLam = reinterpret_cast<float*>(base + 8 * TILE);
  float* sInv = sLam + C;
  float* sMl = sInv + C;  // [2][C] ping-pong
  float* sRs1 = sInv + 3 * C;  // [2][C]
  float* sRse = sRs1 + 2 * C;  // [2][C]
  float* sMq0 = sRse + 2 * C;
  float* sMg0 = sMq0 + C;
  const Lane L;
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const size_t stride = static_cast<size_t>(p.H) * D;
  const int c0 = g * p.G, c1 = min(p.nc, c0 + p.G);
  const bool cen = p.centered;
  Acc Ks, GK, Y;
  zero(Ks), zero(GK), zero(Y);
  float gmp = 0.f;  // Gm0 partial of column tid/4 over rows 16·(tid%4)..
  if (tid < C) sMl[tid] = 0.f;
  auto prefetch = [&](int ci, int buf) {
    const int t0 = ci * C, n = min(C, p.T - t0);
    load_tile(sQb + buf * TILE, p.q + qrow(p, b, t0, h), stride, n);
    load_tile(sKb + buf * TILE, p.k + qrow(p, b, t0, h), stride, n);
    load_tile(sGb + buf * TILE, p.dqc + qrow(p, b, t0, h), stride, n);
  };
  prefetch(c0, 0);
  cp_async_commit();
  for (int ci = c0; ci < c1; ++ci) {
    const int it = ci - c0, buf = it & 1, t0 = ci * C, n = min(C, p.T - t0);
    const bf16 *sQ = sQb + buf * TILE, *sK = sKb + buf * TILE, *sG = sGb + buf * TILE;
    const float* mcur = sMl + (it & 1) * C;
    float* mnext = sMl + ((it + 1) & 1) * C;
    if (ci + 1 < c1) prefetch(ci + 1, buf ^ 1);
    cp_async_commit();
    load_rows(p, b, h, t0, n, sLam, sInv);
    cp_async_wait<1>();
    __syncthreads();
    // phase 1: dA, E tiles; K stats; masked row sums of QKᵀ, GKᵀ; m·q, m·g; local m
    for (int i = tid; i < C * 32; i += NT) {
      const int t = i >> 5, c = 2 * (i & 31);
      const float inv = sInv[t], fa = -sLam[t] * inv, fe = sLam[t] * inv * inv;
      const float g0 = bf(sG, t, c), g1 = bf(sG, t, c + 1);
      *reinterpret_cast<uint32_t*>(sdA + t * LD + c) = pack(fa * g0, fa * g1);
      *reinterpret_cast<uint32_t*>(sE + t * LD + c) = pack(fe * g0, fe * g1);
    }
    gemm<true, true>(Ks, sK, sK, L);
    {
      const float tot = col_sum(sK);
      if ((tid & 3) == 0) mnext[tid >> 2] = mcur[tid >> 2] + tot;
    }
    if (cen) {
      Acc s1, se;
      zero(s1), zero(se);
      gemm2<false, false, false, false>(s1, sQ, sK, se, sG, sK, L);
      float r1[2] = {0.f, 0.f}, re[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (L.col(nt, e) <= L.row(e)) r1[e >> 1] += s1[nt][e], re[e >> 1] += se[nt][e];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float x = quad_sum(r1[hh]), y = quad_sum(re[hh]);
        if (L.tig == 0) sRs1[L.wn * C + L.row(2 * hh)] = x, sRse[L.wn * C + L.row(2 * hh)] = y;
      }
      const int r = tid >> 2, part = tid & 3;
      float x = 0.f, y = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float mm = mcur[16 * part + j];
        x += mm * bf(sQ, r, 16 * part + j);
        y += mm * bf(sG, r, 16 * part + j);
      }
      x = quad_sum(x), y = quad_sum(y);
      if (part == 0) sMq0[r] = x, sMg0[r] = y;
    }
    __syncthreads();
    // phase 2: GK += dAᵀQ, Y += EᵀQ; Gm0 column partials
    if (cen) {
      gemm2<true, true, true, true>(GK, sdA, sQ, Y, sE, sQ, L);
      const int c = tid >> 2, part = tid & 3;
#pragma unroll
      for (int rr = 0; rr < 16; ++rr) {
        const int i = 16 * part + rr;
        const float mq = sMq0[i] + sRs1[i] + sRs1[C + i], mg = sMg0[i] + sRse[i] + sRse[C + i];
        const float f = sLam[i] * sInv[i] * sInv[i];
        gmp += f * (mq * bf(sG, i, c) + mg * bf(sQ, i, c));
      }
    } else {
      gemm<true, true>(GK, sdA, sQ, L);
    }
    __syncthreads();
  }
  float* R = rec(p, b, h, g);
  store_frag(R + kOffK, Ks, L);
  store_frag(R + kOffGK, GK, L);
  if (tid < C) R[kOffM + tid] = sMl[((c1 - c0) & 1) * C + tid];
  gmp = quad_sum(gmp);
  if ((tid & 3) == 0) R[kOffGm + (tid >> 2)] = cen ? gmp : 0.f;
  store_f(sY, Y, L, [](float x, int, int) { return x; });
  __syncthreads();
  for (int i = tid; i < D * D; i += NT) {
    const int a = i >> 6, c = i & 63;
    R[kOffW + i] = cen ? sY[a * LDF + c] + sY[c * LDF + a] : 0.f;
  }
}

// ---------------------------------------------------------------- scan over the groups
// Block (slice, h, b): rows 4·slice .. +3 of the 64×64 matrices, thread (row tid/64, column
// tid%64); m (and m_start for the W m term) in shared memory in every slice, written by
// slice 0. Groups are read 8 at a time so that their loads are in flight together.
constexpr int kScanBatch = 8;

template <bool kBwd>
__global__ void __launch_bounds__(NT) ccq_scan_kernel(const QParams p) {
  __shared__ float sm[C], spart[NT / 32];
  const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, warp = tid >> 5;
  const int a = 4 * s + (tid >> 6), c = tid & 63, e = a * D + c;
  const size_t bh = static_cast<size_t>(b) * p.H + h;
  const bool gm_thread = kBwd && c == 0;  // owns Gm[a]
  const bool cen = p.centered;
  float Kacc = p.K0 ? p.K0[bh * D * D + e] : 0.f;
  if (tid < C) sm[tid] = p.m0 ? p.m0[bh * D + tid] : 0.f;
  __syncthreads();
  for (int g0 = 0; g0 < p.ng; g0 += kScanBatch) {
    const int cnt = min(kScanBatch, p.ng - g0);
    float kl[kScanBatch], ml[kScanBatch], wl[kScanBatch], gl[kScanBatch];
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) {
      kl[u] = ml[u] = wl[u] = gl[u] = 0.f;
      if (u < cnt) {
        const float* R = rec(p, b, h, g0 + u);
        kl[u] = R[kOffK + e];
        if (tid < C) ml[u] = R[kOffM + tid];
        if (kBwd && cen) wl[u] = R[kOffW + e];
        if (gm_thread) gl[u] = R[kOffGm + a];
      }
    }
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) {
      if (u >= cnt) break;
      float* R = rec(p, b, h, g0 + u);
      Kacc += kl[u];
      R[kOffK + e] = Kacc;
      if (kBwd) {  // (W m_start)[a]: the row's 64 products over its two warps
        float x = wl[u] * sm[c];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
        if ((tid & 31) == 0) spart[warp] = x;
      }
      __syncthreads();
      if (gm_thread) R[kOffGm + a] = cen ? gl[u] + (spart[warp] + spart[warp + 1]) : 0.f;
      if (tid < C) {
        sm[tid] += ml[u];
        if (s == 0) R[kOffM + tid] = sm[tid];
      }
      __syncthreads();
    }
  }
  if (p.Kout) p.Kout[bh * D * D + e] = Kacc;
  if (p.mout && s == 0 && tid < C) p.mout[bh * D + tid] = sm[tid];
  if (!kBwd) return;
  // exclusive suffix sums of GK and Gm (each thread reads back only what it wrote or owns)
  float GKacc = 0.f, gmacc = 0.f;
  for (int g0 = p.ng - 1; g0 >= 0; g0 -= kScanBatch) {
    const int cnt = min(kScanBatch, g0 + 1);
    float kl[kScanBatch], gl[kScanBatch];
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) {
      kl[u] = gl[u] = 0.f;
      if (u < cnt) {
        const float* R = rec(p, b, h, g0 - u);
        kl[u] = R[kOffGK + e];
        if (gm_thread) gl[u] = R[kOffGm + a];
      }
    }
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) {
      if (u >= cnt) break;
      float* R = rec(p, b, h, g0 - u);
      R[kOffGK + e] = GKacc;
      GKacc += kl[u];
      if (gm_thread) {
        R[kOffGm + a] = gmacc;
        gmacc += gl[u];
      }
    }
  }
}

// ---------------------------------------------------------------- forward (main)
// Q K ×2 (prefetch), Ks P (bf16), M (fp32), m ping-pong, row sums of (QKᵀ⊙L) [2][C], mprev·q, λ.
constexpr size_t kQFwdSmem = 6 * TILE * sizeof(bf16) + (TILEF + 2 * C + 2 * C + C + C) * sizeof(float);

__global__ void __launch_bounds__(NT, 2) ccq_fwd_kernel(const QParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* base = reinterpret_cast<bf16*>(smem);
  bf16* sQb = base;  // two buffers each (prefetch)
  bf16* sKb = base + 2 * TILE;
  bf16* sKs = base + 4 * TILE;
  bf16* sP = base + 5 * TILE;
  float* sM = reinterpret_cast<float*>(base + 6 * TILE);
  float* sMv = sM + TILEF;  // [2][C] ping-pong
  float* sRow = sM + TILEF + 2 * C;  // [2][C]
  float* sMq = sRow + 2 * C;
  float* sLam = sMq + C;
  const Lane L;
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  const int c0 = g * p.G, c1 = min(p.nc, c0 + p.G);

  // statistics before the group: K0, m0 for the first, else the scan's prefix after g − 1
  const float* Kst = g ? rec(p, b, h, g - 1) + kOffK : p.K0 ? p.K0 + bh * D * D : nullptr;
  const float* mst = g ? rec(p, b, h, g - 1) + kOffM : p.m0 ? p.m0 + bh * D : nullptr;
  Acc Ks;
  if (Kst)
    load_frag(Ks, Kst, L);
  else
    zero(Ks);
  if (tid < C) sMv[tid] = mst ? mst[tid] : 0.f;
  auto prefetch = [&](int ci, int buf) {
    const int t0 = ci * C, n = min(C, p.T - t0);
    load_tile(sQb + buf * TILE, p.q + qrow(p, b, t0, h), stride, n);
    load_tile(sKb + buf * TILE, p.k + qrow(p, b, t0, h), stride, n);
  };
  prefetch(c0, 0);
  cp_async_commit();

  for (int ci = c0; ci < c1; ++ci) {
    const int it = ci - c0, buf = it & 1, t0 = ci * C, n = min(C, p.T - t0);
    const bf16 *sQ = sQb + buf * TILE, *sK = sKb + buf * TILE;
    float* mcur = sMv + (it & 1) * C;
    float* mnext = sMv + ((it + 1) & 1) * C;
    if (ci + 1 < c1) prefetch(ci + 1, buf ^ 1);
    cp_async_commit();
    if (tid < C) sLam[tid] = tid < n ? p.lam[(static_cast<size_t>(b) * p.T + t0 + tid) * p.H + h] : 0.f;
    store_bf(sKs, Ks, L, [](float x, int, int) { return x; });
    cp_async_wait<1>();
    __syncthreads();
    // phase 1: P = (Q Kᵀ) ⊙ L (+ its row sums: Σ_{j≤i} k_jᵀ q_i), R = Q K_prev, M, m_prevᵀ q
    Acc R, P;
    zero(R);
    zero(P);
    gemm2<false, false, false, false>(P, sQ, sK, R, sQ, sKs, L);
    {
      float rs[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (L.row(e) < L.col(nt, e)) P[nt][e] = 0.f;
          rs[e >> 1] += P[nt][e];
        }
      store_bf(sP, P, L, [](float x, int, int) { return x; });
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float x = quad_sum(rs[hh]);
        if (L.tig == 0) sRow[L.wn * C + L.row(2 * hh)] = x;
      }
    }
    {
      const float tot = cumsum_k(sK, mcur, sM);
      if ((tid & 3) == 0) mnext[tid >> 2] = mcur[tid >> 2] + tot;
      const int r = tid >> 2, part = tid & 3;  // m_prevᵀ q_r
      float x = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) x += mcur[16 * part + j] * bf(sQ, r, 16 * part + j);
      x = quad_sum(x);
      if (part == 0) sMq[r] = x;
    }
    __syncthreads();
    // phase 2: R += P K; q_c = q − λ r; K += Kᵀ K
    gemm<false, true>(R, sP, sK, L);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = L.row(2 * hh), a = L.col(nt, 0);
        if (i >= n) continue;
        const float ti = static_cast<float>(p.t0 + t0 + i + 1), inv = 1.f / ti;
        const float mq = sMq[i] + sRow[i] + sRow[C + i];
        float r0 = R[nt][2 * hh] * inv, r1 = R[nt][2 * hh + 1] * inv;
        if (p.centered) {
          r0 -= sM[i * LDF + a] * mq * inv * inv;
          r1 -= sM[i * LDF + a + 1] * mq * inv * inv;
        }
        const float lam = sLam[i];
        *reinterpret_cast<uint32_t*>(p.qc + qrow(p, b, t0 + i, h) + a) =
            pack(bf(sQ, i, a) - lam * r0, bf(sQ, i, a + 1) - lam * r1);
      }
    if (ci + 1 < c1) gemm<true, true>(Ks, sK, sK, L);
    __syncthreads();
  }
}

// ---------------------------------------------------------------- backward (main)
// Q K G ×2 (prefetch), Ks (K_prev), S1', S2', dA, GK (sym) bf16 tiles; m and Gm ping-pong;
// per-row: λ, 1/t, m·q, m·g, mq, mg, row partials [2][C] of Σ_{j>i} s1, Σ_{j>i} p, Σ s1·p, q·X.
constexpr size_t kQBwdSmem = 11 * TILE * sizeof(bf16) + (2 * C + 2 * C + 6 * C + 4 * 2 * C) * sizeof(float);

__global__ void __launch_bounds__(NT, 2) ccq_bwd_kernel(const QParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* base = reinterpret_cast<bf16*>(smem);
  bf16* sQb = base;  // two buffers each (prefetch)
  bf16* sKb = base + 2 * TILE;
  bf16* sGb = base + 4 * TILE;
  bf16* sKs = base + 6 * TILE;
  bf16* sS1 = base + 7 * TILE;
  bf16* sS2 = base + 8 * TILE;
  bf16* sdA = base + 9 * TILE;
  bf16* sGK = base + 10 * TILE;
  float* fb = reinterpret_cast<float*>(base + 11 * TILE);
  float* sMv = fb;  // [2][C] ping-pong, m
  float* sGm = fb + 2 * C;  // [2][C] ping-pong, Gm
  float* sLam = fb + 4 * C;
  float* sInv = fb + 5 * C;
  float* sMcq = fb + 6 * C;
  float* sMcg = fb + 7 * C;
  float* sMq = fb + 8 * C;
  float* sMg = fb + 9 * C;
  float* sSu1 = fb + 10 * C;  // [2][C] each from here
  float* sSu2 = fb + 12 * C;
  float* sRsp = fb + 14 * C;
  float* sXq = fb + 16 * C;
  const Lane L;
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const size_t stride = static_cast<size_t>(p.H) * D;
  const int c0 = g * p.G, c1 = min(p.nc, c0 + p.G);
  const bool cen = p.centered;

  // K, m after the group (the scan's inclusive prefix); GK, Gm of everything after it
  const float* R0 = rec(p, b, h, g);
  Acc Kc, GK;
  load_frag(Kc, R0 + kOffK, L);
  load_frag(GK, R0 + kOffGK, L);
  if (tid < C) sMv[tid] = R0[kOffM + tid], sGm[tid] = R0[kOffGm + tid];
  auto prefetch = [&](int ci, int buf) {
    const int t0 = ci * C, n = min(C, p.T - t0);
    load_tile(sQb + buf * TILE, p.q + qrow(p, b, t0, h), stride, n);
    load_tile(sKb + buf * TILE, p.k + qrow(p, b, t0, h), stride, n);
    load_tile(sGb + buf * TILE, p.dqc + qrow(p, b, t0, h), stride, n);
  };
  prefetch(c1 - 1, 0);
  cp_async_commit();

  for (int ci = c1 - 1; ci >= c0; --ci) {
    const int it = c1 - 1 - ci, buf = it & 1, t0 = ci * C, n = min(C, p.T - t0);
    const bf16 *sQ = sQb + buf * TILE, *sK = sKb + buf * TILE, *sG = sGb + buf * TILE;
    const float* mcur = sMv + (it & 1) * C;
    float* mprev = sMv + ((it + 1) & 1) * C;
    const float* gmcur = sGm + (it & 1) * C;
    float* gmnext = sGm + ((it + 1) & 1) * C;
    if (ci > c0) prefetch(ci - 1, buf ^ 1);
    cp_async_commit();
    load_rows(p, b, h, t0, n, sLam, sInv);
    store_bf(sGK, GK, L, [](float x, int, int) { return x; });
    cp_async_wait<1>();
    __syncthreads();
    // phase A: GK + GKᵀ in place; K_prev = K − KᵀK; s1 = QKᵀ, pk = GKᵀ (kept in registers) and
    // their row partials; m·q, m·g with the m after the chunk; m_prev; dA = −λ g/t
    for (int i = tid; i < D * D; i += NT) {
      const int r = i >> 6, c = i & 63;
      if (r < c) {
        const bf16 v = __float2bfloat16(bf(sGK, r, c) + bf(sGK, c, r));
        sGK[r * LD + c] = v, sGK[c * LD + r] = v;
      } else if (r == c) {
        sGK[r * LD + r] = __float2bfloat16(2.f * bf(sGK, r, r));
      }
    }
    {
      Acc a;
      zero(a);
      gemm<true, true>(a, sK, sK, L);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) Kc[nt][e] -= a[nt][e];
      store_bf(sKs, Kc, L, [](float x, int, int) { return x; });
    }
    Acc s1, pk;
    zero(s1), zero(pk);
    gemm2<false, false, false, false>(s1, sQ, sK, pk, sG, sK, L);
    {
      float u1[2] = {0.f, 0.f}, u2[2] = {0.f, 0.f}, sp[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (L.col(nt, e) > L.row(e)) {
            u1[e >> 1] += s1[nt][e], u2[e >> 1] += pk[nt][e];
          } else {
            sp[e >> 1] += s1[nt][e] * pk[nt][e];
          }
        }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float x = quad_sum(u1[hh]), y = quad_sum(u2[hh]), z = quad_sum(sp[hh]);
        const int i = L.wn * C + L.row(2 * hh);
        if (L.tig == 0) sSu1[i] = x, sSu2[i] = y, sRsp[i] = z;
      }
    }
    {
      const int r = tid >> 2, part = tid & 3;
      float x = 0.f, y = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float mm = mcur[16 * part + j];
        x += mm * bf(sQ, r, 16 * part + j);
        y += mm * bf(sG, r, 16 * part + j);
      }
      x = quad_sum(x), y = quad_sum(y);
      if (part == 0) sMcq[r] = x, sMcg[r] = y;
      const float tot = col_sum(sK);
      if (part == 0) mprev[r] = mcur[r] - tot;  // (column r: col_sum's column is tid/4 too)
    }
    for (int i = tid; i < C * 32; i += NT) {
      const int t = i >> 5, c = 2 * (i & 31);
      const float f = -sLam[t] * sInv[t];
      *reinterpret_cast<uint32_t*>(sdA + t * LD + c) = pack(f * bf(sG, t, c), f * bf(sG, t, c + 1));
    }
    __syncthreads();
    // phase A2: mq_i = M_iᵀq_i = (m after the chunk)ᵀq_i − Σ_{j>i} k_jᵀq_i (mg alike); S1', S2'
    float rmq[2], rmg[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = L.row(2 * hh);
      rmq[hh] = sMcq[i] - (sSu1[i] + sSu1[C + i]);
      rmg[hh] = sMcg[i] - (sSu2[i] + sSu2[C + i]);
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = L.row(2 * hh), j = L.col(nt, 0);
        const float inv = sInv[i], lam = sLam[i], fa = -lam * inv;
        const float o1 = cen ? rmq[hh] * inv : 0.f, o2 = cen ? lam * rmg[hh] * inv * inv : 0.f;
        const float a0 = j <= i ? s1[nt][2 * hh] - o1 : 0.f, a1 = j + 1 <= i ? s1[nt][2 * hh + 1] - o1 : 0.f;
        const float b0 = j <= i ? fa * pk[nt][2 * hh] + o2 : 0.f, b1 = j + 1 <= i ? fa * pk[nt][2 * hh + 1] + o2 : 0.f;
        *reinterpret_cast<uint32_t*>(sS1 + i * LD + j) = pack(a0, a1);
        *reinterpret_cast<uint32_t*>(sS2 + i * LD + j) = pack(b0, b1);
      }
    if (tid < C) {
      sMq[tid] = sMcq[tid] - (sSu1[tid] + sSu1[C + tid]);
      sMg[tid] = sMcg[tid] - (sSu2[tid] + sSu2[C + tid]);
    }
    __syncthreads();
    // phase B: X = G K_prev, dq = g − (λ/t) X + S2' K + b m_prev; q·X; GK += dAᵀQ;
    // dk += S2'ᵀ Q + S1'ᵀ dA + K GKsym + Gm; Gm += Σ_i (a g + b q)
    {
      Acc X, dq;
      zero(X), zero(dq);
      gemm2<false, true, false, true>(X, sG, sKs, dq, sS2, sK, L);
      float xq[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = L.row(2 * hh), a = L.col(nt, 0);
          xq[hh] += X[nt][2 * hh] * bf(sQ, i, a) + X[nt][2 * hh + 1] * bf(sQ, i, a + 1);
          if (i >= n) continue;
          const float inv = sInv[i], lam = sLam[i], fa = -lam * inv, bb = cen ? lam * sMg[i] * inv * inv : 0.f;
          const float d0 = bf(sG, i, a) + fa * X[nt][2 * hh] + dq[nt][2 * hh] + bb * mprev[a];
          const float d1 = bf(sG, i, a + 1) + fa * X[nt][2 * hh + 1] + dq[nt][2 * hh + 1] + bb * mprev[a + 1];
          *reinterpret_cast<uint32_t*>(p.dq + qrow(p, b, t0 + i, h) + a) = pack(d0, d1);
        }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float x = quad_sum(xq[hh]);
        if (L.tig == 0) sXq[L.wn * C + L.row(2 * hh)] = x;
      }
    }
    if (ci > c0) gemm<true, true>(GK, sdA, sQ, L);
    {
      Acc dk;
      zero(dk);
      gemm<true, true>(dk, sS2, sQ, L);
      gemm<true, true>(dk, sS1, sdA, L);
      gemm<false, true>(dk, sK, sGK, L);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int j = L.row(2 * hh), a = L.col(nt, 0);
          if (j >= n) continue;
          uint32_t* dst = reinterpret_cast<uint32_t*>(p.dk + qrow(p, b, t0 + j, h) + a);
          const __nv_bfloat162 old = *reinterpret_cast<const __nv_bfloat162*>(dst);
          *dst = pack(__low2float(old) + (dk[nt][2 * hh] + gmcur[a]), __high2float(old) + (dk[nt][2 * hh + 1] + gmcur[a + 1]));
        }
    }
    if (cen) {
      const int c = tid >> 2, part = tid & 3;
      float x = 0.f;
#pragma unroll
      for (int rr = 0; rr < 16; ++rr) {
        const int i = 16 * part + rr;
        const float f = sLam[i] * sInv[i] * sInv[i];
        x += f * (sMq[i] * bf(sG, i, c) + sMg[i] * bf(sQ, i, c));
      }
      x = quad_sum(x);
      if (part == 0) gmnext[c] = gmcur[c] + x;
    } else if (tid < C) {
      gmnext[tid] = 0.f;
    }
    __syncthreads();
    if (tid < n) {
      const float inv = sInv[tid];
      const float ga = ((sXq[tid] + sXq[C + tid]) + (sRsp[tid] + sRsp[C + tid])) * inv;
      p.dlam[(static_cast<size_t>(b) * p.T + t0 + tid) * p.H + h] = -(ga - (cen ? sMg[tid] * sMq[tid] * inv * inv : 0.f));
    }
  }
}

// ---------------------------------------------------------------- host side
// Chunks per group: kGroup, or LAR_CCQ_GROUP (1..64) when set (a tuning knob for the bench).
int group_chunks() {
  static const int g = [] {
    const char* e = std::getenv("LAR_CCQ_GROUP");
    const int v = e ? std::atoi(e) : 0;
    return v >= 1 && v <= 64 ? v : kGroup;
  }();
  return g;
}

QParams make_qparams(const DeltaShape& s, const char* what) {
  if (s.dk != 64)
    throw RuntimeError(std::string(what) + ": key dim dk=" + std::to_string(s.dk) + " (supported: 64)");
  if (s.B < 1 || s.T < 1 || s.H < 1 || s.B > 65535 || s.H > 65535 || s.T > (int64_t{1} << 30))
    throw RuntimeError(std::string(what) + ": bad shape B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                       " H=" + std::to_string(s.H));
  QParams p{};
  p.B = static_cast<int>(s.B), p.T = static_cast<int>(s.T), p.H = static_cast<int>(s.H);
  p.nc = static_cast<int>(delta_num_chunks(s));
  p.G = group_chunks();
  p.ng = (p.nc + p.G - 1) / p.G;
  return p;
}

// The workspace comes from a private stream-ordered pool that keeps its memory (a layer
// calls ccq_fwd / ccq_bwd with the same sizes every step: no allocation after the first).
cudaMemPool_t ccq_pool() {
  static std::mutex mu;
  static std::map<int, cudaMemPool_t> pools;
  int dev = 0;
  LAR_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = pools.find(dev);
  if (it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = dev;
  cudaMemPool_t pl = nullptr;
  LAR_CUDA_CHECK(cudaMemPoolCreate(&pl, &props));
  uint64_t keep = UINT64_MAX;
  LAR_CUDA_CHECK(cudaMemPoolSetAttribute(pl, cudaMemPoolAttrReleaseThreshold, &keep));
  pools.emplace(dev, pl);
  return pl;
}
struct Workspace {
  float* p = nullptr;
  cudaStream_t stream;
  Workspace(size_t floats, cudaStream_t s) : stream(s) {
    void* ptr = nullptr;
    LAR_CUDA_CHECK(cudaMallocFromPoolAsync(&ptr, floats * sizeof(float), ccq_pool(), s));
    p = static_cast<float*>(ptr);
  }
  ~Workspace() { cudaFreeAsync(p, stream); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
};

template <class K>
void qlaunch(K kernel, dim3 grid, size_t smem, const QParams& p, cudaStream_t stream) {
  LAR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<grid, NT, smem, stream>>>(p);
  LAR_CUDA_LAUNCHED();
}

}  // namespace

void ccq_fwd(const DeltaShape& s, const CcqInputs& in, __nv_bfloat16* qc, const CcqStats& out, cudaStream_t stream) {
  QParams p = make_qparams(s, "ccq_fwd");
  if (!in.q || !in.k || !in.lambda || !qc) throw RuntimeError("ccq_fwd: q, k, lambda and qc are required");
  if (in.t0 < 0) throw RuntimeError("ccq_fwd: negative t0 " + std::to_string(in.t0));
  p.q = in.q, p.k = in.k, p.lam = in.lambda, p.K0 = in.K0, p.m0 = in.m0, p.centered = in.centered ? 1 : 0;
  p.t0 = static_cast<double>(in.t0);
  p.qc = qc, p.Kout = out.K, p.mout = out.m;
  p.rec = kRecF;
  Workspace ws(static_cast<size_t>(p.B) * p.H * p.ng * p.rec, stream);
  p.ws = ws.p;
  const dim3 groups(p.ng, p.H, p.B), slices(D / 4, p.H, p.B);
  qlaunch(ccq_stats_fwd_kernel, groups, kStatsFwdSmem, p, stream);
  qlaunch(ccq_scan_kernel<false>, slices, 0, p, stream);
  qlaunch(ccq_fwd_kernel, groups, kQFwdSmem, p, stream);
}

void ccq_bwd(const DeltaShape& s, const CcqInputs& in, const CcqStats& fin, const __nv_bfloat16* dqc,
             __nv_bfloat16* dq, __nv_bfloat16* dk, float* dlambda, cudaStream_t stream) {
  QParams p = make_qparams(s, "ccq_bwd");
  if (!in.q || !in.k || !in.lambda || !fin.K || !fin.m || !dqc || !dq || !dk || !dlambda)
    throw RuntimeError("ccq_bwd: q, k, lambda, the final statistics, dqc, dq, dk and dlambda are required");
  if (dq == dqc) throw RuntimeError("ccq_bwd: dq must not alias dqc");
  if (in.t0 < 0) throw RuntimeError("ccq_bwd: negative t0 " + std::to_string(in.t0));
  // The statistics at every group boundary are rebuilt from K0, m0 and the keys (the scan
  // below), so fin is not read: it only has to exist (the forward that made it ran).
  p.q = in.q, p.k = in.k, p.lam = in.lambda, p.K0 = in.K0, p.m0 = in.m0, p.centered = in.centered ? 1 : 0;
  p.t0 = static_cast<double>(in.t0);
  p.dqc = dqc, p.dq = dq, p.dk = dk, p.dlam = dlambda;
  p.rec = kRecB;
  Workspace ws(static_cast<size_t>(p.B) * p.H * p.ng * p.rec, stream);
  p.ws = ws.p;
  const dim3 groups(p.ng, p.H, p.B), slices(D / 4, p.H, p.B);
  qlaunch(ccq_stats_bwd_kernel, groups, kStatsBwdSmem, p, stream);
  qlaunch(ccq_scan_kernel<true>, slices, 0, p, stream);
  qlaunch(ccq_bwd_kernel, groups, kQBwdSmem, p, stream);
}

}  // namespace lar::kernels::cuda::linear
