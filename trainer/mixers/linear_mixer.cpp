// The linear-attention mixer layer (docs/spec.md §2) around the recurrences of kernels/linear:
//   q,k,v = projections of the normed input x
//   optional short causal depthwise conv (width model.conv_size) + SiLU on q, k, v
//   delta rules (deltanet, gdn, kda, gdn2), CCQ and model.qk_l2norm: q, k L2-normalised per
//   head; scale 1/sqrt(dk)
//   gates (per token, per head):
//     gla       g = logsigmoid(W₂W₁x + b₂)/16                  per key channel, rank gate_rank
//     deltanet  β = σ(w_βᵀx)
//     gdn       β; g = −exp(A_log)·softplus(w_aᵀx + dt_bias)   scalar
//     kda       β; g = −exp(A_log)·softplus(W₂W₁x + dt_bias)   per key channel
//     gdn2      g as kda; b = σ(W_b x) per key channel; w = σ(W_w x) per value channel
//     carve     g as kda; erase logits W_b x + U2 tanh(U1 m_c) (content, per head); w = σ(w_wᵀx)
//               scalar per head (kernels/carve/carve.hpp); model.carve.qkv: paper
//               takes q, k, v = SiLU(W x) as the paper prints them (no conv, no L2 norm)
//   CCQ (model.ccq.enabled, any of them): q ← (I − λΣ)q on L2-normalised q, k with
//     λ = σ(W_λ p_q + b_λ) from the raw query projection p_q, or a fixed λ
//   o → per-head RMSNorm (weight [dv] shared by the heads) × SiLU(W_g x) → W_o.
//   grouped value heads (model.n_v_heads = H, a multiple of the Hk query/key heads): q, k
//   have Hk heads; v, β, the gates, the recurrence and the output gate have H; value head h
//   reads key head h / (H/Hk) — the same as repeating q, k per group (fla's GVA).
// Initialisation and the choices above are documented in docs/architectures.md.
//
// This file is the CPU skeleton (f32 for training, f64 for the gradient checks); the mixer's
// gates come from its MixerDesc and the add-ons from Dims (linear_layer.hpp, read from the
// config by linear_config.cpp). The
// elementwise parts are host loops, projections go through Backend::gemm, the per-(batch,
// head) recurrences run in parallel over the backend's threads (each one single-threaded,
// so deterministic). On the CUDA backend forward/backward go to cuda_layers/linear_layer_cuda.cpp
// (same parameters, same math; bf16 chunk kernels), CARVE, CCQ and grouped value heads
// included, only with dk ∈ {64, 128, 256} and dv = 64·m (cuda_linear_unsupported says why
// not); so does decode (init_state/step: the per-token kernels, the state on the device),
// except with the cler/cler_h routings (cuda_linear_decode_unsupported).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/carve/carve.hpp"
#include "kernels/ccq/ccq.hpp"
#include "kernels/linear/mixers.hpp"
#include "trainer/mixer.hpp"
#include "trainer/mixers/linear_layer.hpp"

namespace lar::trainer::mixers {

namespace {

namespace lk = lar::kernels::cpu::linear;
using kernels::DType;
using kernels::Tensor;
using Decay = MixerDesc::Decay;

template <class T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}
template <class T>
inline T softplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}
template <class T>
inline T silu(T x) {
  return x * sigmoid(x);
}
template <class T>
inline T silu_grad(T x) {
  T s = sigmoid(x);
  return s * (T(1) + x * (T(1) - s));
}

template <class T>
DType dtype_of() {
  return sizeof(T) == 4 ? DType::f32 : DType::f64;
}
template <class T>
Tensor tv(std::vector<T>& v, std::initializer_list<int64_t> shape) {
  return Tensor(v.data(), dtype_of<T>(), shape);
}

constexpr double kNormEps = 1e-5;  // output RMSNorm
constexpr double kL2Eps = 1e-6;    // q/k L2 normalisation: x / sqrt(Σx² + eps)

// Decode state: recurrent S per (batch, head) and the conv tails of q, k, v.
template <class T>
struct LinearState : MixerState {
  std::vector<T> S;                   // [B,H,dv,dk]
  std::vector<T> tail_q, tail_k, tail_v;  // [B, W−1, C]
  std::vector<lk::CcqState<T>> ccq;       // [B·H] CCQ key statistics
  std::vector<lk::CarveState<T>> carve;   // [B·H] CARVE state (holds its own S)
};

// Everything computed by a forward that the backward needs (host buffers, reused).
template <class T>
struct Cache {
  int B = 0, T_ = 0;
  std::vector<T> x;                      // [N,d] the layer input
  std::vector<T> pq, pk, pv;             // projections before the conv [N,Cqk] / [N,Cv]
  std::vector<T> aq, ak, av;             // after conv + SiLU (= p without conv)
  std::vector<T> rq, rk;                 // 1/‖a‖ per (token, head) for L2 norm [N,H]
  std::vector<T> hq, hk, hv;             // per-(b,h) kernel inputs [B,H,T,·]
  std::vector<T> hg, hbeta, hb, hw;      // per-(b,h) gates
  std::vector<T> gpre, h1;               // gate pre-activations [N,Cq] or [N,H]; low rank [N,r]
  std::vector<T> beta_pre, b_pre, w_pre; // [N,H], [N,Cq], [N,Cv]
  std::vector<T> bounds;                 // chunk start states [B,H,nc,dv,dk]
  std::vector<T> o, rstd, on, og, ypre;  // [N,Cv], [N·H], [N,Cv], [N,Cv], [N,Cv]
  bool ccq_active = false;
  std::vector<T> hq_pre, lam, lam_pre;   // CCQ: q before the correction, λ [B,H,T], logits [N,H]
  std::vector<T> hbx, hws;               // CARVE: erase logits [B,H,T,dk], write [B,H,T]
  std::vector<lk::CarveCache<T>> ccache; // [B·H]
  std::vector<T> rin;                    // routing: p(l)'s side channel [N,Cv] (cler)
  std::vector<T> hres;                   // routing: write residuals [B,H,T,dv]
  Tensor out, d_out, d_in;               // routing tensors of this step (model-owned but d_in/out)
};

template <class T>
class Impl {
 public:
  Impl(const Dims& dm, const Slots& sl, const std::vector<Tensor>& p, const std::vector<Tensor>& g)
      : dm_(dm), sl_(sl), P_(p), G_(g) {}

