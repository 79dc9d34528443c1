#pragma once
// Checks every mixer family must pass through the trainer's Mixer factory, on the CPU
// backend: fp64 finite-difference gradients of the input and of every parameter (each one
// must also matter), and decode (step by step, the recurrent form) equal to forward (the
// chunkwise form). Used by the per-family test files.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "trainer/mixer.hpp"

namespace lar::test {

using kernels::DType;
using kernels::Tensor;
namespace tr = lar::trainer;

// Parameters in host vectors, from each spec's InitRule (own RNG); constants are perturbed
// so that every parameter has an effect the check can see.
template <class T>
struct HostParams {
  std::vector<std::vector<T>> p, g;
  std::vector<tr::ParamSpec> specs;
  HostParams(tr::Mixer& m, unsigned seed) {
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
        else
          x = (T)(s.init.a + std::normal_distribution<double>(0, 0.1)(rng));
      }
    }
    const DType dt = sizeof(T) == 4 ? DType::f32 : DType::f64;
    for (size_t i = 0; i < specs.size(); ++i) {
      pt.emplace_back(p[i].data(), dt, specs[i].shape);
      gt.emplace_back(g[i].data(), dt, specs[i].shape);
    }
    m.bind(pt, gt);
  }
  std::vector<T>& operator[](const std::string& name) {
    for (size_t i = 0; i < specs.size(); ++i)
      if (specs[i].name == name) return p[i];
    throw std::runtime_error("no parameter " + name);
  }
};

inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Fourth-order central differences of loss = Σ R ⊙ mixer(x) against the backward pass.
// `tweak` may set parameter values after the random init (e.g. to leave a clamp).
template <class Tweak>
void check_gradients(const tr::MixerConfig& cfg, const char* what, int B, int T, Tweak tweak, double tol = 1e-6) {
  auto be = kernels::make_backend("cpu", 1, DType::f64);
  kernels::Arena arena(*be);
  tr::ForwardContext ctx{*be, arena, true};
  const int d = cfg.d_model;
  auto m = tr::make_mixer(cfg);
  HostParams<double> P(*m, 5);
  tweak(P);
  std::mt19937 rng(9);
  std::normal_distribution<double> nd(0, 1);
  std::vector<double> x(B * T * d), R(B * T * d), y(B * T * d), dx(B * T * d, 7.0);
  for (auto& e : x) e = nd(rng);
  for (auto& e : R) e = nd(rng);
  tr::Routing route;
  Tensor X(x.data(), DType::f64, {B, T, d}), Y(y.data(), DType::f64, {B, T, d});
  auto loss = [&]() {
    arena.reset();
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
      const double h = 1e-4, v0 = v[i];
      auto at = [&](double z) {
        v[i] = z;
        return loss();
      };
      fd[i] = (8 * (at(v0 + h) - at(v0 - h)) - (at(v0 + 2 * h) - at(v0 - 2 * h))) / (12 * h);
      v[i] = v0;
    }
    return fd;
  };
  EXPECT_LE(rel_err(dx, fd_of(x)), tol) << what << " dx (overwritten, not accumulated)";
  for (size_t i = 0; i < P.p.size(); ++i) {
    auto fd = fd_of(P.p[i]);
    EXPECT_LE(rel_err(P.g[i], fd), tol) << what << " " << P.specs[i].name;
    EXPECT_GT(rel_err(fd, std::vector<double>(fd.size(), 0.0)), 1e-8) << what << " " << P.specs[i].name << " has no effect";
  }
}

inline void check_gradients(const tr::MixerConfig& cfg, const char* what, int B = 2, int T = 7) {
  check_gradients(cfg, what, B, T, [](HostParams<double>&) {});
}

// step() position by position equals forward() over the whole sequence (f64 and f32).
inline void check_decode(const tr::MixerConfig& cfg, const char* what, int B = 3, int T = 11) {
  for (DType dt : {DType::f64, DType::f32}) {
    auto be = kernels::make_backend("cpu", 2, dt);
    kernels::Arena arena(*be);
    tr::ForwardContext ctx{*be, arena, false};
    const int d = cfg.d_model;
    auto m = tr::make_mixer(cfg);
    std::mt19937 rng(4);
    std::normal_distribution<double> nd(0, 1);
    std::vector<double> full(B * T * d), steps(B * T * d);
    auto run = [&](auto zero) {
      using F = decltype(zero);
      HostParams<F> P(*m, 3);
      std::vector<F> x(B * T * d), y(B * T * d), xs(B * d), ys(B * d);
      for (auto& e : x) e = (F)nd(rng);
      tr::Routing route;
      arena.reset();
      m->forward(ctx, Tensor(x.data(), dt, {B, T, d}), Tensor(y.data(), dt, {B, T, d}), route);
      auto st = m->init_state(*be, B, T);
      for (int t = 0; t < T; ++t) {
        for (int b = 0; b < B; ++b)
          for (int i = 0; i < d; ++i) xs[b * d + i] = x[(b * T + t) * d + i];
        tr::Routing rstep;
        arena.reset();
        m->step(ctx, Tensor(xs.data(), dt, {B, d}), Tensor(ys.data(), dt, {B, d}), *st, rstep);
        for (int b = 0; b < B; ++b)
          for (int i = 0; i < d; ++i) steps[(b * T + t) * d + i] = ys[b * d + i];
      }
      for (size_t i = 0; i < y.size(); ++i) full[i] = y[i];
    };
    if (dt == DType::f64)
      run(0.0);
    else
      run(0.0f);
    EXPECT_LE(rel_err(steps, full), dt == DType::f64 ? 1e-12 : 2e-5) << what;
    EXPECT_GT(rel_err(full, std::vector<double>(full.size(), 0.0)), 0.5) << what;
  }
}

}  // namespace lar::test
