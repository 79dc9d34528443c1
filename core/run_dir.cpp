#include "core/run_dir.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <fstream>

#include "core/error.hpp"
#include "core/fs.hpp"

namespace lar {

static const char* kStateNames[] = {"pending", "running", "completed", "failed",
                                    "diverged", "preempted", "cancelled", "timeout"};

std::string to_string(RunState s) { return kStateNames[static_cast<int>(s)]; }

std::optional<RunState> run_state_from_string(const std::string& s) {
  for (int i = 0; i < 8; ++i)
    if (s == kStateNames[i]) return static_cast<RunState>(i);
  return std::nullopt;
}

bool is_terminal(RunState s) {
  return s == RunState::completed || s == RunState::failed || s == RunState::diverged ||
         s == RunState::cancelled;
}

bool is_moved_aside(const std::string& name) {
  const auto pos = name.rfind(".old-");
  return pos != std::string::npos && pos + 5 < name.size() &&
         std::all_of(name.begin() + static_cast<long>(pos) + 5, name.end(), [](unsigned char c) { return std::isdigit(c); });
}

double unix_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

json RunStatus::to_json() const {
  json hist = json::array();
  for (const auto& e : history)
    hist.push_back({{"state", to_string(e.state)}, {"at", e.at}, {"step", e.step},
                    {"reason", e.reason}, {"attempt", e.attempt}});
  return {{"state", to_string(state)}, {"step", step}, {"total_steps", total_steps},
          {"reason", reason}, {"attempt", attempt}, {"started_at", started_at},
          {"updated_at", updated_at}, {"host", host}, {"pid", pid},
          {"summary", summary}, {"history", hist}};
}

static RunState state_of(const json& j, const char* key) {
  auto s = run_state_from_string(j.value(key, std::string("pending")));
  if (!s) throw RuntimeError("unknown run state '" + j.value(key, std::string()) + "'");
  return *s;
}

RunStatus RunStatus::from_json(const json& j) {
  RunStatus s;
  s.state = state_of(j, "state");
  s.step = j.value("step", 0L);
  s.total_steps = j.value("total_steps", 0L);
  s.reason = j.value("reason", std::string());
  s.attempt = j.value("attempt", 0);
  s.started_at = j.value("started_at", 0.0);
  s.updated_at = j.value("updated_at", 0.0);
  s.host = j.value("host", std::string());
  s.pid = j.value("pid", 0L);
  if (j.contains("summary") && j["summary"].is_object()) s.summary = j["summary"];
  if (j.contains("history"))
    for (const auto& e : j["history"]) {
      StatusEvent ev;
      ev.state = state_of(e, "state");
      ev.at = e.value("at", 0.0);
      ev.step = e.value("step", 0L);
      ev.reason = e.value("reason", std::string());
      ev.attempt = e.value("attempt", 0);
      s.history.push_back(ev);
    }
  return s;
}

bool RunDir::exists() const { return std::filesystem::exists(config_path()); }

json RunDir::read_config() const {
  std::string text = read_file(config_path());
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw RuntimeError(config_path().string() + ": invalid JSON: " + e.what());
  }
}

void RunDir::write_config(const json& j) const { atomic_write(config_path(), j.dump(2) + "\n"); }

std::optional<RunStatus> RunDir::read_status() const {
  if (!std::filesystem::exists(status_path())) return std::nullopt;
  try {
    return RunStatus::from_json(json::parse(read_file(status_path())));
  } catch (const json::exception& e) {
    throw RuntimeError(status_path().string() + ": invalid JSON: " + e.what());
  }
}

void RunDir::write_status(const RunStatus& s) const {
  atomic_write(status_path(), s.to_json().dump(2) + "\n");
}

void RunDir::transition(RunStatus& s, RunState to, const std::string& reason) const {
  s.state = to;
  s.reason = reason;
  s.updated_at = unix_now();
  s.history.push_back({to, s.updated_at, s.step, reason, s.attempt});
  write_status(s);
}

MetricsWriter::MetricsWriter(const std::filesystem::path& path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) throw RuntimeError("cannot open " + path.string() + " for appending");
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::append(const json& line) {
  std::string s = line.dump() + "\n";
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(fd_, s.data() + off, s.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw RuntimeError("cannot append a metrics line");
    }
    off += static_cast<size_t>(n);
  }
}

void MetricsWriter::truncate_after(const std::filesystem::path& path, long step) {
  if (!std::filesystem::exists(path)) return;
  MetricsChunk all = read_metrics(path, 0);
  std::string kept;
  for (const auto& l : all.lines)
    if (l.value("step", 0L) <= step) kept += l.dump() + "\n";
  atomic_write(path, kept);
}

MetricsChunk read_metrics(const std::filesystem::path& path, uint64_t offset) {
  MetricsChunk out;
  out.next_offset = offset;
  std::ifstream in(path, std::ios::binary);
  if (!in) return out;
  in.seekg(static_cast<std::streamoff>(offset));
  std::string line;
  uint64_t pos = offset;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // no trailing newline: a torn line, picked up next time
    pos += line.size() + 1;
    if (line.empty()) {
      out.next_offset = pos;
      continue;
    }
    try {
      out.lines.push_back(json::parse(line));
    } catch (const json::exception&) {
      ++out.skipped_bad_lines;  // a complete but corrupt line can never become valid
    }
    out.next_offset = pos;
  }
  return out;
}

}  // namespace lar
