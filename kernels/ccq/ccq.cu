// CCQ read correction (docs/spec.md §4, kernels/ccq/ccq.hpp) forward and backward:
//   q_c = q − λ_t r_t,  r_t = (K_t q)/t − m_t (m_tᵀ q)/t²  (centered; uncentered: no m term)
// with the running key statistics K_t = Σ_{j≤t} k_j k_jᵀ, m_t = Σ_{j≤t} k_j (no forgetting).
// The backbone then runs on q_c; its gradient on q_c comes back here as dqc. See
// ccq_cuda.hpp for the contract.
//
// Chunk-parallel (dev/perf-history.md, "CCQ chunk-parallel" and "CCQ: warp-specialised kernels"). The statistics
// have no decay, so the state before a chunk is a prefix sum of per-chunk terms, and the
// gradients on it (GK on K_prev, Gm on m_prev) are suffix sums. Chunks (64 tokens) are taken
// in groups of G (group_chunks); when B·H is too small to fill the GPU (else the warp-specialised
// kernels below: one 16-warp CTA per (b, h), the forward from K0, m0 and the backward from the
// forward's final statistics) the forward and the backward are three launches each:
//   stats   one CTA per (group, h, b): the group's own sums (fwd: Σ KᵀK, Σ k; bwd also
//           GK = Σ dAᵀQ, W = Σ (λ/t²)(g qᵀ + q gᵀ) and Gm with m = 0 at the group start)
//   scan    per (b, h), 8 CTAs of 8 rows (a warp per row): inclusive prefix of K, m over the groups (+
//           K0, m0; the last one is the final statistics), Gm += W m_start, then the
//           exclusive suffix sums of GK and Gm (all in fp32, fixed order: deterministic)
//   main    one CTA per (group, h, b) walks its G chunks from its start state (forward:
//           K_prev, m_prev; backward in reverse: K, m after the group, GK, Gm after it), next
//           chunk's tiles prefetched with cp.async, two CTAs per SM.
// Per chunk (rows i, t_i = t_prev + i + 1), as wgmma 64×64×64 products on swizzled bf16 tiles (wgmma.cuh):
//   forward  R = Q K_prev + (Q Kᵀ ⊙ L) K,  M_i = m_prev + Σ_{j≤i} k_j,
//            r_i = R_i/t_i − M_i (M_iᵀ q_i)/t_i²,  K += KᵀK
//   backward (g = dqc, dA = −λ g/t, mq = Mᵀq, mg = Mᵀg, a = λ mq/t², b = λ mg/t²)
//            S1' = (QKᵀ − mq/t) ⊙ L,  S2' = (dA Kᵀ + b) ⊙ L   (the mean term folded in)
//            dq = g − (λ/t) G K_prev + S2' K + b m_prev,  dλ = −(qᵀK_prev g + Σ_j S1·GKᵀ)/t + mg mq/t²
//            dk += S2'ᵀ Q + S1'ᵀ dA + K (GK + GKᵀ) + Gm,  GK += dAᵀ Q,  Gm += Σ_i (a g + b q)
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kernels/ccq/ccq_cuda.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/linear/chunk_common.cuh"
#include "kernels/linear/scratch.hpp"
#include "kernels/linear/wgmma.cuh"

namespace lar::kernels::cuda::linear {
namespace {

constexpr int kMinGroup = 4;  // fewest chunks per group (group_chunks picks the default per shape)
// Workspace records per (b, h, group), fp32: forward {K, m}; backward {K, m, GK, W, Gm}.
constexpr int kOffK = 0, kOffM = D * D, kOffGK = D * D + D, kOffW = 2 * D * D + D, kOffGm = 3 * D * D + D;
constexpr int kRecF = D * D + D, kRecB = 3 * D * D + 2 * D;

struct QParams {
  const bf16 *q, *k, *dqc;
  const float *lam, *K0, *m0;
  bf16 *qc, *dq, *dk;
  float *Kout, *mout, *dlam;
  float* ws;  // workspace records [B, H, ng, rec]
  const float *Kfin, *mfin;  // the warp-specialised backward's start: the forward's final statistics
  int B, T, H, nc, G, ng, rec, centered;  // G chunks per group, ng groups
  double t0;  // tokens seen before this call
};

__device__ __forceinline__ size_t qrow(const QParams& p, int b, int t, int h) {
  return ((static_cast<size_t>(b) * p.T + t) * p.H + h) * D;
}
__device__ __forceinline__ float* rec(const QParams& p, int b, int h, int g) {
  return p.ws + ((static_cast<size_t>(b) * p.H + h) * p.ng + g) * p.rec;
}
// Every bf16 tile of these kernels is a swizzled tile (wgmma.cuh: 128-byte rows, 16-byte chunk
// c of row r at chunk c ^ (r & 7)), the layout the wgmma descriptors read; tile slots stay TILE
// elements apart (9216 bytes = 9 × 1024, so each slot starts on a 1024-byte boundary of the
// 1024-aligned dynamic shared memory). Element (r, c) of a tile is at swz(r, c).
using wg::swz;
__device__ __forceinline__ float bfs(const bf16* s, int r, int c) { return __bfloat162float(s[swz(r, c)]); }
__device__ __forceinline__ void put2(bf16* s, int r, int c, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(s + swz(r, c)) = pack(lo, hi);
}
// cp.async of a chunk's [64][64] block (rows ≥ n zero-filled) by threads 0..NT−1.
__device__ __forceinline__ void ld_tile(bf16* s, const bf16* g, size_t stride, int n) {
  wg::load_tile_async(s, g, stride, n, static_cast<int>(threadIdx.x), NT);
}
// An Acc fragment rounded to bf16 into a tile.
__device__ __forceinline__ void st_tile(bf16* s, const Acc& c, const Lane& L) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) put2(s, L.row(2 * h), L.col(nt, 0), c[nt][2 * h], c[nt][2 * h + 1]);
}
// Barriers in front of products: each thread's tile writes (stores, cp.async) are made visible
// to the tensor cores' async proxy first (HOPPER.md).
__device__ __forceinline__ void csync() {
  wg::fence_async_smem();
  __syncthreads();
}
__device__ __forceinline__ void bsync(int id, int n) {
  wg::fence_async_smem();
  bar_sync(id, n);
}
__device__ __forceinline__ void barrive(int id, int n) {
  wg::fence_async_smem();
  bar_arrive(id, n);
}

