#pragma once
// Hopper warpgroup MMA (wgmma, sm_90a; HGMMA in SASS) for the 64×64×64 bf16 products of the
// chunk kernels, with the operands read by the tensor cores straight from shared memory (no
// ldmatrix: dev/perf-history.md, "CCQ: warp-specialised kernels", found the mma.sync kernels bound by it).
//
// Tile layout ("swizzled tile"): a 64 × 64 bf16 tile, 128 bytes a row, the 16-byte chunk c of
// row r stored at chunk c ^ (r & 7) (the 128-byte swizzle of the wgmma descriptors; every
// warp pattern the chunk kernels use — 8 rows × 4 words, fragment rows, ldmatrix rows — then
// hits 32 different banks). Tiles start on 1024-byte boundaries. swz(r, c) is the element
// index of (r, c). A tile holds either orientation of a product's operand:
//   A (m × k): stored [m][k] ("K-major", a_km = false) or [k][m] (a_km = true);
//   B (k × n): stored [n][k] ("K-major", b_kn = false) or [k][n] (b_kn = true).
// (The flags are those of chunk_common.cuh's gemm<A_KM, B_KN>.)
//
// mma_64x64<a_km, b_kn>(c, A, B, wn): c += A·B for the 8 warps of a team (two warpgroups,
// warp w = 4·wn + wm): warpgroup wn computes columns 32·wn .. 32·wn + 31 with four
// wgmma.m64n32k16, so each thread's accumulators are exactly chunk_common.cuh's Acc fragment
// (row 16·wm + g (+8), column 32·wn + 8·nt + 2·tig (+1)). Discipline (PTX ISA, HOPPER.md):
// whoever wrote the operand tiles with ordinary stores or cp.async runs fence_async_smem()
// before the barrier that precedes the product; wgmma.fence before the first wgmma (the
// accumulators were written by ordinary instructions), one commit group, wait 0 before the
// accumulators are read and before the tiles may be overwritten. Batch several products
// between begin() and end() to wait once.
//
// Compiled for plain sm_90 (the build's second target) the same calls run ldmatrix + mma.sync
// on the same swizzled tiles (kWgmma says which one a pass compiled).
// Tests: kernels/ccq/test_ccq_cuda.cpp (WgmmaTileProduct: every orientation, both paths,
// against a CPU product on random data).
#include <cuda_bf16.h>

#include <cstdint>

namespace lar::kernels::cuda::linear::wg {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kWgmma = true;
#else
constexpr bool kWgmma = false;
#endif

__host__ __device__ constexpr int swz(int r, int c) { return r * 64 + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7); }
constexpr int kTileBytes = 64 * 64 * 2;

__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
// The dynamic shared memory rounded up to the next 1024-byte boundary (callers allocate 1 KB more).
__device__ __forceinline__ unsigned char* align1k(unsigned char* p) {
  return p + ((1024u - (saddr(p) & 1023u)) & 1023u);
}

// Ordinary shared-memory writes (stores, cp.async) → visible to the tensor cores' async proxy.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading byte offset (K-major:
// unused, 1; MN-major: the next 64-wide atom, unused at our widths), stride byte offset 1024
// (the next 8 rows).
__device__ __forceinline__ uint64_t desc(uint32_t addr, bool k_major) {
  uint64_t d = static_cast<uint64_t>((addr & 0x3FFFFu) >> 4);
  d |= static_cast<uint64_t>(k_major ? 1u : 64u) << 16;
  d |= static_cast<uint64_t>(64u) << 32;
  d |= static_cast<uint64_t>(1u) << 62;
  return d;
}

__device__ __forceinline__ void begin() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// commit() closes the group of products issued since begin(); wait() returns once they are
// done (work that touches neither their accumulators nor writes their tiles may go between).
__device__ __forceinline__ void commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N = 0>  // returns once at most N committed groups are still running
__device__ __forceinline__ void wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void end() {
  commit();
  wait();
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (64 × 32 per warpgroup, fp32) += A (64 × 16) · B (16 × 32); TA/TB: 1 = operand MN-major.
template <int TA, int TB>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[4][4], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB)
      : "memory");
}
#else
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(saddr(p)));
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(saddr(p)));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// Issue c += A·B (between begin() and end()); wn = the warpgroup's index in its team of 8 warps.
template <bool A_KM, bool B_KN>
__device__ __forceinline__ void issue(float (&c)[4][4], const __nv_bfloat16* A, const __nv_bfloat16* B, int wn) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint32_t a = saddr(A), b = saddr(B) + static_cast<uint32_t>(wn) * (B_KN ? 64u : 4096u);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n32k16<A_KM ? 1 : 0, B_KN ? 1 : 0>(c, desc(a + kk * (A_KM ? 2048u : 32u), !A_KM),
                                                desc(b + kk * (B_KN ? 2048u : 32u), !B_KN));
#else
  const int lane = threadIdx.x & 31, wm = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[4];
    if (!A_KM)
      ldsm4(a, A + swz(16 * wm + (lane & 15), 16 * kk + (lane >> 4) * 8));
    else
      ldsm4t(a, A + swz(16 * kk + (lane & 7) + ((lane >> 4) << 3), 16 * wm + ((lane >> 3) & 1) * 8));
#pragma unroll
    for (int nn = 0; nn < 2; ++nn) {
      const int n0 = 32 * wn + 16 * nn;
      uint32_t b[4];
      if (!B_KN)
        ldsm4(b, B + swz(n0 + (lane & 7) + ((lane >> 4) << 3), 16 * kk + ((lane >> 3) & 1) * 8));
      else
        ldsm4t(b, B + swz(16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3), n0 + (lane >> 4) * 8));
      mma16816(c[2 * nn], a, b[0], b[1]);
      mma16816(c[2 * nn + 1], a, b[2], b[3]);
    }
  }
#endif
}

// c += A·B, complete on return.
template <bool A_KM, bool B_KN>
__device__ __forceinline__ void mma_64x64(float (&c)[4][4], const __nv_bfloat16* A, const __nv_bfloat16* B, int wn) {
  begin();
  issue<A_KM, B_KN>(c, A, B, wn);
  end();
}

// cp.async of a [64][64] bf16 block (rows `stride` elements apart, rows ≥ n zero-filled) into a
// swizzled tile by `nthreads` threads (thread index t).
__device__ __forceinline__ void load_tile_async(__nv_bfloat16* s, const __nv_bfloat16* g, size_t stride, int n, int t,
                                                int nthreads) {
  for (int i = t; i < 64 * 8; i += nthreads) {
    const int r = i >> 3, c = i & 7;
    const bool ok = r < n;
    const __nv_bfloat16* src = ok ? g + r * stride + c * 8 : g;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr(s + swz(r, 8 * c))), "l"(src),
                 "r"(ok ? 16 : 0));
  }
}

}  // namespace lar::kernels::cuda::linear::wg
