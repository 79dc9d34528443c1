// The Mamba-2 layer (see mamba2_mixer.cpp for the math and the CPU reference) on the CUDA
// backend. Same parameters, layout and results as the CPU path within bf16 rounding:
//   [z | x | B | C] = x [W_z; W_x; W_B; W_C]ᵀ    one GEMM (the four are adjacent in the flat
//                                               buffer); dt = x W_dtᵀ in fp32 (its own GEMM)
//   x, B, C ← SiLU(conv + bias)                 ssm_conv_silu_forward (kernels/ssm/
//                                               mamba2_ops.hpp): x fp32, B and C bf16, already
//                                               in the kernels' [B,T,G,N] layout
//   Δ·x (bf16), a = −exp(A_log)·Δ broadcast     mamba2_gates_forward
//   o = gla channel kernel(q = C, k = B, v = Δ·x, g = a on every key channel, scale 1)
//                                               grouped_channel_fwd: the G groups are the key
//                                               heads, the H heads the value heads (grouped_
//                                               heads.hpp; state sizes of 128 and 256 take the
//                                               recurrent wide-key kernels, not the key-block
//                                               split: key_split_gate.hpp, kSsmKeySplitVerified)
//   y = RMSNorm_G((o + D·x) ⊙ SiLU(z)) W_oᵀ      mamba2_out_forward, then the out GEMM
// The channel kernel's gate gradient is per key channel; mamba2_gates_backward sums it over
// the state's N channels for the scalar gate. Parameter gradients: GEMMs (beta = 1) and the
// deterministic column sums of layer_ops.hpp. Kept from forward to backward: the projection
// [z | x | B | C] (act_dtype), dt's pre-activation, o, the boundary states and the norm's rstd;
// the conv outputs, Δ·x and the [N, H·N] gate are recomputed in the backward.
// Decode (init_state/step, one token of B sequences a call; gated by kSsmDecodeCudaVerified):
// the same GEMMs, gates and output as a forward at T = 1; the conv runs over the window of the
// last W projection rows (ssm_decode.hpp) and keeps its last row; the recurrence is the
// gla channel decode (grouped_channel_decode; the wide-key decode at states of 128 and 256) on
// the fp32 state [B, H, P, N] (the CPU layer's layout).
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
#include "kernels/ssm/mamba2_ops.hpp"
#include "trainer/mixers/mamba2_layer.hpp"

namespace lar::trainer::mixers {

namespace {

namespace cl = lar::kernels::cuda::linear;
using bf16 = __nv_bfloat16;
using kernels::DType;
using kernels::Tensor;

using cuda_layer::kNormEps;
using cuda_layer::kernel_choice;

using kernels::cuda::linear::Bf;
using kernels::cuda::linear::bf_alloc;

class CudaMamba2Impl final : public CudaMamba2 {
 public:
  CudaMamba2Impl(const MambaShape& s, int W, const Mamba2Slots& sl, const std::vector<Tensor>& p,
                 const std::vector<Tensor>& g)
      : s_(s), W_(W), sl_(sl), P_(p), G_(g) {
    if (const std::string why = cuda_mamba2_unsupported(s_, W_); !why.empty()) throw UserError(why);
    Di_ = s_.Di;
    GN_ = s_.G * s_.N;
    ldp_ = 2 * Di_ + 2 * GN_;
    // one GEMM for z, x, B, C: their weights (and gradients) must be adjacent
    const auto slots = {sl_.wz, sl_.wx, sl_.wB, sl_.wC};
    if (!cuda_layer::adjacent(P_, slots) || !cuda_layer::adjacent(G_, slots))
      throw RuntimeError("mamba2 mixer (cuda): w_z, w_x, w_B, w_C are not adjacent in the parameter buffer");
    Wcat_ = Tensor(P_[sl_.wz].data, DType::f32, {ldp_, s_.d});
    Gcat_ = Tensor(G_[sl_.wz].data, DType::f32, {ldp_, s_.d});
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
    pdt_ = ar.alloc(DType::f32, {N, s_.H});
    o_ = bf_alloc(ar, N * Di_);
    const std::size_t bb = cl::grouped_channel_boundary_bytes(cl::ChannelMixer::gla, gshape());
    bound_ = ar.alloc(DType::f32, {(int64_t)(bb + 3) / 4});
    rstd_ = ar.alloc(DType::f32, {N * s_.G});
    const auto mark = ar.mark();
    const Tensor Xa = as_act(be, ar, X_);
    be.gemm(Xa, false, Wcat_, true, P_proj_);
    be.gemm(Xa, false, P_[sl_.wdt], true, pdt_);
    inputs(ar, st, N);
    {
      cl::LayerTimer tm("mamba2: channel_fwd", st);
      cl::grouped_channel_fwd(cl::ChannelMixer::gla, gshape(), channel_inputs(), o_.p, nullptr, bound_bf(), st);
    }
    Tensor ypre = ar.alloc(at_, {N, Di_});
    {
      cl::LayerTimer tm("mamba2: out norm+gate (fwd)", st);
      cl::mamba2_out_forward(out_args(N), ypre.data, rstd_.ptr<float>(), st);
    }
    be.gemm(ypre, false, P_[sl_.wo], true, y.view({N, s_.d}));
    ar.release(mark);
  }

