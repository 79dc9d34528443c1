#pragma once
// Chunkwise kernels of the channel-gated mixers: gla (no erase), kda (e = β k, z = β v) and
// gdn2 (e = b ⊙ k, z = w ⊙ v), all with a per-key-channel log-gate. See channel_rule.hpp
// for the contract and kernels/linear/core.hpp for the math.
//
// The in-chunk decay exp(G_tc − G_jc) is per channel, so P and A are no longer a masked
// product of two plain matrices. They are factored per 16-row block I (rows 16I..16I+15)
// around the block's first row s_I:
//   P[t,j] = Σ_c (q_tc e^{G_tc − G_{s_I}c}) (k_jc e^{G_{s_I}c − G_jc}),   t ∈ I, j ≤ t
// The first factor is ≤ 1; the second is ≤ 1 for j < s_I and at most e^{(decay over 16
// tokens)} inside the block. On a steep block (a fall of more than kSpanMax = 40 in some
// channel over its 16 rows) K̄ drops the block's own rows and those pairs are summed directly
// with exp(G_t − G_j) ≤ 1 (steep_fix_*), so the kernels are exact for any log-decay ≤ 0.
// Warp row block wm multiplies with its own
// K̄^(wm) tile. The gate gradient uses that every factor carries +G of its row for q and e
// and −G for k: dG = q∘dq + e∘de − k∘dk (core gradients), plus the G_last terms.
//
// Two implementations of gla / kda / gdn2, chosen per pass from the shape (use_two_phase;
// DeltaShape::kernels.path, the run's cuda.linear_path, forces one): the fused kernels (one CTA per (b, h) walks the chunks;
// best when B·H fills the GPU) and the two-phase path ("two-phase" below; for long sequences
// with few (b, h), e.g. B=1 T=32K). Both write and read the same boundary states. CARVE's
// forward always runs fused (its content gate chains the chunks); its backward splits into a
// chain pass and chunk CTAs beside it at small B·H (use_carve_split).
//
// The kernels and their launch helpers, shared by channel_rule.cu (gla, kda, gdn2) and
// kernels/carve/carve.cu (the CARVE mode); each file instantiates its own modes.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "kernels/channel_rule/channel_rule.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/linear/chunk_common.cuh"
#include "kernels/linear/scratch.hpp"

namespace lar::kernels::cuda::linear {
namespace {

enum Mode { kGla = 0, kKda = 1, kGdn2 = 2, kCarve = 3 };

struct CParams {
  const bf16 *q, *k, *v, *dout, *bg, *wg;
  const float *g, *beta, *S0, *dST;
  bf16 *o, *bound, *dq, *dk, *dv, *dbg, *dwg;
  const bf16* bound_in;
  float *S_out, *dg, *dbeta, *dS0;
  // CARVE: erase logits bx, scalar write gate w, content projection U1 [H,r,64], U2 [H,64,r],
  // the content signal m per chunk (written by the forward, read by the backward).
  const bf16* bx;
  const float *wsc, *U1, *U2;
  float* cm;
  bf16* dbx;
  float *dwsc, *dU1, *dU2;
  int rank, cgrad;
  // Two-phase path (see "two-phase" below): per chunk M = Wᵀ K̂ (bf16; kda, gdn2), the additive
  // term E (fp32; forward Uₒᵀ K̂, backward scale dOᵀ Q'), e^{G_last} per key channel, and the
  // backward's end-of-chunk state gradients.
  bf16 *Mc, *dSend, *Uc, *Wc;  // (forward: the prep's U₀ and W per chunk, bf16)
  float *Ec, *el;
  float* dmc;  // CARVE split backward: dm/64 added to each chunk's dO (chain pass → chunk pass)
  unsigned* flags;  // (one launch: chunk c's chain results are written)
  int B, T, H, nc;
  float scale;
};

__device__ __forceinline__ size_t crow(const CParams& p, int b, int t, int h) {
  return ((static_cast<size_t>(b) * p.T + t) * p.H + h) * D;
}

__device__ __forceinline__ float sigm(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

// CARVE content path, U_b(m) = U2 tanh(U1 m) (rank ≤ 32). Each thread keeps two fixed
// 8-element slices of U1 and U2 in registers for the whole sequence (no global loads on the
// chunk's critical path):
//   u1[j] = U1[r = tid/8][8·(tid%8) + j],   u2[j] = U2[c = tid/4][8·(tid%4) + j]   (0 past rank)
struct CarveU {
  float u1[8], u2[8];
};
__device__ __forceinline__ void carve_load_u(const CParams& p, int h, CarveU& U) {
  const int r = threadIdx.x >> 3, p8 = threadIdx.x & 7, c = threadIdx.x >> 2, p4 = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    U.u1[j] = r < p.rank ? p.U1[(static_cast<size_t>(h) * p.rank + r) * D + 8 * p8 + j] : 0.f;
    U.u2[j] = 8 * p4 + j < p.rank ? p.U2[(static_cast<size_t>(h) * D + c) * p.rank + 8 * p4 + j] : 0.f;
  }
}
// h = tanh(U1 m) into sH (thread (r, part) sums 8 products, the 8 parts reduce by shuffles).
// m_j = Σ_w sCol[w·64 + j] over `nparts` partial column sums (the forward's per-warp-row
// output sums, already divided by 64), or sCol itself with nparts = 1.
__device__ __forceinline__ void carve_h(const CParams& p, const CarveU& U, const float* sCol, int nparts, float* sH) {
  const int r = threadIdx.x >> 3, part = threadIdx.x & 7;
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float m = 0.f;
    for (int w = 0; w < nparts; ++w) m += sCol[w * C + 8 * part + j];
    s += U.u1[j] * m;
  }
  s += __shfl_xor_sync(FULL, s, 1);
  s += __shfl_xor_sync(FULL, s, 2);
  s += __shfl_xor_sync(FULL, s, 4);
  if (part == 0 && r < p.rank) sH[r] = tanhf(s);
}
// u = U2 h into sUc: thread (c, part) sums ranks 8·part..8·part+7.
__device__ __forceinline__ void carve_u(const CParams& p, const CarveU& U, const float* sH, float* sUc) {
  const int c = threadIdx.x >> 2, part = threadIdx.x & 3;
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (8 * part + j < p.rank) s += U.u2[j] * sH[8 * part + j];
  s = quad_sum(s);
  if (part == 0) sUc[c] = s;
}

// 4-byte cp.async (zero-filled when !pred): CARVE's per-token write gate.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool pred) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(pred ? 4 : 0));
}
// fp32 [64 rows][64] gate tile (rows ≥ n → 0).
__device__ __forceinline__ void load_gate_tile(float* s, const float* gsrc, size_t stride, int n) {
#pragma unroll
  for (int i = threadIdx.x; i < C * 16; i += NT) {
    const int r = i >> 4, c = i & 15;
    const bool ok = r < n;
    cp_async16(s + r * LDF + c * 4, ok ? gsrc + r * stride + c * 4 : gsrc, ok);
  }
}

// The factored in-chunk products carry e^{G_{16I} − G_j} for a key row j inside row block I
// (K̄_I) against e^{G_t − G_{16I}} ≤ 1 for a query row t: a steep block (a per-channel fall of
// the cumulative log-decay G by more than kSpanMax over its 16 rows) would overflow the first
// and underflow the second. There K̄_I keeps only the rows before the block, and the in-block
// pairs are summed directly in fp32 with exp(G_t − G_j) ≤ 1 per pair (steep_pairs, steep_grads), so
// every kernel is exact for any log-decay ≤ 0. Below the bound both factors stay within
// e^{±40}, far inside the bf16 / fp32 range, and the tensor-core path runs unchanged.
constexpr float kSpanMax = 40.f;
__device__ __forceinline__ unsigned steep_blocks(const int* steep) {
  int f = 0;
#pragma unroll
  for (int w = 0; w < 8; ++w) f |= steep[w];
  return static_cast<unsigned>(f);
}
// K̄_I's row mask: the rows up to the end of block I, or only those before it when it is steep.
__device__ __forceinline__ bool kbar_row(int t, int I, unsigned steep) {
  return (steep >> I) & 1 ? t < 16 * I : t <= 16 * I + 15;
}

// In-place cumulative sum over rows of each column (forward) of an fp32 tile; thread
// (column tid/4, part tid%4) scans rows 16·part.., the quad combines the part totals.
// With `steep`, also flags the 16-row blocks too steep for the factored products (see
// kSpanMax): warp w writes steep[w], bit I set when one of its columns falls by more than
// kSpanMax over block I; steep_blocks() ORs the 8 words after the next barrier.
__device__ __forceinline__ void cumsum_cols(float* s, int* steep = nullptr) {
  const int c = threadIdx.x >> 2, p = threadIdx.x & 3;
  float v[16];
#pragma unroll
  for (int r = 0; r < 16; ++r) v[r] = s[(16 * p + r) * LDF + c] + (r ? v[r - 1] : 0.f);
  if (steep) {  // lane = 4·column + block: block I's flags are the lanes ≡ I (mod 4)
    const unsigned m = __ballot_sync(FULL, v[0] - v[15] > kSpanMax);
    if ((threadIdx.x & 31) == 0) {
      int f = 0;
#pragma unroll
      for (int I = 0; I < 4; ++I) f |= (m & (0x11111111u << I)) ? 1 << I : 0;
      steep[threadIdx.x >> 5] = f;
    }
  }
  float tot = v[15], inc = tot;
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    const float y = __shfl_up_sync(FULL, inc, o);
    if (p >= o) inc += y;
  }
  const float ex = inc - tot;
#pragma unroll
  for (int r = 0; r < 16; ++r) s[(16 * p + r) * LDF + c] = v[r] + ex;
}
// Reverse cumulative sum (suffix sums) over rows of each column, in place.
__device__ __forceinline__ void rcumsum_cols(float* s) {
  const int c = threadIdx.x >> 2, p = threadIdx.x & 3;
  float v[16];
#pragma unroll
  for (int r = 15; r >= 0; --r) v[r] = s[(16 * p + r) * LDF + c] + (r < 15 ? v[r + 1] : 0.f);
  float tot = v[0], inc = tot;
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    const float y = __shfl_down_sync(FULL, inc, o);
    if (p + o < 4) inc += y;
  }
  const float ex = inc - tot;
#pragma unroll
  for (int r = 0; r < 16; ++r) s[(16 * p + r) * LDF + c] = v[r] + ex;
}

