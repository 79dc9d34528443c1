// The channel-gated chunkwise kernels (kernels/channel_rule: gla, kda, gdn2) against the CPU
// reference (kernels/linear, fp64 chunk form) on fresh random inputs: relative RMS
// error ≤ 5e-3 on o and the final state, ≤ 1e-2 on every gradient (dq, dk, dv, dg and
// dβ / db, dw, dS0). Every GPU output is poisoned with NaN before the launches. Every case runs
// on both implementations (LAR_CHANNEL_PATH=fused / chunked, the two-phase path) and across
// them (a forward of one kind feeding a backward of the other: same boundary states).
// CARVE (kernels/carve/carve_cuda.hpp) against kernels/carve/carve.hpp with an
// initial state and a gradient on the final state, content gradient on and off, on the fused
// backward and the split one (chain pass + chunk pass; LAR_CHANNEL_PATH=fused / chunked).
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

#include "kernels/carve/carve.hpp"
#include "kernels/carve/carve_cuda.hpp"
#include "kernels/channel_rule/channel_rule.hpp"
#include "kernels/linear/mixers.hpp"
#include "tests/gpu/device_buffer.hpp"

namespace cl = lar::kernels::cpu::linear;
namespace gl = lar::kernels::cuda::linear;
using lar::gpu_test::bf16;

namespace {

// The path a case forces ("fused", "chunked", or "" / "auto": the cost model), as the run's
// cuda.linear_path.
gl::PathChoice forced_path(const char* path) { return gl::kernel_choice(path, "auto", "auto", 0).path; }

using lar::gpu_test::Dev;
using lar::gpu_test::rel_rms;
using lar::gpu_test::to_bf;

// Per-head slice of a [B,T,H,w] array into [T,w].
std::vector<double> head(const std::vector<double>& x, int b, int h, int w, int T, int H) {
  std::vector<double> out(static_cast<size_t>(T) * w);
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < w; ++i) out[static_cast<size_t>(t) * w + i] = x[((static_cast<size_t>(b) * T + t) * H + h) * w + i];
  return out;
}
void unhead(std::vector<double>& x, const std::vector<double>& part, int b, int h, int w, int T, int H) {
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < w; ++i) x[((static_cast<size_t>(b) * T + t) * H + h) * w + i] = part[static_cast<size_t>(t) * w + i];
}


// Per-channel log-decays [B,T,H,64]. Mild: mostly log(0.5..1)·0.3 per token, 5% of the
// elements ×4 (as a trained gate). Strong: a tenth of every head's channels draw log-decays
// down to −16 per token, the rest mild. Extreme: a tenth down to −200 per token, another
// tenth exactly 0 (no decay), the rest mild — in-chunk spans far beyond any fp32 exponent.
enum class Gates { mild, strong, extreme };
const char* gates_name(Gates g) { return g == Gates::mild ? "" : g == Gates::strong ? " strong-gates" : " extreme-gates"; }
std::vector<double> make_gates(std::mt19937_64& rng, Gates kind, int B, int T, int H) {
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  std::vector<int> cls(static_cast<size_t>(H) * 64, 0);  // per (h, c): 0 mild, 1 steep, 2 none
  if (kind != Gates::mild)
    for (auto& c : cls) {
      const double u = ud(rng);
      c = u < 0.1 ? 1 : (kind == Gates::extreme && u < 0.2) ? 2 : 0;
    }
  const double steep = kind == Gates::extreme ? 200.0 : 16.0;
  std::vector<double> g(static_cast<size_t>(B) * T * H * 64);
  for (size_t i = 0; i < g.size(); ++i) {
    const int hc = static_cast<int>(i % (static_cast<size_t>(H) * 64));
    const double mild = std::log(0.5 + 0.5 * ud(rng)) * (ud(rng) < 0.05 ? 4.0 : 0.3);
    g[i] = static_cast<float>(cls[hc] == 1 ? -steep * ud(rng) : cls[hc] == 2 ? 0.0 : mild);
  }
  return g;
}

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

