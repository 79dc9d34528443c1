// `lar cancel EXPERIMENT [--cell ID]` — stop running cells (mechanism: runner/cancel.hpp).
#include <iostream>
#include <memory>

#include "cli/command.hpp"
#include "runner/cancel.hpp"

namespace {

struct CancelArgs {
  std::string experiment;
  std::string cell;
  double wait_s = 60;
};

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

int run_cancel(const CancelArgs& a) {
  lar::runner::CancelOptions o;
  if (!a.cell.empty()) o.cell = a.cell;
  o.wait_s = a.wait_s;
  lar::runner::CancelReport r = lar::runner::cancel(a.experiment, o);
  if (r.launch_pid)
    std::cout << "told lar launch (pid " << *r.launch_pid << ") to stop"
              << (r.slurm_jobs.empty() ? "; cells it had not started stay pending" : "") << "\n";
  if (!r.slurm_jobs.empty()) std::cout << "scancel " << join(r.slurm_jobs) << "\n";
  if (!r.cancelled.empty()) std::cout << "cancelled: " << join(r.cancelled) << "\n";
  if (!r.will_not_start.empty()) std::cout << "will not start: " << join(r.will_not_start) << "\n";
  for (const auto& n : r.notes) std::cout << "note: " << n << "\n";
  if (!r.still_running.empty()) {
    std::cout << "still running after " << a.wait_s << " s (SIGTERM sent / scancelled): " << join(r.still_running) << "\n";
    return 1;
  }
  if (r.cancelled.empty() && r.will_not_start.empty() && !r.launch_pid && r.slurm_jobs.empty())
    std::cout << "nothing running in " << a.experiment << (a.cell.empty() ? "" : " for cell " + a.cell) << "\n";
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "cancel", "Stop running cells of an experiment (they are recorded cancelled)", 36,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<CancelArgs>();
      app.add_option("experiment", a->experiment, "experiment name")->required();
      app.add_option("--cell", a->cell, "only this cell id");
      app.add_option("--wait", a->wait_s, "seconds to wait for the trainers (and Slurm tasks) to checkpoint and exit")
          ->check(CLI::NonNegativeNumber);
      app.footer(
          "Writes <run dir>/cancel_requested, then sends SIGTERM: to the experiment's `lar launch`\n"
          "(pid in runs/<experiment>/.launch.lock), which stops starting cells and forwards it, or —\n"
          "for --cell, or when no launch is alive — to the trainer's pid from status.json. Cells\n"
          "launched with --executor slurm whose array task is still queued or running (on any node)\n"
          "are scancelled instead (\"<array job>_<task>\", from runs/<experiment>/slurm/*/jobs.json);\n"
          "without --cell the experiment's follow-up jobs (--then) too. Cancelled cells resume from\n"
          "their last checkpoint on the next `lar launch`.");
      return [a] { return run_cancel(*a); };
    }};
