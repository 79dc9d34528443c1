// The Slurm executor end to end on a real single-node cluster (tests/slurm/cluster.sh):
// `lar launch --executor slurm` as a user runs it, with the test-only fake trainer for the
// bookkeeping tests and the real trainer where checkpoints matter (preemption).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

#include "core/fs.hpp"
#include "tests/runner/lar_process.hpp"
#include "core/run_dir.hpp"
#include "runner/slurm_executor.hpp"
#include "runner/slurm_queue.hpp"


using namespace lar;
using lar::test::spawn_lar;
using lar::test::wait_exit;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// A fresh $LAR_HOME for one test (absolute: Slurm tasks read it from the environment).
struct Home {
  fs::path dir;
  explicit Home(const std::string& name) {
    dir = fs::path("/tmp") / ("lar_slurm_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    ::setenv("LAR_HOME", dir.c_str(), 1);
    ::setenv("LAR_TRAINER_CMD", FAKE_TRAINER " train", 1);
    ::unsetenv("LAR_FAKE_TRAINER_OPTIONS");
    ::unsetenv("LAR_DB");
  }
  ~Home() {
    ::unsetenv("LAR_TRAINER_CMD");
    ::unsetenv("LAR_FAKE_TRAINER_OPTIONS");
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  fs::path write(const std::string& name, const std::string& text) const {
    atomic_write(dir / name, text);
    return dir / name;
  }
  fs::path run_dir(const std::string& exp, const std::string& cell) const { return dir / "runs" / exp / cell; }
  std::vector<fs::path> launches(const std::string& exp) const {
    std::vector<fs::path> out;
    if (fs::exists(dir / "runs" / exp / "slurm"))
      for (const auto& e : fs::directory_iterator(dir / "runs" / exp / "slurm")) out.push_back(e.path());
    std::sort(out.begin(), out.end());
    return out;
  }
};

struct Output {
  int code = -1;
  std::string text;
};

Output run_lar(const std::string& args) {
  Output o;
  std::string cmd = std::string(LAR_BINARY) + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) o.text.append(buf, n);
  int st = ::pclose(p);
  o.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return o;
}


bool wait_until(const std::function<bool()>& pred, std::chrono::seconds limit) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(100ms);
  }
  return pred();
}

// The last step in metrics.jsonl (written every step; status.json only every few seconds).
long last_metric_step(const fs::path& run_dir) {
  auto lines = read_metrics(run_dir / "metrics.jsonl").lines;
  return lines.empty() ? 0 : lines.back().value("step", 0L);
}

std::optional<RunStatus> status_of(const fs::path& run_dir) {
  try {
    return RunDir(run_dir).read_status();
  } catch (...) {
    return std::nullopt;
  }
}

std::vector<std::string> job_ids(const fs::path& launch) {
  std::vector<std::string> ids;
  json doc = json::parse(read_file(launch / "jobs.json"));
  for (const auto& id : doc["job_ids"]) ids.push_back(id);
  return ids;
}

// How many `event` lines `lar slurm-task` wrote into the run's slurm.jsonl.
int count_events(const fs::path& run_dir, const std::string& event) {
  int n = 0;
  for (const auto& l : read_metrics(run_dir / "slurm.jsonl").lines) n += l["event"] == event;
  return n;
}

// Slurm holds a requeued job for 2 minutes (EligibleTime, reason BeginTime); the tests
// let it start at once so that the `slurm` label stays short. That hold is also what
// keeps a requeued job clear of its previous incarnation: slurmd revokes the job's
// credential when it tears the old one down, and a restart launched before that revoke
// is killed as "non-startable: Job credential revoked" (state FAILED). So a task may be
// hurried only once it waits on the hold alone: its old `lar slurm-task` wrote its exit
// event and the node is no longer COMPLETING.
bool held_and_settled(const std::string& task, const fs::path& run_dir) {
  auto q = runner::query_queue({task});
  if (!q || !q->count(task) || (*q)[task].reason != "BeginTime") return false;
  if (count_events(run_dir, "exit") < count_events(run_dir, "start")) return false;
  return runner::run_command({"sinfo", "-h", "-o", "%T"}).out.find("completing") == std::string::npos;
}

