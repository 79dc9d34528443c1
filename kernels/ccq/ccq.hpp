// CCQ (Curvature-Conditioned Query, docs/spec.md §4): the read-side correction
//   q_clean_t = (I − λ_t Σ_t) q_t,   Σ_t = C̄_t − μ_t μ_tᵀ  (centered) or C̄_t (uncentered)
//   C̄_t = (1/t) Σ_{j≤t} k_j k_jᵀ,    μ_t = (1/t) Σ_{j≤t} k_j       (1/t, current key included)
// on L2-normalised q, k of one (batch, head) sequence. The backbone then reads S_t q_clean_t.
// Σ is never formed: Σ_t q = (K_t q)/t − m_t (m_tᵀ q)/t² with the running sums
// K_t = Σ_{j≤t} k_j k_jᵀ and m_t = Σ_{j≤t} k_j, carried across calls in CcqState
// (the statistics have no forgetting and are kept apart from the backbone's state).
// Chunkwise: per chunk, (Q K_prev) + (Q Kᵀ ⊙ L) K for the second moment, row i divided by its
// own t_i; the mean term m_i (m_iᵀ q_i)/t_i² row by row.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "kernels/linear/core.hpp"

namespace lar::kernels::cpu::linear {

// Running key statistics of one (batch, head): K = Σ k kᵀ [dk, dk], m = Σ k [dk], t = count.
template <class T>
struct CcqState {
  std::vector<T> K, m;
  int64_t t = 0;
  explicit CcqState(int dk = 0) : K((std::size_t)dk * dk, T(0)), m(dk, T(0)) {}
};

template <class T>
struct CcqInputs {
  int len = 0, dk = 0;
  const T* q = nullptr;       // [len, dk] normalised queries
  const T* k = nullptr;       // [len, dk] normalised keys
  const T* lambda = nullptr;  // [len] strength λ_t ∈ (0,1)
  bool centered = true;
};

template <class T>
struct CcqGrads {
  T* dq = nullptr;       // [len, dk]
  T* dk = nullptr;       // [len, dk]
  T* dlambda = nullptr;  // [len]
};

namespace detail {
template <class T>
void ccq_check(const CcqInputs<T>& in) {
  if (in.len < 0 || in.dk <= 0 || !in.q || !in.k || !in.lambda)
    throw std::invalid_argument("ccq: bad shapes or missing q/k/lambda");
}
}  // namespace detail

// Recurrent form (reference, decode). st: statistics before the first token (nullptr =
// none), updated in place to include all len keys. qc: [len, dk] corrected queries.
template <class T>
void ccq_recurrent_forward(const CcqInputs<T>& in, CcqState<T>* st, T* qc) {
  detail::ccq_check(in);
  const int dk = in.dk;
  CcqState<T> local(dk);
  CcqState<T>& s = st ? *st : local;
  for (int t = 0; t < in.len; ++t) {
    const T* kt = in.k + (std::size_t)t * dk;
    const T* qt = in.q + (std::size_t)t * dk;
    for (int a = 0; a < dk; ++a) {
      s.m[a] += kt[a];
      for (int b = 0; b < dk; ++b) s.K[(std::size_t)a * dk + b] += kt[a] * kt[b];
    }
    s.t += 1;
    const T n = T(s.t);
    T mq = 0;
    for (int a = 0; a < dk; ++a) mq += s.m[a] * qt[a];
    for (int a = 0; a < dk; ++a) {
      T r = 0;
      for (int b = 0; b < dk; ++b) r += s.K[(std::size_t)a * dk + b] * qt[b];
      r /= n;
      if (in.centered) r -= s.m[a] * mq / (n * n);
      qc[(std::size_t)t * dk + a] = qt[a] - in.lambda[t] * r;
    }
  }
}

// Recurrent backward. st0: the statistics before the first token (nullptr = none).
template <class T>
void ccq_recurrent_backward(const CcqInputs<T>& in, const CcqState<T>* st0, const T* dqc,
                            const CcqGrads<T>& gr) {
  detail::ccq_check(in);
  const int dk = in.dk;
  const std::size_t kk = (std::size_t)dk * dk;
  // replay, keeping K_t and m_t
  std::vector<T> Ks((std::size_t)in.len * kk), ms((std::size_t)in.len * dk);
  CcqState<T> s = st0 ? *st0 : CcqState<T>(dk);
  const int64_t t0 = s.t;
  for (int t = 0; t < in.len; ++t) {
    const T* kt = in.k + (std::size_t)t * dk;
    for (int a = 0; a < dk; ++a) {
      s.m[a] += kt[a];
      for (int b = 0; b < dk; ++b) s.K[(std::size_t)a * dk + b] += kt[a] * kt[b];
    }
    std::copy(s.K.begin(), s.K.end(), Ks.begin() + (std::ptrdiff_t)(t * kk));
    std::copy(s.m.begin(), s.m.end(), ms.begin() + (std::ptrdiff_t)(t * dk));
  }
  // reverse: GK = Σ_{i≥t} ∂L/∂K_i, Gm = Σ_{i≥t} ∂L/∂m_i
  std::vector<T> GK(kk, T(0)), Gm(dk, T(0)), r(dk), dr(dk);
  for (int t = in.len - 1; t >= 0; --t) {
    const T* qt = in.q + (std::size_t)t * dk;
    const T* kt = in.k + (std::size_t)t * dk;
    const T* K = &Ks[(std::size_t)t * kk];
    const T* m = &ms[(std::size_t)t * dk];
    const T* g = dqc + (std::size_t)t * dk;
    const T n = T(t0 + t + 1), lam = in.lambda[t];
    T mq = 0, mdr = 0;
    for (int a = 0; a < dk; ++a) mq += m[a] * qt[a];
    T dl = 0;
    for (int a = 0; a < dk; ++a) {
      T x = 0;
      for (int b = 0; b < dk; ++b) x += K[(std::size_t)a * dk + b] * qt[b];
      r[a] = x / n - (in.centered ? m[a] * mq / (n * n) : T(0));
      dl -= g[a] * r[a];
      dr[a] = -lam * g[a];
    }
    if (gr.dlambda) gr.dlambda[t] = dl;
    for (int a = 0; a < dk; ++a) mdr += m[a] * dr[a];
    // r = K q / n − m (mᵀq)/n²
    for (int a = 0; a < dk; ++a) {
      T x = 0;
      for (int b = 0; b < dk; ++b) x += K[(std::size_t)b * dk + a] * dr[b];  // Kᵀ dr (K symmetric)
      T dqa = g[a] + x / n;
      if (in.centered) dqa -= m[a] * mdr / (n * n);
      if (gr.dq) gr.dq[(std::size_t)t * dk + a] = dqa;
    }
    for (int a = 0; a < dk; ++a)
      for (int b = 0; b < dk; ++b) GK[(std::size_t)a * dk + b] += dr[a] * qt[b] / n;
    if (in.centered)
      for (int a = 0; a < dk; ++a) Gm[a] -= (dr[a] * mq + qt[a] * mdr) / (n * n);
    // K_t includes k_t k_tᵀ, m_t includes k_t (and so do all later ones)
    if (gr.dk)
      for (int a = 0; a < dk; ++a) {
        T x = 0;
        for (int b = 0; b < dk; ++b)
          x += (GK[(std::size_t)a * dk + b] + GK[(std::size_t)b * dk + a]) * kt[b];
        gr.dk[(std::size_t)t * dk + a] = x + Gm[a];
      }
  }
}

namespace detail {
// r rows for one chunk: r_i = (Q K_prev + (Q Kᵀ ⊙ L) K)_i / t_i − m_i (m_iᵀ q_i)/t_i², with
// m_i = m_prev + Σ_{j≤i} k_j. Fills R [n,dk], QK [n,n] (masked), M [n,dk].
template <class T>
void ccq_chunk_rows(const T* q, const T* k, int n, int dk, const CcqState<T>& s, bool centered,
                    std::vector<T>& R, std::vector<T>& QK, std::vector<T>& M) {
  R.assign((std::size_t)n * dk, T(0));
  QK.assign((std::size_t)n * n, T(0));
  gemm(false, false, n, dk, dk, T(1), q, dk, s.K.data(), dk, T(0), R.data(), dk);
  gemm(false, true, n, n, dk, T(1), q, dk, k, dk, T(0), QK.data(), n);
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j) QK[(std::size_t)i * n + j] = T(0);
  gemm(false, false, n, dk, n, T(1), QK.data(), n, k, dk, T(1), R.data(), dk);
  M.resize((std::size_t)n * dk);
  for (int i = 0; i < n; ++i)
    for (int a = 0; a < dk; ++a)
      M[(std::size_t)i * dk + a] =
          (i ? M[(std::size_t)(i - 1) * dk + a] : s.m[a]) + k[(std::size_t)i * dk + a];
  for (int i = 0; i < n; ++i) {
    const T ti = T(s.t + i + 1);
    T mq = 0;
    for (int a = 0; a < dk; ++a) mq += M[(std::size_t)i * dk + a] * q[(std::size_t)i * dk + a];
    for (int a = 0; a < dk; ++a) {
      T& r = R[(std::size_t)i * dk + a];
      r /= ti;
      if (centered) r -= M[(std::size_t)i * dk + a] * mq / (ti * ti);
    }
  }
}
template <class T>
void ccq_advance(const T* k, int n, int dk, CcqState<T>& s) {
  gemm(true, false, dk, dk, n, T(1), k, dk, k, dk, T(1), s.K.data(), dk);
  for (int i = 0; i < n; ++i)
    for (int a = 0; a < dk; ++a) s.m[a] += k[(std::size_t)i * dk + a];
  s.t += n;
}
}  // namespace detail

