#pragma once
// Recurrent single-token decode of the channel-gated mixers (gla, kda, gdn2) and CARVE: the
// kernel and its checks, shared by channel_decode.cu and kernels/carve/carve_decode.cu. See
// channel_rule.hpp and kernels/carve/carve_cuda.hpp for the contract and kernels/linear/core.hpp
// for the recurrence:
//   a = exp(g),  u = z − S (a ⊙ e),  S ← S D(a) + u kᵀ,  o = scale S q.
// One CTA of 256 threads per (b, h); thread (row v = tid/4, part = tid%4) keeps 16 state
// entries S[v][16·part..16·part+15] in registers (four float4 loads, one pass over the
// state in and out), the two row dot products reduce over the quad.
#include <cuda_bf16.h>

#include <string>

#include "kernels/channel_rule/channel_rule.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda::linear {
namespace {

using bf16 = __nv_bfloat16;
constexpr int D = 64, NT = 256;
constexpr unsigned FULL = 0xffffffffu;
enum DecMode { dGla = 0, dKda = 1, dGdn2 = 2, dCarve = 3 };

struct DecParams {
  const bf16 *q, *k, *v, *bg, *wg, *bx;
  const float *g, *beta, *wsc, *U1, *U2;
  float *S, *content;
  bf16* o;
  int H, rank, pos;
  float scale;
};

template <int MODE>
__global__ void __launch_bounds__(NT) cdecode_kernel(const DecParams p) {
  __shared__ float sq[D], sk[D], se[D], sa[D], sz[D], sM[D], sU[D], sH[32];
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const size_t bh = static_cast<size_t>(b) * p.H + h, base = bh * D;
  if (MODE == dCarve) {
    if (tid < D) sM[tid] = p.content[bh * 2 * D + tid];
    __syncthreads();
    {  // h = tanh(U1 m): thread (r = tid/8, part) sums 8 products
      const int r = tid >> 3, part = tid & 7;
      float s = 0.f;
      if (r < p.rank)
#pragma unroll
        for (int j = 0; j < 8; ++j) s += p.U1[(static_cast<size_t>(h) * p.rank + r) * D + 8 * part + j] * sM[8 * part + j];
      s += __shfl_xor_sync(FULL, s, 1);
      s += __shfl_xor_sync(FULL, s, 2);
      s += __shfl_xor_sync(FULL, s, 4);
      if (part == 0 && r < p.rank) sH[r] = tanhf(s);
    }
    __syncthreads();
    {  // u = U2 h: thread (c = tid/4, part) sums ranks 8·part..
      const int c = tid >> 2, part = tid & 3;
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (8 * part + j < p.rank) s += p.U2[(static_cast<size_t>(h) * D + c) * p.rank + 8 * part + j] * sH[8 * part + j];
      s += __shfl_xor_sync(FULL, s, 1);
      s += __shfl_xor_sync(FULL, s, 2);
      if (part == 0) sU[c] = s;
    }
    __syncthreads();
  }
  if (tid < D) {
    const float kv = __bfloat162float(p.k[base + tid]), vv = __bfloat162float(p.v[base + tid]);
    sq[tid] = __bfloat162float(p.q[base + tid]);
    sk[tid] = kv;
    sa[tid] = __expf(p.g[base + tid]);
    float e = 0.f, z = vv;
    if (MODE == dKda) e = p.beta[bh] * kv, z = p.beta[bh] * vv;
    if (MODE == dGdn2) e = __bfloat162float(p.bg[base + tid]) * kv, z = __bfloat162float(p.wg[base + tid]) * vv;
    if (MODE == dCarve) {
      e = kv / (1.f + __expf(-(__bfloat162float(p.bx[base + tid]) + sU[tid])));
      z = p.wsc[bh] * vv;
    }
    se[tid] = e, sz[tid] = z;
  }
  __syncthreads();
  const int v = tid >> 2, part = tid & 3;
  float4* Srow = reinterpret_cast<float4*>(p.S + bh * D * D + static_cast<size_t>(v) * D + 16 * part);
  float s[16];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 x = Srow[i];
    s[4 * i] = x.x, s[4 * i + 1] = x.y, s[4 * i + 2] = x.z, s[4 * i + 3] = x.w;
  }
  float dot = 0.f;
  if (MODE != dGla) {
#pragma unroll
    for (int i = 0; i < 16; ++i) dot += s[i] * sa[16 * part + i] * se[16 * part + i];
    dot += __shfl_xor_sync(FULL, dot, 1);
    dot += __shfl_xor_sync(FULL, dot, 2);
  }
  const float u = sz[v] - dot;
  float o = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = 16 * part + i;
    s[i] = s[i] * sa[c] + u * sk[c];
    o += s[i] * sq[c];
  }
  o += __shfl_xor_sync(FULL, o, 1);
  o += __shfl_xor_sync(FULL, o, 2);
#pragma unroll
  for (int i = 0; i < 4; ++i) Srow[i] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
  if (part == 0) {
    o *= p.scale;
    p.o[base + v] = __float2bfloat16(o);
    if (MODE == dCarve) {  // running output sum of the content chunk; at its end it becomes m
      float* cs = p.content + bh * 2 * D;
      const float sum = cs[D + v] + o;
      if (p.pos == 63) {
        cs[v] = sum * (1.f / 64.f);
        cs[D + v] = 0.f;
      } else {
        cs[D + v] = sum;
      }
    }
  }
}

DecParams make_dec(const DeltaShape& s, const char* what) {
  if (s.dk != 64 || s.dv != 64)
    throw RuntimeError(std::string(what) + ": head dims dk=" + std::to_string(s.dk) + " dv=" + std::to_string(s.dv) +
                       " (supported: dk = dv = 64)");
  if (s.B < 1 || s.H < 1 || s.B > 65535 || s.H > 65535)
    throw RuntimeError(std::string(what) + ": bad shape B=" + std::to_string(s.B) + " H=" + std::to_string(s.H));
  DecParams p{};
  p.H = static_cast<int>(s.H), p.scale = static_cast<float>(s.scale);
  return p;
}

}  // namespace
}  // namespace lar::kernels::cuda::linear
