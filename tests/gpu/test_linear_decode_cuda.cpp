// The recurrent decode of the linear mixers on the CUDA backend (LinearMixer::init_state/step →
// CudaLinear, cuda_layers/linear_layer_cuda.cpp: the per-token kernels of kernels/delta_rule, channel_rule, carve
// with the forward's projections, conv, gates and output): for each mixer, CCQ, wide key heads,
// wider and grouped value heads and the routings (clvr, cler, cler_h), a layer decodes T = 70
// tokens (past one 64-token chunk, so CARVE's content chunk and the chunk forward's second chunk
// are reached) one at a time, and each token's output is compared with (a) the CPU layer's
// step() on the same parameters and inputs and (b) the CUDA layer's own full-sequence forward.
// Then whole models: hybrid stacks (linear + softmax layers; CCQ, clvr, cler) and a cler_h stack
// decode through eval::Decoder on both backends, against each other and against the CUDA full
// forward's log-probabilities; eval's speed measurement runs on a CUDA run; what the CUDA decode
// refuses (cuda_linear_decode_unsupported) is a clear error.
// Inputs are fresh random normals (never zeros); the zero-initialised parameters (gla's gate
// bias, CARVE's content_u2, CCQ's W_λ) and the norms are randomised so no path is trivial.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/run_dir.hpp"
#include "eval/decoder.hpp"
#include "eval/loaded_run.hpp"
#include "eval/loglik.hpp"
#include "eval/speed.hpp"
#include "kernels/backend.hpp"
#include "tests/gpu/decode_check.hpp"
#include "tests/gpu/host_helpers.hpp"
#include "tests/temp_dir.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/linear_layer.hpp"
#include "trainer/model.hpp"
#include "trainer/train.hpp"

using namespace lar;
using kernels::DType;
using kernels::Tensor;
using lar::gpu_test::backend;
using lar::gpu_test::decode_layer;
using lar::gpu_test::decode_run_config;
using lar::gpu_test::DecodeErrors;
using lar::gpu_test::kVocab;
using lar::gpu_test::rel_rms;
using lar::gpu_test::round_bf16;
using lar::gpu_test::to_device;
using lar::gpu_test::to_host;

namespace {

// The model's init with the zero-initialised parameters, the norms and CCQ's constant b_λ
// moved to random values (the same draw for both backends), and every weight nudged so that
// the tiny model's predictions are far from uniform.
std::vector<float> random_params(trainer::Model& model) {
  auto& ps = model.params();
  std::vector<float> p(ps.numel());
  model.backend().download(ps.params(), p.data());
  std::mt19937_64 rng(11);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (const auto& info : ps.table()) {
    auto has = [&](const char* s) { return info.name.find(s) != std::string::npos; };
    for (int64_t i = 0; i < info.numel; ++i) {
      const double r = nd(rng);
      float& v = p[info.offset + i];
      if (has("route_") || has("cler_gamma") || has("gate_bias") || has("ccq_w_lambda")) v = float(0.05 * r);
      if (has("norm")) v = float(1.0 + 0.2 * r);
      if (has("content_u2")) v = float(0.5 * r);           // the content signal moves the erase gates
      if (has("ccq_b_lambda")) v = float(-1.5 + 0.4 * r);  // λ ≈ 0.1–0.35: CCQ moves q visibly
      if (has("embed") || has("head")) v += float(0.05 * r);
    }
  }
  return p;
}

// Bounds. Both CUDA paths read the same bf16 q, k, v, gates in fp32, and round o to bf16 before
// the output norm; the decode kernels keep the state in fp32 and were measured within 5e-3 of
// the chunk kernels and of the fp64 CPU recurrence on exact bf16 inputs
// (tests/gpu/test_linear_{delta,methods,keydim,grouped}). Against the CUDA forward (b) the
// difference is that kernel difference carried through the output norm and W_o, plus the
// GEMMs' different splits of the same products (B rows instead of B·T): 1e-2 over all tokens,
// 2e-2 for the worst token (B × d = 384 outputs: fewer to average over). Against the CPU layer
// (a) the CUDA layer also rounds q, k, v, o (and in mixed precision every GEMM operand: x, the
// weights, ypre) to bf16 where the CPU keeps fp32 — the relative rounding of bf16 is 2⁻⁹ ≈ 2e-3
// per operand, about 6e-3 RMS after a few of them, as the layer's forward shows against the CPU
// (test_linear_layer_cuda: loss within 1e-3, gradients 1e-2 fp32 / 1.5e-2 mixed): 1.5e-2 (fp32)
// and 2.5e-2 (mixed) over all tokens, twice that for the worst token.
void check_layer(const std::string& what, const json& model, const std::string& precision, int B = 3, int T = 70) {
  const json cfg = decode_run_config(model);
  const DecodeErrors e = decode_layer(cfg, precision, B, T, random_params);
  const bool fp32 = precision == "fp32";
  const double tol_cpu = fp32 ? 1.5e-2 : 2.5e-2;
  std::printf("%-24s %-5s decode vs cpu step %.2e (worst token %.2e) | vs cuda forward %.2e (worst %.2e)%s\n",
              what.c_str(), precision.c_str(), e.step_cpu, e.worst_cpu, e.step_fwd, e.worst_fwd,
              e.side_cpu > 0 ? (" | side " + std::to_string(e.side_cpu)).c_str() : "");
  EXPECT_LT(e.step_cpu, tol_cpu) << what << " " << precision;
  EXPECT_LT(e.worst_cpu, 2 * tol_cpu) << what << " " << precision;
  EXPECT_LT(e.step_fwd, 1e-2) << what << " " << precision;
  EXPECT_LT(e.worst_fwd, 2e-2) << what << " " << precision;
  // clvr's ṽ: the conv output itself, bf16 on the CUDA path (no recurrence in between); cler's
  // and cler_h's r = z − o2/scale, o2 the bf16 readout of the fp32 state (its rounding scaled
  // by 1/scale = 8 and partly cancelling against z): twice that
  const std::string routing = cfg.at("model").at("routing");
  if (routing != "none") {
    const double tol_side = (fp32 ? 5e-3 : 1e-2) * (routing == "clvr" ? 1 : 2);
    EXPECT_GT(e.side_cpu, 0.0) << what;
    EXPECT_LT(e.side_cpu, tol_side) << what;
  }
}

}  // namespace

