// `lar bench linear-cuda` — the fused chunkwise linear-mixer kernels (kernels/cuda/linear) on
// the GPU: deltanet, gdn, gla, kda, gdn2 forward, backward and forward+backward at B=8, T=4096, H=16,
// dk=dv=64 and B=1, T=32K; CUDA-event timing, median of --reps after --warmup, against the
// byte and FLOP floors and fla's fwd+bwd times on this H200 (the anchors; the device
// call that produced docs/perf.md also re-measured fla beside us).
// Only in CUDA builds (LAR_HAVE_CUDA comes from kernels/cuda/CMakeLists.txt).
#ifdef LAR_HAVE_CUDA
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <vector>

#include "cli/bench.hpp"
#include "core/error.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/linear/linear_attention.hpp"
#include "registry/text_table.hpp"

namespace {

using bf16 = __nv_bfloat16;
namespace ll = lar::kernels::cuda::linear;

// Ceilings measured on this H200 (/work/.library/device/KINDS.md): bf16 dense GEMM on
// random data, device-to-device copy (read + write).
constexpr double kPeakTflops = 790.0;
constexpr double kBandwidthTBs = 4.3;

struct Options {
  int reps = 20, warmup = 3;
  bool quick = false;
  std::string only;
};

template <class T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) { LAR_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T))); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void put(const std::vector<float>& h) {
    std::vector<T> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = static_cast<T>(h[i]);
    LAR_CUDA_CHECK(cudaMemcpy(p, x.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<float> get() const {
    std::vector<T> x(n);
    LAR_CUDA_CHECK(cudaMemcpy(x.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<float> h(n);
    for (size_t i = 0; i < n; ++i) h[i] = static_cast<float>(x[i]);
    return h;
  }
};

// Deterministic pseudo-random inputs like a layer's: unit-norm q, k rows (bf16), unit
// variance v, dO; β ∈ (0.05, 0.95); log-gates in (log 0.9, 0).
struct Rng {
  uint64_t x;
  explicit Rng(uint64_t seed) : x(seed * 0x9E3779B97F4A7C15ull + 1) {}
  double uniform() {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return static_cast<double>(x >> 11) / 9007199254740992.0;
  }
  double normal() { return std::sqrt(-2 * std::log(uniform() + 1e-300)) * std::cos(6.283185307179586 * uniform()); }
};
std::vector<float> rows_unit(size_t rows, Rng& r) {
  std::vector<float> h(rows * 64);
  for (size_t i = 0; i < rows; ++i) {
    double s = 0;
    for (int c = 0; c < 64; ++c) s += (h[i * 64 + c] = static_cast<float>(r.normal())) * h[i * 64 + c];
    for (int c = 0; c < 64; ++c) h[i * 64 + c] = static_cast<float>(h[i * 64 + c] / std::sqrt(s));
  }
  return h;
}
std::vector<float> normal(size_t n, Rng& r, double sd = 1.0) {
  std::vector<float> h(n);
  for (auto& x : h) x = static_cast<float>(sd * r.normal());
  return h;
}
std::vector<float> bf_round(std::vector<float> h) {
  for (auto& x : h) x = __bfloat162float(__float2bfloat16(x));
  return h;
}

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

// Everything one problem needs on the device. mixer: deltanet, gdn (delta_fwd/bwd) or gla,
// kda, gdn2 (channel_fwd/bwd).
struct Problem {
  std::string mixer;
  bool channel, gated;
  ll::ChannelMixer cm = ll::ChannelMixer::gla;
  ll::DeltaShape s;
  size_t nx, nr, ns;
  DevBuf<bf16> q, k, v, o, dO, dq, dk, dv, bound, bg, wg, dbg, dwg;
  DevBuf<float> g, beta, S, dg, dbeta, dS0;
  Problem(const std::string& m, int64_t B, int64_t T, int64_t H, uint64_t seed)
      : mixer(m),
        channel(m == "gla" || m == "kda" || m == "gdn2"),
        gated(m != "deltanet"),
        s{B, T, H, 64, 64, 0.125},
        nx(static_cast<size_t>(B * T * H) * 64),
        nr(static_cast<size_t>(B * T * H)),
        ns(static_cast<size_t>(B * H) * 64 * 64),
        q(nx), k(nx), v(nx), o(nx), dO(nx), dq(nx), dk(nx), dv(nx),
        bound(ll::delta_boundary_bytes(s) / sizeof(bf16)),
        bg(channel ? nx : 1), wg(channel ? nx : 1), dbg(channel ? nx : 1), dwg(channel ? nx : 1),
        g(channel ? nx : nr), beta(nr), S(ns), dg(channel ? nx : nr), dbeta(nr), dS0(ns) {
    if (m == "kda") cm = ll::ChannelMixer::kda;
    if (m == "gdn2") cm = ll::ChannelMixer::gdn2;
    Rng r(seed);
    q.put(bf_round(rows_unit(nr, r))), k.put(bf_round(rows_unit(nr, r)));
    v.put(bf_round(normal(nx, r))), dO.put(bf_round(normal(nx, r)));
    std::vector<float> hb(nr), hg(g.n, 0.f);
    for (auto& x : hb) x = static_cast<float>(0.05 + 0.9 * r.uniform());
    if (gated)
      for (auto& x : hg) x = static_cast<float>(std::log(0.9 + 0.1 * r.uniform()));
    beta.put(hb), g.put(hg);
    if (channel) {
      std::vector<float> u(nx);
      for (auto& x : u) x = static_cast<float>(0.05 + 0.9 * r.uniform());
      bg.put(u);
      for (auto& x : u) x = static_cast<float>(0.05 + 0.9 * r.uniform());
      wg.put(u);
    }
  }
  ll::ChannelInputs inputs() const {
    ll::ChannelInputs in;
    in.q = q.p, in.k = k.p, in.v = v.p, in.g = g.p, in.beta = beta.p, in.b = bg.p, in.w = wg.p;
    return in;
  }
  void fwd() {
    if (channel)
      ll::channel_fwd(cm, s, inputs(), o.p, S.p, bound.p, nullptr);
    else
      ll::delta_fwd(s, q.p, k.p, v.p, gated ? g.p : nullptr, beta.p, nullptr, o.p, S.p, bound.p, nullptr);
  }
  void bwd() {
    if (channel) {
      ll::ChannelGrads gr;
      gr.dq = dq.p, gr.dk = dk.p, gr.dv = dv.p, gr.dg = dg.p, gr.dbeta = dbeta.p, gr.db = dbg.p, gr.dw = dwg.p;
      gr.dS0 = dS0.p;
      ll::channel_bwd(cm, s, inputs(), bound.p, dO.p, nullptr, gr, nullptr);
    } else {
      ll::delta_bwd(s, q.p, k.p, v.p, gated ? g.p : nullptr, beta.p, bound.p, dO.p, nullptr, dq.p, dk.p, dv.p,
                    gated ? dg.p : nullptr, dbeta.p, dS0.p, nullptr);
    }
  }
};

int bench_linear(const Options& o) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    throw lar::RuntimeError("bench linear-cuda: no CUDA device");
  cudaDeviceProp prop{};
  LAR_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  struct Case {
    int64_t B, T, H;
  };
  std::vector<Case> cases = {{8, 4096, 16}, {1, 32768, 16}};
  if (o.quick) cases = {{1, 1024, 4}};
  std::cout << fmt::format(
      "linear-cuda: fused chunkwise linear mixers (chunk 64, dk=dv=64, bf16 in/out, fp32 state) on {} ({} SMs); "
      "median of {} after {} warm-up; floors at {:.0f} TFLOP/s and {:.1f} TB/s\n",
      prop.name, prop.multiProcessorCount, o.reps, o.warmup, kPeakTflops, kBandwidthTBs);
  lar::registry::TextTable table;
  table.headers = {"mixer", "shape", "pass", "ms", "floor ms (bytes | flops)", "fla ms", "fla/ours"};
  table.right_align = {false, false, false, true, true, true, true};
  for (const std::string mixer : {"deltanet", "gdn", "gla", "kda", "gdn2"}) {
    // fla fwd+bwd on this H200 at B=8, T=4096, H=16 (issue 8's anchors).
    const double anchor = mixer == "deltanet" ? 1.98 : mixer == "gdn" ? 2.28 : mixer == "gla" ? 3.04
                        : mixer == "kda" ? 4.83 : 5.42;
    if (!o.only.empty() && o.only != mixer) continue;
    for (const Case& c : cases) {
      Problem p(mixer, c.B, c.T, c.H, 7);
      auto fwd = [&] { p.fwd(); };
      auto bwd = [&] { p.bwd(); };
      p.fwd();
      const double t_fwd = median_ms(fwd, o.reps, o.warmup);
      const double t_bwd = median_ms(bwd, o.reps, o.warmup);
      const double t_all = median_ms([&] { p.fwd(), p.bwd(); }, o.reps, o.warmup);
      for (float x : p.dq.get())
        if (!std::isfinite(x)) throw lar::RuntimeError("bench linear-cuda: non-finite dq");
      const double rows = static_cast<double>(c.B * c.T * c.H), nc = std::ceil(c.T / 64.0);
      const double bound_bytes = c.B * c.H * nc * 64 * 64 * 2;
      const double gemm = 2.0 * 64 * 64 * 64 * c.B * c.H * nc;  // one 64³ product per chunk and head
      const double extra = p.channel ? 64 * 4 + (mixer == "gdn2" ? 2 * 64 * 2 : 0) : 0;  // gates per token
      const double fwd_bytes = rows * (4 * 64 * 2 + 8 + extra) + bound_bytes;
      const double bwd_bytes = rows * (7 * 64 * 2 + 16 + 2 * extra) + bound_bytes;
      const double fwd_flops = 6 * gemm, bwd_flops = 16 * gemm;
      auto floor_ms = [&](double bytes, double flops) {
        const double b = bytes / (kBandwidthTBs * 1e9), f = flops / (kPeakTflops * 1e9);
        return fmt::format("{:.3f} ({:.3f} | {:.3f})", std::max(b, f), b, f);
      };
      const std::string name = fmt::format("B={} T={} H={}", c.B, c.T, c.H);
      const bool anchored = c.B == 8 && c.T == 4096 && c.H == 16;
      table.rows.push_back({mixer, name, "fwd", fmt::format("{:.3f}", t_fwd), floor_ms(fwd_bytes, fwd_flops), "-", "-"});
      table.rows.push_back({mixer, name, "bwd", fmt::format("{:.3f}", t_bwd), floor_ms(bwd_bytes, bwd_flops), "-", "-"});
      table.rows.push_back({mixer, name, "fwd+bwd", fmt::format("{:.3f}", t_all),
                            floor_ms(fwd_bytes + bwd_bytes, fwd_flops + bwd_flops),
                            anchored ? fmt::format("{:.2f}", anchor) : "-",
                            anchored ? fmt::format("{:.2f}x", anchor / t_all) : "-"});
    }
  }
  std::cout << table.to_table();
  std::cout << "fla: chunk kernels fwd+bwd at B=8 T=4096 H=16 d=64 (issue 8); goal fla/ours >= 1.5x\n";
  return 0;
}

}  // namespace

static lar::cli::BenchRegistration linear_cuda_reg{
    "linear-cuda", "CUDA: fused chunkwise deltanet/gdn/gla/kda/gdn2 fwd/bwd (B=8,T=4096,H=16,d=64; B=1,T=32K)",
    [](CLI::App& app) -> lar::cli::Runner {
      auto o = std::make_shared<Options>();
      app.add_option("--reps", o->reps, "Timed repetitions (median reported)")->check(CLI::Range(1, 100000));
      app.add_option("--warmup", o->warmup, "Untimed warm-up calls")->check(CLI::Range(0, 100000));
      app.add_flag("--quick", o->quick, "One small shape (a smoke run)");
      app.add_option("--mixer", o->only, "Only this mixer (deltanet, gdn, gla, kda, gdn2)");
      return [o] { return bench_linear(*o); };
    }};
#endif  // LAR_HAVE_CUDA