// Waits for the launch `pid` to exit while hurrying its requeued task along, once it has
// been held and settled for 2 s (a margin for slurmd's own bookkeeping).
int wait_hurrying(pid_t pid, const std::string& task, const fs::path& run_dir, int* hurried = nullptr) {
  bool settled = false;
  std::chrono::steady_clock::time_point settled_since;
  for (;;) {
    int st = 0;
    pid_t r = ::waitpid(pid, &st, WNOHANG);
    if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    const auto now = std::chrono::steady_clock::now();
    if (!held_and_settled(task, run_dir)) {
      settled = false;
    } else if (!settled) {
      settled = true;
      settled_since = now;
    } else if (now - settled_since >= 2s) {
      settled = false;
      if (runner::run_command({"scontrol", "update", "JobId=" + task, "StartTime=now"}).exit_code == 0 && hurried)
        ++*hurried;
    }
    std::this_thread::sleep_for(500ms);
  }
}

class Slurm : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(runner::run_command({"sinfo", "-h"}).exit_code, 0)
        << "no Slurm cluster: start one with tests/slurm/cluster.sh start";
  }
};

const char* kSweep =
    "name: sweep\n"
    "base: {budget: {steps: 5}}\n"
    "matrix:\n"
    "  lr: [0.001, 0.002, 0.003, 0.004]\n"
    "  seed: [0, 1, 2]\n";

}  // namespace

TEST_F(Slurm, TwelveCellSweepRunsAsOneThrottledArrayAndRelaunchSubmitsOnlyWhatIsMissing) {
  Home h("sweep");
  fs::path spec = h.write("sweep.yaml", kSweep);
  Output o = run_lar("launch " + spec.string() + " --executor slurm --array-throttle 2");
  ASSERT_EQ(o.code, 0) << o.text;
  auto launches = h.launches("sweep");
  ASSERT_EQ(launches.size(), 1u);
  EXPECT_EQ(job_ids(launches[0]).size(), 1u) << "one sbatch call for 12 cells";
  std::string script = read_file(launches[0] / "array-0.sbatch");
  EXPECT_NE(script.find("#SBATCH --array=0-11%2\n"), std::string::npos) << script;

  // Every cell completed, and never more than 2 ran at once (the throttle).
  std::vector<std::pair<double, int>> edges;
  for (const auto& e : fs::directory_iterator(h.dir / "runs" / "sweep")) {
    if (!fs::exists(e.path() / "config.json")) continue;
    auto st = status_of(e.path());
    ASSERT_TRUE(st.has_value()) << e.path();
    EXPECT_EQ(st->state, RunState::completed) << e.path() << ": " << st->reason;
    for (const auto& l : read_metrics(e.path() / "slurm.jsonl").lines) {
      if (l["event"] == "start") edges.push_back({l["at"].get<double>(), +1});
      if (l["event"] == "exit") edges.push_back({l["at"].get<double>(), -1});
    }
  }
  ASSERT_EQ(edges.size(), 24u);
  std::sort(edges.begin(), edges.end());
  int now = 0, most = 0;
  for (auto& [t, d] : edges) most = std::max(most, now += d);
  EXPECT_LE(most, 2);

  // Relaunch: everything is done, nothing is submitted.
  o = run_lar("launch " + spec.string() + " --executor slurm --array-throttle 2");
  ASSERT_EQ(o.code, 0) << o.text;
  EXPECT_EQ(h.launches("sweep").size(), 1u) << o.text;

  // Two cells lost their run dirs: only those two are submitted.
  fs::remove_all(h.run_dir("sweep", "lr1e-3.s0"));
  fs::remove_all(h.run_dir("sweep", "lr4e-3.s2"));
  o = run_lar("launch " + spec.string() + " --executor slurm --array-throttle 2");
  ASSERT_EQ(o.code, 0) << o.text;
  launches = h.launches("sweep");
  ASSERT_EQ(launches.size(), 2u);
  EXPECT_NE(read_file(launches[1] / "array-0.sbatch").find("#SBATCH --array=0-1%2\n"), std::string::npos);
  std::string manifest = read_file(launches[1] / "manifest.tsv");
  EXPECT_NE(manifest.find("lr1e-3.s0\t"), std::string::npos) << manifest;
  EXPECT_NE(manifest.find("lr4e-3.s2\t"), std::string::npos) << manifest;
  EXPECT_EQ(status_of(h.run_dir("sweep", "lr1e-3.s0"))->state, RunState::completed);
}

