// The recurrent decode of the state-space style mixers on the CUDA backend (init_state/step of
// mamba2, mamba3 and gla_hedgehog → CudaMamba2 / CudaMamba3 / CudaHedgehog: the forward's
// projections, conv over a window of the last W projection rows and output, with the gla channel
// decode (Mamba-2, GLA-Hedgehog) or Mamba-3's own per-token kernel, mamba3_decode_step, on the
// device state). For each mixer (mamba2 at state 128; mamba3 SISO and MIMO rank 4 at state 128;
// gla_hedgehog at head 64 and head 16, the latter padded to the kernels' 64-wide key and value;
// and at CCQ's paper heads of 256 on the key-block split's decode, its gate opened),
// fp32 and mixed, a one-layer model decodes T = 70 tokens of B = 3 sequences one at a time
// (past one 64-token chunk of the forward), and every token's output is compared with (a) the
// CPU layer's step() on the same parameters and inputs and (b) the CUDA layer's own full
// forward. Then whole models (a mamba2 + softmax hybrid as the CCQ/CARVE specs build, pure
// mamba3 MIMO and gla_hedgehog stacks) decode through eval::Decoder on both backends. The decode
// is gated (kSsmDecodeCudaVerified, trainer/mixers/ssm_common.hpp): the tests open the gate for
// themselves (ssm_decode_cuda_unverified_allowed) and check the refusal with it closed.
// Inputs are fresh random normals (never zeros); the constant-initialised parameters are
// randomised so no path is trivial.
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
#include "eval/decoder.hpp"
#include "eval/loglik.hpp"
#include "kernels/backend.hpp"
#include "kernels/linear/grouped_heads.hpp"
#include "tests/gpu/decode_check.hpp"
#include "tests/gpu/host_helpers.hpp"
#include "tests/gpu/key_split_open.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/ssm_common.hpp"
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

// The gate of the CUDA decode, open for the scope (the tests run the unverified path).
struct OpenGate {
  OpenGate() { trainer::mixers::ssm_decode_cuda_unverified_allowed() = true; }
  ~OpenGate() { trainer::mixers::ssm_decode_cuda_unverified_allowed() = false; }
};

// The model's init with the zero- or constant-initialised parameters (Hedgehog's gate bias and
// feature maps, Mamba's D, B/C biases and MIMO maps) and the norms moved to random values (the same draw for both
// backends), and every weight nudged so that the tiny model's predictions are far from uniform.
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
      const bool ends_D = info.name.size() >= 1 && info.name.back() == 'D' &&
                          (info.name.size() == 1 || info.name[info.name.size() - 2] == '.');
      if (has("gate_bias")) v = float(0.05 * r);
      if (has("norm")) v = float(1.0 + 0.2 * r);
      if (has("fmap_")) v = float(0.1 * r);  // Hedgehog's maps off the identity
      if (((has("B_bias") || has("C_bias")) && !has("conv")) || ends_D) v = float(1.0 + 0.2 * r);  // Mamba's constants
      if (has("mimo_")) v *= float(1.0 + 0.2 * r);  // Mamba-3's MIMO maps
      if (has("embed") || has("head")) v += float(0.05 * r);
    }
  }
  return p;
}

// Bounds, as tests/gpu/test_linear_decode_cuda.cpp's (the same argument). Mamba-2 and
// GLA-Hedgehog decode on the same gla channel decode kernels (their state sizes and feature dims
// of 128 on the wide-key decode, GLA-Hedgehog at head 16 on the 64-wide one, padded) with the
// forward's own projections, conv, gates and output ops; against the CUDA forward (b) the
// difference is the decode kernel against the forward's kernel carried through the output norm
// and W_o, plus the GEMMs' different splits of the same products: 1e-2 over all tokens, 2e-2 for
// the worst token. Mamba-3's decode runs its own recurrence in fp32 where the forward rounds q,
// k and the written value c·v to bf16 for the channel kernel (2⁻⁹ relative each): the same
// bounds. Against the CPU layer (a) the CUDA layer also rounds the kernels' inputs and o (and in
// mixed precision every GEMM operand) to bf16: 1.5e-2 (fp32) and 2.5e-2 (mixed) over all
// tokens, twice that for the worst token.
void check_layer(const std::string& what, const json& model, const std::string& precision, int B = 3, int T = 70) {
  const OpenGate open;
  const json cfg = decode_run_config(model);
  const DecodeErrors e = decode_layer(cfg, precision, B, T, random_params);
  const bool fp32 = precision == "fp32";
  const double tol_cpu = fp32 ? 1.5e-2 : 2.5e-2;
  std::printf("%-24s %-5s decode vs cpu step %.2e (worst token %.2e) | vs cuda forward %.2e (worst %.2e)\n",
              what.c_str(), precision.c_str(), e.step_cpu, e.worst_cpu, e.step_fwd, e.worst_fwd);
  EXPECT_LT(e.step_cpu, tol_cpu) << what << " " << precision;
  EXPECT_LT(e.worst_cpu, 2 * tol_cpu) << what << " " << precision;
  EXPECT_LT(e.step_fwd, 1e-2) << what << " " << precision;
  EXPECT_LT(e.worst_fwd, 2e-2) << what << " " << precision;
}

const json kMamba = {{"expand", 2}, {"head_dim", 64}, {"state_size", 128}};

json mamba2_model() { return {{"architecture", "mamba2"}, {"conv_size", 4}, {"mamba", kMamba}}; }
json mamba3_model(int rank) {
  json m = {{"architecture", "mamba3"}, {"mamba", kMamba}};
  if (rank > 1) m["mamba3"] = {{"form", "mimo"}, {"mimo_rank", rank}};
  return m;
}
json hedgehog_model(int head) {
  return {{"architecture", "gla_hedgehog"}, {"head_dim", head}, {"value_dim", head}, {"n_heads", 128 / head}};
}

}  // namespace

