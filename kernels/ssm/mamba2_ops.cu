// The Mamba-2 layer's own elementwise and reduction passes: see mamba2_ops.hpp. All are
// memory-bound and simple: one thread per element for the maps, a warp per (token, head)
// for the gate backward's sums over the state and head channels, a block per (token, group)
// row for the gated RMSNorm. The conv's weight and bias gradients are summed per row split
// into partials and then over the splits in order (no atomics).
#include <cuda_bf16.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/linear/op_common.cuh"
#include "kernels/ssm/mamba2_ops.hpp"

namespace lar::kernels::cuda::linear {
namespace {

using op_common::blocks_for;
using op_common::from_f;
using op_common::to_f;
using op_common::warp_sum;

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;
constexpr int kMaxConv = 8;       // widest conv (the register window of the backward)
constexpr int kSplitRows = 256;   // rows per split of the conv's weight-gradient sums
constexpr int kMaxSplits = 1024;

__device__ __forceinline__ float sigm(float x) { return 1.f / (1.f + expf(-x)); }
// as the CPU's ssm::softplus
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float silu(float x) { return x * sigm(x); }
__device__ __forceinline__ float silu_grad(float x) {
  const float s = sigm(x);
  return s * (1.f + x * (1.f - s));
}
// Sum over the block (kThreads), the same order every call; every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();  // red may still be read by a previous call
  if (l == 0) red[w] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < kThreads / 32; ++i) s += red[i];
  return s;
}



void require(bool ok, const std::string& what) {
  if (!ok) throw RuntimeError("mamba2 ops: " + what);
}

// ---------------------------------------------------------------- conv + SiLU
template <class TP, class TO>
__global__ void conv_fwd_kernel(SsmConvArgs a, TO* out) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, N = a.B * a.T;
  if (idx >= N * a.C) return;
  const int64_t n = idx / a.C;
  const int c = static_cast<int>(idx % a.C);
  const int64_t t = n % a.T;
  const TP* p = static_cast<const TP*>(a.p);
  float s = a.bias[c];
  for (int i = 0; i < a.W; ++i) {
    const int64_t back = a.W - 1 - i;
    if (t >= back) s += a.w[c * a.W + i] * to_f(p[(n - back) * a.ldp + c]);
  }
  out[idx] = from_f<TO>(silu(s));
}

// gpre = da ⊙ silu'(s) and the per-split partial sums of ∂L/∂w, ∂L/∂bias: a thread per
// channel walks its split's rows in order.
template <class TP, class TD>
__global__ void conv_bwd_terms(SsmConvArgs a, const TD* da, float* gpre, float* partial, int64_t rows) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= a.C) return;
  const int64_t N = a.B * a.T, r0 = blockIdx.y * rows, r1 = std::min<int64_t>(N, r0 + rows);
  const TP* p = static_cast<const TP*>(a.p);
  float w[kMaxConv], acc[kMaxConv], accb = 0.f;
  for (int i = 0; i < kMaxConv; ++i) {
    w[i] = i < a.W ? a.w[c * a.W + i] : 0.f;
    acc[i] = 0.f;
  }
  for (int64_t n = r0; n < r1; ++n) {
    const int64_t t = n % a.T;
    float in[kMaxConv];
    float s = a.bias[c];
#pragma unroll
    for (int i = 0; i < kMaxConv; ++i) {
      const int64_t back = a.W - 1 - i;
      in[i] = (i < a.W && t >= back) ? to_f(p[(n - back) * a.ldp + c]) : 0.f;
      s += w[i] * in[i];
    }
    const float g = to_f(da[n * a.C + c]) * silu_grad(s);
    gpre[n * a.C + c] = g;
    accb += g;
#pragma unroll
    for (int i = 0; i < kMaxConv; ++i) acc[i] += g * in[i];
  }
  float* out = partial + ((int64_t)blockIdx.y * a.C + c) * (a.W + 1);
  for (int i = 0; i < a.W; ++i) out[i] = acc[i];
  out[a.W] = accb;
}

// dp[m, c] = Σ_i gpre[m + W − 1 − i, c]·w[c, i] over the outputs of the same sequence.
template <class TP>
__global__ void conv_bwd_input(SsmConvArgs a, const float* gpre, TP* dp) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, N = a.B * a.T;
  if (idx >= N * a.C) return;
  const int64_t m = idx / a.C;
  const int c = static_cast<int>(idx % a.C);
  const int64_t t = m % a.T;
  float s = 0.f;
  for (int i = 0; i < a.W; ++i) {
    const int64_t fwd = a.W - 1 - i;
    if (t + fwd < a.T) s += gpre[(m + fwd) * a.C + c] * a.w[c * a.W + i];
  }
  dp[m * a.ldp + c] = from_f<TP>(s);
}