// Per-chunk operand tiles from Q, K, (b), G:
//   Qb = q e^{G − G_s}, Eb = e e^{G − G_s} (s = the row's 16-block start), Kb_I = k e^{G_{16I} − G}
//   (rows ≤ 16I+15, or < 16I in a steep block; else 0), Qt = q e^{G}, Et = e e^{G}, Kh = k e^{G_last − G}.
template <int MODE>
__device__ __forceinline__ void build_tiles(const CParams& p, int b, int h, int t0, int n, const bf16* Q, const bf16* K,
                                            const float* sGt, bf16* sQb, bf16* sEb, bf16* sKb, bf16* sQt, bf16* sEt,
                                            bf16* sKh, const float* sUc, unsigned steep, const bf16* sBx = nullptr) {
  for (int i = threadIdx.x; i < C * 32; i += NT) {
    const int t = i >> 5, c = 2 * (i & 31);
    float qb[2], eb[2], qt[2], et[2], kh[2], kb[4][2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const float G = sGt[t * LDF + c + u], Gs = sGt[(t & ~15) * LDF + c + u], Gl = sGt[(C - 1) * LDF + c + u];
      const float qv = bf(Q, t, c + u), kv = bf(K, t, c + u);
      float ev = kv;
      if (MODE == kGdn2)  // (sBx: the chunk's erase gate b in shared memory)
        ev = t < n ? kv * (sBx ? bf(sBx, t, c + u) : __bfloat162float(p.bg[crow(p, b, t0 + t, h) + c + u])) : 0.f;
      if (MODE == kCarve) {  // (sBx: the chunk's erase logits already in shared memory, 0 past n)
        const float bxv = sBx ? bf(sBx, t, c + u) : t < n ? __bfloat162float(p.bx[crow(p, b, t0 + t, h) + c + u]) : 0.f;
        ev = t < n ? kv * sigm(bxv + sUc[c + u]) : 0.f;
      }
      const float f = __expf(G - Gs), e0 = __expf(G);
      qb[u] = qv * f, eb[u] = ev * f, qt[u] = qv * e0, et[u] = ev * e0, kh[u] = kv * __expf(Gl - G);
#pragma unroll
      for (int I = 0; I < 4; ++I) kb[I][u] = kbar_row(t, I, steep) ? kv * __expf(sGt[16 * I * LDF + c + u] - G) : 0.f;
    }
    const int o = t * LD + c;
    *reinterpret_cast<uint32_t*>(sQb + o) = pack(qb[0], qb[1]);
    *reinterpret_cast<uint32_t*>(sQt + o) = pack(qt[0], qt[1]);
    *reinterpret_cast<uint32_t*>(sKh + o) = pack(kh[0], kh[1]);
    if (MODE != kGla) {
      *reinterpret_cast<uint32_t*>(sEb + o) = pack(eb[0], eb[1]);
      *reinterpret_cast<uint32_t*>(sEt + o) = pack(et[0], et[1]);
    }
#pragma unroll
    for (int I = 0; I < 4; ++I) *reinterpret_cast<uint32_t*>(sKb + I * TILE + o) = pack(kb[I][0], kb[I][1]);
  }
}


// ---- steep blocks (kSpanMax): the in-block pairs in fp32, exp(G_t − G_j) ≤ 1 per pair.
// Cooperative passes of the whole CTA through shared memory, called only for a chunk with a
// steep block (a CTA-uniform branch between barriers) and kept out of line (__noinline__, no
// fragment crosses the call), so the tuned kernels' straight-line code keeps its size and its
// schedule: inlined, the cold code alone cost the backward 35–65% on the H200.
struct SteepIn {  // the global inputs the passes read (the chunk's tiles may hold other data)
  const bf16 *q, *k, *bg, *bx;
  int T, H;
};
__device__ __forceinline__ SteepIn steep_in(const CParams& p) { return SteepIn{p.q, p.k, p.bg, p.bx, p.T, p.H}; }
__device__ __forceinline__ size_t srow(const SteepIn& a, int b, int t, int h) {
  return ((static_cast<size_t>(b) * a.T + t) * a.H + h) * D;
}
// 8 channels c8.. of a row of a [B,T,H,64] bf16 input.
__device__ __forceinline__ void ld8(const bf16* row, int c8, float (&x)[8]) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(row + c8));
  const bf16* v = reinterpret_cast<const bf16*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = __bfloat162float(v[i]);
}
// ê of row r, channel c: kda k, gdn2 b ⊙ k, CARVE k σ(bx + u).
template <int MODE>
__device__ __forceinline__ float erase_at(const SteepIn& a, size_t r, int c, float kv, const float* sUc) {
  if (MODE == kGdn2) return kv * __bfloat162float(a.bg[r + c]);
  if (MODE == kCarve) return kv * sigm(__bfloat162float(a.bx[r + c]) + sUc[c]);
  return kv;
}
// The forward products' in-block pairs of every steep block: P[t,j] = Σ_c q_tc k_jc e^{G_tc − G_jc}
// (j ≤ t) into the bf16 tile sP and A[t,j] = Σ_c ê_tc k_jc e^{G_tc − G_jc} (j < t) into the fp32
// tile sA (either nullable), over the entries the factored GEMM left at 0 (K̄ dropped the rows).
template <int MODE>
__device__ __noinline__ void steep_pairs(SteepIn a, int b, int h, int t0, int n, const float* sGt, const float* sUc,
                                         unsigned steep, float* sA, bf16* sP) {
  const bool wantA = sA != nullptr && MODE != kGla;
  for (int i = threadIdx.x; i < 4 * 256; i += NT) {
    const int I = i >> 8, t = 16 * I + ((i >> 4) & 15), j = 16 * I + (i & 15);
    if (!((steep >> I) & 1) || j > t || t >= n) continue;
    const size_t rt = srow(a, b, t0 + t, h), rj = srow(a, b, t0 + j, h);
    float sp = 0.f, sa = 0.f;
    for (int c8 = 0; c8 < D; c8 += 8) {
      float kj[8], qt[8], kt[8];
      ld8(a.k + rj, c8, kj);
      ld8(a.q + rt, c8, qt);
      if (wantA) ld8(a.k + rt, c8, kt);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float x = kj[u] * __expf(sGt[t * LDF + c8 + u] - sGt[j * LDF + c8 + u]);
        sp += qt[u] * x;
        if (wantA) sa += erase_at<MODE>(a, rt, c8 + u, kt[u], sUc) * x;
      }
    }
    if (sP) sP[t * LD + j] = __float2bfloat16(sp);
    if (wantA && j < t) sA[t * LDF + j] = sa;
  }
}
// The backward's in-block parts, for every row t of a steep block and channel c, into the fp32
// tile sF (other rows untouched): with rows = true Σ_{16⌊t/16⌋ ≤ j ≤ t} X_tj k_jc e^{G_tc − G_jc}
// (dq's with X = dP, the erase gradient's with X = dAw; both masked tiles); with rows = false
// dk's, Σ_{t ≤ i < end of block, i < n} (dP_it q_ic + dAw_it ê_ic) e^{G_ic − G_tc}.
template <int MODE>
__device__ __noinline__ void steep_grads(SteepIn a, int b, int h, int t0, int n, bool rows, const bf16* sX,
                                         const bf16* sdAw, const bf16* sQ, const bf16* sK, const float* sGt,
                                         const float* sUc, unsigned steep, float* sF) {
  for (int i = threadIdx.x; i < C * D; i += NT) {
    const int t = i >> 6, c = i & 63;
    if (!((steep >> (t >> 4)) & 1)) continue;
    const float Gt = sGt[t * LDF + c];
    float x = 0.f;
    if (rows) {
      for (int j = t & ~15; j <= t; ++j) x += bf(sX, t, j) * bf(sK, j, c) * __expf(Gt - sGt[j * LDF + c]);
    } else {
      for (int r = t; r <= (t | 15) && r < n; ++r) {
        float y = bf(sX, r, t) * bf(sQ, r, c);
        if (MODE != kGla) y += bf(sdAw, r, t) * erase_at<MODE>(a, srow(a, b, t0 + r, h), c, bf(sK, r, c), sUc);
        x += y * __expf(sGt[r * LDF + c] - Gt);
      }
    }
    sF[t * LDF + c] = x;
  }
}
// a += sF on this thread's fragment (a steep row block's warps only).
__device__ __forceinline__ void add_tile(Acc& a, const float* sF, const Lane& L) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[nt][e] += sF[L.row(e) * LDF + L.col(nt, e)];
}

// β of the chunk (kda), 1 on valid rows otherwise; 0 on padded rows.
template <int MODE>
__device__ __forceinline__ void load_beta(const CParams& p, int b, int h, int t0, int n, float* sB, float* sW) {
  const int t = threadIdx.x;
  if (t < C)
    sB[t] = t < n ? (MODE == kKda ? p.beta[(static_cast<size_t>(b) * p.T + t0 + t) * p.H + h] : 1.f) : 0.f;
  if (MODE == kCarve && t >= C && t < 2 * C) {  // CARVE's scalar write gate w (0 past n)
    const int r = t - C;
    sW[r] = r < n ? p.wsc[(static_cast<size_t>(b) * p.T + t0 + r) * p.H + h] : 0.f;
  }
}

// ---------------------------------------------------------------- forward
// Q K V S P U Qb Eb Kb×4 Qt Et Kh Bx Wg (bf16), G, Aw, X (fp32), β, and CARVE's w, u, column sums, h.
constexpr size_t kCFwdSmem = 17 * TILE * sizeof(bf16) + (3 * TILEF + C + C + C + 4 * C + 32 + 8) * sizeof(float);

// β (kda) or CARVE's w of a chunk by cp.async (0 past n); the row mask sB = 1 / 0 otherwise.
template <int MODE>
__device__ __forceinline__ void load_beta_async(const CParams& p, int b, int h, int t0, int n, float* sB, float* sW) {
  const int t = threadIdx.x;
  const size_t r = (static_cast<size_t>(b) * p.T + t0 + t) * p.H + h;
  if (t < C) {
    if (MODE == kKda)
      cp_async4(sB + t, t < n ? p.beta + r : p.beta, t < n);
    else
      sB[t] = t < n ? 1.f : 0.f;
  }
  if (MODE == kCarve && t >= C && t < 2 * C) {
    const size_t r2 = (static_cast<size_t>(b) * p.T + t0 + t - C) * p.H + h;
    cp_async4(sW + t - C, t - C < n ? p.wsc + r2 : p.wsc, t - C < n);
  }
}

