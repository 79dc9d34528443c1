// Schedule values at the boundaries of each phase.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "core/error.hpp"
#include "trainer/optim/schedule.hpp"

using namespace lar;
using namespace lar::optim;

namespace {
ScheduleConfig cfg(ScheduleName name, std::int64_t warmup, double decay_fraction, double min_lr) {
  ScheduleConfig c;
  c.name = name;
  c.warmup_steps = warmup;
  c.decay_fraction = decay_fraction;
  c.min_lr = min_lr;
  return c;
}
}  // namespace

// S = 100, W = 10, D = 20 → s_d = 80. Step k is 0-based; s = k + 1.
TEST(Schedule, WsdBoundaries) {
  const Schedule s(cfg(ScheduleName::wsd, 10, 0.2, 1e-4), 1e-3, 100);
  EXPECT_DOUBLE_EQ(s.lr(0), 1e-4);              // first warmup update: peak·1/10
  EXPECT_DOUBLE_EQ(s.lr(4), 5e-4);              // peak·5/10
  EXPECT_DOUBLE_EQ(s.lr(9), 1e-3);              // end of warmup
  EXPECT_DOUBLE_EQ(s.lr(10), 1e-3);             // stable
  EXPECT_DOUBLE_EQ(s.lr(79), 1e-3);             // last stable update (s = 80 = s_d)
  ASSERT_TRUE(s.stable_end_step().has_value());
  EXPECT_EQ(*s.stable_end_step(), 80);
  EXPECT_EQ(s.decay_steps(), 20);
  EXPECT_DOUBLE_EQ(s.lr(80), 1e-4 + 9e-4 * (1 - std::sqrt(1.0 / 20)));  // first decay update
  EXPECT_DOUBLE_EQ(s.lr(89), 1e-4 + 9e-4 * (1 - std::sqrt(0.5)));
  EXPECT_DOUBLE_EQ(s.lr(99), 1e-4);             // last update lands on min_lr
  EXPECT_DOUBLE_EQ(s.lr(150), 1e-4);            // past the end: stays there
  EXPECT_DOUBLE_EQ(s.factor(99), 0.1);
  EXPECT_DOUBLE_EQ(s.warmup_factor(0), 0.1);
  EXPECT_DOUBLE_EQ(s.warmup_factor(9), 1.0);
  EXPECT_DOUBLE_EQ(s.warmup_factor(99), 1.0);
  for (int k = 10; k < 99; ++k) EXPECT_GE(s.lr(k), s.lr(k + 1)) << k;
}

TEST(Schedule, WsdWithoutWarmupStartsAtPeakAndMinLrZeroEndsAtZero) {
  const Schedule s(cfg(ScheduleName::wsd, 0, 0.1, 0.0), 2e-3, 50);
  EXPECT_DOUBLE_EQ(s.lr(0), 2e-3);
  EXPECT_EQ(*s.stable_end_step(), 45);
  EXPECT_DOUBLE_EQ(s.lr(44), 2e-3);
  EXPECT_DOUBLE_EQ(s.lr(45), 2e-3 * (1 - std::sqrt(0.2)));
  EXPECT_DOUBLE_EQ(s.lr(49), 0.0);
}

TEST(Schedule, WsdDecayIsRoundedAndNeverEatsIntoWarmup) {
  EXPECT_EQ(Schedule(cfg(ScheduleName::wsd, 0, 0.2, 0), 1, 7).decay_steps(), 1);  // round(1.4)
  EXPECT_EQ(Schedule(cfg(ScheduleName::wsd, 0, 0.25, 0), 1, 10).decay_steps(), 3);  // round(2.5) = 3
  const Schedule s(cfg(ScheduleName::wsd, 95, 0.2, 0), 1, 100);
  EXPECT_EQ(s.decay_steps(), 5);
  EXPECT_EQ(*s.stable_end_step(), 95);
  EXPECT_DOUBLE_EQ(s.lr(94), 1.0);
  EXPECT_DOUBLE_EQ(Schedule(cfg(ScheduleName::wsd, 0, 0.0, 0), 1, 10).lr(9), 1.0);  // no decay
}

