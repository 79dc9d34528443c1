// fp64 finite-difference checks of every CPU backend op's backward, and forward checks
// against naive references.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "grad_check.hpp"
#include "kernels/cpu/cpu_backend.hpp"

using namespace lar;
using kernels::DType;
using kernels::Tensor;
using test::check_grad;
using test::random_vec;

namespace {

Tensor T64(std::vector<double>& v, std::initializer_list<int64_t> shape) { return Tensor(v.data(), DType::f64, shape); }
Tensor I32(std::vector<int32_t>& v, std::initializer_list<int64_t> shape) { return Tensor(v.data(), DType::i32, shape); }

struct Kernels : ::testing::Test {
  kernels::cpu::CpuBackend<double> be{2};
};

TEST_F(Kernels, GemmAllTransposesMatchNaive) {
  const int M = 5, N = 7, K = 3;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      auto a = random_vec(M * K, 1), b = random_vec(K * N, 2), c = random_vec(M * N, 3);
      auto c0 = c;
      be.gemm(ta ? T64(a, {K, M}) : T64(a, {M, K}), ta, tb ? T64(b, {N, K}) : T64(b, {K, N}), tb, T64(c, {M, N}), 2.0,
              0.5);
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
          double s = 0;
          for (int k = 0; k < K; ++k) s += (ta ? a[k * M + i] : a[i * K + k]) * (tb ? b[j * K + k] : b[k * N + j]);
          EXPECT_NEAR(c[i * N + j], 2.0 * s + 0.5 * c0[i * N + j], 1e-12) << ta << tb;
        }
    }
}

TEST_F(Kernels, GemmSplitAcrossThreadsMatchesSingleCall) {
  // Large enough to be split across threads; both split directions.
  for (auto [M, N] : {std::pair{200, 64}, std::pair{64, 200}}) {
    const int K = 48;
    auto a = random_vec(M * K, 4), b = random_vec(N * K, 5);
    std::vector<double> c(M * N), ref(M * N);
    be.gemm(T64(a, {M, K}), false, T64(b, {N, K}), true, T64(c, {M, N}));
    kernels::cpu::gemm_raw<double>(false, true, M, N, K, 1.0, a.data(), K, b.data(), K, 0.0, ref.data(), N);
    for (int i = 0; i < M * N; ++i) ASSERT_NEAR(c[i], ref[i], 1e-12);
  }
}

TEST_F(Kernels, RmsNormForwardAndGradients) {
  const int n = 5, d = 8;
  auto x = random_vec(n * d, 10), w = random_vec(d, 11), G = random_vec(n * d, 12);
  std::vector<double> y(n * d), rstd(n);
  auto loss = [&] {
    be.rmsnorm_fwd(T64(x, {n, d}), T64(w, {d}), T64(y, {n, d}), T64(rstd, {n}), 1e-5);
    return test::dot(G, y.data());
  };
  loss();
  double ms = 0;
  for (int c = 0; c < d; ++c) ms += x[c] * x[c];
  EXPECT_NEAR(y[3], x[3] / std::sqrt(ms / d + 1e-5) * w[3], 1e-12);
  std::vector<double> dx(n * d, 0.0), dw(d, 0.0);
  be.rmsnorm_bwd(T64(x, {n, d}), T64(w, {d}), T64(rstd, {n}), T64(G, {n, d}), T64(dx, {n, d}), T64(dw, {d}));
  check_grad("x", x.data(), x.size(), dx, loss);
  check_grad("w", w.data(), w.size(), dw, loss);
  // dx accumulates.
  std::vector<double> dx2(n * d, 1.0), dw2(d, 0.0);
  be.rmsnorm_bwd(T64(x, {n, d}), T64(w, {d}), T64(rstd, {n}), T64(G, {n, d}), T64(dx2, {n, d}), T64(dw2, {d}));
  EXPECT_NEAR(dx2[7], dx[7] + 1.0, 1e-12);
}

