// `lar launch SPEC` — run every cell of an experiment spec (runner::launch does the work).
#include <iostream>
#include <memory>
#include <sstream>

#include "cli/command.hpp"
#include "core/paths.hpp"
#include "experiments/cell.hpp"
#include "runner/console.hpp"
#include "runner/launch.hpp"
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
};

int run_launch(const LaunchArgs& a) {
  using namespace lar;
  experiments::Plan plan = experiments::load_plan(a.spec, a.scale);  // UserError on a bad spec
  for (const auto& w : plan.warnings) std::cerr << w << "\n";

  runner::LaunchOptions o;
  o.jobs = a.jobs;
  o.executor = a.executor;
  o.dry_run = a.dry_run;
  o.stop_grace_s = a.grace_s;
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
      app.add_option("--executor", a->executor, "where cells run: local")->check(CLI::IsMember({"local"}));
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
      return [a] { return run_launch(*a); };
    }};
