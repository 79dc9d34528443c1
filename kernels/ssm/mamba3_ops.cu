// The Mamba-3 layer's own elementwise and per-token passes: see mamba3_ops.hpp. Memory-bound
// and simple: a thread per (token, head) for the scalars, a thread per (sequence, head, pair)
// for the angles' cumulative sums (in token order, as the CPU), a warp per (token, head) for
// the diagonal, the output maps and their backward (the R rows of q and k in registers, lane
// l holding the rotated pairs l + 32m, so a rotation never crosses lanes), a warp per
// normalised row for the RMSNorms' backward. The queries and keys the diagonal uses are
// recomputed in fp32 from the projections (the kernel reads them in bf16). No atomics: every
// output is written by one thread, every sum runs in a fixed order.
#include <cuda_bf16.h>

#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/ssm/mamba3_ops.hpp"
#include "kernels/ssm/supports.hpp"
#include "kernels/linear/op_common.cuh"

namespace lar::kernels::cuda::linear {
namespace {

using op_common::blocks_for;
using op_common::from_f;
using op_common::to_f;
using op_common::warp_sum;

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr float kPi = 3.14159265358979323846f;
constexpr float kAFloor = 1e-4f;  // as the CPU: A = min(−softplus(a), −1e-4)

// as the CPU's ssm helpers (expf, not __expf)
__device__ __forceinline__ float sigm(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float silu(float x) { return x * sigm(x); }
__device__ __forceinline__ float silu_grad(float x) {
  const float s = sigm(x);
  return s * (1.f + x * (1.f - s));
}
// An entry of m_x, m_z or m_o [H, R, Pd]; 1 in the SISO form (no maps).
__device__ __forceinline__ float map_at(const float* m, const Mamba3Args& a, int h, int r, int p) {
  return m ? m[((int64_t)h * a.R + r) * a.Pd + p] : 1.f;
}
__device__ __forceinline__ int64_t warp_id() { return ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__host__ __device__ __forceinline__ int64_t di(const Mamba3Args& a) { return (int64_t)a.H * a.Pd; }

void require(bool ok, const std::string& what) {
  if (!ok) throw RuntimeError("mamba3 ops: " + what);
}

// q̂ (is_q) or k̂ of rank row r, token n, head h: RMSNorm(C or B)·w + bias, rotated by φ
// over the first na pairs, fp32. Lane l holds pairs j = l + 32m (m < NP): y[2m], y[2m+1]
// are channels 2j, 2j+1. raw (nullable) gets the unnormalised inputs, rs their rstd.
template <int NP, class TA>
__device__ void load_rot(const Mamba3Args& a, int64_t n, int h, int r, int lane, bool is_q, float (&y)[2 * NP]) {
  const int RGN = a.R * a.G * a.S, grp = h / (a.H / a.G);
  const TA* src =
      static_cast<const TA*>(a.P) + n * a.ldp + 2 * di(a) + (is_q ? RGN : 0) + (int64_t)(r * a.G + grp) * a.S;
  const float* w = is_q ? a.nC : a.nB;
  const float* bias = (is_q ? a.bC : a.bB) + ((int64_t)h * a.R + r) * a.S;
  float ss = 0.f;
#pragma unroll
  for (int m = 0; m < NP; ++m) {
    const int j = lane + 32 * m;
    const float x0 = to_f(src[2 * j]), x1 = to_f(src[2 * j + 1]);
    y[2 * m] = x0;
    y[2 * m + 1] = x1;
    ss += x0 * x0 + x1 * x1;
  }
  ss = warp_sum(ss);
  const float rs = 1.f / sqrtf(ss / static_cast<float>(a.S) + a.eps);
  const float* ph = a.phi + ((int64_t)n * a.H + h) * a.na;
#pragma unroll
  for (int m = 0; m < NP; ++m) {
    const int j = lane + 32 * m;
    const float a0 = y[2 * m] * rs * w[2 * j] + bias[2 * j];
    const float a1 = y[2 * m + 1] * rs * w[2 * j + 1] + bias[2 * j + 1];
    if (j < a.na) {
      const float c = cosf(ph[j]), s = sinf(ph[j]);
      y[2 * m] = a0 * c - a1 * s;
      y[2 * m + 1] = a0 * s + a1 * c;
    } else {
      y[2 * m] = a0;
      y[2 * m + 1] = a1;
    }
  }
}

// ---------------------------------------------------------------- forward
// Per (token, head): Δ, A, λ, β' = (1 − λ_{t+1})Δ_{t+1} (0 at the sequence's last token), c = λΔ + β'.
__global__ void scalars_fwd_kernel(Mamba3Args a) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, NH = a.B * a.T * a.H;
  if (idx >= NH) return;
  const int64_t n = idx / a.H;
  const int h = static_cast<int>(idx % a.H);
  const int64_t t = n % a.T;
  const float* pg = a.Pg + n * a.ldg;
  const float dt = softplus(pg[h] + a.dt_bias[h]);
  const float A = fminf(-softplus(pg[a.H + h]), -kAFloor);
  const float lam = sigm(pg[2 * a.H + h]);
  float bn = 0.f;
  if (t + 1 < a.T) {
    const float* pg1 = pg + a.ldg;
    bn = (1.f - sigm(pg1[2 * a.H + h])) * softplus(pg1[h] + a.dt_bias[h]);
  }
  a.dt[idx] = dt;
  a.A[idx] = A;
  a.lam[idx] = lam;
  a.bnext[idx] = bn;
  a.cw[idx] = lam * dt + bn;
}

// φ_t = Σ_{s≤t} θ_s Δ_s, θ = π·tanh(angle), per (sequence, head, pair) in token order.
__global__ void phi_kernel(Mamba3Args a) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= a.B * a.H * a.na) return;
  const int j = static_cast<int>(idx % a.na);
  const int64_t bh = idx / a.na, b = bh / a.H;
  const int h = static_cast<int>(bh % a.H);
  float ph = 0.f;
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t n = b * a.T + t;
    const float th = kPi * tanhf(a.Pg[n * a.ldg + 3 * a.H + j]);
    ph = ph + th * a.dt[n * a.H + h];
    a.phi[(n * a.H + h) * a.na + j] = ph;
  }
}

