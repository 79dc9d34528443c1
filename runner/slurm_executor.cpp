#include "runner/slurm_executor.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/env.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/paths.hpp"
#include "runner/local_executor.hpp"
#include "runner/run_dirs.hpp"
#include "runner/slurm_queue.hpp"

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

std::string join_ids(const std::vector<std::string>& ids) {
  std::string s;
  for (const auto& id : ids) s += (s.empty() ? "" : ", ") + id;
  return s;
}

// An absolute path without "." segments or a trailing slash, for the scripts.
std::string clean_absolute(const fs::path& p) {
  std::string s = fs::absolute(p).lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

// JobState=… of `scontrol show job ID`; empty when Slurm no longer knows the job.
std::string scontrol_job_state(const std::string& id) {
  CommandResult j = run_command({"scontrol", "show", "job", id});
  auto pos = j.out.find("JobState=");
  if (j.exit_code != 0 || pos == std::string::npos) return "";
  return j.out.substr(pos + 9, j.out.find_first_of(" \n", pos) - pos - 9);
}

// JobState of every task of an array Slurm still remembers ("<array>_<i>" → state), from
// one `scontrol show job <array>` (records separated by blank lines) instead of one call
// per task: a 1,000-task array that left the queue is settled in one call.
std::map<std::string, std::string> scontrol_array_states(const std::string& array) {
  std::map<std::string, std::string> out;
  CommandResult j = run_command({"scontrol", "show", "job", array});
  if (j.exit_code != 0) return out;
  // KEY=VALUE at the start of a word ("JobId=" must not match inside "ArrayJobId=").
  auto field = [](const std::string& rec, const std::string& key) -> std::string {
    for (size_t pos = rec.find(key + "="); pos != std::string::npos; pos = rec.find(key + "=", pos + 1)) {
      if (pos > 0 && !std::isspace(static_cast<unsigned char>(rec[pos - 1]))) continue;
      size_t from = pos + key.size() + 1;
      return rec.substr(from, rec.find_first_of(" \n", from) - from);
    }
    return "";
  };
  size_t start = 0;
  while (start < j.out.size()) {
    size_t end = j.out.find("\n\n", start);
    std::string rec = j.out.substr(start, end == std::string::npos ? std::string::npos : end - start);
    start = end == std::string::npos ? j.out.size() : end + 2;
    std::string task = field(rec, "ArrayTaskId"), state = field(rec, "JobState");
    bool single = !task.empty() && std::all_of(task.begin(), task.end(), ::isdigit);  // not "3-999%2"
    if (single && !state.empty() && field(rec, "ArrayJobId") == array) out[array + "_" + task] = state;
  }
  return out;
}

}  // namespace

std::string shell_quote(const std::string& s) {
  bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::string("/._-+=:,@%").find(c) != std::string::npos;
  });
  if (plain) return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

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

std::optional<long> slurm_time_seconds(const std::string& t) {
  if (t == "UNLIMITED" || t == "INFINITE" || t == "unlimited" || t == "infinite") return -1;
  std::string rest = t;
  long days = -1;
  if (auto dash = rest.find('-'); dash != std::string::npos) {
    std::string d = rest.substr(0, dash);
    if (d.empty() || !std::all_of(d.begin(), d.end(), ::isdigit) || d.size() > 6) return std::nullopt;
    days = std::stol(d);
    rest = rest.substr(dash + 1);
  }
  std::vector<long> parts;
  for (const auto& p : split(rest, ':')) {
    if (p.empty() || p.size() > 9 || !std::all_of(p.begin(), p.end(), ::isdigit)) return std::nullopt;
    parts.push_back(std::stol(p));
  }
  if (rest.empty() || rest.back() == ':' || parts.empty() || parts.size() > 3) return std::nullopt;
  if (days >= 0) {  // D-H, D-H:M, D-H:M:S
    long s = days * 86400 + parts[0] * 3600;
    if (parts.size() > 1) s += parts[1] * 60;
    if (parts.size() > 2) s += parts[2];
    return s;
  }
  if (parts.size() == 1) return parts[0] * 60;                 // M
  if (parts.size() == 2) return parts[0] * 60 + parts[1];      // M:S
  return parts[0] * 3600 + parts[1] * 60 + parts[2];           // H:M:S
}