  // x [B,T,d] → y [B,T,d]. With st (decode) the conv tails and states are carried and
  // updated; without, they start at zero and the cache for backward is filled.
  void forward(kernels::Backend& be, const T* x, T* y, int B, int len, LinearState<T>* st,
               bool training, Routing& route, kernels::Arena& arena) {
    Cache<T>& c = c_;
    const Dims& d = dm_;
    const int N = B * len;
    c.B = B;
    c.T_ = len;
    c.x.assign(x, x + (size_t)N * d.d);
    Tensor X = tv(c.x, {N, d.d});
    // projections
    c.pq.resize((size_t)N * d.Cqk);
    c.pk.resize((size_t)N * d.Cqk);
    c.pv.resize((size_t)N * d.Cv);
    be.gemm(X, false, P_[sl_.wq], true, tv(c.pq, {N, d.Cqk}));
    be.gemm(X, false, P_[sl_.wk], true, tv(c.pk, {N, d.Cqk}));
    be.gemm(X, false, P_[sl_.wv], true, tv(c.pv, {N, d.Cv}));
    conv_fwd(c.pq, c.aq, sl_.cq, d.Cqk, B, len, st ? &st->tail_q : nullptr);
    conv_fwd(c.pk, c.ak, sl_.ck, d.Cqk, B, len, st ? &st->tail_k : nullptr);
    conv_fwd(c.pv, c.av, sl_.cv, d.Cv, B, len, st ? &st->tail_v : nullptr);
    // CLER: the written value gets p(l)'s write residual, ṽ = v + Γ_l r_{p(l)}
    c.rin.clear();
    if (d.route.kind == Route::cler && !route.in.empty()) {
      if (route.in.numel() != (int64_t)N * d.Cv)
        throw RuntimeError("linear mixer: routing input " + route.in.shape_str() +
                           " does not match [B,T," + std::to_string(d.Cv) + "]");
      c.rin.assign(route.in.ptr<T>(), route.in.ptr<T>() + (size_t)N * d.Cv);
      const T gam = par(sl_.gamma)[0];
      for (size_t i = 0; i < c.av.size(); ++i) c.av[i] += gam * c.rin[i];
    }
    // gates
    gates_fwd(be, X, N);
    // gather per (b,h), L2-normalising q, k for the delta rules
    gather(B, len);
    // CCQ read correction of q
    c.ccq_active = d.ccq.on && !(d.ccq.disable_at_eval && !training);
    if (c.ccq_active) ccq_fwd(be, X, B, len, st);
    // the recurrence
    const int nc = lk::num_chunks(len, d.chunk);
    const size_t ss = (size_t)d.dv * d.dk;
    c.o.resize((size_t)N * d.Cv);
    if (!st && !d.carve.on) c.bounds.resize((size_t)B * d.H * nc * ss);
    if (!st && d.carve.on) c.ccache.resize((size_t)B * d.H);
    std::vector<T> ho((size_t)B * d.H * len * d.dv);
    const T scale = T(1) / std::sqrt(T(d.dk));
    const bool res = d.route.kind == Route::cler || d.route.kind == Route::cler_h;
    c.hres.resize(res ? ho.size() : 0);
#pragma omp parallel for schedule(static) num_threads(be.threads())
    for (int bh = 0; bh < B * d.H; ++bh) {
      T* o = &ho[(size_t)bh * len * d.dv];
      T* resid = res ? &c.hres[(size_t)bh * len * d.dv] : nullptr;
      if (d.carve.on) {
        auto ci = carve_inputs(bh, len, scale);
        ci.resid = resid;
        if (st)
          lk::carve_forward(ci, lk::Form::recurrent, &st->carve[bh], o);
        else
          lk::carve_forward(ci, lk::Form::chunk, (lk::CarveState<T>*)nullptr, o, &c.ccache[bh]);
        continue;
      }
      auto in = inputs(bh, len, scale);
      in.resid = resid;
      in.resid_update = d.route.update;
      if (st) {
        T* S = &st->S[(size_t)bh * ss];
        lk::mixer_forward(d.mixer, in, lk::Form::recurrent, d.chunk, S, o, S);
      } else {
        lk::mixer_forward(d.mixer, in, lk::Form::chunk, d.chunk, (const T*)nullptr, o, (T*)nullptr,
                          &c.bounds[(size_t)bh * nc * ss]);
      }
    }
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < d.H; ++h)
        for (int t = 0; t < len; ++t)
          std::copy_n(&ho[(((size_t)b * d.H + h) * len + t) * d.dv], d.dv,
                      &c.o[((size_t)b * len + t) * d.Cv + (size_t)h * d.dv]);
    // routing: publish the write residual (cler, cler_h) or the written value (clvr)
    c.out = Tensor();
    if (d.route.kind != Route::none) {
      c.out = arena.alloc(dtype_of<T>(), {(int64_t)N, (int64_t)d.Cv});
      T* out = c.out.template ptr<T>();
      if (res) {
        for (int b = 0; b < B; ++b)
          for (int h = 0; h < d.H; ++h)
            for (int t = 0; t < len; ++t)
              std::copy_n(&c.hres[(((size_t)b * d.H + h) * len + t) * d.dv], d.dv,
                          out + ((size_t)b * len + t) * d.Cv + (size_t)h * d.dv);
      } else {
        std::copy(c.av.begin(), c.av.end(), out);
      }
      route.out = st ? c.out.view({B, d.Cv}) : c.out.view({B, len, d.Cv});
    }
    // output: per-head RMSNorm × SiLU(W_g x) → W_o
    c.on.resize(c.o.size());
    c.rstd.resize((size_t)N * d.H);
    be.rmsnorm_fwd(tv(c.o, {N * d.H, d.dv}), P_[sl_.onorm], tv(c.on, {N * d.H, d.dv}),
                   tv(c.rstd, {N * d.H}), kNormEps);
    c.og.resize(c.o.size());
    be.gemm(X, false, P_[sl_.wgate], true, tv(c.og, {N, d.Cv}));
    c.ypre.resize(c.o.size());
    for (size_t i = 0; i < c.ypre.size(); ++i) c.ypre[i] = c.on[i] * silu(c.og[i]);
    be.gemm(tv(c.ypre, {N, d.Cv}), false, P_[sl_.wo], true, Tensor(y, dtype_of<T>(), {N, d.d}));
  }

  // dy [B,T,d] → dx (overwritten); parameter gradients accumulated.
  void backward(kernels::Backend& be, const T* dy_, T* dx_, Routing& route) {
    Cache<T>& c = c_;
    const Dims& d = dm_;
    const int B = c.B, len = c.T_, N = B * len;
    Tensor X = tv(c.x, {N, d.d});
    Tensor dY(const_cast<T*>(dy_), dtype_of<T>(), {N, d.d});
    Tensor dX(dx_, dtype_of<T>(), {N, d.d});
    // y = ypre W_oᵀ
    be.gemm(dY, true, tv(c.ypre, {N, d.Cv}), false, G_[sl_.wo], 1.0, 1.0);
    std::vector<T> dypre((size_t)N * d.Cv);
    be.gemm(dY, false, P_[sl_.wo], false, tv(dypre, {N, d.Cv}));
    // ypre = on ⊙ silu(og)
    std::vector<T> don(dypre.size()), dog(dypre.size());
    for (size_t i = 0; i < dypre.size(); ++i) {
      don[i] = dypre[i] * silu(c.og[i]);
      dog[i] = dypre[i] * c.on[i] * silu_grad(c.og[i]);
    }
    be.gemm(tv(dog, {N, d.Cv}), true, X, false, G_[sl_.wgate], 1.0, 1.0);
    be.gemm(tv(dog, {N, d.Cv}), false, P_[sl_.wgate], false, dX, 1.0, 0.0);  // dx overwritten
    std::vector<T> dO(dypre.size(), T(0));
    be.rmsnorm_bwd(tv(c.o, {N * d.H, d.dv}), P_[sl_.onorm], tv(c.rstd, {N * d.H}),
                   tv(don, {N * d.H, d.dv}), tv(dO, {N * d.H, d.dv}), G_[sl_.onorm]);
    // the recurrence, per (b,h)
    const int nc = lk::num_chunks(len, d.chunk);
    const size_t ss = (size_t)d.dv * d.dk, nk = (size_t)len * d.dk, nv = (size_t)len * d.dv;
    const size_t BH = (size_t)B * d.H;
    std::vector<T> hdo(BH * nv), dq(BH * nk), dk(BH * nk), dv(BH * nv);
    std::vector<T> dg(c.hg.size()), dbeta(c.hbeta.size()), db(c.hb.size()), dw(c.hw.size());
    std::vector<T> dbx(c.hbx.size()), dws(c.hws.size());
    const size_t nU1 = d.carve.on ? (size_t)d.carve.rank * d.dv : 0, nU2 = d.carve.on ? (size_t)d.dk * d.carve.rank : 0;
    std::vector<T> dU1(BH * nU1, T(0)), dU2(BH * nU2, T(0));
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < d.H; ++h)
        for (int t = 0; t < len; ++t)
          std::copy_n(&dO[((size_t)b * len + t) * d.Cv + (size_t)h * d.dv], d.dv,
                      &hdo[(((size_t)b * d.H + h) * len + t) * d.dv]);
    const size_t gstride = c.hg.size() / BH;
    const T scale = T(1) / std::sqrt(T(d.dk));
    // routing: the gradient arriving on the published side channel
    const bool has_dout = d.route.kind != Route::none && !route.d_out.empty();
    if (has_dout && route.d_out.numel() != (int64_t)N * d.Cv)
      throw RuntimeError("linear mixer: routing gradient " + route.d_out.shape_str() +
                         " does not match the side channel");
    std::vector<T> hdres;
    if (has_dout && !c.hres.empty()) {
      hdres.resize(BH * nv);
      const T* g = route.d_out.ptr<T>();
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < d.H; ++h)
          for (int t = 0; t < len; ++t)
            std::copy_n(g + ((size_t)b * len + t) * d.Cv + (size_t)h * d.dv, d.dv,
                        &hdres[(((size_t)b * d.H + h) * len + t) * d.dv]);
    }
