// The families' supports.hpp: which head shapes each family's CUDA kernels take, as the trainer
// reads them before it builds a layer (CUDA-free, so this runs on any machine).
#include <gtest/gtest.h>

#include "kernels/attention/supports.hpp"
#include "kernels/carve/supports.hpp"
#include "kernels/ccq/supports.hpp"
#include "kernels/channel_rule/supports.hpp"
#include "kernels/delta_rule/supports.hpp"
#include "kernels/hedgehog/supports.hpp"
#include "kernels/ssm/supports.hpp"

namespace kc = lar::kernels::cuda::linear;
namespace ka = lar::kernels::cuda::attention;

TEST(KernelSupports, DeltaAndChannelRulesTakeKeyHeadsOf64To256AndValueHeadsOf64m) {
  for (auto supports : {kc::delta_rule_supports, kc::channel_rule_supports}) {
    EXPECT_TRUE(supports({64, 64}));
    EXPECT_TRUE(supports({128, 64}));
    EXPECT_TRUE(supports({256, 512}));
    EXPECT_TRUE(supports({64, 192}));
    EXPECT_FALSE(supports({32, 64}));
    EXPECT_FALSE(supports({96, 64}));
    EXPECT_FALSE(supports({192, 64}));  // gla's key-block split only, behind its gate
    EXPECT_FALSE(supports({512, 64}));
    EXPECT_FALSE(supports({64, 32}));
    EXPECT_FALSE(supports({64, 96}));
    EXPECT_FALSE(supports({64, 576}));
    EXPECT_FALSE(supports({64, 0}));
  }
}

TEST(KernelSupports, CarveTakesHeadsOf64And128AndDecodesHeadsOf64) {
  EXPECT_TRUE(kc::carve_supports({64, 64}));
  EXPECT_TRUE(kc::carve_supports({128, 64}));
  EXPECT_TRUE(kc::carve_supports({64, 128}));
  EXPECT_TRUE(kc::carve_supports({128, 128}));
  EXPECT_FALSE(kc::carve_supports({256, 64}));
  EXPECT_FALSE(kc::carve_supports({64, 192}));
  EXPECT_TRUE(kc::carve_decode_supports({64, 64}));
  EXPECT_FALSE(kc::carve_decode_supports({128, 64}));
  EXPECT_FALSE(kc::carve_decode_supports({64, 128}));
  EXPECT_EQ(kc::kCarveContentChunk, 64);
}

TEST(KernelSupports, CcqAttentionAndHedgehogHeads) {
  EXPECT_TRUE(kc::ccq_supports(64));
  EXPECT_TRUE(kc::ccq_supports(128));
  EXPECT_TRUE(kc::ccq_supports(256));
  EXPECT_FALSE(kc::ccq_supports(192));
  EXPECT_TRUE(ka::flash_attention_supports(64));
  EXPECT_TRUE(ka::flash_attention_supports(128));
  EXPECT_FALSE(ka::flash_attention_supports(96));
  EXPECT_FALSE(ka::flash_attention_supports(256));
  EXPECT_TRUE(kc::hedgehog_map_supports(1));
  EXPECT_TRUE(kc::hedgehog_map_supports(256));
  EXPECT_FALSE(kc::hedgehog_map_supports(0));
  EXPECT_FALSE(kc::hedgehog_map_supports(257));
}

TEST(KernelSupports, SsmStatesOf128And256HeadsOf64mRanksUpTo4) {
  EXPECT_TRUE(kc::ssm_state_supported(128));
  EXPECT_TRUE(kc::ssm_state_supported(256));
  EXPECT_FALSE(kc::ssm_state_supported(64));
  EXPECT_FALSE(kc::ssm_state_supported(192));
  EXPECT_TRUE(kc::ssm_head_supported(64));
  EXPECT_TRUE(kc::ssm_head_supported(512));
  EXPECT_FALSE(kc::ssm_head_supported(96));
  EXPECT_TRUE(kc::mamba3_rank_supported(1));
  EXPECT_TRUE(kc::mamba3_rank_supported(4));
  EXPECT_FALSE(kc::mamba3_rank_supported(0));
  EXPECT_FALSE(kc::mamba3_rank_supported(5));
}
