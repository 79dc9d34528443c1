// The Mamba-2 layer (trainer/mixers/mamba2_mixer.cpp): gradients by finite differences in
// fp64, decode (the recurrent form) equal to the chunkwise forward, the shape options and
// their errors.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "mixer_checks.hpp"

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
