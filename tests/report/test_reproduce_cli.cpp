// End to end with the real trainer: `lar reproduce` on a two-cell spec (a synthetic task,
// so no corpus is needed), re-running only re-renders, `lar table --format json`,
// `lar audit --strict` passing, then failing once a run is marked diverged.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/json.hpp"
#include "tests/shell.hpp"

namespace fs = std::filesystem;
using lar::json;

namespace {

using Result = lar::test::ShellResult;
using lar::test::sh;

const char* kSpec = R"(name: rep-it
description: "lar reproduce integration test"
base:
  threads: 1
  model: {n_layers: 2, d_model: 32, n_heads: 2, stack: pure}
  data: {task: mqar, seq_len: 64, batch_size: 4, num_kv_pairs: 4}
  budget: {steps: 6}
  eval: {batches: 1}
matrix:
  architecture: [gdn]
  routing: [none, clvr]
  seed: [0]
baselines:
  - {match: {routing: clvr}, baseline: {routing: none}}
reference:
  source: {paper: test, table: "Table X", page: 1}
  metrics: [final_loss]
  rows:
    - {match: {routing: none}, values: [2.0]}
    - {match: {routing: clvr}, values: [1.9]}
)";

// A LAR_HOME of its own holding kSpec, removed after; `lar` is the command prefix that runs there.
struct SpecHome {
  fs::path home, spec;
  std::string lar;
  explicit SpecHome(const std::string& tag) {
    home = fs::temp_directory_path() / ("lar_repro_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(home);
    fs::create_directories(home);
    spec = home / "spec.yaml";
    std::ofstream(spec) << kSpec;
    lar = "cd " + home.string() + " && env -u LAR_DB LAR_HOME=" + home.string() + " " + LAR_BINARY " ";
  }
  ~SpecHome() { fs::remove_all(home); }
};

}  // namespace

TEST(ReproduceCli, RunsRerendersAuditsAndFlagsADivergedRun) {
  const SpecHome h("it");
  const fs::path& home = h.home;
  const fs::path& spec = h.spec;
  const std::string& env = h.lar;

  Result first = sh(env + "reproduce " + spec.string() + " -j 2");
  ASSERT_EQ(first.rc, 0) << first.out;
  EXPECT_NE(first.out.find("2 cells"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("| gdn | clvr |"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("PASS: all 2 main rows"), std::string::npos) << first.out;

  Result again = sh(env + "reproduce " + spec.string());
  ASSERT_EQ(again.rc, 0) << again.out;
  EXPECT_EQ(again.out.find("start "), std::string::npos) << again.out;
  EXPECT_NE(again.out.find("| gdn | clvr |"), std::string::npos) << again.out;

  Result table = sh(env + "table " + spec.string() + " --format json");
  ASSERT_EQ(table.rc, 0) << table.out;
  json j = json::parse(table.out);
  ASSERT_EQ(j["rows"].size(), 2u);
  EXPECT_EQ(j["rows"][1]["id"], "gdn.clvr");
  EXPECT_EQ(j["rows"][1]["ours"]["final_loss"]["n"], 1);
  EXPECT_TRUE(j["rows"][1]["ours"]["final_loss"]["mean"].is_number());
  EXPECT_EQ(j["rows"][1]["deltas"]["final_loss"]["matched"], true);
  EXPECT_NEAR(j["rows"][1]["deltas"]["final_loss"]["published"].get<double>(), -0.1, 1e-12);

  EXPECT_EQ(sh(env + "audit " + spec.string() + " --strict").rc, 0);

  // Mark the baseline run diverged on disk, re-index: the audit names it and --strict fails.
  const fs::path status = home / "runs" / "rep-it" / "gdn.none.s0" / "status.json";
  json st = json::parse(std::ifstream(status));
  st["state"] = "diverged";
  st["reason"] = "loss is NaN";
  std::ofstream(status, std::ios::trunc) << st.dump();
  ASSERT_EQ(sh(env + "sync").rc, 0);
  Result audit = sh(env + "audit " + spec.string() + " --strict");
  EXPECT_EQ(audit.rc, 1) << audit.out;
  EXPECT_NE(audit.out.find("rep-it/gdn.none.s0: diverged at step 6/6 (loss is NaN)"), std::string::npos) << audit.out;
  EXPECT_NE(audit.out.find("FAIL: 1 of 2 main rows fail: gdn.none"), std::string::npos) << audit.out;
}

// --help lists the tables the specs' folder holds (not a list kept in the code).
TEST(ReproduceCli, HelpListsEverySpecTable) {
  Result help = sh("env LAR_PAPERS=" LAR_SOURCE_DIR "/experiments/papers " LAR_BINARY " reproduce --help");
  ASSERT_EQ(help.rc, 0) << help.out;
  const auto listed = [&](const std::string& t) {
    return help.out.find(" " + t + " ") != std::string::npos || help.out.find("\n" + t + " ") != std::string::npos;
  };
  for (const char* t : {"laa/table2", "laa/table4", "laa/table5", "ccq/fig3_4", "ccq/appendix_c", "carve/table8"})
    EXPECT_TRUE(listed(t)) << t << "\n" << help.out;
  EXPECT_FALSE(listed("laa/common")) << help.out;
}

// --skip AXIS=VALUE leaves cells untrained for one call: the table still shows them (missing,
// exit 1), the next call without it trains only them; a rule naming no axis or no value is
// exit 2, naming what there is, and trains nothing.
TEST(ReproduceCli, SkipLeavesCellsForALaterCall) {
  const SpecHome h("skip");
  const fs::path& home = h.home;
  const fs::path& spec = h.spec;
  const std::string& env = h.lar;

  Result bad = sh(env + "reproduce " + spec.string() + " --skip route=clvr 2>&1");
  EXPECT_EQ(bad.rc, 2) << bad.out;
  EXPECT_NE(bad.out.find("--skip 'route=clvr': the table has no axis 'route' (axes: architecture, routing, seed)"),
            std::string::npos)
      << bad.out;
  Result none = sh(env + "reproduce " + spec.string() + " --skip routing=cler 2>&1");
  EXPECT_EQ(none.rc, 2) << none.out;
  EXPECT_NE(none.out.find("no cell has routing = cler (values: clvr, none)"), std::string::npos) << none.out;
  EXPECT_FALSE(fs::exists(home / "runs" / "rep-it")) << "a refused call trained something";

  Result first = sh(env + "reproduce " + spec.string() + " --skip routing=clvr");
  EXPECT_EQ(first.rc, 1) << first.out;
  EXPECT_NE(first.out.find("1 cells (1 skipped)"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("start  gdn.none.s0"), std::string::npos) << first.out;
  EXPECT_EQ(first.out.find("start  gdn.clvr.s0"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("| gdn | clvr |"), std::string::npos) << first.out;  // still a row of the table
  EXPECT_FALSE(fs::exists(home / "runs" / "rep-it" / "gdn.clvr.s0" / "status.json"));

  Result second = sh(env + "reproduce " + spec.string());
  EXPECT_EQ(second.rc, 0) << second.out;
  EXPECT_NE(second.out.find("start  gdn.clvr.s0"), std::string::npos) << second.out;
  EXPECT_EQ(second.out.find("start  gdn.none.s0"), std::string::npos) << second.out;
  EXPECT_NE(second.out.find("PASS: all 2 main rows"), std::string::npos) << second.out;
}
