// `fla-dump DIR [--gates mild|strong]` — inputs and results of the chunk kernels for the
// external check against fla's naive PyTorch recurrences (dev/fla/fla_check.py; fla itself
// is fetched separately and never committed). Writes, per mixer (gdn, deltanet, gla, kda,
// gdn2), one case (B=2, T=300, H=4, an initial state and a gradient on the final state) as
// raw little-endian fp32 files DIR/<mixer>_q, <mixer>_o, <mixer>_dq, ….
// --gates strong gives a tenth of the channels of gla, kda and gdn2 log-decays down to −16 a
// token (the exact-at-any-decay check). Only in CUDA builds.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "kernels/channel_rule/channel_rule.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/delta_rule/delta_rule.hpp"

namespace gl = lar::kernels::cuda::linear;
using bf16 = __nv_bfloat16;

namespace {

template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) { LAR_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T))); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void put(const std::vector<double>& x) {
    std::vector<T> h(n);
    for (size_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<T, bf16>)
        h[i] = __float2bfloat16(static_cast<float>(x[i]));
      else
        h[i] = static_cast<T>(x[i]);
    }
    LAR_CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<double> get() const {
    std::vector<T> h(n);
    LAR_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<double> out(n);
    for (size_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<T, bf16>)
        out[i] = __bfloat162float(h[i]);
      else
        out[i] = h[i];
    }
    return out;
  }
};

// x rounded to bf16 and back: what a kernel reading bf16 inputs actually sees.
double to_bf(double x) { return __bfloat162float(__float2bfloat16(static_cast<float>(x))); }

// Raw little-endian fp32, the format fla_check.py reads.
void write_f32(const std::string& path, const std::vector<double>& x) {
  const std::vector<float> f(x.begin(), x.end());
  FILE* fp = std::fopen(path.c_str(), "wb");
  const bool ok = fp && std::fwrite(f.data(), sizeof(float), f.size(), fp) == f.size();
  if (!fp || std::fclose(fp) != 0 || !ok) throw lar::RuntimeError("fla-dump: cannot write " + path);
}

constexpr int B = 2, T = 300, H = 4, D = 64;
constexpr size_t kRows = static_cast<size_t>(B) * T * H, kNx = kRows * D, kNs = static_cast<size_t>(B) * H * D * D;

// q, k: unit-norm rows rounded to bf16 (the layer L2-normalises them).
void unit_rows(std::vector<double>& x, std::mt19937_64& rng) {
  std::normal_distribution<double> nd(0.0, 1.0);
  x.resize(kNx);
  for (size_t r = 0; r < kRows; ++r) {
    double s = 0;
    for (int i = 0; i < D; ++i) s += (x[r * D + i] = nd(rng)) * x[r * D + i];
    for (int i = 0; i < D; ++i) x[r * D + i] = to_bf(x[r * D + i] / std::sqrt(s));
  }
}

// gdn (gated) and deltanet: log-sigmoid-like decays, mostly mild, some strong; β = σ(N(0,1)).
void dump_delta(const std::string& dir, std::mt19937_64& rng) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  for (bool gated : {true, false}) {
    std::vector<double> q, k, v(kNx), dO(kNx), g(kRows, 0.0), beta(kRows), S0(kNs), dST(kNs);
    unit_rows(q, rng), unit_rows(k, rng);
    for (auto& x : v) x = to_bf(nd(rng));
    for (auto& x : dO) x = to_bf(nd(rng));
    for (auto& x : beta) x = static_cast<float>(1.0 / (1.0 + std::exp(-nd(rng))));
    if (gated)
      for (auto& x : g) x = static_cast<float>(std::log(0.5 + 0.5 * ud(rng)) * (ud(rng) < 0.1 ? 8.0 : 0.3));
    for (auto& x : S0) x = static_cast<float>(0.3 * nd(rng));
    for (auto& x : dST) x = static_cast<float>(0.3 * nd(rng));
    gl::DeltaShape s;
    s.B = B, s.T = T, s.H = H, s.scale = 0.125;
    Dev<bf16> qd(kNx), kd(kNx), vd(kNx), od(kNx), dOd(kNx), dqd(kNx), dkd(kNx), dvd(kNx);
    Dev<float> gd(kRows), betad(kRows), dgd(kRows), dbetad(kRows), S0d(kNs), Sd(kNs), dSTd(kNs), dS0d(kNs);
    Dev<bf16> bound(gl::delta_boundary_bytes(s) / sizeof(bf16));
    qd.put(q), kd.put(k), vd.put(v), dOd.put(dO), betad.put(beta), S0d.put(S0), dSTd.put(dST), gd.put(g);
    const float* gp = gated ? gd.p : nullptr;
    gl::delta_fwd(s, qd.p, kd.p, vd.p, gp, betad.p, S0d.p, od.p, Sd.p, bound.p, nullptr);
    gl::delta_bwd(s, qd.p, kd.p, vd.p, gp, betad.p, bound.p, dOd.p, dSTd.p, dqd.p, dkd.p, dvd.p,
                  gated ? dgd.p : nullptr, dbetad.p, dS0d.p, nullptr);
    LAR_CUDA_CHECK(cudaDeviceSynchronize());
    const std::string pre = dir + "/" + (gated ? "gdn_" : "deltanet_");
    auto w = [&](const std::string& name, const std::vector<double>& x) { write_f32(pre + name, x); };
    w("q", q), w("k", k), w("v", v), w("g", g), w("beta", beta), w("S0", S0), w("dO", dO), w("dST", dST);
    w("o", od.get()), w("S", Sd.get()), w("dq", dqd.get()), w("dk", dkd.get()), w("dv", dvd.get());
    w("dg", gated ? dgd.get() : std::vector<double>(kRows, 0.0)), w("dbeta", dbetad.get()), w("dS0", dS0d.get());
    std::printf("dumped %s (B=%d T=%d H=%d) to %s\n", gated ? "gdn" : "deltanet", B, T, H, dir.c_str());
  }
}