template <int MODE>
__global__ void __launch_bounds__(NT, 1) cfwd_kernel(const CParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + TILE;
  bf16* sV = sK + TILE;
  bf16* sS = sV + TILE;
  bf16* sP = sS + TILE;
  bf16* sU = sP + TILE;
  bf16* sQb = sU + TILE;
  bf16* sEb = sQb + TILE;
  bf16* sKb = sEb + TILE;  // 4 tiles
  bf16* sQt = sKb + 4 * TILE;
  bf16* sEt = sQt + TILE;
  bf16* sKh = sEt + TILE;
  bf16* sBx = sKh + TILE;  // CARVE: erase logits of the chunk; gdn2: its erase gate b
  bf16* sWg = sBx + TILE;  // gdn2: the chunk's write gate w
  float* sGt = reinterpret_cast<float*>(sWg + TILE);
  float* sAw = sGt + TILEF;
  float* sX = sAw + TILEF;
  float* sB = sX + TILEF;
  float* sW = sB + C;       // CARVE: w of the chunk's rows
  float* sUc = sW + C;      // CARVE: u = U_b(m) of the chunk
  float* sColS = sUc + C;   // CARVE: [4][C] per warp-row output column sums / 64
  float* sH = sColS + 4 * C;  // CARVE: tanh(U1 m)
  int* sSteep = reinterpret_cast<int*>(sH + 32);  // [8] steep-block flags (cumsum_cols)
  const Lane L;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  CarveU cU;
  if (MODE == kCarve) carve_load_u(p, h, cU);
  if (MODE == kCarve && tid < C) {  // m_0 = 0, so u = U2 tanh(0) = 0 for the first chunk
    sUc[tid] = 0.f;
    p.cm[bh * p.nc * D + tid] = 0.f;
  }

  Acc st;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) st[nt][e] = p.S0 ? p.S0[bh * D * D + L.row(e) * D + L.col(nt, e)] : 0.f;
  store_bf(sS, st, L, [](float x, int, int) { return x; });

  // kda, gdn2, CARVE: the next chunk's inputs are loaded while this one is computed, each into
  // its tile as soon as this chunk's last read of it is behind a barrier (Q, K, bx after the
  // operand tiles are built, V after X, β / w and G after the solve; G alternates between two
  // fp32 tiles, the other being X), so the chunk loop does not wait on global memory.
  constexpr bool PF = MODE != kGla;
  auto load_qk = [&](int c0) {
    const int t1 = c0 * C, n1 = min(C, p.T - t1);
    load_tile(sQ, p.q + crow(p, b, t1, h), stride, n1);
    load_tile(sK, p.k + crow(p, b, t1, h), stride, n1);
    if (MODE == kCarve) load_tile(sBx, p.bx + crow(p, b, t1, h), stride, n1);
    if (MODE == kGdn2) load_tile(sBx, p.bg + crow(p, b, t1, h), stride, n1);
  };
  auto load_v = [&](int c0) {
    const int t1 = c0 * C, n1 = min(C, p.T - t1);
    load_tile(sV, p.v + crow(p, b, t1, h), stride, n1);
    if (MODE == kGdn2) load_tile(sWg, p.wg + crow(p, b, t1, h), stride, n1);
  };
  auto load_gb = [&](int c0, float* gdst) {
    const int t1 = c0 * C, n1 = min(C, p.T - t1);
    load_gate_tile(gdst, p.g + crow(p, b, t1, h), stride, n1);
    load_beta_async<MODE>(p, b, h, t1, n1, sB, sW);
  };
  for (int ci = 0; ci < p.nc; ++ci) {
    const int t0 = ci * C, n = min(C, p.T - t0);
    if (!PF) {
      load_tile(sQ, p.q + crow(p, b, t0, h), stride, n);
      load_tile(sK, p.k + crow(p, b, t0, h), stride, n);
      load_tile(sV, p.v + crow(p, b, t0, h), stride, n);
      load_gate_tile(sGt, p.g + crow(p, b, t0, h), stride, n);
      cp_async_commit();
      load_beta<MODE>(p, b, h, t0, n, sB, sW);
    } else if (ci == 0) {
      load_qk(0), load_v(0), load_gb(0, sGt);
      cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();
    if (p.bound) {
      bf16* dst = p.bound + (bh * p.nc + ci) * D * D;
      for (int i = tid; i < D * 8; i += NT) {
        const int r = i >> 3, c = i & 7;
        *reinterpret_cast<uint4*>(dst + r * D + c * 8) = *reinterpret_cast<const uint4*>(sS + r * LD + c * 8);
      }
    }
    cumsum_cols(sGt, sSteep);
    if (MODE == kCarve && ci > 0) carve_u(p, cU, sH, sUc);  // (chunk 0: u = 0)
    __syncthreads();
    const unsigned steep = steep_blocks(sSteep);
    build_tiles<MODE>(p, b, h, t0, n, sQ, sK, sGt, sQb, sEb, sKb, sQt, sEt, sKh, sUc, steep, PF ? sBx : nullptr);
    __syncthreads();
    const bool next = PF && ci + 1 < p.nc;
    if (next) load_qk(ci + 1);
    const bf16* Kw = sKb + L.wm * TILE;  // this warp's row block's K̄
    Acc o;
    zero(o);
    {
      Acc a, a2;
      zero(a2);
      if (MODE != kGla) {
        zero(a);
        gemm2<false, false, false, false>(a, sEb, Kw, a2, sQb, Kw, L);  // Ē K̄ᵀ, Q̄ K̄ᵀ
        store_f(sAw, a, L, [](float x, int t, int j) { return t > j ? x : 0.f; });
        store_bf(sP, a2, L, [](float x, int t, int j) { return t >= j ? x : 0.f; });
        zero(a);
        gemm2<false, false, false, false>(a, sEt, sS, o, sQt, sS, L);  // Ẽ S0ᵀ, Q̃ S0ᵀ
        store_f(sX, a, L, [&](float x, int t, int c) {
          float z = bf(sV, t, c);
          if (MODE == kGdn2) z = t < n ? z * bf(sWg, t, c) : 0.f;  // (PF: gdn2's w tile)
          if (MODE == kCarve) z *= sW[t];
          return z - x;
        });
      } else {
        gemm2<false, false, false, false>(a2, sQb, Kw, o, sQt, sS, L);  // Q̄ K̄ᵀ, Q̃ S0ᵀ
        store_bf(sP, a2, L, [](float x, int t, int j) { return t >= j ? x : 0.f; });
      }
    }
    __syncthreads();
    if (steep) {
      steep_pairs<MODE>(steep_in(p), b, h, t0, n, sGt, sUc, steep, sAw, sP);
      __syncthreads();
    }
    if (next) load_v(ci + 1);
    const bf16* U = sV;
    if (MODE != kGla) {
      float x[16];
      subst_fwd(sAw, sX, sB, x);
      const int c = tid >> 2, pp = tid & 3;
#pragma unroll
      for (int i = 0; i < 16; ++i) sU[(4 * i + pp) * LD + c] = __float2bfloat16(x[i]);
      __syncthreads();
      U = sU;
    }
    if (next) load_gb(ci + 1, sX);  // (sX: read by the solve only)
    if (PF) cp_async_commit();
    gemm<false, true>(o, sP, U, L);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = L.row(2 * hh);
        if (t < n)
          *reinterpret_cast<uint32_t*>(p.o + crow(p, b, t0 + t, h) + L.col(nt, 0)) =
              pack(o[nt][2 * hh] * p.scale, o[nt][2 * hh + 1] * p.scale);
      }
    const bool content = MODE == kCarve && ci + 1 < p.nc;  // the next chunk's m_c = mean of these outputs
    if (content)  // (every chunk but the last is full)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          float x = o[nt][u] + o[nt][2 + u];
          x = col8_sum(x);
          if (L.g == 0) sColS[L.wm * C + L.col(nt, u)] = x * (p.scale / C);
        }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] *= __expf(sGt[(C - 1) * LDF + L.col(nt, e)]);
    gemm<true, true>(st, U, sKh, L);  // + Uᵀ K̂
    __syncthreads();
    store_bf(sS, st, L, [](float x, int, int) { return x; });
    if (content) {  // h for the next chunk; its u follows after the next loop-top barrier
      if (tid < C) p.cm[(bh * p.nc + ci + 1) * D + tid] = sColS[tid] + sColS[C + tid] + sColS[2 * C + tid] + sColS[3 * C + tid];
      carve_h(p, cU, sColS, 4, sH);
    }
    if (PF) {  // the next chunk's G arrived in the X tile
      float* t = sGt;
      sGt = sX, sX = t;
    }
  }
  if (p.S_out)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) p.S_out[bh * D * D + L.row(e) * D + L.col(nt, e)] = st[nt][e];
}

// ---------------------------------------------------------------- backward
// Q K V dO S0 dS P/dP U dR Qb Eb Kb×4 Qt Et Kh/dAw (bf16), G, Aw, X/dU/dR (fp32), β, sums.
// CARVE adds w, u, m, dm (C each), h (32), the per-warp-row du sums (4 C) and the per-warp
// partials of U2ᵀ du ([8][32]) and U1ᵀ dh ([8][C]).
constexpr size_t kCBwdSmem =
    18 * TILE * sizeof(bf16) + (3 * TILEF + C + 2 * C + 4 * C + 8 + 5 * C + 64 + 4 * C + 8 * 32 + 8 * C + 8) * sizeof(float);

