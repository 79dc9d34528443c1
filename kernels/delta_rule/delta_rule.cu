// The chunkwise gated delta rule (gdn; deltanet with g = nullptr) forward, backward and decode.
// See delta_rule.hpp for the contract and kernels/linear/core.hpp for the math.
//
// Per chunk of n ≤ 64 tokens with start state S0 [dv×dk], G the in-chunk cumulative log-gate,
// M[t,j] = exp(G_t − G_j) (t ≥ j; every exponent ≤ 0), e = β k, z = β v:
//   Aw = (K Kᵀ ∘ M) strictly lower;  A = diag(β) Aw
//   X  = V − diag(e^G) K S0ᵀ;         (I + A) U = diag(β) X     (U = T⁻¹ β X, T = I + A)
//   P  = (Q Kᵀ ∘ M) lower;            O = scale (diag(e^G) Q S0ᵀ + P U)
//   S_end = e^{G_last} S0 + (diag(e^{G_last − G}) U)ᵀ K
// Padded rows of a partial last chunk load as zeros with g = β = 0, which makes every one of
// their contributions vanish (so no masks beyond the row guards on stores).
//
// Every product is a 64×64 (×64) GEMM: 8 warps, warp (wm, wn) owns rows 16·wm.., columns
// 32·wn.. of the output; operands are bf16 tiles in shared memory (row stride 72 elements,
// conflict-free ldmatrix), transposed operands through ldmatrix.trans. The fused forward runs
// two such 8-warp groups per CTA on different products (fwd_kernel). The fused kernels build T⁻¹
// per chunk on tensor cores and apply it by GEMM ("T⁻¹ on tensor cores"); so do the two-phase
// path's kernels (its prep kernel builds T⁻¹ once per chunk, the main kernels load it).
//
// Two implementations, chosen per pass from the shape (use_two_phase): the fused kernels (one
// CTA per (b, h) walks the chunks with the state in registers; best when B·H fills the GPU)
// and the two-phase path (chunk-parallel prep, a one-GEMM-per-chunk sequential state pass,
// chunk-parallel main kernels; for long sequences with few (b, h), e.g. B=1). Both write and
// read the same boundary states, so a forward of one kind feeds a backward of the other.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/env.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/delta_rule/delta_rule.hpp"
#include "kernels/linear/chunk_common.cuh"
#include "kernels/linear/scratch.hpp"

namespace lar::kernels::cuda::linear {
namespace {


struct Params {
  const bf16 *q, *k, *v, *dout;
  const float *g, *beta, *S0, *dST;
  bf16 *o, *bound, *dq, *dk, *dv;
  const bf16* bound_in;
  float *S_out, *dg, *dbeta, *dS0;
  // Chunk-parallel path (see "two-phase" below): per chunk M = Wᵀ diag(e^{G_last − G}) K (bf16),
  // the additive term E (fp32; forward: Ûᵀ K, backward: scale dOᵀ Q'), e^{G_last}, the
  // backward's end-of-chunk state gradients, and T⁻¹ (forward: hi and lo tiles; backward: hi).
  bf16 *Mc, *dSend, *Ti;
  float *Ec, *el;
  // LAR_DELTA_CLOCKS=1: CTA (0, 0) of a fused kernel writes {start ns, end ns, start cycle, end
  // cycle} to clk[4 · clk_slot] (the SM clock it ran at; see clock_report below). Else nullptr.
  unsigned long long* clk;
  int clk_slot;
  int B, T, H, nc;
  float scale;
};

// The fused kernels' clock probe (LAR_DELTA_CLOCKS): global time and SM cycles at the start and
// the end of CTA (0, 0), so that a run inside the training step tells its SM clock.
// The values go to global memory at once (nothing stays live in registers through the kernel).
__device__ __forceinline__ void clock_probe(const Params& p, int end) {
  if (!p.clk || blockIdx.x != 0 || blockIdx.y != 0 || threadIdx.x != 0) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  const unsigned long long c = clock64();
  unsigned long long* d = p.clk + 4 * p.clk_slot;
  d[end] = t, d[2 + end] = c;
}
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

// Rows t < n of a fragment, times f, into a [B,T,H,64] bf16 tensor from the chunk start t0.
__device__ __forceinline__ void store_rows(bf16* dst, const Params& p, int b, int h, int t0, int n, const Acc& a,
                                           float f, const Lane& L) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int t = L.row(2 * hh);
      if (t < n)
        *reinterpret_cast<uint32_t*>(dst + row_off(p, b, t0 + t, h) + L.col(nt, 0)) =
            pack(a[nt][2 * hh] * f, a[nt][2 * hh + 1] * f);
    }
}

// store_rows through shared memory: the warp's 16×32 block of the fragment, times f, into its
// block of the bf16 tile `stage` (which no other warp touches meanwhile), then out with 16-byte
// stores, each warp instruction writing 8 rows × 64 contiguous bytes (store_rows: 8 × 16 bytes,
// half sectors). stage == nullptr: store_rows.
__device__ __forceinline__ void stage_out(bf16* dst, const Params& p, int b, int h, int t0, int n, const bf16* stage,
                                          const Lane& L) {
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int k = L.lane + 32 * i, r = 16 * L.wm + (k >> 2), c = 32 * L.wn + 8 * (k & 3);
    const uint4 x = *reinterpret_cast<const uint4*>(stage + r * LD + c);
    if (r < n) *reinterpret_cast<uint4*>(dst + row_off(p, b, t0 + r, h) + c) = x;
  }
  __syncwarp();
}
__device__ __forceinline__ void store_rows_staged(bf16* dst, const Params& p, int b, int h, int t0, int n,
                                                  const Acc& a, float f, bf16* stage, const Lane& L) {
  if (!stage) {
    store_rows(dst, p, b, h, t0, n, a, f, L);
    return;
  }
  store_bf(stage, a, L, [f](float x, int, int) { return x * f; });
  stage_out(dst, p, b, h, t0, n, stage, L);
}
// 8 bf16 (16 bytes) times f.
__device__ __forceinline__ uint4 scale8(const uint4 x, float f) {
  const uint32_t in[4] = {x.x, x.y, x.z, x.w};
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&in[i]));
    out[i] = pack(v.x * f, v.y * f);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// This thread's values of a per-token [C] vector (gates, β) at its fragment rows L.row(0),
// L.row(2) and columns L.col(nt, 0..1), loaded once instead of once per element.
__device__ __forceinline__ void row_vals(const float* s, const Lane& L, float (&r)[2]) {
  r[0] = s[L.row(0)];
  r[1] = s[L.row(2)];
}
__device__ __forceinline__ void col_vals(const float* s, const Lane& L, float (&c)[4][2]) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const float2 x = *reinterpret_cast<const float2*>(s + L.col(nt, 0));
    c[nt][0] = x.x, c[nt][1] = x.y;
  }
}
// Two adjacent bf16 elements (r, c), (r, c + 1) of a tile (c even) as floats: one 32-bit load.
__device__ __forceinline__ float2 bf2(const bf16* s, int r, int c) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(s + r * LD + c));
}

// ---------------------------------------------------------------- chunk bodies
// The steps of one chunk that the fused kernels (one CTA walks all chunks of a (b, h)) and
// the two-phase path's chunk-parallel kernels share. Tiles are bf16 [64][LD], fp32 ones
// [64][LDF]; sG, sB the chunk's gates (publish_gates).

// Backward: dU = e^{G_last − G} K dSᵀ + scale Pᵀ dO into the bf16 tile sdU (dS: the chunk-end
// state gradient).
__device__ __forceinline__ void bwd_du(const bf16* K, const bf16* sdS, const bf16* sP, const bf16* sdO,
                                       const float* sG, float Gl, float scale, bf16* sdU, const Lane& L) {
  Acc a, c2;
  zero(a);
  zero(c2);
  gemm2<false, false, true, true>(a, K, sdS, c2, sP, sdO, L);  // K dSᵀ, Pᵀ dO
  float gr[2];
  row_vals(sG, L, gr);
  const float dl[2] = {__expf(Gl - gr[0]), __expf(Gl - gr[1])};
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[nt][e] = a[nt][e] * dl[e >> 1] + scale * c2[nt][e];
  store_bf(sdU, a, L, [](float x, int, int) { return x; });
}

// Backward: dKK = −(dR Uᵀ) ∘ β M and dQK = scale (dO Uᵀ) ∘ M (lower parts) into bf16 tiles,
// with their gate terms added to the row/column partial sums. pf: P in fp32 (registers).
// aw_at(nt, e) gives Aw at the fragment position (L.row(e), L.col(nt, e)); read below the diagonal only.
template <class AwAt>
__device__ __forceinline__ void bwd_dkk_dqk(const bf16* sdR, const bf16* sU, const bf16* sdO, const float* sG,
                                            const float* sB, AwAt aw_at, const Acc& pf, float scale,
                                            float (&rowB)[2], float (&rowG)[2], float (&colG)[4][2], bf16* sdKK,
                                            bf16* sdQK, const Lane& L) {
  Acc da, dp;
  zero(da);
  zero(dp);
  gemm2<false, false, false, false>(da, sdR, sU, dp, sdO, sU, L);  // dR Uᵀ, dO Uᵀ
  float gr[2], gc[4][2], br[2];
  row_vals(sG, L, gr);
  col_vals(sG, L, gc);
  row_vals(sB, L, br);
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = L.row(e), j = L.col(nt, e);
      const float m = t >= j ? __expf(gr[e >> 1] - gc[nt][e & 1]) : 0.f, bt = br[e >> 1];
      const float dA = t > j ? -da[nt][e] : 0.f;
      const float x = t > j ? dA * aw_at(nt, e) : 0.f;
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

// Backward: dq = dQK K + scale e^G dO S0 (stored), its gate term into rowG.
__device__ __forceinline__ void bwd_dq(const Params& p, const bf16* sdQK, const bf16* sK, const bf16* sdO,
                                       const bf16* sS0, const bf16* sQ, const float* sG, int b, int h, int t0,
                                       int n, float (&rowG)[2], const Lane& L, bf16* stage = nullptr) {
  Acc a, c2;
  zero(a);
  zero(c2);
  gemm2<false, true, false, true>(a, sdQK, sK, c2, sdO, sS0, L);  // dQK K, dO S0
  float gr[2];
  row_vals(sG, L, gr);
  const float eg[2] = {__expf(gr[0]), __expf(gr[1])};
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float2 q2 = bf2(sQ, L.row(2 * hh), L.col(nt, 0));
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        const int e = 2 * hh + e1;
        const float y = p.scale * eg[hh] * c2[nt][e];
        rowG[hh] += y * (e1 ? q2.y : q2.x);
        a[nt][e] += y;
      }
    }
  store_rows_staged(p.dq, p, b, h, t0, n, a, 1.f, stage, L);
}

