// The one recurrence behind every linear-attention mixer (docs/spec.md §2), on raw arrays.
//
// Per (batch, head) sequence, with state S ∈ R^{dv×dk} (row-major: value rows, key columns):
//   a_t = exp(g_t)                      (log-gate g ≤ 0; scalar or per key channel; none = 1)
//   u_t = z_t − S_{t−1} (a_t ⊙ e_t)     (the write residual; decay before the error)
//   S_t = S_{t−1} D(a_t) + u_t k_tᵀ     (= S_{t−1}D(a_t)(I − e_t k_tᵀ) + z_t k_tᵀ)
//   o_t = scale · S_t q_t
// linear: e = 0, z = v, no gate. gla: e = 0, z = v, channel gate. deltanet/gdn/kda: e = β k,
// z = β v. gdn2: e = b ⊙ k, z = w ⊙ v. mixers.hpp maps each mixer onto this core.
//
// Two exact forms: the recurrent one (reference, decode path) and the chunkwise-parallel one
// (training). Inside a chunk, with G_t the cumulative log-gate from the chunk start:
//   A[t,j] = Σ_c e_tc k_jc exp(G_tc − G_jc)   (j < t)      P[t,j] = Σ_c q_tc k_jc exp(G_tc − G_jc)  (j ≤ t)
//   (I + A) U = Z − Ẽ S0ᵀ,  Ẽ_t = e_t ⊙ exp(G_t)          (UT/WY form of the delta rule)
//   O = scale (Q̃ S0ᵀ + P U),  Q̃_t = q_t ⊙ exp(G_t)
//   S_C = S0 D(exp G_last) + Uᵀ K̂,  K̂_j = k_j ⊙ exp(G_last − G_j)
// Every exponent above is a difference G_i − G_j with i ≥ j, so it is ≤ 0: no overflow even
// with very strong gates (log space, no exp(−G) factorisation).
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <vector>

namespace lar::kernels::cpu::linear {

enum class GateKind { none, scalar, channel };

// Inputs of the core recurrence for one (batch, head) sequence. All arrays row-major.
template <class T>
struct CoreInputs {
  int len = 0, dk = 0, dv = 0;
  const T* q = nullptr;  // [len, dk]
  const T* k = nullptr;  // [len, dk]
  const T* e = nullptr;  // [len, dk] erase vectors; nullptr = no erase (linear, gla)
  const T* z = nullptr;  // [len, dv] written values
  const T* g = nullptr;  // log-gates: [len] (scalar) or [len, dk] (channel); unused for none
  GateKind gate = GateKind::none;
  T scale = 1;
  // Channel gates: in-chunk decay spans up to this use the factored GEMM form, larger ones
  // the pairwise exp(G_t − G_j) loops. 0 = default (40 in fp32, 300 in fp64); a negative
  // value forces the pairwise form (tests cover both).
  double factor_span = 0;
  // Cross-layer routing: the forward writes the write residual u_t here ([len, dv]) when
  // set; the backward adds dresid ([len, dv], the gradient on u_t) when set.
  T* resid = nullptr;
  const T* dresid = nullptr;
};

// Gradient outputs (overwritten, not accumulated). Any pointer may be nullptr when that
// gradient is not wanted (de when e is nullptr, dg when gate is none, dS0 ...).
template <class T>
struct CoreGrads {
  T* dq = nullptr;   // [len, dk]
  T* dk = nullptr;   // [len, dk]
  T* de = nullptr;   // [len, dk]
  T* dz = nullptr;   // [len, dv]
  T* dg = nullptr;   // [len] or [len, dk], like g
  T* dS0 = nullptr;  // [dv, dk]
};

namespace detail {

inline void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m,
              n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m,
              n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template <class T>
void check(const CoreInputs<T>& in) {
  if (in.len < 0 || in.dk <= 0 || in.dv <= 0 || !in.q || !in.k || !in.z)
    throw std::invalid_argument("linear core: bad shapes or missing q/k/z");
  if (in.gate != GateKind::none && !in.g)
    throw std::invalid_argument("linear core: gated recurrence without gate array");
}

// Log-gate of token t (absolute index), channel c.
template <class T>
inline T gate_at(const CoreInputs<T>& in, int t, int c) {
  switch (in.gate) {
    case GateKind::none: return T(0);
    case GateKind::scalar: return in.g[t];
    case GateKind::channel: return in.g[(std::size_t)t * in.dk + c];
  }
  return T(0);
}

// Everything the chunkwise form computes inside one chunk from its start state S0.
// Gates are stored per channel ([n, dk]) for the channel kind and per token ([n]) otherwise.
template <class T>
struct ChunkWork {
  int n = 0, dk = 0, dv = 0, gw = 1;  // gw: gate width (dk for channel gates, else 1)
  std::vector<T> G, expG, decay_end, Qt, Et, Kh, A, P, QK, EK, U;
  // Channel gates whose in-chunk decay span is moderate go through GEMMs: with a per-channel
  // reference r (the middle of the span), exp(G_t − G_j) = exp(G_t − r)·exp(r − G_j), each
  // factor within exp(±span/2), so nothing overflows and every product keeps full relative
  // precision. Stronger decays fall back to the pairwise exp(G_t − G_j) loops.
  bool factored = false;
  std::vector<T> fq, fk, Qb, Kb, Eb;  // exp(G − r), exp(r − G), q̄, k̄, ē   [n, dk]

