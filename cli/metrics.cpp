// `lar metrics RUN --name loss` — one metric series of a run (table, csv or json);
// without --name, the run's metrics with their row counts and last values.
#include <fmt/format.h>

#include <iostream>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "registry/registry.hpp"
#include "registry/text_table.hpp"
#include "registry/views.hpp"

namespace {

struct MetricsOptions {
  std::string db;
  std::string run;
  std::string name;
  std::string format = "table";
};

int run_metrics(const MetricsOptions& o) {
  using namespace lar;
  using namespace lar::registry;
  const OutputFormat format = parse_format(o.format);
  auto reg = Registry::open(o.db.empty() ? default_db_path() : std::filesystem::path(o.db), true);
  RunRecord r = reg.require_run(o.run);
  auto names = reg.metric_names(r.run_id);

  if (o.name.empty()) {
    auto last = reg.last_metrics(r.run_id);
    TextTable t;
    t.headers = {"metric", "points", "last_step", "last_value"};
    t.right_align = {false, true, true, true};
    json arr = json::array();
    for (const auto& n : names) {
      auto series = reg.metric_series(r.run_id, n);
      const MetricPoint& p = last[n];
      t.rows.push_back({n, std::to_string(series.size()), std::to_string(p.step), fmt_num(p.value, 6)});
      arr.push_back({{"name", n}, {"points", series.size()}, {"last", to_json(p)}});
    }
    if (format == OutputFormat::json) std::cout << arr.dump(2) << "\n";
    else std::cout << (format == OutputFormat::csv ? t.to_csv() : t.to_table());
    return 0;
  }

  if (std::find(names.begin(), names.end(), o.name) == names.end()) {
    std::string hint = did_you_mean(o.name, names);
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    throw UserError("run '" + r.run_id + "' has no metric '" + o.name + "'" + (hint.empty() ? "" : " (" + hint + ")") +
                    "; it has: " + (list.empty() ? "(none)" : list));
  }
  auto series = reg.metric_series(r.run_id, o.name);
  if (format == OutputFormat::json) {
    json arr = json::array();
    for (const auto& p : series) arr.push_back(to_json(p));
    std::cout << json{{"run_id", r.run_id}, {"name", o.name}, {"points", arr}}.dump(2) << "\n";
    return 0;
  }
  TextTable t;
  t.headers = {"step", "tokens", o.name, "wall_time"};
  t.right_align = {true, true, true, true};
  const int digits = format == OutputFormat::csv ? 17 : 6;  // csv: full precision
  for (const auto& p : series)
    t.rows.push_back({std::to_string(p.step), fmt_num(p.tokens, digits), fmt_num(p.value, digits),
                      fmt_num(p.wall_time, digits)});
  std::cout << (format == OutputFormat::csv ? t.to_csv() : t.to_table());
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "metrics", "Print a metric series of a run (table, csv or json)", 44,
    [](CLI::App& app) -> lar::cli::Runner {
      auto o = std::make_shared<MetricsOptions>();
      app.add_option("run", o->run, "Run id (experiment/cell), a unique prefix, a cell id or a hash prefix")
          ->required();
      app.add_option("-n,--name", o->name, "Metric name (loss, val_loss, lr, …); omit to list them");
      app.add_option("--db", o->db, "Registry database (default: $LAR_DB or $LAR_HOME/lar.db)");
      app.add_option("-f,--format", o->format, "table | csv | json");
      return [o] { return run_metrics(*o); };
    }};
