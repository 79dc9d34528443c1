// `lar launch`, `lar status`, `lar cancel` as a user runs them: the real `lar` binary with
// the test-only fake trainer (LAR_TRAINER_CMD) on a small spec.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <thread>

#include "core/fs.hpp"
#include "tests/runner/lar_process.hpp"
#include "core/run_dir.hpp"
#include "registry/registry.hpp"
#include "tests/runner/helpers.hpp"


using namespace lar;
using lar::test::spawn_lar;
using lar::test::wait_exit;
using namespace lar::runner::test;
using namespace std::chrono_literals;

namespace {

struct CliEnv : TempHome {
  explicit CliEnv(const std::string& name) : TempHome(name) {
    ::setenv("LAR_TRAINER_CMD", FAKE_TRAINER " train", 1);
    ::unsetenv("LAR_FAKE_TRAINER_OPTIONS");
    ::unsetenv("LAR_DB");
  }
  ~CliEnv() {
    ::unsetenv("LAR_TRAINER_CMD");
    ::unsetenv("LAR_FAKE_TRAINER_OPTIONS");
  }
  fs::path spec(const std::string& name, int seeds, int steps) {
    fs::path p = dir / (name + ".yaml");
    std::string list;
    for (int i = 0; i < seeds; ++i) list += (i ? ", " : "") + std::to_string(i);
    atomic_write(p, "name: " + name + "\nbase:\n  budget: {steps: " + std::to_string(steps) +
                        "}\nmatrix:\n  seed: [" + list + "]\n");
    return p;
  }
};


struct Result {
  int code;
  std::string out;
};
Result run_lar(const CliEnv& env, const std::vector<std::string>& args) {
  fs::path log = env.dir / "out.log";
  int code = wait_exit(spawn_lar(args, log));
  return {code, read_file(log)};
}

RunState state(const std::string& exp, const std::string& cell) {
  auto s = RunDir(run_dir_for(exp, cell)).read_status();
  return s ? s->state : RunState::pending;
}

template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = 10s) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return pred();
}

}  // namespace

TEST(CliLaunch, RunsRelaunchSkipsStatusAndRegistry) {
  CliEnv env("cli_launch");
  fs::path spec = env.spec("cli-exp", 4, 4);
  Result r = run_lar(env, {"launch", spec.string(), "-j", "2"});
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("plan: 4 cells — 4 new"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("done   s3 completed"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cli-exp: 4 cells — 4 completed, 0 failed\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("\x1b["), std::string::npos);  // not a terminal: no control codes

  Result again = run_lar(env, {"launch", spec.string()});
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_NE(again.out.find("4 completed (4 skipped, already done), 0 failed"), std::string::npos) << again.out;
  EXPECT_EQ(again.out.find("start "), std::string::npos);

  Result st = run_lar(env, {"status", "cli-exp"});
  EXPECT_EQ(st.code, 0);
  EXPECT_EQ(st.out, "cli-exp: 4 cells — 4 done, 0 running, 0 failed, 0 stopped, 0 pending\n");

  // The registry knows the runs, synced after each cell.
  auto reg = registry::Registry::open(default_db_path(), true);
  registry::RunFilter filter;
  filter.experiment = "cli-exp";
  auto runs = reg.runs(filter);
  ASSERT_EQ(runs.size(), 4u);
  for (const auto& run : runs) {
    EXPECT_EQ(run.status, RunState::completed) << run.run_id;
    EXPECT_EQ(run.step, 4);
  }
}

TEST(CliLaunch, FailureExitCodeAndDryRun) {
  CliEnv env("cli_fail");
  fs::path spec = env.spec("cli-fail", 3, 4);
  Result dry = run_lar(env, {"launch", spec.string(), "--dry-run"});  // never opens the registry
  ASSERT_EQ(dry.code, 0) << dry.out;
  EXPECT_NE(dry.out.find("  s1  new\n"), std::string::npos) << dry.out;
  EXPECT_NE(dry.out.find("cli-fail: 3 cells; 3 to run, 0 already completed (dry run: nothing written)"),
            std::string::npos) << dry.out;
  EXPECT_FALSE(fs::exists(runs_root()));
  EXPECT_FALSE(fs::exists(default_db_path()));
  // (the other tests here skip the registry: RunsRelaunchSkipsStatusAndRegistry covers it)

  ::setenv("LAR_FAKE_TRAINER_OPTIONS", R"({"s1": {"fail_at_step": 2}})", 1);
  Result r = run_lar(env, {"launch", spec.string(), "-j", "3", "--no-registry"});
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("FAIL   s1 failed: fake failure at step 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cli-fail: 3 cells — 2 completed, 1 failed\n  failed  s1: fake failure at step 2"),
            std::string::npos) << r.out;

  Result st = run_lar(env, {"status", "--once"});
  EXPECT_NE(st.out.find("cli-fail: 3 cells — 2 done, 0 running, 1 failed, 0 stopped, 0 pending"), std::string::npos)
      << st.out;
  EXPECT_NE(st.out.find("failed    s1 step      2/4       loss 3.3333  fake failure at step 2"), std::string::npos)
      << st.out;

  Result bad = run_lar(env, {"launch", (env.dir / "missing.yaml").string()});
  EXPECT_EQ(bad.code, 2);
  Result unknown = run_lar(env, {"status", "no-such-exp"});
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.out.find("no runs of experiment 'no-such-exp'"), std::string::npos) << unknown.out;
}

