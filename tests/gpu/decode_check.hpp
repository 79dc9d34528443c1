// Shared by the decode GPU tests (test_linear_decode_cuda, test_ssm_decode_cuda): a one-step
// run config around a model, one layer decoding B sequences token by token on the CPU and CUDA
// backends (against the CPU layer's step() and the CUDA layer's own full forward), and a whole
// model decoding through eval::Decoder on both backends. The tests pass the parameter draw
// that keeps their mixers' gates and maps off their trivial initial values.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "eval/decoder.hpp"
#include "eval/loglik.hpp"
#include "kernels/backend.hpp"
#include "tests/gpu/host_helpers.hpp"
#include "trainer/mixer.hpp"
#include "trainer/model.hpp"
#include "trainer/train.hpp"

namespace lar::gpu_test {

constexpr int kVocab = 96;

// The parameters both backends get: the model's init with its zero or constant ones randomised.
using ParamsFn = std::function<std::vector<float>(trainer::Model&)>;

inline json decode_run_config(json model, json overrides = json::object()) {
  json base_model = {{"n_layers", 1},   {"d_model", 128},       {"n_heads", 2},
                     {"n_kv_heads", 1}, {"vocab_size", kVocab}, {"stack", "pure"}};
  base_model.merge_patch(model);
  json c = {{"seed", 5},
            {"threads", 2},
            {"model", base_model},
            {"data", {{"task", "mqar"}, {"seq_len", 64}, {"batch_size", 4}, {"num_kv_pairs", 8}}},
            {"optimizer", {{"lr", 3e-3}}},
            {"schedule", {{"warmup_steps", 2}}},
            {"budget", {{"steps", 4}}},
            {"log", {{"every", 1}}},
            {"eval", {{"every", 0}, {"batches", 1}}},
            {"checkpoint", {{"every", 0}, {"keep", 2}}}};
  c.merge_patch(overrides);
  return trainer::prepare_config(c);
}

struct DecodeErrors {
  double step_cpu = 0, step_fwd = 0;    // over all tokens
  double worst_cpu = 0, worst_fwd = 0;  // the worst token (rel RMS over its B × d outputs)
  double side_cpu = 0;                  // a routed layer's published side channel, all tokens
};

// Layer 0 of a one-layer model decodes B sequences of T random inputs on both backends.
inline DecodeErrors decode_layer(const json& cfg, const std::string& precision, int B, int T,
                                 const ParamsFn& random_params) {
  auto cpu = backend("cpu", "fp32");
  auto gpu = backend("cuda", precision);
  trainer::Model mc(cfg, *cpu), mg(cfg, *gpu);
  mc.init(cfg.at("seed").get<uint64_t>());
  const std::vector<float> p = random_params(mc);
  cpu->upload(p.data(), mc.params().params());
  gpu->upload(p.data(), mg.params().params());
  trainer::Mixer& lc = *mc.mixers()[0];
  trainer::Mixer& lg = *mg.mixers()[0];
  const int d = cfg.at("model").at("d_model").get<int>();
  const bool mixed = gpu->act_dtype() == kernels::DType::bf16;
  std::mt19937_64 rng{std::random_device{}()};
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(static_cast<std::size_t>(B) * T * d);
  for (auto& e : x) e = mixed ? round_bf16(nd(rng)) : nd(rng);
  auto token = [&](int t) {
    std::vector<float> xs(static_cast<std::size_t>(B) * d);
    for (int b = 0; b < B; ++b)
      std::copy_n(&x[(static_cast<std::size_t>(b) * T + t) * d], d, &xs[static_cast<std::size_t>(b) * d]);
    return xs;
  };
  const bool side = lc.publishes();
  const int64_t sd = lc.side_dim();
  // (a) the CPU layer's step()
  std::vector<float> ycpu(x.size()), scpu(static_cast<std::size_t>(B) * T * sd);
  {
    kernels::Arena ar(*cpu);
    trainer::ForwardContext ctx{*cpu, ar, false};
    auto st = lc.init_state(*cpu, B, T);
    std::vector<float> ys(static_cast<std::size_t>(B) * d);
    for (int t = 0; t < T; ++t) {
      ar.reset();
      std::vector<float> xs = token(t);
      trainer::Routing r;
      lc.step(ctx, kernels::Tensor(xs.data(), kernels::DType::f32, {B, d}),
              kernels::Tensor(ys.data(), kernels::DType::f32, {B, d}), *st, r);
      for (int b = 0; b < B; ++b) {
        std::copy_n(&ys[static_cast<std::size_t>(b) * d], d, &ycpu[(static_cast<std::size_t>(b) * T + t) * d]);
        if (side) std::copy_n(r.out.ptr<float>() + b * sd, sd, &scpu[(static_cast<std::size_t>(b) * T + t) * sd]);
      }
    }
  }
  // the CUDA layer's step(), x and y in the backend's act_dtype() as the decoder hands them
  const kernels::DType at = gpu->act_dtype();
  std::vector<float> ygpu(x.size()), sgpu(scpu.size()), yfwd;
  {
    kernels::Arena ar(*gpu);
    trainer::ForwardContext ctx{*gpu, ar, false};
    auto st = lg.init_state(*gpu, B, T);
    for (int t = 0; t < T; ++t) {
      ar.reset();
      const kernels::Tensor xs = to_device(*gpu, ar, token(t), at, {B, d});
      const kernels::Tensor ys = ar.alloc(at, {B, d});
      trainer::Routing r;
      lg.step(ctx, xs, ys, *st, r);
      const auto yh = to_host(*gpu, ar, ys);
      for (int b = 0; b < B; ++b)
        std::copy_n(&yh[static_cast<std::size_t>(b) * d], d, &ygpu[(static_cast<std::size_t>(b) * T + t) * d]);
      if (side) {
        EXPECT_EQ(r.out.numel(), B * sd);
        const auto sh = to_host(*gpu, ar, r.out);
        for (int b = 0; b < B; ++b)
          std::copy_n(&sh[static_cast<std::size_t>(b) * sd], sd, &sgpu[(static_cast<std::size_t>(b) * T + t) * sd]);
      }
    }
    // (b) its own full-sequence forward (evaluation)
    ar.reset();
    const kernels::Tensor X = to_device(*gpu, ar, x, at, {B, T, d});
    const kernels::Tensor Y = ar.alloc(at, {B, T, d});
    trainer::Routing r;
    lg.forward(ctx, X, Y, r);
    yfwd = to_host(*gpu, ar, Y);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  DecodeErrors e;
  e.step_cpu = rel_rms(ygpu.data(), ycpu.data(), ycpu.size());
  e.step_fwd = rel_rms(ygpu.data(), yfwd.data(), yfwd.size());
  for (int t = 0; t < T; ++t) {
    std::vector<float> a, c, f;
    for (int b = 0; b < B; ++b) {
      const std::size_t o = (static_cast<std::size_t>(b) * T + t) * d;
      a.insert(a.end(), &ygpu[o], &ygpu[o] + d);
      c.insert(c.end(), &ycpu[o], &ycpu[o] + d);
      f.insert(f.end(), &yfwd[o], &yfwd[o] + d);
    }
    e.worst_cpu = std::max(e.worst_cpu, rel_rms(a.data(), c.data(), a.size()));
    e.worst_fwd = std::max(e.worst_fwd, rel_rms(a.data(), f.data(), a.size()));
  }
  if (side) e.side_cpu = rel_rms(sgpu.data(), scpu.data(), scpu.size());
  // the outputs are not trivially small (a layer that wrote zeros would match nothing)
  double rms = 0;
  for (float v : ycpu) rms += double(v) * v;
  EXPECT_GT(std::sqrt(rms / ycpu.size()), 1e-3);
  return e;
}

// The whole model of cfg decodes B = 2 random sequences of T = 70 tokens through eval::Decoder on
// the CPU (fp32) and CUDA (mixed) backends. Bounds on the next token's log-probability (≈ −4.6 at
// V = 96): 3e-2 mean absolute difference, 1.5e-1 for the worst of B·T, against the CPU decoder
// and against the CUDA model's own full forward (eval::score); most argmaxes agree.
inline void expect_model_decodes_as_on_the_cpu(const json& cfg, const std::string& what,
                                               const ParamsFn& random_params) {
  auto cpu = backend("cpu", "fp32");
  auto gpu = backend("cuda", "mixed");
  trainer::Model mc(cfg, *cpu), mg(cfg, *gpu);
  mc.init(5);
  const std::vector<float> p = random_params(mc);
  cpu->upload(p.data(), mc.params().params());
  gpu->upload(p.data(), mg.params().params());
  const int B = 2, T = 70;
  std::mt19937_64 rng{std::random_device{}()};
  std::vector<std::vector<int32_t>> seqs(B, std::vector<int32_t>(T + 1));
  for (auto& s : seqs)
    for (auto& t : s) t = static_cast<int32_t>(rng() % kVocab);
  std::vector<eval::Request> reqs;
  for (const auto& s : seqs) reqs.push_back({{s[0]}, std::vector<int32_t>(s.begin() + 1, s.end())});
  const auto full = eval::score(mg, reqs, {B, T + 1, false});
  eval::Decoder dc(mc, B, T + 1), dg(mg, B, T + 1);
  double sum_cpu = 0, worst_cpu = 0, sum_fwd = 0, worst_fwd = 0;
  int agree = 0;
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> cur(B), next(B);
    for (int r = 0; r < B; ++r) cur[r] = seqs[r][t], next[r] = seqs[r][t + 1];
    std::vector<double> lc, lg;
    const auto ac = dc.step(cur, &next, &lc);
    const auto ag = dg.step(cur, &next, &lg);
    for (int r = 0; r < B; ++r) {
      ASSERT_TRUE(std::isfinite(lg[r])) << what << " row " << r << " position " << t;
      const double ec = std::abs(lg[r] - lc[r]), ef = std::abs(lg[r] - full[r].token_logprobs[t]);
      sum_cpu += ec, sum_fwd += ef;
      worst_cpu = std::max(worst_cpu, ec), worst_fwd = std::max(worst_fwd, ef);
      agree += ac[r] == ag[r];
    }
  }
  const double n = double(B) * T;
  std::printf(
      "%-24s decode log-prob vs cpu decoder: mean %.2e worst %.2e | vs cuda forward: mean %.2e worst %.2e | "
      "argmax agrees %d/%d\n",
      what.c_str(), sum_cpu / n, worst_cpu, sum_fwd / n, worst_fwd, agree, int(n));
  EXPECT_LT(sum_cpu / n, 3e-2) << what;
  EXPECT_LT(worst_cpu, 1.5e-1) << what;
  EXPECT_LT(sum_fwd / n, 3e-2) << what;
  EXPECT_LT(worst_fwd, 1.5e-1) << what;
  EXPECT_GE(agree, int(0.8 * n)) << what;  // near-ties may flip; most argmaxes agree
}

}  // namespace lar::gpu_test