// Backward: dk (stored) and its gate terms. kStateTerm: also add G_last's term of the state
// decay, e^{G_last} Σ dS ∘ S0 (the fused kernel adds it where it updates dS instead).
template <bool kStateTerm>
__device__ __forceinline__ void bwd_dk(const Params& p, const bf16* sdQK, const bf16* sQ, const bf16* sU,
                                       const bf16* sdS, const bf16* sdKK, const bf16* sK, const bf16* sdR,
                                       const bf16* sS0, const float* sG, const float* sB, float Gl, float el,
                                       int b, int h, int t0, int n, float& gl, float (&rowG)[2], float (&rowB)[2],
                                       const Lane& L, bf16* stage = nullptr) {
  Acc a, c2, c3;
  zero(a);
  zero(c2);
  zero(c3);
  gemm2<true, true, false, true>(a, sdQK, sQ, c2, sU, sdS, L);   // dQKᵀ Q, U dS (dK̂)
  gemm2<false, true, false, true>(a, sdKK, sK, c3, sdR, sS0, L);  // dKK K, dR S0
  gemm<true, true>(a, sdKK, sK, L);                               // dKKᵀ K
  float gr[2], br[2];
  row_vals(sG, L, gr);
  row_vals(sB, L, br);
  const float dl[2] = {__expf(Gl - gr[0]), __expf(Gl - gr[1])}, eg[2] = {__expf(gr[0]), __expf(gr[1])};
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int t = L.row(2 * hh), c = L.col(nt, 0);
      const float2 k2 = bf2(sK, t, c);
      float2 ds2 = make_float2(0.f, 0.f), s02 = ds2;
      if (kStateTerm) ds2 = bf2(sdS, t, c), s02 = bf2(sS0, t, c);
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        const int e = 2 * hh + e1;
        const float kk = e1 ? k2.y : k2.x, bt = br[hh];
        const float x = dl[hh] * c2[nt][e] * kk;
        const float y = -eg[hh] * c3[nt][e];
        // (t, c) also runs over the state's (v, c)
        gl += kStateTerm ? x + el * (e1 ? ds2.y : ds2.x) * (e1 ? s02.y : s02.x) : x;
        rowG[hh] += bt * y * kk - x;
        rowB[hh] += y * kk;
        a[nt][e] += dl[hh] * c2[nt][e] + bt * y;
      }
    }
  store_rows_staged(p.dk, p, b, h, t0, n, a, 1.f, stage, L);
}

// The gate gradients' partial sums into shared memory, one slot per owner (no atomics, so
// the sums below are deterministic): rows per wn (sRowG, sRowB [2][C]), columns per wm
// (sColG [4][C]), G_last's per warp (sGl [8]).
__device__ __forceinline__ void bwd_publish_partials(const float (&rowG)[2], const float (&rowB)[2],
                                                     const float (&colG)[4][2], float gl, float* sRowG,
                                                     float* sRowB, float* sColG, float* sGl, const Lane& L) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float rg = rowG[hh], rb = rowB[hh];
    rg = quad_sum(rg);
    rb = quad_sum(rb);
    if (L.tig == 0) {
      sRowG[L.wn * C + L.row(2 * hh)] = rg;
      sRowB[L.wn * C + L.row(2 * hh)] = rb;
    }
  }
  store_col_sums(colG, sColG, L);
#pragma unroll
  for (int o = 16; o; o >>= 1) gl += __shfl_xor_sync(FULL, gl, o);
  if (L.lane == 0) sGl[threadIdx.x >> 5] = gl;
}

