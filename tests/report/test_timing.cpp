// The timing model reproduces the anchors it is calibrated on (docs/perf.md's 350M steps),
// predicts the third anchor (KDA) within 10 %, the launch-bound floor of a tiny model
// (perf.md: a 3-layer d=64 GDN hybrid trained at ≈ 1.9M tokens/s, 0.54 ms a step), and
// scales with the budget and the number of cells side by side.
#include <gtest/gtest.h>

#include "core/config_schema.hpp"
#include "registry/report/report.hpp"
#include "registry/report/timing.hpp"

using namespace lar;
using namespace lar::report;

namespace {
experiments::Cell cell_of(const std::string& arch, const std::string& stack, int L, int d, int H, int dff, int V, int B,
                          int T, long steps) {
  experiments::Cell c;
  c.id = arch;
  c.config = with_defaults({{"model", {{"architecture", arch}, {"stack", stack}, {"n_layers", L}, {"d_model", d},
                                       {"n_heads", H}, {"n_kv_heads", 4}, {"d_ff", dff}, {"vocab_size", V}}},
                            {"data", {{"seq_len", T}, {"batch_size", B}}},
                            {"budget", {{"steps", steps}}},
                            {"eval", {{"batches", 0}}}});
  return c;
}
}  // namespace

TEST(Timing, AnchorsAndTheTinyModelFloor) {
  const TimingModel m;
  EXPECT_NEAR(estimate_cell(cell_of("gdn", "pure", 20, 1024, 16, 2816, 32000, 8, 4096, 10), m).step_s, 0.1464, 1e-6);
  EXPECT_NEAR(estimate_cell(cell_of("softmax", "dense", 20, 1024, 16, 2816, 32000, 8, 4096, 10), m).step_s, 0.1508, 1e-6);
  const double kda = estimate_cell(cell_of("kda", "pure", 20, 1024, 16, 2816, 32000, 8, 4096, 10), m).step_s;
  EXPECT_NEAR(kda / 0.1824, 1.0, 0.10) << kda;  // not calibrated on: a check of the model
  const double tiny = estimate_cell(cell_of("gdn", "hybrid", 3, 64, 4, 0, 256, 8, 128, 100), m).step_s;
  EXPECT_NEAR(tiny, 0.54e-3, 0.1e-3) << tiny;
}

TEST(Timing, BudgetAndSideBySide) {
  experiments::Plan plan;
  for (int i = 0; i < 4; ++i) plan.cells.push_back(cell_of("gdn", "hybrid", 6, 384, 6, 1024, 256, 32, 512, 1000));
  const CellTiming one = estimate_cell(plan.cells[0]);
  EXPECT_NEAR(one.tokens, 1000.0 * 32 * 512, 1e-6);
  EXPECT_NEAR(one.wall_s, TimingModel{}.startup_s + 1000 * one.step_s, 1e-9);
  const TableTiming serial = estimate_table(plan, 1), four = estimate_table(plan, 4);
  EXPECT_NEAR(serial.table_s, 4 * one.wall_s, 1e-9);
  // Side by side the cells overlap only what is not GPU-busy: faster, but not 4×.
  EXPECT_LT(four.table_s, serial.table_s);
  EXPECT_NEAR(four.table_s, 4 * one.busy_s, 1e-9);
  EXPECT_GT(four.table_s, serial.table_s / 4);
}

// Side by side, the fit on the mini runs of LAA Tables 2, 3 and 8 (six cells at a time on
// one H200): the GPU-busy seconds a step of two Table 2 cells against what they measured
// (iteration time at -j 6 over 6: gdn/AdamW/hybrid 9.1 ms, softmax/AdamW/dense 7.1 ms).
TEST(Timing, SideBySideFitOfTheMiniRuns) {
  const auto gdn = estimate_cell(cell_of("gdn", "hybrid", 6, 384, 6, 1024, 256, 32, 512, 900));
  EXPECT_NEAR(gdn.busy_s / 900 / 0.0091, 1.0, 0.25) << gdn.busy_s / 900;
  const auto soft = estimate_cell(cell_of("softmax", "dense", 6, 384, 6, 1024, 256, 32, 512, 900));
  EXPECT_NEAR(soft.busy_s / 900 / 0.0071, 1.0, 0.25) << soft.busy_s / 900;
  // Alone a step is never faster than the GPU time it holds when shared.
  EXPECT_GE(gdn.step_s * 900, gdn.busy_s - 1e-12);
}

