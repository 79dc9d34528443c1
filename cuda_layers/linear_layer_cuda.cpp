// The linear-mixer layer (docs/spec.md §2; see linear_mixer.cpp for the math and the CPU
// reference) on the CUDA backend. Same parameters and results as the CPU path within bf16
// rounding:
//   P = x [Wq;Wk;Wv]ᵀ             one GEMM (the three are adjacent in the flat buffer)
//   q, k, v = conv+SiLU(P), L2     one fused pass → bf16 q, k [B,T,Hk,dk], v [B,T,H,dv]
//                                  (kernels/linear/layer_ops; key heads of 128 or 256 get their
//                                  L2 norm from a pass of their own, wide_key.hpp, and run the
//                                  recurrent wide-key kernels)
//   gates                          small GEMMs + one elementwise map each
//   CCQ (model.ccq.enabled)        q ← (I − λΣ)q by ccq_fwd in front of any backbone,
//                                  λ = σ(p_q W_λᵀ + b_λ) from P's q columns, or fixed
//   o = chunk kernel(q, k, v, …)   delta_fwd (deltanet, gdn) / channel_fwd (gla, kda, gdn2;
//                                  value heads wider than 64 through grouped_heads.hpp;
//                                  linear = gla with a zero log-gate) / carve_fwd (CARVE: gdn2's
//                                  gates with raw erase logits x W_bᵀ, a scalar write gate per
//                                  head and the content projection U1, U2; kernels/carve/
//                                  carve_cuda.hpp)
//   y = (RMSNorm_h(o) ⊙ SiLU(x W_gᵀ)) W_oᵀ   norm × gate fused
// Grouped value heads (model.n_v_heads, Hk < H): q, k and their conv and L2 norm are Hk heads
// wide, everything else H; the chunk kernels take gshape().Hk and sum the virtual heads' dq,
// dk back onto their key head (grouped_heads.hpp). Where the query differs between the value
// heads of a group (CCQ's q_c by λ, the cler/cler_h readout's shifted query by the gates) or
// the kernel takes one key head per value head (CARVE), the pass runs over q, k repeated per
// group and the group's gradients are summed back (per_value_q, readout_k).
// Routing: clvr publishes ṽ from the qkv pass; cler/cler_h publish the write residual
// r_t = z_t − S_{t−1}(a_t ⊙ e_t) through a second readout of the same recurrence with the
// query shifted by one token (layer_ops.hpp), and its gradient through a second backward
// (not for CARVE: its erase gates come from inside the kernel; cuda_linear_unsupported).
// Value heads wider than 64 read out through the same grouped value-head mapping as the main
// pass (route_* take the value width). model.routing_signal: update (β mixers) publishes
// u = β·r: route_residual scales r by β and keeps r for the backward, whose r-gradient is β·du
// and ∂L/∂β gains Σ du·r (route_backward). Gated until verified (kLaaRoutingCudaVerified).
// Parameter gradients are accumulated by GEMMs (beta = 1) and deterministic column sums.
// Decode (init_state/step, one token of B sequences a call): the same projections, qkv pass,
// gates, CCQ and output as an evaluation forward at T = 1, the conv over a window of the last
// W projection rows kept in the state, and the per-token kernels (delta_decode,
// channel_decode, carve_decode through grouped_heads.hpp / wide_key.hpp) on the state S; CCQ
// carries its key statistics through ccq_fwd's K0, m0, t0. Not with cler/cler_h
// (cuda_linear_decode_unsupported).
// Everything runs on the backend's stream; activations live in the step's arena.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/carve/carve_cuda.hpp"
#include "kernels/ccq/ccq_cuda.hpp"
#include "kernels/channel_rule/channel_rule.hpp"
#include "cuda_layers/layer_common.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/delta_rule/delta_rule.hpp"
#include "kernels/linear/arena_bf16.hpp"
#include "kernels/linear/grouped_heads.hpp"
#include "kernels/linear/layer_ops.hpp"
#include "kernels/linear/wide_key.hpp"
#include "trainer/mixers/linear_layer.hpp"

namespace lar::trainer::mixers {

namespace {

namespace cl = lar::kernels::cuda::linear;
using bf16 = __nv_bfloat16;
using kernels::DType;
using kernels::Tensor;
using Decay = MixerDesc::Decay;

using cuda_layer::kNormEps;
using cuda_layer::kernel_choice;

// What the layer keeps from forward to backward besides o, the boundary states and the
// small gates, by the run's cuda.linear_keep: all (the default) keeps P = x [Wq;Wk;Wv]ᵀ and
// og = x W_gᵀ, og's columns in the same GEMM as P — x [Wq;Wk;Wv;(W_β;W_a;0);W_g]ᵀ → [P | og],
// one wider GEMM instead of two, and in the backward one weight-gradient GEMM and one dx GEMM
// over [∂P | ∂og] (dog is written into those columns) instead of two each; p keeps P and
// recomputes og in the backward (one [Cv, d] GEMM — 1.9 ms a step for the 344M GDN — for
// 64 MiB a layer less at B·T = 32K in bf16); og keeps og and recomputes P (the smallest). p
// and og run og's own GEMM on the same inputs: the same bits; all's wider GEMM changes the
// products' last bits. (The CUDA backend has checked the value.)
bool keeps_p(const kernels::Backend& be) { return be.options().cuda.linear_keep != "og"; }
bool keeps_og(const kernels::Backend& be) { return be.options().cuda.linear_keep != "p"; }

using kernels::cuda::linear::Bf;
using kernels::cuda::linear::bf_alloc;
float* fptr(const Tensor& t) { return t.empty() ? nullptr : t.ptr<float>(); }

// The decode state of one layer (init_state/step), in one device allocation of the backend:
// the recurrent state S fp32 [B,H,dv,dk] (the decode kernels' layout, the CPU's too), the last
// W projection rows P of each sequence (two buffers [B,W,ldp] in act_dtype(), the current one
// and the next: the conv runs the forward's qkv pass over this window, so its last row is the
// forward's value at that position), CARVE's content state [B,H,128] (m of the current content
// chunk and its running output sum), CCQ's key statistics K [B,H,dk,dk], m [B,H,dk] (two sets:
// ccq_fwd reads one and writes the other), gdn's folded projection weight packed once (the
// weights of the decode are those at init_state), and the position. All zero at the start.
struct CudaLinearState final : MixerState {
  CudaLinearState(kernels::Backend& b, std::size_t bytes) : be(b), mem(b.alloc_bytes(bytes)) {}
  ~CudaLinearState() override { be.free_bytes(mem); }
  CudaLinearState(const CudaLinearState&) = delete;
  CudaLinearState& operator=(const CudaLinearState&) = delete;
  kernels::Backend& be;
  void* mem;
  int64_t B = 0, pos = 0;
  DType at = DType::f32;
  int window = 1;  // rows of the conv window: conv_size, or 1 without a conv
  float* S = nullptr;
  void* win[2] = {nullptr, nullptr};
  int cur = 0;                       // the window holding the last token
  float* content = nullptr;          // CARVE
  float* K[2] = {nullptr, nullptr};  // CCQ
  float* m[2] = {nullptr, nullptr};
  int kcur = 0;          // the statistics after the last token
  void* wcat = nullptr;  // gdn: [ldp, d] in act_dtype()
};

class CudaLinearImpl final : public CudaLinear {
 public:
  CudaLinearImpl(const Dims& d, const Slots& s, const std::vector<Tensor>& p, const std::vector<Tensor>& g)
      : d_(d), s_(s), P_(p), G_(g) {
    // The fused QKV GEMM needs wq, wk, wv adjacent (ParamStore declares them in order).
    if (!cuda_layer::adjacent(P_, {s_.wq, s_.wk, s_.wv}) || !cuda_layer::adjacent(G_, {s_.wq, s_.wk, s_.wv}))
      throw RuntimeError("linear mixer (cuda): wq, wk, wv are not adjacent in the parameter buffer");
    nqkv_ = ldp_ = 2 * d_.Cqk + d_.Cv;
    Wqkv_ = Tensor(P_[s_.wq].data, DType::f32, {nqkv_, d_.d});
    Gqkv_ = Tensor(G_[s_.wq].data, DType::f32, {nqkv_, d_.d});
    // gdn: w_beta and w_a, declared one after the other, make one [2H, d] projection
    if (md_.decay == Decay::head) {
      const auto* b = static_cast<const char*>(P_[s_.wbeta].data);
      const auto* gb = static_cast<const char*>(G_[s_.wbeta].data);
      if (static_cast<const char*>(P_[s_.wa].data) == b + P_[s_.wbeta].bytes() &&
          static_cast<const char*>(G_[s_.wa].data) == gb + G_[s_.wbeta].bytes()) {
        Wba_ = Tensor(P_[s_.wbeta].data, DType::f32, {2 * d_.H, d_.d});
        Gba_ = Tensor(G_[s_.wbeta].data, DType::f32, {2 * d_.H, d_.d});
      }
    }
  }

