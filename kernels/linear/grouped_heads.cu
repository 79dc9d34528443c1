// Value widths dv = 64·m and grouped heads on top of the 64-wide chunk kernels (see
// grouped_heads.hpp for the mapping): copies out to the virtual heads, the kernel, and the
// fixed-order sums of the virtual heads' gradients.
#include "kernels/linear/grouped_heads.hpp"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/delta_rule/delta_rule.hpp"
#include "kernels/linear/scratch.hpp"
#include "kernels/linear/wide_key.hpp"

namespace lar::kernels::cuda::linear {
namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16(x); }

// dst [rows, hs·rep, w] = src [rows, hs, w] with every head repeated rep times in place.
template <class T>
__global__ void expand_heads(const T* __restrict__ src, T* __restrict__ dst, int64_t rows, int hs, int rep, int w) {
  const int64_t n = rows * hs * rep * w, hd = static_cast<int64_t>(hs) * rep;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % w, j = (i / w) % hd, r = i / (w * hd);
    dst[i] = src[(r * hs + j / rep) * w + c];
  }
}
// dst [rows, hd, w] = Σ_{u < rep} src [rows, hd·rep, w] at head j·rep + u (in order of u, fp32).
template <class T>
__global__ void sum_heads(const T* __restrict__ src, T* __restrict__ dst, int64_t rows, int hd, int rep, int w) {
  const int64_t n = rows * hd * w;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % w, j = (i / w) % hd, r = i / (w * hd);
    const T* s = src + ((r * hd + j) * rep) * w + c;
    float acc = 0.f;
    for (int u = 0; u < rep; ++u) acc += to_f(s[static_cast<int64_t>(u) * w]);
    dst[i] = from_f<T>(acc);
  }
}

unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::clamp<int64_t>((n + 255) / 256, 1, 65535)); }

// ---- the key-block split (grouped_heads.hpp)

// dst [Q, P, w] = src [P, Q, w] in units of U: a tensor's key blocks [rows, n, 64] out to
// [n, rows, 64] (P = rows, Q = n) and back (P = n, Q = rows).
template <class U>
__global__ void swap_blocks(const U* __restrict__ src, U* __restrict__ dst, int64_t P, int64_t Q, int w) {
  const int64_t n = P * Q * w;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % w, p = (i / w) % P, q = i / (w * P);
    dst[i] = src[(p * Q + q) * w + c];
  }
}
// dst [N] = Σ_{b < nb} src [b, N] in order of b, in fp32, rounded once; 8 elements a thread
// (16-byte loads) or 1.
__global__ void sum_blocks8(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n8, int nb) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc[8] = {};
    for (int b = 0; b < nb; ++b) {
      const uint4 u = src[static_cast<int64_t>(b) * n8 + i];
      const bf16* h = reinterpret_cast<const bf16*>(&u);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += __bfloat162float(h[e]);
    }
    uint4 out;
    bf16* h = reinterpret_cast<bf16*>(&out);
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = __float2bfloat16(acc[e]);
    dst[i] = out;
  }
}
__global__ void sum_blocks1(const bf16* __restrict__ src, bf16* __restrict__ dst, int64_t n, int nb) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.f;
    for (int b = 0; b < nb; ++b) acc += __bfloat162float(src[static_cast<int64_t>(b) * n + i]);
    dst[i] = __float2bfloat16(acc);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// dst [Q, P, 64] = src [P, Q, 64] (elements of T), 16 bytes a thread where both are aligned.
