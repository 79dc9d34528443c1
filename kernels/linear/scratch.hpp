#pragma once
// Stream-ordered scratch for the linear kernels' per-chunk / per-group terms (the delta rule's
// two-phase path, CCQ's chunk-parallel passes). It comes from one private memory pool per
// device that keeps its memory between calls: a layer makes the same requests every step, so
// nothing is allocated after the first (the default pool would unmap it at every synchronisation).
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

namespace lar::kernels::cuda::linear {

cudaMemPool_t scratch_pool();  // this device's pool (created on first use)

// Buffers taken with get() are freed, stream-ordered, when the Scratch goes out of scope.
class Scratch {
 public:
  explicit Scratch(cudaStream_t stream) : stream_(stream) {}
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T>
  T* get(size_t count) {
    return static_cast<T*>(get_bytes(count * sizeof(T)));
  }

 private:
  void* get_bytes(size_t bytes);
  cudaStream_t stream_;
  std::vector<void*> ptrs_;
};

}  // namespace lar::kernels::cuda::linear
