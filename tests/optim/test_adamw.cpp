// AdamW against hand-computed steps, parameter groups, clipping, config errors and the
// bit-exact state round trip.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "trainer/optim/optimizer.hpp"
#include "trainer/optim/param_views.hpp"

using namespace lar;
using namespace lar::optim;

namespace {

OptimizerConfig adamw_config() {
  OptimizerConfig c;
  c.name = OptimizerName::adamw;
  c.lr = 0.1;
  c.weight_decay = 0.1;
  return c;
}

// Two tensors of 2 floats each: a hidden matrix (decays) and a norm gain (never decays).
std::vector<ParamView> two_tensors(ParamKind first, ParamKind second) {
  return {{"w", 0, 1, 2, first}, {"g", 2, 1, 2, second}};
}

}  // namespace

// β = (0.9, 0.95), lr = 0.1, wd = 0.1. Both tensors see grads g1 = (0.5, −1), g2 = (0.25, 0.5).
// Step 1: m = 0.1·g1 = (0.05, −0.1), v = 0.05·g1² = (0.0125, 0.05); bias corrections
//   1 − 0.9 = 0.1 and 1 − 0.95 = 0.05 give m̂ = (0.5, −1), v̂ = (0.25, 1): the update m̂/√v̂ is
//   (1, −1) (ε = 1e-8 is far below float resolution here).
//   decayed:   p = (1, 2)·(1 − 0.1·0.1) − 0.1·(1, −1) = (0.89, 2.08)
//   no decay:  p = (1, 2) − 0.1·(1, −1)                = (0.90, 2.10)
// Step 2: m = 0.9·m + 0.1·g2 = (0.07, −0.04), v = 0.95·v + 0.05·g2² = (0.015, 0.06);
//   corrections 1 − 0.81 = 0.19, 1 − 0.9025 = 0.0975 → m̂ = (7/19, −4/19), v̂ = (2/13, 8/13);
//   update = (7/19)/√(2/13), −(4/19)/√(8/13).
TEST(AdamW, TwoStepsMatchHandComputedValuesWithDecayOnlyOnMatrices) {
  Optimizer opt(adamw_config(), two_tensors(ParamKind::matrix_hidden, ParamKind::norm), 4);
  std::vector<float> p = {1, 2, 1, 2};
  std::vector<float> g1 = {0.5f, -1.0f, 0.5f, -1.0f};
  opt.step(p.data(), g1.data(), 1.0, 1.0);
  EXPECT_NEAR(p[0], 0.89, 1e-6);
  EXPECT_NEAR(p[1], 2.08, 1e-6);
  EXPECT_NEAR(p[2], 0.90, 1e-6);
  EXPECT_NEAR(p[3], 2.10, 1e-6);

  std::vector<float> g2 = {0.25f, 0.5f, 0.25f, 0.5f};
  opt.step(p.data(), g2.data(), 1.0, 1.0);
  const double u0 = (7.0 / 19) / std::sqrt(2.0 / 13), u1 = -(4.0 / 19) / std::sqrt(8.0 / 13);
  EXPECT_NEAR(u0, 0.939293, 1e-6);  // the arithmetic above, spelled out
  EXPECT_NEAR(p[0], 0.89 * 0.99 - 0.1 * u0, 1e-6);
  EXPECT_NEAR(p[1], 2.08 * 0.99 - 0.1 * u1, 1e-6);
  EXPECT_NEAR(p[2], 0.90 - 0.1 * u0, 1e-6);
  EXPECT_NEAR(p[3], 2.10 - 0.1 * u1, 1e-6);
  EXPECT_EQ(opt.steps_taken(), 2);
}

TEST(AdamW, LrFactorScalesStepAndDecay) {
  Optimizer opt(adamw_config(), two_tensors(ParamKind::embedding, ParamKind::bias), 4);
  std::vector<float> p = {1, 2, 1, 2};
  std::vector<float> g = {0.5f, -1.0f, 0.5f, -1.0f};
  opt.step(p.data(), g.data(), 0.5, 0.5);  // lr = 0.05; embedding decays under adamw
  EXPECT_NEAR(p[0], 1 * (1 - 0.05 * 0.1) - 0.05, 1e-6);
  EXPECT_NEAR(p[1], 2 * (1 - 0.05 * 0.1) + 0.05, 1e-6);
  EXPECT_NEAR(p[2], 1 - 0.05, 1e-6);  // bias: no decay
  EXPECT_NEAR(p[3], 2 + 0.05, 1e-6);
}

