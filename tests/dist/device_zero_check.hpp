#pragma once
// The checks of DeviceZeroOptimizer (trainer/optim/device_zero.hpp), shared by the CPU test
// (tests/dist/test_device_zero_cpu.cpp: CPU backends, runs everywhere) and the GPU test
// (tests/gpu/test_device_zero.cpp: one CUDA backend per rank on one GPU). Ranks are threads
// of tests/dist/fake_group.hpp; StagedCommunicator moves each collective's device buffer
// through host memory, so the sums are the fake group's (rank 0 + rank 1 + ... in float or
// double), and the unsharded reference, a DeviceOptimizer with the blocked norm, is given
// exactly those sums.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "tests/dist/fake_group.hpp"
#include "tests/gpu/host_helpers.hpp"
#include "trainer/optim/device_optimizer.hpp"
#include "trainer/optim/device_zero.hpp"
#include "trainer/optim/optimizer.hpp"
#include "trainer/optim/zero.hpp"

namespace lar::testing {

// A rank's collectives on backend memory: download, the host group's collective, upload.
class StagedCommunicator final : public optim::Communicator {
 public:
  StagedCommunicator(optim::Communicator& host, kernels::Backend& be) : host_(host), be_(be) {}
  int rank() const override { return host_.rank(); }
  int world() const override { return host_.world(); }
  void reduce_scatter(float* buf, const std::vector<optim::Segment>& segs) override {
    stage(buf, extent(segs), kernels::DType::f32, [&](float* h) { host_.reduce_scatter(h, segs); });
  }
  void all_gather(float* buf, const std::vector<optim::Segment>& segs) override {
    stage(buf, extent(segs), kernels::DType::f32, [&](float* h) { host_.all_gather(h, segs); });
  }
  void all_reduce(float* buf, std::size_t n) override {
    stage(buf, n, kernels::DType::f32, [&](float* h) { host_.all_reduce(h, n); });
  }
  void all_reduce(double* buf, std::size_t n) override {
    stage(buf, n, kernels::DType::f64, [&](double* h) { host_.all_reduce(h, n); });
  }

