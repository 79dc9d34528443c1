#include "runner/local_executor.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include "core/env.hpp"
#include "core/error.hpp"
#include "core/run_dir.hpp"
#include "runner/run_dirs.hpp"

namespace lar::runner {

std::vector<std::string> default_trainer_cmd() {
  if (const auto env = env_string("LAR_TRAINER_CMD")) {
    std::vector<std::string> cmd;
    std::istringstream in(*env);
    for (std::string w; in >> w;) cmd.push_back(w);
    return cmd;
  }
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw RuntimeError("cannot find this program's path (/proc/self/exe): " + ec.message());
  return {self.string(), "train"};
}

LocalExecutor::LocalExecutor(LocalOptions opts) : opts_(std::move(opts)) {
  if (opts_.parallelism < 1) opts_.parallelism = 1;
  if (opts_.trainer_cmd.empty()) opts_.trainer_cmd = default_trainer_cmd();
  free_gpus_ = opts_.gpus;
}

LocalExecutor::~LocalExecutor() {
  for (auto& [pid, c] : children_) ::kill(pid, SIGKILL);
  for (auto& [pid, c] : children_) ::waitpid(pid, nullptr, 0);
}

void LocalExecutor::submit(const std::vector<Job>& jobs) {
  for (const auto& j : jobs) queue_.push_back(j);
}

pid_t LocalExecutor::spawn(const Job& job, const std::string& gpu) {
  std::vector<std::string> args = opts_.trainer_cmd;
  args.push_back("--run-dir");
  args.push_back(job.run_dir.string());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::string log = (job.run_dir / "stdout.log").string();
  pid_t parent = ::getpid();

  // Everything the child needs is prepared before fork(): after it, only async-signal-safe
  // calls (open, dup2, setpgid, prctl, execv, _exit).
  pid_t pid = ::fork();
  if (pid < 0) throw RuntimeError(std::string("fork failed: ") + std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);  // the launcher died before prctl
    // Restore default dispositions and an empty mask (the launcher may block signals).
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::signal(SIGPIPE, SIG_DFL);
    int in = ::open("/dev/null", O_RDONLY);
    int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (in < 0 || out < 0) ::_exit(126);
    ::dup2(in, 0);
    ::dup2(out, 1);
    ::dup2(out, 2);
    if (!gpu.empty()) ::setenv("CUDA_VISIBLE_DEVICES", gpu.c_str(), 1);
    ::execv(argv[0], argv.data());
    const char msg[] = "lar launch: cannot execute the trainer command\n";
    (void)!::write(2, msg, sizeof msg - 1);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also from the parent, so the group exists before any kill()
  return pid;
}

void LocalExecutor::start_queued(PollResult& out) {
  while (!stopping_ && !queue_.empty() && static_cast<int>(children_.size()) < opts_.parallelism) {
    Job job = queue_.front();
    queue_.pop_front();
    if (cancel_requested(job.run_dir)) {  // `lar cancel --cell` before it started
      JobExit e;
      e.job = job;
      e.never_started = true;
      e.started_at = e.ended_at = unix_now();
      out.exited.push_back(e);
      continue;
    }
    std::string gpu;
    if (job.wants_gpu && !free_gpus_.empty()) {
      gpu = free_gpus_.front();
      free_gpus_.erase(free_gpus_.begin());
    }
    pid_t pid = spawn(job, gpu);
    Child c{job, unix_now(), gpu, false};
    children_[pid] = c;
    out.started.push_back({job, pid, gpu.empty() ? "cpu" : "gpu " + gpu, c.started_at});
  }
}

void LocalExecutor::reap(PollResult& out) {
  for (auto it = children_.begin(); it != children_.end();) {
    int st = 0;
    pid_t r = ::waitpid(it->first, &st, WNOHANG);
    if (r == 0 || (r < 0 && errno == EINTR)) {
      ++it;
      continue;
    }
    JobExit e;
    e.job = it->second.job;
    e.pid = it->first;
    e.started_at = it->second.started_at;
    e.ended_at = unix_now();
    e.stop_requested = it->second.stop_requested || stopping_;
    if (r < 0) {
      e.exit_code = 1;  // lost track of it (ECHILD): count as failed
    } else if (WIFEXITED(st)) {
      e.exit_code = WEXITSTATUS(st);
    } else if (WIFSIGNALED(st)) {
      e.signal = WTERMSIG(st);
    }
    if (!it->second.gpu.empty()) free_gpus_.push_back(it->second.gpu);
    out.exited.push_back(e);
    it = children_.erase(it);
  }
}

PollResult LocalExecutor::poll(std::chrono::milliseconds wait) {
  PollResult out;
  auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    reap(out);
    start_queued(out);
    if (!out.empty() || idle() || std::chrono::steady_clock::now() >= deadline) return out;
    // Children are few and exits rare: a short sleep keeps this simple (no SIGCHLD games)
    // and lets the caller see a stop request promptly.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void LocalExecutor::stop(bool force) {
  stopping_ = true;
  queue_.clear();  // never started: their run dirs stay pending
  for (auto& [pid, c] : children_) {
    c.stop_requested = true;
    ::kill(pid, force ? SIGKILL : SIGTERM);
  }
}

}  // namespace lar::runner
