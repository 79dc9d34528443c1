// `lar plan SPEC [--scale S] [--format table|json|csv]` — expand a spec and show every
// cell with its id, hash, role, axis values and whether its run already exists:
//   done     run directory completed with the same config hash
//   partial  run directory exists but did not complete (pending, running, failed, …)
//   changed  run directory exists with a different config hash (the spec changed)
//   new      no run directory
// Reads run directories only ($LAR_HOME/runs/<experiment>/<cell-id>/); writes nothing.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "core/run_dir.hpp"
#include "experiments/cell.hpp"
#include "experiments/ids.hpp"
#include "registry/report/adapter.hpp"
#include "trainer/mixer.hpp"

namespace {

using lar::json;
using lar::experiments::Cell;
using lar::experiments::Plan;

struct PlanOptions {
  std::string spec;
  std::string scale;
  std::string format = "table";
};

std::string run_status(const Plan& plan, const Cell& c) {
  lar::RunDir rd(lar::run_dir_for(plan.experiment, c.id));
  if (!std::filesystem::exists(rd.root())) return "new";
  try {
    if (!rd.exists()) return "partial";
    if (rd.read_config().value("hash", "") != c.hash) return "changed";
    auto st = rd.read_status();
    return st && st->state == lar::RunState::completed ? "done" : "partial";
  } catch (const lar::RuntimeError&) {
    return "partial";  // unreadable files: the run is not usable as done
  }
}

std::string show(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_float()) return lar::experiments::id_number(v.get<double>());
  return v.dump();
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

void print_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& r : rows)
    for (size_t i = 0; i < r.size(); ++i) {
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], r[i].size());
    }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
}

int run_plan(const PlanOptions& o) {
  if (o.format != "table" && o.format != "json" && o.format != "csv")
    throw lar::UserError("--format: unknown format '" + o.format + "' (table, json, csv)");
  // At a scale other than the paper's, a reference row matches its paper cell by position
  // (the report's rule), so its "matches no cell" warning about the paper's values is moot.
  Plan plan = lar::report::load_paper_plan(o.spec, o.scale);
  for (const auto& w : plan.notes) std::cerr << "lar: " << w << "\n";
  for (const auto& w : plan.warnings) std::cerr << "lar: " << w << "\n";

  std::vector<std::string> status;
  std::map<std::string, int> counts{{"done", 0}, {"partial", 0}, {"changed", 0}, {"new", 0}};
  bool any_baseline = false;
  for (const auto& c : plan.cells) {
    status.push_back(run_status(plan, c));
    ++counts[status.back()];
    any_baseline = any_baseline || c.baseline.has_value();
  }
  std::vector<std::string> axes;
  for (const auto& a : plan.meta.value("axes", json::array())) axes.push_back(a.get<std::string>());
  // Whether the CUDA backend of this build runs each cell ("" = yes), the one rule that
  // `backend: cuda` enforces and `backend: auto` follows (trainer::cuda_unsupported).
  std::vector<std::string> no_cuda;
  for (const auto& c : plan.cells) no_cuda.push_back(lar::trainer::cuda_unsupported(c.config.at("model")));

  if (o.format == "json") {
    json cells = json::array();
    for (size_t i = 0; i < plan.cells.size(); ++i) {
      const Cell& c = plan.cells[i];
      json ax = json::object();
      for (const auto& [k, v] : c.axes) ax[k] = v;
      cells.push_back({{"id", c.id},
                       {"hash", c.hash},
                       {"short_hash", c.short_hash()},
                       {"role", c.role},
                       {"baseline", c.baseline ? json(*c.baseline) : json(nullptr)},
                       {"axes", ax},
                       {"status", status[i]},
                       {"run_dir", lar::run_dir_for(plan.experiment, c.id).string()},
                       {"reference", c.reference},
                       {"cuda", no_cuda[i].empty() ? json{{"covered", true}}
                                                   : json{{"covered", false}, {"why", no_cuda[i]}}},
                       {"config", c.config}});
    }
    json out = {{"experiment", plan.experiment}, {"scale", plan.scale}, {"spec", plan.spec_path.string()},
                {"meta", plan.meta},             {"cells", cells},      {"summary", counts},
                {"warnings", plan.warnings}};
    std::cout << out.dump(2) << "\n";
    return 0;
  }

  if (o.format == "csv") {
    std::cout << "id,hash,role,baseline,status,cuda";
    for (const auto& a : axes) std::cout << "," << csv_field(a);
    std::cout << "\n";
    for (size_t i = 0; i < plan.cells.size(); ++i) {
      const Cell& c = plan.cells[i];
      std::cout << csv_field(c.id) << "," << c.hash << "," << c.role << "," << csv_field(c.baseline.value_or(""))
                << "," << status[i] << "," << csv_field(no_cuda[i].empty() ? "yes" : "no: " + no_cuda[i]);
      for (const auto& [k, v] : c.axes) std::cout << "," << csv_field(v.is_string() ? v.get<std::string>() : v.dump());
      std::cout << "\n";
    }
    return 0;
  }

  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> head{"id", "hash", "role"};
  head.insert(head.end(), axes.begin(), axes.end());
  if (any_baseline) head.push_back("baseline");
  head.push_back("status");
  head.push_back("cuda");
  rows.push_back(head);
  std::vector<std::string> reasons;  // footnotes of the cuda column
  for (size_t i = 0; i < plan.cells.size(); ++i) {
    const Cell& c = plan.cells[i];
    std::vector<std::string> r{c.id, c.short_hash(), c.role};
    for (const auto& [k, v] : c.axes) r.push_back(show(v));
    if (any_baseline) r.push_back(c.baseline.value_or("-"));
    r.push_back(status[i]);
    if (no_cuda[i].empty()) {
      r.push_back("yes");
    } else {
      auto it = std::find(reasons.begin(), reasons.end(), no_cuda[i]);
      if (it == reasons.end()) it = reasons.insert(reasons.end(), no_cuda[i]);
      r.push_back("no [" + std::to_string(it - reasons.begin() + 1) + "]");
    }
    rows.push_back(std::move(r));
  }
  print_table(rows);
  if (!reasons.empty()) std::cout << "\ncuda: no = backend auto trains the cell on the CPU, backend cuda refuses it:\n";
  for (size_t k = 0; k < reasons.size(); ++k) std::cout << "  [" << k + 1 << "] " << reasons[k] << "\n";
  std::cout << "\n"
            << plan.cells.size() << " cells (experiment " << plan.experiment
            << (plan.scale.empty() ? "" : ", scale " + plan.scale) << "): " << counts["done"] << " done, "
            << counts["partial"] << " partial, " << counts["changed"] << " changed, " << counts["new"] << " new\n";
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "plan", "Expand an experiment spec: cells, ids, hashes and which runs exist", 20,
    [](CLI::App& app) -> lar::cli::Runner {
      auto opts = std::make_shared<PlanOptions>();
      app.add_option("spec", opts->spec, "experiment spec (YAML, see docs/specs.md)")->required();
      app.add_option("--scale", opts->scale, "named scale of the spec (default: its default_scale)");
      app.add_option("--format", opts->format, "table | json | csv")->capture_default_str();
      return [opts] { return run_plan(*opts); };
    }};
