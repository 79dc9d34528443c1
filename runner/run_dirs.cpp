#include "runner/run_dirs.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "core/config_schema.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/paths.hpp"

namespace lar::runner {

std::string to_string(CellAction a) {
  switch (a) {
    case CellAction::start_new: return "new";
    case CellAction::resume: return "resume";
    case CellAction::skip_completed: return "skip (completed)";
    case CellAction::skip_diverged: return "skip (diverged)";
    case CellAction::skip_running: return "skip (running)";
  }
  return "?";
}

std::string this_host() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

bool process_alive(long pid) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) == 0) return true;
  return errno == EPERM;  // exists, owned by someone else
}

bool alive_here(const RunStatus& s) {
  return s.state == RunState::running && s.host == this_host() && process_alive(s.pid);
}

fs::path cancel_marker_path(const fs::path& run_dir) { return run_dir / "cancel_requested"; }
bool cancel_requested(const fs::path& run_dir) { return fs::exists(cancel_marker_path(run_dir)); }

fs::path experiment_dir(const std::string& experiment) { return runs_root() / experiment; }

static std::optional<RunStatus> read_status_lenient(const RunDir& rd) {
  try {
    return rd.read_status();
  } catch (const RuntimeError&) {
    return std::nullopt;  // a corrupt status.json: treat the run as never started
  }
}

// Whether the run in rd trained the cell's config: equal once default-valued keys are set
// aside (a key added to the schema since, at its default, changes the hash, not the run).
static bool same_training(const RunDir& rd, const experiments::Cell& cell) {
  if (!cell.config.is_object() || cell.config.empty()) return false;
  try {
    const json stored = rd.read_config();
    return stored.contains("config") && with_defaults(stored["config"]) == with_defaults(cell.config);
  } catch (const RuntimeError&) {
    return false;
  }
}

CellPlan classify_cell(const experiments::Cell& cell, const fs::path& run_dir) {
  CellPlan p;
  p.cell = &cell;
  p.run_dir = run_dir;
  RunDir rd(run_dir);
  if (!fs::exists(run_dir)) {
    p.action = CellAction::start_new;
    return p;
  }
  std::string old_hash;
  if (rd.exists()) {
    try {
      old_hash = rd.read_config().value("hash", std::string());
    } catch (const RuntimeError&) {
      old_hash.clear();  // unreadable config: not ours to trust, move it aside
    }
  }
  if (old_hash != cell.hash && !old_hash.empty() && same_training(rd, cell)) {
    p.rekeyed = true;
    p.detail = "config hash " + old_hash.substr(0, 12) + " → " + cell.short_hash() +
               ": only keys at their defaults differ, the run is kept";
  } else if (old_hash != cell.hash) {
    // A folder without config.json that holds nothing is just an empty shell.
    bool empty = fs::is_directory(run_dir) && fs::is_empty(run_dir);
    p.action = CellAction::start_new;
    p.hash_changed = !empty;
    if (!empty)
      p.detail = old_hash.empty() ? "no readable config.json"
                                  : "config hash changed (" + old_hash.substr(0, 12) + " → " +
                                        cell.short_hash() + ")";
    return p;
  }
  p.prior = read_status_lenient(rd);
  if (!p.prior) {
    p.action = CellAction::resume;
    p.detail = "never started";
    return p;
  }
  const RunStatus& s = *p.prior;
  switch (s.state) {
    case RunState::completed:
      p.action = CellAction::skip_completed;
      return p;
    case RunState::diverged:
      p.action = CellAction::skip_diverged;
      p.detail = "diverged at step " + std::to_string(s.step);
      return p;
    case RunState::running:
      if (s.host != this_host()) {
        p.action = CellAction::skip_running;
        p.detail = "running on " + s.host + " (pid " + std::to_string(s.pid) + "); not touched";
        return p;
      }
      if (process_alive(s.pid)) {
        p.action = CellAction::skip_running;
        p.detail = "already running (pid " + std::to_string(s.pid) + ")";
        return p;
      }
      p.action = CellAction::resume;
      p.detail = "was running (pid " + std::to_string(s.pid) + ", gone) at step " + std::to_string(s.step);
      return p;
    case RunState::pending:
      p.action = CellAction::resume;
      p.detail = "never started";
      return p;
    default:
      p.action = CellAction::resume;
      p.detail = to_string(s.state) + " at step " + std::to_string(s.step) +
                 (s.reason.empty() ? "" : " (" + s.reason + ")");
      return p;
  }
}

fs::path move_aside(const fs::path& run_dir) {
  for (int n = 1;; ++n) {
    fs::path to = run_dir.parent_path() / (run_dir.filename().string() + ".old-" + std::to_string(n));
    if (fs::exists(to)) continue;
    std::error_code ec;
    fs::rename(run_dir, to, ec);
    if (ec) throw RuntimeError("cannot move " + run_dir.string() + " aside to " + to.string() + ": " + ec.message());
    fsync_dir(run_dir.parent_path());
    return to;
  }
}

std::optional<fs::path> prepare_run_dir(const CellPlan& p) {
  std::optional<fs::path> moved;
  if (p.hash_changed) moved = move_aside(p.run_dir);
  else if (fs::exists(p.run_dir) && fs::is_directory(p.run_dir) && fs::is_empty(p.run_dir) &&
           p.action == CellAction::start_new)
    fs::remove(p.run_dir);
  fs::create_directories(p.run_dir);
  RunDir rd(p.run_dir);
  if (!rd.exists()) rd.write_config(p.cell->run_config_json());
  if (!read_status_lenient(rd)) {
    RunStatus s;  // pending: created by the runner, not yet opened by a trainer
    s.updated_at = unix_now();
    s.history.push_back({RunState::pending, s.updated_at, 0, "", 0});
    rd.write_status(s);
  }
  std::error_code ec;
  fs::remove(cancel_marker_path(p.run_dir), ec);  // a request from an earlier launch
  return moved;
}

