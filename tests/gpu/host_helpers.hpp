// Shared by the model-level GPU tests (one step or a run on cuda against the CPU backend):
// backends by kind and precision, a random batch, the relative RMS error of fp32
// vectors (parameters, gradients, updates) they check against, and the loss curves of two
// runs of one config.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/run_dir.hpp"
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
// The relative RMS error of n values against ref (infinite if any value is not finite).
inline double rel_rms(const float* a, const float* ref, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += double(a[i] - ref[i]) * (a[i] - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}
inline double rel_rms(const std::vector<float>& a, const std::vector<float>& ref) {
  return rel_rms(a.data(), ref.data(), a.size());
}

// Rounded to bf16 (nearest even) and back: a mixed-precision layer reads its input in bf16, so
// tests give both backends exactly these values.
inline float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

// A host f32 array into a device tensor of dtype dt (converted on the device), and back.
inline kernels::Tensor to_device(kernels::Backend& be, kernels::Arena& ar, const std::vector<float>& h,
                                 kernels::DType dt, std::initializer_list<int64_t> shape) {
  kernels::Tensor f = ar.alloc(kernels::DType::f32, shape);
  be.upload(h.data(), f);
  if (dt == kernels::DType::f32) return f;
  kernels::Tensor t = ar.alloc(dt, shape);
  be.convert(f, t);
  return t;
}
inline std::vector<float> to_host(kernels::Backend& be, kernels::Arena& ar, const kernels::Tensor& t) {
  std::vector<float> h(static_cast<std::size_t>(t.numel()));
  kernels::Tensor f = t;
  if (t.dtype != kernels::DType::f32) {
    f = ar.alloc(kernels::DType::f32, t.shape());
    be.convert(t, f);
  }
  be.download(f, h.data());
  return h;
}

// The per-step losses of a run directory's metrics, in order.
inline std::vector<double> run_losses(const std::filesystem::path& dir) {
  std::vector<double> out;
  for (const auto& l : read_metrics(RunDir(dir).metrics_path()).lines)
    if (l.contains("loss")) out.push_back(l["loss"].get<double>());
  return out;
}

// A CUDA run's loss curve against the CPU run of the same config, init and data: both have
// `steps` losses, both learn (the last below 0.9 × the first), no step is more than 10%
// apart, and the means of the last 10 steps agree within 3%.
inline void expect_loss_curves_agree(const std::string& what, const std::filesystem::path& cpu,
                                     const std::filesystem::path& gpu, std::size_t steps = 60) {
  const auto lc = run_losses(cpu), lg = run_losses(gpu);
  ASSERT_EQ(lc.size(), steps) << what;
  ASSERT_EQ(lg.size(), steps) << what;
  double worst = 0, tail_c = 0, tail_g = 0;
  for (std::size_t i = 0; i < lc.size(); ++i) {
    worst = std::max(worst, std::abs(lg[i] - lc[i]) / lc[i]);
    if (i + 10 >= lc.size()) tail_c += lc[i] / 10, tail_g += lg[i] / 10;
  }
  std::printf("%s %zu steps: loss %.4f → %.4f (cpu) / %.4f → %.4f (cuda); worst step rel diff %.3g; last-10 mean "
              "%.4f vs %.4f\n", what.c_str(), steps, lc.front(), lc.back(), lg.front(), lg.back(), worst, tail_c, tail_g);
  EXPECT_LT(lc.back(), lc.front() * 0.9) << what;
  EXPECT_LT(lg.back(), lg.front() * 0.9) << what;
  EXPECT_LT(worst, 0.1) << what;
  EXPECT_NEAR(tail_g, tail_c, 0.03 * tail_c) << what;
}

}  // namespace lar::gpu_test