// Warp 0, after a barrier behind bwd_publish_partials: dg (the reverse cumsum of dG within
// the chunk: g_t enters every G_s, s ≥ t) and dβ of the chunk's rows. sPartB: nullable
// [8][C] further per-warp dβ partials.
__device__ __forceinline__ void bwd_write_dg_dbeta(const Params& p, const float* sRowG, const float* sRowB,
                                                   const float* sColG, const float* sGl, const float* sPartB,
                                                   int b, int h, int t0, int n, const Lane& L) {
  float d[2], bsum[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int t = 2 * L.lane + q;
    d[q] = sRowG[t] + sRowG[C + t] + sColG[t] + sColG[C + t] + sColG[2 * C + t] + sColG[3 * C + t];
    bsum[q] = sRowB[t] + sRowB[C + t];
    if (sPartB)
      for (int w = 0; w < 8; ++w) bsum[q] += sPartB[w * C + t];
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

// ---------------------------------------------------------------- T⁻¹ on tensor cores
// The fused kernels' triangular solves (U = T⁻¹ diag(β) X, and the backward's dR = T⁻ᵀ dU, with
// T = I + diag(β) Aw) as GEMMs with T⁻¹ built once per chunk: the 16×16 diagonal blocks are
// inverted by substitution (one warp each), the blocks below them merged with mma (fla's
// structure). A product that must stay fp32-accurate takes its operands split into bf16 hi + lo
// (x ≈ hi + lo to ≈ 2⁻¹⁶ relative) and sums hi·hi + hi·lo + lo·hi in fp32: the merge always, the
// forward's U = T⁻¹ β X too (o within 5e-3 needs it); the backward applies T⁻¹ from bf16 (hi)
// operands, which the gradients' 1e-2 allows (H200: ≤ 4.5e-3 vs ≤ 3.9e-3 split, 3% faster).
__device__ __forceinline__ void split_bf(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  const float2 f = __bfloat1622float2(h);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = pack(x - f.x, y - f.y);
}
// Fragment → hi and lo bf16 tiles (f(value, row, col) gives the stored value).
template <class F>
__device__ __forceinline__ void store_split(bf16* H, bf16* Lo, const Acc& c, const Lane& L, F f) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = L.row(2 * h), cc = L.col(nt, 0);
      uint32_t hi, lo;
      split_bf(f(c[nt][2 * h], r, cc), f(c[nt][2 * h + 1], r, cc + 1), hi, lo);
      *reinterpret_cast<uint32_t*>(H + r * LD + cc) = hi;
      *reinterpret_cast<uint32_t*>(Lo + r * LD + cc) = lo;
    }
}
// ldmatrix addresses of gemm's operand fragments (k-step kk; B's 16 columns from n0).
template <bool A_KM>
__device__ __forceinline__ const bf16* a_frag_addr(const bf16* A, int wm, int kk, int lane) {
  return A_KM ? A + (16 * kk + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * wm + ((lane >> 3) & 1) * 8
              : A + (16 * wm + (lane & 15)) * LD + 16 * kk + (lane >> 4) * 8;
}
template <bool B_KN>
__device__ __forceinline__ const bf16* b_frag_addr(const bf16* B, int n0, int kk, int lane) {
  return B_KN ? B + (16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3)) * LD + n0 + (lane >> 4) * 8
              : B + (n0 + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * kk + ((lane >> 3) & 1) * 8;
}
template <bool TRANS>
__device__ __forceinline__ void ldsm(uint32_t (&r)[4], const bf16* p) {
  if (TRANS)
    ldsm_x4_t(r, p);
  else
    ldsm_x4(r, p);
}
// c += A·B like gemm, A and B given as hi/lo tile pairs (kSplit: Ah·Bh + Ah·Bl + Al·Bh; else
// Ah·Bh), over the k-steps k_lo ≤ kk ≤ k_hi only (the other blocks of a triangular operand are 0).
template <bool A_KM, bool B_KN, bool kSplit>
__device__ __forceinline__ void gemm_split(Acc& c, const bf16* Ah, const bf16* Al, const bf16* Bh, const bf16* Bl,
                                           const Lane& L, int k_lo, int k_hi) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    if (kk < k_lo || kk > k_hi) continue;  // warp-uniform
    uint32_t ah[4], al[4];
    ldsm<A_KM>(ah, a_frag_addr<A_KM>(Ah, L.wm, kk, L.lane));
    if (kSplit) ldsm<A_KM>(al, a_frag_addr<A_KM>(Al, L.wm, kk, L.lane));
#pragma unroll
    for (int nn = 0; nn < 2; ++nn) {
      const int n0 = 32 * L.wn + 16 * nn;
      uint32_t bh[4], bl[4];
      ldsm<B_KN>(bh, b_frag_addr<B_KN>(Bh, n0, kk, L.lane));
      mma(c[2 * nn], ah, bh[0], bh[1]);
      mma(c[2 * nn + 1], ah, bh[2], bh[3]);
      if (kSplit) {
        ldsm<B_KN>(bl, b_frag_addr<B_KN>(Bl, n0, kk, L.lane));
        mma(c[2 * nn], ah, bl[0], bl[1]);
        mma(c[2 * nn + 1], ah, bl[2], bl[3]);
        mma(c[2 * nn], al, bh[0], bh[1]);
        mma(c[2 * nn + 1], al, bh[2], bh[3]);
      }
    }
  }
}
// Diagonal block i of T⁻¹ = (I + diag(β) Aw)⁻¹ (16×16, unit lower) by forward substitution,
// one warp: lane c < 16 solves column c (lanes 16..31 repeat it); hi/lo into TiH/TiL, zeros
// above the diagonal included. The Aw reads are the same address across the warp (broadcast).
__device__ __forceinline__ void diag_inverse16(const float* sAw, const float* sB, bf16* TiH, bf16* TiL, int i,
                                               int lane) {
  const int r0 = 16 * i, c = lane & 15;
  float x[16];
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    float s = 0.f;
#pragma unroll
    for (int kq = 0; kq < (r + 3) / 4; ++kq) {
      const float4 a = *reinterpret_cast<const float4*>(sAw + (r0 + r) * LDF + r0 + 4 * kq);
      const float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (4 * kq + j < r) s = fmaf(av[j], x[4 * kq + j], s);
    }
    x[r] = (r == c ? 1.f : 0.f) - sB[r0 + r] * s;
  }
  if (lane < 16)
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const bf16 h = __float2bfloat16(x[r]);
      TiH[(r0 + r) * LD + r0 + c] = h;
      TiL[(r0 + r) * LD + r0 + c] = __float2bfloat16(x[r] - __bfloat162float(h));
    }
}
// Block row I (1..3) of T⁻¹ below the diagonal, by warp I, after every diagonal block is in
// TiH/TiL: with Y = −Ti_II L_I,<I (L = diag(β) Aw), Ti_Ij = Σ_{k=j}^{I−1} Y_Ik Ti_kj for
// j = I−1 down to 0 (step s = I − j). Step s needs Ti_kj of rows k < I from steps < s of the
// warps below, so a named barrier among the warps still merging separates the steps (warp s
// arrives after its last step; warps > s wait). Warps 1..3 of their group must be warps 1..3
// of a 4-aligned set (the barrier counts whole warps).
template <int I>
__device__ __forceinline__ void merge_row(const float* sAw, const float* sB, bf16* TiH, bf16* TiL, int lane,
                                          int bar0) {
  const int g = lane >> 2, tig = lane & 3, r0 = 16 * I;
  uint32_t ah[4], al[4];
  ldsm_x4(ah, TiH + (r0 + (lane & 15)) * LD + r0 + (lane >> 4) * 8);
  ldsm_x4(al, TiL + (r0 + (lane & 15)) * LD + r0 + (lane >> 4) * 8);
  const float b0 = sB[r0 + 2 * tig], b1 = sB[r0 + 2 * tig + 1], b8 = sB[r0 + 2 * tig + 8], b9 = sB[r0 + 2 * tig + 9];
  float y[2 * I][4];
#pragma unroll
  for (int nt = 0; nt < 2 * I; ++nt) {
    const int n = 8 * nt + g;
    y[nt][0] = y[nt][1] = y[nt][2] = y[nt][3] = 0.f;
    uint32_t bh0, bl0, bh1, bl1;  // B[k][n] = L[r0 + k][n]: k = 2tig, 2tig+1 | 2tig+8, 2tig+9
    split_bf(b0 * sAw[(r0 + 2 * tig) * LDF + n], b1 * sAw[(r0 + 2 * tig + 1) * LDF + n], bh0, bl0);
    split_bf(b8 * sAw[(r0 + 2 * tig + 8) * LDF + n], b9 * sAw[(r0 + 2 * tig + 9) * LDF + n], bh1, bl1);
    mma(y[nt], ah, bh0, bh1);
    mma(y[nt], ah, bl0, bl1);
    mma(y[nt], al, bh0, bh1);
  }
  uint32_t yh[I][4], yl[I][4];  // −Y as A fragments, k-block kb = n-tiles 2kb, 2kb+1
#pragma unroll
  for (int kb = 0; kb < I; ++kb) {
    split_bf(-y[2 * kb][0], -y[2 * kb][1], yh[kb][0], yl[kb][0]);
    split_bf(-y[2 * kb][2], -y[2 * kb][3], yh[kb][1], yl[kb][1]);
    split_bf(-y[2 * kb + 1][0], -y[2 * kb + 1][1], yh[kb][2], yl[kb][2]);
    split_bf(-y[2 * kb + 1][2], -y[2 * kb + 1][3], yh[kb][3], yl[kb][3]);
  }
#pragma unroll
  for (int s = 1; s <= I; ++s) {
    const int j = I - s;
    float o[2][4] = {};
#pragma unroll
    for (int kb = j; kb < I; ++kb) {
      uint32_t bh[4], bl[4];
      const int off = (16 * kb + (lane & 7) + (((lane >> 3) & 1) << 3)) * LD + 16 * j + (lane >> 4) * 8;
      ldsm_x4_t(bh, TiH + off);
      ldsm_x4_t(bl, TiL + off);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mma(o[h], yh[kb], bh[2 * h], bh[2 * h + 1]);
        mma(o[h], yh[kb], bl[2 * h], bl[2 * h + 1]);
        mma(o[h], yl[kb], bh[2 * h], bh[2 * h + 1]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = r0 + g + 8 * hh, cc = 16 * j + 8 * h + 2 * tig;
        uint32_t hi, lo;
        split_bf(o[h][2 * hh], o[h][2 * hh + 1], hi, lo);
        *reinterpret_cast<uint32_t*>(TiH + r * LD + cc) = hi;
        *reinterpret_cast<uint32_t*>(TiL + r * LD + cc) = lo;
      }
    if (s < 3) {
      if (I > s)
        bar_sync(bar0 + s - 1, 32 * (4 - s));
      else
        bar_arrive(bar0 + s - 1, 32 * (4 - s));
    }
  }
}

// ---------------------------------------------------------------- forward
constexpr int NT2 = 2 * NT;

// Barrier of group B (warps 8..15; id 2, 256 threads; 0 is __syncthreads).
__device__ __forceinline__ void group_b_sync() { asm volatile("bar.sync 2, %0;\n" ::"n"(NT) : "memory"); }

// load_tile by group B (threads 256..511) alone: two 16-byte pieces each.
__device__ __forceinline__ void load_tile_b(bf16* s, const bf16* gsrc, size_t stride, int n) {
#pragma unroll
  for (int i = threadIdx.x - NT; i < C * 8; i += NT) {
    const int r = i >> 3, c = i & 7;
    const bool ok = r < n;
    cp_async16(s + r * LD + c * 8, ok ? gsrc + r * stride + c * 8 : gsrc, ok);
  }
}

// One CTA of two 8-warp groups (512 threads, ≤ 128 registers) per (b, h), software-pipelined
// across chunks. The state-independent terms of the NEXT chunk (P, Aw and T⁻¹ need only its q, k
// and gates) are built by group A while group B runs this chunk, so B's chain per chunk is three
// GEMMs:
//   phase 1  A: o = e^G Q S0ᵀ;                          B: X = V − e^G K S0ᵀ → β X (hi/lo),
//              P, Aw, T⁻¹ of chunk c+1                      U = T⁻¹ β X, Û = e^{G_last − G} U;
//                                                           the start state out, loads of c+2
//   phase 2  A: o += P U, stored                        B: S ← e^{G_last} S + Ûᵀ K
// Group A is the longer path in both phases (phase marks on the H200), so group B also writes
// the boundary states and issues the loads. q, k, v are loaded two chunks ahead (3 buffers), the
// gates published one chunk ahead (2 slots), P and T⁻¹ double-buffered. Barrier ids: 2 group B,
// 3 group A, 4–5 the merge (group A's warps 1..3).
constexpr size_t kFwdSmem = 20 * TILE * sizeof(bf16) + (TILEF + 4 * C) * sizeof(float);

__device__ __forceinline__ void group_a_sync() { asm volatile("bar.sync 3, %0;\n" ::"n"(NT) : "memory"); }

__global__ void __launch_bounds__(NT2, 1) fwd_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // [3] each
  bf16* sK = sQ + 3 * TILE;
  bf16* sV = sK + 3 * TILE;
  bf16* sS = sV + 3 * TILE;
  bf16* sU = sS + TILE;
  bf16* sUh = sU + TILE;
  bf16* sP = sUh + TILE;    // [2]
  bf16* sTiH = sP + 2 * TILE;  // [2]
  bf16* sTiL = sTiH + 2 * TILE;  // [2]
  bf16* sXH = sTiL + 2 * TILE;
  bf16* sXL = sXH + TILE;
  float* sAw = reinterpret_cast<float*>(sXL + TILE);  // group A only
  float* sG = sAw + TILEF;  // [2][C]
  float* sB = sG + 2 * C;   // [2][C]
  const int tid = threadIdx.x, warp = tid >> 5;
  const bool grpA = warp < 8;
  const Lane L(warp & 7);
  const int h = blockIdx.x, b = blockIdx.y;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  clock_probe(p, 0);

  Acc keep;  // group A: the output accumulator; group B: the state
  if (!grpA) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        keep[nt][e] = p.S0 ? p.S0[bh * D * D + L.row(e) * D + L.col(nt, e)] : 0.f;
    store_bf(sS, keep, L, [](float x, int, int) { return x; });
  } else {
    for (int i = tid; i < 2 * C * C; i += NT) {  // T⁻¹'s blocks above the diagonal stay 0
      const int s = i >> 12, r = (i >> 6) & 63, c = i & 63;
      if ((c >> 4) > (r >> 4)) sTiH[s * TILE + r * LD + c] = sTiL[s * TILE + r * LD + c] = __float2bfloat16(0.f);
    }
  }
  auto prefetch = [&](int ci) {
    if (ci < p.nc && !grpA) {
      const int t0 = ci * C, n = min(C, p.T - t0), buf = ci % 3;
      load_tile_b(sQ + buf * TILE, p.q + row_off(p, b, t0, h), stride, n);
      load_tile_b(sK + buf * TILE, p.k + row_off(p, b, t0, h), stride, n);
      load_tile_b(sV + buf * TILE, p.v + row_off(p, b, t0, h), stride, n);
    }
    cp_async_commit();
  };
  auto gates = [&](int ci) { return fetch_gates(p, b, h, ci * C, min(C, p.T - ci * C)); };
  // Group A: P, Aw and T⁻¹ of chunk ci (its tiles and gates in place).
  // own(): work to run where the warp has slack — before the group barrier by the warps that
  // invert no diagonal block, after it by the others (warp 1 after its one-step merge). The
  // callers pass none (o's Q S0ᵀ runs before it, q_s0).
  auto local_terms = [&](int ci, auto&& own) {
    const bf16 *Q = sQ + (ci % 3) * TILE, *K = sK + (ci % 3) * TILE;
    const float *G = sG + (ci & 1) * C, *Bt = sB + (ci & 1) * C;
    bf16 *TiH = sTiH + (ci & 1) * TILE, *TiL = sTiL + (ci & 1) * TILE;
    Acc a, a2;
    zero(a);
    zero(a2);
    gemm2<false, false, false, false>(a, Q, K, a2, K, K, L);  // Q Kᵀ, K Kᵀ
    float gr[2], gc[4][2];
    row_vals(G, L, gr);
    col_vals(G, L, gc);
    bf16* P = sP + (ci & 1) * TILE;
    // M = e^{G_t − G_j} once for both: P (lower, bf16) and Aw (strictly lower, fp32)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = L.row(2 * hh), j = L.col(nt, 0);
        float pv[2], aw[2];
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int e = 2 * hh + e1;
          const float m = t >= j + e1 ? __expf(gr[hh] - gc[nt][e1]) : 0.f;
          pv[e1] = t >= j + e1 ? a[nt][e] * m : 0.f;
          aw[e1] = t > j + e1 ? a2[nt][e] * m : 0.f;
        }
        *reinterpret_cast<uint32_t*>(P + t * LD + j) = pack(pv[0], pv[1]);
        *reinterpret_cast<float2*>(sAw + t * LDF + j) = make_float2(aw[0], aw[1]);
      }
    const bool diag = L.wn == (L.wm >> 1);  // this warp holds the diagonal block wm of Aw
    if (diag) {
      __syncwarp();
      diag_inverse16(sAw, Bt, TiH, TiL, L.wm, L.lane);
    } else {
      own();
    }
    group_a_sync();
    if (warp == 1) merge_row<1>(sAw, Bt, TiH, TiL, L.lane, 4);
    if (warp == 2) merge_row<2>(sAw, Bt, TiH, TiL, L.lane, 4);
    if (warp == 3) merge_row<3>(sAw, Bt, TiH, TiL, L.lane, 4);
    if (diag) own();
  };
  prefetch(0);
  prefetch(1);
  GateRegs gr = gates(0);
  publish_gates(gr, sG, sB);
  if (p.nc > 1) gr = gates(1);
  cp_async_wait<1>();
  __syncthreads();
  if (grpA) local_terms(0, [] {});

  for (int ci = 0; ci < p.nc; ++ci) {
    const int t0 = ci * C, n = min(C, p.T - t0), buf = ci % 3, sl = ci & 1;
    if (ci + 1 < p.nc) publish_gates(gr, sG + (sl ^ 1) * C, sB + (sl ^ 1) * C);
    if (ci + 2 < p.nc) gr = gates(ci + 2);
    cp_async_wait<0>();  // chunk ci+1's tiles (group B issued them during chunk ci−1)
    __syncthreads();  // (A) chunk ci+1's tiles and gates, chunk ci's P and T⁻¹, the bf16 state
    const bf16 *Q = sQ + buf * TILE, *K = sK + buf * TILE, *V = sV + buf * TILE;
    const float *G = sG + sl * C, *Bt = sB + sl * C;
    const float Gl = G[C - 1];
    if (grpA) {
      auto q_s0 = [&] {
        zero(keep);
        gemm<false, false>(keep, Q, sS, L);  // Q S0ᵀ
        float gr[2];
        row_vals(G, L, gr);
        const float eg[2] = {__expf(gr[0]), __expf(gr[1])};
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) keep[nt][e] *= eg[e >> 1];
      };
      q_s0();
      if (ci + 1 < p.nc) local_terms(ci + 1, [] {});
    } else {
      Acc x;
      zero(x);
      float gr[2], br[2];
      row_vals(G, L, gr);
      row_vals(Bt, L, br);
      const float eg[2] = {__expf(gr[0]), __expf(gr[1])}, dl[2] = {__expf(Gl - gr[0]), __expf(Gl - gr[1])};
      gemm<false, false>(x, K, sS, L);  // K S0ᵀ
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = L.row(2 * hh), c = L.col(nt, 0);
          const float2 v2 = bf2(V, t, c);
          uint32_t hi, lo;
          split_bf(br[hh] * (v2.x - eg[hh] * x[nt][2 * hh]), br[hh] * (v2.y - eg[hh] * x[nt][2 * hh + 1]), hi, lo);
          *reinterpret_cast<uint32_t*>(sXH + t * LD + c) = hi;
          *reinterpret_cast<uint32_t*>(sXL + t * LD + c) = lo;
        }
      group_b_sync();
      zero(x);
      gemm_split<false, true, true>(x, sTiH + sl * TILE, sTiL + sl * TILE, sXH, sXL, L, 0, L.wm);  // U = T⁻¹ β X
      store_bf(sU, x, L, [](float v, int, int) { return v; });
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = L.row(2 * hh), c = L.col(nt, 0);
          *reinterpret_cast<uint32_t*>(sUh + t * LD + c) = pack(x[nt][2 * hh] * dl[hh], x[nt][2 * hh + 1] * dl[hh]);
        }
      // Group B waits for group A's T⁻¹ merge at (C) anyway: the chunk's start state out for the
      // backward, and chunk ci+2's tiles into buffer (ci+2) % 3 = (ci−1) % 3 (last read in chunk
      // ci−1, before this chunk's (A)).
      if (p.bound) {
        bf16* dst = p.bound + (bh * p.nc + ci) * D * D;
        for (int i = tid - NT; i < D * 8; i += NT) {
          const int r = i >> 3, c = i & 7;
          *reinterpret_cast<uint4*>(dst + r * D + c * 8) = *reinterpret_cast<const uint4*>(sS + r * LD + c * 8);
        }
      }
      prefetch(ci + 2);
    }
    __syncthreads();  // (C)
    if (grpA) {
      gemm<false, true>(keep, sP + sl * TILE, sU, L);  // + P U
      // out through the Aw tile (group A's, read only before (C)) as bf16
      store_rows_staged(p.o, p, b, h, t0, n, keep, p.scale, reinterpret_cast<bf16*>(sAw), L);
    } else {
      const float el = __expf(Gl);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) keep[nt][e] *= el;
      gemm<true, true>(keep, sUh, K, L);  // + Ûᵀ K
      group_b_sync();  // every group-B read of K (and of βX) is done before a group-B thread refills it
      // Every read of sS (phase 1) is behind barrier (C); the next chunk's (A) publishes it.
      store_bf(sS, keep, L, [](float x, int, int) { return x; });
    }
  }
  cp_async_wait<0>();
  if (p.S_out && !grpA)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) p.S_out[bh * D * D + L.row(e) * D + L.col(nt, e)] = keep[nt][e];
  clock_probe(p, 1);
}

