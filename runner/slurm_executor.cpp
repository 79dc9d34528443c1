#include "runner/slurm_executor.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/paths.hpp"
#include "runner/local_executor.hpp"
#include "runner/run_dirs.hpp"

namespace lar::runner {

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, sep)) out.push_back(part);
  return out;
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

std::string launch_id() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::gmtime(&t));
  return std::string(buf) + "-" + std::to_string(::getpid());
}

// The last "exit" event slurm-task wrote in the run dir, if any.
std::optional<json> last_event(const fs::path& run_dir, const std::string& kind) {
  std::optional<json> found;
  for (const auto& line : read_metrics(run_dir / "slurm.jsonl").lines)
    if (line.value("event", "") == kind) found = line;
  return found;
}

}  // namespace

std::string this_executable() {
  std::error_code ec;
  auto self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw RuntimeError("cannot find this program's path (/proc/self/exe): " + ec.message());
  return self.string();
}

SlurmStateMapping map_slurm_state(const std::string& s) {
  if (s == "PENDING" || s == "CONFIGURING" || s == "REQUEUED" || s == "REQUEUE_HOLD" || s == "REQUEUE_FED")
    return {RunState::pending, "queued in Slurm", false};
  if (s == "RUNNING" || s == "COMPLETING" || s == "SUSPENDED" || s == "RESIZING" || s == "STAGE_OUT" ||
      s == "SIGNALING")
    return {RunState::running, "running in Slurm", false};
  if (s == "COMPLETED") return {RunState::completed, "", true};
  if (s == "TIMEOUT") return {RunState::timeout, "Slurm: time limit reached", true};
  if (s == "PREEMPTED") return {RunState::preempted, "Slurm: preempted", true};
  if (s == "CANCELLED" || s == "DEADLINE") return {RunState::cancelled, "Slurm: cancelled (" + s + ")", true};
  if (s == "OUT_OF_MEMORY") return {RunState::failed, "Slurm: out of memory", true};
  if (s == "NODE_FAIL") return {RunState::failed, "Slurm: node failure", true};
  if (s == "BOOT_FAIL") return {RunState::failed, "Slurm: node boot failure", true};
  return {RunState::failed, "Slurm: " + s, true};  // FAILED and anything new
}

CommandResult run_command(const std::vector<std::string>& argv) {
  int fds[2];
  if (::pipe(fds) != 0) throw RuntimeError("pipe() failed");
  pid_t pid = ::fork();
  if (pid < 0) throw RuntimeError("fork() failed");
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    ::close(fds[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "cannot run %s\n", args[0]);
    ::_exit(127);
  }
  ::close(fds[1]);
  CommandResult r;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR))
    if (n > 0) r.out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

int query_max_array_size() {
  CommandResult r = run_command({"scontrol", "show", "config"});
  if (r.exit_code != 0) throw RuntimeError("`scontrol show config` failed: " + trim(r.out));
  for (const auto& line : split(r.out, '\n')) {
    auto eq = line.find('=');
    if (eq != std::string::npos && trim(line.substr(0, eq)) == "MaxArraySize")
      return std::stoi(trim(line.substr(eq + 1)));
  }
  return 1001;  // Slurm's built-in default
}

