// `lar-bench mixers` — CPU tokens/s of every linear mixer layer (trainer/mixers) at a fixed
// small shape: training step (chunkwise forward + backward) and recurrent decode, fp32 on
// the CPU backend, median of --reps after --warmup. The anchor is the softmax layer at the
// same shape (the layers a linear mixer replaces in a hybrid stack).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <random>
#include <vector>

#include "dev/bench/bench.hpp"
#include "kernels/backend.hpp"
#include "registry/text_table.hpp"
#include "trainer/mixer.hpp"

namespace {

namespace tr = lar::trainer;
using lar::kernels::DType;
using lar::kernels::Tensor;

struct Options {
  int reps = 5, warmup = 1, threads = 2, batch = 8, seq = 256, d_model = 64, heads = 2;
  int chunk = 64;
};

template <class F>
double median_s(F&& f, int reps, int warmup) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int bench_mixers(const Options& o) {
  auto be = lar::kernels::make_backend("cpu", o.threads, DType::f32);
  lar::kernels::Arena arena(*be);
  const int B = o.batch, T = o.seq, d = o.d_model;
  std::cout << fmt::format("mixers: one layer, fp32 on {}; B={} T={} d_model={} heads={} "
                           "chunk={}; median of {} after {} warm-up\n",
                           be->name(), B, T, d, o.heads, o.chunk, o.reps, o.warmup);
  lar::registry::TextTable table;
  table.headers = {"mixer", "params", "fwd ms", "fwd+bwd ms", "train tok/s", "decode tok/s", "vs softmax"};
  table.right_align = {false, true, true, true, true, true, true};
  double softmax_tps = 0;
  for (const char* kind : {"softmax", "linear", "gla", "deltanet", "gdn", "kda", "gdn2", "carve"}) {
    if (!tr::mixer_registered(kind)) continue;
    lar::json model{{"architecture", kind == std::string("softmax") ? "gdn" : kind},
                    {"stack", kind == std::string("softmax") ? "dense" : "pure"},
                    {"hybrid_ratio", 2}, {"n_layers", 1}, {"d_model", d}, {"n_heads", o.heads},
                    {"n_kv_heads", 0}, {"head_dim", 0}, {"value_dim", 0}, {"init_std", 0.02},
                    {"routing", "none"}, {"short_conv", true}, {"conv_size", 4},
                    {"chunk_size", o.chunk}, {"gate_rank", 16}, {"rope_base", 10000.0}, {"window", 0},
                    {"ccq", {{"enabled", false}}},
                    {"carve", {{"content_rank", 16}, {"content_chunk", 0}, {"content_grad", true},
                               {"freeze_content", false}}}};
    auto cfg = tr::mixer_config(model, 0);
    auto m = tr::make_mixer(cfg);
    auto specs = m->params();
    std::vector<std::vector<float>> p, g;
    std::vector<Tensor> pt, gt;
    std::mt19937 rng(1);
    int64_t nparams = 0;
    for (auto& s : specs) {
      int64_t n = 1;
      for (auto x : s.shape) n *= x;
      nparams += n;
      p.emplace_back(n);
      g.emplace_back(n, 0.f);
      for (auto& x : p.back())
        x = s.init.kind == tr::InitRule::normal ? std::normal_distribution<float>(0, (float)s.init.a)(rng)
            : s.init.kind == tr::InitRule::uniform
                ? std::uniform_real_distribution<float>((float)s.init.a, (float)s.init.b)(rng)
                : (float)s.init.a;
      pt.emplace_back(p.back().data(), DType::f32, s.shape);
      gt.emplace_back(g.back().data(), DType::f32, s.shape);
    }
    m->bind(pt, gt);
    std::vector<float> x((size_t)B * T * d), y(x.size()), dy(x.size()), dx(x.size());
    std::normal_distribution<float> nd(0, 1);
    for (auto& e : x) e = nd(rng);
    for (auto& e : dy) e = nd(rng);
    tr::ForwardContext ctx{*be, arena, true};
    tr::Routing route;
    Tensor X(x.data(), DType::f32, {B, T, d}), Y(y.data(), DType::f32, {B, T, d});
    Tensor dY(dy.data(), DType::f32, {B, T, d}), dX(dx.data(), DType::f32, {B, T, d});
    auto fwd = [&] {
      arena.reset();
      m->forward(ctx, X, Y, route);
    };
    const double t_fwd = median_s(fwd, o.reps, o.warmup);
    const double t_all = median_s([&] { fwd(), m->backward(ctx, dY, dX, route); }, o.reps, o.warmup);
    // decode: B sequences, 64 positions, one step() each
    const int steps = 64;
    tr::ForwardContext ectx{*be, arena, false};
    std::vector<float> xs((size_t)B * d), ys(xs.size());
    const double t_dec = median_s(
        [&] {
          auto st = m->init_state(*be, B, steps);
          for (int t = 0; t < steps; ++t) {
            arena.reset();
            m->step(ectx, Tensor(xs.data(), DType::f32, {B, d}), Tensor(ys.data(), DType::f32, {B, d}), *st,
                    route);
          }
        },
        o.reps, o.warmup);
    const double tps = B * T / t_all;
    if (std::string(kind) == "softmax") softmax_tps = tps;
    table.rows.push_back({kind, std::to_string(nparams), lar::registry::fmt_num(t_fwd * 1e3),
                          lar::registry::fmt_num(t_all * 1e3), lar::registry::fmt_num(tps, 5),
                          lar::registry::fmt_num(B * steps / t_dec, 5),
                          softmax_tps > 0 ? lar::registry::fmt_num(tps / softmax_tps, 3) : "-"});
  }
  std::cout << table.to_table();
  return 0;
}

}  // namespace

static lar::bench::Registration mixers_reg{
    "mixers", "CPU: tokens/s of each linear mixer layer (train fwd+bwd, decode) vs softmax",
    [](CLI::App& app) -> lar::bench::Runner {
      auto o = std::make_shared<Options>();
      app.add_option("--reps", o->reps, "Timed repetitions (median reported)")->check(CLI::Range(1, 1000));
      app.add_option("--warmup", o->warmup, "Untimed warm-up calls")->check(CLI::Range(0, 1000));
      app.add_option("--threads", o->threads, "CPU backend threads")->check(CLI::Range(1, 256));
      app.add_option("--batch", o->batch, "Sequences")->check(CLI::Range(1, 4096));
      app.add_option("--seq", o->seq, "Tokens per sequence")->check(CLI::Range(1, 1 << 20));
      app.add_option("--d-model", o->d_model, "Residual width")->check(CLI::Range(8, 1 << 16));
      app.add_option("--heads", o->heads, "Heads")->check(CLI::Range(1, 256));
      app.add_option("--chunk", o->chunk, "Chunk size of the chunkwise form")->check(CLI::Range(1, 4096));
      return [o] { return bench_mixers(*o); };
    }};
