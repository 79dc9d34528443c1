// `lar sync/runs/show/compare/metrics`: what they print, exit codes and error messages.
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/fs.hpp"
#include "helpers.hpp"

using namespace lar;
using namespace regtest;

namespace {

struct Result {
  int rc = -1;
  std::string out, err;
};

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    home = temp_dir("cli");
    fs::path a = make_run(home / "runs", "t2", "gdn.s0", {{"architecture", "gdn"}, {"seed", 0}},
                          {{"model", {{"architecture", "gdn"}, {"d_model", 64}}}, {"optimizer", {{"lr", 1e-3}}}});
    append_train_lines(a, 0, 5);
    write_status(a, RunState::completed, 5, 5, {{"final_loss", 2.5}, {"tokens_per_s", 1000}});
    fs::path b = make_run(home / "runs", "t2", "deltanet.s0", {{"architecture", "deltanet"}, {"seed", 0}},
                          {{"model", {{"architecture", "deltanet"}, {"d_model", 64}}}, {"optimizer", {{"lr", 1e-3}}}});
    append_train_lines(b, 0, 3);
    write_status(b, RunState::running, 3, 5);
  }
  Result lar(const std::string& args) {
    const char* override_bin = std::getenv("LAR_TEST_BINARY");  // a locally built lar
    std::string bin = override_bin ? override_bin : LAR_BINARY;
    fs::path out = home / "stdout.txt", err = home / "stderr.txt";
    std::string cmd = "cd " + home.string() + " && LAR_HOME=" + home.string() + " LAR_DB= " + bin + " " + args +
                      " >" + out.string() + " 2>" + err.string();
    int status = std::system(cmd.c_str());
    Result r;
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = read_file(out);
    r.err = read_file(err);
    return r;
  }
  void TearDown() override { fs::remove_all(home); }
  bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
  fs::path home;
};

}  // namespace

TEST_F(Cli, ReadCommandsWithoutADatabaseExitTwo) {
  for (const char* cmd : {"runs", "show t2/gdn.s0", "metrics t2/gdn.s0 --name loss", "compare a b"}) {
    Result r = lar(cmd);
    EXPECT_EQ(r.rc, 2) << cmd;
    EXPECT_EQ(r.err, "lar: no registry at " + (home / "lar.db").string() +
                         " (run `lar sync` to create it, or pass --db PATH)\n")
        << cmd;
    EXPECT_FALSE(fs::exists(home / "lar.db")) << cmd;
  }
}

TEST_F(Cli, SyncPrintsWhatItIngestedAndIsIdempotent) {
  Result r = lar("sync");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(has(r.out, "  t2/deltanet.s0  running 3/5  +6 rows, new\n")) << r.out;
  EXPECT_TRUE(has(r.out, "  t2/gdn.s0  completed 5/5  +10 rows, new\n")) << r.out;
  EXPECT_TRUE(has(r.out, ": 2 changed (2 new), 0 unchanged, +16 metric rows in")) << r.out;
  r = lar("sync --db other.db");
  EXPECT_EQ(r.rc, 0);
  EXPECT_TRUE(fs::exists(home / "other.db"));
  r = lar("sync");
  EXPECT_TRUE(has(r.out, ": 0 changed (0 new), 2 unchanged, +0 metric rows in")) << r.out;
}

TEST_F(Cli, RunsTableCsvJsonAndFilters) {
  ASSERT_EQ(lar("sync -q").rc, 0);
  Result r = lar("runs");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(has(r.out, "run             status     step  architecture  seed  role  final_loss")) << r.out;
  EXPECT_TRUE(has(r.out, "t2/gdn.s0       completed   5/5  gdn           0     main  2.5")) << r.out;
  EXPECT_TRUE(has(r.out, "2 run(s)\n")) << r.out;

  r = lar("runs --where architecture=gdn --format csv");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(has(r.out, "run,status,step,architecture,seed,role,final_loss,tokens_per_s,updated,hash,reason\n")) << r.out;
  EXPECT_TRUE(has(r.out, "\nt2/gdn.s0,completed,5,gdn,0,main,2.5,1000,")) << r.out;
  EXPECT_FALSE(has(r.out, "deltanet"));

  r = lar("runs --status running --format json");
  EXPECT_EQ(r.rc, 0) << r.err;
  json j = json::parse(r.out);
  ASSERT_EQ(j.size(), 1u);
  EXPECT_EQ(j[0]["run_id"], "t2/deltanet.s0");
  EXPECT_EQ(j[0]["config"]["model"]["architecture"], "deltanet");

  r = lar("runs --sort=-final_loss --limit 1 --format csv");
  EXPECT_TRUE(has(r.out, "\nt2/gdn.s0,")) << r.out;
}

