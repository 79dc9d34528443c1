// `lar compare RUN RUN…` — what differs between runs: the config keys whose values
// differ (identical keys are left out), then a metric summary side by side.
#include <fmt/format.h>

#include <cmath>
#include <iostream>
#include <set>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "registry/registry.hpp"
#include "registry/text_table.hpp"
#include "registry/views.hpp"

namespace {

struct CompareOptions {
  std::string db;
  std::vector<std::string> runs;
  std::string format = "table";
};

using lar::json;
using Rows = std::vector<std::pair<std::string, std::vector<json>>>;

json summary_or_metric(const lar::registry::RunRecord& r,
                       const std::map<std::string, lar::registry::MetricPoint>& last, const char* summary_key,
                       const char* metric) {
  if (r.summary.contains(summary_key)) return r.summary[summary_key];
  auto it = last.find(metric);
  if (it != last.end() && std::isfinite(it->second.value)) return it->second.value;
  return nullptr;
}

int run_compare(const CompareOptions& o) {
  using namespace lar;
  using namespace lar::registry;
  const OutputFormat format = parse_format(o.format);
  if (o.runs.size() < 2) throw UserError("lar compare needs at least two runs (got " + std::to_string(o.runs.size()) + ")");
  auto reg = Registry::open(o.db.empty() ? default_db_path() : std::filesystem::path(o.db), true);
  std::vector<RunRecord> runs;
  std::vector<std::map<std::string, MetricPoint>> last;
  for (const auto& id : o.runs) {
    runs.push_back(reg.require_run(id));
    last.push_back(reg.last_metrics(runs.back().run_id));
  }

  // Config diff over the flattened configs; a key missing from a run counts as differing.
  std::vector<std::map<std::string, json>> flat;
  std::set<std::string> keys;
  for (const auto& r : runs) {
    flat.push_back(flatten(r.config));
    for (const auto& [k, _] : flat.back()) keys.insert(k);
  }
  Rows diff;
  for (const auto& k : keys) {
    std::vector<json> vals;
    for (const auto& f : flat) {
      auto it = f.find(k);
      vals.push_back(it == f.end() ? json() : it->second);
    }
    bool same = true;
    for (const auto& v : vals) same = same && v == vals[0];
    if (!same) diff.emplace_back(k, std::move(vals));
  }

  // Metric summary: the numbers a reader compares first.
  Rows metrics;
  auto add = [&](const std::string& name, auto get) {
    std::vector<json> vals;
    for (size_t i = 0; i < runs.size(); ++i) vals.push_back(get(runs[i], last[i]));
    metrics.emplace_back(name, std::move(vals));
  };
  add("status", [](const RunRecord& r, auto&) { return json(to_string(r.status)); });
  add("step", [](const RunRecord& r, auto&) { return json(fmt::format("{}/{}", r.step, r.total_steps)); });
  add("last loss", [](const RunRecord&, const std::map<std::string, MetricPoint>& l) {
    auto it = l.find("loss");
    return it == l.end() || !std::isfinite(it->second.value) ? json() : json(it->second.value);
  });
  add("final_loss", [](const RunRecord& r, auto& l) { return summary_or_metric(r, l, "final_loss", "__none__"); });
  add("saturation_loss", [](const RunRecord& r, auto& l) { return summary_or_metric(r, l, "saturation_loss", "__none__"); });
  add("val_loss", [](const RunRecord& r, auto& l) { return summary_or_metric(r, l, "val_loss", "val_loss"); });
  add("tokens_per_s", [](const RunRecord& r, auto& l) { return summary_or_metric(r, l, "tokens_per_s", "tokens_per_s"); });

  if (format == OutputFormat::json) {
    json j = {{"runs", json::array()}, {"config_keys", keys.size()}, {"config_diff", json::object()}, {"metrics", json::object()}};
    for (const auto& r : runs) j["runs"].push_back(r.run_id);
    for (const auto& [k, v] : diff) j["config_diff"][k] = v;
    for (const auto& [k, v] : metrics) j["metrics"][k] = v;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  if (format == OutputFormat::csv) {
    TextTable t;
    t.headers = {"section", "key"};
    for (const auto& r : runs) t.headers.push_back(r.run_id);
    auto rows = [&](const char* section, const Rows& list) {
      for (const auto& [k, vals] : list) {
        std::vector<std::string> row = {section, k};
        for (const auto& v : vals) row.push_back(v.is_number_float() ? fmt_num(v.get<double>(), 17) : cell_text(v));
        t.rows.push_back(std::move(row));
      }
    };
    rows("config", diff);
    rows("metric", metrics);
    std::cout << t.to_csv();
    return 0;
  }
  auto table = [&](const std::string& first, const Rows& list) {
    TextTable t;
    t.headers = {first};
    for (const auto& r : runs) t.headers.push_back(r.run_id);
    for (const auto& [k, vals] : list) {
      std::vector<std::string> row = {k};
      for (const auto& v : vals) row.push_back(cell_text(v));
      t.rows.push_back(std::move(row));
    }
    return t.to_table();
  };
  if (diff.empty()) std::cout << fmt::format("config: identical ({} keys)\n", keys.size());
  else std::cout << fmt::format("config: {} of {} keys differ\n", diff.size(), keys.size()) << table("key", diff);
  std::cout << "\n" << table("metric", metrics);
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "compare", "Compare runs: config differences and metric summary", 43,
    [](CLI::App& app) -> lar::cli::Runner {
      auto o = std::make_shared<CompareOptions>();
      app.add_option("runs", o->runs, "Two or more runs (ids, unique prefixes, cell ids or hash prefixes)")->required();
      app.add_option("--db", o->db, "Registry database (default: $LAR_DB or $LAR_HOME/lar.db)");
      app.add_option("-f,--format", o->format, "table | csv | json");
      return [o] { return run_compare(*o); };
    }};