// PATH: kBwdFused, one CTA per (b, h) walks the chunks backwards carrying dS (and CARVE's dm);
// kBwdTwoPhase, one CTA per (b, h, chunk) from the chunk's start state and its end-of-chunk
// gradient (p.dSend, from the state pass), without the dS update, U from the prep's U₀ and W;
// CARVE's split backward (carve_bwd at small B·H): kBwdCarveChain walks the chunks like the
// fused kernel but computes only what the chain (dS, dm) needs and writes each chunk's dS_end
// (p.dSend) and dm/64 (p.dmc); kBwdCarvePar then makes the token gradients one CTA per chunk.
// With p.flags both run in one launch (cbwd_carve_split_kernel): the chain publishes chunk c's
// flag once its dS_end and dm are written, and the chunk CTA of c waits for it.
enum BwdPath { kBwdFused = 0, kBwdTwoPhase = 1, kBwdCarveChain = 2, kBwdCarvePar = 3 };
__device__ __forceinline__ unsigned ld_acquire(const unsigned* a) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(a) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(unsigned* a, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(a), "r"(v) : "memory");
}
template <int MODE, int PATH>
__device__ __forceinline__ void cbwd_body(const CParams& p, const int h, const int b, const int c_last) {
  constexpr bool CH = PATH == kBwdTwoPhase || PATH == kBwdCarvePar;  // one chunk per CTA, dS from p.dSend
  constexpr bool PREP = PATH == kBwdTwoPhase;                          // U = U₀ − W S0ᵀ from the prep
  constexpr bool CHAIN = PATH == kBwdFused || PATH == kBwdCarveChain;  // carries dS, dm to earlier chunks
  constexpr bool OUT = PATH != kBwdCarveChain;                         // writes the token gradients
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
  bf16* sQb = sdR + TILE;
  bf16* sEb = sQb + TILE;
  bf16* sKb = sEb + TILE;  // 4 tiles
  bf16* sQt = sKb + 4 * TILE;
  bf16* sEt = sQt + TILE;
  bf16* sKh = sEt + TILE;  // later dAw
  float* sGt = reinterpret_cast<float*>(sKh + TILE);
  float* sAw = sGt + TILEF;  // later dG
  float* sX = sAw + TILEF;
  float* sB = sX + TILEF;
  float* sRowB = sB + C;      // [2][C]
  float* sColL = sRowB + 2 * C;  // [4][C] per wm: Σ over rows of the G_last terms
  float* sW = sColL + 4 * C + 8;  // CARVE: w, u, m, dm/64 of the chunk, h, dh, du sums [4][C]
  float* sUc = sW + C;
  float* sMb = sUc + C;       // [2][C] m of this chunk / of the next one (ping-pong)
  float* sDm = sMb + 2 * C;
  float* sHb = sDm + C;       // [2][32] h, likewise
  float* sDu = sHb + 64;      // [4][C]
  float* sDhP = sDu + 4 * C;  // [8][32] per-warp partials of U2ᵀ du
  float* sDmP = sDhP + 8 * 32;  // [8][C] per-warp partials of U1ᵀ dh
  int* sSteep = reinterpret_cast<int*>(sDmP + 8 * C);  // [8] steep-block flags (cumsum_cols)
  const Lane L;
  const int tid = threadIdx.x, c_stop = CH ? c_last : 0;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;
  const float scale = p.scale;
  float aU1[8] = {}, aU2[8] = {};  // CARVE: this thread's dU1 [r = tid/8][8·(tid%8)..], dU2 [c = tid/4][8·(tid%4)..]
  if (PATH == kBwdCarvePar && p.flags) {  // wait until the chain pass has reached this chunk
    if (tid == 0)
      while (ld_acquire(p.flags + bh * p.nc + c_last) == 0) __nanosleep(200);
    __syncthreads();
  }
  if (MODE == kCarve && tid < C)  // dm/64 for this CTA's first chunk's dO: 0, or the chain pass's
    sDm[tid] = PATH == kBwdCarvePar ? __ldcg(p.dmc + (bh * p.nc + c_last) * D + tid) : 0.f;
  CarveU cU;
  if (MODE == kCarve) {  // m and h of the first chunk walked (the last one)
    carve_load_u(p, h, cU);
    if (tid < C) sMb[(c_last & 1) * C + tid] = p.cm[(bh * p.nc + c_last) * D + tid];
    __syncthreads();
    carve_h(p, cU, sMb + (c_last & 1) * C, 1, sHb + (c_last & 1) * 32);
  }

  Acc dS;
  if (!CH) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dS[nt][e] = p.dST ? p.dST[bh * D * D + L.row(e) * D + L.col(nt, e)] : 0.f;
    store_bf(sdS, dS, L, [](float x, int, int) { return x; });
  } else {
    zero(dS);
  }

  for (int ci = c_last; ci >= c_stop; --ci) {
    const int t0 = ci * C, n = min(C, p.T - t0);
    float* sM = sMb + (ci & 1) * C;  // this chunk's m and h; the other halves take the next chunk's
    float* sH = sHb + (ci & 1) * 32;
    float* sMn = sMb + ((ci & 1) ^ 1) * C;
    float* sHn = sHb + ((ci & 1) ^ 1) * 32;
    load_tile(sQ, p.q + crow(p, b, t0, h), stride, n);
    load_tile(sK, p.k + crow(p, b, t0, h), stride, n);
    load_tile(sV, p.v + crow(p, b, t0, h), stride, n);
    load_tile(sdO, p.dout + crow(p, b, t0, h), stride, n);
    load_tile(sS0, p.bound_in + (bh * p.nc + ci) * D * D, D, C);
    if (CH) load_tile(sdS, p.dSend + (bh * p.nc + ci) * D * D, D, C);
    if (PREP && MODE != kGla) {  // the prep's U₀ and W: U = U₀ − W S0ᵀ without the solve
      load_tile(sU, p.Uc + (bh * p.nc + ci) * D * D, D, C);
      load_tile(sdR, p.Wc + (bh * p.nc + ci) * D * D, D, C);
    }
    load_gate_tile(sGt, p.g + crow(p, b, t0, h), stride, n);
    cp_async_commit();
    load_beta<MODE>(p, b, h, t0, n, sB, sW);
    cp_async_wait<0>();
    __syncthreads();
    if (CH)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dS[nt][e] = bf(sdS, L.row(e), L.col(nt, e));
    if (PATH == kBwdCarveChain) {  // this chunk's dS_end and dm/64 for the chunk pass
      bf16* dst = p.dSend + (bh * p.nc + ci) * D * D;
      for (int i = tid; i < D * 8; i += NT) {
        const int r = i >> 3, c = i & 7;
        *reinterpret_cast<uint4*>(dst + r * D + c * 8) = *reinterpret_cast<const uint4*>(sdS + r * LD + c * 8);
      }
      if (tid < C) p.dmc[(bh * p.nc + ci) * D + tid] = sDm[tid];
      __threadfence();  // (published after the next barrier)
    }
    cumsum_cols(sGt, sSteep);
    if (MODE == kCarve) {  // (sM, sH of this chunk were made at the end of the previous iteration)
      carve_u(p, cU, sH, sUc);
      if (p.cgrad && ci + 1 < p.nc)  // o of this (full) chunk feeds m_{c+1}: dO += dm / 64
        for (int i = tid; i < C * D; i += NT) {
          const int t = i >> 6, c = i & 63;
          sdO[t * LD + c] = __float2bfloat16(__bfloat162float(sdO[t * LD + c]) + sDm[c]);
        }
    }
    __syncthreads();
    if (PATH == kBwdCarveChain && p.flags && tid == 0) st_release(p.flags + bh * p.nc + ci, 1u);
    const unsigned steep = steep_blocks(sSteep);
    const bool steep_wm = (steep >> L.wm) & 1;  // this warp's row block
    build_tiles<MODE>(p, b, h, t0, n, sQ, sK, sGt, sQb, sEb, sKb, sQt, sEt, sKh, sUc, steep);
    __syncthreads();
    const bf16* Kw = sKb + L.wm * TILE;
    {
      Acc a, a2;
      zero(a2);
      if (MODE != kGla) {
        zero(a);
        gemm2<false, false, false, false>(a, sEb, Kw, a2, sQb, Kw, L);  // Ē K̄ᵀ, Q̄ K̄ᵀ
        store_f(sAw, a, L, [](float x, int t, int j) { return t > j ? x : 0.f; });
        zero(a);
        if (PREP) {  // U = U₀ − W S0ᵀ (each thread rewrites only its own elements of U₀)
          gemm<false, false>(a, sdR, sS0, L);
          store_bf(sU, a, L, [&](float x, int t, int c) { return bf(sU, t, c) - x; });
        } else {
          gemm<false, false>(a, sEt, sS0, L);
          store_f(sX, a, L, [&](float x, int t, int c) {
            float z = bf(sV, t, c);
            if (MODE == kGdn2) z = t < n ? z * __bfloat162float(p.wg[crow(p, b, t0 + t, h) + c]) : 0.f;
            if (MODE == kCarve) z *= sW[t];
            return z - x;
          });
        }
      }
      if (MODE == kGla) gemm<false, false>(a2, sQb, Kw, L);
      store_bf(sP, a2, L, [](float x, int t, int j) { return t >= j ? x : 0.f; });
    }
    __syncthreads();
    if (steep) {
      steep_pairs<MODE>(steep_in(p), b, h, t0, n, sGt, sUc, steep, sAw, sP);
      __syncthreads();
    }
    const bf16* U = sV;
    if (MODE != kGla && !PREP) {
      float x[16];
      subst_fwd(sAw, sX, sB, x);
      const int c = tid >> 2, pp = tid & 3;
#pragma unroll
      for (int i = 0; i < 16; ++i) sU[(4 * i + pp) * LD + c] = __float2bfloat16(x[i]);
      if (MODE == kKda)  // R = β X: the dS update below takes (β dR)ᵀ Ẽ
        for (int i = tid; i < C * D; i += NT) {
          const int t = i >> 6, cc = i & 63;
          sEt[t * LD + cc] = __float2bfloat16(__bfloat162float(sEt[t * LD + cc]) * sB[t]);
        }
    }
    if (MODE != kGla) U = sU;
    __syncthreads();
    {
      Acc a, c2;  // dU = K̂ dSᵀ + scale Pᵀ dO
      zero(a);
      zero(c2);
      gemm2<false, false, true, true>(a, sKh, sdS, c2, sP, sdO, L);  // K̂ dSᵀ, Pᵀ dO
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[nt][e] += scale * c2[nt][e];
      store_f(sX, a, L, [](float x, int, int) { return x; });
      if (MODE == kGla) store_bf(sdR, a, L, [](float x, int, int) { return x; });
    }
    __syncthreads();
    if (MODE != kGla) {
      float x[16];
      const int c = tid >> 2, pp = tid & 3;
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = sX[(4 * i + pp) * LDF + c];
      subst_bwd_scalar(sAw, sB, x);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        sX[(4 * i + pp) * LDF + c] = x[i];
        sdR[(4 * i + pp) * LD + c] = __float2bfloat16(x[i]);
      }
      __syncthreads();
    }
    float rowB[2] = {0.f, 0.f}, colL[4][2] = {}, colU[4][2] = {};
    bf16* sdAw = sKh;  // K̂ is not read as a tile any more
    {
      Acc da, dp;
      zero(da);
      zero(dp);
      if (MODE != kGla && OUT)
        gemm2<false, false, false, false>(da, sdR, U, dp, sdO, U, L);  // dR Uᵀ, dO Uᵀ
      else if (MODE != kGla)
        gemm<false, false>(da, sdR, U, L);  // (the chain pass needs no dP)
      else
        gemm<false, false>(dp, sdO, U, L);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = L.row(e), j = L.col(nt, e);
          if (MODE != kGla) {
            const float dA = t > j ? -da[nt][e] : 0.f;
            if (MODE == kKda) rowB[e >> 1] += dA * sAw[t * LDF + j];
            da[nt][e] = MODE == kKda ? dA * sB[t] : dA;  // dAw
          }
          dp[nt][e] = t >= j ? scale * dp[nt][e] : 0.f;
        }
      __syncthreads();  // every read of P, K̂ and Aw is done
      if (MODE != kGla) store_bf(sdAw, da, L, [](float x, int, int) { return x; });
      if (OUT) store_bf(sP, dp, L, [](float x, int, int) { return x; });  // dP (scaled, masked)
    }
    __syncthreads();
    Acc dG;  // gate gradient of this thread's (t, c) elements
    if (!OUT) zero(dG);
    // steep blocks: Aw is dead from here to the dG store, so its tile takes the in-block parts
    // of dq, then of the erase gradient, then of dk
    if (OUT && steep) {
      steep_grads<MODE>(steep_in(p), b, h, t0, n, true, sP, sdAw, sQ, sK, sGt, sUc, steep, sAw);
      __syncthreads();
    }
    if (OUT) {
      Acc a, c2;  // dq = (dP K̄) ∘ e^{G − G_s} + scale e^G (dO S0)
      zero(a);
      zero(c2);
      gemm2<false, true, false, true>(a, sP, Kw, c2, sdO, sS0, L);  // dP K̄, dO S0
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = L.row(e), c = L.col(nt, e);
          const float G = sGt[t * LDF + c], Gs = sGt[(t & ~15) * LDF + c];
          a[nt][e] = a[nt][e] * __expf(G - Gs) + scale * __expf(G) * c2[nt][e];
        }
      if (steep_wm) add_tile(a, sAw, L);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dG[nt][e] = a[nt][e] * bf(sQ, L.row(e), L.col(nt, e));
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = L.row(2 * hh);
          if (t < n)
            *reinterpret_cast<uint32_t*>(p.dq + crow(p, b, t0 + t, h) + L.col(nt, 0)) =
                pack(a[nt][2 * hh], a[nt][2 * hh + 1]);
        }
    }
    // Gradient on ê (the erase vector as it sits in Ē, Ẽ: k for kda, b ⊙ k for gdn2) through
    // A (deA; dAw carries kda's β) and through X = z − Ẽ S0ᵀ (deX = −e^G (dR S0), to be
    // multiplied by kda's β, since R = β X there).
    Acc deA, deX;
    if (MODE != kGla) {
      zero(deA);
      zero(deX);
      gemm2<false, true, false, true>(deA, sdAw, Kw, deX, sdR, sS0, L);  // dAw K̄, dR S0
      if (steep) {
        __syncthreads();  // (every read of dq's parts is done)
        steep_grads<MODE>(steep_in(p), b, h, t0, n, true, sdAw, sdAw, sQ, sK, sGt, sUc, steep, sAw);
        __syncthreads();
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = L.row(e), c = L.col(nt, e);
          const float G = sGt[t * LDF + c], Gs = sGt[(t & ~15) * LDF + c];
          deA[nt][e] *= __expf(G - Gs);
          deX[nt][e] *= -__expf(G);
        }
      if (steep_wm) add_tile(deA, sAw, L);
    }
    {
      Acc a, a4;  // core gradient on k: Σ_I (dP_Iᵀ Q̄_I + dAw_Iᵀ Ē_I) ∘ e^{G_{s_I} − G} + (U dS) ∘ e^{G_last − G}
      zero(a4);
      if (OUT) gemm<false, true>(a4, U, sdS, L);
      if (OUT && steep) {
        __syncthreads();  // (every read of the erase gradient's parts is done)
        steep_grads<MODE>(steep_in(p), b, h, t0, n, false, sP, sdAw, sQ, sK, sGt, sUc, steep, sAw);
        __syncthreads();
      }
      Acc dk;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = L.row(e), c = L.col(nt, e);
          const float x = a4[nt][e] * __expf(sGt[(C - 1) * LDF + c] - sGt[t * LDF + c]);
          dk[nt][e] = x;
          colL[nt][e & 1] += x * bf(sK, t, c);
        }
      if (OUT && steep_wm) add_tile(dk, sAw, L);
      for (int I = L.wm + (steep_wm ? 1 : 0); OUT && I < 4; ++I) {  // (a steep block's own rows: above)
        zero(a);
        gemm_k<true, true>(a, sP, sQb, L, I);
        if (MODE != kGla) gemm_k<true, true>(a, sdAw, sEb, L, I);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = L.row(e), c = L.col(nt, e);
            dk[nt][e] += a[nt][e] * __expf(sGt[16 * I * LDF + c] - sGt[j * LDF + c]);
          }
      }
      // dG, then the mixer's own gradients
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = L.row(e), c = L.col(nt, e);
          const float kv = bf(sK, t, c);
          dG[nt][e] -= dk[nt][e] * kv;
          if (MODE == kKda) {  // ê = k; A = diag(β)·(ĒK̄ᵀ), R = β X
            const float dke = deA[nt][e] + sB[t] * deX[nt][e];
            dG[nt][e] += dke * kv;
            rowB[e >> 1] += deX[nt][e] * kv;
            dk[nt][e] += dke;
          } else if (MODE == kGdn2) {  // ê = b ⊙ k
            const float bv = t < n ? __bfloat162float(p.bg[crow(p, b, t0 + t, h) + c]) : 0.f;
            const float de = deA[nt][e] + deX[nt][e];
            dG[nt][e] += de * bv * kv;
            if (t < n) p.dbg[crow(p, b, t0 + t, h) + c] = __float2bfloat16(de * kv);
            dk[nt][e] += bv * de;
          } else if (MODE == kCarve) {  // ê = b ⊙ k, b = σ(bx + u): dbx = db b (1 − b), du = Σ_t dbx
            const float bv = t < n ? sigm(__bfloat162float(p.bx[crow(p, b, t0 + t, h) + c]) + sUc[c]) : 0.f;
            const float de = deA[nt][e] + deX[nt][e];
            dG[nt][e] += de * bv * kv;
            const float dbx = de * kv * bv * (1.f - bv);
            if (OUT && t < n) p.dbx[crow(p, b, t0 + t, h) + c] = __float2bfloat16(dbx);
            colU[nt][e & 1] += dbx;
            dk[nt][e] += bv * de;
          }
        }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = L.row(2 * hh);
          if (OUT && t < n)
            *reinterpret_cast<uint32_t*>(p.dk + crow(p, b, t0 + t, h) + L.col(nt, 0)) =
                pack(dk[nt][2 * hh], dk[nt][2 * hh + 1]);
        }
    }
    // dv (and dβ, dw) from dR = dZ
