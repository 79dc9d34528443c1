#pragma once
// Small, exact-enough statistics for paper tables: sample mean/std, Welch's t-test
// (with the Student t CDF through the regularized incomplete beta function) and
// Spearman rank correlation, Kendall's τ-b, the sign test and percentile bootstrap intervals. Plain doubles in, plain doubles out, no allocation games.
#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

namespace lar::report {

struct SampleStats {
  int n = 0;
  double mean = 0;
  double std = 0;  // sample standard deviation (n − 1); 0 when n < 2
};
SampleStats sample_stats(const std::vector<double>& xs);

// Regularized incomplete beta I_x(a, b), a, b > 0, 0 ≤ x ≤ 1 (continued fraction,
// modified Lentz; accurate to ~1e-12 for the arguments a t-test produces).
double incomplete_beta(double a, double b, double x);

// P(T ≤ t) for Student's t with `df` > 0 degrees of freedom (df need not be an integer).
double student_t_cdf(double t, double df);

struct WelchResult {
  double diff = 0;  // mean(a) − mean(b)
  double se = 0;    // sqrt(var_a/n_a + var_b/n_b)
  double t = 0;
  double df = 0;    // Welch–Satterthwaite
  double p = 1;     // two-sided
};
// Welch's unequal-variance t-test of a against b. nullopt unless both have ≥ 2 values.
// Zero variance on both sides with different means gives p = 0; equal means give p = 1.
std::optional<WelchResult> welch_t_test(const std::vector<double>& a, const std::vector<double>& b);

// Ranks 1..n, ties get the average rank.
std::vector<double> average_ranks(const std::vector<double>& xs);
// Spearman's ρ (Pearson correlation of average ranks). nullopt for n < 2 or a constant side.
std::optional<double> spearman(const std::vector<double>& x, const std::vector<double>& y);

// Kendall's τ-b: (concordant − discordant) / sqrt((n0 − ties_x)(n0 − ties_y)) over all
// n0 = n(n−1)/2 pairs. nullopt for n < 2 or a constant side.
std::optional<double> kendall_tau_b(const std::vector<double>& x, const std::vector<double>& y);

// Welch's test of a linear combination Σ c_k · mean(x_k) of independent samples against 0:
// se² = Σ c_k² s_k² / n_k, Welch–Satterthwaite df. With terms {(1, a), (−1, b)} it is
// welch_t_test(a, b). nullopt unless every sample has ≥ 2 values.
std::optional<WelchResult> welch_linear(const std::vector<std::pair<double, std::vector<double>>>& terms);

// Two-sided exact sign test: P(at least as extreme as k successes of n) under p = 1/2.
double sign_test_p(int k, int n);

// Linear-interpolation quantile (type 7) of values, q in [0, 1]; values need not be sorted.
double quantile(std::vector<double> values, double q);

struct Interval {
  double lo = 0, hi = 0;
};
// Percentile bootstrap: `resamples` times, every group is resampled with replacement
// (within itself, keeping its size) and `statistic` evaluated; returns the central `level`
// interval of those values, plus each value in `draws` when given. Deterministic for a
// given seed (mt19937_64, indices by modulo).
using Groups = std::vector<std::vector<double>>;
Interval bootstrap_interval(const Groups& groups, const std::function<double(const Groups&)>& statistic, int resamples,
                            uint64_t seed, double level = 0.95, std::vector<double>* draws = nullptr);

}  // namespace lar::report
