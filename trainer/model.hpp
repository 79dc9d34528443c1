#pragma once
// The language model (docs/spec.md §3): untied embedding; per block
//     h ← h + Mixer_l(RMSNorm(h));  [cler_h/clvr: h ← h + P_l·side_l];  h ← h + SwiGLU(RMSNorm(h))
// (P_l full rank and zero at init, or U_l·D_l with D_l zero when model.routing_rank > 0;
// model.routing_inject: layer adds P_l·side_l after the SwiGLU branch instead)
// final RMSNorm, LM head, cross-entropy with a loss mask. Explicit forward and backward
// per module (no autograd); every tensor op goes through kernels::Backend; parameters
// and gradients live in one ParamStore (flat buffers).
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "kernels/backend.hpp"
#include "trainer/data/dataset.hpp"
#include "trainer/mixer.hpp"
#include "trainer/params.hpp"

namespace lar::trainer {

struct ModelShape {
  int n_layers = 0, d_model = 0, d_ff = 0, vocab = 0;
  std::vector<std::string> kinds;  // mixer kind per layer
  std::string routing = "none";
};
// Resolved shape of config["model"] (d_ff = 0 → 8/3·d_model rounded up to 32).
ModelShape model_shape(const json& model);

// Checks the shapes of a run config (schema defaults applied) beyond the schema's types:
// divisibility, positivity, registered mixers, ... Throws lar::UserError naming the key.
void validate_model_config(const json& config);

struct StepResult {
  double loss = 0;        // Σ mask·CE / Σ mask
  double mask_sum = 0;    // Σ mask (tokens that count)
};

class Model {
 public:
  // `config` is the full run config with schema defaults applied.
  Model(const json& config, kernels::Backend& be);
  ~Model();

  ParamStore& params() { return *params_; }
  const ParamStore& params() const { return *params_; }
  void init(uint64_t seed) { params_->init(seed); }
  const ModelShape& shape() const { return shape_; }
  kernels::Backend& backend() { return be_; }

  // Forward and backward on one batch. Gradients ACCUMULATE into params().grads() (the
  // caller zeroes them); they are the gradients of the mean loss over masked tokens.
  StepResult forward_backward(const data::Batch& batch);
  // Forward only (evaluation). predictions: argmax token per position (optional);
  // token_losses: mask·(−log p(target)) per position (optional; the scorers of eval/).
  StepResult evaluate(const data::Batch& batch, std::vector<int32_t>* predictions = nullptr,
                      std::vector<double>* token_losses = nullptr);

  // Bytes of activation memory of the last step (arena peak).
  std::size_t activation_bytes() const;
  const std::vector<std::unique_ptr<Mixer>>& mixers() const { return mixers_; }

  // Data parallelism (dist/, trainer/train.cpp): called during backward each time the
  // gradients of a group of parameters (indices into params().table()) are final for this
  // step — head and final norm first, then each block from the last down, the embedding
  // last — so their all-reduce can start while backward goes on. Called in stream order:
  // on a GPU the gradient kernels are queued, not necessarily finished. Empty: no calls.
  using GradsReadyHook = std::function<void(const std::vector<int>& params)>;
  void set_grads_ready_hook(GradsReadyHook hook) { grads_ready_ = std::move(hook); }

 private:
  struct Layer;
  StepResult forward(const data::Batch& batch, bool training, std::vector<int32_t>* predictions,
                     std::vector<double>* token_losses = nullptr);
  void backward();

  kernels::Backend& be_;
  json config_;
  ModelShape shape_;
  std::unique_ptr<ParamStore> params_;
  std::unique_ptr<kernels::Arena> arena_;
  std::vector<std::unique_ptr<Mixer>> mixers_;
  std::vector<Layer> layers_;
  int embed_ = -1, final_norm_ = -1, head_ = -1;
  struct Acts;
  std::unique_ptr<Acts> acts_;
  GradsReadyHook grads_ready_;
  void grads_ready(int layer);  // the hook with the parameters of block `layer`
};

}  // namespace lar::trainer