  void backward(ForwardContext& ctx, const Tensor& dy, const Tensor& dx) override {
    auto& be = ctx.be;
    auto& ar = ctx.arena;
    cudaStream_t st = stream(be);
    const int64_t N = B_ * T_;
    kernels_ = kernel_choice(be);
    const Tensor dX = dx.view({N, s_.d});
    const auto mark = ar.mark();
    const Tensor Xa = as_act(be, ar, X_);
    const Tensor dY = as_act(be, ar, dy.view({N, s_.d}));
    inputs(ar, st, N);  // the conv outputs, Δ·x and the gate again
    // y = ypre W_oᵀ; the norm × gate backward writes ypre again for W_o's gradient
    Tensor dypre = ar.alloc(at_, {N, Di_});
    be.gemm(dY, false, P_[sl_.wo], false, dypre);
    Tensor ypre = ar.alloc(at_, {N, Di_});
    Bf dO = bf_alloc(ar, N * Di_);
    Tensor dP = ar.alloc(at_, {N, ldp_});  // ∂L/∂[z | x | B | C]
    Tensor dax = ar.alloc(DType::f32, {N, Di_});
    {
      Tensor wterm = ar.alloc(DType::f32, {N, Di_});
      Tensor dterm = ar.alloc(DType::f32, {N, Di_});
      {
        cl::LayerTimer tm("mamba2: out norm+gate (bwd)", st);
        cl::mamba2_out_backward(out_args(N), rstd_.ptr<float>(), dypre.data, dO.p, dP.data, dax.ptr<float>(),
                                wterm.ptr<float>(), dterm.ptr<float>(), ypre.data, st);
      }
      colsum(ar, st, wterm, 1, sl_.norm);
      colsum(ar, st, dterm, s_.P, sl_.D);
    }
    be.gemm(dY, true, ypre, false, G_[sl_.wo], 1.0, 1.0);
    // the recurrence: dq on C, dk on B (summed over each group's heads), dv on Δ·x, dg per channel
    Bf dC = bf_alloc(ar, N * GN_), dB = bf_alloc(ar, N * GN_), dv = bf_alloc(ar, N * Di_);
    Tensor dg = ar.alloc(DType::f32, {N, (int64_t)s_.H * s_.N});
    {
      cl::LayerTimer tm("mamba2: channel_bwd", st);
      cl::ChannelGrads cg;
      cg.dq = dC.p;
      cg.dk = dB.p;
      cg.dv = dv.p;
      cg.dg = dg.ptr<float>();
      cl::grouped_channel_bwd(cl::ChannelMixer::gla, gshape(), channel_inputs(), bound_bf(), dO.p, nullptr, cg, st);
    }
    Tensor ddt = ar.alloc(DType::f32, {N, s_.H});
    Tensor aterm = ar.alloc(DType::f32, {N, s_.H});
    {
      cl::LayerTimer tm("mamba2: gates (bwd)", st);
      cl::mamba2_gates_backward(gate_args(N), dv.p, dg.ptr<float>(), dax.ptr<float>(), ddt.ptr<float>(),
                                aterm.ptr<float>(), st);
    }
    colsum(ar, st, ddt, 1, sl_.dt_bias);
    colsum(ar, st, aterm, 1, sl_.A_log);
    // conv + SiLU backward of x, B, C into their columns of dP
    {
      cl::LayerTimer tm("mamba2: conv+silu (bwd)", st);
      conv_bwd(ar, st, Di_, Di_, sl_.cx, sl_.bx, dax.data, false, dP);
      conv_bwd(ar, st, 2 * Di_, GN_, sl_.cB, sl_.bB, dB.p, true, dP);
      conv_bwd(ar, st, 2 * Di_ + GN_, GN_, sl_.cC, sl_.bC, dC.p, true, dP);
    }
    // the projections: dx overwritten by the first
    be.gemm(dP, true, Xa, false, Gcat_, 1.0, 1.0);
    be.gemm(dP, false, Wcat_, false, dX, 1.0, 0.0);
    be.gemm(ddt, true, Xa, false, G_[sl_.wdt], 1.0, 1.0);
    be.gemm(ddt, false, P_[sl_.wdt], false, dX, 1.0, 1.0);
    ar.release(mark);
  }