TEST_F(Slurm, ScancelledTaskIsRecordedCancelledWithCompleteMetricLines) {
  Home h("cancel");
  ::setenv("LAR_FAKE_TRAINER_OPTIONS", R"({"*": {"step_ms": 50}})", 1);
  fs::path spec = h.write("one.yaml", "name: one\nbase: {budget: {steps: 100000}}\nmatrix: {seed: [0]}\n");
  pid_t pid = spawn_lar({"launch", spec.string(), "--executor", "slurm"}, h.dir / "launch.log");
  fs::path rd = h.run_dir("one", "s0");
  ASSERT_TRUE(wait_until([&] { return last_metric_step(rd) >= 3; }, 60s))
      << read_file(h.dir / "launch.log");
  auto launches = h.launches("one");
  ASSERT_EQ(launches.size(), 1u);
  EXPECT_EQ(runner::run_command({"scancel", job_ids(launches[0])[0]}).exit_code, 0);
  EXPECT_EQ(wait_exit(pid), 1) << read_file(h.dir / "launch.log");
  auto st = status_of(rd);
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->state, RunState::cancelled) << st->reason;
  MetricsChunk m = read_metrics(rd / "metrics.jsonl");
  EXPECT_EQ(m.skipped_bad_lines, 0);
  EXPECT_EQ(m.next_offset, fs::file_size(rd / "metrics.jsonl")) << "a torn metrics line was left behind";
}

TEST_F(Slurm, ThousandCellsNeedOneSbatchOrTwoWhenSplit) {
  for (int max_array : {0, 600}) {
    Home h("thousand" + std::to_string(max_array));
    std::string seeds;
    for (int i = 0; i < 1000; ++i) seeds += (i ? ", " : "") + std::to_string(i);
    fs::path spec = h.write("big.yaml", "name: big\nbase: {budget: {steps: 1}}\nmatrix: {seed: [" + seeds + "]}\n");
    // Held jobs: submitted, never started; cancelled once counted.
    std::vector<std::string> args = {"launch", spec.string(), "--executor", "slurm", "--sbatch-arg=--hold", "--no-registry"};
    if (max_array) args.push_back("--max-array-size=" + std::to_string(max_array));
    pid_t pid = spawn_lar(args, h.dir / "launch.log");
    ASSERT_TRUE(wait_until([&] { auto l = h.launches("big"); return !l.empty() && fs::exists(l[0] / "jobs.json"); }, 120s))
        << read_file(h.dir / "launch.log");
    auto ids = job_ids(h.launches("big")[0]);
    EXPECT_EQ(ids.size(), max_array ? 2u : 1u);
    std::vector<std::string> cancel = {"scancel"};
    cancel.insert(cancel.end(), ids.begin(), ids.end());
    runner::run_command(cancel);
    EXPECT_EQ(wait_exit(pid), 1) << read_file(h.dir / "launch.log");
    EXPECT_EQ(status_of(h.run_dir("big", "s999"))->state, RunState::cancelled);
  }
}

