#pragma once
// runner::launch — run every cell of a Plan to completion (or until stopped), the logic
// behind `lar launch` and `lar reproduce`.
//
// 1. Take the experiment's launch lock (one `lar launch` per experiment at a time).
// 2. Classify each cell from its run directory (runner/run_dirs.hpp): completed with the
//    same hash → skipped; partial → resumed; changed hash → moved aside to
//    <cell>.old-<n> (with a note) and started fresh.
// 3. Write config.json (+ a pending status) for every cell to run, call hooks.before_start
//    (the registry registers the cells), hand the jobs to the executor.
// 4. Until the executor is idle: settle each exited child's status (a child that died
//    without a final status gets one, with the reason), append a runner.jsonl line, call
//    hooks.after_cell (registry sync), report progress.
// 5. SIGINT/SIGTERM (Ctrl-C, or `lar cancel EXPERIMENT`): queued cells are dropped — their
//    run dirs stay pending — and running children get SIGTERM (the trainer checkpoints and
//    exits preempted); launch waits for them. A second signal, or stop_grace_s elapsing,
//    escalates to SIGKILL. Every run dir is left in a consistent, resumable state.
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/run_dir.hpp"
#include "experiments/cell.hpp"
#include "runner/executor.hpp"
#include "runner/run_dirs.hpp"
#include "runner/slurm_executor.hpp"

namespace lar::runner {

struct CellOutcome {
  std::string cell_id;
  std::filesystem::path run_dir;
  CellAction action = CellAction::start_new;  // what the launch decided
  RunState state = RunState::pending;         // where the cell ended up
  std::string reason;
  int attempt = 0;
  bool started = false;                       // a child ran during this launch
};

struct LaunchSummary {
  std::string experiment;
  std::vector<CellOutcome> cells;  // plan order
  int total = 0;
  int completed = 0;   // includes skipped ones
  int skipped = 0;     // already completed before this launch
  int failed = 0;
  int diverged = 0;
  int stopped = 0;     // preempted, timeout, cancelled (resumable by a relaunch)
  int pending = 0;     // never started (stopped early) or running elsewhere
  bool interrupted = false;
  bool dry_run = false;
  std::optional<FollowUp> followup;  // Slurm: the follow-up job (--then), as last seen
  bool all_completed() const { return completed == total; }
  void recount();
};

struct ProgressEvent {
  enum class Kind {
    note,      // a message for the user (moved aside, skipped because running elsewhere…)
    planned,   // one per cell after classification (message: the action and detail)
    started,   // a child started (message: where, e.g. "gpu 0")
    finished,  // a child ended (state, message: the reason)
    tick,      // about once a second while running
    stopping,  // a stop signal arrived (message says what happens next)
  };
  Kind kind = Kind::note;
  std::string cell_id;
  RunState state = RunState::pending;
  std::string message;
  const LaunchSummary* summary = nullptr;  // counts so far
  int running = 0;
  int queued = 0;
};
using ProgressCallback = std::function<void(const ProgressEvent&)>;

struct LaunchHooks {
  // After the run dirs exist and before any start (e.g. registry register_cells).
  std::function<void(const experiments::Plan&)> before_start;
  // After each child exits and its status is settled (e.g. registry sync of that run).
  std::function<void(const CellOutcome&)> after_cell;
  // Once at the end, also after a stop (e.g. a final registry sync).
  std::function<void(const LaunchSummary&)> at_end;
};

struct LaunchOptions {
  int jobs = 0;                          // 0: default_parallelism(plan) (runner/devices.hpp)
  std::string executor = "local";        // local | slurm
  SlurmOptions slurm;                    // for executor == "slurm"
  bool dry_run = false;                  // classify and report; write nothing, start nothing
  std::vector<std::string> trainer_cmd;  // empty: default_trainer_cmd() (local_executor.hpp)
  bool handle_signals = true;            // install SIGINT/SIGTERM handlers while running
  double stop_grace_s = 300;             // after SIGTERM, SIGKILL children still alive
  double tick_s = 1.0;
  LaunchHooks hooks;
};

LaunchSummary launch(const experiments::Plan& plan, const LaunchOptions& options,
                     const ProgressCallback& progress = {});

// Ask a running launch() in this process to stop, as SIGINT would (for embedding callers
// and tests). Safe from a signal handler.
void request_stop();

}  // namespace lar::runner
