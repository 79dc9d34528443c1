// The Mamba-3 layer, SISO and MIMO (trainer/mixers/mamba3_mixer.cpp): gradients by finite
// differences in fp64 (the chunkwise form on the shared core), decode by Mamba-3's own rotary,
// trapezoidal recurrence (kernels/ssm/mamba3.hpp) equal to the chunkwise forward, MIMO of
// rank 1 with its maps at 1 equal to SISO, the parameter shapes and the options' errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "mixer_checks.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/mamba3_layer.hpp"
#include "trainer/train.hpp"

using lar::json;
namespace tr = lar::trainer;

namespace {

tr::MixerConfig config(json mamba, json m3 = json::object(), int chunk = 4) {
  tr::MixerConfig c;
  c.kind = "mamba3";
  c.d_model = 6;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.head_dim = 3;
  c.value_dim = 3;
  c.init_std = 0.3;
  c.routing = "none";
  c.n_layers = 1;
  c.linear_index = 0;
  c.model = json{{"architecture", "mamba3"}, {"chunk_size", chunk}, {"routing", "none"}, {"mamba", mamba}, {"mamba3", m3}};
  return c;
}

}  // namespace

TEST(Mamba3Layer, FiniteDifferenceGradientsFp64) {
  // the a-projection's clamp at −1e-4 is far from the random init's values, so every
  // parameter is differentiable at the checked point
  lar::test::check_gradients(config(json{{"expand", 2}, {"head_dim", 3}, {"state_size", 4}, {"n_groups", 2}}),
                             "mamba3 siso G=2");
  lar::test::check_gradients(config(json{{"expand", 1}, {"head_dim", 2}, {"state_size", 6}}, json{{"rope_fraction", 1.0}}, 3),
                             "mamba3 siso full rope, chunk 3");
}

TEST(Mamba3Layer, DecodeOwnRecurrenceEqualsChunkForward) {
  lar::test::check_decode(config(json{{"expand", 2}, {"head_dim", 4}, {"state_size", 6}}), "mamba3");
  lar::test::check_decode(config(json{{"expand", 2}, {"head_dim", 3}, {"state_size", 4}, {"n_groups", 2}}, json::object(), 5),
                          "mamba3 G=2 chunk 5");
}

TEST(Mamba3Layer, MimoFiniteDifferenceGradientsFp64) {
  const json mimo2{{"form", "mimo"}, {"mimo_rank", 2}};
  lar::test::check_gradients(config(json{{"expand", 2}, {"head_dim", 3}, {"state_size", 4}, {"n_groups", 2}}, mimo2, 3),
                             "mamba3 mimo R=2 G=2, chunk 3");
  lar::test::check_gradients(config(json{{"expand", 1}, {"head_dim", 2}, {"state_size", 6}},
                                    json{{"form", "mimo"}, {"mimo_rank", 3}, {"rope_fraction", 1.0}}, 2),
                             "mamba3 mimo R=3 full rope, chunk 2");
}

TEST(Mamba3Layer, MimoDecodeOwnRecurrenceEqualsChunkForward) {
  lar::test::check_decode(config(json{{"expand", 2}, {"head_dim", 4}, {"state_size", 6}}, json{{"form", "mimo"}}),
                          "mamba3 mimo R=4");
  lar::test::check_decode(config(json{{"expand", 2}, {"head_dim", 3}, {"state_size", 4}, {"n_groups", 2}},
                                 json{{"form", "mimo"}, {"mimo_rank", 3}}, 5),
                          "mamba3 mimo R=3 G=2 chunk 5");
}