  // x, y, dy and dx are the model's tensors in act_dtype() (the model hands every mixer
  // those; any dtype works: x and dy are converted here when they differ). Activations in
  // the backend's act_dtype() (bf16 in mixed precision) wherever they are GEMM operands or
  // outputs, so no GEMM converts an operand. Kept from forward to backward (per layer): o
  // and the boundary states (the chunk kernels'), P = x [Wq;Wk;Wv]ᵀ and og = x W_gᵀ or one
  // of them (keeps_p, keeps_og), gdn's folded weight copy, the output norm's
  // rstd and the small gate tensors ([N, H] or [N, rank]). Everything else of the forward
  // lives above an arena mark and is released at its end: og or P when not kept, q, k, v,
  // the channel mixers' [N, Cq] log-gates (and gdn2's b, w), ypre; the backward recomputes
  // them (a GEMM, one qkv pass, the gate maps; ypre comes out of the norm × gate backward)
  // instead of keeping ≈ 0.6 GB per layer at B·T = 32K.
  void forward(ForwardContext& ctx, const Tensor& x, const Tensor& y, Routing& route) override {
    auto& be = ctx.be;
    auto& ar = ctx.arena;
    cudaStream_t st = cuda_layer::stream(be, "linear mixer");
    const int64_t B = x.size(0), T = x.size(1), N = B * T;
    B_ = B, T_ = T;
    X_ = x.view({N, d_.d});
    at_ = be.act_dtype();
    rin_ = Tensor();
    if (d_.route.kind == Route::cler && !route.in.empty()) {
      if (route.in.numel() != N * d_.Cv)
        throw RuntimeError("linear mixer (cuda): routing input " + route.in.shape_str() + " does not match [B,T," +
                           std::to_string(d_.Cv) + "]");
      rin_ = route.in;
    }
    // kept for the backward (and the published side channel): o, the boundary states, P
    // and/or og (keeps_p, keeps_og)
    kernels_ = kernel_choice(be);
    keep_p_ = keeps_p(be) && ctx.training;  // evaluation has no backward: keep the smaller og
    keep_og_ = !keep_p_ || keeps_og(be);
    // gdn's folded gates: P gets fβ, fa and zero padding to a multiple of 8 columns (16-byte
    // bf16 rows), from a copy of [Wq; Wk; Wv; W_β; W_a; 0] in act_dtype() made here — the
    // weights are tiny next to x — and kept for the backward's dx GEMM (GEMMs of their own
    // re-read x and read-modify-write dx for 32 columns: memory-bound, 2.3 ms a step slower for
    // the 344M GDN). fβ and fa are rounded to act_dtype() with P, like q, k, v.
    fold_ = !Wba_.empty();
    wide_ = keep_p_ && keep_og_;
    pw_ = fold_ ? (nqkv_ + 2 * d_.H + 7) / 8 * 8 : nqkv_;
    ldp_ = pw_ + (wide_ ? d_.Cv : 0);
    wcat_ = Tensor();
    if (fold_ || wide_) {
      // the GEMM's weight [Wq; Wk; Wv; (W_β; W_a; 0); (W_g)] in act_dtype(), [ldp_, d]
      wcat_ = ar.alloc(at_, {ldp_, d_.d});
      cl::LayerTimer tm("linear: weight copy", st);
      cl::pack_pieces(wcat_pieces(), wcat_.data, act_bf16(), st);
    }
    o_ = bf_alloc(ar, N * d_.Cv);
    const std::size_t bb = wide_carve()     ? cl::wide_carve_boundary_bytes(shape())
                           : delta_kernel() ? cl::grouped_boundary_bytes(gshape())
                                            : cl::grouped_channel_boundary_bytes(channel_kind(), gshape());
    bound_ = ar.alloc(DType::f32, {(int64_t)(bb + 3) / 4});
    P_qkv_ = keep_p_ ? ar.alloc(at_, {N, ldp_}) : Tensor();
    og_ = keep_og_ && !wide_ ? ar.alloc(at_, {N, d_.Cv}) : Tensor();  // wide_: og is in P_qkv_
    rstd_ = ar.alloc(DType::f32, {N * d_.H});
    saved_gates_alloc(ar, N);
    // CCQ: λ (and its pre-activation) kept; in training also q_c and the final key
    // statistics ccq_bwd starts from (q_c is [N, Cq] bf16, 64 MiB a layer at B·T = 32K,
    // d = 1024; a second ccq_fwd in the backward cost ≈ 4% of that layer's time). Evaluation
    // may switch it off (model.ccq.disable_at_eval), as on the CPU.
    ccq_on_ = d_.ccq.on && !(d_.ccq.disable_at_eval && !ctx.training);
    lam_ = flam_ = Tensor();
    qc_ = Bf{};
    ccq_stats_ = cl::CcqStats{};
    if (ccq_on_) {
      lam_ = ar.alloc(DType::f32, {N, d_.H});
      if (d_.ccq.learned) flam_ = ar.alloc(DType::f32, {N, d_.H});
      if (ctx.training) {
        qc_ = bf_alloc(ar, N * d_.Cq);
        ccq_stats_.K = ar.alloc(DType::f32, {B * d_.H * d_.dk * d_.dk}).ptr<float>();
        ccq_stats_.m = ar.alloc(DType::f32, {B * d_.H * d_.dk}).ptr<float>();
      }
    }
    // CARVE: the content signal m_c of every chunk (written by carve_fwd, read by carve_bwd);
    // frozen content runs the kernel with U1 = U2 = 0 (no parameters), as the CPU does.
    content_ = Uzero_ = Tensor();
    if (d_.carve.on) {
      const std::size_t cb = wide_carve() ? cl::wide_carve_content_bytes(shape()) : cl::carve_content_bytes(shape());
      content_ = ar.alloc(DType::f32, {(int64_t)(cb + 3) / 4});
      if (d_.carve.freeze_content) Uzero_ = ar.zeros(DType::f32, {(int64_t)d_.H * d_.carve.rank * std::max(d_.dk, d_.dv)});
    }
    route.out = Tensor();
    Tensor vout;
    if (d_.route.kind == Route::clvr) vout = ar.alloc(DType::f32, {B, T, d_.Cv});
    const bool readout = d_.route.kind == Route::cler || d_.route.kind == Route::cler_h;
    r_raw_ = Tensor();
    if (readout) {
      qr_ = bf_alloc(ar, N * d_.Cq);
      route.out = ar.alloc(DType::f32, {B, T, d_.Cv});
      // routing_signal: update publishes u = β·r; r itself is kept for ∂L/∂β
      if (d_.route.update && ctx.training) r_raw_ = ar.alloc(DType::f32, {N, d_.Cv});
    }
    const auto mark = ar.mark();
    const Tensor Xa = as_act(be, ar, X_);
    inputs(be, ar, st, N, Xa, false, fptr(vout));
    // CCQ: the recurrence reads the corrected query
    const bf16* qread = main_q();
    if (ccq_on_) {
      ccq_lambda(be, ar, st, N);
      const Bf qc = qc_.p ? qc_ : bf_alloc(ar, N * d_.Cq);
      cl::LayerTimer tm("linear: ccq_fwd", st);
      if (d_.dk != 64) cl::wide_ccq_fwd(shape(), ccq_inputs(), qc.p, ccq_stats_, st);  // wide key heads
      else cl::ccq_fwd(shape(), ccq_inputs(), qc.p, ccq_stats_, st);
      qread = qc.p;
    }
    // the recurrence
    {
      cl::LayerTimer tm(kernel_name(false), st);
      kernel_fwd(qread, o_.p, bound_bf(), st);
    }
    // routing: publish ṽ (clvr) or the write residual (cler, cler_h)
    if (d_.route.kind == Route::clvr) route.out = vout;
    if (readout) {
      cl::LayerTimer tm("linear: routing readout (fwd)", st);
      cl::route_query(route_args(), qr_.p, st);
      Bf o2 = bf_alloc(ar, N * d_.Cv);
      kernel_fwd(qr_.p, o2.p, nullptr, st, true);
      cl::route_residual(route_args(), o2.p, route.out.ptr<float>(), st, fptr(r_raw_));
    }
    output(be, ar, st, N, Xa, y);
    ar.release(mark);
  }

