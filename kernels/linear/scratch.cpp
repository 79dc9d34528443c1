#include "kernels/linear/scratch.hpp"

#include <cstdint>
#include <map>
#include <mutex>

#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda::linear {

cudaMemPool_t scratch_pool() {
  static std::mutex mu;
  static std::map<int, cudaMemPool_t> pools;
  int dev = 0;
  LAR_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = pools.find(dev);
  if (it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = dev;
  cudaMemPool_t pool = nullptr;
  LAR_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
  uint64_t keep = UINT64_MAX;
  LAR_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  pools.emplace(dev, pool);
  return pool;
}

Scratch::~Scratch() {
  for (void* p : ptrs_) cudaFreeAsync(p, stream_);
}

void* Scratch::get_bytes(size_t bytes) {
  void* ptr = nullptr;
  LAR_CUDA_CHECK(cudaMallocFromPoolAsync(&ptr, bytes, scratch_pool(), stream_));
  ptrs_.push_back(ptr);
  return ptr;
}

}  // namespace lar::kernels::cuda::linear