  std::unique_ptr<MixerState> init_state(kernels::Backend& be, int batch) override {
    cudaStream_t st = stream(be);
    if (batch < 1) throw RuntimeError("mamba2 mixer (cuda): init_state for a batch of " + std::to_string(batch));
    const DType at = be.act_dtype();
    const std::size_t s_bytes = SsmCudaState::rounded((std::size_t)batch * s_.H * s_.P * s_.N * 4);
    const std::size_t w_bytes = SsmCudaState::rounded((std::size_t)batch * W_ * ldp_ * kernels::dtype_size(at));
    auto s = std::make_unique<SsmCudaState>(be, s_bytes + 2 * w_bytes);
    LAR_CUDA_CHECK(cudaMemsetAsync(s->mem, 0, s->bytes, st));
    s->B = batch;
    s->at = at;
    s->window = W_;
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
    SsmCudaState& s = ssm_decode_state("mamba2 mixer (cuda)", state, x, s_.d, at_);
    kernels_ = kernel_choice(be);
    const int64_t B = s.B;
    const auto mark = ar.mark();
    const Tensor Xa = as_act(be, ar, x);
    const Tensor Ptok = ar.alloc(at_, {B, ldp_});
    be.gemm(Xa, false, Wcat_, true, Ptok);
    pdt_ = ar.alloc(DType::f32, {B, s_.H});
    be.gemm(Xa, false, P_[sl_.wdt], true, pdt_);
    // the conv over the window (a sequence of W tokens), its last row kept
    B_ = B, T_ = W_;
    P_proj_ = Tensor(s.push(Ptok.data, st), at_, {B * W_, ldp_});
    {
      cl::LayerTimer tm("mamba2: conv+silu (decode)", st);
      const Tensor axw = ar.alloc(DType::f32, {B * W_, Di_});
      const Bf aBw = bf_alloc(ar, B * W_ * GN_), aCw = bf_alloc(ar, B * W_ * GN_);
      cl::ssm_conv_silu_forward(conv_args(Di_, Di_, sl_.cx, sl_.bx), axw.data, false, st);
      cl::ssm_conv_silu_forward(conv_args(2 * Di_, GN_, sl_.cB, sl_.bB), aBw.p, true, st);
      cl::ssm_conv_silu_forward(conv_args(2 * Di_ + GN_, GN_, sl_.cC, sl_.bC), aCw.p, true, st);
      ax_ = ar.alloc(DType::f32, {B, Di_});
      aB_ = bf_alloc(ar, B * GN_);
      aC_ = bf_alloc(ar, B * GN_);
      ssm_last_rows(axw.data, ax_.data, (std::size_t)Di_ * 4, W_, B, st);
      ssm_last_rows(aBw.p, aB_.p, (std::size_t)GN_ * 2, W_, B, st);
      ssm_last_rows(aCw.p, aC_.p, (std::size_t)GN_ * 2, W_, B, st);
    }
    T_ = 1;
    P_proj_ = Ptok;  // z: the token's first Di columns
    v_ = bf_alloc(ar, B * Di_);
    g_ = ar.alloc(DType::f32, {B, (int64_t)s_.H * s_.N});
    {
      cl::LayerTimer tm("mamba2: gates (decode)", st);
      cl::mamba2_gates_forward(gate_args(B), v_.p, g_.ptr<float>(), st);
    }
    o_ = bf_alloc(ar, B * Di_);
    {
      cl::LayerTimer tm("mamba2: channel decode", st);
      cl::grouped_channel_decode(cl::ChannelMixer::gla, gshape(), channel_inputs(), s.S, o_.p, st);
    }
    rstd_ = ar.alloc(DType::f32, {B * s_.G});
    Tensor ypre = ar.alloc(at_, {B, Di_});
    {
      cl::LayerTimer tm("mamba2: out norm+gate (decode)", st);
      cl::mamba2_out_forward(out_args(B), ypre.data, rstd_.ptr<float>(), st);
    }
    be.gemm(ypre, false, P_[sl_.wo], true, y.view({B, s_.d}));
    ++s.pos;
    ar.release(mark);
  }