// ---------------------------------------------------------------- backward
// One CTA of 8 warps per (b, h) walks the chunks from the last, with the state gradient dS in
// registers and the next chunk's tiles loading (cp.async) while this one computes. Per chunk:
//   P0  tiles in
//   A   K Kᵀ → Aw (fp32), Q Kᵀ → P; the 4 warps owning a diagonal block of Aw invert it;
//       X = V − e^G K S0ᵀ → β X (bf16)
//   P1  B   warps 1..3 merge T⁻¹'s blocks below the diagonal, the other 5 build Q̃, K̃; every warp:
//           dU = e^{G_last − G} K dSᵀ + scale Pᵀ dO (bf16)
//   P2  C   U = T⁻¹ β X (bf16 tile), dR = T⁻ᵀ dU (dv and dβ's v-term from its registers)
//   P3  dKK, dQK;  P4  dq, dk, the dS update (into the other dS slot), the gate partial sums.
// dg and dβ of a chunk are written from its partial sums by warp 1 during the next chunk's P1
// (off the critical path; the partials are rewritten only after P3): 6 barriers per chunk.
// Shared memory: 2×(Q K V dO S0), 2×dS, P U dR dQK dKK Q̃ K̃ T⁻¹(hi, lo) βX (bf16; dU in dQK's
// tile), Aw (fp32), G, β, partial sums.
constexpr size_t kBwdSmem = 22 * TILE * sizeof(bf16) + (TILEF + 10 * C + 8) * sizeof(float);
static_assert(kBwdSmem <= 227 * 1024, "fused backward: one CTA per SM");

