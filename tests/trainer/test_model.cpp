// The whole model: fp64 finite-difference gradients of every parameter (dense softmax
// stacks with GQA and a window; a hybrid stack with cross-layer routing through a test
// mixer), decode-step equivalence, determinism, config validation.
#include <gtest/gtest.h>

#include <cstring>

#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "grad_check.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "trainer/model.hpp"
#include "trainer/softmax_mixer.hpp"

using namespace lar;
using kernels::DType;
using kernels::Tensor;

namespace {

// A routing-capable mixer for tests: y = x·Wᵀ + in·Cᵀ, publishes out = x·Uᵀ.
class RouteMixer final : public trainer::Mixer {
 public:
  explicit RouteMixer(const trainer::MixerConfig& c) : d_(c.d_model) {}
  std::string kind() const override { return "test_route"; }
  std::vector<trainer::ParamSpec> params() const override {
    using trainer::InitRule;
    using trainer::ParamKind;
    return {{"w", {d_, d_}, ParamKind::matrix_hidden, InitRule::Normal(0.3)},
            {"u", {kSide, d_}, ParamKind::matrix_hidden, InitRule::Normal(0.3)},
            {"c", {d_, kSide}, ParamKind::matrix_hidden, InitRule::Normal(0.3)}};
  }
  void bind(std::vector<Tensor> p, std::vector<Tensor> g) override {
    w_ = p[0], u_ = p[1], c_ = p[2], gw_ = g[0], gu_ = g[1], gc_ = g[2];
  }
  bool publishes() const override { return true; }
  int64_t side_dim() const override { return kSide; }
  void forward(trainer::ForwardContext& ctx, const Tensor& x, const Tensor& y, trainer::Routing& r) override {
    x_ = x;
    in_ = r.in;
    ctx.be.gemm(x, false, w_, true, y);
    if (!r.in.empty()) ctx.be.gemm(r.in, false, c_, true, y, 1.0, 1.0);
    r.out = ctx.arena.alloc(ctx.be.dtype(), {x.size(0), x.size(1), kSide});
    ctx.be.gemm(x, false, u_, true, r.out);
  }
  void backward(trainer::ForwardContext& ctx, const Tensor& dy, const Tensor& dx, trainer::Routing& r) override {
    ctx.be.gemm(dy, true, x_, false, gw_, 1.0, 1.0);
    ctx.be.gemm(dy, false, w_, false, dx);
    if (!in_.empty()) {
      ctx.be.gemm(dy, true, in_, false, gc_, 1.0, 1.0);
      ctx.be.gemm(dy, false, c_, false, r.d_in, 1.0, 1.0);
    }
    ctx.be.gemm(r.d_out, true, x_, false, gu_, 1.0, 1.0);
    ctx.be.gemm(r.d_out, false, u_, false, dx, 1.0, 1.0);
  }
  std::unique_ptr<trainer::MixerState> init_state(kernels::Backend&, int, int) const override { return nullptr; }
  void step(trainer::ForwardContext&, const Tensor&, const Tensor&, trainer::MixerState&, trainer::Routing&) override {
    throw RuntimeError("test_route: no decode");
  }

