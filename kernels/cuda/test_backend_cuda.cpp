// Every CUDA backend op against the CPU reference (fp64) on fresh random inputs, at
// several shapes: relative RMS error ≤ 1e-5 on the fp32 paths.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>

#include "core/error.hpp"
#include "kernels/backend.hpp"

using namespace lar::kernels;

namespace {

// precision "fp32": the reference path (cuBLAS pedantic fp32, fp32 attention);
// "mixed": TF32 GEMMs and the bf16 flash attention over the same fp32 tensors.
Backend::Options with_precision(const std::string& p) {
  Backend::Options o;
  o.precision = p;
  return o;
}

struct Pair {
  explicit Pair(const std::string& precision = "fp32") : gpu(make_backend("cuda", 1, DType::f32, with_precision(precision))) {}
  explicit Pair(const Backend::Options& o) : gpu(make_backend("cuda", 1, DType::f32, o)) {}
  std::unique_ptr<Backend> gpu;
  std::unique_ptr<Backend> cpu = make_backend("cpu", 1, DType::f64);
  Arena ga{*gpu}, ca{*cpu};
  std::mt19937_64 rng{std::random_device{}()};

  // The same random values on both backends (never zeros).
  std::pair<Tensor, Tensor> randn(std::vector<int64_t> shape, double scale = 1.0) {
    Tensor g = ga.alloc(DType::f32, shape), c = ca.alloc(DType::f64, shape);
    std::normal_distribution<double> nd(0.0, scale);
    std::vector<float> hf(g.numel());
    std::vector<double> hd(g.numel());
    for (size_t i = 0; i < hf.size(); ++i) hf[i] = static_cast<float>(nd(rng)), hd[i] = hf[i];
    gpu->upload(hf.data(), g);
    cpu->upload(hd.data(), c);
    return {g, c};
  }
  std::pair<Tensor, Tensor> ids(std::vector<int64_t> shape, int vocab) {
    Tensor g = ga.alloc(DType::i32, shape), c = ca.alloc(DType::i32, shape);
    std::vector<int32_t> h(g.numel());
    std::uniform_int_distribution<int> ud(0, vocab - 1);
    for (auto& x : h) x = ud(rng);
    gpu->upload(h.data(), g);
    cpu->upload(h.data(), c);
    return {g, c};
  }
  std::pair<Tensor, Tensor> zeros(std::vector<int64_t> shape) {
    Tensor g = ga.alloc(DType::f32, shape), c = ca.alloc(DType::f64, shape);
    gpu->zero(g);
    cpu->zero(c);
    return {g, c};
  }
  // Output buffers poisoned with NaN: an element the kernel forgot to write fails.
  std::pair<Tensor, Tensor> poisoned(std::vector<int64_t> shape) {
    Tensor g = ga.alloc(DType::f32, shape), c = ca.alloc(DType::f64, shape);
    gpu->fill(g, NAN);
    cpu->zero(c);
    return {g, c};
  }
  // bf16 storage (mixed precision): values already representable in bf16, so the CPU
  // reference sees exactly the GPU's inputs.
  static float round_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    std::memcpy(&x, &u, 4);
    return x;
  }
  std::pair<Tensor, Tensor> randn_bf16(std::vector<int64_t> shape, double scale = 1.0) {
    Tensor g32 = ga.alloc(DType::f32, shape), g = ga.alloc(DType::bf16, shape), c = ca.alloc(DType::f64, shape);
    std::normal_distribution<double> nd(0.0, scale);
    std::vector<float> hf(g.numel());
    std::vector<double> hd(g.numel());
    for (size_t i = 0; i < hf.size(); ++i) hf[i] = round_bf16(static_cast<float>(nd(rng))), hd[i] = hf[i];
    gpu->upload(hf.data(), g32);
    gpu->convert(g32, g);
    cpu->upload(hd.data(), c);
    return {g, c};
  }
  std::pair<Tensor, Tensor> poisoned_bf16(std::vector<int64_t> shape) {
    Tensor g32 = ga.alloc(DType::f32, shape), g = ga.alloc(DType::bf16, shape), c = ca.alloc(DType::f64, shape);
    gpu->fill(g32, NAN);
    gpu->convert(g32, g);
    cpu->zero(c);
    return {g, c};
  }
  double rel_rms(const std::pair<Tensor, Tensor>& t) {
    if (t.first.dtype == DType::bf16) {  // widen on the device, then compare
      Tensor w = ga.alloc(DType::f32, t.first.shape());
      gpu->convert(t.first, w);
      return rel_rms({w, t.second});
    }
    std::vector<float> g(t.first.numel());
    std::vector<double> c(t.second.numel());
    gpu->download(t.first, g.data());
    cpu->download(t.second, c.data());
    double num = 0, den = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      if (!std::isfinite(g[i])) return INFINITY;
      num += (g[i] - c[i]) * (g[i] - c[i]);
      den += c[i] * c[i];
    }
    return std::sqrt(num / std::max(den, 1e-300));
  }
};

constexpr double kTol = 1e-5;

}  // namespace

