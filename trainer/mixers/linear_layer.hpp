#pragma once
// Internal to trainer/mixers: one linear-mixer layer as data — its shape, the mixer's
// description (MixerDesc: decay, erase, write) and the CCQ, CARVE and routing add-ons (Dims),
// and the indices of its parameters (Slots). linear_config.cpp makes them from the config; the
// CPU skeleton (linear_mixer.cpp) and the CUDA one (cuda_layers/linear_layer_cuda.cpp, CUDA
// builds only) run any of them.
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/linear/mixers.hpp"
#include "trainer/mixer.hpp"

namespace lar::trainer::mixers {

// What one mixer puts into the shared layer (docs/spec.md §2): how it decays the state, what
// it erases and what it writes. Projections, conv, L2 norm, the recurrence's chunking and the
// output norm × gate are the same for all six; CCQ, CARVE's content gate and routing are
// add-ons on top (Dims::ccq, carve, route).
struct MixerDesc {
  enum class Decay {
    none,     // linear, deltanet: the state is not decayed
    logsig,   // gla: g = logsigmoid(W₂W₁x + b)/16 per key channel (gate_bias)
    head,     // gdn: g = −exp(A_log)·softplus(w_aᵀx + dt_bias), one per head
    channel,  // kda, gdn2: g = −exp(A_log)·softplus(W₂W₁x + dt_bias) per key channel
  };
  enum class Update {
    add,    // linear, gla: S += v kᵀ, nothing erased
    beta,   // deltanet, gdn, kda: erase β k, write β v, β = σ(w_βᵀx) per head
    gated,  // gdn2: erase σ(W_b x) ⊙ k per key channel, write σ(W_w x) ⊙ v per value channel
  };
  // The CUDA kernel family of the recurrence: the delta rule (scalar decay) or the channel
  // rule (per-channel decay; linear runs it with g = 0).
  enum class Family { delta_rule, channel_rule };
  Decay decay;
  Update update;
  Family family;

