// The Mamba-3 layer (see mamba3_mixer.cpp for the math and the CPU reference) on the CUDA
// backend, SISO and MIMO. Same parameters, layout and results as the CPU path within bf16
// rounding:
//   [z | x | B | C] = x [W_z; W_x; W_B; W_C]ᵀ       one GEMM in act_dtype (adjacent weights)
//   [dt | a | trap | angle] = x [W_dt; …; W_angle]ᵀ  one fp32 GEMM (adjacent weights)
//   Δ, A, λ, c, β', φ; q, k, the written value c·v and the gate
//                                                   mamba3_prepare (kernels/ssm/
//                                                   mamba3_ops.hpp): token t is the R rows
//                                                   t·R + r of the channel kernel's sequence
//   o = gla channel kernel(q, k, v, g, scale 1)     grouped_channel_fwd over T·R rows, one key
//                                                   head per value head (the rotation is per
//                                                   head); states of 128 and 256 run the
//                                                   recurrent wide-key kernels (not the key-block
//                                                   split: kSsmKeySplitVerified)
//   y = Σ_r m_o ⊙ (o_r + diag_r + D v_r) ⊙ SiLU(z ⊙ m_z) W_oᵀ   mamba3_out_forward, the out GEMM
// "Decay on the first of R rows": the channel kernel takes a log-decay per row and key channel,
// so row r = 0 of each token carries AΔ on every key channel and the other R − 1 rows carry 0
// (exp(0) = 1: the state passes unchanged between a token's own rows). Parameter gradients:
// GEMMs (beta = 1) and the deterministic column sums of layer_ops.hpp. Kept from forward to
// backward: the two projections, o and the boundary states; q, k, v, g and the per-token
// scalars are recomputed in the backward.
// Decode (init_state/step, one token of B sequences a call; gated by kSsmDecodeCudaVerified):
// the same two GEMMs as a forward at T = 1, then Mamba-3's own recurrence (not the forward's
// mapping, whose write weight needs the next token) in one per-token kernel,
// mamba3_decode_step (mamba3_ops.hpp), on the fp32 state φ [B,H,na], S [B,H,P,N] (the CPU's
// layout), k_prev [B,H,R,N], v_prev [B,H,R,P]; no conv, so no window.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "cuda_layers/ssm_decode.hpp"
#include "cuda_layers/layer_common.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/linear/arena_bf16.hpp"
#include "kernels/linear/grouped_heads.hpp"
#include "kernels/linear/layer_ops.hpp"
#include "kernels/ssm/mamba3_ops.hpp"
#include "trainer/mixers/mamba3_layer.hpp"

namespace lar::trainer::mixers {

namespace {

namespace cl = lar::kernels::cuda::linear;
using kernels::DType;
using kernels::Tensor;

using cuda_layer::kNormEps;
using cuda_layer::kernel_choice;

using kernels::cuda::linear::Bf;
using kernels::cuda::linear::bf_alloc;

class CudaMamba3Impl final : public CudaMamba3 {
 public:
  CudaMamba3Impl(const MambaShape& s, int na, int R, const Mamba3Slots& sl, const std::vector<Tensor>& p,
                 const std::vector<Tensor>& g)
      : s_(s), na_(na), R_(R), sl_(sl), P_(p), G_(g) {
    if (const std::string why = cuda_mamba3_unsupported(s_, R_); !why.empty()) throw UserError(why);
    Di_ = s_.Di;
    RGN_ = (int64_t)R_ * s_.G * s_.N;
    ldp_ = 2 * Di_ + 2 * RGN_;
    ldg_ = 3 * (int64_t)s_.H + na_;
    using cuda_layer::adjacent;
    for (const auto* v : {&P_, &G_})
      if (!adjacent(*v, {sl_.wz, sl_.wx, sl_.wB, sl_.wC}) || !adjacent(*v, {sl_.wdt, sl_.wa, sl_.wtrap, sl_.wang}))
        throw RuntimeError("mamba3 mixer (cuda): the projection weights are not adjacent in the parameter buffer");
    Wcat_ = Tensor(P_[sl_.wz].data, DType::f32, {ldp_, s_.d});
    Gcat_ = Tensor(G_[sl_.wz].data, DType::f32, {ldp_, s_.d});
    Wg_ = Tensor(P_[sl_.wdt].data, DType::f32, {ldg_, s_.d});
    Gg_ = Tensor(G_[sl_.wdt].data, DType::f32, {ldg_, s_.d});
  }

