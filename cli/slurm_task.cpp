// `lar slurm-task` — what one Slurm array task runs (the sbatch scripts written by the
// Slurm executor exec it). Internal: users never type it. It
//   1. maps SLURM_ARRAY_TASK_ID + --offset to a run directory (line of the manifest),
//   2. runs `lar train --run-dir D` as its child and records start/exit events in
//      D/slurm.jsonl (job id, restart count, node, exit code),
//   3. on USR2 (the time-limit warning requested with --signal=B:USR2@N) forwards it to
//      the trainer, which checkpoints and exits 3, then requeues this task with
//      `scontrol requeue` — at most --max-timeout-requeues times, after which the run is
//      marked `timeout`. SIGTERM (preemption, requeue, scancel) is forwarded too; then
//      Slurm decides whether the task comes back.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/run_dir.hpp"
#include "runner/local_executor.hpp"
#include "runner/slurm_executor.hpp"

namespace {

volatile sig_atomic_t g_child = 0;
volatile sig_atomic_t g_usr2 = 0;
volatile sig_atomic_t g_term = 0;

void on_signal(int sig) {
  if (sig == SIGUSR2) g_usr2 = 1;
  else g_term = 1;
  if (g_child > 0) ::kill(g_child, sig == SIGUSR2 ? SIGUSR2 : SIGTERM);
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

struct Args {
  std::string manifest;
  int offset = 0;
  int max_timeout_requeues = 3;
};

int run_task(const Args& a) {
  using namespace lar;
  std::string task = env("SLURM_ARRAY_TASK_ID");
  if (task.empty()) throw UserError("lar slurm-task runs inside a Slurm array task (SLURM_ARRAY_TASK_ID is unset)");
  int index = std::stoi(task) + a.offset;
  std::ifstream in(a.manifest);
  if (!in) throw RuntimeError("cannot read the manifest " + a.manifest);
  std::string line, run_dir;
  for (int i = 0; std::getline(in, line); ++i)
    if (i == index) run_dir = line.substr(line.find('\t') + 1);
  if (run_dir.empty()) throw RuntimeError("manifest " + a.manifest + " has no line " + std::to_string(index));

  MetricsWriter events(std::filesystem::path(run_dir) / "slurm.jsonl");
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  events.append({{"event", "start"}, {"job", env("SLURM_JOB_ID")}, {"array_job", env("SLURM_ARRAY_JOB_ID")},
                 {"task", index}, {"restart", env("SLURM_RESTART_COUNT")}, {"node", host}, {"at", unix_now()}});

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGUSR2, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);

  std::vector<std::string> cmd = runner::default_trainer_cmd();
  cmd.push_back("--run-dir");
  cmd.push_back(run_dir);
  pid_t pid = ::fork();
  if (pid < 0) throw RuntimeError("fork() failed");
  if (pid == 0) {
    std::vector<char*> argv;
    for (auto& c : cmd) argv.push_back(c.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  g_child = pid;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);

  bool requeued = false;
  if (rc == 3 && g_usr2) {
    // Requeues of this job only (the id survives requeues): a relaunch starts a new count.
    int timeouts = 0;
    for (const auto& l : read_metrics(std::filesystem::path(run_dir) / "slurm.jsonl").lines)
      if (l.value("event", "") == "requeue" && l.value("job", "") == env("SLURM_JOB_ID")) ++timeouts;
    if (timeouts < a.max_timeout_requeues) {
      events.append({{"event", "requeue"}, {"reason", "time limit"}, {"job", env("SLURM_JOB_ID")}, {"at", unix_now()}});
      auto r = runner::run_command({"scontrol", "requeue", env("SLURM_JOB_ID")});
      requeued = r.exit_code == 0;
      if (!requeued) std::cerr << "lar slurm-task: scontrol requeue failed: " << r.out << "\n";
    } else {
      RunDir rd(run_dir);
      if (auto st = rd.read_status()) {
        RunStatus s = *st;
        rd.transition(s, RunState::timeout,
                      "time limit reached " + std::to_string(timeouts + 1) + " times (max_timeout_requeues " +
                          std::to_string(a.max_timeout_requeues) + ")");
      }
    }
  }
  events.append({{"event", "exit"}, {"rc", rc}, {"usr2", g_usr2 != 0}, {"term", g_term != 0},
                 {"requeued", requeued}, {"at", unix_now()}});
  return rc;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "slurm-task", "(internal) run one array task of a Slurm launch", 99,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<Args>();
      app.group("");  // hidden from `lar --help`
      app.add_option("--manifest", a->manifest, "manifest.tsv written by the Slurm executor")->required();
      app.add_option("--offset", a->offset, "index of this array's first manifest line");
      app.add_option("--max-timeout-requeues", a->max_timeout_requeues, "cap on requeues after time limits");
      return [a] { return run_task(*a); };
    }};
