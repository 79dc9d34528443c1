// The linear mixers on the CUDA backend (trainer/mixers/linear_mixer_cuda.cpp over
// kernels/cuda/linear): a full model step (loss and every parameter's gradient) against the
// CPU backend for each mixer, a hybrid stack, each routing, CARVE and CCQ; a loss curve of
// gdn tracking the CPU run; `backend: cuda` training a gdn config and writing metrics; the
// clear errors for what the CUDA path does not run (dk ≠ 64, CARVE with a content chunk ≠ 64
// or with cler/cler_h). Every comparison runs on fresh random inputs and randomised parameters
// (the zero-initialised routing projections, Γ, gla's gate bias, CARVE's U2 and CCQ's W_λ
// too, and CCQ's constant b_λ, so that no gradient path is trivially zero).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>

#include "core/error.hpp"
#include "core/run_dir.hpp"
#include "kernels/backend.hpp"
#include "trainer/mixer.hpp"
#include "trainer/model.hpp"
#include "trainer/train.hpp"
#include "tests/gpu/host_helpers.hpp"
#include "tests/temp_dir.hpp"

using namespace lar;
using kernels::DType;
namespace fs = std::filesystem;
using lar::gpu_test::backend;
using lar::gpu_test::random_batch;

namespace {

// Heads of 64 (the CUDA kernels' size); T = 100 leaves a partial last chunk.
json run_config(json model, json overrides = json::object()) {
  json base_model = {{"n_layers", 2}, {"d_model", 128}, {"n_heads", 2}, {"n_kv_heads", 1}, {"vocab_size", 96}};
  base_model.merge_patch(model);
  json c = {{"seed", 5},
            {"threads", 2},
            {"model", base_model},
            {"data", {{"task", "mqar"}, {"seq_len", 100}, {"batch_size", 4}, {"num_kv_pairs", 8}}},
            {"optimizer", {{"lr", 3e-3}}},
            {"schedule", {{"warmup_steps", 10}}},
            {"budget", {{"steps", 60}}},
            {"log", {{"every", 1}}},
            {"eval", {{"every", 0}, {"batches", 2}}},
            {"checkpoint", {{"every", 0}, {"keep", 2}}}};
  c.merge_patch(overrides);
  return trainer::prepare_config(c);
}

struct StepOut {
  double loss = 0;
  std::vector<float> grads;
  std::vector<trainer::ParamInfo> table;
};

// One forward + backward from the config's init, with the parameters that start at zero
// (routing P_l, Γ_l, gla's gate bias, CARVE's content_u2, CCQ's W_λ), the norms and CCQ's b_λ
// (a constant logit(λ_init)) set to random values.
StepOut one_step(kernels::Backend& be, const json& cfg, const data::Batch& batch) {
  trainer::Model model(cfg, be);
  model.init(cfg.at("seed").get<uint64_t>());
  auto& ps = model.params();
  std::vector<float> p(ps.numel());
  be.download(ps.params(), p.data());
  std::mt19937_64 rng(11);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (const auto& info : ps.table()) {
    auto has = [&](const char* s) { return info.name.find(s) != std::string::npos; };
    const bool zero_init = has("route_") || has("cler_gamma") || has("gate_bias") || has("ccq_w_lambda");
    const bool norm = has("norm");
    for (int64_t i = 0; i < info.numel; ++i) {
      const double r = nd(rng);
      if (zero_init) p[info.offset + i] = static_cast<float>(0.05 * r);
      if (norm) p[info.offset + i] = static_cast<float>(1.0 + 0.2 * r);
      // U2 large enough that the content signal moves the erase gates visibly
      if (has("content_u2")) p[info.offset + i] = static_cast<float>(0.5 * r);
      // λ ≈ 0.1–0.35 per head (init: 0.01 everywhere), so that CCQ moves q by a few percent
      if (has("ccq_b_lambda")) p[info.offset + i] = static_cast<float>(-1.5 + 0.4 * r);
    }
  }
  be.upload(p.data(), ps.params());
  ps.zero_grads();
  StepOut out;
  out.loss = model.forward_backward(batch).loss;
  out.grads.resize(ps.numel());
  be.download(ps.grads(), out.grads.data());
  out.table = ps.table();
  return out;
}

double rel_rms(const float* a, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += double(a[i] - ref[i]) * (a[i] - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The CUDA step against the CPU step: loss within 1e-3 relative, the whole gradient
// vector within 1e-2 relative RMS (1.5e-2 when the model's GEMMs are bf16 too), each
// parameter's gradient within 2e-2 (4e-2). Gradients that are sums over every token of a
// gate's gradient (A_log, dt_bias, gla's gate bias, Γ) cancel heavily — their terms have
// both signs — so the kernels' bf16 rounding shows more there: 6e-2 (1.5e-1); with cler
// (a second bf16 readout feeding the gate gradients) 2.5e-1. The per-token gate gradients
// themselves are held to tol_param through the gate projections (w_a, gate_w1/w2) that
// multiply them with x. Measured on the H200 (docs/perf.md): token sums ≤ 3.6e-2 without
// cler, 1.6e-1 with it; everything else ≤ 1.9e-2. CCQ's b_λ is such a sum too (of ∂L/∂λ over
// every token), and so are CARVE's U1, U2 (their gradient is the per-chunk sum of the erase
// logits' gradient times the content projection). CARVE's A_log sums cancel like cler's:
// measured 5.2e-2 (fp32) and, with CCQ in front, 1.09e-1 while the whole gradient stays at
// 7e-3 and the loss within 2e-5 relative, so CARVE takes cler's 2.5e-1 for token sums.
// T: tokens per sequence (not a multiple of 64);
// deterministic: the CUDA backend's bit-reproducible mode.
void compare_step(const std::string& what, const json& cfg, const std::string& precision, int T = 100,
                  bool deterministic = false) {
  const bool fp32 = precision == "fp32";
  const bool cler = cfg.at("model").at("routing") == "cler";
  const double tol_all = fp32 ? 1e-2 : 1.5e-2, tol_param = fp32 ? 2e-2 : 4e-2;
  const bool carve = cfg.at("model").at("architecture") == "carve";
  const double tol_sum = cler || carve ? 2.5e-1 : fp32 ? 6e-2 : 1.5e-1;
  const auto batch = random_batch(4, T, 96, 3, 7);
  auto cpu = backend("cpu", "fp32");
  kernels::Backend::Options o;
  o.precision = precision;
  o.deterministic = deterministic;
  auto gpu = kernels::make_backend("cuda", 2, DType::f32, o);
  const StepOut ref = one_step(*cpu, cfg, batch);
  const StepOut got = one_step(*gpu, cfg, batch);
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  const double all = rel_rms(got.grads.data(), ref.grads.data(), (int64_t)ref.grads.size());
  double worst = 0, worst_sum = 0;
  std::string worst_name, worst_sum_name;
  for (const auto& info : ref.table) {
    const double e = rel_rms(got.grads.data() + info.offset, ref.grads.data() + info.offset, info.numel);
    bool token_sum = false;
    for (const char* n : {"A_log", "dt_bias", "gate_bias", "cler_gamma", "ccq_b_lambda", "content_u1", "content_u2"})
      token_sum = token_sum || info.name.find(n) != std::string::npos;
    if (token_sum && e > worst_sum) worst_sum = e, worst_sum_name = info.name;
    if (!token_sum && e > worst) worst = e, worst_name = info.name;
    EXPECT_LT(e, token_sum ? tol_sum : tol_param) << what << " " << precision << ": " << info.name;
  }
  std::printf("%-22s %-5s loss %.6f vs cpu %.6f | grads %.2e, worst param %.2e (%s), worst token-sum %.2e (%s)\n",
              what.c_str(), precision.c_str(), got.loss, ref.loss, all, worst, worst_name.c_str(), worst_sum,
              worst_sum_name.c_str());
  EXPECT_NEAR(got.loss, ref.loss, 1e-3 * ref.loss) << what;
  EXPECT_LT(all, tol_all) << what << " " << precision;
}

}  // namespace

TEST(LinearLayerCuda, EveryMixerStepMatchesTheCpuBackend) {
  for (const char* arch : {"linear", "gla", "deltanet", "gdn", "kda", "gdn2"}) {
    const json cfg = run_config({{"architecture", arch}, {"stack", "pure"}});
    compare_step(std::string(arch) + " pure", cfg, "fp32");
    compare_step(std::string(arch) + " pure", cfg, "mixed");
  }
}

TEST(LinearLayerCuda, NoConvAndOtherGateRankMatch) {
  compare_step("gdn no conv", run_config({{"architecture", "gdn"}, {"stack", "pure"}, {"short_conv", false}}), "fp32");
  compare_step("kda rank 8 conv 3",
               run_config({{"architecture", "kda"}, {"stack", "pure"}, {"gate_rank", 8}, {"conv_size", 3}}), "fp32");
  compare_step("gdn2 conv 6", run_config({{"architecture", "gdn2"}, {"stack", "pure"}, {"conv_size", 6}}), "fp32");
}

TEST(LinearLayerCuda, HybridStackMatches) {
  for (const char* arch : {"gdn", "gla"})
    compare_step(std::string(arch) + " hybrid",
                 run_config({{"architecture", arch}, {"stack", "hybrid"}, {"n_layers", 4}, {"hybrid_ratio", 1}}),
                 "mixed");
}

TEST(LinearLayerCuda, EveryRoutingMatches) {
  for (const char* arch : {"gdn", "deltanet", "kda", "gdn2"})
    for (const char* routing : {"cler", "cler_h", "clvr"})
      compare_step(std::string(arch) + " " + routing,
                   run_config({{"architecture", arch}, {"stack", "pure"}, {"n_layers", 3}, {"routing", routing}}),
                   "fp32");
  compare_step("gdn hybrid cler_h r4",
               run_config({{"architecture", "gdn"}, {"stack", "hybrid"}, {"n_layers", 4}, {"hybrid_ratio", 1},
                           {"routing", "cler_h"}, {"routing_rank", 4}}),
               "mixed");
}

// CARVE (gdn2's gates with raw erase logits, a scalar write gate per head and the content
// projection U1, U2 through carve_fwd/carve_bwd): the default, without the content gradient,
// frozen content (no U parameters), clvr routing, and T = 150 (three chunks, a partial last).
TEST(LinearLayerCuda, CarveStepMatchesTheCpuBackend) {
  const json cfg = run_config({{"architecture", "carve"}, {"stack", "pure"}});
  compare_step("carve pure", cfg, "fp32");
  compare_step("carve pure", cfg, "mixed");
  compare_step("carve T=150", run_config({{"architecture", "carve"}, {"stack", "pure"}}, {{"data", {{"seq_len", 150}}}}),
               "fp32", 150);
  compare_step("carve no content grad",
               run_config({{"architecture", "carve"}, {"stack", "pure"}, {"carve", {{"content_grad", false}}}}), "fp32");
  compare_step("carve frozen content",
               run_config({{"architecture", "carve"}, {"stack", "pure"}, {"carve", {{"freeze_content", true}}}}), "fp32");
  compare_step("carve rank 8 clvr",
               run_config({{"architecture", "carve"}, {"stack", "pure"}, {"n_layers", 3}, {"routing", "clvr"},
                           {"carve", {{"content_rank", 8}}}}),
               "fp32");
  compare_step("carve hybrid",
               run_config({{"architecture", "carve"}, {"stack", "hybrid"}, {"n_layers", 4}, {"hybrid_ratio", 1}}),
               "mixed");
  // deterministic: carve_bwd per sequence (its batch sum of dU1, dU2 uses atomics), the U
  // gradients added in sequence order — the same result, and the same bits on a second run
  compare_step("carve deterministic", cfg, "mixed", 100, true);
  kernels::Backend::Options o;
  o.precision = "mixed";
  o.deterministic = true;
  auto gpu = kernels::make_backend("cuda", 2, DType::f32, o);
  const auto batch = random_batch(4, 100, 96, 3, 7);
  const StepOut a = one_step(*gpu, cfg, batch), b = one_step(*gpu, cfg, batch);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_TRUE(a.grads == b.grads) << "carve: a deterministic backend gave different gradients";
}

// CCQ (ccq_fwd in front of the backbone, learned λ from P's q columns) on gdn and gla, fp32
// and mixed; with cler on gdn; a fixed λ, uncentered, on gla (no λ parameters); on CARVE.
TEST(LinearLayerCuda, CcqStepMatchesTheCpuBackend) {
  const json ccq = {{"enabled", true}};
  for (const char* arch : {"gdn", "gla"}) {
    const json cfg = run_config({{"architecture", arch}, {"stack", "pure"}, {"ccq", ccq}});
    compare_step(std::string(arch) + " ccq", cfg, "fp32");
    compare_step(std::string(arch) + " ccq", cfg, "mixed");
  }
  compare_step("gdn ccq cler",
               run_config({{"architecture", "gdn"}, {"stack", "pure"}, {"n_layers", 3}, {"routing", "cler"},
                           {"ccq", ccq}}),
               "fp32");
  compare_step("gla ccq fixed uncentered",
               run_config({{"architecture", "gla"}, {"stack", "pure"},
                           {"ccq", {{"enabled", true}, {"lambda", 0.2}, {"centered", false}}}}),
               "fp32");
  compare_step("carve ccq", run_config({{"architecture", "carve"}, {"stack", "pure"}, {"ccq", ccq}}), "fp32");
  compare_step("gdn ccq hybrid",
               run_config({{"architecture", "gdn"}, {"stack", "hybrid"}, {"n_layers", 4}, {"hybrid_ratio", 1},
                           {"ccq", ccq}}),
               "mixed");
}

TEST(LinearLayerCuda, GdnLossCurveTracksTheCpuRun) {
  TempDir c, g;
  const json model = {{"architecture", "gdn"}, {"stack", "hybrid"}, {"n_layers", 2}, {"hybrid_ratio", 1}};
  for (auto [dir, be] : {std::pair{&c, "cpu"}, std::pair{&g, "cuda"}}) {
    RunDir(dir->path).write_config({{"experiment", "test"}, {"cell_id", "c"}, {"hash", "h"},
                                    {"axes", json::object()}, {"role", "main"}, {"baseline", nullptr},
                                    {"config", run_config(model, {{"backend", be}})}});
    ASSERT_EQ(trainer::train_run(dir->path), 0) << be;
  }
  auto losses = [](const fs::path& dir) {
    std::vector<double> out;
    for (const auto& l : read_metrics(RunDir(dir).metrics_path()).lines)
      if (l.contains("loss")) out.push_back(l["loss"].get<double>());
    return out;
  };
  const auto lc = losses(c.path), lg = losses(g.path);
  ASSERT_EQ(lc.size(), 60u);
  ASSERT_EQ(lg.size(), 60u);
  double worst = 0, tail_c = 0, tail_g = 0;
  for (std::size_t i = 0; i < lc.size(); ++i) {
    worst = std::max(worst, std::abs(lg[i] - lc[i]) / lc[i]);
    if (i >= 50) tail_c += lc[i] / 10, tail_g += lg[i] / 10;
  }
  std::printf("gdn 60 steps: loss %.4f → %.4f (cpu) / %.4f → %.4f (cuda); worst step rel diff %.3g; last-10 mean "
              "%.4f vs %.4f\n", lc.front(), lc.back(), lg.front(), lg.back(), worst, tail_c, tail_g);
  EXPECT_LT(lc.back(), lc.front() * 0.9);
  EXPECT_LT(worst, 0.1);
  EXPECT_NEAR(tail_g, tail_c, 0.03 * tail_c);
  // the CUDA run wrote its metrics with the device memory high-water mark
  auto st = RunDir(g.path).read_status();
  ASSERT_TRUE(st);
  EXPECT_TRUE(st->summary.contains("gpu_peak_mem_mb")) << st->summary.dump();
}

TEST(LinearLayerCuda, WhatTheCudaPathDoesNotRunIsAClearError) {
  const json base = run_config({{"architecture", "gdn"}, {"stack", "pure"}});
  EXPECT_EQ(trainer::cuda_unsupported(base.at("model")), "");
  json m = base.at("model");
  m["head_dim"] = 32;
  EXPECT_NE(trainer::cuda_unsupported(m).find("model.head_dim: the linear CUDA kernels need 64, got 32"),
            std::string::npos);
  m = base.at("model");
  m["ccq"]["enabled"] = true;
  EXPECT_EQ(trainer::cuda_unsupported(m), "");  // CCQ runs on the GPU
  EXPECT_TRUE(trainer::mixer_runs_on_cuda("carve"));
  EXPECT_TRUE(trainer::mixer_runs_on_cuda("kda"));
  // CARVE: 64-token content chunks only, and no cler/cler_h (clvr is fine)
  const json carve = run_config({{"architecture", "carve"}, {"stack", "pure"}}).at("model");
  EXPECT_EQ(trainer::cuda_unsupported(carve), "");
  m = carve;
  m["carve"]["content_chunk"] = 32;
  EXPECT_NE(trainer::cuda_unsupported(m).find("model.carve.content_chunk: the CUDA CARVE kernel uses content chunks "
                                              "of 64, got 32"),
            std::string::npos)
      << trainer::cuda_unsupported(m);
  m = carve;
  m["chunk_size"] = 48;  // content_chunk 0 = chunk_size
  EXPECT_NE(trainer::cuda_unsupported(m).find("content chunks of 64, got 48"), std::string::npos);
  m = carve;
  m["routing"] = "cler_h";
  EXPECT_NE(trainer::cuda_unsupported(m).find("model.routing: 'cler_h' with CARVE has no CUDA path"), std::string::npos);
  m["routing"] = "clvr";
  EXPECT_EQ(trainer::cuda_unsupported(m), "");
  // the layer itself names the value too (a model built without prepare_config's check)
  try {
    one_step(*backend("cuda", "fp32"),
             run_config({{"architecture", "carve"}, {"stack", "pure"}, {"carve", {{"content_chunk", 32}}}}),
             random_batch(2, 16, 96, 1, 7));
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model.carve.content_chunk: the CUDA CARVE kernel uses content chunks of 64, "
                                         "got 32"),
              std::string::npos)
        << e.what();
  }
  // a forward on cuda with heads of 32 names the value
  const json cfg = run_config({{"architecture", "gdn"}, {"stack", "pure"}, {"n_heads", 4}});
  auto gpu = backend("cuda", "mixed");
  try {
    one_step(*gpu, cfg, random_batch(2, 16, 96, 1, 7));
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model.head_dim: the CUDA kernels need 64, got 32"), std::string::npos)
        << e.what();
  }
}