std::string check_slurm_options(const SlurmOptions& o) {
  std::optional<long> limit;
  if (!o.time.empty()) {
    limit = slurm_time_seconds(o.time);
    if (!limit)
      return "--time '" + o.time + "' is not a Slurm time limit (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S or UNLIMITED)";
    if (*limit == 0) return "--time '" + o.time + "' is zero: a task would get no time at all";
  }
  if (limit && *limit > 0 && o.signal_lead_s >= *limit)
    return "--signal-lead " + std::to_string(o.signal_lead_s) + " is not shorter than --time " + o.time + " (" +
           std::to_string(*limit) + " s): the time-limit warning would come before the task starts";
  if (!o.mem.empty()) {
    size_t digits = 0;
    while (digits < o.mem.size() && std::isdigit(static_cast<unsigned char>(o.mem[digits]))) ++digits;
    std::string unit = o.mem.substr(digits);
    if (digits == 0 || !(unit.empty() || unit == "K" || unit == "M" || unit == "G" || unit == "T"))
      return "--mem '" + o.mem + "' is not a Slurm memory size (a number with an optional K, M, G or T, e.g. 32G)";
  }
  return "";
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
  if (o.nproc > 1) {
    // Data parallel (docs/distributed.md): one task per GPU, anywhere in the allocation.
    s << "#SBATCH --ntasks=" << o.nproc << "\n";
    if (o.gpus_per_job <= 0) s << "#SBATCH --gpus-per-task=1\n";
  }
  if (o.cpus_per_task > 0) s << "#SBATCH --cpus-per-task=" << o.cpus_per_task << "\n";
  if (!o.mem.empty()) s << "#SBATCH --mem=" << o.mem << "\n";
  if (!o.dependency.empty()) s << "#SBATCH --dependency=" << o.dependency << "\n";
  for (const auto& a : o.sbatch_args) s << "#SBATCH " << a << "\n";
  if (o.nproc > 1) {
    // slurm-task runs the trainer through srun: ranks from SLURM_PROCID/SLURM_NTASKS, the
    // GPU from SLURM_LOCALID, USR2/TERM forwarded to every rank by srun. A dead rank makes
    // the others fail within LAR_DIST_TIMEOUT with the cause recorded (no --kill-on-bad-exit:
    // they must live to record it). NVLink multicast stays off.
    s << "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1\n"
      << "export LAR_TRAINER_CMD=\"$(command -v srun) --ntasks=" << o.nproc
      << " --gpus-per-task=1 --cpu-bind=none " << o.lar_binary << " train\"\n";
  }
  s << "exec " << o.lar_binary << " slurm-task --manifest " << manifest << " --offset " << offset
    << " --max-timeout-requeues " << o.max_timeout_requeues << "\n";
  return s.str();
}

std::string render_then_script(const std::string& experiment, const std::string& launch_dir,
                               const std::vector<std::string>& after_ok, const SlurmOptions& o) {
  std::ostringstream s;
  std::string ids;
  for (const auto& id : after_ok) ids += ":" + id;
  s << "#!/bin/bash\n"
    << "# lar: follow-up step of experiment " << experiment << ".\n";
  if (after_ok.empty()) {
    s << "# Nothing needed training: it runs right away.\n";
  } else {
    s << "# Starts once every task of the training array(s) of this launch completed (afterok).\n"
      << "# If one fails, times out or is cancelled, Slurm never starts it: squeue shows it\n"
      << "# PENDING with reason DependencyNeverSatisfied (so does `lar status`).\n";
  }
  s << "#SBATCH --job-name=lar-" << experiment << "-then\n"
    << "#SBATCH --output=" << launch_dir << "/then.out\n";
  if (!after_ok.empty()) s << "#SBATCH --dependency=afterok" << ids << "\n";
  if (!o.partition.empty()) s << "#SBATCH --partition=" << o.partition << "\n";
  for (const auto& a : o.sbatch_args) s << "#SBATCH " << a << "\n";
  s << "set -eo pipefail\n"
    << "# The launch's runs and registry, and the launching lar first on PATH.\n"
    << "export LAR_HOME=" << shell_quote(clean_absolute(lar_home())) << "\n"
    << "export LAR_DB=" << shell_quote(clean_absolute(default_db_path())) << "\n"
    << "export PATH=" << shell_quote(fs::path(o.lar_binary).parent_path().string()) << ":\"$PATH\"\n"
    << o.then_cmd << (o.then_cmd.ends_with("\n") ? "" : "\n");
  return s.str();
}