template <class T>
void swap_key_blocks(const T* src, T* dst, int64_t P, int64_t Q, cudaStream_t st) {
  if (P * Q == 0) return;
  if (aligned16(src) && aligned16(dst)) {
    constexpr int w = 64 * static_cast<int>(sizeof(T)) / 16;
    swap_blocks<<<grid_for(P * Q * w), 256, 0, st>>>(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst),
                                                     P, Q, w);
  } else {
    swap_blocks<<<grid_for(P * Q * 64), 256, 0, st>>>(src, dst, P, Q, 64);
  }
  LAR_CUDA_LAUNCHED();
}
// The key blocks of x [R, n·64] as [n, R, 64] in scratch (null stays null) ...
template <class T>
const T* split_keys(Scratch& sc, const T* x, int64_t R, int n, cudaStream_t st) {
  if (!x) return nullptr;
  T* d = sc.get<T>(static_cast<size_t>(n * R * 64));
  swap_key_blocks(x, d, R, n, st);
  return d;
}
// ... a buffer for a gradient in that layout (null when dst is) ...
template <class T>
T* split_buffer(Scratch& sc, const T* dst, int64_t R, int n) {
  return dst ? sc.get<T>(static_cast<size_t>(n * R * 64)) : nullptr;
}
// ... and the blocks back into dst [R, n·64].
template <class T>
void join_keys(const T* x, T* dst, int64_t R, int n, cudaStream_t st) {
  if (dst) swap_key_blocks(x, dst, static_cast<int64_t>(n), R, st);
}
// x [N] repeated n times, [n, N], in scratch.
const bf16* repeat_blocks(Scratch& sc, const bf16* x, int64_t N, int n, cudaStream_t st) {
  if (!x) return nullptr;
  bf16* d = sc.get<bf16>(static_cast<size_t>(n * N));
  for (int b = 0; b < n; ++b)
    LAR_CUDA_CHECK(cudaMemcpyAsync(d + b * N, x, static_cast<size_t>(N) * sizeof(bf16), cudaMemcpyDeviceToDevice, st));
  return d;
}
// dst [N] = Σ_b x [b, N] (fp32 in order of b, rounded once).
void sum_blocks(const bf16* x, bf16* dst, int64_t N, int n, cudaStream_t st) {
  if (!dst || N == 0) return;
  if (N % 8 == 0 && aligned16(x) && aligned16(dst))
    sum_blocks8<<<grid_for(N / 8), 256, 0, st>>>(reinterpret_cast<const uint4*>(x), reinterpret_cast<uint4*>(dst),
                                                 N / 8, n);
  else
    sum_blocks1<<<grid_for(N), 256, 0, st>>>(x, dst, N, n);
  LAR_CUDA_LAUNCHED();
}

// The n key blocks as one 64-wide problem over n·B sequences (block b of sequence i is
// sequence b·B + i).
struct KeySplit {
  GroupedShape bs;
  int n = 1;
  int64_t qk_rows = 0, g_rows = 0, v_elems = 0, s_rows = 0;  // rows of 64·n channels; v elements
};

// "<what>: key dim dk=… (supported: …)", naming the split's gate where it is what refuses dk.
std::string key_dim_error(const std::string& what, int64_t dk) {
  std::string m = what + ": key dim dk=" + std::to_string(dk) + " (supported: 64, 128, 256; gla: 64·n up to " +
                  std::to_string(64 * kKeySplitMaxBlocks) + " through the key-block split)";
  if (key_split_dim(dk) && !wide_key_split_open()) m += std::string("; the split is ") + key_split_gate_text();
  return m;
}
// A key dim that only the split takes, called where the split is not taken.
void check_not_split_only(const GroupedShape& s, const char* what) {
  if (s.dk != 64 && !wide_key_dim(s.dk)) throw RuntimeError(key_dim_error(what, s.dk));
}

