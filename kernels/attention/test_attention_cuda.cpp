// The bf16 flash attention kernels and cuDNN's fused attention (kernels/attention)
// against the CPU reference backend in fp64, on fresh random bf16 inputs: relative RMS
// error ≤ 1e-2 for o, dq, dk, dv (and lse), every output poisoned with NaN before each
// launch; the two implementations' forward and backward combined both ways; the CUDA
// backend's choice between them (cuda.attention, deterministic, windows).
#include <gtest/gtest.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "kernels/attention/cudnn_attention.hpp"
#include "kernels/attention/flash_attention.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "tests/gpu/device_buffer.hpp"

using namespace lar::kernels;
using lar::kernels::cuda::attention::FlashShape;
using lar::gpu_test::bf16;

namespace {

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x

using lar::gpu_test::Dev;
using lar::gpu_test::rel_rms;

struct Harness {
  std::mt19937_64 rng{std::random_device{}()};
  std::unique_ptr<Backend> cpu = make_backend("cpu", 1, DType::f64);

  // Random bf16 values on the device and the same values (exactly) in fp64 on the host.
  std::vector<double> randn(Dev<bf16>& d, double scale = 1.0) {
    std::normal_distribution<double> nd(0.0, scale);
    std::vector<bf16> h(d.n);
    std::vector<double> x(d.n);
    for (size_t i = 0; i < d.n; ++i) {
      h[i] = __float2bfloat16(static_cast<float>(nd(rng)));
      x[i] = __bfloat162float(h[i]);
    }
    cudaMemcpy(d.p, h.data(), d.n * sizeof(bf16), cudaMemcpyHostToDevice);
    return x;
  }
};

struct Result {
  double o, lse, dq, dk, dv;
};

enum class Impl { flash, cudnn };

// One cuDNN attention object for the whole test binary (its plans are cached per shape).
cuda::attention::CudnnAttention& cudnn() {
  static std::unique_ptr<cuda::attention::CudnnAttention> c;
  if (!c) c = std::make_unique<cuda::attention::CudnnAttention>();
  return *c;
}

// cuDNN must be there on the GPU machine (its lib folder on LD_LIBRARY_PATH): a missing
// library would otherwise skip the path silently.
void require_cudnn() {
  ASSERT_TRUE(cuda::attention::cudnn_available()) << cuda::attention::cudnn_unavailable_reason();
}

// One fwd + bwd on the GPU (forward by `f`, backward by `b`) and on the CPU reference
// backend (`cpu`: null = the single-threaded one); returns the relative RMS errors.
Result compare(Harness& hx, const FlashShape& s, Impl f = Impl::flash, Impl b = Impl::flash, Backend* cpu = nullptr) {
  const size_t nq = s.B * s.T * s.Hq * s.D, nk = s.B * s.S * s.Hkv * s.D, nl = s.B * s.Hq * s.T;
  Dev<bf16> q(nq), k(nk), v(nk), o(nq), dout(nq), dq(nq), dk(nk), dv(nk);
  Dev<float> lse(nl);
  size_t wsn = cuda::attention::flash_attention_bwd_workspace_bytes(s);
  if (f == Impl::cudnn || b == Impl::cudnn) {
    std::string why;
    EXPECT_TRUE(cudnn().prepare(s, &why)) << why;
    wsn = std::max({wsn, cudnn().fwd_workspace_bytes(s), cudnn().bwd_workspace_bytes(s)});
  }
  Dev<unsigned char> ws(wsn);
  auto hq = hx.randn(q), hk = hx.randn(k), hv = hx.randn(v), hdo = hx.randn(dout);
  o.poison(), lse.poison(), dq.poison(), dk.poison(), dv.poison(), ws.poison();

  if (f == Impl::cudnn)
    cudnn().fwd(s, q.p, k.p, v.p, o.p, lse.p, ws.p, nullptr);
  else
    cuda::attention::flash_attention_fwd(s, q.p, k.p, v.p, o.p, lse.p, nullptr);
  ws.poison();
  if (b == Impl::cudnn)
    cudnn().bwd(s, q.p, k.p, v.p, o.p, lse.p, dout.p, dq.p, dk.p, dv.p, ws.p, nullptr);
  else
    cuda::attention::flash_attention_bwd(s, q.p, k.p, v.p, o.p, lse.p, dout.p, dq.p, dk.p, dv.p, ws.p, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  Backend& c = cpu ? *cpu : *hx.cpu;
  Arena a(c);
  auto up = [&](const std::vector<double>& x, std::initializer_list<int64_t> shape) {
    Tensor t = a.alloc(DType::f64, shape);
    c.upload(x.data(), t);
    return t;
  };
  Tensor cq = up(hq, {s.B, s.T, s.Hq, s.D}), ck = up(hk, {s.B, s.S, s.Hkv, s.D});
  Tensor cv = up(hv, {s.B, s.S, s.Hkv, s.D}), cdo = up(hdo, {s.B, s.T, s.Hq, s.D});
  Tensor co = a.alloc(DType::f64, {s.B, s.T, s.Hq, s.D}), cl = a.alloc(DType::f64, {s.B, s.Hq, s.T});
  Tensor cdq = a.alloc(DType::f64, {s.B, s.T, s.Hq, s.D}), cdk = a.alloc(DType::f64, {s.B, s.S, s.Hkv, s.D});
  Tensor cdv = a.alloc(DType::f64, {s.B, s.S, s.Hkv, s.D});
  c.attention_fwd(cq, ck, cv, co, cl, s.scale, s.window);
  c.attention_bwd(cq, ck, cv, co, cl, cdo, cdq, cdk, cdv, s.scale, s.window);
  auto down = [&](const Tensor& t) {
    std::vector<double> x(t.numel());
    c.download(t, x.data());
    return x;
  };
  return {rel_rms(o.get(), down(co)), rel_rms(lse.get(), down(cl)), rel_rms(dq.get(), down(cdq)),
          rel_rms(dk.get(), down(cdk)), rel_rms(dv.get(), down(cdv))};
}

FlashShape shape(int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t window) {
  FlashShape s;
  s.B = B, s.T = T, s.S = S, s.Hq = Hq, s.Hkv = Hkv, s.D = D, s.window = window;
  s.scale = 1.0 / std::sqrt(static_cast<double>(D));
  return s;
}

constexpr double kTol = 1e-2;

// O, dQ, dK, dV within the bf16 tolerance of the fp64 reference; the LSE (fp32 with bf16
// inputs) far below it.
void expect_close(const Result& r, const std::string& what) {
  EXPECT_LT(r.o, kTol) << what;
  EXPECT_LT(r.lse, 1e-4) << what;
  EXPECT_LT(r.dq, kTol) << what;
  EXPECT_LT(r.dk, kTol) << what;
  EXPECT_LT(r.dv, kTol) << what;
  std::printf("%s: o %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", what.c_str(), r.o, r.lse, r.dq, r.dk, r.dv);
}
std::string describe(const FlashShape& s, const char* how) {
  return std::string(how) + " B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
         (s.S != s.T ? " S=" + std::to_string(s.S) : "") + " Hq=" + std::to_string(s.Hq) + " Hkv=" +
         std::to_string(s.Hkv) + " D=" + std::to_string(s.D) +
         (s.window > 0 ? " window=" + std::to_string(s.window) : "");
}

}  // namespace

TEST(FlashAttention, MatchesCpuReference) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  ASSERT_GT(devices, 0);
  Harness hx;
  // T not a multiple of the 64-row blocks, GQA groups of 1–4, windows (incl. one shorter
  // than a block), a KV cache (S > T), head dims 64 and 128.
  for (FlashShape s : {shape(2, 200, 200, 4, 2, 64, 0), shape(1, 333, 333, 6, 2, 128, 100),
                       shape(1, 130, 130, 2, 1, 64, 37), shape(2, 257, 257, 4, 1, 128, 0),
                       shape(1, 77, 300, 4, 4, 64, 0), shape(1, 50, 181, 2, 1, 128, 90),
                       shape(1, 64, 64, 1, 1, 64, 0)}) {
    expect_close(compare(hx, s), describe(s, "flash"));
  }
}

