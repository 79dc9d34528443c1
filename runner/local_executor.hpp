#pragma once
// LocalExecutor: runs each job as a child process on this machine, N at a time.
//
//   <trainer command…> --run-dir D     e.g. `/usr/bin/lar train --run-dir D`
//
// - The child's stdout and stderr are appended to D/stdout.log; stdin is /dev/null.
// - Each child gets its own process group, so a Ctrl-C typed at the terminal reaches only
//   `lar launch`, which then forwards SIGTERM to the children (the trainer checkpoints and
//   exits "preempted"). PR_SET_PDEATHSIG sends a child SIGTERM if `lar launch` itself dies.
// - GPU jobs get one GPU each (CUDA_VISIBLE_DEVICES=<id>), from the pool of visible GPUs.
#include <sys/types.h>

#include <deque>
#include <map>
#include <string>
#include <vector>

#include "runner/executor.hpp"

namespace lar::runner {

struct LocalOptions {
  int parallelism = 1;                  // jobs at once (≥ 1)
  std::vector<std::string> trainer_cmd; // argv prefix; "--run-dir D" is appended
  std::vector<std::string> gpus;        // device ids to hand out to GPU jobs (may be empty)
};

class LocalExecutor : public Executor {
 public:
  explicit LocalExecutor(LocalOptions opts);
  ~LocalExecutor() override;  // SIGKILLs and reaps children still running (should not happen)

  std::string name() const override { return "local"; }
  int parallelism() const override { return opts_.parallelism; }
  void submit(const std::vector<Job>& jobs) override;
  PollResult poll(std::chrono::milliseconds wait) override;
  bool idle() const override { return queue_.empty() && children_.empty(); }
  int running() const override { return static_cast<int>(children_.size()); }
  int queued() const override { return static_cast<int>(queue_.size()); }
  void stop(bool force) override;

 private:
  struct Child {
    Job job;
    double started_at = 0;
    std::string gpu;
    bool stop_requested = false;
  };
  void start_queued(PollResult& out);
  pid_t spawn(const Job& job, const std::string& gpu);
  void reap(PollResult& out);

  LocalOptions opts_;
  std::deque<Job> queue_;
  std::map<pid_t, Child> children_;
  std::vector<std::string> free_gpus_;
  bool stopping_ = false;
};

// The default trainer command: this program's own path (/proc/self/exe) + "train",
// unless LAR_TRAINER_CMD is set (split on spaces; tests point it at a test-only trainer).
std::vector<std::string> default_trainer_cmd();

}  // namespace lar::runner