TEST(AdamW, MuonRunsScalarGroupWithScalarLrAndScalarDecay) {
  OptimizerConfig c = adamw_config();
  c.name = OptimizerName::muon;
  c.scalar_lr = 0.01;
  c.scalar_weight_decay = 0.5;
  std::vector<ParamView> table = {{"emb", 0, 1, 2, ParamKind::embedding},
                                  {"gate", 2, 1, 2, ParamKind::scalar},
                                  {"wq", 4, 2, 2, ParamKind::matrix_hidden}};
  Optimizer opt(c, table, 8);
  EXPECT_FALSE(opt.uses_muon(table[0]));
  EXPECT_FALSE(opt.uses_muon(table[1]));
  EXPECT_TRUE(opt.uses_muon(table[2]));
  std::vector<float> p = {1, 2, 1, 2, 0, 0, 0, 0};
  std::vector<float> g = {0.5f, -1.0f, 0.5f, -1.0f, 0, 0, 0, 0};
  opt.step(p.data(), g.data(), 1.0, 1.0);
  EXPECT_NEAR(p[0], 1 * (1 - 0.01 * 0.5) - 0.01, 1e-6);  // scalar_weight_decay on the embedding
  EXPECT_NEAR(p[1], 2 * (1 - 0.01 * 0.5) + 0.01, 1e-6);
  EXPECT_NEAR(p[2], 1 - 0.01, 1e-6);  // gate scalars never decay
  EXPECT_NEAR(p[3], 2 + 0.01, 1e-6);
}

TEST(AdamW, ScalarLrZeroMeansLr) {
  OptimizerConfig c = adamw_config();
  c.name = OptimizerName::normuon;
  c.scalar_lr = 0.0;
  c.scalar_weight_decay = 0.0;
  Optimizer opt(c, {{"n", 0, 1, 2, ParamKind::norm}}, 2);
  std::vector<float> p = {1, 2}, g = {0.5f, -1.0f};
  opt.step(p.data(), g.data(), 1.0, 1.0);
  EXPECT_NEAR(p[0], 0.9, 1e-6);
  EXPECT_NEAR(p[1], 2.1, 1e-6);
}

// Under muon with its own scalar_lr, the AdamW group warms up and then stays at scalar_lr
// (the LAA code's Megatron override min_lr = max_lr = scalar_lr); the Muon group decays.
TEST(AdamW, ScalarLrGroupWarmsUpButNeverDecaysUnderMuon) {
  ScheduleConfig sc;
  sc.name = ScheduleName::wsd;
  sc.warmup_steps = 2;
  sc.decay_fraction = 0.5;
  sc.min_lr = 0.0;
  const Schedule sched(sc, 0.1, 10);
  std::vector<ParamView> table = {{"emb", 0, 1, 2, ParamKind::embedding},
                                  {"w", 2, 2, 2, ParamKind::matrix_hidden}};
  for (double scalar_lr : {0.01, 0.0}) {
    OptimizerConfig c = adamw_config();
    c.name = OptimizerName::muon;
    c.scalar_lr = scalar_lr;
    c.scalar_weight_decay = 0.0;
    c.weight_decay = 0.0;
    const double group_lr = scalar_lr > 0 ? scalar_lr : 0.1;
    {  // first warmup update: both groups at half their peak
      Optimizer opt(c, table, 6);
      std::vector<float> p = {1, 2, 0, 0, 0, 0}, g = {0.5f, -1.0f, 1, 0, 0, 1};
      opt.step(p.data(), g.data(), sched, 0);
      EXPECT_NEAR(p[0], 1 - 0.5 * group_lr, 1e-7);
      EXPECT_NE(p[2], 0.0f);
    }
    {  // last update: lr has decayed to min_lr = 0
      Optimizer opt(c, table, 6);
      std::vector<float> p = {1, 2, 0, 0, 0, 0}, g = {0.5f, -1.0f, 1, 0, 0, 1};
      opt.step(p.data(), g.data(), sched, 9);
      EXPECT_EQ(p[2], 0.0f);  // the Muon matrix does not move
      if (scalar_lr > 0) {
        EXPECT_NEAR(p[0], 1 - 0.01, 1e-7);  // the scalar group still runs at scalar_lr
        EXPECT_NEAR(p[1], 2 + 0.01, 1e-7);
      } else {
        EXPECT_EQ(p[0], 1.0f);  // without its own lr it follows lr's schedule down to 0
      }
    }
  }
}

