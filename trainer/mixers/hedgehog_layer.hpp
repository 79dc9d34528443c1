#pragma once
// Internal to trainer/mixers: the GLA-Hedgehog layer's shape (HedgehogShape) and parameter
// indices (HedgehogSlots), shared by the CPU implementation (hedgehog_mixer.cpp) and the CUDA
// one (cuda_layers/hedgehog_layer_cuda.cpp, CUDA builds only); the gate that keeps the CUDA layer off until
// it is verified on a GPU, and why the CUDA layer cannot run a shape.
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "kernels/linear/key_split_gate.hpp"
#include "trainer/mixer.hpp"

namespace lar::trainer::mixers {

// d_model, heads, the map's head dim dk, value dim dv, feature dim F = 2dk; Cq = H·dk (q, k
// projections), Cv = H·dv, CF = H·F (the per-feature-channel gates).
struct HedgehogShape {
  int d = 0, H = 0, dk = 0, dv = 0, F = 0, Cq = 0, Cv = 0, CF = 0, W = 4, rank = 16, chunk = 64;
  bool conv = true;
};

// Parameter indices into the bound vectors, in declaration order: wq, wk, wv are declared one
// after the other (the CUDA layer runs them as one GEMM).
struct HedgehogSlots {
  int wq = -1, wk = -1, wv = -1, cq = -1, ck = -1, cv = -1;
  int fq_w = -1, fq_b = -1, fk_w = -1, fk_b = -1;
  int g1 = -1, g2 = -1, gb = -1, onorm = -1, wgate = -1, wo = -1;
};

// The layer's shape from its config (model.short_conv, conv_size, gate_rank, chunk_size);
// lar::UserError naming the key for a bad value.
inline HedgehogShape hedgehog_shape(const MixerConfig& cfg) {
  const json& mo = cfg.model;
  HedgehogShape s;
  s.d = cfg.d_model;
  s.H = cfg.n_heads;
  s.dk = cfg.head_dim;
  s.dv = cfg.value_dim;
  s.F = 2 * s.dk;
  s.Cq = s.H * s.dk;
  s.Cv = s.H * s.dv;
  s.CF = s.H * s.F;
  s.conv = mo.value("short_conv", true);
  s.W = mo.value("conv_size", 4);
  s.rank = mo.value("gate_rank", 16);
  s.chunk = mo.value("chunk_size", 64);
  if (s.conv && s.W < 1) throw UserError("model.conv_size: must be ≥ 1, got " + std::to_string(s.W));
  if (s.chunk < 1) throw UserError("model.chunk_size: must be ≥ 1, got " + std::to_string(s.chunk));
  if (s.rank < 1) throw UserError("model.gate_rank: must be ≥ 1, got " + std::to_string(s.rank));
  return s;
}

// The CUDA layer runs the recurrence on the gla channel kernels at key dim Fp, the feature dim
// padded to the kernels' 64 (chunk kernels), 128 or 256 (wide-key kernels, or the key-block
// split where it is open), and past 256 to a multiple of 64 up to 512 (the key-block split of
// kernels/linear/grouped_heads.hpp only: CCQ's paper heads of 256), with zero features and
// zero log-gates, and value heads padded to a multiple of 64 with zero values.
inline int hedgehog_cuda_key_dim(const HedgehogShape& s) {
  return s.F <= 64 ? 64 : s.F <= 128 ? 128 : s.F <= 256 ? 256 : (s.F + 63) / 64 * 64;
}
inline int hedgehog_cuda_value_dim(const HedgehogShape& s) { return (s.dv + 63) / 64 * 64; }

// Why the CUDA layer cannot run this shape ("" when it can); the message names the key and value.
// Heads past 128 (feature dims past 256) run on the key-block split alone, so they are refused
// while its gate (kernels/linear/key_split_gate.hpp) is closed, by the gate's name.
inline std::string cuda_hedgehog_shape_unsupported(const HedgehogShape& s) {
  namespace kl = kernels::cuda::linear;
  if (!s.conv) return "model.short_conv: the CUDA gla_hedgehog layer needs the short conv (true), got false";
  if (s.W > 8) return "model.conv_size: the CUDA conv is at most 8 wide, got " + std::to_string(s.W);
  // F = 2·head_dim is the channel kernels' key dim: at most 256 on the wide-key kernels, 512 on
  // the key-block split; the feature-map GEMM reads rows of head_dim bf16 values, 16-byte aligned
  // at multiples of 8.
  if (s.dk > 32 * kl::kKeySplitMaxBlocks)
    return "model.head_dim: the CUDA gla_hedgehog layer takes up to " + std::to_string(32 * kl::kKeySplitMaxBlocks) +
           " (feature dim 2·head_dim up to " + std::to_string(64 * kl::kKeySplitMaxBlocks) +
           ", the gla kernels' key-block split), got " + std::to_string(s.dk);
  if (s.dk % 8 != 0)
    return "model.head_dim: the CUDA gla_hedgehog layer needs a multiple of 8, got " + std::to_string(s.dk);
  if (s.dv > 512) return "model.value_dim: the CUDA gla_hedgehog layer takes up to 512, got " + std::to_string(s.dv);
  if (s.dk > 128 && !kl::wide_key_split_open())
    return "model.head_dim: the CUDA gla_hedgehog layer runs heads past 128 (feature dims past 256, the wide-key "
           "kernels' widest key) on gla's key-block split only, which is " +
           std::string(kl::key_split_gate_text()) + "; got " + std::to_string(s.dk);
  return "";
}

// The gate: the product runs the CUDA layer once tests/gpu/test_hedgehog_cuda.cpp has passed on
// a GPU (it has, on the H200: 8 of 8); were it false, backend: cuda would refuse it and
// backend: auto train on the CPU. Tests open it for themselves with
// allow_unverified_hedgehog_cuda(). Read only by hedgehog_cuda_gate_open(). Lifting it: set it
// true once test_hedgehog_cuda passes on an H200; the CPU and GPU tests expect either value
// (HedgehogLayer.CudaCoverageNamesTheGateAndTheOption, HedgehogCuda.GateAndShapeRefusals); the
// "gated" wording goes from docs/architectures.md (GLA-Hedgehog), docs/fidelity.md (CCQ
// baselines row) and the comments of experiments/papers/ccq/table2.yaml and table4.yaml.
constexpr bool kHedgehogCudaVerified = true;
inline bool& hedgehog_cuda_test_override() {
  static bool allowed = false;
  return allowed;
}
// Tests only: run the CUDA layer before kHedgehogCudaVerified is true.
inline void allow_unverified_hedgehog_cuda(bool allow) { hedgehog_cuda_test_override() = allow; }
inline bool hedgehog_cuda_gate_open() { return kHedgehogCudaVerified || hedgehog_cuda_test_override(); }

// Why the product does not run this gla_hedgehog shape on CUDA ("" when it does): the gate,
// then the shape. (Inline: trainer::cuda_unsupported checks a model's layers with it before
// any is built, and the mixer checks it before it builds the CUDA layer.)
inline std::string cuda_hedgehog_unsupported(const HedgehogShape& s) {
  if (!hedgehog_cuda_gate_open())
    return "the 'gla_hedgehog' mixer's CUDA layer is unverified: it has not yet passed tests/gpu/"
           "test_hedgehog_cuda on a GPU (kHedgehogCudaVerified, trainer/mixers/hedgehog_layer.hpp)";
  return cuda_hedgehog_shape_unsupported(s);
}

// forward/backward of the Mixer contract on the CUDA backend (fp32 parameters, x, y, dy, dx in
// act_dtype(), the bf16 channel kernels inside), and the recurrent decode (one token of B
// sequences a call, the state on the device; gated: kSsmDecodeCudaVerified, ssm_common.hpp).
class CudaHedgehog {
 public:
  virtual ~CudaHedgehog() = default;
  virtual void forward(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y) = 0;
  virtual void backward(ForwardContext& ctx, const kernels::Tensor& dy, const kernels::Tensor& dx) = 0;
  virtual std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch) = 0;
  virtual void step(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y, MixerState& state) = 0;
};
// Checks the shape only (cuda_hedgehog_shape_unsupported, with the key-block split's gate for
// heads past 128); the mixer checks the layer's gate before it builds one (the GPU tests open
// the gates to reach it).
// The CUDA layer's factory: cuda_layers/hedgehog_layer_cuda.cpp sets it at static initialisation in
// builds with CUDA; null in a build without (the mixer then says the build has no CUDA support).
using CudaHedgehogFactory = std::unique_ptr<CudaHedgehog> (*)(const HedgehogShape& s, const HedgehogSlots& sl,
                                                              const std::vector<kernels::Tensor>& params,
                                                              const std::vector<kernels::Tensor>& grads);
// (An inline function's static is one object per program: the mixer and the registration share it.)
inline CudaHedgehogFactory& cuda_hedgehog_factory() {
  static CudaHedgehogFactory factory = nullptr;
  return factory;
}

}  // namespace lar::trainer::mixers
