// The CUDA backend's memory: tracked allocations (live and peak bytes), the scratch buffers,
// growable blocks in reserved address space (CUDA's virtual memory management, through the
// driver entry points so that no libcuda link is needed), and the host/device copies.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <type_traits>

#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_backend_internal.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda {

void CudaBackend::track_alloc(void* p, std::size_t bytes) {
  allocs_.emplace_back(p, bytes);
  live_bytes_ += bytes;
  peak_bytes_ = std::max(peak_bytes_, live_bytes_);
}

void CudaBackend::track_free(void* p) {
  for (std::size_t i = 0; i < allocs_.size(); ++i)
    if (allocs_[i].first == p) {
      live_bytes_ -= allocs_[i].second;
      allocs_[i] = allocs_.back();
      allocs_.pop_back();
      return;
    }
}

void* CudaBackend::scratch_bytes(std::size_t bytes) {
  if (bytes > big_scratch_n_) {
    if (big_scratch_) {
      synchronize();
      track_free(big_scratch_);
      LAR_CUDA_CHECK(cudaFree(big_scratch_));
      big_scratch_ = nullptr;
    }
    LAR_CUDA_CHECK(cudaMalloc(&big_scratch_, bytes));
    track_alloc(big_scratch_, bytes);
    big_scratch_n_ = bytes;
  }
  return big_scratch_;
}

double* CudaBackend::scratch_doubles(std::size_t n) {
  if (n > scratch_n_) {
    if (scratch_) LAR_CUDA_CHECK(cudaFree(scratch_));
    LAR_CUDA_CHECK(cudaMalloc(&scratch_, n * sizeof(double)));
    scratch_n_ = n;
  }
  return scratch_;
}

void* CudaBackend::alloc_bytes(std::size_t bytes) {
  void* p = nullptr;
  LAR_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 64));
  track_alloc(p, bytes ? bytes : 64);
  return p;
}

// ---- growable blocks (CUDA virtual memory management through the driver entry points) ----

namespace {
struct Vmm {
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) addr_free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  bool ok = false;
};
const Vmm& vmm() {
  static const Vmm v = [] {
    Vmm x;
    auto get = [](const char* name, auto& fn) {
      void* f = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess || f == nullptr) {
        cudaGetLastError();
        return false;
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(f);
      return true;
    };
    x.ok = get("cuMemAddressReserve", x.reserve) && get("cuMemAddressFree", x.addr_free) &&
           get("cuMemCreate", x.create) && get("cuMemRelease", x.release) && get("cuMemMap", x.map) &&
           get("cuMemUnmap", x.unmap) && get("cuMemSetAccess", x.set_access) &&
           get("cuMemGetAllocationGranularity", x.granularity);
    return x;
  }();
  return v;
}
}  // namespace

CudaBackend::Growable* CudaBackend::find_growable(void* p) {
  for (Growable* g : growables_)
    if (reinterpret_cast<void*>(g->base) == p) return g;
  return nullptr;
}

// Backs [mapped, bytes) of g with one new physical chunk; false (nothing changed) on failure.
bool CudaBackend::map_more(Growable& g, std::size_t bytes) {
  const Vmm& v = vmm();
  const std::size_t want = (bytes + g.gran - 1) / g.gran * g.gran;
  if (want <= g.mapped) return true;
  if (want > g.reserved) return false;
  const std::size_t chunk = want - g.mapped;
  CUmemGenericAllocationHandle h{};
  if (v.create(&h, chunk, &g.prop, 0) != CUDA_SUCCESS) return false;
  if (v.map(g.base + g.mapped, chunk, 0, h, 0) != CUDA_SUCCESS) {
    v.release(h);
    return false;
  }
  CUmemAccessDesc desc{};
  desc.location = g.prop.location;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (v.set_access(g.base + g.mapped, chunk, &desc, 1) != CUDA_SUCCESS) {
    v.unmap(g.base + g.mapped, chunk);
    v.release(h);
    return false;
  }
  g.chunks.emplace_back(h, chunk);
  g.mapped = want;
  for (auto& a : allocs_)
    if (a.first == reinterpret_cast<void*>(g.base)) a.second += chunk;
  live_bytes_ += chunk;
  peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  return true;
}

