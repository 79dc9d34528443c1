// End-to-end tests of runner::launch / cancel with real child processes: the test-only
// fake trainer (fake_trainer.cpp) stands in for `lar train`.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <thread>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "runner/cancel.hpp"
#include "runner/launch.hpp"
#include "runner/progress.hpp"
#include "tests/runner/helpers.hpp"

using namespace lar;
using namespace lar::runner;
using namespace lar::runner::test;
using namespace std::chrono_literals;

static LaunchOptions options(int jobs) {
  LaunchOptions o;
  o.jobs = jobs;
  o.trainer_cmd = {FAKE_TRAINER, "train"};
  o.tick_s = 0.1;
  return o;
}

static RunStatus status_of(const std::string& exp, const std::string& cell) {
  auto s = RunDir(run_dir_for(exp, cell)).read_status();
  EXPECT_TRUE(s.has_value()) << cell;
  return s.value_or(RunStatus{});
}

// Waits until `pred` holds (polling), at most `limit`.
template <class Pred>
static bool eventually(Pred pred, std::chrono::milliseconds limit = 10s) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return pred();
}

static int count_running(const std::string& exp, int n) {
  int k = 0;
  for (int i = 0; i < n; ++i) {
    auto s = RunDir(run_dir_for(exp, "c" + std::to_string(i))).read_status();
    if (s && s->state == RunState::running) ++k;
  }
  return k;
}

TEST(Launch, FourCellsTwoAtATimeThenARelaunchSkipsAll) {
  TempHome home("four");
  auto plan = make_plan("exp", 4, 5, 60);  // 5 steps × 60 ms per cell
  std::vector<ProgressEvent::Kind> kinds;
  int max_running = 0;
  auto summary = launch(plan, options(2), [&](const ProgressEvent& ev) {
    kinds.push_back(ev.kind);
    max_running = std::max(max_running, ev.running);
  });
  EXPECT_TRUE(summary.all_completed());
  EXPECT_EQ(summary.completed, 4);
  EXPECT_EQ(summary.skipped, 0);
  EXPECT_EQ(summary.failed, 0);
  EXPECT_FALSE(summary.interrupted);
  EXPECT_EQ(max_running, 2);
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), ProgressEvent::Kind::started), 4);
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), ProgressEvent::Kind::finished), 4);

  // Start intervals from runner.jsonl: never more than 2 at once, and 2 at some point.
  std::vector<std::pair<double, int>> edges;
  for (const auto& c : plan.cells) {
    fs::path d = run_dir_for("exp", c.id);
    RunStatus s = status_of("exp", c.id);
    EXPECT_EQ(s.state, RunState::completed);
    EXPECT_EQ(s.step, 5);
    EXPECT_EQ(s.attempt, 1);
    EXPECT_EQ(RunDir(d).read_config().at("hash"), c.hash);
    EXPECT_EQ(read_jsonl(d / "metrics.jsonl").size(), 5u);
    auto lines = read_jsonl(d / "runner.jsonl");
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0]["exit_code"], 0);
    EXPECT_EQ(lines[0]["attempt"], 1);
    EXPECT_EQ(lines[0]["executor"], "local");
    EXPECT_EQ(lines[0]["pid"], s.pid);  // the trainer's own pid is the child's
    edges.push_back({lines[0]["time"].get<double>(), +1});
    edges.push_back({lines[0]["ended_at"].get<double>(), -1});
    EXPECT_NE(read_file(d / "stdout.log").find("fake_trainer: attempt 1 from step 0"), std::string::npos);
  }
  std::sort(edges.begin(), edges.end());
  int now = 0, peak = 0;
  for (auto& e : edges) peak = std::max(peak, now += e.second);
  EXPECT_EQ(peak, 2);

  // Relaunch: everything is skipped, nothing is started, nothing is appended.
  int started = 0;
  auto again = launch(plan, options(2), [&](const ProgressEvent& ev) {
    if (ev.kind == ProgressEvent::Kind::started) ++started;
  });
  EXPECT_EQ(started, 0);
  EXPECT_EQ(again.skipped, 4);
  EXPECT_EQ(again.completed, 4);
  EXPECT_TRUE(again.all_completed());
  for (const auto& c : plan.cells) EXPECT_EQ(read_jsonl(run_dir_for("exp", c.id) / "runner.jsonl").size(), 1u);
}

