// DeviceOptimizer (trainer/optim/device_optimizer.hpp) against the host Optimizer on
// fresh random parameters and gradients: on the CPU backend (exact for AdamW) and on the
// CUDA backend (AdamW bit-identical too: the kernels evaluate the host's float
// expressions without FMA; Muon/NorMuon to the GEMMs' rounding: fp32, or bf16 operands). Also the state blob: a
// checkpoint written from device state loads into the host optimiser and back.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "tests/gpu/host_helpers.hpp"
#include "trainer/optim/device_optimizer.hpp"
#include "trainer/optim/optimizer.hpp"

using namespace lar;
using kernels::DType;
using kernels::Tensor;
using lar::gpu_test::rel_rms;

namespace {

// A table like a model's: wide, tall and square hidden matrices (two shapes twice, so that
// Newton–Schulz runs batched), embedding, head, norms, a bias — laid out back to back.
std::vector<optim::ParamView> table() {
  std::vector<optim::ParamView> t;
  std::size_t off = 0;
  auto add = [&](const char* name, int r, int c, optim::ParamKind k) {
    t.push_back({name, off, r, c, k});
    off += static_cast<std::size_t>(r) * c;
  };
  add("embed", 50, 24, optim::ParamKind::embedding);
  add("norm", 1, 24, optim::ParamKind::norm);
  add("wq", 24, 24, optim::ParamKind::matrix_hidden);
  add("wk", 8, 24, optim::ParamKind::matrix_hidden);
  add("wv", 24, 24, optim::ParamKind::matrix_hidden);  // wq's shape: a Newton–Schulz batch of 2
  add("w_up", 72, 24, optim::ParamKind::matrix_hidden);
  add("w_down", 24, 72, optim::ParamKind::matrix_hidden);
  add("w_up2", 72, 24, optim::ParamKind::matrix_hidden);  // a tall batch of 2
  add("bias", 1, 7, optim::ParamKind::bias);
  add("head", 50, 24, optim::ParamKind::head);
  return t;
}
std::size_t total(const std::vector<optim::ParamView>& t) { return t.back().offset + t.back().size(); }

optim::OptimizerConfig config(const std::string& name, double clip) {
  optim::OptimizerConfig c;
  c.name = name == "adamw" ? optim::OptimizerName::adamw
           : name == "muon" ? optim::OptimizerName::muon
                            : optim::OptimizerName::normuon;
  c.lr = 0.02;
  c.scalar_lr = name == "adamw" ? 0.0 : 0.005;
  c.weight_decay = 0.1;
  c.scalar_weight_decay = 0.01;
  c.grad_clip = clip;
  return c;
}

std::vector<float> randn(std::size_t n, std::mt19937_64& rng, double s) {
  std::normal_distribution<double> nd(0.0, s);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(nd(rng));
  return v;
}

struct Result {
  std::vector<float> params;
  std::vector<double> norms;
  std::string state;
};

// `steps` updates on the same random gradients: host Optimizer, or DeviceOptimizer on `be`.
Result run(kernels::Backend* be, const std::string& name, double clip, int steps, uint64_t seed) {
  auto t = table();
  const std::size_t n = total(t);
  std::mt19937_64 rng(seed);
  Result r;
  r.params = randn(n, rng, 0.05);
  std::vector<std::vector<float>> grads;
  for (int s = 0; s < steps; ++s) grads.push_back(randn(n, rng, s == 0 ? 3.0 : 0.01));  // step 0 is clipped
  if (!be) {
    optim::Optimizer opt(config(name, clip), t, n);
    for (auto& g : grads) {
      r.norms.push_back(opt.clip_gradients(g.data()));
      opt.step(r.params.data(), g.data(), 0.7, 0.9);
    }
    r.state = opt.save_state();
    return r;
  }
  void* pm = be->alloc_bytes(n * 4);
  void* gm = be->alloc_bytes(n * 4);
  Tensor P(pm, DType::f32, {static_cast<int64_t>(n)}), G(gm, DType::f32, {static_cast<int64_t>(n)});
  be->upload(r.params.data(), P);
  {
    optim::DeviceOptimizer opt(*be, config(name, clip), t, n);
    for (auto& g : grads) {
      be->upload(g.data(), G);
      r.norms.push_back(opt.clip_gradients(G));
      opt.step(P, G, 0.7, 0.9);
    }
    be->download(P, r.params.data());
    r.state = opt.save_state();
  }
  be->free_bytes(pm);
  be->free_bytes(gm);
  return r;
}

// nullptr on a machine without a GPU: the CPU-backend halves of the tests still run.
std::unique_ptr<kernels::Backend> cuda(const std::string& precision) {
  if (!kernels::backend_usable("cuda")) return nullptr;
  kernels::Backend::Options o;
  o.precision = precision;
  return kernels::make_backend("cuda", 1, DType::f32, o);
}

}  // namespace