// λ of row tid of chunk ci (0 past the sequence or outside 0..nc−1). The main loops load it a
// chunk ahead into a register (lam_of for ci ∓ 1 while chunk ci runs), so that its global
// latency overlaps a whole chunk instead of stalling the loop's first barrier.
__device__ __forceinline__ float lam_of(const QParams& p, int b, int h, int ci) {
  const int i = threadIdx.x, t = ci * C + i;
  return i < C && ci >= 0 && ci < p.nc && t < p.T ? p.lam[(static_cast<size_t>(b) * p.T + t) * p.H + h] : 0.f;
}
// λ_i (from the register) and 1/t_i of the rows of the chunk starting at token t0.
__device__ __forceinline__ void put_rows(const QParams& p, int t0, float lam, float* sLam, float* sInv) {
  const int i = threadIdx.x;
  if (i < C) {
    sLam[i] = lam;
    sInv[i] = 1.f / static_cast<float>(p.t0 + t0 + i + 1);
  }
}
// Column sum of a bf16 tile by thread (column tid/4, rows 4·r + tid%4), returned to the quad
// (rows interleaved by part: a warp's 32 loads hit 16 banks, two lanes per word, no conflict).
__device__ __forceinline__ float col_sum(const bf16* s) {
  const int c = threadIdx.x >> 2, part = threadIdx.x & 3;
  float x = 0.f;
#pragma unroll
  for (int r = 0; r < 16; ++r) x += bfs(s, 4 * r + part, c);
  return quad_sum(x);
}
// Dots of the fp32 vector v [64] with row tid/4 of the bf16 tiles A (and B), returned to the
// quad. Part tid%4 takes the column pairs 8j + 2·part: for each j the warp's 8 rows × 4 parts
// read 32 different banks.
template <bool kTwo>
__device__ __forceinline__ void row_dots(const float* v, const bf16* A, const bf16* B, float& x, float& y) {
  const int r = threadIdx.x >> 2, part = threadIdx.x & 3;
  x = 0.f, y = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = 8 * j + 2 * part;
    const float2 m = *reinterpret_cast<const float2*>(v + c);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(A + swz(r, c)));
    x += m.x * a.x + m.y * a.y;
    if (kTwo) {
      const float2 bb = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(B + swz(r, c)));
      y += m.x * bb.x + m.y * bb.y;
    }
  }
  x = quad_sum(x);
  if (kTwo) y = quad_sum(y);
}
// Two adjacent bf16 of a tile as floats.
__device__ __forceinline__ float2 bf2(const bf16* s, int r, int c) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(s + swz(r, c)));
}
// Partial column sums Σ_i a_i X[i][c] + b_i Y[i][c] (bf16 tiles X, Y; fp32 a, b [64]) of the
// column pair c = 2·(tid/8), rows 8·r + tid%8 (each load of the warp in its own bank); the
// caller sums the 8 parts (pair_sum).
__device__ __forceinline__ float2 col_pair_part(const float* a, const bf16* X, const float* b, const bf16* Y) {
  const int c = 2 * (threadIdx.x >> 3), part = threadIdx.x & 7;
  float2 s = make_float2(0.f, 0.f);
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const int i = 8 * r + part;
    const float2 x = bf2(X, i, c), y = bf2(Y, i, c);
    s.x += a[i] * x.x + b[i] * y.x;
    s.y += a[i] * x.y + b[i] * y.y;
  }
  return s;
}
__device__ __forceinline__ float2 pair_sum(float2 s) {
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) s.x += __shfl_xor_sync(FULL, s.x, o), s.y += __shfl_xor_sync(FULL, s.y, o);
  return s;
}
// The 64×64×64 products: wgmma (wgmma.cuh) on swizzled tiles, warpgroup L.wn of the team
// computing columns 32·L.wn.. into the Acc fragment (the same registers chunk_common.cuh's
// mma.sync gemm fills), so the epilogues are unchanged. mm: c += A·B; mm2: two products in
// one commit group (c1 += A1·B1, c2 += A2·B2; c1 and c2 may be the same accumulator).
template <bool A_KM, bool B_KN>
__device__ __forceinline__ void mm(Acc& c, const bf16* A, const bf16* B, const Lane& L) {
  wg::mma_64x64<A_KM, B_KN>(c, A, B, L.wn);
}
template <bool A1_KM, bool B1_KN, bool A2_KM, bool B2_KN>
__device__ __forceinline__ void mm2(Acc& c1, const bf16* A1, const bf16* B1, Acc& c2, const bf16* A2, const bf16* B2,
                                    const Lane& L) {
  wg::begin();
  wg::issue<A1_KM, B1_KN>(c1, A1, B1, L.wn);
  wg::issue<A2_KM, B2_KN>(c2, A2, B2, L.wn);
  wg::end();
}

// ---------------------------------------------------------------- stats (forward)
// The group's Σ KᵀK (fp32 MMA accumulation, chunk after chunk) and Σ k.
constexpr size_t kStatsFwdSmem = 2 * TILE * sizeof(bf16) + 4 * C * sizeof(float);

__global__ void __launch_bounds__(NT, 2) ccq_stats_fwd_kernel(const QParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  bf16* sKb = reinterpret_cast<bf16*>(wg::align1k(smem));  // two buffers of TILE
  float* sCol = reinterpret_cast<float*>(sKb + 2 * TILE);  // [4][C]
  const Lane L;
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const size_t stride = static_cast<size_t>(p.H) * D;
  const int c0 = g * p.G, c1 = min(p.nc, c0 + p.G);
  Acc Ks;
  zero(Ks);
  float col = 0.f;  // column tid%64, rows 16·(tid/64)..
  ld_tile(sKb, p.k + qrow(p, b, c0 * C, h), stride, min(C, p.T - c0 * C));
  cp_async_commit();
  for (int ci = c0; ci < c1; ++ci) {
    const bf16* sK = sKb + ((ci - c0) & 1) * TILE;
    if (ci + 1 < c1) ld_tile(sKb + ((ci - c0 + 1) & 1) * TILE, p.k + qrow(p, b, (ci + 1) * C, h), stride, min(C, p.T - (ci + 1) * C));
    cp_async_commit();
    cp_async_wait<1>();
    csync();
    mm<true, true>(Ks, sK, sK, L);
#pragma unroll
    for (int r = 0; r < 16; ++r) col += bfs(sK, 16 * (tid >> 6) + r, tid & 63);
    csync();  // before the next prefetch overwrites this buffer
  }
  float* R = rec(p, b, h, g);
  frag_store_f(R + kOffK, Ks, L);
  sCol[tid] = col;
  csync();
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
  extern __shared__ __align__(1024) unsigned char smem[];
  bf16* base = reinterpret_cast<bf16*>(wg::align1k(smem));
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
  float2 gmp = make_float2(0.f, 0.f);  // Gm0 partial of columns 2·(tid/8) + {0, 1}, rows 8·r + tid%8
  if (tid < C) sMl[tid] = 0.f;
  auto prefetch = [&](int ci, int buf) {
    const int t0 = ci * C, n = min(C, p.T - t0);
    ld_tile(sQb + buf * TILE, p.q + qrow(p, b, t0, h), stride, n);
    ld_tile(sKb + buf * TILE, p.k + qrow(p, b, t0, h), stride, n);
    ld_tile(sGb + buf * TILE, p.dqc + qrow(p, b, t0, h), stride, n);
  };
  prefetch(c0, 0);
  cp_async_commit();
  float lam_nx = lam_of(p, b, h, c0);
  for (int ci = c0; ci < c1; ++ci) {
    const int it = ci - c0, buf = it & 1, t0 = ci * C;
    const bf16 *sQ = sQb + buf * TILE, *sK = sKb + buf * TILE, *sG = sGb + buf * TILE;
    const float* mcur = sMl + (it & 1) * C;
    float* mnext = sMl + ((it + 1) & 1) * C;
    if (ci + 1 < c1) prefetch(ci + 1, buf ^ 1);
    cp_async_commit();
    put_rows(p, t0, lam_nx, sLam, sInv);
    lam_nx = ci + 1 < c1 ? lam_of(p, b, h, ci + 1) : 0.f;
    cp_async_wait<1>();
    csync();
    // phase 1: K stats, QKᵀ, GKᵀ on the tensor cores while the dA, E tiles, the local m and
    // m·q, m·g are made; then the masked row sums of QKᵀ, GKᵀ
    Acc s1, se;
    zero(s1), zero(se);
    wg::begin();
    wg::issue<true, true>(Ks, sK, sK, L.wn);
    wg::issue<false, false>(s1, sQ, sK, L.wn);  // (used only when centered; unconditional so
    wg::issue<false, false>(se, sG, sK, L.wn);  // that the group stays one asynchronous stage)
    wg::commit();
    for (int i = tid; i < C * 32; i += NT) {
      const int t = i >> 5, c = 2 * (i & 31);
      const float inv = sInv[t], fa = -sLam[t] * inv, fe = sLam[t] * inv * inv;
      const float2 gg = bf2(sG, t, c);
      put2(sdA, t, c, fa * gg.x, fa * gg.y);
      put2(sE, t, c, fe * gg.x, fe * gg.y);
    }
    {
      const float tot = col_sum(sK);
      if ((tid & 3) == 0) mnext[tid >> 2] = mcur[tid >> 2] + tot;
    }
    if (cen) {
      float x, y;
      row_dots<true>(mcur, sQ, sG, x, y);
      if ((tid & 3) == 0) sMq0[tid >> 2] = x, sMg0[tid >> 2] = y;
    }
    wg::wait();
    if (cen) {
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
    }
    csync();
    // phase 2: GK += dAᵀQ, Y += EᵀQ; per row a = λ mq/t², b = λ mg/t² (in place of m·q, m·g)
    if (cen) {
      wg::begin();
      wg::issue<true, true>(GK, sdA, sQ, L.wn);
      wg::issue<true, true>(Y, sE, sQ, L.wn);
      wg::commit();
      if (tid < C) {
        const float f = sLam[tid] * sInv[tid] * sInv[tid];
        sMq0[tid] = f * (sMq0[tid] + (sRs1[tid] + sRs1[C + tid]));
        sMg0[tid] = f * (sMg0[tid] + (sRse[tid] + sRse[C + tid]));
      }
      wg::wait();
    } else {
      mm<true, true>(GK, sdA, sQ, L);
    }
    csync();
    // phase 3: Gm0 column partials Σ_i a_i g_i + b_i q_i
    if (cen) {
      const float2 x = col_pair_part(sMq0, sG, sMg0, sQ);
      gmp.x += x.x, gmp.y += x.y;
    }
    csync();
  }
  float* R = rec(p, b, h, g);
  frag_store_f(R + kOffK, Ks, L);
  frag_store_f(R + kOffGK, GK, L);
  if (tid < C) R[kOffM + tid] = sMl[((c1 - c0) & 1) * C + tid];
  gmp = pair_sum(gmp);
  if ((tid & 7) == 0) R[kOffGm + 2 * (tid >> 3)] = cen ? gmp.x : 0.f, R[kOffGm + 2 * (tid >> 3) + 1] = cen ? gmp.y : 0.f;
  store_f(sY, Y, L, [](float x, int, int) { return x; });
  csync();
  for (int i = tid; i < D * D; i += NT) {
    const int a = i >> 6, c = i & 63;
    R[kOffW + i] = cen ? sY[a * LDF + c] + sY[c * LDF + a] : 0.f;
  }
}

