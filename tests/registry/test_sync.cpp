// Ingest: idempotent, incremental, torn last lines, rewritten files, status/attempts,
// checkpoints, evals, planned cells.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.hpp"
#include "helpers.hpp"
#include "registry/registry.hpp"

using namespace lar;
using namespace lar::registry;
using namespace regtest;

TEST(Sync, EmptyOrMissingRootIngestsNothing) {
  fs::path home = temp_dir("sync_empty");
  auto reg = Registry::open(home / "lar.db");
  auto st = reg.sync(home / "runs");
  EXPECT_EQ(st.runs_seen, 0);
  EXPECT_EQ(st.metric_rows, 0);
}

TEST(Sync, IsIdempotent) {
  fs::path home = temp_dir("sync_idem");
  fs::path d = make_run(home / "runs", "exp", "a", {{"lr", 1e-3}}, {{"optimizer", {{"lr", 1e-3}}}});
  append_train_lines(d, 0, 50);  // 50 lines × (loss, lr) = 100 rows
  write_status(d, RunState::running, 49, 100);
  auto reg = Registry::open(home / "lar.db");

  auto first = reg.sync(home / "runs");
  EXPECT_EQ(first.runs_seen, 1);
  EXPECT_EQ(first.runs_changed, 1);
  EXPECT_EQ(first.metric_rows, 100);
  ASSERT_EQ(first.changed.size(), 1u);
  EXPECT_TRUE(first.changed[0].is_new);
  EXPECT_EQ(first.changed[0].run_id, "exp/a");

  auto second = reg.sync(home / "runs");
  EXPECT_EQ(second.runs_seen, 1);
  EXPECT_EQ(second.runs_changed, 0);
  EXPECT_EQ(second.runs_unchanged, 1);
  EXPECT_EQ(second.metric_rows, 0);
  EXPECT_EQ(reg.metric_row_count(), 100);
  EXPECT_EQ(reg.metric_row_count("exp/a"), 100);
}

TEST(Sync, IsIncremental) {
  fs::path home = temp_dir("sync_incr");
  fs::path d = make_run(home / "runs", "exp", "a");
  append_train_lines(d, 0, 10);
  auto reg = Registry::open(home / "lar.db");
  EXPECT_EQ(reg.sync(home / "runs").metric_rows, 20);
  append_train_lines(d, 10, 15);
  auto st = reg.sync(home / "runs");
  EXPECT_EQ(st.metric_rows, 10);
  ASSERT_EQ(st.changed.size(), 1u);
  EXPECT_FALSE(st.changed[0].is_new);
  auto loss = reg.metric_series("exp/a", "loss");
  ASSERT_EQ(loss.size(), 15u);
  for (size_t i = 0; i < loss.size(); ++i) {
    EXPECT_EQ(loss[i].step, static_cast<long>(i));
    EXPECT_DOUBLE_EQ(loss[i].value, 10.0 - 0.01 * static_cast<double>(i));
    EXPECT_DOUBLE_EQ(loss[i].tokens, 1024.0 * static_cast<double>(i));
    EXPECT_DOUBLE_EQ(loss[i].wall_time, 0.5 * static_cast<double>(i));
  }
}

TEST(Sync, TornLastLineIsSkippedThenPickedUp) {
  fs::path home = temp_dir("sync_torn");
  fs::path d = make_run(home / "runs", "exp", "a");
  append_train_lines(d, 0, 3);
  append_raw(d / "metrics.jsonl", R"({"step": 3, "tokens": 3072, "loss": 9.)");  // torn mid-number
  auto reg = Registry::open(home / "lar.db");
  auto st = reg.sync(home / "runs");
  EXPECT_EQ(st.metric_rows, 6);
  EXPECT_EQ(reg.metric_series("exp/a", "loss").size(), 3u);
  // Still torn: nothing new, nothing counted twice.
  EXPECT_EQ(reg.sync(home / "runs").metric_rows, 0);
  // The trainer finishes the line.
  append_raw(d / "metrics.jsonl", "5, \"wall_time\": 1.5}\n");
  st = reg.sync(home / "runs");
  EXPECT_EQ(st.metric_rows, 1);
  auto loss = reg.metric_series("exp/a", "loss");
  ASSERT_EQ(loss.size(), 4u);
  EXPECT_EQ(loss[3].step, 3);
  EXPECT_DOUBLE_EQ(loss[3].value, 9.5);
  EXPECT_EQ(reg.metric_row_count(), 7);
}