  void backward(ForwardContext& ctx, const Tensor& dy, const Tensor& dx, Routing& route) override {
    auto& be = ctx.be;
    auto& ar = ctx.arena;
    cudaStream_t st = cuda_layer::stream(be, "linear mixer");
    const int64_t N = B_ * T_;
    det_ = be.options().deterministic;
    kernels_ = kernel_choice(be);
    const Tensor dX = dx.view({N, d_.d});
    auto mark = ar.mark();
    const Tensor Xa = as_act(be, ar, X_);
    const Tensor dY = as_act(be, ar, dy.view({N, d_.d}));
    // what the forward released: P or og, q, k, v, the large gates, ypre
    inputs(be, ar, st, N, Xa, true, nullptr);
    if (!keep_og_) {
      og_ = ar.alloc(at_, {N, d_.Cv});
      be.gemm(Xa, false, P_[s_.wgate], true, og_);
    }
    // CCQ: q_c and the final key statistics, kept by the forward
    const bf16* qread = main_q();
    const cl::CcqStats stats = ccq_stats_;
    if (ccq_on_) {
      if (!qc_.p) throw RuntimeError("linear mixer (cuda): backward after an evaluation forward (CCQ kept nothing)");
      qread = qc_.p;
    }
    // y = ypre W_oᵀ, ypre = RMSNorm_h(o) ⊙ SiLU(og): the norm × gate backward also writes
    // ypre again (the forward released it) for W_o's gradient
    Tensor dypre = ar.alloc(at_, {N, d_.Cv});
    be.gemm(dY, false, P_[s_.wo], false, dypre);
    Tensor ypre = ar.alloc(at_, {N, d_.Cv});
    Bf dO = bf_alloc(ar, N * d_.Cv);
    // ∂L/∂P: gdn's folded gates write their columns (and the padding) here, the conv
    // backward the q, k, v columns, and with wide_ the norm × gate backward dog
    Tensor dP = ar.alloc(at_, {N, ldp_});
    Tensor dog = wide_ ? Tensor() : ar.alloc(at_, {N, d_.Cv});
    void* dogp = wide_ ? static_cast<char*>(dP.data) + pw_ * elem_bytes(dP) : dog.data;
    {
      cl::LayerTimer tm("linear: out norm+gate (bwd)", st);
      Tensor scratch = ar.alloc(DType::f32, {(int64_t)cl::out_gate_backward_scratch_floats(N * d_.H, d_.dv)});
      cl::out_gate_backward(N * d_.H, o_.p, og_ptr(), P_[s_.onorm].ptr<float>(), rstd_.ptr<float>(), dypre.data, dO.p,
                            dogp, ypre.data, G_[s_.onorm].ptr<float>(), scratch.ptr<float>(), act_bf16(), st, d_.H,
                            og_ld(), d_.dv);
    }
    be.gemm(dY, true, ypre, false, G_[s_.wo], 1.0, 1.0);
    if (!wide_) {
      be.gemm(dog, true, Xa, false, G_[s_.wgate], 1.0, 1.0);
      be.gemm(dog, false, P_[s_.wgate], false, dX, 1.0, 0.0);  // dx overwritten
    }
    // the recurrence
    Grads g = grads_alloc(ar, N, per_value_q());
    {
      cl::LayerTimer tm(kernel_name(true), st);
      kernel_bwd(qread, dO.p, g, st);
    }
    // CCQ: the backbone's dq is on q_c; ccq_bwd turns it into dq on the normalised q, adds
    // the statistics' share into dk, and gives ∂L/∂λ (→ b_λ, W_λ and p_q when learned)
    Tensor dflam;
    if (ccq_on_) {
      Bf dq = bf_alloc(ar, N * d_.Cq);
      Tensor dlam = ar.alloc(DType::f32, {N, d_.H});
      {
        cl::LayerTimer tm("linear: ccq_bwd", st);
        if (d_.dk != 64) cl::wide_ccq_bwd(shape(), ccq_inputs(), stats, g.dq.p, dq.p, g.dk.p, dlam.ptr<float>(), st);
        else cl::ccq_bwd(shape(), ccq_inputs(), stats, g.dq.p, dq.p, g.dk.p, dlam.ptr<float>(), st);
      }
      g.dq = dq;
      if (d_.ccq.learned) {
        dflam = ar.alloc(DType::f32, {N, d_.H});
        gate_bwd(gate_args(cl::GateMap::sigmoid, flam_, s_.blam, 1), dlam.ptr<float>(), nullptr, nullptr,
                 dflam.ptr<float>(), d_.H, nullptr, st);
        colsum_param(ar, st, dflam, 1, s_.blam);
      }
    }
    if (per_value_q()) {  // grouped value heads over repeated q, k: the group's dq, dk onto its key head
      const int G = static_cast<int>(d_.H / d_.Hk);
      Bf dq = bf_alloc(ar, N * d_.Cqk), dk = bf_alloc(ar, N * d_.Cqk);
      cl::sum_head_groups(g.dq.p, dq.p, N, d_.Hk, G, d_.dk, st);
      cl::sum_head_groups(g.dk.p, dk.p, N, d_.Hk, G, d_.dk, st);
      g.dq = dq;
      g.dk = dk;
    }
    // routing: the gradient on the published side channel
    const bool has_dout = d_.route.kind != Route::none && !route.d_out.empty();
    if (has_dout && route.d_out.numel() != N * d_.Cv)
      throw RuntimeError("linear mixer (cuda): routing gradient " + route.d_out.shape_str() +
                         " does not match the side channel");
    Tensor ek, ev, eb, ew;
    if (has_dout && (d_.route.kind == Route::cler || d_.route.kind == Route::cler_h)) {
      cl::LayerTimer tm("linear: routing readout (bwd)", st);
      Bf do2 = bf_alloc(ar, N * d_.Cv);
      cl::route_readout_grad(route_args(), route.d_out.ptr<float>(), do2.p, st);
      Grads g2 = grads_alloc(ar, N, true);
      kernel_bwd(qr_.p, do2.p, g2, st, true);
      ek = ar.alloc(DType::f32, {N, d_.Cq});
      ev = ar.alloc(DType::f32, {N, d_.Cv});
      cl::RouteGrads rg;
      rg.dr = route.d_out.ptr<float>();
      if (d_.route.update) {
        if (r_raw_.empty())
          throw RuntimeError("linear mixer (cuda): backward after an evaluation forward (the routed update kept no r)");
        rg.r = r_raw_.ptr<float>();
      }
      rg.qr = qr_.p;
      rg.dqr = g2.dq.p;
      rg.dk2 = g2.dk.p;
      rg.dv2 = g2.dv.p;
      rg.ek = ek.ptr<float>();
      rg.ev = ev.ptr<float>();
      if (!g_.empty() && md_.decay != Decay::none) {
        rg.dg = fptr(g.dg);
        rg.dg2 = fptr(g2.dg);
      }
      if (!beta_.empty()) {
        rg.dbeta = fptr(g.dbeta);
        rg.dbeta2 = fptr(g2.dbeta);
      }
      if (md_.gated()) {
        eb = ar.alloc(DType::f32, {N, d_.Cq});
        ew = ar.alloc(DType::f32, {N, d_.Cv});
        rg.db2 = g2.db.p;
        rg.dw2 = g2.dw.p;
        rg.eb = eb.ptr<float>();
        rg.ew = ew.ptr<float>();
      }
      cl::route_backward(route_args(), rg, st);
      if (kr_.p) {  // grouped value heads: ek is on the repeated k, its sum on the key heads
        Tensor ekk = ar.alloc(DType::f32, {N, d_.Cqk});
        cl::sum_head_groups(ek.ptr<float>(), ekk.ptr<float>(), N, d_.Hk, d_.H / d_.Hk, d_.dk, st);
        ek = ekk;
      }
    }
    // gdn's folded gates write into dP; the others add into dx, which the W_g GEMM above
    // wrote (wide_: the final dx GEMM writes it, they follow that)
    if (fold_ || !wide_) gates_backward(be, ar, st, N, g, eb, ew, Xa, dX, dP);
    // conv + SiLU + L2 backward in one pass, then the fused projection
    {
      cl::LayerTimer tm("linear: conv+silu+l2 (bwd)", st);
      cl::QkvGrads qg;
      qg.dq = g.dq.p;
      qg.dk = g.dk.p;
      qg.dv = g.dv.p;
      qg.ek = fptr(ek);
      qg.ev = fptr(ev);
      if (has_dout && d_.route.kind == Route::clvr) qg.dvout = route.d_out.ptr<float>();
      Tensor dgam;
      if (!rin_.empty()) {
        dgam = ar.alloc(DType::f32, {N, d_.Cv});
        qg.dgam_terms = dgam.ptr<float>();
        qg.d_in = fptr(route.d_in);
      }
      if (wide_l2()) {  // the L2 norm of wide key heads, outside the fused pass
        cl::l2_rows_backward(N * d_.Hk, d_.dk, q_.p, rq_.ptr<float>(), g.dq.p, st);
        cl::l2_rows_backward(N * d_.Hk, d_.dk, k_.p, rk_.ptr<float>(), g.dk.p, st);
      }
      const cl::QkvArgs qa = qkv_args();
      Tensor scratch = ar.alloc(DType::f32, {(int64_t)cl::qkv_backward_scratch_floats(qa)});
      cl::qkv_backward(qa, qg, dP.data, d_.conv ? G_[s_.cq].ptr<float>() : nullptr,
                       d_.conv ? G_[s_.ck].ptr<float>() : nullptr, d_.conv ? G_[s_.cv].ptr<float>() : nullptr,
                       scratch.ptr<float>(), st);
      if (!rin_.empty()) {
        Tensor cs = ar.alloc(DType::f32, {(int64_t)cl::colsum_scratch_floats(N, d_.Cv)});
        cl::colsum_accumulate(dgam.ptr<float>(), N, d_.Cv, d_.Cv, d_.Cv, G_[s_.gamma].ptr<float>(), cs.ptr<float>(),
                              st);
      }
    }
    if (!dflam.empty()) ccq_lambda_backward(be, ar, st, N, dflam, dP);
    if (!wcat_.empty()) {
      // one weight-gradient GEMM for all of wcat_'s weights into a scratch (their gradients
      // are not adjacent: the convs' lie between), added to each; one dx GEMM
      Tensor dW = ar.alloc(DType::f32, {ldp_, d_.d});
      be.gemm(dP, true, Xa, false, dW, 1.0, 0.0);
      {
        cl::LayerTimer tm("linear: weight gradient scatter", st);
        cl::scatter_add_pieces(wcat_pieces(), dW.ptr<float>(), st);
      }
      be.gemm(dP, false, wcat_, false, dX, 1.0, wide_ ? 0.0 : 1.0);  // wide_: dx overwritten
    } else {
      be.gemm(dP, true, Xa, false, Gqkv_, 1.0, 1.0);
      be.gemm(dP, false, Wqkv_, false, dX, 1.0, 1.0);
    }
    if (wide_ && !fold_) gates_backward(be, ar, st, N, g, eb, ew, Xa, dX, dP);
    ar.release(mark);
  }

  // Decode: the layout of an evaluation forward (P without og; gdn's gates folded into P), with
  // the per-token kernels in place of the chunk kernels.
  std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch) override {
    cudaStream_t st = cuda_layer::stream(be, "linear mixer");
    if (batch < 1) throw RuntimeError("linear mixer (cuda): init_state for a batch of " + std::to_string(batch));
    decode_layout(be);
    const int64_t B = batch;
    const std::size_t es = kernels::dtype_size(at_);
    const int window = d_.conv ? d_.W : 1;
    auto round = [](std::size_t b) { return (b + 255) / 256 * 256; };
    const std::size_t s_bytes = round((std::size_t)B * d_.H * d_.dv * d_.dk * 4);
    const std::size_t w_bytes = round((std::size_t)B * window * ldp_ * es);
    const std::size_t c_bytes = d_.carve.on ? round((std::size_t)B * d_.H * 128 * 4) : 0;
    const std::size_t k_bytes = d_.ccq.on ? round((std::size_t)B * d_.H * d_.dk * d_.dk * 4) : 0;
    const std::size_t m_bytes = d_.ccq.on ? round((std::size_t)B * d_.H * d_.dk * 4) : 0;
    const std::size_t p_bytes = fold_ ? round((std::size_t)ldp_ * d_.d * es) : 0;
    const std::size_t total = s_bytes + 2 * w_bytes + c_bytes + 2 * (k_bytes + m_bytes) + p_bytes;
    auto s = std::make_unique<CudaLinearState>(be, total);
    char* p = static_cast<char*>(s->mem);
    LAR_CUDA_CHECK(cudaMemsetAsync(p, 0, total, st));
    auto take = [&](std::size_t n) {
      char* r = n ? p : nullptr;
      p += n;
      return r;
    };
    s->B = B;
    s->at = at_;
    s->window = window;
    s->S = reinterpret_cast<float*>(take(s_bytes));
    s->win[0] = take(w_bytes);
    s->win[1] = take(w_bytes);
    s->content = reinterpret_cast<float*>(take(c_bytes));
    for (int i = 0; i < 2; ++i) {
      s->K[i] = reinterpret_cast<float*>(take(k_bytes));
      s->m[i] = reinterpret_cast<float*>(take(m_bytes));
    }
    s->wcat = take(p_bytes);
    if (fold_) cl::pack_pieces(wcat_pieces(), s->wcat, act_bf16(), st);
    return s;
  }