// ---------------------------------------------------------------- scan over the groups
// Block (slice, h, b), 8 warps: warp w owns row a = 8·slice + w of the 64×64 matrices, lane l
// its columns l and l + 32, and keeps m of those two columns in registers (every row does, so
// that the row's W m_start is a warp reduction: no shared memory, no barrier). Slice 0's warp 0
// writes m. Groups are read kScanBatch at a time so that their loads are in flight together.
constexpr int kScanBatch = 8;

template <bool kBwd>
__global__ void __launch_bounds__(NT) ccq_scan_kernel(const QParams p) {
  const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z, lane = threadIdx.x & 31;
  const int a = 8 * s + (threadIdx.x >> 5), e0 = a * D + lane, e1 = e0 + 32;
  const size_t bh = static_cast<size_t>(b) * p.H + h;
  const bool writes_m = s == 0 && a == 0, cen = p.centered;
  float K0 = p.K0 ? p.K0[bh * D * D + e0] : 0.f, K1 = p.K0 ? p.K0[bh * D * D + e1] : 0.f;
  float m0 = p.m0 ? p.m0[bh * D + lane] : 0.f, m1 = p.m0 ? p.m0[bh * D + lane + 32] : 0.f;
  for (int g0 = 0; g0 < p.ng; g0 += kScanBatch) {
    const int cnt = min(kScanBatch, p.ng - g0);
    float k0[kScanBatch], k1[kScanBatch], n0[kScanBatch], n1[kScanBatch], w0[kScanBatch], w1[kScanBatch],
        gl[kScanBatch];
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) {
      k0[u] = k1[u] = n0[u] = n1[u] = w0[u] = w1[u] = gl[u] = 0.f;
      if (u < cnt) {
        const float* R = rec(p, b, h, g0 + u);
        k0[u] = R[kOffK + e0], k1[u] = R[kOffK + e1];
        n0[u] = R[kOffM + lane], n1[u] = R[kOffM + lane + 32];
        if (kBwd && cen) w0[u] = R[kOffW + e0], w1[u] = R[kOffW + e1], gl[u] = R[kOffGm + a];
      }
    }
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) {
      if (u >= cnt) break;
      float* R = rec(p, b, h, g0 + u);
      K0 += k0[u], K1 += k1[u];
      R[kOffK + e0] = K0, R[kOffK + e1] = K1;
      if (kBwd) {  // Gm of the group += (W m_start)[a]
        float x = w0[u] * m0 + w1[u] * m1;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
        if (lane == 0) R[kOffGm + a] = cen ? gl[u] + x : 0.f;
      }
      m0 += n0[u], m1 += n1[u];
      if (writes_m) R[kOffM + lane] = m0, R[kOffM + lane + 32] = m1;
    }
  }
  if (p.Kout) p.Kout[bh * D * D + e0] = K0, p.Kout[bh * D * D + e1] = K1;
  if (p.mout && writes_m) p.mout[bh * D + lane] = m0, p.mout[bh * D + lane + 32] = m1;
  if (!kBwd) return;
  // exclusive suffix sums of GK and Gm (each thread reads back only what it wrote or owns)
  float G0 = 0.f, G1 = 0.f, gm = 0.f;
  for (int g0 = p.ng - 1; g0 >= 0; g0 -= kScanBatch) {
    const int cnt = min(kScanBatch, g0 + 1);
    float k0[kScanBatch], k1[kScanBatch], gl[kScanBatch];
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) {
      k0[u] = k1[u] = gl[u] = 0.f;
      if (u < cnt) {
        const float* R = rec(p, b, h, g0 - u);
        k0[u] = R[kOffGK + e0], k1[u] = R[kOffGK + e1];
        if (lane == 0) gl[u] = R[kOffGm + a];
      }
    }
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) {
      if (u >= cnt) break;
      float* R = rec(p, b, h, g0 - u);
      R[kOffGK + e0] = G0, R[kOffGK + e1] = G1;
      G0 += k0[u], G1 += k1[u];
      if (lane == 0) {
        R[kOffGm + a] = gm;
        gm += gl[u];
      }
    }
  }
}

// ---------------------------------------------------------------- forward (main)
// The mean term rides in the intra-chunk matrix: with mq_i = M_iᵀq_i = m_prevᵀq_i + Σ_{j≤i} k_jᵀq_i,
//   P' = (Q Kᵀ − mq/t) ⊙ L,  R' = Q K_prev + P' K = A − (mq_i/t_i) Σ_{j≤i} k_j,
//   r_i = R'_i/t_i − m_prev mq_i/t_i²   (uncentered: P' = Q Kᵀ ⊙ L, no m term).
// Q K ×2 (prefetch), Ks P (bf16), m ping-pong, row sums of (QKᵀ⊙L) [2][C], m_prevᵀq, λ, 1/t.
constexpr size_t kQFwdSmem = 6 * TILE * sizeof(bf16) + (2 * C + 2 * C + C + C + C) * sizeof(float);

// Phase 1's per-row work of a forward chunk, shared by both forward kernels (threads 0..NT−1),
// called with the chunk's products (P = Q Kᵀ, ...) committed but not waited for: first what
// needs only the tiles — the m after the chunk (mnext = mcur + Σ k), m_prevᵀq (sMq) — while the
// tensor cores run, then (after the wait) P masked to j ≤ i and its row sums (sRow, [2][C]).
__device__ __forceinline__ void fwd_phase1_rows(Acc& P, float* sRow, const bf16* sK, const bf16* sQ,
                                                const float* mcur, float* mnext, float* sMq, const Lane& L,
                                                int tid) {
  {
    const float tot = col_sum(sK);
    if ((tid & 3) == 0) mnext[tid >> 2] = mcur[tid >> 2] + tot;
    float x, y;
    row_dots<false>(mcur, sQ, nullptr, x, y);
    if ((tid & 3) == 0) sMq[tid >> 2] = x;
  }
  wg::wait();
  {
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (L.row(e) < L.col(nt, e)) P[nt][e] = 0.f;
        rs[e >> 1] += P[nt][e];
      }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float x = quad_sum(rs[hh]);
      if (L.tig == 0) sRow[L.wn * C + L.row(2 * hh)] = x;
    }
  }
}

