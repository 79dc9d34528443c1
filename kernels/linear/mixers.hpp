// The six linear-attention recurrences of docs/spec.md §2 (linear, gla, deltanet, gdn, kda, gdn2)
// mapped onto the core recurrence of core.hpp. Per (batch, head) sequence, raw arrays.
//
//   mixer     gate g          erase e      write z
//   linear    none            none         v
//   gla       channel [T,dk]  none         v
//   deltanet  none            β k          β v
//   gdn       scalar [T]      β k          β v
//   kda       channel [T,dk]  β k          β v
//   gdn2      channel [T,dk]  b ⊙ k        w ⊙ v       (b [T,dk], w [T,dv])
//
// q and k arrive already normalised (the layer L2-normalises them for delta rules); the
// output scale (1/sqrt(dk) in docs/spec.md §1) is a parameter.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "kernels/linear/core.hpp"

namespace lar::kernels::cpu::linear {

enum class Mixer { linear, gla, deltanet, gdn, kda, gdn2 };

inline std::optional<Mixer> parse_mixer(std::string_view name) {
  if (name == "linear") return Mixer::linear;
  if (name == "gla") return Mixer::gla;
  if (name == "deltanet") return Mixer::deltanet;
  if (name == "gdn") return Mixer::gdn;
  if (name == "kda") return Mixer::kda;
  if (name == "gdn2") return Mixer::gdn2;
  return std::nullopt;
}

inline const char* mixer_name(Mixer m) {
  switch (m) {
    case Mixer::linear: return "linear";
    case Mixer::gla: return "gla";
    case Mixer::deltanet: return "deltanet";
    case Mixer::gdn: return "gdn";
    case Mixer::kda: return "kda";
    case Mixer::gdn2: return "gdn2";
  }
  return "?";
}

inline GateKind gate_kind(Mixer m) {
  switch (m) {
    case Mixer::linear:
    case Mixer::deltanet: return GateKind::none;
    case Mixer::gdn: return GateKind::scalar;
    default: return GateKind::channel;
  }
}
inline bool uses_beta(Mixer m) {
  return m == Mixer::deltanet || m == Mixer::gdn || m == Mixer::kda;
}
inline bool is_delta_rule(Mixer m) { return m != Mixer::linear && m != Mixer::gla; }

template <class T>
struct MixerInputs {
  int len = 0, dk = 0, dv = 0;
  const T* q = nullptr;     // [len, dk]
  const T* k = nullptr;     // [len, dk]
  const T* v = nullptr;     // [len, dv]
  const T* g = nullptr;     // log-gates ≤ 0: gdn [len]; gla/kda/gdn2 [len, dk]
  const T* beta = nullptr;  // deltanet/gdn/kda [len]
  const T* b = nullptr;     // gdn2 erase gate [len, dk]
  const T* w = nullptr;     // gdn2 write gate [len, dv]
  T scale = 1;
  double factor_span = 0;   // see CoreInputs::factor_span
  // Cross-layer routing (LAA §4): the forward writes the layer's write residual
  // r_t = v_t − S_{t−1}(α_t ⊙ k_t) (deltanet/gdn/kda; the decayed error before β) or
  // r_t = z_t − S_{t−1}(α_t ⊙ b_t ⊙ k_t) (gdn2) into resid [len, dv]; the backward adds
  // the gradient dresid on it. Not defined for linear/gla (no residual).
  T* resid = nullptr;
  const T* dresid = nullptr;
  // β mixers: resid (and dresid) is the written update u_t = β_t·r_t instead (fla's v_new)
  bool resid_update = false;
};

// Gradient outputs, overwritten; nullptr = not wanted. Only the gradients of inputs the
// mixer uses are written (dbeta for deltanet/gdn/kda, db/dw for gdn2, dg when gated).
template <class T>
struct MixerGrads {
  T* dq = nullptr;
  T* dk = nullptr;
  T* dv = nullptr;
  T* dg = nullptr;
  T* dbeta = nullptr;
  T* db = nullptr;
  T* dw = nullptr;
  T* dS0 = nullptr;
};

enum class Form { recurrent, chunk };

namespace detail {

// Materialised erase/write vectors of one sequence, and the core inputs built on them.
template <class T>
struct Prepared {
  std::vector<T> e, z;
  CoreInputs<T> core;
};

template <class T>
Prepared<T> prepare(Mixer m, const MixerInputs<T>& in) {
  if (!in.q || !in.k || !in.v) throw std::invalid_argument("linear mixer: missing q/k/v");
  if (gate_kind(m) != GateKind::none && !in.g)
    throw std::invalid_argument(std::string("linear mixer ") + mixer_name(m) + ": missing gates");
  if (uses_beta(m) && !in.beta)
    throw std::invalid_argument(std::string("linear mixer ") + mixer_name(m) + ": missing beta");
  if (m == Mixer::gdn2 && (!in.b || !in.w))
    throw std::invalid_argument("linear mixer gdn2: missing erase/write gates b, w");
  Prepared<T> p;
  const std::size_t nk = (std::size_t)in.len * in.dk, nv = (std::size_t)in.len * in.dv;
  CoreInputs<T>& c = p.core;
  c.len = in.len;
  c.dk = in.dk;
  c.dv = in.dv;
  c.q = in.q;
  c.k = in.k;
  c.g = in.g;
  c.gate = gate_kind(m);
  c.scale = in.scale;
  c.factor_span = in.factor_span;
  if ((in.resid || in.dresid) && !is_delta_rule(m))
    throw std::invalid_argument(std::string("linear mixer ") + mixer_name(m) +
                                ": no write residual (routing needs a delta rule)");
  if (uses_beta(m)) {
    p.e.resize(nk);
    p.z.resize(nv);
    for (int t = 0; t < in.len; ++t) {
      for (int i = 0; i < in.dk; ++i)
        p.e[(std::size_t)t * in.dk + i] = in.beta[t] * in.k[(std::size_t)t * in.dk + i];
      for (int i = 0; i < in.dv; ++i)
        p.z[(std::size_t)t * in.dv + i] = in.beta[t] * in.v[(std::size_t)t * in.dv + i];
    }
    c.e = p.e.data();
    c.z = p.z.data();
  } else if (m == Mixer::gdn2) {
    p.e.resize(nk);
    p.z.resize(nv);
    for (std::size_t i = 0; i < nk; ++i) p.e[i] = in.b[i] * in.k[i];
    for (std::size_t i = 0; i < nv; ++i) p.z[i] = in.w[i] * in.v[i];
    c.e = p.e.data();
    c.z = p.z.data();
  } else {
    c.z = in.v;  // linear, gla: plain write, no erase
  }
  return p;
}

}  // namespace detail

// Forward of one sequence. S0 nullable (zero state); S_out nullable, may alias S0.
// For the chunk form, boundary (nullable) gets [num_chunks, dv, dk] chunk start states.
template <class T>
void mixer_forward(Mixer m, const MixerInputs<T>& in, Form form, int chunk, const T* S0, T* o,
                   T* S_out, T* boundary = nullptr) {
  auto p = detail::prepare(m, in);
  p.core.resid = in.resid;
  if (form == Form::recurrent)
    recurrent_forward(p.core, S0, o, S_out);
  else
    chunk_forward(p.core, chunk, S0, o, S_out, boundary);
  if (in.resid && uses_beta(m) && !in.resid_update)  // u = β r
    for (int t = 0; t < in.len; ++t)
      for (int i = 0; i < in.dv; ++i) in.resid[(std::size_t)t * in.dv + i] /= in.beta[t];
}

// The decode step: one token, state updated in place (S is [dv, dk]); o is [dv].
template <class T>
void mixer_step(Mixer m, MixerInputs<T> in, T* S, T* o) {
  in.len = 1;
  mixer_forward(m, in, Form::recurrent, 1, S, o, S);
}

// Backward of one sequence. dST nullable (no gradient on the final state). boundary: the
// chunk start states from mixer_forward (chunk form only; nullptr recomputes them).
template <class T>
void mixer_backward(Mixer m, const MixerInputs<T>& in, Form form, int chunk, const T* S0,
                    const T* dO, const T* dST, const MixerGrads<T>& gr,
                    const T* boundary = nullptr) {
  auto p = detail::prepare(m, in);
  const std::size_t nk = (std::size_t)in.len * in.dk, nv = (std::size_t)in.len * in.dv;
  std::vector<T> dk(nk), de(p.core.e ? nk : 0), dz(nv);
  // routing: r = u/β for the β mixers (u the core's residual), so du = dr/β plus a direct
  // −dr·u/β² on β (the core's backward adds u's own dependence on β through e and z)
  std::vector<T> du, u, dbeta_r;
  if (in.dresid && uses_beta(m) && !in.resid_update) {
    du.resize(nv);
    for (int t = 0; t < in.len; ++t)
      for (int i = 0; i < in.dv; ++i)
        du[(std::size_t)t * in.dv + i] = in.dresid[(std::size_t)t * in.dv + i] / in.beta[t];
    p.core.dresid = du.data();
    u.resize(nv);
    p.core.resid = u.data();
    if (form == Form::recurrent)
      recurrent_forward(p.core, S0, (T*)nullptr, (T*)nullptr);
    else
      chunk_forward(p.core, chunk, S0, (T*)nullptr, (T*)nullptr);
    p.core.resid = nullptr;
    dbeta_r.assign(in.len, T(0));
    for (int t = 0; t < in.len; ++t)
      for (int i = 0; i < in.dv; ++i) {
        const std::size_t j = (std::size_t)t * in.dv + i;
        dbeta_r[t] -= in.dresid[j] * u[j] / (in.beta[t] * in.beta[t]);
      }
  } else {
    p.core.dresid = in.dresid;
  }
  CoreGrads<T> cg;
  cg.dq = gr.dq;
  cg.dk = dk.data();
  cg.de = p.core.e ? de.data() : nullptr;
  cg.dz = dz.data();
  cg.dg = gr.dg;
  cg.dS0 = gr.dS0;
  if (form == Form::recurrent)
    recurrent_backward(p.core, S0, dO, dST, cg);
  else
    chunk_backward(p.core, chunk, S0, dO, dST, cg, boundary);
  if (uses_beta(m)) {
    // e = β k, z = β v
    for (int t = 0; t < in.len; ++t) {
      T db = 0;
      const T bt = in.beta[t];
      for (int i = 0; i < in.dk; ++i) {
        std::size_t j = (std::size_t)t * in.dk + i;
        db += de[j] * in.k[j];
        dk[j] += bt * de[j];
      }
      for (int i = 0; i < in.dv; ++i) {
        std::size_t j = (std::size_t)t * in.dv + i;
        db += dz[j] * in.v[j];
        if (gr.dv) gr.dv[j] = bt * dz[j];
      }
      if (gr.dbeta) gr.dbeta[t] = db + (dbeta_r.empty() ? T(0) : dbeta_r[t]);
    }
  } else if (m == Mixer::gdn2) {
    for (std::size_t j = 0; j < nk; ++j) {
      if (gr.db) gr.db[j] = de[j] * in.k[j];
      dk[j] += in.b[j] * de[j];
    }
    for (std::size_t j = 0; j < nv; ++j) {
      if (gr.dw) gr.dw[j] = dz[j] * in.v[j];
      if (gr.dv) gr.dv[j] = in.w[j] * dz[j];
    }
  } else if (gr.dv) {
    std::copy(dz.begin(), dz.end(), gr.dv);
  }
  if (gr.dk) std::copy(dk.begin(), dk.end(), gr.dk);
}

}  // namespace lar::kernels::cpu::linear
