#include "runner/progress.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "core/error.hpp"
#include "core/paths.hpp"
#include "runner/run_dirs.hpp"

namespace lar::runner {

namespace fs = std::filesystem;

// Complete lines of the last `bytes` of a file (a partial first line and a torn last
// line are dropped).
static std::vector<json> tail_lines(const fs::path& path, std::uintmax_t bytes) {
  std::vector<json> out;
  std::error_code ec;
  auto size = fs::file_size(path, ec);
  if (ec || size == 0) return out;
  std::ifstream in(path, std::ios::binary);
  std::uintmax_t from = size > bytes ? size - bytes : 0;
  in.seekg(static_cast<std::streamoff>(from));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t start = 0;
  if (from > 0) {
    size_t nl = text.find('\n');
    if (nl == std::string::npos) return out;
    start = nl + 1;
  }
  while (start < text.size()) {
    size_t nl = text.find('\n', start);
    if (nl == std::string::npos) break;  // torn last line
    try {
      out.push_back(json::parse(text.substr(start, nl - start)));
    } catch (const json::exception&) {
    }
    start = nl + 1;
  }
  return out;
}

CellProgress read_cell_progress(const fs::path& run_dir) {
  CellProgress c;
  c.run_dir = run_dir;
  c.cell_id = run_dir.filename().string();
  c.experiment = run_dir.parent_path().filename().string();
  RunDir rd(run_dir);
  try {
    json cfg = rd.read_config();
    c.cell_id = cfg.value("cell_id", c.cell_id);
    c.experiment = cfg.value("experiment", c.experiment);
    if (cfg.contains("config") && cfg["config"].contains("budget"))
      c.total_steps = cfg["config"]["budget"].value("steps", 0L);
  } catch (const std::exception&) {
  }
  std::optional<RunStatus> s;
  try {
    s = rd.read_status();
  } catch (const RuntimeError&) {
  }
  if (s) {
    c.state = s->state;
    c.step = s->step;
    if (s->total_steps > 0) c.total_steps = s->total_steps;
    c.attempt = s->attempt;
    c.reason = s->reason;
    c.host = s->host;
    c.pid = s->pid;
    c.stale = s->state == RunState::running && s->host == this_host() && !process_alive(s->pid);
  }

  // Last loss and the recent rate, from the train lines (those carrying "loss").
  std::vector<json> lines = tail_lines(rd.metrics_path(), 64 * 1024);
  const json* last = nullptr;
  const json* first = nullptr;
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    if (!it->contains("loss") || !(*it)["loss"].is_number()) continue;
    if (!last) last = &*it;
    // Stop at an attempt boundary: steps must increase along with wall time.
    if (first && (it->value("step", 0L) >= first->value("step", 0L))) break;
    first = &*it;
  }
  if (last) {
    c.loss = (*last)["loss"].get<double>();
    if (first && first != last) {
      double dt = last->value("wall_time", 0.0) - first->value("wall_time", 0.0);
      long ds = last->value("step", 0L) - first->value("step", 0L);
      if (dt > 0 && ds > 0) c.steps_per_s = ds / dt;
    }
  }
  if (c.state == RunState::running && !c.stale && c.steps_per_s && c.total_steps > c.step)
    c.eta_s = (c.total_steps - c.step) / *c.steps_per_s;
  return c;
}

bool ExperimentProgress::active() const { return counts.running > 0 || launch_pid.has_value(); }

ExperimentProgress read_experiment_progress(const std::string& experiment) {
  ExperimentProgress p;
  p.experiment = experiment;
  fs::path dir = experiment_dir(experiment);
  if (!fs::is_directory(dir)) {
    auto known = list_experiments();
    std::string hint = did_you_mean(experiment, known);
    throw UserError("no runs of experiment '" + experiment + "' under " + runs_root().string() +
                    (hint.empty() ? "" : " (" + hint + ")"));
  }
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    if (!e.is_directory() || name.starts_with(".") || is_moved_aside(name)) continue;
    if (!fs::exists(e.path() / "config.json")) continue;
    p.cells.push_back(read_cell_progress(e.path()));
  }
  std::sort(p.cells.begin(), p.cells.end(), [](const auto& a, const auto& b) { return a.cell_id < b.cell_id; });
  p.launch_pid = active_launch_pid(experiment);

  double rate = 0, remaining = 0;
  for (const auto& c : p.cells) {
    Counts& n = p.counts;
    ++n.total;
    switch (c.state) {
      case RunState::completed: ++n.completed; break;
      case RunState::running:
        if (c.stale) ++n.stopped; else ++n.running;
        break;
      case RunState::failed: ++n.failed; break;
      case RunState::diverged: ++n.diverged; break;
      case RunState::pending: ++n.pending; break;
      default: ++n.stopped; break;  // preempted, timeout, cancelled
    }
    bool unfinished = c.state != RunState::completed && c.state != RunState::failed &&
                      c.state != RunState::diverged && c.state != RunState::cancelled;
    if (unfinished) remaining += std::max(0L, c.total_steps - c.step);
    if (c.state == RunState::running && !c.stale && c.steps_per_s) rate += *c.steps_per_s;
  }
  if (rate > 0 && p.counts.running > 0) p.eta_s = remaining / rate;
  return p;
}

std::vector<std::string> list_experiments() {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(runs_root(), ec))
    if (e.is_directory() && !e.path().filename().string().starts_with("."))
      out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  long t = std::lround(s);
  char buf[32];
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t % 3600) / 60);
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else std::snprintf(buf, sizeof buf, "%lds", t);
  return buf;
}

std::vector<std::string> render_progress(const ExperimentProgress& p) {
  std::vector<std::string> out;
  const Counts& n = p.counts;
  std::string head = p.experiment + ": " + std::to_string(n.total) + " cells — " +
                     std::to_string(n.completed) + " done, " + std::to_string(n.running) +
                     " running, " + std::to_string(n.failed) + " failed, ";
  if (n.diverged) head += std::to_string(n.diverged) + " diverged, ";
  head += std::to_string(n.stopped) + " stopped, " + std::to_string(n.pending) + " pending";
  if (p.eta_s) head += "; ETA " + format_duration(*p.eta_s);
  if (p.launch_pid) head += " [lar launch pid " + std::to_string(*p.launch_pid) + "]";
  out.push_back(head);

  size_t w = 0;
  for (const auto& c : p.cells) w = std::max(w, c.cell_id.size());
  for (const auto& c : p.cells) {
    if (c.state == RunState::completed || c.state == RunState::pending) continue;
    std::string state = c.stale ? "dead" : to_string(c.state);
    char buf[512];
    std::snprintf(buf, sizeof buf, "  %-9s %-*s step %6ld/%-6ld", state.c_str(), static_cast<int>(w),
                  c.cell_id.c_str(), c.step, c.total_steps);
    std::string line = buf;
    if (c.loss) {
      std::snprintf(buf, sizeof buf, "  loss %.4f", *c.loss);
      line += buf;
    }
    if (c.state == RunState::running && !c.stale) {
      if (c.steps_per_s) {
        std::snprintf(buf, sizeof buf, "  %.2f step/s", *c.steps_per_s);
        line += buf;
      }
      if (c.eta_s) line += "  ETA " + format_duration(*c.eta_s);
      if (c.attempt > 1) line += "  attempt " + std::to_string(c.attempt);
    } else if (c.stale) {
      line += "  (pid " + std::to_string(c.pid) + " is gone; `lar launch` resumes it)";
    } else if (!c.reason.empty()) {
      line += "  " + c.reason;
    }
    out.push_back(line);
  }
  return out;
}

}  // namespace lar::runner
