// Mamba-3 recurrence pieces on raw arrays, one (batch, head) sequence, rank R (SISO: R = 1):
//   data-dependent RoPE: φ_t = φ_{t−1} + θ_t·Δ_t (per rotated pair i < na), q_{t,r} = R(φ_t) q̂_{t,r},
//     k_{t,r} = R(φ_t) k̂_{t,r} (pairs (2i, 2i+1); the remaining channels are not rotated) — the
//     complex-valued diagonal state of Mamba-3 written as rotations of B and C;
//   trapezoidal discretisation: α_t = exp(a_t), β_t = (1−λ_t)Δ_t α_t, γ_t = λ_t Δ_t,
//     S_t = α_t S_{t−1} + β_t Σ_r v_{t−1,r} k_{t−1,r}ᵀ + γ_t Σ_r v_{t,r} k_{t,r}ᵀ,  o_{t,r} = S_t q_{t,r}.
//   MIMO (R > 1) writes R rank-1 terms per token into the one state and reads it with R queries.
// The step below is the reference recurrence (and the decode path). The chunkwise training
// form maps the same recurrence onto the scalar-decay core: token j is written with the
// weight c_j = γ_j + (1−λ_{j+1})Δ_{j+1} (its own γ plus the β share the next token adds), and
// the diagonal term takes back the next token's share: o_t = core_t − (1−λ_{t+1})Δ_{t+1}(q_t·k_t) v_t.
// With R > 1 each token becomes R consecutive rows of the core (decay on the first), and the
// diagonal adds the same-token rows the causal core leaves out:
//   o_{t,r'} = core_{t,r'} + Σ_r (c_t·[r > r'] − (1−λ_{t+1})Δ_{t+1}) (q_{t,r'}·k_{t,r}) v_{t,r}.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

namespace lar::kernels::cpu::ssm {

// y = R(φ) x over the first na pairs; y may alias x.
template <class T>
inline void rotate(const T* x, const T* phi, int n, int na, T* y) {
  for (int i = 0; i < na; ++i) {
    const T c = std::cos(phi[i]), s = std::sin(phi[i]);
    const T a0 = x[2 * i], a1 = x[2 * i + 1];
    y[2 * i] = a0 * c - a1 * s;
    y[2 * i + 1] = a0 * s + a1 * c;
  }
  for (int i = 2 * na; i < n; ++i) y[i] = x[i];
}

// Backward of y = R(φ) x: dx (overwritten) and dφ (accumulated) from dy, with y the output.
template <class T>
inline void rotate_bwd(const T* y, const T* phi, const T* dy, int n, int na, T* dx, T* dphi) {
  for (int i = 0; i < na; ++i) {
    const T c = std::cos(phi[i]), s = std::sin(phi[i]);
    const T g0 = dy[2 * i], g1 = dy[2 * i + 1];
    dphi[i] += g0 * -y[2 * i + 1] + g1 * y[2 * i];
    dx[2 * i] = g0 * c + g1 * s;
    dx[2 * i + 1] = -g0 * s + g1 * c;
  }
  for (int i = 2 * na; i < n; ++i) dx[i] = dy[i];
}

// The decode state of one head: rotation angles, S [P, N], the previous rotated keys [R, N]
// and values [R, P].
template <class T>
struct Mamba3State {
  std::vector<T> phi, S, k_prev, v_prev;
  Mamba3State(int N, int P, int na, int R = 1)
      : phi(na, T(0)), S((std::size_t)P * N, T(0)), k_prev((std::size_t)R * N, T(0)), v_prev((std::size_t)R * P, T(0)) {}
};

// One token: q̂, k̂ [R, N] (normalised, biased, not yet rotated), v [R, P], theta [na] (angle
// rates), a = log decay, dt = Δ, lam = λ. Writes o [R, P] = S_t q_{t,r}.
template <class T>
void mamba3_step(Mamba3State<T>& st, const T* qh, const T* kh, const T* v, const T* theta, T a, T dt, T lam, int N,
                 int P, int na, int R, T* o) {
  for (int i = 0; i < na; ++i) st.phi[i] += theta[i] * dt;
  std::vector<T> q((std::size_t)R * N), k((std::size_t)R * N);
  for (int r = 0; r < R; ++r) {
    rotate(qh + (std::size_t)r * N, st.phi.data(), N, na, &q[(std::size_t)r * N]);
    rotate(kh + (std::size_t)r * N, st.phi.data(), N, na, &k[(std::size_t)r * N]);
  }
  const T alpha = std::exp(a), beta = (T(1) - lam) * dt * alpha, gamma = lam * dt;
  for (int p = 0; p < P; ++p) {
    T* Sp = &st.S[(std::size_t)p * N];
    for (int i = 0; i < N; ++i) {
      T w = alpha * Sp[i];
      for (int r = 0; r < R; ++r)
        w += beta * st.v_prev[(std::size_t)r * P + p] * st.k_prev[(std::size_t)r * N + i] +
             gamma * v[(std::size_t)r * P + p] * k[(std::size_t)r * N + i];
      Sp[i] = w;
    }
    for (int r = 0; r < R; ++r) {
      T acc = 0;
      for (int i = 0; i < N; ++i) acc += Sp[i] * q[(std::size_t)r * N + i];
      o[(std::size_t)r * P + p] = acc;
    }
  }
  st.k_prev = k;
  st.v_prev.assign(v, v + (std::size_t)R * P);
}

}  // namespace lar::kernels::cpu::ssm
