// The CUDA backend's embedding ops: the row gather forward, and the backward as a sort of the
// token ids (cub's radix sort) and one deterministic sum per table row (no atomics).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/backend_device.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_backend_internal.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda {

namespace {

// ---------------------------------------------------------------- embedding
__global__ void embedding_fwd_kernel(const int* ids, const float* table, float* out, int64_t n, int64_t d) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * d; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t row = i / d, col = i % d;
    out[i] = table[static_cast<int64_t>(ids[row]) * d + col];
  }
}

// The same with a warp per token row and 16-byte accesses (d % 4 == 0, 16-byte aligned rows):
// the scalar kernel's 64-bit division per element made it slower than its bytes.
__global__ void embedding_fwd_rows(const int* __restrict__ ids, const float4* __restrict__ table,
                                   float4* __restrict__ out, int64_t n, int64_t d4) {
  const int64_t row = blockIdx.x * (int64_t)(blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (row >= n) return;
  const float4* src = table + static_cast<int64_t>(ids[row]) * d4;
  float4* dst = out + row * d4;
#pragma unroll 4
  for (int64_t c = threadIdx.x % kWarp; c < d4; c += kWarp) dst[c] = src[c];
}

__global__ void iota_kernel(int* x, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = static_cast<int>(i);
}

// The backward over token positions sorted by id (a stable radix sort: positions of one id
// stay in token order). Block i handles the run of equal ids that starts at sorted position
// i (other blocks exit at once); its warps take 4-column groups (lane c: columns 4c…4c+3
// of a 128-column chunk) and add the run's dout rows four at a time (four loads in flight)
// but in token order, starting from the table row's old value: no atomics, the same bits
// as a sequential loop. Ids outside [0, V) are skipped. d % 4 == 0, 16-byte aligned rows.
constexpr int kEmbWarps = 8;
__global__ void __launch_bounds__(32 * kEmbWarps) embedding_bwd_sorted_kernel(const int* keys, const int* pos,
                                                                              const float* dout, float* dtable,
                                                                              int64_t n, int64_t d, int64_t V) {
  const int64_t i = blockIdx.x;
  const int id = keys[i];
  if ((i > 0 && keys[i - 1] == id) || id < 0 || id >= V) return;
  const int lane = threadIdx.x % kWarp, wid = threadIdx.x / kWarp;
  int64_t e = i;  // the run's end: keys are sorted, so equal ids are contiguous
  for (;;) {
    const int64_t j = e + lane;
    const unsigned same = __ballot_sync(0xffffffffu, j < n && keys[j] == id);
    if (same == 0xffffffffu) {
      e += kWarp;
      continue;
    }
    e += __ffs(~same) - 1;
    break;
  }
  for (int64_t c = (wid * (int64_t)kWarp + lane) * 4; c < d; c += kEmbWarps * kWarp * 4) {
    float* row = dtable + static_cast<int64_t>(id) * d + c;
    float4 acc = *reinterpret_cast<const float4*>(row);
    int64_t j = i;
    for (; j + 4 <= e; j += 4) {
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = *reinterpret_cast<const float4*>(dout + static_cast<int64_t>(pos[j + u]) * d + c);
#pragma unroll
      for (int u = 0; u < 4; ++u) acc.x += v[u].x, acc.y += v[u].y, acc.z += v[u].z, acc.w += v[u].w;
    }
    for (; j < e; ++j) {
      const float4 v = *reinterpret_cast<const float4*>(dout + static_cast<int64_t>(pos[j]) * d + c);
      acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
    }
    *reinterpret_cast<float4*>(row) = acc;
  }
}

// The same for any d (one column per thread).
__global__ void embedding_bwd_sorted_scalar(const int* keys, const int* pos, const float* dout, float* dtable,
                                            int64_t n, int64_t d, int64_t V) {
  const int64_t i = blockIdx.x;
  const int id = keys[i];
  if ((i > 0 && keys[i - 1] == id) || id < 0 || id >= V) return;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float* row = dtable + static_cast<int64_t>(id) * d + c;
    float acc = *row;
    for (int64_t j = i; j < n && keys[j] == id; ++j) acc += dout[static_cast<int64_t>(pos[j]) * d + c];
    *row = acc;
  }
}

}  // namespace

void CudaBackend::embedding_fwd(const Tensor& ids, const Tensor& table, const Tensor& out) {
  OpTimer timer(*this, "embedding");
  int64_t n = ids.numel(), d = table.last();
  if (n == 0) return;
  if (d % 4 == 0 && aligned16(table) && aligned16(out)) {
    embedding_fwd_rows<<<static_cast<unsigned>((n + 7) / 8), 256, 0, stream_>>>(
        ids.ptr<int>(), reinterpret_cast<const float4*>(table.data), reinterpret_cast<float4*>(out.data), n, d / 4);
  } else {
    embedding_fwd_kernel<<<blocks_for(n * d, 256), 256, 0, stream_>>>(ids.ptr<int>(), table.ptr<float>(),
                                                                      out.ptr<float>(), n, d);
  }
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::embedding_bwd(const Tensor& ids, const Tensor& dout, const Tensor& dtable) {
  OpTimer timer(*this, "embedding");
  const int64_t n = ids.numel(), d = dtable.last(), V = dtable.rows();
  touch(dtable);
  if (n == 0) return;
  if (n >= (int64_t(1) << 31)) throw RuntimeError("cuda embedding_bwd: too many tokens");
  // Token positions sorted by id on the device (cub's stable radix sort over the bits that
  // V needs), so no host round trip stalls the stream.
  int end_bit = 1;
  while (end_bit < 31 && (int64_t(1) << end_bit) < V) ++end_bit;
  std::size_t temp = 0;
  LAR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp, ids.ptr<int>(), static_cast<int*>(nullptr),
                                                 static_cast<int*>(nullptr), static_cast<int*>(nullptr),
                                                 static_cast<int>(n), 0, end_bit, stream_));
  const std::size_t ints = 3 * static_cast<std::size_t>(n) + (temp + 3) / 4 + 64;
  if (ints > idx_scratch_n_) {
    if (idx_scratch_) {
      synchronize();
      track_free(idx_scratch_);
      LAR_CUDA_CHECK(cudaFree(idx_scratch_));
    }
    LAR_CUDA_CHECK(cudaMalloc(&idx_scratch_, ints * sizeof(int32_t)));
    track_alloc(idx_scratch_, ints * sizeof(int32_t));
    idx_scratch_n_ = ints;
  }
  int32_t* keys = idx_scratch_;
  int32_t* pos_in = keys + n;
  int32_t* pos = pos_in + n;
  void* tmp = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(pos + n) + 255) / 256 * 256);
  iota_kernel<<<blocks_for(n, 256), 256, 0, stream_>>>(pos_in, n);
  LAR_CUDA_LAUNCHED();
  LAR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(tmp, temp, ids.ptr<int>(), keys, pos_in, pos, static_cast<int>(n), 0,
                                                 end_bit, stream_));
  const unsigned blocks = static_cast<unsigned>(n);
  if (d % 4 == 0 && aligned16(dout) && aligned16(dtable))
    embedding_bwd_sorted_kernel<<<blocks, 32 * kEmbWarps, 0, stream_>>>(keys, pos, dout.ptr<float>(),
                                                                        dtable.ptr<float>(), n, d, V);
  else
    embedding_bwd_sorted_scalar<<<blocks, 128, 0, stream_>>>(keys, pos, dout.ptr<float>(), dtable.ptr<float>(), n, d, V);
  LAR_CUDA_LAUNCHED();
}

}  // namespace lar::kernels::cuda
