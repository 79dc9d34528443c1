#include "trainer/optim/device_zero.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>

#include "core/error.hpp"

namespace lar::optim {

using kernels::DType;
using kernels::Tensor;

namespace {
std::atomic<std::size_t> g_save_window{std::size_t(1) << 24};  // 64 MiB of floats

Tensor floats(void* p, std::size_t n) { return Tensor(p, DType::f32, {static_cast<int64_t>(n)}); }
}  // namespace

std::size_t DeviceZeroOptimizer::save_window() { return g_save_window.load(); }
void DeviceZeroOptimizer::set_save_window_for_tests(std::size_t n) { g_save_window.store(std::max<std::size_t>(n, 1)); }

DeviceZeroOptimizer::DeviceZeroOptimizer(kernels::Backend& be, OptimizerConfig config, std::vector<ParamView> params,
                                         std::size_t total_size, Communicator& comm)
    : be_(be), cfg_(config), params_(std::move(params)), total_size_(total_size), comm_(comm) {
  lay_ = zero_layout(cfg_, params_, comm_.world(), comm_.rank());
  shard_ = std::make_unique<DeviceOptimizer>(be_, cfg_, lay_.shard_views, total_size_);
  map_ = lay_.state_map(shard_->host_);
  for (std::size_t i : lay_.shard_pieces) {
    const ZeroPiece& k = lay_.plan.pieces[i];
    // Pieces start on block boundaries (plan_zero), so their blocks are the unsharded ones.
    norm_ranges_.push_back({static_cast<int64_t>(params_[k.param].offset + k.lo), static_cast<int64_t>(k.hi - k.lo),
                            static_cast<int64_t>(lay_.block_base[k.param] + k.lo / kNormBlock)});
  }
  block_sums_ = be_.alloc_bytes(std::max<std::size_t>(lay_.n_blocks, 1) * sizeof(double));
}

DeviceZeroOptimizer::~DeviceZeroOptimizer() { be_.free_bytes(block_sums_); }

void DeviceZeroOptimizer::reduce_gradients(const Tensor& grads) {
  comm_.reduce_scatter(grads.ptr<float>(), lay_.segments);
}

double DeviceZeroOptimizer::clip_gradients(const Tensor& grads) {
  std::vector<double> sums(lay_.n_blocks);
  if (!sums.empty()) {
    const Tensor dev(block_sums_, DType::f64, {static_cast<int64_t>(sums.size())});
    be_.zero(dev);
    be_.block_sum_squares(grads, norm_ranges_, static_cast<int64_t>(kNormBlock), dev);
    comm_.all_reduce(static_cast<double*>(block_sums_), sums.size());
    be_.download(dev, sums.data());
  }
  double ss = 0;
  for (double b : sums) ss += b;  // table order, as the unsharded blocked norm
  const double norm = std::sqrt(ss);
  shard_->clip_by_norm(grads, norm);
  return norm;
}

void DeviceZeroOptimizer::step(const Tensor& params, const Tensor& grads, const Schedule& schedule,
                               std::int64_t step_index) {
  step(params, grads, schedule.factor(step_index), schedule.warmup_factor(step_index));
}

void DeviceZeroOptimizer::step(const Tensor& params, const Tensor& grads, double lr_factor, double scalar_factor) {
  shard_->step(params, grads, lr_factor, scalar_factor);
  comm_.all_gather(params.ptr<float>(), lay_.segments);
  // The all-gather wrote the weights behind the backend's back: an op on them (x·1 is
  // exact) marks a bf16 weight mirror stale even where this rank's shard wrote nothing.
  if (total_size_) be_.scale(floats(params.data, 1), 1.0);
}

void DeviceZeroOptimizer::gather_state(bool v, std::vector<float>& full) {
  if (full.empty()) return;
  const std::vector<Segment>& segs = v ? lay_.v_segs : lay_.m_segs;
  float* mine = static_cast<float*>(v ? shard_->v_ : shard_->m_);
  const std::size_t window = std::min(save_window(), full.size());
  void* win = be_.alloc_bytes(window * sizeof(float));
  try {
    // Every rank walks the same windows and calls the same collectives.
    for (std::size_t w0 = 0; w0 < full.size(); w0 += window) {
      const std::size_t w1 = std::min(full.size(), w0 + window);
      float* base = static_cast<float*>(win);
      be_.zero(floats(win, w1 - w0));
      for (const ZeroLayout::StateMap& s : map_) {
        if (s.v != v) continue;
        const std::size_t a = std::max(w0, s.full_off), b = std::min(w1, s.full_off + s.count);
        if (a < b) be_.copy(floats(mine + s.shard_off + (a - s.full_off), b - a), floats(base + (a - w0), b - a));
      }
      std::vector<Segment> in_window;
      for (const Segment& s : segs) {
        const std::size_t a = std::max(w0, s.offset), b = std::min(w1, s.offset + s.count);
        if (a < b) in_window.push_back(Segment{a - w0, b - a, s.owner});
      }
      comm_.all_gather(base, in_window);
      be_.download(floats(win, w1 - w0), full.data() + w0);
    }
  } catch (...) {
    be_.free_bytes(win);
    throw;
  }
  be_.free_bytes(win);
}

std::string DeviceZeroOptimizer::save_state() {
  Optimizer full(cfg_, params_, total_size_);
  gather_state(false, full.m_);
  gather_state(true, full.v_);
  full.t_ = shard_->host_.t_;
  return full.save_state();
}

void DeviceZeroOptimizer::load_state(const std::string& blob) {
  Optimizer full(cfg_, params_, total_size_);
  full.load_state(blob);  // checks the format against the unsharded table
  for (const ZeroLayout::StateMap& s : map_) {
    if (!s.count) continue;
    const float* from = (s.v ? full.v_ : full.m_).data() + s.full_off;
    float* to = static_cast<float*>(s.v ? shard_->v_ : shard_->m_) + s.shard_off;
    be_.upload(from, floats(to, s.count));
  }
  shard_->host_.t_ = full.t_;
}

}  // namespace lar::optim
