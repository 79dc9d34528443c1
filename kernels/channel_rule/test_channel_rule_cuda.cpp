// The channel-gated chunkwise kernels (kernels/channel_rule: gla, kda, gdn2) against the CPU
// reference (kernels/linear, fp64 chunk form) on fresh random inputs: relative RMS
// error ≤ 5e-3 on o and the final state, ≤ 1e-2 on every gradient (dq, dk, dv, dg and
// dβ / db, dw, dS0). Every GPU output is poisoned with NaN before the launches. Every case runs
// on both implementations (cuda.linear_path: fused / chunked, the two-phase path) and across
// them (a forward of one kind feeding a backward of the other: same boundary states).
#include <gtest/gtest.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/channel_rule/channel_rule.hpp"
#include "kernels/linear/mixers.hpp"
#include "tests/gpu/device_buffer.hpp"
#include "tests/gpu/linear_inputs.hpp"

namespace cl = lar::kernels::cpu::linear;
namespace gl = lar::kernels::cuda::linear;
using lar::gpu_test::bf16;

namespace {

using lar::gpu_test::Dev;
using lar::gpu_test::rel_rms;
using lar::gpu_test::to_bf;

using lar::gpu_test::forced_path;
using lar::gpu_test::Gates;
using lar::gpu_test::gates_name;
using lar::gpu_test::head;
using lar::gpu_test::make_gates;
using lar::gpu_test::unhead;

struct Case {
  gl::ChannelMixer m;
  int B, T, H;
  bool with_state;
  const char* fwd_path = "fused";  // the forward's and the backward's path (cuda.linear_path)
  const char* bwd_path = "fused";
  Gates gates = Gates::mild;
};

cl::Mixer cpu_mixer(gl::ChannelMixer m) {
  return m == gl::ChannelMixer::gla ? cl::Mixer::gla : m == gl::ChannelMixer::kda ? cl::Mixer::kda : cl::Mixer::gdn2;
}

std::string name(const Case& c) {
  return std::string(gl::channel_mixer_name(c.m)) + " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) +
         " H=" + std::to_string(c.H) + (c.with_state ? " +state" : "") + gates_name(c.gates) + " [" + c.fwd_path + "/" +
         c.bwd_path + "]";
}

struct Errors {
  double o, S, dq, dk, dv, dg, dbeta, db, dw, dS0;
};
// Every GPU output of one forward + backward, for the bit-reproducibility check.
using Outputs = std::vector<std::vector<double>>;

Errors run_case(std::mt19937_64& rng, const Case& c, Outputs* raw = nullptr, int repeats = 1) {
  const int D = 64, B = c.B, T = c.T, H = c.H;
  const size_t rows = static_cast<size_t>(B) * T * H, nx = rows * D, ns = static_cast<size_t>(B) * H * D * D;
  std::normal_distribution<double> nd(0.0, 1.0);
  auto unit_rows = [&](std::vector<double>& x) {
    x.resize(nx);
    for (size_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int i = 0; i < D; ++i) s += (x[r * D + i] = nd(rng)) * x[r * D + i];
      for (int i = 0; i < D; ++i) x[r * D + i] = to_bf(x[r * D + i] / std::sqrt(s));
    }
  };
  std::vector<double> q, k, v(nx), dO(nx), beta(rows), bb(nx), ww(nx), S0(ns, 0.0), dST(ns, 0.0);
  unit_rows(q), unit_rows(k);
  for (auto& x : v) x = to_bf(nd(rng));
  for (auto& x : dO) x = to_bf(nd(rng));
  const std::vector<double> g = make_gates(rng, c.gates, B, T, H);
  for (auto& x : beta) x = static_cast<float>(1.0 / (1.0 + std::exp(-nd(rng))));
  for (auto& x : bb) x = to_bf(1.0 / (1.0 + std::exp(-nd(rng))));
  for (auto& x : ww) x = to_bf(1.0 / (1.0 + std::exp(-nd(rng))));
  if (c.with_state) {
    for (auto& x : S0) x = static_cast<float>(0.3 * nd(rng));
    for (auto& x : dST) x = static_cast<float>(0.3 * nd(rng));
  }
  gl::DeltaShape s;
  s.B = B, s.T = T, s.H = H, s.scale = 0.125;
  Dev<bf16> dq_(nx), dk_(nx), dv_(nx), o_(nx), q_(nx), k_(nx), v_(nx), dO_(nx), b_(nx), w_(nx), db_(nx), dw_(nx);
  Dev<float> g_(nx), dg_(nx), beta_(rows), dbeta_(rows), S0_(ns), S_(ns), dST_(ns), dS0_(ns);
  Dev<bf16> bound(gl::delta_boundary_bytes(s) / sizeof(bf16));
  q_.put(q), k_.put(k), v_.put(v), dO_.put(dO), g_.put(g), beta_.put(beta), b_.put(bb), w_.put(ww);
  S0_.put(S0), dST_.put(dST);
  for (auto* d : {&o_, &dq_, &dk_, &dv_, &db_, &dw_}) d->poison();
  for (auto* d : {&S_, &dg_, &dbeta_, &dS0_}) d->poison();
  gl::ChannelInputs in;
  in.q = q_.p, in.k = k_.p, in.v = v_.p, in.g = g_.p, in.beta = beta_.p, in.b = b_.p, in.w = w_.p;
  in.S0 = c.with_state ? S0_.p : nullptr;
  gl::ChannelGrads gr;
  gr.dq = dq_.p, gr.dk = dk_.p, gr.dv = dv_.p, gr.dg = dg_.p, gr.dbeta = dbeta_.p, gr.db = db_.p, gr.dw = dw_.p;
  gr.dS0 = dS0_.p;
  for (int r = 0; r < repeats; ++r) {  // repeats > 1: every run's outputs must be bit-identical
    if (r > 0) {
      for (auto* d : {&o_, &dq_, &dk_, &dv_, &db_, &dw_}) d->poison();
      for (auto* d : {&S_, &dg_, &dbeta_, &dS0_}) d->poison();
    }
    s.kernels.path = forced_path(c.fwd_path);
    gl::channel_fwd(c.m, s, in, o_.p, S_.p, bound.p, nullptr);
    s.kernels.path = forced_path(c.bwd_path);
    gl::channel_bwd(c.m, s, in, bound.p, dO_.p, c.with_state ? dST_.p : nullptr, gr, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name(c);
    if (raw) {
      Outputs now = {o_.get(), S_.get(), dq_.get(), dk_.get(), dv_.get(), dg_.get(), dbeta_.get(), db_.get(),
                     dw_.get(), dS0_.get()};
      if (r == 0) {
        *raw = now;
      } else {
        for (size_t i = 0; i < now.size(); ++i) {
          size_t diff = 0;
          for (size_t j = 0; j < now[i].size(); ++j)
            diff += std::memcmp(&now[i][j], &(*raw)[i][j], sizeof(double)) != 0;
          EXPECT_EQ(diff, 0u) << name(c) << ": output " << i << " differs between runs";
        }
      }
    }
  }

  // CPU reference, per (b, h)
  std::vector<double> ro(nx), rS(ns), rdq(nx), rdk(nx), rdv(nx), rdg(nx), rdbeta(rows), rdb(nx), rdw(nx), rdS0(ns);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      auto hq = head(q, b, h, D, T, H), hk = head(k, b, h, D, T, H), hv = head(v, b, h, D, T, H);
      auto hdo = head(dO, b, h, D, T, H), hg = head(g, b, h, D, T, H), hbeta = head(beta, b, h, 1, T, H);
      auto hb = head(bb, b, h, D, T, H), hw = head(ww, b, h, D, T, H);
      cl::MixerInputs<double> mi;
      mi.len = T, mi.dk = D, mi.dv = D, mi.q = hq.data(), mi.k = hk.data(), mi.v = hv.data(), mi.g = hg.data();
      mi.beta = hbeta.data(), mi.b = hb.data(), mi.w = hw.data(), mi.scale = 0.125;
      const size_t so = (static_cast<size_t>(b) * H + h) * D * D;
      std::vector<double> o(static_cast<size_t>(T) * D), dq(o.size()), dk(o.size()), dv(o.size()), dg(o.size()),
          dbe(T), db(o.size()), dw(o.size());
      cl::mixer_forward(cpu_mixer(c.m), mi, cl::Form::chunk, 64, &S0[so], o.data(), &rS[so]);
      cl::MixerGrads<double> mg;
      mg.dq = dq.data(), mg.dk = dk.data(), mg.dv = dv.data(), mg.dg = dg.data(), mg.dbeta = dbe.data();
      mg.db = db.data(), mg.dw = dw.data(), mg.dS0 = &rdS0[so];
      cl::mixer_backward(cpu_mixer(c.m), mi, cl::Form::chunk, 64, &S0[so], hdo.data(), &dST[so], mg);
      unhead(ro, o, b, h, D, T, H), unhead(rdq, dq, b, h, D, T, H), unhead(rdk, dk, b, h, D, T, H);
      unhead(rdv, dv, b, h, D, T, H), unhead(rdg, dg, b, h, D, T, H), unhead(rdbeta, dbe, b, h, 1, T, H);
      unhead(rdb, db, b, h, D, T, H), unhead(rdw, dw, b, h, D, T, H);
    }
  Errors e{};
  e.o = rel_rms(o_.get(), ro), e.S = rel_rms(S_.get(), rS), e.dq = rel_rms(dq_.get(), rdq);
  e.dk = rel_rms(dk_.get(), rdk), e.dv = rel_rms(dv_.get(), rdv), e.dg = rel_rms(dg_.get(), rdg);
  e.dS0 = rel_rms(dS0_.get(), rdS0);
  if (c.m == gl::ChannelMixer::kda) e.dbeta = rel_rms(dbeta_.get(), rdbeta);
  if (c.m == gl::ChannelMixer::gdn2) e.db = rel_rms(db_.get(), rdb), e.dw = rel_rms(dw_.get(), rdw);
  return e;
}

}  // namespace

