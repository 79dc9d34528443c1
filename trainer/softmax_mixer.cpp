#include "trainer/softmax_mixer.hpp"

#include <cmath>

#include "core/error.hpp"

namespace lar::trainer {

using kernels::DType;
using kernels::Tensor;

SoftmaxMixer::SoftmaxMixer(const MixerConfig& cfg)
    : cfg_(cfg), hq_(cfg.n_heads), hkv_(cfg.n_kv_heads), hd_(cfg.head_dim) {
  rope_base_ = cfg.model.at("rope_base").get<double>();
  window_ = cfg.model.at("window").get<int64_t>();
  scale_ = 1.0 / std::sqrt(double(hd_));
}

std::vector<ParamSpec> SoftmaxMixer::params() const {
  const int64_t d = cfg_.d_model;
  const double out_std = cfg_.init_std / std::sqrt(2.0 * cfg_.n_layers);
  return {
      {"wq", {int64_t(hq_) * hd_, d}, ParamKind::matrix_hidden, InitRule::Normal(cfg_.init_std)},
      {"wk", {int64_t(hkv_) * hd_, d}, ParamKind::matrix_hidden, InitRule::Normal(cfg_.init_std)},
      {"wv", {int64_t(hkv_) * hd_, d}, ParamKind::matrix_hidden, InitRule::Normal(cfg_.init_std)},
      {"wo", {d, int64_t(hq_) * hd_}, ParamKind::matrix_hidden, InitRule::Normal(out_std)},
  };
}

void SoftmaxMixer::bind(std::vector<Tensor> p, std::vector<Tensor> g) {
  if (p.size() != 4 || g.size() != 4) throw RuntimeError("softmax mixer: expected 4 parameters");
  wq_ = p[0], wk_ = p[1], wv_ = p[2], wo_ = p[3];
  gwq_ = g[0], gwk_ = g[1], gwv_ = g[2], gwo_ = g[3];
}

// The q/k/v projections as one GEMM, where the three weights (and their gradients) are
// adjacent in the flat buffers (they are: declared in that order) — on backends that keep
// activations in a reduced dtype (the GPU), whose GEMMs and passes this saves; the CPU
// reference keeps the three GEMMs.
bool SoftmaxMixer::fused_qkv(bool reduced) const {
  auto next = [](const Tensor& a, const Tensor& b) { return static_cast<const char*>(a.data) + a.bytes() == b.data; };
  return reduced && next(wq_, wk_) && next(wk_, wv_) && next(gwq_, gwk_) && next(gwk_, gwv_);
}

void SoftmaxMixer::forward(ForwardContext& ctx, const Tensor& x, const Tensor& y, Routing&) {
  auto& be = ctx.be;
  auto& ar = ctx.arena;
  const DType dt = be.dtype();
  // q, k, v, o (and x as a GEMM operand) live in the backend's activation dtype: bf16 on
  // the GPU in mixed precision, so the flash kernels read them without conversion passes.
  const DType at = be.act_dtype();
  const int64_t B = x.size(0), T = x.size(1);
  x_ = x;  // the model hands over x in act_dtype() where it can (then kept as is)
  if (x.dtype != at) {
    x_ = ar.alloc(at, std::vector<int64_t>(x.shape()));
    be.convert(x, x_);
  }
  q_ = ar.alloc(at, {B, T, hq_, hd_});
  k_ = ar.alloc(at, {B, T, hkv_, hd_});
  v_ = ar.alloc(at, {B, T, hkv_, hd_});
  o_ = ar.alloc(at, {B, T, hq_, hd_});
  lse_ = ar.alloc(dt, {B, hq_, T});
  const int64_t qd = int64_t(hq_) * hd_, kd = int64_t(hkv_) * hd_;
  if (fused_qkv(at != dt)) {
    // One GEMM against [W_q; W_k; W_v], then q/k/v split with RoPE in one pass.
    auto mark = ar.mark();
    Tensor qkv = ar.alloc(at, {B, T, hq_ + 2 * hkv_, hd_});
    be.gemm(x_, false, Tensor(wq_.data, dt, {qd + 2 * kd, int64_t(cfg_.d_model)}), true, qkv.matrix(qd + 2 * kd));
    be.rope_split_qkv(qkv, q_, k_, v_, rope_base_, 0);
    ar.release(mark);
  } else {
    be.gemm(x_, false, wq_, true, q_.matrix(qd));
    be.gemm(x_, false, wk_, true, k_.matrix(kd));
    be.gemm(x_, false, wv_, true, v_.matrix(kd));
    be.rope_fwd(q_, rope_base_, 0);
    be.rope_fwd(k_, rope_base_, 0);
  }
  be.attention_fwd(q_, k_, v_, o_, lse_, scale_, window_);
  be.gemm(o_.matrix(qd), false, wo_, true, y);
}

void SoftmaxMixer::backward(ForwardContext& ctx, const Tensor& dy, const Tensor& dx, Routing&) {
  auto& be = ctx.be;
  auto& ar = ctx.arena;
  const DType at = q_.dtype;
  auto mark = ar.mark();
  Tensor dy_a = dy;  // dy as a GEMM operand, in the activation dtype
  if (at != dy.dtype) {
    dy_a = ar.alloc(at, std::vector<int64_t>(dy.shape()));
    be.convert(dy, dy_a);
  }
  Tensor dout = ar.alloc(at, std::vector<int64_t>(o_.shape()));
  Tensor dq = ar.alloc(at, std::vector<int64_t>(q_.shape()));
  Tensor dk = ar.alloc(at, std::vector<int64_t>(k_.shape()));
  Tensor dv = ar.alloc(at, std::vector<int64_t>(v_.shape()));
  const int64_t qd = int64_t(hq_) * hd_, kd = int64_t(hkv_) * hd_;
  be.gemm(dy_a, true, o_.matrix(qd), false, gwo_, 1.0, 1.0);
  be.gemm(dy_a, false, wo_, false, dout.matrix(qd));
  be.attention_bwd(q_, k_, v_, o_, lse_, dout, dq, dk, dv, scale_, window_);
  if (fused_qkv(at != be.dtype())) {
    // [dq | dk | dv] (RoPE undone) as one matrix: one GEMM for the three weight gradients
    // and one for dx.
    const int64_t w = qd + 2 * kd, d = cfg_.d_model;
    Tensor dqkv = ar.alloc(at, {q_.size(0), q_.size(1), hq_ + 2 * hkv_, hd_});
    be.rope_merge_qkv(dq, dk, dv, dqkv, rope_base_, 0);
    be.gemm(dqkv.matrix(w), true, x_, false, Tensor(gwq_.data, gwq_.dtype, {w, d}), 1.0, 1.0);
    be.gemm(dqkv.matrix(w), false, Tensor(wq_.data, wq_.dtype, {w, d}), false, dx);
    ar.release(mark);
    return;
  }
  be.rope_bwd(dq, rope_base_, 0);
  be.rope_bwd(dk, rope_base_, 0);
  be.gemm(dq.matrix(qd), true, x_, false, gwq_, 1.0, 1.0);
  be.gemm(dk.matrix(kd), true, x_, false, gwk_, 1.0, 1.0);
  be.gemm(dv.matrix(kd), true, x_, false, gwv_, 1.0, 1.0);
  be.gemm(dq.matrix(qd), false, wq_, false, dx);
  be.gemm(dk.matrix(kd), false, wk_, false, dx, 1.0, 1.0);
  be.gemm(dv.matrix(kd), false, wv_, false, dx, 1.0, 1.0);
  ar.release(mark);
}

namespace {
// The KV cache: keys (RoPE applied) and values of every position so far.
struct KvCache final : MixerState {
  kernels::Backend& be;
  void* kmem = nullptr;
  void* vmem = nullptr;
  Tensor k, v;  // [B·max_len, Hkv, D]
  int batch = 0, max_len = 0, pos = 0;
  KvCache(kernels::Backend& b, int batch_, int max_len_, int hkv, int hd) : be(b), batch(batch_), max_len(max_len_) {
    const int64_t rows = int64_t(batch) * max_len;
    kmem = be.alloc_bytes(rows * hkv * hd * kernels::dtype_size(be.dtype()));
    vmem = be.alloc_bytes(rows * hkv * hd * kernels::dtype_size(be.dtype()));
    k = Tensor(kmem, be.dtype(), {rows, hkv, hd});
    v = Tensor(vmem, be.dtype(), {rows, hkv, hd});
  }
  ~KvCache() override {
    be.free_bytes(kmem);
    be.free_bytes(vmem);
  }
};
}  // namespace

std::unique_ptr<MixerState> SoftmaxMixer::init_state(kernels::Backend& be, int batch, int max_len) const {
  return std::make_unique<KvCache>(be, batch, max_len, hkv_, hd_);
}

void SoftmaxMixer::step(ForwardContext& ctx, const Tensor& x, const Tensor& y, MixerState& state, Routing&) {
  auto& be = ctx.be;
  auto& ar = ctx.arena;
  auto& kv = dynamic_cast<KvCache&>(state);
  const DType dt = be.dtype();
  const int64_t B = x.size(0);
  if (B != kv.batch) throw RuntimeError("softmax step: batch differs from the state's");
  if (kv.pos >= kv.max_len) throw RuntimeError("softmax step: KV cache full");
  auto mark = ar.mark();
  Tensor q = ar.alloc(dt, {B, 1, hq_, hd_});
  Tensor k = ar.alloc(dt, {B, 1, hkv_, hd_});
  Tensor v = ar.alloc(dt, {B, 1, hkv_, hd_});
  Tensor o = ar.alloc(dt, {B, 1, hq_, hd_});
  Tensor lse = ar.alloc(dt, {B, hq_, 1});
  const int64_t qd = int64_t(hq_) * hd_, kd = int64_t(hkv_) * hd_;
  be.gemm(x, false, wq_, true, q.matrix(qd));
  be.gemm(x, false, wk_, true, k.matrix(kd));
  be.gemm(x, false, wv_, true, v.matrix(kd));
  be.rope_fwd(q, rope_base_, kv.pos);
  be.rope_fwd(k, rope_base_, kv.pos);
  const int64_t n = kv.pos + 1;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row0 = b * kv.max_len;
    be.copy(k.slice0(b, 1), kv.k.slice0(row0 + kv.pos, 1));
    be.copy(v.slice0(b, 1), kv.v.slice0(row0 + kv.pos, 1));
    Tensor kb = kv.k.slice0(row0, n).view({1, n, hkv_, hd_});
    Tensor vb = kv.v.slice0(row0, n).view({1, n, hkv_, hd_});
    be.attention_fwd(q.slice0(b, 1), kb, vb, o.slice0(b, 1), lse.slice0(b, 1), scale_, window_);
  }
  be.gemm(o.matrix(qd), false, wo_, true, y);
  ++kv.pos;
  ar.release(mark);
}

static MixerRegistration reg_softmax{"softmax",
                                     [](const MixerConfig& c) { return std::make_unique<SoftmaxMixer>(c); }};

}  // namespace lar::trainer
