// `lar-bench step-passes` — device µs of the model-level memory-bound passes of the CUDA
// trainer at the 344M step's shapes (N = 32768 tokens, d = 1024, V = 32000, 344M parameters),
// with copy / write / read references for their byte floors (AdamW, norms, embedding,
// cross-entropy; host clock around `reps` calls between two synchronising downloads).
// --gemms adds every cuBLASLt candidate's µs (cuda.gemm tune, LAR_GEMM_LOG=1, on stderr) for the
// linear layer's fused projection GEMMs. Only in CUDA builds.
#ifdef LAR_HAVE_CUDA
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "dev/bench/bench.hpp"
#include "kernels/backend.hpp"

namespace {

using lar::kernels::Arena;
using lar::kernels::Backend;
using lar::kernels::DType;
using lar::kernels::Tensor;
using lar::kernels::make_backend;

struct Options {
  bool gemms = false;
};

Tensor random_ids(Backend& be, Arena& ga, int64_t n, int vocab, std::mt19937_64& rng) {
  Tensor t = ga.alloc(DType::i32, {n});
  std::vector<int32_t> h(static_cast<size_t>(n));
  std::uniform_int_distribution<int> ud(0, vocab - 1);
  for (auto& x : h) x = ud(rng);
  be.upload(h.data(), t);
  return t;
}

int bench_step_passes(const Options& o) {
  Backend::Options bo;
  bo.precision = "mixed";
  auto owned = make_backend("cuda", 1, DType::f32, bo);
  Backend& be = *owned;
  Arena ga(be);
  std::mt19937_64 rng{std::random_device{}()};
  const int64_t N = 32768, d = 1024, V = 32000, P = 344400000, R = 8192;
  Tensor one = ga.alloc(DType::f32, {1});
  float probe = 0;
  auto sync = [&] { be.download(one, &probe); };
  auto time_us = [&](const std::string& what, double gbytes, int reps, const std::function<void()>& f) {
    f();
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) f();
    sync();
    const double us = 1e6 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
    std::printf("%-46s %9.1f us %7.3f GB %5.2f TB/s\n", what.c_str(), us, gbytes, gbytes / us * 1e3);
  };
  auto filled = [&](DType t, std::vector<int64_t> shape, float v) {
    Tensor f = ga.alloc(DType::f32, shape);
    be.fill(f, v);
    if (t == DType::f32) return f;
    Tensor b = ga.alloc(t, shape);
    be.convert(f, b);
    return b;
  };
  const double nd4 = N * d * 4e-9, nd2 = N * d * 2e-9;
  {  // references: write, read, copy (1.38 GB: the gradients)
    Tensor g = filled(DType::f32, {P}, 0.01f), g2 = ga.alloc(DType::f32, {P});
    time_us("zero (memset) 344M f32", P * 4e-9, 5, [&] { be.zero(g2); });
    time_us("sum_squares 344M f32 (read)", P * 4e-9, 5, [&] { be.sum_squares(g); });
    time_us("copy (memcpy) 344M f32", P * 8e-9, 5, [&] { be.copy(g, g2); });
    time_us("scale (clip) 344M f32", P * 8e-9, 5, [&] { be.scale(g2, 1.0); });
  }
  {  // AdamW over 344M parameters with the bf16 mirror (30 bytes a parameter)
    Tensor w = filled(DType::f32, {P}, 0.02f), g = filled(DType::f32, {P}, 0.01f);
    Tensor m = filled(DType::f32, {P}, 0.001f), v = filled(DType::f32, {P}, 1e-4f);
    be.register_weights(w);
    Backend::AdamWSegment seg;
    seg.n = P;
    seg.step.step_size = 1e-9f;
    time_us("adamw_step 344M (grid-stride loop, + mirror)", P * 30e-9, 5, [&] { be.adamw_step(w, g, m, v, seg.step); });
    time_us("adamw_step_multi 344M (+ mirror)", P * 30e-9, 5, [&] { be.adamw_step_multi(w, g, m, v, {seg}); });
    seg.step.grad_scale = 0.5f;
    time_us("adamw_step_multi 344M, grad_scale 0.5", P * 30e-9, 5, [&] { be.adamw_step_multi(w, g, m, v, {seg}); });
  }
  {  // norms at N × d
    Tensor x = filled(DType::f32, {N, d}, 0.5f), h = filled(DType::f32, {N, d}, 0.5f), w = filled(DType::f32, {d}, 1.f);
    Tensor r = filled(DType::bf16, {N, d}, 0.25f), dy = filled(DType::bf16, {N, d}, 0.1f);
    Tensor dx = filled(DType::f32, {N, d}, 0.f), dxa = filled(DType::bf16, {N, d}, 0.f);
    Tensor y = filled(DType::bf16, {N, d}, 0.f), rs = filled(DType::f32, {N}, 1.f), dw = filled(DType::f32, {d}, 0.f);
    time_us("add_rmsnorm_fwd (h in place, bf16 r, y)", 2 * nd4 + 2 * nd2, 20,
            [&] { be.add_rmsnorm_fwd(h, r, h, w, y, rs, 1e-5); });
    time_us("rmsnorm_bwd_convert", 3 * nd4 + 2 * nd2, 20, [&] { be.rmsnorm_bwd_convert(x, w, rs, dy, dx, dw, dxa); });
    time_us("add_rmsnorm_bwd_convert", 3 * nd4 + 3 * nd2, 20,
            [&] { be.add_rmsnorm_bwd_convert(x, r, w, rs, dy, dx, dw, dxa); });
  }
  {  // embedding forward (gather) and backward (sorted accumulate) of N tokens
    Tensor table = filled(DType::f32, {V, d}, 0.01f), out = filled(DType::f32, {N, d}, 0.f);
    Tensor dtable = filled(DType::f32, {V, d}, 0.f);
    const Tensor ids = random_ids(be, ga, N, static_cast<int>(V), rng);
    time_us("embedding_fwd 32768 x 1024", 2 * nd4, 10, [&] { be.embedding_fwd(ids, table, out); });
    time_us("embedding_bwd 32768 x 1024", 3 * nd4, 10, [&] { be.embedding_bwd(ids, out, dtable); });
  }
  if (o.gemms) {
    // cuda.gemm: tune, LAR_GEMM_LOG=1: every cuBLASLt candidate's µs (stderr) for the linear
    // layer's fused [P | og] GEMMs (N = 3072 + 32 + 1024 = 4128) and the q·k·v projection
    // beside them. Operands are constant here: absolute times run below the step's (clocks).
    Backend::Options tune = bo;
    tune.cuda.gemm = "tune";
    setenv("LAR_GEMM_LOG", "1", 1);
    be.set_options(tune);
    struct Shape {
      int64_t M, N, K;
      bool ta, tb, bf16_c;
    };
    for (const Shape& g : {Shape{N, 4128, 1024, false, true, true}, Shape{N, 3072, 1024, false, true, true},
                           Shape{N, 1024, 4128, false, false, true}, Shape{4128, 1024, N, true, false, false}}) {
      Tensor A = filled(DType::bf16, g.ta ? std::vector<int64_t>{g.K, g.M} : std::vector<int64_t>{g.M, g.K}, 0.01f);
      Tensor B = filled(DType::bf16, g.tb ? std::vector<int64_t>{g.N, g.K} : std::vector<int64_t>{g.K, g.N}, 0.01f);
      Tensor C = filled(g.bf16_c ? DType::bf16 : DType::f32, {g.M, g.N}, 0.f);
      be.gemm(A, g.ta, B, g.tb, C);
      sync();
    }
    unsetenv("LAR_GEMM_LOG");
    be.set_options(bo);
  }
  {  // cross-entropy on one chunk of 8192 bf16 logit rows, dlogits in place
    Tensor lg = filled(DType::bf16, {R, V}, 0.3f), mk = filled(DType::f32, {R}, 1.f), ls = filled(DType::f32, {R}, 0.f);
    const Tensor tg = random_ids(be, ga, R, static_cast<int>(V), rng);
    time_us("cross_entropy_fwd_bwd 8192x32000 bf16", R * V * 4e-9, 10,
            [&] { be.cross_entropy_fwd_bwd(lg, tg, mk, ls, 1.0 / N, lg); });
  }
  return 0;
}

}  // namespace

static lar::bench::Registration step_passes_reg{
    "step-passes", "CUDA: device µs of the training step's memory-bound passes at the 344M shapes, with byte floors",
    [](CLI::App& app) -> lar::bench::Runner {
      auto o = std::make_shared<Options>();
      app.add_flag("--gemms", o->gemms, "Also log every cuBLASLt candidate for the linear layer's projection GEMMs");
      return [o] { return bench_step_passes(*o); };
    }};
#endif  // LAR_HAVE_CUDA
