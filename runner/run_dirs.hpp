#pragma once
// What the runner does to run directories (docs/protocol.md). The trainer owns
// status.json while it runs; the runner creates the directory, decides what to do with
// an existing one, and settles the status when a child died without saying how.
//
// Files the runner adds to the protocol:
//   <run dir>/config.json        Cell::run_config_json(), written atomically before a start
//   <run dir>/runner.jsonl       one line per start: {"time", "ended_at", "pid", "attempt",
//                                "exit_code", "signal", "state", "reason", "executor", "host"}
//   <run dir>/stdout.log         the child's stdout and stderr (appended across attempts)
//   <run dir>/cancel_requested   written by `lar cancel` (see runner/cancel.hpp)
//   <runs>/<experiment>/.launch.lock   held (flock) by the `lar launch` running the
//                                experiment; holds its pid and host as JSON
//   <runs>/<experiment>/<cell>.old-<n>  a run dir whose config hash no longer matches
//                                the spec, moved aside (never deleted)
#include <filesystem>
#include <optional>
#include <string>

#include "core/run_dir.hpp"
#include "experiments/cell.hpp"
#include "runner/executor.hpp"

namespace lar::runner {

namespace fs = std::filesystem;

// What a launch does with one cell, decided from its run directory.
enum class CellAction {
  start_new,      // no run dir (or it was moved aside): create it and start
  resume,         // same hash, partial (preempted, timeout, failed, cancelled, dead running,
                  // pending): start again; the trainer resumes from its last checkpoint
  skip_completed, // same hash, completed
  skip_diverged,  // same hash, diverged: a recorded result (runs are deterministic)
  skip_running,   // a live trainer (this host) or one on another host owns it
};
std::string to_string(CellAction a);

struct CellPlan {
  const experiments::Cell* cell = nullptr;
  fs::path run_dir;
  CellAction action = CellAction::start_new;
  std::string detail;                 // human note: "preempted at step 40", "hash changed"…
  bool hash_changed = false;          // the existing run dir must be moved aside first
  bool rekeyed = false;               // same run under a new hash (the schema gained default-valued
                                      // keys): config.json is rewritten, the run kept
  std::optional<RunStatus> prior;     // status before this launch (same hash only)
};

// Reads the run directory only; writes nothing (used by --dry-run too).
CellPlan classify_cell(const experiments::Cell& cell, const fs::path& run_dir);

// Makes the run directory ready to start: moves a changed one aside (returns where to, so
// the caller can print it), creates the folder, writes config.json and a pending
// status.json when there is none, removes a stale cancel request.
std::optional<fs::path> prepare_run_dir(const CellPlan& p);

// Renames run_dir to the first free "<name>.old-<n>" (n = 1, 2, …) and returns it.
fs::path move_aside(const fs::path& run_dir);

// The final state of an attempt, after its process is gone.
struct Settled {
  RunState state = RunState::failed;
  std::string reason;
  int attempt = 0;
  bool written_by_runner = false;  // the trainer left no final status; the runner wrote it
};
// `attempt_before` is status.attempt before the start: a trainer that opened the run dir
// has incremented it. When the trainer did not leave a final state, the state is derived
// from the exit (codes: 0 completed, 1 failed, 2 bad config, 3 preempted, 4 diverged; a
// signal → failed, or preempted when we asked it to stop) and written with the reason.
// A pending cancel request turns anything but completed/failed/diverged into cancelled.
Settled settle_after_exit(const JobExit& e, int attempt_before);

// One line in <run dir>/runner.jsonl.
void append_attempt_record(const JobExit& e, const Settled& s, const std::string& executor);

std::string this_host();
bool process_alive(long pid);
// status says running, on this host, and that process still exists.
bool alive_here(const RunStatus& s);

fs::path cancel_marker_path(const fs::path& run_dir);
bool cancel_requested(const fs::path& run_dir);

fs::path experiment_dir(const std::string& experiment);  // <runs>/<experiment>

// The per-experiment launch lock (flock on .launch.lock; released by the kernel when the
// process dies, so a crashed launch never leaves a stale lock). Throws UserError when
// another live process holds it.
class LaunchLock {
 public:
  explicit LaunchLock(const std::string& experiment);
  ~LaunchLock();
  LaunchLock(const LaunchLock&) = delete;
  LaunchLock& operator=(const LaunchLock&) = delete;

 private:
  int fd_ = -1;
};
// The pid of the live `lar launch` holding the experiment's lock, if any.
std::optional<long> active_launch_pid(const std::string& experiment);

}  // namespace lar::runner