// A warp per kernel row ((n·R + r)·H + h): q, k, the written value c·(x ⊙ m_x) and the gate.
template <int NP, class TA>
__global__ void prepare_kernel(Mamba3Args a, bf16* q, bf16* k, bf16* v, float* g) {
  const int64_t row = warp_id();
  if (row >= a.B * a.T * a.R * a.H) return;
  const int lane = threadIdx.x & 31;
  const int h = static_cast<int>(row % a.H);
  const int64_t nr = row / a.H, n = nr / a.R;
  const int r = static_cast<int>(nr % a.R);
  float qv[2 * NP], kv[2 * NP];
  load_rot<NP, TA>(a, n, h, r, lane, true, qv);
  load_rot<NP, TA>(a, n, h, r, lane, false, kv);
#pragma unroll
  for (int m = 0; m < NP; ++m) {
    const int64_t c = row * a.S + 2 * (lane + 32 * m);
    q[c] = __float2bfloat16(qv[2 * m]);
    q[c + 1] = __float2bfloat16(qv[2 * m + 1]);
    k[c] = __float2bfloat16(kv[2 * m]);
    k[c + 1] = __float2bfloat16(kv[2 * m + 1]);
  }
  const int64_t nh = n * a.H + h;
  const float cw = a.cw[nh];
  const TA* x = static_cast<const TA*>(a.P) + n * a.ldp + di(a) + (int64_t)h * a.Pd;
  for (int p = lane; p < a.Pd; p += 32)
    v[row * a.Pd + p] = __float2bfloat16(cw * (to_f(x[p]) * map_at(a.mx, a, h, r, p)));
  const float gv = r == 0 ? a.A[nh] * a.dt[nh] : 0.f;
  for (int i = lane; i < a.S; i += 32) g[row * a.S + i] = gv;
}

// The R rows of q and k of (n, h) and their R×R dot products (every lane gets them).
template <int R, int NP, class TA>
__device__ void load_token(const Mamba3Args& a, int64_t n, int h, int lane, float (&q)[R][2 * NP],
                           float (&k)[R][2 * NP], float (&qk)[R][R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    load_rot<NP, TA>(a, n, h, r, lane, true, q[r]);
    load_rot<NP, TA>(a, n, h, r, lane, false, k[r]);
  }
#pragma unroll
  for (int ro = 0; ro < R; ++ro)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
#pragma unroll
      for (int c = 0; c < 2 * NP; ++c) s += q[ro][c] * k[r][c];
      qk[ro][r] = warp_sum(s);
    }
}

