// `lar-bench linear-cuda` — the fused chunkwise linear-mixer kernels (kernels/delta_rule, channel_rule, carve, ccq, linear) on
// the GPU: deltanet, gdn, gla, kda, gdn2 forward, backward and forward+backward at B=8, T=4096, H=16,
// dk=dv=64 and B=1, T=32K; CUDA-event timing, median of --reps after --warmup, against the
// byte and FLOP floors and, with --fla FILE, fla's chunk kernels timed in the same device call
// (dev/fla/fla_check.py --time --json FILE). --key-dim K and --value-dim N time heads of K × N
// channels through kernels/linear/grouped_heads.hpp (key dims 128 and 256 go to the recurrent
// kernels of wide_key.hpp; CCQ in front at any key dim); --key-split times gla's wide key heads on
// both the recurrent kernels and the key-block split.
// Only in CUDA builds (LAR_HAVE_CUDA comes from kernels/cuda/CMakeLists.txt).
#ifdef LAR_HAVE_CUDA
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/json.hpp"
#include "dev/bench/bench.hpp"
#include "kernels/carve/carve_cuda.hpp"
#include "kernels/ccq/ccq_cuda.hpp"
#include "kernels/channel_rule/channel_rule.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/delta_rule/delta_rule.hpp"
#include "kernels/linear/grouped_heads.hpp"
#include "kernels/linear/wide_key.hpp"
#include "registry/text_table.hpp"