 private:
  static std::size_t extent(const std::vector<optim::Segment>& segs) {
    std::size_t e = 0;
    for (const optim::Segment& s : segs) e = std::max(e, s.offset + s.count);
    return e;
  }
  template <typename T, typename F>
  void stage(T* dev, std::size_t n, kernels::DType dt, F&& collective) {
    std::vector<T> h(n);
    const kernels::Tensor t(dev, dt, {static_cast<int64_t>(n)});
    if (n) be_.download(t, h.data());
    collective(h.data());  // also when n = 0: every rank meets the others
    if (n) be_.upload(h.data(), t);
  }
  optim::Communicator& host_;
  kernels::Backend& be_;
};

namespace device_zero {

using BackendFactory = std::function<std::unique_ptr<kernels::Backend>()>;

// Embedding and head larger than a norm block (AdamW cuts fall inside them), hidden matrices
// of repeated shapes (Newton–Schulz batches that a shard splits), tall and wide, norms, a
// bias and a scalar, with gaps between the tensors.
inline std::vector<optim::ParamView> table(std::size_t* total) {
  std::vector<optim::ParamView> t;
  std::size_t off = 0;
  auto add = [&](const char* name, int rows, int cols, optim::ParamKind kind) {
    t.push_back(optim::ParamView{name, off, rows, cols, kind});
    off += static_cast<std::size_t>(rows) * cols + 5;
  };
  add("embed", 701, 97, optim::ParamKind::embedding);  // 67997: 5 norm blocks
  add("l0.norm", 1, 97, optim::ParamKind::norm);
  add("l0.q", 97, 97, optim::ParamKind::matrix_hidden);
  add("l0.up", 131, 97, optim::ParamKind::matrix_hidden);
  add("l0.down", 97, 131, optim::ParamKind::matrix_hidden);
  add("l0.bias", 1, 61, optim::ParamKind::bias);
  add("l0.gate", 1, 1, optim::ParamKind::scalar);
  add("l1.norm", 1, 97, optim::ParamKind::norm);
  add("l1.q", 97, 97, optim::ParamKind::matrix_hidden);
  add("l1.up", 131, 97, optim::ParamKind::matrix_hidden);
  add("l1.down", 97, 131, optim::ParamKind::matrix_hidden);
  add("l2.q", 97, 97, optim::ParamKind::matrix_hidden);
  add("l1.route", 13, 97, optim::ParamKind::matrix_hidden);
  add("final.norm", 1, 97, optim::ParamKind::norm);
  add("head", 353, 97, optim::ParamKind::head);  // 34241: 3 blocks
  *total = off;
  return t;
}

inline optim::OptimizerConfig config(optim::OptimizerName name) {
  optim::OptimizerConfig c;
  c.name = name;
  c.lr = 2e-2;
  c.weight_decay = 0.1;
  c.grad_clip = 1.0;
  if (name != optim::OptimizerName::adamw) {
    c.scalar_lr = 3e-2;
    c.scalar_weight_decay = 0.05;
  }
  return c;
}

inline const char* name_of(optim::OptimizerName n) {
  return n == optim::OptimizerName::adamw ? "adamw" : n == optim::OptimizerName::muon ? "muon" : "normuon";
}

// Rank r's local gradients at step s on `world` ranks: fresh random values, never zero;
// even steps clip (norm ≈ 2), odd ones do not.
inline std::vector<float> local_grads(std::size_t total, int rank, int step, int world) {
  std::mt19937 gen(static_cast<unsigned>(1000 * step + 17 * rank + 7 * world + 3));
  std::normal_distribution<float> d(0.0f, step % 2 ? 1e-4f : 6e-3f);
  std::vector<float> g(total);
  for (float& x : g) x = d(gen);
  return g;
}

inline std::vector<float> initial_params(std::size_t total) {
  std::mt19937 gen(42);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<float> p(total);
  for (float& x : p) x = d(gen);
  return p;
}

// The fake group's reduction: rank 0's value, + rank 1's, + ... per element.
inline std::vector<float> summed(std::size_t total, int step, int world) {
  std::vector<float> s = local_grads(total, 0, step, world);
  for (int r = 1; r < world; ++r) {
    const std::vector<float> g = local_grads(total, r, step, world);
    for (std::size_t i = 0; i < total; ++i) s[i] += g[i];
  }
  return s;
}

inline double lr_at(int step) { return 1.0 - 0.1 * step; }
inline double scalar_at(int step) { return std::min(1.0, 0.5 + 0.25 * step); }

struct RunResult {
  std::vector<float> params;
  std::vector<double> norms;
  std::string state;
  std::size_t state_bytes = 0;
};

// A flat f32 buffer in backend memory, freed with the object.
struct Buffer {
  kernels::Backend& be;
  kernels::Tensor t;
  Buffer(kernels::Backend& b, std::size_t n)
      : be(b), t(b.alloc_bytes(n * sizeof(float)), kernels::DType::f32, {static_cast<int64_t>(n)}) {}
  ~Buffer() { be.free_bytes(t.data); }
};

// The unsharded DeviceOptimizer (blocked norm) for steps [from, to) on the summed gradients
// of worlds[s] ranks at step s, from params0 and (if not empty) state0.
inline RunResult unsharded(kernels::Backend& be, const optim::OptimizerConfig& cfg, const std::vector<int>& worlds,
                     int from, int to, const std::vector<float>& params0, const std::string& state0) {
  std::size_t total = 0;
  const auto t = table(&total);
  RunResult out;
  Buffer P(be, total), G(be, total);
  be.upload(params0.data(), P.t);
  optim::DeviceOptimizer opt(be, cfg, t, total, /*blocked_norm=*/true);
  if (!state0.empty()) opt.load_state(state0);
  for (int s = from; s < to; ++s) {
    const std::vector<float> g = summed(total, s, worlds[static_cast<std::size_t>(s)]);
    be.upload(g.data(), G.t);
    out.norms.push_back(opt.clip_gradients(G.t));
    opt.step(P.t, G.t, lr_at(s), scalar_at(s));
  }
  out.params.resize(total);
  be.download(P.t, out.params.data());
  out.state = opt.save_state();
  return out;
}

// DeviceZeroOptimizer on `world` ranks (one backend each) for steps [from, to): each rank
// reduce-scatters its local gradients, clips, steps; then every rank saves the state.
inline std::vector<RunResult> sharded(const BackendFactory& make, const optim::OptimizerConfig& cfg, int world, int from,
                                int to, const std::vector<float>& params0, const std::string& state0) {
  std::size_t total = 0;
  const auto t = table(&total);
  std::vector<std::unique_ptr<kernels::Backend>> bes;
  for (int r = 0; r < world; ++r) bes.push_back(make());
  std::vector<RunResult> out(static_cast<std::size_t>(world));
  FakeGroup group(world);
  group.run([&](int rank, optim::Communicator& host) {
    kernels::Backend& be = *bes[static_cast<std::size_t>(rank)];
    RunResult& res = out[static_cast<std::size_t>(rank)];
    StagedCommunicator comm(host, be);
    Buffer P(be, total), G(be, total);
    be.upload(params0.data(), P.t);
    optim::DeviceZeroOptimizer zero(be, cfg, t, total, comm);
    if (!state0.empty()) zero.load_state(state0);
    for (int s = from; s < to; ++s) {
      const std::vector<float> g = local_grads(total, rank, s, world);
      be.upload(g.data(), G.t);
      zero.reduce_gradients(G.t);
      res.norms.push_back(zero.clip_gradients(G.t));
      zero.step(P.t, G.t, lr_at(s), scalar_at(s));
    }
    res.params.resize(total);
    be.download(P.t, res.params.data());
    res.state = zero.save_state();
    res.state_bytes = zero.state_bytes();
  });
  return out;
}

inline std::size_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return i;
  return a.size() == b.size() ? a.size() : std::min(a.size(), b.size());
}

// How close a sharded run must come to the unsharded one. exact: parameters bit for bit, the
// state blob byte for byte (elementwise updates, and any Muon on the CPU). rounding: the GPU's
// fp32 Muon / NorMuon, whose Newton–Schulz batches the matrices of one shape a shard holds, and
// cuBLAS's strided-batched GEMM does not compute a matrix alike at every batch count (seen on
// the H200: parameters 1–2 ulp apart after 4 steps); then every parameter and every state float
// lies within 1e-5 of the reference, relative to its magnitude plus the vector's RMS. bf16: the
// mixed-precision Newton–Schulz, whose bf16 GEMMs round the same difference to bf16 (seen on the
// H200: single parameters 1e-3 apart, relative to magnitude plus RMS); then the relative RMS of
// the difference, over the parameters and over the state floats, is at most 5e-3, the bound of
// the bf16 kernels' outputs against the CPU. Either way the blobs' headers are byte for byte
// equal and the clip norms exact: they read the gradients only.
enum class Match { exact, rounding, bf16 };

inline double rms(const float* x, std::size_t n) {
  double s = 0;
  for (std::size_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return n ? std::sqrt(s / static_cast<double>(n)) : 0.0;
}

// The first index where a and b differ by more than tol·(|b| + rms(b)), or n.
inline std::size_t first_far(const float* a, const float* b, std::size_t n, double tol) {
  const double scale = rms(b, n);
  for (std::size_t i = 0; i < n; ++i)
    if (std::fabs(static_cast<double>(a[i]) - b[i]) > tol * (std::fabs(static_cast<double>(b[i])) + scale)) return i;
  return n;
}

inline constexpr double kRoundingTol = 1e-5;
inline constexpr double kBf16RelRms = 5e-3;

// a against b (n floats) at `match` (not exact).
inline void expect_close(const float* a, const float* b, std::size_t n, Match match, const char* what) {
  if (match == Match::bf16) {
    const double e = gpu_test::rel_rms(a, b, n);
    EXPECT_LE(e, kBf16RelRms) << what << ": relative RMS of the difference over " << n << " floats";
    return;
  }
  const std::size_t d = first_far(a, b, n, kRoundingTol);
  EXPECT_EQ(d, n) << what << ": float " << d << " of " << n << ": " << (d < n ? a[d] : 0.f) << " vs "
                  << (d < n ? b[d] : 0.f);
}

// A state blob: magic, header length, header, then the floats (Optimizer::save_state).
inline void expect_state_close(const std::string& z, const std::string& ref, Match match) {
  std::uint64_t hlen = 0;
  const std::size_t body = 8 + sizeof(hlen);
  ASSERT_EQ(z.size(), ref.size()) << "state blob sizes";
  ASSERT_GE(ref.size(), body);
  std::memcpy(&hlen, ref.data() + 8, sizeof(hlen));
  ASSERT_LE(body + hlen, ref.size());
  EXPECT_EQ(z.substr(0, body + hlen), ref.substr(0, body + hlen)) << "state blob headers differ";
  const std::size_t n = (ref.size() - body - hlen) / sizeof(float);
  std::vector<float> a(n), b(n);
  std::memcpy(a.data(), z.data() + body + hlen, n * sizeof(float));
  std::memcpy(b.data(), ref.data() + body + hlen, n * sizeof(float));
  expect_close(a.data(), b.data(), n, match, "state");
}

// Every rank against the reference at `match`; the norms exactly.
inline void expect_same(const std::vector<RunResult>& ranks, const RunResult& ref, const std::string& what,
                        Match match = Match::exact) {
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    SCOPED_TRACE(what + " rank " + std::to_string(r));
    const RunResult& z = ranks[r];
    ASSERT_EQ(z.params.size(), ref.params.size());
    if (match == Match::exact) {
      const std::size_t d = first_difference(z.params, ref.params);
      EXPECT_EQ(d, ref.params.size()) << "first differing parameter float " << d << ": " << z.params[d] << " vs "
                                      << ref.params[d];
    } else {
      expect_close(z.params.data(), ref.params.data(), ref.params.size(), match, "parameters");
    }
    ASSERT_EQ(z.norms.size(), ref.norms.size());
    for (std::size_t s = 0; s < ref.norms.size(); ++s) {
      EXPECT_EQ(z.norms[s], ref.norms[s]) << "norm of step " << s;
      EXPECT_GT(z.norms[s], 0.0);
    }
    if (match == Match::exact)
      EXPECT_TRUE(z.state == ref.state) << "state blob differs (" << z.state.size() << " vs " << ref.state.size()
                                        << " bytes)";
    else
      expect_state_close(z.state, ref.state, match);
  }
}

// 4 steps (two clipped) on 2 and 3 ranks against the unsharded optimiser on one backend;
// the moments held per rank are below the unsharded optimiser's.
inline void check_matches_unsharded(const BackendFactory& make, optim::OptimizerName name,
                                    Match match = Match::exact) {
  std::size_t total = 0;
  const auto t = table(&total);
  const optim::OptimizerConfig cfg = config(name);
  const std::vector<float> p0 = initial_params(total);
  auto ref_be = make();
  for (int world : {2, 3}) {
    const std::vector<int> worlds(4, world);
    const RunResult ref = unsharded(*ref_be, cfg, worlds, 0, 4, p0, "");
    const std::vector<RunResult> z = sharded(make, cfg, world, 0, 4, p0, "");
    expect_same(z, ref, std::string(name_of(name)) + " world " + std::to_string(world), match);
    const optim::StateBytes sb = optim::optimizer_state_bytes(cfg, t, world);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(z[static_cast<std::size_t>(r)].state_bytes, sb.per_rank[static_cast<std::size_t>(r)]) << r;
      EXPECT_LT(z[static_cast<std::size_t>(r)].state_bytes, sb.full) << r;
    }
  }
}

