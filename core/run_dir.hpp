#pragma once
// The run-directory protocol: the one contract between the runner (who creates a run
// directory and starts `lar train --run-dir D`), the trainer (who writes it) and the
// registry (who ingests it). The directory is the source of truth; it survives crashes,
// requeues and lost databases. See docs/protocol.md.
//
//   D/config.json     {"experiment", "cell_id", "hash", "axes", "role", "config"} — runner
//   D/status.json     RunStatus, rewritten atomically on every transition       — trainer
//   D/metrics.jsonl   one JSON object per line: {"step", "tokens", "wall_time", name: value…}
//                     appended and flushed line by line; a torn last line is skipped by
//                     readers until it is complete                              — trainer
//   D/checkpoints/    step_XXXXXXXX.ckpt, written atomically, last K kept          — trainer
//   D/log.txt         the human log                                              — trainer
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/json.hpp"

namespace lar {

// Run states. `pending` is a run directory the runner created but no trainer has opened.
enum class RunState { pending, running, completed, failed, diverged, preempted, cancelled, timeout };
std::string to_string(RunState s);
std::optional<RunState> run_state_from_string(const std::string& s);
bool is_terminal(RunState s);  // completed, failed, diverged, cancelled
// "<cell>.old-<n>": a run folder the runner moved aside when its cell's config changed. It
// keeps its config.json (same cell_id), so readers that key runs by cell skip it.
bool is_moved_aside(const std::string& folder_name);

struct StatusEvent {
  RunState state = RunState::pending;
  double at = 0;          // unix seconds
  long step = 0;
  std::string reason;
  int attempt = 0;
};

struct RunStatus {
  RunState state = RunState::pending;
  long step = 0;               // last completed optimiser step
  long total_steps = 0;        // planned
  std::string reason;          // why it failed / diverged / was preempted
  int attempt = 0;             // 1 for the first start, +1 per restart/resume
  double started_at = 0;       // of this attempt
  double updated_at = 0;
  std::string host;
  long pid = 0;
  json summary = json::object();  // final scalars: final_loss, saturation_loss, tokens_per_s, params…
  std::vector<StatusEvent> history;

  json to_json() const;
  static RunStatus from_json(const json& j);
};

class RunDir {
 public:
  explicit RunDir(std::filesystem::path root) : root_(std::move(root)) {}
  const std::filesystem::path& root() const { return root_; }
  std::filesystem::path config_path() const { return root_ / "config.json"; }
  std::filesystem::path status_path() const { return root_ / "status.json"; }
  std::filesystem::path metrics_path() const { return root_ / "metrics.jsonl"; }
  std::filesystem::path checkpoints_dir() const { return root_ / "checkpoints"; }
  std::filesystem::path log_path() const { return root_ / "log.txt"; }

  bool exists() const;
  json read_config() const;                   // throws RuntimeError when absent or bad
  void write_config(const json& j) const;     // atomic
  std::optional<RunStatus> read_status() const;  // nullopt when absent
  void write_status(const RunStatus& s) const;   // atomic

  // Record a transition: updates state/step/reason, appends to history, writes atomically.
  void transition(RunStatus& s, RunState to, const std::string& reason = "") const;

 private:
  std::filesystem::path root_;
};

// Appends metric lines; each line is written with one write() call and flushed, so a
// crash leaves at most one torn final line.
class MetricsWriter {
 public:
  explicit MetricsWriter(const std::filesystem::path& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void append(const json& line);
  // Truncate the file to the lines with step <= `step` (used on resume, so that steps
  // replayed after a checkpoint are not recorded twice).
  static void truncate_after(const std::filesystem::path& path, long step);

 private:
  int fd_ = -1;
};

// Reads complete lines starting at byte `offset`; returns the parsed objects and the
// offset just past the last complete, valid line (incremental ingest resumes there).
struct MetricsChunk {
  std::vector<json> lines;
  uint64_t next_offset = 0;
  int skipped_bad_lines = 0;
};
MetricsChunk read_metrics(const std::filesystem::path& path, uint64_t offset = 0);

double unix_now();

}  // namespace lar