TEST(Launch, FailuresAreRecordedAndTheOthersComplete) {
  TempHome home("fail");
  auto plan = make_plan("exp", 4, 4, 10,
                        {{"c1", {{"fail_at_step", 2}}},
                         {"c2", {{"crash_at_step", 2}}},
                         {"c3", {{"exit_at_step", {{"step", 1}, {"code", 2}}}}}});
  auto s = launch(plan, options(2));
  EXPECT_FALSE(s.all_completed());
  EXPECT_EQ(s.completed, 1);
  EXPECT_EQ(s.failed, 3);
  EXPECT_EQ(status_of("exp", "c0").state, RunState::completed);

  RunStatus c1 = status_of("exp", "c1");
  EXPECT_EQ(c1.state, RunState::failed);
  EXPECT_EQ(c1.reason, "fake failure at step 2");  // the trainer's own reason is kept

  RunStatus c2 = status_of("exp", "c2");  // died without a final status: the runner writes it
  EXPECT_EQ(c2.state, RunState::failed);
  EXPECT_EQ(c2.reason, "killed by SIGKILL");
  EXPECT_EQ(c2.step, 2);
  auto c2_lines = read_jsonl(run_dir_for("exp", "c2") / "runner.jsonl");
  ASSERT_EQ(c2_lines.size(), 1u);
  EXPECT_EQ(c2_lines[0]["signal"], SIGKILL);
  EXPECT_EQ(c2_lines[0]["state"], "failed");

  RunStatus c3 = status_of("exp", "c3");
  EXPECT_EQ(c3.state, RunState::failed);
  // the reason quotes the child's last line of output (the real trainer's error message)
  EXPECT_EQ(c3.reason, "bad config (exit code 2): fake_trainer: attempt 1 from step 0");
  EXPECT_EQ(s.cells[3].reason, c3.reason);
}

TEST(Launch, FailedAndPreemptedCellsAreResumedByARelaunch) {
  TempHome home("resume");
  auto plan = make_plan("exp", 2, 6, 10,
                        {{"c0", {{"preempt_at_step", 3}, {"only_on_attempt", 1}}},
                         {"c1", {{"fail_at_step", 2}, {"only_on_attempt", 1}}}});
  auto first = launch(plan, options(2));
  EXPECT_EQ(first.stopped, 1);
  EXPECT_EQ(first.failed, 1);
  EXPECT_EQ(status_of("exp", "c0").state, RunState::preempted);

  auto second = launch(plan, options(2));
  EXPECT_TRUE(second.all_completed());
  for (const char* id : {"c0", "c1"}) {
    RunStatus st = status_of("exp", id);
    EXPECT_EQ(st.state, RunState::completed);
    EXPECT_EQ(st.attempt, 2);
    auto lines = read_jsonl(run_dir_for("exp", id) / "runner.jsonl");
    ASSERT_EQ(lines.size(), 2u);
    EXPECT_EQ(lines[1]["attempt"], 2);
    EXPECT_EQ(lines[1]["exit_code"], 0);
    // resumed, not restarted: one metrics line per step
    EXPECT_EQ(read_jsonl(run_dir_for("exp", id) / "metrics.jsonl").size(), 6u);
  }
  EXPECT_NE(read_file(run_dir_for("exp", "c0") / "stdout.log").find("attempt 2 from step 3"), std::string::npos);
}

