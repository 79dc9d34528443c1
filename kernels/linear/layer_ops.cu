// The elementwise and reduction parts of a linear-mixer layer on the GPU: see layer_ops.hpp.
// All of them are memory-bound. Where a per-head reduction is needed (L2 norm, output
// RMSNorm) half a warp takes a row of 64 channels, 4 channels a lane, and a thread several
// rows / tokens with all loads issued first, so many reductions are in flight; the routing
// readouts use a warp per (token, head) row, 2 channels a lane; elementwise maps one thread
// per element (or per 4). Column sums run in two fixed-order stages (no atomics).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/linear/op_common.cuh"
#include "kernels/linear/layer_ops.hpp"

namespace lar::kernels::cuda::linear {
namespace {

using op_common::blocks_for;
using op_common::from_f;
using op_common::to_f;
using op_common::warp_sum;

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
__device__ __forceinline__ float2 ld_bf2(const bf16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ void st_bf2(bf16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}



void require(bool ok, const std::string& what) {
  if (!ok) throw RuntimeError("linear layer ops: " + what);
}

// ---------------------------------------------------------------- q, k, v
// Which part (q 0, k 1, v 2) a column of P belongs to and its column within that part.
struct Part {
  int which, col;
};
// The conv's channels: q, k, v (P's row stride ldp may be wider, see QkvArgs).
__host__ __device__ __forceinline__ int qkv_channels(const QkvArgs& a) { return 2 * a.Cq + a.Cv; }
__device__ __forceinline__ Part part_of(int c, int Cq) {
  if (c < Cq) return {0, c};
  if (c < 2 * Cq) return {1, c - Cq};
  return {2, c - 2 * Cq};
}

// Runs through time, parallel over tokens and channels. The causal conv needs only the W−1
// previous inputs, so nothing forces one walk per sequence: a block of 8 warps takes 128
// channels (two heads; a lane 4 channels, 8-byte bf16 accesses, 16 lanes per head) × 8 runs
// of R consecutive tokens, a warp one run. A thread walks its run in groups of G tokens,
// carrying the conv's K−1 previous rows in registers, and its P (and, backward, dy) rows
// arrive through a ring of S groups in shared memory filled by cp.async: while a group is
// computed the next S−1 groups are in flight, so loads overlap the math within each warp.
// (The tiles this replaces — 8 tokens a warp, all loads first, then the math — left each
// warp either loading or computing: 5.0 / 10.4 ms fwd / bwd per step at B·T = 32K on the
// H200, 2.6× / 3.7× the byte floor.) Each thread reads back only the ring slots it filled
// itself, so no barrier is needed around the ring; a slot is refilled only after its rows
// have been used. The conv's taps are zero-padded at the front to K (4, or 8 for W 5..8):
// K − W leading taps are 0, so every width shares one code path; K = 1 is the no-conv case.
constexpr int kTileCh = 32 * 4;  // channels per block: 128 (two heads)
// tokens per warp (one run; the backward recomputes K−1 more). H200, B·T = 32K: forward 32 →
// 64 tokens 140 → 133 µs (128: slower again, ≈ 3 waves of blocks); backward 32 → 64 → 128
// tokens 356 → 319 → 303 µs.
constexpr int kFwdRun = 64, kBwdRun = 128;
constexpr int kFwdG = 4, kFwdS = 4;  // forward: rows per ring stage, stages
// backward: rows per stage, stages, tokens per shared L2 butterfly (2 or 4 tokens per butterfly
// measured 440 / 760 µs against 1 token's 319: the registers run out)
constexpr int kBwdG = 4, kBwdS = 4, kBwdB = 1;
// blocks per SM the register allocation must allow: forward ≤ 80 registers (3 blocks of 8
// warps), backward ≤ 128 (2 blocks; with 80 it spills hundreds of bytes)
constexpr int kFwdBlocks = 3, kBwdBlocks = 2;

// Four consecutive channels in the storage dtype, kept packed until used.
template <class TP>
using Raw4 = std::conditional_t<std::is_same_v<TP, bf16>, uint2, float4>;
template <class R4>  // the storage dtype back from its Raw4
using TPof = std::conditional_t<std::is_same_v<R4, uint2>, bf16, float>;
template <class TP>
__device__ __forceinline__ Raw4<TP> ld_raw4(const TP* p) {
  return *reinterpret_cast<const Raw4<TP>*>(p);
}
template <class TP>
__device__ __forceinline__ Raw4<TP> zero_raw4() {
  if constexpr (std::is_same_v<TP, bf16>) return make_uint2(0u, 0u);
  else return make_float4(0.f, 0.f, 0.f, 0.f);
}
// bf16 → fp32 is a shift or a mask of the bits; written in plain C (not the cuda_bf16
// intrinsics, which are inline asm the compiler cannot merge) so that a row used by the K
// conv taps and K weight-gradient taps is unpacked once.
__device__ __forceinline__ void unpack4(uint2 u, float* f) {
  f[0] = __uint_as_float(u.x << 16), f[1] = __uint_as_float(u.x & 0xffff0000u);
  f[2] = __uint_as_float(u.y << 16), f[3] = __uint_as_float(u.y & 0xffff0000u);
}
__device__ __forceinline__ void unpack4(float4 v, float* f) { f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w; }
__device__ __forceinline__ void st4(bf16* p, const float* f) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(f[0], f[1]), hi = __floats2bfloat162_rn(f[2], f[3]);
  uint2 u;
  u.x = *reinterpret_cast<const unsigned*>(&lo);
  u.y = *reinterpret_cast<const unsigned*>(&hi);
  *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ void st4(float* p, const float* f) {
  *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
}
__device__ __forceinline__ void add4(const float* p, float* f) {
  const float4 e = *reinterpret_cast<const float4*>(p);
  f[0] += e.x, f[1] += e.y, f[2] += e.z, f[3] += e.w;
}
// The special-function unit's approximations with denormals flushed (.ftz): without it each
// ex2 / rcp / rsqrt carries a few instructions of denormal scaling, and these kernels are
// close to instruction-bound. (Flushing changes nothing here: SiLU's 1 + 2^(−x·log2 e) is ≥ 1,
// an L2 sum is ≥ 1e-6.)
__device__ __forceinline__ float rsqrt_ftz(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// SiLU's sigmoid. fp32 P (the fp32 path): 1 / (1 + 2^(−x·log2 e)), ≈ 2 ulp like __expf and the
// fast division. bf16 P (mixed precision, whose q, k, v and dP are bf16): ½ + ½·tanh(x/2), one
// special-function op instead of two (tanh.approx: relative error ≤ 2^-11, |Δσ| ≤ 2.5e-4,
// 16× below bf16's rounding; the quarter-rate unit ran ex2 + rcp for every element).
// Measured on the H200 at B·T = 32K: forward 135 → 129 µs, backward 319 → 312 µs; the kernel
// test's fp32 outputs (vout, weight gradients) move from ≈ 1e-7 to ≈ 2e-6 with it.
template <class TP>
__device__ __forceinline__ float sigm_fast(float x) {
  if constexpr (std::is_same_v<TP, bf16>) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.5f * x));
    return fmaf(0.5f, t, 0.5f);
  } else {
    return rcp_ftz(1.f + ex2_ftz(-1.4426950408889634f * x));
  }
}
// Sum over the 16 lanes of a head (mask: this half of the warp; xor offsets < 16 stay in it).
__device__ __forceinline__ float head_sum(float v, unsigned mask) {
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
  return v;
}

// cp.async of one row piece (8 or 16 bytes) into this thread's ring slot; ok = false fills
// the slot with zeros (src-size 0: nothing is read).
template <class R4>
__device__ __forceinline__ void cp_row(unsigned s, const void* src, bool ok) {
  if constexpr (sizeof(R4) == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(ok ? 16 : 0) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(src), "r"(ok ? 8 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// One thread's place: sequence b, the first token t0 of its warp's run, channel c (4 of
// them), the block's tile index (for the weight-gradient partials), and its part.
struct TileThread {
  int64_t b, tile, nb;
  int t0, c, warp, lane;
  bool cok;       // c < 2Cq + Cv (uniform over each half-warp: the parts are multiples of 64)
  unsigned hmask; // the lanes of this thread's head
  Part pt;
};
template <int R>
__device__ __forceinline__ TileThread tile_thread(const QkvArgs& a) {
  TileThread r;
  r.lane = threadIdx.x & 31;
  r.warp = threadIdx.x >> 5;
  r.c = (blockIdx.x * 32 + r.lane) * 4;
  r.cok = r.c < qkv_channels(a);
  const int64_t tiles = (a.T + 8 * R - 1) / (8 * R);
  r.tile = blockIdx.y;
  r.b = blockIdx.y / tiles;
  r.t0 = static_cast<int>(blockIdx.y % tiles) * 8 * R + r.warp * R;
  r.nb = r.b * a.T;
  r.hmask = (r.lane & 16) ? 0xffff0000u : 0x0000ffffu;
  r.pt = part_of(r.cok ? r.c : 0, a.Cq);
  return r;
}

// The padded conv taps of this thread's 4 channels: w[j][e] multiplies P[t − (K−1) + j]
// (the first K − W are zero); K = 1: the identity (no conv).
template <int K>
__device__ __forceinline__ void tile_weights(const QkvArgs& a, Part pt, float (&w)[K][4]) {
  if constexpr (K == 1) {
#pragma unroll
    for (int e = 0; e < 4; ++e) w[0][e] = 1.f;
  } else {
    const float* base = (pt.which == 0 ? a.wq : pt.which == 1 ? a.wk : a.wv) + (int64_t)pt.col * a.W;
    const int lead = K - a.W;
#pragma unroll
    for (int j = 0; j < K; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) w[j][e] = j >= lead ? base[e * a.W + j - lead] : 0.f;
  }
}

// The K−1 rows before token t0 (zeros before the sequence), x[0 .. K−2]; p0 points at row t0.
template <int K, class TP, int n>
__device__ __forceinline__ void halo_rows(const QkvArgs& a, int t0, const TP* p0, Raw4<TP> (&x)[n]) {
#pragma unroll
  for (int j = 0; j < K - 1; ++j)
    x[j] = t0 - (K - 1) + j >= 0 ? ld_raw4(p0 - (int64_t)(K - 1 - j) * a.ldp) : zero_raw4<TP>();
}

// The conv pre-activation s of the token whose window starts at row i of x.
template <int K, class R4, int n>
__device__ __forceinline__ void tile_conv(const R4 (&x)[n], int i, const float (&w)[K][4], float* s) {
  s[0] = s[1] = s[2] = s[3] = 0.f;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    float f[4];
    unpack4(x[i + j], f);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] = fmaf(w[j][e], f[e], s[e]);
  }
}

// cler's routed input on ṽ: act += Γ·rin (v part only).
__device__ __forceinline__ void add_routed(const QkvArgs& a, Part pt, int64_t n, float* act) {
  if (pt.which == 2 && a.rin) {
    const float gm = *a.gamma;
    const float4 r = *reinterpret_cast<const float4*>(a.rin + n * a.Cv + pt.col);
    act[0] = fmaf(gm, r.x, act[0]), act[1] = fmaf(gm, r.y, act[1]);
    act[2] = fmaf(gm, r.z, act[2]), act[3] = fmaf(gm, r.w, act[3]);
  }
}

// Per-head sums of G tokens at once: the G values of each butterfly round are independent,
// so the 4 rounds cost 4 shuffle latencies for all G tokens instead of 4 per token.
template <int G>
__device__ __forceinline__ void head_sums(float (&v)[G], unsigned mask) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1)
#pragma unroll
    for (int i = 0; i < G; ++i) v[i] += __shfl_xor_sync(mask, v[i], o);
}