std::string render_array_script(const std::string& experiment, const std::string& manifest,
                                const std::string& log_dir, int offset, int count, const SlurmOptions& o) {
  std::ostringstream s;
  s << "#!/bin/bash\n"
    << "# lar: experiment " << experiment << ", manifest lines " << offset << ".." << offset + count - 1 << "\n"
    << "# Each array task trains one cell: `lar slurm-task` maps SLURM_ARRAY_TASK_ID + " << offset << "\n"
    << "# to a run directory listed in the manifest and runs `lar train --run-dir D` there.\n"
    << "# USR2 arrives " << o.signal_lead_s << " s before the time limit: the trainer checkpoints and the task\n"
    << "# requeues itself (at most " << o.max_timeout_requeues << " times); preempted tasks are requeued by Slurm.\n"
    << "#SBATCH --job-name=lar-" << experiment << "\n"
    << "#SBATCH --array=0-" << count - 1;
  if (o.array_throttle > 0) s << "%" << o.array_throttle;
  s << "\n#SBATCH --output=" << log_dir << "/%A_%a.out\n"
    << "#SBATCH --open-mode=append\n"
    << "#SBATCH --requeue\n"
    << "#SBATCH --signal=B:USR2@" << o.signal_lead_s << "\n";
  if (!o.partition.empty()) s << "#SBATCH --partition=" << o.partition << "\n";
  if (!o.time.empty()) s << "#SBATCH --time=" << o.time << "\n";
  if (o.gpus_per_job > 0) s << "#SBATCH --gres=gpu:" << o.gpus_per_job << "\n";
  if (o.cpus_per_task > 0) s << "#SBATCH --cpus-per-task=" << o.cpus_per_task << "\n";
  if (!o.mem.empty()) s << "#SBATCH --mem=" << o.mem << "\n";
  if (!o.dependency.empty()) s << "#SBATCH --dependency=" << o.dependency << "\n";
  for (const auto& a : o.sbatch_args) s << "#SBATCH " << a << "\n";
  s << "exec " << o.lar_binary << " slurm-task --manifest " << manifest << " --offset " << offset
    << " --max-timeout-requeues " << o.max_timeout_requeues << "\n";
  return s.str();
}

SlurmExecutor::SlurmExecutor(std::string experiment, SlurmOptions opts)
    : experiment_(std::move(experiment)), opts_(std::move(opts)) {
  if (opts_.lar_binary.empty()) opts_.lar_binary = this_executable();
}

void SlurmExecutor::submit(const std::vector<Job>& jobs) {
  if (jobs.empty()) return;
  fs::path dir = fs::absolute(runs_root() / experiment_ / "slurm" / launch_id());
  fs::create_directories(dir / "logs");
  std::string manifest;
  for (const auto& j : jobs) manifest += j.cell_id + "\t" + fs::absolute(j.run_dir).string() + "\n";
  atomic_write(dir / "manifest.tsv", manifest);

  int chunk = opts_.max_array_size > 0 ? opts_.max_array_size : query_max_array_size();
  json ids = json::array();
  for (int offset = 0, k = 0; offset < static_cast<int>(jobs.size()); offset += chunk, ++k) {
    int count = std::min(chunk, static_cast<int>(jobs.size()) - offset);
    fs::path script = dir / ("array-" + std::to_string(k) + ".sbatch");
    atomic_write(script, render_array_script(experiment_, (dir / "manifest.tsv").string(), (dir / "logs").string(),
                                             offset, count, opts_));
    CommandResult r = run_command({"sbatch", "--parsable", script.string()});
    ++sbatch_calls_;
    if (r.exit_code != 0) throw RuntimeError("sbatch " + script.string() + " failed: " + trim(r.out));
    std::string id = trim(split(trim(r.out), ';').front());
    id = split(id, '\n').back();
    job_ids_.push_back(id);
    ids.push_back(id);
    for (int i = 0; i < count; ++i) {
      Task t;
      t.job = jobs[offset + i];
      t.slurm_id = id + "_" + std::to_string(i);
      live_[t.slurm_id] = t;
    }
  }
  atomic_write(dir / "jobs.json", json{{"experiment", experiment_}, {"job_ids", ids}}.dump(2) + "\n");
}

int SlurmExecutor::running() const {
  return static_cast<int>(std::count_if(live_.begin(), live_.end(), [](const auto& kv) {
    return map_slurm_state(kv.second.state).state == RunState::running;
  }));
}

int SlurmExecutor::queued() const { return static_cast<int>(live_.size()) - running(); }