__global__ void __launch_bounds__(NT, 1) bwd_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sIn = reinterpret_cast<bf16*>(smem);  // [2][5] tiles: Q K V dO S0 of chunks with parity 0, 1
  bf16* sdS2 = sIn + 10 * TILE;  // [2]: the gradient at the end of chunk ci in slot ci & 1
  bf16* sP = sdS2 + 2 * TILE;
  bf16* sU = sP + TILE;
  bf16* sdR = sU + TILE;
  bf16* sdQK = sdR + TILE;
  bf16* sdKK = sdQK + TILE;
  bf16* sQt = sdKK + TILE;
  bf16* sKt = sQt + TILE;
  bf16* sTiH = sKt + TILE;
  bf16* sTiL = sTiH + TILE;
  bf16* sX = sTiL + TILE;  // β X
  bf16* sdU = sdQK;        // dU lives from phase B to C; dQK is written after P3
  float* sAw = reinterpret_cast<float*>(sX + TILE);
  float* sG = sAw + TILEF;
  float* sB = sG + C;
  float* sRowG = sB + C;         // [2][C] per wn
  float* sRowB = sRowG + 2 * C;  // [2][C]
  float* sColG = sRowB + 2 * C;  // [4][C] per wm
  float* sGl = sColG + 4 * C;    // [8] per warp
  const Lane L;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, warp = tid >> 5;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  const float scale = p.scale;
  clock_probe(p, 0);

  Acc dS;  // gradient on the state at the end of the current chunk, rows v, columns c
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dS[nt][e] = p.dST ? p.dST[bh * D * D + L.row(e) * D + L.col(nt, e)] : 0.f;
  store_bf(sdS2 + ((p.nc - 1) & 1) * TILE, dS, L, [](float x, int, int) { return x; });
  // T⁻¹'s blocks above the diagonal stay 0 (the GEMMs skip them; zeroed for safety)
  for (int i = tid; i < C * C; i += NT) {
    const int r = i >> 6, c = i & 63;
    if ((c >> 4) > (r >> 4)) sTiH[r * LD + c] = sTiL[r * LD + c] = __float2bfloat16(0.f);
  }

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
    const bf16* sdS = sdS2 + (ci & 1) * TILE;
    const float Gl = sG[C - 1], el = __expf(Gl);
    float rowG[2] = {0.f, 0.f}, rowB[2] = {0.f, 0.f}, colG[4][2] = {}, gl = 0.f;
    Acc pf;  // P in fp32 (for dG)
    {
      // this thread's gates at its fragment rows and columns
      float gr[2], gc[4][2], br[2];
      row_vals(sG, L, gr);
      col_vals(sG, L, gc);
      row_vals(sB, L, br);
      Acc a;
      zero(a);
      zero(pf);
      gemm2<false, false, false, false>(a, sK, sK, pf, sQ, sK, L);  // K Kᵀ, Q Kᵀ
      // M = e^{G_t − G_j} once for both: Aw (strictly lower, fp32 tile) and P (lower)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = L.row(2 * hh), j = L.col(nt, 0);
          float aw[2];
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            const int e = 2 * hh + e1;
            const float m = t >= j + e1 ? __expf(gr[hh] - gc[nt][e1]) : 0.f;
            aw[e1] = t > j + e1 ? a[nt][e] * m : 0.f;
            pf[nt][e] *= m;
          }
          *reinterpret_cast<float2*>(sAw + t * LDF + j) = make_float2(aw[0], aw[1]);
        }
      store_bf(sP, pf, L, [](float x, int, int) { return x; });
      if (L.wn == (L.wm >> 1)) {  // this warp holds the diagonal block wm of Aw
        __syncwarp();
        diag_inverse16(sAw, sB, sTiH, sTiL, L.wm, L.lane);
      }
      zero(a);
      gemm<false, false>(a, sK, sS0, L);  // K S0ᵀ
      const float eg[2] = {__expf(gr[0]), __expf(gr[1])};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = L.row(2 * hh), c = L.col(nt, 0);
          const float2 v2 = bf2(sV, t, c);
          *reinterpret_cast<uint32_t*>(sX + t * LD + c) =
              pack(br[hh] * (v2.x - eg[hh] * a[nt][2 * hh]), br[hh] * (v2.y - eg[hh] * a[nt][2 * hh + 1]));
        }
    }
    __syncthreads();  // P1
    if (warp == 1) {
      merge_row<1>(sAw, sB, sTiH, sTiL, L.lane, 1);
      // dg, dβ of the previous chunk (ci + 1) from its partial sums (warp 1's merge is one step:
      // the most slack in this phase, H200 phase marks)
      if (ci + 1 < p.nc) bwd_write_dg_dbeta(p, sRowG, sRowB, sColG, sGl, nullptr, b, h, t0 + C, min(C, p.T - t0 - C), L);
    }
    if (warp == 2) merge_row<2>(sAw, sB, sTiH, sTiL, L.lane, 1);
    if (warp == 3) merge_row<3>(sAw, sB, sTiH, sTiL, L.lane, 1);
    if (warp == 0 || warp >= 4) {
      // Q̃ = e^G q, K̃ = β e^G k (operands of the dS update, read after P3), by the 5 warps that
      // do not merge T⁻¹'s blocks meanwhile
      for (int i = (warp ? warp - 3 : 0) * 32 + L.lane; i < 2 * C * 8; i += 5 * 32) {  // 16 bytes each
        const int kt = i >> 9, t = (i >> 3) & (C - 1), c = (i & 7) * 8;
        const float eg = __expf(sG[t]), f = kt ? sB[t] * eg : eg;
        *reinterpret_cast<uint4*>((kt ? sKt : sQt) + t * LD + c) =
            scale8(*reinterpret_cast<const uint4*>((kt ? sK : sQ) + t * LD + c), f);
      }
    }
    bwd_du(sK, sdS, sP, sdO, sG, Gl, scale, sdU, L);
    __syncthreads();  // P2
    {
      Acc u, r;
      zero(u);
      zero(r);
      gemm_split<false, true, false>(u, sTiH, nullptr, sX, nullptr, L, 0, L.wm);    // T⁻¹ β X (lower: kk ≤ wm)
      gemm_split<true, true, false>(r, sTiH, nullptr, sdU, nullptr, L, L.wm, 3);  // T⁻ᵀ dU (upper: kk ≥ wm)
      store_bf(sU, u, L, [](float x, int, int) { return x; });
      store_bf(sdR, r, L, [](float x, int, int) { return x; });
      // dv = β dR, dβ += Σ dR·v
      float br[2];
      row_vals(sB, L, br);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = L.row(2 * hh), c = L.col(nt, 0);
          const float r0 = r[nt][2 * hh], r1 = r[nt][2 * hh + 1];
          const float2 v2 = bf2(sV, t, c);
          rowB[hh] += r0 * v2.x + r1 * v2.y;
          *reinterpret_cast<uint32_t*>(sdKK + t * LD + c) = pack(br[hh] * r0, br[hh] * r1);
        }
      stage_out(p.dv, p, b, h, t0, n, sdKK, L);  // through the dKK tile (written after P3)
    }
    __syncthreads();  // P3
    bwd_dkk_dqk(sdR, sU, sdO, sG, sB, [&](int nt, int e) { return sAw[L.row(e) * LDF + L.col(nt, e)]; }, pf, scale,
                rowB, rowG, colG, sdKK, sdQK, L);
    __syncthreads();  // P4
    // dq, dk go out through the P and βX tiles (dead since P1, P2)
    bwd_dq(p, sdQK, sK, sdO, sS0, sQ, sG, b, h, t0, n, rowG, L, sP);
    bwd_dk<false>(p, sdQK, sQ, sU, sdS, sdKK, sK, sdR, sS0, sG, sB, Gl, el, b, h, t0, n, gl, rowG, rowB, L, sX);
    {
      Acc a, c2;  // dS at the chunk start
      zero(a);
      zero(c2);
      gemm2<true, true, true, true>(a, sdO, sQt, c2, sdR, sKt, L);  // dOᵀ Q̃, dRᵀ K̃
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float2 s2 = bf2(sS0, L.row(2 * hh), L.col(nt, 0));
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            const int e = 2 * hh + e1;
            gl += dS[nt][e] * (e1 ? s2.y : s2.x) * el;
            dS[nt][e] = dS[nt][e] * el + scale * a[nt][e] - c2[nt][e];
          }
        }
    }
    bwd_publish_partials(rowG, rowB, colG, gl, sRowG, sRowB, sColG, sGl, L);
    // the gradient at this chunk's start = at the end of chunk ci − 1: the other slot, whose last
    // readers (chunk ci + 1) are behind barrier P0
    store_bf(sdS2 + ((ci + 1) & 1) * TILE, dS, L, [](float x, int, int) { return x; });
    __syncthreads();  // the next chunk overwrites the tiles, G and β; dS and the partial sums are in
  }
  if (warp == 0) bwd_write_dg_dbeta(p, sRowG, sRowB, sColG, sGl, nullptr, b, h, 0, min(C, p.T), L);
  if (p.dS0)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) p.dS0[bh * D * D + L.row(e) * D + L.col(nt, e)] = dS[nt][e];
  clock_probe(p, 1);
}

// ---------------------------------------------------------------- two-phase (chunk-parallel) path
// The fused kernels above walk a (b, h)'s chunks in one CTA, so B·H CTAs run (128 at B=8 H=16,
// 16 at B=1) and every chunk's whole chain of barrier-separated phases is on the sequential path.
// With W = T⁻¹ diag(β) e^G K and U0 = T⁻¹ diag(β) V (T = I + diag(β) Aw, so U = U0 − W S0ᵀ) and
// D = diag(e^{G_last − G}), the state recurrence is an affine map per chunk:
//   S_end = S0 (e^{G_last} I − M) + E,   M = (D W)ᵀ K [dk×dk],  E = (D U0)ᵀ K [dv×dk]
// and its adjoint, with Q' = e^G Q − P W (so that O = scale (P U0 + Q' S0ᵀ)):
//   dS0 = dS_end (e^{G_last} I − M)ᵀ + scale dOᵀ Q'.
// So: (1) a chunk-parallel prep kernel builds M, E and e^{G_last} of every chunk (all the
// solves); (2) a sequential kernel per (b, h) runs the recurrence, one 64³ GEMM per chunk,
// writing every chunk's boundary state (forward) or end-of-chunk gradient (backward);
// (3) a chunk-parallel kernel per chunk does the rest from those states: the forward's output,
// the backward's dq, dk, dv, dg, dβ. Prep and main kernels run two 8-warp CTAs per SM
// (≤ 113 KB shared, ≤ 128 registers), so one CTA's barriers overlap the other's work.

__device__ __forceinline__ size_t chunk_off(const Params& p, size_t bh, int ci) {
  return (bh * p.nc + ci) * D * D;
}
// Fragment → global [64][64] bf16, row stride 64 (the fp32 load/store are in chunk_common.cuh).
__device__ __forceinline__ void frag_store_bf(bf16* dst, const Acc& c, const Lane& L) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      *reinterpret_cast<uint32_t*>(dst + L.row(2 * hh) * D + L.col(nt, 0)) = pack(c[nt][2 * hh], c[nt][2 * hh + 1]);
}

// (1) prep, one CTA per chunk: Aw = (K Kᵀ ∘ M) strictly lower, then T⁻¹ on tensor cores
// (diag_inverse16 + merge_row, as in the fused kernels) and W = T⁻¹ diag(β) e^G K by one GEMM
// with split operands (fp32-accurate). Forward: U0 = T⁻¹ diag(β) V the same way, M = (D W)ᵀ K,
// E = (D U0)ᵀ K, and T⁻¹ (hi and lo tiles) for the main kernel. Backward: M, Q' = e^G Q − P W,
// E = scale dOᵀ Q', and T⁻¹'s hi tile (the backward applies it from bf16, like the fused one).
// The main kernels load T⁻¹ instead of building it again (16 / 8 KB per chunk against the
// inversion's latency and the fp32 Aw tile, which would not fit two main CTAs per SM).
// T⁻¹'s blocks above the diagonal are never written nor read (every apply skips them).
// Shared memory: 8 bf16 tiles, Aw (fp32; later D W and D U0 / W, as two bf16 tiles), G, β.
constexpr size_t kPrepSmem = 8 * TILE * sizeof(bf16) + (TILEF + 2 * C) * sizeof(float);
static_assert(kPrepSmem + 1024 <= 228 * 1024 / 2, "two prep CTAs per SM");

// Scratch T⁻¹ of chunk (bh, ci): kParts tiles (hi, then lo) of 64×64 bf16.
template <int kParts>
__device__ __forceinline__ bf16* ti_at(const Params& p, size_t bh, int ci) {
  return p.Ti + kParts * chunk_off(p, bh, ci);
}
// A [64][LD] shared tile → global [64][64] (all threads, 16-byte pieces).
__device__ __forceinline__ void tile_to_global(bf16* dst, const bf16* s) {
  for (int i = threadIdx.x; i < C * 8; i += NT) {
    const int r = i >> 3, c = i & 7;
    *reinterpret_cast<uint4*>(dst + r * D + c * 8) = *reinterpret_cast<const uint4*>(s + r * LD + c * 8);
  }
}
// Right-hand side diag(β) f(t) x(t, c) of a solve as hi/lo bf16 tiles, by the `count` threads
// numbered from threadIdx.x = `first`.
template <class F>
__device__ __forceinline__ void rhs_split(const bf16* X, const float* sB, bf16* H, bf16* Lo, F rowf, int first,
                                          int count) {
  for (int i = threadIdx.x - first; i < C * D / 2; i += count) {
    const int t = i >> 5, c = (i & 31) * 2;
    const float f = sB[t] * rowf(t);
    uint32_t hi, lo;
    split_bf(f * bf(X, t, c), f * bf(X, t, c + 1), hi, lo);
    *reinterpret_cast<uint32_t*>(H + t * LD + c) = hi;
    *reinterpret_cast<uint32_t*>(Lo + t * LD + c) = lo;
  }
}

// c1 += T⁻¹·B1 and c2 += T⁻¹·B2 with split operands (hi·hi + hi·lo + lo·hi) over the k-steps
// 0..k_hi of lower-triangular T⁻¹ (as gemm_split<false, true, true> twice, T⁻¹'s fragments
// loaded once and the two products' MMAs interleaved).
__device__ __forceinline__ void gemm_split_pair(Acc& c1, const bf16* B1h, const bf16* B1l, Acc& c2, const bf16* B2h,
                                                const bf16* B2l, const bf16* Th, const bf16* Tl, const Lane& L,
                                                int k_hi) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    if (kk > k_hi) continue;  // warp-uniform
    uint32_t ah[4], al[4];
    ldsm<false>(ah, a_frag_addr<false>(Th, L.wm, kk, L.lane));
    ldsm<false>(al, a_frag_addr<false>(Tl, L.wm, kk, L.lane));
