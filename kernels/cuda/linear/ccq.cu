// CCQ read correction (SPEC §4, kernels/cpu/linear/ccq.hpp) forward and backward:
//   q_c = q − λ_t r_t,  r_t = (K_t q)/t − m_t (m_tᵀ q)/t²  (centered; uncentered: no m term)
// with the running key statistics K_t = Σ_{j≤t} k_j k_jᵀ, m_t = Σ_{j≤t} k_j (no forgetting).
// The backbone then runs on q_c; its gradient on q_c comes back here as dqc. See
// linear_methods.hpp for the contract.
//
// Same structure as the mixers' chunk kernels (chunk_common.cuh): one CTA of 8 warps per
// (b, h) walks the chunks, the 64×64 statistic K in registers (fp32 fragments), every
// product a 64×64×64 mma.sync GEMM on bf16 shared tiles. Per chunk (rows i, t_i = t_prev+i+1):
//   R = Q K_prev + (Q Kᵀ ⊙ L) K,  M_i = m_prev + Σ_{j≤i} k_j,  r_i = R_i/t_i − M_i (M_iᵀ q_i)/t_i².
// The backward walks the chunks in reverse from the forward's final statistics, peeling
// K_prev = K − Kᵀ_c K_c and m_prev = m − Σ k (fp32, so no per-chunk workspace), and carries
// the gradients on the later chunks' K_prev and m_prev (GK, Gm) as the CPU reference does.
#include <cuda_bf16.h>

#include <string>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/linear/chunk_common.cuh"
#include "kernels/cuda/linear/linear_methods.hpp"

namespace lar::kernels::cuda::linear {
namespace {

struct QParams {
  const bf16 *q, *k, *dqc;
  const float *lam, *K0, *m0;
  bf16 *qc, *dq, *dk;
  float *Kout, *mout, *dlam;
  const float *Kfin, *mfin;
  int B, T, H, nc, centered;
  double t0;  // tokens seen before this call
};

__device__ __forceinline__ size_t qrow(const QParams& p, int b, int t, int h) {
  return ((static_cast<size_t>(b) * p.T + t) * p.H + h) * D;
}

// sM[i][c] = base_c + Σ_{j≤i} K[j][c] (− the column total when sub: base is then the
// statistic after the chunk) (bf16 tile K, fp32 out); returns the column total
// Σ_j K[j][c] to every thread of the quad of column c. Thread (column tid/4, part tid%4)
// scans rows 16·part...
__device__ __forceinline__ float cumsum_k(const bf16* sK, const float* base, float* sM, bool sub) {
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
  const float ex = inc - v[15] + base[c] - (sub ? total : 0.f);
#pragma unroll
  for (int r = 0; r < 16; ++r) sM[(16 * p + r) * LDF + c] = v[r] + ex;
  return total;
}

// ---------------------------------------------------------------- forward
// Q K Ks P (bf16), M (fp32), m ping-pong, row sums of (QKᵀ⊙L) [2][C], mprev·q, λ.
constexpr size_t kQFwdSmem = 4 * TILE * sizeof(bf16) + (TILEF + 2 * C + 2 * C + C + C) * sizeof(float);

__global__ void __launch_bounds__(NT, 1) ccq_fwd_kernel(const QParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + TILE;
  bf16* sKs = sK + TILE;
  bf16* sP = sKs + TILE;
  float* sM = reinterpret_cast<float*>(sP + TILE);
  float* sMv0 = sM + TILEF;
  float* sMv1 = sMv0 + C;
  float* sRow = sMv1 + C;  // [2][C]
  float* sMq = sRow + 2 * C;
  float* sLam = sMq + C;
  const Lane L;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;

  Acc Ks;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) Ks[nt][e] = p.K0 ? p.K0[bh * D * D + L.row(e) * D + L.col(nt, e)] : 0.f;
  if (tid < C) sMv0[tid] = p.m0 ? p.m0[bh * D + tid] : 0.f;