// u_{r'} = o_{r'} + Σ_r (c·[r > r'] − β')(q_{r'}·k_r) v_r + D v_{r'} at channel p.
template <int R>
__device__ __forceinline__ void token_u(const Mamba3Args& a, const bf16* o, int64_t n, int h, int p, float cw, float bn,
                                        float Dh, const float (&qk)[R][R], const float (&v)[R], float (&u)[R]) {
#pragma unroll
  for (int ro = 0; ro < R; ++ro) {
    float acc = __bfloat162float(o[((n * R + ro) * a.H + h) * a.Pd + p]);
#pragma unroll
    for (int r = 0; r < R; ++r) acc += ((r > ro ? cw : 0.f) - bn) * qk[ro][r] * v[r];
    u[ro] = acc + Dh * v[ro];
  }
}

template <int R, int NP, class TA>
__global__ void out_fwd_kernel(Mamba3Args a, const bf16* o, TA* ypre) {
  const int64_t w = warp_id();
  if (w >= a.B * a.T * a.H) return;
  const int lane = threadIdx.x & 31;
  const int64_t n = w / a.H;
  const int h = static_cast<int>(w % a.H);
  float q[R][2 * NP], k[R][2 * NP], qk[R][R];
  load_token<R, NP, TA>(a, n, h, lane, q, k, qk);
  const float cw = a.cw[w], bn = a.bnext[w], Dh = a.D[h];
  const TA* P = static_cast<const TA*>(a.P) + n * a.ldp;
  for (int p = lane; p < a.Pd; p += 32) {
    const int64_t col = (int64_t)h * a.Pd + p;
    const float xv = to_f(P[di(a) + col]), zv = to_f(P[col]);
    float v[R], u[R];
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = xv * map_at(a.mx, a, h, r, p);
    token_u<R>(a, o, n, h, p, cw, bn, Dh, qk, v, u);
    float y = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) y += map_at(a.mo, a, h, r, p) * u[r] * silu(zv * map_at(a.mz, a, h, r, p));
    ypre[n * di(a) + col] = from_f<TA>(y);
  }
}

// ---------------------------------------------------------------- backward
template <int R, int NP, class TA>
__global__ void out_bwd_kernel(Mamba3Args a, const bf16* o, const TA* dyv, float* du, bf16* dO, TA* dP, float* dterm,
                               float* tmo, float* tmz, TA* ypre) {
  const int64_t w = warp_id();
  if (w >= a.B * a.T * a.H) return;
  const int lane = threadIdx.x & 31;
  const int64_t n = w / a.H;
  const int h = static_cast<int>(w % a.H);
  float q[R][2 * NP], k[R][2 * NP], qk[R][R];
  load_token<R, NP, TA>(a, n, h, lane, q, k, qk);
  const float cw = a.cw[w], bn = a.bnext[w], Dh = a.D[h];
  const TA* P = static_cast<const TA*>(a.P) + n * a.ldp;
  const int64_t hrp = (int64_t)a.H * a.R * a.Pd;
  float dD = 0.f;
  for (int p = lane; p < a.Pd; p += 32) {
    const int64_t col = (int64_t)h * a.Pd + p;
    const float xv = to_f(P[di(a) + col]), zv = to_f(P[col]), g = to_f(dyv[n * di(a) + col]);
    float v[R], u[R];
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = xv * map_at(a.mx, a, h, r, p);
    token_u<R>(a, o, n, h, p, cw, bn, Dh, qk, v, u);
    float dz = 0.f, y = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float mz = map_at(a.mz, a, h, r, p), mo = map_at(a.mo, a, h, r, p), zr = zv * mz, s = silu(zr);
      const float dzr = g * mo * u[r] * silu_grad(zr);
      dz += dzr * mz;
      if (tmo) {
        const int64_t t = n * hrp + ((int64_t)h * a.R + r) * a.Pd + p;
        tmo[t] = g * u[r] * s;
        tmz[t] = dzr * zv;
      }
      const float d = g * mo * s;
      const int64_t i = ((n * R + r) * a.H + h) * a.Pd + p;
      du[i] = d;
      dO[i] = __float2bfloat16(d);
      dD += d * v[r];
      y += mo * u[r] * s;
    }
    dP[n * a.ldp + col] = from_f<TA>(dz);
    if (ypre) ypre[n * di(a) + col] = from_f<TA>(y);
  }
  dD = warp_sum(dD);
  if (lane == 0) dterm[w] = dD;
}

