#include "trainer/mixer.hpp"

#include <map>

#include "core/error.hpp"
#include "trainer/mixers/hedgehog_layer.hpp"
#include "trainer/mixers/linear_layer.hpp"
#include "trainer/mixers/mamba2_layer.hpp"
#include "trainer/mixers/mamba3_layer.hpp"

namespace lar::trainer {

namespace {
std::map<std::string, MixerFactory>& registry() {
  static std::map<std::string, MixerFactory> r;
  return r;
}
}  // namespace

MixerRegistration::MixerRegistration(const std::string& kind, MixerFactory factory) {
  registry()[kind] = std::move(factory);
}

bool mixer_registered(const std::string& kind) { return registry().count(kind) > 0; }

std::vector<std::string> registered_mixers() {
  std::vector<std::string> out;
  for (const auto& [k, f] : registry()) out.push_back(k);
  return out;
}

// The linear mixers (CARVE included) run on CUDA through cuda_layers/linear_layer_cuda.cpp,
// Mamba-2 and Mamba-3 through cuda_layers/mamba{2,3}_layer_cuda.cpp, GLA-Hedgehog through
// cuda_layers/hedgehog_layer_cuda.cpp: a mixer runs there when its CUDA layer registered its
// factory (builds with CUDA only; Mamba-3's and GLA-Hedgehog's behind their verification
// gates, which cuda_unsupported checks).
bool mixer_runs_on_cuda(const std::string& kind) {
  if (kind == "softmax") return true;
  if (kind == "gla_hedgehog") return mixers::cuda_hedgehog_factory() && mixers::hedgehog_cuda_gate_open();
  if (kind == "mamba2") return mixers::cuda_mamba2_factory() != nullptr;
  if (kind == "mamba3") return mixers::cuda_mamba3_factory() != nullptr;
  return mixers::cuda_linear_factory() && (kind == "linear" || kind == "gla" || kind == "deltanet" || kind == "gdn" ||
                                           kind == "kda" || kind == "gdn2" || kind == "carve");
}

std::string cuda_unsupported(const json& model) {
  bool linear = false, mamba2 = false, mamba3 = false, hedgehog = false;
  for (const auto& kind : layer_kinds(model)) {
    if (kind == "gla_hedgehog" && mixers::cuda_hedgehog_factory()) {  // the gate and the shape, below
      hedgehog = true;
      continue;
    }
    if (!mixer_runs_on_cuda(kind)) return "the '" + kind + "' mixer has no CUDA implementation in this build";
    mamba2 = mamba2 || kind == "mamba2";
    mamba3 = mamba3 || kind == "mamba3";
    linear = linear || (kind != "softmax" && kind != "mamba2" && kind != "mamba3");
  }
  // Mamba-3: refused while its CUDA layer is unverified (mamba3_layer.hpp), then by shape
  // (model.mamba, and model.mamba3's rank).
  if (mamba3) {
    if (std::string why = mixers::mamba3_cuda_gate(); !why.empty()) return why;
    for (int l = 0; l < model.at("n_layers").get<int>(); ++l) {
      const MixerConfig c = mixer_config(model, l);
      if (c.kind != "mamba3") continue;
      try {
        if (std::string why = mixers::cuda_mamba3_unsupported(mixers::mamba_shape(c), mixers::mamba3_rank(model));
            !why.empty())
          return why;
      } catch (const UserError& e) {
        return e.what();
      }
      break;  // every mamba3 layer has the model's shape
    }
  }
  // GLA-Hedgehog: its own layer (the linear layers' keys below do not apply to it), every
  // gla_hedgehog layer with the model's shape.
  if (hedgehog) {
    for (int l = 0; l < model.at("n_layers").get<int>(); ++l) {
      const MixerConfig c = mixer_config(model, l);
      if (c.kind != "gla_hedgehog") continue;
      try {
        if (std::string why = mixers::cuda_hedgehog_unsupported(mixers::hedgehog_shape(c)); !why.empty()) return why;
      } catch (const UserError& e) {
        return e.what();
      }
      break;
    }
  }
  // Mamba-2 takes its shape from model.mamba (the linear layers' keys below do not apply to it).
  if (mamba2) {
    for (int l = 0; l < model.at("n_layers").get<int>(); ++l) {
      const MixerConfig c = mixer_config(model, l);
      if (c.kind != "mamba2") continue;
      try {
        if (std::string why = mixers::cuda_mamba2_unsupported(mixers::mamba_shape(c), model.value("conv_size", 4));
            !why.empty())
          return why;
      } catch (const UserError& e) {
        return e.what();
      }
      break;  // every mamba2 layer has the model's shape
    }
  }
  if (!linear) return "";
  // The dimensions and options are the model's, the same for every linear layer.
  const MixerConfig c = mixer_config(model, 0);
  // Key heads of 64 run the chunk kernels, of 128 and 256 the recurrent wide-key kernels
  // (kernels/linear/wide_key.hpp, CCQ too, CARVE up to 128); the cler/cler_h readouts are
  // 64-wide only.
  if (c.head_dim != 64 && c.head_dim != 128 && c.head_dim != 256)
    return "model.head_dim: the linear CUDA kernels take 64, 128 or 256, got " + std::to_string(c.head_dim);
  if (c.head_dim != 64) {
    const std::string r = model.value("routing", "none");
    const std::string dk = std::to_string(c.head_dim);
    if (model.value("architecture", "") == "carve" && c.head_dim != 128)
      return "model.head_dim: CARVE runs on CUDA with key heads of 64 or 128, got " + dk;
    if (r == "cler" || r == "cler_h")
      return "model.head_dim: the cler/cler_h readouts run on CUDA with key heads of 64 only, got " + dk;
  }
  // Value heads of 64·m run as m heads of 64 sharing q, k (kernels/linear/grouped_heads.hpp);
  // not CARVE beyond 128 (its content signal couples the value channels: its wide kernels hold
  // the whole head in one CTA); the cler/cler_h readouts through the same mapping, gated until
  // verified (kLaaRoutingCudaVerified).
  // Grouped value heads (n_v_heads) run with every option, through the same mapping.
  if (c.value_dim % 64 != 0 || c.value_dim > 512)
    return "model.value_dim: the linear CUDA kernels need a multiple of 64 up to 512, got " +
           std::to_string(c.value_dim);
  if (c.value_dim != 64) {
    const std::string r = model.value("routing", "none");
    if (model.value("architecture", "") == "carve" && c.value_dim != 128)
      return "model.value_dim: CARVE runs on CUDA with value heads of 64 or 128, got " +
             std::to_string(c.value_dim);
    // the readouts at value heads of 64·m: through the grouped value heads, gated until verified
    if ((r == "cler" || r == "cler_h") && !mixers::laa_routing_cuda_open())
      return mixers::laa_routing_cuda_gate("model.value_dim: " + std::to_string(c.value_dim) +
                                           " with the cler/cler_h readouts");
  }
  // CARVE at key or value heads of 128 (the recurrent wide kernels) until verified on a GPU
  if (model.value("architecture", "") == "carve" && (c.head_dim != 64 || c.value_dim != 64) &&
      !mixers::kCarveWideCudaVerified && !mixers::carve_wide_cuda_unverified_allowed())
    return mixers::carve_wide_gate_message(c.head_dim, c.value_dim);
  // CCQ runs on every backbone; CARVE with 64-token content chunks and without cler/cler_h
  // (cuda_linear_unsupported in trainer/mixers/linear_mixer.cpp says the same per layer).
  if (model.value("architecture", "") == "carve") {
    int L = 0;
    if (model.contains("carve") && model["carve"].is_object()) L = model["carve"].value("content_chunk", 0);
    if (L <= 0) L = model.value("chunk_size", 64);
    if (L != 64)
      return "model.carve.content_chunk: the CUDA CARVE kernel uses content chunks of 64, got " + std::to_string(L);
    const std::string r = model.value("routing", "none");
    if (r == "cler" || r == "cler_h") return "model.routing: '" + r + "' with CARVE has no CUDA path (clvr has)";
    if (model.contains("carve") && model["carve"].is_object() && model["carve"].value("qkv", "gdn2") == "paper")
      return "model.carve.qkv: 'paper' (no conv, no L2 norm) has no CUDA path yet";
  }
  const std::string routing = model.value("routing", "none");
  const std::string arch = model.value("architecture", "");
  const bool beta_mixer = arch == "deltanet" || arch == "gdn" || arch == "kda";
  // the LAA paper's routing variants: CUDA paths gated until verified (trainer/mixers/linear_layer.hpp)
  if (model.value("routing_signal", "residual") == "update" && beta_mixer &&
      (routing == "cler" || routing == "cler_h") && !mixers::laa_routing_cuda_open())
    return mixers::laa_routing_cuda_gate("model.routing_signal: 'update' (the β-scaled write residual)");
  if (model.value("routing_inject", "mixer") == "layer" && (routing == "cler_h" || routing == "clvr") &&
      !mixers::laa_routing_cuda_open())
    return mixers::laa_routing_cuda_gate("model.routing_inject: 'layer' (the side channel added after the FFN)");
  if (model.value("short_conv", true) && model.value("conv_size", 4) > 8)
    return "model.conv_size: the CUDA conv is at most 8 wide, got " + std::to_string(model.value("conv_size", 4));
  return "";
}

std::unique_ptr<Mixer> make_mixer(const MixerConfig& cfg) {
  auto it = registry().find(cfg.kind);
  if (it == registry().end()) {
    std::string all;
    for (const auto& k : registered_mixers()) all += (all.empty() ? "" : ", ") + k;
    throw UserError("model.architecture: mixer '" + cfg.kind + "' (layer " + std::to_string(cfg.layer) +
                    ") is not implemented in this build (available: " + all + ")");
  }
  return it->second(cfg);
}

std::vector<std::string> layer_kinds(const json& model) {
  const int n = model.at("n_layers").get<int>();
  const std::string arch = model.at("architecture").get<std::string>();
  const std::string stack = model.at("stack").get<std::string>();
  const int ratio = model.at("hybrid_ratio").get<int>();
  std::vector<std::string> kinds;
  for (int l = 0; l < n; ++l) {
    bool softmax = arch == "softmax" || stack == "dense" || (stack == "hybrid" && l % (ratio + 1) == ratio);
    kinds.push_back(softmax ? "softmax" : arch);
  }
  return kinds;
}

MixerConfig mixer_config(const json& model, int layer) {
  MixerConfig c;
  c.model = model;
  auto kinds = layer_kinds(model);
  c.kind = kinds.at(layer);
  c.layer = layer;
  c.n_layers = static_cast<int>(kinds.size());
  int linear = 0;
  for (int l = 0; l < layer; ++l) linear += kinds[l] != "softmax";
  c.linear_index = c.kind == "softmax" ? -1 : linear;
  c.d_model = model.at("d_model").get<int>();
  c.n_heads = model.at("n_heads").get<int>();
  c.n_kv_heads = model.at("n_kv_heads").get<int>();
  if (c.n_kv_heads <= 0) c.n_kv_heads = c.n_heads;
  c.head_dim = model.at("head_dim").get<int>();
  if (c.head_dim <= 0) c.head_dim = c.d_model / c.n_heads;
  // Linear layers may have their own key-head count and size and grouped value heads (the
  // LAA launchers' GDN: 4 key heads of 64, 8 value heads, beside 16 softmax heads; at 1.3B
  // 8 key heads of 64 beside 16 softmax heads of 128).
  if (c.kind != "softmax") {
    const int lh = model.value("linear_heads", 0), ld = model.value("linear_head_dim", 0);
    if (lh > 0) c.n_heads = lh;
    if (ld > 0) c.head_dim = ld;
    c.n_v_heads = model.value("n_v_heads", 0);
  }
  if (c.n_v_heads <= 0) c.n_v_heads = c.n_heads;
  c.value_dim = model.at("value_dim").get<int>();
  if (c.value_dim <= 0) c.value_dim = c.head_dim;
  c.init_std = model.at("init_std").get<double>();
  c.routing = model.at("routing").get<std::string>();
  return c;
}

}  // namespace lar::trainer
