// The Mamba-2 layer (trainer/mixers/mamba2_mixer.cpp): gradients by finite differences in
// fp64, decode (the recurrent form) equal to the chunkwise forward, the shape options and
// their errors, and which shapes the CUDA layer (cuda_layers/mamba2_layer_cuda.cpp) covers.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "mixer_checks.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/mamba3_layer.hpp"
#include "trainer/train.hpp"

using lar::json;
namespace tr = lar::trainer;

namespace {

tr::MixerConfig config(json mamba, int chunk = 4) {
  tr::MixerConfig c;
  c.kind = "mamba2";
  c.d_model = 6;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.head_dim = 3;
  c.value_dim = 3;
  c.init_std = 0.3;
  c.routing = "none";
  c.n_layers = 1;
  c.linear_index = 0;
  c.model = json{{"architecture", "mamba2"}, {"conv_size", 3}, {"chunk_size", chunk}, {"routing", "none"},
                 {"mamba", mamba}};
  return c;
}

}  // namespace

TEST(Mamba2Layer, Registered) { EXPECT_TRUE(tr::mixer_registered("mamba2")); }

TEST(Mamba2Layer, FiniteDifferenceGradientsFp64) {
  // expand 2 → Di 12, head_dim 3 → 4 heads; 2 groups share B, C between two heads each
  lar::test::check_gradients(config(json{{"expand", 2}, {"head_dim", 3}, {"state_size", 4}, {"n_groups", 2}}), "mamba2 G=2");
  lar::test::check_gradients(config(json{{"expand", 1}, {"head_dim", 2}, {"state_size", 5}, {"n_groups", 1}}, 3),
                             "mamba2 G=1 chunk 3");
}

TEST(Mamba2Layer, DecodeStepByStepEqualsChunkForward) {
  lar::test::check_decode(config(json{{"expand", 2}, {"head_dim", 4}, {"state_size", 6}, {"n_groups", 1}}), "mamba2");
  lar::test::check_decode(config(json{{"expand", 2}, {"head_dim", 3}, {"state_size", 4}, {"n_groups", 2}}, 5),
                          "mamba2 G=2 chunk 5");
}

TEST(Mamba2Layer, ShapeErrorsNameTheOption) {
  auto msg = [](json mamba) {
    try {
      (void)tr::make_mixer(config(mamba));
    } catch (const lar::UserError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(msg(json{{"head_dim", 5}}).find("model.mamba.head_dim: 5 does not divide"), std::string::npos);
  EXPECT_NE(msg(json{{"head_dim", 3}, {"n_groups", 3}}).find("model.mamba.n_groups"), std::string::npos);
  auto c = config(json{{"head_dim", 3}});
  c.routing = "cler";
  EXPECT_THROW((void)tr::make_mixer(c), lar::UserError);
}

TEST(Mamba2Layer, PaperDefaults) {
  auto c = config(json::object());
  c.d_model = 128;
  auto m = tr::make_mixer(c);
  for (const auto& s : m->params()) {
    if (s.name == "w_B") {
      EXPECT_EQ(s.shape, (std::vector<int64_t>{128, 128}));  // one group, state 128
    }
    if (s.name == "A_log") {
      EXPECT_EQ(s.shape, (std::vector<int64_t>{4}));  // 2·128 / 64 heads
    }
  }
}

// trainer::cuda_unsupported for a Mamba-2 model: "" where the CUDA layer runs it (state 64, 128
// or 256 — the gla channel kernels' key dims —, head dim a multiple of 64 up to 512, conv ≤ 8),
// else the reason naming the key and value; builds without CUDA refuse the kind.
TEST(Mamba2Layer, CudaCoverageNamesTheOption) {
  auto model = [](json mamba, int conv = 4, std::string stack = "pure") {
    json raw = {{"model",
                 {{"architecture", "mamba2"}, {"stack", stack}, {"n_layers", 3}, {"hybrid_ratio", 1}, {"d_model", 128},
                  {"n_heads", 2}, {"conv_size", conv}, {"mamba", mamba}}},
                {"data", {{"task", "mqar"}, {"seq_len", 64}, {"batch_size", 2}}}};
    return tr::prepare_config(raw).at("model");
  };
  if (!tr::mixer_runs_on_cuda("mamba2")) {
    EXPECT_EQ(tr::cuda_unsupported(model(json::object())), "the 'mamba2' mixer has no CUDA implementation in this build");
    GTEST_SKIP() << "a build without CUDA";
  }
  EXPECT_EQ(tr::cuda_unsupported(model(json::object())), "");  // the papers' shape: head dim 64, state 128
  EXPECT_EQ(tr::cuda_unsupported(model(json{{"state_size", 128}, {"n_groups", 2}})), "");
  EXPECT_EQ(tr::cuda_unsupported(model(json{{"state_size", 64}})),
            "model.mamba.state_size: 64 has no CUDA path yet (its A_log, dt_bias and D gradients are not within "
            "the GPU tests' bounds); the CUDA Mamba-2 layer takes 128 (the papers') or 256");
  EXPECT_EQ(tr::cuda_unsupported(model(json{{"state_size", 256}, {"head_dim", 128}})), "");
  EXPECT_EQ(tr::cuda_unsupported(model(json::object(), 4, "hybrid")), "");  // beside softmax layers
  EXPECT_EQ(tr::cuda_unsupported(model(json{{"state_size", 32}})),
            "model.mamba.state_size: the CUDA Mamba-2 layer takes 128 or 256, got 32");
  EXPECT_EQ(tr::cuda_unsupported(model(json{{"head_dim", 32}})),
            "model.mamba.head_dim: the CUDA Mamba-2 layer needs a multiple of 64 up to 512, got 32");
  EXPECT_EQ(tr::cuda_unsupported(model(json::object(), 9)), "model.conv_size: the CUDA Mamba-2 layer takes 4 (Mamba-2's), got 9 (at 3 its token-sum gradients measured "
            "outside the GPU tests' bounds)");
  // mamba3's CUDA layer is refused while unverified (test_mamba3_layer.cpp checks its shapes)
  json m3 = model(json::object());
  m3["architecture"] = "mamba3";
  EXPECT_EQ(tr::cuda_unsupported(m3), lar::trainer::mixers::mamba3_cuda_gate());
}