TEST(DeviceOptimizer, AdamWBitIdenticalOnCpuAndCuda) {
  auto cpu = kernels::make_backend("cpu", 1, DType::f32);
  auto gpu = cuda("fp32");
  for (double clip : {0.0, 1.0}) {
    const Result host = run(nullptr, "adamw", clip, 4, 11);
    for (kernels::Backend* be : {cpu.get(), gpu.get()}) {
      if (!be) continue;
      const Result dev = run(be, "adamw", clip, 4, 11);
      ASSERT_EQ(dev.params.size(), host.params.size());
      if (clip == 0.0) {
        // No norm-dependent factor: every float must match.
        EXPECT_EQ(std::memcmp(dev.params.data(), host.params.data(), host.params.size() * 4), 0) << be->name();
        EXPECT_EQ(dev.state, host.state) << be->name();
      } else {
        // The clip factor comes from a double sum taken in another order.
        EXPECT_LT(rel_rms(dev.params, host.params), 1e-6) << be->name();
      }
      for (std::size_t i = 0; i < host.norms.size(); ++i) EXPECT_NEAR(dev.norms[i], host.norms[i], 1e-9 * host.norms[i]);
    }
  }
}

TEST(DeviceOptimizer, MuonAndNorMuonMatchHost) {
  auto cpu = kernels::make_backend("cpu", 1, DType::f32);
  auto gpu = cuda("fp32");
  auto gpu_mixed = cuda("mixed");
  for (const char* name : {"muon", "normuon"}) {
    const Result host = run(nullptr, name, 1.0, 3, 5);
    const Result start = [] {
      std::mt19937_64 rng(5);
      return Result{randn(total(table()), rng, 0.05), {}, {}};
    }();
    // The update itself, relative: what the optimiser changed.
    auto delta_err = [&](const Result& dev) {
      std::vector<float> d(dev.params.size()), h(dev.params.size());
      for (std::size_t i = 0; i < d.size(); ++i) d[i] = dev.params[i] - start.params[i], h[i] = host.params[i] - start.params[i];
      return rel_rms(d, h);
    };
    EXPECT_LT(delta_err(run(cpu.get(), name, 1.0, 3, 5)), 1e-5) << name << " cpu";
    if (!gpu) continue;
    EXPECT_LT(delta_err(run(gpu.get(), name, 1.0, 3, 5)), 1e-5) << name << " cuda fp32";
    // Newton–Schulz with bf16 GEMM operands: 5 iterations of bf16 rounding (1.2e-2 measured).
    EXPECT_LT(delta_err(run(gpu_mixed.get(), name, 1.0, 3, 5)), 3e-2) << name << " cuda bf16";
  }
}

TEST(DeviceOptimizer, StateMovesBetweenHostAndDevice) {
  auto gpu = cuda("fp32");
  if (!gpu) gpu = kernels::make_backend("cpu", 1, DType::f32);
  auto t = table();
  const std::size_t n = total(t);
  const Result dev = run(gpu.get(), "normuon", 1.0, 2, 9);
  // Device state → host optimiser → its blob is the same bytes.
  optim::Optimizer host(config("normuon", 1.0), t, n);
  host.load_state(dev.state);
  EXPECT_EQ(host.save_state(), dev.state);
  EXPECT_EQ(host.steps_taken(), 2);
  // And back into a fresh device optimiser.
  optim::DeviceOptimizer again(*gpu, config("normuon", 1.0), t, n);
  again.load_state(host.save_state());
  EXPECT_EQ(again.save_state(), dev.state);
  // A blob for another optimiser is refused.
  optim::DeviceOptimizer adam(*gpu, config("adamw", 1.0), t, n);
  EXPECT_THROW(adam.load_state(dev.state), RuntimeError);
}

// The device-side normalisation gives the bits of the host round trip it replaces:
// transpose / scale by float(1 / (sqrt(sum_squares) + eps)) on the same backend.
TEST(DeviceOptimizer, FrobeniusNormalizeKeepsTheRoundTripsBits) {
  auto cpu = kernels::make_backend("cpu", 1, DType::f32);
  auto gpu = cuda("mixed");
  std::mt19937_64 rng(21);
  for (kernels::Backend* be : {cpu.get(), gpu.get()}) {
    if (!be) continue;
    for (auto [r, c] : {std::pair{24, 72}, std::pair{72, 24}, std::pair{33, 33}, std::pair{1000, 7}}) {
      const std::vector<float> x = randn(static_cast<std::size_t>(r) * c, rng, 0.3);
      const std::size_t n = x.size();
      void* s = be->alloc_bytes(n * 4);
      void* d1 = be->alloc_bytes(n * 4);
      void* d2 = be->alloc_bytes(n * 4);
      const Tensor S(s, DType::f32, {r, c});
      be->upload(x.data(), S);
      for (bool tr : {false, true}) {
        const std::vector<int64_t> shape = tr ? std::vector<int64_t>{c, r} : std::vector<int64_t>{r, c};
        const Tensor D1(d1, DType::f32, shape), D2(d2, DType::f32, shape);
        be->frobenius_normalize(S, D1, tr, 1e-7);
        const double inv = static_cast<float>(1.0 / (std::sqrt(be->sum_squares(S)) + 1e-7));
        if (tr) {
          be->transpose(S, D2, inv);
        } else {
          be->copy(S, D2);
          be->scale(D2, inv);
        }
        std::vector<float> a(n), b(n);
        be->download(D1, a.data());
        be->download(D2, b.data());
        EXPECT_EQ(std::memcmp(a.data(), b.data(), n * 4), 0) << be->name() << " " << r << "x" << c << (tr ? " T" : "");
        double ss = 0;
        for (float v : a) ss += static_cast<double>(v) * v;
        EXPECT_NEAR(ss, 1.0, 1e-5);  // unit Frobenius norm
      }
      be->free_bytes(s);
      be->free_bytes(d1);
      be->free_bytes(d2);
    }
  }
}
