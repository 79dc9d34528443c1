#include "trainer/model.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace lar::trainer {

using kernels::DType;
using kernels::Tensor;

namespace {
constexpr double kNormEps = 1e-5;
// Rows of logits per head/cross-entropy chunk: at most 512 MB of logits (2^27 in f32, 2^28
// in bf16) live at once instead of N·V (4.2 GB at B=8, T=4096, V=32000 in f32).
constexpr int64_t kLogitBytesPerChunk = int64_t(1) << 29;

int get_int(const json& j, const char* key) { return j.at(key).get<int>(); }
}  // namespace

ModelShape model_shape(const json& model) {
  ModelShape s;
  s.n_layers = get_int(model, "n_layers");
  s.d_model = get_int(model, "d_model");
  s.d_ff = get_int(model, "d_ff");
  if (s.d_ff <= 0) s.d_ff = (s.d_model * 8 / 3 + 31) / 32 * 32;
  s.vocab = get_int(model, "vocab_size");
  s.kinds = layer_kinds(model);
  s.routing = model.at("routing").get<std::string>();
  return s;
}

void validate_model_config(const json& config) {
  const json& m = config.at("model");
  auto positive = [&](const json& sec, const std::string& prefix, const char* key) {
    long v = sec.at(key).get<long>();
    if (v <= 0) throw UserError(prefix + key + ": must be > 0, got " + std::to_string(v));
    return v;
  };
  auto non_negative = [&](const json& sec, const std::string& prefix, const char* key) {
    long v = sec.at(key).get<long>();
    if (v < 0) throw UserError(prefix + key + ": must be ≥ 0, got " + std::to_string(v));
    return v;
  };
  positive(m, "model.", "n_layers");
  long d = positive(m, "model.", "d_model");
  long h = positive(m, "model.", "n_heads");
  long kv = non_negative(m, "model.", "n_kv_heads");
  long hd = non_negative(m, "model.", "head_dim");
  non_negative(m, "model.", "value_dim");
  non_negative(m, "model.", "d_ff");
  non_negative(m, "model.", "window");
  non_negative(m, "model.", "routing_rank");
  positive(m, "model.", "hybrid_ratio");
  positive(m, "model.", "chunk_size");
  if (positive(m, "model.", "vocab_size") < 2) throw UserError("model.vocab_size: must be ≥ 2");
  if (hd == 0 && d % h != 0)
    throw UserError("model.d_model: " + std::to_string(d) + " is not divisible by model.n_heads = " +
                    std::to_string(h));
  if (kv > 0 && h % kv != 0)
    throw UserError("model.n_heads: " + std::to_string(h) + " is not divisible by model.n_kv_heads = " +
                    std::to_string(kv) + " (GQA groups)");
  // The linear layers' own head layout (ignored, like value_dim, by a model without one).
  const long lh = non_negative(m, "model.", "linear_heads");
  const long nv = non_negative(m, "model.", "n_v_heads");
  non_negative(m, "model.", "linear_head_dim");
  const long key_heads = lh > 0 ? lh : h;
  bool any_linear = false;
  for (const auto& k : layer_kinds(m)) any_linear = any_linear || k != "softmax";
  if (any_linear && nv > 0 && nv % key_heads != 0)
    throw UserError("model.n_v_heads: " + std::to_string(nv) + " is not a multiple of the " + std::to_string(key_heads) +
                    " query/key heads of the linear layers (" + (lh > 0 ? "model.linear_heads" : "model.n_heads") + ")");
  if (m.at("rope_base").get<double>() <= 0) throw UserError("model.rope_base: must be > 0");
  if (m.at("init_std").get<double>() < 0) throw UserError("model.init_std: must be ≥ 0");
  auto kinds = layer_kinds(m);
  for (std::size_t l = 0; l < kinds.size(); ++l) {
    MixerConfig mc = mixer_config(m, static_cast<int>(l));
    if (kinds[l] == "softmax" && mc.head_dim % 2 != 0)
      throw UserError("model.head_dim: RoPE needs an even head dimension, got " + std::to_string(mc.head_dim) +
                      (hd == 0 ? " (model.d_model / model.n_heads)" : ""));
    if (!mixer_registered(kinds[l])) {
      std::string all;
      for (const auto& k : registered_mixers()) all += (all.empty() ? "" : ", ") + k;
      throw UserError("model.architecture: mixer '" + kinds[l] + "' is not implemented in this build (available: " +
                      all + ")");
    }
  }
  const json& data = config.at("data");
  positive(data, "data.", "seq_len");
  positive(data, "data.", "batch_size");
  positive(config.at("budget"), "budget.", "steps");
  non_negative(config.at("eval"), "eval.", "every");
  non_negative(config.at("eval"), "eval.", "batches");
  non_negative(config.at("checkpoint"), "checkpoint.", "every");
  positive(config.at("checkpoint"), "checkpoint.", "keep");
  positive(config.at("log"), "log.", "every");
  non_negative(config, "", "threads");
  if (config.at("budget").at("tokens").get<double>() < 0) throw UserError("budget.tokens: must be ≥ 0");
}