// Long sequences: a long key range (S = 32K with a few queries at its end, with and
// without a window) and a 2K×2K full causal problem, still against the fp64 reference.
TEST(FlashAttention, LongSequences) {
  Harness hx;
  for (FlashShape s : {shape(1, 96, 32768, 2, 1, 64, 0), shape(1, 70, 32768, 2, 2, 128, 5000),
                       shape(1, 2048, 2048, 2, 1, 64, 0)}) {
    expect_close(compare(hx, s), describe(s, "flash"));
  }
}

// The backward has no atomics: two runs give the same bits.
TEST(FlashAttention, BackwardIsDeterministic) {
  Harness hx;
  FlashShape s = shape(2, 1000, 1000, 8, 2, 64, 0);
  const size_t nq = s.B * s.T * s.Hq * s.D, nk = s.B * s.S * s.Hkv * s.D;
  Dev<bf16> q(nq), k(nk), v(nk), o(nq), dout(nq);
  Dev<float> lse(s.B * s.Hq * s.T);
  Dev<unsigned char> ws(cuda::attention::flash_attention_bwd_workspace_bytes(s));
  hx.randn(q), hx.randn(k), hx.randn(v), hx.randn(dout);
  cuda::attention::flash_attention_fwd(s, q.p, k.p, v.p, o.p, lse.p, nullptr);
  std::vector<std::vector<double>> runs;
  for (int rep = 0; rep < 2; ++rep) {
    Dev<bf16> dq(nq), dk(nk), dv(nk);
    dq.poison(), dk.poison(), dv.poison();
    cuda::attention::flash_attention_bwd(s, q.p, k.p, v.p, o.p, lse.p, dout.p, dq.p, dk.p, dv.p, ws.p, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<double> all = dq.get(), b = dk.get(), c = dv.get();
    all.insert(all.end(), b.begin(), b.end());
    all.insert(all.end(), c.begin(), c.end());
    runs.push_back(std::move(all));
  }
  ASSERT_EQ(runs[0].size(), runs[1].size());
  EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(double)));
  for (double x : runs[0]) ASSERT_TRUE(std::isfinite(x));
}