  // One token of each of the state's B sequences: x, y [B, d].
  void step(ForwardContext& ctx, const Tensor& x, const Tensor& y, MixerState& state, Routing& route) override {
    auto& be = ctx.be;
    auto& ar = ctx.arena;
    cudaStream_t st = cuda_layer::stream(be, "linear mixer");
    auto* s = dynamic_cast<CudaLinearState*>(&state);
    if (!s) throw RuntimeError("linear mixer (cuda): step() with a foreign state");
    const int64_t N = x.size(0);
    if (x.ndim != 2 || x.size(1) != d_.d || N != s->B)
      throw RuntimeError("linear mixer (cuda): step() input " + x.shape_str() + " for a state of batch " +
                         std::to_string(s->B) + " and width " + std::to_string(d_.d));
    decode_layout(be);
    if (at_ != s->at) throw RuntimeError("linear mixer (cuda): step() with a state of another precision");
    B_ = N, T_ = 1;
    X_ = x;
    rin_ = Tensor();
    if (d_.route.kind == Route::cler && !route.in.empty()) {
      if (route.in.numel() != N * d_.Cv)
        throw RuntimeError("linear mixer (cuda): routing input " + route.in.shape_str() + " does not match [B," +
                           std::to_string(d_.Cv) + "]");
      rin_ = route.in;
    }
    wcat_ = fold_ ? Tensor(s->wcat, at_, {ldp_, d_.d}) : Tensor();
    ccq_on_ = d_.ccq.on && !(d_.ccq.disable_at_eval && !ctx.training);
    // the published side channel outlives the step's scratch (the model reads it after step())
    route.out = Tensor();
    Tensor vout, resid;
    if (d_.route.kind == Route::clvr) vout = ar.alloc(DType::f32, {N, d_.Cv});
    if (readout_routing()) resid = ar.alloc(DType::f32, {N, d_.Cv});
    const auto mark = ar.mark();
    o_ = bf_alloc(ar, N * d_.Cv);
    rstd_ = ar.alloc(DType::f32, {N * d_.H});
    saved_gates_alloc(ar, N);
    content_ = Uzero_ = Tensor();
    if (d_.carve.on && d_.carve.freeze_content)
      Uzero_ = ar.zeros(DType::f32, {(int64_t)d_.H * d_.carve.rank * std::max(d_.dk, d_.dv)});
    const Tensor Xa = as_act(be, ar, X_);
    P_qkv_ = ar.alloc(at_, {N, ldp_});
    be.gemm(Xa, false, wcat_.empty() ? Wqkv_ : wcat_, true, P_qkv_);
    {
      cl::LayerTimer tm("linear: conv+silu+l2 (decode)", st);
      qkv_step(ar, st, *s, fptr(vout));
      wide_key_l2(ar, st, N);
    }
    repeat_groups(ar, st, N);
    gate_inputs(be, ar, st, N, Xa, false);
    const bf16* qread = main_q();
    lam_ = flam_ = Tensor();
    if (ccq_on_) {
      lam_ = ar.alloc(DType::f32, {N, d_.H});
      if (d_.ccq.learned) flam_ = ar.alloc(DType::f32, {N, d_.H});
      ccq_lambda(be, ar, st, N);
      const Bf qc = bf_alloc(ar, N * d_.Cq);
      cl::CcqInputs in = ccq_inputs();
      in.K0 = s->K[s->kcur];
      in.m0 = s->m[s->kcur];
      in.t0 = s->pos;
      const cl::CcqStats out{s->K[s->kcur ^ 1], s->m[s->kcur ^ 1]};
      cl::LayerTimer tm("linear: ccq_fwd (decode)", st);
      if (d_.dk != 64)
        cl::wide_ccq_fwd(shape(), in, qc.p, out, st);
      else
        cl::ccq_fwd(shape(), in, qc.p, out, st);
      s->kcur ^= 1;
      qread = qc.p;
    }
    if (readout_routing()) {
      // cler/cler_h publish r_t = z_t − S_{t−1}(a_t ⊙ e_t): the state before this token's update,
      // read with the token's own qr by a delta-rule decode whose update is zero (β = 0, no
      // decay: S + 0·kᵀ leaves S as it is), then route_residual's z_t less o2/scale
      cl::LayerTimer tm("linear: routing readout (decode)", st);
      qr_ = bf_alloc(ar, N * d_.Cq);
      cl::RouteArgs ra = route_args();
      ra.beta = nullptr;  // the decode publishes r (cuda_linear_decode_unsupported refuses the β-scaled update)
      cl::route_query_decode(ra, qr_.p, st);
      const Bf o2 = bf_alloc(ar, N * d_.Cv);
      const Tensor no_update = ar.zeros(DType::f32, {N, d_.H});
      cl::grouped_delta_decode(readout_shape(), qr_.p, readout_k(), v_.p, nullptr, no_update.ptr<float>(), s->S, o2.p,
                               st);
      cl::route_residual(ra, o2.p, resid.ptr<float>(), st);  // T = 1: r = z
      const Tensor o2f = ar.alloc(DType::f32, {N, d_.Cv});
      be.convert(Tensor(o2.p, DType::bf16, {N, d_.Cv}), o2f);
      be.axpy(-std::sqrt((double)d_.dk), o2f, resid);  // 1/scale
      route.out = resid;
    }
    {
      cl::LayerTimer tm("linear: decode", st);
      kernel_decode(qread, *s, st);
    }
    if (d_.route.kind == Route::clvr) route.out = vout;
    output(be, ar, st, N, Xa, y);
    ++s->pos;
    ar.release(mark);
  }

 private:
  // output: y = (RMSNorm_h(o) ⊙ SiLU(x W_gᵀ)) W_oᵀ over N tokens (og kept when keep_og_, in P with wide_)
  void output(kernels::Backend& be, kernels::Arena& ar, cudaStream_t st, int64_t N, const Tensor& Xa, const Tensor& y) {
    if (!wide_) {
      if (!keep_og_) og_ = ar.alloc(at_, {N, d_.Cv});  // released at the end, recomputed in backward
      be.gemm(Xa, false, P_[s_.wgate], true, og_);
    }
    Tensor ypre = ar.alloc(at_, {N, d_.Cv});
    {
      cl::LayerTimer tm("linear: out norm+gate (fwd)", st);
      cl::out_gate_forward(N * d_.H, o_.p, og_ptr(), P_[s_.onorm].ptr<float>(), kNormEps, ypre.data, rstd_.ptr<float>(),
                           act_bf16(), st, d_.H, og_ld(), d_.dv);
    }
    be.gemm(ypre, false, P_[s_.wo], true, y.view({N, d_.d}));
  }

  // Decode's layout: an evaluation forward's (nothing kept for a backward; gdn's gates folded).
  void decode_layout(const kernels::Backend& be) {
    at_ = be.act_dtype();
    kernels_ = kernel_choice(be);
    keep_p_ = keep_og_ = wide_ = false;
    fold_ = !Wba_.empty();
    pw_ = fold_ ? (nqkv_ + 2 * d_.H + 7) / 8 * 8 : nqkv_;
    ldp_ = pw_;
  }

  // q_, k_, v_ of the token whose projections are in P_qkv_ [B, ldp]: the window of the last W
  // rows moves by one (the token's P last), and the forward's qkv pass runs over it as a
  // sequence of W tokens; its last token's outputs are the conv at this position (the rows
  // before the first token are zero, as the forward's padding). clvr's ṽ into vout [B, Cv].
  void qkv_step(kernels::Arena& ar, cudaStream_t st, CudaLinearState& s, float* vout) {
    const int64_t B = B_;
    const int W = s.window;
    q_ = bf_alloc(ar, B * d_.Cqk);
    k_ = bf_alloc(ar, B * d_.Cqk);
    v_ = bf_alloc(ar, B * d_.Cv);
    cl::QkvArgs a = qkv_args();
    if (a.rin && W > 1) {  // cler's ṽ = v + Γ r_in: r_in in the window's last row
      const Tensor rw = ar.zeros(DType::f32, {B * W * d_.Cv});
      const std::size_t w = (std::size_t)d_.Cv * sizeof(float);
      LAR_CUDA_CHECK(
          cudaMemcpy2DAsync(rw.ptr<float>() + (W - 1) * d_.Cv, w * W, a.rin, w, w, B, cudaMemcpyDeviceToDevice, st));
      a.rin = rw.ptr<float>();
    }
    if (W == 1) {  // no conv: this token alone
      cl::qkv_forward(a, q_.p, k_.p, v_.p, vout, st);
      return;
    }
    const std::size_t row = (std::size_t)ldp_ * elem_bytes(P_qkv_), pitch = row * W;
    char* next = static_cast<char*>(s.win[s.cur ^ 1]);
    const char* last = static_cast<const char*>(s.win[s.cur]);
    LAR_CUDA_CHECK(cudaMemcpy2DAsync(next, pitch, last + row, pitch, row * (W - 1), B, cudaMemcpyDeviceToDevice, st));
    LAR_CUDA_CHECK(
        cudaMemcpy2DAsync(next + row * (W - 1), pitch, P_qkv_.data, row, row, B, cudaMemcpyDeviceToDevice, st));
    s.cur ^= 1;
    a.T = W;
    a.P = next;
    const Bf qw = bf_alloc(ar, B * W * d_.Cqk), kw = bf_alloc(ar, B * W * d_.Cqk), vw = bf_alloc(ar, B * W * d_.Cv);
    const Tensor vo = vout ? ar.alloc(DType::f32, {B * W * d_.Cv}) : Tensor();
    cl::qkv_forward(a, qw.p, kw.p, vw.p, fptr(vo), st);
    // the window's last row of each sequence
    auto last_row = [&](const void* src, void* dst, std::size_t width) {
      LAR_CUDA_CHECK(cudaMemcpy2DAsync(dst, width, static_cast<const char*>(src) + width * (W - 1), width * W, width, B,
                                       cudaMemcpyDeviceToDevice, st));
    };
    last_row(qw.p, q_.p, (std::size_t)d_.Cqk * sizeof(bf16));
    last_row(kw.p, k_.p, (std::size_t)d_.Cqk * sizeof(bf16));
    last_row(vw.p, v_.p, (std::size_t)d_.Cv * sizeof(bf16));
    if (vout) last_row(vo.data, vout, (std::size_t)d_.Cv * sizeof(float));
  }

