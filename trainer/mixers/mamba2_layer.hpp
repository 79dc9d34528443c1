#pragma once
// Internal to trainer/mixers: the parameter indices of the Mamba-2 layer (Mamba2Slots), shared
// by the CPU implementation (mamba2_mixer.cpp) and the CUDA one (cuda_layers/mamba2_layer_cuda.cpp, CUDA
// builds only), and why the CUDA one cannot run a shape.
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/ssm/supports.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/mamba_options.hpp"

namespace lar::trainer::mixers {

// Parameter indices into the bound vectors, in declaration order: w_z, w_x, w_B, w_C, w_dt are
// declared one after the other (the CUDA layer runs the first four as one GEMM).
struct Mamba2Slots {
  int wz = -1, wx = -1, wB = -1, wC = -1, wdt = -1;
  int cx = -1, cB = -1, cC = -1, bx = -1, bB = -1, bC = -1;
  int A_log = -1, dt_bias = -1, D = -1, norm = -1, wo = -1;
};

// Tests only: tests/gpu/test_mamba2_cuda.cpp's DISABLED_StateOf64… and DISABLED_ConvOf3… run the
// refused state of 64 and conv widths other than 4 to find why they fail.
inline bool& mamba2_cuda_refused_shapes_allowed() {
  static bool allowed = false;
  return allowed;
}

// Why the CUDA layer cannot run this shape ("" when it can): the state size (the gla channel
// kernels' key dim) must be 128 or 256, the head dim (their value dim) a multiple of 64 up
// to 512, the conv at most 8 wide. The message names the offending key and value.
// (Inline: trainer::cuda_unsupported checks a model's layers with it before any is built.)
inline std::string cuda_mamba2_unsupported(const MambaShape& s, int conv_size) {
  // States of 128 and 256 run the recurrent wide-key kernels. A state of 64 would run the
  // 64-wide chunk kernels, where the H200 tests measured the A_log, dt_bias and D gradients
  // (sums over every token) 0.06 to 0.46 away from the CPU layer, against the bound of 0.06.
  // That is refused until it is explained: ill-conditioned test data or a kernel fault.
  const bool probe = mamba2_cuda_refused_shapes_allowed();
  if (s.N == 64 && !probe)
    return "model.mamba.state_size: 64 has no CUDA path yet (its A_log, dt_bias and D gradients are not within "
           "the GPU tests' bounds); the CUDA Mamba-2 layer takes 128 (the papers') or 256";
  namespace kc = kernels::cuda::linear;
  if (!kc::ssm_state_supported(s.N) && !(probe && s.N == 64))
    return "model.mamba.state_size: the CUDA Mamba-2 layer takes 128 or 256, got " + std::to_string(s.N);
  if (!kc::ssm_head_supported(s.P))
    return "model.mamba.head_dim: the CUDA Mamba-2 layer needs a multiple of 64 up to 512, got " + std::to_string(s.P);
  // Every mamba2 layer test that passed on the H200 has a conv of 4 (Mamba-2's d_conv); both
  // that failed have 3 (GroupsMatchTheCpuLayer's G = H = 2 case: y and dx within bounds, the
  // D, dt_bias and conv bias gradients 0.1 to 0.8 away). Until that is explained, only 4.
  if (conv_size != 4 && !probe)
    return "model.conv_size: the CUDA Mamba-2 layer takes 4 (Mamba-2's), got " + std::to_string(conv_size) +
           " (at 3 its token-sum gradients measured outside the GPU tests' bounds)";
  return "";
}

// forward/backward of the Mixer contract on the CUDA backend (fp32 parameters, x, y, dy, dx in
// act_dtype(), the bf16 channel kernels inside), and the recurrent decode (one token of B
// sequences a call, the state on the device; gated: kSsmDecodeCudaVerified, ssm_common.hpp).
class CudaMamba2 {
 public:
  virtual ~CudaMamba2() = default;
  virtual void forward(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y) = 0;
  virtual void backward(ForwardContext& ctx, const kernels::Tensor& dy, const kernels::Tensor& dx) = 0;
  virtual std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch) = 0;
  virtual void step(ForwardContext& ctx, const kernels::Tensor& x, const kernels::Tensor& y, MixerState& state) = 0;
};
// The CUDA layer's factory: cuda_layers/mamba2_layer_cuda.cpp sets it at static initialisation in
// builds with CUDA; null in a build without (the mixer then says the build has no CUDA support).
using CudaMamba2Factory = std::unique_ptr<CudaMamba2> (*)(const MambaShape& s, int conv_size, const Mamba2Slots& sl,
                                                          const std::vector<kernels::Tensor>& params,
                                                          const std::vector<kernels::Tensor>& grads);
// (An inline function's static is one object per program: the mixer and the registration share it.)
inline CudaMamba2Factory& cuda_mamba2_factory() {
  static CudaMamba2Factory factory = nullptr;
  return factory;
}

}  // namespace lar::trainer::mixers