TEST_F(Cli, RunsRejectsBadArguments) {
  ASSERT_EQ(lar("sync -q").rc, 0);
  Result r = lar("runs --where architecure=gdn");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.err, "lar: unknown key 'architecure' in --where architecure=gdn (did you mean 'architecture'?)\n");
  r = lar("runs --status runing");
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(has(r.err, "unknown status 'runing' (did you mean 'running'?")) << r.err;
  r = lar("runs --format xml");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.err, "lar: unknown --format 'xml' (expected table|csv|json)\n");
  r = lar("runs --experiment t3");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.err, "lar: unknown experiment 't3' (did you mean 't2'?)\n");
}

TEST_F(Cli, ShowAndUnknownRuns) {
  ASSERT_EQ(lar("sync -q").rc, 0);
  Result r = lar("show gdn.s0");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(has(r.out, "run         t2/gdn.s0\n")) << r.out;
  EXPECT_TRUE(has(r.out, "status      completed  step 5/5  attempt 1\n")) << r.out;
  EXPECT_TRUE(has(r.out, "status history\n")) << r.out;
  EXPECT_TRUE(has(r.out, "  final_loss = 2.5\n")) << r.out;
  EXPECT_TRUE(has(r.out, "  model.architecture = gdn\n")) << r.out;
  EXPECT_TRUE(has(r.out, "loss       4   9.96")) << r.out;

  r = lar("show t2/gdn.s1");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.err, "lar: unknown run 't2/gdn.s1' (did you mean 't2/gdn.s0'?)\n");
  r = lar("show t2/");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.err, "lar: run 't2/' is ambiguous; it matches:\n  t2/deltanet.s0\n  t2/gdn.s0\n");
  r = lar("show t2/gdn.s0 --format json");
  EXPECT_EQ(r.rc, 0);
  EXPECT_EQ(json::parse(r.out)["last_metrics"]["loss"]["step"], 4);
}

TEST_F(Cli, MetricsSeries) {
  ASSERT_EQ(lar("sync -q").rc, 0);
  Result r = lar("metrics t2/deltanet.s0 --name loss --format csv");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out, "step,tokens,loss,wall_time\n0,0,10,0\n1,1024,9.9900000000000002,0.5\n2,2048,9.9800000000000004,1\n");
  r = lar("metrics t2/deltanet.s0 --name loss --format json");
  json j = json::parse(r.out);
  ASSERT_EQ(j["points"].size(), 3u);
  EXPECT_DOUBLE_EQ(j["points"][2]["value"].get<double>(), 9.98);
  r = lar("metrics t2/deltanet.s0 --name los");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.err, "lar: run 't2/deltanet.s0' has no metric 'los' (did you mean 'loss'?); it has: loss, lr\n");
  r = lar("metrics t2/deltanet.s0");
  EXPECT_EQ(r.rc, 0);
  EXPECT_TRUE(has(r.out, "loss         3          2        9.98\n")) << r.out;
}

TEST_F(Cli, CompareShowsOnlyDifferingKeys) {
  ASSERT_EQ(lar("sync -q").rc, 0);
  Result r = lar("compare gdn.s0 deltanet.s0");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(has(r.out, "config: 1 of 3 keys differ\n")) << r.out;
  EXPECT_TRUE(has(r.out, "model.architecture  gdn        deltanet")) << r.out;
  EXPECT_FALSE(has(r.out, "d_model")) << r.out;
  EXPECT_TRUE(has(r.out, "final_loss       2.5        -")) << r.out;
  r = lar("compare gdn.s0 deltanet.s0 --format json");
  json j = json::parse(r.out);
  EXPECT_EQ(j["config_diff"]["model.architecture"], json({"gdn", "deltanet"}));
  EXPECT_DOUBLE_EQ(j["metrics"]["last loss"][1].get<double>(), 9.98);
  r = lar("compare gdn.s0");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.err, "lar: lar compare needs at least two runs (got 1)\n");
  r = lar("compare gdn.s0 nope");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.err, "lar: unknown run 'nope'\n");
}