// A bad value of an environment variable lar reads is a user error (exit 2) naming the
// variable and the value (core/env.hpp), before anything is submitted.
TEST(CliLaunch, ABadEnvironmentValueIsAUserError) {
  CliEnv env("cli_env");
  fs::path spec = env.spec("cli-env", 1, 4);
  ::setenv("LAR_SLURM_NPROC", "many", 1);
  Result r = run_lar(env, {"launch", spec.string(), "--executor", "slurm"});
  ::unsetenv("LAR_SLURM_NPROC");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("LAR_SLURM_NPROC=many: expected an integer from 1 to 4096"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(run_dir_for("cli-env", "s0"))) << "a run directory was written";
}

TEST(CliLaunch, ThenNeedsTheSlurmExecutorAndDryRunPrintsTheFollowUpScript) {
  CliEnv env("cli_then");
  fs::path spec = env.spec("cli-then", 2, 4);
  Result local = run_lar(env, {"launch", spec.string(), "--then", "lar sync"});
  EXPECT_EQ(local.code, 2) << local.out;
  EXPECT_NE(local.out.find("--then needs --executor slurm (it submits a Slurm job that runs after the training "
                           "arrays); with --executor local, run the command after `lar launch` returns"),
            std::string::npos) << local.out;
  Result flags = run_lar(env, {"launch", spec.string(), "--partition", "gpu", "--time=1:00:00"});
  EXPECT_EQ(flags.code, 2) << flags.out;
  EXPECT_NE(flags.out.find("--partition, --time are Slurm options: add --executor slurm, or leave them out with "
                           "--executor local"),
            std::string::npos) << flags.out;
  Result time = run_lar(env, {"launch", spec.string(), "--executor", "slurm", "--time", "2h"});
  EXPECT_EQ(time.code, 2) << time.out;
  EXPECT_NE(time.out.find("--time '2h' is not a Slurm time limit"), std::string::npos) << time.out;
  Result lead = run_lar(env, {"launch", spec.string(), "--executor", "slurm", "--time", "2", "--signal-lead", "300"});
  EXPECT_EQ(lead.code, 2) << lead.out;
  EXPECT_NE(lead.out.find("--signal-lead 300 is not shorter than --time 2 (120 s)"), std::string::npos) << lead.out;
  Result empty = run_lar(env, {"launch", spec.string(), "--executor", "slurm", "--then", " "});
  EXPECT_EQ(empty.code, 2) << empty.out;
  EXPECT_NE(empty.out.find("--then: the command is empty"), std::string::npos) << empty.out;
  EXPECT_FALSE(fs::exists(runs_root())) << "a bad flag writes nothing";

  // The dry run prints both scripts (no cluster needed) and writes nothing.
  Result dry = run_lar(env, {"launch", spec.string(), "--executor", "slurm", "--dry-run", "--then", "echo 'all done'"});
  ASSERT_EQ(dry.code, 0) << dry.out;
  EXPECT_NE(dry.out.find("/slurm/<launch-id>/array-0.sbatch ---\n"), std::string::npos) << dry.out;
  EXPECT_NE(dry.out.find("/slurm/<launch-id>/then.sbatch ---\n"), std::string::npos) << dry.out;
  EXPECT_NE(dry.out.find("#SBATCH --dependency=afterok:<array-0 job id>\n"), std::string::npos) << dry.out;
  EXPECT_NE(dry.out.find("\necho 'all done'\n"), std::string::npos) << dry.out;
  EXPECT_FALSE(fs::exists(runs_root()));

  // Data parallel: one srun task per GPU in every array task's script.
  Result dp = run_lar(env, {"launch", spec.string(), "--executor", "slurm", "--dry-run", "--nproc", "2"});
  ASSERT_EQ(dp.code, 0) << dp.out;
  EXPECT_NE(dp.out.find("#SBATCH --ntasks=2\n#SBATCH --gpus-per-task=1\n"), std::string::npos) << dp.out;
  EXPECT_NE(dp.out.find("srun) --ntasks=2 --gpus-per-task=1 --cpu-bind=none "), std::string::npos) << dp.out;
  Result dp0 = run_lar(env, {"launch", spec.string(), "--executor", "slurm", "--dry-run", "--nproc", "0"});
  EXPECT_EQ(dp0.code, 2) << dp0.out;
  EXPECT_NE(dp0.out.find("--nproc"), std::string::npos) << dp0.out;
  Result dpl = run_lar(env, {"launch", spec.string(), "--nproc", "2"});
  EXPECT_EQ(dpl.code, 2) << dpl.out;
  EXPECT_NE(dpl.out.find("--nproc is a Slurm option"), std::string::npos) << dpl.out;
  EXPECT_FALSE(fs::exists(runs_root()));

  Result help = run_lar(env, {"launch", "--help"});
  EXPECT_NE(help.out.find("--nproc"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("--then"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("afterok"), std::string::npos) << help.out;
}

TEST(CliLaunch, CtrlCLeavesConsistentStateAndARelaunchCompletes) {
  CliEnv env("cli_sigint");
  fs::path spec = env.spec("cli-int", 3, 30);
  ::setenv("LAR_FAKE_TRAINER_OPTIONS", R"({"*": {"step_ms": 60}})", 1);
  fs::path log = env.dir / "launch.log";
  pid_t pid = spawn_lar({"launch", spec.string(), "-j", "2", "--no-registry"}, log);
  ASSERT_TRUE(eventually([] { return state("cli-int", "s0") == RunState::running && state("cli-int", "s1") == RunState::running; }));
  std::this_thread::sleep_for(200ms);
  ::kill(pid, SIGINT);
  EXPECT_EQ(wait_exit(pid), 130) << read_file(log);
  std::string out = read_file(log);
  EXPECT_NE(out.find("stopping: sent SIGTERM to 2 running cell(s)"), std::string::npos) << out;
  EXPECT_NE(out.find("interrupted: run the same `lar launch` again to resume"), std::string::npos) << out;
  EXPECT_EQ(state("cli-int", "s0"), RunState::preempted);
  EXPECT_EQ(state("cli-int", "s1"), RunState::preempted);
  EXPECT_EQ(state("cli-int", "s2"), RunState::pending);

  ::setenv("LAR_FAKE_TRAINER_OPTIONS", R"({"*": {"step_ms": 5}})", 1);
  Result r = run_lar(env, {"launch", spec.string(), "-j", "3", "--no-registry"});
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("  resume s0: preempted at step"), std::string::npos) << r.out;
  for (const char* id : {"s0", "s1", "s2"}) EXPECT_EQ(state("cli-int", id), RunState::completed);
}

TEST(CliCancel, StopsARunningCell) {
  CliEnv env("cli_cancel");
  fs::path spec = env.spec("cli-cancel", 2, 3);
  ::setenv("LAR_FAKE_TRAINER_OPTIONS", R"({"s0": {"hang": true}})", 1);
  fs::path log = env.dir / "launch.log";
  pid_t pid = spawn_lar({"launch", spec.string(), "-j", "2", "--no-registry"}, log);
  ASSERT_TRUE(eventually([] { return state("cli-cancel", "s0") == RunState::running; }));
  Result c = run_lar(env, {"cancel", "cli-cancel", "--cell", "s0", "--wait", "10"});
  EXPECT_EQ(c.code, 0) << c.out;
  EXPECT_EQ(c.out, "cancelled: s0\n");
  EXPECT_EQ(wait_exit(pid), 1) << read_file(log);  // not every cell completed
  EXPECT_EQ(state("cli-cancel", "s0"), RunState::cancelled);
  EXPECT_EQ(state("cli-cancel", "s1"), RunState::completed);
  Result again = run_lar(env, {"cancel", "cli-cancel"});
  EXPECT_EQ(again.out, "nothing running in cli-cancel\n");
}
