// CCQ's read correction at key heads of 128 and 256 (ccq_cuda.hpp's wide_ccq_fwd / wide_ccq_bwd)
// on the recurrent wide-key layout of kernels/linear/wide_common.cuh.
#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "core/error.hpp"
#include "kernels/ccq/ccq_cuda.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/linear/scratch.hpp"
#include "kernels/linear/wide_common.cuh"
#include "kernels/linear/wide_key.hpp"

namespace lar::kernels::cuda::linear {
namespace {

// ---- CCQ (kernels/ccq/ccq.hpp) at dk ∈ {128, 256}: the key statistics K = Σ k kᵀ are a
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
