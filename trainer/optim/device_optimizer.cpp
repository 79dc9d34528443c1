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
                                 std::size_t total_size, bool blocked_norm)
    : be_(be), host_(config, std::move(params), total_size), blocked_norm_(blocked_norm) {
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
  // Muon matrices grouped by shape, in table order, each group cut so that its three
  // matrix buffers stay within kBatchElements floats (or one matrix, if larger).
  constexpr std::size_t kBatchElements = std::size_t(1) << 24;
  std::size_t work = 0;
  for (std::size_t i = 0; i < host_.params_.size(); ++i) {
    if (!host_.slots_[i].muon) continue;
    const ParamView& p = host_.params_[i];
    auto it = std::find_if(batches_.begin(), batches_.end(), [&](const MuonBatch& b) {
      return b.rows == p.rows && b.cols == p.cols && (b.slots.size() + 1) * p.size() <= kBatchElements;
    });
    if (it == batches_.end()) it = batches_.insert(batches_.end(), MuonBatch{p.rows, p.cols, {}});
    it->slots.push_back(i);
  }
  for (const MuonBatch& b : batches_) {
    const std::size_t n = static_cast<std::size_t>(b.rows) * b.cols, r = static_cast<std::size_t>(std::min(b.rows, b.cols));
    work = std::max(work, b.slots.size() * (3 * n + 2 * r * r));
  }
  auto zeroed = [&](std::size_t n) {
    void* p = be_.alloc_bytes(std::max<std::size_t>(n, 1) * sizeof(float));
    be_.zero(Tensor(p, DType::f32, {static_cast<int64_t>(std::max<std::size_t>(n, 1))}));
    return p;
  };
  m_ = zeroed(host_.m_.size());
  v_ = zeroed(host_.v_.size());
  if (work) work_ = be_.alloc_bytes(work * sizeof(float));
  if (blocked_norm_) {
    for (const ParamView& p : host_.params_) {
      norm_ranges_.push_back({static_cast<int64_t>(p.offset), static_cast<int64_t>(p.size()),
                              static_cast<int64_t>(norm_blocks_)});
      norm_blocks_ += norm_blocks(p.size());
    }
    block_sums_ = be_.alloc_bytes(std::max<std::size_t>(norm_blocks_, 1) * sizeof(double));
  }
  // The host copies only stage save/load; drop them until then (2 floats per parameter).
  std::vector<float>().swap(host_.scratch_);
}

DeviceOptimizer::~DeviceOptimizer() {
  be_.free_bytes(m_);
  be_.free_bytes(v_);
  if (work_) be_.free_bytes(work_);
  if (block_sums_) be_.free_bytes(block_sums_);
}

Tensor DeviceOptimizer::at(const Tensor& flat, std::size_t offset, std::size_t n) const {
  return Tensor(static_cast<char*>(flat.data) + offset * sizeof(float), DType::f32, {static_cast<int64_t>(n)});
}

double DeviceOptimizer::clip_gradients(const Tensor& grads) {
  pending_scale_ = 1.0f;
  double ss = 0;
  if (blocked_norm_) {
    std::vector<double> sums(norm_blocks_);
    if (norm_blocks_) {
      const Tensor dev(block_sums_, DType::f64, {static_cast<int64_t>(norm_blocks_)});
      be_.block_sum_squares(grads, norm_ranges_, static_cast<int64_t>(kNormBlock), dev);
      be_.download(dev, sums.data());
    }
    for (double b : sums) ss += b;  // table order, as Optimizer::clip_gradients
  } else if (covers_all_) {
    ss = be_.sum_squares(grads);
  } else {
    for (const ParamView& p : host_.params_) ss += be_.sum_squares(at(grads, p.offset, p.size()));
  }
  const double norm = std::sqrt(ss);
  clip_by_norm(grads, norm);
  return norm;
}

