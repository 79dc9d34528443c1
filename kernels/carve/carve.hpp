// CARVE (docs/spec.md §4): the gdn2 recurrence with a content-aware key-axis erase gate and a
// scalar write gate, for one (batch, head) sequence:
//   b_{c,t} = σ(bx_t + U_b(m_c)),  U_b(m) = U2 tanh(U1 m)   (U1 [r,dv], U2 [dk,r])
//   m_c     = mean of the outputs o_t over content chunk c−1 (length L), m_0 = 0
//   w_t     = scalar per token (already σ-activated), broadcast over dv
//   S_t     = S_{t−1}D(α_t)(I − (b_t ⊙ k_t)k_tᵀ) + w_t v_t k_tᵀ        (gdn2, see core.hpp)
// Content chunk c depends on chunk c−1's outputs, so the content chunks run in order, each
// through the unmodified gdn2 kernel (chunk size `chunk` inside). With U2 = 0 and L equal to
// the kernel chunk this is the very same sequence of operations as gdn2 with b = σ(bx) and
// w broadcast: the outputs are bit-identical. `content_grad` false stops the gradient
// through m_c (it is then treated as a constant input of chunk c).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/linear/mixers.hpp"

namespace lar::kernels::cpu::linear {

template <class T>
inline T carve_sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <class T>
struct CarveInputs {
  int len = 0, dk = 0, dv = 0, rank = 0;
  const T* q = nullptr;   // [len, dk] (normalised)
  const T* k = nullptr;   // [len, dk] (normalised)
  const T* v = nullptr;   // [len, dv]
  const T* g = nullptr;   // [len, dk] log-decay ≤ 0
  const T* bx = nullptr;  // [len, dk] erase logits from the input (W_b x)
  const T* w = nullptr;   // [len] scalar write gate ∈ (0,1)
  const T* U1 = nullptr;  // [rank, dv]
  const T* U2 = nullptr;  // [dk, rank]
  int content_chunk = 64; // L
  int chunk = 64;         // kernel chunk inside a content chunk
  T scale = 1;
  bool content_grad = true;
  double factor_span = 0;
  T* resid = nullptr;          // routing: write residual u_t [len, dv] (see MixerInputs)
  const T* dresid = nullptr;   // routing: its gradient (backward)
};

template <class T>
struct CarveGrads {
  T* dq = nullptr;
  T* dk = nullptr;
  T* dv = nullptr;
  T* dg = nullptr;
  T* dbx = nullptr;
  T* dw = nullptr;   // [len]
  T* dU1 = nullptr;  // accumulated
  T* dU2 = nullptr;  // accumulated
  T* dS0 = nullptr;
};

// Decode state: S, the content signal of the current chunk, the running output sum of the
// current chunk and how many of its tokens were seen.
template <class T>
struct CarveState {
  std::vector<T> S, m, osum;
  int pos = 0;
  CarveState(int dk = 0, int dv = 0)
      : S((std::size_t)dv * dk, T(0)), m(dv, T(0)), osum(dv, T(0)) {}
};

// What the backward needs from a forward started at the zero state.
template <class T>
struct CarveCache {
  std::vector<T> seg_S;   // [nseg, dv, dk] state at each content chunk start
  std::vector<T> seg_m;   // [nseg, dv] content signal of each content chunk
  std::vector<T> bounds;  // inner gdn2 chunk start states, segment after segment
  std::vector<T> b;       // [len, dk] erase gates
};

namespace detail {

// u = U2 tanh(U1 m) [dk]; h = tanh(U1 m) [rank].
template <class T>
void carve_content(const CarveInputs<T>& in, const T* m, T* u, T* h) {
  for (int r = 0; r < in.rank; ++r) {
    T s = 0;
    for (int j = 0; j < in.dv; ++j) s += in.U1[(std::size_t)r * in.dv + j] * m[j];
    h[r] = std::tanh(s);
  }
  for (int c = 0; c < in.dk; ++c) {
    T s = 0;
    for (int r = 0; r < in.rank; ++r) s += in.U2[(std::size_t)c * in.rank + r] * h[r];
    u[c] = s;
  }
}

template <class T>
MixerInputs<T> carve_segment(const CarveInputs<T>& in, int start, int n, const T* b,
                             const std::vector<T>& wfull) {
  MixerInputs<T> mi;
  mi.len = n;
  mi.dk = in.dk;
  mi.dv = in.dv;
  mi.q = in.q + (std::size_t)start * in.dk;
  mi.k = in.k + (std::size_t)start * in.dk;
  mi.v = in.v + (std::size_t)start * in.dv;
  mi.g = in.g + (std::size_t)start * in.dk;
  mi.b = b;
  mi.w = wfull.data();
  mi.scale = in.scale;
  mi.factor_span = in.factor_span;
  mi.resid = in.resid ? in.resid + (std::size_t)start * in.dv : nullptr;
  mi.dresid = in.dresid ? in.dresid + (std::size_t)start * in.dv : nullptr;
  return mi;
}

}  // namespace detail

// Forward. st nullable (zero state, fresh content chunk) and updated in place; o [len, dv].
// cache (nullable) is filled for carve_backward; it requires st == nullptr or a fresh state.
template <class T>
void carve_forward(const CarveInputs<T>& in, Form form, CarveState<T>* st, T* o,
                   CarveCache<T>* cache = nullptr) {
  if (in.content_chunk <= 0 || in.chunk <= 0 || in.rank <= 0 || !in.bx || !in.w || !in.U1 ||
      !in.U2 || !in.g)
    throw std::invalid_argument("carve: bad chunk sizes or missing inputs");
  const int dk = in.dk, dv = in.dv, L = in.content_chunk;
  CarveState<T> local(dk, dv);
  CarveState<T>& s = st ? *st : local;
  const std::size_t ss = (std::size_t)dv * dk;
  if (cache) {
    cache->seg_S.clear();
    cache->seg_m.clear();
    cache->bounds.clear();
    cache->b.assign((std::size_t)in.len * dk, T(0));
  }
  std::vector<T> u(dk), h(in.rank), b, wfull, bnd;
  int start = 0;
  while (start < in.len) {
    const int n = std::min(L - s.pos, in.len - start);
    detail::carve_content(in, s.m.data(), u.data(), h.data());
    b.resize((std::size_t)n * dk);
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < dk; ++c)
        b[(std::size_t)t * dk + c] = carve_sigmoid(in.bx[(std::size_t)(start + t) * dk + c] + u[c]);
    wfull.resize((std::size_t)n * dv);
    for (int t = 0; t < n; ++t)
      std::fill_n(&wfull[(std::size_t)t * dv], dv, in.w[start + t]);
    auto mi = detail::carve_segment(in, start, n, b.data(), wfull);
    T* os = o + (std::size_t)start * dv;
    if (cache) {
      cache->seg_S.insert(cache->seg_S.end(), s.S.begin(), s.S.end());
      cache->seg_m.insert(cache->seg_m.end(), s.m.begin(), s.m.end());
      std::copy(b.begin(), b.end(), cache->b.begin() + (std::ptrdiff_t)start * dk);
    }
    if (form == Form::chunk && cache) {
      bnd.resize((std::size_t)num_chunks(n, in.chunk) * ss);
      mixer_forward(Mixer::gdn2, mi, form, in.chunk, s.S.data(), os, s.S.data(), bnd.data());
      cache->bounds.insert(cache->bounds.end(), bnd.begin(), bnd.end());
    } else {
      mixer_forward(Mixer::gdn2, mi, form, in.chunk, s.S.data(), os, s.S.data());
    }
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < dv; ++j) s.osum[j] += os[(std::size_t)t * dv + j];
    s.pos += n;
    if (s.pos == L) {
      for (int j = 0; j < dv; ++j) {
        s.m[j] = s.osum[j] / T(L);
        s.osum[j] = T(0);
      }
      s.pos = 0;
    }
    start += n;
  }
}