JobExit SlurmExecutor::finish(Task& t, const std::string& final_state) {
  JobExit e;
  e.job = t.job;
  e.pid = std::stol(split(t.slurm_id, '_').front());
  e.started_at = t.started_at;
  e.ended_at = unix_now();
  e.stop_requested = t.stop_requested;
  auto exit_ev = last_event(t.job.run_dir, "exit");
  bool ran = last_event(t.job.run_dir, "start").has_value();
  if (exit_ev) e.exit_code = exit_ev->value("rc", -1);
  SlurmStateMapping m = map_slurm_state(final_state);
  RunDir rd(t.job.run_dir);
  auto st = rd.read_status();
  bool trainer_final = st && (is_terminal(st->state) || st->state == RunState::timeout);
  if (m.state == RunState::cancelled) {
    // settle_after_exit honours the marker unless the trainer had already finished.
    atomic_write(cancel_marker_path(t.job.run_dir), m.reason + "\n");
    e.never_started = !ran;
  } else if (!trainer_final && st && m.state != RunState::completed) {
    RunStatus s = *st;
    rd.transition(s, m.state, m.reason);
    if (!exit_ev) e.signal = 9;
  }
  return e;
}

void SlurmExecutor::refresh(PollResult& out) {
  std::set<std::string> arrays;
  for (const auto& [id, t] : live_) arrays.insert(split(id, '_').front());
  if (arrays.empty()) return;
  std::string list;
  for (const auto& a : arrays) list += (list.empty() ? "" : ",") + a;
  CommandResult r = run_command({"squeue", "-h", "-r", "-j", list, "-o", "%i|%T|%N"});
  if (r.exit_code != 0) return;  // controller busy or restarting: try again next poll
  std::map<std::string, std::pair<std::string, std::string>> seen;  // id → (state, node)
  for (const auto& line : split(r.out, '\n')) {
    auto f = split(trim(line), '|');
    if (f.size() >= 2) seen[f[0]] = {f[1], f.size() > 2 ? f[2] : ""};
  }
  for (auto it = live_.begin(); it != live_.end();) {
    Task& t = it->second;
    auto s = seen.find(t.slurm_id);
    std::string state = s != seen.end() ? s->second.first : "";
    if (state.empty()) {
      // Left the queue: its final state from scontrol (kept MinJobAge seconds).
      CommandResult j = run_command({"scontrol", "show", "job", t.slurm_id});
      std::string final_state = "COMPLETED";
      auto pos = j.out.find("JobState=");
      if (j.exit_code == 0 && pos != std::string::npos)
        final_state = j.out.substr(pos + 9, j.out.find_first_of(" \n", pos) - pos - 9);
      else if (auto st = RunDir(t.job.run_dir).read_status(); !st || st->state != RunState::completed)
        final_state = "FAILED";
      if (map_slurm_state(final_state).terminal) {
        if (!t.started && last_event(t.job.run_dir, "start")) {
          out.started.push_back({t.job, std::stol(split(t.slurm_id, '_').front()), "slurm", unix_now()});
          t.started_at = unix_now();
        }
        out.exited.push_back(finish(t, final_state));
        it = live_.erase(it);
        continue;
      }
      state = final_state;
    }
    t.state = state;
    if (!t.started && map_slurm_state(state).state == RunState::running) {
      t.started = true;
      t.started_at = unix_now();
      std::string node = s != seen.end() ? s->second.second : "";
      out.started.push_back({t.job, std::stol(split(t.slurm_id, '_').front()), "slurm " + node, t.started_at});
    }
    ++it;
  }
}

PollResult SlurmExecutor::poll(std::chrono::milliseconds wait) {
  PollResult out;
  auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    refresh(out);
    if (!out.empty() || idle() || std::chrono::steady_clock::now() >= deadline) return out;
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
        std::chrono::milliseconds(1000),
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now())));
  }
}

void SlurmExecutor::stop(bool force) {
  if (job_ids_.empty()) return;
  std::vector<std::string> cmd = {"scancel"};
  if (force) cmd.push_back("--signal=KILL");
  for (const auto& id : job_ids_) cmd.push_back(id);
  for (auto& [id, t] : live_) t.stop_requested = true;
  run_command(cmd);
}

}  // namespace lar::runner