namespace {

using bf16 = __nv_bfloat16;
namespace ll = lar::kernels::cuda::linear;

// Ceilings measured on the H200: bf16 dense GEMM on
// random data, device-to-device copy (read + write).
constexpr double kPeakTflops = 790.0;
constexpr double kBandwidthTBs = 4.3;

struct Options {
  int reps = 20, warmup = 3;
  int value_dim = 64;  // ≠ 64: value heads of 64·m through grouped_heads.hpp (no floors)
  int key_dim = 64;    // 128, 256: the wide-key kernels (no floors, no CARVE, no decode rows)
  bool key_split = false;  // gla at key_dim 128, 256: the recurrent kernels and the key-block split
  bool quick = false;
  bool long_seq = true;
  bool short_seq = true;
  std::string only;  // comma-separated case names; empty = all
  std::string fla;   // JSON of fla's times from the same call: {"mixer,B,T,H,dk,dv": {"fwd": ms, "fwd_bwd": ms}}
  bool wants(const std::string& name) const {
    if (only.empty()) return true;
    size_t a = 0;
    while (a <= only.size()) {
      const size_t b = std::min(only.find(',', a), only.size());
      if (only.compare(a, b - a, name) == 0) return true;
      a = b + 1;
    }
    return false;
  }
};

// fla's fwd+bwd ms per "mixer,B,T,H,dk,dv" (dev/fla/fla_check.py --time --json writes the file).
std::map<std::string, double> read_fla(const std::string& path) {
  std::map<std::string, double> out;
  if (path.empty()) return out;
  std::ifstream in(path);
  if (!in) throw lar::UserError("bench linear-cuda: --fla " + path + ": cannot open");
  try {
    lar::json j;
    in >> j;
    for (auto it = j.begin(); it != j.end(); ++it) out[it.key()] = it.value().at("fwd_bwd").get<double>();
  } catch (const lar::json::exception& e) {
    throw lar::UserError("bench linear-cuda: --fla " + path + ": " + e.what());
  }
  return out;
}

// Inputs at B=1 T=32K are 33M elements per tensor: generating them on one host thread took
// ~6 s per problem, longer than a short device call. Blocks of 64K elements (whole rows of
// 64) are filled in parallel, each from its own seed, so the values do not depend on the
// thread count.
constexpr size_t kBlock = size_t{1} << 16;
template <class F>
void parallel_blocks(size_t n, F&& f) {
  const size_t blocks = (n + kBlock - 1) / kBlock;
  const size_t threads = std::max<size_t>(1, std::min<size_t>(blocks, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (size_t blk = t; blk < blocks; blk += threads) f(blk, blk * kBlock, std::min(n, (blk + 1) * kBlock));
    });
  for (auto& th : pool) th.join();
}

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
    parallel_blocks(n, [&](size_t, size_t a, size_t b) {
      for (size_t i = a; i < b; ++i) x[i] = static_cast<T>(h[i]);
    });
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
// Each generator takes the caller's Rng only to draw a seed for its blocks (one draw per call,
// so successive tensors differ and the sequence stays deterministic).
std::vector<float> rows_unit(size_t rows, Rng& r, int width = 64) {
  std::vector<float> h(rows * width);
  const uint64_t seed = r.x;
  r.uniform();
  // blocks of 64K elements hold whole rows of 64, 128 or 256
  parallel_blocks(h.size(), [&](size_t blk, size_t a, size_t b) {
    Rng rb(seed + blk);
    for (size_t i = a / width; i < b / width; ++i) {
      double s = 0;
      for (int c = 0; c < width; ++c) s += (h[i * width + c] = static_cast<float>(rb.normal())) * h[i * width + c];
      for (int c = 0; c < width; ++c) h[i * width + c] = static_cast<float>(h[i * width + c] / std::sqrt(s));
    }
  });
  return h;
}
// n values of lo + span * u (u uniform in [0, 1)), or of sd * N(0, 1) when normal is set
std::vector<float> draw(size_t n, Rng& r, bool normal, double lo_or_sd, double span = 0) {
  std::vector<float> h(n);
  const uint64_t seed = r.x;
  r.uniform();
  parallel_blocks(n, [&](size_t blk, size_t a, size_t b) {
    Rng rb(seed + blk);
    for (size_t i = a; i < b; ++i)
      h[i] = static_cast<float>(normal ? lo_or_sd * rb.normal() : lo_or_sd + span * rb.uniform());
  });
  return h;
}
std::vector<float> normal(size_t n, Rng& r, double sd = 1.0) { return draw(n, r, true, sd); }
std::vector<float> uniform(size_t n, Rng& r, double lo, double span) { return draw(n, r, false, lo, span); }
std::vector<float> bf_round(std::vector<float> h) {
  parallel_blocks(h.size(), [&](size_t, size_t a, size_t b) {
    for (size_t i = a; i < b; ++i) h[i] = __bfloat162float(__float2bfloat16(h[i]));
  });
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

// Which kernels a problem of wide gla heads runs: what grouped_heads.hpp picks (the product's
// choice), the recurrent wide-key kernels (wide_key.hpp) or the key-block split (its gate opened
// for the call).
enum class KeyPath { product, recurrent, split };
// Opens the key-block split's gate for a scope when `on`.
struct SplitGate {
  bool was = ll::wide_key_split_unverified_allowed();
  explicit SplitGate(bool on) {
    if (on) ll::wide_key_split_unverified_allowed() = true;
  }
  ~SplitGate() { ll::wide_key_split_unverified_allowed() = was; }
  SplitGate(const SplitGate&) = delete;
  SplitGate& operator=(const SplitGate&) = delete;
};
// Boundary bytes for either path when `both` (the larger need), else the product's.
std::size_t boundary_bytes(const ll::GroupedShape& gs, bool both) {
  const SplitGate gate(both);
  return ll::grouped_boundary_bytes(gs);
}

// Everything one problem needs on the device. mixer: deltanet, gdn (delta_fwd/bwd) or gla,
// kda, gdn2 (channel_fwd/bwd), carve (carve_fwd/bwd, content rank 16), each optionally
// "+ccq" (ccq_fwd in front of the backbone's forward, ccq_bwd after its backward). Heads of
// dk × dv other than 64 × 64 ("wide") go through grouped_heads.hpp.
struct Problem {
  std::string mixer, base;
  bool ccq, carve, channel, gated;
  ll::ChannelMixer cm = ll::ChannelMixer::gla;
  ll::DeltaShape s;
  ll::GroupedShape gs;  // the same with heads of dk × dv (wide)
  bool wide;
  KeyPath path = KeyPath::product;  // wide channel heads only
  int64_t hk;                       // key dim
  size_t nx, nr, ns, nv, nsv, nk;  // q/k elements, rows, 64×64 states; v/o elements, dv×dk states; CCQ's dk×dk

  DevBuf<bf16> q, k, v, o, dO, dq, dk, dv, bound, bg, wg, dbg, dwg;
  DevBuf<float> g, beta, S, dg, dbeta, dS0;
  // CARVE: scalar w, U1, U2, content workspace; CCQ: corrected q, λ, statistics, dq_c
  static constexpr int kRank = 16;
  DevBuf<float> wsc, U1, U2, content, dwsc, dU1, dU2, lam, Kst, mst, dlam;
  DevBuf<bf16> qc, dqc;
  // both: the boundary sized for the recurrent kernels and the key-block split alike
  Problem(const std::string& m, int64_t B, int64_t T, int64_t H, uint64_t seed, int64_t dv = 64, int64_t dk = 64,
          bool both = false)
      : mixer(m),
        base(m.substr(0, m.find('+'))),
        ccq(m.find("+ccq") != std::string::npos),
        carve(base == "carve"),
        channel(base == "gla" || base == "kda" || base == "gdn2" || base == "carve"),
        gated(base != "deltanet"),
        s{B, T, H, dk, 64, 1.0 / std::sqrt(static_cast<double>(dk)), {}},
        gs{B, T, H, H, dk, dv, 1.0 / std::sqrt(static_cast<double>(dk)), {}},
        wide(dv != 64 || dk != 64),
        hk(dk),
        nx(static_cast<size_t>(B * T * H) * dk),
        nr(static_cast<size_t>(B * T * H)),
        ns(static_cast<size_t>(B * H) * 64 * 64),
        nv(nr * dv),
        nsv(static_cast<size_t>(B * H) * dv * dk),
        nk(static_cast<size_t>(B * H) * dk * dk),
        q(nx), k(nx), v(nv), o(nv), dO(nv), dq(nx), dk(nx), dv(nv),
        bound(boundary_bytes(gs, both) / sizeof(bf16)),
        bg(channel ? nx : 1), wg(channel ? nv : 1), dbg(channel ? nx : 1), dwg(channel ? nv : 1),
        g(channel ? nx : nr), beta(nr), S(nsv), dg(channel ? nx : nr), dbeta(nr), dS0(nsv),
        wsc(carve ? nr : 1), U1(carve ? static_cast<size_t>(H) * kRank * 64 : 1),
        U2(carve ? static_cast<size_t>(H) * kRank * 64 : 1), content(carve ? ll::carve_content_bytes(s) / 4 : 1),
        dwsc(carve ? nr : 1), dU1(carve ? static_cast<size_t>(H) * kRank * 64 : 1),
        dU2(carve ? static_cast<size_t>(H) * kRank * 64 : 1), lam(ccq ? nr : 1), Kst(ccq ? nk : 1),
        mst(ccq ? static_cast<size_t>(B * H) * dk : 1), dlam(ccq ? nr : 1), qc(ccq ? nx : 1), dqc(ccq ? nx : 1) {
    if (base == "kda") cm = ll::ChannelMixer::kda;
    if (base == "gdn2") cm = ll::ChannelMixer::gdn2;
    if (wide && carve)
      throw lar::UserError("bench linear-cuda: CARVE runs heads of 64 × 64 only (got dk " + std::to_string(dk) +
                           ", dv " + std::to_string(dv) + ")");
    Rng r(seed);
    q.put(bf_round(rows_unit(nr, r, dk))), k.put(bf_round(rows_unit(nr, r, dk)));
    v.put(bf_round(normal(nv, r))), dO.put(bf_round(normal(nv, r)));
    beta.put(uniform(nr, r, 0.05, 0.9));
    std::vector<float> hg(g.n, 0.f);
    if (gated) {
      hg = uniform(g.n, r, 0.9, 0.1);
      parallel_blocks(hg.size(), [&](size_t, size_t a, size_t b) {
        for (size_t i = a; i < b; ++i) hg[i] = std::log(hg[i]);
      });
    }
    g.put(hg);
    if (channel) {
      bg.put(uniform(nx, r, 0.05, 0.9));
      wg.put(uniform(nv, r, 0.05, 0.9));
      if (carve) bg.put(bf_round(normal(nx, r)));  // erase logits
    }
    if (carve) {
      wsc.put(uniform(nr, r, 0.05, 0.9));
      U1.put(normal(U1.n, r)), U2.put(normal(U2.n, r, 0.3));
    }
    if (ccq) lam.put(uniform(nr, r, 0.01, 0.2));
  }
  const bf16* qin() const { return ccq ? qc.p : q.p; }  // what the backbone reads
  ll::CcqInputs ccq_inputs() const {
    ll::CcqInputs in;
    in.q = q.p, in.k = k.p, in.lambda = lam.p;
    return in;
  }
  ll::CarveInputs carve_inputs() const {
    ll::CarveInputs in;
    in.q = qin(), in.k = k.p, in.v = v.p, in.g = g.p, in.bx = bg.p, in.w = wsc.p, in.U1 = U1.p, in.U2 = U2.p;
    in.rank = kRank;
    return in;
  }
  ll::ChannelInputs inputs() const {
    ll::ChannelInputs in;
    in.q = qin(), in.k = k.p, in.v = v.p, in.g = g.p, in.beta = beta.p, in.b = bg.p, in.w = wg.p;
    return in;
  }
  void fwd() {
    if (ccq && hk != 64)
      ll::wide_ccq_fwd(s, ccq_inputs(), qc.p, {Kst.p, mst.p}, nullptr);
    else if (ccq)
      ll::ccq_fwd(s, ccq_inputs(), qc.p, {Kst.p, mst.p}, nullptr);
    const SplitGate gate(path == KeyPath::split);
    if (wide && channel && path == KeyPath::recurrent)
      ll::wide_channel_fwd(cm, gs, inputs(), o.p, S.p, bound.p, nullptr);
    else if (wide && channel)
      ll::grouped_channel_fwd(cm, gs, inputs(), o.p, S.p, bound.p, nullptr);
    else if (wide)
      ll::grouped_delta_fwd(gs, qin(), k.p, v.p, gated ? g.p : nullptr, beta.p, nullptr, o.p, S.p, bound.p, nullptr);
    else if (carve)
      ll::carve_fwd(s, carve_inputs(), o.p, S.p, bound.p, content.p, nullptr);
    else if (channel)
      ll::channel_fwd(cm, s, inputs(), o.p, S.p, bound.p, nullptr);
    else
      ll::delta_fwd(s, qin(), k.p, v.p, gated ? g.p : nullptr, beta.p, nullptr, o.p, S.p, bound.p, nullptr);
  }
  void bwd() {
    bf16* dq_b = ccq ? dqc.p : dq.p;  // the backbone's gradient on the q it read
    if (carve) {
      ll::CarveGrads gr;
      gr.dq = dq_b, gr.dk = dk.p, gr.dv = dv.p, gr.dbx = dbg.p, gr.dg = dg.p, gr.dw = dwsc.p, gr.dU1 = dU1.p;
      gr.dU2 = dU2.p, gr.dS0 = dS0.p;
      ll::carve_bwd(s, carve_inputs(), bound.p, content.p, dO.p, nullptr, gr, nullptr);
    } else if (channel) {
      ll::ChannelGrads gr;
      gr.dq = dq_b, gr.dk = dk.p, gr.dv = dv.p, gr.dg = dg.p, gr.dbeta = dbeta.p, gr.db = dbg.p, gr.dw = dwg.p;
      gr.dS0 = dS0.p;
      const SplitGate gate(path == KeyPath::split);
      if (wide && path == KeyPath::recurrent)
        ll::wide_channel_bwd(cm, gs, inputs(), bound.p, dO.p, nullptr, gr, nullptr);
      else if (wide)
        ll::grouped_channel_bwd(cm, gs, inputs(), bound.p, dO.p, nullptr, gr, nullptr);
      else
        ll::channel_bwd(cm, s, inputs(), bound.p, dO.p, nullptr, gr, nullptr);
    } else if (wide) {
      ll::grouped_delta_bwd(gs, qin(), k.p, v.p, gated ? g.p : nullptr, beta.p, bound.p, dO.p, nullptr, dq_b, dk.p,
                            dv.p, gated ? dg.p : nullptr, dbeta.p, dS0.p, nullptr);
    } else {
      ll::delta_bwd(s, qin(), k.p, v.p, gated ? g.p : nullptr, beta.p, bound.p, dO.p, nullptr, dq_b, dk.p, dv.p,
                    gated ? dg.p : nullptr, dbeta.p, dS0.p, nullptr);
    }
    if (ccq && hk != 64)
      ll::wide_ccq_bwd(s, ccq_inputs(), {Kst.p, mst.p}, dqc.p, dq.p, dk.p, dlam.p, nullptr);
    else if (ccq)
      ll::ccq_bwd(s, ccq_inputs(), {Kst.p, mst.p}, dqc.p, dq.p, dk.p, dlam.p, nullptr);
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
  if (!o.long_seq) cases = {{8, 4096, 16}};
  if (!o.short_seq) cases = {{1, 32768, 16}};
  if (!o.long_seq && !o.short_seq) throw lar::UserError("bench linear-cuda: --no-long and --no-short leave no shape");
  if (o.quick) cases = {{1, 1024, 4}};
  if (o.value_dim % 64 != 0)
    throw lar::UserError("bench linear-cuda: --value-dim " + std::to_string(o.value_dim) + " is not a multiple of 64");
  if (o.key_dim != 64 && !ll::wide_key_dim(o.key_dim))
    throw lar::UserError("bench linear-cuda: --key-dim " + std::to_string(o.key_dim) + ": the kernels take 64, 128 or 256");
  if (o.key_split && o.key_dim == 64)
    throw lar::UserError("bench linear-cuda: --key-split times key dims of 128 and 256 (give --key-dim)");
  const bool wide = o.key_dim != 64 || o.value_dim != 64;
  std::cout << fmt::format(
      "linear-cuda: {} linear mixers (dk={}, dv={}, bf16 in/out, fp32 state) on {} ({} SMs); "
      "median of {} after {} warm-up; floors at {:.0f} TFLOP/s and {:.1f} TB/s\n",
      o.key_dim == 64 ? "fused chunkwise (chunk 64)"
      : o.key_split   ? "recurrent wide-key and (gla) key-block split"
                      : "recurrent wide-key",
      o.key_dim, o.value_dim, prop.name, prop.multiProcessorCount, o.reps, o.warmup, kPeakTflops, kBandwidthTBs);
  const std::map<std::string, double> fla = read_fla(o.fla);
  lar::registry::TextTable table;
  table.headers = {"mixer", "shape", "pass", "ms", "floor ms (bytes | flops)", "anchor ms", "anchor/ours"};
  table.right_align = {false, false, false, true, true, true, true};
  // our own times of each case, for the carve (vs gdn2) and +ccq (vs backbone) anchors
  std::map<std::string, double> ours;
  for (const std::string mixer : {"deltanet", "gdn", "gla", "kda", "gdn2", "carve", "gdn+ccq", "gla+ccq"}) {
    // carve is anchored on our gdn2, a +ccq mixer on its backbone (same call)
    const std::string own_anchor = mixer == "carve" ? "gdn2" : mixer.substr(0, mixer.find('+'));
    if (!o.wants(mixer)) continue;
    // --key-split: gla's wide key heads on the recurrent kernels and on the key-block split,
    // the split's rows anchored on the recurrent ones
    const bool both = o.key_split && o.key_dim != 64 && mixer.rfind("gla", 0) == 0;
    std::vector<std::pair<KeyPath, std::string>> paths = {{KeyPath::product, mixer}};
    if (both) paths = {{KeyPath::recurrent, mixer + " [recurrent]"}, {KeyPath::split, mixer + " [key split]"}};
    for (const Case& c : cases) {
      if (wide && mixer == "carve") continue;
      Problem p(mixer, c.B, c.T, c.H, 7, o.value_dim, o.key_dim, both);
      for (const auto& [path, label] : paths) {
        p.path = path;
        const std::string anchor_of = path == KeyPath::split ? mixer + " [recurrent]" : own_anchor;
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
        // gates per token: channel log-gate; gdn2 b, w; carve bx and the scalar w
        const double extra = p.channel ? 64 * 4 + (mixer == "gdn2" ? 2 * 64 * 2 : p.carve ? 64 * 2 + 4 : 0) : 0;
        // CCQ: q read again, q_c written and read (fwd); dq_c written and read, q, k, dk again (bwd); λ
        const double cx_fwd = p.ccq ? 3 * 64 * 2 + 4 : 0, cx_bwd = p.ccq ? 6 * 64 * 2 + 8 : 0;
        const double fwd_bytes = rows * (4 * 64 * 2 + 8 + extra + cx_fwd) + bound_bytes;
        const double bwd_bytes = rows * (7 * 64 * 2 + 16 + 2 * extra + cx_bwd) + bound_bytes;
        const double fwd_flops = (6 + (p.ccq ? 4 : 0)) * gemm, bwd_flops = (16 + (p.ccq ? 12 : 0)) * gemm;
        auto floor_ms = [&](double bytes, double flops) {
          const double b = bytes / (kBandwidthTBs * 1e9), f = flops / (kPeakTflops * 1e9);
          return fmt::format("{:.3f} ({:.3f} | {:.3f})", std::max(b, f), b, f);
        };
        const std::string name = fmt::format("B={} T={} H={}", c.B, c.T, c.H) +
                                 (p.wide ? fmt::format(" dk={} dv={}", o.key_dim, o.value_dim) : "");
        const auto fla_it = fla.find(fmt::format("{},{},{},{},{},{}", mixer, c.B, c.T, c.H, o.key_dim, o.value_dim));
        const double anchor = fla_it == fla.end() ? 0.0 : fla_it->second;  // fla fwd+bwd, same call
        const bool anchored = anchor > 0;
        for (const auto& [pass, t] : {std::pair<std::string, double>{"fwd", t_fwd}, {"bwd", t_bwd}, {"fwd+bwd", t_all}})
          ours[label + name + pass] = t;
        auto own = [&](const std::string& pass, double t) -> std::vector<std::string> {
          const auto it = ours.find(anchor_of + name + pass);
          if (anchor_of == label || it == ours.end()) return {"-", "-"};
          return {fmt::format("{:.3f} ({})", it->second, anchor_of), fmt::format("{:.3f}x", it->second / t)};
        };
        auto row = [&](const std::string& pass, double t, const std::string& floor, bool with_fla) {
          std::vector<std::string> a = with_fla ? std::vector<std::string>{fmt::format("{:.2f} (fla)", anchor),
                                                                       fmt::format("{:.2f}x", anchor / t)}
                                           : own(pass, t);
          table.rows.push_back({label, name, pass, fmt::format("{:.3f}", t), floor, a[0], a[1]});
        };
        // one line as soon as a case is timed: a run stopped by a time limit keeps what it measured
        std::cout << fmt::format("  {} {}: fwd {:.3f}  bwd {:.3f}  fwd+bwd {:.3f} ms\n", label, name, t_fwd, t_bwd, t_all)
                  << std::flush;
        // (the floors count heads of 64 × 64: none for wide heads)
        row("fwd", t_fwd, p.wide ? "-" : floor_ms(fwd_bytes, fwd_flops), false);
        row("bwd", t_bwd, p.wide ? "-" : floor_ms(bwd_bytes, bwd_flops), false);
        row("fwd+bwd", t_all, p.wide ? "-" : floor_ms(fwd_bytes + bwd_bytes, fwd_flops + bwd_flops), anchored);
      }
    }
  }
  // recurrent single-token decode of every mixer: one launch per token, state read
  // and written once (floor: 2 · B·H·16 KiB at the copy bandwidth)
  for (const std::string mixer : {"deltanet", "gdn", "gla", "kda", "gdn2", "carve"}) {
    if (!o.wants(mixer + "-decode") || wide) continue;
    const int64_t B = o.quick ? 1 : 8, H = o.quick ? 4 : 16;
    Problem p(mixer, B, 1, H, 11);
    const double t = median_ms(
        [&] {
          if (p.carve) {
            ll::CarveInputs in = p.carve_inputs();
            ll::carve_decode(p.s, in, 5, p.S.p, p.content.p, p.o.p, nullptr);
          } else if (!p.channel) {
            ll::delta_decode(p.s, p.q.p, p.k.p, p.v.p, p.gated ? p.g.p : nullptr, p.beta.p, p.S.p, p.o.p, nullptr);
          } else {
            ll::channel_decode(p.cm, p.s, p.inputs(), p.S.p, p.o.p, nullptr);
          }
        },
        std::max(o.reps, 50), o.warmup + 5);
    const double bytes = 2.0 * B * H * 64 * 64 * 4;
    table.rows.push_back({mixer + " decode", fmt::format("B={} H={} (1 token)", B, H), "step",
                          fmt::format("{:.4f}", t), fmt::format("{:.4f} (bytes)", bytes / (kBandwidthTBs * 1e9)), "-",
                          "-"});
  }
  std::cout << table.to_table();
  std::cout << (o.fla.empty() ? std::string("anchors: no fla times given (--fla FILE: dev/fla/fla_check.py --time --json "
                                            "FILE in the same device call)")
                              : "anchors: fla's chunk kernels fwd+bwd timed in the same call (" + o.fla + ")")
            << "; goal fla/ours >= 1.5x; carve vs our gdn2 (goal >= 0.91x: within 10%); +ccq vs its "
               "backbone (goal >= 0.83x: CCQ adds <= 20%)\n";
  return 0;
}

}  // namespace

static lar::bench::Registration linear_cuda_reg{
    "linear-cuda", "CUDA: fused chunkwise deltanet/gdn/gla/kda/gdn2/carve (+ccq) fwd/bwd (B=8,T=4096,H=16,d=64; B=1,T=32K), decode",
    [](CLI::App& app) -> lar::bench::Runner {
      auto o = std::make_shared<Options>();
      app.add_option("--reps", o->reps, "Timed repetitions (median reported)")->check(CLI::Range(1, 100000));
      app.add_option("--warmup", o->warmup, "Untimed warm-up calls")->check(CLI::Range(0, 100000));
      app.add_flag("--quick", o->quick, "One small shape (a smoke run)");
      app.add_flag("!--no-long", o->long_seq, "Skip the B=1, T=32K shape");
      app.add_flag("!--no-short", o->short_seq, "Skip the B=8, T=4096 shape");
      app.add_option("--value-dim", o->value_dim,
                     "Value head dim (a multiple of 64 up to 512): value heads of 64·m run as m heads "
                     "sharing q, k (kernels/linear/grouped_heads.hpp); no CARVE, no decode rows")
          ->check(CLI::Range(64, 512));
      app.add_option("--key-dim", o->key_dim,
                     "Key head dim, 64, 128 or 256 (CARVE's paper heads are 128, CCQ's 256 × 512): 128 and 256 run "
                     "the recurrent wide-key kernels (kernels/linear/wide_key.hpp); no CARVE, no decode rows")
          ->check(CLI::IsMember({64, 128, 256}));
      app.add_flag("--key-split", o->key_split,
                   "With --key-dim 128 or 256: time gla and gla+ccq on the recurrent wide-key kernels and on the "
                   "key-block split (the 64-wide chunk kernels over the key blocks, kernels/linear/"
                   "grouped_heads.hpp; its gate opened for the bench), the split's rows anchored on the recurrent ones");
      app.add_option("--mixer", o->only,
                     "Only these cases, comma-separated (deltanet, gdn, gla, kda, gdn2, carve, gdn+ccq, gla+ccq, "
                     "<mixer>-decode for deltanet, gdn, gla, kda, gdn2, carve)");
      app.add_option("--fla", o->fla,
                     "JSON of fla's fwd+bwd ms timed in the same device call, keyed \"mixer,B,T,H,dk,dv\" "
                     "(dev/fla/fla_check.py --time --json FILE)");
      return [o] { return bench_linear(*o); };
    }};
#endif  // LAR_HAVE_CUDA