KeySplit make_split(const GroupedShape& s, bool decode, const char* what) {
  const int64_t Hk = s.Hk > 0 ? s.Hk : s.H;
  if (!key_split_dim(s.dk)) throw RuntimeError(key_dim_error(what, s.dk));
  if (s.dv < 64 || s.dv % 64 != 0)
    throw RuntimeError(std::string(what) + ": value dim dv=" + std::to_string(s.dv) + " (supported: multiples of 64)");
  if (s.H < 1 || Hk < 1 || s.H % Hk != 0)
    throw RuntimeError(std::string(what) + ": " + std::to_string(s.H) + " value heads are not a multiple of " +
                       std::to_string(Hk) + " key heads");
  if (s.B < 1 || (!decode && s.T < 0)) throw RuntimeError(std::string(what) + ": bad shape");
  const int64_t T = decode ? 1 : s.T;
  KeySplit k;
  k.n = static_cast<int>(s.dk / 64);
  k.bs = s;
  k.bs.B = s.B * k.n, k.bs.dk = 64;
  if (decode) k.bs.T = 1;
  k.qk_rows = s.B * T * Hk, k.g_rows = s.B * T * s.H, k.v_elems = s.B * T * s.H * s.dv;
  k.s_rows = s.B * s.H * s.dv;
  return k;
}
std::size_t split_boundary_bytes(const GroupedShape& s) {
  const KeySplit k = make_split(s, false, "grouped boundary");
  return s.T == 0 ? 0 : grouped_boundary_bytes(k.bs);
}
// At T = 0 the state passes through (S_out = S0, dS0 = dST; zeros without them), as the
// recurrent kernels have it (the chunk kernels take T ≥ 1).
void pass_state(const float* src, float* dst, const KeySplit& k, cudaStream_t st) {
  if (!dst) return;
  const std::size_t bytes = static_cast<std::size_t>(k.s_rows) * k.n * 64 * sizeof(float);
  if (src)
    LAR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st));
  else
    LAR_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, st));
}
ChannelInputs split_inputs(Scratch& sc, const KeySplit& k, const ChannelInputs& in, bool with_state, cudaStream_t st) {
  ChannelInputs x;
  x.q = split_keys(sc, in.q, k.qk_rows, k.n, st);
  x.k = split_keys(sc, in.k, k.qk_rows, k.n, st);
  x.g = split_keys(sc, in.g, k.g_rows, k.n, st);
  x.v = repeat_blocks(sc, in.v, k.v_elems, k.n, st);
  if (with_state) x.S0 = split_keys(sc, in.S0, k.s_rows, k.n, st);
  return x;
}

// The virtual problem: H·m heads of 64 value channels.
struct Virtual {
  DeltaShape s;
  int64_t rows = 0;  // B·T (decode: B)
  int Hk = 0, H = 0, m = 1, rep_qk = 1;
  bool direct() const { return rep_qk == 1; }
};
Virtual make_virtual(const GroupedShape& g, bool decode, const char* what) {
  const int64_t Hk = g.Hk > 0 ? g.Hk : g.H;
  if (g.dk != 64)
    throw RuntimeError(std::string(what) + ": key dim dk=" + std::to_string(g.dk) + " (supported: 64, 128, 256)");
  if (g.dv < 64 || g.dv % 64 != 0)
    throw RuntimeError(std::string(what) + ": value dim dv=" + std::to_string(g.dv) + " (supported: multiples of 64)");
  if (g.H < 1 || Hk < 1 || g.H % Hk != 0)
    throw RuntimeError(std::string(what) + ": " + std::to_string(g.H) + " value heads are not a multiple of " +
                       std::to_string(Hk) + " key heads");
  Virtual v;
  v.Hk = static_cast<int>(Hk), v.H = static_cast<int>(g.H), v.m = static_cast<int>(g.dv / 64);
  v.rep_qk = static_cast<int>(g.H / Hk) * v.m;
  v.s.B = g.B, v.s.T = g.T, v.s.H = g.H * v.m, v.s.dk = 64, v.s.dv = 64, v.s.scale = g.scale;
  v.s.kernels = g.kernels;
  v.rows = decode ? g.B : g.B * g.T;
  return v;
}