  // The per-token recurrence from the state, o_ [B, Cv] out (the same head mapping as kernel_fwd).
  void kernel_decode(const bf16* q, CudaLinearState& s, cudaStream_t st) {
    const bool pv = per_value_q();
    const cl::GroupedShape gs = pv ? readout_shape() : gshape();
    const bf16* k = pv ? readout_k() : k_.p;
    if (d_.carve.on)
      cl::carve_decode(shape(), carve_inputs(q), static_cast<int>(s.pos % cl::kChunk), s.S, s.content, o_.p, st);
    else if (delta_kernel())
      cl::grouped_delta_decode(gs, q, k, v_.p, fptr(g_), fptr(beta_), s.S, o_.p, st);
    else
      cl::grouped_channel_decode(channel_kind(), gs, channel_inputs(q, k), s.S, o_.p, st);
  }

  // Kernel-side gradients of one backward call.
  struct Grads {
    Bf dq, dk, dv, db, dw;
    Tensor dg, dbeta;
    Bf dbx;                  // CARVE: on the erase logits [N, Cq]
    Tensor dws, dU1, dU2;    // CARVE: on the scalar write gate [N, H]; this call's dU1, dU2
  };

  cl::DeltaShape shape() const {
    cl::DeltaShape s;
    s.B = B_;
    s.T = T_;
    s.H = d_.H;
    s.dk = d_.dk;
    s.dv = d_.dv;
    s.scale = 1.0 / std::sqrt((double)d_.dk);
    s.kernels = kernels_;
    return s;
  }
  // The delta and channel kernels' shape: value heads of dv = 64·m channels run as m heads of
  // 64 sharing q, k and the gates, and value head j reads key head j / (H / Hk)
  // (kernels/linear/grouped_heads.hpp).
  cl::GroupedShape gshape() const {
    cl::GroupedShape s;
    s.B = B_;
    s.T = T_;
    s.H = d_.H;
    s.Hk = d_.Hk;
    s.dk = d_.dk;
    s.dv = d_.dv;
    s.scale = 1.0 / std::sqrt((double)d_.dk);
    s.kernels = kernels_;
    return s;
  }
  // Grouped value heads whose query differs between the value heads of a group run one key head
  // per value head over q, k repeated per group (qx_, kr_; inputs() makes them) and sum the
  // group's dq, dk back: CCQ (q_c by the value head's λ) and CARVE (its kernel takes one key
  // head per value head) in the main pass, and the cler/cler_h readout (its shifted query
  // a_t ⊙ e_t carries the value head's gates). Without grouping these are q_, k_ and gshape().
  bool grouped() const { return d_.Hk != d_.H; }
  bool per_value_q() const { return grouped() && (ccq_on_ || d_.carve.on); }
  // CARVE at key or value heads of 128: the recurrent kernels of wide_key.hpp (wide_carve_fwd/bwd).
  bool wide_carve() const { return d_.carve.on && (d_.dk != 64 || d_.dv != 64); }
  bool readout_routing() const { return d_.route.kind == Route::cler || d_.route.kind == Route::cler_h; }
  cl::GroupedShape readout_shape() const {
    cl::GroupedShape s = gshape();
    s.Hk = d_.H;
    return s;
  }
  const bf16* readout_k() const { return kr_.p ? kr_.p : k_.p; }
  const bf16* main_q() const { return qx_.p ? qx_.p : q_.p; }
  bf16* bound_bf() const { return static_cast<bf16*>(bound_.data); }
  const char* kernel_name(bool bwd) const {
    if (d_.carve.on) return bwd ? "linear: carve_bwd" : "linear: carve_fwd";
    if (delta_kernel()) return bwd ? "linear: delta_bwd" : "linear: delta_fwd";
    return bwd ? "linear: channel_bwd" : "linear: channel_fwd";
  }
  // CARVE's kernel inputs from sequence b on ([B,T,H,dk] / [B,T,H,dv] tensors, w [B,T,H]).
  // (Only the 64-wide path passes b > 0: there dk = dv = 64.)
  cl::CarveInputs carve_inputs(const bf16* q, int64_t b = 0) const {
    const int64_t tok = b * T_ * d_.Cq, gate = b * T_ * d_.H;
    cl::CarveInputs in;
    in.q = q + tok;
    in.k = readout_k() + tok;
    in.v = v_.p + tok;
    in.g = g_.ptr<float>() + tok;
    in.bx = bx_.p + tok;
    in.w = ws_.ptr<float>() + gate;
    in.U1 = d_.carve.freeze_content ? Uzero_.ptr<float>() : P_[s_.U1].ptr<float>();
    in.U2 = d_.carve.freeze_content ? Uzero_.ptr<float>() : P_[s_.U2].ptr<float>();
    in.rank = d_.carve.rank;
    in.content_grad = d_.carve.content_grad;
    return in;
  }
  cl::CcqInputs ccq_inputs() const {
    cl::CcqInputs in;
    in.q = main_q();
    in.k = readout_k();
    in.lambda = lam_.ptr<float>();
    in.centered = d_.ccq.centered;
    return in;
  }
  bool delta_kernel() const { return md_.family == MixerDesc::Family::delta_rule; }
  // The channel rule's update: gdn2's gated erase and write, kda's β, or none (gla, and
  // linear with g = 0).
  cl::ChannelMixer channel_kind() const {
    if (md_.gated()) return cl::ChannelMixer::gdn2;
    if (md_.beta()) return cl::ChannelMixer::kda;
    return cl::ChannelMixer::gla;
  }
  cl::ChannelInputs channel_inputs(const bf16* q, const bf16* k) const {
    cl::ChannelInputs in;
    in.q = q;
    in.k = k;
    in.v = v_.p;
    in.g = fptr(g_);
    in.beta = fptr(beta_);
    in.b = b_.p;
    in.w = w_.p;
    return in;
  }

  // readout: the cler/cler_h readout pass. It and the main pass with per_value_q() read a
  // query per value head, over readout_k().
  void kernel_fwd(const bf16* q, bf16* o, bf16* bound, cudaStream_t st, bool readout = false) {
    const bool pv = readout || per_value_q();
    const cl::GroupedShape gs = pv ? readout_shape() : gshape();
    const bf16* k = pv ? readout_k() : k_.p;
    if (wide_carve())
      cl::wide_carve_fwd(shape(), carve_inputs(q), o, nullptr, bound, content_.ptr<float>(), st);
    else if (d_.carve.on)
      cl::carve_fwd(shape(), carve_inputs(q), o, nullptr, bound, content_.ptr<float>(), st);
    else if (delta_kernel())
      cl::grouped_delta_fwd(gs, q, k, v_.p, fptr(g_), fptr(beta_), nullptr, o, nullptr, bound, st);
    else
      cl::grouped_channel_fwd(channel_kind(), gs, channel_inputs(q, k), o, nullptr, bound, st);
  }

  // per_value: dq, dk per value head (the readout pass, the main pass with per_value_q()).
  Grads grads_alloc(kernels::Arena& ar, int64_t N, bool per_value = false) {
    Grads g;
    const int64_t nk = N * (per_value ? d_.Cq : d_.Cqk);
    g.dq = bf_alloc(ar, nk);
    g.dk = bf_alloc(ar, nk);
    g.dv = bf_alloc(ar, N * d_.Cv);
    if (!g_.empty()) g.dg = ar.alloc(DType::f32, g_.shape());
    if (!beta_.empty()) g.dbeta = ar.alloc(DType::f32, beta_.shape());
    if (d_.carve.on) {
      // U1 [H, r, dv] and U2 [H, dk, r]: one copy, or one per sequence when deterministic with
      // the 64-wide kernel (the wide one sums the batch in a fixed order itself)
      const int64_t nb = det_ && !wide_carve() ? B_ : 1;
      g.dbx = bf_alloc(ar, N * d_.Cq);
      g.dws = ar.alloc(DType::f32, {N, d_.H});
      g.dU1 = ar.alloc(DType::f32, {(int64_t)d_.H * d_.carve.rank * d_.dv * nb});
      g.dU2 = ar.alloc(DType::f32, {(int64_t)d_.H * d_.carve.rank * d_.dk * nb});
    } else if (md_.gated()) {
      g.db = bf_alloc(ar, N * d_.Cq);
      g.dw = bf_alloc(ar, N * d_.Cv);
    }
    return g;
  }

