// The audit: every exclusion reason, matched-baseline detection (naming the key),
// aggregation over seeds, deltas with Welch's test, agreement with the paper.
#include <gtest/gtest.h>

#include <cmath>

#include "fixtures.hpp"
#include "registry/report/render.hpp"
#include "registry/report/report.hpp"

using namespace lar;
using namespace lar::report;
using namespace lar::report::testing;

namespace {

const std::vector<std::string> kMetrics = {"final_loss"};

RunVerdict judge(const ReportRun& r, const ReportCell& c) { return judge_run(r, &c, kMetrics); }

}  // namespace

TEST(Audit, CompletedRunIsIncluded) {
  auto c = cell("gdn", "none", 0);
  auto v = judge(completed_run(c, 2.5), c);
  EXPECT_TRUE(v.included) << v.reason;
  EXPECT_EQ(v.code, "");
}

TEST(Audit, ScheduleNotCompleted) {
  auto c = cell("gdn", "none", 0);
  auto r = completed_run(c, 2.5);
  r.status = "running";
  r.step = 40;
  auto v = judge(r, c);
  EXPECT_FALSE(v.included);
  EXPECT_EQ(v.code, reason::not_completed);
  EXPECT_EQ(v.reason, "schedule not completed: running at step 40/100");
  r.status = "preempted";
  r.reason = "SIGTERM";
  EXPECT_EQ(judge(r, c).reason, "schedule not completed: preempted at step 40/100 (SIGTERM)");
  r.status = "failed";
  EXPECT_EQ(judge(r, c).code, reason::not_completed);
}

TEST(Audit, Diverged) {
  auto c = cell("gdn", "none", 0);
  auto r = completed_run(c, 2.5);
  r.status = "diverged";
  r.step = 57;
  r.reason = "loss is NaN";
  auto v = judge(r, c);
  EXPECT_EQ(v.code, reason::diverged);
  EXPECT_EQ(v.reason, "diverged at step 57/100 (loss is NaN)");
}

TEST(Audit, NotTheFinalCheckpoint) {
  auto c = cell("gdn", "none", 0);
  auto r = completed_run(c, 2.5);
  r.checkpoint_step = 80;
  auto v = judge(r, c);
  EXPECT_EQ(v.code, reason::not_final);
  EXPECT_EQ(v.reason, "not the final checkpoint: metrics at step 80, schedule ends at step 100");
}

TEST(Audit, EveryRequiredFieldMissing) {
  auto c = cell("gdn", "none", 0);
  struct Case { const char* path; const char* expect; };
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"model", "architecture"}, "required field missing: architecture (model.architecture)"},
      {{"model", "stack"}, "required field missing: stack (model.stack)"},
      {{"model", "d_model"}, "required field missing: size (model.d_model)"},
      {{"optimizer", "name"}, "required field missing: optimizer (optimizer.name)"},
      {{"optimizer", "lr"}, "required field missing: learning rate (optimizer.lr)"},
  };
  for (const auto& [path, expect] : cases) {
    auto r = completed_run(c, 2.5);
    r.config[path[0]].erase(path[1]);
    auto v = judge(r, c);
    EXPECT_EQ(v.code, reason::missing_field) << expect;
    EXPECT_EQ(v.reason, expect);
  }
  {
    auto r = completed_run(c, 2.5);
    r.config["budget"] = {{"steps", 0}, {"tokens", 0}};
    EXPECT_EQ(judge(r, c).reason, "required field missing: token budget (budget.steps / budget.tokens)");
  }
  {
    auto r = completed_run(c, 2.5);
    r.summary = {{"tokens_per_s", 5.0}};
    EXPECT_EQ(judge(r, c).reason, "required field missing: metric (none of final_loss in the summary)");
  }
  {
    auto r = completed_run(c, 2.5);
    r.checkpoint_step.reset();
    EXPECT_EQ(judge(r, c).reason, "required field missing: checkpoint (no final checkpoint step recorded)");
  }
  {
    auto r = completed_run(c, 2.5);
    r.config = json::object();
    EXPECT_EQ(judge(r, c).reason, "required field missing: config");
  }
}

