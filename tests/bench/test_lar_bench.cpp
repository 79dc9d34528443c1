// `lar-bench` (dev/bench) as a process: the benchmarks are a program beside `lar`, not a `lar`
// subcommand; its help lists them, a CPU benchmark prints its table, bad options exit 2.
#include <gtest/gtest.h>

#include <string>

#include "tests/shell.hpp"

namespace {

using lar::test::sh;

const std::string kBench = LAR_BENCH_BINARY;

TEST(LarBench, HelpListsEveryBenchmark) {
  const auto r = sh(kBench + " --help");
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const char* name : {"plan", "ingest", "runs", "serve", "train", "mixers", "linear-layer"})
    EXPECT_NE(r.out.find(std::string("  ") + name), std::string::npos) << name << "\n" << r.out;
  EXPECT_EQ(sh(kBench).rc, 2);  // a benchmark must be named
  const auto bad = sh(kBench + " nope");
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.out.find("nope"), std::string::npos) << bad.out;
}

TEST(LarBench, IsNoLongerALarSubcommand) {
  const auto r = sh(std::string(LAR_BINARY) + " bench plan");
  EXPECT_EQ(r.rc, 2) << r.out;
}

// `lar-bench linear-layer` (the CCQ layer-time measure) on the CPU backend: the bench
// drives one whole mixer layer through the Mixer interface with and without CCQ and prints a
// row per backbone with the paper's overhead beside ours; a bad option changes nothing.
TEST(LarBench, LinearLayerRunsOnTheCpuAndRejectsBadShapes) {
  const auto r = sh(kBench + " linear-layer --quick --backend cpu --reps 1 --warmup 0 --mixer gla,gdn");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("CCQ adds (fwd+bwd)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("+53.5% (2.28 → 3.50)"), std::string::npos) << r.out;  // the paper's GLA value
  EXPECT_NE(r.out.find("+28.8% (6.26 → 8.06)"), std::string::npos) << r.out;  // and its GDN one
  EXPECT_NE(r.out.find("B=1 T=256 d=128 H=2 (quick)"), std::string::npos) << r.out;
  const auto shape = sh(kBench + " linear-layer --shape huge --backend cpu");
  EXPECT_EQ(shape.rc, 2);
  EXPECT_NE(shape.out.find("huge"), std::string::npos) << shape.out;
  const auto mixer = sh(kBench + " linear-layer --quick --backend cpu --mixer nope");
  EXPECT_EQ(mixer.rc, 2);
  EXPECT_NE(mixer.out.find("nope"), std::string::npos) << mixer.out;
}

// `lar-bench runs` times the `lar` beside it unless told another; a path that is not an
// executable is the user's mistake, named, before anything is written.
TEST(LarBench, RunsNamesAMissingLarBinary) {
  const auto r = sh(kBench + " runs --runs 10 --lar /nonexistent/lar");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("/nonexistent/lar"), std::string::npos) << r.out;
}

// The plan benchmark's table: 100,000 cells expanded, goal and verdict printed.
TEST(LarBench, PlanExpandsTheHundredThousandCellMatrix) {
  const auto r = sh(kBench + " plan --repeat 1");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("| cells"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("100000"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("goal"), std::string::npos) << r.out;
}

}  // namespace
