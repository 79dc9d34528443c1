// The recurrent wide-key kernels of wide_key.hpp: forward (also the decode), backward from the
// 64-token checkpoints, the fixed-order sums of the per-value-tile key-side gradients, and the
// L2 norm of wide heads.
#include "kernels/cuda/linear/wide_key.hpp"

#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "core/error.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/linear/scratch.hpp"

namespace lar::kernels::cuda::linear {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kRW = 4;                // state rows per warp
constexpr int kNW = 16;               // warps per CTA
constexpr int kRT = kRW * kNW;        // value rows per CTA (one value tile)
constexpr int kThreads = 32 * kNW;
constexpr int kSeg = 256;             // tokens between the forward's checkpoints
constexpr int kSub = 8;               // tokens between the backward's sub-checkpoints
constexpr int kSlots = kSeg / kSub;   // sub-checkpoints of a segment
constexpr int kKinds = 4;             // key-side gradient rows: dq, dk, dg (channel), db (gdn2)

enum Gate : int { kNoGate = 0, kScalarGate = 1, kChannelGate = 2 };
enum Erase : int { kNoErase = 0, kBetaErase = 1, kGdn2Erase = 2 };

struct WArgs {
  int64_t B = 0, T = 0;
  int H = 1, Hk = 1, G = 1, dv = 64, m = 1;
  float scale = 1.f;
  int gate = kNoGate, erase = kNoErase;
  const bf16 *q = nullptr, *k = nullptr, *v = nullptr, *b = nullptr, *w = nullptr;
  const float *g = nullptr, *beta = nullptr, *S0 = nullptr;
  bf16* o = nullptr;
  float* S_out = nullptr;
  float* ckpt = nullptr;  // [B,H,nseg,dv,dk]
  int64_t nseg = 0;
  // backward
  const bf16* dout = nullptr;
  const float* dST = nullptr;
  float* dS0 = nullptr;
  bf16 *dvv = nullptr, *dw = nullptr;
  float* part = nullptr;   // [kKinds][m][B·T·H][dk]
  float* spart = nullptr;  // [2][m][B·T·H]: β, gdn's g
  float* scratch = nullptr;  // per CTA [kSlots + kSub][kRT][dk]
  // the backward runs in waves of whole sequences [b0, b0 + nbw) (bounded scratch and partials;
  // part and spart hold the wave's rows only)
  int64_t b0 = 0, nbw = 0;
};

__device__ __forceinline__ float bf(bf16 x) { return __bfloat162float(x); }

template <int N>
__device__ __forceinline__ void warp_sum(float (&x)[N]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int r = 0; r < N; ++r) x[r] += __shfl_xor_sync(0xffffffffu, x[r], o);
}
__device__ __forceinline__ float warp_sum1(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float pick4(const float (&x)[kRW], int i) {
  return i == 0 ? x[0] : i == 1 ? x[1] : i == 2 ? x[2] : x[3];
}

// One CTA's place.
struct Place {
  int b, h, hk, tile, warp, lane, row0;  // row0: this warp's first value row in the head
  int64_t bh;
};
__device__ __forceinline__ Place place(const WArgs& a) {
  Place p;
  p.tile = blockIdx.x % a.m;
  p.bh = a.b0 * a.H + blockIdx.x / a.m;
  p.h = static_cast<int>(p.bh % a.H);
  p.b = static_cast<int>(p.bh / a.H);
  p.hk = p.h / a.G;
  p.warp = threadIdx.x >> 5;
  p.lane = threadIdx.x & 31;
  p.row0 = p.tile * kRT + p.warp * kRW;
  return p;
}

// Token t's key-side values at this lane's columns c = lane + 32j, and its rows' z factors.
template <int DK>
struct Tok {
  static constexpr int NJ = DK / 32;
  float k[NJ], q[NJ], e[NJ], a[NJ], bb[NJ];
  float beta;
  float zf[kRW], v[kRW];  // z = zf ⊙ v
};
template <int DK>
__device__ __forceinline__ void load_tok(const WArgs& A, const Place& p, int64_t t, Tok<DK>& x) {
  constexpr int NJ = DK / 32;
  const int64_t n = static_cast<int64_t>(p.b) * A.T + t;
  const int64_t kb = (n * A.Hk + p.hk) * DK, hb = n * A.H + p.h, gb = hb * DK, vb = hb * A.dv + p.row0;
  x.beta = A.erase == kBetaErase ? A.beta[hb] : 1.f;
  const float sa = A.gate == kScalarGate ? __expf(A.g[hb]) : 1.f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int c = p.lane + 32 * j;
    x.k[j] = bf(A.k[kb + c]);
    x.q[j] = bf(A.q[kb + c]);
    x.a[j] = A.gate == kChannelGate ? __expf(A.g[gb + c]) : sa;
    x.bb[j] = A.erase == kGdn2Erase ? bf(A.b[gb + c]) : 0.f;
    x.e[j] = A.erase == kBetaErase ? x.beta * x.k[j] : A.erase == kGdn2Erase ? x.bb[j] * x.k[j] : 0.f;
  }
#pragma unroll
  for (int r = 0; r < kRW; ++r) {
    x.v[r] = bf(A.v[vb + r]);
    x.zf[r] = A.erase == kBetaErase ? x.beta : A.erase == kGdn2Erase ? bf(A.w[vb + r]) : 1.f;
  }
}

// S ← S D(a); u = z − S e; S ← S + u kᵀ. Sp (nullable) gets S D(a), u the residual.
template <int DK>
__device__ __forceinline__ void fwd_step(const WArgs& A, const Tok<DK>& x, float (&S)[kRW][DK / 32], float* Sp,
                                         int lane, float (&u)[kRW]) {
  constexpr int NJ = DK / 32;
  float p[kRW];
#pragma unroll
  for (int r = 0; r < kRW; ++r) {
    p[r] = 0.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      S[r][j] *= x.a[j];
      p[r] = fmaf(S[r][j], x.e[j], p[r]);
    }
  }
  if (Sp) {
#pragma unroll
    for (int r = 0; r < kRW; ++r)
#pragma unroll
      for (int j = 0; j < NJ; ++j) Sp[r * DK + lane + 32 * j] = S[r][j];
  }
  if (A.erase != kNoErase) warp_sum(p);
#pragma unroll
  for (int r = 0; r < kRW; ++r) {
    u[r] = x.zf[r] * x.v[r] - (A.erase != kNoErase ? p[r] : 0.f);
#pragma unroll
    for (int j = 0; j < NJ; ++j) S[r][j] = fmaf(u[r], x.k[j], S[r][j]);
  }
}

template <int DK>
__device__ __forceinline__ void load_state(const float* src, int lane, float (&S)[kRW][DK / 32]) {
#pragma unroll
  for (int r = 0; r < kRW; ++r)
#pragma unroll
    for (int j = 0; j < DK / 32; ++j) S[r][j] = src ? src[r * DK + lane + 32 * j] : 0.f;
}
template <int DK>
__device__ __forceinline__ void store_state(float* dst, int lane, const float (&S)[kRW][DK / 32]) {
#pragma unroll
  for (int r = 0; r < kRW; ++r)
#pragma unroll
    for (int j = 0; j < DK / 32; ++j) dst[r * DK + lane + 32 * j] = S[r][j];
}

// Where this warp's rows of a [B,H,dv,dk] state, and of checkpoint `seg`, start.
__device__ __forceinline__ int64_t state_off(const WArgs& A, const Place& p, int dk) {
  return (p.bh * A.dv + p.row0) * dk;
}
__device__ __forceinline__ int64_t ckpt_off(const WArgs& A, const Place& p, int64_t seg, int dk) {
  return ((p.bh * A.nseg + seg) * A.dv + p.row0) * dk;
}

template <int DK>
__global__ void __launch_bounds__(kThreads) wide_fwd_kernel(WArgs A) {
  constexpr int NJ = DK / 32;
  const Place p = place(A);
  float S[kRW][NJ];
  load_state<DK>(A.S0 ? A.S0 + state_off(A, p, DK) : nullptr, p.lane, S);
  for (int64_t t = 0; t < A.T; ++t) {
    if (A.ckpt && t % kSeg == 0) store_state<DK>(A.ckpt + ckpt_off(A, p, t / kSeg, DK), p.lane, S);
    Tok<DK> x;
    load_tok<DK>(A, p, t, x);
    float u[kRW];
    fwd_step<DK>(A, x, S, nullptr, p.lane, u);
    float o[kRW];
#pragma unroll
    for (int r = 0; r < kRW; ++r) {
      o[r] = 0.f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) o[r] = fmaf(S[r][j], x.q[j], o[r]);
    }
    warp_sum(o);
    if (p.lane < kRW) {
      const int64_t n = static_cast<int64_t>(p.b) * A.T + t;
      A.o[(n * A.H + p.h) * A.dv + p.row0 + p.lane] = __float2bfloat16(A.scale * pick4(o, p.lane));
    }
  }
  if (A.S_out) store_state<DK>(A.S_out + state_off(A, p, DK), p.lane, S);
}

