#pragma once
// `lar train --nproc N`: start N ranks of one run on this host, one per GPU, and watch them.
//
//   rank i runs `argv` with LAR_RANK=i, LAR_WORLD_SIZE=N, LAR_LOCAL_RANK=i (its GPU index),
//   LAR_DIST_TOKEN=<this launch> and NVLink multicast off (NCCL_NVLS_ENABLE=0,
//   TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1);
//   SIGTERM / SIGUSR2 / SIGINT to the launcher reach every rank (they agree on the step,
//   rank 0 checkpoints, all exit 3); a rank dies with the launcher (PR_SET_PDEATHSIG);
//   when a rank fails (killed, or an exit code other than 0/2/3/4), the others have
//   grace_s to notice (their collectives time out, docs/distributed.md) and exit; then
//   the launcher kills what is left.
#include <string>
#include <vector>

#include "core/run_dir.hpp"

namespace lar::dist {

struct LaunchOptions {
  std::vector<std::string> argv;  // one rank's command; argv[0] is an absolute path
  int nproc = 1;
  double grace_s = 60;            // after the first failure, before SIGKILL to the rest
  std::string token;              // LAR_DIST_TOKEN (empty: new_launch_token())
};

struct RankOutcome {
  int rank = 0;
  int exit_code = 0;   // 128 + signal when killed
  int signal = 0;      // the signal that ended it (0: it exited)
  bool killed_by_launcher = false;
  double seconds = 0;  // from the start to its end
};

struct LaunchResult {
  int exit_code = 0;    // 0 all completed; 2, 3, 4 when every rank says so; else 1
  std::string failure;  // in words, when exit_code is 1: which rank failed first and how
  std::vector<RankOutcome> ranks;
};

LaunchResult launch_ranks(const LaunchOptions& o);

// The launcher's word on a failed launch goes into status.json: which rank failed first
// and how, before what the ranks themselves recorded in this attempt (a peer's timeout,
// say); `failed` with just that when no rank could record anything (rank 0 killed).
// attempt_before: the status's attempt before the launch (0: none).
void record_launch_failure(const RunDir& rd, int attempt_before, const std::string& failure);

// A fresh token for one launch (host, pid, time): its NCCL id file is its own.
std::string new_launch_token();

}  // namespace lar::dist
