#include "trainer/optim/zero.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/error.hpp"

namespace lar::optim {

namespace {

bool is_muon(const OptimizerConfig& c, const ParamView& p) {
  return c.name != OptimizerName::adamw && p.kind == ParamKind::matrix_hidden;
}

// Second-moment floats of a tensor in Optimizer's layout.
std::size_t v_len(const OptimizerConfig& c, const ParamView& p) {
  if (!is_muon(c, p)) return p.size();
  return c.name == OptimizerName::normuon ? static_cast<std::size_t>(std::max(p.rows, p.cols)) : 0;
}

}  // namespace

std::vector<std::size_t> ZeroPlan::of_rank(int rank) const {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < pieces.size(); ++i)
    if (pieces[i].owner == rank) out.push_back(i);
  return out;
}

std::vector<Segment> ZeroPlan::segments(const std::vector<ParamView>& params) const {
  std::vector<Segment> out;
  for (const ZeroPiece& p : pieces) {
    const std::size_t off = params[p.param].offset + p.lo, n = p.hi - p.lo;
    if (!out.empty() && out.back().owner == p.owner && out.back().offset + out.back().count == off)
      out.back().count += n;
    else
      out.push_back(Segment{off, n, p.owner});
  }
  return out;
}

ZeroPlan plan_zero(const OptimizerConfig& config, const std::vector<ParamView>& params, int world) {
  if (world < 1) throw RuntimeError(fmt::format("zero: world size {} (must be ≥ 1)", world));
  ZeroPlan plan;
  plan.world = world;

  // Muon matrices whole: largest first, each to the least loaded rank.
  std::vector<std::size_t> muon;
  for (std::size_t i = 0; i < params.size(); ++i)
    if (is_muon(config, params[i])) muon.push_back(i);
  std::stable_sort(muon.begin(), muon.end(),
                   [&](std::size_t a, std::size_t b) { return params[a].size() > params[b].size(); });
  std::vector<std::size_t> load(static_cast<std::size_t>(world), 0);
  for (std::size_t i : muon) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[static_cast<std::size_t>(r)] += params[i].size();
    plan.pieces.push_back(ZeroPiece{i, 0, params[i].size(), r, true});
  }

  // AdamW tensors concatenated in table order, cut into `world` ranges at block boundaries.
  std::vector<std::size_t> adamw, start;
  std::size_t total = 0;
  for (std::size_t i = 0; i < params.size(); ++i)
    if (!is_muon(config, params[i])) {
      adamw.push_back(i);
      start.push_back(total);
      total += params[i].size();
    }
  std::vector<std::size_t> cut(static_cast<std::size_t>(world) + 1, total);
  cut[0] = 0;
  for (int r = 1; r < world; ++r) {
    const std::size_t t = total * static_cast<std::size_t>(r) / static_cast<std::size_t>(world);
    // The tensor holding position t; the cut moves down to its block boundary.
    const auto it = std::upper_bound(start.begin(), start.end(), t);
    std::size_t c = t;
    if (it != start.begin() && t < total) {
      const std::size_t s = *(it - 1);
      c = s + (t - s) / kNormBlock * kNormBlock;
    }
    cut[static_cast<std::size_t>(r)] = std::max(c, cut[static_cast<std::size_t>(r) - 1]);
  }
  for (std::size_t k = 0; k < adamw.size(); ++k) {
    const std::size_t lo = start[k], hi = start[k] + params[adamw[k]].size();
    for (int r = 0; r < world; ++r) {
      const std::size_t a = std::max(lo, cut[static_cast<std::size_t>(r)]);
      const std::size_t b = std::min(hi, cut[static_cast<std::size_t>(r) + 1]);
      if (a < b) plan.pieces.push_back(ZeroPiece{adamw[k], a - lo, b - lo, r, false});
    }
  }
  std::sort(plan.pieces.begin(), plan.pieces.end(), [](const ZeroPiece& a, const ZeroPiece& b) {
    return a.param != b.param ? a.param < b.param : a.lo < b.lo;
  });
  return plan;
}

StateBytes optimizer_state_bytes(const OptimizerConfig& config, const std::vector<ParamView>& params, int world) {
  StateBytes out;
  out.per_rank.assign(static_cast<std::size_t>(std::max(world, 1)), 0);
  for (const ParamView& p : params) out.full += sizeof(float) * (p.size() + v_len(config, p));
  for (const ZeroPiece& k : plan_zero(config, params, world).pieces) {
    const ParamView& p = params[k.param];
    const std::size_t floats = k.muon ? p.size() + v_len(config, p) : 2 * (k.hi - k.lo);
    out.per_rank[static_cast<std::size_t>(k.owner)] += sizeof(float) * floats;
  }
  return out;
}