  void forward(ForwardContext& ctx, const Tensor& x, const Tensor& y) override {
    auto& be = ctx.be;
    auto& ar = ctx.arena;
    cudaStream_t st = stream(be);
    B_ = x.size(0), T_ = x.size(1);
    const int64_t N = B_ * T_;
    X_ = x.view({N, s_.d});
    at_ = be.act_dtype();
    kernels_ = kernel_choice(be);
    // kept for the backward
    P_proj_ = ar.alloc(at_, {N, ldp_});
    Pg_ = ar.alloc(DType::f32, {N, ldg_});
    o_ = bf_alloc(ar, rows() * s_.P);
    const std::size_t bb = cl::grouped_channel_boundary_bytes(cl::ChannelMixer::gla, gshape());
    bound_ = ar.alloc(DType::f32, {(int64_t)(bb + 3) / 4});
    const auto mark = ar.mark();
    const Tensor Xa = as_act(be, ar, X_);
    be.gemm(Xa, false, Wcat_, true, P_proj_);
    be.gemm(Xa, false, Wg_, true, Pg_);
    inputs(ar, st, N);
    {
      cl::LayerTimer tm("mamba3: channel_fwd", st);
      cl::grouped_channel_fwd(cl::ChannelMixer::gla, gshape(), channel_inputs(), o_.p, nullptr, bound_bf(), st);
    }
    Tensor ypre = ar.alloc(at_, {N, Di_});
    {
      cl::LayerTimer tm("mamba3: diagonal + out maps (fwd)", st);
      cl::mamba3_out_forward(args(), o_.p, ypre.data, st);
    }
    be.gemm(ypre, false, P_[sl_.wo], true, y.view({N, s_.d}));
    ar.release(mark);
  }

