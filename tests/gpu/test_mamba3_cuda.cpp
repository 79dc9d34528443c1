// The Mamba-3 layer on the CUDA backend (cuda_layers/mamba3_layer_cuda.cpp: the gla channel
// kernels over R rows per token, kernels/ssm/mamba3_ops.hpp around them), SISO and
// MIMO, against the CPU layer (trainer/mixers/mamba3_mixer.cpp): the layer's output, input
// gradient and every parameter gradient at the CARVE mini shape (d 384: 12 heads of 64, state
// 128, MIMO rank 4 with chunk 16) and at small shapes (B·H odd, T not a multiple of 64, state
// 256, value heads of 128, grouped B and C, ranks 2 and 3), fp32 and mixed; a whole model step;
// a loss curve of a CUDA run tracking the CPU run; determinism; the gate; and the same layer with
// the states on the key-block split of grouped_heads.hpp (its gate opened). Every comparison
// runs on fresh random inputs and parameters drawn so that every gate, map and skip is far
// from trivial. Every test opens the verification gate for itself (mamba3_cuda_unverified_allowed),
// so they check the layer whatever kMamba3CudaVerified (mamba3_layer.hpp) says.
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
#include "kernels/linear/grouped_heads.hpp"
#include "tests/gpu/host_helpers.hpp"
#include "tests/gpu/key_split_open.hpp"
#include "tests/gpu/layer_run.hpp"
#include "tests/temp_dir.hpp"
#include "tests/trainer/run_test_helpers.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/mamba3_layer.hpp"
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
using lar::gpu_test::random_batch;
using lar::gpu_test::rel_rms;

