// The GLA-Hedgehog layer (model.architecture: gla_hedgehog), CCQ's learned-feature-map
// baseline: lar's GLA layer with the Hedgehog feature map (Zhang et al. 2024) on q and k.
//   q, k, v = projections of the normed input, short causal conv + SiLU (model.short_conv)
//   per head: φ(a) = [softmax(W a + b), softmax(−(W a + b))] ∈ R^{2dk}, W [dk,dk] initialised
//     to the identity and b to 0, one map for q and one for k (shared by the heads)
//   g = logsigmoid(W₂W₁x + b_g)/16 per feature channel (2dk per head, rank model.gate_rank)
//   S_t = S_{t−1} D(exp g_t) + v_t φ(k_t)ᵀ,  o_t = S_t φ(q_t)      (the GLA core, no scale:
//     the per-head RMSNorm below makes the output scale-free)
//   o → per-head RMSNorm × SiLU(W_g x) → W_o.
// The recurrence is the shared core (kernels/linear/core.hpp, channel gates): chunkwise
// in training, recurrent in decode. On the CUDA backend forward/backward go to
// cuda_layers/hedgehog_layer_cuda.cpp (CUDA builds; the feature map of kernels/hedgehog/hedgehog_ops.hpp
// and the gla channel kernels at key dim 2dk; cuda_hedgehog_unsupported says which shapes, and
// the gate kHedgehogCudaVerified in hedgehog_layer.hpp keeps it off until it is verified on a
// GPU); so does decode (init_state/step: the forward's projections, conv over a window of the
// last W projection rows, the feature maps and the gla channel decode on the device state),
// gated until its GPU test passes (kSsmDecodeCudaVerified, ssm_common.hpp).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kernels/linear/core.hpp"
#include "kernels/hedgehog/hedgehog_map.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/hedgehog_layer.hpp"
#include "trainer/mixers/ssm_common.hpp"

namespace lar::trainer::mixers {

namespace {

namespace lk = lar::kernels::cpu::linear;
using kernels::DType;
using kernels::Tensor;
using namespace ssm;

constexpr double kNormEps = 1e-5;

using Shape = HedgehogShape;
using Slots = HedgehogSlots;

template <class T>
struct State : MixerState {
  std::vector<T> S;  // [B,H,dv,2dk]
  std::vector<T> tail_q, tail_k, tail_v;
};

template <class T>
struct Cache {
  int B = 0, len = 0;
  std::vector<T> x, pq, pk, pv, sq, sk, sv, aq, ak, av;
  std::vector<T> hq, hk, hv, hg, bounds;  // per (b,h): features [T,F], v [T,dv], gates [T,F]
  std::vector<T> h1, f;                   // low-rank gate
  std::vector<T> o, on, rstd, og, ypre;
};

template <class T>
class Impl {
 public:
  Impl(const Shape& s, const Slots& sl, const ParamTable& pt) : s_(s), sl_(sl), pt_(pt) {}