  // Largest in-chunk decay span for which the factored form is used.
  static constexpr double max_span() { return sizeof(T) == 4 ? 40.0 : 300.0; }

  void compute(const CoreInputs<T>& in, int start, int len_chunk, const T* S0) {
    n = len_chunk;
    factored = false;
    dk = in.dk;
    dv = in.dv;
    gw = in.gate == GateKind::channel ? dk : 1;
    const T* q = in.q + (std::size_t)start * dk;
    const T* k = in.k + (std::size_t)start * dk;
    const T* e = in.e ? in.e + (std::size_t)start * dk : nullptr;
    const T* z = in.z + (std::size_t)start * dv;
    G.assign((std::size_t)n * gw, T(0));
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < gw; ++c)
        G[(std::size_t)t * gw + c] =
            (t ? G[(std::size_t)(t - 1) * gw + c] : T(0)) + gate_at(in, start + t, c);
    expG.resize(G.size());
    decay_end.resize(G.size());
    for (std::size_t i = 0; i < G.size(); ++i) {
      expG[i] = std::exp(G[i]);
      decay_end[i] = std::exp(G[(std::size_t)(n - 1) * gw + i % gw] - G[i]);
    }
    auto eg = [&](int t, int c) { return expG[(std::size_t)t * gw + (gw == 1 ? 0 : c)]; };
    Qt.resize((std::size_t)n * dk);
    Kh.resize((std::size_t)n * dk);
    Et.assign(e ? (std::size_t)n * dk : 0, T(0));
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < dk; ++c) {
        std::size_t i = (std::size_t)t * dk + c;
        Qt[i] = q[i] * eg(t, c);
        Kh[i] = k[i] * decay_end[(std::size_t)t * gw + (gw == 1 ? 0 : c)];
        if (e) Et[i] = e[i] * eg(t, c);
      }
    // Pairwise intra-chunk matrices P (j ≤ t) and A (j < t).
    P.assign((std::size_t)n * n, T(0));
    A.assign(e ? (std::size_t)n * n : 0, T(0));
    if (gw == 1) {
      QK.resize((std::size_t)n * n);
      gemm(false, true, n, n, dk, T(1), q, dk, k, dk, T(0), QK.data(), n);
      if (e) {
        EK.resize((std::size_t)n * n);
        gemm(false, true, n, n, dk, T(1), e, dk, k, dk, T(0), EK.data(), n);
      }
      for (int t = 0; t < n; ++t)
        for (int j = 0; j <= t; ++j) {
          T m = std::exp(G[t] - G[j]);
          P[(std::size_t)t * n + j] = QK[(std::size_t)t * n + j] * m;
          if (e && j < t) A[(std::size_t)t * n + j] = EK[(std::size_t)t * n + j] * m;
        }
    } else {
      factored = true;
      for (int c = 0; c < dk && factored; ++c)
        factored = G[c] - G[(std::size_t)(n - 1) * dk + c] <=
                   T(in.factor_span == 0 ? max_span() : in.factor_span);
    }
    if (gw > 1 && factored) {
      fq.resize((std::size_t)n * dk);
      fk.resize((std::size_t)n * dk);
      Qb.resize((std::size_t)n * dk);
      Kb.resize((std::size_t)n * dk);
      Eb.assign(e ? (std::size_t)n * dk : 0, T(0));
      for (int t = 0; t < n; ++t)
        for (int c = 0; c < dk; ++c) {
          std::size_t i = (std::size_t)t * dk + c;
          T r = (G[c] + G[(std::size_t)(n - 1) * dk + c]) / T(2);
          fq[i] = std::exp(G[i] - r);
          fk[i] = std::exp(r - G[i]);
          Qb[i] = q[i] * fq[i];
          Kb[i] = k[i] * fk[i];
          if (e) Eb[i] = e[i] * fq[i];
        }
      gemm(false, true, n, n, dk, T(1), Qb.data(), dk, Kb.data(), dk, T(0), P.data(), n);
      for (int t = 0; t < n; ++t)
        for (int j = t + 1; j < n; ++j) P[(std::size_t)t * n + j] = T(0);
      if (e) {
        gemm(false, true, n, n, dk, T(1), Eb.data(), dk, Kb.data(), dk, T(0), A.data(), n);
        for (int t = 0; t < n; ++t)
          for (int j = t; j < n; ++j) A[(std::size_t)t * n + j] = T(0);
      }
    } else if (gw > 1) {
      std::vector<T> ex(dk);
      for (int t = 0; t < n; ++t) {
        const T* Gt = &G[(std::size_t)t * dk];
        const T* qt = q + (std::size_t)t * dk;
        const T* et = e ? e + (std::size_t)t * dk : nullptr;
        for (int j = 0; j <= t; ++j) {
          const T* Gj = &G[(std::size_t)j * dk];
          const T* kj = k + (std::size_t)j * dk;
          T pp = 0, pa = 0;
          for (int c = 0; c < dk; ++c) ex[c] = std::exp(Gt[c] - Gj[c]) * kj[c];
          for (int c = 0; c < dk; ++c) pp += qt[c] * ex[c];
          if (et && j < t)
            for (int c = 0; c < dk; ++c) pa += et[c] * ex[c];
          P[(std::size_t)t * n + j] = pp;
          if (et && j < t) A[(std::size_t)t * n + j] = pa;
        }
      }
    }
    // U = (I + A)^{-1} (Z − Ẽ S0ᵀ), by forward substitution.
    U.assign(z, z + (std::size_t)n * dv);
    if (e) {
      gemm(false, true, n, dv, dk, T(-1), Et.data(), dk, S0, dk, T(1), U.data(), dv);
      for (int t = 1; t < n; ++t) {
        T* ut = &U[(std::size_t)t * dv];
        for (int j = 0; j < t; ++j) {
          T a = A[(std::size_t)t * n + j];
          const T* uj = &U[(std::size_t)j * dv];
          for (int v = 0; v < dv; ++v) ut[v] -= a * uj[v];
        }
      }
    }
  }

