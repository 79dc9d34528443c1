#pragma once
// Internal to cuda_layers/: the decode state of the CUDA Mamba-2, Mamba-3 and GLA-Hedgehog
// layers (init_state/step) and the conv window they share. As the linear mixers' decode
// (linear_layer_cuda.cpp): the state lives in one device allocation of the
// backend, zero at the start; the causal conv runs the forward's own conv kernel over a window
// of the last W projection rows of each sequence (two buffers [B, W, ldp] in act_dtype(), the
// current one and the next), so its last row is the forward's value at that position.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "kernels/backend.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "trainer/mixer.hpp"

namespace lar::trainer::mixers {

struct SsmCudaState final : MixerState {
  SsmCudaState(kernels::Backend& b, std::size_t bytes) : be(b), mem(b.alloc_bytes(bytes)), bytes(bytes) {}
  ~SsmCudaState() override { be.free_bytes(mem); }
  SsmCudaState(const SsmCudaState&) = delete;
  SsmCudaState& operator=(const SsmCudaState&) = delete;
  kernels::Backend& be;
  void* mem;
  std::size_t bytes;
  std::size_t used = 0;
  int64_t B = 0, pos = 0;
  kernels::DType at = kernels::DType::f32;
  int window = 1;                                          // rows of the conv window (conv_size; 1: no conv)
  int64_t ldp = 0;                                         // the window's row width (elements of act_dtype())
  void* win[2] = {nullptr, nullptr};                       // [B, window, ldp]
  int cur = 0;                                             // the window holding the last token
  float* S = nullptr;                                      // the recurrent state, fp32
  float* extra[4] = {nullptr, nullptr, nullptr, nullptr};  // mixer-specific (Mamba-3: φ, k_prev ×2, v_prev)

  // The next n bytes of the allocation (256-byte aligned), nullptr for n = 0.
  void* take(std::size_t n) {
    if (n == 0) return nullptr;
    n = (n + 255) / 256 * 256;
    if (used + n > bytes) throw RuntimeError("ssm decode state: allocation too small");
    void* r = static_cast<char*>(mem) + used;
    used += n;
    return r;
  }
  static std::size_t rounded(std::size_t n) { return (n + 255) / 256 * 256; }

  // The window moves by one: its rows 1..W−1 and then the token's projection row P [B, ldp]
  // into the other buffer, which becomes the current one. Returns it.
  void* push(const void* P, cudaStream_t st) {
    const std::size_t row = (std::size_t)ldp * kernels::dtype_size(at), pitch = row * window;
    char* next = static_cast<char*>(win[cur ^ 1]);
    const char* last = static_cast<const char*>(win[cur]);
    if (window > 1)
      LAR_CUDA_CHECK(
          cudaMemcpy2DAsync(next, pitch, last + row, pitch, row * (window - 1), B, cudaMemcpyDeviceToDevice, st));
    LAR_CUDA_CHECK(cudaMemcpy2DAsync(next + row * (window - 1), pitch, P, row, row, B, cudaMemcpyDeviceToDevice, st));
    cur ^= 1;
    return next;
  }
};

// The last of W rows of each of B sequences: src [B, W, width bytes] → dst [B, width bytes].
inline void ssm_last_rows(const void* src, void* dst, std::size_t width, int W, int64_t B, cudaStream_t st) {
  LAR_CUDA_CHECK(cudaMemcpy2DAsync(dst, width, static_cast<const char*>(src) + width * (W - 1), width * W, width, B,
                                   cudaMemcpyDeviceToDevice, st));
}

// step()'s checks: the state is one of these, of this batch and precision, x is [B, d].
inline SsmCudaState& ssm_decode_state(const char* who, MixerState& state, const kernels::Tensor& x, int64_t d,
                                      kernels::DType at) {
  auto* s = dynamic_cast<SsmCudaState*>(&state);
  if (!s) throw RuntimeError(std::string(who) + ": step() with a foreign state");
  if (x.ndim != 2 || x.size(1) != d || x.size(0) != s->B)
    throw RuntimeError(std::string(who) + ": step() input " + x.shape_str() + " for a state of batch " +
                       std::to_string(s->B) + " and width " + std::to_string(d));
  if (s->at != at) throw RuntimeError(std::string(who) + ": step() with a state of another precision");
  return *s;
}

}  // namespace lar::trainer::mixers