TEST(Audit, ConfigDiffersFromCellNamesTheKey) {
  auto c = cell("gdn", "none", 0);
  auto r = completed_run(c, 2.5);
  r.config["optimizer"]["lr"] = 3e-4;
  auto v = judge(r, c);
  EXPECT_EQ(v.code, reason::config_differs);
  EXPECT_EQ(v.reason, "config differs from the spec's cell: optimizer.lr: 0.0003 vs 0.001");
  // Operational keys (threads, backend, checkpointing, logging) do not matter.
  auto ok = completed_run(c, 2.5);
  ok.config["threads"] = 2;
  ok.config["checkpoint"]["every"] = 7;
  EXPECT_TRUE(judge(ok, c).included);
  // A key the schema gained after the run, at its default, is no difference.
  auto older = completed_run(c, 2.5);
  ASSERT_TRUE(older.config["model"].contains("ccq"));
  older.config["model"].erase("ccq");
  EXPECT_TRUE(judge(older, c).included) << judge(older, c).reason;
}

TEST(Audit, RunOutsideThePlan) {
  auto c = cell("gdn", "none", 0);
  auto v = judge_run(completed_run(c, 2.5), nullptr, kMetrics);
  EXPECT_EQ(v.code, reason::not_in_plan);
}

TEST(Audit, NewestIncludedRunWinsDuplicatesAreSuperseded) {
  TableInput in;
  in.metrics = kMetrics;
  auto c = cell("gdn", "none", 0, {{"final_loss", 2.4}});
  in.cells = {c};
  auto old_run = completed_run(c, 2.9, 1000, 1);
  old_run.run_id = "old";
  auto new_run = completed_run(c, 2.5, 1000, 2);
  new_run.run_id = "new";
  in.runs = {old_run, new_run};
  auto rep = build_report(in);
  ASSERT_EQ(rep.rows.size(), 1u);
  EXPECT_EQ(rep.rows[0].ours.at("final_loss").stats.mean, 2.5);
  EXPECT_EQ(rep.runs[0].code, reason::superseded);
  EXPECT_EQ(rep.runs[0].reason, "superseded by the newer run new of the same cell");
  EXPECT_TRUE(rep.runs[1].included);
  EXPECT_EQ(rep.rows[0].status, "ok");
  EXPECT_EQ(rep.rows[0].notes.front(), "single seed: no significance claim");
}

TEST(Audit, ConfigDifferencesHelper) {
  json a = {{"model", {{"d_model", 64}, {"routing", "clvr"}}}, {"seed", 1}, {"threads", 4}};
  json b = {{"model", {{"d_model", 64.0}, {"routing", "none"}}}, {"seed", 2}, {"threads", 1}};
  EXPECT_EQ(config_differences(a, b), (std::vector<std::string>{"model.routing: clvr vs none", "seed: 1 vs 2"}));
  EXPECT_EQ(config_differences(a, b, {"model.routing"}), (std::vector<std::string>{"seed: 1 vs 2"}));
  json c = {{"data", {{"seq_len", 128}}}};
  EXPECT_EQ(config_differences(c, json::object()), (std::vector<std::string>{"data.seq_len: 128 vs (absent)"}));
}

TEST(Audit, RowIdDropsTheSeed) {
  EXPECT_EQ(row_id_of(cell("gdn", "clvr", 3)), "gdn.clvr");
  ReportCell mid;
  mid.id = "gdn.s1.muon";
  mid.axes = {{"architecture", "gdn"}, {"seed", 1}, {"optimizer", "muon"}};
  EXPECT_EQ(row_id_of(mid), "gdn.muon");
  ReportCell none;
  none.id = "gdn.muon";
  none.axes = {{"architecture", "gdn"}};
  EXPECT_EQ(row_id_of(none), "gdn.muon");
}

namespace {

// Routing table: gdn with none / clvr, three seeds each, published final losses.
TableInput routing_table(int seeds) {
  TableInput in;
  in.experiment = "t7";
  in.metrics = kMetrics;
  const double base[] = {2.40, 2.42, 2.41};
  const double clvr[] = {2.37, 2.38, 2.36};
  for (int s = 0; s < seeds; ++s) {
    in.cells.push_back(cell("gdn", "none", s, {{"final_loss", 2.8331}}));
    in.cells.push_back(cell("gdn", "clvr", s, {{"final_loss", 2.8228}}));
    in.runs.push_back(completed_run(in.cells[in.cells.size() - 2], base[s]));
    in.runs.push_back(completed_run(in.cells.back(), clvr[s]));
  }
  return in;
}

}  // namespace