TEST(Schedule, CosineBoundaries) {
  const Schedule s(cfg(ScheduleName::cosine, 10, 0.2, 1e-4), 1e-3, 100);
  EXPECT_DOUBLE_EQ(s.lr(0), 1e-4);
  EXPECT_DOUBLE_EQ(s.lr(9), 1e-3);
  EXPECT_DOUBLE_EQ(s.lr(10), 1e-4 + 9e-4 * 0.5 * (1 + std::cos(std::numbers::pi / 90)));
  EXPECT_NEAR(s.lr(54), 5.5e-4, 1e-15);  // s = 55: half way through the cosine
  EXPECT_NEAR(s.lr(99), 1e-4, 1e-15);
  EXPECT_FALSE(s.stable_end_step().has_value());
}

TEST(Schedule, ConstantAfterWarmup) {
  const Schedule s(cfg(ScheduleName::constant, 4, 0.2, 0), 0.5, 20);
  EXPECT_DOUBLE_EQ(s.lr(0), 0.125);
  EXPECT_DOUBLE_EQ(s.lr(3), 0.5);
  EXPECT_DOUBLE_EQ(s.lr(19), 0.5);
  EXPECT_EQ(*s.stable_end_step(), 20);
}

TEST(Schedule, ConfigFromJsonAndErrors) {
  const ScheduleConfig d = ScheduleConfig::from_json(json::object());
  EXPECT_EQ(d.name, ScheduleName::wsd);
  EXPECT_EQ(d.warmup_steps, 0);
  EXPECT_DOUBLE_EQ(d.decay_fraction, 0.2);
  EXPECT_DOUBLE_EQ(d.min_lr, 0.0);
  const ScheduleConfig c =
      ScheduleConfig::from_json(json{{"schedule", {{"name", "cosine"}, {"warmup_steps", 7}, {"min_lr", 1e-5}}}});
  EXPECT_EQ(c.name, ScheduleName::cosine);
  EXPECT_EQ(c.warmup_steps, 7);
  EXPECT_DOUBLE_EQ(c.min_lr, 1e-5);
  try {
    ScheduleConfig::from_json(json{{"schedule", {{"decay_fraction", -0.5}}}});
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "schedule.decay_fraction: must be ≥ 0, got -0.5");
  }
  EXPECT_DOUBLE_EQ(ScheduleConfig::from_json(json{{"schedule", {{"decay_fraction", 3.0}}}}).decay_fraction, 3.0);
  try {
    Schedule(cfg(ScheduleName::wsd, 0, 0.2, 0.01), 0.001, 10);
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "schedule.min_lr: 0.01 is above the peak lr optimizer.lr = 0.001");
  }
  EXPECT_THROW(Schedule(cfg(ScheduleName::wsd, 0, 0.2, 0), 0.001, 0), UserError);
}

TEST(Schedule, FromRunConfigUsesOptimizerLrAsPeak) {
  const json config = {{"optimizer", {{"lr", 0.004}}},
                       {"schedule", {{"name", "wsd"}, {"warmup_steps", 2}, {"decay_fraction", 0.5}}}};
  const Schedule s = Schedule::from_json(config, 10);
  EXPECT_DOUBLE_EQ(s.peak_lr(), 0.004);
  EXPECT_DOUBLE_EQ(s.lr(0), 0.002);
  EXPECT_EQ(*s.stable_end_step(), 5);
  EXPECT_DOUBLE_EQ(s.lr(9), 0.0);
}

// decay_fraction 3 over S = 10 with W = 2: D = 30, s_d = −20 — Megatron's WSD when
// --lr-wsd-decay-samples is three times the run: after the warmup the lr is already deep in
// the minus-sqrt decay, and it reaches min_lr at the last step.
TEST(Schedule, WsdDecayLongerThanTheRunBeganBeforeIt) {
  const double peak = 1e-3, lo = 1e-4;
  const Schedule s(cfg(ScheduleName::wsd, 2, 3.0, lo), peak, 10);
  EXPECT_DOUBLE_EQ(s.lr(0), peak / 2);
  EXPECT_DOUBLE_EQ(s.lr(1), peak);
  for (int k = 2; k < 10; ++k) {
    const double frac = (k + 1 + 20) / 30.0;
    EXPECT_NEAR(s.lr(k), lo + (peak - lo) * (1 - std::sqrt(frac)), 1e-15) << k;
  }
  EXPECT_DOUBLE_EQ(s.lr(9), lo);
  EXPECT_LT(*s.stable_end_step(), 0);  // no stable phase: no saturation loss
}