__global__ void conv_bwd_finish(const float* partial, int splits, int C, int W, float* dw, float* dbias) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= C * (W + 1)) return;
  const int c = idx / (W + 1), j = idx % (W + 1);
  float s = 0.f;
  for (int sp = 0; sp < splits; ++sp) s += partial[((int64_t)sp * C + c) * (W + 1) + j];
  if (j < W) dw[c * W + j] += s;
  else dbias[c] += s;
}

int64_t split_rows(int64_t N) { return std::max<int64_t>(kSplitRows, (N + kMaxSplits - 1) / kMaxSplits); }

void check_conv(const SsmConvArgs& a) {
  require(a.B > 0 && a.T > 0 && a.C > 0, "conv: empty shape B=" + std::to_string(a.B) + " T=" + std::to_string(a.T) +
                                             " C=" + std::to_string(a.C));
  require(a.W >= 1 && a.W <= kMaxConv, "conv: width " + std::to_string(a.W) + " (1 to 8)");
  require(a.ldp >= a.C, "conv: row stride " + std::to_string(a.ldp) + " below " + std::to_string(a.C) + " channels");
  require(a.p && a.w && a.bias, "conv: null input");
}

// ---------------------------------------------------------------- gates
__global__ void gates_value_kernel(Mamba2GateArgs a, bf16* v) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, HP = (int64_t)a.H * a.P;
  if (idx >= a.N * HP) return;
  const int64_t n = idx / HP;
  const int h = static_cast<int>((idx % HP) / a.P);
  const float dt = softplus(a.pdt[n * a.H + h] + a.dt_bias[h]);
  v[idx] = __float2bfloat16(dt * a.x[idx]);
}

__global__ void gates_gate_kernel(Mamba2GateArgs a, float* g) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, HS = (int64_t)a.H * a.S;
  if (idx >= a.N * HS) return;
  const int64_t n = idx / HS;
  const int h = static_cast<int>((idx % HS) / a.S);
  g[idx] = -expf(a.A_log[h]) * softplus(a.pdt[n * a.H + h] + a.dt_bias[h]);
}

__global__ void gates_bwd_kernel(Mamba2GateArgs a, const bf16* dv, const float* dg, float* dx, float* ddt,
                                 float* aterm) {
  const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // (token, head)
  const int lane = threadIdx.x & 31;
  if (row >= a.N * a.H) return;
  const int64_t n = row / a.H;
  const int h = static_cast<int>(row % a.H);
  const float pre = a.pdt[row] + a.dt_bias[h], dt = softplus(pre), A = expf(a.A_log[h]);
  const float* dgr = dg + n * a.H * (int64_t)a.S + (int64_t)h * a.S;
  float sg = 0.f;
  for (int i = lane; i < a.S; i += 32) sg += dgr[i];
  const int64_t off = n * a.H * (int64_t)a.P + (int64_t)h * a.P;
  float sv = 0.f;
  for (int p = lane; p < a.P; p += 32) {
    const float d = __bfloat162float(dv[off + p]);
    sv += d * a.x[off + p];
    dx[off + p] += dt * d;
  }
  sg = warp_sum(sg);
  sv = warp_sum(sv);
  if (lane == 0) {
    ddt[row] = (sv - sg * A) * sigm(pre);
    aterm[row] = sg * (-A * dt);
  }
}