  void backward(ForwardContext& ctx, const Tensor& dy, const Tensor& dx) override {
    auto& be = ctx.be;
    auto& ar = ctx.arena;
    cudaStream_t st = stream(be);
    const int64_t N = B_ * T_, HRP = (int64_t)s_.H * R_ * s_.P, HRN = (int64_t)s_.H * R_ * s_.N;
    kernels_ = kernel_choice(be);
    const bool mimo = sl_.mx >= 0;
    const Tensor dX = dx.view({N, s_.d});
    const auto mark = ar.mark();
    const Tensor Xa = as_act(be, ar, X_);
    const Tensor dY = as_act(be, ar, dy.view({N, s_.d}));
    inputs(ar, st, N);  // the scalars, q, k, v and the gate again
    // y = ypre W_oᵀ; the output backward writes ypre again for W_o's gradient
    Tensor dyv = ar.alloc(at_, {N, Di_});
    be.gemm(dY, false, P_[sl_.wo], false, dyv);
    Tensor ypre = ar.alloc(at_, {N, Di_});
    Tensor du = ar.alloc(DType::f32, {rows(), (int64_t)s_.P});
    Bf dO = bf_alloc(ar, rows() * s_.P);
    Tensor dP = ar.alloc(at_, {N, ldp_});  // ∂L/∂[z | x | B | C]
    {
      Tensor dterm = ar.alloc(DType::f32, {N, (int64_t)s_.H});
      Tensor tmo, tmz;
      if (mimo) {
        tmo = ar.alloc(DType::f32, {N, HRP});
        tmz = ar.alloc(DType::f32, {N, HRP});
      }
      {
        cl::LayerTimer tm("mamba3: diagonal + out maps (bwd)", st);
        cl::mamba3_out_backward(args(), o_.p, dyv.data, du.ptr<float>(), dO.p, dP.data, dterm.ptr<float>(),
                                mimo ? tmo.ptr<float>() : nullptr, mimo ? tmz.ptr<float>() : nullptr, ypre.data, st);
      }
      colsum(ar, st, dterm, 1, sl_.D);
      if (mimo) {
        colsum(ar, st, tmo, 1, sl_.mo);
        colsum(ar, st, tmz, 1, sl_.mz);
      }
    }
    be.gemm(dY, true, ypre, false, G_[sl_.wo], 1.0, 1.0);
    // the recurrence: the kernel's gradients on q, k, the written value and the gate
    Bf dq = bf_alloc(ar, rows() * s_.N), dk = bf_alloc(ar, rows() * s_.N), dv = bf_alloc(ar, rows() * s_.P);
    Tensor dg = ar.alloc(DType::f32, {rows(), (int64_t)s_.N});
    {
      cl::LayerTimer tm("mamba3: channel_bwd", st);
      cl::ChannelGrads cg;
      cg.dq = dq.p;
      cg.dk = dk.p;
      cg.dv = dv.p;
      cg.dg = dg.ptr<float>();
      cl::grouped_channel_bwd(cl::ChannelMixer::gla, gshape(), channel_inputs(), bound_bf(), dO.p, nullptr, cg, st);
    }
    Tensor dQh = ar.alloc(DType::f32, {N, HRN}), dKh = ar.alloc(DType::f32, {N, HRN});
    Tensor dphi = ar.alloc(DType::f32, {N, (int64_t)s_.H * na_});
    Tensor dc = ar.alloc(DType::f32, {N, (int64_t)s_.H}), dbn = ar.alloc(DType::f32, {N, (int64_t)s_.H}),
           dadt = ar.alloc(DType::f32, {N, (int64_t)s_.H});
    {
      Tensor tmx;
      if (mimo) tmx = ar.alloc(DType::f32, {N, HRP});
      {
        cl::LayerTimer tm("mamba3: diagonal + rotation (bwd)", st);
        cl::Mamba3CoreGrads g;
        g.dq = dq.p;
        g.dk = dk.p;
        g.dv = dv.p;
        g.dg = dg.ptr<float>();
        g.dQh = dQh.ptr<float>();
        g.dKh = dKh.ptr<float>();
        g.dphi = dphi.ptr<float>();
        g.dc = dc.ptr<float>();
        g.dbn = dbn.ptr<float>();
        g.dadt = dadt.ptr<float>();
        g.tmx = mimo ? tmx.ptr<float>() : nullptr;
        cl::mamba3_core_backward(args(), du.ptr<float>(), g, dP.data, st);
      }
      if (mimo) colsum(ar, st, tmx, 1, sl_.mx);
    }
    colsum(ar, st, dQh, 1, sl_.bC);
    colsum(ar, st, dKh, 1, sl_.bB);
    {
      Tensor tnB = ar.alloc(DType::f32, {N * R_ * s_.G, (int64_t)s_.N});
      Tensor tnC = ar.alloc(DType::f32, {N * R_ * s_.G, (int64_t)s_.N});
      {
        cl::LayerTimer tm("mamba3: B, C norms (bwd)", st);
        cl::mamba3_norm_backward(args(), dQh.ptr<float>(), dKh.ptr<float>(), dP.data, tnB.ptr<float>(),
                                 tnC.ptr<float>(), st);
      }
      colsum(ar, st, tnB, 1, sl_.nB);
      colsum(ar, st, tnC, 1, sl_.nC);
    }
    Tensor dPg = ar.alloc(DType::f32, {N, ldg_});
    {
      cl::LayerTimer tm("mamba3: scalars (bwd)", st);
      cl::mamba3_scalars_backward(args(), dphi.ptr<float>(), dc.ptr<float>(), dbn.ptr<float>(), dadt.ptr<float>(),
                                  dPg.ptr<float>(), st);
    }
    {  // ∂L/∂dt_bias: the dt columns of dPg
      Tensor scratch = ar.alloc(DType::f32, {(int64_t)cl::colsum_scratch_floats(N, s_.H)});
      cl::LayerTimer tm("mamba3: parameter sums", st);
      cl::colsum_accumulate(dPg.ptr<float>(), N, s_.H, ldg_, 1, G_[sl_.dt_bias].ptr<float>(), scratch.ptr<float>(), st);
    }
    // the projections: dx overwritten by the first
    be.gemm(dP, true, Xa, false, Gcat_, 1.0, 1.0);
    be.gemm(dP, false, Wcat_, false, dX, 1.0, 0.0);
    be.gemm(dPg, true, Xa, false, Gg_, 1.0, 1.0);
    be.gemm(dPg, false, Wg_, false, dX, 1.0, 1.0);
    ar.release(mark);
  }