// Shared memory of the backward: the per-warp key-side rows, the sub-segment's residuals u,
// the per-warp scalar sums.
template <int DK>
constexpr std::size_t bwd_smem_bytes() {
  return sizeof(float) * (static_cast<std::size_t>(kNW) * kKinds * DK + kSub * kRT + kNW * 2);
}

template <int DK>
__global__ void __launch_bounds__(kThreads) wide_bwd_kernel(WArgs A) {
  constexpr int NJ = DK / 32;
  extern __shared__ float smem[];
  float* red = smem;                            // [kNW][kKinds][DK]
  float* us = red + kNW * kKinds * DK;          // [kSub][kRT]
  float* reds = us + kSub * kRT;                // [kNW][2]
  const Place p = place(A);
  const int64_t NH = A.nbw * A.T * A.H, nh0 = A.b0 * A.T * A.H;  // the wave's rows of part, spart
  // this CTA's scratch: kSlots sub-checkpoints, then kSub decayed states, each [kRT][DK]
  float* sc = A.scratch + static_cast<int64_t>(blockIdx.x) * (kSlots + kSub) * kRT * DK + p.warp * kRW * DK;
  auto sub = [&](int i) { return sc + static_cast<int64_t>(i) * kRT * DK; };
  auto spb = [&](int i) { return sc + static_cast<int64_t>(kSlots + i) * kRT * DK; };
  const int nk = 2 + (A.gate == kChannelGate) + (A.erase == kGdn2Erase);  // key-side rows in use
  float dS[kRW][NJ];
  load_state<DK>(A.dST ? A.dST + state_off(A, p, DK) : nullptr, p.lane, dS);
  for (int64_t seg = A.nseg - 1; seg >= 0; --seg) {
    const int64_t t0 = seg * kSeg, t1 = std::min<int64_t>(A.T, t0 + kSeg);
    const int nsub = static_cast<int>((t1 - t0 + kSub - 1) / kSub);
    float S[kRW][NJ];
    load_state<DK>(A.ckpt + ckpt_off(A, p, seg, DK), p.lane, S);
    // sub-checkpoints every kSub tokens
    for (int ss = 0; ss < nsub; ++ss) {
      store_state<DK>(sub(ss), p.lane, S);
      if (ss + 1 == nsub) break;
      for (int64_t t = t0 + ss * kSub; t < t0 + (ss + 1) * kSub; ++t) {
        Tok<DK> x;
        load_tok<DK>(A, p, t, x);
        float u[kRW];
        fwd_step<DK>(A, x, S, nullptr, p.lane, u);
      }
    }
    for (int ss = nsub - 1; ss >= 0; --ss) {
      const int64_t s0 = t0 + ss * kSub, s1 = std::min<int64_t>(t1, s0 + kSub);
      load_state<DK>(sub(ss), p.lane, S);
      __syncwarp();
      for (int64_t t = s0; t < s1; ++t) {
        Tok<DK> x;
        load_tok<DK>(A, p, t, x);
        float u[kRW];
        fwd_step<DK>(A, x, S, spb(static_cast<int>(t - s0)), p.lane, u);
        if (p.lane == 0)
#pragma unroll
          for (int r = 0; r < kRW; ++r) us[(t - s0) * kRT + p.warp * kRW + r] = u[r];
      }
      __syncwarp();
      for (int64_t t = s1 - 1; t >= s0; --t) {
        const int tt = static_cast<int>(t - s0);
        Tok<DK> x;
        load_tok<DK>(A, p, t, x);
        const int64_t n = static_cast<int64_t>(p.b) * A.T + t, nh = n * A.H + p.h, vb = nh * A.dv + p.row0;
        float dO[kRW], u[kRW], du[kRW];
#pragma unroll
        for (int r = 0; r < kRW; ++r) {
          dO[r] = bf(A.dout[vb + r]);
          u[r] = us[tt * kRT + p.warp * kRW + r];
          du[r] = 0.f;
#pragma unroll
          for (int j = 0; j < NJ; ++j) {
            dS[r][j] = fmaf(A.scale * dO[r], x.q[j], dS[r][j]);  // o_t = scale S_t q_t
            du[r] = fmaf(dS[r][j], x.k[j], du[r]);
          }
        }
        warp_sum(du);
        const float* Sp = spb(tt);
        float sb = 0.f, sg = 0.f;
        float* myred = red + p.warp * kKinds * DK;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int c = p.lane + 32 * j;
          float dq = 0.f, dkk = 0.f, de = 0.f, dg = 0.f;
#pragma unroll
          for (int r = 0; r < kRW; ++r) {
            const float sp = Sp[r * DK + c];
            dq = fmaf(sp + u[r] * x.k[j], dO[r], dq);  // S_t = S' + u kᵀ
            dkk = fmaf(dS[r][j], u[r], dkk);
            if (A.erase != kNoErase) {
              de = fmaf(-sp, du[r], de);
              dS[r][j] = fmaf(-du[r], x.e[j], dS[r][j]);  // dS' = dS − du eᵀ
            }
            dg = fmaf(dS[r][j], sp, dg);
            dS[r][j] *= x.a[j];
          }
          float db = 0.f;
          if (A.erase == kBetaErase) {
            dkk = fmaf(x.beta, de, dkk);
            sb = fmaf(x.k[j], de, sb);
          } else if (A.erase == kGdn2Erase) {
            dkk = fmaf(x.bb[j], de, dkk);
            db = x.k[j] * de;
          }
          myred[c] = A.scale * dq;
          myred[DK + c] = dkk;
          if (A.gate == kChannelGate) myred[2 * DK + c] = dg;
          if (A.erase == kGdn2Erase) myred[(A.gate == kChannelGate ? 3 : 2) * DK + c] = db;
          sg += dg;
        }
        // the value side: dz = du
        if (A.erase == kBetaErase && p.lane == 0)
#pragma unroll
          for (int r = 0; r < kRW; ++r) sb = fmaf(du[r], x.v[r], sb);
        if (p.lane < kRW) {
          const int r = p.lane;
          const float dz = pick4(du, r);
          A.dvv[vb + r] = __float2bfloat16(dz * pick4(x.zf, r));
          if (A.erase == kGdn2Erase) A.dw[vb + r] = __float2bfloat16(dz * pick4(x.v, r));
        }
        sb = warp_sum1(sb);
        sg = warp_sum1(sg);
        if (p.lane == 0) reds[p.warp * 2] = sb, reds[p.warp * 2 + 1] = sg;
        __syncthreads();
        for (int i = threadIdx.x; i < nk * DK; i += kThreads) {
          const int kind = i / DK, c = i % DK;
          float s = 0.f;
          for (int w = 0; w < kNW; ++w) s += red[(w * kKinds + kind) * DK + c];
          A.part[((static_cast<int64_t>(kind) * A.m + p.tile) * NH + nh - nh0) * DK + c] = s;
        }
        if (threadIdx.x < 2) {
          float s = 0.f;
          for (int w = 0; w < kNW; ++w) s += reds[w * 2 + threadIdx.x];
          A.spart[(static_cast<int64_t>(threadIdx.x) * A.m + p.tile) * NH + nh - nh0] = s;
        }
        __syncthreads();
      }
    }
  }
  if (A.dS0) store_state<DK>(A.dS0 + state_off(A, p, DK), p.lane, dS);
}

// out[r, c] = Σ_{tile < m} Σ_{g < G} part[tile][r·G + g][c] (fixed order), r < NH / G.
__global__ void sum_tiles(const float* __restrict__ part, int m, int64_t NH, int G, int W, float* outf,
                          bf16* outb) {
  const int64_t n = NH / G * W;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % W, r = i / W;
    float acc = 0.f;
    for (int tile = 0; tile < m; ++tile)
      for (int g = 0; g < G; ++g) acc += part[((tile * NH) + r * G + g) * W + c];
    if (outf) outf[i] = acc;
    else outb[i] = __float2bfloat16(acc);
  }
}
unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::clamp<int64_t>((n + 255) / 256, 1, 65535)); }
void sum_parts(const float* part, int m, int64_t NH, int G, int W, float* outf, bf16* outb, cudaStream_t st) {
  if (!outf && !outb) return;
  const int64_t n = NH / G * W;
  sum_tiles<<<grid_for(n), 256, 0, st>>>(part, m, NH, G, W, outf, outb);
  LAR_CUDA_LAUNCHED();
}

WArgs make_args(const GroupedShape& s, bool decode, const char* what) {
  const int64_t Hk = s.Hk > 0 ? s.Hk : s.H;
  if (!wide_key_dim(s.dk))
    throw RuntimeError(std::string(what) + ": key dim dk=" + std::to_string(s.dk) + " (supported: 64, 128, 256)");
  if (s.dv < 64 || s.dv % 64 != 0)
    throw RuntimeError(std::string(what) + ": value dim dv=" + std::to_string(s.dv) + " (supported: multiples of 64)");
  if (s.H < 1 || Hk < 1 || s.H % Hk != 0)
    throw RuntimeError(std::string(what) + ": " + std::to_string(s.H) + " value heads are not a multiple of " +
                       std::to_string(Hk) + " key heads");
  if (s.B < 1 || (!decode && s.T < 0)) throw RuntimeError(std::string(what) + ": bad shape");
  WArgs a;
  a.B = s.B, a.T = decode ? 1 : s.T;
  a.H = static_cast<int>(s.H), a.Hk = static_cast<int>(Hk), a.G = static_cast<int>(s.H / Hk);
  a.dv = static_cast<int>(s.dv), a.m = static_cast<int>(s.dv / kRT);
  a.scale = static_cast<float>(s.scale);
  a.nseg = (a.T + kSeg - 1) / kSeg;
  return a;
}

