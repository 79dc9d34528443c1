// The CUDA backend's causal attention ops: the fp32 reference kernels (one warp per query
// row), the bf16 flash kernels over fp32 tensors in mixed precision (attention/flash_attention)
// and cuDNN's fused attention where it applies (attention/cudnn_attention), and the dispatch
// between them (cuda.attention).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/env.hpp"
#include "kernels/attention/cudnn_attention.hpp"
#include "kernels/attention/flash_attention.hpp"
#include "kernels/cuda/backend_device.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_backend_internal.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda {

namespace {

// ---------------------------------------------------------------- attention
struct AttnShape {
  int64_t B, T, S, Hq, Hkv, D, Dv;
  float scale;
  int64_t window;
};

__device__ inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 ? (pos - window + 1 > 0 ? pos - window + 1 : 0) : 0;
}

// One warp per (b, t, h): online softmax over the visible keys.
__global__ void attention_fwd_kernel(const float* q, const float* k, const float* v, float* o, float* lse,
                                     AttnShape s) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / kWarp;
  int lane = threadIdx.x % kWarp;
  if (warp >= s.B * s.T * s.Hq) return;
  int64_t h = warp % s.Hq, t = (warp / s.Hq) % s.T, b = warp / (s.Hq * s.T);
  int64_t hk = h / (s.Hq / s.Hkv);
  int64_t pos = t + (s.S - s.T);
  const float* qr = q + ((b * s.T + t) * s.Hq + h) * s.D;
  float qv[kPerLane], acc[kPerLane];
  for (int i = 0; i < kPerLane; ++i) {
    int64_t d = lane + i * kWarp;
    qv[i] = d < s.D ? qr[d] : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int64_t j = first_key(pos, s.window); j <= pos; ++j) {
    const float* kr = k + ((b * s.S + j) * s.Hkv + hk) * s.D;
    const float* vr = v + ((b * s.S + j) * s.Hkv + hk) * s.Dv;
    float part = 0.f;
    for (int i = 0; i < kPerLane; ++i) {
      int64_t d = lane + i * kWarp;
      if (d < s.D) part += qv[i] * kr[d];
    }
    float sc = warp_sum(part) * s.scale;
    float m_new = fmaxf(m, sc);
    float corr = expf(m - m_new), p = expf(sc - m_new);
    l = l * corr + p;
    for (int i = 0; i < kPerLane; ++i) {
      int64_t d = lane + i * kWarp;
      acc[i] = acc[i] * corr + (d < s.Dv ? p * vr[d] : 0.f);
    }
    m = m_new;
  }
  float* orow = o + ((b * s.T + t) * s.Hq + h) * s.Dv;
  for (int i = 0; i < kPerLane; ++i) {
    int64_t d = lane + i * kWarp;
    if (d < s.Dv) orow[d] = acc[i] / l;
  }
  if (lane == 0) lse[(b * s.Hq + h) * s.T + t] = m + logf(l);
}

// delta[b,h,t] = dO·O of the row.
__global__ void attention_delta_kernel(const float* o, const float* dout, float* delta, AttnShape s) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / kWarp;
  int lane = threadIdx.x % kWarp;
  if (warp >= s.B * s.T * s.Hq) return;
  int64_t h = warp % s.Hq, t = (warp / s.Hq) % s.T, b = warp / (s.Hq * s.T);
  const float* orow = o + ((b * s.T + t) * s.Hq + h) * s.Dv;
  const float* drow = dout + ((b * s.T + t) * s.Hq + h) * s.Dv;
  float part = 0.f;
  for (int64_t d = lane; d < s.Dv; d += kWarp) part += orow[d] * drow[d];
  part = warp_sum(part);
  if (lane == 0) delta[(b * s.Hq + h) * s.T + t] = part;
}

__device__ inline float row_dot(const float* a, const float* b, int64_t n, int lane) {
  float part = 0.f;
  for (int64_t d = lane; d < n; d += kWarp) part += a[d] * b[d];
  return warp_sum(part);
}