TEST_F(Slurm, PreemptedTaskResumesFromItsCheckpointWithTheSameFinalLoss) {
  const char* spec_text =
      "name: pre\n"
      "base:\n"
      "  backend: cpu\n"
      "  threads: 1\n"
      "  model: {n_layers: 1, d_model: 64, n_heads: 4, vocab_size: 128}\n"
      "  data: {task: mqar, seq_len: 64, batch_size: 8, num_kv_pairs: 4}\n"
      "  budget: {steps: 3000}\n"
      "  checkpoint: {every: 50, keep: 2}\n"
      "  eval: {batches: 2}\n"
      "matrix: {seed: [3]}\n";
  double reference = 0;
  {
    Home h("preref");
    ::unsetenv("LAR_TRAINER_CMD");
    fs::path spec = h.write("pre.yaml", spec_text);
    Output o = run_lar("launch " + spec.string() + " --executor local --no-registry");
    ASSERT_EQ(o.code, 0) << o.text;
    reference = status_of(h.run_dir("pre", "s3"))->summary["final_loss"].get<double>();
  }
  Home h("pre");
  ::unsetenv("LAR_TRAINER_CMD");
  fs::path spec = h.write("pre.yaml", spec_text);
  pid_t pid = spawn_lar({"launch", spec.string(), "--executor", "slurm", "--no-registry"}, h.dir / "launch.log");
  fs::path rd = h.run_dir("pre", "s3");
  ASSERT_TRUE(wait_until([&] { return last_metric_step(rd) >= 120; }, 120s))
      << read_file(h.dir / "launch.log");
  std::string task = job_ids(h.launches("pre")[0])[0] + "_0";
  auto r = runner::run_command({"scontrol", "requeue", task});
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(wait_hurrying(pid, task, rd), 0) << read_file(h.dir / "launch.log");
  auto st = status_of(rd);
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->state, RunState::completed) << st->reason;
  EXPECT_GE(st->attempt, 2) << "the requeued task must have started a second attempt";
  bool saw_preempted = false;
  for (const auto& e : st->history) saw_preempted |= e.state == RunState::preempted;
  EXPECT_TRUE(saw_preempted);
  EXPECT_EQ(count_events(rd, "start"), 2);
  EXPECT_EQ(st->summary["final_loss"].get<double>(), reference) << "resume must be bit-identical";
}

namespace {

std::string then_job(const fs::path& launch) {
  return json::parse(read_file(launch / "jobs.json")).value("then_job", "");
}

// The time of the last "exit" event any task of the experiment wrote.
double last_task_exit(const Home& h, const std::string& exp) {
  double last = 0;
  for (const auto& e : fs::directory_iterator(h.dir / "runs" / exp))
    for (const auto& l : read_metrics(e.path() / "slurm.jsonl").lines)
      if (l["event"] == "exit") last = std::max(last, l["at"].get<double>());
  return last;
}

}  // namespace

TEST_F(Slurm, FollowUpJobRunsAfterokOnceEveryTaskOfEveryArrayCompleted) {
  Home h("then");
  fs::path spec = h.write("thn.yaml", "name: thn\nbase: {budget: {steps: 5}}\nmatrix: {seed: [0, 1, 2]}\n");
  // Two arrays (split at 2): the follow-up waits for both.
  Output o = run_lar("launch " + spec.string() +
                     " --executor slurm --no-registry --max-array-size 2"
                     " --then 'date +%s.%N > $LAR_HOME/then-at && lar status thn --once > $LAR_HOME/then-status'");
  ASSERT_EQ(o.code, 0) << o.text;
  auto launches = h.launches("thn");
  ASSERT_EQ(launches.size(), 1u);
  auto ids = job_ids(launches[0]);
  ASSERT_EQ(ids.size(), 2u);
  std::string then = then_job(launches[0]);
  ASSERT_FALSE(then.empty());
  std::string script = read_file(launches[0] / "then.sbatch");
  EXPECT_NE(script.find("#SBATCH --dependency=afterok:" + ids[0] + ":" + ids[1] + "\n"), std::string::npos) << script;
  EXPECT_NE(o.text.find("follow-up job " + then + " submitted (afterok on array job(s) " + ids[0] + ", " + ids[1]),
            std::string::npos) << o.text;
  EXPECT_NE(o.text.find("follow-up job " + then + ": COMPLETED"), std::string::npos) << o.text;
  ASSERT_TRUE(fs::exists(h.dir / "then-at")) << read_file(launches[0] / "then.out");
  EXPECT_GT(std::stod(read_file(h.dir / "then-at")), last_task_exit(h, "thn")) << "afterok: it ran after every task";
  EXPECT_NE(read_file(h.dir / "then-status").find("thn: 3 cells — 3 done"), std::string::npos)
      << read_file(h.dir / "then-status");
}

