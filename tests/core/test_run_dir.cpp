#include <gtest/gtest.h>

#include <fstream>

#include "core/fs.hpp"
#include "core/run_dir.hpp"

using namespace lar;

static fs::path temp_dir(const char* name) {
  fs::path d = fs::temp_directory_path() / (std::string("lar_test_") + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

TEST(RunDir, StatusRoundTripAndHistory) {
  RunDir rd(temp_dir("status"));
  RunStatus s;
  s.attempt = 1;
  rd.transition(s, RunState::running);
  s.step = 7;
  s.summary["final_loss"] = 2.5;
  rd.transition(s, RunState::completed);
  auto back = rd.read_status();
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->state, RunState::completed);
  EXPECT_EQ(back->step, 7);
  ASSERT_EQ(back->history.size(), 2u);
  EXPECT_EQ(back->history[0].state, RunState::running);
  EXPECT_DOUBLE_EQ(back->summary["final_loss"].get<double>(), 2.5);
}

TEST(RunDir, TornLastMetricsLineIsSkippedThenPickedUp) {
  fs::path d = temp_dir("metrics");
  fs::path p = d / "metrics.jsonl";
  {
    MetricsWriter w(p);
    w.append({{"step", 1}, {"loss", 5.0}});
    w.append({{"step", 2}, {"loss", 4.0}});
  }
  {
    std::ofstream out(p, std::ios::app);
    out << R"({"step": 3, "lo)";
  }
  MetricsChunk c = read_metrics(p, 0);
  ASSERT_EQ(c.lines.size(), 2u);
  EXPECT_EQ(c.lines[1]["step"], 2);
  {
    std::ofstream out(p, std::ios::app);
    out << R"(ss": 3.0})" << "\n";
  }
  MetricsChunk c2 = read_metrics(p, c.next_offset);
  ASSERT_EQ(c2.lines.size(), 1u);
  EXPECT_DOUBLE_EQ(c2.lines[0]["loss"].get<double>(), 3.0);
  EXPECT_EQ(c2.next_offset, fs::file_size(p));
}

TEST(RunDir, TruncateAfterDropsReplayedSteps) {
  fs::path p = temp_dir("trunc") / "metrics.jsonl";
  {
    MetricsWriter w(p);
    for (int i = 1; i <= 5; ++i) w.append({{"step", i}, {"loss", 1.0 / i}});
  }
  MetricsWriter::truncate_after(p, 3);
  EXPECT_EQ(read_metrics(p).lines.size(), 3u);
}

TEST(AtomicWrite, ReplacesWholeFile) {
  fs::path p = temp_dir("atomic") / "f.txt";
  atomic_write(p, "one");
  atomic_write(p, "two");
  EXPECT_EQ(read_file(p), "two");
}
