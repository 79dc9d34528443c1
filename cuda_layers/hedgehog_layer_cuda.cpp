// The GLA-Hedgehog layer (see hedgehog_mixer.cpp for the math and the CPU reference) on the
// CUDA backend. Same parameters, layout and results as the CPU path within bf16 rounding:
//   [q | k | v] = x [Wq; Wk; Wv]ᵀ                one GEMM (the three are adjacent in the flat
//                                               buffer)
//   a_q, a_k, v = SiLU(causal conv)              ssm_conv_silu_forward (kernels/ssm/
//                                               mamba2_ops.hpp, with a zero bias): a_q, a_k fp32,
//                                               v bf16
//   u = a Δᵀ per (token, head)                   a GEMM over the [N·H, dk] rows (one map for all
//                                               heads), W = I + Δ applied as a + a Δᵀ
//   φ = [softmax(a + u + b), softmax(−…)]        hedgehog_map_forward (kernels/hedgehog/
//                                               hedgehog_ops.hpp): bf16 [N, H, Fp]
//   g = logsigmoid(x W₁ᵀ W₂ᵀ + b_g)/16           two GEMMs + layer_ops' gate map (logsig16)
//   o = gla channel kernel(q = φ_q, k = φ_k, v, g, scale 1)
//                                               grouped_channel_fwd at key dim Fp (64: the
//                                               chunk kernels; 128, 256: the wide-key kernels
//                                               or the key-block split where open; 320..512,
//                                               heads past 128: the key-block split only,
//                                               refused while its gate is closed)
//   y = (RMSNorm_h(o) ⊙ SiLU(x W_gᵀ)) W_oᵀ       out_gate_forward (value heads of dv), the out GEMM
// Padding (hedgehog_cuda_key_dim, hedgehog_cuda_value_dim): a feature dim F = 2dk below the
// kernels' key dim gets zero features and zero log-gates in the extra channels (they add nothing
// to S φ(q)), a value dim off a multiple of 64 zero values (their outputs are dropped); the
// padded and dense layouts are copied into each other with cudaMemcpy2DAsync.
// Backward: the norm × gate backward, the channel kernel's backward (dφ_q, dφ_k, dv, dg), the
// gate map's backward with column sums for b_g, hedgehog_map_backward for ∂L/∂(a + u + b), then
// ∂L/∂a = ∂L/∂x (I + Δ), ∂L/∂Δ += ∂L/∂xᵀ a (GEMMs, β = 1) and ∂L/∂b by column sums, the conv
// backward into ∂L/∂[q | k | v] and the projection GEMMs. Kept from forward to backward
// (per layer): P, a_q, a_k, u_q, u_k, φ_q, φ_k, v, the gates' f and g, h1 = x W₁ᵀ, og = x W_gᵀ,
// o, the boundary states and the norm's rstd.
// Decode (init_state/step, one token of B sequences a call; gated by kSsmDecodeCudaVerified):
// the same GEMMs, feature maps, gates and output as a forward at T = 1; the conv runs over the
// window of the last W projection rows (ssm_decode.hpp) and keeps its last row; the
// recurrence is the gla channel decode at key dim Fp on the fp32 state [B, H, dvp, Fp] (padded
// as the forward's: the padding channels stay zero; past 256 the split decode of
// grouped_heads.hpp, n 64-wide decodes over the state's column blocks).
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "cuda_layers/ssm_decode.hpp"
#include "cuda_layers/layer_common.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/linear/arena_bf16.hpp"
#include "kernels/linear/grouped_heads.hpp"
#include "kernels/hedgehog/hedgehog_ops.hpp"
#include "kernels/linear/layer_ops.hpp"
#include "kernels/ssm/mamba2_ops.hpp"
#include "trainer/mixers/hedgehog_layer.hpp"

