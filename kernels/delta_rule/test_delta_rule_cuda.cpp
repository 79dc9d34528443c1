// The chunkwise gated delta rule kernels (kernels/delta_rule: gdn, and deltanet without
// gates) against the CPU reference (kernels/linear, fp64 chunk form) on fresh random
// inputs: relative RMS error ≤ 5e-3 on o and the final state, ≤ 1e-2 on every gradient
// (dq, dk, dv, dg, dβ, dS0); the decode kernel stepped token by token agrees with the
// chunk forward. Every GPU output is poisoned with NaN before the launches.
#include <gtest/gtest.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/delta_rule/delta_rule.hpp"
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

struct Case {
  int B, T, H;
  bool gated, with_state;
  double corr = 0.0;  // keys share a common direction with this weight (cosine ≈ corr²), β ≥ 0.5
};

// Random inputs in [B,T,H,*] layout, already rounded to what the GPU sees.
struct Inputs {
  int B, T, H;
  std::vector<double> q, k, v, g, beta, S0, dO, dST;
};

Inputs make_inputs(std::mt19937_64& rng, const Case& c) {
  const int D = 64;
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  Inputs in{c.B, c.T, c.H, {}, {}, {}, {}, {}, {}, {}, {}};
  const size_t rows = static_cast<size_t>(c.B) * c.T * c.H;
  std::vector<double> common(D);
  for (auto& x : common) x = nd(rng);
  auto unit_rows = [&](std::vector<double>& x, double corr) {  // L2-normalised like the layer's q, k
    x.resize(rows * D);
    for (size_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int i = 0; i < D; ++i) {
        x[r * D + i] = corr * common[i] + std::sqrt(1.0 - corr * corr) * nd(rng);
        s += x[r * D + i] * x[r * D + i];
      }
      for (int i = 0; i < D; ++i) x[r * D + i] = to_bf(x[r * D + i] / std::sqrt(s));
    }
  };
  unit_rows(in.q, 0.0);
  unit_rows(in.k, c.corr);
  in.v.resize(rows * D);
  in.dO.resize(rows * D);
  for (auto& x : in.v) x = to_bf(nd(rng));
  for (auto& x : in.dO) x = to_bf(nd(rng));
  in.beta.resize(rows);
  for (auto& x : in.beta) {
    x = 1.0 / (1.0 + std::exp(-nd(rng)));
    if (c.corr > 0) x = 0.5 + 0.5 * x;  // strong updates of correlated keys: the hard case of the solve
    x = static_cast<float>(x);
  }
  if (c.gated) {
    in.g.resize(rows);
    // log-sigmoid-like decays: mostly mild, some strong
    for (auto& x : in.g) x = static_cast<float>(std::log(0.5 + 0.5 * ud(rng)) * (ud(rng) < 0.1 ? 8.0 : 0.3));
  }
  const size_t ns = static_cast<size_t>(c.B) * c.H * D * D;
  in.S0.assign(ns, 0.0);
  in.dST.assign(ns, 0.0);
  if (c.with_state) {
    for (auto& x : in.S0) x = static_cast<float>(0.3 * nd(rng));
    for (auto& x : in.dST) x = static_cast<float>(0.3 * nd(rng));
  }
  return in;
}

// Per-head slice of a [B,T,H,w] array into [T,w].
std::vector<double> head(const std::vector<double>& x, const Inputs& in, int b, int h, int w) {
  std::vector<double> out(static_cast<size_t>(in.T) * w);
  for (int t = 0; t < in.T; ++t)
    for (int i = 0; i < w; ++i) out[static_cast<size_t>(t) * w + i] = x[((static_cast<size_t>(b) * in.T + t) * in.H + h) * w + i];
  return out;
}
void unhead(std::vector<double>& x, const std::vector<double>& part, const Inputs& in, int b, int h, int w) {
  for (int t = 0; t < in.T; ++t)
    for (int i = 0; i < w; ++i) x[((static_cast<size_t>(b) * in.T + t) * in.H + h) * w + i] = part[static_cast<size_t>(t) * w + i];
}

struct Ref {
  std::vector<double> o, S, dq, dk, dv, dg, dbeta, dS0;
};