  // O = scale (Q̃ S0ᵀ + P U) into o ([n, dv]).
  void output(const T* S0, T scale, T* o) const {
    gemm(false, true, n, dv, dk, scale, Qt.data(), dk, S0, dk, T(0), o, dv);
    gemm(false, false, n, dv, n, scale, P.data(), n, U.data(), dv, T(1), o, dv);
  }

  // S_end = S0 D(exp G_last) + Uᵀ K̂ into S_end ([dv, dk]); S_end must not alias S0.
  void end_state(const T* S0, T* S_end) const {
    for (int v = 0; v < dv; ++v)
      for (int c = 0; c < dk; ++c)
        S_end[(std::size_t)v * dk + c] =
            S0[(std::size_t)v * dk + c] * expG[(std::size_t)(n - 1) * gw + (gw == 1 ? 0 : c)];
    gemm(true, false, dv, dk, n, T(1), U.data(), dv, Kh.data(), dk, T(1), S_end, dk);
  }
};

}  // namespace detail

inline int num_chunks(int len, int chunk) { return len <= 0 ? 0 : (len + chunk - 1) / chunk; }

// Recurrent form. S0 may be nullptr (zero state); S_out ([dv,dk], may alias S0 or be nullptr)
// receives the final state; o is [len, dv]. With len = 1 this is the decode step.
template <class T>
void recurrent_forward(const CoreInputs<T>& in, const T* S0, T* o, T* S_out,
                       std::vector<T>* states = nullptr) {
  detail::check(in);
  const int dk = in.dk, dv = in.dv;
  std::vector<T> S((std::size_t)dv * dk, T(0)), a(dk), ae(dk), u(dv);
  if (S0) std::copy(S0, S0 + S.size(), S.begin());
  if (states) states->assign((std::size_t)in.len * S.size(), T(0));
  for (int t = 0; t < in.len; ++t) {
    const T* qt = in.q + (std::size_t)t * dk;
    const T* kt = in.k + (std::size_t)t * dk;
    const T* zt = in.z + (std::size_t)t * dv;
    for (int c = 0; c < dk; ++c) a[c] = std::exp(detail::gate_at(in, t, c));
    for (int v = 0; v < dv; ++v) u[v] = zt[v];
    if (in.e) {
      const T* et = in.e + (std::size_t)t * dk;
      for (int c = 0; c < dk; ++c) ae[c] = a[c] * et[c];
      for (int v = 0; v < dv; ++v) {
        T s = 0;
        for (int c = 0; c < dk; ++c) s += S[(std::size_t)v * dk + c] * ae[c];
        u[v] -= s;
      }
    }
    if (in.resid) std::copy(u.begin(), u.end(), in.resid + (std::size_t)t * dv);
    T* ot = o ? o + (std::size_t)t * dv : nullptr;
    for (int v = 0; v < dv; ++v) {
      T* Sv = &S[(std::size_t)v * dk];
      T acc = 0;
      for (int c = 0; c < dk; ++c) {
        Sv[c] = Sv[c] * a[c] + u[v] * kt[c];
        acc += Sv[c] * qt[c];
      }
      if (ot) ot[v] = in.scale * acc;
    }
    if (states) std::copy(S.begin(), S.end(), states->begin() + (std::ptrdiff_t)(t * S.size()));
  }
  if (S_out) std::copy(S.begin(), S.end(), S_out);
}

