#include "registry/report/adapter.hpp"

#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cmath>
#include <fstream>
#include <map>
#include <mutex>

#include "core/config_hash.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/hash.hpp"
#include "core/paths.hpp"

#ifndef LAR_PAPERS_DIR
#define LAR_PAPERS_DIR ""
#endif

namespace lar::report {

namespace {

fs::path self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return {};
  return fs::path(std::string(buf, static_cast<size_t>(n)));
}

bool is_spec_file(const fs::path& p) {
  const std::string name = p.filename().string();
  return p.extension() == ".yaml" && name != "common.yaml" && name != "notes.yaml";
}

std::string seed_token(const json& v) { return "s" + (v.is_string() ? v.get<std::string>() : v.dump()); }

// The id with its seed token replaced ("gdn.muon.s0" → "gdn.muon.s3").
std::string reseed_id(const std::string& id, const json& old_seed, const json& new_seed) {
  const std::string from = seed_token(old_seed), to = seed_token(new_seed);
  if (id == from) return to;
  if (id.size() > from.size() && id.compare(id.size() - from.size() - 1, std::string::npos, "." + from) == 0)
    return id.substr(0, id.size() - from.size()) + to;
  if (auto pos = id.find("." + from + "."); pos != std::string::npos) return id.substr(0, pos + 1) + to + id.substr(pos + 1 + from.size());
  if (id.rfind(from + ".", 0) == 0) return to + id.substr(from.size());
  return id + "." + to;
}

const json* seed_of(const experiments::Cell& c) {
  for (const auto& [a, v] : c.axes)
    if (a == "seed") return &v;
  return nullptr;
}

std::string categorical_signature(const experiments::Cell& c) {
  std::string s;
  for (const auto& [a, v] : c.axes)
    if (v.is_string() || v.is_boolean()) s += a + "=" + v.dump() + ";";
  return s;
}

bool has_reference(const json& r) {
  if (!r.is_object()) return false;
  return std::any_of(r.begin(), r.end(), [](const json& v) { return v.is_number(); });
}

}  // namespace

fs::path papers_root() {
  std::vector<fs::path> candidates;
  if (const auto env = env_string("LAR_PAPERS")) candidates.emplace_back(*env);
  if (fs::path exe = self_exe(); !exe.empty()) {
    candidates.push_back(exe.parent_path() / ".." / "experiments" / "papers");
    candidates.push_back(exe.parent_path() / ".." / ".." / "experiments" / "papers");
  }
  if (std::string(LAR_PAPERS_DIR).size()) candidates.emplace_back(LAR_PAPERS_DIR);
  for (const auto& c : candidates) {
    std::error_code ec;
    if (fs::is_directory(c, ec)) return fs::weakly_canonical(c);
  }
  throw RuntimeError("cannot find the paper specs (experiments/papers); set LAR_PAPERS to that folder");
}

