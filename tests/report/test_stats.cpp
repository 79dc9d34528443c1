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