#pragma omp parallel for schedule(static) num_threads(be.threads())
    for (int bh = 0; bh < (int)BH; ++bh) {
      const T* dres = hdres.empty() ? nullptr : &hdres[bh * nv];
      if (d.carve.on) {
        lk::CarveGrads<T> cg;
        cg.dq = &dq[bh * nk];
        cg.dk = &dk[bh * nk];
        cg.dv = &dv[bh * nv];
        cg.dg = &dg[bh * gstride];
        cg.dbx = &dbx[bh * nk];
        cg.dw = &dws[(size_t)bh * len];
        cg.dU1 = &dU1[bh * nU1];
        cg.dU2 = &dU2[bh * nU2];
        auto ci = carve_inputs(bh, len, scale);
        ci.dresid = dres;
        lk::carve_backward(ci, lk::Form::chunk, &hdo[bh * nv], cg, &c.ccache[bh]);
        continue;
      }
      auto in = inputs(bh, len, scale);
      in.dresid = dres;
      in.resid_update = d.route.update;
      lk::MixerGrads<T> gr;
      gr.dq = &dq[bh * nk];
      gr.dk = &dk[bh * nk];
      gr.dv = &dv[bh * nv];
      if (!dg.empty()) gr.dg = &dg[bh * gstride];
      if (!dbeta.empty()) gr.dbeta = &dbeta[(size_t)bh * len];
      if (!db.empty()) gr.db = &db[bh * nk];
      if (!dw.empty()) gr.dw = &dw[bh * nv];
      lk::mixer_backward(d.mixer, in, lk::Form::chunk, d.chunk, (const T*)nullptr,
                         &hdo[bh * nv], (const T*)nullptr, gr, &c.bounds[(size_t)bh * nc * ss]);
    }
    // CARVE content projection: sum the per-(b,h) gradients in a fixed order
    if (d.carve.on && !d.carve.freeze_content)
      for (int h = 0; h < d.H; ++h)
        for (int b = 0; b < B; ++b) {
          const size_t bh = (size_t)b * d.H + h;
          for (size_t i = 0; i < nU1; ++i) grad(sl_.U1)[h * nU1 + i] += dU1[bh * nU1 + i];
          for (size_t i = 0; i < nU2; ++i) grad(sl_.U2)[h * nU2 + i] += dU2[bh * nU2 + i];
        }
    // CCQ: from the corrected q back to the normalised q, k and λ
    std::vector<T> dpq_ccq;
    if (c.ccq_active) ccq_bwd(be, X, dX, B, len, dq, dk, dpq_ccq);
    // scatter back to [N, C] and undo the L2 normalisation
    // (grouped value heads: the value heads of one group add up on their key head)
    std::vector<T> daq((size_t)N * d.Cqk, T(0)), dak((size_t)N * d.Cqk, T(0)), dav((size_t)N * d.Cv);
    std::vector<T> tq(d.dk), tk(d.dk);
    const int grp = d.H / d.Hk;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < d.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t hi = ((size_t)b * d.H + h) * len + t, n = (size_t)b * len + t;
          const size_t kc = n * d.Cqk + (size_t)(h / grp) * d.dk;
          const T* qn = c.ccq_active ? &c.hq_pre[hi * d.dk] : &c.hq[hi * d.dk];
          l2_bwd(&dq[hi * d.dk], qn, c.rq[n * d.H + h], tq.data());
          l2_bwd(&dk[hi * d.dk], &c.hk[hi * d.dk], c.rk[n * d.H + h], tk.data());
          for (int i = 0; i < d.dk; ++i) {
            daq[kc + i] += tq[i];
            dak[kc + i] += tk[i];
          }
          std::copy_n(&dv[hi * d.dv], d.dv, &dav[n * d.Cv + h * d.dv]);
        }
    if (has_dout && d.route.kind == Route::clvr) {  // published ṽ = v
      const T* g = route.d_out.ptr<T>();
      for (size_t i = 0; i < dav.size(); ++i) dav[i] += g[i];
    }
    if (!c.rin.empty()) {  // ṽ = v + Γ r_in
      const T gam = par(sl_.gamma)[0];
      T dgam = 0;
      for (size_t i = 0; i < dav.size(); ++i) dgam += dav[i] * c.rin[i];
      grad(sl_.gamma)[0] += dgam;
      if (!route.d_in.empty()) {
        T* din = route.d_in.ptr<T>();
        for (size_t i = 0; i < dav.size(); ++i) din[i] += gam * dav[i];
      }
    }
    gates_bwd(be, X, dX, N, dg, dbeta, db, dw, dbx, dws);
    // conv + SiLU, then the projections
    std::vector<T> dp;
    conv_bwd(c.pq, c.aq, daq, dp, sl_.cq, d.Cqk, B, len);
    for (size_t i = 0; i < dpq_ccq.size(); ++i) dp[i] += dpq_ccq[i];  // λ reads p_q
    proj_bwd(be, X, dX, dp, sl_.wq, N, d.Cqk);
    conv_bwd(c.pk, c.ak, dak, dp, sl_.ck, d.Cqk, B, len);
    proj_bwd(be, X, dX, dp, sl_.wk, N, d.Cqk);
    conv_bwd(c.pv, c.av, dav, dp, sl_.cv, d.Cv, B, len);
    proj_bwd(be, X, dX, dp, sl_.wv, N, d.Cv);
  }

  std::unique_ptr<LinearState<T>> make_state(int B) const {
    auto s = std::make_unique<LinearState<T>>();
    s->S.assign((size_t)B * dm_.H * dm_.dv * dm_.dk, T(0));
    const int w1 = std::max(dm_.W - 1, 0);
    s->tail_q.assign((size_t)B * w1 * dm_.Cqk, T(0));
    s->tail_k.assign((size_t)B * w1 * dm_.Cqk, T(0));
    s->tail_v.assign((size_t)B * w1 * dm_.Cv, T(0));
    if (dm_.ccq.on) s->ccq.assign((size_t)B * dm_.H, lk::CcqState<T>(dm_.dk));
    if (dm_.carve.on) s->carve.assign((size_t)B * dm_.H, lk::CarveState<T>(dm_.dk, dm_.dv));
    return s;
  }

 private:
  const T* par(int slot) const { return P_[slot].template ptr<T>(); }
  T* grad(int slot) const { return G_[slot].template ptr<T>(); }

  lk::MixerInputs<T> inputs(int bh, int len, T scale) const {
    const Cache<T>& c = c_;
    const size_t BH = (size_t)c.B * dm_.H;
    lk::MixerInputs<T> in;
    in.len = len;
    in.dk = dm_.dk;
    in.dv = dm_.dv;
    in.q = &c.hq[(size_t)bh * len * dm_.dk];
    in.k = &c.hk[(size_t)bh * len * dm_.dk];
    in.v = &c.hv[(size_t)bh * len * dm_.dv];
    if (!c.hg.empty()) in.g = &c.hg[(size_t)bh * (c.hg.size() / BH)];
    if (!c.hbeta.empty()) in.beta = &c.hbeta[(size_t)bh * len];
    if (!c.hb.empty()) in.b = &c.hb[(size_t)bh * len * dm_.dk];
    if (!c.hw.empty()) in.w = &c.hw[(size_t)bh * len * dm_.dv];
    in.scale = scale;
    return in;
  }

  lk::CarveInputs<T> carve_inputs(int bh, int len, T scale) const {
    const Cache<T>& c = c_;
    const int h = bh % dm_.H;
    lk::CarveInputs<T> in;
    in.len = len;
    in.dk = dm_.dk;
    in.dv = dm_.dv;
    in.rank = dm_.carve.rank;
    in.q = &c.hq[(size_t)bh * len * dm_.dk];
    in.k = &c.hk[(size_t)bh * len * dm_.dk];
    in.v = &c.hv[(size_t)bh * len * dm_.dv];
    in.g = &c.hg[(size_t)bh * len * dm_.dk];
    in.bx = &c.hbx[(size_t)bh * len * dm_.dk];
    in.w = &c.hws[(size_t)bh * len];
    if (dm_.carve.freeze_content) {
      in.U1 = zeros_.data();
      in.U2 = zeros_.data();
    } else {
      in.U1 = par(sl_.U1) + (size_t)h * dm_.carve.rank * dm_.dv;
      in.U2 = par(sl_.U2) + (size_t)h * dm_.dk * dm_.carve.rank;
    }
    in.content_chunk = dm_.carve.content_chunk;
    in.chunk = dm_.chunk;
    in.scale = scale;
    in.content_grad = dm_.carve.content_grad;
    return in;
  }

  // CCQ: λ per (token, head), then q ← (I − λΣ)q per (b,h); c.hq_pre keeps the input.
  void ccq_fwd(kernels::Backend& be, const Tensor& X, int B, int len, LinearState<T>* st) {
    Cache<T>& c = c_;
    const Dims& d = dm_;
    const int N = B * len;
    c.lam.resize((size_t)N * d.H);
    if (d.ccq.learned) {
      c.lam_pre.resize((size_t)N * d.H);
      be.gemm(tv(c.pq, {N, d.Cqk}), false, P_[sl_.wlam], true, tv(c.lam_pre, {N, d.H}));
    }
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < d.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t n = (size_t)b * len + t, hi = ((size_t)b * d.H + h) * len + t;
          c.lam[hi] = d.ccq.learned ? sigmoid(c.lam_pre[n * d.H + h] + par(sl_.blam)[h])
                                    : T(d.ccq.lambda);
        }
    c.hq_pre = c.hq;