// ---------------------------------------------------------------- CARVE
struct CarveCase {
  int B, T, H, rank;
  bool content_grad, with_state;
  const char* bwd_path = "fused";  // LAR_CHANNEL_PATH of the backward (the forward has one kernel)
  Gates gates = Gates::mild;
};
std::string name(const CarveCase& c) {
  return "carve B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) +
         " r=" + std::to_string(c.rank) + (c.content_grad ? "" : " no-content-grad") + (c.with_state ? " +state" : "") +
         gates_name(c.gates) + " [" + c.bwd_path + "]";
}
struct CarveErrors {
  double o, S, dq, dk, dv, dg, dbx, dw, dU1, dU2, dS0;
};

// cl::carve_backward with a gradient dST on the final state (the CPU reference starts from
// dS = 0): the same segment walk, from dST.
void carve_backward_ref(const cl::CarveInputs<double>& in, const double* dO, const double* dST,
                        const cl::CarveGrads<double>& gr, const cl::CarveCache<double>& cache) {
  const int dk = in.dk, dv = in.dv, L = in.content_chunk;
  const int nseg = cl::num_chunks(in.len, L);
  const size_t ss = static_cast<size_t>(dv) * dk;
  std::vector<size_t> boff(nseg + 1, 0);
  for (int c = 0; c < nseg; ++c)
    boff[c + 1] = boff[c] + static_cast<size_t>(cl::num_chunks(std::min(L, in.len - c * L), in.chunk)) * ss;
  std::vector<double> dS(dST, dST + ss), dS0(ss), dm(dv, 0.0), dOs, wfull, db, dwf, u(dk), h(in.rank), du(dk),
      dh(in.rank);
  for (int c = nseg - 1; c >= 0; --c) {
    const int start = c * L, n = std::min(L, in.len - start);
    dOs.assign(dO + static_cast<size_t>(start) * dv, dO + static_cast<size_t>(start + n) * dv);
    if (in.content_grad && c + 1 < nseg)
      for (int t = 0; t < n; ++t)
        for (int j = 0; j < dv; ++j) dOs[static_cast<size_t>(t) * dv + j] += dm[j] / L;
    wfull.resize(static_cast<size_t>(n) * dv);
    for (int t = 0; t < n; ++t) std::fill_n(&wfull[static_cast<size_t>(t) * dv], dv, in.w[start + t]);
    const double* b = &cache.b[static_cast<size_t>(start) * dk];
    auto mi = cl::detail::carve_segment(in, start, n, b, wfull);
    db.resize(static_cast<size_t>(n) * dk);
    dwf.resize(static_cast<size_t>(n) * dv);
    cl::MixerGrads<double> mg;
    mg.dq = gr.dq + static_cast<size_t>(start) * dk, mg.dk = gr.dk + static_cast<size_t>(start) * dk;
    mg.dv = gr.dv + static_cast<size_t>(start) * dv, mg.dg = gr.dg + static_cast<size_t>(start) * dk;
    mg.db = db.data(), mg.dw = dwf.data(), mg.dS0 = dS0.data();
    cl::mixer_backward(cl::Mixer::gdn2, mi, cl::Form::chunk, in.chunk, &cache.seg_S[c * ss], dOs.data(), dS.data(), mg,
                       &cache.bounds[boff[c]]);
    dS.swap(dS0);
    for (int t = 0; t < n; ++t) {
      double x = 0;
      for (int j = 0; j < dv; ++j) x += dwf[static_cast<size_t>(t) * dv + j];
      gr.dw[start + t] = x;
    }
    std::fill(du.begin(), du.end(), 0.0);
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < dk; ++i) {
        const double bb = b[static_cast<size_t>(t) * dk + i], x = db[static_cast<size_t>(t) * dk + i] * bb * (1 - bb);
        gr.dbx[static_cast<size_t>(start + t) * dk + i] = x;
        du[i] += x;
      }
    const double* m = &cache.seg_m[static_cast<size_t>(c) * dv];
    cl::detail::carve_content(in, m, u.data(), h.data());
    for (int r = 0; r < in.rank; ++r) {
      double x = 0;
      for (int i = 0; i < dk; ++i) {
        x += in.U2[static_cast<size_t>(i) * in.rank + r] * du[i];
        gr.dU2[static_cast<size_t>(i) * in.rank + r] += du[i] * h[r];
      }
      dh[r] = x * (1 - h[r] * h[r]);
    }
    std::fill(dm.begin(), dm.end(), 0.0);
    for (int r = 0; r < in.rank; ++r)
      for (int j = 0; j < dv; ++j) {
        gr.dU1[static_cast<size_t>(r) * dv + j] += dh[r] * m[j];
        dm[j] += in.U1[static_cast<size_t>(r) * dv + j] * dh[r];
      }
  }
  std::copy(dS.begin(), dS.end(), gr.dS0);
}

