// The linear mixer layers (trainer/mixers/linear_mixer.cpp) through the trainer's Mixer
// factory: fp64 finite-difference gradients of every parameter and of the input, decode
// (step by step) equals forward, and configuration errors.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "trainer/mixer.hpp"

using lar::json;
using lar::kernels::DType;
using lar::kernels::Tensor;
namespace tr = lar::trainer;

namespace {

const char* kMixers[] = {"linear", "gla", "deltanet", "gdn", "kda", "gdn2"};

tr::MixerConfig config(const std::string& kind, bool conv = true) {
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
                 {"ccq", {{"enabled", false}}}};
  return c;
}

// Parameters in host vectors, initialised from each spec's InitRule (own RNG).
template <class T>
struct Params {
  std::vector<std::vector<T>> p, g;
  std::vector<tr::ParamSpec> specs;
  Params(tr::Mixer& m, unsigned seed) {
    specs = m.params();
    std::mt19937 rng(seed);
    std::vector<Tensor> pt, gt;
    for (auto& s : specs) {
      int64_t n = 1;
      for (auto d : s.shape) n *= d;
      p.emplace_back(n);
      g.emplace_back(n, T(0));
      for (auto& x : p.back()) {
        if (s.init.kind == tr::InitRule::normal)
          x = (T)std::normal_distribution<double>(0, s.init.a)(rng);
        else if (s.init.kind == tr::InitRule::uniform)
          x = (T)std::uniform_real_distribution<double>(s.init.a, s.init.b)(rng);
        else  // perturb constants so that every parameter matters in the check
          x = (T)(s.init.a + std::normal_distribution<double>(0, 0.1)(rng));
      }
    }
    for (size_t i = 0; i < specs.size(); ++i) {
      DType dt = sizeof(T) == 4 ? DType::f32 : DType::f64;
      pt.emplace_back(p[i].data(), dt, specs[i].shape);
      gt.emplace_back(g[i].data(), dt, specs[i].shape);
    }
    m.bind(pt, gt);
  }
};

double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace

TEST(LinearLayer, AllArchitecturesRegistered) {
  for (const char* k : kMixers) EXPECT_TRUE(tr::mixer_registered(k)) << k;
}

TEST(LinearLayer, FiniteDifferenceGradientsFp64) {
  auto be = lar::kernels::make_backend("cpu", 1, DType::f64);
  lar::kernels::Arena arena(*be);
  tr::ForwardContext ctx{*be, arena, true};
  const int B = 2, T = 7, d = 10;
  for (const char* kind : kMixers)
    for (bool conv : {true, false}) {
      if (!conv && std::string(kind) != "gdn") continue;
      auto m = tr::make_mixer(config(kind, conv));
      Params<double> P(*m, 5);
      std::mt19937 rng(9);
      std::normal_distribution<double> nd(0, 1);
      std::vector<double> x(B * T * d), R(B * T * d), y(B * T * d), dx(B * T * d, 7.0);
      for (auto& e : x) e = nd(rng);
      for (auto& e : R) e = nd(rng);
      tr::Routing route;
      Tensor X(x.data(), DType::f64, {B, T, d}), Y(y.data(), DType::f64, {B, T, d});
      auto loss = [&]() {
        m->forward(ctx, X, Y, route);
        double l = 0;
        for (size_t i = 0; i < y.size(); ++i) l += R[i] * y[i];
        return l;
      };
      loss();
      Tensor dY(R.data(), DType::f64, {B, T, d}), dX(dx.data(), DType::f64, {B, T, d});
      m->backward(ctx, dY, dX, route);
      auto fd_of = [&](std::vector<double>& v) {
        std::vector<double> fd(v.size());
        for (size_t i = 0; i < v.size(); ++i) {
          const double h = 1e-6, v0 = v[i];
          v[i] = v0 + h;
          double lp = loss();
          v[i] = v0 - h;
          double lm = loss();
          v[i] = v0;
          fd[i] = (lp - lm) / (2 * h);
        }
        return fd;
      };
      EXPECT_LE(rel_err(dx, fd_of(x)), 1e-6) << kind << " dx (overwritten, not accumulated)";
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
    for (const char* kind : kMixers) {
      auto m = tr::make_mixer(config(kind));
      std::mt19937 rng(4);
      std::normal_distribution<double> nd(0, 1);
      std::vector<double> full(B * T * d), steps(B * T * d);
      auto run = [&](auto zero) {
        using F = decltype(zero);
        Params<F> P(*m, 3);
        std::vector<F> x(B * T * d), y(B * T * d), xs(B * d), ys(B * d);
        for (auto& e : x) e = (F)nd(rng);
        tr::Routing route;
        m->forward(ctx, Tensor(x.data(), dt, {B, T, d}), Tensor(y.data(), dt, {B, T, d}), route);
        auto st = m->init_state(*be, B, T);
        for (int t = 0; t < T; ++t) {
          for (int b = 0; b < B; ++b)
            for (int i = 0; i < d; ++i) xs[b * d + i] = x[(b * T + t) * d + i];
          m->step(ctx, Tensor(xs.data(), dt, {B, d}), Tensor(ys.data(), dt, {B, d}), *st, route);
          for (int b = 0; b < B; ++b)
            for (int i = 0; i < d; ++i) steps[(b * T + t) * d + i] = ys[b * d + i];
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

TEST(LinearLayer, UnsupportedOptionsAreUserErrors) {
  auto c = config("gdn");
  c.routing = "cler";
  try {
    tr::make_mixer(c);
    FAIL() << "expected UserError";
  } catch (const lar::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("cler"), std::string::npos);
  }
  c = config("gdn");
  c.model["chunk_size"] = 0;
  EXPECT_THROW(tr::make_mixer(c), lar::UserError);
}