  void forward(kernels::Backend& be, const T* x, T* yout, int B, int len, State<T>* st) {
    Cache<T>& c = c_;
    const Shape& s = s_;
    const int N = B * len;
    c.B = B;
    c.len = len;
    c.x.assign(x, x + (size_t)N * s.d);
    Tensor X = tv(c.x, {N, s.d});
    auto proj = [&](std::vector<T>& out, int slot, int C) {
      out.resize((size_t)N * C);
      be.gemm(X, false, pt_.P[slot], true, tv(out, {N, C}));
    };
    proj(c.pq, sl_.wq, s.Cq);
    proj(c.pk, sl_.wk, s.Cq);
    proj(c.pv, sl_.wv, s.Cv);
    conv(c.pq, c.sq, c.aq, sl_.cq, s.Cq, B, len, st ? &st->tail_q : nullptr);
    conv(c.pk, c.sk, c.ak, sl_.ck, s.Cq, B, len, st ? &st->tail_k : nullptr);
    conv(c.pv, c.sv, c.av, sl_.cv, s.Cv, B, len, st ? &st->tail_v : nullptr);
    c.h1.resize((size_t)N * s.rank);
    c.f.resize((size_t)N * s.CF);
    be.gemm(X, false, pt_.P[sl_.g1], true, tv(c.h1, {N, s.rank}));
    be.gemm(tv(c.h1, {N, s.rank}), false, pt_.P[sl_.g2], true, tv(c.f, {N, s.CF}));
    const size_t BH = (size_t)B * s.H;
    c.hq.resize(BH * len * s.F);
    c.hk.resize(BH * len * s.F);
    c.hv.resize(BH * len * s.dv);
    c.hg.resize(BH * len * s.F);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t hi = ((size_t)b * s.H + h) * len + t, n = (size_t)b * len + t;
          lk::hedgehog_forward(&c.aq[n * s.Cq + (size_t)h * s.dk], par(sl_.fq_w), par(sl_.fq_b), s.dk, &c.hq[hi * s.F]);
          lk::hedgehog_forward(&c.ak[n * s.Cq + (size_t)h * s.dk], par(sl_.fk_w), par(sl_.fk_b), s.dk, &c.hk[hi * s.F]);
          std::copy_n(&c.av[n * s.Cv + (size_t)h * s.dv], s.dv, &c.hv[hi * s.dv]);
          for (int i = 0; i < s.F; ++i) {
            const int ch = h * s.F + i;
            c.hg[hi * s.F + i] = -softplus(-(c.f[n * s.CF + ch] + par(sl_.gb)[ch])) / T(16);
          }
        }
    const int nc = lk::num_chunks(len, s.chunk);
    const size_t ss = (size_t)s.dv * s.F;
    if (!st) c.bounds.resize(BH * nc * ss);
    std::vector<T> ho(BH * len * s.dv);
#pragma omp parallel for schedule(static) num_threads(be.threads())
    for (int bh = 0; bh < (int)BH; ++bh) {
      auto in = core_inputs(bh, len);
      T* o = &ho[(size_t)bh * len * s.dv];
      if (st) {
        T* S = &st->S[(size_t)bh * ss];
        lk::recurrent_forward(in, S, o, S);
      } else {
        lk::chunk_forward(in, s.chunk, (const T*)nullptr, o, (T*)nullptr, &c.bounds[(size_t)bh * nc * ss]);
      }
    }
    c.o.resize((size_t)N * s.Cv);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t)
          std::copy_n(&ho[(((size_t)b * s.H + h) * len + t) * s.dv], s.dv,
                      &c.o[((size_t)b * len + t) * s.Cv + (size_t)h * s.dv]);
    c.on.resize(c.o.size());
    c.rstd.resize((size_t)N * s.H);
    be.rmsnorm_fwd(tv(c.o, {N * s.H, s.dv}), pt_.P[sl_.onorm], tv(c.on, {N * s.H, s.dv}), tv(c.rstd, {N * s.H}),
                   kNormEps);
    proj(c.og, sl_.wgate, s.Cv);
    c.ypre.resize(c.o.size());
    for (size_t i = 0; i < c.ypre.size(); ++i) c.ypre[i] = c.on[i] * silu(c.og[i]);
    be.gemm(tv(c.ypre, {N, s.Cv}), false, pt_.P[sl_.wo], true, Tensor(yout, dtype_of<T>(), {N, s.d}));
  }

