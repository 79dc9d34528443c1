// The GLA-Hedgehog layer on the CUDA backend (cuda_layers/hedgehog_layer_cuda.cpp: the
// feature map of kernels/hedgehog/hedgehog_ops.hpp and the gla channel kernels at key dim
// 2·head_dim) against the CPU layer (trainer/mixers/hedgehog_mixer.cpp): the feature map's
// forward and backward against the CPU map (kernels/hedgehog/hedgehog_map.hpp); the layer's
// output, input gradient and every parameter gradient at CCQ's mini shape (head 64: feature dim
// 128 on the wide-key kernels, value heads of 128) and its smoke shape (head 16: feature dim 32
// padded to the 64-wide chunk kernels, value heads of 32 padded to 64), feature dim 256, T not
// a multiple of 64 and odd B·H, fp32 and mixed, also with the feature dims on the key-block split
// of grouped_heads.hpp (its gate opened), and CCQ's paper heads of 256 (feature dim 512) on the
// split, their only CUDA path; a whole model step; a loss curve of a CUDA run
// tracking the CPU run; and the gate (kHedgehogCudaVerified, trainer/mixers/hedgehog_layer.hpp)
// that refuses the layer in the product until these tests have passed on a GPU. Every test
// but the gate's opens it for itself (allow_unverified_hedgehog_cuda), so all of this runs the
// CUDA layer before the gate is lifted. Every comparison runs on fresh random inputs and
// parameters drawn so that no map, gate or norm is at its trivial initial value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/run_dir.hpp"
#include "kernels/backend.hpp"
#include "kernels/hedgehog/hedgehog_map.hpp"
#include "kernels/linear/grouped_heads.hpp"
#include "kernels/hedgehog/hedgehog_ops.hpp"
#include "tests/gpu/device_buffer.hpp"
#include "tests/gpu/host_helpers.hpp"
#include "tests/gpu/key_split_open.hpp"
#include "tests/gpu/layer_run.hpp"
#include "tests/temp_dir.hpp"
#include "tests/trainer/run_test_helpers.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/hedgehog_layer.hpp"
#include "trainer/model.hpp"
#include "trainer/params.hpp"
#include "trainer/train.hpp"

using namespace lar;
using kernels::DType;
using kernels::Tensor;
namespace fs = std::filesystem;
using lar::gpu_test::backend;
using lar::gpu_test::LayerOut;
using lar::gpu_test::rel;
using lar::gpu_test::run_layer;
using lar::gpu_test::Dev;
using lar::gpu_test::random_batch;