TEST(Sync, RewrittenOrTruncatedMetricsAreReingestedFromScratch) {
  fs::path home = temp_dir("sync_rewrite");
  fs::path d = make_run(home / "runs", "exp", "a");
  append_train_lines(d, 0, 20);
  auto reg = Registry::open(home / "lar.db");
  EXPECT_EQ(reg.sync(home / "runs").metric_rows, 40);
  // Resume from a checkpoint at step 9: lines after it are dropped (atomic rewrite),
  // then the trainer appends again — the file ends up longer than before.
  MetricsWriter::truncate_after(d / "metrics.jsonl", 9);
  append_train_lines(d, 10, 25);
  auto st = reg.sync(home / "runs");
  ASSERT_EQ(st.changed.size(), 1u);
  EXPECT_TRUE(st.changed[0].reset);
  EXPECT_EQ(st.metric_rows, 50);
  EXPECT_EQ(reg.metric_row_count(), 50);
  auto loss = reg.metric_series("exp/a", "loss");
  ASSERT_EQ(loss.size(), 25u);
  EXPECT_EQ(loss.back().step, 24);
  // In-place truncation (same inode, shorter file).
  fs::resize_file(d / "metrics.jsonl", 0);
  append_train_lines(d, 0, 2);
  st = reg.sync(home / "runs");
  ASSERT_EQ(st.changed.size(), 1u);
  EXPECT_TRUE(st.changed[0].reset);
  EXPECT_EQ(reg.metric_row_count(), 4);
}

TEST(Sync, NonFiniteValuesAreKeptAsNaNAndBadLinesCounted) {
  fs::path home = temp_dir("sync_nan");
  fs::path d = make_run(home / "runs", "exp", "a");
  append_raw(d / "metrics.jsonl",
             "{\"step\": 1, \"loss\": 3.0, \"note\": \"text is not a metric\"}\n"
             "this is not json\n"
             "{\"step\": 2, \"loss\": null}\n");
  auto reg = Registry::open(home / "lar.db");
  auto st = reg.sync(home / "runs");
  ASSERT_EQ(st.changed.size(), 1u);
  EXPECT_EQ(st.changed[0].bad_lines, 1);
  EXPECT_EQ(st.metric_rows, 2);
  auto loss = reg.metric_series("exp/a", "loss");
  ASSERT_EQ(loss.size(), 2u);
  EXPECT_DOUBLE_EQ(loss[0].value, 3.0);
  EXPECT_TRUE(std::isnan(loss[1].value));
  EXPECT_TRUE(std::isnan(loss[0].tokens));  // absent → unknown
  EXPECT_EQ(reg.metric_names("exp/a"), std::vector<std::string>{"loss"});
}

TEST(Sync, StatusHistoryAttemptsCheckpointsAndEvals) {
  fs::path home = temp_dir("sync_status");
  fs::path d = make_run(home / "runs", "exp", "a");
  write_status(d, RunState::running, 0, 100, json::object(), 1);
  write_status(d, RunState::preempted, 40, 100, json::object(), 1);
  write_status(d, RunState::running, 40, 100, json::object(), 2);
  write_status(d, RunState::completed, 100, 100, {{"final_loss", 2.25}, {"tokens_per_s", 5000}}, 2);
  fs::create_directories(d / "checkpoints");
  append_raw(d / "checkpoints" / "step_00000040.ckpt", "0123456789");
  append_raw(d / "checkpoints" / "step_00000100.ckpt", "01234");
  append_raw(d / "checkpoints" / "step_00000100.ckpt.tmp", "partial");  // ignored
  append_raw(d / "metrics.jsonl", "{\"step\": 50, \"tokens\": 100, \"wall_time\": 2, \"val_loss\": 3.5, \"acc@512\": 0.75}\n");

  auto reg = Registry::open(home / "lar.db");
  reg.sync(home / "runs");
  auto r = reg.run("exp/a");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, RunState::completed);
  EXPECT_EQ(r->step, 100);
  EXPECT_EQ(r->total_steps, 100);
  EXPECT_EQ(r->attempts, 2);
  EXPECT_DOUBLE_EQ(r->summary["final_loss"].get<double>(), 2.25);
  ASSERT_EQ(r->history.size(), 4u);
  EXPECT_EQ(r->history[1].state, RunState::preempted);
  EXPECT_EQ(r->history[1].step, 40);
  EXPECT_EQ(r->history[3].attempt, 2);

  auto ck = reg.checkpoints("exp/a");
  ASSERT_EQ(ck.size(), 2u);
  EXPECT_EQ(ck[0].step, 40);
  EXPECT_EQ(ck[0].bytes, 10);
  EXPECT_EQ(ck[1].step, 100);

  auto ev = reg.evals("exp/a");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].step, 50);
  EXPECT_DOUBLE_EQ(ev[0].results["val_loss"].get<double>(), 3.5);
  EXPECT_DOUBLE_EQ(ev[0].results["acc@512"].get<double>(), 0.75);

  auto last = reg.last_metrics("exp/a");
  ASSERT_EQ(last.count("val_loss"), 1u);
  EXPECT_DOUBLE_EQ(last["val_loss"].value, 3.5);

  // A status change alone (no new metrics) is picked up by the next sync.
  write_status(d, RunState::failed, 100, 100, json::object(), 3);
  auto st = reg.sync(home / "runs");
  EXPECT_EQ(st.runs_changed, 1);
  EXPECT_EQ(reg.run("exp/a")->status, RunState::failed);
  EXPECT_EQ(reg.run("exp/a")->reason, "boom");
}