TEST(Audit, MultiSeedDeltaWithWelch) {
  auto rep = build_report(routing_table(3));
  ASSERT_EQ(rep.rows.size(), 2u);
  const Row& clvr = rep.rows[1];
  EXPECT_EQ(clvr.id, "gdn.clvr");
  ASSERT_TRUE(clvr.baseline_row);
  EXPECT_EQ(*clvr.baseline_row, "gdn.none");
  const MetricValue& v = clvr.ours.at("final_loss");
  EXPECT_EQ(v.stats.n, 3);
  EXPECT_NEAR(v.stats.mean, 2.37, 1e-12);
  EXPECT_NEAR(v.stats.std, 0.01, 1e-12);
  const Delta& d = clvr.deltas.at("final_loss");
  EXPECT_TRUE(d.matched);
  EXPECT_NEAR(*d.ours, 2.37 - 2.41, 1e-12);
  // se = sqrt(0.01²/3 + 0.01²/3); t = −0.04/se; df = 4 (equal variances and sizes)
  EXPECT_NEAR(*d.se, std::sqrt(2e-4 / 3), 1e-12);
  ASSERT_TRUE(d.test);
  EXPECT_NEAR(d.test->t, -0.04 / std::sqrt(2e-4 / 3), 1e-9);
  EXPECT_NEAR(d.test->df, 4.0, 1e-9);
  // two-sided p for t = −4.898979, df = 4 (numerical integration of the t density): 0.0080498931
  EXPECT_NEAR(d.test->p, 0.0080498931, 1e-8);
  EXPECT_NEAR(*d.published, 2.8228 - 2.8331, 1e-12);
  EXPECT_EQ(clvr.status, "ok");
  ASSERT_EQ(rep.signs.size(), 1u);
  EXPECT_EQ(rep.signs[0].n, 1);
  EXPECT_EQ(rep.signs[0].agree, 1);
}

TEST(Audit, SingleSeedDeltaHasNoSignificance) {
  auto rep = build_report(routing_table(1));
  const Row& clvr = rep.rows[1];
  const Delta& d = clvr.deltas.at("final_loss");
  EXPECT_NEAR(*d.ours, 2.37 - 2.40, 1e-12);
  EXPECT_FALSE(d.se);
  EXPECT_FALSE(d.test);
  EXPECT_NE(std::find(clvr.notes.begin(), clvr.notes.end(),
                      "too few seeds for a significance test (n = 1 vs 1; Welch's t needs ≥ 2 per side)"),
            clvr.notes.end());
}

TEST(Audit, UnmatchedBaselineNamesTheDifferingKey) {
  auto in = routing_table(1);
  // The baseline run trained with another learning rate than the routed run.
  in.runs[0].config["optimizer"]["lr"] = 3e-4;
  in.cells[0].config["optimizer"]["lr"] = 3e-4;  // so the run itself is not excluded
  auto rep = build_report(in);
  const Row& clvr = rep.rows[1];
  const Delta& d = clvr.deltas.at("final_loss");
  EXPECT_FALSE(d.matched);
  EXPECT_EQ(d.mismatch, "optimizer.lr: 0.001 vs 0.0003");
  EXPECT_FALSE(d.ours);
  EXPECT_EQ(clvr.status, "fail");
  EXPECT_EQ(rep.failed_main_rows(), std::vector<std::string>{"gdn.clvr"});
  EXPECT_NE(std::find(clvr.notes.begin(), clvr.notes.end(),
                      "delta not reported: baseline gdn.none differs in optimizer.lr: 0.001 vs 0.0003"),
            clvr.notes.end());
}

