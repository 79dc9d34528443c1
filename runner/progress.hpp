#pragma once
// Progress of runs, read from run directories (the source of truth): what `lar status`
// shows and what `lar launch` puts on its live progress line.
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/run_dir.hpp"

namespace lar::runner {

struct CellProgress {
  std::string experiment;
  std::string cell_id;
  std::filesystem::path run_dir;
  RunState state = RunState::pending;
  bool stale = false;          // status says running, but its process (this host) is gone
  long step = 0;
  long total_steps = 0;        // from status.json, else the config's budget.steps
  int attempt = 0;
  std::string reason;
  std::string host;
  long pid = 0;
  std::optional<double> loss;          // last train loss in metrics.jsonl
  std::optional<double> steps_per_s;   // from the recent metrics lines
  std::optional<double> eta_s;         // running cells: (total - step) / steps_per_s
};

// Reads config.json, status.json and the tail of metrics.jsonl (the last 64 KiB).
CellProgress read_cell_progress(const std::filesystem::path& run_dir);

struct Counts {
  int total = 0, completed = 0, running = 0, failed = 0, diverged = 0, stopped = 0, pending = 0;
};

struct ExperimentProgress {
  std::string experiment;
  std::vector<CellProgress> cells;   // sorted by cell id
  Counts counts;
  std::optional<double> eta_s;       // remaining steps of running+pending cells / Σ rates
  std::optional<long> launch_pid;    // the live `lar launch` of this experiment
  bool active() const;               // something is running or a launch is alive
};

// Run directories of <runs>/<experiment>/ (moved-aside "*.old-N" folders are skipped).
// Throws UserError when the experiment has no runs folder.
ExperimentProgress read_experiment_progress(const std::string& experiment);
std::vector<std::string> list_experiments();  // sorted names under <runs>/

std::string format_duration(double seconds);  // "3h02m", "4m12s", "9s"
// The `lar status` block of one experiment: a summary line, then one line per running,
// failed, diverged or stopped cell.
std::vector<std::string> render_progress(const ExperimentProgress& p);

}  // namespace lar::runner