// LAA Table 8's TFLOP/s/GPU: 6 × the weights a token passes (embedding lookups are not
// matrix products: 6·(params − V·d)) plus causal attention, 6·T·H·head_dim a softmax layer;
// the run's tokens/s per GPU turns it into a rate.
TEST(Timing, ModelFlopsPerTokenAndTflopsPerGpu) {
  const auto c = cell_of("softmax", "dense", 2, 64, 4, 192, 256, 8, 128, 10);
  const double expected = 6 * (estimate_params(c.config) - 256.0 * 64) + 6.0 * 128 * 4 * 16 * 2;
  EXPECT_DOUBLE_EQ(model_flops_per_token(c.config), expected);
  ReportRun run;
  run.config = c.config;
  run.summary = {{"tokens_per_s", 2.0e6}, {"world_size", 2}};
  EXPECT_DOUBLE_EQ(*run_metric(run, "tflops_per_gpu"), expected * 1.0e6 / 1e12);
  run.summary.erase("tokens_per_s");
  EXPECT_FALSE(run_metric(run, "tflops_per_gpu").has_value());
}

// The layers whose chunk kernel runs past 64 keys carry the H200's times of the wide paths
// (docs/perf.md, fwd+bwd at B=8 T=4096 per 1024 value channels): gla at 128 keys on the
// key-block split 12.92 / 2 ms, GLA-Hedgehog's feature dim 128 the same, Mamba-2's state of 128
// on the recurrent wide-key kernels 55.72 / 2 (its heads: expand · d / head_dim), MIMO alike;
// 64-wide heads keep the bench's kernel_ms; and the step grows with them.
TEST(Timing, WideKeyLayersCountTheirKernels) {
  const TimingModel m;
  const auto config = [](const std::string& arch, int H, json extra = json::object()) {
    json c = cell_of(arch, "pure", 4, 512, H, 1536, 256, 8, 4096, 10).config;
    c["model"].merge_patch(extra);
    return c;
  };
  EXPECT_DOUBLE_EQ(layer_kernel_ms(config("gla", 16)), m.kernel_ms("gla") * 0.5);  // 16 heads of 32
  EXPECT_DOUBLE_EQ(layer_kernel_ms(config("gla", 8, {{"head_dim", 128}})), 12.92 / 2);  // values follow: 128
  EXPECT_DOUBLE_EQ(layer_kernel_ms(config("gdn", 8, {{"head_dim", 128}, {"value_dim", 128}})), 55.72 / 2);
  EXPECT_DOUBLE_EQ(layer_kernel_ms(config("gla_hedgehog", 8)), 12.92 / 2 * 0.5);  // head 64: features 128
  EXPECT_DOUBLE_EQ(layer_kernel_ms(config("mamba2", 8)), 55.72 / 2);              // 16 heads of 64, state 128
  EXPECT_DOUBLE_EQ(layer_kernel_ms(config("mamba3", 8, {{"mamba3", {{"form", "mimo"}}}})), 55.72 / 2);
  EXPECT_DOUBLE_EQ(layer_kernel_ms(config("mamba2", 8, {{"mamba", {{"state_size", 64}}}})), m.kernel_ms("gla"));
  EXPECT_DOUBLE_EQ(layer_kernel_ms(config("softmax", 8)), 0.0);
  const auto step = [&](const json& c) {
    experiments::Cell cell;
    cell.config = c;
    return estimate_cell(cell, m).step_s;
  };
  EXPECT_GT(step(config("mamba2", 8)), 2 * step(config("mamba2", 8, {{"mamba", {{"state_size", 64}}}})));
  EXPECT_GT(step(config("gla_hedgehog", 8)), step(config("gla", 8)));
}
