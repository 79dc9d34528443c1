#include "runner/cancel.hpp"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "runner/progress.hpp"
#include "runner/run_dirs.hpp"

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
  std::vector<const CellProgress*> targets;  // running here: to be stopped
  for (const auto& c : p.cells) {
    if (options.cell && c.cell_id != *options.cell) continue;
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
  return report;
}

}  // namespace lar::runner