namespace {

// Opens the gate for the tests that run the CUDA layer (and closes it after them).
struct OpenGate {
  OpenGate() { trainer::mixers::allow_unverified_hedgehog_cuda(true); }
  ~OpenGate() { trainer::mixers::allow_unverified_hedgehog_cuda(false); }
};

// ---------------------------------------------------------------- the feature map

// rows (token, head) rows of a head of dk: a ~ SiLU-like values of order 1, Δ ~ N(0, 0.25/dk)
// (the map well away from the identity), b ~ N(0, 0.5); dφ rounded to bf16 (what the channel
// kernels hand the map). Forward: φ in bf16 within 4e-3 relative RMS of the CPU map in fp64
// (bf16 rounding of values in (0, 1): ≤ 2⁻⁹ relative each), the padding columns exactly 0.
// Backward: from the GPU's ∂L/∂x, ∂L/∂a = ∂L/∂x (I + Δ), ∂L/∂Δ = Σ ∂L/∂xᵀ a and ∂L/∂b = Σ ∂L/∂x
// (in fp64 on the host) within 1e-5 of the CPU map's (fp32 arithmetic against fp64 on the
// same bf16 dφ: the softmax Jacobian's sums over dk ≤ 256 terms cost ≈ 1e-7 relative each).
void check_map(int64_t rows, int dk, int64_t ld, uint64_t seed) {
  namespace lk = kernels::cpu::linear;
  namespace cl = kernels::cuda::linear;
  const std::string what = "rows=" + std::to_string(rows) + " dk=" + std::to_string(dk) + " ld=" + std::to_string(ld);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> a(rows * dk), delta((size_t)dk * dk), b(dk), dphi(rows * ld, 0.0);
  for (auto& v : a) {
    const double z = 1.5 * nd(rng);
    v = z / (1.0 + std::exp(-z));
  }
  for (auto& v : delta) v = 0.5 * nd(rng) / std::sqrt((double)dk);
  for (auto& v : b) v = 0.5 * nd(rng);
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < 2 * dk; ++c) dphi[r * ld + c] = gpu_test::to_bf(nd(rng));
  // u = a Δᵀ (the layer's GEMM), in fp64 then rounded to fp32 on upload
  std::vector<double> u(rows * dk, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < dk; ++j) u[r * dk + i] += delta[(size_t)i * dk + j] * a[r * dk + j];
  // the CPU map, fp64
  std::vector<double> phi_ref(rows * 2 * dk), da_ref(rows * dk), dd_ref((size_t)dk * dk, 0.0), db_ref(dk, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    lk::hedgehog_forward(&a[r * dk], delta.data(), b.data(), dk, &phi_ref[r * 2 * dk]);
    lk::hedgehog_backward(&a[r * dk], delta.data(), dk, &phi_ref[r * 2 * dk], &dphi[r * ld], &da_ref[r * dk],
                          dd_ref.data(), db_ref.data());
  }
  Dev<float> du(u.size()), da(a.size()), db(dk), dx(a.size()), dx2(a.size());
  Dev<gpu_test::bf16> dph(rows * ld), ddph(dphi.size());
  du.put(u);
  da.put(a);
  db.put(b);
  ddph.put(dphi);
  dph.poison();
  dx.poison();
  dx2.poison();
  cl::hedgehog_map_forward(rows, dk, du.p, da.p, db.p, dph.p, ld, nullptr);
  cl::hedgehog_map_backward(rows, dk, du.p, da.p, db.p, ddph.p, ld, dx.p, dx2.p, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  const std::vector<double> phi = dph.get(), g = dx.get(), g2 = dx2.get();
  std::vector<double> phi_got(rows * 2 * dk);
  bool pad_zero = true;
  for (int64_t r = 0; r < rows; ++r) {
    for (int c = 0; c < 2 * dk; ++c) phi_got[r * 2 * dk + c] = phi[r * ld + c];
    for (int64_t c = 2 * dk; c < ld; ++c) pad_zero = pad_zero && phi[r * ld + c] == 0.0;
  }
  std::vector<double> da_got(rows * dk), dd_got((size_t)dk * dk, 0.0), db_got(dk, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < dk; ++i) {
      const double gi = g[r * dk + i];
      db_got[i] += gi;
      double s = gi;
      for (int j = 0; j < dk; ++j) {
        dd_got[(size_t)i * dk + j] += gi * a[r * dk + j];
        s += g[r * dk + j] * delta[(size_t)j * dk + i];
      }
      da_got[r * dk + i] = s;
    }
  const double ephi = gpu_test::rel_rms(phi_got, phi_ref), eda = gpu_test::rel_rms(da_got, da_ref),
               edd = gpu_test::rel_rms(dd_got, dd_ref), edb = gpu_test::rel_rms(db_got, db_ref);
  std::printf("hedgehog map %-28s phi %.2e | da %.2e dDelta %.2e db %.2e\n", what.c_str(), ephi, eda, edd, edb);
  EXPECT_LT(ephi, 4e-3) << what << ": phi";
  EXPECT_TRUE(pad_zero) << what << ": padding columns not zero";
  EXPECT_LT(eda, 1e-5) << what << ": da";
  EXPECT_LT(edd, 1e-5) << what << ": dDelta";
  EXPECT_LT(edb, 1e-5) << what << ": db";
  EXPECT_TRUE(g == g2) << what << ": dx2 is not a copy of dx";
}

// ---------------------------------------------------------------- the layer

struct Shape {
  int d = 192, H = 3, dk = 64, dv = 128, W = 4;
  int B = 3, T = 100;
  std::string name() const {
    return "d=" + std::to_string(d) + " H=" + std::to_string(H) + " dk=" + std::to_string(dk) +
           " dv=" + std::to_string(dv) + " W=" + std::to_string(W) + " B=" + std::to_string(B) +
           " T=" + std::to_string(T);
  }
};

json run_config(const Shape& s, json overrides = json::object()) {
  json c = {{"seed", 5},
            {"threads", 2},
            {"model",
             {{"architecture", "gla_hedgehog"},
              {"stack", "pure"},
              {"n_layers", 2},
              {"d_model", s.d},
              {"n_heads", s.H},
              {"head_dim", s.dk},
              {"value_dim", s.dv},
              {"vocab_size", 96},
              {"conv_size", s.W}}},
            {"data", {{"task", "mqar"}, {"seq_len", s.T}, {"batch_size", s.B}, {"num_kv_pairs", 8}}},
            {"optimizer", {{"lr", 3e-3}}},
            {"schedule", {{"warmup_steps", 10}}},
            {"budget", {{"steps", 60}}},
            {"log", {{"every", 1}}},
            {"eval", {{"every", 0}, {"batches", 2}}},
            {"checkpoint", {{"every", 0}, {"keep", 2}}}};
  c.merge_patch(overrides);
  return trainer::prepare_config(c);
}

// Random parameters by name: projections N(0, 1/d_in) (outputs of order 1), convs U(±0.5),
// the maps' offsets Δ ~ N(0, 0.25/dk) and biases N(0, 0.5) (init: Δ = 0, b = 0, the identity map:
// away from it the map's own gradients are not trivially symmetric), the gate bias N(2, 1)
// (init 0; with f = x W₁ᵀW₂ᵀ of order 1, per-token decays exp(g) from about 0.88 to 0.9998
// within a sequence), the norm weight around 1.
std::vector<float> random_params(const std::vector<trainer::ParamSpec>& specs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  std::vector<float> p;
  for (const auto& s : specs) {
    int64_t n = 1;
    for (auto e : s.shape) n *= e;
    for (int64_t i = 0; i < n; ++i) {
      double v;
      if (s.name == "fmap_q_delta" || s.name == "fmap_k_delta")
        v = 0.5 * nd(rng) / std::sqrt((double)s.shape.back());
      else if (s.name == "fmap_q_bias" || s.name == "fmap_k_bias")
        v = 0.5 * nd(rng);
      else if (s.name == "gate_bias")
        v = 2.0 + nd(rng);
      else if (s.name == "o_norm")
        v = 1.0 + 0.2 * nd(rng);
      else if (s.name.rfind("conv_", 0) == 0)
        v = ud(rng) - 0.5;
      else
        v = nd(rng) / std::sqrt((double)s.shape.back());  // wq, wk, wv, gate_w1/w2, w_gate, wo
      p.push_back(static_cast<float>(v));
    }
  }
  return p;
}

// The CUDA layer against the CPU layer (fp32 reference) on the same parameters and inputs.
// Bounds, relative RMS, the linear layer's (test_linear_layer_cuda.cpp; the channel kernels
// read bf16 q, k, v, here φ_q, φ_k, v, in either precision): output and input gradient 1e-2
// (2e-2 mixed: bf16 GEMMs and activations too); each parameter's gradient 2e-2 (4e-2); the
// gradients that are sums over every token (and head) of terms of both signs — the gate bias
// and the maps' Δ and b, which sum the map's gradient over all heads — 6e-2 (1.5e-1), and
// 1.5e-1 in fp32 too where the feature dim runs the wide-key kernels (F > 64: sums over F·dv
// products of bf16 operands, as the linear layer's wide heads).
void compare_layer(const Shape& s, const std::string& precision) {
  const json cfg = run_config(s);
  const trainer::MixerConfig mc = trainer::mixer_config(cfg.at("model"), 0);
  ASSERT_EQ(mc.kind, "gla_hedgehog");
  const bool fp32 = precision == "fp32", wide = 2 * s.dk > 64;
  const double tol_out = fp32 ? 1e-2 : 2e-2, tol_param = fp32 ? 2e-2 : 4e-2, tol_sum = fp32 && !wide ? 6e-2 : 1.5e-1;
  const auto specs = trainer::make_mixer(mc)->params();
  const std::vector<float> params = random_params(specs, 17);
  std::mt19937_64 rng(23);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<float> x((size_t)s.B * s.T * s.d), dy(x.size());
  for (auto& v : x) v = static_cast<float>(nd(rng));
  for (auto& v : dy) v = static_cast<float>(nd(rng));
  auto cpu = backend("cpu", "fp32");
  auto gpu = backend("cuda", precision);
  const LayerOut ref = run_layer(*cpu, mc, params, x, dy, s.B, s.T);
  const LayerOut got = run_layer(*gpu, mc, params, x, dy, s.B, s.T);
  const std::string what = s.name() + " " + precision;
  const double ey = gpu_test::rel_rms(got.y, ref.y), edx = gpu_test::rel_rms(got.dx, ref.dx);
  EXPECT_LT(ey, tol_out) << what << ": output";
  EXPECT_LT(edx, tol_out) << what << ": input gradient";
  double worst = 0, worst_sum = 0;
  std::string worst_name, worst_sum_name;
  ASSERT_EQ(got.table.size(), ref.table.size());
  for (const auto& [name, range] : ref.table) {
    const double e = rel(got.grads, ref.grads, range.first, range.second);
    const bool token_sum = name == "gate_bias" || name.rfind("fmap_", 0) == 0;
    if (token_sum && e > worst_sum) worst_sum = e, worst_sum_name = name;
    if (!token_sum && e > worst) worst = e, worst_name = name;
    EXPECT_LT(e, token_sum ? tol_sum : tol_param) << what << ": " << name;
    // every gradient is exercised (no parameter whose gradient is trivially zero)
    double ss = 0;
    for (int64_t i = 0; i < range.second; ++i) ss += double(ref.grads[range.first + i]) * ref.grads[range.first + i];
    EXPECT_GT(ss, 0.0) << what << ": " << name << " has a zero CPU gradient";
  }
  std::printf("%-44s %-5s y %.2e dx %.2e | worst param %.2e (%s), worst token-sum %.2e (%s)\n", s.name().c_str(),
              precision.c_str(), ey, edx, worst, worst_name.c_str(), worst_sum, worst_sum_name.c_str());
}

}  // namespace