  for (int ci = 0; ci < p.nc; ++ci) {
    float* mcur = (ci & 1) ? sMv1 : sMv0;
    float* mnext = (ci & 1) ? sMv0 : sMv1;
    const int t0 = ci * C, n = min(C, p.T - t0);
    load_tile(sQ, p.q + qrow(p, b, t0, h), stride, n);
    load_tile(sK, p.k + qrow(p, b, t0, h), stride, n);
    cp_async_commit();
    if (tid < C) sLam[tid] = tid < n ? p.lam[(static_cast<size_t>(b) * p.T + t0 + tid) * p.H + h] : 0.f;
    store_bf(sKs, Ks, L, [](float x, int, int) { return x; });
    cp_async_wait<0>();
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
        float x = rs[hh];
        x += __shfl_xor_sync(FULL, x, 1);
        x += __shfl_xor_sync(FULL, x, 2);
        if (L.tig == 0) sRow[L.wn * C + L.row(2 * hh)] = x;
      }
    }
    {
      const float tot = cumsum_k(sK, mcur, sM, false);
      if ((tid & 3) == 0) mnext[tid >> 2] = mcur[tid >> 2] + tot;
      const int r = tid >> 2, part = tid & 3;  // m_prevᵀ q_r
      float x = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) x += mcur[16 * part + j] * bf(sQ, r, 16 * part + j);
      x += __shfl_xor_sync(FULL, x, 1);
      x += __shfl_xor_sync(FULL, x, 2);
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
    gemm<true, true>(Ks, sK, sK, L);
    __syncthreads();
  }
  if (p.Kout)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) p.Kout[bh * D * D + L.row(e) * D + L.col(nt, e)] = Ks[nt][e];
  if (p.mout && tid < C) p.mout[bh * D + tid] = ((p.nc & 1) ? sMv1 : sMv0)[tid];
}

// ---------------------------------------------------------------- backward
// Q K G(dqc) Ks S1 dA S2 GK (bf16), M, dM (fp32), m and Gm ping-pong, mq, mg, dλ partials, λ.
constexpr size_t kQBwdSmem = 8 * TILE * sizeof(bf16) + (2 * TILEF + 4 * C + C + C + 2 * C + C) * sizeof(float);

