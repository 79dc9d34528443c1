#include "registry/report/stats.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>

namespace lar::report {

SampleStats sample_stats(const std::vector<double>& xs) {
  SampleStats s;
  s.n = static_cast<int>(xs.size());
  if (xs.empty()) return s;
  s.mean = std::accumulate(xs.begin(), xs.end(), 0.0) / s.n;
  if (s.n >= 2) {
    double ss = 0;
    for (double x : xs) ss += (x - s.mean) * (x - s.mean);
    s.std = std::sqrt(ss / (s.n - 1));
  }
  return s;
}

namespace {

// Continued fraction for I_x(a,b) (Numerical Recipes §6.4 form), evaluated with the
// modified Lentz method. Converges fast for x < (a+1)/(a+b+2).
double beta_continued_fraction(double a, double b, double x) {
  constexpr int kMaxIter = 500;
  constexpr double kEps = 1e-15;
  constexpr double kTiny = 1e-300;
  const double qab = a + b, qap = a + 1, qam = a - 1;
  double c = 1, d = 1 - qab * x / qap;
  if (std::fabs(d) < kTiny) d = kTiny;
  d = 1 / d;
  double h = d;
  for (int m = 1; m <= kMaxIter; ++m) {
    const int m2 = 2 * m;
    // Even step.
    double aa = m * (b - m) * x / ((qam + m2) * (a + m2));
    d = 1 + aa * d;
    if (std::fabs(d) < kTiny) d = kTiny;
    c = 1 + aa / c;
    if (std::fabs(c) < kTiny) c = kTiny;
    d = 1 / d;
    h *= d * c;
    // Odd step.
    aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2));
    d = 1 + aa * d;
    if (std::fabs(d) < kTiny) d = kTiny;
    c = 1 + aa / c;
    if (std::fabs(c) < kTiny) c = kTiny;
    d = 1 / d;
    const double del = d * c;
    h *= del;
    if (std::fabs(del - 1) < kEps) return h;
  }
  return h;  // not converged to kEps; still accurate far beyond what a table prints
}

}  // namespace

double incomplete_beta(double a, double b, double x) {
  if (!(a > 0) || !(b > 0)) throw std::invalid_argument("incomplete_beta: a and b must be > 0");
  if (x <= 0) return 0;
  if (x >= 1) return 1;
  // Prefactor x^a (1−x)^b / (a B(a,b)), computed in log space.
  const double log_front = std::lgamma(a + b) - std::lgamma(a) - std::lgamma(b) + a * std::log(x) +
                           b * std::log1p(-x);
  const double front = std::exp(log_front);
  // Use the symmetry I_x(a,b) = 1 − I_{1−x}(b,a) where the fraction converges faster.
  if (x < (a + 1) / (a + b + 2)) return front * beta_continued_fraction(a, b, x) / a;
  return 1 - front * beta_continued_fraction(b, a, 1 - x) / b;
}

double student_t_cdf(double t, double df) {
  if (!(df > 0)) throw std::invalid_argument("student_t_cdf: df must be > 0");
  if (std::isinf(t)) return t > 0 ? 1 : 0;
  // P(|T| > |t|) = I_{df/(df+t²)}(df/2, 1/2).
  const double x = df / (df + t * t);
  const double tail = 0.5 * incomplete_beta(df / 2, 0.5, x);
  return t >= 0 ? 1 - tail : tail;
}

std::optional<WelchResult> welch_t_test(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() < 2 || b.size() < 2) return std::nullopt;
  const SampleStats sa = sample_stats(a), sb = sample_stats(b);
  const double va = sa.std * sa.std / sa.n, vb = sb.std * sb.std / sb.n;
  WelchResult r;
  r.diff = sa.mean - sb.mean;
  r.se = std::sqrt(va + vb);
  if (r.se == 0) {
    // Both sides constant: the difference is exact (infinitely significant) or nil.
    r.t = r.diff == 0 ? 0 : std::copysign(std::numeric_limits<double>::infinity(), r.diff);
    r.df = sa.n + sb.n - 2;
    r.p = r.diff == 0 ? 1 : 0;
    return r;
  }
  r.t = r.diff / r.se;
  r.df = (va + vb) * (va + vb) / (va * va / (sa.n - 1) + vb * vb / (sb.n - 1));
  // Two-sided p = 2·P(T > |t|) = I_{df/(df+t²)}(df/2, 1/2); computing the tail directly
  // (not as 1 − cdf) keeps its digits when p is tiny.
  r.p = incomplete_beta(r.df / 2, 0.5, r.df / (r.df + r.t * r.t));
  return r;
}

std::vector<double> average_ranks(const std::vector<double>& xs) {
  const size_t n = xs.size();
  std::vector<size_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](size_t i, size_t j) { return xs[i] < xs[j]; });
  std::vector<double> ranks(n);
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j + 1 < n && xs[idx[j + 1]] == xs[idx[i]]) ++j;
    const double r = (static_cast<double>(i) + static_cast<double>(j)) / 2 + 1;  // average of i+1..j+1
    for (size_t k = i; k <= j; ++k) ranks[idx[k]] = r;
    i = j + 1;
  }
  return ranks;
}