TEST(CudaBackend, Gemm) {
  Pair p;
  for (auto [M, N, K] : {std::tuple{7, 5, 3}, {64, 96, 128}, {257, 129, 65}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        auto A = p.randn(ta ? std::vector<int64_t>{K, M} : std::vector<int64_t>{M, K});
        auto B = p.randn(tb ? std::vector<int64_t>{N, K} : std::vector<int64_t>{K, N});
        auto C = p.randn({M, N});
        p.gpu->gemm(A.first, ta, B.first, tb, C.first, 0.5, 1.0);
        p.cpu->gemm(A.second, ta, B.second, tb, C.second, 0.5, 1.0);
        EXPECT_LT(p.rel_rms(C), kTol) << M << "x" << N << "x" << K << " ta=" << ta << " tb=" << tb;
      }
}

TEST(CudaBackend, GemmBatched) {
  Pair p;
  auto A = p.randn({3, 16, 24}), B = p.randn({3, 32, 24}), C = p.poisoned({3, 16, 32});
  p.gpu->gemm_batched(A.first, false, B.first, true, C.first, 3);
  p.cpu->gemm_batched(A.second, false, B.second, true, C.second, 3);
  EXPECT_LT(p.rel_rms(C), kTol);
}

TEST(CudaBackend, ReductionsAndAxpy) {
  Pair p;
  auto x = p.randn({1000, 37}), y = p.randn({1000, 37});
  p.gpu->axpy(-0.3, x.first, y.first);
  p.cpu->axpy(-0.3, x.second, y.second);
  EXPECT_LT(p.rel_rms(y), kTol);
  double g = p.gpu->sum_squares(x.first), c = p.cpu->sum_squares(x.second);
  EXPECT_NEAR(g / c, 1.0, 1e-9);
  EXPECT_EQ(p.gpu->sum_squares(x.first), g) << "sum_squares must be bit-reproducible";
  EXPECT_TRUE(p.gpu->all_finite(x.first));
  float nan = NAN;
  p.gpu->upload(&nan, x.first.slice0(500, 1).view({37}).slice0(3, 1));
  EXPECT_FALSE(p.gpu->all_finite(x.first));
}

// sum_squares / all_finite on bf16 tensors (the linear layers' activations): n counts bf16
// elements. Each tensor is the front of a buffer whose rest holds NaN, so a kernel that read
// it as fp32 (twice its bytes) would see them; a NaN or Inf at the last element must be found
// through the 16-byte path (n % 8 == 0), the scalar tail (n odd) and a 2-byte-offset view.
TEST(CudaBackend, ReductionsOnBf16) {
  Pair p("mixed");
  for (int64_t n : {int64_t(4096) * 1024 + 8, int64_t(100003), int64_t(7)})
    for (int64_t off : {int64_t(0), int64_t(1)}) {
      Tensor g32 = p.ga.alloc(DType::f32, {2 * n + 16}), buf = p.ga.alloc(DType::bf16, {2 * n + 16});
      p.gpu->fill(g32, NAN);
      p.gpu->convert(g32, buf);
      std::normal_distribution<double> nd(0.0, 1.5);
      std::vector<float> h(n);
      double ref = 0;
      for (auto& x : h) x = Pair::round_bf16(static_cast<float>(nd(p.rng))), ref += double(x) * x;
      Tensor hx = p.ga.alloc(DType::f32, {n});
      const Tensor x(static_cast<char*>(buf.data) + 2 * off, DType::bf16, {n});
      p.gpu->upload(h.data(), hx);
      p.gpu->convert(hx, x);
      const double got = p.gpu->sum_squares(x);
      EXPECT_NEAR(got / ref, 1.0, 1e-12) << "n " << n << " offset " << off;
      EXPECT_EQ(p.gpu->sum_squares(x), got) << "bit-reproducible";
      EXPECT_TRUE(p.gpu->all_finite(x)) << "n " << n << " offset " << off;
      for (float bad : {NAN, INFINITY, -INFINITY}) {
        h[n - 1] = bad;
        p.gpu->upload(h.data(), hx);
        p.gpu->convert(hx, x);
        EXPECT_FALSE(p.gpu->all_finite(x)) << bad << " at the last of " << n << ", offset " << off;
        EXPECT_FALSE(std::isfinite(p.gpu->sum_squares(x))) << n;
      }
      h[n - 1] = 0.5f;
      p.gpu->upload(h.data(), hx);
      p.gpu->convert(hx, x);
      EXPECT_TRUE(p.gpu->all_finite(x)) << "finite again, n " << n;
    }
  // f32 still works through the same entry (a NaN at the last element of an odd count).
  auto x = p.randn({1001});
  EXPECT_TRUE(p.gpu->all_finite(x.first));
  float inf = INFINITY;
  p.gpu->upload(&inf, x.first.slice0(1000, 1));
  EXPECT_FALSE(p.gpu->all_finite(x.first));
  EXPECT_THROW(p.gpu->sum_squares(p.ga.alloc(DType::i32, {4})), lar::RuntimeError);
}

TEST(CudaBackend, Embedding) {
  Pair p;
  // 132 tokens over 50 ids (repeats and unused rows); 5000 tokens over 3000 ids, d = 200;
  // runs of ≈ 1000 equal ids (the device sort's long runs); d = 30: the one-column kernel.
  for (auto [N, V, d] : {std::tuple<int64_t, int, int64_t>{132, 50, 48}, {5000, 3000, 200}, {3001, 3, 36},
                         {700, 5, 30}}) {
    auto table = p.randn({V, d});
    auto ids = p.ids({N}, V);
    auto out = p.poisoned({N, d});
    p.gpu->embedding_fwd(ids.first, table.first, out.first);
    p.cpu->embedding_fwd(ids.second, table.second, out.second);
    EXPECT_LT(p.rel_rms(out), kTol);
    auto dout = p.randn({N, d});
    auto dtable = p.randn({V, d});
    p.gpu->embedding_bwd(ids.first, dout.first, dtable.first);
    p.cpu->embedding_bwd(ids.second, dout.second, dtable.second);
    EXPECT_LT(p.rel_rms(dtable), kTol) << N;
  }
}

TEST(CudaBackend, RmsNorm) {
  Pair p;
  // d % 4 == 0 and ≤ 1024: the warp-per-row kernels (4099 rows: several per warp);
  // d = 30 and 2048: the block-per-row fallback.
  for (auto [n, d] : {std::pair<int64_t, int64_t>{37, 64}, {37, 1000}, {37, 1024}, {4099, 96}, {37, 30}, {37, 2048}}) {
    auto x = p.randn({n, d}), w = p.randn({d}), y = p.poisoned({n, d}), r = p.poisoned({n});
    p.gpu->rmsnorm_fwd(x.first, w.first, y.first, r.first, 1e-6);
    p.cpu->rmsnorm_fwd(x.second, w.second, y.second, r.second, 1e-6);
    EXPECT_LT(p.rel_rms(y), kTol) << d;
    EXPECT_LT(p.rel_rms(r), kTol) << d;
    auto dy = p.randn({n, d}), dx = p.randn({n, d}), dw = p.randn({d});
    p.gpu->rmsnorm_bwd(x.first, w.first, r.first, dy.first, dx.first, dw.first);
    p.cpu->rmsnorm_bwd(x.second, w.second, r.second, dy.second, dx.second, dw.second);
    EXPECT_LT(p.rel_rms(dx), kTol) << d;
    EXPECT_LT(p.rel_rms(dw), kTol) << d;
  }
}

TEST(CudaBackend, SwiGLU) {
  Pair p;
  auto gu = p.randn({29, 2 * 88}), h = p.poisoned({29, 88});
  p.gpu->swiglu_fwd(gu.first, h.first);
  p.cpu->swiglu_fwd(gu.second, h.second);
  EXPECT_LT(p.rel_rms(h), kTol);
  auto dh = p.randn({29, 88}), dgu = p.poisoned({29, 2 * 88});
  p.gpu->swiglu_bwd(gu.first, dh.first, dgu.first);
  p.cpu->swiglu_bwd(gu.second, dh.second, dgu.second);
  EXPECT_LT(p.rel_rms(dgu), kTol);
}

TEST(CudaBackend, Rope) {
  Pair p;
  for (int64_t D : {64, 12}) {  // 16-byte groups of pairs (D/2 % 4 == 0) and the scalar kernel
    auto x = p.randn({2, 77, 3, D});
    p.gpu->rope_fwd(x.first, 5e5, 11);
    p.cpu->rope_fwd(x.second, 5e5, 11);
    EXPECT_LT(p.rel_rms(x), kTol) << D;
    p.gpu->rope_bwd(x.first, 5e5, 11);
    p.cpu->rope_bwd(x.second, 5e5, 11);
    EXPECT_LT(p.rel_rms(x), kTol) << D;
  }
}

TEST(CudaBackend, AttentionGqaWindowKvCache) {
  Pair p;
  struct Case { int64_t B, T, S, Hq, Hkv, D, Dv, window; };
  for (Case c : {Case{2, 65, 65, 4, 2, 64, 64, 0}, Case{1, 100, 100, 4, 1, 32, 48, 17},
                 Case{2, 9, 40, 2, 2, 128, 128, 0}}) {
    auto q = p.randn({c.B, c.T, c.Hq, c.D}), k = p.randn({c.B, c.S, c.Hkv, c.D});
    auto v = p.randn({c.B, c.S, c.Hkv, c.Dv});
    auto o = p.poisoned({c.B, c.T, c.Hq, c.Dv}), lse = p.poisoned({c.B, c.Hq, c.T});
    double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
    p.gpu->attention_fwd(q.first, k.first, v.first, o.first, lse.first, scale, c.window);
    p.cpu->attention_fwd(q.second, k.second, v.second, o.second, lse.second, scale, c.window);
    EXPECT_LT(p.rel_rms(o), kTol) << c.T << " " << c.window;
    EXPECT_LT(p.rel_rms(lse), kTol);
    auto dout = p.randn({c.B, c.T, c.Hq, c.Dv});
    auto dq = p.poisoned({c.B, c.T, c.Hq, c.D}), dk = p.poisoned({c.B, c.S, c.Hkv, c.D});
    auto dv = p.poisoned({c.B, c.S, c.Hkv, c.Dv});
    p.gpu->attention_bwd(q.first, k.first, v.first, o.first, lse.first, dout.first, dq.first, dk.first, dv.first,
                         scale, c.window);
    p.cpu->attention_bwd(q.second, k.second, v.second, o.second, lse.second, dout.second, dq.second, dk.second,
                         dv.second, scale, c.window);
    EXPECT_LT(p.rel_rms(dq), kTol);
    EXPECT_LT(p.rel_rms(dk), kTol);
    EXPECT_LT(p.rel_rms(dv), kTol);
  }
}

TEST(CudaBackend, CrossEntropy) {
  Pair p;
  int64_t N = 45, V = 3001;
  auto logits = p.randn({N, V}, 3.0);
  auto tg = p.ids({N}, static_cast<int>(V));
  auto mask = p.randn({N});
  auto losses = p.poisoned({N});
  Tensor ag = p.ga.alloc(DType::i32, {N}), ac = p.ca.alloc(DType::i32, {N});
  double g = p.gpu->cross_entropy_fwd(logits.first, tg.first, mask.first, losses.first, ag);
  double c = p.cpu->cross_entropy_fwd(logits.second, tg.second, mask.second, losses.second, ac);
  EXPECT_NEAR(g, c, 1e-5 * std::abs(c) + 1e-6);
  EXPECT_LT(p.rel_rms(losses), kTol);
  std::vector<int32_t> hg(N), hc(N);
  p.gpu->download(ag, hg.data());
  p.cpu->download(ac, hc.data());
  EXPECT_EQ(hg, hc);
  auto dl = p.poisoned({N, V});
  p.gpu->cross_entropy_bwd(logits.first, tg.first, mask.first, 0.25, dl.first);
  p.cpu->cross_entropy_bwd(logits.second, tg.second, mask.second, 0.25, dl.second);
  EXPECT_LT(p.rel_rms(dl), kTol);
}

// Mixed precision: bf16-product GEMMs (≈3e-3 relative; TF32 ≈3e-4) and the bf16 flash
// attention (head dims 64 and 128) behind the same fp32 tensors, at the bf16
// tolerance 1e-2.
TEST(CudaBackend, MixedPrecisionGemmAndFlashAttention) {
  Pair p("mixed");
  for (bool ta : {false, true}) {
    Pair t("tf32");
    const int64_t M = 300, N = 257, K = 520;
    auto A = t.randn(ta ? std::vector<int64_t>{K, M} : std::vector<int64_t>{M, K});
    auto B = t.randn({N, K});
    auto C = t.randn({M, N});
    t.gpu->gemm(A.first, ta, B.first, true, C.first, 1.0, 0.5);
    t.cpu->gemm(A.second, ta, B.second, true, C.second, 1.0, 0.5);
    EXPECT_LT(t.rel_rms(C), 2e-3) << "tf32";
  }
  for (bool ta : {false, true}) {
    const int64_t M = 300, N = 257, K = 520;
    auto A = p.randn(ta ? std::vector<int64_t>{K, M} : std::vector<int64_t>{M, K});
    auto B = p.randn({N, K});
    auto C = p.randn({M, N});
    p.gpu->gemm(A.first, ta, B.first, true, C.first, 1.0, 0.5);
    p.cpu->gemm(A.second, ta, B.second, true, C.second, 1.0, 0.5);
    EXPECT_LT(p.rel_rms(C), 1e-2) << "bf16";
    EXPECT_GT(p.rel_rms(C), 1e-5) << "bf16 products must differ from fp32";
  }
  struct Case { int64_t B, T, S, Hq, Hkv, D, window; };
  for (Case c : {Case{2, 200, 200, 4, 2, 64, 0}, Case{1, 130, 130, 4, 1, 128, 37}, Case{2, 33, 100, 2, 2, 64, 0}}) {
    auto q = p.randn({c.B, c.T, c.Hq, c.D}), k = p.randn({c.B, c.S, c.Hkv, c.D});
    auto v = p.randn({c.B, c.S, c.Hkv, c.D});
    auto o = p.poisoned({c.B, c.T, c.Hq, c.D}), lse = p.poisoned({c.B, c.Hq, c.T});
    double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
    p.gpu->attention_fwd(q.first, k.first, v.first, o.first, lse.first, scale, c.window);
    p.cpu->attention_fwd(q.second, k.second, v.second, o.second, lse.second, scale, c.window);
    EXPECT_LT(p.rel_rms(o), 1e-2) << c.T << " " << c.D;
    EXPECT_LT(p.rel_rms(lse), 1e-2);
    auto dout = p.randn({c.B, c.T, c.Hq, c.D});
    auto dq = p.poisoned({c.B, c.T, c.Hq, c.D}), dk = p.poisoned({c.B, c.S, c.Hkv, c.D});
    auto dv = p.poisoned({c.B, c.S, c.Hkv, c.D});
    p.gpu->attention_bwd(q.first, k.first, v.first, o.first, lse.first, dout.first, dq.first, dk.first, dv.first,
                         scale, c.window);
    p.cpu->attention_bwd(q.second, k.second, v.second, o.second, lse.second, dout.second, dq.second, dk.second,
                         dv.second, scale, c.window);
    EXPECT_LT(p.rel_rms(dq), 1e-2) << c.T << " " << c.D;
    EXPECT_LT(p.rel_rms(dk), 1e-2);
    EXPECT_LT(p.rel_rms(dv), 1e-2);
  }
}

// bf16 activation storage (Backend::act_dtype() in mixed precision): every op that takes
// bf16 tensors against the fp64 CPU reference on the same (bf16-representable) inputs.
TEST(CudaBackend, Bf16StorageOps) {
  Pair p("mixed");
  ASSERT_EQ(p.gpu->act_dtype(), DType::bf16);
  {  // convert: f32 → bf16 rounds to nearest even, bf16 → f32 is exact
    std::vector<float> h = {1.0f, 1.00390625f, 1.01171875f, -3.3f, 1e-3f, 65504.f};
    Tensor a = p.ga.alloc(DType::f32, {6}), b = p.ga.alloc(DType::bf16, {6}), c = p.ga.alloc(DType::f32, {6});
    p.gpu->upload(h.data(), a);
    p.gpu->convert(a, b);
    p.gpu->convert(b, c);
    std::vector<float> back(6);
    p.gpu->download(c, back.data());
    for (int i = 0; i < 6; ++i) EXPECT_EQ(back[i], Pair::round_bf16(h[i])) << i;
    EXPECT_EQ(back[1], 1.0f) << "ties round to even";
  }
  // GEMMs: bf16 A, weights B through the bf16 mirror, C in bf16 and f32 (β = 0.5).
  const int64_t M = 300, N = 264, K = 520;
  auto W = p.randn({N + 8, K});  // the registered "weights"; B is a view into them
  p.gpu->register_weights(W.first);
  Tensor Bg = W.first.slice0(8, N), Bc = W.second.slice0(8, N);
  for (bool ta : {false, true}) {
    auto A = p.randn_bf16(ta ? std::vector<int64_t>{K, M} : std::vector<int64_t>{M, K});
    auto C = p.randn({M, N});
    p.gpu->gemm(A.first, ta, Bg, true, C.first, 1.0, 0.5);
    p.cpu->gemm(A.second, ta, Bc, true, C.second, 1.0, 0.5);
    EXPECT_LT(p.rel_rms(C), 1e-2) << "f32 C, ta=" << ta;
    auto Cb = p.poisoned_bf16({M, N});
    p.gpu->gemm(A.first, ta, Bg, true, Cb.first);
    p.cpu->gemm(A.second, ta, Bc, true, Cb.second);
    EXPECT_LT(p.rel_rms(Cb), 1e-2) << "bf16 C, ta=" << ta;
  }
  {  // the mirror follows writes into the weights (upload, optimiser-style scale)
    auto A = p.randn_bf16({M, K});
    auto C = p.poisoned({M, N});
    auto fresh = p.randn({N + 8, K});
    p.gpu->copy(fresh.first, W.first);
    p.cpu->copy(fresh.second, W.second);
    p.gpu->scale(W.first, -2.0);
    p.cpu->scale(W.second, -2.0);
    p.gpu->gemm(A.first, false, Bg, true, C.first);
    p.cpu->gemm(A.second, false, Bc, true, C.second);
    EXPECT_LT(p.rel_rms(C), 1e-2) << "stale bf16 mirror";
  }
  for (int64_t d : {64, 1000, 1024}) {  // RMSNorm with bf16 output, fused residual add
    const int64_t n = 37;
    auto x = p.randn({n, d}), r = p.randn({n, d}), w = p.randn({d});
    auto y = p.poisoned_bf16({n, d}), rs = p.poisoned({n});
    p.gpu->rmsnorm_fwd(x.first, w.first, y.first, rs.first, 1e-6);
    p.cpu->rmsnorm_fwd(x.second, w.second, y.second, rs.second, 1e-6);
    EXPECT_LT(p.rel_rms(y), 1e-2) << d;
    EXPECT_LT(p.rel_rms(rs), kTol) << d;
    auto h = p.poisoned({n, d}), yf = p.poisoned({n, d}), yb = p.poisoned_bf16({n, d});
    p.gpu->add_rmsnorm_fwd(x.first, r.first, h.first, w.first, yf.first, rs.first, 1e-6);
    p.cpu->add_rmsnorm_fwd(x.second, r.second, h.second, w.second, yf.second, rs.second, 1e-6);
    EXPECT_LT(p.rel_rms(h), kTol) << d;
    EXPECT_LT(p.rel_rms(yf), kTol) << d;
    EXPECT_LT(p.rel_rms(rs), kTol) << d;
    p.gpu->add_rmsnorm_fwd(x.first, r.first, x.first, w.first, yb.first, rs.first, 1e-6);  // h aliases x
    p.cpu->add_rmsnorm_fwd(x.second, r.second, x.second, w.second, yb.second, rs.second, 1e-6);
    EXPECT_LT(p.rel_rms(x), kTol) << d;
    EXPECT_LT(p.rel_rms(yb), 1e-2) << d;
  }
  for (int64_t f : {88, 2816, 45}) {  // SwiGLU: the 16-byte path (f % 8 == 0) and the scalar one
    const int64_t n = 29;
    auto gu = p.randn_bf16({n, 2 * f}, 2.0), h = p.poisoned_bf16({n, f});
    p.gpu->swiglu_fwd(gu.first, h.first);
    p.cpu->swiglu_fwd(gu.second, h.second);
    EXPECT_LT(p.rel_rms(h), 1e-2) << f;
    auto dh = p.randn_bf16({n, f}), dgu = p.poisoned_bf16({n, 2 * f});
    p.gpu->swiglu_bwd(gu.first, dh.first, dgu.first);
    p.cpu->swiglu_bwd(gu.second, dh.second, dgu.second);
    EXPECT_LT(p.rel_rms(dgu), 1e-2) << f;
    auto dhf = p.randn({n, f}), dgu2 = p.poisoned_bf16({n, 2 * f});  // f32 dh with bf16 gu
    p.gpu->swiglu_bwd(gu.first, dhf.first, dgu2.first);
    p.cpu->swiglu_bwd(gu.second, dhf.second, dgu2.second);
    EXPECT_LT(p.rel_rms(dgu2), 1e-2) << f;
  }
  {  // RoPE in place on bf16 (the table is cached between calls: two positions offsets)
    for (int64_t pos0 : {0, 11, 11}) {
      auto x = p.randn_bf16({2, 77, 3, 64});
      p.gpu->rope_fwd(x.first, 5e5, pos0);
      p.cpu->rope_fwd(x.second, 5e5, pos0);
      EXPECT_LT(p.rel_rms(x), 1e-2) << pos0;
      p.gpu->rope_bwd(x.first, 5e5, pos0);
      p.cpu->rope_bwd(x.second, 5e5, pos0);
      EXPECT_LT(p.rel_rms(x), 1e-2) << pos0;
    }
  }
  {  // cross-entropy backward into bf16 dlogits
    const int64_t n = 45, V = 3001;
    auto logits = p.randn({n, V}, 3.0);
    auto tg = p.ids({n}, static_cast<int>(V));
    auto mask = p.randn({n});
    auto dl = p.poisoned_bf16({n, V});
    p.gpu->cross_entropy_bwd(logits.first, tg.first, mask.first, 0.25, dl.first);
    p.cpu->cross_entropy_bwd(logits.second, tg.second, mask.second, 0.25, dl.second);
    EXPECT_LT(p.rel_rms(dl), 1e-2);
  }
  // Attention on bf16 tensors: the flash kernels directly (D = 64, 128) and the fp32
  // fallback for other head dims (D = 32).
  struct Case { int64_t B, T, S, Hq, Hkv, D, window; };
  for (Case c : {Case{2, 200, 200, 4, 2, 64, 0}, Case{1, 130, 130, 4, 1, 128, 37}, Case{2, 33, 100, 2, 2, 64, 0},
                 Case{1, 70, 70, 4, 2, 32, 9}}) {
    auto q = p.randn_bf16({c.B, c.T, c.Hq, c.D}), k = p.randn_bf16({c.B, c.S, c.Hkv, c.D});
    auto v = p.randn_bf16({c.B, c.S, c.Hkv, c.D});
    auto o = p.poisoned_bf16({c.B, c.T, c.Hq, c.D}), lse = p.poisoned({c.B, c.Hq, c.T});
    double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
    p.gpu->attention_fwd(q.first, k.first, v.first, o.first, lse.first, scale, c.window);
    p.cpu->attention_fwd(q.second, k.second, v.second, o.second, lse.second, scale, c.window);
    EXPECT_LT(p.rel_rms(o), 1e-2) << c.T << " " << c.D;
    EXPECT_LT(p.rel_rms(lse), 1e-2);
    // The backward's o: the GPU's own bf16 o, and the CPU its exact widening.
    std::vector<float> ho(o.first.numel());
    Tensor ow = p.ga.alloc(DType::f32, o.first.shape());
    p.gpu->convert(o.first, ow);
    p.gpu->download(ow, ho.data());
    std::vector<double> hd(ho.begin(), ho.end());
    p.cpu->upload(hd.data(), o.second);
    auto dout = p.randn_bf16({c.B, c.T, c.Hq, c.D});
    auto dq = p.poisoned_bf16({c.B, c.T, c.Hq, c.D}), dk = p.poisoned_bf16({c.B, c.S, c.Hkv, c.D});
    auto dv = p.poisoned_bf16({c.B, c.S, c.Hkv, c.D});
    p.gpu->attention_bwd(q.first, k.first, v.first, o.first, lse.first, dout.first, dq.first, dk.first, dv.first,
                         scale, c.window);
    p.cpu->attention_bwd(q.second, k.second, v.second, o.second, lse.second, dout.second, dq.second, dk.second,
                         dv.second, scale, c.window);
    EXPECT_LT(p.rel_rms(dq), 1e-2) << c.T << " " << c.D;
    EXPECT_LT(p.rel_rms(dk), 1e-2);
    EXPECT_LT(p.rel_rms(dv), 1e-2);
  }
}

// The fp32 path of the fused residual add + RMSNorm (the default precision "fp32").
TEST(CudaBackend, AddRmsNormFp32) {
  Pair p;
  EXPECT_EQ(p.gpu->act_dtype(), DType::f32);
  auto x = p.randn({4099, 96}), r = p.randn({4099, 96}), w = p.randn({96});
  auto h = p.poisoned({4099, 96}), y = p.poisoned({4099, 96}), rs = p.poisoned({4099});
  p.gpu->add_rmsnorm_fwd(x.first, r.first, h.first, w.first, y.first, rs.first, 1e-5);
  p.cpu->add_rmsnorm_fwd(x.second, r.second, h.second, w.second, y.second, rs.second, 1e-5);
  EXPECT_LT(p.rel_rms(h), kTol);
  EXPECT_LT(p.rel_rms(y), kTol);
  EXPECT_LT(p.rel_rms(rs), kTol);
}

// The fused cross-entropy forward + backward (one pass over each row in shared memory),
// f32 and bf16 dlogits, against the CPU's separate forward and backward.
TEST(CudaBackend, CrossEntropyFusedForwardBackward) {
  for (const char* precision : {"fp32", "mixed"}) {
    Pair p(precision);
    const int64_t N = 37, V = 32000;
    auto logits = p.randn({N, V}, 3.0);
    auto tg = p.ids({N}, static_cast<int>(V));
    auto mask = p.randn({N});
    auto losses = p.poisoned({N});
    auto dl = p.poisoned({N, V});
    const double g = p.gpu->cross_entropy_fwd_bwd(logits.first, tg.first, mask.first, losses.first, 0.5, dl.first);
    const double c = p.cpu->cross_entropy_fwd_bwd(logits.second, tg.second, mask.second, losses.second, 0.5, dl.second);
    EXPECT_NEAR(g, c, 1e-5 * std::abs(c) + 1e-6) << precision;
    EXPECT_LT(p.rel_rms(losses), kTol) << precision;
    EXPECT_LT(p.rel_rms(dl), kTol) << precision;
    if (std::string(precision) == "mixed") {
      auto dlb = p.poisoned_bf16({N, V});
      const double gb = p.gpu->cross_entropy_fwd_bwd(logits.first, tg.first, mask.first, losses.first, 0.5, dlb.first);
      EXPECT_NEAR(gb, c, 1e-5 * std::abs(c) + 1e-6);
      EXPECT_LT(p.rel_rms({dlb.first, dl.second}), 1e-2);  // against the CPU's dlogits
    }
  }
}

// One q/k/v GEMM output split into q, k (RoPE) and v, and the transpose that merges the
// gradients back (RoPE undone): fp32 and bf16 storage against the CPU.
TEST(CudaBackend, RopeSplitMergeQkv) {
  for (const char* precision : {"fp32", "mixed"}) {
    Pair p(precision);
    const bool bf = std::string(precision) == "mixed";
    const double tol = bf ? 1e-2 : kTol;
    const int64_t B = 2, T = 37, Hq = 4, Hkv = 2;
    auto mk = [&](std::vector<int64_t> s) { return bf ? p.randn_bf16(s) : p.randn(s); };
    auto out = [&](std::vector<int64_t> s) { return bf ? p.poisoned_bf16(s) : p.poisoned(s); };
    // D = 64: 16-byte groups of pairs per thread; D = 20: the scalar kernel.
    for (auto [pos0, D] : {std::pair<int64_t, int64_t>{0, 64}, {5, 64}, {3, 20}}) {
      auto qkv = mk({B, T, Hq + 2 * Hkv, D});
      auto q = out({B, T, Hq, D}), k = out({B, T, Hkv, D}), v = out({B, T, Hkv, D});
      p.gpu->rope_split_qkv(qkv.first, q.first, k.first, v.first, 1e4, pos0);
      p.cpu->rope_split_qkv(qkv.second, q.second, k.second, v.second, 1e4, pos0);
      EXPECT_LT(p.rel_rms(q), tol) << precision << " " << pos0;
      EXPECT_LT(p.rel_rms(k), tol) << precision << " " << pos0;
      EXPECT_LT(p.rel_rms(v), bf ? 1e-7 : kTol) << "v is copied exactly";
      auto dq = mk({B, T, Hq, D}), dk = mk({B, T, Hkv, D}), dv = mk({B, T, Hkv, D});
      auto dqkv = out({B, T, Hq + 2 * Hkv, D});
      p.gpu->rope_merge_qkv(dq.first, dk.first, dv.first, dqkv.first, 1e4, pos0);
      p.cpu->rope_merge_qkv(dq.second, dk.second, dv.second, dqkv.second, 1e4, pos0);
      EXPECT_LT(p.rel_rms(dqkv), tol) << precision << " " << pos0;
    }
  }
}

// The arena's block grows in place on the GPU (reserved address space, memory mapped on
// demand): an overflow continues the same block, the bytes are usable across the mapped
// chunks, and the device memory high-water mark follows the bytes used (not 2× them).
TEST(CudaBackend, ArenaGrowsInPlace) {
  auto gpu = make_backend("cuda", 1, DType::f32, with_precision("mixed"));
  const std::size_t before = gpu->device_peak_bytes();
  Arena ar(*gpu);
  Tensor a = ar.alloc(DType::f32, {1000});  // the first block (1 MiB)
  const int64_t n = int64_t(50) << 20;       // 200 MiB: overflows it
  Tensor b = ar.alloc(DType::f32, {n});
  Tensor c = ar.alloc(DType::f32, {16});
  EXPECT_EQ(static_cast<char*>(b.data) - static_cast<char*>(a.data), 4032) << "grown in place";
  EXPECT_EQ(static_cast<char*>(c.data) - static_cast<char*>(b.data), n * 4);
  gpu->fill(b, 3.0);
  gpu->fill(c, -1.0);
  std::vector<float> tail(16), head(16), cc(16);
  gpu->download(b.slice0(n - 16, 16), tail.data());
  gpu->download(b.slice0(0, 16), head.data());
  gpu->download(c, cc.data());
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(tail[i], 3.0f);
    EXPECT_EQ(head[i], 3.0f);
    EXPECT_EQ(cc[i], -1.0f);
  }
  const std::size_t used = 4032 + n * 4 + 64;
  EXPECT_LE(gpu->device_peak_bytes() - before, used + (std::size_t(34) << 20)) << "no doubling";
  EXPECT_GE(gpu->device_peak_bytes() - before, used);
  ar.reset();  // one block already: kept, and the same addresses come back
  Tensor a2 = ar.alloc(DType::f32, {1000});
  Tensor b2 = ar.alloc(DType::f32, {n});
  EXPECT_EQ(a2.data, a.data);
  EXPECT_EQ(b2.data, b.data);
}