SlurmExecutor::SlurmExecutor(std::string experiment, SlurmOptions opts)
    : experiment_(std::move(experiment)), opts_(std::move(opts)) {
  if (opts_.lar_binary.empty()) opts_.lar_binary = this_executable();
  if (opts_.nproc == 0)
    opts_.nproc = static_cast<int>(env_int("LAR_SLURM_NPROC", 0, 1, 4096));
}

void SlurmExecutor::submit(const std::vector<Job>& jobs) {
  if (jobs.empty() && opts_.then_cmd.empty()) return;
  cancel_stale_followups();
  fs::path dir = fs::absolute(runs_root() / experiment_ / "slurm" / launch_id());
  fs::create_directories(dir / "logs");
  std::string manifest;
  for (const auto& j : jobs) manifest += j.cell_id + "\t" + fs::absolute(j.run_dir).string() + "\n";
  atomic_write(dir / "manifest.tsv", manifest);

  int chunk = jobs.empty() ? 1 : opts_.max_array_size > 0 ? opts_.max_array_size : query_max_array_size();
  json ids = json::array();
  json arrays = json::array();
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
    arrays.push_back({{"job", id}, {"offset", offset}, {"count", count}});
    for (int i = 0; i < count; ++i) {
      Task t;
      t.job = jobs[offset + i];
      t.slurm_id = id + "_" + std::to_string(i);
      live_[t.slurm_id] = t;
    }
  }
  json record = {{"experiment", experiment_}, {"job_ids", ids}, {"arrays", arrays}};
  atomic_write(dir / "jobs.json", record.dump(2) + "\n");

  if (!opts_.then_cmd.empty()) {
    FollowUp f;
    f.script = (dir / "then.sbatch").string();
    f.output = (dir / "then.out").string();
    atomic_write(f.script, render_then_script(experiment_, dir.string(), job_ids_, opts_));
    CommandResult r = run_command({"sbatch", "--parsable", f.script});
    ++sbatch_calls_;
    if (r.exit_code != 0) {
      // No half-submitted launch: the arrays would train with nobody to run the step.
      std::vector<std::string> cancel = {"scancel"};
      cancel.insert(cancel.end(), job_ids_.begin(), job_ids_.end());
      if (!job_ids_.empty()) run_command(cancel);
      throw RuntimeError("sbatch " + f.script + " failed: " + trim(r.out) +
                         (job_ids_.empty() ? "" : " (the training array(s) were cancelled again)"));
    }
    f.job_id = split(trim(split(trim(r.out), ';').front()), '\n').back();
    f.state = "PENDING";
    record["then_job"] = f.job_id;
    atomic_write(dir / "jobs.json", record.dump(2) + "\n");
    notes_.push_back("follow-up job " + f.job_id + " submitted" +
                     (job_ids_.empty() ? "" : " (afterok on array job(s) " + join_ids(job_ids_) + ")") + ": " + f.script);
    then_ = f;
  }
}

// Follow-ups of earlier launches that can never run (a task of theirs failed): this
// launch submits its own, so they would only linger in the queue.
void SlurmExecutor::cancel_stale_followups() {
  std::vector<std::string> ids;
  for (const auto& l : read_slurm_launches(experiment_))
    if (!l.then_job.empty()) ids.push_back(l.then_job);
  auto queue = query_queue(ids);
  if (!queue) return;
  for (const auto& [id, j] : *queue) {
    if (j.reason != "DependencyNeverSatisfied") continue;
    run_command({"scancel", id});
    notes_.push_back("cancelled follow-up job " + id + " of an earlier launch (its dependency could never be satisfied)");
  }
}