ZeroLayout zero_layout(const OptimizerConfig& config, const std::vector<ParamView>& params, int world, int rank) {
  ZeroLayout lay;
  lay.plan = plan_zero(config, params, world);
  lay.segments = lay.plan.segments(params);

  // The unsharded layout's offsets (Optimizer's constructor lays out m_ and v_ this way).
  std::vector<std::size_t> m_off(params.size()), v_off(params.size());
  lay.block_base.resize(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    m_off[i] = lay.m_len, v_off[i] = lay.v_len;
    lay.m_len += params[i].size();
    lay.v_len += v_len(config, params[i]);
    lay.block_base[i] = lay.n_blocks;
    lay.n_blocks += norm_blocks(params[i].size());
  }

  for (std::size_t i = 0; i < lay.plan.pieces.size(); ++i) {
    const ZeroPiece& k = lay.plan.pieces[i];
    const ParamView& p = params[k.param];
    const std::size_t vl = v_len(config, p);
    lay.m_segs.push_back(Segment{m_off[k.param] + k.lo, k.hi - k.lo, k.owner});
    if (vl) lay.v_segs.push_back(Segment{v_off[k.param] + (k.muon ? 0 : k.lo), k.muon ? vl : k.hi - k.lo, k.owner});
    if (k.owner != rank) continue;
    ParamView view = p;
    if (!k.muon) {
      view.name = fmt::format("{}[{}:{}]", p.name, k.lo, k.hi);
      view.offset = p.offset + k.lo;
      view.rows = 1;
      view.cols = static_cast<int>(k.hi - k.lo);
    }
    lay.shard_views.push_back(view);
    lay.shard_pieces.push_back(i);
    lay.shard_full_m.push_back(m_off[k.param] + k.lo);
    lay.shard_full_v.push_back(v_off[k.param] + (k.muon ? 0 : k.lo));
  }
  return lay;
}

std::vector<ZeroLayout::StateMap> ZeroLayout::state_map(const Optimizer& shard) const {
  std::vector<StateMap> out;
  for (std::size_t i = 0; i < shard_pieces.size(); ++i) {
    const ZeroPiece& k = plan.pieces[shard_pieces[i]];
    const Optimizer::Slot& s = shard.slots_[i];
    out.push_back(StateMap{false, s.m_off, shard_full_m[i], k.hi - k.lo});
    if (s.v_len) out.push_back(StateMap{true, s.v_off, shard_full_v[i], s.v_len});
  }
  return out;
}

ZeroOptimizer::ZeroOptimizer(OptimizerConfig config, std::vector<ParamView> params, std::size_t total_size,
                             Communicator& comm)
    : cfg_(config), params_(std::move(params)), total_size_(total_size), comm_(comm) {
  lay_ = zero_layout(cfg_, params_, comm_.world(), comm_.rank());
  shard_ = std::make_unique<Optimizer>(cfg_, lay_.shard_views, total_size_);
  map_ = lay_.state_map(*shard_);
}

void ZeroOptimizer::reduce_gradients(float* grads) { comm_.reduce_scatter(grads, lay_.segments); }

double ZeroOptimizer::clip_gradients(float* grads) {
  // This rank's block sums, zero elsewhere; the all-reduce adds zeros to each (exact), and
  // every rank adds the blocks in table order as Optimizer::clip_gradients does.
  std::vector<double> bs(lay_.n_blocks, 0.0);
  for (std::size_t i : lay_.plan.of_rank(comm_.rank())) {
    const ZeroPiece& k = lay_.plan.pieces[i];
    const ParamView& p = params_[k.param];
    for (std::size_t lo = k.lo; lo < k.hi; lo += kNormBlock)
      bs[lay_.block_base[k.param] + lo / kNormBlock] =
          block_sum_squares(grads + p.offset + lo, std::min(kNormBlock, p.size() - lo));
  }
  comm_.all_reduce(bs.data(), bs.size());
  double ss = 0;
  for (double b : bs) ss += b;
  const double norm = std::sqrt(ss);
  if (!std::isfinite(norm) || cfg_.grad_clip <= 0) return norm;
  const double coef = cfg_.grad_clip / (norm + 1e-6);
  if (coef < 1.0) {
    const float cf = static_cast<float>(coef);
    for (const Segment& s : lay_.segments) {
      if (s.owner != comm_.rank()) continue;
      float* g = grads + s.offset;
      for (std::size_t i = 0; i < s.count; ++i) g[i] *= cf;
    }
  }
  return norm;
}

void ZeroOptimizer::step(float* params, const float* grads, const Schedule& schedule, std::int64_t step_index) {
  step(params, grads, schedule.factor(step_index), schedule.warmup_factor(step_index));
}

void ZeroOptimizer::step(float* params, const float* grads, double lr_factor, double scalar_factor) {
  shard_->step(params, grads, lr_factor, scalar_factor);
  comm_.all_gather(params, lay_.segments);
}

std::unique_ptr<Optimizer> ZeroOptimizer::full_layout() const {
  return std::make_unique<Optimizer>(cfg_, params_, total_size_);
}

std::string ZeroOptimizer::save_state() {
  std::unique_ptr<Optimizer> full = full_layout();
  for (const ZeroLayout::StateMap& s : map_) {
    const std::vector<float>& from = s.v ? shard_->v_ : shard_->m_;
    std::vector<float>& to = s.v ? full->v_ : full->m_;
    std::memcpy(to.data() + s.full_off, from.data() + s.shard_off, sizeof(float) * s.count);
  }
  comm_.all_gather(full->m_.data(), lay_.m_segs);
  comm_.all_gather(full->v_.data(), lay_.v_segs);
  full->t_ = shard_->t_;
  return full->save_state();
}

void ZeroOptimizer::load_state(const std::string& blob) {
  std::unique_ptr<Optimizer> full = full_layout();
  full->load_state(blob);  // checks the format against the unsharded table
  for (const ZeroLayout::StateMap& s : map_) {
    const std::vector<float>& from = s.v ? full->v_ : full->m_;
    std::vector<float>& to = s.v ? shard_->v_ : shard_->m_;
    std::memcpy(to.data() + s.shard_off, from.data() + s.full_off, sizeof(float) * s.count);
  }
  shard_->t_ = full->t_;
}

}  // namespace lar::optim