TEST(Sync, PlannedCellsArePendingUntilTheirRunDirectoryAppears) {
  fs::path home = temp_dir("sync_planned");
  auto reg = Registry::open(home / "lar.db");
  PlannedCell a{"exp", "gdn.s0", "hash_a", {{"architecture", "gdn"}}, "main", "", {{"model", {{"architecture", "gdn"}}}}, home / "runs/exp/gdn.s0"};
  PlannedCell b{"exp", "gdn.s1", "hash_b", {{"architecture", "gdn"}}, "exploratory", "gdn.s0", {{"model", {{"architecture", "gdn"}}}}, home / "runs/exp/gdn.s1"};
  reg.register_cells({a, b});
  reg.register_cells({a, b});  // idempotent
  auto all = reg.runs();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].run_id, "exp/gdn.s0");
  EXPECT_EQ(all[0].status, RunState::pending);
  EXPECT_EQ(all[0].hash, "hash_a");
  EXPECT_EQ(all[1].role, "exploratory");
  EXPECT_EQ(all[1].baseline, "gdn.s0");
  EXPECT_EQ(all[1].config["model"]["architecture"], "gdn");
  EXPECT_EQ(reg.experiments(), std::vector<std::string>{"exp"});

  fs::path d = make_run(home / "runs", "exp", "gdn.s0", {{"architecture", "gdn"}});
  write_status(d, RunState::running, 5, 10);
  reg.sync(home / "runs");
  // Re-registering never resets a run's progress.
  reg.register_cells({a});
  auto r = reg.run("exp/gdn.s0");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, RunState::running);
  EXPECT_EQ(r->step, 5);
  EXPECT_EQ(reg.run("exp/gdn.s1")->status, RunState::pending);
}

TEST(Sync, ABrokenRunDirectoryIsReportedAndTheRestIngested) {
  fs::path home = temp_dir("sync_broken");
  fs::path good = make_run(home / "runs", "exp", "good");
  append_train_lines(good, 0, 2);
  fs::create_directories(home / "runs/exp/bad");
  append_raw(home / "runs/exp/bad/config.json", "{not json");
  fs::create_directories(home / "runs/exp/no_config");  // not a run yet: ignored
  auto reg = Registry::open(home / "lar.db");
  auto st = reg.sync(home / "runs");
  EXPECT_EQ(st.runs_seen, 2);
  EXPECT_EQ(st.runs_changed, 1);
  ASSERT_EQ(st.errors.size(), 1u);
  EXPECT_NE(st.errors[0].find("bad/config.json: invalid JSON"), std::string::npos) << st.errors[0];
  EXPECT_EQ(reg.metric_row_count(), 4);
}

// A folder the runner moved aside (<cell>.old-<n>) keeps its cell_id; it must not overwrite
// the live run's record, whatever order the folders sort in.
TEST(Sync, MovedAsideFoldersDoNotReplaceTheLiveRun) {
  fs::path home = temp_dir("sync_moved_aside");
  fs::path live = make_run(home / "runs", "exp", "a", {{"lr", 2e-3}}, {{"optimizer", {{"lr", 2e-3}}}});
  write_status(live, RunState::completed, 100, 100);
  fs::path old = home / "runs" / "exp" / "a.old-1";
  fs::create_directories(old);
  RunDir(old).write_config({{"experiment", "exp"}, {"cell_id", "a"}, {"hash", "h_old"}, {"axes", {{"lr", 1e-3}}},
                            {"role", "main"}, {"config", {{"optimizer", {{"lr", 1e-3}}}}}});
  write_status(old, RunState::failed, 3, 100);
  auto reg = Registry::open(home / "lar.db");
  auto st = reg.sync(home / "runs");
  EXPECT_EQ(st.runs_seen, 1);
  auto rec = reg.run("exp/a");
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(to_string(rec->status), "completed");
  EXPECT_EQ(rec->hash, "h_exp_a");
  EXPECT_EQ(rec->config.at("optimizer").at("lr"), 2e-3);
  EXPECT_TRUE(is_moved_aside("a.old-1"));
  EXPECT_TRUE(is_moved_aside("a.b.old-12"));
  EXPECT_FALSE(is_moved_aside("a.old-"));
  EXPECT_FALSE(is_moved_aside("a.old-1x"));
  EXPECT_FALSE(is_moved_aside("a"));
}