namespace lar::trainer::mixers {

namespace {

namespace cl = lar::kernels::cuda::linear;
using bf16 = __nv_bfloat16;
using kernels::DType;
using kernels::Tensor;
using kernels::cuda::linear::Bf;
using kernels::cuda::linear::bf_alloc;

using cuda_layer::kNormEps;
using cuda_layer::kernel_choice;

// rows × w elements of es bytes: dense [rows, w] → dst rows of ld (the rest zeroed), and back.
void pad_rows(const void* src, int64_t w, void* dst, int64_t ld, int64_t rows, std::size_t es, cudaStream_t st) {
  if (rows == 0) return;
  LAR_CUDA_CHECK(cudaMemsetAsync(dst, 0, rows * ld * es, st));
  LAR_CUDA_CHECK(cudaMemcpy2DAsync(dst, ld * es, src, w * es, w * es, rows, cudaMemcpyDeviceToDevice, st));
}
void unpad_rows(const void* src, int64_t ld, void* dst, int64_t w, int64_t rows, std::size_t es, cudaStream_t st) {
  if (rows == 0) return;
  LAR_CUDA_CHECK(cudaMemcpy2DAsync(dst, w * es, src, ld * es, w * es, rows, cudaMemcpyDeviceToDevice, st));
}

class CudaHedgehogImpl final : public CudaHedgehog {
 public:
  CudaHedgehogImpl(const HedgehogShape& s, const HedgehogSlots& sl, const std::vector<Tensor>& p,
                   const std::vector<Tensor>& g)
      : s_(s), sl_(sl), P_(p), G_(g) {
    if (const std::string why = cuda_hedgehog_shape_unsupported(s_); !why.empty()) throw UserError(why);
    Fp_ = hedgehog_cuda_key_dim(s_);
    dvp_ = hedgehog_cuda_value_dim(s_);
    ldp_ = 2 * s_.Cq + s_.Cv;
    // one GEMM for q, k, v: their weights (and gradients) must be adjacent
    const auto slots = {sl_.wq, sl_.wk, sl_.wv};
    if (!cuda_layer::adjacent(P_, slots) || !cuda_layer::adjacent(G_, slots))
      throw RuntimeError("gla_hedgehog mixer (cuda): wq, wk, wv are not adjacent in the parameter buffer");
    Wqkv_ = Tensor(P_[sl_.wq].data, DType::f32, {ldp_, s_.d});
    Gqkv_ = Tensor(G_[sl_.wq].data, DType::f32, {ldp_, s_.d});
  }