// Parameter indices of one block.
struct Model::Layer {
  int norm1 = -1, norm2 = -1, w_gate = -1, w_up = -1, w_down = -1;
  // cler_h / clvr: P_l [d, side] (full rank), or P_l = U_l·D_l with U_l [d, r] random and
  // D_l [r, side] zero (model.routing_rank = r > 0): only one factor is zeroed, so D_l
  // learns from the first step.
  int route_p = -1, route_u = -1, route_d = -1;
  // model.routing_inject: layer — the projection adds to the stream after the FFN (h2), not
  // after the mixer (h1)
  bool inject_after_ffn = false;
  std::vector<int> mixer_params;
  int prev_linear = -1;  // p(l): the nearest lower layer that publishes a side channel
};

// Activations of one forward pass (arena tensors), kept for backward.
struct Model::Acts {
  int B = 0, T = 0;
  int64_t N = 0;
  double mask_sum = 0;
  Tensor ids, targets, mask;
  // Residual stream (dtype()): h[2l] block input, h[2l+1] after the mixer — stored only for
  // layers with a routing projection; elsewhere the backward forms h[2l] + ymix[l] again.
  std::vector<Tensor> h;
  std::vector<Tensor> ymix;              // the mixers' outputs (act_dtype()), kept for backward
  // xn2, gu, act (and xnf) have the backend's act_dtype() (bf16 on the GPU in mixed
  // precision); act is kept only when act_dtype() == dtype(), else recomputed in backward.
  std::vector<Tensor> rstd1, xn1, rstd2, xn2, gu, act;
  Tensor mix_y;                          // the FFNs' output (act_dtype()), and mixer outputs not kept
  Tensor act_tmp;                        // silu(gate)·up of one layer when act is not kept
  std::vector<Routing> route;
  std::vector<Tensor> route_low;         // low-rank routing: side·D_lᵀ [N, r]
  Tensor hf, rstdf, xnf, losses, argmax;
  Tensor dxnf;                           // ∂L/∂xnf, computed chunk by chunk in the forward (training)
};