TEST(SsmDecodeCuda, Mamba2DecodesAsTheCpuLayerAndItsOwnForward) {
  for (const char* precision : {"fp32", "mixed"}) check_layer("mamba2 N128", mamba2_model(), precision);
}

TEST(SsmDecodeCuda, Mamba3DecodesAsTheCpuLayerAndItsOwnForward) {
  for (const char* precision : {"fp32", "mixed"}) {
    check_layer("mamba3 siso N128", mamba3_model(1), precision);
    check_layer("mamba3 mimo4 N128", mamba3_model(4), precision);
  }
}

TEST(SsmDecodeCuda, HedgehogDecodesAsTheCpuLayerAndItsOwnForward) {
  for (const char* precision : {"fp32", "mixed"}) {
    check_layer("gla_hedgehog head64", hedgehog_model(64), precision);
    check_layer("gla_hedgehog head16", hedgehog_model(16), precision);
  }
}

// CCQ's paper heads (head_dim 256, value_dim 512: feature dim 512) decode on the key-block
// split's decode (kernels/linear/grouped_heads.hpp: 8 decodes of 64 key channels over the
// state's column blocks, o summed over the blocks), the only CUDA path past feature dim 256, its
// gate opened for the test: one head, and two heads of 256 with value heads of 256; and heads
// of 200 (feature dim 400 padded to 448). Against the CPU step and the CUDA forward (on the
// split too), the bounds of check_layer.
TEST(SsmDecodeCuda, HedgehogPaperHeadsDecodeOnTheKeySplit) {
  namespace kl = kernels::cuda::linear;
  const gpu_test::KeySplitOpen open;
  kl::GroupedShape probe;
  probe.B = 3, probe.H = 1, probe.dk = 512, probe.dv = 512;
  ASSERT_TRUE(kl::grouped_channel_decode_key_split(kl::ChannelMixer::gla, probe));
  const json one = {{"architecture", "gla_hedgehog"}, {"head_dim", 256}, {"value_dim", 512}, {"n_heads", 1}};
  const json two = {{"architecture", "gla_hedgehog"}, {"head_dim", 256}, {"value_dim", 256}, {"n_heads", 2}};
  const json padded = {{"architecture", "gla_hedgehog"}, {"head_dim", 200}, {"value_dim", 64}, {"n_heads", 3}};
  for (const char* precision : {"fp32", "mixed"}) check_layer("gla_hedgehog head256 dv512", one, precision);
  check_layer("gla_hedgehog 2x head256", two, "fp32");
  check_layer("gla_hedgehog 3x head200", padded, "fp32", 1);
}

// Whole models through eval::Decoder: a mamba2 + softmax hybrid (the softmax layers' KV-cache
// step on the backend's own ops), and pure mamba3 MIMO and gla_hedgehog stacks, decode the same
// tokens on both backends. Bounds on the next token's log-probability (≈ −4.6 at V = 96), as
// test_linear_decode_cuda's HybridModelDecodesAsOnTheCpu: 3e-2 mean absolute difference, 1.5e-1
// for the worst of B·T, against the CPU decoder and against the CUDA model's own full forward.
TEST(SsmDecodeCuda, ModelsDecodeAsOnTheCpu) {
  const OpenGate open;
  json hybrid = mamba2_model();
  hybrid.merge_patch({{"stack", "hybrid"}, {"hybrid_ratio", 1}, {"n_layers", 4}});
  json m3 = mamba3_model(4);
  m3["n_layers"] = 2;
  json hh = hedgehog_model(64);
  hh["n_layers"] = 2;
  for (const json& m : {hybrid, m3, hh}) {
    const json cfg = decode_run_config(m);
    const std::string what = m.at("architecture").get<std::string>() + (m.contains("stack") ? " hybrid" : " pure");
    gpu_test::expect_model_decodes_as_on_the_cpu(cfg, what, random_params);
  }
}

// With the gate closed (until kSsmDecodeCudaVerified is true) the CUDA decode of each mixer is a
// UserError naming the key, the value and the test; once it is true the decoder builds.
TEST(SsmDecodeCuda, UnverifiedDecodeIsAClearError) {
  trainer::mixers::ssm_decode_cuda_unverified_allowed() = false;
  for (const json& m : {mamba2_model(), mamba3_model(1), hedgehog_model(64)}) {
    const std::string arch = m.at("architecture");
    const json cfg = decode_run_config(m);
    auto gpu = backend("cuda", "mixed");
    trainer::Model mg(cfg, *gpu);
    mg.init(5);
    if (trainer::mixers::kSsmDecodeCudaVerified) {
      EXPECT_NO_THROW(eval::Decoder(mg, 1, 4)) << arch;
      continue;
    }
    try {
      eval::Decoder dec(mg, 1, 4);
      FAIL() << arch << ": no error";
    } catch (const UserError& e) {
      const std::string msg = e.what();
      // the backend's name carries its precision and device: "cuda-mixed-bf16, … (NVIDIA H200)"
      EXPECT_EQ(msg.rfind("model.architecture: '" + arch + "' decode (step) on backend cuda", 0), 0u) << msg;
      EXPECT_NE(msg.find(" has a CUDA path that is not yet verified on a GPU (tests/gpu/test_ssm_decode_cuda.cpp); "
                         "decode with backend: cpu"),
                std::string::npos)
          << msg;
    }
  }
}