// dq: one warp per query row, over its visible keys.
__global__ void attention_dq_kernel(const float* q, const float* k, const float* v, const float* lse,
                                    const float* delta, const float* dout, float* dq, AttnShape s) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / kWarp;
  int lane = threadIdx.x % kWarp;
  if (warp >= s.B * s.T * s.Hq) return;
  int64_t h = warp % s.Hq, t = (warp / s.Hq) % s.T, b = warp / (s.Hq * s.T);
  int64_t hk = h / (s.Hq / s.Hkv);
  int64_t pos = t + (s.S - s.T);
  const float* qr = q + ((b * s.T + t) * s.Hq + h) * s.D;
  const float* dor = dout + ((b * s.T + t) * s.Hq + h) * s.Dv;
  float L = lse[(b * s.Hq + h) * s.T + t], dl = delta[(b * s.Hq + h) * s.T + t];
  float acc[kPerLane];
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
  for (int64_t j = first_key(pos, s.window); j <= pos; ++j) {
    const float* kr = k + ((b * s.S + j) * s.Hkv + hk) * s.D;
    const float* vr = v + ((b * s.S + j) * s.Hkv + hk) * s.Dv;
    float p = expf(row_dot(qr, kr, s.D, lane) * s.scale - L);
    float ds = p * (row_dot(dor, vr, s.Dv, lane) - dl);
    for (int i = 0; i < kPerLane; ++i) {
      int64_t d = lane + i * kWarp;
      if (d < s.D) acc[i] += ds * kr[d];
    }
  }
  float* dqr = dq + ((b * s.T + t) * s.Hq + h) * s.D;
  for (int i = 0; i < kPerLane; ++i) {
    int64_t d = lane + i * kWarp;
    if (d < s.D) dqr[d] = acc[i] * s.scale;
  }
}

// dk, dv: one warp per key row (b, j, kv head), over every query head of its group and
// every query that sees it — the sum runs in a fixed order, so no atomics are needed.
__global__ void attention_dkv_kernel(const float* q, const float* k, const float* v, const float* lse,
                                     const float* delta, const float* dout, float* dk, float* dv, AttnShape s) {
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / kWarp;
  int lane = threadIdx.x % kWarp;
  if (warp >= s.B * s.S * s.Hkv) return;
  int64_t hk = warp % s.Hkv, j = (warp / s.Hkv) % s.S, b = warp / (s.Hkv * s.S);
  int64_t group = s.Hq / s.Hkv;
  const float* kr = k + ((b * s.S + j) * s.Hkv + hk) * s.D;
  const float* vr = v + ((b * s.S + j) * s.Hkv + hk) * s.Dv;
  float ak[kPerLane], av[kPerLane];
  for (int i = 0; i < kPerLane; ++i) ak[i] = av[i] = 0.f;
  int64_t offset = s.S - s.T;
  // Queries that see key j: pos = t + offset ≥ j and pos − j < window.
  int64_t t_lo = j - offset > 0 ? j - offset : 0;
  int64_t t_hi = s.T - 1;
  if (s.window > 0 && j + s.window - 1 - offset < t_hi) t_hi = j + s.window - 1 - offset;
  for (int64_t g = 0; g < group; ++g) {
    int64_t h = hk * group + g;
    for (int64_t t = t_lo; t <= t_hi; ++t) {
      const float* qr = q + ((b * s.T + t) * s.Hq + h) * s.D;
      const float* dor = dout + ((b * s.T + t) * s.Hq + h) * s.Dv;
      float p = expf(row_dot(qr, kr, s.D, lane) * s.scale - lse[(b * s.Hq + h) * s.T + t]);
      float ds = p * (row_dot(dor, vr, s.Dv, lane) - delta[(b * s.Hq + h) * s.T + t]);
      for (int i = 0; i < kPerLane; ++i) {
        int64_t d = lane + i * kWarp;
        if (d < s.D) ak[i] += ds * qr[d];
        if (d < s.Dv) av[i] += p * dor[d];
      }
    }
  }
  float* dkr = dk + ((b * s.S + j) * s.Hkv + hk) * s.D;
  float* dvr = dv + ((b * s.S + j) * s.Hkv + hk) * s.Dv;
  for (int i = 0; i < kPerLane; ++i) {
    int64_t d = lane + i * kWarp;
    if (d < s.D) dkr[d] = ak[i] * s.scale;
    if (d < s.Dv) dvr[d] = av[i];
  }
}

}  // namespace

static AttnShape attn_shape(const Tensor& q, const Tensor& k, const Tensor& v, double scale, int64_t window) {
  AttnShape s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3),
              static_cast<float>(scale), window};
  if (s.D > kMaxHeadDim || s.Dv > kMaxHeadDim)
    throw RuntimeError("cuda attention: head dim > " + std::to_string(kMaxHeadDim));
  if (s.Hq % s.Hkv != 0) throw RuntimeError("cuda attention: Hq % Hkv != 0");
  return s;
}