 private:
  static cudaStream_t stream(kernels::Backend& be) { return cuda_layer::stream(be, "mamba2 mixer"); }
  cl::GroupedShape gshape() const {
    cl::GroupedShape g;
    g.B = B_;
    g.T = T_;
    g.H = s_.H;
    g.Hk = s_.G;
    g.dk = s_.N;
    g.dv = s_.P;
    g.scale = 1.0;
    g.kernels = kernels_;
    g.key_split = cl::ssm_key_split_open();
    return g;
  }
  bf16* bound_bf() const { return static_cast<bf16*>(bound_.data); }
  bool act_bf16() const { return at_ == DType::bf16; }
  std::size_t act_bytes() const { return at_ == DType::bf16 ? 2 : 4; }
  // P's columns from `col` on (row stride ldp_)
  void* pcol(const Tensor& t, int64_t col) const { return static_cast<char*>(t.data) + col * act_bytes(); }

  cl::SsmConvArgs conv_args(int64_t col, int64_t C, int wslot, int bslot) const {
    cl::SsmConvArgs a;
    a.B = B_;
    a.T = T_;
    a.C = static_cast<int>(C);
    a.W = W_;
    a.p = pcol(P_proj_, col);
    a.p_bf16 = act_bf16();
    a.ldp = ldp_;
    a.w = P_[wslot].ptr<float>();
    a.bias = P_[bslot].ptr<float>();
    return a;
  }
  void conv_bwd(kernels::Arena& ar, cudaStream_t st, int64_t col, int64_t C, int wslot, int bslot, const void* da,
                bool da_bf16, const Tensor& dP) {
    const cl::SsmConvArgs a = conv_args(col, C, wslot, bslot);
    Tensor scratch = ar.alloc(DType::f32, {(int64_t)cl::ssm_conv_silu_backward_scratch_floats(a)});
    cl::ssm_conv_silu_backward(a, da, da_bf16, pcol(dP, col), G_[wslot].ptr<float>(), G_[bslot].ptr<float>(),
                               scratch.ptr<float>(), st);
  }
  cl::Mamba2GateArgs gate_args(int64_t N) const {
    cl::Mamba2GateArgs a;
    a.N = N;
    a.H = s_.H;
    a.P = s_.P;
    a.S = s_.N;
    a.pdt = pdt_.ptr<float>();
    a.dt_bias = P_[sl_.dt_bias].ptr<float>();
    a.A_log = P_[sl_.A_log].ptr<float>();
    a.x = ax_.ptr<float>();
    return a;
  }
  cl::Mamba2OutArgs out_args(int64_t N) const {
    cl::Mamba2OutArgs a;
    a.N = N;
    a.H = s_.H;
    a.P = s_.P;
    a.G = s_.G;
    a.o = o_.p;
    a.x = ax_.ptr<float>();
    a.D = P_[sl_.D].ptr<float>();
    a.z = P_proj_.data;  // z: P's first Di columns
    a.ldz = ldp_;
    a.wn = P_[sl_.norm].ptr<float>();
    a.eps = kNormEps;
    a.act_bf16 = act_bf16();
    return a;
  }
  cl::ChannelInputs channel_inputs() const {
    cl::ChannelInputs in;
    in.q = aC_.p;
    in.k = aB_.p;
    in.v = v_.p;
    in.g = g_.ptr<float>();
    return in;
  }

