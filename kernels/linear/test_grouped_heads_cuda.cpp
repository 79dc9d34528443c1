// Value widths above 64 and grouped heads (kernels/linear/grouped_heads.hpp) against the
// CPU reference (kernels/linear, fp64 chunk form) run per value head with the q, k of its
// key head: relative RMS ≤ 5e-3 on o and the final state, ≤ 1e-2 on every gradient (dq, dk
// summed over the key head's group). Every mixer (linear as gla with a zero log-gate), value
// dims 64..512, groups of 1..4 value heads per key head, both channel paths, strong gates in
// some cases, and the recurrent decode token by token against the same reference; the head
// repeat and group sum the layer uses where the query is per value head.
#include <gtest/gtest.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/linear/mixers.hpp"
#include "kernels/linear/grouped_heads.hpp"
#include "tests/gpu/device_buffer.hpp"

namespace cl = lar::kernels::cpu::linear;
namespace gl = lar::kernels::cuda::linear;
using lar::gpu_test::bf16;
using lar::gpu_test::Dev;
using lar::gpu_test::rel_rms;
using lar::gpu_test::to_bf;

namespace {

struct GCase {
  cl::Mixer m;
  int B, T, Hk, H, dv;
  bool with_state;
  const char* path = "fused";  // channel mixers: cuda.linear_path
  bool strong = false;         // a tenth of the channels (gdn: of the heads) decay by up to 16 per token
};
std::string name(const GCase& c) {
  return std::string(cl::mixer_name(c.m)) + " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) +
         " Hk=" + std::to_string(c.Hk) + " H=" + std::to_string(c.H) + " dv=" + std::to_string(c.dv) +
         (c.with_state ? " +state" : "") + (c.strong ? " strong" : "") + " [" + c.path + "]";
}
bool channel(cl::Mixer m) { return m == cl::Mixer::linear || m == cl::Mixer::gla || m == cl::Mixer::kda || m == cl::Mixer::gdn2; }
gl::ChannelMixer channel_kind(cl::Mixer m) {
  return m == cl::Mixer::kda ? gl::ChannelMixer::kda : m == cl::Mixer::gdn2 ? gl::ChannelMixer::gdn2 : gl::ChannelMixer::gla;
}

// Rows [b, t, h, 0..w) of x [B,T,H,w] for one (b, h) as [T, w].
std::vector<double> slice(const std::vector<double>& x, int b, int h, int w, int T, int H) {
  std::vector<double> out(static_cast<size_t>(T) * w);
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < w; ++i) out[static_cast<size_t>(t) * w + i] = x[((static_cast<size_t>(b) * T + t) * H + h) * w + i];
  return out;
}
// x[b, t, h, :] (+)= part[t, :]
void unslice(std::vector<double>& x, const std::vector<double>& part, int b, int h, int w, int T, int H, bool add) {
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < w; ++i) {
      double& y = x[((static_cast<size_t>(b) * T + t) * H + h) * w + i];
      y = (add ? y : 0.0) + part[static_cast<size_t>(t) * w + i];
    }
}

struct Result {
  std::vector<std::pair<std::string, double>> err;  // name, rel RMS
};