Ref reference(const Inputs& in, bool gated) {
  const int D = 64;
  const size_t rows = static_cast<size_t>(in.B) * in.T * in.H, ss = D * D;
  Ref r;
  r.o.resize(rows * D), r.dq.resize(rows * D), r.dk.resize(rows * D), r.dv.resize(rows * D);
  r.dg.assign(rows, 0.0), r.dbeta.resize(rows);
  r.S.resize(in.S0.size()), r.dS0.resize(in.S0.size());
  for (int b = 0; b < in.B; ++b)
    for (int h = 0; h < in.H; ++h) {
      auto q = head(in.q, in, b, h, D), k = head(in.k, in, b, h, D), v = head(in.v, in, b, h, D);
      auto dO = head(in.dO, in, b, h, D), beta = head(in.beta, in, b, h, 1);
      std::vector<double> g = gated ? head(in.g, in, b, h, 1) : std::vector<double>();
      cl::MixerInputs<double> mi;
      mi.len = in.T, mi.dk = D, mi.dv = D;
      mi.q = q.data(), mi.k = k.data(), mi.v = v.data(), mi.beta = beta.data();
      mi.g = gated ? g.data() : nullptr;
      mi.scale = 0.125;
      const cl::Mixer m = gated ? cl::Mixer::gdn : cl::Mixer::deltanet;
      const size_t so = (static_cast<size_t>(b) * in.H + h) * ss;
      std::vector<double> o(static_cast<size_t>(in.T) * D);
      cl::mixer_forward(m, mi, cl::Form::chunk, 64, &in.S0[so], o.data(), &r.S[so]);
      unhead(r.o, o, in, b, h, D);
      std::vector<double> dq(o.size()), dk(o.size()), dv(o.size()), dg(in.T), db(in.T);
      cl::MixerGrads<double> gr;
      gr.dq = dq.data(), gr.dk = dk.data(), gr.dv = dv.data(), gr.dbeta = db.data();
      gr.dg = gated ? dg.data() : nullptr;
      gr.dS0 = &r.dS0[so];
      cl::mixer_backward(m, mi, cl::Form::chunk, 64, &in.S0[so], dO.data(), &in.dST[so], gr);
      unhead(r.dq, dq, in, b, h, D), unhead(r.dk, dk, in, b, h, D), unhead(r.dv, dv, in, b, h, D);
      unhead(r.dbeta, db, in, b, h, 1);
      if (gated) unhead(r.dg, dg, in, b, h, 1);
    }
  return r;
}

using lar::gpu_test::forced_path;

// The device side of one case: inputs uploaded, every output poisoned with NaN.
struct Buffers {
  gl::DeltaShape s;
  Dev<bf16> q, k, v, o, dO, dq, dk, dv, bound;
  Dev<float> g, beta, dg, dbeta, S0, S, dST, dS0;
  explicit Buffers(const Inputs& in)
      : s{shape(in)},
        q(in.q.size()), k(in.q.size()), v(in.q.size()), o(in.q.size()), dO(in.q.size()), dq(in.q.size()),
        dk(in.q.size()), dv(in.q.size()), bound(gl::delta_boundary_bytes(s) / sizeof(bf16)),
        g(in.beta.size()), beta(in.beta.size()), dg(in.beta.size()), dbeta(in.beta.size()), S0(in.S0.size()),
        S(in.S0.size()), dST(in.S0.size()), dS0(in.S0.size()) {
    q.put(in.q), k.put(in.k), v.put(in.v), dO.put(in.dO), beta.put(in.beta), S0.put(in.S0), dST.put(in.dST);
    if (!in.g.empty()) g.put(in.g);
    o.poison(), S.poison(), bound.poison();
    poison_grads();
  }
  void poison_grads() { dq.poison(), dk.poison(), dv.poison(), dg.poison(), dbeta.poison(), dS0.poison(); }
  static gl::DeltaShape shape(const Inputs& in) {
    gl::DeltaShape s;
    s.B = in.B, s.T = in.T, s.H = in.H, s.scale = 0.125;
    return s;
  }
};

std::string name(const Case& c) {
  return std::string(c.gated ? "gdn" : "deltanet") + " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) +
         " H=" + std::to_string(c.H) + (c.with_state ? " +state" : "") + (c.corr > 0 ? " corr" : "");
}

}  // namespace