std::vector<std::string> list_paper_tables() {
  std::vector<std::string> out;
  const fs::path root = papers_root();
  for (const auto& paper : fs::directory_iterator(root)) {
    if (!paper.is_directory()) continue;
    for (const auto& f : fs::directory_iterator(paper.path()))
      if (f.is_regular_file() && is_spec_file(f.path()))
        out.push_back(paper.path().filename().string() + "/" + f.path().stem().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

fs::path resolve_paper_spec(const std::string& paper_table) {
  if (paper_table.size() > 5 && paper_table.compare(paper_table.size() - 5, 5, ".yaml") == 0) {
    if (!fs::is_regular_file(paper_table)) throw UserError("no such spec file '" + paper_table + "'");
    return paper_table;
  }
  const fs::path p = papers_root() / (paper_table + ".yaml");
  if (paper_table.find('/') != std::string::npos && fs::is_regular_file(p) && is_spec_file(p)) return p;
  const auto all = list_paper_tables();
  std::string msg = "unknown paper table '" + paper_table + "' (available: ";
  for (size_t i = 0; i < all.size(); ++i) msg += (i ? ", " : "") + all[i];
  msg += ")";
  std::string hint = did_you_mean(paper_table, all);
  if (!hint.empty()) msg += "; " + hint;
  throw UserError(msg);
}

experiments::Plan with_seeds(const experiments::Plan& plan, int n) {
  if (n <= 0) return plan;
  experiments::Plan out = plan;
  out.cells.clear();
  // Rows: cells that differ only in the seed, in plan order; the first cell is the template.
  std::vector<std::string> order;
  std::map<std::string, std::vector<const experiments::Cell*>> rows;
  for (const auto& c : plan.cells) {
    std::string key = row_id_of(to_report_cell(c));
    if (!rows.count(key)) order.push_back(key);
    rows[key].push_back(&c);
  }
  for (const auto& key : order) {
    const auto& cells = rows[key];
    for (int s = 0; s < n; ++s) {
      const json seed = s;
      const experiments::Cell* same = nullptr;
      for (const auto* c : cells)
        if (const json* cs = seed_of(*c); cs && *cs == seed) same = c;
      if (same) {
        out.cells.push_back(*same);
        continue;
      }
      experiments::Cell c = *cells.front();
      const json* old = seed_of(c);
      const json old_seed = old ? *old : json(c.config.value("seed", 0));
      if (old) {
        for (auto& [a, v] : c.axes)
          if (a == "seed") v = seed;
      } else {
        c.axes.emplace_back("seed", seed);
      }
      c.id = old ? reseed_id(c.id, old_seed, seed) : c.id + "." + seed_token(seed);
      c.config["seed"] = s;
      c.hash = config_hash(c.config);
      if (c.baseline) c.baseline = old ? reseed_id(*c.baseline, old_seed, seed) : *c.baseline + "." + seed_token(seed);
      out.cells.push_back(std::move(c));
    }
  }
  // A baseline must be a cell of the plan for every seed; drop dangling ones.
  std::map<std::string, bool> ids;
  for (const auto& c : out.cells) ids[c.id] = true;
  for (auto& c : out.cells)
    if (c.baseline && !ids.count(*c.baseline)) c.baseline.reset();
  return out;
}

experiments::Plan load_paper_plan(const fs::path& spec, const std::string& scale, int seeds) {
  experiments::Plan plan = experiments::load_plan(spec, scale);
  const bool has_paper_scale = plan.meta.contains("scales") && plan.meta["scales"].is_array() &&
                               std::find(plan.meta["scales"].begin(), plan.meta["scales"].end(), json("paper")) !=
                                   plan.meta["scales"].end();
  if (plan.scale != "paper" && has_paper_scale) {
    const experiments::Plan paper = experiments::load_plan(spec, "paper");
    // Cell i of this scale stands for paper cell i / k when this scale runs k seeds for the
    // paper's one (the seed axis is the matrix's last, so a row's seeds are adjacent).
    const size_t k = paper.cells.empty() ? 0 : plan.cells.size() / paper.cells.size();
    if (k > 0 && paper.cells.size() * k == plan.cells.size()) {
      bool filled = false;
      for (size_t i = 0; i < plan.cells.size(); ++i) {
        auto& c = plan.cells[i];
        const auto& p = paper.cells[i / k];
        if (!has_reference(c.reference) && has_reference(p.reference) && categorical_signature(c) == categorical_signature(p)) {
          c.reference = p.reference;
          filled = true;
        }
      }
      // The "matches no cell" warnings were about the paper scale's values: resolved now.
      if (filled)
        plan.warnings.erase(std::remove_if(plan.warnings.begin(), plan.warnings.end(),
                                           [](const std::string& w) {
                                             return w.find("reference.rows[") != std::string::npos &&
                                                    w.find("matches no cell") != std::string::npos;
                                           }),
                            plan.warnings.end());
    }
  }
  return with_seeds(plan, seeds);
}

std::vector<KnownIssue> load_known_issues(const fs::path& spec) {
  std::vector<KnownIssue> out;
  const fs::path notes = spec.parent_path() / "notes.yaml";
  if (!fs::is_regular_file(notes)) return out;
  const std::string table = spec.stem().string();
  try {
    YAML::Node root = YAML::LoadFile(notes.string());
    for (const auto& issue : root["known_issues"]) {
      bool applies = !issue["tables"];
      for (const auto& t : issue["tables"])
        if (t.as<std::string>() == table) applies = true;
      if (applies) out.push_back({issue["where"].as<std::string>(""), issue["text"].as<std::string>("")});
    }
  } catch (const YAML::Exception& e) {
    throw UserError(notes.string() + ":" + std::to_string(e.mark.line + 1) + ":" + std::to_string(e.mark.column + 1) +
                    ": error: " + e.msg);
  }
  return out;
}

double planned_tokens(const json& config) {
  const json* d = config.is_object() && config.contains("data") ? &config["data"] : nullptr;
  const json* b = config.is_object() && config.contains("budget") ? &config["budget"] : nullptr;
  if (!d || !b) return 0;
  const double per_step = d->value("batch_size", 0.0) * d->value("seq_len", 0.0);
  const double tokens = b->value("tokens", 0.0);
  const double steps = tokens > 0 && per_step > 0 ? std::max(1.0, std::ceil(tokens / per_step)) : b->value("steps", 0.0);
  return steps * per_step;
}

std::optional<double> corpus_train_tokens(const json& config) {
  if (!config.is_object() || !config.contains("data")) return std::nullopt;
  const json& d = config["data"];
  if (d.value("task", std::string("lm")) != "lm") return std::nullopt;
  const std::string p = d.value("path", std::string());
  const fs::path dir = p.empty() ? data_root() / "brown" : fs::path(p);
  static std::mutex mu;
  static std::map<std::string, std::optional<double>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto [it, fresh] = cache.try_emplace(dir.string());
  if (!fresh) return it->second;
  std::ifstream f(dir / "manifest.json");
  if (!f) return std::nullopt;
  try {
    const json m = json::parse(f);
    if (m.contains("train") && m["train"].contains("tokens") && m["train"]["tokens"].is_number())
      it->second = m["train"]["tokens"].get<double>();
  } catch (const json::exception&) {
  }
  return it->second;
}

ReportCell to_report_cell(const experiments::Cell& c) {
  ReportCell r;
  r.id = c.id;
  r.hash = c.hash;
  r.axes = c.axes;
  r.config = c.config;
  r.role = c.role;
  r.baseline = c.baseline;
  r.reference = c.reference;
  if (auto corpus = corpus_train_tokens(c.config); corpus && *corpus > 0) r.epochs = planned_tokens(c.config) / *corpus;
  return r;
}

ReportRun to_report_run(const registry::RunRecord& rec, std::optional<long> checkpoint_step) {
  ReportRun r;
  r.run_id = rec.run_id;
  r.cell_id = rec.cell_id;
  r.hash = rec.hash;
  r.status = to_string(rec.status);
  r.reason = rec.reason;
  r.role = rec.role;
  r.step = rec.step;
  r.total_steps = rec.total_steps;
  r.checkpoint_step = checkpoint_step;
  r.config = rec.config;
  r.summary = rec.summary.is_object() ? rec.summary : json::object();
  r.updated_at = rec.updated_at;
  if (auto corpus = corpus_train_tokens(rec.config); corpus && *corpus > 0) {
    const double tokens = r.summary.contains("tokens") && r.summary["tokens"].is_number() ? r.summary["tokens"].get<double>()
                                                                                         : planned_tokens(rec.config);
    r.epochs = tokens / *corpus;
  }
  return r;
}

TableInput make_table_input(const experiments::Plan& plan, const fs::path& spec, registry::Registry* reg) {
  TableInput in;
  in.experiment = plan.experiment;
  in.scale = plan.scale;
  const json ref = plan.meta.value("reference", json::object());
  in.source = ref.value("source", json::object());
  if (ref.contains("metrics")) in.metrics = ref["metrics"].get<std::vector<std::string>>();
  in.description = plan.meta.value("description", std::string());
  std::string paper = in.source.value("paper", spec.parent_path().filename().string());
  std::transform(paper.begin(), paper.end(), paper.begin(), [](unsigned char ch) { return std::toupper(ch); });
  in.title = paper + " " + in.source.value("table", spec.stem().string());
  for (const auto& c : plan.cells) in.cells.push_back(to_report_cell(c));
  in.known_issues = load_known_issues(spec);
  in.claims = plan.claims;
  if (!reg) return in;
  registry::RunFilter f;
  f.experiment = plan.experiment;
  for (const auto& rec : reg->runs(f)) {
    std::optional<long> ckpt;
    if (rec.summary.is_object() && rec.summary.contains("checkpoint_step") && rec.summary["checkpoint_step"].is_number())
      ckpt = rec.summary["checkpoint_step"].get<long>();
    if (!ckpt)
      for (const auto& c : reg->checkpoints(rec.run_id)) ckpt = std::max(ckpt.value_or(c.step), c.step);
    if (!ckpt)
      for (const auto& e : reg->evals(rec.run_id)) ckpt = std::max(ckpt.value_or(e.step), e.step);
    in.runs.push_back(to_report_run(rec, ckpt));
  }
  return in;
}

TableInput make_table_input(const experiments::Plan& plan, const fs::path& spec, const fs::path& db) {
  if (!fs::exists(db)) return make_table_input(plan, spec, nullptr);
  registry::Registry reg = registry::Registry::open(db, /*read_only=*/true);
  return make_table_input(plan, spec, &reg);
}

PaperReport paper_report(const std::string& paper_table, const std::string& scale, int seeds, const fs::path& db) {
  PaperReport p;
  p.spec = resolve_paper_spec(paper_table);
  p.plan = load_paper_plan(p.spec, scale, seeds);
  p.input = make_table_input(p.plan, p.spec, db);
  p.report = build_report(p.input);
  return p;
}

}  // namespace lar::report