// MIMO of rank 1 whose maps m_x, m_z, m_o are 1 is the SISO layer: same parameters (B_bias
// [H, 1, N] holds SISO's [H, N]), same output.
TEST(Mamba3Layer, MimoRankOneIsSiso) {
  const json shape{{"expand", 2}, {"head_dim", 3}, {"state_size", 4}, {"n_groups", 2}};
  auto siso = tr::make_mixer(config(shape));
  auto mimo = tr::make_mixer(config(shape, json{{"form", "mimo"}, {"mimo_rank", 1}}));
  lar::test::HostParams<double> ps(*siso, 11), pm(*mimo, 11);
  for (size_t i = 0; i < ps.specs.size(); ++i) pm[ps.specs[i].name] = ps.p[i];
  for (const char* map : {"mimo_x", "mimo_z", "mimo_o"}) std::fill(pm[map].begin(), pm[map].end(), 1.0);
  auto be = lar::kernels::make_backend("cpu", 1, lar::kernels::DType::f64);
  lar::kernels::Arena arena(*be);
  tr::ForwardContext ctx{*be, arena, false};
  const int B = 2, T = 6, d = 6;
  std::vector<double> x(B * T * d), ys(x.size()), ym(x.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7 * (double)i);
  tr::Routing route;
  using lar::kernels::Tensor;
  const auto f64 = lar::kernels::DType::f64;
  siso->forward(ctx, Tensor(x.data(), f64, {B, T, d}), Tensor(ys.data(), f64, {B, T, d}), route);
  mimo->forward(ctx, Tensor(x.data(), f64, {B, T, d}), Tensor(ym.data(), f64, {B, T, d}), route);
  EXPECT_LE(lar::test::rel_err(ym, ys), 1e-13);
  EXPECT_GT(lar::test::rel_err(ys, std::vector<double>(ys.size(), 0.0)), 0.5);
}

// The paper's shape at d_model 128: expand 2, head_dim 64 → 4 heads, state 128, rank 4.
TEST(Mamba3Layer, MimoParameterShapes) {
  auto shapes = [](json m3) {
    auto c = config(json::object(), m3);
    c.d_model = 128;
    std::map<std::string, std::vector<int64_t>> out;
    for (const auto& s : tr::make_mixer(c)->params()) out[s.name] = s.shape;
    return out;
  };
  auto siso = shapes(json::object()), mimo = shapes(json{{"form", "mimo"}});
  EXPECT_EQ(mimo["w_B"], (std::vector<int64_t>{4 * 128, 128}));  // R·G·N rows
  EXPECT_EQ(mimo["w_C"], (std::vector<int64_t>{4 * 128, 128}));
  EXPECT_EQ(mimo["B_bias"], (std::vector<int64_t>{4, 4, 128}));  // [H, R, N]
  EXPECT_EQ(mimo["C_bias"], (std::vector<int64_t>{4, 4, 128}));
  for (const char* map : {"mimo_x", "mimo_z", "mimo_o"}) {
    EXPECT_EQ(mimo[map], (std::vector<int64_t>{4, 4, 64})) << map;  // [H, R, P]
    EXPECT_EQ(siso.count(map), 0u) << map;
  }
  EXPECT_EQ(siso["w_B"], (std::vector<int64_t>{128, 128}));
  EXPECT_EQ(siso["B_bias"], (std::vector<int64_t>{4, 128}));
  EXPECT_EQ(mimo.size(), siso.size() + 3);
  for (const auto& [name, shape] : siso)
    if (name != "w_B" && name != "w_C" && name != "B_bias" && name != "C_bias") {
      EXPECT_EQ(mimo[name], shape) << name;
    }
  // the maps start as the reference's: x and the output averaged over the rank, z as is
  auto c = config(json::object(), json{{"form", "mimo"}});
  c.d_model = 128;
  for (const auto& s : tr::make_mixer(c)->params()) {
    if (s.name == "mimo_x" || s.name == "mimo_o") {
      EXPECT_DOUBLE_EQ(s.init.a, 0.25) << s.name;
    }
    if (s.name == "mimo_z") {
      EXPECT_DOUBLE_EQ(s.init.a, 1.0);
    }
  }
}