  std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch) override {
    cudaStream_t st = stream(be);
    if (batch < 1) throw RuntimeError("mamba3 mixer (cuda): init_state for a batch of " + std::to_string(batch));
    const std::size_t BH = (std::size_t)batch * s_.H;
    const std::size_t sizes[4] = {SsmCudaState::rounded(BH * na_ * 4), SsmCudaState::rounded(BH * s_.P * s_.N * 4),
                                  SsmCudaState::rounded(BH * R_ * s_.N * 4), SsmCudaState::rounded(BH * R_ * s_.P * 4)};
    auto s = std::make_unique<SsmCudaState>(be, sizes[0] + sizes[1] + sizes[2] + sizes[3]);
    LAR_CUDA_CHECK(cudaMemsetAsync(s->mem, 0, s->bytes, st));
    s->B = batch;
    s->at = be.act_dtype();
    for (int i = 0; i < 4; ++i) s->extra[i] = static_cast<float*>(s->take(sizes[i]));
    s->S = s->extra[1];
    return s;
  }

  // One token of each of the state's B sequences: x, y [B, d] in act_dtype().
  void step(ForwardContext& ctx, const Tensor& x, const Tensor& y, MixerState& state) override {
    auto& be = ctx.be;
    auto& ar = ctx.arena;
    cudaStream_t st = stream(be);
    at_ = be.act_dtype();
    SsmCudaState& s = ssm_decode_state("mamba3 mixer (cuda)", state, x, s_.d, at_);
    const int64_t B = s.B;
    const auto mark = ar.mark();
    const Tensor Xa = as_act(be, ar, x);
    B_ = B, T_ = 1;
    P_proj_ = ar.alloc(at_, {B, ldp_});
    Pg_ = ar.alloc(DType::f32, {B, ldg_});
    be.gemm(Xa, false, Wcat_, true, P_proj_);
    be.gemm(Xa, false, Wg_, true, Pg_);
    for (Tensor* t : {&sc_dt_, &sc_A_, &sc_lam_, &sc_cw_, &sc_bn_, &phi_}) *t = Tensor();
    Tensor ypre = ar.alloc(at_, {B, Di_});
    {
      cl::LayerTimer tm("mamba3: recurrence + out maps (decode)", st);
      cl::Mamba3DecodeState ds;
      ds.phi = s.extra[0];
      ds.S = s.extra[1];
      ds.k_prev = s.extra[2];
      ds.v_prev = s.extra[3];
      cl::mamba3_decode_step(args(), ds, ypre.data, st);
    }
    be.gemm(ypre, false, P_[sl_.wo], true, y.view({B, s_.d}));
    ++s.pos;
    ar.release(mark);
  }

 private:
  static cudaStream_t stream(kernels::Backend& be) { return cuda_layer::stream(be, "mamba3 mixer"); }
  // the channel kernel's rows: R per token and head
  int64_t rows() const { return B_ * T_ * R_ * s_.H; }
  cl::GroupedShape gshape() const {
    cl::GroupedShape g;
    g.B = B_;
    g.T = T_ * R_;
    g.H = s_.H;
    g.Hk = s_.H;  // the rotation is per head: one key head per value head
    g.dk = s_.N;
    g.dv = s_.P;
    g.scale = 1.0;
    g.kernels = kernels_;
    g.key_split = cl::ssm_key_split_open();
    return g;
  }
  __nv_bfloat16* bound_bf() const { return static_cast<__nv_bfloat16*>(bound_.data); }
  const float* par_or_null(int slot) const { return slot < 0 ? nullptr : P_[slot].ptr<float>(); }