  void forward(ForwardContext& ctx, const Tensor& x, const Tensor& y) override {
    auto& be = ctx.be;
    auto& ar = ctx.arena;
    cudaStream_t st = stream(be);
    B_ = x.size(0), T_ = x.size(1);
    const int64_t N = B_ * T_, R = N * s_.H;  // R: (token, head) rows
    X_ = x.view({N, s_.d});
    at_ = be.act_dtype();
    kernels_ = kernel_choice(be);
    // kept for the backward
    P_proj_ = ar.alloc(at_, {N, ldp_});
    aq_ = ar.alloc(DType::f32, {R, s_.dk});
    ak_ = ar.alloc(DType::f32, {R, s_.dk});
    uq_ = ar.alloc(DType::f32, {R, s_.dk});
    uk_ = ar.alloc(DType::f32, {R, s_.dk});
    phq_ = bf_alloc(ar, R * Fp_);
    phk_ = bf_alloc(ar, R * Fp_);
    v_ = bf_alloc(ar, R * dvp_);
    h1_ = ar.alloc(at_, {N, s_.rank});
    f_ = ar.alloc(DType::f32, {N, s_.CF});
    g_ = ar.alloc(DType::f32, {R, Fp_});
    o_ = bf_alloc(ar, R * dvp_);
    oc_ = padded_v() ? bf_alloc(ar, R * s_.dv) : o_;
    og_ = ar.alloc(at_, {N, s_.Cv});
    const std::size_t bb = cl::grouped_channel_boundary_bytes(cl::ChannelMixer::gla, gshape());
    bound_ = ar.alloc(DType::f32, {(int64_t)(bb + 3) / 4});
    rstd_ = ar.alloc(DType::f32, {R});
    const auto mark = ar.mark();
    const Tensor Xa = as_act(be, ar, X_);
    be.gemm(Xa, false, Wqkv_, true, P_proj_);
    // conv + SiLU: a_q, a_k (fp32, the maps' inputs) and v (bf16, padded to dvp_)
    {
      const Tensor zb = ar.zeros(DType::f32, {std::max(s_.Cq, s_.Cv)});
      cl::LayerTimer tm("gla_hedgehog: conv+silu (fwd)", st);
      cl::ssm_conv_silu_forward(conv_args(0, s_.Cq, sl_.cq, zb), aq_.data, false, st);
      cl::ssm_conv_silu_forward(conv_args(s_.Cq, s_.Cq, sl_.ck, zb), ak_.data, false, st);
      if (padded_v()) {
        const Bf vd = bf_alloc(ar, R * s_.dv);
        cl::ssm_conv_silu_forward(conv_args(2 * s_.Cq, s_.Cv, sl_.cv, zb), vd.p, true, st);
        pad_rows(vd.p, s_.dv, v_.p, dvp_, R, 2, st);
      } else {
        cl::ssm_conv_silu_forward(conv_args(2 * s_.Cq, s_.Cv, sl_.cv, zb), v_.p, true, st);
      }
    }
    // the feature maps
    be.gemm(aq_, false, P_[sl_.fq_w], true, uq_);
    be.gemm(ak_, false, P_[sl_.fk_w], true, uk_);
    {
      cl::LayerTimer tm("gla_hedgehog: feature map (fwd)", st);
      cl::hedgehog_map_forward(R, s_.dk, uq_.ptr<float>(), aq_.ptr<float>(), P_[sl_.fq_b].ptr<float>(), phq_.p, Fp_,
                               st);
      cl::hedgehog_map_forward(R, s_.dk, uk_.ptr<float>(), ak_.ptr<float>(), P_[sl_.fk_b].ptr<float>(), phk_.p, Fp_,
                               st);
    }
    // the per-feature-channel gates, padded with zero log-gates
    be.gemm(Xa, false, P_[sl_.g1], true, h1_);
    be.gemm(h1_, false, P_[sl_.g2], true, f_);
    {
      cl::LayerTimer tm("gla_hedgehog: gate map (fwd)", st);
      if (padded_f()) {
        const Tensor gd = ar.alloc(DType::f32, {N, s_.CF});
        cl::gate_forward(gate_args(), gd.ptr<float>(), nullptr, st);
        pad_rows(gd.data, s_.F, g_.data, Fp_, R, 4, st);
      } else {
        cl::gate_forward(gate_args(), g_.ptr<float>(), nullptr, st);
      }
    }
    {
      cl::LayerTimer tm("gla_hedgehog: channel_fwd", st);
      cl::grouped_channel_fwd(cl::ChannelMixer::gla, gshape(), channel_inputs(), o_.p, nullptr, bound_bf(), st);
    }
    if (padded_v()) unpad_rows(o_.p, dvp_, oc_.p, s_.dv, R, 2, st);
    be.gemm(Xa, false, P_[sl_.wgate], true, og_);
    Tensor ypre = ar.alloc(at_, {N, s_.Cv});
    {
      cl::LayerTimer tm("gla_hedgehog: out norm+gate (fwd)", st);
      cl::out_gate_forward(R, oc_.p, og_.data, P_[sl_.onorm].ptr<float>(), kNormEps, ypre.data, rstd_.ptr<float>(),
                           act_bf16(), st, s_.H, 0, s_.dv);
    }
    be.gemm(ypre, false, P_[sl_.wo], true, y.view({N, s_.d}));
    ar.release(mark);
  }

