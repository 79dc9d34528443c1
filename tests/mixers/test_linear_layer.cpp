// The linear mixer layers (trainer/mixers/linear_mixer.cpp) through the trainer's Mixer
// factory: fp64 finite-difference gradients of every parameter and of the input, decode
// (step by step) equals forward, and configuration errors.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "mixer_checks.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/hedgehog_layer.hpp"
#include "trainer/mixers/linear_layer.hpp"
#include "trainer/mixers/mamba2_layer.hpp"
#include "trainer/mixers/mamba3_layer.hpp"

using lar::json;
using lar::kernels::DType;
using lar::kernels::Tensor;
namespace tr = lar::trainer;

namespace {

const char* kMixers[] = {"linear", "gla", "deltanet", "gdn", "kda", "gdn2", "carve"};

tr::MixerConfig config(const std::string& kind, bool conv = true, json ccq = json{{"enabled", false}},
                       json carve = json::object()) {
  tr::MixerConfig c;
  c.kind = kind;
  c.d_model = 10;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.value_dim = 3;  // dk ≠ dv
  c.init_std = 0.3;
  c.routing = "none";
  c.n_layers = 1;
  c.linear_index = 0;
  c.model = json{{"architecture", kind}, {"short_conv", conv}, {"conv_size", 3},
                 {"chunk_size", 4},      {"gate_rank", 3},     {"routing", "none"},
                 {"ccq", ccq}};
  json cv{{"content_rank", 2}, {"content_chunk", 3}, {"content_grad", true}, {"freeze_content", false}};
  for (auto& [k, v] : carve.items()) cv[k] = v;
  c.model["carve"] = cv;
  return c;
}

// Width of the layer's side channel / value projection: value heads × dv.
int cv_of(const tr::MixerConfig& c) { return (c.n_v_heads > 0 ? c.n_v_heads : c.n_heads) * c.value_dim; }

// Grouped value heads: 2 query/key heads, 4 value heads.
tr::MixerConfig grouped(tr::MixerConfig c) {
  c.n_v_heads = 4;
  return c;
}

// The layer variants every test runs: each mixer, plus CCQ, CARVE, grouped-value-head and
// routing-signal options.
struct Variant {
  std::string name;
  tr::MixerConfig cfg;
};
std::vector<Variant> variants() {
  std::vector<Variant> v;
  for (const char* k : kMixers) v.push_back({k, config(k)});
  v.push_back({"gdn no conv", config("gdn", false)});
  v.push_back({"gla+ccq", config("gla", true, json{{"enabled", true}, {"lambda", "learned"}, {"lambda_init", 0.3}})});
  v.push_back({"linear+ccq", config("linear", true, json{{"enabled", true}, {"lambda", "learned"}})});
  v.push_back({"gdn+ccq fixed uncentered",
               config("gdn", true, json{{"enabled", true}, {"lambda", 0.4}, {"centered", false}})});
  v.push_back({"carve+ccq", config("carve", true, json{{"enabled", true}, {"lambda", "learned"}})});
  v.push_back({"carve frozen content", config("carve", true, json{{"enabled", false}},
                                              json{{"freeze_content", true}})});
  auto routed = [](const char* kind, const char* routing) {
    auto c = config(kind);
    c.routing = routing;
    c.model["routing"] = routing;
    return c;
  };
  v.push_back({"gdn cler", routed("gdn", "cler")});
  v.push_back({"kda cler_h", routed("kda", "cler_h")});
  v.push_back({"deltanet clvr", routed("deltanet", "clvr")});
  v.push_back({"gdn2 cler", routed("gdn2", "cler")});
  v.push_back({"carve cler", routed("carve", "cler")});
  v.push_back({"gdn grouped v heads", grouped(config("gdn"))});
  v.push_back({"kda grouped v heads", grouped(config("kda"))});
  v.push_back({"gdn2 grouped v heads", grouped(config("gdn2"))});
  v.push_back({"carve grouped v heads", grouped(config("carve"))});
  auto l2 = config("gla");
  l2.model["qk_l2norm"] = true;
  v.push_back({"gla qk_l2norm", l2});
  v.push_back({"carve paper qkv", config("carve", true, json{{"enabled", false}}, json{{"qkv", "paper"}})});
  v.push_back({"gla+ccq grouped v heads",
               grouped(config("gla", true, json{{"enabled", true}, {"lambda", "learned"}, {"lambda_init", 0.3}}))});
  auto update = [&](const char* kind, const char* routing) {
    auto c = routed(kind, routing);
    c.model["routing_signal"] = "update";
    return c;
  };
  v.push_back({"deltanet cler update", update("deltanet", "cler")});
  v.push_back({"gdn cler_h update grouped", grouped(update("gdn", "cler_h"))});
  return v;
}

// The host parameters and the relative error every mixer family's tests share.
template <class T>
using Params = lar::test::HostParams<T>;
using lar::test::rel_err;

}  // namespace

TEST(LinearLayer, AllArchitecturesRegistered) {
  for (const char* k : kMixers) EXPECT_TRUE(tr::mixer_registered(k)) << k;
}