namespace {

// Opens the gate for one test (and closes it again).
struct AllowUnverified {
  AllowUnverified() { trainer::mixers::mamba3_cuda_unverified_allowed() = true; }
  ~AllowUnverified() { trainer::mixers::mamba3_cuda_unverified_allowed() = false; }
};

struct Shape {
  int d = 96, expand = 2, P = 64, N = 128, G = 1;
  int R = 1;  // 1: SISO; else MIMO of this rank
  int chunk = 64;
  int B = 3, T = 100;
  std::string name() const {
    return std::string(R == 1 ? "siso" : "mimo R=" + std::to_string(R)) + " d=" + std::to_string(d) +
           " P=" + std::to_string(P) + " N=" + std::to_string(N) + " G=" + std::to_string(G) +
           " B=" + std::to_string(B) + " T=" + std::to_string(T);
  }
};

json run_config(const Shape& s, json overrides = json::object()) {
  json m3 = s.R == 1 ? json{{"form", "siso"}} : json{{"form", "mimo"}, {"mimo_rank", s.R}};
  json c = {{"seed", 5},
            {"threads", 2},
            {"model",
             {{"architecture", "mamba3"},
              {"stack", "pure"},
              {"n_layers", 2},
              {"d_model", s.d},
              {"n_heads", std::max(1, s.d / 64)},
              {"n_kv_heads", 1},
              {"vocab_size", 96},
              {"chunk_size", s.chunk},
              {"mamba", {{"expand", s.expand}, {"head_dim", s.P}, {"state_size", s.N}, {"n_groups", s.G}}},
              {"mamba3", m3}}},
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

// Random parameters by name: projections N(0, 1/d_in) (outputs of order 1: the trapezoid's λ
// spread over (0, 1), the angle rates π·tanh over most of (−π, π), A = −softplus(a) around −0.7),
// Δ = softplus(dt_bias + dt) mostly in [0.05, 0.7] (fast and slow decay within one sequence),
// the B, C norm weights, D and the MIMO maps around their init (1, 1, 1/R for x and the output)
// with 20–30% spread, and the B, C biases around 0.5 instead of their init of 1: with
// q̂ = RMSNorm(C) + 1 the products q·k over 128 channels are dominated by the biases' 128, the
// diagonal's (q·k)·v terms by one shared number, and the gradients of the biases and norms by
// cancellations between tokens that no bf16 path could be held to a bound on.
std::vector<float> random_params(const std::vector<trainer::ParamSpec>& specs, int R, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  std::vector<float> p;
  for (const auto& s : specs) {
    int64_t n = 1;
    for (auto e : s.shape) n *= e;
    for (int64_t i = 0; i < n; ++i) {
      double v;
      if (s.name == "dt_bias")
        v = -3.0 + 3.0 * ud(rng);
      else if (s.name == "D")
        v = 1.0 + 0.3 * nd(rng);
      else if (s.name == "B_norm" || s.name == "C_norm")
        v = 1.0 + 0.2 * nd(rng);
      else if (s.name == "B_bias" || s.name == "C_bias")
        v = 0.5 + 0.3 * nd(rng);
      else if (s.name == "mimo_x" || s.name == "mimo_o")
        v = (1.0 + 0.3 * nd(rng)) / R;
      else if (s.name == "mimo_z")
        v = 1.0 + 0.3 * nd(rng);
      else
        v = nd(rng) / std::sqrt((double)s.shape.back());  // the projections and wo
      p.push_back(static_cast<float>(v));
    }
  }
  return p;
}

// The parameters whose gradient is a sum over every token (and head) of terms of both signs;
// w_angle's too: the angle rates reach the rotation through φ_t = Σ_{s≤t} θ_sΔ_s, so their
// gradient is the reverse cumulative sum of ∂L/∂φ over the rest of the sequence.
bool token_sum(const std::string& name) {
  return name == "dt_bias" || name == "D" || name == "B_norm" || name == "C_norm" || name == "B_bias" ||
         name == "C_bias" || name == "w_angle" || name.rfind("mimo_", 0) == 0;
}

// The CUDA layer against the CPU layer (fp32 reference) on the same parameters and inputs.
// Bounds, relative RMS, those of the Mamba-2 layer (test_mamba2_cuda.cpp) and the linear layers
// (test_linear_layer_cuda.cpp), since the channel kernels read bf16 q, k, v in either
// precision: output and input gradient 1e-2 (2e-2 mixed: bf16 GEMMs and activations too); each
// projection's gradient 2e-2 (4e-2); the token sums (token_sum above) 6e-2 (1.5e-1). The
// conditioning, measured on the CPU layer at every shape below: scaling every parameter and
// input by 1 + 0.4%·noise (about four times bf16 rounding's RMS) moves the output and the input
// gradient by 1.1–1.6%, the projections' gradients by 1–2%, w_angle's by 2–3.5% and the other
// token sums' by up to 6% (dt_bias, MIMO rank 4 at d 96, T 100): the bounds sit in that proportion.
void compare_layer(const Shape& s, const std::string& precision) {
  const json cfg = run_config(s);
  const trainer::MixerConfig mc = trainer::mixer_config(cfg.at("model"), 0);
  ASSERT_EQ(mc.kind, "mamba3");
  const bool fp32 = precision == "fp32";
  const double tol_out = fp32 ? 1e-2 : 2e-2, tol_param = fp32 ? 2e-2 : 4e-2, tol_sum = fp32 ? 6e-2 : 1.5e-1;
  const auto specs = trainer::make_mixer(mc)->params();
  const std::vector<float> params = random_params(specs, s.R, 17);
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
  const double ey = rel_rms(got.y, ref.y), edx = rel_rms(got.dx, ref.dx);
  EXPECT_LT(ey, tol_out) << what << ": output";
  EXPECT_LT(edx, tol_out) << what << ": input gradient";
  double worst = 0, worst_sum = 0;
  std::string worst_name, worst_sum_name;
  ASSERT_EQ(got.table.size(), ref.table.size());
  for (const auto& [name, range] : ref.table) {
    const double e = rel(got.grads, ref.grads, range.first, range.second);
    const bool sum = token_sum(name);
    if (sum && e > worst_sum) worst_sum = e, worst_sum_name = name;
    if (!sum && e > worst) worst = e, worst_name = name;
    EXPECT_LT(e, sum ? tol_sum : tol_param) << what << ": " << name;
    // every gradient is exercised (no parameter whose gradient is trivially zero)
    double ss = 0;
    for (int64_t i = 0; i < range.second; ++i) ss += double(ref.grads[range.first + i]) * ref.grads[range.first + i];
    EXPECT_GT(ss, 0.0) << what << ": " << name << " has a zero CPU gradient";
  }
  std::printf("%-48s %-5s y %.2e dx %.2e | worst param %.2e (%s), worst token-sum %.2e (%s)\n", s.name().c_str(),
              precision.c_str(), ey, edx, worst, worst_name.c_str(), worst_sum, worst_sum_name.c_str());
}

// The CARVE mini scale's layer (experiments/papers/carve/{common,main}.yaml: d_model 384, the
// Mamba defaults expand 2, head dim 64, state 128: 12 heads; SISO with chunk 64, MIMO rank 4
// with chunk 16) at 2 sequences of 130 tokens (T·R = 520 rows: three 256-row checkpoint
// segments of the wide-key kernels in the MIMO form; a partial last chunk).
Shape mini(int R) {
  Shape s;
  s.d = 384;
  s.R = R;
  s.chunk = R == 1 ? 64 : 16;
  s.B = 2;
  s.T = 130;
  return s;
}

}  // namespace

TEST(Mamba3Cuda, CarveMiniShapeMatchesTheCpuLayer) {
  AllowUnverified allow;
  for (int R : {1, 4})
    for (const char* precision : {"fp32", "mixed"}) compare_layer(mini(R), precision);
}

// Small shapes: H = 3 heads (d 96) and B = 3 (B·H = 9, odd), T = 100 (not a multiple of 64),
// SISO and MIMO of ranks 2, 3 and 4 (every instantiation of the per-token kernels at state 128).
TEST(Mamba3Cuda, SmallShapesMatchTheCpuLayer) {
  AllowUnverified allow;
  Shape s;
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
  for (int R : {2, 3, 4}) {
    s.R = R;
    s.chunk = 16;
    compare_layer(s, "fp32");
  }
  s.R = 4;
  compare_layer(s, "mixed");
}

// State 256 (the other wide-key width and the per-token kernels' second instantiation), value
// heads of 128 (two value tiles), and grouped B, C (G = 2 over H = 4: their gradients summed over
// a group's heads); one sequence of 77 tokens.
TEST(Mamba3Cuda, WideStateHeadsAndGroupsMatchTheCpuLayer) {
  AllowUnverified allow;
  Shape s;
  s.N = 256;
  s.B = 1;
  s.T = 77;
  compare_layer(s, "fp32");
  s.R = 4;
  s.chunk = 16;
  compare_layer(s, "fp32");
  s.R = 1;
  s.chunk = 64;
  s.N = 128;
  s.d = 192;  // Di 384: H = 3 heads of 128
  s.P = 128;
  compare_layer(s, "fp32");
  s.d = 128;  // H = 4 heads of 64, 2 groups
  s.P = 64;
  s.G = 2;
  s.B = 3;
  compare_layer(s, "fp32");
  s.R = 2;
  s.chunk = 32;
  compare_layer(s, "mixed");
}

// States of 128 and 256 through the key-block split of the gla kernels (grouped_heads.hpp: the
// 64-wide chunk kernels over the state's blocks of 64 channels, over T·R rows), its gate opened
// for the test beside the layer's own: the CARVE mini shape SISO and MIMO rank 4, state 256,
// value heads of 128, grouped B, C; the same bounds as above.
// Disabled: the check that lifts kSsmKeySplitVerified (key_split_gate.hpp), failing on the H200
// (Mamba-3's input gradient 1.35e-2 relative RMS against 1e-2); the layers keep the recurrent
// wide-key kernels meanwhile.
TEST(Mamba3Cuda, DISABLED_KeySplitMatchesTheCpuLayer) {
  namespace kl = kernels::cuda::linear;
  AllowUnverified allow;
  const gpu_test::KeySplitOpen open;
  kl::GroupedShape probe;
  probe.T = 100, probe.dk = 128;
  ASSERT_TRUE(kl::grouped_channel_key_split(kl::ChannelMixer::gla, probe));
  compare_layer(mini(1), "fp32");
  compare_layer(mini(4), "mixed");
  Shape s;
  s.N = 256;
  s.B = 1;
  s.T = 77;
  s.R = 4;
  s.chunk = 16;
  compare_layer(s, "fp32");
  s.R = 1;
  s.chunk = 64;
  s.N = 128;
  s.d = 192;  // Di 384: H = 3 heads of 128
  s.P = 128;
  compare_layer(s, "fp32");
  s.d = 128;  // H = 4 heads of 64, 2 groups
  s.P = 64;
  s.G = 2;
  s.B = 3;
  compare_layer(s, "fp32");
}

// A whole model step (embedding, norms, two Mamba-3 layers, head) on the CUDA backend against
// the CPU backend: the model's parameter buffer (the fused projections' adjacency), bf16
// activations between layers in mixed precision. Loss within 1e-3 relative, the whole
// gradient within 1e-2 (1.5e-2 mixed) relative RMS, as Mamba-2's and the linear layers' steps.
TEST(Mamba3Cuda, ModelStepMatchesTheCpuBackend) {
  AllowUnverified allow;
  for (int R : {1, 4}) {
    Shape s;
    s.d = 128;
    s.B = 4;
    s.R = R;
    s.chunk = R == 1 ? 64 : 16;
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
      const double e = rel_rms(gg, gc);
      std::printf("mamba3 R=%d model step %-5s loss %.6f vs cpu %.6f, grads rel RMS %.2e\n", R, precision, lg, lc, e);
      EXPECT_NEAR(lg, lc, 1e-3 * lc) << "R=" << R << " " << precision;
      EXPECT_LT(e, fp32 ? 1e-2 : 1.5e-2) << "R=" << R << " " << precision;
    }
  }
}

// 60 steps of `backend: cuda` (mixed) against the CPU run from the same init and data, SISO and
// MIMO: it learns, and the losses stay close (expect_loss_curves_agree, the linear layers' and
// Mamba-2's bounds).
TEST(Mamba3Cuda, LossCurveTracksTheCpuRun) {
  AllowUnverified allow;
  for (int R : {1, 4}) {
    Shape s;
    s.d = 128;
    s.B = 4;
    s.R = R;
    s.chunk = R == 1 ? 64 : 16;
    TempDir c, g;
    lar::test::write_run(c.path, run_config(s, {{"backend", "cpu"}}));
    lar::test::write_run(g.path, run_config(s, {{"backend", "cuda"}}));
    ASSERT_EQ(trainer::train_run(c.path), 0);
    ASSERT_EQ(trainer::train_run(g.path), 0);
    lar::gpu_test::expect_loss_curves_agree(R == 1 ? "mamba3 siso" : "mamba3 mimo", c.path, g.path);
    EXPECT_EQ(trainer::resolve_train_backend(run_config(s, {{"backend", "auto"}})), "cuda");
  }
}

// Deterministic: the same bits on a second step (the layer has no atomics).
TEST(Mamba3Cuda, DeterministicStepRepeatsItsBits) {
  AllowUnverified allow;
  for (int R : {1, 4}) {
    Shape s;
    s.R = R;
    s.chunk = R == 1 ? 64 : 16;
    const json cfg = run_config(s);
    const trainer::MixerConfig mc = trainer::mixer_config(cfg.at("model"), 0);
    const std::vector<float> params = random_params(trainer::make_mixer(mc)->params(), R, 3);
    std::vector<float> x((size_t)s.B * s.T * s.d), dy(x.size());
    std::mt19937_64 rng(4);
    std::normal_distribution<double> nd(0.0, 1.0);
    for (auto& v : x) v = static_cast<float>(nd(rng));
    for (auto& v : dy) v = static_cast<float>(nd(rng));
    auto gpu = backend("cuda", "mixed", true);
    const LayerOut a = run_layer(*gpu, mc, params, x, dy, s.B, s.T), b = run_layer(*gpu, mc, params, x, dy, s.B, s.T);
    EXPECT_TRUE(a.y == b.y && a.dx == b.dx && a.grads == b.grads) << "R=" << R;
  }
}

// While kMamba3CudaVerified is false: `backend: cuda` is refused with the gate's reason, `auto`
// trains on the CPU, and the layer itself refuses the CUDA backend. Once it is true: the
// CARVE shapes resolve to cuda, and a shape out of coverage names its value.
TEST(Mamba3Cuda, GateRefusesUntilVerified) {
  Shape s;
  if (!trainer::mixers::kMamba3CudaVerified) {
    try {
      (void)run_config(s, {{"backend", "cuda"}});
      ADD_FAILURE() << "backend: cuda accepted an unverified mamba3";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("unverified"), std::string::npos) << e.what();
    }
    EXPECT_EQ(trainer::resolve_train_backend(run_config(s, {{"backend", "auto"}})), "cpu");
    const trainer::MixerConfig mc = trainer::mixer_config(run_config(s).at("model"), 0);
    auto gpu = backend("cuda", "fp32");
    std::vector<float> x((size_t)s.B * s.T * s.d, 0.5f);
    EXPECT_THROW(run_layer(*gpu, mc, random_params(trainer::make_mixer(mc)->params(), 1, 1), x, x, s.B, s.T),
                 UserError);
  } else {
    EXPECT_EQ(trainer::resolve_train_backend(run_config(mini(1), {{"backend", "auto"}})), "cuda");
    EXPECT_EQ(trainer::resolve_train_backend(run_config(mini(4), {{"backend", "auto"}})), "cuda");
  }
  AllowUnverified allow;
  s.N = 64;
  EXPECT_EQ(trainer::cuda_unsupported(run_config(s).at("model")),
            "model.mamba.state_size: the CUDA Mamba-3 layer takes 128 or 256, got 64");
  s.N = 128;
  s.R = 5;
  EXPECT_EQ(trainer::cuda_unsupported(run_config(s).at("model")),
            "model.mamba3.mimo_rank: the CUDA Mamba-3 layer takes 1 to 4, got 5");
}
