// The CUDA backend's cross-entropy ops: forward, backward and the fused forward-backward over
// f32 or bf16 logits (a block per row, or rows held in registers for bf16), masked and
// deterministic.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/backend_device.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_backend_internal.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda {

namespace {

// ---------------------------------------------------------------- cross-entropy
template <class TL>
__global__ void ce_fwd_kernel(const TL* logits, const int* targets, const float* mask, float* losses,
                              int* argmax, int64_t V) {
  int64_t row = blockIdx.x;
  const TL* lr = logits + row * V;
  float m = -INFINITY;
  int64_t best = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
    if (ldf(lr + i) > m) m = ldf(lr + i), best = i;
  float gmax = block_max(m);
  __shared__ long long best_idx;
  if (threadIdx.x == 0) best_idx = V;
  __syncthreads();
  // The first index holding the maximum, as the CPU reference picks it.
  if (m == gmax) atomicMin(&best_idx, static_cast<long long>(best));
  __syncthreads();
  double se = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) se += exp(static_cast<double>(ldf(lr + i) - gmax));
  se = block_sum_d(se);
  if (threadIdx.x == 0) {
    double lse = gmax + log(se);
    losses[row] = static_cast<float>(mask[row] * (lse - ldf(lr + targets[row])));
    if (argmax) argmax[row] = static_cast<int>(best_idx);
  }
}

template <class TL, class TD>
__global__ void ce_bwd_kernel(const TL* logits, const int* targets, const float* mask, float grad_scale,
                              TD* dlogits, int64_t V) {
  int64_t row = blockIdx.x;
  const TL* lr = logits + row * V;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, ldf(lr + i));
  float gmax = block_max(m);
  double se = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) se += exp(static_cast<double>(ldf(lr + i) - gmax));
  se = block_sum_d(se);
  __syncthreads();  // every read of the row is done before dlogits (which may alias) is written
  float w = grad_scale * mask[row];
  int tgt = targets[row];
  float inv = static_cast<float>(1.0 / se);
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    float p = expf(ldf(lr + i) - gmax) * inv;
    stf(dlogits + row * V + i, w * (p - (i == tgt ? 1.f : 0.f)));
  }
}

// cross-entropy forward and backward of one row per block, the row staged once in shared
// memory (V floats): one read of the logits, one write of dlogits, instead of five passes.
// Same arithmetic as ce_fwd_kernel + ce_bwd_kernel (reduction splits differ: not bitwise).
constexpr int kCeFusedThreads = 1024;
template <class TL, class TD>
__global__ void __launch_bounds__(kCeFusedThreads) ce_fused_kernel(const TL* logits, const int* targets,
                                                                   const float* mask, float* losses, float grad_scale,
                                                                   TD* dlogits, int64_t V) {
  extern __shared__ float srow[];
  const int64_t row = blockIdx.x;
  const TL* lr = logits + row * V;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float x = ldf(lr + i);
    srow[i] = x;
    m = fmaxf(m, x);
  }
  const float gmax = block_max(m);  // its barriers also publish srow
  double se = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) se += exp(static_cast<double>(srow[i] - gmax));
  se = block_sum_d(se);
  const int tgt = targets[row];
  if (threadIdx.x == 0) losses[row] = static_cast<float>(mask[row] * (gmax + log(se) - srow[tgt]));
  const float w = grad_scale * mask[row];
  const float inv = static_cast<float>(1.0 / se);
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float p = expf(srow[i] - gmax) * inv;
    stf(dlogits + row * V + i, w * (p - (i == tgt ? 1.f : 0.f)));
  }
}

