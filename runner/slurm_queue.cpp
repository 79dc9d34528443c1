#include "runner/slurm_queue.hpp"

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "core/fs.hpp"
#include "core/json.hpp"
#include "runner/run_dirs.hpp"
#include "runner/slurm_executor.hpp"

namespace lar::runner {

namespace fs = std::filesystem;

namespace {

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

}  // namespace

std::string SlurmLaunchRecord::task_id(size_t line) const {
  for (const auto& a : arrays)
    if (static_cast<int>(line) >= a.offset && static_cast<int>(line) < a.offset + a.count)
      return a.job_id + "_" + std::to_string(static_cast<int>(line) - a.offset);
  return "";
}

std::vector<SlurmLaunchRecord> read_slurm_launches(const std::string& experiment) {
  std::vector<SlurmLaunchRecord> out;
  fs::path root = experiment_dir(experiment) / "slurm";
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.is_directory() && fs::exists(e.path() / "jobs.json")) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  for (const auto& d : dirs) {
    SlurmLaunchRecord r;
    r.dir = d;
    json doc;
    try {
      doc = json::parse(read_file(d / "jobs.json"));
    } catch (const std::exception&) {
      continue;  // being written right now (atomic_write makes this rare), or damaged
    }
    std::ifstream in(d / "manifest.tsv");
    for (std::string line; std::getline(in, line);) {
      auto tab = line.find('\t');
      if (tab != std::string::npos) r.manifest.emplace_back(line.substr(0, tab), fs::path(line.substr(tab + 1)));
    }
    if (doc.contains("arrays")) {
      for (const auto& a : doc["arrays"])
        r.arrays.push_back({a.value("job", ""), a.value("offset", 0), a.value("count", 0)});
    } else if (doc.contains("job_ids") && doc["job_ids"].size() == 1) {
      // Records written before arrays were listed: one array covers the whole manifest.
      r.arrays.push_back({doc["job_ids"][0].get<std::string>(), 0, static_cast<int>(r.manifest.size())});
    }
    r.then_job = doc.value("then_job", "");
    out.push_back(std::move(r));
  }
  return out;
}

std::optional<std::map<std::string, QueuedJob>> query_queue(const std::vector<std::string>& job_ids) {
  std::map<std::string, QueuedJob> out;
  if (job_ids.empty()) return out;
  std::string list;
  for (const auto& id : job_ids) list += (list.empty() ? "" : ",") + id;
  CommandResult r = run_command({"squeue", "-h", "-r", "-j", list, "-o", "%i|%T|%r|%N"});
  if (r.exit_code != 0) {
    // Every id already purged from slurmctld (MinJobAge): nothing is queued.
    if (r.out.find("Invalid job id") != std::string::npos) return out;
    return std::nullopt;
  }
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> f;
    std::istringstream fields(trim(line));
    for (std::string part; std::getline(fields, part, '|');) f.push_back(part);
    if (f.size() < 2) continue;
    QueuedJob j{f[0], f[1], f.size() > 2 ? f[2] : "", f.size() > 3 ? f[3] : ""};
    if (j.reason == "None") j.reason.clear();
    out[j.id] = j;
  }
  return out;
}

std::string explain_slurm_reason(const std::string& r) {
  if (r.empty()) return "";
  if (r == "DependencyNeverSatisfied")
    return "DependencyNeverSatisfied: a training task did not complete, so it will never run";
  if (r == "Dependency") return "Dependency: waits for the training array(s) to complete";
  if (r == "JobArrayTaskLimit") return "JobArrayTaskLimit: the array's throttle (%K)";
  if (r == "Resources") return "Resources: waiting for free nodes/GPUs";
  if (r == "Priority") return "Priority: other jobs go first";
  if (r == "BeginTime") return "BeginTime: requeued, eligible again shortly";
  if (r == "JobHeldUser" || r == "JobHeldAdmin") return r + ": held (scontrol release)";
  return r;
}

SlurmView read_slurm_view(const std::string& experiment) {
  SlurmView v;
  auto launches = read_slurm_launches(experiment);
  if (launches.empty()) return v;
  v.used = true;
  std::vector<std::string> ids;
  for (const auto& l : launches) {
    for (const auto& a : l.arrays) ids.push_back(a.job_id);
    if (!l.then_job.empty()) ids.push_back(l.then_job);
  }
  auto queue = query_queue(ids);
  if (!queue) return v;
  v.available = true;
  std::map<std::string, SlurmView::Task> by_cell;  // a later launch supersedes an earlier one
  for (const auto& l : launches) {
    for (size_t i = 0; i < l.manifest.size(); ++i) {
      auto it = queue->find(l.task_id(i));
      if (it != queue->end()) by_cell[l.manifest[i].first] = {l.manifest[i].first, l.manifest[i].second, it->second};
    }
    if (!l.then_job.empty())
      if (auto it = queue->find(l.then_job); it != queue->end()) v.followups.push_back(it->second);
  }
  for (auto& [id, t] : by_cell) v.tasks.push_back(std::move(t));
  return v;
}

std::vector<std::string> render_slurm_view(const SlurmView& v) {
  std::vector<std::string> out;
  if (!v.used) return out;
  if (!v.available) {
    out.push_back("  slurm: squeue did not answer; the states above come from the run directories");
    return out;
  }
  if (!v.tasks.empty()) {
    int running = 0;
    std::string where;                   // "s0 = 240_0 on n1, …" for the first few
    std::map<std::string, int> pending;  // reason → tasks
    std::set<std::string> arrays;
    for (const auto& t : v.tasks) {
      arrays.insert(t.job.id.substr(0, t.job.id.find('_')));
      if (t.job.state == "PENDING" || t.job.state == "REQUEUED") {
        ++pending[t.job.reason];
        continue;
      }
      if (++running <= 3)
        where += (where.empty() ? "" : ", ") + t.cell_id + " = " + t.job.id + (t.job.node.empty() ? "" : " on " + t.job.node);
      else if (running == 4)
        where += ", …";
    }
    std::string line = "  slurm: " + std::to_string(running) + " task(s) running" + (where.empty() ? "" : " (" + where + ")");
    for (const auto& [reason, n] : pending)
      line += ", " + std::to_string(n) + " pending" + (reason.empty() ? "" : " (" + explain_slurm_reason(reason) + ")");
    line += "; array job(s)";
    for (const auto& a : arrays) line += " " + a;
    out.push_back(line);
  }
  for (const auto& f : v.followups) {
    std::string line = "  slurm: follow-up job " + f.id + " " + f.state;
    if (!f.reason.empty()) line += " — " + explain_slurm_reason(f.reason);
    if (f.reason == "DependencyNeverSatisfied") line += " (scancel " + f.id + ", or relaunch to retry)";
    out.push_back(line);
  }
  return out;
}

}  // namespace lar::runner
