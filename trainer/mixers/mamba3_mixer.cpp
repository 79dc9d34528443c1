// The Mamba-3 layer (model.architecture: mamba3; Lahoti et al. 2026), SISO or MIMO
// (model.mamba3.form; MIMO rank R = model.mamba3.mimo_rank, SISO is R = 1 without the maps):
//   z, x [Di]; B, C [R·G·N]; dt, a, trap [H]; θ [na] = projections of the normed input (no conv)
//   Δ = softplus(dt + dt_bias); A = min(−softplus(a), −1e-4); λ = σ(trap); θ ← π·tanh(θ)
//   k̂_r = RMSNorm(B_r)·w_B + B_bias_{h,r}, q̂_r = RMSNorm(C_r)·w_C + C_bias_{h,r}  (biases start at 1)
//   v_r = x_h ⊙ m_x,{h,r}  (MIMO; SISO: v = x_h)
//   per head: the rotary, trapezoidal recurrence of kernels/ssm/mamba3.hpp with log
//     decay A·Δ, R keys/values written and R queries read per token;
//   y_h = Σ_r m_o,{h,r} ⊙ (o_r + D_h v_r) ⊙ SiLU(z_h ⊙ m_z,{h,r}) → out projection
//     (SISO: y_h = (o + D_h x_h) ⊙ SiLU(z_h)).
// Training runs the chunkwise form on the shared scalar-decay core (the mapping is in
// mamba3.hpp: each token is R rows of the core); decode runs Mamba-3's own recurrence. On the
// CUDA backend forward/backward go to cuda_layers/mamba3_layer_cuda.cpp (CUDA builds; the same mapping on
// the gla channel kernels; cuda_mamba3_unsupported says which shapes); so does decode
// (init_state/step: the forward's projections and Mamba-3's own recurrence in one per-token
// kernel, mamba3_decode_step, on the device state φ, S, k_prev, v_prev), gated until its GPU
// test passes (kSsmDecodeCudaVerified, ssm_common.hpp).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kernels/linear/core.hpp"
#include "kernels/ssm/mamba3.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/mamba3_layer.hpp"
#include "trainer/mixers/mamba_options.hpp"
#include "trainer/mixers/ssm_common.hpp"

namespace lar::trainer::mixers {

namespace {

namespace lk = lar::kernels::cpu::linear;
namespace ks = lar::kernels::cpu::ssm;
using kernels::DType;
using kernels::Tensor;
using namespace ssm;

constexpr double kNormEps = 1e-5;
constexpr double kAFloor = 1e-4;
constexpr double kPi = 3.14159265358979323846;

using Slots = Mamba3Slots;  // mx, mz, mo: MIMO only, the rank-R maps of x, z and the output [H, R, P]

template <class T>
struct State : MixerState {
  std::vector<ks::Mamba3State<T>> h;  // [B·H]
};

// Sub-token rows: token t of sequence (b, h) with rank index r is row (bh·len + t)·R + r.
template <class T>
struct Cache {
  int B = 0, len = 0;
  std::vector<T> x, pz, px, pB, pC, pdt, pa, ptrap, pang;
  std::vector<T> Bn, Cn, rB, rC;          // normalised B, C [N·R·G rows of N], rstd
  std::vector<T> dt, A, lam, theta;       // [N,H], [N,H], [N,H], [N,na]
  std::vector<T> phi, cw, bnext;          // per (b,h,t)
  std::vector<T> hq, hk, hv, hg, bounds;  // per sub-token row
  std::vector<T> u;                       // per sub-token row [P]: o + D·v
};

template <class T>
class Impl {
 public:
  Impl(const MambaShape& s, int na, int R, const Slots& sl, const ParamTable& pt)
      : s_(s), na_(na), R_(R), sl_(sl), pt_(pt) {}

