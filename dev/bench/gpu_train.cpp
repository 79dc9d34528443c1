// `lar-bench gpu-train` — end-to-end training throughput on the CUDA backend: the
// 350M-class dense model of the performance goal (20 layers, d=1024, 16 heads, 4 kv groups, FFN 2816,
// vocab 32000) at B=8 × T=4096 by default; forward + backward + global-norm clip + AdamW
// (or --optimizer muon/normuon) per step, all on the device. Prints tokens/s, s/step,
// device memory high-water mark and MFU (6·params·tokens over the measured 790 TFLOP/s
// bf16 matrix rate of the H200 — the convention of the PyTorch anchor).
// With LAR_CUDA_PROFILE=1 it adds device milliseconds per step for each op kind.
// --arch/--stack/--hybrid-ratio pick the token mixers (default: the dense softmax model);
// e.g. `--arch gdn --stack pure` is the 344M GDN model of the kernel goal (heads of 64), whose
// linear layers add their own per-op times (kernels/linear/layer_ops.hpp) to the profile.
// Only in CUDA builds (LAR_HAVE_CUDA comes from kernels/cuda/CMakeLists.txt).
#ifdef LAR_HAVE_CUDA
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "dev/bench/bench.hpp"
#include "core/config_schema.hpp"
#include "kernels/backend.hpp"
#include "core/error.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/linear/layer_ops.hpp"
#include "trainer/mixer.hpp"
#include "trainer/model.hpp"
#include "trainer/optim/device_optimizer.hpp"
#include "trainer/optim/param_views.hpp"
#include "trainer/rng.hpp"