Result run(std::mt19937_64& rng, const GCase& c) {
  const int B = c.B, T = c.T, Hk = c.Hk, H = c.H, dv = c.dv, D = 64, G = H / Hk;
  const bool ch = channel(c.m), gated = c.m != cl::Mixer::deltanet && c.m != cl::Mixer::linear;
  const bool scalar_g = c.m == cl::Mixer::gdn;
  const size_t nk = static_cast<size_t>(B) * T * Hk * D, nv = static_cast<size_t>(B) * T * H * dv,
               nh = static_cast<size_t>(B) * T * H, ng = scalar_g ? nh : nh * D, ns = static_cast<size_t>(B) * H * dv * D;
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  auto unit_rows = [&](std::vector<double>& x, size_t n) {
    x.resize(n);
    for (size_t r = 0; r < n / D; ++r) {
      double s = 0;
      for (int i = 0; i < D; ++i) s += (x[r * D + i] = nd(rng)) * x[r * D + i];
      for (int i = 0; i < D; ++i) x[r * D + i] = to_bf(x[r * D + i] / std::sqrt(s));
    }
  };
  std::vector<double> q, k, v(nv), dO(nv), g(ng, 0.0), beta(nh), bb(nh * D), ww(nv), S0(ns, 0.0), dST(ns, 0.0);
  unit_rows(q, nk), unit_rows(k, nk);
  for (auto& x : v) x = to_bf(nd(rng));
  for (auto& x : dO) x = to_bf(nd(rng));
  const int gw = scalar_g ? 1 : D;
  std::vector<bool> steep(static_cast<size_t>(H) * gw);
  for (size_t i = 0; i < steep.size(); ++i) steep[i] = c.strong && ud(rng) < 0.1;
  if (gated)
    for (size_t i = 0; i < ng; ++i)
      g[i] = static_cast<float>(steep[i % steep.size()] ? -16.0 * ud(rng)
                                                         : std::log(0.5 + 0.5 * ud(rng)) * (ud(rng) < 0.05 ? 4.0 : 0.3));
  for (auto& x : beta) x = static_cast<float>(1.0 / (1.0 + std::exp(-nd(rng))));
  for (auto& x : bb) x = to_bf(1.0 / (1.0 + std::exp(-nd(rng))));
  for (auto& x : ww) x = to_bf(1.0 / (1.0 + std::exp(-nd(rng))));
  if (c.with_state) {
    for (auto& x : S0) x = static_cast<float>(0.3 * nd(rng));
    for (auto& x : dST) x = static_cast<float>(0.3 * nd(rng));
  }

  gl::GroupedShape s;
  s.B = B, s.T = T, s.H = H, s.Hk = Hk, s.dk = D, s.dv = dv, s.scale = 0.125;
  Dev<bf16> q_(nk), k_(nk), v_(nv), dO_(nv), o_(nv), dq_(nk), dk_(nk), dv_(nv), b_(nh * D), w_(nv), db_(nh * D), dw_(nv);
  Dev<float> g_(ng), dg_(ng), beta_(nh), dbeta_(nh), S0_(ns), S_(ns), dST_(ns), dS0_(ns);
  Dev<bf16> bound(gl::grouped_boundary_bytes(s) / sizeof(bf16));
  q_.put(q), k_.put(k), v_.put(v), dO_.put(dO), g_.put(g), beta_.put(beta), b_.put(bb), w_.put(ww), S0_.put(S0),
      dST_.put(dST);
  for (auto* d : {&o_, &dq_, &dk_, &dv_, &db_, &dw_}) d->poison();
  for (auto* d : {&S_, &dg_, &dbeta_, &dS0_}) d->poison();
  const float* S0p = c.with_state ? S0_.p : nullptr;
  const float* dSTp = c.with_state ? dST_.p : nullptr;
  if (ch) {
    gl::ChannelInputs in;
    in.q = q_.p, in.k = k_.p, in.v = v_.p, in.g = g_.p, in.S0 = S0p;
    if (c.m == cl::Mixer::kda) in.beta = beta_.p;
    if (c.m == cl::Mixer::gdn2) in.b = b_.p, in.w = w_.p;
    gl::ChannelGrads gr;
    gr.dq = dq_.p, gr.dk = dk_.p, gr.dv = dv_.p, gr.dg = dg_.p, gr.dS0 = dS0_.p;
    if (c.m == cl::Mixer::kda) gr.dbeta = dbeta_.p;
    if (c.m == cl::Mixer::gdn2) gr.db = db_.p, gr.dw = dw_.p;
    s.kernels.path = gl::kernel_choice(c.path, "auto", "auto", 0).path;
    gl::grouped_channel_fwd(channel_kind(c.m), s, in, o_.p, S_.p, bound.p, nullptr);
    gl::grouped_channel_bwd(channel_kind(c.m), s, in, bound.p, dO_.p, dSTp, gr, nullptr);
  } else {
    const float* gp = gated ? g_.p : nullptr;
    gl::grouped_delta_fwd(s, q_.p, k_.p, v_.p, gp, beta_.p, S0p, o_.p, S_.p, bound.p, nullptr);
    gl::grouped_delta_bwd(s, q_.p, k_.p, v_.p, gp, beta_.p, bound.p, dO_.p, dSTp, dq_.p, dk_.p, dv_.p,
                          gated ? dg_.p : nullptr, dbeta_.p, dS0_.p, nullptr);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name(c);

  // the reference, per value head j with key head j / G
  std::vector<double> ro(nv), rS(ns), rdq(nk, 0.0), rdk(nk, 0.0), rdv(nv), rdg(ng), rdbeta(nh), rdb(nh * D), rdw(nv),
      rdS0(ns);
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < H; ++j) {
      const int hk = j / G;
      auto hq = slice(q, b, hk, D, T, Hk), hk_ = slice(k, b, hk, D, T, Hk), hv = slice(v, b, j, dv, T, H);
      auto hdo = slice(dO, b, j, dv, T, H), hg = slice(g, b, j, gw, T, H), hbeta = slice(beta, b, j, 1, T, H);
      auto hb = slice(bb, b, j, D, T, H), hw = slice(ww, b, j, dv, T, H);
      cl::MixerInputs<double> mi;
      mi.len = T, mi.dk = D, mi.dv = dv, mi.q = hq.data(), mi.k = hk_.data(), mi.v = hv.data();
      mi.g = gated ? hg.data() : nullptr, mi.beta = hbeta.data(), mi.b = hb.data(), mi.w = hw.data(), mi.scale = 0.125;
      const size_t so = (static_cast<size_t>(b) * H + j) * dv * D;
      std::vector<double> o(static_cast<size_t>(T) * dv), dq(static_cast<size_t>(T) * D), dk(dq.size()), dvv(o.size()),
          dg(static_cast<size_t>(T) * gw), dbe(T), db(dq.size()), dw(o.size());
      cl::mixer_forward(c.m, mi, cl::Form::chunk, 64, &S0[so], o.data(), &rS[so]);
      cl::MixerGrads<double> mg;
      mg.dq = dq.data(), mg.dk = dk.data(), mg.dv = dvv.data(), mg.dg = dg.data(), mg.dbeta = dbe.data();
      mg.db = db.data(), mg.dw = dw.data(), mg.dS0 = &rdS0[so];
      cl::mixer_backward(c.m, mi, cl::Form::chunk, 64, &S0[so], hdo.data(), &dST[so], mg);
      unslice(ro, o, b, j, dv, T, H, false), unslice(rdv, dvv, b, j, dv, T, H, false);
      unslice(rdq, dq, b, hk, D, T, Hk, true), unslice(rdk, dk, b, hk, D, T, Hk, true);
      unslice(rdg, dg, b, j, gw, T, H, false), unslice(rdbeta, dbe, b, j, 1, T, H, false);
      unslice(rdb, db, b, j, D, T, H, false), unslice(rdw, dw, b, j, dv, T, H, false);
    }
  Result r;
  r.err = {{"o", rel_rms(o_.get(), ro)},   {"S", rel_rms(S_.get(), rS)},   {"dq", rel_rms(dq_.get(), rdq)},
           {"dk", rel_rms(dk_.get(), rdk)}, {"dv", rel_rms(dv_.get(), rdv)}, {"dS0", rel_rms(dS0_.get(), rdS0)}};
  if (gated) r.err.push_back({"dg", rel_rms(dg_.get(), rdg)});
  if (cl::uses_beta(c.m)) r.err.push_back({"dbeta", rel_rms(dbeta_.get(), rdbeta)});
  if (c.m == cl::Mixer::gdn2) r.err.push_back({"db", rel_rms(db_.get(), rdb)}), r.err.push_back({"dw", rel_rms(dw_.get(), rdw)});

  // decode: every token in turn from S0, against the same reference outputs and final state
  {
    const size_t tk = static_cast<size_t>(B) * Hk * D, tv = static_cast<size_t>(B) * H * dv, th = static_cast<size_t>(B) * H;
    Dev<bf16> qt(tk), kt(tk), vt(tv), ot(tv), bt(th * D), wt(tv);
    Dev<float> gt(scalar_g ? th : th * D), betat(th), Sd(ns);
    Sd.put(S0);
    std::vector<double> od(nv);
    auto at = [&](const std::vector<double>& x, int t, int heads, int w) {
      std::vector<double> y(static_cast<size_t>(B) * heads * w);
      for (int b = 0; b < B; ++b)
        for (int i = 0; i < heads * w; ++i)
          y[static_cast<size_t>(b) * heads * w + i] = x[(static_cast<size_t>(b) * T + t) * heads * w + i];
      return y;
    };
    for (int t = 0; t < T; ++t) {
      qt.put(at(q, t, Hk, D)), kt.put(at(k, t, Hk, D)), vt.put(at(v, t, H, dv)), betat.put(at(beta, t, H, 1));
      gt.put(at(g, t, H, gw)), bt.put(at(bb, t, H, D)), wt.put(at(ww, t, H, dv));
      gl::GroupedShape sd = s;
      sd.T = 1;
      if (ch) {
        gl::ChannelInputs in;
        in.q = qt.p, in.k = kt.p, in.v = vt.p, in.g = gt.p;
        if (c.m == cl::Mixer::kda) in.beta = betat.p;
        if (c.m == cl::Mixer::gdn2) in.b = bt.p, in.w = wt.p;
        gl::grouped_channel_decode(channel_kind(c.m), sd, in, Sd.p, ot.p, nullptr);
      } else {
        gl::grouped_delta_decode(sd, qt.p, kt.p, vt.p, gated ? gt.p : nullptr, betat.p, Sd.p, ot.p, nullptr);
      }
      const auto o1 = ot.get();
      for (int b = 0; b < B; ++b)
        for (int i = 0; i < H * dv; ++i)
          od[(static_cast<size_t>(b) * T + t) * H * dv + i] = o1[static_cast<size_t>(b) * H * dv + i];
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name(c);
    r.err.push_back({"decode o", rel_rms(od, ro)});
    r.err.push_back({"decode S", rel_rms(Sd.get(), rS)});
  }
  return r;
}

void check(const GCase& c, const Result& r) {
  std::string line = name(c) + ":";
  for (const auto& [n, e] : r.err) {
    char buf[64];
    std::snprintf(buf, sizeof buf, " %s %.2e", n.c_str(), e);
    line += buf;
    const bool value = n == "o" || n == "S" || n == "decode o" || n == "decode S";
    EXPECT_LT(e, value ? 5e-3 : 1e-2) << name(c) << ": " << n;
  }
  std::printf("%s\n", line.c_str());
}

}  // namespace

