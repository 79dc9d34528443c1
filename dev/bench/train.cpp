// `lar-bench train` — training throughput of the CPU backend: a 4-layer d=256 softmax
// model at T=512 (the anchor), forward + backward + AdamW step per iteration,
// with the fraction of time in GEMMs and in attention. Results go to docs/perf.md.
#include <time.h>

#include <chrono>
#include <cstdio>
#include <iostream>

#include "dev/bench/bench.hpp"
#include "core/config_schema.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "trainer/model.hpp"
#include "trainer/optim/optimizer.hpp"
#include "trainer/optim/param_views.hpp"
#include "trainer/rng.hpp"

namespace {

struct BenchArgs {
  int layers = 4, d_model = 256, heads = 4, seq = 512, batch = 4, vocab = 256, steps = 5, threads = 2;
};

int run_bench(const BenchArgs& a) {
  using namespace lar;
  json cfg = with_defaults({{"model", {{"n_layers", a.layers}, {"d_model", a.d_model}, {"n_heads", a.heads},
                                       {"vocab_size", a.vocab}}},
                            {"data", {{"seq_len", a.seq}, {"batch_size", a.batch}}}});
  trainer::validate_model_config(cfg);
  kernels::cpu::CpuBackend<float> be(a.threads);
  trainer::Model model(cfg, be);
  model.init(0);
  optim::Optimizer opt(optim::OptimizerConfig::from_json(cfg), optim::param_views(model.params().table()),
                       static_cast<std::size_t>(model.params().numel()));
  trainer::Rng rng(1);
  data::Batch b;
  b.batch = a.batch;
  b.seq_len = a.seq;
  for (int i = 0; i < a.batch * a.seq; ++i) {
    b.inputs.push_back(static_cast<int32_t>(rng.next() % a.vocab));
    b.targets.push_back(static_cast<int32_t>(rng.next() % a.vocab));
    b.loss_mask.push_back(1.0f);
  }
  auto step = [&] {
    model.params().zero_grads();
    model.forward_backward(b);
    opt.clip_gradients(model.params().host_grads());
    opt.step(model.params().host_params(), model.params().host_grads(), 1.0, 1.0);
  };
  step();  // warm-up: arena sizing, page faults
  const double g0 = be.gemm_seconds(), at0 = be.attention_seconds();
  auto cpu_now = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
  };
  const double c0 = cpu_now();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.steps; ++i) step();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpu = cpu_now() - c0;
  const double gemm = be.gemm_seconds() - g0, attn = be.attention_seconds() - at0;
  const double tokens = double(a.batch) * a.seq * a.steps;
  const double flops = 6.0 * double(model.params().numel()) * tokens;  // dense part, per token 6·params
  std::printf("lar-bench train — %s, %d layers, d=%d, heads=%d, T=%d, batch=%d, vocab=%d, %lld params\n",
              be.name().c_str(), a.layers, a.d_model, a.heads, a.seq, a.batch, a.vocab,
              static_cast<long long>(model.params().numel()));
  std::printf("%-28s %12s\n", "measure", "value");
  std::printf("%-28s %12.0f\n", "tokens/s", tokens / secs);
  std::printf("%-28s %12.3f\n", "s/step", secs / a.steps);
  // On a shared machine wall time includes other load; CPU time per thread does not.
  std::printf("%-28s %12.0f\n", "tokens per CPU-second", tokens / cpu);
  std::printf("%-28s %12.2f\n", "CPU use (cores)", cpu / secs);
  std::printf("%-28s %12.1f\n", "GFLOP/s (6·params·tokens)", flops / secs / 1e9);
  std::printf("%-28s %11.1f%%\n", "time in GEMM", 100.0 * gemm / secs);
  std::printf("%-28s %11.1f%%\n", "time in attention", 100.0 * attn / secs);
  std::printf("%-28s %12.1f\n", "activation MiB", model.activation_bytes() / 1048576.0);
  return 0;
}

}  // namespace

static lar::bench::Registration reg{
    "train", "Training tokens/s of the CPU backend (4-layer d=256, T=512) and the share of GEMM time",
    [](CLI::App& app) -> lar::bench::Runner {
      auto a = std::make_shared<BenchArgs>();
      app.add_option("--layers", a->layers, "blocks")->capture_default_str();
      app.add_option("--d-model", a->d_model, "residual width")->capture_default_str();
      app.add_option("--heads", a->heads, "attention heads")->capture_default_str();
      app.add_option("--seq", a->seq, "sequence length")->capture_default_str();
      app.add_option("--batch", a->batch, "sequences per step")->capture_default_str();
      app.add_option("--vocab", a->vocab, "vocabulary")->capture_default_str();
      app.add_option("--steps", a->steps, "timed steps (after one warm-up step)")->capture_default_str();
      app.add_option("--threads", a->threads, "CPU threads")->capture_default_str();
      return [a] { return run_bench(*a); };
    }};
