#pragma once
// What Slurm holds of an experiment, for the commands that run in another process than
// the launch (`lar cancel`, `lar status`): the launch records the Slurm executor writes
//   <runs>/<experiment>/slurm/<launch-id>/manifest.tsv   line i: "<cell id>\t<run dir>"
//   <runs>/<experiment>/slurm/<launch-id>/jobs.json      arrays (job id, manifest offset,
//                                                        count) and the follow-up job
// joined with squeue's view of those jobs (no accounting database needed).
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace lar::runner {

struct SlurmArray {
  std::string job_id;  // the array job id
  int offset = 0;      // manifest line of its task 0
  int count = 0;
};

struct SlurmLaunchRecord {
  std::filesystem::path dir;  // <runs>/<experiment>/slurm/<launch-id>
  std::vector<SlurmArray> arrays;
  std::string then_job;       // the follow-up job (--then); empty when none
  std::vector<std::pair<std::string, std::filesystem::path>> manifest;  // cell id, run dir
  // "<array job>_<index>" of manifest line `line`; empty when no array covers it.
  std::string task_id(size_t line) const;
};

// Launch records of the experiment, oldest first (launch ids sort by time). Folders
// without a jobs.json (a submission that failed) are skipped.
std::vector<SlurmLaunchRecord> read_slurm_launches(const std::string& experiment);

// One line of squeue: an array task ("123_4"), or a plain job ("125").
struct QueuedJob {
  std::string id;
  std::string state;   // PENDING, RUNNING, COMPLETING, REQUEUED…
  std::string reason;  // squeue's %r: JobArrayTaskLimit, Dependency, DependencyNeverSatisfied…
  std::string node;
};

// squeue's view of these jobs (array tasks one per line); jobs that left the queue are
// absent. nullopt when squeue cannot answer (no controller). Job ids Slurm has already
// forgotten are not an error.
std::optional<std::map<std::string, QueuedJob>> query_queue(const std::vector<std::string>& job_ids);

// A Slurm reason in words for `lar status` and `lar launch` ("" when none to say).
std::string explain_slurm_reason(const std::string& reason);

// The experiment's cells and follow-up jobs that are still in Slurm's queue.
struct SlurmView {
  bool used = false;       // the experiment has Slurm launch records
  bool available = false;  // squeue answered
  struct Task {
    std::string cell_id;
    std::filesystem::path run_dir;
    QueuedJob job;
  };
  std::vector<Task> tasks;           // queued or running array tasks (per cell: its latest launch)
  std::vector<QueuedJob> followups;  // follow-up jobs still queued
};
SlurmView read_slurm_view(const std::string& experiment);

// `lar status` lines for the Slurm part of an experiment (none when it never used Slurm).
std::vector<std::string> render_slurm_view(const SlurmView& v);

}  // namespace lar::runner