  void backward(ForwardContext& ctx, const Tensor& dy, const Tensor& dx) override {
    auto& be = ctx.be;
    auto& ar = ctx.arena;
    cudaStream_t st = stream(be);
    const int64_t N = B_ * T_, R = N * s_.H;
    kernels_ = kernel_choice(be);
    const Tensor dX = dx.view({N, s_.d});
    const auto mark = ar.mark();
    const Tensor Xa = as_act(be, ar, X_);
    const Tensor dY = as_act(be, ar, dy.view({N, s_.d}));
    // y = ypre W_oᵀ; the norm × gate backward writes ypre again for W_o's gradient
    Tensor dypre = ar.alloc(at_, {N, s_.Cv});
    be.gemm(dY, false, P_[sl_.wo], false, dypre);
    Tensor ypre = ar.alloc(at_, {N, s_.Cv});
    Bf dOc = bf_alloc(ar, R * s_.dv);
    Tensor dog = ar.alloc(at_, {N, s_.Cv});
    {
      Tensor scratch = ar.alloc(DType::f32, {(int64_t)cl::out_gate_backward_scratch_floats(R, s_.dv)});
      cl::LayerTimer tm("gla_hedgehog: out norm+gate (bwd)", st);
      cl::out_gate_backward(R, oc_.p, og_.data, P_[sl_.onorm].ptr<float>(), rstd_.ptr<float>(), dypre.data, dOc.p,
                            dog.data, ypre.data, G_[sl_.onorm].ptr<float>(), scratch.ptr<float>(), act_bf16(), st, s_.H,
                            0, s_.dv);
    }
    be.gemm(dY, true, ypre, false, G_[sl_.wo], 1.0, 1.0);
    be.gemm(dog, true, Xa, false, G_[sl_.wgate], 1.0, 1.0);
    be.gemm(dog, false, P_[sl_.wgate], false, dX, 1.0, 0.0);  // dx overwritten
    // the recurrence
    Bf dO = dOc;
    if (padded_v()) {
      dO = bf_alloc(ar, R * dvp_);
      pad_rows(dOc.p, s_.dv, dO.p, dvp_, R, 2, st);
    }
    Bf dphq = bf_alloc(ar, R * Fp_), dphk = bf_alloc(ar, R * Fp_), dv = bf_alloc(ar, R * dvp_);
    Tensor dg = ar.alloc(DType::f32, {R, Fp_});
    {
      cl::LayerTimer tm("gla_hedgehog: channel_bwd", st);
      cl::ChannelGrads cg;
      cg.dq = dphq.p;
      cg.dk = dphk.p;
      cg.dv = dv.p;
      cg.dg = dg.ptr<float>();
      cl::grouped_channel_bwd(cl::ChannelMixer::gla, gshape(), channel_inputs(), bound_bf(), dO.p, nullptr, cg, st);
    }
    // the gates: ∂L/∂f, b_g's sum, then W₂ and W₁
    {
      Tensor dgc = dg;
      if (padded_f()) {
        dgc = ar.alloc(DType::f32, {N, s_.CF});
        unpad_rows(dg.data, Fp_, dgc.data, s_.F, R, 4, st);
      }
      Tensor df = ar.alloc(DType::f32, {N, s_.CF});
      {
        cl::LayerTimer tm("gla_hedgehog: gate map (bwd)", st);
        cl::gate_backward(gate_args(), dgc.ptr<float>(), nullptr, nullptr, df.ptr<float>(), s_.CF, nullptr, st);
      }
      colsum(ar, st, df, sl_.gb);
      be.gemm(df, true, h1_, false, G_[sl_.g2], 1.0, 1.0);
      Tensor dh1 = ar.alloc(DType::f32, {N, s_.rank});
      be.gemm(df, false, P_[sl_.g2], false, dh1);
      be.gemm(dh1, true, Xa, false, G_[sl_.g1], 1.0, 1.0);
      be.gemm(dh1, false, P_[sl_.g1], false, dX, 1.0, 1.0);
    }
    // the feature maps: ∂L/∂a_q, ∂L/∂a_k (fp32 [N, Cq]) and the maps' parameter gradients
    Tensor daq = ar.alloc(DType::f32, {R, s_.dk}), dak = ar.alloc(DType::f32, {R, s_.dk});
    map_backward(be, ar, st, uq_, aq_, sl_.fq_w, sl_.fq_b, dphq, daq);
    map_backward(be, ar, st, uk_, ak_, sl_.fk_w, sl_.fk_b, dphk, dak);
    // the conv + SiLU backward into ∂L/∂[q | k | v], then the projection
    Bf dvc = dv;
    if (padded_v()) {
      dvc = bf_alloc(ar, R * s_.dv);
      unpad_rows(dv.p, dvp_, dvc.p, s_.dv, R, 2, st);
    }
    Tensor dP = ar.alloc(at_, {N, ldp_});
    {
      const Tensor zb = ar.zeros(DType::f32, {std::max(s_.Cq, s_.Cv)});
      Tensor dbias = ar.zeros(DType::f32, {std::max(s_.Cq, s_.Cv)});  // the zero bias's gradient: dropped
      cl::LayerTimer tm("gla_hedgehog: conv+silu (bwd)", st);
      conv_bwd(ar, st, 0, s_.Cq, sl_.cq, zb, dbias, daq.data, false, dP);
      conv_bwd(ar, st, s_.Cq, s_.Cq, sl_.ck, zb, dbias, dak.data, false, dP);
      conv_bwd(ar, st, 2 * s_.Cq, s_.Cv, sl_.cv, zb, dbias, dvc.p, true, dP);
    }
    be.gemm(dP, true, Xa, false, Gqkv_, 1.0, 1.0);
    be.gemm(dP, false, Wqkv_, false, dX, 1.0, 1.0);
    ar.release(mark);
  }