// Chunkwise forward; st as in ccq_recurrent_forward.
template <class T>
void ccq_chunk_forward(const CcqInputs<T>& in, int chunk, CcqState<T>* st, T* qc) {
  detail::ccq_check(in);
  if (chunk <= 0) throw std::invalid_argument("ccq: chunk size must be positive");
  const int dk = in.dk;
  CcqState<T> local(dk);
  CcqState<T>& s = st ? *st : local;
  std::vector<T> R, QK, M;
  for (int start = 0; start < in.len; start += chunk) {
    const int n = std::min(chunk, in.len - start);
    const T* q = in.q + (std::size_t)start * dk;
    const T* k = in.k + (std::size_t)start * dk;
    detail::ccq_chunk_rows(q, k, n, dk, s, in.centered, R, QK, M);
    for (int i = 0; i < n; ++i)
      for (int a = 0; a < dk; ++a) {
        std::size_t x = (std::size_t)i * dk + a;
        qc[(std::size_t)start * dk + x] = q[x] - in.lambda[start + i] * R[x];
      }
    detail::ccq_advance(k, n, dk, s);
  }
}

// Chunkwise backward; st0 as in ccq_recurrent_backward.
template <class T>
void ccq_chunk_backward(const CcqInputs<T>& in, int chunk, const CcqState<T>* st0, const T* dqc,
                        const CcqGrads<T>& gr) {
  using detail::gemm;
  detail::ccq_check(in);
  if (chunk <= 0) throw std::invalid_argument("ccq: chunk size must be positive");
  const int dk = in.dk, nc = num_chunks(in.len, chunk);
  // statistics at every chunk start
  std::vector<CcqState<T>> starts;
  CcqState<T> s = st0 ? *st0 : CcqState<T>(dk);
  for (int c = 0; c < nc; ++c) {
    starts.push_back(s);
    const int n = std::min(chunk, in.len - c * chunk);
    detail::ccq_advance(in.k + (std::size_t)c * chunk * dk, n, dk, s);
  }
  // gradients on the carried sums from later chunks: GK on K_prev, Gm on m_prev
  std::vector<T> GK((std::size_t)dk * dk, T(0)), Gm(dk, T(0));
  std::vector<T> R, QK, M, dR, dM, S2, dq, dkk;
  for (int c = nc - 1; c >= 0; --c) {
    const int start = c * chunk, n = std::min(chunk, in.len - start);
    const T* q = in.q + (std::size_t)start * dk;
    const T* k = in.k + (std::size_t)start * dk;
    const T* g = dqc + (std::size_t)start * dk;
    const CcqState<T>& s0 = starts[c];
    detail::ccq_chunk_rows(q, k, n, dk, s0, in.centered, R, QK, M);
    dq.assign(g, g + (std::size_t)n * dk);
    dkk.assign((std::size_t)n * dk, T(0));
    dR.resize((std::size_t)n * dk);
    dM.assign((std::size_t)n * dk, T(0));
    std::vector<T> dA((std::size_t)n * dk);  // gradient on the second-moment rows before /t_i
    for (int i = 0; i < n; ++i) {
      const T ti = T(s0.t + i + 1), lam = in.lambda[start + i];
      T dl = 0, mq = 0, mdr = 0;
      for (int a = 0; a < dk; ++a) {
        std::size_t x = (std::size_t)i * dk + a;
        dl -= g[x] * R[x];
        dR[x] = -lam * g[x];
        mq += M[x] * q[x];
      }
      if (gr.dlambda) gr.dlambda[start + i] = dl;
      for (int a = 0; a < dk; ++a) mdr += M[(std::size_t)i * dk + a] * dR[(std::size_t)i * dk + a];
      for (int a = 0; a < dk; ++a) {
        std::size_t x = (std::size_t)i * dk + a;
        dA[x] = dR[x] / ti;
        if (in.centered) {
          dq[x] -= M[x] * mdr / (ti * ti);
          dM[x] = -(dR[x] * mq + q[x] * mdr) / (ti * ti);
        }
      }
    }
    // A = Q K_prev + (Q Kᵀ ⊙ L) K
    gemm(false, false, n, dk, dk, T(1), dA.data(), dk, s0.K.data(), dk, T(1), dq.data(), dk);
    S2.assign((std::size_t)n * n, T(0));
    gemm(false, true, n, n, dk, T(1), dA.data(), dk, k, dk, T(0), S2.data(), n);
    for (int i = 0; i < n; ++i)
      for (int j = i + 1; j < n; ++j) S2[(std::size_t)i * n + j] = T(0);
    gemm(false, false, n, dk, n, T(1), S2.data(), n, k, dk, T(1), dq.data(), dk);  // (dA Kᵀ⊙L) K
    gemm(true, false, n, dk, n, T(1), S2.data(), n, q, dk, T(1), dkk.data(), dk);  // S2ᵀ Q
    gemm(true, false, n, dk, n, T(1), QK.data(), n, dA.data(), dk, T(1), dkk.data(), dk); // S1ᵀ dA
    // later chunks see K_prev + Σ k kᵀ and m_prev + Σ k: dk_j += (GK + GKᵀ) k_j + Gm
    std::vector<T> GKs((std::size_t)dk * dk);
    for (int a = 0; a < dk; ++a)
      for (int b = 0; b < dk; ++b)
        GKs[(std::size_t)a * dk + b] = GK[(std::size_t)a * dk + b] + GK[(std::size_t)b * dk + a];
    gemm(false, false, n, dk, dk, T(1), k, dk, GKs.data(), dk, T(1), dkk.data(), dk);
    // M_i = m_prev + Σ_{j≤i} k_j: reverse cumulative sum of dM, plus Gm
    std::vector<T> acc(Gm);
    for (int i = n - 1; i >= 0; --i)
      for (int a = 0; a < dk; ++a) {
        acc[a] += dM[(std::size_t)i * dk + a];
        dkk[(std::size_t)i * dk + a] += acc[a];
      }
    // this chunk's own use of K_prev, m_prev, for the earlier chunks
    gemm(true, false, dk, dk, n, T(1), dA.data(), dk, q, dk, T(1), GK.data(), dk);
    Gm = acc;
    if (gr.dq) std::copy(dq.begin(), dq.end(), gr.dq + (std::size_t)start * dk);
    if (gr.dk) std::copy(dkk.begin(), dkk.end(), gr.dk + (std::size_t)start * dk);
  }
}

}  // namespace lar::kernels::cpu::linear
