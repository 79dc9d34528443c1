// CARVE (carve_cuda.hpp's wide_carve_fwd / wide_carve_bwd) at dk = 128 or dv = 128: the gdn2 step
// of fwd_step with b_t = σ(bx_t + u_c), u_c = U2 tanh(U1 m_c), z_t = w_t v_t, m_c the mean of the
// outputs over content chunk c − 1 (64 tokens). m_c reads every value row of the head, so one CTA
// holds the whole head (16 warps of dv/16 rows) and the content signal is reduced between two
// block barriers at each chunk start; the forward records (m_c, h_c = tanh(U1 m_c), u_c) per
// chunk for the backward. The backward is wide_bwd_kernel's (checkpoints every 256 tokens,
// sub-checkpoints every 8) with the whole head's key-side sums in the CTA, so it applies
// b(1 − b), sums du_c = Σ_t ∂L/∂(bx + u) over the chunk and, at the chunk's first token, turns
// it into dU2 += du hᵀ, dU1 += dh mᵀ and dm_c (added as dm_c / 64 to the previous chunk's dO when
// content_grad), in the CPU's order (kernels/carve/carve.hpp). dU1, dU2 per sequence, then
// summed over the batch in order: deterministic, no atomics.
#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "core/error.hpp"
#include "kernels/carve/carve_cuda.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/linear/scratch.hpp"
#include "kernels/linear/wide_common.cuh"

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