void launch_fwd(const WArgs& a, int dk, cudaStream_t st) {
  if (a.T == 0) {
    if (a.S_out) {
      const std::size_t bytes = static_cast<std::size_t>(a.B) * a.H * a.dv * dk * sizeof(float);
      if (a.S0) LAR_CUDA_CHECK(cudaMemcpyAsync(a.S_out, a.S0, bytes, cudaMemcpyDeviceToDevice, st));
      else LAR_CUDA_CHECK(cudaMemsetAsync(a.S_out, 0, bytes, st));
    }
    return;
  }
  const unsigned grid = static_cast<unsigned>(a.B * a.H * a.m);
  if (dk == 128) wide_fwd_kernel<128><<<grid, kThreads, 0, st>>>(a);
  else wide_fwd_kernel<256><<<grid, kThreads, 0, st>>>(a);
  LAR_CUDA_LAUNCHED();
}

template <int DK>
void launch_bwd_dk(const WArgs& a, cudaStream_t st) {
  const std::size_t smem = bwd_smem_bytes<DK>();
  LAR_CUDA_CHECK(cudaFuncSetAttribute(wide_bwd_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  wide_bwd_kernel<DK><<<static_cast<unsigned>(a.nbw * a.H * a.m), kThreads, smem, st>>>(a);
  LAR_CUDA_LAUNCHED();
}

// The backward and the sums of its partials into the caller's gradients.
struct Outs {
  bf16 *dq = nullptr, *dk = nullptr, *db = nullptr;
  float *dgc = nullptr, *dgs = nullptr, *dbeta = nullptr;  // channel gate, scalar gate, β
};
// Sequences per backward wave: about one CTA per SM (the kernels run one CTA an SM), so the
// per-CTA scratch and the per-tile partials stay bounded whatever the batch.
int64_t wave_batches(int64_t B, int64_t ctas_per_seq) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return std::clamp<int64_t>(std::max<int64_t>(sms, 1) / std::max<int64_t>(ctas_per_seq, 1), 1, B);
}

void run_bwd(WArgs a, int dk, const Outs& out, cudaStream_t st) {
  if (!a.ckpt) throw RuntimeError("wide-key backward: no boundary states (the forward ran without them)");
  if (!a.dout || !a.dvv || !out.dq || !out.dk) throw RuntimeError("wide-key backward: missing dout, dq, dk or dv");
  if (a.erase == kGdn2Erase && (!a.dw || !out.db)) throw RuntimeError("wide-key backward: gdn2 needs db and dw");
  if (a.erase == kBetaErase && !out.dbeta) throw RuntimeError("wide-key backward: missing dbeta");
  if (a.T == 0) {
    if (a.dS0) {
      const std::size_t bytes = static_cast<std::size_t>(a.B) * a.H * a.dv * dk * sizeof(float);
      if (a.dST) LAR_CUDA_CHECK(cudaMemcpyAsync(a.dS0, a.dST, bytes, cudaMemcpyDeviceToDevice, st));
      else LAR_CUDA_CHECK(cudaMemsetAsync(a.dS0, 0, bytes, st));
    }
    return;
  }
  const int64_t nbw = wave_batches(a.B, static_cast<int64_t>(a.H) * a.m);
  const int64_t rows = nbw * a.T * a.H;  // value-head rows of one wave
  Scratch sc(st);
  a.part = sc.get<float>(static_cast<std::size_t>(kKinds) * a.m * rows * dk);
  a.spart = sc.get<float>(static_cast<std::size_t>(2) * a.m * rows);
  a.scratch = sc.get<float>(static_cast<std::size_t>(nbw) * a.H * a.m * (kSlots + kSub) * kRT * dk);
  for (int64_t b0 = 0; b0 < a.B; b0 += nbw) {
    a.b0 = b0, a.nbw = std::min(nbw, a.B - b0);
    if (dk == 128) launch_bwd_dk<128>(a, st);
    else launch_bwd_dk<256>(a, st);
    const int64_t NH = a.nbw * a.T * a.H, r0 = b0 * a.T * a.H;  // this wave's rows
    const int64_t rk0 = b0 * a.T * a.Hk;                         // ... of the key-head tensors
    const std::size_t kind = static_cast<std::size_t>(a.m) * NH * dk;  // the kernel's strides: this wave's rows
    sum_parts(a.part, a.m, NH, a.G, dk, nullptr, out.dq + rk0 * dk, st);
    sum_parts(a.part + kind, a.m, NH, a.G, dk, nullptr, out.dk + rk0 * dk, st);
    int next = 2;
    if (a.gate == kChannelGate) sum_parts(a.part + kind * next++, a.m, NH, 1, dk, out.dgc + r0 * dk, nullptr, st);
    if (a.erase == kGdn2Erase) sum_parts(a.part + kind * next, a.m, NH, 1, dk, nullptr, out.db + r0 * dk, st);
    if (a.erase == kBetaErase) sum_parts(a.spart, a.m, NH, 1, 1, out.dbeta + r0, nullptr, st);
    if (a.gate == kScalarGate)
      sum_parts(a.spart + static_cast<std::size_t>(a.m) * NH, a.m, NH, 1, 1, out.dgs + r0, nullptr, st);
  }
}

void set_channel(WArgs& a, ChannelMixer m, const ChannelInputs& in) {
  a.q = in.q, a.k = in.k, a.v = in.v, a.g = in.g;
  a.gate = in.g ? kChannelGate : kNoGate;
  if (m == ChannelMixer::kda) {
    if (!in.beta) throw RuntimeError("wide-key kda: missing beta");
    a.erase = kBetaErase, a.beta = in.beta;
  } else if (m == ChannelMixer::gdn2) {
    if (!in.b || !in.w) throw RuntimeError("wide-key gdn2: missing b or w");
    a.erase = kGdn2Erase, a.b = in.b, a.w = in.w;
  }
}

__global__ void l2_fwd_kernel(int64_t rows, int width, bf16* x, float* rn) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  bf16* xr = x + r * width;
  float s = 0.f;
  for (int c = lane; c < width; c += 32) {
    const float v = bf(xr[c]);
    s = fmaf(v, v, s);
  }
  s = warp_sum1(s);
  const float inv = rsqrtf(s + 1e-6f);
  for (int c = lane; c < width; c += 32) xr[c] = __float2bfloat16(bf(xr[c]) * inv);
  if (lane == 0) rn[r] = inv;
}
__global__ void l2_bwd_kernel(int64_t rows, int width, const bf16* xh, const float* rn, bf16* dx) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const bf16* xr = xh + r * width;
  bf16* dr = dx + r * width;
  float s = 0.f;
  for (int c = lane; c < width; c += 32) s = fmaf(bf(xr[c]), bf(dr[c]), s);
  s = warp_sum1(s);
  const float inv = rn[r];
  for (int c = lane; c < width; c += 32) dr[c] = __float2bfloat16(inv * (bf(dr[c]) - bf(xr[c]) * s));
}


// ---- CCQ (kernels/cpu/linear/ccq.hpp) at dk ∈ {128, 256}: the key statistics K = Σ k kᵀ are a
// state of dk rows (value tiles of 64 rows) updated by u = k, no gate, no erase; the readout
// r = K q / n − c·m (mᵀq) / n² (n = t0 + t + 1) gives q_c = q − λ r. m (a dk vector) is carried
// in every lane for its key columns and rows (redundantly per warp: mᵀq needs all of it).
struct CcqArgs {
  int64_t B = 0, T = 0, t0 = 0;
  int H = 1, m = 1;
  bool centered = true;
  const bf16 *q = nullptr, *k = nullptr, *dqc = nullptr;
  const float *lambda = nullptr, *K0 = nullptr, *m0 = nullptr;
  bf16* qc = nullptr;
  float *Kout = nullptr, *mout = nullptr;
  // backward (from the statistics after the call)
  const float *Kfin = nullptr, *mfin = nullptr;
  float *part = nullptr, *spart = nullptr;  // [2][m][rows][dk] (dq, dk), [m][rows] (λ): the wave's rows
  int64_t b0 = 0, nbw = 0;                  // the backward's wave of sequences [b0, b0 + nbw)
};

