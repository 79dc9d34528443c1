#include "runner/cancel.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "runner/progress.hpp"
#include "runner/run_dirs.hpp"
#include "runner/slurm_executor.hpp"
#include "runner/slurm_queue.hpp"

namespace lar::runner {

namespace fs = std::filesystem;

CancelReport cancel(const std::string& experiment, const CancelOptions& options) {
  ExperimentProgress p = read_experiment_progress(experiment);  // UserError when unknown
  CancelReport report;
  std::optional<long> launch = p.launch_pid;

  if (options.cell) {
    bool known = false;
    std::vector<std::string> ids;
    for (const auto& c : p.cells) {
      ids.push_back(c.cell_id);
      known = known || c.cell_id == *options.cell;
    }
    if (!known) {
      std::string hint = did_you_mean(*options.cell, ids);
      throw UserError("experiment '" + experiment + "' has no cell '" + *options.cell + "'" +
                      (hint.empty() ? "" : " (" + hint + ")"));
    }
  }

  const char* user = std::getenv("USER");
  std::string why = "cancelled by lar cancel (" + std::string(user ? user : "?") + "@" + this_host() +
                    ", pid " + std::to_string(::getpid()) + ")";

  // Cells whose task is in Slurm's queue (pending or running, any node): scancel the task.
  // Slurm SIGTERMs a running trainer, which checkpoints; a pending task just leaves.
  SlurmView slurm = read_slurm_view(experiment);
  if (slurm.used && !slurm.available)
    report.notes.push_back("squeue did not answer: tasks of this experiment still in Slurm were not cancelled");
  std::vector<SlurmView::Task> slurm_targets;
  std::vector<std::string> scancel = {"scancel"};
  for (const auto& t : slurm.tasks) {
    if (options.cell && t.cell_id != *options.cell) continue;
    atomic_write(cancel_marker_path(t.run_dir), why + "\n");
    slurm_targets.push_back(t);
    scancel.push_back(t.job.id);
  }
  // The whole experiment: its follow-up jobs too (they could never run after this).
  if (!options.cell)
    for (const auto& f : slurm.followups) scancel.push_back(f.id);
  if (scancel.size() > 1) {
    CommandResult r = run_command(scancel);
    if (r.exit_code != 0) report.notes.push_back("scancel: " + r.out);
    report.slurm_jobs.assign(scancel.begin() + 1, scancel.end());
  }
  auto in_slurm = [&](const std::string& cell) {
    return std::any_of(slurm_targets.begin(), slurm_targets.end(), [&](const auto& t) { return t.cell_id == cell; });
  };

  std::vector<const CellProgress*> targets;  // running here: to be stopped
  for (const auto& c : p.cells) {
    if (options.cell && c.cell_id != *options.cell) continue;
    if (in_slurm(c.cell_id)) continue;
    if (c.state == RunState::running && !c.stale) {
      if (c.host != this_host()) {
        report.notes.push_back(c.cell_id + " runs on " + c.host + " (pid " + std::to_string(c.pid) +
                               "); run lar cancel there");
        continue;
      }
      atomic_write(cancel_marker_path(c.run_dir), why + "\n");
      targets.push_back(&c);
    } else if (c.state == RunState::pending && launch) {
      // The live launch may start it any moment (or just has): it honours the request.
      atomic_write(cancel_marker_path(c.run_dir), why + "\n");
      if (options.cell) report.will_not_start.push_back(c.cell_id);
    }
  }

  if (!options.cell && launch) {
    ::kill(static_cast<pid_t>(*launch), SIGTERM);  // it forwards SIGTERM to its children
    report.launch_pid = launch;
  } else {
    for (const auto* c : targets) ::kill(static_cast<pid_t>(c->pid), SIGTERM);
  }

  // Wait for the trainers to exit (they write a checkpoint first).
  using clock = std::chrono::steady_clock;
  auto deadline = clock::now() + std::chrono::milliseconds(static_cast<long>(options.wait_s * 1000));
  auto all_gone = [&] {
    for (const auto* c : targets)
      if (process_alive(c->pid)) return false;
    return true;
  };
  while (!all_gone() && clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(50));

  for (const auto* c : targets) {
    RunDir rd(c->run_dir);
    if (process_alive(c->pid)) {
      report.still_running.push_back(c->cell_id);
      continue;
    }
    // A live launch settles the status itself (cancel_requested → cancelled): give it a
    // moment, so that only one process writes the final transition.
    auto settle_deadline = clock::now() + std::chrono::seconds(launch ? 3 : 0);
    std::optional<RunStatus> s;
    for (;;) {
      s = rd.read_status();
      bool settled = s && s->state != RunState::running && !cancel_requested(c->run_dir);
      if (settled || clock::now() >= settle_deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (s && s->state != RunState::cancelled && s->state != RunState::completed &&
        s->state != RunState::failed && s->state != RunState::diverged) {
      rd.transition(*s, RunState::cancelled, why);
    }
    std::error_code ec;
    fs::remove(cancel_marker_path(c->run_dir), ec);
    if (s && s->state != RunState::cancelled)
      report.notes.push_back(c->cell_id + " ended " + to_string(s->state) + " before the cancel took effect");
    else
      report.cancelled.push_back(c->cell_id);
  }

  // Slurm tasks: wait until they left the queue (a running trainer checkpoints first).
  auto slurm_gone = [&](std::vector<std::string>& left) {
    left.clear();
    std::vector<std::string> ids;
    for (const auto& t : slurm_targets) ids.push_back(t.job.id);
    auto queue = query_queue(ids);
    for (const auto& t : slurm_targets)
      if (!queue || queue->count(t.job.id)) left.push_back(t.cell_id);
    return left.empty();
  };
  std::vector<std::string> left;
  while (!slurm_targets.empty() && !slurm_gone(left) && clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  for (const auto& t : slurm_targets) {
    if (std::find(left.begin(), left.end(), t.cell_id) != left.end()) {
      report.still_running.push_back(t.cell_id);
      continue;
    }
    // A live launch settles it itself (it sees the task CANCELLED); otherwise we do.
    RunDir rd(t.run_dir);
    auto settle_deadline = clock::now() + std::chrono::seconds(launch ? 10 : 0);
    std::optional<RunStatus> s;
    for (;;) {
      s = rd.read_status();
      bool settled = s && s->state != RunState::running && !cancel_requested(t.run_dir);
      if (settled || clock::now() >= settle_deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    bool ended = s && (s->state == RunState::completed || s->state == RunState::failed ||
                       s->state == RunState::diverged || s->state == RunState::timeout);
    if (s && !ended && s->state != RunState::cancelled) rd.transition(*s, RunState::cancelled, why);
    std::error_code ec;
    fs::remove(cancel_marker_path(t.run_dir), ec);
    if (ended) report.notes.push_back(t.cell_id + " ended " + to_string(s->state) + " before the cancel took effect");
    else report.cancelled.push_back(t.cell_id);
  }
  return report;
}

}  // namespace lar::runner