TEST_F(Slurm, FollowUpNeverRunsWhenATaskFailsAndStatusSaysSo) {
  Home h("thenfail");
  ::setenv("LAR_FAKE_TRAINER_OPTIONS", R"({"s1": {"fail_at_step": 2}})", 1);
  fs::path spec = h.write("thf.yaml", "name: thf\nbase: {budget: {steps: 5}}\nmatrix: {seed: [0, 1]}\n");
  std::string launch = "launch " + spec.string() + " --executor slurm --no-registry --then 'touch $LAR_HOME/ran'";
  Output o = run_lar(launch);
  EXPECT_EQ(o.code, 1) << o.text;
  auto launches = h.launches("thf");
  ASSERT_EQ(launches.size(), 1u);
  std::string then = then_job(launches[0]);
  EXPECT_NE(o.text.find("follow-up job " + then + " will never run: a training task did not complete (DependencyNeverSatisfied)"), std::string::npos)
      << o.text;
  EXPECT_NE(o.text.find("follow-up job " + then + ": PENDING (DependencyNeverSatisfied: a training task did not "
                        "complete, so it will never run)"),
            std::string::npos) << o.text;
  EXPECT_FALSE(fs::exists(h.dir / "ran"));
  Output st = run_lar("status thf --once");
  EXPECT_NE(st.text.find("failed    s1"), std::string::npos) << st.text;
  EXPECT_NE(st.text.find("  slurm: follow-up job " + then + " PENDING — DependencyNeverSatisfied"), std::string::npos)
      << st.text;

  // Relaunch: s1 resumes, the stale follow-up is cancelled and the new one runs.
  ::unsetenv("LAR_FAKE_TRAINER_OPTIONS");
  o = run_lar(launch);
  EXPECT_EQ(o.code, 0) << o.text;
  EXPECT_NE(o.text.find("cancelled follow-up job " + then + " of an earlier launch"), std::string::npos) << o.text;
  EXPECT_TRUE(fs::exists(h.dir / "ran"));
  EXPECT_TRUE(runner::query_queue({then})->empty());
}