  bool low_rank_gate() const { return decay == Decay::logsig || decay == Decay::channel; }  // W₁ [r,d], W₂
  bool softplus_gate() const { return decay == Decay::head || decay == Decay::channel; }    // A_log, dt_bias
  bool beta() const { return update == Update::beta; }
  bool gated() const { return update == Update::gated; }
};

constexpr MixerDesc describe(kernels::cpu::linear::Mixer m) {
  using D = MixerDesc::Decay;
  using U = MixerDesc::Update;
  using F = MixerDesc::Family;
  using M = kernels::cpu::linear::Mixer;
  switch (m) {
    case M::linear:
      return {D::none, U::add, F::channel_rule};
    case M::gla:
      return {D::logsig, U::add, F::channel_rule};
    case M::deltanet:
      return {D::none, U::beta, F::delta_rule};
    case M::gdn:
      return {D::head, U::beta, F::delta_rule};
    case M::kda:
      return {D::channel, U::beta, F::channel_rule};
    case M::gdn2:
      return {D::channel, U::gated, F::channel_rule};
  }
  return {D::none, U::add, F::channel_rule};
}

// CCQ (model.ccq): q ← (I − λΣ)q with λ = σ(W_λ p_q + b_λ) (learned) or a fixed λ.
struct CcqAddon {
  bool on = false, centered = true, learned = true, disable_at_eval = false;
  double lambda = 0.01;  // fixed λ, or λ at init when learned
};

// CARVE (model.architecture: carve; the mixer is gdn2 for the shared gate code): the erase
// logits gain the content term U2 tanh(U1 m_c) per content chunk; the write gate is one scalar
// per head.
struct CarveAddon {
  bool on = false, content_grad = true, freeze_content = false;
  int content_chunk = 64, rank = 16;
};

// Cross-layer routing (LAA §4): none, cler (ṽ = v + Γ r_{p(l)}), cler_h / clvr (the model
// projects the published side channel into the residual stream).
enum class Route { none, cler, cler_h, clvr };
struct RouteAddon {
  Route kind = Route::none;
  // cler / cler_h with a β mixer: publish the written update β·r instead of r (model.routing_signal)
  bool update = false;
};

// Shapes and switches of one layer, resolved from the MixerConfig.
struct Dims {
  kernels::cpu::linear::Mixer mixer = kernels::cpu::linear::Mixer::linear;
  MixerDesc desc() const { return describe(mixer); }
  // H: heads of the recurrence (the value heads); Hk: query/key heads, H a multiple of Hk
  // (grouped value heads: head h reads the q, k of key head h / (H / Hk)). Cqk = Hk·dk is
  // the width of the q, k projections; Cq = H·dk of everything per key channel of a value
  // head (decay and erase gates); Cv = H·dv.
  int d = 0, H = 0, Hk = 0, dk = 0, dv = 0, Cqk = 0, Cq = 0, Cv = 0, W = 0, rank = 0, chunk = 64;
  bool conv = true, l2 = false;
  bool silu_only = false;  // no conv, q, k, v = SiLU(W x) (CARVE's printed form, model.carve.qkv: paper)
  CcqAddon ccq;
  CarveAddon carve;
  RouteAddon route;
};

// Parameter indices (into the bound vectors), -1 when the mixer has no such parameter.
struct Slots {
  int wq = -1, wk = -1, wv = -1, cq = -1, ck = -1, cv = -1;
  int g1 = -1, g2 = -1, gb = -1;  // low-rank gate W₁ [r,d], W₂ [Cq,r], bias (gla)
  int wbeta = -1, wa = -1, A_log = -1, dt_bias = -1;
  int werase = -1, wwrite = -1;  // gdn2
  int onorm = -1, wgate = -1, wo = -1;
  int wlam = -1, blam = -1;  // CCQ gate
  int U1 = -1, U2 = -1;      // CARVE content projection
  int gamma = -1;            // CLER Γ_l
};

// The layer's description from its config (trainer/mixers/linear_config.cpp): the Dims, with a
// UserError naming the key for a value out of range, and the parameter list in declaration
// order (sl: where each parameter landed, -1 for those the mixer has not).
Dims linear_dims(const MixerConfig& cfg);
std::vector<ParamSpec> linear_params(const Dims& d, double init_std, Slots& sl);

// Why the CUDA implementation cannot run this layer ("" when it can): key head dims other than
// 64, 128, 256 (or other than 64 with cler/cler_h; with CARVE other than 64 or 128, and 128 only
// once verified: kCarveWideCudaVerified), a conv wider than 8, CARVE with a content chunk other
// than 64 or with cler/cler_h routing, CARVE's printed q, k, v form, and while unverified
// (kLaaRoutingCudaVerified) the β-scaled routing signal and the cler/cler_h readouts at value
// heads wider than 64. The message names the offending value.
std::string cuda_linear_unsupported(const Dims& d);

// Why the CUDA implementation cannot decode this layer (init_state/step) although it runs its
// forward ("" when it can): CARVE at heads other than 64, the β-scaled routing signal. The
// message names the key and value.
std::string cuda_linear_decode_unsupported(const Dims& d);

// CARVE at key heads of 128 or value heads of 128 on CUDA (the recurrent wide_carve_fwd/bwd of
// kernels/linear/wide_key.hpp): verified on the H200 (test_linear_layer_cuda CarveWide*,
// test_wide_key_cuda CarveWideMatchesCpuReference). Set it to false to refuse the path again
// (cuda_linear_unsupported then says why and backend: auto trains those cells on the CPU).
constexpr bool kCarveWideCudaVerified = true;
// The refusal while the gate is closed (the model-level check of trainer/mixer.cpp says the same).
inline std::string carve_wide_gate_message(int dk, int dv) {
  return dk != 64 ? "model.head_dim: CARVE at key heads of " + std::to_string(dk) +
                        " has a CUDA path that is not yet verified on a GPU (tests/gpu/test_linear_layer_cuda.cpp "
                        "CarveWide*)"
                  : "model.value_dim: CARVE at value heads of " + std::to_string(dv) +
                        " has a CUDA path that is not yet verified on a GPU (tests/gpu/test_linear_layer_cuda.cpp "
                        "CarveWide*)";
}
// Tests only: tests/gpu/test_linear_layer_cuda.cpp (CarveWide*) runs the unverified wide CARVE.
inline bool& carve_wide_cuda_unverified_allowed() {
  static bool allowed = false;
  return allowed;
}

// The LAA paper-scale routing on CUDA — model.routing_signal: update (u = β·r published by
// cler/cler_h on a β mixer), model.routing_inject: layer (the side channel added after the FFN,
// trainer/model.cpp's inject_after_ffn over Backend ops) and the cler/cler_h readouts at value
// heads wider than 64 — verified on the H200 by tests/gpu/test_linear_layer_cuda.cpp's
// LaaRouting*. While false the CUDA backend refuses those cells (laa_routing_cuda_gate) and
// `backend: auto` trains them on the CPU; WhatTheCudaPathDoesNotRunIsAClearError expects either
// value.
constexpr bool kLaaRoutingCudaVerified = true;

// Tests only: tests/gpu/test_linear_layer_cuda.cpp's LaaRouting* run the unverified paths.
inline bool& laa_routing_cuda_unverified_allowed() {
  static bool allowed = false;
  return allowed;
}
inline bool laa_routing_cuda_open() { return kLaaRoutingCudaVerified || laa_routing_cuda_unverified_allowed(); }
// The refusal of an unverified LAA routing path: `what` names the key and value.
inline std::string laa_routing_cuda_gate(const std::string& what) {
  return what + " has a CUDA path that is not yet verified on a GPU (tests/gpu/test_linear_layer_cuda.cpp LaaRouting*)";
}

// The CUDA implementation (cuda_layers/linear_layer_cuda.cpp): forward/backward of the Mixer contract
// on the CUDA backend, fp32 interface tensors, bf16 chunk kernels inside; and the recurrent
// decode (one token per call, the state on the device: the decode kernels of
// the family kernels (kernels/delta_rule, channel_rule, carve, ccq) with the forward's projections, conv, gates and
// output).
class CudaLinear {
 public:
  virtual ~CudaLinear() = default;
  virtual void forward(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y, Routing& route) = 0;
  virtual void backward(ForwardContext& ctx, const kernels::Tensor& dy, const kernels::Tensor& dx, Routing& route) = 0;
  virtual std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch) = 0;
  virtual void step(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y, MixerState& state,
                    Routing& route) = 0;
};
// The CUDA layer's factory: cuda_layers/linear_layer_cuda.cpp sets it at static initialisation in
// builds with CUDA; null in a build without (the mixer then says the build has no CUDA support).
using CudaLinearFactory = std::unique_ptr<CudaLinear> (*)(const Dims& d, const Slots& s,
                                                          const std::vector<kernels::Tensor>& params,
                                                          const std::vector<kernels::Tensor>& grads);
// (An inline function's static is one object per program: the mixer and the registration share it.)
inline CudaLinearFactory& cuda_linear_factory() {
  static CudaLinearFactory factory = nullptr;
  return factory;
}

}  // namespace lar::trainer::mixers