__global__ void __launch_bounds__(NT, 2) ccq_fwd_kernel(const QParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  bf16* base = reinterpret_cast<bf16*>(wg::align1k(smem));
  bf16* sQb = base;  // two buffers each (prefetch)
  bf16* sKb = base + 2 * TILE;
  bf16* sKs = base + 4 * TILE;
  bf16* sP = base + 5 * TILE;
  float* sMv = reinterpret_cast<float*>(base + 6 * TILE);  // [2][C] ping-pong
  float* sRow = sMv + 2 * C;  // [2][C]
  float* sMq = sRow + 2 * C;
  float* sLam = sMq + C;
  float* sInv = sLam + C;
  const Lane L;
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  const int c0 = g * p.G, c1 = min(p.nc, c0 + p.G);
  const bool cen = p.centered;

  // statistics before the group: K0, m0 for the first, else the scan's prefix after g − 1
  const float* Kst = g ? rec(p, b, h, g - 1) + kOffK : p.K0 ? p.K0 + bh * D * D : nullptr;
  const float* mst = g ? rec(p, b, h, g - 1) + kOffM : p.m0 ? p.m0 + bh * D : nullptr;
  Acc Ks;
  if (Kst)
    frag_load_f(Ks, Kst, L);
  else
    zero(Ks);
  if (tid < C) sMv[tid] = mst ? mst[tid] : 0.f;
  auto prefetch = [&](int ci, int buf) {
    const int t0 = ci * C, n = min(C, p.T - t0);
    ld_tile(sQb + buf * TILE, p.q + qrow(p, b, t0, h), stride, n);
    ld_tile(sKb + buf * TILE, p.k + qrow(p, b, t0, h), stride, n);
  };
  prefetch(c0, 0);
  cp_async_commit();
  float lam_nx = lam_of(p, b, h, c0);

  for (int ci = c0; ci < c1; ++ci) {
    const int it = ci - c0, buf = it & 1, t0 = ci * C, n = min(C, p.T - t0);
    const bf16 *sQ = sQb + buf * TILE, *sK = sKb + buf * TILE;
    const float* mcur = sMv + (it & 1) * C;
    float* mnext = sMv + ((it + 1) & 1) * C;
    if (ci + 1 < c1) prefetch(ci + 1, buf ^ 1);
    cp_async_commit();
    put_rows(p, t0, lam_nx, sLam, sInv);
    lam_nx = ci + 1 < c1 ? lam_of(p, b, h, ci + 1) : 0.f;
    st_tile(sKs, Ks, L);
    cp_async_wait<1>();
    csync();
    // phase 1: P = Q Kᵀ (masked, row sums), R = Q K_prev, K += KᵀK, m_prevᵀq, m after the chunk
    Acc R, P;
    zero(R);
    zero(P);
    wg::begin();
    wg::issue<false, false>(P, sQ, sK, L.wn);
    wg::issue<false, false>(R, sQ, sKs, L.wn);
    wg::issue<true, true>(Ks, sK, sK, L.wn);  // (unused after the group's last chunk; unconditional
                                              // so that the group stays one asynchronous stage)
    wg::commit();
    fwd_phase1_rows(P, sRow, sK, sQ, mcur, mnext, sMq, L, tid);
    csync();
    // phase 1b: mq per row, P' = P − mq/t on j ≤ i
    float rmq[2], rinv[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = L.row(2 * hh);
      rmq[hh] = sMq[i] + (sRow[i] + sRow[C + i]);
      rinv[hh] = sInv[i];
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = L.row(2 * hh), j = L.col(nt, 0);
        const float o = cen ? rmq[hh] * rinv[hh] : 0.f;
        const float v0 = j <= i ? P[nt][2 * hh] - o : 0.f, v1 = j + 1 <= i ? P[nt][2 * hh + 1] - o : 0.f;
        put2(sP, i, j, v0, v1);
      }
    csync();
    // phase 2: R += P' K; q_c = q − λ r
    mm<false, true>(R, sP, sK, L);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = L.row(2 * hh);
      if (i >= n) continue;
      const float inv = rinv[hh], lam = sLam[i], mt = cen ? rmq[hh] * inv * inv : 0.f;
      bf16* dst = p.qc + qrow(p, b, t0 + i, h);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int a = L.col(nt, 0);
        const float2 m = *reinterpret_cast<const float2*>(mcur + a);
        const float2 q = bf2(sQ, i, a);
        const float r0 = R[nt][2 * hh] * inv - m.x * mt, r1 = R[nt][2 * hh + 1] * inv - m.y * mt;
        *reinterpret_cast<uint32_t*>(dst + a) = pack(q.x - lam * r0, q.y - lam * r1);
      }
    }
    csync();
  }
}

// ---------------------------------------------------------------- backward (main)
// Q K G ×2 (prefetch), Ks (K_prev), S1', S2', dA, GK bf16 tiles; m and Gm ping-pong;
// per-row: λ, 1/t, m·q, m·g, mq, mg, a, b, row partials [2][C] of Σ_{j>i} s1, Σ_{j>i} p, Σ s1·p, q·X.
constexpr size_t kQBwdSmem = 11 * TILE * sizeof(bf16) + (2 * C + 2 * C + 8 * C + 4 * 2 * C) * sizeof(float);

// Phase A of a backward chunk, shared by both backward kernels (threads 0..NT−1): K_prev = K − KᵀK
// (Kc, and bf16 into sKs); s1 = QKᵀ, pk = GKᵀ (left in registers for phase A2) and their row
// partials Σ_{j>i} s1, Σ_{j>i} pk, Σ s1·pk (sSu1, sSu2, rsp); m·q, m·g with the m after the chunk
// (sMcq, sMcg); m_prev; dA = −λ g/t (sdA).
__device__ __forceinline__ void bwd_phase_a(Acc& Kc, Acc& s1, Acc& pk, const bf16* sQ, const bf16* sK,
                                            const bf16* sG, bf16* sKs, bf16* sdA, const float* mcur, float* mprev,
                                            const float* lamv, const float* invv, float* sSu1, float* sSu2,
                                            float* rsp, float* sMcq, float* sMcg, const Lane& L, int tid) {
  // the three products in one group; the per-row passes that need only the tiles run meanwhile
  {
    Acc a;
    zero(a);
    mm<true, true>(a, sK, sK, L);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) Kc[nt][e] -= a[nt][e];
  }
  zero(s1), zero(pk);
  wg::begin();
  wg::issue<false, false>(s1, sQ, sK, L.wn);
  wg::issue<false, false>(pk, sG, sK, L.wn);
  wg::commit();
  {
    const int r = tid >> 2, part = tid & 3;
    float x, y;
    row_dots<true>(mcur, sQ, sG, x, y);
    if (part == 0) sMcq[r] = x, sMcg[r] = y;
    const float tot = col_sum(sK);
    if (part == 0) mprev[r] = mcur[r] - tot;  // (column r: col_sum's column is tid/4 too)
  }
  for (int i = tid; i < C * 32; i += NT) {
    const int t = i >> 5, c = 2 * (i & 31);
    const float f = -lamv[t] * invv[t];
    const float2 gg = bf2(sG, t, c);
    put2(sdA, t, c, f * gg.x, f * gg.y);
  }
  st_tile(sKs, Kc, L);
  wg::wait();
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
      if (L.tig == 0) sSu1[i] = x, sSu2[i] = y, rsp[i] = z;
    }
  }
}

// Phase B's dq row of a backward chunk, shared by both backward kernels: row i = L.row(2·hh) of
// dq = g − (λ/t) X + S2'K + b m_prev (fa = −λ/t, bb = b) stored to dst if i < n; returns the
// row's q·X (summed over the quad).
__device__ __forceinline__ float bwd_dq_row(const Acc& X, const Acc& dq, int hh, float fa, float bb, const bf16* sQ,
                                            const bf16* sG, const float* mprev, bf16* dst, int n, const Lane& L) {
  const int i = L.row(2 * hh);
  float xq = 0.f;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int a = L.col(nt, 0);
    const float2 q = bf2(sQ, i, a), gg = bf2(sG, i, a), m = *reinterpret_cast<const float2*>(mprev + a);
    xq += X[nt][2 * hh] * q.x + X[nt][2 * hh + 1] * q.y;
    const float d0 = gg.x + fa * X[nt][2 * hh] + dq[nt][2 * hh] + bb * m.x;
    const float d1 = gg.y + fa * X[nt][2 * hh + 1] + dq[nt][2 * hh + 1] + bb * m.y;
    if (i < n) *reinterpret_cast<uint32_t*>(dst + a) = pack(d0, d1);
  }
  return quad_sum(xq);
}

