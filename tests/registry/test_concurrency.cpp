// Integration: several processes writing and ingesting at once, and kill -9 in the middle
// of an ingest. Children are forked; each opens its own connection.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <thread>

#include "core/error.hpp"
#include "helpers.hpp"
#include "registry/registry.hpp"

using namespace lar;
using namespace lar::registry;
using namespace regtest;

namespace {

// Fork `n` children running body(i) after a common start signal; returns their exit codes.
std::vector<int> run_children(int n, const std::function<void(int)>& body) {
  int gate[2];
  EXPECT_EQ(::pipe(gate), 0);
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(gate[1]);
      char c;
      (void)!::read(gate[0], &c, 1);  // returns 0 when the parent closes the gate
      int rc = 0;
      try {
        body(i);
      } catch (const std::exception& e) {
        std::cerr << "child " << i << ": " << e.what() << std::endl;
        rc = 1;
      }
      ::_exit(rc);
    }
    pids.push_back(pid);
  }
  ::close(gate[0]);
  ::close(gate[1]);  // go
  std::vector<int> codes;
  for (pid_t p : pids) {
    int status = 0;
    ::waitpid(p, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

}  // namespace

// 8 processes, each the trainer of one run (appending 10,000 metric rows in 20 bursts)
// and an ingester of the whole runs folder after every burst — all against one fresh
// database that they also create and migrate together.
TEST(Concurrency, EightProcessesIngestTenThousandRowsEach) {
  fs::path home = temp_dir("conc");
  const int procs = 8, bursts = 20, lines_per_burst = 250;  // 250 lines × 2 metrics × 20 = 10,000 rows
  for (int i = 0; i < procs; ++i) make_run(home / "runs", "conc", "r" + std::to_string(i));
  auto codes = run_children(procs, [&](int i) {
    auto reg = Registry::open(home / "lar.db");
    fs::path d = home / "runs/conc" / ("r" + std::to_string(i));
    for (int b = 0; b < bursts; ++b) {
      append_train_lines(d, b * lines_per_burst, (b + 1) * lines_per_burst);
      SyncStats st = reg.sync(home / "runs");
      if (!st.errors.empty()) throw RuntimeError(st.errors[0]);
    }
  });
  for (int i = 0; i < procs; ++i) EXPECT_EQ(codes[static_cast<size_t>(i)], 0) << "child " << i;

  auto reg = Registry::open(home / "lar.db");
  reg.sync(home / "runs");  // whatever the last child left for others to pick up
  EXPECT_EQ(reg.integrity_check(), "ok");
  EXPECT_EQ(reg.user_version(), schema_version());
  EXPECT_EQ(reg.metric_row_count(), 80000);
  for (int i = 0; i < procs; ++i) {
    std::string id = "conc/r" + std::to_string(i);
    auto loss = reg.metric_series(id, "loss");
    ASSERT_EQ(loss.size(), 5000u) << id;
    for (size_t s = 0; s < loss.size(); ++s) ASSERT_EQ(loss[s].step, static_cast<long>(s)) << id;  // no dup, no gap
  }
  fs::remove_all(home);
}

// kill -9 an ingest of 600,000 rows at several moments; afterwards the database is
// intact and a sync ingests exactly what is on disk — nothing lost, nothing twice.
TEST(Concurrency, KillDuringIngestThenSyncLosesNothing) {
  fs::path home = temp_dir("kill");
  const int runs = 4;
  const long lines = 75000;  // × 2 metrics × 4 runs = 600,000 rows
  for (int i = 0; i < runs; ++i) {
    fs::path d = make_run(home / "runs", "kill", "r" + std::to_string(i));
    append_train_lines(d, 0, lines);
  }
  const long long expected = runs * lines * 2;
  bool interrupted_once = false;
  for (int delay_ms : {30, 120, 400}) {
    fs::remove(home / "lar.db");
    fs::remove(home / "lar.db-wal");
    fs::remove(home / "lar.db-shm");
    pid_t pid = ::fork();
    if (pid == 0) {
      try {
        auto reg = Registry::open(home / "lar.db");
        reg.sync(home / "runs");
      } catch (...) {
        ::_exit(1);
      }
      ::_exit(0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!fs::exists(home / "lar.db")) continue;  // killed before it even created the file

    auto reg = Registry::open(home / "lar.db");
    EXPECT_EQ(reg.integrity_check(), "ok") << "after kill at " << delay_ms << " ms";
    long long before = reg.metric_row_count();
    EXPECT_EQ(before % (lines * 2), 0) << "a run was half ingested";  // whole runs only
    if (before < expected) interrupted_once = true;
    reg.sync(home / "runs");
    EXPECT_EQ(reg.metric_row_count(), expected) << "after kill at " << delay_ms << " ms";
    for (int i = 0; i < runs; ++i)
      EXPECT_EQ(reg.metric_row_count("kill/r" + std::to_string(i)), lines * 2);
    EXPECT_EQ(reg.sync(home / "runs").metric_rows, 0);
  }
  if (!interrupted_once) std::cout << "note: every ingest finished before its kill (fast machine)\n";
  fs::remove_all(home);
}
