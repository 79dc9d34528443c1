#pragma once
// Causal softmax attention through cuDNN's fused flash-attention engines, built with
// cuDNN's backend graph API (no cudnn-frontend): the forward graph is
//   S = Q·Kᵀ → ·scale → causal mask (row ≥ col, else −inf) → softmax with stats → P·V,
// the backward graph the matching dQ, dK, dV chain (dO·O row sums, P recomputed from the
// stats). Same tensors and layouts as the flash kernels (flash_attention.hpp):
//   q, o, dout, dq [B, T, Hq, D] bf16;  k, v, dk, dv [B, T, Hkv, D] bf16;  lse [B, Hq, T] fp32.
// cuDNN's softmax stats are max + log Σ exp, i.e. the natural-log LSE of each row of
// scale·q·kᵀ, which is exactly the flash kernels' lse: a forward by one implementation
// and a backward by the other agree (tests/gpu/test_attention_cuda checks both ways).
//
// What it covers (cudnn_covers): causal with or without a sliding window (cuDNN's
// diagonal band: keep t − j < window), S == T, D = 64 or 128, GQA (Hq a multiple of Hkv).
// The CUDA backend uses the flash kernels for everything else (KV cache S > T, other head
// dims), in deterministic mode (cuDNN's backward accumulates dQ with atomics), and where
// cuDNN cannot be loaded. The run's cuda.attention = auto|cudnn|flash (default auto) forces one.
//
// cuDNN is optional twice over: the build defines LAR_HAVE_CUDNN only when the CUDA
// toolkit has its headers, and the library (libcudnn.so.9) is opened at run time, so a
// binary still starts (and uses the flash kernels) where cuDNN is not on the library path.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "kernels/attention/flash_attention.hpp"

namespace lar::kernels::cuda::attention {

enum class AttentionMode { auto_, cudnn, flash };
// The value of cuda.attention ("" or "auto": auto); lar::UserError naming the key for any other.
AttentionMode attention_mode(const std::string& value);

// True when cuDNN's graph covers this problem (see above); says nothing about the library.
bool cudnn_covers(const FlashShape& s);
// True when this build has cuDNN support and libcudnn.so.9 (major version 9) loaded.
bool cudnn_available();
// Why cudnn_available() is false ("" when it is true).
std::string cudnn_unavailable_reason();
// The loaded library's version (e.g. 91300 for 9.13.0); 0 when unavailable.
long cudnn_version();

// One cuDNN handle and the execution plans built so far, per shape (B, T, Hq, Hkv, D,
// window): building an operation graph and finalising its plan takes tens of
// milliseconds, so each shape is built once. Not thread-safe (one per backend/stream).
class CudnnAttention {
 public:
  CudnnAttention();  // RuntimeError when !cudnn_available()
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Builds (once) the forward and backward plans of this shape; false, with the reason,
  // when cuDNN has no engine for either. Both or neither: a shape never runs its forward
  // on one implementation and its backward on the other by accident.
  bool prepare(const FlashShape& s, std::string* why = nullptr);

  // Device workspace bytes of the forward / backward (prepare()d shapes; 256-aligned).
  std::size_t fwd_workspace_bytes(const FlashShape& s);
  std::size_t bwd_workspace_bytes(const FlashShape& s);

  // o and lse are overwritten (lse in the flash layout above). The scale may differ from
  // call to call (it is a run-time scalar of the plan). RuntimeError on any cuDNN failure.
  void fwd(const FlashShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
           __nv_bfloat16* o, float* lse, void* workspace, cudaStream_t stream);
  // dq, dk, dv are overwritten; o and lse are a forward's outputs (either implementation).
  void bwd(const FlashShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
           const __nv_bfloat16* o, const float* lse, const __nv_bfloat16* dout, __nv_bfloat16* dq,
           __nv_bfloat16* dk, __nv_bfloat16* dv, void* workspace, cudaStream_t stream);

 private:
  struct Plan;
  struct Entry;
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
  Entry& entry(const FlashShape& s);
  void* handle_ = nullptr;  // cudnnHandle_t
  std::map<Key, std::unique_ptr<Entry>> plans_;
};

}  // namespace lar::kernels::cuda::attention