namespace {
// Bitwise equality of two tensors of one dtype (the fused paths must give the unfused bits).
bool same_bits(Backend& be, const Tensor& a, const Tensor& b) {
  if (a.bytes() != b.bytes()) return false;
  std::vector<char> x(a.bytes()), y(b.bytes());
  be.download(a, x.data());
  be.download(b, y.data());
  return x == y;
}
}  // namespace

// The one-pass norm backward (dx, dw and the bf16 copy of dx in one kernel; bf16 dy), the
// residual add with a bf16 branch output, at the warp-per-row shapes and the fallbacks.
TEST(CudaBackend, FusedNormPassesBf16) {
  Pair p("mixed");
  for (auto [n, d] : {std::pair<int64_t, int64_t>{37, 64}, {4099, 1024}, {37, 1000}, {37, 30}, {37, 2048}}) {
    auto x = p.randn({n, d}), w = p.randn({d});
    auto y = p.poisoned_bf16({n, d}), rs = p.poisoned({n});
    p.gpu->rmsnorm_fwd(x.first, w.first, y.first, rs.first, 1e-5);
    p.cpu->rmsnorm_fwd(x.second, w.second, y.second, rs.second, 1e-5);
    EXPECT_LT(p.rel_rms(rs), kTol) << d;
    auto dy = p.randn_bf16({n, d});
    auto dx = p.randn({n, d}), dw = p.randn({d});
    auto dx_a = p.poisoned_bf16({n, d});
    p.gpu->rmsnorm_bwd_convert(x.first, w.first, rs.first, dy.first, dx.first, dw.first, dx_a.first);
    p.cpu->rmsnorm_bwd_convert(x.second, w.second, rs.second, dy.second, dx.second, dw.second, dx_a.second);
    EXPECT_LT(p.rel_rms(dx), kTol) << "bf16 dy, f32 math: " << n << "x" << d;
    EXPECT_LT(p.rel_rms(dw), kTol) << n << "x" << d;
    EXPECT_LT(p.rel_rms(dx_a), 1e-2) << n << "x" << d;
    Tensor conv = p.ga.alloc(DType::bf16, {n, d});
    p.gpu->convert(dx.first, conv);
    EXPECT_TRUE(same_bits(*p.gpu, conv, dx_a.first)) << "dx_act is exactly convert(dx): " << d;
    // The plain backward with bf16 dy, twice from the same inputs: the same bits.
    auto dx2 = p.randn({n, d}), dw2 = p.randn({d});
    Tensor dx3 = p.ga.alloc(DType::f32, {n, d}), dw3 = p.ga.alloc(DType::f32, {d});
    p.gpu->copy(dx2.first, dx3);
    p.gpu->copy(dw2.first, dw3);
    p.gpu->rmsnorm_bwd(x.first, w.first, rs.first, dy.first, dx2.first, dw2.first);
    p.gpu->rmsnorm_bwd(x.first, w.first, rs.first, dy.first, dx3, dw3);
    p.cpu->rmsnorm_bwd(x.second, w.second, rs.second, dy.second, dx2.second, dw2.second);
    EXPECT_LT(p.rel_rms(dx2), kTol) << d;
    EXPECT_LT(p.rel_rms(dw2), kTol) << d;
    EXPECT_TRUE(same_bits(*p.gpu, dx2.first, dx3) && same_bits(*p.gpu, dw2.first, dw3)) << "deterministic " << d;
    // h = x + r with r in bf16 (the branch output), y in bf16; h aliasing x.
    auto r = p.randn_bf16({n, d});
    auto h = p.poisoned({n, d}), yb = p.poisoned_bf16({n, d});
    p.gpu->add_rmsnorm_fwd(x.first, r.first, h.first, w.first, yb.first, rs.first, 1e-5);
    p.cpu->add_rmsnorm_fwd(x.second, r.second, h.second, w.second, yb.second, rs.second, 1e-5);
    EXPECT_LT(p.rel_rms(h), kTol) << d;
    EXPECT_LT(p.rel_rms(rs), kTol) << d;
    EXPECT_LT(p.rel_rms(yb), 1e-2) << d;
    p.gpu->add_rmsnorm_fwd(x.first, r.first, x.first, w.first, yb.first, rs.first, 1e-5);
    p.cpu->add_rmsnorm_fwd(x.second, r.second, x.second, w.second, yb.second, rs.second, 1e-5);
    EXPECT_LT(p.rel_rms(x), kTol) << d;
    EXPECT_LT(p.rel_rms(yb), 1e-2) << d;
  }
}

