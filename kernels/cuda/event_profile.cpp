#include "kernels/cuda/event_profile.hpp"

#include <algorithm>
#include <cstdlib>

#include "core/env.hpp"
#include "kernels/cuda/cuda_check.hpp"

namespace lar::kernels::cuda {

bool profiling_enabled() {
  static const bool on = env_flag("LAR_CUDA_PROFILE");
  return on;
}

EventProfile::~EventProfile() {
  for (const auto& s : spans_) cudaEventDestroy(s.a), cudaEventDestroy(s.b);
}

EventProfile::Scope::Scope(EventProfile& profile, bool on, const char* name, cudaStream_t stream)
    : profile_(profile), name_(name), stream_(stream) {
  if (!on) return;
  LAR_CUDA_CHECK(cudaEventCreate(&a_));
  LAR_CUDA_CHECK(cudaEventRecord(a_, stream_));
}

EventProfile::Scope::~Scope() {
  if (!a_) return;
  cudaEvent_t b = nullptr;
  if (cudaEventCreate(&b) == cudaSuccess && cudaEventRecord(b, stream_) == cudaSuccess)
    profile_.spans_.push_back({name_, a_, b});
}

std::vector<std::pair<std::string, double>> EventProfile::report() {
  std::vector<std::pair<std::string, double>> out;
  for (const auto& s : spans_) {
    float ms = 0;
    LAR_CUDA_CHECK(cudaEventElapsedTime(&ms, s.a, s.b));
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == s.name; });
    if (it == out.end()) out.emplace_back(s.name, ms * 1e-3);
    else it->second += ms * 1e-3;
    cudaEventDestroy(s.a);
    cudaEventDestroy(s.b);
  }
  spans_.clear();
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  return out;
}

}  // namespace lar::kernels::cuda
