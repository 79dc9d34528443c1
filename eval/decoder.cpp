#include "eval/decoder.hpp"

#include "core/error.hpp"

namespace lar::eval {

using kernels::DType;
using kernels::Tensor;

namespace {
constexpr double kNormEps = 1e-5;  // the model's (trainer/model.cpp)
}

struct Decoder::Impl {
  trainer::Model& model;
  kernels::Backend& be;
  int B;
  kernels::Arena arena;
  struct Layer {
    int norm1 = -1, norm2 = -1, w_gate = -1, w_down = -1, route_p = -1, route_u = -1, route_d = -1;
    int prev = -1;  // the nearest lower layer that publishes a side channel
  };
  std::vector<Layer> layers;
  std::vector<std::unique_ptr<trainer::MixerState>> states;
  int embed, final_norm, head;

  Impl(trainer::Model& m, int batch, int max_len) : model(m), be(m.backend()), B(batch), arena(m.backend()) {
    auto& ps = m.params();
    auto find = [&](const std::string& name) {
      for (size_t i = 0; i < ps.table().size(); ++i)
        if (ps.table()[i].name == name) return static_cast<int>(i);
      return -1;
    };
    embed = ps.index_of("embed");
    final_norm = ps.index_of("final_norm");
    head = ps.index_of("head");
    const auto& shape = m.shape();
    int last = -1;
    for (int l = 0; l < shape.n_layers; ++l) {
      const std::string pre = "layers." + std::to_string(l) + ".";
      Layer ly;
      ly.norm1 = ps.index_of(pre + "norm1");
      ly.norm2 = ps.index_of(pre + "norm2");
      ly.w_gate = ps.index_of(pre + "ffn.w_gate");
      ly.w_down = ps.index_of(pre + "ffn.w_down");
      ly.route_p = find(pre + "route_p");
      ly.route_u = find(pre + "route_u");
      ly.route_d = find(pre + "route_d");
      ly.prev = shape.routing == "none" ? -1 : last;
      if (m.mixers()[l]->publishes() && shape.routing != "none") last = l;
      layers.push_back(ly);
      states.push_back(m.mixers()[l]->init_state(be, batch, max_len));
    }
  }

  std::vector<int32_t> step(const std::vector<int32_t>& tokens, const std::vector<int32_t>* next,
                            std::vector<double>* next_lp) {
    auto& ps = model.params();
    const auto& shape = model.shape();
    const DType dt = be.dtype(), at = be.act_dtype();
    const int64_t d = shape.d_model, F = shape.d_ff, V = shape.vocab;
    if (static_cast<int>(tokens.size()) != B) throw RuntimeError("decoder: one token per row expected");
    arena.reset();
    Tensor ids = arena.alloc(DType::i32, {B});
    be.upload(tokens.data(), ids);
    Tensor h = arena.alloc(dt, {B, d}), h1 = arena.alloc(dt, {B, d});
    be.embedding_fwd(ids, ps.param(embed), h);
    Tensor xn = arena.alloc(at, {B, d}), rstd = arena.alloc(dt, {B}), y = arena.alloc(at, {B, d});
    Tensor gu = arena.alloc(at, {B, 2 * F}), act = arena.alloc(at, {B, F}), ffn = arena.alloc(at, {B, d});
    std::vector<trainer::Routing> route(layers.size());
    trainer::ForwardContext ctx{be, arena, false};
    for (size_t l = 0; l < layers.size(); ++l) {
      const Layer& ly = layers[l];
      if (l == 0) be.rmsnorm_fwd(h, ps.param(ly.norm1), xn, rstd, kNormEps);
      else be.add_rmsnorm_fwd(h1, ffn, h, ps.param(ly.norm1), xn, rstd, kNormEps);  // h = h1 + ffn
      if (ly.prev >= 0) route[l].in = route[static_cast<size_t>(ly.prev)].out;
      model.mixers()[l]->step(ctx, xn, y, *states[l], route[l]);
      Tensor xn2 = arena.alloc(at, {B, d});
      be.add_rmsnorm_fwd(h, y, h1, ps.param(ly.norm2), xn2, rstd, kNormEps);  // h1 = h + y
      if (ly.route_p >= 0 || ly.route_d >= 0) {
        const Tensor& side = route[l].out;
        if (side.empty()) throw RuntimeError("layer " + std::to_string(l) + " published no side channel in step()");
        if (ly.route_p >= 0) be.gemm(side, false, ps.param(ly.route_p), true, h1, 1.0, 1.0);
        if (ly.route_d >= 0) {
          const Tensor& D = ps.param(ly.route_d);
          Tensor low = arena.alloc(dt, {B, D.size(0)});
          be.gemm(side, false, D, true, low);
          be.gemm(low, false, ps.param(ly.route_u), true, h1, 1.0, 1.0);
        }
        be.rmsnorm_fwd(h1, ps.param(ly.norm2), xn2, rstd, kNormEps);
      }
      Tensor w_gu(ps.param(ly.w_gate).data, dt, {2 * F, d});
      be.gemm(xn2, false, w_gu, true, gu);
      be.swiglu_fwd(gu, act);
      be.gemm(act, false, ps.param(ly.w_down), true, ffn);
    }
    Tensor xnf = arena.alloc(at, {B, d});
    be.add_rmsnorm_fwd(h1, ffn, h, ps.param(final_norm), xnf, rstd, kNormEps);
    Tensor logits = arena.alloc(at, {B, V});
    be.gemm(xnf, false, ps.param(head), true, logits);
    std::vector<int32_t> tg(static_cast<size_t>(B), 0);
    if (next) tg = *next;
    Tensor targets = arena.alloc(DType::i32, {B});
    be.upload(tg.data(), targets);
    Tensor mask = arena.alloc(dt, {B}), losses = arena.alloc(dt, {B}), amax = arena.alloc(DType::i32, {B});
    if (dt == DType::f64) {
      std::vector<double> one(static_cast<size_t>(B), 1.0);
      be.upload(one.data(), mask);
    } else {
      std::vector<float> one(static_cast<size_t>(B), 1.f);
      be.upload(one.data(), mask);
    }
    be.cross_entropy_fwd(logits, targets, mask, losses, amax);
    std::vector<int32_t> out(static_cast<size_t>(B));
    be.download(amax, out.data());
    if (next_lp) {
      next_lp->resize(static_cast<size_t>(B));
      if (dt == DType::f64) {
        be.download(losses, next_lp->data());
      } else {
        std::vector<float> l(static_cast<size_t>(B));
        be.download(losses, l.data());
        for (int r = 0; r < B; ++r) (*next_lp)[static_cast<size_t>(r)] = l[static_cast<size_t>(r)];
      }
      for (auto& v : *next_lp) v = -v;
    }
    return out;
  }
};

Decoder::Decoder(trainer::Model& model, int batch, int max_len) : impl_(std::make_unique<Impl>(model, batch, max_len)) {}
Decoder::~Decoder() = default;

std::vector<int32_t> Decoder::step(const std::vector<int32_t>& tokens, const std::vector<int32_t>* next,
                                   std::vector<double>* next_logprob) {
  auto r = impl_->step(tokens, next, next_logprob);
  ++pos_;
  return r;
}

}  // namespace lar::eval
