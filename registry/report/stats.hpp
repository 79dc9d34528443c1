#pragma once
// Small, exact-enough statistics for paper tables: sample mean/std, Welch's t-test
// (with the Student t CDF through the regularized incomplete beta function) and
// Spearman rank correlation. Plain doubles in, plain doubles out, no allocation games.
#include <optional>
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

}  // namespace lar::report