template <int DK>
__global__ void __launch_bounds__(kThreads) wide_ccq_fwd_kernel(CcqArgs A) {
  constexpr int NJ = DK / 32;
  const int tile = blockIdx.x % A.m;
  const int64_t bh = blockIdx.x / A.m;
  const int h = static_cast<int>(bh % A.H), b = static_cast<int>(bh / A.H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = tile * kRT + warp * kRW;
  float S[kRW][NJ], mc[NJ], mr[kRW];
  const int64_t so = (bh * DK + row0) * DK;
  load_state<DK>(A.K0 ? A.K0 + so : nullptr, lane, S);
#pragma unroll
  for (int j = 0; j < NJ; ++j) mc[j] = A.m0 ? A.m0[bh * DK + lane + 32 * j] : 0.f;
#pragma unroll
  for (int r = 0; r < kRW; ++r) mr[r] = A.m0 ? A.m0[bh * DK + row0 + r] : 0.f;
  for (int64_t t = 0; t < A.T; ++t) {
    const int64_t n = static_cast<int64_t>(b) * A.T + t, base = (n * A.H + h) * DK;
    float k[NJ], q[NJ], kr[kRW], qr[kRW];
#pragma unroll
    for (int j = 0; j < NJ; ++j) k[j] = bf(A.k[base + lane + 32 * j]), q[j] = bf(A.q[base + lane + 32 * j]);
#pragma unroll
    for (int r = 0; r < kRW; ++r) kr[r] = bf(A.k[base + row0 + r]), qr[r] = bf(A.q[base + row0 + r]);
    const float lam = A.lambda[n * A.H + h], cnt = static_cast<float>(A.t0 + t + 1);
    float mq = 0.f, o[kRW];
#pragma unroll
    for (int j = 0; j < NJ; ++j) mc[j] += k[j], mq = fmaf(mc[j], q[j], mq);
#pragma unroll
    for (int r = 0; r < kRW; ++r) {
      mr[r] += kr[r];
      o[r] = 0.f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        S[r][j] = fmaf(kr[r], k[j], S[r][j]);
        o[r] = fmaf(S[r][j], q[j], o[r]);
      }
    }
    mq = warp_sum1(mq);
    warp_sum(o);
    if (lane < kRW) {
      const int r = lane;
      float x = pick4(o, r) / cnt;
      if (A.centered) x -= pick4(mr, r) * mq / (cnt * cnt);
      A.qc[base + row0 + r] = __float2bfloat16(pick4(qr, r) - lam * x);
    }
  }
  if (A.Kout) store_state<DK>(A.Kout + so, lane, S);
  if (A.mout && tile == 0 && warp == 0)
#pragma unroll
    for (int j = 0; j < NJ; ++j) A.mout[bh * DK + lane + 32 * j] = mc[j];
}

template <int DK>
constexpr std::size_t ccq_bwd_smem_bytes() {
  return sizeof(float) * (static_cast<std::size_t>(kNW) * 2 * DK + kRT + 2 * DK + kNW);
}

// The reverse walk from the statistics after the call: K_{t−1} = K_t − k_t k_tᵀ and
// m_{t−1} = m_t − k_t (no decay: the subtraction undoes the forward's sum), with
// GK = Σ_{i≥t} ∂L/∂K_i in registers and Gm = Σ_{i≥t} ∂L/∂m_i in shared memory (warp 0).
template <int DK>
__global__ void __launch_bounds__(kThreads) wide_ccq_bwd_kernel(CcqArgs A) {
  constexpr int NJ = DK / 32;
  extern __shared__ float smem[];
  float* red = smem;                    // [kNW][2][DK]
  float* rowbuf = red + kNW * 2 * DK;   // [kRT]: (GK k) at this tile's rows
  float* gms = rowbuf + kRT;            // [DK]: Gm (carried over the tokens)
  float* dqx = gms + DK;                // [DK]: dq's elementwise terms
  float* reds = dqx + DK;               // [kNW]
  const int tile = blockIdx.x % A.m;
  const int64_t bh = A.b0 * A.H + blockIdx.x / A.m;
  const int h = static_cast<int>(bh % A.H), b = static_cast<int>(bh / A.H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = tile * kRT + warp * kRW;
  const int64_t NH = A.nbw * A.T * A.H, nh0 = A.b0 * A.T * A.H;  // the wave's rows of part, spart
  float S[kRW][NJ], dS[kRW][NJ], mc[NJ], mr[kRW];
  const int64_t so = (bh * DK + row0) * DK;
  load_state<DK>(A.Kfin + so, lane, S);
  load_state<DK>(nullptr, lane, dS);
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    mc[j] = A.mfin[bh * DK + lane + 32 * j];
    if (warp == 0) gms[lane + 32 * j] = 0.f;  // Gm lives in shared memory, updated by warp 0 only
  }
#pragma unroll
  for (int r = 0; r < kRW; ++r) mr[r] = A.mfin[bh * DK + row0 + r];
  const float c = A.centered ? 1.f : 0.f;
  for (int64_t t = A.T - 1; t >= 0; --t) {
    const int64_t n = static_cast<int64_t>(b) * A.T + t, nh = n * A.H + h, base = nh * DK;
    float k[NJ], q[NJ], gc[NJ], kr[kRW], gr[kRW];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int col = lane + 32 * j;
      k[j] = bf(A.k[base + col]), q[j] = bf(A.q[base + col]), gc[j] = bf(A.dqc[base + col]);
    }
#pragma unroll
    for (int r = 0; r < kRW; ++r) kr[r] = bf(A.k[base + row0 + r]), gr[r] = bf(A.dqc[base + row0 + r]);
    const float lam = A.lambda[nh], cnt = static_cast<float>(A.t0 + t + 1), inv = 1.f / cnt, inv2 = inv * inv;
    float mq = 0.f, mdr = 0.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) mq = fmaf(mc[j], q[j], mq), mdr = fmaf(mc[j], -lam * gc[j], mdr);
    mq = warp_sum1(mq);
    mdr = warp_sum1(mdr);
    float o[kRW], du[kRW];
#pragma unroll
    for (int r = 0; r < kRW; ++r) {
      o[r] = 0.f;
      du[r] = 0.f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        o[r] = fmaf(S[r][j], q[j], o[r]);
        dS[r][j] = fmaf(-lam * gr[r] * inv, q[j], dS[r][j]);  // GK += dr qᵀ / n
        du[r] = fmaf(dS[r][j], k[j], du[r]);
      }
    }
    warp_sum(o);
    warp_sum(du);
    float dl = 0.f;
#pragma unroll
    for (int r = 0; r < kRW; ++r) dl -= gr[r] * (o[r] * inv - c * mr[r] * mq * inv2);
    float* myred = red + warp * 2 * DK;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int col = lane + 32 * j;
      float dq = 0.f, dkk = 0.f;
#pragma unroll
      for (int r = 0; r < kRW; ++r) {
        dq = fmaf(S[r][j], -lam * gr[r], dq);
        dkk = fmaf(dS[r][j], kr[r], dkk);
      }
      myred[col] = dq * inv;
      myred[DK + col] = dkk;
      if (warp == 0) {
        gms[col] -= c * (-lam * gc[j] * mq + q[j] * mdr) * inv2;
        dqx[col] = gc[j] - c * mc[j] * mdr * inv2;
      }
    }
    if (lane < kRW) rowbuf[warp * kRW + lane] = pick4(du, lane);
    if (lane == 0) reds[warp] = dl;
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * DK; i += kThreads) {
      const int kind = i / DK, col = i % DK;
      float s = 0.f;
      for (int w = 0; w < kNW; ++w) s += red[(w * 2 + kind) * DK + col];
      if (kind == 0 && tile == 0) s += dqx[col];
      if (kind == 1) {
        if (col >= tile * kRT && col < (tile + 1) * kRT) s += rowbuf[col - tile * kRT];
        if (tile == 0) s += gms[col];
      }
      A.part[((static_cast<int64_t>(kind) * A.m + tile) * NH + nh - nh0) * DK + col] = s;
    }
    if (threadIdx.x == 0) {
      float s = 0.f;
      for (int w = 0; w < kNW; ++w) s += reds[w];
      A.spart[static_cast<int64_t>(tile) * NH + nh - nh0] = s;
    }
    __syncthreads();
    // back to K_{t−1}, m_{t−1}
#pragma unroll
    for (int j = 0; j < NJ; ++j) mc[j] -= k[j];
#pragma unroll
    for (int r = 0; r < kRW; ++r) {
      mr[r] -= kr[r];
#pragma unroll
      for (int j = 0; j < NJ; ++j) S[r][j] = fmaf(-kr[r], k[j], S[r][j]);
    }
  }
}

// dst[i] (+)= Σ_{tile < m} part[tile][i] (fixed order); bf16 out, optionally added to what is there.
__global__ void sum_tiles_add(const float* __restrict__ part, int m, int64_t n, bf16* dst, bool add) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = add ? bf(dst[i]) : 0.f;
    for (int tile = 0; tile < m; ++tile) acc += part[tile * n + i];
    dst[i] = __float2bfloat16(acc);
  }
}