// The one-pass norm backward (the cp.async pipeline where its buffers fit, else the
// register-staged kernel) against the CPU: plain (f32 and bf16 dy) and x0 + r (bf16 and f32
// r), more rows than the pipeline's grid has warps (several rows per warp, a ragged last
// round), d = 1024 / 256 / 64 (the pipeline) / 1000 (d % 8 ≠ 0: the register kernel); x0 + r
// bit-equal to the plain backward of the stored sum, and twice from the same inputs the same
// bits.
TEST(CudaBackend, NormBackwardPaths) {
  Pair p("mixed");
  for (auto [n, d] : {std::pair<int64_t, int64_t>{2113, 1024}, {1111, 256}, {1500, 64}, {77, 1000}})
    for (int variant = 0; variant < 4; ++variant) {  // 0 plain bf16 dy, 1 plain f32 dy, 2 bf16 r, 3 f32 r
      auto x = p.randn({n, d}), w = p.randn({d});
      auto r = variant == 3 ? p.randn({n, d}) : p.randn_bf16({n, d});
      auto h = p.poisoned({n, d}), y = p.poisoned_bf16({n, d}), rs = p.poisoned({n});
      if (variant >= 2) {
        p.gpu->add_rmsnorm_fwd(x.first, r.first, h.first, w.first, y.first, rs.first, 1e-5);
        p.cpu->add_rmsnorm_fwd(x.second, r.second, h.second, w.second, y.second, rs.second, 1e-5);
      } else {
        p.gpu->rmsnorm_fwd(x.first, w.first, y.first, rs.first, 1e-5);
        p.cpu->rmsnorm_fwd(x.second, w.second, y.second, rs.second, 1e-5);
      }
      auto dy = variant == 1 ? p.randn({n, d}) : p.randn_bf16({n, d});
      auto dx = p.randn({n, d}), dw = p.randn({d});
      auto dx_a = p.poisoned_bf16({n, d});
      Tensor dx0 = p.ga.alloc(DType::f32, {n, d}), dw0 = p.ga.alloc(DType::f32, {d});
      p.gpu->copy(dx.first, dx0);
      p.gpu->copy(dw.first, dw0);
      if (variant >= 2)
        p.cpu->add_rmsnorm_bwd_convert(x.second, r.second, w.second, rs.second, dy.second, dx.second, dw.second,
                                       dx_a.second);
      else
        p.cpu->rmsnorm_bwd_convert(x.second, w.second, rs.second, dy.second, dx.second, dw.second, dx_a.second);
      Tensor dx2 = p.ga.alloc(DType::f32, {n, d}), dw2 = p.ga.alloc(DType::f32, {d});
      Tensor dx_a2 = p.ga.alloc(DType::bf16, {n, d});
      {
        const std::string what = std::string(d % 8 ? "rows" : "pipe") + " " + std::to_string(n) + "x" + std::to_string(d) + " variant " +
                                 std::to_string(variant);
        for (auto [a, b] : {std::pair<Tensor, Tensor>{dx0, dx.first}, {dw0, dw.first}, {dx0, dx2}, {dw0, dw2}})
          p.gpu->copy(a, b);
        if (variant >= 2) {
          p.gpu->add_rmsnorm_bwd_convert(x.first, r.first, w.first, rs.first, dy.first, dx.first, dw.first, dx_a.first);
          p.gpu->rmsnorm_bwd_convert(h.first, w.first, rs.first, dy.first, dx2, dw2, dx_a2);
        } else {
          p.gpu->rmsnorm_bwd_convert(x.first, w.first, rs.first, dy.first, dx.first, dw.first, dx_a.first);
          p.gpu->rmsnorm_bwd_convert(x.first, w.first, rs.first, dy.first, dx2, dw2, dx_a2);
        }
        EXPECT_LT(p.rel_rms(dx), kTol) << what;
        EXPECT_LT(p.rel_rms(dw), kTol) << what;
        EXPECT_LT(p.rel_rms(dx_a), 1e-2) << what;
        EXPECT_TRUE(same_bits(*p.gpu, dx.first, dx2)) << what;
        EXPECT_TRUE(same_bits(*p.gpu, dw.first, dw2)) << what;
        EXPECT_TRUE(same_bits(*p.gpu, dx_a.first, dx_a2)) << what;
      }
    }
}