// The forward: per group of G tokens, conv + SiLU (+ Γ·rin) + per-head L2 (one butterfly for
// the G tokens), stored in bf16 (and ṽ in fp32 into vout). The same kernel is the backward's
// recompute, so both give the same bits.
template <int K, class TP, int G, int S, int R>
__global__ void __launch_bounds__(kThreads, kFwdBlocks) qkv_fwd_kernel(QkvArgs a, bf16* q, bf16* k, bf16* v, float* vout) {
  static_assert(R % G == 0, "a run is whole groups");
  using R4 = Raw4<TP>;
  extern __shared__ uint4 qkv_smem[];
  const TileThread th = tile_thread<R>(a);
  if (!th.cok || th.t0 >= a.T) return;  // uniform per half-warp; no block barrier follows
  const TP* p0 = static_cast<const TP*>(a.P) + (th.nb + th.t0) * a.ldp + th.c;  // row t0
  const int n = static_cast<int>(std::min<int64_t>(R, a.T - th.t0));  // tokens of the run (uniform per warp)
  const int groups = (n + G - 1) / G;
  const R4* ring = reinterpret_cast<const R4*>(qkv_smem) + threadIdx.x;  // this thread's slots, kThreads apart
  const unsigned sring = static_cast<unsigned>(__cvta_generic_to_shared(ring));
  auto issue = [&](int grp, int slot) {  // rows t0 + grp·G + r (zeros past T) into the slot
    if (grp < groups) {
      const TP* src = p0 + (int64_t)grp * G * a.ldp;
#pragma unroll
      for (int r = 0; r < G; ++r, src += a.ldp) {
        const bool ok = th.t0 + grp * G + r < a.T;
        cp_row<R4>(sring + (slot * G + r) * kThreads * sizeof(R4), ok ? src : p0, ok);
      }
    }
    cp_commit();  // one group per call, empty or not: wait_group counts them
  };
#pragma unroll
  for (int s = 0; s < S; ++s) issue(s, s);
  float w[K][4];
  tile_weights<K>(a, th.pt, w);
  R4 x[G + K - 1];  // rows t − (K−1) .. t + G − 1 of the group at t
  halo_rows<K, TP>(a, th.t0, p0, x);
  const int64_t ldo = th.pt.which == 2 ? a.Cv : a.Cq;
  bf16* orow = (th.pt.which == 0 ? q : th.pt.which == 1 ? k : v) + (th.nb + th.t0) * ldo + th.pt.col;  // row t
  int slot = 0;
#pragma unroll 1
  for (int grp = 0; grp < groups; ++grp) {
    cp_wait<S - 1>();  // this group's rows have landed (S − 1 newer groups may be pending)
#pragma unroll
    for (int r = 0; r < G; ++r) x[K - 1 + r] = ring[(slot * G + r) * kThreads];
    const int t = th.t0 + grp * G;
    float act[G][4];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      float s[4];
      tile_conv<K>(x, i, w, s);
#pragma unroll
      for (int e = 0; e < 4; ++e) act[i][e] = K > 1 ? s[e] * sigm_fast<TP>(s[e]) : s[e];
      if (t + i < a.T) add_routed(a, th.pt, th.nb + t + i, act[i]);
    }
    if (th.pt.which < 2 && a.l2) {  // uniform per half-warp
      float ss[G];
#pragma unroll
      for (int i = 0; i < G; ++i)
        ss[i] = act[i][0] * act[i][0] + act[i][1] * act[i][1] + act[i][2] * act[i][2] + act[i][3] * act[i][3];
      head_sums(ss, th.hmask);
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const float rn = rsqrt_ftz(ss[i] + 1e-6f);
#pragma unroll
        for (int e = 0; e < 4; ++e) act[i][e] *= rn;
      }
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      if (grp * G + i >= n) break;  // uniform over the warp
      st4(orow + i * ldo, act[i]);
      if (th.pt.which == 2 && vout) st4(vout + (th.nb + t + i) * a.Cv + th.pt.col, act[i]);
    }
    orow += G * ldo;
    issue(grp + S, slot);  // the slot's rows are used: refill it S groups ahead
    slot = slot + 1 == S ? 0 : slot + 1;
#pragma unroll
    for (int j = 0; j < K - 1; ++j) x[j] = x[G + j];
  }
}

// The forward with 8 channels a lane (bf16 P; the layer's mixed-precision path): 16-byte
// rows, one cp.async and one ring read per row and lane, 8 lanes a head (3 butterfly rounds
// for the L2 sums), a warp 4 heads, a block 256 channels × 8 runs of R tokens. The 4-channel
// kernel above issued ≈ 140 instructions per token and thread and was bound by them (ncu:
// 0.74 warps issued per scheduler and cycle, DRAM 56%); per channel this one issues the
// addressing, cp.async, ring and shuffle work once for 8 channels instead of twice for 4.
// Otherwise the same walk (runs, groups of G, a ring of S groups, K−1 halo rows in
// registers) and the same per-element math.
constexpr int kTileCh8 = 32 * 8;  // channels per block: 256 (four heads)
constexpr int kFwd8Blocks = 2;    // ≤ 128 registers (W ≤ 4: 128, no spills)
__device__ __forceinline__ void unpack8(uint4 u, float* f) {
  unpack4(make_uint2(u.x, u.y), f);
  unpack4(make_uint2(u.z, u.w), f + 4);
}
__device__ __forceinline__ void st8(bf16* p, const float* f) {
  uint4 u;
  unsigned* w = &u.x;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * e], f[2 * e + 1]);
    w[e] = *reinterpret_cast<const unsigned*>(&h);
  }
  *reinterpret_cast<uint4*>(p) = u;
}

template <int K, int G, int S, int R>
__global__ void __launch_bounds__(kThreads, kFwd8Blocks) qkv_fwd8_kernel(QkvArgs a, bf16* q, bf16* k, bf16* v,
                                                                        float* vout) {
  static_assert(R % G == 0, "a run is whole groups");
  extern __shared__ uint4 qkv_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = (blockIdx.x * 32 + lane) * 8;
  const int64_t tiles = (a.T + 8 * R - 1) / (8 * R);
  const int64_t nb = blockIdx.y / tiles * a.T;
  const int t0 = static_cast<int>(blockIdx.y % tiles) * 8 * R + warp * R;
  // uniform per head (8 lanes; the parts are multiples of 64) and per warp; no barrier follows
  if (c >= qkv_channels(a) || t0 >= a.T) return;
  const unsigned hmask = 0xffu << (lane & 24);
  const Part pt = part_of(c, a.Cq);
  const bf16* p0 = static_cast<const bf16*>(a.P) + (nb + t0) * a.ldp + c;  // row t0
  const int n = static_cast<int>(std::min<int64_t>(R, a.T - t0));
  const int groups = (n + G - 1) / G;
  const uint4* ring = qkv_smem + threadIdx.x;
  const unsigned sring = static_cast<unsigned>(__cvta_generic_to_shared(ring));
  auto issue = [&](int grp, int slot) {
    if (grp < groups) {
      const bf16* src = p0 + (int64_t)grp * G * a.ldp;
#pragma unroll
      for (int r = 0; r < G; ++r, src += a.ldp) {
        const bool ok = t0 + grp * G + r < a.T;
        cp_row<uint4>(sring + (slot * G + r) * kThreads * sizeof(uint4), ok ? src : p0, ok);
      }
    }
    cp_commit();
  };
#pragma unroll
  for (int s = 0; s < S; ++s) issue(s, s);
  float w[K][8];
  if constexpr (K == 1) {
#pragma unroll
    for (int e = 0; e < 8; ++e) w[0][e] = 1.f;
  } else {
    const float* base = (pt.which == 0 ? a.wq : pt.which == 1 ? a.wk : a.wv) + (int64_t)pt.col * a.W;
    const int lead = K - a.W;
#pragma unroll
    for (int j = 0; j < K; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) w[j][e] = j >= lead ? base[e * a.W + j - lead] : 0.f;
  }
  uint4 x[G + K - 1];
#pragma unroll
  for (int j = 0; j < K - 1; ++j)
    x[j] = t0 - (K - 1) + j >= 0 ? *reinterpret_cast<const uint4*>(p0 - (int64_t)(K - 1 - j) * a.ldp)
                                 : make_uint4(0u, 0u, 0u, 0u);
  const int64_t ldo = pt.which == 2 ? a.Cv : a.Cq;
  bf16* orow = (pt.which == 0 ? q : pt.which == 1 ? k : v) + (nb + t0) * ldo + pt.col;
  int slot = 0;
#pragma unroll 1
  for (int grp = 0; grp < groups; ++grp) {
    cp_wait<S - 1>();
#pragma unroll
    for (int r = 0; r < G; ++r) x[K - 1 + r] = ring[(slot * G + r) * kThreads];
    const int t = t0 + grp * G;
    float act[G][8];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      float s8[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) s8[e] = 0.f;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        float f[8];
        unpack8(x[i + j], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) s8[e] = fmaf(w[j][e], f[e], s8[e]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) act[i][e] = K > 1 ? s8[e] * sigm_fast<bf16>(s8[e]) : s8[e];
      if (pt.which == 2 && a.rin && t + i < a.T) {
        const float gm = *a.gamma;
        const float* rp = a.rin + (nb + t + i) * a.Cv + pt.col;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float4 r4 = *reinterpret_cast<const float4*>(rp + 4 * h);
          act[i][4 * h] = fmaf(gm, r4.x, act[i][4 * h]), act[i][4 * h + 1] = fmaf(gm, r4.y, act[i][4 * h + 1]);
          act[i][4 * h + 2] = fmaf(gm, r4.z, act[i][4 * h + 2]), act[i][4 * h + 3] = fmaf(gm, r4.w, act[i][4 * h + 3]);
        }
      }
    }
    if (pt.which < 2 && a.l2) {  // uniform per head
      float ss[G];
#pragma unroll
      for (int i = 0; i < G; ++i) {
        ss[i] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) ss[i] = fmaf(act[i][e], act[i][e], ss[i]);
      }