std::optional<double> spearman(const std::vector<double>& x, const std::vector<double>& y) {
  if (x.size() != y.size()) throw std::invalid_argument("spearman: samples differ in length");
  if (x.size() < 2) return std::nullopt;
  const auto rx = average_ranks(x), ry = average_ranks(y);
  const SampleStats sx = sample_stats(rx), sy = sample_stats(ry);
  if (sx.std == 0 || sy.std == 0) return std::nullopt;
  double cov = 0;
  for (size_t i = 0; i < rx.size(); ++i) cov += (rx[i] - sx.mean) * (ry[i] - sy.mean);
  cov /= static_cast<double>(rx.size() - 1);
  return cov / (sx.std * sy.std);
}

std::optional<double> kendall_tau_b(const std::vector<double>& x, const std::vector<double>& y) {
  if (x.size() != y.size()) throw std::invalid_argument("kendall_tau_b: samples differ in length");
  const size_t n = x.size();
  if (n < 2) return std::nullopt;
  double concordant = 0, discordant = 0, ties_x = 0, ties_y = 0;
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j) {
      const double dx = x[i] - x[j], dy = y[i] - y[j];
      if (dx == 0) ties_x += 1;
      if (dy == 0) ties_y += 1;
      if (dx == 0 || dy == 0) continue;
      ((dx > 0) == (dy > 0) ? concordant : discordant) += 1;
    }
  const double n0 = static_cast<double>(n) * static_cast<double>(n - 1) / 2;
  const double denom = std::sqrt((n0 - ties_x) * (n0 - ties_y));
  if (denom == 0) return std::nullopt;
  return (concordant - discordant) / denom;
}

std::optional<WelchResult> welch_linear(const std::vector<std::pair<double, std::vector<double>>>& terms) {
  if (terms.empty()) return std::nullopt;
  WelchResult r;
  double var = 0, df_denom = 0;
  for (const auto& [c, xs] : terms) {
    if (xs.size() < 2) return std::nullopt;
    const SampleStats s = sample_stats(xs);
    r.diff += c * s.mean;
    const double v = c * c * s.std * s.std / s.n;
    var += v;
    df_denom += v * v / (s.n - 1);
  }
  r.se = std::sqrt(var);
  if (r.se == 0) {
    r.t = r.diff == 0 ? 0 : std::copysign(std::numeric_limits<double>::infinity(), r.diff);
    double df = 0;
    for (const auto& t : terms) df += static_cast<double>(t.second.size()) - 1;
    r.df = df;
    r.p = r.diff == 0 ? 1 : 0;
    return r;
  }
  r.t = r.diff / r.se;
  r.df = var * var / df_denom;
  r.p = incomplete_beta(r.df / 2, 0.5, r.df / (r.df + r.t * r.t));
  return r;
}

double sign_test_p(int k, int n) {
  if (n <= 0) return 1;
  const int m = std::min(k, n - k);
  // Σ_{i ≤ m} C(n, i) / 2^n, in log space so that large n stays finite.
  double tail = 0;
  for (int i = 0; i <= m; ++i)
    tail += std::exp(std::lgamma(n + 1.0) - std::lgamma(i + 1.0) - std::lgamma(n - i + 1.0) - n * std::log(2.0));
  return std::min(1.0, 2 * tail);
}

double quantile(std::vector<double> values, double q) {
  if (values.empty()) throw std::invalid_argument("quantile: no values");
  std::sort(values.begin(), values.end());
  const double h = q * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(h));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (h - static_cast<double>(lo)) * (values[hi] - values[lo]);
}

Interval bootstrap_interval(const Groups& groups, const std::function<double(const Groups&)>& statistic, int resamples,
                            uint64_t seed, double level, std::vector<double>* draws) {
  if (resamples < 1) throw std::invalid_argument("bootstrap_interval: resamples must be ≥ 1");
  std::mt19937_64 rng(seed);
  // A 64-bit draw modulo n is the same on every platform (the standard distributions'
  // algorithms are implementation-defined); its bias, n / 2^64, is far below any effect.
  auto index = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  std::vector<double> stats;
  stats.reserve(static_cast<size_t>(resamples));
  Groups sample(groups.size());
  for (int b = 0; b < resamples; ++b) {
    for (size_t g = 0; g < groups.size(); ++g) {
      sample[g].resize(groups[g].size());
      for (auto& v : sample[g]) v = groups[g][index(groups[g].size())];
    }
    stats.push_back(statistic(sample));
  }
  Interval iv{quantile(stats, (1 - level) / 2), quantile(stats, 1 - (1 - level) / 2)};
  if (draws) *draws = std::move(stats);
  return iv;
}

}  // namespace lar::report
