// The Slurm executor's pure parts: state mapping, the generated scripts, the launch
// records and the `lar status` lines (no cluster needed).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "core/fs.hpp"
#include "runner/slurm_executor.hpp"
#include "runner/slurm_queue.hpp"

using namespace lar;
using namespace lar::runner;

TEST(SlurmStates, MapToRunStatesWithReasons) {
  EXPECT_EQ(map_slurm_state("PENDING").state, RunState::pending);
  EXPECT_FALSE(map_slurm_state("PENDING").terminal);
  EXPECT_EQ(map_slurm_state("RUNNING").state, RunState::running);
  EXPECT_EQ(map_slurm_state("COMPLETED").state, RunState::completed);
  EXPECT_EQ(map_slurm_state("TIMEOUT").state, RunState::timeout);
  EXPECT_EQ(map_slurm_state("PREEMPTED").state, RunState::preempted);
  EXPECT_EQ(map_slurm_state("CANCELLED").state, RunState::cancelled);
  auto oom = map_slurm_state("OUT_OF_MEMORY");
  EXPECT_EQ(oom.state, RunState::failed);
  EXPECT_EQ(oom.reason, "Slurm: out of memory");
  EXPECT_EQ(map_slurm_state("NODE_FAIL").reason, "Slurm: node failure");
  EXPECT_EQ(map_slurm_state("FAILED").state, RunState::failed);
  EXPECT_TRUE(map_slurm_state("FAILED").terminal);
}

TEST(SlurmScript, ArrayThrottleSignalRequeueAndResources) {
  SlurmOptions o;
  o.lar_binary = "/opt/lar/bin/lar";
  o.partition = "gpu";
  o.time = "04:00:00";
  o.gpus_per_job = 1;
  o.array_throttle = 2;
  o.signal_lead_s = 90;
  o.max_timeout_requeues = 5;
  o.sbatch_args = {"--qos=high"};
  std::string s = render_array_script("exp1", "/runs/exp1/slurm/L/manifest.tsv", "/runs/exp1/slurm/L/logs", 1001, 12, o);
  EXPECT_EQ(s.rfind("#!/bin/bash\n", 0), 0u);
  for (const char* line : {"#SBATCH --job-name=lar-exp1\n", "#SBATCH --array=0-11%2\n",
                           "#SBATCH --output=/runs/exp1/slurm/L/logs/%A_%a.out\n", "#SBATCH --requeue\n",
                           "#SBATCH --signal=B:USR2@90\n", "#SBATCH --partition=gpu\n", "#SBATCH --time=04:00:00\n",
                           "#SBATCH --gres=gpu:1\n", "#SBATCH --qos=high\n",
                           "exec /opt/lar/bin/lar slurm-task --manifest /runs/exp1/slurm/L/manifest.tsv --offset 1001 "
                           "--max-timeout-requeues 5\n"})
    EXPECT_NE(s.find(line), std::string::npos) << line << "\nin\n" << s;
  EXPECT_EQ(s.find("USR1"), std::string::npos) << "NCCL uses USR1";
}

TEST(SlurmScript, FollowUpDependsAfterokOnEveryArrayAndRunsTheCommandWithTheLaunchHome) {
  SlurmOptions o;
  o.lar_binary = "/opt/lar/bin/lar";
  o.partition = "cpu";
  o.sbatch_args = {"--account=proj"};
  o.time = "04:00:00";  // the training limit: not for the follow-up
  o.gpus_per_job = 2;
  o.then_cmd = "lar sync --quiet\nlar table laa/table2 -o '/r/t.md'";
  ::setenv("LAR_HOME", "/data/lar/./home/", 1);
  ::setenv("LAR_DB", "/data/lar/reg.db", 1);
  std::string s = render_then_script("exp1", "/runs/exp1/slurm/L", {"123", "124"}, o);
  ::unsetenv("LAR_HOME");
  ::unsetenv("LAR_DB");
  EXPECT_EQ(s.rfind("#!/bin/bash\n", 0), 0u);
  for (const char* line : {"#SBATCH --job-name=lar-exp1-then\n", "#SBATCH --output=/runs/exp1/slurm/L/then.out\n",
                           "#SBATCH --dependency=afterok:123:124\n", "#SBATCH --partition=cpu\n",
                           "#SBATCH --account=proj\n", "set -eo pipefail\n", "export LAR_HOME=/data/lar/home\n",
                           "export LAR_DB=/data/lar/reg.db\n", "export PATH=/opt/lar/bin:\"$PATH\"\n",
                           "lar sync --quiet\nlar table laa/table2 -o '/r/t.md'\n"})
    EXPECT_NE(s.find(line), std::string::npos) << line << "\nin\n" << s;
  EXPECT_EQ(s.find("--time"), std::string::npos) << s;
  EXPECT_EQ(s.find("--gres"), std::string::npos) << s;
  EXPECT_EQ(s.find("--array"), std::string::npos) << s;

  // Nothing to train: no dependency, it runs right away.
  std::string now = render_then_script("exp1", "/L", {}, o);
  EXPECT_EQ(now.find("--dependency"), std::string::npos) << now;
  EXPECT_NE(now.find("runs right away"), std::string::npos) << now;
}

TEST(SlurmScript, ShellQuote) {
  EXPECT_EQ(shell_quote("/a/b-c_d.yaml"), "/a/b-c_d.yaml");
  EXPECT_EQ(shell_quote("a b"), "'a b'");
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
  EXPECT_EQ(shell_quote(""), "''");
}