TEST_F(Kernels, SwiGluGradients) {
  const int n = 4, F = 6;
  auto gu = random_vec(n * 2 * F, 20), G = random_vec(n * F, 21);
  std::vector<double> h(n * F), dgu(n * 2 * F);
  auto loss = [&] {
    be.swiglu_fwd(T64(gu, {n, 2 * F}), T64(h, {n, F}));
    return test::dot(G, h.data());
  };
  loss();
  const double a = gu[2], u = gu[F + 2];
  EXPECT_NEAR(h[2], a / (1 + std::exp(-a)) * u, 1e-12);
  be.swiglu_bwd(T64(gu, {n, 2 * F}), T64(G, {n, F}), T64(dgu, {n, 2 * F}));
  check_grad("gu", gu.data(), gu.size(), dgu, loss);
}

TEST_F(Kernels, RopeRotatesPairsAndBackwardIsTranspose) {
  const int B = 2, Tn = 5, H = 3, D = 8;
  auto x0 = random_vec(B * Tn * H * D, 30), G = random_vec(B * Tn * H * D, 31);
  auto x = x0;
  std::vector<double> y;
  auto loss = [&] {
    y = x;
    be.rope_fwd(T64(y, {B, Tn, H, D}), 10000.0, 3);
    return test::dot(G, y.data());
  };
  loss();
  // Element (b=1, t=2, h=1, i=1): angle (3+2)·base^(−2/8).
  const int64_t base = ((1 * Tn + 2) * H + 1) * D;
  const double ang = 5.0 * std::pow(10000.0, -2.0 / 8);
  EXPECT_NEAR(y[base + 1], x[base + 1] * std::cos(ang) - x[base + 5] * std::sin(ang), 1e-12);
  EXPECT_NEAR(y[base + 5], x[base + 5] * std::cos(ang) + x[base + 1] * std::sin(ang), 1e-12);
  auto dx = G;
  be.rope_bwd(T64(dx, {B, Tn, H, D}), 10000.0, 3);
  check_grad("x", x.data(), x.size(), dx, loss);
}

// Naive causal attention for one (b, h).
void naive_attention(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                     std::vector<double>& o, int B, int Tq, int S, int Hq, int Hkv, int D, double scale, int window) {
  const int group = Hq / Hkv, off = S - Tq;
  o.assign(size_t(B) * Tq * Hq * D, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h)
      for (int t = 0; t < Tq; ++t) {
        const int pos = t + off, kh = h / group;
        std::vector<double> s(S, -1e300);
        double mx = -1e300;
        for (int j = 0; j <= pos; ++j) {
          if (window > 0 && pos - j >= window) continue;
          double acc = 0;
          for (int c = 0; c < D; ++c) acc += q[((b * Tq + t) * Hq + h) * D + c] * k[((b * S + j) * Hkv + kh) * D + c];
          s[j] = acc * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int j = 0; j <= pos; ++j) sum += s[j] > -1e299 ? std::exp(s[j] - mx) : 0;
        for (int j = 0; j <= pos; ++j) {
          if (s[j] < -1e299) continue;
          const double p = std::exp(s[j] - mx) / sum;
          for (int c = 0; c < D; ++c) o[((b * Tq + t) * Hq + h) * D + c] += p * v[((b * S + j) * Hkv + kh) * D + c];
        }
      }
}

struct AttnCase {
  int B, T, S, Hq, Hkv, D, window;
};

class Attention : public Kernels, public ::testing::WithParamInterface<AttnCase> {};