// The map at the specs' head dims (16: smoke, 64: mini, 256: paper, 128: the widest of the
// narrow instance) with the layer's padded rows (feature dim 32 → 64, 128, 256, 400 → 448) and
// unpadded rows, odd row counts (partial blocks); past 128 the wide instance (8 channels a lane).
TEST(HedgehogCuda, FeatureMapMatchesTheCpuMap) {
  check_map(1001, 16, 64, 1);
  check_map(777, 16, 32, 2);
  check_map(1001, 64, 128, 3);
  check_map(333, 128, 256, 4);
  check_map(95, 24, 64, 5);  // a head dim off the warp's 32
  check_map(517, 256, 512, 6);  // CCQ's paper heads: feature dim 512
  check_map(201, 200, 448, 7);  // feature dim 400 padded to the split's 448
  check_map(63, 136, 272, 8);   // just past the narrow instance, unpadded
}

// CCQ's mini shape (experiments/papers/ccq/common.yaml, scale mini): heads of 64 (feature dim
// 128: the wide-key kernels), value heads of 128 (two value tiles of 64); H = 3, B = 3 (B·H = 9),
// T = 100 (a partial last chunk); and one sequence of 300 tokens (two 256-token checkpoint
// segments of the wide-key kernels).
TEST(HedgehogCuda, MiniShapeMatchesTheCpuLayer) {
  OpenGate gate;
  Shape s;
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
  s.B = 1;
  s.T = 300;
  compare_layer(s, "fp32");
}

