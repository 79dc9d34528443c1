// The recurrent wide-key kernels of wide_key.hpp for the delta and channel rules: forward (also
// the decode), backward from the 256-token checkpoints, the fixed-order sums of the
// per-value-tile key-side gradients, and the L2 norm of wide heads.
#include "kernels/linear/wide_key.hpp"

#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "core/error.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/linear/scratch.hpp"
#include "kernels/linear/wide_common.cuh"

namespace lar::kernels::cuda::linear {
namespace {

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