// FlashShape::tiles forces one tile configuration for both passes (`lar-bench attention
// --tiles`); each against the CPU reference, and any other value is an error naming it.
TEST(FlashAttention, EachTileConfigurationMatchesTheCpu) {
  Harness hx;
  for (const int tiles : {0, 1})
    for (FlashShape s : {shape(2, 200, 200, 4, 2, 64, 0), shape(1, 257, 257, 4, 1, 128, 50)}) {
      s.tiles = tiles;
      const std::string how = "flash tiles " + std::to_string(tiles);
      expect_close(compare(hx, s), describe(s, how.c_str()));
    }
  FlashShape s = shape(1, 16, 16, 2, 2, 64, 0);
  s.tiles = 2;
  try {
    cuda::attention::flash_attention_fwd(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("tiles 2: expected -1, 0 or 1"), std::string::npos) << e.what();
  }
}

TEST(FlashAttention, RejectsBadShapes) {
  FlashShape s = shape(1, 16, 16, 3, 2, 64, 0);  // Hq % Hkv != 0
  try {
    cuda::attention::flash_attention_fwd(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("Hq=3 Hkv=2"), std::string::npos) << e.what();
  }
  s = shape(1, 16, 16, 2, 2, 96, 0);
  try {
    cuda::attention::flash_attention_fwd(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("head dim 96"), std::string::npos) << e.what();
  }
}

// ---- cuDNN's fused attention (kernels/attention/cudnn_attention.hpp) ----