// swiglu_bwd_fwd: the backward and the recomputed hidden from one read of gate·up — the
// same bits as swiglu_bwd + swiglu_fwd (16-byte path), and the CPU's values.
TEST(CudaBackend, SwigluBackwardWithHidden) {
  Pair p("mixed");
  for (int64_t f : {2816, 88, 45}) {
    const int64_t n = 29;
    auto gu = p.randn_bf16({n, 2 * f}, 2.0), dh = p.randn_bf16({n, f});
    auto dgu = p.poisoned_bf16({n, 2 * f}), h = p.poisoned_bf16({n, f});
    p.gpu->swiglu_bwd_fwd(gu.first, dh.first, dgu.first, h.first);
    p.cpu->swiglu_bwd_fwd(gu.second, dh.second, dgu.second, h.second);
    EXPECT_LT(p.rel_rms(dgu), 1e-2) << f;
    EXPECT_LT(p.rel_rms(h), 1e-2) << f;
    Tensor dgu2 = p.ga.alloc(DType::bf16, {n, 2 * f}), h2 = p.ga.alloc(DType::bf16, {n, f});
    p.gpu->swiglu_fwd(gu.first, h2);
    p.gpu->swiglu_bwd(gu.first, dh.first, dgu2);
    EXPECT_TRUE(same_bits(*p.gpu, h.first, h2)) << f;
    EXPECT_TRUE(same_bits(*p.gpu, dgu.first, dgu2)) << f;
  }
}

