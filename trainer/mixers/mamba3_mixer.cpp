// The Mamba-3 layer, SISO form (model.architecture: mamba3; Lahoti et al. 2026):
//   z, x [Di]; B, C [G·N]; dt, a, trap [H]; θ [na] = projections of the normed input (no conv)
//   Δ = softplus(dt + dt_bias); A = min(−softplus(a), −1e-4); λ = σ(trap); θ ← π·tanh(θ)
//   k̂ = RMSNorm(B)·w_B + B_bias_h, q̂ = RMSNorm(C)·w_C + C_bias_h   (biases start at 1)
//   per head: the rotary, trapezoidal recurrence of kernels/cpu/ssm/mamba3.hpp with log
//     decay A·Δ, value x_h; y = (o + D_h x_h) ⊙ SiLU(z_h) → out projection.
// Training runs the chunkwise form on the shared scalar-decay core (the mapping is in
// mamba3.hpp); decode runs Mamba-3's own recurrence. CPU backend only. The MIMO form is not
// implemented yet (model.mamba3.form: mimo is refused).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/linear/core.hpp"
#include "kernels/cpu/ssm/mamba3.hpp"
#include "trainer/mixer.hpp"
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

struct Slots {
  int wz = -1, wx = -1, wB = -1, wC = -1, wdt = -1, wa = -1, wtrap = -1, wang = -1;
  int dt_bias = -1, nB = -1, nC = -1, bB = -1, bC = -1, D = -1, wo = -1;
};

template <class T>
struct State : MixerState {
  std::vector<ks::Mamba3State<T>> h;  // [B·H]
};

template <class T>
struct Cache {
  int B = 0, len = 0;
  std::vector<T> x, pz, px, pB, pC, pdt, pa, ptrap, pang;
  std::vector<T> Bn, Cn, rB, rC;            // normalised B, C [N·G rows of N], rstd
  std::vector<T> dt, A, lam, theta;         // [N,H], [N,H], [N,H], [N,na]
  std::vector<T> phi, hq, hk, hz, hg, cw, bnext, bounds;  // per (b,h)
  std::vector<T> o, u;                      // [N,Di] before / after the D skip
};

template <class T>
class Impl {
 public:
  Impl(const MambaShape& s, int na, const Slots& sl, const ParamTable& pt) : s_(s), na_(na), sl_(sl), pt_(pt) {}