__global__ void __launch_bounds__(NT, 2) ccq_bwd_kernel(const QParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  bf16* base = reinterpret_cast<bf16*>(wg::align1k(smem));
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
  float* sA = fb + 10 * C;
  float* sB = fb + 11 * C;
  float* sSu1 = fb + 12 * C;  // [2][C] each from here
  float* sSu2 = fb + 14 * C;
  float* sRsp = fb + 16 * C;
  float* sXq = fb + 18 * C;
  const Lane L;
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const size_t stride = static_cast<size_t>(p.H) * D;
  const int c0 = g * p.G, c1 = min(p.nc, c0 + p.G);
  const bool cen = p.centered;

  // K, m after the group (the scan's inclusive prefix); GK, Gm of everything after it
  const float* R0 = rec(p, b, h, g);
  Acc Kc, GK;
  frag_load_f(Kc, R0 + kOffK, L);
  frag_load_f(GK, R0 + kOffGK, L);
  if (tid < C) sMv[tid] = R0[kOffM + tid], sGm[tid] = R0[kOffGm + tid];
  auto prefetch = [&](int ci, int buf) {
    const int t0 = ci * C, n = min(C, p.T - t0);
    ld_tile(sQb + buf * TILE, p.q + qrow(p, b, t0, h), stride, n);
    ld_tile(sKb + buf * TILE, p.k + qrow(p, b, t0, h), stride, n);
    ld_tile(sGb + buf * TILE, p.dqc + qrow(p, b, t0, h), stride, n);
  };
  prefetch(c1 - 1, 0);
  cp_async_commit();
  float lam_nx = lam_of(p, b, h, c1 - 1);

  for (int ci = c1 - 1; ci >= c0; --ci) {
    const int it = c1 - 1 - ci, buf = it & 1, t0 = ci * C, n = min(C, p.T - t0);
    const bf16 *sQ = sQb + buf * TILE, *sK = sKb + buf * TILE, *sG = sGb + buf * TILE;
    const float* mcur = sMv + (it & 1) * C;
    float* mprev = sMv + ((it + 1) & 1) * C;
    const float* gmcur = sGm + (it & 1) * C;
    float* gmnext = sGm + ((it + 1) & 1) * C;
    if (ci > c0) prefetch(ci - 1, buf ^ 1);
    cp_async_commit();
    put_rows(p, t0, lam_nx, sLam, sInv);
    lam_nx = ci > c0 ? lam_of(p, b, h, ci - 1) : 0.f;
    st_tile(sGK, GK, L);
    cp_async_wait<1>();
    csync();
    // phase A: K_prev = K − KᵀK; s1 = QKᵀ, pk = GKᵀ (kept in registers) and their row
    // partials; m·q, m·g with the m after the chunk; m_prev; dA = −λ g/t
    Acc s1, pk;
    bwd_phase_a(Kc, s1, pk, sQ, sK, sG, sKs, sdA, mcur, mprev, sLam, sInv, sSu1, sSu2, sRsp, sMcq, sMcg, L, tid);
    csync();
    // phase A2: mq_i = M_iᵀq_i = (m after the chunk)ᵀq_i − Σ_{j>i} k_jᵀq_i (mg alike); S1', S2'
    float rmq[2], rmg[2], rinv[2], rlam[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = L.row(2 * hh);
      rmq[hh] = sMcq[i] - (sSu1[i] + sSu1[C + i]);
      rmg[hh] = sMcg[i] - (sSu2[i] + sSu2[C + i]);
      rinv[hh] = sInv[i], rlam[hh] = sLam[i];
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = L.row(2 * hh), j = L.col(nt, 0);
        const float inv = rinv[hh], lam = rlam[hh], fa = -lam * inv;
        const float o1 = cen ? rmq[hh] * inv : 0.f, o2 = cen ? lam * rmg[hh] * inv * inv : 0.f;
        const float a0 = j <= i ? s1[nt][2 * hh] - o1 : 0.f, a1 = j + 1 <= i ? s1[nt][2 * hh + 1] - o1 : 0.f;
        const float b0 = j <= i ? fa * pk[nt][2 * hh] + o2 : 0.f, b1 = j + 1 <= i ? fa * pk[nt][2 * hh + 1] + o2 : 0.f;
        put2(sS1, i, j, a0, a1);
        put2(sS2, i, j, b0, b1);
      }
    if (tid < C) {
      const float mq = sMcq[tid] - (sSu1[tid] + sSu1[C + tid]), mg = sMcg[tid] - (sSu2[tid] + sSu2[C + tid]);
      const float f = sLam[tid] * sInv[tid] * sInv[tid];
      sMq[tid] = mq, sMg[tid] = mg, sA[tid] = f * mq, sB[tid] = f * mg;
    }
    csync();
    // phase B: X = G K_prev, dq = g − (λ/t) X + S2' K + b m_prev; q·X; GK += dAᵀQ;
    // dk += S2'ᵀ Q + S1'ᵀ dA + K GKsym + Gm; Gm += Σ_i (a g + b q)
    // (two commit groups: the dq epilogue runs while the tensor cores do the dk products)
    {
      Acc X, dq, dk;
      zero(X), zero(dq), zero(dk);
      wg::begin();
      wg::issue<false, true>(X, sG, sKs, L.wn);
      wg::issue<false, true>(dq, sS2, sK, L.wn);
      wg::commit();
      // dk = S2'ᵀ Q + S1'ᵀ dA + K GK + K GKᵀ; GK += dAᵀ Q (unused after the last chunk)
      wg::issue<true, true>(dk, sS2, sQ, L.wn);
      wg::issue<true, true>(dk, sS1, sdA, L.wn);
      wg::issue<false, true>(dk, sK, sGK, L.wn);
      wg::issue<false, false>(dk, sK, sGK, L.wn);
      wg::issue<true, true>(GK, sdA, sQ, L.wn);
      wg::commit();
      wg::wait<1>();
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = L.row(2 * hh);
        const float fa = -rlam[hh] * rinv[hh], bb = cen ? sB[i] : 0.f;
        const float xq = bwd_dq_row(X, dq, hh, fa, bb, sQ, sG, mprev, p.dq + qrow(p, b, t0 + i, h), n, L);
        if (L.tig == 0) sXq[L.wn * C + i] = xq;
      }
      // this chunk's rows of the backbone's dk (CCQ's part is added below; after the dq rows:
      // 128 registers)
      uint32_t dk_old[2][4];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int j = L.row(2 * hh);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          dk_old[hh][nt] = j < n ? *reinterpret_cast<const uint32_t*>(p.dk + qrow(p, b, t0 + j, h) + L.col(nt, 0)) : 0u;
      }
      wg::wait<0>();
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int j = L.row(2 * hh);
        if (j >= n) continue;
        bf16* row = p.dk + qrow(p, b, t0 + j, h);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int a = L.col(nt, 0);
          uint32_t* dst = reinterpret_cast<uint32_t*>(row + a);
          const float2 old = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&dk_old[hh][nt]));
          const float2 gm = *reinterpret_cast<const float2*>(gmcur + a);
          *dst = pack(old.x + (dk[nt][2 * hh] + gm.x), old.y + (dk[nt][2 * hh + 1] + gm.y));
        }
      }
    }
    if (cen) {
      const float2 x = pair_sum(col_pair_part(sA, sG, sB, sQ));
      const int c = 2 * (tid >> 3);
      if ((tid & 7) == 0) gmnext[c] = gmcur[c] + x.x, gmnext[c + 1] = gmcur[c + 1] + x.y;
    } else if (tid < C) {
      gmnext[tid] = 0.f;
    }
    csync();
    if (tid < n) {
      const float inv = sInv[tid];
      const float ga = ((sXq[tid] + sXq[C + tid]) + (sRsp[tid] + sRsp[C + tid])) * inv;
      p.dlam[(static_cast<size_t>(b) * p.T + t0 + tid) * p.H + h] = -(ga - (cen ? sMg[tid] * sMq[tid] * inv * inv : 0.f));
    }
  }
}

// ---------------------------------------------------------------- backward (warp-specialised)
// The default backward when B·H fills the GPU (ccq_bwd's rule): one CTA of 16 warps per (b, h)
// walks all the chunks in reverse from the forward's final statistics (fin: K, m after the
// last chunk; GK = Gm = 0 after it), so there is no stats pass, no scan and no workspace, in
// two teams that work on different chunks at once:
//   team A (warps 0–7): the key-statistics chain (K_prev = K − KᵀK, m_prev) and what depends
//     only on it: s1 = QKᵀ, pk = GKᵀ, mq, mg, S1', S2', dA, the per-row scalars and the
//     chunk's Gm increment (3 GEMMs and the scalar passes, 3 barriers);
//   team B (warps 8–15), one chunk behind: X = G K_prev, dq, dλ, dk = S2'ᵀQ + S1'ᵀdA +
//     K (GK + GKᵀ) + Gm and GK += dAᵀQ (7 GEMMs, 1 barrier).
// A hands a chunk to B through one of two slots (S1', S2', dA, K_prev tiles and the per-row
// vectors) and Q, K, G through three (A's chunk, B's chunk, the prefetch), with named
// barriers: FULL_s (A arrives, B waits) and EMPTY_s (B arrives once it has finished the
// chunk's dλ at the start of its next chunk; A waits before it refills slot s two chunks
// later). GK, Gm stay in B's registers, K_prev in A's: fixed order, no atomics.
// (Measured against the 8-warp main kernel run over all chunks from fin, 0.40 ms, and a split
// with dq in team A, 0.38 ms: dev/perf-history.md.)
constexpr int kWsThreads = 2 * NT;
constexpr int kBarA = 1, kBarB = 2, kBarFull = 3, kBarEmpty = 5;  // FULL_s = 3 + s, EMPTY_s = 5 + s
// Q K G ×3, S1' S2' dA K_prev ×2, GK ×2 (bf16); per slot m, λ, 1/t, mq, mg, b, Gm increment
// (+ a spare), Σs1·pk and q·X halves; row partials of s1 and pk, m·q, m·g, a.
constexpr size_t kQBwdWsSmem = 19 * TILE * sizeof(bf16) + (2 * 8 * C + 2 * 2 * C + 2 * 2 * C + 2 * C + 2 * C + 3 * C) * sizeof(float);

