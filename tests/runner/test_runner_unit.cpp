// Unit tests of the runner's run-directory logic, progress reading and device defaults.
// No child processes here (those are in test_runner_e2e.cpp).
#include <gtest/gtest.h>

#include <sstream>

#include "core/config_hash.hpp"
#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "runner/console.hpp"
#include "runner/devices.hpp"
#include "runner/progress.hpp"
#include "runner/run_dirs.hpp"
#include "tests/runner/helpers.hpp"

using namespace lar;
using namespace lar::runner;
using namespace lar::runner::test;

static RunStatus status_with(RunState st, long step, int attempt, long pid = 0, std::string host = "") {
  RunStatus s;
  s.state = st;
  s.step = step;
  s.attempt = attempt;
  s.pid = pid;
  s.host = host.empty() ? this_host() : host;
  return s;
}

TEST(Classify, NewCompletedPartialAndChanged) {
  TempHome home("classify");
  auto plan = make_plan("exp", 1);
  const auto& cell = plan.cells[0];
  fs::path d = run_dir_for("exp", cell.id);

  EXPECT_EQ(classify_cell(cell, d).action, CellAction::start_new);

  CellPlan p = classify_cell(cell, d);
  EXPECT_FALSE(prepare_run_dir(p).has_value());
  RunDir rd(d);
  EXPECT_EQ(rd.read_config().at("hash"), cell.hash);
  EXPECT_EQ(rd.read_status()->state, RunState::pending);
  EXPECT_EQ(classify_cell(cell, d).action, CellAction::resume);
  EXPECT_EQ(classify_cell(cell, d).detail, "never started");

  rd.write_status(status_with(RunState::completed, 5, 1));
  EXPECT_EQ(classify_cell(cell, d).action, CellAction::skip_completed);

  rd.write_status(status_with(RunState::preempted, 3, 1));
  auto pre = classify_cell(cell, d);
  EXPECT_EQ(pre.action, CellAction::resume);
  EXPECT_EQ(pre.detail, "preempted at step 3");

  rd.write_status(status_with(RunState::diverged, 2, 1));
  EXPECT_EQ(classify_cell(cell, d).action, CellAction::skip_diverged);

  // running, but its process is gone: resumed
  rd.write_status(status_with(RunState::running, 4, 1, 999999999));
  auto dead = classify_cell(cell, d);
  EXPECT_EQ(dead.action, CellAction::resume);
  EXPECT_NE(dead.detail.find("gone"), std::string::npos);

  // running and alive (this test process stands in for the trainer): not touched
  rd.write_status(status_with(RunState::running, 4, 1, ::getpid()));
  EXPECT_EQ(classify_cell(cell, d).action, CellAction::skip_running);

  // running on another host: not touched either
  rd.write_status(status_with(RunState::running, 4, 1, 1, "some-other-host"));
  auto other = classify_cell(cell, d);
  EXPECT_EQ(other.action, CellAction::skip_running);
  EXPECT_NE(other.detail.find("some-other-host"), std::string::npos);

  // a changed spec: the same id, another hash
  auto changed = make_cell("exp", cell.id, json{{"seed", 42}});
  auto ch = classify_cell(changed, d);
  EXPECT_EQ(ch.action, CellAction::start_new);
  EXPECT_TRUE(ch.hash_changed);
  EXPECT_NE(ch.detail.find("config hash changed (" + cell.hash.substr(0, 12)), std::string::npos);
}

// The cuda kernel keys at their defaults are not hashed: a run planned before they existed
// keeps its hash (not even re-keyed), and asking for other kernels starts another run.
TEST(Classify, CudaKeysAtTheirDefaultsKeepTheRunAndItsHash) {
  TempHome home("cuda_keys");
  const json full = with_defaults(json{{"seed", 3}});
  json older = full;
  older.erase("cuda");  // as written before the schema had the cuda keys
  older["optimizer"].erase("zero_stage");  // and ZeRO's stage
  const auto old_cell = make_cell("exp", "c0", older);
  const fs::path d = run_dir_for("exp", "c0");
  prepare_run_dir(classify_cell(old_cell, d));
  RunDir(d).write_status(status_with(RunState::completed, 5, 1));
  auto now = make_cell("exp", "c0", full);
  now.hash = config_hash(full);
  EXPECT_EQ(now.hash, old_cell.hash);
  const CellPlan p = classify_cell(now, d);
  EXPECT_EQ(p.action, CellAction::skip_completed);
  EXPECT_FALSE(p.rekeyed);
  EXPECT_FALSE(p.hash_changed);
  json other = full;
  other["cuda"]["gemm"] = "cublas";
  auto changed = make_cell("exp", "c0", other);
  changed.hash = config_hash(other);
  const CellPlan ch = classify_cell(changed, d);
  EXPECT_TRUE(ch.hash_changed);
  EXPECT_EQ(ch.action, CellAction::start_new);
}