TEST(LinearGroupedCuda, MatchesCpuReference) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  ASSERT_GT(devices, 0);
  std::mt19937_64 rng{std::random_device{}()};
  for (cl::Mixer m : {cl::Mixer::linear, cl::Mixer::gla, cl::Mixer::deltanet, cl::Mixer::gdn, cl::Mixer::kda,
                      cl::Mixer::gdn2})
    for (GCase c : {GCase{m, 2, 150, 2, 4, 128, true}, GCase{m, 1, 100, 1, 3, 256, false, "chunked"},
                    GCase{m, 1, 70, 2, 2, 512, true, "fused", true}, GCase{m, 1, 97, 1, 4, 64, true, "chunked", true},
                    GCase{m, 3, 65, 1, 1, 128, false}}) {
      check(c, run(rng, c));
    }
}

TEST(LinearGroupedCuda, RejectsUnsupportedShapes) {
  gl::GroupedShape s;
  s.B = 1, s.T = 16, s.H = 3, s.Hk = 2, s.dv = 64;
  try {
    gl::grouped_boundary_bytes(s);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("3 value heads are not a multiple of 2 key heads"), std::string::npos) << e.what();
  }
  s.H = 2, s.Hk = 1, s.dk = 96;
  try {
    gl::grouped_boundary_bytes(s);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("key dim dk=96 (supported: 64, 128, 256; gla: 64·n up to 512 through the key-block split)"), std::string::npos) << e.what();
  }
  s.dk = 64, s.dv = 96;
  try {
    gl::grouped_boundary_bytes(s);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("value dim dv=96 (supported: multiples of 64)"), std::string::npos) << e.what();
  }
}