template <int R, int NP, class TA>
__global__ void core_bwd_kernel(Mamba3Args a, const float* du, Mamba3CoreGrads g, TA* dP) {
  const int64_t w = warp_id();
  if (w >= a.B * a.T * a.H) return;
  const int lane = threadIdx.x & 31;
  const int64_t n = w / a.H;
  const int h = static_cast<int>(w % a.H);
  float q[R][2 * NP], k[R][2 * NP], qk[R][R];
  load_token<R, NP, TA>(a, n, h, lane, q, k, qk);
  const float cw = a.cw[w], bn = a.bnext[w], Dh = a.D[h];
  const TA* P = static_cast<const TA*>(a.P) + n * a.ldp;
  auto rowi = [&](int r) { return (n * R + r) * a.H + h; };
  // dov[r'][r] = dO_{r'}·v_r, dcv = Σ_r dz_r·v_r (dz: the gradient on the written value c·v)
  float dov[R][R], dcv = 0.f;
#pragma unroll
  for (int ro = 0; ro < R; ++ro)
#pragma unroll
    for (int r = 0; r < R; ++r) dov[ro][r] = 0.f;
  for (int p = lane; p < a.Pd; p += 32) {
    const float xv = to_f(P[di(a) + (int64_t)h * a.Pd + p]);
    float v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = xv * map_at(a.mx, a, h, r, p);
#pragma unroll
    for (int ro = 0; ro < R; ++ro) {
      const float d = du[rowi(ro) * a.Pd + p];
#pragma unroll
      for (int r = 0; r < R; ++r) dov[ro][r] += d * v[r];
    }
#pragma unroll
    for (int r = 0; r < R; ++r) dcv += __bfloat162float(g.dv[rowi(r) * a.Pd + p]) * v[r];
  }
  float wgt[R][R], dc = warp_sum(dcv), dbn = 0.f;
#pragma unroll
  for (int ro = 0; ro < R; ++ro)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      dov[ro][r] = warp_sum(dov[ro][r]);
      wgt[ro][r] = (r > ro ? cw : 0.f) - bn;
      if (r > ro) dc += qk[ro][r] * dov[ro][r];
      dbn -= qk[ro][r] * dov[ro][r];
    }
  // the values: dv_r = D dO_r + Σ_{r'} w(r', r)(q_{r'}·k_r) dO_{r'} + c dz_r, then x and m_x
  const int64_t hrp = (int64_t)a.H * a.R * a.Pd;
  for (int p = lane; p < a.Pd; p += 32) {
    const int64_t col = (int64_t)h * a.Pd + p;
    const float xv = to_f(P[di(a) + col]);
    float d[R];
#pragma unroll
    for (int r = 0; r < R; ++r) d[r] = du[rowi(r) * a.Pd + p];
    float dx = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float hdv = Dh * d[r] + cw * __bfloat162float(g.dv[rowi(r) * a.Pd + p]);
#pragma unroll
      for (int ro = 0; ro < R; ++ro) hdv += wgt[ro][r] * qk[ro][r] * d[ro];
      dx += hdv * map_at(a.mx, a, h, r, p);
      if (g.tmx) g.tmx[n * hrp + ((int64_t)h * a.R + r) * a.Pd + p] = hdv * xv;
    }
    dP[n * a.ldp + di(a) + col] = from_f<TA>(dx);
  }
  // the keys and queries: the kernel's gradients plus the diagonal's, then the rotation
  const float* ph = a.phi + w * a.na;
  float dph[NP];
#pragma unroll
  for (int m = 0; m < NP; ++m) dph[m] = 0.f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < NP; ++m) {
      const int j = lane + 32 * m;
      float gq[2], gk[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 2 * m + e;
        const int64_t ch = rowi(r) * a.S + 2 * j + e;
        gq[e] = __bfloat162float(g.dq[ch]);
        gk[e] = __bfloat162float(g.dk[ch]);
#pragma unroll
        for (int r2 = 0; r2 < R; ++r2) {
          gq[e] += wgt[r][r2] * dov[r][r2] * k[r2][c];  // q_r is query row r' = r
          gk[e] += wgt[r2][r] * dov[r2][r] * q[r2][c];  // k_r is key row r
        }
      }
      float xq0 = gq[0], xq1 = gq[1], xk0 = gk[0], xk1 = gk[1];
      if (j < a.na) {
        const float cs = cosf(ph[j]), sn = sinf(ph[j]);
        dph[m] += gq[0] * -q[r][2 * m + 1] + gq[1] * q[r][2 * m];
        dph[m] += gk[0] * -k[r][2 * m + 1] + gk[1] * k[r][2 * m];
        xq0 = gq[0] * cs + gq[1] * sn;
        xq1 = -gq[0] * sn + gq[1] * cs;
        xk0 = gk[0] * cs + gk[1] * sn;
        xk1 = -gk[0] * sn + gk[1] * cs;
      }
      const int64_t o = ((n * a.H + h) * a.R + r) * a.S + 2 * j;
      g.dQh[o] = xq0;
      g.dQh[o + 1] = xq1;
      g.dKh[o] = xk0;
      g.dKh[o + 1] = xk1;
    }
  }
