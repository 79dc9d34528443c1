// `lar plan` end to end: exit codes, locations on stderr, output formats, run status.
#include <sys/wait.h>

#include <array>
#include <cstdio>

#include "core/json.hpp"
#include "core/run_dir.hpp"
#include "spec_fixture.hpp"

using namespace lar;
using lar::experiments::testing::SpecDir;

namespace {

struct Result {
  int code = -1;
  std::string out, err;
};

Result run_lar(const SpecDir& d, const std::string& args) {
  std::string err_file = (d.dir() / "stderr.txt").string();
  std::string cmd = "cd '" + d.dir().string() + "' && LAR_HOME='" + d.dir().string() + "' '" + LAR_BINARY + "' " + args +
                    " 2>'" + err_file + "'";
  Result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_file);
  r.err.assign(std::istreambuf_iterator<char>(in), {});
  return r;
}

const char* kSpec = "name: cli\nmatrix:\n  lr: [1e-3, 3e-4]\n  seed: [0, 1]\nexclude:\n  - {seed: 9}\n";

}  // namespace

TEST(PlanCli, BadSpecExitsTwoWithLocation) {
  SpecDir d;
  d.write("bad.yaml", "name: bad\nmatrix:\n  seed: [0, one]\n");
  Result r = run_lar(d, "plan bad.yaml");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "lar: bad.yaml:3:13: error: matrix.seed: expected integer, got \"one\"\n");
  EXPECT_EQ(r.out, "");
  EXPECT_FALSE(std::filesystem::exists(d.dir() / "runs"));
  EXPECT_FALSE(std::filesystem::exists(d.dir() / "lar.db"));
}

TEST(PlanCli, JsonListsCellsWithStatus) {
  SpecDir d;
  d.write("s.yaml", kSpec);
  // One run completed with the same hash, one partial, one with a changed config.
  experiments::Plan p = experiments::load_plan(d.dir() / "s.yaml", "");
  auto make = [&](const experiments::Cell& c, RunState st, const std::string& hash) {
    RunDir rd(d.dir() / "runs" / "cli" / c.id);
    std::filesystem::create_directories(rd.root());
    json cfg = c.run_config_json();
    cfg["hash"] = hash;
    rd.write_config(cfg);
    RunStatus s;
    s.state = st;
    rd.write_status(s);
  };
  make(p.cells[0], RunState::completed, p.cells[0].hash);
  make(p.cells[1], RunState::running, p.cells[1].hash);
  make(p.cells[2], RunState::completed, "0123");
  Result r = run_lar(d, "plan s.yaml --format json");
  ASSERT_EQ(r.code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["experiment"], "cli");
  ASSERT_EQ(j["cells"].size(), 4u);
  EXPECT_EQ(j["cells"][0]["id"], "lr1e-3.s0");
  EXPECT_EQ(j["cells"][0]["hash"], p.cells[0].hash);
  EXPECT_EQ(j["cells"][0]["axes"]["lr"], 1e-3);
  EXPECT_EQ(j["cells"][0]["status"], "done");
  EXPECT_EQ(j["cells"][1]["status"], "partial");
  EXPECT_EQ(j["cells"][2]["status"], "changed");
  EXPECT_EQ(j["cells"][3]["status"], "new");
  EXPECT_EQ(j["summary"], json({{"done", 1}, {"partial", 1}, {"changed", 1}, {"new", 1}}));
  // The exclude that matches nothing is a warning on stderr, with its location.
  EXPECT_EQ(r.err, "lar: s.yaml:6:5: warning: exclude[0] matches no cell\n");
}

TEST(PlanCli, TableAndCsv) {
  SpecDir d;
  d.write("s.yaml", kSpec);
  Result t = run_lar(d, "plan s.yaml");
  ASSERT_EQ(t.code, 0) << t.err;
  experiments::Plan p = experiments::load_plan(d.dir() / "s.yaml", "");
  // Header, one aligned row per cell, summary.
  EXPECT_NE(t.out.find("id         hash          role  lr    seed  status"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("lr3e-4.s1  " + p.cells[3].short_hash() + "  main  3e-4  1     new"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("4 cells (experiment cli): 0 done, 0 partial, 0 changed, 4 new"), std::string::npos) << t.out;
  Result c = run_lar(d, "plan s.yaml --format csv");
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_EQ(c.out.substr(0, c.out.find('\n')), "id,hash,role,baseline,status,lr,seed");
  EXPECT_NE(c.out.find("lr1e-3.s0," + p.cells[0].hash + ",main,,new,0.001,0\n"), std::string::npos) << c.out;
  Result bad = run_lar(d, "plan s.yaml --format xml");
  EXPECT_EQ(bad.code, 2);
}
