// The Mamba-2 layer on the CUDA backend (cuda_layers/mamba2_layer_cuda.cpp: the gla channel
// kernels with the scalar gate broadcast over the key channels, kernels/ssm/
// mamba2_ops.hpp around them) against the CPU layer (trainer/mixers/mamba2_mixer.cpp): the
// layer's output, input gradient and every parameter gradient at the CCQ / CARVE shape (state
// 128, head dim 64), state 64 and 256, grouped B, C (G < H), value heads of 128, T not a
// multiple of 64 and odd B·H, fp32 and mixed, also with the states on the key-block split of
// grouped_heads.hpp (its gate opened); a whole model step; a loss curve of a CUDA run
// tracking the CPU run; and cuda_unsupported's reasons. Every comparison runs on fresh random
// inputs and parameters drawn so that every gate and skip is far from trivial.
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
#include "kernels/ssm/mamba2_ops.hpp"
#include "kernels/backend.hpp"
#include "kernels/linear/grouped_heads.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/mamba2_layer.hpp"
#include "trainer/model.hpp"
#include "trainer/params.hpp"
#include "trainer/train.hpp"
#include "tests/gpu/device_buffer.hpp"
#include "tests/gpu/host_helpers.hpp"
#include "tests/gpu/key_split_open.hpp"
#include "tests/gpu/layer_run.hpp"
#include "tests/temp_dir.hpp"
#include "tests/trainer/run_test_helpers.hpp"

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

struct Shape {
  int d = 128, expand = 2, P = 64, N = 128, G = 1, W = 4;
  int B = 3, T = 100;
  std::string name() const {
    return "d=" + std::to_string(d) + " P=" + std::to_string(P) + " N=" + std::to_string(N) + " G=" +
           std::to_string(G) + " W=" + std::to_string(W) + " B=" + std::to_string(B) + " T=" + std::to_string(T);
  }
};

json run_config(const Shape& s, json overrides = json::object()) {
  json c = {{"seed", 5},
            {"threads", 2},
            {"model",
             {{"architecture", "mamba2"},
              {"stack", "pure"},
              {"n_layers", 2},
              {"d_model", s.d},
              {"n_heads", s.d / 64},
              {"n_kv_heads", 1},
              {"vocab_size", 96},
              {"conv_size", s.W},
              {"mamba", {{"expand", s.expand}, {"head_dim", s.P}, {"state_size", s.N}, {"n_groups", s.G}}}}},
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

// Random parameters by name: projections N(0, 1/d_in) (outputs of order 1), convs and their
// biases U(±0.5), A = exp(A_log) ∈ [1, 16] as at init, Δ = softplus(dt_bias + dt) mostly in
// [0.05, 0.7] (fast and slow decay within the same sequence), D and the norm weight around 1.
// W_B and W_C at half that scale: with B, C of order 1 the products C·B over N channels made
// the layer's gradient ill-conditioned — scaling every parameter by 1 + 0.4%·noise moved the
// CPU layer's own gradients of B, C, dt_bias and D by 10–140% (one head per group, state 64),
// so no bf16 path could be held to a bound there; at half scale the same perturbation moves
// them by 1–4%, in proportion.
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
      if (s.name == "A_log") v = std::log(16.0) * ud(rng);
      else if (s.name == "dt_bias") v = -3.0 + 3.0 * ud(rng);
      else if (s.name == "D") v = 1.0 + 0.3 * nd(rng);
      else if (s.name == "norm") v = 1.0 + 0.2 * nd(rng);
      else if (s.name.rfind("conv_", 0) == 0) v = ud(rng) - 0.5;
      else if (s.name == "w_B" || s.name == "w_C") v = 0.5 * nd(rng) / std::sqrt((double)s.shape.back());
      else v = nd(rng) / std::sqrt((double)s.shape.back());  // w_z, w_x, w_dt, wo
      p.push_back(static_cast<float>(v));
    }
  }
  return p;
}