TEST(Audit, BaselineDifferingOnlyInTheComparedAxisIsMatched) {
  auto in = routing_table(1);
  auto rep = build_report(in);
  EXPECT_TRUE(rep.rows[1].deltas.at("final_loss").matched);
  // A differing data slice recorded by the trainer breaks the match.
  in.runs[0].summary["data_slice"] = "brown:train[0:90%]";
  in.runs[1].summary["data_slice"] = "brown:train[0:80%]";
  auto rep2 = build_report(in);
  EXPECT_FALSE(rep2.rows[1].deltas.at("final_loss").matched);
  EXPECT_EQ(rep2.rows[1].deltas.at("final_loss").mismatch,
            "data slice (summary.data_slice): run " + in.runs[1].run_id + " trained on brown:train[0:80%], run " +
                in.runs[0].run_id + " on brown:train[0:90%]");
  // So does another tokenizer over the same slice.
  in.runs[1].summary["data_slice"] = "brown:train[0:90%]";
  in.runs[0].summary["tokenizer"] = "byte";
  in.runs[1].summary["tokenizer"] = "sp:llama2-32000";
  auto rep3 = build_report(in);
  EXPECT_EQ(rep3.rows[1].deltas.at("final_loss").mismatch,
            "tokenizer (summary.tokenizer): run " + in.runs[1].run_id + " trained on sp:llama2-32000, run " +
                in.runs[0].run_id + " on byte");
}

TEST(Audit, ExploratoryRowsNeverFail) {
  auto in = routing_table(1);
  in.cells[1].role = "exploratory";
  in.runs.pop_back();  // no run for the exploratory cell
  auto rep = build_report(in);
  EXPECT_EQ(rep.rows[1].status, "exploratory");
  EXPECT_EQ(rep.rows[1].notes.front(), "exploratory: indicative only, not a main result (LAA App. B)");
  EXPECT_TRUE(rep.failed_main_rows().empty());
}

TEST(Audit, MissingAndFailedMainRows) {
  auto in = routing_table(1);
  in.runs[1].status = "diverged";
  in.runs.erase(in.runs.begin());  // baseline never ran
  auto rep = build_report(in);
  EXPECT_EQ(rep.rows[0].status, "missing");
  EXPECT_EQ(rep.rows[1].status, "fail");
  EXPECT_EQ(rep.failed_main_rows(), (std::vector<std::string>{"gdn.none", "gdn.clvr"}));
}

// A table in progress: a run cut before the end of its schedule (preempted) or still training
// leaves its row incomplete, not failed; the verdict says so apart from the failures.
TEST(Audit, UnfinishedRunsMakeARowIncompleteNotFailed) {
  auto in = routing_table(1);
  in.runs[1].status = "preempted";
  in.runs[1].step = 40;
  auto rep = build_report(in);
  EXPECT_EQ(rep.rows[0].status, "ok");
  EXPECT_EQ(rep.rows[1].status, "incomplete");
  EXPECT_EQ(rep.failed_main_rows(), std::vector<std::string>{"gdn.clvr"});  // not complete: exit 1
  EXPECT_EQ(rep.main_rows_with_status("incomplete"), std::vector<std::string>{"gdn.clvr"});
  const std::string md = audit_markdown(rep);
  EXPECT_EQ(md.find("FAIL:"), std::string::npos) << md;
  EXPECT_NE(md.find("INCOMPLETE: 1 of 2 main rows have runs not finished yet"), std::string::npos) << md;
  EXPECT_EQ(audit_json(rep)["incomplete_main_rows"], json::array({"gdn.clvr"}));
  // a diverged run beside it is a failure again
  in.runs[0].status = "diverged";
  auto rep2 = build_report(in);
  EXPECT_EQ(rep2.rows[0].status, "fail");
  EXPECT_EQ(rep2.rows[1].status, "incomplete");
  const std::string md2 = audit_markdown(rep2);
  EXPECT_NE(md2.find("FAIL: 1 of 2 main rows fail: gdn.none\n"), std::string::npos) << md2;
  EXPECT_NE(md2.find("INCOMPLETE: 1 of 2 main rows"), std::string::npos) << md2;
}