// 2 steps on 2 ranks, the blob and parameters resumed on 3 ranks (and on one unsharded
// optimiser) for 2 more: both continue as the unsharded run of all 4 steps. A small save
// window makes save_state cross windows (and pieces straddle them).
inline void check_resume_on_other_world(const BackendFactory& make, optim::OptimizerName name,
                                        Match match = Match::exact) {
  std::size_t total = 0;
  (void)table(&total);
  const optim::OptimizerConfig cfg = config(name);
  const std::vector<float> p0 = initial_params(total);
  const std::size_t window = optim::DeviceZeroOptimizer::save_window();
  optim::DeviceZeroOptimizer::set_save_window_for_tests(10007);
  auto ref_be = make();
  const std::vector<int> worlds{2, 2, 3, 3};
  const RunResult ref = unsharded(*ref_be, cfg, worlds, 0, 4, p0, "");
  const RunResult ref_half = unsharded(*ref_be, cfg, worlds, 0, 2, p0, "");
  const std::vector<RunResult> first = sharded(make, cfg, 2, 0, 2, p0, "");
  expect_same(first, ref_half, std::string(name_of(name)) + " steps 0-1 on 2 ranks", match);
  const std::vector<RunResult> second = sharded(make, cfg, 3, 2, 4, first[0].params, first[0].state);
  RunResult tail = ref;
  tail.norms.erase(tail.norms.begin(), tail.norms.begin() + 2);
  expect_same(second, tail, std::string(name_of(name)) + " steps 2-3 on 3 ranks", match);
  // The sharded blob resumes on one unsharded optimiser too.
  const RunResult alone = unsharded(*ref_be, cfg, worlds, 2, 4, first[0].params, first[0].state);
  expect_same({alone}, tail, std::string(name_of(name)) + " steps 2-3 unsharded", match);
  optim::DeviceZeroOptimizer::set_save_window_for_tests(window);
}

}  // namespace device_zero
}  // namespace lar::testing
