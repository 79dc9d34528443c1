#pragma once
// Learning-rate schedules of docs/spec.md §5: linear warmup, then `wsd` (warmup–stable–decay with
// minus_sqrt decay), `cosine`, or `constant`.
//
// Steps are 0-based update indices k = 0 … S−1 (S = budget.steps); the formulas use the
// 1-based count s = k + 1 of the update being taken, so the first update of a warmup gets
// peak/W and the last update of a decay gets exactly min_lr:
//   warmup  (s ≤ W):          lr = peak · s / W
//   wsd     stable (s ≤ s_d): lr = peak,                     s_d = S − D, D = round(decay_fraction·S)
//           decay  (s > s_d): lr = min_lr + (peak − min_lr)·(1 − sqrt((s − s_d)/(S − s_d)))
//   cosine  (s > W):          lr = min_lr + (peak − min_lr)·½(1 + cos(π (s − W)/(S − W)))
//   constant(s > W):          lr = peak
// D is clamped to [0, S − W] (the decay never eats into the warmup) — except for
// decay_fraction > 1: then D > S, s_d < 0, and the run starts inside a decay that began
// before it (Megatron's WSD with a decay longer than the run), after its warmup.
// docs/optimizers.md.
#include <cstdint>
#include <optional>
#include <string>

#include "core/json.hpp"

namespace lar::optim {

enum class ScheduleName { wsd, cosine, constant };

struct ScheduleConfig {
  ScheduleName name = ScheduleName::wsd;
  std::int64_t warmup_steps = 0;
  double decay_fraction = 0.2;
  double min_lr = 0.0;
  // Reads config["schedule"] (missing keys take the schema defaults); throws UserError
  // naming the key for negative warmup, negative decay_fraction, negative min_lr.
  static ScheduleConfig from_json(const json& run_config);
};

class Schedule {
 public:
  // peak_lr = optimizer.lr; total_steps = S ≥ 1. Throws UserError when min_lr > peak_lr.
  Schedule(ScheduleConfig config, double peak_lr, std::int64_t total_steps);
  // schedule.* and optimizer.lr of a run config; total_steps as resolved by the trainer
  // (budget.steps, or budget.tokens / (batch_size·seq_len)).
  static Schedule from_json(const json& run_config, std::int64_t total_steps);

  double lr(std::int64_t step) const;      // lr of the update with 0-based index `step`
  double factor(std::int64_t step) const;  // lr(step) / peak
  // The warmup ramp alone: s/W during warmup, 1 after it (the scalar_lr group under Muon).
  double warmup_factor(std::int64_t step) const;

  // Number of completed updates at the end of the stable phase: record the saturation
  // loss when steps_done == *stable_end_step() (after the update with index value−1).
  // wsd: S − D; constant: S; cosine: none (it has no stable phase).
  std::optional<std::int64_t> stable_end_step() const;
  std::int64_t warmup_steps() const { return warmup_; }
  std::int64_t decay_steps() const { return decay_; }  // D (wsd), 0 otherwise
  std::int64_t total_steps() const { return total_; }
  double peak_lr() const { return peak_; }
  const ScheduleConfig& config() const { return cfg_; }

 private:
  ScheduleConfig cfg_;
  double peak_ = 0;
  std::int64_t total_ = 0, warmup_ = 0, decay_ = 0;
};

}  // namespace lar::optim