// Both implementations (kernels/delta_rule/delta_rule.cu picks one per pass from the shape;
// the run's cuda.linear_path forces it): the fused one-CTA-per-(b, h) kernels (T⁻¹ = (I + diag(β) Aw)⁻¹
// built on tensor cores, applied by GEMM) and the two-phase path (chunk-parallel prep that
// builds T⁻¹ the same way, sequential state pass, chunk-parallel main kernel that loads T⁻¹ from
// the prep). The "corr" cases give
// the keys a common direction and β ≥ 0.5, where T⁻¹ is far from the identity: gdn at cosine
// ≈ 0.8, deltanet (no decay, the longest memory) at ≈ 0.5 — at 0.8 its dβ measured 8.3–8.8e-3
// fused and 5.8–7.0e-3 on the fp32-substitution path, too close to the 1e-2 limit for a test
// on fresh random inputs.
TEST(LinearDeltaCuda, MatchesCpuReference) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  ASSERT_GT(devices, 0);
  std::mt19937_64 rng{std::random_device{}()};
  // The one-token case has 16 (b, h) rows, not 2: its dg is one sum per row, often near zero,
  // and a relative RMS over only two of them read 4.1e-2 once in six runs (1e-3–8e-3 otherwise).
  for (const char* path : {"chunked", "fused"}) {
    for (const Case& c : {Case{2, 200, 4, true, true}, Case{1, 100, 3, true, false}, Case{2, 64, 2, false, false},
                          Case{1, 333, 2, false, true}, Case{2, 1, 8, true, true}, Case{1, 1000, 2, true, true},
                          Case{3, 129, 1, true, false}, Case{2, 256, 2, true, true, 0.9},
                          Case{1, 200, 2, false, false, 0.7}}) {
      const Inputs in = make_inputs(rng, c);
      Buffers d(in);
      d.s.kernels.path = forced_path(path);
      auto& [s, q, k, v, o, dO, dq, dk, dv, bound, g, beta, dg, dbeta, S0, S, dST, dS0] = d;
      const float* gp = c.gated ? g.p : nullptr;
      gl::delta_fwd(s, q.p, k.p, v.p, gp, beta.p, c.with_state ? S0.p : nullptr, o.p, S.p, bound.p, nullptr);
      gl::delta_bwd(s, q.p, k.p, v.p, gp, beta.p, bound.p, dO.p, c.with_state ? dST.p : nullptr, dq.p, dk.p, dv.p,
                    c.gated ? dg.p : nullptr, dbeta.p, dS0.p, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << path << " " << name(c);
      const Ref r = reference(in, c.gated);
      const double eo = rel_rms(o.get(), r.o), eS = rel_rms(S.get(), r.S), edq = rel_rms(dq.get(), r.dq),
                   edk = rel_rms(dk.get(), r.dk), edv = rel_rms(dv.get(), r.dv), edb = rel_rms(dbeta.get(), r.dbeta),
                   edS = rel_rms(dS0.get(), r.dS0), edg = c.gated ? rel_rms(dg.get(), r.dg) : 0.0;
      const std::string what = std::string(path) + " " + name(c);
      std::printf("%s: o %.2e S %.2e dq %.2e dk %.2e dv %.2e dg %.2e dbeta %.2e dS0 %.2e\n", what.c_str(), eo, eS,
                  edq, edk, edv, edg, edb, edS);
      EXPECT_LT(eo, 5e-3) << what;
      EXPECT_LT(eS, 5e-3) << what;
      EXPECT_LT(edq, 1e-2) << what;
      EXPECT_LT(edk, 1e-2) << what;
      EXPECT_LT(edv, 1e-2) << what;
      EXPECT_LT(edg, 1e-2) << what;
      EXPECT_LT(edb, 1e-2) << what;
      EXPECT_LT(edS, 1e-2) << what;
    }
  }
}

// Both implementations are deterministic: the same backward twice gives the same bits (the
// gate gradients' partial sums go through fixed shared-memory slots, no atomics), which
// `deterministic: true` training relies on.
TEST(LinearDeltaCuda, BackwardIsBitReproducible) {
  std::mt19937_64 rng{std::random_device{}()};
  for (const char* path : {"chunked", "fused"}) {
    const Inputs in = make_inputs(rng, Case{2, 300, 3, true, true});
    Buffers d(in);
    d.s.kernels.path = forced_path(path);
    auto& [s, q, k, v, o, dO, dq, dk, dv, bound, g, beta, dg, dbeta, S0, S, dST, dS0] = d;
    gl::delta_fwd(s, q.p, k.p, v.p, g.p, beta.p, S0.p, o.p, S.p, bound.p, nullptr);
    std::vector<std::vector<double>> first;
    for (int run = 0; run < 2; ++run) {
      d.poison_grads();
      gl::delta_bwd(s, q.p, k.p, v.p, g.p, beta.p, bound.p, dO.p, dST.p, dq.p, dk.p, dv.p, dg.p, dbeta.p, dS0.p,
                    nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << path;
      std::vector<std::vector<double>> out = {dq.get(), dk.get(), dv.get(), dg.get(), dbeta.get(), dS0.get()};
      if (run == 0) {
        first = std::move(out);
        continue;
      }
      const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "dS0"};
      for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], first[i]) << path << " " << names[i];
    }
  }
}

