#pragma once
// The per-layer token-mixer interface (docs/spec.md §2–§4). A block is
//     h ← h + Mixer(RMSNorm(h));  h ← h + SwiGLU(RMSNorm(h))
// and the model (trainer/model.hpp) owns everything except the Mixer: norms, SwiGLU,
// residual adds, the cross-layer routing projections P_l, and the layer list.
//
// Writing a mixer (e.g. trainer/mixers/gdn.cpp):
//   class Gdn : public lar::trainer::Mixer { ... };
//   static lar::trainer::MixerRegistration reg{"gdn",
//       [](const lar::trainer::MixerConfig& c) { return std::make_unique<Gdn>(c); }};
// The registry is keyed by the `model.architecture` value; nothing else needs editing
// (lar_trainer is linked whole-archive, so static registrations are never dropped).
//
// Lifecycle, per training step (one Mixer object per layer; it may keep pointers into
// the arena between forward and backward of the same step):
//   1. params()          once, at model build: the model allocates them in the flat
//                        buffers (trainer/params.hpp) and calls bind() with the views.
//   2. forward(ctx, x, y, route)   x,y [B,T,d_model]. Cache what backward needs in
//                        ctx.arena (valid until the next forward). Overwrite y. x is
//                        the model's arena tensor: it stays valid until backward, so
//                        keep the Tensor rather than a copy.
//   3. backward(ctx, dy, dx, route) dx [B,T,d_model]: OVERWRITE dx (the model adds it
//                        into the residual gradient through RMSNorm's backward);
//                        ACCUMULATE parameter gradients into the bound grad tensors.
//   4. init_state()/step(): recurrent decode, one token per call, carried state; step()
//                        outputs must equal forward() outputs position by position.
// Parameters, gradients and state have the backend's dtype (f32 in training, f64 in gradient
// checks); x, y, dy and dx have its act_dtype() (bf16 on the CUDA backend in mixed precision,
// else the same as dtype()).
// `ctx.training` is false for evaluation (e.g. CCQ's disable_at_eval).
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "kernels/backend.hpp"
#include "trainer/params.hpp"

namespace lar::trainer {

// Everything a mixer needs to build itself. Dimensions are resolved (no zeros).
struct MixerConfig {
  json model;            // the config's "model" section, schema defaults applied
  std::string kind;      // the mixer of this layer: "softmax" or model.architecture
  int layer = 0;         // block index
  int linear_index = -1; // index among the linear (non-softmax) layers, -1 for softmax
  int n_layers = 0;
  int d_model = 0;
  int n_heads = 0;       // softmax: query heads; linear mixers: query/key heads (model.linear_heads)
  int n_v_heads = 0;     // linear mixers: value heads, a multiple of n_heads; 0 = n_heads
  int n_kv_heads = 0;    // softmax GQA groups
  int head_dim = 0;      // dk
  int value_dim = 0;     // dv (linear mixers); softmax uses head_dim
  double init_std = 0.02;
  std::string routing;   // "none" | "cler" | "cler_h" | "clvr"
};

struct ForwardContext {
  kernels::Backend& be;
  kernels::Arena& arena;   // activations of this step; reset by the model before forward
  bool training = true;
};

// Cross-layer routing (docs/spec.md §4, LAA §4): a side channel [B,T,side_dim] that a linear
// layer publishes (its write residual r_l for cler/cler_h, its written value v_l for clvr)
// and that p(l') — the nearest lower linear layer — hands to layer l'. Softmax layers
// neither read nor publish; the channel skips them.
//   cler:          the mixer itself uses `in` (ṽ = v + Γ_l·r_{p(l)}) with its own Γ_l param.
//   cler_h / clvr: the MODEL adds P_l·out to the residual after the mixer's residual add
//                  (P_l [d_model, side_dim], zero-initialised, declared by the model).
// Data flow (all tensors allocated by the model except `out`):
//   forward:  `in`  = p(l)'s `out`, or empty when l has no lower linear layer or routing
//             is none; the mixer sets `out` (in its arena cache) when publishes() is true.
//   backward: the model zeroes every d_out before the backward pass; layers run top-down,
//             so layer l' ACCUMULATES ∂L/∂in into `d_in` (= p(l')'s d_out) before p(l')
//             reads its complete `d_out`.
struct Routing {
  kernels::Tensor in, d_in;
  kernels::Tensor out, d_out;
};

// Decode state carried between step() calls (KV cache, recurrent S, conv tail, ...).
struct MixerState {
  virtual ~MixerState() = default;
};

class Mixer {
 public:
  virtual ~Mixer() = default;
  virtual std::string kind() const = 0;

  // Declared parameters (local names; the model prefixes "layers.<l>.mixer.").
  virtual std::vector<ParamSpec> params() const = 0;
  // Views of the declared parameters and their gradients, in declaration order.
  virtual void bind(std::vector<kernels::Tensor> params, std::vector<kernels::Tensor> grads) = 0;

  // Routing: does this layer publish a side channel, and of which width.
  virtual bool publishes() const { return false; }
  virtual int64_t side_dim() const { return 0; }

  virtual void forward(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y,
                       Routing& route) = 0;
  virtual void backward(ForwardContext& ctx, const kernels::Tensor& dy, const kernels::Tensor& dx,
                        Routing& route) = 0;

  // Decode: x, y [B,d_model], one position per call. `route` as in forward with [B,side].
  virtual std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch, int max_len) const = 0;
  virtual void step(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y,
                    MixerState& state, Routing& route) = 0;
};

using MixerFactory = std::function<std::unique_ptr<Mixer>(const MixerConfig&)>;

struct MixerRegistration {
  MixerRegistration(const std::string& kind, MixerFactory factory);
};

// Throws lar::UserError naming the kind and the registered ones when unknown.
std::unique_ptr<Mixer> make_mixer(const MixerConfig& cfg);
bool mixer_registered(const std::string& kind);
std::vector<std::string> registered_mixers();
// Whether this build can run a layer of this kind on the CUDA backend (the trainer
// refuses, or with backend: auto falls back to the CPU, when a layer cannot).
bool mixer_runs_on_cuda(const std::string& kind);
// Why this model (its "model" section, defaults applied) cannot train on the CUDA backend,
// or "" when it can: a mixer without CUDA kernels, or a linear layer with dk/dv ≠ 64 or a
// conv wider than 8, CARVE with a content chunk ≠ 64 or cler/cler_h routing (the message
// names the value). mixer_runs_on_cuda checks kinds only.
std::string cuda_unsupported(const json& model);

// The layer list (docs/spec.md §3): the mixer kind of each layer. Layer l is softmax when
// architecture == softmax, or stack == dense, or (stack == hybrid and
// l % (hybrid_ratio+1) == hybrid_ratio); otherwise model.architecture.
std::vector<std::string> layer_kinds(const json& model);

// MixerConfig of layer l with every dimension resolved (head_dim = d_model/n_heads, ...).
MixerConfig mixer_config(const json& model, int layer);

}  // namespace lar::trainer
