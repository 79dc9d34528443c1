// Statistics against values computed by hand (and, for p-values, by numerical
// integration of the t density in an independent script).
#include <gtest/gtest.h>

#include <cmath>

#include "registry/report/stats.hpp"

using namespace lar::report;

TEST(Stats, MeanAndSampleStd) {
  auto s = sample_stats({2.31, 2.33, 2.32});
  EXPECT_EQ(s.n, 3);
  EXPECT_NEAR(s.mean, 2.32, 1e-12);
  EXPECT_NEAR(s.std, 0.01, 1e-12);  // sqrt((1e-4 + 1e-4 + 0) / 2)
  auto one = sample_stats({5.0});
  EXPECT_EQ(one.n, 1);
  EXPECT_EQ(one.mean, 5.0);
  EXPECT_EQ(one.std, 0.0);
  EXPECT_EQ(sample_stats({}).n, 0);
}

TEST(Stats, IncompleteBetaKnownValues) {
  // I_0.5(2,3) = Σ_{j=2..4} C(4,j) 0.5^4 = (6+4+1)/16
  EXPECT_NEAR(incomplete_beta(2, 3, 0.5), 11.0 / 16.0, 1e-13);
  // I_x(1,1) = x; I_x(a,1) = x^a
  EXPECT_NEAR(incomplete_beta(1, 1, 0.3), 0.3, 1e-13);
  EXPECT_NEAR(incomplete_beta(3, 1, 0.7), 0.343, 1e-13);
  // symmetry I_x(a,b) = 1 − I_{1−x}(b,a)
  EXPECT_NEAR(incomplete_beta(2.5, 0.5, 0.9), 1 - incomplete_beta(0.5, 2.5, 0.1), 1e-13);
  EXPECT_EQ(incomplete_beta(2, 3, 0), 0);
  EXPECT_EQ(incomplete_beta(2, 3, 1), 1);
  EXPECT_THROW(incomplete_beta(0, 1, 0.5), std::invalid_argument);
}

TEST(Stats, StudentTCdfKnownValues) {
  // df = 1 is Cauchy: P(T ≤ 1) = 3/4.
  EXPECT_NEAR(student_t_cdf(1.0, 1), 0.75, 1e-12);
  EXPECT_NEAR(student_t_cdf(0.0, 7), 0.5, 1e-15);
  // df = 2 has a closed form: F(t) = 1/2 + t / (2 sqrt(2 + t²)).
  EXPECT_NEAR(student_t_cdf(1.5, 2), 0.5 + 1.5 / (2 * std::sqrt(2 + 2.25)), 1e-12);
  // Table value: two-sided p of t = 2, df = 10 is 0.0733880.
  EXPECT_NEAR(2 * (1 - student_t_cdf(2.0, 10)), 0.0733880348, 1e-8);
  // 97.5% quantile of t(10) is 2.228139.
  EXPECT_NEAR(student_t_cdf(2.228139, 10), 0.975, 1e-6);
  EXPECT_NEAR(student_t_cdf(-2.228139, 10), 0.025, 1e-6);
}

TEST(Stats, WelchHandExample) {
  // a = {1,2,3}: mean 2, var 1; b = {4,5,6,7}: mean 5.5, var 5/3.
  // se² = 1/3 + 5/12 = 3/4; t = −3.5/sqrt(0.75); df = 0.5625 / ((1/3)²/2 + (5/12)²/3).
  auto r = welch_t_test({1, 2, 3}, {4, 5, 6, 7});
  ASSERT_TRUE(r.has_value());
  EXPECT_NEAR(r->diff, -3.5, 1e-12);
  EXPECT_NEAR(r->se, std::sqrt(0.75), 1e-12);
  EXPECT_NEAR(r->t, -4.041451884327381, 1e-12);
  EXPECT_NEAR(r->df, 4.959183673469387, 1e-12);
  EXPECT_NEAR(r->p, 0.0100769433, 1e-8);
}