#pragma unroll
  for (int m = 0; m < NP; ++m) {
    const int j = lane + 32 * m;
    if (j < a.na) g.dphi[w * a.na + j] = dph[m];
  }
  // the log decay sits on the token's first row: its gradient summed over the key channels
  float dg = 0.f;
  for (int i = lane; i < a.S; i += 32) dg += g.dg[rowi(0) * a.S + i];
  dg = warp_sum(dg);
  if (lane == 0) {
    g.dc[w] = dc;
    g.dbn[w] = dbn;
    g.dadt[w] = dg;
  }
}

// A warp per normalised row (n, r, g) of B (k̂) and of C (q̂).
template <int NP, class TA>
__global__ void norm_bwd_kernel(Mamba3Args a, const float* dQh, const float* dKh, TA* dP, float* tnB, float* tnC) {
  const int64_t row = warp_id();
  if (row >= a.B * a.T * a.R * a.G) return;
  const int lane = threadIdx.x & 31;
  const int grp = static_cast<int>(row % a.G);
  const int64_t nr = row / a.G, n = nr / a.R;
  const int r = static_cast<int>(nr % a.R), hpg = a.H / a.G, RGN = a.R * a.G * a.S;
  constexpr int kC = 2 * NP;  // channels per lane: lane + 32c
  for (int which = 0; which < 2; ++which) {
    const bool is_q = which == 1;
    const int64_t off = n * a.ldp + 2 * di(a) + (is_q ? RGN : 0) + (int64_t)(r * a.G + grp) * a.S;
    const TA* src = static_cast<const TA*>(a.P) + off;
    const float* wn = is_q ? a.nC : a.nB;
    const float* dsrc = is_q ? dQh : dKh;
    float x[kC], dn[kC], ss = 0.f, dot = 0.f;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int i = lane + 32 * c;
      x[c] = to_f(src[i]);
      ss += x[c] * x[c];
      float s = 0.f;
      for (int hh = grp * hpg; hh < (grp + 1) * hpg; ++hh) s += dsrc[((n * a.H + hh) * a.R + r) * a.S + i];
      dn[c] = s;
      dot += s * wn[i] * x[c];
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    const float rs = 1.f / sqrtf(ss / static_cast<float>(a.S) + a.eps);
    float* tn = is_q ? tnC : tnB;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int i = lane + 32 * c;
      dP[off + i] = from_f<TA>(rs * dn[c] * wn[i] - x[c] * rs * rs * rs * dot / static_cast<float>(a.S));
      tn[row * a.S + i] = dn[c] * x[c] * rs;
    }
  }
}

// The reverse cumulative sum of dφ per (sequence, head, pair), in place.
__global__ void phi_bwd_kernel(Mamba3Args a, float* dphi) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= a.B * a.H * a.na) return;
  const int j = static_cast<int>(idx % a.na);
  const int64_t bh = idx / a.na, b = bh / a.H;
  const int h = static_cast<int>(bh % a.H);
  float cum = 0.f;
  for (int64_t t = a.T - 1; t >= 0; --t) {
    const int64_t i = ((b * a.T + t) * a.H + h) * a.na + j;
    cum += dphi[i];
    dphi[i] = cum;
  }
}