// Exact at any decay: strong (−16 per token in a tenth of the channels) and extreme (−200, and
// channels with no decay at all) gates, both paths and across them, T not a multiple of 64,
// odd B·H, with and without a state. Every output must be finite and match the reference.
TEST(LinearChannelCuda, ExactAtAnyDecay) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  ASSERT_GT(devices, 0);
  std::mt19937_64 rng{std::random_device{}()};
  for (Gates gk : {Gates::strong, Gates::extreme})
    for (gl::ChannelMixer m : {gl::ChannelMixer::gla, gl::ChannelMixer::kda, gl::ChannelMixer::gdn2})
      for (Case c : {Case{m, 1, 333, 3, true, "fused", "fused"}, Case{m, 3, 200, 1, false, "chunked", "chunked"},
                     Case{m, 1, 150, 3, true, "chunked", "fused"}, Case{m, 1, 97, 1, true, "fused", "chunked"}}) {
        c.gates = gk;
        const Errors e = run_case(rng, c);
        std::printf("%s: o %.2e S %.2e dq %.2e dk %.2e dv %.2e dg %.2e dbeta %.2e db %.2e dw %.2e dS0 %.2e\n",
                    name(c).c_str(), e.o, e.S, e.dq, e.dk, e.dv, e.dg, e.dbeta, e.db, e.dw, e.dS0);
        EXPECT_LT(e.o, 5e-3) << name(c);  // (NaN fails every comparison)
        EXPECT_LT(e.S, 5e-3) << name(c);
        for (double x : {e.dq, e.dk, e.dv, e.dg, e.dbeta, e.db, e.dw, e.dS0}) EXPECT_LT(x, 1e-2) << name(c);
      }
}