CcqArgs make_ccq(const DeltaShape& s, const CcqInputs& in, const char* what) {
  if (!wide_key_dim(s.dk))
    throw RuntimeError(std::string(what) + ": key dim dk=" + std::to_string(s.dk) + " (supported: 128, 256)");
  if (!in.q || !in.k || !in.lambda) throw RuntimeError(std::string(what) + ": missing q, k or lambda");
  if (s.B < 1 || s.H < 1 || s.T < 0) throw RuntimeError(std::string(what) + ": bad shape");
  CcqArgs a;
  a.B = s.B, a.T = s.T, a.t0 = in.t0, a.H = static_cast<int>(s.H), a.m = static_cast<int>(s.dk / kRT);
  a.centered = in.centered, a.q = in.q, a.k = in.k, a.lambda = in.lambda, a.K0 = in.K0, a.m0 = in.m0;
  return a;
}
}  // namespace

bool wide_key_dim(int64_t dk) { return dk == 128 || dk == 256; }

std::size_t wide_boundary_bytes(const GroupedShape& s) {
  const WArgs a = make_args(s, false, "wide-key boundary");
  return static_cast<std::size_t>(a.B) * a.H * std::max<int64_t>(a.nseg, 1) * a.dv * s.dk * sizeof(float);
}

void wide_delta_fwd(const GroupedShape& s, const bf16* q, const bf16* k, const bf16* v, const float* g,
                    const float* beta, const float* S0, bf16* o, float* S_out, void* boundary, cudaStream_t stream) {
  WArgs a = make_args(s, false, "wide-key delta forward");
  if (!beta) throw RuntimeError("wide-key delta forward: missing beta");
  a.q = q, a.k = k, a.v = v, a.g = g, a.beta = beta, a.S0 = S0, a.o = o, a.S_out = S_out;
  a.gate = g ? kScalarGate : kNoGate, a.erase = kBetaErase;
  a.ckpt = static_cast<float*>(boundary);
  launch_fwd(a, static_cast<int>(s.dk), stream);
}

void wide_delta_bwd(const GroupedShape& s, const bf16* q, const bf16* k, const bf16* v, const float* g,
                    const float* beta, const void* boundary, const bf16* dout, const float* dST, bf16* dq, bf16* dk,
                    bf16* dv, float* dg, float* dbeta, float* dS0, cudaStream_t stream) {
  WArgs a = make_args(s, false, "wide-key delta backward");
  if (!beta) throw RuntimeError("wide-key delta backward: missing beta");
  a.q = q, a.k = k, a.v = v, a.g = g, a.beta = beta;
  a.gate = g ? kScalarGate : kNoGate, a.erase = kBetaErase;
  a.ckpt = static_cast<float*>(const_cast<void*>(boundary));
  a.dout = dout, a.dST = dST, a.dS0 = dS0, a.dvv = dv;
  Outs out;
  out.dq = dq, out.dk = dk, out.dgs = g ? dg : nullptr, out.dbeta = dbeta;
  run_bwd(a, static_cast<int>(s.dk), out, stream);
}

void wide_delta_decode(const GroupedShape& s, const bf16* q, const bf16* k, const bf16* v, const float* g,
                       const float* beta, float* S, bf16* o, cudaStream_t stream) {
  WArgs a = make_args(s, true, "wide-key delta decode");
  if (!beta) throw RuntimeError("wide-key delta decode: missing beta");
  a.q = q, a.k = k, a.v = v, a.g = g, a.beta = beta, a.S0 = S, a.S_out = S, a.o = o;
  a.gate = g ? kScalarGate : kNoGate, a.erase = kBetaErase;
  launch_fwd(a, static_cast<int>(s.dk), stream);
}

void wide_channel_fwd(ChannelMixer m, const GroupedShape& s, const ChannelInputs& in, bf16* o, float* S_out,
                      void* boundary, cudaStream_t stream) {
  WArgs a = make_args(s, false, "wide-key channel forward");
  set_channel(a, m, in);
  a.S0 = in.S0, a.o = o, a.S_out = S_out, a.ckpt = static_cast<float*>(boundary);
  launch_fwd(a, static_cast<int>(s.dk), stream);
}

void wide_channel_bwd(ChannelMixer m, const GroupedShape& s, const ChannelInputs& in, const void* boundary,
                      const bf16* dout, const float* dST, const ChannelGrads& gr, cudaStream_t stream) {
  WArgs a = make_args(s, false, "wide-key channel backward");
  set_channel(a, m, in);
  a.ckpt = static_cast<float*>(const_cast<void*>(boundary));
  a.dout = dout, a.dST = dST, a.dS0 = gr.dS0, a.dvv = gr.dv, a.dw = gr.dw;
  Outs out;
  out.dq = gr.dq, out.dk = gr.dk, out.db = gr.db, out.dgc = a.gate == kChannelGate ? gr.dg : nullptr;
  out.dbeta = gr.dbeta;
  if (a.gate == kChannelGate && !gr.dg) throw RuntimeError("wide-key channel backward: missing dg");
  run_bwd(a, static_cast<int>(s.dk), out, stream);
}

void wide_channel_decode(ChannelMixer m, const GroupedShape& s, const ChannelInputs& in, float* S, bf16* o,
                         cudaStream_t stream) {
  WArgs a = make_args(s, true, "wide-key channel decode");
  set_channel(a, m, in);
  a.S0 = S, a.S_out = S, a.o = o;
  launch_fwd(a, static_cast<int>(s.dk), stream);
}

void l2_rows_forward(int64_t rows, int width, bf16* x, float* rn, cudaStream_t stream) {
  if (rows <= 0) return;
  l2_fwd_kernel<<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(rows, width, x, rn);
  LAR_CUDA_LAUNCHED();
}
void l2_rows_backward(int64_t rows, int width, const bf16* xhat, const float* rn, bf16* dx, cudaStream_t stream) {
  if (rows <= 0) return;
  l2_bwd_kernel<<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(rows, width, xhat, rn, dx);
  LAR_CUDA_LAUNCHED();
}

}  // namespace lar::kernels::cuda::linear