  std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch) override {
    cudaStream_t st = stream(be);
    if (batch < 1) throw RuntimeError("gla_hedgehog mixer (cuda): init_state for a batch of " + std::to_string(batch));
    const DType at = be.act_dtype();
    const std::size_t s_bytes = SsmCudaState::rounded((std::size_t)batch * s_.H * dvp_ * Fp_ * 4);
    const std::size_t w_bytes = SsmCudaState::rounded((std::size_t)batch * s_.W * ldp_ * kernels::dtype_size(at));
    auto s = std::make_unique<SsmCudaState>(be, s_bytes + 2 * w_bytes);
    LAR_CUDA_CHECK(cudaMemsetAsync(s->mem, 0, s->bytes, st));
    s->B = batch;
    s->at = at;
    s->window = s_.W;
    s->ldp = ldp_;
    s->S = static_cast<float*>(s->take(s_bytes));
    s->win[0] = s->take(w_bytes);
    s->win[1] = s->take(w_bytes);
    return s;
  }

  // One token of each of the state's B sequences: x, y [B, d] in act_dtype().
  void step(ForwardContext& ctx, const Tensor& x, const Tensor& y, MixerState& state) override {
    auto& be = ctx.be;
    auto& ar = ctx.arena;
    cudaStream_t st = stream(be);
    at_ = be.act_dtype();
    SsmCudaState& s = ssm_decode_state("gla_hedgehog mixer (cuda)", state, x, s_.d, at_);
    kernels_ = kernel_choice(be);
    const int64_t B = s.B, R = B * s_.H, W = s_.W;
    const auto mark = ar.mark();
    const Tensor Xa = as_act(be, ar, x);
    const Tensor Ptok = ar.alloc(at_, {B, ldp_});
    be.gemm(Xa, false, Wqkv_, true, Ptok);
    // the conv over the window (a sequence of W tokens), its last row kept
    B_ = B, T_ = W;
    P_proj_ = Tensor(s.push(Ptok.data, st), at_, {B * W, ldp_});
    aq_ = ar.alloc(DType::f32, {R, s_.dk});
    ak_ = ar.alloc(DType::f32, {R, s_.dk});
    v_ = bf_alloc(ar, R * dvp_);
    {
      const Tensor zb = ar.zeros(DType::f32, {std::max(s_.Cq, s_.Cv)});
      const Tensor aqw = ar.alloc(DType::f32, {B * W, s_.Cq}), akw = ar.alloc(DType::f32, {B * W, s_.Cq});
      const Bf vw = bf_alloc(ar, B * W * s_.Cv);
      cl::LayerTimer tm("gla_hedgehog: conv+silu (decode)", st);
      cl::ssm_conv_silu_forward(conv_args(0, s_.Cq, sl_.cq, zb), aqw.data, false, st);
      cl::ssm_conv_silu_forward(conv_args(s_.Cq, s_.Cq, sl_.ck, zb), akw.data, false, st);
      cl::ssm_conv_silu_forward(conv_args(2 * s_.Cq, s_.Cv, sl_.cv, zb), vw.p, true, st);
      ssm_last_rows(aqw.data, aq_.data, (std::size_t)s_.Cq * 4, W, B, st);
      ssm_last_rows(akw.data, ak_.data, (std::size_t)s_.Cq * 4, W, B, st);
      if (padded_v()) {
        const Bf vd = bf_alloc(ar, R * s_.dv);
        ssm_last_rows(vw.p, vd.p, (std::size_t)s_.Cv * 2, W, B, st);
        pad_rows(vd.p, s_.dv, v_.p, dvp_, R, 2, st);
      } else {
        ssm_last_rows(vw.p, v_.p, (std::size_t)s_.Cv * 2, W, B, st);
      }
    }
    T_ = 1;
    P_proj_ = Ptok;
    // the feature maps
    uq_ = ar.alloc(DType::f32, {R, s_.dk});
    uk_ = ar.alloc(DType::f32, {R, s_.dk});
    phq_ = bf_alloc(ar, R * Fp_);
    phk_ = bf_alloc(ar, R * Fp_);
    be.gemm(aq_, false, P_[sl_.fq_w], true, uq_);
    be.gemm(ak_, false, P_[sl_.fk_w], true, uk_);
    {
      cl::LayerTimer tm("gla_hedgehog: feature map (decode)", st);
      cl::hedgehog_map_forward(R, s_.dk, uq_.ptr<float>(), aq_.ptr<float>(), P_[sl_.fq_b].ptr<float>(), phq_.p, Fp_,
                               st);
      cl::hedgehog_map_forward(R, s_.dk, uk_.ptr<float>(), ak_.ptr<float>(), P_[sl_.fk_b].ptr<float>(), phk_.p, Fp_,
                               st);
    }
    // the per-feature-channel gates, padded with zero log-gates
    h1_ = ar.alloc(at_, {B, s_.rank});
    f_ = ar.alloc(DType::f32, {B, s_.CF});
    g_ = ar.alloc(DType::f32, {R, Fp_});
    be.gemm(Xa, false, P_[sl_.g1], true, h1_);
    be.gemm(h1_, false, P_[sl_.g2], true, f_);
    {
      cl::LayerTimer tm("gla_hedgehog: gate map (decode)", st);
      if (padded_f()) {
        const Tensor gd = ar.alloc(DType::f32, {B, s_.CF});
        cl::gate_forward(gate_args(), gd.ptr<float>(), nullptr, st);
        pad_rows(gd.data, s_.F, g_.data, Fp_, R, 4, st);
      } else {
        cl::gate_forward(gate_args(), g_.ptr<float>(), nullptr, st);
      }
    }
    o_ = bf_alloc(ar, R * dvp_);
    oc_ = padded_v() ? bf_alloc(ar, R * s_.dv) : o_;
    {
      cl::LayerTimer tm("gla_hedgehog: channel decode", st);
      cl::grouped_channel_decode(cl::ChannelMixer::gla, gshape(), channel_inputs(), s.S, o_.p, st);
    }
    if (padded_v()) unpad_rows(o_.p, dvp_, oc_.p, s_.dv, R, 2, st);
    og_ = ar.alloc(at_, {B, s_.Cv});
    be.gemm(Xa, false, P_[sl_.wgate], true, og_);
    rstd_ = ar.alloc(DType::f32, {R});
    Tensor ypre = ar.alloc(at_, {B, s_.Cv});
    {
      cl::LayerTimer tm("gla_hedgehog: out norm+gate (decode)", st);
      cl::out_gate_forward(R, oc_.p, og_.data, P_[sl_.onorm].ptr<float>(), kNormEps, ypre.data, rstd_.ptr<float>(),
                           act_bf16(), st, s_.H, 0, s_.dv);
    }
    be.gemm(ypre, false, P_[sl_.wo], true, y.view({B, s_.d}));
    ++s.pos;
    ar.release(mark);
  }