// The CUDA layer against the CPU layer (fp32 reference) on the same parameters and inputs.
// Bounds, relative RMS: output and input gradient 1e-2 (2e-2 mixed: bf16 GEMMs and activations
// too); each parameter's gradient 2e-2 (4e-2); the gradients that are sums over every token of
// terms of both signs (A_log, dt_bias, D) 6e-2 (1.5e-1) — the linear layer's bounds
// (test_linear_layer_cuda.cpp), since the channel kernels read bf16 q, k, v in either precision.
void compare_layer(const Shape& s, const std::string& precision) {
  const json cfg = run_config(s);
  const trainer::MixerConfig mc = trainer::mixer_config(cfg.at("model"), 0);
  ASSERT_EQ(mc.kind, "mamba2");
  const bool fp32 = precision == "fp32";
  const double tol_out = fp32 ? 1e-2 : 2e-2, tol_param = fp32 ? 2e-2 : 4e-2, tol_sum = fp32 ? 6e-2 : 1.5e-1;
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
  const double ey = rel_rms(got.y, ref.y), edx = rel_rms(got.dx, ref.dx);
  EXPECT_LT(ey, tol_out) << what << ": output";
  EXPECT_LT(edx, tol_out) << what << ": input gradient";
  double worst = 0, worst_sum = 0;
  std::string worst_name, worst_sum_name;
  ASSERT_EQ(got.table.size(), ref.table.size());
  for (const auto& [name, range] : ref.table) {
    const double e = rel(got.grads, ref.grads, range.first, range.second);
    const bool token_sum = name == "A_log" || name == "dt_bias" || name == "D";
    if (token_sum && e > worst_sum) worst_sum = e, worst_sum_name = name;
    if (!token_sum && e > worst) worst = e, worst_name = name;
    EXPECT_LT(e, token_sum ? tol_sum : tol_param) << what << ": " << name;
    // every gradient is exercised (no parameter whose gradient is trivially zero)
    double ss = 0;
    for (int64_t i = 0; i < range.second; ++i) ss += double(ref.grads[range.first + i]) * ref.grads[range.first + i];
    EXPECT_GT(ss, 0.0) << what << ": " << name << " has a zero CPU gradient";
  }
  std::printf("%-40s %-5s y %.2e dx %.2e | worst param %.2e (%s), worst token-sum %.2e (%s)\n", s.name().c_str(),
              precision.c_str(), ey, edx, worst, worst_name.c_str(), worst_sum, worst_sum_name.c_str());
}

}  // namespace

// The CCQ / CARVE Mamba-2 baseline's shape (expand 2, head dim 64, state 128, one group):
// H = 3 heads (d 96) and B = 3 (B·H = 9), T = 100 (a partial last chunk).
TEST(Mamba2Cuda, PaperShapeMatchesTheCpuLayer) {
  Shape s;
  s.d = 96;
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
  // two 256-token checkpoint segments of the wide-key kernels, one sequence
  s.B = 1;
  s.T = 300;
  compare_layer(s, "fp32");
}

// Groups at the papers' state of 128 (the wide-key kernels' grouped heads): one head per group
// (G = H = 2: B, C of their own per head, Hk = H), two heads per group (G = 2, H = 4 and G = 3,
// H = 6: B, C shared, their gradient summed over the group's heads); a conv of 4.
TEST(Mamba2Cuda, GroupsMatchTheCpuLayer) {
  Shape s;
  s.d = 64;  // H = 2, G = 2 (with W = 3 its token-sum gradients failed on the H200: see below)
  s.G = 2;
  s.T = 77;
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
  s.d = 128;  // H = 4, 2 groups of 2 heads
  s.W = 4;
  s.B = 5;
  s.T = 65;
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
  s.d = 192;  // H = 6, 3 groups of 2 heads
  s.G = 3;
  s.B = 1;
  s.T = 77;
  compare_layer(s, "fp32");
}