// A key the schema gained since a run was planned, at its default, changes the hash but
// not the run: the run is kept (re-keyed), while a real change still starts afresh.
TEST(Classify, KeysAddedAtTheirDefaultsKeepTheRun) {
  TempHome home("rekey");
  const json full = with_defaults(json{{"seed", 3}, {"optimizer", {{"lr", 0.002}}}});
  json older = full;
  older["model"].erase("ccq");  // as written before the schema had model.ccq
  const auto old_cell = make_cell("exp", "c0", older);
  const fs::path d = run_dir_for("exp", "c0");
  prepare_run_dir(classify_cell(old_cell, d));
  RunDir(d).write_status(status_with(RunState::completed, 5, 1));
  const auto now = make_cell("exp", "c0", full);
  ASSERT_NE(now.hash, old_cell.hash);
  const CellPlan p = classify_cell(now, d);
  EXPECT_EQ(p.action, CellAction::skip_completed);
  EXPECT_TRUE(p.rekeyed);
  EXPECT_FALSE(p.hash_changed);
  EXPECT_NE(p.detail.find("only keys at their defaults differ"), std::string::npos) << p.detail;
  json other = full;
  other["optimizer"]["lr"] = 0.003;
  const CellPlan ch = classify_cell(make_cell("exp", "c0", other), d);
  EXPECT_TRUE(ch.hash_changed);
  EXPECT_FALSE(ch.rekeyed);
  EXPECT_EQ(ch.action, CellAction::start_new);
}

TEST(MoveAside, PicksTheFirstFreeNumberAndKeepsContent) {
  TempHome home("aside");
  fs::path d = run_dir_for("exp", "c0");
  fs::create_directories(d / "checkpoints");
  atomic_write(d / "config.json", "{\"hash\":\"a\"}");
  fs::create_directories(d.parent_path() / "c0.old-1");
  fs::path to = move_aside(d);
  EXPECT_EQ(to.filename(), "c0.old-2");
  EXPECT_FALSE(fs::exists(d));
  EXPECT_EQ(read_file(to / "config.json"), "{\"hash\":\"a\"}");
  EXPECT_TRUE(fs::is_directory(to / "checkpoints"));
}

TEST(Prepare, ChangedHashMovesAsideAndWritesFreshConfig) {
  TempHome home("prepare");
  auto plan = make_plan("exp", 1);
  fs::path d = run_dir_for("exp", "c0");
  prepare_run_dir(classify_cell(plan.cells[0], d));
  RunDir(d).write_status(status_with(RunState::completed, 5, 1));
  auto changed = make_cell("exp", "c0", json{{"seed", 7}});
  auto moved = prepare_run_dir(classify_cell(changed, d));
  ASSERT_TRUE(moved.has_value());
  EXPECT_EQ(moved->filename(), "c0.old-1");
  EXPECT_EQ(RunDir(*moved).read_config().at("hash"), plan.cells[0].hash);
  EXPECT_EQ(RunDir(*moved).read_status()->state, RunState::completed);
  EXPECT_EQ(RunDir(d).read_config().at("hash"), changed.hash);
  EXPECT_EQ(RunDir(d).read_status()->state, RunState::pending);
}

// settle_after_exit decides the final status from what the trainer left and the exit.
struct SettleCase {
  RunState left;      // state in status.json after the child exited
  int attempt_after;  // status.attempt after the exit (1 = the trainer opened the run)
  int exit_code;
  int signal;
  bool stop_requested;
  RunState expect;
  const char* reason_part;
};

class Settle : public ::testing::TestWithParam<SettleCase> {};

TEST_P(Settle, DerivesTheFinalState) {
  const SettleCase& c = GetParam();
  TempHome home("settle");
  fs::path d = run_dir_for("exp", "c0");
  fs::create_directories(d);
  RunStatus s = status_with(c.left, 3, c.attempt_after);
  if (c.left == RunState::failed) s.reason = "trainer's own reason";
  RunDir(d).write_status(s);
  JobExit e;
  e.job = {"exp", "c0", d, false};
  e.pid = 4242;
  e.exit_code = c.exit_code;
  e.signal = c.signal;
  e.stop_requested = c.stop_requested;
  Settled got = settle_after_exit(e, 0);
  EXPECT_EQ(got.state, c.expect);
  EXPECT_NE(got.reason.find(c.reason_part), std::string::npos) << got.reason;
  EXPECT_EQ(got.attempt, 1);
  auto back = RunDir(d).read_status();
  EXPECT_EQ(back->state, c.expect);
  EXPECT_EQ(back->reason, got.reason);
}

