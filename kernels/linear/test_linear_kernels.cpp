// Recurrent vs chunkwise forms of every linear-attention recurrence, finite-difference
// gradients in fp64, the special-case equalities of docs/spec.md §2 and decode = full forward.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "kernels/linear/mixers.hpp"

namespace lk = lar::kernels::cpu::linear;
using lk::Form;
using lk::Mixer;

namespace {

const Mixer kAll[] = {Mixer::linear, Mixer::gla, Mixer::deltanet,
                      Mixer::gdn,    Mixer::kda, Mixer::gdn2};

// Owned random inputs of one (batch, head) sequence.
template <class T>
struct Data {
  int len, dk, dv;
  std::vector<T> q, k, v, g, beta, b, w, S0;
  double factor_span = 0;

  Data(Mixer m, int len_, int dk_, int dv_, unsigned seed, double gate_lo = -0.7)
      : len(len_), dk(dk_), dv(dv_) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> nd(0.0, 1.0);
    std::uniform_real_distribution<double> ud(0.05, 0.95), gd(gate_lo, -0.01);
    auto unit_rows = [&](std::vector<T>& x, int rows, int cols) {
      x.resize((size_t)rows * cols);
      for (int r = 0; r < rows; ++r) {
        double n2 = 0;
        for (int c = 0; c < cols; ++c) n2 += std::pow(x[(size_t)r * cols + c] = (T)nd(rng), 2);
        for (int c = 0; c < cols; ++c) x[(size_t)r * cols + c] /= (T)std::sqrt(n2);
      }
    };
    unit_rows(q, len, dk);
    unit_rows(k, len, dk);
    v.resize((size_t)len * dv);
    for (auto& x : v) x = (T)nd(rng);
    auto gk = lk::gate_kind(m);
    if (gk == lk::GateKind::scalar) g.resize(len);
    if (gk == lk::GateKind::channel) g.resize((size_t)len * dk);
    for (auto& x : g) x = (T)gd(rng);
    if (lk::uses_beta(m)) {
      beta.resize(len);
      for (auto& x : beta) x = (T)ud(rng);
    }
    if (m == Mixer::gdn2) {
      b.resize((size_t)len * dk);
      w.resize((size_t)len * dv);
      for (auto& x : b) x = (T)ud(rng);
      for (auto& x : w) x = (T)ud(rng);
    }
    S0.resize((size_t)dv * dk);
    for (auto& x : S0) x = (T)(0.5 * nd(rng));
  }

  lk::MixerInputs<T> inputs() const {
    lk::MixerInputs<T> in;
    in.len = len;
    in.dk = dk;
    in.dv = dv;
    in.q = q.data();
    in.k = k.data();
    in.v = v.data();
    in.g = g.empty() ? nullptr : g.data();
    in.beta = beta.empty() ? nullptr : beta.data();
    in.b = b.empty() ? nullptr : b.data();
    in.w = w.empty() ? nullptr : w.data();
    in.scale = (T)(1.0 / std::sqrt((double)dk));
    in.factor_span = factor_span;
    return in;
  }
};

template <class T>
struct Grads {
  std::vector<T> dq, dk, dv, dg, dbeta, db, dw, dS0;
  Grads(const Data<T>& d)
      : dq(d.q.size()), dk(d.k.size()), dv(d.v.size()), dg(d.g.size()), dbeta(d.beta.size()),
        db(d.b.size()), dw(d.w.size()), dS0(d.S0.size()) {}
  lk::MixerGrads<T> ptrs() {
    lk::MixerGrads<T> g;
    g.dq = dq.data();
    g.dk = dk.data();
    g.dv = dv.data();
    g.dg = dg.empty() ? nullptr : dg.data();
    g.dbeta = dbeta.empty() ? nullptr : dbeta.data();
    g.db = db.empty() ? nullptr : db.data();
    g.dw = dw.empty() ? nullptr : dw.data();
    g.dS0 = dS0.data();
    return g;
  }
  std::vector<std::pair<const char*, const std::vector<T>*>> all() const {
    return {{"dq", &dq},       {"dk", &dk}, {"dv", &dv}, {"dg", &dg},
            {"dbeta", &dbeta}, {"db", &db}, {"dw", &dw}, {"dS0", &dS0}};
  }
};