  void forward(kernels::Backend& be, const T* x, T* yout, int B, int len, State<T>* st) {
    Cache<T>& c = c_;
    const MambaShape& s = s_;
    const int N = B * len, GN = s.G * s.N, hpg = s.H / s.G;
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
    proj(c.pB, sl_.wB, GN);
    proj(c.pC, sl_.wC, GN);
    proj(c.pdt, sl_.wdt, s.H);
    proj(c.pa, sl_.wa, s.H);
    proj(c.ptrap, sl_.wtrap, s.H);
    proj(c.pang, sl_.wang, na_);
    c.Bn.resize(c.pB.size());
    c.Cn.resize(c.pC.size());
    c.rB.resize((size_t)N * s.G);
    c.rC.resize((size_t)N * s.G);
    group_rmsnorm_fwd(c.pB.data(), par(sl_.nB), c.Bn.data(), c.rB.data(), (size_t)N * s.G, s.N, s.N, kNormEps);
    group_rmsnorm_fwd(c.pC.data(), par(sl_.nC), c.Cn.data(), c.rC.data(), (size_t)N * s.G, s.N, s.N, kNormEps);
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
    const size_t BH = (size_t)B * s.H;
    std::vector<T> ho(BH * len * s.P);
    if (st) {  // decode: Mamba-3's own recurrence
      std::vector<T> qh(s.N), kh(s.N);
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < s.H; ++h)
          for (int t = 0; t < len; ++t) {
            const size_t n = (size_t)b * len + t, hi = ((size_t)b * s.H + h) * len + t;
            biased(n, h / hpg, h, qh.data(), kh.data());
            ks::mamba3_step(st->h[(size_t)b * s.H + h], qh.data(), kh.data(), &c.px[n * s.Di + (size_t)h * s.P],
                            &c.theta[n * na_], c.A[n * s.H + h] * c.dt[n * s.H + h], c.dt[n * s.H + h],
                            c.lam[n * s.H + h], s.N, s.P, na_, &ho[hi * s.P]);
          }
    } else {
      gather(B, len);
      const int nc = lk::num_chunks(len, s.chunk);
      const size_t ss = (size_t)s.P * s.N;
      c.bounds.resize(BH * nc * ss);
#pragma omp parallel for schedule(static) num_threads(be.threads())
      for (int bh = 0; bh < (int)BH; ++bh) {
        auto in = core_inputs(bh, len);
        T* o = &ho[(size_t)bh * len * s.P];
        lk::chunk_forward(in, s.chunk, (const T*)nullptr, o, (T*)nullptr, &c.bounds[(size_t)bh * nc * ss]);
        // the diagonal takes back the next token's β share
        for (int t = 0; t < len; ++t) {
          const size_t hi = (size_t)bh * len + t;
          T qk = 0;
          for (int i = 0; i < s.N; ++i) qk += c.hq[hi * s.N + i] * c.hk[hi * s.N + i];
          const T* v = &c.hz[hi * s.P];  // hz holds x here; the core wrote c·x through in.z
          for (int p = 0; p < s.P; ++p) o[(size_t)t * s.P + p] -= c.bnext[hi] * qk * v[p];
        }
      }
    }
    c.o.resize((size_t)N * s.Di);
    c.u.resize(c.o.size());
    std::vector<T> yv(c.o.size());
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t hi = ((size_t)b * s.H + h) * len + t, n = (size_t)b * len + t;
          for (int p = 0; p < s.P; ++p) {
            const size_t j = n * s.Di + (size_t)h * s.P + p;
            c.o[j] = ho[hi * s.P + p];
            c.u[j] = c.o[j] + par(sl_.D)[h] * c.px[j];
            yv[j] = c.u[j] * silu(c.pz[j]);
          }
        }
    be.gemm(tv(yv, {N, s.Di}), false, pt_.P[sl_.wo], true, Tensor(yout, dtype_of<T>(), {N, s.d}));
    yv_ = std::move(yv);
  }

  void backward(kernels::Backend& be, const T* dy_, T* dx_) {
    Cache<T>& c = c_;
    const MambaShape& s = s_;
    const int B = c.B, len = c.len, N = B * len, GN = s.G * s.N, hpg = s.H / s.G;
    Tensor X = tv(c.x, {N, s.d});
    Tensor dY(const_cast<T*>(dy_), dtype_of<T>(), {N, s.d});
    Tensor dX(dx_, dtype_of<T>(), {N, s.d});
    be.zero(dX);
    be.gemm(dY, true, tv(yv_, {N, s.Di}), false, pt_.G[sl_.wo], 1.0, 1.0);
    std::vector<T> dyv((size_t)N * s.Di), dpz(dyv.size()), dpx(dyv.size(), T(0));
    be.gemm(dY, false, pt_.P[sl_.wo], false, tv(dyv, {N, s.Di}));
    const size_t BH = (size_t)B * s.H;
    std::vector<T> hdo(BH * len * s.P);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t hi = ((size_t)b * s.H + h) * len + t, n = (size_t)b * len + t;
          T dD = 0;
          for (int p = 0; p < s.P; ++p) {
            const size_t j = n * s.Di + (size_t)h * s.P + p;
            const T du = dyv[j] * silu(c.pz[j]);
            dpz[j] = dyv[j] * c.u[j] * silu_grad(c.pz[j]);
            hdo[hi * s.P + p] = du;
            dD += du * c.px[j];
            dpx[j] += par(sl_.D)[h] * du;
          }
          grad(sl_.D)[h] += dD;
        }
    const int nc = lk::num_chunks(len, s.chunk);
    const size_t ss = (size_t)s.P * s.N;
    std::vector<T> dq(BH * len * s.N), dk(dq.size()), dz(BH * len * s.P), dg(BH * len);
    std::vector<T> dbn(BH * len, T(0)), dc(BH * len, T(0));
