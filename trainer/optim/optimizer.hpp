#pragma once
// Optimisers of docs/spec.md §5 over flat fp32 buffers: `adamw`, `muon`, `normuon`.
//
// The trainer keeps every parameter in one flat float buffer and every gradient in a
// second buffer of the same layout. A table of ParamView says where each tensor lives and
// what kind it is; the kind decides the parameter group:
//
//   optimizer.name  | matrix_hidden               | embedding, head        | norm, bias, scalar
//   ----------------+-----------------------------+------------------------+--------------------
//   adamw           | AdamW, lr, weight_decay     | AdamW, lr, weight_decay| AdamW, lr, no decay
//   muon / normuon  | Muon / NorMuon, lr,         | AdamW, scalar_lr,      | AdamW, scalar_lr,
//                   | weight_decay                | scalar_weight_decay    | no decay
//
// Learning rates over time (as the LAA code does it, Megatron param-group overrides):
//   every group except the one below: its peak lr × Schedule::factor(step) (warmup, then
//     stable/decay to min_lr as a fraction of the peak);
//   the AdamW group under muon/normuon with scalar_lr > 0: scalar_lr ×
//     Schedule::warmup_factor(step), i.e. warmup, then constant at scalar_lr (Megatron sets
//     that group's min_lr = max_lr = scalar_lr, so it never decays);
//   scalar_lr = 0 means "use lr" and that group then follows lr's full schedule.
// Weight decay is decoupled and scaled by the group's current lr: p ← p·(1 − lr·wd) before
// the update. Full formulas: docs/optimizers.md.
//
// Usage per training step (the trainer):
//   double norm = opt.clip_gradients(grads);          // pre-clip global norm
//   if (!std::isfinite(norm)) → mark the run diverged (grads were left untouched)
//   opt.step(params, grads, schedule, step);          // step = 0-based update index
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "trainer/optim/schedule.hpp"

namespace lar::optim {

// What a parameter tensor is; decides its optimiser group and weight decay.
enum class ParamKind {
  matrix_hidden,  // 2-D weight of a hidden layer (attention/MLP projections, routing, ...)
  embedding,      // token embedding table (vocab × d)
  head,           // LM head (vocab × d or d × vocab)
  norm,           // RMSNorm gains
  bias,           // additive biases
  scalar,         // gates' scalars and other small learned vectors/scalars
};
const char* to_string(ParamKind k);
ParamKind param_kind_from_string(const std::string& s);  // throws UserError if unknown

// One tensor inside the flat buffers. Row-major rows × cols; vectors use rows = 1.
struct ParamView {
  std::string name;
  std::size_t offset = 0;  // in floats from the start of the flat buffer
  int rows = 1;
  int cols = 1;
  ParamKind kind = ParamKind::matrix_hidden;
  std::size_t size() const { return static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols); }
};

enum class OptimizerName { adamw, muon, normuon };
enum class ScaleMode { default_, spectral };

// optimizer.* of the run config (core/config_schema.cpp documents every key).
struct OptimizerConfig {
  OptimizerName name = OptimizerName::adamw;
  double lr = 1e-3;
  double scalar_lr = 0.0;  // 0 = lr
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double scalar_weight_decay = 0.0;
  double grad_clip = 1.0;  // 0 = off
  double momentum = 0.95;
  bool nesterov = true;
  int ns_steps = 5;
  std::array<double, 3> ns_coefficients{3.4445, -4.7750, 2.0315};
  ScaleMode scale_mode = ScaleMode::default_;
  double normuon_beta2 = 0.95;
  int zero_stage = 0;  // 0 = replicated state; 1 = ZeRO-1 (trainer/optim/zero.hpp)

  // Reads config["optimizer"] (missing keys take the schema defaults). Throws UserError
  // naming the key and value for out-of-range values (e.g. beta2 ≥ 1, ns_steps < 1).
  static OptimizerConfig from_json(const json& run_config);
};

// Global L2 norm of n floats, accumulated in double (NaN/Inf propagate).
double global_norm(const float* x, std::size_t n);

