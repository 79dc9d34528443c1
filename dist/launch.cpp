#include "dist/launch.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "core/error.hpp"

namespace lar::dist {

namespace {

std::atomic<int> g_forward{0};
void on_signal(int sig) { g_forward.store(sig); }

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

bool is_failure(const RankOutcome& r) {
  return r.signal != 0 || (r.exit_code != 0 && r.exit_code != 2 && r.exit_code != 3 && r.exit_code != 4);
}

std::string describe(const RankOutcome& r) {
  if (r.killed_by_launcher) return "rank " + std::to_string(r.rank) + " did not exit in time and was killed";
  if (r.signal) return "rank " + std::to_string(r.rank) + " was killed by " + signal_name(r.signal) + " (signal " +
                       std::to_string(r.signal) + ")";
  return "rank " + std::to_string(r.rank) + " exited with code " + std::to_string(r.exit_code);
}

}  // namespace

void record_launch_failure(const RunDir& rd, int attempt_before, const std::string& failure) {
  auto st = rd.read_status();
  RunStatus s = st.value_or(RunStatus{});
  if (st && st->attempt > attempt_before && st->state == RunState::failed) {
    if (st->reason.rfind(failure, 0) == 0) return;
    s.reason = failure + "; " + st->reason;
    if (!s.history.empty()) s.history.back().reason = s.reason;
    s.updated_at = unix_now();
    rd.write_status(s);
  } else {
    rd.transition(s, RunState::failed, failure);
  }
}

std::string new_launch_token() {
  char host[64] = {0};
  ::gethostname(host, sizeof host - 1);
  std::random_device rd;
  const auto now = std::chrono::system_clock::now().time_since_epoch().count();
  return std::string(host) + "-" + std::to_string(::getpid()) + "-" + std::to_string(now) + "-" +
         std::to_string(rd() % 100000);
}

LaunchResult launch_ranks(const LaunchOptions& o) {
  if (o.argv.empty() || o.nproc < 1) throw RuntimeError("launch_ranks: no command or no ranks");
  const std::string token = o.token.empty() ? new_launch_token() : o.token;
  // Forwarded signals: installed before the first fork, so none is lost in between.
  g_forward.store(0);
  struct sigaction sa {}, old_term {}, old_usr2 {}, old_int {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, &old_term);
  sigaction(SIGUSR2, &sa, &old_usr2);
  sigaction(SIGINT, &sa, &old_int);

  const auto t0 = std::chrono::steady_clock::now();
  const pid_t parent = ::getpid();
  std::vector<pid_t> pids(o.nproc, -1);
  LaunchResult res;
  res.ranks.resize(o.nproc);
  for (int i = 0; i < o.nproc; ++i) {
    res.ranks[i].rank = i;
    pid_t pid = ::fork();
    if (pid < 0) {
      for (int j = 0; j < i; ++j) ::kill(pids[j], SIGKILL);
      throw RuntimeError("fork() failed starting rank " + std::to_string(i));
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // the launcher died: checkpoint and stop
      if (::getppid() != parent) ::_exit(1);
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigaction(SIGTERM, &dfl, nullptr);
      sigaction(SIGUSR2, &dfl, nullptr);
      sigaction(SIGINT, &dfl, nullptr);
      ::setenv("LAR_RANK", std::to_string(i).c_str(), 1);
      ::setenv("LAR_WORLD_SIZE", std::to_string(o.nproc).c_str(), 1);
      ::setenv("LAR_LOCAL_RANK", std::to_string(i).c_str(), 1);
      ::setenv("LAR_DIST_TOKEN", token.c_str(), 1);
      ::setenv("NCCL_NVLS_ENABLE", "0", 1);
      ::setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
      ::setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
      std::vector<char*> argv;
      for (const auto& a : o.argv) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      std::fprintf(stderr, "lar: cannot run %s: %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    pids[i] = pid;
  }

  int live = o.nproc;
  int first_failure = -1;
  std::chrono::steady_clock::time_point deadline{};
  while (live > 0) {
    if (int sig = g_forward.exchange(0))
      for (int i = 0; i < o.nproc; ++i)
        if (pids[i] > 0) ::kill(pids[i], sig);
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int i = 0; i < o.nproc; ++i) {
        if (pids[i] != pid) continue;
        RankOutcome& r = res.ranks[i];
        r.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
        r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + r.signal;
        r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        pids[i] = -1;
        --live;
        if (first_failure < 0 && is_failure(r)) {
          first_failure = i;
          deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                            std::chrono::duration<double>(o.grace_s));
        }
      }
      continue;
    }
    if (first_failure >= 0 && std::chrono::steady_clock::now() >= deadline) {
      for (int i = 0; i < o.nproc; ++i)
        if (pids[i] > 0) {
          ::kill(pids[i], SIGKILL);
          res.ranks[i].killed_by_launcher = true;
        }
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  sigaction(SIGTERM, &old_term, nullptr);
  sigaction(SIGUSR2, &old_usr2, nullptr);
  sigaction(SIGINT, &old_int, nullptr);

  if (first_failure >= 0) {
    res.exit_code = 1;
    res.failure = describe(res.ranks[first_failure]);
    for (const auto& r : res.ranks)
      if (r.killed_by_launcher) {
        char after[64];
        std::snprintf(after, sizeof after, " (%g s after)", o.grace_s);
        res.failure += "; " + describe(r) + after;
      }
    return res;
  }
  const int code = res.ranks[0].exit_code;
  for (const auto& r : res.ranks)
    if (r.exit_code != code) {
      res.exit_code = 1;
      res.failure = "the ranks ended differently:";
      for (const auto& q : res.ranks) res.failure += " " + describe(q) + ";";
      res.failure.pop_back();
      return res;
    }
  res.exit_code = code;
  return res;
}

}  // namespace lar::dist