#pragma unroll
    for (int nn = 0; nn < 2; ++nn) {
      const int n0 = 32 * L.wn + 16 * nn;
      uint32_t b1h[4], b1l[4], b2h[4], b2l[4];
      ldsm<true>(b1h, b_frag_addr<true>(B1h, n0, kk, L.lane));
      ldsm<true>(b1l, b_frag_addr<true>(B1l, n0, kk, L.lane));
      ldsm<true>(b2h, b_frag_addr<true>(B2h, n0, kk, L.lane));
      ldsm<true>(b2l, b_frag_addr<true>(B2l, n0, kk, L.lane));
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        Acc& c = q ? c2 : c1;
        const uint32_t(&bh)[4] = q ? b2h : b1h;
        const uint32_t(&bl)[4] = q ? b2l : b1l;
        mma(c[2 * nn], ah, bh[0], bh[1]);
        mma(c[2 * nn + 1], ah, bh[2], bh[3]);
        mma(c[2 * nn], ah, bl[0], bl[1]);
        mma(c[2 * nn + 1], ah, bl[2], bl[3]);
        mma(c[2 * nn], al, bh[0], bh[1]);
        mma(c[2 * nn + 1], al, bh[2], bh[3]);
      }
    }
  }
}

template <bool kBwd>
__global__ void __launch_bounds__(NT, 2) prep_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sA = sK + TILE;     // forward: V; backward: Q
  bf16* sdO = sA + TILE;    // backward: dO; forward: β V lo
  bf16* sP = sdO + TILE;    // backward: P; forward: β V hi
  bf16* sTiH = sP + TILE;
  bf16* sTiL = sTiH + TILE;
  bf16* sRh = sTiL + TILE;  // β e^G K (hi, lo); backward: later Q'
  bf16* sRl = sRh + TILE;
  float* sAw = reinterpret_cast<float*>(sRl + TILE);
  float* sG = sAw + TILEF;
  float* sB = sG + C;
  bf16* sWa = reinterpret_cast<bf16*>(sAw);  // once T⁻¹ is built: D W
  bf16* sWb = sWa + TILE;                    // forward: D U0; backward: W
  bf16* sVh = sP;
  bf16* sVl = sdO;
  const Lane L;
  const int ci = blockIdx.x, h = blockIdx.y, b = blockIdx.z, warp = threadIdx.x >> 5;
  const int t0 = ci * C, n = min(C, p.T - t0);
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  load_tile(sK, p.k + row_off(p, b, t0, h), stride, n);
  load_tile(sA, (kBwd ? p.q : p.v) + row_off(p, b, t0, h), stride, n);
  cp_async_commit();
  if (kBwd) load_tile(sdO, p.dout + row_off(p, b, t0, h), stride, n);  // read only by the last product
  cp_async_commit();
  publish_gates(fetch_gates(p, b, h, t0, n), sG, sB);
  cp_async_wait<1>();
  __syncthreads();
  {
    Acc a, a2;
    zero(a);
    zero(a2);
    if (kBwd)
      gemm2<false, false, false, false>(a, sK, sK, a2, sA, sK, L);  // K Kᵀ, Q Kᵀ
    else
      gemm<false, false>(a, sK, sK, L);
    store_f(sAw, a, L, [&](float x, int t, int j) { return t > j ? x * __expf(sG[t] - sG[j]) : 0.f; });
    if (kBwd)
      store_bf(sP, a2, L, [&](float x, int t, int j) { return t >= j ? x * __expf(sG[t] - sG[j]) : 0.f; });
    if (L.wn == (L.wm >> 1)) {  // this warp (0, 1, 6 or 7) holds the diagonal block wm of Aw
      __syncwarp();
      diag_inverse16(sAw, sB, sTiH, sTiL, L.wm, L.lane);
    } else {  // warps 2..5 (threads 64..191) meanwhile build the right-hand sides
      rhs_split(sK, sB, sRh, sRl, [&](int t) { return __expf(sG[t]); }, 2 * 32, 4 * 32);
      if (!kBwd) rhs_split(sA, sB, sVh, sVl, [](int) { return 1.f; }, 2 * 32, 4 * 32);
    }
  }
  __syncthreads();
  if (warp == 1) merge_row<1>(sAw, sB, sTiH, sTiL, L.lane, 1);
  if (warp == 2) merge_row<2>(sAw, sB, sTiH, sTiL, L.lane, 1);
  if (warp == 3) merge_row<3>(sAw, sB, sTiH, sTiL, L.lane, 1);
  __syncthreads();  // T⁻¹ complete; Aw is dead (its space takes D W and D U0 / W)
  const float Gl = sG[C - 1];
  {
    Acc w;
    zero(w);
    if (kBwd) {
      gemm_split<false, true, true>(w, sTiH, sTiL, sRh, sRl, L, 0, L.wm);  // W = T⁻¹ β e^G K
      store_bf(sWb, w, L, [](float x, int, int) { return x; });
    } else {
      Acc u;
      zero(u);
      gemm_split_pair(w, sRh, sRl, u, sVh, sVl, sTiH, sTiL, L, L.wm);  // W = T⁻¹ β e^G K, U0 = T⁻¹ β V
      store_bf(sWb, u, L, [&](float x, int t, int) { return x * __expf(Gl - sG[t]); });
    }
    store_bf(sWa, w, L, [&](float x, int t, int) { return x * __expf(Gl - sG[t]); });
    tile_to_global(ti_at<kBwd ? 1 : 2>(p, bh, ci), sTiH);
    if (!kBwd) tile_to_global(ti_at<2>(p, bh, ci) + D * D, sTiL);
  }
  __syncthreads();
  const size_t off = chunk_off(p, bh, ci);
  if (threadIdx.x == 0) p.el[bh * p.nc + ci] = __expf(Gl);
  if (!kBwd) {
    Acc m, e;
    zero(m);
    zero(e);
    gemm2<true, true, true, true>(m, sWa, sK, e, sWb, sK, L);  // (D W)ᵀ K, (D U0)ᵀ K
    frag_store_bf(p.Mc + off, m, L);
    frag_store_f(p.Ec + off, e, L, 1.f);
  } else {
    Acc a, m;
    zero(a);
    zero(m);
    gemm2<false, true, true, true>(a, sP, sWb, m, sWa, sK, L);  // P W, (D W)ᵀ K
    frag_store_bf(p.Mc + off, m, L);
    store_bf(sRh, a, L, [&](float x, int t, int c) { return __expf(sG[t]) * bf(sA, t, c) - x; });  // Q'
    cp_async_wait<0>();
    __syncthreads();
    zero(a);
    gemm<true, true>(a, sdO, sRh, L);  // dOᵀ Q'
    frag_store_f(p.Ec + off, a, L, p.scale);
  }
}

// (2) the sequential pass. Forward: S ← e^{G_last} S − S M + E from S0, writing every chunk's
// start state (bf16) into the boundary; backward: dS ← e^{G_last} dS − dS Mᵀ + E from dS_T over
// the chunks in reverse, writing every chunk's end-of-chunk gradient. The map acts on each row
// of the state alone, so a CTA of 4 warps carries 16 rows of one (b, h) through all chunks with
// the state in registers, warp w owning its 16 columns 16·w.. (two n-tiles). Per chunk each warp
// packs its columns to bf16 — exactly the A fragment of k-step w of the next product — and
// swaps them with the other warps through shared memory (double-buffered: one barrier per
// chunk); the product of its own k-step starts before the barrier. Each warp streams only the
// slice of M and E it needs (forward: M's columns 16·w..; backward: M's rows 16·w..; E's 16×16
// block) through its own ring of kStages stages, issued kStages − 1 chunks ahead, so the ring
// needs no barrier. (One warp per 16 rows measured 0.80 µs per chunk, H200: a single warp's
// ≈ 250 instructions per chunk, latency-bound; split over 4 warps each does a quarter.)
constexpr int kStages = 6, kStateRows = 16, kStateWarps = 4, kSliceLd = 24;
constexpr size_t kStageM = 64 * kSliceLd * sizeof(bf16);  // forward [64][24]; backward [16][72] fits
constexpr size_t kStageE = kStateRows * 16 * sizeof(float);
constexpr size_t kStateStage = kStageM + kStageE + 16;
constexpr size_t kStateXchg = 2 * kStateWarps * 32 * sizeof(uint4);
constexpr size_t kStateSmem = kStateWarps * kStages * kStateStage + kStateXchg;
static_assert(kStageM >= 16 * LD * sizeof(bf16) && kStateStage % 16 == 0, "state ring layout");

__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src));
}