// Cross-entropy on bf16 logits (the head GEMM's bf16 output): the fused forward+backward in
// place (row in registers for V % 8 == 0: V = 32000 and 50000; shared-memory kernel for
// V = 3001) and into a separate buffer, the forward with argmax, and the backward.
TEST(CudaBackend, CrossEntropyBf16Logits) {
  Pair p("mixed");
  for (int64_t V : {32000, 50000, 3001}) {
    const int64_t N = 37;
    auto logits = p.randn_bf16({N, V}, 3.0);
    auto tg = p.ids({N}, static_cast<int>(V));
    auto mask = p.randn({N});
    auto losses = p.poisoned({N});
    Tensor keep = p.ga.alloc(DType::bf16, {N, V});
    p.gpu->copy(logits.first, keep);
    {  // forward with argmax; backward into bf16 from bf16 logits
      Tensor ag = p.ga.alloc(DType::i32, {N}), ac = p.ca.alloc(DType::i32, {N});
      const double g = p.gpu->cross_entropy_fwd(logits.first, tg.first, mask.first, losses.first, ag);
      const double c = p.cpu->cross_entropy_fwd(logits.second, tg.second, mask.second, losses.second, ac);
      EXPECT_NEAR(g, c, 1e-5 * std::abs(c) + 1e-6) << V;
      EXPECT_LT(p.rel_rms(losses), kTol) << V;
      std::vector<int32_t> hg(N), hc(N);
      p.gpu->download(ag, hg.data());
      p.cpu->download(ac, hc.data());
      EXPECT_EQ(hg, hc) << V;
      auto dl = p.poisoned_bf16({N, V});
      p.gpu->cross_entropy_bwd(logits.first, tg.first, mask.first, 0.25, dl.first);
      p.cpu->cross_entropy_bwd(logits.second, tg.second, mask.second, 0.25, dl.second);
      EXPECT_LT(p.rel_rms(dl), 1e-2) << V;
    }
    auto dl = p.poisoned_bf16({N, V});
    const double c = p.cpu->cross_entropy_fwd_bwd(logits.second, tg.second, mask.second, losses.second, 0.5, dl.second);
    const double g = p.gpu->cross_entropy_fwd_bwd(logits.first, tg.first, mask.first, losses.first, 0.5, dl.first);
    EXPECT_NEAR(g, c, 1e-5 * std::abs(c) + 1e-6) << V;
    EXPECT_LT(p.rel_rms(losses), kTol) << V;
    EXPECT_LT(p.rel_rms(dl), 1e-2) << V;
    // In place: dlogits over the logits, the same bits as into a separate buffer.
    const double gi = p.gpu->cross_entropy_fwd_bwd(logits.first, tg.first, mask.first, losses.first, 0.5, logits.first);
    EXPECT_EQ(gi, g) << V;
    EXPECT_TRUE(same_bits(*p.gpu, logits.first, dl.first)) << "in place " << V;
    // Deterministic: the same inputs again give the same bits.
    auto dl2 = p.poisoned_bf16({N, V});
    EXPECT_EQ(p.gpu->cross_entropy_fwd_bwd(keep, tg.first, mask.first, losses.first, 0.5, dl2.first), g) << V;
    EXPECT_TRUE(same_bits(*p.gpu, dl2.first, dl.first)) << V;
  }
  // 301 rows (more than two blocks per SM), with a masked-out row: the CPU's values, in
  // place = into a separate buffer bit for bit.
  for (int64_t V : {32000, 1000}) {
    const int64_t N = 301;
    auto logits = p.randn_bf16({N, V}, 3.0);
    auto tg = p.ids({N}, static_cast<int>(V));
    auto mask = p.randn({N});
    const float zero = 0.f;
    const double dz = 0;
    p.gpu->upload(&zero, mask.first.slice0(7, 1));
    p.cpu->upload(&dz, mask.second.slice0(7, 1));
    Tensor keep = p.ga.alloc(DType::bf16, {N, V}), l2 = p.ga.alloc(DType::f32, {N});
    p.gpu->copy(logits.first, keep);
    auto losses = p.poisoned({N});
    auto dl = p.poisoned_bf16({N, V});
    const double g = p.gpu->cross_entropy_fwd_bwd(logits.first, tg.first, mask.first, losses.first, 0.5, dl.first);
    const double c = p.cpu->cross_entropy_fwd_bwd(logits.second, tg.second, mask.second, losses.second, 0.5, dl.second);
    EXPECT_NEAR(g, c, 1e-5 * std::abs(c) + 1e-6) << V;
    EXPECT_LT(p.rel_rms(losses), kTol) << V;
    EXPECT_LT(p.rel_rms(dl), 1e-2) << V;
    EXPECT_EQ(p.gpu->cross_entropy_fwd_bwd(keep, tg.first, mask.first, l2, 0.5, keep), g) << V;
    EXPECT_TRUE(same_bits(*p.gpu, keep, dl.first)) << "in place " << V;
    EXPECT_TRUE(same_bits(*p.gpu, l2, losses.first)) << V;
  }
}