INSTANTIATE_TEST_SUITE_P(
    Exits, Settle,
    ::testing::Values(
        SettleCase{RunState::completed, 1, 0, 0, false, RunState::completed, ""},
        SettleCase{RunState::failed, 1, 1, 0, false, RunState::failed, "trainer's own reason"},
        SettleCase{RunState::running, 1, 0, 0, false, RunState::failed, "exited 0 without"},
        SettleCase{RunState::running, 1, 1, 0, false, RunState::failed, "exit code 1"},
        SettleCase{RunState::pending, 0, 2, 0, false, RunState::failed, "bad config (exit code 2)"},
        SettleCase{RunState::running, 1, 3, 0, false, RunState::preempted, "exit code 3"},
        SettleCase{RunState::running, 1, 4, 0, false, RunState::diverged, "exit code 4"},
        SettleCase{RunState::running, 1, 77, 0, false, RunState::failed, "code 77"},
        SettleCase{RunState::running, 1, -1, 9, false, RunState::failed, "killed by SIGKILL"},
        SettleCase{RunState::running, 1, -1, 15, true, RunState::preempted, "stopped by lar launch (SIGTERM)"},
        // an earlier attempt's preempted status does not count for this one
        SettleCase{RunState::preempted, 0, -1, 11, false, RunState::failed, "killed by SIGSEGV"}));

TEST(Settle, AFailureReasonQuotesTheChildsLastOutputLine) {
  TempHome home("settle_log");
  fs::path d = run_dir_for("exp", "c0");
  fs::create_directories(d);
  RunDir(d).write_status(status_with(RunState::pending, 0, 0));
  JobExit e;
  e.job = {"exp", "c0", d, false};
  e.exit_code = 2;
  EXPECT_EQ(settle_after_exit(e, 0).reason, "bad config (exit code 2); see stdout.log");
  atomic_write(d / "stdout.log", "loading\nlar: data.path: no prepared data at /x\n\n");
  RunDir(d).write_status(status_with(RunState::pending, 0, 0));
  EXPECT_EQ(settle_after_exit(e, 0).reason, "bad config (exit code 2): lar: data.path: no prepared data at /x");
}

TEST(Settle, CancelRequestWinsOverPreemptedButNotOverCompleted) {
  TempHome home("settle_cancel");
  fs::path d = run_dir_for("exp", "c0");
  fs::create_directories(d);
  JobExit e;
  e.job = {"exp", "c0", d, false};
  e.exit_code = 3;
  RunDir(d).write_status(status_with(RunState::preempted, 3, 1));
  atomic_write(cancel_marker_path(d), "cancelled by alice\n");
  Settled got = settle_after_exit(e, 0);
  EXPECT_EQ(got.state, RunState::cancelled);
  EXPECT_EQ(got.reason, "cancelled by alice");
  EXPECT_FALSE(cancel_requested(d));  // honoured and removed

  RunDir(d).write_status(status_with(RunState::completed, 5, 2));
  atomic_write(cancel_marker_path(d), "too late\n");
  e.exit_code = 0;
  EXPECT_EQ(settle_after_exit(e, 1).state, RunState::completed);
}

TEST(AttemptRecord, OneLinePerStart) {
  TempHome home("attempts");
  fs::path d = run_dir_for("exp", "c0");
  fs::create_directories(d);
  JobExit e;
  e.job = {"exp", "c0", d, false};
  e.pid = 31;
  e.exit_code = 0;
  e.started_at = 100;
  e.ended_at = 160;
  append_attempt_record(e, {RunState::completed, "", 1, false}, "local");
  e.exit_code = -1;
  e.signal = 9;
  append_attempt_record(e, {RunState::failed, "killed by SIGKILL", 2, true}, "local");
  auto lines = read_jsonl(d / "runner.jsonl");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["pid"], 31);
  EXPECT_EQ(lines[0]["attempt"], 1);
  EXPECT_EQ(lines[0]["exit_code"], 0);
  EXPECT_EQ(lines[0]["time"], 100.0);
  EXPECT_TRUE(lines[1]["exit_code"].is_null());
  EXPECT_EQ(lines[1]["signal"], 9);
  EXPECT_EQ(lines[1]["state"], "failed");
}

