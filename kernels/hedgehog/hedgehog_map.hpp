// The Hedgehog feature map (Zhang et al. 2024, "The Hedgehog & the Porcupine"), per head:
//   u = (I + Δ) a + b,   φ(a) = [softmax(u), softmax(−u)] ∈ R^{2d}
// Δ [d,d] is the learned map's offset from the identity (the map starts as the identity),
// b [d] its bias. Raw arrays, one token of one head; the backward accumulates dΔ and db.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace lar::kernels::cpu::linear {

template <class T>
void hedgehog_forward(const T* a, const T* delta, const T* bias, int d, T* phi) {
  std::vector<T> u(d);
  for (int i = 0; i < d; ++i) {
    T s = a[i] + bias[i];
    for (int j = 0; j < d; ++j) s += delta[(std::size_t)i * d + j] * a[j];
    u[i] = s;
  }
  for (int half = 0; half < 2; ++half) {
    const T sign = half ? T(-1) : T(1);
    T mx = sign * u[0];
    for (int i = 1; i < d; ++i) mx = std::max(mx, sign * u[i]);
    T sum = 0;
    for (int i = 0; i < d; ++i) sum += (phi[half * d + i] = std::exp(sign * u[i] - mx));
    for (int i = 0; i < d; ++i) phi[half * d + i] /= sum;
  }
}

// dphi [2d] → da [d] (overwritten); dΔ, db accumulated. phi is the forward's output.
template <class T>
void hedgehog_backward(const T* a, const T* delta, int d, const T* phi, const T* dphi, T* da, T* ddelta, T* dbias) {
  std::vector<T> du(d, T(0));
  for (int half = 0; half < 2; ++half) {
    const T sign = half ? T(-1) : T(1);
    const T* s = phi + half * d;
    const T* ds = dphi + half * d;
    T dot = 0;
    for (int i = 0; i < d; ++i) dot += s[i] * ds[i];
    for (int i = 0; i < d; ++i) du[i] += sign * s[i] * (ds[i] - dot);
  }
  for (int j = 0; j < d; ++j) da[j] = du[j];
  for (int i = 0; i < d; ++i) {
    dbias[i] += du[i];
    for (int j = 0; j < d; ++j) {
      ddelta[(std::size_t)i * d + j] += du[i] * a[j];
      da[j] += du[i] * delta[(std::size_t)i * d + j];
    }
  }
}

}  // namespace lar::kernels::cpu::linear
