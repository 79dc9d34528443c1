// `lar launch SPEC` — run every cell of an experiment spec (runner::launch does the work).
#include <cstdlib>
#include <iostream>
#include <memory>
#include <filesystem>
#include <sstream>

#include "cli/command.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "experiments/cell.hpp"
#include "runner/console.hpp"
#include "runner/launch.hpp"
#include "runner/local_executor.hpp"
#include "runner/slurm_executor.hpp"
#include "runner/registry_hooks.hpp"

namespace {

struct LaunchArgs {
  std::string spec;
  std::string scale;
  int jobs = 0;
  std::string executor = "local";
  bool dry_run = false;
  bool no_registry = false;
  std::string trainer_cmd;
  double grace_s = 300;
  lar::runner::SlurmOptions slurm;
  bool then_given = false;  // --then on the command line (even as '')
  std::vector<std::string> slurm_flags_given;  // Slurm-group flags on the command line
};

// --dry-run --executor slurm: the sbatch script(s) the launch would submit.
void print_slurm_dry_run(const lar::experiments::Plan& plan, const lar::runner::LaunchSummary& s,
                         lar::runner::SlurmOptions o) {
  using namespace lar::runner;
  int n = 0;
  for (const auto& c : s.cells) n += (c.action == CellAction::start_new || c.action == CellAction::resume);
  if (n == 0 && o.then_cmd.empty()) return;
  if (o.lar_binary.empty()) o.lar_binary = this_executable();
  int chunk = o.max_array_size > 0 ? o.max_array_size : 1001;
  auto dir = (std::filesystem::absolute(lar::runs_root()) / plan.experiment / "slurm" / "<launch-id>").string();
  std::vector<std::string> arrays;
  for (int offset = 0, k = 0; offset < n; offset += chunk, ++k) {
    std::cout << "\n--- " << dir << "/array-" << k << ".sbatch ---\n"
              << render_array_script(plan.experiment, dir + "/manifest.tsv", dir + "/logs", offset,
                                     std::min(chunk, n - offset), o);
    arrays.push_back("<array-" + std::to_string(k) + " job id>");
  }
  if (!o.then_cmd.empty())
    std::cout << "\n--- " << dir << "/then.sbatch ---\n" << render_then_script(plan.experiment, dir, arrays, o);
}

// Slurm options with another executor would be silently ignored: say so instead. Then
// the values the flag parser cannot judge alone (formats Slurm expects, --signal-lead
// against --time). All before anything is written.
void check_slurm_flags(const LaunchArgs& a) {
  if (a.then_given && a.executor != "slurm")
    throw lar::UserError("--then needs --executor slurm (it submits a Slurm job that runs after the training "
                         "arrays); with --executor " + a.executor + ", run the command after `lar launch` returns");
  if (!a.slurm_flags_given.empty() && a.executor != "slurm") {
    std::string names;
    for (const auto& n : a.slurm_flags_given) names += (names.empty() ? "" : ", ") + n;
    throw lar::UserError(names + (a.slurm_flags_given.size() == 1 ? " is a Slurm option" : " are Slurm options") +
                         ": add --executor slurm, or leave " + (a.slurm_flags_given.size() == 1 ? "it" : "them") +
                         " out with --executor " + a.executor);
  }
  if (a.then_given && a.slurm.then_cmd.find_first_not_of(" \t\n") == std::string::npos)
    throw lar::UserError("--then: the command is empty (give a shell command, e.g. --then 'lar sync')");
  if (a.executor == "slurm")
    if (std::string why = lar::runner::check_slurm_options(a.slurm); !why.empty()) throw lar::UserError(why);
}

int run_launch(const LaunchArgs& a) {
  using namespace lar;
  check_slurm_flags(a);
  // UserError on a bad spec or cell, before anything is written. lar's own trainer in a
  // local launch needs the data here; a Slurm job reads it on the cluster's file system, a
  // dry run not at all, and what another --trainer-cmd reads lar cannot know.
  const bool other_trainer = env_string("LAR_TRAINER_CMD").has_value();  // runner/local_executor.hpp
  const bool data_here = !a.dry_run && a.executor == "local" && a.trainer_cmd.empty() && !other_trainer;
  experiments::Plan plan = experiments::load_plan(a.spec, a.scale, {.require_data = data_here});
  for (const auto& w : plan.notes) std::cerr << w << "\n";
  for (const auto& w : plan.warnings) std::cerr << w << "\n";

  runner::LaunchOptions o;
  o.jobs = a.jobs;
  o.executor = a.executor;
  o.dry_run = a.dry_run;
  o.stop_grace_s = a.grace_s;
  o.slurm = a.slurm;
  if (!a.trainer_cmd.empty()) {
    std::istringstream in(a.trainer_cmd);
    for (std::string w; in >> w;) o.trainer_cmd.push_back(w);
  }
  bool tty = cli::stdout_is_tty();
  auto console = std::make_shared<runner::ConsoleProgress>(std::cout, tty, a.dry_run);
  if (!a.no_registry && !a.dry_run)
    o.hooks = runner::registry_hooks(default_db_path(), [console](const std::string& msg) {
      (*console)({runner::ProgressEvent::Kind::note, "", RunState::pending, msg, nullptr, 0, 0});
    });

  std::cout << (a.dry_run ? "dry run: " : "") << plan.experiment
            << (plan.scale.empty() ? "" : " (scale " + plan.scale + ")") << " → "
            << (runs_root() / plan.experiment).string() << "\n";
  runner::LaunchSummary s = runner::launch(plan, o, [console](const runner::ProgressEvent& ev) { (*console)(ev); });
  console->finish();
  if (a.dry_run && a.executor == "slurm") print_slurm_dry_run(plan, s, a.slurm);
  return runner::print_summary(std::cout, s);
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "launch", "Run the cells of an experiment spec (skips completed, resumes partial)", 30,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<LaunchArgs>();
      app.add_option("spec", a->spec, "experiment spec (YAML)")->required()->check(CLI::ExistingFile);
      app.add_option("--scale", a->scale, "named scale of the spec (smoke, mini, paper); default: the spec's");
      app.add_option("-j,--jobs", a->jobs,
                     "cells at once; default: one per visible GPU for cuda cells, else 1 "
                     "(a CPU trainer already uses every core)")
          ->check(CLI::PositiveNumber);
      app.add_option("--executor", a->executor, "where cells run: local (child processes) or slurm (job arrays)")
          ->check(CLI::IsMember({"local", "slurm"}));
      auto* sl = "Slurm (--executor slurm)";
      app.add_option("--partition", a->slurm.partition, "Slurm partition")->group(sl);
      app.add_option("--time", a->slurm.time,
                     "time limit per task: minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S, e.g. 04:00:00")
          ->group(sl);
      app.add_option("--gpus-per-job", a->slurm.gpus_per_job, "GPUs per array task (--gres=gpu:G)")
          ->group(sl)->check(CLI::NonNegativeNumber);
      app.add_option("--nproc", a->slurm.nproc,
                     "data-parallel ranks per run: each task runs the trainer through srun, one task per "
                     "GPU, ranks may span nodes (docs/distributed.md); default LAR_SLURM_NPROC, else 1")
          ->group(sl)->check(CLI::PositiveNumber);
      app.add_option("--cpus-per-task", a->slurm.cpus_per_task, "CPUs per array task")
          ->group(sl)->check(CLI::NonNegativeNumber);
      app.add_option("--mem", a->slurm.mem, "memory per task, e.g. 32G")->group(sl);
      app.add_option("--array-throttle", a->slurm.array_throttle, "at most K tasks of the array at once (%K)")
          ->group(sl)->check(CLI::NonNegativeNumber);
      app.add_option("--sbatch-arg", a->slurm.sbatch_args, "extra #SBATCH line (repeatable), e.g. --qos=high")
          ->group(sl);
      app.add_option("--dependency", a->slurm.dependency, "--dependency for the arrays, e.g. afterok:123")->group(sl);
      app.add_option("--then", a->slurm.then_cmd,
                     "shell command run as one Slurm job after every array task completed "
                     "(--dependency=afterok), e.g. 'lar sync && lar table laa/table2 -o t.md'; never runs "
                     "when a task fails. Script: runs/<experiment>/slurm/<launch-id>/then.sbatch")
          ->group(sl)
          ->each([a](const std::string&) { a->then_given = true; });
      app.add_option("--signal-lead", a->slurm.signal_lead_s,
                     "seconds before the time limit at which USR2 asks the trainer to checkpoint")
          ->group(sl)->check(CLI::PositiveNumber);
      app.add_option("--max-timeout-requeues", a->slurm.max_timeout_requeues,
                     "requeues after hitting the time limit before the run is marked timeout")
          ->group(sl)->check(CLI::NonNegativeNumber);
      app.add_option("--max-array-size", a->slurm.max_array_size,
                     "split arrays at this size (default: MaxArraySize from scontrol show config)")
          ->group(sl)->check(CLI::NonNegativeNumber);
      app.add_flag("--dry-run", a->dry_run, "show what would run, skip or resume; write nothing");
      app.add_flag("--no-registry", a->no_registry, "do not register/sync the runs in the SQLite registry");
      app.add_option("--grace", a->grace_s, "seconds to wait for stopped cells to checkpoint before SIGKILL");
      app.add_option("--trainer-cmd", a->trainer_cmd,
                     "trainer command line ('--run-dir D' is appended); default: this lar's `train` "
                     "(env LAR_TRAINER_CMD)");
      app.footer(
          "Runs go to $LAR_HOME/runs/<experiment>/<cell>/ (docs/protocol.md). Ctrl-C stops cleanly:\n"
          "running cells checkpoint and are marked preempted, unstarted ones stay pending; launch\n"
          "again to resume. A second Ctrl-C kills the running cells. Exit code: 0 when every cell\n"
          "completed, 1 when some did not, 130 when interrupted, 2 for a bad spec or flag.");
      CLI::App* parsed = &app;
      return [a, parsed, sl] {
        for (const CLI::Option* opt : parsed->get_options())
          if (opt->get_group() == sl && opt->count() > 0) a->slurm_flags_given.push_back(opt->get_name());
        return run_launch(*a);
      };
    }};