Model::Model(const json& config, kernels::Backend& be)
    : be_(be), config_(config), shape_(model_shape(config.at("model"))) {
  params_ = std::make_unique<ParamStore>(be_);
  arena_ = std::make_unique<kernels::Arena>(be_);
  const json& m = config.at("model");
  const int d = shape_.d_model, F = shape_.d_ff, L = shape_.n_layers;
  const double std_ = m.at("init_std").get<double>();
  // Output projections of residual branches are scaled down by 1/sqrt(2L) (GPT-2).
  const double out_std = std_ / std::sqrt(2.0 * L);
  auto& ps = *params_;
  embed_ = ps.add({"embed", {shape_.vocab, d}, ParamKind::embedding, InitRule::Normal(std_)}, "", -1);
  layers_.resize(L);
  int last_publisher = -1;
  for (int l = 0; l < L; ++l) {
    Layer& ly = layers_[l];
    const std::string pre = "layers." + std::to_string(l) + ".";
    ly.norm1 = ps.add({"norm1", {d}, ParamKind::norm, InitRule::Constant(1.0)}, pre, l);
    MixerConfig mc = mixer_config(m, l);
    mixers_.push_back(make_mixer(mc));
    for (const auto& spec : mixers_.back()->params()) ly.mixer_params.push_back(ps.add(spec, pre + "mixer.", l));
    ly.prev_linear = shape_.routing == "none" ? -1 : last_publisher;
    if (mixers_.back()->publishes() && shape_.routing != "none") {
      last_publisher = l;
      const int64_t side = mixers_.back()->side_dim();
      const int64_t rank = m.value("routing_rank", 0);
      if ((shape_.routing == "cler_h" || shape_.routing == "clvr") && rank == 0)
        ly.route_p = ps.add({"route_p", {d, side}, ParamKind::matrix_hidden, InitRule::Constant(0.0)}, pre, l);
      if ((shape_.routing == "cler_h" || shape_.routing == "clvr") && rank > 0) {
        ly.route_u = ps.add({"route_u", {d, rank}, ParamKind::matrix_hidden, InitRule::Normal(std_)}, pre, l);
        ly.route_d = ps.add({"route_d", {rank, side}, ParamKind::matrix_hidden, InitRule::Constant(0.0)}, pre, l);
      }
      ly.inject_after_ffn = (shape_.routing == "cler_h" || shape_.routing == "clvr") &&
                            m.value("routing_inject", "mixer") == "layer";
    }
    ly.norm2 = ps.add({"norm2", {d}, ParamKind::norm, InitRule::Constant(1.0)}, pre, l);
    // w_gate and w_up are adjacent: together they are the [2F, d] matrix of one GEMM.
    ly.w_gate = ps.add({"w_gate", {F, d}, ParamKind::matrix_hidden, InitRule::Normal(std_)}, pre + "ffn.", l);
    ly.w_up = ps.add({"w_up", {F, d}, ParamKind::matrix_hidden, InitRule::Normal(std_)}, pre + "ffn.", l);
    ly.w_down = ps.add({"w_down", {d, F}, ParamKind::matrix_hidden, InitRule::Normal(out_std)}, pre + "ffn.", l);
  }
  final_norm_ = ps.add({"final_norm", {d}, ParamKind::norm, InitRule::Constant(1.0)}, "", -1);
  head_ = ps.add({"head", {shape_.vocab, d}, ParamKind::head, InitRule::Normal(std_)}, "", -1);
  ps.allocate();
  be_.register_weights(ps.params());  // the GPU keeps a bf16 mirror of them for its GEMMs
  for (int l = 0; l < L; ++l) {
    std::vector<Tensor> p, g;
    for (int i : layers_[l].mixer_params) {
      p.push_back(ps.param(i));
      g.push_back(ps.grad(i));
    }
    mixers_[l]->bind(p, g);
  }
  acts_ = std::make_unique<Acts>();
}

Model::~Model() = default;

std::size_t Model::activation_bytes() const { return arena_->peak_bytes(); }

