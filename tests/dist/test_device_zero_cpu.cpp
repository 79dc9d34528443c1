// DeviceZeroOptimizer (trainer/optim/device_zero.hpp) on CPU backends: the checks of
// tests/dist/device_zero_check.hpp (which tests/gpu/test_device_zero.cpp runs on CUDA), the
// blocked norm against the host Optimizer's, and Backend::block_sum_squares's default.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/error.hpp"
#include "tests/dist/device_zero_check.hpp"

extern "C" void openblas_set_num_threads(int);

namespace lar::testing::device_zero {
namespace {

using kernels::DType;
using kernels::Tensor;
using optim::OptimizerName;

// The ranks are threads: one BLAS thread each (Newton–Schulz), not a pool per rank.
const bool kOneBlasThread = [] {
  openblas_set_num_threads(1);
  return true;
}();

std::unique_ptr<kernels::Backend> cpu() { return kernels::make_backend("cpu", 1, DType::f32); }

TEST(DeviceZeroCpu, AdamWMatchesUnsharded) { check_matches_unsharded(cpu, OptimizerName::adamw); }
TEST(DeviceZeroCpu, MuonMatchesUnsharded) { check_matches_unsharded(cpu, OptimizerName::muon); }
TEST(DeviceZeroCpu, NorMuonMatchesUnsharded) { check_matches_unsharded(cpu, OptimizerName::normuon); }
TEST(DeviceZeroCpu, AdamWResumesOnAnotherWorldSize) { check_resume_on_other_world(cpu, OptimizerName::adamw); }
TEST(DeviceZeroCpu, NorMuonResumesOnAnotherWorldSize) { check_resume_on_other_world(cpu, OptimizerName::normuon); }

// On a CPU backend the blocked norm is the host Optimizer's bit for bit, and so (AdamW being
// elementwise) are the parameters after clipped steps; the state blob is the host's bytes.
TEST(DeviceZeroCpu, BlockedNormIsTheHostOptimizersOnTheCpuBackend) {
  std::size_t total = 0;
  const auto t = table(&total);
  const optim::OptimizerConfig cfg = config(OptimizerName::adamw);
  std::vector<float> host_p = initial_params(total);
  optim::Optimizer host(cfg, t, total);
  auto be = cpu();
  const RunResult dev = unsharded(*be, cfg, {1, 1, 1}, 0, 3, host_p, "");
  for (int s = 0; s < 3; ++s) {
    std::vector<float> g = summed(total, s, 1);
    EXPECT_EQ(host.clip_gradients(g.data()), dev.norms[static_cast<std::size_t>(s)]) << s;
    host.step(host_p.data(), g.data(), lr_at(s), scalar_at(s));
  }
  EXPECT_EQ(first_difference(host_p, dev.params), total);
  EXPECT_TRUE(host.save_state() == dev.state);
  EXPECT_GT(dev.norms[0], 1.0);  // the first step clipped
}

// The layout both ZeRO optimisers use: every rank's state segments tile the unsharded m_
// and v_ once (what save_state's all-gathers rely on), the ranks' shard tables cover every
// parameter element once, and each rank's state map lands inside its own segments.
TEST(DeviceZeroCpu, LayoutTilesTheUnshardedStateAndTheParameters) {
  std::size_t total = 0;
  const auto t = table(&total);
  for (OptimizerName name : {OptimizerName::adamw, OptimizerName::muon, OptimizerName::normuon})
    for (int world : {1, 2, 3, 5}) {
      SCOPED_TRACE(std::string(name_of(name)) + " world " + std::to_string(world));
      const optim::OptimizerConfig cfg = config(name);
      const optim::Optimizer full(cfg, t, total);
      std::vector<int> param_owner(total, -1);
      for (int rank = 0; rank < world; ++rank) {
        const optim::ZeroLayout lay = optim::zero_layout(cfg, t, world, rank);
        ASSERT_EQ(lay.m_len + lay.v_len, full.state_floats());
        for (const auto* segs : {&lay.m_segs, &lay.v_segs}) {
          std::size_t next = 0;
          for (const optim::Segment& s : *segs) {
            EXPECT_EQ(s.offset, next);  // in order, no gap, no overlap
            next = s.offset + s.count;
          }
          EXPECT_EQ(next, segs == &lay.m_segs ? lay.m_len : lay.v_len);
        }
        for (const optim::ParamView& v : lay.shard_views)
          for (std::size_t i = 0; i < v.size(); ++i) {
            EXPECT_EQ(param_owner[v.offset + i], -1) << v.name;
            param_owner[v.offset + i] = rank;
          }
        const optim::Optimizer shard(cfg, lay.shard_views, total);
        for (const optim::ZeroLayout::StateMap& m : lay.state_map(shard)) {
          bool inside = false;
          for (const optim::Segment& s : m.v ? lay.v_segs : lay.m_segs)
            inside = inside || (s.owner == rank && m.full_off >= s.offset && m.full_off + m.count <= s.offset + s.count);
          EXPECT_TRUE(inside) << (m.v ? "v " : "m ") << m.full_off;
        }
      }
      for (const optim::ParamView& p : t)
        for (std::size_t i = 0; i < p.size(); ++i) ASSERT_NE(param_owner[p.offset + i], -1) << p.name << " " << i;
    }
}

TEST(DeviceZeroCpu, BlockSumSquaresWritesEachRangesBlocksWhereAsked) {
  auto be = cpu();
  std::mt19937 gen(5);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(1000);
  for (float& v : x) v = d(gen);
  const Tensor X(x.data(), DType::f32, {1000});
  std::vector<double> out(10, -1.0);
  const Tensor O(out.data(), DType::f64, {10});
  // [10, 260) in blocks of 100 → out[5..7]; [600, 650) → out[1]; an empty range writes nothing.
  be->block_sum_squares(X, {{10, 250, 5}, {600, 50, 1}, {0, 0, 9}}, 100, O);
  EXPECT_EQ(out[5], optim::block_sum_squares(x.data() + 10, 100));
  EXPECT_EQ(out[6], optim::block_sum_squares(x.data() + 110, 100));
  EXPECT_EQ(out[7], optim::block_sum_squares(x.data() + 210, 50));
  EXPECT_EQ(out[1], optim::block_sum_squares(x.data() + 600, 50));
  for (int i : {0, 2, 3, 4, 8, 9}) EXPECT_EQ(out[static_cast<std::size_t>(i)], -1.0) << i;
  EXPECT_THROW(be->block_sum_squares(X, {{990, 20, 0}}, 100, O), RuntimeError);
  EXPECT_THROW(be->block_sum_squares(X, {{0, 300, 8}}, 100, O), RuntimeError);
}

}  // namespace
}  // namespace lar::testing::device_zero