#pragma unroll
      for (int o = 4; o > 0; o >>= 1)
#pragma unroll
        for (int i = 0; i < G; ++i) ss[i] += __shfl_xor_sync(hmask, ss[i], o);
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const float rn = rsqrt_ftz(ss[i] + 1e-6f);
#pragma unroll
        for (int e = 0; e < 8; ++e) act[i][e] *= rn;
      }
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      if (grp * G + i >= n) break;  // uniform over the warp
      st8(orow + i * ldo, act[i]);
      if (pt.which == 2 && vout) {
        float* vo = vout + (nb + t + i) * a.Cv + pt.col;
        st4(vo, act[i]);
        st4(vo + 4, act[i] + 4);
      }
    }
    orow += G * ldo;
    issue(grp + S, slot);
    slot = slot + 1 == S ? 0 : slot + 1;
#pragma unroll
    for (int j = 0; j < K - 1; ++j) x[j] = x[G + j];
  }
}

// The gradient arriving on the activation of token n: the kernels' dq / dk / dv plus the
// routing extras.
template <class TD>
__device__ __forceinline__ void tile_dy(const QkvArgs& a, const QkvGrads& g, Part pt, int64_t n, TD raw, float* dy) {
  unpack4(raw, dy);
  if (pt.which == 1 && g.ek) add4(g.ek + n * a.Cq + pt.col, dy);
  if (pt.which == 2) {
    if (g.ev) add4(g.ev + n * a.Cv + pt.col, dy);
    if (g.dvout) add4(g.dvout + n * a.Cv + pt.col, dy);
  }
}
__device__ __forceinline__ const bf16* dy_row(const QkvArgs& a, const QkvGrads& g, Part pt, int64_t n) {
  return pt.which == 0 ? g.dq + n * a.Cq + pt.col : pt.which == 1 ? g.dk + n * a.Cq + pt.col : g.dv + n * a.Cv + pt.col;
}
// du (the gradient on the conv pre-activation s; on P without conv) of G consecutive tokens
// t_first + i whose conv windows start at row row0 + i of x, from their dy (raw bf16 in
// dyr[i]), recomputing the activation; 0 for tokens past the end. The L2 sums of the G
// tokens share one butterfly. own: the tokens are this tile's (cler's d_in and the Γ terms
// are written by the tile that owns the token).
template <int K, int G, class R4, int n>
__device__ __forceinline__ void tile_du(const QkvArgs& a, const QkvGrads& g, const TileThread& th, const R4 (&x)[n],
                                        int row0, int t_first, const uint2 (&dyr)[G], const float (&w)[K][4],
                                        bool own, float (&du)[G][4]) {
  // (the activation itself is needed only by the L2 norm, on q and k, which have no routed
  // input: act = s·σ(s) there, recomputed where used instead of held in registers)
  float s[G][4], sg[G][4];
#pragma unroll
  for (int i = 0; i < G; ++i) {
    const int t = t_first + i;
    tile_conv<K>(x, row0 + i, w, s[i]);
#pragma unroll
    for (int e = 0; e < 4; ++e) sg[i][e] = K > 1 ? sigm_fast<TPof<R4>>(s[i][e]) : 1.f;
    if (t < a.T) {
      tile_dy(a, g, th.pt, th.nb + t, dyr[i], du[i]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) du[i][e] = 0.f;
    }
  }
  if (th.pt.which < 2 && a.l2) {  // uniform per half-warp
    // y = a·r, r = 1/sqrt(Σa² + eps): da = r (dy − y (y·dy)), y·dy = r (a·dy)
    float sums[2 * G];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      float aa = 0.f, ad = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float act = s[i][e] * sg[i][e];
        aa = fmaf(act, act, aa), ad = fmaf(act, du[i][e], ad);
      }
      sums[2 * i] = aa, sums[2 * i + 1] = ad;
    }
    head_sums(sums, th.hmask);
#pragma unroll
    for (int i = 0; i < G; ++i) {
      // da = r·dy − (r³·(a·dy))·a
      const float rn = rsqrt_ftz(sums[2 * i] + 1e-6f), c = rn * rn * rn * sums[2 * i + 1];
#pragma unroll
      for (int e = 0; e < 4; ++e) du[i][e] = fmaf(-c, s[i][e] * sg[i][e], rn * du[i][e]);
    }
  }
#pragma unroll
  for (int i = 0; i < G; ++i) {
    const int t = t_first + i;
    if (own && th.pt.which == 2 && a.rin && t < a.T) {  // ṽ = silu(conv) + gamma·rin
      const int64_t j = (th.nb + t) * a.Cv + th.pt.col;
      const float4 rr = *reinterpret_cast<const float4*>(a.rin + j);
      if (g.d_in) {
        const float gm = *a.gamma;
        float4 di = *reinterpret_cast<float4*>(g.d_in + j);
        di.x = fmaf(gm, du[i][0], di.x), di.y = fmaf(gm, du[i][1], di.y);
        di.z = fmaf(gm, du[i][2], di.z), di.w = fmaf(gm, du[i][3], di.w);
        *reinterpret_cast<float4*>(g.d_in + j) = di;
      }
      *reinterpret_cast<float4*>(g.dgam_terms + j) =
          make_float4(du[i][0] * rr.x, du[i][1] * rr.y, du[i][2] * rr.z, du[i][3] * rr.w);
    }
    if constexpr (K > 1) {  // silu'(s) = σ (1 + s (1 − σ)) = σ + a (1 − σ), a = s·σ, σ from the recompute above
#pragma unroll
      for (int e = 0; e < 4; ++e) du[i][e] *= fmaf(s[i][e] * sg[i][e], 1.f - sg[i][e], sg[i][e]);
    }
    if (t >= a.T) du[i][0] = du[i][1] = du[i][2] = du[i][3] = 0.f;
  }
}