TEST(LinearChannelCuda, MatchesCpuReference) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  ASSERT_GT(devices, 0);
  std::mt19937_64 rng{std::random_device{}()};
  for (gl::ChannelMixer m : {gl::ChannelMixer::gla, gl::ChannelMixer::kda, gl::ChannelMixer::gdn2})
    for (const char* path : {"fused", "chunked"})
      for (Case c : {Case{m, 2, 200, 4, true}, Case{m, 1, 100, 3, false}, Case{m, 1, 1, 2, true},
                     Case{m, 1, 700, 2, true}, Case{m, 1, 64, 1, true}, Case{m, 1, 1500, 2, true}}) {
      c.fwd_path = c.bwd_path = path;
      const Errors e = run_case(rng, c);
      std::printf("%s: o %.2e S %.2e dq %.2e dk %.2e dv %.2e dg %.2e dbeta %.2e db %.2e dw %.2e dS0 %.2e\n",
                  name(c).c_str(), e.o, e.S, e.dq, e.dk, e.dv, e.dg, e.dbeta, e.db, e.dw, e.dS0);
      EXPECT_LT(e.o, 5e-3) << name(c);
      EXPECT_LT(e.S, 5e-3) << name(c);
      for (double x : {e.dq, e.dk, e.dv, e.dg, e.dbeta, e.db, e.dw, e.dS0}) EXPECT_LT(x, 1e-2) << name(c);
    }
}

