// `lar status [EXPERIMENT]` — progress of experiments, read from their run directories.
#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <ctime>
#include <iostream>
#include <memory>
#include <thread>

#include "cli/command.hpp"
#include "core/paths.hpp"
#include "runner/progress.hpp"
#include "runner/slurm_queue.hpp"

namespace {

struct StatusArgs {
  std::string experiment;
  bool once = false;
  double interval_s = 1.0;
};

std::atomic<bool> g_quit{false};
void on_quit(int) { g_quit = true; }

std::vector<std::string> snapshot(const StatusArgs& a, bool& active) {
  using namespace lar::runner;
  std::vector<std::string> names = a.experiment.empty() ? list_experiments() : std::vector<std::string>{a.experiment};
  std::vector<std::string> lines;
  active = false;
  if (names.empty()) {
    lines.push_back("no runs under " + lar::runs_root().string());
    return lines;
  }
  for (const auto& n : names) {
    ExperimentProgress p = read_experiment_progress(n);
    active = active || p.active();
    for (auto& l : render_progress(p)) lines.push_back(std::move(l));
    // Cells launched through Slurm: what the queue says (pending reasons, follow-up job).
    SlurmView v = read_slurm_view(n);
    active = active || !v.tasks.empty();
    for (auto& l : render_slurm_view(v)) lines.push_back(std::move(l));
  }
  return lines;
}

int terminal_width() {
  winsize ws{};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 20) return ws.ws_col;
  return 100;
}

// Cut a line to `width` columns (UTF-8 aware), so that each line takes exactly one row
// and the redraw can move the cursor back up by the line count.
std::string fit(const std::string& s, int width) {
  int cols = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) continue;
    if (++cols > width) return s.substr(0, i);
  }
  return s;
}

int run_status(const StatusArgs& a) {
  bool active = false;
  if (a.once || !lar::cli::stdout_is_tty()) {
    for (const auto& l : snapshot(a, active)) std::cout << l << "\n";
    return 0;
  }
  // Live display: redraw in place every interval until nothing runs any more or Ctrl-C.
  struct sigaction sa {};
  sa.sa_handler = on_quit;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  size_t shown = 0;
  for (;;) {
    auto lines = snapshot(a, active);
    std::time_t now = std::time(nullptr);
    char clock[16];
    std::strftime(clock, sizeof clock, "%H:%M:%S", std::localtime(&now));
    lines.insert(lines.begin(), std::string("lar status — ") + clock + (active ? "  (Ctrl-C to quit)" : ""));
    if (shown > 0) std::cout << "\x1b[" << shown << "A\r";
    std::cout << "\x1b[J";
    int width = terminal_width() - 1;
    for (const auto& l : lines) std::cout << fit(l, width) << "\n";
    std::cout << std::flush;
    shown = lines.size();
    if (!active || g_quit) break;
    for (double t = 0; t < a.interval_s && !g_quit; t += 0.05)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "status", "Progress of experiments: cells done/running/failed/pending, step, loss, ETA", 35,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<StatusArgs>();
      app.add_option("experiment", a->experiment, "experiment name (default: all under $LAR_HOME/runs)");
      app.add_flag("--once", a->once, "print one snapshot instead of a live display");
      app.add_option("--interval", a->interval_s, "seconds between refreshes of the live display")
          ->check(CLI::PositiveNumber);
      app.footer(
          "Reads the run directories (the source of truth), not the registry. On a terminal the\n"
          "display refreshes in place until no cell is running and no `lar launch` is active;\n"
          "otherwise (or with --once) it prints one snapshot. ETA = remaining steps of running\n"
          "and pending cells / the summed recent step rate of the running ones. For cells launched\n"
          "with --executor slurm, `slurm:` lines add squeue's view: tasks running and pending (with\n"
          "Slurm's reason) and the follow-up job (--then), e.g. DependencyNeverSatisfied when a\n"
          "training task failed so that it will never run.");
      return [a] { return run_status(*a); };
    }};