// The training cross-entropy on bf16 logits (the head GEMM's bf16 output), one row per
// block of kCeRegThreads threads with the row held in registers (VPT 16-byte groups of 8
// logits per thread): one read of the logits and one write of bf16 dlogits, in place
// allowed (every read of the row precedes the block barrier before the writes). Max by
// a block reduction; Σ exp in float per thread (exp2 of a pre-scaled argument), then in
// double across the block in a fixed order: deterministic. V % 8 == 0, rows 16-byte aligned.
constexpr int kCeRegThreads = 512;
template <int VPT>
__global__ void __launch_bounds__(kCeRegThreads, VPT <= 8 ? 2 : 1) ce_fused_bf16_rows(const bf16* logits, const int* targets,
                                                                    const float* mask, float* losses, float grad_scale,
                                                                    bf16* dlogits, int64_t V) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int64_t row = blockIdx.x;
  const uint4* lr = reinterpret_cast<const uint4*>(logits + row * V);
  const int v8 = static_cast<int>(V / 8);
  uint4 buf[VPT];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = threadIdx.x + k * kCeRegThreads;
    if (i < v8) {
      buf[k] = lr[i];
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&buf[k]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(h[e]);
        m = fmaxf(m, fmaxf(f.x, f.y));
      }
    }
  }
  const float gmax = block_max(m);
  const float mscaled = gmax * kLog2e;
  // exp(x − max) once per logit: summed in float, and kept (rounded to bf16, in place of the
  // logit) for the output pass — the output is bf16 anyway, and one exp per logit instead
  // of two halves the MUFU work, which bounds this kernel next to its memory traffic.
  float se = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = threadIdx.x + k * kCeRegThreads;
    if (i < v8) {
      __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&buf[k]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(h[e]);
        const float a = exp2f(fmaf(f.x, kLog2e, -mscaled)), b = exp2f(fmaf(f.y, kLog2e, -mscaled));
        se += a + b;
        h[e] = __floats2bfloat162_rn(a, b);
      }
    }
  }
  const double sed = block_sum_d(se);  // its barriers also end every read of the row
  const int tgt = targets[row];
  if (threadIdx.x == 0) {
    const float xt = __bfloat162float(logits[row * V + tgt]);
    losses[row] = static_cast<float>(mask[row] * (gmax + log(sed) - xt));
  }
  __syncthreads();  // the target logit is read before any thread overwrites the row
  const float w = grad_scale * mask[row];
  const float inv = static_cast<float>(1.0 / sed);
  uint4* dl = reinterpret_cast<uint4*>(dlogits + row * V);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = threadIdx.x + k * kCeRegThreads;
    if (i < v8) {
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&buf[k]);
      float o[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(h[e]);  // exp(x − max)
        o[2 * e] = w * (f.x * inv - (8 * i + 2 * e == tgt ? 1.f : 0.f));
        o[2 * e + 1] = w * (f.y * inv - (8 * i + 2 * e + 1 == tgt ? 1.f : 0.f));
      }
      store8(reinterpret_cast<bf16*>(dl + i), o);
    }
  }
}

}  // namespace

namespace {
// The n per-row losses summed in a fixed order on the host (N floats is small next to N·V
// logits), so the loss is the same bits run to run.
double host_sum(Backend& be, const Tensor& losses, int64_t n) {
  std::vector<float> host(static_cast<std::size_t>(n));
  be.download(losses, host.data());
  double total = 0;
  for (float l : host) total += l;
  return total;
}
}  // namespace

double CudaBackend::cross_entropy_fwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                      const Tensor& losses, const Tensor& argmax) {
  OpTimer timer(*this, "cross-entropy");
  require_act(logits, "cross-entropy logits");
  int64_t n = logits.rows(), V = logits.last();
  int* am = argmax.empty() ? nullptr : argmax.ptr<int>();
  if (is_bf16(logits))
    ce_fwd_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(logits.ptr<bf16>(), targets.ptr<int>(),
                                                                 mask.ptr<float>(), losses.ptr<float>(), am, V);
  else
    ce_fwd_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(logits.ptr<float>(), targets.ptr<int>(),
                                                                 mask.ptr<float>(), losses.ptr<float>(), am, V);
  LAR_CUDA_LAUNCHED();
  return host_sum(*this, losses, n);
}