// Recurrent backward (the reference): replays the forward keeping every state.
// dO is [len, dv]; dST ([dv,dk]) is the gradient on the final state, nullptr = 0.
template <class T>
void recurrent_backward(const CoreInputs<T>& in, const T* S0, const T* dO, const T* dST,
                        const CoreGrads<T>& gr) {
  detail::check(in);
  const int dk = in.dk, dv = in.dv;
  const std::size_t ss = (std::size_t)dv * dk;
  std::vector<T> states;
  recurrent_forward(in, S0, (T*)nullptr, (T*)nullptr, &states);
  std::vector<T> zero(ss, T(0));
  std::vector<T> dS(ss, T(0)), a(dk), ae(dk), u(dv), du(dv), dae(dk), da(dk);
  if (dST) std::copy(dST, dST + ss, dS.begin());
  const int gw = in.gate == GateKind::channel ? dk : 1;
  for (int t = in.len - 1; t >= 0; --t) {
    const T* St = &states[(std::size_t)t * ss];
    const T* Sp = t ? &states[(std::size_t)(t - 1) * ss] : (S0 ? S0 : zero.data());
    const T* qt = in.q + (std::size_t)t * dk;
    const T* kt = in.k + (std::size_t)t * dk;
    const T* zt = in.z + (std::size_t)t * dv;
    const T* et = in.e ? in.e + (std::size_t)t * dk : nullptr;
    const T* dot = dO + (std::size_t)t * dv;
    for (int c = 0; c < dk; ++c) a[c] = std::exp(detail::gate_at(in, t, c));
    // o_t = scale S_t q_t
    if (gr.dq)
      for (int c = 0; c < dk; ++c) {
        T s = 0;
        for (int v = 0; v < dv; ++v) s += St[(std::size_t)v * dk + c] * dot[v];
        gr.dq[(std::size_t)t * dk + c] = in.scale * s;
      }
    for (int v = 0; v < dv; ++v)
      for (int c = 0; c < dk; ++c) dS[(std::size_t)v * dk + c] += in.scale * dot[v] * qt[c];
    // recompute u_t
    for (int v = 0; v < dv; ++v) u[v] = zt[v];
    if (et) {
      for (int c = 0; c < dk; ++c) ae[c] = a[c] * et[c];
      for (int v = 0; v < dv; ++v) {
        T s = 0;
        for (int c = 0; c < dk; ++c) s += Sp[(std::size_t)v * dk + c] * ae[c];
        u[v] -= s;
      }
    }
    // S_t = S_{t-1} D(a) + u kᵀ
    for (int v = 0; v < dv; ++v) {
      T s = 0;
      for (int c = 0; c < dk; ++c) s += dS[(std::size_t)v * dk + c] * kt[c];
      du[v] = s + (in.dresid ? in.dresid[(std::size_t)t * dv + v] : T(0));
    }
    if (gr.dk)
      for (int c = 0; c < dk; ++c) {
        T s = 0;
        for (int v = 0; v < dv; ++v) s += dS[(std::size_t)v * dk + c] * u[v];
        gr.dk[(std::size_t)t * dk + c] = s;
      }
    for (int c = 0; c < dk; ++c) {
      T s = 0;
      for (int v = 0; v < dv; ++v) s += dS[(std::size_t)v * dk + c] * Sp[(std::size_t)v * dk + c];
      da[c] = s;
    }
    if (gr.dz)
      for (int v = 0; v < dv; ++v) gr.dz[(std::size_t)t * dv + v] = du[v];
    // dS_{t-1} = dS_t D(a) − du (a ⊙ e)ᵀ
    for (int v = 0; v < dv; ++v)
      for (int c = 0; c < dk; ++c) dS[(std::size_t)v * dk + c] *= a[c];
    if (et) {
      // u = z − S_{t-1}(a ⊙ e)
      for (int c = 0; c < dk; ++c) {
        T s = 0;
        for (int v = 0; v < dv; ++v) s += Sp[(std::size_t)v * dk + c] * du[v];
        dae[c] = -s;
        da[c] += dae[c] * et[c];
        if (gr.de) gr.de[(std::size_t)t * dk + c] = dae[c] * a[c];
      }
      for (int v = 0; v < dv; ++v)
        for (int c = 0; c < dk; ++c) dS[(std::size_t)v * dk + c] -= du[v] * ae[c];
    } else if (gr.de) {
      for (int c = 0; c < dk; ++c) gr.de[(std::size_t)t * dk + c] = T(0);
    }
    if (gr.dg && in.gate != GateKind::none) {
      if (gw == 1) {
        T s = 0;
        for (int c = 0; c < dk; ++c) s += da[c] * a[c];
        gr.dg[t] = s;
      } else {
        for (int c = 0; c < dk; ++c) gr.dg[(std::size_t)t * dk + c] = da[c] * a[c];
      }
    }
  }
  if (gr.dS0) std::copy(dS.begin(), dS.end(), gr.dS0);
}