// ---------------------------------------------------------------- output
template <class TA>
__global__ void out_fwd_kernel(Mamba2OutArgs a, TA* ypre, float* rstd) {
  __shared__ float red[kThreads / 32];
  const int Di = a.H * a.P, gs = Di / a.G;
  const int64_t n = blockIdx.x / a.G;
  const int c0 = static_cast<int>(blockIdx.x % a.G) * gs;
  const TA* z = static_cast<const TA*>(a.z) + n * a.ldz;
  const int64_t row = n * Di;
  auto yg_at = [&](int c) {
    const float y = __bfloat162float(a.o[row + c]) + a.D[c / a.P] * a.x[row + c];
    return y * silu(to_f(z[c]));
  };
  float ss = 0.f;
  for (int c = c0 + threadIdx.x; c < c0 + gs; c += kThreads) {
    const float v = yg_at(c);
    ss += v * v;
  }
  ss = block_sum(ss, red);
  const float rs = 1.f / sqrtf(ss / gs + a.eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
  for (int c = c0 + threadIdx.x; c < c0 + gs; c += kThreads) ypre[row + c] = from_f<TA>(yg_at(c) * rs * a.wn[c]);
}

template <class TA>
__global__ void out_bwd_kernel(Mamba2OutArgs a, const float* rstd, const TA* dypre, bf16* dO, TA* dz, float* dx,
                               float* wterm, float* dterm, TA* ypre) {
  __shared__ float red[kThreads / 32];
  const int Di = a.H * a.P, gs = Di / a.G;
  const int64_t n = blockIdx.x / a.G;
  const int c0 = static_cast<int>(blockIdx.x % a.G) * gs;
  const TA* z = static_cast<const TA*>(a.z) + n * a.ldz;
  const int64_t row = n * Di;
  const float rs = rstd[blockIdx.x];
  float dot = 0.f;
  for (int c = c0 + threadIdx.x; c < c0 + gs; c += kThreads) {
    const float y = __bfloat162float(a.o[row + c]) + a.D[c / a.P] * a.x[row + c];
    dot += to_f(dypre[row + c]) * a.wn[c] * y * silu(to_f(z[c]));
  }
  dot = block_sum(dot, red);
  const float k = rs * rs * rs * dot / gs;
  for (int c = c0 + threadIdx.x; c < c0 + gs; c += kThreads) {
    const float xv = a.x[row + c], Dh = a.D[c / a.P];
    const float y = __bfloat162float(a.o[row + c]) + Dh * xv;
    const float zz = to_f(z[c]), sz = silu(zz), yg = y * sz;
    const float dyn = to_f(dypre[row + c]), w = a.wn[c];
    const float dyg = rs * dyn * w - yg * k;
    const float dy = dyg * sz;
    wterm[row + c] = dyn * yg * rs;
    dO[row + c] = __float2bfloat16(dy);
    dz[n * a.ldz + c] = from_f<TA>(dyg * y * silu_grad(zz));
    dx[row + c] = Dh * dy;
    dterm[row + c] = dy * xv;
    if (ypre) ypre[row + c] = from_f<TA>(yg * rs * w);
  }
}

void check_out(const Mamba2OutArgs& a) {
  require(a.N > 0 && a.H > 0 && a.P > 0 && a.G > 0, "out: empty shape");
  require((a.H * a.P) % a.G == 0, "out: " + std::to_string(a.G) + " groups do not divide " +
                                      std::to_string(a.H * a.P) + " channels");
  require(a.ldz >= a.H * a.P, "out: z's row stride " + std::to_string(a.ldz) + " below the width");
  require(a.o && a.x && a.D && a.z && a.wn, "out: null input");
}

}  // namespace

void ssm_conv_silu_forward(const SsmConvArgs& a, void* out, bool out_bf16, cudaStream_t stream) {
  check_conv(a);
  const int64_t n = a.B * a.T * a.C;
  const unsigned blocks = blocks_for(n, kThreads);
  if (a.p_bf16) {
    if (out_bf16) conv_fwd_kernel<bf16, bf16><<<blocks, kThreads, 0, stream>>>(a, static_cast<bf16*>(out));
    else conv_fwd_kernel<bf16, float><<<blocks, kThreads, 0, stream>>>(a, static_cast<float*>(out));
  } else {
    if (out_bf16) conv_fwd_kernel<float, bf16><<<blocks, kThreads, 0, stream>>>(a, static_cast<bf16*>(out));
    else conv_fwd_kernel<float, float><<<blocks, kThreads, 0, stream>>>(a, static_cast<float*>(out));
  }
  LAR_CUDA_LAUNCHED();
}

std::size_t ssm_conv_silu_backward_scratch_floats(const SsmConvArgs& a) {
  const int64_t N = a.B * a.T, rows = split_rows(N), splits = (N + rows - 1) / rows;
  return static_cast<std::size_t>(N * a.C + splits * a.C * (a.W + 1));
}

