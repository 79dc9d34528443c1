#pragma once
// Helpers for fp64 finite-difference gradient checks on the CPU backend.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "kernels/backend.hpp"
#include "trainer/rng.hpp"

namespace lar::test {

inline std::vector<double> random_vec(std::size_t n, uint64_t seed, double scale = 1.0) {
  trainer::Rng r(seed);
  std::vector<double> v(n);
  for (auto& x : v) x = scale * r.normal();
  return v;
}

// Checks d(loss)/d(x[i]) against `analytic[i]` by central differences for every index of
// x (or `max_checks` evenly spread ones). `loss` reads x through the pointer.
inline void check_grad(const char* what, double* x, std::size_t n, const std::vector<double>& analytic,
                       const std::function<double()>& loss, double tol = 1e-6, std::size_t max_checks = 0,
                       double eps = 1e-5) {
  ASSERT_EQ(analytic.size(), n) << what;
  std::size_t stride = max_checks && n > max_checks ? n / max_checks : 1;
  double worst = 0;
  for (std::size_t i = 0; i < n; i += stride) {
    const double keep = x[i];
    x[i] = keep + eps;
    const double lp = loss();
    x[i] = keep - eps;
    const double lm = loss();
    x[i] = keep;
    const double num = (lp - lm) / (2 * eps);
    const double err = std::abs(num - analytic[i]) / std::max(1.0, std::abs(num));
    worst = std::max(worst, err);
    EXPECT_LT(err, tol) << what << "[" << i << "]: numeric " << num << " analytic " << analytic[i];
    if (err >= tol) return;  // one report per tensor is enough
  }
  ::testing::Test::RecordProperty(what, std::to_string(worst));
}

inline double dot(const std::vector<double>& a, const double* b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace lar::test
