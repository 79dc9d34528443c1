// `lar-bench linear-layer` — one whole linear-mixer layer of the trainer (trainer/mixers,
// cuda_layers/linear_layer_cuda.cpp) forward and forward+backward on the GPU, with and without CCQ: the
// measure of the goal "CCQ adds at most 20% to its backbone's layer time". It is the CCQ
// paper's own measure (its Table 5: one layer, batch 1, hidden 2048, T = 4K, fwd+bwd; GLA
// 2.28 → 3.50 ms = +53.5%, Gated DeltaNet 6.26 → 8.06 ms = +28.8%): the layer is everything
// between the block's norm and its residual add — the projections (GEMMs), the short convs,
// gates, the chunkwise kernel, CCQ's λ map and its kernels, the output norm × gate and W_o.
// Two shapes: the paper's (B=1, T=4096, d=2048; our heads are 64 wide, so 32 of them) and
// the 344M model's layer (B=8, T=4096, d=1024, 16 heads). CUDA-event timing, median of --reps.
// `--backend cpu` runs the same on the CPU backend (its own layer code; a check of the bench,
// not a number to compare).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <vector>

#include "dev/bench/bench.hpp"
#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "registry/text_table.hpp"
#include "trainer/mixer.hpp"
#include "trainer/model.hpp"
#include "trainer/params.hpp"
#include "trainer/rng.hpp"