TEST(Launch, AChangedHashIsMovedAsideAndRunFresh) {
  TempHome home("hash");
  auto plan = make_plan("exp", 2, 3, 10);
  ASSERT_TRUE(launch(plan, options(2)).all_completed());
  std::string old_hash = plan.cells[1].hash;

  auto changed = make_plan("exp", 2, 4, 10);  // budget changed → new hashes
  std::vector<std::string> notes;
  auto s = launch(changed, options(2), [&](const ProgressEvent& ev) {
    if (ev.kind == ProgressEvent::Kind::note) notes.push_back(ev.cell_id + ": " + ev.message);
  });
  EXPECT_TRUE(s.all_completed());
  EXPECT_EQ(s.skipped, 0);
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_NE(notes[1].find("c1: config hash changed (" + old_hash.substr(0, 12)), std::string::npos) << notes[1];
  EXPECT_NE(notes[1].find("moved aside to " + run_dir_for("exp", "c1.old-1").string()), std::string::npos);

  fs::path aside = run_dir_for("exp", "c1.old-1");
  EXPECT_EQ(RunDir(aside).read_config().at("hash"), old_hash);  // kept, not deleted
  EXPECT_EQ(RunDir(aside).read_status()->step, 3);
  EXPECT_EQ(status_of("exp", "c1").step, 4);
  EXPECT_EQ(RunDir(run_dir_for("exp", "c1")).read_config().at("hash"), changed.cells[1].hash);
  EXPECT_EQ(read_experiment_progress("exp").counts.total, 2);  // .old-N not counted
}

TEST(Launch, DryRunClassifiesAndWritesNothing) {
  TempHome home("dry");
  auto plan = make_plan("exp", 2);
  auto o = options(1);
  o.dry_run = true;
  std::vector<std::string> planned;
  auto s = launch(plan, o, [&](const ProgressEvent& ev) { planned.push_back(ev.cell_id + " " + ev.message); });
  EXPECT_EQ(planned, (std::vector<std::string>{"c0 new", "c1 new"}));
  EXPECT_EQ(s.pending, 2);
  EXPECT_FALSE(fs::exists(runs_root()));
}

TEST(Launch, UnknownExecutorIsAUserError) {
  TempHome home("executor");
  auto o = options(1);
  o.executor = "kubernetes";
  EXPECT_THROW(
      {
        try {
          launch(make_plan("exp", 1), o);
        } catch (const UserError& e) {
          EXPECT_EQ(std::string(e.what()).rfind("unknown executor 'kubernetes' (available: local", 0), 0u) << e.what();
          throw;
        }
      },
      UserError);
  EXPECT_FALSE(fs::exists(runs_root()));
}

TEST(Launch, SigintStopsCleanlyAndARelaunchCompletes) {
  TempHome home("sigint");
  auto plan = make_plan("exp", 3, 40, 50);  // 2 s per cell: still running when interrupted
  auto fut = std::async(std::launch::async, [&] { return launch(plan, options(2)); });
  ASSERT_TRUE(eventually([&] { return count_running("exp", 3) == 2; }));
  std::this_thread::sleep_for(150ms);
  ::kill(::getpid(), SIGINT);  // as a Ctrl-C at the terminal would
  ASSERT_EQ(fut.wait_for(15s), std::future_status::ready);
  auto s = fut.get();
  EXPECT_TRUE(s.interrupted);
  EXPECT_EQ(s.stopped, 2);
  EXPECT_EQ(s.pending, 1);
  EXPECT_FALSE(s.all_completed());
  for (const char* id : {"c0", "c1"}) {
    RunStatus st = status_of("exp", id);
    EXPECT_EQ(st.state, RunState::preempted) << id;  // the trainer checkpointed and said so
    EXPECT_EQ(st.reason, "SIGTERM");
    auto lines = read_jsonl(run_dir_for("exp", id) / "runner.jsonl");
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0]["exit_code"], 3);
  }
  EXPECT_EQ(status_of("exp", "c2").state, RunState::pending);  // never started
  EXPECT_FALSE(fs::exists(run_dir_for("exp", "c2") / "runner.jsonl"));
  EXPECT_FALSE(active_launch_pid("exp").has_value());  // lock released

  // The SIGINT handler is gone again after launch returns (restored to the default).
  struct sigaction now {};
  ::sigaction(SIGINT, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);

  auto again = launch(plan, options(3));
  EXPECT_TRUE(again.all_completed());
  EXPECT_EQ(again.skipped, 0);
  for (const char* id : {"c0", "c1", "c2"}) {
    RunStatus st = status_of("exp", id);
    EXPECT_EQ(st.state, RunState::completed);
    EXPECT_EQ(st.attempt, std::string(id) == "c2" ? 1 : 2);
    EXPECT_EQ(read_jsonl(run_dir_for("exp", id) / "metrics.jsonl").size(), 40u);
  }
}

