// The Mamba-2 layer (model.architecture: mamba2; Dao & Gu 2024, the SSD layer):
//   z, x, B, C, dt = projections of the normed input  (x, z [Di = expand·d]; B, C [G·N]; dt [H])
//   x, B, C ← SiLU(causal depthwise conv (width model.conv_size, with bias))
//   Δ = softplus(dt + dt_bias);  a = −exp(A_log)·Δ  (log decay, one per head and token)
//   per head h (x_h [P]; B, C of the head's group [N]):
//     S_t = exp(a_t) S_{t−1} + (Δ_t x_t) B_tᵀ,   y_t = S_t C_t + D_h x_t
//   y ← RMSNorm over each group of channels (y ⊙ SiLU(z)) · w  →  out projection.
// The recurrence is scalar-decay linear attention — the state-space dual — so it runs on the
// shared core of kernels/linear/core.hpp (q = C, k = B, written value Δ·x, scalar gate
// a, no output scale): the chunkwise form trains, the recurrent form decodes.
// On the CPU backend (f32 training, f64 gradient checks) projections go through Backend::gemm,
// the per-(batch, head) recurrences run in parallel over the backend's threads. On the CUDA
// backend forward/backward go to cuda_layers/mamba2_layer_cuda.cpp (CUDA builds; the gla channel kernels
// with the scalar gate broadcast over the key channels; cuda_mamba2_unsupported says which
// shapes); so does decode (init_state/step: the forward's projections, conv over a window of
// the last W projection rows, and the gla channel decode on the device state), gated until its
// GPU test passes (kSsmDecodeCudaVerified, ssm_common.hpp).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kernels/linear/core.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/mamba2_layer.hpp"
#include "trainer/mixers/mamba_options.hpp"
#include "trainer/mixers/ssm_common.hpp"