// The CUDA layers (cuda_layers/) register their factories with the trainer at static
// initialisation: a build with the CUDA backend has all of them and runs the linear mixers
// there; a build without has none, and the trainer says so by name.
TEST(LinearLayer, CudaLayersRegisterExactlyWithTheCudaBackend) {
  namespace mx = lar::trainer::mixers;
  const bool cuda = lar::kernels::backend_available("cuda");
  EXPECT_EQ(mx::cuda_linear_factory() != nullptr, cuda);
  EXPECT_EQ(mx::cuda_hedgehog_factory() != nullptr, cuda);
  EXPECT_EQ(mx::cuda_mamba2_factory() != nullptr, cuda);
  EXPECT_EQ(mx::cuda_mamba3_factory() != nullptr, cuda);
  for (const char* k : {"linear", "gla", "deltanet", "gdn", "kda", "gdn2", "carve", "mamba2", "mamba3"})
    EXPECT_EQ(tr::mixer_runs_on_cuda(k), cuda) << k;
  EXPECT_TRUE(tr::mixer_runs_on_cuda("softmax"));
}

TEST(LinearLayer, FiniteDifferenceGradientsFp64) {
  auto be = lar::kernels::make_backend("cpu", 1, DType::f64);
  lar::kernels::Arena arena(*be);
  tr::ForwardContext ctx{*be, arena, true};
  const int B = 2, T = 7, d = 10;
  for (const auto& var : variants()) {
      const std::string& kind = var.name;
      auto m = tr::make_mixer(var.cfg);
      Params<double> P(*m, 5);
      std::mt19937 rng(9);
      std::normal_distribution<double> nd(0, 1);
      std::vector<double> x(B * T * d), R(B * T * d), y(B * T * d), dx(B * T * d, 7.0);
      for (auto& e : x) e = nd(rng);
      for (auto& e : R) e = nd(rng);
      // routing: the side channel published (into the loss through R2) and, for cler,
      // the one received from p(l)
      const bool pub = m->publishes(), cler = var.cfg.routing == "cler";
      const int Cv = cv_of(var.cfg);
      std::vector<double> rin(B * T * Cv), drin(B * T * Cv, 0.0), R2(B * T * Cv);
      for (auto& e : rin) e = nd(rng);
      for (auto& e : R2) e = nd(rng);
      EXPECT_EQ(m->side_dim(), pub ? Cv : 0);
      tr::Routing route;
      if (cler) route.in = Tensor(rin.data(), DType::f64, {B, T, Cv});
      Tensor X(x.data(), DType::f64, {B, T, d}), Y(y.data(), DType::f64, {B, T, d});
      auto loss = [&]() {
        arena.reset();
        m->forward(ctx, X, Y, route);
        double l = 0;
        for (size_t i = 0; i < y.size(); ++i) l += R[i] * y[i];
        if (pub) {
          EXPECT_EQ(route.out.numel(), B * T * Cv);
          for (size_t i = 0; i < R2.size(); ++i) l += R2[i] * route.out.ptr<double>()[i];
        }
        return l;
      };
      loss();
      if (pub) route.d_out = Tensor(R2.data(), DType::f64, {B, T, Cv});
      if (cler) route.d_in = Tensor(drin.data(), DType::f64, {B, T, Cv});
      Tensor dY(R.data(), DType::f64, {B, T, d}), dX(dx.data(), DType::f64, {B, T, d});
      m->backward(ctx, dY, dX, route);
      // fourth-order central differences: truncation and rounding both far below 1e-6
      auto fd_of = [&](std::vector<double>& v) {
        std::vector<double> fd(v.size());
        for (size_t i = 0; i < v.size(); ++i) {
          const double h = 1e-4, v0 = v[i];
          auto at = [&](double x) {
            v[i] = x;
            return loss();
          };
          fd[i] = (8 * (at(v0 + h) - at(v0 - h)) - (at(v0 + 2 * h) - at(v0 - 2 * h))) / (12 * h);
          v[i] = v0;
        }
        return fd;
      };
      EXPECT_LE(rel_err(dx, fd_of(x)), 1e-6) << kind << " dx (overwritten, not accumulated)";
      if (cler) {
        EXPECT_LE(rel_err(drin, fd_of(rin)), 1e-6) << kind << " routing d_in";
      }
      for (size_t i = 0; i < P.p.size(); ++i) {
        auto fd = fd_of(P.p[i]);
        EXPECT_LE(rel_err(P.g[i], fd), 1e-6) << kind << " " << P.specs[i].name;
        EXPECT_GT(rel_err(fd, std::vector<double>(fd.size(), 0.0)), 1e-8)
            << kind << " " << P.specs[i].name << " has no effect";
      }
    }
}