TEST_F(Slurm, LarCancelScancelsPendingAndRunningTasksWithOrWithoutTheLaunch) {
  Home h("larcancel");
  ::setenv("LAR_FAKE_TRAINER_OPTIONS", R"({"*": {"step_ms": 50}})", 1);
  fs::path spec = h.write("lc.yaml", "name: lc\nbase: {budget: {steps: 100000}}\nmatrix: {seed: [0, 1, 2, 3]}\n");
  pid_t pid = spawn_lar({"launch", spec.string(), "--executor", "slurm", "--array-throttle", "1", "--no-registry"},
                        h.dir / "launch.log");
  fs::path s0 = h.run_dir("lc", "s0"), s1 = h.run_dir("lc", "s1");
  ASSERT_TRUE(wait_until([&] { return last_metric_step(s0) >= 3; }, 60s)) << read_file(h.dir / "launch.log");
  std::string array = job_ids(h.launches("lc")[0])[0];
  Output status = run_lar("status lc --once");
  EXPECT_NE(status.text.find("  slurm: 1 task(s) running (s0 = " + array + "_0 on "), std::string::npos) << status.text;
  EXPECT_NE(status.text.find(", 3 pending (JobArrayTaskLimit: the array's throttle (%K)); array job(s) " + array),
            std::string::npos) << status.text;

  // The launch alive: a pending cell, then the running one; the launch records both and
  // goes on with the next cell.
  Output c = run_lar("cancel lc --cell s3 --wait 30");
  EXPECT_EQ(c.code, 0) << c.text;
  EXPECT_NE(c.text.find("scancel " + array + "_3\n"), std::string::npos) << c.text;
  EXPECT_NE(c.text.find("cancelled: s3\n"), std::string::npos) << c.text;
  c = run_lar("cancel lc --cell s0 --wait 30");
  EXPECT_EQ(c.code, 0) << c.text;
  EXPECT_NE(c.text.find("scancel " + array + "_0\n"), std::string::npos) << c.text;
  EXPECT_NE(c.text.find("cancelled: s0\n"), std::string::npos) << c.text;
  for (const char* cell : {"s0", "s3"}) {
    auto st = status_of(h.run_dir("lc", cell));
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(st->state, RunState::cancelled) << cell;
    EXPECT_NE(st->reason.find("cancelled by lar cancel"), std::string::npos) << cell << ": " << st->reason;
  }
  EXPECT_FALSE(fs::exists(h.run_dir("lc", "s3") / "slurm.jsonl")) << "it never started";
  ASSERT_TRUE(wait_until([&] { return last_metric_step(s1) >= 3; }, 60s)) << read_file(h.dir / "launch.log");

  // The launch dies (say, its login session ended); the tasks go on, and lar cancel
  // stops the running and the pending one without it.
  ::kill(pid, SIGKILL);
  wait_exit(pid);
  c = run_lar("cancel lc --wait 60");
  EXPECT_EQ(c.code, 0) << c.text;
  EXPECT_NE(c.text.find("scancel " + array + "_1, " + array + "_2\n"), std::string::npos) << c.text;
  EXPECT_NE(c.text.find("cancelled: s1, s2\n"), std::string::npos) << c.text;
  for (const char* cell : {"s1", "s2"}) {
    auto st = status_of(h.run_dir("lc", cell));
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(st->state, RunState::cancelled) << cell << ": " << st->reason;
    EXPECT_FALSE(fs::exists(h.run_dir("lc", cell) / "cancel_requested"));
  }
  for (const fs::path& rd : {s0, s1}) {
    MetricsChunk m = read_metrics(rd / "metrics.jsonl");
    EXPECT_EQ(m.skipped_bad_lines, 0);
    EXPECT_EQ(m.next_offset, fs::file_size(rd / "metrics.jsonl")) << "a torn metrics line was left behind";
  }
  EXPECT_TRUE(runner::query_queue({array})->empty());
  Output st = run_lar("status lc --once");
  EXPECT_NE(st.text.find("lc: 4 cells — 0 done, 0 running, 0 failed, 4 stopped, 0 pending"), std::string::npos)
      << st.text;
}