// src [rows, hs, w] repeated rep times per head, in scratch (src itself when rep = 1 or null).
template <class T>
const T* expand(Scratch& sc, const T* src, int64_t rows, int hs, int rep, int w, cudaStream_t st) {
  if (!src || rep == 1) return src;
  const int64_t n = rows * hs * rep * w;
  T* dst = sc.get<T>(static_cast<size_t>(n));
  expand_heads<<<grid_for(n), 256, 0, st>>>(src, dst, rows, hs, rep, w);
  LAR_CUDA_LAUNCHED();
  return dst;
}
// The virtual gradient buffer for dst [rows, hd, w] (dst itself when rep = 1 or null) ...
template <class T>
T* grad_buffer(Scratch& sc, T* dst, int64_t rows, int hd, int rep, int w) {
  if (!dst || rep == 1) return dst;
  return sc.get<T>(static_cast<size_t>(rows * hd * rep * w));
}
// ... and its sum back into dst.
template <class T>
void sum_back(const T* buf, T* dst, int64_t rows, int hd, int rep, int w, cudaStream_t st) {
  if (!dst || rep == 1) return;
  const int64_t n = rows * hd * w;
  sum_heads<<<grid_for(n), 256, 0, st>>>(buf, dst, rows, hd, rep, w);
  LAR_CUDA_LAUNCHED();
}

// The channel mixers' per-value-head inputs on the virtual heads (w, v, S0 need no copy).
ChannelInputs virtual_inputs(Scratch& sc, const Virtual& v, const ChannelInputs& in, cudaStream_t st) {
  ChannelInputs x = in;
  x.q = expand(sc, in.q, v.rows, v.Hk, v.rep_qk, 64, st);
  x.k = expand(sc, in.k, v.rows, v.Hk, v.rep_qk, 64, st);
  x.g = expand(sc, in.g, v.rows, v.H, v.m, 64, st);
  x.beta = expand(sc, in.beta, v.rows, v.H, v.m, 1, st);
  x.b = expand(sc, in.b, v.rows, v.H, v.m, 64, st);
  return x;
}

void key_split_fwd(ChannelMixer m, const GroupedShape& gs, const ChannelInputs& in, bf16* o, float* S_out,
                   bf16* boundary, cudaStream_t st) {
  if (!o) throw RuntimeError("grouped channel forward: o is required");
  const KeySplit k = make_split(gs, false, "grouped channel forward (key split)");
  if (gs.T == 0) return pass_state(in.S0, S_out, k, st);
  Scratch sc(st);
  const ChannelInputs x = split_inputs(sc, k, in, true, st);
  bf16* ob = sc.get<bf16>(static_cast<size_t>(k.n * k.v_elems));
  float* Sb = split_buffer(sc, S_out, k.s_rows, k.n);
  grouped_channel_fwd(m, k.bs, x, ob, Sb, boundary, st);
  sum_blocks(ob, o, k.v_elems, k.n, st);
  join_keys(Sb, S_out, k.s_rows, k.n, st);
}

void key_split_bwd(ChannelMixer m, const GroupedShape& gs, const ChannelInputs& in, const bf16* boundary,
                   const bf16* dout, const float* dST, const ChannelGrads& gr, cudaStream_t st) {
  const KeySplit k = make_split(gs, false, "grouped channel backward (key split)");
  if (gs.T == 0) return pass_state(dST, gr.dS0, k, st);
  Scratch sc(st);
  const ChannelInputs x = split_inputs(sc, k, in, false, st);  // the backward reads the boundary states
  const bf16* dob = repeat_blocks(sc, dout, k.v_elems, k.n, st);
  const float* dSTb = split_keys(sc, dST, k.s_rows, k.n, st);
  ChannelGrads y;
  y.dq = split_buffer(sc, gr.dq, k.qk_rows, k.n);
  y.dk = split_buffer(sc, gr.dk, k.qk_rows, k.n);
  y.dg = split_buffer(sc, gr.dg, k.g_rows, k.n);
  y.dv = gr.dv ? sc.get<bf16>(static_cast<size_t>(k.n * k.v_elems)) : nullptr;
  y.dS0 = split_buffer(sc, gr.dS0, k.s_rows, k.n);
  grouped_channel_bwd(m, k.bs, x, boundary, dob, dSTb, y, st);
  join_keys(y.dq, gr.dq, k.qk_rows, k.n, st);
  join_keys(y.dk, gr.dk, k.qk_rows, k.n, st);
  join_keys(y.dg, gr.dg, k.g_rows, k.n, st);
  sum_blocks(y.dv, gr.dv, k.v_elems, k.n, st);
  join_keys(y.dS0, gr.dS0, k.s_rows, k.n, st);
}