// CCQ's smoke shape: heads of 16 (feature dim 32, padded to the 64-wide chunk kernels with zero
// features and zero log-gates), value heads of 32 (padded to 64): d 64 with 4 heads as the
// specs' first smoke size, and d 48 with 3 heads and B = 3 (B·H = 9) at T = 77.
TEST(HedgehogCuda, SmokeShapeMatchesTheCpuLayer) {
  OpenGate gate;
  Shape s;
  s.d = 64;
  s.H = 4;
  s.dk = 16;
  s.dv = 32;
  s.B = 2;
  s.T = 128;
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
  s.d = 48;
  s.H = 3;
  s.B = 3;
  s.T = 77;
  s.W = 3;
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
}

// Feature dim 256 (heads of 128, the widest the CUDA layer takes) with value heads of 64, and
// feature dim 64 without padding (heads of 32) with value heads of 64.
TEST(HedgehogCuda, OtherFeatureDimsMatchTheCpuLayer) {
  OpenGate gate;
  Shape s;
  s.d = 128;
  s.H = 1;
  s.dk = 128;
  s.dv = 64;
  s.B = 3;
  s.T = 90;
  compare_layer(s, "fp32");
  s.d = 96;
  s.H = 3;
  s.dk = 32;
  s.T = 70;
  compare_layer(s, "fp32");
  compare_layer(s, "mixed");
}

