#pragma once
// Where a data-parallel rank learns who it is (docs/distributed.md):
//   lar train --nproc N   the launcher sets LAR_RANK, LAR_WORLD_SIZE, LAR_LOCAL_RANK and
//                         LAR_DIST_TOKEN (names this launch's NCCL id file) per rank;
//   srun                  SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID of a job step (only
//                         inside a step, i.e. with SLURM_STEP_ID set: a bare `lar train` in
//                         a batch script with --ntasks=4 is one process, not rank 0 of 4).
// LAR_* wins over SLURM_*. Anything else: one process (world 1).
#include <functional>
#include <string>

namespace lar::dist {

struct DistEnv {
  int rank = 0, world = 1, local_rank = 0;
  std::string source;  // "" (one process), "lar" (lar train --nproc), "slurm" (srun)
  std::string token;   // unique per launch: the NCCL id file's name
  bool distributed() const { return world > 1; }
};

using EnvLookup = std::function<const char*(const char*)>;

// The rank of this process. Throws lar::UserError naming the variable when a value is
// not an integer or out of range (rank ≥ world, world < 1, ...).
DistEnv dist_env(const EnvLookup& get);
DistEnv dist_env();  // from the process environment

// LAR_DIST_TIMEOUT (default 40 s): how long a rank waits on a collective before it takes
// its peers for dead. The launcher (lar train --nproc) adds its grace period to it.
double dist_timeout_s();

}  // namespace lar::dist