 private:
  static cudaStream_t stream(kernels::Backend& be) { return cuda_layer::stream(be, "gla_hedgehog mixer"); }
  bool padded_f() const { return Fp_ != s_.F; }
  bool padded_v() const { return dvp_ != s_.dv; }
  cl::GroupedShape gshape() const {
    cl::GroupedShape g;
    g.B = B_;
    g.T = T_;
    g.H = s_.H;
    g.Hk = s_.H;
    g.dk = Fp_;
    g.dv = dvp_;
    g.scale = 1.0;
    g.kernels = kernels_;
    return g;
  }
  cl::ChannelInputs channel_inputs() const {
    cl::ChannelInputs in;
    in.q = phq_.p;
    in.k = phk_.p;
    in.v = v_.p;
    in.g = g_.ptr<float>();
    return in;
  }
  cl::GateArgs gate_args() const {
    cl::GateArgs a;
    a.map = cl::GateMap::logsig16;
    a.N = f_.size(0);
    a.C = s_.CF;
    a.f = f_.ptr<float>();
    a.ldf = s_.CF;
    a.bias = P_[sl_.gb].ptr<float>();
    a.per_head = 1;
    return a;
  }
  bf16* bound_bf() const { return static_cast<bf16*>(bound_.data); }
  bool act_bf16() const { return at_ == DType::bf16; }
  std::size_t act_bytes() const { return at_ == DType::bf16 ? 2 : 4; }
  void* pcol(const Tensor& t, int64_t col) const { return static_cast<char*>(t.data) + col * act_bytes(); }

