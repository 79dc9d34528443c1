// `lar-bench attention` — causal bf16 attention on the GPU, both implementations in
// kernels/attention: cuDNN's fused attention (cudnn_attention.hpp) and our flash
// kernels (flash_attention.hpp); forward, backward and forward+backward at the issue's
// shapes, CUDA-event timing, median of --reps after --warmup, against the FLOP floor and
// PyTorch SDPA timed in the same device call (--sdpa FILE; without it, no SDPA columns).
// Only in CUDA builds (LAR_HAVE_CUDA comes from kernels/cuda/CMakeLists.txt).
#ifdef LAR_HAVE_CUDA
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dev/bench/bench.hpp"
#include "core/error.hpp"
#include "core/json.hpp"
#include "kernels/attention/cudnn_attention.hpp"
#include "kernels/attention/flash_attention.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "registry/text_table.hpp"

namespace {

using bf16 = __nv_bfloat16;
namespace fa = lar::kernels::cuda::attention;

// bf16 dense matrix rate measured on this H200 (an 8192³ product through PyTorch on random
// data): the floor uses it, not the datasheet's 990.
constexpr double kPeakTflops = 790.0;

struct Options {
  int reps = 30, warmup = 5;
  bool quick = false;
  int64_t B = 0, T = 0, H = 16, kv = 0, d = 64;  // --T given: that one shape only
  std::string sdpa;  // JSON of SDPA times: {"B,T,H,kv,d": {"fwd": ms, "fwd_bwd": ms}, ...}
  int tiles = -1;    // the flash kernels' tile configuration for both passes; -1: each pass its faster
  std::string attention = "auto";  // the cuda.attention value whose path is reported
};

// SDPA milliseconds of one shape (fwd, fwd+bwd); negative where not measured.
struct SdpaMs {
  double fwd = -1, all = -1;
};

std::map<std::string, SdpaMs> read_sdpa(const std::string& path) {
  std::map<std::string, SdpaMs> out;
  if (path.empty()) return out;
  std::ifstream in(path);
  if (!in) throw lar::UserError("bench attention: --sdpa " + path + ": cannot open");
  lar::json j;
  try {
    in >> j;
    for (auto it = j.begin(); it != j.end(); ++it)
      out[it.key()] = {it.value().value("fwd", -1.0), it.value().value("fwd_bwd", -1.0)};
  } catch (const lar::json::exception& e) {
    throw lar::UserError("bench attention: --sdpa " + path + ": " + e.what());
  }
  return out;
}

struct Case {
  int64_t B, T, H, Hkv, D;
};

template <class T>
struct DevBuf {
  T* p = nullptr;
  explicit DevBuf(size_t n) { LAR_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T))); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

// Uniform values of unit variance (never zeros: they run faster than real data).
void fill_random(bf16* dst, size_t n, uint64_t seed) {
  std::vector<bf16> h(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const double u = static_cast<double>(x >> 11) / 9007199254740992.0;  // [0,1)
    h[i] = __float2bfloat16(static_cast<float>((2 * u - 1) * 1.7320508));
  }
  LAR_CUDA_CHECK(cudaMemcpy(dst, h.data(), n * sizeof(bf16), cudaMemcpyHostToDevice));
}