// A thread per (token, column c < H + na): the dt, a and trap pre-activations' gradients of
// head c, or the angle's of pair c − H.
__global__ void scalars_bwd_kernel(Mamba3Args a, const float* cum, const float* dc, const float* dbn, const float* dadt,
                                   float* dPg) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, W = a.H + a.na;
  if (idx >= a.B * a.T * W) return;
  const int64_t n = idx / W;
  const int c = static_cast<int>(idx % W);
  const float* pg = a.Pg + n * a.ldg;
  float* out = dPg + n * a.ldg;
  if (c < a.H) {
    const int h = c;
    const int64_t i = n * a.H + h, t = n % a.T;
    const float dt = a.dt[i], lam = a.lam[i];
    // c_t = λ_t Δ_t + β'_{t+1};  β'_t = (1 − λ_t) Δ_t (its gradient from token t − 1); a = AΔ
    float dDT = dc[i] * lam + dadt[i] * a.A[i], dlam = dc[i] * dt;
    for (int j = 0; j < a.na; ++j) dDT += cum[i * a.na + j] * (kPi * tanhf(pg[3 * a.H + j]));
    if (t > 0) {
      const float dbp = dc[i - a.H] + dbn[i - a.H];
      dlam -= dbp * dt;
      dDT += dbp * (1.f - lam);
    }
    out[h] = dDT * sigm(pg[h] + a.dt_bias[h]);
    const bool clamped = -softplus(pg[a.H + h]) > -kAFloor;
    out[a.H + h] = clamped ? 0.f : -dadt[i] * dt * sigm(pg[a.H + h]);
    out[2 * a.H + h] = dlam * lam * (1.f - lam);
  } else {
    const int j = c - a.H;
    float dth = 0.f;
    for (int h = 0; h < a.H; ++h) dth += cum[(n * a.H + h) * a.na + j] * a.dt[n * a.H + h];
    const float th = tanhf(pg[3 * a.H + j]);
    out[3 * a.H + j] = dth * kPi * (1.f - th * th);
  }
}

// ---------------------------------------------------------------- decode
// One CTA per (sequence, head) of a single token: the scalars, the angles' update and the R
// rows of q, k (warps r < R, fp32 in shared memory), then a warp per value row p of the state
// (lanes over the key channels): S_p ← α S_p + β Σ_r v_prev,r[p] k_prev,r + γ Σ_r v_r[p] k_r,
// o_r[p] = S_p·q_r, and the output maps at p. k_prev is read into shared memory before any
// warp overwrites it; v_prev[r][p] is read and written by row p's warp only.
template <int R, int NP, class TA>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(Mamba3Args a, float* phi, float* S, float* kprev, float* vprev, TA* ypre) {
  constexpr int kS = 64 * NP;  // the state size
  __shared__ float qs[R][kS], ks[R][kS], kps[R][kS];
  const int64_t bh = blockIdx.x, b = bh / a.H;
  const int h = static_cast<int>(bh % a.H);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* pg = a.Pg + b * a.ldg;
  const float dt = softplus(pg[h] + a.dt_bias[h]);
  const float A = fminf(-softplus(pg[a.H + h]), -kAFloor);
  const float lam = sigm(pg[2 * a.H + h]);
  for (int j = tid; j < a.na; j += blockDim.x) phi[bh * a.na + j] += kPi * tanhf(pg[3 * a.H + j]) * dt;
  for (int i = tid; i < R * kS; i += blockDim.x) kps[i / kS][i % kS] = kprev[bh * R * kS + i];
  __syncthreads();  // φ (global) and k_prev visible to the block
  if (warp < R) {
    float y[2 * NP];
    load_rot<NP, TA>(a, b, h, warp, lane, true, y);
#pragma unroll
    for (int m = 0; m < NP; ++m) {
      const int j = lane + 32 * m;
      qs[warp][2 * j] = y[2 * m];
      qs[warp][2 * j + 1] = y[2 * m + 1];
    }
    load_rot<NP, TA>(a, b, h, warp, lane, false, y);
#pragma unroll
    for (int m = 0; m < NP; ++m) {
      const int j = lane + 32 * m;
      ks[warp][2 * j] = y[2 * m];
      ks[warp][2 * j + 1] = y[2 * m + 1];
      kprev[(bh * R + warp) * kS + 2 * j] = y[2 * m];
      kprev[(bh * R + warp) * kS + 2 * j + 1] = y[2 * m + 1];
    }
  }
  __syncthreads();
  const float alpha = expf(A * dt), beta = (1.f - lam) * dt * alpha, gamma = lam * dt, Dh = a.D[h];
  const TA* P = static_cast<const TA*>(a.P) + b * a.ldp;
  for (int p = warp; p < a.Pd; p += kWarps) {
    const int64_t col = (int64_t)h * a.Pd + p;
    const float xv = to_f(P[di(a) + col]), zv = to_f(P[col]);
    float v[R], vp[R], acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      v[r] = xv * map_at(a.mx, a, h, r, p);
      vp[r] = vprev[(bh * R + r) * a.Pd + p];
      acc[r] = 0.f;
    }
    float* Sp = S + (bh * a.Pd + p) * kS;
    for (int i = lane; i < kS; i += 32) {
      float w = alpha * Sp[i];
#pragma unroll
      for (int r = 0; r < R; ++r) w += beta * vp[r] * kps[r][i] + gamma * v[r] * ks[r][i];
      Sp[i] = w;
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] += w * qs[r][i];
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
      float y = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        y += map_at(a.mo, a, h, r, p) * (acc[r] + Dh * v[r]) * silu(zv * map_at(a.mz, a, h, r, p));
        vprev[(bh * R + r) * a.Pd + p] = v[r];
      }
      ypre[b * di(a) + col] = from_f<TA>(y);
    }
  }
}