TEST(LinearDecodeCuda, EveryMixerDecodesAsTheCpuLayerAndItsOwnForward) {
  for (const char* arch : {"linear", "gla", "deltanet", "gdn", "kda", "gdn2", "carve"})
    for (const char* precision : {"fp32", "mixed"}) check_layer(arch, {{"architecture", arch}}, precision);
}

TEST(LinearDecodeCuda, CcqCarriesItsKeyStatistics) {
  for (const char* arch : {"gla", "gdn"})
    for (const char* precision : {"fp32", "mixed"})
      check_layer(std::string(arch) + " ccq", {{"architecture", arch}, {"ccq", {{"enabled", true}}}}, precision);
  // a fixed λ, uncentered statistics
  check_layer("gdn ccq fixed",
              {{"architecture", "gdn"}, {"ccq", {{"enabled", true}, {"lambda", 0.2}, {"centered", false}}}}, "fp32");
}

TEST(LinearDecodeCuda, WideKeyHeads) {
  // key heads of 128 (the recurrent wide-key kernels and their own L2 pass), CCQ's wide kernel
  check_layer("gdn dk128", {{"architecture", "gdn"}, {"head_dim", 128}, {"d_model", 256}}, "mixed");
  check_layer("kda dk128", {{"architecture", "kda"}, {"head_dim", 128}, {"d_model", 256}}, "fp32");
  check_layer("gla dk128 ccq",
              {{"architecture", "gla"}, {"head_dim", 128}, {"d_model", 256}, {"ccq", {{"enabled", true}}}}, "fp32");
}

TEST(LinearDecodeCuda, WiderAndGroupedValueHeads) {
  check_layer("gdn2 dv128", {{"architecture", "gdn2"}, {"value_dim", 128}}, "mixed");
  check_layer("gdn grouped 2/4", {{"architecture", "gdn"}, {"n_v_heads", 4}}, "mixed");
  check_layer("gla grouped 2/4", {{"architecture", "gla"}, {"n_v_heads", 4}}, "fp32");
  // per value head queries over repeated q, k: CCQ (λ per value head) and CARVE
  check_layer("gdn grouped ccq", {{"architecture", "gdn"}, {"n_v_heads", 4}, {"ccq", {{"enabled", true}}}}, "fp32");
  check_layer("carve grouped 2/4", {{"architecture", "carve"}, {"n_v_heads", 4}}, "fp32");
}

TEST(LinearDecodeCuda, ClvrPublishesTheWrittenValue) {
  check_layer("gdn clvr", {{"architecture", "gdn"}, {"routing", "clvr"}}, "mixed");
  check_layer("carve clvr", {{"architecture", "carve"}, {"routing", "clvr"}}, "fp32");
}