  void forward(kernels::Backend& be, const T* x, T* yout, int B, int len, State<T>* st) {
    Cache<T>& c = c_;
    const MambaShape& s = s_;
    const int R = R_, N = B * len, RGN = R * s.G * s.N, hpg = s.H / s.G;
    c.B = B;
    c.len = len;
    c.x.assign(x, x + (size_t)N * s.d);
    Tensor X = tv(c.x, {N, s.d});
    auto proj = [&](std::vector<T>& out, int slot, int C) {
      out.resize((size_t)N * C);
      be.gemm(X, false, pt_.P[slot], true, tv(out, {N, C}));
    };
    proj(c.pz, sl_.wz, s.Di);
    proj(c.px, sl_.wx, s.Di);
    proj(c.pB, sl_.wB, RGN);
    proj(c.pC, sl_.wC, RGN);
    proj(c.pdt, sl_.wdt, s.H);
    proj(c.pa, sl_.wa, s.H);
    proj(c.ptrap, sl_.wtrap, s.H);
    proj(c.pang, sl_.wang, na_);
    const size_t normed = (size_t)N * R * s.G;
    c.Bn.resize(c.pB.size());
    c.Cn.resize(c.pC.size());
    c.rB.resize(normed);
    c.rC.resize(normed);
    group_rmsnorm_fwd(c.pB.data(), par(sl_.nB), c.Bn.data(), c.rB.data(), normed, s.N, s.N, kNormEps);
    group_rmsnorm_fwd(c.pC.data(), par(sl_.nC), c.Cn.data(), c.rC.data(), normed, s.N, s.N, kNormEps);
    c.dt.resize((size_t)N * s.H);
    c.A.resize(c.dt.size());
    c.lam.resize(c.dt.size());
    for (size_t i = 0; i < c.dt.size(); ++i) {
      const int h = (int)(i % s.H);
      c.dt[i] = softplus(c.pdt[i] + par(sl_.dt_bias)[h]);
      c.A[i] = std::min(-softplus(c.pa[i]), T(-kAFloor));
      c.lam[i] = sigmoid(c.ptrap[i]);
    }
    c.theta.resize(c.pang.size());
    for (size_t i = 0; i < c.pang.size(); ++i) c.theta[i] = T(kPi) * std::tanh(c.pang[i]);
    const size_t BH = (size_t)B * s.H, rows = BH * len * R;
    std::vector<T> ho(rows * s.P);
    if (st) {  // decode: Mamba-3's own recurrence
      std::vector<T> qh((size_t)R * s.N), kh(qh.size()), v((size_t)R * s.P);
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < s.H; ++h)
          for (int t = 0; t < len; ++t) {
            const size_t n = (size_t)b * len + t, row = (((size_t)b * s.H + h) * len + t) * R;
            for (int r = 0; r < R; ++r) {
              biased(n, h / hpg, h, r, &qh[(size_t)r * s.N], &kh[(size_t)r * s.N]);
              value(n, h, r, &v[(size_t)r * s.P]);
            }
            ks::mamba3_step(st->h[(size_t)b * s.H + h], qh.data(), kh.data(), v.data(), &c.theta[n * na_],
                            c.A[n * s.H + h] * c.dt[n * s.H + h], c.dt[n * s.H + h], c.lam[n * s.H + h], s.N, s.P, na_,
                            R, &ho[row * s.P]);
          }
    } else {
      gather(B, len);
      const int nc = lk::num_chunks(len * R, s.chunk * R);
      const size_t ss = (size_t)s.P * s.N;
      c.bounds.resize(BH * nc * ss);
#pragma omp parallel for schedule(static) num_threads(be.threads())
      for (int bh = 0; bh < (int)BH; ++bh) {
        auto in = core_inputs(bh, len);
        T* o = &ho[(size_t)bh * len * R * s.P];
        lk::chunk_forward(in, s.chunk * R, (const T*)nullptr, o, (T*)nullptr, &c.bounds[(size_t)bh * nc * ss]);
        for (int t = 0; t < len; ++t) {  // the token's own rows: see mamba3.hpp
          const size_t ti = (size_t)bh * len + t, row = ti * R;
          for (int ro = 0; ro < R; ++ro)
            for (int r = 0; r < R; ++r) {
              const T w = diag_weight(ti, ro, r) * dot(&c.hq[(row + ro) * s.N], &c.hk[(row + r) * s.N], s.N);
              const T* v = &c.hv[(row + r) * s.P];
              T* out = &o[((size_t)t * R + ro) * s.P];
              for (int p = 0; p < s.P; ++p) out[p] += w * v[p];
            }
        }
      }
    }
    c.u.resize(ho.size());
    std::vector<T> yv((size_t)N * s.Di), v(s.P);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t n = (size_t)b * len + t, row = (((size_t)b * s.H + h) * len + t) * R;
          T* y = &yv[n * s.Di + (size_t)h * s.P];
          for (int r = 0; r < R; ++r) {
            value(n, h, r, v.data());
            for (int p = 0; p < s.P; ++p) {
              const size_t k = (row + r) * s.P + p;
              c.u[k] = ho[k] + par(sl_.D)[h] * v[p];
              const T zr = c.pz[n * s.Di + (size_t)h * s.P + p] * mimo(sl_.mz, h, r, p);
              y[p] += mimo(sl_.mo, h, r, p) * c.u[k] * silu(zr);
            }
          }
        }
    be.gemm(tv(yv, {N, s.Di}), false, pt_.P[sl_.wo], true, Tensor(yout, dtype_of<T>(), {N, s.d}));
    yv_ = std::move(yv);
  }