  void backward(kernels::Backend& be, const T* dy_, T* dx_) {
    Cache<T>& c = c_;
    const Shape& s = s_;
    const int B = c.B, len = c.len, N = B * len;
    Tensor X = tv(c.x, {N, s.d});
    Tensor dY(const_cast<T*>(dy_), dtype_of<T>(), {N, s.d});
    Tensor dX(dx_, dtype_of<T>(), {N, s.d});
    be.zero(dX);
    be.gemm(dY, true, tv(c.ypre, {N, s.Cv}), false, pt_.G[sl_.wo], 1.0, 1.0);
    std::vector<T> dypre((size_t)N * s.Cv), don(dypre.size()), dog(dypre.size()), dO(dypre.size(), T(0));
    be.gemm(dY, false, pt_.P[sl_.wo], false, tv(dypre, {N, s.Cv}));
    for (size_t i = 0; i < dypre.size(); ++i) {
      don[i] = dypre[i] * silu(c.og[i]);
      dog[i] = dypre[i] * c.on[i] * silu_grad(c.og[i]);
    }
    proj_bwd(be, X, dX, dog, pt_, sl_.wgate, N, s.Cv);
    be.rmsnorm_bwd(tv(c.o, {N * s.H, s.dv}), pt_.P[sl_.onorm], tv(c.rstd, {N * s.H}), tv(don, {N * s.H, s.dv}),
                   tv(dO, {N * s.H, s.dv}), pt_.G[sl_.onorm]);
    const size_t BH = (size_t)B * s.H;
    std::vector<T> hdo(BH * len * s.dv);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t)
          std::copy_n(&dO[((size_t)b * len + t) * s.Cv + (size_t)h * s.dv], s.dv,
                      &hdo[(((size_t)b * s.H + h) * len + t) * s.dv]);
    const int nc = lk::num_chunks(len, s.chunk);
    const size_t ss = (size_t)s.dv * s.F;
    std::vector<T> dq(BH * len * s.F), dk(dq.size()), dv(BH * len * s.dv), dg(dq.size());
#pragma omp parallel for schedule(static) num_threads(be.threads())
    for (int bh = 0; bh < (int)BH; ++bh) {
      auto in = core_inputs(bh, len);
      lk::CoreGrads<T> gr;
      gr.dq = &dq[(size_t)bh * len * s.F];
      gr.dk = &dk[(size_t)bh * len * s.F];
      gr.dz = &dv[(size_t)bh * len * s.dv];
      gr.dg = &dg[(size_t)bh * len * s.F];
      lk::chunk_backward(in, s.chunk, (const T*)nullptr, &hdo[(size_t)bh * len * s.dv], (const T*)nullptr, gr,
                         &c.bounds[(size_t)bh * nc * ss]);
    }
    std::vector<T> daq((size_t)N * s.Cq), dak(daq.size()), dav((size_t)N * s.Cv), df((size_t)N * s.CF);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t hi = ((size_t)b * s.H + h) * len + t, n = (size_t)b * len + t;
          lk::hedgehog_backward(&c.aq[n * s.Cq + (size_t)h * s.dk], par(sl_.fq_w), s.dk, &c.hq[hi * s.F], &dq[hi * s.F],
                                &daq[n * s.Cq + (size_t)h * s.dk], grad(sl_.fq_w), grad(sl_.fq_b));
          lk::hedgehog_backward(&c.ak[n * s.Cq + (size_t)h * s.dk], par(sl_.fk_w), s.dk, &c.hk[hi * s.F], &dk[hi * s.F],
                                &dak[n * s.Cq + (size_t)h * s.dk], grad(sl_.fk_w), grad(sl_.fk_b));
          std::copy_n(&dv[hi * s.dv], s.dv, &dav[n * s.Cv + (size_t)h * s.dv]);
          for (int i = 0; i < s.F; ++i) {
            const int ch = h * s.F + i;
            // g = logsigmoid(f + b)/16: dg/df = σ(−(f + b))/16
            const T v = dg[hi * s.F + i] * sigmoid(-(c.f[n * s.CF + ch] + par(sl_.gb)[ch])) / T(16);
            df[n * s.CF + ch] = v;
            grad(sl_.gb)[ch] += v;
          }
        }
    std::vector<T> dh1((size_t)N * s.rank);
    be.gemm(tv(df, {N, s.CF}), true, tv(c.h1, {N, s.rank}), false, pt_.G[sl_.g2], 1.0, 1.0);
    be.gemm(tv(df, {N, s.CF}), false, pt_.P[sl_.g2], false, tv(dh1, {N, s.rank}));
    proj_bwd(be, X, dX, dh1, pt_, sl_.g1, N, s.rank);
    std::vector<T> dp;
    conv_bwd(c.pq, c.sq, daq, dp, sl_.cq, s.Cq, B, len);
    proj_bwd(be, X, dX, dp, pt_, sl_.wq, N, s.Cq);
    conv_bwd(c.pk, c.sk, dak, dp, sl_.ck, s.Cq, B, len);
    proj_bwd(be, X, dX, dp, pt_, sl_.wk, N, s.Cq);
    conv_bwd(c.pv, c.sv, dav, dp, sl_.cv, s.Cv, B, len);
    proj_bwd(be, X, dX, dp, pt_, sl_.wv, N, s.Cv);
  }

  std::unique_ptr<State<T>> make_state(int B) const {
    auto st = std::make_unique<State<T>>();
    st->S.assign((size_t)B * s_.H * s_.dv * s_.F, T(0));
    const int w1 = s_.conv ? s_.W - 1 : 0;
    st->tail_q.assign((size_t)B * w1 * s_.Cq, T(0));
    st->tail_k.assign((size_t)B * w1 * s_.Cq, T(0));
    st->tail_v.assign((size_t)B * w1 * s_.Cv, T(0));
    return st;
  }

 private:
  const T* par(int slot) const { return pt_.par<T>(slot); }
  T* grad(int slot) const { return pt_.grad<T>(slot); }

  void conv(const std::vector<T>& p, std::vector<T>& pre, std::vector<T>& a, int slot, int C, int B, int len,
            std::vector<T>* tail) {
    if (!s_.conv) {
      pre = p;
      a = p;
      return;
    }
    conv_silu_fwd(p, pre, a, par(slot), (const T*)nullptr, s_.W, C, B, len, tail);
  }
  void conv_bwd(const std::vector<T>& p, const std::vector<T>& pre, const std::vector<T>& da, std::vector<T>& dp,
                int slot, int C, int B, int len) {
    if (!s_.conv) {
      dp = da;
      return;
    }
    conv_silu_bwd(p, pre, da, dp, par(slot), grad(slot), (T*)nullptr, s_.W, C, B, len);
  }

  lk::CoreInputs<T> core_inputs(int bh, int len) const {
    lk::CoreInputs<T> in;
    in.len = len;
    in.dk = s_.F;
    in.dv = s_.dv;
    in.q = &c_.hq[(size_t)bh * len * s_.F];
    in.k = &c_.hk[(size_t)bh * len * s_.F];
    in.z = &c_.hv[(size_t)bh * len * s_.dv];
    in.g = &c_.hg[(size_t)bh * len * s_.F];
    in.gate = lk::GateKind::channel;
    in.scale = T(1);
    return in;
  }

  Shape s_;
  Slots sl_;
  const ParamTable& pt_;
  Cache<T> c_;
};