// Feature dims 128 and 256 through the key-block split of the gla kernels (grouped_heads.hpp:
// the 64-wide chunk kernels over the feature blocks of 64), its gate opened for the test beside
// the layer's own: the mini shape in fp32 and mixed, one sequence of 300 tokens, feature dim
// 256; the same bounds as above.
TEST(HedgehogCuda, KeySplitMatchesTheCpuLayer) {
  namespace kl = kernels::cuda::linear;
  OpenGate gate;
  const gpu_test::KeySplitOpen open;
  kl::GroupedShape probe;
  probe.T = 100, probe.dk = 128;
  ASSERT_TRUE(kl::grouped_channel_key_split(kl::ChannelMixer::gla, probe));
  Shape s;
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
  s.B = 1;
  s.T = 300;
  compare_layer(s, "fp32");
  s.d = 128;
  s.H = 1;
  s.dk = 128;
  s.dv = 64;
  s.B = 3;
  s.T = 90;
  compare_layer(s, "fp32");
}

// CCQ's paper heads (experiments/papers/ccq/common.yaml: head_dim 256, value_dim 512, feature
// dim 512) on the key-block split, the only CUDA path at feature dims past 256 (its gate opened
// for the test, as the layer's own): 8 feature blocks of 64 on the 64-wide chunk kernels. One
// head with B = 3 (B·H odd) at T = 100 in fp32 and mixed; the paper's 4 heads at d 1024 with one
// sequence of 130 tokens; heads of 200 (feature dim 400 padded to 448 with zero features and
// zero log-gates), 3 heads, value heads of 64, T = 77. The bounds of compare_layer (the wide
// feature dims').
TEST(HedgehogCuda, PaperHeadsMatchTheCpuLayer) {
  namespace kl = kernels::cuda::linear;
  OpenGate gate;
  const gpu_test::KeySplitOpen open;
  Shape s;
  s.d = 256;
  s.H = 1;
  s.dk = 256;
  s.dv = 512;
  s.B = 3;
  s.T = 100;
  {
    const json model = run_config(s).at("model");
    ASSERT_EQ(trainer::cuda_unsupported(model), "");
    const trainer::mixers::HedgehogShape hs = trainer::mixers::hedgehog_shape(trainer::mixer_config(model, 0));
    ASSERT_EQ(trainer::mixers::hedgehog_cuda_key_dim(hs), 512);
    kl::GroupedShape probe;
    probe.B = s.B, probe.T = s.T, probe.H = s.H, probe.dk = 512, probe.dv = 512;
    ASSERT_TRUE(kl::grouped_channel_key_split(kl::ChannelMixer::gla, probe));
  }
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
  s.d = 1024;
  s.H = 4;
  s.B = 1;
  s.T = 130;
  compare_layer(s, "fp32");
  s.d = 192;
  s.H = 3;
  s.dk = 200;
  s.dv = 64;
  s.T = 77;
  compare_layer(s, "fp32");
}