// ---- bf16 flash attention over fp32 tensors (mixed precision) ----
// q, k, v (and dout) are rounded to bf16 in a scratch buffer, the flash kernels run, and
// their bf16 outputs widen back into the fp32 tensors. The forward's o is a widened bf16,
// so the backward's re-rounding of o gives the forward's bf16 o exactly.

namespace {
void to_bf16(const Tensor& x, __nv_bfloat16* y, cudaStream_t st) {
  launch_f32_to_bf16(x.ptr<float>(), y, x.numel(), blocks_for(x.numel(), 256), st);
}
void to_f32(const __nv_bfloat16* x, const Tensor& y, cudaStream_t st) {
  launch_bf16_to_f32(x, y.ptr<float>(), y.numel(), blocks_for(y.numel(), 256), st);
}
attention::FlashShape flash_shape(const Tensor& q, const Tensor& k, double scale, int64_t window) {
  attention::FlashShape f;
  f.B = q.size(0), f.T = q.size(1), f.S = k.size(1), f.Hq = q.size(2), f.Hkv = k.size(2), f.D = q.size(3);
  f.scale = scale;
  f.window = window;
  return f;
}
std::size_t align256(std::size_t b) { return (b + 255) / 256 * 256; }
}  // namespace

bool CudaBackend::flash_ok(const Tensor& q, const Tensor& v) const {
  return mixed_ && attention::flash_attention_supports(q.size(3)) && v.size(3) == q.size(3);
}

void CudaBackend::flash_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                            double scale, int64_t window) {
  using bf = __nv_bfloat16;
  const std::size_t nq = align256(q.numel() * 2), nk = align256(k.numel() * 2);
  char* base = static_cast<char*>(scratch_bytes(2 * nq + 2 * nk));
  bf* qb = reinterpret_cast<bf*>(base);
  bf* kb = reinterpret_cast<bf*>(base + nq);
  bf* vb = reinterpret_cast<bf*>(base + nq + nk);
  bf* ob = reinterpret_cast<bf*>(base + nq + 2 * nk);
  to_bf16(q, qb, stream_);
  to_bf16(k, kb, stream_);
  to_bf16(v, vb, stream_);
  attention::flash_attention_fwd(flash_shape(q, k, scale, window), qb, kb, vb, ob, lse.ptr<float>(), stream_);
  to_f32(ob, o, stream_);
}

void CudaBackend::flash_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                            const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv, double scale,
                            int64_t window) {
  using bf = __nv_bfloat16;
  const attention::FlashShape fs = flash_shape(q, k, scale, window);
  const std::size_t nq = align256(q.numel() * 2), nk = align256(k.numel() * 2);
  const std::size_t ws = align256(attention::flash_attention_bwd_workspace_bytes(fs));
  char* base = static_cast<char*>(scratch_bytes(4 * nq + 4 * nk + ws));
  bf* qb = reinterpret_cast<bf*>(base);
  bf* ob = reinterpret_cast<bf*>(base + nq);
  bf* dob = reinterpret_cast<bf*>(base + 2 * nq);
  bf* dqb = reinterpret_cast<bf*>(base + 3 * nq);
  bf* kb = reinterpret_cast<bf*>(base + 4 * nq);
  bf* vb = reinterpret_cast<bf*>(base + 4 * nq + nk);
  bf* dkb = reinterpret_cast<bf*>(base + 4 * nq + 2 * nk);
  bf* dvb = reinterpret_cast<bf*>(base + 4 * nq + 3 * nk);
  void* work = base + 4 * nq + 4 * nk;
  to_bf16(q, qb, stream_);
  to_bf16(k, kb, stream_);
  to_bf16(v, vb, stream_);
  to_bf16(o, ob, stream_);
  to_bf16(dout, dob, stream_);
  attention::flash_attention_bwd(fs, qb, kb, vb, ob, lse.ptr<float>(), dob, dqb, dkb, dvb, work, stream_);
  to_f32(dqb, dq, stream_);
  to_f32(dkb, dk, stream_);
  to_f32(dvb, dv, stream_);
}