#pragma omp parallel for schedule(static) num_threads(be.threads())
    for (int bh = 0; bh < (int)BH; ++bh) {
      auto in = core_inputs(bh, len);
      lk::CoreGrads<T> gr;
      gr.dq = &dq[(size_t)bh * len * s.N];
      gr.dk = &dk[(size_t)bh * len * s.N];
      gr.dz = &dz[(size_t)bh * len * s.P];
      gr.dg = &dg[(size_t)bh * len];
      lk::chunk_backward(in, s.chunk, (const T*)nullptr, &hdo[(size_t)bh * len * s.P], (const T*)nullptr, gr,
                         &c.bounds[(size_t)bh * nc * ss]);
      for (int t = 0; t < len; ++t) {  // the diagonal correction o −= β'(q·k) x
        const size_t hi = (size_t)bh * len + t;
        const T* q = &c.hq[hi * s.N];
        const T* k = &c.hk[hi * s.N];
        const T* v = &c.hz[hi * s.P];
        const T* dO = &hdo[hi * s.P];
        T qk = 0, dov = 0;
        for (int i = 0; i < s.N; ++i) qk += q[i] * k[i];
        for (int p = 0; p < s.P; ++p) dov += dO[p] * v[p];
        const T bn = c.bnext[hi];
        for (int i = 0; i < s.N; ++i) {
          dq[hi * s.N + i] -= bn * dov * k[i];
          dk[hi * s.N + i] -= bn * dov * q[i];
        }
        dbn[hi] -= qk * dov;
        // written value z = c·x: dx gets c·dz (below) and the correction's −β'(q·k)·dO
        T dcv = 0;
        for (int p = 0; p < s.P; ++p) {
          dcv += dz[hi * s.P + p] * v[p];
          dz[hi * s.P + p] = c.cw[hi] * dz[hi * s.P + p] - bn * qk * dO[p];
        }
        dc[hi] = dcv;
      }
    }
    // per token and head: the weights c, β', the rotation, the decay
    std::vector<T> dBn((size_t)N * GN, T(0)), dCn(dBn.size(), T(0)), dpdt((size_t)N * s.H), dpa(dpdt.size()),
        dptrap(dpdt.size()), dtheta((size_t)N * na_, T(0));
    std::vector<T> dqh(s.N), dkh(s.N), dphi((size_t)len * na_);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h) {
        const size_t bh = (size_t)b * s.H + h;
        const int grp = h / hpg;
        std::vector<T> dDT(len, T(0)), dlam(len, T(0));
        std::fill(dphi.begin(), dphi.end(), T(0));
        for (int t = 0; t < len; ++t) {
          const size_t hi = bh * len + t, n = (size_t)b * len + t, nh = n * s.H + h;
          for (int p = 0; p < s.P; ++p) dpx[n * s.Di + (size_t)h * s.P + p] += dz[hi * s.P + p];
          // c_t = λ_t Δ_t + β'_{t+1};  β'_s = (1 − λ_s) Δ_s
          dlam[t] += dc[hi] * c.dt[nh];
          dDT[t] += dc[hi] * c.lam[nh];
          if (t + 1 < len) {
            const T dbp = dc[hi] + dbn[hi];
            const size_t nh1 = nh + s.H;
            dlam[t + 1] -= dbp * c.dt[nh1];
            dDT[t + 1] += dbp * (T(1) - c.lam[nh1]);
          }
          // a = A·Δ
          const T dadt = dg[hi];
          dDT[t] += dadt * c.A[nh];
          const bool clamped = -softplus(c.pa[nh]) > T(-kAFloor);
          dpa[nh] = clamped ? T(0) : -dadt * c.dt[nh] * sigmoid(c.pa[nh]);
          // rotation
          const T* phi = &c.phi[hi * na_];
          ks::rotate_bwd(&c.hq[hi * s.N], phi, &dq[hi * s.N], s.N, na_, dqh.data(), &dphi[(size_t)t * na_]);
          ks::rotate_bwd(&c.hk[hi * s.N], phi, &dk[hi * s.N], s.N, na_, dkh.data(), &dphi[(size_t)t * na_]);
          for (int i = 0; i < s.N; ++i) {
            grad(sl_.bC)[(size_t)h * s.N + i] += dqh[i];
            grad(sl_.bB)[(size_t)h * s.N + i] += dkh[i];
            dCn[n * GN + (size_t)grp * s.N + i] += dqh[i];
            dBn[n * GN + (size_t)grp * s.N + i] += dkh[i];
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
    std::vector<T> dpB(c.pB.size()), dpC(c.pC.size());
    group_rmsnorm_bwd(c.pB.data(), par(sl_.nB), c.rB.data(), dBn.data(), dpB.data(), grad(sl_.nB), (size_t)N * s.G, s.N,
                      s.N);
    group_rmsnorm_bwd(c.pC.data(), par(sl_.nC), c.rC.data(), dCn.data(), dpC.data(), grad(sl_.nC), (size_t)N * s.G, s.N,
                      s.N);
    proj_bwd(be, X, dX, dpz, pt_, sl_.wz, N, s.Di);
    proj_bwd(be, X, dX, dpx, pt_, sl_.wx, N, s.Di);
    proj_bwd(be, X, dX, dpB, pt_, sl_.wB, N, GN);
    proj_bwd(be, X, dX, dpC, pt_, sl_.wC, N, GN);
    proj_bwd(be, X, dX, dpdt, pt_, sl_.wdt, N, s.H);
    proj_bwd(be, X, dX, dpa, pt_, sl_.wa, N, s.H);
    proj_bwd(be, X, dX, dptrap, pt_, sl_.wtrap, N, s.H);
    proj_bwd(be, X, dX, dpang, pt_, sl_.wang, N, na_);
  }

  std::unique_ptr<State<T>> make_state(int B) const {
    auto st = std::make_unique<State<T>>();
    st->h.assign((size_t)B * s_.H, ks::Mamba3State<T>(s_.N, s_.P, na_));
    return st;
  }

 private:
  const T* par(int slot) const { return pt_.par<T>(slot); }
  T* grad(int slot) const { return pt_.grad<T>(slot); }

  void biased(size_t n, int grp, int h, T* qh, T* kh) const {
    const int GN = s_.G * s_.N;
    for (int i = 0; i < s_.N; ++i) {
      qh[i] = c_.Cn[n * GN + (size_t)grp * s_.N + i] + par(sl_.bC)[(size_t)h * s_.N + i];
      kh[i] = c_.Bn[n * GN + (size_t)grp * s_.N + i] + par(sl_.bB)[(size_t)h * s_.N + i];
    }
  }

  // Rotated q, k, the value x (hz), the write weights c, the next token's β share and the
  // log decays, per (b,h).
  void gather(int B, int len) {
    Cache<T>& c = c_;
    const MambaShape& s = s_;
    const int hpg = s.H / s.G;
    const size_t BH = (size_t)B * s.H;
    c.phi.resize(BH * len * na_);
    c.hq.resize(BH * len * s.N);
    c.hk.resize(c.hq.size());
    c.hz.resize(BH * len * s.P);
    c.hg.resize(BH * len);
    c.cw.resize(BH * len);
    c.bnext.resize(BH * len);
    wz_.resize(BH * len * s.P);
    std::vector<T> qh(s.N), kh(s.N);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t hi = ((size_t)b * s.H + h) * len + t, n = (size_t)b * len + t, nh = n * s.H + h;
          T* phi = &c.phi[hi * na_];
          for (int i = 0; i < na_; ++i) phi[i] = (t ? phi[i - na_] : T(0)) + c.theta[n * na_ + i] * c.dt[nh];
          biased(n, h / hpg, h, qh.data(), kh.data());
          ks::rotate(qh.data(), phi, s.N, na_, &c.hq[hi * s.N]);
          ks::rotate(kh.data(), phi, s.N, na_, &c.hk[hi * s.N]);
          c.hg[hi] = c.A[nh] * c.dt[nh];
          c.bnext[hi] = t + 1 < len ? (T(1) - c.lam[nh + s.H]) * c.dt[nh + s.H] : T(0);
          c.cw[hi] = c.lam[nh] * c.dt[nh] + c.bnext[hi];
          for (int p = 0; p < s.P; ++p) {
            const T xv = c.px[n * s.Di + (size_t)h * s.P + p];
            c.hz[hi * s.P + p] = xv;
            wz_[hi * s.P + p] = c.cw[hi] * xv;
          }
        }
  }

  lk::CoreInputs<T> core_inputs(int bh, int len) const {
    lk::CoreInputs<T> in;
    in.len = len;
    in.dk = s_.N;
    in.dv = s_.P;
    in.q = &c_.hq[(size_t)bh * len * s_.N];
    in.k = &c_.hk[(size_t)bh * len * s_.N];
    in.z = &wz_[(size_t)bh * len * s_.P];
    in.g = &c_.hg[(size_t)bh * len];
    in.gate = lk::GateKind::scalar;
    in.scale = T(1);
    return in;
  }

  MambaShape s_;
  int na_;
  Slots sl_;
  const ParamTable& pt_;
  Cache<T> c_;
  std::vector<T> wz_, yv_;  // the core's written values c·x; the gated output
};