// Median milliseconds of `reps` timed calls of f (each between two events) after warm-up.
template <class F>
double median_ms(F&& f, int reps, int warmup) {
  for (int i = 0; i < warmup; ++i) f();
  cudaEvent_t a, b;
  LAR_CUDA_CHECK(cudaEventCreate(&a));
  LAR_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    LAR_CUDA_CHECK(cudaEventRecord(a));
    f();
    LAR_CUDA_CHECK(cudaEventRecord(b));
    LAR_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    LAR_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int bench_attention(const Options& o) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    throw lar::RuntimeError("bench attention: no CUDA device");
  cudaDeviceProp prop{};
  LAR_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::vector<Case> cases = {{8, 4096, 16, 16, 64}, {8, 4096, 16, 4, 64}, {2, 16384, 16, 16, 64},
                             {1, 32768, 16, 16, 64}, {4, 4096, 16, 16, 128}};
  if (o.quick) cases = {{1, 1024, 4, 4, 64}};
  if (o.T > 0) {
    if (o.d != 64 && o.d != 128) throw lar::UserError("bench attention: --d must be 64 or 128, got " + std::to_string(o.d));
    const int64_t kv = o.kv > 0 ? o.kv : o.H;
    if (o.H < 1 || o.H % kv != 0)
      throw lar::UserError("bench attention: --H " + std::to_string(o.H) + " is not a multiple of --kv " + std::to_string(kv));
    cases = {{o.B > 0 ? o.B : 1, o.T, o.H, kv, o.d}};
  }
  const std::map<std::string, SdpaMs> sdpa = read_sdpa(o.sdpa);
  const fa::AttentionMode mode = fa::attention_mode(o.attention);
  std::unique_ptr<fa::CudnnAttention> cudnn;
  if (fa::cudnn_available()) cudnn = std::make_unique<fa::CudnnAttention>();
  std::cout << fmt::format("attention: causal bf16 on {} ({} SMs), scale 1/sqrt(d); median of {} after {} warm-up; "
                           "floor at {:.0f} TFLOP/s (fwd 2·B·H·T²·d flops, bwd 2.5×); flash tiles {}\n",
                           prop.name, prop.multiProcessorCount, o.reps, o.warmup, kPeakTflops,
                           o.tiles >= 0 ? fmt::format("{} (--tiles)", o.tiles) : "default");
  std::cout << (cudnn ? fmt::format("cudnn: cuDNN {} (fused flash attention, backend graph API)\n", fa::cudnn_version())
                      : "cudnn: unavailable (" + fa::cudnn_unavailable_reason() + ")\n");
  lar::registry::TextTable table;
  table.headers = {"shape", "impl", "pass", "ms", "TFLOP/s", "floor ms", "SDPA ms", "ours/SDPA"};
  table.right_align = {false, false, false, true, true, true, true, true};
  std::vector<std::string> paths;
  for (const Case& c : cases) {
    fa::FlashShape s;
    s.tiles = static_cast<int>(o.tiles);
    s.B = c.B, s.T = c.T, s.S = c.T, s.Hq = c.H, s.Hkv = c.Hkv, s.D = c.D;
    s.scale = 1.0 / std::sqrt(static_cast<double>(c.D));
    std::string why;
    const bool cudnn_ok = cudnn && cudnn->prepare(s, &why);
    if (cudnn && !cudnn_ok) std::cout << fmt::format("cudnn: no plan for B={} T={}: {}\n", c.B, c.T, why);
    const size_t nq = c.B * c.T * c.H * c.D, nk = c.B * c.T * c.Hkv * c.D;
    size_t wsn = fa::flash_attention_bwd_workspace_bytes(s);
    if (cudnn_ok) wsn = std::max({wsn, cudnn->fwd_workspace_bytes(s), cudnn->bwd_workspace_bytes(s)});
    DevBuf<bf16> q(nq), k(nk), v(nk), out(nq), dout(nq), dq(nq), dk(nk), dv(nk);
    DevBuf<float> lse(c.B * c.H * c.T);
    DevBuf<unsigned char> ws(wsn);
    fill_random(q.p, nq, 1), fill_random(k.p, nk, 2), fill_random(v.p, nk, 3), fill_random(dout.p, nq, 4);

    const double f_fwd = 2.0 * c.B * c.H * static_cast<double>(c.T) * c.T * c.D;
    const double floor_fwd = f_fwd / (kPeakTflops * 1e9), floor_bwd = 2.5 * floor_fwd;
    const std::string name = fmt::format("B={} T={} H={}{} d={}", c.B, c.T, c.H,
                                         c.Hkv != c.H ? fmt::format(" (kv {})", c.Hkv) : "", c.D);
    SdpaMs anchor;
    auto it = sdpa.find(fmt::format("{},{},{},{},{}", c.B, c.T, c.H, c.Hkv, c.D));
    if (it != sdpa.end()) anchor = it->second;
    auto row = [&](const char* impl, const char* pass, double ms, double flops, double floor, double ref) {
      table.rows.push_back({name, impl, pass, fmt::format("{:.3f}", ms), fmt::format("{:.0f}", flops / (ms * 1e9)),
                            fmt::format("{:.3f}", floor), ref > 0 ? fmt::format("{:.3f}", ref) : "-",
                            ref > 0 ? fmt::format("{:.2f}x", ms / ref) : "-"});
    };
    // Times one implementation; its gradients must be finite (a NaN means a broken kernel).
    auto time_impl = [&](const char* impl, auto&& fwd, auto&& bwd) {
      const double t_fwd = median_ms(fwd, o.reps, o.warmup);
      const double t_bwd = median_ms(bwd, o.reps, o.warmup);
      const double t_all = median_ms([&] { fwd(), bwd(); }, o.reps, o.warmup);
      LAR_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<bf16> h(std::min<size_t>(nq, 1 << 20));
      LAR_CUDA_CHECK(cudaMemcpy(h.data(), dq.p, h.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
      for (bf16 x : h)
        if (!std::isfinite(__bfloat162float(x))) throw lar::RuntimeError(std::string("bench attention: non-finite dq (") + impl + ")");
      row(impl, "fwd", t_fwd, f_fwd, floor_fwd, anchor.fwd);
      row(impl, "bwd", t_bwd, 2.5 * f_fwd, floor_bwd, anchor.fwd > 0 && anchor.all > 0 ? anchor.all - anchor.fwd : -1);
      row(impl, "fwd+bwd", t_all, 3.5 * f_fwd, floor_fwd + floor_bwd, anchor.all);
    };
    if (cudnn_ok)
      time_impl(
          "cudnn", [&] { cudnn->fwd(s, q.p, k.p, v.p, out.p, lse.p, ws.p, nullptr); },
          [&] { cudnn->bwd(s, q.p, k.p, v.p, out.p, lse.p, dout.p, dq.p, dk.p, dv.p, ws.p, nullptr); });
    time_impl(
        "flash", [&] { fa::flash_attention_fwd(s, q.p, k.p, v.p, out.p, lse.p, nullptr); },
        [&] { fa::flash_attention_bwd(s, q.p, k.p, v.p, out.p, lse.p, dout.p, dq.p, dk.p, dv.p, ws.p, nullptr); });
    // What CudaBackend's attention would run at this shape (training: not deterministic).
    const bool backend_cudnn = mode != fa::AttentionMode::flash && cudnn_ok;
    paths.push_back(fmt::format("{}: {}", name, backend_cudnn ? "cudnn" : "flash"));
  }
  std::cout << table.to_table();
  std::cout << fmt::format("path `lar train` takes (cuda.attention: {}; deterministic runs: flash): ", o.attention);
  for (size_t i = 0; i < paths.size(); ++i) std::cout << (i ? "; " : "") << paths[i];
  std::cout << "\n";
  if (o.sdpa.empty())
    std::cout << "SDPA: not given (--sdpa FILE: PyTorch SDPA ms timed in the same device call); goal: "
                 "fwd+bwd ≤ 1.2× SDPA\n";
  else
    std::cout << "SDPA: PyTorch F.scaled_dot_product_attention(is_causal=True) timed in this session (" << o.sdpa
              << "); goal: fwd+bwd ≤ 1.2× SDPA\n";
  return 0;
}

}  // namespace

static lar::bench::Registration attention_reg{
    "attention", "CUDA: causal bf16 attention fwd/bwd, cuDNN and flash (B=8,T=4096,H=16,d=64; kv 4; T=16K, 32K)",
    [](CLI::App& app) -> lar::bench::Runner {
      auto o = std::make_shared<Options>();
      app.add_option("--reps", o->reps, "Timed repetitions (median reported)")->check(CLI::Range(1, 100000));
      app.add_option("--warmup", o->warmup, "Untimed warm-up calls")->check(CLI::Range(0, 100000));
      app.add_flag("--quick", o->quick, "One small shape (a smoke run)");
      app.add_option("--T", o->T, "Time one shape of this sequence length instead of the default list");
      app.add_option("--B", o->B, "Batch of that shape (default 1)");
      app.add_option("--H", o->H, "Query heads of that shape");
      app.add_option("--kv", o->kv, "KV heads of that shape (default: --H)");
      app.add_option("--d", o->d, "Head dim of that shape (64 or 128)");
      app.add_option("--tiles", o->tiles, "Flash tile configuration for both passes: 0 or 1 (default: each pass its faster)")
          ->check(CLI::Range(0, 1));
      app.add_option("--attention", o->attention, "The cuda.attention value whose path is reported")
          ->check(CLI::IsMember({"auto", "cudnn", "flash"}));
      app.add_option("--sdpa", o->sdpa, "JSON of PyTorch SDPA ms measured in this session, keyed \"B,T,H,kv,d\"");
      return [o] { return bench_attention(*o); };
    }};
#endif  // LAR_HAVE_CUDA