// AdamW inside the registered weights also writes their bf16 mirror (no refresh pass): a GEMM
// right after the step sees the new weights — vectorised (aligned) and scalar (odd offset)
// paths, and the f32 results equal the same update outside the weights.
TEST(CudaBackend, AdamWKeepsTheWeightMirrorFresh) {
  Pair p("mixed");
  const int64_t M = 64, N = 96, K = 72;
  auto W = p.randn({N + 1, K});
  p.gpu->register_weights(W.first);
  auto A = p.randn_bf16({M, K});
  auto C0 = p.poisoned({M, N});
  Tensor Bg = W.first.slice0(1, N), Bc = W.second.slice0(1, N);
  p.gpu->gemm(A.first, false, Bg, true, C0.first);  // the mirror is fresh now
  Backend::AdamWStep s;
  s.step_size = 0.5f;
  s.decay = 0.99f;
  for (int64_t off : {K, 3 + K}) {  // rows 1… (16-byte aligned), then an odd element offset
    const int64_t n = N * K - 3;
    Tensor w = Tensor(static_cast<float*>(W.first.data) + off, DType::f32, {n});
    auto g = p.randn({n}), m = p.randn({n}, 0.1), v = p.randn({n}, 0.1);
    std::vector<float> hv(n);
    p.gpu->download(v.first, hv.data());
    for (float& x : hv) x = std::abs(x);
    p.gpu->upload(hv.data(), v.first);
    Tensor wc = p.ga.alloc(DType::f32, {n}), mc = p.ga.alloc(DType::f32, {n}), vc = p.ga.alloc(DType::f32, {n});
    p.gpu->copy(w, wc), p.gpu->copy(m.first, mc), p.gpu->copy(v.first, vc);
    p.gpu->adamw_step(w, g.first, m.first, v.first, s);
    p.gpu->adamw_step(wc, g.first, mc, vc, s);  // outside the weights: plain
    EXPECT_TRUE(same_bits(*p.gpu, w, wc)) << off;
    EXPECT_TRUE(same_bits(*p.gpu, m.first, mc)) << off;
    std::vector<float> hw(W.first.numel());
    p.gpu->download(W.first, hw.data());
    std::vector<double> hd(hw.begin(), hw.end());
    p.cpu->upload(hd.data(), W.second);
    auto C = p.poisoned({M, N});
    p.gpu->gemm(A.first, false, Bg, true, C.first);
    p.cpu->gemm(A.second, false, Bc, true, C.second);
    EXPECT_LT(p.rel_rms(C), 1e-2) << "mirror after adamw, offset " << off;
  }
}

// adamw_step_multi: many segments (own scalars, odd offsets and lengths, m and v laid out
// apart from w, segments longer than one block and more than one launch's table) in one
// call — the same bits as adamw_step per segment, on the GPU and on the CPU; inside the
// registered weights the bf16 mirror follows.
TEST(CudaBackend, AdamWMultiSegment) {
  Pair p("mixed");
  const int64_t total = 200003;
  auto w = p.randn({total}), g = p.randn({total}), m = p.randn({total + 7}, 0.1), v = p.randn({total + 7}, 0.1);
  for (auto* t : {&v}) {  // second moments are ≥ 0
    std::vector<float> h(t->first.numel());
    p.gpu->download(t->first, h.data());
    for (float& x : h) x = std::abs(x);
    std::vector<double> hd(h.begin(), h.end());
    p.gpu->upload(h.data(), t->first);
    p.cpu->upload(hd.data(), t->second);
  }
  std::vector<Backend::AdamWSegment> segs;
  int64_t off = 0;
  for (int i = 0; off < total - 1; ++i) {
    Backend::AdamWSegment s;
    s.offset = off;
    s.n = std::min<int64_t>(total - 1 - off, i % 3 == 0 ? 5 : i % 3 == 1 ? 1031 : 9000 + i);
    // m and v shifted against w by different amounts; segments must not overlap in any of the
    // three (an alternating v shift made neighbours share 7 entries: the per-segment reference
    // then updates them twice in order, the one-launch update once each, in parallel)
    s.m_offset = off + 7, s.v_offset = off + 3;
    s.step.step_size = 0.01f * (1 + i % 5);
    s.step.decay = 1.0f - 0.001f * (i % 4);
    s.step.inv_sqrt_bc2 = 1.5f;
    segs.push_back(s);
    off += s.n + (i % 7 == 0 ? 1 : 0);  // an occasional untouched element between segments
  }
  ASSERT_GT(segs.size(), 48u) << "more segments than one launch takes (48)";
  // The reference: one adamw_step per segment, on copies.
  Tensor w2 = p.ga.alloc(DType::f32, {total}), m2 = p.ga.alloc(DType::f32, {total + 7}),
         v2 = p.ga.alloc(DType::f32, {total + 7});
  p.gpu->copy(w.first, w2), p.gpu->copy(m.first, m2), p.gpu->copy(v.first, v2);
  auto at = [](const Tensor& t, int64_t o, int64_t n) { return Tensor(t.ptr<float>() + o, DType::f32, {n}); };
  for (const auto& s : segs)
    p.gpu->adamw_step(at(w2, s.offset, s.n), at(g.first, s.offset, s.n), at(m2, s.m_offset, s.n),
                      at(v2, s.v_offset, s.n), s.step);
  p.gpu->register_weights(w.first);
  auto A = p.randn_bf16({3, 1000});
  Tensor Wg = w.first.slice0(0, 200000).view({200, 1000});
  auto C = p.poisoned({3, 200});
  p.gpu->gemm(A.first, false, Wg, true, C.first);  // mirror fresh before the update
  p.gpu->adamw_step_multi(w.first, g.first, m.first, v.first, segs);
  p.cpu->adamw_step_multi(w.second, g.second, m.second, v.second, segs);
  EXPECT_TRUE(same_bits(*p.gpu, w.first, w2));
  EXPECT_TRUE(same_bits(*p.gpu, m.first, m2));
  EXPECT_TRUE(same_bits(*p.gpu, v.first, v2));
  EXPECT_LT(p.rel_rms(w), 1e-6) << "vs the CPU in double";
  Tensor Wc = w.second.slice0(0, 200000).view({200, 1000});
  p.gpu->gemm(A.first, false, Wg, true, C.first);
  p.cpu->gemm(A.second, false, Wc, true, C.second);
  EXPECT_LT(p.rel_rms(C), 1e-2) << "the mirror after adamw_step_multi";
}

// The clip's factor folded into AdamW (AdamWStep::grad_scale): the same bits for w, m, v
// and the mirror as scale(g) followed by the plain update, through adamw_step and
// adamw_step_multi (vector and scalar tails: 10007 elements), and g left unscaled.
TEST(CudaBackend, AdamWFoldsTheClipScale) {
  Pair p("mixed");
  const int64_t n = 10007;
  auto w = p.randn({n}), g = p.randn({n}, 3.0), m = p.randn({n}, 0.1), v = p.randn({n}, 0.1);
  std::vector<float> hv(n);
  p.gpu->download(v.first, hv.data());
  for (float& x : hv) x = std::abs(x);
  p.gpu->upload(hv.data(), v.first);
  Tensor g0 = p.ga.alloc(DType::f32, {n});
  p.gpu->copy(g.first, g0);
  Backend::AdamWStep st;
  st.step_size = 0.01f, st.decay = 0.999f, st.inv_sqrt_bc2 = 1.3f;
  const float cf = static_cast<float>(1.0 / 7.3);
  for (bool multi : {false, true}) {
    Tensor w1 = p.ga.alloc(DType::f32, {n}), m1 = p.ga.alloc(DType::f32, {n}), v1 = p.ga.alloc(DType::f32, {n});
    Tensor w2 = p.ga.alloc(DType::f32, {n}), m2 = p.ga.alloc(DType::f32, {n}), v2 = p.ga.alloc(DType::f32, {n});
    Tensor gs = p.ga.alloc(DType::f32, {n});
    for (auto [a, b] : {std::pair<Tensor, Tensor>{w.first, w1}, {m.first, m1}, {v.first, v1}, {w.first, w2},
                        {m.first, m2}, {v.first, v2}, {g.first, gs}})
      p.gpu->copy(a, b);
    p.gpu->scale(gs, cf);  // the separate clip pass
    Backend::AdamWStep clipped = st;
    clipped.grad_scale = cf;
    if (multi) {
      Backend::AdamWSegment s1, s2;
      s1.n = n, s1.step = st;
      s2.n = n, s2.step = clipped;
      p.gpu->adamw_step_multi(w1, gs, m1, v1, {s1});
      p.gpu->adamw_step_multi(w2, g.first, m2, v2, {s2});
    } else {
      p.gpu->adamw_step(w1, gs, m1, v1, st);
      p.gpu->adamw_step(w2, g.first, m2, v2, clipped);
    }
    EXPECT_TRUE(same_bits(*p.gpu, w1, w2)) << multi;
    EXPECT_TRUE(same_bits(*p.gpu, m1, m2)) << multi;
    EXPECT_TRUE(same_bits(*p.gpu, v1, v2)) << multi;
    EXPECT_TRUE(same_bits(*p.gpu, g.first, g0)) << "g is not scaled in memory";
    EXPECT_FALSE(same_bits(*p.gpu, w1, w.first)) << "the update moved w";
  }
}

