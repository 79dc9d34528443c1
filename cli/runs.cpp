// `lar runs` — list runs from the registry, filtered and sorted.
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <set>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "registry/registry.hpp"
#include "registry/text_table.hpp"
#include "registry/views.hpp"

namespace {

struct RunsOptions {
  std::string db;
  std::string experiment;
  std::vector<std::string> where;
  std::vector<std::string> status;
  std::string sort = "run_id";
  bool desc = false;
  size_t limit = 0;
  std::string format = "table";
};

// Axis columns: the union of the listed runs' axes, in first-seen order (capped so that
// a wide sweep still fits a terminal; csv/json carry all of them).
std::vector<std::string> axis_columns(const std::vector<lar::registry::RunRecord>& runs, size_t cap) {
  std::vector<std::string> cols;
  std::set<std::string> seen;
  for (const auto& r : runs)
    for (auto it = r.axes.begin(); it != r.axes.end(); ++it)
      if (seen.insert(it.key()).second) cols.push_back(it.key());
  if (cols.size() > cap) cols.resize(cap);
  return cols;
}

std::string summary_cell(const lar::registry::RunRecord& r, const char* key) {
  auto it = r.summary.find(key);
  return it == r.summary.end() ? "-" : lar::registry::cell_text(*it);
}

int run_runs(const RunsOptions& o) {
  using namespace lar;
  using namespace lar::registry;
  const OutputFormat format = parse_format(o.format);
  RunFilter f;
  f.experiment = o.experiment;
  for (const auto& w : o.where) f.where.push_back(RunFilter::parse_where(w));
  f.status = parse_states(o.status);
  f.sort = o.desc && !o.sort.starts_with("-") ? "-" + o.sort : o.sort;
  f.limit = o.limit;
  f.with_config = format == OutputFormat::json;
  auto reg = Registry::open(o.db.empty() ? default_db_path() : fs::path(o.db), /*read_only=*/true);
  if (!o.experiment.empty()) {
    auto exps = reg.experiments();
    if (std::find(exps.begin(), exps.end(), o.experiment) == exps.end()) {
      std::string hint = did_you_mean(o.experiment, exps);
      throw UserError("unknown experiment '" + o.experiment + "'" + (hint.empty() ? "" : " (" + hint + ")"));
    }
  }
  auto runs = reg.runs(f);

  if (format == OutputFormat::json) {
    json arr = json::array();
    for (const auto& r : runs) arr.push_back(to_json(r));
    std::cout << arr.dump(2) << "\n";
    return 0;
  }
  const bool csv = format == OutputFormat::csv;
  auto axes = axis_columns(runs, csv ? 1000 : 6);
  TextTable t;
  t.headers = {"run", "status", "step"};
  for (const auto& a : axes) t.headers.push_back(a);
  for (const char* h : {"role", "final_loss", "tokens_per_s", "updated"}) t.headers.push_back(h);
  if (csv) {
    t.headers.push_back("hash");
    t.headers.push_back("reason");
  }
  t.right_align.assign(t.headers.size(), false);
  t.right_align[2] = true;
  for (const auto& r : runs) {
    std::vector<std::string> row = {r.run_id, to_string(r.status),
                                    csv ? std::to_string(r.step) : fmt::format("{}/{}", r.step, r.total_steps)};
    for (const auto& a : axes) row.push_back(r.axes.contains(a) ? cell_text(r.axes[a]) : "-");
    row.push_back(r.role);
    row.push_back(summary_cell(r, "final_loss"));
    row.push_back(summary_cell(r, "tokens_per_s"));
    row.push_back(fmt_time(r.updated_at));
    if (csv) {
      row.push_back(r.hash);
      row.push_back(r.reason);
    }
    t.rows.push_back(std::move(row));
  }
  if (csv) {
    std::cout << t.to_csv();
  } else {
    std::cout << t.to_table();
    std::cout << fmt::format("{} run(s)\n", runs.size());
  }
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "runs", "List runs in the registry (filter, sort, table/csv/json)", 41,
    [](CLI::App& app) -> lar::cli::Runner {
      auto o = std::make_shared<RunsOptions>();
      app.add_option("--db", o->db, "Registry database (default: $LAR_DB or $LAR_HOME/lar.db)");
      app.add_option("-e,--experiment", o->experiment, "Only runs of this experiment");
      app.add_option("-w,--where", o->where,
                     "KEY=VALUE or KEY!=VALUE on an axis (architecture=gdn), a dotted config path "
                     "(optimizer.lr=3e-4), summary.KEY, or a column (role, status); repeatable");
      app.add_option("-s,--status", o->status, "Only these states (comma-separated or repeated)");
      app.add_option("--sort", o->sort,
                     "Sort key: run_id, status, step, updated_at, a summary key (final_loss), an axis "
                     "or config path; --sort=-KEY sorts descending");
      app.add_flag("--desc", o->desc, "Sort descending");
      app.add_option("-n,--limit", o->limit, "Show at most N runs");
      app.add_option("-f,--format", o->format, "table | csv | json");
      return [o] { return run_runs(*o); };
    }};