// A whole model step (embedding, norms, two GLA-Hedgehog layers, head) on the CUDA backend
// against the CPU backend, at the mini shape and the smoke shape: the model's parameter buffer
// (the fused projection's adjacency), bf16 activations between layers in mixed precision. Loss
// within 1e-3 relative, the whole gradient within 1e-2 (1.5e-2 mixed) relative RMS, as the
// linear and Mamba-2 layers' model steps. Parameters from the model's init: Δ = 0, b = 0 (the
// identity map) and the gate bias 0, as a run starts.
TEST(HedgehogCuda, ModelStepMatchesTheCpuBackend) {
  OpenGate gate;
  Shape mini;
  mini.d = 128;
  mini.H = 2;
  mini.B = 4;
  Shape smoke;
  smoke.d = 64;
  smoke.H = 4;
  smoke.dk = 16;
  smoke.dv = 32;
  smoke.B = 4;
  for (const Shape& s : {mini, smoke}) {
    const json cfg = run_config(s);
    const auto batch = random_batch(s.B, s.T, 96, 3, 7);
    for (const char* precision : {"fp32", "mixed"}) {
      const bool fp32 = std::string(precision) == "fp32";
      auto step = [&](kernels::Backend& be, double& loss) {
        trainer::Model model(cfg, be);
        model.init(cfg.at("seed").get<uint64_t>());
        auto& ps = model.params();
        ps.zero_grads();
        loss = model.forward_backward(batch).loss;
        std::vector<float> g(ps.numel());
        be.download(ps.grads(), g.data());
        return g;
      };
      auto cpu = backend("cpu", "fp32");
      auto gpu = backend("cuda", precision);
      double lc = 0, lg = 0;
      const auto gc = step(*cpu, lc), gg = step(*gpu, lg);
      const double e = gpu_test::rel_rms(gg, gc);
      std::printf("gla_hedgehog model step %-40s %-5s loss %.6f vs cpu %.6f, grads rel RMS %.2e\n", s.name().c_str(),
                  precision, lg, lc, e);
      EXPECT_NEAR(lg, lc, 1e-3 * lc) << s.name() << " " << precision;
      EXPECT_LT(e, fp32 ? 1e-2 : 1.5e-2) << s.name() << " " << precision;
    }
  }
}

// 60 steps of `backend: cuda` (mixed) against the CPU run from the same init and data: it
// learns, and the losses stay close (expect_loss_curves_agree: the linear and Mamba-2 layers'
// bounds). With the gate open, `backend: auto` resolves to cuda.
TEST(HedgehogCuda, LossCurveTracksTheCpuRun) {
  OpenGate gate;
  Shape s;
  s.d = 128;
  s.H = 2;
  s.B = 4;
  TempDir c, g;
  lar::test::write_run(c.path, run_config(s, {{"backend", "cpu"}}));
  lar::test::write_run(g.path, run_config(s, {{"backend", "cuda"}}));
  ASSERT_EQ(trainer::train_run(c.path), 0);
  ASSERT_EQ(trainer::train_run(g.path), 0);
  lar::gpu_test::expect_loss_curves_agree("gla_hedgehog", c.path, g.path);
  EXPECT_EQ(trainer::resolve_train_backend(run_config(s, {{"backend", "auto"}})), "cuda");
}