TEST(LinearLayer, DecodeStepByStepEqualsForward) {
  for (DType dt : {DType::f64, DType::f32}) {
    auto be = lar::kernels::make_backend("cpu", 2, dt);
    lar::kernels::Arena arena(*be);
    tr::ForwardContext ctx{*be, arena, false};
    const int B = 3, T = 11, d = 10;
    for (const auto& var : variants()) {
      const std::string& kind = var.name;
      auto m = tr::make_mixer(var.cfg);
      std::mt19937 rng(4);
      std::normal_distribution<double> nd(0, 1);
      std::vector<double> full(B * T * d), steps(B * T * d);
      auto run = [&](auto zero) {
        using F = decltype(zero);
        Params<F> P(*m, 3);
        std::vector<F> x(B * T * d), y(B * T * d), xs(B * d), ys(B * d);
        for (auto& e : x) e = (F)nd(rng);
        const int Cv = cv_of(var.cfg);
        const bool pub = m->publishes(), cler = var.cfg.routing == "cler";
        std::vector<F> rin(B * T * Cv), rs(B * Cv), side(B * T * Cv);
        for (auto& e : rin) e = (F)nd(rng);
        tr::Routing route;
        if (cler) route.in = Tensor(rin.data(), dt, {B, T, Cv});
        arena.reset();
        m->forward(ctx, Tensor(x.data(), dt, {B, T, d}), Tensor(y.data(), dt, {B, T, d}), route);
        if (pub) std::copy_n(route.out.ptr<F>(), side.size(), side.begin());
        auto st = m->init_state(*be, B, T);
        for (int t = 0; t < T; ++t) {
          for (int b = 0; b < B; ++b) {
            for (int i = 0; i < d; ++i) xs[b * d + i] = x[(b * T + t) * d + i];
            for (int i = 0; i < Cv; ++i) rs[b * Cv + i] = rin[(b * T + t) * Cv + i];
          }
          tr::Routing rstep;
          if (cler) rstep.in = Tensor(rs.data(), dt, {B, Cv});
          arena.reset();
          m->step(ctx, Tensor(xs.data(), dt, {B, d}), Tensor(ys.data(), dt, {B, d}), *st, rstep);
          for (int b = 0; b < B; ++b)
            for (int i = 0; i < d; ++i) steps[(b * T + t) * d + i] = ys[b * d + i];
          if (pub) {
            for (int b = 0; b < B; ++b)
              for (int i = 0; i < Cv; ++i) {
                EXPECT_NEAR(rstep.out.ptr<F>()[b * Cv + i], side[(b * T + t) * Cv + i],
                            dt == DType::f64 ? 1e-12 : 1e-4)
                    << kind << " side channel";
              }
          }
        }
        for (size_t i = 0; i < y.size(); ++i) full[i] = y[i];
      };
      if (dt == DType::f64)
        run(0.0);
      else
        run(0.0f);
      EXPECT_LE(rel_err(steps, full), dt == DType::f64 ? 1e-12 : 1e-5) << kind;
      EXPECT_GT(rel_err(full, std::vector<double>(full.size(), 0.0)), 0.5) << kind;
    }
  }
}

TEST(LinearLayer, ParameterListsFollowTheMixer) {
  auto names = [](const char* kind) {
    std::vector<std::string> n;
    for (auto& s : tr::make_mixer(config(kind))->params()) n.push_back(s.name);
    return n;
  };
  auto has = [&](const char* kind, const char* p) {
    auto n = names(kind);
    return std::find(n.begin(), n.end(), p) != n.end();
  };
  EXPECT_FALSE(has("linear", "w_beta"));
  EXPECT_TRUE(has("deltanet", "w_beta"));
  EXPECT_FALSE(has("deltanet", "A_log"));
  EXPECT_TRUE(has("gdn", "w_a"));
  EXPECT_TRUE(has("kda", "gate_w1"));
  EXPECT_TRUE(has("gla", "gate_bias"));
  EXPECT_TRUE(has("gdn2", "w_erase"));
  EXPECT_TRUE(has("gdn2", "w_write"));
  for (auto& s : tr::make_mixer(config("gdn"))->params()) {
    if (s.name == "A_log") {
      EXPECT_EQ(s.kind, tr::ParamKind::scalar);
      EXPECT_NEAR(s.init.b, std::log(16.0), 1e-12);
    }
    if (s.name == "dt_bias") {
      // softplus(dt_bias) spans [1e-3, 1e-1]
      EXPECT_NEAR(std::log1p(std::exp(s.init.a)), 1e-3, 1e-12);
      EXPECT_NEAR(std::log1p(std::exp(s.init.b)), 1e-1, 1e-12);
    }
  }
}