// One token: the state's column blocks out to [n, B·H·dv, 64] (= [n·B, H, dv, 64], the 64-wide
// decode's layout over n·B sequences), the decode in place there, the blocks back into S.
void key_split_decode(ChannelMixer m, const GroupedShape& gs, const ChannelInputs& in, float* S, bf16* o,
                      cudaStream_t st) {
  if (!S || !o) throw RuntimeError("grouped channel decode (key split): S and o are required");
  const KeySplit k = make_split(gs, true, "grouped channel decode (key split)");
  Scratch sc(st);
  const ChannelInputs x = split_inputs(sc, k, in, false, st);
  float* Sb = sc.get<float>(static_cast<size_t>(k.n * k.s_rows * 64));
  swap_key_blocks(S, Sb, k.s_rows, k.n, st);
  bf16* ob = sc.get<bf16>(static_cast<size_t>(k.n * k.v_elems));
  grouped_channel_decode(m, k.bs, x, Sb, ob, st);
  sum_blocks(ob, o, k.v_elems, k.n, st);
  join_keys(Sb, S, k.s_rows, k.n, st);
}

}  // namespace

bool grouped_channel_key_split(ChannelMixer m, const GroupedShape& s) {
  return s.key_split && wide_key_split_open() && m == ChannelMixer::gla && key_split_dim(s.dk) &&
         (s.T > 0 || !wide_key_dim(s.dk));
}

bool grouped_channel_decode_key_split(ChannelMixer m, const GroupedShape& s) {
  return s.key_split && wide_key_split_open() && m == ChannelMixer::gla && key_split_dim(s.dk) &&
         !wide_key_dim(s.dk);
}

std::size_t grouped_boundary_bytes(const GroupedShape& s) {
  if (s.dk != 64) {
    const bool split = grouped_channel_key_split(ChannelMixer::gla, s);
    if (!wide_key_dim(s.dk)) {
      if (!split) throw RuntimeError(key_dim_error("grouped boundary", s.dk));
      return split_boundary_bytes(s);
    }
    const std::size_t wide = wide_boundary_bytes(s);  // (checks the shape)
    if (!split) return wide;
    return std::max(wide, split_boundary_bytes(s));
  }
  return delta_boundary_bytes(make_virtual(s, false, "grouped boundary").s);
}

std::size_t grouped_channel_boundary_bytes(ChannelMixer m, const GroupedShape& s) {
  if (grouped_channel_key_split(m, s)) return split_boundary_bytes(s);
  check_not_split_only(s, "grouped channel boundary");
  return s.dk != 64 ? wide_boundary_bytes(s) : grouped_boundary_bytes(s);
}

void grouped_delta_fwd(const GroupedShape& gs, const bf16* q, const bf16* k, const bf16* v, const float* g,
                       const float* beta, const float* S0, bf16* o, float* S_out, bf16* boundary,
                       cudaStream_t stream) {
  check_not_split_only(gs, "grouped delta forward");
  if (gs.dk != 64) return wide_delta_fwd(gs, q, k, v, g, beta, S0, o, S_out, boundary, stream);
  const Virtual vs = make_virtual(gs, false, "grouped delta forward");
  if (vs.direct()) return delta_fwd(vs.s, q, k, v, g, beta, S0, o, S_out, boundary, stream);
  Scratch sc(stream);
  delta_fwd(vs.s, expand(sc, q, vs.rows, vs.Hk, vs.rep_qk, 64, stream), expand(sc, k, vs.rows, vs.Hk, vs.rep_qk, 64, stream),
            v, expand(sc, g, vs.rows, vs.H, vs.m, 1, stream), expand(sc, beta, vs.rows, vs.H, vs.m, 1, stream), S0, o,
            S_out, boundary, stream);
}