__global__ void __launch_bounds__(kWsThreads, 1) ccq_bwd_ws_kernel(const QParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  bf16* base = reinterpret_cast<bf16*>(wg::align1k(smem));
  bf16* sQb = base;  // three slots each
  bf16* sKb = base + 3 * TILE;
  bf16* sGb = base + 6 * TILE;
  bf16* sS1b = base + 9 * TILE;  // two hand-off slots each
  bf16* sS2b = base + 11 * TILE;
  bf16* sdAb = base + 13 * TILE;
  bf16* sKsb = base + 15 * TILE;
  bf16* sGKb = base + 17 * TILE;  // team B: GK, two slots
  float* fb = reinterpret_cast<float*>(base + 19 * TILE);
  // per slot s (stride 8·C): m (the chunk's m_prev is the other slot's), λ, 1/t, mq, mg, b, Gm increment, spare
  float* sV = fb;
  auto sMv = [&](int s) { return sV + s * 8 * C; };
  auto sLam = [&](int s) { return sV + s * 8 * C + C; };
  auto sInv = [&](int s) { return sV + s * 8 * C + 2 * C; };
  auto sMq = [&](int s) { return sV + s * 8 * C + 3 * C; };
  auto sMg = [&](int s) { return sV + s * 8 * C + 4 * C; };
  auto sB = [&](int s) { return sV + s * 8 * C + 5 * C; };
  auto sGinc = [&](int s) { return sV + s * 8 * C + 6 * C; };
  float* sRspb = fb + 16 * C;  // [2 slots][2][C]
  float* sXqb = fb + 20 * C;   // [2 slots][2][C] (team B)
  float* sSu1 = fb + 24 * C;   // [2][C]
  float* sSu2 = fb + 26 * C;   // [2][C]
  float* sMcq = fb + 28 * C;
  float* sMcg = fb + 29 * C;
  float* sA = fb + 30 * C;
  const int h = blockIdx.x, b = blockIdx.y, nc = p.nc;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  const bool cen = p.centered;

  // (the team index read through a shuffle: warp-uniform to the compiler, so that it keeps the
  // wgmma of each team asynchronous instead of serialising them in a "divergent" branch)
  const int team = __shfl_sync(FULL, static_cast<int>(threadIdx.x) / NT, 0);
  if (team == 0) {  // ---- team A (threadIdx.x < NT: the helpers' thread mappings hold)
    const Lane L;
    const int tid = threadIdx.x;
    Acc Kc;
    frag_load_f(Kc, p.Kfin + bh * D * D, L);
    if (tid < C) sMv(0)[tid] = p.mfin[bh * D + tid];
    auto prefetch = [&](int ci, int it) {
      const int t0 = ci * C, n = min(C, p.T - t0);
      ld_tile(sQb + (it % 3) * TILE, p.q + qrow(p, b, t0, h), stride, n);
      ld_tile(sKb + (it % 3) * TILE, p.k + qrow(p, b, t0, h), stride, n);
      ld_tile(sGb + (it % 3) * TILE, p.dqc + qrow(p, b, t0, h), stride, n);
    };
    prefetch(nc - 1, 0);
    cp_async_commit();
    float lam_nx = lam_of(p, b, h, nc - 1);
    for (int ci = nc - 1; ci >= 0; --ci) {
      const int it = nc - 1 - ci, s = it & 1, t0 = ci * C;
      const bf16 *sQ = sQb + (it % 3) * TILE, *sK = sKb + (it % 3) * TILE, *sG = sGb + (it % 3) * TILE;
      bf16 *sS1 = sS1b + s * TILE, *sS2 = sS2b + s * TILE, *sdA = sdAb + s * TILE, *sKs = sKsb + s * TILE;
      const float* mcur = sMv(s);
      float* mprev = sMv(s ^ 1);
      float *lamv = sLam(s), *invv = sInv(s), *rsp = sRspb + s * 2 * C;
      // slot s and the Q/K/G slot (it + 1) % 3 were B's two chunks ago
      if (it >= 2) bsync(kBarEmpty + s, kWsThreads);
      if (ci > 0) prefetch(ci - 1, it + 1);
      cp_async_commit();
      put_rows(p, t0, lam_nx, lamv, invv);
      lam_nx = ci > 0 ? lam_of(p, b, h, ci - 1) : 0.f;
      cp_async_wait<1>();
      bsync(kBarA, NT);
      // phase A: K_prev = K − KᵀK; s1 = QKᵀ, pk = GKᵀ (registers) and their row partials;
      // m·q, m·g with the m after the chunk; m_prev; dA = −λ g/t
      Acc s1, pk;
      bwd_phase_a(Kc, s1, pk, sQ, sK, sG, sKs, sdA, mcur, mprev, lamv, invv, sSu1, sSu2, rsp, sMcq, sMcg, L, tid);
      bsync(kBarA, NT);
      // phase A2: mq_i = M_iᵀq_i = (m after the chunk)ᵀq_i − Σ_{j>i} k_jᵀq_i (mg alike); S1', S2'
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = L.row(2 * hh);
        const float rmq = sMcq[i] - (sSu1[i] + sSu1[C + i]), rmg = sMcg[i] - (sSu2[i] + sSu2[C + i]);
        const float inv = invv[i], lam = lamv[i], fa = -lam * inv;
        const float o1 = cen ? rmq * inv : 0.f, o2 = cen ? lam * rmg * inv * inv : 0.f;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int j = L.col(nt, 0);
          const float a0 = j <= i ? s1[nt][2 * hh] - o1 : 0.f, a1 = j + 1 <= i ? s1[nt][2 * hh + 1] - o1 : 0.f;
          const float b0 = j <= i ? fa * pk[nt][2 * hh] + o2 : 0.f, b1 = j + 1 <= i ? fa * pk[nt][2 * hh + 1] + o2 : 0.f;
          put2(sS1, i, j, a0, a1);
          put2(sS2, i, j, b0, b1);
        }
      }
      if (tid < C) {
        const float mq = sMcq[tid] - (sSu1[tid] + sSu1[C + tid]), mg = sMcg[tid] - (sSu2[tid] + sSu2[C + tid]);
        const float f = lamv[tid] * invv[tid] * invv[tid];
        sMq(s)[tid] = mq, sMg(s)[tid] = mg, sA[tid] = f * mq, sB(s)[tid] = f * mg;
      }
      bsync(kBarA, NT);
      // the chunk's Gm increment Σ_i (a g + b q), then the chunk goes to team B
      float* ginc = sGinc(s);
      if (cen) {
        const float2 x = pair_sum(col_pair_part(sA, sG, sB(s), sQ));
        const int c = 2 * (tid >> 3);
        if ((tid & 7) == 0) ginc[c] = x.x, ginc[c + 1] = x.y;
      } else if (tid < C) {
        ginc[tid] = 0.f;
      }
      barrive(kBarFull + s, kWsThreads);
    }
  } else {  // ---- team B
    const Lane L(static_cast<int>(threadIdx.x >> 5) - 8);
    const int tb = static_cast<int>(threadIdx.x) - NT;
    Acc GK;
    zero(GK);
    float gm[4][2] = {};  // Gm after the current chunk, columns L.col(nt, e)
    // dλ of the chunk of iteration it (slot it & 1), once the q·X halves of all B warps are in
    auto finish = [&](int it) {
      const int s = it & 1, t0 = (nc - 1 - it) * C, n = min(C, p.T - t0);
      if (tb < n) {
        const float inv = sInv(s)[tb], *xq = sXqb + s * 2 * C, *rsp = sRspb + s * 2 * C;
        const float ga = ((xq[tb] + xq[C + tb]) + (rsp[tb] + rsp[C + tb])) * inv;
        p.dlam[(static_cast<size_t>(b) * p.T + t0 + tb) * p.H + h] = -(ga - (cen ? sMg(s)[tb] * sMq(s)[tb] * inv * inv : 0.f));
      }
    };
    for (int ci = nc - 1; ci >= 0; --ci) {
      const int it = nc - 1 - ci, s = it & 1, t0 = ci * C, n = min(C, p.T - t0);
      const bf16 *sQ = sQb + (it % 3) * TILE, *sK = sKb + (it % 3) * TILE, *sG = sGb + (it % 3) * TILE;
      const bf16 *sS1 = sS1b + s * TILE, *sS2 = sS2b + s * TILE, *sdA = sdAb + s * TILE, *sKs = sKsb + s * TILE;
      bf16* sGK = sGKb + s * TILE;
      // the backbone's dk of this chunk's rows (CCQ's part is added below), read early
      uint32_t dk_old[2][4];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int j = L.row(2 * hh);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          dk_old[hh][nt] = j < n ? *reinterpret_cast<const uint32_t*>(p.dk + qrow(p, b, t0 + j, h) + L.col(nt, 0)) : 0u;
      }
      wg::wait<0>();  // (the previous chunk's GK update)
      st_tile(sGK, GK, L);  // (slot s: last read two chunks ago)
      bsync(kBarFull + s, kWsThreads);
      bsync(kBarB, NT);
      if (it >= 1) {  // the previous chunk: dλ, then its slot goes back to A (A waits for it two chunks on)
        finish(it - 1);
        if (it + 1 < nc) barrive(kBarEmpty + (s ^ 1), kWsThreads);
      }
      // X = G K_prev, dq = g − (λ/t) X + S2' K + b m_prev and q·X (first commit group) while the
      // tensor cores do dk = S2'ᵀ Q + S1'ᵀ dA + K GK + K GKᵀ (second)
      Acc dk;
      {
        Acc X, dq;
        zero(X), zero(dq), zero(dk);
        wg::begin();
        wg::issue<false, true>(X, sG, sKs, L.wn);
        wg::issue<false, true>(dq, sS2, sK, L.wn);
        wg::commit();
        wg::issue<true, true>(dk, sS2, sQ, L.wn);
        wg::issue<true, true>(dk, sS1, sdA, L.wn);
        wg::issue<false, true>(dk, sK, sGK, L.wn);
        wg::issue<false, false>(dk, sK, sGK, L.wn);
        wg::commit();
        wg::wait<1>();
        const float *lamv = sLam(s), *invv = sInv(s), *bv = sB(s), *mprev = sMv(s ^ 1);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = L.row(2 * hh);
          const float fa = -lamv[i] * invv[i], bb = cen ? bv[i] : 0.f;
          const float xq = bwd_dq_row(X, dq, hh, fa, bb, sQ, sG, mprev, p.dq + qrow(p, b, t0 + i, h), n, L);
          if (L.tig == 0) sXqb[s * 2 * C + L.wn * C + i] = xq;
        }
      }
      wg::wait<0>();
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int j = L.row(2 * hh);
        if (j >= n) continue;
        bf16* row = p.dk + qrow(p, b, t0 + j, h);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const float2 old = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&dk_old[hh][nt]));
          *reinterpret_cast<uint32_t*>(row + L.col(nt, 0)) =
              pack(old.x + (dk[nt][2 * hh] + gm[nt][0]), old.y + (dk[nt][2 * hh + 1] + gm[nt][1]));
        }
      }
      // GK += dAᵀ Q, waited for at the next chunk's st_tile (after the dk stores: GK and dk in
      // flight together spill at 128 registers; its tiles are released two chunks on)
      wg::begin();
      wg::issue<true, true>(GK, sdA, sQ, L.wn);
      wg::commit();
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) gm[nt][0] += sGinc(s)[L.col(nt, 0)], gm[nt][1] += sGinc(s)[L.col(nt, 1)];
    }
    wg::wait<0>();
    bsync(kBarB, NT);
    finish(nc - 1);
  }
}