TEST_F(Slurm, TimeLimitWarningRequeuesUpToTheCapThenRecordsTimeout) {
  Home h("tlimit");
  // --time 1 (minute) with USR2 50 s before it: slurmctld checks time limits every 30 s,
  // so each attempt gets the warning within about half a minute.
  fs::path spec = h.write("tl.yaml", "name: tl\nbase: {budget: {steps: 100000000}}\nmatrix: {seed: [0]}\n");
  pid_t pid = spawn_lar({"launch", spec.string(), "--executor", "slurm", "--no-registry", "--time", "1",
                         "--signal-lead", "50", "--max-timeout-requeues", "1"},
                        h.dir / "launch.log");
  ASSERT_TRUE(wait_until([&] { return !h.launches("tl").empty() && fs::exists(h.launches("tl")[0] / "jobs.json"); }, 60s));
  int hurried = 0;
  fs::path rd = h.run_dir("tl", "s0");
  EXPECT_EQ(wait_hurrying(pid, job_ids(h.launches("tl")[0])[0] + "_0", rd, &hurried), 1);
  EXPECT_EQ(hurried, 1) << "one requeue after the first time limit, none after the second";
  Output o{0, read_file(h.dir / "launch.log")};
  auto st = status_of(rd);
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->state, RunState::timeout) << st->reason;
  EXPECT_EQ(st->reason, "time limit reached 2 times (max_timeout_requeues 1)");
  EXPECT_EQ(st->attempt, 2);
  int preempted_by_usr2 = 0;
  for (const auto& e : st->history) {
    preempted_by_usr2 += e.state == RunState::preempted && e.reason == "SIGUSR2";
    EXPECT_NE(e.state, RunState::cancelled);
  }
  EXPECT_EQ(preempted_by_usr2, 2) << "both attempts checkpointed on the warning";
  int usr2_exits = 0;
  for (const auto& l : read_metrics(rd / "slurm.jsonl").lines)
    usr2_exits += l["event"] == "exit" && l.value("usr2", false) && l.value("rc", 0) == 3;
  EXPECT_EQ(count_events(rd, "start"), 2);
  EXPECT_EQ(count_events(rd, "requeue"), 1);
  EXPECT_EQ(usr2_exits, 2);
  EXPECT_NE(o.text.find("  timeout  s0: time limit reached 2 times (max_timeout_requeues 1)"), std::string::npos)
      << o.text;
  MetricsChunk m = read_metrics(rd / "metrics.jsonl");
  EXPECT_EQ(m.skipped_bad_lines, 0);
  ASSERT_GE(m.lines.size(), 2u);
  EXPECT_EQ(m.lines.back().value("step", 0L), static_cast<long>(m.lines.size())) << "resumed, not restarted";
}

TEST_F(Slurm, ReproduceSubmitsTheArraysAndAFollowUpThatWritesTableAndAudit) {
  Home h("repro");
  // The fake trainer records no eval metrics, so the table's rows fail; what is checked
  // here is the chaining: one command, the follow-up job wrote table + audit.
  ::setenv("LAR_FAKE_TRAINER_OPTIONS", R"({"*": {"step_ms": 1}})", 1);
  Output o = run_lar("reproduce laa/table2 --scale smoke --executor slurm");
  fs::path exp = h.dir / "runs" / "laa-table2";
  auto launches = h.launches("laa-table2");
  ASSERT_EQ(launches.size(), 1u) << o.text;
  std::string then = then_job(launches[0]);
  EXPECT_NE(o.text.find("as Slurm job arrays"), std::string::npos) << o.text;
  EXPECT_NE(o.text.find("follow-up job " + then + ": COMPLETED"), std::string::npos) << o.text;
  EXPECT_NE(o.text.find("the follow-up job wrote the table and audit to " + exp.string() + "/"), std::string::npos)
      << o.text;
  std::string script = read_file(launches[0] / "then.sbatch");
  EXPECT_NE(script.find("#SBATCH --dependency=afterok:" + job_ids(launches[0])[0] + "\n"), std::string::npos) << script;
  EXPECT_NE(script.find("lar sync --quiet\nlar table laa/table2 --scale smoke --format md -o " + exp.string() +
                        "/table.md\nlar audit laa/table2 --scale smoke > " + exp.string() + "/audit.md\n"),
            std::string::npos) << script;
  ASSERT_TRUE(fs::exists(exp / "table.md")) << read_file(launches[0] / "then.out");
  EXPECT_EQ(read_file(exp / "table.md").rfind("### LAA Table 2", 0), 0u) << read_file(exp / "table.md");
  EXPECT_NE(read_file(exp / "audit.md").find("### Verdict"), std::string::npos) << read_file(exp / "audit.md");
  EXPECT_NE(read_file(launches[0] / "then.out").find("synced 18 run(s) from " + (h.dir / "runs").string()),
            std::string::npos) << read_file(launches[0] / "then.out");
}
