// The Slurm executor's pure parts: state mapping and the generated array script.
#include <gtest/gtest.h>

#include "runner/slurm_executor.hpp"

using namespace lar;
using namespace lar::runner;

TEST(SlurmStates, MapToRunStatesWithReasons) {
  EXPECT_EQ(map_slurm_state("PENDING").state, RunState::pending);
  EXPECT_FALSE(map_slurm_state("PENDING").terminal);
  EXPECT_EQ(map_slurm_state("RUNNING").state, RunState::running);
  EXPECT_EQ(map_slurm_state("COMPLETED").state, RunState::completed);
  EXPECT_EQ(map_slurm_state("TIMEOUT").state, RunState::timeout);
  EXPECT_EQ(map_slurm_state("PREEMPTED").state, RunState::preempted);
  EXPECT_EQ(map_slurm_state("CANCELLED").state, RunState::cancelled);
  auto oom = map_slurm_state("OUT_OF_MEMORY");
  EXPECT_EQ(oom.state, RunState::failed);
  EXPECT_EQ(oom.reason, "Slurm: out of memory");
  EXPECT_EQ(map_slurm_state("NODE_FAIL").reason, "Slurm: node failure");
  EXPECT_EQ(map_slurm_state("FAILED").state, RunState::failed);
  EXPECT_TRUE(map_slurm_state("FAILED").terminal);
}

TEST(SlurmScript, ArrayThrottleSignalRequeueAndResources) {
  SlurmOptions o;
  o.lar_binary = "/opt/lar/bin/lar";
  o.partition = "gpu";
  o.time = "04:00:00";
  o.gpus_per_job = 1;
  o.array_throttle = 2;
  o.signal_lead_s = 90;
  o.max_timeout_requeues = 5;
  o.sbatch_args = {"--qos=high"};
  std::string s = render_array_script("exp1", "/runs/exp1/slurm/L/manifest.tsv", "/runs/exp1/slurm/L/logs", 1001, 12, o);
  EXPECT_EQ(s.rfind("#!/bin/bash\n", 0), 0u);
  for (const char* line : {"#SBATCH --job-name=lar-exp1\n", "#SBATCH --array=0-11%2\n",
                           "#SBATCH --output=/runs/exp1/slurm/L/logs/%A_%a.out\n", "#SBATCH --requeue\n",
                           "#SBATCH --signal=B:USR2@90\n", "#SBATCH --partition=gpu\n", "#SBATCH --time=04:00:00\n",
                           "#SBATCH --gres=gpu:1\n", "#SBATCH --qos=high\n",
                           "exec /opt/lar/bin/lar slurm-task --manifest /runs/exp1/slurm/L/manifest.tsv --offset 1001 "
                           "--max-timeout-requeues 5\n"})
    EXPECT_NE(s.find(line), std::string::npos) << line << "\nin\n" << s;
  EXPECT_EQ(s.find("USR1"), std::string::npos) << "NCCL uses USR1";
}
