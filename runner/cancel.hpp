#pragma once
// `lar cancel EXPERIMENT [--cell ID]` — stop running cells of an experiment.
//
// The mechanism (all through files and signals, so it works from any shell):
//   - `lar launch` holds <runs>/<experiment>/.launch.lock (flock) and writes its pid in it;
//     each trainer writes its own pid and host into its run dir's status.json.
//   - cancel first writes <run dir>/cancel_requested (the reason) into every cell it stops,
//     so whoever settles the run records it as `cancelled` rather than `preempted`.
//   - Whole experiment with a live launch: SIGTERM to the launch, which drops the cells it
//     has not started (they stay pending) and forwards SIGTERM to its children.
//     One cell, or no live launch: SIGTERM straight to the trainer's pid (this host only).
//   - The trainer checkpoints and exits; the launch settles the status (cancel_requested →
//     cancelled). cancel waits up to `wait_s` and settles it itself when no launch did.
//   - Slurm: cells whose array task is still in Slurm's queue (read from the launch
//     records under <runs>/<experiment>/slurm/ and squeue) get `scancel <array>_<i>`,
//     pending or running, on any node; without --cell the experiment's follow-up jobs
//     too. Slurm SIGTERMs a running trainer, which checkpoints; cancel waits until the
//     tasks left the queue and records them cancelled (or lets the live launch do it).
//   - A pending cell named with --cell while a launch is alive is skipped by that launch
//     when its turn comes (recorded cancelled). A relaunch removes stale requests and
//     resumes cancelled cells from their last checkpoint.
#include <optional>
#include <string>
#include <vector>

namespace lar::runner {

struct CancelOptions {
  std::optional<std::string> cell;  // only this cell
  double wait_s = 60;               // how long to wait for the trainers to exit
};

struct CancelReport {
  std::vector<std::string> cancelled;      // stopped and recorded cancelled
  std::vector<std::string> still_running;  // SIGTERM sent, still alive after wait_s
  std::vector<std::string> will_not_start; // pending cells the live launch will skip
  std::vector<std::string> notes;          // e.g. cells running on another host
  std::optional<long> launch_pid;          // the launch that was told to stop
  std::vector<std::string> slurm_jobs;     // Slurm tasks/jobs scancelled ("123_4", "125")
};

// Throws UserError for an unknown experiment or cell.
CancelReport cancel(const std::string& experiment, const CancelOptions& options);

}  // namespace lar::runner