namespace {
// bf16 attention tensors: all of them bf16 (lse stays f32).
bool all_bf16(std::initializer_list<const Tensor*> ts) {
  int n = 0;
  for (const Tensor* t : ts) n += is_bf16(*t);
  if (n != 0 && n != static_cast<int>(ts.size()))
    throw RuntimeError("cuda attention: q, k, v, o (and dout, dq, dk, dv) must all be f32 or all bf16");
  return n != 0;
}
Tensor as_f32(const Tensor& t, char*& cursor) {
  Tensor f(cursor, DType::f32, t.shape());
  cursor += align256(f.bytes());
  return f;
}
}  // namespace

// cuDNN's fused attention for the bf16 shapes it covers (attention/cudnn_attention.hpp),
// unless deterministic (its backward accumulates dQ with atomics) or cuda.attention: flash.
// The forward and backward plans of a shape are built together, so both directions of a
// shape take the same path; were they ever to differ, the saved lse means the same in both
// (natural-log LSE of scale·q·kᵀ, [B, Hq, T]).
bool CudaBackend::attn_cudnn(const attention::FlashShape& fs) {
  const attention::AttentionMode mode = attention::attention_mode(options().cuda.attention);
  if (mode == attention::AttentionMode::flash || options().deterministic || !attention::cudnn_covers(fs)) return false;
  const bool forced = mode == attention::AttentionMode::cudnn;
  if (!cudnn_attn_) {
    if (!attention::cudnn_available()) {
      if (forced) throw RuntimeError("cuda.attention: cudnn: " + attention::cudnn_unavailable_reason());
      return false;
    }
    cudnn_attn_ = std::make_unique<attention::CudnnAttention>();
  }
  std::string why;
  if (cudnn_attn_->prepare(fs, &why)) return true;
  if (forced) throw RuntimeError("cuda.attention: cudnn: " + why);
  static bool warned = false;  // once per process: the flash kernels take over
  if (!warned) std::fprintf(stderr, "lar: cuDNN attention unavailable (%s); using the flash kernels\n", why.c_str());
  warned = true;
  return false;
}

void CudaBackend::attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                const Tensor& lse, double scale, int64_t window) {
  OpTimer timer(*this, "attention fwd");
  require_f32(lse, "attention lse");
  if (all_bf16({&q, &k, &v, &o})) {
    if (flash_ok(q, v)) {  // bf16 tensors straight into cuDNN or the flash kernel: no conversions
      const attention::FlashShape fs = flash_shape(q, k, scale, window);
      if (attn_cudnn(fs)) {
        void* work = scratch_bytes(cudnn_attn_->fwd_workspace_bytes(fs));
        cudnn_attn_->fwd(fs, q.ptr<bf16>(), k.ptr<bf16>(), v.ptr<bf16>(), o.ptr<bf16>(), lse.ptr<float>(), work,
                         stream_);
        attn_path_ = "cudnn";
        return;
      }
      attention::flash_attention_fwd(fs, q.ptr<bf16>(), k.ptr<bf16>(), v.ptr<bf16>(), o.ptr<bf16>(), lse.ptr<float>(),
                                     stream_);
      attn_path_ = "flash";
      return;
    }
    attn_path_ = "fp32";
    // Head dims the flash kernel lacks: widen, run the fp32 kernels, round o.
    char* cur = static_cast<char*>(
        scratch_bytes(align256(q.numel() * 4) + align256(o.numel() * 4) + align256(k.numel() * 4) + align256(v.numel() * 4)));
    Tensor qf = as_f32(q, cur), kf = as_f32(k, cur), vf = as_f32(v, cur), of = as_f32(o, cur);
    convert(q, qf), convert(k, kf), convert(v, vf);
    AttnShape s = attn_shape(qf, kf, vf, scale, window);
    attention_fwd_kernel<<<blocks_for(s.B * s.T * s.Hq * kWarp, 256), 256, 0, stream_>>>(
        qf.ptr<float>(), kf.ptr<float>(), vf.ptr<float>(), of.ptr<float>(), lse.ptr<float>(), s);
    LAR_CUDA_LAUNCHED();
    convert(of, o);
    return;
  }
  attn_path_ = flash_ok(q, v) ? "flash" : "fp32";
  if (flash_ok(q, v)) return flash_fwd(q, k, v, o, lse, scale, window);
  AttnShape s = attn_shape(q, k, v, scale, window);
  int64_t warps = s.B * s.T * s.Hq;
  attention_fwd_kernel<<<blocks_for(warps * kWarp, 256), 256, 0, stream_>>>(
      q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), o.ptr<float>(), lse.ptr<float>(), s);
  LAR_CUDA_LAUNCHED();
}

