// The Mamba-3 SISO layer (trainer/mixers/mamba3_mixer.cpp): gradients by finite differences
// in fp64 (the chunkwise form on the shared core), decode by Mamba-3's own rotary,
// trapezoidal recurrence (kernels/cpu/ssm/mamba3.hpp) equal to the chunkwise forward, and
// the options' errors.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "mixer_checks.hpp"

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

TEST(Mamba3Layer, OptionErrors) {
  auto msg = [](json m3) {
    try {
      (void)tr::make_mixer(config(json{{"head_dim", 3}, {"state_size", 4}}, m3));
    } catch (const lar::UserError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(msg(json{{"form", "mimo"}}).find("model.mamba3.form: 'mimo' is not implemented"), std::string::npos);
  EXPECT_NE(msg(json{{"rope_fraction", 0.3}}).find("model.mamba3.rope_fraction"), std::string::npos);
  EXPECT_EQ(msg(json{{"form", "siso"}}), "");
}