TEST(Clipping, ScalesToMaxNormAndReturnsPreClipNorm) {
  OptimizerConfig c = adamw_config();
  c.grad_clip = 1.0;
  Optimizer opt(c, two_tensors(ParamKind::matrix_hidden, ParamKind::norm), 4);
  std::vector<float> g = {3, 0, 0, 4};
  EXPECT_DOUBLE_EQ(opt.clip_gradients(g.data()), 5.0);
  EXPECT_NEAR(g[0], 0.6, 1e-6);
  EXPECT_NEAR(g[3], 0.8, 1e-6);
  EXPECT_NEAR(global_norm(g.data(), 4), 1.0, 1e-6);

  std::vector<float> small = {0.3f, 0, 0, 0.4f};  // norm 0.5 < 1: untouched
  EXPECT_NEAR(opt.clip_gradients(small.data()), 0.5, 1e-7);
  EXPECT_EQ(small[0], 0.3f);
  EXPECT_EQ(small[3], 0.4f);
}

TEST(Clipping, ZeroDisablesClipping) {
  OptimizerConfig c = adamw_config();
  c.grad_clip = 0.0;
  Optimizer opt(c, two_tensors(ParamKind::matrix_hidden, ParamKind::norm), 4);
  std::vector<float> g = {3, 0, 0, 4};
  EXPECT_DOUBLE_EQ(opt.clip_gradients(g.data()), 5.0);
  EXPECT_EQ(g[0], 3.0f);
  EXPECT_EQ(g[3], 4.0f);
}

TEST(Clipping, NonFiniteNormIsReportedAndGradsLeftAlone) {
  Optimizer opt(adamw_config(), two_tensors(ParamKind::matrix_hidden, ParamKind::norm), 4);
  std::vector<float> g = {3, std::numeric_limits<float>::quiet_NaN(), 0, 4};
  EXPECT_TRUE(std::isnan(opt.clip_gradients(g.data())));
  EXPECT_EQ(g[0], 3.0f);
  std::vector<float> h = {std::numeric_limits<float>::infinity(), 0, 0, 4};
  EXPECT_TRUE(std::isinf(opt.clip_gradients(h.data())));
  EXPECT_EQ(h[3], 4.0f);
}

TEST(OptimizerConfig, ReadsRunConfigWithDefaults) {
  const OptimizerConfig c = OptimizerConfig::from_json(
      json{{"optimizer", {{"name", "normuon"}, {"lr", 0.02}, {"scale_mode", "spectral"}}}});
  EXPECT_EQ(c.name, OptimizerName::normuon);
  EXPECT_DOUBLE_EQ(c.lr, 0.02);
  EXPECT_EQ(c.scale_mode, ScaleMode::spectral);
  EXPECT_DOUBLE_EQ(c.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.eps, 1e-8);
  EXPECT_DOUBLE_EQ(c.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(c.grad_clip, 1.0);
  EXPECT_DOUBLE_EQ(c.momentum, 0.95);
  EXPECT_TRUE(c.nesterov);
  EXPECT_EQ(c.ns_steps, 5);
  EXPECT_DOUBLE_EQ(c.ns_coefficients[1], -4.7750);
  EXPECT_DOUBLE_EQ(c.normuon_beta2, 0.95);
}

TEST(OptimizerConfig, OutOfRangeValuesNameTheKey) {
  try {
    OptimizerConfig::from_json(json{{"optimizer", {{"beta2", 1.5}}}});
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "optimizer.beta2: must be in [0, 1), got 1.5");
  }
  try {
    OptimizerConfig::from_json(json{{"optimizer", {{"ns_coefficients", {1.0, 2.0}}}}});
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.ns_coefficients: must be a list of 3 numbers"), std::string::npos);
  }
  EXPECT_THROW(OptimizerConfig::from_json(json{{"optimizer", {{"ns_steps", 0}}}}), UserError);
}

TEST(Optimizer, RejectsBadParameterTables) {
  EXPECT_THROW(Optimizer(adamw_config(), {{"a", 0, 2, 2, ParamKind::norm}, {"b", 3, 1, 2, ParamKind::norm}}, 8),
               RuntimeError);
  try {
    Optimizer(adamw_config(), {{"a", 4, 2, 3, ParamKind::matrix_hidden}}, 8);
    FAIL() << "no error";
  } catch (const RuntimeError& e) {
    EXPECT_STREQ(e.what(), "optimizer: parameter 'a' [4, 10) lies outside the buffer of 8 floats");
  }
}