// Both paths write and read the same boundary states: a forward of one kind feeds a backward
// of the other.
TEST(LinearChannelCuda, PathsShareTheBoundaryStates) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  ASSERT_GT(devices, 0);
  std::mt19937_64 rng{std::random_device{}()};
  for (gl::ChannelMixer m : {gl::ChannelMixer::gla, gl::ChannelMixer::kda, gl::ChannelMixer::gdn2})
    for (Case c : {Case{m, 1, 333, 2, true, "chunked", "fused"}, Case{m, 2, 130, 1, false, "fused", "chunked"}}) {
      const Errors e = run_case(rng, c);
      std::printf("%s: o %.2e S %.2e dq %.2e dk %.2e dv %.2e dg %.2e dbeta %.2e db %.2e dw %.2e dS0 %.2e\n",
                  name(c).c_str(), e.o, e.S, e.dq, e.dk, e.dv, e.dg, e.dbeta, e.db, e.dw, e.dS0);
      EXPECT_LT(e.o, 5e-3) << name(c);
      EXPECT_LT(e.S, 5e-3) << name(c);
      for (double x : {e.dq, e.dk, e.dv, e.dg, e.dbeta, e.db, e.dw, e.dS0}) EXPECT_LT(x, 1e-2) << name(c);
    }
}

// No float atomics on either path: the same inputs give bit-identical outputs and gradients.
TEST(LinearChannelCuda, BitReproducible) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  ASSERT_GT(devices, 0);
  std::mt19937_64 rng{std::random_device{}()};
  for (gl::ChannelMixer m : {gl::ChannelMixer::gla, gl::ChannelMixer::kda, gl::ChannelMixer::gdn2})
    for (const char* path : {"fused", "chunked"}) {
      Case c{m, 2, 1000, 3, true, path, path};
      Outputs raw;
      const Errors e = run_case(rng, c, &raw, 3);
      EXPECT_LT(e.o, 5e-3) << name(c);
      EXPECT_LT(e.dk, 1e-2) << name(c);
    }
}

// The kernel keys' values are checked, naming the key: cuda.linear_path, cuda.ccq_fwd/bwd, cuda.ccq_group.
TEST(LinearChannelCuda, RejectsBadPathOverride) {
  const auto message = [](const char* path, const char* fwd, const char* bwd, int group) {
    try {
      (void)gl::kernel_choice(path, fwd, bwd, group);
    } catch (const lar::UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message("twophase", "auto", "auto", 0), "cuda.linear_path: 'twophase' is not one of auto, fused, chunked");
  EXPECT_EQ(message("auto", "fast", "auto", 0), "cuda.ccq_fwd: 'fast' is not one of auto, par, ws");
  EXPECT_EQ(message("auto", "auto", "seq", 0), "cuda.ccq_bwd: 'seq' is not one of auto, par, ws");
  EXPECT_EQ(message("auto", "auto", "auto", 65), "cuda.ccq_group: 65 is not from 0 to 64");
  EXPECT_EQ(message("", "", "", 0), "no error");
  const gl::KernelChoice c = gl::kernel_choice("chunked", "ws", "par", 8);
  EXPECT_EQ(c.path, gl::PathChoice::chunked);
  EXPECT_EQ(c.ccq_fwd, gl::CcqPath::ws);
  EXPECT_EQ(c.ccq_bwd, gl::CcqPath::par);
  EXPECT_EQ(c.ccq_group, 8);
}

TEST(LinearChannelCuda, RejectsMissingInputs) {
  gl::DeltaShape s;
  s.B = 1, s.T = 16, s.H = 1;
  gl::ChannelInputs in;
  in.q = in.k = in.v = reinterpret_cast<const bf16*>(16);
  in.g = reinterpret_cast<const float*>(16);
  try {
    gl::channel_fwd(gl::ChannelMixer::gdn2, s, in, reinterpret_cast<bf16*>(16), nullptr, nullptr, nullptr);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("gdn2 needs b and w"), std::string::npos) << e.what();
  }
}