namespace {

using lar::kernels::DType;
using lar::kernels::Tensor;

struct Options {
  int reps = 20, warmup = 3;
  bool quick = false;
  std::string arch = "gla,gdn";
  std::string backend = "cuda";
  std::string shape = "both";  // paper | model | both
};

struct Shape {
  int B, T, d, H;
  std::string label;
};

// One layer of `arch` (CCQ on or off) at `s`: params from the model's init rules, random x
// and dy; returns {fwd ms, fwd+bwd ms}.
std::pair<double, double> time_layer(lar::kernels::Backend& be, const std::string& arch, bool ccq, const Shape& s,
                                     const Options& o) {
  using namespace lar;
  json cfg = with_defaults({{"model", {{"n_layers", 1}, {"d_model", s.d}, {"n_heads", s.H}, {"architecture", arch},
                                       {"stack", "pure"}, {"ccq", {{"enabled", ccq}}}}},
                            {"data", {{"seq_len", s.T}, {"batch_size", s.B}}}});
  trainer::validate_model_config(cfg);
  if (const std::string why = o.backend == "cuda" ? trainer::cuda_unsupported(cfg.at("model")) : ""; !why.empty())
    throw UserError("bench linear-layer: " + why);
  auto mixer = trainer::make_mixer(trainer::mixer_config(cfg.at("model"), 0));
  trainer::ParamStore ps(be);
  std::vector<int> idx;
  for (const auto& spec : mixer->params()) idx.push_back(ps.add(spec, "mixer.", 0));
  ps.allocate();
  be.register_weights(ps.params());
  ps.init(7);
  std::vector<Tensor> p, g;
  for (int i : idx) {
    p.push_back(ps.param(i));
    g.push_back(ps.grad(i));
  }
  mixer->bind(p, g);

  const int64_t N = int64_t(s.B) * s.T;
  kernels::Arena io(be), ar(be);
  const DType at = be.act_dtype();
  auto random = [&](uint64_t seed) {
    trainer::Rng rng(seed);
    std::vector<float> h(static_cast<size_t>(N) * s.d);
    for (auto& v : h) v = static_cast<float>(rng.normal());
    Tensor f = io.alloc(DType::f32, {s.B, s.T, s.d});
    be.upload(h.data(), f);
    if (at == DType::f32) return f;
    Tensor t = io.alloc(at, {s.B, s.T, s.d});
    be.convert(f, t);
    return t;
  };
  const Tensor x = random(1), dy = random(2);
  const Tensor y = io.alloc(at, {s.B, s.T, s.d}), dx = io.alloc(at, {s.B, s.T, s.d});
  trainer::ForwardContext ctx{be, ar, true};
  trainer::Routing route;

  // Host clock around a synchronising one-number download: the device finishes every call.
  float probe = 0;
  const Tensor probe_src(ps.params().data, DType::f32, {1});
  auto median_ms = [&](bool backward) {
    std::vector<double> ts;
    for (int i = 0; i < o.warmup + o.reps; ++i) {
      be.download(probe_src, &probe);
      const auto t0 = std::chrono::steady_clock::now();
      ar.reset();
      mixer->forward(ctx, x, y, route);
      if (backward) mixer->backward(ctx, dy, dx, route);
      be.download(probe_src, &probe);
      if (i >= o.warmup)
        ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };
  const double fwd = median_ms(false), all = median_ms(true);
  Tensor dx32 = dx;  // all_finite reads fp32
  if (dx.dtype != DType::f32) {
    dx32 = io.alloc(DType::f32, {s.B, s.T, s.d});
    be.convert(dx, dx32);
  }
  if (!be.all_finite(dx32)) throw RuntimeError("bench linear-layer: " + arch + " produced a non-finite dx");
  return {fwd, all};
}

int bench_layer(const Options& o) {
  using namespace lar;
  kernels::Backend::Options bo;
  bo.precision = o.backend == "cuda" ? "mixed" : "fp32";
  auto be = kernels::make_backend(o.backend, 1, DType::f32, bo);
  std::vector<Shape> shapes;
  if (o.shape != "model") shapes.push_back({1, 4096, 2048, 32, "B=1 T=4096 d=2048 H=32 (paper's layer test)"});
  if (o.shape != "paper") shapes.push_back({8, 4096, 1024, 16, "B=8 T=4096 d=1024 H=16 (344M model's layer)"});
  if (o.quick) shapes = {{1, 256, 128, 2, "B=1 T=256 d=128 H=2 (quick)"}};
  // The CCQ paper's Table 5 (one layer, B=1, hidden 2048, T=4K, fwd+bwd ms): backbone → +CCQ.
  const std::map<std::string, std::pair<double, double>> paper = {{"gla", {2.28, 3.50}}, {"gdn", {6.26, 8.06}}};
  registry::TextTable table;
  table.headers = {"mixer", "shape", "fwd ms", "fwd+bwd ms", "+ccq fwd ms", "+ccq fwd+bwd ms", "CCQ adds (fwd+bwd)",
                  "paper: CCQ adds"};
  std::vector<std::string> archs;
  for (size_t a = 0; a <= o.arch.size();) {
    const size_t b = std::min(o.arch.find(',', a), o.arch.size());
    if (b > a) archs.push_back(o.arch.substr(a, b - a));
    a = b + 1;
  }
  for (const auto& s : shapes) {
    for (const auto& arch : archs) {
      const auto base = time_layer(*be, arch, false, s, o);
      const auto with = time_layer(*be, arch, true, s, o);
      auto it = paper.find(arch);
      const std::string anchor =
          it == paper.end() ? "-"
                            : fmt::format("{:+.1f}% ({:.2f} → {:.2f})", 100.0 * (it->second.second / it->second.first - 1),
                                          it->second.first, it->second.second);
      table.rows.push_back({arch, s.label, fmt::format("{:.3f}", base.first), fmt::format("{:.3f}", base.second),
                            fmt::format("{:.3f}", with.first), fmt::format("{:.3f}", with.second),
                            fmt::format("{:+.1f}%", 100.0 * (with.second / base.second - 1)), anchor});
      std::cerr << "." << std::flush;  // progress: each row takes a few seconds
    }
  }
  std::cerr << "\n";
  std::cout << table.to_table();
  std::cout << "goal: CCQ adds at most 20% to its backbone's layer time (fwd+bwd)\n";
  return 0;
}

}  // namespace

static lar::bench::Registration linear_layer_reg{
    "linear-layer",
    "CUDA: one whole linear-mixer layer (projections, conv, kernel, norm×gate) fwd and fwd+bwd, with and without CCQ",
    [](CLI::App& app) -> lar::bench::Runner {
      auto o = std::make_shared<Options>();
      app.add_option("--reps", o->reps, "Timed repetitions (median reported)")->check(CLI::Range(1, 100000));
      app.add_option("--warmup", o->warmup, "Untimed warm-up calls")->check(CLI::Range(0, 100000));
      app.add_flag("--quick", o->quick, "One small shape (a smoke run)");
      app.add_option("--mixer", o->arch, "Backbones, comma-separated (any linear architecture; default gla,gdn)");
      app.add_option("--shape", o->shape, "paper (B=1 T=4096 d=2048), model (B=8 T=4096 d=1024) or both")
          ->check(CLI::IsMember({"paper", "model", "both"}));
      app.add_option("--backend", o->backend, "cuda (the measure) or cpu (a check of the bench itself)")
          ->check(CLI::IsMember({"cuda", "cpu"}));
      return [o] { return bench_layer(*o); };
    }};