template <class A, class B>
double rel_err(const std::vector<A>& a, const std::vector<B>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += std::pow((double)a[i] - (double)b[i], 2);
    den += std::pow((double)b[i], 2);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

template <class T>
std::vector<T> randn(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<T> x(n);
  for (auto& e : x) e = (T)nd(rng);
  return x;
}

struct Shape {
  int len, dk, dv, chunk;
};
// T not a multiple of the chunk, dk ≠ dv, and a few "heads" (independent seeds).
const Shape kShapes[] = {{37, 8, 12, 16}, {100, 16, 8, 64}, {130, 32, 24, 64}, {5, 4, 6, 8}};

}  // namespace

TEST(LinearKernels, ChunkForwardMatchesRecurrentFp32) {
  for (Mixer m : kAll)
    for (const Shape& s : kShapes)
      for (unsigned head = 0; head < 3; ++head) {
        Data<float> d(m, s.len, s.dk, s.dv, 1000 + head * 7 + s.len);
        auto in = d.inputs();
        std::vector<float> o1((size_t)s.len * s.dv), o2(o1.size()), S1(d.S0.size()), S2(S1.size());
        lk::mixer_forward(m, in, Form::recurrent, s.chunk, d.S0.data(), o1.data(), S1.data());
        lk::mixer_forward(m, in, Form::chunk, s.chunk, d.S0.data(), o2.data(), S2.data());
        EXPECT_LE(rel_err(o2, o1), 1e-5) << lk::mixer_name(m) << " T=" << s.len;
        EXPECT_LE(rel_err(S2, S1), 1e-5) << lk::mixer_name(m) << " T=" << s.len;
        EXPECT_GT(rel_err(o1, std::vector<float>(o1.size(), 0.f)), 0.1);  // not all zero
      }
}

TEST(LinearKernels, ChunkBackwardMatchesRecurrentFp32) {
  for (Mixer m : kAll)
    for (const Shape& s : kShapes) {
      Data<float> d(m, s.len, s.dk, s.dv, 77 + s.len);
      auto in = d.inputs();
      auto dO = randn<float>((size_t)s.len * s.dv, 5);
      auto dST = randn<float>(d.S0.size(), 6);
      Grads<float> g1(d), g2(d);
      lk::mixer_backward(m, in, Form::recurrent, s.chunk, d.S0.data(), dO.data(), dST.data(),
                         g1.ptrs());
      std::vector<float> bnd((size_t)lk::num_chunks(s.len, s.chunk) * d.S0.size());
      lk::mixer_forward(m, in, Form::chunk, s.chunk, d.S0.data(), (float*)nullptr,
                        (float*)nullptr, bnd.data());
      lk::mixer_backward(m, in, Form::chunk, s.chunk, d.S0.data(), dO.data(), dST.data(),
                         g2.ptrs(), bnd.data());
      auto a1 = g1.all(), a2 = g2.all();
      for (size_t i = 0; i < a1.size(); ++i) {
        if (a1[i].second->empty()) continue;
        EXPECT_LE(rel_err(*a2[i].second, *a1[i].second), 1e-5)
            << lk::mixer_name(m) << " " << a1[i].first << " T=" << s.len;
        EXPECT_GT(rel_err(*a1[i].second, std::vector<float>(a1[i].second->size(), 0.f)), 1e-3)
            << lk::mixer_name(m) << " " << a1[i].first << " is zero";
      }
    }
}