  void backward(kernels::Backend& be, const T* dy_, T* dx_) {
    Cache<T>& c = c_;
    const MambaShape& s = s_;
    const int R = R_, B = c.B, len = c.len, N = B * len, RGN = R * s.G * s.N, hpg = s.H / s.G;
    Tensor X = tv(c.x, {N, s.d});
    Tensor dY(const_cast<T*>(dy_), dtype_of<T>(), {N, s.d});
    Tensor dX(dx_, dtype_of<T>(), {N, s.d});
    be.zero(dX);
    be.gemm(dY, true, tv(yv_, {N, s.Di}), false, pt_.G[sl_.wo], 1.0, 1.0);
    std::vector<T> dyv((size_t)N * s.Di), dpz(dyv.size(), T(0)), dpx(dyv.size(), T(0));
    be.gemm(dY, false, pt_.P[sl_.wo], false, tv(dyv, {N, s.Di}));
    const size_t BH = (size_t)B * s.H, rows = BH * len * R;
    std::vector<T> hdo(rows * s.P), hdv(rows * s.P, T(0));  // d o and d v per sub-token row
    // y = Σ_r m_o,r ⊙ u_r ⊙ SiLU(z ⊙ m_z,r),  u_r = o_r + D v_r
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t n = (size_t)b * len + t, row = (((size_t)b * s.H + h) * len + t) * R;
          T dD = 0;
          for (int r = 0; r < R; ++r)
            for (int p = 0; p < s.P; ++p) {
              const size_t j = n * s.Di + (size_t)h * s.P + p, k = (row + r) * s.P + p;
              const T mz = mimo(sl_.mz, h, r, p), mo = mimo(sl_.mo, h, r, p), zr = c.pz[j] * mz, u = c.u[k];
              const T dzr = dyv[j] * mo * u * silu_grad(zr);
              dpz[j] += dzr * mz;
              if (is_mimo()) {
                mimo_grad(sl_.mo, h, r, p) += dyv[j] * u * silu(zr);
                mimo_grad(sl_.mz, h, r, p) += dzr * c.pz[j];
              }
              const T du = dyv[j] * mo * silu(zr);
              hdo[k] = du;
              dD += du * c.px[j] * mimo(sl_.mx, h, r, p);
              hdv[k] += par(sl_.D)[h] * du;
            }
          grad(sl_.D)[h] += dD;
        }
    const int nc = lk::num_chunks(len * R, s.chunk * R);
    const size_t ss = (size_t)s.P * s.N;
    std::vector<T> dq(rows * s.N), dk(dq.size()), dz(rows * s.P), dg(rows);
    std::vector<T> dbn(BH * len, T(0)), dc(BH * len, T(0));
#pragma omp parallel for schedule(static) num_threads(be.threads())
    for (int bh = 0; bh < (int)BH; ++bh) {
      auto in = core_inputs(bh, len);
      const size_t r0 = (size_t)bh * len * R;
      lk::CoreGrads<T> gr;
      gr.dq = &dq[r0 * s.N];
      gr.dk = &dk[r0 * s.N];
      gr.dz = &dz[r0 * s.P];
      gr.dg = &dg[r0];
      lk::chunk_backward(in, s.chunk * R, (const T*)nullptr, &hdo[r0 * s.P], (const T*)nullptr, gr,
                         &c.bounds[(size_t)bh * nc * ss]);
      for (int t = 0; t < len; ++t) {
        const size_t ti = (size_t)bh * len + t, row = ti * R;
        // the diagonal o_{r'} += w(r', r) (q_{r'}·k_r) v_r
        for (int ro = 0; ro < R; ++ro)
          for (int r = 0; r < R; ++r) {
            const T* q = &c.hq[(row + ro) * s.N];
            const T* k = &c.hk[(row + r) * s.N];
            const T* v = &c.hv[(row + r) * s.P];
            const T* dO = &hdo[(row + ro) * s.P];
            const T qk = dot(q, k, s.N), dov = dot(dO, v, s.P), w = diag_weight(ti, ro, r);
            for (int i = 0; i < s.N; ++i) {
              dq[(row + ro) * s.N + i] += w * dov * k[i];
              dk[(row + r) * s.N + i] += w * dov * q[i];
            }
            for (int p = 0; p < s.P; ++p) hdv[(row + r) * s.P + p] += w * qk * dO[p];
            if (r > ro) dc[ti] += qk * dov;
            dbn[ti] -= qk * dov;
          }
        // the written values c·v
        for (int r = 0; r < R; ++r) {
          T* dzr = &dz[(row + r) * s.P];
          dc[ti] += dot(dzr, &c.hv[(row + r) * s.P], s.P);
          for (int p = 0; p < s.P; ++p) hdv[(row + r) * s.P + p] += c.cw[ti] * dzr[p];
        }
      }
    }
    // per token and head: v = x ⊙ m_x, the weights c, β', the rotation, the decay
    std::vector<T> dBn((size_t)N * RGN, T(0)), dCn(dBn.size(), T(0)), dpdt((size_t)N * s.H), dpa(dpdt.size()),
        dptrap(dpdt.size()), dtheta((size_t)N * na_, T(0));
    std::vector<T> dqh(s.N), dkh(s.N), dphi((size_t)len * na_);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h) {
        const size_t bh = (size_t)b * s.H + h;
        const int grp = h / hpg;
        std::vector<T> dDT(len, T(0)), dlam(len, T(0));
        std::fill(dphi.begin(), dphi.end(), T(0));
        for (int t = 0; t < len; ++t) {
          const size_t ti = bh * len + t, row = ti * R, n = (size_t)b * len + t, nh = n * s.H + h;
          for (int r = 0; r < R; ++r)
            for (int p = 0; p < s.P; ++p) {
              const size_t j = n * s.Di + (size_t)h * s.P + p;
              const T dv = hdv[(row + r) * s.P + p];
              dpx[j] += dv * mimo(sl_.mx, h, r, p);
              if (is_mimo()) mimo_grad(sl_.mx, h, r, p) += dv * c.px[j];
            }
          // c_t = λ_t Δ_t + β'_{t+1};  β'_s = (1 − λ_s) Δ_s
          dlam[t] += dc[ti] * c.dt[nh];
          dDT[t] += dc[ti] * c.lam[nh];
          if (t + 1 < len) {
            const T dbp = dc[ti] + dbn[ti];
            const size_t nh1 = nh + s.H;
            dlam[t + 1] -= dbp * c.dt[nh1];
            dDT[t + 1] += dbp * (T(1) - c.lam[nh1]);
          }
          // a = A·Δ, on the token's first row
          const T dadt = dg[row];
          dDT[t] += dadt * c.A[nh];
          const bool clamped = -softplus(c.pa[nh]) > T(-kAFloor);
          dpa[nh] = clamped ? T(0) : -dadt * c.dt[nh] * sigmoid(c.pa[nh]);
          // rotation
          const T* phi = &c.phi[ti * na_];
          for (int r = 0; r < R; ++r) {
            ks::rotate_bwd(&c.hq[(row + r) * s.N], phi, &dq[(row + r) * s.N], s.N, na_, dqh.data(),
                           &dphi[(size_t)t * na_]);
            ks::rotate_bwd(&c.hk[(row + r) * s.N], phi, &dk[(row + r) * s.N], s.N, na_, dkh.data(),
                           &dphi[(size_t)t * na_]);
            const size_t bias = ((size_t)h * R + r) * s.N, src = n * RGN + ((size_t)r * s.G + grp) * s.N;
            for (int i = 0; i < s.N; ++i) {
              grad(sl_.bC)[bias + i] += dqh[i];
              grad(sl_.bB)[bias + i] += dkh[i];
              dCn[src + i] += dqh[i];
              dBn[src + i] += dkh[i];
            }
          }
        }
        // φ_t = Σ_{s≤t} θ_s Δ_s: reverse cumulative sum
        std::vector<T> cum(na_, T(0));
        for (int t = len - 1; t >= 0; --t) {
          const size_t n = (size_t)b * len + t, nh = n * s.H + h;
          for (int i = 0; i < na_; ++i) {
            cum[i] += dphi[(size_t)t * na_ + i];
            dtheta[n * na_ + i] += cum[i] * c.dt[nh];
            dDT[t] += cum[i] * c.theta[n * na_ + i];
          }
        }
        for (int t = 0; t < len; ++t) {
          const size_t nh = ((size_t)b * len + t) * s.H + h;
          dpdt[nh] = dDT[t] * sigmoid(c.pdt[nh] + par(sl_.dt_bias)[h]);
          grad(sl_.dt_bias)[h] += dpdt[nh];
          dptrap[nh] = dlam[t] * c.lam[nh] * (T(1) - c.lam[nh]);
        }
      }
    std::vector<T> dpang((size_t)N * na_);
    for (size_t i = 0; i < dpang.size(); ++i) {
      const T th = std::tanh(c.pang[i]);
      dpang[i] = dtheta[i] * T(kPi) * (T(1) - th * th);
    }
    const size_t normed = (size_t)N * R * s.G;
    std::vector<T> dpB(c.pB.size()), dpC(c.pC.size());
    group_rmsnorm_bwd(c.pB.data(), par(sl_.nB), c.rB.data(), dBn.data(), dpB.data(), grad(sl_.nB), normed, s.N, s.N);
    group_rmsnorm_bwd(c.pC.data(), par(sl_.nC), c.rC.data(), dCn.data(), dpC.data(), grad(sl_.nC), normed, s.N, s.N);
    proj_bwd(be, X, dX, dpz, pt_, sl_.wz, N, s.Di);
    proj_bwd(be, X, dX, dpx, pt_, sl_.wx, N, s.Di);
    proj_bwd(be, X, dX, dpB, pt_, sl_.wB, N, RGN);
    proj_bwd(be, X, dX, dpC, pt_, sl_.wC, N, RGN);
    proj_bwd(be, X, dX, dpdt, pt_, sl_.wdt, N, s.H);
    proj_bwd(be, X, dX, dpa, pt_, sl_.wa, N, s.H);
    proj_bwd(be, X, dX, dptrap, pt_, sl_.wtrap, N, s.H);
    proj_bwd(be, X, dX, dpang, pt_, sl_.wang, N, na_);
  }

  std::unique_ptr<State<T>> make_state(int B) const {
    auto st = std::make_unique<State<T>>();
    st->h.assign((size_t)B * s_.H, ks::Mamba3State<T>(s_.N, s_.P, na_, R_));
    return st;
  }

 private:
  const T* par(int slot) const { return pt_.par<T>(slot); }
  T* grad(int slot) const { return pt_.grad<T>(slot); }
  bool is_mimo() const { return sl_.mx >= 0; }
  // An entry of m_x, m_z or m_o [H, R, P]; 1 in the SISO form, which has none.
  T mimo(int slot, int h, int r, int p) const { return slot < 0 ? T(1) : par(slot)[((size_t)h * R_ + r) * s_.P + p]; }
  T& mimo_grad(int slot, int h, int r, int p) const { return grad(slot)[((size_t)h * R_ + r) * s_.P + p]; }
  static T dot(const T* a, const T* b, int n) {
    T acc = 0;
    for (int i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
  }
  // The weight of row r of token ti in query row r' of the same token, beyond the core.
  T diag_weight(size_t ti, int ro, int r) const { return (r > ro ? c_.cw[ti] : T(0)) - c_.bnext[ti]; }

  // q̂, k̂ of rank index r (normalised and biased, not yet rotated) of token n in head h.
  void biased(size_t n, int grp, int h, int r, T* qh, T* kh) const {
    const int RGN = R_ * s_.G * s_.N;
    const size_t src = n * RGN + ((size_t)r * s_.G + grp) * s_.N, bias = ((size_t)h * R_ + r) * s_.N;
    for (int i = 0; i < s_.N; ++i) {
      qh[i] = c_.Cn[src + i] + par(sl_.bC)[bias + i];
      kh[i] = c_.Bn[src + i] + par(sl_.bB)[bias + i];
    }
  }
  // v_r = x_h ⊙ m_x,r of token n.
  void value(size_t n, int h, int r, T* v) const {
    for (int p = 0; p < s_.P; ++p) v[p] = c_.px[n * s_.Di + (size_t)h * s_.P + p] * mimo(sl_.mx, h, r, p);
  }

  // Per (b,h,t): the angles, the write weight c and the next token's β share; per sub-token
  // row: rotated q, k, the value v, the written value c·v and the log decay (first row only).
  void gather(int B, int len) {
    Cache<T>& c = c_;
    const MambaShape& s = s_;
    const int R = R_, hpg = s.H / s.G;
    const size_t BH = (size_t)B * s.H, rows = BH * len * R;
    c.phi.resize(BH * len * na_);
    c.cw.resize(BH * len);
    c.bnext.resize(BH * len);
    c.hq.resize(rows * s.N);
    c.hk.resize(c.hq.size());
    c.hv.resize(rows * s.P);
    c.hg.resize(rows);
    wz_.resize(rows * s.P);
    std::vector<T> qh(s.N), kh(s.N);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t ti = ((size_t)b * s.H + h) * len + t, n = (size_t)b * len + t, nh = n * s.H + h;
          T* phi = &c.phi[ti * na_];
          for (int i = 0; i < na_; ++i) phi[i] = (t ? phi[i - na_] : T(0)) + c.theta[n * na_ + i] * c.dt[nh];
          c.bnext[ti] = t + 1 < len ? (T(1) - c.lam[nh + s.H]) * c.dt[nh + s.H] : T(0);
          c.cw[ti] = c.lam[nh] * c.dt[nh] + c.bnext[ti];
          for (int r = 0; r < R; ++r) {
            const size_t row = ti * R + r;
            biased(n, h / hpg, h, r, qh.data(), kh.data());
            ks::rotate(qh.data(), phi, s.N, na_, &c.hq[row * s.N]);
            ks::rotate(kh.data(), phi, s.N, na_, &c.hk[row * s.N]);
            c.hg[row] = r == 0 ? c.A[nh] * c.dt[nh] : T(0);
            value(n, h, r, &c.hv[row * s.P]);
            for (int p = 0; p < s.P; ++p) wz_[row * s.P + p] = c.cw[ti] * c.hv[row * s.P + p];
          }
        }
  }

  lk::CoreInputs<T> core_inputs(int bh, int len) const {
    const size_t r0 = (size_t)bh * len * R_;
    lk::CoreInputs<T> in;
    in.len = len * R_;
    in.dk = s_.N;
    in.dv = s_.P;
    in.q = &c_.hq[r0 * s_.N];
    in.k = &c_.hk[r0 * s_.N];
    in.z = &wz_[r0 * s_.P];
    in.g = &c_.hg[r0];
    in.gate = lk::GateKind::scalar;
    in.scale = T(1);
    return in;
  }

  MambaShape s_;
  int na_, R_;
  Slots sl_;
  const ParamTable& pt_;
  Cache<T> c_;
  std::vector<T> wz_, yv_;  // the core's written values c·v; the gated output
};