TEST_P(Attention, ForwardMatchesNaiveAndGradientsMatchFiniteDifferences) {
  const AttnCase c = GetParam();
  const double scale = 1.0 / std::sqrt(double(c.D));
  auto q = random_vec(size_t(c.B) * c.T * c.Hq * c.D, 40);
  auto k = random_vec(size_t(c.B) * c.S * c.Hkv * c.D, 41);
  auto v = random_vec(size_t(c.B) * c.S * c.Hkv * c.D, 42);
  auto G = random_vec(size_t(c.B) * c.T * c.Hq * c.D, 43);
  std::vector<double> o(G.size()), lse(size_t(c.B) * c.Hq * c.T), ref;
  auto fwd = [&] {
    be.attention_fwd(T64(q, {c.B, c.T, c.Hq, c.D}), T64(k, {c.B, c.S, c.Hkv, c.D}), T64(v, {c.B, c.S, c.Hkv, c.D}),
                     T64(o, {c.B, c.T, c.Hq, c.D}), T64(lse, {c.B, c.Hq, c.T}), scale, c.window);
    return test::dot(G, o.data());
  };
  fwd();
  naive_attention(q, k, v, ref, c.B, c.T, c.S, c.Hq, c.Hkv, c.D, scale, c.window);
  for (size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(o[i], ref[i], 1e-12) << i;
  if (c.S != c.T) return;  // backward is for training (S == T)
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
  be.attention_bwd(T64(q, {c.B, c.T, c.Hq, c.D}), T64(k, {c.B, c.S, c.Hkv, c.D}), T64(v, {c.B, c.S, c.Hkv, c.D}),
                   T64(o, {c.B, c.T, c.Hq, c.D}), T64(lse, {c.B, c.Hq, c.T}), T64(G, {c.B, c.T, c.Hq, c.D}),
                   T64(dq, {c.B, c.T, c.Hq, c.D}), T64(dk, {c.B, c.S, c.Hkv, c.D}), T64(dv, {c.B, c.S, c.Hkv, c.D}),
                   scale, c.window);
  check_grad("q", q.data(), q.size(), dq, fwd, 1e-6, 60);
  check_grad("k", k.data(), k.size(), dk, fwd, 1e-6, 60);
  check_grad("v", v.data(), v.size(), dv, fwd, 1e-6, 60);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Attention,
                         ::testing::Values(AttnCase{2, 7, 7, 4, 2, 4, 0},     // GQA, full causal
                                           AttnCase{2, 7, 7, 4, 2, 4, 3},     // GQA + sliding window
                                           AttnCase{1, 70, 70, 2, 1, 4, 0},   // more than one query block
                                           AttnCase{1, 70, 70, 2, 2, 4, 20},  // blocks + window
                                           AttnCase{2, 3, 9, 4, 2, 4, 0},     // KV cache: S > T
                                           AttnCase{2, 3, 9, 4, 1, 4, 4}));   // KV cache + window

TEST_F(Kernels, CrossEntropyLossArgmaxAndGradients) {
  const int n = 6, V = 5;
  auto logits = random_vec(n * V, 50, 2.0);
  std::vector<int32_t> tg = {0, 4, 2, 2, 1, 3};
  std::vector<double> mask = {1, 0, 1, 0.5, 1, 1}, losses(n);
  std::vector<int32_t> am(n);
  auto loss = [&] {
    return 0.25 * be.cross_entropy_fwd(T64(logits, {n, V}), I32(tg, {n}), T64(mask, {n}), T64(losses, {n}),
                                       Tensor());
  };
  be.cross_entropy_fwd(T64(logits, {n, V}), I32(tg, {n}), T64(mask, {n}), T64(losses, {n}), I32(am, {n}));
  double s = 0;
  int best = 0;
  for (int j = 0; j < V; ++j) {
    s += std::exp(logits[2 * V + j]);
    if (logits[2 * V + j] > logits[2 * V + best]) best = j;
  }
  EXPECT_NEAR(losses[2], std::log(s) - logits[2 * V + 2], 1e-12);
  EXPECT_EQ(losses[1], 0.0);
  EXPECT_EQ(am[2], best);
  std::vector<double> d(n * V);
  be.cross_entropy_bwd(T64(logits, {n, V}), I32(tg, {n}), T64(mask, {n}), 0.25, T64(d, {n, V}));
  check_grad("logits", logits.data(), logits.size(), d, loss);
  // In place (dlogits aliases logits) gives the same values.
  auto l2 = logits;
  be.cross_entropy_bwd(T64(l2, {n, V}), I32(tg, {n}), T64(mask, {n}), 0.25, T64(l2, {n, V}));
  for (int i = 0; i < n * V; ++i) EXPECT_EQ(l2[i], d[i]);
}

TEST_F(Kernels, EmbeddingGradientsWithRepeatedIds) {
  const int V = 6, d = 5, n = 7;
  auto table = random_vec(V * d, 60), G = random_vec(n * d, 61);
  std::vector<int32_t> ids = {1, 3, 1, 5, 0, 3, 1};
  std::vector<double> out(n * d), dt(V * d, 0.0);
  auto loss = [&] {
    be.embedding_fwd(I32(ids, {n}), T64(table, {V, d}), T64(out, {n, d}));
    return test::dot(G, out.data());
  };
  loss();
  EXPECT_EQ(out[3 * d + 2], table[5 * d + 2]);
  be.embedding_bwd(I32(ids, {n}), T64(G, {n, d}), T64(dt, {V, d}));
  check_grad("table", table.data(), table.size(), dt, loss);
  std::vector<int32_t> bad = {7};
  EXPECT_THROW(be.embedding_fwd(I32(bad, {1}), T64(table, {V, d}), T64(out, {1, d})), std::exception);
}

TEST_F(Kernels, SumSquaresAndFiniteness) {
  std::vector<double> x = {1, 2, 3};
  EXPECT_DOUBLE_EQ(be.sum_squares(T64(x, {3})), 14.0);
  EXPECT_TRUE(be.all_finite(T64(x, {3})));
  x[1] = std::nan("");
  EXPECT_FALSE(be.all_finite(T64(x, {3})));
}

TEST(Arena, ReusesMemoryAfterReset) {
  kernels::cpu::CpuBackend<float> be(1);
  kernels::Arena ar(be);
  Tensor a = ar.alloc(DType::f32, {100});
  Tensor b = ar.alloc(DType::f32, {1 << 20});  // overflows the first block
  EXPECT_NE(a.data, b.data);
  const auto peak = ar.peak_bytes();
  EXPECT_GE(peak, (1u << 22) + 400);
  ar.reset();
  Tensor c = ar.alloc(DType::f32, {100});
  Tensor d = ar.alloc(DType::f32, {1 << 20});  // fits now: one coalesced block
  EXPECT_EQ(static_cast<char*>(d.data) - static_cast<char*>(c.data), 448);
  auto m = ar.mark();
  Tensor e = ar.alloc(DType::f32, {10});
  ar.release(m);
  Tensor f = ar.alloc(DType::f32, {10});
  EXPECT_EQ(e.data, f.data);
}

}  // namespace

