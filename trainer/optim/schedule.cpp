#include "trainer/optim/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include <fmt/format.h>

#include "core/config_schema.hpp"
#include "core/error.hpp"

namespace lar::optim {

ScheduleConfig ScheduleConfig::from_json(const json& run_config) {
  const json full = with_defaults(run_config);
  const json& s = full.at("schedule");
  ScheduleConfig c;
  const std::string name = s.at("name").get<std::string>();
  if (name == "wsd") c.name = ScheduleName::wsd;
  else if (name == "cosine") c.name = ScheduleName::cosine;
  else if (name == "constant") c.name = ScheduleName::constant;
  else throw UserError(fmt::format("schedule.name: unknown schedule '{}' (wsd, cosine, constant)", name));
  c.warmup_steps = s.at("warmup_steps").get<std::int64_t>();
  c.decay_fraction = s.at("decay_fraction").get<double>();
  c.min_lr = s.at("min_lr").get<double>();
  if (c.warmup_steps < 0)
    throw UserError(fmt::format("schedule.warmup_steps: must be ≥ 0, got {}", c.warmup_steps));
  if (!(c.decay_fraction >= 0 && std::isfinite(c.decay_fraction)))
    throw UserError(fmt::format("schedule.decay_fraction: must be ≥ 0, got {}", c.decay_fraction));
  if (!(c.min_lr >= 0)) throw UserError(fmt::format("schedule.min_lr: must be ≥ 0, got {}", c.min_lr));
  return c;
}

Schedule::Schedule(ScheduleConfig config, double peak_lr, std::int64_t total_steps)
    : cfg_(config), peak_(peak_lr), total_(total_steps) {
  if (total_ < 1) throw UserError(fmt::format("budget.steps: must be ≥ 1, got {}", total_));
  if (!(peak_ > 0 && std::isfinite(peak_)))
    throw UserError(fmt::format("optimizer.lr: must be > 0, got {}", peak_));
  if (cfg_.min_lr > peak_)
    throw UserError(fmt::format("schedule.min_lr: {} is above the peak lr optimizer.lr = {}", cfg_.min_lr, peak_));
  warmup_ = std::min(cfg_.warmup_steps, total_);
  if (cfg_.name == ScheduleName::wsd) {
    const auto d = static_cast<std::int64_t>(std::llround(cfg_.decay_fraction * static_cast<double>(total_)));
    // Above 1 the decay is longer than the run: it began before step 1, as Megatron's WSD
    // does when --lr-wsd-decay-samples exceeds the run (the LAA 1B runs); the warmup still
    // comes first.
    decay_ = cfg_.decay_fraction > 1 ? d : std::clamp<std::int64_t>(d, 0, total_ - warmup_);
  }
}

Schedule Schedule::from_json(const json& run_config, std::int64_t total_steps) {
  const json full = with_defaults(run_config);
  return Schedule(ScheduleConfig::from_json(full), full.at("optimizer").at("lr").get<double>(), total_steps);
}

double Schedule::lr(std::int64_t step) const {
  // s = 1-based count of the update being taken, clamped to [1, S].
  const std::int64_t s = std::clamp<std::int64_t>(step + 1, 1, total_);
  if (s <= warmup_) return peak_ * static_cast<double>(s) / static_cast<double>(warmup_);
  const double lo = cfg_.min_lr;
  switch (cfg_.name) {
    case ScheduleName::constant:
      return peak_;
    case ScheduleName::wsd: {
      const std::int64_t sd = total_ - decay_;
      if (s <= sd) return peak_;
      const double frac = static_cast<double>(s - sd) / static_cast<double>(decay_);
      return lo + (peak_ - lo) * (1.0 - std::sqrt(frac));
    }
    case ScheduleName::cosine: {
      const double frac = static_cast<double>(s - warmup_) / static_cast<double>(total_ - warmup_);
      return lo + (peak_ - lo) * 0.5 * (1.0 + std::cos(std::numbers::pi * frac));
    }
  }
  return peak_;
}

double Schedule::factor(std::int64_t step) const { return lr(step) / peak_; }

double Schedule::warmup_factor(std::int64_t step) const {
  const std::int64_t s = std::clamp<std::int64_t>(step + 1, 1, total_);
  return s <= warmup_ ? static_cast<double>(s) / static_cast<double>(warmup_) : 1.0;
}

std::optional<std::int64_t> Schedule::stable_end_step() const {
  switch (cfg_.name) {
    case ScheduleName::wsd: return total_ - decay_;
    case ScheduleName::constant: return total_;
    case ScheduleName::cosine: return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace lar::optim