StepResult Model::forward(const data::Batch& batch, bool training, std::vector<int32_t>* predictions,
                          std::vector<double>* token_losses) {
  auto& A = *acts_;
  auto& ps = *params_;
  const DType dt = be_.dtype();
  const int L = shape_.n_layers;
  const int64_t d = shape_.d_model, F = shape_.d_ff, V = shape_.vocab;
  A.B = batch.batch;
  A.T = batch.seq_len;
  A.N = int64_t(A.B) * A.T;
  const int64_t N = A.N, B = A.B, T = A.T;
  if (static_cast<int64_t>(batch.inputs.size()) != N || static_cast<int64_t>(batch.targets.size()) != N ||
      static_cast<int64_t>(batch.loss_mask.size()) != N)
    throw RuntimeError("batch: sizes do not match batch·seq_len");
  arena_->reset();
  auto& ar = *arena_;
  A.ids = ar.alloc(DType::i32, {N});
  A.targets = ar.alloc(DType::i32, {N});
  A.mask = ar.alloc(dt, {N});
  be_.upload(batch.inputs.data(), A.ids);
  be_.upload(batch.targets.data(), A.targets);
  A.mask_sum = 0;
  for (float w : batch.loss_mask) A.mask_sum += w;
  if (dt == DType::f64) {
    std::vector<double> m(batch.loss_mask.begin(), batch.loss_mask.end());
    be_.upload(m.data(), A.mask);
  } else {
    be_.upload(batch.loss_mask.data(), A.mask);
  }

  const DType at = be_.act_dtype();
  const bool keep_act = at == dt;  // bf16 storage: recompute silu(gate)·up in backward instead
  A.h.assign(2 * L + 1, Tensor());
  A.ymix.assign(L, Tensor());
  A.rstd1.assign(L, Tensor());
  A.xn1 = A.rstd2 = A.xn2 = A.gu = A.act = A.rstd1;
  A.route.assign(L, Routing());
  A.route_low.assign(L, Tensor());
  A.h[0] = ar.alloc(dt, {B, T, d});
  be_.embedding_fwd(A.ids, ps.param(embed_), A.h[0]);
  // One buffer holds each FFN's output (in act_dtype()) until the next norm adds it to the
  // residual stream (add_rmsnorm_fwd: no copy of the stream, no accumulating GEMM into it).
  // A mixer's output y is kept per layer (act_dtype(): half the bytes of the fp32 stream
  // after it, which the backward forms again as h[2l] + y); the stream after the mixer lives
  // in the next block input's buffer, where that norm adds the FFN's output in place. Layers
  // with a routing projection (it adds to the stream after the mixer) store that stream
  // instead and write y into the shared buffer.
  A.mix_y = ar.alloc(at, {B, T, d});
  const Tensor ffn_y = A.mix_y;
  Tensor h1;  // the stream after the current layer's mixer
  A.act_tmp = keep_act ? Tensor() : ar.alloc(at, {N, F});
  ForwardContext ctx{be_, ar, training};
  for (int l = 0; l < L; ++l) {
    const Layer& ly = layers_[l];
    // Mixer branch (after the previous layer's residual add). Every mixer takes and returns
    // act_dtype() tensors (x, y, dy, dx; bf16 on the GPU in mixed precision: their GEMMs read
    // and write them directly, no conversion passes).
    A.rstd1[l] = ar.alloc(dt, {N});
    A.xn1[l] = ar.alloc(at, {B, T, d});
    if (l == 0) {
      be_.rmsnorm_fwd(A.h[0], ps.param(ly.norm1), A.xn1[l], A.rstd1[l], kNormEps);
    } else {
      if (A.h[2 * l].empty()) A.h[2 * l] = ar.alloc(dt, {B, T, d});  // else h1 already lives there: in place
      be_.add_rmsnorm_fwd(h1, ffn_y, A.h[2 * l], ps.param(ly.norm1), A.xn1[l], A.rstd1[l], kNormEps);
    }
    Routing& r = A.route[l];
    if (ly.prev_linear >= 0) r.in = A.route[ly.prev_linear].out;
    const bool keep_y = (ly.route_p < 0 && ly.route_d < 0) || ly.inject_after_ffn;
    const Tensor y = keep_y ? ar.alloc(at, {B, T, d}) : A.mix_y;
    if (keep_y) A.ymix[l] = y;
    mixers_[l]->forward(ctx, A.xn1[l], y, r);
    A.rstd2[l] = ar.alloc(dt, {N});
    A.xn2[l] = ar.alloc(at, {B, T, d});
    if (keep_y) {
      // h1 = h0 + y and the SwiGLU branch's norm in one pass; h1 goes into h[2l+2]'s buffer.
      A.h[2 * l + 2] = ar.alloc(dt, {B, T, d});
      h1 = A.h[2 * l + 2];
      be_.add_rmsnorm_fwd(A.h[2 * l], y, h1, ps.param(ly.norm2), A.xn2[l], A.rstd2[l], kNormEps);
    } else {
      // h1 = h0 + y (y may be bf16); the norm it also writes is redone below, after the side channel
      A.h[2 * l + 1] = ar.alloc(dt, {B, T, d});
      h1 = A.h[2 * l + 1];
      be_.add_rmsnorm_fwd(A.h[2 * l], y, A.h[2 * l + 1], ps.param(ly.norm2), A.xn2[l], A.rstd2[l], kNormEps);
      if (ly.route_p >= 0) {  // cler_h / clvr: h += side·P_lᵀ
        if (r.out.empty()) throw RuntimeError("layer " + std::to_string(l) + " publishes no side channel");
        be_.gemm(r.out, false, ps.param(ly.route_p), true, A.h[2 * l + 1], 1.0, 1.0);
      }
      if (ly.route_d >= 0) {  // low rank: h += (side·Dᵀ)·Uᵀ
        if (r.out.empty()) throw RuntimeError("layer " + std::to_string(l) + " publishes no side channel");
        const Tensor& D = ps.param(ly.route_d);
        A.route_low[l] = ar.alloc(dt, {N, D.size(0)});
        be_.gemm(r.out, false, D, true, A.route_low[l]);
        be_.gemm(A.route_low[l], false, ps.param(ly.route_u), true, A.h[2 * l + 1], 1.0, 1.0);
      }
      be_.rmsnorm_fwd(A.h[2 * l + 1], ps.param(ly.norm2), A.xn2[l], A.rstd2[l], kNormEps);
    }
    // SwiGLU branch.
    A.gu[l] = ar.alloc(at, {N, 2 * F});
    Tensor w_gu(ps.param(ly.w_gate).data, dt, {2 * F, d});
    be_.gemm(A.xn2[l], false, w_gu, true, A.gu[l]);
    Tensor act = keep_act ? ar.alloc(at, {N, F}) : A.act_tmp;
    if (keep_act) A.act[l] = act;
    be_.swiglu_fwd(A.gu[l], act);
    be_.gemm(act, false, ps.param(ly.w_down), true, ffn_y);  // h2 = h1 + ffn_y: added by the next norm
    if (ly.inject_after_ffn) {  // routing_inject: layer — h2 += side·P_lᵀ, through ffn_y
      if (r.out.empty()) throw RuntimeError("layer " + std::to_string(l) + " publishes no side channel");
      if (ly.route_p >= 0) be_.gemm(r.out, false, ps.param(ly.route_p), true, ffn_y, 1.0, 1.0);
      if (ly.route_d >= 0) {
        const Tensor& D = ps.param(ly.route_d);
        A.route_low[l] = ar.alloc(dt, {N, D.size(0)});
        be_.gemm(r.out, false, D, true, A.route_low[l]);
        be_.gemm(A.route_low[l], false, ps.param(ly.route_u), true, ffn_y, 1.0, 1.0);
      }
    }
  }
  if (A.h[2 * L].empty()) A.h[2 * L] = ar.alloc(dt, {B, T, d});
  A.hf = A.h[2 * L];
  A.rstdf = ar.alloc(dt, {N});
  A.xnf = ar.alloc(at, {N, d});
  be_.add_rmsnorm_fwd(h1, ffn_y, A.hf, ps.param(final_norm_), A.xnf, A.rstdf, kNormEps);
  A.losses = ar.alloc(dt, {N});
  A.argmax = predictions ? ar.alloc(DType::i32, {N}) : Tensor();
  // The head and the cross-entropy in chunks of rows; in training each chunk's dlogits go
  // straight into the head's gradient and ∂L/∂xnf, so no N·V logits are ever stored.
  A.dxnf = training ? ar.alloc(at, {N, d}) : Tensor();
  const double grad_scale = A.mask_sum > 0 ? 1.0 / A.mask_sum : 0.0;
  const int64_t rows =
      std::max<int64_t>(1, std::min<int64_t>(N, kLogitBytesPerChunk / (V * int64_t(kernels::dtype_size(at)))));
  const auto head_mark = ar.mark();
  // Logits in act_dtype() (bf16 on the GPU: the cross-entropy reads them once and writes
  // dlogits in their place).
  Tensor logits = ar.alloc(at, {rows, V});
  Tensor dlogits = logits;
  double total = 0;
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t c = std::min(rows, N - r0);
    Tensor lg = logits.slice0(0, c), x = A.xnf.slice0(r0, c), tg = A.targets.slice0(r0, c), mk = A.mask.slice0(r0, c);
    be_.gemm(x, false, ps.param(head_), true, lg);
    if (!training || predictions) {
      total += be_.cross_entropy_fwd(lg, tg, mk, A.losses.slice0(r0, c), predictions ? A.argmax.slice0(r0, c) : Tensor());
      if (!training) continue;
    }
    Tensor dl = dlogits.slice0(0, c);
    if (predictions)
      be_.cross_entropy_bwd(lg, tg, mk, grad_scale, dl);
    else
      total += be_.cross_entropy_fwd_bwd(lg, tg, mk, A.losses.slice0(r0, c), grad_scale, dl);
    be_.gemm(dl, true, x, false, ps.grad(head_), 1.0, 1.0);
    be_.gemm(dl, false, ps.param(head_), false, A.dxnf.slice0(r0, c));
  }
  ar.release(head_mark);
  if (predictions) {
    predictions->resize(N);
    be_.download(A.argmax, predictions->data());
  }
  if (token_losses) {
    token_losses->resize(N);
    if (dt == DType::f64) {
      be_.download(A.losses, token_losses->data());
    } else {
      std::vector<float> l(N);
      be_.download(A.losses, l.data());
      std::copy(l.begin(), l.end(), token_losses->begin());
    }
  }
  StepResult res;
  res.mask_sum = A.mask_sum;
  res.loss = A.mask_sum > 0 ? total / A.mask_sum : 0.0;
  return res;
}