TEST(LaunchLock, SecondLaunchOfTheSameExperimentIsRefused) {
  TempHome home("lock");
  {
    LaunchLock a("exp");
    EXPECT_EQ(active_launch_pid("exp"), ::getpid());
    try {
      LaunchLock b("exp");
      FAIL() << "a second lock was granted";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("already being launched by pid " + std::to_string(::getpid())),
                std::string::npos);
    }
    LaunchLock other("another-exp");  // other experiments are independent
  }
  EXPECT_FALSE(active_launch_pid("exp").has_value());
  LaunchLock again("exp");
}

TEST(Progress, StepLossRateAndEtaFromTheRunDir) {
  TempHome home("progress");
  auto plan = make_plan("exp", 3, 100);
  for (const auto& c : plan.cells) prepare_run_dir(classify_cell(c, run_dir_for("exp", c.id)));
  RunDir r0(run_dir_for("exp", "c0")), r1(run_dir_for("exp", "c1"));
  RunStatus s = status_with(RunState::running, 40, 1, ::getpid());
  s.total_steps = 100;
  r0.write_status(s);
  {
    MetricsWriter m(r0.metrics_path());
    for (int step = 1; step <= 40; ++step)
      m.append({{"step", step}, {"wall_time", 1000.0 + step * 0.5}, {"loss", 5.0 - step * 0.01}});
    m.append({{"step", 40}, {"wall_time", 1020.1}, {"val_loss", 9.0}});  // an eval line: no loss
  }
  // a torn last line (no newline) is ignored
  { std::ofstream(r0.metrics_path(), std::ios::app) << "{\"step\": 41, \"lo"; }
  RunStatus f = status_with(RunState::failed, 7, 1);
  f.reason = "boom";
  r1.write_status(f);

  CellProgress c0 = read_cell_progress(r0.root());
  EXPECT_EQ(c0.cell_id, "c0");
  EXPECT_EQ(c0.step, 40);
  ASSERT_TRUE(c0.loss.has_value());
  EXPECT_DOUBLE_EQ(*c0.loss, 4.6);
  ASSERT_TRUE(c0.steps_per_s.has_value());
  EXPECT_NEAR(*c0.steps_per_s, 2.0, 1e-9);
  ASSERT_TRUE(c0.eta_s.has_value());
  EXPECT_NEAR(*c0.eta_s, 30.0, 1e-6);

  auto p = read_experiment_progress("exp");
  EXPECT_EQ(p.counts.total, 3);
  EXPECT_EQ(p.counts.running, 1);
  EXPECT_EQ(p.counts.failed, 1);
  EXPECT_EQ(p.counts.pending, 1);
  ASSERT_TRUE(p.eta_s.has_value());
  EXPECT_NEAR(*p.eta_s, (60.0 + 100.0) / 2.0, 1e-6);  // running + pending steps / Σ rate
  auto lines = render_progress(p);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "exp: 3 cells — 0 done, 1 running, 1 failed, 0 stopped, 1 pending; ETA 1m20s");
  EXPECT_NE(lines[1].find("running   c0 step     40/100     loss 4.6000  2.00 step/s  ETA 30s"), std::string::npos)
      << lines[1];
  EXPECT_NE(lines[2].find("failed    c1"), std::string::npos);
  EXPECT_NE(lines[2].find("boom"), std::string::npos);

  // moved-aside folders are not cells of the experiment
  fs::create_directories(run_dir_for("exp", "c0.old-1"));
  atomic_write(run_dir_for("exp", "c0.old-1") / "config.json", "{}");
  EXPECT_EQ(read_experiment_progress("exp").counts.total, 3);
  EXPECT_EQ(list_experiments(), std::vector<std::string>{"exp"});
}