// Whole models through eval::Decoder (the path of eval's speed and generation): a hybrid stack
// of linear and softmax layers (the softmax layers' KV-cache step runs on the backend's own
// ops) decodes the same tokens on both backends. Bounds on the next token's log-probability
// (≈ −4.6 at V = 96): the logits carry the layers' relative error (above) times their size;
// 3e-2 mean absolute difference, 1.5e-1 for the worst of B·T, against the CPU decoder and
// against the CUDA model's own full forward (eval::score).
TEST(LinearDecodeCuda, HybridModelDecodesAsOnTheCpu) {
  const std::vector<json> models = {
      {{"architecture", "gdn"}, {"stack", "hybrid"}, {"hybrid_ratio", 1}, {"n_layers", 4}},
      {{"architecture", "carve"}, {"stack", "hybrid"}, {"hybrid_ratio", 2}, {"n_layers", 3}},
      {{"architecture", "gla"},
       {"stack", "hybrid"},
       {"hybrid_ratio", 1},
       {"n_layers", 4},
       {"ccq", {{"enabled", true}}}},
      {{"architecture", "kda"},
       {"stack", "hybrid"},
       {"hybrid_ratio", 1},
       {"n_layers", 4},
       {"routing", "clvr"},
       {"ccq", {{"enabled", true}}}},
      {{"architecture", "gdn"}, {"stack", "hybrid"}, {"hybrid_ratio", 1}, {"n_layers", 4}, {"routing", "cler"}},
      {{"architecture", "kda"}, {"n_layers", 3}, {"routing", "cler_h"}, {"routing_rank", 4}}};
  for (const auto& m : models) {
    const json cfg = decode_run_config(m);
    const std::string what = m.at("architecture").get<std::string>() + (m.contains("stack") ? " hybrid" : " pure") +
                             (m.contains("routing") ? " " + m.at("routing").get<std::string>() : "") +
                             (m.contains("ccq") ? " ccq" : "");
    gpu_test::expect_model_decodes_as_on_the_cpu(cfg, what, random_params);
  }
}

// eval's speed measurement (prefill, then decode through eval::Decoder) on a run trained on the
// CUDA backend: a hybrid gdn model, read back with backend cuda.
TEST(LinearDecodeCuda, SpeedMeasurementRunsOnTheCudaBackend) {
  TempDir dir;
  const json cfg = decode_run_config(
      {{"architecture", "gdn"}, {"stack", "hybrid"}, {"hybrid_ratio", 1}, {"n_layers", 2}}, {{"backend", "cuda"}});
  RunDir(dir.path).write_config({{"experiment", "test"},
                                 {"cell_id", "c"},
                                 {"hash", "h"},
                                 {"axes", json::object()},
                                 {"role", "main"},
                                 {"baseline", nullptr},
                                 {"config", cfg}});
  ASSERT_EQ(trainer::train_run(dir.path), 0);
  eval::OpenOptions o;
  o.backend = "cuda";
  auto run = eval::LoadedRun::open(dir.path, o);
  ASSERT_EQ(run->backend().device(), kernels::Device::cuda);
  eval::SpeedOptions so;
  so.batch = 2;
  so.prompt_len = 32;
  so.decode_tokens = 8;
  so.repeats = 1;
  const json s = eval::measure_speed(*run, so);
  std::printf("speed on cuda: %s\n", s.dump().c_str());
  EXPECT_GT(s.at("prefill_ms").get<double>(), 0.0);
  EXPECT_GT(s.at("decode_tok_s").get<double>(), 0.0);
}

// cler and cler_h publish the write residual r_t = z_t − S_{t−1}(a_t ⊙ e_t) (a readout of the state
// before the token's update), and cler's layers read the lower layer's r into ṽ = v + Γ r.
TEST(LinearDecodeCuda, ClerPublishesTheWriteResidual) {
  for (const char* arch : {"gdn", "deltanet", "kda", "gdn2"})
    check_layer(std::string(arch) + " cler", {{"architecture", arch}, {"routing", "cler"}}, "fp32");
  check_layer("gdn cler_h", {{"architecture", "gdn"}, {"routing", "cler_h"}, {"routing_rank", 4}}, "mixed");
  check_layer("gdn cler grouped", {{"architecture", "gdn"}, {"routing", "cler"}, {"n_v_heads", 4}}, "fp32");
}

// What the CUDA decode does not run — the β-scaled routing signal (routing_signal: update) — is a
// UserError naming the key and value, and where to decode instead.
TEST(LinearDecodeCuda, WhatTheCudaDecodeDoesNotRunIsAClearError) {
  json m = {{"architecture", "gdn"}, {"n_layers", 2}, {"routing", "cler"}, {"routing_signal", "update"}};
  const json cfg = decode_run_config(m);
  auto gpu = backend("cuda", "mixed");
  trainer::Model mg(cfg, *gpu);
  mg.init(5);
  try {
    eval::Decoder dec(mg, 1, 4);
    FAIL() << "no error";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("model.architecture: 'gdn' decode (step) on backend cuda", 0), 0u) << msg;
    EXPECT_NE(msg.find("model.routing_signal: 'update' (the β-scaled write residual) has no CUDA decode yet "
                       "(decode with backend: cpu)"),
              std::string::npos)
        << msg;
  }
}