class HedgehogMixer final : public ssm::DtypeMixer<HedgehogMixer, Impl, State, CudaHedgehog> {
 public:
  explicit HedgehogMixer(const MixerConfig& cfg) : DtypeMixer(cfg), s_(hedgehog_shape(cfg)) {
    check_no_routing(cfg);
    const double sd = cfg.init_std;
    auto mat = [&](const char* name, int64_t rows, int64_t cols) {
      return pt_.add({name, {rows, cols}, ParamKind::matrix_hidden, InitRule::Normal(sd)});
    };
    sl_.wq = mat("wq", s_.Cq, s_.d);
    sl_.wk = mat("wk", s_.Cq, s_.d);
    sl_.wv = mat("wv", s_.Cv, s_.d);
    if (s_.conv) {
      const double bound = 1.0 / std::sqrt((double)s_.W);
      auto conv = [&](const char* name, int64_t C) {
        return pt_.add({name, {C, s_.W}, ParamKind::scalar, InitRule::Uniform(-bound, bound)});
      };
      sl_.cq = conv("conv_q", s_.Cq);
      sl_.ck = conv("conv_k", s_.Cq);
      sl_.cv = conv("conv_v", s_.Cv);
    }
    // The feature maps start as the identity map W = I, b = 0 (Hedgehog's initialisation);
    // InitRule has no identity, so W is stored as the offset from I (W = I + Δ, Δ = 0).
    sl_.fq_w = pt_.add({"fmap_q_delta", {s_.dk, s_.dk}, ParamKind::scalar, InitRule::Constant(0.0)});
    sl_.fq_b = pt_.add({"fmap_q_bias", {s_.dk}, ParamKind::bias, InitRule::Constant(0.0)});
    sl_.fk_w = pt_.add({"fmap_k_delta", {s_.dk, s_.dk}, ParamKind::scalar, InitRule::Constant(0.0)});
    sl_.fk_b = pt_.add({"fmap_k_bias", {s_.dk}, ParamKind::bias, InitRule::Constant(0.0)});
    sl_.g1 = mat("gate_w1", s_.rank, s_.d);
    sl_.g2 = mat("gate_w2", s_.CF, s_.rank);
    sl_.gb = pt_.add({"gate_bias", {s_.CF}, ParamKind::bias, InitRule::Constant(0.0)});
    sl_.onorm = pt_.add({"o_norm", {s_.dv}, ParamKind::norm, InitRule::Constant(1.0)});
    sl_.wgate = mat("w_gate", s_.Cv, s_.d);
    sl_.wo = mat("wo", s_.d, s_.Cv);
  }

  template <class T>
  std::unique_ptr<Impl<T>> make_impl() const {
    return std::make_unique<Impl<T>>(s_, sl_, pt_);
  }

  std::string cuda_refusal(const kernels::Backend& be) const {
    const std::string why = cuda_hedgehog_unsupported(s_);
    return why.empty() ? "" : "gla_hedgehog mixer (layer " + std::to_string(cfg_.layer) + ") on " + be.name() + ": " + why;
  }
  std::unique_ptr<CudaHedgehog> make_cuda() const {
    return cuda_hedgehog_factory() ? cuda_hedgehog_factory()(s_, sl_, pt_.P, pt_.G) : nullptr;
  }

 private:
  Shape s_;
  Slots sl_;
};

const MixerRegistration reg_hedgehog{"gla_hedgehog",
                                     [](const MixerConfig& c) { return std::make_unique<HedgehogMixer>(c); }};

}  // namespace

}  // namespace lar::trainer::mixers