class Mamba3Mixer final : public ssm::DtypeMixer<Mamba3Mixer, Impl, State> {
 public:
  explicit Mamba3Mixer(const MixerConfig& cfg) : DtypeMixer(cfg), s_(mamba_shape(cfg)) {
    check_no_routing(cfg);
    const json& mo = cfg.model;
    json m3 = mo.contains("mamba3") && mo["mamba3"].is_object() ? mo["mamba3"] : json::object();
    const std::string form = m3.value("form", "siso");
    if (form != "siso")
      throw UserError("model.mamba3.form: '" + form + "' is not implemented in this build (siso is)");
    const double frac = m3.value("rope_fraction", 0.5);
    if (frac != 0.5 && frac != 1.0)
      throw UserError("model.mamba3.rope_fraction: must be 0.5 or 1, got " + std::to_string(frac));
    int rot = (int)(s_.N * frac);
    rot -= rot % 2;
    na_ = rot / 2;
    if (na_ < 1) throw UserError("model.mamba.state_size: " + std::to_string(s_.N) + " × rope_fraction leaves no rotated pair");
    const double sd = cfg.init_std;
    const int GN = s_.G * s_.N;
    auto mat = [&](const char* name, int64_t rows, int64_t cols) {
      return pt_.add({name, {rows, cols}, ParamKind::matrix_hidden, InitRule::Normal(sd)});
    };
    sl_.wz = mat("w_z", s_.Di, s_.d);
    sl_.wx = mat("w_x", s_.Di, s_.d);
    sl_.wB = mat("w_B", GN, s_.d);
    sl_.wC = mat("w_C", GN, s_.d);
    sl_.wdt = mat("w_dt", s_.H, s_.d);
    sl_.wa = mat("w_a", s_.H, s_.d);
    sl_.wtrap = mat("w_trap", s_.H, s_.d);
    sl_.wang = mat("w_angle", na_, s_.d);
    sl_.dt_bias = pt_.add({"dt_bias", {s_.H}, ParamKind::scalar, InitRule::Uniform(softplus_inv(1e-3), softplus_inv(1e-1))});
    sl_.nB = pt_.add({"B_norm", {s_.N}, ParamKind::norm, InitRule::Constant(1.0)});
    sl_.nC = pt_.add({"C_norm", {s_.N}, ParamKind::norm, InitRule::Constant(1.0)});
    sl_.bB = pt_.add({"B_bias", {s_.H, s_.N}, ParamKind::bias, InitRule::Constant(1.0)});
    sl_.bC = pt_.add({"C_bias", {s_.H, s_.N}, ParamKind::bias, InitRule::Constant(1.0)});
    sl_.D = pt_.add({"D", {s_.H}, ParamKind::scalar, InitRule::Constant(1.0)});
    sl_.wo = mat("wo", s_.d, s_.Di);
  }

  template <class T>
  std::unique_ptr<Impl<T>> make_impl() const {
    return std::make_unique<Impl<T>>(s_, na_, sl_, pt_);
  }

 private:
  MambaShape s_;
  int na_ = 1;
  Slots sl_;
};

const MixerRegistration reg_mamba3{
    "mamba3", [](const MixerConfig& c) { return std::make_unique<Mamba3Mixer>(c); }};

}  // namespace

}  // namespace lar::trainer::mixers
