#pragma once
// Internal to cuda_layers/: what the four CUDA layers (linear, Mamba-2, Mamba-3, GLA-Hedgehog)
// share around their kernels — the backend's stream, the run's kernel choice, and the check
// that the weights one GEMM reads as a single matrix lie one after another.
#include <cuda_runtime.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/linear/shape.hpp"

namespace lar::trainer::mixers::cuda_layer {

constexpr float kNormEps = 1e-5f;  // the output RMSNorm's, as on the CPU

// The CUDA backend's stream; `who` names the layer in the error for another backend.
inline cudaStream_t stream(kernels::Backend& be, const char* who) {
  auto* cb = dynamic_cast<kernels::cuda::CudaBackend*>(&be);
  if (!cb) throw RuntimeError(std::string(who) + " (cuda): backend " + be.name() + " is not the CUDA backend");
  return cb->stream();
}

// The chunk and CCQ kernels the run's cuda.linear_path and cuda.ccq_* keys ask for.
inline kernels::cuda::linear::KernelChoice kernel_choice(const kernels::Backend& be) {
  const auto& c = be.options().cuda;
  return kernels::cuda::linear::kernel_choice(c.linear_path, c.ccq_fwd, c.ccq_bwd, c.ccq_group);
}

// Whether the tensors v[slots[0]], v[slots[1]], … lie one after another in memory (ParamStore
// declares a layer's parameters in order, so a fused projection's weights do unless a
// parameter was declared between them).
inline bool adjacent(const std::vector<kernels::Tensor>& v, std::initializer_list<int> slots) {
  const int* o = slots.begin();
  for (std::size_t i = 0; i + 1 < slots.size(); ++i)
    if (static_cast<const char*>(v[o[i + 1]].data) != static_cast<const char*>(v[o[i]].data) + v[o[i]].bytes())
      return false;
  return true;
}

}  // namespace lar::trainer::mixers::cuda_layer