namespace lar::trainer::mixers {

namespace {

namespace lk = lar::kernels::cpu::linear;
using kernels::DType;
using kernels::Tensor;
using namespace ssm;

constexpr double kNormEps = 1e-5;

using Slots = Mamba2Slots;

template <class T>
struct State : MixerState {
  std::vector<T> S;                       // [B,H,P,N]
  std::vector<T> tail_x, tail_B, tail_C;  // [B,W−1,C]
};

template <class T>
struct Cache {
  int B = 0, len = 0;
  std::vector<T> x;                       // [N,d]
  std::vector<T> pz, px, pB, pC, pdt;     // projections
  std::vector<T> sx, sB, sC, ax, aB, aC;  // conv pre-activations and SiLU outputs
  std::vector<T> dt, g;                   // [N,H] Δ and log decay
  std::vector<T> hq, hk, hz, hg, bounds;  // per-(b,h) core inputs, chunk start states
  std::vector<T> y, yg, yn, rstd;         // [N,Di] pre-gate, gated, normed
};

template <class T>
class Impl {
 public:
  Impl(const MambaShape& s, int W, const Slots& sl, const ParamTable& pt) : s_(s), W_(W), sl_(sl), pt_(pt) {}

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
    conv_silu_fwd(c.px, c.sx, c.ax, par(sl_.cx), par(sl_.bx), W_, s.Di, B, len, st ? &st->tail_x : nullptr);
    conv_silu_fwd(c.pB, c.sB, c.aB, par(sl_.cB), par(sl_.bB), W_, GN, B, len, st ? &st->tail_B : nullptr);
    conv_silu_fwd(c.pC, c.sC, c.aC, par(sl_.cC), par(sl_.bC), W_, GN, B, len, st ? &st->tail_C : nullptr);
    c.dt.resize((size_t)N * s.H);
    c.g.resize((size_t)N * s.H);
    for (int n = 0; n < N; ++n)
      for (int h = 0; h < s.H; ++h) {
        const size_t i = (size_t)n * s.H + h;
        c.dt[i] = softplus(c.pdt[i] + par(sl_.dt_bias)[h]);
        c.g[i] = -std::exp(par(sl_.A_log)[h]) * c.dt[i];
      }
    // gather per (b,h)
    const size_t BH = (size_t)B * s.H;
    c.hq.resize(BH * len * s.N);
    c.hk.resize(BH * len * s.N);
    c.hz.resize(BH * len * s.P);
    c.hg.resize(BH * len);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h) {
        const int grp = h / hpg;
        for (int t = 0; t < len; ++t) {
          const size_t hi = ((size_t)b * s.H + h) * len + t, n = (size_t)b * len + t;
          std::copy_n(&c.aC[n * GN + (size_t)grp * s.N], s.N, &c.hq[hi * s.N]);
          std::copy_n(&c.aB[n * GN + (size_t)grp * s.N], s.N, &c.hk[hi * s.N]);
          const T dt = c.dt[n * s.H + h];
          for (int p = 0; p < s.P; ++p) c.hz[hi * s.P + p] = dt * c.ax[n * s.Di + (size_t)h * s.P + p];
          c.hg[hi] = c.g[n * s.H + h];
        }
      }
    const int nc = lk::num_chunks(len, s.chunk);
    const size_t ss = (size_t)s.P * s.N;
    if (!st) c.bounds.resize(BH * nc * ss);
    std::vector<T> ho(BH * len * s.P);
#pragma omp parallel for schedule(static) num_threads(be.threads())
    for (int bh = 0; bh < (int)BH; ++bh) {
      auto in = core_inputs(bh, len);
      T* o = &ho[(size_t)bh * len * s.P];
      if (st) {
        T* S = &st->S[(size_t)bh * ss];
        lk::recurrent_forward(in, S, o, S);
      } else {
        lk::chunk_forward(in, s.chunk, (const T*)nullptr, o, (T*)nullptr, &c.bounds[(size_t)bh * nc * ss]);
      }
    }
    // y = o + D x;  gated RMSNorm;  out projection
    c.y.resize((size_t)N * s.Di);
    c.yg.resize(c.y.size());
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t hi = ((size_t)b * s.H + h) * len + t, n = (size_t)b * len + t;
          for (int p = 0; p < s.P; ++p) {
            const size_t j = n * s.Di + (size_t)h * s.P + p;
            c.y[j] = ho[hi * s.P + p] + par(sl_.D)[h] * c.ax[j];
            c.yg[j] = c.y[j] * silu(c.pz[j]);
          }
        }
    const int gs = s.Di / s.G;
    c.yn.resize(c.y.size());
    c.rstd.resize((size_t)N * s.G);
    group_rmsnorm_fwd(c.yg.data(), par(sl_.norm), c.yn.data(), c.rstd.data(), (size_t)N, s.Di, gs, kNormEps);
    be.gemm(tv(c.yn, {N, s.Di}), false, pt_.P[sl_.wo], true, Tensor(yout, dtype_of<T>(), {N, s.d}));
  }

  void backward(kernels::Backend& be, const T* dy_, T* dx_) {
    Cache<T>& c = c_;
    const MambaShape& s = s_;
    const int B = c.B, len = c.len, N = B * len, GN = s.G * s.N, hpg = s.H / s.G;
    Tensor X = tv(c.x, {N, s.d});
    Tensor dY(const_cast<T*>(dy_), dtype_of<T>(), {N, s.d});
    Tensor dX(dx_, dtype_of<T>(), {N, s.d});
    be.zero(dX);
    be.gemm(dY, true, tv(c.yn, {N, s.Di}), false, pt_.G[sl_.wo], 1.0, 1.0);
    std::vector<T> dyn((size_t)N * s.Di), dyg(dyn.size());
    be.gemm(dY, false, pt_.P[sl_.wo], false, tv(dyn, {N, s.Di}));
    group_rmsnorm_bwd(c.yg.data(), par(sl_.norm), c.rstd.data(), dyn.data(), dyg.data(), grad(sl_.norm), (size_t)N,
                      s.Di, s.Di / s.G);
    std::vector<T> dyv(dyn.size()), dpz(dyn.size()), dax(dyn.size(), T(0));
    for (size_t j = 0; j < dyv.size(); ++j) {
      dyv[j] = dyg[j] * silu(c.pz[j]);
      dpz[j] = dyg[j] * c.y[j] * silu_grad(c.pz[j]);
    }
    // D skip, and the core's output gradient per (b,h)
    const size_t BH = (size_t)B * s.H;
    std::vector<T> hdo(BH * len * s.P);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t hi = ((size_t)b * s.H + h) * len + t, n = (size_t)b * len + t;
          T dD = 0;
          for (int p = 0; p < s.P; ++p) {
            const size_t j = n * s.Di + (size_t)h * s.P + p;
            hdo[hi * s.P + p] = dyv[j];
            dD += dyv[j] * c.ax[j];
            dax[j] += par(sl_.D)[h] * dyv[j];
          }
          grad(sl_.D)[h] += dD;
        }
    const int nc = lk::num_chunks(len, s.chunk);
    const size_t ss = (size_t)s.P * s.N;
    std::vector<T> dq(BH * len * s.N), dk(dq.size()), dz(BH * len * s.P), dg(BH * len);
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
    }
    // scatter: C ← q, B ← k (summed over the heads of a group), x and Δ ← z = Δ·x, Δ and A ← g
    std::vector<T> daB((size_t)N * GN, T(0)), daC(daB.size(), T(0)), ddt((size_t)N * s.H, T(0));
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h) {
        const int grp = h / hpg;
        for (int t = 0; t < len; ++t) {
          const size_t hi = ((size_t)b * s.H + h) * len + t, n = (size_t)b * len + t;
          for (int i = 0; i < s.N; ++i) {
            daC[n * GN + (size_t)grp * s.N + i] += dq[hi * s.N + i];
            daB[n * GN + (size_t)grp * s.N + i] += dk[hi * s.N + i];
          }
          const T dt = c.dt[n * s.H + h];
          T d = 0;
          for (int p = 0; p < s.P; ++p) {
            const size_t j = n * s.Di + (size_t)h * s.P + p;
            dax[j] += dt * dz[hi * s.P + p];
            d += dz[hi * s.P + p] * c.ax[j];
          }
          const T gv = dg[hi];
          grad(sl_.A_log)[h] += gv * c.g[n * s.H + h];  // g = −exp(A_log)·Δ
          d += gv * -std::exp(par(sl_.A_log)[h]);
          ddt[n * s.H + h] = d * sigmoid(c.pdt[n * s.H + h] + par(sl_.dt_bias)[h]);
          grad(sl_.dt_bias)[h] += ddt[n * s.H + h];
        }
      }
    proj_bwd(be, X, dX, ddt, pt_, sl_.wdt, N, s.H);
    proj_bwd(be, X, dX, dpz, pt_, sl_.wz, N, s.Di);
    std::vector<T> dp;
    conv_silu_bwd(c.px, c.sx, dax, dp, par(sl_.cx), grad(sl_.cx), grad(sl_.bx), W_, s.Di, B, len);
    proj_bwd(be, X, dX, dp, pt_, sl_.wx, N, s.Di);
    conv_silu_bwd(c.pB, c.sB, daB, dp, par(sl_.cB), grad(sl_.cB), grad(sl_.bB), W_, GN, B, len);
    proj_bwd(be, X, dX, dp, pt_, sl_.wB, N, GN);
    conv_silu_bwd(c.pC, c.sC, daC, dp, par(sl_.cC), grad(sl_.cC), grad(sl_.bC), W_, GN, B, len);
    proj_bwd(be, X, dX, dp, pt_, sl_.wC, N, GN);
  }

  std::unique_ptr<State<T>> make_state(int B) const {
    auto st = std::make_unique<State<T>>();
    st->S.assign((size_t)B * s_.H * s_.P * s_.N, T(0));
    st->tail_x.assign((size_t)B * (W_ - 1) * s_.Di, T(0));
    st->tail_B.assign((size_t)B * (W_ - 1) * s_.G * s_.N, T(0));
    st->tail_C.assign(st->tail_B.size(), T(0));
    return st;
  }

 private:
  const T* par(int slot) const { return pt_.par<T>(slot); }
  T* grad(int slot) const { return pt_.grad<T>(slot); }

  lk::CoreInputs<T> core_inputs(int bh, int len) const {
    lk::CoreInputs<T> in;
    in.len = len;
    in.dk = s_.N;
    in.dv = s_.P;
    in.q = &c_.hq[(size_t)bh * len * s_.N];
    in.k = &c_.hk[(size_t)bh * len * s_.N];
    in.z = &c_.hz[(size_t)bh * len * s_.P];
    in.g = &c_.hg[(size_t)bh * len];
    in.gate = lk::GateKind::scalar;
    in.scale = T(1);
    return in;
  }

  MambaShape s_;
  int W_;
  Slots sl_;
  const ParamTable& pt_;
  Cache<T> c_;
};