namespace {
TEST(FastExp, MatchesStdExpWithinTwoUlpsOverTheRangeUsed) {
  double worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.00731f) {
    const double want = std::exp(double(x));
    const double rel = std::abs(double(lar::kernels::cpu::fast_expf(x)) - want) / want;
    worst = std::max(worst, rel);
  }
  EXPECT_LT(worst, 2.5e-7);
  EXPECT_EQ(lar::kernels::cpu::fast_expf(0.0f), 1.0f);
  EXPECT_LT(lar::kernels::cpu::fast_expf(-1000.0f), 1e-37f);
}

TEST(AttentionF32, AgreesWithTheF64Reference) {
  lar::kernels::cpu::CpuBackend<float> bf(2);
  lar::kernels::cpu::CpuBackend<double> bd(2);
  const int B = 1, T = 80, H = 2, D = 8;
  auto q = random_vec(B * T * H * D, 1), k = random_vec(B * T * H * D, 2), v = random_vec(B * T * H * D, 3);
  std::vector<float> qf(q.begin(), q.end()), kf(k.begin(), k.end()), vf(v.begin(), v.end()), of(q.size()), lf(B * H * T);
  std::vector<double> od(q.size()), ld(B * H * T);
  bf.attention_fwd(Tensor(qf.data(), DType::f32, {B, T, H, D}), Tensor(kf.data(), DType::f32, {B, T, H, D}),
                   Tensor(vf.data(), DType::f32, {B, T, H, D}), Tensor(of.data(), DType::f32, {B, T, H, D}),
                   Tensor(lf.data(), DType::f32, {B, H, T}), 0.35, 30);
  bd.attention_fwd(T64(q, {B, T, H, D}), T64(k, {B, T, H, D}), T64(v, {B, T, H, D}), T64(od, {B, T, H, D}),
                   T64(ld, {B, H, T}), 0.35, 30);
  for (size_t i = 0; i < od.size(); ++i) ASSERT_NEAR(of[i], od[i], 1e-5) << i;
}
}  // namespace