// The backward of the whole qkv pass, one run per warp: du of each group of G tokens
// (recomputing the conv, SiLU and L2 from P), the conv weights' gradient Σ_t du[t]·P[t −
// (K−1) + j] summed per thread, and the conv's transpose dP[t] = Σ_j w[j]·du[t + K−1−j]
// accumulated forward in time: du[u] adds w[j]·du[u] to the pending sums of tokens u − (K−1)
// + j, and the sum of token u − (K−1) is complete (stored) once du[u] is in. So the warp
// walks K−1 tokens past its run (their du only completes its last dP rows; they are the next
// run's, which computes them again as its own), and skips the dP rows of the K−1 tokens before
// its run (the previous run's). The weight sums of the block's 8 warps are added in a fixed
// order into one partial per block (conv_weight_finish sums the blocks in order: no atomics).
template <int K, class TP, int G, int S, int B, int R>
__global__ void __launch_bounds__(kThreads, kBwdBlocks) qkv_bwd_kernel(QkvArgs a, QkvGrads g, TP* dP, float* wpartial) {
  static_assert(R % G == 0 && G % B == 0, "a run is whole groups, a group whole butterflies");
  using R4 = Raw4<TP>;
  extern __shared__ uint4 qkv_smem[];
  const TileThread th = tile_thread<R>(a);
  const bool active = th.cok && th.t0 < a.T;  // uniform per half-warp
  float w[K][4], acc[K][4];
  tile_weights<K>(a, th.pt, w);
#pragma unroll
  for (int j = 0; j < K; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  const R4* ringp = reinterpret_cast<const R4*>(qkv_smem) + threadIdx.x;
  const uint2* ringd = reinterpret_cast<const uint2*>(reinterpret_cast<const R4*>(qkv_smem) + S * G * kThreads) + threadIdx.x;
  const unsigned sringp = static_cast<unsigned>(__cvta_generic_to_shared(ringp)),
                 sringd = static_cast<unsigned>(__cvta_generic_to_shared(ringd));
  if (active) {
    const TP* p0 = static_cast<const TP*>(a.P) + (th.nb + th.t0) * a.ldp + th.c;  // row t0
    const bf16* d0 = dy_row(a, g, th.pt, th.nb + th.t0);
    const int64_t ldd = th.pt.which == 2 ? a.Cv : a.Cq;
    const int own = static_cast<int>(std::min<int64_t>(R, a.T - th.t0));  // the run's tokens
    // + the K−1 after it (du = 0 past T: the last rows' dP sums still complete)
    const int n = own + K - 1;
    const int groups = (n + G - 1) / G;
    auto issue = [&](int grp, int slot) {  // P and dy rows t0 + grp·G + r (zeros past T)
      if (grp < groups) {
        const TP* ps = p0 + (int64_t)grp * G * a.ldp;
        const bf16* ds = d0 + (int64_t)grp * G * ldd;
#pragma unroll
        for (int r = 0; r < G; ++r, ps += a.ldp, ds += ldd) {
          const bool ok = th.t0 + grp * G + r < a.T;
          cp_row<R4>(sringp + (slot * G + r) * kThreads * sizeof(R4), ok ? ps : p0, ok);
          cp_row<uint2>(sringd + (slot * G + r) * kThreads * sizeof(uint2), ok ? ds : d0, ok);
        }
      }
      cp_commit();
    };
#pragma unroll
    for (int s = 0; s < S; ++s) issue(s, s);
    R4 x[G + K - 1];  // rows t − (K−1) .. t + G − 1 of the group at t
    halo_rows<K, TP>(a, th.t0, p0, x);
    float pend[K > 1 ? K - 1 : 1][4];  // pend[j]: dP of token u − (K−1) + j so far (u: the next du)
#pragma unroll
    for (int j = 0; j < K - 1; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) pend[j][e] = 0.f;
    int slot = 0;
    TP* drow = dP + (th.nb + th.t0) * a.ldp + th.c;  // row t of the group
#pragma unroll 1
    for (int grp = 0; grp < groups; ++grp) {
      cp_wait<S - 1>();
      const bool mine = grp * G < own;  // the whole group is the run's (R % G = 0), or none of it
      // one token at a time (its du used at once: few live values), B tokens per butterfly
#pragma unroll
      for (int h = 0; h < G; h += B) {
        uint2 dg[B];
#pragma unroll
        for (int i = 0; i < B; ++i) {
          x[K - 1 + h + i] = ringp[(slot * G + h + i) * kThreads];
          dg[i] = ringd[(slot * G + h + i) * kThreads];
        }
        float du[B][4];
        tile_du<K, B>(a, g, th, x, h, th.t0 + grp * G + h, dg, w, mine, du);
#pragma unroll
        for (int i = 0; i < B; ++i) {
          if constexpr (K > 1) {
            if (mine) {
#pragma unroll
              for (int j = 0; j < K; ++j) {
                float f[4];
                unpack4(x[h + i + j], f);
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[j][e] = fmaf(du[i][e], f[e], acc[j][e]);
              }
            }
          }
          const int tp = grp * G + h + i - (K - 1);  // the token (in the run) whose dP completes
          float d[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if constexpr (K > 1) {
              d[e] = fmaf(w[0][e], du[i][e], pend[0][e]);
#pragma unroll
              for (int j = 1; j < K - 1; ++j) pend[j - 1][e] = fmaf(w[j][e], du[i][e], pend[j][e]);
              pend[K - 2][e] = w[K - 1][e] * du[i][e];
            } else {
              d[e] = du[i][e];
            }
          }
          if (tp >= 0 && tp < own) st4(drow + (h + i - (K - 1)) * a.ldp, d);  // uniform per warp
        }
      }
      issue(grp + S, slot);
      slot = slot + 1 == S ? 0 : slot + 1;
      drow += G * a.ldp;
#pragma unroll
      for (int j = 0; j < K - 1; ++j) x[j] = x[G + j];
    }
    cp_wait<0>();  // (only empty groups can be pending; the ring is reused below)
  }
  if constexpr (K > 1) {
    float4* sm = reinterpret_cast<float4*>(qkv_smem);  // 8 warps × K taps × 32 lanes
    __syncthreads();
#pragma unroll
    for (int j = 0; j < K; ++j) sm[(th.warp * K + j) * 32 + th.lane] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    __syncthreads();
    // thread → (lane l, tap j) pairs: the sum over the 8 warps in order
    for (int idx = threadIdx.x; idx < 32 * K; idx += blockDim.x) {
      const int l = idx % 32, j = idx / 32, m = j - (K - a.W);
      const int c = (blockIdx.x * 32 + l) * 4;
      if (m < 0 || c >= qkv_channels(a)) continue;
      float4 s = sm[j * 32 + l];
      for (int y = 1; y < 8; ++y) {
        const float4 v = sm[(y * K + j) * 32 + l];
        s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
      }
      float* wp = wpartial + th.tile * qkv_channels(a) * a.W + (int64_t)c * a.W + m;
      wp[0] = s.x, wp[a.W] = s.y, wp[2 * a.W] = s.z, wp[3 * a.W] = s.w;
    }
  }
}

// One block per weight (c, j): threads stride over the tiles' partials, then a fixed tree.
__global__ void conv_weight_finish(QkvArgs a, const float* partial, int64_t ranges, float* gwq, float* gwk,
                                   float* gwv) {
  __shared__ float red[kThreads];
  const int64_t i = blockIdx.x;
  const int c = static_cast<int>(i / a.W), j = static_cast<int>(i % a.W);
  float s = 0.f;
  for (int64_t r = threadIdx.x; r < ranges; r += blockDim.x) s += partial[r * qkv_channels(a) * a.W + i];
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
// softplus(x) and σ(x) from one exp: e = exp(−|x|) ∈ (0, 1], softplus = max(x, 0) + log(1 + e)
// (its series below 1e-3, where 1 + e would round), σ = 1/(1 + e) or e/(1 + e). The precise
// log1pf and division made the [N, 1024] gate passes instruction-bound (≈ 45% of the bandwidth).
__device__ __forceinline__ void softplus_sigm(float x, float& sp, float& sg) {
  const float e = __expf(-fabsf(x));
  const float r = __fdividef(1.f, 1.f + e);
  sp = fmaxf(x, 0.f) + (e < 1e-3f ? e * (1.f - 0.5f * e) : __logf(1.f + e));
  sg = x >= 0.f ? r : e * r;
}
__device__ __forceinline__ float softplus_fast(float x) {
  float sp, sg;
  softplus_sigm(x, sp, sg);
  return sp;
}
__device__ __forceinline__ float gate_value(const GateArgs& a, float f, int c) {
  switch (a.map) {
    case GateMap::decay: return -__expf(a.A_log[c / a.per_head]) * softplus_fast(f + a.bias[c]);
    case GateMap::logsig16: return -softplus_fast(-(f + a.bias[c])) / 16.f;
    default: return sigm(a.bias ? f + a.bias[c] : f);
  }
}
__global__ void gate_fwd_kernel(GateArgs a, float* out, bf16* outb) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.N * a.C) return;
  const int64_t n = i / a.C;
  const int c = static_cast<int>(i % a.C);
  const float y = gate_value(a, a.f[n * a.ldf + c], c);
  if (out) out[i] = y;
  else outb[i] = __float2bfloat16(y);
}

// The same maps four channels at a time (float4 loads and stores: the [N, 1024] maps of
// kda / gla / gdn2 are pure bandwidth; the scalar kernel with its 64-bit index division
// ran at ≈ 40% of it). Needs C, ldf % 4 = 0, 16-byte aligned f and out (checked by the host).
__global__ void gate_fwd4_kernel(GateArgs a, float* out, bf16* outb) {
  const int C4 = a.C / 4;
  const int i4 = blockIdx.x * blockDim.x + threadIdx.x;  // N·C < 2^31 (checked by the host)
  if (i4 >= a.N * C4) return;
  const int n = i4 / C4, c = (i4 - n * C4) * 4;
  const float4 f = *reinterpret_cast<const float4*>(a.f + (int64_t)n * a.ldf + c);
  const float y[4] = {gate_value(a, f.x, c), gate_value(a, f.y, c + 1), gate_value(a, f.z, c + 2),
                      gate_value(a, f.w, c + 3)};
  if (out) st4(out + (int64_t)n * a.C + c, y);
  else st4(outb + (int64_t)n * a.C + c, y);
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

// ---------------------------------------------------------------- packed weight pieces
// Block row y = piece y; its offset in the packed buffer and whether 4-element (16-byte
// source) accesses apply come from the host.
struct PieceLaunch {
  Pieces p;
  int64_t off[kMaxPieces];
  bool vec[kMaxPieces];
};
template <class TO>
__global__ void pack_pieces_kernel(PieceLaunch l, TO* out) {
  const int k = blockIdx.y;
  const float* s = l.p.src[k];
  TO* o = out + l.off[k];
  const int64_t n = l.p.n[k], tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x,
                stride = (int64_t)gridDim.x * blockDim.x;
  if (l.vec[k]) {
    for (int64_t i = tid; i < n / 4; i += stride) {
      const float4 v = s ? reinterpret_cast<const float4*>(s)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
      const float f[4] = {v.x, v.y, v.z, v.w};
      st4(o + 4 * i, f);
    }
  } else {
    for (int64_t i = tid; i < n; i += stride) o[i] = from_f<TO>(s ? s[i] : 0.f);
  }
}
__global__ void scatter_add_pieces_kernel(PieceLaunch l, const float* packed) {
  const int k = blockIdx.y;
  float* d = l.p.dst[k];
  if (!d) return;  // a piece without a destination (the padding rows) is dropped
  const float* s = packed + l.off[k];
  const int64_t n = l.p.n[k], tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x,
                stride = (int64_t)gridDim.x * blockDim.x;
  if (l.vec[k]) {
    for (int64_t i = tid; i < n / 4; i += stride) {
      float4 v = reinterpret_cast<float4*>(d)[i];
      const float4 a = reinterpret_cast<const float4*>(s)[i];
      v.x += a.x, v.y += a.y, v.z += a.z, v.w += a.w;
      reinterpret_cast<float4*>(d)[i] = v;
    }
  } else {
    for (int64_t i = tid; i < n; i += stride) d[i] += s[i];
  }
}

// ---------------------------------------------------------------- gdn's gates (fused projection)
// One thread per (token, head): β and g from P's fβ, fa columns, with gate_value's maps.
template <class TP>
__global__ void gdn_gates_fwd_kernel(GdnGateArgs a, float* beta, float* g) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.N * a.H) return;
  const int64_t n = i / a.H;
  const int h = static_cast<int>(i - n * a.H);
  const TP* f = static_cast<const TP*>(a.P) + n * a.ldp + a.off + h;
  beta[i] = sigm(to_f(f[0]));
  g[i] = -__expf(a.A_log[h]) * softplus_fast(to_f(f[a.H]) + a.dt_bias[h]);
}