namespace {

struct Args {
  int layers = 20, d_model = 1024, heads = 16, kv = 4, d_ff = 2816, vocab = 32000, seq = 4096, batch = 8;
  int steps = 5, warmup = 2;
  std::string precision = "mixed", optimizer = "adamw";
  std::string arch = "softmax", stack = "dense";
  int hybrid_ratio = 2;
};

int run(Args a) {
  using namespace lar;
  if (a.arch != "softmax" && a.stack == "dense") a.stack = "pure";  // `--arch gdn` alone: the pure GDN model
  json cfg = with_defaults({{"model", {{"n_layers", a.layers}, {"d_model", a.d_model}, {"n_heads", a.heads},
                                       {"n_kv_heads", a.kv}, {"d_ff", a.d_ff}, {"vocab_size", a.vocab},
                                       {"architecture", a.arch}, {"stack", a.stack}, {"hybrid_ratio", a.hybrid_ratio}}},
                            {"optimizer", {{"name", a.optimizer}}},
                            {"data", {{"seq_len", a.seq}, {"batch_size", a.batch}}}});
  trainer::validate_model_config(cfg);
  if (const std::string why = trainer::cuda_unsupported(cfg.at("model")); !why.empty())
    throw UserError("bench gpu-train: " + why);
  kernels::Backend::Options o;
  o.precision = a.precision;
  auto be = kernels::make_backend("cuda", 1, kernels::DType::f32, o);
  trainer::Model model(cfg, *be);
  model.init(0);
  auto& ps = model.params();
  optim::DeviceOptimizer opt(*be, optim::OptimizerConfig::from_json(cfg), optim::param_views(ps.table()),
                             static_cast<std::size_t>(ps.numel()));
  trainer::Rng rng(1);
  data::Batch b;
  b.batch = a.batch;
  b.seq_len = a.seq;
  for (int i = 0; i < a.batch * a.seq; ++i) {
    b.inputs.push_back(static_cast<int32_t>(rng.next() % a.vocab));
    b.targets.push_back(static_cast<int32_t>(rng.next() % a.vocab));
    b.loss_mask.push_back(1.0f);
  }
  double loss = 0, gnorm = 0;
  float probe = 0;
  auto sync = [&] { be->download(kernels::Tensor(ps.params().data, kernels::DType::f32, {1}), &probe); };
  std::vector<double> fb_times, opt_times;  // forward+backward, clip+update (each synced)
  auto step = [&] {
    auto t0 = std::chrono::steady_clock::now();
    ps.zero_grads();
    loss = model.forward_backward(b).loss;
    sync();
    auto t1 = std::chrono::steady_clock::now();
    gnorm = opt.clip_gradients(ps.grads());  // syncs: the norm comes back to the host
    opt.step(ps.params(), ps.grads(), 1.0, 1.0);
    sync();
    fb_times.push_back(std::chrono::duration<double>(t1 - t0).count());
    opt_times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count());
  };
  for (int i = 0; i < a.warmup; ++i) step();
  sync();
  fb_times.clear();
  opt_times.clear();
  auto* cuda = dynamic_cast<kernels::cuda::CudaBackend*>(be.get());
  if (cuda) {  // drop the warm-up's events
    cuda->profile_report();
    kernels::cuda::linear::layer_profile_report();
  }
  std::vector<double> times;
  for (int i = 0; i < a.steps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    step();
    sync();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  std::sort(fb_times.begin(), fb_times.end());
  std::sort(opt_times.begin(), opt_times.end());
  const double med = times[times.size() / 2];
  const double tokens = double(a.batch) * a.seq;
  const double n = double(ps.numel());
  std::printf("lar-bench gpu-train — %s, %s, %s/%s, %d layers, d=%d, heads=%d/%d kv, FFN %d, vocab %d, B=%d, T=%d, "
              "%.1fM params\n",
              be->name().c_str(), a.optimizer.c_str(), a.arch.c_str(), a.stack.c_str(), a.layers, a.d_model, a.heads,
              a.kv, a.d_ff, a.vocab, a.batch, a.seq, n / 1e6);
  std::printf("%-34s %12s\n", "measure", "value");
  std::printf("%-34s %12.0f\n", "tokens/s (median step)", tokens / med);
  std::printf("%-34s %12.4f\n", "s/step (median; min / max)", med);
  std::printf("%-34s %5.4f / %5.4f\n", "", times.front(), times.back());
  std::printf("%-34s %12.4f\n", "  forward+backward s (median)", fb_times[fb_times.size() / 2]);
  std::printf("%-34s %12.4f\n", "  clip + optimiser s (median)", opt_times[opt_times.size() / 2]);
  std::printf("%-34s %12.2f\n", "device memory peak GiB (ours)", be->device_peak_bytes() / 1073741824.0);
  std::printf("%-34s %12.2f\n", "activation arena GiB", model.activation_bytes() / 1073741824.0);
  std::printf("%-34s %11.1f%%\n", "MFU (6·N·tokens / 790 TFLOP/s)", 100.0 * 6.0 * n * tokens / med / 790e12);
  std::printf("%-34s %12.4f\n", "loss / grad norm (last step)", loss);
  std::printf("%-34s %12.4f\n", "", gnorm);
  // LAR_CUDA_PROFILE=1: device time per op kind and step (events add a little overhead).
  if (cuda) {
    auto ops = cuda->profile_report();
    for (auto& op : kernels::cuda::linear::layer_profile_report()) ops.push_back(op);
    std::sort(ops.begin(), ops.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
    for (const auto& [op, secs] : ops)
      std::printf("  %-32s %9.2f ms/step %5.1f%%\n", op.c_str(), 1e3 * secs / a.steps, 100.0 * secs / a.steps / med);
  }
  return 0;
}

}  // namespace

static lar::bench::Registration reg{
    "gpu-train", "Training tokens/s on the CUDA backend (350M-class dense model, B=8×4096)",
    [](CLI::App& app) -> lar::bench::Runner {
      auto a = std::make_shared<Args>();
      app.add_option("--layers", a->layers, "blocks")->capture_default_str();
      app.add_option("--d-model", a->d_model, "residual width")->capture_default_str();
      app.add_option("--heads", a->heads, "attention heads")->capture_default_str();
      app.add_option("--kv", a->kv, "key/value heads")->capture_default_str();
      app.add_option("--d-ff", a->d_ff, "SwiGLU width")->capture_default_str();
      app.add_option("--vocab", a->vocab, "vocabulary")->capture_default_str();
      app.add_option("--seq", a->seq, "sequence length")->capture_default_str();
      app.add_option("--batch", a->batch, "sequences per step")->capture_default_str();
      app.add_option("--steps", a->steps, "timed steps")->capture_default_str();
      app.add_option("--warmup", a->warmup, "untimed steps first")->capture_default_str();
      app.add_option("--precision", a->precision, "fp32 | mixed")->capture_default_str();
      app.add_option("--optimizer", a->optimizer, "adamw | muon | normuon")->capture_default_str();
      app.add_option("--arch", a->arch, "model.architecture: softmax | linear | gla | deltanet | gdn | kda | gdn2")
          ->capture_default_str();
      app.add_option("--stack", a->stack, "model.stack: dense | pure | hybrid (a linear --arch with dense is "
                                          "changed to pure)")
          ->capture_default_str();
      app.add_option("--hybrid-ratio", a->hybrid_ratio, "linear layers per softmax layer (hybrid)")->capture_default_str();
      return [a] { return run(*a); };
    }};
#endif  // LAR_HAVE_CUDA