// Chunkwise forward. boundary (nullable) receives the state at the start of every chunk,
// [num_chunks(len, chunk), dv, dk], for chunk_backward. S0, S_out as in recurrent_forward.
template <class T>
void chunk_forward(const CoreInputs<T>& in, int chunk, const T* S0, T* o, T* S_out,
                   T* boundary = nullptr) {
  detail::check(in);
  if (chunk <= 0) throw std::invalid_argument("linear core: chunk size must be positive");
  const std::size_t ss = (std::size_t)in.dv * in.dk;
  std::vector<T> S(ss, T(0)), S_next(ss);
  if (S0) std::copy(S0, S0 + ss, S.begin());
  detail::ChunkWork<T> w;
  const int nc = num_chunks(in.len, chunk);
  for (int ci = 0; ci < nc; ++ci) {
    const int start = ci * chunk, n = std::min(chunk, in.len - start);
    if (boundary) std::copy(S.begin(), S.end(), boundary + (std::size_t)ci * ss);
    w.compute(in, start, n, S.data());
    if (o) w.output(S.data(), in.scale, o + (std::size_t)start * in.dv);
    if (in.resid) std::copy(w.U.begin(), w.U.end(), in.resid + (std::size_t)start * in.dv);
    w.end_state(S.data(), S_next.data());
    S.swap(S_next);
  }
  if (S_out) std::copy(S.begin(), S.end(), S_out);
}