  void kernel_bwd(const bf16* q, const bf16* dO, Grads& g, cudaStream_t st, bool readout = false) {
    const bool pv = readout || per_value_q();
    const cl::GroupedShape gs = pv ? readout_shape() : gshape();
    const bf16* k = pv ? readout_k() : k_.p;
    if (wide_carve()) {
      cl::CarveGrads cg;
      cg.dq = g.dq.p;
      cg.dk = g.dk.p;
      cg.dv = g.dv.p;
      cg.dbx = g.dbx.p;
      cg.dg = g.dg.ptr<float>();
      cg.dw = g.dws.ptr<float>();
      cg.dU1 = g.dU1.ptr<float>();
      cg.dU2 = g.dU2.ptr<float>();
      cl::wide_carve_bwd(shape(), carve_inputs(q), bound_.data, content_.ptr<float>(), dO, nullptr, cg, st);
    } else if (d_.carve.on) {
      // carve_bwd sums dU1, dU2 over the batch with atomics (order-dependent in the last
      // bit). A deterministic backend runs it per sequence instead, into per-sequence
      // slices that gates_backward adds in sequence order (B launches of H CTAs: slower).
      const int64_t nb = det_ ? B_ : 1, tok = T_ * d_.Cq, nc = cl::delta_num_chunks(shape());
      cl::DeltaShape s = shape();
      s.B = B_ / nb;
      const int64_t nu = (int64_t)d_.H * d_.carve.rank * d_.dk;
      for (int64_t b = 0; b < nb; ++b) {
        cl::CarveGrads cg;
        cg.dq = g.dq.p + b * tok;
        cg.dk = g.dk.p + b * tok;
        cg.dv = g.dv.p + b * tok;
        cg.dbx = g.dbx.p + b * tok;
        cg.dg = g.dg.ptr<float>() + b * tok;
        cg.dw = g.dws.ptr<float>() + b * T_ * d_.H;
        cg.dU1 = g.dU1.ptr<float>() + b * nu;
        cg.dU2 = g.dU2.ptr<float>() + b * nu;
        // boundary [B,H,nc,64,64] bf16 and content [B,H,nc,64] fp32 are sequence-major
        cl::carve_bwd(s, carve_inputs(q, b), bound_bf() + b * d_.H * nc * d_.dk * d_.dv,
                      content_.ptr<float>() + b * d_.H * nc * d_.dv, dO + b * tok, nullptr, cg, st);
      }
    } else if (delta_kernel()) {
      cl::grouped_delta_bwd(gs, q, k, v_.p, fptr(g_), fptr(beta_), bound_bf(), dO, nullptr, g.dq.p, g.dk.p, g.dv.p,
                            fptr(g.dg), fptr(g.dbeta), nullptr, st);
    } else {
      cl::ChannelGrads cg;
      cg.dq = g.dq.p;
      cg.dk = g.dk.p;
      cg.dv = g.dv.p;
      cg.dg = fptr(g.dg);
      cg.dbeta = fptr(g.dbeta);
      cg.db = g.db.p;
      cg.dw = g.dw.p;
      cl::grouped_channel_bwd(channel_kind(), gs, channel_inputs(q, k), bound_bf(), dO, nullptr, cg, st);
    }
  }

  cl::QkvArgs qkv_args() const {
    cl::QkvArgs a;
    a.B = B_;
    a.T = T_;
    a.Cq = d_.Cqk;
    a.Cv = d_.Cv;
    a.W = d_.conv ? d_.W : 0;
    a.l2 = d_.l2 && !wide_l2();
    a.P = P_qkv_.data;
    a.p_bf16 = P_qkv_.dtype == DType::bf16;
    a.ldp = ldp_;
    if (d_.conv) {
      a.wq = P_[s_.cq].ptr<float>();
      a.wk = P_[s_.ck].ptr<float>();
      a.wv = P_[s_.cv].ptr<float>();
    }
    if (!rin_.empty()) {
      a.rin = rin_.ptr<float>();
      a.gamma = P_[s_.gamma].ptr<float>();
    }
    return a;
  }

  cl::RouteArgs route_args() const {
    cl::RouteArgs a;
    a.B = B_;
    a.T = T_;
    a.H = d_.H;
    a.k = readout_k();
    a.v = v_.p;
    a.g = fptr(g_);
    a.g_channel = md_.decay != Decay::head;
    a.b = b_.p;
    a.w = w_.p;
    a.scale = static_cast<float>(1.0 / std::sqrt((double)d_.dk));
    a.dv = d_.dv;
    if (d_.route.update) a.beta = fptr(beta_);  // publish u = β·r (model.routing_signal: update)
    return a;
  }

  bool act_bf16() const { return at_ == DType::bf16; }
  // Key heads wider than 64 (wide_key.hpp): q, k are L2-normalised by a pass of their own.
  bool wide_l2() const { return d_.l2 && d_.dk != 64; }
  // wcat_'s rows as pieces of the parameter (src) and gradient (dst) buffers: [Wq;Wk;Wv],
  // (fold_: [W_β;W_a] and zero padding rows), (wide_: W_g).
  cl::Pieces wcat_pieces() const {
    cl::Pieces p;
    auto add = [&](const Tensor& w, const Tensor& g, int64_t rows) {
      p.src[p.count] = w.empty() ? nullptr : w.ptr<float>();
      p.dst[p.count] = g.empty() ? nullptr : g.ptr<float>();
      p.n[p.count] = rows * d_.d;
      ++p.count;
    };
    add(Wqkv_, Gqkv_, nqkv_);
    if (fold_) {
      add(Wba_, Gba_, 2 * d_.H);
      if (pw_ > nqkv_ + 2 * d_.H) add(Tensor(), Tensor(), pw_ - nqkv_ - 2 * d_.H);  // padding: zeros, dropped
    }
    if (wide_) add(P_[s_.wgate], G_[s_.wgate], d_.Cv);
    return p;
  }
  static std::size_t elem_bytes(const Tensor& t) { return t.bytes() / t.numel(); }
  // og: its own [N, Cv] tensor, or (wide_) P_qkv_'s columns [pw_, pw_ + Cv), row stride ldp_
  const void* og_ptr() const {
    return wide_ ? static_cast<const char*>(P_qkv_.data) + pw_ * elem_bytes(P_qkv_) : og_.data;
  }
  int64_t og_ld() const { return wide_ ? ldp_ : 0; }

  // t in act_dtype(): t itself, or a converted copy in the arena.
  Tensor as_act(kernels::Backend& be, kernels::Arena& ar, const Tensor& t) const { return cl::as_dtype(be, ar, t, at_); }

  // The small gate tensors kept from forward to backward: gdn's a-gate pre-activation and
  // log-decay [N, H], β's [N, H], the low-rank gates' hidden x W₁ᵀ [N, rank].
  void saved_gates_alloc(kernels::Arena& ar, int64_t N) {
    g_ = beta_ = fg_ = h1_ = fbeta_ = fb_ = fw_ = fws_ = ws_ = Tensor();
    b_ = w_ = bx_ = Bf();
    if (d_.carve.on) {  // the scalar write gate per head: pre-activation and σ
      fws_ = ar.alloc(DType::f32, {N, d_.H});
      ws_ = ar.alloc(DType::f32, {N, d_.H});
    }
    if (fold_) {
      // gdn's folded gates: fβ and fa are columns of P (gdn_gate_args); β and g kept below
    } else if (!Wba_.empty()) {
      // gdn's fused [W_β; W_a] projection: fbeta_ and fg_ are the two column blocks of one
      // [N, 2H] buffer (row stride pre_ld(), which gate_args passes on)
      Tensor f = ar.alloc(DType::f32, {N, 2 * d_.H});
      fbeta_ = Tensor(f.data, DType::f32, {N, d_.H});
      fg_ = Tensor(f.ptr<float>() + d_.H, DType::f32, {N, d_.H});
    } else if (md_.decay == Decay::head) {
      fg_ = ar.alloc(DType::f32, {N, d_.H});
    }
    if (md_.decay == Decay::head) g_ = ar.alloc(DType::f32, {N, d_.H});
    if (md_.low_rank_gate()) h1_ = ar.alloc(at_, {N, d_.rank});
    if (md_.beta()) {
      if (fbeta_.empty() && !fold_) fbeta_ = ar.alloc(DType::f32, {N, d_.H});
      beta_ = ar.alloc(DType::f32, {N, d_.H});
    }
  }
  // Row stride of gdn's fg_ and of fbeta_ (2H when they share the fused buffer).
  int64_t pre_ld() const { return Wba_.empty() ? d_.H : 2 * d_.H; }
  Tensor pre_ba() const { return Tensor(fbeta_.data, DType::f32, {fbeta_.size(0), 2 * d_.H}); }

  // The kernels' inputs from x (Xa: x in act_dtype): P = x [Wq;Wk;Wv]ᵀ, then q, k, v (one
  // fused pass; clvr's published ṽ into vout), and the gates. In the forward (again =
  // false) the small gates are computed into their kept buffers; in the backward (again)
  // they are reused and only the released ones are recomputed: P, q, k, v, the channel
  // mixers' [N, Cq] pre-activations and log-gates, gdn2's b and w — the same GEMMs and
  // maps on the same inputs, so the same values as in the forward.
  void inputs(kernels::Backend& be, kernels::Arena& ar, cudaStream_t st, int64_t N, const Tensor& Xa, bool again,
              float* vout) {
    if (!again || !keep_p_) {  // P: into its kept buffer (allocated by forward), or here
      if (!keep_p_) P_qkv_ = ar.alloc(at_, {N, ldp_});
      be.gemm(Xa, false, wcat_.empty() ? Wqkv_ : wcat_, true, P_qkv_);
    }
    q_ = bf_alloc(ar, N * d_.Cqk);
    k_ = bf_alloc(ar, N * d_.Cqk);
    v_ = bf_alloc(ar, N * d_.Cv);
    {
      cl::LayerTimer tm(again ? "linear: conv+silu+l2 (recompute)" : "linear: conv+silu+l2 (fwd)", st);
      cl::qkv_forward(qkv_args(), q_.p, k_.p, v_.p, vout, st);
      wide_key_l2(ar, st, N);
    }
    repeat_groups(ar, st, N);
    gate_inputs(be, ar, st, N, Xa, again);
  }

  // Key heads wider than 64: the fused qkv pass normalises heads of 64 only, so q_, k_ get
  // their L2 norm from a pass of their own (1/‖·‖ kept in rq_, rk_ for the backward).
  void wide_key_l2(kernels::Arena& ar, cudaStream_t st, int64_t N) {
    if (!wide_l2()) return;
    rq_ = ar.alloc(DType::f32, {N * d_.Hk});
    rk_ = ar.alloc(DType::f32, {N * d_.Hk});
    cl::l2_rows_forward(N * d_.Hk, d_.dk, q_.p, rq_.ptr<float>(), st);
    cl::l2_rows_forward(N * d_.Hk, d_.dk, k_.p, rk_.ptr<float>(), st);
  }

