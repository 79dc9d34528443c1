#pragma once
// lar::registry — the SQLite registry of experiments, cells and runs.
//
// The run directory is the source of truth (docs/protocol.md); the registry is an index
// over it: `sync` ingests run directories idempotently and incrementally, the queries
// below read it. One process writes at a time (BEGIN IMMEDIATE, busy_timeout 30 s, WAL),
// any number read. Other modules use only this header.
//
//   auto reg = lar::registry::Registry::open(lar::default_db_path());
//   reg.register_cells(planned);                 // runner: before launching
//   auto stats = reg.sync(lar::runs_root());     // ingest every run directory
//   for (auto& r : reg.runs({.experiment = "laa-table2"})) ...
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/json.hpp"
#include "core/run_dir.hpp"

namespace lar::registry {

namespace fs = std::filesystem;

// The schema version this build migrates a database to (PRAGMA user_version).
int schema_version();

// A cell the runner is about to launch; registered so that `lar runs` / `lar status`
// show it as pending before any trainer starts. Deliberately a plain struct (the
// registry does not depend on lar_experiments).
struct PlannedCell {
  std::string experiment;
  std::string cell_id;
  std::string hash;
  json axes = json::object();     // axis name → value
  std::string role = "main";      // main | exploratory
  std::string baseline;           // cell id of the matched baseline, "" when none
  json config = json::object();   // the fully resolved run config
  fs::path run_dir;               // $LAR_HOME/runs/<experiment>/<cell_id>
};

struct SyncedRun {
  std::string run_id;
  bool is_new = false;         // first time this run was seen
  bool reset = false;          // metrics.jsonl was rewritten/truncated: re-ingested from 0
  long metric_rows = 0;        // rows added by this sync
  int bad_lines = 0;           // complete but unparsable lines skipped
  RunState status = RunState::pending;
  long step = 0;
  long total_steps = 0;
};

struct SyncStats {
  int runs_seen = 0;           // run directories found (with a config.json)
  int runs_changed = 0;        // runs whose rows/status changed
  int runs_unchanged = 0;      // nothing new on disk since the last sync
  long metric_rows = 0;        // metric rows added in total
  double seconds = 0;
  std::vector<SyncedRun> changed;     // one entry per changed run
  std::vector<std::string> errors;    // "<run dir>: <why>" for directories that failed
};

struct MetricPoint {
  long step = 0;
  double tokens = 0;
  double value = 0;            // NaN when the trainer logged a non-finite value (null)
  double wall_time = 0;
};

struct CheckpointRecord {
  long step = 0;
  std::string path;
  long long bytes = 0;
};

struct EvalRecord {
  long step = 0;
  double tokens = 0;
  double wall_time = 0;
  json results = json::object();   // {"val_loss": ..., "acc": ..., "acc@512": ...}
};

struct RunRecord {
  std::string run_id;          // "<experiment>/<cell_id>"
  std::string experiment;
  std::string cell_id;
  std::string hash;
  json axes = json::object();
  json config = json::object();  // null unless RunFilter::with_config (always set by run())
  std::string role = "main";
  std::string baseline;          // "" when none
  RunState status = RunState::pending;
  long step = 0;
  long total_steps = 0;
  std::string reason;
  json summary = json::object();
  int attempts = 0;
  std::string host;
  std::string run_dir;
  double updated_at = 0;         // unix seconds (status.json's updated_at, or registration)
  std::vector<StatusEvent> history;  // filled by run(); by runs() only with with_history
};

struct WhereClause {
  std::string key;     // axis name, alias (core/config_schema axis_aliases) or dotted config path
  std::string value;   // compared as number when both sides are numbers, else as text
  bool negate = false; // key!=value
};

struct RunFilter {
  std::string experiment;              // "" = all
  std::vector<WhereClause> where;      // all must hold
  std::vector<RunState> status;        // empty = any
  std::string sort = "run_id";         // column (run_id experiment cell_id status step
                                       // updated_at attempts), a summary key (final_loss),
                                       // an axis or a config path; prefix '-' = descending
  size_t limit = 0;                    // 0 = no limit
  bool with_config = true;             // parse the full config of each run
  bool with_history = false;           // load status history of each run

  // Parse "k=v" / "k!=v" (throws UserError naming the text when malformed).
  static WhereClause parse_where(const std::string& text);
};

class Registry {
 public:
  // Opens (creating and migrating when needed) the database at `path`.
  // read_only: the file must exist (else UserError "no registry at PATH"); no writes.
  static Registry open(const fs::path& path, bool read_only = false);
  ~Registry();
  Registry(Registry&&) noexcept;
  Registry& operator=(Registry&&) noexcept;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  const fs::path& path() const;
  int user_version() const;

  // --- writing --------------------------------------------------------------------
  // Ingest every run directory runs_root/<experiment>/<cell>/ (with a config.json).
  // Idempotent and incremental; each run is one transaction.
  SyncStats sync(const fs::path& runs_root);
  // Ingest one run directory (same rules as sync).
  SyncedRun sync_run(const fs::path& run_dir);
  // Record planned cells (experiment, cell, a pending run). Existing runs keep their
  // status; their cell data (hash, axes, config) is updated. One transaction.
  void register_cells(const std::vector<PlannedCell>& cells);

  // --- reading --------------------------------------------------------------------
  std::vector<std::string> experiments();
  std::vector<RunRecord> runs(const RunFilter& filter = {});
  // Exact run id, else a unique run-id prefix, else a unique cell id or hash prefix.
  // nullopt when nothing matches; UserError listing the candidates when ambiguous.
  std::optional<RunRecord> run(const std::string& run_id_or_unique_prefix);
  // Like run() but throws UserError "unknown run 'X'" (with a did-you-mean) when absent.
  RunRecord require_run(const std::string& run_id_or_unique_prefix);
  std::vector<std::string> run_ids();
  std::vector<MetricPoint> metric_series(const std::string& run_id, const std::string& name);
  std::vector<std::string> metric_names(const std::string& run_id);
  // The last logged point of every metric of a run (name → point).
  std::map<std::string, MetricPoint> last_metrics(const std::string& run_id);
  long long metric_row_count(const std::string& run_id = "");  // "" = all runs
  std::vector<CheckpointRecord> checkpoints(const std::string& run_id);
  std::vector<EvalRecord> evals(const std::string& run_id);

  // PRAGMA integrity_check → "ok" when healthy.
  std::string integrity_check();

  struct Impl;

 private:
  explicit Registry(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace lar::registry
