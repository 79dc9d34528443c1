// `lar-bench ccq-kernels` — CCQ's own kernels (ccq_fwd, ccq_bwd; kernels/ccq/ccq.cu)
// timed alone at the paper's layer shape (B=1 T=4096 H=32) and the 344M model's (B=8 T=4096
// H=16); CUDA events, median of --reps after --warmup. The whole layer with and without CCQ is
// `lar-bench linear-layer`. --group, --fwd and --bwd force the variants (A/B; cuda.ccq_* in a run).
// Only in CUDA builds (LAR_HAVE_CUDA comes from kernels/cuda/CMakeLists.txt).
#ifdef LAR_HAVE_CUDA
#include <fmt/format.h>

#include <cstdlib>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dev/bench/bench.hpp"
#include "dev/bench/cuda_timing.hpp"
#include "kernels/ccq/ccq_cuda.hpp"

namespace {

namespace gl = lar::kernels::cuda::linear;
using lar::bench::bf16;
using lar::bench::DeviceBuffer;

struct Options {
  int reps = 20, warmup = 5;
  int group = 0;                       // 0: per shape
  std::string fwd = "auto", bwd = "auto";  // auto | par | ws
};

int bench_ccq(const Options& o) {
  constexpr int D = 64, T = 4096;
  std::mt19937_64 rng{42};
  std::normal_distribution<double> nd(0.0, 1.0);
  const gl::KernelChoice kc = gl::kernel_choice("auto", o.fwd, o.bwd, o.group);
  std::cout << fmt::format("ccq-kernels: median of {} after {} warm-up; group {} fwd {} bwd {}\n", o.reps, o.warmup,
                           o.group ? std::to_string(o.group) : std::string("auto"), o.fwd, o.bwd);
  for (const auto& [B, H] : {std::pair<int, int>{1, 32}, std::pair<int, int>{8, 16}}) {
    const size_t rows = static_cast<size_t>(B) * T * H, nx = rows * D, ns = static_cast<size_t>(B) * H * D * D;
    std::vector<float> q(nx), lam(rows, 0.3f);
    for (auto& v : q) v = static_cast<float>(0.125 * nd(rng));
    DeviceBuffer<bf16> q_(nx), k_(nx), dqc_(nx), qc_(nx), dq_(nx), dk_(nx);
    DeviceBuffer<float> lam_(rows), K_(ns), m_(static_cast<size_t>(B) * H * D), dl_(rows);
    q_.put(q), k_.put(q), dqc_.put(q), dk_.put(q), lam_.put(lam);
    gl::DeltaShape s;
    s.B = B, s.T = T, s.H = H;
    s.kernels = kc;
    gl::CcqInputs in;
    in.q = q_.p, in.k = k_.p, in.lambda = lam_.p;
    const double f = lar::bench::median_event_ms([&] { gl::ccq_fwd(s, in, qc_.p, {K_.p, m_.p}, nullptr); }, o.reps,
                                                 o.warmup);
    const double b = lar::bench::median_event_ms(
        [&] { gl::ccq_bwd(s, in, {K_.p, m_.p}, dqc_.p, dq_.p, dk_.p, dl_.p, nullptr); }, o.reps, o.warmup);
    LAR_CUDA_CHECK(cudaDeviceSynchronize());
    std::cout << fmt::format("ccq B={} T={} H={}: fwd {:.4f} ms, bwd {:.4f} ms, fwd+bwd {:.4f} ms\n", B, T, H, f, b,
                             f + b);
  }
  return 0;
}

}  // namespace

static lar::bench::Registration ccq_reg{
    "ccq-kernels", "CUDA: CCQ's own kernels fwd/bwd at the paper's layer shape (B=1 T=4096 H=32) and the 344M model's",
    [](CLI::App& app) -> lar::bench::Runner {
      auto o = std::make_shared<Options>();
      app.add_option("--reps", o->reps, "Timed repetitions (median reported)")->check(CLI::Range(1, 100000));
      app.add_option("--warmup", o->warmup, "Untimed warm-up calls")->check(CLI::Range(0, 100000));
      app.add_option("--group", o->group, "Chunks per group of the chunk-parallel kernels (0: per shape)")
          ->check(CLI::Range(0, 64));
      app.add_option("--fwd", o->fwd, "Forward kernels: auto, par or ws")->check(CLI::IsMember({"auto", "par", "ws"}));
      app.add_option("--bwd", o->bwd, "Backward kernels: auto, par or ws")->check(CLI::IsMember({"auto", "par", "ws"}));
      return [o] { return bench_ccq(*o); };
    }};
#endif  // LAR_HAVE_CUDA