TEST(Mamba3Layer, OptionErrors) {
  auto msg = [](json m3) {
    try {
      (void)tr::make_mixer(config(json{{"head_dim", 3}, {"state_size", 4}}, m3));
    } catch (const lar::UserError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(msg(json{{"form", "mimo"}}), "");
  EXPECT_EQ(msg(json{{"form", "mimo"}, {"mimo_rank", 0}}), "model.mamba3.mimo_rank: must be ≥ 1, got 0");
  EXPECT_EQ(msg(json{{"form", "miso"}}), "model.mamba3.form: must be siso or mimo, got 'miso'");
  EXPECT_NE(msg(json{{"rope_fraction", 0.3}}).find("model.mamba3.rope_fraction"), std::string::npos);
  EXPECT_EQ(msg(json{{"form", "siso"}}), "");
  EXPECT_EQ(msg(json{{"form", "siso"}, {"mimo_rank", 0}}), "");  // the rank is a MIMO option
}

// trainer::cuda_unsupported for a Mamba-3 model. While the CUDA layer is unverified
// (kMamba3CudaVerified false) every mamba3 model gets the gate's reason; the shapes the layer
// takes (state 128 or 256, head dim a multiple of 64 up to 512, MIMO rank ≤ 4, any chunk size)
// are checked with the gate opened as the GPU tests open it. Builds without CUDA refuse the kind.
TEST(Mamba3Layer, CudaCoverageNamesTheOption) {
  namespace mx = lar::trainer::mixers;
  auto model = [](json mamba, json m3 = json::object(), int chunk = 64) {
    json raw = {{"model",
                 {{"architecture", "mamba3"},
                  {"stack", "pure"},
                  {"n_layers", 2},
                  {"d_model", 128},
                  {"n_heads", 2},
                  {"chunk_size", chunk},
                  {"mamba", mamba},
                  {"mamba3", m3}}},
                {"data", {{"task", "mqar"}, {"seq_len", 64}, {"batch_size", 2}}}};
    return tr::prepare_config(raw).at("model");
  };
  if (!tr::mixer_runs_on_cuda("mamba3")) {
    EXPECT_EQ(tr::cuda_unsupported(model(json::object())),
              "the 'mamba3' mixer has no CUDA implementation in this build");
    GTEST_SKIP() << "a build without CUDA";
  }
  if (!mx::kMamba3CudaVerified) {
    EXPECT_EQ(tr::cuda_unsupported(model(json::object())), mx::mamba3_cuda_gate());
    EXPECT_NE(mx::mamba3_cuda_gate().find("unverified"), std::string::npos);
  }
  struct Open {
    Open() { mx::mamba3_cuda_unverified_allowed() = true; }
    ~Open() { mx::mamba3_cuda_unverified_allowed() = false; }
  } open;
  const json mimo = {{"form", "mimo"}, {"mimo_rank", 4}};
  EXPECT_EQ(tr::cuda_unsupported(model(json::object())), "");            // the CARVE main table's SISO row
  EXPECT_EQ(tr::cuda_unsupported(model(json::object(), mimo, 16)), "");  // its MIMO row
  EXPECT_EQ(tr::cuda_unsupported(model(json{{"state_size", 256}, {"head_dim", 128}})), "");
  EXPECT_EQ(tr::cuda_unsupported(model(json{{"n_groups", 2}}, json{{"form", "mimo"}, {"mimo_rank", 2}}, 7)), "");
  EXPECT_EQ(tr::cuda_unsupported(model(json{{"state_size", 64}})),
            "model.mamba.state_size: the CUDA Mamba-3 layer takes 128 or 256, got 64");
  EXPECT_EQ(tr::cuda_unsupported(model(json{{"head_dim", 32}})),
            "model.mamba.head_dim: the CUDA Mamba-3 layer needs a multiple of 64 up to 512, got 32");
  EXPECT_EQ(tr::cuda_unsupported(model(json::object(), json{{"form", "mimo"}, {"mimo_rank", 8}})),
            "model.mamba3.mimo_rank: the CUDA Mamba-3 layer takes 1 to 4, got 8");
  EXPECT_EQ(tr::cuda_unsupported(model(json::object(), json{{"form", "siso"}, {"mimo_rank", 8}})), "");  // SISO: R = 1
}