// repeat_heads and sum_head_groups (the layer's passes over q, k repeated per group): exact
// copies, and the fixed-order fp32 sums of each group's heads (bf16 rounded once) against the
// host, at the layer's head widths 64 and 128 and groups of 1, 2 and 3.
TEST(LinearGroupedCuda, RepeatAndSumHeadGroups) {
  std::mt19937_64 rng(5);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (const auto& [rows, Hk, G, w] : {std::tuple{37, 2, 2, 64}, std::tuple{5, 1, 3, 128}, std::tuple{9, 3, 1, 64}}) {
    const std::string what = "rows=" + std::to_string(rows) + " Hk=" + std::to_string(Hk) + " G=" + std::to_string(G) +
                             " w=" + std::to_string(w);
    const size_t nk = static_cast<size_t>(rows) * Hk * w, nv = nk * G;
    std::vector<double> src(nk), grad(nv);
    for (auto& e : src) e = to_bf(nd(rng));
    for (auto& e : grad) e = to_bf(nd(rng));
    Dev<bf16> s(nk), r(nv), gb(nv), sb(nk);
    Dev<float> gf(nv), sf(nk);
    s.put(src);
    gb.put(grad);
    gf.put(grad);
    r.poison(), sb.poison(), sf.poison();
    gl::repeat_heads(s.p, r.p, rows, Hk, G, w, nullptr);
    gl::sum_head_groups(gf.p, sf.p, rows, Hk, G, w, nullptr);
    gl::sum_head_groups(gb.p, sb.p, rows, Hk, G, w, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    const auto rep = r.get(), sumf = sf.get(), sumb = sb.get();
    for (int n = 0; n < rows; ++n)
      for (int j = 0; j < Hk; ++j)
        for (int c = 0; c < w; ++c) {
          const size_t k = (static_cast<size_t>(n) * Hk + j) * w + c;
          double sum = 0;
          for (int u = 0; u < G; ++u) {
            const size_t v = ((static_cast<size_t>(n) * Hk + j) * G + u) * w + c;
            ASSERT_EQ(rep[v], src[k]) << what << " row " << n << " head " << j * G + u << " channel " << c;
            sum += static_cast<float>(grad[v]);
          }
          ASSERT_NEAR(sumf[k], sum, 1e-6 * (1 + std::abs(sum))) << what;
          ASSERT_EQ(sumb[k], to_bf(static_cast<float>(sumf[k]))) << what;
        }
  }
}