#pragma unroll
    for (int nt = 0; nt < 4 && OUT; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = L.row(2 * hh), c = L.col(nt, 0);
        const float2 r = *reinterpret_cast<const float2*>(sX + t * LDF + c);
        if (t >= n) continue;
        const size_t gi = crow(p, b, t0 + t, h) + c;
        float d0 = r.x, d1 = r.y;
        if (MODE == kKda) {
          rowB[hh] += r.x * bf(sV, t, c) + r.y * bf(sV, t, c + 1);
          d0 *= sB[t], d1 *= sB[t];
        } else if (MODE == kCarve) {  // z = w v with a scalar w: dw = Σ_c dz v
          rowB[hh] += r.x * bf(sV, t, c) + r.y * bf(sV, t, c + 1);
          d0 *= sW[t], d1 *= sW[t];
        } else if (MODE == kGdn2) {
          const float w0 = __bfloat162float(p.wg[gi]), w1 = __bfloat162float(p.wg[gi + 1]);
          *reinterpret_cast<uint32_t*>(p.dwg + gi) = pack(r.x * bf(sV, t, c), r.y * bf(sV, t, c + 1));
          d0 *= w0, d1 *= w1;
        }
        *reinterpret_cast<uint32_t*>(p.dv + gi) = pack(d0, d1);
      }
    {
      Acc a, c2;  // dS at the chunk start = dS ∘ e^{G_last} + scale dOᵀ Q̃ − dRᵀ Ẽ (fused path only)
      zero(a);
      zero(c2);
      if (!CHAIN) {
      } else if (MODE != kGla) {
        gemm2<true, true, true, true>(a, sdO, sQt, c2, sdR, sEt, L);  // dOᵀ Q̃, dRᵀ Ẽ
      } else {
        gemm<true, true>(a, sdO, sQt, L);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int v = L.row(e), c = L.col(nt, e);
          const float el = __expf(sGt[(C - 1) * LDF + c]);
          colL[nt][e & 1] += dS[nt][e] * bf(sS0, v, c) * el;
          dS[nt][e] = dS[nt][e] * el + scale * a[nt][e] - c2[nt][e];
        }
    }
    // reductions: G_last column sums, dβ row sums
    if (OUT) store_col_sums(colL, sColL, L);
    if (MODE == kCarve && CHAIN) store_col_sums(colU, sDu, L);
    if ((MODE == kKda || MODE == kCarve) && OUT)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float x = rowB[hh];
        x = quad_sum(x);
        if (L.tig == 0) sRowB[L.wn * C + L.row(2 * hh)] = x;
      }
    __syncthreads();  // every read of the tiles, sdS and Aw is done
    if (CHAIN) store_bf(sdS, dS, L, [](float x, int, int) { return x; });
    if (OUT)
      store_f(sAw, dG, L, [&](float x, int t, int c) {
        return t == C - 1 ? x + sColL[c] + sColL[C + c] + sColL[2 * C + c] + sColL[3 * C + c] : x;
      });
    if (MODE == kKda && tid < C && tid < n)
      p.dbeta[(static_cast<size_t>(b) * p.T + t0 + tid) * p.H + h] = sRowB[tid] + sRowB[C + tid];
    if (MODE == kCarve && OUT && tid < C && tid < n)
      p.dwsc[(static_cast<size_t>(b) * p.T + t0 + tid) * p.H + h] = sRowB[tid] + sRowB[C + tid];
    if (MODE == kCarve && CHAIN) {
      // u = U2 h, h = tanh(U1 m): dU2 += du hᵀ; U2ᵀ du with this thread's U2 slice, summed
      // over the warp's 8 rows c by shuffles, the 8 warps' partials in sDhP
      const int c = tid >> 2, part = tid & 3;
      const float du = sDu[c] + sDu[C + c] + sDu[2 * C + c] + sDu[3 * C + c];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        aU2[j] += du * (8 * part + j < p.rank ? sH[8 * part + j] : 0.f);
        float x = cU.u2[j] * du;
        x = col8_sum(x);
        if ((tid & 31) < 4) sDhP[(tid >> 5) * 32 + 8 * part + j] = x;
      }
    }
    __syncthreads();
    if (MODE == kCarve && CHAIN) {  // dh = (U2ᵀ du) ⊙ (1 − h²); dU1 += dh mᵀ; U1ᵀ dh partials (warp's 4 ranks) in sDmP
      const int r = tid >> 3, part = tid & 7;
      float dh = 0.f;
      if (r < p.rank) {
#pragma unroll
        for (int w = 0; w < 8; ++w) dh += sDhP[w * 32 + r];
        dh *= 1.f - sH[r] * sH[r];
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        aU1[j] += dh * sM[8 * part + j];
        float x = cU.u1[j] * dh;
        x += __shfl_xor_sync(FULL, x, 8);
        x += __shfl_xor_sync(FULL, x, 16);
        if ((tid & 31) < 8) sDmP[(tid >> 5) * C + 8 * part + j] = x;
      }
    }
    if (MODE == kCarve && CHAIN && ci > 0 && tid < C) sMn[tid] = p.cm[(bh * p.nc + ci - 1) * D + tid];
    if (OUT) rcumsum_cols(sAw);  // g_t enters every G_s, s ≥ t, of the chunk
    __syncthreads();
    if (MODE == kCarve && CHAIN) {
      if (tid < C) {  // dm = U1ᵀ dh, into the previous chunk's dO (/ 64)
        float x = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) x += sDmP[w * C + tid];
        sDm[tid] = p.cgrad ? x * (1.f / C) : 0.f;
      }
      if (ci > 0) carve_h(p, cU, sMn, 1, sHn);  // h of the previous chunk (its u at its loop top)
    }
    for (int i = tid; OUT && i < C * D; i += NT) {
      const int t = i >> 6, c = i & 63;
      if (t < n) p.dg[crow(p, b, t0 + t, h) + c] = sAw[t * LDF + c];
    }
    __syncthreads();
  }
  if (CHAIN && p.dS0)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) p.dS0[bh * D * D + L.row(e) * D + L.col(nt, e)] = dS[nt][e];
  if (MODE == kCarve && CHAIN) {  // U1, U2 are per head: the batch's CTAs add into the same gradient
    {
      const int r = tid >> 3, part = tid & 7;
      if (r < p.rank)
#pragma unroll
        for (int j = 0; j < 8; ++j) atomicAdd(p.dU1 + (static_cast<size_t>(h) * p.rank + r) * D + 8 * part + j, aU1[j]);
    }
    const int c = tid >> 2, part = tid & 3;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (8 * part + j < p.rank) atomicAdd(p.dU2 + (static_cast<size_t>(h) * D + c) * p.rank + 8 * part + j, aU2[j]);
  }
}
template <int MODE, int PATH>
__global__ void __launch_bounds__(NT, 1) cbwd_kernel(const CParams p) {
  if (PATH == kBwdTwoPhase || PATH == kBwdCarvePar)
    cbwd_body<MODE, PATH>(p, blockIdx.y, blockIdx.z, blockIdx.x);
  else
    cbwd_body<MODE, PATH>(p, blockIdx.x, blockIdx.y, p.nc - 1);
}
// ---------------------------------------------------------------- two-phase (chunk-parallel) path
// The kernels above walk a (b, h)'s chunks in one CTA: B·H CTAs (16 at B=1 H=16 on 132 SMs).
// Per chunk the recurrence is affine in the start state S0 (rows = value channels):
//   S_end = S0 (diag(e^{G_last}) − M) + E,   M = Wᵀ K̂ [dk×dk],   E = U₀ᵀ K̂ [dv×dk]
// with T = I + diag(β) Aw, W = T⁻¹ diag(β) Ẽ, U₀ = T⁻¹ diag(β) Z (so U = U₀ − W S0ᵀ) and
// K̂ = k e^{G_last − G}; gla has no erase (M = 0, U₀ = V). The adjoint, with Q' = Q̃ − P W (so
// that O = scale (P U₀ + Q' S0ᵀ)):
//   dS0 = dS_end (diag(e^{G_last}) − M)ᵀ + scale dOᵀ Q'.
// Three launches per pass, as the delta rule's two-phase path (delta_rule.cu): (1) cprep_kernel,
// one CTA per (b, h, chunk), writes M (bf16), E (fp32), e^{G_last}, and W, U₀ (bf16) — all the
// solves; (2) cstate_kernel runs the recurrence: the rows of S evolve independently, so 4 CTAs
// per (b, h) take 16 value rows each, their 4 warps 16 key columns each; M, E and e^{G_last}
// stream through a ring of cp.async stages; it writes every chunk's start state (forward, the
// boundary) or end-of-chunk gradient (backward); (3) one CTA per (b, h, chunk) does the rest
// from those states: the forward's output by cfwd_main_kernel (U = U₀ − W S0ᵀ: no solve), the
// backward's gradients by cbwd_kernel<MODE, kBwdTwoPhase> (the fused chunk body without the dS
// update, U from U₀ and W likewise). CARVE cannot take this path: its content gate makes chunk
// c's erase depend on chunk c − 1's output, so the chunk terms cannot be built before the
// recurrence has run (its backward has its own split, cbwd_carve_split_kernel).

