#include "registry/report/timing.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "kernels/linear/key_split_gate.hpp"
#include "registry/report/adapter.hpp"

namespace lar::report {

namespace {

struct Shape {
  double L = 0, d = 0, H = 0, kv = 0, hd = 0, dv = 0, dff = 0, V = 0, ratio = 2;
  std::string arch, stack, optimizer;
  double soft_layers = 0, lin_layers = 0;
  bool ccq = false;
  // What the linear layer's chunk kernel sees: heads of kdk keys × kdv values, kernel_arch's
  // recurrence (Mamba-2, Mamba-3 and GLA-Hedgehog run gla's), and whether the key-block split
  // runs it (key_split_gate.hpp). Mamba-3 MIMO's R rows a token are not counted: on the H200 its
  // CARVE-main runs kept pace with SISO's and Mamba-2's (the recurrent wide-key kernels' time is
  // not in proportion to their rows at these sizes).
  double kheads = 0, kdk = 64, kdv = 64;
  std::string kernel_arch;
  bool key_split = false;
};

double num(const json& j, const char* key, double dflt) {
  return j.is_object() && j.contains(key) && j[key].is_number() ? j[key].get<double>() : dflt;
}

Shape shape_of(const json& config) {
  const json& m = config.is_object() && config.contains("model") ? config["model"] : json::object();
  Shape s;
  s.L = num(m, "n_layers", 2);
  s.d = num(m, "d_model", 64);
  s.H = std::max(1.0, num(m, "n_heads", 1));
  s.kv = num(m, "n_kv_heads", 0) > 0 ? num(m, "n_kv_heads", 0) : s.H;
  s.hd = num(m, "head_dim", 0) > 0 ? num(m, "head_dim", 0) : s.d / s.H;
  s.dv = num(m, "value_dim", 0) > 0 ? num(m, "value_dim", 0) : s.hd;
  s.dff = num(m, "d_ff", 0) > 0 ? num(m, "d_ff", 0) : 32 * std::ceil(8.0 / 3.0 * s.d / 32);
  s.V = num(m, "vocab_size", 256);
  s.ratio = num(m, "hybrid_ratio", 2);
  s.arch = m.value("architecture", std::string("softmax"));
  s.stack = m.value("stack", std::string("dense"));
  s.ccq = m.contains("ccq") && m["ccq"].is_object() && m["ccq"].value("enabled", false);
  if (config.is_object() && config.contains("optimizer")) s.optimizer = config["optimizer"].value("name", std::string());
  s.kernel_arch = s.arch;
  s.kheads = s.H;
  s.kdk = s.hd;
  s.kdv = s.dv;
  const bool ssm = s.arch == "mamba2" || s.arch == "mamba3";
  if (ssm) {
    const json& mm = m.contains("mamba") && m["mamba"].is_object() ? m["mamba"] : json::object();
    const double P = std::max(1.0, num(mm, "head_dim", 64));
    s.kernel_arch = "gla";
    s.kheads = num(mm, "expand", 2) * s.d / P;
    s.kdk = num(mm, "state_size", 128);
    s.kdv = P;
  } else if (s.arch == "gla_hedgehog") {
    s.kernel_arch = "gla";
    s.kdk = 64 * std::ceil(2 * s.hd / 64);  // the feature dim, padded to a multiple of 64
    s.kdv = 64 * std::ceil(s.dv / 64);
  }
  // Past 64 keys, the key-block split where its gates (key_split_gate.hpp) send the layer: gla
  // (with or without CCQ) and GLA-Hedgehog by kWideKeySplitVerified, the state-space layers by
  // kSsmKeySplitVerified; otherwise the recurrent wide-key kernels.
  namespace kl = kernels::cuda::linear;
  s.key_split = s.kdk > 64 && (((s.arch == "gla" || s.arch == "gla_hedgehog") && kl::kWideKeySplitVerified) ||
                               (ssm && kl::kSsmKeySplitVerified));
  // The trainer's layer plan: hybrid = every (ratio+1)-th layer softmax.
  for (int l = 0; l < static_cast<int>(s.L); ++l) {
    const bool soft = s.arch == "softmax" || s.stack == "dense" ||
                      (s.stack == "hybrid" && l % (static_cast<int>(s.ratio) + 1) == static_cast<int>(s.ratio));
    (soft ? s.soft_layers : s.lin_layers) += 1;
  }
  return s;
}

double softmax_layer_params(const Shape& s) { return s.d * s.H * s.hd * 2 + 2 * s.d * s.kv * s.hd; }
// q, k (dk), v and the output gate (dv), the output projection, and ≈ d² of gates,
// short convolutions and norms.
double linear_layer_params(const Shape& s) { return 2 * s.d * s.H * s.hd + 3 * s.d * s.H * s.dv + s.d * s.d * 0.1; }
double matrix_params(const Shape& s) {
  return s.soft_layers * softmax_layer_params(s) + s.lin_layers * linear_layer_params(s) + s.L * 3 * s.d * s.dff;
}

// GEMM work of a step: 6 · (weights in matrices + the head) · tokens.
double dense_flops(const Shape& s, double tokens) { return 6 * (matrix_params(s) + s.V * s.d) * tokens; }
// Causal attention, forward and backward: ≈ 6 · T · H · hd a token and layer.
double attention_flops(const Shape& s, double tokens, double T) { return 6 * T * s.H * s.hd * s.soft_layers * tokens; }
// Muon / NorMuon: 5 Newton–Schulz steps of ≈ 3 GEMMs each, ≈ 30 · N · min(m, n) a step.
double optimiser_flops(const Shape& s) {
  if (s.optimizer != "muon" && s.optimizer != "normuon") return 0;
  return 30 * matrix_params(s) * std::min(s.d, s.dff);
}

double efficiency(double d, const TimingModel& m) { return std::min(1.0, 1.5 * d / (d + m.small_width)); }

struct Rates {
  double dense = 0, attention = 0;
};

// Calibrate the GEMM and attention rates on the 350M anchors (pure GDN for the GEMMs, its
// delta kernels taken out; dense softmax for attention).
Rates calibrate(const TimingModel& m) {
  const json gdn = {{"model", {{"n_layers", 20}, {"d_model", 1024}, {"n_heads", 16}, {"n_kv_heads", 4}, {"d_ff", 2816},
                               {"vocab_size", 32000}, {"architecture", "gdn"}, {"stack", "pure"}}},
                    {"optimizer", {{"name", "adamw"}}}};
  json soft = gdn;
  soft["model"]["architecture"] = "softmax";
  soft["model"]["stack"] = "dense";
  const double tokens = 8.0 * 4096;
  // The measured steps include the latency floor of their 20 layers.
  const double floor = 20 * m.layer_floor_s + m.step_floor_s;
  Rates r;
  r.dense = dense_flops(shape_of(gdn), tokens) / (m.gdn_step_s - m.gdn_delta_kernels_s - floor);
  const Shape ss = shape_of(soft);
  const double t_attn = m.softmax_step_s - floor - dense_flops(ss, tokens) / r.dense;
  r.attention = attention_flops(ss, tokens, 4096) / std::max(t_attn, 0.01 * m.softmax_step_s);
  return r;
}

// The chunk kernel of one layer, fwd+bwd, ms at B=8 T=4096, for the layer's own heads: the
// 64-wide kernels' time (kernel_ms, 16 heads of 64) per 1024 value channels, and past 64 keys the
// H200's times of the wide paths per 1024 value channels (docs/perf.md: 16 heads of 128 × 128;
// gla at 256 × 512). Key dims past 256 on the split scale with their 64-wide blocks (not measured).
double layer_kernel_ms(const Shape& s, const TimingModel& m) {
  double per_1024;
  if (s.kdk <= 64) {
    per_1024 = m.kernel_ms(s.kernel_arch);
  } else if (s.key_split) {
    per_1024 = s.kdk <= 128 ? 12.92 / 2 : 464.59 / 8 * std::max(1.0, s.kdk / 256);
  } else if (s.kdk <= 128) {
    const std::string& a = s.kernel_arch;
    per_1024 = (a == "kda" ? 59.57 : a == "gdn2" || a == "carve" ? 62.01 : 55.72) / 2;
  } else {
    per_1024 = 2027.97 / 8;
  }
  return per_1024 * (s.kheads * s.kdv / 1024);
}

}  // namespace

double TimingModel::kernel_ms(const std::string& arch) const {
  // docs/perf.md (lar-bench linear-cuda, B=8 T=4096, fwd+bwd).
  if (arch == "deltanet") return 0.963;
  if (arch == "gdn" || arch == "linear") return 0.966;
  if (arch == "gla") return 1.354;
  if (arch == "kda") return 2.265;
  if (arch == "gdn2") return 2.739;
  if (arch == "carve") return 2.871;
  return 0;
}

double model_flops_per_token(const json& config) {
  const Shape s = shape_of(config);
  const double T = num(config.contains("data") ? config["data"] : json::object(), "seq_len", 1);
  return dense_flops(s, 1) + attention_flops(s, 1, T);
}

double layer_kernel_ms(const json& config, const TimingModel& m) { return layer_kernel_ms(shape_of(config), m); }

double estimate_params(const json& config) {
  const Shape s = shape_of(config);
  return matrix_params(s) + 2 * s.V * s.d;
}

CellTiming estimate_cell(const experiments::Cell& cell, const TimingModel& m) {
  const Rates rates = calibrate(m);
  const json& c = cell.config;
  const Shape s = shape_of(c);
  CellTiming t;
  t.id = cell.id;
  t.arch = s.arch;
  t.stack = s.stack;
  t.params = estimate_params(c);
  const json& data = c.contains("data") ? c["data"] : json::object();
  const double B = num(data, "batch_size", 1), T = num(data, "seq_len", 1);
  const double per_step = B * T;
  t.tokens = planned_tokens(c);
  t.steps = per_step > 0 ? t.tokens / per_step : 0;
  const double eff = efficiency(s.d, m);
  const double dense = (dense_flops(s, per_step) + optimiser_flops(s)) / (rates.dense * eff);
  const double attn = attention_flops(s, per_step, T) / (rates.attention * eff);
  // The chunk kernels scale with tokens and width; inside a training step they run ≈ 16 %
  // slower than in their bench (lower clocks: the GDN step's profile, 22.41 ms for 20
  // layers, against 20 × 0.966); CCQ adds ≈ 30 % to a layer (perf.md).
  const double in_step = m.gdn_delta_kernels_s * 1e3 / (20 * m.kernel_ms("gdn"));
  const double kernels =
      s.lin_layers * layer_kernel_ms(s, m) * in_step * 1e-3 * (per_step / 32768) * (s.ccq ? 1.3 : 1.0);
  const double floor = m.layer_floor_s * s.L + m.step_floor_s;
  t.flops_per_step = dense_flops(s, per_step) + optimiser_flops(s) + attention_flops(s, per_step, T);
  const double compute = dense + attn + kernels;
  const double muon = s.optimizer == "muon" || s.optimizer == "normuon" ? 1 : 0;
  // The linear layer's kernel against GDN's at the same heads of 64 (the shared-GPU fit's unit).
  const double kernel_vs_gdn = layer_kernel_ms(s, m) / (m.kernel_ms("gdn") * std::max(s.H * s.dv, 1.0) / 1024);
  const double shared = m.shared_compute * compute +
                        (per_step / m.shared_tokens) *
                            (m.shared_layer_s * s.L + m.shared_linear_s * s.lin_layers * kernel_vs_gdn +
                             m.shared_muon_s * muon * s.L);
  // Alone, a step takes at least the GPU time it holds when shared (no alone runs of these
  // sizes are measured: a lower bound, not a fit).
  t.step_s = std::max(compute + floor, shared);
  const double busy_step = std::max(t.step_s - (1 - m.busy_of_floor) * floor, shared);
  // Evaluation: forward passes (≈ a third of a step) of eval.batches at the end, at the end
  // of a WSD stable phase too, or every eval.every steps; at each of eval.lengths.
  const json& ev = c.contains("eval") ? c["eval"] : json::object();
  const double batches = num(ev, "batches", 0), every = num(ev, "every", 0);
  double evals = 1;
  if (every > 0) evals = std::floor(t.steps / every);
  else if (c.contains("schedule") && c["schedule"].value("name", std::string()) == "wsd") evals = 2;
  double length_factor = 1;
  if (ev.contains("lengths") && ev["lengths"].is_array() && !ev["lengths"].empty()) {
    length_factor = 0;
    for (const auto& l : ev["lengths"])
      if (l.is_number()) length_factor += l.get<double>() / T;
  }
  const double eval_s = evals * batches * length_factor * t.step_s / 3;
  t.busy_s = t.steps * busy_step + eval_s;
  t.wall_s = m.startup_s + t.steps * t.step_s + eval_s;
  return t;
}

TableTiming estimate_table(const experiments::Plan& plan, int jobs, const TimingModel& m) {
  TableTiming t;
  t.jobs = std::max(1, jobs);
  double busy = 0;
  std::vector<double> slots(static_cast<size_t>(t.jobs), 0.0);
  for (const auto& c : plan.cells) {
    CellTiming ct = estimate_cell(c, m);
    t.sum_wall_s += ct.wall_s;
    busy += ct.busy_s;
    // The runner starts cells in plan order as slots free up.
    auto slot = std::min_element(slots.begin(), slots.end());
    *slot += ct.wall_s;
    t.cells.push_back(std::move(ct));
  }
  // One GPU time-slices between processes: side by side, the cells overlap only their
  // latency-bound gaps, so the table takes at least the GPU-busy time of all of them.
  t.table_s = std::max(*std::max_element(slots.begin(), slots.end()), busy);
  return t;
}

std::string timing_markdown(const TableTiming& t, const experiments::Plan& plan, const experiments::Plan* paper) {
  std::ostringstream os;
  os << "| cell | params | steps | tokens | s/step | run s | of the paper's tokens | of its params |\n"
     << "|---|---:|---:|---:|---:|---:|---:|---:|\n";
  for (size_t i = 0; i < t.cells.size(); ++i) {
    const CellTiming& c = t.cells[i];
    std::string ft = "—", fp = "—";
    if (paper && paper->cells.size() == plan.cells.size()) {
      const auto& pc = paper->cells[i].config;
      const double ptok = planned_tokens(pc), ppar = estimate_params(pc);
      if (ptok > 0) ft = fmt::format("{:.2g}", c.tokens / ptok);
      if (ppar > 0) fp = fmt::format("{:.2g}", c.params / ppar);
    }
    os << "| " << c.id << " | " << fmt::format("{:.1f}M", c.params / 1e6) << " | " << fmt::format("{:.0f}", c.steps)
       << " | " << fmt::format("{:.3g}", c.tokens) << " | " << fmt::format("{:.4f}", c.step_s) << " | "
       << fmt::format("{:.0f}", c.wall_s) << " | " << ft << " | " << fp << " |\n";
  }
  os << "\nWhole table on one H200 at -j " << t.jobs << ": " << fmt::format("{:.1f}", t.table_s / 60)
     << " min predicted (cells one after another: " << fmt::format("{:.1f}", t.sum_wall_s / 60) << " min).\n";
  return os.str();
}

}  // namespace lar::report