  // From the kept projections: the conv outputs x (fp32), B, C (bf16), the value Δ·x and the
  // broadcast log-gate, in the arena above the caller's mark (the same values every call).
  void inputs(kernels::Arena& ar, cudaStream_t st, int64_t N) {
    ax_ = ar.alloc(DType::f32, {N, Di_});
    aB_ = bf_alloc(ar, N * GN_);
    aC_ = bf_alloc(ar, N * GN_);
    v_ = bf_alloc(ar, N * Di_);
    g_ = ar.alloc(DType::f32, {N, (int64_t)s_.H * s_.N});
    {
      cl::LayerTimer tm("mamba2: conv+silu (fwd)", st);
      cl::ssm_conv_silu_forward(conv_args(Di_, Di_, sl_.cx, sl_.bx), ax_.data, false, st);
      cl::ssm_conv_silu_forward(conv_args(2 * Di_, GN_, sl_.cB, sl_.bB), aB_.p, true, st);
      cl::ssm_conv_silu_forward(conv_args(2 * Di_ + GN_, GN_, sl_.cC, sl_.bC), aC_.p, true, st);
    }
    cl::LayerTimer tm("mamba2: gates (fwd)", st);
    cl::mamba2_gates_forward(gate_args(N), v_.p, g_.ptr<float>(), st);
  }

  // out[j] += Σ_n Σ_{c in group j} M[n, c] into the gradient of slot (deterministic).
  void colsum(kernels::Arena& ar, cudaStream_t st, const Tensor& M, int group, int slot) const {
    cl::colsum_into(ar, st, M, group, G_[slot].ptr<float>(), "mamba2: parameter sums");
  }

  // t in act_dtype(): t itself, or a converted copy in the arena.
  Tensor as_act(kernels::Backend& be, kernels::Arena& ar, const Tensor& t) const {
    return cl::as_dtype(be, ar, t, at_);
  }

  MambaShape s_;
  int W_;
  Mamba2Slots sl_;
  std::vector<Tensor> P_, G_;
  int64_t Di_ = 0, GN_ = 0, ldp_ = 0;
  Tensor Wcat_, Gcat_;  // [W_z; W_x; W_B; W_C] and its gradient, [ldp_, d]
  // this step's cache (arena tensors, valid until the next forward)
  int64_t B_ = 0, T_ = 0;
  DType at_ = DType::f32;
  cl::KernelChoice kernels_;
  Tensor X_, P_proj_, pdt_, bound_, rstd_;
  Bf o_;
  // recomputed in forward and backward (above their marks)
  Tensor ax_, g_;
  Bf aB_, aC_, v_;
};

std::unique_ptr<CudaMamba2> make_cuda_mamba2(const MambaShape& s, int conv_size, const Mamba2Slots& sl,
                                             const std::vector<Tensor>& params, const std::vector<Tensor>& grads) {
  return std::make_unique<CudaMamba2Impl>(s, conv_size, sl, params, grads);
}

// The trainer builds the layer through this factory (cuda_mamba2_factory, mamba2_layer.hpp); a build
// without CUDA has no factory, and the mixer says so.
[[maybe_unused]] const bool kRegistered = (cuda_mamba2_factory() = &make_cuda_mamba2, true);

}  // namespace

}  // namespace lar::trainer::mixers
