// `lar export figure` from the command line: the catalogue, a figure drawn before any run
// exists, and the user errors (exit code 2, nothing written).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/shell.hpp"

namespace fs = std::filesystem;

namespace {

using Result = lar::test::ShellResult;
using lar::test::sh;

struct Home {
  fs::path path = fs::temp_directory_path() / ("lar_export_it_" + std::to_string(::getpid()));
  Home() { fs::create_directories(path); }
  ~Home() { fs::remove_all(path); }
  std::string lar() const { return "cd " + path.string() + " && env -u LAR_DB LAR_HOME=" + path.string() + " " LAR_BINARY " "; }
};

}  // namespace

TEST(ExportCli, ListsTheCatalogue) {
  Home home;
  Result r = sh(home.lar() + "export figure --list");
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const char* name : {"laa/fig4  (laa/lr_sweep, panels)", "laa/frontier", "ccq/fig5", "carve/table3"})
    EXPECT_NE(r.out.find(name), std::string::npos) << name << "\n" << r.out;
}

TEST(ExportCli, DrawsAnEmptyFigureBeforeAnyRun) {
  Home home;
  Result r = sh(home.lar() + "export figure laa/fig4 --format svg -o fig4.svg --scale smoke");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("wrote fig4.svg (svg, 0 series) from 0 runs"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(none yet: run `lar reproduce laa/lr_sweep` first)"), std::string::npos) << r.out;
  std::ifstream in(home.path / "fig4.svg");
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("no data yet"), std::string::npos);
  EXPECT_EQ(r.out.find("warning"), std::string::npos) << "gnuplot's messages stay in its log";
}

TEST(ExportCli, UserErrorsExitTwoAndWriteNothing) {
  Home home;
  Result smooth = sh(home.lar() + "export figure laa/fig4 --smooth 1.5 -o a.svg");
  EXPECT_EQ(smooth.rc, 2) << smooth.out;
  EXPECT_NE(smooth.out.find("--smooth 1.5: the EMA factor must be in [0, 1)"), std::string::npos) << smooth.out;
  Result grid = sh(home.lar() + "export figure laa/fig5 --grid -o b.svg");
  EXPECT_EQ(grid.rc, 2) << grid.out;
  EXPECT_NE(grid.out.find("figure laa/fig5 has no small-multiples layout"), std::string::npos) << grid.out;
  Result both = sh(home.lar() + "export figure laa/fig4 --grid --no-grid -o c.svg");
  EXPECT_EQ(both.rc, 2) << both.out;
  Result name = sh(home.lar() + "export figure laa/fig7");
  EXPECT_EQ(name.rc, 2);
  EXPECT_NE(name.out.find("unknown figure 'laa/fig7'"), std::string::npos) << name.out;
  for (const char* f : {"a.svg", "b.svg", "c.svg"}) EXPECT_FALSE(fs::exists(home.path / f)) << f;
}