__device__ __forceinline__ size_t coff(const CParams& p, size_t bh, int ci) { return (bh * p.nc + ci) * D * D; }
// Fragment → global [64][64] bf16, row stride 64.
__device__ __forceinline__ void cfrag_store_bf(bf16* dst, const Acc& c, const Lane& L) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      *reinterpret_cast<uint32_t*>(dst + L.row(2 * hh) * D + L.col(nt, 0)) = pack(c[nt][2 * hh], c[nt][2 * hh + 1]);
}

// chunk_common.cuh's subst_fwd_regs on two right-hand sides at once (x and y, same thread
// layout): the prep's two solves share every Aw load and interleave their dependency chains.
__device__ __forceinline__ void subst_fwd_regs2(const float* sAw, const float* sB, float (&x)[16], float (&y)[16]) {
  const int p = threadIdx.x & 3, lane = threadIdx.x & 31;
  float ax[16], ay[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) ax[i] = ay[i] = 0.f;
#pragma unroll
  for (int jb = 0; jb < 16; ++jb) {
    const float4 ad = *reinterpret_cast<const float4*>(sAw + (4 * jb + p) * LDF + 4 * jb);
    const float adj[4] = {ad.x, ad.y, ad.z, ad.w};
    float xs[4], ys[4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      float xj = 0.f, yj = 0.f;
      if (p == jj) {
        const float bj = sB[4 * jb + jj];
        x[jb] = bj * (x[jb] - ax[jb]);
        y[jb] = bj * (y[jb] - ay[jb]);
        xj = x[jb], yj = y[jb];
      }
      xs[jj] = __shfl_sync(FULL, xj, (lane & ~3) | jj);
      ys[jj] = __shfl_sync(FULL, yj, (lane & ~3) | jj);
      if (p > jj) ax[jb] += adj[jj] * xs[jj], ay[jb] += adj[jj] * ys[jj];
    }
#pragma unroll
    for (int i = jb + 1; i < 16; ++i) {
      const float4 a = *reinterpret_cast<const float4*>(sAw + (4 * i + p) * LDF + 4 * jb);
      ax[i] += a.x * xs[0] + a.y * xs[1] + a.z * xs[2] + a.w * xs[3];
      ay[i] += a.x * ys[0] + a.y * ys[1] + a.z * ys[2] + a.w * ys[3];
    }
  }
}

// (1) prep. Forward: M, E = U₀ᵀ K̂ (gla: E = Vᵀ K̂). Backward: M, E = scale dOᵀ Q' (gla: scale dOᵀ Q̃).
// Eight bf16 tiles, G and Aw (fp32) and β: 108 KB, so two CTAs share an SM and one's barriers
// and solves overlap the other's work. Tiles are reused as they die: K̂ overwrites K and Q̃
// overwrites Q in place (each thread rewrites only the elements it read), Ẽ = Ē e^{G_s} is
// rebuilt from Ē for the solve, and W, U₀ / Q', dO take K̄'s tiles once Aw and P are made.
//   tile 0: forward K → K̂;   backward Q → Q̃
//   tile 1: forward V;       backward K → K̂
//   tile 2: Ē;               tile 3: backward Q̄ → P
//   tiles 4–7: K̄ per 16-row block → W, then U₀ (forward) / Q', dO, V → U₀ (backward)
// Both passes export W and U₀ (bf16) for their chunk kernels, which then need no solve for U.
constexpr size_t kCPrepSmem = 8 * TILE * sizeof(bf16) + (2 * TILEF + C + 8) * sizeof(float);
static_assert(kCPrepSmem + 1024 <= 228 * 1024 / 2, "two prep CTAs per SM");