// The whole parameter list of each mixer, in declaration order (checkpoints and the CUDA
// layer's fused projections — [W_β; W_a], [Wq; Wk; Wv] — depend on it): d = 10, 2 heads,
// dk = 4, dv = 3, gate rank 3, conv 3.
TEST(LinearLayer, ParameterListsInOrder) {
  auto list = [](const tr::MixerConfig& c) {
    std::string out;
    for (auto& s : tr::make_mixer(c)->params()) {
      out += s.name + "[";
      for (std::size_t i = 0; i < s.shape.size(); ++i) out += (i ? "," : "") + std::to_string(s.shape[i]);
      out += "] ";
    }
    return out;
  };
  const std::string qkv = "wq[8,10] wk[8,10] wv[6,10] conv_q[8,3] conv_k[8,3] conv_v[6,3] ";
  const std::string out = "o_norm[3] w_gate[6,10] wo[10,6] ";
  const std::string low_rank = "gate_w1[3,10] gate_w2[8,3] ";
  EXPECT_EQ(list(config("linear")), qkv + out);
  EXPECT_EQ(list(config("gla")), qkv + low_rank + "gate_bias[8] " + out);
  EXPECT_EQ(list(config("deltanet")), qkv + "w_beta[2,10] " + out);
  EXPECT_EQ(list(config("gdn")), qkv + "w_beta[2,10] w_a[2,10] A_log[2] dt_bias[2] " + out);
  EXPECT_EQ(list(config("kda")), qkv + low_rank + "w_beta[2,10] A_log[2] dt_bias[8] " + out);
  EXPECT_EQ(list(config("gdn2")), qkv + low_rank + "A_log[2] dt_bias[8] w_erase[8,10] w_write[6,10] " + out);
  EXPECT_EQ(list(config("carve")), qkv + low_rank +
                                       "A_log[2] dt_bias[8] w_erase[8,10] w_write[2,10] content_u1[4,3] "
                                       "content_u2[8,2] " +
                                       out);
  EXPECT_EQ(list(config("gdn", false)), "wq[8,10] wk[8,10] wv[6,10] w_beta[2,10] w_a[2,10] A_log[2] dt_bias[2] " + out);
  EXPECT_EQ(list(config("gla", true, json{{"enabled", true}})),
            qkv + low_rank + "gate_bias[8] ccq_w_lambda[2,8] ccq_b_lambda[2] " + out);
  auto cler = config("deltanet");
  cler.routing = "cler";
  EXPECT_EQ(list(cler), qkv + "w_beta[2,10] cler_gamma[1] " + out);
}

// Each mixer's description (decay, erase, write, kernel family) says what its recurrence
// (kernels/linear/mixers.hpp) takes: a per-channel or per-head gate, β, the gated erase/write.
TEST(LinearLayer, MixerDescriptionsMatchTheRecurrences) {
  namespace lk = lar::kernels::cpu::linear;
  using D = tr::mixers::MixerDesc::Decay;
  for (lk::Mixer m : {lk::Mixer::linear, lk::Mixer::gla, lk::Mixer::deltanet, lk::Mixer::gdn, lk::Mixer::kda,
                      lk::Mixer::gdn2}) {
    SCOPED_TRACE(lk::mixer_name(m));
    const tr::mixers::MixerDesc md = tr::mixers::describe(m);
    const lk::GateKind gk = md.decay == D::none   ? lk::GateKind::none
                            : md.decay == D::head ? lk::GateKind::scalar
                                                  : lk::GateKind::channel;
    // linear runs gla's channel kernel with g = 0, but its recurrence has no gate
    EXPECT_EQ(gk, lk::gate_kind(m));
    EXPECT_EQ(md.beta(), lk::uses_beta(m));
    EXPECT_EQ(md.update != tr::mixers::MixerDesc::Update::add, lk::is_delta_rule(m));
    EXPECT_EQ(md.gated(), m == lk::Mixer::gdn2);
    EXPECT_EQ(md.family == tr::mixers::MixerDesc::Family::delta_rule, m == lk::Mixer::deltanet || m == lk::Mixer::gdn);
  }
}

// The decay gates of every Mamba-2-style mixer start as in fla / Mamba-2 (docs/architectures.md):
// A = exp(A_log) in [1, 16] (one per head), dt = softplus(dt_bias) in [1e-3, 1e-1] (one per
// head for gdn, one per key channel for kda / gdn2 / carve), neither weight-decayed. A
// decay that starts much stronger (or an A_log / dt_bias mix-up) shows here.
TEST(LinearLayer, DecayGateInitIsTheMamba2Rule) {
  const int H = 2, dk = 4;  // config(): 2 heads, head_dim 4
  for (const char* kind : {"gdn", "kda", "gdn2", "carve"}) {
    auto m = tr::make_mixer(config(kind));
    int seen = 0;
    for (auto& s : m->params()) {
      if (s.name == "A_log") {
        ++seen;
        EXPECT_EQ(s.shape, std::vector<int64_t>({H})) << kind;
        EXPECT_EQ(s.kind, tr::ParamKind::scalar) << kind;
        ASSERT_EQ(s.init.kind, tr::InitRule::uniform) << kind;
        EXPECT_NEAR(std::exp(s.init.a), 1.0, 1e-12) << kind;
        EXPECT_NEAR(std::exp(s.init.b), 16.0, 1e-12) << kind;
      }
      if (s.name == "dt_bias") {
        ++seen;
        const int64_t n = std::string(kind) == "gdn" ? H : H * dk;
        EXPECT_EQ(s.shape, std::vector<int64_t>({n})) << kind;
        EXPECT_EQ(s.kind, tr::ParamKind::scalar) << kind;
        ASSERT_EQ(s.init.kind, tr::InitRule::uniform) << kind;
        EXPECT_NEAR(std::log1p(std::exp(s.init.a)), 1e-3, 1e-12) << kind;
        EXPECT_NEAR(std::log1p(std::exp(s.init.b)), 1e-1, 1e-12) << kind;
      }
    }
    EXPECT_EQ(seen, 2) << kind;
  }
  // GLA's gate starts at logsigmoid(0)/16 = −log 2/16 per token (zero bias, small weights).
  for (auto& s : tr::make_mixer(config("gla"))->params())
    if (s.name == "gate_bias") {
      EXPECT_EQ(s.init.kind, tr::InitRule::constant);
      EXPECT_EQ(s.init.a, 0.0);
      EXPECT_EQ(s.kind, tr::ParamKind::bias);
    }
}