// A path the kernels do not know is refused, naming the run's key.
TEST(LinearDeltaCuda, RejectsBadPathSetting) {
  try {
    (void)gl::kernel_choice("fastest", "auto", "auto", 0);
    FAIL() << "no error";
  } catch (const lar::UserError& e) {
    EXPECT_STREQ(e.what(), "cuda.linear_path: 'fastest' is not one of auto, fused, chunked");
  }
}

// The decode kernel, stepped token by token from S0, agrees with the chunk forward (outputs
// and final state) and with the CPU recurrence.
TEST(LinearDeltaCuda, DecodeMatchesChunk) {
  std::mt19937_64 rng{std::random_device{}()};
  for (bool gated : {true, false}) {
    const Case c{2, 150, 3, gated, true};
    const Inputs in = make_inputs(rng, c);
    gl::DeltaShape s;
    s.B = c.B, s.T = c.T, s.H = c.H, s.scale = 0.125;
    const size_t nx = in.q.size(), nr = in.beta.size(), ns = in.S0.size();
    Dev<bf16> q(nx), k(nx), v(nx), o(nx);
    Dev<float> g(nr), beta(nr), S0(ns), S(ns);
    q.put(in.q), k.put(in.k), v.put(in.v), beta.put(in.beta), S0.put(in.S0);
    if (gated) g.put(in.g);
    o.poison(), S.poison();
    gl::delta_fwd(s, q.p, k.p, v.p, gated ? g.p : nullptr, beta.p, S0.p, o.p, S.p, nullptr, nullptr);
    // decode: per token, gather [B,H,*] slices
    const int BH = c.B * c.H, D = 64;
    Dev<bf16> qt(BH * D), kt(BH * D), vt(BH * D), ot(BH * D);
    Dev<float> gt(BH), bt(BH), Sd(ns);
    Sd.put(in.S0);
    std::vector<double> od(nx);
    for (int t = 0; t < c.T; ++t) {
      std::vector<double> a(BH * D), bb(BH * D), cc(BH * D), gg(BH), be(BH);
      for (int b = 0; b < c.B; ++b)
        for (int h = 0; h < c.H; ++h) {
          const size_t src = (static_cast<size_t>(b) * c.T + t) * c.H + h, dst = static_cast<size_t>(b) * c.H + h;
          for (int i = 0; i < D; ++i) {
            a[dst * D + i] = in.q[src * D + i];
            bb[dst * D + i] = in.k[src * D + i];
            cc[dst * D + i] = in.v[src * D + i];
          }
          gg[dst] = gated ? in.g[src] : 0.0;
          be[dst] = in.beta[src];
        }
      qt.put(a), kt.put(bb), vt.put(cc), gt.put(gg), bt.put(be);
      ot.poison();
      gl::delta_decode(s, qt.p, kt.p, vt.p, gated ? gt.p : nullptr, bt.p, Sd.p, ot.p, nullptr);
      const auto y = ot.get();
      for (int b = 0; b < c.B; ++b)
        for (int h = 0; h < c.H; ++h)
          for (int i = 0; i < D; ++i)
            od[((static_cast<size_t>(b) * c.T + t) * c.H + h) * D + i] = y[(static_cast<size_t>(b) * c.H + h) * D + i];
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Ref r = reference(in, gated);
    const double e_chunk = rel_rms(od, o.get()), e_state = rel_rms(Sd.get(), S.get());
    const double e_ref = rel_rms(od, r.o), e_sref = rel_rms(Sd.get(), r.S);
    std::printf("decode %s: vs chunk o %.2e S %.2e; vs CPU o %.2e S %.2e\n", gated ? "gdn" : "deltanet", e_chunk,
                e_state, e_ref, e_sref);
    EXPECT_LT(e_chunk, 5e-3);
    EXPECT_LT(e_state, 5e-3);
    EXPECT_LT(e_ref, 5e-3);
    EXPECT_LT(e_sref, 1e-4);  // fp32 state, exact bf16 inputs
  }
}

TEST(LinearDeltaCuda, RejectsBadShapes) {
  gl::DeltaShape s;
  s.B = 1, s.T = 16, s.H = 2, s.dk = 128;
  try {
    gl::delta_fwd(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("dk=128"), std::string::npos) << e.what();
  }
  s.dk = 64, s.T = 0;
  try {
    gl::delta_fwd(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("T=0"), std::string::npos) << e.what();
  }
}

