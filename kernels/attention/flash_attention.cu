// Flash-style causal attention (FlashAttention-2 structure) with mma.sync m16n8k16 bf16
// tensor-core instructions. See flash_attention.hpp for the contract.
//
// Every kernel: a CTA of NW warps; each warp owns 16 rows of the output tile and keeps
// its accumulators in registers. Tiles are staged in shared memory by cp.async (double
// buffered) in a 16-byte-chunk XOR swizzle so that ldmatrix is conflict-free. The
// softmax probabilities go from the S accumulators straight into the A operand of the
// next MMA (the C layout of two 16×8 tiles is the A layout of one 16×16 tile).
//
//   fwd_kernel   grid (query blocks, Hq, B): online softmax over the visible key blocks
//   delta_kernel rowwise Δ = Σ dout·o (fp32)
//   dkdv_kernel  grid (key blocks, Hkv, B): loops over the group's query heads and the
//                query blocks that see the key block; dk, dv in registers → no atomics
//   dq_kernel    grid (query blocks, Hq, B): loops over key blocks like the forward
#include "kernels/attention/flash_attention.hpp"

#include <cuda_bf16.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda::attention {
namespace {

using bf16 = __nv_bfloat16;
constexpr float kLog2e = 1.4426950408889634f;

struct Params {
  const bf16 *q, *k, *v, *o, *dout;
  bf16 *out, *dq, *dk, *dv;
  const float* lse_in;
  float *lse, *delta;
  int B, T, S, Hq, Hkv, G, off, window;
  float scale, scale_log2;
};

// ---------------------------------------------------------------- PTX helpers
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global → shared; pred false zero-fills (no bytes are read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
// c += a·b, a 16×16 (row), b 16×8 (col), c 16×8 fp32.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---------------------------------------------------------------- tiles
// Element offset of 16-byte chunk c of row r in a row-major tile of D bf16 columns.
template <int D>
__device__ __forceinline__ int swz(int r, int c) {
  return r * D + ((c ^ (r & 7)) << 3);
}
// Rows row0.. row0+R-1 of a strided global matrix into a swizzled tile; rows ≥ nrows → 0.
template <int D, int R, int NT>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, size_t stride, int row0, int nrows) {
  constexpr int C = D / 8;
#pragma unroll
  for (int i = threadIdx.x; i < R * C; i += NT) {
    const int r = i / C, c = i % C, gr = row0 + r;
    const bool ok = gr < nrows;
    cp_async16(s + swz<D>(r, c), ok ? g + static_cast<size_t>(gr) * stride + c * 8 : g, ok);
  }
}
// A fragment (16×16) of rows r0.., columns 16·kk.. of a swizzled tile.
template <int D>
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const bf16* s, int r0, int kk, int lane) {
  ldsm_x4(a, s + swz<D>(r0 + (lane & 15), 2 * kk + (lane >> 4)));
}
// B fragments of two 8-column n-tiles (rows n0.., n0+8.. of a tile stored [n][k]) at
// k columns 16·kk..: r[0],r[1] → n-tile n0, r[2],r[3] → n-tile n0+8.
template <int D>
__device__ __forceinline__ void frag_b(uint32_t (&r)[4], const bf16* s, int n0, int kk, int lane) {
  ldsm_x4(r, s + swz<D>(n0 + ((lane >> 4) << 3) + (lane & 7), 2 * kk + ((lane >> 3) & 1)));
}
// B fragments from a tile stored [k][n] (rows k0..k0+15), n columns 16·dn..:
// r[0],r[1] → n-tile 16·dn, r[2],r[3] → n-tile 16·dn+8.
template <int D>
__device__ __forceinline__ void frag_bt(uint32_t (&r)[4], const bf16* s, int k0, int dn, int lane) {
  ldsm_x4_t(r, s + swz<D>(k0 + (((lane >> 3) & 1) << 3) + (lane & 7), 2 * dn + (lane >> 4)));
}
// The C fragments of n-tiles 2kt, 2kt+1 as one bf16 A fragment (k = those 16 columns).
template <int N>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c)[N][4], int kt) {
  a[0] = pack(c[2 * kt][0], c[2 * kt][1]);
  a[1] = pack(c[2 * kt][2], c[2 * kt][3]);
  a[2] = pack(c[2 * kt + 1][0], c[2 * kt + 1][1]);
  a[3] = pack(c[2 * kt + 1][2], c[2 * kt + 1][3]);
}