CarveErrors run_carve(std::mt19937_64& rng, const CarveCase& c, Outputs* raw = nullptr, int repeats = 1) {
  const int D = 64, B = c.B, T = c.T, H = c.H, r = c.rank;
  const size_t rows = static_cast<size_t>(B) * T * H, nx = rows * D, ns = static_cast<size_t>(B) * H * D * D;
  std::normal_distribution<double> nd(0.0, 1.0);
  auto unit_rows = [&](std::vector<double>& x) {
    x.resize(nx);
    for (size_t i = 0; i < rows; ++i) {
      double s = 0;
      for (int j = 0; j < D; ++j) s += (x[i * D + j] = nd(rng)) * x[i * D + j];
      for (int j = 0; j < D; ++j) x[i * D + j] = to_bf(x[i * D + j] / std::sqrt(s));
    }
  };
  std::vector<double> q, k, v(nx), dO(nx), bx(nx), w(rows), S0(ns, 0.0), dST(ns, 0.0);
  std::vector<double> U1(static_cast<size_t>(H) * r * D), U2(static_cast<size_t>(H) * D * r);
  unit_rows(q), unit_rows(k);
  for (auto& x : v) x = to_bf(nd(rng));
  for (auto& x : dO) x = to_bf(nd(rng));
  const std::vector<double> g = make_gates(rng, c.gates, B, T, H);
  for (auto& x : bx) x = to_bf(nd(rng));
  for (auto& x : w) x = static_cast<float>(1.0 / (1.0 + std::exp(-nd(rng))));
  for (auto& x : U1) x = static_cast<float>(3.0 * nd(rng));
  for (auto& x : U2) x = static_cast<float>(4.0 * nd(rng));  // strong enough to move o by a few percent
  if (c.with_state) {
    for (auto& x : S0) x = static_cast<float>(0.3 * nd(rng));
    for (auto& x : dST) x = static_cast<float>(0.3 * nd(rng));
  }
  gl::DeltaShape s;
  s.B = B, s.T = T, s.H = H, s.scale = 0.125;
  Dev<bf16> q_(nx), k_(nx), v_(nx), bx_(nx), dO_(nx), o_(nx), dq_(nx), dk_(nx), dv_(nx), dbx_(nx);
  Dev<float> g_(nx), w_(rows), U1_(U1.size()), U2_(U2.size()), S0_(ns), S_(ns), dST_(ns), dg_(nx), dw_(rows),
      dU1_(U1.size()), dU2_(U2.size()), dS0_(ns);
  Dev<bf16> bound(gl::delta_boundary_bytes(s) / sizeof(bf16));
  Dev<float> content(gl::carve_content_bytes(s) / sizeof(float));
  q_.put(q), k_.put(k), v_.put(v), bx_.put(bx), dO_.put(dO), g_.put(g), w_.put(w), U1_.put(U1), U2_.put(U2);
  S0_.put(S0), dST_.put(dST);
  gl::CarveInputs in;
  in.q = q_.p, in.k = k_.p, in.v = v_.p, in.g = g_.p, in.bx = bx_.p, in.w = w_.p, in.U1 = U1_.p, in.U2 = U2_.p;
  in.rank = r, in.content_grad = c.content_grad, in.S0 = c.with_state ? S0_.p : nullptr;
  gl::CarveGrads gr;
  gr.dq = dq_.p, gr.dk = dk_.p, gr.dv = dv_.p, gr.dbx = dbx_.p, gr.dg = dg_.p, gr.dw = dw_.p, gr.dU1 = dU1_.p;
  gr.dU2 = dU2_.p, gr.dS0 = dS0_.p;
  for (int rep = 0; rep < repeats; ++rep) {  // repeats > 1: every run's outputs must be bit-identical
    for (auto* d : {&o_, &dq_, &dk_, &dv_, &dbx_}) d->poison();
    for (auto* d : {&S_, &dg_, &dw_, &dU1_, &dU2_, &dS0_, &content}) d->poison();
    s.kernels.path = gl::PathChoice::automatic;
    gl::carve_fwd(s, in, o_.p, S_.p, bound.p, content.p, nullptr);
    s.kernels.path = forced_path(c.bwd_path);
    gl::carve_bwd(s, in, bound.p, content.p, dO_.p, c.with_state ? dST_.p : nullptr, gr, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name(c);
    if (raw) {
      Outputs now = {o_.get(), S_.get(), dq_.get(), dk_.get(), dv_.get(), dbx_.get(), dg_.get(),
                     dw_.get(), dU1_.get(), dU2_.get(), dS0_.get()};
      if (rep == 0) {
        *raw = now;
      } else {
        for (size_t i = 0; i < now.size(); ++i) {
          size_t diff = 0;
          for (size_t j = 0; j < now[i].size(); ++j) diff += std::memcmp(&now[i][j], &(*raw)[i][j], sizeof(double)) != 0;
          EXPECT_EQ(diff, 0u) << name(c) << ": output " << i << " differs between runs";
        }
      }
    }
  }

  std::vector<double> ro(nx), rS(ns), rdq(nx), rdk(nx), rdv(nx), rdg(nx), rdbx(nx), rdw(rows), rdU1(U1.size(), 0.0),
      rdU2(U2.size(), 0.0), rdS0(ns);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      auto hq = head(q, b, h, D, T, H), hk = head(k, b, h, D, T, H), hv = head(v, b, h, D, T, H);
      auto hg = head(g, b, h, D, T, H), hbx = head(bx, b, h, D, T, H), hw = head(w, b, h, 1, T, H);
      auto hdo = head(dO, b, h, D, T, H);
      cl::CarveInputs<double> ci;
      ci.len = T, ci.dk = D, ci.dv = D, ci.rank = r;
      ci.q = hq.data(), ci.k = hk.data(), ci.v = hv.data(), ci.g = hg.data(), ci.bx = hbx.data(), ci.w = hw.data();
      ci.U1 = &U1[static_cast<size_t>(h) * r * D], ci.U2 = &U2[static_cast<size_t>(h) * D * r];
      ci.content_chunk = 64, ci.chunk = 64, ci.scale = 0.125, ci.content_grad = c.content_grad;
      const size_t so = (static_cast<size_t>(b) * H + h) * D * D;
      cl::CarveState<double> st(D, D);
      std::copy(S0.begin() + static_cast<std::ptrdiff_t>(so), S0.begin() + static_cast<std::ptrdiff_t>(so + D * D),
                st.S.begin());
      cl::CarveCache<double> cache;
      std::vector<double> o(static_cast<size_t>(T) * D), dq(o.size()), dk(o.size()), dv(o.size()), dg(o.size()),
          dbxh(o.size()), dw(T);
      cl::carve_forward(ci, cl::Form::chunk, &st, o.data(), &cache);
      std::copy(st.S.begin(), st.S.end(), rS.begin() + static_cast<std::ptrdiff_t>(so));
      cl::CarveGrads<double> cg;
      cg.dq = dq.data(), cg.dk = dk.data(), cg.dv = dv.data(), cg.dg = dg.data(), cg.dbx = dbxh.data(), cg.dw = dw.data();
      cg.dU1 = &rdU1[static_cast<size_t>(h) * r * D], cg.dU2 = &rdU2[static_cast<size_t>(h) * D * r];
      cg.dS0 = &rdS0[so];
      carve_backward_ref(ci, hdo.data(), &dST[so], cg, cache);
      unhead(ro, o, b, h, D, T, H), unhead(rdq, dq, b, h, D, T, H), unhead(rdk, dk, b, h, D, T, H);
      unhead(rdv, dv, b, h, D, T, H), unhead(rdg, dg, b, h, D, T, H), unhead(rdbx, dbxh, b, h, D, T, H);
      unhead(rdw, dw, b, h, 1, T, H);
    }
  CarveErrors e{};
  e.o = rel_rms(o_.get(), ro), e.S = rel_rms(S_.get(), rS), e.dq = rel_rms(dq_.get(), rdq);
  e.dk = rel_rms(dk_.get(), rdk), e.dv = rel_rms(dv_.get(), rdv), e.dg = rel_rms(dg_.get(), rdg);
  e.dbx = rel_rms(dbx_.get(), rdbx), e.dw = rel_rms(dw_.get(), rdw), e.dU1 = rel_rms(dU1_.get(), rdU1);
  e.dU2 = rel_rms(dU2_.get(), rdU2), e.dS0 = rel_rms(dS0_.get(), rdS0);
  return e;
}
void expect_carve(const CarveCase& c, const CarveErrors& e) {
  std::printf("%s: o %.2e S %.2e dq %.2e dk %.2e dv %.2e dg %.2e dbx %.2e dw %.2e dU1 %.2e dU2 %.2e dS0 %.2e\n",
              name(c).c_str(), e.o, e.S, e.dq, e.dk, e.dv, e.dg, e.dbx, e.dw, e.dU1, e.dU2, e.dS0);
  EXPECT_LT(e.o, 5e-3) << name(c);
  EXPECT_LT(e.S, 5e-3) << name(c);
  for (double x : {e.dq, e.dk, e.dv, e.dg, e.dbx, e.dw, e.dS0}) EXPECT_LT(x, 1e-2) << name(c);
  // U1, U2 act from the second chunk on. With T = 65 that chunk has one token, so dU1 = dh mᵀ
  // rests on one token's dbx (rank one, like a T = 1 dq): measured 5.99e-3 and 1.24e-2 on two
  // draws; checked from T = 96 on.
  if (c.T >= 96) {
    EXPECT_LT(e.dU1, 1e-2) << name(c);
    EXPECT_LT(e.dU2, 1e-2) << name(c);
  }
}

}  // namespace