// loss = <R1, o> + <R2, S_T>; central differences on every input, fp64, tiny shapes.
// Channel gates take the factored GEMM path (factor_span 0 = default) or the pairwise
// exp(G_t − G_j) path (factor_span −1); both are checked.
TEST(LinearKernels, FiniteDifferenceGradientsFp64) {
  const int len = 7, dk = 3, dv = 4, chunk = 3;
  for (double span : {0.0, -1.0})
  for (Mixer m : kAll)
    for (Form form : {Form::recurrent, Form::chunk}) {
      Data<double> d(m, len, dk, dv, 31);
      d.factor_span = span;
      auto R1 = randn<double>((size_t)len * dv, 8), R2 = randn<double>(d.S0.size(), 9);
      // delta rules: the write residual (routing's side channel) is part of the loss too
      const bool delta = lk::is_delta_rule(m);
      auto R3 = randn<double>((size_t)len * dv, 10);
      auto loss = [&]() {
        std::vector<double> o((size_t)len * dv), S(d.S0.size()), r((size_t)len * dv);
        auto in = d.inputs();
        if (delta) in.resid = r.data();
        lk::mixer_forward(m, in, form, chunk, d.S0.data(), o.data(), S.data());
        double l = 0;
        for (size_t i = 0; i < o.size(); ++i) l += R1[i] * o[i] + R3[i] * r[i];
        for (size_t i = 0; i < S.size(); ++i) l += R2[i] * S[i];
        return l;
      };
      Grads<double> gr(d);
      auto bin = d.inputs();
      if (delta) bin.dresid = R3.data();
      lk::mixer_backward(m, bin, form, chunk, d.S0.data(), R1.data(), R2.data(), gr.ptrs());
      std::vector<std::pair<std::vector<double>*, std::vector<double>*>> pairs = {
          {&d.q, &gr.dq},       {&d.k, &gr.dk}, {&d.v, &gr.dv}, {&d.g, &gr.dg},
          {&d.beta, &gr.dbeta}, {&d.b, &gr.db}, {&d.w, &gr.dw}, {&d.S0, &gr.dS0}};
      const char* names[] = {"q", "k", "v", "g", "beta", "b", "w", "S0"};
      for (size_t p = 0; p < pairs.size(); ++p) {
        auto& x = *pairs[p].first;
        std::vector<double> fd(x.size());
        for (size_t i = 0; i < x.size(); ++i) {
          const double h = 1e-5, x0 = x[i];
          x[i] = x0 + h;
          double lp = loss();
          x[i] = x0 - h;
          double lm = loss();
          x[i] = x0;
          fd[i] = (lp - lm) / (2 * h);
        }
        EXPECT_LE(rel_err(*pairs[p].second, fd), 1e-6)
            << lk::mixer_name(m) << (form == Form::chunk ? " chunk " : " recurrent ") << names[p];
      }
    }
}

TEST(LinearKernels, SpecialCasesCoincide) {
  const int len = 45, dk = 8, dv = 6, chunk = 16;
  auto run = [&](Mixer m, const lk::MixerInputs<double>& in, const std::vector<double>& S0) {
    std::vector<double> o((size_t)len * dv);
    lk::mixer_forward(m, in, Form::chunk, chunk, S0.data(), o.data(), (double*)nullptr);
    return o;
  };
  Data<double> kda(Mixer::kda, len, dk, dv, 3);
  // gdn2 with b = β·1, w = β·1 equals kda.
  {
    std::vector<double> b((size_t)len * dk), w((size_t)len * dv);
    for (int t = 0; t < len; ++t) {
      for (int i = 0; i < dk; ++i) b[(size_t)t * dk + i] = kda.beta[t];
      for (int i = 0; i < dv; ++i) w[(size_t)t * dv + i] = kda.beta[t];
    }
    auto in = kda.inputs();
    in.b = b.data();
    in.w = w.data();
    EXPECT_LE(rel_err(run(Mixer::gdn2, in, kda.S0), run(Mixer::kda, kda.inputs(), kda.S0)), 1e-12);
  }
  // kda with equal channels equals gdn.
  Data<double> gdn(Mixer::gdn, len, dk, dv, 4);
  {
    std::vector<double> gch((size_t)len * dk);
    for (int t = 0; t < len; ++t)
      for (int i = 0; i < dk; ++i) gch[(size_t)t * dk + i] = gdn.g[t];
    auto in = gdn.inputs();
    in.g = gch.data();
    EXPECT_LE(rel_err(run(Mixer::kda, in, gdn.S0), run(Mixer::gdn, gdn.inputs(), gdn.S0)), 1e-12);
  }
  // gdn with α ≡ 1 (g ≡ 0) equals deltanet.
  {
    std::vector<double> zero(len, 0.0);
    auto in = gdn.inputs();
    in.g = zero.data();
    auto o_gdn = run(Mixer::gdn, in, gdn.S0);
    EXPECT_LE(rel_err(o_gdn, run(Mixer::deltanet, gdn.inputs(), gdn.S0)), 1e-12);
    // and the gate does matter when it is not 1
    EXPECT_GT(rel_err(run(Mixer::gdn, gdn.inputs(), gdn.S0), o_gdn), 1e-2);
  }
}

