#pragma once
// SlurmExecutor: runs a launch's jobs as Slurm job arrays (submitit's pattern, in C++).
//
// submit(jobs):
//   <runs>/<experiment>/slurm/<launch-id>/manifest.tsv    line i: "<cell id>\t<run dir>"
//   <runs>/<experiment>/slurm/<launch-id>/array-<k>.sbatch one readable script per array
//   <runs>/<experiment>/slurm/<launch-id>/logs/%A_%a.out   Slurm's stdout of each task
//   <runs>/<experiment>/slurm/<launch-id>/jobs.json        the submitted job ids
// One sbatch per array; a matrix larger than the cluster's MaxArraySize (read from
// `scontrol show config`) is split into several arrays. `%K` throttles each array.
// Each array task runs `lar slurm-task --manifest M --offset O`, which maps
// SLURM_ARRAY_TASK_ID + O to a run directory and runs `lar train --run-dir D` under it.
//
// Time limits and preemption (see cli/slurm_task.cpp):
//   --signal=B:USR2@<lead>  Slurm warns the batch step <lead> s before the time limit;
//                           slurm-task forwards USR2 to the trainer (checkpoint, exit 3)
//                           and requeues the task itself (`scontrol requeue`), at most
//                           max_timeout_requeues times; then the run is marked `timeout`.
//                           USR2, not USR1: NCCL uses USR1.
//   SIGTERM (preemption, `scontrol requeue`, scancel) reaches the trainer, which
//                           checkpoints and exits 3; Slurm requeues a preempted/requeued
//                           task (--requeue), and the next attempt resumes from the
//                           checkpoint. A cancelled task is recorded `cancelled`.
//
// Follow-up step (--then CMD, and `lar reproduce --executor slurm`): after the arrays,
// submit() writes <launch dir>/then.sbatch and submits it with
// --dependency=afterok:<every array of the launch>, so CMD runs once every task completed.
// If a task fails, times out or is cancelled, Slurm never starts it: it stays PENDING
// with reason DependencyNeverSatisfied; the launch reports that, `lar status` shows it,
// and the next launch of the experiment cancels it (it submits its own follow-up).
//
// poll(): reconciles Slurm's view (squeue; `scontrol show job` for tasks that left the
// queue; sacct is not needed) with the run directories.
#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/run_dir.hpp"
#include "runner/executor.hpp"

namespace lar::runner {

struct SlurmOptions {
  std::string partition;             // --partition (empty: the cluster's default)
  std::string time;                  // --time, e.g. "04:00:00" (empty: partition default)
  int gpus_per_job = 0;              // --gres=gpu:G
  int nproc = 0;                     // > 1: data-parallel ranks per run, one srun task per GPU
                                     // (docs/distributed.md); 0: LAR_SLURM_NPROC, else 1
  int cpus_per_task = 0;             // --cpus-per-task (0: Slurm's default)
  std::string mem;                   // --mem (empty: default)
  int array_throttle = 0;            // %K (0: no throttle)
  std::vector<std::string> sbatch_args;  // extra #SBATCH lines, e.g. "--qos=high"
  int signal_lead_s = 120;           // USR2 this long before the time limit
  int max_timeout_requeues = 3;      // cap on self-requeues after time limits
  std::string lar_binary;            // absolute path of lar on the cluster (default: this one)
  std::string dependency;            // --dependency for the arrays (e.g. "afterok:123")
  int max_array_size = 0;            // 0: read MaxArraySize from `scontrol show config`
  std::string then_cmd;              // follow-up shell command, afterok on the arrays (empty: none)
};

// The follow-up job of a launch, as the launch last saw it.
struct FollowUp {
  std::string job_id;
  std::string script;       // <launch dir>/then.sbatch
  std::string output;       // <launch dir>/then.out
  std::string state;        // Slurm's state: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED…
  std::string reason;       // squeue's reason while pending (Dependency, DependencyNeverSatisfied)
  bool done = false;        // ended, or will never run
  bool ok() const { return state == "COMPLETED"; }
};

// A Slurm job state mapped to a run state, with the reason to record.
struct SlurmStateMapping {
  RunState state;
  std::string reason;
  bool terminal;  // the task has left Slurm's hands for good
};
SlurmStateMapping map_slurm_state(const std::string& slurm_state);

// Seconds of a Slurm time limit: "M", "M:S", "H:M:S", "D-H", "D-H:M", "D-H:M:S"; -1 for
// UNLIMITED/INFINITE; nullopt when it is none of these (sbatch would reject it).
std::optional<long> slurm_time_seconds(const std::string& time);

// A user mistake in the Slurm options (bad --time or --mem, a signal lead not shorter
// than the time limit), in words; "" when they are fine. Checked before anything is written.
std::string check_slurm_options(const SlurmOptions& o);

// The readable sbatch script of one array (also what --dry-run prints).
std::string render_array_script(const std::string& experiment, const std::string& manifest,
                                const std::string& log_dir, int offset, int count,
                                const SlurmOptions& o);

// The follow-up script: runs `o.then_cmd` after every job in `after_ok` completed (none:
// right away). LAR_HOME and LAR_DB are exported as absolute paths and this lar's folder
// leads PATH, so `lar …` in the command means the launching lar on the same runs.
std::string render_then_script(const std::string& experiment, const std::string& launch_dir,
                               const std::vector<std::string>& after_ok, const SlurmOptions& o);

// A word for bash: single-quoted unless it is plainly safe (paths, ids).
std::string shell_quote(const std::string& s);

// This program's absolute path: the array tasks run the same `lar` (its slurm-task).
std::string this_executable();

// MaxArraySize from `scontrol show config` (the largest index is MaxArraySize − 1).
int query_max_array_size();

// Output and exit code of a command (no shell).
struct CommandResult {
  int exit_code = -1;
  std::string out;  // stdout + stderr
};
CommandResult run_command(const std::vector<std::string>& argv);

class SlurmExecutor : public Executor {
 public:
  SlurmExecutor(std::string experiment, SlurmOptions opts);
  std::string name() const override { return "slurm"; }
  int parallelism() const override { return opts_.array_throttle > 0 ? opts_.array_throttle : 0; }
  void submit(const std::vector<Job>& jobs) override;
  PollResult poll(std::chrono::milliseconds wait) override;
  bool idle() const override { return live_.empty() && (!then_ || then_->done); }
  int running() const override;
  int queued() const override;
  void stop(bool force) override;

  const std::vector<std::string>& job_ids() const { return job_ids_; }
  int sbatch_calls() const { return sbatch_calls_; }
  const std::optional<FollowUp>& followup() const { return then_; }

 private:
  struct Task {
    Job job;
    std::string slurm_id;  // "<array job id>_<index>"
    std::string state = "PENDING";
    double started_at = 0;
    bool started = false;
    bool stop_requested = false;
  };
  void refresh(PollResult& out);
  void refresh_followup(PollResult& out);
  void cancel_stale_followups();
  JobExit finish(Task& t, const std::string& final_state);

  std::string experiment_;
  SlurmOptions opts_;
  std::vector<std::string> job_ids_;
  std::map<std::string, Task> live_;  // by slurm id
  int sbatch_calls_ = 0;
  std::optional<FollowUp> then_;
  std::chrono::steady_clock::time_point next_followup_check_{};
  std::vector<std::string> notes_;  // for the next poll()
};

}  // namespace lar::runner