// Run a few steps, save, restore into a fresh optimiser, continue both: identical bits.
TEST(OptimizerState, SaveLoadRoundTripIsBitExact) {
  for (OptimizerName name : {OptimizerName::adamw, OptimizerName::muon, OptimizerName::normuon}) {
    OptimizerConfig c = adamw_config();
    c.name = name;
    c.scalar_lr = 0.05;
    std::vector<ParamView> table = {{"emb", 0, 5, 3, ParamKind::embedding},
                                    {"w1", 15, 6, 4, ParamKind::matrix_hidden},
                                    {"w2", 39, 3, 7, ParamKind::matrix_hidden},
                                    {"norm", 60, 1, 4, ParamKind::norm}};
    const std::size_t n = 64;
    std::vector<float> p(n), g(n);
    for (std::size_t i = 0; i < n; ++i) p[i] = std::sin(0.37f * i);
    auto grads = [&](int k) {
      for (std::size_t i = 0; i < n; ++i) g[i] = std::cos(0.11f * i * (k + 1)) + 0.01f * k;
    };
    Optimizer a(c, table, n);
    for (int k = 0; k < 3; ++k) {
      grads(k);
      a.step(p.data(), g.data(), 0.7, 0.9);
    }
    const std::string blob = a.save_state();
    Optimizer b(c, table, n);
    b.load_state(blob);
    EXPECT_EQ(b.steps_taken(), 3);
    EXPECT_EQ(b.save_state(), blob);
    std::vector<float> q = p;
    for (int k = 3; k < 6; ++k) {
      grads(k);
      a.step(p.data(), g.data(), 0.5, 1.0);
      b.step(q.data(), g.data(), 0.5, 1.0);
    }
    EXPECT_EQ(std::memcmp(p.data(), q.data(), n * sizeof(float)), 0) << "optimizer " << int(name);
    EXPECT_EQ(a.save_state(), b.save_state());
  }
}

TEST(OptimizerState, LoadRejectsMismatchedOrCorruptState) {
  std::vector<ParamView> table = {{"w", 0, 2, 2, ParamKind::matrix_hidden}};
  OptimizerConfig muon = adamw_config();
  muon.name = OptimizerName::muon;
  Optimizer a(muon, table, 4);
  const std::string blob = a.save_state();
  Optimizer b(adamw_config(), table, 4);
  try {
    b.load_state(blob);
    FAIL() << "no error";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("'optimizer' differs (checkpoint \"muon\", this run \"adamw\")"),
              std::string::npos)
        << e.what();
  }
  Optimizer c(muon, {{"w_renamed", 0, 2, 2, ParamKind::matrix_hidden}}, 4);
  EXPECT_THROW(c.load_state(blob), RuntimeError);
  Optimizer d(muon, table, 4);
  EXPECT_THROW(d.load_state(blob.substr(0, blob.size() - 1)), RuntimeError);
  EXPECT_THROW(d.load_state("not a state"), RuntimeError);
}

TEST(ParamViews, TrainerTableMapsShapesAndKinds) {
  std::vector<trainer::ParamInfo> table(3);
  table[0].name = "embed";
  table[0].offset = 0;
  table[0].numel = 12;
  table[0].shape = {4, 3};
  table[0].kind = trainer::ParamKind::embedding;
  table[1].name = "layers.0.mixer.wq";
  table[1].offset = 12;
  table[1].numel = 6;
  table[1].shape = {2, 3};
  table[1].kind = trainer::ParamKind::matrix_hidden;
  table[2].name = "layers.0.norm1";
  table[2].offset = 18;
  table[2].numel = 3;
  table[2].shape = {3};
  table[2].kind = trainer::ParamKind::norm;
  const std::vector<ParamView> v = param_views(table);
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[0].kind, ParamKind::embedding);
  EXPECT_EQ(v[1].name, "layers.0.mixer.wq");
  EXPECT_EQ(v[1].offset, 12u);
  EXPECT_EQ(v[1].rows, 2);
  EXPECT_EQ(v[1].cols, 3);
  EXPECT_EQ(v[2].rows, 1);
  EXPECT_EQ(v[2].cols, 3);
  EXPECT_EQ(v[2].kind, ParamKind::norm);
  table[2].numel = 4;  // inconsistent with shape {3}? 1-D uses numel, so it stays valid
  EXPECT_EQ(param_views(table)[2].cols, 4);
  table[1].numel = 7;  // 7 is not 2 × k
  EXPECT_THROW(param_views(table), RuntimeError);
}
