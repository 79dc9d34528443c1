#pragma once
// The Executor interface: how the runner gets cells executed. One implementation per
// backend — LocalExecutor (child processes on this machine) and, later, a Slurm executor
// (job arrays). The runner (runner/launch.hpp) owns everything about run directories
// (creating config.json, skipping done cells, settling the final status, runner.jsonl);
// an executor only starts `lar train --run-dir D` somewhere and reports when it ended.
//
// Life cycle, driven by runner::launch():
//   submit(jobs)            once, with every cell that needs running (in plan order)
//   poll(wait) … poll(wait) until idle(); each call returns what started/ended since the
//                           last call, waiting at most `wait` when nothing happened
//   stop(force)             on Ctrl-C / `lar cancel EXPERIMENT`: queued jobs are dropped
//                           (their run dirs stay pending), running ones get SIGTERM
//                           (force: SIGKILL); keep polling until idle()
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

namespace lar::runner {

struct Job {
  std::string experiment;
  std::string cell_id;
  std::filesystem::path run_dir;
  // GPU backend: the job wants one GPU (the executor pins it via CUDA_VISIBLE_DEVICES).
  bool wants_gpu = false;
};

struct JobStart {
  Job job;
  long pid = 0;          // local: the child's pid; slurm: the job id
  std::string where;     // "gpu 1", "cpu", a node name…
  double at = 0;         // unix seconds
};

struct JobExit {
  Job job;
  long pid = 0;
  int exit_code = -1;    // when the process exited normally
  int signal = 0;        // when it was killed by a signal
  double started_at = 0;
  double ended_at = 0;
  bool stop_requested = false;  // we asked it to stop (stop(), cancel_job())
  bool never_started = false;   // dropped from the queue because a cancel was requested
};

struct PollResult {
  std::vector<JobStart> started;
  std::vector<JobExit> exited;
  std::vector<std::string> notes;  // for the user, e.g. what became of a follow-up job
  bool empty() const { return started.empty() && exited.empty() && notes.empty(); }
};

class Executor {
 public:
  virtual ~Executor() = default;
  virtual std::string name() const = 0;
  // How many jobs run at once (for the progress display).
  virtual int parallelism() const = 0;
  virtual void submit(const std::vector<Job>& jobs) = 0;
  virtual PollResult poll(std::chrono::milliseconds wait) = 0;
  // Nothing queued and nothing running.
  virtual bool idle() const = 0;
  virtual int running() const = 0;
  virtual int queued() const = 0;
  // Stop everything: drop queued jobs, SIGTERM running ones (SIGKILL when force).
  virtual void stop(bool force) = 0;
};

}  // namespace lar::runner