namespace lar::kernels::cuda::linear {

void wide_ccq_fwd(const DeltaShape& s, const CcqInputs& in, bf16* qc, const CcqStats& out, cudaStream_t stream) {
  CcqArgs a = make_ccq(s, in, "wide-key ccq forward");
  if (!qc) throw RuntimeError("wide-key ccq forward: missing q_c");
  a.qc = qc, a.Kout = out.K, a.mout = out.m;
  const std::size_t KK = static_cast<std::size_t>(s.B) * s.H * s.dk * s.dk, M = static_cast<std::size_t>(s.B) * s.H * s.dk;
  if (s.T == 0) {  // the statistics pass through
    if (out.K) {
      if (in.K0) LAR_CUDA_CHECK(cudaMemcpyAsync(out.K, in.K0, KK * sizeof(float), cudaMemcpyDeviceToDevice, stream));
      else LAR_CUDA_CHECK(cudaMemsetAsync(out.K, 0, KK * sizeof(float), stream));
    }
    if (out.m) {
      if (in.m0) LAR_CUDA_CHECK(cudaMemcpyAsync(out.m, in.m0, M * sizeof(float), cudaMemcpyDeviceToDevice, stream));
      else LAR_CUDA_CHECK(cudaMemsetAsync(out.m, 0, M * sizeof(float), stream));
    }
    return;
  }
  const unsigned grid = static_cast<unsigned>(s.B * s.H * a.m);
  if (s.dk == 128) wide_ccq_fwd_kernel<128><<<grid, kThreads, 0, stream>>>(a);
  else wide_ccq_fwd_kernel<256><<<grid, kThreads, 0, stream>>>(a);
  LAR_CUDA_LAUNCHED();
}

namespace {
template <int DK>
void launch_ccq_bwd(const CcqArgs& a, cudaStream_t st) {
  const std::size_t smem = ccq_bwd_smem_bytes<DK>();
  LAR_CUDA_CHECK(cudaFuncSetAttribute(wide_ccq_bwd_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  wide_ccq_bwd_kernel<DK><<<static_cast<unsigned>(a.nbw * a.H * a.m), kThreads, smem, st>>>(a);
  LAR_CUDA_LAUNCHED();
}
}  // namespace

void wide_ccq_bwd(const DeltaShape& s, const CcqInputs& in, const CcqStats& fin, const bf16* dqc, bf16* dq, bf16* dk,
                  float* dlambda, cudaStream_t stream) {
  CcqArgs a = make_ccq(s, in, "wide-key ccq backward");
  if (!fin.K || !fin.m) throw RuntimeError("wide-key ccq backward: the forward kept no statistics");
  if (!dqc || !dq || !dk || !dlambda) throw RuntimeError("wide-key ccq backward: missing dq_c, dq, dk or dlambda");
  if (s.T == 0) return;
  a.Kfin = fin.K, a.mfin = fin.m, a.dqc = dqc;
  const int64_t nbw = wave_batches(s.B, s.H * a.m), rows = nbw * s.T * s.H;
  Scratch sc(stream);
  a.part = sc.get<float>(static_cast<std::size_t>(2) * a.m * rows * s.dk);
  a.spart = sc.get<float>(static_cast<std::size_t>(a.m) * rows);
  for (int64_t b0 = 0; b0 < s.B; b0 += nbw) {
    a.b0 = b0, a.nbw = std::min(nbw, s.B - b0);
    if (s.dk == 128) launch_ccq_bwd<128>(a, stream);
    else launch_ccq_bwd<256>(a, stream);
    const int64_t NH = a.nbw * s.T * s.H, r0 = b0 * s.T * s.H, n = NH * s.dk;  // this wave's rows
    sum_tiles_add<<<grid_for(n), 256, 0, stream>>>(a.part, a.m, n, dq + r0 * s.dk, false);
    LAR_CUDA_LAUNCHED();
    sum_tiles_add<<<grid_for(n), 256, 0, stream>>>(a.part + static_cast<std::size_t>(a.m) * n, a.m, n,
                                                   dk + r0 * s.dk, true);
    LAR_CUDA_LAUNCHED();
    sum_parts(a.spart, a.m, NH, 1, 1, dlambda + r0, nullptr, stream);
  }
}

}  // namespace lar::kernels::cuda::linear

// ---- CARVE (linear_methods.hpp's carve_fwd / carve_bwd) at dk = 128 or dv = 128: the gdn2 step
// of fwd_step with b_t = σ(bx_t + u_c), u_c = U2 tanh(U1 m_c), z_t = w_t v_t, m_c the mean of the
// outputs over content chunk c − 1 (64 tokens). m_c reads every value row of the head, so one CTA
// holds the whole head (16 warps of dv/16 rows) and the content signal is reduced between two
// block barriers at each chunk start; the forward records (m_c, h_c = tanh(U1 m_c), u_c) per
// chunk for the backward. The backward is wide_bwd_kernel's (checkpoints every 256 tokens,
// sub-checkpoints every 8) with the whole head's key-side sums in the CTA, so it applies
// b(1 − b), sums du_c = Σ_t ∂L/∂(bx + u) over the chunk and, at the chunk's first token, turns
// it into dU2 += du hᵀ, dU1 += dh mᵀ and dm_c (added as dm_c / 64 to the previous chunk's dO when
// content_grad), in the CPU's order (kernels/cpu/linear/carve.hpp). dU1, dU2 per sequence, then
// summed over the batch in order: deterministic, no atomics.
namespace lar::kernels::cuda::linear {
namespace {

constexpr int kCL = 64;  // CARVE's content chunk
constexpr int kCR = 32;  // the largest content rank

struct CArgs {
  int64_t B = 0, T = 0, nc = 1, nseg = 0;
  int H = 1, dv = 64, rank = 1, cw = 0;  // cw: floats of one chunk's content record
  float scale = 1.f;
  bool content_grad = true;
  const bf16 *q = nullptr, *k = nullptr, *v = nullptr, *bx = nullptr;
  const float *g = nullptr, *w = nullptr, *U1 = nullptr, *U2 = nullptr, *S0 = nullptr;
  bf16* o = nullptr;
  float *S_out = nullptr, *ckpt = nullptr, *content = nullptr;  // content [B,H,nc,cw]: m [dv], h [kCR], u [dk]
  const bf16* dout = nullptr;
  const float* dST = nullptr;
  float* dS0 = nullptr;
  bf16 *dq = nullptr, *dk = nullptr, *dvv = nullptr, *dbx = nullptr;
  float *dg = nullptr, *dw = nullptr;
  float *dU1p = nullptr, *dU2p = nullptr;  // [B,H,rank,dv], [B,H,dk,rank]
  float* scratch = nullptr;                // per CTA [kSlots + kSub][dv][dk]
  int64_t b0 = 0, nbw = 0;
};

__device__ __forceinline__ float csig(float x) { return 1.f / (1.f + __expf(-x)); }

template <int DK, int RW>
struct CTok {
  static constexpr int NJ = DK / 32;
  float k[NJ], q[NJ], e[NJ], a[NJ], bb[NJ];
  float w;
  float v[RW];
};
template <int DK, int RW>
__device__ __forceinline__ void carve_tok(const CArgs& A, int b, int h, int row0, int lane, int64_t t, const float* u_s,
                                          CTok<DK, RW>& x) {
  const int64_t hb = (static_cast<int64_t>(b) * A.T + t) * A.H + h, kb = hb * DK, vb = hb * A.dv + row0;
#pragma unroll
  for (int j = 0; j < DK / 32; ++j) {
    const int c = lane + 32 * j;
    x.k[j] = bf(A.k[kb + c]);
    x.q[j] = bf(A.q[kb + c]);
    x.a[j] = __expf(A.g[kb + c]);
    x.bb[j] = csig(bf(A.bx[kb + c]) + u_s[c]);
    x.e[j] = x.bb[j] * x.k[j];
  }
  x.w = A.w[hb];
#pragma unroll
  for (int r = 0; r < RW; ++r) x.v[r] = bf(A.v[vb + r]);
}
// S ← S D(a); u = w v − S e; S ← S + u kᵀ (fwd_step's gdn2 case); Sp (nullable) gets S D(a).
template <int DK, int RW>
__device__ __forceinline__ void carve_step(const CTok<DK, RW>& x, float (&S)[RW][DK / 32], float* Sp, int lane,
                                           float (&u)[RW]) {
  constexpr int NJ = DK / 32;
  float p[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    p[r] = 0.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      S[r][j] *= x.a[j];
      p[r] = fmaf(S[r][j], x.e[j], p[r]);
    }
  }
  if (Sp) {
#pragma unroll
    for (int r = 0; r < RW; ++r)
#pragma unroll
      for (int j = 0; j < NJ; ++j) Sp[r * DK + lane + 32 * j] = S[r][j];
  }
  warp_sum(p);
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    u[r] = x.w * x.v[r] - p[r];
#pragma unroll
    for (int j = 0; j < NJ; ++j) S[r][j] = fmaf(u[r], x.k[j], S[r][j]);
  }
}
template <int DK, int RW>
__device__ __forceinline__ void cload(const float* src, int lane, float (&S)[RW][DK / 32]) {
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int j = 0; j < DK / 32; ++j) S[r][j] = src ? src[r * DK + lane + 32 * j] : 0.f;
}
template <int DK, int RW>
__device__ __forceinline__ void cstore(float* dst, int lane, const float (&S)[RW][DK / 32]) {
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int j = 0; j < DK / 32; ++j) dst[r * DK + lane + 32 * j] = S[r][j];
}
template <int RW>
__device__ __forceinline__ float pickn(const float (&x)[RW], int i) {
  float y = x[0];
#pragma unroll
  for (int r = 1; r < RW; ++r)
    if (r == i) y = x[r];
  return y;
}

template <int DK, int RW>
__global__ void __launch_bounds__(kThreads) wide_carve_fwd_kernel(CArgs A) {
  constexpr int NJ = DK / 32;
  __shared__ float u_s[DK], m_s[2 * kRT], h_s[kCR];
  const int64_t bh = blockIdx.x;
  const int h = static_cast<int>(bh % A.H), b = static_cast<int>(bh / A.H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = warp * RW;
  float S[RW][NJ], osum[RW];
  cload<DK, RW>(A.S0 ? A.S0 + (bh * A.dv + row0) * DK : nullptr, lane, S);
#pragma unroll
  for (int r = 0; r < RW; ++r) osum[r] = 0.f;
  float* cont = A.content + bh * A.nc * A.cw;
  for (int i = threadIdx.x; i < DK; i += kThreads) u_s[i] = 0.f;  // m_0 = 0: u_0 = U2 tanh(0) = 0
  for (int i = threadIdx.x; i < A.cw; i += kThreads) cont[i] = 0.f;
  __syncthreads();
  for (int64_t t = 0; t < A.T; ++t) {
    if (t > 0 && t % kCL == 0) {  // content chunk c = t / 64 starts: m_c, h_c, u_c
      if (lane == 0)
#pragma unroll
        for (int r = 0; r < RW; ++r) m_s[row0 + r] = osum[r] * (1.f / kCL);
#pragma unroll
      for (int r = 0; r < RW; ++r) osum[r] = 0.f;
      __syncthreads();
      for (int r = warp; r < A.rank; r += kNW) {
        float s = 0.f;
        for (int j = lane; j < A.dv; j += 32)
          s = fmaf(A.U1[(static_cast<int64_t>(h) * A.rank + r) * A.dv + j], m_s[j], s);
        s = warp_sum1(s);
        if (lane == 0) h_s[r] = tanhf(s);
      }
      __syncthreads();
      float* rec = cont + (t / kCL) * A.cw;
      for (int i = threadIdx.x; i < DK; i += kThreads) {
        float s = 0.f;
        for (int r = 0; r < A.rank; ++r) s = fmaf(A.U2[(static_cast<int64_t>(h) * DK + i) * A.rank + r], h_s[r], s);
        u_s[i] = s;
        rec[A.dv + kCR + i] = s;
      }
      for (int i = threadIdx.x; i < A.dv; i += kThreads) rec[i] = m_s[i];
      for (int i = threadIdx.x; i < A.rank; i += kThreads) rec[A.dv + i] = h_s[i];
      __syncthreads();
    }
    if (A.ckpt && t % kSeg == 0) cstore<DK, RW>(A.ckpt + ((bh * A.nseg + t / kSeg) * A.dv + row0) * DK, lane, S);
    CTok<DK, RW> x;
    carve_tok<DK, RW>(A, b, h, row0, lane, t, u_s, x);
    float u[RW], o[RW];
    carve_step<DK, RW>(x, S, nullptr, lane, u);
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      o[r] = 0.f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) o[r] = fmaf(S[r][j], x.q[j], o[r]);
    }
    warp_sum(o);
#pragma unroll
    for (int r = 0; r < RW; ++r) osum[r] = fmaf(A.scale, o[r], osum[r]);
    if (lane < RW) {
      const int64_t hb = (static_cast<int64_t>(b) * A.T + t) * A.H + h;
      A.o[hb * A.dv + row0 + lane] = __float2bfloat16(A.scale * pickn(o, lane));
    }
  }
  if (A.S_out) cstore<DK, RW>(A.S_out + (bh * A.dv + row0) * DK, lane, S);
}

