// `lar-bench delta-paths` — gdn fwd and bwd times of the delta rule's two paths (fused,
// two-phase "chunked") and of the automatic choice at B = 1, 2, 4, 8 with T = 32768 / B, H = 16
// (CUDA events, median of --reps after --warmup): the data the cost model of `use_two_phase`
// (kernels/delta_rule/delta_rule.cu) is fitted on. The verdict says whether the automatic
// choice is within 10% of the faster path at every shape; the exit code is 1 when it is not.
// Only in CUDA builds (LAR_HAVE_CUDA comes from kernels/cuda/CMakeLists.txt).
#ifdef LAR_HAVE_CUDA
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <random>
#include <vector>

#include "core/error.hpp"
#include "dev/bench/bench.hpp"
#include "dev/bench/cuda_timing.hpp"
#include "kernels/delta_rule/delta_rule.hpp"

namespace {

namespace gl = lar::kernels::cuda::linear;
using lar::bench::bf16;
using lar::bench::DeviceBuffer;

struct Options {
  int reps = 7, warmup = 2;
};

int bench_delta_paths(const Options& o) {
  const int H = 16, D = 64, total = 32768;
  const size_t nx = static_cast<size_t>(total) * H * D, nr = static_cast<size_t>(total) * H;
  uint64_t state = 0x9e3779b97f4a7c15ull ^ std::random_device{}();
  auto uni = [&] {  // uniform in [-1, 1): cheap enough for 33M values
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<double>(state >> 11) * 0x1.0p-52 - 1.0);
  };
  std::vector<float> x(nx), r(nr);
  DeviceBuffer<bf16> q(nx), k(nx), v(nx), out(nx), dO(nx), dq(nx), dk(nx), dv(nx);
  DeviceBuffer<float> g(nr), beta(nr), dg(nr), dbeta(nr);
  for (auto& y : x) y = 0.2f * uni();  // rows of norm ≈ 0.9, like the layer's L2-normalised q, k
  q.put(x);
  for (auto& y : x) y = 0.2f * uni();
  k.put(x);
  for (auto& y : x) y = uni();
  v.put(x);
  for (auto& y : x) y = uni();
  dO.put(x);
  for (auto& y : r) y = 0.5f + 0.4f * uni();
  beta.put(r);
  for (auto& y : r) y = -0.05f * (1.0f + uni());
  g.put(r);
  std::cout << fmt::format("delta-paths: gdn H=16, T = 32768 / B, median of {} after {} warm-up, ms\n", o.reps,
                           o.warmup);
  std::cout << "shape              fwd: fused  chunked  auto | bwd: fused  chunked  auto\n";
  bool ok = true;
  for (const int B : {1, 2, 4, 8}) {
    gl::DeltaShape s;
    s.B = B, s.T = total / B, s.H = H, s.scale = 0.125;
    DeviceBuffer<bf16> bound(gl::delta_boundary_bytes(s) / sizeof(bf16));
    double t[2][3];
    const gl::PathChoice paths[] = {gl::PathChoice::fused, gl::PathChoice::chunked, gl::PathChoice::automatic};
    for (int pi = 0; pi < 3; ++pi) {
      s.kernels.path = paths[pi];
      t[0][pi] = lar::bench::median_event_ms(
          [&] { gl::delta_fwd(s, q.p, k.p, v.p, g.p, beta.p, nullptr, out.p, nullptr, bound.p, nullptr); }, o.reps,
          o.warmup);
      t[1][pi] = lar::bench::median_event_ms(
          [&] {
            gl::delta_bwd(s, q.p, k.p, v.p, g.p, beta.p, bound.p, dO.p, nullptr, dq.p, dk.p, dv.p, dg.p, dbeta.p,
                          nullptr, nullptr);
          },
          o.reps, o.warmup);
      LAR_CUDA_CHECK(cudaDeviceSynchronize());
    }
    std::cout << fmt::format("B={} T={:<6}        {:7.3f} {:8.3f} {:6.3f} | {:9.3f} {:8.3f} {:6.3f}\n", B, total / B,
                             t[0][0], t[0][1], t[0][2], t[1][0], t[1][1], t[1][2]);
    for (int pass = 0; pass < 2; ++pass)
      if (t[pass][2] >= 1.1 * std::min(t[pass][0], t[pass][1])) {
        std::cout << fmt::format("  auto {} at B={} is more than 10% slower than the faster path\n",
                                 pass ? "bwd" : "fwd", B);
        ok = false;
      }
  }
  std::cout << (ok ? "goal met: the automatic choice is within 10% of the faster path at every shape\n"
                   : "GOAL MISSED: refit use_two_phase's cost model on these numbers\n");
  return ok ? 0 : 1;
}

}  // namespace

static lar::bench::Registration delta_paths_reg{
    "delta-paths", "CUDA: gdn fwd/bwd of the fused and two-phase delta-rule paths and the automatic choice, B=1..8",
    [](CLI::App& app) -> lar::bench::Runner {
      auto o = std::make_shared<Options>();
      app.add_option("--reps", o->reps, "Timed repetitions (median reported)")->check(CLI::Range(1, 100000));
      app.add_option("--warmup", o->warmup, "Untimed warm-up calls")->check(CLI::Range(0, 100000));
      return [o] { return bench_delta_paths(*o); };
    }};
#endif  // LAR_HAVE_CUDA