// The fp32 reference backward on f32 tensors.
static void attention_bwd_f32(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                              const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv, double scale,
                              int64_t window, cudaStream_t stream) {
  AttnShape s = attn_shape(q, k, v, scale, window);
  float* delta = nullptr;
  LAR_CUDA_CHECK(cudaMallocAsync(&delta, sizeof(float) * s.B * s.Hq * s.T, stream));
  int64_t qwarps = s.B * s.T * s.Hq, kwarps = s.B * s.S * s.Hkv;
  attention_delta_kernel<<<blocks_for(qwarps * kWarp, 256), 256, 0, stream>>>(o.ptr<float>(), dout.ptr<float>(),
                                                                              delta, s);
  LAR_CUDA_LAUNCHED();
  attention_dq_kernel<<<blocks_for(qwarps * kWarp, 256), 256, 0, stream>>>(
      q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), lse.ptr<float>(), delta, dout.ptr<float>(), dq.ptr<float>(), s);
  LAR_CUDA_LAUNCHED();
  attention_dkv_kernel<<<blocks_for(kwarps * kWarp, 256), 256, 0, stream>>>(
      q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), lse.ptr<float>(), delta, dout.ptr<float>(), dk.ptr<float>(),
      dv.ptr<float>(), s);
  LAR_CUDA_LAUNCHED();
  LAR_CUDA_CHECK(cudaFreeAsync(delta, stream));
}

void CudaBackend::attention_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                const Tensor& dv, double scale, int64_t window) {
  OpTimer timer(*this, "attention bwd");
  require_f32(lse, "attention lse");
  if (all_bf16({&q, &k, &v, &o, &dout, &dq, &dk, &dv})) {
    if (flash_ok(q, v)) {
      const attention::FlashShape fs = flash_shape(q, k, scale, window);
      if (attn_cudnn(fs)) {
        void* work = scratch_bytes(cudnn_attn_->bwd_workspace_bytes(fs));
        cudnn_attn_->bwd(fs, q.ptr<bf16>(), k.ptr<bf16>(), v.ptr<bf16>(), o.ptr<bf16>(), lse.ptr<float>(),
                         dout.ptr<bf16>(), dq.ptr<bf16>(), dk.ptr<bf16>(), dv.ptr<bf16>(), work, stream_);
        attn_path_ = "cudnn";
        return;
      }
      void* work = scratch_bytes(align256(attention::flash_attention_bwd_workspace_bytes(fs)));
      attention::flash_attention_bwd(fs, q.ptr<bf16>(), k.ptr<bf16>(), v.ptr<bf16>(), o.ptr<bf16>(), lse.ptr<float>(),
                                     dout.ptr<bf16>(), dq.ptr<bf16>(), dk.ptr<bf16>(), dv.ptr<bf16>(), work, stream_);
      attn_path_ = "flash";
      return;
    }
    attn_path_ = "fp32";
    const std::size_t nq = align256(q.numel() * 4), no = align256(o.numel() * 4), nk = align256(k.numel() * 4),
                      nv = align256(v.numel() * 4);
    char* cur = static_cast<char*>(scratch_bytes(2 * nq + 2 * no + 2 * nk + 2 * nv));
    Tensor qf = as_f32(q, cur), kf = as_f32(k, cur), vf = as_f32(v, cur), of = as_f32(o, cur);
    Tensor df = as_f32(dout, cur), dqf = as_f32(dq, cur), dkf = as_f32(dk, cur), dvf = as_f32(dv, cur);
    convert(q, qf), convert(k, kf), convert(v, vf), convert(o, of), convert(dout, df);
    attention_bwd_f32(qf, kf, vf, of, lse, df, dqf, dkf, dvf, scale, window, stream_);
    convert(dqf, dq), convert(dkf, dk), convert(dvf, dv);
    return;
  }
  attn_path_ = flash_ok(q, v) ? "flash" : "fp32";
  if (flash_ok(q, v)) return flash_bwd(q, k, v, o, lse, dout, dq, dk, dv, scale, window);
  attention_bwd_f32(q, k, v, o, lse, dout, dq, dk, dv, scale, window, stream_);
}

}  // namespace lar::kernels::cuda