// Prep tiles from K (→ K̂ in place), the gates and, for the backward, Q (→ Q̃ in place):
// Ē = ê e^{G − G_s}, K̄_I = k e^{G_{16I} − G} (rows ≤ 16I+15, else 0), Q̄ = q e^{G − G_s}.
template <int MODE, bool kQ>
__device__ __forceinline__ void prep_tiles(const CParams& p, int b, int h, int t0, int n, bf16* sQ, bf16* sK,
                                           const float* sGt, bf16* sQb, bf16* sEb, bf16* sKb, unsigned steep) {
  for (int i = threadIdx.x; i < C * 32; i += NT) {
    const int t = i >> 5, c = 2 * (i & 31);
    float qb[2], qt[2], eb[2], kh[2], kb[4][2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const float G = sGt[t * LDF + c + u], Gs = sGt[(t & ~15) * LDF + c + u], Gl = sGt[(C - 1) * LDF + c + u];
      const float kv = bf(sK, t, c + u), f = __expf(G - Gs);
      float ev = kv;
      if (MODE == kGdn2) ev = t < n ? kv * __bfloat162float(p.bg[crow(p, b, t0 + t, h) + c + u]) : 0.f;
      eb[u] = ev * f, kh[u] = kv * __expf(Gl - G);
      if (kQ) {
        const float qv = bf(sQ, t, c + u);
        qb[u] = qv * f, qt[u] = qv * __expf(G);
      }
#pragma unroll
      for (int I = 0; I < 4; ++I) kb[I][u] = kbar_row(t, I, steep) ? kv * __expf(sGt[16 * I * LDF + c + u] - G) : 0.f;
    }
    const int o = t * LD + c;
    *reinterpret_cast<uint32_t*>(sK + o) = pack(kh[0], kh[1]);
    *reinterpret_cast<uint32_t*>(sEb + o) = pack(eb[0], eb[1]);
    if (kQ) {
      *reinterpret_cast<uint32_t*>(sQ + o) = pack(qt[0], qt[1]);
      *reinterpret_cast<uint32_t*>(sQb + o) = pack(qb[0], qb[1]);
    }
#pragma unroll
    for (int I = 0; I < 4; ++I) *reinterpret_cast<uint32_t*>(sKb + I * TILE + o) = pack(kb[I][0], kb[I][1]);
  }
}

template <int MODE, bool kBwd>
__global__ void __launch_bounds__(NT, 2) cprep_kernel(const CParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sT = reinterpret_cast<bf16*>(smem);
  bf16* sQ = sT;                              // backward: Q → Q̃
  bf16* sK = kBwd ? sT + TILE : sT;           // K → K̂
  bf16* sV = sT + TILE;                       // forward
  bf16* sEb = sT + 2 * TILE;
  bf16* sQb = sT + 3 * TILE;                  // backward: Q̄, then P
  bf16* sKb = sT + 4 * TILE;                  // 4 tiles
  bf16* sW = sKb;                             // after Aw and P
  bf16* sU0 = sKb + TILE;                     // forward U₀; backward Q'
  bf16* sdO = sKb + 2 * TILE;                 // backward, loaded while Aw is made
  bf16* sVb = sKb + 3 * TILE;                 // backward: V → U₀ in place
  float* sGt = reinterpret_cast<float*>(sT + 8 * TILE);
  float* sAw = sGt + TILEF;
  float* sB = sAw + TILEF;
  int* sSteep = reinterpret_cast<int*>(sB + C);  // [8] steep-block flags (cumsum_cols)
  const Lane L;
  const int ci = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int t0 = ci * C, n = min(C, p.T - t0);
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D, off = coff(p, bh, ci);
  if (MODE == kGla) {  // forward: E = Vᵀ K̂, K̂ = k e^{G_last − G}; backward: E = scale dOᵀ Q̃, Q̃ = q e^G
    bf16* sX = sT;            // K / Q, rewritten in place
    bf16* sY = sT + TILE;     // V / dO
    load_tile(sX, (kBwd ? p.q : p.k) + crow(p, b, t0, h), stride, n);
    load_tile(sY, (kBwd ? p.dout : p.v) + crow(p, b, t0, h), stride, n);
    load_gate_tile(sGt, p.g + crow(p, b, t0, h), stride, n);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    cumsum_cols(sGt);
    __syncthreads();
    if (tid < C) p.el[(bh * p.nc + ci) * C + tid] = __expf(sGt[(C - 1) * LDF + tid]);
    for (int i = tid; i < C * 32; i += NT) {
      const int t = i >> 5, c = 2 * (i & 31);
      float x[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float G = sGt[t * LDF + c + u];
        x[u] = bf(sX, t, c + u) * __expf(kBwd ? G : sGt[(C - 1) * LDF + c + u] - G);
      }
      *reinterpret_cast<uint32_t*>(sX + t * LD + c) = pack(x[0], x[1]);
    }
    __syncthreads();
    Acc e;
    zero(e);
    gemm<true, true>(e, sY, sX, L);  // Vᵀ K̂ / dOᵀ Q̃
    frag_store_f(p.Ec + off, e, L, kBwd ? p.scale : 1.f);
    return;
  }
  if (kBwd) load_tile(sQ, p.q + crow(p, b, t0, h), stride, n);
  if (!kBwd) load_tile(sV, p.v + crow(p, b, t0, h), stride, n);
  load_tile(sK, p.k + crow(p, b, t0, h), stride, n);
  load_gate_tile(sGt, p.g + crow(p, b, t0, h), stride, n);
  cp_async_commit();
  load_beta<MODE>(p, b, h, t0, n, sB, nullptr);
  cp_async_wait<0>();
  __syncthreads();
  cumsum_cols(sGt, sSteep);
  __syncthreads();
  const unsigned steep = steep_blocks(sSteep);
  if (tid < C) p.el[(bh * p.nc + ci) * C + tid] = __expf(sGt[(C - 1) * LDF + tid]);
  prep_tiles<MODE, kBwd>(p, b, h, t0, n, sQ, sK, sGt, sQb, sEb, sKb, steep);
  __syncthreads();
  {
    const bf16* Kw = sKb + L.wm * TILE;  // this warp's row block's K̄
    Acc a, a2;
    zero(a);
    zero(a2);
    if (kBwd)
      gemm2<false, false, false, false>(a, sEb, Kw, a2, sQb, Kw, L);  // Ē K̄ᵀ, Q̄ K̄ᵀ
    else
      gemm<false, false>(a, sEb, Kw, L);
    store_f(sAw, a, L, [](float x, int t, int j) { return t > j ? x : 0.f; });
    __syncthreads();  // every read of Q̄ and K̄ is done
    if (kBwd) {
      load_tile(sdO, p.dout + crow(p, b, t0, h), stride, n);
      load_tile(sVb, p.v + crow(p, b, t0, h), stride, n);
      cp_async_commit();
      store_bf(sQb, a2, L, [](float x, int t, int j) { return t >= j ? x : 0.f; });  // P
      cp_async_wait<0>();
      __syncthreads();  // V is in
    }
  }
  if (steep) {
    steep_pairs<MODE>(steep_in(p), b, h, t0, n, sGt, nullptr, steep, sAw, kBwd ? sQb : nullptr);
    __syncthreads();
  }
  {
    const int c = tid >> 2, pp = tid & 3;
    float x[16], y[16];  // W = T⁻¹ diag(β) Ẽ (Ẽ = Ē e^{G_s}); forward also U₀ = T⁻¹ diag(β) Z
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int t = 4 * i + pp;
      x[i] = bf(sEb, t, c) * __expf(sGt[(t & ~15) * LDF + c]);
    }
    bf16* sZ = kBwd ? sVb : sV;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int t = 4 * i + pp;
      float z = bf(sZ, t, c);
      if (MODE == kGdn2) z = t < n ? z * __bfloat162float(p.wg[crow(p, b, t0 + t, h) + c]) : 0.f;
      y[i] = z;
    }
    subst_fwd_regs2(sAw, sB, x, y);
    bf16* sUo = kBwd ? sVb : sU0;  // (the backward's V is read only by its owner thread)
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      sUo[(4 * i + pp) * LD + c] = __float2bfloat16(y[i]);
      sW[(4 * i + pp) * LD + c] = __float2bfloat16(x[i]);
    }
  }
  __syncthreads();
  for (int i = tid; i < 2 * D * 8; i += NT) {  // W and U₀ for the chunk kernel
    const int r = (i >> 3) & 63, c = (i & 7) * 8;
    const bf16* src = i < D * 8 ? sW : kBwd ? sVb : sU0;
    bf16* dst = (i < D * 8 ? p.Wc : p.Uc) + off;
    *reinterpret_cast<uint4*>(dst + r * D + c) = *reinterpret_cast<const uint4*>(src + r * LD + c);
  }
  Acc m;
  zero(m);
  if (!kBwd) {
    Acc e;
    zero(e);
    gemm2<true, true, true, true>(m, sW, sK, e, sU0, sK, L);  // Wᵀ K̂, U₀ᵀ K̂
    cfrag_store_bf(p.Mc + off, m, L);
    frag_store_f(p.Ec + off, e, L, 1.f);
  } else {
    Acc a;
    zero(a);
    gemm2<false, true, true, true>(a, sQb, sW, m, sW, sK, L);  // P W, Wᵀ K̂
    cfrag_store_bf(p.Mc + off, m, L);
    store_bf(sU0, a, L, [&](float x, int t, int c) { return bf(sQ, t, c) - x; });  // Q' = Q̃ − P W
    __syncthreads();
    zero(a);
    gemm<true, true>(a, sdO, sU0, L);  // dOᵀ Q'
    frag_store_f(p.Ec + off, a, L, p.scale);
  }
}

// (2) the sequential pass. Forward: S ← S diag(e^{G_last}) − S M + E from S0, writing every
// chunk's start state (bf16) into the boundary; backward: dS ← dS diag(e^{G_last}) − dS Mᵀ + E
// from dS_T over the chunks in reverse, writing every chunk's end-of-chunk gradient. The rows
// of S evolve independently: CTA blockIdx.x owns 16 value rows and its 4 warps split the 64 key
// columns (warp w: columns 16w..16w+15), so each chunk's 16×64×64 product runs on all four
// tensor-core partitions of the SM (8 MMAs per warp; with one warp for all 64 columns the
// chain of 32 MMAs on one partition made 0.7 µs per chunk). The state stays in fp32
// registers; its bf16 copy in shared memory (two buffers, by chunk parity) is every warp's A
// operand: one barrier per chunk. Warp w's fragment st[j][e] sits at row r0 + g + 8·(e/2),
// column 16w + 8j + 2·tig + e%2.
constexpr int kCStages = 6;
constexpr int kCStateThreads = 128;
constexpr size_t kCStageM = TILE * sizeof(bf16);            // M [64][LD]
constexpr size_t kCStageE = 16 * LDF * sizeof(float);       // this CTA's 16 rows of E
constexpr size_t kCStage = kCStageM + kCStageE + C * sizeof(float);  // + e^{G_last}
constexpr size_t kCStateA = 2 * 16 * LD * sizeof(bf16);     // the state rows, two buffers
constexpr size_t kCStateSmem = kCStateA + kCStages * kCStage;