// A state of 64 runs the 64-wide chunk kernels. On the H200 the A_log, dt_bias and D gradients
// measured 0.06 to 0.46 from the CPU layer, against the bound of 6e-2 (fp32), at G = 1, H = 3, W = 3,
// T = 77 and at the group shapes above. The outputs, the input gradient and every other
// parameter gradient were within their bounds. The CPU layer's own token sums are
// ill-conditioned there (see random_params), so the cause is open, and cuda_mamba2_unsupported
// refuses the state until it is known; these two tests open the refusal for themselves
// (mamba2_cuda_refused_shapes_allowed) to measure it.
// A conv of 3 at G = H = 2 (d 64, B 3, T 77): on the H200 y and dx were within bounds (1.6e-3,
// 7.8e-3 fp32) but D's gradient was 0.76 away, dt_bias 0.14, the conv biases 0.1 (fp32; mixed
// alike). The product refuses conv widths other than 4 (cuda_mamba2_unsupported) until this
// is explained; the state-64 case above also used 3.
// The conv kernels alone are exact at widths 2 to 5 (ConvKernelsMatchAHostReference, passed on
// the H200), and at this shape the CPU layer matches finite differences with its token sums
// moving at most 6 % under a 0.4 % perturbation of every parameter: neither the conv nor
// ill-conditioned data explains it.
TEST(Mamba2Cuda, DISABLED_ConvOf3MatchesTheCpuLayer) {
  trainer::mixers::mamba2_cuda_refused_shapes_allowed() = true;
  Shape s;
  s.d = 64;
  s.G = 2;
  s.W = 3;
  s.T = 77;
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
  trainer::mixers::mamba2_cuda_refused_shapes_allowed() = false;
}

TEST(Mamba2Cuda, DISABLED_StateOf64MatchesTheCpuLayer) {
  trainer::mixers::mamba2_cuda_refused_shapes_allowed() = true;
  Shape s;
  s.d = 96;  // H = 3
  s.N = 64;
  s.W = 3;
  s.T = 77;
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
  // which of the two is the cause: a state of 64 with Mamba-2's conv of 4, a conv of 3 at 256
  s.W = 4;
  compare_layer(s, "fp32");
  s.N = 256;
  s.W = 3;
  compare_layer(s, "fp32");
  trainer::mixers::mamba2_cuda_refused_shapes_allowed() = false;
}