TEST(LinearLayer, UnsupportedOptionsAreUserErrors) {
  auto c = config("gdn");
  c.routing = "sideways";
  try {
    tr::make_mixer(c);
    FAIL() << "expected UserError";
  } catch (const lar::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("sideways"), std::string::npos);
  }
  c = config("gdn");
  c.model["chunk_size"] = 0;
  EXPECT_THROW(tr::make_mixer(c), lar::UserError);
}

// disable_at_eval: training reads through CCQ, evaluation reads with λ = 0, i.e. exactly the
// backbone without CCQ (same parameters).
TEST(LinearLayer, CcqDisableAtEvalReadsWithoutCorrection) {
  auto be = lar::kernels::make_backend("cpu", 1, DType::f64);
  lar::kernels::Arena arena(*be);
  const int B = 2, T = 9, d = 10;
  auto with = tr::make_mixer(config("gla", true, json{{"enabled", true}, {"lambda", "learned"},
                                                       {"lambda_init", 0.5}, {"disable_at_eval", true}}));
  auto without = tr::make_mixer(config("gla"));
  Params<double> P(*with, 7);
  Params<double> Q(*without, 8);
  auto ws = with->params(), wos = without->params();
  for (size_t i = 0; i < wos.size(); ++i)
    for (size_t j = 0; j < ws.size(); ++j)
      if (ws[j].name == wos[i].name) Q.p[i] = P.p[j];
  std::mt19937 rng(2);
  std::normal_distribution<double> nd(0, 1);
  std::vector<double> x(B * T * d), y_train(x.size()), y_eval(x.size()), y_plain(x.size());
  for (auto& e : x) e = nd(rng);
  tr::Routing route;
  Tensor X(x.data(), DType::f64, {B, T, d});
  tr::ForwardContext train{*be, arena, true}, eval{*be, arena, false};
  with->forward(train, X, Tensor(y_train.data(), DType::f64, {B, T, d}), route);
  with->forward(eval, X, Tensor(y_eval.data(), DType::f64, {B, T, d}), route);
  without->forward(eval, X, Tensor(y_plain.data(), DType::f64, {B, T, d}), route);
  // the plain gla layer does not normalise q, k; CCQ's does, so compare against a CCQ layer
  // with λ fixed at 0 instead
  auto zero = tr::make_mixer(config("gla", true, json{{"enabled", true}, {"lambda", 0.0}}));
  Params<double> Z(*zero, 9);
  auto zs = zero->params();
  for (size_t i = 0; i < zs.size(); ++i)
    for (size_t j = 0; j < ws.size(); ++j)
      if (ws[j].name == zs[i].name) Z.p[i] = P.p[j];
  std::vector<double> y_zero(x.size());
  zero->forward(train, X, Tensor(y_zero.data(), DType::f64, {B, T, d}), route);
  EXPECT_EQ(y_eval, y_zero);
  // ... which is GLA with q, k L2-normalised and no CCQ (model.qk_l2norm): CCQ's matched control
  auto l2cfg = config("gla");
  l2cfg.model["qk_l2norm"] = true;
  auto l2 = tr::make_mixer(l2cfg);
  Params<double> L2P(*l2, 10);
  auto ls = l2->params();
  for (size_t i = 0; i < ls.size(); ++i)
    for (size_t j = 0; j < ws.size(); ++j)
      if (ws[j].name == ls[i].name) L2P.p[i] = P.p[j];
  std::vector<double> y_l2(x.size());
  l2->forward(eval, X, Tensor(y_l2.data(), DType::f64, {B, T, d}), route);
  EXPECT_LE(rel_err(y_l2, y_eval), 1e-12);
  EXPECT_GT(rel_err(y_train, y_eval), 1e-3);
  EXPECT_GT(rel_err(y_plain, y_eval), 1e-3);  // normalised q, k make it a different layer
}

