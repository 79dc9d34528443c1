// The results folder (write_results) on a hand-built report: every file is written, the
// README carries the table with epochs and the claims, and the figures of the table are
// asked of `lar export figure` with the reproduction's scale and seeds (a stand-in binary
// records the call here).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "registry/report/render.hpp"
#include "registry/report/results.hpp"
#include "tests/report/fixtures.hpp"

using namespace lar;
using namespace lar::report;
namespace fs = std::filesystem;

namespace {
std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
}  // namespace

TEST(Results, WritesTheFolderAndAsksForTheTablesFigures) {
  using namespace lar::report::testing;
  const fs::path dir = fs::temp_directory_path() / ("lar_results_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  // A stand-in for `lar`: writes its arguments into the file after -o.
  const fs::path fake = dir / "fake-lar";
  std::ofstream(fake) << "#!/bin/sh\nout=\"\"; prev=\"\"\nfor a in \"$@\"; do [ \"$prev\" = \"-o\" ] && out=\"$a\"; prev=\"$a\"; done\n"
                         "echo \"<svg><!-- $* --></svg>\" > \"$out\"\n";
  ::chmod(fake.c_str(), 0755);

  PaperReport p;
  p.input.experiment = "exp";
  p.input.scale = "mini";
  p.input.title = "LAA Fig. 6";
  p.input.metrics = {"final_loss"};
  for (const char* routing : {"none", "cler"}) {
    ReportCell c = cell("gdn", routing, 0, json{{"final_loss", 2.0}});
    c.epochs = 2.5;
    p.input.cells.push_back(c);
  }
  ReportRun run = completed_run(p.input.cells[0], 2.1);
  run.epochs = 0.5;
  p.input.runs.push_back(run);
  experiments::Claim claim;
  claim.name = "cler beats none";
  claim.kind = experiments::Claim::Kind::better;
  claim.sides = {{{"routing", "cler"}}, {{"routing", "none"}}};
  claim.metric = "final_loss";
  p.input.claims = {claim};
  p.report = build_report(p.input);

  ResultsOptions o;
  o.table = "laa/fig6";
  o.scale = "mini";
  o.seeds = 3;
  o.lar_exe = fake;
  o.command = "lar reproduce laa/fig6 --scale mini --seeds 3";
  const fs::path out = dir / "res";
  ResultsSummary s = write_results(p, nullptr, out, o);
  for (const char* f : {"README.md", "audit.md", "audit.json", "table.csv", "provenance.md", "provenance.json", "laa_fig6.svg"})
    EXPECT_TRUE(fs::exists(out / f)) << f;
  EXPECT_TRUE(s.warnings.empty());
  const std::string svg = slurp(out / "laa_fig6.svg");
  EXPECT_NE(svg.find("export figure laa/fig6 --format svg -o " + (out / "laa_fig6.svg").string() + " --scale mini --seeds 3"),
            std::string::npos)
      << svg;
  const std::string readme = slurp(out / "README.md");
  EXPECT_NE(readme.find("# LAA Fig. 6 at scale mini"), std::string::npos) << readme;
  EXPECT_NE(readme.find("Made by `lar reproduce laa/fig6 --scale mini --seeds 3`"), std::string::npos);
  // none ran (0.50 epochs); cler has no run yet: its planned 2.5 epochs are flagged.
  EXPECT_NE(readme.find("| 0.50 | ok |"), std::string::npos) << readme;
  EXPECT_NE(readme.find("| 2.50 ⚠ >1 (planned) | missing |"), std::string::npos) << readme;
  EXPECT_NE(readme.find("| cler beats none | **not enough data** |"), std::string::npos) << readme;
  EXPECT_NE(readme.find("![laa_fig6.svg](laa_fig6.svg)"), std::string::npos);
  // A figure that cannot be drawn is a note, not a failure.
  o.lar_exe = "/bin/false";
  s = write_results(p, nullptr, dir / "res2", o);
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_NE(s.warnings[0].find("figure laa/fig6 not drawn"), std::string::npos);
  EXPECT_NE(slurp(dir / "res2" / "README.md").find("Not written:"), std::string::npos);
  fs::remove_all(dir);
}
