// The linear mixer's description, read once from its MixerConfig: the Dims (shape, the
// mixer's decay/erase/write, the CCQ, CARVE and routing add-ons), its parameter list, and what
// the CUDA kernels can run of it. The CPU skeleton (linear_mixer.cpp) and the CUDA one
// (cuda_layers/linear_layer_cuda.cpp) take the Dims and Slots made here.
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/carve/supports.hpp"
#include "kernels/ccq/supports.hpp"
#include "kernels/channel_rule/supports.hpp"
#include "kernels/delta_rule/supports.hpp"
#include "kernels/linear/mixers.hpp"
#include "trainer/mixers/linear_layer.hpp"

namespace lar::trainer::mixers {

namespace {

namespace lk = lar::kernels::cpu::linear;
namespace kc = lar::kernels::cuda::linear;  // the CUDA kernels' shape contracts (CUDA-free)
using Decay = MixerDesc::Decay;

// softplus⁻¹(y) = log(expm1(y)): dt_bias is initialised uniform between softplus⁻¹(1e-3)
// and softplus⁻¹(1e-1), which makes dt = softplus(dt_bias) (almost exactly) log-uniform
// in [1e-3, 1e-1] as in Mamba-2 / fla.
double softplus_inv(double y) { return std::log(std::expm1(y)); }

// Whether the CUDA kernels of this mixer's family take these heads: gdn and deltanet run on the
// delta rule, linear, gla, kda and gdn2 on the channel rule; CCQ and CARVE add their own.
bool family_supports(const Dims& d, kc::HeadDims h) {
  const bool delta = d.desc().family == MixerDesc::Family::delta_rule;
  if (!(delta ? kc::delta_rule_supports(h) : kc::channel_rule_supports(h))) return false;
  return !d.ccq.on || kc::ccq_supports(h.dk);
}

}  // namespace

Dims linear_dims(const MixerConfig& cfg) {
  Dims dm;
  auto m = cfg.kind == "carve" ? std::optional<lk::Mixer>(lk::Mixer::gdn2) : lk::parse_mixer(cfg.kind);
  if (!m) throw UserError("linear mixer: unknown architecture '" + cfg.kind + "'");
  dm.mixer = *m;
  dm.carve.on = cfg.kind == "carve";
  dm.d = cfg.d_model;
  dm.Hk = cfg.n_heads;
  dm.H = cfg.n_v_heads > 0 ? cfg.n_v_heads : cfg.n_heads;
  if (dm.Hk < 1 || dm.H % dm.Hk != 0)
    throw UserError("model.n_v_heads: " + std::to_string(dm.H) + " value heads are not a multiple of the " +
                    std::to_string(dm.Hk) + " query/key heads");
  dm.dk = cfg.head_dim;
  dm.dv = cfg.value_dim;
  dm.Cqk = dm.Hk * dm.dk;
  dm.Cq = dm.H * dm.dk;
  dm.Cv = dm.H * dm.dv;
  const json& mo = cfg.model;
  dm.conv = mo.value("short_conv", true);
  dm.W = mo.value("conv_size", 4);
  dm.rank = mo.value("gate_rank", 16);
  dm.chunk = mo.value("chunk_size", 64);
  if (mo.contains("ccq") && mo["ccq"].is_object()) {
    const json& cq = mo["ccq"];
    dm.ccq.on = cq.value("enabled", false);
    dm.ccq.centered = cq.value("centered", true);
    dm.ccq.disable_at_eval = cq.value("disable_at_eval", false);
    dm.ccq.lambda = cq.value("lambda_init", 0.01);
    if (cq.contains("lambda") && cq["lambda"].is_number()) {
      dm.ccq.learned = false;
      dm.ccq.lambda = cq["lambda"].get<double>();
    } else if (cq.contains("lambda") && cq["lambda"] != "learned") {
      throw UserError("model.ccq.lambda: expected 'learned' or a number, got " + cq["lambda"].dump());
    }
    if (dm.ccq.on && !(dm.ccq.lambda > 0.0 && dm.ccq.lambda < 1.0) && dm.ccq.learned)
      throw UserError("model.ccq.lambda_init: must lie in (0, 1), got " + std::to_string(dm.ccq.lambda));
  }
  if (dm.carve.on && mo.contains("carve") && mo["carve"].is_object()) {
    const json& cv = mo["carve"];
    dm.carve.rank = cv.value("content_rank", 16);
    dm.carve.content_chunk = cv.value("content_chunk", 0);
    dm.carve.content_grad = cv.value("content_grad", true);
    dm.carve.freeze_content = cv.value("freeze_content", false);
    const std::string qkv = cv.value("qkv", "gdn2");
    if (qkv != "gdn2" && qkv != "paper")
      throw UserError("model.carve.qkv: unknown value '" + qkv + "' (choices: gdn2, paper)");
    if (qkv == "paper") {
      dm.conv = false;
      dm.silu_only = true;
    }
  }
  if (dm.carve.on && dm.carve.content_chunk <= 0) dm.carve.content_chunk = dm.chunk;
  if (dm.carve.on && (dm.carve.rank < 1 || dm.carve.rank > 32))
    throw UserError("model.carve.content_rank: must be in 1..32, got " + std::to_string(dm.carve.rank));
  dm.l2 = (lk::is_delta_rule(dm.mixer) && !dm.silu_only) || dm.ccq.on || mo.value("qk_l2norm", false);
  if (dm.conv && dm.W < 1) throw UserError("model.conv_size: must be ≥ 1, got " + std::to_string(dm.W));
  if (dm.chunk < 1) throw UserError("model.chunk_size: must be ≥ 1, got " + std::to_string(dm.chunk));
  if (dm.rank < 1) throw UserError("model.gate_rank: must be ≥ 1, got " + std::to_string(dm.rank));
  if (cfg.routing == "cler")
    dm.route.kind = Route::cler;
  else if (cfg.routing == "cler_h")
    dm.route.kind = Route::cler_h;
  else if (cfg.routing == "clvr")
    dm.route.kind = Route::clvr;
  else if (cfg.routing != "none" && !cfg.routing.empty())
    throw UserError("model.routing: unknown value '" + cfg.routing + "'");
  const std::string signal = mo.value("routing_signal", "residual");
  if (signal != "residual" && signal != "update")
    throw UserError("model.routing_signal: unknown value '" + signal + "' (choices: residual, update)");
  dm.route.update = signal == "update" && dm.desc().beta() && !dm.carve.on &&
                    (dm.route.kind == Route::cler || dm.route.kind == Route::cler_h);
  if (dm.route.kind != Route::none && !lk::is_delta_rule(dm.mixer))
    throw UserError("model.routing: '" + cfg.routing +
                    "' needs a delta-rule mixer (deltanet, gdn, "
                    "kda, gdn2, carve); '" +
                    cfg.kind + "' has no write residual");
  return dm;
}

std::vector<ParamSpec> linear_params(const Dims& d, double init_std, Slots& sl) {
  sl = Slots{};
  std::vector<ParamSpec> specs;
  auto add = [&](ParamSpec s) {
    specs.push_back(std::move(s));
    return (int)specs.size() - 1;
  };
  const double sd = init_std;
  auto mat = [&](const char* name, int64_t rows, int64_t cols) {
    return add({name, {rows, cols}, ParamKind::matrix_hidden, InitRule::Normal(sd)});
  };
  sl.wq = mat("wq", d.Cqk, d.d);
  sl.wk = mat("wk", d.Cqk, d.d);
  sl.wv = mat("wv", d.Cv, d.d);
  if (d.conv) {
    // PyTorch's Conv1d default for a depthwise conv: U(±1/sqrt(width)).
    const double bound = 1.0 / std::sqrt((double)d.W);
    auto conv = [&](const char* name, int64_t C) {
      return add({name, {C, d.W}, ParamKind::scalar, InitRule::Uniform(-bound, bound)});
    };
    sl.cq = conv("conv_q", d.Cqk);
    sl.ck = conv("conv_k", d.Cqk);
    sl.cv = conv("conv_v", d.Cv);
  }
  const MixerDesc md = d.desc();
  if (md.low_rank_gate()) {
    sl.g1 = mat("gate_w1", d.rank, d.d);
    sl.g2 = mat("gate_w2", d.Cq, d.rank);
  }
  if (md.decay == Decay::logsig) sl.gb = add({"gate_bias", {d.Cq}, ParamKind::bias, InitRule::Constant(0.0)});
  if (md.beta()) sl.wbeta = mat("w_beta", d.H, d.d);
  if (md.decay == Decay::head) sl.wa = mat("w_a", d.H, d.d);
  if (md.softplus_gate()) {
    sl.A_log = add({"A_log", {d.H}, ParamKind::scalar, InitRule::Uniform(0.0, std::log(16.0))});
    const int64_t n = md.decay == Decay::head ? d.H : d.Cq;
    sl.dt_bias = add({"dt_bias", {n}, ParamKind::scalar, InitRule::Uniform(softplus_inv(1e-3), softplus_inv(1e-1))});
  }
  if (d.carve.on) {
    sl.werase = mat("w_erase", d.Cq, d.d);
    sl.wwrite = mat("w_write", d.H, d.d);  // one scalar write gate per head
    if (!d.carve.freeze_content) {
      // U_b(m) = U2 tanh(U1 m) per head; U2 starts at zero so CARVE starts as gdn2 with a
      // scalar write gate.
      sl.U1 = add({"content_u1",
                   {(int64_t)d.H * d.carve.rank, d.dv},
                   ParamKind::matrix_hidden,
                   InitRule::Normal(1.0 / std::sqrt((double)d.dv))});
      sl.U2 =
          add({"content_u2", {(int64_t)d.H * d.dk, d.carve.rank}, ParamKind::matrix_hidden, InitRule::Constant(0.0)});
    }
  } else if (md.gated()) {
    sl.werase = mat("w_erase", d.Cq, d.d);
    sl.wwrite = mat("w_write", d.Cv, d.d);
  }
  if (d.route.kind == Route::cler)  // Γ_l, zero so that the layer starts as without routing
    sl.gamma = add({"cler_gamma", {1}, ParamKind::scalar, InitRule::Constant(0.0)});
  if (d.ccq.on && d.ccq.learned) {
    // λ = σ(W_λ p_q + b_λ): W_λ zero, b_λ = logit(lambda_init) so λ starts at lambda_init.
    sl.wlam = add({"ccq_w_lambda", {d.H, d.Cqk}, ParamKind::matrix_hidden, InitRule::Constant(0.0)});
    sl.blam = add(
        {"ccq_b_lambda", {d.H}, ParamKind::bias, InitRule::Constant(std::log(d.ccq.lambda / (1.0 - d.ccq.lambda)))});
  }
  sl.onorm = add({"o_norm", {d.dv}, ParamKind::norm, InitRule::Constant(1.0)});
  sl.wgate = mat("w_gate", d.Cv, d.d);
  sl.wo = mat("wo", d.d, d.Cv);
  return specs;
}

std::string cuda_linear_decode_unsupported(const Dims& d) {
  // CARVE's CUDA decode (carve_decode) is 64-wide; the wide kernels have no per-token form yet.
  if (d.carve.on && !kc::carve_decode_supports({d.dk, 64}))
    return "model.head_dim: CARVE decode on CUDA takes key heads of 64 only, got " + std::to_string(d.dk);
  if (d.carve.on && !kc::carve_decode_supports({64, d.dv}))
    return "model.value_dim: CARVE decode on CUDA takes value heads of 64 only, got " + std::to_string(d.dv);
  // The decode's readout subtracts the token's own o2 after route_residual (T = 1), which would
  // scale z alone by β: the β-scaled update has no CUDA decode.
  if (d.route.update) return "model.routing_signal: 'update' (the β-scaled write residual) has no CUDA decode yet";
  return "";
}

std::string cuda_linear_unsupported(const Dims& d) {
  // The CUDA CARVE kernel's content chunk is its 64-token chunk; the cler/cler_h readout
  // (a second kernel pass with the shifted query) would need CARVE's content-gated erase
  // gates, which exist only inside carve_fwd.
  if (d.carve.on && d.carve.content_chunk != kc::kCarveContentChunk)
    return "model.carve.content_chunk: the CUDA CARVE kernel uses content chunks of 64, got " +
           std::to_string(d.carve.content_chunk);
  if (d.carve.on && (d.route.kind == Route::cler || d.route.kind == Route::cler_h))
    return "model.routing: cler/cler_h with CARVE have no CUDA path (clvr has)";
  if (d.route.update && !laa_routing_cuda_open())
    return laa_routing_cuda_gate("model.routing_signal: 'update' (the β-scaled write residual)");
  if (d.silu_only) return "model.carve.qkv: 'paper' has no CUDA path yet";
  // key heads of 128 and 256: the recurrent wide-key kernels (kernels/linear/wide_key.hpp,
  // CCQ included), without the cler/cler_h readouts (64-wide kernels only); CARVE at key or value
  // heads of 128 through wide_carve_fwd/bwd, gated until verified (kCarveWideCudaVerified)
  if (!family_supports(d, {d.dk, 64}))
    return "model.head_dim: the CUDA kernels take 64, 128 or 256, got " + std::to_string(d.dk);
  if (d.carve.on && !kc::carve_supports({d.dk, 64}))
    return "model.head_dim: CARVE runs on CUDA with key heads of 64 or 128, got " + std::to_string(d.dk);
  if (d.carve.on && !kc::carve_supports({64, d.dv}))
    return "model.value_dim: CARVE runs on CUDA with value heads of 64 or 128, got " + std::to_string(d.dv);
  if (d.carve.on && (d.dk != 64 || d.dv != 64) && !kCarveWideCudaVerified && !carve_wide_cuda_unverified_allowed())
    return carve_wide_gate_message(d.dk, d.dv);
  if (d.dk != 64 && (d.route.kind == Route::cler || d.route.kind == Route::cler_h))
    return "model.head_dim: the cler/cler_h readouts run on CUDA with key heads of 64 only, got " +
           std::to_string(d.dk);
  if (!family_supports(d, {64, d.dv}))
    return "model.value_dim: the CUDA kernels need a multiple of 64 up to 512, got " + std::to_string(d.dv);
  if (d.dv != 64 && (d.route.kind == Route::cler || d.route.kind == Route::cler_h) && !laa_routing_cuda_open())
    return laa_routing_cuda_gate("model.value_dim: " + std::to_string(d.dv) + " with the cler/cler_h readouts");
  if (d.conv && d.W > 8) return "model.conv_size: the CUDA conv is at most 8 wide, got " + std::to_string(d.W);
  return "";
}

}  // namespace lar::trainer::mixers
