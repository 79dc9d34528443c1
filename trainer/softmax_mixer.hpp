#pragma once
// The `softmax` token mixer (docs/spec.md §2): q, k, v projections with grouped-query attention
// (model.n_kv_heads key/value heads), RoPE (model.rope_base) on q and k, causal softmax
// attention with an optional sliding window (model.window), output projection W_o.
// Registered as "softmax".
#include "trainer/mixer.hpp"

namespace lar::trainer {

class SoftmaxMixer final : public Mixer {
 public:
  explicit SoftmaxMixer(const MixerConfig& cfg);
  std::string kind() const override { return "softmax"; }
  std::vector<ParamSpec> params() const override;
  void bind(std::vector<kernels::Tensor> params, std::vector<kernels::Tensor> grads) override;
  void forward(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y, Routing& route) override;
  void backward(ForwardContext& ctx, const kernels::Tensor& dy, const kernels::Tensor& dx, Routing& route) override;
  std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch, int max_len) const override;
  void step(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y, MixerState& state,
            Routing& route) override;

 private:
  bool fused_qkv(bool reduced) const;
  MixerConfig cfg_;
  int hq_, hkv_, hd_;
  double rope_base_, scale_;
  int64_t window_;
  kernels::Tensor wq_, wk_, wv_, wo_, gwq_, gwk_, gwv_, gwo_;
  // Forward cache (arena tensors of the current step): x_ is the input in the backend's
  // act_dtype() (a bf16 copy on the GPU in mixed precision), q_ … o_ in act_dtype() too.
  kernels::Tensor x_, q_, k_, v_, o_, lse_;
};

}  // namespace lar::trainer