__device__ __forceinline__ bool visible(int pos, int j, int window) {
  return j <= pos && (window <= 0 || pos - j < window);
}

// ---------------------------------------------------------------- forward
// CTA: NW warps × MT m-tiles of 16 query rows (BR = 16·NW·MT rows); key blocks of BC.
// MT = 2 lets each K/V fragment read from shared memory feed two MMAs.
// D=64 with one m-tile needs 130 registers: capping it at 128 lets 4 CTAs share an SM.
template <int D, int NW, int MT, int BC>
__global__ void __launch_bounds__(NW * 32, (D == 64 && MT == 1) ? 4 : 1) fwd_kernel(const Params p) {
  constexpr int BR = NW * 16 * MT, NT = NW * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + BR * D;  // [2][BC][D]
  bf16* sV = sK + 2 * BC * D;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
  const int qblk = gridDim.x - 1 - blockIdx.x;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.G, q0 = qblk * BR;
  const int wr0 = q0 + warp * 16 * MT;  // this warp's first row
  const size_t qs = static_cast<size_t>(p.Hq) * D, ks = static_cast<size_t>(p.Hkv) * D;
  const size_t qoff = (static_cast<size_t>(b) * p.T * p.Hq + h) * D;
  const bf16* K = p.k + (static_cast<size_t>(b) * p.S * p.Hkv + hk) * D;
  const bf16* V = p.v + (static_cast<size_t>(b) * p.S * p.Hkv + hk) * D;
  const int pos_lo = q0 + p.off, pos_hi = min(q0 + BR, p.T) - 1 + p.off;
  const int kbeg = p.window > 0 ? max(0, pos_lo - p.window + 1) : 0;
  const int kend = min(p.S, pos_hi + 1);
  const int nb0 = kbeg / BC, nb1 = (kend + BC - 1) / BC;

  load_tile<D, BR, NT>(sQ, p.q + qoff, qs, q0, p.T);
  load_tile<D, BC, NT>(sK, K, ks, nb0 * BC, p.S);
  load_tile<D, BC, NT>(sV, V, ks, nb0 * BC, p.S);
  cp_async_commit();

  uint32_t qf[MT][D / 16][4];
  float o[MT][D / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }

  for (int nb = nb0; nb < nb1; ++nb) {
    const int buf = (nb - nb0) & 1;
    if (nb + 1 < nb1) {
      load_tile<D, BC, NT>(sK + (buf ^ 1) * BC * D, K, ks, (nb + 1) * BC, p.S);
      load_tile<D, BC, NT>(sV + (buf ^ 1) * BC * D, V, ks, (nb + 1) * BC, p.S);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (nb == nb0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) frag_a<D>(qf[mt][kk], sQ, (warp * MT + mt) * 16, kk, lane);
    }
    const bf16* sKb = sK + buf * BC * D;
    const bf16* sVb = sV + buf * BC * D;

    float s[MT][BC / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < BC / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int nn = 0; nn < BC / 16; ++nn) {
        uint32_t r[4];
        frag_b<D>(r, sKb, nn * 16, kk, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(s[mt][2 * nn], qf[mt][kk], r[0], r[1]);
          mma(s[mt][2 * nn + 1], qf[mt][kk], r[2], r[3]);
        }
      }

    const int kb0 = nb * BC;
    const bool full = kb0 + BC - 1 <= pos_lo && kb0 + BC <= p.S && (p.window <= 0 || pos_hi - kb0 < p.window);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mt][nt][e] * p.scale_log2;
          if (!full) {
            const int pos = wr0 + mt * 16 + g + (e >> 1) * 8 + p.off;
            const int j = kb0 + nt * 8 + tig * 2 + (e & 1);
            if (!(j < p.S && visible(pos, j, p.window))) x = -INFINITY;
          }
          s[mt][nt][e] = x;
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = m[mt][r];
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mu = mx == -INFINITY ? 0.f : mx;  // a row with nothing visible yet
        const float alpha = ex2(m[mt][r] - mu);
        m[mt][r] = mx;
        float rs = 0.f;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
          s[mt][nt][2 * r] = ex2(s[mt][nt][2 * r] - mu);
          s[mt][nt][2 * r + 1] = ex2(s[mt][nt][2 * r + 1] - mu);
          rs += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
        }
        l[mt][r] = l[mt][r] * alpha + rs;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) o[mt][dt][2 * r] *= alpha, o[mt][dt][2 * r + 1] *= alpha;
      }
    }

