// `lar sync` — ingest every run directory under $LAR_HOME/runs into the registry.
#include <fmt/format.h>

#include <iostream>

#include "cli/command.hpp"
#include "core/paths.hpp"
#include "registry/registry.hpp"
#include "registry/text_table.hpp"

namespace {

struct SyncOptions {
  std::string db;
  std::string runs;
  bool quiet = false;
};

// Changed runs listed one per line up to this many; the rest are summed up.
constexpr size_t kMaxListed = 50;

int run_sync(const SyncOptions& o) {
  using namespace lar;
  namespace fs = std::filesystem;
  const fs::path db = o.db.empty() ? default_db_path() : fs::path(o.db);
  const fs::path root = o.runs.empty() ? runs_root() : fs::path(o.runs);
  auto reg = registry::Registry::open(db);
  registry::SyncStats st = reg.sync(root);
  if (!o.quiet) {
    for (size_t i = 0; i < st.changed.size() && i < kMaxListed; ++i) {
      const auto& r = st.changed[i];
      std::string what = fmt::format("+{} rows", r.metric_rows);
      if (r.is_new) what += ", new";
      if (r.reset) what += ", metrics re-read (file was rewritten)";
      if (r.bad_lines) what += fmt::format(", {} unreadable line(s) skipped", r.bad_lines);
      std::cout << fmt::format("  {}  {} {}/{}  {}\n", r.run_id, to_string(r.status), r.step, r.total_steps, what);
    }
    if (st.changed.size() > kMaxListed)
      std::cout << fmt::format("  ... and {} more changed runs\n", st.changed.size() - kMaxListed);
  }
  int new_runs = 0;
  for (const auto& r : st.changed) new_runs += r.is_new ? 1 : 0;
  std::cout << fmt::format("synced {} run(s) from {} into {}: {} changed ({} new), {} unchanged, +{} metric rows in {:.2f} s\n",
                           st.runs_seen, root.string(), db.string(), st.runs_changed, new_runs,
                           st.runs_unchanged, st.metric_rows, st.seconds);
  for (const auto& e : st.errors) std::cerr << "lar sync: warning: " << e << "\n";
  // The readable runs are ingested; a run directory that could not be read is a fault.
  return st.errors.empty() ? 0 : 1;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "sync", "Ingest run directories into the registry (idempotent, incremental)", 40,
    [](CLI::App& app) -> lar::cli::Runner {
      auto o = std::make_shared<SyncOptions>();
      app.add_option("--db", o->db, "Registry database (default: $LAR_DB or $LAR_HOME/lar.db)");
      app.add_option("--runs", o->runs, "Runs folder to ingest (default: $LAR_HOME/runs)");
      app.add_flag("-q,--quiet", o->quiet, "Print only the summary line");
      return [o] { return run_sync(*o); };
    }};