// Chunkwise backward. boundary: the chunk start states from chunk_forward (nullptr: they are
// recomputed here). dST as in recurrent_backward.
template <class T>
void chunk_backward(const CoreInputs<T>& in, int chunk, const T* S0, const T* dO, const T* dST,
                    const CoreGrads<T>& gr, const T* boundary = nullptr) {
  using detail::gemm;
  detail::check(in);
  if (chunk <= 0) throw std::invalid_argument("linear core: chunk size must be positive");
  const int dk = in.dk, dv = in.dv, nc = num_chunks(in.len, chunk);
  const std::size_t ss = (std::size_t)dv * dk;
  std::vector<T> own;
  if (!boundary) {
    own.resize((std::size_t)nc * ss);
    chunk_forward(in, chunk, S0, (T*)nullptr, (T*)nullptr, own.data());
    boundary = own.data();
  }
  const bool has_e = in.e != nullptr;
  const int gw = in.gate == GateKind::channel ? dk : 1;
  std::vector<T> dS(ss, T(0)), dS0(ss);
  if (dST) std::copy(dST, dST + ss, dS.begin());
  std::vector<T> dOs, dU, dKh, dQt, dEt, dP, dA, dR, dG, dq, dkk, de, tmp;
  detail::ChunkWork<T> w;
  for (int ci = nc - 1; ci >= 0; --ci) {
    const int start = ci * chunk, n = std::min(chunk, in.len - start);
    const T* S0c = boundary + (std::size_t)ci * ss;
    w.compute(in, start, n, S0c);
    const T* q = in.q + (std::size_t)start * dk;
    const T* k = in.k + (std::size_t)start * dk;
    const T* e = has_e ? in.e + (std::size_t)start * dk : nullptr;
    auto eg = [&](int t, int c) { return w.expG[(std::size_t)t * gw + (gw == 1 ? 0 : c)]; };
    dOs.assign(dO + (std::size_t)start * dv, dO + (std::size_t)(start + n) * dv);
    for (auto& x : dOs) x *= in.scale;
    dG.assign((std::size_t)n * gw, T(0));
    auto addG = [&](int t, int c, T val) { dG[(std::size_t)t * gw + (gw == 1 ? 0 : c)] += val; };
    dq.assign((std::size_t)n * dk, T(0));
    dkk.assign((std::size_t)n * dk, T(0));
    de.assign(has_e ? (std::size_t)n * dk : 0, T(0));
    // S_end = S0 D(exp G_last) + Uᵀ K̂
    dU.assign((std::size_t)n * dv, T(0));
    gemm(false, true, n, dv, dk, T(1), w.Kh.data(), dk, dS.data(), dk, T(0), dU.data(), dv);
    dKh.assign((std::size_t)n * dk, T(0));
    gemm(false, false, n, dk, dv, T(1), w.U.data(), dv, dS.data(), dk, T(0), dKh.data(), dk);
    for (int v = 0; v < dv; ++v)
      for (int c = 0; c < dk; ++c) {
        std::size_t i = (std::size_t)v * dk + c;
        T el = eg(n - 1, c);
        dS0[i] = dS[i] * el;
        addG(n - 1, c, dS[i] * S0c[i] * el);
      }
    // O = Q̃ S0ᵀ + P U (scale folded into dOs)
    dQt.assign((std::size_t)n * dk, T(0));
    gemm(false, false, n, dk, dv, T(1), dOs.data(), dv, S0c, dk, T(0), dQt.data(), dk);
    gemm(true, false, dv, dk, n, T(1), dOs.data(), dv, w.Qt.data(), dk, T(1), dS0.data(), dk);
    dP.assign((std::size_t)n * n, T(0));
    gemm(false, true, n, n, dv, T(1), dOs.data(), dv, w.U.data(), dv, T(0), dP.data(), n);
    for (int t = 0; t < n; ++t)
      for (int j = t + 1; j < n; ++j) dP[(std::size_t)t * n + j] = T(0);
    gemm(true, false, n, dv, n, T(1), w.P.data(), n, dOs.data(), dv, T(1), dU.data(), dv);
    if (in.dresid)
      for (std::size_t i = 0; i < dU.size(); ++i) dU[i] += in.dresid[(std::size_t)start * dv + i];
    // (I + A) U = R: dR = (I + A)^{-T} dU, dA = −dR Uᵀ (strictly lower)
    dR = dU;
    if (has_e) {
      for (int j = n - 2; j >= 0; --j) {
        T* rj = &dR[(std::size_t)j * dv];
        for (int t = j + 1; t < n; ++t) {
          T a = w.A[(std::size_t)t * n + j];
          const T* rt = &dR[(std::size_t)t * dv];
          for (int v = 0; v < dv; ++v) rj[v] -= a * rt[v];
        }
      }
      dA.assign((std::size_t)n * n, T(0));
      gemm(false, true, n, n, dv, T(-1), dR.data(), dv, w.U.data(), dv, T(0), dA.data(), n);
      for (int t = 0; t < n; ++t)
        for (int j = t; j < n; ++j) dA[(std::size_t)t * n + j] = T(0);
      // R = Z − Ẽ S0ᵀ
      dEt.assign((std::size_t)n * dk, T(0));
      gemm(false, false, n, dk, dv, T(-1), dR.data(), dv, S0c, dk, T(0), dEt.data(), dk);
      gemm(true, false, dv, dk, n, T(-1), dR.data(), dv, w.Et.data(), dk, T(1), dS0.data(), dk);
    }
    if (gr.dz)
      std::copy(dR.begin(), dR.end(), gr.dz + (std::size_t)start * dv);
    // Pairwise terms P[t,j] = Σ_c q_tc k_jc M_tjc, A[t,j] = Σ_c e_tc k_jc M_tjc
    if (gw == 1) {
      // M_tj = exp(G_t − G_j) scalar: go through the gemm products QK, EK.
      tmp.assign((std::size_t)n * n, T(0));
      for (int t = 0; t < n; ++t)
        for (int j = 0; j <= t; ++j) {
          std::size_t i = (std::size_t)t * n + j;
          T m = std::exp(w.G[t] - w.G[j]);
          T dm = dP[i] * w.QK[i];
          tmp[i] = dP[i] * m;  // d(QK)
          if (has_e && j < t) dm += dA[i] * w.EK[i];
          dG[t] += dm * m;
          dG[j] -= dm * m;
        }
      gemm(false, false, n, dk, n, T(1), tmp.data(), n, k, dk, T(1), dq.data(), dk);
      gemm(true, false, n, dk, n, T(1), tmp.data(), n, q, dk, T(1), dkk.data(), dk);
      if (has_e) {
        for (int t = 0; t < n; ++t)
          for (int j = 0; j < t; ++j) {
            std::size_t i = (std::size_t)t * n + j;
            tmp[i] = dA[i] * std::exp(w.G[t] - w.G[j]);
          }
        for (int t = 0; t < n; ++t) tmp[(std::size_t)t * n + t] = T(0);
        gemm(false, false, n, dk, n, T(1), tmp.data(), n, k, dk, T(1), de.data(), dk);
        gemm(true, false, n, dk, n, T(1), tmp.data(), n, e, dk, T(1), dkk.data(), dk);
      }
    } else if (w.factored) {
      // P = Q̄ K̄ᵀ, A = Ē K̄ᵀ (masked): dQ̄ = dP K̄, dĒ = dA K̄, dK̄ = dPᵀ Q̄ + dAᵀ Ē
      std::vector<T> dQb((std::size_t)n * dk, T(0)), dKb((std::size_t)n * dk, T(0)),
          dEb(has_e ? (std::size_t)n * dk : 0, T(0));
      gemm(false, false, n, dk, n, T(1), dP.data(), n, w.Kb.data(), dk, T(0), dQb.data(), dk);
      gemm(true, false, n, dk, n, T(1), dP.data(), n, w.Qb.data(), dk, T(0), dKb.data(), dk);
      if (has_e) {
        gemm(false, false, n, dk, n, T(1), dA.data(), n, w.Kb.data(), dk, T(0), dEb.data(), dk);
        gemm(true, false, n, dk, n, T(1), dA.data(), n, w.Eb.data(), dk, T(1), dKb.data(), dk);
      }
      for (std::size_t i = 0; i < (std::size_t)n * dk; ++i) {
        dq[i] += dQb[i] * w.fq[i];
        dkk[i] += dKb[i] * w.fk[i];
        T x = dQb[i] * w.Qb[i] - dKb[i] * w.Kb[i];
        if (has_e) {
          de[i] += dEb[i] * w.fq[i];
          x += dEb[i] * w.Eb[i];
        }
        dG[i] += x;
      }
    } else {
      std::vector<T> ex(dk);
      for (int t = 0; t < n; ++t) {
        const T* Gt = &w.G[(std::size_t)t * dk];
        const T* qt = q + (std::size_t)t * dk;
        const T* et = e ? e + (std::size_t)t * dk : nullptr;
        T* dqt = &dq[(std::size_t)t * dk];
        T* det = e ? &de[(std::size_t)t * dk] : nullptr;
        T* dGt = &dG[(std::size_t)t * dk];
        for (int j = 0; j <= t; ++j) {
          const T* Gj = &w.G[(std::size_t)j * dk];
          const T* kj = k + (std::size_t)j * dk;
          T* dkj = &dkk[(std::size_t)j * dk];
          T* dGj = &dG[(std::size_t)j * dk];
          const T p = dP[(std::size_t)t * n + j];
          const T a = (et && j < t) ? dA[(std::size_t)t * n + j] : T(0);
          for (int c = 0; c < dk; ++c) ex[c] = std::exp(Gt[c] - Gj[c]);
          for (int c = 0; c < dk; ++c) {
            T kx = kj[c] * ex[c];
            T src = p * qt[c] + (et ? a * et[c] : T(0));  // d(term)/d(k_jc M_tjc)
            dqt[c] += p * kx;
            if (et) det[c] += a * kx;
            dkj[c] += src * ex[c];
            T x = src * kx;
            dGt[c] += x;
            dGj[c] -= x;
          }
        }
      }
    }
    // Elementwise factors Q̃ = q exp(G), Ẽ = e exp(G), K̂ = k exp(G_last − G)
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < dk; ++c) {
        std::size_t i = (std::size_t)t * dk + c;
        T el = eg(t, c);
        dq[i] += dQt[i] * el;
        addG(t, c, dQt[i] * w.Qt[i]);
        if (has_e) {
          de[i] += dEt[i] * el;
          addG(t, c, dEt[i] * w.Et[i]);
        }
        T kh = dKh[i] * w.Kh[i];
        dkk[i] += dKh[i] * w.decay_end[(std::size_t)t * gw + (gw == 1 ? 0 : c)];
        addG(n - 1, c, kh);
        addG(t, c, -kh);
      }
    if (gr.dq) std::copy(dq.begin(), dq.end(), gr.dq + (std::size_t)start * dk);
    if (gr.dk) std::copy(dkk.begin(), dkk.end(), gr.dk + (std::size_t)start * dk);
    if (gr.de) {
      if (has_e)
        std::copy(de.begin(), de.end(), gr.de + (std::size_t)start * dk);
      else
        std::fill(gr.de + (std::size_t)start * dk, gr.de + (std::size_t)(start + n) * dk, T(0));
    }
    if (gr.dg && in.gate != GateKind::none) {
      // g_t enters G_s for every s ≥ t in the chunk: reverse cumulative sum.
      for (int t = n - 2; t >= 0; --t)
        for (int c = 0; c < gw; ++c)
          dG[(std::size_t)t * gw + c] += dG[(std::size_t)(t + 1) * gw + c];
      std::copy(dG.begin(), dG.end(), gr.dg + (std::size_t)start * gw);
    }
    dS.swap(dS0);
  }
  if (gr.dS0) std::copy(dS.begin(), dS.end(), gr.dS0);
}

}  // namespace lar::kernels::cpu::linear