// Deterministic: the same bits on a second step (the layer has no atomics).
TEST(HedgehogCuda, DeterministicStepRepeatsItsBits) {
  OpenGate gate;
  Shape s;
  const json cfg = run_config(s);
  const trainer::MixerConfig mc = trainer::mixer_config(cfg.at("model"), 0);
  const std::vector<float> params = random_params(trainer::make_mixer(mc)->params(), 3);
  std::vector<float> x((size_t)s.B * s.T * s.d), dy(x.size());
  std::mt19937_64 rng(4);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (auto& v : x) v = static_cast<float>(nd(rng));
  for (auto& v : dy) v = static_cast<float>(nd(rng));
  auto gpu = backend("cuda", "mixed", true);
  const LayerOut a = run_layer(*gpu, mc, params, x, dy, s.B, s.T), b = run_layer(*gpu, mc, params, x, dy, s.B, s.T);
  EXPECT_TRUE(a.y == b.y && a.dx == b.dx && a.grads == b.grads);
}

// The gate, closed: while kHedgehogCudaVerified is false the product refuses the CUDA layer
// (backend: cuda, and the mixer itself on the CUDA backend) and backend: auto trains on the CPU;
// once it is true, the same shapes run. Shapes the CUDA layer cannot run are refused with the
// key either way (with the gate open here, to see the shape's reason).
TEST(HedgehogCuda, GateAndShapeRefusals) {
  Shape s;
  const json model = run_config(s).at("model");
  if (!trainer::mixers::kHedgehogCudaVerified) {
    EXPECT_NE(trainer::cuda_unsupported(model).find("unverified"), std::string::npos)
        << trainer::cuda_unsupported(model);
    EXPECT_THROW((void)run_config(s, {{"backend", "cuda"}}), UserError);
    EXPECT_EQ(trainer::resolve_train_backend(run_config(s, {{"backend", "auto"}})), "cpu");
    const trainer::MixerConfig mc = trainer::mixer_config(model, 0);
    const std::vector<float> params = random_params(trainer::make_mixer(mc)->params(), 3);
    std::vector<float> x((size_t)s.B * s.T * s.d, 0.5f);
    auto gpu = backend("cuda", "fp32");
    EXPECT_THROW((void)run_layer(*gpu, mc, params, x, x, s.B, s.T), UserError);
  } else {
    EXPECT_EQ(trainer::cuda_unsupported(model), "");
  }
  OpenGate gate;
  EXPECT_EQ(trainer::cuda_unsupported(model), "");
  json wide = model;
  wide["head_dim"] = 256;  // CCQ's paper scale: feature dim 512, on the key-block split only
  namespace kl = kernels::cuda::linear;
  const bool was = kl::wide_key_split_unverified_allowed();
  kl::wide_key_split_unverified_allowed() = false;
  if (!kl::kWideKeySplitVerified) {
    const std::string why = trainer::cuda_unsupported(wide);
    EXPECT_EQ(why.rfind("model.head_dim: the CUDA gla_hedgehog layer runs heads past 128", 0), 0u) << why;
    EXPECT_NE(why.find("kWideKeySplitVerified"), std::string::npos) << why;
    EXPECT_NE(why.find("got 256"), std::string::npos) << why;
    // the mixer itself on the CUDA backend refuses it the same way
    const trainer::MixerConfig mc = trainer::mixer_config(wide, 0);
    const std::vector<float> params = random_params(trainer::make_mixer(mc)->params(), 3);
    std::vector<float> x((size_t)s.B * s.T * s.d, 0.5f);
    auto gpu = backend("cuda", "fp32");
    EXPECT_THROW((void)run_layer(*gpu, mc, params, x, x, s.B, s.T), UserError);
  } else {
    EXPECT_EQ(trainer::cuda_unsupported(wide), "");
  }
  kl::wide_key_split_unverified_allowed() = true;
  EXPECT_EQ(trainer::cuda_unsupported(wide), "");
  kl::wide_key_split_unverified_allowed() = was;
  wide["head_dim"] = 264;
  EXPECT_EQ(trainer::cuda_unsupported(wide),
            "model.head_dim: the CUDA gla_hedgehog layer takes up to 256 (feature dim 2·head_dim up to 512, the gla "
            "kernels' key-block split), got 264");
}