  // Grouped value heads: q, k repeated per group where the kernels read a key head per value
  // head (readout_k, main_q).
  void repeat_groups(kernels::Arena& ar, cudaStream_t st, int64_t N) {
    kr_ = qx_ = Bf{};
    if (grouped() && (readout_routing() || per_value_q())) {
      kr_ = bf_alloc(ar, N * d_.Cq);  // readout_k
      cl::repeat_heads(k_.p, kr_.p, N, d_.Hk, d_.H / d_.Hk, d_.dk, st);
    }
    if (per_value_q()) {
      qx_ = bf_alloc(ar, N * d_.Cq);  // main_q
      cl::repeat_heads(q_.p, qx_.p, N, d_.Hk, d_.H / d_.Hk, d_.dk, st);
    }
  }

  // The gates of N tokens from x (Xa) and, for gdn's folded gates, from P_qkv_ (again: see inputs()).
  void gate_inputs(kernels::Backend& be, kernels::Arena& ar, cudaStream_t st, int64_t N, const Tensor& Xa, bool again) {
    if (md_.decay == Decay::head && fold_) {
      if (!again) {
        cl::LayerTimer tm("linear: gate maps (fwd)", st);
        cl::gdn_gates_forward(gdn_gate_args(), beta_.ptr<float>(), g_.ptr<float>(), st);
      }
    } else if (md_.decay == Decay::head) {
      if (!again) {
        if (Wba_.empty()) be.gemm(Xa, false, P_[s_.wa], true, fg_);
        else be.gemm(Xa, false, Wba_, true, pre_ba());  // β's pre-activation too
        gate_fwd(gate_args(cl::GateMap::decay, fg_, s_.dt_bias, 1, pre_ld()), g_.ptr<float>(), nullptr, st);
      }
    } else if (md_.low_rank_gate()) {
      if (!again) be.gemm(Xa, false, P_[s_.g1], true, h1_);
      fg_ = ar.alloc(DType::f32, {N, d_.Cq});
      be.gemm(h1_, false, P_[s_.g2], true, fg_);
      g_ = ar.alloc(DType::f32, {N, d_.Cq});
      if (md_.decay == Decay::logsig)
        gate_fwd(gate_args(cl::GateMap::logsig16, fg_, s_.gb, 1), g_.ptr<float>(), nullptr, st);
      else
        gate_fwd(gate_args(cl::GateMap::decay, fg_, s_.dt_bias, d_.dk), g_.ptr<float>(), nullptr, st);
    } else if (md_.family == MixerDesc::Family::channel_rule) {
      // the channel kernel as gla with a zero log-gate: S_t = S_{t−1} + v_t k_tᵀ
      g_ = ar.zeros(DType::f32, {N, d_.Cq});
    }
    if (md_.beta() && !again && !fold_) {
      if (Wba_.empty()) be.gemm(Xa, false, P_[s_.wbeta], true, fbeta_);
      gate_fwd(gate_args(cl::GateMap::sigmoid, fbeta_, -1, 1, pre_ld()), beta_.ptr<float>(), nullptr, st);
    }
    if (d_.carve.on) {
      // raw erase logits x W_bᵀ in bf16 (the kernel adds the content term and applies σ)
      bx_ = bf_alloc(ar, N * d_.Cq);
      const Tensor bx(bx_.p, DType::bf16, {N, d_.Cq});
      if (at_ == DType::bf16) {
        be.gemm(Xa, false, P_[s_.werase], true, bx);
      } else {
        Tensor f = ar.alloc(DType::f32, {N, d_.Cq});
        be.gemm(Xa, false, P_[s_.werase], true, f);
        be.convert(f, bx);
      }
      if (!again) {
        be.gemm(Xa, false, P_[s_.wwrite], true, fws_);
        gate_fwd(gate_args(cl::GateMap::sigmoid, fws_, -1, 1), ws_.ptr<float>(), nullptr, st);
      }
    } else if (md_.gated()) {
      fb_ = ar.alloc(DType::f32, {N, d_.Cq});
      fw_ = ar.alloc(DType::f32, {N, d_.Cv});
      be.gemm(Xa, false, P_[s_.werase], true, fb_);
      be.gemm(Xa, false, P_[s_.wwrite], true, fw_);
      b_ = bf_alloc(ar, N * d_.Cq);
      w_ = bf_alloc(ar, N * d_.Cv);
      gate_fwd(gate_args(cl::GateMap::sigmoid, fb_, -1, 1), nullptr, b_.p, st);
      gate_fwd(gate_args(cl::GateMap::sigmoid, fw_, -1, 1), nullptr, w_.p, st);
    }
  }

  void gate_fwd(const cl::GateArgs& a, float* out, bf16* outb, cudaStream_t st) const {
    cl::LayerTimer tm("linear: gate maps (fwd)", st);
    cl::gate_forward(a, out, outb, st);
  }
  void gate_bwd(const cl::GateArgs& a, const float* dyf, const bf16* dyb, const float* extra, float* df, int64_t ldd,
                float* aterm, cudaStream_t st) const {
    cl::LayerTimer tm("linear: gate maps (bwd)", st);
    cl::gate_backward(a, dyf, dyb, extra, df, ldd, aterm, st);
  }

  // ldf: f's row stride (0: its width).
  cl::GateArgs gate_args(cl::GateMap map, const Tensor& f, int bias_slot, int per_head, int64_t ldf = 0) const {
    cl::GateArgs a;
    a.map = map;
    a.N = f.size(0);
    a.C = static_cast<int>(f.size(1));
    a.f = f.ptr<float>();
    a.ldf = ldf > 0 ? ldf : f.size(1);
    if (bias_slot >= 0) a.bias = P_[bias_slot].ptr<float>();
    if (map == cl::GateMap::decay) a.A_log = P_[s_.A_log].ptr<float>();
    a.per_head = per_head;
    return a;
  }

  // f = x Wᵀ (W [C, d]; Xa = x in act_dtype): dW += dfᵀ x, dx += df W.
  void proj_bwd(kernels::Backend& be, const Tensor& df, int slot, const Tensor& Xa, const Tensor& dX) {
    be.gemm(df, true, Xa, false, G_[slot], 1.0, 1.0);
    be.gemm(df, false, P_[slot], false, dX, 1.0, 1.0);
  }

  // gdn's folded gates: fβ, fa in P's columns [2Cqk+Cv, 2Cqk+Cv+2H).
  cl::GdnGateArgs gdn_gate_args() const {
    cl::GdnGateArgs a;
    a.N = P_qkv_.size(0);
    a.H = d_.H;
    a.P = P_qkv_.data;
    a.p_bf16 = P_qkv_.dtype == DType::bf16;
    a.ldp = ldp_;
    a.off = nqkv_;
    a.width = pw_;
    a.A_log = P_[s_.A_log].ptr<float>();
    a.dt_bias = P_[s_.dt_bias].ptr<float>();
    return a;
  }