#pragma omp parallel for schedule(static) num_threads(be.threads())
    for (int bh = 0; bh < B * d.H; ++bh) {
      lk::CcqInputs<T> in;
      in.len = len;
      in.dk = d.dk;
      in.q = &c.hq_pre[(size_t)bh * len * d.dk];
      in.k = &c.hk[(size_t)bh * len * d.dk];
      in.lambda = &c.lam[(size_t)bh * len];
      in.centered = d.ccq.centered;
      T* out = &c.hq[(size_t)bh * len * d.dk];
      if (st)
        lk::ccq_recurrent_forward(in, &st->ccq[bh], out);
      else
        lk::ccq_chunk_forward(in, d.chunk, (lk::CcqState<T>*)nullptr, out);
    }
  }

  // dq arrives on the corrected q: replaced by the gradient on the normalised q; dk gets
  // the statistics' share; dpq receives the λ gate's gradient on p_q ([N, Cqk]).
  void ccq_bwd(kernels::Backend& be, const Tensor& X, const Tensor& dX, int B, int len,
               std::vector<T>& dq, std::vector<T>& dk, std::vector<T>& dpq) {
    Cache<T>& c = c_;
    const Dims& d = dm_;
    const int N = B * len;
    const size_t nk = (size_t)len * d.dk;
    std::vector<T> dqn(dq.size()), dkc(dk.size()), dlam(c.lam.size());
#pragma omp parallel for schedule(static) num_threads(be.threads())
    for (int bh = 0; bh < B * d.H; ++bh) {
      lk::CcqInputs<T> in;
      in.len = len;
      in.dk = d.dk;
      in.q = &c.hq_pre[bh * nk];
      in.k = &c.hk[bh * nk];
      in.lambda = &c.lam[(size_t)bh * len];
      in.centered = d.ccq.centered;
      lk::ccq_chunk_backward(in, d.chunk, (const lk::CcqState<T>*)nullptr, &dq[bh * nk],
                             lk::CcqGrads<T>{&dqn[bh * nk], &dkc[bh * nk], &dlam[(size_t)bh * len]});
    }
    dq.swap(dqn);
    for (size_t i = 0; i < dk.size(); ++i) dk[i] += dkc[i];
    dpq.clear();
    if (!d.ccq.learned) return;
    std::vector<T> dpre((size_t)N * d.H);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < d.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t n = (size_t)b * len + t, hi = ((size_t)b * d.H + h) * len + t;
          const T l = c.lam[hi];
          dpre[n * d.H + h] = dlam[hi] * l * (T(1) - l);
          grad(sl_.blam)[h] += dpre[n * d.H + h];
        }
    dpq.assign((size_t)N * d.Cqk, T(0));
    be.gemm(tv(dpre, {N, d.H}), true, tv(c.pq, {N, d.Cqk}), false, G_[sl_.wlam], 1.0, 1.0);
    be.gemm(tv(dpre, {N, d.H}), false, P_[sl_.wlam], false, tv(dpq, {N, d.Cqk}));
  }

  // a[t,c] = silu(Σ_i w[c,i] p[t−W+1+i, c]) per sequence; p before t=0 comes from the tail.
  void conv_fwd(const std::vector<T>& p, std::vector<T>& a, int slot, int C, int B, int len,
                std::vector<T>* tail) {
    a.resize(p.size());
    if (!dm_.conv) {
      a = p;
      if (dm_.silu_only)
        for (auto& e : a) e = silu(e);
      return;
    }
    const int W = dm_.W;
    const T* w = par(slot);
    for (int b = 0; b < B; ++b) {
      const T* pb = &p[(size_t)b * len * C];
      T* ab = &a[(size_t)b * len * C];
      const T* tb = tail ? &(*tail)[(size_t)b * (W - 1) * C] : nullptr;
      for (int t = 0; t < len; ++t)
        for (int ch = 0; ch < C; ++ch) {
          T s = 0;
          for (int i = 0; i < W; ++i) {
            int src = t - W + 1 + i;
            T x = src >= 0 ? pb[(size_t)src * C + ch]
                           : (tb ? tb[(size_t)(W - 1 + src) * C + ch] : T(0));
            s += w[(size_t)ch * W + i] * x;
          }
          ab[(size_t)t * C + ch] = silu(s);
        }
      if (tail) {  // keep the last W−1 inputs
        std::vector<T> ext((size_t)(W - 1 + len) * C);
        std::copy_n(tb, (size_t)(W - 1) * C, ext.begin());
        std::copy_n(pb, (size_t)len * C, ext.begin() + (size_t)(W - 1) * C);
        std::copy_n(ext.end() - (std::ptrdiff_t)(W - 1) * C, (size_t)(W - 1) * C,
                    &(*tail)[(size_t)b * (W - 1) * C]);
      }
    }
  }

  // From da (gradient on the conv output) to dp (on its input), accumulating dw.
  void conv_bwd(const std::vector<T>& p, const std::vector<T>& a, const std::vector<T>& da,
                std::vector<T>& dp, int slot, int C, int B, int len) {
    if (!dm_.conv) {
      dp = da;
      if (dm_.silu_only)
        for (size_t i = 0; i < dp.size(); ++i) dp[i] *= silu_grad(p[i]);
      return;
    }
    const int W = dm_.W;
    const T* w = par(slot);
    T* dw = grad(slot);
    dp.assign(p.size(), T(0));
    std::vector<T> du(p.size());
    for (int b = 0; b < B; ++b) {
      const T* pb = &p[(size_t)b * len * C];
      for (int t = 0; t < len; ++t)
        for (int ch = 0; ch < C; ++ch) {
          // recompute the pre-activation s (cheap) for silu'
          T s = 0;
          for (int i = 0; i < W; ++i) {
            int src = t - W + 1 + i;
            if (src >= 0) s += w[(size_t)ch * W + i] * pb[(size_t)src * C + ch];
          }
          du[((size_t)b * len + t) * C + ch] = da[((size_t)b * len + t) * C + ch] * silu_grad(s);
        }
    }
    for (int b = 0; b < B; ++b) {
      const T* pb = &p[(size_t)b * len * C];
      const T* dub = &du[(size_t)b * len * C];
      T* dpb = &dp[(size_t)b * len * C];
      for (int t = 0; t < len; ++t)
        for (int ch = 0; ch < C; ++ch) {
          const T g = dub[(size_t)t * C + ch];
          for (int i = 0; i < W; ++i) {
            int src = t - W + 1 + i;
            if (src < 0) continue;
            dw[(size_t)ch * W + i] += g * pb[(size_t)src * C + ch];
            dpb[(size_t)src * C + ch] += g * w[(size_t)ch * W + i];
          }
        }
    }
  }

  // p = x Wᵀ: dW += dpᵀ x, dx += dp W.
  void proj_bwd(kernels::Backend& be, const Tensor& X, const Tensor& dX, std::vector<T>& dp,
                int slot, int N, int C) {
    be.gemm(tv(dp, {N, C}), true, X, false, G_[slot], 1.0, 1.0);
    be.gemm(tv(dp, {N, C}), false, P_[slot], false, dX, 1.0, 1.0);
  }

  // Low-rank gate f = (x W₁ᵀ) W₂ᵀ, into c.gpre ([N, Cq]); h1 cached.
  void lowrank_fwd(kernels::Backend& be, const Tensor& X, int N) {
    Cache<T>& c = c_;
    c.h1.resize((size_t)N * dm_.rank);
    c.gpre.resize((size_t)N * dm_.Cq);
    be.gemm(X, false, P_[sl_.g1], true, tv(c.h1, {N, dm_.rank}));
    be.gemm(tv(c.h1, {N, dm_.rank}), false, P_[sl_.g2], true, tv(c.gpre, {N, dm_.Cq}));
  }
  void lowrank_bwd(kernels::Backend& be, const Tensor& X, const Tensor& dX, std::vector<T>& df,
                   int N) {
    Cache<T>& c = c_;
    std::vector<T> dh1((size_t)N * dm_.rank);
    be.gemm(tv(df, {N, dm_.Cq}), true, tv(c.h1, {N, dm_.rank}), false, G_[sl_.g2], 1.0, 1.0);
    be.gemm(tv(df, {N, dm_.Cq}), false, P_[sl_.g2], false, tv(dh1, {N, dm_.rank}));
    be.gemm(tv(dh1, {N, dm_.rank}), true, X, false, G_[sl_.g1], 1.0, 1.0);
    be.gemm(tv(dh1, {N, dm_.rank}), false, P_[sl_.g1], false, dX, 1.0, 1.0);
  }

  // Gate pre-activations (cached); the activated gates are written by gather().
  void gates_fwd(kernels::Backend& be, const Tensor& X, int N) {
    Cache<T>& c = c_;
    const Dims& d = dm_;
    if (md_.low_rank_gate()) {
      lowrank_fwd(be, X, N);
    } else if (md_.decay == Decay::head) {
      c.gpre.resize((size_t)N * d.H);
      be.gemm(X, false, P_[sl_.wa], true, tv(c.gpre, {N, d.H}));
    } else {
      c.gpre.clear();
    }
    if (md_.beta()) {
      c.beta_pre.resize((size_t)N * d.H);
      be.gemm(X, false, P_[sl_.wbeta], true, tv(c.beta_pre, {N, d.H}));
    }
    if (d.carve.on) {
      c.b_pre.resize((size_t)N * d.Cq);
      c.w_pre.resize((size_t)N * d.H);
      be.gemm(X, false, P_[sl_.werase], true, tv(c.b_pre, {N, d.Cq}));
      be.gemm(X, false, P_[sl_.wwrite], true, tv(c.w_pre, {N, d.H}));
    } else if (md_.gated()) {
      c.b_pre.resize((size_t)N * d.Cq);
      c.w_pre.resize((size_t)N * d.Cv);
      be.gemm(X, false, P_[sl_.werase], true, tv(c.b_pre, {N, d.Cq}));
      be.gemm(X, false, P_[sl_.wwrite], true, tv(c.w_pre, {N, d.Cv}));
    }
  }

  // log-gate value of channel ch (key channel, or head for scalar) at token n, and its
  // derivative with respect to the pre-activation, the bias and A_log.
  T gate_value(int n, int ch) const {
    const Cache<T>& c = c_;
    const bool per_head = md_.decay == Decay::head;
    const int h = per_head ? ch : ch / dm_.dk;
    const int C = per_head ? dm_.H : dm_.Cq;
    const T f = c.gpre[(size_t)n * C + ch];
    if (md_.decay == Decay::logsig) return -softplus(-(f + par(sl_.gb)[ch])) / T(16);
    return -std::exp(par(sl_.A_log)[h]) * softplus(f + par(sl_.dt_bias)[ch]);
  }

  void gather(int B, int len) {
    Cache<T>& c = c_;
    const Dims& d = dm_;
    const int N = B * len;
    const size_t BH = (size_t)B * d.H;
    c.hq.resize(BH * len * d.dk);
    c.hk.resize(BH * len * d.dk);
    c.hv.resize(BH * len * d.dv);
    c.rq.assign((size_t)N * d.H, T(1));
    c.rk.assign((size_t)N * d.H, T(1));
    const lk::GateKind gk = lk::gate_kind(d.mixer);
    c.hg.resize(gk == lk::GateKind::none ? 0 : BH * len * (gk == lk::GateKind::scalar ? 1 : d.dk));
    c.hbeta.resize(md_.beta() ? BH * len : 0);
    const bool g2 = md_.gated() && !d.carve.on;
    c.hb.resize(g2 ? BH * len * d.dk : 0);
    c.hw.resize(g2 ? BH * len * d.dv : 0);
    c.hbx.resize(d.carve.on ? BH * len * d.dk : 0);
    c.hws.resize(d.carve.on ? BH * len : 0);
    const int grp = d.H / d.Hk;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < d.H; ++h)
        for (int t = 0; t < len; ++t) {
          const size_t hi = ((size_t)b * d.H + h) * len + t, n = (size_t)b * len + t;
          const T* aq = &c.aq[n * d.Cqk + (size_t)(h / grp) * d.dk];
          const T* ak = &c.ak[n * d.Cqk + (size_t)(h / grp) * d.dk];
          if (d.l2) {
            T sq = 0, sk = 0;
            for (int i = 0; i < d.dk; ++i) {
              sq += aq[i] * aq[i];
              sk += ak[i] * ak[i];
            }
            c.rq[n * d.H + h] = T(1) / std::sqrt(sq + T(kL2Eps));
            c.rk[n * d.H + h] = T(1) / std::sqrt(sk + T(kL2Eps));
          }
          for (int i = 0; i < d.dk; ++i) {
            c.hq[hi * d.dk + i] = aq[i] * c.rq[n * d.H + h];
            c.hk[hi * d.dk + i] = ak[i] * c.rk[n * d.H + h];
          }
          std::copy_n(&c.av[n * d.Cv + h * d.dv], d.dv, &c.hv[hi * d.dv]);
          if (gk == lk::GateKind::scalar) c.hg[hi] = gate_value((int)n, h);
          if (gk == lk::GateKind::channel)
            for (int i = 0; i < d.dk; ++i) c.hg[hi * d.dk + i] = gate_value((int)n, h * d.dk + i);
          if (!c.hbeta.empty()) c.hbeta[hi] = sigmoid(c.beta_pre[n * d.H + h]);
          if (d.carve.on) {  // erase logits go to the kernel raw (it adds the content term)
            std::copy_n(&c.b_pre[n * d.Cq + h * d.dk], d.dk, &c.hbx[hi * d.dk]);
            c.hws[hi] = sigmoid(c.w_pre[n * d.H + h]);
          }
          if (!c.hb.empty())
            for (int i = 0; i < d.dk; ++i)
              c.hb[hi * d.dk + i] = sigmoid(c.b_pre[n * d.Cq + h * d.dk + i]);
          if (!c.hw.empty())
            for (int i = 0; i < d.dv; ++i)
              c.hw[hi * d.dv + i] = sigmoid(c.w_pre[n * d.Cv + h * d.dv + i]);
        }
  }

  // y = a·r (r = 1/sqrt(Σa²+eps)): da = r (dy − y (y·dy)). Identity when not normalised.
  void l2_bwd(const T* dy, const T* y, T r, T* da) const {
    if (!dm_.l2) {
      std::copy_n(dy, dm_.dk, da);
      return;
    }
    T dot = 0;
    for (int i = 0; i < dm_.dk; ++i) dot += y[i] * dy[i];
    for (int i = 0; i < dm_.dk; ++i) da[i] = r * (dy[i] - y[i] * dot);
  }

  void gates_bwd(kernels::Backend& be, const Tensor& X, const Tensor& dX, int N,
                 const std::vector<T>& dg, const std::vector<T>& dbeta, const std::vector<T>& db,
                 const std::vector<T>& dw, const std::vector<T>& dbx, const std::vector<T>& dws) {
    Cache<T>& c = c_;
    const Dims& d = dm_;
    const int B = c.B, len = c.T_;
    const lk::GateKind gk = lk::gate_kind(d.mixer);
    if (gk != lk::GateKind::none) {
      const int C = gk == lk::GateKind::scalar ? d.H : d.Cq;
      std::vector<T> df((size_t)N * C);
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < d.H; ++h)
          for (int t = 0; t < len; ++t) {
            const size_t hi = ((size_t)b * d.H + h) * len + t, n = (size_t)b * len + t;
            const int nch = gk == lk::GateKind::scalar ? 1 : d.dk;
            for (int i = 0; i < nch; ++i) {
              const int ch = gk == lk::GateKind::scalar ? h : h * d.dk + i;
              const T gval = c.hg[hi * nch + i], dgv = dg[hi * nch + i];
              const T f = c.gpre[n * C + ch];
              T dfv;
              if (md_.decay == Decay::logsig) {
                // g = logsigmoid(f + b)/16: dg/df = σ(−(f + b))/16
                dfv = dgv * sigmoid(-(f + par(sl_.gb)[ch])) / T(16);
                grad(sl_.gb)[ch] += dfv;
              } else {
                // g = −exp(A_log)·softplus(f + dt_bias)
                const T A = std::exp(par(sl_.A_log)[h]);
                dfv = -dgv * A * sigmoid(f + par(sl_.dt_bias)[ch]);
                grad(sl_.dt_bias)[ch] += dfv;
                grad(sl_.A_log)[h] += dgv * gval;
              }
              df[n * C + ch] = dfv;
            }
          }
      if (md_.decay == Decay::head) {
        be.gemm(tv(df, {N, d.H}), true, X, false, G_[sl_.wa], 1.0, 1.0);
        be.gemm(tv(df, {N, d.H}), false, P_[sl_.wa], false, dX, 1.0, 1.0);
      } else {
        lowrank_bwd(be, X, dX, df, N);
      }
    }
    if (!dbeta.empty()) {
      std::vector<T> dpre((size_t)N * d.H);
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < d.H; ++h)
          for (int t = 0; t < len; ++t) {
            const size_t hi = ((size_t)b * d.H + h) * len + t, n = (size_t)b * len + t;
            const T s = c.hbeta[hi];
            dpre[n * d.H + h] = dbeta[hi] * s * (T(1) - s);
          }
      be.gemm(tv(dpre, {N, d.H}), true, X, false, G_[sl_.wbeta], 1.0, 1.0);
      be.gemm(tv(dpre, {N, d.H}), false, P_[sl_.wbeta], false, dX, 1.0, 1.0);
    }
    if (d.carve.on) {
      std::vector<T> dbp((size_t)N * d.Cq), dwp((size_t)N * d.H);
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < d.H; ++h)
          for (int t = 0; t < len; ++t) {
            const size_t hi = ((size_t)b * d.H + h) * len + t, n = (size_t)b * len + t;
            std::copy_n(&dbx[hi * d.dk], d.dk, &dbp[n * d.Cq + h * d.dk]);
            const T s = c.hws[hi];
            dwp[n * d.H + h] = dws[hi] * s * (T(1) - s);
          }
      be.gemm(tv(dbp, {N, d.Cq}), true, X, false, G_[sl_.werase], 1.0, 1.0);
      be.gemm(tv(dbp, {N, d.Cq}), false, P_[sl_.werase], false, dX, 1.0, 1.0);
      be.gemm(tv(dwp, {N, d.H}), true, X, false, G_[sl_.wwrite], 1.0, 1.0);
      be.gemm(tv(dwp, {N, d.H}), false, P_[sl_.wwrite], false, dX, 1.0, 1.0);
    }
    if (!db.empty()) {
      std::vector<T> dbp((size_t)N * d.Cq), dwp((size_t)N * d.Cv);
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < d.H; ++h)
          for (int t = 0; t < len; ++t) {
            const size_t hi = ((size_t)b * d.H + h) * len + t, n = (size_t)b * len + t;
            for (int i = 0; i < d.dk; ++i) {
              const T s = c.hb[hi * d.dk + i];
              dbp[n * d.Cq + h * d.dk + i] = db[hi * d.dk + i] * s * (T(1) - s);
            }
            for (int i = 0; i < d.dv; ++i) {
              const T s = c.hw[hi * d.dv + i];
              dwp[n * d.Cv + h * d.dv + i] = dw[hi * d.dv + i] * s * (T(1) - s);
            }
          }
      be.gemm(tv(dbp, {N, d.Cq}), true, X, false, G_[sl_.werase], 1.0, 1.0);
      be.gemm(tv(dbp, {N, d.Cq}), false, P_[sl_.werase], false, dX, 1.0, 1.0);
      be.gemm(tv(dwp, {N, d.Cv}), true, X, false, G_[sl_.wwrite], 1.0, 1.0);
      be.gemm(tv(dwp, {N, d.Cv}), false, P_[sl_.wwrite], false, dX, 1.0, 1.0);
    }
  }

  Dims dm_;
  MixerDesc md_ = dm_.desc();
  Slots sl_;
  std::vector<Tensor> P_, G_;
  Cache<T> c_;
  std::vector<T> zeros_ = std::vector<T>((size_t)std::max(dm_.carve.rank * dm_.dv, dm_.dk * dm_.carve.rank), T(0));
};