class Mamba3Mixer final : public ssm::DtypeMixer<Mamba3Mixer, Impl, State, CudaMamba3> {
 public:
  explicit Mamba3Mixer(const MixerConfig& cfg) : DtypeMixer(cfg), s_(mamba_shape(cfg)) {
    check_no_routing(cfg);
    const json& mo = cfg.model;
    json m3 = mo.contains("mamba3") && mo["mamba3"].is_object() ? mo["mamba3"] : json::object();
    const std::string form = m3.value("form", "siso");
    if (form != "siso" && form != "mimo")
      throw UserError("model.mamba3.form: must be siso or mimo, got '" + form + "'");
    const bool mimo = form == "mimo";
    if (mimo) {
      R_ = m3.value("mimo_rank", 4);
      if (R_ < 1) throw UserError("model.mamba3.mimo_rank: must be ≥ 1, got " + std::to_string(R_));
    }
    const double frac = m3.value("rope_fraction", 0.5);
    if (frac != 0.5 && frac != 1.0)
      throw UserError("model.mamba3.rope_fraction: must be 0.5 or 1, got " + std::to_string(frac));
    int rot = (int)(s_.N * frac);
    rot -= rot % 2;
    na_ = rot / 2;
    if (na_ < 1)
      throw UserError("model.mamba.state_size: " + std::to_string(s_.N) + " × rope_fraction leaves no rotated pair");
    const double sd = cfg.init_std;
    const int RGN = R_ * s_.G * s_.N;
    auto mat = [&](const char* name, int64_t rows, int64_t cols) {
      return pt_.add({name, {rows, cols}, ParamKind::matrix_hidden, InitRule::Normal(sd)});
    };
    sl_.wz = mat("w_z", s_.Di, s_.d);
    sl_.wx = mat("w_x", s_.Di, s_.d);
    sl_.wB = mat("w_B", RGN, s_.d);
    sl_.wC = mat("w_C", RGN, s_.d);
    sl_.wdt = mat("w_dt", s_.H, s_.d);
    sl_.wa = mat("w_a", s_.H, s_.d);
    sl_.wtrap = mat("w_trap", s_.H, s_.d);
    sl_.wang = mat("w_angle", na_, s_.d);
    sl_.dt_bias =
        pt_.add({"dt_bias", {s_.H}, ParamKind::scalar, InitRule::Uniform(softplus_inv(1e-3), softplus_inv(1e-1))});
    sl_.nB = pt_.add({"B_norm", {s_.N}, ParamKind::norm, InitRule::Constant(1.0)});
    sl_.nC = pt_.add({"C_norm", {s_.N}, ParamKind::norm, InitRule::Constant(1.0)});
    const std::vector<int64_t> bias_shape =
        mimo ? std::vector<int64_t>{s_.H, R_, s_.N} : std::vector<int64_t>{s_.H, s_.N};
    sl_.bB = pt_.add({"B_bias", bias_shape, ParamKind::bias, InitRule::Constant(1.0)});
    sl_.bC = pt_.add({"C_bias", bias_shape, ParamKind::bias, InitRule::Constant(1.0)});
    sl_.D = pt_.add({"D", {s_.H}, ParamKind::scalar, InitRule::Constant(1.0)});
    sl_.wo = mat("wo", s_.d, s_.Di);
    if (mimo) {  // the reference's init: x and the output averaged over the rank, z as is
      auto map = [&](const char* name, double v) {
        return pt_.add({name, {s_.H, R_, s_.P}, ParamKind::scalar, InitRule::Constant(v)});
      };
      sl_.mx = map("mimo_x", 1.0 / R_);
      sl_.mz = map("mimo_z", 1.0);
      sl_.mo = map("mimo_o", 1.0 / R_);
    }
  }

  template <class T>
  std::unique_ptr<Impl<T>> make_impl() const {
    return std::make_unique<Impl<T>>(s_, na_, R_, sl_, pt_);
  }

  std::string cuda_refusal(const kernels::Backend& be) const {
    const std::string who = "mamba3 mixer (layer " + std::to_string(cfg_.layer) + ") on " + be.name() + ": ";
    if (const std::string why = mamba3_cuda_gate(); !why.empty()) return who + why;
    if (const std::string why = cuda_mamba3_unsupported(s_, R_); !why.empty()) return who + why;
    return "";
  }
  std::unique_ptr<CudaMamba3> make_cuda() const {
    return cuda_mamba3_factory() ? cuda_mamba3_factory()(s_, na_, R_, sl_, pt_.P, pt_.G) : nullptr;
  }

 private:
  MambaShape s_;
  int na_ = 1, R_ = 1;
  Slots sl_;
};

const MixerRegistration reg_mamba3{"mamba3", [](const MixerConfig& c) { return std::make_unique<Mamba3Mixer>(c); }};

}  // namespace

}  // namespace lar::trainer::mixers
