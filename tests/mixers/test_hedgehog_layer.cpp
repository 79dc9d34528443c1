// The GLA-Hedgehog layer (trainer/mixers/hedgehog_mixer.cpp): gradients by finite
// differences in fp64, decode (recurrent) equal to the chunkwise forward, and the feature map
// itself (two softmaxes, the identity at init).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/linear/hedgehog_map.hpp"
#include "mixer_checks.hpp"

using lar::json;
namespace tr = lar::trainer;

namespace {

tr::MixerConfig config(bool conv, int chunk = 4) {
  tr::MixerConfig c;
  c.kind = "gla_hedgehog";
  c.d_model = 8;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.head_dim = 3;
  c.value_dim = 4;
  c.init_std = 0.3;
  c.routing = "none";
  c.n_layers = 1;
  c.linear_index = 0;
  c.model = json{{"architecture", "gla_hedgehog"}, {"short_conv", conv}, {"conv_size", 3},
                 {"chunk_size", chunk},            {"gate_rank", 3},     {"routing", "none"}};
  return c;
}

}  // namespace

TEST(HedgehogLayer, FeatureMapIsTwoSoftmaxes) {
  const std::vector<double> a{0.5, -1.0, 2.0}, zero(9, 0.0), b(3, 0.0);
  std::vector<double> phi(6);
  lar::kernels::cpu::linear::hedgehog_forward(a.data(), zero.data(), b.data(), 3, phi.data());
  double s1 = 0, s2 = 0;
  for (int i = 0; i < 3; ++i) {
    s1 += phi[i];
    s2 += phi[3 + i];
  }
  EXPECT_NEAR(s1, 1.0, 1e-15);
  EXPECT_NEAR(s2, 1.0, 1e-15);
  // identity map: softmax(a) and softmax(−a)
  const double z = std::exp(0.5) + std::exp(-1.0) + std::exp(2.0);
  EXPECT_NEAR(phi[2], std::exp(2.0) / z, 1e-15);
  const double zm = std::exp(-0.5) + std::exp(1.0) + std::exp(-2.0);
  EXPECT_NEAR(phi[4], std::exp(1.0) / zm, 1e-15);
}

TEST(HedgehogLayer, FiniteDifferenceGradientsFp64) {
  lar::test::check_gradients(config(true), "gla_hedgehog conv");
  lar::test::check_gradients(config(false, 3), "gla_hedgehog no conv, chunk 3");
}

TEST(HedgehogLayer, DecodeStepByStepEqualsChunkForward) {
  lar::test::check_decode(config(true), "gla_hedgehog");
  lar::test::check_decode(config(false, 5), "gla_hedgehog no conv");
}

TEST(HedgehogLayer, RoutingIsRefused) {
  auto c = config(true);
  c.routing = "clvr";
  EXPECT_THROW((void)tr::make_mixer(c), lar::UserError);
}