 private:
  static constexpr int64_t kSide = 3;
  int64_t d_;
  Tensor w_, u_, c_, gw_, gu_, gc_, x_, in_;
};

trainer::MixerRegistration reg_route{"test_route",
                                     [](const trainer::MixerConfig& c) { return std::make_unique<RouteMixer>(c); }};

json tiny_config(json model_overrides) {
  json c = {{"model", {{"n_layers", 2}, {"d_model", 8}, {"n_heads", 2}, {"n_kv_heads", 1}, {"vocab_size", 11},
                       {"d_ff", 16}, {"init_std", 0.4}}},
            {"data", {{"seq_len", 6}, {"batch_size", 2}}}};
  if (model_overrides.is_object()) c["model"].update(model_overrides);
  return with_defaults(c);
}

data::Batch random_batch(int B, int T, int V, uint64_t seed) {
  trainer::Rng r(seed);
  data::Batch b;
  b.batch = B;
  b.seq_len = T;
  for (int i = 0; i < B * T; ++i) {
    b.inputs.push_back(static_cast<int32_t>(r.next() % V));
    b.targets.push_back(static_cast<int32_t>(r.next() % V));
    b.loss_mask.push_back(i % 5 == 3 ? 0.0f : 1.0f);
  }
  return b;
}

void check_model_gradients(const json& config) {
  kernels::cpu::CpuBackend<double> be(2);
  trainer::Model m(config, be);
  m.init(3);
  // Randomise everything (norm gains, zero-initialised routing P) so no gradient is trivial.
  auto* p = static_cast<double*>(m.params().params().data);
  auto noise = test::random_vec(m.params().numel(), 99, 0.3);
  for (int64_t i = 0; i < m.params().numel(); ++i) p[i] += noise[i];
  auto batch = random_batch(2, 6, 11, 5);
  m.params().zero_grads();
  m.forward_backward(batch);
  const auto* g = static_cast<const double*>(m.params().grads().data);
  for (const auto& info : m.params().table()) {
    std::vector<double> analytic(g + info.offset, g + info.offset + info.numel);
    test::check_grad(info.name.c_str(), p + info.offset, info.numel, analytic,
                     [&] { return m.evaluate(batch).loss; }, 1e-6, 40);
  }
}

TEST(Model, GradientsDenseGqa) { check_model_gradients(tiny_config({})); }

TEST(Model, GradientsDenseSlidingWindow) { check_model_gradients(tiny_config({{"window", 3}, {"n_kv_heads", 2}})); }

TEST(Model, GradientsHybridWithCrossLayerRouting) {
  // Layers 0, 1, 3 are test_route (publishers), layer 2 softmax: the side channel skips it.
  for (const char* routing : {"cler_h", "cler"})
    check_model_gradients(tiny_config({{"n_layers", 4}, {"architecture", "test_route"}, {"stack", "hybrid"},
                                       {"routing", routing}}));
}

TEST(Model, LayerKindsFollowTheStack) {
  json m = tiny_config({{"n_layers", 8}, {"architecture", "gdn"}, {"stack", "hybrid"}, {"hybrid_ratio", 3}})["model"];
  EXPECT_EQ(trainer::layer_kinds(m),
            (std::vector<std::string>{"gdn", "gdn", "gdn", "softmax", "gdn", "gdn", "gdn", "softmax"}));
  m["stack"] = "pure";
  EXPECT_EQ(trainer::layer_kinds(m)[3], "gdn");
  m["stack"] = "dense";
  EXPECT_EQ(trainer::layer_kinds(m)[0], "softmax");
  m["stack"] = "hybrid";
  m["hybrid_ratio"] = 2;
  m["n_layers"] = 20;
  int softmax = 0;
  for (auto& k : trainer::layer_kinds(m)) softmax += k == "softmax";
  EXPECT_EQ(softmax, 6);
}

TEST(Model, ParameterTableIsFlatAndOrdered) {
  kernels::cpu::CpuBackend<float> be(1);
  trainer::Model m(tiny_config({}), be);
  const auto& t = m.params().table();
  ASSERT_EQ(t.front().name, "embed");
  EXPECT_EQ(t.back().name, "head");
  int64_t off = 0;
  for (const auto& p : t) {
    EXPECT_EQ(p.offset, off) << p.name;
    off += p.numel;
  }
  EXPECT_EQ(off, m.params().numel());
  const auto& wq = t[m.params().index_of("layers.1.mixer.wq")];
  EXPECT_EQ(wq.shape, (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(wq.kind, trainer::ParamKind::matrix_hidden);
  EXPECT_EQ(t[m.params().index_of("layers.1.mixer.wk")].shape, (std::vector<int64_t>{4, 8}));  // GQA: 1 kv head
  EXPECT_EQ(t[m.params().index_of("final_norm")].kind, trainer::ParamKind::norm);
  EXPECT_NE(m.params().host_params(), nullptr);
}

TEST(Model, SameSeedSameBitsDifferentSeedDifferentInit) {
  auto run = [](uint64_t seed) {
    kernels::cpu::CpuBackend<float> be(2);
    trainer::Model m(tiny_config({{"d_model", 32}, {"n_heads", 4}}), be);
    m.init(seed);
    m.params().zero_grads();
    auto r = m.forward_backward(random_batch(2, 6, 11, 1));
    std::vector<float> g(m.params().host_grads(), m.params().host_grads() + m.params().numel());
    return std::pair{r.loss, g};
  };
  auto a = run(1), b = run(1), c = run(2);
  EXPECT_EQ(a.first, b.first);
  EXPECT_EQ(0, std::memcmp(a.second.data(), b.second.data(), a.second.size() * sizeof(float)));
  EXPECT_NE(a.first, c.first);
}

TEST(SoftmaxMixer, DecodeStepsEqualTheParallelForward) {
  kernels::cpu::CpuBackend<double> be(2);
  for (int window : {0, 3}) {
    json model = tiny_config({{"window", window}, {"d_model", 16}, {"n_heads", 4}, {"n_kv_heads", 2}})["model"];
    auto mc = trainer::mixer_config(model, 0);
    trainer::SoftmaxMixer mix(mc);
    trainer::ParamStore ps(be);
    for (auto& s : mix.params()) ps.add(s, "", 0);
    ps.allocate();
    ps.init(4);
    std::vector<Tensor> p, g;
    for (int i = 0; i < 4; ++i) p.push_back(ps.param(i)), g.push_back(ps.grad(i));
    mix.bind(p, g);
    const int B = 2, Tn = 7, d = 16;
    auto x = test::random_vec(B * Tn * d, 8);
    std::vector<double> y(B * Tn * d);
    kernels::Arena ar(be);
    trainer::ForwardContext ctx{be, ar, false};
    trainer::Routing r;
    mix.forward(ctx, Tensor(x.data(), DType::f64, {B, Tn, d}), Tensor(y.data(), DType::f64, {B, Tn, d}), r);
    auto state = mix.init_state(be, B, Tn);
    for (int t = 0; t < Tn; ++t) {
      std::vector<double> xt(B * d), yt(B * d);
      for (int b = 0; b < B; ++b) std::memcpy(&xt[b * d], &x[(b * Tn + t) * d], d * sizeof(double));
      mix.step(ctx, Tensor(xt.data(), DType::f64, {B, d}), Tensor(yt.data(), DType::f64, {B, d}), *state, r);
      for (int b = 0; b < B; ++b)
        for (int c = 0; c < d; ++c) ASSERT_NEAR(yt[b * d + c], y[(b * Tn + t) * d + c], 1e-12) << t << " " << window;
    }
  }
}

TEST(ModelConfig, ImpossibleShapesAreUserErrorsNamingTheKey) {
  auto expect_error = [](json overrides, const std::string& needle) {
    json c = tiny_config({});
    c.merge_patch(overrides);
    try {
      trainer::validate_model_config(c);
      FAIL() << "no error for " << overrides.dump();
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error({{"model", {{"d_model", 10}, {"n_heads", 4}}}}, "model.d_model: 10 is not divisible by model.n_heads = 4");
  expect_error({{"model", {{"n_heads", 4}, {"n_kv_heads", 3}}}}, "model.n_heads: 4 is not divisible by model.n_kv_heads = 3");
  expect_error({{"model", {{"architecture", "nosuch"}, {"stack", "pure"}}}}, "mixer 'nosuch' is not implemented");
  expect_error({{"data", {{"seq_len", 0}}}}, "data.seq_len: must be > 0");
  expect_error({{"model", {{"head_dim", 3}}}}, "RoPE needs an even head dimension");
  EXPECT_NO_THROW(trainer::validate_model_config(tiny_config({})));
}

}  // namespace

namespace {
TEST(Model, TwoThreadsAreDeterministicOnShapesThatSplitWork) {
  auto run = [] {
    kernels::cpu::CpuBackend<float> be(2);
    json c = tiny_config({{"d_model", 64}, {"n_heads", 4}, {"n_kv_heads", 2}, {"vocab_size", 11}, {"d_ff", 0}});
    trainer::Model m(c, be);
    m.init(5);
    m.params().zero_grads();
    auto r = m.forward_backward(random_batch(8, 64, 11, 2));
    std::vector<float> g(m.params().host_grads(), m.params().host_grads() + m.params().numel());
    return std::pair{r.loss, g};
  };
  auto a = run(), b = run();
  EXPECT_EQ(a.first, b.first);
  EXPECT_EQ(0, std::memcmp(a.second.data(), b.second.data(), a.second.size() * sizeof(float)));
}
}  // namespace