  cl::Mamba3Args args() const {
    cl::Mamba3Args a;
    a.B = B_;
    a.T = T_;
    a.H = s_.H;
    a.Pd = s_.P;
    a.S = s_.N;
    a.G = s_.G;
    a.R = R_;
    a.na = na_;
    a.P = P_proj_.data;
    a.act_bf16 = at_ == DType::bf16;
    a.ldp = ldp_;
    a.Pg = Pg_.ptr<float>();
    a.ldg = ldg_;
    a.dt_bias = P_[sl_.dt_bias].ptr<float>();
    a.nB = P_[sl_.nB].ptr<float>();
    a.nC = P_[sl_.nC].ptr<float>();
    a.bB = P_[sl_.bB].ptr<float>();
    a.bC = P_[sl_.bC].ptr<float>();
    a.D = P_[sl_.D].ptr<float>();
    a.mx = par_or_null(sl_.mx);
    a.mz = par_or_null(sl_.mz);
    a.mo = par_or_null(sl_.mo);
    a.eps = kNormEps;
    a.dt = sc_dt_.ptr<float>();
    a.A = sc_A_.ptr<float>();
    a.lam = sc_lam_.ptr<float>();
    a.cw = sc_cw_.ptr<float>();
    a.bnext = sc_bn_.ptr<float>();
    a.phi = phi_.ptr<float>();
    return a;
  }
  cl::ChannelInputs channel_inputs() const {
    cl::ChannelInputs in;
    in.q = q_.p;
    in.k = k_.p;
    in.v = v_.p;
    in.g = g_.ptr<float>();
    return in;
  }

  // From the kept projections: the per-token scalars, the angles and the kernel's inputs, in
  // the arena above the caller's mark (the same values every call).
  void inputs(kernels::Arena& ar, cudaStream_t st, int64_t N) {
    for (Tensor* t : {&sc_dt_, &sc_A_, &sc_lam_, &sc_cw_, &sc_bn_}) *t = ar.alloc(DType::f32, {N, (int64_t)s_.H});
    phi_ = ar.alloc(DType::f32, {N, (int64_t)s_.H * na_});
    q_ = bf_alloc(ar, rows() * s_.N);
    k_ = bf_alloc(ar, rows() * s_.N);
    v_ = bf_alloc(ar, rows() * s_.P);
    g_ = ar.alloc(DType::f32, {rows(), (int64_t)s_.N});
    cl::LayerTimer tm("mamba3: scalars, rotation, kernel inputs (fwd)", st);
    cl::mamba3_prepare(args(), q_.p, k_.p, v_.p, g_.ptr<float>(), st);
  }

  // out[j] += Σ_n Σ_{c in group j} M[n, c] into the gradient of slot (deterministic).
  void colsum(kernels::Arena& ar, cudaStream_t st, const Tensor& M, int group, int slot) const {
    cl::colsum_into(ar, st, M, group, G_[slot].ptr<float>(), "mamba3: parameter sums");
  }

  // t in act_dtype(): t itself, or a converted copy in the arena.
  Tensor as_act(kernels::Backend& be, kernels::Arena& ar, const Tensor& t) const {
    return cl::as_dtype(be, ar, t, at_);
  }

  MambaShape s_;
  int na_, R_;
  Mamba3Slots sl_;
  std::vector<Tensor> P_, G_;
  int64_t Di_ = 0, RGN_ = 0, ldp_ = 0, ldg_ = 0;
  Tensor Wcat_, Gcat_, Wg_, Gg_;  // [W_z; W_x; W_B; W_C], [W_dt; W_a; W_trap; W_angle] and their gradients
  // this step's cache (arena tensors, valid until the next forward)
  int64_t B_ = 0, T_ = 0;
  DType at_ = DType::f32;
  cl::KernelChoice kernels_;
  Tensor X_, P_proj_, Pg_, bound_;
  Bf o_;
  // recomputed in forward and backward (above their marks)
  Tensor sc_dt_, sc_A_, sc_lam_, sc_cw_, sc_bn_, phi_, g_;
  Bf q_, k_, v_;
};

std::unique_ptr<CudaMamba3> make_cuda_mamba3(const MambaShape& s, int na, int rank, const Mamba3Slots& sl,
                                             const std::vector<Tensor>& params, const std::vector<Tensor>& grads) {
  return std::make_unique<CudaMamba3Impl>(s, na, rank, sl, params, grads);
}

// The trainer builds the layer through this factory (cuda_mamba3_factory, mamba3_layer.hpp); a build
// without CUDA has no factory, and the mixer says so.
[[maybe_unused]] const bool kRegistered = (cuda_mamba3_factory() = &make_cuda_mamba3, true);

}  // namespace

}  // namespace lar::trainer::mixers
