// `lar train --nproc` launcher (dist/launch.hpp) with shell commands as ranks: exit-code
// aggregation, the rank environment, a dying rank ends the launch, signal forwarding.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "core/fs.hpp"
#include "dist/launch.hpp"
#include "tests/temp_dir.hpp"

using namespace lar;
namespace fs = std::filesystem;

namespace {

dist::LaunchOptions sh(const std::string& script, int nproc, double grace = 60) {
  dist::LaunchOptions o;
  o.argv = {"/bin/sh", "-c", script};
  o.nproc = nproc;
  o.grace_s = grace;
  o.token = "t123";
  return o;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST(Launch, EveryRankGetsItsEnvironment) {
  const TempDir tmp;
  const fs::path& dir = tmp.path;
  auto r = dist::launch_ranks(sh("echo \"$LAR_RANK $LAR_WORLD_SIZE $LAR_LOCAL_RANK $LAR_DIST_TOKEN "
                                 "$NCCL_NVLS_ENABLE $TORCH_SYMM_MEM_DISABLE_MULTICAST $NVSHMEM_DISABLE_NVLS\" > " +
                                     dir.string() + "/rank$LAR_RANK",
                                 3));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.failure, "");
  ASSERT_EQ(r.ranks.size(), 3u);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(read_file(dir / ("rank" + std::to_string(i))),
              std::to_string(i) + " 3 " + std::to_string(i) + " t123 0 1 1\n");
}

TEST(Launch, SameCodeFromEveryRankIsTheLaunchsCode) {
  EXPECT_EQ(dist::launch_ranks(sh("exit 3", 2)).exit_code, 3);
  EXPECT_EQ(dist::launch_ranks(sh("exit 4", 2)).exit_code, 4);
  EXPECT_EQ(dist::launch_ranks(sh("exit 2", 2)).exit_code, 2);
}

TEST(Launch, RanksThatDisagreeFailTheLaunch) {
  auto r = dist::launch_ranks(sh("exit $((LAR_RANK * 3))", 2));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.failure, "the ranks ended differently: rank 0 exited with code 0; rank 1 exited with code 3");
}

TEST(Launch, AKilledRankEndsTheLaunchAfterTheGrace) {
  // Rank 1 dies at once; rank 0 hangs (as a rank blocked on a dead peer would) and is
  // killed once the grace period is over.
  const auto t0 = std::chrono::steady_clock::now();
  auto r = dist::launch_ranks(sh("if [ $LAR_RANK = 1 ]; then kill -9 $$; fi; exec sleep 30", 2, 0.5));
  const double s = seconds_since(t0);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.failure,
            "rank 1 was killed by SIGKILL (signal 9); rank 0 did not exit in time and was killed (0.5 s after)");
  EXPECT_EQ(r.ranks[1].signal, SIGKILL);
  EXPECT_FALSE(r.ranks[1].killed_by_launcher);
  EXPECT_TRUE(r.ranks[0].killed_by_launcher);
  EXPECT_LT(s, 5.0);
}

TEST(Launch, AFailedRankWhosePeersExitIsTheCause) {
  // Rank 0 fails with code 1; rank 1 notices (here: after 0.2 s) and exits 1 as well.
  auto r = dist::launch_ranks(sh("if [ $LAR_RANK = 0 ]; then exit 1; fi; sleep 0.2; exit 1", 2, 30));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.failure, "rank 0 exited with code 1");
  EXPECT_FALSE(r.ranks[1].killed_by_launcher);
}

TEST(Launch, SignalsReachEveryRank) {
  // SIGTERM to the launcher: every rank gets it (the trap exits 3, as a preempted trainer).
  std::thread sender([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ::kill(::getpid(), SIGTERM);
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto r = dist::launch_ranks(sh("trap 'exit 3' TERM; sleep 20 & wait", 3));
  sender.join();
  EXPECT_EQ(r.exit_code, 3) << r.failure;
  EXPECT_LT(seconds_since(t0), 10.0);
}

TEST(Launch, AMissingProgramIsAFailure) {
  dist::LaunchOptions o;
  o.argv = {"/nonexistent/lar", "train"};
  o.nproc = 2;
  auto r = dist::launch_ranks(o);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.failure.find("exited with code 127"), std::string::npos) << r.failure;
}

TEST(Launch, FailureIsRecordedFirstInTheRunStatus) {
  const TempDir tmp;
  RunDir rd(tmp.path);
  // Rank 0 was killed while running: nobody recorded anything; the launcher does.
  RunStatus s;
  s.attempt = 1;
  rd.transition(s, RunState::running);
  dist::record_launch_failure(rd, 0, "rank 0 was killed by SIGKILL (signal 9)");
  auto st = rd.read_status();
  EXPECT_EQ(st->state, RunState::failed);
  EXPECT_EQ(st->reason, "rank 0 was killed by SIGKILL (signal 9)");
  // Rank 0 recorded its timeout in attempt 2: the launcher's cause goes first.
  s = *st;
  s.attempt = 2;
  rd.transition(s, RunState::running);
  rd.transition(s, RunState::failed, "rank 0: gradient all-reduce timed out after 40 s");
  dist::record_launch_failure(rd, 1, "rank 1 was killed by SIGKILL (signal 9)");
  st = rd.read_status();
  EXPECT_EQ(st->reason, "rank 1 was killed by SIGKILL (signal 9); rank 0: gradient all-reduce timed out after 40 s");
  EXPECT_EQ(st->history.back().reason, st->reason);
  const auto events = st->history.size();
  dist::record_launch_failure(rd, 1, "rank 1 was killed by SIGKILL (signal 9)");  // idempotent
  EXPECT_EQ(rd.read_status()->reason, st->reason);
  EXPECT_EQ(rd.read_status()->history.size(), events);
}