// The fused ops the GPU backend implements in one pass (rmsnorm_bwd_convert,
// swiglu_bwd_fwd, adamw_step_multi): on the CPU they are their compositions of the plain
// ops, which these check value for value.
TEST_F(Kernels, FusedOpsEqualTheirCompositions) {
  const int n = 6, d = 12, F = 10;
  auto x = random_vec(n * d, 40), w = random_vec(d, 41), dy = random_vec(n * d, 42), dx0 = random_vec(n * d, 43);
  std::vector<double> y(n * d), rstd(n);
  be.rmsnorm_fwd(T64(x, {n, d}), T64(w, {d}), T64(y, {n, d}), T64(rstd, {n}), 1e-5);
  auto dx1 = dx0, dx2 = dx0;
  std::vector<double> dw1(d, 0.5), dw2(d, 0.5), copy(n * d, -7.0);
  be.rmsnorm_bwd_convert(T64(x, {n, d}), T64(w, {d}), T64(rstd, {n}), T64(dy, {n, d}), T64(dx1, {n, d}),
                         T64(dw1, {d}), T64(copy, {n, d}));
  be.rmsnorm_bwd(T64(x, {n, d}), T64(w, {d}), T64(rstd, {n}), T64(dy, {n, d}), T64(dx2, {n, d}), T64(dw2, {d}));
  EXPECT_EQ(dx1, dx2);
  EXPECT_EQ(dw1, dw2);
  EXPECT_EQ(copy, dx1) << "dx_act is the updated dx";
  EXPECT_NE(dx1, dx0);

  auto gu = random_vec(n * 2 * F, 44), dh = random_vec(n * F, 45);
  std::vector<double> h1(n * F, 9.0), h2(n * F), dgu1(n * 2 * F), dgu2(n * 2 * F);
  be.swiglu_bwd_fwd(T64(gu, {n, 2 * F}), T64(dh, {n, F}), T64(dgu1, {n, 2 * F}), T64(h1, {n, F}));
  be.swiglu_fwd(T64(gu, {n, 2 * F}), T64(h2, {n, F}));
  be.swiglu_bwd(T64(gu, {n, 2 * F}), T64(dh, {n, F}), T64(dgu2, {n, 2 * F}));
  EXPECT_EQ(h1, h2);
  EXPECT_EQ(dgu1, dgu2);

  const int P = 40;
  auto pw = random_vec(P, 46), pg = random_vec(P, 47), pm = random_vec(P + 3, 48), pv = random_vec(P + 3, 49);
  for (double& v : pv) v = std::abs(v);
  const auto pw0 = pw;
  auto pw2 = pw, pm2 = pm, pv2 = pv;
  std::vector<kernels::Backend::AdamWSegment> segs(3);
  segs[0].offset = 0, segs[0].m_offset = 3, segs[0].v_offset = 0, segs[0].n = 7;
  segs[1].offset = 9, segs[1].m_offset = 12, segs[1].v_offset = 9, segs[1].n = 20;
  segs[2].offset = 29, segs[2].m_offset = 32, segs[2].v_offset = 29, segs[2].n = 11;
  segs[1].step.step_size = 0.3f, segs[1].step.decay = 0.9f;
  segs[0].step.step_size = 0.2f;
  segs[2].step.step_size = 0.1f;
  be.adamw_step_multi(T64(pw, {P}), T64(pg, {P}), T64(pm, {P + 3}), T64(pv, {P + 3}), segs);
  for (const auto& s : segs)
    be.adamw_step(Tensor(pw2.data() + s.offset, DType::f64, {s.n}), Tensor(pg.data() + s.offset, DType::f64, {s.n}),
                  Tensor(pm2.data() + s.m_offset, DType::f64, {s.n}), Tensor(pv2.data() + s.v_offset, DType::f64, {s.n}),
                  s.step);
  EXPECT_EQ(pw, pw2);
  EXPECT_EQ(pm, pm2);
  EXPECT_EQ(pv, pv2);
  EXPECT_EQ(pw[7], pw0[7]) << "elements between segments stay";
  EXPECT_EQ(pw[8], pw0[8]);
  EXPECT_NE(pw[0], pw0[0]);
}