namespace {
template <class TL, class TD>
void ce_bwd_launch(const Tensor& logits, const Tensor& targets, const Tensor& mask, float grad_scale,
                   const Tensor& dlogits, cudaStream_t st) {
  ce_bwd_kernel<<<static_cast<unsigned>(logits.rows()), 256, 0, st>>>(
      logits.ptr<TL>(), targets.ptr<int>(), mask.ptr<float>(), grad_scale, dlogits.ptr<TD>(), logits.last());
}
template <class TL, class TD>
void ce_fused_launch(const Tensor& logits, const Tensor& targets, const Tensor& mask, const Tensor& losses,
                     float grad_scale, const Tensor& dlogits, std::size_t smem, cudaStream_t st) {
  LAR_CUDA_CHECK(cudaFuncSetAttribute(ce_fused_kernel<TL, TD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  ce_fused_kernel<<<static_cast<unsigned>(logits.rows()), kCeFusedThreads, smem, st>>>(
      logits.ptr<TL>(), targets.ptr<int>(), mask.ptr<float>(), losses.ptr<float>(), grad_scale, dlogits.ptr<TD>(),
      logits.last());
}
template <int VPT>
void ce_rows_launch(const Tensor& logits, const Tensor& targets, const Tensor& mask, const Tensor& losses,
                    float grad_scale, const Tensor& dlogits, cudaStream_t st) {
  ce_fused_bf16_rows<VPT><<<static_cast<unsigned>(logits.rows()), kCeRegThreads, 0, st>>>(
      logits.ptr<bf16>(), targets.ptr<int>(), mask.ptr<float>(), losses.ptr<float>(), grad_scale, dlogits.ptr<bf16>(),
      logits.last());
}
}  // namespace

void CudaBackend::cross_entropy_bwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                    double grad_scale, const Tensor& dlogits) {
  OpTimer timer(*this, "cross-entropy");
  require_act(logits, "cross-entropy logits");
  require_act(dlogits, "cross-entropy dlogits");
  if (dlogits.data == logits.data && dlogits.dtype != logits.dtype)
    throw RuntimeError("cuda cross_entropy_bwd: dlogits may alias the logits only in their dtype");
  touch(dlogits);
  const float gs = static_cast<float>(grad_scale);
  if (is_bf16(logits))
    is_bf16(dlogits) ? ce_bwd_launch<bf16, bf16>(logits, targets, mask, gs, dlogits, stream_)
                     : ce_bwd_launch<bf16, float>(logits, targets, mask, gs, dlogits, stream_);
  else
    is_bf16(dlogits) ? ce_bwd_launch<float, bf16>(logits, targets, mask, gs, dlogits, stream_)
                     : ce_bwd_launch<float, float>(logits, targets, mask, gs, dlogits, stream_);
  LAR_CUDA_LAUNCHED();
}

double CudaBackend::cross_entropy_fwd_bwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                          const Tensor& losses, double grad_scale, const Tensor& dlogits) {
  require_act(logits, "cross-entropy logits");
  require_act(dlogits, "cross-entropy dlogits");
  const int64_t n = logits.rows(), V = logits.last();
  const float gs = static_cast<float>(grad_scale);
  const bool alias = dlogits.data == logits.data;
  // bf16 logits, V % 8 == 0: the row in registers (≤ 16 groups of 8 per thread, V ≤ 65536).
  const int64_t groups = (V / 8 + kCeRegThreads - 1) / kCeRegThreads;
  if (is_bf16(logits) && is_bf16(dlogits) && V % 8 == 0 && groups <= 16 && aligned16(logits) && aligned16(dlogits) &&
      (alias || static_cast<const char*>(dlogits.data) >= static_cast<const char*>(logits.data) + logits.bytes() ||
       static_cast<const char*>(logits.data) >= static_cast<const char*>(dlogits.data) + dlogits.bytes())) {
    OpTimer timer(*this, "cross-entropy");
    touch(dlogits);
    if (groups <= 2) ce_rows_launch<2>(logits, targets, mask, losses, gs, dlogits, stream_);
    else if (groups <= 4) ce_rows_launch<4>(logits, targets, mask, losses, gs, dlogits, stream_);
    else if (groups <= 8) ce_rows_launch<8>(logits, targets, mask, losses, gs, dlogits, stream_);
    else ce_rows_launch<16>(logits, targets, mask, losses, gs, dlogits, stream_);
    LAR_CUDA_LAUNCHED();
    return host_sum(*this, losses, n);
  }
  const std::size_t smem = static_cast<std::size_t>(V) * sizeof(float);
  // The row must fit in shared memory (V ≤ 40960); in place only in one dtype (the row is
  // staged before any write, but a bf16 dlogits over f32 logits would overlap other rows).
  if (smem > 160 * 1024 || (alias && dlogits.dtype != logits.dtype))
    return Backend::cross_entropy_fwd_bwd(logits, targets, mask, losses, grad_scale, dlogits);
  {
    OpTimer timer(*this, "cross-entropy");
    touch(dlogits);
    if (is_bf16(logits))
      is_bf16(dlogits) ? ce_fused_launch<bf16, bf16>(logits, targets, mask, losses, gs, dlogits, smem, stream_)
                       : ce_fused_launch<bf16, float>(logits, targets, mask, losses, gs, dlogits, smem, stream_);
    else
      is_bf16(dlogits) ? ce_fused_launch<float, bf16>(logits, targets, mask, losses, gs, dlogits, smem, stream_)
                       : ce_fused_launch<float, float>(logits, targets, mask, losses, gs, dlogits, smem, stream_);
    LAR_CUDA_LAUNCHED();
  }
  return host_sum(*this, losses, n);
}

}  // namespace lar::kernels::cuda
