// The elementwise and reduction parts of a linear-mixer layer on the GPU: see layer_ops.hpp.
// All of them are memory-bound: one warp per row of 64 channels (a head's slice) where a
// per-head reduction is needed (L2 norm, output RMSNorm, routing's scalar-gate sums), one
// thread per element elsewhere; loads are float2 / bf16x2 per lane, so a warp reads 256
// or 128 contiguous bytes. Column sums run in two fixed-order stages (no atomics).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/linear/layer_ops.hpp"

namespace lar::kernels::cuda::linear {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kSeg = 64;        // channels of one head
constexpr int kThreads = 256;   // 8 warps per block
constexpr int kMaxSplits = 1024;  // row splits of the column sums (≥ 64 rows each)
constexpr int kMaxConv = 8;     // widest short conv supported

__device__ __forceinline__ float sigm(float x) { return 1.f / (1.f + __expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(__expf(x)); }
__device__ __forceinline__ float silu_grad(float x) {
  const float s = sigm(x);
  return s * (1.f + x * (1.f - s));
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float2 ld_bf2(const bf16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ void st_bf2(bf16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// Pairs of an activation tensor in either storage dtype (fp32 or bf16).
__device__ __forceinline__ float2 ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 ld2(const bf16* p) { return ld_bf2(p); }
__device__ __forceinline__ void st2(float* p, float2 v) { *reinterpret_cast<float2*>(p) = v; }
__device__ __forceinline__ void st2(bf16* p, float2 v) { st_bf2(p, v.x, v.y); }

unsigned blocks_for(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

void require(bool ok, const std::string& what) {
  if (!ok) throw RuntimeError("linear layer ops: " + what);
}

// ---------------------------------------------------------------- q, k, v
// Which part (q 0, k 1, v 2) a column of P belongs to, its weight row and its output column.
struct Part {
  int which, col;
};
__device__ __forceinline__ Part part_of(int c, int Cq) {
  if (c < Cq) return {0, c};
  if (c < 2 * Cq) return {1, c - Cq};
  return {2, c - 2 * Cq};
}

// Token ranges: a warp walks up to kTokF (forward) / kTokB (backward) consecutive tokens of
// one sequence for one 64-channel segment of P, keeping the conv's input window in
// registers, so every element of P is loaded once (the conv's W−1 predecessors once per range).
// Each walk loads the next token's inputs one step ahead. (Loading a whole batch of tokens
// before the math — all 16 in the forward, 8 at a time in the backward — measured slower
// on the H200: 8.6 / 26.7 ms per step instead of 7.0 / 18.7, as the register arrays halve
// the resident warps and the per-token shuffle chain, not the loads, sets the pace.)
constexpr int kTokF = 16, kTokB = 64;

// The conv window of one lane's channel pair: win[K−1−j] = P[t−j]; wr[j] = w[W−1−j].
template <int K>
struct ConvWindow {
  float2 win[K];
  float wr0[K], wr1[K];  // reversed: wr[j] = w[W−1−j]
  float wf0[K], wf1[K];  // in order: wf[m] = w[m]
};

__device__ __forceinline__ const float* conv_weights(const QkvArgs& a, Part pt) {
  return pt.which == 0 ? a.wq : pt.which == 1 ? a.wk : a.wv;
}

// Load the weights and the W−1 inputs before token t0 (row n0 = b·T + t0), placed as the
// window of token t0 − 1 (win[K−j] = P[t0−j]) since window_push shifts before it stores.
template <int K, class TP>
__device__ __forceinline__ void window_init(const QkvArgs& a, const TP* P, ConvWindow<K>& cw, Part pt, int64_t n0,
                                            int t0, int c) {
  const float* w = conv_weights(a, pt) + (int64_t)pt.col * a.W;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    cw.wr0[j] = j < a.W ? w[a.W - 1 - j] : 0.f;
    cw.wr1[j] = j < a.W ? w[a.W + a.W - 1 - j] : 0.f;
    cw.wf0[j] = j < a.W ? w[j] : 0.f;
    cw.wf1[j] = j < a.W ? w[a.W + j] : 0.f;
    cw.win[j] = make_float2(0.f, 0.f);
  }
#pragma unroll
  for (int j = 1; j < K; ++j)
    if (j < a.W && t0 - j >= 0) cw.win[K - j] = ld2(P + (n0 - j) * a.ldp + c);
}

// Shift the window by one token holding x = P[t] (zeros past the end); returns s = the conv
// pre-activation. The caller loads x one token ahead (prefetch), so the walk's load latency
// overlaps the previous token's math instead of stalling each step.
template <int K>
__device__ __forceinline__ float2 window_push(ConvWindow<K>& cw, float2 x) {
#pragma unroll
  for (int j = 0; j < K - 1; ++j) cw.win[j] = cw.win[j + 1];
  cw.win[K - 1] = x;
  float2 s = make_float2(0.f, 0.f);
#pragma unroll
  for (int j = 0; j < K; ++j) {
    s.x = fmaf(cw.wr0[j], cw.win[K - 1 - j].x, s.x);
    s.y = fmaf(cw.wr1[j], cw.win[K - 1 - j].y, s.y);
  }
  return s;
}

// The activation after conv + SiLU (or P itself without conv), plus cler's routed input.
__device__ __forceinline__ float2 activate(const QkvArgs& a, float2 s, Part pt, int64_t n) {
  float2 act = a.W > 0 ? make_float2(s.x * sigm(s.x), s.y * sigm(s.y)) : s;
  if (pt.which == 2 && a.rin) {
    const float gm = *a.gamma;
    const float2 r = *reinterpret_cast<const float2*>(a.rin + n * a.Cv + pt.col);
    act.x = fmaf(gm, r.x, act.x);
    act.y = fmaf(gm, r.y, act.y);
  }
  return act;
}

// Warp index → (sequence b, token range [t0, t1), segment, channel pair c of this lane).
struct WarpRange {
  int64_t b;
  int t0, t1, seg, c;
  bool ok;
};
__device__ __forceinline__ WarpRange warp_range(const QkvArgs& a, int tok) {
  WarpRange r;
  const int lane = threadIdx.x & 31;
  const int64_t nseg = a.ldp / kSeg;
  const int64_t groups = (a.T + tok - 1) / tok;
  const int64_t wid = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  r.ok = wid < a.B * groups * nseg;
  r.seg = static_cast<int>(wid % nseg);
  const int64_t bg = wid / nseg;
  r.b = bg / groups;
  r.t0 = static_cast<int>(bg % groups) * tok;
  r.t1 = min(r.t0 + tok, static_cast<int>(a.T));
  r.c = r.seg * kSeg + 2 * lane;
  return r;
}

template <int K, class TP>
__global__ void qkv_fwd_kernel(QkvArgs a, bf16* q, bf16* k, bf16* v, float* vout) {
  const WarpRange r = warp_range(a, kTokF);
  if (!r.ok) return;
  const TP* P = static_cast<const TP*>(a.P);
  const Part pt = part_of(r.c, a.Cq);
  const int64_t nb = r.b * a.T;
  ConvWindow<K> cw;
  if (a.W > 0) window_init(a, P, cw, pt, nb + r.t0, r.t0, r.c);
  float2 next = ld2(P + (nb + r.t0) * a.ldp + r.c);  // t0 < t1: every range has a token
  for (int t = r.t0; t < r.t1; ++t) {
    const int64_t n = nb + t;
    const float2 x = next;
    if (t + 1 < r.t1) next = ld2(P + (n + 1) * a.ldp + r.c);
    const float2 s = a.W > 0 ? window_push(cw, x) : x;
    float2 act = activate(a, s, pt, n);
    if (pt.which < 2 && a.l2) {
      const float rn = 1.f / sqrtf(warp_sum(act.x * act.x + act.y * act.y) + 1e-6f);
      act.x *= rn;
      act.y *= rn;
    }
    if (pt.which == 0) st_bf2(q + n * a.Cq + pt.col, act.x, act.y);
    else if (pt.which == 1) st_bf2(k + n * a.Cq + pt.col, act.x, act.y);
    else {
      st_bf2(v + n * a.Cv + pt.col, act.x, act.y);
      if (vout) *reinterpret_cast<float2*>(vout + n * a.Cv + pt.col) = act;
    }
  }
}

// The gradient arriving on the activation of token n: the kernels' dq / dk / dv plus the
// routing extras (loaded one token ahead by the backward walk).
__device__ __forceinline__ float2 token_dy(const QkvArgs& a, const QkvGrads& g, Part pt, int64_t n) {
  float2 dy;
  if (pt.which == 0) {
    dy = ld_bf2(g.dq + n * a.Cq + pt.col);
  } else if (pt.which == 1) {
    dy = ld_bf2(g.dk + n * a.Cq + pt.col);
    if (g.ek) {
      const float2 e = *reinterpret_cast<const float2*>(g.ek + n * a.Cq + pt.col);
      dy.x += e.x, dy.y += e.y;
    }
  } else {
    dy = ld_bf2(g.dv + n * a.Cv + pt.col);
    if (g.ev) {
      const float2 e = *reinterpret_cast<const float2*>(g.ev + n * a.Cv + pt.col);
      dy.x += e.x, dy.y += e.y;
    }
    if (g.dvout) {
      const float2 e = *reinterpret_cast<const float2*>(g.dvout + n * a.Cv + pt.col);
      dy.x += e.x, dy.y += e.y;
    }
  }
  return dy;
}

// du at token n: the gradient on the conv pre-activation (on P without conv), from dy.
__device__ __forceinline__ float2 token_du(const QkvArgs& a, const QkvGrads& g, Part pt, int64_t n, float2 s,
                                           float2 dy, bool own) {
  const float2 act = activate(a, s, pt, n);
  float2 da = dy;
  if (pt.which < 2 && a.l2) {
    // y = a·r, r = 1/sqrt(Σa² + eps): da = r (dy − y (y·dy)), y·dy = r (a·dy); both sums
    // in one butterfly (half the dependent shuffles of two)
    float aa = act.x * act.x + act.y * act.y, ad = act.x * dy.x + act.y * dy.y;
    for (int o = 16; o > 0; o >>= 1) {
      aa += __shfl_xor_sync(0xffffffffu, aa, o);
      ad += __shfl_xor_sync(0xffffffffu, ad, o);
    }
    const float rn = 1.f / sqrtf(aa + 1e-6f);
    const float yx = act.x * rn, yy = act.y * rn;
    const float dot = rn * ad;
    da = make_float2(rn * (dy.x - yx * dot), rn * (dy.y - yy * dot));
  }
  if (own && pt.which == 2 && a.rin) {  // ṽ = silu(conv) + gamma·rin
    const int64_t i = n * a.Cv + pt.col;
    const float2 rr = *reinterpret_cast<const float2*>(a.rin + i);
    if (g.d_in) {
      const float gm = *a.gamma;
      float2 di = *reinterpret_cast<float2*>(g.d_in + i);
      di.x = fmaf(gm, da.x, di.x);
      di.y = fmaf(gm, da.y, di.y);
      *reinterpret_cast<float2*>(g.d_in + i) = di;
    }
    *reinterpret_cast<float2*>(g.dgam_terms + i) = make_float2(da.x * rr.x, da.y * rr.y);
  }
  if (a.W > 0) da = make_float2(da.x * silu_grad(s.x), da.y * silu_grad(s.y));
  return da;
}

// The whole backward of the qkv pass in one walk: du (recomputing the conv, SiLU and L2
// from P), the conv's transpose dP[t] = Σ_m w[m] du[t+m'] (emitted W−1 tokens late, with a
// halo of W−1 recomputed tokens past the range), and the conv weights' partial sums over
// the range (one partial per range, summed in order by conv_weight_finish).
// Three blocks of 8 warps per SM for the common width (≤ 85 registers): the walk is
// latency-bound, so resident warps matter more than the few values the compiler re-derives.
template <int K, class TP>
__global__ void __launch_bounds__(kThreads, K <= 4 ? 3 : 2) qkv_bwd_kernel(QkvArgs a, QkvGrads g, TP* dP, float* wpartial) {
  const WarpRange r = warp_range(a, kTokB);
  if (!r.ok) return;
  const TP* P = static_cast<const TP*>(a.P);
  const Part pt = part_of(r.c, a.Cq);
  const int64_t nb = r.b * a.T;
  if (a.W == 0) {
    for (int t = r.t0; t < r.t1; ++t) {
      const int64_t n = nb + t;
      const float2 du = token_du(a, g, pt, n, ld2(P + n * a.ldp + r.c), token_dy(a, g, pt, n), true);
      st2(dP + n * a.ldp + r.c, du);
    }
    return;
  }
  ConvWindow<K> cw;
  window_init(a, P, cw, pt, nb + r.t0, r.t0, r.c);
  float2 hist[K];  // hist[m] = du[t−m]
  float acc0[K], acc1[K];
#pragma unroll
  for (int j = 0; j < K; ++j) hist[j] = make_float2(0.f, 0.f), acc0[j] = acc1[j] = 0.f;
  const int tend = r.t1 + a.W - 1;  // last token whose du feeds dP of this range, + 1
  const int tval = min(tend, static_cast<int>(a.T));  // tokens that exist
  // P and dy of the next token, loaded one step ahead (t0 < T always)
  float2 nx = ld2(P + (nb + r.t0) * a.ldp + r.c), ndy = token_dy(a, g, pt, nb + r.t0);
  for (int t = r.t0; t < tend; ++t) {
    const int64_t n = nb + t;
    const bool valid = t < tval;
    const float2 x = valid ? nx : make_float2(0.f, 0.f), dy = ndy;
    if (t + 1 < tval) {
      nx = ld2(P + (n + 1) * a.ldp + r.c);
      ndy = token_dy(a, g, pt, n + 1);
    }
    const float2 s = window_push(cw, x);
    float2 du = make_float2(0.f, 0.f);
    if (valid) du = token_du(a, g, pt, n, s, dy, t < r.t1);
#pragma unroll
    for (int j = K - 1; j > 0; --j) hist[j] = hist[j - 1];
    hist[0] = du;
    if (t < r.t1) {  // weight gradient: dw[W−1−j] += du[t]·P[t−j]
#pragma unroll
      for (int j = 0; j < K; ++j) {
        acc0[j] = fmaf(du.x, cw.win[K - 1 - j].x, acc0[j]);
        acc1[j] = fmaf(du.y, cw.win[K - 1 - j].y, acc1[j]);
      }
    }
    const int te = t - a.W + 1;  // dP of token te is complete: Σ_m w[m]·du[te + W−1−m] = Σ_m w[m]·hist[m]
    if (te >= r.t0) {
      float2 d = make_float2(0.f, 0.f);
#pragma unroll
      for (int m = 0; m < K; ++m) {  // wf[m] = 0 for m ≥ W
        d.x = fmaf(cw.wf0[m], hist[m].x, d.x);
        d.y = fmaf(cw.wf1[m], hist[m].y, d.y);
      }
      st2(dP + (nb + te) * a.ldp + r.c, d);
    }
  }
  const int64_t groups = (a.T + kTokB - 1) / kTokB;
  const int64_t range = r.b * groups + r.t0 / kTokB;
  float* wp = wpartial + range * a.ldp * a.W;
#pragma unroll
  for (int j = 0; j < K; ++j)
    if (j < a.W) {
      wp[(int64_t)r.c * a.W + (a.W - 1 - j)] = acc0[j];
      wp[(int64_t)(r.c + 1) * a.W + (a.W - 1 - j)] = acc1[j];
    }
}

// One block per weight (c, j): threads stride over the ranges' partials, then a fixed tree.
__global__ void conv_weight_finish(QkvArgs a, const float* partial, int64_t ranges, float* gwq, float* gwk,
                                   float* gwv) {
  __shared__ float red[kThreads];
  const int64_t i = blockIdx.x;
  const int c = static_cast<int>(i / a.W), j = static_cast<int>(i % a.W);
  float s = 0.f;
  for (int64_t r = threadIdx.x; r < ranges; r += blockDim.x) s += partial[r * a.ldp * a.W + i];
  red[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  const Part pt = part_of(c, a.Cq);
  float* gw = pt.which == 0 ? gwq : pt.which == 1 ? gwk : gwv;
  gw[(int64_t)pt.col * a.W + j] += red[0];
}

// ---------------------------------------------------------------- gates
__global__ void gate_fwd_kernel(GateArgs a, float* out, bf16* outb) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.N * a.C) return;
  const int64_t n = i / a.C;
  const int c = static_cast<int>(i % a.C);
  const float f = a.f[n * a.ldf + c];
  float y;
  switch (a.map) {
    case GateMap::decay: y = -__expf(a.A_log[c / a.per_head]) * softplus(f + a.bias[c]); break;
    case GateMap::logsig16: y = -softplus(-(f + a.bias[c])) / 16.f; break;
    default: y = sigm(a.bias ? f + a.bias[c] : f);
  }
  if (out) out[i] = y;
  else outb[i] = __float2bfloat16(y);
}

__global__ void gate_bwd_kernel(GateArgs a, const float* dyf, const bf16* dyb, const float* extra, float* df,
                                int64_t ldd, float* aterm) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.N * a.C) return;
  const int64_t n = i / a.C;
  const int c = static_cast<int>(i % a.C);
  float dy = 0.f;
  if (dyf) dy += dyf[i];
  if (dyb) dy += __bfloat162float(dyb[i]);
  if (extra) dy += extra[i];
  const float f = a.f[n * a.ldf + c];
  float d;
  switch (a.map) {
    case GateMap::decay: {
      const float A = __expf(a.A_log[c / a.per_head]);
      const float x = f + a.bias[c];
      d = -dy * A * sigm(x);
      aterm[i] = dy * (-A * softplus(x));
      break;
    }
    case GateMap::logsig16: d = dy * sigm(-(f + a.bias[c])) / 16.f; break;
    default: {
      const float s = sigm(a.bias ? f + a.bias[c] : f);
      d = dy * s * (1.f - s);
    }
  }
  df[n * ldd + c] = d;
}

// ---------------------------------------------------------------- column sums
__global__ void colsum_kernel(const float* M, int64_t N, int C, int64_t ld, float* partial) {
  __shared__ float red[8][32];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int c = blockIdx.x * 32 + tx;
  const int64_t per = (N + gridDim.y - 1) / gridDim.y;
  const int64_t r0 = blockIdx.y * per, r1 = std::min<int64_t>(N, r0 + per);
  float acc = 0.f;
  if (c < C)
    for (int64_t n = r0 + ty; n < r1; n += 8) acc += M[n * ld + c];
  red[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && c < C) {
    float s = 0.f;
    for (int y = 0; y < 8; ++y) s += red[y][tx];
    partial[(int64_t)blockIdx.y * C + c] = s;
  }
}

// One block per output j: the block's threads stride over the (split, column) partials of
// its group in a fixed order, then a fixed shared-memory tree (deterministic, and short
// dependency chains: a serial sum over groups × splits was latency-bound).
__global__ void colsum_finish(const float* partial, int splits, int C, int group, float* out) {
  __shared__ float red[kThreads];
  const int j = blockIdx.x;
  const int64_t total = (int64_t)group * splits;
  float s = 0.f;
  for (int64_t idx = threadIdx.x; idx < total; idx += blockDim.x) {
    const int64_t sp = idx / group;
    const int c = j * group + static_cast<int>(idx % group);
    s += partial[sp * C + c];
  }
  red[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[j] += red[0];
}

// ---------------------------------------------------------------- output norm × gate
// A warp takes kRowsW consecutive rows and issues all their loads before the math (one row
// per warp left these passes latency-bound at ≈ 2 TB/s).
constexpr int kRowsW = 4;

template <class TA>
__global__ void out_fwd_kernel(int64_t rows, const bf16* o, const TA* og, const float* wn, float eps, TA* ypre,
                               float* rstd) {
  const int lane = threadIdx.x & 31;
  const int64_t r0 = ((int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * kRowsW;
  if (r0 >= rows) return;
  const float2 w = make_float2(wn[2 * lane], wn[2 * lane + 1]);  // parameters: only 4-byte aligned
  float2 x[kRowsW], gt[kRowsW];
#pragma unroll
  for (int j = 0; j < kRowsW; ++j) {
    const int64_t i = (r0 + j) * kSeg + 2 * lane;
    const bool ok = r0 + j < rows;
    x[j] = ok ? ld_bf2(o + i) : make_float2(0.f, 0.f);
    gt[j] = ok ? ld2(og + i) : make_float2(0.f, 0.f);
  }
#pragma unroll
  for (int j = 0; j < kRowsW; ++j) {
    if (r0 + j >= rows) break;  // uniform across the warp
    const int64_t i = (r0 + j) * kSeg + 2 * lane;
    const float rs = 1.f / sqrtf(warp_sum(x[j].x * x[j].x + x[j].y * x[j].y) / kSeg + eps);
    st2(ypre + i, make_float2(x[j].x * rs * w.x * gt[j].x * sigm(gt[j].x), x[j].y * rs * w.y * gt[j].y * sigm(gt[j].y)));
    if (lane == 0) rstd[r0 + j] = rs;
  }
}

// A fixed grid of kOutBlocks blocks (fewer for small inputs); warp w of the grid takes the
// row groups w, w + warps, … (kRowsW rows each), so each block's ∂L/∂wn partial covers a
// fixed set of rows.
constexpr int kOutBlocks = 1024;
int out_blocks(int64_t rows) {
  return static_cast<int>(std::clamp<int64_t>((rows + 8 * kRowsW - 1) / (8 * kRowsW), 1, kOutBlocks));
}

template <class TA>
__global__ void out_bwd_kernel(int64_t rows, const bf16* o, const TA* og, const float* wn, const float* rstd,
                               const TA* dypre, bf16* dO, TA* dog, float* dwn_partial) {
  __shared__ float red[kThreads / 32][kSeg];
  const int lane = threadIdx.x & 31, wib = threadIdx.x / 32;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  const float2 w = make_float2(wn[2 * lane], wn[2 * lane + 1]);  // parameters: only 4-byte aligned
  float dw0 = 0.f, dw1 = 0.f;
  for (int64_t r0 = ((int64_t)blockIdx.x * (blockDim.x / 32) + wib) * kRowsW; r0 < rows; r0 += warps * kRowsW) {
    float2 x[kRowsW], gt[kRowsW], dy[kRowsW];
    float rs[kRowsW];
#pragma unroll
    for (int j = 0; j < kRowsW; ++j) {
      const int64_t i = (r0 + j) * kSeg + 2 * lane;
      const bool ok = r0 + j < rows;
      x[j] = ok ? ld_bf2(o + i) : make_float2(0.f, 0.f);
      gt[j] = ok ? ld2(og + i) : make_float2(0.f, 0.f);
      dy[j] = ok ? ld2(dypre + i) : make_float2(0.f, 0.f);
      rs[j] = ok ? rstd[r0 + j] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kRowsW; ++j) {
      if (r0 + j >= rows) break;  // uniform across the warp
      const int64_t i = (r0 + j) * kSeg + 2 * lane;
      const float xh0 = x[j].x * rs[j], xh1 = x[j].y * rs[j];                   // normalised o
      const float sg0 = gt[j].x * sigm(gt[j].x), sg1 = gt[j].y * sigm(gt[j].y);  // silu(og)
      const float don0 = dy[j].x * sg0, don1 = dy[j].y * sg1;                    // on = x̂·w
      st2(dog + i, make_float2(dy[j].x * xh0 * w.x * silu_grad(gt[j].x), dy[j].y * xh1 * w.y * silu_grad(gt[j].y)));
      dw0 = fmaf(don0, xh0, dw0);
      dw1 = fmaf(don1, xh1, dw1);
      const float dx0 = don0 * w.x, dx1 = don1 * w.y;  // on x̂
      const float m = warp_sum(dx0 * xh0 + dx1 * xh1) / kSeg;
      st_bf2(dO + i, rs[j] * (dx0 - xh0 * m), rs[j] * (dx1 - xh1 * m));
    }
  }
  red[wib][2 * lane] = dw0;
  red[wib][2 * lane + 1] = dw1;
  __syncthreads();
  if (threadIdx.x < kSeg) {
    float s = 0.f;
    for (int y = 0; y < kThreads / 32; ++y) s += red[y][threadIdx.x];
    dwn_partial[(int64_t)blockIdx.x * kSeg + threadIdx.x] = s;
  }
}

// ---------------------------------------------------------------- routing readouts
// a_t ⊙ e_t of token n, channel pair (2·lane) of head h.
__device__ __forceinline__ float2 readout_vec(const RouteArgs& a, int64_t n, int h, int lane) {
  const int64_t C = (int64_t)a.H * kSeg;
  const int64_t i = n * C + h * kSeg + 2 * lane;
  float2 e = ld_bf2(a.k + i);
  if (a.b) {
    const float2 b = ld_bf2(a.b + i);
    e.x *= b.x, e.y *= b.y;
  }
  if (a.g) {
    if (a.g_channel) {
      const float2 g = *reinterpret_cast<const float2*>(a.g + i);
      e.x *= __expf(g.x), e.y *= __expf(g.y);
    } else {
      const float s = __expf(a.g[n * a.H + h]);
      e.x *= s, e.y *= s;
    }
  }
  return e;
}

// One warp per (token, head): qr[b, s] = a_{s+1} ⊙ e_{s+1}, 0 at s = T−1.
__global__ void route_query_kernel(RouteArgs a, bf16* qr) {
  const int lane = threadIdx.x & 31;
  const int64_t wid = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (wid >= a.B * a.T * a.H) return;
  const int64_t n = wid / a.H;
  const int h = static_cast<int>(wid % a.H);
  const int t = static_cast<int>(n % a.T);
  const int64_t i = n * a.H * kSeg + h * kSeg + 2 * lane;
  if (t == a.T - 1) {
    st_bf2(qr + i, 0.f, 0.f);
    return;
  }
  const float2 e = readout_vec(a, n + 1, h, lane);
  st_bf2(qr + i, e.x, e.y);
}

__global__ void route_residual_kernel(RouteArgs a, const bf16* o2, float* r) {
  const int64_t C = (int64_t)a.H * kSeg;
  const int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 2;
  if (i >= a.B * a.T * C) return;
  const int64_t n = i / C;
  const int t = static_cast<int>(n % a.T);
  float2 z = ld_bf2(a.v + i);
  if (a.w) {
    const float2 w = ld_bf2(a.w + i);
    z.x *= w.x, z.y *= w.y;
  }
  if (t > 0) {
    const float2 o = ld_bf2(o2 + i - C);
    z.x -= o.x / a.scale, z.y -= o.y / a.scale;
  }
  *reinterpret_cast<float2*>(r + i) = z;
}

__global__ void route_readout_grad_kernel(RouteArgs a, const float* dr, bf16* do2) {
  const int64_t C = (int64_t)a.H * kSeg;
  const int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 2;
  if (i >= a.B * a.T * C) return;
  const int t = static_cast<int>((i / C) % a.T);
  if (t == a.T - 1) {
    st_bf2(do2 + i, 0.f, 0.f);
    return;
  }
  const float2 d = *reinterpret_cast<const float2*>(dr + i + C);
  st_bf2(do2 + i, -d.x / a.scale, -d.y / a.scale);
}

// One warp per (token n, head h): fold the second readout's gradients back.
__global__ void route_backward_kernel(RouteArgs a, RouteGrads g) {
  const int lane = threadIdx.x & 31;
  const int64_t wid = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (wid >= a.B * a.T * a.H) return;
  const int64_t n = wid / a.H;
  const int h = static_cast<int>(wid % a.H);
  const int t = static_cast<int>(n % a.T);
  const int64_t C = (int64_t)a.H * kSeg;
  const int64_t i = n * C + h * kSeg + 2 * lane;
  // qr_{t−1} = a_t ⊙ e_t: its gradient dqr_{t−1} lands on token t.
  float2 dqr = make_float2(0.f, 0.f), qr = dqr;
  if (t > 0) {
    dqr = ld_bf2(g.dqr + i - C);
    qr = ld_bf2(g.qr + i - C);
  }
  // ∂qr/∂g = qr (a = exp(g)); ∂qr/∂e = a.
  float2 aval = make_float2(1.f, 1.f);
  if (a.g) {
    if (a.g_channel) {
      const float2 gg = *reinterpret_cast<const float2*>(a.g + i);
      aval = make_float2(__expf(gg.x), __expf(gg.y));
      float2 dg = *reinterpret_cast<float2*>(g.dg + i);
      const float2 d2 = *reinterpret_cast<const float2*>(g.dg2 + i);
      dg.x += d2.x + dqr.x * qr.x;
      dg.y += d2.y + dqr.y * qr.y;
      *reinterpret_cast<float2*>(g.dg + i) = dg;
    } else {
      const float s = __expf(a.g[n * a.H + h]);
      aval = make_float2(s, s);
      const float sum = warp_sum(dqr.x * qr.x + dqr.y * qr.y);
      if (lane == 0) g.dg[n * a.H + h] += g.dg2[n * a.H + h] + sum;
    }
  }
  if (g.dbeta && lane == 0) g.dbeta[n * a.H + h] += g.dbeta2[n * a.H + h];
  const float2 de = make_float2(dqr.x * aval.x, dqr.y * aval.y);  // on e_t
  float2 ek = ld_bf2(g.dk2 + i);
  const float2 dr = *reinterpret_cast<const float2*>(g.dr + i);
  float2 ev = ld_bf2(g.dv2 + i);
  if (a.b) {  // gdn2: e = b ⊙ k, z = w ⊙ v
    const float2 b = ld_bf2(a.b + i), k = ld_bf2(a.k + i);
    const float2 w = ld_bf2(a.w + i), v = ld_bf2(a.v + i);
    ek.x += de.x * b.x, ek.y += de.y * b.y;
    const float2 db2 = ld_bf2(g.db2 + i), dw2 = ld_bf2(g.dw2 + i);
    *reinterpret_cast<float2*>(g.eb + i) = make_float2(db2.x + de.x * k.x, db2.y + de.y * k.y);
    *reinterpret_cast<float2*>(g.ew + i) = make_float2(dw2.x + dr.x * v.x, dw2.y + dr.y * v.y);
    ev.x += dr.x * w.x, ev.y += dr.y * w.y;
  } else {
    ek.x += de.x, ek.y += de.y;
    ev.x += dr.x, ev.y += dr.y;
  }
  *reinterpret_cast<float2*>(g.ek + i) = ek;
  *reinterpret_cast<float2*>(g.ev + i) = ev;
}

// ---------------------------------------------------------------- profiling
EventProfile& layer_profile() {
  static EventProfile p;
  return p;
}

}  // namespace

int64_t qkv_warps(const QkvArgs& a, int tok) { return a.B * ((a.T + tok - 1) / tok) * (a.ldp / kSeg); }

void qkv_forward(const QkvArgs& a, bf16* q, bf16* k, bf16* v, float* vout, cudaStream_t stream) {
  require(a.ldp == 2 * a.Cq + a.Cv && a.Cq % kSeg == 0 && a.Cv % kSeg == 0, "qkv: widths must be multiples of 64");
  require(a.W >= 0 && a.W <= kMaxConv, "qkv: conv width " + std::to_string(a.W) + " outside 0..8");
  require(!a.rin || a.gamma, "qkv: cler needs gamma");
  const int64_t warps = qkv_warps(a, kTokF);
  if (warps == 0) return;
  // the conv window's register arrays sized for the common width 4 (or the widest, 8)
  const unsigned blocks = blocks_for(warps, kThreads / 32);
  if (a.p_bf16) {
    if (a.W <= 4) qkv_fwd_kernel<4, bf16><<<blocks, kThreads, 0, stream>>>(a, q, k, v, vout);
    else qkv_fwd_kernel<kMaxConv, bf16><<<blocks, kThreads, 0, stream>>>(a, q, k, v, vout);
  } else {
    if (a.W <= 4) qkv_fwd_kernel<4, float><<<blocks, kThreads, 0, stream>>>(a, q, k, v, vout);
    else qkv_fwd_kernel<kMaxConv, float><<<blocks, kThreads, 0, stream>>>(a, q, k, v, vout);
  }
  LAR_CUDA_LAUNCHED();
}

std::size_t qkv_backward_scratch_floats(const QkvArgs& a) {
  return static_cast<std::size_t>(a.B * ((a.T + kTokB - 1) / kTokB) * a.ldp * std::max(a.W, 1));
}

void qkv_backward(const QkvArgs& a, const QkvGrads& g, void* dP, float* gwq, float* gwk, float* gwv, float* scratch,
                  cudaStream_t stream) {
  require(a.ldp == 2 * a.Cq + a.Cv && a.Cq % kSeg == 0 && a.Cv % kSeg == 0, "qkv: widths must be multiples of 64");
  require(a.W >= 0 && a.W <= kMaxConv, "qkv: conv width " + std::to_string(a.W) + " outside 0..8");
  require(!a.rin || (a.gamma && g.dgam_terms), "qkv backward: cler needs gamma and dgam_terms");
  require(a.W == 0 || (gwq && gwk && gwv && scratch), "qkv backward: conv needs weight gradients and scratch");
  const int64_t warps = qkv_warps(a, kTokB);
  if (warps == 0) return;
  const unsigned blocks = blocks_for(warps, kThreads / 32);
  if (a.p_bf16) {
    auto* d = static_cast<bf16*>(dP);
    if (a.W <= 4) qkv_bwd_kernel<4, bf16><<<blocks, kThreads, 0, stream>>>(a, g, d, scratch);
    else qkv_bwd_kernel<kMaxConv, bf16><<<blocks, kThreads, 0, stream>>>(a, g, d, scratch);
  } else {
    auto* d = static_cast<float*>(dP);
    if (a.W <= 4) qkv_bwd_kernel<4, float><<<blocks, kThreads, 0, stream>>>(a, g, d, scratch);
    else qkv_bwd_kernel<kMaxConv, float><<<blocks, kThreads, 0, stream>>>(a, g, d, scratch);
  }
  LAR_CUDA_LAUNCHED();
  if (a.W == 0) return;
  conv_weight_finish<<<static_cast<unsigned>(a.ldp * a.W), kThreads, 0, stream>>>(
      a, scratch, a.B * ((a.T + kTokB - 1) / kTokB), gwq, gwk, gwv);
  LAR_CUDA_LAUNCHED();
}

void gate_forward(const GateArgs& a, float* out, bf16* outb, cudaStream_t stream) {
  require((out != nullptr) != (outb != nullptr), "gate forward: exactly one output");
  require(a.map == GateMap::sigmoid || a.bias, "gate forward: missing bias");
  require(a.map != GateMap::decay || (a.A_log && a.per_head > 0), "gate forward: missing A_log");
  if (a.N * a.C == 0) return;
  gate_fwd_kernel<<<blocks_for(a.N * a.C, kThreads), kThreads, 0, stream>>>(a, out, outb);
  LAR_CUDA_LAUNCHED();
}

void gate_backward(const GateArgs& a, const float* dyf, const bf16* dyb, const float* extra, float* df,
                   int64_t ldd, float* aterm, cudaStream_t stream) {
  require(a.map != GateMap::decay || aterm, "gate backward: decay needs aterm");
  if (a.N * a.C == 0) return;
  gate_bwd_kernel<<<blocks_for(a.N * a.C, kThreads), kThreads, 0, stream>>>(a, dyf, dyb, extra, df, ldd, aterm);
  LAR_CUDA_LAUNCHED();
}

int colsum_splits(int64_t N) { return static_cast<int>(std::clamp<int64_t>(N / 64, 1, kMaxSplits)); }

std::size_t colsum_scratch_floats(int64_t N, int C) { return static_cast<std::size_t>(colsum_splits(N)) * C; }

void colsum_accumulate(const float* M, int64_t N, int C, int64_t ld, int group, float* out, float* scratch,
                       cudaStream_t stream) {
  require(group >= 1 && C % group == 0, "colsum: group must divide the columns");
  if (C == 0 || N == 0) return;
  const int splits = colsum_splits(N);
  colsum_kernel<<<dim3(blocks_for(C, 32), splits), kThreads, 0, stream>>>(M, N, C, ld, scratch);
  LAR_CUDA_LAUNCHED();
  colsum_finish<<<C / group, kThreads, 0, stream>>>(scratch, splits, C, group, out);
  LAR_CUDA_LAUNCHED();
}

void out_gate_forward(int64_t rows, const bf16* o, const void* og, const float* wn, float eps, void* ypre,
                      float* rstd, bool act_bf16, cudaStream_t stream) {
  if (rows == 0) return;
  const unsigned blocks = blocks_for(rows, kThreads / 32 * kRowsW);
  if (act_bf16)
    out_fwd_kernel<<<blocks, kThreads, 0, stream>>>(rows, o, static_cast<const bf16*>(og), wn, eps,
                                                    static_cast<bf16*>(ypre), rstd);
  else
    out_fwd_kernel<<<blocks, kThreads, 0, stream>>>(rows, o, static_cast<const float*>(og), wn, eps,
                                                    static_cast<float*>(ypre), rstd);
  LAR_CUDA_LAUNCHED();
}

std::size_t out_gate_backward_scratch_floats(int64_t rows) {
  return static_cast<std::size_t>(out_blocks(rows)) * kSeg;
}

void out_gate_backward(int64_t rows, const bf16* o, const void* og, const float* wn, const float* rstd,
                       const void* dypre, bf16* dO, void* dog, float* dwn, float* scratch, bool act_bf16,
                       cudaStream_t stream) {
  if (rows == 0) return;
  const int blocks = out_blocks(rows);
  if (act_bf16)
    out_bwd_kernel<<<blocks, kThreads, 0, stream>>>(rows, o, static_cast<const bf16*>(og), wn, rstd,
                                                    static_cast<const bf16*>(dypre), dO, static_cast<bf16*>(dog),
                                                    scratch);
  else
    out_bwd_kernel<<<blocks, kThreads, 0, stream>>>(rows, o, static_cast<const float*>(og), wn, rstd,
                                                    static_cast<const float*>(dypre), dO, static_cast<float*>(dog),
                                                    scratch);
  LAR_CUDA_LAUNCHED();
  colsum_finish<<<kSeg, kThreads, 0, stream>>>(scratch, blocks, kSeg, 1, dwn);
  LAR_CUDA_LAUNCHED();
}

void route_query(const RouteArgs& a, bf16* qr, cudaStream_t stream) {
  const int64_t warps = a.B * a.T * a.H;
  if (warps == 0) return;
  route_query_kernel<<<blocks_for(warps, kThreads / 32), kThreads, 0, stream>>>(a, qr);
  LAR_CUDA_LAUNCHED();
}

void route_residual(const RouteArgs& a, const bf16* o2, float* r, cudaStream_t stream) {
  const int64_t pairs = a.B * a.T * a.H * kSeg / 2;
  if (pairs == 0) return;
  route_residual_kernel<<<blocks_for(pairs, kThreads), kThreads, 0, stream>>>(a, o2, r);
  LAR_CUDA_LAUNCHED();
}

void route_readout_grad(const RouteArgs& a, const float* dr, bf16* do2, cudaStream_t stream) {
  const int64_t pairs = a.B * a.T * a.H * kSeg / 2;
  if (pairs == 0) return;
  route_readout_grad_kernel<<<blocks_for(pairs, kThreads), kThreads, 0, stream>>>(a, dr, do2);
  LAR_CUDA_LAUNCHED();
}

void route_backward(const RouteArgs& a, const RouteGrads& g, cudaStream_t stream) {
  require(!a.g || (g.dg && g.dg2), "route backward: gated mixer needs dg and dg2");
  require(!g.dbeta || g.dbeta2, "route backward: dbeta needs dbeta2");
  require(!a.b || (g.eb && g.ew && g.db2 && g.dw2), "route backward: gdn2 needs eb, ew, db2, dw2");
  const int64_t warps = a.B * a.T * a.H;
  if (warps == 0) return;
  route_backward_kernel<<<blocks_for(warps, kThreads / 32), kThreads, 0, stream>>>(a, g);
  LAR_CUDA_LAUNCHED();
}

LayerTimer::LayerTimer(const char* name, cudaStream_t stream)
    : Scope(layer_profile(), profiling_enabled(), name, stream) {}

std::vector<std::pair<std::string, double>> layer_profile_report() {
  if (layer_profile().empty()) return {};
  LAR_CUDA_CHECK(cudaDeviceSynchronize());
  return layer_profile().report();
}

}  // namespace lar::kernels::cuda::linear