  // dP: ∂L/∂P, where gdn's folded gates put ∂L/∂(fβ, fa) (their weights' gradients and dx
  // then come from the q·k·v GEMMs).
  void gates_backward(kernels::Backend& be, kernels::Arena& ar, cudaStream_t st, int64_t N, const Grads& g,
                      const Tensor& eb, const Tensor& ew, const Tensor& Xa, const Tensor& dX, const Tensor& dP) {
    auto colsum = [&](const Tensor& M, int group, int slot, int64_t ld = 0) {
      Tensor scratch = ar.alloc(DType::f32, {(int64_t)cl::colsum_scratch_floats(M.size(0), (int)M.size(1))});
      cl::LayerTimer tm("linear: gate maps (bwd)", st);
      cl::colsum_accumulate(M.ptr<float>(), M.size(0), (int)M.size(1), ld > 0 ? ld : M.size(1), group,
                            G_[slot].ptr<float>(), scratch.ptr<float>(), st);
    };
    if (fold_) {
      Tensor scratch = ar.alloc(DType::f32, {(int64_t)cl::gdn_gates_backward_scratch_floats(N, d_.H)});
      cl::LayerTimer tm("linear: gate maps (bwd)", st);
      cl::gdn_gates_backward(gdn_gate_args(), g.dbeta.ptr<float>(), g.dg.ptr<float>(), dP.data,
                             G_[s_.dt_bias].ptr<float>(), G_[s_.A_log].ptr<float>(), scratch.ptr<float>(), st);
      return;
    }
    if (!Wba_.empty()) {
      // gdn, fused [W_β; W_a]: both gates' ∂L/∂f into one [N, 2H] for one projection backward
      const int64_t H = d_.H;
      Tensor dF = ar.alloc(DType::f32, {N, 2 * H});
      Tensor aterm = ar.alloc(DType::f32, {N, H});
      gate_bwd(gate_args(cl::GateMap::sigmoid, fbeta_, -1, 1, 2 * H), g.dbeta.ptr<float>(), nullptr, nullptr,
               dF.ptr<float>(), 2 * H, nullptr, st);
      gate_bwd(gate_args(cl::GateMap::decay, fg_, s_.dt_bias, 1, 2 * H), g.dg.ptr<float>(), nullptr, nullptr,
               dF.ptr<float>() + H, 2 * H, aterm.ptr<float>(), st);
      colsum(Tensor(dF.ptr<float>() + H, DType::f32, {N, H}), 1, s_.dt_bias, 2 * H);
      colsum(aterm, 1, s_.A_log);
      be.gemm(dF, true, Xa, false, Gba_, 1.0, 1.0);
      be.gemm(dF, false, Wba_, false, dX, 1.0, 1.0);
      return;
    }
    if (!fg_.empty() && md_.decay != Decay::head) {
      // the channel gates (gla, kda, gdn2; f = (x W₁ᵀ) W₂ᵀ): df in act_dtype() and the bias /
      // A_log sums in one pass
      const bool decay = md_.decay != Decay::logsig;
      const cl::GateArgs ga = decay ? gate_args(cl::GateMap::decay, fg_, s_.dt_bias, d_.dk)
                                    : gate_args(cl::GateMap::logsig16, fg_, s_.gb, 1);
      Tensor df = ar.alloc(at_, fg_.shape());
      {
        Tensor scratch = ar.alloc(DType::f32, {(int64_t)cl::gate_backward_fused_scratch_floats(ga)});
        cl::LayerTimer tm("linear: gate maps (bwd)", st);
        cl::gate_backward_fused(ga, g.dg.ptr<float>(), df.data, act_bf16(), G_[decay ? s_.dt_bias : s_.gb].ptr<float>(),
                                decay ? G_[s_.A_log].ptr<float>() : nullptr, scratch.ptr<float>(), st);
      }
      be.gemm(df, true, h1_, false, G_[s_.g2], 1.0, 1.0);
      Tensor dh1 = ar.alloc(DType::f32, {N, d_.rank});
      be.gemm(df, false, P_[s_.g2], false, dh1);
      proj_bwd(be, dh1, s_.g1, Xa, dX);
    } else if (!fg_.empty()) {  // gdn without the fused [W_β; W_a]: f = x W_aᵀ [N, H]
      Tensor df = ar.alloc(DType::f32, fg_.shape());
      Tensor aterm = ar.alloc(DType::f32, fg_.shape());
      gate_bwd(gate_args(cl::GateMap::decay, fg_, s_.dt_bias, 1), g.dg.ptr<float>(), nullptr, nullptr, df.ptr<float>(),
               df.size(1), aterm.ptr<float>(), st);
      colsum(df, 1, s_.dt_bias);
      colsum(aterm, 1, s_.A_log);
      proj_bwd(be, df, s_.wa, Xa, dX);
    }
    if (!fbeta_.empty()) {
      Tensor df = ar.alloc(DType::f32, {N, d_.H});
      gate_bwd(gate_args(cl::GateMap::sigmoid, fbeta_, -1, 1), g.dbeta.ptr<float>(), nullptr, nullptr,
                        df.ptr<float>(), d_.H, nullptr, st);
      proj_bwd(be, df, s_.wbeta, Xa, dX);
    }
    if (!fb_.empty()) {
      Tensor dfb = ar.alloc(DType::f32, {N, d_.Cq});
      Tensor dfw = ar.alloc(DType::f32, {N, d_.Cv});
      gate_bwd(gate_args(cl::GateMap::sigmoid, fb_, -1, 1), nullptr, g.db.p, fptr(eb), dfb.ptr<float>(),
                        d_.Cq, nullptr, st);
      gate_bwd(gate_args(cl::GateMap::sigmoid, fw_, -1, 1), nullptr, g.dw.p, fptr(ew), dfw.ptr<float>(),
                        d_.Cv, nullptr, st);
      proj_bwd(be, dfb, s_.werase, Xa, dX);
      proj_bwd(be, dfw, s_.wwrite, Xa, dX);
    }
    if (d_.carve.on) {
      // U1, U2: carve_bwd summed this call's batch in a fixed order; add to the gradients
      if (!d_.carve.freeze_content) {
        const int64_t nu1 = G_[s_.U1].numel(), nu2 = G_[s_.U2].numel();
        for (int64_t b = 0; b * nu1 < g.dU1.numel(); ++b) {  // one slice, or one per sequence in order
          be.axpy(1.0, Tensor(g.dU1.ptr<float>() + b * nu1, DType::f32, {nu1}), G_[s_.U1]);
          be.axpy(1.0, Tensor(g.dU2.ptr<float>() + b * nu2, DType::f32, {nu2}), G_[s_.U2]);
        }
      }
      proj_bwd(be, as_act(be, ar, Tensor(g.dbx.p, DType::bf16, {N, d_.Cq})), s_.werase, Xa, dX);
      Tensor dfw = ar.alloc(DType::f32, {N, d_.H});
      gate_bwd(gate_args(cl::GateMap::sigmoid, fws_, -1, 1), g.dws.ptr<float>(), nullptr, nullptr, dfw.ptr<float>(),
               d_.H, nullptr, st);
      proj_bwd(be, dfw, s_.wwrite, Xa, dX);
    }
  }

  // out[j] += Σ_n Σ_{c in group j} M[n, c] into the gradient of slot (deterministic).
  void colsum_param(kernels::Arena& ar, cudaStream_t st, const Tensor& M, int group, int slot) const {
    cl::colsum_into(ar, st, M, group, G_[slot].ptr<float>(), "linear: gate maps (bwd)");
  }

  // p_q = P's first Cqk columns (row stride ldp) as a contiguous [N, Cqk] in act_dtype().
  Tensor q_projection(kernels::Arena& ar, cudaStream_t st, int64_t N) const {
    Tensor pq = ar.alloc(at_, {N, d_.Cqk});
    const std::size_t es = P_qkv_.bytes() / P_qkv_.numel();
    LAR_CUDA_CHECK(cudaMemcpy2DAsync(pq.data, d_.Cqk * es, P_qkv_.data, ldp_ * es, d_.Cqk * es, N,
                                     cudaMemcpyDeviceToDevice, st));
    return pq;
  }

  // CCQ's λ [N, H] into lam_: σ(p_q W_λᵀ + b_λ) (pre-activation kept in flam_), or fixed.
  void ccq_lambda(kernels::Backend& be, kernels::Arena& ar, cudaStream_t st, int64_t N) {
    if (!d_.ccq.learned) {
      be.fill(lam_, d_.ccq.lambda);
      return;
    }
    be.gemm(q_projection(ar, st, N), false, P_[s_.wlam], true, flam_);
    gate_fwd(gate_args(cl::GateMap::sigmoid, flam_, s_.blam, 1), lam_.ptr<float>(), nullptr, st);
  }

  // λ's projection backward (dflam = ∂L/∂(p_q W_λᵀ)): W_λ's gradient from p_q (P as
  // recomputed in this backward), and dP[:, :Cqk] += dflam W_λ through a contiguous copy of
  // that column block (dP is overwritten by qkv_backward, so this runs after it).
  void ccq_lambda_backward(kernels::Backend& be, kernels::Arena& ar, cudaStream_t st, int64_t N, const Tensor& dflam,
                           const Tensor& dP) {
    be.gemm(dflam, true, q_projection(ar, st, N), false, G_[s_.wlam], 1.0, 1.0);
    Tensor dpq = ar.alloc(dP.dtype, {N, d_.Cqk});
    const std::size_t es = dP.bytes() / dP.numel();
    LAR_CUDA_CHECK(cudaMemcpy2DAsync(dpq.data, d_.Cqk * es, dP.data, ldp_ * es, d_.Cqk * es, N,
                                     cudaMemcpyDeviceToDevice, st));
    be.gemm(dflam, false, P_[s_.wlam], false, dpq, 1.0, 1.0);
    LAR_CUDA_CHECK(cudaMemcpy2DAsync(dP.data, ldp_ * es, dpq.data, d_.Cqk * es, d_.Cqk * es, N,
                                     cudaMemcpyDeviceToDevice, st));
  }
  Dims d_;
  MixerDesc md_ = d_.desc();
  Slots s_;
  std::vector<Tensor> P_, G_;
  int64_t nqkv_ = 0;  // 2Cqk + Cv: P's q, k, v columns
  int64_t pw_ = 0;    // P's columns before og: nqkv_, or with gdn's folded gates and padding
  int64_t ldp_ = 0;   // P's row stride: pw_, or pw_ + Cv with og beside it (wide_)
  Tensor Wqkv_, Gqkv_;
  Tensor Wba_, Gba_;  // gdn: [W_β; W_a] and its gradient (empty when not adjacent)
  // this step's cache (arena tensors, valid until the next forward)
  int64_t B_ = 0, T_ = 0;
  DType at_ = DType::f32;  // the backend's act_dtype()
  Tensor X_, P_qkv_, rin_, bound_, og_, rstd_;
  Tensor g_, beta_, fg_, h1_, fbeta_, fb_, fw_;
  Bf q_, k_, v_, o_, b_, w_, qr_;
  Tensor r_raw_;  // routing_signal: update (training): the unscaled write residual r [N, Cv] for ∂L/∂β
  Bf qx_, kr_;  // grouped value heads: q, k repeated per group [N, Cq] (per_value_q, readout_k)
  Tensor rq_, rk_;  // wide key heads (wide_l2): 1 / ‖q‖, 1 / ‖k‖ per (token, head) of the last qkv pass
  // CCQ: whether this forward applied it, λ [N, H] and its pre-activation (learned)
  bool ccq_on_ = false;
  bool keep_p_ = true;   // this step keeps P, see keeps_p
  bool keep_og_ = true;  // this step keeps og, see keeps_og
  bool fold_ = false;    // gdn's gates come out of the q·k·v GEMM (always, for gdn)
  bool wide_ = false;    // og comes out of the q·k·v GEMM too (P and og both kept)
  cl::KernelChoice kernels_;  // the chunk and CCQ kernels (kernel_choice)
  Tensor wcat_;          // fold_ or wide_: [Wq; Wk; Wv; (W_β; W_a; 0); (W_g)] in act_dtype(), [ldp_, d]
  bool det_ = false;  // the backend promises bit-identical results (CARVE's dU1, dU2 per sequence)
  Tensor lam_, flam_;
  Bf qc_;                     // q_c (training forwards)
  cl::CcqStats ccq_stats_;    // the statistics after the sequence (training forwards)
  // CARVE: content signal (kept), write-gate pre-activation and σ [N, H] (kept), zero U
  // (freeze_content), erase logits bf16 [N, Cq] (recomputed)
  Tensor content_, fws_, ws_, Uzero_;
  Bf bx_;
};

std::unique_ptr<CudaLinear> make_cuda_linear(const Dims& d, const Slots& s, const std::vector<Tensor>& params,
                                             const std::vector<Tensor>& grads) {
  return std::make_unique<CudaLinearImpl>(d, s, params, grads);
}

// The trainer builds the layer through this factory (cuda_linear_factory, linear_layer.hpp); a build
// without CUDA has no factory, and the mixer says so.
[[maybe_unused]] const bool kRegistered = (cuda_linear_factory() = &make_cuda_linear, true);

}  // namespace

}  // namespace lar::trainer::mixers
