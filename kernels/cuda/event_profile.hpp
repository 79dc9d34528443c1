#pragma once
// LAR_CUDA_PROFILE=1: device time per named region, from a pair of CUDA events recorded
// around its launches. Off by default: then a Scope costs one branch. The backend's ops
// and the linear-mixer layer kernels each keep one (lar-bench gpu-train prints both).
#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

namespace lar::kernels::cuda {

// LAR_CUDA_PROFILE=1 in the environment (read once).
bool profiling_enabled();

class EventProfile {
 public:
  EventProfile() = default;
  ~EventProfile();
  EventProfile(const EventProfile&) = delete;
  EventProfile& operator=(const EventProfile&) = delete;

  // Brackets a region of work on `stream` when `on`.
  class Scope {
   public:
    Scope(EventProfile& profile, bool on, const char* name, cudaStream_t stream);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    EventProfile& profile_;
    const char* name_;
    cudaStream_t stream_;
    cudaEvent_t a_ = nullptr;
  };

  bool empty() const { return spans_.empty(); }
  // Seconds per name since the last report, largest first. The caller synchronizes the
  // streams first (the events must have completed).
  std::vector<std::pair<std::string, double>> report();

 private:
  struct Span {
    const char* name;
    cudaEvent_t a, b;
  };
  std::vector<Span> spans_;
};

}  // namespace lar::kernels::cuda