TEST(Stats, WelchLossExample) {
  auto r = welch_t_test({2.31, 2.33, 2.32}, {2.35, 2.36, 2.38});
  ASSERT_TRUE(r.has_value());
  EXPECT_NEAR(r->diff, 2.32 - 2.3633333333333333, 1e-12);
  EXPECT_NEAR(r->se, 0.01054092553389456, 1e-12);
  EXPECT_NEAR(r->t, -4.110960958218919, 1e-9);
  EXPECT_NEAR(r->df, 3.4482758620689786, 1e-9);
  EXPECT_NEAR(r->p, 0.0198551175, 1e-7);
}

TEST(Stats, WelchNeedsTwoPerSide) {
  EXPECT_FALSE(welch_t_test({1.0}, {1.0, 2.0}).has_value());
  EXPECT_FALSE(welch_t_test({1.0, 2.0}, {}).has_value());
  auto same = welch_t_test({1, 1}, {1, 1});
  ASSERT_TRUE(same);
  EXPECT_EQ(same->p, 1);
  auto exact = welch_t_test({1, 1}, {2, 2});
  ASSERT_TRUE(exact);
  EXPECT_EQ(exact->p, 0);
}

TEST(Stats, RanksAndSpearman) {
  auto r = average_ranks({10, 20, 20, 5});
  EXPECT_EQ(r, (std::vector<double>{2, 3.5, 3.5, 1}));
  EXPECT_NEAR(*spearman({1, 2, 3, 4}, {10, 20, 30, 40}), 1.0, 1e-12);
  EXPECT_NEAR(*spearman({1, 2, 3, 4}, {4, 3, 2, 1}), -1.0, 1e-12);
  // d = ranks differ by (0, 0, 1, −1) for {1,2,3,4} vs {1,2,4,3}: ρ = 1 − 6·2/(4·15) = 0.8
  EXPECT_NEAR(*spearman({1, 2, 3, 4}, {1, 2, 4, 3}), 0.8, 1e-12);
  // With ties: Pearson of average ranks. x ranks (1,2,3), y ranks (1.5,1.5,3) → ρ = 0.8660254
  EXPECT_NEAR(*spearman({1, 2, 3}, {7, 7, 9}), std::sqrt(3.0) / 2, 1e-12);
  EXPECT_FALSE(spearman({1}, {2}).has_value());
  EXPECT_FALSE(spearman({1, 2}, {3, 3}).has_value());
  EXPECT_THROW(spearman({1, 2}, {1}), std::invalid_argument);
}

TEST(Stats, WelchTextbookExample) {
  // The first example of Wikipedia's "Welch's t-test" article (t = −2.46, ν = 25.0,
  // p = 0.021); the digits below from the formulas and a Simpson integration of the t
  // density in an independent script.
  const std::vector<double> a = {27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4};
  const std::vector<double> b = {27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4};
  auto r = welch_t_test(a, b);
  ASSERT_TRUE(r.has_value());
  EXPECT_NEAR(r->t, -2.45535639828601, 1e-10);
  EXPECT_NEAR(r->df, 24.98852929023142, 1e-10);
  EXPECT_NEAR(r->p, 0.0213780014, 1e-8);
}

TEST(Stats, KendallTauBByHand) {
  // 6 concordant, 4 discordant pairs of 10: (6 − 4) / 10.
  EXPECT_NEAR(*kendall_tau_b({1, 2, 3, 4, 5}, {3, 4, 1, 2, 5}), 0.2, 1e-15);
  // One tie in x: 5 concordant, 0 discordant, n0 = 6: 5 / sqrt(5 · 6).
  EXPECT_NEAR(*kendall_tau_b({1, 2, 2, 3}, {1, 3, 2, 4}), 5 / std::sqrt(30.0), 1e-15);
  // Ties on both sides: 6 − 2 over sqrt((10 − 1)(10 − 2)).
  EXPECT_NEAR(*kendall_tau_b({1, 2, 2, 3, 4}, {2, 1, 1, 3, 3}), 4 / std::sqrt(72.0), 1e-15);
  EXPECT_NEAR(*kendall_tau_b({1, 2, 3}, {3, 2, 1}), -1.0, 1e-15);
  EXPECT_FALSE(kendall_tau_b({1, 1, 1}, {1, 2, 3}).has_value());
  EXPECT_FALSE(kendall_tau_b({1}, {1}).has_value());
  EXPECT_THROW(kendall_tau_b({1, 2}, {1}), std::invalid_argument);
}