void ssm_conv_silu_backward(const SsmConvArgs& a, const void* da, bool da_bf16, void* dp, float* dw, float* dbias,
                            float* scratch, cudaStream_t stream) {
  check_conv(a);
  require(da && dp && dw && dbias && scratch, "conv backward: null argument");
  const int64_t N = a.B * a.T, rows = split_rows(N), splits = (N + rows - 1) / rows;
  float* gpre = scratch;
  float* partial = scratch + N * a.C;
  const dim3 tg(blocks_for(a.C, 128), static_cast<unsigned>(splits));
  if (a.p_bf16) {
    if (da_bf16) conv_bwd_terms<bf16, bf16><<<tg, 128, 0, stream>>>(a, static_cast<const bf16*>(da), gpre, partial, rows);
    else conv_bwd_terms<bf16, float><<<tg, 128, 0, stream>>>(a, static_cast<const float*>(da), gpre, partial, rows);
  } else {
    if (da_bf16) conv_bwd_terms<float, bf16><<<tg, 128, 0, stream>>>(a, static_cast<const bf16*>(da), gpre, partial, rows);
    else conv_bwd_terms<float, float><<<tg, 128, 0, stream>>>(a, static_cast<const float*>(da), gpre, partial, rows);
  }
  LAR_CUDA_LAUNCHED();
  const unsigned blocks = blocks_for(N * a.C, kThreads);
  if (a.p_bf16) conv_bwd_input<bf16><<<blocks, kThreads, 0, stream>>>(a, gpre, static_cast<bf16*>(dp));
  else conv_bwd_input<float><<<blocks, kThreads, 0, stream>>>(a, gpre, static_cast<float*>(dp));
  LAR_CUDA_LAUNCHED();
  conv_bwd_finish<<<blocks_for((int64_t)a.C * (a.W + 1), kThreads), kThreads, 0, stream>>>(
      partial, static_cast<int>(splits), a.C, a.W, dw, dbias);
  LAR_CUDA_LAUNCHED();
}

void mamba2_gates_forward(const Mamba2GateArgs& a, bf16* v, float* g, cudaStream_t stream) {
  require(a.N > 0 && a.H > 0 && a.P > 0 && a.S > 0, "gates: empty shape");
  require(a.pdt && a.dt_bias && a.A_log && a.x && v && g, "gates: null argument");
  gates_value_kernel<<<blocks_for(a.N * a.H * a.P, kThreads), kThreads, 0, stream>>>(a, v);
  LAR_CUDA_LAUNCHED();
  gates_gate_kernel<<<blocks_for(a.N * a.H * a.S, kThreads), kThreads, 0, stream>>>(a, g);
  LAR_CUDA_LAUNCHED();
}

void mamba2_gates_backward(const Mamba2GateArgs& a, const bf16* dv, const float* dg, float* dx, float* ddt,
                           float* aterm, cudaStream_t stream) {
  require(a.N > 0 && a.H > 0 && a.P > 0 && a.S > 0, "gates backward: empty shape");
  require(dv && dg && dx && ddt && aterm, "gates backward: null argument");
  gates_bwd_kernel<<<blocks_for(a.N * a.H * 32, kThreads), kThreads, 0, stream>>>(a, dv, dg, dx, ddt, aterm);
  LAR_CUDA_LAUNCHED();
}

void mamba2_out_forward(const Mamba2OutArgs& a, void* ypre, float* rstd, cudaStream_t stream) {
  check_out(a);
  require(ypre && rstd, "out: null output");
  const unsigned blocks = static_cast<unsigned>(a.N * a.G);
  if (a.act_bf16) out_fwd_kernel<bf16><<<blocks, kThreads, 0, stream>>>(a, static_cast<bf16*>(ypre), rstd);
  else out_fwd_kernel<float><<<blocks, kThreads, 0, stream>>>(a, static_cast<float*>(ypre), rstd);
  LAR_CUDA_LAUNCHED();
}

void mamba2_out_backward(const Mamba2OutArgs& a, const float* rstd, const void* dypre, bf16* dO, void* dz, float* dx,
                         float* wterm, float* dterm, void* ypre, cudaStream_t stream) {
  check_out(a);
  require(rstd && dypre && dO && dz && dx && wterm && dterm, "out backward: null argument");
  const unsigned blocks = static_cast<unsigned>(a.N * a.G);
  if (a.act_bf16)
    out_bwd_kernel<bf16><<<blocks, kThreads, 0, stream>>>(a, rstd, static_cast<const bf16*>(dypre), dO,
                                                          static_cast<bf16*>(dz), dx, wterm, dterm,
                                                          static_cast<bf16*>(ypre));
  else
    out_bwd_kernel<float><<<blocks, kThreads, 0, stream>>>(a, rstd, static_cast<const float*>(dypre), dO,
                                                           static_cast<float*>(dz), dx, wterm, dterm,
                                                           static_cast<float*>(ypre));
  LAR_CUDA_LAUNCHED();
}

}  // namespace lar::kernels::cuda::linear