// ---------------------------------------------------------------- forward (warp-specialised)
// The default forward when B·H fills the GPU (the same rule as the backward's): one CTA of 16
// warps per (b, h) walks all the chunks from K0, m0 and writes the final statistics itself (no
// stats pass, no scan, no workspace), in two teams on different chunks:
//   team A (warps 0–7): K_prev (bf16, before its update), P = QKᵀ masked with its row sums,
//     mq, P' = (P − mq/t)⊙L, K += KᵀK, m (2 GEMMs, 2 barriers);
//   team B (warps 8–15), one chunk behind: R = Q K_prev + P' K and q_c (2 GEMMs, no barrier).
// Hand-off as in the warp-specialised backward: K_prev, P' and the per-row λ, 1/t, mq/t² in two
// slots, Q and K in three, m (before each chunk) in three; FULL_s / EMPTY_s named barriers.
// Q K ×3, K_prev P' ×2 (bf16); m ×3, per slot λ, 1/t, mq/t²; row sums of P [2][C], m·q.
constexpr size_t kQFwdWsSmem = 10 * TILE * sizeof(bf16) + (3 * C + 2 * 3 * C + 2 * C + C) * sizeof(float);

__global__ void __launch_bounds__(kWsThreads, 1) ccq_fwd_ws_kernel(const QParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  bf16* base = reinterpret_cast<bf16*>(wg::align1k(smem));
  bf16* sQb = base;  // three slots each
  bf16* sKb = base + 3 * TILE;
  bf16* sKsb = base + 6 * TILE;  // two hand-off slots each
  bf16* sPb = base + 8 * TILE;
  float* fb = reinterpret_cast<float*>(base + 10 * TILE);
  float* sMb = fb;  // [3][C]: m before the chunk of iteration it is slot it % 3
  auto sLam = [&](int s) { return fb + 3 * C + s * 3 * C; };
  auto sInv = [&](int s) { return fb + 4 * C + s * 3 * C; };
  auto sMt = [&](int s) { return fb + 5 * C + s * 3 * C; };
  float* sRow = fb + 9 * C;  // [2][C] (team A)
  float* sMq = fb + 11 * C;  // (team A)
  const int h = blockIdx.x, b = blockIdx.y, nc = p.nc;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  const bool cen = p.centered;

  // (the team index read through a shuffle: warp-uniform to the compiler, so that it keeps the
  // wgmma of each team asynchronous instead of serialising them in a "divergent" branch)
  const int team = __shfl_sync(FULL, static_cast<int>(threadIdx.x) / NT, 0);
  if (team == 0) {  // ---- team A (threadIdx.x < NT: the helpers' thread mappings hold)
    const Lane L;
    const int tid = threadIdx.x;
    Acc Ks;
    if (p.K0)
      frag_load_f(Ks, p.K0 + bh * D * D, L);
    else
      zero(Ks);
    if (tid < C) sMb[tid] = p.m0 ? p.m0[bh * D + tid] : 0.f;
    auto prefetch = [&](int ci, int it) {
      const int t0 = ci * C, n = min(C, p.T - t0);
      ld_tile(sQb + (it % 3) * TILE, p.q + qrow(p, b, t0, h), stride, n);
      ld_tile(sKb + (it % 3) * TILE, p.k + qrow(p, b, t0, h), stride, n);
    };
    prefetch(0, 0);
    cp_async_commit();
    float lam_nx = lam_of(p, b, h, 0);
    for (int ci = 0; ci < nc; ++ci) {
      const int it = ci, s = it & 1, t0 = ci * C;
      const bf16 *sQ = sQb + (it % 3) * TILE, *sK = sKb + (it % 3) * TILE;
      bf16 *sKs = sKsb + s * TILE, *sP = sPb + s * TILE;
      const float* mcur = sMb + (it % 3) * C;
      float* mnext = sMb + ((it + 1) % 3) * C;
      float *lamv = sLam(s), *invv = sInv(s);
      // slot s and the Q/K/m slot (it + 1) % 3 were B's two chunks ago
      if (it >= 2) bsync(kBarEmpty + s, kWsThreads);
      if (ci + 1 < nc) prefetch(ci + 1, it + 1);
      cp_async_commit();
      put_rows(p, t0, lam_nx, lamv, invv);
      lam_nx = ci + 1 < nc ? lam_of(p, b, h, ci + 1) : 0.f;
      st_tile(sKs, Ks, L);
      cp_async_wait<1>();
      bsync(kBarA, NT);
      // phase 1: P = Q Kᵀ (masked, row sums), K += KᵀK, m_prevᵀq, m after the chunk
      Acc P;
      zero(P);
      wg::begin();
      wg::issue<false, false>(P, sQ, sK, L.wn);
      wg::issue<true, true>(Ks, sK, sK, L.wn);  // (unconditional: one asynchronous stage)
      wg::commit();
      fwd_phase1_rows(P, sRow, sK, sQ, mcur, mnext, sMq, L, tid);
      bsync(kBarA, NT);
      // phase 1b: mq per row, P' = P − mq/t on j ≤ i, mq/t² for B; then the chunk goes to B
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = L.row(2 * hh);
        const float rmq = sMq[i] + (sRow[i] + sRow[C + i]), inv = invv[i];
        const float o = cen ? rmq * inv : 0.f;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int j = L.col(nt, 0);
          const float v0 = j <= i ? P[nt][2 * hh] - o : 0.f, v1 = j + 1 <= i ? P[nt][2 * hh + 1] - o : 0.f;
          put2(sP, i, j, v0, v1);
        }
        if (L.wn == 0 && L.tig == 0) sMt(s)[i] = o * inv;
      }
      barrive(kBarFull + s, kWsThreads);
    }
    bsync(kBarA, NT);  // (m after the last chunk: written by other threads)
    if (p.Kout) frag_store_f(p.Kout + bh * D * D, Ks, L);
    if (p.mout && tid < C) p.mout[bh * D + tid] = sMb[(nc % 3) * C + tid];
  } else {  // ---- team B
    const Lane L(static_cast<int>(threadIdx.x >> 5) - 8);
    for (int ci = 0; ci < nc; ++ci) {
      const int it = ci, s = it & 1, t0 = ci * C, n = min(C, p.T - t0);
      const bf16 *sQ = sQb + (it % 3) * TILE, *sK = sKb + (it % 3) * TILE;
      const bf16 *sKs = sKsb + s * TILE, *sP = sPb + s * TILE;
      const float *mcur = sMb + (it % 3) * C, *lamv = sLam(s), *invv = sInv(s), *mtv = sMt(s);
      bsync(kBarFull + s, kWsThreads);
      // R = Q K_prev + P' K; q_c = q − λ r, r = R/t − m_prev mq/t²
      Acc R;
      zero(R);
      mm2<false, false, false, true>(R, sQ, sKs, R, sP, sK, L);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = L.row(2 * hh);
        if (i >= n) continue;
        const float inv = invv[i], lam = lamv[i], mt = mtv[i];
        bf16* dst = p.qc + qrow(p, b, t0 + i, h);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int a = L.col(nt, 0);
          const float2 m = *reinterpret_cast<const float2*>(mcur + a);
          const float2 q = bf2(sQ, i, a);
          const float r0 = R[nt][2 * hh] * inv - m.x * mt, r1 = R[nt][2 * hh + 1] * inv - m.y * mt;
          *reinterpret_cast<uint32_t*>(dst + a) = pack(q.x - lam * r0, q.y - lam * r1);
        }
      }
      if (it + 2 < nc) barrive(kBarEmpty + s, kWsThreads);  // (A waits for it two chunks on)
    }
  }
}