template <int DK>
constexpr std::size_t carve_bwd_smem_floats(int dv) {
  return static_cast<std::size_t>(kNW) * 4 * DK + static_cast<std::size_t>(kSub) * dv + kNW + 2 * DK + dv + 2 * kCR;
}

template <int DK, int RW>
__global__ void __launch_bounds__(kThreads) wide_carve_bwd_kernel(CArgs A) {
  constexpr int NJ = DK / 32;
  extern __shared__ float smem[];
  float* red = smem;               // [kNW][4][DK]: dq, dk, dg, db per warp
  float* us = red + kNW * 4 * DK;  // [kSub][dv]
  float* reds = us + kSub * A.dv;  // [kNW]: dw per warp
  float* u_s = reds + kNW;         // [DK]: u_c of the chunk being walked
  float* du_s = u_s + DK;          // [DK]: Σ_t dbx over the chunk
  float* dm_s = du_s + DK;         // [dv]: dm_{c+1} / 64, added to dO in chunk c
  float* dh_s = dm_s + A.dv;       // [kCR]
  const int64_t bh = A.b0 * A.H + blockIdx.x;
  const int h = static_cast<int>(bh % A.H), b = static_cast<int>(bh / A.H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = warp * RW;
  const int64_t rows = static_cast<int64_t>(A.dv) * DK;
  float* sc = A.scratch + static_cast<int64_t>(blockIdx.x) * (kSlots + kSub) * rows + row0 * DK;
  auto sub = [&](int i) { return sc + static_cast<int64_t>(i) * rows; };
  auto spb = [&](int i) { return sc + static_cast<int64_t>(kSlots + i) * rows; };
  const float* cont = A.content + bh * A.nc * A.cw;
  float* dU1 = A.dU1p + bh * A.rank * A.dv;
  float* dU2 = A.dU2p + bh * DK * A.rank;
  for (int i = threadIdx.x; i < A.rank * A.dv; i += kThreads) dU1[i] = 0.f;
  for (int i = threadIdx.x; i < DK * A.rank; i += kThreads) dU2[i] = 0.f;
  for (int i = threadIdx.x; i < DK; i += kThreads) du_s[i] = 0.f;
  for (int i = threadIdx.x; i < A.dv; i += kThreads) dm_s[i] = 0.f;
  int64_t cur = -1;  // the chunk whose u is in u_s
  auto load_u = [&](int64_t c) {
    if (c == cur) return;
    __syncthreads();
    for (int i = threadIdx.x; i < DK; i += kThreads) u_s[i] = cont[c * A.cw + A.dv + kCR + i];
    __syncthreads();
    cur = c;
  };
  float dS[RW][NJ];
  cload<DK, RW>(A.dST ? A.dST + (bh * A.dv + row0) * DK : nullptr, lane, dS);
  for (int64_t seg = A.nseg - 1; seg >= 0; --seg) {
    const int64_t t0 = seg * kSeg, t1 = std::min<int64_t>(A.T, t0 + kSeg);
    const int nsub = static_cast<int>((t1 - t0 + kSub - 1) / kSub);
    float S[RW][NJ];
    cload<DK, RW>(A.ckpt + ((bh * A.nseg + seg) * A.dv + row0) * DK, lane, S);
    for (int ss = 0; ss < nsub; ++ss) {
      cstore<DK, RW>(sub(ss), lane, S);
      if (ss + 1 == nsub) break;
      load_u((t0 + ss * kSub) / kCL);  // a sub-segment lies in one content chunk (8 | 64)
      for (int64_t t = t0 + ss * kSub; t < t0 + (ss + 1) * kSub; ++t) {
        CTok<DK, RW> x;
        carve_tok<DK, RW>(A, b, h, row0, lane, t, u_s, x);
        float u[RW];
        carve_step<DK, RW>(x, S, nullptr, lane, u);
      }
    }
    for (int ss = nsub - 1; ss >= 0; --ss) {
      const int64_t s0 = t0 + ss * kSub, s1 = std::min<int64_t>(t1, s0 + kSub);
      load_u(s0 / kCL);
      cload<DK, RW>(sub(ss), lane, S);
      __syncwarp();
      for (int64_t t = s0; t < s1; ++t) {
        CTok<DK, RW> x;
        carve_tok<DK, RW>(A, b, h, row0, lane, t, u_s, x);
        float u[RW];
        carve_step<DK, RW>(x, S, spb(static_cast<int>(t - s0)), lane, u);
        if (lane == 0)
#pragma unroll
          for (int r = 0; r < RW; ++r) us[(t - s0) * A.dv + row0 + r] = u[r];
      }
      __syncwarp();
      for (int64_t t = s1 - 1; t >= s0; --t) {
        const int tt = static_cast<int>(t - s0);
        CTok<DK, RW> x;
        carve_tok<DK, RW>(A, b, h, row0, lane, t, u_s, x);
        const int64_t hb = (static_cast<int64_t>(b) * A.T + t) * A.H + h, kb = hb * DK, vb = hb * A.dv + row0;
        float dO[RW], u[RW], du[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) {
          dO[r] = bf(A.dout[vb + r]) + dm_s[row0 + r];
          u[r] = us[tt * A.dv + row0 + r];
          du[r] = 0.f;
#pragma unroll
          for (int j = 0; j < NJ; ++j) {
            dS[r][j] = fmaf(A.scale * dO[r], x.q[j], dS[r][j]);
            du[r] = fmaf(dS[r][j], x.k[j], du[r]);
          }
        }
        warp_sum(du);
        const float* Sp = spb(tt);
        float* myred = red + warp * 4 * DK;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int c = lane + 32 * j;
          float dq = 0.f, dkk = 0.f, de = 0.f, dg = 0.f;
#pragma unroll
          for (int r = 0; r < RW; ++r) {
            const float sp = Sp[r * DK + c];
            dq = fmaf(sp + u[r] * x.k[j], dO[r], dq);
            dkk = fmaf(dS[r][j], u[r], dkk);
            de = fmaf(-sp, du[r], de);
            dS[r][j] = fmaf(-du[r], x.e[j], dS[r][j]);
            dg = fmaf(dS[r][j], sp, dg);
            dS[r][j] *= x.a[j];
          }
          myred[c] = A.scale * dq;
          myred[DK + c] = fmaf(x.bb[j], de, dkk);
          myred[2 * DK + c] = dg;
          myred[3 * DK + c] = x.k[j] * de;
        }
        float sw = 0.f;  // the scalar write gate: Σ over the rows of dz · v
#pragma unroll
        for (int r = 0; r < RW; ++r) sw = fmaf(du[r], x.v[r], sw);
        if (lane < RW) A.dvv[vb + lane] = __float2bfloat16(pickn(du, lane) * x.w);
        if (lane == 0) reds[warp] = sw;
        __syncthreads();
        for (int i = threadIdx.x; i < 4 * DK; i += kThreads) {
          const int kind = i / DK, c = i % DK;
          float s = 0.f;
          for (int w = 0; w < kNW; ++w) s += red[(w * 4 + kind) * DK + c];
          if (kind == 0)
            A.dq[kb + c] = __float2bfloat16(s);
          else if (kind == 1)
            A.dk[kb + c] = __float2bfloat16(s);
          else if (kind == 2)
            A.dg[kb + c] = s;
          else {
            const float bb = csig(bf(A.bx[kb + c]) + u_s[c]), x2 = s * bb * (1.f - bb);
            A.dbx[kb + c] = __float2bfloat16(x2);
            du_s[c] += x2;
          }
        }
        if (threadIdx.x == 0) {
          float s = 0.f;
          for (int w = 0; w < kNW; ++w) s += reds[w];
          A.dw[hb] = s;
        }
        __syncthreads();
        if (t % kCL == 0) {  // chunk c = t / 64 done: its content gradients
          const float* rec = cont + (t / kCL) * A.cw;
          const float *m = rec, *hh = rec + A.dv;
          for (int r = warp; r < A.rank; r += kNW) {
            float s = 0.f;
            for (int i = lane; i < DK; i += 32)
              s = fmaf(A.U2[(static_cast<int64_t>(h) * DK + i) * A.rank + r], du_s[i], s);
            s = warp_sum1(s);
            if (lane == 0) dh_s[r] = s * (1.f - hh[r] * hh[r]);
          }
          for (int i = threadIdx.x; i < DK * A.rank; i += kThreads)
            dU2[i] = fmaf(du_s[i / A.rank], hh[i % A.rank], dU2[i]);
          __syncthreads();
          for (int i = threadIdx.x; i < A.rank * A.dv; i += kThreads)
            dU1[i] = fmaf(dh_s[i / A.dv], m[i % A.dv], dU1[i]);
          for (int j = threadIdx.x; j < A.dv; j += kThreads) {
            float s = 0.f;
            if (A.content_grad)
              for (int r = 0; r < A.rank; ++r)
                s = fmaf(A.U1[(static_cast<int64_t>(h) * A.rank + r) * A.dv + j], dh_s[r], s);
            dm_s[j] = s * (1.f / kCL);
          }
          for (int i = threadIdx.x; i < DK; i += kThreads) du_s[i] = 0.f;
          __syncthreads();
        }
      }
    }
  }
  if (A.dS0) cstore<DK, RW>(A.dS0 + (bh * A.dv + row0) * DK, lane, dS);
}