template <bool kBwd>
__global__ void __launch_bounds__(kStateWarps * 32) state_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
  unsigned char* ring = smem + w * kStages * kStateStage;
  uint4* xchg = reinterpret_cast<uint4*>(smem + kStateWarps * kStages * kStateStage);  // [2][4 warps][32 lanes]
  auto stage_M = [&](int k) { return reinterpret_cast<bf16*>(ring + k * kStateStage); };
  auto stage_E = [&](int k) { return reinterpret_cast<float*>(ring + k * kStateStage + kStageM); };
  const int r0 = kStateRows * blockIdx.x, c0 = 16 * w, h = blockIdx.y, b = blockIdx.z;
  const size_t bh = static_cast<size_t>(b) * p.H + h;
  const float* init = kBwd ? p.dST : p.S0;
  // st[j][e]: row r0 + g + 8·(e >> 1), column c0 + 8·j + 2·tig + (e & 1)
  float st[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      st[j][e] = init ? init[bh * D * D + (r0 + g + 8 * (e >> 1)) * D + c0 + 8 * j + 2 * tig + (e & 1)] : 0.f;
  auto chunk_at = [&](int s) { return kBwd ? p.nc - 1 - s : s; };
  // Chunk s's slices into stage s % kStages (one commit group per chunk, empty past the end).
  auto issue = [&](int s) {
    if (s < p.nc) {
      const int ci = chunk_at(s), k = s % kStages;
      const bf16* srcM = p.Mc + chunk_off(p, bh, ci);
      bf16* dM = stage_M(k);
#pragma unroll
      for (int i = lane; i < 128; i += 32) {
        if (!kBwd) {  // M[:, c0 .. c0 + 15] → [64][kSliceLd]
          const int r = i >> 1, c = i & 1;
          cp_async16(dM + r * kSliceLd + 8 * c, srcM + r * D + c0 + 8 * c, true);
        } else {  // M[c0 .. c0 + 15, :] → [16][LD]
          const int r = i >> 3, c = i & 7;
          cp_async16(dM + r * LD + 8 * c, srcM + (c0 + r) * D + 8 * c, true);
        }
      }
      const float* srcE = p.Ec + chunk_off(p, bh, ci) + r0 * D + c0;
      float* dE = stage_E(k);
#pragma unroll
      for (int i = lane; i < 64; i += 32) {  // 16 rows × 4 float4
        const int r = i >> 2, c = i & 3;
        cp_async16(dE + r * 16 + 4 * c, srcE + r * D + 4 * c, true);
      }
      if (lane == 0) cp_async4(dE + kStateRows * 16, p.el + bh * p.nc + ci);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  for (int s = 0; s < p.nc; ++s) {
    const int ci = chunk_at(s), k = s % kStages;
    issue(s + kStages - 1);
    // this warp's columns as the A fragment of k-step w (rows g, g+8; columns 2tig.., 2tig+8..)
    uint4 mine;
    mine.x = pack(st[0][0], st[0][1]);
    mine.y = pack(st[0][2], st[0][3]);
    mine.z = pack(st[1][0], st[1][1]);
    mine.w = pack(st[1][2], st[1][3]);
    xchg[((s & 1) * kStateWarps + w) * 32 + lane] = mine;
    {
      bf16* out = (kBwd ? p.dSend : p.bound) + chunk_off(p, bh, ci) + (r0 + g) * D + c0 + 2 * tig;
      *reinterpret_cast<uint32_t*>(out) = mine.x;
      *reinterpret_cast<uint32_t*>(out + 8 * D) = mine.y;
      *reinterpret_cast<uint32_t*>(out + 8) = mine.z;
      *reinterpret_cast<uint32_t*>(out + 8 * D + 8) = mine.w;
    }
    cp_async_wait<kStages - 1>();  // chunk s's group is complete
    __syncwarp();
    const bf16* M = stage_M(k);
    uint32_t bb[4][4];  // B fragments of k-steps w, w+1, w+2, w+3 (mod 4): columns c0.., two n-tiles
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int kk = (w + i) & 3;
      if (!kBwd)  // B[k][n] = M[k][c0 + n]
        ldsm_x4_t(bb[i], M + (16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3)) * kSliceLd + (lane >> 4) * 8);
      else  // B[k][n] = M[c0 + n][k]
        ldsm_x4(bb[i], M + ((lane & 7) + ((lane >> 4) << 3)) * LD + 16 * kk + ((lane >> 3) & 1) * 8);
    }
    float acc[2][2][4] = {};  // two partial sums per n-tile (shorter MMA chains)
    const uint32_t am[4] = {mine.x, mine.y, mine.z, mine.w};
    mma(acc[0][0], am, bb[0][0], bb[0][1]);
    mma(acc[0][1], am, bb[0][2], bb[0][3]);
    __syncthreads();  // every warp's columns are in xchg[s & 1]
#pragma unroll
    for (int i = 1; i < 4; ++i) {
      const uint4 x = xchg[((s & 1) * kStateWarps + ((w + i) & 3)) * 32 + lane];
      const uint32_t a[4] = {x.x, x.y, x.z, x.w};
      mma(acc[i & 1][0], a, bb[i][0], bb[i][1]);
      mma(acc[i & 1][1], a, bb[i][2], bb[i][3]);
    }
    const float* E = stage_E(k);
    const float el = E[kStateRows * 16];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float2 e = *reinterpret_cast<const float2*>(E + (g + 8 * hh) * 16 + 8 * j + 2 * tig);
        st[j][2 * hh] = el * st[j][2 * hh] - (acc[0][j][2 * hh] + acc[1][j][2 * hh]) + e.x;
        st[j][2 * hh + 1] = el * st[j][2 * hh + 1] - (acc[0][j][2 * hh + 1] + acc[1][j][2 * hh + 1]) + e.y;
      }
    __syncwarp();  // this stage is read before the next iteration refills it
  }
  cp_async_wait<0>();
  float* fin = kBwd ? p.dS0 : p.S_out;
  if (fin)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        *reinterpret_cast<float2*>(fin + bh * D * D + (r0 + g + 8 * hh) * D + c0 + 8 * j + 2 * tig) =
            make_float2(st[j][2 * hh], st[j][2 * hh + 1]);
}

// (3a) forward output per chunk from its start state and the prep's T⁻¹ (hi, lo):
//   A  P = (Q Kᵀ ∘ M) lower, o = e^G Q S0ᵀ, β X = β (V − e^G K S0ᵀ) (hi/lo)
//   B  U = T⁻¹ β X (split operands, as in the fused forward)      C  o += P U, stored.
constexpr size_t kFwdMainSmem = 9 * TILE * sizeof(bf16) + 2 * C * sizeof(float);

__global__ void __launch_bounds__(NT, 2) fwd_main_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + TILE;
  bf16* sV = sK + TILE;
  bf16* sS = sV + TILE;
  bf16* sTiH = sS + TILE;
  bf16* sTiL = sTiH + TILE;
  bf16* sP = sTiL + TILE;
  bf16* sXh = sP + TILE;
  bf16* sXl = sXh + TILE;
  float* sG = reinterpret_cast<float*>(sXl + TILE);
  float* sB = sG + C;
  bf16* sU = sQ;  // Q is read in phase A only
  const Lane L;
  const int ci = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int t0 = ci * C, n = min(C, p.T - t0);
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  load_tile(sQ, p.q + row_off(p, b, t0, h), stride, n);
  load_tile(sK, p.k + row_off(p, b, t0, h), stride, n);
  load_tile(sV, p.v + row_off(p, b, t0, h), stride, n);
  load_tile(sS, p.bound + chunk_off(p, bh, ci), D, C);
  cp_async_commit();
  load_tile(sTiH, ti_at<2>(p, bh, ci), D, C);  // T⁻¹ arrives while phase A runs
  load_tile(sTiL, ti_at<2>(p, bh, ci) + D * D, D, C);
  cp_async_commit();
  publish_gates(fetch_gates(p, b, h, t0, n), sG, sB);
  cp_async_wait<1>();
  __syncthreads();
  Acc o;
  {
    Acc a;
    zero(a);
    gemm<false, false>(a, sQ, sK, L);  // Q Kᵀ
    store_bf(sP, a, L, [&](float x, int t, int j) { return t >= j ? x * __expf(sG[t] - sG[j]) : 0.f; });
    zero(a);
    zero(o);
    gemm2<false, false, false, false>(a, sK, sS, o, sQ, sS, L);  // K S0ᵀ, Q S0ᵀ
    store_split(sXh, sXl, a, L, [&](float x, int t, int c) { return sB[t] * (bf(sV, t, c) - __expf(sG[t]) * x); });
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nt][e] *= __expf(sG[L.row(e)]);
  }
  cp_async_wait<0>();
  __syncthreads();
  {
    Acc u;
    zero(u);
    gemm_split<false, true, true>(u, sTiH, sTiL, sXh, sXl, L, 0, L.wm);  // U = T⁻¹ β X
    store_bf(sU, u, L, [](float x, int, int) { return x; });
  }
  __syncthreads();
  gemm<false, true>(o, sP, sU, L);  // + P U
  store_rows_staged(p.o, p, b, h, t0, n, o, p.scale, sK, L);  // through the K tile (read in phase A only)
}

// (3b) backward per chunk from its start state S0, end-of-chunk gradient dS and the prep's T⁻¹
// (the fused backward's chunk body without the dS update):
//   A  Aw (kept in registers as bf16 pairs: only dKK's gate terms read it), P, β X
//   B  dU = e^{G_last − G} K dSᵀ + scale Pᵀ dO
//   C  U = T⁻¹ β X, dR = T⁻ᵀ dU (bf16 operands); dv and dβ's v-term from dR's registers
//   D  dKK, dQK      E  dq, dk, the gate partial sums      F  dg, dβ.
// 10 bf16 tiles (U takes P's, dR V's in place, dKK βX's, dQK dU's) for two CTAs per SM. The gate
// gradients' partial sums take fixed per-warp slots, not atomics: bit-reproducible.
constexpr size_t kBwdMainSmem = 10 * TILE * sizeof(bf16) + (12 * C + 8) * sizeof(float);
static_assert(kBwdMainSmem + 1024 <= 228 * 1024 / 2, "two backward CTAs per SM");