#pragma unroll
    for (int kt = 0; kt < BC / 16; ++kt) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) c_to_a(pa[mt], s[mt], kt);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t r[4];
        frag_bt<D>(r, sVb, kt * 16, dn, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(o[mt][2 * dn], pa[mt], r[0], r[1]);
          mma(o[mt][2 * dn + 1], pa[mt], r[2], r[3]);
        }
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this buffer
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lr = l[mt][r];
      lr += __shfl_xor_sync(0xffffffffu, lr, 1);
      lr += __shfl_xor_sync(0xffffffffu, lr, 2);
      const int row = wr0 + mt * 16 + g + r * 8;
      if (row >= p.T) continue;
      const float inv = 1.f / lr;
      bf16* O = p.out + qoff + static_cast<size_t>(row) * qs;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(O + dt * 8 + tig * 2) =
            pack(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
      if (tig == 0)
        p.lse[(static_cast<size_t>(b) * p.Hq + h) * p.T + row] = (m[mt][r] + log2f(lr)) * 0.6931471805599453f;
    }
}

// ---------------------------------------------------------------- backward
// Δ[b,h,t] = Σ_d dout·o, one warp per row.
template <int D>
__global__ void delta_kernel(const Params p) {
  const size_t row = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const size_t rows = static_cast<size_t>(p.B) * p.T * p.Hq;
  if (row >= rows) return;
  const bf16* o = p.o + row * D;  // rows of [B,T,Hq] in memory order
  const bf16* d = p.dout + row * D;
  float acc = 0.f;
#pragma unroll
  for (int i = lane * 2; i < D; i += 64) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o + i));
    const float2 c = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(d + i));
    acc += a.x * c.x + a.y * c.y;
  }
#pragma unroll
  for (int w = 16; w; w >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, w);
  if (lane == 0) {
    const size_t h = row % p.Hq, t = (row / p.Hq) % p.T, b = row / (static_cast<size_t>(p.Hq) * p.T);
    p.delta[(b * p.Hq + h) * p.T + t] = acc;
  }
}