static std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// The last non-empty line of the child's output (its error message, usually), cut short.
static std::string last_log_line(const fs::path& run_dir) {
  std::ifstream in(run_dir / "stdout.log", std::ios::binary);
  if (!in) return "";
  in.seekg(0, std::ios::end);
  std::streamoff size = in.tellg();
  std::streamoff from = size > 4096 ? size - 4096 : 0;
  in.seekg(from);
  std::string tail((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!tail.empty() && (tail.back() == '\n' || tail.back() == '\r' || tail.back() == ' ')) tail.pop_back();
  auto nl = tail.rfind('\n');
  std::string line = nl == std::string::npos ? tail : tail.substr(nl + 1);
  if (line.size() > 300) line = line.substr(0, 297) + "...";
  return line;
}

Settled settle_after_exit(const JobExit& e, int attempt_before) {
  RunDir rd(e.job.run_dir);
  RunStatus s = read_status_lenient(rd).value_or(RunStatus{});
  bool trainer_opened = s.attempt > attempt_before;
  bool trainer_settled = trainer_opened && s.state != RunState::running && s.state != RunState::pending;
  Settled out;

  std::optional<std::string> cancel_reason;
  if (cancel_requested(e.job.run_dir)) {
    std::ifstream in(cancel_marker_path(e.job.run_dir));
    std::string why((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) why.pop_back();
    cancel_reason = why.empty() ? "cancelled by lar cancel" : why;
  }

  if (!trainer_opened) {
    // The trainer never got as far as recording this attempt: record it for it.
    s.attempt = attempt_before + 1;
    s.started_at = e.started_at;
    s.pid = e.pid;
    s.host = this_host();
  }

  RunState st = s.state;
  bool keep_final = st == RunState::completed || st == RunState::failed || st == RunState::diverged;
  if (e.never_started) {
    out.written_by_runner = true;
    s.attempt = attempt_before;  // nothing ran
    rd.transition(s, RunState::cancelled, cancel_reason.value_or("cancelled before it started"));
  } else if (cancel_reason && !(trainer_settled && keep_final) && st != RunState::cancelled) {
    out.written_by_runner = true;
    rd.transition(s, RunState::cancelled, *cancel_reason);
  } else if (!trainer_settled) {
    RunState to = RunState::failed;
    std::string why;
    if (e.signal != 0) {
      if (e.stop_requested) {
        to = RunState::preempted;
        why = "stopped by lar launch (" + signal_name(e.signal) + ")";
      } else {
        why = "killed by " + signal_name(e.signal);
      }
    } else {
      switch (e.exit_code) {
        case 0: why = "trainer exited 0 without writing a final status"; break;
        case 1: why = "trainer failed (exit code 1)"; break;
        case 2: why = "bad config (exit code 2)"; break;
        case 3: to = RunState::preempted; why = "preempted (exit code 3)"; break;
        case 4: to = RunState::diverged; why = "diverged (exit code 4)"; break;
        default: why = "trainer exited with code " + std::to_string(e.exit_code);
      }
      if (to == RunState::failed && e.exit_code != 0) {
        // Say why right in the status: the child's last words are usually the error.
        std::string last = last_log_line(e.job.run_dir);
        why += last.empty() ? "; see stdout.log" : ": " + last;
      }
    }
    out.written_by_runner = true;
    rd.transition(s, to, why);
  }
  std::error_code ec;
  fs::remove(cancel_marker_path(e.job.run_dir), ec);  // honoured; the status carries the reason
  out.state = s.state;
  out.reason = s.reason;
  out.attempt = s.attempt;
  return out;
}

void append_attempt_record(const JobExit& e, const Settled& s, const std::string& executor) {
  json line = {{"time", e.started_at}, {"ended_at", e.ended_at}, {"pid", e.pid},
               {"attempt", s.attempt}, {"exit_code", e.signal ? json(nullptr) : json(e.exit_code)},
               {"signal", e.signal ? json(e.signal) : json(nullptr)}, {"state", to_string(s.state)},
               {"reason", s.reason}, {"executor", executor}, {"host", this_host()}};
  // Each record is one line, appended with O_APPEND (like metrics.jsonl).
  MetricsWriter(e.job.run_dir / "runner.jsonl").append(line);
}

LaunchLock::LaunchLock(const std::string& experiment) {
  fs::path dir = experiment_dir(experiment);
  fs::create_directories(dir);
  fs::path path = dir / ".launch.lock";
  // O_CLOEXEC: children must not inherit the lock, or an orphaned trainer would hold it.
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw RuntimeError("cannot open " + path.string() + ": " + std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd_);
    fd_ = -1;
    auto pid = active_launch_pid(experiment);
    throw UserError("experiment '" + experiment + "' is already being launched" +
                    (pid ? " by pid " + std::to_string(*pid) : std::string()) +
                    " (lock " + path.string() + "); stop it with `lar cancel " + experiment + "`");
  }
  std::string content = json{{"pid", ::getpid()}, {"host", this_host()}, {"started_at", unix_now()}}.dump() + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, content.data(), content.size(), 0) < 0)
    throw RuntimeError("cannot write " + path.string());
}

LaunchLock::~LaunchLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

std::optional<long> active_launch_pid(const std::string& experiment) {
  fs::path path = experiment_dir(experiment) / ".launch.lock";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  bool held = ::flock(fd, LOCK_SH | LOCK_NB) != 0;
  ::close(fd);
  if (!held) return std::nullopt;
  try {
    return json::parse(read_file(path)).value("pid", 0L);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace lar::runner