TEST(LinearLayer, CcqAndCarveParameters) {
  auto find = [](const tr::MixerConfig& c, const std::string& name) -> std::optional<tr::ParamSpec> {
    for (auto& s : tr::make_mixer(c)->params())
      if (s.name == name) return s;
    return std::nullopt;
  };
  auto ccq = config("gdn", true, json{{"enabled", true}, {"lambda", "learned"}, {"lambda_init", 0.01}});
  auto b = find(ccq, "ccq_b_lambda");
  ASSERT_TRUE(b.has_value());
  EXPECT_NEAR(1.0 / (1.0 + std::exp(-b->init.a)), 0.01, 1e-12);  // λ ≈ 0.01 at init
  auto w = find(ccq, "ccq_w_lambda");
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->init.kind, tr::InitRule::constant);
  EXPECT_EQ(w->init.a, 0.0);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 8}));  // [H, H·dk]: from the raw query projection
  EXPECT_FALSE(find(config("gdn", true, json{{"enabled", true}, {"lambda", 0.1}}), "ccq_w_lambda"));
  auto u2 = find(config("carve"), "content_u2");
  ASSERT_TRUE(u2.has_value());
  EXPECT_EQ(u2->init.kind, tr::InitRule::constant);
  EXPECT_EQ(u2->init.a, 0.0);
  EXPECT_EQ(find(config("carve"), "w_write")->shape, (std::vector<int64_t>{2, 10}));
  EXPECT_FALSE(find(config("carve", true, json{{"enabled", false}}, json{{"freeze_content", true}}),
                    "content_u2"));
  // the paper's q, k, v: no conv parameters (and no L2 norm, checked by the gradients)
  EXPECT_FALSE(find(config("carve", true, json{{"enabled", false}}, json{{"qkv", "paper"}}), "conv_q"));
  EXPECT_TRUE(find(config("carve"), "conv_q"));
  auto bad = config("carve", true, json{{"enabled", false}}, json{{"content_rank", 33}});
  try {
    tr::make_mixer(bad);
    FAIL() << "expected UserError";
  } catch (const lar::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("content_rank"), std::string::npos);
  }
}

// Routing never reads a future token: perturbing x at t+1 leaves y and the side channel at
// positions ≤ t unchanged.
TEST(LinearLayer, RoutingIsCausal) {
  auto be = lar::kernels::make_backend("cpu", 1, DType::f64);
  lar::kernels::Arena arena(*be);
  tr::ForwardContext ctx{*be, arena, true};
  const int B = 1, T = 12, d = 10, t0 = 6;
  for (const auto& var : variants()) {
    if (var.cfg.routing == "none") continue;
    const int Cv = cv_of(var.cfg);
    auto m = tr::make_mixer(var.cfg);
    Params<double> P(*m, 6);
    std::mt19937 rng(5);
    std::normal_distribution<double> nd(0, 1);
    std::vector<double> x(B * T * d), rin(B * T * Cv), y1(x.size()), y2(x.size());
    for (auto& e : x) e = nd(rng);
    for (auto& e : rin) e = nd(rng);
    tr::Routing route;
    if (var.cfg.routing == "cler") route.in = Tensor(rin.data(), DType::f64, {B, T, Cv});
    arena.reset();
    m->forward(ctx, Tensor(x.data(), DType::f64, {B, T, d}), Tensor(y1.data(), DType::f64, {B, T, d}), route);
    std::vector<double> s1(route.out.ptr<double>(), route.out.ptr<double>() + B * T * Cv);
    for (int i = 0; i < d; ++i) x[(t0 + 1) * d + i] += 1.0;
    for (int i = 0; i < Cv; ++i) rin[(t0 + 1) * Cv + i] += 1.0;
    arena.reset();
    m->forward(ctx, Tensor(x.data(), DType::f64, {B, T, d}), Tensor(y2.data(), DType::f64, {B, T, d}), route);
    const double* s2 = route.out.ptr<double>();
    // Equal to rounding: with per-channel gates the chunkwise form picks its intra-chunk
    // path (and the reference point of the factored exponentials) from the whole chunk's
    // decay span, so a later token of the same chunk can change the last bits.
    for (int i = 0; i < (t0 + 1) * d; ++i) EXPECT_NEAR(y1[i], y2[i], 1e-12) << var.name;
    for (int i = 0; i < (t0 + 1) * Cv; ++i) EXPECT_NEAR(s1[i], s2[i], 1e-12) << var.name;
    double later = 0;
    for (int i = (t0 + 1) * Cv; i < T * Cv; ++i) later += std::abs(s1[i] - s2[i]);
    EXPECT_GT(later, 1e-6) << var.name;
  }
}

TEST(LinearLayer, RoutingNeedsADeltaRule) {
  auto c = config("gla");
  c.routing = "cler_h";
  try {
    tr::make_mixer(c);
    FAIL() << "expected UserError";
  } catch (const lar::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("delta-rule"), std::string::npos);
  }
  auto g = config("gdn");
  g.routing = "cler";
  auto m = tr::make_mixer(g);
  EXPECT_TRUE(m->publishes());
  bool has_gamma = false;
  for (auto& s : m->params())
    if (s.name == "cler_gamma") has_gamma = s.init.kind == tr::InitRule::constant && s.init.a == 0.0;
  EXPECT_TRUE(has_gamma);
}