// The conv + SiLU kernels alone (mamba2_ops.hpp) against a host fp64 reference, at widths 2 to
// 5, on a column block of a wider projection (ldp > C, as the layer calls them), fp32 and bf16
// projections, one row split and several: out, dp, dw and dbias. The layer's token-sum
// gradients failed at a conv of 3 (DISABLED_ConvOf3MatchesTheCpuLayer); this tells whether
// the conv is where.
TEST(Mamba2Cuda, ConvKernelsMatchAHostReference) {
  namespace cl = lar::kernels::cuda::linear;
  using lar::gpu_test::Dev;
  for (int64_t Bn : {3, 9}) for (int W : {2, 3, 4, 5}) for (bool pb : {false, true}) {
    const int64_t T = Bn == 3 ? 77 : 300, N = Bn * T, C = 96, ldp = 160, col = 32;
    std::mt19937_64 rng(100 + W + 7 * pb + Bn);
    std::normal_distribution<double> nd(0.0, 1.0);
    std::vector<double> P(N * ldp), w(C * W), bias(C), da(N * C);
    for (auto& v : P) v = pb ? lar::gpu_test::to_bf(nd(rng)) : nd(rng);
    for (auto& v : w) v = 0.5 * nd(rng);
    for (auto& v : bias) v = 0.5 * nd(rng);
    for (auto& v : da) v = nd(rng);
    // host reference
    std::vector<double> out(N * C), dp(N * C, 0.0), dw(C * W, 0.0), db(C, 0.0), pre(N * C);
    for (int64_t n = 0; n < N; ++n) for (int64_t c = 0; c < C; ++c) {
      const int64_t t = n % T;
      double s = bias[c];
      for (int i = 0; i < W; ++i) {
        const int64_t back = W - 1 - i;
        if (t >= back) s += w[c * W + i] * P[(n - back) * ldp + col + c];
      }
      pre[n * C + c] = s;
      const double sg = 1.0 / (1.0 + std::exp(-s));
      out[n * C + c] = s * sg;
      const double g = da[n * C + c] * sg * (1.0 + s * (1.0 - sg));
      db[c] += g;
      for (int i = 0; i < W; ++i) {
        const int64_t back = W - 1 - i;
        if (t >= back) {
          dw[c * W + i] += g * P[(n - back) * ldp + col + c];
          dp[(n - back) * C + c] += g * w[c * W + i];
        }
      }
    }
    Dev<float> Pf(N * ldp), wd(C * W), bd(C), daf(N * C), outd(N * C), dwd(C * W), dbd(C);
    Dev<lar::gpu_test::bf16> Pb(N * ldp);
    if (pb) Pb.put(P); else Pf.put(P);
    wd.put(w);
    bd.put(bias);
    daf.put(da);
    dwd.put(std::vector<double>(C * W, 0.0));
    dbd.put(std::vector<double>(C, 0.0));
    outd.poison();
    cl::SsmConvArgs a;
    a.B = Bn;
    a.T = T;
    a.C = static_cast<int>(C);
    a.W = W;
    a.p_bf16 = pb;
    a.p = pb ? static_cast<const void*>(Pb.p + col) : static_cast<const void*>(Pf.p + col);
    a.ldp = ldp;
    a.w = wd.p;
    a.bias = bd.p;
    cl::ssm_conv_silu_forward(a, outd.p, false, nullptr);
    Dev<float> scratch(cl::ssm_conv_silu_backward_scratch_floats(a));
    Dev<float> dPf(N * ldp);
    Dev<lar::gpu_test::bf16> dPb(N * ldp);
    if (pb) dPb.put(std::vector<double>(N * ldp, 0.0)); else dPf.put(std::vector<double>(N * ldp, 0.0));
    cl::ssm_conv_silu_backward(a, daf.p, false, pb ? static_cast<void*>(dPb.p + col) : static_cast<void*>(dPf.p + col),
                               dwd.p, dbd.p, scratch.p, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<double> dPh = pb ? dPb.get() : dPf.get();
    std::vector<double> dpg(N * C);
    for (int64_t n = 0; n < N; ++n) for (int64_t c = 0; c < C; ++c) dpg[n * C + c] = dPh[n * ldp + col + c];
    const std::string what = "B=" + std::to_string(Bn) + " W=" + std::to_string(W) + (pb ? " bf16" : " fp32");
    const double tol = pb ? 1e-2 : 1e-5;
    const double eo = lar::gpu_test::rel_rms(outd.get(), out), ep = lar::gpu_test::rel_rms(dpg, dp),
                 ew = lar::gpu_test::rel_rms(dwd.get(), dw), eb = lar::gpu_test::rel_rms(dbd.get(), db);
    std::printf("conv %-14s out %.2e dp %.2e dw %.2e dbias %.2e\n", what.c_str(), eo, ep, ew, eb);
    EXPECT_LT(eo, 1e-5) << what;
    EXPECT_LT(ep, tol) << what;
    EXPECT_LT(ew, 1e-5) << what;
    EXPECT_LT(eb, 1e-5) << what;
  }
}

// Value heads of 128 (two value tiles of 64 per head) and state 256.
TEST(Mamba2Cuda, WideHeadsAndStateMatchTheCpuLayer) {
  Shape s;
  s.d = 192;  // Di 384: H = 3 heads of 128
  s.P = 128;
  s.N = 256;
  s.T = 90;
  compare_layer(s, "fp32");
  s.N = 128;
  compare_layer(s, "mixed");
  s.d = 96;  // H = 3 heads of 64, state 256
  s.P = 64;
  s.N = 256;
  s.B = 1;
  s.T = 70;
  compare_layer(s, "fp32");
}

// States of 128 and 256 through the key-block split of the gla kernels (grouped_heads.hpp: the
// 64-wide chunk kernels over the state's blocks of 64 channels), its gate opened for the test:
// the paper shape in fp32 and mixed, groups (2 groups of 2 heads), value heads of 128 at state
// 256, the same bounds as above. The 64-wide kernels' gate gradient is the one the state-64
// case (DISABLED_StateOf64MatchesTheCpuLayer) found off in its token sums, so a failure of
// A_log, dt_bias or D alone here points there rather than at the split.
// Disabled: the check that lifts kSsmKeySplitVerified (key_split_gate.hpp), failing on the H200
// (Mamba-3's input gradient 1.35e-2 relative RMS against 1e-2); the layers keep the recurrent
// wide-key kernels meanwhile.
TEST(Mamba2Cuda, DISABLED_KeySplitMatchesTheCpuLayer) {
  namespace kl = kernels::cuda::linear;
  const gpu_test::KeySplitOpen open;
  kl::GroupedShape probe;
  probe.T = 100, probe.dk = 128;
  ASSERT_TRUE(kl::grouped_channel_key_split(kl::ChannelMixer::gla, probe));
  Shape s;
  s.d = 96;  // H = 3, state 128, B·H = 9, T = 100
  for (const char* precision : {"fp32", "mixed"}) compare_layer(s, precision);
  s.d = 128;  // H = 4, 2 groups of 2 heads
  s.G = 2;
  s.B = 5;
  s.T = 65;
  compare_layer(s, "fp32");
  s.d = 192;  // H = 3 heads of 128, state 256, two 256-token segments
  s.P = 128;
  s.N = 256;
  s.G = 1;
  s.B = 1;
  s.T = 300;
  compare_layer(s, "fp32");
}

// A whole model step (embedding, norms, two Mamba-2 layers, head) on the CUDA backend against
// the CPU backend: the model's parameter buffer (the fused projection's adjacency), bf16
// activations between layers in mixed precision. Loss within 1e-3 relative, the whole
// gradient within 1e-2 (1.5e-2 mixed) relative RMS, as the linear layers' model steps.
TEST(Mamba2Cuda, ModelStepMatchesTheCpuBackend) {
  Shape s;
  s.d = 128;
  s.B = 4;
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
    std::printf("mamba2 model step %-5s loss %.6f vs cpu %.6f, grads rel RMS %.2e\n", precision, lg, lc, e);
    EXPECT_NEAR(lg, lc, 1e-3 * lc) << precision;
    EXPECT_LT(e, fp32 ? 1e-2 : 1.5e-2) << precision;
  }
}

// 60 steps of `backend: cuda` (mixed) against the CPU run from the same init and data: it
// learns, and the losses stay close (the linear layers' bounds, GdnLossCurveTracksTheCpuRun).
TEST(Mamba2Cuda, LossCurveTracksTheCpuRun) {
  Shape s;
  s.d = 128;
  s.B = 4;
  TempDir c, g;
  lar::test::write_run(c.path, run_config(s, {{"backend", "cpu"}}));
  lar::test::write_run(g.path, run_config(s, {{"backend", "cuda"}}));
  ASSERT_EQ(trainer::train_run(c.path), 0);
  ASSERT_EQ(trainer::train_run(g.path), 0);
  lar::gpu_test::expect_loss_curves_agree("mamba2", c.path, g.path);
  EXPECT_EQ(trainer::resolve_train_backend(run_config(s, {{"backend", "auto"}})), "cuda");
}

// Deterministic: the same bits on a second step (the layer has no atomics).
TEST(Mamba2Cuda, DeterministicStepRepeatsItsBits) {
  Shape s;
  s.d = 96;
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