class Mamba2Mixer final : public ssm::DtypeMixer<Mamba2Mixer, Impl, State, CudaMamba2> {
 public:
  explicit Mamba2Mixer(const MixerConfig& cfg) : DtypeMixer(cfg), s_(mamba_shape(cfg)) {
    check_no_routing(cfg);
    W_ = cfg.model.value("conv_size", 4);
    if (W_ < 1) throw UserError("model.conv_size: must be ≥ 1, got " + std::to_string(W_));
    const double sd = cfg.init_std;
    const int GN = s_.G * s_.N;
    auto mat = [&](const char* name, int64_t rows, int64_t cols, double std) {
      return pt_.add({name, {rows, cols}, ParamKind::matrix_hidden, InitRule::Normal(std)});
    };
    sl_.wz = mat("w_z", s_.Di, s_.d, sd);
    sl_.wx = mat("w_x", s_.Di, s_.d, sd);
    sl_.wB = mat("w_B", GN, s_.d, sd);
    sl_.wC = mat("w_C", GN, s_.d, sd);
    sl_.wdt = mat("w_dt", s_.H, s_.d, sd);
    // PyTorch's Conv1d default for a depthwise conv (weight and bias): U(±1/sqrt(width)).
    const double cb = 1.0 / std::sqrt((double)W_);
    auto conv = [&](const char* name, int64_t C) {
      return pt_.add({name, {C, W_}, ParamKind::scalar, InitRule::Uniform(-cb, cb)});
    };
    auto bias = [&](const char* name, int64_t C) {
      return pt_.add({name, {C}, ParamKind::bias, InitRule::Uniform(-cb, cb)});
    };
    sl_.cx = conv("conv_x", s_.Di);
    sl_.cB = conv("conv_B", GN);
    sl_.cC = conv("conv_C", GN);
    sl_.bx = bias("conv_x_bias", s_.Di);
    sl_.bB = bias("conv_B_bias", GN);
    sl_.bC = bias("conv_C_bias", GN);
    // A = exp(A_log) ∈ U[1, 16] as in Mamba-2; Δ log-uniform in [1e-3, 1e-1]; D = 1.
    sl_.A_log = pt_.add({"A_log", {s_.H}, ParamKind::scalar, InitRule::Uniform(0.0, std::log(16.0))});
    sl_.dt_bias =
        pt_.add({"dt_bias", {s_.H}, ParamKind::scalar, InitRule::Uniform(softplus_inv(1e-3), softplus_inv(1e-1))});
    sl_.D = pt_.add({"D", {s_.H}, ParamKind::scalar, InitRule::Constant(1.0)});
    sl_.norm = pt_.add({"norm", {s_.Di}, ParamKind::norm, InitRule::Constant(1.0)});
    sl_.wo = mat("wo", s_.d, s_.Di, sd);
  }

  template <class T>
  std::unique_ptr<Impl<T>> make_impl() const {
    return std::make_unique<Impl<T>>(s_, W_, sl_, pt_);
  }

  std::string cuda_refusal(const kernels::Backend& be) const {
    const std::string why = cuda_mamba2_unsupported(s_, W_);
    return why.empty() ? "" : "mamba2 mixer (layer " + std::to_string(cfg_.layer) + ") on " + be.name() + ": " + why;
  }
  std::unique_ptr<CudaMamba2> make_cuda() const {
    return cuda_mamba2_factory() ? cuda_mamba2_factory()(s_, W_, sl_, pt_.P, pt_.G) : nullptr;
  }

 private:
  MambaShape s_;
  int W_ = 4;
  Slots sl_;
};

const MixerRegistration reg_mamba2{"mamba2", [](const MixerConfig& c) { return std::make_unique<Mamba2Mixer>(c); }};

}  // namespace

}  // namespace lar::trainer::mixers