// The norm backward of x0 + r (add_rmsnorm_bwd_convert: the model keeps the mixer output r
// instead of the stream after it): the same bits as rmsnorm_bwd_convert on the sum the
// forward stored, and the CPU's values; bf16 and f32 r, with and without dx_act, at the
// warp-per-row shapes and the fallbacks (d = 30, 2048), and r misaligned (fallback too).
TEST(CudaBackend, AddNormBackwardFormsTheSumAgain) {
  Pair p("mixed");
  for (auto [n, d] : {std::pair<int64_t, int64_t>{37, 64}, {4099, 1024}, {37, 1000}, {37, 30}, {37, 2048}})
    for (bool r_bf16 : {true, false}) {
      auto x0 = p.randn({n, d}), w = p.randn({d});
      auto r = r_bf16 ? p.randn_bf16({n, d}) : p.randn({n, d});
      auto h = p.poisoned({n, d}), y = p.poisoned_bf16({n, d}), rs = p.poisoned({n});
      p.gpu->add_rmsnorm_fwd(x0.first, r.first, h.first, w.first, y.first, rs.first, 1e-5);
      p.cpu->add_rmsnorm_fwd(x0.second, r.second, h.second, w.second, y.second, rs.second, 1e-5);
      auto dy = p.randn_bf16({n, d});
      auto dx = p.randn({n, d}), dw = p.randn({d});
      Tensor dx_ref = p.ga.alloc(DType::f32, {n, d}), dw_ref = p.ga.alloc(DType::f32, {d});
      p.gpu->copy(dx.first, dx_ref);
      p.gpu->copy(dw.first, dw_ref);
      auto dx_a = p.poisoned_bf16({n, d});
      Tensor dx_a_ref = p.ga.alloc(DType::bf16, {n, d});
      p.gpu->add_rmsnorm_bwd_convert(x0.first, r.first, w.first, rs.first, dy.first, dx.first, dw.first, dx_a.first);
      p.gpu->rmsnorm_bwd_convert(h.first, w.first, rs.first, dy.first, dx_ref, dw_ref, dx_a_ref);
      p.cpu->add_rmsnorm_bwd_convert(x0.second, r.second, w.second, rs.second, dy.second, dx.second, dw.second,
                                     dx_a.second);
      const std::string what = std::to_string(n) + "x" + std::to_string(d) + (r_bf16 ? " bf16 r" : " f32 r");
      EXPECT_TRUE(same_bits(*p.gpu, dx.first, dx_ref)) << what;
      EXPECT_TRUE(same_bits(*p.gpu, dw.first, dw_ref)) << what;
      EXPECT_TRUE(same_bits(*p.gpu, dx_a.first, dx_a_ref)) << what;
      EXPECT_LT(p.rel_rms(dx), kTol) << what;
      EXPECT_LT(p.rel_rms(dw), kTol) << what;
      EXPECT_LT(p.rel_rms(dx_a), 1e-2) << what;
      // Without dx_act (rmsnorm_bwd of the sum), and r at a 2-byte offset (not 16-byte aligned).
      Tensor r_odd = p.ga.alloc(r.first.dtype, {n * d + 1});
      Tensor r_mis(static_cast<char*>(r_odd.data) + dtype_size(r.first.dtype), r.first.dtype, {n, d});
      p.gpu->copy(r.first, r_mis);
      p.gpu->add_rmsnorm_bwd_convert(x0.first, r_mis, w.first, rs.first, dy.first, dx.first, dw.first, Tensor());
      p.gpu->rmsnorm_bwd(h.first, w.first, rs.first, dy.first, dx_ref, dw_ref);
      p.cpu->add_rmsnorm_bwd_convert(x0.second, r.second, w.second, rs.second, dy.second, dx.second, dw.second,
                                     Tensor());
      EXPECT_TRUE(same_bits(*p.gpu, dx.first, dx_ref)) << what << " misaligned r";
      EXPECT_TRUE(same_bits(*p.gpu, dw.first, dw_ref)) << what << " misaligned r";
      EXPECT_LT(p.rel_rms(dx), kTol) << what;
      EXPECT_LT(p.rel_rms(dw), kTol) << what;
    }
}

// The run's cuda keys reach the backend as Options::cuda; a value it does not know is refused
// when the options are set, naming the key and the value.
TEST(CudaBackend, KernelKeysAreChecked) {
  const auto message = [](const Backend::Options& o) {
    try {
      make_backend("cuda", 1, DType::f32, o);
    } catch (const lar::UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  Backend::Options o = with_precision("mixed");
  EXPECT_EQ(message(o), "no error");
  o.cuda.gemm = "fastest";
  EXPECT_EQ(message(o), "cuda.gemm: 'fastest' is not one of heuristic, tune, cublas");
  o.cuda.gemm = "tune";
  EXPECT_EQ(message(o), "no error");
  o.deterministic = true;
  EXPECT_NE(message(o).find("cuda.gemm: 'tune' picks GEMM algorithms by their timings"), std::string::npos) << message(o);
  o = with_precision("mixed");
  o.cuda.attention = "sdpa";
  EXPECT_EQ(message(o), "cuda.attention: 'sdpa' is not one of auto, cudnn, flash");
  o = with_precision("mixed");
  o.cuda.linear_keep = "none";
  EXPECT_EQ(message(o), "cuda.linear_keep: 'none' is not one of all, p, og");
  o = with_precision("mixed");
  o.cuda.linear_path = "twophase";
  EXPECT_EQ(message(o), "cuda.linear_path: 'twophase' is not one of auto, fused, chunked");
  o = with_precision("mixed");
  o.cuda.ccq_group = 65;
  EXPECT_EQ(message(o), "cuda.ccq_group: 65 is not from 0 to 64");
}

// The bf16 GEMMs through cuBLASLt in each algorithm mode (cuda.gemm): against the fp64 CPU on
// bf16-representable operands (f32 C: only the accumulation order differs), β = 1 into f32
// C (a timed candidate must not add into C twice), bf16 C, a tall-skinny and a long-K
// (weight gradient) shape, a batched one, an operand at a 2-byte offset (its own plan), and
// a second call of the same shape (the cached plan) giving the same bits.
TEST(CudaBackend, Bf16GemmAlgorithmModes) {
  struct Case { int64_t M, N, K; bool ta, tb; double beta; bool c_bf16; };
  const Case cases[] = {{300, 257, 520, false, true, 0.5, false}, {4099, 32, 1024, false, true, 0.0, true},
                        {96, 1024, 4096, true, false, 1.0, false}, {513, 1024, 96, false, false, 1.0, true}};
  for (const char* mode : {"heuristic", "tune", "cublas"}) {
    Backend::Options o = with_precision("mixed");
    o.cuda.gemm = mode;
    Pair p(o);
    for (const Case& c : cases) {
      auto A = p.randn_bf16(c.ta ? std::vector<int64_t>{c.K, c.M} : std::vector<int64_t>{c.M, c.K});
      auto B = p.randn_bf16(c.tb ? std::vector<int64_t>{c.N, c.K} : std::vector<int64_t>{c.K, c.N});
      auto C = c.c_bf16 ? p.randn_bf16({c.M, c.N}) : p.randn({c.M, c.N});
      Tensor C2 = p.ga.alloc(C.first.dtype, {c.M, c.N});
      p.gpu->copy(C.first, C2);
      p.gpu->gemm(A.first, c.ta, B.first, c.tb, C.first, 1.0, c.beta);
      p.gpu->gemm(A.first, c.ta, B.first, c.tb, C2, 1.0, c.beta);
      p.cpu->gemm(A.second, c.ta, B.second, c.tb, C.second, 1.0, c.beta);
      const std::string what = std::string(mode) + " " + std::to_string(c.M) + "x" + std::to_string(c.N) + "x" +
                               std::to_string(c.K) + " β=" + std::to_string(c.beta);
      EXPECT_LT(p.rel_rms(C), c.c_bf16 ? 1e-2 : 5e-5) << what;
      EXPECT_TRUE(same_bits(*p.gpu, C.first, C2)) << what << ": the cached plan";
    }
    {  // batched, and A at a 2-byte offset
      auto A = p.randn_bf16({3, 40, 24}), B = p.randn_bf16({3, 32, 24});
      auto C = p.poisoned({3, 40, 32});
      p.gpu->gemm_batched(A.first, false, B.first, true, C.first, 3);
      p.cpu->gemm_batched(A.second, false, B.second, true, C.second, 3);
      EXPECT_LT(p.rel_rms(C), 5e-5) << mode << " batched";
      Tensor a_odd = p.ga.alloc(DType::bf16, {3 * 40 * 24 + 1});
      Tensor a_mis(static_cast<char*>(a_odd.data) + 2, DType::bf16, {120, 24});
      p.gpu->copy(A.first, a_mis);
      auto C1 = p.poisoned({120, 96});
      p.gpu->gemm(a_mis, false, B.first.view({96, 24}), true, C1.first);
      p.cpu->gemm(A.second.view({120, 24}), false, B.second.view({96, 24}), true, C1.second);
      EXPECT_LT(p.rel_rms(C1), 5e-5) << mode << " misaligned A";
    }
  }
}