TEST(LinearKernels, DecodeStepByStepEqualsFullForward) {
  const int len = 50, dk = 8, dv = 5, chunk = 16;
  for (Mixer m : kAll) {
    Data<double> d(m, len, dk, dv, 11);
    auto in = d.inputs();
    std::vector<double> o((size_t)len * dv), S_full(d.S0.size());
    lk::mixer_forward(m, in, Form::chunk, chunk, d.S0.data(), o.data(), S_full.data());
    std::vector<double> S = d.S0, o_step((size_t)len * dv);
    for (int t = 0; t < len; ++t) {
      lk::MixerInputs<double> st = in;
      st.q += (size_t)t * dk;
      st.k += (size_t)t * dk;
      st.v += (size_t)t * dv;
      if (st.g) st.g += lk::gate_kind(m) == lk::GateKind::scalar ? (size_t)t : (size_t)t * dk;
      if (st.beta) st.beta += t;
      if (st.b) st.b += (size_t)t * dk;
      if (st.w) st.w += (size_t)t * dv;
      lk::mixer_step(m, st, S.data(), o_step.data() + (size_t)t * dv);
    }
    EXPECT_LE(rel_err(o_step, o), 1e-12) << lk::mixer_name(m);
    EXPECT_LE(rel_err(S, S_full), 1e-12) << lk::mixer_name(m);
    // splitting the sequence in two calls that carry the state gives the same too
    std::vector<double> Sh(d.S0.size()), o2((size_t)len * dv);
    auto first = in;
    first.len = 20;
    lk::mixer_forward(m, first, Form::chunk, chunk, d.S0.data(), o2.data(), Sh.data());
    auto second = in;
    second.len = len - 20;
    second.q += 20 * dk;
    second.k += 20 * dk;
    second.v += 20 * dv;
    if (second.g) second.g += lk::gate_kind(m) == lk::GateKind::scalar ? 20 : 20 * dk;
    if (second.beta) second.beta += 20;
    if (second.b) second.b += 20 * dk;
    if (second.w) second.w += 20 * dv;
    lk::mixer_forward(m, second, Form::chunk, chunk, Sh.data(), o2.data() + 20 * dv, Sh.data());
    EXPECT_LE(rel_err(o2, o), 1e-12) << lk::mixer_name(m);
  }
}

// Very strong decay (g down to −30 per step) would overflow an exp(−G) factorisation in
// fp32; the chunk form falls back to pairwise exponents there. Both fp32 forms are compared
// with the fp64 recurrent form (the fp32 recurrent form is itself off by ~1e-5 here).
TEST(LinearKernels, StrongGatesStayFinite) {
  for (Mixer m : {Mixer::gla, Mixer::gdn, Mixer::kda, Mixer::gdn2}) {
    Data<float> d(m, 70, 8, 8, 13, -30.0);
    Data<double> d64(m, 70, 8, 8, 13, -30.0);
    auto in = d.inputs();
    std::vector<float> o1(70 * 8), o2(o1.size());
    lk::mixer_forward(m, in, Form::recurrent, 64, d.S0.data(), o1.data(), (float*)nullptr);
    lk::mixer_forward(m, in, Form::chunk, 64, d.S0.data(), o2.data(), (float*)nullptr);
    for (float x : o2) ASSERT_TRUE(std::isfinite(x)) << lk::mixer_name(m);
    EXPECT_LE(rel_err(o2, o1), 1e-5) << lk::mixer_name(m);
    std::vector<double> o64(o1.size());
    lk::mixer_forward(m, d64.inputs(), Form::recurrent, 64, d64.S0.data(), o64.data(),
                      (double*)nullptr);
    EXPECT_LE(rel_err(o2, o64), 1e-5) << lk::mixer_name(m);
    // and the backward of the pairwise path
    auto dO = randn<float>(o1.size(), 21);
    auto dST = randn<float>(d.S0.size(), 22);
    Grads<float> g1(d), g2(d);
    std::vector<double> dO64(dO.begin(), dO.end()), dST64(dST.begin(), dST.end());
    Grads<double> g64(d64);
    lk::mixer_backward(m, d64.inputs(), Form::recurrent, 64, d64.S0.data(), dO64.data(),
                       dST64.data(), g64.ptrs());
    lk::mixer_backward(m, in, Form::recurrent, 64, d.S0.data(), dO.data(), dST.data(), g1.ptrs());
    lk::mixer_backward(m, in, Form::chunk, 64, d.S0.data(), dO.data(), dST.data(), g2.ptrs());
    auto a1 = g1.all(), a2 = g2.all();
    auto a64 = g64.all();
    for (size_t i = 0; i < a1.size(); ++i) {
      if (a1[i].second->empty()) continue;
      // dg is a reverse cumulative sum of terms that cancel: with decays this strong it
      // loses about one more digit than the other gradients in fp32.
      EXPECT_LE(rel_err(*a2[i].second, *a64[i].second), 5e-5)
          << lk::mixer_name(m) << " " << a1[i].first << " strong gates, chunk";
      EXPECT_LE(rel_err(*a1[i].second, *a64[i].second), 1e-4)
          << lk::mixer_name(m) << " " << a1[i].first << " strong gates, recurrent";
    }
  }
}