// ---------------------------------------------------------------- dispatch
template <int V>
using Ic = std::integral_constant<int, V>;
template <class T>
struct Tag {
  using type = T;
};

// f(Ic<R>, Ic<NP>, Tag<TA>) for the shape's rank, pairs per lane (S / 64) and act dtype.
template <class F>
void with_shape(const Mamba3Args& a, F&& f) {
  auto np = [&](auto rc) {
    auto ta = [&](auto npc) {
      if (a.act_bf16)
        f(rc, npc, Tag<bf16>{});
      else
        f(rc, npc, Tag<float>{});
    };
    if (a.S == 128)
      ta(Ic<2>{});
    else
      ta(Ic<4>{});
  };
  switch (a.R) {
    case 1:
      np(Ic<1>{});
      break;
    case 2:
      np(Ic<2>{});
      break;
    case 3:
      np(Ic<3>{});
      break;
    default:
      np(Ic<4>{});
      break;
  }
}

void check(const Mamba3Args& a, bool work = true) {
  require(a.B > 0 && a.T > 0 && a.H > 0 && a.Pd > 0 && a.G > 0 && a.na > 0, "empty shape");
  require(ssm_state_supported(a.S), "state size " + std::to_string(a.S) + " (128 or 256)");
  static_assert(kMamba3MaxRank == 4, "the rank switch instantiates the kernels for ranks 1 to 4");
  require(mamba3_rank_supported(a.R), "rank " + std::to_string(a.R) + " (1 to " + std::to_string(kMamba3MaxRank) + ")");
  require(a.H % a.G == 0, std::to_string(a.G) + " groups do not divide " + std::to_string(a.H) + " heads");
  require(2 * a.na <= a.S, "more rotated pairs than the state holds");
  require(a.ldp >= 2 * di(a) + 2 * (int64_t)a.R * a.G * a.S, "P's row stride below its width");
  require(a.ldg >= 3 * a.H + a.na, "Pg's row stride below its width");
  require(a.P && a.Pg && a.dt_bias && a.nB && a.nC && a.bB && a.bC && a.D, "null parameter");
  require((a.mx != nullptr) == (a.mz != nullptr) && (a.mz != nullptr) == (a.mo != nullptr),
          "the MIMO maps come together");
  if (work) require(a.dt && a.A && a.lam && a.cw && a.bnext && a.phi, "null work array");
}

unsigned warp_blocks(int64_t warps) { return blocks_for(warps, kWarps); }

}  // namespace

void mamba3_prepare(const Mamba3Args& a, bf16* q, bf16* k, bf16* v, float* g, cudaStream_t stream) {
  check(a);
  require(q && k && v && g, "prepare: null output");
  const int64_t N = a.B * a.T;
  scalars_fwd_kernel<<<blocks_for(N * a.H, kThreads), kThreads, 0, stream>>>(a);
  LAR_CUDA_LAUNCHED();
  phi_kernel<<<blocks_for(a.B * a.H * a.na, 128), 128, 0, stream>>>(a);
  LAR_CUDA_LAUNCHED();
  with_shape(a, [&](auto, auto npc, auto ta) {
    using TA = typename decltype(ta)::type;
    prepare_kernel<decltype(npc)::value, TA><<<warp_blocks(N * a.R * a.H), kThreads, 0, stream>>>(a, q, k, v, g);
  });
  LAR_CUDA_LAUNCHED();
}

void mamba3_out_forward(const Mamba3Args& a, const bf16* o, void* ypre, cudaStream_t stream) {
  check(a);
  require(o && ypre, "out: null argument");
  with_shape(a, [&](auto rc, auto npc, auto ta) {
    using TA = typename decltype(ta)::type;
    out_fwd_kernel<decltype(rc)::value, decltype(npc)::value, TA>
        <<<warp_blocks(a.B * a.T * a.H), kThreads, 0, stream>>>(a, o, static_cast<TA*>(ypre));
  });
  LAR_CUDA_LAUNCHED();
}