// The backward over a split of rows per block: a thread keeps one head h (threads t and
// t + H·r share it) and walks every (256 / H)-th row of the split; its ∂dt_bias and ∂A_log
// terms are summed in registers, then over the block's row lanes in order in shared memory:
// one partial per (split, head), summed over the splits in order by colsum_finish. Replaces
// two gate_bwd passes, two colsum passes (the fp32 [N, 2H] df and the [N, H] A-terms) and
// the GEMMs' conversion of df (≈ 33 µs a layer at B·T = 32K, H = 16).
template <class TP>
__global__ void gdn_gates_bwd_kernel(GdnGateArgs a, const float* dbeta, const float* dg, TP* dP, float* pdt,
                                     float* pa) {
  __shared__ float red[2][kThreads];
  const int R = kThreads / a.H;  // rows in flight per block (H ≤ 128)
  const int t = threadIdx.x, h = t % a.H, r = t / a.H;
  const int64_t per = (a.N + gridDim.x - 1) / gridDim.x;
  const int64_t r0 = blockIdx.x * per, r1 = std::min<int64_t>(a.N, r0 + per);
  const int pad = static_cast<int>((a.width ? a.width : a.ldp) - a.off - 2 * a.H);
  float sdt = 0.f, sa = 0.f;
  if (r < R) {
    const float A = __expf(a.A_log[h]), bias = a.dt_bias[h];
    for (int64_t n = r0 + r; n < r1; n += R) {
      const TP* f = static_cast<const TP*>(a.P) + n * a.ldp + a.off + h;
      TP* d = dP + n * a.ldp + a.off + h;
      const int64_t i = n * a.H + h;
      const float s = sigm(to_f(f[0]));
      d[0] = from_f<TP>(dbeta[i] * s * (1.f - s));
      const float x = to_f(f[a.H]) + bias, dy = dg[i];
      const float dfa = -dy * A * sigm(x);
      d[a.H] = from_f<TP>(dfa);
      sdt += dfa;
      sa += dy * (-A * softplus(x));
      for (int j = h; j < pad; j += a.H) d[2 * a.H - h + j] = from_f<TP>(0.f);
    }
  }
  red[0][t] = sdt;
  red[1][t] = sa;
  __syncthreads();
  if (t < 2 * a.H) {
    const int k = t / a.H, hh = t % a.H;
    float sum = 0.f;
    for (int y = 0; y < R; ++y) sum += red[k][y * a.H + hh];
    (k == 0 ? pdt : pa)[(int64_t)blockIdx.x * a.H + hh] = sum;
  }
}

