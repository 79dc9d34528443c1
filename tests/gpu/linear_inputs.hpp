#pragma once
// Fresh random inputs of the linear families' 64-wide kernel tests (channel rule, CARVE, CCQ,
// the decodes), shared so that each family's test file draws them the same way.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

#include "kernels/linear/shape.hpp"
#include "tests/gpu/device_buffer.hpp"

namespace lar::gpu_test {

inline constexpr int kHeadDim = 64;

// The path a case forces ("fused", "chunked", or "" / "auto": the cost model), as the run's
// cuda.linear_path.
inline kernels::cuda::linear::PathChoice forced_path(const char* path) {
  return kernels::cuda::linear::kernel_choice(path, "auto", "auto", 0).path;
}

// Per-channel log-decays [B,T,H,64]. Mild: mostly log(0.5..1)·0.3 per token, 5% of the
// elements ×4 (as a trained gate). Strong: a tenth of every head's channels draw log-decays
// down to −16 per token, the rest mild. Extreme: a tenth down to −200 per token, another
// tenth exactly 0 (no decay), the rest mild — in-chunk spans far beyond any fp32 exponent.
enum class Gates { mild, strong, extreme };
inline const char* gates_name(Gates g) {
  return g == Gates::mild ? "" : g == Gates::strong ? " strong-gates" : " extreme-gates";
}
inline std::vector<double> make_gates(std::mt19937_64& rng, Gates kind, int B, int T, int H) {
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  std::vector<int> cls(static_cast<size_t>(H) * 64, 0);  // per (h, c): 0 mild, 1 steep, 2 none
  if (kind != Gates::mild)
    for (auto& c : cls) {
      const double u = ud(rng);
      c = u < 0.1 ? 1 : (kind == Gates::extreme && u < 0.2) ? 2 : 0;
    }
  const double steep = kind == Gates::extreme ? 200.0 : 16.0;
  std::vector<double> g(static_cast<size_t>(B) * T * H * 64);
  for (size_t i = 0; i < g.size(); ++i) {
    const int hc = static_cast<int>(i % (static_cast<size_t>(H) * 64));
    const double mild = std::log(0.5 + 0.5 * ud(rng)) * (ud(rng) < 0.05 ? 4.0 : 0.3);
    g[i] = static_cast<float>(cls[hc] == 1 ? -steep * ud(rng) : cls[hc] == 2 ? 0.0 : mild);
  }
  return g;
}

// Per-head slice of a [B,T,H,w] array into [T,w], and back.
inline std::vector<double> head(const std::vector<double>& x, int b, int h, int w, int T, int H) {
  std::vector<double> out(static_cast<size_t>(T) * w);
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < w; ++i)
      out[static_cast<size_t>(t) * w + i] = x[((static_cast<size_t>(b) * T + t) * H + h) * w + i];
  return out;
}
inline void unhead(std::vector<double>& x, const std::vector<double>& part, int b, int h, int w, int T, int H) {
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < w; ++i)
      x[((static_cast<size_t>(b) * T + t) * H + h) * w + i] = part[static_cast<size_t>(t) * w + i];
}

// Fresh random layer-like inputs: unit q, k rows, normal v and dO, per-channel log-decays
// (mostly mild, some strong), gates in (0, 1); all rounded to what the kernels read.
struct LinearInputs {
  int B, T, H;
  std::vector<double> q, k, v, dO, g, beta, b, w, bx, wsc;
  LinearInputs(std::mt19937_64& rng, int B_, int T_, int H_) : B(B_), T(T_), H(H_) {
    const size_t rows = static_cast<size_t>(B) * T * H, nx = rows * kHeadDim;
    std::normal_distribution<double> nd(0.0, 1.0);
    std::uniform_real_distribution<double> ud(0.0, 1.0);
    auto unit_rows = [&](std::vector<double>& x) {
      x.resize(nx);
      for (size_t r = 0; r < rows; ++r) {
        double s = 0;
        for (int i = 0; i < kHeadDim; ++i) s += (x[r * kHeadDim + i] = nd(rng)) * x[r * kHeadDim + i];
        for (int i = 0; i < kHeadDim; ++i) x[r * kHeadDim + i] = to_bf(x[r * kHeadDim + i] / std::sqrt(s));
      }
    };
    unit_rows(q), unit_rows(k);
    v.resize(nx), dO.resize(nx), g.resize(nx), beta.resize(rows), b.resize(nx), w.resize(nx), bx.resize(nx);
    wsc.resize(rows);
    for (auto& x : v) x = to_bf(nd(rng));
    for (auto& x : dO) x = to_bf(nd(rng));
    for (auto& x : g) x = static_cast<float>(std::log(0.5 + 0.5 * ud(rng)) * (ud(rng) < 0.05 ? 4.0 : 0.3));
    for (auto& x : beta) x = static_cast<float>(1.0 / (1.0 + std::exp(-nd(rng))));
    for (auto& x : b) x = to_bf(1.0 / (1.0 + std::exp(-nd(rng))));
    for (auto& x : w) x = to_bf(1.0 / (1.0 + std::exp(-nd(rng))));
    for (auto& x : bx) x = to_bf(nd(rng));
    for (auto& x : wsc) x = static_cast<float>(1.0 / (1.0 + std::exp(-nd(rng))));
  }
};

}  // namespace lar::gpu_test
