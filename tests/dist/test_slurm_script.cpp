// The Slurm executor's script for data-parallel runs: one srun task per GPU.
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/error.hpp"
#include "runner/slurm_executor.hpp"

using namespace lar;
using namespace lar::runner;

TEST(SlurmDataParallel, ScriptRunsTheTrainerThroughSrunOneTaskPerGpu) {
  SlurmOptions o;
  o.lar_binary = "/opt/lar/bin/lar";
  o.nproc = 4;
  std::string s = render_array_script("exp1", "/r/m.tsv", "/r/logs", 0, 3, o);
  for (const char* line :
       {"#SBATCH --ntasks=4\n", "#SBATCH --gpus-per-task=1\n",
        "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1\n",
        "export LAR_TRAINER_CMD=\"$(command -v srun) --ntasks=4 --gpus-per-task=1 --cpu-bind=none /opt/lar/bin/lar "
        "train\"\n",
        "exec /opt/lar/bin/lar slurm-task --manifest /r/m.tsv --offset 0"})
    EXPECT_NE(s.find(line), std::string::npos) << line << "\nin\n" << s;
  EXPECT_LT(s.find("LAR_TRAINER_CMD"), s.find("exec "));
  EXPECT_EQ(s.find("kill-on-bad-exit"), std::string::npos);  // survivors record the failure
}

TEST(SlurmDataParallel, OneRankScriptIsUnchanged) {
  SlurmOptions o;
  o.lar_binary = "/opt/lar/bin/lar";
  o.gpus_per_job = 1;
  std::string s = render_array_script("exp1", "/r/m.tsv", "/r/logs", 0, 3, o);
  EXPECT_EQ(s.find("srun"), std::string::npos) << s;
  EXPECT_EQ(s.find("--ntasks"), std::string::npos) << s;
}

TEST(SlurmDataParallel, NprocFromTheEnvironment) {
  ::setenv("LAR_SLURM_NPROC", "x", 1);
  EXPECT_THROW(SlurmExecutor("e", SlurmOptions{}), UserError);
  ::unsetenv("LAR_SLURM_NPROC");
  EXPECT_NO_THROW(SlurmExecutor("e", SlurmOptions{}));
}