void Model::backward() {
  auto& A = *acts_;
  auto& ps = *params_;
  auto& ar = *arena_;
  const DType dt = be_.dtype();
  const int L = shape_.n_layers;
  const int64_t d = shape_.d_model, F = shape_.d_ff, N = A.N;
  // The head's gradients came with the forward (chunked cross-entropy); final norm.
  const DType at = be_.act_dtype();
  const bool keep_act = at == dt;
  Tensor dh = ar.zeros(dt, {A.B, A.T, d});
  Tensor dh_a = at != dt ? ar.alloc(at, {N, d}) : dh.matrix(d);  // dh as a GEMM operand
  // Each norm's backward also writes dh_a, the updated dh in act_dtype(), for the GEMMs
  // that read it next (no separate conversion pass).
  auto norm_bwd = [&](const Tensor& x, int w, const Tensor& rstd, const Tensor& dy, bool want_a) {
    if (at != dt && want_a)
      be_.rmsnorm_bwd_convert(x, ps.param(w), rstd, dy, dh, ps.grad(w), dh_a);
    else
      be_.rmsnorm_bwd(x, ps.param(w), rstd, dy, dh, ps.grad(w));
  };
  norm_bwd(A.hf, final_norm_, A.rstdf, A.dxnf, true);
  if (grads_ready_) grads_ready_({head_, final_norm_});
  Tensor dact = ar.alloc(at, {N, F});
  Tensor dgu = ar.alloc(at, {N, 2 * F});
  const Tensor dxn_a = ar.alloc(at, {A.B, A.T, d});  // ∂L/∂xn2 of the FFN, then ∂L/∂xn1 of the mixer
  // Side-channel gradients, zeroed up front (consumers above accumulate into them).
  for (int l = 0; l < L; ++l) {
    Routing& r = A.route[l];
    r.d_in = Tensor();
    r.d_out = r.out.empty() ? Tensor() : ar.alloc(dt, r.out.shape());
    if (!r.d_out.empty()) be_.zero(r.d_out);
  }
  for (int l = 0; l < L; ++l)
    if (layers_[l].prev_linear >= 0) A.route[l].d_in = A.route[layers_[l].prev_linear].d_out;
  ForwardContext ctx{be_, ar, true};
  auto route_bwd = [&](const Layer& ly, Routing& r, int l) {  // h += side·Pᵀ (or low·Uᵀ, low = side·Dᵀ)
    if (ly.route_p >= 0) {
      be_.gemm(dh, true, r.out, false, ps.grad(ly.route_p), 1.0, 1.0);
      be_.gemm(dh, false, ps.param(ly.route_p), false, r.d_out, 1.0, 1.0);
    }
    if (ly.route_d >= 0) {
      const Tensor& low = A.route_low[l];
      Tensor dlow = ar.alloc(dt, low.shape());
      be_.gemm(dh, true, low, false, ps.grad(ly.route_u), 1.0, 1.0);
      be_.gemm(dh, false, ps.param(ly.route_u), false, dlow);
      be_.gemm(dlow, true, r.out, false, ps.grad(ly.route_d), 1.0, 1.0);
      be_.gemm(dlow, false, ps.param(ly.route_d), false, r.d_out, 1.0, 1.0);
    }
  };
  for (int l = L - 1; l >= 0; --l) {
    const Layer& ly = layers_[l];
    Routing& r = A.route[l];
    // routing_inject: layer — h2 += side·Pᵀ; dh is ∂L/∂h2 here
    if (ly.inject_after_ffn) route_bwd(ly, r, l);
    // SwiGLU branch: h2 = h1 + act·W_downᵀ.
    be_.gemm(dh_a, false, ps.param(ly.w_down), false, dact);
    Tensor act = A.act[l];
    if (keep_act) {
      be_.swiglu_bwd(A.gu[l], dact, dgu);
    } else {  // act recomputed by the backward pass itself (one read of gate·up)
      act = A.act_tmp;
      be_.swiglu_bwd_fwd(A.gu[l], dact, dgu, act);
    }
    be_.gemm(dh_a, true, act, false, ps.grad(ly.w_down), 1.0, 1.0);
    Tensor g_gu(ps.grad(ly.w_gate).data, dt, {2 * F, d});
    Tensor w_gu(ps.param(ly.w_gate).data, dt, {2 * F, d});
    be_.gemm(dgu, true, A.xn2[l], false, g_gu, 1.0, 1.0);
    be_.gemm(dgu, false, w_gu, false, dxn_a);
    if (!A.ymix[l].empty())  // the norm of h1 = h0 + y, formed again from the kept mixer output
      be_.add_rmsnorm_bwd_convert(A.h[2 * l], A.ymix[l], ps.param(ly.norm2), A.rstd2[l], dxn_a, dh,
                                  ps.grad(ly.norm2), at != dt ? dh_a : Tensor());
    else
      norm_bwd(A.h[2 * l + 1], ly.norm2, A.rstd2[l], dxn_a, true);
    // Routing projection after the mixer: h1 += side·Pᵀ.
    if (!ly.inject_after_ffn) route_bwd(ly, r, l);
    // Mixer branch: h1 = h0 + Mixer(RMSNorm(h0)).
    mixers_[l]->backward(ctx, at != dt ? Tensor(dh_a.data, at, {A.B, A.T, d}) : dh, dxn_a, r);
    norm_bwd(A.h[2 * l], ly.norm1, A.rstd1[l], dxn_a, l > 0);
    if (grads_ready_) grads_ready(l);
  }
  be_.embedding_bwd(A.ids, dh, ps.grad(embed_));
  if (grads_ready_) grads_ready_({embed_});
}

void Model::grads_ready(int layer) {
  std::vector<int> idx;
  const auto& table = params_->table();
  for (int i = 0; i < static_cast<int>(table.size()); ++i)
    if (table[i].layer == layer) idx.push_back(i);
  grads_ready_(idx);
}

StepResult Model::forward_backward(const data::Batch& batch) {
  StepResult r = forward(batch, true, nullptr);
  backward();
  return r;
}

StepResult Model::evaluate(const data::Batch& batch, std::vector<int32_t>* predictions,
                           std::vector<double>* token_losses) {
  return forward(batch, false, predictions, token_losses);
}

}  // namespace lar::trainer
