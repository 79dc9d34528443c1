#pragma once
// Internal to trainer/mixers: the parameter indices of the Mamba-3 layer (Mamba3Slots), shared
// by the CPU implementation (mamba3_mixer.cpp) and the CUDA one (cuda_layers/mamba3_layer_cuda.cpp, CUDA
// builds only); why the CUDA one cannot run a shape; and the gate that keeps the CUDA layer
// off until the GPU tests (tests/gpu/test_mamba3_cuda.cpp) have passed on an H200.
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/ssm/supports.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/mamba_options.hpp"

namespace lar::trainer::mixers {

// Parameter indices into the bound vectors, in declaration order: w_z, w_x, w_B, w_C are
// declared one after the other, then w_dt, w_a, w_trap, w_angle (the CUDA layer runs each run
// of four as one GEMM). mx, mz, mo: MIMO only (−1 in the SISO form).
struct Mamba3Slots {
  int wz = -1, wx = -1, wB = -1, wC = -1, wdt = -1, wa = -1, wtrap = -1, wang = -1;
  int dt_bias = -1, nB = -1, nC = -1, bB = -1, bC = -1, D = -1, wo = -1;
  int mx = -1, mz = -1, mo = -1;
};

// The CUDA Mamba-3 layer runs in the product once tests/gpu/test_mamba3_cuda.cpp has passed on
// a GPU (it has, on the H200: 7 of 7). Were it false, trainer::cuda_unsupported would refuse
// every mamba3 model (`backend: cuda` a UserError, `backend: auto` on the CPU).
constexpr bool kMamba3CudaVerified = true;

// Test-only: tests/gpu/test_mamba3_cuda.cpp sets this to run the unverified CUDA layer (the
// layer's own tests and the model runs around it). Nothing else may set it.
inline bool& mamba3_cuda_unverified_allowed() {
  static bool allowed = false;
  return allowed;
}

// "" when the CUDA layer may run (verified, or allowed by the GPU tests), else the reason.
inline std::string mamba3_cuda_gate() {
  if (kMamba3CudaVerified || mamba3_cuda_unverified_allowed()) return "";
  return "the 'mamba3' mixer's CUDA layer is unverified (its GPU tests, tests/gpu/test_mamba3_cuda.cpp, have not "
         "passed on a GPU yet); it trains on the cpu backend";
}

// The MIMO rank (1 in the SISO form) and the rotated pairs of model.mamba3, as the layer reads
// them (Mamba3Mixer checks the values; this only reads them).
inline int mamba3_rank(const json& model) {
  const json m3 = model.contains("mamba3") && model["mamba3"].is_object() ? model["mamba3"] : json::object();
  return m3.value("form", "siso") == "mimo" ? m3.value("mimo_rank", 4) : 1;
}

// The widest MIMO rank the CUDA layer takes (its per-token kernels hold the R rows of q and k
// in registers).
constexpr int kMamba3CudaMaxRank = kernels::cuda::linear::kMamba3MaxRank;

// Why the CUDA layer cannot run this shape ("" when it can): the state size (the gla channel
// kernels' key dim) must be 128 or 256 (the recurrent wide-key kernels: exact at any chunk
// size, so model.chunk_size does not matter), the head dim (their value dim) a multiple of 64
// up to 512, the MIMO rank at most kMamba3CudaMaxRank. The message names the key and value.
// (Inline: trainer::cuda_unsupported checks a model's layers with it before any is built.)
inline std::string cuda_mamba3_unsupported(const MambaShape& s, int rank) {
  namespace kc = kernels::cuda::linear;
  if (!kc::ssm_state_supported(s.N))
    return "model.mamba.state_size: the CUDA Mamba-3 layer takes 128 or 256, got " + std::to_string(s.N);
  if (!kc::ssm_head_supported(s.P))
    return "model.mamba.head_dim: the CUDA Mamba-3 layer needs a multiple of 64 up to 512, got " + std::to_string(s.P);
  if (!kc::mamba3_rank_supported(rank))
    return "model.mamba3.mimo_rank: the CUDA Mamba-3 layer takes 1 to " + std::to_string(kMamba3CudaMaxRank) +
           ", got " + std::to_string(rank);
  return "";
}

// forward/backward of the Mixer contract on the CUDA backend (fp32 parameters, x, y, dy, dx in
// act_dtype(), the bf16 channel kernels inside), and the recurrent decode (one token of B
// sequences a call, Mamba-3's own recurrence on the device state; gated: kSsmDecodeCudaVerified,
// ssm_common.hpp).
class CudaMamba3 {
 public:
  virtual ~CudaMamba3() = default;
  virtual void forward(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y) = 0;
  virtual void backward(ForwardContext& ctx, const kernels::Tensor& dy, const kernels::Tensor& dx) = 0;
  virtual std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch) = 0;
  virtual void step(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y, MixerState& state) = 0;
};
// na: the rotated pairs; rank: R (1 for SISO).
// The CUDA layer's factory: cuda_layers/mamba3_layer_cuda.cpp sets it at static initialisation in
// builds with CUDA; null in a build without (the mixer then says the build has no CUDA support).
using CudaMamba3Factory = std::unique_ptr<CudaMamba3> (*)(const MambaShape& s, int na, int rank, const Mamba3Slots& sl,
                                                          const std::vector<kernels::Tensor>& params,
                                                          const std::vector<kernels::Tensor>& grads);
// (An inline function's static is one object per program: the mixer and the registration share it.)
inline CudaMamba3Factory& cuda_mamba3_factory() {
  static CudaMamba3Factory factory = nullptr;
  return factory;
}

}  // namespace lar::trainer::mixers
