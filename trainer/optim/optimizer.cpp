#include "trainer/optim/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include <fmt/format.h>

#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "trainer/optim/newton_schulz.hpp"

namespace lar::optim {

const char* to_string(ParamKind k) {
  switch (k) {
    case ParamKind::matrix_hidden: return "matrix_hidden";
    case ParamKind::embedding: return "embedding";
    case ParamKind::head: return "head";
    case ParamKind::norm: return "norm";
    case ParamKind::bias: return "bias";
    case ParamKind::scalar: return "scalar";
  }
  return "?";
}

ParamKind param_kind_from_string(const std::string& s) {
  for (ParamKind k : {ParamKind::matrix_hidden, ParamKind::embedding, ParamKind::head, ParamKind::norm,
                      ParamKind::bias, ParamKind::scalar})
    if (s == to_string(k)) return k;
  throw UserError(fmt::format("unknown parameter kind '{}' (matrix_hidden, embedding, head, norm, bias, scalar)", s));
}

namespace {

const char* to_string(OptimizerName n) {
  switch (n) {
    case OptimizerName::adamw: return "adamw";
    case OptimizerName::muon: return "muon";
    case OptimizerName::normuon: return "normuon";
  }
  return "?";
}

void require(bool ok, const std::string& key, const std::string& rule, double value) {
  if (!ok) throw UserError(fmt::format("optimizer.{}: must be {}, got {}", key, rule, value));
}

}  // namespace

OptimizerConfig OptimizerConfig::from_json(const json& run_config) {
  const json full = with_defaults(run_config);
  const json& o = full.at("optimizer");
  OptimizerConfig c;
  const std::string name = o.at("name").get<std::string>();
  if (name == "adamw") c.name = OptimizerName::adamw;
  else if (name == "muon") c.name = OptimizerName::muon;
  else if (name == "normuon") c.name = OptimizerName::normuon;
  else throw UserError(fmt::format("optimizer.name: unknown optimiser '{}' (adamw, muon, normuon)", name));
  c.lr = o.at("lr").get<double>();
  c.scalar_lr = o.at("scalar_lr").get<double>();
  c.beta1 = o.at("beta1").get<double>();
  c.beta2 = o.at("beta2").get<double>();
  c.eps = o.at("eps").get<double>();
  c.weight_decay = o.at("weight_decay").get<double>();
  c.scalar_weight_decay = o.at("scalar_weight_decay").get<double>();
  c.grad_clip = o.at("grad_clip").get<double>();
  c.momentum = o.at("momentum").get<double>();
  c.nesterov = o.at("nesterov").get<bool>();
  c.ns_steps = o.at("ns_steps").get<int>();
  const json& abc = o.at("ns_coefficients");
  if (!abc.is_array() || abc.size() != 3)
    throw UserError(fmt::format("optimizer.ns_coefficients: must be a list of 3 numbers (a, b, c), got {}", abc.dump()));
  for (int i = 0; i < 3; ++i) c.ns_coefficients[i] = abc[i].get<double>();
  const std::string mode = o.at("scale_mode").get<std::string>();
  if (mode == "default") c.scale_mode = ScaleMode::default_;
  else if (mode == "spectral") c.scale_mode = ScaleMode::spectral;
  else throw UserError(fmt::format("optimizer.scale_mode: unknown mode '{}' (default, spectral)", mode));
  c.normuon_beta2 = o.at("normuon_beta2").get<double>();
  const long zero = o.at("zero_stage").get<long>();
  if (zero == 2 || zero == 3)
    throw UserError(fmt::format("optimizer.zero_stage: {} is not implemented (0 = off, 1 = ZeRO-1 sharded "
                                "optimiser state; ZeRO-2/3 are not implemented)", zero));
  if (zero != 0 && zero != 1)
    throw UserError(fmt::format("optimizer.zero_stage: {} is not a ZeRO stage (0 = off, 1 = ZeRO-1)", zero));
  c.zero_stage = static_cast<int>(zero);

  require(c.lr > 0 && std::isfinite(c.lr), "lr", "> 0", c.lr);
  require(c.scalar_lr >= 0, "scalar_lr", "≥ 0 (0 = lr)", c.scalar_lr);
  require(c.beta1 >= 0 && c.beta1 < 1, "beta1", "in [0, 1)", c.beta1);
  require(c.beta2 >= 0 && c.beta2 < 1, "beta2", "in [0, 1)", c.beta2);
  require(c.eps > 0, "eps", "> 0", c.eps);
  require(c.weight_decay >= 0, "weight_decay", "≥ 0", c.weight_decay);
  require(c.scalar_weight_decay >= 0, "scalar_weight_decay", "≥ 0", c.scalar_weight_decay);
  require(c.grad_clip >= 0, "grad_clip", "≥ 0 (0 = off)", c.grad_clip);
  require(c.momentum >= 0 && c.momentum < 1, "momentum", "in [0, 1)", c.momentum);
  require(c.ns_steps >= 1, "ns_steps", "≥ 1", c.ns_steps);
  require(c.normuon_beta2 >= 0 && c.normuon_beta2 < 1, "normuon_beta2", "in [0, 1)", c.normuon_beta2);
  return c;
}

double global_norm(const float* x, std::size_t n) {
  double ss = 0;
  for (std::size_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  return std::sqrt(ss);
}

double block_sum_squares(const float* x, std::size_t n) {
  double ss = 0;
  for (std::size_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  return ss;
}

Optimizer::Optimizer(OptimizerConfig config, std::vector<ParamView> params, std::size_t total_size)
    : cfg_(config), params_(std::move(params)), total_size_(total_size) {
  // Check the table: inside the buffer, no overlaps, sane shapes.
  std::vector<const ParamView*> by_off;
  for (const ParamView& p : params_) {
    if (p.rows < 1 || p.cols < 1)
      throw RuntimeError(fmt::format("optimizer: parameter '{}' has shape {}×{}", p.name, p.rows, p.cols));
    if (p.offset + p.size() > total_size_)
      throw RuntimeError(fmt::format("optimizer: parameter '{}' [{}, {}) lies outside the buffer of {} floats",
                                     p.name, p.offset, p.offset + p.size(), total_size_));
    by_off.push_back(&p);
  }
  std::sort(by_off.begin(), by_off.end(), [](auto a, auto b) { return a->offset < b->offset; });
  for (std::size_t i = 1; i < by_off.size(); ++i)
    if (by_off[i - 1]->offset + by_off[i - 1]->size() > by_off[i]->offset)
      throw RuntimeError(fmt::format("optimizer: parameters '{}' and '{}' overlap", by_off[i - 1]->name, by_off[i]->name));

  // Lay out the state: m_ mirrors every tensor; v_ holds AdamW's elementwise second
  // moment, or NorMuon's one value per row (rows ≥ cols) or per column.
  const bool muon_family = cfg_.name != OptimizerName::adamw;
  const double scalar_lr = cfg_.scalar_lr > 0 ? cfg_.scalar_lr : cfg_.lr;
  std::size_t m_len = 0, v_len = 0, largest = 0;
  for (const ParamView& p : params_) {
    Slot s;
    s.muon = uses_muon(p);
    const bool decays = p.kind == ParamKind::matrix_hidden || p.kind == ParamKind::embedding ||
                        p.kind == ParamKind::head;
    if (s.muon) {
      s.lr_mult = cfg_.lr;
      s.wd = cfg_.weight_decay;
      if (cfg_.name == OptimizerName::normuon) s.v_len = static_cast<std::size_t>(std::max(p.rows, p.cols));
      largest = std::max(largest, p.size());
    } else {
      s.lr_mult = muon_family ? scalar_lr : cfg_.lr;
      s.own_lr = muon_family && cfg_.scalar_lr > 0;
      s.wd = decays ? (muon_family ? cfg_.scalar_weight_decay : cfg_.weight_decay) : 0.0;
      s.v_len = p.size();
    }
    s.m_off = m_len;
    s.v_off = v_len;
    m_len += p.size();
    v_len += s.v_len;
    slots_.push_back(s);
  }
  m_.assign(m_len, 0.0f);
  v_.assign(v_len, 0.0f);
  scratch_.resize(2 * largest);
}

bool Optimizer::uses_muon(const ParamView& p) const {
  return cfg_.name != OptimizerName::adamw && p.kind == ParamKind::matrix_hidden;
}

double Optimizer::muon_scale(int rows, int cols) const {
  // default: Keller Jordan's Muon, sqrt(max(1, rows/cols)).
  // spectral: the LAA repository trains with Megatron's `--muon-scale-mode spectral`
  // (no --muon-extra-scale-factor, i.e. 1.0), whose scale is sqrt(max(rows, cols))
  // (emerging_optimizers get_muon_scale_factor; Scion / Kimi Moonlight's rule).
  const double r = rows, c = cols;
  if (cfg_.scale_mode == ScaleMode::spectral) return std::sqrt(std::max(r, c));
  return std::sqrt(std::max(1.0, r / c));
}

double Optimizer::clip_gradients(float* grads) const {
  double norm = 0;
  {
    // Blocked (kNormBlock) so that ZeRO-1's sharded norm is this one bit for bit.
    double ss = 0;
    for (const ParamView& p : params_) {
      const float* g = grads + p.offset;
      for (std::size_t lo = 0; lo < p.size(); lo += kNormBlock)
        ss += block_sum_squares(g + lo, std::min(kNormBlock, p.size() - lo));
    }
    norm = std::sqrt(ss);
  }
  if (!std::isfinite(norm) || cfg_.grad_clip <= 0) return norm;
  const double coef = cfg_.grad_clip / (norm + 1e-6);
  if (coef < 1.0) {
    const float cf = static_cast<float>(coef);
    for (const ParamView& p : params_) {
      float* g = grads + p.offset;
      for (std::size_t i = 0; i < p.size(); ++i) g[i] *= cf;
    }
  }
  return norm;
}

void Optimizer::step(float* params, const float* grads, const Schedule& schedule, std::int64_t step_index) {
  step(params, grads, schedule.factor(step_index), schedule.warmup_factor(step_index));
}

void Optimizer::step(float* params, const float* grads, double lr_factor, double scalar_factor) {
  ++t_;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const ParamView& p = params_[i];
    const Slot& s = slots_[i];
    const double lr = s.lr_mult * (s.own_lr ? scalar_factor : lr_factor);
    if (s.muon) muon_update(p, s, params, grads, lr);
    else adamw_update(p, s, params, grads, lr);
  }
}

void Optimizer::adamw_update(const ParamView& p, const Slot& s, float* params, const float* grads, double lr) {
  const double t = static_cast<double>(t_);
  const double bc1 = 1.0 - std::pow(cfg_.beta1, t);
  const double bc2 = 1.0 - std::pow(cfg_.beta2, t);
  const float b1 = static_cast<float>(cfg_.beta1), b2 = static_cast<float>(cfg_.beta2);
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float eps = static_cast<float>(cfg_.eps);
  const float decay = static_cast<float>(1.0 - lr * s.wd);
  float* __restrict w = params + p.offset;
  const float* __restrict g = grads + p.offset;
  float* __restrict m = m_.data() + s.m_off;
  float* __restrict v = v_.data() + s.v_off;
  for (std::size_t i = 0; i < p.size(); ++i) {
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    const float denom = std::sqrt(v[i]) * inv_sqrt_bc2 + eps;
    w[i] = w[i] * decay - step_size * (m[i] / denom);
  }
}

void Optimizer::muon_update(const ParamView& p, const Slot& s, float* params, const float* grads, double lr) {
  const std::size_t n = p.size();
  const float mu = static_cast<float>(cfg_.momentum);
  float* w = params + p.offset;
  const float* g = grads + p.offset;
  float* buf = m_.data() + s.m_off;
  float* u = scratch_.data();
  float* o = u + n;
  // Momentum as an EMA (buf ← μ·buf + (1−μ)·g); Nesterov looks one step ahead:
  // u = (1−μ)·g + μ·buf. The EMA's (1−μ) factor cancels in the Frobenius normalisation.
  for (std::size_t i = 0; i < n; ++i) {
    buf[i] = mu * buf[i] + (1.0f - mu) * g[i];
    u[i] = cfg_.nesterov ? (1.0f - mu) * g[i] + mu * buf[i] : buf[i];
  }
  newton_schulz(u, o, p.rows, p.cols, cfg_.ns_steps, cfg_.ns_coefficients, ns_work_);

  if (cfg_.name == OptimizerName::normuon) {
    // One second moment per row when rows ≥ cols (mean of O² over the columns), else
    // per column; O is divided by sqrt(V) + eps, then rescaled to its former ‖O‖_F.
    const bool per_row = p.rows >= p.cols;
    const int len = per_row ? p.rows : p.cols;
    const int other = per_row ? p.cols : p.rows;
    float* V = v_.data() + s.v_off;
    const double b2 = cfg_.normuon_beta2;
    std::vector<double> mean(static_cast<std::size_t>(len), 0.0);
    double before = 0;
    for (int r = 0; r < p.rows; ++r)
      for (int c = 0; c < p.cols; ++c) {
        const double x = o[static_cast<std::size_t>(r) * p.cols + c];
        mean[per_row ? r : c] += x * x;
        before += x * x;
      }
    std::vector<float> inv(static_cast<std::size_t>(len));
    for (int k = 0; k < len; ++k) {
      V[k] = static_cast<float>(b2 * V[k] + (1.0 - b2) * (mean[k] / other));
      inv[k] = static_cast<float>(1.0 / (std::sqrt(static_cast<double>(V[k])) + cfg_.eps));
    }
    double after = 0;
    for (int r = 0; r < p.rows; ++r)
      for (int c = 0; c < p.cols; ++c) {
        float& x = o[static_cast<std::size_t>(r) * p.cols + c];
        x *= inv[per_row ? r : c];
        after += static_cast<double>(x) * x;
      }
    const float rescale = after > 0 ? static_cast<float>(std::sqrt(before / after)) : 0.0f;
    for (std::size_t i = 0; i < n; ++i) o[i] *= rescale;
  }

  const float decay = static_cast<float>(1.0 - lr * s.wd);
  const float step_size = static_cast<float>(lr * muon_scale(p.rows, p.cols));
  for (std::size_t i = 0; i < n; ++i) w[i] = w[i] * decay - step_size * o[i];
}

// ---- state serialisation ------------------------------------------------------------
// Layout: "LAROPTST" | u64 header length | header JSON (canonical) | m_ floats | v_ floats.
// Floats are copied as raw bytes (host order; every supported host is little-endian),
// which is what makes resume bit-identical.

namespace {
constexpr char kMagic[8] = {'L', 'A', 'R', 'O', 'P', 'T', 'S', 'T'};

json state_header(const OptimizerConfig& cfg, const std::vector<ParamView>& params, std::int64_t t,
                  std::size_t m_len, std::size_t v_len) {
  json table = json::array();
  for (const ParamView& p : params)
    table.push_back(json::array({p.name, p.offset, p.rows, p.cols, to_string(p.kind)}));
  return json{{"format", "lar-optimizer-state"}, {"version", 1},  {"optimizer", to_string(cfg.name)},
              {"steps", t},                      {"params", table}, {"m_len", m_len},
              {"v_len", v_len}};
}
}  // namespace

std::string Optimizer::save_state() const {
  const std::string header = canonical_dump(state_header(cfg_, params_, t_, m_.size(), v_.size()));
  const std::uint64_t hlen = header.size();
  std::string out;
  out.reserve(sizeof(kMagic) + sizeof(hlen) + header.size() + 4 * (m_.size() + v_.size()));
  out.append(kMagic, sizeof(kMagic));
  out.append(reinterpret_cast<const char*>(&hlen), sizeof(hlen));
  out.append(header);
  out.append(reinterpret_cast<const char*>(m_.data()), sizeof(float) * m_.size());
  out.append(reinterpret_cast<const char*>(v_.data()), sizeof(float) * v_.size());
  return out;
}

void Optimizer::load_state(const std::string& blob) {
  std::uint64_t hlen = 0;
  if (blob.size() < sizeof(kMagic) + sizeof(hlen) || std::memcmp(blob.data(), kMagic, sizeof(kMagic)) != 0)
    throw RuntimeError("optimizer state: not an optimiser state blob (bad magic)");
  std::memcpy(&hlen, blob.data() + sizeof(kMagic), sizeof(hlen));
  const std::size_t body = sizeof(kMagic) + sizeof(hlen);
  if (hlen > blob.size() - body) throw RuntimeError("optimizer state: truncated header");
  json header;
  try {
    header = json::parse(blob.substr(body, hlen));
  } catch (const json::exception& e) {
    throw RuntimeError(std::string("optimizer state: corrupt header: ") + e.what());
  }
  if (!header.is_object()) throw RuntimeError("optimizer state: corrupt header (not a JSON object)");
  const json expected = state_header(cfg_, params_, 0, m_.size(), v_.size());
  for (const char* key : {"format", "version", "optimizer", "params", "m_len", "v_len"})
    if (header.value(key, json()) != expected.at(key))
      throw RuntimeError(fmt::format("optimizer state: '{}' differs (checkpoint {}, this run {})", key,
                                     header.value(key, json()).dump(), expected.at(key).dump()));
  const std::size_t need = body + hlen + sizeof(float) * (m_.size() + v_.size());
  if (blob.size() != need)
    throw RuntimeError(fmt::format("optimizer state: {} bytes, expected {}", blob.size(), need));
  const char* data = blob.data() + body + hlen;
  std::memcpy(m_.data(), data, sizeof(float) * m_.size());
  std::memcpy(v_.data(), data + sizeof(float) * m_.size(), sizeof(float) * v_.size());
  t_ = header.at("steps").get<std::int64_t>();
}

}  // namespace lar::optim