void mamba3_out_backward(const Mamba3Args& a, const bf16* o, const void* dyv, float* du, bf16* dO, void* dP,
                         float* dterm, float* tmo, float* tmz, void* ypre, cudaStream_t stream) {
  check(a);
  require(o && dyv && du && dO && dP && dterm, "out backward: null argument");
  require((a.mo != nullptr) == (tmo != nullptr && tmz != nullptr), "out backward: the map terms go with the maps");
  with_shape(a, [&](auto rc, auto npc, auto ta) {
    using TA = typename decltype(ta)::type;
    out_bwd_kernel<decltype(rc)::value, decltype(npc)::value, TA>
        <<<warp_blocks(a.B * a.T * a.H), kThreads, 0, stream>>>(
            a, o, static_cast<const TA*>(dyv), du, dO, static_cast<TA*>(dP), dterm, tmo, tmz, static_cast<TA*>(ypre));
  });
  LAR_CUDA_LAUNCHED();
}

void mamba3_core_backward(const Mamba3Args& a, const float* du, const Mamba3CoreGrads& g, void* dP,
                          cudaStream_t stream) {
  check(a);
  require(du && dP && g.dq && g.dk && g.dv && g.dg && g.dQh && g.dKh && g.dphi && g.dc && g.dbn && g.dadt,
          "core backward: null argument");
  require((a.mx != nullptr) == (g.tmx != nullptr), "core backward: the map terms go with the maps");
  with_shape(a, [&](auto rc, auto npc, auto ta) {
    using TA = typename decltype(ta)::type;
    core_bwd_kernel<decltype(rc)::value, decltype(npc)::value, TA>
        <<<warp_blocks(a.B * a.T * a.H), kThreads, 0, stream>>>(a, du, g, static_cast<TA*>(dP));
  });
  LAR_CUDA_LAUNCHED();
}

void mamba3_norm_backward(const Mamba3Args& a, const float* dQh, const float* dKh, void* dP, float* tnB, float* tnC,
                          cudaStream_t stream) {
  check(a);
  require(dQh && dKh && dP && tnB && tnC, "norm backward: null argument");
  with_shape(a, [&](auto, auto npc, auto ta) {
    using TA = typename decltype(ta)::type;
    norm_bwd_kernel<decltype(npc)::value, TA>
        <<<warp_blocks(a.B * a.T * a.R * a.G), kThreads, 0, stream>>>(a, dQh, dKh, static_cast<TA*>(dP), tnB, tnC);
  });
  LAR_CUDA_LAUNCHED();
}

void mamba3_scalars_backward(const Mamba3Args& a, float* dphi, const float* dc, const float* dbn, const float* dadt,
                             float* dPg, cudaStream_t stream) {
  check(a);
  require(dphi && dc && dbn && dadt && dPg, "scalars backward: null argument");
  phi_bwd_kernel<<<blocks_for(a.B * a.H * a.na, 128), 128, 0, stream>>>(a, dphi);
  LAR_CUDA_LAUNCHED();
  scalars_bwd_kernel<<<blocks_for(a.B * a.T * (a.H + a.na), kThreads), kThreads, 0, stream>>>(a, dphi, dc, dbn, dadt,
                                                                                              dPg);
  LAR_CUDA_LAUNCHED();
}

void mamba3_decode_step(const Mamba3Args& a0, const Mamba3DecodeState& s, void* ypre, cudaStream_t stream) {
  Mamba3Args a = a0;
  a.T = 1;
  a.phi = s.phi;  // load_rot reads the angles of token n = b: the state's
  check(a, false);
  require(s.phi && s.S && s.k_prev && s.v_prev && ypre, "decode: null argument");
  with_shape(a, [&](auto rc, auto npc, auto ta) {
    using TA = typename decltype(ta)::type;
    decode_kernel<decltype(rc)::value, decltype(npc)::value, TA>
        <<<static_cast<unsigned>(a.B * a.H), kThreads, 0, stream>>>(a, s.phi, s.S, s.k_prev, s.v_prev,
                                                                    static_cast<TA*>(ypre));
  });
  LAR_CUDA_LAUNCHED();
}

}  // namespace lar::kernels::cuda::linear
