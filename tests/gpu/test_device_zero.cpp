// DeviceZeroOptimizer (trainer/optim/device_zero.hpp) on the CUDA backend: 2 and 3 ranks as
// threads on one GPU, each its own CUDA backend, the collectives staged through the host
// fake group (tests/dist/device_zero_check.hpp: sums in rank order), against the unsharded
// DeviceOptimizer with the blocked norm on another CUDA backend given the same summed
// gradients — the same norms, AdamW's parameters and state bit for bit, Muon's and NorMuon's to
// the rounding of cuBLAS's batched GEMM (Match::rounding, Match::bf16 in mixed precision:
// device_zero_check.hpp) — and a
// checkpoint resumed on another world size; plus the CUDA block_sum_squares against the host
// block sums. The same checks run on CPU backends in tests/dist/test_device_zero_cpu.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "tests/dist/device_zero_check.hpp"

namespace lar::testing::device_zero {
namespace {

using kernels::DType;
using kernels::Tensor;
using optim::OptimizerName;

// Deterministic CUDA backends (fp32 or mixed precision); null without a usable GPU.
BackendFactory cuda(const std::string& precision) {
  return [precision]() -> std::unique_ptr<kernels::Backend> {
    kernels::Backend::Options o;
    o.deterministic = true;
    o.precision = precision;
    return kernels::make_backend("cuda", 1, DType::f32, o);
  };
}

bool have_gpu() { return kernels::backend_usable("cuda"); }

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no usable CUDA device"

TEST(DeviceZeroGpu, BlockSumSquaresMatchesHostBlocks) {
  REQUIRE_GPU();
  auto be = cuda("fp32")();
  std::mt19937 gen(9);
  std::normal_distribution<float> d(0.0f, 0.7f);
  const std::size_t n = 3 * optim::kNormBlock + 777;
  std::vector<float> x(n);
  for (float& v : x) v = d(gen);
  Buffer X(*be, n);
  be->upload(x.data(), X.t);
  void* o = be->alloc_bytes(16 * sizeof(double));
  const Tensor O(o, DType::f64, {16});
  std::vector<double> init(16, -1.0), out(16);
  be->upload(init.data(), O);
  const int64_t B = static_cast<int64_t>(optim::kNormBlock);
  // The whole buffer from out[2] (4 blocks, the last short), a short range to out[0], none to out[15].
  be->block_sum_squares(X.t, {{0, static_cast<int64_t>(n), 2}, {5, 1000, 0}, {0, 0, 15}}, B, O);
  be->download(O, out.data());
  be->free_bytes(o);
  for (int k = 0; k < 4; ++k) {
    const std::size_t lo = static_cast<std::size_t>(k) * optim::kNormBlock;
    const double h = optim::block_sum_squares(x.data() + lo, std::min(optim::kNormBlock, n - lo));
    // Another order of the same double additions: rounding only.
    EXPECT_NEAR(out[static_cast<std::size_t>(2 + k)], h, 1e-12 * h) << k;
  }
  EXPECT_NEAR(out[0], optim::block_sum_squares(x.data() + 5, 1000), 1e-12 * out[0]);
  for (int i : {1, 6, 15}) EXPECT_EQ(out[static_cast<std::size_t>(i)], -1.0) << i;
}

TEST(DeviceZeroGpu, AdamWMatchesUnsharded) {
  REQUIRE_GPU();
  check_matches_unsharded(cuda("fp32"), OptimizerName::adamw);
}
TEST(DeviceZeroGpu, MuonMatchesUnsharded) {
  REQUIRE_GPU();
  check_matches_unsharded(cuda("fp32"), OptimizerName::muon, Match::rounding);
}
TEST(DeviceZeroGpu, NorMuonMatchesUnsharded) {
  REQUIRE_GPU();
  check_matches_unsharded(cuda("fp32"), OptimizerName::normuon, Match::rounding);
}
// bf16 Newton–Schulz GEMMs (the mixed-precision runs): to bf16 rounding.
TEST(DeviceZeroGpu, NorMuonMixedPrecisionMatchesUnsharded) {
  REQUIRE_GPU();
  check_matches_unsharded(cuda("mixed"), OptimizerName::normuon, Match::bf16);
}
TEST(DeviceZeroGpu, AdamWResumesOnAnotherWorldSize) {
  REQUIRE_GPU();
  check_resume_on_other_world(cuda("fp32"), OptimizerName::adamw);
}
TEST(DeviceZeroGpu, NorMuonResumesOnAnotherWorldSize) {
  REQUIRE_GPU();
  check_resume_on_other_world(cuda("fp32"), OptimizerName::normuon, Match::rounding);
}

// The blocked norm on the GPU is the host's to rounding (the blocks' sums run in another
// order), and a checkpoint written by the sharded GPU optimiser loads into the host one.
TEST(DeviceZeroGpu, BlockedNormAndStateAgreeWithTheHost) {
  REQUIRE_GPU();
  std::size_t total = 0;
  const auto t = table(&total);
  const optim::OptimizerConfig cfg = config(OptimizerName::normuon);
  const std::vector<float> p0 = initial_params(total);
  auto be = cuda("fp32")();
  const RunResult dev = unsharded(*be, cfg, {2, 2}, 0, 2, p0, "");
  optim::Optimizer host(cfg, t, total);
  for (int s = 0; s < 2; ++s) {
    std::vector<float> g = summed(total, s, 2);
    const double h = host.clip_gradients(g.data());
    EXPECT_NEAR(dev.norms[static_cast<std::size_t>(s)], h, 1e-12 * h) << s;
  }
  const std::vector<RunResult> z = sharded(cuda("fp32"), cfg, 2, 0, 2, p0, "");
  optim::Optimizer loaded(cfg, t, total);
  loaded.load_state(z[0].state);
  EXPECT_TRUE(loaded.save_state() == z[0].state);
  EXPECT_EQ(loaded.steps_taken(), 2);
}

}  // namespace
}  // namespace lar::testing::device_zero
