// `lar reproduce PAPER/TABLE` — the one command: plan the paper's matrix at a scale, run
// every cell that is not done yet (live progress), sync the registry, print our table
// beside the published one and the audit. Re-running a finished reproduction only
// re-renders (every cell is skipped as completed); an interrupted one resumes (partial
// cells continue from their last checkpoint). --report DIR writes the results folder,
// --bundle FILE the runs without checkpoints in one .tar.gz.
#include <algorithm>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "cli/command.hpp"
#include "core/config_hash.hpp"
#include "core/error.hpp"
#include "core/hash.hpp"
#include "core/paths.hpp"
#include "registry/report/adapter.hpp"
#include "registry/report/bundle.hpp"
#include "registry/report/render.hpp"
#include "registry/report/results.hpp"
#include "registry/report/timing.hpp"
#include "runner/console.hpp"
#include "runner/devices.hpp"
#include "runner/launch.hpp"
#include "runner/registry_hooks.hpp"
#include "trainer/mixer.hpp"

namespace {

// The paper tables there are, wrapped for --help (the specs' folder, not a list kept here).
std::string table_list() {
  std::vector<std::string> tables;
  try {
    tables = lar::report::list_paper_tables();
  } catch (const std::exception&) {
    return "(none found: set LAR_PAPERS)";
  }
  std::string out, line;
  for (const std::string& t : tables) {
    if (!line.empty() && line.size() + 1 + t.size() > 88) {
      out += line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + t;
  }
  return out + line;
}

struct ReproduceArgs {
  std::string table;
  std::string scale;
  std::string executor = "local";
  int seeds = 0;
  int jobs = 0;
  std::string format = "md";
  bool no_audit = false;
  std::string report_dir;
  std::string bundle;
  long checkpoint_every = 0;
  bool no_run = false;
  bool estimate = false;
  std::vector<std::string> skip;  // AXIS=VALUE: cells not trained by this call
};

// An axis value as --skip spells it: strings bare, everything else as JSON (true, 512, 3e-4).
std::string axis_text(const lar::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

// --skip AXIS=VALUE (repeatable): the plan's cells less those with any such axis value, for the
// launch only (the table, audit, report and bundle still cover the whole table, the skipped
// cells as missing). A malformed rule, an axis the plan does not have or a value no cell takes
// is a UserError naming what there is.
std::vector<lar::experiments::Cell> cells_to_run(const lar::experiments::Plan& plan,
                                                 const std::vector<std::string>& skip) {
  using lar::UserError;
  std::vector<std::pair<std::string, std::string>> rules;
  for (const std::string& r : skip) {
    const auto eq = r.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == r.size())
      throw UserError("--skip '" + r + "': expected AXIS=VALUE, e.g. --skip architecture=mamba2");
    const std::string axis = r.substr(0, eq), value = r.substr(eq + 1);
    std::set<std::string> axes, values;
    for (const auto& c : plan.cells)
      for (const auto& [a, v] : c.axes) {
        axes.insert(a);
        if (a == axis) values.insert(axis_text(v));
      }
    const auto joined = [](const std::set<std::string>& xs) {
      std::string out;
      for (const auto& x : xs) out += (out.empty() ? "" : ", ") + x;
      return out;
    };
    if (!axes.count(axis)) throw UserError("--skip '" + r + "': the table has no axis '" + axis + "' (axes: " + joined(axes) + ")");
    if (!values.count(value))
      throw UserError("--skip '" + r + "': no cell has " + axis + " = " + value + " (values: " + joined(values) + ")");
    rules.emplace_back(axis, value);
  }
  std::vector<lar::experiments::Cell> out;
  for (const auto& c : plan.cells) {
    bool skipped = false;
    for (const auto& [a, v] : c.axes)
      for (const auto& [axis, value] : rules) skipped |= a == axis && axis_text(v) == value;
    if (!skipped) out.push_back(c);
  }
  return out;
}

// --estimate: the timing model's H200 prediction for this table at -j N, with the fraction
// of the paper's tokens and parameters, and the cells the GPU would refuse (they train on
// the CPU under backend: auto, so a GPU budget does not cover them).
int print_estimate(const ReproduceArgs& a, const lar::experiments::Plan& plan, const std::filesystem::path& spec) {
  using namespace lar;
  const int jobs = a.jobs > 0 ? a.jobs : 1;
  std::optional<experiments::Plan> paper;
  try {
    paper = report::load_paper_plan(spec, "paper", a.seeds);
  } catch (const UserError&) {
  }
  const report::TableTiming t = report::estimate_table(plan, jobs);
  std::cout << "predicted H200 time of " << a.table << " at scale " << (plan.scale.empty() ? "(none)" : plan.scale)
            << " (timing model, docs/reproduce.md \"Sizing a scale\"):\n\n"
            << report::timing_markdown(t, plan, paper ? &*paper : nullptr);
  int cpu = 0;
  for (const auto& c : plan.cells)
    if (c.config.is_object() && c.config.contains("model"))
      if (const std::string why = trainer::cuda_unsupported(c.config["model"]); !why.empty()) {
        if (cpu++ == 0) std::cout << "\nCells the CUDA backend refuses (backend auto trains them on the CPU):\n";
        std::cout << "- " << c.id << ": " << why << "\n";
      }
  return 0;
}

// The command line a results folder names (what another machine runs to add to it).
std::string command_line(const ReproduceArgs& a, int jobs) {
  std::string c = "lar reproduce " + a.table;
  if (!a.scale.empty()) c += " --scale " + a.scale;
  if (a.seeds > 0) c += " --seeds " + std::to_string(a.seeds);
  if (jobs > 0) c += " -j " + std::to_string(jobs);
  if (a.checkpoint_every > 0) c += " --checkpoint-every " + std::to_string(a.checkpoint_every);
  return c;
}

// --checkpoint-every N: every cell checkpoints each N steps, so that a reproduction cut
// off hard (SIGKILL, a machine taken back) loses at most N steps per cell. It is part of
// the run config, hence of the cell hash: give the same N on every call of one
// reproduction (another N is another config, and its cells start over).
void set_checkpoint_every(lar::experiments::Plan& plan, long every) {
  if (every <= 0) return;
  for (auto& c : plan.cells) {
    if (!c.config.is_object()) continue;
    c.config["checkpoint"]["every"] = every;
    c.hash = lar::config_hash(c.config);
  }
}

std::filesystem::path self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::path() : p;
}

// The results folder and the bundle, from what the registry holds now.
int write_outputs(const ReproduceArgs& a, const lar::experiments::Plan& plan, const std::filesystem::path& spec, int jobs,
                  const lar::report::Report* rep_done) {
  using namespace lar;
  if (!a.report_dir.empty()) {
    report::PaperReport p;
    p.spec = spec;
    p.plan = plan;
    std::optional<registry::Registry> reg;
    if (std::filesystem::exists(default_db_path())) reg.emplace(registry::Registry::open(default_db_path(), true));
    p.input = report::make_table_input(plan, spec, reg ? &*reg : nullptr);
    p.report = rep_done ? *rep_done : report::build_report(p.input);
    report::ResultsOptions o;
    o.table = a.table;
    o.scale = plan.scale;
    o.seeds = a.seeds;
    o.lar_exe = self_exe();
    o.command = command_line(a, jobs);
    auto s = report::write_results(p, reg ? &*reg : nullptr, a.report_dir, o);
    std::cout << "wrote the results folder " << a.report_dir << " (" << s.files.size() << " files)\n";
    for (const auto& w : s.warnings) std::cout << "  note: " << w << "\n";
  }
  if (!a.bundle.empty()) {
    json meta = {{"table", a.table}, {"scale", plan.scale}, {"seeds", a.seeds}, {"command", command_line(a, jobs)},
                 {"machine", report::machine_provenance()}};
    auto s = report::export_bundle(plan.experiment, runs_root(), a.bundle, meta);
    std::cout << "wrote the bundle " << a.bundle << ": " << s.cells.size() << " runs without checkpoints, "
              << s.bytes / 1024 << " KiB (import with `lar bundle import " << a.bundle << "`)\n";
  }
  return 0;
}

// CPU cells that pin their thread count (smoke scales: threads 1) can share the cores;
// otherwise the runner's default (one per GPU, or one CPU trainer using every core).
int default_jobs(const lar::experiments::Plan& plan) {
  using namespace lar;
  const bool gpu_present = !runner::visible_gpus().empty();
  long threads = 0;
  for (const auto& c : plan.cells) {
    if (runner::uses_gpu(c, gpu_present)) return runner::default_parallelism(plan);
    const long t = c.config.value("threads", 0L);
    if (t <= 0) return runner::default_parallelism(plan);
    threads = std::max(threads, t);
  }
  const long cores = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<int>(std::max(1L, cores / std::max(1L, threads)));
}

// --executor slurm: after the training array(s), one follow-up job (afterok on all of them)
// syncs the registry and writes the table and audit into the experiment folder, so the
// result lands even when this process is gone by then (logged out, killed).
std::string slurm_followup(const ReproduceArgs& a, const lar::experiments::Plan& plan, const std::string& spec) {
  namespace fs = std::filesystem;
  using lar::runner::shell_quote;
  const std::string dir = fs::absolute(lar::runs_root() / plan.experiment).lexically_normal().string();
  const std::string table = shell_quote(a.table.ends_with(".yaml") ? fs::absolute(spec).string() : a.table);
  std::string sel = plan.scale.empty() ? "" : " --scale " + shell_quote(plan.scale);
  if (a.seeds > 0) sel += " --seeds " + std::to_string(a.seeds);
  const std::string ext = a.format == "latex" ? "tex" : a.format;
  std::string cmd = "lar sync --quiet\nlar table " + table + sel + " --format " + a.format + " -o " +
                    shell_quote(dir + "/table." + ext) + "\n";
  if (!a.no_audit) cmd += "lar audit " + table + sel + " > " + shell_quote(dir + "/audit.md") + "\n";
  return cmd;
}

int run_reproduce(const ReproduceArgs& a) {
  using namespace lar;
  const auto spec = report::resolve_paper_spec(a.table);
  experiments::Plan plan = report::load_paper_plan(spec, a.scale, a.seeds);
  for (const auto& w : plan.notes) std::cerr << w << "\n";
  for (const auto& w : plan.warnings) std::cerr << w << "\n";
  set_checkpoint_every(plan, a.checkpoint_every);
  experiments::Plan to_run = plan;
  to_run.cells = cells_to_run(plan, a.skip);
  if (a.estimate) return print_estimate(a, to_run, spec);
  if (a.no_run) {
    report::Report rep = report::build_report(report::make_table_input(plan, spec, default_db_path()));
    std::cout << report::render_table(rep, a.format);
    if (!a.no_audit) std::cout << "\n" << report::audit_markdown(rep);
    write_outputs(a, plan, spec, a.jobs, &rep);
    return rep.failed_main_rows().empty() ? 0 : 1;
  }

  runner::LaunchOptions o;
  o.jobs = a.jobs > 0 ? a.jobs : default_jobs(plan);
  o.executor = a.executor;
  if (a.executor == "slurm") o.slurm.then_cmd = slurm_followup(a, plan, spec.string());
  const bool tty = cli::stdout_is_tty();
  auto console = std::make_shared<runner::ConsoleProgress>(std::cout, tty, false);
  o.hooks = runner::registry_hooks(default_db_path(), [console](const std::string& msg) {
    (*console)({runner::ProgressEvent::Kind::note, "", RunState::pending, msg, nullptr, 0, 0});
  });
  std::cout << "reproducing " << a.table << ": " << plan.experiment
            << (plan.scale.empty() ? "" : " at scale " + plan.scale) << ", " << to_run.cells.size() << " cells"
            << (to_run.cells.size() < plan.cells.size()
                    ? " (" + std::to_string(plan.cells.size() - to_run.cells.size()) + " skipped)"
                    : std::string())
            << ", " << (a.executor == "slurm" ? "as Slurm job arrays" : std::to_string(o.jobs) + " at a time") << " → "
            << (runs_root() / plan.experiment).string() << "\n";
  runner::LaunchSummary s = runner::launch(to_run, o, [console](const runner::ProgressEvent& ev) { (*console)(ev); });
  console->finish();
  const int launch_rc = runner::print_summary(std::cout, s);
  if (s.interrupted) {
    // What is done so far still comes back; the next call resumes the rest.
    if (!a.report_dir.empty() || !a.bundle.empty()) write_outputs(a, plan, spec, o.jobs, nullptr);
    return launch_rc;
  }
  if (s.followup && s.followup->ok())
    std::cout << "the follow-up job wrote the table and audit to " << (runs_root() / plan.experiment).string() << "/\n";

  report::TableInput in = report::make_table_input(plan, spec, default_db_path());
  report::Report rep = report::build_report(in);
  std::cout << "\n" << report::render_table(rep, a.format);
  if (!a.no_audit) std::cout << "\n" << report::audit_markdown(rep);
  write_outputs(a, plan, spec, o.jobs, &rep);
  return rep.failed_main_rows().empty() ? 0 : 1;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "reproduce", "Reproduce a paper table: plan, run what is missing, print table + audit", 10,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<ReproduceArgs>();
      app.add_option("table", a->table, "paper table, e.g. laa/table2 (the list is below), or a spec .yaml")->required();
      app.add_option("--scale", a->scale, "smoke (2 CPU cores, minutes) | mini (1 GPU, ~1 h) | paper; default: the spec's");
      app.add_option("--executor", a->executor,
                     "where cells run: local | slurm (job arrays, then one job afterok on them that syncs "
                     "the registry and writes table.<ext> + audit.md into runs/<experiment>/)")
          ->check(CLI::IsMember({"local", "slurm"}));
      app.add_option("--seeds", a->seeds, "run seeds 0..N-1 of every cell (default: the spec's seeds)")
          ->check(CLI::PositiveNumber);
      app.add_option("-j,--jobs", a->jobs, "cells at once (default: one per GPU; on CPU, cores / threads per cell)")
          ->check(CLI::PositiveNumber);
      app.add_option("--format", a->format, "table format: md | latex | csv | json")
          ->check(CLI::IsMember({"md", "latex", "csv", "json"}));
      app.add_flag("--no-audit", a->no_audit, "print the table only");
      app.add_option("--report", a->report_dir,
                     "write the results folder DIR: README.md (table beside the paper's, epochs, claims), "
                     "audit.md/.json, table.csv, the figures as SVG, provenance.md/.json");
      app.add_option("--bundle", a->bundle,
                     "write FILE (.tar.gz): this experiment's run folders without checkpoints plus a registry "
                     "of them (lar bundle import FILE reads it back)");
      app.add_option("--checkpoint-every", a->checkpoint_every,
                     "checkpoint every N steps (default: the spec's checkpoint.every); part of the config hash, "
                     "so give the same N on every call of one reproduction")
          ->check(CLI::PositiveNumber);
      app.add_flag("--estimate", a->estimate,
                   "train nothing: predict the H200 wall time of every cell and of the table at -j N "
                   "(timing model), with the fraction of the paper's tokens and parameters");
      app.add_flag("--no-run", a->no_run, "train nothing: print, and write --report / --bundle from the runs there are");
      app.add_option("--skip", a->skip,
                     "AXIS=VALUE (repeatable): do not train the cells with that axis value this call, e.g. "
                     "--skip architecture=mamba2; the table, audit, report and bundle still cover every cell "
                     "(the skipped ones as missing), and a later call without it trains them");
      app.footer("Tables: " + table_list() + " (experiments/papers/). Exit code: 0\n"
                 "when every main cell has an included run, 1 otherwise, 130 when interrupted.\n"
                 "Resuming: run the same command again; completed cells are skipped and partial ones\n"
                 "continue from their last checkpoint (taken every checkpoint.every steps and on\n"
                 "SIGTERM/SIGINT, so `timeout 570 lar reproduce …` stops cleanly). --report and --bundle\n"
                 "are written even when the run is interrupted.\n"
                 "See docs/reproduce.md.");
      return [a] { return run_reproduce(*a); };
    }};