TEST(Cancel, StopsOneRunningCellAndTheLaunchGoesOn) {
  TempHome home("cancel_cell");
  auto plan = make_plan("exp", 2, 10, 30, {{"c0", {{"hang", true}}}});
  auto fut = std::async(std::launch::async, [&] { return launch(plan, options(2)); });
  ASSERT_TRUE(eventually([&] { return count_running("exp", 2) >= 1 && status_of("exp", "c0").state == RunState::running; }));
  CancelOptions co;
  co.cell = "c0";
  co.wait_s = 10;
  CancelReport r = cancel("exp", co);
  EXPECT_EQ(r.cancelled, std::vector<std::string>{"c0"});
  EXPECT_TRUE(r.still_running.empty());
  EXPECT_FALSE(r.launch_pid.has_value());  // only the cell was signalled
  ASSERT_EQ(fut.wait_for(15s), std::future_status::ready);
  auto s = fut.get();
  EXPECT_FALSE(s.interrupted);
  RunStatus c0 = status_of("exp", "c0");
  EXPECT_EQ(c0.state, RunState::cancelled);
  EXPECT_NE(c0.reason.find("cancelled by lar cancel"), std::string::npos) << c0.reason;
  // exactly one cancelled transition, whoever wrote it
  EXPECT_EQ(std::count_if(c0.history.begin(), c0.history.end(),
                          [](const StatusEvent& e) { return e.state == RunState::cancelled; }), 1);
  EXPECT_FALSE(cancel_requested(run_dir_for("exp", "c0")));
  EXPECT_EQ(status_of("exp", "c1").state, RunState::completed);
  EXPECT_EQ(s.cells[0].state, RunState::cancelled);
  EXPECT_EQ(s.completed, 1);
  EXPECT_EQ(s.stopped, 1);
}

TEST(Cancel, WholeExperimentStopsTheLaunchAndLeavesUnstartedCellsPending) {
  TempHome home("cancel_all");
  auto plan = make_plan("exp", 3, 10, 30, {{"c0", {{"hang", true}}}, {"c1", {{"hang", true}}}});
  auto fut = std::async(std::launch::async, [&] { return launch(plan, options(2)); });
  ASSERT_TRUE(eventually([&] { return count_running("exp", 3) == 2; }));
  CancelOptions co;
  co.wait_s = 10;
  CancelReport r = cancel("exp", co);
  EXPECT_EQ(r.launch_pid, ::getpid());  // the launch (this process) was told to stop
  EXPECT_EQ(r.cancelled, (std::vector<std::string>{"c0", "c1"}));
  ASSERT_EQ(fut.wait_for(15s), std::future_status::ready);
  auto s = fut.get();
  EXPECT_TRUE(s.interrupted);
  EXPECT_EQ(status_of("exp", "c0").state, RunState::cancelled);
  EXPECT_EQ(status_of("exp", "c1").state, RunState::cancelled);
  EXPECT_EQ(status_of("exp", "c2").state, RunState::pending);
  auto p = read_experiment_progress("exp");
  EXPECT_EQ(p.counts.stopped, 2);
  EXPECT_EQ(p.counts.pending, 1);
  EXPECT_FALSE(p.launch_pid.has_value());
}

TEST(Cancel, UnknownCellIsAUserError) {
  TempHome home("cancel_unknown");
  ASSERT_TRUE(launch(make_plan("exp", 1, 1, 1), options(1)).all_completed());
  CancelOptions co;
  co.cell = "c9";
  try {
    cancel("exp", co);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("experiment 'exp' has no cell 'c9'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cancel("nope", {}), UserError);
}