  cl::SsmConvArgs conv_args(int64_t col, int64_t C, int wslot, const Tensor& zero_bias) const {
    cl::SsmConvArgs a;
    a.B = B_;
    a.T = T_;
    a.C = static_cast<int>(C);
    a.W = s_.W;
    a.p = pcol(P_proj_, col);
    a.p_bf16 = act_bf16();
    a.ldp = ldp_;
    a.w = P_[wslot].ptr<float>();
    a.bias = zero_bias.ptr<float>();
    return a;
  }
  void conv_bwd(kernels::Arena& ar, cudaStream_t st, int64_t col, int64_t C, int wslot, const Tensor& zb,
                const Tensor& dbias, const void* da, bool da_bf16, const Tensor& dP) {
    const cl::SsmConvArgs a = conv_args(col, C, wslot, zb);
    Tensor scratch = ar.alloc(DType::f32, {(int64_t)cl::ssm_conv_silu_backward_scratch_floats(a)});
    cl::ssm_conv_silu_backward(a, da, da_bf16, pcol(dP, col), G_[wslot].ptr<float>(), dbias.ptr<float>(),
                               scratch.ptr<float>(), st);
  }

  // One map's backward: dx = ∂L/∂(a + u + b) [R, dk]; da = dx (I + Δ); dΔ += dxᵀ a; db += Σ dx.
  void map_backward(kernels::Backend& be, kernels::Arena& ar, cudaStream_t st, const Tensor& u, const Tensor& a,
                    int wslot, int bslot, const Bf& dphi, const Tensor& da) {
    const int64_t R = a.size(0);
    Tensor dxm = ar.alloc(DType::f32, {R, s_.dk});
    {
      cl::LayerTimer tm("gla_hedgehog: feature map (bwd)", st);
      cl::hedgehog_map_backward(R, s_.dk, u.ptr<float>(), a.ptr<float>(), P_[bslot].ptr<float>(), dphi.p, Fp_,
                                dxm.ptr<float>(), da.ptr<float>(), st);
    }
    be.gemm(dxm, false, P_[wslot], false, da, 1.0, 1.0);
    be.gemm(dxm, true, a, false, G_[wslot], 1.0, 1.0);
    colsum(ar, st, dxm, bslot);
  }

  // G[slot][j] += Σ_n M[n, j] (deterministic).
  void colsum(kernels::Arena& ar, cudaStream_t st, const Tensor& M, int slot) const {
    cl::colsum_into(ar, st, M, 1, G_[slot].ptr<float>(), "gla_hedgehog: parameter sums");
  }

  // t in act_dtype(): t itself, or a converted copy in the arena.
  Tensor as_act(kernels::Backend& be, kernels::Arena& ar, const Tensor& t) const {
    return cl::as_dtype(be, ar, t, at_);
  }

  HedgehogShape s_;
  HedgehogSlots sl_;
  std::vector<Tensor> P_, G_;
  int64_t Fp_ = 64, dvp_ = 64, ldp_ = 0;
  Tensor Wqkv_, Gqkv_;  // [Wq; Wk; Wv] and its gradient, [ldp_, d]
  // this step's cache (arena tensors, valid until the next forward)
  int64_t B_ = 0, T_ = 0;
  DType at_ = DType::f32;
  cl::KernelChoice kernels_;
  Tensor X_, P_proj_, aq_, ak_, uq_, uk_, h1_, f_, g_, og_, bound_, rstd_;
  Bf phq_, phk_, v_, o_, oc_;
};

std::unique_ptr<CudaHedgehog> make_cuda_hedgehog(const HedgehogShape& s, const HedgehogSlots& sl,
                                                 const std::vector<Tensor>& params, const std::vector<Tensor>& grads) {
  return std::make_unique<CudaHedgehogImpl>(s, sl, params, grads);
}

// The trainer builds the layer through this factory (cuda_hedgehog_factory, hedgehog_layer.hpp); a build
// without CUDA has no factory, and the mixer says so.
[[maybe_unused]] const bool kRegistered = (cuda_hedgehog_factory() = &make_cuda_hedgehog, true);

}  // namespace

}  // namespace lar::trainer::mixers