void SlurmExecutor::refresh_followup(PollResult& out) {
  if (!then_ || then_->done) return;
  // Every poll while the arrays are done; otherwise now and then (it cannot start earlier).
  auto now = std::chrono::steady_clock::now();
  if (!live_.empty() && now < next_followup_check_) return;
  next_followup_check_ = now + std::chrono::seconds(10);
  FollowUp& f = *then_;
  auto queue = query_queue({f.job_id});
  if (!queue) return;
  if (auto it = queue->find(f.job_id); it != queue->end()) {
    bool changed = it->second.state != f.state;
    f.state = it->second.state;
    f.reason = it->second.reason;
    if (f.reason == "DependencyNeverSatisfied") {
      f.done = true;
      out.notes.push_back("follow-up job " + f.job_id +
                          " will never run: a training task did not complete (DependencyNeverSatisfied); it stays "
                          "queued so that `lar status` shows it: scancel " + f.job_id + ", or relaunch to retry");
    } else if (changed && f.state == "RUNNING") {
      out.notes.push_back("follow-up job " + f.job_id + " running; output: " + f.output);
    }
    return;
  }
  std::string state = scontrol_job_state(f.job_id);
  if (state.empty()) state = "UNKNOWN";  // purged already (MinJobAge)
  else if (!map_slurm_state(state).terminal) return;  // between two squeue views
  f.state = state;
  f.reason.clear();
  f.done = true;
  out.notes.push_back("follow-up job " + f.job_id + " " + state + "; output: " + f.output);
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
    // settle_after_exit honours the marker unless the trainer had already finished; a
    // marker from `lar cancel` carries who cancelled it, so keep that one.
    if (!cancel_requested(t.job.run_dir)) atomic_write(cancel_marker_path(t.job.run_dir), m.reason + "\n");
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
  auto queue = query_queue(std::vector<std::string>(arrays.begin(), arrays.end()));
  if (!queue) return;  // controller busy or restarting: try again next poll
  std::map<std::string, std::map<std::string, std::string>> left;  // array → task → final state
  for (auto it = live_.begin(); it != live_.end();) {
    Task& t = it->second;
    auto s = queue->find(t.slurm_id);
    std::string state = s != queue->end() ? s->second.state : "";
    if (state.empty()) {
      // Left the queue: its final state from scontrol (kept MinJobAge seconds). Slurm
      // forgets a pending array task that was cancelled at once: no start → cancelled.
      std::string array = split(t.slurm_id, '_').front();
      if (!left.count(array)) left[array] = scontrol_array_states(array);
      auto known = left[array].find(t.slurm_id);
      std::string final_state = known != left[array].end() ? known->second : "";
      if (final_state.empty()) {
        auto st = RunDir(t.job.run_dir).read_status();
        if (st && st->state == RunState::completed) final_state = "COMPLETED";
        else if (!last_event(t.job.run_dir, "start")) final_state = "CANCELLED";
        else final_state = "FAILED";
      }
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
      std::string node = s != queue->end() ? s->second.node : "";
      out.started.push_back({t.job, std::stol(split(t.slurm_id, '_').front()), "slurm " + t.slurm_id + " on " + node,
                             t.started_at});
    }
    ++it;
  }
}

PollResult SlurmExecutor::poll(std::chrono::milliseconds wait) {
  PollResult out;
  auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    for (auto& n : notes_) out.notes.push_back(std::move(n));
    notes_.clear();
    refresh(out);
    refresh_followup(out);
    if (!out.empty() || idle() || std::chrono::steady_clock::now() >= deadline) return out;
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
        std::chrono::milliseconds(1000),
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now())));
  }
}

void SlurmExecutor::stop(bool force) {
  if (job_ids_.empty() && (!then_ || then_->done)) return;
  std::vector<std::string> cmd = {"scancel"};
  if (force) cmd.push_back("--signal=KILL");
  for (const auto& id : job_ids_) cmd.push_back(id);
  if (then_ && !then_->done) cmd.push_back(then_->job_id);
  for (auto& [id, t] : live_) t.stop_requested = true;
  run_command(cmd);
}

}  // namespace lar::runner