TEST(Stats, WelchLinearReducesToWelchAndCombinesPairs) {
  const std::vector<double> a = {1, 2, 3}, b = {4, 5, 6, 7};
  auto one = welch_linear({{1, a}, {-1, b}});
  auto ref = welch_t_test(a, b);
  ASSERT_TRUE(one && ref);
  EXPECT_NEAR(one->t, ref->t, 1e-12);
  EXPECT_NEAR(one->df, ref->df, 1e-12);
  EXPECT_NEAR(one->p, ref->p, 1e-12);
  // Mean of two pair differences: ((2 − 5.5) + (3 − 3)) / 2 = −1.75;
  // var = Σ c² s²/n = 1/12 + 5/48 + 1/4 + 1/4 = 33/48; df = var² / Σ (v_k² / (n_k − 1)).
  auto two = welch_linear({{0.5, a}, {-0.5, b}, {0.5, {2, 4}}, {-0.5, {2, 4}}});
  ASSERT_TRUE(two.has_value());
  EXPECT_NEAR(two->diff, -1.75, 1e-12);
  EXPECT_NEAR(two->se, std::sqrt(33.0 / 48), 1e-12);
  const double v1 = 1.0 / 12, v2 = 5.0 / 48, v3 = 0.25;
  EXPECT_NEAR(two->df, (33.0 / 48) * (33.0 / 48) / (v1 * v1 / 2 + v2 * v2 / 3 + v3 * v3 + v3 * v3), 1e-12);
  EXPECT_FALSE(welch_linear({{1, a}, {-1, {5}}}).has_value());
}

TEST(Stats, SignTestExactBinomial) {
  EXPECT_NEAR(sign_test_p(8, 8), 2.0 / 256, 1e-15);  // the paper's 8 of 8
  EXPECT_NEAR(sign_test_p(0, 8), 2.0 / 256, 1e-15);
  EXPECT_NEAR(sign_test_p(7, 8), 2.0 * 9 / 256, 1e-15);
  EXPECT_NEAR(sign_test_p(4, 4), 0.125, 1e-15);
  EXPECT_EQ(sign_test_p(4, 8), 1.0);
  EXPECT_EQ(sign_test_p(0, 0), 1.0);
}

TEST(Stats, QuantileType7) {
  EXPECT_EQ(quantile({3, 1, 2}, 0.5), 2);
  EXPECT_NEAR(quantile({1, 2, 3, 4}, 0.25), 1.75, 1e-15);
  EXPECT_EQ(quantile({5}, 0.9), 5);
}

TEST(Stats, BootstrapIsSeededAndCoversByHand) {
  auto mean = [](const Groups& g) { return sample_stats(g[0]).mean; };
  // Resampling {1, 2, 3}: the mean is 1 (all ones) with probability 1/27 ≈ 3.7 % > 2.5 %,
  // likewise 3, so the 95 % percentile interval is [1, 3].
  const Interval iv = bootstrap_interval({{1, 2, 3}}, mean, 2000, 42);
  EXPECT_EQ(iv.lo, 1.0);
  EXPECT_EQ(iv.hi, 3.0);
  // The same seed gives the same draws; another seed other draws.
  std::vector<double> d1, d2, d3;
  bootstrap_interval({{1, 2, 3, 4}}, mean, 100, 7, 0.95, &d1);
  bootstrap_interval({{1, 2, 3, 4}}, mean, 100, 7, 0.95, &d2);
  bootstrap_interval({{1, 2, 3, 4}}, mean, 100, 8, 0.95, &d3);
  EXPECT_EQ(d1, d2);
  EXPECT_NE(d1, d3);
  // A constant sample has a point interval; every draw keeps each group's size.
  const Interval c = bootstrap_interval({{2, 2}, {5}}, [](const Groups& g) { return g[0].size() + g[1][0]; }, 50, 1);
  EXPECT_EQ(c.lo, 7.0);
  EXPECT_EQ(c.hi, 7.0);
}