// gla, kda, gdn2: log-gates in (log 0.9, 0) (strong: a tenth of the channels down to −16);
// β, b, w in (0.05, 0.95) — every value rounded to what the kernels read.
void dump_channel(const std::string& dir, bool strong, std::mt19937_64& rng) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  for (gl::ChannelMixer m : {gl::ChannelMixer::gla, gl::ChannelMixer::kda, gl::ChannelMixer::gdn2}) {
    std::vector<double> q, k, v(kNx), dO(kNx), g(kNx), beta(kRows), eb(kNx), ew(kNx), S0(kNs), dST(kNs);
    unit_rows(q, rng), unit_rows(k, rng);
    for (auto& y : v) y = to_bf(nd(rng));
    for (auto& y : dO) y = to_bf(nd(rng));
    for (auto& y : g) y = std::log(0.9 + 0.1 * ud(rng));
    if (strong) {  // a tenth of every head's channels decay by up to 16 per token
      std::vector<bool> steep(static_cast<size_t>(H) * D);
      for (size_t i = 0; i < steep.size(); ++i) steep[i] = ud(rng) < 0.1;
      for (size_t i = 0; i < g.size(); ++i)
        if (steep[i % steep.size()]) g[i] = -16.0 * ud(rng);
    }
    for (auto& y : beta) y = 0.05 + 0.9 * ud(rng);
    for (auto& y : eb) y = to_bf(0.05 + 0.9 * ud(rng));
    for (auto& y : ew) y = to_bf(0.05 + 0.9 * ud(rng));
    for (auto& y : S0) y = 0.1 * nd(rng);
    for (auto& y : dST) y = 0.1 * nd(rng);

    gl::DeltaShape s;
    s.B = B, s.T = T, s.H = H, s.scale = 0.125;
    Dev<bf16> dq_(kNx), dk_(kNx), dv_(kNx), qd(kNx), kd(kNx), vd(kNx), od(kNx), dOd(kNx), bd(kNx), wd(kNx), dbd(kNx),
        dwd(kNx);
    Dev<float> gd(kNx), betad(kRows), dgd(kNx), dbetad(kRows), S0d(kNs), Sd(kNs), dSTd(kNs), dS0d(kNs);
    Dev<bf16> bound(gl::delta_boundary_bytes(s) / sizeof(bf16));
    qd.put(q), kd.put(k), vd.put(v), dOd.put(dO), gd.put(g), betad.put(beta), bd.put(eb), wd.put(ew);
    S0d.put(S0), dSTd.put(dST);
    gl::ChannelInputs in;
    in.q = qd.p, in.k = kd.p, in.v = vd.p, in.g = gd.p, in.S0 = S0d.p;
    if (m == gl::ChannelMixer::kda) in.beta = betad.p;
    if (m == gl::ChannelMixer::gdn2) in.b = bd.p, in.w = wd.p;
    gl::ChannelGrads gr;
    gr.dq = dq_.p, gr.dk = dk_.p, gr.dv = dv_.p, gr.dg = dgd.p, gr.dS0 = dS0d.p;
    if (m == gl::ChannelMixer::kda) gr.dbeta = dbetad.p;
    if (m == gl::ChannelMixer::gdn2) gr.db = dbd.p, gr.dw = dwd.p;
    gl::channel_fwd(m, s, in, od.p, Sd.p, bound.p, nullptr);
    gl::channel_bwd(m, s, in, bound.p, dOd.p, dSTd.p, gr, nullptr);
    LAR_CUDA_CHECK(cudaDeviceSynchronize());

    const std::string pre = dir + "/" + gl::channel_mixer_name(m) + "_";
    auto w = [&](const std::string& name, const std::vector<double>& x) { write_f32(pre + name, x); };
    w("q", q), w("k", k), w("v", v), w("g", g), w("S0", S0), w("dO", dO), w("dST", dST);
    w("o", od.get()), w("S", Sd.get()), w("dq", dq_.get()), w("dk", dk_.get()), w("dv", dv_.get());
    w("dg", dgd.get()), w("dS0", dS0d.get());
    if (m == gl::ChannelMixer::kda) w("beta", beta), w("dbeta", dbetad.get());
    if (m == gl::ChannelMixer::gdn2) w("b", eb), w("w", ew), w("db", dbd.get()), w("dw", dwd.get());
    std::printf("dumped %s (B=%d T=%d H=%d, %s gates) to %s\n", gl::channel_mixer_name(m), B, T, H,
                strong ? "strong" : "mild", dir.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fla-dump — inputs, outputs and gradients of the chunk kernels for dev/fla/fla_check.py"};
  std::string dir, gates = "mild";
  app.add_option("dir", dir, "Folder to write the dumps to (must exist)")->required()->check(CLI::ExistingDirectory);
  app.add_option("--gates", gates, "mild, or strong: a tenth of the channel gates decay by up to 16 a token")
      ->check(CLI::IsMember({"mild", "strong"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : lar::kExitUser;
  }
  try {
    std::mt19937_64 rng{std::random_device{}()};
    dump_delta(dir, rng);
    dump_channel(dir, gates == "strong", rng);
  } catch (const std::exception& e) {
    std::cerr << "fla-dump: error: " << e.what() << "\n";
    return lar::kExitRuntime;
  }
  return 0;
}