void* CudaBackend::alloc_growable(std::size_t bytes) {
  const Vmm& v = vmm();
  if (!v.ok) return alloc_bytes(bytes);
  auto g = std::make_unique<Growable>();
  g->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  g->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  g->prop.location.id = device_;
  if (v.granularity(&g->gran, &g->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || g->gran == 0)
    return alloc_bytes(bytes);
  // Address space for the whole device memory (cheap: nothing is backed until mapped).
  g->reserved = std::max(total_mem_, bytes + g->gran) / g->gran * g->gran + g->gran;
  if (v.reserve(&g->base, g->reserved, 0, 0, 0) != CUDA_SUCCESS) return alloc_bytes(bytes);
  track_alloc(reinterpret_cast<void*>(g->base), 0);
  if (!map_more(*g, std::max<std::size_t>(bytes, 1))) {
    track_free(reinterpret_cast<void*>(g->base));
    v.addr_free(g->base, g->reserved);
    return alloc_bytes(bytes);
  }
  growables_.push_back(g.release());
  return reinterpret_cast<void*>(growables_.back()->base);
}

bool CudaBackend::grow_bytes(void* p, std::size_t bytes) {
  Growable* g = find_growable(p);
  return g != nullptr && map_more(*g, bytes);
}

void CudaBackend::free_bytes(void* p) {
  if (p) {
    synchronize();
    // Freeing the registered weights unregisters them: memory allocated later at those
    // addresses must not be read through the (then meaningless) mirror.
    std::size_t size = 0;
    for (const auto& a : allocs_)
      if (a.first == p) size = a.second;
    const char* c = static_cast<const char*>(p);
    if (weights_ && c <= weights_ && weights_ < c + size) {
      weights_ = nullptr;
      weights_bytes_ = 0;
      mirror_fresh_ = false;
      if (mirror_) {
        track_free(mirror_);
        LAR_CUDA_CHECK(cudaFree(mirror_));
        mirror_ = nullptr;
      }
    }
    if (Growable* g = find_growable(p)) {
      const Vmm& v = vmm();
      CUdeviceptr at = g->base;
      for (auto& [h, n] : g->chunks) {  // each mapping separately, in address order
        v.unmap(at, n);
        v.release(h);
        at += n;
      }
      v.addr_free(g->base, g->reserved);
      track_free(p);
      growables_.erase(std::find(growables_.begin(), growables_.end(), g));
      delete g;
      return;
    }
    track_free(p);
    LAR_CUDA_CHECK(cudaFree(p));
  }
}

void CudaBackend::upload(const void* host, const Tensor& dst) {
  touch(dst);
  LAR_CUDA_CHECK(cudaMemcpyAsync(dst.data, host, dst.bytes(), cudaMemcpyHostToDevice, stream_));
  synchronize();
}

void CudaBackend::download(const Tensor& src, void* host) {
  LAR_CUDA_CHECK(cudaMemcpyAsync(host, src.data, src.bytes(), cudaMemcpyDeviceToHost, stream_));
  synchronize();
}

void CudaBackend::zero(const Tensor& t) {
  OpTimer timer(*this, "zero");
  touch(t);
  LAR_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.bytes(), stream_));
}

void CudaBackend::copy(const Tensor& src, const Tensor& dst) {
  OpTimer timer(*this, "copy");
  if (src.numel() != dst.numel() || src.dtype != dst.dtype)
    throw RuntimeError("cuda copy: " + src.shape_str() + " → " + dst.shape_str());
  touch(dst);
  LAR_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, stream_));
}

}  // namespace lar::kernels::cuda