TEST(CudnnAttention, MatchesCpuReference) {
  require_cudnn();
  std::printf("cuDNN %ld\n", cuda::attention::cudnn_version());
  Harness hx;
  // T not a multiple of 64, GQA groups 1–4 (kv = 4 of 16 heads), head dims 64 and 128,
  // sliding windows (one shorter than a tile, one longer than T).
  for (FlashShape s : {shape(2, 200, 200, 4, 4, 64, 0), shape(1, 300, 300, 16, 4, 64, 0),
                       shape(2, 257, 257, 4, 1, 128, 0), shape(1, 333, 333, 6, 2, 128, 0),
                       shape(1, 64, 64, 1, 1, 64, 0), shape(1, 130, 130, 2, 1, 64, 37),
                       shape(1, 333, 333, 6, 2, 128, 100), shape(2, 200, 200, 4, 2, 64, 500)})
    expect_close(compare(hx, s, Impl::cudnn, Impl::cudnn), describe(s, "cudnn"));
}

// T = 16K (and a 2K problem at D = 128) against the fp64 reference on all cores.
TEST(CudnnAttention, LongSequences) {
  require_cudnn();
  Harness hx;
  auto cpu = make_backend("cpu", 0, DType::f64);
  for (FlashShape s : {shape(1, 16384, 16384, 2, 2, 64, 0), shape(1, 2048, 2048, 4, 1, 128, 0),
                       shape(1, 4096, 4096, 2, 1, 64, 1000)})
    expect_close(compare(hx, s, Impl::cudnn, Impl::cudnn, cpu.get()), describe(s, "cudnn"));
}

// cuDNN's stats are the flash kernels' lse: either forward feeds either backward.
TEST(CudnnAttention, ForwardAndBackwardMixWithFlash) {
  require_cudnn();
  Harness hx;
  for (FlashShape s : {shape(2, 300, 300, 8, 2, 64, 0), shape(1, 300, 300, 4, 2, 128, 64)}) {
    expect_close(compare(hx, s, Impl::cudnn, Impl::flash), describe(s, "cudnn fwd + flash bwd"));
    expect_close(compare(hx, s, Impl::flash, Impl::cudnn), describe(s, "flash fwd + cudnn bwd"));
  }
}

TEST(CudnnAttention, CoversOnlyCausalFullSequences) {
  EXPECT_TRUE(cuda::attention::cudnn_covers(shape(8, 4096, 4096, 16, 4, 64, 0)));
  EXPECT_TRUE(cuda::attention::cudnn_covers(shape(1, 32768, 32768, 16, 16, 128, 0)));
  EXPECT_TRUE(cuda::attention::cudnn_covers(shape(1, 100, 100, 2, 2, 64, 37)));    // window
  EXPECT_FALSE(cuda::attention::cudnn_covers(shape(1, 77, 300, 4, 4, 64, 0)));     // KV cache
  EXPECT_FALSE(cuda::attention::cudnn_covers(shape(1, 100, 100, 2, 2, 32, 0)));    // head dim
  EXPECT_FALSE(cuda::attention::cudnn_covers(shape(1, 100, 100, 3, 2, 64, 0)));    // Hq % Hkv
}