__global__ void __launch_bounds__(NT, 1) ccq_bwd_kernel(const QParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + TILE;
  bf16* sG = sK + TILE;
  bf16* sKs = sG + TILE;
  bf16* sS1 = sKs + TILE;
  bf16* sdA = sS1 + TILE;
  bf16* sS2 = sdA + TILE;
  bf16* sGK = sS2 + TILE;
  float* sM = reinterpret_cast<float*>(sGK + TILE);
  float* sDM = sM + TILEF;
  float* sMv0 = sDM + TILEF;
  float* sMv1 = sMv0 + C;
  float* sGm0 = sMv1 + C;
  float* sGm1 = sGm0 + C;
  float* sMq = sGm1 + C;
  float* sMg = sMq + C;
  float* sDl = sMg + C;  // [2][C]
  float* sLam = sDl + 2 * C;
  const Lane L;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const size_t bh = static_cast<size_t>(b) * p.H + h, stride = static_cast<size_t>(p.H) * D;

  Acc Kc, GK;  // statistic at the end of the chunk (peeled to its start), gradient on later K_prev
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) Kc[nt][e] = p.Kfin[bh * D * D + L.row(e) * D + L.col(nt, e)], GK[nt][e] = 0.f;
  if (tid < C) sMv0[tid] = p.mfin[bh * D + tid], sGm0[tid] = 0.f;

  for (int ci = p.nc - 1, it = 0; ci >= 0; --ci, ++it) {
    float* mcur = (it & 1) ? sMv1 : sMv0;
    float* mprev = (it & 1) ? sMv0 : sMv1;
    float* gmcur = (it & 1) ? sGm1 : sGm0;
    float* gmnext = (it & 1) ? sGm0 : sGm1;
    const int t0 = ci * C, n = min(C, p.T - t0);
    load_tile(sQ, p.q + qrow(p, b, t0, h), stride, n);
    load_tile(sK, p.k + qrow(p, b, t0, h), stride, n);
    load_tile(sG, p.dqc + qrow(p, b, t0, h), stride, n);
    cp_async_commit();
    if (tid < C) sLam[tid] = tid < n ? p.lam[(static_cast<size_t>(b) * p.T + t0 + tid) * p.H + h] : 0.f;
    store_bf(sGK, GK, L, [](float x, int, int) { return x; });
    cp_async_wait<0>();
    __syncthreads();
    // phase A: K_prev = K − Kᵀ K (→ Ks), S1 = (Q Kᵀ) ⊙ L, M = m_prev + cumsum k, dA = −λ g / t
    {
      Acc a, s1;
      zero(a);
      zero(s1);
      gemm2<true, true, false, false>(a, sK, sK, s1, sQ, sK, L);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) Kc[nt][e] -= a[nt][e];
      store_bf(sKs, Kc, L, [](float x, int, int) { return x; });
      store_bf(sS1, s1, L, [](float x, int i, int j) { return i >= j ? x : 0.f; });
    }
    {
      const float tot = cumsum_k(sK, mcur, sM, true);
      if ((tid & 3) == 0) mprev[tid >> 2] = mcur[tid >> 2] - tot;
    }
    for (int i = tid; i < C * 32; i += NT) {
      const int t = i >> 5, c = 2 * (i & 31);
      const float f = -sLam[t] / static_cast<float>(p.t0 + t0 + t + 1);
      *reinterpret_cast<uint32_t*>(sdA + t * LD + c) = pack(f * bf(sG, t, c), f * bf(sG, t, c + 1));
    }
    __syncthreads();
    // phase B: R = Q K_prev + S1 K; mq = Mᵀq, mg = Mᵀg row by row
    Acc R;
    zero(R);
    gemm<false, false>(R, sQ, sKs, L);
    gemm<false, true>(R, sS1, sK, L);
    {
      const int r = tid >> 2, part = tid & 3;
      float x = 0.f, y = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float mm = sM[r * LDF + 16 * part + j];
        x += mm * bf(sQ, r, 16 * part + j);
        y += mm * bf(sG, r, 16 * part + j);
      }
      x += __shfl_xor_sync(FULL, x, 1);
      x += __shfl_xor_sync(FULL, x, 2);
      y += __shfl_xor_sync(FULL, y, 1);
      y += __shfl_xor_sync(FULL, y, 2);
      if (part == 0) sMq[r] = x, sMg[r] = y;
    }
    __syncthreads();
    // phase C: dλ partials, S2 = (dA Kᵀ) ⊙ L, dq = dA K_prev, GK += dAᵀ Q, dM (reverse cumsum + Gm)
    {
      float dl[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = L.row(e), a = L.col(nt, e);
          const float inv = 1.f / static_cast<float>(p.t0 + t0 + i + 1);
          float r = R[nt][e] * inv;
          if (p.centered) r -= sM[i * LDF + a] * sMq[i] * inv * inv;
          dl[e >> 1] += bf(sG, i, a) * r;
        }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float x = dl[hh];
        x += __shfl_xor_sync(FULL, x, 1);
        x += __shfl_xor_sync(FULL, x, 2);
        if (L.tig == 0) sDl[L.wn * C + L.row(2 * hh)] = x;
      }
    }
    Acc dq;
    {
      Acc s2;
      zero(s2);
      zero(dq);
      gemm2<false, false, false, false>(s2, sdA, sK, dq, sdA, sKs, L);
      store_bf(sS2, s2, L, [](float x, int i, int j) { return i >= j ? x : 0.f; });
    }
    gemm<true, true>(GK, sdA, sQ, L);
    {  // dM_i = (λ g mq − q mdr)/t², mdr = −λ mg; then suffix sums per column, + Gm
      const int c = tid >> 2, part = tid & 3;
      float v[16];
#pragma unroll
      for (int rr = 15; rr >= 0; --rr) {
        const int i = 16 * part + rr;
        const float inv = 1.f / static_cast<float>(p.t0 + t0 + i + 1), lam = sLam[i];
        const float x = p.centered ? (lam * bf(sG, i, c) * sMq[i] + bf(sQ, i, c) * lam * sMg[i]) * inv * inv : 0.f;
        v[rr] = x + (rr < 15 ? v[rr + 1] : 0.f);
      }
      float inc = v[0];
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        const float y = __shfl_down_sync(FULL, inc, o);
        if (part + o < 4) inc += y;
      }
      const float total = __shfl_sync(FULL, inc, (threadIdx.x & 31) & ~3);
      const float ex = inc - v[0] + gmcur[c];