// out[i] = Σ_{b < B} part[b·n + i] (fixed order).
__global__ void sum_batch(const float* __restrict__ part, int64_t B, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.f;
    for (int64_t b = 0; b < B; ++b) acc += part[b * n + i];
    out[i] = acc;
  }
}

CArgs make_carve(const DeltaShape& s, const CarveInputs& in, const char* what) {
  if (!wide_carve_shape(s.dk, s.dv))
    throw RuntimeError(std::string(what) + ": dk=" + std::to_string(s.dk) + ", dv=" + std::to_string(s.dv) +
                       " (supported: dk 64 or 128, dv 64 or 128)");
  if (!in.q || !in.k || !in.v || !in.g || !in.bx || !in.w || !in.U1 || !in.U2)
    throw RuntimeError(std::string(what) + ": missing inputs");
  if (in.rank < 1 || in.rank > kCR) throw RuntimeError(std::string(what) + ": rank " + std::to_string(in.rank));
  if (s.B < 1 || s.H < 1 || s.T < 0) throw RuntimeError(std::string(what) + ": bad shape");
  CArgs a;
  a.B = s.B, a.T = s.T, a.H = static_cast<int>(s.H), a.dv = static_cast<int>(s.dv), a.rank = in.rank;
  a.nc = std::max<int64_t>((s.T + kCL - 1) / kCL, 1), a.nseg = (s.T + kSeg - 1) / kSeg;
  a.cw = static_cast<int>(s.dv + kCR + s.dk);
  a.scale = static_cast<float>(s.scale), a.content_grad = in.content_grad;
  a.q = in.q, a.k = in.k, a.v = in.v, a.bx = in.bx, a.g = in.g, a.w = in.w, a.U1 = in.U1, a.U2 = in.U2, a.S0 = in.S0;
  return a;
}

template <int DK, int RW>
void launch_carve_bwd(const CArgs& a, cudaStream_t st) {
  const std::size_t smem = carve_bwd_smem_floats<DK>(a.dv) * sizeof(float);
  LAR_CUDA_CHECK(cudaFuncSetAttribute(wide_carve_bwd_kernel<DK, RW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  wide_carve_bwd_kernel<DK, RW><<<static_cast<unsigned>(a.nbw * a.H), kThreads, smem, st>>>(a);
  LAR_CUDA_LAUNCHED();
}

}  // namespace

bool wide_carve_shape(int64_t dk, int64_t dv) { return (dk == 64 || dk == 128) && (dv == 64 || dv == 128); }

std::size_t wide_carve_boundary_bytes(const DeltaShape& s) {
  const int64_t nseg = std::max<int64_t>((s.T + kSeg - 1) / kSeg, 1);
  return static_cast<std::size_t>(s.B) * s.H * nseg * s.dv * s.dk * sizeof(float);
}

std::size_t wide_carve_content_bytes(const DeltaShape& s) {
  const int64_t nc = std::max<int64_t>((s.T + kCL - 1) / kCL, 1);
  return static_cast<std::size_t>(s.B) * s.H * nc * (s.dv + kCR + s.dk) * sizeof(float);
}

void wide_carve_fwd(const DeltaShape& s, const CarveInputs& in, bf16* o, float* S_out, void* boundary, float* content,
                    cudaStream_t stream) {
  CArgs a = make_carve(s, in, "wide-key carve forward");
  if (!o || !content) throw RuntimeError("wide-key carve forward: missing o or the content workspace");
  a.o = o, a.S_out = S_out, a.ckpt = static_cast<float*>(boundary), a.content = content;
  if (a.T == 0) {
    const std::size_t bytes = static_cast<std::size_t>(a.B) * a.H * a.dv * s.dk * sizeof(float);
    if (S_out) {
      if (in.S0)
        LAR_CUDA_CHECK(cudaMemcpyAsync(S_out, in.S0, bytes, cudaMemcpyDeviceToDevice, stream));
      else
        LAR_CUDA_CHECK(cudaMemsetAsync(S_out, 0, bytes, stream));
    }
    return;
  }
  const unsigned grid = static_cast<unsigned>(a.B * a.H);
  if (s.dk == 128 && s.dv == 128)
    wide_carve_fwd_kernel<128, 8><<<grid, kThreads, 0, stream>>>(a);
  else if (s.dk == 128)
    wide_carve_fwd_kernel<128, 4><<<grid, kThreads, 0, stream>>>(a);
  else if (s.dv == 128)
    wide_carve_fwd_kernel<64, 8><<<grid, kThreads, 0, stream>>>(a);
  else
    wide_carve_fwd_kernel<64, 4><<<grid, kThreads, 0, stream>>>(a);
  LAR_CUDA_LAUNCHED();
}

void wide_carve_bwd(const DeltaShape& s, const CarveInputs& in, const void* boundary, const float* content,
                    const bf16* dout, const float* dST, const CarveGrads& gr, cudaStream_t stream) {
  CArgs a = make_carve(s, in, "wide-key carve backward");
  if (!boundary || !content) throw RuntimeError("wide-key carve backward: the forward kept no boundary or content");
  if (!dout || !gr.dq || !gr.dk || !gr.dv || !gr.dbx || !gr.dg || !gr.dw || !gr.dU1 || !gr.dU2)
    throw RuntimeError("wide-key carve backward: missing dout or a gradient");
  const std::size_t n1 = static_cast<std::size_t>(a.H) * a.rank * a.dv,
                    n2 = static_cast<std::size_t>(a.H) * s.dk * a.rank;
  if (a.T == 0) {
    LAR_CUDA_CHECK(cudaMemsetAsync(gr.dU1, 0, n1 * sizeof(float), stream));
    LAR_CUDA_CHECK(cudaMemsetAsync(gr.dU2, 0, n2 * sizeof(float), stream));
    if (gr.dS0) {
      const std::size_t bytes = static_cast<std::size_t>(a.B) * a.H * a.dv * s.dk * sizeof(float);
      if (dST)
        LAR_CUDA_CHECK(cudaMemcpyAsync(gr.dS0, dST, bytes, cudaMemcpyDeviceToDevice, stream));
      else
        LAR_CUDA_CHECK(cudaMemsetAsync(gr.dS0, 0, bytes, stream));
    }
    return;
  }
  a.ckpt = static_cast<float*>(const_cast<void*>(boundary)), a.content = const_cast<float*>(content);
  a.dout = dout, a.dST = dST, a.dS0 = gr.dS0;
  a.dq = gr.dq, a.dk = gr.dk, a.dvv = gr.dv, a.dbx = gr.dbx, a.dg = gr.dg, a.dw = gr.dw;
  const int64_t nbw = wave_batches(a.B, a.H);
  Scratch sc(stream);
  a.dU1p = sc.get<float>(static_cast<std::size_t>(a.B) * n1);
  a.dU2p = sc.get<float>(static_cast<std::size_t>(a.B) * n2);
  a.scratch = sc.get<float>(static_cast<std::size_t>(nbw) * a.H * (kSlots + kSub) * a.dv * s.dk);
  for (int64_t b0 = 0; b0 < a.B; b0 += nbw) {
    a.b0 = b0, a.nbw = std::min(nbw, a.B - b0);
    if (s.dk == 128 && s.dv == 128)
      launch_carve_bwd<128, 8>(a, stream);
    else if (s.dk == 128)
      launch_carve_bwd<128, 4>(a, stream);
    else if (s.dv == 128)
      launch_carve_bwd<64, 8>(a, stream);
    else
      launch_carve_bwd<64, 4>(a, stream);
  }
  sum_batch<<<grid_for(static_cast<int64_t>(n1)), 256, 0, stream>>>(a.dU1p, a.B, static_cast<int64_t>(n1), gr.dU1);
  LAR_CUDA_LAUNCHED();
  sum_batch<<<grid_for(static_cast<int64_t>(n2)), 256, 0, stream>>>(a.dU2p, a.B, static_cast<int64_t>(n2), gr.dU2);
  LAR_CUDA_LAUNCHED();
}

}  // namespace lar::kernels::cuda::linear