TEST(Audit, RelativeThroughputAndRankAgreement) {
  TableInput in;
  in.metrics = {"rel_throughput_pct", "final_loss"};
  auto a = cell("gdn", "none", 0, {{"rel_throughput_pct", 100.0}, {"final_loss", 2.433}});
  auto b = cell("kda", "none", 0, {{"rel_throughput_pct", 73.6}, {"final_loss", 2.347}});
  auto c = cell("deltanet", "none", 0, {{"rel_throughput_pct", 91.9}, {"final_loss", 2.382}});
  in.cells = {a, b, c};
  in.runs = {completed_run(a, 3.0, 2000), completed_run(b, 2.9, 1500), completed_run(c, 2.95, 1900)};
  auto rep = build_report(in);
  ASSERT_TRUE(rep.throughput_reference);
  EXPECT_EQ(*rep.throughput_reference, "gdn.none");
  EXPECT_DOUBLE_EQ(rep.rows[0].ours.at("rel_throughput_pct").stats.mean, 100.0);
  EXPECT_DOUBLE_EQ(rep.rows[1].ours.at("rel_throughput_pct").stats.mean, 75.0);
  EXPECT_DOUBLE_EQ(rep.rows[2].ours.at("rel_throughput_pct").stats.mean, 95.0);
  ASSERT_EQ(rep.agreement.size(), 2u);
  EXPECT_EQ(rep.agreement[0].n, 3);
  EXPECT_NEAR(*rep.agreement[0].spearman, 1.0, 1e-12);
  EXPECT_NEAR(*rep.agreement[1].spearman, 1.0, 1e-12);
  EXPECT_EQ(rep.decimals.at("rel_throughput_pct"), 1);
  EXPECT_EQ(rep.decimals.at("final_loss"), 3);
}

TEST(Audit, PerplexityColumnsUseAMarkedProxy) {
  ReportRun r;
  r.summary = {{"final_loss", 2.0}};
  bool proxy = false;
  std::string note;
  auto v = run_metric(r, "wikitext_ppl", &proxy, &note);
  ASSERT_TRUE(v);
  EXPECT_NEAR(*v, std::exp(2.0), 1e-12);
  EXPECT_TRUE(proxy);
  EXPECT_EQ(note, "wikitext_ppl: our validation perplexity exp(final_loss) stands in");
  r.summary["wikitext_ppl"] = 17.5;
  EXPECT_EQ(*run_metric(r, "wikitext_ppl", &proxy), 17.5);
  EXPECT_FALSE(proxy);
  EXPECT_FALSE(run_metric(r, "lambada_acc").has_value());
}

TEST(Audit, MetricNamesMapToOurSummary) {
  ReportRun r;
  r.summary = {{"iter_time_s", 0.5}, {"peak_mem_mb", 2048.0}, {"tokens_per_s", 900.0}, {"acc@4096", 0.25}, {"acc", 0.5}};
  EXPECT_EQ(*run_metric(r, "sec_per_iter"), 0.5);
  EXPECT_EQ(*run_metric(r, "peak_mem_gb"), 2.0);
  EXPECT_EQ(*run_metric(r, "tok_s"), 900.0);
  EXPECT_EQ(*run_metric(r, "acc_pct@4K"), 25.0);
  EXPECT_EQ(*run_metric(r, "acc_pct@4096"), 25.0);
  EXPECT_EQ(*run_metric(r, "acc_pct"), 50.0);
  EXPECT_FALSE(run_metric(r, "acc_pct@8K").has_value());
  EXPECT_FALSE(run_metric(r, "acc_pct_uuid@4K").has_value());
}

TEST(Audit, IterationTimeGrowthOverTheShortestLength) {
  TableInput in;
  in.metrics = {"sec_per_iter", "iter_time_growth_pct"};
  for (int len : {256, 1024, 2048}) {
    ReportCell c;
    c.id = "softmax.seq_len" + std::to_string(len) + ".s0";
    c.axes = {{"architecture", "softmax"}, {"seq_len", len}, {"seed", 0}};
    c.config = config_for("softmax", "none", 0);
    in.cells.push_back(c);
    auto r = completed_run(c, 3.0);
    r.summary["iter_time_s"] = len == 256 ? 0.1 : len == 1024 ? 0.15 : 0.3;
    in.runs.push_back(r);
  }
  auto rep = build_report(in);
  EXPECT_NEAR(rep.rows[0].ours.at("iter_time_growth_pct").stats.mean, 0.0, 1e-12);
  EXPECT_NEAR(rep.rows[1].ours.at("iter_time_growth_pct").stats.mean, 50.0, 1e-9);
  EXPECT_NEAR(rep.rows[2].ours.at("iter_time_growth_pct").stats.mean, 200.0, 1e-9);
  EXPECT_NEAR(rep.rows[2].ours.at("sec_per_iter").stats.mean, 0.3, 1e-12);
}