// ---------------------------------------------------------------- fused channel-gate backward
// decay / logsig16 over [N, C] (kda, gdn2: decay per head of 64; gla: logsig16) in one
// pass: df = ∂L/∂f (fp32 or bf16, the GEMMs' operand dtype) and the per-column partial sums
// of df (for the bias) and of dy·g (decay: for A_log) over a fixed row split. Block (64, 4):
// x → 4 columns, y → every 4th row of the split; the 4 rows' sums are added in order in
// shared memory, one partial per (split, column); colsum_finish sums the splits in order.
// Replaces gate_bwd_kernel + 2 colsum passes over fp32 [N, C] df and A-terms + the GEMMs'
// conversions of df (7.5 ms per step for kda at B·T = 32K).
template <class TD>
__global__ void gate_bwd_fused_kernel(GateArgs a, const float* dy, TD* df, int64_t ldd, float* pbias, float* pa) {
  __shared__ float4 red[2][4][64];
  const int tx = threadIdx.x & 63, ty = threadIdx.x >> 6;
  const int c = (blockIdx.x * 64 + tx) * 4;
  const int64_t per = (a.N + gridDim.y - 1) / gridDim.y;
  const int64_t r0 = blockIdx.y * per, r1 = std::min<int64_t>(a.N, r0 + per);
  float sb[4] = {0.f, 0.f, 0.f, 0.f}, sa[4] = {0.f, 0.f, 0.f, 0.f};
  if (c < a.C) {
    float bias[4], A[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      bias[e] = a.bias[c + e];
      A[e] = a.map == GateMap::decay ? __expf(a.A_log[(c + e) / a.per_head]) : 0.f;
    }
    for (int64_t n = r0 + ty; n < r1; n += 4) {
      const float4 f4 = *reinterpret_cast<const float4*>(a.f + n * a.ldf + c);
      const float4 d4 = *reinterpret_cast<const float4*>(dy + n * a.C + c);
      const float f[4] = {f4.x, f4.y, f4.z, f4.w}, d[4] = {d4.x, d4.y, d4.z, d4.w};
      float o[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = f[e] + bias[e];
        if (a.map == GateMap::decay) {
          float sp, sg;
          softplus_sigm(x, sp, sg);
          o[e] = -d[e] * A[e] * sg;
          sa[e] += d[e] * (-A[e] * sp);
        } else {
          float sp, sg;
          softplus_sigm(-x, sp, sg);
          o[e] = d[e] * sg / 16.f;
        }
        sb[e] += o[e];
      }
      st4(df + n * ldd + c, o);
    }
  }
  red[0][ty][tx] = make_float4(sb[0], sb[1], sb[2], sb[3]);
  red[1][ty][tx] = make_float4(sa[0], sa[1], sa[2], sa[3]);
  __syncthreads();
  if (ty < 2 && c < a.C) {
    float4 s = red[ty][0][tx];
    for (int y = 1; y < 4; ++y) {
      const float4 v = red[ty][y][tx];
      s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
    float* p = (ty == 0 ? pbias : pa) + (int64_t)blockIdx.y * a.C + c;
    if (ty == 0 || pa) *reinterpret_cast<float4*>(p) = s;
  }
}

// ---------------------------------------------------------------- output norm × gate
// Half a warp per row of 64 (4 channels a lane: 8-byte bf16 accesses, a 4-step shuffle
// reduction), a warp kRowsW rows = 4 row pairs, all loads issued before the math (one
// row of 2 channels a lane per step left these passes at ≈ 60% of the bandwidth).
constexpr int kRowsW = 8;

// Where row r (token r / heads, head r % heads) of og and dog starts: contiguous rows of 64
// (ld = 0), or heads of 64 at the front of rows of ld elements (the layer's wide GEMM output,
// og beside P; rows < 2^32, checked by the host).
struct OgRows {
  uint32_t heads = 1;
  int64_t ld = 0;
  __device__ __forceinline__ int64_t at(int64_t r) const {
    if (ld == 0) return r * kSeg;
    const uint32_t n = static_cast<uint32_t>(r) / heads;
    return n * ld + (static_cast<uint32_t>(r) - n * heads) * kSeg;
  }
};

template <class TA>
__global__ void out_fwd_kernel(int64_t rows, const bf16* o, const TA* og, OgRows gl, const float* wn, float eps,
                               TA* ypre, float* rstd) {
  const int lane = threadIdx.x & 31, half = lane >> 4, l4 = (lane & 15) * 4;
  const unsigned hmask = half ? 0xffff0000u : 0x0000ffffu;
  const int64_t r0 = ((int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * kRowsW + half;
  if (r0 >= rows) return;  // uniform per half-warp; no block barrier follows
  float w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) w[e] = wn[l4 + e];  // parameters: only 4-byte aligned
  uint2 x[kRowsW / 2];
  Raw4<TA> gt[kRowsW / 2];
#pragma unroll
  for (int j = 0; j < kRowsW / 2; ++j) {
    const int64_t r = r0 + 2 * j;
    x[j] = r < rows ? ld_raw4(o + r * kSeg + l4) : make_uint2(0u, 0u);
    gt[j] = r < rows ? ld_raw4(og + gl.at(r) + l4) : zero_raw4<TA>();
  }
#pragma unroll
  for (int j = 0; j < kRowsW / 2; ++j) {
    const int64_t r = r0 + 2 * j;
    if (r >= rows) break;  // uniform per half-warp
    float xv[4], g[4], y[4];
    unpack4(x[j], xv);
    unpack4(gt[j], g);
    const float rs =
        1.f / sqrtf(head_sum(xv[0] * xv[0] + xv[1] * xv[1] + xv[2] * xv[2] + xv[3] * xv[3], hmask) / kSeg + eps);
#pragma unroll
    for (int e = 0; e < 4; ++e) y[e] = xv[e] * rs * w[e] * g[e] * sigm(g[e]);
    st4(ypre + r * kSeg + l4, y);
    if ((lane & 15) == 0) rstd[r] = rs;
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
__global__ void out_bwd_kernel(int64_t rows, const bf16* o, const TA* og, OgRows gl, const float* wn, const float* rstd,
                               const TA* dypre, bf16* dO, TA* dog, TA* ypre, float* dwn_partial) {
  __shared__ float red[kThreads / 32][2][kSeg];
  const int lane = threadIdx.x & 31, wib = threadIdx.x / 32, half = lane >> 4, l4 = (lane & 15) * 4;
  const unsigned hmask = half ? 0xffff0000u : 0x0000ffffu;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  float w[4], dw[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int e = 0; e < 4; ++e) w[e] = wn[l4 + e];  // parameters: only 4-byte aligned
  for (int64_t r0 = ((int64_t)blockIdx.x * (blockDim.x / 32) + wib) * kRowsW + half; r0 < rows;
       r0 += warps * kRowsW) {
    uint2 x[kRowsW / 2];
    Raw4<TA> gt[kRowsW / 2], dy[kRowsW / 2];
    float rs[kRowsW / 2];
#pragma unroll
    for (int j = 0; j < kRowsW / 2; ++j) {
      const int64_t r = r0 + 2 * j;
      const bool ok = r < rows;
      x[j] = ok ? ld_raw4(o + r * kSeg + l4) : make_uint2(0u, 0u);
      gt[j] = ok ? ld_raw4(og + gl.at(r) + l4) : zero_raw4<TA>();
      dy[j] = ok ? ld_raw4(dypre + r * kSeg + l4) : zero_raw4<TA>();
      rs[j] = ok ? rstd[r] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kRowsW / 2; ++j) {
      const int64_t r = r0 + 2 * j;
      if (r >= rows) break;  // uniform per half-warp
      float xv[4], g[4], d[4], xh[4], dx[4], gg[4], out[4];
      unpack4(x[j], xv);
      unpack4(gt[j], g);
      unpack4(dy[j], d);
      float m = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        xh[e] = xv[e] * rs[j];                      // normalised o
        const float don = d[e] * g[e] * sigm(g[e]);  // on on = x̂·w
        gg[e] = d[e] * xh[e] * w[e] * silu_grad(g[e]);
        dw[e] = fmaf(don, xh[e], dw[e]);
        dx[e] = don * w[e];  // on x̂
        m = fmaf(dx[e], xh[e], m);
      }
      st4(dog + gl.at(r) + l4, gg);
      if (ypre) {  // the forward's output again, same expression (same bits) as out_fwd_kernel
#pragma unroll
        for (int e = 0; e < 4; ++e) out[e] = xv[e] * rs[j] * w[e] * g[e] * sigm(g[e]);
        st4(ypre + r * kSeg + l4, out);
      }
      m = head_sum(m, hmask) / kSeg;
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e] = rs[j] * (dx[e] - xh[e] * m);
      st4(dO + r * kSeg + l4, out);
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) red[wib][half][l4 + e] = dw[e];
  __syncthreads();
  if (threadIdx.x < kSeg) {
    float s = 0.f;
    for (int y = 0; y < kThreads / 32; ++y) s += red[y][0][threadIdx.x] + red[y][1][threadIdx.x];
    dwn_partial[(int64_t)blockIdx.x * kSeg + threadIdx.x] = s;
  }
}

// ---- the same at a head width W ≠ 64 (value heads of 64·m channels): one warp per row,
// channels lane, lane + 32, … (W ≤ kWideMax), the row's sums by shuffles. Both kernels use the
// same expressions, so the backward's ypre is the forward's bit for bit.
constexpr int kWideMax = 512;
__device__ __forceinline__ float ldf(const float* p) { return *p; }
__device__ __forceinline__ float ldf(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void stf(float* p, float x) { *p = x; }
__device__ __forceinline__ void stf(bf16* p, float x) { *p = __float2bfloat16(x); }
// Where row r's og starts at width W (see OgRows).
__device__ __forceinline__ int64_t og_at(const OgRows& gl, int64_t r, int W) {
  if (gl.ld == 0) return r * W;
  const int64_t n = r / gl.heads;
  return n * gl.ld + (r - n * gl.heads) * W;
}
template <class TA>
__global__ void out_fwd_wide_kernel(int64_t rows, int W, const bf16* o, const TA* og, OgRows gl, const float* wn,
                                    float eps, TA* ypre, float* rstd) {
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;  // uniform per warp
  float ss = 0.f;
  for (int c = lane; c < W; c += 32) {
    const float x = __bfloat162float(o[r * W + c]);
    ss += x * x;
  }
  const float rs = 1.f / sqrtf(warp_sum(ss) / W + eps);
  for (int c = lane; c < W; c += 32) {
    const float x = __bfloat162float(o[r * W + c]), g = ldf(og + og_at(gl, r, W) + c);
    stf(ypre + r * W + c, x * rs * wn[c] * g * sigm(g));
  }
  if (lane == 0) rstd[r] = rs;
}
// Grid of out_blocks(rows) blocks, warps strided over the rows; ∂L/∂wn per block into
// dwn_partial [blocks, W] (fixed rows per block: deterministic).
template <class TA>
__global__ void out_bwd_wide_kernel(int64_t rows, int W, const bf16* o, const TA* og, OgRows gl, const float* wn,
                                    const float* rstd, const TA* dypre, bf16* dO, TA* dog, TA* ypre,
                                    float* dwn_partial) {
  __shared__ float red[kThreads / 32][kWideMax];
  const int lane = threadIdx.x & 31, wib = threadIdx.x / 32;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  float dw[kWideMax / 32];
#pragma unroll
  for (int i = 0; i < kWideMax / 32; ++i) dw[i] = 0.f;
  for (int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + wib; r < rows; r += warps) {
    const float rs = rstd[r];
    const int64_t go = og_at(gl, r, W);
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < kWideMax / 32; ++i) {
      const int c = lane + 32 * i;
      if (c >= W) break;
      const float x = __bfloat162float(o[r * W + c]), g = ldf(og + go + c), d = ldf(dypre + r * W + c);
      const float xh = x * rs, don = d * g * sigm(g);
      dw[i] = fmaf(don, xh, dw[i]);
      stf(dog + go + c, d * xh * wn[c] * silu_grad(g));
      if (ypre) stf(ypre + r * W + c, x * rs * wn[c] * g * sigm(g));
      m = fmaf(don * wn[c], xh, m);
    }
    m = warp_sum(m) / W;
    for (int c = lane; c < W; c += 32) {
      const float x = __bfloat162float(o[r * W + c]), g = ldf(og + go + c), d = ldf(dypre + r * W + c);
      const float xh = x * rs, dx = d * g * sigm(g) * wn[c];
      dO[r * W + c] = __float2bfloat16(rs * (dx - xh * m));
    }
  }
#pragma unroll
  for (int i = 0; i < kWideMax / 32; ++i)
    if (lane + 32 * i < W) red[wib][lane + 32 * i] = dw[i];
  __syncthreads();
  for (int c = threadIdx.x; c < W; c += blockDim.x) {
    float s = 0.f;
    for (int y = 0; y < kThreads / 32; ++y) s += red[y][c];
    dwn_partial[(int64_t)blockIdx.x * W + c] = s;
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

// One warp per (token, head): qr[n] = a_n ⊙ e_n, the token's own (decode: the query that reads
// the state before the token's update).
__global__ void route_query_decode_kernel(RouteArgs a, bf16* qr) {
  const int lane = threadIdx.x & 31;
  const int64_t wid = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (wid >= a.B * a.T * a.H) return;
  const int64_t n = wid / a.H;
  const int h = static_cast<int>(wid % a.H);
  const float2 e = readout_vec(a, n, h, lane);
  st_bf2(qr + n * a.H * kSeg + h * kSeg + 2 * lane, e.x, e.y);
}

__global__ void route_residual_kernel(RouteArgs a, const bf16* o2, float* r, float* r_raw) {
  const int64_t C = (int64_t)a.H * a.dv;
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
  if (a.beta) {  // publish u = β·r
    if (r_raw) *reinterpret_cast<float2*>(r_raw + i) = z;
    const float b = a.beta[n * a.H + (i % C) / a.dv];
    z.x *= b, z.y *= b;
  }
  *reinterpret_cast<float2*>(r + i) = z;
}

__global__ void route_readout_grad_kernel(RouteArgs a, const float* dr, bf16* do2) {
  const int64_t C = (int64_t)a.H * a.dv;
  const int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 2;
  if (i >= a.B * a.T * C) return;
  const int64_t n = i / C;
  const int t = static_cast<int>(n % a.T);
  if (t == a.T - 1) {
    st_bf2(do2 + i, 0.f, 0.f);
    return;
  }
  float2 d = *reinterpret_cast<const float2*>(dr + i + C);
  if (a.beta) {  // dr is on u_{t+1} = β_{t+1}·r_{t+1}
    const float b = a.beta[(n + 1) * a.H + (i % C) / a.dv];
    d.x *= b, d.y *= b;
  }
  st_bf2(do2 + i, -d.x / a.scale, -d.y / a.scale);
}

// One warp per (token n, head h): fold the second readout's gradients back. The key side
// (qr, dqr, dk2, ek, a channel g, gdn2's b) is one segment of 64 at i; the value side (dr, dv2,
// ev, gdn2's w) dv/64 segments at iv.
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
  const float2 de = make_float2(dqr.x * aval.x, dqr.y * aval.y);  // on e_t
  float2 ek = ld_bf2(g.dk2 + i);
  if (a.b) {  // gdn2: e = b ⊙ k
    const float2 b = ld_bf2(a.b + i), k = ld_bf2(a.k + i);
    ek.x += de.x * b.x, ek.y += de.y * b.y;
    const float2 db2 = ld_bf2(g.db2 + i);
    *reinterpret_cast<float2*>(g.eb + i) = make_float2(db2.x + de.x * k.x, db2.y + de.y * k.y);
  } else {
    ek.x += de.x, ek.y += de.y;
  }
  *reinterpret_cast<float2*>(g.ek + i) = ek;
  // the value side: r = z − …, z = v (w ⊙ v for gdn2); with a.beta the published u = β·r
  const float beta = a.beta ? a.beta[n * a.H + h] : 1.f;
  float bsum = 0.f;  // Σ_c du_c·r_c: ∂L/∂β through u = β·r
  for (int s = 0; s < a.dv / kSeg; ++s) {
    const int64_t iv = n * (int64_t)a.H * a.dv + (int64_t)h * a.dv + s * kSeg + 2 * lane;
    const float2 du = *reinterpret_cast<const float2*>(g.dr + iv);
    const float2 dr = make_float2(du.x * beta, du.y * beta);
    float2 ev = ld_bf2(g.dv2 + iv);
    if (a.w) {  // gdn2: z = w ⊙ v
      const float2 w = ld_bf2(a.w + iv), v = ld_bf2(a.v + iv);
      const float2 dw2 = ld_bf2(g.dw2 + iv);
      *reinterpret_cast<float2*>(g.ew + iv) = make_float2(dw2.x + dr.x * v.x, dw2.y + dr.y * v.y);
      ev.x += dr.x * w.x, ev.y += dr.y * w.y;
    } else {
      ev.x += dr.x, ev.y += dr.y;
    }
    *reinterpret_cast<float2*>(g.ev + iv) = ev;
    if (a.beta) {
      const float2 r = *reinterpret_cast<const float2*>(g.r + iv);
      bsum += du.x * r.x + du.y * r.y;
    }
  }
  if (a.beta) bsum = warp_sum(bsum);
  if (g.dbeta && lane == 0) g.dbeta[n * a.H + h] += g.dbeta2[n * a.H + h] + bsum;
}

// ---------------------------------------------------------------- profiling
EventProfile& layer_profile() {
  static EventProfile p;
  return p;
}

}  // namespace

namespace {

void qkv_check(const QkvArgs& a) {
  require(a.Cq % kSeg == 0 && a.Cv % kSeg == 0, "qkv: widths must be multiples of 64");
  require(a.ldp >= qkv_channels(a) && a.ldp % 4 == 0,
          "qkv: row stride " + std::to_string(a.ldp) + " below 2Cq+Cv or not a multiple of 4");
  require(a.W >= 0 && a.W <= kMaxConv, "qkv: conv width " + std::to_string(a.W) + " outside 0..8");
}

// Blocks of 128 channels × 8 runs of R tokens.
template <int R>
int64_t qkv_tiles(const QkvArgs& a) {
  return a.B * ((a.T + 8 * R - 1) / (8 * R));
}
template <int R>
dim3 qkv_grid(const QkvArgs& a) {
  const int64_t tiles = qkv_tiles<R>(a);
  require(tiles <= 65535, "qkv: B·⌈T/" + std::to_string(8 * R) + "⌉ = " + std::to_string(tiles) +
                              " tiles, more than a grid column holds");
  return dim3(blocks_for(qkv_channels(a), kTileCh), static_cast<unsigned>(tiles));
}

// Launch with dynamic shared memory, opting in above the default 48 KB (per call: the
// attribute is per device, and the call is cheap next to the kernel).
template <class Kernel, class... Args>
void launch_smem(Kernel kernel, dim3 grid, std::size_t smem, cudaStream_t stream, Args... args) {
  if (smem > 48 * 1024)
    LAR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<grid, kThreads, smem, stream>>>(args...);
  LAR_CUDA_LAUNCHED();
}

template <int G, int S, int R>
void qkv_forward_with(const QkvArgs& a, bf16* q, bf16* k, bf16* v, float* vout, cudaStream_t stream) {
  const dim3 grid = qkv_grid<R>(a);
  // the conv taps padded to 4 (W ≤ 4) or 8; 1: no conv
  auto launch = [&](auto kind) {
    using TP = decltype(kind);
    const std::size_t smem = sizeof(Raw4<TP>) * S * G * kThreads;
    if (a.W == 0) launch_smem(qkv_fwd_kernel<1, TP, G, S, R>, grid, smem, stream, a, q, k, v, vout);
    else if (a.W <= 4) launch_smem(qkv_fwd_kernel<4, TP, G, S, R>, grid, smem, stream, a, q, k, v, vout);
    else launch_smem(qkv_fwd_kernel<kMaxConv, TP, G, S, R>, grid, smem, stream, a, q, k, v, vout);
  };
  if (a.p_bf16) launch(bf16{});
  else launch(float{});
}

template <int G, int S, int R>
void qkv_forward8_with(const QkvArgs& a, bf16* q, bf16* k, bf16* v, float* vout, cudaStream_t stream) {
  const int64_t tiles = qkv_tiles<R>(a);
  require(tiles <= 65535, "qkv: B·⌈T/" + std::to_string(8 * R) + "⌉ = " + std::to_string(tiles) +
                              " tiles, more than a grid column holds");
  const dim3 grid(blocks_for(qkv_channels(a), kTileCh8), static_cast<unsigned>(tiles));
  const std::size_t smem = sizeof(uint4) * S * G * kThreads;
  if (a.W == 0) launch_smem(qkv_fwd8_kernel<1, G, S, R>, grid, smem, stream, a, q, k, v, vout);
  else launch_smem(qkv_fwd8_kernel<4, G, S, R>, grid, smem, stream, a, q, k, v, vout);
}

template <int G, int S, int B, int R>
void qkv_backward_with(const QkvArgs& a, const QkvGrads& g, void* dP, float* gwq, float* gwk, float* gwv,
                       float* scratch, cudaStream_t stream) {
  const dim3 grid = qkv_grid<R>(a);
  auto launch = [&](auto* d) {
    using TP = std::remove_pointer_t<decltype(d)>;
    // the P and dy rings; the weight sums reuse them (8 warps × K taps × 32 lanes × float4)
    const std::size_t ring = (sizeof(Raw4<TP>) + sizeof(uint2)) * S * G * kThreads;
    auto smem = [&](int K) { return std::max<std::size_t>(ring, sizeof(float4) * 8 * K * 32); };
    if (a.W == 0) launch_smem(qkv_bwd_kernel<1, TP, G, S, B, R>, grid, smem(1), stream, a, g, d, scratch);
    else if (a.W <= 4) launch_smem(qkv_bwd_kernel<4, TP, G, S, B, R>, grid, smem(4), stream, a, g, d, scratch);
    else launch_smem(qkv_bwd_kernel<kMaxConv, TP, G, S, B, R>, grid, smem(kMaxConv), stream, a, g, d, scratch);
  };
  if (a.p_bf16) launch(static_cast<bf16*>(dP));
  else launch(static_cast<float*>(dP));
  if (a.W == 0) return;
  conv_weight_finish<<<static_cast<unsigned>(qkv_channels(a) * a.W), kThreads, 0, stream>>>(a, scratch, qkv_tiles<R>(a), gwq,
                                                                                    gwk, gwv);
  LAR_CUDA_LAUNCHED();
}

}  // namespace

void qkv_forward(const QkvArgs& a, bf16* q, bf16* k, bf16* v, float* vout, cudaStream_t stream) {
  qkv_check(a);
  require(!a.rin || a.gamma, "qkv: cler needs gamma");
  if (a.B * a.T == 0) return;
  // bf16 P in 16-byte rows and convs up to 4 wide: 8 channels a lane, the faster where both
  // apply (with the 8-tap weights of W = 5..8 that kernel would spill: the 4-channel one takes
  // them, and every other case)
  if (a.p_bf16 && a.W <= 4 && a.ldp % 8 == 0 && reinterpret_cast<uintptr_t>(a.P) % 16 == 0)
    qkv_forward8_with<kFwdG, kFwdS, kFwdRun>(a, q, k, v, vout, stream);
  else
    qkv_forward_with<kFwdG, kFwdS, kFwdRun>(a, q, k, v, vout, stream);
}

std::size_t qkv_backward_scratch_floats(const QkvArgs& a) {
  return static_cast<std::size_t>(qkv_tiles<kBwdRun>(a) * qkv_channels(a) * std::max(a.W, 1));
}

void qkv_backward(const QkvArgs& a, const QkvGrads& g, void* dP, float* gwq, float* gwk, float* gwv, float* scratch,
                  cudaStream_t stream) {
  qkv_check(a);
  require(!a.rin || (a.gamma && g.dgam_terms), "qkv backward: cler needs gamma and dgam_terms");
  require(a.W == 0 || (gwq && gwk && gwv && scratch), "qkv backward: conv needs weight gradients and scratch");
  if (a.B * a.T == 0) return;
  qkv_backward_with<kBwdG, kBwdS, kBwdB, kBwdRun>(a, g, dP, gwq, gwk, gwv, scratch, stream);
}

void gate_forward(const GateArgs& a, float* out, bf16* outb, cudaStream_t stream) {
  require((out != nullptr) != (outb != nullptr), "gate forward: exactly one output");
  require(a.map == GateMap::sigmoid || a.bias, "gate forward: missing bias");
  require(a.map != GateMap::decay || (a.A_log && a.per_head > 0), "gate forward: missing A_log");
  if (a.N * a.C == 0) return;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (a.C % 4 == 0 && a.ldf % 4 == 0 && a.N * a.C < (int64_t(1) << 31) && aligned(a.f) &&
      aligned(out ? static_cast<const void*>(out) : static_cast<const void*>(outb)))
    gate_fwd4_kernel<<<blocks_for(a.N * a.C / 4, kThreads), kThreads, 0, stream>>>(a, out, outb);
  else
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

void gdn_gates_check(const GdnGateArgs& a) {
  require(a.H >= 1 && 2 * a.H <= kThreads && a.P && a.A_log && a.dt_bias, "gdn gates: H outside 1..128 or a missing input");
  const int64_t width = a.width ? a.width : a.ldp;
  require(a.off >= 0 && width >= a.off + 2 * a.H && width <= a.ldp,
          "gdn gates: columns [off, off + 2H) or the padding outside the row stride");
}

void gdn_gates_forward(const GdnGateArgs& a, float* beta, float* g, cudaStream_t stream) {
  gdn_gates_check(a);
  require(beta && g, "gdn gates forward: missing output");
  if (a.N == 0) return;
  const unsigned blocks = blocks_for(a.N * a.H, kThreads);
  if (a.p_bf16) gdn_gates_fwd_kernel<bf16><<<blocks, kThreads, 0, stream>>>(a, beta, g);
  else gdn_gates_fwd_kernel<float><<<blocks, kThreads, 0, stream>>>(a, beta, g);
  LAR_CUDA_LAUNCHED();
}

namespace {
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
// Offsets and access widths of the pieces; packed: the packed buffer, es its element size.
PieceLaunch piece_launch(const Pieces& p, const void* packed, std::size_t es, bool pack, int64_t& longest) {
  require(p.count >= 1 && p.count <= kMaxPieces, "pieces: 1 to " + std::to_string(kMaxPieces) + " pieces");
  PieceLaunch l;
  l.p = p;
  int64_t off = 0;
  longest = 0;
  for (int k = 0; k < p.count; ++k) {
    require(p.n[k] >= 0, "pieces: a negative count");
    l.off[k] = off;
    const auto* at = static_cast<const char*>(packed) + off * es;
    const void* other = pack ? static_cast<const void*>(p.src[k]) : static_cast<const void*>(p.dst[k]);
    l.vec[k] = p.n[k] % 4 == 0 && (other == nullptr || aligned16(other)) &&
               reinterpret_cast<uintptr_t>(at) % (4 * es) == 0;
    off += p.n[k];
    longest = std::max(longest, p.n[k]);
  }
  return l;
}
dim3 piece_grid(int64_t longest, int count) {
  return dim3(static_cast<unsigned>(std::clamp<int64_t>((longest / 4 + kThreads - 1) / kThreads, 1, 1024)),
              static_cast<unsigned>(count));
}
}  // namespace

void pack_pieces(const Pieces& p, void* packed, bool packed_bf16, cudaStream_t stream) {
  int64_t longest = 0;
  const PieceLaunch l = piece_launch(p, packed, packed_bf16 ? 2 : 4, true, longest);
  if (longest == 0) return;
  if (packed_bf16) pack_pieces_kernel<<<piece_grid(longest, p.count), kThreads, 0, stream>>>(l, static_cast<bf16*>(packed));
  else pack_pieces_kernel<<<piece_grid(longest, p.count), kThreads, 0, stream>>>(l, static_cast<float*>(packed));
  LAR_CUDA_LAUNCHED();
}

void scatter_add_pieces(const Pieces& p, const float* packed, cudaStream_t stream) {
  int64_t longest = 0;
  const PieceLaunch l = piece_launch(p, packed, 4, false, longest);
  if (longest == 0) return;
  scatter_add_pieces_kernel<<<piece_grid(longest, p.count), kThreads, 0, stream>>>(l, packed);
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

std::size_t gdn_gates_backward_scratch_floats(int64_t N, int H) { return 2 * colsum_scratch_floats(N, H); }

void gdn_gates_backward(const GdnGateArgs& a, const float* dbeta, const float* dg, void* dP, float* ddt, float* dA_log,
                        float* scratch, cudaStream_t stream) {
  gdn_gates_check(a);
  require(dbeta && dg && dP && ddt && dA_log && scratch, "gdn gates backward: missing input or output");
  if (a.N == 0) return;
  const int splits = colsum_splits(a.N);
  float *pdt = scratch, *pa = scratch + (std::size_t)splits * a.H;
  if (a.p_bf16)
    gdn_gates_bwd_kernel<bf16><<<splits, kThreads, 0, stream>>>(a, dbeta, dg, static_cast<bf16*>(dP), pdt, pa);
  else
    gdn_gates_bwd_kernel<float><<<splits, kThreads, 0, stream>>>(a, dbeta, dg, static_cast<float*>(dP), pdt, pa);
  LAR_CUDA_LAUNCHED();
  colsum_finish<<<a.H, kThreads, 0, stream>>>(pdt, splits, a.H, 1, ddt);
  LAR_CUDA_LAUNCHED();
  colsum_finish<<<a.H, kThreads, 0, stream>>>(pa, splits, a.H, 1, dA_log);
  LAR_CUDA_LAUNCHED();
}

std::size_t gate_backward_fused_scratch_floats(const GateArgs& a) {
  return 2 * colsum_scratch_floats(a.N, a.C);
}

void gate_backward_fused(const GateArgs& a, const float* dy, void* df, bool df_bf16, float* dbias, float* dA_log,
                         float* scratch, cudaStream_t stream) {
  require(a.map == GateMap::decay || a.map == GateMap::logsig16, "fused gate backward: decay or logsig16 only");
  require(a.bias && dbias && scratch && dy && df, "fused gate backward: missing bias, dy, df, dbias or scratch");
  require(a.map != GateMap::decay || (a.A_log && dA_log && a.per_head > 0 && a.C % a.per_head == 0),
          "fused gate backward: decay needs A_log, dA_log and whole heads");
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  require(a.C % 4 == 0 && a.ldf % 4 == 0 && aligned(a.f) && aligned(dy) && aligned(df),
          "fused gate backward: C and ldf must be multiples of 4, f, dy and df 16-byte aligned");
  if (a.N * a.C == 0) return;
  const int splits = colsum_splits(a.N);
  float* pbias = scratch;
  float* pa = a.map == GateMap::decay ? scratch + (int64_t)splits * a.C : nullptr;
  const dim3 grid(blocks_for(a.C / 4, 64), static_cast<unsigned>(splits));
  if (df_bf16)
    gate_bwd_fused_kernel<<<grid, kThreads, 0, stream>>>(a, dy, static_cast<bf16*>(df), a.C, pbias, pa);
  else
    gate_bwd_fused_kernel<<<grid, kThreads, 0, stream>>>(a, dy, static_cast<float*>(df), a.C, pbias, pa);
  LAR_CUDA_LAUNCHED();
  colsum_finish<<<a.C, kThreads, 0, stream>>>(pbias, splits, a.C, 1, dbias);
  LAR_CUDA_LAUNCHED();
  if (pa) {
    colsum_finish<<<a.C / a.per_head, kThreads, 0, stream>>>(pa, splits, a.C, a.per_head, dA_log);
    LAR_CUDA_LAUNCHED();
  }
}

namespace {
OgRows og_rows(int64_t rows, int og_heads, int64_t og_ld, int width = kSeg) {
  OgRows g;
  if (og_ld == 0) return g;
  require(og_heads >= 1 && rows % og_heads == 0 && og_ld >= og_heads * width && og_ld % 4 == 0 &&
              rows < (int64_t(1) << 32),
          "out norm × gate: og rows of " + std::to_string(og_heads) + " heads in a stride of " + std::to_string(og_ld));
  g.heads = static_cast<uint32_t>(og_heads);
  g.ld = og_ld;
  return g;
}
}  // namespace

void out_gate_forward(int64_t rows, const bf16* o, const void* og, const float* wn, float eps, void* ypre,
                      float* rstd, bool act_bf16, cudaStream_t stream, int og_heads, int64_t og_ld, int width) {
  require(width >= 1 && width <= kWideMax, "out norm × gate: head width " + std::to_string(width) + " outside 1..512");
  if (rows == 0) return;
  const OgRows gl = og_rows(rows, og_heads, og_ld, width);
  if (width != kSeg) {
    const unsigned blocks = blocks_for(rows, kThreads / 32);
    if (act_bf16)
      out_fwd_wide_kernel<<<blocks, kThreads, 0, stream>>>(rows, width, o, static_cast<const bf16*>(og), gl, wn, eps,
                                                           static_cast<bf16*>(ypre), rstd);
    else
      out_fwd_wide_kernel<<<blocks, kThreads, 0, stream>>>(rows, width, o, static_cast<const float*>(og), gl, wn, eps,
                                                           static_cast<float*>(ypre), rstd);
    LAR_CUDA_LAUNCHED();
    return;
  }
  const unsigned blocks = blocks_for(rows, kThreads / 32 * kRowsW);
  if (act_bf16)
    out_fwd_kernel<<<blocks, kThreads, 0, stream>>>(rows, o, static_cast<const bf16*>(og), gl, wn, eps,
                                                    static_cast<bf16*>(ypre), rstd);
  else
    out_fwd_kernel<<<blocks, kThreads, 0, stream>>>(rows, o, static_cast<const float*>(og), gl, wn, eps,
                                                    static_cast<float*>(ypre), rstd);
  LAR_CUDA_LAUNCHED();
}

std::size_t out_gate_backward_scratch_floats(int64_t rows, int width) {
  return static_cast<std::size_t>(out_blocks(rows)) * width;
}

void out_gate_backward(int64_t rows, const bf16* o, const void* og, const float* wn, const float* rstd,
                       const void* dypre, bf16* dO, void* dog, void* ypre, float* dwn, float* scratch, bool act_bf16,
                       cudaStream_t stream, int og_heads, int64_t og_ld, int width) {
  require(width >= 1 && width <= kWideMax, "out norm × gate: head width " + std::to_string(width) + " outside 1..512");
  if (rows == 0) return;
  const OgRows gl = og_rows(rows, og_heads, og_ld, width);
  const int blocks = out_blocks(rows);
  if (width != kSeg) {
    if (act_bf16)
      out_bwd_wide_kernel<<<blocks, kThreads, 0, stream>>>(rows, width, o, static_cast<const bf16*>(og), gl, wn, rstd,
                                                           static_cast<const bf16*>(dypre), dO, static_cast<bf16*>(dog),
                                                           static_cast<bf16*>(ypre), scratch);
    else
      out_bwd_wide_kernel<<<blocks, kThreads, 0, stream>>>(rows, width, o, static_cast<const float*>(og), gl, wn, rstd,
                                                           static_cast<const float*>(dypre), dO, static_cast<float*>(dog),
                                                           static_cast<float*>(ypre), scratch);
    LAR_CUDA_LAUNCHED();
    colsum_finish<<<width, kThreads, 0, stream>>>(scratch, blocks, width, 1, dwn);
    LAR_CUDA_LAUNCHED();
    return;
  }
  if (act_bf16)
    out_bwd_kernel<<<blocks, kThreads, 0, stream>>>(rows, o, static_cast<const bf16*>(og), gl, wn, rstd,
                                                    static_cast<const bf16*>(dypre), dO, static_cast<bf16*>(dog),
                                                    static_cast<bf16*>(ypre), scratch);
  else
    out_bwd_kernel<<<blocks, kThreads, 0, stream>>>(rows, o, static_cast<const float*>(og), gl, wn, rstd,
                                                    static_cast<const float*>(dypre), dO, static_cast<float*>(dog),
                                                    static_cast<float*>(ypre), scratch);
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

void route_query_decode(const RouteArgs& a, bf16* qr, cudaStream_t stream) {
  const int64_t warps = a.B * a.T * a.H;
  if (warps == 0) return;
  route_query_decode_kernel<<<blocks_for(warps, kThreads / 32), kThreads, 0, stream>>>(a, qr);
  LAR_CUDA_LAUNCHED();
}

void route_residual(const RouteArgs& a, const bf16* o2, float* r, cudaStream_t stream, float* r_raw) {
  require(a.dv % kSeg == 0 && a.dv > 0, "route residual: value heads must be multiples of 64");
  const int64_t pairs = a.B * a.T * a.H * a.dv / 2;
  if (pairs == 0) return;
  route_residual_kernel<<<blocks_for(pairs, kThreads), kThreads, 0, stream>>>(a, o2, r, r_raw);
  LAR_CUDA_LAUNCHED();
}

void route_readout_grad(const RouteArgs& a, const float* dr, bf16* do2, cudaStream_t stream) {
  require(a.dv % kSeg == 0 && a.dv > 0, "route readout grad: value heads must be multiples of 64");
  const int64_t pairs = a.B * a.T * a.H * a.dv / 2;
  if (pairs == 0) return;
  route_readout_grad_kernel<<<blocks_for(pairs, kThreads), kThreads, 0, stream>>>(a, dr, do2);
  LAR_CUDA_LAUNCHED();
}

void route_backward(const RouteArgs& a, const RouteGrads& g, cudaStream_t stream) {
  require(!a.g || (g.dg && g.dg2), "route backward: gated mixer needs dg and dg2");
  require(!g.dbeta || g.dbeta2, "route backward: dbeta needs dbeta2");
  require(!a.b || (g.eb && g.ew && g.db2 && g.dw2), "route backward: gdn2 needs eb, ew, db2, dw2");
  require(!a.beta || (g.r && g.dbeta), "route backward: the β-scaled signal needs r and dbeta");
  require(a.dv % kSeg == 0 && a.dv > 0, "route backward: value heads must be multiples of 64");
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
