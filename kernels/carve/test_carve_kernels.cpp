// CARVE (kernels/carve/carve.hpp): bit-identity with gdn2 when U2 = 0, chunkwise =
// recurrent, finite-difference gradients through the content signal, m_0 = 0, decode.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/carve/carve.hpp"

namespace lk = lar::kernels::cpu::linear;
using lk::Form;

namespace {

template <class T>
struct CarveData {
  int len, dk, dv, rank;
  std::vector<T> q, k, v, g, bx, w, U1, U2;
  CarveData(int len_, int dk_, int dv_, int rank_, unsigned seed, bool zero_u2 = false)
      : len(len_), dk(dk_), dv(dv_), rank(rank_) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> nd(0, 1);
    std::uniform_real_distribution<double> ud(0.05, 0.95), gd(-0.7, -0.01);
    auto unit = [&](std::vector<T>& x) {
      x.resize((size_t)len * dk);
      for (int r = 0; r < len; ++r) {
        double n2 = 0;
        for (int c = 0; c < dk; ++c) n2 += std::pow(x[(size_t)r * dk + c] = (T)nd(rng), 2);
        for (int c = 0; c < dk; ++c) x[(size_t)r * dk + c] /= (T)std::sqrt(n2);
      }
    };
    unit(q);
    unit(k);
    v.resize((size_t)len * dv);
    for (auto& x : v) x = (T)nd(rng);
    g.resize((size_t)len * dk);
    for (auto& x : g) x = (T)gd(rng);
    bx.resize((size_t)len * dk);
    for (auto& x : bx) x = (T)nd(rng);
    w.resize(len);
    for (auto& x : w) x = (T)ud(rng);
    U1.resize((size_t)rank * dv);
    for (auto& x : U1) x = (T)nd(rng);
    U2.resize((size_t)dk * rank);
    for (auto& x : U2) x = zero_u2 ? T(0) : (T)nd(rng);
  }
  lk::CarveInputs<T> inputs(int L, int chunk, bool content_grad = true) const {
    lk::CarveInputs<T> in;
    in.len = len;
    in.dk = dk;
    in.dv = dv;
    in.rank = rank;
    in.q = q.data();
    in.k = k.data();
    in.v = v.data();
    in.g = g.data();
    in.bx = bx.data();
    in.w = w.data();
    in.U1 = U1.data();
    in.U2 = U2.data();
    in.content_chunk = L;
    in.chunk = chunk;
    in.scale = (T)(1.0 / std::sqrt((double)dk));
    in.content_grad = content_grad;
    return in;
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
struct CarveGradBufs {
  std::vector<T> dq, dk, dv, dg, dbx, dw, dU1, dU2;
  explicit CarveGradBufs(const CarveData<T>& d)
      : dq(d.q.size()), dk(d.k.size()), dv(d.v.size()), dg(d.g.size()), dbx(d.bx.size()),
        dw(d.w.size()), dU1(d.U1.size(), T(0)), dU2(d.U2.size(), T(0)) {}
  lk::CarveGrads<T> ptrs() {
    return {dq.data(), dk.data(), dv.data(), dg.data(), dbx.data(), dw.data(), dU1.data(), dU2.data(), nullptr};
  }
};

}  // namespace

TEST(CarveKernels, ZeroContentProjectionIsBitIdenticalToGdn2) {
  CarveData<float> d(150, 16, 12, 4, 5, /*zero_u2=*/true);
  auto in = d.inputs(64, 64);
  std::vector<float> oc((size_t)d.len * d.dv), og(oc.size());
  lk::carve_forward(in, Form::chunk, (lk::CarveState<float>*)nullptr, oc.data());
  // gdn2 with b = σ(bx) and the scalar write gate broadcast over dv
  std::vector<float> b(d.bx.size()), wf((size_t)d.len * d.dv);
  for (size_t i = 0; i < b.size(); ++i) b[i] = lk::carve_sigmoid(d.bx[i]);
  for (int t = 0; t < d.len; ++t)
    for (int j = 0; j < d.dv; ++j) wf[(size_t)t * d.dv + j] = d.w[t];
  lk::MixerInputs<float> mi;
  mi.len = d.len;
  mi.dk = d.dk;
  mi.dv = d.dv;
  mi.q = d.q.data();
  mi.k = d.k.data();
  mi.v = d.v.data();
  mi.g = d.g.data();
  mi.b = b.data();
  mi.w = wf.data();
  mi.scale = in.scale;
  lk::mixer_forward(lk::Mixer::gdn2, mi, Form::chunk, 64, (const float*)nullptr, og.data(),
                    (float*)nullptr);
  EXPECT_EQ(std::memcmp(oc.data(), og.data(), oc.size() * sizeof(float)), 0);
  // and the content path does change the result once U2 ≠ 0
  CarveData<float> d2(150, 16, 12, 4, 5);
  std::vector<float> o2(oc.size());
  lk::carve_forward(d2.inputs(64, 64), Form::chunk, (lk::CarveState<float>*)nullptr, o2.data());
  EXPECT_GT(rel_err(o2, oc), 1e-3);
}

TEST(CarveKernels, FirstContentChunkSeesZeroSignal) {
  CarveData<double> d(40, 6, 5, 3, 8);
  std::vector<double> o1((size_t)d.len * d.dv), o2(o1.size());
  lk::carve_forward(d.inputs(16, 8), Form::chunk, (lk::CarveState<double>*)nullptr, o1.data());
  for (auto& x : d.U2) x *= 3;
  for (auto& x : d.U1) x += 0.5;
  lk::carve_forward(d.inputs(16, 8), Form::chunk, (lk::CarveState<double>*)nullptr, o2.data());
  for (int i = 0; i < 16 * d.dv; ++i) EXPECT_EQ(o1[i], o2[i]) << i;
  double later = 0;
  for (size_t i = 16 * d.dv; i < o1.size(); ++i) later += std::abs(o1[i] - o2[i]);
  EXPECT_GT(later, 1e-6);
}

TEST(CarveKernels, ChunkwiseMatchesRecurrentFp32) {
  for (int L : {10, 16, 64})
    for (int chunk : {4, 16}) {
      CarveData<float> d(70, 8, 6, 3, 21 + L);
      auto in = d.inputs(L, chunk);
      std::vector<float> o1((size_t)d.len * d.dv), o2(o1.size());
      lk::carve_forward(in, Form::recurrent, (lk::CarveState<float>*)nullptr, o1.data());
      lk::CarveCache<float> cache;
      lk::carve_forward(in, Form::chunk, (lk::CarveState<float>*)nullptr, o2.data(), &cache);
      EXPECT_LE(rel_err(o2, o1), 1e-5) << L << " " << chunk;
      std::mt19937 rng(1);
      std::normal_distribution<float> nd(0, 1);
      std::vector<float> dO(o1.size());
      for (auto& x : dO) x = nd(rng);
      CarveGradBufs<float> g1(d), g2(d);
      lk::carve_backward(in, Form::recurrent, dO.data(), g1.ptrs());
      lk::carve_backward(in, Form::chunk, dO.data(), g2.ptrs(), &cache);
      EXPECT_LE(rel_err(g2.dq, g1.dq), 1e-5);
      EXPECT_LE(rel_err(g2.dk, g1.dk), 1e-5);
      EXPECT_LE(rel_err(g2.dv, g1.dv), 1e-5);
      EXPECT_LE(rel_err(g2.dg, g1.dg), 1e-5);
      EXPECT_LE(rel_err(g2.dbx, g1.dbx), 1e-5);
      EXPECT_LE(rel_err(g2.dw, g1.dw), 1e-5);
      EXPECT_LE(rel_err(g2.dU1, g1.dU1), 1e-5);
      EXPECT_LE(rel_err(g2.dU2, g1.dU2), 1e-5);
    }
}

TEST(CarveKernels, FiniteDifferenceGradientsFp64) {
  for (bool content_grad : {true, false}) {
    CarveData<double> d(11, 3, 4, 2, 13);
    const int L = 4, chunk = 3;
    std::mt19937 rng(2);
    std::normal_distribution<double> nd(0, 1);
    std::vector<double> R((size_t)d.len * d.dv);
    for (auto& x : R) x = nd(rng);
    auto loss = [&]() {
      std::vector<double> o(R.size());
      lk::carve_forward(d.inputs(L, chunk), Form::chunk, (lk::CarveState<double>*)nullptr, o.data());
      double l = 0;
      for (size_t i = 0; i < o.size(); ++i) l += R[i] * o[i];
      return l;
    };
    CarveGradBufs<double> gr(d);
    lk::carve_backward(d.inputs(L, chunk, content_grad), Form::chunk, R.data(), gr.ptrs());
    std::vector<std::pair<std::vector<double>*, std::vector<double>*>> pairs = {
        {&d.q, &gr.dq},   {&d.k, &gr.dk}, {&d.v, &gr.dv},     {&d.g, &gr.dg},
        {&d.bx, &gr.dbx}, {&d.w, &gr.dw}, {&d.U1, &gr.dU1}, {&d.U2, &gr.dU2}};
    const char* names[] = {"q", "k", "v", "g", "bx", "w", "U1", "U2"};
    double worst = 0;
    for (size_t p = 0; p < pairs.size(); ++p) {
      auto& x = *pairs[p].first;
      std::vector<double> fd(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        const double h = 1e-6, x0 = x[i];
        x[i] = x0 + h;
        double lp = loss();
        x[i] = x0 - h;
        double lm = loss();
        x[i] = x0;
        fd[i] = (lp - lm) / (2 * h);
      }
      double e = rel_err(*pairs[p].second, fd);
      worst = std::max(worst, e);
      if (content_grad) {
        EXPECT_LE(e, 1e-6) << names[p];
      }
    }
    // Without the gradient through m_c the result is no longer the full gradient.
    if (!content_grad) {
      EXPECT_GT(worst, 1e-4);
    }
  }
}

TEST(CarveKernels, DecodeStepByStepEqualsForward) {
  CarveData<double> d(37, 5, 4, 2, 31);
  auto in = d.inputs(8, 4);
  std::vector<double> full((size_t)d.len * d.dv), step(full.size());
  lk::carve_forward(in, Form::chunk, (lk::CarveState<double>*)nullptr, full.data());
  lk::CarveState<double> st(d.dk, d.dv);
  for (int t = 0; t < d.len; ++t) {
    auto one = in;
    one.len = 1;
    one.q += t * d.dk;
    one.k += t * d.dk;
    one.v += t * d.dv;
    one.g += t * d.dk;
    one.bx += t * d.dk;
    one.w += t;
    lk::carve_forward(one, Form::recurrent, &st, step.data() + t * d.dv);
  }
  EXPECT_LE(rel_err(step, full), 1e-12);
}