TEST(SlurmQueue, LaunchRecordsMapManifestLinesToArrayTasks) {
  namespace fs = std::filesystem;
  fs::path home = fs::temp_directory_path() / ("lar_slurm_unit_" + std::to_string(::getpid()));
  fs::remove_all(home);
  ::setenv("LAR_HOME", home.c_str(), 1);
  fs::path l1 = home / "runs" / "exp" / "slurm" / "20261129-100000-1";
  fs::path l2 = home / "runs" / "exp" / "slurm" / "20261129-110000-2";
  fs::path broken = home / "runs" / "exp" / "slurm" / "20261129-120000-3";  // sbatch failed: no jobs.json
  fs::create_directories(l1);
  fs::create_directories(l2);
  fs::create_directories(broken);
  atomic_write(l1 / "manifest.tsv", "a\t/r/a\nb\t/r/b\nc\t/r/c\n");
  atomic_write(l1 / "jobs.json", R"({"experiment":"exp","job_ids":["10","11"],
    "arrays":[{"job":"10","offset":0,"count":2},{"job":"11","offset":2,"count":1}],"then_job":"12"})");
  atomic_write(l2 / "manifest.tsv", "b\t/r/b\n");
  atomic_write(l2 / "jobs.json", R"({"experiment":"exp","job_ids":["20"]})");  // older record format
  auto launches = read_slurm_launches("exp");
  ::unsetenv("LAR_HOME");
  fs::remove_all(home);
  ASSERT_EQ(launches.size(), 2u);
  EXPECT_EQ(launches[0].task_id(0), "10_0");
  EXPECT_EQ(launches[0].task_id(1), "10_1");
  EXPECT_EQ(launches[0].task_id(2), "11_0");
  EXPECT_EQ(launches[0].task_id(3), "");
  EXPECT_EQ(launches[0].then_job, "12");
  EXPECT_EQ(launches[0].manifest[2].first, "c");
  EXPECT_EQ(launches[0].manifest[2].second, "/r/c");
  EXPECT_EQ(launches[1].task_id(0), "20_0");
  EXPECT_EQ(launches[1].then_job, "");
}

TEST(SlurmQueue, StatusLinesSayStateAndReason) {
  SlurmView v;
  EXPECT_TRUE(render_slurm_view(v).empty()) << "never used Slurm: no lines";
  v.used = true;
  auto lines = render_slurm_view(v);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("squeue did not answer"), std::string::npos);

  v.available = true;
  v.tasks = {{"a", "/r/a", {"10_0", "RUNNING", "", "n1"}},
             {"b", "/r/b", {"10_1", "PENDING", "JobArrayTaskLimit", ""}},
             {"c", "/r/c", {"10_2", "PENDING", "JobArrayTaskLimit", ""}}};
  v.followups = {{"12", "PENDING", "DependencyNeverSatisfied", ""}};
  lines = render_slurm_view(v);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], "  slurm: 1 task(s) running (a = 10_0 on n1), 2 pending (JobArrayTaskLimit: the array's throttle (%K)); array job(s) 10");
  EXPECT_EQ(lines[1],
            "  slurm: follow-up job 12 PENDING — DependencyNeverSatisfied: a training task did not complete, so it "
            "will never run (scancel 12, or relaunch to retry)");
  EXPECT_EQ(explain_slurm_reason("Dependency"), "Dependency: waits for the training array(s) to complete");
  EXPECT_EQ(explain_slurm_reason("SomethingNew"), "SomethingNew");
}

TEST(SlurmOptionsCheck, TimeFormatsMemAndSignalLead) {
  EXPECT_EQ(slurm_time_seconds("1"), 60);
  EXPECT_EQ(slurm_time_seconds("1:30"), 90);
  EXPECT_EQ(slurm_time_seconds("04:00:00"), 4 * 3600);
  EXPECT_EQ(slurm_time_seconds("2-3"), 2 * 86400 + 3 * 3600);
  EXPECT_EQ(slurm_time_seconds("2-3:04"), 2 * 86400 + 3 * 3600 + 4 * 60);
  EXPECT_EQ(slurm_time_seconds("1-00:00:05"), 86400 + 5);
  EXPECT_EQ(slurm_time_seconds("UNLIMITED"), -1);
  for (const char* bad : {"", "4h", "1:2:3:4", "-1", "1-", "1:", ":5", "abc", "1-2-3"})
    EXPECT_FALSE(slurm_time_seconds(bad).has_value()) << bad;

  SlurmOptions o;
  EXPECT_EQ(check_slurm_options(o), "");
  o.time = "4h";
  EXPECT_EQ(check_slurm_options(o),
            "--time '4h' is not a Slurm time limit (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S or UNLIMITED)");
  o.time = "1";  // 60 s, with the default lead of 120 s
  EXPECT_EQ(check_slurm_options(o), "--signal-lead 120 is not shorter than --time 1 (60 s): the time-limit warning "
                                    "would come before the task starts");
  o.signal_lead_s = 50;
  EXPECT_EQ(check_slurm_options(o), "");
  o.mem = "32GB";
  EXPECT_EQ(check_slurm_options(o),
            "--mem '32GB' is not a Slurm memory size (a number with an optional K, M, G or T, e.g. 32G)");
  o.mem = "32G";
  EXPECT_EQ(check_slurm_options(o), "");
}