// CARVE on both backward paths: T not a multiple of 64 (incl. a one-token last chunk), an
// initial state and dS_T, content gradient on and off, ranks 5..32, B·H up to 6.
TEST(LinearChannelCuda, CarveMatchesCpuReference) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  ASSERT_GT(devices, 0);
  std::mt19937_64 rng{std::random_device{}()};
  for (const char* path : {"fused", "chunked"})
    for (CarveCase c : {CarveCase{1, 700, 2, 16, true, true}, CarveCase{2, 200, 3, 8, true, false},
                        CarveCase{1, 333, 2, 32, false, true}, CarveCase{1, 65, 2, 5, true, true},
                        CarveCase{2, 130, 1, 16, false, false}, CarveCase{1, 1500, 1, 16, true, true}}) {
      c.bwd_path = path;
      expect_carve(c, run_carve(rng, c));
    }
}

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
  for (Gates gk : {Gates::strong, Gates::extreme})
    for (const char* path : {"fused", "chunked"})
      for (CarveCase c : {CarveCase{1, 333, 3, 16, true, true}, CarveCase{3, 150, 1, 8, true, false}}) {
        c.bwd_path = path, c.gates = gk;
        expect_carve(c, run_carve(rng, c));
      }
}

// The split backward has no float atomics within a (b, h) either: three runs, bit-identical.
TEST(LinearChannelCuda, CarveSplitBitReproducible) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  ASSERT_GT(devices, 0);
  std::mt19937_64 rng{std::random_device{}()};
  CarveCase c{2, 1000, 3, 16, true, true, "chunked"};
  Outputs raw;
  expect_carve(c, run_carve(rng, c, &raw, 3));
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