void grouped_delta_bwd(const GroupedShape& gs, const bf16* q, const bf16* k, const bf16* v, const float* g,
                       const float* beta, const bf16* boundary, const bf16* dout, const float* dST, bf16* dq,
                       bf16* dk, bf16* dv, float* dg, float* dbeta, float* dS0, cudaStream_t stream) {
  check_not_split_only(gs, "grouped delta backward");
  if (gs.dk != 64)
    return wide_delta_bwd(gs, q, k, v, g, beta, boundary, dout, dST, dq, dk, dv, dg, dbeta, dS0, stream);
  const Virtual vs = make_virtual(gs, false, "grouped delta backward");
  if (vs.direct()) return delta_bwd(vs.s, q, k, v, g, beta, boundary, dout, dST, dq, dk, dv, dg, dbeta, dS0, stream);
  Scratch sc(stream);
  bf16* dqx = grad_buffer(sc, dq, vs.rows, vs.Hk, vs.rep_qk, 64);
  bf16* dkx = grad_buffer(sc, dk, vs.rows, vs.Hk, vs.rep_qk, 64);
  float* dgx = g ? grad_buffer(sc, dg, vs.rows, vs.H, vs.m, 1) : nullptr;
  float* dbx = grad_buffer(sc, dbeta, vs.rows, vs.H, vs.m, 1);
  delta_bwd(vs.s, expand(sc, q, vs.rows, vs.Hk, vs.rep_qk, 64, stream), expand(sc, k, vs.rows, vs.Hk, vs.rep_qk, 64, stream),
            v, expand(sc, g, vs.rows, vs.H, vs.m, 1, stream), expand(sc, beta, vs.rows, vs.H, vs.m, 1, stream), boundary,
            dout, dST, dqx, dkx, dv, dgx, dbx, dS0, stream);
  sum_back(dqx, dq, vs.rows, vs.Hk, vs.rep_qk, 64, stream);
  sum_back(dkx, dk, vs.rows, vs.Hk, vs.rep_qk, 64, stream);
  if (g) sum_back(dgx, dg, vs.rows, vs.H, vs.m, 1, stream);
  sum_back(dbx, dbeta, vs.rows, vs.H, vs.m, 1, stream);
}

void grouped_delta_decode(const GroupedShape& gs, const bf16* q, const bf16* k, const bf16* v, const float* g,
                          const float* beta, float* S, bf16* o, cudaStream_t stream) {
  check_not_split_only(gs, "grouped delta decode");
  if (gs.dk != 64) return wide_delta_decode(gs, q, k, v, g, beta, S, o, stream);
  const Virtual vs = make_virtual(gs, true, "grouped delta decode");
  if (vs.direct()) return delta_decode(vs.s, q, k, v, g, beta, S, o, stream);
  Scratch sc(stream);
  delta_decode(vs.s, expand(sc, q, vs.rows, vs.Hk, vs.rep_qk, 64, stream),
               expand(sc, k, vs.rows, vs.Hk, vs.rep_qk, 64, stream), v, expand(sc, g, vs.rows, vs.H, vs.m, 1, stream),
               expand(sc, beta, vs.rows, vs.H, vs.m, 1, stream), S, o, stream);
}

void grouped_channel_fwd(ChannelMixer m, const GroupedShape& gs, const ChannelInputs& in, bf16* o, float* S_out,
                         bf16* boundary, cudaStream_t stream) {
  if (grouped_channel_key_split(m, gs)) return key_split_fwd(m, gs, in, o, S_out, boundary, stream);
  check_not_split_only(gs, "grouped channel forward");
  if (gs.dk != 64) return wide_channel_fwd(m, gs, in, o, S_out, boundary, stream);
  const Virtual vs = make_virtual(gs, false, "grouped channel forward");
  if (vs.direct()) return channel_fwd(m, vs.s, in, o, S_out, boundary, stream);
  Scratch sc(stream);
  channel_fwd(m, vs.s, virtual_inputs(sc, vs, in, stream), o, S_out, boundary, stream);
}