#pragma unroll
      for (int rr = 0; rr < 16; ++rr) sDM[(16 * part + rr) * LDF + c] = v[rr] + ex;
      if (part == 0) gmnext[c] = gmcur[c] + total;
    }
    __syncthreads();
    // phase D: dq += S2 K, + g − M mdr/t²; dk += S2ᵀ Q + S1ᵀ dA + K (GK + GKᵀ) + dM sums
    gemm<false, true>(dq, sS2, sK, L);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = L.row(2 * hh), a = L.col(nt, 0);
        if (i >= n) continue;
        const float inv = 1.f / static_cast<float>(p.t0 + t0 + i + 1);
        const float mdr = -sLam[i] * sMg[i];
        float d0 = dq[nt][2 * hh] + bf(sG, i, a), d1 = dq[nt][2 * hh + 1] + bf(sG, i, a + 1);
        if (p.centered) {
          d0 -= sM[i * LDF + a] * mdr * inv * inv;
          d1 -= sM[i * LDF + a + 1] * mdr * inv * inv;
        }
        *reinterpret_cast<uint32_t*>(p.dq + qrow(p, b, t0 + i, h) + a) = pack(d0, d1);
      }
    {
      Acc dk;
      zero(dk);
      gemm<true, true>(dk, sS2, sQ, L);
      gemm<true, true>(dk, sS1, sdA, L);
      gemm<false, true>(dk, sK, sGK, L);
      gemm<false, false>(dk, sK, sGK, L);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int j = L.row(2 * hh), a = L.col(nt, 0);
          if (j >= n) continue;
          uint32_t* dst = reinterpret_cast<uint32_t*>(p.dk + qrow(p, b, t0 + j, h) + a);
          const __nv_bfloat162 old = *reinterpret_cast<const __nv_bfloat162*>(dst);
          *dst = pack(__low2float(old) + dk[nt][2 * hh] + sDM[j * LDF + a],
                      __high2float(old) + dk[nt][2 * hh + 1] + sDM[j * LDF + a + 1]);
        }
    }
    if (tid < C && tid < n)
      p.dlam[(static_cast<size_t>(b) * p.T + t0 + tid) * p.H + h] = -(sDl[tid] + sDl[C + tid]);
    __syncthreads();
  }
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
  return p;
}

template <class K>
void qlaunch(K kernel, size_t smem, const QParams& p, cudaStream_t stream) {
  LAR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<dim3(p.H, p.B), NT, smem, stream>>>(p);
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
  qlaunch(ccq_fwd_kernel, kQFwdSmem, p, stream);
}

void ccq_bwd(const DeltaShape& s, const CcqInputs& in, const CcqStats& fin, const __nv_bfloat16* dqc,
             __nv_bfloat16* dq, __nv_bfloat16* dk, float* dlambda, cudaStream_t stream) {
  QParams p = make_qparams(s, "ccq_bwd");
  if (!in.q || !in.k || !in.lambda || !fin.K || !fin.m || !dqc || !dq || !dk || !dlambda)
    throw RuntimeError("ccq_bwd: q, k, lambda, the final statistics, dqc, dq, dk and dlambda are required");
  if (dq == dqc) throw RuntimeError("ccq_bwd: dq must not alias dqc");
  p.q = in.q, p.k = in.k, p.lam = in.lambda, p.centered = in.centered ? 1 : 0, p.t0 = static_cast<double>(in.t0);
  p.Kfin = fin.K, p.mfin = fin.m, p.dqc = dqc, p.dq = dq, p.dk = dk, p.dlam = dlambda;
  qlaunch(ccq_bwd_kernel, kQBwdSmem, p, stream);
}

}  // namespace lar::kernels::cuda::linear
