// Shared by the model-level GPU tests (one step or a run on cuda against the CPU backend):
// backends by kind and precision, a random batch, and the relative RMS error of fp32
// vectors (parameters, gradients, updates) they check against.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "trainer/data/dataset.hpp"

namespace lar::gpu_test {

// deterministic: the backend's bit-reproducible mode; cuda: the run's cuda keys.
inline std::unique_ptr<kernels::Backend> backend(const std::string& kind, const std::string& precision,
                                                 bool deterministic = false,
                                                 const kernels::Backend::Options::Cuda& cuda = {}) {
  kernels::Backend::Options o;
  o.precision = precision;
  o.deterministic = deterministic;
  o.cuda = cuda;
  return kernels::make_backend(kind, 2, kernels::DType::f32, o);
}

// B×T random tokens and targets over a vocabulary of V; every mask_every-th position is
// masked out of the loss.
inline data::Batch random_batch(int B, int T, int V, uint64_t seed, int mask_every) {
  std::mt19937_64 rng(seed);
  data::Batch b;
  b.batch = B;
  b.seq_len = T;
  for (int i = 0; i < B * T; ++i) {
    b.inputs.push_back(static_cast<int32_t>(rng() % V));
    b.targets.push_back(static_cast<int32_t>(rng() % V));
    b.loss_mask.push_back(i % mask_every == 0 ? 0.0f : 1.0f);
  }
  return b;
}

// ‖a − ref‖ / ‖ref‖; infinite as soon as a holds a non-finite value.
inline double rel_rms(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += double(a[i] - ref[i]) * (a[i] - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace lar::gpu_test