TEST(Progress, UnknownExperimentIsAUserErrorWithASuggestion) {
  TempHome home("progress_unknown");
  fs::create_directories(runs_root() / "laa-table2");
  try {
    read_experiment_progress("laa-tabel2");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("no runs of experiment 'laa-tabel2'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("laa-table2"), std::string::npos);
  }
}

TEST(Progress, FormatDuration) {
  EXPECT_EQ(format_duration(9.4), "9s");
  EXPECT_EQ(format_duration(252), "4m12s");
  EXPECT_EQ(format_duration(3 * 3600 + 125), "3h02m");
}

TEST(Devices, CudaVisibleDevicesDecidesTheGpusAndTheDefaultParallelism) {
  ::setenv("CUDA_VISIBLE_DEVICES", "2, 5,-1,7", 1);
  EXPECT_EQ(visible_gpus(), (std::vector<std::string>{"2", "5"}));
  EXPECT_EQ(gpu_slots(3), (std::vector<std::string>{"2", "5", "2"}));
  auto plan = make_plan("exp", 2);
  for (auto& c : plan.cells) c.config["backend"] = "cuda";
  EXPECT_EQ(default_parallelism(plan), 2);
  for (auto& c : plan.cells) c.config["backend"] = "cpu";
  EXPECT_EQ(default_parallelism(plan), 1);  // a CPU trainer uses every core
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
  EXPECT_TRUE(visible_gpus().empty());
  for (auto& c : plan.cells) c.config["backend"] = "auto";
  EXPECT_EQ(default_parallelism(plan), 1);
  EXPECT_TRUE(gpu_slots(2).empty());
  ::unsetenv("CUDA_VISIBLE_DEVICES");
}

// The console display of `lar launch` / `lar reproduce`.

static void feed(ConsoleProgress& c, LaunchSummary& s) {
  auto ev = [&](ProgressEvent::Kind k, const std::string& id, RunState st, const std::string& msg, int running,
                int queued) {
    ProgressEvent e;
    e.kind = k;
    e.cell_id = id;
    e.state = st;
    e.message = msg;
    e.summary = &s;
    e.running = running;
    e.queued = queued;
    c(e);
  };
  ev(ProgressEvent::Kind::planned, "c0", RunState::pending, "new", 0, 0);
  ev(ProgressEvent::Kind::planned, "c1", RunState::pending, "new", 0, 0);
  s.cells[0].state = RunState::running;
  ev(ProgressEvent::Kind::started, "c0", RunState::running, "cpu", 1, 1);
  s.cells[0].state = RunState::completed;
  s.recount();
  ev(ProgressEvent::Kind::finished, "c0", RunState::completed, "", 0, 1);
  c.finish();
}

static LaunchSummary two_cells(const fs::path& root) {
  LaunchSummary s;
  s.experiment = "exp";
  for (const char* id : {"c0", "c1"}) {
    CellOutcome o;
    o.cell_id = id;
    o.run_dir = root / id;
    s.cells.push_back(o);
  }
  s.recount();
  return s;
}

TEST(Console, TerminalRedrawsOneLiveLineBelowTheEventLines) {
  TempHome home("console_tty");
  LaunchSummary s = two_cells(home.dir);
  std::ostringstream out;
  ConsoleProgress c(out, true, false);
  feed(c, s);
  EXPECT_EQ(out.str(),
            "plan: 2 cells — 2 new\n"
            "start  c0 (cpu)\n"
            "\r\x1b[K[0/2 done · 1 running · 1 queued] c0 0/0"
            "\r\x1b[Kdone   c0 completed\n"
            "\r\x1b[K[1/2 done · 0 running · 1 queued]"
            "\r\x1b[K");
}

TEST(Console, PlainOutputHasNoControlCharacters) {
  TempHome home("console_plain");
  LaunchSummary s = two_cells(home.dir);
  std::ostringstream out;
  ConsoleProgress c(out, false, false);
  feed(c, s);
  EXPECT_EQ(out.str(), "plan: 2 cells — 2 new\nstart  c0 (cpu)\ndone   c0 completed\n");
}

TEST(Console, SummaryListsWhatDidNotCompleteAndPicksTheExitCode) {
  TempHome home("console_summary");
  LaunchSummary s = two_cells(home.dir);
  s.cells[0].state = RunState::completed;
  s.cells[0].action = CellAction::skip_completed;
  s.cells[1].state = RunState::failed;
  s.cells[1].reason = "killed by SIGKILL";
  s.recount();
  std::ostringstream out;
  EXPECT_EQ(print_summary(out, s), 1);
  EXPECT_EQ(out.str(), "exp: 2 cells — 1 completed (1 skipped, already done), 1 failed\n"
                       "  failed  c1: killed by SIGKILL\n    " + (home.dir / "c1").string() + "\n");
  s.interrupted = true;
  std::ostringstream out2;
  EXPECT_EQ(print_summary(out2, s), 130);
  s.interrupted = false;
  s.cells[1].state = RunState::completed;
  s.recount();
  std::ostringstream out3;
  EXPECT_EQ(print_summary(out3, s), 0);
}