// Grouped value heads are the ordinary layer over n_v_heads heads with q, k (projection and
// conv rows) repeated per group: same output from the same parameters.
TEST(LinearLayer, GroupedValueHeadsEqualRepeatedKeyHeads) {
  auto be = lar::kernels::make_backend("cpu", 1, DType::f64);
  lar::kernels::Arena arena(*be);
  tr::ForwardContext ctx{*be, arena, false};
  const int B = 2, T = 9, d = 10, dk = 4, Hk = 2, H = 4, G = H / Hk;
  for (const char* kind : {"deltanet", "gdn", "kda", "gdn2", "carve", "gla"}) {
    auto g = tr::make_mixer(grouped(config(kind)));
    auto plain_cfg = config(kind);
    plain_cfg.n_heads = H;
    auto p = tr::make_mixer(plain_cfg);
    Params<double> PG(*g, 11), PP(*p, 12);
    auto gs = g->params(), ps = p->params();
    ASSERT_EQ(gs.size(), ps.size()) << kind;
    for (size_t i = 0; i < ps.size(); ++i) {
      ASSERT_EQ(gs[i].name, ps[i].name) << kind;
      const bool qk = ps[i].name == "wq" || ps[i].name == "wk" || ps[i].name == "conv_q" || ps[i].name == "conv_k";
      if (!qk) {
        ASSERT_EQ(gs[i].shape, ps[i].shape) << kind << " " << ps[i].name;
        PP.p[i] = PG.p[i];
        continue;
      }
      EXPECT_EQ(gs[i].shape[0], Hk * dk) << kind << " " << ps[i].name;
      EXPECT_EQ(ps[i].shape[0], H * dk) << kind << " " << ps[i].name;
      const int64_t cols = ps[i].shape[1];
      for (int h = 0; h < H; ++h)
        for (int r = 0; r < dk; ++r)
          for (int64_t c = 0; c < cols; ++c)
            PP.p[i][(h * dk + r) * cols + c] = PG.p[i][((h / G) * dk + r) * cols + c];
    }
    std::mt19937 rng(3);
    std::normal_distribution<double> nd(0, 1);
    std::vector<double> x(B * T * d), yg(x.size()), yp(x.size());
    for (auto& e : x) e = nd(rng);
    tr::Routing r1, r2;
    arena.reset();
    g->forward(ctx, Tensor(x.data(), DType::f64, {B, T, d}), Tensor(yg.data(), DType::f64, {B, T, d}), r1);
    p->forward(ctx, Tensor(x.data(), DType::f64, {B, T, d}), Tensor(yp.data(), DType::f64, {B, T, d}), r2);
    EXPECT_LE(rel_err(yg, yp), 1e-12) << kind;
    EXPECT_GT(rel_err(yp, std::vector<double>(yp.size(), 0.0)), 0.1) << kind;
  }
}

TEST(LinearLayer, GroupedValueHeadShapesAndErrors) {
  auto find = [](const tr::MixerConfig& c, const std::string& name) -> std::vector<int64_t> {
    for (auto& s : tr::make_mixer(c)->params())
      if (s.name == name) return s.shape;
    return {};
  };
  auto c = grouped(config("kda"));  // 2 key heads, 4 value heads, dk 4, dv 3
  EXPECT_EQ(find(c, "wq"), (std::vector<int64_t>{8, 10}));
  EXPECT_EQ(find(c, "wv"), (std::vector<int64_t>{12, 10}));
  EXPECT_EQ(find(c, "w_beta"), (std::vector<int64_t>{4, 10}));
  EXPECT_EQ(find(c, "gate_w2"), (std::vector<int64_t>{16, 3}));  // per key channel of a value head
  EXPECT_EQ(find(c, "A_log"), (std::vector<int64_t>{4}));
  EXPECT_EQ(find(c, "w_gate"), (std::vector<int64_t>{12, 10}));
  EXPECT_EQ(tr::make_mixer(c)->side_dim(), 0);
  auto bad = config("gdn");
  bad.n_v_heads = 3;
  try {
    tr::make_mixer(bad);
    FAIL() << "expected UserError";
  } catch (const lar::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_v_heads: 3 value heads are not a multiple of the 2"),
              std::string::npos)
        << e.what();
  }
}

// routing_signal: update publishes β·r (fla's v_new) where residual publishes r, with the
// same parameters; gdn2 has no β and publishes its residual either way.
TEST(LinearLayer, RoutingSignalUpdateIsBetaTimesResidual) {
  auto be = lar::kernels::make_backend("cpu", 1, DType::f64);
  lar::kernels::Arena arena(*be);
  tr::ForwardContext ctx{*be, arena, true};
  const int B = 2, T = 7, d = 10, H = 2, dv = 3;
  for (const char* kind : {"deltanet", "gdn", "kda", "gdn2"}) {
    auto base = config(kind);
    base.routing = "cler_h";
    base.model["routing"] = "cler_h";
    auto upd = base;
    upd.model["routing_signal"] = "update";
    auto mr = tr::make_mixer(base), mu = tr::make_mixer(upd);
    Params<double> PR(*mr, 4), PU(*mu, 5);
    PU.p = PR.p;
    std::mt19937 rng(8);
    std::normal_distribution<double> nd(0, 1);
    std::vector<double> x(B * T * d), y(x.size());
    for (auto& e : x) e = nd(rng);
    tr::Routing rr, ru;
    Tensor X(x.data(), DType::f64, {B, T, d}), Y(y.data(), DType::f64, {B, T, d});
    arena.reset();
    mr->forward(ctx, X, Y, rr);
    std::vector<double> sr(rr.out.ptr<double>(), rr.out.ptr<double>() + B * T * H * dv);
    mu->forward(ctx, X, Y, ru);
    const double* su = ru.out.ptr<double>();
    const auto specs = mr->params();
    const std::vector<double>* wb = nullptr;
    for (size_t i = 0; i < specs.size(); ++i)
      if (specs[i].name == "w_beta") wb = &PR.p[i];
    for (int n = 0; n < B * T; ++n)
      for (int h = 0; h < H; ++h) {
        double beta = 1;
        if (wb) {
          double z = 0;
          for (int i = 0; i < d; ++i) z += (*wb)[h * d + i] * x[n * d + i];
          beta = 1 / (1 + std::exp(-z));
        }
        for (int i = 0; i < dv; ++i) {
          const int j = (n * H + h) * dv + i;
          EXPECT_NEAR(su[j], beta * sr[j], 1e-12) << kind << " token " << n << " head " << h;
        }
      }
  }
}