__global__ void __launch_bounds__(NT, 2) bwd_main_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + TILE;
  bf16* sV = sK + TILE;
  bf16* sdO = sV + TILE;
  bf16* sS0 = sdO + TILE;
  bf16* sdS = sS0 + TILE;
  bf16* sTi = sdS + TILE;
  bf16* sP = sTi + TILE;
  bf16* sX = sP + TILE;  // β X
  bf16* sdU = sX + TILE;
  float* sG = reinterpret_cast<float*>(sdU + TILE);
  float* sB = sG + C;
  float* sRowG = sB + C;         // [2][C] per wn
  float* sRowB = sRowG + 2 * C;  // [2][C]
  float* sColG = sRowB + 2 * C;  // [4][C] per wm
  float* sGl = sColG + 4 * C;    // [8] per warp
  bf16* sU = sP;
  bf16* sdR = sV;
  bf16* sdKK = sX;
  bf16* sdQK = sdU;
  const Lane L;
  const int ci = blockIdx.x, h = blockIdx.y, b = blockIdx.z, warp = threadIdx.x >> 5;
  const int t0 = ci * C, n = min(C, p.T - t0);
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  const float scale = p.scale;
  load_tile(sQ, p.q + row_off(p, b, t0, h), stride, n);
  load_tile(sK, p.k + row_off(p, b, t0, h), stride, n);
  load_tile(sV, p.v + row_off(p, b, t0, h), stride, n);
  load_tile(sS0, p.bound_in + chunk_off(p, bh, ci), D, C);
  cp_async_commit();  // phase A's operands; the later phases' arrive while it runs
  load_tile(sdO, p.dout + row_off(p, b, t0, h), stride, n);
  load_tile(sdS, p.dSend + chunk_off(p, bh, ci), D, C);
  cp_async_commit();
  load_tile(sTi, ti_at<1>(p, bh, ci), D, C);
  cp_async_commit();
  publish_gates(fetch_gates(p, b, h, t0, n), sG, sB);
  cp_async_wait<2>();
  __syncthreads();  // P0
  const float Gl = sG[C - 1], el = __expf(Gl);
  float rowG[2] = {0.f, 0.f}, rowB[2] = {0.f, 0.f}, colG[4][2] = {}, gl = 0.f;
  Acc pf;             // P in fp32 (for dG)
  uint32_t aw[4][2];  // Aw at this warp's fragment positions, bf16 pairs
  {
    Acc a;
    zero(a);
    zero(pf);
    gemm2<false, false, false, false>(a, sK, sK, pf, sQ, sK, L);  // K Kᵀ, Q Kᵀ
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float y[2];
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int e = 2 * hh + e1, t = L.row(e), j = L.col(nt, e);
          y[e1] = t > j ? a[nt][e] * __expf(sG[t] - sG[j]) : 0.f;
          pf[nt][e] = t >= j ? pf[nt][e] * __expf(sG[t] - sG[j]) : 0.f;
        }
        aw[nt][hh] = pack(y[0], y[1]);
      }
    store_bf(sP, pf, L, [](float x, int, int) { return x; });
    zero(a);
    gemm<false, false>(a, sK, sS0, L);  // K S0ᵀ
    store_bf(sX, a, L, [&](float x, int t, int c) { return sB[t] * (bf(sV, t, c) - __expf(sG[t]) * x); });
  }
  cp_async_wait<1>();
  __syncthreads();  // P1
  bwd_du(sK, sdS, sP, sdO, sG, Gl, scale, sdU, L);
  cp_async_wait<0>();
  __syncthreads();  // P2
  {
    Acc u, r;
    zero(u);
    zero(r);
    gemm_split<false, true, false>(u, sTi, nullptr, sX, nullptr, L, 0, L.wm);   // T⁻¹ β X (lower: kk ≤ wm)
    gemm_split<true, true, false>(r, sTi, nullptr, sdU, nullptr, L, L.wm, 3);  // T⁻ᵀ dU (upper: kk ≥ wm)
    store_bf(sU, u, L, [](float x, int, int) { return x; });
    // dv = β dR, dβ += Σ dR·v; then dR over V at the same positions (each lane reads the V
    // values it overwrites, and nothing else reads V from here on)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = L.row(2 * hh), c = L.col(nt, 0);
        const float r0 = r[nt][2 * hh], r1 = r[nt][2 * hh + 1];
        rowB[hh] += r0 * bf(sV, t, c) + r1 * bf(sV, t, c + 1);
        if (t < n) *reinterpret_cast<uint32_t*>(p.dv + row_off(p, b, t0 + t, h) + c) = pack(sB[t] * r0, sB[t] * r1);
      }
    store_bf(sdR, r, L, [](float x, int, int) { return x; });
  }
  __syncthreads();  // P3
  bwd_dkk_dqk(sdR, sU, sdO, sG, sB,
              [&](int nt, int e) {
                const __nv_bfloat162 v2 = *reinterpret_cast<const __nv_bfloat162*>(&aw[nt][e >> 1]);
                return (e & 1) ? __high2float(v2) : __low2float(v2);
              },
              pf, scale, rowB, rowG, colG, sdKK, sdQK, L);
  __syncthreads();  // P4
  // dq, dk go out through the T⁻¹ tile (read in phase C only; each warp reuses its own block)
  bwd_dq(p, sdQK, sK, sdO, sS0, sQ, sG, b, h, t0, n, rowG, L, sTi);
  bwd_dk<true>(p, sdQK, sQ, sU, sdS, sdKK, sK, sdR, sS0, sG, sB, Gl, el, b, h, t0, n, gl, rowG, rowB, L, sTi);
  bwd_publish_partials(rowG, rowB, colG, gl, sRowG, sRowB, sColG, sGl, L);
  __syncthreads();  // P5
  if (warp == 0) bwd_write_dg_dbeta(p, sRowG, sRowB, sColG, sGl, nullptr, b, h, t0, n, L);
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
  sk_dot = quad_sum(sk_dot);
  const float u = beta * (__bfloat162float(p.v[bh * D + v]) - sk_dot);
  float od = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    s[i] += u * sk[part * 16 + i];
    od += s[i] * sq[part * 16 + i];
  }
  od = quad_sum(od);
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

// Which path runs a pass. The fused kernels take one CTA per (b, h) for the whole sequence;
// the two-phase path spreads the chunks over the GPU but moves more bytes and repeats part of
// the work. Cost model, µs per chunk of the sequence, fitted on the H200 (132 SMs; gdn, H=16,
// B = 1, 2, 4, 8 at T = 32K / B: `lar-bench delta-paths`): fused fwd 6.4, bwd 13.6 per wave of
// B·H CTAs; two-phase fwd 0.0787, bwd 0.121 per (b, h) plus the sequential pass's 0.15 per chunk.
// So the fused path wins from about B·H ≥ 80 (fwd) / 112 (bwd) on 132 SMs.
// DeltaShape::kernels.path (cuda.linear_path) forces one.
bool use_two_phase(const Params& p, bool bwd, PathChoice want) {
  if (want != PathChoice::automatic) return want == PathChoice::chunked;
  const int sms = sm_count();
  const double bh = static_cast<double>(p.B) * p.H;
  const double fused = (bwd ? 13.6 : 6.4) * std::ceil(bh / sms);
  const double chunked = (bwd ? 0.121 : 0.0787) * bh * 132.0 / sms + 0.15;
  return chunked < fused;
}

// LAR_DELTA_CLOCKS=1: the fused kernels' clock probe. Every fused launch gets a slot (a ring of
// kClockSlots per kind); at exit the process prints, per kind, CTA (0, 0)'s median duration and
// SM clock (cycles over global time) — e.g. inside `lar-bench gpu-train` against the kernel bench.
constexpr int kClockSlots = 512;
struct ClockLog {
  unsigned long long* dev = nullptr;
  int calls[2] = {0, 0};  // forward, backward
};
void clock_report();
ClockLog* clock_log() {
  static ClockLog* log = []() -> ClockLog* {
    if (!env_flag("LAR_DELTA_CLOCKS")) return nullptr;
    auto* l = new ClockLog;
    const size_t bytes = 2 * kClockSlots * 4 * sizeof(unsigned long long);
    LAR_CUDA_CHECK(cudaMalloc(&l->dev, bytes));
    LAR_CUDA_CHECK(cudaMemset(l->dev, 0, bytes));
    std::atexit(clock_report);
    return l;
  }();
  return log;
}
void clock_slot(Params& p, int kind) {
  if (ClockLog* l = clock_log()) {
    p.clk = l->dev;
    p.clk_slot = kind * kClockSlots + l->calls[kind]++ % kClockSlots;
  }
}
void clock_report() {
  ClockLog* l = clock_log();
  std::vector<unsigned long long> hst(2 * kClockSlots * 4);
  if (cudaMemcpy(hst.data(), l->dev, hst.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost) != cudaSuccess)
    return;
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<double> us, mhz;
    for (int i = 0; i < std::min(l->calls[kind], kClockSlots); ++i) {
      const unsigned long long* x = &hst[4 * (kind * kClockSlots + i)];
      if (x[1] <= x[0]) continue;
      us.push_back((x[1] - x[0]) * 1e-3);
      mhz.push_back(double(x[3] - x[2]) / double(x[1] - x[0]) * 1e3);
    }
    if (us.empty()) continue;
    std::sort(us.begin(), us.end());
    std::sort(mhz.begin(), mhz.end());
    std::fprintf(stderr, "LAR_DELTA_CLOCKS %s: %d calls, CTA (0,0) median %.1f us, SM clock median %.0f MHz (min %.0f, max %.0f)\n",
                 kind ? "delta_bwd" : "delta_fwd", l->calls[kind], us[us.size() / 2], mhz[mhz.size() / 2], mhz.front(),
                 mhz.back());
  }
}

// One launch with its dynamic shared memory (the limit must be raised above 48 KB first).
void launch(void (*kernel)(Params), dim3 grid, size_t smem, const Params& p, cudaStream_t stream, int threads = NT) {
  LAR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // all of L1 as shared memory, so that the two-phase kernels get their two CTAs per SM
  LAR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared));
  kernel<<<grid, threads, smem, stream>>>(p);
  LAR_CUDA_LAUNCHED();
}

template <bool kBwd>
void launch_two_phase(const Params& p, cudaStream_t stream) {
  const dim3 per_chunk(p.nc, p.H, p.B), per_rows(D / kStateRows, p.H, p.B);
  launch(prep_kernel<kBwd>, per_chunk, kPrepSmem, p, stream);
  launch(state_kernel<kBwd>, per_rows, kStateSmem, p, stream, kStateWarps * 32);
  if (kBwd)
    launch(bwd_main_kernel, per_chunk, kBwdMainSmem, p, stream);
  else
    launch(fwd_main_kernel, per_chunk, kFwdMainSmem, p, stream);
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
  if (!use_two_phase(p, false, s.kernels.path)) {
    clock_slot(p, 0);
    launch(fwd_kernel, dim3(p.H, p.B), kFwdSmem, p, stream, NT2);
    return;
  }
  const size_t chunks = static_cast<size_t>(p.B) * p.H * p.nc;
  Scratch scratch(stream);
  p.Mc = scratch.get<bf16>(chunks * D * D);
  p.Ec = scratch.get<float>(chunks * D * D);
  p.el = scratch.get<float>(chunks);
  p.Ti = scratch.get<bf16>(2 * chunks * D * D);
  if (!p.bound) p.bound = scratch.get<bf16>(chunks * D * D);  // the main kernel reads the states from here
  launch_two_phase<false>(p, stream);
}

void delta_bwd(const DeltaShape& s, const bf16* q, const bf16* k, const bf16* v, const float* g, const float* beta,
               const bf16* boundary, const bf16* dout, const float* dST, bf16* dq, bf16* dk, bf16* dv, float* dg,
               float* dbeta, float* dS0, cudaStream_t stream) {
  Params p = make_params(s, "delta_bwd");
  if (!q || !k || !v || !beta || !boundary || !dout || !dq || !dk || !dv || !dbeta)
    throw RuntimeError("delta_bwd: q, k, v, beta, boundary, dout, dq, dk, dv and dbeta are required");
  p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta, p.bound_in = boundary, p.dout = dout, p.dST = dST;
  p.dq = dq, p.dk = dk, p.dv = dv, p.dg = dg, p.dbeta = dbeta, p.dS0 = dS0;
  if (!use_two_phase(p, true, s.kernels.path)) {
    clock_slot(p, 1);
    launch(bwd_kernel, dim3(p.H, p.B), kBwdSmem, p, stream);
    return;
  }
  const size_t chunks = static_cast<size_t>(p.B) * p.H * p.nc;
  Scratch scratch(stream);
  p.Mc = scratch.get<bf16>(chunks * D * D);
  p.Ec = scratch.get<float>(chunks * D * D);
  p.el = scratch.get<float>(chunks);
  p.Ti = scratch.get<bf16>(chunks * D * D);
  p.dSend = scratch.get<bf16>(chunks * D * D);
  launch_two_phase<true>(p, stream);
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