class LinearMixer final : public Mixer {
 public:
  explicit LinearMixer(const MixerConfig& cfg)
      : cfg_(cfg), dm_(linear_dims(cfg)), specs_(linear_params(dm_, cfg.init_std, sl_)) {}

  std::string kind() const override { return cfg_.kind; }
  bool publishes() const override { return dm_.route.kind != Route::none; }
  int64_t side_dim() const override { return publishes() ? dm_.Cv : 0; }
  std::vector<ParamSpec> params() const override { return specs_; }
  void bind(std::vector<Tensor> params, std::vector<Tensor> grads) override {
    if (params.size() != specs_.size() || grads.size() != specs_.size())
      throw RuntimeError("linear mixer: bind() got " + std::to_string(params.size()) +
                         " tensors for " + std::to_string(specs_.size()) + " parameters");
    params_ = std::move(params);
    grads_ = std::move(grads);
    f32_.reset();
    f64_.reset();
    cuda_.reset();
  }

  void forward(ForwardContext& ctx, const Tensor& x, const Tensor& y, Routing& route) override {
    if (ctx.be.device() == kernels::Device::cuda) return cuda(ctx.be).forward(ctx, x, y, route);
    check_cpu(ctx.be);
    const int B = (int)x.size(0), len = (int)x.size(1);
    if (ctx.be.dtype() == DType::f32)
      impl<float>().forward(ctx.be, x.ptr<float>(), y.ptr<float>(), B, len, nullptr, ctx.training,
                            route, ctx.arena);
    else
      impl<double>().forward(ctx.be, x.ptr<double>(), y.ptr<double>(), B, len, nullptr,
                             ctx.training, route, ctx.arena);
  }
  void backward(ForwardContext& ctx, const Tensor& dy, const Tensor& dx, Routing& route) override {
    if (ctx.be.device() == kernels::Device::cuda) return cuda(ctx.be).backward(ctx, dy, dx, route);
    check_cpu(ctx.be);
    if (ctx.be.dtype() == DType::f32)
      impl<float>().backward(ctx.be, dy.ptr<float>(), dx.ptr<float>(), route);
    else
      impl<double>().backward(ctx.be, dy.ptr<double>(), dx.ptr<double>(), route);
  }

