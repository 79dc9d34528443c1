// Inputs and results of the channel-gated kernels (gla, kda, gdn2) for the external check
// against fla's naive PyTorch recurrences (kernels/cuda/linear/fla_check.py; fla itself is
// fetched separately and never committed). test_linear_delta's DumpForExternalCheck does the
// same for gdn and deltanet. With LAR_LINEAR_DUMP=DIR set it writes, per mixer, one case
// (B=2, T=300, H=4, an initial state and a gradient on the final state) as raw
// little-endian fp32 files <mixer>_q, <mixer>_o, <mixer>_dq, …; skipped otherwise.
// LAR_LINEAR_DUMP_GATES=strong gives a tenth of the channels log-decays down to −16 a token.
#include <gtest/gtest.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/linear/linear_attention.hpp"
#include "tests/gpu/device_buffer.hpp"

namespace gl = lar::kernels::cuda::linear;
using lar::gpu_test::bf16;
using lar::gpu_test::Dev;
using lar::gpu_test::to_bf;

namespace {

TEST(FlaDump, ChannelMixersForExternalCheck) {
  const char* dir = std::getenv("LAR_LINEAR_DUMP");
  if (!dir) GTEST_SKIP() << "LAR_LINEAR_DUMP not set";
  std::mt19937_64 rng{std::random_device{}()};
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  const int B = 2, T = 300, H = 4, D = 64;
  // LAR_LINEAR_DUMP_GATES=strong: the exact-at-any-decay check against fla's naive recurrences
  const char* gates = std::getenv("LAR_LINEAR_DUMP_GATES");
  const bool strong = gates && std::string(gates) == "strong";
  const size_t rows = static_cast<size_t>(B) * T * H, nx = rows * D, ns = static_cast<size_t>(B) * H * D * D;
  for (gl::ChannelMixer m : {gl::ChannelMixer::gla, gl::ChannelMixer::kda, gl::ChannelMixer::gdn2}) {
    // the layer's inputs: unit-norm q, k rows; unit-variance v, dO; log-gates in (log 0.9, 0);
    // β, b, w in (0.05, 0.95) — every value rounded to what the kernels read
    std::vector<double> q(nx), k(nx), v(nx), dO(nx), g(nx), beta(rows), eb(nx), ew(nx), S0(ns), dST(ns);
    for (auto* x : {&q, &k}) {
      for (size_t r = 0; r < rows; ++r) {
        double s = 0;
        for (int i = 0; i < D; ++i) s += ((*x)[r * D + i] = nd(rng)) * (*x)[r * D + i];
        for (int i = 0; i < D; ++i) (*x)[r * D + i] = to_bf((*x)[r * D + i] / std::sqrt(s));
      }
    }
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
    Dev<bf16> dq_(nx), dk_(nx), dv_(nx), qd(nx), kd(nx), vd(nx), od(nx), dOd(nx), bd(nx), wd(nx), dbd(nx), dwd(nx);
    Dev<float> gd(nx), betad(rows), dgd(nx), dbetad(rows), S0d(ns), Sd(ns), dSTd(ns), dS0d(ns);
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
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    const std::string pre = std::string(dir) + "/" + gl::channel_mixer_name(m) + "_";
    auto write = [&](const std::string& name, const std::vector<double>& x) {
      ASSERT_TRUE(lar::gpu_test::write_f32(pre + name, x)) << pre + name;
    };
    write("q", q), write("k", k), write("v", v), write("g", g), write("S0", S0), write("dO", dO), write("dST", dST);
    write("o", od.get()), write("S", Sd.get()), write("dq", dq_.get()), write("dk", dk_.get()), write("dv", dv_.get());
    write("dg", dgd.get()), write("dS0", dS0d.get());
    if (m == gl::ChannelMixer::kda) write("beta", beta), write("dbeta", dbetad.get());
    if (m == gl::ChannelMixer::gdn2) write("b", eb), write("w", ew), write("db", dbd.get()), write("dw", dwd.get());
    std::printf("dumped %s (B=%d T=%d H=%d) to %s\n", gl::channel_mixer_name(m), B, T, H, dir);
  }
}

}  // namespace