// CTA: NW warps × MT m-tiles of 16 keys (BCK = 16·NW·MT keys); query blocks of BRQ.
// D=64 with one m-tile needs 177 registers: capping it at 168 lets 3 CTAs share an SM.
template <int D, int NW, int MT, int BRQ>
__global__ void __launch_bounds__(NW * 32, (D == 64 && MT == 1) ? 3 : 1) dkdv_kernel(const Params p) {
  constexpr int BCK = NW * 16 * MT, NT = NW * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + BCK * D;
  bf16* sQ = sV + BCK * D;       // [2][BRQ][D]
  bf16* sdO = sQ + 2 * BRQ * D;  // [2][BRQ][D]
  float* sL = reinterpret_cast<float*>(sdO + 2 * BRQ * D);  // [2][BRQ] lse·log2e
  float* sDl = sL + 2 * BRQ;                                 // [2][BRQ] Δ
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
  const int hk = blockIdx.y, b = blockIdx.z, k0 = blockIdx.x * BCK;
  const int wk0 = k0 + warp * 16 * MT;  // this warp's first key
  const size_t qs = static_cast<size_t>(p.Hq) * D, ks = static_cast<size_t>(p.Hkv) * D;
  const size_t koff = (static_cast<size_t>(b) * p.S * p.Hkv + hk) * D;
  // Queries that see some key of this block.
  const int klast = min(k0 + BCK, p.S) - 1;
  const int tbeg = max(0, k0 - p.off);
  const int tend = p.window > 0 ? min(p.T, klast + p.window - p.off) : p.T;
  const int qb0 = tbeg / BRQ, nq = tend > tbeg ? (tend + BRQ - 1) / BRQ - qb0 : 0;
  const int iters = nq * p.G;

  load_tile<D, BCK, NT>(sK, p.k + koff, ks, k0, p.S);
  load_tile<D, BCK, NT>(sV, p.v + koff, ks, k0, p.S);
  auto load_q = [&](int it, int buf) {
    const int h = hk * p.G + it / nq, t0 = (qb0 + it % nq) * BRQ;
    const size_t qoff = (static_cast<size_t>(b) * p.T * p.Hq + h) * D;
    load_tile<D, BRQ, NT>(sQ + buf * BRQ * D, p.q + qoff, qs, t0, p.T);
    load_tile<D, BRQ, NT>(sdO + buf * BRQ * D, p.dout + qoff, qs, t0, p.T);
    const size_t roff = (static_cast<size_t>(b) * p.Hq + h) * p.T;
    for (int i = threadIdx.x; i < BRQ; i += NT) {
      const int t = t0 + i;
      sL[buf * BRQ + i] = t < p.T ? p.lse_in[roff + t] * kLog2e : INFINITY;  // → P = 0
      sDl[buf * BRQ + i] = t < p.T ? p.delta[roff + t] : 0.f;
    }
  };
  if (iters > 0) load_q(0, 0);
  cp_async_commit();

  float dk[MT][D / 8][4], dv[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[mt][i][e] = dv[mt][i][e] = 0.f;

  for (int it = 0; it < iters; ++it) {
    const int buf = it & 1;
    if (it + 1 < iters) load_q(it + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16* sQb = sQ + buf * BRQ * D;
    const bf16* sdOb = sdO + buf * BRQ * D;
    const float* sLb = sL + buf * BRQ;
    const float* sDb = sDl + buf * BRQ;
    const int tq0 = (qb0 + it % nq) * BRQ;

    // Sᵀ = K Qᵀ (16·MT keys × BRQ queries per warp)
    float st[MT][BRQ / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < BRQ / 8; ++i) st[mt][i][0] = st[mt][i][1] = st[mt][i][2] = st[mt][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) frag_a<D>(ka[mt], sK, (warp * MT + mt) * 16, kk, lane);
#pragma unroll
      for (int nn = 0; nn < BRQ / 16; ++nn) {
        uint32_t r[4];
        frag_b<D>(r, sQb, nn * 16, kk, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(st[mt][2 * nn], ka[mt], r[0], r[1]);
          mma(st[mt][2 * nn + 1], ka[mt], r[2], r[3]);
        }
      }
    }
    // Pᵀ
    const bool full = k0 + BCK - 1 <= tq0 + p.off && (p.window <= 0 || tq0 + BRQ - 1 + p.off - k0 < p.window);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BRQ / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nt * 8 + tig * 2 + (e & 1);
          float pv = ex2(st[mt][nt][e] * p.scale_log2 - sLb[col]);
          if (!full) {
            const int key = wk0 + mt * 16 + g + (e >> 1) * 8;
            if (!visible(tq0 + col + p.off, key, p.window)) pv = 0.f;
          }
          st[mt][nt][e] = pv;
        }
    // dV += Pᵀ dO
#pragma unroll
    for (int kt = 0; kt < BRQ / 16; ++kt) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) c_to_a(pa[mt], st[mt], kt);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t r[4];
        frag_bt<D>(r, sdOb, kt * 16, dn, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(dv[mt][2 * dn], pa[mt], r[0], r[1]);
          mma(dv[mt][2 * dn + 1], pa[mt], r[2], r[3]);
        }
      }
    }
    // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ − Δ) in place of Pᵀ
    {
      float dpt[MT][BRQ / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < BRQ / 8; ++i) dpt[mt][i][0] = dpt[mt][i][1] = dpt[mt][i][2] = dpt[mt][i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t va[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) frag_a<D>(va[mt], sV, (warp * MT + mt) * 16, kk, lane);
#pragma unroll
        for (int nn = 0; nn < BRQ / 16; ++nn) {
          uint32_t r[4];
          frag_b<D>(r, sdOb, nn * 16, kk, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma(dpt[mt][2 * nn], va[mt], r[0], r[1]);
            mma(dpt[mt][2 * nn + 1], va[mt], r[2], r[3]);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < BRQ / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[mt][nt][e] *= dpt[mt][nt][e] - sDb[nt * 8 + tig * 2 + (e & 1)];
    }
    // dK += dSᵀ Q
#pragma unroll
    for (int kt = 0; kt < BRQ / 16; ++kt) {
      uint32_t da[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) c_to_a(da[mt], st[mt], kt);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t r[4];
        frag_bt<D>(r, sQb, kt * 16, dn, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(dk[mt][2 * dn], da[mt], r[0], r[1]);
          mma(dk[mt][2 * dn + 1], da[mt], r[2], r[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = wk0 + mt * 16 + g + r * 8;
      if (key >= p.S) continue;
      bf16* DK = p.dk + koff + static_cast<size_t>(key) * ks;
      bf16* DV = p.dv + koff + static_cast<size_t>(key) * ks;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        *reinterpret_cast<uint32_t*>(DK + dt * 8 + tig * 2) =
            pack(dk[mt][dt][2 * r] * p.scale, dk[mt][dt][2 * r + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(DV + dt * 8 + tig * 2) = pack(dv[mt][dt][2 * r], dv[mt][dt][2 * r + 1]);
      }
    }
}

template <int D, int NW, int MT, int BC>
__global__ void __launch_bounds__(NW * 32) dq_kernel(const Params p) {
  constexpr int BR = NW * 16 * MT, NT = NW * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sdO = sQ + BR * D;
  bf16* sK = sdO + BR * D;  // [2][BC][D]
  bf16* sV = sK + 2 * BC * D;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
  const int qblk = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.G, q0 = qblk * BR;
  const int wr0 = q0 + warp * 16 * MT;
  const size_t qs = static_cast<size_t>(p.Hq) * D, ks = static_cast<size_t>(p.Hkv) * D;
  const size_t qoff = (static_cast<size_t>(b) * p.T * p.Hq + h) * D;
  const bf16* K = p.k + (static_cast<size_t>(b) * p.S * p.Hkv + hk) * D;
  const bf16* V = p.v + (static_cast<size_t>(b) * p.S * p.Hkv + hk) * D;
  const int pos_lo = q0 + p.off, pos_hi = min(q0 + BR, p.T) - 1 + p.off;
  const int kbeg = p.window > 0 ? max(0, pos_lo - p.window + 1) : 0;
  const int kend = min(p.S, pos_hi + 1);
  const int nb0 = kbeg / BC, nb1 = (kend + BC - 1) / BC;

  load_tile<D, BR, NT>(sQ, p.q + qoff, qs, q0, p.T);
  load_tile<D, BR, NT>(sdO, p.dout + qoff, qs, q0, p.T);
  load_tile<D, BC, NT>(sK, K, ks, nb0 * BC, p.S);
  load_tile<D, BC, NT>(sV, V, ks, nb0 * BC, p.S);
  cp_async_commit();

  float lr[MT][2], dr[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wr0 + mt * 16 + g + r * 8;
      const size_t i = (static_cast<size_t>(b) * p.Hq + h) * p.T + row;
      lr[mt][r] = row < p.T ? p.lse_in[i] * kLog2e : INFINITY;
      dr[mt][r] = row < p.T ? p.delta[i] : 0.f;
    }
  uint32_t qf[MT][D / 16][4], df[MT][D / 16][4];
  float dq[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) dq[mt][i][0] = dq[mt][i][1] = dq[mt][i][2] = dq[mt][i][3] = 0.f;

  for (int nb = nb0; nb < nb1; ++nb) {
    const int buf = (nb - nb0) & 1;
    if (nb + 1 < nb1) {
      load_tile<D, BC, NT>(sK + (buf ^ 1) * BC * D, K, ks, (nb + 1) * BC, p.S);
      load_tile<D, BC, NT>(sV + (buf ^ 1) * BC * D, V, ks, (nb + 1) * BC, p.S);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (nb == nb0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          frag_a<D>(qf[mt][kk], sQ, (warp * MT + mt) * 16, kk, lane);
          frag_a<D>(df[mt][kk], sdO, (warp * MT + mt) * 16, kk, lane);
        }
    }
    const bf16* sKb = sK + buf * BC * D;
    const bf16* sVb = sV + buf * BC * D;

    float s[MT][BC / 8][4], dp[MT][BC / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < BC / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][i][e] = dp[mt][i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int nn = 0; nn < BC / 16; ++nn) {
        uint32_t r[4];
        frag_b<D>(r, sKb, nn * 16, kk, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(s[mt][2 * nn], qf[mt][kk], r[0], r[1]);
          mma(s[mt][2 * nn + 1], qf[mt][kk], r[2], r[3]);
        }
        frag_b<D>(r, sVb, nn * 16, kk, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(dp[mt][2 * nn], df[mt][kk], r[0], r[1]);
          mma(dp[mt][2 * nn + 1], df[mt][kk], r[2], r[3]);
        }
      }

    const int kb0 = nb * BC;
    const bool full = kb0 + BC - 1 <= pos_lo && kb0 + BC <= p.S && (p.window <= 0 || pos_hi - kb0 < p.window);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pv = ex2(s[mt][nt][e] * p.scale_log2 - lr[mt][e >> 1]);
          if (!full) {
            const int pos = wr0 + mt * 16 + g + (e >> 1) * 8 + p.off;
            const int j = kb0 + nt * 8 + tig * 2 + (e & 1);
            if (!(j < p.S && visible(pos, j, p.window))) pv = 0.f;
          }
          s[mt][nt][e] = pv * (dp[mt][nt][e] - dr[mt][e >> 1]);  // dS
        }
    // dQ += dS K
#pragma unroll
    for (int kt = 0; kt < BC / 16; ++kt) {
      uint32_t da[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) c_to_a(da[mt], s[mt], kt);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t r[4];
        frag_bt<D>(r, sKb, kt * 16, dn, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(dq[mt][2 * dn], da[mt], r[0], r[1]);
          mma(dq[mt][2 * dn + 1], da[mt], r[2], r[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wr0 + mt * 16 + g + r * 8;
      if (row >= p.T) continue;
      bf16* DQ = p.dq + qoff + static_cast<size_t>(row) * qs;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(DQ + dt * 8 + tig * 2) =
            pack(dq[mt][dt][2 * r] * p.scale, dq[mt][dt][2 * r + 1] * p.scale);
    }
}

// ---------------------------------------------------------------- launch
Params make_params(const FlashShape& s) {
  if (!flash_attention_supports(s.D))
    throw RuntimeError("flash attention: head dim " + std::to_string(s.D) + " (supported: 64, 128)");
  if (s.B < 1 || s.T < 1 || s.S < s.T || s.Hq < 1 || s.Hkv < 1 || s.Hq % s.Hkv != 0)
    throw RuntimeError("flash attention: bad shape B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                       " S=" + std::to_string(s.S) + " Hq=" + std::to_string(s.Hq) +
                       " Hkv=" + std::to_string(s.Hkv));
  if (s.S > (int64_t{1} << 30) || s.B > 65535 || s.Hq > 65535)
    throw RuntimeError("flash attention: shape too large");
  Params p{};
  p.B = static_cast<int>(s.B);
  p.T = static_cast<int>(s.T);
  p.S = static_cast<int>(s.S);
  p.Hq = static_cast<int>(s.Hq);
  p.Hkv = static_cast<int>(s.Hkv);
  p.G = p.Hq / p.Hkv;
  p.off = p.S - p.T;
  p.window = s.window > 0 ? static_cast<int>(std::min<int64_t>(s.window, s.S + 1)) : 0;
  p.scale = static_cast<float>(s.scale);
  p.scale_log2 = static_cast<float>(s.scale * 1.4426950408889634);
  return p;
}

template <class Kernel>
void launch(Kernel kernel, dim3 grid, int threads, std::size_t smem, cudaStream_t stream, const Params& p,
            bool max_shared) {
  LAR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // The backward kernels ask for the largest shared-memory carveout: with the default split
  // dk/dv fitted 2 CTAs per SM instead of the 3 its registers allow (ncu). The forward
  // keeps the default: a run that forced the carveout together with an FFMA-folded softmax
  // scale measured it 7% slower (not separated; both left out of the forward).
  if (max_shared)
    LAR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
  kernel<<<grid, threads, smem, stream>>>(p);
  LAR_CUDA_LAUNCHED();
}

// Tile configurations. Each warp owns MT·16 rows with fp32 accumulators in registers; the
// inner tile (keys in fwd/dq, queries in dk/dv) is as large as the registers allow.
//   tiles 0: 64-row CTAs, 4 warps × 1 m-tile of 16 rows
//   tiles 1: 128-row CTAs — D=64: 4 warps × 2 m-tiles; D=128: 8 warps × 1 — so each K/V
//            (Q/dO) tile staged in shared memory serves twice the rows
// Measured on the H200 (dev/perf-history.md): tiles 1 is faster in the forward, tiles 0 in the
// backward, so the default takes each pass's faster one. FlashShape::tiles = 0 or 1 forces one
// configuration for both passes (`lar-bench attention --tiles`).
struct Tiles {
  int fwd, bwd;
};
Tiles tiles_choice(const FlashShape& s) {
  if (s.tiles != -1 && s.tiles != 0 && s.tiles != 1)
    throw RuntimeError("flash attention: tiles " + std::to_string(s.tiles) + ": expected -1, 0 or 1");
  return s.tiles == 0 ? Tiles{0, 0} : s.tiles == 1 ? Tiles{1, 1} : Tiles{1, 0};
}

template <int D, int NW, int MT, int BC>
void fwd_launch(const Params& p, int B, cudaStream_t st) {
  constexpr int BR = NW * 16 * MT;
  const std::size_t smem = static_cast<std::size_t>(BR + 4 * BC) * D * sizeof(bf16);
  launch(fwd_kernel<D, NW, MT, BC>, dim3((p.T + BR - 1) / BR, p.Hq, B), NW * 32, smem, st, p, D == 64 && MT == 1);
}
template <int D, int NW, int MT, int BI>
void bwd_launch(const Params& p, int B, cudaStream_t st) {
  constexpr int BR = NW * 16 * MT;
  const int rows_per_block = 256 / 32;
  const std::size_t rows = static_cast<std::size_t>(B) * p.T * p.Hq;
  delta_kernel<D><<<static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block), 256, 0, st>>>(p);
  LAR_CUDA_LAUNCHED();
  const std::size_t smem_kv = static_cast<std::size_t>(2 * BR + 4 * BI) * D * sizeof(bf16) + 4 * BI * sizeof(float);
  launch(dkdv_kernel<D, NW, MT, BI>, dim3((p.S + BR - 1) / BR, p.Hkv, B), NW * 32, smem_kv, st, p, true);
  const std::size_t smem_q = static_cast<std::size_t>(2 * BR + 4 * BI) * D * sizeof(bf16);
  launch(dq_kernel<D, NW, MT, BI>, dim3((p.T + BR - 1) / BR, p.Hq, B), NW * 32, smem_q, st, p, true);
}
template <int D>
void fwd_impl(const Params& p, int B, int tiles, cudaStream_t st) {
  if (tiles == 0)
    fwd_launch<D, 4, 1, 64>(p, B, st);
  else if constexpr (D == 64)
    fwd_launch<64, 4, 2, 64>(p, B, st);
  else
    fwd_launch<128, 8, 1, 64>(p, B, st);
}
template <int D>
void bwd_impl(const Params& p, int B, int tiles, cudaStream_t st) {
  if (tiles == 0)
    bwd_launch<D, 4, 1, D == 64 ? 64 : 32>(p, B, st);
  else if constexpr (D == 64)
    bwd_launch<64, 4, 2, 32>(p, B, st);
  else
    bwd_launch<128, 8, 1, 32>(p, B, st);
}

}  // namespace

void flash_attention_fwd(const FlashShape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,
                         cudaStream_t stream) {
  Params p = make_params(s);
  p.q = q, p.k = k, p.v = v, p.out = o, p.lse = lse;
  const int tiles = tiles_choice(s).fwd;
  if (s.D == 64)
    fwd_impl<64>(p, static_cast<int>(s.B), tiles, stream);
  else
    fwd_impl<128>(p, static_cast<int>(s.B), tiles, stream);
}

std::size_t flash_attention_bwd_workspace_bytes(const FlashShape& s) {
  return static_cast<std::size_t>(s.B * s.Hq * s.T) * sizeof(float);
}

void flash_attention_bwd(const FlashShape& s, const bf16* q, const bf16* k, const bf16* v, const bf16* o,
                         const float* lse, const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                         cudaStream_t stream) {
  Params p = make_params(s);
  if (workspace == nullptr) throw RuntimeError("flash attention: backward needs a workspace");
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse_in = lse, p.dout = dout;
  p.dq = dq, p.dk = dk, p.dv = dv, p.delta = static_cast<float*>(workspace);
  const int tiles = tiles_choice(s).bwd;
  if (s.D == 64)
    bwd_impl<64>(p, static_cast<int>(s.B), tiles, stream);
  else
    bwd_impl<128>(p, static_cast<int>(s.B), tiles, stream);
}

}  // namespace lar::kernels::cuda::attention