void DeviceOptimizer::clip_by_norm(const Tensor& grads, double norm) {
  pending_scale_ = 1.0f;
  const double clip = host_.cfg_.grad_clip;
  if (!std::isfinite(norm) || clip <= 0) return;
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
  std::vector<double> lrs(host_.params_.size(), 0.0);
  auto same = [](const kernels::Backend::AdamWStep& x, const kernels::Backend::AdamWStep& y) {
    return x.beta1 == y.beta1 && x.beta2 == y.beta2 && x.eps == y.eps && x.step_size == y.step_size &&
           x.inv_sqrt_bc2 == y.inv_sqrt_bc2 && x.decay == y.decay && x.grad_scale == y.grad_scale;
  };
  for (std::size_t i = 0; i < host_.params_.size(); ++i) {
    const ParamView& p = host_.params_[i];
    const Optimizer::Slot& s = host_.slots_[i];
    const double lr = s.lr_mult * (s.own_lr ? scalar_factor : lr_factor);
    if (s.muon) {
      lrs[i] = lr;
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
  for (const MuonBatch& b : batches_) muon_batch(b, params, grads, lrs);
  if (!segs.empty()) be_.adamw_step_multi(params, grads, m, v, segs);
  pending_scale_ = 1.0f;  // applied once
}

// Per matrix: momentum, then newton_schulz.hpp's algorithm — X₀ = G/(‖G‖_F + ε) in wide form,
// X ← a·X + (b·A + c·A·A)·X with A = X·Xᵀ (symmetric, so A·Aᵀ = A·A) — batched over the
// group, then NorMuon's normalisation and the decayed update.
void DeviceOptimizer::muon_batch(const MuonBatch& b, const Tensor& params, const Tensor& grads,
                                 const std::vector<double>& lrs) {
  const OptimizerConfig& c = host_.cfg_;
  const int64_t nb = static_cast<int64_t>(b.slots.size());
  const bool tall = b.rows > b.cols;
  const int64_t r = tall ? b.cols : b.rows, w = tall ? b.rows : b.cols, n = r * w;
  float* U = static_cast<float*>(work_);
  float* X = U + nb * n;
  float* Y = X + nb * n;
  float* A = Y + nb * n;
  float* B = A + nb * r * r;
  for (int64_t k = 0; k < nb; ++k) {
    const ParamView& p = host_.params_[b.slots[k]];
    const Optimizer::Slot& s = host_.slots_[b.slots[k]];
    const Tensor u(U + k * n, DType::f32, {p.rows, p.cols});
    const Tensor buf(static_cast<float*>(m_) + s.m_off, DType::f32, {p.rows, p.cols});
    be_.momentum_step(at(grads, p.offset, p.size()), buf, u, static_cast<float>(c.momentum), c.nesterov);
    be_.frobenius_normalize(u, Tensor(X + k * n, DType::f32, {r, w}), tall, kNewtonSchulzEps);
  }
  const Tensor As(A, DType::f32, {nb, r, r}), Bs(B, DType::f32, {nb, r, r});
  const auto [ca, cb, cc] = c.ns_coefficients;
  for (int s = 0; s < c.ns_steps; ++s) {
    const Tensor x(X, DType::f32, {nb, r, w}), y(Y, DType::f32, {nb, r, w});
    be_.gemm_batched(x, false, x, true, As, nb);  // A = X·Xᵀ
    be_.copy(As, Bs);
    be_.gemm_batched(As, false, As, false, Bs, nb, cc, cb);  // B = b·A + c·A·A
    be_.copy(x, y);
    be_.gemm_batched(Bs, false, x, false, y, nb, 1.0, ca);  // Y = a·X + B·X
    std::swap(X, Y);
  }
  for (int64_t k = 0; k < nb; ++k) {
    const ParamView& p = host_.params_[b.slots[k]];
    const Optimizer::Slot& s = host_.slots_[b.slots[k]];
    const Tensor x(X + k * n, DType::f32, {r, w});
    Tensor o(X + k * n, DType::f32, {p.rows, p.cols});
    if (tall) {
      o = Tensor(U + k * n, DType::f32, {p.rows, p.cols});  // U is free once X₀ is formed
      be_.transpose(x, o, 1.0);
    }
    if (c.name == OptimizerName::normuon)
      be_.normuon_normalize(o, at(Tensor(v_, DType::f32, {1}), s.v_off, s.v_len), c.normuon_beta2, c.eps);
    const double lr = lrs[b.slots[k]];
    const double decay = static_cast<float>(1.0 - lr * s.wd);
    const double step_size = static_cast<float>(lr * host_.muon_scale(p.rows, p.cols));
    be_.decayed_update(at(params, p.offset, p.size()), o, decay, step_size);
  }
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
