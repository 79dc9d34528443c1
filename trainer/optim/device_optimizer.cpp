#include "trainer/optim/device_optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.hpp"
#include "trainer/optim/newton_schulz.hpp"

namespace lar::optim {

using kernels::DType;
using kernels::Tensor;

DeviceOptimizer::DeviceOptimizer(kernels::Backend& be, OptimizerConfig config, std::vector<ParamView> params,
                                 std::size_t total_size)
    : be_(be), host_(config, std::move(params), total_size) {
  if (be_.dtype() != DType::f32) throw RuntimeError("device optimiser: needs an f32 backend");
  std::vector<const ParamView*> by_off;
  for (const ParamView& p : host_.params_) by_off.push_back(&p);
  std::sort(by_off.begin(), by_off.end(), [](auto a, auto b) { return a->offset < b->offset; });
  std::size_t end = 0;
  covers_all_ = true;
  for (const ParamView* p : by_off) {
    covers_all_ = covers_all_ && p->offset == end;
    end = p->offset + p->size();
  }
  covers_all_ = covers_all_ && end == total_size;
  all_adamw_ = true;
  for (std::size_t i = 0; i < host_.params_.size(); ++i) all_adamw_ = all_adamw_ && !host_.slots_[i].muon;
  for (std::size_t i = 0; i < host_.params_.size(); ++i)
    if (host_.slots_[i].muon) {
      const ParamView& p = host_.params_[i];
      const std::size_t r = static_cast<std::size_t>(std::min(p.rows, p.cols));
      largest_ = std::max(largest_, p.size());
      largest_rr_ = std::max(largest_rr_, r * r);
    }
  auto zeroed = [&](std::size_t n) {
    void* p = be_.alloc_bytes(std::max<std::size_t>(n, 1) * sizeof(float));
    be_.zero(Tensor(p, DType::f32, {static_cast<int64_t>(std::max<std::size_t>(n, 1))}));
    return p;
  };
  m_ = zeroed(host_.m_.size());
  v_ = zeroed(host_.v_.size());
  if (largest_) work_ = be_.alloc_bytes((4 * largest_ + 2 * largest_rr_) * sizeof(float));
  // The host copies only stage save/load; drop them until then (2 floats per parameter).
  std::vector<float>().swap(host_.scratch_);
}

DeviceOptimizer::~DeviceOptimizer() {
  be_.free_bytes(m_);
  be_.free_bytes(v_);
  if (work_) be_.free_bytes(work_);
}

Tensor DeviceOptimizer::at(const Tensor& flat, std::size_t offset, std::size_t n) const {
  return Tensor(static_cast<char*>(flat.data) + offset * sizeof(float), DType::f32, {static_cast<int64_t>(n)});
}

double DeviceOptimizer::clip_gradients(const Tensor& grads) {
  pending_scale_ = 1.0f;
  double ss = 0;
  if (covers_all_) {
    ss = be_.sum_squares(grads);
  } else {
    for (const ParamView& p : host_.params_) ss += be_.sum_squares(at(grads, p.offset, p.size()));
  }
  const double norm = std::sqrt(ss);
  const double clip = host_.cfg_.grad_clip;
  if (!std::isfinite(norm) || clip <= 0) return norm;
  const double coef = clip / (norm + 1e-6);
  if (coef < 1.0) {
    const double cf = static_cast<float>(coef);
    if (all_adamw_) {
      // Applied by the next step() as AdamW reads g (AdamWStep::grad_scale): the same bits
      // as scaling here, without a read and write of every gradient (0.7 ms at 344M params).
      pending_scale_ = static_cast<float>(cf);
    } else if (covers_all_) {
      be_.scale(grads, cf);
    } else {
      for (const ParamView& p : host_.params_) be_.scale(at(grads, p.offset, p.size()), cf);
    }
  }
  return norm;
}

void DeviceOptimizer::step(const Tensor& params, const Tensor& grads, const Schedule& schedule,
                           std::int64_t step_index) {
  step(params, grads, schedule.factor(step_index), schedule.warmup_factor(step_index));
}

void DeviceOptimizer::step(const Tensor& params, const Tensor& grads, double lr_factor, double scalar_factor) {
  ++host_.t_;
  const OptimizerConfig& c = host_.cfg_;
  const double t = static_cast<double>(host_.t_);
  const double bc1 = 1.0 - std::pow(c.beta1, t);
  const double bc2 = 1.0 - std::pow(c.beta2, t);
  const Tensor m(m_, DType::f32, {static_cast<int64_t>(std::max<std::size_t>(host_.m_.size(), 1))});
  const Tensor v(v_, DType::f32, {static_cast<int64_t>(std::max<std::size_t>(host_.v_.size(), 1))});
  // Every AdamW parameter is a segment of one adamw_step_multi (one pass on the GPU instead
  // of a launch per tensor); consecutive parameters whose weights, gradients, m and v are
  // contiguous and whose scalars are equal share a segment. Elementwise: the same bits.
  std::vector<kernels::Backend::AdamWSegment> segs;
  auto same = [](const kernels::Backend::AdamWStep& x, const kernels::Backend::AdamWStep& y) {
    return x.beta1 == y.beta1 && x.beta2 == y.beta2 && x.eps == y.eps && x.step_size == y.step_size &&
           x.inv_sqrt_bc2 == y.inv_sqrt_bc2 && x.decay == y.decay && x.grad_scale == y.grad_scale;
  };
  for (std::size_t i = 0; i < host_.params_.size(); ++i) {
    const ParamView& p = host_.params_[i];
    const Optimizer::Slot& s = host_.slots_[i];
    const double lr = s.lr_mult * (s.own_lr ? scalar_factor : lr_factor);
    if (s.muon) {
      muon_update(p, s, params, grads, lr);
      continue;
    }
    // The host Optimizer's scalars, rounded to float the same way.
    kernels::Backend::AdamWStep a;
    a.beta1 = static_cast<float>(c.beta1);
    a.beta2 = static_cast<float>(c.beta2);
    a.eps = static_cast<float>(c.eps);
    a.step_size = static_cast<float>(lr / bc1);
    a.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
    a.decay = static_cast<float>(1.0 - lr * s.wd);
    a.grad_scale = pending_scale_;
    const int64_t n = static_cast<int64_t>(p.size()), off = static_cast<int64_t>(p.offset);
    const int64_t m_off = static_cast<int64_t>(s.m_off), v_off = static_cast<int64_t>(s.v_off);
    auto* last = segs.empty() ? nullptr : &segs.back();
    if (last && same(last->step, a) && last->offset + last->n == off && last->m_offset + last->n == m_off &&
        last->v_offset + last->n == v_off) {
      last->n += n;
    } else {
      kernels::Backend::AdamWSegment seg;
      seg.offset = off, seg.m_offset = m_off, seg.v_offset = v_off, seg.n = n, seg.step = a;
      segs.push_back(seg);
    }
  }
  if (!segs.empty()) be_.adamw_step_multi(params, grads, m, v, segs);
  pending_scale_ = 1.0f;  // applied once
}

void DeviceOptimizer::muon_update(const ParamView& p, const Optimizer::Slot& s, const Tensor& params,
                                  const Tensor& grads, double lr) {
  const OptimizerConfig& c = host_.cfg_;
  const std::size_t n = p.size();
  float* work = static_cast<float*>(work_);
  const Tensor u(work, DType::f32, {p.rows, p.cols});
  const Tensor o(work + largest_, DType::f32, {p.rows, p.cols});
  const Tensor buf(static_cast<float*>(m_) + s.m_off, DType::f32, {p.rows, p.cols});
  be_.momentum_step(at(grads, p.offset, n), buf, u, static_cast<float>(c.momentum), c.nesterov);
  newton_schulz(u, o, p.rows, p.cols);
  if (c.name == OptimizerName::normuon)
    be_.normuon_normalize(o, at(Tensor(v_, DType::f32, {1}), s.v_off, s.v_len), c.normuon_beta2, c.eps);
  const double decay = static_cast<float>(1.0 - lr * s.wd);
  const double step_size = static_cast<float>(lr * host_.muon_scale(p.rows, p.cols));
  be_.decayed_update(at(params, p.offset, n), o, decay, step_size);
}

// newton_schulz.hpp's algorithm on backend tensors: X₀ = G/(‖G‖_F + ε) in wide form, then
// X ← a·X + (b·A + c·A·A)·X with A = X·Xᵀ (A is symmetric, so A·Aᵀ = A·A).
void DeviceOptimizer::newton_schulz(const Tensor& g, const Tensor& out, int rows, int cols) {
  const OptimizerConfig& c = host_.cfg_;
  const bool tall = rows > cols;
  const int64_t r = tall ? cols : rows, w = tall ? rows : cols;
  float* work = static_cast<float*>(work_);
  Tensor x(work + 2 * largest_, DType::f32, {r, w});
  Tensor y(work + 3 * largest_, DType::f32, {r, w});
  const Tensor A(work + 4 * largest_, DType::f32, {r, r});
  const Tensor B(work + 4 * largest_ + largest_rr_, DType::f32, {r, r});
  const double ss = be_.sum_squares(g);
  const double inv = static_cast<float>(1.0 / (std::sqrt(ss) + kNewtonSchulzEps));
  if (tall) {
    be_.transpose(g, x, inv);
  } else {
    be_.copy(g, x);
    be_.scale(x, inv);
  }
  const auto [a, b, cc] = c.ns_coefficients;
  for (int s = 0; s < c.ns_steps; ++s) {
    be_.gemm(x, false, x, true, A);  // A = X·Xᵀ
    be_.copy(A, B);
    be_.gemm(A, false, A, false, B, cc, b);  // B = b·A + c·A·A
    be_.copy(x, y);
    be_.gemm(B, false, x, false, y, 1.0, a);  // Y = a·X + B·X
    std::swap(x, y);
  }
  if (tall) be_.transpose(x, out, 1.0);
  else be_.copy(x, out);
}

std::string DeviceOptimizer::save_state() {
  if (!host_.m_.empty()) be_.download(Tensor(m_, DType::f32, {static_cast<int64_t>(host_.m_.size())}), host_.m_.data());
  if (!host_.v_.empty()) be_.download(Tensor(v_, DType::f32, {static_cast<int64_t>(host_.v_.size())}), host_.v_.data());
  return host_.save_state();
}

void DeviceOptimizer::load_state(const std::string& blob) {
  host_.load_state(blob);
  if (!host_.m_.empty()) be_.upload(host_.m_.data(), Tensor(m_, DType::f32, {static_cast<int64_t>(host_.m_.size())}));
  if (!host_.v_.empty()) be_.upload(host_.v_.data(), Tensor(v_, DType::f32, {static_cast<int64_t>(host_.v_.size())}));
}

}  // namespace lar::optim
