// `lar bench attention` — the bf16 flash attention kernels (kernels/cuda/attention) on the
// GPU: forward, backward and forward+backward at the shapes, CUDA-event timing,
// median of --reps after --warmup, against the FLOP floor and the PyTorch SDPA anchor.
// Only in CUDA builds (LAR_HAVE_CUDA comes from kernels/cuda/CMakeLists.txt).
#ifdef LAR_HAVE_CUDA
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <vector>

#include "cli/bench.hpp"
#include "core/error.hpp"
#include "kernels/cuda/attention/flash_attention.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "registry/text_table.hpp"

namespace {

using bf16 = __nv_bfloat16;
namespace fa = lar::kernels::cuda::attention;

// bf16 dense matrix rate measured on this H200 (an 8192³ product through PyTorch on random
// data, /work/.library/device/KINDS.md): the floor uses it, not the datasheet's 990.
constexpr double kPeakTflops = 790.0;
// PyTorch SDPA causal fwd+bwd at B=8, T=4096, H=16, d=64 on this H200 (issue 7).
constexpr double kAnchorMs = 2.57;

struct Options {
  int reps = 30, warmup = 5;
  bool quick = false;
  int64_t B = 0, T = 0, H = 16, kv = 0, d = 64;  // --T given: that one shape only
};

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
  std::vector<Case> cases = {{8, 4096, 16, 16, 64}, {2, 16384, 16, 16, 64}, {1, 32768, 16, 16, 64},
                             {4, 4096, 16, 16, 128}, {8, 4096, 16, 4, 64}};
  if (o.quick) cases = {{1, 1024, 4, 4, 64}};
  if (o.T > 0) {
    if (o.d != 64 && o.d != 128) throw lar::UserError("bench attention: --d must be 64 or 128, got " + std::to_string(o.d));
    const int64_t kv = o.kv > 0 ? o.kv : o.H;
    if (o.H < 1 || o.H % kv != 0)
      throw lar::UserError("bench attention: --H " + std::to_string(o.H) + " is not a multiple of --kv " + std::to_string(kv));
    cases = {{o.B > 0 ? o.B : 1, o.T, o.H, kv, o.d}};
  }
  const char* tiles = std::getenv("LAR_FLASH_TILES");
  std::cout << fmt::format("attention: bf16 flash kernels on {} ({} SMs); causal, scale 1/sqrt(d); median of {} "
                           "after {} warm-up; floor at {:.0f} TFLOP/s (fwd 2·B·H·T²·d flops, bwd 2.5×); tiles {}\n",
                           prop.name, prop.multiProcessorCount, o.reps, o.warmup, kPeakTflops,
                           tiles ? fmt::format("LAR_FLASH_TILES={}", tiles) : "default");
  lar::registry::TextTable table;
  table.headers = {"shape", "pass", "ms", "TFLOP/s", "floor ms", "anchor ms", "ours/anchor"};
  table.right_align = {false, false, true, true, true, true, true};
  for (const Case& c : cases) {
    fa::FlashShape s;
    s.B = c.B, s.T = c.T, s.S = c.T, s.Hq = c.H, s.Hkv = c.Hkv, s.D = c.D;
    s.scale = 1.0 / std::sqrt(static_cast<double>(c.D));
    const size_t nq = c.B * c.T * c.H * c.D, nk = c.B * c.T * c.Hkv * c.D;
    DevBuf<bf16> q(nq), k(nk), v(nk), out(nq), dout(nq), dq(nq), dk(nk), dv(nk);
    DevBuf<float> lse(c.B * c.H * c.T);
    DevBuf<unsigned char> ws(fa::flash_attention_bwd_workspace_bytes(s));
    fill_random(q.p, nq, 1), fill_random(k.p, nk, 2), fill_random(v.p, nk, 3), fill_random(dout.p, nq, 4);
    auto fwd = [&] { fa::flash_attention_fwd(s, q.p, k.p, v.p, out.p, lse.p, nullptr); };
    auto bwd = [&] {
      fa::flash_attention_bwd(s, q.p, k.p, v.p, out.p, lse.p, dout.p, dq.p, dk.p, dv.p, ws.p, nullptr);
    };
    const double t_fwd = median_ms(fwd, o.reps, o.warmup);
    const double t_bwd = median_ms(bwd, o.reps, o.warmup);
    const double t_all = median_ms([&] { fwd(), bwd(); }, o.reps, o.warmup);
    LAR_CUDA_CHECK(cudaDeviceSynchronize());
    // Sanity: the gradients must be finite (a NaN here means a broken kernel, not a timing).
    std::vector<bf16> h(std::min<size_t>(nq, 1 << 20));
    LAR_CUDA_CHECK(cudaMemcpy(h.data(), dq.p, h.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    for (bf16 x : h)
      if (!std::isfinite(__bfloat162float(x))) throw lar::RuntimeError("bench attention: non-finite dq");

    const double f_fwd = 2.0 * c.B * c.H * static_cast<double>(c.T) * c.T * c.D;
    const double floor_fwd = f_fwd / (kPeakTflops * 1e9), floor_bwd = 2.5 * floor_fwd;
    const std::string name = fmt::format("B={} T={} H={}{} d={}", c.B, c.T, c.H,
                                         c.Hkv != c.H ? fmt::format(" (kv {})", c.Hkv) : "", c.D);
    const bool anchored = c.B == 8 && c.T == 4096 && c.H == 16 && c.Hkv == 16 && c.D == 64;
    auto row = [&](const char* pass, double ms, double flops, double floor, bool anchor) {
      table.rows.push_back({name, pass, fmt::format("{:.3f}", ms), fmt::format("{:.0f}", flops / (ms * 1e9)),
                            fmt::format("{:.3f}", floor), anchor ? fmt::format("{:.2f}", kAnchorMs) : "-",
                            anchor ? fmt::format("{:.2f}x", ms / kAnchorMs) : "-"});
    };
    row("fwd", t_fwd, f_fwd, floor_fwd, false);
    row("bwd", t_bwd, 2.5 * f_fwd, floor_bwd, false);
    row("fwd+bwd", t_all, 3.5 * f_fwd, floor_fwd + floor_bwd, anchored);
  }
  std::cout << table.to_table();
  std::cout << fmt::format("anchor: PyTorch SDPA causal fwd+bwd, bf16, on this H200 (issue 7); goal ≤ {:.2f} ms\n",
                           1.2 * kAnchorMs);
  return 0;
}

}  // namespace

static lar::cli::BenchRegistration attention_reg{
    "attention", "CUDA: bf16 flash attention fwd/bwd (B=8,T=4096,H=16,d=64; T=16K, 32K)",
    [](CLI::App& app) -> lar::cli::Runner {
      auto o = std::make_shared<Options>();
      app.add_option("--reps", o->reps, "Timed repetitions (median reported)")->check(CLI::Range(1, 100000));
      app.add_option("--warmup", o->warmup, "Untimed warm-up calls")->check(CLI::Range(0, 100000));
      app.add_flag("--quick", o->quick, "One small shape (a smoke run)");
      app.add_option("--T", o->T, "Time one shape of this sequence length instead of the default list");
      app.add_option("--B", o->B, "Batch of that shape (default 1)");
      app.add_option("--H", o->H, "Query heads of that shape");
      app.add_option("--kv", o->kv, "KV heads of that shape (default: --H)");
      app.add_option("--d", o->d, "Head dim of that shape (64 or 128)");
      return [o] { return bench_attention(*o); };
    }};
#endif  // LAR_HAVE_CUDA