// What the CUDA layer cannot run yet is named by trainer::cuda_unsupported (CUDA builds).
TEST(LinearLayer, CudaRefusesTheOptionsItLacks) {
  json plain = lar::with_defaults(json{{"model", {{"architecture", "gdn"}, {"stack", "pure"}, {"d_model", 128},
                                                  {"n_heads", 2}, {"routing", "cler_h"}}}})["model"];
  if (!tr::cuda_unsupported(plain).empty()) GTEST_SKIP() << "no CUDA linear mixers: " << tr::cuda_unsupported(plain);
  auto with = [&](const char* key, json v) {
    json m = plain;
    m[key] = v;
    return tr::cuda_unsupported(m);
  };
  // grouped value heads run with every routing, CCQ, CARVE and wide key heads (the grouped chunk
  // kernels, or q, k repeated per group where the query differs between the value heads)
  EXPECT_EQ(with("n_v_heads", 4), "");
  {
    json g = plain;
    g["n_v_heads"] = 4;
    for (const char* r : {"none", "cler", "clvr"}) {
      g["routing"] = r;
      EXPECT_EQ(tr::cuda_unsupported(g), "") << r;
      json c = g;
      c["ccq"]["enabled"] = true;
      EXPECT_EQ(tr::cuda_unsupported(c), "") << r << " ccq";
    }
    g["routing"] = "clvr";
    g["architecture"] = "carve";
    EXPECT_EQ(tr::cuda_unsupported(g), "");
    g["architecture"] = "gdn";
    g["routing"] = "none";
    g["head_dim"] = 128;
    g["value_dim"] = 128;
    EXPECT_EQ(tr::cuda_unsupported(g), "");  // grouped wide key heads
    g["ccq"]["enabled"] = true;
    EXPECT_EQ(tr::cuda_unsupported(g), "");
  }
  // the LAA routing variants: refused by name while their gate is closed
  json clvr = plain;
  clvr["routing"] = "clvr";
  clvr["routing_inject"] = "layer";
  if (lar::trainer::mixers::kLaaRoutingCudaVerified) {
    EXPECT_EQ(with("routing_signal", "update"), "");
    EXPECT_EQ(tr::cuda_unsupported(clvr), "");
  } else {
    EXPECT_NE(with("routing_signal", "update").find("model.routing_signal"), std::string::npos);
    EXPECT_NE(tr::cuda_unsupported(clvr).find("model.routing_inject"), std::string::npos);
  }
  EXPECT_EQ(with("linear_heads", 4), "");
  json carve = plain;
  carve["architecture"] = "carve";
  carve["routing"] = "clvr";
  EXPECT_EQ(tr::cuda_unsupported(carve), "");
  carve["carve"]["qkv"] = "paper";
  EXPECT_NE(tr::cuda_unsupported(carve).find("model.carve.qkv"), std::string::npos);
  // key heads of 128 and 256 run (the wide-key kernels, CCQ too), without CARVE or cler/cler_h
  json wide = plain;
  wide["routing"] = "none";
  for (int dk : {128, 256}) {
    wide["head_dim"] = dk;
    wide["value_dim"] = 512;
    EXPECT_EQ(tr::cuda_unsupported(wide), "") << dk;
    json w = wide;
    w["routing"] = "clvr";
    EXPECT_EQ(tr::cuda_unsupported(w), "") << dk;
    w["routing"] = "cler_h";
    EXPECT_NE(tr::cuda_unsupported(w).find("model.head_dim: the cler/cler_h readouts"), std::string::npos)
        << tr::cuda_unsupported(w);
    w = wide;
    w["ccq"]["enabled"] = true;
    EXPECT_EQ(tr::cuda_unsupported(w), "") << dk;
    w = wide;
    w["architecture"] = "carve";
    w["value_dim"] = 0;
    // CARVE at key heads of 128: the recurrent wide CARVE kernels (gated); at 256: none
    if (dk == 128 && lar::trainer::mixers::kCarveWideCudaVerified)
      EXPECT_EQ(tr::cuda_unsupported(w), "");
    else
      EXPECT_NE(tr::cuda_unsupported(w).find("model.head_dim: CARVE"), std::string::npos) << tr::cuda_unsupported(w);
  }
  wide["head_dim"] = 96;
  wide["value_dim"] = 0;
  EXPECT_NE(tr::cuda_unsupported(wide).find("model.head_dim: the linear CUDA kernels take 64, 128 or 256, got 96"),
            std::string::npos)
      << tr::cuda_unsupported(wide);
}