// The gradient norm of clip_gradients is a blocked sum: every tensor is cut into blocks of
// kNormBlock elements (the last one shorter), each block's squares are summed in double in
// element order, and the block sums are added in table order. ZeRO-1 (zero.hpp) cuts its
// shards on block boundaries, so each rank sums whole blocks and the ranks' block sums,
// added in the same order, give the unsharded norm bit for bit.
constexpr std::size_t kNormBlock = std::size_t(1) << 14;
double block_sum_squares(const float* x, std::size_t n);
// Blocks of a tensor of n elements.
inline std::size_t norm_blocks(std::size_t n) { return (n + kNormBlock - 1) / kNormBlock; }

class Optimizer {
 public:
  // `params` must lie inside [0, total_size), must not overlap and have rows, cols ≥ 1;
  // throws RuntimeError otherwise (a bug in the caller's parameter table).
  Optimizer(OptimizerConfig config, std::vector<ParamView> params, std::size_t total_size);

  // Clips grads in place to global norm ≤ grad_clip (coefficient clip/(norm + 1e-6), only
  // applied when < 1; grad_clip = 0 disables clipping) and returns the norm BEFORE
  // clipping. A NaN/Inf norm is returned as is and the gradients are left untouched:
  // the caller marks the run diverged and does not call step().
  double clip_gradients(float* grads) const;

  // One update of all parameters at the 0-based update index `step` of `schedule`.
  void step(float* params, const float* grads, const Schedule& schedule, std::int64_t step);
  // The same with explicit multipliers: lr_factor for every group except the AdamW group
  // under muon/normuon with scalar_lr > 0, which uses scalar_factor (tests, tools).
  void step(float* params, const float* grads, double lr_factor, double scalar_factor);

  // Optimiser state (moments, momentum buffers, step count) as a self-describing byte
  // string; load_state restores it bit for bit. load_state throws RuntimeError when the
  // blob is corrupt or was written for another optimiser or parameter table.
  std::string save_state() const;
  void load_state(const std::string& blob);

  std::int64_t steps_taken() const { return t_; }
  // Floats of optimiser state held (moments, momentum and second-moment buffers).
  std::size_t state_floats() const { return m_.size() + v_.size(); }
  const OptimizerConfig& config() const { return cfg_; }
  const std::vector<ParamView>& params() const { return params_; }
  // True when this tensor is updated by Muon/NorMuon (not AdamW).
  bool uses_muon(const ParamView& p) const;
  // Muon's shape scale for a rows × cols matrix under the configured scale_mode.
  double muon_scale(int rows, int cols) const;

 private:
  friend class DeviceOptimizer;  // shares the slot layout and the state format
  friend class ZeroOptimizer;    // maps its shard's state into the unsharded layout
  friend struct ZeroLayout;      // reads the shard's slot layout
  friend class DeviceZeroOptimizer;  // stages the unsharded state of save/load
  struct Slot {           // per-tensor state layout
    bool muon = false;    // Muon/NorMuon (true) or AdamW (false)
    bool own_lr = false;  // AdamW group under muon/normuon with its own scalar_lr
    double lr_mult = 1;   // this group's peak lr (lr or scalar_lr)
    double wd = 0;        // this group's weight decay
    std::size_t m_off = 0, v_off = 0, v_len = 0;  // into m_ / v_ (v_ unused by Muon)
  };
  void adamw_update(const ParamView& p, const Slot& s, float* params, const float* grads, double lr);
  void muon_update(const ParamView& p, const Slot& s, float* params, const float* grads, double lr);

  OptimizerConfig cfg_;
  std::vector<ParamView> params_;
  std::size_t total_size_ = 0;
  std::vector<Slot> slots_;
  std::vector<float> m_;  // AdamW first moment / Muon momentum buffer
  std::vector<float> v_;  // AdamW second moment / NorMuon row-or-column second moment
  std::int64_t t_ = 0;    // steps taken (AdamW bias correction)
  std::vector<float> scratch_;  // Muon workspace: momentum-mixed update and NS output
  std::vector<float> ns_work_;  // Newton–Schulz workspace
};

}  // namespace lar::optim