namespace {
struct BackendRun {
  std::string path_fwd, path_bwd;
  std::vector<double> o, dq, dk, dv;
};

// attention_fwd + attention_bwd through the CUDA backend on bf16 tensors (same inputs
// every call: seeded); S > T is a KV cache.
// attention: the run's cuda.attention.
BackendRun backend_run(bool deterministic, int64_t window, int64_t S = 192, const char* attention = "auto") {
  Backend::Options opt;
  opt.precision = "mixed";
  opt.deterministic = deterministic;
  opt.cuda.attention = attention;
  auto be = make_backend("cuda", 0, DType::f32, opt);
  auto* cb = dynamic_cast<cuda::CudaBackend*>(be.get());
  EXPECT_NE(cb, nullptr);
  const int64_t B = 2, T = 192, Hq = 4, Hkv = 2, D = 64;
  Dev<bf16> q(B * T * Hq * D), k(B * S * Hkv * D), v(B * S * Hkv * D), o(B * T * Hq * D), dout(B * T * Hq * D);
  Dev<bf16> dq(B * T * Hq * D), dk(B * S * Hkv * D), dv(B * S * Hkv * D);
  Dev<float> lse(B * Hq * T);
  Harness hx;
  hx.rng.seed(7);
  hx.randn(q), hx.randn(k), hx.randn(v), hx.randn(dout);
  auto t = [](auto& d, std::initializer_list<int64_t> shape, DType dt) { return Tensor(d.p, dt, shape); };
  Tensor tq = t(q, {B, T, Hq, D}, DType::bf16), tk = t(k, {B, S, Hkv, D}, DType::bf16),
         tv = t(v, {B, S, Hkv, D}, DType::bf16), to = t(o, {B, T, Hq, D}, DType::bf16),
         tl = t(lse, {B, Hq, T}, DType::f32), tdo = t(dout, {B, T, Hq, D}, DType::bf16),
         tdq = t(dq, {B, T, Hq, D}, DType::bf16), tdk = t(dk, {B, S, Hkv, D}, DType::bf16),
         tdv = t(dv, {B, S, Hkv, D}, DType::bf16);
  const double scale = 0.125;
  BackendRun r;
  be->attention_fwd(tq, tk, tv, to, tl, scale, window);
  r.path_fwd = cb ? cb->attention_path() : "?";
  be->attention_bwd(tq, tk, tv, to, tl, tdo, tdq, tdk, tdv, scale, window);
  r.path_bwd = cb ? cb->attention_path() : "?";
  if (cb) cb->synchronize();
  r.o = o.get(), r.dq = dq.get(), r.dk = dk.get(), r.dv = dv.get();
  return r;
}
}  // namespace

TEST(CudnnAttention, BackendPicksThePath) {
  require_cudnn();
  BackendRun flash, cud;
  {  // auto
    cud = backend_run(false, 0);
    EXPECT_EQ(cud.path_fwd, "cudnn");
    EXPECT_EQ(cud.path_bwd, "cudnn");
    BackendRun w = backend_run(false, 50);  // sliding window: cuDNN's band mask
    EXPECT_EQ(w.path_fwd, "cudnn");
    EXPECT_EQ(w.path_bwd, "cudnn");
    BackendRun kv = backend_run(false, 0, 256);  // KV cache (S > T): the flash kernels
    EXPECT_EQ(kv.path_fwd, "flash");
    EXPECT_EQ(kv.path_bwd, "flash");
    BackendRun d = backend_run(true, 0);  // deterministic: the flash kernels
    EXPECT_EQ(d.path_fwd, "flash");
    EXPECT_EQ(d.path_bwd, "flash");
  }
  {
    flash = backend_run(false, 0, 192, "flash");
    EXPECT_EQ(flash.path_fwd, "flash");
    EXPECT_EQ(flash.path_bwd, "flash");
  }
  {
    EXPECT_EQ(backend_run(false, 0, 192, "cudnn").path_bwd, "cudnn");
    EXPECT_EQ(backend_run(false, 0, 256, "cudnn").path_fwd, "flash");  // not a shape cuDNN's graph covers
  }
  // The two paths agree on the same inputs (each is checked against fp64 above).
  EXPECT_LT(rel_rms(cud.o, flash.o), kTol);
  EXPECT_LT(rel_rms(cud.dq, flash.dq), kTol);
  EXPECT_LT(rel_rms(cud.dk, flash.dk), kTol);
  EXPECT_LT(rel_rms(cud.dv, flash.dv), kTol);
  {
    try {
      backend_run(false, 0, 192, "bogus");
      FAIL() << "no error";
    } catch (const lar::UserError& e) {
      EXPECT_STREQ(e.what(), "cuda.attention: 'bogus' is not one of auto, cudnn, flash");
    }
  }
}