  std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch, int) const override {
    if (be.device() == kernels::Device::cuda)
      return const_cast<LinearMixer*>(this)->cuda_decode(be).init_state(be, batch);
    check_cpu(be);
    if (be.dtype() == DType::f32)
      return const_cast<LinearMixer*>(this)->impl<float>().make_state(batch);
    return const_cast<LinearMixer*>(this)->impl<double>().make_state(batch);
  }
  void step(ForwardContext& ctx, const Tensor& x, const Tensor& y, MixerState& state,
            Routing& route) override {
    if (ctx.be.device() == kernels::Device::cuda) return cuda_decode(ctx.be).step(ctx, x, y, state, route);
    check_cpu(ctx.be);
    const int B = (int)x.size(0);
    if (ctx.be.dtype() == DType::f32) {
      auto* st = dynamic_cast<LinearState<float>*>(&state);
      if (!st) throw RuntimeError("linear mixer: step() with a foreign state");
      impl<float>().forward(ctx.be, x.ptr<float>(), y.ptr<float>(), B, 1, st, ctx.training, route,
                            ctx.arena);
    } else {
      auto* st = dynamic_cast<LinearState<double>*>(&state);
      if (!st) throw RuntimeError("linear mixer: step() with a foreign state");
      impl<double>().forward(ctx.be, x.ptr<double>(), y.ptr<double>(), B, 1, st, ctx.training,
                             route, ctx.arena);
    }
  }

 private:
  // The host implementation runs on the CPU backend; CUDA has its own (cuda(), cuda_decode()).
  static void check_cpu(const kernels::Backend& be) {
    if (be.device() != kernels::Device::cpu)
      throw UserError("linear mixers run on the cpu and cuda backends only, not on backend " + be.name());
  }

  // The CUDA implementation for decode: what its forward takes, less cuda_linear_decode_unsupported.
  CudaLinear& cuda_decode(const kernels::Backend& be) {
    const std::string why = cuda_linear_decode_unsupported(dm_);
    if (!why.empty())
      throw UserError("model.architecture: '" + cfg_.kind + "' decode (step) on backend " + be.name() + ": " + why +
                      " (decode with backend: cpu)");
    return cuda(be);
  }

  // The CUDA implementation, built on first use (after bind()).
  CudaLinear& cuda(const kernels::Backend& be) {
    const std::string why = cuda_linear_unsupported(dm_);
    if (!why.empty())
      throw UserError("model.architecture: '" + cfg_.kind + "' on backend " + be.name() + ": " + why +
                      " (use backend: cpu)");
    if (params_.empty()) throw RuntimeError("linear mixer: used before bind()");
    if (!cuda_) {
      if (!cuda_linear_factory())
        throw UserError("linear mixers: this build has no CUDA support (backend " + be.name() + ")");
      cuda_ = cuda_linear_factory()(dm_, sl_, params_, grads_);
    }
    return *cuda_;
  }

  template <class T>
  Impl<T>& impl() {
    if (params_.empty()) throw RuntimeError("linear mixer: used before bind()");
    if constexpr (sizeof(T) == 4) {
      if (!f32_) f32_ = std::make_unique<Impl<float>>(dm_, sl_, params_, grads_);
      return *f32_;
    } else {
      if (!f64_) f64_ = std::make_unique<Impl<double>>(dm_, sl_, params_, grads_);
      return *f64_;
    }
  }

  MixerConfig cfg_;
  Dims dm_;
  Slots sl_;
  std::vector<ParamSpec> specs_;
  std::vector<Tensor> params_, grads_;
  std::unique_ptr<Impl<float>> f32_;
  std::unique_ptr<Impl<double>> f64_;
  std::unique_ptr<CudaLinear> cuda_;
};

MixerFactory factory() {
  return [](const MixerConfig& c) { return std::make_unique<LinearMixer>(c); };
}

const MixerRegistration reg_linear{"linear", factory()};
const MixerRegistration reg_gla{"gla", factory()};
const MixerRegistration reg_deltanet{"deltanet", factory()};
const MixerRegistration reg_gdn{"gdn", factory()};
const MixerRegistration reg_kda{"kda", factory()};
const MixerRegistration reg_gdn2{"gdn2", factory()};
const MixerRegistration reg_carve{"carve", factory()};

}  // namespace

}  // namespace lar::trainer::mixers