TEST(LinearKernels, MissingInputsAreRejected) {
  Data<float> d(Mixer::gdn2, 4, 4, 4, 1);
  auto in = d.inputs();
  in.w = nullptr;
  std::vector<float> o(16);
  try {
    lk::mixer_forward(Mixer::gdn2, in, Form::chunk, 4, (float*)nullptr, o.data(), (float*)nullptr);
    FAIL() << "expected an exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("gdn2"), std::string::npos);
  }
  EXPECT_FALSE(lk::parse_mixer("softmax").has_value());
  EXPECT_EQ(*lk::parse_mixer("kda"), Mixer::kda);
}

// The routing side channel: r_t = v_t − S_{t−1}(α_t ⊙ k_t) for the β rules (before β),
// z_t − S_{t−1}(α_t ⊙ b_t ⊙ k_t) for gdn2; chunkwise = recurrent; refused without a delta rule.
TEST(LinearKernels, WriteResidualIsTheDecayedError) {
  const int len = 40, dk = 6, dv = 5;
  for (Mixer m : {Mixer::deltanet, Mixer::gdn, Mixer::kda, Mixer::gdn2}) {
    Data<double> d(m, len, dk, dv, 19);
    auto in = d.inputs();
    std::vector<double> r1((size_t)len * dv), r2(r1.size()), o(r1.size());
    in.resid = r1.data();
    lk::mixer_forward(m, in, Form::recurrent, 16, d.S0.data(), o.data(), (double*)nullptr);
    in.resid = r2.data();
    lk::mixer_forward(m, in, Form::chunk, 16, d.S0.data(), o.data(), (double*)nullptr);
    EXPECT_LE(rel_err(r2, r1), 1e-12) << lk::mixer_name(m);
    // explicitly, from the state before each token
    std::vector<double> S = d.S0, want(r1.size()), ot(dv);
    for (int t = 0; t < len; ++t) {
      for (int i = 0; i < dv; ++i) {
        double s = 0;
        for (int c = 0; c < dk; ++c) {
          double a = 1;
          if (lk::gate_kind(m) == lk::GateKind::scalar) a = std::exp(d.g[t]);
          if (lk::gate_kind(m) == lk::GateKind::channel) a = std::exp(d.g[(size_t)t * dk + c]);
          double e = d.k[(size_t)t * dk + c] * (m == Mixer::gdn2 ? d.b[(size_t)t * dk + c] : 1.0);
          s += S[(size_t)i * dk + c] * a * e;
        }
        double z = d.v[(size_t)t * dv + i] * (m == Mixer::gdn2 ? d.w[(size_t)t * dv + i] : 1.0);
        want[(size_t)t * dv + i] = z - s;
      }
      lk::MixerInputs<double> st = in;
      st.resid = nullptr;
      st.q += (size_t)t * dk;
      st.k += (size_t)t * dk;
      st.v += (size_t)t * dv;
      if (st.g) st.g += lk::gate_kind(m) == lk::GateKind::scalar ? (size_t)t : (size_t)t * dk;
      if (st.beta) st.beta += t;
      if (st.b) st.b += (size_t)t * dk;
      if (st.w) st.w += (size_t)t * dv;
      lk::mixer_step(m, st, S.data(), ot.data());
    }
    EXPECT_LE(rel_err(r1, want), 1e-12) << lk::mixer_name(m);
  }
  Data<float> d(Mixer::gla, 4, 4, 4, 1);
  auto in = d.inputs();
  std::vector<float> r(16), o(16);
  in.resid = r.data();
  EXPECT_THROW(lk::mixer_forward(Mixer::gla, in, Form::chunk, 4, (float*)nullptr, o.data(), (float*)nullptr),
               std::invalid_argument);
}