// ---------------------------------------------------------------- host side
// DeltaShape::kernels (the run's cuda.ccq_group, cuda.ccq_fwd and cuda.ccq_bwd) may force the
// chunks per group of the chunk-parallel passes (1–64) and the kernels of each pass
// (chunk-parallel or warp-specialised; automatic: use_ws); anything else is an error.
// Group size by default: the fewest chunks per group (at least kMinGroup) that still fit the B·H·ng CTAs of
// the main kernels in one wave at 2 CTAs per SM: a CTA walks its group's chunks one after the
// other, so at small B·H (the paper's layer, B=1 H=32: 8 chunks, 256 CTAs) shorter groups
// shorten the chain; at larger B·H the groups get longer instead of adding waves.
int group_chunks(const QParams& p, int forced) {
  if (forced == 0) {
    const long slots = 2L * sm_count(), heads = static_cast<long>(p.B) * p.H;
    int g = kMinGroup;
    while (g < 64 && heads * ((p.nc + g - 1) / g) > slots) g *= 2;
    return g;
  }
  if (forced < 1 || forced > 64)
    throw RuntimeError("CCQ: " + std::to_string(forced) + " chunks per group (cuda.ccq_group): expected 1 to 64");
  return forced;
}
// auto: a warp-specialised kernel runs one CTA per (b, h) on its own SM, so its time is
// ⌈B·H / SMs⌉ waves of a whole sequence; the chunk-parallel one spreads B·H·ng CTAs, 2 per SM,
// and its backward measured 1.45× the warp-specialised time per B·H/SMs (0.50 against 0.34 ms
// at B=8 T=4096 H=16 on 132 SMs; 0.25 against 0.35 at B=4). Take ws while its waves cost less.
bool use_ws(const QParams& p) {
  int dev = 0, sms = 0;
  LAR_CUDA_CHECK(cudaGetDevice(&dev));
  LAR_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const double heads = static_cast<double>(p.B) * p.H, waves = std::ceil(heads / sms);
  return waves < 1.4 * heads / sms;
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
  p.G = group_chunks(p, s.kernels.ccq_group);
  p.ng = (p.nc + p.G - 1) / p.G;
  return p;
}

// (kernels with shared memory get 1 KB more: their tiles start at the first 1024-byte boundary)
template <class K>
void qlaunch(K kernel, dim3 grid, size_t smem, const QParams& p, cudaStream_t stream, int threads = NT) {
  if (smem) smem += 1024;
  LAR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<grid, threads, smem, stream>>>(p);
  LAR_CUDA_LAUNCHED();
}

// The inputs both passes read (t0 checked).
void set_inputs(QParams& p, const CcqInputs& in, const char* what) {
  if (in.t0 < 0) throw RuntimeError(std::string(what) + ": negative t0 " + std::to_string(in.t0));
  p.q = in.q, p.k = in.k, p.lam = in.lambda, p.K0 = in.K0, p.m0 = in.m0, p.centered = in.centered ? 1 : 0;
  p.t0 = static_cast<double>(in.t0);
}

}  // namespace

void ccq_fwd(const DeltaShape& s, const CcqInputs& in, __nv_bfloat16* qc, const CcqStats& out, cudaStream_t stream) {
  QParams p = make_qparams(s, "ccq_fwd");
  const CcqPath path = s.kernels.ccq_fwd;
  if (!in.q || !in.k || !in.lambda || !qc) throw RuntimeError("ccq_fwd: q, k, lambda and qc are required");
  set_inputs(p, in, "ccq_fwd");
  p.qc = qc, p.Kout = out.K, p.mout = out.m;
  if (path == CcqPath::ws || (path == CcqPath::automatic && use_ws(p))) {
    qlaunch(ccq_fwd_ws_kernel, dim3(p.H, p.B), kQFwdWsSmem, p, stream, kWsThreads);
    return;
  }
  p.rec = kRecF;
  Scratch ws(stream);
  p.ws = ws.get<float>(static_cast<size_t>(p.B) * p.H * p.ng * p.rec);
  const dim3 groups(p.ng, p.H, p.B), slices(D / 8, p.H, p.B);
  qlaunch(ccq_stats_fwd_kernel, groups, kStatsFwdSmem, p, stream);
  qlaunch(ccq_scan_kernel<false>, slices, 0, p, stream);
  qlaunch(ccq_fwd_kernel, groups, kQFwdSmem, p, stream);
}

void ccq_bwd(const DeltaShape& s, const CcqInputs& in, const CcqStats& fin, const __nv_bfloat16* dqc,
             __nv_bfloat16* dq, __nv_bfloat16* dk, float* dlambda, cudaStream_t stream) {
  QParams p = make_qparams(s, "ccq_bwd");
  const CcqPath path = s.kernels.ccq_bwd;
  if (!in.q || !in.k || !in.lambda || !fin.K || !fin.m || !dqc || !dq || !dk || !dlambda)
    throw RuntimeError("ccq_bwd: q, k, lambda, the final statistics, dqc, dq, dk and dlambda are required");
  if (dq == dqc) throw RuntimeError("ccq_bwd: dq must not alias dqc");
  set_inputs(p, in, "ccq_bwd");
  p.dqc = dqc, p.dq = dq, p.dk = dk, p.dlam = dlambda;
  if (path == CcqPath::ws || (path == CcqPath::automatic && use_ws(p))) {  // from fin
    p.Kfin = fin.K, p.mfin = fin.m;
    qlaunch(ccq_bwd_ws_kernel, dim3(p.H, p.B), kQBwdWsSmem, p, stream, kWsThreads);
    return;
  }
  // chunk-parallel: the statistics at every group boundary are rebuilt from K0, m0 and the
  // keys (the scan below); fin is not read
  p.rec = kRecB;
  Scratch ws(stream);
  p.ws = ws.get<float>(static_cast<size_t>(p.B) * p.H * p.ng * p.rec);
  const dim3 groups(p.ng, p.H, p.B), slices(D / 8, p.H, p.B);
  qlaunch(ccq_stats_bwd_kernel, groups, kStatsBwdSmem, p, stream);
  qlaunch(ccq_scan_kernel<true>, slices, 0, p, stream);
  qlaunch(ccq_bwd_kernel, groups, kQBwdSmem, p, stream);
}

}  // namespace lar::kernels::cuda::linear