template <bool kBwd, bool kHasM>
__global__ void __launch_bounds__(kCStateThreads) cstate_kernel(const CParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int r0 = 16 * blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int lane = tid & 31, c0 = 16 * (tid >> 5), g = lane >> 2, tig = lane & 3;
  const size_t bh = static_cast<size_t>(b) * p.H + h;
  bf16* sA = reinterpret_cast<bf16*>(smem);
  auto stage_M = [&](int k) { return reinterpret_cast<bf16*>(smem + kCStateA + k * kCStage); };
  auto stage_E = [&](int k) { return reinterpret_cast<float*>(smem + kCStateA + k * kCStage + kCStageM); };
  auto chunk_at = [&](int s) { return kBwd ? p.nc - 1 - s : s; };
  // Chunk s's terms into stage s % kCStages (one commit group per chunk, empty past the end).
  auto issue = [&](int s) {
    if (s < p.nc) {
      const int ci = chunk_at(s), k = s % kCStages;
      const size_t off = coff(p, bh, ci);
      if (kHasM)
        for (int i = tid; i < C * 8; i += kCStateThreads) {
          const int r = i >> 3, c = (i & 7) * 8;
          cp_async16(stage_M(k) + r * LD + c, p.Mc + off + r * D + c, true);
        }
      float* E = stage_E(k);
      for (int i = tid; i < 16 * 16; i += kCStateThreads) {
        const int r = i >> 4, c = (i & 15) * 4;
        cp_async16(E + r * LDF + c, p.Ec + off + (r0 + r) * D + c, true);
      }
      if (tid < 16) cp_async16(E + 16 * LDF + 4 * tid, p.el + (bh * p.nc + ci) * C + 4 * tid, true);
    }
    cp_async_commit();
  };
  auto at = [&](int j, int e) { return (r0 + g + 8 * (e >> 1)) * D + c0 + 8 * j + 2 * tig + (e & 1); };
  float st[2][4];
  const float* init = kBwd ? p.dST : p.S0;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) st[j][e] = init ? init[bh * D * D + at(j, e)] : 0.f;
#pragma unroll
  for (int s = 0; s < kCStages - 1; ++s) issue(s);
  bf16* out = kBwd ? p.dSend : p.bound;
  for (int s = 0; s < p.nc; ++s) {
    const int ci = chunk_at(s), k = s % kCStages;
    bf16* A = sA + (s & 1) * 16 * LD;
    bf16* dst = out + coff(p, bh, ci);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const uint32_t v = pack(st[j][2 * hh], st[j][2 * hh + 1]);
        const int r = g + 8 * hh, c = c0 + 8 * j + 2 * tig;
        *reinterpret_cast<uint32_t*>(A + r * LD + c) = v;
        *reinterpret_cast<uint32_t*>(dst + (r0 + r) * D + c) = v;
      }
    cp_async_wait<kCStages - 2>();  // chunk s's group is complete (groups 0 .. s+kCStages-2 issued)
    __syncthreads();  // the state rows and chunk s's stage are in; every read of chunk s−1's stage is done
    issue(s + kCStages - 1);  // refills the stage chunk s−1 used
    float a[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) a[j][0] = a[j][1] = a[j][2] = a[j][3] = 0.f;
    if (kHasM) {
      const bf16* M = stage_M(k);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t af[4], bq[4];
        ldsm_x4(af, A + (lane & 15) * LD + 16 * kk + (lane >> 4) * 8);
        if (!kBwd)  // S M: M stored [k][n]
          ldsm_x4_t(bq, M + (16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3)) * LD + c0 + (lane >> 4) * 8);
        else  // dS Mᵀ: M stored [n][k]
          ldsm_x4(bq, M + (c0 + (lane & 7) + ((lane >> 4) << 3)) * LD + 16 * kk + ((lane >> 3) & 1) * 8);
        mma(a[0], af, bq[0], bq[1]);
        mma(a[1], af, bq[2], bq[3]);
      }
    }
    const float* E = stage_E(k);
    const float* el = E + 16 * LDF;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 l = *reinterpret_cast<const float2*>(el + c0 + 8 * j + 2 * tig);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float2 e = *reinterpret_cast<const float2*>(E + (g + 8 * hh) * LDF + c0 + 8 * j + 2 * tig);
        st[j][2 * hh] = l.x * st[j][2 * hh] - a[j][2 * hh] + e.x;
        st[j][2 * hh + 1] = l.y * st[j][2 * hh + 1] - a[j][2 * hh + 1] + e.y;
      }
    }
  }
  cp_async_wait<0>();
  float* fin = kBwd ? p.dS0 : p.S_out;
  if (fin)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) fin[bh * D * D + at(j, e)] = st[j][e];
}

// (3a) forward output per chunk from its start state S0 (boundary) and the prep's U₀, W:
//   U = U₀ − W S0ᵀ,   O = scale (Q̃ S0ᵀ + P U)
// (gla: U = V). No Aw, no solve: ten bf16 tiles and G (110 KB), two CTAs per SM.
constexpr size_t kCFwdMainSmem = 10 * TILE * sizeof(bf16) + (TILEF + 8) * sizeof(float);
static_assert(kCFwdMainSmem + 1024 <= 228 * 1024 / 2, "two forward CTAs per SM");

template <int MODE>
__global__ void __launch_bounds__(NT, 2) cfwd_main_kernel(const CParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // Q → Q̃ in place
  bf16* sK = sQ + TILE;
  bf16* sS = sK + TILE;
  bf16* sU = sS + TILE;   // U₀ → U (gla: V)
  bf16* sW = sU + TILE;
  bf16* sQb = sW + TILE;  // Q̄ → P
  bf16* sKb = sQb + TILE;  // 4 tiles
  float* sGt = reinterpret_cast<float*>(sKb + 4 * TILE);
  int* sSteep = reinterpret_cast<int*>(sGt + TILEF);  // [8] steep-block flags (cumsum_cols)
  const Lane L;
  const int ci = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int t0 = ci * C, n = min(C, p.T - t0);
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D, off = coff(p, bh, ci);
  load_tile(sQ, p.q + crow(p, b, t0, h), stride, n);
  load_tile(sK, p.k + crow(p, b, t0, h), stride, n);
  load_tile(sS, p.bound + off, D, C);
  if (MODE == kGla) {
    load_tile(sU, p.v + crow(p, b, t0, h), stride, n);
  } else {
    load_tile(sU, p.Uc + off, D, C);
    load_tile(sW, p.Wc + off, D, C);
  }
  load_gate_tile(sGt, p.g + crow(p, b, t0, h), stride, n);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  cumsum_cols(sGt, sSteep);
  __syncthreads();
  const unsigned steep = steep_blocks(sSteep);
  for (int i = tid; i < C * 32; i += NT) {  // Q̄ = q e^{G − G_s}, Q̃ = q e^G, K̄_I = k e^{G_{16I} − G}
    const int t = i >> 5, c = 2 * (i & 31);
    float qb[2], qt[2], kb[4][2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const float G = sGt[t * LDF + c + u], Gs = sGt[(t & ~15) * LDF + c + u];
      const float qv = bf(sQ, t, c + u), kv = bf(sK, t, c + u);
      qb[u] = qv * __expf(G - Gs), qt[u] = qv * __expf(G);
#pragma unroll
      for (int I = 0; I < 4; ++I) kb[I][u] = kbar_row(t, I, steep) ? kv * __expf(sGt[16 * I * LDF + c + u] - G) : 0.f;
    }
    const int o = t * LD + c;
    *reinterpret_cast<uint32_t*>(sQb + o) = pack(qb[0], qb[1]);
    *reinterpret_cast<uint32_t*>(sQ + o) = pack(qt[0], qt[1]);
#pragma unroll
    for (int I = 0; I < 4; ++I) *reinterpret_cast<uint32_t*>(sKb + I * TILE + o) = pack(kb[I][0], kb[I][1]);
  }
  __syncthreads();
  Acc o, a;
  zero(o);
  zero(a);
  gemm2<false, false, false, false>(a, sQb, sKb + L.wm * TILE, o, sQ, sS, L);  // Q̄ K̄ᵀ, Q̃ S0ᵀ
  Acc x;
  if (MODE != kGla) {
    zero(x);
    gemm<false, false>(x, sW, sS, L);  // W S0ᵀ
  }
  __syncthreads();  // every read of Q̄ and U₀'s neighbours is done
  store_bf(sQb, a, L, [](float v, int t, int j) { return t >= j ? v : 0.f; });  // P
  if (MODE != kGla)  // U = U₀ − W S0ᵀ (each thread rewrites only its own elements)
    store_bf(sU, x, L, [&](float v, int t, int c) { return bf(sU, t, c) - v; });
  __syncthreads();
  if (steep) {
    steep_pairs<MODE>(steep_in(p), b, h, t0, n, sGt, nullptr, steep, nullptr, sQb);
    __syncthreads();
  }
  gemm<false, true>(o, sQb, sU, L);  // + P U
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int t = L.row(2 * hh);
      if (t < n)
        *reinterpret_cast<uint32_t*>(p.o + crow(p, b, t0 + t, h) + L.col(nt, 0)) =
            pack(o[nt][2 * hh] * p.scale, o[nt][2 * hh + 1] * p.scale);
    }
}

CParams make_cparams(const DeltaShape& s, const char* what) {
  if (s.dk != 64 || s.dv != 64)
    throw RuntimeError(std::string(what) + ": head dims dk=" + std::to_string(s.dk) + " dv=" + std::to_string(s.dv) +
                       " (supported: dk = dv = 64)");
  if (s.B < 1 || s.T < 1 || s.H < 1 || s.B > 65535 || s.H > 65535 || s.T > (int64_t{1} << 30))
    throw RuntimeError(std::string(what) + ": bad shape B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                       " H=" + std::to_string(s.H));
  CParams p{};
  p.B = static_cast<int>(s.B), p.T = static_cast<int>(s.T), p.H = static_cast<int>(s.H);
  p.nc = static_cast<int>(delta_num_chunks(s));
  p.scale = static_cast<float>(s.scale);
  return p;
}

// One launch with its dynamic shared memory (the limit must be raised above 48 KB first);
// the fused kernels take one CTA per (b, h).
template <class K>
void launch(K kernel, size_t smem, const CParams& p, cudaStream_t stream, dim3 grid = dim3(0), int threads = NT) {
  LAR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  if (grid.x == 0) grid = dim3(p.H, p.B);
  kernel<<<grid, threads, smem, stream>>>(p);
  LAR_CUDA_LAUNCHED();
}

}  // namespace
}  // namespace lar::kernels::cuda::linear