void grouped_channel_bwd(ChannelMixer m, const GroupedShape& gs, const ChannelInputs& in, const bf16* boundary,
                         const bf16* dout, const float* dST, const ChannelGrads& gr, cudaStream_t stream) {
  if (grouped_channel_key_split(m, gs)) return key_split_bwd(m, gs, in, boundary, dout, dST, gr, stream);
  check_not_split_only(gs, "grouped channel backward");
  if (gs.dk != 64) return wide_channel_bwd(m, gs, in, boundary, dout, dST, gr, stream);
  const Virtual vs = make_virtual(gs, false, "grouped channel backward");
  if (vs.direct()) return channel_bwd(m, vs.s, in, boundary, dout, dST, gr, stream);
  Scratch sc(stream);
  ChannelGrads x = gr;
  x.dq = grad_buffer(sc, gr.dq, vs.rows, vs.Hk, vs.rep_qk, 64);
  x.dk = grad_buffer(sc, gr.dk, vs.rows, vs.Hk, vs.rep_qk, 64);
  x.dg = grad_buffer(sc, gr.dg, vs.rows, vs.H, vs.m, 64);
  x.dbeta = grad_buffer(sc, gr.dbeta, vs.rows, vs.H, vs.m, 1);
  x.db = grad_buffer(sc, gr.db, vs.rows, vs.H, vs.m, 64);
  channel_bwd(m, vs.s, virtual_inputs(sc, vs, in, stream), boundary, dout, dST, x, stream);
  sum_back(x.dq, gr.dq, vs.rows, vs.Hk, vs.rep_qk, 64, stream);
  sum_back(x.dk, gr.dk, vs.rows, vs.Hk, vs.rep_qk, 64, stream);
  sum_back(x.dg, gr.dg, vs.rows, vs.H, vs.m, 64, stream);
  sum_back(x.dbeta, gr.dbeta, vs.rows, vs.H, vs.m, 1, stream);
  sum_back(x.db, gr.db, vs.rows, vs.H, vs.m, 64, stream);
}

void grouped_channel_decode(ChannelMixer m, const GroupedShape& gs, const ChannelInputs& in, float* S, bf16* o,
                            cudaStream_t stream) {
  if (grouped_channel_decode_key_split(m, gs)) return key_split_decode(m, gs, in, S, o, stream);
  check_not_split_only(gs, "grouped channel decode");
  if (gs.dk != 64) return wide_channel_decode(m, gs, in, S, o, stream);
  const Virtual vs = make_virtual(gs, true, "grouped channel decode");
  if (vs.direct()) return channel_decode(m, vs.s, in, S, o, stream);
  Scratch sc(stream);
  channel_decode(m, vs.s, virtual_inputs(sc, vs, in, stream), S, o, stream);
}

void repeat_heads(const bf16* src, bf16* dst, int64_t rows, int Hk, int G, int w, cudaStream_t stream) {
  const int64_t n = rows * Hk * G * w;
  if (n == 0) return;
  expand_heads<<<grid_for(n), 256, 0, stream>>>(src, dst, rows, Hk, G, w);
  LAR_CUDA_LAUNCHED();
}

void sum_head_groups(const float* src, float* dst, int64_t rows, int Hk, int G, int w, cudaStream_t stream) {
  const int64_t n = rows * Hk * w;
  if (n == 0) return;
  sum_heads<<<grid_for(n), 256, 0, stream>>>(src, dst, rows, Hk, G, w);
  LAR_CUDA_LAUNCHED();
}

void sum_head_groups(const bf16* src, bf16* dst, int64_t rows, int Hk, int G, int w, cudaStream_t stream) {
  const int64_t n = rows * Hk * w;
  if (n == 0) return;
  sum_heads<<<grid_for(n), 256, 0, stream>>>(src, dst, rows, Hk, G, w);
  LAR_CUDA_LAUNCHED();
}

}  // namespace lar::kernels::cuda::linear