// Backward of a forward started at the zero state. cache from carve_forward (same form), or
// nullptr to recompute it. dO [len, dv].
template <class T>
void carve_backward(const CarveInputs<T>& in, Form form, const T* dO, const CarveGrads<T>& gr,
                    const CarveCache<T>* cache = nullptr) {
  const int dk = in.dk, dv = in.dv, L = in.content_chunk;
  CarveCache<T> own;
  if (!cache) {
    std::vector<T> o((std::size_t)in.len * dv);
    carve_forward(in, form, (CarveState<T>*)nullptr, o.data(), &own);
    cache = &own;
  }
  const int nseg = num_chunks(in.len, L);
  const std::size_t ss = (std::size_t)dv * dk;
  // where each segment's inner chunk boundaries start
  std::vector<std::size_t> boff(nseg + 1, 0);
  for (int c = 0; c < nseg; ++c)
    boff[c + 1] = boff[c] + (std::size_t)num_chunks(std::min(L, in.len - c * L), in.chunk) * ss;
  std::vector<T> dS(ss, T(0)), dS0(ss), dm(dv, T(0)), dOs, wfull, db, dwf, u(dk), h(in.rank),
      du(dk), dh(in.rank);
  for (int c = nseg - 1; c >= 0; --c) {
    const int start = c * L, n = std::min(L, in.len - start);
    dOs.assign(dO + (std::size_t)start * dv, dO + (std::size_t)(start + n) * dv);
    if (in.content_grad && c + 1 < nseg)  // m_{c+1} = mean of this segment's outputs
      for (int t = 0; t < n; ++t)
        for (int j = 0; j < dv; ++j) dOs[(std::size_t)t * dv + j] += dm[j] / T(L);
    wfull.resize((std::size_t)n * dv);
    for (int t = 0; t < n; ++t)
      std::fill_n(&wfull[(std::size_t)t * dv], dv, in.w[start + t]);
    const T* b = &cache->b[(std::size_t)start * dk];
    auto mi = detail::carve_segment(in, start, n, b, wfull);
    db.resize((std::size_t)n * dk);
    dwf.resize((std::size_t)n * dv);
    MixerGrads<T> mg;
    mg.dq = gr.dq ? gr.dq + (std::size_t)start * dk : nullptr;
    mg.dk = gr.dk ? gr.dk + (std::size_t)start * dk : nullptr;
    mg.dv = gr.dv ? gr.dv + (std::size_t)start * dv : nullptr;
    mg.dg = gr.dg ? gr.dg + (std::size_t)start * dk : nullptr;
    mg.db = db.data();
    mg.dw = dwf.data();
    mg.dS0 = dS0.data();
    const T* S0 = &cache->seg_S[(std::size_t)c * ss];
    mixer_backward(Mixer::gdn2, mi, form, in.chunk, S0, dOs.data(), dS.data(), mg,
                   form == Form::chunk && !cache->bounds.empty() ? &cache->bounds[boff[c]]
                                                                 : (const T*)nullptr);
    dS.swap(dS0);
    if (gr.dw)
      for (int t = 0; t < n; ++t) {
        T x = 0;
        for (int j = 0; j < dv; ++j) x += dwf[(std::size_t)t * dv + j];
        gr.dw[start + t] = x;
      }
    // b = σ(bx + u): dbx = db b(1−b), du = Σ_t dbx
    std::fill(du.begin(), du.end(), T(0));
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < dk; ++i) {
        const T bb = b[(std::size_t)t * dk + i];
        const T x = db[(std::size_t)t * dk + i] * bb * (T(1) - bb);
        if (gr.dbx) gr.dbx[(std::size_t)(start + t) * dk + i] = x;
        du[i] += x;
      }
    // u = U2 h, h = tanh(U1 m)
    const T* m = &cache->seg_m[(std::size_t)c * dv];
    detail::carve_content(in, m, u.data(), h.data());
    for (int r = 0; r < in.rank; ++r) {
      T x = 0;
      for (int i = 0; i < dk; ++i) {
        x += in.U2[(std::size_t)i * in.rank + r] * du[i];
        if (gr.dU2) gr.dU2[(std::size_t)i * in.rank + r] += du[i] * h[r];
      }
      dh[r] = x * (T(1) - h[r] * h[r]);
    }
    std::fill(dm.begin(), dm.end(), T(0));
    for (int r = 0; r < in.rank; ++r)
      for (int j = 0; j < dv; ++j) {
        if (gr.dU1) gr.dU1[(std::size_t)r * dv + j] += dh[r] * m[j];
        dm[j] += in.U1[(std::size_t)r * dv + j] * dh[r];
      }
  }
  if (gr.dS0) std::copy(dS.begin(), dS.end(), gr.dS0);
}

}  // namespace lar::kernels::cpu::linear
